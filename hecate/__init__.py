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


def _register_backend() -> None:
    """``backend="hecate"`` comes from the package's entry point once it is installed. Run from a checkout
    without installing (``PYTHONPATH=.``), there is no entry point: importing hecate registers the backend."""
    from importlib.metadata import entry_points

    from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend

    if "hecate" not in _COMPILER_FNS and not entry_points(group="torch_dynamo_backends", name="hecate"):
        register_backend(hecate_backend, name="hecate")


_register_backend()

__all__ = [
    "hecate_backend", "last_report", "explain", "export_onnx", "export_mlir",
    "HecateOptionsError", "Options", "Fusion", "FusionReport", "Miss",
]
