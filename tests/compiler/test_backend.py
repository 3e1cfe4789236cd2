"""The backend end to end, independent of any one pattern."""

import copy
import subprocess
import sys
import textwrap

import pytest
import torch

import hecate
from hecate.models.short_conv import KeyQueryPreprocess
from hecate.testing import assert_close


def test_entry_point_works_without_importing_hecate():
    code = textwrap.dedent("""
        import sys, torch
        f = torch.compile(lambda x: torch.sin(x) * 2, backend="hecate", options={"fallback": "eager"})
        x = torch.linspace(-1, 1, 7)
        assert torch.allclose(f(x), torch.sin(x) * 2)
        assert "hecate" in torch._dynamo.list_backends()
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


def test_importing_hecate_registers_the_backend_where_no_entry_point_does():
    """Run from a checkout without installing (PYTHONPATH=., as on a lent GPU machine): no entry point, yet
    backend="hecate" works once hecate is imported."""
    code = textwrap.dedent("""
        import importlib.metadata as md
        real = md.entry_points
        md.entry_points = lambda **kw: [] if kw.get("group") == "torch_dynamo_backends" else real(**kw)
        import torch
        import hecate
        md.entry_points = real
        from torch._dynamo.backends.registry import _COMPILER_FNS
        assert _COMPILER_FNS["hecate"] is hecate.hecate_backend
        f = torch.compile(lambda x: torch.sin(x) * 2, backend="hecate", options={"fallback": "eager"})
        x = torch.linspace(-1, 1, 7)
        assert torch.allclose(f(x), torch.sin(x) * 2)
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


def test_fused_op_kept_by_inductor_compiles(fresh_dynamo):
    """Where qk_preprocess's Inductor decomposition declines (CUDA; here the interpreter's triton_on_cpu), Inductor
    lowers the op itself: it must have a fallback to call (it failed 'both a fallback and a decomp for same op')."""
    from hecate.lowering.dispatch import triton_on_cpu

    torch.manual_seed(0)
    model = KeyQueryPreprocess(d_model=12, d_key=8, n_heads=2, phi="elu1")
    x = torch.randn(2, 9, 12)
    with triton_on_cpu():
        q, k = torch.compile(copy.deepcopy(model), backend="hecate")(x)
    assert hecate.last_report().count("qk_preprocess") == 2, str(hecate.last_report())
    q_ref, k_ref = model(x)
    assert_close("q", q, q_ref, 1e-5)
    assert_close("k", k, k_ref, 1e-5)


def test_first_torch_distributions_kl_in_a_fresh_process_is_one_graph_and_fused():
    """kl_divergence's first dispatch of a pair graph-breaks in Dynamo; the backend resolves the
    Gaussian pairs when it is looked up, so a user's very first call compiles in one graph."""
    code = textwrap.dedent("""
        import torch
        from torch.distributions import Normal, kl_divergence

        def attention(mu, std, v):
            kl = kl_divergence(Normal(mu[:, :, None], std[:, :, None]), Normal(mu[:, None], std[:, None])).sum(-1)
            return torch.softmax(-kl, -1) @ v

        f = torch.compile(attention, backend="hecate", options={"fallback": "eager", "strict": True})
        mu, std, v = torch.randn(2, 5, 3), torch.rand(2, 5, 3) + 0.5, torch.randn(2, 5, 4)
        y, y_ref = f(mu, std, v), attention(mu, std, v)
        import hecate
        report = hecate.last_report()
        assert report.graphs == 1 and report.count("kl_attention") == 1, str(report)
        assert ((y - y_ref).norm() / y_ref.norm()).item() < 1e-5
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


def test_dynamo_restart_from_the_fallback_compile_is_passed_on(monkeypatch):
    """Inductor may ask Dynamo to trace again (a float it tensorifies): that request must reach
    Dynamo, not be taken for a failure that drops the fusions."""
    from hecate.compiler import backend
    from hecate.passes.report import FusionReport

    gm = torch.fx.symbolic_trace(lambda x: torch.sin(x) * 2)
    monkeypatch.setattr(backend, "fuse_or_original", lambda g, inputs, opts: (copy.deepcopy(g), FusionReport()))

    calls = []

    def restart(g, inputs, opts, mode_config):  # asks once; compiling the unfused graph instead would succeed
        calls.append(g)
        if len(calls) == 1:
            raise torch._dynamo.exc.TensorifyScalarRestartAnalysis()
        return g.forward

    monkeypatch.setattr(backend, "_compile_rest", restart)
    with pytest.raises(torch._dynamo.exc.RestartAnalysis):
        backend.hecate_backend(gm, [torch.randn(3)], {"strict": False})
    assert len(calls) == 1


@pytest.mark.parametrize("mode", ["max-autotune-no-cudagraphs", "reduce-overhead"])
def test_torch_compile_mode_reaches_inductor_and_still_fuses(mode, fresh_dynamo, monkeypatch):
    from torch._inductor import compile_fx as inductor

    patches = []
    real = inductor.compile_fx
    monkeypatch.setattr(inductor, "compile_fx", lambda *a, **kw: patches.append(kw.get("config_patches")) or real(*a, **kw))
    model = KeyQueryPreprocess(8, kernel_size=3)
    x = torch.randn(2, 5, 8)
    got = torch.compile(model, backend="hecate", mode=mode)(x)
    assert hecate.last_report().count("qk_preprocess") == 2, str(hecate.last_report())  # keys and queries
    # the outer call (Inductor recurses): the mode's settings, beside Hecate's own for a graph with its ops
    assert patches and patches[0].items() >= torch._inductor.list_mode_options(mode).items(), patches
    for g, r in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(model(x))):
        assert_close("output", g, r, 1e-5)


def test_unknown_torch_compile_mode_is_an_error_naming_it(fresh_dynamo):
    with pytest.raises(Exception, match="bogus"):
        torch.compile(torch.nn.Linear(3, 3), backend="hecate", mode="bogus")(torch.randn(2, 3))


@pytest.mark.parametrize("fallback", ["eager", "inductor"])
def test_unmatched_graph_is_compiled_by_fallback_and_trains(fallback, fresh_dynamo):
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    x = torch.randn(4, 5)
    compiled = torch.compile(model, backend="hecate", options={"fallback": fallback})
    loss = compiled(x).square().sum()
    loss.backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ref = model(x).square().sum()
    ref.backward()
    assert torch.allclose(loss, ref, rtol=1e-5, atol=1e-6)
    for g, p in zip(got, model.parameters()):
        assert torch.allclose(g, p.grad, rtol=1e-5, atol=1e-6)
    assert hecate.last_report().graphs == 1


def test_torch_transformer_layer_compiles_through_inductor_without_a_miss(fresh_dynamo):
    """nn.MultiheadAttention views heads of a transposed, .contiguous() copy: the normal form keeps that copy."""
    from hecate.testing import assert_close

    torch.manual_seed(0)
    model = torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, dropout=0.0)
    x = torch.randn(2, 7, 16)
    compiled = torch.compile(model, backend="hecate", options={"fallback": "inductor", "strict": True})
    got = compiled(x)
    assert hecate.last_report().misses == [], str(hecate.last_report())
    assert_close("output", got, model(x), 1e-5)


def test_dump_dir_holds_graph_before_and_after_each_pass(tmp_path, fresh_dynamo):
    f = torch.compile(lambda x: torch.relu(x) + 1, backend="hecate",
                      options={"fallback": "eager", "dump_dir": str(tmp_path)})
    f(torch.randn(3))
    names = sorted(p.name for p in tmp_path.iterdir())
    assert any(n.endswith(".0_before.txt") for n in names)
    from hecate.passes import PASSES
    for name in PASSES:
        assert any(n.endswith(f"_after_{name}.txt") for n in names), (name, names)
    before = next(p for p in tmp_path.iterdir() if p.name.endswith(".0_before.txt")).read_text()
    assert "torch.ops.aten.relu.default" in before


def test_explain_does_not_need_fusions_and_counts_graphs():
    report = hecate.explain(lambda x: x.cos() + 1, torch.randn(4))
    assert report.graphs == 1
    assert report.fusions == [] and report.misses == []


def test_explain_rejects_non_callable():
    with pytest.raises(TypeError, match="needs a model or function"):
        hecate.explain(3, torch.randn(2))
