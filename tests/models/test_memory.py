"""The memory models themselves (eager): forms agree, equations hold, bad inputs are refused."""

from __future__ import annotations

import pytest
import torch

from hecate.models.memory import HebbianMemory, LpMemory
from hecate.testing import assert_close


def test_p2_without_retention_is_the_classic_delta_rule():
    # p = 2, α = 0: M ← M − η·2(Mk − v)kᵀ = M + β(v − Mk)kᵀ with β = 2η
    model = LpMemory(4, n_heads=2, d_k=3, d_v=5, p=2.0, alpha=0.0, eta=0.1)
    M = torch.randn(2, 2, 5, 3, dtype=torch.float64)
    k, q = torch.randn(2, 2, 3, dtype=torch.float64), torch.randn(2, 2, 3, dtype=torch.float64)
    v = torch.randn(2, 2, 5, dtype=torch.float64)
    (new,), y = model.step((M,), k, v, q, torch.zeros(2, 2, dtype=torch.float64),
                           torch.full((2, 2), 0.1, dtype=torch.float64))
    beta = 0.2
    expected = M + beta * torch.einsum("bhv,bhk->bhvk", v - torch.einsum("bhvk,bhk->bhv", M, k), k)
    assert_close("delta rule M", new, expected, 1e-12)
    assert_close("read after update", y, torch.einsum("bhvk,bhk->bhv", expected, q), 1e-12)


def test_gradient_phi_is_hope_eq51_momentum():
    # Eq 51 with P = I: m ← β m − η φ_g(∇), W ← (1 − α) W + m; ∇ = g φ(k)ᵀ, here g = 2e (p = 2)
    model = LpMemory(4, n_heads=2, d_k=3, d_v=5, p=2.0, alpha=0.1, eta=0.3, momentum=0.5, gradient_phi="elu1")
    f64 = dict(dtype=torch.float64)
    M, S = torch.randn(2, 2, 5, 3, **f64), torch.randn(2, 2, 5, 3, **f64)
    k, v, q = torch.randn(2, 2, 3, **f64), torch.randn(2, 2, 5, **f64), torch.randn(2, 2, 3, **f64)
    (new_M, new_S), y = model.step((M, S), k, v, q, torch.full((2, 2), 0.1, **f64), torch.full((2, 2), 0.3, **f64))
    grad = torch.einsum("bhv,bhk->bhvk", 2 * (torch.einsum("bhvk,bhk->bhv", M, k) - v), k)
    expected_S = 0.5 * S - 0.3 * (torch.nn.functional.elu(grad) + 1)
    assert_close("momentum m", new_S, expected_S, 1e-12)
    assert_close("memory W", new_M, 0.9 * M + expected_S, 1e-12)
    assert_close("read", y, torch.einsum("bhvk,bhk->bhv", new_M, q), 1e-12)


@pytest.mark.parametrize("p", [1.0, 2.0, 2.5])
def test_bias_gradient_is_the_lp_gradient_away_from_zero(p):
    # p·sign(e)|e|^(p−1) (MIRAS Eq 11); the tanh/eps approximators are exact to ~1e-4 at |e| >= 0.5
    model = LpMemory(4, p=p)
    e = torch.tensor([-2.0, -0.5, 0.7, 1.5], dtype=torch.float64)
    exact = torch.sign(e) * e.abs() ** (p - 1) * (p if p != 1.0 else 1.0)
    assert_close(f"l_{p} gradient", model.bias_gradient(e), exact, 1e-4)


@pytest.mark.parametrize("kwargs", [dict(p=2.5, alpha=None, eta=None), dict(p=3.0, q_norm=4.0),
                                    dict(p=1.0, momentum=0.5)], ids=["lp-gated", "moneta", "momentum"])
def test_scan_form_equals_loop_form(kwargs, fresh_dynamo):
    loop = LpMemory(10, n_heads=2, d_k=3, d_v=4, **kwargs)
    scan = LpMemory(10, n_heads=2, d_k=3, d_v=4, use_scan=True, **kwargs)
    scan.load_state_dict(loop.state_dict())
    x, m0 = torch.randn(2, 5, 10), 0.1 * torch.randn(2, 2, 4, 3)
    (y1, m1), (y2, m2) = loop(x, m0), scan(x, m0)
    assert_close("y", y2, y1, 1e-6)
    assert_close("m_final", m2, m1, 1e-6)


@pytest.mark.parametrize("normalise", [False, True])
def test_hebbian_cumsum_and_scan_equal_loop(normalise, fresh_dynamo):
    loop = HebbianMemory(10, n_heads=2, d_k=3, d_v=4, alpha=1.0, normalise=normalise)
    cumsum = HebbianMemory(10, n_heads=2, d_k=3, d_v=4, alpha=1.0, normalise=normalise, form="cumsum")
    scan = HebbianMemory(10, n_heads=2, d_k=3, d_v=4, alpha=1.0, normalise=normalise, use_scan=True)
    cumsum.load_state_dict(loop.state_dict())
    scan.load_state_dict(loop.state_dict())
    x = torch.randn(2, 6, 10)
    y, m = loop(x)
    for name, other in (("cumsum", cumsum), ("scan", scan)):
        y2, m2 = other(x)
        assert_close(f"{name} y", y2, y, 1e-5)
        assert_close(f"{name} m_final", m2, m, 1e-5)


@pytest.mark.parametrize("normalise", [False, True])
def test_hebbian_noncausal_is_phi_q_phi_k_t_v(normalise):
    model = HebbianMemory(10, n_heads=1, d_k=3, d_v=4, alpha=1.0, normalise=normalise, form="noncausal")
    x = torch.randn(1, 5, 10)
    y, m = model(x)
    assert m is None
    q, k, v = (t[:, :, 0] for t in model.qkv(x))  # one head: [1, T, d]
    scores = q @ k.transpose(1, 2)  # φ(q_t)·φ(k_s) for all s (no mask)
    expected = scores @ v
    if normalise:
        expected = expected / (scores.sum(-1, keepdim=True) + 1e-6)
    assert_close("non-causal y", y, model.out(expected), 1e-5)


def test_hebbian_gated_loop_is_the_fast_weight_recurrence():
    # HOPE Eq 5: M_t = α_t M_{t−1} + v_t φ(k_t)ᵀ,  y_t = M_t φ(q_t)
    model = HebbianMemory(6, n_heads=1, d_k=2, d_v=3, alpha=None)
    x = torch.randn(1, 4, 6, dtype=torch.float64)
    model.double()
    y, m = model(x)
    q, k, v = (t[0, :, 0] for t in model.qkv(x))
    alpha = model.gate("alpha", x)[0, :, 0]
    M, ys = torch.zeros(3, 2, dtype=torch.float64), []
    for t in range(4):
        M = alpha[t] * M + torch.outer(v[t], k[t])
        ys.append(M @ q[t])
    assert_close("y", y, model.out(torch.stack(ys)[None]), 1e-12)
    assert_close("m_final", m[0, 0], M, 1e-12)


@pytest.mark.parametrize("make,match", [
    (lambda: LpMemory(4, p=0.5), "p must be a number >= 1"),
    (lambda: LpMemory(4, alpha=1.5), "alpha must be a number in \\[0, 1\\]"),
    (lambda: LpMemory(4, eta=-0.1), "eta must be a number in \\[0, 1\\]"),
    (lambda: LpMemory(4, momentum=1.0), "momentum must be in \\[0, 1\\)"),
    (lambda: LpMemory(4, q_norm=1.0), "q_norm must be >= 2"),
    (lambda: LpMemory(4, momentum=0.5, q_norm=4.0), "choose GD with momentum or MONETA"),
    (lambda: LpMemory(4, phi="tanh"), "phi must be one of"),
    (lambda: LpMemory(4, momentum=0.5, gradient_phi="tanh"), "gradient_phi must be one of"),
    (lambda: LpMemory(4, gradient_phi="elu1"), "gradient_phi='elu1' .* needs momentum > 0"),
    (lambda: HebbianMemory(4, form="chunked"), "form must be one of"),
    (lambda: LpMemory(4, phi="relu", d_phi=6), "phi='relu' fixes its own size, so d_phi must be None"),
    (lambda: HebbianMemory(4, alpha=0.9, form="cumsum"), "needs alpha=1.0, got 0.9"),
])
def test_bad_configuration_is_refused(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_bad_initial_state_shape_is_refused():
    model = LpMemory(4, n_heads=2, d_k=3, d_v=5)
    with pytest.raises(ValueError, match=r"m0 must have shape \[B, H, d_v, d_phi\] = \[1, 2, 5, 3\], got \[1, 2, 3, 5\]"):
        model(torch.randn(1, 3, 4), torch.zeros(1, 2, 3, 5))


# ---------------------------------------------------------------- φ with d_φ ≠ d_k (feature-maps spec, Note 2)

PHIS = [("linear", 5, 5), ("random_fourier", 6, 6), ("poly2", None, 3 + 9), ("mlp", 4, 3), ("performer", 4, 4)]


@pytest.mark.parametrize("phi,d_phi,width", PHIS, ids=[p for p, _, _ in PHIS])
@pytest.mark.parametrize("memory", ["lp", "hebbian"])
def test_every_feature_map_sizes_the_memory_and_the_loop_still_fuses(memory, phi, d_phi, width, fresh_dynamo):
    """M is [d_v, d_φ]; φ(k), φ(q) are inputs of the fused scan; compiled == eager, forward and gradients."""
    import hecate

    if memory == "lp":
        model = LpMemory(7, n_heads=2, d_k=3, d_v=4, p=2.0, alpha=None, eta=None, phi=phi, d_phi=d_phi)
        op = "memory_scan"
    else:
        model = HebbianMemory(7, n_heads=2, d_k=3, d_v=4, alpha=None, phi=phi, d_phi=d_phi)
        op = "linear_attention"
    x = torch.randn(2, 4, 7, requires_grad=True)
    y_ref, m_ref = model(x)
    assert m_ref.shape == (2, 2, 4, width)
    grads_ref = torch.autograd.grad(y_ref.square().sum() + m_ref.sum(), [x, *model.parameters()])
    y, m = torch.compile(model, backend="hecate", options={"fallback": "eager"})(x)
    report = hecate.last_report()
    assert report.count(op) == 1, str(report)
    assert not [miss for miss in report.misses if miss.pattern == op], str(report)
    grads = torch.autograd.grad(y.square().sum() + m.sum(), [x, *model.parameters()])
    assert_close("y", y, y_ref, 1e-5)
    assert_close("m_final", m, m_ref, 1e-5)
    for i, (a, b) in enumerate(zip(grads, grads_ref)):
        assert_close(f"grad {i}", a, b, 1e-5)


@pytest.mark.parametrize("kwargs", [dict(p=2.5, alpha=None, eta=0.05), dict(p=2.0, momentum=0.5, eta=0.05)],
                         ids=["lp-gated", "momentum"])
def test_compiled_memory_under_autocast_matches_eager_autocast(kwargs, fresh_dynamo):
    """KeyQueryPreprocess → memory loop, fused into qk_preprocess → memory_scan, under CPU bf16 autocast: the
    dtypes eager gives (y bf16, the state fp32), values and gradients within bf16 rounding."""
    import hecate

    model = LpMemory(16, n_heads=2, d_k=4, d_v=4, phi="elu1", **kwargs)
    x = 0.5 * torch.randn(2, 6, 16)

    def run(fn):
        with torch.autocast("cpu", torch.bfloat16):
            y, m = fn(x)
        grads = torch.autograd.grad(y.float().square().sum() + m.sum(), list(model.parameters()))
        return y, m, grads

    y_ref, m_ref, grads_ref = run(model)
    y, m, grads = run(torch.compile(model, backend="hecate", options={"fallback": "eager"}))
    report = hecate.last_report()
    assert report.count("qk_preprocess") == 2 and report.count("memory_scan") == 1, str(report)
    assert (y.dtype, m.dtype) == (y_ref.dtype, m_ref.dtype) == (torch.bfloat16, torch.float32)
    assert_close("y", y, y_ref, 2e-2)
    assert_close("m_final", m, m_ref, 2e-2)
    for (name, _), g, g_ref in zip(model.named_parameters(), grads, grads_ref):
        assert_close(f"grad {name}", g, g_ref, 3e-2)


@pytest.mark.parametrize("kwargs", [dict(p=2.5, alpha=None, eta=0.05, phi="elu1"),
                                    dict(p=2.0, momentum=0.5, eta=0.05, phi="relu")], ids=["lp-gated", "momentum"])
def test_chunks_carrying_the_state_equal_the_whole_sequence(kwargs):
    """forward_chunk carries the convs' left context, the memory and the momentum buffer: chunk by chunk equals
    forward on the whole sequence (the final M too)."""
    model = LpMemory(10, n_heads=2, d_k=3, d_v=4, **kwargs).double()
    x = 0.5 * torch.randn(2, 9, 10, dtype=torch.float64)
    out, m = model(x)
    state, outs = None, []
    for start, stop in ((0, 2), (2, 6), (6, 9)):
        out_c, state = model.forward_chunk(x[:, start:stop], state)
        outs.append(out_c)
    assert_close("out", torch.cat(outs, 1), out, 1e-12)
    assert_close("m_final", state[1], m, 1e-12)
    assert (state[2] is None) == (model.momentum == 0)


@pytest.mark.parametrize("name", ["lp_memory", "hebbian_memory"])
def test_examples_stay_finite_over_a_long_sequence(name):
    """``hecate explain`` and the GPU check run these examples: their memory must not diverge (the p = 3 example
    did, to NaN within 5 tokens, while η's gate started near 0.5)."""
    from hecate.models import EXAMPLES

    model, (x,) = EXAMPLES[name]()
    out, m = model(torch.randn(2, 256, x.shape[-1]))
    assert torch.isfinite(out).all() and torch.isfinite(m).all()
