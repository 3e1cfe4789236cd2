"""Inputs shared by the memory_scan tests: small, odd shapes (Dk = 5, Dv = 3, T = 7)."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    p: float = 2.0
    momentum: float = 0.0
    q_norm: float = 2.0
    fixed_gates: bool = False   # one α, η for every token and head (expanded), as a fixed-gate layer passes them
    with_m0: bool = True
    T: int = 7
    cu_seqlens: Optional[tuple[int, ...]] = None  # packed (B = 1); lengths may be 0

    def scalars(self):
        return (self.p, 10.0, 1e-6, self.momentum, self.q_norm)


CASES = [
    Case("p2"),
    Case("p1_fixed_gates", p=1.0, fixed_gates=True),
    Case("p3_no_m0", p=3.0, with_m0=False),
    Case("p2.5_momentum", p=2.5, momentum=0.6),
    Case("moneta_p3_q4", p=3.0, q_norm=4.0),
    Case("moneta_momentum", p=2.0, q_norm=4.0, momentum=0.5, fixed_gates=True),
    Case("T1", p=2.5, T=1),
    Case("varlen", p=2.5, momentum=0.3, cu_seqlens=(0, 3, 3, 7)),
]


def make_inputs(case: Case, dtype=torch.float64, B=2, H=2, Dk=5, Dv=3, unit_keys=False):
    """(k, v, q, alpha, eta, m0, cu_seqlens) with grads on the float tensors. ``unit_keys``: ‖k_t‖ = 1, as
    wide heads need (with ‖k‖ ≈ √Dk / 2 the p = 3 update diverges: Dk = 64, T = 300 overflows float64)."""
    T = case.T
    if case.cu_seqlens is not None:
        B = 1
        T = case.cu_seqlens[-1]
    n_states = B if case.cu_seqlens is None else len(case.cu_seqlens) - 1
    k = torch.randn(B, T, H, Dk, dtype=dtype) * 0.5
    if unit_keys:
        k = k / k.norm(dim=-1, keepdim=True)
    v = torch.randn(B, T, H, Dv, dtype=dtype)
    q = torch.randn(B, T, H, Dk, dtype=dtype)
    if case.fixed_gates:
        alpha = torch.full((B, T, H), 0.1, dtype=dtype)
        eta = torch.full((B, T, H), 0.15, dtype=dtype)
    else:  # data-dependent: sigmoid of a projection, as the layer computes them
        alpha = torch.sigmoid(torch.randn(B, T, H, dtype=dtype) - 2.0)
        eta = 0.3 * torch.sigmoid(torch.randn(B, T, H, dtype=dtype))
    m0 = torch.randn(n_states, H, Dv, Dk, dtype=dtype) * 0.3 if case.with_m0 else None
    tensors = [x.requires_grad_() if x is not None else None for x in (k, v, q, alpha, eta, m0)]
    cu = torch.tensor(case.cu_seqlens, dtype=torch.int32) if case.cu_seqlens is not None else None
    return (*tensors, cu)


def grads_of(fn, inputs, dy, dm):
    """Run fn(*inputs) -> (y, m_final) and return outputs plus grads of <y, dy> + <m, dm> wrt every float input."""
    y, m = fn(*inputs)[:2]
    wrt = [x for x in inputs[:6] if x is not None]
    grads = torch.autograd.grad((y * dy.to(y.dtype)).sum() + (m * dm.to(m.dtype)).sum(), wrt)
    return y, m, grads


GRAD_NAMES = ["dk", "dv", "dq", "dalpha", "deta", "dm0"]
