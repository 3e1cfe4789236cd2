"""Where each fused op declares its export translations.

An op's folder registers, beside its definition:

* an ONNX translation (an onnxscript function written with standard ONNX ops),
  used by :func:`hecate.export_onnx` through ``torch.onnx.export(custom_translation_table=...)``;
* an ATen decomposition (plain ``torch.ops.aten`` calls), used by
  :func:`hecate.export_mlir` so torch-mlir sees only ops it knows, and by :func:`differentiable_backward` for a
  gradient that is differentiated again.
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


def differentiable_backward(op: torch._ops.OpOverload, inputs: tuple, grads: tuple) -> tuple:
    """The gradients of ``op``'s inputs (None where one takes none) for the gradients ``grads`` of its outputs, by
    autograd through its ATen decomposition, as a graph that is itself differentiable.

    An op's backward takes this path where it runs under ``create_graph=True`` (a gradient penalty differentiates
    the gradient): its fused backward op has no autograd formula of its own. Lists of tensors among the inputs (a
    φ's weights) get lists of gradients."""
    leaves, spec = torch.utils._pytree.tree_flatten(list(inputs))
    wrt = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad]
    with torch.enable_grad():
        outputs = torch.utils._pytree.tree_leaves(DECOMPOSITIONS[op](*inputs))
    pairs = [(o, g) for o, g in zip(outputs, grads)
             if g is not None and isinstance(o, torch.Tensor) and o.requires_grad]
    found = torch.autograd.grad([o for o, _ in pairs], [leaves[i] for i in wrt], [g for _, g in pairs],
                                create_graph=True, allow_unused=True) if pairs and wrt else []
    result = [None] * len(leaves)
    for i, g in zip(wrt, found):
        result[i] = g
    return tuple(torch.utils._pytree.tree_unflatten(result, spec))
