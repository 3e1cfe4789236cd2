"""The Pure FEP transformer (hecate/models/fep.py) against the spec's equations.

References are independent of the model's analytic code: torch.autograd of the
VFE (β computed from q inside F, so the product rule through β is included),
per-pair loops, and the spec's own loop for the token-prior update.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from hecate.models.fep import (
    MAX_FISHER_STEP,     PureFEPConfig, PureFEPTransformer, TokenPriorBank, attention_mask, compute_attention,
    compute_mu_gradient, compute_sigma_gradient, compute_vfe, kl_pairwise, kl_self_coupling,
    natural_gradient_step, observation_likelihood, p_flow, q_flow, update_token_priors)
from hecate.testing import assert_close

GRAD_TOL = 1e-6  # float64 analytic vs autograd


def _beliefs(B, N, K, V, dtype=torch.float64, sigma_range=(0.5, 1.5)):
    lo, hi = sigma_range
    μ = torch.randn(B, N, K, dtype=dtype, requires_grad=True)
    σ = (lo + (hi - lo) * torch.rand(B, N, K, dtype=dtype)).requires_grad_()
    μ_p = torch.randn(N, K, dtype=dtype)
    σ_p = 0.5 + torch.rand(N, K, dtype=dtype)
    bank = TokenPriorBank(V, K).to(dtype)
    with torch.no_grad():
        bank.log_sigma.uniform_(-0.5, 0.5)
    targets = torch.randint(0, V, (B, N))
    return μ, σ, μ_p, σ_p, bank, targets


def _kl_first_slot_only(μ, σ, eps, live_slot):
    """KL(q_i‖q_j) with only one slot differentiable ("first": i, "second": j)."""
    var = σ.square() + eps
    μ_i, var_i = μ.unsqueeze(2), var.unsqueeze(2)
    μ_j, var_j = μ.unsqueeze(1), var.unsqueeze(1)
    if live_slot == "first":
        μ_j, var_j = μ_j.detach(), var_j.detach()
    else:
        μ_i, var_i = μ_i.detach(), var_i.detach()
    return 0.5 * (torch.log(var_j / var_i) + var_i / var_j + (μ_i - μ_j).square() / var_j - 1.0).sum(-1)


def _reference_gradients(μ, σ, μ_p, σ_p, bank, targets, mask, config, part):
    """autograd of the VFE part: "self", "obs", "align" (joint F), "align_own_row"
    (each agent's own row: the "agent" gradient) or "align_others" (joint − own row)."""
    if part == "self":
        F_ = config.alpha * kl_self_coupling(μ, σ, μ_p, σ_p, config.eps).sum()
    elif part == "obs":
        F_ = observation_likelihood(μ, σ, bank, targets, config.tau, config.eps).sum()
    elif part == "align":
        F_, _ = compute_vfe(μ, σ, μ_p, σ_p, mask, bank, None, config)
        F_ = F_ - config.alpha * kl_self_coupling(μ, σ, μ_p, σ_p, config.eps).sum()
    else:
        kl = _kl_first_slot_only(μ, σ, config.eps, "first" if part == "align_own_row" else "second")
        β = compute_attention(kl, config.kappa, mask)  # β from the same slot: product rule included
        F_ = config.lambda_beta * (β * kl).sum()
    return torch.autograd.grad(F_, (μ, σ))


def _analytic_gradients(μ, σ, μ_p, σ_p, bank, targets, mask, config):
    with torch.no_grad():
        kl = kl_pairwise(μ, σ, config.eps)
        β = compute_attention(kl, config.kappa, mask)
        return (compute_mu_gradient(μ, σ, μ_p, σ_p, β, kl, bank, targets, config),
                compute_sigma_gradient(μ, σ, μ_p, σ_p, β, kl, bank, targets, config))


@pytest.mark.parametrize("N,K", [(5, 3), (1, 3), (4, 1)])
def test_kl_pairwise_matches_per_pair_loop(N, K):
    μ = torch.randn(2, N, K, dtype=torch.float64)
    σ = 0.3 + torch.rand(2, N, K, dtype=torch.float64)
    eps = 1e-6
    expected = torch.empty(2, N, N, dtype=torch.float64)
    for b in range(2):
        for i in range(N):
            for j in range(N):
                kl = 0.0
                for k in range(K):
                    vi, vj = σ[b, i, k] ** 2 + eps, σ[b, j, k] ** 2 + eps
                    kl += 0.5 * (math.log(vj / vi) + vi / vj + (μ[b, i, k] - μ[b, j, k]) ** 2 / vj - 1)
                expected[b, i, j] = kl
    assert_close("kl_pairwise", kl_pairwise(μ, σ, eps), expected, 1e-12)
    assert torch.all(torch.diagonal(kl_pairwise(μ, σ, eps), dim1=1, dim2=2).abs() < 1e-12)


@pytest.mark.parametrize("mask_diagonal", [False, True], ids=["keep_diag", "mask_diag"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("N", [5, 1])
@pytest.mark.parametrize("q_flow_gradient", ["joint", "agent"])
def test_q_flow_gradients_match_autograd_of_vfe(q_flow_gradient, N, causal, mask_diagonal):
    """Full analytic ∂F/∂μ, ∂F/∂σ (self + alignment + observation) vs autograd."""
    K, V = 3, 7
    config = PureFEPConfig(vocab_size=V, embed_dim=K, max_seq_len=8, alpha=0.3, lambda_beta=1.3,
                           kappa=0.7, tau=0.9, causal=causal, mask_diagonal=mask_diagonal,
                           q_flow_gradient=q_flow_gradient)
    μ, σ, μ_p, σ_p, bank, targets = _beliefs(2, N, K, V)
    mask = attention_mask(N, causal, mask_diagonal)
    parts = ["self", "obs", "align" if q_flow_gradient == "joint" else "align_own_row"]
    ref = [sum(g) for g in zip(*(_reference_gradients(μ, σ, μ_p, σ_p, bank, targets, mask, config, p)
                                 for p in parts))]
    got = _analytic_gradients(μ, σ, μ_p, σ_p, bank, targets, mask, config)
    assert_close("∂F/∂μ", got[0], ref[0], GRAD_TOL)
    assert_close("∂F/∂σ", got[1], ref[1], GRAD_TOL)


@pytest.mark.parametrize("mask_diagonal", [False, True], ids=["keep_diag", "mask_diag"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("term", ["self", "obs", "align_own_row", "align_others"])
def test_each_gradient_term_matches_autograd(term, causal, mask_diagonal):
    """Each VFE term alone, mean and variance. align_own_row is the direct term plus
    the product rule through row i's β; align_others is others-aligning-to-i plus
    the product rule through row j's β (the joint gradient minus the agent one)."""
    N, K, V = 6, 5, 9
    base = dict(vocab_size=V, embed_dim=K, max_seq_len=8, kappa=0.6, tau=1.1,
                causal=causal, mask_diagonal=mask_diagonal)
    μ, σ, μ_p, σ_p, bank, targets = _beliefs(2, N, K, V)
    mask = attention_mask(N, causal, mask_diagonal)
    with_targets = targets if term == "obs" else None
    weights = dict(alpha=0.0, lambda_beta=0.0)
    if term == "self":
        weights["alpha"] = 0.4
    elif term.startswith("align"):
        weights["lambda_beta"] = 1.7

    def grads(mode):
        cfg = PureFEPConfig(**base, **weights, q_flow_gradient=mode)
        return _analytic_gradients(μ, σ, μ_p, σ_p, bank, with_targets, mask, cfg)

    cfg = PureFEPConfig(**base, **weights)
    ref = _reference_gradients(μ, σ, μ_p, σ_p, bank, targets, mask, cfg, term)
    if term == "align_others":
        got = [j - a for j, a in zip(grads("joint"), grads("agent"))]
    else:
        got = grads("agent")
    assert_close(f"{term} ∂/∂μ", got[0], ref[0], GRAD_TOL)
    assert_close(f"{term} ∂/∂σ", got[1], ref[1], GRAD_TOL)


def test_product_rule_through_beta_matters():
    """The product-rule terms are not negligible: with β held fixed, autograd of F
    differs from the analytic gradient by far more than the tolerance above, so
    the tests above would catch a missing product rule."""
    N, K, V = 6, 4, 5
    config = PureFEPConfig(vocab_size=V, embed_dim=K, max_seq_len=8, alpha=0.0, kappa=0.5)
    μ, σ, μ_p, σ_p, bank, _ = _beliefs(1, N, K, V)
    mask = attention_mask(N, True, False)
    with torch.no_grad():
        β_fixed = compute_attention(kl_pairwise(μ, σ, config.eps), config.kappa, mask)
    F_fixed, _ = compute_vfe(μ, σ, μ_p, σ_p, mask, bank, None, config, β=β_fixed)
    ref_fixed = torch.autograd.grad(F_fixed, (μ, σ))
    got = _analytic_gradients(μ, σ, μ_p, σ_p, bank, None, mask, config)
    for name, g, r in zip(("μ", "σ"), got, ref_fixed):
        err = (g - r).norm() / r.norm()
        assert err > 1e-2, f"∂F/∂{name}: product rule through β changed the gradient by only {err:.2e}"


def _model(**overrides):
    config = dict(vocab_size=11, embed_dim=5, n_layers=2, max_seq_len=12, n_vfe_steps=2)
    config.update(overrides)
    torch.manual_seed(0)
    return PureFEPTransformer(PureFEPConfig(**config))


@pytest.mark.parametrize("q_flow_gradient,leaks", [("agent", False), ("joint", True)])
def test_agent_gradient_is_causal_joint_gradient_sees_the_future(q_flow_gradient, leaks):
    """With q_flow_gradient="agent" the logits at positions < t do not depend on the
    token at t; the spec's joint gradient (others aligning to i) lets later beliefs
    move earlier ones, as documented."""
    model = _model(q_flow_gradient=q_flow_gradient, observation_in_q_flow=False).double()
    ids = torch.randint(0, 11, (1, 9))
    changed = ids.clone()
    changed[0, 6] = (ids[0, 6] + 1) % 11
    with torch.no_grad():
        before, _ = model(ids)
        after, _ = model(changed)
    past_diff = (before[:, :6] - after[:, :6]).abs().max().item()
    assert (after[:, 6] - before[:, 6]).abs().max() > 1e-6  # the change itself is seen
    if leaks:
        assert past_diff > 1e-6
    else:
        assert past_diff == 0.0


@pytest.mark.parametrize("sigma,kappa", [(1e-4, 1.0), (1e3, 1.0), (1.0, 1e-4), (1e-3, 1e-3)])
@pytest.mark.parametrize("mask_diagonal", [False, True], ids=["keep_diag", "mask_diag"])
def test_no_nan_for_extreme_variances_and_small_kappa(sigma, kappa, mask_diagonal):
    """float32 Q-flow + decode + backward stay finite; with the diagonal masked the
    first row has no key at all (softmax of all −inf)."""
    model = _model(kappa=kappa, mask_diagonal=mask_diagonal)
    with torch.no_grad():
        model.token_priors.log_sigma.fill_(math.log(sigma))
        for p in model.position_priors:
            p.log_sigma.fill_(math.log(sigma))
    ids = torch.randint(0, 11, (2, 7))
    logits, loss = model(ids[:, :-1], ids[:, 1:])
    loss.backward()
    assert torch.isfinite(logits).all() and torch.isfinite(loss)
    for name, p in model.named_parameters():
        assert torch.isfinite(p.grad).all(), name


def test_fully_masked_row_gives_zero_attention_and_finite_gradient():
    kl = torch.rand(1, 3, 3, requires_grad=True)
    mask = attention_mask(3, causal=True, mask_diagonal=True)  # row 0 allows nothing
    β = compute_attention(kl, 0.5, mask)
    assert torch.equal(β[0, 0], torch.zeros(3))
    assert_close("β row 2", β[0, 2].sum(), torch.tensor(1.0), 1e-6)
    (β * torch.randn(1, 3, 3)).sum().backward()
    assert torch.isfinite(kl.grad).all()


def test_natural_gradient_step_formula_trust_region_and_positivity():
    μ = torch.randn(3, 4, dtype=torch.float64)
    σ = 0.2 + torch.rand(3, 4, dtype=torch.float64)
    g_μ, g_σ = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    μ_new, σ_new = natural_gradient_step(μ, σ, g_μ, g_σ, lr_μ=0.1, lr_σ=0.05, variance_floor=1e-4)
    grad_var = g_σ / (2 * σ)  # ∂F/∂v from ∂F/∂σ
    assert_close("μ_new", μ_new, μ - 0.1 * σ ** 2 * g_μ, 1e-12)
    assert_close("σ_new", σ_new, σ * torch.exp(-0.05 * σ ** 2 * grad_var), 1e-12)
    # huge gradients: the step stops at the trust region (MAX_FISHER_STEP Fisher units)
    huge = torch.full_like(σ, 1e30)
    μ_far, σ_small = natural_gradient_step(μ, σ, huge, huge, 0.1, 0.05, 1e-4)
    assert_close("clipped μ step", μ_far, μ - MAX_FISHER_STEP * σ, 1e-12)
    assert_close("clipped σ step", σ_small, (σ * math.exp(-MAX_FISHER_STEP)).clamp(min=1e-2), 1e-12)
    _, σ_big = natural_gradient_step(μ, σ, g_μ, -huge, 0.1, 0.05, 1e-4)
    assert_close("clipped σ growth", σ_big, σ * math.exp(MAX_FISHER_STEP), 1e-12)
    _, σ_floor = natural_gradient_step(μ, torch.full_like(σ, 1e-3), g_μ, g_σ, 0.1, 0.05, 1e-4)
    assert torch.all(σ_floor == 1e-2)


def test_token_prior_update_equals_spec_loop():
    """§5.3's loop, written out, against the vectorised index_add_ version."""
    V, K, B, N, lr = 6, 3, 3, 7, 0.2
    bank = TokenPriorBank(V, K).double()
    μ_q = torch.randn(B, N, K, dtype=torch.float64)
    targets = torch.randint(0, 3, (B, N))  # few distinct tokens: many repeats
    targets[0, 0] = 5
    expected = bank.mu.detach().clone()
    for b in range(B):
        for n in range(N):
            v = targets[b, n].item()
            expected[v] += lr * (μ_q[b, n] - expected[v])
    update_token_priors(bank, μ_q, targets, lr)
    assert_close("token prior means", bank.mu.detach(), expected, 1e-12)


def test_p_flow_formula():
    N, K = 5, 3
    config = PureFEPConfig(lr_prior=0.3)
    μ_p, σ_p = torch.randn(N, K, dtype=torch.float64), torch.rand(N, K, dtype=torch.float64) + 0.5
    μ_q, σ_q = torch.randn(4, N, K, dtype=torch.float64), torch.rand(4, N, K, dtype=torch.float64)
    errors = torch.tensor([0.1, 1.0, 2.0, 8.0, 1.5], dtype=torch.float64)
    μ_new, σ_new = p_flow(μ_p, σ_p, μ_q, σ_q, errors, config)
    mean_error = sum(errors.tolist()) / N
    for n in range(N):
        scale = math.sqrt(min(max(errors[n].item() / (mean_error + 1e-6), 0.5), 2.0))
        target = μ_q[:, n].mean(0)
        assert_close(f"μ_p[{n}]", μ_new[n], μ_p[n] + 0.3 * scale * (target - μ_p[n]), 1e-12)
    assert σ_new is σ_p


def test_train_step_applies_backprop_then_p_flow():
    """With a zero-lr optimizer only P-flow moves the priors, exactly as p_flow and
    update_token_priors say; the backward pass reaches every layer's priors."""
    model = _model(lr_prior=0.1, lr_token_prior=0.05).double()
    ids = torch.randint(0, 11, (3, 8))
    x, y = ids[:, :-1], ids[:, 1:]
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        logits, _, beliefs = model(x, y, return_beliefs=True)
        errors = F.cross_entropy(logits.reshape(-1, 11), y.reshape(-1), reduction="none").view(3, 7).mean(0)
    model.train_step(x, y, torch.optim.SGD(model.parameters(), lr=0.0))
    for layer, (μ_q, σ_q) in enumerate(beliefs):
        expected, _ = p_flow(before[f"position_priors.{layer}.mu"][:7], None, μ_q, σ_q, errors, model.config)
        assert_close(f"layer {layer} μ_p", model.position_priors[layer].mu.detach()[:7], expected, 1e-12)
        assert torch.equal(model.position_priors[layer].mu.detach()[7:], before[f"position_priors.{layer}.mu"][7:])
        grad = model.position_priors[layer].mu.grad
        assert grad is not None and grad[:7].abs().sum() > 0, f"no gradient reached layer {layer}'s priors"
    bank = TokenPriorBank(11, 5).double()
    bank.mu.data.copy_(before["token_priors.mu"])
    update_token_priors(bank, beliefs[-1][0], y, 0.05)
    assert_close("token priors", model.token_priors.mu.detach(), bank.mu.detach(), 1e-12)


def test_train_step_reduces_loss_on_a_repeated_batch():
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-2)
    ids = torch.randint(0, 11, (4, 10))
    losses = [model.train_step(ids[:, :-1], ids[:, 1:], optimizer).item() for _ in range(15)]
    assert losses[-1] < 0.6 * losses[0], losses


def test_bad_inputs_raise_clear_errors():
    model = _model()
    with pytest.raises(ValueError, match=r"input_ids must be \(batch, seq_len\), got shape \(5,\)"):
        model(torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="seq_len 13 > max_seq_len 12"):
        model(torch.zeros(1, 13, dtype=torch.long))
    with pytest.raises(ValueError, match=r"ids in \[0, 11\), got values in \[11, 11\]"):
        model(torch.full((1, 4), 11, dtype=torch.long))
    with pytest.raises(ValueError, match=r"target_ids must have input_ids' shape \(1, 4\), got \(1, 3\)"):
        model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="input_ids must be an int64 tensor"):
        model(torch.zeros(1, 4))

    config = model.config
    μ, σ = torch.randn(1, 4, 5), torch.rand(1, 4, 5) + 0.1
    μ_p, σ_p = torch.randn(4, 5), torch.rand(4, 5) + 0.1
    bad_σ = σ.clone()
    bad_σ[0, 1, 2] = -0.5
    with pytest.raises(ValueError, match=r"σ_q must be > 0 everywhere .*got min -0.5"):
        q_flow(μ, bad_σ, μ_p, σ_p, None, model.token_priors, None, config)
    with pytest.raises(ValueError, match=r"σ_p must be > 0 everywhere .*got min 0"):
        compute_vfe(μ, σ, μ_p, torch.zeros_like(σ_p), None, model.token_priors, None, config)
    with pytest.raises(ValueError, match=r"σ_q must have μ_q's shape \(1, 4, 5\), got \(1, 4, 4\)"):
        q_flow(μ, σ[..., :4], μ_p, σ_p, None, model.token_priors, None, config)
    with pytest.raises(ValueError, match=r"μ_p must be \(seq_len, embed_dim\) = \(4, 5\)"):
        q_flow(μ, σ, μ_p[:3], σ_p, None, model.token_priors, None, config)

    with pytest.raises(ValueError, match="PureFEPConfig.kappa must be > 0, got 0.0"):
        PureFEPConfig(kappa=0.0)
    with pytest.raises(ValueError, match=r"q_flow_gradient must be one of \['joint', 'agent'\], got 'mean'"):
        PureFEPConfig(q_flow_gradient="mean")
    with pytest.raises(ValueError, match="PureFEPConfig.embed_dim must be a positive int, got 0"):
        PureFEPConfig(embed_dim=0)


def test_evaluation_without_targets_drops_the_observation_term():
    """Targets change the Q-flow only through the observation term: without targets
    (or with observation_in_q_flow=False) the beliefs are the same."""
    ids = torch.randint(0, 11, (2, 6))
    model = _model().double()
    with torch.no_grad():
        logits_eval, loss_eval = model(ids)
        logits_obs, _ = model(ids, ids)
        model.config.observation_in_q_flow = False
        logits_no_obs, _ = model(ids, ids)
    assert loss_eval is None
    assert torch.equal(logits_eval, logits_no_obs)
    assert (logits_eval - logits_obs).abs().max() > 1e-6


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("q_flow_gradient,mask_diagonal", [("joint", False), ("agent", True)])
def test_hecate_compiled_model_equals_eager(q_flow_gradient, mask_diagonal):
    """The model through backend="hecate" (fallback eager: Hecate's fused ops, the
    rest as ATen) gives eager's loss, logits and prior gradients (float32, 1e-4)."""
    model = _model(q_flow_gradient=q_flow_gradient, mask_diagonal=mask_diagonal)
    ids = torch.randint(0, 11, (2, 8))
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    logits, loss = model(x, y)
    loss.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    compiled = torch.compile(model, backend="hecate", options={"fallback": "eager"})
    c_logits, c_loss = compiled(x, y)
    c_loss.backward()
    assert_close("loss", c_loss, loss, 1e-4)
    assert_close("logits", c_logits, logits, 1e-4)
    for name, p in model.named_parameters():
        assert_close(f"∂loss/∂{name}", p.grad, expected[name], 1e-4)
