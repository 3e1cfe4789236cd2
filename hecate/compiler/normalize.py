"""One normal form for the ATen graph, so that spellings collapse before any pass looks.

Every rewrite here is exact: the rewritten graph computes bit-for-bit what the original
computes (checked in ``tests/compiler/test_normalize.py``). :func:`normalize` makes in-place
ops functional in the whole graph, drops its no-op copies and turns ``narrow`` into a slice,
and applies to the body of every ``scan`` in it (where the memory passes look) the whole
normal form below. (The graph outside loop bodies keeps its other spellings until the passes
that match fixed patterns there trace their patterns into the same normal form: their
SubgraphMatcher patterns are not normalised today.)

* :func:`functionalize`: an in-place op on a tensor nothing else aliases (``M.mul_(a)``,
  ``M -= x``, ``M.add_(x, alpha=-1)``) becomes its out-of-place op, later reads of the
  tensor read the result; an in-place op on an input or on a view stays as it is;
* no-op copies dropped: ``clone`` / ``contiguous`` / ``alias`` whose result is not a graph
  output (outputs must not alias each other);
* ``narrow(x, d, s, n)`` → ``slice(x, d, s, s + n)``; a slice of a whole dim (``x[:, t]`` under
  torch.export leaves ``slice(x, 0, 0, END)`` before the select) → ``x``;
* a product with nothing summed is a broadcast multiply: ``matmul``/``bmm`` whose
  contracted dim has size 1 (``g.unsqueeze(-1) @ k.unsqueeze(-2)``) and an ``einsum`` in
  which every index is kept (``einsum("bhv,bhk->bhvk", g, k)``) become ``mul`` of the
  operands unsqueezed/permuted into place (a sum of one product is that product);
* ``x * x`` → ``x ** 2`` (ATen computes ``pow(x, 2)`` as ``x * x``);
* common subexpressions: the same pure op on the same inputs is computed once (so
  ``k[:, t]`` written at every use becomes one node).

:func:`functionalize` also runs on Dynamo's graph (:mod:`hecate.compiler.loops` calls it
before rolling loops up): there in-place ops are ``call_method`` ``mul_`` / ``operator.isub``.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef

aten = torch.ops.aten

# Dynamo's spelling of ``x op= y`` on a tensor and its out-of-place twin
_INPLACE_OPERATORS = {operator.iadd: operator.add, operator.isub: operator.sub, operator.imul: operator.mul,
                      operator.itruediv: operator.truediv}


def normalize(gm: fx.GraphModule) -> fx.GraphModule:
    """Make ``gm`` functional without copies or narrow, and its scan bodies wholly normal, in place; return it."""
    normalize_graph(gm, whole=False)
    for graph_module in _graph_modules(gm)[1:]:
        normalize_graph(graph_module)
    return gm


def normalize_graph(graph_module: fx.GraphModule, whole: bool = True) -> fx.GraphModule:
    """Rewrite ``graph_module`` (not the graphs it calls) into the normal form, in place; return it.

    ``whole=False``: functional ops, no-op copies dropped and ``narrow`` as a slice only (what the
    fixed-pattern passes outside loop bodies already read the same way)."""
    graph = graph_module.graph
    functionalize(graph)
    outputs = _output_nodes(graph)
    for node in list(graph.nodes):
        if node.op != "call_function" or not (whole or node.target in _STRUCTURAL):
            continue
        replacement = _rewrite(graph, node, outputs)
        if replacement is not None and replacement is not node:
            node.replace_all_uses_with(replacement)
            graph.erase_node(node)
    if whole:
        eliminate_common_subexpressions(graph)
    graph.eliminate_dead_code()
    graph.lint()
    graph_module.recompile()
    return graph_module


def _graph_modules(gm: fx.GraphModule) -> list[fx.GraphModule]:
    """``gm`` and every graph module it calls through ``get_attr`` (the bodies of higher-order ops)."""
    found = [gm]
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            sub = getattr(gm, node.target, None)
            if isinstance(sub, fx.GraphModule):
                found += _graph_modules(sub)
    return found


def _output_nodes(graph: fx.Graph) -> set[fx.Node]:
    out = next(reversed(graph.nodes))
    found: set[fx.Node] = set()
    fx.node.map_arg(out.args, found.add)
    return found


# ---------------------------------------------------------------- in-place ops

def _out_of_place(node: fx.Node) -> tuple[str, Any] | None:
    """``(op, target)`` of the out-of-place twin of an in-place node, or None."""
    if node.op == "call_method" and isinstance(node.target, str) and node.target.endswith("_") \
            and not node.target.endswith("__"):
        return "call_method", node.target[:-1]
    if node.op == "call_function" and node.target in _INPLACE_OPERATORS:
        return "call_function", _INPLACE_OPERATORS[node.target]
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) \
            and node.target._schema.is_mutable:
        name = node.target._schema.name.split("::")[-1]
        packet = getattr(aten, name[:-1], None) if name.endswith("_") else None
        twin = getattr(packet, node.target._overloadname, None) if packet is not None else None
        if twin is not None and not twin._schema.is_mutable:
            return "call_function", twin
    return None


def _storage(node: Any) -> StorageWeakRef | None:
    value = node.meta.get("val", node.meta.get("example_value")) if isinstance(node, fx.Node) else None
    if not isinstance(value, torch.Tensor):
        return None
    try:
        return StorageWeakRef(value.untyped_storage())
    except Exception:  # e.g. a tensor subclass without storage
        return None


def functionalize(graph: fx.Graph) -> None:
    """Replace each in-place op on a tensor that nothing else aliases by its out-of-place op.

    A storage qualifies when exactly one node computes it (not a graph input or attribute,
    not a view of another node) and every other node holding it is an in-place op on it:
    then no view can observe the mutations, and reading each op's result wherever the
    tensor is read afterwards is exactly what the mutation did.
    """
    order = {n: i for i, n in enumerate(graph.nodes)}
    groups: dict[StorageWeakRef, list[fx.Node]] = {}
    for node in graph.nodes:
        key = _storage(node)
        if key is not None:
            groups.setdefault(key, []).append(node)
    for members in groups.values():
        root, *mutations = members
        if root.op in ("placeholder", "get_attr") or _out_of_place(root) is not None or not mutations:
            continue
        if any(_out_of_place(n) is None or not n.args or n.args[0] not in members for n in mutations):
            continue
        for node in mutations:  # in program order: each reads the previous one's result
            current = node.args[0]
            node.op, node.target = _out_of_place(node)
            position = order[node]
            current.replace_all_uses_with(node, delete_user_cb=lambda u: order.get(u, -1) > position)
            if isinstance(node.target, torch._ops.OpOverload):
                _refake(node)  # a fresh tensor now


def _refake(node: fx.Node) -> None:
    from torch._guards import detect_fake_mode

    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    tensors = [v for v in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor)]
    fake_mode = detect_fake_mode(tensors)
    if fake_mode is not None:
        with fake_mode:
            node.meta["val"] = node.target(*args, **kwargs)


# ---------------------------------------------------------------- local rewrites

def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else node


def _emit(graph: fx.Graph, target: Any, *args: Any, **kwargs: Any) -> fx.Node:
    new = graph.call_function(target, args, kwargs)
    _refake(new)
    return new


# the rewrites that only remove a spelling's noise (copies, narrow), applied to the whole graph
_STRUCTURAL = (aten.clone.default, aten.contiguous.default, aten.alias.default, aten.lift_fresh.default,
               aten.narrow.default, aten.slice.Tensor)

# the end torch.export writes for a slice to the end of a dim of symbolic size (``x[:, t]`` → slice(x, 0, 0, END))
_SLICE_TO_END = 9223372036854775807


def _rewrite(graph: fx.Graph, node: fx.Node, outputs: set[fx.Node]) -> fx.Node | None:
    """The node that computes what ``node`` computes in the normal form (None: keep ``node``)."""
    target, args = node.target, node.args
    if target in (aten.clone.default, aten.contiguous.default, aten.alias.default, aten.lift_fresh.default):
        if node not in outputs and isinstance(args[0], fx.Node) and _same_layout_free(node):
            return args[0]
        return None
    if target is aten.slice.Tensor and _whole_slice(node):
        return args[0]
    if target is aten.narrow.default and all(isinstance(a, int) for a in args[1:]):
        with graph.inserting_before(node):
            return _emit(graph, aten.slice.Tensor, args[0], args[1], args[2], args[2] + args[3])
    if target in (aten.matmul.default, aten.bmm.default) and len(node.kwargs) == 0:
        a, b = (_val(x) for x in args)
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() >= 2 and b.dim() >= 2 \
                and a.shape[-1] == 1 and b.shape[-2] == 1 and a.dtype == b.dtype:
            with graph.inserting_before(node):
                return _emit(graph, aten.mul.Tensor, args[0], args[1])
        return None
    if target is aten.einsum.default:
        return _einsum_product(graph, node)
    if target is aten.mul.Tensor and len(args) == 2 and args[0] is args[1] and isinstance(args[0], fx.Node):
        with graph.inserting_before(node):
            return _emit(graph, aten.pow.Tensor_Scalar, args[0], 2)
    return None


def _whole_slice(node: fx.Node) -> bool:
    """``slice(x, d, 0, END)`` with step 1: a view of all of ``x`` (``x[:, t]`` leaves one before the select)."""
    args = list(node.args) + [None] * (5 - len(node.args))
    _, _, start, end, step = args[:5]
    start, end, step = node.kwargs.get("start", start), node.kwargs.get("end", end), node.kwargs.get("step", step)
    return start in (None, 0) and end in (None, _SLICE_TO_END) and step in (None, 1)


def _same_layout_free(node: fx.Node) -> bool:
    """A copy whose only effect is memory layout or a fresh buffer (no dtype/device change)."""
    return set(node.kwargs) <= {"memory_format"}


def _einsum_product(graph: fx.Graph, node: fx.Node) -> fx.Node | None:
    """``einsum(eq, [x, y])`` that sums over nothing, as ``x' * y'`` (each operand viewed into place)."""
    equation, operands = node.args[0], node.args[1]
    if not isinstance(equation, str) or "->" not in equation or "." in equation or len(operands) != 2:
        return None
    inputs, output = equation.replace(" ", "").split("->")
    terms = inputs.split(",")
    if len(terms) != 2 or len(set(output)) != len(output):
        return None
    vals = [_val(x) for x in operands]
    if any(not isinstance(v, torch.Tensor) or v.dim() != len(t) for v, t in zip(vals, terms)):
        return None
    if vals[0].dtype != vals[1].dtype:
        return None
    for term in terms:
        if len(set(term)) != len(term) or not set(term) <= set(output):
            return None  # a diagonal or a summed index
    sizes: dict[str, Any] = {}
    for term, v in zip(terms, vals):
        for letter, size in zip(term, v.shape):
            if sizes.setdefault(letter, size) != size:
                return None  # einsum broadcasts no size-1 dims; leave such equations alone
    with graph.inserting_before(node):
        placed = []
        for term, x in zip(terms, operands):
            kept = [letter for letter in output if letter in term]
            permutation = [term.index(letter) for letter in kept]
            if permutation != list(range(len(term))):
                x = _emit(graph, aten.permute.default, x, permutation)
            for i, letter in enumerate(output):
                if letter not in term:
                    x = _emit(graph, aten.unsqueeze.default, x, i)
            placed.append(x)
        return _emit(graph, aten.mul.Tensor, placed[0], placed[1])


# ---------------------------------------------------------------- common subexpressions

def _pure(node: fx.Node) -> bool:
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    if target._schema.is_mutable or torch.Tag.nondeterministic_seeded in target.tags:
        return False
    return not any(r.alias_info is not None and r.alias_info.is_write for r in target._schema.returns)


def _key(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_key(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((k, _key(v)) for k, v in value.items())))
    if isinstance(value, fx.Node):
        return ("node", id(value))
    if isinstance(value, float):  # 2.0 and 2 differ in type promotion; -0.0 and 0.0 in sign
        return ("float", value.hex())
    if isinstance(value, (int, bool, str, type(None), torch.dtype, torch.device, torch.layout,
                          torch.memory_format)):
        return (type(value).__name__, value)
    raise TypeError  # an argument this CSE does not compare: keep the node


def eliminate_common_subexpressions(graph: fx.Graph) -> None:
    """Replace each pure ATen call by an earlier identical call (same op, same inputs and literals)."""
    seen: dict[Any, fx.Node] = {}
    for node in list(graph.nodes):
        if not _pure(node):
            continue
        try:
            key = (node.target, _key(node.args), _key(node.kwargs))
        except TypeError:
            continue
        earlier = seen.setdefault(key, node)
        if earlier is not node:
            node.replace_all_uses_with(earlier)
            graph.erase_node(node)
