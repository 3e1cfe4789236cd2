"""linear_attention: CPU path, Triton (interpreter) and exports against the float64 loop reference."""

from __future__ import annotations

import onnx
import onnxruntime
import pytest
import torch
import torch.nn.functional as F

import hecate
import hecate.lowering  # noqa: F401
from hecate.lowering.dispatch import triton_on_cpu
from hecate.lowering.linear_attention.naive import linear_attention_naive
from hecate.lowering.memory_scan import cpu, kernels
from hecate.testing import assert_close

op = torch.ops.hecate.linear_attention

# (name, causal, normalize, gated α, initial state)
CASES = [
    ("causal_gated_with_state", True, False, True, True),
    ("causal_normalized_gated_with_state", True, True, True, True),
    ("causal_normalized_no_decay", True, True, False, False),
    ("noncausal_normalized", False, True, False, False),
    ("noncausal", False, False, False, False),
]


def make_inputs(causal, normalize, gated, init, dtype=torch.float64, B=2, T=7, H=2, Dk=5, Dv=3):
    k = F.elu(torch.randn(B, T, H, Dk, dtype=dtype)) + 1  # φ = elu + 1 keeps the normaliser positive
    q = F.elu(torch.randn(B, T, H, Dk, dtype=dtype)) + 1
    v = torch.randn(B, T, H, Dv, dtype=dtype)
    alpha = torch.sigmoid(torch.randn(B, T, H, dtype=dtype) + 2) if gated else None
    m0 = torch.randn(B, H, Dv, Dk, dtype=dtype) if init else None
    z0 = torch.rand(B, H, Dk, dtype=dtype) + 1 if init and normalize else None
    return [x.requires_grad_() if x is not None else None for x in (k, v, q, alpha, m0, z0)]


def _grads(fn, inputs, cot):
    outs = fn(*inputs)
    wrt = [x for x in inputs if x is not None]
    return outs, torch.autograd.grad(sum((o * c.to(o.dtype)).sum() for o, c in zip(outs, cot)), wrt)


def _check(case, dtype, tol, ctx):
    name, causal, normalize, gated, init = case
    ref_in = make_inputs(causal, normalize, gated, init)
    inputs = [x.detach().to(dtype).requires_grad_() if x is not None else None for x in ref_in]
    ref = linear_attention_naive(*ref_in, normalize, 1e-6, causal)
    cot = [torch.randn_like(r) for r in ref]
    with ctx():
        outs, grads = _grads(lambda *x: op(*x, normalize, 1e-6, causal), inputs, cot)
    _, grads_ref = _grads(lambda *x: linear_attention_naive(*x, normalize, 1e-6, causal), ref_in, cot)
    for what, o, r in zip(("y", "m_final", "z_final"), outs, ref):
        assert_close(what, o, r, tol)
    names = [n for n, x in zip(("dk", "dv", "dq", "dalpha", "dm0", "dz0"), ref_in) if x is not None]
    for what, g, r in zip(names, grads, grads_ref):
        assert_close(what, g, r, tol)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_cpu_path_matches_reference_float64(case, monkeypatch):
    import contextlib

    monkeypatch.setattr(cpu, "CHUNK", 3)
    _check(case, torch.float64, 1e-12, contextlib.nullcontext)


@pytest.mark.parametrize("case", CASES[:3], ids=lambda c: c[0])
def test_triton_matches_reference(case, monkeypatch):
    monkeypatch.setattr(kernels, "CHUNK", 3)
    # one value tile in the forward, two in the backward (Dv = 3, or 4 rows with the normaliser)
    monkeypatch.setattr(kernels, "MAX_BLOCK_V", 4)
    monkeypatch.setattr(kernels, "MAX_BLOCK_V_BACKWARD", 2)
    _check(case, torch.float32, 1e-5, triton_on_cpu)


def test_reference_gradcheck_float64():
    k, v, q, alpha, m0, z0 = make_inputs(True, True, True, True, B=1, T=3, H=1, Dk=3, Dv=2)
    assert torch.autograd.gradcheck(lambda *x: linear_attention_naive(*x, True, 1e-6, True), (k, v, q, alpha, m0, z0))


def test_opcheck():
    for causal, normalize, gated, init in [(True, True, True, True), (False, True, False, False)]:
        k, v, q, alpha, m0, z0 = [x.detach().float() if x is not None else None
                                  for x in make_inputs(causal, normalize, gated, init)]
        torch.library.opcheck(op.default, (k, v, q, alpha, m0, z0, normalize, 1e-6, causal))


@pytest.mark.parametrize("causal,normalize", [(True, True), (True, False), (False, True)])
def test_one_sequence_one_head_outputs_own_their_storage(causal, normalize):
    """At B = H = 1 the memory and the normaliser cut from one state are contiguous views of it; a custom op's
    outputs may alias neither its inputs nor each other (opcheck and torch.compile check both)."""
    k, v, q, alpha, m0, z0 = [x.detach().float() if x is not None else None
                              for x in make_inputs(causal, normalize, causal, causal, B=1, H=1)]
    y, m, z = op(k, v, q, alpha, m0, z0, normalize, 1e-6, causal)
    tensors = [t for t in (y, m, z, k, v, q, alpha, m0, z0) if t is not None]
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == len(tensors)
    torch.library.opcheck(op.default, (k, v, q, alpha, m0, z0, normalize, 1e-6, causal))


def test_bad_inputs():
    k, v, q, alpha, m0, z0 = [x.detach() if x is not None else None for x in make_inputs(True, True, True, True)]
    with pytest.raises(ValueError, match=r"alpha must be None for the non-causal form"):
        op(k, v, q, alpha, None, None, True, 1e-6, False)
    with pytest.raises(ValueError, match=r"z0 is the normaliser's initial state; pass it only with normalize=True"):
        op(k, v, q, alpha, m0, z0, False, 1e-6, True)
    with pytest.raises(ValueError, match=r"v shape \(2, 6, 2, 3\).*k shape \(2, 7, 2, 5\)"):
        op(k, v[:, :6], q, alpha, m0, z0, True, 1e-6, True)


@pytest.mark.parametrize("T", [7, 70], ids=["recurrent", "chunked_length"])
def test_a_nan_gate_is_carried_from_its_step_as_the_loop_carries_it(T):
    """A NaN gate is no error: the outputs from its step on are NaN and those before it are the reference's,
    at T = 70 too (where finite gates take the chunked form)."""
    k, v, q, alpha, m0, z0 = [x.detach() if x is not None else None
                              for x in make_inputs(True, True, True, True, T=T, dtype=torch.float32)]
    bad = alpha.clone()
    bad[1, 2, 0] = float("nan")
    y = op(k, v, q, bad, m0, z0, True, 1e-6, True)[0]
    y_ref = linear_attention_naive(k, v, q, bad, m0, z0, True, 1e-6, True)[0]
    assert torch.equal(torch.isfinite(y), torch.isfinite(y_ref)) and not torch.isfinite(y_ref[1, 2:, 0]).any()
    finite = torch.isfinite(y_ref)
    assert finite[1, :2].all() and finite[0].all()
    assert_close("y where finite", y[finite], y_ref[finite], 1e-5)


class LinearAttentionCall(torch.nn.Module):
    def __init__(self, causal, normalize):
        super().__init__()
        self.causal, self.normalize = causal, normalize

    def forward(self, k, v, q, alpha, m0, z0):
        if not self.causal:
            return op(k, v, q, None, None, None, self.normalize, 1e-6, False)
        return op(k, v, q, alpha, m0, z0 if self.normalize else None, self.normalize, 1e-6, True)


@pytest.mark.parametrize("causal,normalize", [(True, True), (True, False), (False, True)])
def test_onnx_export_matches(causal, normalize, tmp_path):
    args = tuple(x.detach().float() for x in make_inputs(True, True, True, True))
    model = LinearAttentionCall(causal, normalize)
    path = tmp_path / "linear_attention.onnx"
    hecate.export_onnx(model, args, path, opset_version=18)  # the Scan form; opset 27: tests/export
    ops = [n.op_type for n in onnx.load(str(path)).graph.node]
    assert ops.count("Scan") == (1 if causal else 0), ops
    session = onnxruntime.InferenceSession(str(path))
    kept = {i.name for i in session.get_inputs()}  # the exporter drops inputs the graph does not use
    assert kept <= {"k", "v", "q", "alpha", "m0", "z0"}, kept
    feeds = {name: x.numpy() for name, x in zip(("k", "v", "q", "alpha", "m0", "z0"), args) if name in kept}
    got = session.run(None, feeds)
    for what, o, r in zip(("y", "m_final", "z_final"), got, model(*args)):
        assert_close(what, torch.from_numpy(o), r, 1e-4)


def test_mlir_export():
    args = tuple(x.detach().float() for x in make_inputs(True, True, True, True, T=3))
    text = hecate.export_mlir(LinearAttentionCall(True, True), args, output_type="linalg-on-tensors")
    assert "hecate" not in text and "linalg" in text
