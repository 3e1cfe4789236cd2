"""The op itself: CPU path vs reference, opcheck, input validation, the Inductor CPU decomposition."""

import pytest
import torch
from torch._inductor.decomposition import decompositions as inductor_decompositions
from torch._inductor.utils import run_and_get_code

from hecate.lowering.dispatch import triton_on_cpu
from hecate.lowering.qk_preprocess.naive import ACTIVATIONS, ELEMENTWISE_PHI
from hecate.testing import assert_close

from qk_preprocess_cases import Case, check_against_reference, detached

OP = torch.ops.hecate.qk_preprocess.default
BACKWARD_OP = torch.ops.hecate.qk_preprocess_backward.default


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("phi", ELEMENTWISE_PHI)
def test_cpu_path_matches_reference_float64(activation, phi):
    check_against_reference(OP, Case(B=2, T=11, D_in=5, D=6, K=4, activation=activation, phi=phi), 1e-12,
                            dtype=torch.float64)


@pytest.mark.parametrize("case", [
    Case(B=1, T=2, D_in=3, D=10, K=4),
    Case(B=2, T=7, D=6, K=3, proj=False, proj_bias=False, conv_bias=False, phi="exp"),
    Case(B=2, T=9, D_in=4, D=5, K=2, proj_bias=False, activation="none", phi="relu"),
    Case(B=2, T=9, D_in=4, D=6, K=4, phi="linear", head_dim=3, d_phi=5),
    Case(B=2, T=9, D_in=4, D=6, K=4, phi="random_fourier", head_dim=3, d_phi=5),
    Case(B=2, T=9, D=6, K=3, proj=False, proj_bias=False, phi="performer", head_dim=6, d_phi=7),
], ids=["T<K", "no-proj-no-bias", "K=2-no-proj-bias", "linear-phi", "random-fourier-phi", "performer-phi"])
def test_cpu_path_shapes_and_optional_tensors(case):
    check_against_reference(OP, case, 1e-12, dtype=torch.float64)


@pytest.mark.parametrize("case", [Case(B=2, T=6, D_in=5, D=6, K=4, phi="exp"),
                                  Case(B=1, T=3, D=4, K=4, proj=False, proj_bias=False, conv_bias=False),
                                  Case(B=1, T=4, D_in=3, D=4, K=2, phi="linear", head_dim=2, d_phi=3),
                                  Case(B=1, T=4, D_in=3, D=4, K=2, phi="random_fourier", head_dim=2, d_phi=3),
                                  Case(B=1, T=4, D_in=3, D=4, K=2, phi="performer", head_dim=4, d_phi=3)],
                         ids=["full-chain", "conv-only", "linear-phi", "random-fourier-phi", "performer-phi"])
def test_opcheck_cpu_path(case):
    args = case.args(case.tensors())
    torch.library.opcheck(OP, args)
    grad_out = torch.randn(case.B, case.T, case.out_width)
    plain = detached(args)
    torch.library.opcheck(BACKWARD_OP, (grad_out, *plain, [True] * 8))
    torch.library.opcheck(BACKWARD_OP, (grad_out, *plain, [False, True, False, True, False, True, False, False]))


def _valid():
    return dict(x=torch.randn(2, 5, 4), proj_weight=torch.randn(6, 4), proj_bias=torch.randn(6),
                conv_weight=torch.randn(6, 1, 3), conv_bias=torch.randn(6), activation="silu", phi="elu1",
                phi_params=[], phi_scalar=10.0)


@pytest.mark.parametrize("change, message", [
    (dict(x=torch.randn(5, 4)), r"x must be \[B, T, D_in\] \(3-D\), got shape \(5, 4\)"),
    (dict(x=torch.randint(0, 3, (2, 5, 4))), r"x must be a floating-point tensor, got dtype torch.int64"),
    (dict(proj_weight=torch.randn(6, 5)), r"proj_weight must be \[D, D_in\] = \[D, 4\].*got shape \(6, 5\)"),
    (dict(proj_weight=torch.randn(7, 4)), r"proj_weight has 7 output channels but conv_weight has D=6"),
    (dict(conv_weight=torch.randn(6, 3)), r"conv_weight must be .*\[D, 1, K\], got shape \(6, 3\)"),
    (dict(conv_weight=torch.randn(6, 2, 3)), r"conv_weight must be .*\[D, 1, K\], got shape \(6, 2, 3\)"),
    (dict(proj_bias=torch.randn(5)), r"proj_bias must be \[D\] = \[6\], got shape \(5,\)"),
    (dict(conv_bias=torch.randn(6, 1)), r"conv_bias must be \[D\] = \[6\], got shape \(6, 1\)"),
    (dict(activation="gelu"), r"activation must be one of \['silu', 'none'\], got 'gelu'"),
    (dict(phi="softmax"),
     r"phi must be one of \['identity', 'elu1', 'relu', 'relu2', 'exp', 'linear', 'random_fourier', 'performer'\], "
     r"got 'softmax'"),
    (dict(phi="linear"), r"phi='linear' takes phi_params=\[W_phi \[d_phi, Dh\]\], got shapes \[\]"),
    (dict(phi="random_fourier", phi_params=[torch.randn(5, 3)]),
     r"phi='random_fourier' takes phi_params=\[W_phi \[d_phi, Dh\], b_phi \[d_phi\]\], got shapes \[\(5, 3\)\]"),
    (dict(phi="random_fourier", phi_params=[torch.randn(5, 3), torch.randn(4)]),
     r"b_phi must be \[d_phi\] = \[5\], got shape \(4,\)"),
    (dict(phi="linear", phi_params=[torch.randn(5, 4)]), r"Dh=4 must divide D=6"),
    (dict(phi="linear", phi_params=[torch.randn(5, 3, dtype=torch.float64)]),
     r"phi_params\[0\] has dtype torch.float64 but x has torch.float32"),
    (dict(phi_params=[torch.randn(3, 3)]), r"phi='elu1' is elementwise and takes no phi_params, got 1"),
    (dict(conv_weight=torch.randn(6, 1, 3, dtype=torch.float64)),
     r"conv_weight has dtype torch.float64 but x has torch.float32"),
    (dict(proj_weight=None), r"proj_bias was given without proj_weight"),
    (dict(proj_weight=None, proj_bias=None), r"without a projection x must be \[B, T, D\] with D=6.*\(2, 5, 4\)"),
])
def test_bad_inputs_raise_clear_errors(change, message):
    kwargs = {**_valid(), **change}
    with pytest.raises(ValueError, match=message):
        OP(*kwargs.values())
    with pytest.raises(ValueError, match=message):       # the fake (used at compile time) says the same
        with torch._subclasses.fake_tensor.FakeTensorMode(allow_non_fake_inputs=True):
            OP(*kwargs.values())


def test_backward_output_mask_length_is_checked():
    v = _valid()
    with pytest.raises(ValueError, match=r"output_mask must have 8 entries .* got 2"):
        BACKWARD_OP(torch.randn(2, 5, 6), *v.values(), [True, True])


class DirectCall(torch.nn.Module):
    """A tiny model that calls the fused op itself (no pass involved)."""

    def __init__(self, d_in=8, d=6, k=4, phi="elu1"):
        super().__init__()
        self.proj = torch.nn.Linear(d_in, d)
        self.conv = torch.nn.Conv1d(d, d, k, groups=d)
        self.phi = phi

    def forward(self, x):
        y = OP(x, self.proj.weight, self.proj.bias, self.conv.weight, self.conv.bias, "silu", self.phi, [], 10.0)
        return y * torch.tanh(x).sum(-1, keepdim=True)


def test_inductor_decomposition_declines_triton_path():
    """On CPU the decomposition yields ATen; under triton_on_cpu (as on CUDA) it declines."""
    args = tuple(_valid().values())
    assert isinstance(inductor_decompositions[OP](*args), torch.Tensor)
    with triton_on_cpu():
        assert inductor_decompositions[OP](*args) is NotImplemented
        assert inductor_decompositions[BACKWARD_OP](torch.randn(2, 5, 6), *args, [True] * 8) is NotImplemented


@pytest.mark.slow
def test_hecate_backend_trains_through_op_on_cpu_with_inductor(fresh_dynamo):
    """torch.compile(backend="hecate") with Inductor: forward and every gradient equal eager, and on CPU
    Inductor's code calls no hecate op (both ops were decomposed into ATen it fuses)."""
    model = DirectCall()
    x = torch.randn(2, 9, 8, requires_grad=True)
    compiled = torch.compile(model, backend="hecate")

    def step():
        out = compiled(x)
        out.square().sum().backward()
        return out

    out, codes = run_and_get_code(step)
    grads = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    model.zero_grad()
    x.grad = None
    ref = model(x)
    ref.square().sum().backward()
    ref_grads = [p.grad for p in model.parameters()] + [x.grad]
    assert_close("out", out, ref, 1e-5)
    for name, g, r in zip(["proj_weight", "proj_bias", "conv_weight", "conv_bias", "x"], grads, ref_grads):
        assert_close(f"d{name}", g, r, 1e-5)
    assert len(codes) == 2                                   # forward and backward graphs
    assert not any("torch.ops.hecate" in code for code in codes)


def test_decomposition_reaches_inductor_table_memoised_before_import():
    """Inductor memoises its decomposition table on first use; importing hecate later still adds ours."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import torch
        from torch._inductor.decomposition import select_decomp_table
        select_decomp_table()                   # memoised before hecate is imported
        import hecate.lowering
        table = select_decomp_table()
        assert torch.ops.hecate.qk_preprocess.default in table
        assert torch.ops.hecate.qk_preprocess_backward.default in table
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")
