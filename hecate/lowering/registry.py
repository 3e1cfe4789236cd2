"""Where each fused op declares its export translations.

An op's folder registers, beside its definition:

* an ONNX translation (an onnxscript function written with standard ONNX ops),
  used by :func:`hecate.export_onnx` through ``torch.onnx.export(custom_translation_table=...)``;
* an ATen decomposition (plain ``torch.ops.aten`` calls), used by
  :func:`hecate.export_mlir` so torch-mlir sees only ops it knows.
"""

from __future__ import annotations

from typing import Callable

import torch

ONNX_TRANSLATIONS: dict[torch._ops.OpOverload, Callable] = {}
DECOMPOSITIONS: dict[torch._ops.OpOverload, Callable] = {}


def onnx_translation(op: torch._ops.OpOverload) -> Callable[[Callable], Callable]:
    """Register ``fn`` as the ONNX translation of ``op``."""

    def register(fn: Callable) -> Callable:
        ONNX_TRANSLATIONS[op] = fn
        return fn

    return register


def decomposition(op: torch._ops.OpOverload) -> Callable[[Callable], Callable]:
    """Register ``fn`` as the ATen decomposition of ``op`` (for torch-mlir)."""

    def register(fn: Callable) -> Callable:
        DECOMPOSITIONS[op] = fn
        return fn

    return register
