"""The Pure FEP transformer's validation phases that are tests: 1.5 (Q-flow gradients by
finite differences) and 2.4 (memorising a sequence).

Phase 1.5 checks the analytic gradients of §4.1/§4.2 (as completed in hecate/models/fep.py)
against central finite differences of the free energy itself, in float64 — a reference that
shares nothing with the analytic code nor with autograd (test_fep.py checks autograd).
"""

import pytest
import torch

from hecate.models.fep import (
    PureFEPConfig, PureFEPTransformer, TokenPriorBank, attention_mask, compute_attention,
    compute_mu_gradient, compute_sigma_gradient, kl_pairwise, kl_self_coupling, observation_likelihood)
from hecate.testing import assert_close

FD_STEP = 1e-6  # central differences in float64: truncation ~h², rounding ~1e-16/h
FD_TOL = 1e-7   # relative error of the analytic gradient against them


def _pair_kl(μ_i, v_i, μ_j, v_j):
    """KL(N(μ_i, v_i) ‖ N(μ_j, v_j)) for every pair (i, j), summed over K: (B, N, N)."""
    μ_i, v_i, μ_j, v_j = μ_i.unsqueeze(2), v_i.unsqueeze(2), μ_j.unsqueeze(1), v_j.unsqueeze(1)
    return 0.5 * (torch.log(v_j / v_i) + v_i / v_j + (μ_i - μ_j).square() / v_j - 1.0).sum(-1)


def _free_energy(μ, σ, priors, fixed, mask, bank, targets, config):
    """F summed over rows. ``fixed=None``: the joint F (every slot moves with (μ, σ)); otherwise
    ``fixed = (μ0, σ0)`` holds the second slot of every pairwise KL (q_j) at those values, so F
    is Σ_i F_i with F_i depending on q_i alone: its gradient is the "agent" gradient."""
    eps = config.eps
    var = σ.square() + eps
    μ_j, var_j = (μ, var) if fixed is None else (fixed[0], fixed[1].square() + eps)
    kl = _pair_kl(μ, var, μ_j, var_j)
    β = compute_attention(kl, config.kappa, mask)
    F = config.alpha * kl_self_coupling(μ, σ, *priors, eps).sum()
    F = F + config.lambda_beta * (β * kl).sum()
    if targets is not None:
        F = F + observation_likelihood(μ, σ, bank, targets, config.tau, eps).sum()
    return F


def _central_differences(f, x):
    grad = torch.empty_like(x)
    flat, g = x.view(-1), grad.view(-1)
    for n in range(flat.numel()):
        saved = flat[n].item()
        flat[n] = saved + FD_STEP
        up = f()
        flat[n] = saved - FD_STEP
        down = f()
        flat[n] = saved
        g[n] = (up - down) / (2 * FD_STEP)
    return grad


@pytest.mark.parametrize("causal,mask_diagonal", [(True, False), (False, False), (True, True)],
                         ids=["causal", "full", "causal_maskdiag"])
@pytest.mark.parametrize("q_flow_gradient", ["joint", "agent"])
def test_q_flow_gradients_match_central_finite_differences(q_flow_gradient, causal, mask_diagonal):
    B, N, K, V = 1, 4, 3, 5
    g = torch.Generator().manual_seed(3)
    dt = torch.float64
    μ = torch.randn(B, N, K, generator=g, dtype=dt)
    σ = 0.5 + torch.rand(B, N, K, generator=g, dtype=dt)
    μ_p, σ_p = torch.randn(N, K, generator=g, dtype=dt), 0.5 + torch.rand(N, K, generator=g, dtype=dt)
    bank = TokenPriorBank(V, K).to(dt)
    with torch.no_grad():
        bank.mu.copy_(torch.randn(V, K, generator=g, dtype=dt))
        bank.log_sigma.uniform_(-0.5, 0.5, generator=g)
    targets = torch.randint(0, V, (B, N), generator=g)
    config = PureFEPConfig(vocab_size=V, embed_dim=K, max_seq_len=N, alpha=0.3, lambda_beta=1.3, kappa=0.7,
                           tau=0.9, causal=causal, mask_diagonal=mask_diagonal, q_flow_gradient=q_flow_gradient)
    mask = attention_mask(N, causal, mask_diagonal)
    fixed = None if q_flow_gradient == "joint" else (μ.clone(), σ.clone())

    with torch.no_grad():
        kl = kl_pairwise(μ, σ, config.eps)
        β = compute_attention(kl, config.kappa, mask)
        grad_μ = compute_mu_gradient(μ, σ, μ_p, σ_p, β, kl, bank, targets, config)
        grad_σ = compute_sigma_gradient(μ, σ, μ_p, σ_p, β, kl, bank, targets, config)
        energy = lambda: _free_energy(μ, σ, (μ_p, σ_p), fixed, mask, bank, targets, config).item()  # noqa: E731
        fd_μ = _central_differences(energy, μ)
        fd_σ = _central_differences(energy, σ)
    assert_close(f"{q_flow_gradient} ∂F/∂μ vs finite differences", grad_μ, fd_μ, FD_TOL)
    assert_close(f"{q_flow_gradient} ∂F/∂σ vs finite differences", grad_σ, fd_σ, FD_TOL)


MEMORISE_STEPS = 60
MEMORISE_LOSS = 0.01  # nats per token, from ln V ≈ 2.8 at the start


@pytest.mark.parametrize("options", [dict(), dict(q_flow_gradient="agent", observation_in_q_flow=False)],
                         ids=["spec_defaults", "causal_safe"])
def test_memorises_one_sequence(options):
    """Phase 2.4: trained on one random sequence of 16 tokens (V = 16), the model drives its
    cross-entropy below MEMORISE_LOSS nats per token within MEMORISE_STEPS train_steps and then
    predicts every next token of it; the free energy's own training (backprop + P-flow) does it."""
    V, N = 16, 16
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(0, V, (1, N + 1), generator=g)
    x, y = seq[:, :-1], seq[:, 1:]
    config = PureFEPConfig(vocab_size=V, embed_dim=16, n_layers=1, max_seq_len=N, n_vfe_steps=2, **options)
    model = PureFEPTransformer(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    first = model.train_step(x, y, optimizer).item()
    for _ in range(MEMORISE_STEPS - 1):
        last = model.train_step(x, y, optimizer).item()
    assert first > 2.0, f"the first loss {first:.3f} should be near ln V = {torch.log(torch.tensor(V)):.2f}"
    assert last < MEMORISE_LOSS, f"loss {last:.4f} after {MEMORISE_STEPS} steps, expected < {MEMORISE_LOSS}"
    with torch.no_grad():
        logits, _ = model(x)  # no targets: Q-flow without the observation term, as in generation
    assert torch.equal(logits.argmax(-1), y), "the memorised sequence is not reproduced token by token"


def test_forward_records_attention_per_layer_and_q_flow_step():
    """Phase 4.3's inspection hook: one β per layer and Q-flow step, each a causal row-stochastic
    map, and the recorded last step is the β the layer's Q-flow used last."""
    config = PureFEPConfig(vocab_size=11, embed_dim=4, n_layers=2, max_seq_len=9, n_vfe_steps=3)
    model = PureFEPTransformer(config)
    ids = torch.randint(0, 11, (2, 7))
    attention = []
    with torch.no_grad():
        logits, _ = model(ids, attention=attention)
        plain, _ = model(ids)
    assert torch.equal(logits, plain), "recording attention changed the output"
    assert [len(layer) for layer in attention] == [3, 3]
    for layer in attention:
        for β in layer:
            assert β.shape == (2, 7, 7)
            assert torch.allclose(β.sum(-1), torch.ones(2, 7))
            assert torch.all(β.triu(1) == 0), "β attends to the future under the causal mask"
    assert not torch.equal(attention[0][0], attention[0][2]), "β does not change across Q-flow steps"


def test_sweep_and_attention_examples_run_quick(tmp_path):
    """examples/fep_sweep.py --quick and examples/fep_attention.py on its weights, end to end."""
    import importlib.util
    import json
    import os
    import sys

    examples = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")
    sys.path.insert(0, examples)
    try:
        def load(name):
            spec = importlib.util.spec_from_file_location(name, os.path.join(examples, f"{name}.py"))
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module

        results = load("fep_sweep").main(["--quick", "--out", str(tmp_path)])
        load("fep_attention").main(["--weights", str(tmp_path / "fep_sweep_best.pt"), "--text", "The end.",
                                    "--out", str(tmp_path)])
    finally:
        sys.path.remove(examples)
    torch._dynamo.reset()
    saved = json.loads((tmp_path / "fep_sweep.json").read_text())
    assert saved["criteria"] == results["criteria"] and saved["best"] in saved["sweep"]
    assert saved["criteria"]["ratio_same_steps"] == saved["fep"]["heldout_bpc"] / saved["baseline"]["heldout_bpc"]
    attention = json.loads((tmp_path / "fep_attention.json").read_text())
    assert len(attention["entropy"]) == saved["fep"]["config"]["n_layers"]
    assert all(0 <= h <= attention["uniform_causal_entropy"] + 1e-6 for row in attention["entropy"] for h in row)
    assert (tmp_path / "fep_sweep.png").stat().st_size > 10_000 and (tmp_path / "fep_attention.png").stat().st_size > 10_000
