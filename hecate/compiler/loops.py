"""Roll the loops Dynamo unrolled back up into one ``scan`` before re-tracing to ATen.

Dynamo unrolls ``for t in range(T): state, y_t = step(state, x[:, t])`` into T copies of
the step. Re-tracing every copy to ATen (~2 ms a node) and matching patterns over them
makes compile time grow with T. This module finds such a run of copies in Dynamo's graph,
proves it is one loop, and replaces it by the node Dynamo itself emits for torch's scan::

    torch.ops.higher_order.scan(body, init, xs, invariants)

so re-tracing sees the body once and the memory passes fuse the scan like a user's own.
What :meth:`_Loop.verify` proves, for T ≥ 2 consecutive blocks of L nodes:

* node ``o`` of every block has the same op, target and literals, except the time index of
  a per-step slice: block t reads ``x[..., start + t, ...]`` of one tensor x from before the
  loop (a getitem or ``select``): those slices become the scan's ``xs``;
* every tensor input of node ``o`` is, in every block, either node ``o'`` of the same block
  (internal), one node from before the loop (an invariant), or node ``o'`` of the previous
  block with a value from before the loop in block 0 (a carry, whose init is that value);
* after the loop only the last block's carries are read, and ``torch.stack`` of one node
  from every block, in order (the scan's stacked per-step outputs);
* nothing in the loop mutates or draws random numbers.

A run that fails any check is left unrolled, exactly as Dynamo produced it.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

_TENSOR_OPS = ("call_function", "call_method")
_RANDOM = ("rand", "dropout", "bernoulli", "normal", "multinomial", "uniform")


@dataclass
class RolledGraph:
    """Dynamo's graph with its unrolled loops replaced by scans."""

    gm: fx.GraphModule
    steps: list[int]  # per rolled loop, in graph order: how many copies it had

    def mark(self, aten_gm: fx.GraphModule) -> None:
        """Tag the re-traced graph's scans that are rolled loops (``meta["hecate_rolled_loop"] = T``).

        Re-tracing keeps program order, so the k-th scan of ``aten_gm`` is the k-th scan of ``gm``.
        """
        flags = [getattr(n.args[0], "target", "").startswith("hecate_loop_body")
                 for n in _scans(self.gm.graph)]
        scans = _scans(aten_gm.graph)
        if len(scans) != len(flags):
            raise RuntimeError(f"re-tracing changed the number of scans ({len(flags)} -> {len(scans)})")
        steps = iter(self.steps)
        for node, rolled in zip(scans, flags):
            if rolled:
                node.meta["hecate_rolled_loop"] = next(steps)

    @staticmethod
    def unfused(aten_gm: fx.GraphModule) -> list[tuple[int, list[str]]]:
        """The rolled loops still scans after the passes: (steps, the ATen ops their body calls)."""
        loops = []
        for node in _scans(aten_gm.graph):
            if "hecate_rolled_loop" in node.meta:
                body = getattr(aten_gm, node.args[0].target)
                ops = dict.fromkeys(str(n.target).removeprefix("aten.").removesuffix(".default")
                                    for n in body.graph.nodes if n.op == "call_function")
                loops.append((node.meta["hecate_rolled_loop"], list(ops)))
        return loops


def _scans(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "call_function" and n.target is torch.ops.higher_order.scan]


def roll_loops(gm: fx.GraphModule) -> RolledGraph | None:
    """A copy of Dynamo's ``gm`` with every provable unrolled loop rolled into a scan, or None."""
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    loops: list[_Loop] = []
    end = 0
    for start_pos, period, count in _candidates(nodes, position):
        if start_pos < end:
            continue
        for s in range(max(end, start_pos - period + 1), start_pos + 1):
            loop = _Loop(nodes, position, s, period, count)
            if loop.verify():
                loops.append(loop)
                end = loop.end
                break
    if not loops:
        return None
    return RolledGraph(_rebuild(gm, loops), [loop.T for loop in loops])


# ---------------------------------------------------------------- per-step slices

def _time_slice(node: fx.Node) -> tuple[fx.Node, int, int] | None:
    """``(x, dim, index)`` if ``node`` is ``x[:, ..., index]`` / ``x.select(dim, index)`` of a tensor x."""
    if node.op == "call_function" and node.target is operator.getitem:
        x, index = node.args
        if not isinstance(x, fx.Node) or not isinstance(_value(x), torch.Tensor) or node.kwargs:
            return None
        index = index if isinstance(index, tuple) else (index,)
        ints = [i for i, e in enumerate(index) if _is_int(e)]
        if len(ints) != 1:
            return None
        (i,) = ints
        before, after = index[:i], index[i + 1:]
        if not all(e == slice(None) for e in after):
            return None
        if all(e == slice(None) for e in before):
            dim = i
        elif before == (Ellipsis,) and not after:
            dim = _value(x).dim() - 1
        else:
            return None
        return _normalise(x, dim, index[i])
    if node.op == "call_method" and node.target == "select" or (
            node.op == "call_function" and node.target is torch.select):
        if len(node.args) == 3 and not node.kwargs and isinstance(node.args[0], fx.Node) \
                and _is_int(node.args[1]) and _is_int(node.args[2]):
            return _normalise(*node.args)
    return None


def _normalise(x: fx.Node, dim: int, index: int) -> tuple[fx.Node, int, int] | None:
    value = _value(x)
    if not isinstance(value, torch.Tensor) or not -value.dim() <= dim < value.dim():
        return None
    dim %= value.dim()
    size = value.shape[dim]
    if not isinstance(size, int) or not -size <= index < size:
        return None
    return x, dim, index % size


def _value(node: fx.Node) -> Any:
    return node.meta.get("example_value", node.meta.get("val"))


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _candidates(nodes: list[fx.Node], position: dict[fx.Node, int]) -> list[tuple[int, int, int]]:
    """``(position of the first slice, period, steps)`` of runs of slices ``x[.., t0 + t, ..]``.

    A loop over T steps slices each per-step input once per step, at the same place in every
    copy: consecutive indices at a constant distance (the period) in the node list.
    """
    groups: dict[tuple[fx.Node, int], list[tuple[int, int]]] = {}
    for n in nodes:
        sliced = _time_slice(n)
        if sliced is not None:
            x, dim, index = sliced
            groups.setdefault((x, dim), []).append((position[n], index))
    runs = []
    for members in groups.values():
        i = 0
        while i + 1 < len(members):
            (p0, i0), (p1, i1) = members[i], members[i + 1]
            period, j = p1 - p0, i + 1
            if i1 != i0 + 1:
                i += 1
                continue
            while j + 1 < len(members) and members[j + 1][1] == members[j][1] + 1 \
                    and members[j + 1][0] - members[j][0] == period:
                j += 1
            runs.append((p0, period, j - i + 1))
            i = j
    return sorted(runs)


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
    slices: dict[int, tuple[fx.Node, int, int]] = field(default_factory=dict)  # offset -> (x, dim, start)
    stacks: dict[fx.Node, int] = field(default_factory=dict)  # torch.stack after the loop -> offset
    finals: dict[fx.Node, int] = field(default_factory=dict)  # last block's carry read after -> offset

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
        if o in self.slices:
            x, dim, start = self.slices[o]
            return all(_time_slice(self.at(t, o)) == (x, dim, start + t) for t in ts)
        leaves0, spec0 = pytree.tree_flatten((n0.args, n0.kwargs))
        for t in ts:
            nt = self.at(t, o)
            if nt.op != n0.op or nt.target != n0.target:
                return False
            leaves, spec = pytree.tree_flatten((nt.args, nt.kwargs))
            if spec != spec0:
                return False
            for j, (a0, a) in enumerate(zip(leaves0, leaves)):
                if not self._same_leaf(o, j, t, a0, a):
                    return False
        return True

    def _find_time_slice(self, o: int) -> None:
        """Record node o as a per-step slice if its index advances by one per block (else it is ordinary)."""
        s0, s1 = _time_slice(self.at(0, o)), _time_slice(self.at(1, o))
        if s0 is None or s1 is None or self.block(s0[0]) is not None or s1[:2] != s0[:2] or s1[2] != s0[2] + 1:
            return
        if s0[2] + self.T <= _value(s0[0]).shape[s0[1]]:
            self.slices[o] = s0

    def _same_leaf(self, o: int, j: int, t: int, a0: Any, a: Any) -> bool:
        if not isinstance(a0, fx.Node):
            return not isinstance(a, fx.Node) and type(a) is type(a0) and a == a0
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
                    else:
                        return False
        return True

    def _is_stack_of(self, node: fx.Node, o: int) -> bool:
        if node.op != "call_function" or node.target is not torch.stack or not node.args:
            return False
        items = node.args[0]
        return isinstance(items, (list, tuple)) and list(items) == [self.at(t, o) for t in range(self.T)] \
            and set(node.kwargs) <= {"dim"} and len(node.args) <= 2


def _pure(node: fx.Node) -> bool:
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    if name.endswith("_") and not name.endswith("__") or "out" in node.kwargs:
        return False  # in place
    return node.target is not operator.setitem and not any(r in name for r in _RANDOM)


def _same_meta(a: fx.Node, b: fx.Node) -> bool:
    va, vb = _value(a), _value(b)
    return isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) \
        and va.shape == vb.shape and va.dtype == vb.dtype and va.device == vb.device


# ---------------------------------------------------------------- rebuilding the graph

def _rebuild(gm: fx.GraphModule, loops: list[_Loop]) -> fx.GraphModule:
    """Copy ``gm``'s graph, emitting one scan in place of each loop."""
    graph, env, attrs = fx.Graph(), {}, {}
    starts = {loop.s: loop for loop in loops}
    skip: set[fx.Node] = set()
    stacks: dict[fx.Node, fx.Node] = {}
    for p, node in enumerate(gm.graph.nodes):
        if p in starts:
            loop = starts[p]
            name = f"hecate_loop_body_{len(attrs)}"
            attrs[name] = _body(loop)
            outs = _emit_scan(graph, env, loop, name)
            skip.update(loop.nodes[loop.s:loop.end])
            stacks.update({stack: outs[("y", o)] for stack, o in loop.stacks.items()})
            env.update({node: outs[("carry", o)] for node, o in loop.finals.items()})
        if node in skip:
            continue
        if node in stacks:
            dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
            env[node] = graph.call_function(torch.movedim, (stacks[node], 0, dim))
            continue
        env[node] = graph.node_copy(node, env.__getitem__)
        if node.op in ("get_attr", "call_module"):
            attrs[node.target] = operator.attrgetter(node.target)(gm)
    rolled = fx.GraphModule(attrs, graph, class_name=type(gm).__name__)
    rolled.meta.update(gm.meta)
    return rolled


def _emit_scan(graph: fx.Graph, env: dict, loop: _Loop, body_name: str) -> dict[tuple[str, int], fx.Node]:
    carries, ys, invariants = _io(loop)
    xs = []
    for o in sorted(loop.slices):
        x, dim, start = loop.slices[o]
        x = env[x]
        if dim != 0:
            x = graph.call_function(torch.movedim, (x, dim, 0))
        if start != 0 or _value(loop.slices[o][0]).shape[dim] != loop.T:
            x = graph.call_function(torch.narrow, (x, 0, start, loop.T))
        xs.append(x)
    scan = graph.call_function(torch.ops.higher_order.scan, (
        graph.get_attr(body_name), [env[loop.carries[o]] for o in carries], xs, [env[a] for a in invariants]))
    outs = {}
    for i, key in enumerate([("carry", o) for o in carries] + [("y", o) for o in ys]):
        outs[key] = graph.call_function(operator.getitem, (scan, i))
    return outs


def _io(loop: _Loop) -> tuple[list[int], list[int], list[fx.Node]]:
    """Offsets of the carries and stacked outputs, and the invariants in order of first use."""
    invariants = list(dict.fromkeys(ref for what, ref in loop.args.values() if what == "invariant"))
    return sorted(loop.carries), sorted(set(loop.stacks.values())), invariants


def _body(loop: _Loop) -> fx.GraphModule:
    """Block 0 as the scan body: ``(*carries, *x_t, *invariants) -> [*next carries, *y_t]``."""
    carries, ys, invariants = _io(loop)
    body = fx.Graph()
    carry_in = {o: body.placeholder(f"carry_{i}") for i, o in enumerate(carries)}
    env = {loop.at(0, o): body.placeholder(f"x_{i}") for i, o in enumerate(sorted(loop.slices))}
    invariant_in = {a: body.placeholder(f"invariant_{i}") for i, a in enumerate(invariants)}
    for o in range(loop.L):
        node = loop.at(0, o)
        if o in loop.slices:
            continue
        leaves, spec = pytree.tree_flatten((node.args, node.kwargs))
        for j, leaf in enumerate(leaves):
            if not isinstance(leaf, fx.Node):
                continue
            what, ref = loop.args[(o, j)]
            if what == "internal":
                leaves[j] = env[loop.at(0, ref)]
            elif what == "invariant":
                leaves[j] = invariant_in[ref]
            else:
                leaves[j] = carry_in[ref]
        args, kwargs = pytree.tree_unflatten(leaves, spec)
        env[node] = body.create_node(node.op, node.target, args, kwargs)
    outputs = [env[loop.at(0, o)] for o in carries]
    for o in ys:  # scan outputs must not alias each other or an input
        y = env[loop.at(0, o)]
        outputs.append(body.call_method("clone", (y,)) if o in carries or o in loop.slices else y)
    body.output(outputs)
    return fx.GraphModule({}, body, class_name="hecate_loop_body")
