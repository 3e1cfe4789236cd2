"""Finding a pattern written as PyTorch in a canonical graph, and replacing it by one op.

A pass writes its pattern as the code a user writes::

    def conv_silu(x, w, b):
        return F.silu(F.conv1d(F.pad(x, (3, 0)), w, b, groups=8))

:func:`pattern_graph` traces it to the same pre-dispatch ATen form the pipeline
gives the captured graph, and :func:`find_matches` runs torch's
``SubgraphMatcher`` over the graph with literals as wildcards (padding, groups,
slice bounds match any value). The pass then reads the literals of each match
(:meth:`Match.node`) and either replaces it (:func:`replace_with_op` for one op call,
:func:`replace_with_function` for a replacement written as a PyTorch function) or
reports a near-miss with the reason (:class:`NotFused`).
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.fx.passes.utils.matcher_utils import InternalMatch, SubgraphMatcher
from torch.utils import _pytree as pytree

from hecate.passes.report import source_line

aten = torch.ops.aten


class NotFused(Exception):
    """Raised while recognising a match that cannot be fused; the message is the report's reason."""


def pattern_graph(fn: Callable, *example_inputs: torch.Tensor) -> fx.Graph:
    """Trace ``fn`` (plain PyTorch) to the pre-dispatch ATen graph used as a pattern."""
    return make_fx(fn, pre_dispatch=True)(*example_inputs).graph


@dataclass
class Match:
    """One place where a pattern occurs in the graph."""

    pattern: fx.Graph
    internal: InternalMatch

    @property
    def inputs(self) -> list[fx.Node]:
        """The graph nodes bound to the pattern's inputs, in the pattern's argument order."""
        return list(self.internal.placeholder_nodes)

    @property
    def outputs(self) -> list[fx.Node]:
        """The graph nodes bound to the pattern's outputs."""
        return list(self.internal.returning_nodes)

    @property
    def nodes(self) -> list[fx.Node]:
        """The graph nodes the pattern's computation covers (inputs excluded)."""
        return [g for p, g in self.internal.nodes_map.items() if p.op not in ("placeholder", "output")]

    def node(self, target: Any, index: int = 0) -> fx.Node:
        """The graph node matched by the ``index``-th pattern node calling ``target``."""
        found = [g for p, g in self.internal.nodes_map.items()
                 if p.op == "call_function" and p.target == target]
        if index >= len(found):
            raise KeyError(f"pattern has {len(found)} node(s) calling {target}, asked for #{index}")
        return found[index]

    def where(self) -> str:
        """The matched node names, for reports and dumps."""
        return ", ".join(n.name for n in self.nodes)


def find_matches(gm: fx.GraphModule, pattern: fx.Graph) -> list[Match]:
    """Every non-overlapping occurrence of ``pattern`` in ``gm``; literals are wildcards.

    A view of the pattern's inputs (``w.T`` in ``x @ w.T``) may be shared with the rest of the
    graph, as the normal form computes each subexpression once: the weight's transpose read by
    the keys' and the queries' feature maps is one node, in both matches."""
    matcher = _SharedViewMatcher(pattern, match_output=False, match_placeholder=False,
                                 remove_overlapping_matches=True)
    return [Match(pattern, m) for m in matcher.match(gm.graph)]


class _SharedViewMatcher(SubgraphMatcher):
    """SubgraphMatcher whose matches may share the views and pads of their inputs with other nodes.

    Such a view costs nothing to keep for its other readers, and such a pad (a streaming conv's
    padded input, whose last K−1 steps are the state it returns) is what those readers computed
    before: a replacement erases only the matched nodes nothing else reads, so it neither makes
    a match leak nor makes two overlap.
    """

    def __init__(self, pattern: fx.Graph, **kwargs: Any):
        super().__init__(pattern, **kwargs)
        self.input_views: set[fx.Node] = set()
        for pn in pattern.nodes:  # in order: a view's inputs are classified before it
            if (is_view(pn) or pn.target is torch.ops.aten.pad.default) \
                    and all(i.op == "placeholder" or i in self.input_views for i in pn.all_input_nodes):
                self.input_views.add(pn)

    def _match_literals(self, pn: Any, gn: Any, match: InternalMatch) -> bool:
        """A literal of the pattern matches anything (its value is the pass's to check: a size may be a
        symbolic node); an op of the pattern never matches a literal (``z * 2.0`` is not ``z * sigmoid(z)``,
        which SubgraphMatcher's ``ignore_literals`` would let through)."""
        if isinstance(pn, fx.Node):
            return super()._match_literals(pn, gn, match)
        return True

    def _owned(self, nodes_map: dict[fx.Node, fx.Node]) -> dict[fx.Node, fx.Node]:
        return {pn: gn for pn, gn in nodes_map.items() if pn not in self.input_views}

    def _is_contained(self, nodes_map: dict[fx.Node, fx.Node]) -> bool:
        return super()._is_contained(self._owned(nodes_map))

    def _remove_overlapping_matches(self, matches: list[InternalMatch]) -> list[InternalMatch]:
        kept, taken = [], set()
        for match in matches:
            owned = {gn for pn, gn in self._owned(match.nodes_map).items() if pn.op not in ("placeholder", "output")}
            if not owned & taken:
                kept.append(match)
                taken |= owned
        return kept


def is_view(node: fx.Node) -> bool:
    """An ATen call whose result aliases its input without writing it (transpose, view, slice, ...)."""
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    return schema is not None and not schema.is_mutable and len(schema.returns) == 1 \
        and schema.returns[0].alias_info is not None


def val(node: Any) -> Any:
    """The fake value of a node (its shape and dtype), or the literal itself."""
    return node.meta["val"] if isinstance(node, fx.Node) else node


def pad_fill(pad: fx.Node) -> tuple[str, Any]:
    """What ``F.pad`` fills with: its (mode, value), schema defaults where omitted."""
    mode = pad.args[2] if len(pad.args) > 2 else pad.kwargs.get("mode", "constant")
    value = pad.args[3] if len(pad.args) > 3 else pad.kwargs.get("value")
    return mode, value


# Ops whose value turns on a bound or a sign: evaluated at sample points, clamp(x, -10, 10) is x and
# where(|s| > 20, 0, s) is s. A pass that recognises a subgraph by evaluating it may not drop one of
# these unseen; what it fuses must compute each exactly (kept as an input, or generated into the kernel).
THRESHOLD_OPS = frozenset({
    aten.clamp.default, aten.clamp.Tensor, aten.clamp_min.default, aten.clamp_min.Tensor, aten.clamp_max.default,
    aten.clamp_max.Tensor, aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar,
    aten.relu.default, aten.hardtanh.default, aten.threshold.default, aten.leaky_relu.default, aten.abs.default,
    aten.sign.default, aten.maximum.default, aten.minimum.default, aten.fmax.default, aten.fmin.default,
    aten.round.default, aten.floor.default, aten.ceil.default, aten.trunc.default,
    aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.heaviside.default,
    aten.gt.Tensor, aten.gt.Scalar, aten.ge.Tensor, aten.ge.Scalar, aten.lt.Tensor, aten.lt.Scalar,
    aten.le.Tensor, aten.le.Scalar, aten.eq.Tensor, aten.eq.Scalar, aten.ne.Tensor, aten.ne.Scalar,
})


_MASK_ARGUMENT = {aten.masked_fill.Scalar: 1, aten.masked_fill.Tensor: 1, aten.where.self: 0,
                  aten.where.ScalarSelf: 0, aten.where.ScalarOther: 0, aten.where.Scalar: 0}


def first_threshold(nodes: Iterable[fx.Node], values: dict | None = None) -> fx.Node | None:
    """The first of ``nodes`` that applies a bound or branch on data (:data:`THRESHOLD_OPS`). A mask made of
    sizes alone (``tril(ones(T, T))``, an ``arange`` comparison) and applied by ``masked_fill`` or ``where``
    is no threshold on data; nor is a branch at 0 (relu, abs, sign, ``x > 0``) whose input took both signs,
    each at a fifth of the points checked at least (``values``: node → value there), so that the check
    saw both sides of it (``relu(x − 2) + 2`` is a bound those points may never reach)."""
    for node in nodes:
        if node.op != "call_function" or node.target not in THRESHOLD_OPS or depends_on_sizes_only(node):
            continue
        mask = _MASK_ARGUMENT.get(node.target)
        if mask is not None and isinstance(node.args[mask], fx.Node) and (
                depends_on_sizes_only(node.args[mask]) or _both_sides_seen(node.args[mask], values)):
            continue
        if _both_sides_seen(node, values):
            continue
        return node
    return None


def _both_sides_seen(node: fx.Node, values: dict | None) -> bool:
    """A branch at 0 whose input took both signs at the points checked, each at a fifth of them at least."""
    if values is None or not _branch_at_zero(node) or not isinstance(node.args[0], fx.Node):
        return False
    x = values.get(node.args[0])
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.numel() < 10:
        return False
    return bool((x > 0).double().mean() >= 0.2) and bool((x < 0).double().mean() >= 0.2)


_AT_ZERO = {aten.relu.default, aten.abs.default, aten.sign.default, aten.heaviside.default}
_COMPARISONS = {aten.gt.Scalar, aten.ge.Scalar, aten.lt.Scalar, aten.le.Scalar}


def _branch_at_zero(node: fx.Node) -> bool:
    """relu, abs, sign, ``clamp(x, min=0)``, ``x > 0``: a branch at 0 and no other bound."""
    if node.target in _AT_ZERO:
        return True
    if node.target in _COMPARISONS:
        return node.args[1] == 0
    if node.target in (aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default):
        bounds = [b for b in node.args[1:] if b is not None] + [b for b in node.kwargs.values() if b is not None]
        return all(isinstance(b, (int, float)) and b == 0 for b in bounds)
    return False


_SIZE_OF = {aten.sym_size.int, aten.sym_numel.default, aten.sym_stride.int, aten.sym_storage_offset.default}


def nodes_between(sources: Iterable[fx.Node], sinks: Iterable[fx.Node]) -> list[fx.Node]:
    """The nodes computed from one of ``sources`` that one of ``sinks`` is computed from (sinks included), not
    through another source, in graph order: what a fusion from those inputs to those outputs replaces (what
    an input is computed from stays)."""
    sinks, sources = list(sinks), [s for s in sources if isinstance(s, fx.Node)]
    up, stack = set(sinks), [s for s in sinks if s not in sources]
    while stack:
        for i in stack.pop().all_input_nodes:
            if i not in up:
                up.add(i)
                # (a size read off a tensor, under dynamic shapes, is no path from its values)
                if i not in sources and i.target not in _SIZE_OF:
                    stack.append(i)
    down, stack = set(), list(sources)
    while stack:
        for u in stack.pop().users:
            if u not in down and u in up:
                down.add(u)
                stack.append(u)
    graph = sinks[0].graph
    return [n for n in graph.nodes if n in down]


def op_name(node: fx.Node) -> str:
    """The op a node calls, as the user wrote it: ``tanh`` for ``aten.tanh.default``."""
    return str(node.target).removeprefix("aten.").split(".")[0]


def bound_reason(node: fx.Node, what: str) -> str:
    """Why a fusion found by evaluation stops at a bound or branch on data in its region."""
    return (f"{what} applies {op_name(node)} ({source_line([node]) or node.name}), a bound or branch on data: the check at "
            "random points cannot see past it (where it is not reached it passes for the value it bounds), and "
            "the fused op would drop it")


def is_pointwise(node: fx.Node) -> bool:
    """An ATen op computing each output element from the elements at its position (``torch.Tag.pointwise``)."""
    return node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) \
        and torch.Tag.pointwise in node.target.tags


def depends_on_sizes_only(node: fx.Node) -> bool:
    """Whether ``node`` reads no tensor input of the graph: its value is made of sizes and constants (a causal
    mask)."""
    return not tensors_read([node])


def is_zeros(node: Any) -> bool:
    """Whether ``node`` makes a tensor of zeros (zeros, zeros_like, new_zeros, or a full of 0) that nothing writes
    into afterwards (``M = zeros(..); M[:, 0, 0] = 1`` is no zeros)."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or written_in_place(node) is not None:
        return False
    if node.target in (aten.zeros_like.default, aten.new_zeros.default, aten.zeros.default):
        return True
    if node.target in (aten.full.default, aten.new_full.default, aten.full_like.default):
        fill = node.args[1] if node.target in (aten.full_like.default, aten.full.default) else node.args[-1]
        return fill == 0
    return False


def constant_tensor(node: Any) -> torch.Tensor | None:
    """The value of a constant tensor of the graph (a ``get_attr`` that is not a parameter: a tensor the
    model makes in forward, such as the ``torch.tensor(0.5)`` of ``Normal(mu, 0.5)``), else None."""
    if not isinstance(node, fx.Node) or node.op != "get_attr" or node.graph.owning_module is None:
        return None
    value = node.graph.owning_module
    for name in node.target.split("."):
        value = getattr(value, name, None)
    return value if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter) else None


def made_in_forward(node: Any) -> torch.Tensor | None:
    """The value of a tensor the model makes in forward that Dynamo lifted into a constant of the graph
    (``torch.tensor(float("-inf"))``, a ``get_attr`` named ``_tensor_constant*``), else None. Not a buffer or
    parameter: those may change between calls."""
    if isinstance(node, fx.Node) and node.op == "get_attr" and node.target.startswith("_tensor_constant"):
        return constant_tensor(node)
    return None


_ONE_ELEMENT_VIEWS = (aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.view.default,
                      aten.reshape.default, aten.unsqueeze.default, aten.select.int)


def snapped(value: float) -> float:
    """A number found by evaluation (an eps as the difference of two float64 values), without the rounding it
    picked up: 0 where it is within 1e-12 of it (an eps of 0 evaluates to ±1e-16), else 12 significant digits
    (1e-6 evaluates to 1e-6 ± 1e-17)."""
    return 0.0 if abs(value) < 1e-12 else float(f"{value:.12g}")


def number_of(arg: Any) -> float | None:
    """The number ``arg`` holds: a Python number, a one-element constant tensor of the graph
    (``torch.tensor(float("-inf"))`` written in the model, ``full([], v)``), or zeros; else None."""
    if isinstance(arg, (int, float)) and not isinstance(arg, bool):
        return float(arg)
    if is_zeros(arg):
        return 0.0
    while isinstance(arg, fx.Node) and (arg.target in (aten.detach.default, aten.lift_fresh_copy.default,
                                                        aten.alias.default, aten.clone.default)
                                        or arg.target in _ONE_ELEMENT_VIEWS and isinstance(val(arg), torch.Tensor)
                                        and val(arg).numel() == 1):
        arg = arg.args[0]  # (torch.full((1,), c).squeeze(): the number c)
    if isinstance(arg, fx.Node) and arg.op == "call_function":
        if arg.target is aten.scalar_tensor.default and isinstance(arg.args[0], (int, float)):
            return float(arg.args[0])
        if arg.target is aten.full.default and all(d == 1 for d in arg.args[0]) and isinstance(arg.args[1], (int, float)):
            return float(arg.args[1])
    value = constant_tensor(arg)
    return value.item() if value is not None and value.numel() == 1 and value.dtype != torch.bool else None


def zero_pad_amounts(node: Any) -> list[int] | None:
    """The amounts of ``F.pad(x, amounts)`` when it pads with zeros (mode constant, value 0 or unset) by fixed
    amounts, else None (not a pad, another fill, or symbolic amounts)."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or node.target is not torch.ops.aten.pad.default:
        return None
    mode, value = pad_fill(node)
    if mode != "constant" or value not in (None, 0) or not all(isinstance(a, int) for a in node.args[1]):
        return None
    return list(node.args[1])


def zero_padded_dims(node: Any) -> dict[int, tuple[int, int]] | None:
    """{dim: (before, after)} for each dim a zero ``F.pad`` pads (see :func:`zero_pad_amounts`), else None."""
    return padded_dims(node) if zero_pad_amounts(node) is not None else None


def padded_dims(node: Any) -> dict[int, tuple[int, int]] | None:
    """{dim: (before, after)} for each dim ``F.pad`` pads by fixed amounts, whatever it fills with (its amounts
    run from the last dim back), else None."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if not isinstance(val, torch.Tensor) or node.target is not torch.ops.aten.pad.default \
            or not all(isinstance(a, int) for a in node.args[1]):
        return None
    amounts = list(node.args[1])
    pairs = zip(amounts[::2], amounts[1::2])
    return {val.dim() - 1 - i: pair for i, pair in enumerate(pairs) if any(pair)}


def size_hint(size: Any) -> int:
    """A size as a number: a symbolic size's hint (the value it has now), without adding a guard."""
    if not isinstance(size, torch.SymInt):
        return int(size)
    try:
        from torch.fx.experimental.symbolic_shapes import optimization_hint
    except ImportError:  # torch < 2.12: the same hint, read the older way
        return size.node.shape_env.size_hint(size.node.expr)
    return optimization_hint(size)


def shifted_size(size: Any, only: Any = None) -> int:
    """A size at other lengths: each symbol it is computed from (of ``only``, when given) 3 more than its hint (a
    value read from sizes under dynamic shapes, checked at a second point: ``j <= i + (n − 6)`` is causal at
    n = 6 alone)."""
    if not isinstance(size, torch.SymInt):
        return int(size)
    expr, env = size.node.expr, size.node.shape_env
    hints = getattr(env, "backed_var_to_val", None) or env.var_to_val  # (renamed in torch 2.13)
    if any(symbol not in hints for symbol in expr.free_symbols):
        return size_hint(size)
    return int(expr.xreplace({symbol: hints[symbol] + (3 if only is None or symbol in only else 0)
                              for symbol in expr.free_symbols}))


def tensors_read(roots: Sequence[fx.Node], stop: Sequence[fx.Node] = ()) -> list[fx.Node]:
    """The graph's input tensors (placeholders and get_attr: arguments, parameters, buffers) that ``roots``
    compute from, not looking past ``stop``: what a value reads beside sizes and constants."""
    stack, seen, found = list(roots), set(stop), []
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if _is_size(node):
            continue  # x.shape[1] (sym_size under torch.export) reads x's size, not its values
        if node.op in ("placeholder", "get_attr") and isinstance(node.meta.get("val"), torch.Tensor):
            found.append(node)
        stack += node.all_input_nodes
    return found


def written_in_place(node: fx.Node) -> fx.Node | None:
    """An op that writes into ``node``'s values after it is made (in place, or by item assignment, into it, into
    what it is a view of, or into a view of either), or None: a value evaluated from what computes it would miss
    the write."""
    return next(iter(writes_into(node)), None)


def writes_into(node: fx.Node) -> list[fx.Node]:
    """Every op that writes into ``node``'s values (see :func:`written_in_place`)."""
    node = _base(node)  # a view sees what is written into its base
    stack, seen, writers = [node], set(), []
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        for user in n.users:
            written = user.args[0] if user.args else None
            if (written is n or user.kwargs.get("out") is n) and mutates(user) and user.target not in _WRITE_NO_VALUES:
                writers.append(user)  # (in place, or through out=: nn.init.eye_(M[0]) is eye(.., out=M[0]))
            if user.args and user.args[0] is n and aliases(user):
                stack.append(user)
    return writers


# in-place ops that write no values: ``torch.tensor(c)`` is a constant with a ``detach_``
_WRITE_NO_VALUES = {"detach_", "requires_grad_", aten.detach_.default}


def mutates(node: fx.Node) -> bool:
    """Whether ``node`` may write into a tensor (in place, through ``out=`` or by item assignment)."""
    if node.op not in ("call_function", "call_method"):
        return False
    if isinstance(node.target, torch._ops.OpOverload):
        return node.target._schema.is_mutable
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) \
        or node.target in (operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.setitem) \
        or node.kwargs.get("inplace") is True or "out" in node.kwargs


def aliases(node: fx.Node) -> bool:
    """Whether ``node`` is a view of its first argument (so a write into it writes there): an ATen op whose
    schema says its result aliases its input, or a call of Dynamo's graph whose result shares the input's
    storage (``squeeze``, ``x[:, t]``, ``.mT``)."""
    if node.op not in ("call_function", "call_method") or not node.args:
        return False
    schema = getattr(node.target, "_schema", None)
    if schema is not None:
        return len(schema.returns) == 1 and schema.returns[0].alias_info is not None and not schema.is_mutable
    def fake(n):  # ``val`` in ATen graphs, ``example_value`` in Dynamo's
        return n.meta.get("val", n.meta.get("example_value")) if isinstance(n, fx.Node) else None

    value, base = fake(node), fake(node.args[0])
    try:
        return isinstance(value, torch.Tensor) and isinstance(base, torch.Tensor) \
            and value.untyped_storage()._cdata == base.untyped_storage()._cdata
    except Exception:  # a tensor without storage
        return False



def written_tensor(node: fx.Node) -> fx.Node:
    """The tensor a write into ``node`` lands in: followed through views and through the in-place writes before
    it (a write into ``flat.view(..).mul_(a)`` lands in ``flat``)."""
    while isinstance(node, fx.Node) and node.args and isinstance(node.args[0], fx.Node) \
            and (aliases(node) or mutates(node)):
        node = node.args[0]
    return node

def _is_size(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val", node.meta.get("example_value")), (int, torch.SymInt)) \
        and not isinstance(node.meta.get("val"), bool)


def flat_args(node: fx.Node) -> list[Any]:
    """A node's positional arguments, then its keyword arguments by name."""
    return list(node.args) + [node.kwargs[k] for k in sorted(node.kwargs)]


def literal_slots(pattern: fx.Graph, roles: dict[float, str] | None = None) -> list[tuple[fx.Node, int, str | None, Any]]:
    """``(pattern node, argument index, role, value)`` of every literal in the pattern.

    ``roles`` names the literals that are parameters (traced with distinctive values, e.g.
    ``{2.75: "p"}``); every other literal is structural and must match (:func:`same_literal`).
    """
    roles = roles or {}
    slots = []
    for pn in pattern.nodes:
        if pn.op != "call_function":
            continue
        for i, value in enumerate(flat_args(pn)):
            if not isinstance(value, fx.Node):
                slots.append((pn, i, roles.get(value) if isinstance(value, float) else None, value))
    return slots


# ops whose argument 1 is a dim (or dims), and how much rank the dim is counted against adds
_DIM_OPS = {torch.ops.aten.unsqueeze.default: 1, torch.ops.aten.squeeze.dim: 0, torch.ops.aten.sum.dim_IntList: 0,
            torch.ops.aten.cumsum.default: 0, torch.ops.aten.select.int: 0}


def same_literal(pn: fx.Node, gn: fx.Node, i: int, expected: Any, got: Any) -> bool:
    """Whether literal ``i`` of graph node ``gn`` means what ``expected`` means in pattern node ``pn``.

    Equal values match (ints and floats alike); a dim written negative in one and positive in
    the other matches too (-1 and 3 on a rank-4 tensor).
    """
    if expected == got and (type(expected) is type(got) or _is_number(expected) and _is_number(got)):
        return True
    if pn.target in _DIM_OPS and i == 1:
        rank = gn.args[0].meta["val"].dim() + _DIM_OPS[pn.target]
        norm = lambda d: [x % rank for x in (d if isinstance(d, (list, tuple)) else [d])]  # noqa: E731
        return norm(expected) == norm(got)
    return False


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_gradients_flow(args: Sequence[Any], outputs: Sequence[fx.Node]) -> None:
    """Raise :class:`NotFused` if the subgraph from ``args`` to ``outputs`` stops gradients on the way
    (``detach``; what is computed under ``torch.no_grad()`` reaches the rest through one), also inside
    a loop body it calls: a fused op's backward would let them through. A detached constant stops
    nothing."""
    inputs = {a for a in pytree.tree_leaves(list(args)) if isinstance(a, fx.Node)}
    region, replaced = _differentiable_ancestors(outputs, inputs), set(outputs)
    for node in region:
        if node in inputs and all(u in replaced or u not in region for u in node.users):
            continue  # a detached input read by the replaced outputs alone (β @ mu.detach()): the op reads it so
        if is_register_hook(node.target):
            raise NotFused(hook_reason(node))
        stop = gradient_stop(node, inputs)
        if stop is not None and stop in replaced:
            continue  # (an output read through detach, made under no_grad: the fused op's is detached too)
        if stop is None:
            stop = next((s for body in _bodies(node) if (s := first_gradient_stop(body)) is not None), None)
        if stop is not None:
            raise NotFused(gradient_stop_reason(stop))


def first_gradient_stop(body: fx.GraphModule) -> fx.Node | None:
    """The first detach in a loop body of what its inputs compute (``M.detach()`` at every step; what is computed
    under torch.no_grad() reaches the rest through one), or None."""
    inputs = set(body.graph.find_nodes(op="placeholder"))
    return next((s for n in body.graph.nodes if (s := gradient_stop(n, inputs)) is not None), None)


def is_register_hook(target: Any) -> bool:
    """``target`` is torch's ``register_hook`` operator, a gradient hook registered inside the compiled code
    (``y.register_hook(fn)``), or a copy of it (deep-copying a graph copies it)."""
    return isinstance(target, torch._ops.HigherOrderOperator) and target.name() == "register_hook"


def check_no_hook_on_what_is_read_inside(replaced: Sequence[fx.Node], outputs: Sequence[fx.Node]) -> None:
    """NotFused where a gradient hook is registered on a replaced output that the replaced nodes also read (a
    loop's final state, read by its last step; a value read by a later op of the subgraph): the hook changes the
    whole gradient of that tensor, the fused op's backward would apply it to the part leaving the op alone."""
    inside = set(replaced)
    for output in outputs:
        hooks = [u for u in output.users if is_register_hook(u.target)]
        if hooks and (any(u in inside for u in output.users) or _final_carry(output, inside)):
            raise NotFused(hook_reason(hooks[0]))


def _final_carry(node: fx.Node, inside: set[fx.Node]) -> bool:
    """Whether ``node`` is a carried value a replaced ``scan`` returns (its last step computed and read it)."""
    if node.target is not operator.getitem or not isinstance(node.args[0], fx.Node):
        return False
    scan = node.args[0]
    return scan in inside and scan.target is torch.ops.higher_order.scan and node.args[1] < len(scan.args[1])


# the meta key of a node a pass keeps though nothing reads it (a memory split per row: its gates read per row)
KEEP = "hecate_keep"


def eliminate_dead_code(graph: fx.Graph) -> None:
    """``graph.eliminate_dead_code()`` keeping the gradient hooks registered in it (a hook on a value read before
    it is registered, or not at all afterwards, has no reader, and still acts in backward) and the nodes marked
    :data:`KEEP`, in it and in the graphs it calls (a scan's body), which torch's own recursion would not."""
    for node in reversed(graph.nodes):
        if not node.users and not (node.is_impure() or is_register_hook(node.target) or node.meta.get(KEEP)):
            graph.erase_node(node)
    owner = graph.owning_module
    if owner is None:
        return
    called = {n.target for n in graph.find_nodes(op="get_attr")}
    for name, child in owner.named_children():
        if name in called and isinstance(child, fx.GraphModule):
            eliminate_dead_code(child.graph)
            child.recompile()


def hook_reason(hook: fx.Node) -> str:
    return (f"a gradient hook is registered at {source_line([hook]) or hook.name} on a value the fused op would "
            "compute (or read) inside: its backward would not apply the hook there; compiled as written")


def gradient_stop_reason(stop: fx.Node) -> str:
    return (f"gradients stop inside it at {source_line([stop]) or stop.name} (detach, a value computed under "
            "torch.no_grad(), or a number read by .item()); the fused op would let them through; compiled as written")


def gradient_stop(node: fx.Node, inputs: set[fx.Node]) -> fx.Node | None:
    """``node`` if it is a detach of something computed from ``inputs``."""
    if node.target is torch.ops.aten.detach.default and inputs & _differentiable_ancestors(node.args, inputs) \
            and any(n.op == "placeholder" for n in tensors_read(node.args[:1])):
        return node  # (torch.tensor(0.9) in forward is a get_attr constant, detached: no gradient to stop)
    if node.target in _READ_AS_A_NUMBER and inputs & _differentiable_ancestors(node.args, inputs) \
            and any(n.op == "placeholder" and n.meta.get("requires_grad", True) for n in tensors_read(node.args[:1])):
        return node  # (Dynamo's 0-d input for a float attribute under dynamic=True requires no gradient)
    return None


# why an input's in-place writes stay writes, and what to write instead (the loop then rolls up)
INPUT_WRITTEN_ADVICE = ("Hecate reads in-place writes into an input as a state reassigned only where nothing else "
                        "holds the input (no view of it read or written, not returned) and it requires no gradient "
                        "or the call runs without them: update a tensor of the function's own, M = state.clone(), "
                        "and write it back once after the loop, state.copy_(M)")


def is_one(size: Any) -> bool:
    """``size`` is 1 for every input the graph is compiled for (not a dynamic size that is 1 now)."""
    return statically_known_true(size == 1)


def inline(gm: fx.GraphModule, sub: fx.GraphModule, inputs: Sequence[Any]) -> tuple[Any, list[fx.Node]]:
    """Copy graph ``sub`` into ``gm`` at its insertion point, its placeholders read as ``inputs`` in order: (its
    output as the graph returns it, the nodes emitted). A constant ``sub`` holds becomes one of ``gm``'s."""
    env: dict[fx.Node, Any] = dict(zip([n for n in sub.graph.nodes if n.op == "placeholder"], inputs))
    graph, result, emitted = gm.graph, None, []
    for n in sub.graph.nodes:
        if n.op == "call_function":
            env[n] = graph.node_copy(n, lambda a: env[a])
            emitted.append(env[n])
        elif n.op == "get_attr":
            name = free_attribute(gm, n.target)
            gm.register_buffer(name, getattr(sub, n.target), persistent=False)
            env[n] = graph.get_attr(name)
            env[n].meta = dict(n.meta)
            emitted.append(env[n])
        elif n.op == "output":
            result = fx.node.map_arg(n.args[0], lambda a: env[a])
    return result, emitted


def same_shape(node: Any, x: Any) -> bool:
    """``node``'s value has ``x``'s shape, provably (sizes compared without a guard: a symbolic size equal to
    another only now is not the same)."""
    a, b = (n.meta.get("val", n.meta.get("example_value")) if isinstance(n, fx.Node) else n for n in (node, x))
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() == b.dim() \
        and all(statically_known_true(m == n) for m, n in zip(a.shape, b.shape))


_READ_AS_A_NUMBER = (torch.ops.aten.item.default, torch.ops.aten._local_scalar_dense.default)  # .item()


def _bodies(node: fx.Node) -> list[fx.GraphModule]:
    """The graphs ``node`` calls (a scan's or a checkpoint's body)."""
    owner = node.graph.owning_module
    return [getattr(owner, a.target) for a in node.all_input_nodes
            if a.op == "get_attr" and isinstance(getattr(owner, a.target, None), fx.GraphModule)]


def _differentiable_ancestors(nodes: Sequence[Any], stop: set[fx.Node]) -> set[fx.Node]:
    """``nodes`` and the floating-point tensors they are computed from, up to the nodes in ``stop``
    (sizes and masks carry no gradient)."""
    seen: set[fx.Node] = set()
    stack = [n for n in nodes if isinstance(n, fx.Node)]
    while stack:
        node = stack.pop()
        values = pytree.tree_leaves(node.meta.get("val"))  # a loop's results come as a tuple
        if node in seen or not any(isinstance(v, torch.Tensor) and v.is_floating_point() or isinstance(v, torch.SymFloat)
                                   for v in values):  # (a number read by .item() is one: no gradient passes it)
            continue
        seen.add(node)
        if node not in stop:
            stack.extend(node.all_input_nodes)
    return seen


def check_nothing_written_in_place(args: Sequence[Any], replaced: Sequence[fx.Node],
                                   outputs: Sequence[fx.Node] = ()) -> tuple[list[fx.Node], dict]:
    """NotFused where a tensor the fused op reads is written in place among the nodes it replaces, or one it
    replaces is written at all: the op runs where the replaced outputs were, after any write in between, and would
    see the tensor at another point than the code. A write done before the first replaced node both see. Returns
    the ``outputs`` written in place after the last replaced node (``y[:, 0] = 0`` after the family, also through a
    view): those are fine, on a copy of the op's result (:func:`_copies_for_writers`), unless two outputs share
    their values; and the tensors read that are written only after the replaced nodes that read them (``k.add_(1)``
    after the loop, a cache written back after the window is made from it), each with the node before which the op
    reads a copy of it (:func:`_read_from_copies`): the values the code read, which the op's backward may save."""
    order = {n: i for i, n in enumerate(replaced[0].graph.nodes)} if replaced else {}
    first = min((order[n] for n in replaced), default=0)
    last = max((order[n] for n in replaced), default=0)
    late = {w for n in replaced for w in writes_into(n) if order[w] > last}  # (reach them through the outputs)
    written = [o for o in outputs if late & set(writes_into(o))]
    bases = [_base(o) for o in outputs]
    shared = [o for o in written if bases.count(_base(o)) > 1]
    copies = {}
    # the replaced nodes and what they read: where the code reads what the op takes (a conv's cat([state, x]))
    near = set(replaced) | {i for n in replaced for i in n.all_input_nodes if i.op == "call_function"}
    for node, read in [(n, True) for a in args for n in _nodes_in(a)] + [(n, False) for n in replaced]:
        writers = [w for w in writes_into(node)
                   if (w not in late or shared or not written) and (not read or order.get(w, first) >= first)]
        viewed = [node]  # (it, and what it is a view of: a transpose a pass made of what the replaced nodes read)
        while viewed[-1].args and isinstance(viewed[-1].args[0], fx.Node) and aliases(viewed[-1]):
            viewed.append(viewed[-1].args[0])
        readers = sorted((r for r in near if any(v in r.all_input_nodes for v in viewed)), key=order.__getitem__)
        read_last = max(order[readers[-1]] if readers else last, order.get(node, first))
        if read and writers and all(order.get(w, first) > read_last for w in writers):  # (read, then written)
            at = readers[0] if readers and order[readers[0]] > order.get(node, first) else node.next
            copies.setdefault(node, at if readers else _last(replaced[0].graph, replaced))
        elif writers:
            raise NotFused(f"{node.name}, read or replaced by it, is written in place ({writers[0].name}): the fused "
                           "op would see it at another point than the code does")
    return written, copies


def _read_from_copies(graph: fx.Graph, args: Sequence[Any], copies: dict) -> list:
    """``args`` with each tensor of ``copies`` (node → where: tensors the code writes in place after reading them)
    read from a clone taken there: the op sees the values the code read, and what its backward saves stays so."""
    made = {}
    for node, before in copies.items():
        with graph.inserting_before(before):
            made[node] = graph.call_function(torch.ops.aten.clone.default, (node,))
        made[node].meta = {**node.meta, "val": node.meta["val"].clone()}
    return [fx.node.map_arg(a, lambda n: made.get(n, n)) for a in args]


def _base(node: fx.Node) -> fx.Node:
    while node.args and isinstance(node.args[0], fx.Node) and aliases(node):
        node = node.args[0]
    return node


def _copies_for_writers(graph: fx.Graph, old_outputs: Sequence[fx.Node], new_outputs: Sequence[fx.Node],
                        written: Sequence[fx.Node]) -> list[fx.Node]:
    """``new_outputs``, each of those standing for a ``written`` output cloned: what the code writes into
    afterwards is a tensor of its own, as the replaced output was, never the op's result (which its backward
    may have saved)."""
    copies = []
    for old, new in zip(old_outputs, new_outputs):
        if old in written:
            with graph.inserting_after(new):
                copy = graph.call_function(torch.ops.aten.clone.default, (new,))
            copy.meta = {**old.meta, "val": new.meta["val"].clone()}
            new = copy
        copies.append(new)
    return copies


def replace_with_op(gm: fx.GraphModule, match: Match, op: torch._ops.OpOverload,
                    args: Sequence[Any], outputs: Sequence[int | None] | None = None) -> fx.Node:
    """Replace the matched subgraph by one call ``op(*args)``.

    ``outputs[i]`` says which result of ``op`` stands for ``match.outputs[i]``
    (``None``: ``op`` returns a single tensor that replaces the single output).
    The new node gets its fake value, so later passes and exporters can read
    its shape. Returns the new call node.
    """
    check_gradients_flow(args, match.outputs)
    check_no_hook_on_what_is_read_inside(match.nodes, match.outputs)
    written, copies = check_nothing_written_in_place(args, match.nodes, match.outputs)
    graph = gm.graph
    args = _read_from_copies(graph, args, copies)
    with graph.inserting_before(_last(graph, match.nodes)):
        call = graph.call_function(op, tuple(args))
    call.meta["val"] = _fake_run(op, args)
    if outputs is None:
        outputs = [None] * len(match.outputs)
    new_outputs = []
    for index in outputs:
        if index is None:
            new_outputs.append(call)
            continue
        with graph.inserting_after(call):
            new = graph.call_function(operator.getitem, (call, index))
        new.meta["val"] = call.meta["val"][index]
        new_outputs.append(new)
    _substitute(graph, match.nodes, match.outputs, _copies_for_writers(graph, match.outputs, new_outputs, written))
    return call


# the meta key of the nodes a fusion emits (the op's call and the code around it): not the user's code, so no
# signature of a family among them is reported as a miss
EMITTED = "hecate_emitted"


def replace_with_function(gm: fx.GraphModule, replaced: Match | Sequence[fx.Node], fn: Callable,
                          args: Sequence[Any], outputs: Sequence[fx.Node] | None = None,
                          as_computed: Sequence[fx.Node] = ()) -> list[fx.Node]:
    """Replace a subgraph by what the plain PyTorch function ``fn(*args)`` computes.

    ``replaced`` is a :class:`Match`, or the graph nodes to replace with ``outputs`` the
    ones of them read afterwards. ``args`` are graph nodes (bound to their fake values) or
    literals; ``fn`` returns one tensor per output (a tensor, or a tuple of them). ``fn`` is
    traced with ``make_fx`` under the graph's fake mode and its nodes inlined: a size it
    reads (``x.shape[0]``) becomes a ``sym_size`` node of the graph under ``dynamic=True``,
    never a SymInt frozen into the generated code. The new nodes carry their fake values
    and the user's source line of the replaced subgraph. Returns the nodes that now stand
    for the outputs. Each is cast to the dtype of the output it replaces, but those in ``as_computed``: values
    something else is computed from (a fused loop's reads, before the step's function of them).
    """
    nodes, old_outputs = (replaced.nodes, replaced.outputs) if isinstance(replaced, Match) \
        else (list(replaced), list(outputs or ()))
    if not old_outputs:
        raise ValueError(f"replace_with_function: no outputs to replace among {[n.name for n in nodes]}; "
                         "pass a Match or outputs=[the replaced nodes read afterwards]")
    check_gradients_flow(args, old_outputs)
    check_no_hook_on_what_is_read_inside(nodes, old_outputs)
    written, copies = check_nothing_written_in_place(args, nodes, old_outputs)
    if computed_from([n for a in args for n in _nodes_in(a)], set(old_outputs)):
        raise NotFused("the replacement would read values computed from what it replaces (a cycle); "
                       "the graph is left as it was")
    args = _read_from_copies(gm.graph, args, copies)
    values = [fx.node.map_aggregate(a, val) for a in args]
    fake_mode = detect_fake_mode([v for v in values if isinstance(v, torch.Tensor)])
    if fake_mode is None:
        raise ValueError("replace_with_function: no argument has a fake value (node.meta['val']); "
                         "the graph must come from the pipeline's re-trace")
    with fake_mode:
        traced = make_fx(_in_dtypes_of(_in_eagers_precision(fn, nodes, values),
                                       [None if o in as_computed else o for o in old_outputs]),
                         pre_dispatch=True)(*values)
    graph = gm.graph
    source = next((n.meta["stack_trace"] for n in reversed(nodes) if n.meta.get("stack_trace")), None)
    env: dict[fx.Node, Any] = {}
    placeholders = iter(args)
    new_outputs: list[fx.Node] = []
    with graph.inserting_before(_last(graph, nodes)):
        for node in traced.graph.nodes:
            if node.op == "placeholder":
                env[node] = next(placeholders)
            elif node.op == "get_attr":  # a tensor fn created (torch.tensor(...)) becomes a constant of gm
                name = free_attribute(gm, node.target)
                gm.register_buffer(name, getattr(traced, node.target), persistent=False)
                env[node] = graph.get_attr(name)
                env[node].meta = dict(node.meta)
            elif node.op == "output":
                new_outputs = list(pytree.tree_leaves(fx.node.map_arg(node.args[0], env.__getitem__)))
            else:
                env[node] = graph.node_copy(node, env.__getitem__)
                env[node].meta[EMITTED] = True
                if source is not None:
                    env[node].meta["stack_trace"] = source
    if len(new_outputs) != len(old_outputs):
        raise ValueError(f"replace_with_function: {getattr(fn, '__name__', fn)} returned {len(new_outputs)} "
                         f"tensor(s) for {len(old_outputs)} output(s) of the replaced subgraph")
    new_outputs = _detached_where_they_were(graph, old_outputs, new_outputs)
    new_outputs = _copies_for_writers(graph, old_outputs, new_outputs, written)
    _substitute(graph, nodes, old_outputs, new_outputs)
    return new_outputs


def _detached_where_they_were(graph: fx.Graph, old_outputs: Sequence[fx.Node],
                              new_outputs: list[fx.Node]) -> list[fx.Node]:
    """``new_outputs``, each read through ``detach`` where the output it replaces is a detach (a value made under
    no_grad and read after it): no gradient flows back through the fused op's either."""
    out = []
    for old, new in zip(old_outputs, new_outputs):
        if old.target is aten.detach.default and isinstance(new, fx.Node):
            with graph.inserting_after(new):
                detached = graph.call_function(aten.detach.default, (new,))
            detached.meta = {**new.meta, "val": val(new).detach()}
            new = detached
        out.append(new)
    return out


def _in_eagers_precision(fn: Callable, nodes: Sequence[fx.Node], values: Sequence[Any]) -> Callable:
    """``fn`` run with autocast off where autocast is on and the code it replaces computes nothing in autocast's
    lower dtype: eager runs elementwise code (a KL written out, a read by ``*`` and a sum) in float32 under
    autocast, where an op would cast its inputs as autocast casts a matmul's (:mod:`hecate.lowering.autocast`)."""
    device = next((v.device.type for v in pytree.tree_leaves(values) if isinstance(v, torch.Tensor)), None)
    if device not in ("cpu", "cuda") or not torch.is_autocast_enabled(device):
        return fn
    lower = torch.get_autocast_dtype(device)
    if any(getattr(val(n), "dtype", None) == lower for n in nodes):
        return fn

    def in_float32(*args):
        with torch.autocast(device, enabled=False):
            return fn(*args)

    return in_float32


def _in_dtypes_of(fn: Callable, outputs: Sequence[fx.Node | None]) -> Callable:
    """``fn`` with each output cast to the dtype of the node it replaces where they differ (None: as fn gives it):
    under autocast a read rounded to bf16 and divided by a float32 normaliser is float32, and so must the fused
    result be."""
    dtypes = [getattr(val(o), "dtype", None) if o is not None else None for o in outputs]

    def in_dtypes(*args):
        leaves, spec = pytree.tree_flatten(fn(*args))
        leaves = [x.to(d) if isinstance(x, torch.Tensor) and d is not None and x.dtype != d else x
                  for x, d in itertools.zip_longest(leaves, dtypes[:len(leaves)])]
        return pytree.tree_unflatten(leaves, spec)

    return in_dtypes


def _nodes_in(arg: Any) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg(arg, found.append)
    return found


def descendants(node: fx.Node, depth: int) -> list[fx.Node]:
    """The calls reading ``node`` within ``depth`` steps, in graph order."""
    found, frontier = set(), {node}
    for _ in range(depth):
        frontier = {u for n in frontier for u in n.users if u.op == "call_function"} - found
        found |= frontier
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return sorted(found, key=order.__getitem__)


def computed_from(roots: Sequence[fx.Node], sources: set[fx.Node]) -> bool:
    """Whether any of ``roots`` is one of ``sources`` or computed from one."""
    stack, seen = list(roots), set()
    while stack:
        node = stack.pop()
        if node in sources:
            return True
        if node not in seen:
            seen.add(node)
            stack += node.all_input_nodes
    return False


def _last(graph: fx.Graph, nodes: Sequence[fx.Node]) -> fx.Node:
    order = {n: i for i, n in enumerate(graph.nodes)}
    return max(nodes, key=order.__getitem__)


def free_attribute(gm: fx.GraphModule, prefix: str) -> str:
    return next(name for i in itertools.count() if not hasattr(gm, name := f"_hecate_{prefix}_{i}"))


def _substitute(graph: fx.Graph, nodes: Sequence[fx.Node], old_outputs: Sequence[fx.Node],
                new_outputs: Sequence[fx.Node]) -> None:
    """Point every reader of ``old_outputs[i]`` at ``new_outputs[i]`` and erase the replaced ``nodes``."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for old, new in zip(old_outputs, new_outputs):
        old.replace_all_uses_with(new)
    for node in sorted(nodes, key=order.__getitem__, reverse=True):
        if not node.users:
            graph.erase_node(node)
    restore_topological_order(graph)  # users of an early output may sit before the new nodes


def restore_topological_order(graph: fx.Graph) -> None:
    """Move nodes, in place, so every node follows its inputs; otherwise keep their order.

    In place (unlike ``legalize_graph``, which rebuilds the graph) so node objects a pass
    holds stay valid.
    """
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    if all(position[i] < position[n] for n in nodes for i in n.all_input_nodes):
        return
    placed: set[fx.Node] = set()
    entered: set[fx.Node] = set()
    order: list[fx.Node] = []
    for root in nodes:  # depth-first, inputs before users, iterative (graphs can be deep)
        stack = [(root, False)]
        while stack:
            node, inputs_done = stack.pop()
            if node in placed:
                continue
            if inputs_done:
                placed.add(node)
                order.append(node)
                continue
            if node in entered:  # reached again from its own inputs: no order exists
                raise RuntimeError(f"restore_topological_order: the graph has a cycle through {node.name}")
            entered.add(node)
            stack.append((node, True))
            for i in sorted(node.all_input_nodes, key=position.__getitem__, reverse=True):
                if i not in placed:
                    stack.append((i, False))
    previous = order[0]
    for n in order[1:]:
        previous.append(n)  # fx moves ``n`` to just after ``previous``
        previous = n


def _fake_run(op: torch._ops.OpOverload, args: Sequence[Any]) -> Any:
    vals = [fx.node.map_aggregate(a, val) for a in args]  # also inside lists, e.g. Tensor[] args
    fake_mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    if fake_mode is None:
        return None
    with fake_mode:
        return op(*vals)
