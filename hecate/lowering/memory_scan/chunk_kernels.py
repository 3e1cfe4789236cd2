"""Triton kernels of the chunked form of the two recurrences that are linear in the state.

Mathematics (derivation and the rule that picks this form: :mod:`.chunked`). Per head, state A [Dv, Dk],
keep a_t = 1 − α_t; for a chunk of C tokens starting from A_0, with

    P[t, s]  = Π_{s<r≤t} a_r  (s ≤ t, else 0)      γ_t  = Π_{r≤t} a_r       ρ_s = P[C−1, s]
    P⁻[t, s] = Π_{s<r≤t−1} a_r  (s < t, else 0)    γ⁻_t = Π_{r≤t−1} a_r     (the same, one token earlier)

    delta rule (p = 2):  L = diag(b) (P⁻ ⊙ K Kᵀ) (strictly lower),  b = 2η
                         U = (I + L)⁻¹ diag(b) V,  Ŵ = (I + L)⁻¹ diag(b γ⁻) K,  W = U − Ŵ A_0ᵀ
    Hebbian:             W = diag(η) V
    Y   = diag(γ) Q A_0ᵀ + (P ⊙ Q Kᵀ) W
    A_C = γ_{C−1} A_0 + Wᵀ diag(ρ) K

Every P is a cumulative product down the columns of a masked matrix of keep factors, never a ratio of
γ's, so a keep factor of 0 is exact.

Kernels (fp32 arithmetic and fp32 ``tl.dot`` whatever the input dtype, as three TF32 products ("tf32x3",
fp32's accuracy on tensor cores) where the GPU has them, else "ieee" (:func:`dot_precision`); fp16/bf16
k, v, q are read and widened, y is written in the dtype of v):

1. :func:`delta_prepare_kernel` (delta rule only), one program per (chunk, sequence·head), all in parallel:
   L, (I + L)⁻¹ by forward substitution in registers, U and Ŵ.
2. :func:`chunk_forward_kernel`, one program per (value tile, sequence·head), sequential over the chunks of
   its sequence, carrying its rows of A: W, Y, A ← γ_{C−1} A + Wᵀ diag(ρ) K. It optionally keeps A at
   every chunk start (for the backward).
3. :func:`chunk_backward_kernel`, one program per (value tile, sequence·head), in reverse over the chunks,
   carrying D = ∂loss/∂A at the chunk's end (dm_final at the last), from the chunk-start states A_0 that a
   re-run of 1-2 kept. Through Y and A_C (both recurrences):

       dW  = diag(ρ) K Dᵀ + (P ⊙ Q Kᵀ)ᵀ dY
       dK  = diag(ρ) W D  + (P ⊙ dY Wᵀ)ᵀ Q
       dQ  = diag(γ) dY A_0 + (P ⊙ dY Wᵀ) K
       da  = γ⁻ ⊙ ρ ⟨D, A_0⟩ + γ⁻ ⊙ Pᵀx + ρ ⊙ P⁻z + colsum(P ⊙ (R P⁻ᵀ))       (dα = −da)
             x_t = dy_t · A_0 q_t,  z_s = w_s · D k_s,  R = (dY Wᵀ ⊙ Q Kᵀ) on s ≤ t
       D  ← γ_{C−1} D + dYᵀ diag(γ) Q                    (dm0 = D after the first chunk)

   Through W: Hebbian dv = diag(η) dW, dη_t = v_t · dW_t. Delta rule, with (I + L) W = rhs =
   diag(b) V − diag(b γ⁻) K A_0ᵀ (the kernel recomputes (I + L)⁻¹ and W):

       d rhs = (I + L)⁻ᵀ dW,   dL = −d rhs Wᵀ (strictly lower),   dv = diag(b) d rhs
       db_t  = d rhs_t · (v_t − γ⁻_t A_0 k_t) + Σ_s dL[t, s] P⁻[t, s] (k_t · k_s),   dη = 2 db
       dK   += G K + Gᵀ K − diag(b γ⁻) d rhs A_0,   G = dL ⊙ diag(b) P⁻
       da   += γ⁻ ⊙ P⁻ᵀ dγ⁻ + colsum(P⁻ ⊙ (dP⁻ P⁻ᵀ)),  dγ⁻_t = −b_t d rhs_t · A_0 k_t,  dP⁻ = dL ⊙ diag(b) K Kᵀ
       D    −= d rhsᵀ diag(b γ⁻) K

   (da_r sums, over every product P, P⁻, γ, γ⁻, ρ that contains a_r, that product with a_r left out, written
   as matrix products: exact at a_r = 0, no division.) Every term is a sum over value rows, so each value tile
   writes partials of dk, dq, dα, dη that the launcher sums.

Layout (contiguous): k, q [B, T, H, Dk]; v, y [B, T, H, Dv]; alpha, eta [B, T, H]; u [B, T, H, Dv] and
w_hat [B, T, H, Dk] fp32; m0, m_final [N, H, Dv, Dk]. Packed sequences (cu_seqlens, B = 1) use rows
bos..eos−1; chunks start at each sequence's bos and never cross a boundary. Chunk-start states for the
backward: [N·ceil(T/C) (or T//C + N packed), H, Dv, Dk] fp32, the slots of :func:`.kernels._sequence`.

NaN and inf propagate (no tl.maximum / tl.minimum, causal masks by tl.where, not by a product with 0);
the matrix products mix a chunk's tokens, so a non-finite input may also turn the outputs of the earlier
tokens of its chunk NaN, where the recurrence poisons only its own token's and the later ones. The ops
therefore send non-finite inputs to the fused-recurrent kernels (:func:`.chunked.uses_chunked`).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from hecate.lowering.memory_scan import chunked
from hecate.lowering.memory_scan.kernels import _check_dtypes, _contiguous, _layout, _sequence

# value rows per program of the sequential kernels (and the value block of the prepare kernel)
MAX_BLOCK_V = 32
# tl.dot needs every dimension >= 16 on a GPU
MIN_BLOCK = 16


@triton.jit
def _decays(keep, o_c, LAG: tl.constexpr):
    # [C, C]: M[t, s] = Π_{s+LAG < r ≤ t} keep_r for t ≥ s + LAG, else 0 (LAG 0: P from keep = a;
    # LAG 1: P⁻ from keep_r = a_{r−1}), a cumulative product down each column (exact with zeros)
    factors = tl.where(o_c[:, None] > o_c[None, :] + LAG, keep[:, None], 1.0)
    return tl.where(o_c[:, None] >= o_c[None, :] + LAG, tl.cumprod(factors, 0), 0.0)


@triton.jit
def _last_entry(x, o_c, CHUNK: tl.constexpr):
    # x[C − 1] of a [C] vector (the padding's keep factors are 1, so in a tail chunk it equals the last valid one)
    return tl.sum(tl.where(o_c == CHUNK - 1, x, 0.0), 0)


@triton.jit
def _last_row(M, o_c, CHUNK: tl.constexpr):
    # M[C − 1, :] of a [C, C] matrix (in a tail chunk, the last valid row: see _last_entry)
    return tl.sum(tl.where(o_c[:, None] == CHUNK - 1, M, 0.0), 0)


@triton.jit
def _chunk_gates(alpha, eta, rows, mask_c, o_c, H: tl.constexpr):
    # a_t = 1 − α_t and a⁻_t = a_{t−1} [C] (1 in the padding and at t = 0), η_t [C] (0 in the padding)
    # (1 − α in alpha's own dtype first: a float64 α near 1 keeps the digits of a keep near 0)
    keep = (1.0 - tl.load(alpha + rows, mask=mask_c, other=0.0)).to(tl.float32)
    keep_prev = (1.0 - tl.load(alpha + rows - H, mask=mask_c & (o_c > 0), other=0.0)).to(tl.float32)
    step = tl.load(eta + rows, mask=mask_c, other=0.0).to(tl.float32)
    return keep, keep_prev, step


@triton.jit
def _load_rows(x, rows, cols, mask_c, mask_cols, WIDTH: tl.constexpr):
    # [C, len(cols)] fp32 block of a [rows, WIDTH] tensor, 0 outside the masks
    return tl.load(x + rows[:, None] * WIDTH + cols[None, :], mask=mask_c[:, None] & mask_cols[None, :],
                   other=0.0).to(tl.float32)


@triton.jit
def _unit_lower_inverse(L, o_c, CHUNK: tl.constexpr):
    # (I + L)⁻¹ [C, C] for strictly lower-triangular L, by forward substitution: row i of the inverse is
    # e_i − L[i, :] (I + L)⁻¹, which reads only the rows j < i already final (L[i, j] = 0 for j ≥ i)
    eye = tl.where(o_c[:, None] == o_c[None, :], 1.0, 0.0)
    inverse = eye
    for i in range(1, CHUNK):
        l_i = tl.sum(tl.where(o_c[:, None] == i, L, 0.0), 0)  # L[i, :]  [C]
        row = tl.sum(l_i[:, None] * inverse, 0)                # L[i, :] (I + L)⁻¹  [C]
        inverse = tl.where(o_c[:, None] == i, eye - row[None, :], inverse)
    return inverse


@triton.jit
def _error_gates(keep, keep_prev, DECAY_FIRST: tl.constexpr):
    # the keeps whose products decay the memory the error reads: a⁻ (A_{t−1} as it is), or a (decayed first)
    if DECAY_FIRST:
        return keep
    return keep_prev


@triton.jit
def _delta_system(K, keep_err, b, o_c, CHUNK: tl.constexpr, DOT: tl.constexpr, DECAY_FIRST: tl.constexpr):
    # (P_err, K Kᵀ, (I + L)⁻¹) [C, C] of the delta rule's chunk, L = diag(b) (P_err ⊙ K Kᵀ) strictly lower,
    # P_err = P⁻ (from keep_err = a⁻), or P (from keep_err = a) with DECAY_FIRST
    if DECAY_FIRST:
        P_err = _decays(keep_err, o_c, 0)
    else:
        P_err = _decays(keep_err, o_c, 1)
    KK = tl.dot(K, tl.trans(K), input_precision=DOT)
    L = tl.where(o_c[:, None] > o_c[None, :], b[:, None] * P_err * KK, 0.0)
    return P_err, KK, _unit_lower_inverse(L, o_c, CHUNK)


@triton.jit
def _state_tile(i_v, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, CHUNK: tl.constexpr):
    # the offsets of a sequential program: chunk rows o_c [C], key columns o_k [BK], its value rows o_v [BV],
    # their masks, the offsets of its [BV, BK] tile inside one [DV, DK] state, and the causal [C, C] mask
    o_c = tl.arange(0, CHUNK)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_k, mask_v = o_k < DK, o_v < DV
    mask_kv = mask_v[:, None] & mask_k[None, :]
    tile = o_v[:, None] * DK + o_k[None, :]
    causal = o_c[:, None] >= o_c[None, :]
    return o_c, o_k, o_v, mask_k, mask_v, mask_kv, tile, causal


@triton.jit
def delta_prepare_kernel(
    k, v, alpha, eta, u, w_hat, cu_seqlens, T,
    H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    CHUNK: tl.constexpr, VARLEN: tl.constexpr, DOT: tl.constexpr, DECAY_FIRST: tl.constexpr,
):
    # grid (max chunks per sequence, N·H); writes u [rows, DV] and w_hat [rows, DK] fp32 of its chunk
    i_c, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, length, _ = _sequence(cu_seqlens, i_n, T, CHUNK, VARLEN)
    start = i_c * CHUNK
    o_c = tl.arange(0, CHUNK)
    o_k = tl.arange(0, BK)
    mask_c, mask_k = o_c < length - start, o_k < DK  # a program past its sequence's end masks everything
    rows = (bos + start + o_c) * H + i_h
    K = _load_rows(k, rows, o_k, mask_c, mask_k, DK)  # [C, BK]
    keep, keep_prev, step = _chunk_gates(alpha, eta, rows, mask_c, o_c, H)
    b = 2.0 * step
    keep_err = _error_gates(keep, keep_prev, DECAY_FIRST)
    _, _, inverse = _delta_system(K, keep_err, b, o_c, CHUNK, DOT, DECAY_FIRST)
    gamma_err = tl.cumprod(keep_err, 0)
    W_hat = tl.dot(inverse, (b * gamma_err)[:, None] * K, input_precision=DOT)  # [C, BK]
    tl.store(w_hat + rows[:, None] * DK + o_k[None, :], W_hat, mask=mask_c[:, None] & mask_k[None, :])
    for i_v in range(0, tl.cdiv(DV, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        mask_v = o_v < DV
        V = _load_rows(v, rows, o_v, mask_c, mask_v, DV)  # [C, BV]
        U = tl.dot(inverse, b[:, None] * V, input_precision=DOT)
        tl.store(u + rows[:, None] * DV + o_v[None, :], U, mask=mask_c[:, None] & mask_v[None, :])


@triton.jit
def chunk_forward_kernel(
    k, v, q, alpha, eta, u, w_hat, m0, y, m_final, states, cu_seqlens, T,
    H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    CHUNK: tl.constexpr, HAS_M0: tl.constexpr, STORE_STATES: tl.constexpr, VARLEN: tl.constexpr,
    HEBBIAN: tl.constexpr, DOT: tl.constexpr,
):
    # grid (cdiv(DV, BV), N·H); rows BV of the state A [BV, BK] fp32 on chip across the chunks
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, length, slot0 = _sequence(cu_seqlens, i_n, T, CHUNK, VARLEN)
    o_c, o_k, o_v, mask_k, mask_v, mask_kv, tile, causal = _state_tile(i_v, DK, DV, BK, BV, CHUNK)

    A = tl.zeros([BV, BK], dtype=tl.float32)
    if HAS_M0:
        A = tl.load(m0 + i_nh * DV * DK + tile, mask=mask_kv, other=0.0).to(tl.float32)
    for c in range(0, tl.cdiv(length, CHUNK)):
        if STORE_STATES:
            tl.store(states + ((slot0 + c) * H + i_h) * DV * DK + tile, A, mask=mask_kv)
        mask_c = o_c < length - c * CHUNK
        rows = (bos + c * CHUNK + o_c) * H + i_h
        Q = _load_rows(q, rows, o_k, mask_c, mask_k, DK)  # [C, BK]
        K = _load_rows(k, rows, o_k, mask_c, mask_k, DK)  # [C, BK]
        keep, _, step = _chunk_gates(alpha, eta, rows, mask_c, o_c, H)
        P = _decays(keep, o_c, 0)  # [C, C]
        gamma = tl.cumprod(keep, 0)  # [C]
        if HEBBIAN:
            W = step[:, None] * _load_rows(v, rows, o_v, mask_c, mask_v, DV)  # [C, BV]
        else:
            W = _load_rows(u, rows, o_v, mask_c, mask_v, DV) - tl.dot(
                _load_rows(w_hat, rows, o_k, mask_c, mask_k, DK), tl.trans(A), input_precision=DOT)
        QK = tl.where(causal, P * tl.dot(Q, tl.trans(K), input_precision=DOT), 0.0)  # P ⊙ QKᵀ  [C, C]
        Y = gamma[:, None] * tl.dot(Q, tl.trans(A), input_precision=DOT) + tl.dot(QK, W, input_precision=DOT)
        tl.store(y + rows[:, None] * DV + o_v[None, :], Y.to(y.dtype.element_ty),
                 mask=mask_c[:, None] & mask_v[None, :])
        rho = _last_row(P, o_c, CHUNK)  # [C]
        A = _last_entry(gamma, o_c, CHUNK) * A + tl.dot(tl.trans(W * rho[:, None]), K, input_precision=DOT)
    tl.store(m_final + i_nh * DV * DK + tile, A, mask=mask_kv)


@triton.jit
def chunk_backward_kernel(
    k, v, q, alpha, eta, dy, dm_final, states, dk_part, dv, dq_part, dalpha_part, deta_part, dm0, cu_seqlens,
    T, ROWS,
    H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    CHUNK: tl.constexpr, VARLEN: tl.constexpr, HEBBIAN: tl.constexpr, DOT: tl.constexpr,
    DECAY_FIRST: tl.constexpr,
):
    # grid (NV = cdiv(DV, BV), N·H), in reverse over the chunks carrying D [BV, BK] = ∂loss/∂A at the chunk's
    # end. Partials over value tiles (every term is a sum over value rows): dk_part, dq_part [NV, ROWS, DK];
    # dalpha_part, deta_part [NV, ROWS] (ROWS = B·T·H). dv [B, T, H, DV]; dm0 [N, H, DV, DK] fp32; states
    # [slots, H, DV, DK] the chunk starts A_0. The delta rule recomputes its chunk's (I + L)⁻¹ and W here.
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, length, slot0 = _sequence(cu_seqlens, i_n, T, CHUNK, VARLEN)
    o_c, o_k, o_v, mask_k, mask_v, mask_kv, tile, causal = _state_tile(i_v, DK, DV, BK, BV, CHUNK)

    D = tl.load(dm_final + i_nh * DV * DK + tile, mask=mask_kv, other=0.0).to(tl.float32)
    n_chunks = tl.cdiv(length, CHUNK)
    for ci in range(0, n_chunks):
        c = n_chunks - 1 - ci
        A0 = tl.load(states + ((slot0 + c) * H + i_h) * DV * DK + tile, mask=mask_kv, other=0.0)  # [BV, BK]
        mask_c = o_c < length - c * CHUNK
        rows = (bos + c * CHUNK + o_c) * H + i_h
        Q = _load_rows(q, rows, o_k, mask_c, mask_k, DK)  # [C, BK]
        K = _load_rows(k, rows, o_k, mask_c, mask_k, DK)  # [C, BK]
        V = _load_rows(v, rows, o_v, mask_c, mask_v, DV)  # [C, BV]
        dY = _load_rows(dy, rows, o_v, mask_c, mask_v, DV)  # [C, BV]
        keep, keep_prev, step = _chunk_gates(alpha, eta, rows, mask_c, o_c, H)
        P = _decays(keep, o_c, 0)
        gamma, gamma_prev = tl.cumprod(keep, 0), tl.cumprod(keep_prev, 0)
        rho = _last_row(P, o_c, CHUNK)
        P_prev = _decays(keep_prev, o_c, 1)
        if HEBBIAN:
            W = step[:, None] * V  # [C, BV]
        else:
            b = 2.0 * step
            keep_err = _error_gates(keep, keep_prev, DECAY_FIRST)
            P_err, KK, inverse = _delta_system(K, keep_err, b, o_c, CHUNK, DOT, DECAY_FIRST)
            gamma_err = tl.cumprod(keep_err, 0)
            KA0 = tl.dot(K, tl.trans(A0), input_precision=DOT)  # row t: (A_0 k_t)ᵀ  [C, BV]
            rhs = b[:, None] * V - (b * gamma_err)[:, None] * KA0  # (I + L) W = rhs
            W = tl.dot(inverse, rhs, input_precision=DOT)  # [C, BV]

        # through Y = diag(γ) Q A_0ᵀ + (P ⊙ Q Kᵀ) W and A_C = γ_{C−1} A_0 + Wᵀ diag(ρ) K
        QK = tl.dot(Q, tl.trans(K), input_precision=DOT)  # [C, C]
        KD = tl.dot(K, tl.trans(D), input_precision=DOT)  # K Dᵀ  [C, BV]
        dW = rho[:, None] * KD + tl.dot(tl.trans(tl.where(causal, P * QK, 0.0)), dY, input_precision=DOT)
        dYW = tl.dot(dY, tl.trans(W), input_precision=DOT)  # [C, C]
        dYW_decayed = tl.where(causal, P * dYW, 0.0)
        dK = rho[:, None] * tl.dot(W, D, input_precision=DOT) + tl.dot(tl.trans(dYW_decayed), Q,
                                                                          input_precision=DOT)
        dQ = gamma[:, None] * tl.dot(dY, A0, input_precision=DOT) + tl.dot(dYW_decayed, K, input_precision=DOT)
        x = tl.sum(dY * tl.dot(Q, tl.trans(A0), input_precision=DOT), 1)  # dy_t · A_0 q_t  [C]
        z = tl.sum(W * KD, 1)  # w_s · D k_s  [C]
        R = tl.where(causal, dYW * QK, 0.0)
        d_keep = (gamma_prev * rho * tl.sum(tl.sum(D * A0, 1), 0) + gamma_prev * tl.sum(P * x[:, None], 0)
                  + rho * tl.sum(P_prev * z[None, :], 1)
                  + tl.sum(P * tl.dot(R, tl.trans(P_prev), input_precision=DOT), 0))
        D_next = _last_entry(gamma, o_c, CHUNK) * D + tl.dot(tl.trans(dY * gamma[:, None]), Q, input_precision=DOT)

        if HEBBIAN:  # W = diag(η) V
            dV = step[:, None] * dW
            d_step = tl.sum(V * dW, 1)
        else:  # W = (I + L)⁻¹ rhs: d rhs = (I + L)⁻ᵀ dW, dL = −d rhs Wᵀ (strictly lower); on to b, P⁻, γ⁻, K, A_0
            d_rhs = tl.dot(tl.trans(inverse), dW, input_precision=DOT)  # [C, BV]
            dV = b[:, None] * d_rhs
            dL = tl.where(o_c[:, None] > o_c[None, :], -tl.dot(d_rhs, tl.trans(W), input_precision=DOT), 0.0)
            d_step = 2.0 * (tl.sum(d_rhs * (V - gamma_err[:, None] * KA0), 1) + tl.sum(dL * P_err * KK, 1))
            d_gamma_err = -b * tl.sum(d_rhs * KA0, 1)  # [C]
            dKK = dL * b[:, None] * P_err  # [C, C]
            dK += (tl.dot(dKK, K, input_precision=DOT) + tl.dot(tl.trans(dKK), K, input_precision=DOT)
                   - (b * gamma_err)[:, None] * tl.dot(d_rhs, A0, input_precision=DOT))
            dP_err = dL * b[:, None] * KK
            # P_err, γ_err are P, γ (∂/∂a_r as those of the reads) or P⁻, γ⁻
            d_keep += (gamma_prev * tl.sum(P_err * d_gamma_err[:, None], 0)
                       + tl.sum(P_err * tl.dot(dP_err, tl.trans(P_prev), input_precision=DOT), 0))
            D_next -= tl.dot(tl.trans(d_rhs * (b * gamma_err)[:, None]), K, input_precision=DOT)

        tl.store(dv + rows[:, None] * DV + o_v[None, :], dV.to(dv.dtype.element_ty),
                 mask=mask_c[:, None] & mask_v[None, :])
        tl.store(deta_part + i_v * ROWS + rows, d_step, mask=mask_c)
        tl.store(dalpha_part + i_v * ROWS + rows, -d_keep, mask=mask_c)
        mask_ck = mask_c[:, None] & mask_k[None, :]
        tl.store(dk_part + (i_v * ROWS + rows[:, None]) * DK + o_k[None, :], dK, mask=mask_ck)
        tl.store(dq_part + (i_v * ROWS + rows[:, None]) * DK + o_k[None, :], dQ, mask=mask_ck)
        D = D_next
    tl.store(dm0 + i_nh * DV * DK + tile, D, mask=mask_kv)


def dot_precision(x: torch.Tensor) -> str:
    """The products' precision: "tf32x3" on GPUs with TF32 tensor cores (sm_80 and newer), three TF32
    products that together keep fp32's accuracy; "ieee" elsewhere. fp32 "ieee" dots have no tensor-core
    form: they unroll into FMAs, which made the backward kernel take 45 s to compile for sm_90 (18 s as
    tf32x3, on 2 cores) and keep the chunked form slow."""
    if x.is_cuda and torch.cuda.get_device_capability(x.device) >= (8, 0):
        return "tf32x3"
    return "ieee"


def _chunk_size(chunk: Optional[int]) -> int:
    chunk = chunked.CHUNK if chunk is None else chunk
    if chunk < MIN_BLOCK or chunk & (chunk - 1):
        raise ValueError(f"memory_scan chunk kernels: chunk must be a power of two >= {MIN_BLOCK}, got {chunk}")
    return chunk


def _blocks(DK: int, DV: int) -> tuple[int, int]:
    return max(MIN_BLOCK, triton.next_power_of_2(DK)), min(max(MIN_BLOCK, triton.next_power_of_2(DV)), MAX_BLOCK_V)


def _longest(T: int, cu_seqlens: Optional[torch.Tensor]) -> int:
    return T if cu_seqlens is None else int((cu_seqlens[1:] - cu_seqlens[:-1]).max())


def _state_slots(B: int, T: int, N: int, chunk: int, varlen: bool) -> int:
    # the chunk-start slots of kernels._sequence: ceil(T/C) per sequence, or T//C + N packed
    return T // chunk + N if varlen else B * triton.cdiv(T, chunk)


def _launch_forward(k, v, q, alpha, eta, m0, cu_seqlens, hebbian, chunk, y, m_final, states, decay_first=False):
    B, T, H, DK, DV, N = _layout(k, v, cu_seqlens)
    BK, BV = _blocks(DK, DV)
    dot = dot_precision(k)
    f32 = dict(dtype=torch.float32, device=k.device)
    if hebbian:
        u = w_hat = k  # not read
    else:
        u, w_hat = torch.empty(B, T, H, DV, **f32), torch.empty(B, T, H, DK, **f32)
        delta_prepare_kernel[(triton.cdiv(_longest(T, cu_seqlens), chunk), N * H)](
            k, v, alpha, eta, u, w_hat, cu_seqlens if cu_seqlens is not None else k, T,
            H=H, DK=DK, DV=DV, BK=BK, BV=BV, CHUNK=chunk, VARLEN=cu_seqlens is not None, DOT=dot,
            DECAY_FIRST=decay_first)
    chunk_forward_kernel[(triton.cdiv(DV, BV), N * H)](
        k, v, q, alpha, eta, u, w_hat, m0 if m0 is not None else k, y, m_final,
        states if states is not None else k, cu_seqlens if cu_seqlens is not None else k, T,
        H=H, DK=DK, DV=DV, BK=BK, BV=BV, CHUNK=chunk, HAS_M0=m0 is not None, STORE_STATES=states is not None,
        VARLEN=cu_seqlens is not None, HEBBIAN=hebbian, DOT=dot)


def forward(k, v, q, alpha, eta, m0, cu_seqlens, hebbian=False, chunk=None, decay_first=False):
    """(y [B, T, H, Dv] in the dtype of v, m_final [N, H, Dv, Dk] fp32, empty s_final) of ``memory_scan``
    with p = 2, no bias, no momentum, q_norm = 2 (the delta rule), or its Hebbian mode (``hebbian``:
    A ← (1 − α) A + η v kᵀ, linear attention). ``chunk``: tokens per chunk, a power of two >= 16
    (default :data:`.chunked.CHUNK`). ``decay_first``: the delta rule's error reads the decayed memory
    (Gated DeltaNet's order; P⁻, γ⁻ become P, γ in L and the right-hand side)."""
    _check_dtypes(k)
    chunk = _chunk_size(chunk)
    k, v, q, alpha, eta, m0, cu_seqlens = _contiguous(k, v, q, alpha, eta, m0, cu_seqlens)
    B, T, H, DK, DV, N = _layout(k, v, cu_seqlens)
    y = torch.empty_like(v)
    m_final = torch.empty(N, H, DV, DK, dtype=torch.float32, device=k.device)
    _launch_forward(k, v, q, alpha, eta, m0, cu_seqlens, hebbian, chunk, y, m_final, None, decay_first)
    return y, m_final, m_final.new_empty(0)


def backward(dy, dm_final, k, v, q, alpha, eta, m0, cu_seqlens, hebbian=False, chunk=None, decay_first=False):
    """(dk, dv, dq, dalpha, deta, dm0, ds0) of :func:`forward` (as :func:`.kernels.backward`; ds0 empty): re-run
    the chunked forward keeping the state at every chunk start, then the reverse chunk kernel. dm0 is fp32
    (zeros-shaped when m0 is None)."""
    _check_dtypes(k)
    chunk = _chunk_size(chunk)
    dy, dm_final, k, v, q, alpha, eta, m0, cu_seqlens = _contiguous(
        dy, dm_final, k, v, q, alpha, eta, m0, cu_seqlens)
    B, T, H, DK, DV, N = _layout(k, v, cu_seqlens)
    f32 = dict(dtype=torch.float32, device=k.device)
    states = torch.empty(_state_slots(B, T, N, chunk, cu_seqlens is not None), H, DV, DK, **f32)
    _launch_forward(k, v, q, alpha, eta, m0, cu_seqlens, hebbian, chunk, torch.empty_like(v),
                    torch.empty(N, H, DV, DK, **f32), states, decay_first)

    BK, BV = _blocks(DK, DV)
    NV = triton.cdiv(DV, BV)
    rows = B * T * H
    dk_part, dq_part = torch.empty(NV, rows, DK, **f32), torch.empty(NV, rows, DK, **f32)
    dalpha_part, deta_part = torch.empty(NV, rows, **f32), torch.empty(NV, rows, **f32)
    dv = torch.empty_like(v)
    dm0 = torch.empty(N, H, DV, DK, **f32)
    chunk_backward_kernel[(NV, N * H)](
        k, v, q, alpha, eta, dy, dm_final.to(torch.float32), states, dk_part, dv, dq_part, dalpha_part,
        deta_part, dm0, cu_seqlens if cu_seqlens is not None else k, T, rows,
        H=H, DK=DK, DV=DV, BK=BK, BV=BV, CHUNK=chunk, VARLEN=cu_seqlens is not None, HEBBIAN=hebbian,
        DOT=dot_precision(k), DECAY_FIRST=decay_first)
    dk = dk_part.sum(0).view(B, T, H, DK).to(k.dtype)
    dq = dq_part.sum(0).view(B, T, H, DK).to(q.dtype)
    dalpha = dalpha_part.sum(0).view(B, T, H).to(alpha.dtype)
    deta = deta_part.sum(0).view(B, T, H).to(eta.dtype)
    return dk, dv, dq, dalpha, deta, dm0, dm0.new_empty(0)
