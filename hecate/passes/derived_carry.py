"""A carry the step recomputes from another one, read as that function of the other.

MONETA written the natural way carries the normalised memory W from step to step beside A::

    for t in range(T):
        e = W k_t − v_t                                     # W of the previous step
        A = a·A − η·outer(G(e), k_t)
        W = A / (Σ|A|^q + eps)^((q−2)/q)                    # W_new = f(A_new)
        y_t = W q_t

The step reads the W it computed from A the step before, so W_old = f(A_old) at every step after the first, and at
the first one too when W's initial value is f(A's initial value). The body is then the same step with W dropped
as a carry and f(A_old) computed where W_old was read, which :mod:`memory_step` recognises as one memory step.

A carry W is *derived* from a carry A when the body's new W is computed from the body's new A alone (pure ops and
constants, no other input of the step). Its initial value is proven to be f(A's) only where both start at zeros
(W's init zeros, or the very node A's init is) and f of zeros is exactly zeros, evaluated on zeros of A's size
in A's dtype and in float64 (an eps that rounds to zero in float32 makes 0/0, which the step as written never
computes); otherwise the carry is left as it is. The rewrite (:func:`without_derived`) is a copy of the body;
:func:`install` puts it in the graph only once the copy has been proven a memory step: the scan loses W's init
and output, and a read of W's final value after the loop becomes f of A's final value.

This lives beside the memory passes rather than in :mod:`hecate.compiler.loops`: a user's own ``scan`` never
passes through the loop roller, the zero-init proof reads the ATen graph around the scan, and the rewrite is only
worth making (and only made) where the step it leaves is then fused.
"""

from __future__ import annotations

import copy
import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from hecate.passes.matching import eliminate_dead_code, is_zeros


@dataclass
class Derived:
    """Carry ``w`` whose new value is f(new value of carry ``a``): ``nodes`` (in graph order) compute f from
    ``source`` (the body's new A) to ``result`` (its new W); ``proven``: W starts as f(A's initial value)."""

    w: int
    a: int
    nodes: list[fx.Node]
    source: fx.Node
    result: fx.Node
    proven: bool


def _functional(node: fx.Node) -> bool:
    """Nothing in place, nothing random."""
    if node.op == "get_attr":
        return True
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    return isinstance(node.target, torch._ops.OpOverload) and not node.target._schema.is_mutable \
        and torch.Tag.nondeterministic_seeded not in node.target.tags


def derived_carries(gm: fx.GraphModule, node: fx.Node) -> list[Derived]:
    """The carries of scan ``node`` that its body recomputes from another carry's new value alone (none read
    through another derived one)."""
    from hecate.passes.memory_step import _upstream

    body = getattr(gm, node.args[0].target)
    init = list(node.args[1])
    placeholders = [p for p in body.graph.nodes if p.op == "placeholder"]
    outputs = list(body.graph.output_node().args[0])
    order = {x: i for i, x in enumerate(body.graph.nodes)}
    found: list[Derived] = []
    for w in range(len(init)):
        if not isinstance(outputs[w], fx.Node):
            continue
        for a in range(len(init)):
            if a == w or not isinstance(outputs[a], fx.Node) or any(d.w == a or d.a == w for d in found):
                continue  # (W from A and A from W: at most one of them is dropped)
            source, result = outputs[a], outputs[w]
            nodes = [] if result is source else sorted(_upstream(result, source), key=order.__getitem__)
            if not all(_functional(x) for x in nodes):
                continue  # reads an input of the step (a placeholder) or writes in place
            if nodes and source not in {i for x in nodes for i in x.all_input_nodes}:
                continue  # W_new does not read A_new at all (a constant: no state of A's)
            d = Derived(w, a, nodes, source, result, False)
            d.proven = _starts_as_f(d, init, placeholders)
            found.append(d)
            break
    return found


def _starts_as_f(d: Derived, init: list, placeholders: list[fx.Node]) -> bool:
    """Whether W's initial value is provably f(A's initial value): both zeros, f(zeros) exactly zeros."""
    from hecate.passes.memory_step import _concrete, _evaluate

    if not is_zeros(init[d.a]) or not (init[d.w] is init[d.a] or is_zeros(init[d.w])):
        return False
    A, W = placeholders[d.a].meta.get("val"), placeholders[d.w].meta.get("val")
    if not isinstance(A, torch.Tensor) or not isinstance(W, torch.Tensor) or not A.is_floating_point():
        return False
    try:
        shape, w_shape = tuple(_concrete(s) for s in A.shape), tuple(_concrete(s) for s in W.shape)
        for dtype in dict.fromkeys((A.dtype, torch.float64)):
            value = _evaluate(d.source.graph, {}, {d.source: torch.zeros(shape, dtype=dtype)}, upto=set(d.nodes))
            value = value.get(d.result)
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != w_shape \
                    or not bool(torch.isfinite(value).all()) or bool((value != 0).any()):
                return False
    except Exception:  # (a size without an example value, an op that does not run on zeros): not proven
        return False
    return True


def without_derived(body: fx.GraphModule, n_carries: int, derived: list[Derived]) -> fx.GraphModule:
    """A copy of scan ``body`` without the ``derived`` carries: f(A_old) computed from A's input where W_old was
    read, W's new value no output."""
    new = copy.deepcopy(body)
    old_nodes, new_nodes = list(body.graph.nodes), list(new.graph.nodes)
    assert len(old_nodes) == len(new_nodes)
    copied = dict(zip(old_nodes, new_nodes))
    graph = new.graph
    placeholders = [p for p in graph.nodes if p.op == "placeholder"]
    output = graph.output_node()
    first = next(x for x in graph.nodes if x.op != "placeholder")
    for d in derived:
        env = {copied[d.source]: placeholders[d.a]}
        with graph.inserting_before(first):
            for x in d.nodes:
                env[copied[x]] = graph.node_copy(copied[x], env.__getitem__)
        placeholders[d.w].replace_all_uses_with(env[copied[d.result]])  # (a y_t that is W_old itself included)
    dropped = {d.w for d in derived}
    outputs = list(output.args[0])
    output.args = ([o for i, o in enumerate(outputs) if i not in dropped or i >= n_carries],) + tuple(output.args[1:])
    for d in derived:
        graph.erase_node(placeholders[d.w])
    eliminate_dead_code(graph)
    graph.lint()
    new.recompile()
    return new


def final_reads(gm: fx.GraphModule, node: fx.Node, derived: list[Derived]) -> dict[int, fx.GraphModule]:
    """For each derived carry whose final value is read after the scan, f traced on A's final (fake) value."""
    from torch._guards import detect_fake_mode
    from torch.fx.experimental.proxy_tensor import make_fx

    read = {u.args[1] for u in node.users if u.target is operator.getitem and u.users}
    traced = {}
    for d in derived:
        if d.w not in read:
            continue
        A = node.meta["val"][d.a]

        with detect_fake_mode([A]):
            traced[d.w] = make_fx(_as_function(d))(A)
    return traced


def _as_function(d: Derived) -> Any:
    """f, computing W from A as the body does."""
    from hecate.passes.memory_step import _evaluate

    def f(value: torch.Tensor) -> Any:
        return _evaluate(d.source.graph, {}, {d.source: value}, upto=set(d.nodes))[d.result]

    return f


def readable(node: fx.Node) -> bool:
    """Whether scan ``node``'s results are read one by one (each by a getitem of an int index)."""
    return all(u.op == "call_function" and u.target is operator.getitem and isinstance(u.args[1], int)
               for u in node.users) and isinstance(node.meta.get("val"), (list, tuple))


def install(gm: fx.GraphModule, node: fx.Node, body: fx.GraphModule, derived: list[Derived],
            traced: dict[int, fx.GraphModule]) -> None:
    """Scan ``node`` rewritten to run ``body`` (:func:`without_derived`'s): the derived carries' inits dropped, the
    other results' indices shifted, a read of a derived carry's final value made f of its source's final value."""
    from hecate.passes.memory_step import _emit_traced

    graph = gm.graph
    dropped = {d.w for d in derived}
    index = {i: i - sum(j < i for j in dropped) for i in range(len(node.meta["val"])) if i not in dropped}
    results = {u.args[1]: u for u in node.users}
    setattr(gm, node.args[0].target, body)
    node.args = (node.args[0], [x for i, x in enumerate(node.args[1]) if i not in dropped]) + tuple(node.args[2:])
    val = node.meta["val"]
    node.meta["val"] = type(val)(v for i, v in enumerate(val) if i not in dropped)
    for i, u in list(results.items()):
        if i in index:
            u.args = (node, index[i])
    for d in derived:
        w_read = results.get(d.w)
        if w_read is None:
            continue
        if d.w in traced:
            a_read = results.get(d.a)
            if a_read is None:
                with graph.inserting_after(node):
                    a_read = results[d.a] = graph.call_function(operator.getitem, (node, index[d.a]))
                a_read.meta["val"] = node.meta["val"][index[d.a]]
            node.append(a_read)  # right after the scan: before the read of W it stands for
            with graph.inserting_before(w_read):
                out, _ = _emit_traced(gm, traced[d.w], [a_read])
            w_read.replace_all_uses_with(out)
        graph.erase_node(w_read)
