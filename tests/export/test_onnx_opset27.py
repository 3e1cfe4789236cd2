"""ONNX opset 27: LinearAttention / CausalConvWithState, their semantics in onnxruntime and Hecate's mapping.

1. The operators' semantics, one-node graphs against a plain PyTorch loop (both the ONNX domain,
   which onnxruntime 1.32 runs as the operator's function, and com.microsoft's native kernel).
2. The mapping: each fused op at p = 2 / Hebbian / short conv takes the operator, the rest keeps its Scan,
   and the export's ``onnx_forms`` says which and why; onnxruntime matches PyTorch within 1e-5 (fp32).
3. State: m0 in, m_final out, and chunked runs in onnxruntime equal one run over the whole sequence.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import hecate
from hecate.lowering.memory_scan.naive import memory_scan_naive
from hecate.lowering.onnx_fused import fused_ops_supported
from hecate.models.memory import HebbianMemory, LpMemory
from hecate.models.short_conv import KeyQueryPreprocess
from hecate.testing import assert_close

_SUPPORTED, _WHY_NOT = fused_ops_supported()
pytestmark = pytest.mark.skipif(not _SUPPORTED, reason=_WHY_NOT or "opset 27 available")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

TOL = 1e-5
DOMAINS = ["", "com.microsoft"]


def _session(model_or_path):
    source = model_or_path.SerializeToString() if hasattr(model_or_path, "SerializeToString") else str(model_or_path)
    return ort.InferenceSession(source, providers=["CPUExecutionProvider"])


def _one_node(op_type, domain, inputs, outputs, **attributes):
    """A one-node model; ``inputs`` / ``outputs``: (name, shape) with "" for an absent optional input."""
    from onnx import TensorProto, helper

    node = helper.make_node(op_type, [n for n, _ in inputs], [n for n, _ in outputs], domain=domain, **attributes)
    graph = helper.make_graph([node], "one_node",
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs if n],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in outputs])
    opsets = [helper.make_opsetid("", 27)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 10
    return _session(model)


# --------------------------------------------------------------------------------------------------
# 1. What the operators compute
# --------------------------------------------------------------------------------------------------

def _linear_attention_loop(rule, q, k, v, S, g=None, beta=None, scale=1.0):
    """q, k [B, T, H, dk], v [B, T, H, dv], S [B, H, dk, dv], g [B, T, H] or [B, T, H, dk], beta [B, T, H]."""
    ys = []
    for t in range(k.shape[1]):
        decay = 1.0 if g is None else (g[:, t].exp()[..., None, None] if g.dim() == 3 else g[:, t].exp()[..., None])
        S = decay * S
        k_t, v_t = k[:, t], v[:, t]
        if rule in ("delta", "gated_delta"):
            v_t = beta[:, t, :, None] * (v_t - torch.einsum("bhkv,bhk->bhv", S, k_t))
        S = S + k_t[..., :, None] * v_t[..., None, :]
        ys.append(scale * torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    return torch.stack(ys, 1), S


@pytest.mark.parametrize("domain", DOMAINS)
@pytest.mark.parametrize("rule,per_key", [("linear", False), ("gated", False), ("gated", True), ("delta", False),
                                          ("gated_delta", False), ("gated_delta", True)])
def test_linear_attention_semantics(domain, rule, per_key):
    B, T, H, dk, dv = 2, 11, 3, 5, 4
    q, k, v = torch.randn(B, T, H, dk), torch.randn(B, T, H, dk) * 0.4, torch.randn(B, T, H, dv)  # keys not unit
    S0 = torch.randn(B, H, dk, dv)
    g = -torch.rand(B, T, H, dk) if per_key else -torch.rand(B, T, H)
    beta = torch.rand(B, T, H)
    gated, delta = rule.startswith("gated"), rule.endswith("delta")
    inputs = [("q", [B, T, H * dk]), ("k", [B, T, H * dk]), ("v", [B, T, H * dv]), ("past", [B, H, dk, dv]),
              ("g" if gated else "", [B, T, g[0, 0].numel()]), ("beta" if delta else "", [B, T, H])]
    while not inputs[-1][0]:
        inputs.pop()
    session = _one_node("LinearAttention", domain, inputs, [("y", [B, T, H * dv]), ("S", [B, H, dk, dv])],
                        update_rule=rule, q_num_heads=H, kv_num_heads=H, scale=1.0)
    feeds = dict(q=q.flatten(2), k=k.flatten(2), v=v.flatten(2), past=S0, g=g.flatten(2), beta=beta)
    y, S = session.run(None, {n: feeds[n].numpy() for n, _ in inputs if n})
    y_ref, S_ref = _linear_attention_loop(rule, q, k, v, S0, g if gated else None, beta if delta else None)
    assert_close("output", torch.from_numpy(y).view(B, T, H, dv), y_ref, TOL)
    assert_close("present_state", torch.from_numpy(S), S_ref, TOL)


@pytest.mark.parametrize("domain", DOMAINS)
def test_linear_attention_default_scale_and_no_past(domain):
    B, T, H, dk, dv = 1, 4, 2, 3, 2
    q, k, v = torch.randn(B, T, H, dk), torch.randn(B, T, H, dk), torch.randn(B, T, H, dv)
    session = _one_node("LinearAttention", domain, [("q", [B, T, H * dk]), ("k", [B, T, H * dk]), ("v", [B, T, H * dv])],
                        [("y", [B, T, H * dv]), ("S", [B, H, dk, dv])], update_rule="linear", q_num_heads=H,
                        kv_num_heads=H)
    y, S = session.run(None, dict(q=q.flatten(2).numpy(), k=k.flatten(2).numpy(), v=v.flatten(2).numpy()))
    y_ref, S_ref = _linear_attention_loop("linear", q, k, v, torch.zeros(B, H, dk, dv), scale=1 / math.sqrt(dk))
    assert_close("output with scale 1/sqrt(d_k)", torch.from_numpy(y).view(B, T, H, dv), y_ref, TOL)
    assert_close("present_state from zeros", torch.from_numpy(S), S_ref, TOL)


@pytest.mark.parametrize("domain", DOMAINS)
@pytest.mark.parametrize("T,K,activation,with_past", [(9, 4, "silu", True), (2, 4, "none", True), (7, 3, "silu", False)])
def test_causal_conv_with_state_semantics(domain, T, K, activation, with_past):
    B, C = 2, 5
    x, w, b, past = torch.randn(B, C, T), torch.randn(C, 1, K), torch.randn(C), torch.randn(B, C, K - 1)
    inputs = [("x", [B, C, T]), ("w", [C, 1, K]), ("b", [C])] + ([("past", [B, C, K - 1])] if with_past else [])
    session = _one_node("CausalConvWithState", domain, inputs, [("y", [B, C, T]), ("S", [B, C, K - 1])],
                        activation=activation)
    feeds = dict(x=x, w=w, b=b, past=past)
    y, S = session.run(None, {n: feeds[n].numpy() for n, _ in inputs})
    window = torch.cat([past if with_past else torch.zeros(B, C, K - 1), x], -1)
    y_ref = F.conv1d(window, w, b, groups=C)
    y_ref = F.silu(y_ref) if activation == "silu" else y_ref
    assert_close("output", torch.from_numpy(y), y_ref, TOL)
    assert torch.equal(torch.from_numpy(S), window[..., -(K - 1):]), "present_state must be the last K-1 inputs"


# --------------------------------------------------------------------------------------------------
# 2. The l_p memory at p = 2 is a gated delta rule
# --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def p2_session(tmp_path_factory):
    """memory_scan at p = 2 exported once for [B, T, H, Dk, Dv] = [2, 13, 2, 5, 3]."""
    B, T, H, Dk, Dv = 2, 13, 2, 5, 3
    args = (torch.zeros(B, T, H, Dk), torch.zeros(B, T, H, Dv), torch.zeros(B, T, H, Dk), torch.zeros(B, T, H),
            torch.zeros(B, T, H), torch.zeros(B, H, Dv, Dk))
    path = tmp_path_factory.mktemp("p2") / "memory_scan.onnx"
    report = hecate.export_onnx(MemoryScanCall(2.0), args, path)
    assert [f.form for f in report.onnx_forms] == ["LinearAttention(gated_delta)"], report.onnx_forms
    return _session(path)


@pytest.mark.parametrize("alpha_kind", ["random", "near_one", "one", "zero"])
def test_p2_memory_is_gated_delta_with_rescaled_beta_and_values(alpha_kind, p2_session):
    """M ← (1−α)M − 2η(Mk − v)kᵀ equals gated delta with e^g = 1−α, β = 2η/(1−α), v' = (1−α)v.

    Checked through the exported op (so the hold of γ = 1 − α away from 0 is tested too): α = 1
    still reads the old memory through M k, which the hold keeps.
    """
    B, T, H, Dk, Dv = 2, 13, 2, 5, 3
    k, v, q = torch.randn(B, T, H, Dk) * 0.5, torch.randn(B, T, H, Dv), torch.randn(B, T, H, Dk)
    alpha = {"random": torch.rand(B, T, H), "near_one": 1 - torch.rand(B, T, H) * 1e-6,
             "one": torch.ones(B, T, H), "zero": torch.zeros(B, T, H)}[alpha_kind]
    args = (k, v, q, alpha, torch.rand(B, T, H) * 0.3, torch.randn(B, H, Dv, Dk))
    names = [i.name for i in p2_session.get_inputs()]
    y, m, s = p2_session.run(None, {n: a.numpy() for n, a in zip(names, args)})
    y_ref, m_ref, _ = memory_scan_naive(*(x.double() for x in args))
    assert s.shape == (0,), "s_final without momentum is an empty [0]"
    assert_close("y", torch.from_numpy(y), y_ref.float(), TOL)
    assert_close("m_final", torch.from_numpy(m), m_ref.float(), TOL)


class MemoryScanCall(torch.nn.Module):
    def __init__(self, p, momentum=0.0, q_norm=2.0, decay_first=False):
        super().__init__()
        self.scalars = (p, 10.0, 1e-6, momentum, q_norm)
        self.decay_first = decay_first

    def forward(self, k, v, q, alpha, eta, m0):
        return torch.ops.hecate.memory_scan(k, v, q, alpha, eta, m0, None, *self.scalars, "", None, None,
                                            self.decay_first)


class LinearAttentionCall(torch.nn.Module):
    def __init__(self, normalize, gated=True, causal=True):
        super().__init__()
        self.normalize, self.gated, self.causal = normalize, gated, causal

    def forward(self, k, v, q, alpha, m0, z0):
        if not self.causal:
            return torch.ops.hecate.linear_attention(k, v, q, None, None, None, self.normalize, 1e-6, False)
        return torch.ops.hecate.linear_attention(k, v, q, alpha if self.gated else None, m0,
                                                 z0 if self.normalize else None, self.normalize, 1e-6, True)


def _run_exported(model, args, path, *, expect_forms=None, **export_kwargs):
    """Export ``model`` with ``args`` to ``path``, run it in onnxruntime on ``args``; the outputs as tensors."""
    report = hecate.export_onnx(model, args, path, **export_kwargs)
    if expect_forms is not None:
        assert [f.form for f in report.onnx_forms] == expect_forms, report.onnx_forms
    session = _session(path)
    kept = [i.name for i in session.get_inputs()]  # the exporter drops inputs the graph does not use
    names = model.forward.__code__.co_varnames[1:model.forward.__code__.co_argcount]
    feeds = {n: a.numpy() for n, a in zip(names, args) if n in kept}
    return [torch.from_numpy(o) for o in session.run(None, feeds)]


@pytest.mark.parametrize("domain,B,T", [("", 1, 1), ("", 3, 17), ("com.microsoft", 2, 70)])
def test_memory_scan_p2_op_parity(domain, B, T, tmp_path):
    H, Dk, Dv = 2, 5, 3
    args = (torch.randn(B, T, H, Dk) * 0.5, torch.randn(B, T, H, Dv), torch.randn(B, T, H, Dk),
            torch.rand(B, T, H), torch.rand(B, T, H) * 0.3, torch.randn(B, H, Dv, Dk))
    model = MemoryScanCall(2.0)
    y, m, s = _run_exported(model, args, tmp_path / "m.onnx", fused_domain=domain,
                            expect_forms=["LinearAttention(gated_delta)"])
    y_ref, m_ref, s_ref = model(*args)
    assert s.shape == s_ref.shape == (0,), "s_final without momentum is an empty [0]"
    assert_close("y", y, y_ref, TOL)
    assert_close("m_final (present_state)", m, m_ref, TOL)


@pytest.mark.parametrize("domain", DOMAINS)
def test_memory_scan_decay_first_is_gated_delta_as_is(domain, tmp_path):
    """decay_first is the operator's own order (decay, then the delta rule): β = 2η and v unscaled."""
    B, T, H, Dk, Dv = 2, 9, 2, 5, 3
    args = (torch.randn(B, T, H, Dk) * 0.5, torch.randn(B, T, H, Dv), torch.randn(B, T, H, Dk),
            torch.rand(B, T, H), torch.rand(B, T, H) * 0.3, torch.randn(B, H, Dv, Dk))
    model = MemoryScanCall(2.0, decay_first=True)
    y, m, _ = _run_exported(model, args, tmp_path / "m.onnx", fused_domain=domain,
                            expect_forms=["LinearAttention(gated_delta)"])
    y_ref, m_ref, _ = model(*args)
    assert_close("y", y, y_ref, TOL)
    assert_close("m_final (present_state)", m, m_ref, TOL)


@pytest.mark.parametrize("p,momentum,q_norm,why", [(3.0, 0.0, 2.0, "p=3"), (1.0, 0.0, 2.0, "p=1"),
                                                   (2.0, 0.5, 2.0, "momentum"), (2.0, 0.0, 4.0, "MONETA")])
def test_memory_scan_that_does_not_fit_keeps_its_scan(p, momentum, q_norm, why, tmp_path):
    B, T, H, Dk, Dv = 2, 6, 2, 5, 3
    args = (torch.randn(B, T, H, Dk) * 0.5, torch.randn(B, T, H, Dv), torch.randn(B, T, H, Dk),
            torch.rand(B, T, H), torch.rand(B, T, H) * 0.3, torch.randn(B, H, Dv, Dk))
    model = MemoryScanCall(p, momentum, q_norm)
    report = hecate.export_onnx(model, args, tmp_path / "m.onnx")
    (form,) = report.onnx_forms
    assert form.form == "Scan" and why in form.reason, form
    assert "Scan" in [n.op_type for n in onnx.load(str(tmp_path / "m.onnx")).graph.node]


@pytest.mark.parametrize("domain,normalize,gated,B,T", [("", True, True, 2, 9), ("com.microsoft", False, True, 1, 33),
                                                        ("", True, False, 3, 5), ("com.microsoft", False, False, 2, 1)])
def test_linear_attention_op_parity(domain, normalize, gated, B, T, tmp_path):
    H, Dk, Dv = 2, 4, 3
    args = (torch.rand(B, T, H, Dk), torch.randn(B, T, H, Dv), torch.rand(B, T, H, Dk), torch.rand(B, T, H),
            torch.randn(B, H, Dv, Dk), torch.rand(B, H, Dk))
    model = LinearAttentionCall(normalize, gated)
    got = _run_exported(model, args, tmp_path / "la.onnx", fused_domain=domain,
                        expect_forms=[f"LinearAttention({'gated' if gated else 'linear'})"])
    for what, o, r in zip(("y", "m_final", "z_final"), got, model(*args)):
        if what == "z_final" and not normalize:
            assert not o.any(), "z_final must be zeros without the normaliser"
        else:
            assert_close(what, o, r, TOL)


def test_non_causal_linear_attention_is_matmuls(tmp_path):
    args = (torch.rand(2, 5, 2, 4), torch.randn(2, 5, 2, 3), torch.rand(2, 5, 2, 4), torch.rand(2, 5, 2),
            torch.randn(2, 2, 3, 4), torch.rand(2, 2, 4))
    model = LinearAttentionCall(True, causal=False)
    y, *_ = _run_exported(model, args, tmp_path / "la.onnx", expect_forms=["MatMul"])
    assert_close("y", y, model(*args)[0], TOL)


def test_opset_below_27_gives_the_scan_form(tmp_path):
    args = (torch.rand(2, 5, 2, 4), torch.randn(2, 5, 2, 3), torch.rand(2, 5, 2, 4), torch.rand(2, 5, 2) * 0.3,
            torch.rand(2, 5, 2) * 0.3, torch.randn(2, 2, 3, 4))
    report = hecate.export_onnx(MemoryScanCall(2.0), args, tmp_path / "m.onnx", opset_version=18)
    assert [(f.form, f.reason) for f in report.onnx_forms] == [("Scan", "opset 18 < 27")]
    ops = [n.op_type for n in onnx.load(str(tmp_path / "m.onnx")).graph.node]
    assert "Scan" in ops and "LinearAttention" not in ops, ops


def test_unknown_fused_domain_is_refused(tmp_path):
    with pytest.raises(ValueError, match="fused_domain must be one of"):
        hecate.export_onnx(MemoryScanCall(2.0), (torch.rand(1, 2, 1, 2),) * 3 + (torch.rand(1, 2, 1),) * 2
                           + (torch.rand(1, 1, 2, 2),), tmp_path / "m.onnx", fused_domain="ai.example")


# --------------------------------------------------------------------------------------------------
# 3. State in and out: chunks in onnxruntime equal one PyTorch run over the whole sequence
# --------------------------------------------------------------------------------------------------

def test_state_carries_across_chunks(tmp_path):
    B, H, Dk, Dv, chunk = 2, 2, 5, 3, 6
    T = 3 * chunk
    k, v, q = torch.randn(B, T, H, Dk) * 0.5, torch.randn(B, T, H, Dv), torch.randn(B, T, H, Dk)
    alpha, eta = torch.rand(B, T, H), torch.rand(B, T, H) * 0.3
    model = MemoryScanCall(2.0)
    y_full, m_full = model(k, v, q, alpha, eta, torch.zeros(B, H, Dv, Dk))[:2]
    sl = slice(0, chunk)
    hecate.export_onnx(model, (k[:, sl], v[:, sl], q[:, sl], alpha[:, sl], eta[:, sl], torch.zeros(B, H, Dv, Dk)),
                       tmp_path / "chunk.onnx")
    session = _session(tmp_path / "chunk.onnx")
    names = [i.name for i in session.get_inputs()]
    m, ys = np.zeros((B, H, Dv, Dk), np.float32), []
    for start in range(0, T, chunk):
        sl = slice(start, start + chunk)
        y, m, _ = session.run(None, dict(zip(names, (k[:, sl].numpy(), v[:, sl].numpy(), q[:, sl].numpy(),
                                                  alpha[:, sl].numpy(), eta[:, sl].numpy(), m))))
        ys.append(torch.from_numpy(y))
    assert_close("y over chunks", torch.cat(ys, 1), y_full, TOL)
    assert_close("state after the last chunk", torch.from_numpy(m), m_full, TOL)


# --------------------------------------------------------------------------------------------------
# 4. The models of hecate/models whose recurrence fits
# --------------------------------------------------------------------------------------------------

def _model_parity(model, args, path, expect_forms, domain=""):
    model.eval()
    got = _run_exported(model, args, path, fused_domain=domain, expect_forms=expect_forms)
    with torch.no_grad():
        ref = [r for r in model(*args) if r is not None]
    assert len(got) == len(ref)
    for i, (o, r) in enumerate(zip(got, ref)):
        assert_close(f"output {i}", o, r, TOL)


_CONV = "CausalConvWithState(silu)"


@pytest.mark.parametrize("domain,alpha,eta,B,T", [("", None, None, 2, 9), ("com.microsoft", 0.1, 0.2, 1, 24),
                                                  ("", 1.0, 0.1, 3, 5)])
def test_lp_memory_p2_model(domain, alpha, eta, B, T, tmp_path):
    # use_scan=True: torch.export unrolls a Python loop, which exports unfused (the README's export form)
    model = LpMemory(16, n_heads=2, d_k=4, d_v=3, p=2.0, alpha=alpha, eta=eta, phi="elu1", use_scan=True)
    _model_parity(model, (torch.randn(B, T, 16), torch.randn(B, 2, 3, 4) * 0.1), tmp_path / "model.onnx",
                  [_CONV, _CONV, "LinearAttention(gated_delta)"], domain)


@pytest.mark.parametrize("domain,kwargs,B,T,rule", [
    ("", dict(alpha=None, normalise=True, use_scan=True), 2, 9, "gated"),
    ("com.microsoft", dict(alpha=0.9, use_scan=True), 1, 17, "gated"),
    ("", dict(alpha=1.0, normalise=True, form="cumsum"), 3, 6, "linear")])
def test_hebbian_memory_model(domain, kwargs, B, T, rule, tmp_path):
    model = HebbianMemory(16, n_heads=2, d_k=4, d_v=3, **kwargs)
    _model_parity(model, (torch.randn(B, T, 16), torch.randn(B, 2, 3, 4) * 0.1), tmp_path / "model.onnx",
                  [_CONV, _CONV, f"LinearAttention({rule})"], domain)


@pytest.mark.parametrize("kwargs,B,T,form", [(dict(phi="elu1", n_heads=2), 2, 7, _CONV),
                                             (dict(phi="relu", activation="none", kernel_size=3), 1, 2,
                                              "CausalConvWithState(none)"),
                                             (dict(phi="performer", n_heads=2), 3, 11, _CONV)])
def test_key_query_preprocess_model(kwargs, B, T, form, tmp_path):
    _model_parity(KeyQueryPreprocess(16, d_key=8, **kwargs), (torch.randn(B, T, 16),), tmp_path / "kq.onnx",
                  [form, form])


def test_an_argument_not_mapped_keeps_the_fallback():
    """An argument added to an op later (given, not its default) keeps the op on its pre-opset-27 translation."""
    from hecate.lowering.onnx_fused import onnx_translations, use_fused

    def fallback(x, carried_state=None):
        return x

    with onnx_translations(27) as (_, _, forms):
        assert use_fused("hecate.example", "Scan", fallback, ("x",), {}, lambda a: "", mapped=("x",)) == \
            {"x": "x", "carried_state": None}
        assert use_fused("hecate.example", "Scan", fallback, ("x", "state"), {}, lambda a: "", mapped=("x",)) is None
    assert [(f.form, f.reason) for f in forms] == [("Scan", "carried_state not mapped onto the fused operator")]
