"""Roll the loops Dynamo unrolled back up into one ``scan`` before re-tracing to ATen.

Dynamo unrolls ``for t in range(T): state, y_t = step(state, x[:, t])`` into T copies of
the step. Re-tracing every copy to ATen (~2 ms a node) and matching patterns over them
makes compile time grow with T. This module finds such a run of copies in Dynamo's graph,
proves it is one loop, and replaces it by the node Dynamo itself emits for torch's scan::

    torch.ops.higher_order.scan(body, init, xs, invariants)

so re-tracing sees the body once and the memory passes fuse the scan like a user's own.
It serves Dynamo's graph and ATen graphs (torch.export's) alike. What :meth:`_Loop.verify`
proves, for T ≥ 2 consecutive blocks of L nodes:

* node ``o`` of every block has the same op, target and literals, except the time index of
  a per-step slice: block t reads time index start + t of one tensor x from before the loop,
  written any way (``x[:, t]``, ``x[:, t, None]``, ``x[..., t]``, ``x.select``, ``narrow(.., t, 1)``,
  ``x[:, t:t + 1]``, ATen ``select``/``slice``): each sliced tensor becomes one of the scan's
  ``xs`` (read at several places per step, it is still one input);
* every tensor input of node ``o`` is, in every block, either node ``o'`` of the same block
  (internal), one node from before the loop (an invariant), or node ``o'`` of the previous
  block with a value from before the loop in block 0 (a carry, whose init is that value);
* after the loop only the last block's carries are read, and ``torch.stack`` of one node
  from every block, in order, or ``torch.cat`` of them along a size-1 dim (the scan's stacked
  per-step outputs), with other tensors from outside the loop before or after them where the
  code wrote a step before the loop (``M = v_0 k_0ᵀ; ys = [M q_0]``) or after it;
* nothing in the loop mutates (in-place updates of unaliased tensors are made functional
  first) or draws random numbers.

What every step computes from values before the loop alone (``1 - self.decay``, once common
subexpressions are merged) sits in block 0 only: it is first moved before the loop
(:func:`_hoist_invariants`), where it is an invariant like any other.

A run whose blocks differ from block t on (another literal, op or p) is rolled up to t and
the rest is tried again as a loop of its own, its blocks starting with the ops the run's before started
with (blocks starting inside the differing step also prove, rotated: the step's head at the end of each
block, which reads as no memory step). Nested loops are rolled from the inside: the runs with
the shortest blocks are tried first, and a loop that carries nothing (a map, such as a loop over heads
inside the loop over time) only where no loop that carries a state covers it. An index with two
integers (``alpha[:, t, h]``) is read at whichever of them advances with the blocks. A run that fails
any check is left unrolled, exactly as Dynamo produced it.

A proven loop whose carries fall into groups that never read each other (one state per head, updated
in a loop over heads inside the loop over time) is split into one scan per group (loop fission,
:func:`_parts`), so each can be matched as a memory step alone. A value of the step that reads several
groups is allowed only as a stack (or cat) of one value per group, stacked again after the loop (the
per-step outputs of the heads): each group's scan stacks its own value and the pieces are stacked
after the scans.

A loop of one step (T = 1, e.g. a one-token forward) has no second block to compare with; it
is read from what a loop leaves around it instead (:func:`_one_step`) and rolled when that
reading is unambiguous (a state nothing reads after the step: its last value computed from its start).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import is_concrete_int, statically_known_true
from torch.fx.immutable_collections import immutable_dict, immutable_list
from torch.multiprocessing.reductions import StorageWeakRef

from hecate.compiler.normalize import emit, functional_op, functionalize, mutates
from hecate.passes.matching import aliases, inline, written_in_place

_TENSOR_OPS = ("call_function", "call_method")
# words of the names of calls that draw random numbers (``F.normalize`` is none: a name matches by whole words)
_RANDOM = {"rand", "randn", "randint", "randperm", "dropout", "dropout1d", "dropout2d", "dropout3d", "bernoulli",
           "normal", "multinomial", "uniform", "poisson", "exponential", "geometric", "cauchy", "rrelu"}


@dataclass
class RolledGraph:
    """Dynamo's graph with its unrolled loops replaced by scans."""

    gm: fx.GraphModule
    steps: list[int]  # per scan emitted, in graph order: how many copies its loop had
    indices: list[int]  # per scan emitted: its loop's index among the loops found (a split loop's scans share one)

    def mark(self, aten_gm: fx.GraphModule) -> None:
        """Tag the re-traced graph's scans that are rolled loops (``meta["hecate_rolled_loop"] = T``).

        Re-tracing keeps program order, so the k-th scan of ``aten_gm`` is the k-th scan of ``gm``.
        """
        flags = [getattr(n.args[0], "target", "").startswith("hecate_loop_body")
                 for n in _scans(self.gm.graph)]
        scans = _scans(aten_gm.graph)
        if len(scans) != len(flags):
            raise RuntimeError(f"re-tracing changed the number of scans ({len(flags)} -> {len(scans)})")
        steps = iter(zip(self.indices, self.steps))
        for node, rolled in zip(scans, flags):
            if rolled:
                node.meta["hecate_rolled_index"], node.meta["hecate_rolled_loop"] = next(steps)

    @staticmethod
    def unfused_indices(aten_gm: fx.GraphModule) -> set[int]:
        """Which rolled loops (their indices in graph order, as :func:`roll_loops` ``only`` takes them) are still
        scans after the passes."""
        return {node.meta["hecate_rolled_index"] for node in _scans(aten_gm.graph)
                if "hecate_rolled_index" in node.meta}

    @staticmethod
    def unfused(aten_gm: fx.GraphModule, body_test=None) -> list[tuple[int, list[str]]]:
        """The rolled loops still scans after the passes: (steps, the ATen ops their body calls); only those
        whose body graph passes ``body_test``, when given."""
        loops = []
        for node in _scans(aten_gm.graph):
            if "hecate_rolled_loop" in node.meta:
                body = getattr(aten_gm, node.args[0].target)
                if body_test is not None and not body_test(body.graph):
                    continue
                ops = dict.fromkeys(str(n.target).removeprefix("aten.").removesuffix(".default")
                                    for n in body.graph.nodes if n.op == "call_function")
                loops.append((node.meta["hecate_rolled_loop"], list(ops)))
        return loops


def unroll_split_parts(aten_gm: fx.GraphModule, rolled: RolledGraph) -> set[str]:
    """Each scan left in ``aten_gm`` that is one part of a split loop (fission) whose other parts the passes fused,
    written out step by step in its place (its length static): a plain Hebbian memory whose loop also carries a
    normaliser no read uses (z, handed to a decoder after a prefill) stays fused, the normaliser's steps unrolled.
    Otherwise a loop that is not fused whole is compiled unrolled whole (rolled again without it, see the caller).
    Returns the names of the scans written out."""
    left = [n for n in _scans(aten_gm.graph) if "hecate_rolled_index" in n.meta]
    unrolled = set()
    for node in left:
        index = node.meta["hecate_rolled_index"]
        siblings = sum(n.meta["hecate_rolled_index"] == index for n in left)
        if rolled.indices.count(index) > siblings and isinstance(_value_of_scan_length(node), int) \
                and _plain_body(getattr(aten_gm, node.args[0].target)):
            unrolled.add(node.name)
            _unroll(aten_gm, node)
    aten_gm.recompile()
    return unrolled


def _plain_body(body: fx.GraphModule) -> bool:
    """A body of ATen calls and tensor constants alone (no graph of its own inside, which a copy would not carry)."""
    return all(n.op in ("placeholder", "output") or n.op == "call_function" and (
        isinstance(n.target, torch._ops.OpOverload) or n.target is operator.getitem)
        or n.op == "get_attr" and isinstance(getattr(body, n.target, None), torch.Tensor) for n in body.graph.nodes)


def _value_of_scan_length(node: fx.Node) -> Any:
    xs = node.args[2]
    value = xs[0].meta.get("val") if xs and isinstance(xs[0], fx.Node) else None
    return value.shape[0] if isinstance(value, torch.Tensor) else None


def _unroll(gm: fx.GraphModule, node: fx.Node) -> None:
    """Scan ``node`` (an ATen graph's: body, init, xs, invariants) written out as its steps, each a copy of the
    body reading its slices of xs, the per-step outputs stacked after the last."""
    body = getattr(gm, node.args[0].target)
    init, xs, invariants = list(node.args[1]), list(node.args[2]), list(node.args[3])
    graph, carries, ys = gm.graph, init, [[] for _ in list(body.graph.output_node().args[0])[len(init):]]
    with graph.inserting_before(node):
        for t in range(_value_of_scan_length(node)):
            step, _ = inline(gm, body, carries + [emit(graph, torch.ops.aten.select.int, x, 0, t) for x in xs]
                             + invariants)
            step = list(step)
            carries = step[:len(init)]
            for stacked, y in zip(ys, step[len(init):]):
                stacked.append(y)
        results = carries + [emit(graph, torch.ops.aten.stack.default, stacked) for stacked in ys]
    for user in list(node.users):
        user.replace_all_uses_with(results[user.args[1]])
        graph.erase_node(user)
    graph.erase_node(node)


def _scans(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "call_function" and n.target is torch.ops.higher_order.scan]


def roll_loops(gm: fx.GraphModule, only: set[int] | None = None) -> RolledGraph | None:
    """A copy of Dynamo's ``gm`` with every provable unrolled loop rolled into a scan, or None; with ``only``,
    just those of the loops (their indices in graph order) it names, the others left unrolled.

    In-place updates of tensors nothing else aliases (``M -= ...``) are first made functional
    in ``gm`` itself (exactly: see :func:`hecate.compiler.normalize.functionalize`). An ATen
    graph is expected in the normal form (:func:`hecate.compiler.normalize.normalize_graph`:
    ``x[:, t]`` of a symbolic-size x is then one ``select``).
    """
    changed = functionalize(gm.graph)
    changed = _peeled_first_steps(gm.graph) or changed
    changed = _cats_joined(gm.graph) or changed
    changed = _cats_of_unsqueezed(gm.graph) or changed
    undo = _outputs_returned_apart(gm.graph)  # (for the rolled copy alone: undone in gm below)
    changed = _outputs_read_through_their_stack(gm.graph) or changed
    if _hoist_invariants(gm.graph) or changed or undo:
        gm.recompile()
    try:
        return _rolled(gm, only)
    finally:
        if undo is not None:
            undo()
            gm.recompile()


def _rolled(gm: fx.GraphModule, only: set[int] | None) -> RolledGraph | None:
    """:func:`roll_loops` on a graph in its rolling form."""
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    loops: list[_Loop] = []
    maps: list[_Loop] = []

    def free(start: int, steps: int, period: int) -> int:
        """How many of ``steps`` blocks from ``start`` lie before any loop already rolled up."""
        ends = [other.s for other in loops if other.end > start]
        if any(other.s <= start < other.end for other in loops):
            return 0
        return min([steps] + [(e - start) // period for e in ends])

    # the innermost loops first (the shortest period): in a loop over heads around a loop over time, each head's
    # loop over time is the memory loop; the loop over heads, whose body would hold T unrolled steps, is not
    # (first slice, period, steps, how its blocks should start: as the run's before a step that differs did)
    pending = sorted(((*c, None) for c in _candidates(nodes, position)), key=lambda c: (c[1], c[0]))
    heads: dict[int, tuple] = {}  # period -> how the blocks of the first loop of that period start
    while pending:
        start_pos, period, count, phase = pending.pop(0)
        # after a step that differs, the block after it too (blocks starting inside it may prove, rotated)
        last = start_pos + (period if phase is not None else 0)
        if phase is None:  # a run of the period of a loop rolled already (after a step of another length) starts alike
            phase = heads.get(period)
        shortest, best, sliced_only = count, None, False
        # where a block starts: the longest loop, then the one carrying least (a loop after other steps also
        # proves with its blocks starting inside the step before, carrying that step's q_t to the next), then
        # the one in phase with the run before (after a step that differs, blocks starting inside that step roll up
        # as many steps rotated, the step's head at the end of each block), then the earliest
        for s in range(max(0, start_pos - period + 1), last + 1):
            steps = free(s, count if s <= start_pos else count - 1, period)
            if steps < 2:
                continue
            loop = _Loop(nodes, position, s, period, steps)
            proven = loop.verify()
            while not proven and loop.bad is not None and 2 <= loop.bad < loop.T:
                loop = _Loop(nodes, position, s, period, loop.bad)  # the steps before the first that differs
                proven = loop.verify()
            if proven and len(loop.slices) == loop.L:
                # steps that only slice (a, e = gates[..., 0], gates[..., 1]) compute nothing to roll up: their
                # slices are the inputs of the loop that reads them
                best, shortest, sliced_only = None, loop.T, True
                break
            if proven and (best is None or _rank(loop, phase) < _rank(best, phase)):
                best = loop
        if best is not None:
            # a loop that carries nothing (a map, such as a loop over heads inside the loop over time) waits:
            # a loop around it that carries a state is rolled up first
            (loops if best.carries else maps).append(best)
            heads.setdefault(period, _head(nodes, best.s, period))
            shortest = best.T
        elif not sliced_only:
            shortest = 1
        if shortest < count and count - shortest >= 2:  # what follows a step that differs may be a loop again
            pending.append((start_pos + shortest * period, period, count - shortest,
                            _head(nodes, best.s, period) if best is not None else None))
            pending.sort(key=lambda c: (c[1], c[0]))
    for loop in maps:
        if free(loop.s, loop.T, loop.L) == loop.T:
            loops.append(loop)
    for node in nodes:
        loop = _one_step(nodes, position, node, loops)
        if loop is not None and all(loop.end <= other.s or other.end <= loop.s for other in loops):
            loops.append(loop)
    loops.sort(key=lambda loop: loop.s)
    for i, loop in enumerate(loops):
        loop.index = i
    if only is not None:
        loops = [loop for loop in loops if loop.index in only]
    if not loops:
        return None
    return RolledGraph(*_rebuild(gm, loops))


def _hoist_invariants(graph: fx.Graph) -> bool:
    """Move before the loops what several steps share and compute from values before the loops alone.

    Once common subexpressions are merged, ``1 - self.decay`` written in every step is computed in
    the first step only and read by all of them. A node is such a shared invariant when it depends on
    no per-step slice (nor on anything impure) and two or more nodes of the steps read it, directly
    or through other invariants (``self.eta[:, None, None]`` merged, each step's ``· 2`` of it not); it
    moves, with the invariants it reads, right after the graph's inputs; returns whether any moved. Exact: a
    pure call computes the same value earlier when nothing is written in between and in the same modes, so only
    nodes before the graph's first write (an in-place op left, an item assignment) or mode switch (no_grad,
    enable_grad, autocast) move.
    """
    # an edge shows neither what a write into a tensor (in place, item assignment) changes nor the grad mode or
    # autocast a node runs under: a node after the first write or mode switch stays where it is (moved before
    # it, it could read the value before the write, or get a gradient no_grad denied it)
    position = {node: i for i, node in enumerate(graph.nodes)}
    first_write = min((position[n] for n in graph.nodes
                       if mutates(n) or n.op in _TENSOR_OPS and n.is_impure()), default=len(position))
    step: dict[fx.Node, int] = {}  # the latest time index a node reads (-1: none, an invariant)
    impure: set[fx.Node] = set()
    for node in graph.nodes:
        sliced = _time_slice(node) if node.op in _TENSOR_OPS else None
        # a slice's step is its index (not that of the tensor it slices: a second loop reads x[:, t] of the
        # stacked outputs of a first one, which every step of the first wrote)
        step[node] = sliced[2] if sliced else max([step[i] for i in node.all_input_nodes] + [-1])
        if node.op in _TENSOR_OPS and not _pure(node) or any(i in impure for i in node.all_input_nodes):
            impure.add(node)
    # the nodes of the steps that read a node, through invariants (nodes, not time indices: at two steps, the
    # second step's (1 − a)·M reads M of step 0 and no slice of its own, and has step 0's index)
    read_by: dict[fx.Node, set[fx.Node]] = {}
    for node in reversed(graph.nodes):
        read_by[node] = set().union(*({u} if step[u] >= 0 else read_by[u] for u in node.users))
    shared = [n for n in graph.nodes
              if n.op in _TENSOR_OPS and step[n] < 0 and n not in impure
              and isinstance(_value(n), (torch.Tensor, torch.SymFloat))  # a scan's invariants (see _scan_operand)
              and len(read_by[n]) >= 2 and position[n] < first_write]
    hoist: set[fx.Node] = set()
    pending = list(shared)
    while pending:
        node = pending.pop()
        if node not in hoist and node.op != "placeholder":
            hoist.add(node)
            pending.extend(node.all_input_nodes)
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    if not hoist or not inputs:
        return False
    anchor = inputs[-1]
    for node in [n for n in graph.nodes if n in hoist]:  # graph order: each after what it reads
        anchor.append(node)
        anchor = node
    return True


_ADDS = (operator.add, operator.iadd, torch.add, torch.ops.aten.add.Tensor)


def _peeled_first_steps(graph: fx.Graph) -> bool:
    """``S = u(x[:, 0]); for t in 1..: S = S + u(x[:, t])`` (the first step written before the loop, from no state):
    the first state becomes ``zeros + u(x[:, 0])``, so the first step is one like the others and the loop rolls up
    from it, with a zero initial state. Exact: 0 + x is x. Returns whether any changed."""
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    changed = False
    for node in list(graph.nodes):
        if node.op not in _TENSOR_OPS or node.target not in _ADDS or len(node.args) != 2 or node.kwargs:
            continue
        for first, term in (node.args, node.args[::-1]):
            value = _value(first) if isinstance(first, fx.Node) else None
            if not isinstance(value, torch.Tensor) or not isinstance(term, fx.Node) or first is term \
                    or not all(is_concrete_int(s) for s in value.shape) or not _one_step_earlier(first, term):
                continue
            anchor = inputs[-1] if inputs else next(iter(graph.nodes))
            with graph.inserting_after(anchor):
                zeros = graph.call_function(torch.zeros, (tuple(int(s) for s in value.shape),),
                                            {"dtype": value.dtype, "device": value.device})
            with graph.inserting_after(first):
                started = graph.call_function(operator.add, (zeros, first))
            first.replace_all_uses_with(started, delete_user_cb=lambda user: user is not started)
            zeros.meta["example_value"] = torch.zeros_like(value)
            started.meta["example_value"] = zeros.meta["example_value"] + value
            changed = True
            break
    return changed


_CATS = (torch.cat, torch.concat, torch.concatenate, torch.ops.aten.cat.default)


def _cats_joined(graph: fx.Graph) -> bool:
    """``out = cat([out, y_t], dim)`` each step (outputs gathered by growing a tensor): one ``cat`` of every y_t,
    as the loop's stacked outputs are read; a part empty along the dim (``out = torch.empty(B, 0, D)`` to start
    from) left out. Exact: the same elements in the same order. Returns whether any changed."""
    changed = False
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _CATS or not node.args \
                or not isinstance(node.args[0], (list, tuple)) or set(node.kwargs) - {"dim"}:
            continue
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        parts, joined = [], []
        for part in node.args[0]:
            inner_dim = (part.args[1] if len(part.args) > 1 else part.kwargs.get("dim", 0)) \
                if isinstance(part, fx.Node) and part.target in _CATS and part.args else None
            if inner_dim is not None and len(part.users) == 1 and not set(part.kwargs) - {"dim"} \
                    and isinstance(part.args[0], (list, tuple)) \
                    and _same_dim(inner_dim, dim, _value(part)):
                parts.extend(part.args[0])
                joined.append(part)
            else:
                parts.append(part)
        out = _value(node)
        empty = [p for p in parts if isinstance(p, fx.Node) and isinstance(_value(p), torch.Tensor)
                 and isinstance(out, torch.Tensor) and _value(p).dim() == out.dim() and _value(p).dtype == out.dtype
                 and _is_int(dim) and _value(p).shape[dim] == 0]
        rest = [p for p in parts if p not in empty]
        if empty and (not rest or not all(isinstance(p, fx.Node) and getattr(_value(p), "dtype", None) == out.dtype
                                          for p in rest)):
            empty, rest = [], parts  # (all empty: the empty result; or the empty part sets the result's dtype)
        parts = rest
        if joined or empty:
            node.args = (parts, *node.args[1:])
            for part in joined:
                graph.erase_node(part)
            changed = True
    return changed


_UNSQUEEZES = ("unsqueeze", torch.unsqueeze, torch.ops.aten.unsqueeze.default)


def _cats_of_unsqueezed(graph: fx.Graph) -> bool:
    """``torch.cat([y.unsqueeze(d) for y in ys], d)`` (each y unsqueezed after the loop, read by the cat alone):
    ``torch.stack(ys, d)``, which a loop's outputs are read as. Exact: the same elements in the same order.
    Returns whether any changed."""
    changed = False
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _CATS or not node.args \
                or not isinstance(node.args[0], (list, tuple)) or len(node.args[0]) < 2 or set(node.kwargs) - {"dim"}:
            continue
        dim, out = _stack_dim(node), _value(node)
        items = list(node.args[0])
        if not isinstance(out, torch.Tensor) or not _is_int(dim) or not all(
                isinstance(y, fx.Node) and y.target in _UNSQUEEZES and len(y.users) == 1 and not y.kwargs
                and len(y.args) == 2 and _is_int(y.args[1]) and isinstance(_value(y), torch.Tensor)
                and _value(y).shape[dim] == 1 and y.args[1] % out.dim() == dim % out.dim() for y in items):
            continue
        with graph.inserting_before(node):
            stacked = graph.call_function(torch.stack, ([y.args[0] for y in items], dim % out.dim()))
        stacked.meta.update(node.meta)
        node.replace_all_uses_with(stacked)
        graph.erase_node(node)
        for y in items:
            graph.erase_node(y)
        changed = True
    return changed


def _outputs_returned_apart(graph: fx.Graph) -> Callable[[], None] | None:
    """Per-step outputs returned as they are (``return ys``, a list of a loop's reads): a run of two or more
    returned tensors of one shape and dtype, each computed in the graph, is returned as ``stack(ys).select(0, t)``,
    so a loop's steps are read by a stack as where the code stacks them. Exact: a stack's slice is its item.
    Returns what undoes it (the rolled graph is a copy: the unrolled one is left returning its tensors as they
    are), or None where nothing changed."""
    (output,) = graph.find_nodes(op="output")
    returned = output.args[0]
    if not isinstance(returned, (list, tuple)):
        return None

    inputs = {_storage_of(n) for n in graph.find_nodes(op="placeholder")} - {None}

    def same(a, b):  # (a view of an input is returned as one: a stack's slice is none)
        va, vb = _value(a), _value(b)
        return isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.dtype == vb.dtype \
            and va.shape == vb.shape and a is not b and not {_storage_of(a), _storage_of(b)} & inputs

    runs, start = [], 0
    for i in range(1, len(returned) + 1):
        if i == len(returned) or not (all(isinstance(x, fx.Node) and x.op in ("call_function", "call_method")
                                          for x in returned[i - 1:i + 1]) and same(returned[i - 1], returned[i])):
            if i - start >= 2 and len(set(returned[start:i])) == i - start:
                runs.append((start, i))
            start = i
    if not runs:
        return None
    new, added = list(returned), []
    for start, end in runs:
        items = list(returned[start:end])
        with graph.inserting_before(output):
            stack = graph.call_function(torch.stack, (items, 0))
        stack.meta["example_value"] = torch.stack([_value(y) for y in items])
        added.append(stack)
        for t in range(len(items)):
            with graph.inserting_before(output):
                new[start + t] = graph.call_function(torch.select, (stack, 0, t))
            new[start + t].meta["example_value"] = _value(items[t])
            added.append(new[start + t])
    output.args = (type(returned)(new),)

    def undo():
        output.args = (returned,)
        for node in reversed(added):
            graph.erase_node(node)
    return undo


def _storage_of(node: fx.Node) -> StorageWeakRef | None:
    value = _value(node)
    try:
        return StorageWeakRef(value.untyped_storage()) if isinstance(value, torch.Tensor) else None
    except Exception:  # (a tensor subclass without a storage)
        return None


def _outputs_read_through_their_stack(graph: fx.Graph) -> bool:
    """Per-step outputs stacked and also read after the stack otherwise (``torch.stack(ys, 1)``, then ``sum(ys)``,
    ``torch.cat(ys, -1)``, ``ys[-1]``): those reads read the stack's slice instead, ``stack(ys, d).select(d, t)``,
    so the loop's steps are read by the stack alone. Exact: a stack's slice is its item. Returns whether any
    changed."""
    changed = False
    position = {n: i for i, n in enumerate(graph.nodes)}
    for stack in list(graph.nodes):
        if stack.op != "call_function" or stack.target not in _STACKS or not stack.args \
                or not isinstance(stack.args[0], (list, tuple)) or set(stack.kwargs) - {"dim"} \
                or not all(isinstance(y, fx.Node) for y in stack.args[0]) \
                or len(set(stack.args[0])) != len(stack.args[0]) or not isinstance(_value(stack), torch.Tensor):
            continue
        items, dim = list(stack.args[0]), _stack_dim(stack) % _value(stack).dim()
        if any(written_in_place(y) is not None for y in items):
            continue  # (a write into an item after the stack is not seen by the stack's slice)
        later = [(i, u) for i, y in enumerate(items) for u in y.users
                 if u is not stack and position[u] > position[stack]]
        if not later:
            continue
        anchor = stack
        for i, user in later:
            with graph.inserting_after(anchor):
                piece = graph.call_function(torch.select, (stack, dim, i))
            piece.meta["example_value"] = _value(stack).select(dim, i)
            user.replace_input_with(items[i], piece)
            anchor = piece
        position = {n: k for k, n in enumerate(graph.nodes)}
        changed = True
    return changed


def _same_dim(a: Any, b: Any, value: Any) -> bool:
    """Whether dims ``a`` and ``b`` of a tensor like ``value`` are one dim."""
    if not (_is_int(a) and _is_int(b) and isinstance(value, torch.Tensor)):
        return False
    return a % value.dim() == b % value.dim()


def _one_step_earlier(a: Any, b: Any, depth: int = 6) -> bool:
    """Whether ``a`` computes from time index t what ``b`` computes from t + 1 (the same calls on per-step slices
    one index earlier, the same other inputs), reading at least one such slice."""
    if not isinstance(a, fx.Node) or not isinstance(b, fx.Node) or a is b or depth == 0:
        return False
    if a.op not in _TENSOR_OPS or a.op != b.op or a.target != b.target or a.kwargs != b.kwargs \
            or len(a.args) != len(b.args):
        return False
    reads = {(x, dim, index + 1, repr(rest)) for x, dim, index, rest in _time_slices(a)}
    if any((x, dim, index, repr(rest)) in reads for x, dim, index, rest in _time_slices(b)):
        return True
    shifted = False
    for x, y in zip(a.args, b.args):
        if isinstance(x, fx.Node) and isinstance(y, fx.Node) and x is not y:
            if not _one_step_earlier(x, y, depth - 1):
                return False
            shifted = True
        elif x is not y and (isinstance(x, (fx.Node, torch.Tensor)) or isinstance(y, (fx.Node, torch.Tensor))
                             or x != y):
            return False
    return shifted


# ---------------------------------------------------------------- per-step slices

_SELECTS = ("select", torch.select, torch.ops.aten.select.int)
_NARROWS = ("narrow", torch.narrow, torch.ops.aten.narrow.default)


def _time_slice(node: fx.Node) -> tuple[fx.Node, int, int, Any] | None:
    """The first of :func:`_time_slices`, or None."""
    readings = _time_slices(node)
    return readings[0] if readings else None


def _time_slices(node: fx.Node) -> list[tuple[fx.Node, int, int, Any]]:
    """``(x, dim, index, rest)`` for each way ``node`` may read one time index of a tensor x from before the loop.

    ``node`` is ``x.select(dim, index)`` then ``rest`` applied to it: None (nothing),
    ``("index", i)`` (the other elements of ``x[..., t, None, :]``), or ``("keep",)``
    (``x.narrow(dim, t, 1)``, ``x[:, t:t + 1]``: the size-1 time dim stays).
    All spellings meet in these three: ``x[:, t]``, ``x[:, t, None, None]``, ``x[..., t]``,
    ``x.select(1, t)``, ``torch.select``, ``narrow``, and ATen's ``select``/``slice``/``narrow``.
    An index with several integers (``alpha[:, t, h]`` in a loop over heads around the loop over time) is
    one reading per integer: which one is the time is what the blocks of a loop tell (it advances by one).
    """
    target = node.target if node.op in _TENSOR_OPS else None
    if node.kwargs or not node.args or not isinstance(node.args[0], fx.Node) \
            or not isinstance(_value(node.args[0]), torch.Tensor):
        return []
    x, rank = node.args[0], _value(node.args[0]).dim()
    found = None
    if target is operator.getitem:
        return [r for r in _getitem_slices(x, rank, node.args[1]) if r is not None]
    if target in _SELECTS and len(node.args) == 3 and _is_int(node.args[1]) and _is_int(node.args[2]):
        found = _normalise(x, node.args[1], node.args[2], None)
    elif target in _NARROWS and len(node.args) == 4 and all(_is_int(a) for a in node.args[1:]) \
            and node.args[3] == 1:
        found = _normalise(x, node.args[1], node.args[2], ("keep",))
    elif target is torch.ops.aten.slice.Tensor and len(node.args) == 4 and all(_is_int(a) for a in node.args[1:]):
        _, dim, start, end = node.args
        if end == start + 1 and start >= 0:
            found = _normalise(x, dim, start, ("keep",))
    return [found] if found is not None else []


def _getitem_slices(x: fx.Node, rank: int, index: Any) -> list[tuple[fx.Node, int, int, Any] | None]:
    index = index if isinstance(index, tuple) else (index,)
    if not all(e is None or e is Ellipsis or _is_int(e) or isinstance(e, slice) for e in index):
        return []  # tensor (advanced) indexing
    if any(isinstance(b, fx.Node) for e in index if isinstance(e, slice) for b in (e.start, e.stop, e.step)):
        return []  # a bound read at run time (pos[l, :N] under dynamic=True): a graph value the step would reach into
    if sum(e is Ellipsis for e in index) > 1:
        return []
    consumed = sum(1 for e in index if e is not None and e is not Ellipsis)
    ellipsis_span = rank - consumed
    ints = [i for i, e in enumerate(index) if _is_int(e)]
    dims, d = [], 0  # the dim of x each element indexes (None for None/Ellipsis)
    for e in index:
        dims.append(d if e is not None and e is not Ellipsis else None)
        d += ellipsis_span if e is Ellipsis else (0 if e is None else 1)
    readings = []
    for i in ints:  # the other integers index the selected tensor, whose dims after the time dim move up one
        rest = index[:i] + index[i + 1:]
        plain = all(e == slice(None) or e is Ellipsis for e in rest)
        readings.append(_normalise(x, dims[i], index[i], None if plain else ("index", rest)))
    steps = [i for i, e in enumerate(index) if isinstance(e, slice) and e != slice(None)]
    if not ints and len(steps) == 1 and all(e == slice(None) or e is Ellipsis or e is None
                                            for j, e in enumerate(index) if j != steps[0]):
        sl = index[steps[0]]
        if _is_int(sl.start) and sl.start >= 0 and sl.stop == sl.start + 1 and sl.step in (None, 1):
            # x[:, t:t + 1, None] is x.select(1, t)[:, None, None]: the kept time dim a None in its place
            rest = ("keep",) if None not in index else ("index", index[:steps[0]] + (None,) + index[steps[0] + 1:])
            readings.append(_normalise(x, dims[steps[0]], sl.start, rest))
    return readings


def _normalise(x: fx.Node, dim: int, index: int, rest: Any) -> tuple[fx.Node, int, int, Any] | None:
    value = _value(x)
    if not isinstance(value, torch.Tensor) or not -value.dim() <= dim < value.dim():
        return None
    dim %= value.dim()
    size = value.shape[dim]  # symbolic under dynamic shapes: the index must be in range for every size
    if is_concrete_int(size) and -int(size) <= index < 0:  # a Python loop fixes T (also under dynamic=True)
        index += int(size)
    if index < 0 or not statically_known_true(index < size):
        return None
    return x, dim, index, rest


def _value(node: fx.Node) -> Any:
    return node.meta.get("example_value", node.meta.get("val"))


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _head(nodes: list[fx.Node], s: int, period: int) -> tuple:
    """What a block starting at ``s`` starts with: its first few ops (the step's first statement), with the inputs of
    the graph they read (``k[:, t]`` and ``q[:, t]`` are two heads)."""
    return tuple((n.op, n.target, tuple(a for a in n.all_input_nodes if a.op in ("placeholder", "get_attr")))
                 for n in nodes[s:s + min(3, period)])


def _rank(loop: "_Loop", head: tuple | None) -> tuple:
    """How good an alignment of a run's blocks is (less is better): more steps, fewer carries, its blocks starting
    with ``head`` (as the run before a step that differs did: step lengths may differ, so not by position)."""
    return -loop.T, len(loop.carries), head is not None and _head(loop.nodes, loop.s, loop.L) != head


def _candidates(nodes: list[fx.Node], position: dict[fx.Node, int]) -> list[tuple[int, int, int]]:
    """``(position of the first slice, period, steps)`` of runs of slices ``x[.., t0 + t, ..]``.

    A loop over T steps slices each per-step input once per step, at the same place in every
    copy: consecutive indices at a constant distance (the period) in the node list.
    """
    index_at: dict[tuple, dict[int, int]] = {}  # (x, dim, rest) -> position -> time index
    for n in nodes:
        for x, dim, index, rest in _time_slices(n):
            index_at.setdefault((x, dim, repr(rest)), {})[position[n]] = index
    runs = []
    for reads in index_at.values():  # the same slice may be read several times per step
        by_index: dict[int, list[int]] = {}
        for p, i in reads.items():
            by_index.setdefault(i, []).append(p)
        # how far the index moves per step: one, or as the reads go (reversed(range(T)), range(0, T, 2))
        indices = [i for _, i in sorted(reads.items())]
        steps = {1} | {b - a for a, b in zip(indices, indices[1:]) if a != b and abs(b - a) <= 8}
        for p0, i0 in reads.items():
            for step in steps:
                for p1 in by_index.get(i0 + step, []):
                    period = p1 - p0
                    if period <= 0 or reads.get(p0 - period) == i0 - step:
                        continue  # not forward in the graph, or not the first step of its run
                    count = 2
                    while reads.get(p0 + count * period) == i0 + count * step:
                        count += 1
                    runs.append((p0, period, count))
    return sorted(set(runs))


# ---------------------------------------------------------------- proving a run is one loop

@dataclass
class _Loop:
    """T blocks of L nodes from position s of ``nodes``; :meth:`verify` proves they are one loop."""

    nodes: list[fx.Node]
    position: dict[fx.Node, int]
    s: int  # position of block 0's first node
    L: int  # nodes per block
    T: int  # blocks
    # filled by verify():
    args: dict[tuple[int, int], tuple[str, Any]] = field(default_factory=dict)  # (offset, leaf) -> kind
    carries: dict[int, fx.Node] = field(default_factory=dict)  # offset of the next value -> init
    slices: dict[int, tuple[fx.Node, int, int, Any]] = field(default_factory=dict)  # offset -> (x, dim, start, rest)
    # offset -> how far its index moves per step where not 1 (−1: a loop over reversed(range(T)); 2: every other)
    steps: dict[int, int] = field(default_factory=dict)
    flipped: set = field(default_factory=set)  # stacks of the steps' values last step first (``stack(ys[::-1])``)
    # (offset, leaf) of a number that differs between steps where a floating tensor is multiplied by it, divided
    # by it, added to it or raised to it (η_t = 0.5 / (t + 1) of a Python schedule, x * t, γ ** t): read per step,
    # as the scan's inputs are
    literals: set = field(default_factory=set)
    stacks: dict[fx.Node, int] = field(default_factory=dict)  # torch.stack after the loop -> offset
    finals: dict[fx.Node, int] = field(default_factory=dict)  # last block's carry read after -> offset
    bad: int | None = None  # after a failed verify(): the first block that differs, if one was found
    index: int = 0  # among the loops roll_loops found, in graph order
    flat0: dict[int, tuple[list, Any]] = field(default_factory=dict)  # offset -> block 0's node flattened

    @property
    def end(self) -> int:
        return self.s + self.L * self.T

    def at(self, t: int, o: int) -> fx.Node:
        return self.nodes[self.s + t * self.L + o]

    def block(self, node: Any) -> tuple[int, int] | None:
        """(block, offset) of a node in the loop, None outside."""
        p = self.position.get(node) if isinstance(node, fx.Node) else None
        if p is None or not self.s <= p < self.end:
            return None
        return divmod(p - self.s, self.L)

    def verify(self) -> bool:
        """Whether the T blocks are one loop; if not, ``bad`` may name the first block that differs."""
        self.bad = None
        self.args, self.carries, self.slices, self.stacks, self.finals, self.steps = {}, {}, {}, {}, {}, {}
        self.flipped, self.literals = set(), set()
        if self.L < 1 or self.T < 2 or self.end > len(self.nodes):
            return False
        # blocks 0 and 1 first: a wrong block boundary fails here, cheaply
        return all(self._same_node(o, ts) for ts in ((1,), range(2, self.T)) for o in range(self.L)) \
            and self._outputs()

    def _same_node(self, o: int, ts) -> bool:
        n0 = self.at(0, o)
        if n0.op not in _TENSOR_OPS or not _pure(n0):
            return False
        if ts == (1,):
            self._find_time_slice(o)
        for t in ts:
            if not self._same_as_block0(o, n0, t):
                self.bad = t
                return False
        return True

    def _same_as_block0(self, o: int, n0: fx.Node, t: int) -> bool:
        if o in self.slices:
            x, dim, start, rest = self.slices[o]
            return (x, dim, start + self.steps.get(o, 1) * t, rest) in _time_slices(self.at(t, o))
        nt = self.at(t, o)
        if nt.op != n0.op or nt.target != n0.target:
            return False
        leaves0, spec0 = self._flat0(o, n0)
        leaves, spec = _flatten(nt)
        return spec == spec0 and all(self._same_leaf(o, j, t, a0, a) for j, (a0, a) in enumerate(zip(leaves0, leaves)))

    def _flat0(self, o: int, n0: fx.Node) -> tuple[list, Any]:
        """:func:`_flatten` of node o of block 0, which every other block is compared with."""
        if o not in self.flat0:
            self.flat0[o] = _flatten(n0)
        return self.flat0[o]

    def _find_time_slice(self, o: int) -> None:
        """Record node o as a per-step slice if its index moves by the same step per block, one first (else it
        is ordinary): forward, backward (``reversed(range(T))``) or strided, within the tensor for every size."""
        later = _time_slices(self.at(1, o))
        for s0 in _time_slices(self.at(0, o)):
            x, dim, start, rest = s0
            steps = sorted({i - start for y, d, i, r in later if (y, d, r) == (x, dim, rest) and i != start},
                           key=lambda step: (step != 1, abs(step)))
            for step in steps if self.block(x) is None else ():
                last = start + step * (self.T - 1)
                if last >= 0 and statically_known_true(max(start, last) < _value(x).shape[dim]):
                    self.slices[o] = s0
                    if step != 1:
                        self.steps[o] = step
                    return

    def _same_leaf(self, o: int, j: int, t: int, a0: Any, a: Any) -> bool:
        if not isinstance(a0, fx.Node):
            if isinstance(a, fx.Node) or type(a) is not type(a0):
                return False
            if a == a0 and (o, j) not in self.literals:
                return True
            if type(a0) in (int, float) and _number_of_a_step(self.at(0, o), j) \
                    and (self.at(0, o).target not in _POWERS or self._new_at_every_step(o, j, t)):
                self.literals.add((o, j))
                return True
            return False
        if not isinstance(a, fx.Node):
            return False
        kind = self.args.get((o, j))
        if kind is None:  # classify from block 1 (t == 1 is always checked first)
            kind = self._classify(a0, a)
            if kind is None:
                return False
            self.args[(o, j)] = kind
        what, ref = kind
        if what == "internal":
            return self.block(a) == (t, ref)
        if what == "invariant":
            return a is a0
        return self.block(a) == (t - 1, ref)  # carry

    def _new_at_every_step(self, o: int, j: int, t: int) -> bool:
        """Whether a power's number differs from the step before's, as it has from step 1 on (γ ** (t + 1)). An
        exponent that changes once (p = 2 for some steps, then 3) ends the loop there instead: each run of one
        exponent is a loop of its own, which a memory op takes (it takes no p per step)."""
        before = _flatten(self.at(t - 1, o))[0][j]
        return _flatten(self.at(t, o))[0][j] != before and (t == 1 or (o, j) in self.literals)

    def _classify(self, a0: fx.Node, a1: fx.Node) -> tuple[str, Any] | None:
        b0, b1 = self.block(a0), self.block(a1)
        if b0 is not None:
            return ("internal", b0[1]) if b0[0] == 0 and b1 == (1, b0[1]) else None
        if a1 is a0:
            return "invariant", a0
        if b1 is None or b1[0] != 0:
            return None
        init = self.carries.setdefault(b1[1], a0)
        if init is not a0 or not _same_meta(a0, a1):
            return None
        return "carry", b1[1]

    def _outputs(self) -> bool:
        """After the loop: only the last block's carries and stacks of one node per block."""
        for t in range(self.T):
            for o in range(self.L):
                node = self.at(t, o)
                for user in node.users:
                    if self.block(user) is not None:
                        continue
                    if user in self.stacks:
                        continue
                    if self._is_stack_of(user, o):
                        self.stacks[user] = o
                    elif t == self.T - 1 and o in self.carries:
                        self.finals[node] = o
                    else:  # read after the loop: the loop can end at block t at the latest
                        self.bad = t + 1
                        return False
        return True

    def _is_stack_of(self, node: fx.Node, o: int) -> bool:
        """``torch.stack`` of node o of every block in order (or in reverse: ``ys[::-1]`` of a loop backwards in
        time), or ``torch.cat`` of them along a size-1 dim; other tensors from outside the loop may come before and
        after them (``ys = [read(M, q[:, 0])]`` of a first step written before the loop): :func:`_stacked` joins
        the pieces."""
        if node.op != "call_function" or node.target not in _STACKS + _CATS or not node.args:
            return False
        items = node.args[0]
        if not (isinstance(items, (list, tuple)) and set(node.kwargs) <= {"dim"} and len(node.args) <= 2):
            return False
        run = [self.at(t, o) for t in range(self.T)]
        start = _run_start(items, run)
        if start is None and (start := _run_start(items, run[::-1])) is not None:
            self.flipped.add(node)
        if start is None or any(self.block(x) is not None for x in items[:start] + items[start + self.T:]):
            return False
        if node.target in _CATS:
            value = _value(self.at(0, o))
            dim = _stack_dim(node)
            return isinstance(value, torch.Tensor) and -value.dim() <= dim < value.dim() and value.shape[dim] == 1
        return True


_STACKS = (torch.stack, torch.ops.aten.stack.default)


_ARITHMETIC = (operator.mul, operator.truediv, operator.add, operator.sub, torch.mul, torch.div, torch.add, torch.sub,
               "mul", "div", "add", "sub", "__mul__", "__rmul__", "__truediv__", "__add__", "__radd__", "__sub__",
               "__rsub__")
# a state's scaling (its decay written first: 0.9 * M, M / 2, -M), Dynamo's spellings and ATen's
_SCALINGS = (operator.mul, operator.truediv, operator.neg, torch.mul, torch.div, torch.neg, "mul", "div", "neg",
             "__mul__", "__rmul__", "__truediv__", "__neg__", torch.ops.aten.mul.Tensor, torch.ops.aten.div.Tensor,
             torch.ops.aten.neg.default)
# a power whose exponent (γ ** (t + 1) of a discount) or base differs at every step
_POWERS = (operator.pow, torch.pow, "pow", "__pow__", "__rpow__")


def _number_of_a_step(node: fx.Node, j: int) -> bool:
    """Whether leaf ``j`` of ``node`` is a Python number one operand of a product, quotient, sum, difference or
    power whose other operand is a float32 or float64 tensor: there a 0-d tensor of that dtype holding the number
    computes the same values (ATen casts the number to the tensor's dtype; the dtype of the result is the
    tensor's either way)."""
    if node.target not in _ARITHMETIC + _POWERS or node.kwargs or len(node.args) != 2 or j > 1:
        return False
    other = _value(node.args[1 - j]) if isinstance(node.args[1 - j], fx.Node) else None
    return isinstance(other, torch.Tensor) and other.dtype in (torch.float32, torch.float64)


def _literal_values(loop: "_Loop", o: int, j: int) -> list[float]:
    return [_flatten(loop.at(t, o))[0][j] for t in range(loop.T)]


def _literals(loop: "_Loop", part: "_Part") -> list[tuple[int, int]]:
    """The numbers of a step the part reads (see ``_Loop.literals``), one scan input each."""
    return sorted((o, j) for o, j in loop.literals if o in part.offsets)


def _stack_dim(node: fx.Node) -> int:
    return node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)


def _run_start(items, run: list) -> int | None:
    """Where ``run`` lies in ``items`` as a contiguous run, or None."""
    items = list(items)
    for i in range(len(items) - len(run) + 1):
        if items[i:i + len(run)] == run:
            return i
    return None


def _flatten(node: fx.Node) -> tuple[list, Any]:
    """The leaves of ``(node.args, node.kwargs)`` in order, and their nesting (lists, tuples, dicts).

    Every node of every block is flattened once per proof, so this walks only the containers
    fx arguments are made of (torch's pytree, general, costs several times as much)."""
    leaves: list = []

    def walk(value: Any) -> Any:
        if type(value) in _SEQUENCES:
            return type(value), tuple(walk(v) for v in value)
        if type(value) in _MAPPINGS:
            return dict, tuple((k, walk(v)) for k, v in value.items())
        leaves.append(value)
        return None

    return leaves, walk((node.args, node.kwargs))


def _unflatten(spec: Any, leaves) -> Any:
    """The arguments :func:`_flatten` gave ``spec`` of, with the next of ``leaves`` at each leaf."""
    if spec is None:
        return next(leaves)
    kind, items = spec
    if kind is dict:
        return {k: _unflatten(v, leaves) for k, v in items}
    return (list if kind is immutable_list else kind)(_unflatten(v, leaves) for v in items)


_SEQUENCES = (tuple, list, immutable_list)
_MAPPINGS = (dict, immutable_dict)


def _pure(node: fx.Node) -> bool:
    """Nothing in place and nothing random (Dynamo's calls are judged by their names)."""
    if isinstance(node.target, torch._ops.OpOverload):  # an ATen graph (torch.export's)
        return functional_op(node.target)
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    if "dropout" in name.lower().split("_") and (_training_arg(node) is False or _dropout_p(node) == 0):
        return not mutates(node)  # F.dropout(x, p, training=False), nn.Dropout in eval(), or p = 0: x itself
    return not mutates(node) and _RANDOM.isdisjoint(name.lower().split("_"))


def _training_arg(node: fx.Node) -> Any:
    """The ``training`` argument of a dropout call (F.dropout(input, p, training, inplace)), None if not given."""
    return node.kwargs.get("training", node.args[2] if len(node.args) > 2 else None)


def _dropout_p(node: fx.Node) -> Any:
    """The ``p`` argument of a dropout call (F.dropout(input, p=0.5, ...))."""
    return node.kwargs.get("p", node.args[1] if len(node.args) > 1 else 0.5)


def _same_meta(a: fx.Node, b: fx.Node) -> bool:
    va, vb = _value(a), _value(b)
    return isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) \
        and va.shape == vb.shape and va.dtype == vb.dtype and va.device == vb.device


def _one_step(nodes: list[fx.Node], position: dict[fx.Node, int], stack: fx.Node,
              rolled: Sequence[_Loop] = ()) -> _Loop | None:
    """The loop of one step whose output ``stack`` collects, if it is one (else None).

    ``for t in range(T)`` at T = 1 leaves one copy of the step: no second copy tells the loop's
    extent, its carries or its per-step inputs. Read instead from what a loop leaves around it:
    ``stack`` is ``torch.stack([y])`` (or ``torch.cat`` along a size-1 dim); the step runs from
    the first per-step slice ``x[.., 0, ..]`` of a size-1 time dim that y reads to just before
    ``stack``; what the step computes and is read after it is a carry, whose init is the one
    tensor from before the step of the same shape, dtype and device that the step reads (none,
    or several, and it is not rolled). For one step any such reading computes what the graph
    computes; it decides only whether the memory passes recognise the step.
    """
    if stack.op != "call_function" or stack.target not in _STACKS + _CATS or not stack.args \
            or not isinstance(stack.args[0], (list, tuple)) or len(stack.args[0]) != 1:
        return None
    first, todo, seen = None, [stack.args[0][0]], set()
    while todo:  # y's ancestors back to the per-step slices
        node = todo.pop()
        if not isinstance(node, fx.Node) or node in seen or node.op not in _TENSOR_OPS:
            continue
        seen.add(node)
        sliced = _one_step_slice(node)
        if sliced is not None and not _computed_in_a_step(sliced[0]):
            first = node if first is None or position[node] < position[first] else first
        else:
            todo.extend(node.all_input_nodes)
    if first is None:
        return None
    first = _with_its_state_scalings(nodes, position, first, stack, rolled)
    loop = _Loop(nodes, position, position[first], position[stack] - position[first], 1)
    if not loop._is_stack_of(stack, position[stack.args[0][0]] - loop.s):
        return None
    reads: dict[fx.Node, list[tuple[int, int]]] = {}  # tensor from before the step -> where the step reads it
    for o in range(loop.L):
        node = loop.at(0, o)
        if node.op not in _TENSOR_OPS or not _pure(node):
            return None
        sliced = _one_step_slice(node)
        if sliced is not None and loop.block(sliced[0]) is None:
            loop.slices[o] = sliced
            continue
        for j, leaf in enumerate(_flatten(node)[0]):
            if isinstance(leaf, fx.Node):
                inside = loop.block(leaf)
                loop.args[(o, j)] = ("internal", inside[1]) if inside is not None else ("invariant", leaf)
                if inside is None:
                    reads.setdefault(leaf, []).append((o, j))
    for o in range(loop.L):
        node = loop.at(0, o)
        after = [user for user in node.users if loop.block(user) is None]
        # (a stack of this one value: one of several values, two states returned side by side, is no step's
        # output stacked, at one step no more than at many)
        loop.stacks.update({user: o for user in after if loop._is_stack_of(user, o) and len(user.args[0]) == 1})
        if all(user in loop.stacks for user in after):
            continue
        inits = [a for a in reads if _same_meta(a, node)]  # node is read after the step: a carry's next value
        if len(inits) != 1 or inits[0] in loop.carries.values():
            return None
        loop.carries[o], loop.finals[node] = inits[0], o
        loop.args.update({where: ("carry", o) for where in reads[inits[0]]})
    if not loop.carries:  # a state nothing reads after the step (the model returns its outputs alone)
        found = [(init, o) for init in reads for o in _last_values_of(loop, init)]
        if len(found) == 1:
            (init, o), = found
            loop.carries[o] = init
            loop.args.update({where: ("carry", o) for where in reads[init]})
    return loop if loop.carries and loop.slices else None


def _with_its_state_scalings(nodes: list[fx.Node], position: dict[fx.Node, int], first: fx.Node, stack: fx.Node,
                             rolled: Sequence[_Loop]) -> fx.Node:
    """The one step's first node, once the scalings of its state computed before its first slice are moved into it.

    ``M = 0.9 * M + v[:, t, :, None] * k[:, t, None, :]`` computes ``0.9 * M`` before the first slice: left
    there, the step would start from 0.9·M, its decay lost to it, while the normaliser's, written after the
    slice, stays in the step (and z ← a·z + k no longer matches M's decay). A product, quotient or negation
    before ``first`` of a tensor of its own shape, dtype and device (the state's scaling; not ``zeros_like(M)``,
    a second state's start), read only by the step and by no slice, moves to just before ``first``, past pure
    nodes alone and no loop already found.
    Exact: it reads what it read, and is computed before each of its readers."""
    start, end = position[first], position[stack]
    moved = []
    for n in reversed(nodes[:start]):
        if n.op not in _TENSOR_OPS or not _pure(n):
            break  # nothing moves past a write or a mode switch
        if any(loop.s <= position[n] < loop.end for loop in rolled):
            break
        if n.target in _SCALINGS and n.users and all(start <= position.get(u, -1) < end or u in moved
                                                     for u in n.users) \
                and any(_same_meta(n, a) for a in n.all_input_nodes) \
                and not any(_one_step_slice(u) is not None for u in n.users):
            moved.insert(0, n)
    if not moved:
        return first
    for n in moved:
        first.prepend(n)
    nodes[:] = list(first.graph.nodes)
    position.clear()
    position.update({n: i for i, n in enumerate(nodes)})
    if first.graph.owning_module is not None:
        first.graph.owning_module.recompile()
    return moved[0]


def _computed_in_a_step(x: fx.Node) -> bool:
    """Whether ``x`` is, or is computed from, a slice ``x[.., 0, ..]`` of a size-1 dim (not looking past a stack:
    the outputs of a step before): a slice of it, the ``[..., 0]`` of a read ``M @ q_t[..., None]``, is computed in
    the step, no per-step input of it."""
    todo, seen = [x], set()
    while todo:
        node = todo.pop()
        if not isinstance(node, fx.Node) or node in seen or node.op not in _TENSOR_OPS:
            continue
        seen.add(node)
        if _one_step_slice(node) is not None:
            return True
        if node.target not in _STACKS + _CATS:
            todo.extend(node.all_input_nodes)
    return False


def _last_values_of(loop: _Loop, init: fx.Node) -> list[int]:
    """The steps' nodes (as offsets) that compute a new value of ``init`` (the same shape, dtype and device, computed
    from it) that no further such value is computed from: the state's next value, where nothing after the step reads
    it to tell."""
    derived = {}
    for o in range(loop.L):
        node = loop.at(0, o)
        if any(a is init or a in derived for a in node.all_input_nodes):
            derived[node] = o
    same = {node: o for node, o in derived.items() if _same_meta(init, node)}
    return [o for node, o in same.items()
            if not any(other is not node and _reads(other, node, derived) for other in same)]


def _reads(later: fx.Node, earlier: fx.Node, inside: dict) -> bool:
    """Whether ``later`` is computed from ``earlier`` through the nodes ``inside``."""
    todo, seen = [later], set()
    while todo:
        node = todo.pop()
        for a in node.all_input_nodes:
            if a is earlier:
                return True
            if a in inside and a not in seen:
                seen.add(a)
                todo.append(a)
    return False


def _one_step_slice(node: fx.Node) -> tuple[fx.Node, int, int, Any] | None:
    """``_time_slice(node)`` if it reads index 0 of a size-1 dim: the step of a loop of one."""
    sliced = _time_slice(node)
    if sliced is None or sliced[2] != 0:
        return None
    size = _value(sliced[0]).shape[sliced[1]]
    if not (is_concrete_int(size) and int(size) == 1):
        return None
    return sliced


# ---------------------------------------------------------------- rebuilding the graph

def _rebuild(gm: fx.GraphModule, loops: list[_Loop]) -> tuple[fx.GraphModule, list[int], list[int]]:
    """Copy ``gm``'s graph, emitting one scan in place of each loop (one per part of a split loop); also
    the steps of each scan emitted, in graph order, and its loop's index."""
    graph, env, attrs = fx.Graph(), {}, {}
    starts = {loop.s: loop for loop in loops}
    skip: set[fx.Node] = set()
    stacks: dict[fx.Node, fx.Node] = {}
    steps, indices = [], []
    for p, node in enumerate(gm.graph.nodes):
        if p in starts:
            loop = starts[p]
            parts, mixed = _parts(loop)
            outs = {}
            for part in parts:
                name = f"hecate_loop_body_{len(attrs)}"
                attrs[name] = _body(loop, part)
                outs.update(_emit_scan(graph, env, loop, name, part))
                steps.append(loop.T)
                indices.append(loop.index)
            for o, items in mixed.items():  # per step a stack over the parts: stack the parts' stacked pieces
                combine = loop.at(0, o)
                if combine.target not in _STACKS + _CATS:  # a sum (...) of the parts' values: of their stacks
                    outs[("y", o)] = graph.call_function(combine.target, tuple(
                        outs[("y", loop.block(a)[1])] if isinstance(a, fx.Node) and loop.block(a) is not None
                        else env[a] if isinstance(a, fx.Node) else a for a in combine.args))
                    continue
                rank = _value(loop.at(0, items[0])).dim()
                dim = _stack_dim(combine) % (rank + (combine.target in _STACKS))
                outs[("y", o)] = graph.call_function(
                    torch.stack if combine.target in _STACKS else torch.cat,
                    ([outs[("y", item)] for item in items],), {"dim": dim + 1})
            skip.update(loop.nodes[loop.s:loop.end])
            for stack, o in loop.stacks.items():
                run = [loop.at(t, o) for t in range(loop.T)]
                flipped = stack in loop.flipped
                stacks.setdefault(stack, {})[_run_start(stack.args[0], run[::-1] if flipped else run)] = \
                    (loop.T, outs[("y", o)], flipped)
            env.update({node: outs[("carry", o)] for node, o in loop.finals.items()})
        if node in skip:
            continue
        if node in stacks:
            env[node] = _stacked(graph, env, node, stacks[node])
            continue
        env[node] = graph.node_copy(node, env.__getitem__)
        if node.op in ("get_attr", "call_module"):
            attrs[node.target] = operator.attrgetter(node.target)(gm)
    rolled = fx.GraphModule(attrs, graph, class_name=type(gm).__name__)
    rolled.meta.update(gm.meta)
    return rolled, steps, indices


def _stacked(graph: fx.Graph, env: dict, node: fx.Node, runs: dict[int, tuple[int, fx.Node]]) -> fx.Node:
    """The stack (or cat) ``node`` of the new graph: each run of its items that a loop's steps computed, from
    ``runs`` (first item -> (steps, the scan's output, stacked along dim 0, whether the items are in reverse
    order)), the other items as they are;
    the pieces joined along the stack's dim. Exact: the same elements in the same order."""
    dim = _stack_dim(node) % _value(node).dim()
    items, pieces, i = list(node.args[0]), [], 0
    while i < len(items):
        if i in runs:
            steps, out, flipped = runs[i]
            if flipped:
                out = graph.call_function(torch.flip, (out, (0,)))
            out = graph.call_function(torch.movedim, (out, 0, dim))
            if node.target in _CATS:  # cat of [.., 1, ..] pieces: stack them, then drop the size-1 dim
                out = graph.call_function(torch.squeeze, (out, dim + 1))
            pieces.append(out)
            i += steps
        else:
            j = next((j for j in range(i, len(items)) if j in runs), len(items))
            pieces.append(graph.call_function(node.target, ([env[x] for x in items[i:j]], dim)))
            i = j
    return pieces[0] if len(pieces) == 1 else graph.call_function(torch.cat, (pieces, dim))


@dataclass
class _Part:
    """The offsets of a block one scan holds (in block order), its carries and its stacked outputs."""

    offsets: list[int]
    carries: list[int]
    ys: list[int]


def _parts(loop: _Loop) -> tuple[list[_Part], dict[int, list[int]]]:
    """Loop fission: the block split into parts whose carries never read each other's, or the whole block.

    Carries are grouped by what they read (transitively within the block); each group is a part, with the
    values only it reads and those that read no carry (the step's inputs, copied into every part that needs
    them). A value reading several groups must be read only by a stack after the loop, and be a stack or cat
    of values each reading one group, or a sum, difference, product or quotient of such values of its own
    shape (two memories' reads added: y_t = M_t q_t + W_t k_t) and of tensors from before the loop; it is
    returned as ``{offset: its items' offsets}``, each item a stacked output of its part, and is computed after
    the scans from their outputs (stacked along a new first dim: the same values, right-aligned as before).
    Anything else reading several groups keeps the loop whole.
    """
    carries, ys = _io(loop)
    whole = [_Part(list(range(loop.L)), carries, ys)], {}
    reads: dict[int, set[int]] = {}  # offset -> the carries it reads
    for o in range(loop.L):
        reads[o] = set()
        for j, leaf in enumerate(loop._flat0(o, loop.at(0, o))[0] if o not in loop.slices else ()):
            if isinstance(leaf, fx.Node):
                what, ref = loop.args[(o, j)]
                reads[o] |= reads[ref] if what == "internal" else {ref} if what == "carry" else set()
    group = {c: c for c in carries}

    def find(c: int) -> int:
        while group[c] != c:
            c = group[c]
        return c

    for c in carries:
        for d in reads[c]:
            group[find(d)] = find(c)
    groups = list(dict.fromkeys(find(c) for c in carries))
    if len(groups) < 2:
        return whole
    of = {o: {find(c) for c in reads[o]} for o in range(loop.L)}
    mixed: dict[int, list[int]] = {}
    for o in range(loop.L):
        if len(of[o]) < 2:
            continue
        node = loop.at(0, o)
        items = node.args[0] if node.target in _STACKS + _CATS and node.args else _combined_items(loop, o)
        if (o not in ys or o in carries or not isinstance(items, (list, tuple))
                or any(loop.block(u) is not None for u in node.users)):
            return whole
        offsets = [loop.block(item) for item in items]
        if any(b is None or b[0] != 0 or len(of[b[1]]) > 1 for b in offsets):
            return whole
        mixed[o] = [b[1] for b in offsets]
    parts = []
    for g in groups:
        roots = [c for c in carries if find(c) == g]
        part_ys = [o for o in ys if o not in mixed and (of[o] == {g} or (not of[o] and g == groups[0]))]
        part_ys += [item for items in mixed.values() for item in items
                    if (of[item] == {g} or not of[item] and g == groups[0]) and item not in part_ys]
        needed, todo = set(), roots + part_ys
        while todo:
            o = todo.pop()
            if o in needed:
                continue
            needed.add(o)
            if o not in loop.slices:
                todo += [ref for j, leaf in enumerate(loop._flat0(o, loop.at(0, o))[0]) if isinstance(leaf, fx.Node)
                         for what, ref in [loop.args[(o, j)]] if what == "internal"]
        parts.append(_Part(sorted(needed), roots, sorted(part_ys)))
    return parts, mixed


_COMBINED = tuple(t for t in _ARITHMETIC if callable(t))  # (what the graph can call after the scans)


def _combined_items(loop: _Loop, o: int) -> list[fx.Node] | None:
    """The step's values node ``o`` adds, subtracts, multiplies or divides, where each has the node's shape and
    the rest are numbers the steps share or tensors from before the loop of no more dims (so that, stacked along
    a new first dim, the operation gives the stack of its per-step results); else None."""
    node = loop.at(0, o)
    if node.target not in _COMBINED or node.kwargs or len(node.args) != 2 or any((o, j) in loop.literals
                                                                                   for j in range(2)):
        return None
    shape, items = getattr(_value(node), "shape", None), []
    for a in node.args:
        if isinstance(a, fx.Node) and loop.block(a) is not None:
            if getattr(_value(a), "shape", None) != shape:
                return None
            items.append(a)
        elif isinstance(a, fx.Node) and not (isinstance(_value(a), torch.Tensor) and shape is not None
                                             and _value(a).dim() <= len(shape)):
            return None
    return items or None


def _emit_scan(graph: fx.Graph, env: dict, loop: _Loop, body_name: str, part: _Part) -> dict[tuple[str, int], fx.Node]:
    carries, ys, invariants = part.carries, part.ys, _invariants(loop, part)
    xs = []
    for x, dim, start, step in _sources(loop, part):
        size = _value(x).shape[dim]
        x = env[x]
        if dim != 0:
            x = graph.call_function(torch.movedim, (x, dim, 0))
        first, span = min(start, start + step * (loop.T - 1)), abs(step) * (loop.T - 1) + 1  # the indices read
        if first != 0 or size != span:
            x = graph.call_function(torch.narrow, (x, 0, first, span))
        if abs(step) != 1:
            x = graph.call_function(operator.getitem, (x, slice(None, None, abs(step))))
        if step < 0:  # read from the last index down
            x = graph.call_function(torch.flip, (x, (0,)))
        xs.append(x)
    for o, j in _literals(loop, part):  # the step's number as a [T] tensor of its operand's dtype, on its device
        operand = _value(loop.at(0, o).args[1 - j])  # (made on the CPU, a constant, then moved: a copy traces)
        numbers = graph.call_function(torch.tensor, (_literal_values(loop, o, j),), {"dtype": operand.dtype})
        xs.append(graph.call_method("to", (numbers, operand.device)))
    inits = []
    for o in carries:  # carries that start from one tensor (CSE merged two torch.zeros) start from copies of it:
        init = env[loop.carries[o]]  # tracing the scan keys its inputs by tensor, and would read one carry for both
        inits.append(graph.call_function(torch.clone, (init,)) if init in inits else init)
    scan = graph.call_function(torch.ops.higher_order.scan, (
        graph.get_attr(body_name), inits, xs, [_scan_operand(graph, env[a], _value(a)) for a in invariants]))
    # the user's line a report names for the loop: where the largest state is updated
    updates = sorted(carries, key=lambda o: -getattr(_value(loop.at(0, o)), "dim", lambda: 0)())
    traces = [loop.at(0, o).meta.get("stack_trace") for o in updates]
    if any(traces):
        scan.meta["stack_trace"] = next(t for t in traces if t)
    outs = {}
    for i, key in enumerate([("carry", o) for o in carries] + [("y", o) for o in ys]):
        outs[key] = graph.call_function(operator.getitem, (scan, i))
    return outs


def _sources(loop: _Loop, part: _Part) -> list[tuple[fx.Node, int, int, int]]:
    """The distinct ``(x, dim, start, step)`` the part slices, one scan input each (``k[:, t]`` read at
    every use is one input)."""
    return list(dict.fromkeys(_source(loop, o) for o in part.offsets if o in loop.slices))


def _source(loop: _Loop, o: int) -> tuple[fx.Node, int, int, int]:
    return (*loop.slices[o][:3], loop.steps.get(o, 1))


def _io(loop: _Loop) -> tuple[list[int], list[int]]:
    """Offsets of the carries and of the stacked outputs."""
    return sorted(loop.carries), sorted(set(loop.stacks.values()))


def _invariants(loop: _Loop, part: _Part) -> list[fx.Node]:
    """The tensors the part reads from before the loop, in order of first use: each invariant, or the tensor
    that several of them view (``f[None, :, None]`` and ``f[None, :, None, None]``), which the body then
    views itself. One input, not two: what analyses the body at sample points sees one tensor, as the loop
    did (two inputs would be drawn apart, and one decay read two ways would differ from itself)."""
    return list(dict.fromkeys(_viewed(a, loop, part)[0] for a in _read_invariants(loop, part)))


def _read_invariants(loop: _Loop, part: _Part) -> list[fx.Node]:
    offsets = set(part.offsets)
    return list(dict.fromkeys(ref for (o, _), (what, ref) in loop.args.items() if what == "invariant" and o in offsets))


def _view_chain(node: fx.Node) -> tuple[fx.Node, list[fx.Node]]:
    """(the tensor ``node`` is a view of through views alone, those views in order)."""
    chain = []
    while node.op in _TENSOR_OPS and node.args and isinstance(node.args[0], fx.Node) and aliases(node) \
            and not any(isinstance(a, fx.Node) for a in [*node.args[1:], *node.kwargs.values()]) and not mutates(node):
        chain.append(node)
        node = node.args[0]
    return node, chain[::-1]


def _viewed(invariant: fx.Node, loop: _Loop, part: _Part) -> tuple[fx.Node, list[fx.Node]]:
    """(the loop's input for ``invariant``, the views the body applies to it): the tensor it views when another
    invariant of the part views that tensor too, else itself and none."""
    root, chain = _view_chain(invariant)
    if chain and sum(_view_chain(a)[0] is root for a in _read_invariants(loop, part)) + \
            (root in _read_invariants(loop, part)) >= 2:
        return root, chain
    return invariant, []


def _scan_operand(graph: fx.Graph, node: fx.Node, value: Any) -> fx.Node:
    """An invariant as the scan takes it: tensors and ints as they are, a symbolic float (``d ** -0.5`` of a
    dynamic size) as a 0-d float64 tensor, which scales a tensor in its own dtype as the number did."""
    if isinstance(value, torch.SymFloat):
        return graph.call_function(torch.scalar_tensor, (node,), {"dtype": torch.float64})
    return node


def _body(loop: _Loop, part: _Part) -> fx.GraphModule:
    """The part of block 0 as the scan body: ``(*carries, *x_t, *invariants) -> [*next carries, *y_t]``."""
    carries, ys, invariants = part.carries, part.ys, _invariants(loop, part)
    body = fx.Graph()
    carry_in = {o: body.placeholder(f"carry_{i}") for i, o in enumerate(carries)}
    xs_in = {source: body.placeholder(f"x_{i}") for i, source in enumerate(_sources(loop, part))}
    numbers_in = {leaf: body.placeholder(f"x_{len(xs_in) + i}") for i, leaf in enumerate(_literals(loop, part))}
    invariant_in = {a: body.placeholder(f"invariant_{i}") for i, a in enumerate(invariants)}
    for a in _read_invariants(loop, part):  # an invariant that views one of them: that view, in the body
        root, chain = _viewed(a, loop, part)
        for view in chain:
            invariant_in[view] = body.create_node(view.op, view.target, (invariant_in[view.args[0]], *view.args[1:]),
                                                  dict(view.kwargs))
    env = {}
    for o in sorted(set(loop.slices) & set(part.offsets)):  # x.select(dim, t) is the scan's x_t; then the user's slice
        x, dim, _, rest = loop.slices[o]
        x_t = xs_in[_source(loop, o)]
        if rest is not None and rest[0] == "index":
            x_t = body.call_function(operator.getitem, (x_t, rest[1]))
        elif rest is not None:  # ("keep",): the size-1 time dim stays
            x_t = body.call_function(torch.unsqueeze, (x_t, dim))
        env[loop.at(0, o)] = x_t
    for o in part.offsets:
        node = loop.at(0, o)
        if o in loop.slices:
            continue
        leaves, spec = _flatten(node)
        for j, leaf in enumerate(leaves):
            if (o, j) in numbers_in:
                leaves[j] = numbers_in[(o, j)]
            if not isinstance(leaf, fx.Node):
                continue
            what, ref = loop.args[(o, j)]
            if what == "internal":
                leaves[j] = env[loop.at(0, ref)]
            elif what == "invariant":
                leaves[j] = invariant_in[ref]
            else:
                leaves[j] = carry_in[ref]
        args, kwargs = _unflatten(spec, iter(leaves))
        env[node] = body.create_node(node.op, node.target, args, kwargs)
    outputs = [env[loop.at(0, o)] for o in carries]
    for o in ys:  # scan outputs must not alias each other or an input
        y = env[loop.at(0, o)]
        outputs.append(body.call_method("clone", (y,)) if o in carries or o in loop.slices else y)
    body.output(outputs)
    return fx.GraphModule({}, body, class_name="hecate_loop_body")
