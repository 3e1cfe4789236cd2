"""Linear attention / fast weights / Hebbian memory, written as the plain per-token loop.

Spec: ``spec/feature-maps-phi.md`` (HOPE Eq 5) and ``spec/linear-attention-feature-maps.md``.
k and q already are φ(k_t), φ(q_t). Per head, with M [Dv, Dk] and z [Dk]::

    causal:      M_t = α_t M_{t−1} + v_t k_tᵀ          y_t = M_t q_t
                 normalize: z_t = α_t z_{t−1} + k_t,  y_t = M_t q_t / (z_t · q_t + eps)
    non-causal:  y_t = (Σ_s v_s k_sᵀ) q_t  = φ(Q) (φ(K)ᵀ V)   (/ (q_t · Σ_s k_s + eps))

α_t is a keep factor (None: 1, no decay). Returns y, the final M and the final z
(zeros when not normalising). Non-causal: M and z are the full sums.
"""

from __future__ import annotations

from typing import Optional

import torch


def linear_attention_naive(k: torch.Tensor, v: torch.Tensor, q: torch.Tensor, alpha: Optional[torch.Tensor] = None,
                           m0: Optional[torch.Tensor] = None, z0: Optional[torch.Tensor] = None,
                           normalize: bool = False, eps: float = 1e-6, causal: bool = True):
    B, T, H, Dk = k.shape
    Dv = v.shape[-1]
    dtype = torch.promote_types(k.dtype, torch.float32)
    kf, vf, qf = k.to(dtype), v.to(dtype), q.to(dtype)
    if not causal:
        M = torch.einsum("bthv,bthk->bhvk", vf, kf)
        z = kf.sum(1)
        y = torch.einsum("bhvk,bthk->bthv", M, qf)
        if normalize:
            y = y / (torch.einsum("bthk,bhk->bth", qf, z).unsqueeze(-1) + eps)
        return y.to(v.dtype), M, z if normalize else torch.zeros_like(z)
    M = m0.to(dtype) if m0 is not None else k.new_zeros(B, H, Dv, Dk, dtype=dtype)
    z = z0.to(dtype) if z0 is not None else k.new_zeros(B, H, Dk, dtype=dtype)
    ys = []
    for t in range(T):
        a_t = alpha[:, t].to(dtype) if alpha is not None else torch.ones(B, H, dtype=dtype)
        M = a_t[..., None, None] * M + vf[:, t, :, :, None] * kf[:, t, :, None, :]
        y_t = torch.einsum("bhvk,bhk->bhv", M, qf[:, t])
        if normalize:
            z = a_t[..., None] * z + kf[:, t]
            y_t = y_t / ((z * qf[:, t]).sum(-1, keepdim=True) + eps)
        ys.append(y_t)
    y = torch.stack(ys, 1) if ys else v.new_zeros(B, 0, H, Dv, dtype=dtype)
    return y.to(v.dtype), M, z if normalize else torch.zeros_like(z)
