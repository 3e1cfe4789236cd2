"""Hecate: a torch.compile backend for memory-augmented and free-energy models.

    torch.compile(model, backend="hecate")          # no import needed
    hecate.explain(model, *args)                     # what would be fused, and why not
    hecate.export_onnx(model, args, "model.onnx")    # for onnxruntime
    hecate.export_mlir(model, args, output_type="linalg-on-tensors")
"""

from hecate.compiler.backend import hecate_backend, last_report
from hecate.compiler.explain import explain
from hecate.compiler.export import export_mlir, export_onnx
from hecate.compiler.options import HecateOptionsError, Options
from hecate.passes.report import Fusion, FusionReport, Miss

__all__ = [
    "hecate_backend", "last_report", "explain", "export_onnx", "export_mlir",
    "HecateOptionsError", "Options", "Fusion", "FusionReport", "Miss",
]
