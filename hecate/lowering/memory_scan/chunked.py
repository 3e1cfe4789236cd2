"""The chunked form of the recurrences that are linear in the state.

Two members of ``memory_scan`` update the state linearly (per head, A [Dv, Dk], keep
a_t = 1 − α_t)::

    p = 2 (no momentum, q_norm = 2, no user bias):  A_t = a_t A_{t−1} + w_t k_tᵀ,  w_t = 2η_t (v_t − A_{t−1} k_t)
    Hebbian (linear attention):                     A_t = a_t A_{t−1} + w_t k_tᵀ,  w_t = η_t v_t

The first is the gated delta rule (g = a, β = 2η/a, v' = a v); with α = 0 the delta rule. With ``decay_first``
(w_t = 2η_t (v_t − a_t A_{t−1} k_t), Gated DeltaNet's own order) the error reads P[t, s] and γ_t below where the
delta rule reads P[t−1, s] and γ_{t−1}.
Everything else (general p, p = 1, a user bias g(e), MONETA's q_norm) is nonlinear in the
state and stays fused-recurrent, as does momentum (linear, but its buffer S is a second state the
chunked form does not carry).

Within a chunk of C tokens starting from A_0, with P[t, s] = Π_{r=s+1..t} a_r (P[t, t] = 1)
and γ_t = Π_{r≤t} a_r, the state is A_t = γ_t A_0 + Σ_{s≤t} P[t, s] w_s k_sᵀ, so the
delta-rule w's solve one unit lower-triangular system per chunk, independent of A_0 but
for one product::

    (I + L) W = diag(b) V − diag(b γ_{t−1}) K A_0ᵀ,   L[t, s] = b_t P[t−1, s] (k_s · k_t)  (s < t)
    W = U − Ŵ A_0ᵀ,   U = (I + L)⁻¹ diag(b) V,   Ŵ = (I + L)⁻¹ diag(b γ_{t−1}) K
    Y = diag(γ) Q A_0ᵀ + (P ⊙ Q Kᵀ) W            (P lower-triangular, diagonal included)
    A_C = γ_C A_0 + Wᵀ diag(P[C, :]) K

(Hebbian: L = 0, b = η.) U and Ŵ of every chunk are computed at once; only the C-step
hops between chunk boundaries are sequential. P is formed by a cumulative product, not
as a ratio of γ's, so a keep factor of 0 is exact.
"""

from __future__ import annotations

from typing import Optional

import torch

CHUNK = 64   # tokens per chunk
MIN_T = 64   # below this the fused-recurrent form is as fast (fla switches near the same length)


def applies(p: float, bias: str, momentum: float, q_norm: float, hebbian: bool) -> bool:
    """Whether a chunked form exists: the recurrence is linear in the state and keeps no momentum buffer."""
    return hebbian or (p == 2.0 and not bias and momentum == 0.0 and q_norm == 2.0)


def uses_chunked(T: int, p: float, bias: str, momentum: float, q_norm: float, hebbian: bool,
                 *inputs: Optional[torch.Tensor]) -> bool:
    """The op's choice (CPU and Triton alike): chunked when a chunked form exists, the sequence is at
    least ``MIN_T`` long and every tensor of ``inputs`` is finite.

    Inside a chunk the dense products meet every token (0 · NaN = NaN), so a NaN or inf would also
    reach the reads before it, which the recurrence (and eager) keep finite: such inputs take the
    fused-recurrent form, whose outputs are eager's."""
    return T >= MIN_T and applies(p, bias, momentum, q_norm, hebbian) and all_finite(inputs)


def all_finite(tensors) -> bool:
    """Whether every element of the floating ``tensors`` (None skipped) is finite, by one host sync: the sums are
    finite. A NaN or inf always makes its sum non-finite; a sum of finite values that overflows (beyond 3e38)
    reads as not finite too, which only sends the call to the recurrent form. (A sum reads each tensor once; the
    elementwise ``isfinite(x).all()`` wrote a mask of each, several times slower on the CPU.)"""
    sums = [x.sum(dtype=torch.float64 if x.dtype == torch.float64 else torch.float32)
            for x in tensors if isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel()]
    return not sums or bool(torch.isfinite(torch.stack([s.to(sums[0].dtype) for s in sums])).all())


DIVERGED = 1e18  # a result beyond this in magnitude comes from a diverging recurrence: take the recurrent form


def all_bounded(tensors) -> bool:
    """Whether every element of the floating ``tensors`` (None skipped) is finite and at most ``DIVERGED`` in
    magnitude, by one host sync (one min and max per tensor, no temporaries)."""
    ends = [torch.stack(torch.aminmax(x)).to(torch.float64)
            for x in tensors if isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel()]
    return not ends or bool((torch.cat(ends).abs() <= DIVERGED).all())  # (NaN compares False)


def finite_or_recurrent(chunked_form, recurrent_form):
    """``chunked_form()``'s results if all are finite and bounded, else ``recurrent_form()``'s.

    With finite inputs the chunked form can still overflow where the recurrence does not: a state growing
    without bound (keys with ‖k‖² β > 2 make the delta rule diverge) reaches inf inside a chunk's products,
    and 0 · inf = NaN there reaches the reads before it, which the recurrence (and eager) keep finite until
    the state itself overflows. Before it overflows, such a state has grown by orders of magnitude within
    each chunk, whose products then round its small terms away where the recurrence (and eager) keeps them
    step by step: past ``DIVERGED`` (a float32 state grown ×11 a step reads 2e35 at T = 70, where the chunked
    reads were 7e-6 off float64 against eager's 3e-6) the recurrence gives the results. One check of the
    results (a host sync, as the inputs' check is)."""
    out = chunked_form()
    return out if all_bounded(out) else recurrent_form()


# ---------------------------------------------------------------- the CPU form, in batched ATen
#
# What does not depend on a chunk's start state (P, γ, K Kᵀ, (I + L)⁻¹) is formed for every chunk at once.
# Then the chunks are walked in order, all B·H heads at once: when chunk c starts, its start state A_0 is
# known, so W = (I + L)⁻¹ diag(b) (V − diag(γ_{t−1}) K A_0ᵀ) directly (U − Ŵ A_0ᵀ above, in one product),
# and one chunk's [B·H, C, C] and [B·H, C, D] operands stay in cache. The split into U and Ŵ, which lets
# every chunk's products run at once, is for parallel hardware.
#
# Layout: a sequence is cut into n = ceil(T / C) chunks, chunk-major [n, B·H, C, ...] blocks (one chunk's
# slice is contiguous). The tail is padded with tokens that leave the state as it is (keep 1, step 0,
# k = v = q = 0); their reads are dropped.


def _state_dtype(k: torch.Tensor) -> torch.dtype:
    return torch.float64 if k.dtype == torch.float64 else torch.float32


def _blocks(x: torch.Tensor, n_chunks: int, dtype: torch.dtype, pad_value: float = 0.0) -> torch.Tensor:
    """[B, T, H, *D] -> [n_chunks, B·H, C, *D] in ``dtype``, the tail padded with ``pad_value``."""
    B, T, H = x.shape[:3]
    feature = x.shape[3:]
    x = x.to(dtype)
    pad = n_chunks * CHUNK - T
    if pad:
        x = torch.cat([x, x.new_full((B, pad, H, *feature), pad_value)], 1)
    x = x.reshape(B, n_chunks, CHUNK, H, *feature).permute(1, 0, 3, 2, *range(4, 4 + len(feature)))
    return x.reshape(n_chunks, B * H, CHUNK, *feature)              # from [n, B, H, C, *D]


def _tokens(x: torch.Tensor, B: int, H: int, T: int) -> torch.Tensor:
    """[n, B·H, C, *D] -> [B, T, H, *D] (the padded tail dropped), the inverse of :func:`_blocks`."""
    n_chunks, _, C, *feature = x.shape
    x = x.reshape(n_chunks, B, H, C, *feature).permute(1, 0, 3, 2, *range(4, 4 + len(feature)))
    return x.reshape(B, n_chunks * C, H, *feature)[:, :T].contiguous()


def _decays(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """P [.., C, C] with P[t, s] = Π_{r=s+1..t} a_r on and below the diagonal (0 above), and γ [.., C].

    Column s of P is a cumulative product down the column of the factors a_t below the diagonal (1 on and
    above it), never a ratio of γ's: a keep factor of exactly 0 gives exact zeros, and no 0/0."""
    below = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=keep.device).tril(-1)   # t > s
    factors = torch.where(below, keep.unsqueeze(-1), torch.ones((), dtype=keep.dtype))
    return torch.cumprod(factors, -2).tril(), torch.cumprod(keep, -1)


def _within(K: torch.Tensor, keep: torch.Tensor, b: torch.Tensor, hebbian: bool, decay_first: bool = False) -> tuple:
    """What a chunk needs besides its start state, for every chunk at once ([n, BH, ...]):
    (P, γ, P_prev, γ_prev, K Kᵀ, (I + L)⁻¹) with P_prev[t] = P[t−1], γ_prev[t] = γ_{t−1} (the last two
    None for Hebbian). One batched triangular solve inverts every chunk's I + L: inside the chunk walk,
    the solves are then matrix products. The error's decays (:func:`_error_decays`) are P_prev and γ_prev,
    or with ``decay_first`` P and γ."""
    P, gamma = _decays(keep)                                                # [n, BH, C, C], [n, BH, C]
    P_prev = torch.nn.functional.pad(P[..., :-1, :], (0, 0, 1, 0))          # row 0: 0
    gamma_prev = torch.nn.functional.pad(gamma[..., :-1], (1, 0), value=1.0)  # γ_{−1} = 1
    if hebbian:
        return P, gamma, P_prev, gamma_prev, None, None
    # L[t, s] = b_t P[t−1, s] (k_s · k_t) for s < t (P[t, s] with decay_first); unitriangular: the solve reads
    # only L's strict lower triangle and takes a unit diagonal
    KK = K @ K.transpose(-1, -2)
    L = b.unsqueeze(-1) * (P if decay_first else P_prev) * KK
    identity = torch.eye(CHUNK, dtype=L.dtype, device=L.device).expand_as(L)
    return P, gamma, P_prev, gamma_prev, KK, torch.linalg.solve_triangular(L, identity, upper=False,
                                                                           unitriangular=True)


def _error_decays(within: tuple, decay_first: bool) -> tuple:
    """(P_err, γ_err): what decays the memory the error reads, per (t, s) and per t. The error of token t reads
    A_{t−1}, decayed by the keeps up to t − 1 (P_prev, γ_prev); with ``decay_first`` by a_t too (P, γ)."""
    P, gamma, P_prev, gamma_prev = within[:4]
    return (P, gamma) if decay_first else (P_prev, gamma_prev)


def _solve(A, K, V, b, gamma_err, inverse, hebbian):
    """The chunk's w's, W [BH, C, Dv], and K A_0ᵀ [BH, C, Dv] (None for Hebbian, where W = diag(b) V)."""
    if hebbian:
        return b.unsqueeze(-1) * V, None
    KA = K @ A.transpose(1, 2)
    rhs = torch.addcmul(V, gamma_err.unsqueeze(-1), KA, value=-1.0).mul_(b.unsqueeze(-1))
    return inverse @ rhs, KA                                                # (I + L) W = rhs


def _chunk(A: torch.Tensor, blocks: tuple, within: tuple, hebbian: bool, Y: Optional[torch.Tensor],
           decay_first: bool = False) -> torch.Tensor:
    """One chunk from its start state A [BH, Dv, Dk]: writes its reads into Y [BH, C, Dv] (None: no reads, as
    the backward's pass over the start states needs none), returns the end state.

    ``blocks``: the chunk's K, V, Q [BH, C, D], keep a_t and step b_t (η_t Hebbian, 2η_t delta rule) [BH, C];
    ``within``: the chunk's slice of :func:`_within`. In place where it can: on CPU every fresh buffer of this
    size costs page faults."""
    K, V, Q, _, b = blocks
    P, gamma, _, _, _, inverse = within
    W = _solve(A, K, V, b, _error_decays(within, decay_first)[1], inverse, hebbian)[0]
    # Y = diag(γ) Q A_0ᵀ + (P ⊙ Q Kᵀ) W
    if Y is not None:
        torch.baddbmm((Q @ A.transpose(1, 2)).mul_(gamma.unsqueeze(-1)), (Q @ K.transpose(1, 2)).mul_(P), W,
                      out=Y)
    # A_end = γ_C A_0 + Wᵀ diag(P[C, :]) K
    return torch.baddbmm(gamma[:, -1, None, None] * A, W.mul_(P[:, -1].unsqueeze(-1)).transpose(1, 2), K)


def _chunk_backward(A, blocks, within, hebbian, dY, dA_end, decay_first=False):
    """The reverse of :func:`_chunk`: (dA_0, dK, dV, dQ, dkeep, db) from dY [BH, C, Dv] and dA_end [BH, Dv, Dk]."""
    K, V, Q, _, b = blocks
    P, gamma, P_prev, gamma_prev, KK, inverse = within
    P_err, gamma_err = _error_decays(within, decay_first)
    W, KA = _solve(A, K, V, b, gamma_err, inverse, hebbian)
    QK, QA = Q @ K.transpose(1, 2), Q @ A.transpose(1, 2)
    dP, dgamma = torch.zeros_like(P), torch.zeros_like(gamma)
    # A_end = γ_C A_0 + Zᵀ K,  Z = diag(P[C, :]) W
    last = P[:, -1].unsqueeze(-1)                                           # [BH, C, 1]
    dZ = K @ dA_end.transpose(1, 2)                                         # [BH, C, Dv]
    dA = gamma[:, -1, None, None] * dA_end
    dK = (last * W) @ dA_end
    dW = last * dZ
    dP[:, -1] = (W * dZ).sum(-1)
    dgamma[:, -1] = (dA_end * A).sum((1, 2))
    # Y = diag(γ) Q A_0ᵀ + M W,  M = P ⊙ Q Kᵀ
    dgamma += (dY * QA).sum(-1)
    dQA = gamma.unsqueeze(-1) * dY
    dQ = dQA @ A
    dA += dQA.transpose(1, 2) @ Q
    dW += (P * QK).transpose(1, 2) @ dY
    dM = dY @ W.transpose(1, 2)
    dP += dM * QK
    dQK = dM * P
    dQ += dQK @ K
    dK += dQK.transpose(1, 2) @ Q
    if hebbian:                                                             # W = diag(b) V
        db, dV = (dW * V).sum(-1), b.unsqueeze(-1) * dW
    else:
        # W = (I + L)⁻¹ rhs: d rhs = (I + L)⁻ᵀ dW, dL = −d rhs Wᵀ (strict lower part: L's only entries)
        drhs = inverse.transpose(1, 2) @ dW
        dL = -(drhs @ W.transpose(1, 2)).tril(-1)
        # rhs = diag(b) E,  E = V − diag(γ_err) K A_0ᵀ
        E = V - gamma_err.unsqueeze(-1) * KA
        dV = b.unsqueeze(-1) * drhs
        dKA = -gamma_err.unsqueeze(-1) * dV
        dK += dKA @ A
        dA += dKA.transpose(1, 2) @ K
        # L = diag(b) (P_err ⊙ K Kᵀ)
        db = (drhs * E).sum(-1) + (dL * P_err * KK).sum(-1)
        dKK = b.unsqueeze(-1) * P_err * dL
        dK += (dKK + dKK.transpose(1, 2)) @ K
        dP_err, dgamma_err = b.unsqueeze(-1) * KK * dL, -(dV * KA).sum(-1)
        if decay_first:
            dP += dP_err
            dgamma += dgamma_err
        else:
            dP[:, :-1] += dP_err[:, 1:]                                      # P_prev[t] = P[t−1]
            dgamma[:, :-1] += dgamma_err[:, 1:]                              # γ_prev[t] = γ_{t−1}
    # P[t, s] and γ_t are products of keeps: ∂/∂a_r leaves a_r out, P[r−1, s] · P[t, r] (γ_{r−1} · P[t, r]),
    # so da_r = Σ_{s<r} P[r−1, s] (Pᵀ dP)[r, s] + γ_{r−1} (Pᵀ dγ)_r: no division, a keep of 0 is exact
    Pt = P.transpose(1, 2)
    dkeep = (P_prev * (Pt @ dP)).sum(-1) + gamma_prev * (Pt @ dgamma.unsqueeze(-1)).squeeze(-1)
    return dA, dK, dV, dQ, dkeep, db


def _inputs(k, v, q, alpha, eta, m0, hebbian):
    """The blocks (K, V, Q, keep, b) [n, BH, C, ...] and the start state A_0 [BH, Dv, Dk] in the state dtype."""
    B, T, H, Dk = k.shape
    Dv = v.shape[-1]
    dtype = _state_dtype(k)
    n_chunks = max(1, -(-T // CHUNK))
    blocks = (_blocks(k, n_chunks, dtype), _blocks(v, n_chunks, dtype), _blocks(q, n_chunks, dtype),
              _blocks(1.0 - alpha.double(), n_chunks, dtype, pad_value=1.0),  # 1 − α in float64: see cpu._prepare
              _blocks(eta, n_chunks, dtype) * (1.0 if hebbian else 2.0))
    A = m0.to(dtype).reshape(B * H, Dv, Dk) if m0 is not None else k.new_zeros(B * H, Dv, Dk, dtype=dtype)
    return blocks, A


def _at(tensors: tuple, c: int) -> tuple:
    """Chunk c's slice of each of ``tensors`` ([n, ...] or None)."""
    return tuple(None if x is None else x[c] for x in tensors)


def forward(k: torch.Tensor, v: torch.Tensor, q: torch.Tensor, alpha: torch.Tensor, eta: torch.Tensor,
            m0: Optional[torch.Tensor], hebbian: bool,
            decay_first: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``cpu.forward`` for the two linear members: y [B, T, H, Dv] (dtype of v), A_T [B, H, Dv, Dk] and the empty
    momentum state, from k, q [B, T, H, Dk], v [B, T, H, Dv], alpha (forget rate), eta [B, T, H], m0 or None.

    ``hebbian``: w_t = η_t v_t (linear attention); else w_t = 2η_t (v_t − A_{t−1} k_t) (p = 2), or with
    ``decay_first`` 2η_t (v_t − a_t A_{t−1} k_t)."""
    B, T, H, Dk = k.shape
    blocks, A = _inputs(k, v, q, alpha, eta, m0, hebbian)
    within = _within(blocks[0], blocks[3], blocks[4], hebbian, decay_first)
    Y = torch.empty_like(blocks[1])                                         # [n, BH, C, Dv]
    for c in range(Y.shape[0]):
        A = _chunk(A, _at(blocks, c), _at(within, c), hebbian, Y[c], decay_first)
    y = _tokens(Y, B, H, T)
    return y.to(v.dtype), A.reshape(B, H, *A.shape[1:]), A.new_empty(0)


def backward(dy: torch.Tensor, dA_final: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor,
             alpha: torch.Tensor, eta: torch.Tensor, m0: Optional[torch.Tensor], hebbian: bool,
             decay_first: bool = False) -> tuple[torch.Tensor, ...]:
    """``cpu.backward`` for the two linear members: (dk, dv, dq, dalpha, deta, dm0, empty ds0).

    As in the recurrent backward, the forward is re-run keeping only the chunk start states (n of them); then
    each chunk, last first, is recomputed and pulled back (:func:`_chunk_backward`) from (dY_c, dA_end) to its
    inputs and dA_0, which is the previous chunk's dA_end."""
    B, T, H, Dk = k.shape
    Dv = v.shape[-1]
    blocks, A = _inputs(k, v, q, alpha, eta, m0, hebbian)
    within = _within(blocks[0], blocks[3], blocks[4], hebbian, decay_first)
    n_chunks = blocks[0].shape[0]
    starts = []
    for c in range(n_chunks):
        starts.append(A)
        A = _chunk(A, _at(blocks, c), _at(within, c), hebbian, None, decay_first)
    dY = _blocks(dy, n_chunks, A.dtype)
    dA = dA_final.to(A.dtype).reshape(A.shape)
    dblocks = [torch.empty_like(x) for x in blocks]
    for c in range(n_chunks - 1, -1, -1):
        dA, *dchunk = _chunk_backward(starts[c], _at(blocks, c), _at(within, c), hebbian, dY[c], dA, decay_first)
        for dx, dx_c in zip(dblocks, dchunk):
            dx[c] = dx_c
    dk, dv, dq, dkeep, db = (_tokens(dx, B, H, T) for dx in dblocks)
    return (dk.to(k.dtype), dv.to(v.dtype), dq.to(q.dtype), (-dkeep).to(alpha.dtype),
            (db * (1.0 if hebbian else 2.0)).to(eta.dtype), dA.reshape(B, H, Dv, Dk), dA.new_empty(0))
