"""What the two KL passes share: reading a subgraph by what it computes, and inlining a replacement.

* :func:`evaluate` runs a piece of the captured graph on real (float64) tensors, so a pass can
  check what a subgraph computes (the pairwise score against the closed-form Gaussian KL, a
  mask against the causal/no-self masks) whatever ops spell it.
* :data:`VARIANCE_FROM` the parameterisations of a diagonal Gaussian's spread a model may carry
  (variance, log-variance, standard deviation, log-std, precision, log-precision) and how each gives the variance.
* :func:`far_draw` and :func:`equals_scaled`: a match found at values near 1 confirmed far from them.
* :func:`gaussian_kl` the closed form ``KL(N(μ_i, v_i) ‖ N(μ_j, v_j))`` summed over the last dim.
* :func:`independent` which of the per-position tensors a score reads are drawn at random
  (the others are computed from them).
* :func:`run_time_temperature` a temperature read from a 0-d tensor at run time (:class:`Temperature`).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import fx

from hecate.passes.matching import (NotFused, depends_on_sizes_only, hook_reason, is_pointwise, is_register_hook,
                                    made_in_forward, same_shape, writes_into)

aten = torch.ops.aten

VARIANCE_FROM: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "variance": lambda s: s,
    "log-variance": torch.exp,
    "standard deviation": torch.square,
    "log standard deviation": lambda s: torch.exp(2.0 * s),
    "precision": torch.reciprocal,
    "log-precision": lambda s: torch.exp(-s),
}


@dataclass
class Temperature:
    """κ = scale · t^power of a 0-d tensor t of the graph (a learned temperature, a buffer, a float attribute
    torch.compile(dynamic=True) passes in as a tensor): power 1 divides the KL by t, −1 multiplies it."""

    node: fx.Node
    scale: float
    power: int

    def __str__(self) -> str:
        # (a 0-d tensor of a number computed from sizes at run time, √K under dynamic=True: named by what it is)
        t = ("(a number computed from sizes)" if self.node.target is torch.ops.aten.scalar_tensor.default
             else self.node.name)
        return f"{self.scale:g}·{t}" if self.power == 1 else f"{self.scale:g}/{t}"


def run_time_temperature(kappas: list[float], values: list[dict], candidates: list[fx.Node]) -> Temperature | None:
    """The 0-d tensor t the temperatures ``kappas`` found at two draws (``values``: each draw's node values) are
    proportional to (κ = c·t) or inversely (κ = c/t), or None: a score −KL/κ whose κ changes with the draw.
    Of several (``exp(log κ)`` and ``exp(log κ).clamp(min=0.05)``, equal where the draws stay above the
    bound), the last computed: the one the score reads, so that what the op replaces holds no bound."""
    found = []
    for node in candidates:
        drawn = [v.get(node) for v in values]
        if not all(isinstance(x, torch.Tensor) and x.dim() == 0 and x.item() > 0 for x in drawn):
            continue
        t = [x.item() for x in drawn]
        for power in (1, -1):
            scales = [k / x ** power for k, x in zip(kappas, t)]
            if math.isclose(scales[0], scales[1], rel_tol=1e-9):
                found.append(Temperature(node, float(f"{scales[0]:.12g}"), power))
                break
    if len(found) > 1:
        order = {n: i for i, n in enumerate(found[0].node.graph.nodes)}
        return max(found, key=lambda temperature: order[temperature.node])
    return found[0] if found else None


# Each parameterisation of VARIANCE_FROM given a log-variance: how a confirming draw spreads the variances.
FROM_LOG_VARIANCE: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "variance": torch.exp,
    "log-variance": lambda log_v: log_v,
    "standard deviation": lambda log_v: torch.exp(0.5 * log_v),
    "log standard deviation": lambda log_v: 0.5 * log_v,
    "precision": lambda log_v: torch.exp(-log_v),
    "log-precision": lambda log_v: -log_v,
}

# The confirming draw: means of either sign, variances from e^-8 to e^8. The first draws (positive values
# near 1) find the roles; this one shows what is the KL only there: relu(μ), |μ|, a clamp or floor of v.
_FAR_MEANS, _FAR_LOG_VARIANCES = 6.0, 8.0


def far_draw(env: dict, means: Sequence, scales: dict, seed: int, computed: dict | None = None) -> dict:
    """``env`` (node → drawn value) with ``means`` redrawn in (−6, 6) and each of ``scales`` (node →
    parameterisation) drawn itself redrawn as variances e^(−8..8) in that parameterisation; the rest as drawn.
    A scale computed from what was drawn (softplus(raw) + eps) stays so, unless ``computed`` (node → its value at
    ``env``) gives its shape: then it is drawn far too, over what computes it (every term must read it alone)."""
    gen = torch.Generator().manual_seed(seed)
    far = dict(env)
    for node in means:
        if node not in env:  # computed from what was drawn: it stays so
            continue
        far[node] = _FAR_MEANS * (2 * torch.rand(env[node].shape, generator=gen, dtype=torch.float64) - 1)
    for node, param in scales.items():
        shape = env[node].shape if node in env else computed[node].shape if computed and node in computed else None
        if shape is None:
            continue
        log_v = _FAR_LOG_VARIANCES * (2 * torch.rand(shape, generator=gen, dtype=torch.float64) - 1)
        far[node] = FROM_LOG_VARIANCE[param](log_v)
    return far


def equals_scaled(value: Any, reference: torch.Tensor, gamma: float, tol: float = 1e-8) -> bool:
    """``value = γ · reference`` element by element, to ``tol`` of the largest |γ · reference| in its row
    (a row's largest KL sets the rounding of a KL expanded into sums, not the norm of the whole score)."""
    if not isinstance(value, torch.Tensor) or value.shape != reference.shape or not torch.isfinite(value).all():
        return False
    expected = gamma * reference
    row = expected.abs().amax(-1, keepdim=True) if expected.dim() else expected.abs()
    return bool(((value - expected).abs() <= tol * (row + expected.abs())).all())


def gaussian_kl(mu_p, var_p, mu_q, var_q):
    """KL(N(μ_p, v_p) ‖ N(μ_q, v_q)) of diagonal Gaussians, summed over the last dim (broadcasting)."""
    return 0.5 * (torch.log(var_q / var_p) + var_p / var_q + (mu_p - mu_q).square() / var_q - 1.0).sum(-1)


def shape_of(node) -> tuple | None:
    """The shape of a node's fake value (entries may be SymInts), None without one."""
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def short(target) -> str:
    return getattr(target, "__name__", str(target))


def proportion(value: torch.Tensor, reference: torch.Tensor, tol: float = 1e-9) -> float | None:
    """γ with ``value = γ · reference`` to ``tol`` (relative), or None (also for a value that is no float tensor)."""
    if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.shape != reference.shape or not torch.isfinite(value).all() or not torch.isfinite(reference).all():
        return None
    norm = reference.square().sum()
    if norm == 0:
        return None
    gamma = float((value * reference).sum() / norm)
    if not (value - gamma * reference).norm() <= tol * max(value.norm(), reference.norm()):
        return None
    return gamma


_SHAPE_ONLY = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default,
               aten.contiguous.default, aten.clone.default, aten.alias.default}


def _is_noop(node: fx.Node) -> bool:
    """A node that gives its input's values unchanged (a view to the same shape, an expand, a full slice).

    An expand is a no-op where its result is read by broadcasting ops, as in every score: the
    evaluation then checks what the whole subgraph computes, so a wrong guess cannot pass.
    """
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    if node.target == aten.expand.default:
        return True
    if node.target in _SHAPE_ONLY:
        return same_shape(node, node.args[0])
    if node.target == aten.slice.Tensor:
        args = list(node.args) + [None] * (5 - len(node.args))
        dim, start, end, step = args[1] or 0, args[2], args[3], args[4]
        size = shape_of(node.args[0])[dim] if shape_of(node.args[0]) else None
        return (start in (None, 0) and step in (None, 1)
                and (end is None or (isinstance(end, int) and isinstance(size, int) and end >= size)
                     or end == 2 ** 63 - 1))
    return False


def strip_noops(node: Any) -> Any:
    """``node`` with no-op views and full slices (see :func:`_is_noop`) peeled off."""
    while isinstance(node, fx.Node) and _is_noop(node) and node.target != aten.expand.default:
        node = node.args[0]
    return node


def evaluate(node: fx.Node, values: dict, size_hint: Callable[[Any], int] | None = None,
             expand: bool = False, as_made: bool = False) -> Any:
    """The value of ``node`` computed from ``values`` (graph nodes → real values), recursively.

    ``values`` is extended in place with every node computed. Factory ops (``ones``,
    ``arange``...) run on CPU, a floating one in float64 (the values evaluated are); a node whose
    value is a size is replaced by ``size_hint(value)`` (when given); any other input not in ``values``
    raises :class:`NotFused`. An expand is a no-op (values drawn at other sizes than the graph's
    broadcast as they are) unless ``expand`` (values at the graph's own sizes: the expanded pairs may be
    flattened, ``mu.unsqueeze(2).expand(b, n, n, k).reshape(-1, k)``). ``as_made``: ``node``'s value as its op
    makes it, even where the code writes into it later (after the subgraph that is replaced).
    """
    memo, order = values, {}  # (order: the graph's, made once a write is found)

    def run(n):
        if not isinstance(n, fx.Node):
            return n
        if n in memo:
            return memo[n]
        if is_register_hook(n.target):
            raise NotFused(hook_reason(n))
        val = n.meta.get("val")
        if size_hint is not None and isinstance(val, (torch.SymInt, int)) and not isinstance(val, bool):
            memo[n] = size_hint(val)
            return memo[n]
        if n.op != "call_function":
            constant = made_in_forward(n)
            if constant is not None:  # known: a float64 copy, as factory ops are evaluated
                memo[n] = constant.double() if constant.is_floating_point() else constant.clone()
                return memo[n]
            if isinstance(val, (torch.SymFloat, float)):
                raise NotFused(f"it reads {n.name}, a Python float (an attribute such as self.kappa) that "
                               "torch.compile passes in at run time under dynamic=True, not known when compiling")
            if isinstance(val, (torch.SymInt, int)):
                raise NotFused(f"it reads {n.name}, a size torch.compile passes in at run time (dynamic shapes), "
                               "not known when compiling")
            raise NotFused(f"it reads {n.name}, an input of the graph whose value is not known when compiling")
        writers = [] if as_made and n is node else writes_into(n)
        if writers:  # (a write after ``node`` is made does not change its value: k.add_(1) after the family)
            order.update({} if order else {x: i for i, x in enumerate(node.graph.nodes)})
            writers = [w for w in writers if order[w] < order[node]]
        if writers:
            raise NotFused(f"it reads {n.name}, written in place after it is made (by {writers[0].name}): its value "
                           "is not the one what computes it gives")
        if _is_noop(n) and not (expand and n.target == aten.expand.default):
            memo[n] = run(n.args[0])
            return memo[n]
        args = fx.node.map_aggregate(n.args, run)
        kwargs = {k: ("cpu" if k == "device" else fx.node.map_aggregate(v, run)) for k, v in n.kwargs.items()}
        value = n.target(*args, **kwargs)
        if isinstance(value, torch.Tensor) and value.dtype in (torch.float32, torch.float16, torch.bfloat16) \
                and not any(isinstance(memo.get(i), torch.Tensor) for i in n.all_input_nodes):
            value = value.double()  # a factory (torch.zeros(n, k) in the score)
        memo[n] = value
        return memo[n]

    return run(node)


def nearest_sources(node: fx.Node, is_source: Callable[[tuple], bool], depth: int = 8) -> list[fx.Node]:
    """The nearest tensors ``node`` is computed from whose shape ``is_source`` takes (a per-position number's
    [..., N, K] log-variances, say), within ``depth`` ops."""
    found, frontier, seen = [], [node], {node}
    for _ in range(depth):
        parents = []
        for n in frontier:
            for x in n.all_input_nodes:
                shape = shape_of(x)
                if x in seen or shape is None:
                    continue
                seen.add(x)
                (found if is_source(shape) else parents).append(x)
        frontier = parents
    return found


def sources_shaped(node: fx.Node, keep: Callable[[tuple], bool]) -> list[fx.Node]:
    """The floating tensors ``node`` is computed from through tensors whose shape ``keep`` takes (``2 * v`` and
    ``log v`` read apart are both computed from v, which is then drawn, and they evaluated from it)."""
    found, stack = [], [node]
    while stack:
        n = stack.pop()
        if n.op != "call_function":
            continue
        for x in n.all_input_nodes:
            shape = shape_of(x)
            if x not in found and shape is not None and x.meta["val"].is_floating_point() and keep(shape):
                found.append(x)
                stack.append(x)
    return found


def where_read_apart(node: fx.Node, within: set | None = None) -> fx.Node:
    """The last of ``node``'s chain of single-reader pointwise ops of its own shape (within ``within``, if given):
    the first value read in two places (v = softplus(raw) + ε, var = −0.5 / η₂), or ``node``. Drawn there, the
    value keeps the sign and range the KL needs whatever it is computed from."""
    while len(node.users) == 1:
        (user,) = node.users
        if within is not None and user not in within or not same_shape(user, node) or not is_pointwise(user) \
                or any(i is not node and not depends_on_sizes_only(i) for i in user.all_input_nodes):
            break
        node = user
    return node


def independent(bases: Sequence[fx.Node], depth: int = 16) -> list[fx.Node]:
    """``bases`` without those computed from others of them alone (``log(v)`` beside ``v``): those are
    evaluated from them rather than drawn independently. A base that also reads a graph input (the
    means of a second Q-flow step, computed from the first step's beliefs) is drawn. Looks ``depth`` ops up."""
    return [node for node in bases if not _computed_from(node, set(bases) - {node}, depth)]


def _fused(node: fx.Node) -> bool:
    """An output of a fused op (``torch.ops.hecate.*``, or an item of its outputs): drawn like a graph input,
    not evaluated through the op (the beliefs of a second Q-flow step, computed by the first one's fusion)."""
    if node.target is operator.getitem:
        node = node.args[0]
    return isinstance(node.target, torch._ops.OpOverload) and node.target.namespace == "hecate"


def _computed_from(node: fx.Node, others: set, depth: int) -> bool:
    """Whether ``node`` is a function of ``others`` (and constants) only, within ``depth`` ops."""
    found, seen, frontier = False, {node}, [node]
    for _ in range(depth):
        parents = []
        for n in frontier:
            for i in n.all_input_nodes:
                if i in others:
                    found = True
                elif isinstance(i.meta.get("val"), (torch.SymInt, int)):
                    continue  # a size (read off a tensor under dynamic shapes): no value it is computed from
                elif i.op in ("placeholder", "get_attr") and isinstance(i.meta.get("val"), torch.Tensor) \
                        or _fused(i):
                    return False
                elif i not in seen:
                    seen.add(i)
                    parents.append(i)
        frontier = parents
        if not frontier:
            return found
    return False
