"""Inputs and comparisons shared by the qk_preprocess op tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hecate.lowering.qk_preprocess.naive import MATRIX_PHI, qk_preprocess_reference
from hecate.testing import assert_close


@dataclass
class Case:
    B: int = 2
    T: int = 7
    D_in: int = 5
    D: int = 6
    K: int = 4
    proj: bool = True
    proj_bias: bool = True
    conv_bias: bool = True
    activation: str = "silu"
    phi: str = "elu1"
    phi_scalar: float = 0.5     # low enough that "exp" clamps some entries
    head_dim: int = 0           # matrix φ: W_phi is [d_phi, head_dim], head_dim divides D
    d_phi: int = 0

    @property
    def out_width(self) -> int:
        return self.D // self.head_dim * self.d_phi if self.phi in MATRIX_PHI else self.D

    def tensors(self, dtype=torch.float32, device="cpu") -> dict:
        """x, proj_weight, proj_bias, conv_weight, conv_bias, phi_weight, phi_bias (None where absent), all
        requiring grad."""
        def make(*shape, scale=1.0):
            return (torch.randn(*shape, dtype=torch.float64) * scale).to(dtype=dtype, device=device).requires_grad_()
        return dict(
            x=make(self.B, self.T, self.D_in if self.proj else self.D),
            proj_weight=make(self.D, self.D_in, scale=self.D_in ** -0.5) if self.proj else None,
            proj_bias=make(self.D) if self.proj and self.proj_bias else None,
            conv_weight=make(self.D, 1, self.K, scale=0.5),
            conv_bias=make(self.D) if self.conv_bias else None,
            phi_weight=make(self.d_phi, self.head_dim, scale=self.head_dim ** -0.5) if self.phi in MATRIX_PHI else None,
            phi_bias=make(self.d_phi) if self.phi == "random_fourier" else None,
        )

    def args(self, tensors: dict) -> tuple:
        return (tensors["x"], tensors["proj_weight"], tensors["proj_bias"], tensors["conv_weight"],
                tensors["conv_bias"], self.activation, self.phi, self.phi_params(tensors), self.phi_scalar)

    def phi_params(self, tensors: dict) -> list:
        return [t for t in (tensors["phi_weight"], tensors["phi_bias"]) if t is not None]


def output_and_grads(fn, case: Case, tensors: dict, grad_out: torch.Tensor):
    """fn(*args) and the gradients of every present tensor for the upstream gradient ``grad_out``."""
    out = fn(*case.args(tensors))
    names = [n for n, t in tensors.items() if t is not None]
    grads = torch.autograd.grad(out, [tensors[n] for n in names], grad_out.to(out.dtype))
    return out, dict(zip(names, grads))


def check_against_reference(fn, case: Case, tol: float, dtype=torch.float32, device="cpu") -> None:
    """``fn``'s output and every gradient vs the float64 reference, relative error <= tol."""
    tensors = case.tensors(dtype, device)
    reference_tensors = {n: t.detach().double().cpu().requires_grad_() if t is not None else None
                         for n, t in tensors.items()}
    grad_out = torch.randn(case.B, case.T, case.out_width, dtype=torch.float64)
    out, grads = output_and_grads(fn, case, tensors, grad_out.to(device))
    ref_out, ref_grads = output_and_grads(qk_preprocess_reference, case, reference_tensors, grad_out)
    assert_close("out", out.cpu(), ref_out, tol)
    assert set(grads) == set(ref_grads)
    for name in ref_grads:
        assert_close(f"d{name}", grads[name].cpu(), ref_grads[name], tol)


def detached(args: tuple) -> tuple:
    """The op's arguments with every tensor (also inside phi_params) detached."""
    return tuple([t.detach() for t in a] if isinstance(a, list) else a.detach() if isinstance(a, torch.Tensor) else a
                 for a in args)
