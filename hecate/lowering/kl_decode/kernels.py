"""Triton kernels of ``hecate.kl_decode_logits`` / ``hecate.kl_decode_ce``.

Scores in the dot-product form (:mod:`.matmul_form`)::

    z_iv = −(c_i + a_i · b_v + d_v) / τ       a [M, D2], b [V, D2] (D2 = 2K), c [M], d [V]

``_logits``   (row block × vocab block) → z [M, V]
``_ce_fwd``   (row blocks; online logsumexp over vocab blocks) → loss [M], lse [M]; z never stored
``_ce_bwd_rows`` (row blocks)   → da, dc     with dz_iv = g_i (softmax_iv − [v = t_i]), recomputed
``_ce_bwd_cols`` (vocab blocks) → db, dd
All tensors contiguous; fp32 accumulation; the score dot product in IEEE fp32.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _load_rows(ptr, offs, n, D, BLOCK_D: tl.constexpr):
    cols = tl.arange(0, BLOCK_D)
    mask = (offs[:, None] < n) & (cols[None, :] < D)
    return tl.load(ptr + offs[:, None] * D + cols[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _scores(a_i, c_i, b_v, d_v, neg_inv_tau):
    return (c_i[:, None] + tl.dot(a_i, tl.trans(b_v), input_precision="ieee") + d_v[None, :]) * neg_inv_tau


@triton.jit
def _logits(a_ptr, c_ptr, b_ptr, d_ptr, z_ptr, M, V, D2, neg_inv_tau,
            BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    a_i = _load_rows(a_ptr, offs_m, M, D2, BLOCK_D)
    b_v = _load_rows(b_ptr, offs_v, V, D2, BLOCK_D)
    c_i = tl.load(c_ptr + offs_m, mask=offs_m < M, other=0.0)
    d_v = tl.load(d_ptr + offs_v, mask=offs_v < V, other=0.0)
    z = _scores(a_i, c_i, b_v, d_v, neg_inv_tau)
    mask = (offs_m[:, None] < M) & (offs_v[None, :] < V)
    tl.store(z_ptr + offs_m[:, None] * V + offs_v[None, :], z.to(z_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _ce_fwd(a_ptr, c_ptr, b_ptr, d_ptr, t_ptr, loss_ptr, lse_ptr, M, V, D2, neg_inv_tau, ignore_index,
            BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    a_i = _load_rows(a_ptr, offs_m, M, D2, BLOCK_D)
    c_i = tl.load(c_ptr + offs_m, mask=offs_m < M, other=0.0)
    t_i = tl.load(t_ptr + offs_m, mask=offs_m < M, other=0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    z_t = tl.zeros([BLOCK_M], tl.float32)
    for start_v in range(0, V, BLOCK_V):
        offs_v = start_v + tl.arange(0, BLOCK_V)
        b_v = _load_rows(b_ptr, offs_v, V, D2, BLOCK_D)
        d_v = tl.load(d_ptr + offs_v, mask=offs_v < V, other=0.0)
        z = tl.where(offs_v[None, :] < V, _scores(a_i, c_i, b_v, d_v, neg_inv_tau), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(z, 1))
        l_i = l_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(z - m_new[:, None]), 1)
        m_i = m_new
        z_t += tl.sum(tl.where(offs_v[None, :] == t_i[:, None], z, 0.0), 1)
    # lse = m + log l in float64, exactly: at |logits| ~ 550 (a wide belief, a small τ) fp32 would round it by 3e-5,
    # every probability the backward recomputes from it with it; the loss as (m − z_t) + log l for the same reason
    loss = tl.where(t_i == ignore_index, 0.0, (m_i - z_t) + tl.log(l_i))
    tl.store(loss_ptr + offs_m, loss.to(loss_ptr.dtype.element_ty), mask=offs_m < M)
    tl.store(lse_ptr + offs_m, m_i.to(tl.float64) + tl.log(l_i).to(tl.float64), mask=offs_m < M)


@triton.jit
def _lse_parts(lse_ptr, offs_m, M):
    # the float64 lse as hi + lo in fp32: z − hi is exact (both near the row's max), then − lo
    lse = tl.load(lse_ptr + offs_m, mask=offs_m < M, other=0.0)
    hi = lse.to(tl.float32)
    return hi, (lse - hi.to(tl.float64)).to(tl.float32)


@triton.jit
def _grad_scores(z, lse_hi, lse_lo, g_i, t_i, offs_v, V, neg_inv_tau):
    """dKL_iv = −dz_iv/τ, dz_iv = g_i (softmax_iv − [v = t_i]) (g_i = 0 on ignored rows)."""
    p = tl.where(offs_v[None, :] < V, tl.exp((z - lse_hi[:, None]) - lse_lo[:, None]), 0.0)
    dz = g_i[:, None] * (p - tl.where(offs_v[None, :] == t_i[:, None], 1.0, 0.0))
    # rows with g = 0 (ignored, or past M with lse = 0 loaded) may hold exp overflow: drop them
    return tl.where(g_i[:, None] != 0.0, dz, 0.0) * neg_inv_tau


@triton.jit
def _ce_bwd_rows(a_ptr, c_ptr, b_ptr, d_ptr, t_ptr, lse_ptr, g_ptr, grad_a_ptr, grad_c_ptr,
                 M, V, D2, neg_inv_tau,
                 BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    a_i = _load_rows(a_ptr, offs_m, M, D2, BLOCK_D)
    c_i = tl.load(c_ptr + offs_m, mask=offs_m < M, other=0.0)
    t_i = tl.load(t_ptr + offs_m, mask=offs_m < M, other=0)
    lse_hi, lse_lo = _lse_parts(lse_ptr, offs_m, M)
    g_i = tl.load(g_ptr + offs_m, mask=offs_m < M, other=0.0)
    grad_a = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    grad_c = tl.zeros([BLOCK_M], tl.float32)
    for start_v in range(0, V, BLOCK_V):
        offs_v = start_v + tl.arange(0, BLOCK_V)
        b_v = _load_rows(b_ptr, offs_v, V, D2, BLOCK_D)
        d_v = tl.load(d_ptr + offs_v, mask=offs_v < V, other=0.0)
        ds = _grad_scores(_scores(a_i, c_i, b_v, d_v, neg_inv_tau), lse_hi, lse_lo, g_i, t_i, offs_v, V,
                          neg_inv_tau)
        grad_a += tl.dot(ds, b_v, input_precision="ieee")
        grad_c += tl.sum(ds, 1)
    cols = tl.arange(0, BLOCK_D)
    tl.store(grad_a_ptr + offs_m[:, None] * D2 + cols[None, :], grad_a,
             mask=(offs_m[:, None] < M) & (cols[None, :] < D2))
    tl.store(grad_c_ptr + offs_m, grad_c, mask=offs_m < M)


@triton.jit
def _ce_bwd_cols(a_ptr, c_ptr, b_ptr, d_ptr, t_ptr, lse_ptr, g_ptr, grad_b_ptr, grad_d_ptr,
                 M, V, D2, neg_inv_tau,
                 BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr):
    offs_v = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
    b_v = _load_rows(b_ptr, offs_v, V, D2, BLOCK_D)
    d_v = tl.load(d_ptr + offs_v, mask=offs_v < V, other=0.0)
    grad_b = tl.zeros([BLOCK_V, BLOCK_D], tl.float32)
    grad_d = tl.zeros([BLOCK_V], tl.float32)
    for start_m in range(0, M, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        a_i = _load_rows(a_ptr, offs_m, M, D2, BLOCK_D)
        c_i = tl.load(c_ptr + offs_m, mask=offs_m < M, other=0.0)
        t_i = tl.load(t_ptr + offs_m, mask=offs_m < M, other=0)
        lse_hi, lse_lo = _lse_parts(lse_ptr, offs_m, M)
        g_i = tl.load(g_ptr + offs_m, mask=offs_m < M, other=0.0)  # 0 beyond M: those rows add nothing
        ds = _grad_scores(_scores(a_i, c_i, b_v, d_v, neg_inv_tau), lse_hi, lse_lo, g_i, t_i, offs_v, V,
                          neg_inv_tau)
        grad_b += tl.dot(tl.trans(ds), a_i, input_precision="ieee")
        grad_d += tl.sum(ds, 0)
    cols = tl.arange(0, BLOCK_D)
    tl.store(grad_b_ptr + offs_v[:, None] * D2 + cols[None, :], grad_b,
             mask=(offs_v[:, None] < V) & (cols[None, :] < D2))
    tl.store(grad_d_ptr + offs_v, grad_d, mask=offs_v < V)
