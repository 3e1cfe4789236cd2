"""Streaming: qk_preprocess reads a carried conv state (the K-1 projected inputs before the chunk) and
next_conv_state gives the state after it, so a sequence processed in chunks equals the whole sequence, forward
and gradients (those of the first chunk's state included), on both paths."""

import contextlib

import pytest
import torch

from hecate.lowering.dispatch import triton_on_cpu
from hecate.lowering.qk_preprocess import kernels
from hecate.lowering.qk_preprocess.naive import qk_preprocess_reference
from hecate.lowering.qk_preprocess.op import next_conv_state
from hecate.testing import assert_close, poisoned

from qk_preprocess_cases import Case, detached

OP = torch.ops.hecate.qk_preprocess.default
PATHS = {"aten": (contextlib.nullcontext, torch.float64, 1e-12), "triton": (triton_on_cpu, torch.float32, 1e-5)}
FP32_TOL = 1e-5


def _chunked(case: Case, tensors: dict, state: torch.Tensor, bounds) -> tuple[torch.Tensor, torch.Tensor]:
    """The op over x[:, bounds[i]:bounds[i+1]], carrying the conv state; (outputs concatenated, final state)."""
    outs = []
    args = list(case.args(tensors))
    for start, stop in zip(bounds[:-1], bounds[1:]):
        chunk = tensors["x"][:, start:stop]
        outs.append(OP(chunk, *args[1:], state))
        state = next_conv_state(chunk, tensors["proj_weight"], tensors["proj_bias"], tensors["conv_weight"], state)
    return torch.cat(outs, 1), state


def _whole(case: Case, tensors: dict, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference on [the state's inputs; x]: the state is the projected inputs, so they enter after the
    projection, which the reference applies to x only."""
    x, w, b = tensors["x"], tensors["proj_weight"], tensors["proj_bias"]
    u = torch.nn.functional.linear(x, w, b) if w is not None else x
    context = torch.cat([state, u], 1)
    out = qk_preprocess_reference(context, None, None, tensors["conv_weight"], tensors["conv_bias"], case.activation,
                                  case.phi, case.phi_params(tensors), case.phi_scalar)
    return out[:, state.shape[1]:], context[:, context.shape[1] - state.shape[1]:]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case, bounds", [
    (Case(B=2, T=11, D_in=5, D=6, K=4), (0, 2, 7, 11)),                   # a chunk shorter than K-1
    (Case(B=2, T=9, D=6, K=3, proj=False, proj_bias=False, phi="exp"), (0, 4, 9)),
    (Case(B=1, T=8, D_in=4, D=6, K=4, phi="random_fourier", head_dim=3, d_phi=5), (0, 1, 5, 8)),
], ids=["proj-elu1", "no-proj-exp", "random-fourier"])
def test_chunks_carrying_the_conv_state_equal_the_whole_sequence(case, bounds, path):
    context, dtype, tol = PATHS[path]
    tensors = case.tensors(dtype)
    state = (torch.randn(case.B, case.K - 1, case.D, dtype=torch.float64) * 0.5).to(dtype).requires_grad_()
    reference = {n: t.detach().double().requires_grad_() if t is not None else None for n, t in tensors.items()}
    reference_state = state.detach().double().requires_grad_()
    with context():
        out, final = _chunked(case, tensors, state, bounds)
    ref_out, ref_final = _whole(case, reference, reference_state)
    assert_close("out", out, ref_out, tol)
    assert_close("final state", final, ref_final, tol)
    cot_out, cot_final = torch.randn_like(ref_out), torch.randn_like(ref_final)
    leaves = [t for t in tensors.values() if t is not None] + [state]
    reference_leaves = [t for t in reference.values() if t is not None] + [reference_state]
    with context():
        grads = torch.autograd.grad((out * cot_out.to(dtype)).sum() + (final * cot_final.to(dtype)).sum(), leaves)
    grads_ref = torch.autograd.grad((ref_out * cot_out).sum() + (ref_final * cot_final).sum(), reference_leaves)
    names = [n for n, t in tensors.items() if t is not None] + ["conv_state"]
    for name, g, g_ref in zip(names, grads, grads_ref):
        assert_close(f"d{name}", g, g_ref, tol)


# interpreter tiles: 16 rows (the backward owns 16 − 2(K−1) of them), 16 channels
@pytest.mark.parametrize("case", [
    Case(B=3, T=19, D_in=7, D=17, K=4),                                   # 2 D blocks, 2 backward T blocks
    Case(B=2, T=2, D=10, K=5, proj=False, proj_bias=False, conv_bias=False, phi="relu2"),   # T < K−1
    Case(B=1, T=11, D_in=5, D=12, K=3, activation="none", phi="performer", head_dim=6, d_phi=5),
], ids=["proj-elu1-odd", "T<K-1-no-proj", "performer-2-heads"])
def test_triton_kernels_with_a_state_write_every_output_element(case):
    """NaN-filled buffers, the Triton kernels on a carried state: the output, du, the conv's partial sums and the
    state's gradient are all written and equal the reference on [state; u] (x's outputs, its gradients)."""
    t = {n: v.detach() if v is not None else None for n, v in case.tensors().items()}
    state = torch.randn(case.B, case.K - 1, case.D)
    phi_params = case.phi_params(t)
    args = (t["x"], t["proj_weight"], t["proj_bias"], t["conv_weight"], t["conv_bias"], case.activation, case.phi,
            phi_params, case.phi_scalar)
    out = poisoned(case.B, case.T, case.out_width)
    kernels.launch_forward(out, *args, state)

    n_partial = case.B * kernels.backward_row_blocks(case.T, case.K)
    du, dcw_partial, dstate = poisoned(case.B, case.T, case.D), poisoned(n_partial, case.K, case.D), \
        poisoned(case.B, case.K - 1, case.D)
    dcb_partial = poisoned(n_partial, case.D) if case.conv_bias else None
    grad_out = torch.randn(case.B, case.T, case.out_width)
    kernels.launch_backward_conv(du, dcw_partial, dcb_partial, None, None, grad_out, *args, state, dstate)

    u = (torch.nn.functional.linear(t["x"], t["proj_weight"], t["proj_bias"]) if case.proj else t["x"]).double()
    leaves = [u.requires_grad_(), state.double().requires_grad_(), t["conv_weight"].double().requires_grad_()]
    leaves += [t["conv_bias"].double().requires_grad_()] if case.conv_bias else []
    ref = qk_preprocess_reference(torch.cat(leaves[:2][::-1], 1), None, None, leaves[2],
                                  leaves[3] if case.conv_bias else None, case.activation, case.phi,
                                  [p.double() for p in phi_params], case.phi_scalar)[:, case.K - 1:]
    ref_grads = torch.autograd.grad(ref, leaves, grad_out.double())
    assert_close("out", out, ref, FP32_TOL)
    assert_close("du", du, ref_grads[0], FP32_TOL)
    assert_close("dconv_state", dstate, ref_grads[1], FP32_TOL)
    assert_close("dconv_weight", dcw_partial.sum(0).t().unsqueeze(1), ref_grads[2], FP32_TOL)
    if case.conv_bias:
        assert_close("dconv_bias", dcb_partial.sum(0), ref_grads[3], FP32_TOL)


@pytest.mark.parametrize("path", PATHS)
def test_opcheck_with_conv_state(path):
    context = PATHS[path][0]
    case = Case(B=1, T=5, D_in=4, D=6, K=3)
    args = case.args(case.tensors())
    state = torch.randn(1, 2, 6, requires_grad=True)
    with context():
        torch.library.opcheck(OP, (*args, state))
        torch.library.opcheck(torch.ops.hecate.qk_preprocess_backward.default,
                              (torch.randn(1, 5, 6), *detached(args), [True] * 8, state.detach()))


def test_bad_conv_state_is_refused():
    case = Case(B=2, T=5, D_in=4, D=6, K=3)
    with pytest.raises(ValueError, match=r"conv_state must be \[B, K-1, D\] = \[2, 2, 6\].*got shape \(2, 3, 6\)"):
        OP(*detached(case.args(case.tensors())), torch.zeros(2, 3, 6))


class StatefulCall(torch.nn.Module):
    """A decode-style step: the op with a carried conv state, and the state after the chunk."""

    def __init__(self, case: Case):
        super().__init__()
        self.case = case
        tensors = case.tensors()
        self.weights = torch.nn.ParameterDict({n: torch.nn.Parameter(t.detach()) for n, t in tensors.items()
                                               if t is not None and n != "x"})

    def forward(self, x, state):
        tensors = {"x": x, **{n: self.weights[n] if n in self.weights else None
                              for n in ("proj_weight", "proj_bias", "conv_weight", "conv_bias", "phi_weight",
                                        "phi_bias")}}
        out = OP(*self.case.args(tensors), state)
        return out, next_conv_state(x, tensors["proj_weight"], tensors["proj_bias"], tensors["conv_weight"], state)


@pytest.mark.parametrize("case", [Case(B=2, T=3, D_in=5, D=6, K=4), Case(B=2, T=1, D=6, K=3, proj=False,
                                                                          proj_bias=False, phi="relu")],
                         ids=["proj-elu1-T3", "no-proj-relu-T1"])
def test_onnx_export_with_conv_state_matches(case, tmp_path):
    import onnxruntime

    import hecate

    model = StatefulCall(case).eval()
    x, state = torch.randn(case.B, case.T, case.D_in if case.proj else case.D), torch.randn(case.B, case.K - 1, case.D)
    path = tmp_path / "qk_state.onnx"
    hecate.export_onnx(model, (x, state), path)
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = session.run(None, {i.name: a.numpy() for i, a in zip(session.get_inputs(), (x, state))})
    for name, g, e in zip(("out", "next state"), got, model(x, state)):
        assert_close(name, torch.from_numpy(g), e, 1e-5)


def test_mlir_export_with_conv_state_has_no_hecate_op():
    import hecate

    case = Case(B=2, T=3, D_in=5, D=6, K=4)
    text = hecate.export_mlir(StatefulCall(case), (torch.randn(2, 3, 5), torch.randn(2, 3, 6)),
                              output_type="linalg-on-tensors")
    assert "func.func @main" in text and "hecate" not in text
