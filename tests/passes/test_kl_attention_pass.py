"""Pass kl_attention (and kl_decode) on the Pure FEP transformer: fused = eager, 40 fusions, near-misses, export."""

import math

import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F

import hecate
from hecate.models.fep import PureFEPConfig, PureFEPTransformer
from hecate.testing import assert_close


def _model(n=5, **overrides):
    config = dict(vocab_size=9, embed_dim=3, n_layers=1, max_seq_len=8, n_vfe_steps=2)
    config.update(overrides)
    model = PureFEPTransformer(PureFEPConfig(**config))
    ids = torch.randint(0, config["vocab_size"], (2, n + 1))
    return model, ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def _loss_and_grads(fn, model, ids, targets):
    _, loss = fn(ids, targets)
    return loss.detach(), torch.autograd.grad(loss, list(model.parameters()))


def _check_compiled_equals_eager(model, ids, targets, fallback="eager", tol=1e-5):
    compiled = torch.compile(model, backend="hecate", options={"fallback": fallback})
    loss, grads = _loss_and_grads(compiled, model, ids, targets)
    report = hecate.last_report()
    ref_loss, ref_grads = _loss_and_grads(model, model, ids, targets)
    assert_close("loss", loss, ref_loss, tol)
    for (name, _), g, r in zip(model.named_parameters(), grads, ref_grads):
        assert_close(f"d {name}", g, r, tol)
    return report


@pytest.mark.parametrize("overrides", [
    {},                                                     # the spec: causal, joint gradient, observation in Q-flow
    {"mask_diagonal": True},
    {"causal": False, "kappa": 0.5},
    {"q_flow_gradient": "agent", "observation_in_q_flow": False},
], ids=["spec", "mask_diagonal", "full_attention", "agent_gradient"])
def test_compiled_model_equals_eager(overrides, fresh_dynamo):
    model, ids, targets = _model(**overrides)
    report = _check_compiled_equals_eager(model, ids, targets)
    assert report.count("kl_attention") == 2, str(report)  # 1 layer × 2 Q-flow steps
    assert report.count("kl_decode") >= 1, str(report)
    assert not [m for m in report.misses if m.pattern == "kl_attention"], str(report)


def test_single_position_with_masked_diagonal(fresh_dynamo):
    """N = 1 and the diagonal masked: no key at all; the model's β = 0, the op's sums are 0."""
    model, ids, targets = _model(n=1, mask_diagonal=True)
    report = _check_compiled_equals_eager(model, ids, targets)
    assert report.count("kl_attention") == 2


@pytest.mark.slow
def test_compiled_with_inductor_equals_eager(fresh_dynamo):
    model, ids, targets = _model(n_vfe_steps=1, observation_in_q_flow=False)
    report = _check_compiled_equals_eager(model, ids, targets, fallback="inductor", tol=1e-4)
    assert report.count("kl_attention") == 1


def test_explain_shows_forty_fused_q_flow_steps():
    """4 layers × 10 Q-flow steps unrolled: 40 fused attentions (no targets: a smaller graph to trace)."""
    model, ids, _ = _model(n=3, vocab_size=5, embed_dim=2, n_layers=4, n_vfe_steps=10)
    report = hecate.explain(model, ids)
    assert report.count("kl_attention") == 40, str(report)
    assert not [m for m in report.misses if m.pattern == "kl_attention"]


# near-misses: reported with the reason, left unfused, still correct


def _kl(mu, var):
    mu_i, mu_j, var_i, var_j = mu.unsqueeze(2), mu.unsqueeze(1), var.unsqueeze(2), var.unsqueeze(1)
    return (0.5 * (torch.log(var_j / var_i) + var_i / var_j + (mu_i - mu_j).square() / var_j - 1.0)).sum(dim=-1)


def _direct_gradient(beta, mu, var):
    return (beta.unsqueeze(-1) * (mu.unsqueeze(2) - mu.unsqueeze(1)) / var.unsqueeze(1)).sum(dim=2)


def _softmax_over_queries(mu, var):
    mask = torch.tril(torch.ones(mu.shape[1], mu.shape[1], dtype=torch.bool))
    beta = F.softmax((-_kl(mu, var) / 1.0).masked_fill(~mask, float("-inf")), dim=1)
    return _direct_gradient(beta, mu, var)


def _upper_triangular_mask(mu, var):
    mask = torch.triu(torch.ones(mu.shape[1], mu.shape[1], dtype=torch.bool))
    beta = F.softmax((-_kl(mu, var) / 1.0).masked_fill(~mask, float("-inf")), dim=-1)
    return _direct_gradient(beta, mu, var)


def _beta_returned(mu, var):
    mask = torch.tril(torch.ones(mu.shape[1], mu.shape[1], dtype=torch.bool))
    beta = F.softmax((-_kl(mu, var) / 1.0).masked_fill(~mask, float("-inf")), dim=-1)
    return _direct_gradient(beta, mu, var), beta


def _not_separable(mu, var):
    mask = torch.tril(torch.ones(mu.shape[1], mu.shape[1], dtype=torch.bool))
    beta = F.softmax((-_kl(mu, var) / 1.0).masked_fill(~mask, float("-inf")), dim=-1)
    return (beta.unsqueeze(-1) * torch.exp(mu.unsqueeze(2) * mu.unsqueeze(1))).sum(dim=2)


def _fused(mu, var):
    mask = torch.tril(torch.ones(mu.shape[1], mu.shape[1], dtype=torch.bool))
    beta = F.softmax((-_kl(mu, var) / 2.0).masked_fill(~mask, float("-inf")), dim=-1)
    return _direct_gradient(beta, mu, var)


@pytest.mark.parametrize("fn,reason", [
    (_softmax_over_queries, "over the queries (dim −2), for each key"),
    (_not_separable, "exp of shape [2, 4, 4, 3] is neither per-query nor per-key"),
])
def test_near_misses_are_reported_and_left_unfused(fn, reason, fresh_dynamo):
    mu, var = torch.randn(2, 4, 3), torch.rand(2, 4, 3) + 0.5
    report = hecate.explain(fn, mu, var)
    assert report.count("kl_attention") == 0
    assert any(m.pattern == "kl_attention" and reason in m.reason for m in report.misses), str(report)
    compiled = torch.compile(fn, backend="hecate", options={"fallback": "eager"})
    for got, ref in zip(torch.utils._pytree.tree_leaves(compiled(mu, var)), torch.utils._pytree.tree_leaves(fn(mu, var))):
        assert_close("output", got, ref, 1e-6)


def test_a_mask_of_none_of_the_kernels_patterns_is_read_at_run_time(fresh_dynamo):
    """An anti-causal mask made from sizes is none of the kernels' patterns: the op takes the graph's own mask at
    run time (its matmul form), as it takes one passed in."""
    mu = torch.randn(2, 4, 3, requires_grad=True)
    var = (torch.rand(2, 4, 3) + 0.5).requires_grad_()
    got = torch.compile(_upper_triangular_mask, backend="hecate", options={"fallback": "eager"})(mu, var)
    report = hecate.last_report()
    assert report.count("kl_attention") == 1 and "as the graph makes it" in report.fusions[0].detail, str(report)
    ref = _upper_triangular_mask(mu, var)
    assert_close("output", got, ref, 1e-5)
    for name, a, b in zip(("d mu", "d var"), torch.autograd.grad(got.sum(), [mu, var]),
                          torch.autograd.grad(ref.sum(), [mu, var])):
        assert_close(name, a, b, 1e-5)


def test_returned_beta_is_formed_in_matmul_form_beside_the_op(fresh_dynamo):
    """β returned by the model: the sums still come from the op; β [B, N, N] is formed (no [B, N, N, K])."""
    mu = torch.randn(2, 4, 3, requires_grad=True)
    var = (torch.rand(2, 4, 3) + 0.5).requires_grad_()
    compiled = torch.compile(_beta_returned, backend="hecate", options={"fallback": "eager"})
    got = compiled(mu, var)
    report = hecate.last_report()
    assert report.count("kl_attention") == 1 and "[B, N, N] formed for output" in report.fusions[0].detail
    ref = _beta_returned(mu, var)
    for name, a, b in zip(("gradient", "beta"), got, ref):
        assert_close(name, a, b, 1e-5)
    loss = lambda out: out[0].square().sum() + (out[1] * torch.arange(4.0)).sum()  # noqa: E731
    for a, b in zip(torch.autograd.grad(loss(got), (mu, var)), torch.autograd.grad(loss(ref), (mu, var))):
        assert_close("grad", a, b, 1e-5)


def test_a_handwritten_attention_gradient_is_fused(fresh_dynamo):
    mu = torch.randn(2, 4, 3, requires_grad=True)
    var = (torch.rand(2, 4, 3) + 0.5).requires_grad_()
    compiled = torch.compile(_fused, backend="hecate", options={"fallback": "eager"})
    out = compiled(mu, var)
    assert hecate.last_report().count("kl_attention") == 1
    ref = _fused(mu, var)
    assert_close("output", out, ref, 1e-5)
    g = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad((out * g).sum(), (mu, var)), torch.autograd.grad((ref * g).sum(), (mu, var))):
        assert_close("grad", a, b, 1e-5)


# export of the whole (tiny) model


def test_full_model_to_onnx_runs_in_onnxruntime(tmp_path):
    model, ids, targets = _model(n=4, n_layers=1, n_vfe_steps=2)
    path = tmp_path / "fep.onnx"
    report = hecate.export_onnx(model, (ids, targets), path)
    assert report.count("kl_attention") == 2 and report.count("kl_decode") >= 1
    session = ort.InferenceSession(str(path))
    got = session.run(None, {i.name: a.numpy() for i, a in zip(session.get_inputs(), (ids, targets))})
    logits, loss = model(ids, targets)
    assert_close("logits", torch.from_numpy(got[0]), logits, 1e-4)
    assert_close("loss", torch.from_numpy(got[1]), loss, 1e-4)


@pytest.mark.parametrize("output_type", ["torch", "linalg-on-tensors"])
def test_full_model_to_mlir(output_type):
    model, ids, targets = _model(n=4, n_layers=1, n_vfe_steps=1)
    text = hecate.export_mlir(model, (ids, targets), output_type=output_type)
    assert "hecate" not in text and "torch.operator" not in text
    assert ("linalg" in text) if output_type == "linalg-on-tensors" else ("torch.aten" in text)


# recompilation: new batch sizes and lengths, both fallbacks, dynamic=True


def _causal_attention(mu, var):
    n = mu.shape[1]
    beta = F.softmax((-_kl(mu, var) / 0.5).masked_fill(~torch.tril(torch.ones(n, n, dtype=torch.bool)),
                                                       float("-inf")), dim=-1)
    return beta @ mu, _direct_gradient(beta, mu, var)


@pytest.mark.parametrize("fallback", ["eager", "inductor"])
@pytest.mark.parametrize("dynamic", [None, True])
def test_recompiles_at_new_batch_sizes_and_lengths(fallback, dynamic, fresh_dynamo):
    if fallback == "inductor" and dynamic is None:
        pytest.skip("covered by dynamic=True with Inductor (the slowest combination is enough once)")
    compiled = torch.compile(_causal_attention, backend="hecate", dynamic=dynamic, options={"fallback": fallback})
    for b, n in ((2, 4), (3, 4), (3, 6)):
        mu = torch.randn(b, n, 3, requires_grad=True)
        var = (torch.rand(b, n, 3) + 0.5).requires_grad_()
        got = compiled(mu, var)
        assert hecate.last_report().count("kl_attention") == 1, (b, n, str(hecate.last_report()))
        ref = _causal_attention(mu, var)
        for a, r in zip(got, ref):
            assert_close(f"output b={b} n={n}", a, r, 1e-5)
        loss = lambda out: out[0].sum() + out[1].square().sum()  # noqa: E731
        for a, r in zip(torch.autograd.grad(loss(got), (mu, var)), torch.autograd.grad(loss(ref), (mu, var))):
            assert_close(f"grad b={b} n={n}", a, r, 1e-5)


def _attention_over_root_k(mu, var):
    n, k = mu.shape[1:]
    s = -_kl(mu, var) / math.sqrt(k)  # κ = √K: under dynamic=True a number computed from a size at run time
    return F.softmax(s.masked_fill(~torch.tril(torch.ones(n, n, dtype=torch.bool)), float("-inf")), dim=-1) @ mu


def test_temperature_from_the_feature_size_under_dynamic_shapes(fresh_dynamo):
    """κ = √K with K symbolic is read at run time: one graph serves every K, each with its own κ."""
    compiled = torch.compile(_attention_over_root_k, backend="hecate", dynamic=True)
    for b, n, k in ((2, 5, 3), (3, 7, 8)):
        mu = torch.randn(b, n, k, requires_grad=True)
        var = (torch.rand(b, n, k) + 0.5).requires_grad_()
        got, ref = compiled(mu, var), _attention_over_root_k(mu, var)
        assert hecate.last_report().count("kl_attention") == 1, str(hecate.last_report())
        assert_close(f"output k={k}", got, ref, 1e-5)
        for name, a, r in zip(("mu", "var"), torch.autograd.grad(got.square().sum(), (mu, var)),
                              torch.autograd.grad(ref.square().sum(), (mu, var))):
            assert_close(f"d{name} k={k}", a, r, 1e-5)


class _MultiHeadKLAttention(torch.nn.Module):
    """[B, N, H·K] beliefs split into H heads, causal KL attention per head, heads merged back."""

    def forward(self, mu, logvar):
        b, n, _ = mu.shape
        mu_h, var_h = (x.view(b, n, 2, -1).transpose(1, 2) for x in (mu, logvar.exp()))
        mask = torch.tril(torch.ones(n, n, dtype=torch.bool))
        beta = F.softmax((-_kl_pairs(mu_h, var_h) / 0.5).masked_fill(~mask, float("-inf")), dim=-1)
        return (beta @ mu_h).transpose(1, 2).reshape(b, n, -1)


def _kl_pairs(mu, var):  # [..., N, K] → [..., N, N]
    mu_i, mu_j, var_i, var_j = mu.unsqueeze(-2), mu.unsqueeze(-3), var.unsqueeze(-2), var.unsqueeze(-3)
    return (0.5 * (torch.log(var_j / var_i) + var_i / var_j + (mu_i - mu_j).square() / var_j - 1.0)).sum(dim=-1)


def test_multihead_attention_to_onnx_runs_at_other_batch_sizes_and_lengths(tmp_path):
    """Heads folded into the op's batch: one export, onnxruntime == PyTorch at new B and N (dynamic dims)."""
    model = _MultiHeadKLAttention()
    path = tmp_path / "heads.onnx"
    report = hecate.export_onnx(model, (torch.randn(2, 5, 6), 0.3 * torch.randn(2, 5, 6)), path)
    assert report.count("kl_attention") == 1, str(report)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for b, n in ((1, 3), (3, 7)):
        mu, logvar = torch.randn(b, n, 6), 0.3 * torch.randn(b, n, 6)
        [got] = session.run(None, {i.name: a.numpy() for i, a in zip(session.get_inputs(), (mu, logvar))})
        assert_close(f"output at B={b}, N={n}", torch.from_numpy(got), model(mu, logvar), 1e-5)
