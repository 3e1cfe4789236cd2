"""A memory whose decay is one per value row, read as one memory per row.

Mamba-1 with one decay rate per channel (A [D] where the paper has A [D, N]) carries h [B, D, N] and steps::

    h ← a_t[:, :, None] ⊙ h + u_t[:, :, None] B_t[:, None, :],    y_t = Σ_n h C_t

Its decay is neither one number nor one per batch and head, so :mod:`memory_step` refuses the step as written.
But each row d of h is a memory of its own: one value (Dv = 1), its own decay a_t[d], the key B_t and the query
C_t every row shares. That is D heads of the Hebbian step (spec eq. 7 with a gate per head), and likewise of the
l_p step. Here a copy of the body carries the memory as [.., A, 1, C], a view of it on either side; the step is
recognised on the copy, which is installed only if it is one.

The step's other gates are then read per row: a value one number across the memory's columns ([B, 1, 1] of a step
size per sequence, [D, 1] of a decay parameter per row) is read without that dim against the rows (`_row_gates`).
A memory stored [.., Dk, Dv] with a decay per column (per value) is not split, and stays reported as it was.
"""

from __future__ import annotations

import contextlib
import copy
import operator

import torch
from torch import fx
from torch._guards import detect_fake_mode

from hecate.passes.matching import KEEP, computed_from, is_one

aten = torch.ops.aten


def _emit(graph: fx.Graph, node: fx.Node, split: bool) -> fx.Node:
    """``node`` [.., A, C] split into one memory per row [.., A, 1, C] (or put back together), at the graph's
    insertion point, with its value."""
    target = aten.unsqueeze.default if split else aten.squeeze.dim
    value = node.meta["val"]
    out = graph.call_function(target, (node, -2))
    with detect_fake_mode([value]) or contextlib.nullcontext():
        out.meta["val"] = target(value, -2)
    return out


def per_row(body: fx.GraphModule, state: int) -> fx.GraphModule:
    """A copy of scan ``body`` that carries its state ``state`` [.., A, C] as one memory per row [.., A, 1, C]."""
    body = copy.deepcopy(body)
    graph = body.graph
    M_in = [n for n in graph.nodes if n.op == "placeholder"][state]
    with detect_fake_mode([M_in.meta["val"]]) or contextlib.nullcontext():
        M_in.meta["val"] = M_in.meta["val"].unsqueeze(-2)
    output = graph.output_node()
    outputs = list(output.args[0])
    with graph.inserting_before(next(n for n in graph.nodes if n.op != "placeholder")):
        M = _emit(graph, M_in, split=False)
    M_in.replace_all_uses_with(M, delete_user_cb=lambda user: user is not M)
    with graph.inserting_before(output):
        outputs[state] = _emit(graph, outputs[state], split=True)
    output.args = (outputs,) + tuple(output.args[1:])
    body.meta[ROW_GATES] = _row_gates(graph, M, rank=M.meta["val"].dim())
    graph.lint()
    body.recompile()
    return body


# the meta key of a per-row body's gates read per row: {the name of a value [.., 1] as it broadcasts against the
# memory [.., A, C]: the name of the same without its last dim, [..] against the rows [.., A]} (names: a copy of
# the body keeps them)
ROW_GATES = "hecate_row_gates"


def _row_gates(graph: fx.Graph, M: fx.Node, rank: int) -> dict[str, str]:
    """For each value of the memory's rank that is one number across its columns ([B, 1, 1] of a step size per
    sequence, [D, 1] of a decay per row), its select of that one column: the value per row, as the memory split
    per row reads it (the gates of a memory [B, D, N] read as [B] and [D] against [B, D], from the right)."""
    gates = {}
    first = next(n for n in graph.nodes if n.op != "placeholder")
    for node in list(graph.nodes):
        value = node.meta.get("val")
        if node.op not in ("placeholder", "call_function") or node is M or not isinstance(value, torch.Tensor) \
                or not value.is_floating_point() or not 1 <= value.dim() <= rank or not is_one(value.shape[-1]) \
                or computed_from([node], {M}):
            continue
        with graph.inserting_before(first if node.op == "placeholder" else node.next):
            gates[node] = graph.call_function(aten.select.int, (node, -1, 0))
        gates[node].meta[KEEP] = True  # (read by the op's inputs, made from the body after the pass that found it)
        with detect_fake_mode([value]) or contextlib.nullcontext():
            gates[node].meta["val"] = value.select(-1, 0)
    return {node.name: gate.name for node, gate in gates.items()}


def install(gm: fx.GraphModule, node: fx.Node, state: int, body: fx.GraphModule) -> None:
    """Scan ``node`` rewritten to run ``body`` (:func:`per_row`'s): its initial state split before it, its final
    state put back together after it."""
    graph = gm.graph
    setattr(gm, node.args[0].target, body)
    init = list(node.args[1])
    with graph.inserting_before(node):
        init[state] = _emit(graph, init[state], split=True)
    node.args = (node.args[0], init) + tuple(node.args[2:])
    val = list(node.meta["val"])
    val[state] = init[state].meta["val"]
    node.meta["val"] = type(node.meta["val"])(val)
    for user in list(node.users):
        if user.target is operator.getitem and user.args[1] == state:
            user.meta["val"] = val[state]
            with graph.inserting_before(user.next):
                whole = _emit(graph, user, split=False)
            user.replace_all_uses_with(whole, delete_user_cb=lambda u, whole=whole: u is not whole)
