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
Gated linear attention stores its state [Dk, Dv] with a decay per key dim, a row each, and reads it across the rows,
o_t = q_t S_t = Σ_a q_t[a] S_t[a, :]: there the read is written as one read per row memory, its query q_t's number
for the row, summed after (`_reads_per_row`; so is a normaliser z [.., Dk] decayed with the rows, read q·z by a
matmul: each row's z_a q_a), and a read of S + X, X made from the step's inputs (RWKV-6's bonus for
the current token, r_t (S_{t−1} + diag(u) k_tᵀ v_t)), as a read of S plus r_t X.
A memory stored [.., Dk, Dv] with a decay per column (per value) is not split, and stays reported as it was.
"""

from __future__ import annotations

import contextlib
import copy
import operator

import torch
from torch import fx
from torch._guards import detect_fake_mode

from hecate.compiler.normalize import emit
from hecate.passes.matching import KEEP, computed_from, is_one

aten = torch.ops.aten


def _emit(graph: fx.Graph, node: fx.Node, split: bool) -> fx.Node:
    """``node`` [.., A, C] split into one memory per row [.., A, 1, C] (or put back together), at the graph's
    insertion point, with its value."""
    return emit(graph, aten.unsqueeze.default if split else aten.squeeze.dim, node, -2)


def per_row(body: fx.GraphModule, state: int, n_carries: int) -> fx.GraphModule:
    """A copy of scan ``body`` that carries its state ``state`` [.., A, C] as one memory per row [.., A, 1, C]."""
    body = copy.deepcopy(body)
    graph = body.graph
    carries = [n for n in graph.nodes if n.op == "placeholder"][:n_carries]
    M_in = carries[state]
    rows = M_in.meta["val"].shape[:-1]
    # a normaliser z [.., A] decayed with the rows (GLA's): its read q·z by a matmul, each row's z_a q_a apart
    for z in carries:
        if z is not M_in and getattr(z.meta.get("val"), "shape", None) == rows:
            _reads_per_row(graph, z, rows + (1,))
    with detect_fake_mode([M_in.meta["val"]]) or contextlib.nullcontext():
        M_in.meta["val"] = M_in.meta["val"].unsqueeze(-2)
    with graph.inserting_before(next(n for n in graph.nodes if n.op != "placeholder")):
        M = _emit(graph, M_in, split=False)
    M_in.replace_all_uses_with(M, delete_user_cb=lambda user: user is not M)
    _reads_per_row(graph, M, M.meta["val"].shape)
    reads_apart(graph, M, state)
    output = graph.output_node()
    outputs = list(output.args[0])
    with graph.inserting_before(output):
        outputs[state] = _emit(graph, outputs[state], split=True)
    output.args = (outputs,) + tuple(output.args[1:])
    body.meta[ROW_GATES] = _row_gates(graph, M, rank=M.meta["val"].dim())
    graph.lint()
    body.recompile()
    return body


def _reads_per_row(graph: fx.Graph, M: fx.Node, shape: torch.Size) -> None:
    """Each read across the memory's rows, y = Σ_a x_a Y[a, :] with Y [.., A, C] (``shape``) the memory or computed
    from it (``einsum("bhk,bhkv->bhv", q, S)``, ``q[.., None, :] @ S``: GLA's read of its state stored [Dk, Dv]),
    written as ``(x[.., :, None] * Y).sum(-2)``: one read per row memory, its query x's number for the row, summed
    after."""
    for node in list(graph.nodes):
        operands = _row_contraction(node, shape)
        if operands is None or not computed_from([operands[1]], {M}) or computed_from([operands[0]], {M}):
            continue
        x, Y = operands
        matmul = node.target is not aten.einsum.default  # x [.., 1, A]: its column against the rows, keeping the 1
        with graph.inserting_before(node):
            column = emit(graph, aten.transpose.int, x, -1, -2) if matmul else emit(graph, aten.unsqueeze.default, x, -1)
            read = emit(graph, aten.sum.dim_IntList, emit(graph, aten.mul.Tensor, column, Y), [-2], matmul)
        read.meta.update({k: v for k, v in node.meta.items() if k != "val"})
        node.replace_all_uses_with(read)
        graph.erase_node(node)


_BILINEAR = (aten.mul.Tensor, aten.matmul.default, aten.bmm.default, aten.einsum.default)


def reads_apart(graph: fx.Graph, M: fx.Node, state: int) -> bool:
    """Each product of a value c with M + X, X made from the step's inputs (RWKV's bonus for the current token:
    r (S + diag(u) kᵀv)), written as c·M + c·X (a product, matmul or einsum of two: linear in each), where the
    new memory (carry ``state``) is made from neither: the read of the memory apart (a read of the new memory, its
    update's terms, stays one read). Whether any was."""
    shape, new_memory, changed = M.meta["val"].shape, graph.output_node().args[0][state], False
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target in _BILINEAR]:
        einsum = node.target is aten.einsum.default
        operands = list(node.args[1]) if einsum else list(node.args)
        if len(operands) != 2 or not all(isinstance(a, fx.Node) for a in operands) or node.kwargs \
                or computed_from([new_memory], {node}):
            continue
        for i in (0, 1):
            c, Y = operands[1 - i], operands[i]
            terms = _terms(Y, M, shape)
            if len(terms) != 2 or computed_from([c], {M}) or computed_from([new_memory], {Y}) \
                    or node.target is not aten.mul.Tensor and _shape(terms[1]) != shape:  # (no broadcast there)
                continue
            with graph.inserting_before(node):
                parts = []
                for term in terms:
                    pair = [c, term] if i == 1 else [term, c]
                    parts.append(emit(graph, node.target, *((node.args[0], pair) if einsum else pair)))
                total = emit(graph, aten.add.Tensor, *parts)
            total.meta.update({k: v for k, v in node.meta.items() if k != "val"})
            node.replace_all_uses_with(total)
            graph.erase_node(node)
            changed = True
            break
    return changed


def _terms(Y: fx.Node, M: fx.Node, shape: torch.Size) -> list[fx.Node]:
    """[A, X] where Y = A + X of ``shape``, A of that shape computed from the memory M, X not; else [Y]."""
    if Y.target is not aten.add.Tensor or Y.kwargs or len(Y.args) != 2 or _shape(Y) != shape \
            or not all(isinstance(t, fx.Node) for t in Y.args):
        return [Y]
    from_memory = [computed_from([t], {M}) for t in Y.args]
    if from_memory.count(True) != 1 or _shape(Y.args[from_memory.index(True)]) != shape:
        return [Y]
    return list(Y.args)


def _shape(node: fx.Node) -> torch.Size | None:
    return getattr(node.meta.get("val"), "shape", None)


def _row_contraction(node: fx.Node, shape: torch.Size) -> tuple[fx.Node, fx.Node] | None:
    """(x, Y) where ``node`` contracts Y of ``shape`` [.., A, C] over its rows A with a vector x [.., A] (an einsum
    of the two, the lead dims kept in order) or a row x [.., 1, A] (a matmul)."""
    if node.target in (aten.matmul.default, aten.bmm.default) and len(node.args) == 2:
        x, Y = node.args
        xv, Yv = (a.meta.get("val") if isinstance(a, fx.Node) else None for a in (x, Y))
        if isinstance(xv, torch.Tensor) and isinstance(Yv, torch.Tensor) and Yv.shape == shape \
                and xv.dim() == Yv.dim() and is_one(xv.shape[-2]) and xv.shape[:-2] == Yv.shape[:-2]:
            return x, Y
        return None
    if node.target is not aten.einsum.default or len(node.args[1]) != 2 or "..." in node.args[0]:
        return None
    ins, out = node.args[0].replace(" ", "").split("->")
    for (xs, ys), (x, Y) in ((ins.split(","), node.args[1]), (ins.split(",")[::-1], node.args[1][::-1])):
        Yv = Y.meta.get("val") if isinstance(Y, fx.Node) else None
        if isinstance(Yv, torch.Tensor) and Yv.shape == shape and len(ys) == len(shape) \
                and xs == ys[:-1] and out == ys[:-2] + ys[-1] and len(set(ys)) == len(ys):
            return x, Y
    return None


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
                or computed_from([node], {M}) or not any(_of_rank(user, rank) for user in node.users):
            continue  # (one that broadcasts against a smaller tensor, b [B, H, 1] of b·v, is no gate of the rows)
        # its leading dims of 1 made explicit: a decay [H, A, 1] read as [1, H, A] against [B, H, A], from the
        # right as it broadcasts (as [H, A] it would read as one per sequence [B, 1, A] where B = H)
        with graph.inserting_before(first if node.op == "placeholder" else node.next), \
                detect_fake_mode([value]) or contextlib.nullcontext():
            gate = graph.call_function(aten.select.int, (node, -1, 0))
            gate.meta["val"] = value.select(-1, 0)
            for _ in range(rank - value.dim()):
                gate.meta[KEEP] = True  # (read by the op's inputs, made from the body after the pass that found it)
                gate = graph.call_function(aten.unsqueeze.default, (gate, 0))
                gate.meta["val"] = gate.args[0].meta["val"].unsqueeze(0)
        gate.meta[KEEP] = True
        gates[node] = gate
    return {node.name: gate.name for node, gate in gates.items()}


def _of_rank(node: fx.Node, rank: int) -> bool:
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and value.dim() == rank


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
