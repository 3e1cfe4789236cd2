"""Triton kernels of ``hecate.kl_attention``: flash-style, never forming [B, N, N, K] or [B, N, N].

Every kernel works on tiles of the KL matrix computed per pair, as the model writes it::

    S_ij = ½ Σ_k [((μ_ik − μ_jk)² + v_ik − v_jk) / v_jk + log v_jk − log v_ik]     μ, v, log v [B,N,K]
    P_ij = exp(−S_ij/κ − lse_i) on allowed pairs, 0 elsewhere (β)

not in the dot-product form c_i + a_i·b_j + d_j, which subtracts terms of size μ²/v: the
KL of near pairs (which carry β, amplified by 1/κ) would lose its digits and S_ii would
not be 0. The gradients with respect to μ and v are summed per pair too. All tensors are
contiguous [B, N, D] (or [B, N]); one program handles one block of rows (queries) or
columns (keys) of one batch element; sums are fp32, the value dot products IEEE fp32.

Forward:  ``_fwd_rows``  (row blocks; online softmax over key blocks) → row_sum, row_kl_sum, energy, lse
          ``_fwd_cols``  (key blocks; loops over query blocks, needs lse)  → col_sum, col_kl_sum
Backward (recomputing P from lse):
          ``_bwd_col_values`` (row blocks) → dW = P dO3 + (P∘S) dO4   (only with column values)
          ``_bwd_rows`` (row blocks)   → dμ, dv through the query side of S
          ``_bwd_cols`` (key blocks, its tiles transposed: keys on the rows) → dμ, dv through the key
                        side of S, dV
The formulas are in :func:`hecate.lowering.kl_attention.matmul_form.backward`.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _load_rows(ptr, b, offs, N, D, BLOCK_D: tl.constexpr):
    """[len(offs), BLOCK_D] rows ``offs`` of batch ``b`` of a contiguous [B, N, D] tensor (0 outside)."""
    cols = tl.arange(0, BLOCK_D)
    mask = (offs[:, None] < N) & (cols[None, :] < D)
    return tl.load(ptr + b * N * D + offs[:, None] * D + cols[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _store_rows(ptr, value, b, offs, N, D, BLOCK_D: tl.constexpr):
    cols = tl.arange(0, BLOCK_D)
    mask = (offs[:, None] < N) & (cols[None, :] < D)
    tl.store(ptr + b * N * D + offs[:, None] * D + cols[None, :], value.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _load_vec(ptr, b, offs, N):
    return tl.load(ptr + b * N + offs, mask=offs < N, other=0.0).to(tl.float32)


@triton.jit
def _store_vec(ptr, value, b, offs, N):
    tl.store(ptr + b * N + offs, value.to(ptr.dtype.element_ty), mask=offs < N)


@triton.jit
def _load_beliefs(mu_ptr, var_ptr, lv_ptr, b, offs, N, K, BLOCK_K: tl.constexpr):
    """(μ, v, log v) [len(offs), BLOCK_K]; padding is μ = 0, v = 1, log v = 0 (adds 0 to S)."""
    cols = tl.arange(0, BLOCK_K)
    mask = (offs[:, None] < N) & (cols[None, :] < K)
    ptrs = b * N * K + offs[:, None] * K + cols[None, :]
    mu = tl.load(mu_ptr + ptrs, mask=mask, other=0.0).to(tl.float32)
    var = tl.load(var_ptr + ptrs, mask=mask, other=1.0).to(tl.float32)
    lv = tl.load(lv_ptr + ptrs, mask=mask, other=0.0).to(tl.float32)
    return mu, var, lv


@triton.jit
def _kl(mu_i, v_i, lv_i, mu_j, v_j, lv_j):
    """S_ij per pair from query beliefs and key beliefs broadcast against each other ([.., .., BLOCK_D] each),
    summed over the features: 0 exactly when q_i = q_j. (d² + v_i)/v_j − 1, not (d² + v_i − v_j)/v_j: at
    v_j = inf that is −inf/inf = NaN where the formula's v_i/v_j is 0 and the KL inf."""
    d = mu_i - mu_j
    return 0.5 * tl.sum((d * d + v_i) / v_j - 1.0 + (lv_j - lv_i), 2)


@triton.jit
def _kl_tile(mu_i, v_i, lv_i, mu_j, v_j, lv_j):
    """S_ij [BLOCK_M, BLOCK_N], queries on the rows."""
    return _kl(mu_i[:, None, :], v_i[:, None, :], lv_i[:, None, :], mu_j[None, :, :], v_j[None, :, :], lv_j[None, :, :])


@triton.jit
def _key_tile(mu_i, v_i, lv_i, mu_j, v_j, lv_j):
    """S_ij transposed, [BLOCK_N, BLOCK_M]: the keys on the rows, for the backward's sums over queries per key.
    (Summing a query-major tile over its rows, with its transpose in the value products, spilled up to 14 KB of
    registers per thread on sm_90; benchmarks/kernel_resources.py.)"""
    return _kl(mu_i[None, :, :], v_i[None, :, :], lv_i[None, :, :], mu_j[:, None, :], v_j[:, None, :], lv_j[:, None, :])


@triton.jit
def _allowed(query, key, N, CAUSAL: tl.constexpr, MASK_DIAGONAL: tl.constexpr):
    """Which pairs are attended, from query and key indices broadcast against each other."""
    ok = (query < N) & (key < N)
    if CAUSAL:
        ok = ok & (key <= query)
    if MASK_DIAGONAL:
        ok = ok & (key != query)
    return ok


@triton.jit
def _beta_tile(s, lse, ok, neg_inv_kappa):
    """P_ij from the scores and the query's log-sum-exp, broadcast to the tile (0 on masked pairs and on
    queries with no key)."""
    return tl.where(ok, tl.exp(s * neg_inv_kappa - lse), 0.0)


@triton.jit
def _fwd_rows(mu_ptr, var_ptr, lv_ptr, rv_ptr,
              row_ptr, row_kl_ptr, energy_ptr, lse_ptr,
              N, K, DV, neg_inv_kappa,
              CAUSAL: tl.constexpr, MASK_DIAGONAL: tl.constexpr, HAS_V: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr):
    pid_m = tl.program_id(0)
    b = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mu_i, v_i, lv_i = _load_beliefs(mu_ptr, var_ptr, lv_ptr, b, offs_m, N, K, BLOCK_D)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    e_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_V], tl.float32)
    acc_kl = tl.zeros([BLOCK_M, BLOCK_V], tl.float32)
    hi = N
    if CAUSAL:
        hi = tl.minimum(N, (pid_m + 1) * BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        mu_j, v_j, lv_j = _load_beliefs(mu_ptr, var_ptr, lv_ptr, b, offs_n, N, K, BLOCK_D)
        s = _kl_tile(mu_i, v_i, lv_i, mu_j, v_j, lv_j)  # [BM, BN]
        ok = _allowed(offs_m[:, None], offs_n[None, :], N, CAUSAL, MASK_DIAGONAL)
        logit = tl.where(ok, s * neg_inv_kappa, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(logit, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no allowed key yet: keep exp(−inf) = 0
        alpha = tl.exp(m_i - m_ref)
        p = tl.exp(logit - m_ref[:, None])
        ps = p * tl.where(ok, s, 0.0)
        l_i = l_i * alpha + tl.sum(p, 1)
        e_i = e_i * alpha + tl.sum(ps, 1)
        if HAS_V:
            rv_j = _load_rows(rv_ptr, b, offs_n, N, DV, BLOCK_V)  # [BN, BV]
            acc = acc * alpha[:, None] + tl.dot(p, rv_j, input_precision="ieee")
            acc_kl = acc_kl * alpha[:, None] + tl.dot(ps, rv_j, input_precision="ieee")
        m_i = m_new
    has_key = l_i != 0.0  # 0: no allowed key; NaN (a NaN score) stays NaN, as in ATen
    inv_l = tl.where(has_key, 1.0 / tl.where(has_key, l_i, 1.0), 0.0)
    lse = tl.where(has_key, m_i + tl.log(tl.where(has_key, l_i, 1.0)), float("-inf"))
    _store_vec(energy_ptr, e_i * inv_l, b, offs_m, N)
    _store_vec(lse_ptr, lse, b, offs_m, N)
    if HAS_V:
        _store_rows(row_ptr, acc * inv_l[:, None], b, offs_m, N, DV, BLOCK_V)
        _store_rows(row_kl_ptr, acc_kl * inv_l[:, None], b, offs_m, N, DV, BLOCK_V)


@triton.jit
def _fwd_cols(mu_ptr, var_ptr, lv_ptr, lse_ptr, cv_ptr,
              col_ptr, col_kl_ptr,
              N, K, DW, neg_inv_kappa,
              CAUSAL: tl.constexpr, MASK_DIAGONAL: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_W: tl.constexpr):
    pid_n = tl.program_id(0)
    b = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mu_j, v_j, lv_j = _load_beliefs(mu_ptr, var_ptr, lv_ptr, b, offs_n, N, K, BLOCK_D)
    acc = tl.zeros([BLOCK_N, BLOCK_W], tl.float32)
    acc_kl = tl.zeros([BLOCK_N, BLOCK_W], tl.float32)
    lo = 0
    if CAUSAL:
        lo = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M  # queries before the key block see none of it
    for start_m in range(lo, N, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        mu_i, v_i, lv_i = _load_beliefs(mu_ptr, var_ptr, lv_ptr, b, offs_m, N, K, BLOCK_D)
        lse_i = _load_vec(lse_ptr, b, offs_m, N)
        w_i = _load_rows(cv_ptr, b, offs_m, N, DW, BLOCK_W)  # [BM, BW]
        s = _kl_tile(mu_i, v_i, lv_i, mu_j, v_j, lv_j)
        ok = _allowed(offs_m[:, None], offs_n[None, :], N, CAUSAL, MASK_DIAGONAL)
        p = _beta_tile(s, lse_i[:, None], ok, neg_inv_kappa)
        acc += tl.dot(tl.trans(p), w_i, input_precision="ieee")
        acc_kl += tl.dot(tl.trans(p * tl.where(ok, s, 0.0)), w_i, input_precision="ieee")
    _store_rows(col_ptr, acc, b, offs_n, N, DW, BLOCK_W)
    _store_rows(col_kl_ptr, acc_kl, b, offs_n, N, DW, BLOCK_W)


@triton.jit
def _bwd_col_values(mu_ptr, var_ptr, lv_ptr, lse_ptr, g_col_ptr, g_col_kl_ptr,
                    grad_cv_ptr,
                    N, K, DW, neg_inv_kappa,
                    CAUSAL: tl.constexpr, MASK_DIAGONAL: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_W: tl.constexpr):
    """dW_i = Σ_j P_ij dO3_j + P_ij S_ij dO4_j."""
    pid_m = tl.program_id(0)
    b = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mu_i, v_i, lv_i = _load_beliefs(mu_ptr, var_ptr, lv_ptr, b, offs_m, N, K, BLOCK_D)
    lse_i = _load_vec(lse_ptr, b, offs_m, N)
    acc = tl.zeros([BLOCK_M, BLOCK_W], tl.float32)
    hi = N
    if CAUSAL:
        hi = tl.minimum(N, (pid_m + 1) * BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        mu_j, v_j, lv_j = _load_beliefs(mu_ptr, var_ptr, lv_ptr, b, offs_n, N, K, BLOCK_D)
        s = _kl_tile(mu_i, v_i, lv_i, mu_j, v_j, lv_j)
        ok = _allowed(offs_m[:, None], offs_n[None, :], N, CAUSAL, MASK_DIAGONAL)
        p = _beta_tile(s, lse_i[:, None], ok, neg_inv_kappa)
        g3 = _load_rows(g_col_ptr, b, offs_n, N, DW, BLOCK_W)
        g4 = _load_rows(g_col_kl_ptr, b, offs_n, N, DW, BLOCK_W)
        acc += tl.dot(p, g3, input_precision="ieee") + tl.dot(p * tl.where(ok, s, 0.0), g4, input_precision="ieee")
    _store_rows(grad_cv_ptr, acc, b, offs_m, N, DW, BLOCK_W)


@triton.jit
def _pair_dot(i_x, j_y, KEYS_ON_ROWS: tl.constexpr):
    """Σ_d x_id y_jd on a tile: [BLOCK_M, BLOCK_N], or [BLOCK_N, BLOCK_M] with the keys on the rows."""
    # one return: Triton requires every return of a function to have one type, taken branch or not
    if KEYS_ON_ROWS:
        dot = tl.dot(j_y, tl.trans(i_x), input_precision="ieee")
    else:
        dot = tl.dot(i_x, tl.trans(j_y), input_precision="ieee")
    return dot


@triton.jit
def _grad_scores(s, ok, p, i_rv1, i_rv2, i_energy, i_lse, i_rowdot, i_cv, j_rv, j_g3, j_g4, inv_kappa,
                 HAS_V: tl.constexpr, HAS_W: tl.constexpr, KEYS_ON_ROWS: tl.constexpr):
    """(dS, ∂L/∂l) on one tile (see matmul_form.backward); i_* are per-query, j_* per-key operands. The tile
    has the queries on its rows, or (KEYS_ON_ROWS) the keys: the per-query vectors then broadcast along the rows."""
    if KEYS_ON_ROWS:
        i_energy, i_lse, i_rowdot = i_energy[None, :], i_lse[None, :], i_rowdot[None, :]
    else:
        i_energy, i_lse, i_rowdot = i_energy[:, None], i_lse[:, None], i_rowdot[:, None]
    sv = tl.where(ok, s, 0.0)
    direct = tl.zeros_like(s) + i_energy
    grad_p = tl.zeros_like(s)
    if HAS_V:
        direct += _pair_dot(i_rv2, j_rv, KEYS_ON_ROWS)
        grad_p += _pair_dot(i_rv1, j_rv, KEYS_ON_ROWS)
    if HAS_W:
        direct += _pair_dot(i_cv, j_g4, KEYS_ON_ROWS)
        grad_p += _pair_dot(i_cv, j_g3, KEYS_ON_ROWS)
    grad_p += sv * direct
    # q = ∂L/∂l on the logits l = −S/κ (the softmax's share); dS = P·direct − q/κ
    q = p * (grad_p - i_rowdot + i_lse)
    return p * direct - q * inv_kappa, q


@triton.jit
def _bwd_rows(mu_ptr, var_ptr, lv_ptr, lse_ptr, rowdot_ptr, rv_ptr, cv_ptr,
              g_row_ptr, g_row_kl_ptr, g_energy_ptr, g_col_ptr, g_col_kl_ptr, g_lse_ptr,
              grad_mu_ptr, grad_var_ptr, kappa_rows_ptr,
              N, K, DV, DW, neg_inv_kappa,
              CAUSAL: tl.constexpr, MASK_DIAGONAL: tl.constexpr, HAS_V: tl.constexpr, HAS_W: tl.constexpr,
              KAPPA_GRAD: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
              BLOCK_V: tl.constexpr, BLOCK_W: tl.constexpr):
    """dμ_i = Σ_j dS_ij (μ_i − μ_j)/v_j, dv_i = ½ Σ_j dS_ij (v_i − v_j)/(v_i v_j): the query side of S;
    with KAPPA_GRAD, Σ_j ∂L/∂l_ij S_ij per row [B, N] (∂L/∂κ is their sum over κ²)."""
    pid_m = tl.program_id(0)
    b = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mu_i, v_i, lv_i = _load_beliefs(mu_ptr, var_ptr, lv_ptr, b, offs_m, N, K, BLOCK_D)
    lse_i = _load_vec(lse_ptr, b, offs_m, N)
    rowdot_i = _load_vec(rowdot_ptr, b, offs_m, N)
    ge_i = _load_vec(g_energy_ptr, b, offs_m, N)
    gl_i = _load_vec(g_lse_ptr, b, offs_m, N)
    g1_i = _load_rows(g_row_ptr, b, offs_m, N, DV, BLOCK_V)
    g2_i = _load_rows(g_row_kl_ptr, b, offs_m, N, DV, BLOCK_V)
    w_i = _load_rows(cv_ptr, b, offs_m, N, DW, BLOCK_W)
    inv_kappa = -neg_inv_kappa
    grad_mu = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    grad_var = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    kappa_rows = tl.zeros([BLOCK_M], tl.float32)
    hi = N
    if CAUSAL:
        hi = tl.minimum(N, (pid_m + 1) * BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        mu_j, v_j, lv_j = _load_beliefs(mu_ptr, var_ptr, lv_ptr, b, offs_n, N, K, BLOCK_D)
        rv_j = _load_rows(rv_ptr, b, offs_n, N, DV, BLOCK_V)
        g3_j = _load_rows(g_col_ptr, b, offs_n, N, DW, BLOCK_W)
        g4_j = _load_rows(g_col_kl_ptr, b, offs_n, N, DW, BLOCK_W)
        s = _kl_tile(mu_i, v_i, lv_i, mu_j, v_j, lv_j)
        ok = _allowed(offs_m[:, None], offs_n[None, :], N, CAUSAL, MASK_DIAGONAL)
        p = _beta_tile(s, lse_i[:, None], ok, neg_inv_kappa)
        ds, q = _grad_scores(s, ok, p, g1_i, g2_i, ge_i, gl_i, rowdot_i, w_i, rv_j, g3_j, g4_j, inv_kappa,
                             HAS_V, HAS_W, False)
        if KAPPA_GRAD:
            kappa_rows += tl.sum(q * tl.where(ok, s, 0.0), 1)
        dsk = ds[:, :, None]
        grad_mu += tl.sum(dsk * (mu_i[:, None, :] - mu_j[None, :, :]) / v_j[None, :, :], 1)
        grad_var += 0.5 * tl.sum(dsk * (v_i[:, None, :] - v_j[None, :, :]) / (v_i[:, None, :] * v_j[None, :, :]), 1)
    _store_rows(grad_mu_ptr, grad_mu, b, offs_m, N, K, BLOCK_D)
    _store_rows(grad_var_ptr, grad_var, b, offs_m, N, K, BLOCK_D)
    if KAPPA_GRAD:
        _store_vec(kappa_rows_ptr, kappa_rows, b, offs_m, N)


@triton.jit
def _bwd_cols(mu_ptr, var_ptr, lv_ptr, lse_ptr, rowdot_ptr, rv_ptr, cv_ptr,
              g_row_ptr, g_row_kl_ptr, g_energy_ptr, g_col_ptr, g_col_kl_ptr, g_lse_ptr,
              grad_mu_ptr, grad_var_ptr, grad_rv_ptr,
              N, K, DV, DW, neg_inv_kappa,
              CAUSAL: tl.constexpr, MASK_DIAGONAL: tl.constexpr, HAS_V: tl.constexpr, HAS_W: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
              BLOCK_V: tl.constexpr, BLOCK_W: tl.constexpr):
    """dμ_j = −Σ_i dS_ij (μ_i − μ_j)/v_j, dv_j = ½ Σ_i dS_ij (v_j − v_i − (μ_i − μ_j)²)/v_j² (the key side
    of S), dV_j = Σ_i P_ij dO1_i + P_ij S_ij dO2_i."""
    pid_n = tl.program_id(0)
    b = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mu_j, v_j, lv_j = _load_beliefs(mu_ptr, var_ptr, lv_ptr, b, offs_n, N, K, BLOCK_D)
    rv_j = _load_rows(rv_ptr, b, offs_n, N, DV, BLOCK_V)
    g3_j = _load_rows(g_col_ptr, b, offs_n, N, DW, BLOCK_W)
    g4_j = _load_rows(g_col_kl_ptr, b, offs_n, N, DW, BLOCK_W)
    inv_kappa = -neg_inv_kappa
    grad_mu = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    grad_var = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    grad_v = tl.zeros([BLOCK_N, BLOCK_V], tl.float32)
    lo = 0
    if CAUSAL:
        lo = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M
    for start_m in range(lo, N, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        mu_i, v_i, lv_i = _load_beliefs(mu_ptr, var_ptr, lv_ptr, b, offs_m, N, K, BLOCK_D)
        lse_i = _load_vec(lse_ptr, b, offs_m, N)
        rowdot_i = _load_vec(rowdot_ptr, b, offs_m, N)
        ge_i = _load_vec(g_energy_ptr, b, offs_m, N)
        gl_i = _load_vec(g_lse_ptr, b, offs_m, N)
        g1_i = _load_rows(g_row_ptr, b, offs_m, N, DV, BLOCK_V)
        g2_i = _load_rows(g_row_kl_ptr, b, offs_m, N, DV, BLOCK_V)
        w_i = _load_rows(cv_ptr, b, offs_m, N, DW, BLOCK_W)
        s = _key_tile(mu_i, v_i, lv_i, mu_j, v_j, lv_j)  # [BN, BM]
        ok = _allowed(offs_m[None, :], offs_n[:, None], N, CAUSAL, MASK_DIAGONAL)
        p = _beta_tile(s, lse_i[None, :], ok, neg_inv_kappa)
        ds, _ = _grad_scores(s, ok, p, g1_i, g2_i, ge_i, gl_i, rowdot_i, w_i, rv_j, g3_j, g4_j, inv_kappa,
                             HAS_V, HAS_W, True)
        dsk = ds[:, :, None]
        d = mu_i[None, :, :] - mu_j[:, None, :]
        grad_mu -= tl.sum(dsk * d / v_j[:, None, :], 1)
        grad_var += 0.5 * tl.sum(dsk * ((v_j[:, None, :] - v_i[None, :, :]) - d * d) / (v_j * v_j)[:, None, :], 1)
        if HAS_V:
            grad_v += tl.dot(p, g1_i, input_precision="ieee")
            grad_v += tl.dot(p * tl.where(ok, s, 0.0), g2_i, input_precision="ieee")
    _store_rows(grad_mu_ptr, grad_mu, b, offs_n, N, K, BLOCK_D)
    _store_rows(grad_var_ptr, grad_var, b, offs_n, N, K, BLOCK_D)
    if HAS_V:
        _store_rows(grad_rv_ptr, grad_v, b, offs_n, N, DV, BLOCK_V)
