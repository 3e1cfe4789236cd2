"""The op's CPU path (and its ATen decomposition): scores and matmuls, one block of query rows at a time.

KL is a dot product, c_i + a_i·b_j + d_j (:mod:`hecate.lowering.gaussian_features`), one
GEMM; but it subtracts terms of size μ²/v: with variances spanning e^±7 or means spread
over tens of σ, in float32 the KL of near pairs (which carry the softmax's weight, amplified
by 1/κ) loses every digit, and KL_ii is not 0. So the KL is formed in float64 over centred
means (KL is shift-invariant, so the gradient with respect to the centred means is the
gradient with respect to the means) and KL_ii set to 0 exactly. Once formed, the KL is read
whole per pair: the softmax, β·KL and the β-weighted sums run in the input's precision
(float32 at least, as eager's softmax does). The backward forms dKL in that precision too,
and only the GEMMs that take it back through the dot form (dKL @ b, dKLᵀ @ a, which cancel
like the KL) run in float64. It stays within 10× of eager float32's own error for variances
e^-7..e^7, 30σ spreads and κ = 1e-3 (tests/lowering/test_kl_attention.py).

On the CPU path the query rows are processed in blocks of :data:`BLOCK_ROWS` rows, so that
each [B, rows, N] tile stays in cache across its dozen passes (the softmax is per row; the
column sums and key gradients accumulate over blocks), and a causal block stops at its last
row's key. Traced (the decomposition, under fake or functional modes)
there is one block, N rows, and every op is functional. The Triton kernels compute the KL
per pair per tile instead (elementwise work is cheap there).
"""

from __future__ import annotations

import torch

from hecate.lowering.gaussian_features import (center, key_features, key_features_backward, query_features,
                                               query_features_backward)

# query rows per block on the CPU path: fewer pay the per-op overhead more often, more leave the
# cache (1 thread: at N = 1024 fastest of 16..256 and 1.8× faster than one block, forward and
# backward; at N = 4096 as fast as 64 or 256)
BLOCK_ROWS = 128


def tracing() -> bool:
    """Under a dispatch mode (fake / functional / proxy tracing for export): stay functional."""
    return torch._C._len_torch_dispatch_stack() > 0


def softmax_dtype(dtype: torch.dtype) -> torch.dtype:
    """Everything after the KL: the input's precision, float32 at least."""
    return torch.promote_types(dtype, torch.float32)


_MASKS: dict = {}


def masked_keys(n: int, causal: bool, mask_diagonal: bool, device) -> torch.Tensor | None:
    """[N, N] bool, True where query i may NOT attend to key j; None when every pair is allowed.

    Cached per (N, mask, device) outside tracing (under fake/proxy modes a cached tensor would leak).
    """
    if not causal and not mask_diagonal:
        return None
    key = (n, causal, mask_diagonal, str(device))
    traced = tracing()
    if traced or key not in _MASKS:
        i = torch.arange(n, device=device)
        j, i = i.unsqueeze(0), i.unsqueeze(1)
        if causal:
            masked = (j >= i) if mask_diagonal else (j > i)
        else:
            masked = j == i
        if traced:
            return masked
        if len(_MASKS) > 64:
            _MASKS.clear()
        _MASKS[key] = masked
    return _MASKS[key]


def kl_features(mu: torch.Tensor, var: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(a', b') float64 [B, N, 2K+2] over centred means, KL_ij = a'_i · b'_j: a' = [a, c, 1], b' = [b, 1, d].

    c and d ride in the GEMM (no [B, N, N] broadcast add), and its transposes give their gradients,
    the row and column sums of dKL, as columns 2K and 2K+1.
    """
    muc, v = center(mu.double(), dim=1), var.double()
    a, c = query_features(muc, v)
    b, d = key_features(muc, v)
    one = torch.ones_like(c).unsqueeze(-1)
    return torch.cat([a, c.unsqueeze(-1), one], -1), torch.cat([b, one, d.unsqueeze(-1)], -1)


def _fill(x: torch.Tensor, r0: int, mask: torch.Tensor, value: float) -> torch.Tensor:
    """x [B, R, C] (query rows r0.., keys 0..) with ``value`` where ``mask`` [R, R] says, on keys r0..r0+R.

    A block's masked pairs (j > i, j = i) all lie in that square, and its mask is the [R, R] one
    whatever r0. In place on the CPU path; traced there is one block (r0 = 0, R = C = N).
    """
    if tracing():
        return x.masked_fill(mask, value)
    x[:, :, r0:r0 + mask.shape[0]].masked_fill_(mask, value)
    return x


def _scores(qa, kb, r0: int, kappa, causal: bool, mask_diagonal: bool, dtype, masked=None):
    """(KL, β, lse) of the query rows r0.. with features ``qa`` [B, R, F] against the keys ``kb`` [B, C, F];
    ``masked`` [N, N] or [B, N, N] bool (True: key j not allowed for query i) a mask of any pattern, besides the
    flags'.

    KL is formed in float64 with KL_ii = 0 exactly, then cast to ``dtype``; it is 0 at masked
    pairs (every use multiplies it by β, which is 0 there, even for a NaN or infinite belief).
    One pass of exp: β = exp(l − m) / Σ, lse = m + log Σ (m = 0 on a row with no key, so
    its β is exp(−inf) = 0 and its lse is log 0 = −inf).
    """
    rows = qa.shape[1]
    kl = _fill(torch.bmm(qa, kb.transpose(1, 2)), r0, masked_keys(rows, False, True, qa.device), 0.0).to(dtype)
    logits = kl * (-1.0 / kappa)
    square = masked_keys(rows, causal, mask_diagonal, qa.device)
    if square is not None:
        logits = _fill(logits, r0, square, float("-inf"))
        kl = _fill(kl, r0, square, 0.0)
    if masked is not None:  # anywhere in the tile: out of place
        tile = masked[..., r0:r0 + rows, :kb.shape[1]]
        logits, kl = logits.masked_fill(tile, float("-inf")), kl.masked_fill(tile, 0.0)
    m = logits.amax(-1, keepdim=True)
    if square is not None or masked is not None:
        m = m.masked_fill(torch.isinf(m), 0.0)
    if tracing() or logits.requires_grad:  # (autograd through the decomposition: a gradient differentiated again)
        p = torch.exp(logits - m)
        total = p.sum(-1, keepdim=True)
        beta = p / total.clamp_min(torch.finfo(p.dtype).tiny)
    else:  # reuse the tile's buffer
        p = torch.exp_(logits.sub_(m))
        total = p.sum(-1, keepdim=True)
        beta = p.div_(total.clamp_min(torch.finfo(p.dtype).tiny))
    lse = (m + torch.log(total)).squeeze(-1)
    return kl, beta, lse


def scores_and_beta(mu, var, kappa, causal: bool, mask_diagonal: bool, masked=None):
    """(KL [B,N,N], β [B,N,N] with 0 at masked pairs, lse [B,N]) in :func:`softmax_dtype`, all rows at once."""
    qa, kb = kl_features(mu, var)
    return _scores(qa, kb, 0, kappa, causal, mask_diagonal, softmax_dtype(mu.dtype), masked)


def row_blocks(n: int, causal: bool, rows: int | None = None) -> list[tuple[int, int, int]]:
    """(r0, r1, keys) per block of query rows: ``keys`` = the keys they may see (r1 when causal).

    ``rows`` defaults to :data:`BLOCK_ROWS`; traced, one block of N rows (N may be symbolic).
    """
    if tracing():
        return [(0, n, n)]
    rows = rows or BLOCK_ROWS
    return [(r0, min(n, r0 + rows), min(n, r0 + rows) if causal else n) for r0 in range(0, n, rows)]


def forward(mu, var, row_values, col_values, kappa, causal: bool, mask_diagonal: bool,
            block_rows: int | None = None, masked=None):
    """The op's seven outputs in the matmul form (CPU path, and the ATen decomposition); κ a number or a 0-d
    tensor (a temperature known at run time); ``masked`` [(B,) N, N] a mask of any pattern besides the flags'.

    The column sums are formed transposed, [B, D, N] = Σ over blocks of (values)ᵀ [B, D, rows] @ β [B, rows, keys]:
    the big matrix is never transposed, and each block's GEMM adds into the sums in place.
    """
    qa, kb = kl_features(mu, var)
    dtype = softmax_dtype(mu.dtype)
    rv, cv = row_values.to(dtype), col_values.to(dtype)
    (b, n), dw = mu.shape[:2], cv.shape[-1]

    def block(r0, r1, keys):
        """Rows r0..r1: (row_sum, row_kl_sum, energy, lse) for them, and the (left, right) factors of their
        part of the transposed column sums over keys 0..keys, [col_sum, col_energy_sum] and col_kl_sum."""
        kl, beta, lse = _scores(qa[:, r0:r1], kb[:, :keys], r0, kappa, causal, mask_diagonal, dtype, masked)
        beta_kl = beta * kl
        energy = beta_kl.sum(-1)
        w = cv[:, r0:r1]
        return ((beta @ rv[:, :keys], beta_kl @ rv[:, :keys], energy, lse),
                ((torch.cat([w, energy.unsqueeze(-1) * w], -1).transpose(1, 2), beta), (w.transpose(1, 2), beta_kl)))

    blocks = row_blocks(n, causal, block_rows)
    if len(blocks) == 1:
        (row, row_kl, energy, lse), cols = block(*blocks[0])
        col_t, col_kl_t = (left @ right for left, right in cols)
    else:
        row, row_kl = (rv.new_empty(rv.shape) for _ in range(2))
        energy, lse = (rv.new_empty(b, n) for _ in range(2))
        col_t, col_kl_t = cv.new_zeros(b, 2 * dw, n), cv.new_zeros(b, dw, n)
        for r0, r1, keys in blocks:
            (row[:, r0:r1], row_kl[:, r0:r1], energy[:, r0:r1], lse[:, r0:r1]), cols = block(r0, r1, keys)
            for total, (left, right) in zip((col_t, col_kl_t), cols):
                total[..., :keys].baddbmm_(left, right)
    dt = mu.dtype
    # contiguous copies of the transposed sums (the halves of col_t must not alias, even when dw = 0)
    dense = dict(memory_format=torch.contiguous_format, copy=True)
    col, col_kl = col_t.transpose(1, 2), col_kl_t.transpose(1, 2)
    return (row.to(dt), row_kl.to(dt), energy.to(dt), col[..., :dw].to(dt, **dense), col_kl.to(dt, **dense),
            col[..., dw:].to(dt, **dense), lse.to(dt))


def backward(mu, var, row_values, col_values, grads, kappa, causal: bool, mask_diagonal: bool,
             block_rows: int | None = None, kappa_grad: bool = False, masked=None):
    """(dμ, dv, d row_values, d col_values, d(1/κ)) given the gradients of the seven outputs; κ a number or a
    0-d tensor, d(1/κ) = ∂L/∂(1/κ) a 0-d tensor (0 unless ``kappa_grad``; finite at κ = inf, where ∂L/∂κ is 0);
    ``masked`` as in :func:`forward`.

    With P = β, S = KL, E = rowsum(P∘S), the outputs are O1 = P V, O2 = (P∘S) V, E,
    O3 = Pᵀ W, O4 = (P∘S)ᵀ W, O5 = Pᵀ (E⊙W), lse. O5 is O3 over the values E⊙W, so
    with Y = P dO5 the energy's total gradient is dE' = dE + rowsum(W⊙Y), and::

        dP_ij = dO1_i·V_j + S_ij (dO2_i·V_j + dE'_i) + W_i·dO3_j + S_ij W_i·dO4_j + E_i W_i·dO5_j
        dS_ij = P_ij (dO2_i·V_j + dE'_i + W_i·dO4_j − dlse_i/κ) − P_ij (dP_ij − D_i) / κ
        D_i   = Σ_j P_ij dP_ij
        dV    = Pᵀ dO1 + (P∘S)ᵀ dO2,      dW = X + E⊙Y,   X = P dO3 + (P∘S) dO4
        dκ    = Σ_ij P_ij (dP_ij − D_i + dlse_i) S_ij / κ²     (P (dP − D + dlse) is ∂L/∂l, l = −S/κ)

    Every term is per query row but dV and the key side of dS's GEMM, which add up over the blocks.
    """
    qa, kb = kl_features(mu, var)
    dtype = softmax_dtype(mu.dtype)
    g_row, g_row_kl, g_energy, g_col, g_col_kl, g_col_energy, g_lse = (g.to(dtype) for g in grads)
    rv, cv = row_values.to(dtype), col_values.to(dtype)
    # the key-side factors of the two [rows, keys] GEMMs of dP's terms: direct (∂/∂S at fixed P) and the rest
    direct_keys = torch.cat([rv, g_col_kl], -1).transpose(1, 2)
    p_keys = torch.cat([rv, g_col, g_col_energy], -1).transpose(1, 2)
    g_cols = torch.cat([g_col, g_col_energy], -1)
    (b, n), dw = mu.shape[:2], cv.shape[-1]
    # the sums over query rows (dV, the keys' b') transposed, [B, D, N]: each block's GEMM adds in place
    grad_rv_t, grad_kb_t = rv.new_zeros(b, rv.shape[-1], n), kb.new_zeros(b, kb.shape[-1], n)
    grad_qa, grad_cv = torch.empty_like(qa), torch.empty_like(cv)
    kappa_sum = torch.zeros((), dtype=torch.float64, device=mu.device)  # κ² ∂L/∂κ
    for r0, r1, keys in row_blocks(n, causal, block_rows):
        kl, beta, _ = _scores(qa[:, r0:r1], kb[:, :keys], r0, kappa, causal, mask_diagonal, dtype, masked)
        beta_kl = beta * kl
        energy = beta_kl.sum(-1, keepdim=True)
        w = cv[:, r0:r1]
        xy = beta @ g_cols[:, :keys]
        x, y = xy[..., :dw] + beta_kl @ g_col_kl[:, :keys], xy[..., dw:]
        g_e = g_energy[:, r0:r1, None] + (w * y).sum(-1, keepdim=True)
        grad_rv_t[..., :keys].baddbmm_(g_row[:, r0:r1].transpose(1, 2), beta)
        grad_rv_t[..., :keys].baddbmm_(g_row_kl[:, r0:r1].transpose(1, 2), beta_kl)
        direct = torch.baddbmm(g_e, torch.cat([g_row_kl[:, r0:r1], w], -1), direct_keys[..., :keys])
        grad_p = torch.cat([g_row[:, r0:r1], w, energy * w], -1) @ p_keys[..., :keys]
        grad_p.addcmul_(kl, direct)
        shift = (beta * grad_p).sum(-1, keepdim=True) - g_lse[:, r0:r1, None]
        grad_p.sub_(shift)
        if kappa_grad:
            kappa_sum = kappa_sum + (grad_p * beta * kl).sum(dtype=torch.float64)
        # dS = P (direct − (dP − D + dlse) / κ); KL_ii ≡ 0 has no gradient
        grad_s = _fill(grad_p.mul_(-1.0 / kappa).add_(direct).mul_(beta), r0,
                       masked_keys(r1 - r0, False, True, mu.device), 0.0).double()
        grad_qa[:, r0:r1] = grad_s @ kb[:, :keys]
        grad_kb_t[..., :keys].baddbmm_(qa[:, r0:r1].transpose(1, 2), grad_s)
        grad_cv[:, r0:r1] = x + energy * y
    return _features_backward(mu, var, grad_qa, grad_kb_t.transpose(1, 2)) + (
        grad_rv_t.transpose(1, 2).to(row_values.dtype).contiguous(), grad_cv.to(col_values.dtype).contiguous(),
        (-kappa_sum).to(dtype))  # ∂L/∂(1/κ): finite at κ = inf too


def _features_backward(mu, var, grad_qa, grad_kb):
    """(dμ, dv) from the gradients of :func:`kl_features`' a' and b', in float64."""
    k = mu.shape[-1]
    muc, v = center(mu.double(), dim=1), var.double()
    gq_mu, gq_var = query_features_backward(muc, v, grad_qa[..., :2 * k], grad_qa[..., 2 * k])
    gk_mu, gk_var = key_features_backward(muc, v, grad_kb[..., :2 * k], grad_kb[..., 2 * k + 1])
    return (gq_mu + gk_mu).to(mu.dtype).contiguous(), (gq_var + gk_var).to(var.dtype).contiguous()
