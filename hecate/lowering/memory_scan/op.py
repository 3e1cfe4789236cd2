"""``torch.ops.hecate.memory_scan``: the l_p associative-memory recurrence as one op.

Contract (the recognition pass in ``hecate/passes/memory_scan.py`` emits exactly this)::

    torch.ops.hecate.memory_scan(
        k,          # [B, T, H, Dk]  φ(k_t), already feature-mapped
        v,          # [B, T, H, Dv]
        q,          # [B, T, H, Dk]  φ(q_t)
        alpha,      # [B, T, H]  retention (forget rate) α_t; a fixed α is expanded by the caller
        eta,        # [B, T, H]  step size η_t
        m0,         # [B, H, Dv, Dk] initial state A_0, or None (zeros)
        cu_seqlens, # [N+1] int32/int64 offsets of packed sequences (then B == 1 and m0 is
                    # [N, H, Dv, Dk]), or None
        p,          # l_p exponent >= 1 (p = 2 and p = 1 are fast paths)
        a,          # tanh sharpness of the Sign approximator (spec default 10)
        eps,        # eps of the |e|^(p-1) approximator and of MONETA's norm (spec default 1e-6)
        momentum,   # β: 0 = plain GD; else S ← β S − η_t U ; A ← (1 − α_t) A + S (S_0 = s0)
        q_norm,     # 2 = plain; else MONETA: W = A / ‖A‖_q^{q−2} over the whole [Dv, Dk] per head
        bias,       # "" = the l_p bias gradient of p, a, eps; else the user's elementwise g(e) as a
                    # hecate.lowering.pointwise expression (then p and a are unused; eps stays MONETA's)
        s0=None,    # [B or N, H, Dv, Dk] initial momentum buffer S_0, or None (zeros); momentum only
        beta=None,  # [B, T, H] per-step factor of the momentum decay: S ← (momentum · β_t) S − η_t U (HOPE Eq 51's
                    # α_{i+1}, data-dependent or learned), or None (the fixed momentum); momentum only
        decay_first=False,  # the error read from the decayed memory, e = (1 − α_t) W_{t−1} k_t − v_t (Gated
                    # DeltaNet's order: decay, then the delta rule); without momentum and with q_norm = 2 only
    ) -> (y [B, T, H, Dv] in the dtype of v, m_final [B or N, H, Dv, Dk] fp32,
          s_final [B or N, H, Dv, Dk] fp32 with momentum, else empty [0])

Chunked processing: a sequence split into chunks, each called with the previous chunk's (m_final,
s_final) as (m0, s0), gives the whole sequence's y and final states (and gradients).

Per step: e = W_{t−1} k_t − v_t (``decay_first``: (1 − α_t) W_{t−1} k_t − v_t) ; U = g(e) k_tᵀ with g = bias_grad_p or the ``bias`` function ; A_t = (1 − α_t) A_{t−1} − η_t U
(or the momentum form) ; W_t = A_t (q_norm = 2) or the MONETA normalisation ; y_t = W_t q_t.
The state in and out is A (the memory M itself when q_norm = 2). Full statement: :mod:`.naive`.

A ``bias`` g is generated into the Triton kernels (forward: g; backward: g', the derivative
:func:`hecate.lowering.pointwise.derivative` traces from autograd), evaluated with torch on the
CPU path and in the ATen decomposition, and written with ONNX ops in the export. For example
a Huber bias of threshold 1, ``pointwise.trace(lambda e: torch.where(e.abs() <= 1, e, e.sign()))``,
is ``"abs(x);le(%0,1.0);sign(x);where(%1,x,%2)"``.

k, v and q share one dtype (fp32, bf16, fp16; fp64 on the ATen path, on every device); the state is
fp32 (fp64 for fp64 inputs). Differentiable in k, v, q, alpha, eta, m0, s0 and beta; the
backward is ``torch.ops.hecate.memory_scan_backward`` (same arguments plus dy and
dm_final first, ds_final and beta last), which re-runs the forward keeping the state every C steps
(B·H·ceil(T/C)·Dv·Dk·4 bytes, twice with momentum; C = ``kernels.CHUNK`` = 32 on
Triton, ``cpu.CHUNK`` = 64 on CPU) and recomputes inside each segment (Triton:
a scratch of B·H·C·Dv·Dk·4 bytes; CPU: C states held). Nothing is saved between
forward and backward but the inputs: the forward itself stores no checkpoints.

On Triton, the delta rule (p = 2, no bias, no momentum, q_norm = 2; :func:`.chunked.uses_chunked`) from
T = ``chunked.MIN_T`` runs in the chunk kernels of :mod:`.chunk_kernels`, forward and backward (the backward
keeps the state at every chunk start: B·H·ceil(T/C)·Dv·Dk·4 bytes, C = ``chunked.CHUNK``). With ``decay_first`` too (the error
of the decayed memory: P⁻ and γ⁻ become P and γ in the chunk's system, :mod:`.chunked`).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from hecate.lowering import pointwise
from hecate.lowering.autocast import register_autocast
from hecate.lowering.dispatch import check_devices, dense, use_triton_kernels
from hecate.lowering.memory_scan import chunked, cpu
from hecate.lowering.registry import differentiable_backward


def _state_dtype(k: Tensor) -> torch.dtype:
    return torch.float64 if k.dtype == torch.float64 else torch.float32


def check_kvq_shapes(op: str, k: Tensor, v: Tensor, q: Tensor) -> None:
    """k, q [B, T, H, Dk] and v [B, T, H, Dv] (shared with linear_attention)."""
    if k.dim() != 4:
        raise ValueError(f"{op}: k must be [B, T, H, Dk], got shape {tuple(k.shape)}")
    if q.shape != k.shape:
        raise ValueError(f"{op}: q shape {tuple(q.shape)} must equal k shape {tuple(k.shape)} ([B, T, H, Dk])")
    if v.dim() != 4 or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"{op}: v shape {tuple(v.shape)} must be [B, T, H, Dv] with B, T, H of "
                         f"k shape {tuple(k.shape)}")


def check_shapes(k, v, q, alpha, eta, m0, cu_seqlens, p, a, eps, momentum, q_norm, bias="", s0=None,
                 beta=None, decay_first=False) -> None:
    """Shape, dtype and scalar checks (no data reads: also run at trace time)."""
    if bias:
        try:
            pointwise.parse(bias)
        except ValueError as error:
            raise ValueError(f"memory_scan: bias must be '' or a pointwise expression of e; {error}") from None
    if not (isinstance(p, (int, float)) and p >= 1.0 and math.isfinite(p)):
        raise ValueError(f"memory_scan: p must be a finite number >= 1 (the l_p exponent), got {p!r}")
    if not q_norm >= 1.0 or not math.isfinite(q_norm):
        raise ValueError(f"memory_scan: q_norm must be a finite number >= 1 (2 = no L_q retention), got {q_norm!r}")
    if not (a > 0.0 and math.isfinite(a)):
        raise ValueError(f"memory_scan: a (tanh sharpness) must be finite and > 0, got {a!r}")
    if not (eps > 0.0 and math.isfinite(eps)):
        raise ValueError(f"memory_scan: eps must be finite and > 0, got {eps!r}")
    if not math.isfinite(momentum):
        raise ValueError(f"memory_scan: momentum must be finite, got {momentum!r}")
    check_kvq_shapes("memory_scan", k, v, q)
    check_devices("memory_scan", "k", k, v=v, q=q, alpha=alpha, eta=eta, beta=beta, m0=m0, s0=s0, cu_seqlens=cu_seqlens)
    B, T, H, Dk = k.shape
    for name, gate in (("alpha", alpha), ("eta", eta), ("beta", beta)):
        if gate is None:
            continue
        if gate.shape != k.shape[:3]:
            raise ValueError(f"memory_scan: {name} shape {tuple(gate.shape)} must be [B, T, H] = "
                             f"{tuple(k.shape[:3])} from k shape {tuple(k.shape)}")
        if not gate.is_floating_point():
            raise TypeError(f"memory_scan: {name} must be a floating tensor, got {gate.dtype}")
    if v.dtype != k.dtype or q.dtype != k.dtype:
        raise TypeError(f"memory_scan: k, v and q must share one dtype, got k {k.dtype}, v {v.dtype}, q {q.dtype}")
    if not k.is_floating_point():
        raise TypeError(f"memory_scan: k must be a floating tensor, got {k.dtype}")
    n_states = B
    if cu_seqlens is not None:
        if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
            raise ValueError(f"memory_scan: cu_seqlens must be 1-D [N+1] with N >= 1, got shape {tuple(cu_seqlens.shape)}")
        if cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"memory_scan: cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
        if B != 1:
            raise ValueError(f"memory_scan: with cu_seqlens the batch is packed, so B must be 1; k shape {tuple(k.shape)}")
        n_states = cu_seqlens.shape[0] - 1
    Dv = v.shape[-1]
    for name, state in (("m0", m0), ("s0", s0)):
        if state is not None and tuple(state.shape) != (n_states, H, Dv, Dk):
            raise ValueError(f"memory_scan: {name} shape {tuple(state.shape)} must be "
                             f"[{'N' if cu_seqlens is not None else 'B'}, H, Dv, Dk] = {(n_states, H, Dv, Dk)} "
                             f"from k shape {tuple(k.shape)} and v shape {tuple(v.shape)}")
    if s0 is not None and momentum == 0.0:
        raise ValueError("memory_scan: s0 is the momentum buffer's initial state; pass it only with momentum != 0, "
                         "got momentum=0")
    if beta is not None and momentum == 0.0:
        raise ValueError("memory_scan: beta scales the momentum decay (momentum · beta_t); pass it with momentum != 0 "
                         "(momentum=1.0 for a decay of beta_t itself), got momentum=0")
    if decay_first and (momentum != 0.0 or q_norm != 2.0):
        raise ValueError("memory_scan: decay_first (the error read from the decayed memory) needs momentum=0 and "
                         f"q_norm=2, got momentum={momentum!r}, q_norm={q_norm!r}")


def check_values(k, alpha, eta, cu_seqlens) -> None:
    """Data checks: well-formed cu_seqlens (one host sync each). A NaN or inf gate is no error: the state
    carries it from its step on, as the model's own loop does (the recurrent form: see chunked.uses_chunked)."""
    if cu_seqlens is not None:
        T = k.shape[1]
        first, last = int(cu_seqlens[0]), int(cu_seqlens[-1])
        if first != 0 or last != T:
            raise ValueError(f"memory_scan: cu_seqlens must start at 0 and end at T = {T}, got {cu_seqlens.tolist()}")
        if bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
            raise ValueError(f"memory_scan: cu_seqlens must be non-decreasing, got {cu_seqlens.tolist()}")


@torch.library.custom_op("hecate::memory_scan", mutates_args=())
def memory_scan(k: Tensor, v: Tensor, q: Tensor, alpha: Tensor, eta: Tensor, m0: Optional[Tensor],
                cu_seqlens: Optional[Tensor], p: float = 2.0, a: float = 10.0, eps: float = 1e-6,
                momentum: float = 0.0, q_norm: float = 2.0, bias: str = "",
                s0: Optional[Tensor] = None, beta: Optional[Tensor] = None,
                decay_first: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    check_shapes(k, v, q, alpha, eta, m0, cu_seqlens, p, a, eps, momentum, q_norm, bias, s0, beta, decay_first)
    check_values(k, alpha, eta, cu_seqlens)
    if use_triton_kernels(k):
        from hecate.lowering.memory_scan import chunk_kernels, kernels
        recurrent = lambda: kernels.forward(k, v, q, alpha, eta, m0, cu_seqlens, p, a, eps, momentum,  # noqa: E731
                                            q_norm, bias=bias, s0=s0, beta=beta, decay_first=decay_first)
        if chunked.uses_chunked(k.shape[1], p, bias, momentum, q_norm, False, k, v, q, alpha, eta, m0):
            return dense(chunked.finite_or_recurrent(
                lambda: chunk_kernels.forward(k, v, q, alpha, eta, m0, cu_seqlens, decay_first=decay_first),
                recurrent))
        return dense(recurrent())
    return dense(cpu.forward_packed(k, v, q, alpha, eta, m0, cu_seqlens, p, a, eps, momentum, q_norm, bias=bias,
                                    s0=s0, beta=beta, decay_first=decay_first))


def _final_states_fake(k, v, cu_seqlens, momentum):
    B, T, H, Dk = k.shape
    n_states = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    m_final = k.new_empty(n_states, H, v.shape[-1], Dk, dtype=_state_dtype(k))
    return m_final, m_final.new_empty(m_final.shape if momentum != 0.0 else (0,))


@memory_scan.register_fake
def _memory_scan_fake(k, v, q, alpha, eta, m0, cu_seqlens, p=2.0, a=10.0, eps=1e-6, momentum=0.0, q_norm=2.0,
                      bias="", s0=None, beta=None, decay_first=False):
    check_shapes(k, v, q, alpha, eta, m0, cu_seqlens, p, a, eps, momentum, q_norm, bias, s0, beta, decay_first)
    return (v.new_empty(v.shape), *_final_states_fake(k, v, cu_seqlens, momentum))


@torch.library.custom_op("hecate::memory_scan_backward", mutates_args=())
def memory_scan_backward(dy: Tensor, dm_final: Tensor, k: Tensor, v: Tensor, q: Tensor, alpha: Tensor,
                         eta: Tensor, m0: Optional[Tensor], cu_seqlens: Optional[Tensor], p: float,
                         a: float, eps: float, momentum: float,
                         q_norm: float, bias: str = "", s0: Optional[Tensor] = None,
                         ds_final: Optional[Tensor] = None, beta: Optional[Tensor] = None,
                         decay_first: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients (dk, dv, dq, dalpha, deta, dm0, ds0, dbeta) of ``memory_scan`` (dm0, ds0 fp32; dm0 zeros-shaped
    when m0 is None; ds0 empty without momentum, dbeta without beta; ds_final None means zeros)."""
    if use_triton_kernels(k):
        from hecate.lowering.memory_scan import chunk_kernels, kernels
        recurrent = lambda: kernels.backward(dy, dm_final, k, v, q, alpha, eta, m0, cu_seqlens, p, a, eps,  # noqa: E731
                                             momentum, q_norm, bias=bias, s0=s0, ds_final=ds_final, beta=beta,
                                             decay_first=decay_first)
        if chunked.uses_chunked(k.shape[1], p, bias, momentum, q_norm, False, k, v, q, alpha, eta, m0, dy,
                                   dm_final):  # (no momentum there, so no dbeta)
            return dense(chunked.finite_or_recurrent(
                lambda: (*chunk_kernels.backward(dy, dm_final, k, v, q, alpha, eta, m0, cu_seqlens,
                                                 decay_first=decay_first), dy.new_empty(0)),
                recurrent))
        return dense(recurrent())
    return dense(cpu.backward_packed(dy, dm_final, k, v, q, alpha, eta, m0, cu_seqlens, p, a, eps, momentum, q_norm,
                                     bias=bias, s0=s0, dS_final=ds_final, beta=beta, decay_first=decay_first))


@memory_scan_backward.register_fake
def _memory_scan_backward_fake(dy, dm_final, k, v, q, alpha, eta, m0, cu_seqlens, p, a, eps, momentum, q_norm,
                               bias="", s0=None, ds_final=None, beta=None, decay_first=False):
    return (k.new_empty(k.shape), v.new_empty(v.shape), q.new_empty(q.shape), alpha.new_empty(alpha.shape),
            eta.new_empty(eta.shape), *_final_states_fake(k, v, cu_seqlens, momentum),
            beta.new_empty(beta.shape) if beta is not None else dy.new_empty(0))


def _setup_context(ctx, inputs, output):
    k, v, q, alpha, eta, m0, cu_seqlens, p, a, eps, momentum, q_norm, bias, s0, beta, decay_first = inputs
    ctx.save_for_backward(k, v, q, alpha, eta, m0, cu_seqlens, s0, beta)
    ctx.scalars = (p, a, eps, momentum, q_norm, bias)
    ctx.decay_first = decay_first
    ctx.state_dtypes = tuple(None if state is None else state.dtype for state in (m0, s0))


def _backward(ctx, dy, dm_final, ds_final):
    k, v, q, alpha, eta, m0, cu_seqlens, s0, beta = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph=True: this gradient is differentiated again
        return differentiable_backward(torch.ops.hecate.memory_scan.default, (
            k, v, q, alpha, eta, m0, cu_seqlens, *ctx.scalars, s0, beta, ctx.decay_first), (dy, dm_final, ds_final))
    momentum = ctx.scalars[3]
    dk, dv, dq, dalpha, deta, dm0, ds0, dbeta = torch.ops.hecate.memory_scan_backward(
        dy.contiguous(), dm_final.contiguous(), k, v, q, alpha, eta, m0, cu_seqlens, *ctx.scalars, s0,
        ds_final.contiguous() if momentum != 0.0 else None, beta, ctx.decay_first)
    dm0, ds0 = (None if dt is None else g.to(dt) for g, dt in zip((dm0, ds0), ctx.state_dtypes))
    return (dk, dv, dq, dalpha, deta, dm0, None, None, None, None, None, None, None, ds0,
            dbeta if beta is not None else None, None)


memory_scan.register_autograd(_backward, setup_context=_setup_context)


# Under autocast k, v, q arrive in the autocast dtype (eager's matmuls read them there) and y leaves in it;
# the gates and the fp32 state keep their dtype.
register_autocast(memory_scan, cast=("k", "v", "q"))
