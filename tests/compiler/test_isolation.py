"""A failing pass or pipeline never costs the user the compile: the graph is left as it was,
the report says why, and ``strict`` re-raises."""

import pytest
import torch
from torch import fx

import hecate
from hecate.testing import assert_close, assert_outputs_and_gradients_close
import hecate.compiler.pipeline as pipeline
from hecate.compiler.options import parse_options
from hecate.passes import PASSES
from hecate.passes.report import FusionReport


def _model(x, w):
    h = torch.tanh(x @ w)
    return torch.relu(h) * 2 + h


def _half_then_fail(gm: fx.GraphModule, report: FusionReport) -> None:
    """Rewrites relu to sigmoid, adds a constant and a submodule, records a fusion, then raises."""
    for node in gm.graph.nodes:
        if node.target is torch.ops.aten.relu.default:
            node.target = torch.ops.aten.sigmoid.default
            report.add_fusion("broken", "hecate.nothing", 1)
            gm.register_buffer("_extra", torch.ones(1))
            gm.add_submodule("_extra_module", torch.nn.Identity())
            raise ValueError(f"cannot handle {node.name}")


@pytest.fixture
def broken_pass(monkeypatch):
    monkeypatch.setitem(PASSES, "broken", _half_then_fail)
    monkeypatch.setattr(pipeline, "_warned", set())


@pytest.mark.parametrize("fallback", ["eager", "inductor"])
def test_failing_pass_leaves_compiled_equal_to_eager_and_reports_it(fallback, broken_pass, fresh_dynamo):
    x, w = torch.randn(3, 5), torch.randn(5, 4)
    compiled = torch.compile(_model, backend="hecate",
                             options={"patterns": ["broken"], "fallback": fallback, "strict": False})
    with pytest.warns(UserWarning, match="internal error in pass broken: ValueError: cannot handle relu"):
        got = compiled(x, w)
    ref = _model(x, w)
    assert torch.linalg.norm(got - ref) / torch.linalg.norm(ref) <= 1e-6
    report = hecate.last_report()
    assert report.fusions == []  # the fusion the pass recorded before failing is withdrawn
    [miss] = report.misses
    assert miss.pattern == "broken"
    assert miss.reason.startswith("internal error in pass broken: ValueError: cannot handle relu")
    assert "test_isolation.py" in miss.source and "torch.relu(h)" in miss.source  # the node it was on


def test_strict_reraises_the_pass_error(broken_pass, fresh_dynamo):
    compiled = torch.compile(_model, backend="hecate", options={"patterns": ["broken"], "strict": True})
    with pytest.raises(Exception, match="cannot handle relu"):
        compiled(torch.randn(3, 5), torch.randn(5, 4))


def _nodes(gm: fx.GraphModule) -> list:
    """Each node's name, op, target, arguments (by name) and metadata."""
    by_name = lambda a: fx.node.map_arg(a, lambda n: n.name)  # noqa: E731
    return [(n.name, n.op, n.target, by_name(n.args), by_name(n.kwargs), n.meta.get("stack_trace"),
             sorted(n.meta)) for n in gm.graph.nodes]


def test_graph_is_restored_exactly_after_a_pass_failed_halfway(broken_pass):
    gm = fx.symbolic_trace(_model)
    gm = pipeline.canonicalize(gm, [torch.randn(3, 5), torch.randn(5, 4)])
    before_code = gm.code
    before = _nodes(gm)
    before_attrs, before_modules = set(gm.__dict__), dict(gm._modules)

    report = FusionReport()
    with pytest.warns(UserWarning):
        pipeline.run_passes(gm, parse_options({"patterns": ["broken"], "strict": False}), report)

    assert gm.code == before_code
    assert _nodes(gm) == before
    assert set(gm.__dict__) == before_attrs and dict(gm._modules) == before_modules
    assert not hasattr(gm, "_extra")
    x, w = torch.randn(3, 5), torch.randn(5, 4)
    assert torch.equal(gm(x, w), _model(x, w))


def test_warns_once_per_pass_and_error_kind(broken_pass, fresh_dynamo):
    options = {"patterns": ["broken"], "fallback": "eager", "strict": False}
    with pytest.warns(UserWarning) as first:
        torch.compile(_model, backend="hecate", options=options)(torch.randn(3, 5), torch.randn(5, 4))
    torch._dynamo.reset()
    import warnings
    with warnings.catch_warnings(record=True) as second:
        warnings.simplefilter("always")
        torch.compile(_model, backend="hecate", options=options)(torch.randn(3, 5), torch.randn(5, 4))
    assert len([w for w in first if "internal error" in str(w.message)]) == 1
    assert not [w for w in second if "internal error" in str(w.message)]
    assert hecate.last_report().misses  # reported every time, warned once


def test_failing_pipeline_compiles_dynamos_graph_and_says_why(monkeypatch, fresh_dynamo):
    def retrace_fails(gm, example_inputs):
        raise RuntimeError("re-trace failed")

    monkeypatch.setattr(pipeline, "canonicalize", retrace_fails)
    monkeypatch.setattr(pipeline, "_warned", set())
    x, w = torch.randn(3, 5), torch.randn(5, 4)
    compiled = torch.compile(_model, backend="hecate", options={"fallback": "inductor", "strict": False})
    with pytest.warns(UserWarning, match="internal error in Hecate's pipeline: RuntimeError: re-trace failed"):
        got = compiled(x, w)
    ref = _model(x, w)
    assert torch.linalg.norm(got - ref) / torch.linalg.norm(ref) <= 1e-6
    [miss] = hecate.last_report().misses
    assert "without fusions" in miss.reason

    torch._dynamo.reset()
    strict = torch.compile(_model, backend="hecate", options={"strict": True})
    with pytest.raises(Exception, match="re-trace failed"):
        strict(x, w)


def test_strict_defaults_from_the_environment(monkeypatch):
    monkeypatch.setenv("HECATE_STRICT", "1")
    assert parse_options(None).strict is True
    monkeypatch.setenv("HECATE_STRICT", "0")
    assert parse_options(None).strict is False
    assert parse_options({"strict": True}).strict is True
    monkeypatch.setenv("HECATE_STRICT", "yes")
    with pytest.raises(hecate.HecateOptionsError, match="HECATE_STRICT must be 0 or 1, got 'yes'"):
        parse_options(None)


def batched_outer(a, b):  # torch.vmap in the user's code: functorch levels in Dynamo's graph
    return torch.vmap(torch.outer)(a * 2, b) * 3


def energy_descent(a, b):  # torch.func.grad in the user's code (a gradient step inside the forward)
    energy = lambda x: (torch.softmax(x @ x.mT, -1) * b.sum()).sum()  # noqa: E731
    return a - 0.1 * torch.func.grad(energy)(a)


@pytest.mark.parametrize("fn,line", [(batched_outer, "torch.vmap(torch.outer)"),
                                     (energy_descent, "torch.func.grad(energy)")], ids=["vmap", "func_grad"])
@pytest.mark.parametrize("fallback", ["eager", "inductor"])
def test_graph_the_retrace_cannot_follow_runs_as_captured_and_says_why(fn, line, fallback, fresh_dynamo):
    a, b = torch.randn(2, 3), torch.randn(2, 4)
    # strict too: a limit of the re-trace is reported, not raised
    compiled = torch.compile(fn, backend="hecate", options={"fallback": fallback, "strict": True})
    got, expected = compiled(a, b), fn(a, b)
    assert_close("output", got, expected, 1e-6)
    [miss] = hecate.last_report().misses
    assert "functorch transforms" in miss.reason and "compiled as Dynamo captured it" in miss.reason
    assert "@torch.compiler.disable" in miss.reason, miss.reason
    assert miss.source.startswith("test_isolation.py:") and line in miss.source, miss.source


@torch.compiler.disable
def keys_normalised_one_by_one(k):
    return torch.vmap(lambda x: x / x.norm(dim=-1, keepdim=True))(k)


def hebbian_after_a_vmap(q, k, v, transform_apart):
    k = keys_normalised_one_by_one(k) if transform_apart else torch.vmap(lambda x: x / x.norm(dim=-1, keepdim=True))(k)
    S, ys = q.new_zeros(q.shape[0], v.shape[-1], k.shape[-1]), []
    for t in range(q.shape[1]):
        S = 0.9 * S + v[:, t, :, None] * k[:, t, None, :]
        ys.append((S @ q[:, t, :, None])[..., 0])
    return torch.stack(ys, 1)


@pytest.mark.parametrize("transform_apart", [False, True], ids=["in_the_graph", "through_disable"])
def test_the_advice_for_a_transform_lets_the_rest_fuse(transform_apart, fresh_dynamo):
    """A vmap anywhere in the graph leaves the whole graph unfused (the Hebbian loop after it too); called
    through a function under @torch.compiler.disable, as the reason advises, the loop fuses. Equal to eager
    either way, forward and gradients."""
    args = [torch.randn(2, 5, 3) for _ in range(3)]
    xc, xe = ([a.clone().requires_grad_() for a in args] for _ in range(2))
    got = torch.compile(hebbian_after_a_vmap, backend="hecate", options={"fallback": "eager", "strict": True})(
        *xc, transform_apart)
    report = hecate.last_report()
    assert report.count("linear_attention") == int(transform_apart), str(report)
    assert_outputs_and_gradients_close(got, hebbian_after_a_vmap(*xe, transform_apart), xc, xe, 1e-5)
