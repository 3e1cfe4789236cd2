"""Faithful numerics on both paths (CPU loop, Triton): NaN and ±inf in k, v, q come out where they come out of
the plain loop; float64 is computed in float64."""

from __future__ import annotations

import contextlib

import pytest
import torch

import hecate.lowering  # noqa: F401
from hecate.lowering.dispatch import triton_on_cpu
from hecate.lowering.memory_scan.naive import memory_scan_naive
from hecate.testing import assert_close, assert_close_nonfinite

from memory_scan_cases import GRAD_NAMES, Case, grads_of, make_inputs

PATHS = {"cpu": contextlib.nullcontext, "triton": triton_on_cpu}
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's numpy
POISONS = {"nan": float("nan"), "inf": float("inf"), "-inf": -float("inf")}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("case", [Case("p2"), Case("p2.5_momentum", p=2.5, momentum=0.5),
                                  Case("moneta_p3_q4", p=3.0, q_norm=4.0)], ids=lambda c: c.name)
def test_poisoned_inputs_propagate_as_in_the_loop(case, poison, path):
    inputs = list(make_inputs(case, dtype=torch.float32, B=2))
    with torch.no_grad():   # batch 0 only: one key, one value, one query entry, at different tokens
        inputs[0][0, 2, 1, 3] = POISONS[poison]
        inputs[1][0, 4, 0, 1] = POISONS[poison]
        inputs[2][0, 5, 1, 0] = POISONS[poison]
    reference_inputs = [x.detach().double().requires_grad_() if isinstance(x, torch.Tensor) else x for x in inputs]
    y_ref, m_ref = memory_scan_naive(*reference_inputs, *case.scalars())[:2]
    dy, dm = torch.randn_like(y_ref), torch.randn_like(m_ref)
    def op(*x):
        return torch.ops.hecate.memory_scan(*x, *case.scalars())[:2]

    with PATHS[path]():
        y, m, grads = grads_of(op, inputs, dy, dm)
    assert not torch.isfinite(y[0]).all() and torch.isfinite(y[1]).all()   # reached the output; batch 1 kept
    assert_close_nonfinite("y", y, y_ref, 1e-5)
    assert_close_nonfinite("m_final", m, m_ref, 1e-5)
    if poison == "nan":
        _, _, grads_ref = grads_of(lambda *x: memory_scan_naive(*x, *case.scalars()), reference_inputs, dy, dm)
    elif path == "triton":
        # with ±inf inputs the hand-written reverse loop meets inf·0 where autograd's does not (both are
        # undefined there): the kernels' gradients are held to the CPU path's
        _, _, grads_ref = grads_of(op, [x.detach().requires_grad_() if isinstance(x, torch.Tensor) else x
                                        for x in inputs], dy, dm)
    else:
        return
    for name, g, g_ref in zip(GRAD_NAMES, grads, grads_ref):
        assert_close_nonfinite(name, g, g_ref, 1e-5)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", [Case("p2.5_momentum", p=2.5, momentum=0.5), Case("moneta_p3_q4", p=3.0, q_norm=4.0)],
                         ids=lambda c: c.name)
def test_float64_is_computed_in_float64(case, path):
    """The kernels accumulate in fp32, so the Triton path routes float64 to the CPU loop."""
    inputs = make_inputs(case)
    y_ref, m_ref = memory_scan_naive(*inputs, *case.scalars())[:2]
    dy, dm = torch.randn_like(y_ref), torch.randn_like(m_ref)
    with PATHS[path]():
        y, m, grads = grads_of(lambda *x: torch.ops.hecate.memory_scan(*x, *case.scalars())[:2], inputs, dy, dm)
    _, _, grads_ref = grads_of(lambda *x: memory_scan_naive(*x, *case.scalars()), inputs, dy, dm)
    assert y.dtype == m.dtype == torch.float64
    assert_close("y", y, y_ref, 1e-12)
    assert_close("m_final", m, m_ref, 1e-12)
    for name, g, g_ref in zip(GRAD_NAMES, grads, grads_ref):
        assert_close(name, g, g_ref, 1e-11)


@pytest.mark.parametrize("path", PATHS)
def test_autocast_casts_k_v_q_and_keeps_the_state_fp32(path):
    """Under autocast eager's matmuls read k, v, q in the autocast dtype and the read y leaves in it, while the
    state stays fp32: the op is the op on k, v, q cast to that dtype, with the gates and m0 as given."""
    case = Case("p2.5_momentum", p=2.5, momentum=0.5)
    k, v, q, alpha, eta, m0, _ = [x.detach().float() if isinstance(x, torch.Tensor) else x
                                  for x in make_inputs(case)]
    dtype = torch.bfloat16
    with PATHS[path]():
        with torch.autocast("cpu", dtype):
            y, m = torch.ops.hecate.memory_scan(k, v, q, alpha, eta, m0, None, *case.scalars())[:2]
        y_cast, m_cast = torch.ops.hecate.memory_scan(k.to(dtype), v.to(dtype), q.to(dtype), alpha, eta, m0, None,
                                                      *case.scalars())[:2]
    assert y.dtype == dtype and m.dtype == torch.float32
    assert torch.equal(y, y_cast) and torch.equal(m, m_cast)
