"""What Hecate's tests compare with: relative error, poisoned outputs, CUDA checks."""

from __future__ import annotations

import torch


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``‖actual − expected‖ / ‖expected‖`` in float64 (0 when both are zero).

    NaN anywhere in ``actual`` (an unwritten poisoned element) gives NaN, which
    fails every ``<=`` tolerance check.
    """
    if actual.shape != expected.shape:
        raise AssertionError(f"shape mismatch: actual {tuple(actual.shape)} vs expected {tuple(expected.shape)}")
    a, b = actual.detach().double(), expected.detach().double()
    denom = b.norm()
    diff = (a - b).norm()
    if denom == 0:
        return float(diff)
    return float(diff / denom)


def assert_close(name: str, actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    """Assert ``rel_err(actual, expected) <= tol`` with a message naming the tensor."""
    err = rel_err(actual, expected)
    if not err <= tol:  # also catches NaN
        raise AssertionError(f"{name}: relative error {err:.3e} > tolerance {tol:.1e}")


def poisoned(*shape: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> torch.Tensor:
    """A NaN-filled tensor: any element a kernel forgets to write stays NaN."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)
