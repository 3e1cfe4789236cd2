"""The plain PyTorch reference of ``hecate.kl_attention``: the spec's broadcast form.

Spec (pure-fep-transformer.md §1.3, §3.2), for diagonal Gaussians q_i = N(μ_i, v_i)::

    KL_ij = KL(q_i ‖ q_j) = ½ Σ_k [log(v_jk / v_ik) + v_ik / v_jk + (μ_ik − μ_jk)² / v_jk − 1]
    β_ij  = softmax_j(−KL_ij / κ)            over the allowed keys j
            (causal: j ≤ i; mask_diagonal: j ≠ i; allowed[(b,) i, j]: a mask given at run time)

What the op returns (per batch b; V: row values [N, Dv], W: column values [N, Dw])::

    row_sum[i]    = Σ_j β_ij V_j               β-weighted sums of per-key features
    row_kl_sum[i] = Σ_j β_ij KL_ij V_j         the product-rule terms of §4.1
    energy[i]     = Σ_j β_ij KL_ij             the alignment energy of §3.4
    col_sum[i]    = Σ_k β_ki W_k               "others aligning to i" (a transposed sum)
    col_kl_sum[i] = Σ_k β_ki KL_ki W_k
    col_energy_sum[i] = Σ_k β_ki energy[k] W_k    (the product rule through row k's softmax)
    lse[i]        = log Σ_j exp(−KL_ij / κ)    (what the backward recomputes β from)

A row with no allowed key (N = 1 with the diagonal masked, or row 0 of a causal
diagonal-masked attention) has β_i· = 0: its sums are 0 and its lse is −inf.
This reference builds the [B, N, N, K] tensor the fused op never does.
"""

from __future__ import annotations

import torch


def allowed_keys(n: int, causal: bool, mask_diagonal: bool, device: torch.device | str = "cpu") -> torch.Tensor:
    """[N, N] bool: entry (i, j) says whether query i may attend to key j."""
    i = torch.arange(n, device=device)[:, None]
    j = torch.arange(n, device=device)[None, :]
    allowed = torch.ones(n, n, dtype=torch.bool, device=device)
    if causal:
        allowed = allowed & (j <= i)
    if mask_diagonal:
        allowed = allowed & (j != i)
    return allowed


def kl_pairwise(mu: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    """KL(q_i ‖ q_j) for all pairs, [B, N, N], through the [B, N, N, K] broadcast."""
    mu_i, mu_j = mu.unsqueeze(2), mu.unsqueeze(1)  # [B, N, 1, K], [B, 1, N, K]
    var_i, var_j = var.unsqueeze(2), var.unsqueeze(1)
    kl = 0.5 * (torch.log(var_j / var_i) + var_i / var_j + (mu_i - mu_j).square() / var_j - 1.0)
    return kl.sum(dim=-1)


def kl_attention_naive(mu: torch.Tensor, var: torch.Tensor, row_values: torch.Tensor, col_values: torch.Tensor,
                       kappa: float, causal: bool, mask_diagonal: bool, allowed: torch.Tensor | None = None,
                       inverse_kappa: torch.Tensor | None = None):
    """The seven outputs of ``hecate.kl_attention`` (see the module docstring); ``allowed`` [(B,) N, N] a mask
    known at run time, besides the flags'; ``inverse_kappa`` 1/κ given instead of κ (the op's
    ``inverse_temperature``: −KL · (1/κ) keeps its gradient finite where 1/κ is 0)."""
    n = mu.shape[1]
    kl = kl_pairwise(mu, var)  # [B, N, N]
    keys = allowed_keys(n, causal, mask_diagonal, mu.device)
    allowed = keys if allowed is None else keys & allowed
    logits = (-kl / kappa if inverse_kappa is None else -kl * inverse_kappa).masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)  # −inf on a row with no allowed key
    beta = torch.exp(logits - lse.masked_fill(torch.isinf(lse), 0.0).unsqueeze(-1))  # 0 where masked
    beta_kl = beta * kl.masked_fill(~allowed, 0.0)
    energy = beta_kl.sum(-1)
    return (beta @ row_values, beta_kl @ row_values, energy,
            beta.transpose(1, 2) @ col_values, beta_kl.transpose(1, 2) @ col_values,
            beta.transpose(1, 2) @ (energy.unsqueeze(-1) * col_values), lse)
