"""A memory update made for every step before the loop, formed in the step instead.

Mamba-1 as transformers' reference writes it makes the whole update before the scan and reads one step of it::

    dB_u = dt[:, :, :, None] * B[:, None, :, :] * x[:, :, :, None]    # [B, D, T, N]
    for i in range(T):
        h = dA[:, :, i] * h + dB_u[:, :, i]                             # h [B, D, N]
        y_i = h @ C[:, i, :, None]

Step i reads the outer product ``(dt_i x_i) B_iᵀ`` already formed, so its body holds no outer product and reads
as no memory step. A per-step input that is a product of tensors broadcast against each other is the same product
of their own steps (of the factor whole where it has a time of size 1): the copy of the scan here takes the
factors as its inputs and multiplies them in the step as the code did (the same tree of products, so each element
is the same number). The copy is installed only where it is then a memory step (:mod:`memory_step`).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import fx

from hecate.passes.matching import is_one

aten = torch.ops.aten


def _tree(node: Any, top: bool = True) -> Any:
    """``node``'s product tree: (left, right) for an ``aten.mul.Tensor`` (read by the tree alone, but at the top),
    else the leaf itself (a tensor node or a number)."""
    if isinstance(node, fx.Node) and node.op == "call_function" and node.target is aten.mul.Tensor \
            and not node.kwargs and (top or len(node.users) == 1):
        return _tree(node.args[0], False), _tree(node.args[1], False)
    return node


def _leaves(tree: Any) -> list[Any]:
    return _leaves(tree[0]) + _leaves(tree[1]) if isinstance(tree, tuple) else [tree]


def _product_of_steps(x: fx.Node) -> tuple[fx.Node, Any, int] | None:
    """(P, its product tree, P's time dim) when the scan input ``x`` is P read with its time dim first (P itself,
    or ``P.permute(perm)``), P a product of tensors one of which it broadcasts; else None."""
    product, time = x, 0
    if x.op == "call_function" and x.target is aten.permute.default:
        product, time = x.args[0], x.args[1][0]
    tree = _tree(product) if isinstance(product, fx.Node) else None
    if not isinstance(tree, tuple):
        return None
    leaves = _leaves(tree)
    if not all(isinstance(f, (int, float)) and not isinstance(f, bool) or isinstance(f, fx.Node) and isinstance(
            f.meta.get("val"), torch.Tensor) for f in leaves):
        return None
    shape = tuple(product.meta["val"].shape)
    if all(tuple(f.meta["val"].shape) == shape for f in leaves if isinstance(f, fx.Node)):
        return None  # an elementwise product of whole tensors: nothing formed by broadcasting
    return product, tree, time % len(shape)


def sunk(gm: fx.GraphModule, node: fx.Node) -> tuple[fx.GraphModule, list, list, list[fx.Node]] | None:
    """(a copy of scan ``node``'s body, its per-step inputs, its invariants, the nodes emitted into ``gm`` before
    ``node`` for them) with each per-step input that is a product of broadcast tensors taken as its factors and
    multiplied in the step; None if no per-step input is such a product."""
    _, init, xs, invariants = node.args[:4]
    products = {j: found for j, x in enumerate(xs) if isinstance(x, fx.Node)
                and (found := _product_of_steps(x)) is not None}
    if not products:
        return None
    body = copy.deepcopy(getattr(gm, node.args[0].target))
    graph = body.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    carries, steps = placeholders[:len(init)], placeholders[len(init):len(init) + len(xs)]
    every = placeholders[len(init) + len(xs):]
    new_xs, new_invariants, emitted = [x for j, x in enumerate(xs) if j not in products], list(invariants), []
    kept_steps = [p for j, p in enumerate(steps) if j not in products]
    first = next(n for n in graph.nodes if n.op != "placeholder")

    def emit(target, *args):
        with gm.graph.inserting_before(node):
            out = gm.graph.call_function(target, args)
        out.meta["val"] = target(*fx.node.map_arg(args, lambda n: n.meta["val"]))
        emitted.append(out)
        return out

    for j, (product, tree, time) in products.items():
        rank = product.meta["val"].dim()
        read: dict[fx.Node, fx.Node] = {}  # factor -> its placeholder in the step
        for f in _leaves(tree):
            if not isinstance(f, fx.Node) or f in read:
                continue
            value = f.meta["val"]
            aligned = f if value.dim() == rank else emit(aten.reshape.default, f,
                                                         [1] * (rank - value.dim()) + list(value.shape))
            size = aligned.meta["val"].shape[time]
            with graph.inserting_before(first):
                read[f] = graph.placeholder(f"{f.name}_{'step' if not is_one(size) else 'every_step'}")
            if is_one(size):  # no time: every step reads it whole
                outer = emit(aten.select.int, aligned, time, 0)
                new_invariants.append(outer)
                every.append(read[f])
                read[f].meta["val"] = outer.meta["val"]
            else:
                outer = emit(aten.permute.default, aligned, [time] + [d for d in range(rank) if d != time])
                new_xs.append(outer)
                kept_steps.append(read[f])
                read[f].meta["val"] = outer.meta["val"].select(0, 0)

        def build(t):
            if isinstance(t, tuple):
                return graph.call_function(aten.mul.Tensor, (build(t[0]), build(t[1])))
            return read.get(t, t)

        with graph.inserting_before(first):
            steps[j].replace_all_uses_with(build(tree))
        graph.erase_node(steps[j])
    anchor = next(n for n in graph.nodes if n.op != "placeholder")  # (the products' nodes come first now)
    for ph in carries + kept_steps + every:  # carries, per-step inputs, invariants: the scan's order
        anchor.prepend(ph)
    graph.lint()
    body.recompile()
    return body, new_xs, new_invariants, emitted


def install(gm: fx.GraphModule, node: fx.Node, body: fx.GraphModule, xs: list, invariants: list) -> None:
    """Scan ``node`` rewritten to run ``body`` (:func:`sunk`'s) over ``xs`` and ``invariants``."""
    setattr(gm, node.args[0].target, body)
    node.args = (node.args[0], node.args[1], xs, invariants) + tuple(node.args[4:])


def discard(gm: fx.GraphModule, emitted: list[fx.Node]) -> None:
    """Remove what :func:`sunk` emitted for a copy that is not installed."""
    for n in reversed(emitted):
        gm.graph.erase_node(n)
