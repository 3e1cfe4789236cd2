"""KL between diagonal Gaussians as a dot product: the features both KL ops build on.

DESIGN fact "Pairwise KL is a dot product"::

    KL(q_i ‖ p_j) = c_i + a_i · b_j + d_j
    a_i = [v_i + μ_i², μ_i]                 [.., 2K]   (query side)
    b_j = [1 / (2 v_j), −μ_j / v_j]         [.., 2K]   (key / prior side)
    c_i = −½ Σ_k (log v_ik + 1)             [..]
    d_j =  ½ Σ_k (log v_jk + μ_jk² / v_jk)  [..]

The expansion subtracts terms of size μ²/v: callers shift the means first (KL is
shift-invariant) and compute KL values that are read whole per pair instead
(``kl_attention/matmul_form.kl_features``).
"""

from __future__ import annotations

import torch


def center(mu: torch.Tensor, dim: int) -> torch.Tensor:
    """μ minus the mean over ``dim`` of its finite entries (KL is shift-invariant; this keeps a · b
    well-conditioned, and a NaN or ±inf belief stays its own, as in the per-pair form). The mean is
    detached: the KL's gradient with respect to a common shift is 0, and through the mean autograd would
    give every belief the sum of all their gradients, a NaN of one belief's gradient (a β read by
    ``xlogy(β, β)`` at a masked key, say) reaching all."""
    return mu - mu.nan_to_num(0.0, 0.0, 0.0).mean(dim=dim, keepdim=True).detach()


def query_features(mu: torch.Tensor, var: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(a, c): a = [v + μ², μ] [.., 2K], c = −½ Σ(log v + 1) [..]."""
    a = torch.cat([var + mu * mu, mu], dim=-1)
    c = -0.5 * (torch.log(var) + 1.0).sum(-1)
    return a, c


def key_features(mu: torch.Tensor, var: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(b, d): b = [1/(2v), −μ/v] [.., 2K], d = ½ Σ(log v + μ²/v) [..]."""
    inv = 1.0 / var
    b = torch.cat([0.5 * inv, -mu * inv], dim=-1)
    d = 0.5 * (torch.log(var) + mu * mu * inv).sum(-1)
    return b, d


def query_features_backward(mu, var, grad_a, grad_c):
    """(dμ, dv) from the gradients of (a, c) of :func:`query_features`."""
    k = mu.shape[-1]
    ga_var, ga_mu = grad_a[..., :k], grad_a[..., k:]
    grad_mu = 2.0 * mu * ga_var + ga_mu
    grad_var = ga_var - 0.5 * grad_c.unsqueeze(-1) / var
    return grad_mu, grad_var


def key_features_backward(mu, var, grad_b, grad_d):
    """(dμ, dv) from the gradients of (b, d) of :func:`key_features`."""
    k = mu.shape[-1]
    inv = 1.0 / var
    gb_var, gb_mu = grad_b[..., :k], grad_b[..., k:]
    gd = grad_d.unsqueeze(-1)
    grad_mu = -gb_mu * inv + gd * mu * inv
    grad_var = (-0.5 * gb_var + gb_mu * mu) * inv * inv + gd * (0.5 * inv - 0.5 * mu * mu * inv * inv)
    return grad_mu, grad_var
