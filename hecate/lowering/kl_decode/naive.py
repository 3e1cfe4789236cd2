"""The plain PyTorch reference of ``hecate.kl_decode_logits`` and ``hecate.kl_decode_ce``.

Spec (pure-fep-transformer.md §2.2, §3.3): the token prior bank decodes a belief
q_i = N(μ_i, v_i) through its KL to every token prior π_v = N(m_v, s_v)::

    logits_iv = −KL(q_i ‖ π_v) / τ = −½ Σ_k [log(s_vk / v_ik) + v_ik / s_vk + (μ_ik − m_vk)² / s_vk − 1] / τ
    loss_i    = logsumexp_v(logits_iv) − logits_i,t_i           (cross-entropy; 0 where t_i = ignore_index)

This reference builds the [M, V, K] tensor that the fused ops never form.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def kl_decode_logits_naive(mu, var, prior_mu, prior_var, tau: float) -> torch.Tensor:
    """[..., V] logits −KL(q ‖ π_v)/τ through the [..., V, K] broadcast."""
    mu_i, var_i = mu.unsqueeze(-2), var.unsqueeze(-2)
    kl = 0.5 * (torch.log(prior_var / var_i) + var_i / prior_var + (mu_i - prior_mu).square() / prior_var - 1.0)
    return -kl.sum(-1) / tau


def kl_decode_ce_naive(mu, var, prior_mu, prior_var, targets, tau: float, ignore_index: int = -100):
    """(loss [M], lse [M]) for beliefs [M, K] and targets [M]."""
    logits = kl_decode_logits_naive(mu, var, prior_mu, prior_var, tau)
    loss = F.cross_entropy(logits, targets, reduction="none", ignore_index=ignore_index)
    return loss, torch.logsumexp(logits, -1)
