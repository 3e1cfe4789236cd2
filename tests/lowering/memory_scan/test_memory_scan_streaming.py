"""Streaming: memory_scan takes and returns both states (the memory A and the momentum buffer S), so a sequence
processed in chunks, each starting from the previous chunk's final states, equals the whole sequence, forward
and gradients (also those of the initial states), on both paths."""

from __future__ import annotations

import contextlib

import pytest
import torch

import hecate.lowering  # noqa: F401
from hecate.lowering.dispatch import triton_on_cpu
from hecate.lowering.memory_scan.naive import memory_scan_naive
from hecate.testing import assert_close

from memory_scan_cases import Case, make_inputs

op = torch.ops.hecate.memory_scan
PATHS = {"cpu": (contextlib.nullcontext, torch.float64, 1e-12), "triton": (triton_on_cpu, torch.float32, 1e-5)}
CHUNKS = (0, 3, 5, 7)


def _with_s0(case: Case, dtype, **shape):
    k, v, q, alpha, eta, m0, _ = make_inputs(case, dtype=torch.float64, **shape)
    s0 = (0.3 * torch.randn_like(m0)) if case.momentum else None
    return [x.detach().to(dtype).requires_grad_() if x is not None else None for x in (k, v, q, alpha, eta, m0, s0)]


def _chunked(inputs, case):
    """y and the final states, running the op over CHUNKS and carrying (m_final, s_final)."""
    k, v, q, alpha, eta, m, s = inputs
    ys = []
    for start, stop in zip(CHUNKS[:-1], CHUNKS[1:]):
        y, m, s = op(*(x[:, start:stop] for x in (k, v, q, alpha, eta)), m, None, *case.scalars(), "",
                     s if case.momentum else None)
        ys.append(y)
    return torch.cat(ys, 1), m, s


def _whole_reference(inputs, case):
    k, v, q, alpha, eta, m0, s0 = inputs
    return memory_scan_naive(k, v, q, alpha, eta, m0, None, *case.scalars(), "", s0)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", [Case("p2.5_momentum", p=2.5, momentum=0.6), Case("moneta_p3_q4", p=3.0, q_norm=4.0)],
                         ids=lambda c: c.name)
def test_chunks_carrying_the_states_equal_the_whole_sequence(case, path):
    context, dtype, tol = PATHS[path]
    inputs = _with_s0(case, dtype)
    reference_inputs = [x.detach().double().requires_grad_() if x is not None else None for x in inputs]
    expected = _whole_reference(reference_inputs, case)
    cotangents = [torch.randn_like(e) for e in expected]
    with context():
        got = _chunked(inputs, case)
    assert got[2].shape == expected[2].shape == ((2, 2, 3, 5) if case.momentum else (0,))
    for name, g, e in zip(("y", "m_final", "s_final"), got, expected):
        assert_close(name, g, e, tol)
    leaves = [x for x in inputs if x is not None]
    reference_leaves = [x for x in reference_inputs if x is not None]
    with context():
        grads = torch.autograd.grad(sum((g * c.to(g.dtype)).sum() for g, c in zip(got, cotangents)), leaves)
    grads_ref = torch.autograd.grad(sum((e * c).sum() for e, c in zip(expected, cotangents)), reference_leaves)
    names = [n for n, x in zip(("dk", "dv", "dq", "dalpha", "deta", "dm0", "ds0"), inputs) if x is not None]
    for name, g, g_ref in zip(names, grads, grads_ref):
        assert_close(name, g, g_ref, tol)


def test_momentum_state_gradcheck_float64():
    case = Case("p2.5_momentum", p=2.5, momentum=0.5, T=3)
    k, v, q, alpha, eta, m0, s0 = _with_s0(case, torch.float64, B=1, H=1, Dk=3, Dv=2)
    assert torch.autograd.gradcheck(lambda *x: op(*x[:6], None, *case.scalars(), "", x[6]), (k, v, q, alpha, eta, m0, s0))


def test_opcheck_with_momentum_state():
    case = Case("p2.5_momentum", p=2.5, momentum=0.5, T=4)
    k, v, q, alpha, eta, m0, s0 = [x.detach() for x in _with_s0(case, torch.float32)]
    torch.library.opcheck(op.default, (k, v, q, alpha, eta, m0, None, *case.scalars(), "", s0))
    with triton_on_cpu():
        torch.library.opcheck(op.default, (k, v, q, alpha, eta, None, None, *case.scalars(), "", s0),
                              test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    torch.library.opcheck(torch.ops.hecate.memory_scan_backward.default,
                          (torch.randn_like(v), torch.randn_like(m0), k, v, q, alpha, eta, m0, None, *case.scalars(),
                           "", s0, torch.randn_like(s0)))


def test_s0_without_momentum_is_refused():
    k, v, q, alpha, eta, m0, _ = [x.detach() if isinstance(x, torch.Tensor) else x
                                  for x in make_inputs(Case("p2"), dtype=torch.float32)]
    with pytest.raises(ValueError, match=r"s0 is the momentum buffer's initial state; pass it only with momentum != 0"):
        op(k, v, q, alpha, eta, m0, None, 2.0, 10.0, 1e-6, 0.0, 2.0, "", torch.zeros_like(m0))
    with pytest.raises(ValueError, match=r"s0 shape \(2, 2, 5, 3\) must be \[B, H, Dv, Dk\] = \(2, 2, 3, 5\)"):
        op(k, v, q, alpha, eta, m0, None, 2.0, 10.0, 1e-6, 0.5, 2.0, "", m0.transpose(-1, -2))


class MomentumStateCall(torch.nn.Module):
    def __init__(self, case: Case):
        super().__init__()
        self.case = case

    def forward(self, k, v, q, alpha, eta, m0, s0):
        return op(k, v, q, alpha, eta, m0, None, *self.case.scalars(), "", s0)


def test_onnx_export_with_momentum_state_matches(tmp_path):
    import onnx
    import onnxruntime

    import hecate

    case = Case("p2.5_momentum", p=2.5, momentum=0.6)
    args = tuple(x.detach() for x in _with_s0(case, torch.float32))
    model = MomentumStateCall(case)
    path = tmp_path / "memory_scan_state.onnx"
    hecate.export_onnx(model, args, path)
    assert [n.op_type for n in onnx.load(str(path)).graph.node].count("Scan") == 1
    session = onnxruntime.InferenceSession(str(path))
    got = session.run(None, {i.name: a.numpy() for i, a in zip(session.get_inputs(), args)})
    for name, g, e in zip(("y", "m_final", "s_final"), got, model(*args)):
        assert_close(name, torch.from_numpy(g), e, 1e-4)


def test_mlir_export_with_momentum_state():
    import hecate

    case = Case("p2.5_momentum", p=2.5, momentum=0.6, T=3)
    text = hecate.export_mlir(MomentumStateCall(case), tuple(x.detach() for x in _with_s0(case, torch.float32)),
                              output_type="linalg-on-tensors")
    assert "hecate" not in text and "linalg" in text
