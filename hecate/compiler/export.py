"""Export with Hecate's fusions: ONNX for onnxruntime, MLIR through torch-mlir.

Both start from ``torch.export`` (whose graph is the same pre-dispatch ATen form
the backend canonicalises to), run the same passes on it, and then translate:
each fused op carries its own ONNX translation and its own ATen decomposition
(:mod:`hecate.lowering.registry`).
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

import torch

from hecate.compiler.options import parse_options
from hecate.compiler.pipeline import run_passes
from hecate.compiler.report import FusionReport

MLIR_OUTPUT_TYPES = ("torch", "linalg-on-tensors", "tosa", "stablehlo", "raw")


def export_program(model: torch.nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None,
                   options: Mapping[str, Any] | None = None) -> tuple[torch.export.ExportedProgram, FusionReport]:
    """``torch.export`` the model and apply Hecate's passes to the exported graph."""
    import hecate.lowering  # noqa: F401

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple of example inputs, got {type(args).__name__}")
    opts = parse_options(options)
    program = torch.export.export(model, tuple(args), dict(kwargs or {}))
    report = FusionReport(graphs=1)
    run_passes(program.graph_module, opts, report, dump_name="export")
    return program, report


def export_onnx(model: torch.nn.Module, args: Sequence[Any], path: str | os.PathLike, *,
                kwargs: Mapping[str, Any] | None = None, options: Mapping[str, Any] | None = None,
                opset_version: int | None = None, fused_domain: str = "") -> FusionReport:
    """Write ``model`` with Hecate's fused ops to an ONNX file at ``path``.

    Fused ops become standard ONNX ops through their translations, so plain
    onnxruntime (CPU or CUDA provider) runs the file. Returns the fusion report;
    ``report.onnx_forms`` says which ONNX form each fused op took and why.
    ``opset_version``: None is 27 where onnx/onnxruntime have it (recurrences that fit become
    ``LinearAttention``, the short conv ``CausalConvWithState``), else torch.onnx's default; below
    27 every recurrence is a ``Scan``. ``fused_domain="com.microsoft"`` writes those two operators
    as onnxruntime's native kernels (:mod:`hecate.lowering.onnx_fused`).
    """
    from hecate.lowering.onnx_fused import finish_model, onnx_translations

    program, report = export_program(model, args, kwargs, options)
    with onnx_translations(opset_version, fused_domain) as (table, opset_version, forms):
        onnx_program = torch.onnx.export(program, tuple(args), kwargs=dict(kwargs or {}), dynamo=True,
                                         custom_translation_table=table,
                                         opset_version=opset_version, external_data=False)
    report.onnx_forms = forms
    finish_model(onnx_program, fused_domain)
    onnx_program.save(os.fspath(path))
    return report


def export_mlir(model: torch.nn.Module, args: Sequence[Any], *, output_type: str = "torch",
                kwargs: Mapping[str, Any] | None = None, options: Mapping[str, Any] | None = None) -> str:
    """Import ``model`` into MLIR with torch-mlir and return the module as text.

    ``output_type`` is one of "torch", "linalg-on-tensors", "tosa", "stablehlo", "raw".
    Fused ops are decomposed into ATen first (torch-mlir knows no hecate op).
    """
    if output_type not in MLIR_OUTPUT_TYPES:
        raise ValueError(f"output_type must be one of {list(MLIR_OUTPUT_TYPES)}, got {output_type!r}")
    try:
        from torch_mlir.fx import export_and_import, get_decomposition_table
    except ImportError as e:  # an optional dependency: pip install 'hecate[mlir]'
        raise ImportError("export_mlir needs torch-mlir: pip install torch-mlir") from e
    from hecate.lowering.registry import DECOMPOSITIONS

    program, _ = export_program(model, args, kwargs, options)
    table = {**get_decomposition_table(), **DECOMPOSITIONS}
    return str(export_and_import(program, output_type=output_type, decomposition_table=table))
