"""The Triton kernels (under TRITON_INTERPRET=1 on CPU, for real on CUDA) vs the plain reference."""

import pytest
import torch

from hecate.lowering.dispatch import triton_on_cpu
from hecate.lowering.qk_preprocess import kernels
from hecate.lowering.qk_preprocess.naive import ACTIVATIONS, ELEMENTWISE_PHI, qk_preprocess_reference
from hecate.testing import assert_close, bf16_dot_in_interpreter, poisoned

from qk_preprocess_cases import Case, check_against_reference, detached

OP = torch.ops.hecate.qk_preprocess.default
FP32_TOL = 1e-5


def triton_op(*args):
    with triton_on_cpu():
        return OP(*args)


# Multi-block in T and in D (interpreter tiles are 16 x 16): T = 29 rows, D = 17 channels, K = 3.
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("phi", ELEMENTWISE_PHI)
def test_every_activation_and_phi(activation, phi):
    check_against_reference(triton_op, Case(B=2, T=29, D_in=20, D=17, K=3, activation=activation, phi=phi),
                            FP32_TOL)


@pytest.mark.parametrize("case", [
    Case(B=1, T=2, D_in=3, D=10, K=4),                                   # T < K
    Case(B=1, T=1, D_in=4, D=6, K=4, phi="relu2"),                       # T = 1
    Case(B=2, T=7, D=6, K=4, proj=False, proj_bias=False),               # chain starts at the conv
    Case(B=2, T=33, D=10, K=4, proj=False, proj_bias=False, conv_bias=False, phi="exp"),  # 3 T blocks
    Case(B=2, T=21, D_in=7, D=6, K=2, proj_bias=False, activation="none", phi="relu"),
    Case(B=1, T=18, D_in=33, D=10, K=4, conv_bias=False, phi="identity"),  # D_in over two BLOCK_K steps
    Case(B=2, T=19, D_in=7, D=12, K=4, phi="linear", head_dim=6, d_phi=5),  # 2 heads, Dh and d_phi odd
    Case(B=1, T=5, D=16, K=3, proj=False, proj_bias=False, activation="none", phi="linear", head_dim=16,
         d_phi=20),                                                       # one head, d_phi over two chunks
    Case(B=2, T=19, D_in=7, D=12, K=4, phi="random_fourier", head_dim=6, d_phi=5),
    Case(B=1, T=17, D=16, K=3, proj=False, proj_bias=False, phi="random_fourier", head_dim=16, d_phi=20),
    Case(B=2, T=19, D_in=7, D=12, K=4, phi="performer", head_dim=6, d_phi=5),
    Case(B=1, T=17, D=16, K=3, proj=False, proj_bias=False, activation="none", phi="performer", head_dim=16,
         d_phi=20),
], ids=["T<K", "T=1", "no-proj", "no-bias-3-blocks", "K=2-no-proj-bias", "D_in=33-no-conv-bias",
        "linear-phi-2-heads", "linear-phi-1-head-no-proj", "random-fourier-2-heads", "random-fourier-1-head-no-proj",
        "performer-2-heads", "performer-1-head-no-proj"])
def test_shapes_and_optional_tensors(case):
    check_against_reference(triton_op, case, FP32_TOL)


def test_only_requested_gradients():
    """Gradients for x alone (weights frozen): the kernel skips dW; autograd gets None for the rest."""
    case = Case(B=1, T=9, D_in=5, D=6, K=4)
    t = case.tensors()
    for name in ("proj_weight", "proj_bias", "conv_weight", "conv_bias"):
        t[name].requires_grad_(False)
    grad_out = torch.randn(1, 9, 6)
    with triton_on_cpu():
        (dx,) = torch.autograd.grad(OP(*case.args(t)), [t["x"]], grad_out)
    x_ref = t["x"].detach().double().requires_grad_()
    ref = qk_preprocess_reference(x_ref, *[v.detach().double() for v in list(t.values())[1:5]], case.activation,
                                  case.phi, [], case.phi_scalar)
    (dx_ref,) = torch.autograd.grad(ref, [x_ref], grad_out.double())
    assert_close("dx", dx, dx_ref, FP32_TOL)


@pytest.mark.parametrize("case", [Case(B=2, T=19, D_in=7, D=17, K=4),
                                  Case(B=2, T=19, D_in=7, D=12, K=4, phi="random_fourier", head_dim=6, d_phi=5)],
                         ids=["elu1", "random-fourier-phi"])
def test_kernels_write_every_output_element(case):
    """NaN-filled output buffers: every element the kernels own must be written."""
    t = {n: v.detach() if v is not None else None for n, v in case.tensors().items()}
    phi_params = case.phi_params(t)
    args = (t["x"], t["proj_weight"], t["proj_bias"], t["conv_weight"], t["conv_bias"], case.activation, case.phi,
            phi_params, case.phi_scalar)
    out = poisoned(case.B, case.T, case.out_width)
    kernels.launch_forward(out, *args)
    assert_close("out", out, qk_preprocess_reference(*args), FP32_TOL)

    n_partial = case.B * kernels.backward_row_blocks(case.T, case.K)
    du, dcw_partial, dcb_partial = (poisoned(case.B, case.T, case.D), poisoned(n_partial, case.K, case.D),
                                    poisoned(n_partial, case.D))
    matrix = case.phi == "random_fourier"
    n_head_partial = n_partial * case.D // max(case.head_dim, 1)
    dphi_partial = poisoned(n_head_partial, case.d_phi, case.head_dim) if matrix else None
    dphib_partial = poisoned(n_head_partial, case.d_phi) if matrix else None
    grad_out = torch.randn(case.B, case.T, case.out_width)
    kernels.launch_backward_conv(du, dcw_partial, dcb_partial, dphi_partial, dphib_partial, grad_out, *args)
    u = torch.nn.functional.linear(t["x"], t["proj_weight"], t["proj_bias"]).requires_grad_()
    leaves = [u, t["conv_weight"].clone().requires_grad_(), t["conv_bias"].clone().requires_grad_()]
    leaves += [p.clone().requires_grad_() for p in phi_params]
    ref = qk_preprocess_reference(u, None, None, leaves[1], leaves[2], case.activation, case.phi, leaves[3:],
                                  case.phi_scalar)
    ref_grads = torch.autograd.grad(ref, leaves, grad_out)
    assert_close("du", du, ref_grads[0], FP32_TOL)
    assert_close("dconv_weight", dcw_partial.sum(0).t().unsqueeze(1), ref_grads[1], FP32_TOL)
    assert_close("dconv_bias", dcb_partial.sum(0), ref_grads[2], FP32_TOL)
    if matrix:
        assert_close("dphi_weight", dphi_partial.sum(0), ref_grads[3], FP32_TOL)
        assert_close("dphi_bias", dphib_partial.sum(0), ref_grads[4], FP32_TOL)


def test_non_contiguous_inputs():
    case = Case(B=2, T=9, D_in=5, D=6, K=3)
    t = {n: v.detach() for n, v in case.tensors().items() if v is not None}
    x_t = t["x"].transpose(0, 1).contiguous().transpose(0, 1)               # same values, other strides
    w_t = t["proj_weight"].t().contiguous().t()
    assert not x_t.is_contiguous() and not w_t.is_contiguous()
    got = triton_op(x_t, w_t, t["proj_bias"], t["conv_weight"], t["conv_bias"], case.activation, case.phi, [],
                    case.phi_scalar)
    assert_close("out", got, qk_preprocess_reference(*case.args({**t, "phi_weight": None, "phi_bias": None})), FP32_TOL)


@pytest.mark.parametrize("case", [Case(B=1, T=5, D_in=4, D=6, K=3),
                                  Case(B=1, T=5, D_in=4, D=6, K=3, phi="random_fourier", head_dim=3, d_phi=4)],
                         ids=["elu1", "random-fourier-phi"])
def test_opcheck_triton_path(case):
    args = case.args(case.tensors())
    with triton_on_cpu():
        torch.library.opcheck(OP, args)
        grad_out = torch.randn(1, 5, case.out_width)
        torch.library.opcheck(torch.ops.hecate.qk_preprocess_backward.default,
                              (grad_out, *detached(args),
                               [True, True, False, True, True, True, False, False]))


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 4e-2), (torch.float16, 2e-2)], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", [
    Case(B=2, T=29, D_in=20, D=17, K=3, phi="elu1"),
    Case(B=2, T=19, D=12, K=4, proj=False, proj_bias=False, phi="exp"),
    Case(B=2, T=19, D_in=7, D=12, K=4, phi="linear", head_dim=6, d_phi=5),
    Case(B=1, T=17, D_in=20, D=16, K=3, phi="random_fourier", head_dim=16, d_phi=20),
    Case(B=2, T=19, D_in=7, D=12, K=4, activation="none", phi="performer", head_dim=6, d_phi=5),
], ids=["elu1", "exp-no-proj", "linear-phi", "random-fourier-phi", "performer-phi"])
def test_half_precision_kernels_on_cpu(case, dtype, tol):
    """The kernels' bf16/fp16 code (half loads, the projection's half tl.dot with fp32 accumulation, casts and half
    stores) under the interpreter, whose bf16 dot is made to read its operands as the GPU does. (The upstream
    gradient reaches the op rounded to bf16: the Performer's cancelling conv-bias sum needs the looser bf16
    tolerance.)"""
    with bf16_dot_in_interpreter():
        check_against_reference(triton_op, case, tol, dtype=dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("phi", ["elu1", "exp", "linear", "random_fourier", "performer"])
def test_half_precision_on_cuda(dtype, phi):
    """bf16/fp16 inputs, fp32 accumulation inside the kernels: close to the float64 reference."""
    case = Case(B=2, T=300, D_in=96, D=128, K=4, phi=phi, head_dim=64, d_phi=80)
    check_against_reference(OP, case, 2e-2, dtype=dtype, device="cuda")


@pytest.mark.cuda
def test_fp32_on_cuda_large():
    check_against_reference(OP, Case(B=2, T=517, D_in=256, D=200, K=4), 1e-5, device="cuda")
