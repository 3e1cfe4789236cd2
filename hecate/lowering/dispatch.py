"""Which implementation a fused op runs: Triton kernels or the CPU path.

CUDA tensors run the Triton kernels. CPU tensors run the op's CPU path (plain,
fast ATen), except inside :func:`triton_on_cpu`, which routes them through the
Triton kernels under the interpreter: that is how CI, which has no GPU, tests
every kernel. ``TRITON_INTERPRET=1`` must be set before triton is imported
(``tests/conftest.py`` does it).
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch

_force_triton_on_cpu = False


def interpreting() -> bool:
    """True when Triton kernels run under the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(x: torch.Tensor) -> bool:
    """Whether an op whose main input is ``x`` should launch its Triton kernels."""
    if x.device.type == "cuda":
        return True
    return x.device.type == "cpu" and _force_triton_on_cpu


def use_triton_kernels(x: torch.Tensor) -> bool:
    """:func:`use_triton`, for the dtypes the kernels compute faithfully (fp32 accumulation: fp32, fp16,
    bf16). float64 runs the op's ATen path on every device, in float64, never silently in float32."""
    return use_triton(x) and x.dtype != torch.float64


def check_devices(op: str, name: str, first: torch.Tensor, **others: torch.Tensor | None) -> None:
    """Every tensor of ``others`` on ``first``'s device: the kernels read them all from there."""
    for other, x in others.items():
        if x is not None and x.device != first.device:
            raise ValueError(f"{op}: {other} is on {x.device}, expected {name}'s device {first.device}")


@contextlib.contextmanager
def triton_on_cpu() -> Iterator[None]:
    """Run Hecate's Triton kernels on CPU tensors (needs ``TRITON_INTERPRET=1``)."""
    global _force_triton_on_cpu
    if not interpreting():
        raise RuntimeError("triton_on_cpu() needs TRITON_INTERPRET=1 set before triton is imported")
    previous, _force_triton_on_cpu = _force_triton_on_cpu, True
    try:
        yield
    finally:
        _force_triton_on_cpu = previous


def dense(outputs: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """A fused op's outputs, contiguous: every op's fake says so, and Inductor asserts the strides of what
    runs against the fake's (inputs laid out transposed would otherwise give transposed gradients). Each
    owns its storage: a custom op's outputs may not alias each other (the memory and the normaliser cut
    from one state are views of it, contiguous ones at batch 1)."""
    if isinstance(outputs, torch.Tensor):
        return outputs.contiguous()
    owned, storages = [], set()
    for t in outputs:
        t = t.contiguous()
        if t.untyped_storage().data_ptr() in storages and t.numel():
            t = t.clone()
        storages.add(t.untyped_storage().data_ptr())
        owned.append(t)
    return tuple(owned)
