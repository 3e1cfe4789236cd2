"""Faithful numerics on linear_attention's paths (CPU, Triton): NaN and ±inf in k, v, q come out where they
come out of the loop; float64 is computed in float64."""

from __future__ import annotations

import contextlib

import pytest
import torch

import hecate.lowering  # noqa: F401
from hecate.lowering.dispatch import triton_on_cpu
from hecate.lowering.linear_attention.naive import linear_attention_naive
from hecate.testing import assert_close, assert_close_nonfinite

from test_linear_attention import _grads, make_inputs

PATHS = {"cpu": contextlib.nullcontext, "triton": triton_on_cpu}
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's numpy


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("causal,normalize,path", [(True, True, "cpu"), (True, True, "triton"), (True, False, "triton"),
                                                   (False, True, "cpu")],   # non-causal: two matmuls, no kernel
                         ids=["causal_normalized-cpu", "causal_normalized-triton", "causal-triton",
                              "noncausal_normalized"])
def test_poisoned_inputs_propagate_as_in_the_loop(causal, normalize, path, poison):
    inputs = [x.detach().float() if x is not None else None
              for x in make_inputs(causal, normalize, causal, causal)]
    inputs[0][0, 2, 1, 3] = poison
    inputs[1][0, 4, 0, 1] = poison
    inputs[2][0, 5, 1, 0] = poison
    with PATHS[path]():
        outs = torch.ops.hecate.linear_attention(*inputs, normalize, 1e-6, causal)
    refs = linear_attention_naive(*[x.double() if x is not None else None for x in inputs], normalize, 1e-6, causal)
    assert not torch.isfinite(outs[0][0]).all() and torch.isfinite(outs[0][1]).all()
    for name, o, r in zip(("y", "m_final", "z_final"), outs, refs):
        assert_close_nonfinite(name, o, r, 1e-5)


@pytest.mark.parametrize("path", PATHS)
def test_float64_is_computed_in_float64(path):
    """The kernels accumulate in fp32, so the Triton path routes float64 to the CPU loop."""
    inputs = make_inputs(True, True, True, True)
    refs = linear_attention_naive(*inputs, True, 1e-6, True)
    cotangents = [torch.randn_like(r) for r in refs]
    with PATHS[path]():
        outs, grads = _grads(lambda *x: torch.ops.hecate.linear_attention(*x, True, 1e-6, True), inputs, cotangents)
    _, grads_ref = _grads(lambda *x: linear_attention_naive(*x, True, 1e-6, True), inputs, cotangents)
    for name, o, r in zip(("y", "m_final", "z_final"), outs, refs):
        assert o.dtype == torch.float64
        assert_close(name, o, r, 1e-12)
    for name, g, r in zip(("dk", "dv", "dq", "dalpha", "dm0", "dz0"), grads, grads_ref):
        assert_close(name, g, r, 1e-11)


@pytest.mark.parametrize("path", PATHS)
def test_autocast_casts_k_v_q_and_keeps_the_state_fp32(path):
    """Under autocast the op is the op on k, v, q cast to the autocast dtype, with α, m0, z0 as given."""
    k, v, q, alpha, m0, z0 = [x.detach().float() for x in make_inputs(True, True, True, True)]
    dtype = torch.bfloat16
    with PATHS[path]():
        with torch.autocast("cpu", dtype):
            outs = torch.ops.hecate.linear_attention(k, v, q, alpha, m0, z0, True, 1e-6, True)
        cast = torch.ops.hecate.linear_attention(k.to(dtype), v.to(dtype), q.to(dtype), alpha, m0, z0, True, 1e-6,
                                                 True)
    assert [o.dtype for o in outs] == [dtype, torch.float32, torch.float32]
    for name, o, c in zip(("y", "m_final", "z_final"), outs, cast):
        assert torch.equal(o, c), name
