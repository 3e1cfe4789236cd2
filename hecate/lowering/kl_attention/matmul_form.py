"""The op's CPU path (and its ATen decomposition), with [B, N, N] scores and matmuls.

KL could be a dot product, c_i + a_i·b_j + d_j (:mod:`hecate.lowering.gaussian_features`),
but that subtracts terms of size μ²/v: with variances spanning e^±7 or means spread over
tens of σ, the KL of near pairs (which carry the softmax's weight, amplified by 1/κ) loses
every digit, and KL_ii is not 0. So the KL values and their gradient are computed per pair,
as the model writes them (:func:`pairwise_kl`, :func:`_scores_backward`: differences are
formed before anything large, KL_ii = 0 exactly), in float64, over chunks of K (never
[B, N, N, K] whole); the Triton kernels do the same per tile.
"""

from __future__ import annotations

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The CPU path computes in float64 whatever the input: the softmax's gradient is amplified by
    1/κ (κ down to 1e-3), and its float32 rounding would then exceed eager's own error."""
    return torch.float64


_MASKS: dict = {}


def masked_keys(n: int, causal: bool, mask_diagonal: bool, device) -> torch.Tensor | None:
    """[N, N] bool, True where query i may NOT attend to key j; None when every pair is allowed.

    Cached per (N, mask, device) outside tracing (under fake/proxy modes a cached tensor would leak).
    """
    if not causal and not mask_diagonal:
        return None
    key = (n, causal, mask_diagonal, str(device))
    tracing = torch._C._len_torch_dispatch_stack() > 0
    if tracing or key not in _MASKS:
        i = torch.arange(n, device=device)
        j, i = i.unsqueeze(0), i.unsqueeze(1)
        if causal:
            masked = (j >= i) if mask_diagonal else (j > i)
        else:
            masked = j == i
        if tracing:
            return masked
        if len(_MASKS) > 64:
            _MASKS.clear()
        _MASKS[key] = masked
    return _MASKS[key]


_CHUNK = 1 << 22  # pair-feature elements per chunk of K: bounds the [B, N, N, k] temporaries


def pairwise_kl(mu: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    """KL(q_i ‖ q_j) [B, N, N] per pair, in float64, summed over K in chunks.

    ½ Σ_k [((μ_ik − μ_jk)² + v_ik − v_jk) / v_jk + log v_jk − log v_ik], the form the Triton
    kernels use: differences are formed before anything large is, so KL_ii is exactly 0
    and a near pair's KL keeps its relative precision.
    """
    mu, var = mu.double(), var.double()
    b, n, k = mu.shape
    log_var = torch.log(var)
    tracing = torch._C._len_torch_dispatch_stack() > 0 or not isinstance(k, int)
    step = k if tracing else max(1, _CHUNK // max(1, b * n * n))
    total = None
    for start in range(0, k, step):
        m, v, lv = (t[..., start:start + step] for t in (mu, var, log_var))
        d = m.unsqueeze(2) - m.unsqueeze(1)
        vi, vj = v.unsqueeze(2), v.unsqueeze(1)
        part = ((d * d + (vi - vj)) / vj + (lv.unsqueeze(1) - lv.unsqueeze(2))).sum(-1)
        total = part if total is None else total + part
    return 0.5 * total


def scores_and_beta(mu, var, kappa: float, causal: bool, mask_diagonal: bool):
    """(KL [B,N,N], β [B,N,N] with 0 at masked pairs, lse [B,N]).

    KL is 0 at masked pairs (every use multiplies it by β, which is 0 there).
    One pass of exp: β = exp(l − m) / Σ, lse = m + log Σ (m = 0 on a row with no key, so
    its β is exp(−inf) = 0 and its lse is log 0 = −inf).
    """
    ct = compute_dtype(mu.dtype)
    kl = pairwise_kl(mu, var).to(ct)
    logits = kl * (-1.0 / kappa)
    masked = masked_keys(mu.shape[1], causal, mask_diagonal, mu.device)
    if masked is not None:
        logits = logits.masked_fill(masked, float("-inf"))
        kl = kl.masked_fill(masked, 0.0)  # β is 0 there: 0, not β·KL, even for a NaN or infinite belief
    m = logits.amax(-1, keepdim=True)
    if masked is not None:
        m = m.masked_fill(torch.isinf(m), 0.0)
    if torch._C._len_torch_dispatch_stack() > 0:  # traced (decomposition for export): stay functional
        p = torch.exp(logits - m)
        total = p.sum(-1, keepdim=True)
        beta = p / total.clamp_min(torch.finfo(p.dtype).tiny)
    else:  # the CPU path: reuse the [B, N, N] buffer
        p = torch.exp_(logits.sub_(m))
        total = p.sum(-1, keepdim=True)
        beta = p.div_(total.clamp_min(torch.finfo(p.dtype).tiny))
    lse = (m + torch.log(total)).squeeze(-1)
    return kl, beta, lse


def _t_matmul(x, y):
    """xᵀ @ y for x [B, N, N], y [B, N, D], as (yᵀ @ x)ᵀ: the big matrix is never transposed."""
    return (y.transpose(1, 2) @ x).transpose(1, 2)


def forward(mu, var, row_values, col_values, kappa: float, causal: bool, mask_diagonal: bool):
    """The op's seven outputs in the matmul form (CPU path, and the ATen decomposition)."""
    kl, beta, lse = scores_and_beta(mu, var, kappa, causal, mask_diagonal)
    beta_kl = beta * kl
    energy = beta_kl.sum(-1)
    rv, cv = row_values.to(kl.dtype), col_values.to(kl.dtype)
    dt = mu.dtype
    return ((beta @ rv).to(dt), (beta_kl @ rv).to(dt), energy.to(dt), _t_matmul(beta, cv).to(dt).contiguous(),
            _t_matmul(beta_kl, cv).to(dt).contiguous(),
            _t_matmul(beta, energy.unsqueeze(-1) * cv).to(dt).contiguous(), lse.to(dt))


def backward(mu, var, row_values, col_values, grads, kappa: float, causal: bool, mask_diagonal: bool):
    """(dμ, dv, d row_values, d col_values) given the gradients of the seven outputs.

    With P = β, S = KL, E = rowsum(P∘S), the outputs are O1 = P V, O2 = (P∘S) V, E,
    O3 = Pᵀ W, O4 = (P∘S)ᵀ W, O5 = Pᵀ (E⊙W), lse. O5 is O3 over the values E⊙W, so
    with Y = P dO5 the energy's total gradient is dE' = dE + rowsum(W⊙Y), and::

        dP_ij = dO1_i·V_j + S_ij (dO2_i·V_j + dE'_i) + W_i·dO3_j + S_ij W_i·dO4_j + E_i W_i·dO5_j
        dS_ij = P_ij (dO2_i·V_j + dE'_i + W_i·dO4_j − dlse_i/κ) − P_ij (dP_ij − D_i) / κ
        D_i   = Σ_j P_ij dP_ij = dO1_i·O1_i + dO2_i·O2_i + dE'_i E_i + W_i·X_i + E_i W_i·Y_i
        dV    = Pᵀ dO1 + (P∘S)ᵀ dO2,      dW = X + E⊙Y,   X = P dO3 + (P∘S) dO4
    """
    kl, beta, _ = scores_and_beta(mu, var, kappa, causal, mask_diagonal)
    g_row, g_row_kl, g_energy, g_col, g_col_kl, g_col_energy, g_lse = (g.to(kl.dtype) for g in grads)
    rv, cv = row_values.to(kl.dtype), col_values.to(kl.dtype)
    beta_kl = beta * kl
    energy = beta_kl.sum(-1, keepdim=True)
    x = beta @ g_col + beta_kl @ g_col_kl
    y = beta @ g_col_energy
    g_energy = g_energy.unsqueeze(-1) + (cv * y).sum(-1, keepdim=True)
    grad_rv = _t_matmul(beta, g_row) + _t_matmul(beta_kl, g_row_kl)
    direct = g_row_kl @ rv.transpose(1, 2) + g_energy + cv @ g_col_kl.transpose(1, 2)  # ∂/∂S at fixed P
    grad_p = (g_row @ rv.transpose(1, 2) + kl * direct + cv @ g_col.transpose(1, 2)
              + (energy * cv) @ g_col_energy.transpose(1, 2))
    row_dot = (beta * grad_p).sum(-1, keepdim=True)
    grad_s = beta * (direct - g_lse.unsqueeze(-1) / kappa) - beta * (grad_p - row_dot) / kappa
    grad_cv = x + energy * y
    return _scores_backward(mu, var, grad_s) + (grad_rv.to(row_values.dtype).contiguous(),
                                                grad_cv.to(col_values.dtype).contiguous())


def _scores_backward(mu, var, grad_s):
    """(dμ, dv) from dKL [B, N, N], per pair like :func:`pairwise_kl` (float64, K in chunks).

    ∂KL_ij/∂μ_i = −∂KL_ij/∂μ_j = (μ_i − μ_j)/v_j, ∂KL_ij/∂v_i = ½ (v_i − v_j)/(v_i v_j),
    ∂KL_ij/∂v_j = ½ (v_j − v_i − (μ_i − μ_j)²)/v_j²: each vanishes on the diagonal exactly,
    where an expansion into per-position sums would leave rounding of size 1/κ.
    """
    g = grad_s.double().unsqueeze(-1)
    m, v = mu.double(), var.double()
    b, n, k = m.shape
    tracing = torch._C._len_torch_dispatch_stack() > 0 or not isinstance(k, int)
    step = k if tracing else max(1, _CHUNK // max(1, b * n * n))
    grad_mu, grad_var = [], []
    for start in range(0, k, step):
        mc, vc = m[..., start:start + step], v[..., start:start + step]
        vi, vj = vc.unsqueeze(2), vc.unsqueeze(1)
        d = mc.unsqueeze(2) - mc.unsqueeze(1)
        t = g * d / vj
        grad_mu.append(t.sum(2) - t.sum(1))
        gv_i = (g * (vi - vj) / (vi * vj)).sum(2)
        gv_j = (g * (vj - vi - d * d) / (vj * vj)).sum(1)
        grad_var.append(0.5 * (gv_i + gv_j))
    return (torch.cat(grad_mu, -1).to(mu.dtype).contiguous(), torch.cat(grad_var, -1).to(var.dtype).contiguous())
