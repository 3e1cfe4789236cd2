"""A user's pointwise function of one tensor, carried into a fused op as a string.

Fused ops that apply a function the user wrote elementwise (φ in ``qk_preprocess``, the
bias gradient g(e) in ``memory_scan``) take it as one ``str`` argument, an *expression*:
the function's operations in SSA form, one statement per operation, ``;``-separated, the
last statement being the result::

    "sigmoid(x);mul(%0,x);mul(x,x);mul(0.5,%2);add(%1,%3)"   # sigmoid(z)·z + 0.5·z²

``x`` is the input, ``%i`` the result of statement i, numbers are literals (``inf``,
``nan`` included). The string is canonical for a function written the same way (operands
of commutative operations sorted, common subexpressions shared, constants folded), so equal
functions give equal strings and the op's caches hit. From it:

* :func:`extract` reads it out of an FX (ATen) graph, between an input node and an output
  node; :func:`grow` finds the largest pointwise region after a node; :func:`trace` reads it
  from a Python function. A non-pointwise operation raises :class:`NotPointwise` naming it.
* :func:`evaluate` computes it with torch (the ops' CPU path and their ATen decomposition).
* :func:`derivative` is f'(x) as another expression, obtained by tracing autograd of
  :func:`evaluate` (``make_fx`` of the vjp with ones), as FlexAttention does with ``score_mod``.
* :func:`triton_function` generates it as a ``@triton.jit`` function (written to a file in
  a cache dir and imported: ``triton.jit`` reads real source) that kernels take as a
  ``tl.constexpr`` argument and call on fp32 tiles.
* :func:`to_onnx` writes it with onnxscript ops.

The operations (the canonical language; composite ATen ops such as ``silu``, ``elu``,
``gelu``, ``softplus``, ``hardswish``, ``log_sigmoid``, ``leaky_relu``, ``clamp``, ``square``,
``masked_fill`` are written in it when read from a graph): add sub mul div pow neg exp log log1p expm1 sqrt rsqrt tanh
sigmoid relu abs sign cos sin erf maximum minimum clamp_min clamp_max gt ge lt le eq ne
and or not where. NaN propagates as in torch (maximum/minimum/clamp/relu of NaN are NaN).
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import importlib.util
import math
import os
import re
import sys
import tempfile
from typing import Any, Callable, Union

import torch
from torch import fx

aten = torch.ops.aten

# An expression tree: X (the input), a float literal, or (op, *operands). Tuples compare
# structurally, so equal subtrees are one dict key (common subexpressions are shared).
X = ("x",)
Expr = Union[tuple, float]


class NotPointwise(ValueError):
    """The subgraph holds an operation that is not elementwise in its input; ``node`` is it."""

    def __init__(self, message: str, node: fx.Node | None = None):
        super().__init__(message)
        self.node = node


# --------------------------------------------------------------------------------------------------
# The operations: arity, and how each is computed with torch, written in Triton and in ONNX.
# --------------------------------------------------------------------------------------------------

UNARY = ("neg", "exp", "log", "log1p", "expm1", "sqrt", "rsqrt", "tanh", "sigmoid", "relu", "abs", "sign",
         "cos", "sin", "erf", "not")
BINARY = ("add", "sub", "mul", "div", "pow", "maximum", "minimum", "clamp_min", "clamp_max",
          "gt", "ge", "lt", "le", "eq", "ne", "and", "or")
BOOLEAN = ("gt", "ge", "lt", "le", "eq", "ne", "and", "or", "not")    # the operations giving booleans
COMMUTATIVE = ("add", "mul", "maximum", "minimum", "eq", "ne", "and", "or")
ARITY = {**{op: 1 for op in UNARY}, **{op: 2 for op in BINARY}, "where": 3}
_SWAPPED_COMPARISON = {"gt": "lt", "lt": "gt", "ge": "le", "le": "ge", "eq": "eq", "ne": "ne"}


def _full(x: torch.Tensor, c: float) -> torch.Tensor:
    return torch.full_like(x, c)


def _torch_op(op: str, args: list, x: torch.Tensor):
    """One operation with torch on tensors and Python floats (literals become tensors like x where
    torch needs a tensor)."""
    if op in ("maximum", "minimum", "where", "and", "or"):
        args = [_full(x, a) if isinstance(a, float) and not (op == "where" and i == 0) else a
                for i, a in enumerate(args)]
    a = args[0]
    b = args[1] if len(args) > 1 else None
    if op == "add":
        return a + b
    if op == "sub":
        return a - b
    if op == "mul":
        return a * b
    if op == "div":
        return a / b
    if op == "pow":
        return torch.pow(a, b)
    if op == "neg":
        return -a
    if op in ("gt", "ge", "lt", "le", "eq", "ne"):
        if isinstance(a, float):                      # 2.0 > t  ≡  t < 2.0
            a, b, op = b, a, _SWAPPED_COMPARISON[op]
        return getattr(torch, op)(a, b)
    if op == "clamp_min":
        return torch.clamp_min(a, b)
    if op == "clamp_max":
        return torch.clamp_max(a, b)
    if op == "maximum":
        return torch.maximum(a, b)
    if op == "minimum":
        return torch.minimum(a, b)
    if op == "and":
        return torch.logical_and(a, b)
    if op == "or":
        return torch.logical_or(a, b)
    if op == "not":
        return torch.logical_not(a)
    if op == "where":
        return torch.where(a, b, args[2])
    return getattr(torch, op)(a)                      # the unary functions share torch's names


_TRITON_BINARY_INFIX = {"add": "+", "sub": "-", "mul": "*", "div": "/", "gt": ">", "ge": ">=", "lt": "<",
                        "le": "<=", "eq": "==", "ne": "!=", "and": "&", "or": "|"}
_TRITON_UNARY = {"exp": "tl.exp", "log": "tl.log", "log1p": "_log1p", "expm1": "_expm1", "sqrt": "tl.sqrt",
                 "rsqrt": "tl.rsqrt", "tanh": "_tanh", "sigmoid": "tl.sigmoid", "abs": "tl.abs",
                 "sign": "_sign", "cos": "tl.cos", "sin": "tl.sin", "erf": "tl.erf", "relu": "_relu"}
_NAN_ALL = "propagate_nan=tl.PropagateNan.ALL"

# Helpers the generated functions call: the interpreter has no libdevice, so log1p, expm1 and tanh
# are written from exp/log (with the classic corrections that keep them accurate
# near 0, and exact at ±inf).
_TRITON_HELPERS = '''


@triton.jit
def _log1p(x):
    u = 1.0 + x
    d = u - 1.0
    return tl.where(d == 0.0, x, tl.where(u == float("inf"), u, tl.log(u) * (x / d)))


@triton.jit
def _expm1(x):
    u = tl.exp(x)
    d = u - 1.0
    return tl.where(u == 1.0, x, tl.where(d == -1.0, -1.0, tl.where(u == float("inf"), u, d * (x / tl.log(u)))))


@triton.jit
def _tanh(x):
    t = _expm1(-2.0 * tl.abs(x))          # on |x|: never overflows; expm1 keeps small |x| accurate
    th = -t / (t + 2.0)
    return tl.where(x < 0.0, -th, th)


@triton.jit
def _sign(x):
    return tl.where(x > 0.0, 1.0, tl.where(x < 0.0, -1.0, 0.0))


@triton.jit
def _relu(x):
    return tl.maximum(x, 0.0, propagate_nan=tl.PropagateNan.ALL)
'''


def _triton_literal(c: float) -> str:
    if math.isnan(c):
        return 'float("nan")'
    if math.isinf(c):
        return 'float("inf")' if c > 0 else '(-float("inf"))'
    return repr(float(c))


def _triton_pow(a: str, b: Any, b_is_literal: bool) -> str:
    if not b_is_literal:
        return f"tl.exp({b} * tl.log({a}))"
    p = float(b)
    if p == 0.0:
        return f"tl.full({a}.shape, 1.0, tl.float32)"     # torch: x ** 0 = 1, NaN included
    if p == 0.5:
        return f"tl.sqrt({a})"
    if p == -0.5:
        return f"tl.rsqrt({a})"
    if p.is_integer() and abs(p) <= 4:
        prod = " * ".join([a] * int(abs(p)))
        return f"({prod})" if p > 0 else f"(1.0 / ({prod}))"
    magnitude = f"tl.exp({_triton_literal(p)} * tl.log(tl.abs({a})))"
    if p.is_integer():                                    # (-2) ** 5 = -32: the sign of an odd power
        return f"tl.where({a} < 0.0, -{magnitude}, {magnitude})" if int(p) % 2 else magnitude
    return f"tl.exp({_triton_literal(p)} * tl.log({a}))"     # NaN for a < 0, as torch


def _triton_op(op: str, args: list[str], literal: list[bool]) -> str:
    a = args[0]
    if op in _TRITON_BINARY_INFIX:
        return f"({a} {_TRITON_BINARY_INFIX[op]} {args[1]})"
    if op == "neg":
        return f"(-{a})"
    if op == "not":
        return f"({a} == 0)"
    if op == "pow":
        if literal[0]:                                    # c ** t = exp(t log c)
            return f"tl.exp({args[1]} * {_triton_literal(math.log(float(a)))})"
        return _triton_pow(a, args[1], literal[1])
    if op in ("maximum", "clamp_min", "minimum", "clamp_max"):
        fn = "tl.maximum" if op in ("maximum", "clamp_min") else "tl.minimum"
        if literal[0]:
            a, b = args[1], a
        else:
            b = args[1]
        return f"{fn}({a}, {b}, {_NAN_ALL})"
    if op == "where":
        return f"tl.where({a}, {args[1]}, {args[2]})"
    return f"{_TRITON_UNARY[op]}({a})"


def _onnx_op(op: str, args: list, boolean: list[bool], x):
    from onnxscript import opset18 as ox

    def lit(c):
        return ox.CastLike(ox.Constant(value_float=float(c)), x)

    args = [lit(a) if isinstance(a, float) and not (op == "pow" and i == 1) else a for i, a in enumerate(args)]
    if op not in ("and", "or", "not", "where"):       # torch promotes booleans in arithmetic; ONNX does not
        args = [ox.CastLike(a, x) if is_bool else a for a, is_bool in zip(args, boolean)]
    elif op == "where":
        args = [args[0], *(ox.CastLike(a, x) if is_bool else a for a, is_bool in zip(args[1:], boolean[1:]))]
    a = args[0]
    b = args[1] if len(args) > 1 else None
    simple = {"add": ox.Add, "sub": ox.Sub, "mul": ox.Mul, "div": ox.Div, "maximum": ox.Max, "minimum": ox.Min,
              "clamp_min": ox.Max, "clamp_max": ox.Min, "gt": ox.Greater, "ge": ox.GreaterOrEqual,
              "lt": ox.Less, "le": ox.LessOrEqual, "eq": ox.Equal, "and": ox.And, "or": ox.Or, "neg": ox.Neg,
              "exp": ox.Exp, "log": ox.Log, "sqrt": ox.Sqrt, "tanh": ox.Tanh, "sigmoid": ox.Sigmoid,
              "relu": ox.Relu, "abs": ox.Abs, "sign": ox.Sign, "cos": ox.Cos, "sin": ox.Sin, "erf": ox.Erf,
              "not": ox.Not}
    if op in simple:
        return simple[op](*args)
    if op == "ne":
        return ox.Not(ox.Equal(a, b))
    if op == "pow":
        return ox.Pow(a, lit(b) if isinstance(b, float) else b)
    if op == "log1p":
        return ox.Log(ox.Add(a, lit(1.0)))
    if op == "expm1":
        return ox.Sub(ox.Exp(a), lit(1.0))
    if op == "rsqrt":
        return ox.Reciprocal(ox.Sqrt(a))
    if op == "where":
        return ox.Where(a, b, args[2])
    raise ValueError(f"pointwise ONNX: no translation for operation {op!r}")


# --------------------------------------------------------------------------------------------------
# Building expressions: constant folding, identities, canonical operand order.
# --------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=4096)
def _key(e: Expr) -> str:
    """A structural sort key (digested so deep expressions stay short)."""
    if isinstance(e, float):
        return "0" + repr(e)
    if e == X:
        return "1x"
    text = e[0] + "(" + ",".join(_key(a) for a in e[1:]) + ")"
    return "2" + (text if len(text) < 64 else hashlib.sha1(text.encode()).hexdigest())


def make(op: str, *args: Expr) -> Expr:
    """The expression op(*args), folded and simplified where that changes no result."""
    if ARITY.get(op) != len(args):
        raise NotPointwise(f"pointwise operation {op!r} with {len(args)} operand(s) is not supported")
    args = tuple(float(a) if isinstance(a, (int, float, bool)) and not isinstance(a, tuple) else a for a in args)
    if op == "where" and isinstance(args[0], float):
        return args[1] if args[0] else args[2]
    if all(isinstance(a, float) for a in args):        # fold in float64
        folded = _torch_op(op, [torch.tensor(a, dtype=torch.float64) if i == 0 else a for i, a in enumerate(args)],
                           torch.zeros((), dtype=torch.float64))
        return float(folded)
    if op == "mul" and 1.0 in args:                    # x·1 = x exactly
        return args[1] if args[0] == 1.0 else args[0]
    if op == "add" and 0.0 in args and isinstance(args[0], tuple) != isinstance(args[1], tuple):
        other = args[1] if args[0] == 0.0 else args[0]
        if other[0] not in BOOLEAN:
            return other
    if op in ("div", "pow") and args[1] == 1.0:       # x/1 = x¹ = x exactly
        return args[0]
    if op in COMMUTATIVE:
        args = tuple(sorted(args, key=_key))
    return (op, *args)


# --------------------------------------------------------------------------------------------------
# The canonical string
# --------------------------------------------------------------------------------------------------

def serialise(e: Expr) -> str:
    statements: list[str] = []
    index: dict[Expr, int] = {}

    def ref(a: Expr) -> str:
        if isinstance(a, float):
            return repr(a)
        if a == X:
            return "x"
        if a not in index:
            operands = ",".join(ref(b) for b in a[1:])
            statements.append(f"{a[0]}({operands})")
            index[a] = len(statements) - 1
        return f"%{index[a]}"

    result = ref(e)
    if not statements or result != f"%{len(statements) - 1}":
        statements.append(result)                        # x itself, or a constant
    return ";".join(statements)


_STATEMENT = re.compile(r"^([a-z_0-9]+)\((.*)\)$")


@functools.lru_cache(maxsize=1024)
def parse(expr: str) -> Expr:
    """The expression tree of a string (raises ValueError naming what is wrong)."""
    if not isinstance(expr, str) or not expr:
        raise ValueError(f"pointwise expression must be a non-empty string, got {expr!r}")
    values: list[Expr] = []

    def operand(text: str) -> Expr:
        text = text.strip()
        if text == "x":
            return X
        if text.startswith("%"):
            i = int(text[1:])
            if not 0 <= i < len(values):
                raise ValueError(f"pointwise expression {expr!r}: {text} refers to a later statement")
            return values[i]
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"pointwise expression {expr!r}: operand {text!r} is not x, %i or a number") from None

    statements = expr.split(";")
    for n, statement in enumerate(statements):
        call = _STATEMENT.match(statement.strip())
        if call is None:
            if n != len(statements) - 1:
                raise ValueError(f"pointwise expression {expr!r}: statement {statement!r} is not op(operands)")
            values.append(operand(statement))
            continue
        op, operands = call.group(1), call.group(2)
        if op not in ARITY:
            raise ValueError(f"pointwise expression {expr!r}: unknown operation {op!r}; "
                             f"expected one of {sorted(ARITY)}")
        values.append(make(op, *(operand(t) for t in operands.split(","))))
    return values[-1]


def canonical(expr: str) -> str:
    """The canonical spelling of an expression string (validates it)."""
    return serialise(parse(expr))


def _nodes_in_order(e: Expr) -> list[tuple]:
    """The operations of ``e`` once each, operands before their users."""
    order: list[tuple] = []
    seen: set = set()

    def visit(a: Expr) -> None:
        if isinstance(a, float) or a == X or a in seen:
            return
        for b in a[1:]:
            visit(b)
        seen.add(a)
        order.append(a)

    visit(e)
    return order


# --------------------------------------------------------------------------------------------------
# Evaluation with torch
# --------------------------------------------------------------------------------------------------

def evaluate(expr: str, x: torch.Tensor) -> torch.Tensor:
    """f(x) with torch ops (the ATen the ops' CPU path and decompositions run)."""
    e = parse(expr)
    values: dict[Expr, Any] = {X: x}

    def value(a: Expr):
        return a if isinstance(a, float) else values[a]

    for node in _nodes_in_order(e):
        values[node] = _torch_op(node[0], [value(a) for a in node[1:]], x)
    out = value(e)
    return torch.full_like(x, out) if isinstance(out, float) else out


# --------------------------------------------------------------------------------------------------
# Reading a function out of an FX graph
# --------------------------------------------------------------------------------------------------

def _val(node: Any):
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _literal_node(node: fx.Node) -> float | None:
    """The value of a node that is a scalar constant (scalar_tensor, a 0-d tensor attribute), else None."""
    if node.op == "get_attr":
        owner = node.graph.owning_module
        value = getattr(owner, node.target, None) if owner is not None else None
        if isinstance(value, torch.Tensor) and value.dim() == 0 and value.is_floating_point():
            return float(value)
        return None
    if node.op == "call_function" and node.target in (aten.scalar_tensor.default,):
        return float(node.args[0])
    if node.op == "call_function" and node.target in (aten.lift_fresh_copy.default, aten.clone.default) \
            and isinstance(node.args[0], fx.Node):
        return _literal_node(node.args[0])
    return None


def _describe(node: fx.Node) -> str:
    target = node.target
    name = getattr(target, "__name__", None) or str(target)
    if isinstance(target, torch._ops.OpOverload):
        name = f"{target.overloadpacket.__name__} ({target})"
    return name


def _kwargs(node: fx.Node) -> dict[str, Any]:
    from torch.fx.operator_schemas import normalize_function

    normalized = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True)
    if normalized is None:
        raise NotPointwise(f"{_describe(node)} is not a pointwise operation Hecate can read", node)
    return normalized.kwargs


def _same_dtype(node: fx.Node, source: Any) -> bool:
    out, inp = _val(node), _val(source)
    return isinstance(out, torch.Tensor) and isinstance(inp, torch.Tensor) and out.dtype == inp.dtype


def _identity_ops() -> set:
    return {aten.detach.default, aten.clone.default, aten.alias.default, aten.contiguous.default,
            aten.positive.default, aten.lift_fresh_copy.default}


def _read(node: fx.Node, k: dict[str, Any], operand: Callable[[Any], Expr]) -> Expr:
    """The expression of one ATen call, its operands read by ``operand``."""
    packet = node.target.overloadpacket.__name__
    self_ = k.get("input", k.get("self"))
    if node.target in _identity_ops() or (packet in ("to", "_to_copy") and _same_dtype(node, self_)):
        return operand(self_)
    if packet in ("ones_like", "zeros_like", "full_like"):
        operand(self_)                                   # shaped like a value of x, so it broadcasts as x
        return {"ones_like": 1.0, "zeros_like": 0.0}.get(packet, k.get("fill_value"))
    if packet in UNARY and packet not in ("not",):
        return make(packet, operand(self_))
    if packet == "sgn":
        return make("sign", operand(self_))
    if packet == "logical_not":
        return make("not", operand(self_))
    if packet in ("add", "sub"):
        other = operand(k["other"])
        alpha = k.get("alpha", 1)
        return make(packet, operand(self_), make("mul", other, alpha) if alpha != 1 else other)
    if packet == "rsub":
        alpha = k.get("alpha", 1)
        return make("sub", operand(k["other"]), make("mul", operand(self_), alpha))
    if packet in ("mul", "maximum", "minimum", "gt", "ge", "lt", "le", "eq", "ne"):
        return make(packet, operand(self_), operand(k["other"]))
    if packet in ("div", "true_divide"):
        if k.get("rounding_mode") is not None:
            raise NotPointwise(f"{_describe(node)} rounds (rounding_mode={k['rounding_mode']!r}); Hecate's "
                               "pointwise functions are smooth-or-piecewise real functions", node)
        return make("div", operand(self_), operand(k["other"]))
    if packet in ("logical_and", "logical_or"):
        return make(packet[len("logical_"):], operand(self_), operand(k["other"]))
    if packet == "pow":
        base = k.get("self", self_)
        return make("pow", operand(base), operand(k["exponent"]))
    if packet == "square":
        a = operand(self_)
        return make("mul", a, a)
    if packet == "reciprocal":
        return make("div", 1.0, operand(self_))
    if packet == "silu":
        a = operand(self_)
        return make("mul", a, make("sigmoid", a))
    if packet == "mish":
        a = operand(self_)
        return make("mul", a, make("tanh", _softplus(a, 1.0, 20.0)))
    if packet == "elu":
        a = operand(self_)
        alpha, scale, input_scale = (float(k.get(n, 1.0)) for n in ("alpha", "scale", "input_scale"))
        negative = make("mul", alpha * scale, make("expm1", make("mul", a, input_scale)))
        return make("where", make("gt", a, 0.0), make("mul", a, scale), negative)
    if packet == "leaky_relu":
        a = operand(self_)
        return make("where", make("gt", a, 0.0), a, make("mul", a, float(k.get("negative_slope", 0.01))))
    if packet == "threshold":
        a = operand(self_)
        return make("where", make("gt", a, float(k["threshold"])), a, float(k["value"]))
    if packet == "softplus":
        return _softplus(operand(self_), float(k.get("beta", 1.0)), float(k.get("threshold", 20.0)))
    if packet in ("hardsigmoid", "hardswish"):  # (x + 3) / 6 between −3 and 3 (times x), 0 and 1 (x) outside: as
        a = operand(self_)                        # branches, so the derivative at ±3 is ATen's (the outer one's)
        ramp = make("div", make("mul", a, make("add", a, 3.0)) if packet == "hardswish" else make("add", a, 3.0), 6.0)
        return make("where", make("le", a, -3.0), 0.0, make("where", make("ge", a, 3.0),
                                                            a if packet == "hardswish" else 1.0, ramp))
    if packet == "log_sigmoid":
        return _log_sigmoid(operand(self_))
    if packet == "gelu":
        return _gelu(operand(self_), k.get("approximate", "none"))
    if packet in ("clamp", "hardtanh", "clamp_min", "clamp_max"):
        a = operand(self_)
        low = k.get("min", k.get("min_val", -1.0 if packet == "hardtanh" else None))
        high = k.get("max", k.get("max_val", 1.0 if packet == "hardtanh" else None))
        if low is not None:
            a = make("clamp_min", a, operand(low))
        if high is not None:
            a = make("clamp_max", a, operand(high))
        return a
    if packet in ("where", "masked_fill"):
        if packet == "masked_fill":
            return make("where", operand(k["mask"]), operand(k["value"]), operand(self_))
        return make("where", operand(k["condition"]), operand(self_), operand(k["other"]))
    raise NotPointwise(f"{_describe(node)} is not one of the pointwise operations Hecate generates", node)


def _log_sigmoid(a: Expr) -> Expr:
    """ATen's min(x, 0) − log1p(exp(−|x|)) per sign of x: smooth in each branch, so the derivative at 0 is ATen's ½."""
    return make("where", make("lt", a, 0.0), make("sub", a, make("log1p", make("exp", a))),
                make("neg", make("log1p", make("exp", make("neg", a)))))


def _softplus(a: Expr, beta: float, threshold: float) -> Expr:
    scaled = make("mul", a, beta)
    smooth = make("div", make("log1p", make("exp", scaled)), beta)
    return make("where", make("gt", scaled, threshold), a, smooth)


def _gelu(a: Expr, approximate: str) -> Expr:
    if approximate == "tanh":                      # ½x(1 + tanh(√(2/π)(x + 0.044715x³)))
        inner = make("mul", math.sqrt(2.0 / math.pi), make("add", a, make("mul", 0.044715, make("pow", a, 3.0))))
        return make("mul", make("mul", 0.5, a), make("add", 1.0, make("tanh", inner)))
    return make("mul", make("mul", 0.5, a), make("add", 1.0, make("erf", make("mul", a, math.sqrt(0.5)))))


def extract(input_node: fx.Node, output_node: fx.Node) -> str:
    """The expression computing ``output_node`` from ``input_node`` elementwise.

    Every node between them must be a supported pointwise ATen call whose operands are
    ``input_node``, values computed from it, or scalar constants; otherwise
    :class:`NotPointwise` names the offending node (the one nearest the input).
    """
    memo: dict[fx.Node, Expr] = {input_node: X}
    failures: list[NotPointwise] = []

    def operand(a: Any) -> Expr:
        if isinstance(a, bool):
            return float(a)
        if isinstance(a, (int, float)):
            return float(a)
        if not isinstance(a, fx.Node):
            raise NotPointwise(f"operand {a!r} is neither a tensor computed from the input nor a number")
        if a in memo:
            return memo[a]
        literal = _literal_node(a)
        if literal is not None:
            memo[a] = literal
            return literal
        if a.op != "call_function" or not isinstance(a.target, torch._ops.OpOverload):
            raise NotPointwise(f"{a.op} {a.name} is read, but it is not computed from the input elementwise", a)
        try:
            memo[a] = _read(a, _kwargs(a), operand)
        except NotPointwise as failure:
            failures.append(failure)
            raise
        return memo[a]

    try:
        e = operand(output_node)
    except NotPointwise:
        raise failures[0] if failures else NotPointwise(
            f"{output_node.name} is not computed from {input_node.name} elementwise", output_node)
    return serialise(e)


def _generated(node: fx.Node) -> bool:
    """Whether ``node`` is an ATen call :func:`extract` reads (its operands aside)."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    try:
        _read(node, _kwargs(node), lambda a: X if isinstance(a, fx.Node) else float(a))
    except (NotPointwise, TypeError, ValueError, KeyError):
        return False
    return True


def grow(input_node: fx.Node) -> tuple[fx.Node, list[fx.Node]]:
    """The largest pointwise function of ``input_node`` the graph computes after it.

    Returns (output node, the nodes computing it, in graph order): every node reads only
    ``input_node``, other nodes of the region and constants, and only the output is read
    outside the region. (input_node, []) when no pointwise operation follows.
    """
    order = {n: i for i, n in enumerate(input_node.graph.nodes)}
    region: set[fx.Node] = set()
    frontier = [input_node]
    while frontier:                                   # forward closure over pointwise readers
        node = frontier.pop()
        for user in node.users:
            if user in region or not _generated(user):
                continue
            tensor_operands = [a for a in user.all_input_nodes if _literal_node(a) is None]
            if all(a is input_node or a in region for a in tensor_operands):
                region.add(user)
                frontier.append(user)
    for candidate in sorted(region, key=order.__getitem__, reverse=True):
        ancestors = _ancestors_within(candidate, region)
        inner = ancestors - {candidate}
        if all(all(u in ancestors for u in n.users) for n in inner):
            return candidate, sorted(ancestors, key=order.__getitem__)
    return input_node, []


def _ancestors_within(node: fx.Node, region: set[fx.Node]) -> set[fx.Node]:
    found = {node}
    stack = [node]
    while stack:
        for a in stack.pop().all_input_nodes:
            if a in region and a not in found:
                found.add(a)
                stack.append(a)
    return found


# make_fx splits F.logsigmoid into log_sigmoid_forward's two outputs (the second a buffer its backward reads): the
# first is read as the graph's aten.log_sigmoid is
_TRACE_DECOMPOSITIONS = {aten.log_sigmoid_forward.default: lambda x: (
    evaluate(serialise(_log_sigmoid(X)), x), x.new_empty((0,)))}


def trace(fn: Callable[[torch.Tensor], torch.Tensor]) -> str:
    """The expression of a Python function of one tensor (traced on zeros: no RNG is moved)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(lambda z: fn(z), decomposition_table=_TRACE_DECOMPOSITIONS)(torch.zeros(4))
    placeholder = next(n for n in gm.graph.nodes if n.op == "placeholder")
    output = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    if isinstance(output, (list, tuple)):
        output = output[0]
    if not isinstance(output, fx.Node):
        return serialise(float(output))
    return extract(placeholder, output)


# --------------------------------------------------------------------------------------------------
# The derivative, by tracing autograd of the torch function
# --------------------------------------------------------------------------------------------------

def _backward_decompositions() -> dict:
    from torch._decomp import get_decompositions

    return get_decompositions([aten.sigmoid_backward, aten.tanh_backward, aten.threshold_backward,
                               aten.elu_backward, aten.gelu_backward, aten.softplus_backward,
                               aten.silu_backward, aten.hardtanh_backward, aten.leaky_relu_backward])


@functools.lru_cache(maxsize=1024)
def derivative(expr: str) -> str:
    """f'(x) as an expression: make_fx of the vjp of :func:`evaluate` with a cotangent of ones.

    Traced in a thread of its own: the caller may be inside a trace (Inductor lowering the op's backward
    runs under fake mode and functorch's transforms), and those modes are per thread."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(_derivative, expr).result()


def _derivative(expr: str) -> str:
    from torch.fx.experimental.proxy_tensor import make_fx

    e = parse(expr)
    if isinstance(e, float) or not _nodes_in_order(e) and e != X:
        return serialise(0.0)

    def vjp_of_ones(x: torch.Tensor) -> torch.Tensor:
        y, pullback = torch.func.vjp(functools.partial(evaluate, expr), x)
        return pullback(torch.ones_like(y))[0]

    gm = make_fx(torch.func.functionalize(vjp_of_ones), decomposition_table=_backward_decompositions())(
        torch.zeros(4))
    placeholder = next(n for n in gm.graph.nodes if n.op == "placeholder")
    output = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    return serialise(_branch_guarded(parse(extract(placeholder, output))))


def _branch_guarded(e: Expr) -> Expr:
    """``e`` with each product by a branch's indicator taken inside the branch: autograd of
    ``where(x > 20, x, log1p(exp(x)))`` gives ``where(c, 0, 1) · exp(x) / (1 + exp(x))``, NaN at x = 100
    (0 · inf) where the branch taken gives 1; ``where(c, 0, exp(x) / (1 + exp(x)))`` is 0 there, as
    eager's gradient is. Equal wherever the other factors are finite."""
    if not isinstance(e, tuple) or e == X:
        return e
    op, args = e[0], [_branch_guarded(a) for a in e[1:]]
    for i, a in enumerate(args if op == "mul" else args[:1] if op == "div" else ()):
        if isinstance(a, tuple) and a[0] == "where" and 0.0 in (a[2], a[3]) and a[2] != a[3]:
            cond, taken = a[1], a[3] if a[2] == 0.0 else a[2]
            inner = _branch_guarded(make(op, *args[:i], taken, *args[i + 1:]))
            return make("where", cond, 0.0, inner) if a[2] == 0.0 else make("where", cond, inner, 0.0)
    return make(op, *args)


# --------------------------------------------------------------------------------------------------
# Triton: the expression as a generated @triton.jit function
# --------------------------------------------------------------------------------------------------

def triton_source(expr: str, name: str) -> str:
    """Source of a module defining ``@triton.jit def <name>(x)`` computing the expression on fp32."""
    e = parse(expr)
    names: dict[Expr, str] = {X: "x"}
    body: list[str] = []

    def ref(a: Expr) -> str:
        return _triton_literal(a) if isinstance(a, float) else names[a]

    for i, node in enumerate(_nodes_in_order(e)):
        names[node] = f"v{i}"
        code = _triton_op(node[0], [ref(a) for a in node[1:]], [isinstance(a, float) for a in node[1:]])
        body.append(f"    v{i} = {code}")
    result = ref(e) if not isinstance(e, float) else f"tl.full(x.shape, {_triton_literal(e)}, tl.float32)"
    lines = [f'"""Generated by hecate.lowering.pointwise from: {expr}"""', "import triton",
             "import triton.language as tl", _TRITON_HELPERS, "", "@triton.jit", f"def {name}(x):",
             *body, f"    return {result}", ""]
    return "\n".join(lines)


def cache_dir() -> str:
    """Where generated sources go: $HECATE_CACHE_DIR/pointwise, else a per-user temporary dir."""
    root = os.environ.get("HECATE_CACHE_DIR") or os.path.join(tempfile.gettempdir(), f"hecate-{os.getuid()}")
    path = os.path.join(root, "pointwise")
    os.makedirs(path, exist_ok=True)
    return path


@functools.lru_cache(maxsize=1024)
def triton_function(expr: str):
    """The ``@triton.jit`` function ``f(x)`` of an expression (pass it to a kernel as a constexpr).

    The source is written once to :func:`cache_dir` (named by the expression's digest) and imported;
    whether it runs interpreted follows ``TRITON_INTERPRET`` at import, as for any Triton module.
    """
    expr = canonical(expr)
    digest = hashlib.sha1(expr.encode()).hexdigest()[:16]
    name = f"pointwise_{digest}"
    path = os.path.join(cache_dir(), f"hecate_{name}.py")
    source = triton_source(expr, name)
    if not os.path.exists(path) or open(path).read() != source:
        partial = f"{path}.{os.getpid()}.tmp"
        with open(partial, "w") as f:
            f.write(source)
        os.replace(partial, path)                       # atomic: concurrent writers see whole files
    module_name = f"hecate_{name}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return getattr(module, name)


# --------------------------------------------------------------------------------------------------
# ONNX
# --------------------------------------------------------------------------------------------------

def to_onnx(expr: str, x):
    """f(x) written with onnxscript ops (call inside an ONNX translation)."""
    e = parse(expr)
    values: dict[Expr, Any] = {X: x}
    for node in _nodes_in_order(e):
        values[node] = _onnx_op(node[0], [a if isinstance(a, float) else values[a] for a in node[1:]],
                                [isinstance(a, tuple) and a[0] in BOOLEAN for a in node[1:]], x)
    if isinstance(e, float):
        from onnxscript import opset18 as ox

        return ox.Expand(ox.CastLike(ox.Constant(value_float=e), x), ox.Shape(x))
    return values[e]
