"""KL decode as a matmul plus per-token bias, and the CPU path built on it.

With the dot-product form of :mod:`hecate.lowering.gaussian_features`
(beliefs on the query side, token priors on the key side)::

    KL(q_i ‖ π_v) = c_i + a_i · b_v + d_v,     logits_iv = −KL / τ

Means are shifted by the prior bank's mean first (KL is shift-invariant; this keeps
the dot product well-conditioned), so the logits are one [M, 2K] × [2K, V] matmul.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hecate.lowering.gaussian_features import (key_features, key_features_backward, query_features,
                                               query_features_backward)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp16/bf16 inputs are computed in fp32; fp32 and fp64 in their own precision."""
    return torch.promote_types(dtype, torch.float32)


def features(mu, var, prior_mu, prior_var):
    """(a, c, b, d, shifted μ, shifted prior means) in the compute dtype; mu is [M, K], prior [V, K]."""
    ct = compute_dtype(mu.dtype)
    shift = prior_mu.to(ct).nan_to_num(0.0, 0.0, 0.0).mean(0)  # of the finite entries: a NaN prior stays its own
    muc, pmc = mu.to(ct) - shift, prior_mu.to(ct) - shift
    a, c = query_features(muc, var.to(ct))
    b, d = key_features(pmc, prior_var.to(ct))
    return a, c, b, d, muc, pmc


def logits(mu, var, prior_mu, prior_var, tau: float) -> torch.Tensor:
    a, c, b, d, _, _ = features(mu, var, prior_mu, prior_var)
    return (torch.addmm(c.unsqueeze(-1) + d, a, b.t()) * (-1.0 / tau)).to(mu.dtype)


def grad_from_logits(mu, var, prior_mu, prior_var, grad_logits, tau: float):
    """(dμ, dv, d prior_mu, d prior_var) from d logits [M, V]."""
    a, _, b, _, muc, pmc = features(mu, var, prior_mu, prior_var)
    ct = a.dtype
    ct_var, ct_pvar = var.to(ct), prior_var.to(ct)
    grad_s = grad_logits.to(ct) * (-1.0 / tau)  # dKL
    gq_mu, gq_var = query_features_backward(muc, ct_var, grad_s @ b, grad_s.sum(-1))
    gk_mu, gk_var = key_features_backward(pmc, ct_pvar, grad_s.t() @ a, grad_s.sum(0))
    # the shift by the prior mean: KL is invariant under it, so its gradient adds nothing
    return gq_mu.to(mu.dtype), gq_var.to(var.dtype), gk_mu.to(prior_mu.dtype), gk_var.to(prior_var.dtype)


def ce(mu, var, prior_mu, prior_var, targets, tau: float, ignore_index: int):
    """(loss [M], lse [M] float64) in the matmul form (materialises [M, V]: the CPU path)."""
    z = logits(mu, var, prior_mu, prior_var, tau).to(compute_dtype(mu.dtype))
    loss = F.cross_entropy(z, targets, reduction="none", ignore_index=ignore_index)
    return loss.to(mu.dtype), torch.logsumexp(z.double(), -1)


def ce_grad_logits(mu, var, prior_mu, prior_var, targets, lse, grad_loss, tau: float, ignore_index: int):
    """d logits = g_i (softmax_iv − [v = t_i]), 0 on ignored rows.

    The softmax is taken of z itself, exp(z − max) / Σ, not exp(z − lse) with the forward's lse: where the logits
    are large (−550: a wide belief, a small τ) lse rounds by up to half an ulp there (3e-5 in fp32), every
    probability with it, and Σ_v p_v ≠ 1 multiplies the large terms of dv (probe r19: ∂/∂ log v 1e-4 off, eager
    1e-6). ``lse`` stays in the signature: the Triton backward reads it (in float64, split into two fp32)."""
    z = logits(mu, var, prior_mu, prior_var, tau).to(compute_dtype(mu.dtype))
    p = torch.softmax(z, -1)
    valid = targets != ignore_index
    p = p - F.one_hot(torch.where(valid, targets, 0), z.shape[-1]).to(z.dtype)
    # where, not × valid: a mean over no target gives each row an infinite gradient, and ignored rows get 0
    return p * torch.where(valid, grad_loss.to(z.dtype), 0.0).unsqueeze(-1)
