"""CPU path of ``memory_scan``: a tight ATen loop over T, batched over B·H.

The state is [B·H, Dv, Dk] and every step is a handful of batched ATen calls:
matrix-vector products as one-row bmm (see :func:`_matvec`), rank-1 updates as
addcmul. This runs ~2× faster than the eager loop forward and avoids autograd's
per-step bookkeeping backward.
The backward is a hand-written reverse loop: the forward is re-run keeping the
state every ``CHUNK`` steps (B·H·ceil(T/CHUNK)·Dv·Dk floats, twice with momentum),
then each segment is recomputed (CHUNK states held) and walked backwards.
The equations are in :mod:`.naive`; the reverse-mode ones are in :func:`backward_recurrent`.

:func:`forward` and :func:`backward` pick the form: the recurrences that are linear in the state
(p = 2 and Hebbian) run in the chunked form of :mod:`.chunked` at T >= ``chunked.MIN_T``, the rest
(and short sequences) run this per-token loop (:func:`forward_recurrent`, :func:`backward_recurrent`).
"""

from __future__ import annotations

from typing import Optional

import torch

from hecate.lowering import pointwise
from hecate.lowering.memory_scan import chunked
from hecate.lowering.memory_scan.naive import bias_grad, lq_normalize

CHUNK = 64


def bias_grad_derivative(e: torch.Tensor, p: float, a: float, eps: float, bias: str = "") -> torch.Tensor:
    """d bias_grad / de, element-wise (for a pointwise ``bias``, its derivative traced by autograd)."""
    if bias:
        return pointwise.evaluate(pointwise.derivative(bias), e)
    if p == 2.0:
        return torch.full_like(e, 2.0)
    th = torch.tanh(a * e)
    if p == 1.0:
        return a * (1.0 - th * th)
    r = e * e + eps
    pw = r.pow((p - 1.0) / 2.0)
    return p * (a * (1.0 - th * th) * pw + th * (p - 1.0) * e * pw / r)


def lq_normalize_vjp(A: torch.Tensor, dW: torch.Tensor, q_norm: float, eps: float) -> torch.Tensor:
    """dA given dW for W = A · (Σ|A|^q + eps)^(−r), r = (q−2)/q (sum over the last two dims)."""
    if q_norm == 2.0:
        return dW
    r = (q_norm - 2.0) / q_norm
    absA = A.abs()
    s = absA.pow(q_norm).sum((-2, -1), keepdim=True) + eps
    c = s.pow(-r)
    inner = (dW * A).sum((-2, -1), keepdim=True)
    ds_dA = q_norm * torch.sign(A) * absA.pow(q_norm - 1.0)
    return c * dW - r * inner * c / s * ds_dA


def _tm(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, T, H, ...] -> time-major [T, B·H, ...] in ``dtype`` (each step's slice is contiguous)."""
    B, T, H = x.shape[:3]
    return x.to(dtype).transpose(0, 1).reshape(T, B * H, *x.shape[3:]).contiguous()


def _untm(x: torch.Tensor, B: int, H: int) -> torch.Tensor:
    """[T, B·H, ...] -> [B, T, H, ...] (contiguous)."""
    return x.reshape(x.shape[0], B, H, *x.shape[2:]).transpose(0, 1).contiguous()


def _matvec(M: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """M x for M [BH, R, C], x [BH, C], written as the row product xᵀ Mᵀ: on CPU, bmm with a
    one-row left operand is ~15× faster than with a one-column right operand (measured here)."""
    return torch.bmm(x.unsqueeze(1), M.transpose(1, 2)).squeeze(1)


class _Step:
    """One token of the recurrence on [B·H, Dv, Dk] states (arguments as in the op).

    The gates come precomputed per step: ``keep`` = 1 − α_t [B·H, 1, 1] and ``neg_eta`` = −η_t [B·H, 1]; with a
    per-step momentum decay, ``decay`` = momentum · β_t [B·H, 1, 1] (else the number ``momentum``).
    ``decay_first``: the error reads the decayed memory, e = (1 − α_t) W k − v.
    """

    def __init__(self, p, a, eps, momentum, q_norm, hebbian, bias="", decay_first=False):
        self.p, self.a, self.eps, self.momentum, self.q_norm = p, a, eps, momentum, q_norm
        self.hebbian, self.bias, self.decay_first = hebbian, bias, decay_first

    def error_and_gradient(self, A, kt, vt, keep):
        """(e, g): the prediction error and bias gradient; Hebbian: (None, −v), the memory is not read."""
        if self.hebbian:
            return None, -vt
        read = _matvec(lq_normalize(A, self.q_norm, self.eps), kt)
        e = (keep[..., 0] * read if self.decay_first else read) - vt
        return e, bias_grad(e, self.p, self.a, self.eps, self.bias)

    def __call__(self, A, S, kt, vt, keep, neg_eta, decay=None):
        g = self.error_and_gradient(A, kt, vt, keep)[1]
        minus_eta_g = (g * neg_eta).unsqueeze(-1)  # [BH, Dv, 1]
        if self.momentum != 0.0:
            S = (torch.baddbmm(S, minus_eta_g, kt.unsqueeze(1), beta=self.momentum) if decay is None
                 else torch.baddbmm(decay * S, minus_eta_g, kt.unsqueeze(1)))
            return keep * A + S, S
        return torch.addcmul(keep * A, minus_eta_g, kt.unsqueeze(1)), S


def _prepare(k, v, q, alpha, eta, m0):
    """Time-major inputs, the per-step gate factors (1 − α_t, −η_t) and the initial state A."""
    dtype = torch.float64 if k.dtype == torch.float64 else torch.float32
    B, T, H, Dk = k.shape
    Dv = v.shape[-1]
    K, V, Q = _tm(k, dtype), _tm(v, dtype), _tm(q, dtype)
    AL, ET = _tm(alpha, dtype), _tm(eta, dtype)  # [T, BH]
    # 1 − α in float64 before the state's dtype: a keep near 0 that arrives as an α near 1 (float64, from the pass's
    # 1 − keep) keeps its digits, where 1 − α in fp32 would keep only 1's (a relative error of 6% at 1e-6)
    keep, neg_eta = _tm(1.0 - alpha.double(), dtype)[..., None, None], (-ET)[..., None]
    A0 = (m0.to(dtype).reshape(B * H, Dv, Dk).clone() if m0 is not None
          else k.new_zeros(B * H, Dv, Dk, dtype=dtype))
    return K, V, Q, AL, ET, keep, neg_eta, A0


def _decays(beta, momentum, dtype):
    """momentum · β_t, time-major [T, B·H, 1, 1], for a per-step ``beta`` [B, T, H]; None without one."""
    return None if beta is None else (momentum * _tm(beta, dtype))[..., None, None]


def _at(decays, t):
    return None if decays is None else decays[t]


def _initial_momentum(s0, A):
    """S_0 [B·H, Dv, Dk]: s0, or zeros."""
    return s0.to(A.dtype).reshape(A.shape).clone() if s0 is not None else torch.zeros_like(A)


def _final_momentum(S, momentum, B, H):
    """s_final [B, H, Dv, Dk], or empty without momentum (there is no buffer)."""
    return S.reshape(B, H, *S.shape[1:]) if momentum != 0.0 else S.new_empty(0)


def forward_recurrent(k, v, q, alpha, eta, m0, p, a, eps, momentum, q_norm, hebbian=False, bias="", s0=None,
                      beta=None, decay_first=False):
    """The per-token loop: y [B, T, H, Dv] (dtype of v), A_T and S_T [B, H, Dv, Dk] (S_T empty without momentum) for one
    unpacked batch, starting from m0 and s0 (zeros when None); ``beta`` [B, T, H] the per-step momentum decay's
    factor (the decay is momentum · β_t), or None.

    ``hebbian``: the update ignores the memory, U = −v kᵀ (so A ← (1 − α) A + η v kᵀ): the
    linear-attention recurrence, run by ``hecate.linear_attention`` through this same loop.
    """
    B, T, H, _ = k.shape
    K, V, Q, _, _, keep, neg_eta, A = _prepare(k, v, q, alpha, eta, m0)
    step = _Step(p, a, eps, momentum, q_norm, hebbian, bias, decay_first)
    S = _initial_momentum(s0, A)
    decays = _decays(beta, momentum, K.dtype)
    Y = V.new_empty(V.shape)
    for t in range(T):
        A, S = step(A, S, K[t], V[t], keep[t], neg_eta[t], _at(decays, t))
        torch.bmm(Q[t].unsqueeze(1), lq_normalize(A, q_norm, eps).transpose(1, 2), out=Y[t].unsqueeze(1))
    return _untm(Y, B, H).to(v.dtype), A.reshape(B, H, *A.shape[1:]), _final_momentum(S, momentum, B, H)


def backward_recurrent(dy, dA_final, k, v, q, alpha, eta, m0, p, a, eps, momentum, q_norm, hebbian=False, bias="",
                       s0=None, dS_final=None, beta=None, decay_first=False):
    """The per-token reverse loop: gradients (dk, dv, dq, dalpha, deta, dm0, ds0, dbeta) of one unpacked batch (ds0
    empty without momentum, dbeta without a per-step ``beta``).

    Reverse step for token t (pre-state A_{t−1}, post-state A_t), carrying
    P = (1 − α_{t+1}) dA_{t+1} (+ the next error's dW when q = 2, folded in) and,
    for MONETA, Q = de_{t+1} k_{t+1}ᵀ (a gradient on W_t, pulled back through the
    normalisation at A_t)::

        dW_t = dy_t q_tᵀ + Q ;  dA_t = P + N'(A_t)ᵀ dW_t ;  dq_t = W_tᵀ dy_t
        D    = dA_t  (plain)  or  dS_t = β_{t+1} dS_{t+1} + dA_t  (momentum; dS_T also gets ds_final, and
               ds0 = β_1 dS_1) ;  dβ_t = momentum · ⟨dS_t, S_{t−1}⟩  (β_t = momentum · beta_t)
        dη_t = −g_tᵀ D k_t ;  dα_t = −⟨dA_t, A_{t−1}⟩
        dg_t = −η_t D k_t ;  de_t = bias_grad'(e_t) ⊙ dg_t ;  dv_t = −de_t
        dk_t = −η_t Dᵀ g_t + W_{t−1}ᵀ de_t
        P ← (1 − α_t) dA_t ;  Q ← de_t k_tᵀ

    Hebbian (g_t = −v_t, no error): dv_t = −dg_t, and neither the W_{t−1} term nor Q exist.
    ``decay_first`` (e_t = (1 − α_t) r_t − v_t, r_t = W_{t−1} k_t; q = 2): the error's terms of dk_t and P
    take de_t · (1 − α_t), and dα_t gets −de_tᵀ r_t.
    """
    B, T, H, Dk = k.shape
    Dv = v.shape[-1]
    K, V, Q, AL, ET, keep, neg_eta, A = _prepare(k, v, q, alpha, eta, m0)
    dtype = K.dtype
    dY = _tm(dy, dtype)
    step = _Step(p, a, eps, momentum, q_norm, hebbian, bias, decay_first)
    lq = q_norm != 2.0
    S = _initial_momentum(s0, A)
    decays = _decays(beta, momentum, dtype)
    checkpoints = []
    for t in range(T):
        if t % CHUNK == 0:
            checkpoints.append((A, S))
        A, S = step(A, S, K[t], V[t], keep[t], neg_eta[t], _at(decays, t))

    dK, dV, dQ = torch.empty_like(K), torch.empty_like(V), torch.empty_like(Q)
    dAL, dET = torch.empty_like(AL), torch.empty_like(ET)
    dBETA = torch.empty_like(AL) if decays is not None else None
    P = dA_final.to(dtype).reshape(B * H, Dv, Dk).clone()
    Qc = torch.zeros_like(P)
    dS_carry = (dS_final.to(dtype).reshape(P.shape) if dS_final is not None and dS_final.numel()
                else torch.zeros_like(P))          # β dS_{t+1}, the momentum adjoint handed to step t
    for c in range(len(checkpoints) - 1, -1, -1):
        A, S = checkpoints[c]
        start, stop = c * CHUNK, min((c + 1) * CHUNK, T)
        pre_states = []
        for t in range(start, stop):
            pre_states.append((A, S))
            A, S = step(A, S, K[t], V[t], keep[t], neg_eta[t], _at(decays, t))
        A_post = A
        for t in range(stop - 1, start - 1, -1):
            A_pre, S_pre = pre_states[t - start]
            kt, qt, dyt = K[t], Q[t], dY[t]
            W_post = lq_normalize(A_post, q_norm, eps)
            torch.bmm(dyt.unsqueeze(1), W_post, out=dQ[t].unsqueeze(1))  # W_tᵀ dy_t
            if lq:
                dA = P + lq_normalize_vjp(A_post, torch.addcmul(Qc, dyt.unsqueeze(-1), qt.unsqueeze(1)), q_norm, eps)
            else:
                dA = torch.addcmul(P, dyt.unsqueeze(-1), qt.unsqueeze(1))
            if momentum != 0.0:
                D = dS_carry + dA
                dS_carry = momentum * D if decays is None else decays[t] * D
                if dBETA is not None:
                    dBETA[t] = momentum * (D * S_pre).sum((1, 2))
            else:
                D = dA
            e, g = step.error_and_gradient(A_pre, kt, V[t], keep[t])
            Dk_t = _matvec(D, kt)  # [BH, Dv]
            dET[t] = -(g * Dk_t).sum(-1)
            dAL[t] = -(dA * A_pre).sum((1, 2))
            dg = Dk_t * neg_eta[t]
            torch.bmm(g.unsqueeze(1), D, out=dK[t].unsqueeze(1))  # Dᵀ g
            dK[t] *= neg_eta[t]
            P = keep[t] * dA
            if hebbian:
                dV[t] = -dg
            else:
                de = bias_grad_derivative(e, p, a, eps, bias) * dg
                dV[t] = -de
                if decay_first:  # e = (1 − α) r − v
                    dAL[t] -= (de * _matvec(A_pre, kt)).sum(-1)
                    de = de * keep[t][..., 0]
                W_pre = lq_normalize(A_pre, q_norm, eps)
                dK[t] += torch.bmm(de.unsqueeze(1), W_pre).squeeze(1)  # W_{t−1}ᵀ de
                if lq:
                    Qc = de.unsqueeze(-1) * kt.unsqueeze(1)
                else:
                    P = torch.addcmul(P, de.unsqueeze(-1), kt.unsqueeze(1))
            A_post = A_pre
    dA0 = P + lq_normalize_vjp(A_post, Qc, q_norm, eps) if lq else P
    return (_untm(dK, B, H).to(k.dtype), _untm(dV, B, H).to(v.dtype), _untm(dQ, B, H).to(q.dtype),
            _untm(dAL, B, H).to(alpha.dtype), _untm(dET, B, H).to(eta.dtype),
            dA0.reshape(B, H, Dv, Dk), _final_momentum(dS_carry, momentum, B, H),
            _untm(dBETA, B, H).to(beta.dtype) if dBETA is not None else dA0.new_empty(0))


def forward(k, v, q, alpha, eta, m0, p, a, eps, momentum, q_norm, hebbian=False, bias="", s0=None, beta=None,
            decay_first=False):
    """:func:`forward_recurrent`'s results, from the chunked form where it applies (see :mod:`.chunked`)."""
    recurrent = lambda: forward_recurrent(k, v, q, alpha, eta, m0, p, a, eps, momentum, q_norm, hebbian, bias,  # noqa: E731
                                          s0, beta, decay_first)
    if chunked.uses_chunked(k.shape[1], p, bias, momentum, q_norm, hebbian, k, v, q, alpha, eta, m0):
        return chunked.finite_or_recurrent(lambda: chunked.forward(k, v, q, alpha, eta, m0, hebbian, decay_first),
                                           recurrent)
    return recurrent()


def backward(dy, dA_final, k, v, q, alpha, eta, m0, p, a, eps, momentum, q_norm, hebbian=False, bias="", s0=None,
             dS_final=None, beta=None, decay_first=False):
    """:func:`backward_recurrent`'s results, from the chunked form where it applies (see :mod:`.chunked`; it has
    no momentum, so no dbeta: an empty one is appended)."""
    recurrent = lambda: backward_recurrent(dy, dA_final, k, v, q, alpha, eta, m0, p, a, eps, momentum,  # noqa: E731
                                           q_norm, hebbian, bias, s0, dS_final, beta, decay_first)
    if chunked.uses_chunked(k.shape[1], p, bias, momentum, q_norm, hebbian, k, v, q, alpha, eta, m0, dy,
                            dA_final):
        return chunked.finite_or_recurrent(
            lambda: (*chunked.backward(dy, dA_final, k, v, q, alpha, eta, m0, hebbian, decay_first), dy.new_empty(0)),
            recurrent)
    return recurrent()


def _sequences(cu_seqlens: Optional[torch.Tensor], T: int):
    if cu_seqlens is None:
        return None
    bounds = [int(x) for x in cu_seqlens.tolist()]
    return list(zip(bounds[:-1], bounds[1:]))


def _state_slice(state, n):
    return None if state is None or state.numel() == 0 else state[n:n + 1]


def forward_packed(k, v, q, alpha, eta, m0, cu_seqlens, p, a, eps, momentum, q_norm, hebbian=False, bias="",
                   s0=None, beta=None, decay_first=False):
    """The CPU forward for either layout (packed: one call per sequence)."""
    seqs = _sequences(cu_seqlens, k.shape[1])
    if seqs is None:
        return forward(k, v, q, alpha, eta, m0, p, a, eps, momentum, q_norm, hebbian, bias, s0, beta, decay_first)
    parts = [forward(k[:, bos:eos], v[:, bos:eos], q[:, bos:eos], alpha[:, bos:eos], eta[:, bos:eos],
                     _state_slice(m0, n), p, a, eps, momentum, q_norm, hebbian, bias, _state_slice(s0, n),
                     None if beta is None else beta[:, bos:eos], decay_first)
             for n, (bos, eos) in enumerate(seqs)]
    return tuple(torch.cat([part[i] for part in parts], 1 if i == 0 else 0) for i in range(3))


def backward_packed(dy, dA_final, k, v, q, alpha, eta, m0, cu_seqlens, p, a, eps, momentum, q_norm,
                    hebbian=False, bias="", s0=None, dS_final=None, beta=None, decay_first=False):
    """The CPU backward for either layout."""
    seqs = _sequences(cu_seqlens, k.shape[1])
    if seqs is None:
        return backward(dy, dA_final, k, v, q, alpha, eta, m0, p, a, eps, momentum, q_norm, hebbian, bias, s0,
                        dS_final, beta, decay_first)
    parts = []
    for n, (bos, eos) in enumerate(seqs):
        sl = slice(bos, eos)
        parts.append(backward(dy[:, sl], dA_final[n:n + 1], k[:, sl], v[:, sl], q[:, sl], alpha[:, sl],
                              eta[:, sl], _state_slice(m0, n), p, a, eps, momentum, q_norm,
                              hebbian, bias, _state_slice(s0, n), _state_slice(dS_final, n),
                              None if beta is None else beta[:, sl], decay_first))
    # dk .. deta and dbeta are per token (joined along T), dm0 and ds0 per sequence (along N); no beta: no dbeta
    per_token = (True,) * 5 + (False, False, True)
    return tuple(torch.cat([part[i] for part in parts], 1 if per_token[i] else 0) if i < 7 or beta is not None
                 else parts[0][i] for i in range(8))
