"""memory_scan exports: one ONNX Scan node (onnxruntime matches), torch-mlir through the decomposition."""

from __future__ import annotations

import onnx
import onnxruntime
import pytest
import torch

import hecate
from hecate.testing import assert_close

from memory_scan_cases import Case, make_inputs


class MemoryScanCall(torch.nn.Module):
    def __init__(self, case: Case):
        super().__init__()
        self.case = case

    def forward(self, k, v, q, alpha, eta, m0):
        return torch.ops.hecate.memory_scan(k, v, q, alpha, eta, m0 if self.case.with_m0 else None, None,
                                            *self.case.scalars())


def _args(case):
    k, v, q, alpha, eta, m0, _ = make_inputs(case, dtype=torch.float32)
    m0 = m0 if m0 is not None else torch.zeros(2, 2, 3, 5)
    return tuple(x.detach() for x in (k, v, q, alpha, eta, m0))


@pytest.mark.parametrize("case", [Case("p2"), Case("p1_no_m0", p=1.0, with_m0=False),
                                  Case("p2.5_momentum", p=2.5, momentum=0.5),
                                  Case("moneta_p3_q4", p=3.0, q_norm=4.0)], ids=lambda c: c.name)
def test_onnx_export_is_one_scan_and_matches(case, tmp_path):
    model, args = MemoryScanCall(case), _args(case)
    path = tmp_path / "memory_scan.onnx"
    hecate.export_onnx(model, args, path, opset_version=18)  # the Scan form; opset 27: tests/export
    ops = [n.op_type for n in onnx.load(str(path)).graph.node]
    assert ops.count("Scan") == 1 and "Loop" not in ops, ops
    # besides the Scan only the zero state's shape (Shape → Concat → ConstantOfShape at a dynamic batch) and, at a
    # dynamic length, the step that keeps the state (Expand → Concat) and the slice that drops its output
    assert len(set(ops) - {"Scan", "Shape", "Concat", "ConstantOfShape", "Expand", "Slice"}) <= 1, \
        f"the recurrence must stay rolled up, got top-level ops {ops}"
    session = onnxruntime.InferenceSession(str(path))
    feeds = {i.name: a.numpy() for i, a in zip(session.get_inputs(), args)}
    y_onnx, m_onnx, _ = session.run(None, feeds)
    y, m, _ = model(*args)
    assert_close("y", torch.from_numpy(y_onnx), y, 1e-4)
    assert_close("m_final", torch.from_numpy(m_onnx), m, 1e-4)


@pytest.mark.parametrize("output_type", ["torch", "linalg-on-tensors"])
def test_mlir_export(output_type):
    case = Case("moneta_momentum", p=3.0, q_norm=4.0, momentum=0.5, T=3)
    text = hecate.export_mlir(MemoryScanCall(case), _args(case), output_type=output_type)
    assert "hecate" not in text
    assert ("linalg" in text) if output_type == "linalg-on-tensors" else ("torch.aten" in text)
