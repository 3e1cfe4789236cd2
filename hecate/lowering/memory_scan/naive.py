"""The l_p associative-memory recurrence, written as the plain per-token loop.

Spec: ``spec/lp-attentional-bias.md`` (MIRAS Eqs 10-12, Remark 5, MONETA Eqs 24-25)
and ``spec/feature-maps-phi.md`` (HOPE Eq 5: φ is applied to keys and queries
*before* this op, so here ``k`` and ``q`` already are φ(k_t), φ(q_t)).

Per head, with memory M [Dv, Dk] and token t (the read comes after the update)::

    e_t = W_{t-1} k_t − v_t                                   (prediction error)
          or (1 − α_t) W_{t-1} k_t − v_t with ``decay_first``  (the error read from the decayed memory,
                                                                 Gated DeltaNet's order)
    g_t = bias_grad_p(e_t)                                    (MIRAS Eq 11, Remark 5)
          p = 2 : 2 e                  p = 1 : tanh(a e)
          else  : p · tanh(a e) · (e² + eps)^((p−1)/2)
          or any pointwise g the user wrote (``bias``: a Huber gradient, |e|^(p−1)·sign(e), ...)
    U_t = g_t k_tᵀ                                            (gradient of ‖W k − v‖_p^p)
    plain     : A_t = (1 − α_t) A_{t−1} − η_t U_t
    momentum β: S_t = β_t S_{t−1} − η_t U_t ;  A_t = (1 − α_t) A_{t−1} + S_t
                (β_t = momentum, or momentum · beta_t with a per-step ``beta`` [B, T, H]: HOPE Eq 51's α_{i+1})
    W_t = A_t                             (q_norm = 2)
    W_t = A_t / ‖A_t‖_q^{q−2}             (MONETA L_q retention, q_norm = q ≠ 2),
          computed as A_t · (Σ|A_t|^q + eps)^{−(q−2)/q}   (eps keeps A = 0 finite)
    y_t = W_t q_t

The state the op takes (``m0``) and returns (``m_final``) is A: the memory M
itself when q_norm = 2, the un-normalised accumulator of MONETA otherwise. With
momentum the op also takes the momentum buffer S (``s0``, zeros when absent) and
returns its final value (``s_final``), so processing a sequence in chunks, each
starting from the previous chunk's (m_final, s_final), equals processing it whole.
Without momentum there is no buffer: ``s0`` must be None and ``s_final`` is empty.

Choices where the spec is ambiguous (documented here and in the report):
* MONETA retention: the spec writes ``A = alpha * A − eta * grad`` with alpha a
  retention *keep* factor; this op keeps the convention of every other variant,
  ``A ← (1 − α_t) A − η_t grad`` (α_t is the forget rate), so the same gates drive
  all variants.
* HOPE Eq 51's higher-order momentum applies φ to the gradient. Inside this op the
  gradient feature map is the identity (P_i = identity, φ = identity); the
  momentum decay of Eq 51, α_{i+1}, is ``momentum`` times the per-step ``beta`` when one is given (a
  data-dependent or learned decay), else the fixed ``momentum``.
"""

from __future__ import annotations

from typing import Optional

import torch

from hecate.lowering import pointwise


def bias_grad(e: torch.Tensor, p: float, a: float, eps: float, bias: str = "") -> torch.Tensor:
    """∂/∂e of the smoothed ‖e‖_p^p (spec fast paths for p = 2 and p = 1), or the user's pointwise g
    (``bias``, an expression of :mod:`hecate.lowering.pointwise`; p, a, eps then unused)."""
    if bias:
        return pointwise.evaluate(bias, e)
    if p == 2.0:
        return 2.0 * e
    if p == 1.0:
        return torch.tanh(a * e)
    return p * torch.tanh(a * e) * (e * e + eps).pow((p - 1.0) / 2.0)


def lq_normalize(A: torch.Tensor, q_norm: float, eps: float) -> torch.Tensor:
    """MONETA's read weight W = A / ‖A‖_q^{q−2} over the last two dims (identity for q = 2)."""
    if q_norm == 2.0:
        return A
    s = A.abs().pow(q_norm).sum((-2, -1), keepdim=True)
    return A * (s + eps).pow(-(q_norm - 2.0) / q_norm)


def _scan_one(k, v, q, alpha, eta, m0, p, a, eps, momentum, q_norm, bias, s0=None, beta=None, decay_first=False):
    B, T, H, Dk = k.shape
    Dv = v.shape[-1]
    dtype = torch.promote_types(k.dtype, torch.float32)
    A = m0.to(dtype) if m0 is not None else k.new_zeros(B, H, Dv, Dk, dtype=dtype)
    S = s0.to(dtype) if s0 is not None else torch.zeros_like(A)
    ys = []
    for t in range(T):
        kt, vt, qt = k[:, t].to(dtype), v[:, t].to(dtype), q[:, t].to(dtype)
        keep = (1.0 - alpha[:, t].double()).to(dtype)[..., None, None]  # (1 − α in float64: see cpu._prepare)
        et = eta[:, t].to(dtype)[..., None, None]
        W = lq_normalize(A, q_norm, eps)
        read = torch.einsum("bhvk,bhk->bhv", W, kt)
        e = keep[..., 0] * read - vt if decay_first else read - vt
        U = bias_grad(e, p, a, eps, bias)[..., :, None] * kt[..., None, :]
        if momentum != 0.0:
            decay = momentum if beta is None else momentum * beta[:, t].to(dtype)[..., None, None]
            S = decay * S - et * U
            A = keep * A + S
        else:
            A = keep * A - et * U
        ys.append(torch.einsum("bhvk,bhk->bhv", lq_normalize(A, q_norm, eps), qt))
    y = torch.stack(ys, 1) if ys else v.new_zeros(B, 0, H, Dv, dtype=dtype)
    return y.to(v.dtype), A, S if momentum != 0.0 else A.new_empty(0)


def memory_scan_naive(k: torch.Tensor, v: torch.Tensor, q: torch.Tensor, alpha: torch.Tensor,
                      eta: torch.Tensor, m0: Optional[torch.Tensor] = None,
                      cu_seqlens: Optional[torch.Tensor] = None, p: float = 2.0, a: float = 10.0,
                      eps: float = 1e-6, momentum: float = 0.0,
                      q_norm: float = 2.0, bias: str = "", s0: Optional[torch.Tensor] = None,
                      beta: Optional[torch.Tensor] = None,
                      decay_first: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference for ``torch.ops.hecate.memory_scan`` (same arguments, same results).

    k, q [B, T, H, Dk]; v [B, T, H, Dv]; alpha, eta [B, T, H]; m0, s0 [B, H, Dv, Dk] or None; beta [B, T, H] or None.
    With ``cu_seqlens`` [N+1] the batch is packed (B == 1) and the states are [N, H, Dv, Dk].
    Returns y [B, T, H, Dv] (dtype of v), m_final and s_final (fp32, or fp64 for fp64 inputs;
    s_final is empty without momentum).
    """
    if cu_seqlens is None:
        return _scan_one(k, v, q, alpha, eta, m0, p, a, eps, momentum, q_norm, bias, s0, beta, decay_first)
    bounds = [int(x) for x in cu_seqlens.tolist()]
    parts = [_scan_one(k[:, bos:eos], v[:, bos:eos], q[:, bos:eos], alpha[:, bos:eos], eta[:, bos:eos],
                       None if m0 is None else m0[n:n + 1], p, a, eps, momentum, q_norm, bias,
                       None if s0 is None else s0[n:n + 1], None if beta is None else beta[:, bos:eos], decay_first)
             for n, (bos, eos) in enumerate(zip(bounds[:-1], bounds[1:]))]
    return tuple(torch.cat([part[i] for part in parts], 1 if i == 0 else 0) for i in range(3))
