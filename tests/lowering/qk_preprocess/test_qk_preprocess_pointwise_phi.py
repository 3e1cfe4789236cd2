"""qk_preprocess with a φ the user wrote (a pointwise expression): the ATen path and the Triton kernels
(under the interpreter) against the chain computed plainly with the user's Python φ, forward and gradients."""

import onnxruntime
import pytest
import torch
import torch.nn.functional as F

import hecate
from hecate.lowering import pointwise
from hecate.lowering.dispatch import triton_on_cpu
from hecate.lowering.qk_preprocess.naive import qk_preprocess_reference
from hecate.testing import assert_close

from qk_preprocess_cases import Case, detached, output_and_grads

OP = torch.ops.hecate.qk_preprocess.default

PHIS = {
    "invented": lambda z: torch.sigmoid(z) * z + 0.5 * z.square(),
    "softplus": F.softplus,
    "relu_squared_written_as_pow": lambda z: F.relu(z) ** 2,
    "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"),
    "huber_like": lambda z: torch.where(z.abs() <= 0.3, z * z, 0.6 * z.abs() - 0.09),
}


def check(run, name: str, case: Case, tol: float) -> None:
    phi = PHIS[name]
    tensors = case.tensors()
    reference_tensors = {n: t.detach().double().requires_grad_() if t is not None else None
                         for n, t in tensors.items()}
    grad_out = torch.randn(case.B, case.T, case.D, dtype=torch.float64)
    expr_case = Case(**{**case.__dict__, "phi": pointwise.trace(phi)})
    identity_case = Case(**{**case.__dict__, "phi": "identity"})
    out, grads = output_and_grads(run, expr_case, tensors, grad_out)
    ref_out, ref_grads = output_and_grads(lambda *a: phi(qk_preprocess_reference(*a)), identity_case,
                                          reference_tensors, grad_out)
    assert_close(f"{name} out", out, ref_out, tol)
    for key in ref_grads:
        assert_close(f"{name} d{key}", grads[key], ref_grads[key], tol)


@pytest.mark.parametrize("name", PHIS)
def test_aten_path(name):
    check(OP, name, Case(B=2, T=7, D_in=5, D=6, K=4), 1e-5)


@pytest.mark.parametrize("name", PHIS)
def test_triton_kernels(name):
    def run(*args):
        with triton_on_cpu():
            return OP(*args)

    # T = 29, D = 17: several T and channel blocks of the interpreter's 16 × 16 tiles
    check(run, name, Case(B=2, T=29, D_in=20, D=17, K=3, conv_bias=name != "softplus"), 1e-5)


def test_triton_without_activation_or_projection():
    def run(*args):
        with triton_on_cpu():
            return OP(*args)

    check(run, "invented", Case(B=1, T=9, D=6, K=2, proj=False, proj_bias=False, activation="none"), 1e-5)


def test_opcheck():
    case = Case(B=1, T=5, D_in=4, D=6, K=3, phi=pointwise.trace(PHIS["invented"]))
    args = detached(case.args(case.tensors()))
    torch.library.opcheck(OP, args)
    with triton_on_cpu():
        torch.library.opcheck(OP, args, test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def test_a_malformed_phi_is_refused():
    case = Case(phi="cosh(x)")
    with pytest.raises(ValueError, match=r"qk_preprocess: phi must be one of \[.*\], got 'cosh\(x\)', which is "
                                         r"not a pointwise expression.*unknown operation 'cosh'"):
        OP(*detached(case.args(case.tensors())))


class Preprocess(torch.nn.Module):
    def __init__(self, phi: str):
        super().__init__()
        self.phi = phi

    def forward(self, x, proj_weight, conv_weight):
        return torch.ops.hecate.qk_preprocess(x, proj_weight, None, conv_weight, None, "silu", self.phi, [], 0.0)


def test_onnx_export(tmp_path):
    expr = pointwise.trace(PHIS["invented"])
    case = Case(B=2, T=7, D_in=5, D=6, K=4, proj_bias=False, conv_bias=False)
    t = case.tensors()
    args = (t["x"].detach(), t["proj_weight"].detach(), t["conv_weight"].detach())
    path = tmp_path / "phi.onnx"
    # batch and sequence dynamic on x only: the weights are inputs here, and their dim 0 is the channel
    # count, which the conv's group (and opset 27's CausalConvWithState) needs static
    x_dims = {0: torch.export.Dim.AUTO, 1: torch.export.Dim.AUTO}
    hecate.export_onnx(Preprocess(expr), args, path, dynamic_shapes=(x_dims, None, None))
    session = onnxruntime.InferenceSession(str(path))
    (got,) = session.run(None, {i.name: a.numpy() for i, a in zip(session.get_inputs(), args)})
    expected = PHIS["invented"](qk_preprocess_reference(args[0], args[1], None, args[2], None, "silu", "identity",
                                                         [], 0.0))
    assert_close("onnx", torch.from_numpy(got), expected, 1e-5)
