"""Triton kernels of ``memory_scan``, in the manner of a fused recurrent kernel.

One program per (sequence n, head h, tile of BV value rows): it holds its rows of
the state A [BV, BK] in fp32 on chip for all T steps and reads the full key
dimension (BK = next power of two ≥ Dk). For q_norm = 2 the rows of M evolve
independently (e = M k − v is row-wise), so tiling over Dv is exact; the key,
query and gate gradients sum over all rows, so the backward writes one partial
per value tile and the launcher sums them. MONETA (q_norm ≠ 2) normalises by a
norm over the whole [Dv, Dk] matrix, so there one program holds all of Dv.

Tensors (contiguous): k, q [B, T, H, Dk]; v, y [B, T, H, Dv]; alpha, eta [B, T, H];
states m0, m_final (and s0, s_final of the momentum buffer), checkpoints [slots, H, Dv, Dk] fp32.
Packed sequences (cu_seqlens, B = 1) use rows bos..eos−1 of T.

Backward memory: the forward is re-run keeping A (and S with momentum) before every
CHUNK-th step: ckpt [N·ceil(T/CHUNK) (or T//CHUNK + N packed), H, Dv, Dk] fp32, i.e.
B·H·ceil(T/C)·Dv·Dk·4 bytes (twice with momentum); then each program recomputes
its segment into a scratch [CHUNK, BV, BK] fp32 (B·H·C·Dv·Dk·4 bytes in all) and
walks it backwards.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


CHUNK = 32
# value rows per program (q_norm = 2); tests lower both to exercise several tiles. The backward holds
# about eight [BV, BK] fp32 tiles live (states before/after the step, adjoints, carries), so it takes
# fewer rows than the forward to stay in registers.
MAX_BLOCK_V = 32
MAX_BLOCK_V_BACKWARD = 16


@triton.jit
def _tanh(x):
    # tanh from exp (no libdevice under the interpreter), on |x| so exp never overflows
    z = tl.exp(-2.0 * tl.abs(x))
    th = (1.0 - z) / (1.0 + z)
    return tl.where(x < 0.0, -th, th)


@triton.jit
def _bias_grad(e, p, a, eps, P_MODE: tl.constexpr):
    # g = ∂‖e‖_p^p/∂e smoothed (MIRAS Eq 11, Remark 5): P_MODE 2 → 2e ; 1 → tanh(ae) ; 0 → general p
    if P_MODE == 2:
        g = 2.0 * e
    elif P_MODE == 1:
        g = _tanh(a * e)
    else:
        g = p * _tanh(a * e) * tl.exp((p - 1.0) * 0.5 * tl.log(e * e + eps))
    return g


@triton.jit
def _bias_grad_derivative(e, p, a, eps, P_MODE: tl.constexpr):
    if P_MODE == 2:
        d = tl.full(e.shape, 2.0, tl.float32)
    elif P_MODE == 1:
        th = _tanh(a * e)
        d = a * (1.0 - th * th)
    else:
        th = _tanh(a * e)
        r = e * e + eps
        pw = tl.exp((p - 1.0) * 0.5 * tl.log(r))
        d = p * (a * (1.0 - th * th) * pw + th * (p - 1.0) * e * pw / r)
    return d


@triton.jit
def _lq_sum(A, q_norm, eps):
    # Σ|A|^q + eps over the whole tile [BV, BK] (padding is zero); |A|^q = exp(q log|A|) is 0 at A = 0 and
    # keeps NaN / inf (no tl.maximum, which drops NaN)
    absA = tl.abs(A)
    powq = tl.where(absA == 0.0, 0.0, tl.exp(q_norm * tl.log(absA)))
    return tl.sum(tl.sum(powq, 1), 0) + eps


@triton.jit
def _lq_normalize(A, q_norm, eps, LQ: tl.constexpr):
    # W = A · (Σ|A|^q + eps)^(−(q−2)/q)  (MONETA), or A
    if LQ:
        s = _lq_sum(A, q_norm, eps)
        W = A * tl.exp(-(q_norm - 2.0) / q_norm * tl.log(s))
    else:
        W = A
    return W


@triton.jit
def _lq_normalize_vjp(A, dW, q_norm, eps):
    # dA = c dW − r ⟨dW, A⟩ c / s · q sign(A) |A|^(q−1),  c = s^(−r), r = (q−2)/q
    r = (q_norm - 2.0) / q_norm
    s = _lq_sum(A, q_norm, eps)
    c = tl.exp(-r * tl.log(s))
    inner = tl.sum(tl.sum(dW * A, 1), 0)
    absA = tl.abs(A)
    ds_dA = tl.where(absA == 0.0, 0.0, q_norm * A * tl.exp((q_norm - 2.0) * tl.log(absA)))
    return c * dW - r * inner * c / s * ds_dA


@triton.jit
def _outer(col, row, mask_kv):
    # col rowᵀ on the tile, 0 in its padding: a ±inf entry times a padding zero would be NaN, and the
    # padding must stay 0 (MONETA's norm and the adjoints' sums run over the whole tile)
    return tl.where(mask_kv, col[:, None] * row[None, :], 0.0)


@triton.jit
def _memory_step(A, S, W, k_t, v_t, a_t, eta_t, p, a, eps, momentum, mask_kv,
                 P_MODE: tl.constexpr, USE_MOMENTUM: tl.constexpr, HEBBIAN: tl.constexpr):
    """One token's update of the state tile A [BV, BK] (and momentum S), reading the memory W.

    U = g kᵀ with g the l_p bias gradient of e = W k − v (Hebbian: g = −v, W not read);
    A ← (1 − α) A − η U, or with momentum S ← β S − η U, A ← (1 − α) A + S.
    The forward and the backward's recomputation share it, so they cannot drift apart.
    """
    if HEBBIAN:
        g = -v_t
    else:
        e = tl.sum(W * k_t[None, :], 1) - v_t  # [BV]
        g = _bias_grad(e, p, a, eps, P_MODE)
    U = _outer(g, k_t, mask_kv)
    if USE_MOMENTUM:
        S = momentum * S - eta_t * U
        A = (1.0 - a_t) * A + S
    else:
        A = (1.0 - a_t) * A - eta_t * U
    return A, S


@triton.jit
def _sequence(cu_seqlens, i_n, T, CHUNK: tl.constexpr, VARLEN: tl.constexpr):
    # (first row, length, first checkpoint slot) of sequence i_n
    if VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        slot0 = bos // CHUNK + i_n  # ≥ previous sequence's slot0 + its ceil(len/CHUNK)
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T
        slot0 = i_n.to(tl.int64) * tl.cdiv(T, CHUNK)
    return bos, eos - bos, slot0


@triton.jit
def memory_scan_fwd_kernel(
    k, v, q, alpha, eta, m0, y, m_final, ckpt_a, ckpt_s, cu_seqlens, s0, s_final,
    T, p, a, eps, momentum, q_norm,
    H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    CHUNK: tl.constexpr, P_MODE: tl.constexpr, USE_MOMENTUM: tl.constexpr, LQ: tl.constexpr,
    HAS_M0: tl.constexpr, HAS_S0: tl.constexpr, STORE_Y: tl.constexpr, STORE_FINAL: tl.constexpr,
    STORE_CKPT: tl.constexpr,
    VARLEN: tl.constexpr, HEBBIAN: tl.constexpr,
):
    # grid (cdiv(DV, BV), N·H); state tile A [BV, BK] fp32 on chip across the sequence
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, L, slot0 = _sequence(cu_seqlens, i_n, T, CHUNK, VARLEN)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_k, mask_v = o_k < DK, o_v < DV
    mask_kv = mask_v[:, None] & mask_k[None, :]
    tile = o_v[:, None] * DK + o_k[None, :]  # offsets inside one [DV, DK] state

    A = tl.zeros([BV, BK], dtype=tl.float32)
    if HAS_M0:
        A = tl.load(m0 + i_nh * DV * DK + tile, mask=mask_kv, other=0.0).to(tl.float32)
    S = tl.zeros([BV, BK], dtype=tl.float32)
    if HAS_S0:
        S = tl.load(s0 + i_nh * DV * DK + tile, mask=mask_kv, other=0.0).to(tl.float32)
    W = _lq_normalize(A, q_norm, eps, LQ)
    for t in range(0, L):
        if STORE_CKPT:
            if t % CHUNK == 0:
                slot_off = ((slot0 + t // CHUNK) * H + i_h) * DV * DK
                tl.store(ckpt_a + slot_off + tile, A, mask=mask_kv)
                if USE_MOMENTUM:
                    tl.store(ckpt_s + slot_off + tile, S, mask=mask_kv)
        row = (bos + t) * H + i_h
        k_t = tl.load(k + row * DK + o_k, mask=mask_k, other=0.0).to(tl.float32)
        v_t = tl.load(v + row * DV + o_v, mask=mask_v, other=0.0).to(tl.float32)
        a_t = tl.load(alpha + row).to(tl.float32)
        eta_t = tl.load(eta + row).to(tl.float32)
        A, S = _memory_step(A, S, W, k_t, v_t, a_t, eta_t, p, a, eps, momentum, mask_kv, P_MODE, USE_MOMENTUM,
                            HEBBIAN)
        W = _lq_normalize(A, q_norm, eps, LQ)
        if STORE_Y:
            q_t = tl.load(q + row * DK + o_k, mask=mask_k, other=0.0).to(tl.float32)
            y_t = tl.sum(W * q_t[None, :], 1)
            tl.store(y + row * DV + o_v, y_t.to(y.dtype.element_ty), mask=mask_v)
    if STORE_FINAL:
        tl.store(m_final + i_nh * DV * DK + tile, A, mask=mask_kv)
        if USE_MOMENTUM:
            tl.store(s_final + i_nh * DV * DK + tile, S, mask=mask_kv)


@triton.jit
def memory_scan_bwd_kernel(
    k, v, q, alpha, eta, dy, dm_final, ckpt_a, ckpt_s, scratch,
    dk_part, dv, dq_part, dalpha_part, deta_part, dm0, cu_seqlens, ds_final, ds0,
    T, ROWS, p, a, eps, momentum, q_norm,
    H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    CHUNK: tl.constexpr, P_MODE: tl.constexpr, USE_MOMENTUM: tl.constexpr, LQ: tl.constexpr,
    VARLEN: tl.constexpr, HEBBIAN: tl.constexpr,
):
    # grid (NV = cdiv(DV, BV), N·H). Partials over value tiles: dk_part, dq_part [NV, ROWS, DK];
    # dalpha_part, deta_part [NV, ROWS] (ROWS = B·T·H). dv [B, T, H, DV]; dm0 [N, H, DV, DK] fp32;
    # scratch [NV·N·H, CHUNK, BV, BK] fp32 holds the recomputed pre-step states of one segment.
    # Reverse step (see cpu.backward): P carries (1 − α) dA (+ the next error's dW when LQ is off),
    # Qc the next error's dW for MONETA, dS_carry the momentum adjoint β dS_{t+1} (ds_final at the end;
    # ds0 at the start). ds_final, ds0 [N, H, DV, DK] fp32 (read and written with momentum only).
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    NV = tl.num_programs(0)
    bos, L, slot0 = _sequence(cu_seqlens, i_n, T, CHUNK, VARLEN)
    o_k = tl.arange(0, BK)
    o_bv = tl.arange(0, BV)
    o_v = i_v * BV + o_bv
    mask_k, mask_v = o_k < DK, o_v < DV
    mask_kv = mask_v[:, None] & mask_k[None, :]
    tile = o_v[:, None] * DK + o_k[None, :]
    scratch_base = scratch + (i_nh * NV + i_v).to(tl.int64) * CHUNK * BV * BK
    scratch_tile = o_bv[:, None] * BK + o_k[None, :]

    P = tl.load(dm_final + i_nh * DV * DK + tile, mask=mask_kv, other=0.0).to(tl.float32)
    Qc = tl.zeros([BV, BK], dtype=tl.float32)
    dS_carry = tl.zeros([BV, BK], dtype=tl.float32)
    if USE_MOMENTUM:
        dS_carry = tl.load(ds_final + i_nh * DV * DK + tile, mask=mask_kv, other=0.0).to(tl.float32)
    A_post = tl.zeros([BV, BK], dtype=tl.float32)
    n_chunks = tl.cdiv(L, CHUNK)
    for ci in range(0, n_chunks):
        c = n_chunks - 1 - ci
        start = c * CHUNK
        seg = tl.minimum(start + CHUNK, L) - start
        slot_off = ((slot0 + c) * H + i_h) * DV * DK
        A = tl.load(ckpt_a + slot_off + tile, mask=mask_kv, other=0.0)
        S = tl.zeros([BV, BK], dtype=tl.float32)
        if USE_MOMENTUM:
            S = tl.load(ckpt_s + slot_off + tile, mask=mask_kv, other=0.0)
        # recompute the segment, keeping each pre-step state
        for j in range(0, seg):
            tl.store(scratch_base + j * BV * BK + scratch_tile, A)
            row = (bos + start + j) * H + i_h
            k_t = tl.load(k + row * DK + o_k, mask=mask_k, other=0.0).to(tl.float32)
            v_t = tl.load(v + row * DV + o_v, mask=mask_v, other=0.0).to(tl.float32)
            a_t = tl.load(alpha + row).to(tl.float32)
            eta_t = tl.load(eta + row).to(tl.float32)
            A, S = _memory_step(A, S, _lq_normalize(A, q_norm, eps, LQ), k_t, v_t, a_t, eta_t, p, a, eps,
                                momentum, mask_kv, P_MODE, USE_MOMENTUM, HEBBIAN)
        A_post = A
        # walk it backwards
        for jj in range(0, seg):
            j = seg - 1 - jj
            row = (bos + start + j) * H + i_h
            A_pre = tl.load(scratch_base + j * BV * BK + scratch_tile)
            k_t = tl.load(k + row * DK + o_k, mask=mask_k, other=0.0).to(tl.float32)
            v_t = tl.load(v + row * DV + o_v, mask=mask_v, other=0.0).to(tl.float32)
            q_t = tl.load(q + row * DK + o_k, mask=mask_k, other=0.0).to(tl.float32)
            dy_t = tl.load(dy + row * DV + o_v, mask=mask_v, other=0.0).to(tl.float32)
            a_t = tl.load(alpha + row).to(tl.float32)
            eta_t = tl.load(eta + row).to(tl.float32)

            W_post = _lq_normalize(A_post, q_norm, eps, LQ)
            tl.store(dq_part + (i_v * ROWS + row) * DK + o_k, tl.sum(W_post * dy_t[:, None], 0), mask=mask_k)
            if LQ:
                dA = P + _lq_normalize_vjp(A_post, _outer(dy_t, q_t, mask_kv) + Qc, q_norm, eps)
            else:
                dA = P + _outer(dy_t, q_t, mask_kv)
            if USE_MOMENTUM:
                D = dS_carry + dA
                dS_carry = momentum * D
            else:
                D = dA
            if HEBBIAN:
                g = -v_t
            else:
                W_pre = _lq_normalize(A_pre, q_norm, eps, LQ)
                e = tl.where(mask_v, tl.sum(W_pre * k_t[None, :], 1) - v_t, 0.0)  # padding rows: 0, not 0·inf
                g = _bias_grad(e, p, a, eps, P_MODE)
            D_k = tl.where(mask_v, tl.sum(D * k_t[None, :], 1), 0.0)  # [BV]
            tl.store(deta_part + i_v * ROWS + row, -tl.sum(g * D_k, 0))
            tl.store(dalpha_part + i_v * ROWS + row, -tl.sum(tl.sum(dA * A_pre, 1), 0))
            dg = D_k * (-eta_t)
            dk_t = -eta_t * tl.sum(D * g[:, None], 0)
            P = (1.0 - a_t) * dA
            if HEBBIAN:  # g = −v: no error, no read of W_{t−1}
                tl.store(dv + row * DV + o_v, (-dg).to(dv.dtype.element_ty), mask=mask_v)
            else:
                de = _bias_grad_derivative(e, p, a, eps, P_MODE) * dg
                tl.store(dv + row * DV + o_v, (-de).to(dv.dtype.element_ty), mask=mask_v)
                dk_t += tl.sum(W_pre * de[:, None], 0)
                if LQ:
                    Qc = _outer(de, k_t, mask_kv)
                else:
                    P = P + _outer(de, k_t, mask_kv)
            tl.store(dk_part + (i_v * ROWS + row) * DK + o_k, dk_t, mask=mask_k)
            A_post = A_pre
    if LQ:
        if L > 0:
            P = P + _lq_normalize_vjp(A_post, Qc, q_norm, eps)
    tl.store(dm0 + i_nh * DV * DK + tile, P, mask=mask_kv)
    if USE_MOMENTUM:
        tl.store(ds0 + i_nh * DV * DK + tile, dS_carry, mask=mask_kv)


def _p_mode(p: float) -> int:
    return 2 if p == 2.0 else 1 if p == 1.0 else 0


def _blocks(DK: int, DV: int, q_norm: float, max_block_v: int) -> tuple[int, int]:
    # MONETA's norm spans the whole [DV, DK] matrix: one program holds all of it
    BK = triton.next_power_of_2(DK)
    BV = triton.next_power_of_2(DV) if q_norm != 2.0 else min(triton.next_power_of_2(DV), max_block_v)
    return BK, BV


def _layout(k, v, cu_seqlens):
    B, T, H, DK = k.shape
    DV = v.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return B, T, H, DK, DV, N


def _check_dtypes(k):
    if k.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"memory_scan (Triton path): k, v, q must be float32, float16 or bfloat16, got {k.dtype}")


def _launch_forward(k, v, q, alpha, eta, m0, s0, cu_seqlens, p, a, eps, momentum, q_norm,
                    y, m_final, s_final, ckpt_a, ckpt_s, hebbian):
    B, T, H, DK, DV, N = _layout(k, v, cu_seqlens)
    BK, BV = _blocks(DK, DV, q_norm, MAX_BLOCK_V)
    dummy = k
    memory_scan_fwd_kernel[(triton.cdiv(DV, BV), N * H)](
        k, v, q, alpha, eta,
        m0 if m0 is not None else dummy, y if y is not None else dummy,
        m_final if m_final is not None else dummy,
        ckpt_a if ckpt_a is not None else dummy, ckpt_s if ckpt_s is not None else dummy,
        cu_seqlens if cu_seqlens is not None else dummy,
        s0 if s0 is not None else dummy, s_final if s_final is not None else dummy,
        T, float(p), float(a), float(eps), float(momentum), float(q_norm),
        H=H, DK=DK, DV=DV, BK=BK, BV=BV, CHUNK=CHUNK, P_MODE=_p_mode(p),
        USE_MOMENTUM=momentum != 0.0, LQ=q_norm != 2.0, HAS_M0=m0 is not None, HAS_S0=s0 is not None,
        STORE_Y=y is not None, STORE_FINAL=m_final is not None, STORE_CKPT=ckpt_a is not None,
        VARLEN=cu_seqlens is not None, HEBBIAN=hebbian,
    )


def _contiguous(*xs):
    return [None if x is None else x.contiguous() for x in xs]


def forward(k, v, q, alpha, eta, m0, cu_seqlens, p, a, eps, momentum, q_norm, hebbian=False, s0=None):
    """y [B, T, H, Dv] (dtype of v), m_final and s_final [N, H, Dv, Dk] fp32 (s_final empty without momentum).

    ``hebbian``: U = −v kᵀ (the memory is not read), the linear-attention recurrence.
    """
    _check_dtypes(k)
    k, v, q, alpha, eta, m0, s0, cu_seqlens = _contiguous(k, v, q, alpha, eta, m0, s0, cu_seqlens)
    B, T, H, DK, DV, N = _layout(k, v, cu_seqlens)
    y = torch.empty_like(v)
    m_final = torch.empty(N, H, DV, DK, dtype=torch.float32, device=k.device)
    s_final = torch.empty(N, H, DV, DK, dtype=torch.float32, device=k.device) if momentum != 0.0 else \
        m_final.new_empty(0)
    _launch_forward(k, v, q, alpha, eta, m0, s0, cu_seqlens, p, a, eps, momentum, q_norm, y, m_final, s_final,
                    None, None, hebbian)
    return y, m_final, s_final


def backward(dy, dm_final, k, v, q, alpha, eta, m0, cu_seqlens, p, a, eps, momentum, q_norm, hebbian=False,
             s0=None, ds_final=None):
    """(dk, dv, dq, dalpha, deta, dm0, ds0): re-run the forward keeping checkpoints, then the reverse kernel
    (ds0 empty without momentum)."""
    _check_dtypes(k)
    dy, dm_final, k, v, q, alpha, eta, m0, s0, cu_seqlens = _contiguous(
        dy, dm_final, k, v, q, alpha, eta, m0, s0, cu_seqlens)
    B, T, H, DK, DV, N = _layout(k, v, cu_seqlens)
    slots = B * triton.cdiv(T, CHUNK) if cu_seqlens is None else T // CHUNK + N
    f32 = dict(dtype=torch.float32, device=k.device)
    ckpt_a = torch.empty(slots, H, DV, DK, **f32)
    ckpt_s = torch.empty(slots, H, DV, DK, **f32) if momentum != 0.0 else None
    _launch_forward(k, v, q, alpha, eta, m0, s0, cu_seqlens, p, a, eps, momentum, q_norm, None, None, None,
                    ckpt_a, ckpt_s, hebbian)

    BK, BV = _blocks(DK, DV, q_norm, MAX_BLOCK_V_BACKWARD)
    NV = triton.cdiv(DV, BV)
    rows = B * T * H
    scratch = torch.empty(NV * N * H, CHUNK, BV, BK, **f32)
    dk_part = torch.empty(NV, rows, DK, **f32)
    dq_part = torch.empty(NV, rows, DK, **f32)
    dalpha_part = torch.empty(NV, rows, **f32)
    deta_part = torch.empty(NV, rows, **f32)
    dv = torch.empty_like(v)
    dm0 = torch.empty(N, H, DV, DK, **f32)
    ds0 = torch.empty(N, H, DV, DK, **f32) if momentum != 0.0 else dm0.new_empty(0)
    if momentum != 0.0 and (ds_final is None or ds_final.numel() == 0):
        ds_final = torch.zeros(N, H, DV, DK, **f32)
    memory_scan_bwd_kernel[(NV, N * H)](
        k, v, q, alpha, eta, dy, dm_final.to(torch.float32), ckpt_a,
        ckpt_s if ckpt_s is not None else ckpt_a, scratch,
        dk_part, dv, dq_part, dalpha_part, deta_part, dm0,
        cu_seqlens if cu_seqlens is not None else k,
        ds_final.to(torch.float32).contiguous() if momentum != 0.0 else dm0, ds0 if momentum != 0.0 else dm0,
        T, rows, float(p), float(a), float(eps), float(momentum), float(q_norm),
        H=H, DK=DK, DV=DV, BK=BK, BV=BV, CHUNK=CHUNK, P_MODE=_p_mode(p),
        USE_MOMENTUM=momentum != 0.0, LQ=q_norm != 2.0, VARLEN=cu_seqlens is not None, HEBBIAN=hebbian,
    )
    dk = dk_part.sum(0).view(B, T, H, DK).to(k.dtype)
    dq = dq_part.sum(0).view(B, T, H, DK).to(q.dtype)
    dalpha = dalpha_part.sum(0).view(B, T, H).to(alpha.dtype)
    deta = deta_part.sum(0).view(B, T, H).to(eta.dtype)
    return dk, dv, dq, dalpha, deta, dm0, ds0
