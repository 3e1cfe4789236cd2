"""Recognise a memory step inside a scan body by what it computes, whatever its spelling.

A loop arrives here as ``scan(body, init, xs, invariants)`` (:mod:`hecate.compiler.loops`
rolls Dynamo's unrolled copies up; a user's own ``scan`` arrives as is). :func:`analyse`
proves that the body is one of

* the l_p memory step (``spec/lp-attentional-bias.md``)::

      e = read(W, k) − v              W = M, or MONETA's W = M / (Σ|M|^q + eps)^((q−2)/q)
      M ← a·M − b·outer(G(e), k)      (or with momentum: S ← β S − b·outer(G(e), k); M ← a·M + S)
      y = read(W, q)

* the Hebbian step: ``M ← a·M + b·outer(v, k)``, ``y = read(M, q)``, optionally normalised
  by ``z ← a·z + k``, ``y / (z·q + eps)``,

where read is the contraction of M with a vector over either of its last two dims (M may be
stored [Dv, Dk] or [Dk, Dv]), a and b are numbers or any per-step function of the loop's
inputs (gates), k, v, q are any per-step values (φ(k) computed inside the loop included) and
G is a pointwise function of e. The proof is by meaning, not by matching one spelling:

1. the body's additive/multiplicative structure is read off the graph (sums of products,
   seen through views): which term keeps M, which updates it, which factors are gates;
2. the roles are found by evaluating the body at random float64 points of either sign (its own
   generator, the user's RNG is not touched; positive points where the body is not finite at signed
   ones, a root or log of an input; so relu(k_t) or |q_t| is never taken for k_t or q_t; symbolic
   sizes, under dynamic=True or a dynamic export, at the example's): y equals read(M_new, q) for one
   per-step value q; one node equals read(M, k) − v; G is evaluated on its own over a grid of e and
   identified as one of memory_scan's bias gradients (2e, tanh(a·e), p·tanh(a·e)·(e²+eps)^((p−1)/2)), its
   parameters taken from the body's literals;
3. the whole step is then evaluated again at fresh random points against the op's own
   equations with the recovered roles; anything that differs is :class:`NotFused`.

Where the body as written is none, two rewrites of a copy are tried, each installed only if the copy is one:
the update put in the shape of one term (:mod:`memory_update`, the delta rule's Householder form), and a carry the
step recomputes from another one's new value dropped (:mod:`derived_carry`, MONETA's W = f(A) carried beside A).

The scan is then replaced by the op through a plain PyTorch function traced under the graph's
fake mode (:func:`_fused_recurrence`): every size it needs is read off a tensor, so a dynamic
batch or length stays dynamic in the fused graph.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from hecate.compiler.normalize import WRITTEN_BACK
from hecate.passes.matching import NotFused, bound_reason, computed_from, eliminate_dead_code, first_gradient_stop, \
    first_threshold, INPUT_WRITTEN_ADVICE, gradient_stop, gradient_stop_reason, inline, is_one, \
    is_register_hook, is_view, is_zeros, op_name, replace_with_function, snapped, written_tensor
from hecate.passes.report import source_line

aten = torch.ops.aten

_TOL = 1e-9  # float64 agreement required between the body and the op's equations

_WHERE = {aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar}

# views through which a product's factors are read (they move no value across elements)
_VIEWS = {aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.view.default,
          aten.reshape.default, aten._unsafe_view.default, aten.expand.default, aten.alias.default,
          aten.clone.default}


# ---------------------------------------------------------------- evaluating the body

def _evaluate(graph: fx.Graph, inputs: dict[fx.Node, Any], overrides: dict[fx.Node, Any] | None = None,
              upto: set[fx.Node] | None = None) -> dict[fx.Node, Any]:
    """Run ``graph`` on concrete values; ``overrides`` replace nodes' values; ``upto`` limits what is run."""
    env: dict[fx.Node, Any] = dict(inputs)
    overrides = overrides or {}
    for node in graph.nodes:
        if node in overrides:
            env[node] = overrides[node]
            continue
        if node.op == "get_attr" and node not in env:  # a constant the body holds (torch.tensor(1e-6))
            value = fx.graph_module._get_attr(graph.owning_module, node.target)
            env[node] = value  # (float32 beside float64 sample points: the points' dtype wins)
            continue
        if node.op != "call_function" or (upto is not None and node not in upto):
            continue
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: env.get(n))
        if node.target is aten.sym_size.int:  # through the tensor's size: under vmap that has no batching rule
            env[node] = args[0].size(args[1])
            continue
        if _float_cast(node.target, args, kwargs):  # x.float() of a bf16 input: the sample points stay float64
            env[node] = args[0]
            continue
        env[node] = node.target(*args, **kwargs)
    return env


def _float_cast(target: Any, args: tuple, kwargs: dict) -> bool:
    """Whether the call casts a float64 tensor to another floating dtype (``.float()``, ``.to(torch.bfloat16)``
    on the sample points, which are float64: the step's values at its own precision would mix the two)."""
    if target not in (aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout,
                      torch.ops.prims.convert_element_type.default) or not args \
            or not isinstance(args[0], torch.Tensor) or args[0].dtype != torch.float64:
        return False
    dtype = kwargs.get("dtype", args[1] if len(args) > 1 and target is not aten._to_copy.default else None)
    return isinstance(dtype, torch.dtype) and dtype.is_floating_point and set(kwargs) <= {"dtype", "layout", "device",
                                                                                            "pin_memory", "copy",
                                                                                            "non_blocking",
                                                                                            "memory_format"}


def _concrete(size: int | torch.SymInt) -> int:
    """A size as a number: a symbolic size (dynamic=True, dynamic export) at its hint, the example's size."""
    if isinstance(size, int):
        return size
    hint = size.node.hint
    if hint is None:
        raise NotFused(f"the loop's size {size} has no example value (a data-dependent size); the memory step is "
                       "recognised at sample points of the example's sizes")
    return int(hint)


def _random_inputs(placeholders: list[fx.Node], seed: int, states: set[fx.Node], signed: bool) -> dict[fx.Node, Any]:
    """Sample points for the body's inputs, at the example's sizes where the loop's shapes are symbolic:
    ``signed``, every input of either sign (relu(k), |v| or a clamp of q then differ from k, v, q); else the
    inputs in (0.1, 0.9), for a body that takes roots or logs of them."""
    gen = torch.Generator().manual_seed(seed)
    values = {}
    for ph in placeholders:
        v = ph.meta.get("val")
        if isinstance(v, torch.SymInt):  # a size the body reads (dynamic shapes pass them in)
            values[ph] = _concrete(v)
            continue
        if not isinstance(v, torch.Tensor):
            values[ph] = v
            continue
        shape = tuple(_concrete(s) for s in v.shape)
        if v.is_floating_point():
            if ph in states or signed:  # states of either sign
                values[ph] = torch.randn(shape, generator=gen, dtype=torch.float64)
            else:  # inputs in (0.1, 0.9): gates stay gates, roots and logs stay real
                values[ph] = 0.1 + 0.8 * torch.rand(shape, generator=gen, dtype=torch.float64)
        elif v.dtype == torch.bool:
            # flags of both values in every draw: a reset never set reads as no reset, and one always set as a
            # reset on either side of the error; a single flag is set at the check of the whole step (seed 1)
            n = math.prod(shape)
            flags = torch.zeros(n, dtype=torch.bool)
            if n > 1:
                flags[torch.randperm(n, generator=gen)[:n // 2]] = True
            else:
                flags[:] = seed % 2 == 1
            values[ph] = flags.reshape(shape)
        else:
            values[ph] = torch.zeros(shape, dtype=v.dtype)
    return values


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or not a.is_floating_point() or not b.is_floating_point():  # (a mask is no value here)
        return False
    scale = float(b.abs().max()) if b.numel() else 0.0
    diff = float((a - b).abs().max()) if a.numel() else 0.0
    return bool(torch.isfinite(a).all()) and diff <= _TOL * max(scale, 1.0)


def _as(value: Any, shape: tuple[int, ...]) -> torch.Tensor | None:
    """``value`` viewed as ``shape`` when it holds that many elements, its dims those of ``shape`` with size-1 dims
    moved freely and consecutive dims merged (a step's k_t [B, H, D] read as [B·H, D], as ``k[:, t].reshape(B * H,
    D)`` reads it for a memory of the heads flattened into the batch); or broadcast to ``shape`` where it lacks
    some of its dims (:func:`_shared_by`: Mamba-2's B_t, C_t [B, N] shared by the heads of [B, H, N])."""
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel() != math.prod(shape):
        placed = _shared_by(value, shape)
        return None if placed is None else placed.expand(shape)
    if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.numel() != math.prod(shape):
        return None
    have, want = [s for s in value.shape if s != 1], [s for s in shape if s != 1]
    while have and want:  # each dim of ``shape`` is the product of the next dims of ``value``
        size = have.pop(0)
        while size < want[0] and have:
            size *= have.pop(0)
        if size != want.pop(0):
            return None
    return value.reshape(shape) if not have and not want else None


# ---------------------------------------------------------------- reading sums of products

def _terms(node: Any, sign: float = 1.0, stop: frozenset = frozenset(),
           views: bool = False) -> list[tuple[float, Any]]:
    """``node`` as Σ sign·term, through add/sub/neg (and ``alpha=`` of add/sub), not into ``stop``; with ``views``,
    a view of a sum as the sum of its terms (each read through the view by :func:`_product`)."""
    if isinstance(node, fx.Node) and node.op == "call_function" and node not in stop:
        if node.target in (aten.add.Tensor, aten.sub.Tensor) and len(node.args) == 2:
            alpha = node.kwargs.get("alpha", 1)
            if set(node.kwargs) <= {"alpha"} and isinstance(alpha, (int, float)):
                second = alpha * (1 if node.target is aten.add.Tensor else -1)
                return _terms(node.args[0], sign, stop, views) + _terms(node.args[1], sign * second, stop, views)
        if node.target is aten.neg.default:
            return _terms(node.args[0], -sign, stop, views)
        if node.target is aten.rsub.Scalar and len(node.args) == 2 and isinstance(node.args[1], (int, float)) \
                and set(node.kwargs) <= {"alpha"} and isinstance(node.kwargs.get("alpha", 1), (int, float)):
            # c − x (``1 - a`` of a tensor a): the number c is a term of its own
            return [(sign, node.args[1])] + _terms(node.args[0], -sign * node.kwargs.get("alpha", 1), stop, views)
        if node.target in (aten.mul.Tensor, aten.div.Tensor) and len(node.args) == 2 and not node.kwargs:
            # c·(a − b) and (a − b)/c for a number c: distributed, c·a − c·b (an EMA written M + λ(X − M))
            x, c = node.args
            if node.target is aten.mul.Tensor and not isinstance(x, fx.Node):
                x, c = c, x
            if isinstance(c, (int, float)) and not isinstance(c, bool) and c != 0 and isinstance(x, fx.Node) \
                    and x.op == "call_function" and x.target in (aten.add.Tensor, aten.sub.Tensor, aten.neg.default):
                return _terms(x, sign * (c if node.target is aten.mul.Tensor else 1 / c), stop, views)
        if views and node.target in _VIEWS and isinstance(node.args[0], fx.Node):  # the sum of the views of a sum
            inner = _terms(node.args[0], sign, stop, views)
            if len(inner) > 1:
                return inner
        if node.target in (aten.clone.default, aten.alias.default):
            return _terms(node.args[0], sign, stop, views)
        if node.target in (aten.lerp.Tensor, aten.lerp.Scalar) and len(node.args) == 3 and not node.kwargs:
            # lerp(a, b, w) = a + w·(b − a): a gated write, M ← (1 − w)·M + w·v kᵀ
            a, b, w = node.args  # (b a sum: each of its terms times w, lerp(M, M − e kᵀ, η) = M − η e kᵀ)
            return _terms(a, sign, stop, views) + [(s, ("mul", w, t)) for s, t in _terms(b, sign, stop, views)] \
                + [(-sign, ("mul", w, a))]
        if node.target is torch.ops.prims.fma.default and len(node.args) == 3 and not node.kwargs:
            a, b, c = node.args  # a·b + c (Dynamo's spelling of x.addcmul_(a, b, value=v): fma(a·b, v, x))
            return _terms(c, sign, stop, views) + [(sign, ("mul", a, b))]
        if node.target in (aten.addcmul.default, aten.addcdiv.default) and len(node.args) == 3:
            value = node.kwargs.get("value", 1)  # self + value·t1·t2 (or t1/t2): a term that is a product
            kind = "mul" if node.target is aten.addcmul.default else "div"
            return _terms(node.args[0], sign, stop, views) + [(sign * value, (kind, node.args[1], node.args[2]))]
    return [(sign, node)]


@dataclass
class _Product:
    coef: float = 1.0
    factors: list[fx.Node] = field(default_factory=list)
    divisors: list[fx.Node] = field(default_factory=list)
    read_as: dict = field(default_factory=dict)  # a factor reached through views -> the outermost of them


def _product(node: Any, out: _Product | None = None, invert: bool = False, views: bool = True,
             top: fx.Node | None = None) -> _Product:
    """``node`` as coef · Π factors / Π divisors, through mul/div/neg and (``views``) views; without views the
    factors multiply back to the node's value as they broadcast."""
    out = out or _Product()
    if isinstance(node, tuple):  # ("mul" | "div", a, b) from addcmul / addcdiv
        kind, a, b = node
        _product(a, out, invert, views)
        return _product(b, out, invert if kind == "mul" else not invert, views)
    if isinstance(node, (int, float)) and not isinstance(node, bool):
        out.coef = out.coef / node if invert else out.coef * node
        return out
    if node.op == "call_function":
        t, a = node.target, node.args
        if t is aten.mul.Tensor and len(a) == 2 and not node.kwargs:
            _product(a[0], out, invert, views)
            return _product(a[1], out, invert, views)
        if t is aten.div.Tensor and len(a) == 2 and not node.kwargs:
            _product(a[0], out, invert, views)
            return _product(a[1], out, not invert, views)
        if t is aten.neg.default:
            out.coef = -out.coef
            return _product(a[0], out, invert, views)
        if views and t in _VIEWS and isinstance(a[0], fx.Node):
            return _product(a[0], out, invert, views, top or node)
    (out.divisors if invert else out.factors).append(node)
    if top is not None:
        out.read_as[node] = top
    return out


def _gates_as_read(b: "_Body", prod: _Product, lead: tuple) -> _Product:
    """``prod`` with each factor read through views as [..., 1, 1] against the memory [*lead, A, C] taken as so
    read: the views say which leading dims it spans, which its values alone do not (α[:, t, None, None, None] of
    an α [B, T] and λ[:, None, None] of a λ [H] both reach [2] through the views)."""
    def as_read(f):
        top = prod.read_as.get(f)
        for read in (top, f):  # a memory split per row (memory_heads): a gate of its columns read per row
            if read in b.row_gates:
                return b.row_gates[read]
        value = b.env.get(top) if top is not None else None
        spans_leading = isinstance(value, torch.Tensor) and value.dim() == len(lead) + 2 \
            and tuple(value.shape[-2:]) == (1, 1)
        # a memory split per row, its lead [B, H, A]: a strength b_t[..., None] [B, H, 1] of b·v spans the rows
        per_head = b.per_row and _same_rank_as(value, lead) and _as(value, lead) is None
        return top if spans_leading or per_head else f

    prod.factors, prod.divisors = [as_read(f) for f in prod.factors], [as_read(f) for f in prod.divisors]
    return prod


# ---------------------------------------------------------------- what was recognised

@dataclass
class PerStep:
    """A per-step value [*lead, D] (or [*lead] for a gate): coef · Π factors / Π divisors · Π features of body
    nodes. A feature is a tensor every step shares that scales a vector value as its own shape broadcasts against
    [*lead, D] (``k_t ⊙ s`` with s [D] or [H, D]; ``k_t * w[:, None]``)."""

    coef: float
    factors: list[fx.Node]
    divisors: list[fx.Node] = field(default_factory=list)
    offset: float | None = None  # the value is offset − (coef · Π ...) (memory_scan's α = 1 − keep)
    features: list[fx.Node] = field(default_factory=list)
    # a vector's factors of [*lead]'s size read as vectors every row shares, not one number per row: a memory
    # split per row (GLA's decay per key, stored [Dk, Dv]) has its rows in lead, and with Dk = Dv the step's
    # v [B, H, Dv] has the size of [B, H, rows]; evaluation tells which (:func:`_outer_roles`)
    shared: bool = False

    @property
    def nodes(self) -> list[fx.Node]:
        return self.factors + self.divisors + self.features

    def value(self, env: dict[fx.Node, Any], lead: tuple[int, ...], size: Any = None,
              like: torch.Tensor | None = None) -> torch.Tensor:
        """The value from the body's values ``env``, as [*lead] (a gate) or [*lead, size] (a vector), in the dtype
        of ``like`` (float64 by default)."""
        shape = tuple(lead) + (() if size is None else (size,))
        dtype = torch.float64 if like is None else like.dtype
        out = None
        for f in self.factors:
            x = _broadcastable(env[f], shape, lead, self.shared)
            if isinstance(x, torch.Tensor) and not x.is_floating_point():  # a flag (M * ~reset_t): 0 or 1
                x = x.to(dtype)
            out = x if out is None else out * x
        for d in self.divisors:
            x = _broadcastable(env[d], shape, lead, self.shared)
            out = 1.0 / x if out is None else out / x
        for f in self.features:
            out = env[f] if out is None else out * env[f]
        if out is None:
            out = torch.full(shape, float(self.coef), dtype=dtype, device=None if like is None else like.device)
        elif self.coef != 1.0:
            out = out * self.coef
        out = out.expand(shape) if tuple(out.shape) != shape else out
        # offset − value in float64: memory_scan's α = 1 − keep hands a keep near 0 over as an α near 1, whose digits
        # the op's 1 − α reads back (in fp32 a keep of 1e-6 would come back 6% off)
        return out if self.offset is None else self.offset - out.double()


def _heads(value: torch.Tensor) -> torch.Tensor:
    """A factor broadcast against the memory [*lead, A, C] as the leading dims it has, from the right: an
    [H, 1, 1] tensor as [H] (a parameter [H] read as ``lam[:, None, None]`` arrives as [H] through the views)."""
    return value[..., 0, 0] if value.dim() >= 2 and value.shape[-2:] == (1, 1) else value


def _is_gate(value: Any, lead: tuple[int, ...]) -> bool:
    """One number, one per batch and head [*lead], or one per head broadcast over the batch ([H, 1, 1], [H])."""
    if not isinstance(value, torch.Tensor):
        return False
    if value.numel() == 1 or _as(value, lead) is not None:
        return True
    heads = _heads(value).shape
    return len(heads) <= len(lead) and all(s in (1, n) for s, n in zip(reversed(heads), reversed(lead)))


def _same_rank_as(value: Any, lead: tuple[int, ...]) -> bool:
    """One number per batch [B, 1] against [B, H] (a shared key's norm ‖k_t‖, keepdim): [*lead] broadcast from
    dims of 1, the rank kept, which :func:`_broadcastable` places as it is."""
    return isinstance(value, torch.Tensor) and value.dim() == len(lead) \
        and all(s == 1 or s == n for s, n in zip(value.shape, lead))


def _is_feature(value: Any, shape: tuple[int, ...]) -> bool:
    """A tensor every step shares that scales a [*lead, D] value: it broadcasts to ``shape`` as its own shape
    does (s [D] or [H, D] by feature, w [H, 1] by head), and is not one number nor as large as a per-step vector."""
    if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.dim() == 0:
        return False
    try:
        return (tuple(torch.broadcast_shapes(value.shape, shape)) == tuple(shape)
                and 1 < value.numel() < math.prod(shape))
    except RuntimeError:
        return False


def _shared_by(value: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor | None:
    """``value`` with dims of 1 where it lacks dims of ``shape`` [*lead, D] but has the first and the last (a step's
    C_t [B, N] as [B, 1, N] against [B, H, N]: one per sequence, shared by the heads), or None."""
    have = list(value.shape)
    if len(have) == len(shape) >= 3 and have[0] == shape[0] and have[-1] == shape[-1] \
            and all(h == 1 or h == n for h, n in zip(have, shape)):
        return value  # (the dims of 1 already in place: B_t read as [B, 1, N] against [B, H, N])
    if not 2 <= len(have) < len(shape) or have[0] != shape[0] or have[-1] != shape[-1]:
        return None
    placed, i = [], 0
    for j, size in enumerate(shape):  # (its last dim placed at the last: the features)
        if i < len(have) and have[i] == size and (i < len(have) - 1) == (j < len(shape) - 1):
            placed.append(size)
            i += 1
        else:
            placed.append(1)
    return value.reshape(placed) if i == len(have) else None


def _broadcastable(value: Any, shape: tuple[int, ...], lead: tuple[int, ...], shared: bool = False) -> Any:
    """A factor's value viewed to broadcast against ``shape`` ([*lead] or [*lead, D]): whole, one per batch and
    head ([*lead, 1]), one number, or one per head (:func:`_heads`, broadcast over the batch); ``shared``: a
    vector the last of the lead's dims shares before one per batch and head (:attr:`PerStep.shared`)."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value
    if value.numel() == 1:
        return value.reshape(())
    if value.numel() == math.prod(shape):
        return value.reshape(shape)
    if shared and len(shape) > len(lead) and (placed := _shared_by(value, shape)) is not None:
        return placed
    tail = (1,) * (len(shape) - len(lead))
    if value.numel() == math.prod(lead):
        return value.reshape(tuple(lead) + tail)
    if (shared := _shared_by(value, shape)) is not None:
        return shared
    heads = _heads(value)
    return heads.reshape(tuple(heads.shape) + tail)


@dataclass
class Recurrence:
    """A scan body proven to be one memory step."""

    kind: str  # "lp" (memory_scan) or "hebbian" (linear_attention)
    layout: str  # "vk": M is [.., Dv, Dk], read contracts its last dim; "kv": M is [.., Dk, Dv]
    lead: tuple[int, ...]  # the leading dims of M (batch, heads)
    dv: int
    dk: int
    state: int  # index of M among the carries
    momentum_state: int | None = None
    momentum_scale: float = 1.0  # the model's buffer is the op's S divided by this (M ← a·M + c·S)
    momentum_scale_factors: list = field(default_factory=list)  # and by these tensors every step reads alike (lr·S)
    normaliser_state: int | None = None
    per_step: dict[str, PerStep] = field(default_factory=dict)  # k, v, q [*lead, D]; alpha, eta, beta [*lead]
    params: dict[str, float] = field(default_factory=dict)
    read_before_update: bool = False  # y_t reads M_{t−1} (retrieve, then write) instead of M_t
    read_node: fx.Node | None = None  # the read, where the step's output is a per-step function of it
    # the normaliser's read z·q, where the output is a function of it and the read (mLSTM's M q / max(|z·q|, 1))
    normaliser_read: fx.Node | None = None
    per_row: bool = False  # the memory carried as one per row (:mod:`memory_heads`): its decay is one per row
    generated: set = field(default_factory=set)  # the nodes of g(e) where the op generates it from them
    detached: bool = False  # the new state detached at every step (test-time training): gradients reach q alone

    @property
    def name(self) -> str:
        if self.kind == "hebbian":
            return "Hebbian" + (" normalised" if self.normaliser_state is not None else "")
        if self.params.get("q_norm", 2.0) != 2.0:
            return "MONETA L_q retention"
        return "GD with momentum" if self.momentum_state is not None else "GD"


# ---------------------------------------------------------------- the analysis

def _read(M: torch.Tensor, x: torch.Tensor, layout: str) -> torch.Tensor:
    return torch.einsum("...ac,...c->...a" if layout == "vk" else "...ac,...a->...c", M, x)


def _outer(g: torch.Tensor, k: torch.Tensor, layout: str) -> torch.Tensor:
    return g.unsqueeze(-1) * k.unsqueeze(-2) if layout == "vk" else k.unsqueeze(-1) * g.unsqueeze(-2)


def _lq(A: torch.Tensor, q: float, eps: float) -> torch.Tensor:
    if q == 2.0:
        return A
    return A * (A.abs().pow(q).sum((-2, -1), keepdim=True) + eps).pow(-(q - 2.0) / q)


def _bias(e: torch.Tensor, p: float, a: float, eps: float) -> torch.Tensor:
    if p == 2.0:
        return 2.0 * e
    if p == 1.0:
        return torch.tanh(a * e)
    return p * torch.tanh(a * e) * (e * e + eps).pow((p - 1.0) / 2.0)


class _Body:
    def __init__(self, body: fx.GraphModule, n_carries: int, n_xs: int | None = None):
        from hecate.passes.memory_heads import ROW_GATES

        self.graph = body.graph
        by_name = {n.name: n for n in body.graph.nodes} if ROW_GATES in body.meta else {}
        self.row_gates = {by_name[a]: by_name[g] for a, g in body.meta.get(ROW_GATES, {}).items()
                          if a in by_name and g in by_name}
        # a memory split per row [.., A, 1, C]: a key or query [B, C] is one every row shares, also where A = C
        self.per_row = ROW_GATES in body.meta
        self.placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
        self.outputs = list(next(iter(reversed(body.graph.nodes))).args[0])
        self.carries = self.placeholders[:n_carries]
        # what every step reads alike (the scan's invariants: parameters, numbers held in tensors); unknown: none
        shared = set(self.placeholders[n_carries + n_xs:]) if n_xs is not None else set()
        self.invariant: dict[fx.Node, bool] = {}
        for n in body.graph.nodes:
            self.invariant[n] = n in shared or (n.op in ("call_function", "get_attr") and all(
                self.invariant[i] for i in n.all_input_nodes))
        self.carry_out = self.outputs[:n_carries]
        self.ys = self.outputs[n_carries:]
        self.compute = [n for n in body.graph.nodes if n.op == "call_function"]
        self.depends: dict[fx.Node, set[int]] = {}
        for n in body.graph.nodes:
            if n in self.carries:
                self.depends[n] = {self.carries.index(n)}
            else:
                self.depends[n] = set().union(*(self.depends.get(i, set()) for i in n.all_input_nodes))
        # signed inputs where the body is finite at them, else positive ones (gates, roots and logs stay real)
        for self.signed in (True, False):
            self.env = _evaluate(self.graph, _random_inputs(self.placeholders, 0, set(self.carries), self.signed))
            if all(torch.isfinite(self.env[n]).all() for n in self.outputs if isinstance(self.env.get(n), torch.Tensor)
                   and self.env[n].is_floating_point()):
                break

    def per_step_nodes(self, shape: tuple[int, ...]) -> list[fx.Node]:
        """Nodes that depend on no state and hold a value of ``shape`` (up to size-1 dims), the last computed
        first: of values equal at the sample points (q and clamp(q, −10, 10)), the one the step reads."""
        return [n for n in reversed(self.graph.nodes) if n.op in ("placeholder", "call_function")
                and not self.depends[n] and _as(self.env.get(n), shape) is not None]

    def literals(self, nodes: set[fx.Node]) -> set[float]:
        found = set()
        for n in nodes:
            for a in torch.utils._pytree.tree_leaves((n.args, n.kwargs)):
                if isinstance(a, (int, float)) and not isinstance(a, bool):
                    found.add(float(a))
        return found

    def between(self, source: fx.Node, sinks: list[fx.Node]) -> set[fx.Node]:
        """Nodes on a path from ``source`` to one of ``sinks`` (both included)."""
        down, stack = {source}, [source]
        while stack:
            for u in stack.pop().users:
                if u not in down:
                    down.add(u)
                    stack.append(u)
        up, stack = set(sinks), list(sinks)
        while stack:
            for i in stack.pop().all_input_nodes:
                if i not in up:
                    up.add(i)
                    stack.append(i)
        return down & up


def analyse(body: fx.GraphModule, n_carries: int, n_xs: int | None = None) -> Recurrence:
    """Prove ``body`` (a scan body: carries first, then ``n_xs`` per-step inputs, then what every step reads) is one
    memory step; raise :class:`NotFused` if not."""
    try:
        b = _Body(body, n_carries, n_xs)
    except (RuntimeError, TypeError, ValueError) as why:  # an op that does not run on float64 sample points
        raise NotFused(f"the loop body could not be evaluated at sample points ({type(why).__name__}: "
                       f"{str(why).splitlines()[0] if str(why) else ''})") from None
    stop = first_gradient_stop(body)
    if stop is not None:  # (M.detach() every step, a write under torch.no_grad(): said so, not what it reads as)
        raise NotFused(gradient_stop_reason(stop))
    if len(b.ys) > 1:
        raise NotFused(f"the loop produces {len(b.ys)} per-step outputs; a memory loop produces its reads y_t")
    matrices = [i for i, c in enumerate(b.carries)
                if isinstance(b.env[c], torch.Tensor) and b.env[c].is_floating_point() and b.env[c].dim() >= 2]
    candidates = [i for i in matrices if b.env[b.carries[i]].dim() >= 3]
    if any(b.env[b.carries[i]].numel() == 0 for i in candidates or matrices):
        sizes = " and ".join(str(list(b.env[b.carries[i]].shape)) for i in candidates or matrices)
        raise NotFused(f"the carried state {sizes} has no elements (a batch of 0 sequences, say): there is no "
                       "step to check, and nothing to compute")
    skipped = next((c for i in candidates or matrices if (c := _kept_where(b.carry_out[i], b.carries[i]))), None)
    if skipped is not None:
        raise NotFused(f"the new memory is chosen by torch.where ({source_line([skipped]) or skipped.name}): the "
                       "step's memory where a flag is set, the old one where not (a step skipped at padding or past "
                       "a sequence's end); the op has no such select: write it as a gate, M + f·(new − M) with "
                       "f = flag.float(), which fuses (it differs where new is not finite)")
    found = _first_fit(b, candidates or matrices)  # one sequence's memory [Dv, Dk] (torch.addr) where no batched one
    if isinstance(found, Recurrence):
        return found
    if not candidates:
        raise NotFused("no matrix state is carried from step to step (a memory M [.., Dv, Dk])" + (
            "" if found is None else f"; read as one sequence's memory [Dv, Dk], the 2-D state "
            f"{' and '.join(str(list(b.env[b.carries[i]].shape)) for i in matrices)} is no memory step either: {found}"))
    raise found


def _first_fit(b: _Body, candidates: list[int]) -> Recurrence | NotFused | None:
    """The memory step of the first of the ``candidates`` states that is one (the largest first), else
    why not (None without candidates)."""
    why = None
    for m in sorted(candidates, key=lambda i: -b.env[b.carries[i]].dim()):
        try:
            return _analyse_state(b, m)
        except NotFused as e:
            why = e if why is None or "per-step output is not" in str(why) else why
    return why


def _find_read(b: _Body, m: int, y: fx.Node, q_norm: float, lq_eps: float) -> tuple | None:
    """((layout, q, z index, eps), read before the update) when ``y`` = read(W_new, q) for one per-step q, in
    one layout (or normalised by z·q + eps), or (plain) read(M_old, q); else None."""
    M_in, M_out = b.carries[m], b.carry_out[m]
    Mv = b.env[M_in]
    lead, (A, C) = tuple(Mv.shape[:-2]), tuple(Mv.shape[-2:])
    W_out_val = _lq(b.env[M_out], q_norm, lq_eps)
    for layout, d_in, d_out in (("vk", C, A), ("kv", A, C)):
        y_val = _as(b.env[y], lead + (d_out,))
        if y_val is None:
            continue
        for qn in b.per_step_nodes(lead + (d_in,)):
            r = _read(W_out_val, _as(b.env[qn], lead + (d_in,)), layout)
            if _close(y_val, r):
                return (layout, qn, None, None), False
            normalised = _normaliser(b, m, r, y_val, _as(b.env[qn], lead + (d_in,)), b.env)
            if normalised is not None:
                return (layout, qn) + normalised, False
    if q_norm == 2.0:  # retrieve, then write: y_t = M_{t−1}·q_t
        read = _plain_read(b, m, y, b.env[M_in], lead, A, C)
        if read is not None:
            return read, True
    return None


def _read_then_per_step(b: _Body, m: int, q_norm: float, lq_eps: float) -> tuple | None:
    """(read node, its read, the normaliser's read node or None) when the step's output is a per-step function of
    a read of the memory (plain or normalised) and of per-step inputs alone (y_t = W_o (M q_t), LayerNorm(M q_t),
    silu(M q_t) + q_t), or of a plain read and the normaliser's read z·q (mLSTM's M q / max(|z·q|, 1)): the op
    reads, the function runs after it, step by step."""
    y = b.ys[0]
    for n in reversed(b.compute):
        if n is y or m not in b.depends[n] or n not in b.between(b.carries[m], [y]):
            continue
        if _only_through(b, y, n):
            found = _find_read(b, m, n, q_norm, lq_eps)
            if found is not None:
                return n, found, None
        elif q_norm == 2.0 and (found := _find_read(b, m, n, q_norm, lq_eps)) is not None and found[0][2] is None \
                and found[0][1] is not None and (normaliser := _normaliser_read(b, m, n, found)) is not None:
            z_read, z_index = normaliser
            (layout, qn, _, _), before = found
            return n, ((layout, qn, z_index, None), before), z_read
    return None


def _normaliser_read(b: _Body, m: int, read: fx.Node, found: tuple) -> tuple[fx.Node, int] | None:
    """(the node, the carry z's index) of the first node that is z·q, the read's query q against a carried z
    (z_new after the update, z_old where the memory is read before it), where the step's output reads the carries
    only through it and ``read``."""
    (layout, qn, _, _), before = found
    lead = tuple(b.env[b.carries[m]].shape[:-2])
    q = _as(b.env[qn], lead + (b.env[b.carries[m]].shape[-1 if layout == "vk" else -2],))
    for node in b.compute:
        s = _as(b.env[node], lead + (1,))
        if s is None or node is read or not b.depends[node] or not _only_through(b, b.ys[0], read, node):
            continue
        for i, (z_in, z_out) in enumerate(zip(b.carries, b.carry_out)):
            z = _as(b.env[z_in if before else z_out], q.shape) if i != m else None
            if z is not None and _close(s, (z * q).sum(-1, keepdim=True)):
                return node, i
    return None


def _only_through(b: _Body, y: fx.Node, *via: fx.Node) -> bool:
    """Whether ``y`` reads the loop's carries only through ``via`` (or their sizes: ones_like(n[..., 0]) under
    dynamic shapes reads the size of a carry, which is every step's)."""
    return not _upstream(y, *via, sizes=False) & set(b.carries)


def _upstream(y: fx.Node, *via: fx.Node, sizes: bool = True) -> set[fx.Node]:
    """``y`` and what it is computed from, not looking past ``via`` (nor, without ``sizes``, past a size read)."""
    seen, stack = {y}, [y]
    while stack:
        node = stack.pop()
        if not sizes and node.target is aten.sym_size.int:
            continue
        for i in node.all_input_nodes:
            if i not in seen and i not in via:
                seen.add(i)
                stack.append(i)
    return seen


def _analyse_state(b: _Body, m: int) -> Recurrence:
    q_norm, lq_eps, W_in = _state_transform(b, m)
    if not b.ys:  # only the final memory is read (a prefill): no read tells the layout; the update does
        first = None
        for layout in ("vk", "kv"):
            try:
                return _analyse_step(b, m, ((layout, None, None, None), False), None, q_norm, lq_eps, W_in)
            except NotFused as why:
                first = first or why
        raise first
    found, first = _find_read(b, m, b.ys[0], q_norm, lq_eps), None
    if found is not None:
        try:
            return _analyse_step(b, m, found, None, q_norm, lq_eps, W_in)
        except NotFused as why:  # the output equal to a read at the sample points only (|z·q| of positive
            first = why  # features read as z·q, a bound the op would drop): read as a function of the reads
    if (after := _read_then_per_step(b, m, q_norm, lq_eps)) is None:
        raise first or NotFused(f"{_NO_READ} y = M·q of the new or the old state, nor "
                                "y / (z·q + eps) of the new or the old state and normaliser, nor a function of such "
                                "a read (or of M·q and z·q) and the step's inputs alone, for any per-step input q")
    read_node, found, z_read = after
    try:
        return _analyse_step(b, m, found, read_node, q_norm, lq_eps, W_in, z_read)
    except NotFused:
        if first is None:
            raise
        raise first from None


def _analyse_step(b: _Body, m: int, found: tuple, read_node: fx.Node | None, q_norm: float, lq_eps: float,
                  W_in: fx.Node, z_read: fx.Node | None = None) -> Recurrence:
    """The memory step of state ``m`` read as ``found`` (see :func:`_find_read`; its q None where no step reads
    the memory: the op then reads with the keys, and its reads are dropped); ``z_read``: the normaliser's read z·q
    the output is a function of beside the read ``read_node``."""
    M_in, M_out = b.carries[m], b.carry_out[m]
    Mv = b.env[M_in]
    lead, (A, C) = tuple(Mv.shape[:-2]), tuple(Mv.shape[-2:])
    (layout, qn, z_index, norm_eps), before = found
    reset = next((n for n in b.compute if n.target in _WHERE and _resets(n, M_in)), None)
    if reset is not None:
        raise NotFused("the memory is reset by where(flag, 0, M), which clears a NaN or inf it holds where a gate "
                       "(the op's decay) multiplies it: write the reset M * (1 - flag) or M * ~flag, which fuses "
                       "where that is what is meant")
    dv, dk = (A, C) if layout == "vk" else (C, A)
    rec = Recurrence("lp", layout, lead, dv, dk, m, params={"q_norm": q_norm}, read_before_update=before,
                     read_node=read_node, normaliser_read=z_read)
    if qn is not None:
        rec.per_step["q"] = PerStep(1.0, [qn], shared=b.per_row)
    # M_out = Σ terms: a·M (retention), the update, and with momentum the new buffer c·S (any number c ≠ 0:
    # M ← a·M − S with S ← β·S + η·g kᵀ, as torch.optim.SGD writes it, is the op's S' = c·S)
    retention, update, momentum = [], [], None
    for sign, term in _terms(M_out, stop=frozenset(b.carry_out) - {M_out}, views=True):
        prod = _gates_as_read(b, _product(term), lead)
        prod.coef *= sign
        if prod.factors.count(M_in) == 1 and all(not b.depends[f] for f in prod.factors + prod.divisors
                                                 if f is not M_in):
            prod.factors.remove(M_in)
            retention.append(prod)
        elif momentum is None and (buffer := _scaled_buffer(b, prod, M_out)) is not None:
            (momentum, scale_factors), scale = buffer, prod.coef
        else:
            update.append(prod)
    if momentum is not None:
        if update:
            raise NotFused("with a momentum buffer, the memory's update is M ← a·M + c·S")
        S_in, S_out = b.carries[momentum], b.carry_out[momentum]
        for f in scale_factors:
            if not _is_gate(b.env[f], lead):
                raise NotFused(f"the momentum buffer enters the memory scaled by a factor of shape "
                               f"{list(b.env[f].shape)}, not one number per batch and head {list(lead)}")
        decays = []  # β·S: β a number, or a gate (per step, learned, data-dependent: HOPE Eq 51's α_{i+1})
        for sign, term in _terms(S_out):
            prod = _product(term)
            prod.coef *= sign
            if prod.factors.count(S_in) == 1 and all(not b.depends[f] for f in prod.factors + prod.divisors
                                                     if f is not S_in):
                prod.factors.remove(S_in)
                decays.append(prod)
            else:
                prod.coef *= scale
                prod.factors += scale_factors
                update.append(prod)
        if not decays:
            raise NotFused("the momentum buffer S is not kept from step to step (S ← β·S − η·g kᵀ)")
        beta = _keep(decays)
        for f in beta.factors + beta.divisors:
            if not _is_gate(b.env[f], lead):
                raise NotFused(f"the momentum's decay has a factor of shape {list(b.env[f].shape)}, neither one "
                               f"number, nor one per batch and head {list(lead)}, nor one per head broadcast over "
                               "the batch")
        if beta.factors or beta.divisors or beta.offset is not None:
            rec.per_step["beta"], rec.params["momentum"] = beta, 1.0  # the op's decay: 1.0 · β_t
        else:
            rec.params["momentum"] = beta.coef
        rec.momentum_state, rec.momentum_scale, rec.momentum_scale_factors = momentum, scale, scale_factors
    if len(update) != 1:
        kept_through = [f for prod in update for f in prod.factors  # (tanh(M): no linear function of M)
                        if _nonlinear_pointwise(f) and M_in in f.all_input_nodes]
        if not retention and kept_through:
            raise NotFused(f"the new memory keeps the old one through {op_name(kept_through[0])} of it, not as "
                           "a·M: the step is not linear in the memory")
        raise NotFused(f"the new memory is not a·M plus one update term ({len(update)} update terms)")
    (update,) = update
    squashed = [f for f in update.factors if _nonlinear_pointwise(f) and len(_terms(f.args[0])) > 1
                and any(M_in in _product(t).factors for _, t in _terms(f.args[0]))]
    if not retention and squashed:  # tanh(a·M + v kᵀ): the whole new memory through a nonlinearity
        raise NotFused(f"the new memory is {op_name(squashed[0])} of a sum that keeps the old one (a·M + update): "
                       "the step is not linear in the memory")
    keep = _keep(retention)
    for f in keep.factors + keep.divisors:
        if not _is_gate(b.env[f], lead):
            raise NotFused(f"the memory's {_PER_ROW_DECAY} {list(b.env[f].shape)}, neither one number, nor "
                           f"one per batch and head {list(lead)}, nor one per head broadcast over the batch"
                           + _decay_advice(_scaled_per(M_in), b.env[M_in].shape,
                                           any(b.depends[f] for f in update.factors + update.divisors)))
    if any(b.depends[f] - {m} for f in update.factors + update.divisors):
        raise NotFused("the update reads another state")
    if z_index is not None or not any(b.depends[f] for f in update.factors + update.divisors):
        _hebbian(b, rec, update, keep, z_index, norm_eps)
    else:
        if z_index is not None:
            raise NotFused("a normalised read with an error-driven update")
        _lp(b, rec, update, keep, W_in, lq_eps)
    if qn is None:
        rec.per_step["q"] = rec.per_step["k"]
    others = set(range(len(b.carries))) - {m, rec.momentum_state, rec.normaliser_state}
    if others:
        raise NotFused("the loop also carries " + ", ".join(_carry_named(b, i) for i in sorted(others)) +
                       ", which the memory step does not update")
    _verify(b, rec)
    return rec


def _kept_where(M_out: fx.Node, M_in: fx.Node) -> fx.Node | None:
    """The ``where(flag, new, M)`` (or ``where(flag, M, new)``) the new memory is, new not zero (a reset, which
    :func:`_resets` reads); None if it is none."""
    node = M_out
    while isinstance(node, fx.Node) and node.target in _VIEWS:
        node = node.args[0]
    if not isinstance(node, fx.Node) or node.target not in _WHERE or _resets(node, M_in):
        return None
    return node if any(a is M_in or isinstance(a, fx.Node) and a.target in _VIEWS and a.args[0] is M_in
                       for a in node.args[1:3]) else None


def _resets(where: fx.Node, M: fx.Node) -> bool:
    """``where(flag, 0, M)`` or ``where(flag, M, 0)`` (M read directly or through a view)."""
    def is_memory(a):
        return a is M or isinstance(a, fx.Node) and a.target in _VIEWS and a.args[0] is M

    def is_zero(a):
        return isinstance(a, fx.Node) and is_zeros(a) or isinstance(a, (int, float)) and not isinstance(a, bool) \
            and a == 0

    branches = where.args[1:3]
    return len(branches) == 2 and (is_memory(branches[0]) and is_zero(branches[1])
                                   or is_memory(branches[1]) and is_zero(branches[0]))


def _scaled_buffer(b: _Body, prod: _Product, M_out: fx.Node) -> tuple[int, list[fx.Node]] | None:
    """(index of the carry S, the tensors scaling it) when ``prod`` is c·S for another carry's new value S, c a
    number times what every step reads alike (a learned step size: M ← M − lr·S); None if it is no such term;
    NotFused where S is scaled by a per-step value."""
    buffers = [f for f in prod.factors if f in b.carry_out and f is not M_out]
    if prod.divisors or len(buffers) != 1:
        return None
    others = [f for f in prod.factors if f is not buffers[0]]
    if all(b.invariant[f] for f in others):
        return (b.carry_out.index(buffers[0]), others) if prod.coef != 0 else None
    if not any(b.depends[f] for f in others):
        raise NotFused("the momentum buffer enters the memory scaled by a per-step value (M ← a·M − η_t·S): the "
                       "op's buffer would be η_t·S, decayed by β·η_t/η_{t−1}, a ratio across steps no step "
                       "computes (a step size inside the buffer, S ← β·S + η_t·∇, fuses)")
    return None


def _nonlinear_pointwise(f: Any) -> bool:
    """Whether ``f`` is a pointwise op that is no linear function of its inputs (tanh, exp; not mul, add, ...)."""
    return isinstance(f, fx.Node) and f.op == "call_function" and isinstance(f.target, torch._ops.OpOverload) \
        and torch.Tag.pointwise in f.target.tags \
        and f.target not in (aten.mul.Tensor, aten.div.Tensor, aten.add.Tensor, aten.sub.Tensor, aten.neg.default)


def _plain_read(b: _Body, m: int, y: fx.Node, W: torch.Tensor, lead: tuple, A: int, C: int) -> tuple | None:
    """(layout, q, None, None) when ``y`` is read(W, q) of the old state W for a per-step q, (layout, q, z index,
    eps) when it is that read normalised by the old z·q + eps; else None."""
    for layout, d_in, d_out in (("vk", C, A), ("kv", A, C)):
        y_val = _as(b.env[y], lead + (d_out,))
        if y_val is None:
            continue
        for qn in b.per_step_nodes(lead + (d_in,)):
            r = _read(W, _as(b.env[qn], lead + (d_in,)), layout)
            if _close(y_val, r):
                return layout, qn, None, None
            normalised = _normaliser(b, m, r, y_val, _as(b.env[qn], lead + (d_in,)), b.env, old=True)
            if normalised is not None:
                return (layout, qn) + normalised
    return None


def _keep(retention: list) -> PerStep:
    """What the new memory keeps of the old: none (0), terms c·M with numbers c (summed: ``M − 0.1·M``), and
    at most one gate a·M (``M − α·M``: a number and a gate)."""
    constant = [r for r in retention if not r.factors and not r.divisors]
    gated: dict[tuple, _Product] = {}  # the terms of one gate summed (w·M − w·M of a lerp: none)
    for r in retention:
        if r.factors or r.divisors:
            key = (tuple(r.factors), tuple(r.divisors))
            gated[key] = _Product(gated[key].coef + r.coef, r.factors, r.divisors) if key in gated else r
    gated = [r for r in gated.values() if r.coef != 0]
    kept = sum(r.coef for r in constant)
    if not gated:
        return PerStep(kept, [])
    if len(gated) == 1:
        (r,) = gated
        return PerStep(-r.coef, r.factors, r.divisors, offset=kept) if constant else PerStep(r.coef, r.factors,
                                                                                               r.divisors)
    raise NotFused(f"the new memory keeps the old one through {len(gated)} gated terms")


def _state_transform(b: _Body, m: int) -> tuple[float, float, fx.Node]:
    """MONETA reads W = M / (Σ|M|^q + eps)^((q−2)/q): (q, eps, the node of W) — or (2, 0, M) when it reads M."""
    M_in = b.carries[m]
    Mv = b.env[M_in]
    other_form = None  # an L_q normalisation up to where its eps goes (or a clamp instead of one)
    for n in b.compute:
        if b.depends[n] != {m} or not isinstance(b.env.get(n), torch.Tensor) or b.env[n].shape != Mv.shape:
            continue
        if n.target in _VIEWS or _close(b.env[n], Mv) or \
                {p for p in _ancestors(n) if p.op == "placeholder"} != {M_in}:
            continue
        lits = b.literals(b.between(M_in, [n]))
        for q, eps in itertools.product(sorted(lits), sorted(lits)):
            if q > 2 and eps > 0 and _close(b.env[n], _lq(Mv, q, eps)):
                return q, eps, n
        other_form = other_form or next((q for q in sorted(lits) if q > 2 and torch.allclose(
            b.env[n], _lq(Mv, q, 0.0), rtol=1e-4, atol=0.0)), None)
    if other_form is not None:
        raise NotFused(f"the memory is read through an L_q normalisation (q = {other_form:g}) of another form than "
                       "MONETA's W = M / (Σ|M|^q + eps)^((q−2)/q), which memory_scan computes: eps added outside the "
                       "root, or the norm clamped, differs from it near M = 0")
    return 2.0, 0.0, M_in


def _normaliser(b: _Body, m: int, r: torch.Tensor, y: torch.Tensor, q: torch.Tensor,
                env: dict[fx.Node, Any], old: bool = False) -> tuple[int, float] | None:
    """(index of z, eps) when y = r / (z_new·q + eps) (``old``: z_old, a read before the update) for a carried z,
    at the point ``env``: eps a number, or the index among the body's inputs of the one number every step reads it
    from (a float argument that ``dynamic=True`` passes in as a tensor)."""
    for i, z_out in enumerate(b.carry_out):
        z = _as(env[b.carries[i] if old else z_out], q.shape)
        if i == m or z is None:
            continue
        eps = r / y - (z * q).sum(-1, keepdim=True)
        eps0 = snapped(float(eps.flatten()[0]))
        if _close(eps, torch.full_like(eps, eps0)):
            read = [j for j, ph in enumerate(b.placeholders) if b.invariant[ph] and isinstance(env[ph], torch.Tensor)
                    and env[ph].numel() == 1 and env[ph].is_floating_point()
                    and _close(env[ph].reshape(()).to(eps.dtype), eps.flatten()[0])]
            return i, (("input", read[0]) if read else eps0)
    return None


def _hebbian(b: _Body, rec: Recurrence, update: _Product, keep: PerStep, z_index: int | None,
             eps: float | None) -> None:
    """update = b·outer(v, k): find v and k among the factors; with a normaliser z ← a·z + k."""
    rec.kind = "hebbian"
    M_out = b.env[b.carry_out[rec.state]] - keep.value(b.env, rec.lead)[..., None, None] * b.env[b.carries[rec.state]]
    factors, written = update.factors, False
    for vn, kn in itertools.permutations(factors, 2):
        if _as(b.env[vn], rec.lead + (rec.dv,)) is None or _as(b.env[kn], rec.lead + (rec.dk,)) is None \
                or not all(_is_gate(b.env[d], rec.lead) for d in update.divisors):
            continue
        rest = [f for f in factors if f is not vn and f is not kn]
        for v, k in _outer_roles(b, rec, M_out, PerStep(update.coef, [vn], update.divisors), PerStep(1.0, [kn]), rest):
            written = True  # b folds into v: linear_attention adds v kᵀ
            roles = (v, k) if z_index is None else _summed_key(b, rec, keep, z_index, v, k)
            if roles is not None:
                rec.per_step["v"], rec.per_step["k"] = roles
                rec.per_step["alpha"] = keep
                if z_index is not None:
                    rec.normaliser_state, rec.params["eps"] = z_index, eps
                return
    if written:
        raise NotFused("the normaliser is not z ← a·z + k with the memory's decay a and the key k the memory "
                       "writes (b·k, where the write v (b·k)ᵀ has a strength b)")
    others = [f for f in factors if _as(b.env[f], rec.lead + (rec.dk,)) is None
              and _as(b.env[f], rec.lead + (rec.dv,)) is None and not _is_gate(b.env[f], rec.lead)]
    raise NotFused("the update adds a term that is not an outer product of two per-step vectors b·v kᵀ" + (
        f" (its factor, {_named(b, others[0])}, is neither a per-step vector, "
        "nor one number per head, nor a vector every step shares that scales the key or the value by feature)"
        if others else ""))


def _summed_key(b: _Body, rec: Recurrence, keep: PerStep, z_index: int, v: PerStep,
                k: PerStep) -> tuple[PerStep, PerStep] | None:
    """(v, k) such that the normaliser is z ← a·z + k, the write strength b on the key's side when z sums it too
    (mLSTM: C ← f·C + v (i·k)ᵀ, n ← f·n + i·k); None if neither reading is."""
    z_in, z_out = b.carries[z_index], b.carry_out[z_index]
    z = _as(b.env[z_out], rec.lead + (rec.dk,))
    decayed = keep.value(b.env, rec.lead)[..., None] * _as(b.env[z_in], rec.lead + (rec.dk,))
    strong_key = PerStep(v.coef, k.factors + v.factors[1:], v.divisors, features=k.features)
    for key, value in ((k, v), (strong_key, PerStep(1.0, v.factors[:1], features=v.features))):
        if z is not None and _close(z, decayed + key.value(b.env, rec.lead, rec.dk)):
            return value, key
    return None


def _outer_roles(b: _Body, rec: Recurrence, M_out: torch.Tensor, v: PerStep, k: PerStep,
                 rest: list[fx.Node]) -> Iterator[tuple[PerStep, PerStep]]:
    """Each (v, k) with each of the update's ``rest`` factors taken as a gate (into v) or as a feature of v or of
    k, such that M_out = outer(v, k). A vector of as many numbers as there are heads may be either, and only
    evaluation tells which (each factor's readings are few: at most 3 such factors); a normaliser tells on which
    side a per-head scale is (z sums the key)."""
    readings = []
    for f in rest:
        value = b.env[f]
        roles = ([("gate", v)] if _is_gate(value, rec.lead) else []) + \
            ([("feature", v)] if _is_feature(value, rec.lead + (rec.dv,)) else []) + \
            ([("feature", k)] if _is_feature(value, rec.lead + (rec.dk,)) else [])
        if not roles:
            return
        readings.append(roles)
    if sum(len(r) > 1 for r in readings) > 3:
        return
    for reading, shared in itertools.product(itertools.product(*readings), (False, True)):
        vv = PerStep(v.coef, list(v.factors), list(v.divisors), features=list(v.features), shared=shared)
        kk = PerStep(k.coef, list(k.factors), list(k.divisors), features=list(k.features))
        for f, (role, side) in zip(rest, reading):
            target = vv if side is v else kk
            (target.factors if role == "gate" else target.features).append(f)
        if shared and not any(b.env[f].numel() == math.prod(rec.lead) for f in vv.factors + vv.divisors
                              if isinstance(b.env[f], torch.Tensor)):
            continue  # (no factor the lead's size: the same reading as before)
        if _close(M_out, _outer(vv.value(b.env, rec.lead, rec.dv), kk.value(b.env, rec.lead, rec.dk), rec.layout)):
            yield vv, kk


def _error(b: _Body, rec: Recurrence, W: torch.Tensor) -> tuple | None:
    """(e, k, v, sign) for a body node e = sign · (read(W, k) − v) with per-step k and v, else None."""
    ks = b.per_step_nodes(rec.lead + (rec.dk,))
    vs = b.per_step_nodes(rec.lead + (rec.dv,))
    reads = {kn: _read(W, _as(b.env[kn], rec.lead + (rec.dk,)), rec.layout) for kn in ks}
    for en in b.compute:
        e = _as(b.env[en], rec.lead + (rec.dv,)) if b.depends[en] == {rec.state} else None
        if e is None:
            continue
        for (kn, r), vn in itertools.product(reads.items(), vs):
            v = _as(b.env[vn], rec.lead + (rec.dv,))
            for sign in (1.0, -1.0):
                if _close(e, sign * (r - v)):
                    return en, kn, vn, sign
    return None


def _lp(b: _Body, rec: Recurrence, update: _Product, keep: PerStep, W_in: fx.Node, lq_eps: float) -> None:
    """update = −η·outer(G(e), k): find e = read(W, k) − v, k, the gates, and identify G."""
    m = rec.state
    W = b.env[W_in] if W_in is not b.carries[m] else b.env[b.carries[m]]
    found = _error(b, rec, W)
    decays = keep.factors or keep.coef != 1.0 or keep.offset is not None
    if found is None and decays:  # decay, then the delta rule: e = (a·M)·k − v, Gated DeltaNet's order
        found = _error(b, rec, keep.value(b.env, rec.lead)[..., None, None] * W)
        if found is not None and (rec.momentum_state is not None or rec.params["q_norm"] != 2.0):
            raise NotFused("the error e = (a·M)·k − v is formed from the decayed memory (the decay applied before "
                           "the error, as Gated DeltaNet writes it) in a step with "
                           + ("momentum" if rec.momentum_state is not None else "MONETA's normalised memory") +
                           ": memory_scan takes that order only for the plain step")
        rec.params["decay_first"] = found is not None
    if found is None:
        other = "kv" if rec.layout == "vk" else "vk"
        if rec.dk == rec.dv and _error(b, dataclasses.replace(rec, layout=other), W) is not None:
            read, error = ("q·M", "M·k − v") if rec.layout == "kv" else ("M·q", "k·M − v")
            raise NotFused(f"the memory is read as {read} but its error is formed as {error}: the read and the "
                           "update use the memory in two layouts (transposed to each other), which no memory step "
                           "does")
        raise NotFused("no error e = M·k − v is formed from the memory (an l_p step reads the memory with its key "
                       "and compares with the value)")
    en, kn, vn, e_sign = found
    rec.per_step["k"], rec.per_step["v"] = PerStep(1.0, [kn], shared=b.per_row), PerStep(1.0, [vn])
    g_factors = [f for f in update.factors if b.depends[f]]
    g_divisors = [d for d in update.divisors if b.depends[d]]
    update.divisors = [d for d in update.divisors if not b.depends[d]]
    key = _key_factors(b, rec, [f for f in update.factors if f not in g_factors], update.divisors, kn)
    if key is None:
        raise NotFused("the update is not an outer product with the key that forms the error (g kᵀ)")
    update.coef *= key[2]  # the product's factors are s · k
    gates = [f for f in update.factors if f not in g_factors]
    for f in key[0]:
        gates.remove(f)
    update.divisors = [d for d in update.divisors if d not in key[1]]
    for f in gates + update.divisors:
        if not _is_gate(b.env[f], rec.lead):
            raise NotFused(f"the update's factor, {_named(b, f)}, is neither the key, nor a function of e, nor one "
                           "number per head (a gate)")
    # G: the g-factors as a function of e alone
    inside = b.between(en, g_factors + g_divisors)
    outside = {p for g in g_factors + g_divisors for p in _ancestors(g) if p.op == "placeholder"} - set(_ancestors(en))
    if outside:
        scalar = any(b.env[p].dim() == 0 for p in outside if isinstance(b.env.get(p), torch.Tensor))
        raise NotFused("the update's error factor g(e) also reads other inputs (" +
                       ", ".join(sorted(_named(b, p) for p in outside)) + "): the op generates g from e alone" +
                       ("; a 0-d one is a number held in a tensor (a buffer, a parameter, or a float attribute "
                        "torch.compile(dynamic=True) passes in as a tensor), which it cannot read (a Python number "
                        "fuses)" if scalar else ""))
    for g in g_factors + g_divisors:
        if b.env[g].numel() != b.env[en].numel():
            raise NotFused(f"the update's error factor g(e) is not elementwise in e: {_named(b, g)} has "
                           f"{b.env[g].numel()} values where e has {b.env[en].numel()}")
    grid = torch.cat([torch.linspace(-3, 3, 61, dtype=torch.float64),
                      torch.tensor([1e-4, -1e-4, 0.03, -0.07, 7.5, -11.0], dtype=torch.float64)])
    n = b.env[en].numel()
    grid = grid.repeat(n // grid.numel() + 1)[:n]

    def G(x: torch.Tensor) -> torch.Tensor:
        env = _evaluate(b.graph, {}, {en: (e_sign * x).reshape(b.env[en].shape)}, upto=inside)
        out = torch.ones_like(x)
        for g in g_factors:
            out = out * env[g].reshape(-1)
        for d in g_divisors:
            out = out / env[d].reshape(-1)
        return out

    try:
        gx = G(grid)
    except (RuntimeError, TypeError):  # it reads a value not computed from e (e read before it is written in place)
        raise NotFused("the update's error factor g(e) reads values not computed from e: the op generates g from "
                       "e alone") from None
    if not _close(G(grid.flip(0)), gx.flip(0)):
        raise NotFused("the update's error factor g(e) is not elementwise in e")
    # a g with a bound in it (2·clamp(e, −12, 12)) is generated as written: on a grid it may pass for 2e
    params = None if first_threshold(inside) is not None else _identify_bias(gx, grid, b.literals(inside))
    if params is None:  # any other pointwise g: the op generates it into its kernels
        p, a, eps, scale = 2.0, 10.0, lq_eps or 1e-6, 1.0
        rec.params["bias"] = _bias_expression(en, g_factors, g_divisors, e_sign)
        rec.generated = set(inside)
    else:
        p, a, eps, scale = params
        if rec.params["q_norm"] != 2.0 and p not in (1.0, 2.0) and not math.isclose(eps, lq_eps):
            raise NotFused(f"the bias's eps ({eps:g}) and MONETA's eps ({lq_eps:g}) differ; memory_scan takes one")
        if rec.params["q_norm"] != 2.0 and p in (1.0, 2.0):
            eps = lq_eps
    rec.params.update(p=p, a=a, eps=eps)
    # M_new = keep·M + coef·Π gates·G(e)·kᵀ = (1 − α)·M − η·bias(e)·kᵀ with η = −coef·scale·Π gates
    rec.per_step["eta"] = PerStep(-update.coef * scale, gates, update.divisors)
    if keep.offset is None:
        rec.per_step["alpha"] = PerStep(keep.coef, keep.factors, keep.divisors, offset=1.0)
    elif keep.offset == 1.0:  # keep = 1 − c·Π: α = c·Π
        rec.per_step["alpha"] = PerStep(keep.coef, keep.factors, keep.divisors)
    else:
        raise NotFused(f"the memory is kept as {keep.offset:g} − (a gate); memory_scan's retention is 1 − α")


def _key_factors(b: _Body, rec: Recurrence, factors: list[fx.Node], divisors: list[fx.Node],
                 kn: fx.Node) -> tuple[list[fx.Node], list[fx.Node], float] | None:
    """The factors and divisors of the update (not g's) whose product is the key ``kn`` up to a number s
    (the update read ``kt = k_t · 0.5`` as 0.5 · k_t: the 0.5 went to its coefficient, which s takes back):
    one vector, with the numbers per head and the vectors every step shares it is scaled by where the product
    reads the key apart
    (``F.normalize(k)`` is k / ‖k‖), and s; None if none is. s must be one number at two draws of the body's
    inputs: at batch 1 the norm ‖k‖ is a single number too, and taken as s it is not the same at the next draw."""
    shape = rec.lead + (rec.dk,)
    heads = [(f, False) for f in factors] + [(d, True) for d in divisors]
    heads = [(x, div) for x, div in heads if _as(b.env[x], rec.lead) is not None or b.env[x].numel() == 1
             or _same_rank_as(b.env[x], rec.lead)]
    heads += [(f, None) for f in factors if _is_feature(b.env[f], shape)]  # k_t ⊙ s: s scales it by feature
    draws = [b.env, _evaluate(b.graph, _random_inputs(b.placeholders, 2, set(b.carries), b.signed))]

    def scale_of(product: PerStep, env: dict) -> float | None:
        value, k = product.value(env, rec.lead, rec.dk), _as(env[kn], shape)
        scale = float((value * k).sum() / (k * k).sum()) if float((k * k).sum()) > 0 else 0.0
        return scale if scale != 0.0 and _close(value, scale * k) else None

    for vector in factors:
        if _as(b.env[vector], shape) is None:
            continue
        for n in range(len(heads) + 1):
            for scales in itertools.combinations(heads, n):
                over = [x for x, div in scales if div is False and x is not vector]
                under = [x for x, div in scales if div]
                features = [x for x, div in scales if div is None and x is not vector]
                if len(over) + len(under) + len(features) != n or len(set(over + features)) != len(over + features):
                    continue
                found = [scale_of(PerStep(1.0, [vector] + over, under, features=features, shared=b.per_row), env)
                         for env in draws]
                if None not in found and math.isclose(found[0], found[1], rel_tol=1e-6):
                    return [vector] + over + features, under, found[0]
    return None


def _bias_expression(e: fx.Node, g_factors: list[fx.Node], g_divisors: list[fx.Node], e_sign: float) -> str:
    """g = Π factors / Π divisors as a :mod:`hecate.lowering.pointwise` expression of e = M·k − v
    (the error node is ``e_sign``·e)."""
    from hecate.lowering import pointwise

    try:
        factors = [pointwise.extract(e, g) for g in g_factors]
        divisors = [pointwise.extract(e, d) for d in g_divisors]
    except pointwise.NotPointwise as why:
        raise NotFused(f"the bias gradient g(e) is not elementwise in e: {why}") from None

    def g(x):
        out = math.prod(pointwise.evaluate(f, e_sign * x) for f in factors)
        for d in divisors:
            out = out / pointwise.evaluate(d, e_sign * x)
        return out
    return pointwise.trace(g)


def _ancestors(node: fx.Node) -> set[fx.Node]:
    seen, stack = {node}, [node]
    while stack:
        for i in stack.pop().all_input_nodes:
            if i not in seen:
                seen.add(i)
                stack.append(i)
    return seen


def _identify_bias(g: torch.Tensor, e: torch.Tensor, literals: set[float]) -> tuple[float, float, float, float] | None:
    """(p, a, eps, scale) with g = scale · bias_p(e), or None. p = 2 and p = 1 are the op's exact fast paths."""
    def fits(reference: torch.Tensor) -> float | None:
        i = int(reference.abs().argmax())
        if reference[i] == 0:
            return None
        scale = float(g[i] / reference[i])
        return scale if scale != 0 and _close(g, scale * reference) else None

    scale = fits(2.0 * e)
    if scale is not None:
        return 2.0, 10.0, 1e-6, scale
    lits = sorted(x for x in literals if x > 0)
    for a in lits:
        scale = fits(torch.tanh(a * e))
        if scale is not None:
            return 1.0, a, 1e-6, scale
    ps = sorted({x for x in lits if x >= 1} | {2 * x + 1 for x in lits})
    for p, a, eps in itertools.product(ps, lits, lits):
        if p in (1.0, 2.0):
            continue  # the op computes its exact fast paths there, not this form
        scale = fits(_bias(e, p, a, eps))
        if scale is not None:
            return p, a, eps, scale
    return None


def _evaluate_bias(expr: str, e: torch.Tensor) -> torch.Tensor:
    from hecate.lowering import pointwise

    return pointwise.evaluate(expr, e)


def _no_bound_dropped(b: _Body, rec: Recurrence) -> None:
    """Raise NotFused where the body bounds or branches on data (a clamp, where, relu...) in a node the op
    neither reads (the per-step k, v, q and gates are computed as the body computes them) nor generates (g):
    the points the roles were checked at may never reach the bound (clamp(q, −10, 10))."""
    kept = set(rec.generated)
    for value in rec.per_step.values():
        for node in value.nodes:
            kept |= _ancestors(node)
    if rec.read_node is not None:  # what the output computes from the read runs as the body computes it
        kept |= _upstream(b.ys[0], rec.read_node, rec.normaliser_read)
    dropped = first_threshold((n for n in b.compute if n not in kept), b.env)
    if dropped is not None:
        raise NotFused(bound_reason(dropped, f"the step (a {rec.name} step at sample points)"))


def _verify(b: _Body, rec: Recurrence) -> None:
    """The whole step, at fresh random points, against the op's own equations with the recovered roles."""
    _no_bound_dropped(b, rec)
    env = _evaluate(b.graph, _random_inputs(b.placeholders, 1, set(b.carries), b.signed))
    lead = rec.lead
    k = rec.per_step["k"].value(env, lead, rec.dk)
    v = rec.per_step["v"].value(env, lead, rec.dv)
    q = rec.per_step["q"].value(env, lead, rec.dk)
    alpha = rec.per_step["alpha"].value(env, lead)[..., None, None]
    M = env[b.carries[rec.state]]
    if rec.layout == "kv":
        M = M.transpose(-1, -2)
    expect = {}
    if rec.kind == "hebbian":
        M_new = alpha * M + v.unsqueeze(-1) * k.unsqueeze(-2)
        y = (M if rec.read_before_update else M_new) @ q.unsqueeze(-1)
        y = y_read = y.squeeze(-1)
        if rec.normaliser_state is not None:
            z_in = _as(env[b.carries[rec.normaliser_state]], lead + (rec.dk,))
            z = alpha[..., 0] * z_in + k
            expect[b.carry_out[rec.normaliser_state]] = z
            z_q = ((z_in if rec.read_before_update else z) * q).sum(-1, keepdim=True)
            eps = rec.params["eps"]
            if rec.normaliser_read is not None:  # (the output a function of it and the read, which run after)
                expect[rec.normaliser_read] = z_q
            else:
                y = y / (z_q + (env[b.placeholders[eps[1]]].reshape(()) if isinstance(eps, tuple) else eps))
    else:
        eta = rec.per_step["eta"].value(env, lead)[..., None, None]
        p, a, eps, qn = rec.params["p"], rec.params["a"], rec.params["eps"], rec.params["q_norm"]
        read = (_lq(M, qn, eps) @ k.unsqueeze(-1)).squeeze(-1)
        e = ((1 - alpha[..., 0]) * read if rec.params.get("decay_first") else read) - v
        g = _bias(e, p, a, eps) if "bias" not in rec.params else _evaluate_bias(rec.params["bias"], e)
        U = g.unsqueeze(-1) * k.unsqueeze(-2)
        if rec.momentum_state is not None:
            scale = PerStep(rec.momentum_scale, rec.momentum_scale_factors).value(env, lead)[..., None, None]
            S = env[b.carries[rec.momentum_state]] * scale
            S = (S.transpose(-1, -2) if rec.layout == "kv" else S)
            decay = (rec.per_step["beta"].value(env, lead)[..., None, None] if "beta" in rec.per_step
                     else rec.params["momentum"])
            S_new = decay * S - eta * U
            M_new = (1 - alpha) * M + S_new
            S_new = S_new / scale
            expect[b.carry_out[rec.momentum_state]] = S_new.transpose(-1, -2) if rec.layout == "kv" else S_new
        else:
            M_new = (1 - alpha) * M - eta * U
        y = (_lq(M if rec.read_before_update else M_new, qn, eps) @ q.unsqueeze(-1)).squeeze(-1)
    expect[b.carry_out[rec.state]] = M_new.transpose(-1, -2) if rec.layout == "kv" else M_new
    if b.ys:
        expect[rec.read_node or b.ys[0]] = y
    for node, value in expect.items():
        got = _as(env[node], tuple(value.shape))
        if got is None or not _close(got, value):
            if node is b.ys[0] and rec.normaliser_state is not None and got is not None \
                    and _normaliser(b, rec.state, y_read, got, q, env, rec.read_before_update) is not None:
                raise NotFused("the read is normalised as y / (z·q + eps) with an eps that is another number at "
                               "each draw, computed in the loop from what it reads: the op takes eps as a number, or "
                               "reads it at run time from one tensor (a buffer, parameter or input) the loop reads "
                               "as it is")
            raise NotFused(f"the step differs from the {rec.name} equations at random points "
                           f"({node.name} does not match)")


# ---------------------------------------------------------------- replacing the scan by the op

def scans(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.higher_order.scan]


def recognise(gm: fx.GraphModule, node: fx.Node) -> Recurrence | NotFused:
    """The memory step of scan ``node``, or why it is none (analysed once per scan, kept in its meta)."""
    if "hecate_memory_step" not in node.meta:
        found = _recognised(gm, node)
        if isinstance(found, NotFused):
            found = _with_products_sunk(gm, node, found)
        node.meta["hecate_memory_step"] = found
    return node.meta["hecate_memory_step"]


def _recognised(gm: fx.GraphModule, node: fx.Node) -> Recurrence | NotFused:
    """The memory step of scan ``node`` as written, or once its body is rewritten by one of the readings below."""
    body = getattr(gm, node.args[0].target)
    stripped = _state_detach_stripped(body, len(node.args[1]))
    if stripped is not None:
        return _with_state_detached(gm, node, stripped)
    try:
        return analyse(body, len(node.args[1]), len(node.args[2]))
    except NotFused as why:
        found = _combined(gm, node, why)
        if isinstance(found, NotFused):
            found = _without_derived(gm, node, found)
        if isinstance(found, NotFused):
            found = _with_reads_apart(gm, node, found)
        if isinstance(found, NotFused):
            found = _per_row(gm, node, found)
        if isinstance(found, NotFused) and _stabilised(body, len(node.args[1])):
            found = NotFused("the step is stabilised by a carried running max, m ← max(log f + m, log i) (xLSTM's "
                             "mLSTM), which its gates exp(log i − m), exp(log f + m_old − m) read: a state no op "
                             "carries. The recurrent form without it, h = C q / max(|n·q|, 1), fuses (it can overflow "
                             "where exp(log i) is large, where this form does not)")
        return found


def _stabilised(body: fx.GraphModule, n_carries: int) -> bool:
    """Whether a carry's new value is max(·, ·) of what reads that carry itself (xLSTM's stabiliser m ← max(log f +
    m, log i)) where another carry is a memory (updated by an outer product)."""
    carries = [n for n in body.graph.nodes if n.op == "placeholder"][:n_carries]
    new = list(body.graph.output_node().args[0])[:n_carries]
    outers = set(_outer_products(body.graph))
    return any(isinstance(out, fx.Node) and computed_from([out], outers) for out in new) and any(
        isinstance(out, fx.Node) and out.target in (aten.maximum.default, aten.max.other)
        and computed_from([a for a in out.args if isinstance(a, fx.Node)], {carry}) for carry, out in zip(carries, new))


_NO_READ = "the per-step output is not the memory read"  # (the reason :func:`_with_reads_apart` reads)


def _with_reads_apart(gm: fx.GraphModule, node: fx.Node, why: NotFused) -> Recurrence | NotFused:
    """The memory step of scan ``node`` once each read of M + X is read as M's plus X's (:func:`memory_heads.
    reads_apart`: RWKV's bonus for the current token, r (S + diag(u) kᵀv)), its body then replaced; else ``why``
    it is none, as is."""
    from hecate.passes import memory_heads

    if _NO_READ not in str(why):
        return why
    body, n_carries, n_xs = getattr(gm, node.args[0].target), len(node.args[1]), len(node.args[2])
    for state in range(n_carries):
        rewritten = copy.deepcopy(body)
        M = [n for n in rewritten.graph.nodes if n.op == "placeholder"][state]
        value = M.meta.get("val")
        if not isinstance(value, torch.Tensor) or value.dim() < 2 \
                or not memory_heads.reads_apart(rewritten.graph, M, state):
            continue
        eliminate_dead_code(rewritten.graph)
        rewritten.recompile()
        try:
            rec = analyse(rewritten, n_carries, n_xs)
        except NotFused:
            continue
        setattr(gm, node.args[0].target, rewritten)
        return rec
    return why


def _state_detach_stripped(body: fx.GraphModule, n_carries: int) -> fx.GraphModule | None:
    """A copy of scan ``body`` without its gradient stops, where each is a new state detached as the step carries
    it (``M = (a·M + u).detach()``, or the update made under ``torch.no_grad()``, the grad mode's switches dropped
    too); None where the body has no stop or another one (a read under no_grad, M.detach() at the step's start)."""
    inputs = set(body.graph.find_nodes(op="placeholder"))
    stops = [n for n in body.graph.nodes if gradient_stop(n, inputs) is not None]
    carried = list(body.graph.output_node().args[0])[:n_carries]
    if not stops or any(n not in carried for n in stops):
        return None
    body = copy.deepcopy(body)
    graph = body.graph
    carried = list(graph.output_node().args[0])[:n_carries]
    for n in list(graph.nodes):
        if n in carried and n.target is aten.detach.default:
            n.replace_all_uses_with(n.args[0])
            graph.erase_node(n)
        elif n.op == "call_function" and n.target is torch._C._set_grad_enabled:
            graph.erase_node(n)
    graph.lint()
    body.recompile()
    return body


def _with_state_detached(gm: fx.GraphModule, node: fx.Node, stripped: fx.GraphModule) -> Recurrence | NotFused:
    """The memory step of scan ``node`` whose new state is detached at every step, as the step is without the
    detach, the op then run on inputs detached but the queries (so that gradients reach what eager's reach: the
    reads' queries). The scan keeps its body as written: the one read is installed only as the op replaces it."""
    original = getattr(gm, node.args[0].target)
    setattr(gm, node.args[0].target, stripped)
    rec = _recognised(gm, node)
    if isinstance(rec, NotFused):
        setattr(gm, node.args[0].target, original)
        stop = first_gradient_stop(original)
        return NotFused(gradient_stop_reason(stop) + f"; read without the stop, the step is none either: {rec}")
    rec.detached = True  # (the body as read is installed only to be replaced: gradients flow through it)
    node.meta["hecate_body_as_read"] = getattr(gm, node.args[0].target)
    setattr(gm, node.args[0].target, original)
    return rec


def _with_products_sunk(gm: fx.GraphModule, node: fx.Node, why: NotFused) -> Recurrence | NotFused:
    """The memory step of scan ``node`` whose update is made for every step before the loop (:mod:`sunk_products`:
    transformers' Mamba-1), once its body forms it; the scan then rewritten. Else ``why`` it is none, as is."""
    from hecate.passes import sunk_products

    if forms_outer_product(getattr(gm, node.args[0].target).graph):
        return why
    try:  # nothing here may fail the pass: any error leaves the scan exactly as it was
        found = sunk_products.sunk(gm, node)
    except Exception:
        return why
    if found is None:
        return why
    body, xs, invariants, emitted = found
    before = (node.args, getattr(gm, node.args[0].target))
    sunk_products.install(gm, node, body, xs, invariants)
    rec = _recognised(gm, node)
    if isinstance(rec, NotFused):
        node.args = before[0]
        setattr(gm, node.args[0].target, before[1])
        sunk_products.discard(gm, emitted)
        node.meta["hecate_update_made_before"] = True  # (a loop of the family's shape: reported with this reason)
        return NotFused(f"{rec} (the update made before the loop, read as formed in the step)")
    return rec


def _combined(gm: fx.GraphModule, node: fx.Node, why: NotFused) -> Recurrence | NotFused:
    """The memory step of scan ``node`` once its update is one term (:mod:`memory_update`: ``M (I − β k kᵀ) +
    β v kᵀ``), its body then replaced by the rewritten one; else ``why`` it is none (the rewritten body's reason
    where the body as written has more than one update term)."""
    from hecate.passes import memory_update

    found = _combined_body(getattr(gm, node.args[0].target), len(node.args[1]), len(node.args[2]),
                           memory_update.identity_inputs(gm, node), why)
    if isinstance(found, NotFused):
        return found
    rec, rewritten = found
    setattr(gm, node.args[0].target, rewritten)
    return rec


def _combined_body(body: fx.GraphModule, n_carries: int, n_xs: int, identities: set[int],
                   why: NotFused) -> tuple[Recurrence, fx.GraphModule] | NotFused:
    """:func:`_combined` on ``body``: (the memory step, the rewritten body), or why not."""
    from hecate.passes import memory_update

    for state in range(n_carries):
        rewritten = memory_update.combined(body, state, identities)
        if rewritten is None:
            continue
        try:
            rec = analyse(rewritten, n_carries, n_xs)
        except NotFused as other:  # (the rewritten body's reason where it is nearer: one update term now, or a
            # decay that is one per row, which :func:`_per_row` reads)
            why = other if "update term" in str(why) or _PER_ROW_DECAY in str(other) else why
            continue
        return rec, rewritten
    return why


_PER_ROW_DECAY = "decay has a factor of shape"  # (the reason :func:`_per_row` reads as a decay it may split per row)


def _per_row(gm: fx.GraphModule, node: fx.Node, why: NotFused) -> Recurrence | NotFused:
    """The memory step of scan ``node`` whose decay is one per row of a memory, once the body carries
    that memory as one per row (:mod:`memory_heads`: Mamba-1's h [B, D, N] with A [D] as D heads of Dv = 1); the
    scan then rewritten. Else ``why`` it is none, as is."""
    from hecate.passes import memory_heads, memory_update

    body, n_carries, n_xs = getattr(gm, node.args[0].target), len(node.args[1]), len(node.args[2])
    identities = memory_update.identity_inputs(gm, node)
    split_why = None  # why a memory scaled per row is no step split per row either
    for state, init in enumerate(node.args[1]):
        value = init.meta.get("val") if isinstance(init, fx.Node) else None
        if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.dim() < 2:
            continue
        per_row = _scaled_per([n for n in body.graph.nodes if n.op == "placeholder"][state]) == "row"
        if _PER_ROW_DECAY not in str(why) and not per_row:
            continue  # (a reason found before the decay's, where the state is scaled per row: its reads apart)
        rewritten = memory_heads.per_row(body, state, n_carries)
        try:
            rec = analyse(rewritten, n_carries, n_xs)
        except NotFused as other:
            found = _combined_body(rewritten, n_carries, n_xs, identities, other)
            if isinstance(found, NotFused):
                split_why = split_why or (found if per_row else None)
                continue
            rec, rewritten = found
        memory_heads.install(gm, node, state, rewritten)
        rec.per_row = True
        return rec
    if split_why is not None and _PER_ROW_DECAY in str(why):  # (the decay is no reason: split, it is one)
        return NotFused(f"{why}; it is one per row of the memory, and split into one memory per row the step is "
                        f"none either: {split_why}")
    return why


def _decay_advice(scaled_per: str | None, memory: torch.Size, error_driven: bool) -> str:
    """What to write instead, for a memory [.., A, C] whose decay is one per column; what the ops take, for one
    whose decay is one per element, or one per row of a memory whose update reads it (an error)."""
    *_, rows, columns = memory
    if scaled_per == "row" and error_driven:
        return ("; it is one per row of the memory (a decay per key dim: Gated DeltaNet's with a gate per key "
                "channel, KDA), and a memory is split into one per row only where its update reads none of it "
                "(Hebbian): this step's error reads every row at once, and no op takes its decay")
    if scaled_per == "element":
        return ("; it is one per element of the memory (Mamba-1's exp(Δ A) with A [D, N]), which no op takes: a "
                "decay per row fuses (A one per channel, [D]), the memory split into one per row")
    if scaled_per != "column":
        return ""
    return (f"; it is one per column of the memory [.., {rows}, {columns}], and Hecate splits a memory into one per "
            f"row where its decay is one per row: store the memory transposed, [.., {columns}, {rows}], its "
            "columns as rows (GLA's state [Dv, Dk] as [Dk, Dv], S ← α[..., :, None] ⊙ S + k vᵀ)")


def _scaled_per(M: fx.Node) -> str | None:
    """"row" where the step multiplies its state M [.., A, C] by a value of one number per row [.., A, 1] (A > 1), as
    a decay per row does; "column" where by one per column [.., 1, C] (C > 1); "element" where by one per element
    [.., A, C]; else None."""
    for node in M.users:
        other = [a for a in node.args if a is not M] if node.target is aten.mul.Tensor else []
        shape = getattr(other[0].meta.get("val"), "shape", None) if other and isinstance(other[0], fx.Node) else None
        if shape is not None and len(shape) >= 2 and is_one(shape[-1]) != is_one(shape[-2]):
            return "row" if is_one(shape[-1]) else "column"
        if shape is not None and len(shape) >= 2 and tuple(shape[-2:]) == tuple(M.meta["val"].shape[-2:]):
            return "element"
    return None


_DERIVED_UNPROVEN = ("; the step recomputes a carried W from the new memory (W = f(M), as MONETA's normalised W) "
                     "and reads it in the next step, but W's initial value is not provably f of the memory's initial "
                     "value (only both starting at zeros, with f(0) = 0, is), so W is a second state")


def _without_derived(gm: fx.GraphModule, node: fx.Node, why: NotFused) -> Recurrence | NotFused:
    """The memory step of scan ``node`` once the carries its body recomputes from another carry's new value
    (:mod:`derived_carry`: MONETA's W = f(A) carried beside A) are dropped, f(A_old) read for W_old; the scan is
    then rewritten. Else ``why`` it is none, as is (the rewritten body's reason where ``why`` is that the update
    reads another state, a carry the rewrite removed; a word on a derived carry whose start is not proven)."""
    from hecate.passes import derived_carry, memory_update

    try:  # nothing here may fail the pass: any error leaves the scan exactly as it was
        if not derived_carry.readable(node):
            return why
        found = derived_carry.derived_carries(gm, node)
        derived = [d for d in found if d.proven]
        if not derived:
            return NotFused(f"{why}{_DERIVED_UNPROVEN}") if found and "another state" in str(why) else why
        n_carries = len(node.args[1])
        body = derived_carry.without_derived(getattr(gm, node.args[0].target), n_carries, derived)
        left = n_carries - len(derived)
        try:
            rec = analyse(body, left, len(node.args[2]))
        except NotFused as other:
            identities = {i - len(derived) for i in memory_update.identity_inputs(gm, node)}
            combined = _combined_body(body, left, len(node.args[2]), identities, other)
            if isinstance(combined, NotFused):
                return combined if "another state" in str(why) else why
            rec, body = combined
        traced = derived_carry.final_reads(gm, node, derived)
    except Exception:  # (NotFused tracing the final W, or an unexpected graph: the rewrite is never a risk)
        return why
    derived_carry.install(gm, node, body, derived, traced)
    return rec


_HEADS_ADVICE = ("; the step reads its inputs or state at several fixed indices of one dim (x[:, h], M[:, h], "
                 "W[l]), as a Python loop over heads or layers inside the loop over time does: write the heads as a "
                 "batch dim of one memory [B, H, Dv, Dk], keep one memory per head (a list: the loop is then split "
                 "per head), or put the loop over heads around the loop over time (each head's loop then fuses); "
                 "for layers, each reading the one before, run each layer's loop over time in turn (each then fuses)")


def _reads_per_head(body: fx.GraphModule) -> bool:
    """Whether the step reads one of its inputs at two or more fixed integer indices of one dim."""
    indices: dict[tuple, set] = {}
    for n in body.graph.find_nodes(op="call_function", target=aten.select.int):
        if n.args[0].op == "placeholder":
            indices.setdefault((n.args[0], n.args[1]), set()).add(n.args[2])
    return any(len(found) > 1 for found in indices.values())


def forms_outer_product(body: fx.Graph) -> bool:
    """Whether a loop body forms an outer product ([.., D, 1] times [.., 1, K], however written: the normal form
    makes einsum, ``torch.outer`` and size-1 matmuls that product), as a memory update does. A loop without one
    (a Q-flow's belief updates) is no memory loop, and its report says nothing of it."""
    return bool(_outer_products(body))


def channel_recurrences(body: fx.GraphModule, n_carries: int) -> bool:
    """Whether a loop's step updates every floating carry as a linear recurrence of one number per channel,
    s ← d ⊙ s + x with d and x free of every carry and d not all ones (RWKV-4's wkv numerator and denominator, an
    exponential moving average). A loop of a memory's family without its outer product
    (each channel a memory of one number), where a Q-flow's belief update is not linear in the beliefs and a running
    sum has no decay. Checked at sample points: the step's change from carries at zero is d ⊙ s with one d for two
    draws of s."""
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    carries = [n for n in placeholders[:n_carries] if isinstance(n.meta.get("val"), torch.Tensor)
               and n.meta["val"].is_floating_point()]
    outputs = list(body.graph.output_node().args[0])[:n_carries]
    if not carries or any(n.meta["val"].numel() < 2 for n in carries):
        return False

    def step(states: list[torch.Tensor]) -> list[torch.Tensor]:
        env = _evaluate(body.graph, {**inputs, **dict(zip(carries, states))})
        return [env[outputs[placeholders.index(c)]] for c in carries]

    gen = torch.Generator().manual_seed(1)
    try:
        inputs = _random_inputs(placeholders, 0, set(carries), signed=False)
        zeros = [torch.zeros_like(inputs[c]) for c in carries]
        draws = [[torch.where(torch.rand(z.shape, generator=gen, dtype=z.dtype) < 0.5, -1.0, 1.0)
                  * (0.5 + torch.rand(z.shape, generator=gen, dtype=z.dtype)) for z in zeros] for _ in range(2)]
        at_zero = step(zeros)
        decays = [[(new - x) / s for new, x, s in zip(step(states), at_zero, states)] for states in draws]
    except Exception:  # (a step that does not run on its sample points, a size with no example: none read here)
        return False
    return all(isinstance(d, torch.Tensor) and d.shape == s.shape and _close(d, e)
               for d, e, s in zip(decays[0], decays[1], draws[0])) \
        and not all(_close(d, torch.ones_like(d)) for d in decays[0])


def _family(body: fx.Graph, n_carries: int) -> str:
    """The family a loop that is no memory step is reported under: memory_scan where an outer product it forms reads
    a carried memory (an error e = M k − v written into it), linear_attention where none does (Hebbian; a gate
    computed from another carry, mLSTM's stabiliser m, is no error)."""
    carries = [n for n in body.nodes if n.op == "placeholder"][:n_carries]
    outers = _outer_products(body)
    new = list(body.output_node().args[0])[:n_carries]
    memories = {c for c, out in zip(carries, new) if isinstance(out, fx.Node) and computed_from([out], set(outers))}
    reads_memory = any(computed_from([a for a in node.args[:2] if isinstance(a, fx.Node)], memories)
                       for node in outers)
    return "memory_scan" if reads_memory else "linear_attention"


def _outer_products(body: fx.Graph) -> list[fx.Node]:
    found = []
    for node in body.find_nodes(op="call_function", target=aten.mul.Tensor) + \
            body.find_nodes(op="call_function", target=aten.matmul.default) + \
            body.find_nodes(op="call_function", target=aten.bmm.default):
        shapes = [getattr(a.meta.get("val"), "shape", None) if isinstance(a, fx.Node) else None for a in node.args[:2]]
        if any(s is None or len(s) < 2 for s in shapes):
            continue
        a, b = shapes
        if node.target is aten.mul.Tensor and (is_one(a[-1]) and is_one(b[-2])
                                               or is_one(a[-2]) and is_one(b[-1])):
            found.append(node)
        elif node.target is not aten.mul.Tensor and is_one(a[-1]):  # a product that sums over one element
            found.append(node)
    return found


def fuse_scans(gm: fx.GraphModule, report: Any, op: str) -> None:
    """Replace every scan whose body is a step ``op`` computes; report (once) the scans that are no memory step."""
    kind = {"memory_scan": "lp", "linear_attention": "hebbian"}[op]
    # the loops (their rolled indices) split into parts of which one is a memory (forms an outer product): the
    # other parts carry what the memory's loop also carried (a normaliser no output divides by, say)
    with_a_memory = {n.meta["hecate_rolled_index"] for n in scans(gm) if "hecate_rolled_index" in n.meta
                     and forms_outer_product(getattr(gm, n.args[0].target).graph)}
    for node in scans(gm):
        rec = recognise(gm, node)
        if isinstance(rec, NotFused):
            if node.meta.get("hecate_memory_step_reported"):
                continue
            outer = forms_outer_product(getattr(gm, node.args[0].target).graph) \
                or node.meta.get("hecate_update_made_before")  # (the loop's outer products made before it)
            if not outer and channel_recurrences(getattr(gm, node.args[0].target), len(node.args[1])):
                node.meta["hecate_memory_step_reported"] = True
                channels = "a recurrence of one number per channel, s ← d ⊙ s + x"
                if node.meta.get("hecate_rolled_index", -1) in with_a_memory:
                    why = (f"{_form(node)} of {_over(node)} also carries, apart from its memory, a state that is {channels}"
                           " (a normaliser z the memory's reads are not divided by, say: a normaliser fuses with its "
                           "memory where one per-step output is a function of M q and z·q); the loop is split, the "
                           "memory's part fused on its own, and no Hecate op takes this part")
                else:
                    why = (f"{_form(node)} of {_over(node)} is not a memory step: its state is {channels} (RWKV-4's wkv, "
                           "a moving average), with no outer product v kᵀ, and no Hecate op takes a memory of one "
                           "number per channel")
                report.add_miss("linear_attention", why, node.name, nodes=_body_nodes(gm, node))
            elif outer:
                node.meta["hecate_memory_step_reported"] = True
                heads = _HEADS_ADVICE if _reads_per_head(getattr(gm, node.args[0].target)) else ""
                family = _family(getattr(gm, node.args[0].target).graph, len(node.args[1]))
                report.add_miss(family, f"{_form(node)} of {_over(node)} is not a memory step: {rec}{heads}", node.name,
                                nodes=_body_nodes(gm, node))
            continue
        if rec.kind != kind:
            continue
        body = getattr(gm, node.args[0].target)
        compute = sum(n.op == "call_function" for n in body.graph.nodes)
        form, over = _form(node), _over(node)
        replaced = _steps(node) * compute + 1 if "hecate_rolled_loop" in node.meta else compute + 1
        as_written = getattr(gm, node.args[0].target)
        if "hecate_body_as_read" in node.meta:  # (read without its detach: the op's inputs traced from it)
            setattr(gm, node.args[0].target, node.meta["hecate_body_as_read"])
        try:
            _replace(gm, node, rec, op)
        except NotFused as why:
            setattr(gm, node.args[0].target, as_written)
            report.add_miss(op, f"{form} over a {rec.name} step: {why}", node.name, nodes=_body_nodes(gm, node))
            continue
        report.add_fusion(op, f"hecate.{op}", replaced, f"{describe(rec)}; {_runs_as(rec)}; {form} rolled up {over}")


def _runs_as(rec: Recurrence) -> str:
    """Which form the fused op runs: chunked where the step is linear in the state (from ``chunked.MIN_T``)."""
    from hecate.lowering.memory_scan import chunked

    p = rec.params
    if chunked.applies(p.get("p", 2.0), p.get("bias", ""), p.get("momentum", 0.0), p.get("q_norm", 2.0),
                       rec.kind == "hebbian"):
        return f"chunked at T >= {chunked.MIN_T}"
    if p.get("p", 2.0) != 2.0 or p.get("bias") or p.get("q_norm", 2.0) != 2.0:
        return "fused-recurrent (nonlinear in the state)"
    return "fused-recurrent (the chunked form keeps no momentum buffer)"


def _form(node: fx.Node) -> str:
    return "loop" if "hecate_rolled_loop" in node.meta else "scan higher-order op"


def _steps(node: fx.Node) -> int | torch.SymInt:
    xs = node.args[2]
    return xs[0].meta["val"].shape[0] if xs else node.meta.get("hecate_rolled_loop", 0)


def _over(node: fx.Node) -> str:
    steps = _steps(node)
    if not isinstance(steps, int):
        return f"any number of steps (T = {steps}, dynamic)"
    return f"{steps} step" + ("" if steps == 1 else "s")


def _body_nodes(gm: fx.GraphModule, node: fx.Node) -> list[fx.Node]:
    body = getattr(gm, node.args[0].target)
    return [n for n in body.graph.nodes if n.op == "call_function"] + [node]


def describe(rec: Recurrence) -> str:
    if rec.kind == "hebbian":
        what = "Hebbian M ← α M + v φ(k)ᵀ"
        if rec.normaliser_state is not None:
            what += ", normalised by z ← α z + φ(k)" + (", ε read at run time" if isinstance(rec.params.get("eps"),
                                                                                               tuple) else "")
            if rec.normaliser_read is not None:
                what += " (the output a function of M q and z·q, run after the op)"
        return what + (", M stored [Dk, Dv]" if rec.layout == "kv" else "") + _read_as(rec)
    p = rec.params["p"]
    bias = {2.0: "l_2 bias p=2 (2e fast path)", 1.0: "l_1 bias p=1 (tanh fast path)"}.get(
        p, f"l_p bias p={p:g} (general form)")
    if "bias" in rec.params:
        bias = f"bias g(e) = {rec.params['bias']} (generated)"
    if rec.params.get("q_norm", 2.0) != 2.0:
        retention = f"MONETA L_q retention q={rec.params['q_norm']:g}"
    elif rec.momentum_state is not None:
        retention = ("GD with momentum, β_t per step" if "beta" in rec.per_step
                     else f"GD with momentum β={rec.params['momentum']:g}")
    else:
        retention = "GD"
    return (f"{retention}, {bias}" + (", the error read from the decayed memory" if rec.params.get("decay_first")
                                      else "") + (", M stored [Dk, Dv]" if rec.layout == "kv" else "")
            + _read_as(rec))


def _read_as(rec: Recurrence) -> str:
    """What the op reads of the memory, where the user would not guess it from their code."""
    per_row = ", one memory per row of M (a decay per row)" if rec.per_row else ""
    if rec.read_node is not None and rec.read_before_update and "q" in rec.per_step \
            and rec.per_step["q"].factors == rec.per_step["alpha"].factors:
        # the step's output read the new memory across its rows: the op gives each step's α_t M_{t−1}, and the
        # step's own ops make the output from it
        return (per_row + "; the op gives every step's decayed memory α_t M_{t−1}, the outer product and the "
                "read run after it for all steps at once")
    return per_row + (", read before the update" if rec.read_before_update else "")


def _per_step_shape(rec: Recurrence, role: str, M: torch.Tensor) -> tuple:
    """The shape of ``role``'s per-step value as (lead, size), read off the memory M [*lead, A, C] (symbolic where
    M's is): [*lead, Dk] for k and q, [*lead, Dv] for v, [*lead] (size None) for the gates."""
    lead = tuple(M.shape[:-2])
    if role in ("alpha", "eta", "beta"):
        return lead, None
    dk_dim, dv_dim = (-1, -2) if rec.layout == "vk" else (-2, -1)
    return lead, M.shape[dk_dim if role in ("k", "q") else dv_dim]


def _sequence(gm: fx.GraphModule, node: fx.Node, rec: Recurrence, role: str) -> fx.Node:
    """Emit, before ``node``, the [T, *shape] tensor of a per-step value: its body subgraph vmapped over T."""
    per_step = rec.per_step[role]
    body_gm = getattr(gm, node.args[0].target)
    body = body_gm.graph
    _, init, xs, invariants = node.args[:4]
    inputs = [n for n in body.nodes if n.op == "placeholder"][len(init):]
    outer = list(xs) + list(invariants) + [init[rec.state]]  # the initial memory: its shape gives the value's
    needed = set().union(*(_ancestors(f) for f in per_step.nodes)) if per_step.nodes else set()

    def one_step(*values):
        *values, M = values
        env = _evaluate(body, dict(zip(inputs, values)), upto=needed)
        # (the dtype of the value: its first floating factor's, else the memory's, as eager casts a number to the
        # dtype of the tensor it scales: 0.9 · M of an fp32 M is fp32's 0.9 where a bf16 input's would be 0.8984)
        like = next(x for x in [env.get(n) for n in per_step.nodes] + [M]
                    if isinstance(x, torch.Tensor) and x.is_floating_point())
        return per_step.value(env, *_per_step_shape(rec, role, M), like=like)

    traced = _trace_vmapped(one_step, [_value_of(n) for n in outer],
                            tuple([0] * len(xs) + [None] * (len(invariants) + 1)), "a per-step input of the memory")
    with gm.graph.inserting_before(node):
        return _emit_traced(gm, traced, outer)[0]


def _value_of(x: Any) -> Any:
    """A scan input's value to trace with: a node's fake value, or the number itself (a size the loop reads as an
    invariant, ``1e-2 * T``)."""
    return x.meta["val"] if isinstance(x, fx.Node) else x


def _trace_vmapped(step: Any, values: list, in_dims: tuple, what: str) -> fx.GraphModule:
    """``torch.vmap(step, in_dims)`` traced on fake ``values`` under their fake mode (vmap is not traceable
    pre-dispatch); NotFused if it cannot be."""
    from torch._guards import detect_fake_mode
    from torch.fx.experimental.proxy_tensor import make_fx

    fake_mode = detect_fake_mode([v for v in values if isinstance(v, torch.Tensor)])
    try:
        with fake_mode:
            return make_fx(torch.vmap(step, in_dims=in_dims))(*values)
    except (RuntimeError, TypeError, ValueError, AttributeError) as why:
        raise NotFused(f"{what} could not be computed for all steps at once "
                       f"({type(why).__name__}: {str(why).splitlines()[0] if str(why) else ''})") from None


def _emit_traced(gm: fx.GraphModule, traced: fx.GraphModule, outer: list) -> tuple[Any, list]:
    """Copy ``traced`` into ``gm`` at its insertion point, its inputs ``outer``: (its one result, the nodes
    emitted)."""
    result, emitted = inline(gm, traced, outer)
    if isinstance(result, (list, tuple)):
        (result,) = result
    return result, emitted


def _fused_recurrence(rec: Recurrence, names: list[str], initial: set[str], y_ones: list[bool] | None,
                      reads: set[str], y_static: list[int] | None = None) -> Any:
    """The scan's results computed by the op, as a plain PyTorch function of the tensors ``names`` say.

    Traced under the graph's fake mode (:func:`replace_with_function`): every size is read off a
    tensor, so a dynamic batch or length stays dynamic. Inputs: k, q [T, *lead, Dk], v [T, *lead, Dv],
    the gates [T, *lead], M0 [*lead, A, C], z0 [*lead, Dk] and the momentum buffer S0 [*lead, A, C], the
    initial states (the op starts from zeros unless ``initial`` names them). The op takes [B, T, H, D] with B = lead[0] (1 when none), H the
    product of the rest. Returns what ``reads`` names, in this order: "y" as the scan stacked it
    (``y_ones``: where its static size-1 dims are), the final "M", "z" and "S", each in the layout and shape
    the loop carried it.
    """
    p = rec.params

    def fused(*tensors):
        x = dict(zip(names, tensors))
        if rec.detached:  # no gradient through the states: to the queries alone
            x = {name: t if name == "q" or not isinstance(t, torch.Tensor) else t.detach() for name, t in x.items()}
        M0 = x["M0"]
        lead = tuple(M0.shape[:-2])
        B = lead[0] if lead else 1
        H = math.prod(lead[1:]) if len(lead) > 1 else 1

        def bthd(t):  # [T, *lead, *tail] → [B, T, H, *tail]
            return t.reshape(t.shape[0], B, H, *t.shape[1 + len(lead):]).movedim(0, 1)

        k, v, q = bthd(x["k"]), bthd(x["v"]), bthd(x["q"])
        m0 = None
        if "M0" in initial:
            m0 = M0.transpose(-1, -2) if rec.layout == "kv" else M0
            m0 = m0.reshape(B, H, *m0.shape[-2:])
        if rec.read_before_update:  # y_t = M_{t−1} q_t: the op's read after step t − 1 with the query of t, and
            # y_0 = M0 q_0 (0 from zeros), normalised by z0·q_0 + ε (0 from zeros: eager's 0/0 at ε = 0, NaN
            # forward and in q_0's gradient, as here). The op's last read is of no step: its query is zeros, or the
            # last query again where the read is normalised (a zero one would be 0/0 at ε = 0, and NaN in the
            # backward through the read nothing uses)
            normalised = rec.normaliser_state is not None and rec.normaliser_read is None  # (divided in the op)
            q_first, q = q[:, :1], torch.cat([q[:, 1:], q[:, -1:] if normalised else torch.zeros_like(q[:, :1])], 1)
            m_first = m0 if m0 is not None else q.new_zeros(B, H, v.shape[-1], k.shape[-1])
            first = (m_first.unsqueeze(1) @ q_first.unsqueeze(-1).to(m_first.dtype)).squeeze(-1)
            if rec.normaliser_state is not None:
                z_first = x["z0"].reshape(B, 1, H, -1) if "z0" in initial else q.new_zeros(B, 1, H, k.shape[-1])
                z_q = (z_first * q_first).sum(-1, keepdim=True)
                first = torch.cat([first, z_q.to(first.dtype)], -1) if not normalised else \
                    first / (z_q + (x["eps"].reshape(()) if "eps" in x else p["eps"]))
        if rec.kind == "lp":
            s0 = None
            if "S0" in initial:  # the op's buffer is the model's times its scale (M ← a·M + c·S)
                s0 = x["S0"].transpose(-1, -2) if rec.layout == "kv" else x["S0"]
                s0 = (s0 * rec.momentum_scale).reshape(B, H, *s0.shape[-2:])
            y, m, s = torch.ops.hecate.memory_scan(k, v, q, bthd(x["alpha"]), bthd(x["eta"]), m0, None, p["p"],
                                                   p["a"], p["eps"], p.get("momentum", 0.0), p["q_norm"],
                                                   p.get("bias", ""), s0, bthd(x["beta"]) if "beta" in x else None,
                                                   bool(p.get("decay_first")))
            z = None
        elif "eps" in x or rec.normaliser_read is not None:
            # ε read at run time, or the output a function of M q and z·q: z·q is the op's read of a value column
            # of ones, divided after (the function of both given the reads [M q; z·q] whole)
            dv = v.shape[-1]
            if m0 is not None or "z0" in initial:  # the state [M; zᵀ]: [B, H, Dv + 1, Dk]
                zeros = M0.new_zeros(B, H, 1, k.shape[-1])
                z0 = x["z0"].reshape(B, H, 1, -1).to(M0.dtype) if "z0" in initial else zeros
                m0 = torch.cat([zeros.expand(B, H, dv, -1) if m0 is None else m0, z0], -2)
            y, m, _ = torch.ops.hecate.linear_attention(k, torch.cat([v, torch.ones_like(v[..., :1])], -1), q,
                                                        bthd(x["alpha"]), m0, None, False, 1e-6, True)
            if "eps" in x:
                y = y[..., :dv] / (y[..., dv:] + x["eps"].reshape(()).to(y.dtype))
            m, z = m[..., :dv, :], m[..., dv, :]
        else:
            z0 = x["z0"].reshape(B, H, -1) if "z0" in initial else None
            y, m, z = torch.ops.hecate.linear_attention(k, v, q, bthd(x["alpha"]), m0, z0,
                                                        rec.normaliser_state is not None, p.get("eps", 1e-6), True)
        if rec.read_before_update:  # the op's last read is of no step
            y = torch.cat([first.to(y.dtype), y[:, :-1]], 1)
        results = []
        if "y" in reads:  # [B, T, H, Dv] → [T, *lead, Dv], with the size-1 dims the body's y has
            y = y.movedim(1, 0)
            sizes = iter(s for s in (y.shape[0], *lead, y.shape[-1]) if not is_one(s))
            # (y_static: the body's own static shape, where its y splits a dim of the memory's batch)
            y = y.reshape(y_static if y_static is not None else [1 if one else next(sizes) for one in y_ones])
            # the reads a function of the read takes next, traced on a contiguous tensor: one, not a strided view
            results.append(y.contiguous() if rec.read_node is not None else y)
        if "M" in reads:
            m = m.transpose(-1, -2) if rec.layout == "kv" else m
            results.append(m.reshape(M0.shape).to(M0.dtype))
        if "z" in reads:
            results.append(z.reshape(x["z0"].shape))
        if "S" in reads:
            s = (s / rec.momentum_scale).transpose(-1, -2) if rec.layout == "kv" else s / rec.momentum_scale
            results.append(s.reshape(x["S0"].shape).to(x["S0"].dtype))
        if rec.detached:  # the states carried out detached, as the step made them (the reads keep q's gradient)
            results = [r if i == 0 and "y" in reads else r.detach() for i, r in enumerate(results)]
        return tuple(results)

    return fused


def _replace(gm: fx.GraphModule, node: fx.Node, rec: Recurrence, op: str) -> None:
    _, init, xs, invariants = node.args[:4]
    if not xs:
        raise NotFused("the scan has no per-step inputs")
    if not hasattr(torch.ops.hecate, op):
        raise NotFused(f"the op hecate.{op} is not registered (import hecate.lowering)")
    results = {u.args[1]: u for u in node.users if u.target is operator.getitem}
    if len(results) != len(node.users):
        raise NotFused("the scan's results are read other than one by one")
    n_carries = len(init)
    M0 = init[rec.state]
    if M0.meta["val"].dtype not in (torch.float32, torch.float64):
        raise NotFused(f"the memory is {M0.meta['val'].dtype}; hecate.{op} keeps an fp32 or fp64 state")
    roles = ("k", "v", "q", "alpha") + (("eta",) if rec.kind == "lp" else ()) + \
        (("beta",) if "beta" in rec.per_step else ())
    inputs = {role: _sequence(gm, node, rec, role) for role in roles}
    dtypes = {inputs[role].meta["val"].dtype for role in ("k", "v", "q")}
    if len(dtypes) != 1:
        raise NotFused(f"k, v and q have dtypes {sorted(map(str, dtypes))}; hecate.{op} takes one")
    inputs["M0"] = M0  # its shape is the final memory's, even when the op starts from zeros
    if rec.normaliser_state is not None:
        inputs["z0"] = init[rec.normaliser_state]
        if isinstance(rec.params.get("eps"), tuple):  # the body's input it is read from, the scan's operand
            inputs["eps"] = (list(init) + list(xs) + list(invariants))[rec.params["eps"][1]]
    if rec.momentum_state is not None:  # a buffer carried in from a previous chunk, and out to the next
        inputs["S0"] = init[rec.momentum_state]
    initial = {name for name in ("M0", "z0", "S0") if name in inputs and not is_zeros(inputs[name])}
    read = {"y": results.get(n_carries), "M": results.get(rec.state),
            "z": results.get(rec.normaliser_state) if rec.normaliser_state is not None else None,
            "S": results.get(rec.momentum_state) if rec.momentum_state is not None else None}
    read = {name: r for name, r in read.items() if r is not None and r.users}
    if not read:
        raise NotFused("no result of the scan is read")
    if rec.momentum_scale_factors and ("S0" in initial or "S" in read):
        raise NotFused("the momentum buffer enters the memory scaled by a tensor (M ← a·M − lr·S, lr a parameter or "
                       "buffer), and is carried in from before the loop or read after it: the op's buffer is lr·S, "
                       "which it could give back only divided by lr")
    y_ones = [is_one(s) for s in read["y"].meta["val"].shape] if "y" in read else None
    y_static = None
    if "y" in read and rec.read_node is None:
        lead, dv = _per_step_shape(rec, "v", M0.meta["val"])
        steps = read["y"].meta["val"].shape[0]
        if sum(not one for one in y_ones) != sum(not is_one(s) for s in (steps, *lead, dv)):
            # the body's y splits the memory's batch (k[:, t].reshape(B·H, D) read back as [B, H, Dv])
            y_static = [s for s in read["y"].meta["val"].shape]
            if not all(isinstance(s, int) for s in y_static):
                raise NotFused(f"the per-step output {list(y_static)} splits the memory's batch {list(lead)} into "
                               "dims whose sizes are symbolic (dynamic shapes): which split is not read off a tensor")
    after = None
    if rec.read_node is not None and "y" in read:  # the op gives the reads; the output's function follows them
        steps = read["y"].meta["val"].shape[0]
        y_ones = [is_one(steps)] + [is_one(s) for s in rec.read_node.meta["val"].shape]
        M = M0.meta["val"]  # the reads [T, *lead, Dv] with the read's size-1 dims, sizes as the memory's
        lead, dv = _per_step_shape(rec, "v", M)
        if rec.normaliser_read is not None:  # [T, *lead, Dv + 1]: the reads and z·q after them
            y_ones, dv = [is_one(s) for s in (steps, *lead)] + [False], dv + 1
        sizes = iter(s for s in (steps, *lead, dv) if not is_one(s))
        reads = M.new_empty([1 if one else next(sizes) for one in y_ones], dtype=rec.read_node.meta["val"].dtype)
        # traced before anything changes: where it cannot be, NotFused leaves the graph as it is
        after = _after_the_reads(getattr(gm, node.args[0].target).graph, n_carries,
                                 list(xs) + list(invariants) + list(init), len(xs), rec, reads)
    names = list(inputs)
    fused = _fused_recurrence(rec, names, initial, y_ones, set(read), y_static)
    new = replace_with_function(gm, [node, *results.values()], fused, [inputs[n] for n in names],
                                outputs=list(read.values()), as_computed=[read["y"]] if after is not None else [])
    if after is not None:
        reads = new[list(read).index("y")]
        with gm.graph.inserting_before(reads.next):
            out, emitted = _emit_traced(gm, after, [reads, *xs, *invariants, *init])
        for n in emitted:  # (the fused loop's own steps, over all steps at once: no update left unrolled)
            n.meta[_AFTER_THE_READS] = True
        inside = set(emitted)
        reads.replace_all_uses_with(out, delete_user_cb=lambda user: user not in inside)


_AFTER_THE_READS = "hecate_after_the_reads"  # the meta key of the nodes a fused op's reads are made outputs by


def _after_the_reads(body: fx.Graph, n_carries: int, outer: list[fx.Node], n_xs: int, rec: Recurrence,
                     reads: torch.Tensor) -> fx.GraphModule:
    """The step's output computed from the op's ``reads`` [T, ...] (a fake value) and the step's inputs ``outer``
    (its per-step inputs first, then what every step reads, then the carries' initial values, whose sizes alone
    the output may read), step by step: vmapped, traced on fake values."""
    placeholders = [n for n in body.nodes if n.op == "placeholder"]
    inputs = placeholders[n_carries:] + placeholders[:n_carries]
    y = list(body.output_node().args[0])[n_carries]
    upto = _upstream(y, rec.read_node, rec.normaliser_read)
    # which dims are 1, read here: in the trace, a size compared with 1 would be a size the trace does not hold
    lead_ones, dv_one = [is_one(s) for s in reads.shape[1:-1]], is_one(reads.shape[-1] - 1)
    like = {n: [is_one(s) for s in n.meta["val"].shape] for n in (rec.read_node, rec.normaliser_read) if n is not None}

    def shaped(t, last_one, node):  # t [*lead, D] with the size-1 dims the step's own value has
        sizes = iter(s for s, one in zip(t.shape, lead_ones + [last_one]) if not one)
        return t.reshape([1 if one else next(sizes) for one in like[node]])

    def one_step(read_t, *values):
        reads = {rec.read_node: read_t}
        if rec.normaliser_read is not None:  # read_t [*lead, Dv + 1]: M q, then z·q
            dv = read_t.shape[-1] - 1
            reads = {rec.read_node: shaped(read_t[..., :dv], dv_one, rec.read_node),
                     rec.normaliser_read: shaped(read_t[..., dv:], True, rec.normaliser_read)}
        return _evaluate(body, dict(zip(inputs, values)), reads, upto=upto)[y]

    return _trace_vmapped(one_step, [reads] + [_value_of(n) for n in outer],
                          tuple([0] * (1 + n_xs) + [None] * (len(outer) - n_xs)), "the step's output")


# ---------------------------------------------------------------- memory updates left unrolled

def _is_outer_product(node: Any) -> bool:
    """``x[.., A, 1] * y[.., 1, C]`` (A, C > 1), possibly scaled by more factors."""
    if not isinstance(node, fx.Node) or node.target is not aten.mul.Tensor:
        return False
    shapes = [a.meta["val"].shape if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)
              else None for a in node.args]
    if all(s is not None and len(s) >= 2 for s in shapes):
        (a1, a2), (b1, b2) = shapes[0][-2:], shapes[1][-2:]
        if (a2 == 1 and b1 == 1 and a1 != 1 and b2 != 1) or (a1 == 1 and b2 == 1 and a2 != 1 and b1 != 1):
            return True
    return any(_is_outer_product(a) for a in node.args)


def _steps_apart(products: list[fx.Node]) -> bool:
    """Whether two outer products read one tensor at different indices of one dim (``a·v_0 k_0ᵀ + v_1 k_1ᵀ``: a
    first state written as its update, then a step), so their sum is a step of a memory written out."""
    reads = []
    for p in products:
        seen, todo, found = set(), [p], set()
        while todo and len(seen) < 64:
            n = todo.pop()
            if not isinstance(n, fx.Node) or n in seen:
                continue
            seen.add(n)
            if n.target is aten.select.int:
                found.add((n.args[0], n.args[1], n.args[2]))
            todo.extend(n.all_input_nodes)
        reads.append(found)
    return any(a[:2] == b[:2] and a[2] != b[2] for i, x in enumerate(reads) for y in reads[i + 1:]
               for a in x for b in y)


def _read_at_two_indices(gm: fx.GraphModule) -> bool:
    """Whether a tensor is read at two integer indices that both take several values, ``x[:, t, h]``."""
    reads: dict[tuple, set[tuple]] = {}
    for n in gm.graph.nodes:
        inner = n.args[0] if n.target is aten.select.int else None
        if isinstance(inner, fx.Node) and inner.target is aten.select.int:
            reads.setdefault((inner.args[0], inner.args[1], n.args[1]), set()).add((inner.args[2], n.args[2]))
    return any(len({i for i, _ in pairs}) > 1 and len({j for _, j in pairs}) > 1 for pairs in reads.values())


def _named(b: _Body, node: fx.Node) -> str:
    """A node of the step in the user's terms (its graph name means nothing to them): the op computing it, or an
    input of the loop, and its shape."""
    value = b.env.get(node)
    shape = f" of shape {list(value.shape)}" if isinstance(value, torch.Tensor) else ""
    return ("an input of the loop" if node.op == "placeholder" else op_name(node)) + shape


def _carry_named(b: _Body, i: int) -> str:
    """Carry ``i`` in the user's terms: its shape and the line that computes its new value."""
    value, line = b.env.get(b.carries[i]), source_line([b.carry_out[i]])
    return "a state" + (f" of shape {list(value.shape)}" if isinstance(value, torch.Tensor) else "") + \
        (f" ({line})" if line else "")


def _written_at_two_indices(write: fx.Node) -> bool:
    """Whether an in-place write goes into ``out[.., i, .., j]``: a select of a select at integer indices."""
    target = write.args[0] if write.args else None
    while isinstance(target, fx.Node) and target.target in _VIEWS - {aten.clone.default}:
        target = target.args[0]
    return isinstance(target, fx.Node) and target.target is aten.select.int and isinstance(target.args[0], fx.Node) \
        and target.args[0].target is aten.select.int


def _a_loops_final_state(node: fx.Node) -> bool:
    """Whether ``node`` is (a view of) the final state of a loop rolled up (a scan) or fused (a Hecate op)."""
    while node.op == "call_function" and (node.target is operator.getitem or is_view(node)):
        node = node.args[0]
    return node.op == "call_function" and (node.target is torch.ops.higher_order.scan or isinstance(
        node.target, torch._ops.OpOverload) and node.target.namespace == "hecate")


def _carried_on(update: fx.Node) -> bool:
    """Whether the sum ``update`` is a state: returned, or a term of another such sum."""
    return any(u.op == "output" or u.target in (aten.add.Tensor, aten.sub.Tensor) for u in update.users)


def _reads_the_state(update: fx.Node) -> bool:
    """Whether the outer product of ``update`` (a·M ± outer product) is computed from the state M it updates (the
    error M k − v of a delta rule), not only from the step's tokens (a Hebbian v kᵀ)."""
    terms = [t for _, t in _terms(update) if isinstance(t, fx.Node)]
    outer = [t for t in terms if _is_outer_product(t)]
    shape = update.meta["val"].shape
    states = {x for t in terms if t not in outer for x in (t, *t.all_input_nodes)
              if isinstance(x.meta.get("val"), torch.Tensor) and x.meta["val"].shape == shape}
    return bool(states) and computed_from(outer, states)


UNROLLED_UPDATES = "memory update step(s) M ← a·M + (outer product) are written out step by step"


def report_unrolled_updates(gm: fx.GraphModule, report: Any) -> None:
    """Report (once per graph) memory updates ``M ← a·M ± outer product`` left in the graph unrolled: under
    memory_scan where a step's outer product is computed from the state before it (an error M k − v), else under
    linear_attention (a Hebbian v kᵀ).

    Not when the report already says why either did not fuse (a loop rolled up, analysed and
    found no memory step is then compiled unrolled: its reason is the analysis's).
    """
    if gm.meta.get("hecate_unrolled_reported") or any(m.pattern in ("memory_scan", "linear_attention")
                                                        for m in report.misses):
        return
    updates = []
    for node in gm.graph.nodes:
        if node.target not in (aten.add.Tensor, aten.sub.Tensor) or node.meta.get(_AFTER_THE_READS):
            continue
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor) or value.dim() < 2 \
                or any(statically_known_true(s < 2) for s in value.shape[-2:]):  # (a size compared, no guard)
            continue
        terms = [t for _, t in _terms(node)]
        outer = [t for t in terms if _is_outer_product(t)]
        if any(isinstance(t, fx.Node) and t.target == aten.cumsum.default and t.args[0] in outer for t in terms):
            continue  # every step's state at once, cumsum(v kᵀ) − v kᵀ: an exclusive prefix sum, no step
        states = [t for t in terms if isinstance(t, fx.Node) and not _is_outer_product(t)
                  and isinstance(t.meta.get("val"), torch.Tensor) and t.meta["val"].shape == value.shape]
        if states and all(map(_a_loops_final_state, states)) and not _carried_on(node):
            continue  # the bonus of a read after a loop, r (S + u k vᵀ), its step's write dead: no update
        if outer and (states or _steps_apart(outer)):
            updates.append(node)
    if updates:
        gm.meta["hecate_unrolled_reported"] = True
        writes = [n for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
                  and n.target._schema.is_mutable and not n.meta.get(WRITTEN_BACK)]  # (not an input's write-back)
        why = ("the steps differ (an op, a literal such as p, or a gate's form changes between steps), an "
               "intermediate state is read outside the loop, or there is a single step")
        lines = [source_line([u]) for u in updates]
        if all(lines) and len(set(lines)) == len(lines):  # each update written once: one step, or steps by hand
            why = ("each update is a line of code of its own: there is a single step (a loop over one token), or the "
                   "steps are written out by hand; Hecate rolls up the steps a Python loop repeats")
        promoted = next(((u, t) for u in updates for _, t in _terms(u) if isinstance(t, fx.Node)
                         and isinstance(t.meta.get("val"), torch.Tensor) and t.meta["val"].shape == u.meta["val"].shape
                         and t.meta["val"].dtype != u.meta["val"].dtype), None)
        if promoted is not None:  # (a bf16 state from new_zeros of a bf16 tensor, made float32 by its first update)
            new, old = (str(n.meta["val"].dtype).removeprefix("torch.") for n in promoted)
            why = (f"the state is {old} before this update and {new} after it (mixed dtypes promote), so this step "
                   f"computes in another dtype than the steps after it, which are rolled up as the loop; start the "
                   f"state as {new} (torch.zeros(..., dtype=torch.{new}), not new_zeros of a {old} tensor) and the "
                   "whole loop rolls up")
        if _read_at_two_indices(gm):
            why = ("one tensor is read at two integer indices that both change, x[:, t, h] (a Python loop over heads "
                   "inside or around the loop over time, one memory per head, gates read as alpha[:, t, h]); Hecate "
                   "rolls up one loop over time: write the heads as a batch dim of one memory [B, H, Dv, Dk], read "
                   "k[:, t] [B, H, Dk] and alpha[:, t] [B, H] per step, or flatten them into the batch [B·H, Dv, Dk]")
        inputs = [w for w in writes if written_tensor(w.args[0]).op == "placeholder"]
        if inputs:  # the state an input (a module's buffer) written in place, not made functional
            why = (f"the steps write into an input in place ({len(inputs)} in-place call(s) such as "
                   f"{inputs[0].target._schema.name.replace('::', '.')} into {written_tensor(inputs[0].args[0]).name}); "
                   f"{INPUT_WRITTEN_ADVICE}")
        elif writes:  # what the loop proof refuses first: steps that write into a tensor
            why = (f"the steps write into a tensor in place ({len(writes)} in-place call(s) such as "
                   f"{writes[0].target._schema.name.replace('::', '.')}); outputs written into a fresh tensor, "
                   "out[:, t] = y, are read as collected only when every slot is written exactly once, by a value "
                   "of its shape and dtype, and out is read after the last write alone")
            if any(_written_at_two_indices(w) for w in writes):
                why += (", and at one integer index: here slots are written at two (out[:, h, t] = y, a loop over "
                        "heads inside the loop over time); collect each head's outputs in a list and stack them")
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        draws = [n for n in gm.graph.nodes if isinstance(n.target, torch._ops.OpOverload)
                 and torch.Tag.nondeterministic_seeded in n.target.tags and order[updates[0]] < order[n]
                 < order[updates[-1]]]  # between the first step's update and the last's: drawn by a step
        if draws:
            why = (f"the steps draw random numbers (each step calls {draws[0].target._schema.name.replace('aten::', '')}"
                   "), which one fused op would not draw as the code does; without them (dropout in eval(), or "
                   "moved before or after the loop) the loop is rolled up")
        hooks = [n for n in gm.graph.nodes if is_register_hook(n.target) and order[n] < order[updates[-1]]
                 and computed_from([n.args[0]], {updates[0]})]  # on a value of the steps, before the last
        if hooks:
            why = (f"a gradient hook is registered inside the steps ({source_line(hooks[:1]) or hooks[0].name}), "
                   "which a fused loop's backward would not call")
        op = "memory_scan" if any(map(_reads_the_state, updates)) else "linear_attention"
        report.add_miss(op, f"{len(updates)} {UNROLLED_UPDATES} and could not be rolled up into one loop: {why}; "
                        "compiled as written",
                        f"{updates[0].name} .. {updates[-1].name}", nodes=updates)
