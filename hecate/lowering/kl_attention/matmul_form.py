"""The op's CPU path (and its ATen decomposition), with [B, N, N] scores and matmuls.

KL is a dot product, c_i + a_i·b_j + d_j (:mod:`hecate.lowering.gaussian_features`), one
GEMM; but it subtracts terms of size μ²/v: with variances spanning e^±7 or means spread
over tens of σ, in float32 the KL of near pairs (which carry the softmax's weight, amplified
by 1/κ) loses every digit, and KL_ii is not 0. So the CPU path forms it in float64 over
centred means (KL is shift-invariant, so the gradient with respect to the centred means is
the gradient with respect to the means) and sets KL_ii = 0 and its gradient exactly
(:func:`pairwise_kl`, :func:`_scores_backward`); then it stays within 10× of eager float32's
own error for variances e^-7..e^7, 30σ spreads and κ = 1e-3 (tests/lowering/test_kl_attention.py),
at about twice the float32 time. The Triton kernels compute the KL per pair per tile instead
(elementwise work is cheap there).
"""

from __future__ import annotations

import torch

from hecate.lowering.gaussian_features import (center, key_features, key_features_backward, query_features,
                                               query_features_backward)


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


def pairwise_kl(mu: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    """KL(q_i ‖ q_j) [B, N, N]: the dot form over centred means in float64, KL_ii = 0 exactly."""
    muc, v = center(mu.double(), dim=1), var.double()
    a, c = query_features(muc, v)
    b, d = key_features(muc, v)
    return _zero_diagonal(torch.baddbmm(c.unsqueeze(-1) + d.unsqueeze(-2), a, b.transpose(1, 2)))


def _zero_diagonal(x: torch.Tensor) -> torch.Tensor:
    """KL_ii is 0 whatever q_i: set it (and its gradient) exactly, where the dot form leaves rounding."""
    return x.masked_fill(torch.eye(x.shape[1], dtype=torch.bool, device=x.device), 0.0)


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
    """(dμ, dv) from dKL [B, N, N] through KL = c_i + a_i·b_j + d_j, in float64; KL_ii ≡ 0 has no gradient."""
    ct = torch.float64
    grad_s = _zero_diagonal(grad_s.to(ct))
    muc = center(mu.to(ct), dim=1)
    v = var.to(ct)
    a, _ = query_features(muc, v)
    b, _ = key_features(muc, v)
    gq_mu, gq_var = query_features_backward(muc, v, grad_s @ b, grad_s.sum(-1))
    gk_mu, gk_var = key_features_backward(muc, v, _t_matmul(grad_s, a), grad_s.sum(-2))
    return (gq_mu + gk_mu).to(mu.dtype).contiguous(), (gq_var + gk_var).to(var.dtype).contiguous()
