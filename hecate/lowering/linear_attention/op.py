"""``torch.ops.hecate.linear_attention``: the Hebbian / fast-weight / linear-attention memory as one op.

Contract::

    torch.ops.hecate.linear_attention(
        k,          # [B, T, H, Dk]  φ(k_t)
        v,          # [B, T, H, Dv]
        q,          # [B, T, H, Dk]  φ(q_t)
        alpha,      # [B, T, H] keep factor α_t, or None (1: no decay); causal only
        m0,         # [B, H, Dv, Dk] initial M or None (zeros); causal only
        z0,         # [B, H, Dk] initial normaliser z or None (zeros); causal and normalize only
        normalize,  # bool: y_t / (z_t · q_t + eps)
        eps,        # float
        causal,     # bool: the recurrence (True) or φ(Q)(φ(K)ᵀV) (False)
    ) -> (y [B, T, H, Dv] in the dtype of v, m_final [B, H, Dv, Dk] fp32, z_final [B, H, Dk] fp32)

Equations: :mod:`.naive`. The causal form runs the memory_scan machinery in its
Hebbian mode (CPU loop / Triton fused recurrent kernels, same checkpointed backward;
on Triton from T = ``chunked.MIN_T`` the chunk kernels of
:mod:`hecate.lowering.memory_scan.chunk_kernels`, forward and backward),
U = −v kᵀ with retention 1 − α and step 1, so A ← α A + v kᵀ. The
normaliser rides along as one more value row: v' = [v, 1] makes row Dv of the
state z, and y = (M q) / (z·q + eps) is divided out afterwards. The non-causal
form is two matmuls.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from hecate.lowering.autocast import register_autocast
from hecate.lowering.dispatch import check_devices, dense, use_triton_kernels
from hecate.lowering.memory_scan import chunked, cpu
from hecate.lowering.memory_scan.op import check_kvq_shapes
from hecate.lowering.registry import differentiable_backward


def check_inputs(k, v, q, alpha, m0, z0, normalize, eps, causal) -> None:
    """Shape and argument checks (no data reads: also run at trace time)."""
    check_kvq_shapes("linear_attention", k, v, q)
    check_devices("linear_attention", "k", k, v=v, q=q, alpha=alpha, m0=m0, z0=z0)
    B, T, H, Dk = k.shape
    if v.dtype != k.dtype or q.dtype != k.dtype or not k.is_floating_point():
        raise TypeError(f"linear_attention: k, v and q must share one floating dtype, got k {k.dtype}, "
                        f"v {v.dtype}, q {q.dtype}")
    if not (eps >= 0.0 and math.isfinite(eps)):  # 0: y = M q / (z·q), as the normaliser is often written
        raise ValueError(f"linear_attention: eps must be finite and ≥ 0, got {eps!r}")
    Dv = v.shape[-1]
    if not causal:
        for name, x in (("alpha", alpha), ("m0", m0), ("z0", z0)):
            if x is not None:
                raise ValueError(f"linear_attention: {name} must be None for the non-causal form "
                                 f"(it has no recurrence), got a tensor of shape {tuple(x.shape)}")
        return
    if alpha is not None and alpha.shape != k.shape[:3]:
        raise ValueError(f"linear_attention: alpha shape {tuple(alpha.shape)} must be [B, T, H] = "
                         f"{tuple(k.shape[:3])} from k shape {tuple(k.shape)}")
    if m0 is not None and tuple(m0.shape) != (B, H, Dv, Dk):
        raise ValueError(f"linear_attention: m0 shape {tuple(m0.shape)} must be [B, H, Dv, Dk] = {(B, H, Dv, Dk)}")
    if z0 is not None:
        if not normalize:
            raise ValueError("linear_attention: z0 is the normaliser's initial state; pass it only with normalize=True")
        if tuple(z0.shape) != (B, H, Dk):
            raise ValueError(f"linear_attention: z0 shape {tuple(z0.shape)} must be [B, H, Dk] = {(B, H, Dk)}")


def _hebbian_inputs(k, v, alpha, m0, z0, normalize):
    """The memory_scan (Hebbian mode) arguments: v' = [v, 1] with the normaliser, retention 1 − α, step 1."""
    B, T, H, Dk = k.shape
    Dv = v.shape[-1]
    state = torch.float64 if k.dtype == torch.float64 else torch.float32
    if normalize:
        v = torch.cat([v.to(state), v.new_ones(B, T, H, 1, dtype=state)], -1)
    # the kernels take the forget rate 1 − α and compute 1 − (1 − α): in float64, so a keep near 0 keeps its digits
    forget = (1.0 - alpha.double()) if alpha is not None else k.new_zeros(B, T, H, dtype=state)
    step = torch.ones_like(forget)
    A0 = None
    if m0 is not None or (normalize and z0 is not None):
        M = m0.to(state) if m0 is not None else k.new_zeros(B, H, Dv, Dk, dtype=state)
        A0 = torch.cat([M, (z0.to(state) if z0 is not None else M.new_zeros(B, H, Dk)).unsqueeze(2)], 2) \
            if normalize else M
    return v, forget, step, A0


def _uses_chunked(*inputs) -> bool:
    """Whether the Triton path takes the chunk kernels (the Hebbian recurrence always has a chunked form)."""
    return chunked.uses_chunked(inputs[0].shape[1], 2.0, "", 0.0, 2.0, True, *inputs)


def _recurrence(k, v, q, forget, step, A0):
    """(y, A_T) of the Hebbian recurrence (no momentum: memory_scan's empty s_final is dropped)."""
    if use_triton_kernels(k):
        from hecate.lowering.memory_scan import chunk_kernels, kernels
        recurrent = lambda: kernels.forward(k, v, q, forget, step, A0, None, 2.0, 1.0, 1e-6, 0.0, 2.0,  # noqa: E731
                                            hebbian=True)[:2]
        if _uses_chunked(k, v, q, forget, step, A0):
            return chunked.finite_or_recurrent(
                lambda: chunk_kernels.forward(k, v, q, forget, step, A0, None, hebbian=True)[:2], recurrent)
        return recurrent()
    return cpu.forward(k, v, q, forget, step, A0, 2.0, 1.0, 1e-6, 0.0, 2.0, hebbian=True)[:2]


def _recurrence_backward(dy, dA, k, v, q, forget, step, A0):
    """(dk, dv, dq, dforget, dstep, dA0)."""
    if use_triton_kernels(k):
        from hecate.lowering.memory_scan import chunk_kernels, kernels
        recurrent = lambda: kernels.backward(dy, dA, k, v, q, forget, step, A0, None, 2.0, 1.0, 1e-6, 0.0, 2.0,  # noqa: E731
                                             hebbian=True)[:6]
        if _uses_chunked(k, v, q, forget, step, A0, dy, dA):
            return chunked.finite_or_recurrent(
                lambda: chunk_kernels.backward(dy, dA, k, v, q, forget, step, A0, None, hebbian=True)[:6], recurrent)
        return recurrent()
    return cpu.backward(dy, dA, k, v, q, forget, step, A0, 2.0, 1.0, 1e-6, 0.0, 2.0, hebbian=True)[:6]


def _split(y_aug, A, Dv, eps, normalize):
    """(y, M, z, denominator + eps) from the augmented read and state."""
    if not normalize:
        return y_aug, A, A.new_zeros(A.shape[0], A.shape[1], A.shape[3]), None
    den = y_aug[..., Dv:] + eps
    return y_aug[..., :Dv] / den, A[:, :, :Dv].contiguous(), A[:, :, Dv].contiguous(), den


def _non_causal(k, v, q, normalize, eps):
    state = torch.float64 if k.dtype == torch.float64 else torch.float32
    kf, vf, qf = k.to(state), v.to(state), q.to(state)
    M = torch.einsum("bthv,bthk->bhvk", vf, kf)
    z = kf.sum(1)
    num = torch.einsum("bhvk,bthk->bthv", M, qf)
    den = torch.einsum("bthk,bhk->bth", qf, z).unsqueeze(-1) + eps if normalize else None
    return kf, vf, qf, M, z, num, den


@torch.library.custom_op("hecate::linear_attention", mutates_args=())
def linear_attention(k: Tensor, v: Tensor, q: Tensor, alpha: Optional[Tensor], m0: Optional[Tensor],
                     z0: Optional[Tensor], normalize: bool = False, eps: float = 1e-6,
                     causal: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    check_inputs(k, v, q, alpha, m0, z0, normalize, eps, causal)
    if not causal:
        _, _, _, M, z, num, den = _non_causal(k, v, q, normalize, eps)
        y = num / den if normalize else num
        return dense((y.to(v.dtype), M, z if normalize else torch.zeros_like(z)))
    Dv = v.shape[-1]
    v_aug, forget, step, A0 = _hebbian_inputs(k, v, alpha, m0, z0, normalize)
    y_aug, A = _recurrence(k, v_aug, q, forget, step, A0)
    y, M, z, _ = _split(y_aug, A, Dv, eps, normalize)
    return dense((y.to(v.dtype), M, z))


@linear_attention.register_fake
def _linear_attention_fake(k, v, q, alpha, m0, z0, normalize=False, eps=1e-6, causal=True):
    check_inputs(k, v, q, alpha, m0, z0, normalize, eps, causal)
    B, T, H, Dk = k.shape
    state = torch.float64 if k.dtype == torch.float64 else torch.float32
    return (v.new_empty(B, T, H, v.shape[-1]), k.new_empty(B, H, v.shape[-1], Dk, dtype=state),
            k.new_empty(B, H, Dk, dtype=state))


@torch.library.custom_op("hecate::linear_attention_backward", mutates_args=())
def linear_attention_backward(dy: Tensor, dm_final: Tensor, dz_final: Tensor, k: Tensor, v: Tensor, q: Tensor,
                              alpha: Optional[Tensor], m0: Optional[Tensor], z0: Optional[Tensor],
                              normalize: bool, eps: float,
                              causal: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dk, dv, dq, dalpha, dm0, dz0); the gradients of absent inputs come back as zeros of their shape."""
    B, T, H, Dk = k.shape
    Dv = v.shape[-1]
    state = torch.float64 if k.dtype == torch.float64 else torch.float32
    dyf = dy.to(state)
    if not causal:
        kf, vf, qf, M, z, num, den = _non_causal(k, v, q, normalize, eps)
        dnum = dyf / den if normalize else dyf
        dM = torch.einsum("bthv,bthk->bhvk", dnum, qf) + dm_final.to(state)
        dq = torch.einsum("bhvk,bthv->bthk", M, dnum)
        dk = torch.einsum("bhvk,bthv->bthk", dM, vf)
        if normalize:
            dden = -(dnum * num / den).sum(-1)  # [B, T, H]
            dq = dq + dden.unsqueeze(-1) * z.unsqueeze(1)
            dk = dk + (torch.einsum("bth,bthk->bhk", dden, qf) + dz_final.to(state)).unsqueeze(1)
        dv = torch.einsum("bhvk,bthk->bthv", dM, kf)
        zeros = k.new_zeros(B, T, H, dtype=state)
        return dense((dk.to(k.dtype), dv.to(v.dtype), dq.to(q.dtype), zeros, k.new_zeros(B, H, Dv, Dk, dtype=state),
                      k.new_zeros(B, H, Dk, dtype=state)))
    v_aug, forget, step, A0 = _hebbian_inputs(k, v, alpha, m0, z0, normalize)
    if normalize:
        y_aug, _ = _recurrence(k, v_aug, q, forget, step, A0)
        den = y_aug[..., Dv:] + eps
        dnum = dyf / den
        dden = -(dnum * y_aug[..., :Dv] / den).sum(-1, keepdim=True)
        dy_aug = torch.cat([dnum, dden], -1)
        dA = torch.cat([dm_final.to(state), dz_final.to(state).unsqueeze(2)], 2)
    else:
        dy_aug, dA = dyf, dm_final.to(state)
    dk, dv_aug, dq, dforget, _, dA0 = _recurrence_backward(dy_aug.contiguous(), dA.contiguous(), k, v_aug, q,
                                                           forget, step, A0)
    dm0 = dA0[:, :, :Dv].contiguous()
    dz0 = dA0[:, :, Dv].contiguous() if normalize else k.new_zeros(B, H, Dk, dtype=state)
    return dense((dk.to(k.dtype), dv_aug[..., :Dv].to(v.dtype), dq.to(q.dtype), (-dforget).to(state),
                  dm0.to(state), dz0.to(state)))


@linear_attention_backward.register_fake
def _linear_attention_backward_fake(dy, dm_final, dz_final, k, v, q, alpha, m0, z0, normalize, eps, causal):
    B, T, H, Dk = k.shape
    state = torch.float64 if k.dtype == torch.float64 else torch.float32
    return (k.new_empty(k.shape), v.new_empty(v.shape), q.new_empty(q.shape), k.new_empty(B, T, H, dtype=state),
            k.new_empty(B, H, v.shape[-1], Dk, dtype=state), k.new_empty(B, H, Dk, dtype=state))


def _setup_context(ctx, inputs, output):
    k, v, q, alpha, m0, z0, normalize, eps, causal = inputs
    ctx.save_for_backward(k, v, q, alpha, m0, z0)
    ctx.flags = (normalize, eps, causal)
    ctx.dtypes = tuple(None if x is None else x.dtype for x in (alpha, m0, z0))


def _backward(ctx, dy, dm_final, dz_final):
    k, v, q, alpha, m0, z0 = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph=True: this gradient is differentiated again
        return differentiable_backward(torch.ops.hecate.linear_attention.default, (k, v, q, alpha, m0, z0, *ctx.flags),
                                       (dy, dm_final, dz_final))
    dk, dv, dq, dalpha, dm0, dz0 = torch.ops.hecate.linear_attention_backward(
        dy.contiguous(), dm_final.contiguous(), dz_final.contiguous(), k, v, q, alpha, m0, z0, *ctx.flags)
    grads = [g.to(dt) if dt is not None else None for g, dt in zip((dalpha, dm0, dz0), ctx.dtypes)]
    return (dk, dv, dq, *grads, None, None, None)


linear_attention.register_autograd(_backward, setup_context=_setup_context)


# Under autocast k, v, q arrive in the autocast dtype; the gates and the fp32 state keep theirs.
register_autocast(linear_attention, cast=("k", "v", "q"))
