"""Faithful numerics on both paths (ATen, Triton): NaN and ±inf in the input come out where they come out of
the plain chain; float64 is computed in float64."""

import contextlib

import pytest
import torch

from hecate.lowering.dispatch import triton_on_cpu
from hecate.lowering.qk_preprocess.naive import ELEMENTWISE_PHI, qk_preprocess_reference
from hecate.testing import assert_close, assert_close_nonfinite, bf16_dot_in_interpreter

from qk_preprocess_cases import Case, check_against_reference, output_and_grads

OP = torch.ops.hecate.qk_preprocess.default
PATHS = {"aten": contextlib.nullcontext, "triton": triton_on_cpu}
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's numpy


def _poison(x: torch.Tensor) -> None:
    """NaN, +inf and −inf at three tokens of batch 0 (batch 1 stays finite)."""
    with torch.no_grad():
        x[0, 1, 0] = float("nan")
        x[0, 4, 1] = float("inf")
        x[0, 8, 2] = -float("inf")


def _check(case: Case, path: str) -> None:
    tensors = case.tensors()
    _poison(tensors["x"])
    reference_tensors = {n: t.detach().double().requires_grad_() if t is not None else None
                         for n, t in tensors.items()}
    grad_out = torch.randn(case.B, case.T, case.out_width, dtype=torch.float64)
    with PATHS[path]():
        out, grads = output_and_grads(OP, case, tensors, grad_out)
    ref_out, ref_grads = output_and_grads(qk_preprocess_reference, case, reference_tensors, grad_out)
    assert out.isnan().any() and torch.isfinite(out[1]).all()        # the poison reached the output, batch 1 kept
    assert_close_nonfinite("out", out, ref_out, 1e-5)
    for name in ref_grads:
        assert_close_nonfinite(f"d{name}", grads[name], ref_grads[name], 1e-5)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("activation", ["silu", "none"])
@pytest.mark.parametrize("phi", ELEMENTWISE_PHI)
def test_elementwise_phi_without_projection(phi, activation, path):
    """The conv spreads each poisoned input over K tokens; SiLU and φ see ±inf and NaN themselves."""
    _check(Case(B=2, T=11, D=5, K=3, proj=False, proj_bias=False, activation=activation, phi=phi), path)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("phi", ["elu1", "linear", "random_fourier", "performer"])
def test_with_projection_and_matrix_phi(phi, path):
    _check(Case(B=2, T=11, D_in=4, D=6, K=4, phi=phi, head_dim=3, d_phi=5), path)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("phi", ["elu1", "exp", "random_fourier"])
def test_float64_is_computed_in_float64(phi, path):
    """The kernels accumulate in fp32, so the Triton path routes float64 to the ATen path."""
    def op(*args):
        with PATHS[path]():
            return OP(*args)

    check_against_reference(op, Case(B=2, T=9, D_in=5, D=6, K=4, phi=phi, head_dim=3, d_phi=4), 1e-12,
                            dtype=torch.float64)


def _autocast_case_inputs(case: Case, device: str = "cpu") -> tuple:
    return tuple([t.detach().to(device) for t in a] if isinstance(a, list)
                 else a.detach().to(device) if isinstance(a, torch.Tensor) else a for a in case.args(case.tensors()))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("phi", ["elu1", "performer"])
def test_autocast_returns_the_dtype_eager_returns(phi, path):
    """Under CPU bf16 autocast eager's linear and conv1d run in bf16, so the chain's result is bf16: the op
    casts its tensors to the autocast dtype too."""
    case = Case(B=2, T=9, D_in=5, D=6, K=4, phi=phi, head_dim=3, d_phi=4)
    args = _autocast_case_inputs(case)
    dtype = torch.bfloat16
    with torch.autocast("cpu", dtype):
        expected = qk_preprocess_reference(*args)
        with PATHS[path](), bf16_dot_in_interpreter():
            got = OP(*args)
    assert expected.dtype == dtype and got.dtype == dtype
    assert_close("out", got, qk_preprocess_reference(*[[t.to(dtype).double() for t in a] if isinstance(a, list) else
                                                      a.to(dtype).double() if isinstance(a, torch.Tensor) else a
                                                      for a in args]), 1e-2)


@pytest.mark.cuda
def test_autocast_cuda_float16():
    args = _autocast_case_inputs(Case(B=2, T=9, D_in=5, D=6, K=4), "cuda")
    with torch.autocast("cuda", torch.float16):
        expected, got = qk_preprocess_reference(*args), OP(*args)
    assert got.dtype == expected.dtype == torch.float16
    assert_close("out", got, expected, 1e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_gradients_accumulate_in_float32_on_the_aten_path(dtype):
    """The ATen path differentiates bf16/fp16 inputs in float32 (the kernels accumulate so): the projection bias's
    gradient sums B·T terms of K taps each, which bf16 sums rounded to 5e-2 (probe r31). Against float64 at the same
    half-precision inputs, every gradient is within half the dtype's epsilon (summed in the input dtype they were
    1.5–2× that: 5e-3 in bf16, 6e-4 in fp16)."""
    torch.manual_seed(0)
    case = Case(B=3, T=33, D_in=5, D=6, K=4, phi="elu1")
    tensors = {n: t.detach().to(dtype).requires_grad_() if t is not None else None
               for n, t in case.tensors().items()}
    reference_tensors = {n: t.detach().double().requires_grad_() if t is not None else None
                         for n, t in tensors.items()}
    grad_out = torch.randn(case.B, case.T, case.out_width, dtype=torch.float64)
    _, grads = output_and_grads(OP, case, tensors, grad_out.to(dtype))
    _, ref_grads = output_and_grads(qk_preprocess_reference, case, reference_tensors, grad_out)
    for name in ref_grads:
        assert grads[name].dtype == dtype, name
        assert_close(f"d{name}", grads[name].double(), ref_grads[name], torch.finfo(dtype).eps / 2)
