"""Equivalence-preserving rewrites of a Dynamo FX graph, the spellings researchers vary.

Each rewrite turns one spelling into another that computes exactly the same values:
commuted operands of ``+``/``*``, ``x + x`` ↔ ``2 * x``, ``unsqueeze`` ↔ ``None``
indexing, ``bmm`` ↔ ``einsum`` ↔ ``matmul``, ``square`` ↔ ``** 2``, ``a - b`` →
``a + (-b)``, a pointwise function applied under a transpose undone after it, and an
expression bound once written again at each use (the graph form of splitting it into
temporaries or not). A rewrite is applied to every node of one *site*,
the nodes one source line produced (its copies in an unrolled loop included), as editing
that line of the model would.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import fx
from torch._guards import detect_fake_mode

from hecate.passes.report import source_line


def _value(a: Any) -> Any:
    return a.meta.get("example_value") if isinstance(a, fx.Node) else a


def _is_tensor(a: Any) -> bool:
    return isinstance(_value(a), torch.Tensor)


def _is_call(node: fx.Node, functions=(), methods=()) -> bool:
    return (node.op == "call_function" and node.target in functions
            or node.op == "call_method" and node.target in methods)


def _emit(node: fx.Node, op: str, target: Any, args: tuple, kwargs: dict | None = None) -> fx.Node:
    """A new node before ``node`` with its fake value and ``node``'s source line."""
    graph = node.graph
    with graph.inserting_before(node):
        new = graph.create_node(op, target, args, kwargs or {})
    new.meta["stack_trace"] = node.meta.get("stack_trace")
    values = fx.node.map_arg((args, kwargs or {}), _value)
    with detect_fake_mode(_tensors(values)):
        fn = target if op == "call_function" else getattr(type(values[0][0]), target)
        new.meta["example_value"] = fn(*values[0], **values[1])
    return new


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [v for v in torch.utils._pytree.tree_leaves(tree) if isinstance(v, torch.Tensor)]


def _replace(node: fx.Node, op: str, target: Any, args: tuple, kwargs: dict | None = None) -> None:
    new = _emit(node, op, target, args, kwargs)
    node.replace_all_uses_with(new)
    node.graph.erase_node(node)


# ---- the rewrites: (applies to node?, rewrite node) ------------------------------------------

_ADD = (operator.add, torch.add)
_MUL = (operator.mul, torch.mul)


def _binary(node, functions, methods=()) -> bool:
    return _is_call(node, functions, methods) and len(node.args) == 2 and not node.kwargs


def _commutes(node):
    return _binary(node, _ADD + _MUL) and (_is_tensor(node.args[0]) or _is_tensor(node.args[1]))


def _commute(node):
    node.args = (node.args[1], node.args[0])


def _doubles(node):
    a, b = node.args if _binary(node, _ADD + _MUL) else (None, None)
    if _is_call(node, _ADD) and a is b and _is_tensor(a):
        return True
    return _is_call(node, _MUL) and (_is_tensor(a) and b == 2 or _is_tensor(b) and a == 2) \
        and _value(node).dtype.is_floating_point


def _double(node):
    a, b = node.args
    if a is b:
        _replace(node, "call_function", operator.mul, (2, a))
    else:
        x = a if _is_tensor(a) else b
        _replace(node, "call_function", operator.add, (x, x))


def _unsqueezes(node):
    return _is_call(node, (torch.unsqueeze,), ("unsqueeze",)) and len(node.args) == 2 and not node.kwargs


def _unsqueeze_to_index(node):
    x, dim = node.args
    dim = dim % (_value(x).dim() + 1)
    _replace(node, "call_function", operator.getitem, (x, (slice(None),) * dim + (None,)))


def _none_indexes(node):
    if not _is_call(node, (operator.getitem,)) or not _is_tensor(node.args[0]):
        return False
    index = node.args[1]
    return (isinstance(index, tuple) and index.count(None) == 1
            and all(i is None or i == slice(None) for i in index))


def _index_to_unsqueeze(node):
    x, index = node.args
    _replace(node, "call_method", "unsqueeze", (x, index.index(None)))


def _products(node):
    if not (_is_call(node, (torch.bmm, torch.matmul, operator.matmul), ("matmul", "bmm"))
            and len(node.args) == 2 and not node.kwargs):
        return False
    a, b = (_value(x) for x in node.args)
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() == b.dim() >= 2


def _product_forms(node, choice: int):
    a, b = node.args
    rank = _value(a).dim()
    forms = [("call_function", torch.einsum, ("...ij,...jk->...ik", a, b)),
             ("call_function", torch.matmul, (a, b))]
    if rank == 3:
        forms.append(("call_function", torch.bmm, (a, b)))
    _replace(node, *forms[choice % len(forms)])


def _squares(node):
    if _is_call(node, (torch.square,), ("square",)) and len(node.args) == 1:
        return True
    return (_is_call(node, (operator.pow, torch.pow), ("pow",)) and len(node.args) == 2
            and _is_tensor(node.args[0]) and node.args[1] in (2, 2.0) and not isinstance(node.args[1], bool))


def _square_pow(node):
    x = node.args[0]
    if len(node.args) == 1:
        _replace(node, "call_function", operator.pow, (x, 2))
    else:
        _replace(node, "call_method", "square", (x,))


def _subtracts(node):
    return _binary(node, (operator.sub, torch.sub)) and _is_tensor(node)


def _sub_to_add_neg(node):
    a, b = node.args
    negated = _emit(node, "call_function", operator.neg, (b,)) if isinstance(b, fx.Node) else -b
    _replace(node, "call_function", operator.add, (a, negated))


_POINTWISE_FUNCTIONS = (torch.sigmoid, torch.exp, torch.tanh, torch.nn.functional.silu, torch.nn.functional.elu,
                        torch.nn.functional.relu, torch.nn.functional.softplus)
_POINTWISE_METHODS = ("sigmoid", "exp", "tanh", "relu")


def _pointwise_of_a_matrix(node):
    return _is_call(node, _POINTWISE_FUNCTIONS, _POINTWISE_METHODS) and node.args and _is_tensor(node.args[0]) \
        and _value(node.args[0]).dim() >= 2 and _is_tensor(node)


def _under_a_transpose(node):
    """f(x) → f(x.transpose(0, -1)).transpose(0, -1): the layout moved before the op and back after it."""
    moved = _emit(node, "call_method", "transpose", (node.args[0], 0, -1))
    applied = _emit(node, node.op, node.target, (moved, *node.args[1:]), dict(node.kwargs))
    _replace(node, "call_method", "transpose", (applied, 0, -1))


_PURE_FUNCTIONS = (operator.getitem, operator.add, operator.sub, operator.mul, operator.truediv, operator.neg)
_PURE_METHODS = ("unsqueeze", "transpose", "square", "view", "reshape", "squeeze", "exp")


def _shared(node):
    return _is_call(node, _PURE_FUNCTIONS, _PURE_METHODS) and _is_tensor(node) and len(node.users) >= 2


def _write_at_each_use(node):
    for user in list(node.users)[1:]:
        copy = _emit(node, node.op, node.target, node.args, node.kwargs)
        user.replace_input_with(node, copy)


@dataclass(frozen=True)
class Rewrite:
    name: str
    applies: Callable[[fx.Node], bool]
    apply: Callable[..., None]
    takes_choice: bool = False  # apply(node, choice) picks one of several forms


REWRITES = {r.name: r for r in [
    Rewrite("commute", _commutes, _commute),
    Rewrite("x+x <-> 2*x", _doubles, _double),
    Rewrite("unsqueeze -> None index", _unsqueezes, _unsqueeze_to_index),
    Rewrite("None index -> unsqueeze", _none_indexes, _index_to_unsqueeze),
    Rewrite("bmm/einsum/matmul", _products, _product_forms, takes_choice=True),
    Rewrite("square <-> pow 2", _squares, _square_pow),
    Rewrite("a-b -> a+(-b)", _subtracts, _sub_to_add_neg),
    Rewrite("written at each use", _shared, _write_at_each_use),
    Rewrite("pointwise under a transpose", _pointwise_of_a_matrix, _under_a_transpose),
]}


def _site(node: fx.Node) -> tuple:
    """The source line a node came from (all its unrolled copies share it) and what it calls."""
    return node.meta.get("stack_trace"), node.op, node.target


def sites(gm: fx.GraphModule, rewrite: Rewrite) -> list[list[fx.Node]]:
    """The nodes ``rewrite`` applies to, grouped by site, in graph order."""
    found: dict[tuple, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if rewrite.applies(node):
            found.setdefault(_site(node), []).append(node)
    return list(found.values())


def code(nodes: list[fx.Node]) -> str:
    """The user's code of a site (``M = (1 - alpha_t) * M - eta_t * grad``), or its first node's name."""
    line = source_line(nodes)
    return line.split(": ", 1)[1] if line else nodes[0].name


def apply_rewrites(gm: fx.GraphModule, choices: list[tuple[str, int | None]]) -> list[str]:
    """Apply ``(rewrite name, site choice)`` pairs in turn to ``gm`` in place; return what was done.

    A choice picks one site (modulo their number); ``None`` rewrites every site at once.
    """
    done = []
    for name, pick in choices:
        rewrite = REWRITES[name]
        candidates = sites(gm, rewrite)
        if not candidates:
            continue
        for site in candidates if pick is None else [candidates[pick % len(candidates)]]:
            for node in site:
                rewrite.apply(node, pick or 0) if rewrite.takes_choice else rewrite.apply(node)
            done.append(f"{rewrite.name} at {code(site)} ({len(site)} node(s))")
    gm.graph.lint()
    gm.recompile()
    return done
