"""A memory whose decay is one per value row, read as one memory per row.

Mamba-1 with one decay rate per channel (A [D] where the paper has A [D, N]) carries h [B, D, N] and steps::

    h ← a_t[:, :, None] ⊙ h + u_t[:, :, None] B_t[:, None, :],    y_t = Σ_n h C_t

Its decay is neither one number nor one per batch and head, so :mod:`memory_step` refuses the step as written.
But each row d of h is a memory of its own: one value (Dv = 1), its own decay a_t[d], the key B_t and the query
C_t every row shares. That is D heads of the Hebbian step (spec eq. 7 with a gate per head), and likewise of the
l_p step. Here a copy of the body carries the memory as [.., A, 1, C], a view of it on either side; the step is
recognised on the copy, which is installed only if it is one.

Every gate of the step is then read per row: a decay per row beside a step size per head (η_t [B, H] read as
[B, H, 1, 1]) is not recognised, and a memory stored [.., Dk, Dv] with a decay per column (per value) is not
split; both stay reported as they were.
"""

from __future__ import annotations

import contextlib
import copy
import operator

import torch
from torch import fx
from torch._guards import detect_fake_mode

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
    graph.lint()
    body.recompile()
    return body


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
