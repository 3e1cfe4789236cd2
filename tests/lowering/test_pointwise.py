"""hecate.lowering.pointwise: a user's elementwise function read from a graph, evaluated with torch,
generated into Triton (under TRITON_INTERPRET=1 here), differentiated by tracing autograd, written in ONNX."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.fx.experimental.proxy_tensor import make_fx

from hecate.lowering import pointwise
from hecate.testing import assert_close, poisoned

FP32_TOL = 1e-5

FUNCTIONS = {
    "invented": lambda z: torch.sigmoid(z) * z + 0.5 * z.square(),
    "softplus": F.softplus,
    "relu_squared": lambda z: F.relu(z) ** 2,
    "elu_plus_one": lambda z: F.elu(z) + 1,
    "gelu": F.gelu,
    "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"),
    "huber_gradient": lambda e: torch.where(e.abs() <= 1.0, e, torch.sign(e)),
    "p3_abs_sign": lambda e: 3 * e.abs() ** 2 * torch.sign(e),
    "clamped_exp": lambda z: torch.exp(torch.clamp(z, max=3.0)),
    "transcendental": lambda z: (torch.log1p(z.abs()) + torch.expm1(-z.abs()) + torch.tanh(z)
                                 + torch.cos(z) * torch.sin(z) + torch.rsqrt(1 + z * z) + torch.sqrt(z.abs() + 1)
                                 + 1 / (2 + z.abs())),
    "maximum_minimum": lambda z: torch.maximum(z, torch.tensor(0.25)) + torch.minimum(z, 2 * z) + z.clamp(-1, 1),
    "leaky_relu": F.leaky_relu,
    "silu": F.silu,
    "mish": F.mish,
    "hardswish": F.hardswish,
    "log_sigmoid": lambda z: F.logsigmoid(-2 * z),
    "identity": lambda z: z,
    "powers": lambda z: (z.abs() + 0.5) ** 1.7 + z ** 5 + 2 ** z - (z.abs() + 1) ** -2,
    "masked_fill": lambda z: z.masked_fill(z < -1, 0.0) * (z != 0.5),
}


def points(n: int = 301) -> torch.Tensor:
    """Random points plus the kinks and edges the functions have (0, ±1, clamp bounds, ties)."""
    x = torch.randn(n, dtype=torch.float64) * 3
    x[:8] = torch.tensor([0.0, 1.0, -1.0, 3.0, 0.25, 0.5, -2.0, 25.0], dtype=torch.float64)
    return x


def autograd_derivative(fn, x: torch.Tensor) -> torch.Tensor:
    x = x.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(fn(x).sum(), x)
    return grad


@triton.jit
def _apply_kernel(x_ptr, y_ptr, dy_ptr, n, FN: tl.constexpr, DFN: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
    tl.store(y_ptr + offsets, FN(x), mask=mask)
    tl.store(dy_ptr + offsets, DFN(x), mask=mask)


def triton_apply(expr: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """f(x) and f'(x) from the generated functions, in fp32, into NaN-poisoned outputs."""
    x = x.float().contiguous()
    y, dy = poisoned(*x.shape), poisoned(*x.shape)
    _apply_kernel[(triton.cdiv(x.numel(), 64),)](x, y, dy, x.numel(), FN=pointwise.triton_function(expr),
                                                 DFN=pointwise.triton_function(pointwise.derivative(expr)), BLOCK=64)
    return y, dy


@pytest.mark.parametrize("name", FUNCTIONS)
def test_evaluate_and_derivative_match_torch(name):
    fn = FUNCTIONS[name]
    expr = pointwise.trace(fn)
    x = points()
    assert_close(f"{name} f", pointwise.evaluate(expr, x), fn(x), 1e-12)
    assert_close(f"{name} f'", pointwise.evaluate(pointwise.derivative(expr), x), autograd_derivative(fn, x), 1e-12)


@pytest.mark.parametrize("name", FUNCTIONS)
def test_triton_function_and_derivative(name):
    fn = FUNCTIONS[name]
    expr = pointwise.trace(fn)
    x = points()
    y, dy = triton_apply(expr, x)
    assert_close(f"{name} f (triton)", y, fn(x), FP32_TOL)
    assert_close(f"{name} f' (triton)", dy, autograd_derivative(fn, x), FP32_TOL)


@pytest.mark.parametrize("name", FUNCTIONS)
def test_onnx_translation(name):
    fn = FUNCTIONS[name]
    expr = pointwise.trace(fn)
    x = points(41).float()
    got = pointwise.to_onnx(expr, x.numpy())        # onnxscript evaluates eagerly with onnxruntime
    assert_close(f"{name} (onnx)", torch.from_numpy(np.asarray(getattr(got, "value", got))), fn(x), FP32_TOL)


def test_nan_propagates_as_in_torch():
    x = torch.tensor([float("nan"), -1.0, 2.0])
    for name in ("relu_squared", "maximum_minimum", "clamped_exp", "softplus", "elu_plus_one", "transcendental"):
        expr = pointwise.trace(FUNCTIONS[name])
        y, _ = triton_apply(expr, x)
        assert torch.isnan(y[0]), f"{name}: NaN in, {y[0].item()} out (torch gives NaN)"
        assert torch.isnan(pointwise.evaluate(expr, x)[0]), name


def test_accurate_near_zero_and_at_infinity():
    """log1p / expm1 / tanh keep their accuracy near 0 and their limits at ±inf (written without libdevice)."""
    x = torch.tensor([1e-9, -3e-8, 1e-4, float("inf"), -float("inf"), 40.0, -40.0])
    for fn in (lambda z: torch.log1p(z.abs()), torch.expm1, torch.tanh):
        expr = pointwise.trace(fn)
        y, _ = triton_apply(expr, x)
        expected = fn(x)
        finite = torch.isfinite(expected)
        assert torch.equal(y[~finite], expected[~finite]), (expr, y, expected)
        rel = ((y[finite] - expected[finite]).abs() / expected[finite].abs()).max()
        assert rel <= 1e-6, (expr, y, expected)


def test_spellings_of_one_function_give_one_string():
    spellings = [F.silu, lambda z: z * torch.sigmoid(z), lambda z: torch.sigmoid(z) * z]
    assert len({pointwise.trace(s) for s in spellings}) == 1
    assert pointwise.trace(lambda z: z ** 2) != pointwise.trace(lambda z: z ** 3)


def test_string_round_trip_and_errors():
    expr = pointwise.trace(FUNCTIONS["invented"])
    assert pointwise.canonical(expr) == expr
    assert pointwise.canonical("x") == "x"
    with pytest.raises(ValueError, match="unknown operation 'cosh'"):
        pointwise.parse("cosh(x)")
    with pytest.raises(ValueError, match="refers to a later statement"):
        pointwise.parse("exp(%1);exp(x)")
    with pytest.raises(ValueError, match="non-empty string"):
        pointwise.parse("")


def test_extract_names_the_first_non_pointwise_op():
    def phi(z):
        return torch.exp(z - z.sum(-1, keepdim=True)) * 2

    gm = make_fx(phi)(torch.zeros(2, 3))
    nodes = list(gm.graph.nodes)
    output = nodes[-1].args[0]
    with pytest.raises(pointwise.NotPointwise, match="sum") as failure:
        pointwise.extract(nodes[0], output)
    assert failure.value.node.target == torch.ops.aten.sum.dim_IntList


def test_extract_rejects_another_tensor():
    gm = make_fx(lambda z, w: torch.exp(z) * w)(torch.zeros(3), torch.zeros(3))
    nodes = list(gm.graph.nodes)
    with pytest.raises(pointwise.NotPointwise, match="placeholder w"):
        pointwise.extract(nodes[0], nodes[-1].args[0])


def test_grow_stops_at_the_first_non_pointwise_op():
    def model(z):
        phi = torch.sigmoid(z) * z + 0.5 * z.square()
        return phi.sum(-1)

    gm = make_fx(model)(torch.zeros(2, 3))
    z = next(n for n in gm.graph.nodes if n.op == "placeholder")
    output, region = pointwise.grow(z)
    assert list(output.users)[0].target == torch.ops.aten.sum.dim_IntList
    assert pointwise.extract(z, output) == pointwise.trace(lambda t: torch.sigmoid(t) * t + 0.5 * t.square())
    assert output in region and all(n.op == "call_function" for n in region)


def test_grow_keeps_values_read_outside_inside_the_output():
    """exp(z) is also read by the sum: the region ending at the product cannot hide it, so it ends at exp."""
    def model(z):
        e = torch.exp(z)
        return e * 2, e.sum()

    gm = make_fx(model)(torch.zeros(3))
    z = next(n for n in gm.graph.nodes if n.op == "placeholder")
    output, region = pointwise.grow(z)
    assert output.target == torch.ops.aten.exp.default and region == [output]


def test_derivative_of_constant_and_identity():
    assert pointwise.derivative("x") == "1.0"
    assert pointwise.derivative("2.5") == "0.0"
    assert pointwise.evaluate("2.5", torch.zeros(3)).tolist() == [2.5] * 3
    y, dy = triton_apply("mul(3.0,x)", torch.arange(5.0))
    assert torch.equal(dy, torch.full((5,), 3.0)) and torch.equal(y, 3 * torch.arange(5.0))


def test_generated_source_is_cached_as_a_file(tmp_path, monkeypatch):
    monkeypatch.setenv("HECATE_CACHE_DIR", str(tmp_path))
    expr = "tanh(x);mul(0.5,%0)"
    pointwise.triton_function.cache_clear()
    fn = pointwise.triton_function(expr)
    files = list((tmp_path / "pointwise").glob("*.py"))
    assert len(files) == 1 and "def " + fn.__name__ in files[0].read_text()
    pointwise.triton_function.cache_clear()
    assert math.isfinite(float(triton_apply(expr, torch.ones(3))[0][0]))


@pytest.mark.parametrize("fn", [F.softplus, lambda x: F.softplus(x, beta=2.0, threshold=5.0),
                                lambda x: F.elu(x, alpha=0.5) + 1], ids=["softplus", "softplus_beta2", "elu_half"])
def test_derivative_of_a_branch_is_finite_where_the_other_branch_overflows(fn):
    """Autograd of where(x > 20, x, log1p(exp(x))) multiplies the branch not taken by its indicator, 0 · inf
    at x = 100; the derivative keeps that product inside the branch, and is torch's gradient there."""
    x = torch.tensor([-200.0, -90.0, -3.0, 0.0, 2.5, 30.0, 90.0, 100.0, 400.0], requires_grad=True)
    (expected,) = torch.autograd.grad(fn(x).sum(), x)
    got = pointwise.evaluate(pointwise.derivative(pointwise.trace(fn)), x.detach())
    assert torch.isfinite(got).all(), got
    assert_close("f'(x)", got, expected, 1e-6)
