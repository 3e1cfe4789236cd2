"""One normal form for the ATen graph, so that spellings collapse before any pass looks.

Every rewrite here is exact: the rewritten graph computes bit-for-bit what the original
computes (checked in ``tests/compiler/test_normalize.py``), except that an einsum made a
matmul computes the same sums through another BLAS call, which may add them in another order, and a
conv written by hand made a conv1d adds its products in the conv's order. :func:`normalize` puts the
whole graph and the body of every ``scan`` in it in this form:

* :func:`functionalize`: an in-place op on a tensor nothing else aliases (``M.mul_(a)``,
  ``M -= x``, ``M.add_(x, alpha=-1)``) becomes its out-of-place op, later reads of the
  tensor read the result; an in-place op on an input or on a view stays as it is;
* no-op copies dropped: ``clone`` / ``contiguous`` / ``alias`` whose result is not a graph
  output (outputs must not alias each other);
* a slice of an ``unsqueeze`` on another dim is the unsqueeze of the slice (``y.unsqueeze(2)[..., :T]`` →
  ``y[..., :T].unsqueeze(2)``), so a conv's causal slice sits by the conv;
* a reshape or view to the shape it already has (``h.view(B, T, D)`` of an h [B, T, D]) → h;
  ``swapaxes`` / ``swapdims`` / ``movedim`` / ``moveaxis`` → the ``permute`` they are;
* ``x.unbind(d)[t]`` → ``x.select(d, t)`` where it is read (:func:`unbind_as_selects`); the pieces of a tensor
  unpacked along dim 0 (``q, k, v = x``) made together (:func:`unpacked_pieces_together`);
* ``narrow(x, d, s, n)`` → ``slice(x, d, s, s + n)``; a slice of a whole dim (``x[:, t]`` under
  torch.export leaves ``slice(x, 0, 0, END)`` before the select) → ``x``;
* a product with nothing summed is a broadcast multiply: ``matmul``/``bmm`` whose
  contracted dim has size 1 (``g.unsqueeze(-1) @ k.unsqueeze(-2)``) and an ``einsum`` in
  which every index is kept (``einsum("bhv,bhk->bhvk", g, k)``) become ``mul`` of the
  operands unsqueezed/permuted into place (a sum of one product is that product);
* an ``einsum`` of two operands over the same indices (``einsum("bij,bij->b", a, k)``) is their
  product summed over the indices it drops;
* an ``einsum`` that is a tensor times a matrix (``einsum("btd,ed->bte", x, W)``) is that
  ``matmul`` (``x @ W.permute(1, 0)``), in any index layout: with the output's indices in another
  order (``einsum("btd,ed->bet", x, W)``) it is that matmul, then one ``permute`` into the output's order;
* a product with a diagonal matrix, ``X @ torch.diag_embed(d)`` (or ``torch.diag(d)``), is the broadcast multiply
  ``X * d[..., None, :]`` (``diag(d) @ X``: ``d[..., :, None] * X``): the same for finite X, where the matmul's
  zeros times an inf of X would make NaN;
* ``baddbmm(M, a, b, beta=β, alpha=α)``, ``addmm``, ``addr`` → ``β·M + α·(a @ b)`` (``addr``: α·a bᵀ), the
  product then read as above (the same sums, which the fused call may round once fewer);
* ``x.expand_as(y)`` → ``x.expand(y.shape)``: a gate broadcast as the memory does not read the memory;
* a permute sees the smaller tensor: a slice of a ``transpose``/``permute`` is the permute of the
  slice (``y.transpose(1, 2)[:, :T]`` → ``y[..., :T].transpose(1, 2)``), and a permute of a zero
  ``F.pad`` is the pad of the permute (``F.pad(h, (0, 0, K-1, 0)).transpose(1, 2)`` →
  ``F.pad(h.transpose(1, 2), (K-1, 0))``), so a conv's padding and slicing sit next to it;
* a ``conv2d`` over one row with a (1, K) kernel (``F.conv2d(h.unsqueeze(2), w.unsqueeze(2))``)
  is the ``conv1d`` (unsqueezed); ``x.unsqueeze(d).squeeze(d)`` and ``x.unsqueeze(d).select(d, 0)`` → ``x``;
* ``a + (−b)`` → ``a − b`` (a negation written first, ``−kl/κ + mask``, stays: the score's sign is the
  score's); ``x − c`` → ``x + (−c)`` for a number c; ``x + x`` → ``x * 2``;
* ``x * x`` and ``x.square()`` → ``x ** 2`` (ATen computes ``pow(x, 2)`` as ``x * x``), so that CSE merges
  a value written with each;
* a depthwise causal conv written by hand, ``Σ_k w_k · F.pad(h, (K−1, 0))[..., k:k+T]`` or over
  ``unfold(-1, K, 1)``, is ``F.conv1d(F.pad(h, (K−1, 0)), W, groups=D)`` (:func:`hand_written_convs`; the
  same products, summed in the conv's order), and so, between transposes, is one written channels last
  over ``F.pad(h, (0, 0, K−1, 0))``;
* a negated or scaled reshape or transpose is that of the negation or product (``-kl.flatten(0, 1)`` →
  ``(-kl).flatten(0, 1)``, ``kl.view(-1, V) * -0.5`` → ``(kl * -0.5).view(-1, V)``);
* common subexpressions: the same pure op on the same inputs (a sum's or a product's in either
  order) is computed once (so
  ``k[:, t]`` written at every use becomes one node; in Dynamo's graph the slices themselves stay
  apart, each step reading its own, and what is computed from equal slices is computed once).

Dynamo's graph gets the first and the last before loops are rolled up (:func:`collapse_captured`):
there in-place ops are ``call_method`` ``mul_`` / ``operator.isub``, and a step that writes an
expression again at each use would not read as the same step as the last one. It also gets
:func:`float_inputs_as_tensors`: a float attribute Dynamo does not specialise (``dynamic=True``) is read
by arithmetic on its 0-d tensor instead of on a Python float taken out of it at each step, and
Python arithmetic on literals is folded (:func:`fold_scalar_constants`); ``x.unbind(d)[t]`` is
``x.select(d, t)`` where it is read (:func:`unbind_as_selects`); outputs written into every slot of a
fresh tensor once (``out[:, t] = y``) are the stack of what was written (:func:`slot_writes_as_stacks`).
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import math
import operator
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import fx
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.multiprocessing.reductions import StorageWeakRef

from hecate.passes.shifts import shifted_copy
from hecate.passes.matching import (aliases, computed_from, depends_on_sizes_only, eliminate_dead_code, is_pointwise,
                                    mutates, number_of, same_shape, size_hint, written_in_place, zero_pad_amounts,
                                    zero_padded_dims)

aten = torch.ops.aten

# Dynamo's spelling of ``x op= y`` on a tensor and its out-of-place twin
_INPLACE_OPERATORS = {operator.iadd: operator.add, operator.isub: operator.sub, operator.imul: operator.mul,
                      operator.itruediv: operator.truediv}


def normalize(gm: fx.GraphModule) -> fx.GraphModule:
    """Put ``gm`` and the body of every scan in it in the normal form, in place; return it."""
    for graph_module in _graph_modules(gm):
        normalize_graph(graph_module)
    return gm


def normalize_graph(graph_module: fx.GraphModule) -> fx.GraphModule:
    """Rewrite ``graph_module`` (not the graphs it calls) into the normal form, in place; return it."""
    graph = graph_module.graph
    slot_writes_as_stacks(graph)  # (Dynamo's graph had them made stacks before it was traced to ATen)
    functionalize(graph)
    windows_shifted_in_place_as_cats(graph)
    detach_no_grad_results(graph)
    unbind_as_selects(graph)
    softmax_spellings(graph)
    pointwise_before_permutes(graph)
    pairs_after_other_dims(graph)
    outputs = _output_nodes(graph)
    # storages an in-place op still writes (functionalize leaves those a view reads): their copies are copies
    mutated = {_storage(a) for n in graph.nodes if mutates(n) for a in (n, *n.args[:1])} - {None}
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in _COPIES and mutated and (_storage(node) in mutated or _storage(node.args[0]) in mutated):
            continue
        before = node.prev
        replacement = _rewrite(graph, node, outputs)
        if replacement is not None and replacement is not node:
            _keep_source(before, node)
            node.replace_all_uses_with(replacement)
            graph.erase_node(node)
    eliminate_common_subexpressions(graph)
    layout_chains_as_permutes(graph)
    pointwise_before_permutes(graph)  # (again: a no-op .contiguous() after a head split is gone now)
    shifted_copies_as_windows(graph)
    eliminate_dead_code(graph)  # (what the rewrites left unread: a window's reader must be its only one)
    hand_written_convs(graph)  # after CSE: a pad written at each window is one pad
    eliminate_dead_code(graph)
    graph.lint()
    graph_module.recompile()
    return graph_module


def hand_written_convs(graph: fx.Graph) -> None:
    """A depthwise causal conv written by hand is that conv: for h [B, D, T] and P = ``F.pad(h, (K−1, 0))``,

    * ``Σ_k w_k · P[..., k:k+T]`` (w_k per channel, [D, 1]; summed by ``+`` or Python's ``sum``), and
    * ``(P.unfold(-1, K, 1) * w).sum(-1)`` (w [D, 1, K])

    → ``F.conv1d(P, W, b, groups=D)`` with W [D, 1, K] stacked from the w_k, and b a per-channel ``+ b[:, None]``
    right after the sum, if any: the same products (a conv is a cross-correlation, out_t = Σ_k W_k P_{t+k}),
    summed in the conv's order. Channels last, h [B, T, D] padded on time (``F.pad(h, (0, 0, K−1, 0))``,
    windows ``P[:, k:k+T]``, w_k [D]), it is that conv between transposes: ``conv1d(F.pad(hᵀ, (K−1, 0)))ᵀ``."""
    written = {_storage(n.args[0]) for n in graph.nodes if mutates(n) and n.args} - {None}
    for pad in list(graph.find_nodes(op="call_function", target=aten.pad.default)):
        if _storage(pad.args[0]) in written:
            continue  # the conv would pad the tensor where the sum is, after the write (the windows are before)
        shape, padded = getattr(_val(pad), "shape", ()), zero_padded_dims(pad)
        if len(shape) != 3 or padded is None or len(padded) != 1:
            continue
        ((time, (left, right)),) = padded.items()
        if time not in (1, 2) or left < 1 or right != 0:
            continue
        found = _unfolded_conv(pad, left + 1, time) or _windowed_conv(pad, left + 1, time)
        if found is None:
            continue
        out, weights, bias = found
        channels = shape[3 - time]
        (user,) = out.users if len(out.users) == 1 else (None,)
        if bias is None and user is not None and user.target is aten.add.Tensor and not user.kwargs:  # + b[:, None]
            other = user.args[1] if user.args[0] is out else user.args[0]
            if isinstance(other, fx.Node) and _per_channel(other, channels, _val(pad).dtype, 0, time):
                out, bias = user, other
        before = out.prev
        with graph.inserting_before(out):
            weight = weights[0] if len(weights) == 1 else emit(
                graph, aten.stack.default, [emit(graph, aten.reshape.default, w, [channels]) for w in weights], -1)
            weight = emit(graph, aten.reshape.default, weight, [channels, 1, left + 1])
            if bias is not None:
                bias = emit(graph, aten.reshape.default, bias, [channels])
            padded_input = pad if time == 2 else emit(
                graph, aten.pad.default, emit(graph, aten.transpose.int, pad.args[0], 1, 2), [left, 0])
            conv = emit(graph, aten.conv1d.default, padded_input, weight, bias, [1], [0], [1], channels)
            if time == 1:
                conv = emit(graph, aten.transpose.int, conv, 1, 2)
        _keep_source(before, out)  # (the sum's line: a near-miss at the conv points at the user's code)
        out.replace_all_uses_with(conv)


def layout_chains_as_permutes(graph: fx.Graph) -> None:
    """A chain of views and permutes that, in the end, only moves x's dims (heads split, moved, merged back:
    ``u.view(B, T, H, Dh).permute(0, 2, 3, 1).reshape(B, D, T)`` is ``u.transpose(1, 2)``) → ``x.permute(p)``.
    Read off the chain run on a meta tensor of x's sizes (at a second length too where a size is symbolic): a view
    of it (no reshape copied) whose sizes and strides are x's permuted. The chain's inner nodes are read by the
    chain alone."""
    from hecate.passes.gaussian import evaluate
    from hecate.passes.matching import NotFused, shifted_size, size_hint

    layout = (*_RESHAPES, aten.permute.default, aten.transpose.int)
    outputs = _output_nodes(graph)  # (a view the graph returns stays one: its aliasing is the user's)
    for end in list(graph.nodes):
        if end.target not in layout or any(u.target in layout for u in end.users) or end in outputs:
            continue
        chain, x = [end], end.args[0]
        while isinstance(x, fx.Node) and x.target in layout and len(x.users) == 1:
            chain.append(x)
            x = x.args[0]
        value = _val(x)
        if len(chain) < 2 or not any(n.target in _RESHAPES for n in chain) or not isinstance(value, torch.Tensor) \
                or value.dim() != _val(end).dim():
            continue
        sizes = [size_hint] + ([shifted_size] if any(isinstance(d, torch.SymInt) for d in value.shape) else [])
        found = None
        for size in sizes:
            source = torch.empty([size(d) for d in value.shape], dtype=value.dtype, device="meta")
            try:
                got = evaluate(end, {x: source}, size_hint=size)
            except (NotFused, RuntimeError, TypeError, ValueError, IndexError):  # not evaluable: not read so
                found = None
                break
            move = _dims_moved(source, got)
            if move is None or found is not None and found != move:
                found = None
                break
            found = move
        if found is None:
            continue
        if found == list(range(len(found))):
            moved = x  # (the dims back where they were: x itself)
        else:
            with graph.inserting_before(end):
                moved = emit(graph, aten.permute.default, x, found)
            if "stack_trace" in end.meta:
                moved.meta["stack_trace"] = end.meta["stack_trace"]
        end.replace_all_uses_with(moved)
        for node in chain:
            if not node.users:
                graph.erase_node(node)


def pointwise_before_permutes(graph: fx.Graph) -> None:
    """Pointwise ops of a permuted tensor → the ops, then the permute::

        F.silu(h.view(B, T, H, Dh).transpose(1, 2))   →   F.silu(h.view(B, T, H, Dh)).transpose(1, 2)

    so the pointwise functions a chain computes (SiLU, φ after a head split) stay next to what computes their
    input, wherever the user wrote the layout moves. Exact: each element is computed from the same elements.

    The ops moved are the region of pointwise ops that read the permute (:func:`_pointwise_region`), taken only
    where it holds every reader of the permute (a permute also read by a matrix product, a FAVOR+ φ's ``z @ Wᵀ``
    beside its ``z ** 2``, stays where it is, so the chain is not split). Two permutes that undo each other (so
    made or written) are none (``f(x.mT).mT`` is ``f(x)``), but for a view the graph returns (its aliasing is the
    user's).

    It runs before :func:`pairs_after_other_dims`, which moves the permute of a pairwise score up to the beliefs
    (the permutes it leaves there are read by more than pointwise ops, or by its exp alone, which may move), and
    again after the rewrites have dropped the copies that change nothing (``.contiguous()`` after a head split)."""
    outputs = _output_nodes(graph)
    _join_permutes(graph, outputs)
    while _moved_below_pointwise(graph):  # (a permute moved down may meet another: joined, then moved on)
        _join_permutes(graph, outputs)


def _join_permutes(graph: fx.Graph, outputs: set[fx.Node]) -> None:
    """``x.permute(p).permute(q)`` → ``x`` where q undoes p; not for ``outputs``. Others stay two: passes read a
    head split's ``k.transpose(1, 2)`` and then its ``.mT`` as two moves."""
    for node in list(graph.nodes):
        outer, inner_order = _permutation(node), _permutation(node.args[0] if node.args else None)
        if outer is None or inner_order is None or node in outputs \
                or [inner_order[d] for d in outer] != list(range(len(outer))):
            continue
        node.replace_all_uses_with(node.args[0].args[0])
        graph.erase_node(node)


def _moved_below_pointwise(graph: fx.Graph) -> bool:
    """Each permute whose readers are all in its :func:`_pointwise_region` moved below it; whether one was."""
    erased: set[fx.Node] = set()
    for permute in list(graph.nodes):
        order = _permutation(permute)
        if permute in erased or order is None or order == sorted(order) or not permute.users:
            continue
        region = _pointwise_region(permute, order)
        if not region or not set(permute.users) <= set(region):
            continue
        unpermuted: dict[fx.Node, fx.Node] = {}

        def inside(a):
            return unpermuted.get(a, a.args[0] if a not in region and _permutation(a) == order else a)

        for node in region:  # (in graph order: operands first)
            before = node.prev
            with graph.inserting_before(node):
                unpermuted[node] = emit(graph, node.target, *fx.node.map_arg(node.args, inside),
                                        **fx.node.map_arg(node.kwargs, inside))
                readers = [u for u in node.users if u not in region]
                if readers:
                    back = _moved(graph, unpermuted[node], order)
                    for user in readers:
                        user.replace_input_with(node, back)
            _keep_source(before, node)
        for node in reversed(region):
            graph.erase_node(node)
            erased.add(node)
    return bool(erased)


def _pointwise_region(permute: fx.Node, order: list[int]) -> list[fx.Node]:
    """The pointwise ops that read ``permute`` and what they compute together (in graph order): each reads only
    the region, permutes by the same ``order`` of tensors of the permuted tensor's shape, and 0-d tensors or
    numbers; it ends at a node also read outside it. Ops drawing random numbers stay (their draws would land
    elsewhere), and so do clones (a clone of a permute lays it out for a view:
    ``.transpose(1, 2).clone(memory_format=...).view(...)``)."""
    source, rank = permute.args[0], len(order)
    region: set[fx.Node] = set()
    pending = list(permute.users)
    while pending:
        node = pending.pop()
        if node in region or not is_pointwise(node) or torch.Tag.nondeterministic_seeded in node.target.tags \
                or node.target is aten.clone.default or not isinstance(_val(node), torch.Tensor) \
                or _val(node).dim() != rank:
            continue
        operands = [a for a in node.all_input_nodes if isinstance(_val(a), torch.Tensor) and _val(a).dim() > 0]
        if all(a in region or _permutation(a) == order and same_shape(a.args[0], source) for a in operands):
            region.add(node)
            pending.extend(node.users)
    # a node read both inside and outside the region ends it there: moved on, the region's part would read it
    # unpermuted and the rest permuted back, two layouts of one value (a FAVOR+ φ's z ** 2 beside its z @ Wᵀ)
    while (split := next((n for n in region if 0 < len(set(n.users) & region) < len(n.users)), None)) is not None:
        cut, below = set(), [u for u in split.users if u in region]
        while below:
            n = below.pop()
            if n in region and n not in cut:
                cut.add(n)
                below.extend(n.users)
        region -= cut
    position = {n: i for i, n in enumerate(permute.graph.nodes)} if region else {}
    return sorted(region, key=position.__getitem__)


def _moved(graph: fx.Graph, x: fx.Node, order: list[int]) -> fx.Node:
    """``x.permute(order)``, written ``x.transpose(a, b)`` where it swaps two dims (as passes read a swap of the
    pair dims)."""
    swapped = [d for d, o in enumerate(order) if d != o]
    if len(swapped) == 2:
        return emit(graph, aten.transpose.int, x, *swapped)
    return emit(graph, aten.permute.default, x, order)


def _dims_moved(source: torch.Tensor, got: Any) -> list[int] | None:
    """p with ``got`` = ``source.permute(p)``, ``got`` a view of ``source`` (contiguous) read off sizes and strides
    (dims of size 1 in order: moving them moves no element); None if it is none."""
    if not isinstance(got, torch.Tensor) or got._base is not source or got.storage_offset() != 0 \
            or got.dim() != source.dim() or 0 in source.shape:
        return None
    free = list(range(source.dim()))
    move = []
    for size, stride in zip(got.shape, got.stride()):
        j = next((j for j in free if source.shape[j] == size and (size == 1 or source.stride(j) == stride)), None)
        if j is None:
            return None
        free.remove(j)
        move.append(j)
    return move


def windows_shifted_in_place_as_cats(graph: fx.Graph) -> None:
    """A window c [..., K] along a dim d shifted one step and its last slot written in place, however the shift is
    spelt, → ``torch.cat([c[..., 1:], x.unsqueeze(d)], d)`` for what reads it afterwards, as a decode step's window
    is written functionally, which the qk pass reads. The spellings: Mamba's ``causal_conv1d_update`` reference
    (``w = c.clone(); w.copy_(torch.roll(w, -1, d)); w[..., -1] = x``), a rolled copy (``w = c.roll(-1, d)``,
    ``.clone()``), the slots moved by a slice assignment (``w[..., :-1] = w[..., 1:].clone()``); on a tensor made
    here, or on the cache passed in. Recognised by its values: the writes, run on a random c and x in float64,
    leave exactly c shifted with x last. A tensor made here is no longer written; the cache passed in still is,
    where the code writes it, and the window's state is read from a copy taken before the writes."""
    for last in list(graph.find_nodes(op="call_function", target=aten.select.int)):
        if last._erased or len(last.users) != 1:
            continue
        (write,) = last.users
        window = last.args[0]
        shape = tuple(getattr(_val(window), "shape", ()))
        if write.target is not aten.copy_.default or write.args[0] is not last or write.kwargs or len(shape) < 2 \
                or not isinstance(write.args[1], fx.Node) or _val(write.args[1]).shape != _val(last).shape \
                or _val(write.args[1]).dtype != _val(window).dtype or not isinstance(last.args[2], int):
            continue
        dim, size = last.args[1] % len(shape), shape[last.args[1] % len(shape)]
        if last.args[2] != -1 and not statically_known_true(last.args[2] == size - 1) \
                or not statically_known_true(size >= 2):
            continue
        found = _window_shifted_in_place(graph, window, write, dim)
        if found is None:
            continue
        cache, base, writes, read, later = found
        fresh = base is not cache  # (else the cache passed in, still written where the code writes it)
        order = {n: i for i, n in enumerate(graph.nodes)}
        held = _aliases_of(base)
        # what reads the window after this step and before the next step writes it (a loop of steps), other than
        # what the later steps' writes are computed from
        until = min((order[w] for w in later), default=len(order))
        feeding, stack = set(), list(later)
        while stack:  # (what the later writes are computed from)
            n = stack.pop()
            if n not in feeding:
                feeding.add(n)
                stack += n.all_input_nodes
        readers = [u for n in held for u in n.users if order[write] < order[u] < until and u not in feeding
                   and (fresh or u.op != "output" and not aliases(u))]
        after = write.next
        with graph.inserting_before(read):  # (the cache's values as the shift reads them)
            kept = emit(graph, aten.slice.Tensor, cache, dim, 1)
            if not fresh or any(mutates(n) for n in _aliases_of(cache) if n is not cache):
                kept = emit(graph, aten.clone.default, kept)  # (the cache is written: the window keeps its values)
        with graph.inserting_before(after):
            cat = emit(graph, aten.cat.default, [kept, emit(graph, aten.unsqueeze.default, write.args[1], dim)], dim)
        for reader in readers:
            for n in reader.all_input_nodes:
                if n in held and tuple(_val(n).shape) == shape:
                    reader.replace_input_with(n, cat)
        if fresh:
            for node in reversed(writes):
                node.replace_all_uses_with(node.args[0])
                graph.erase_node(node)


def _aliases_of(base: fx.Node) -> set[fx.Node]:
    """``base`` and every node holding its values: its views and the results of in-place ops on them."""
    found, stack = set(), [base]
    while stack:
        n = stack.pop()
        if n not in found:
            found.add(n)
            stack += [u for u in n.users if u.args and u.args[0] is n and (aliases(u) or mutates(u))]
    return found


def _window_shifted_in_place(graph: fx.Graph, window: fx.Node, write: fx.Node,
                             dim: int) -> tuple[fx.Node, fx.Node, list[fx.Node], fx.Node, list[fx.Node]] | None:
    """(the cache c before the step, the tensor written, the step's writes into it in order, the first node
    reading c for the shift, the writes into it after the step: a loop's later steps) when the writes into
    ``window``'s base up to ``write`` (its last slot along ``dim``) leave c shifted one step with ``write``'s value
    last, and nothing else reads the tensor between them (nor, for a tensor made here, a view of it taken before
    them afterwards); None otherwise."""
    base = window
    while base.op == "call_function" and base.args and isinstance(base.args[0], fx.Node) \
            and (aliases(base) or mutates(base)):
        base = base.args[0]
    order = {n: i for i, n in enumerate(graph.nodes)}
    held = _aliases_of(base)
    writes = sorted((n for n in held if n is not base and mutates(n) and n.args[0] in held), key=order.__getitem__)
    if write not in writes:
        return None
    # the step's writes: after the last slot written by the step before (a loop of steps on one cache), up to its own
    at = writes.index(write)
    start = max((i + 1 for i, w in enumerate(writes[:at]) if _writes_last_slot(w, dim)), default=0)
    writes, later = writes[start:at + 1], writes[at + 1:]
    if later and base.op == "call_function" and not (aliases(base) or mutates(base)) \
            and base.target not in _COPIED_OR_ROLLED:
        return None
    chain = [base]  # the tensor written, and what it is copied or rolled from: candidates for the cache
    while chain[-1].op == "call_function" and chain[-1].target in _COPIED_OR_ROLLED \
            and isinstance(chain[-1].args[0], fx.Node):
        chain.append(chain[-1].args[0])
    x = write.args[1]
    for cache in chain[1:] + chain[:1]:  # what it is made from first: a tensor made here is then no longer written
        if tuple(_val(cache).shape) != tuple(_val(base).shape) or computed_from([x], {cache}):
            continue
        # the cache as the step finds it: held whole before the step's first write (an earlier step's copy_ into it)
        found_as = {n for n in held if order[n] < order[writes[0]] and n is not cache and cache is base
                    and tuple(_val(n).shape) == tuple(_val(base).shape)}
        steps, stack = set(), list(writes)  # what the writes read, from the cache on
        while stack:
            n = stack.pop()
            if n not in steps and n is not cache and n is not x and n not in found_as and computed_from([n], {cache}):
                steps.add(n)
                stack += n.all_input_nodes
        steps = sorted(steps, key=order.__getitem__)
        between = [u for n in held for u in n.users if order[writes[0]] < order[u] < order[write] and u not in steps]
        views_read_later = [n for n in held if order[n] < order[write] and n not in steps and n is not base
                            and any(order[u] > order[write] for u in n.users)]
        if between or (cache is not base and (views_read_later or later)) \
                or not _shifts(cache, x, base, steps, dim, found_as):
            continue
        return cache, base, writes, chain[chain.index(cache) - 1] if cache is not base else writes[0], later
    return None


def _writes_last_slot(write: fx.Node, dim: int) -> bool:
    """Whether ``write`` copies into the last slot of a window along ``dim`` (``w[..., -1] = x``)."""
    last = write.args[0] if write.target is aten.copy_.default else None
    if not isinstance(last, fx.Node) or last.target is not aten.select.int:
        return False
    rank, size = _val(last.args[0]).dim(), _val(last.args[0]).shape[last.args[1] % _val(last.args[0]).dim()]
    return last.args[1] % rank == dim and (last.args[2] == -1 or statically_known_true(last.args[2] == size - 1))


_COPIED_OR_ROLLED = {aten.clone.default, aten.roll.default, aten.contiguous.default, aten.alias.default}


def _shifts(cache: fx.Node, x: fx.Node, base: fx.Node, steps: list[fx.Node], dim: int,
            found_as: Iterable[fx.Node] = ()) -> bool:
    """Whether running ``steps`` (in place, as written) on a random float64 cache and x leaves ``base`` equal to
    cat([cache[..., 1:], x.unsqueeze(dim)], dim); ``found_as`` hold the cache itself (its value at the step)."""
    generator = torch.Generator().manual_seed(20261128)
    shape, token_shape = (tuple(size_hint(s) for s in _val(n).shape) for n in (cache, x))  # (symbols: their values)
    drawn = torch.randn(shape, generator=generator, dtype=torch.float64)
    token = torch.randn(token_shape, generator=generator, dtype=torch.float64)
    env = {cache: drawn.clone(), x: token}
    env.update({n: env[cache] for n in found_as})  # (the same tensor: a write into either is into both)

    def value(n):  # (a size node of the graph read as its value now)
        return env[n] if n in env else size_hint(_val(n)) if isinstance(_val(n), torch.SymInt) else env[n]

    try:
        for node in steps:
            if node in env:
                continue
            args = fx.node.map_arg(node.args, value)
            kwargs = fx.node.map_arg(node.kwargs, value)
            env[node] = node.target(*args, **kwargs)
    except Exception:  # noqa: BLE001  (reads something else, or does not run at these values: no shift)
        return False
    expected = torch.cat([drawn.narrow(dim, 1, shape[dim] - 1), token.unsqueeze(dim)], dim)
    return base in env and torch.equal(env[base], expected)


def shifted_copies_as_windows(graph: fx.Graph) -> None:
    """Copies of one u [B, D, T] (or [B, T, D]) shifted in time by s ≥ 0 with zeros in front, each written its own
    way and multiplied by a weight (``F.pad(u[..., :-s], (s, 0))``, ``F.pad(u, (s, 0))[..., :T]``,
    ``torch.cat([zeros, u[:, :-s]], 1)``, ``torch.where(t >= s, torch.roll(u, s, -1), 0)``, u itself for s = 0)
    → the windows ``P[..., S−s:S−s+T]`` of one pad P = ``F.pad(u, (S, 0))``, S the largest shift, which
    :func:`hand_written_convs` reads as the causal conv they are. A copy is recognised by its values: computed from
    one h (u, or h = uᵀ where the normal form moved the slice or pad through u's transpose) and sizes alone, it
    equals u shifted by s at a random h (float64: copies and zeros are exact), at a second length too where the
    length is symbolic, and zeros in front at an h of inf (``torch.roll(u, s) * (t >= s)`` is NaN
    there, 0·inf, so it is no copy)."""
    groups: dict[tuple[fx.Node, bool, int], dict[fx.Node, int]] = {}  # (h, u = hᵀ, time dim) → {copy: s}
    unshifted_copies = []  # (h, u = hᵀ, copy): u itself, along either dim
    for mul in graph.find_nodes(op="call_function", target=aten.mul.Tensor):
        for copy in mul.args:
            found = shifted_copy(copy) if isinstance(copy, fx.Node) else None
            if found is not None and found[2] is None:
                unshifted_copies.append((found[0], found[1], copy))
            elif found is not None:
                groups.setdefault(found[:3], {})[copy] = found[3]
    for h, swapped, copy in unshifted_copies:
        (key, *more) = [key for key in groups if key[:2] == (h, swapped)] or [None]
        if key is not None and not more:
            groups[key][copy] = 0
    for (h, swapped, time), copies in groups.items():
        u = h
        if swapped:  # u = h.transpose(1, 2): the graph's own, which the tap of shift 0 reads, or a new one
            u = next((t for t in h.users if t.target is aten.transpose.int and {d % 3 for d in t.args[1:3]} == {1, 2}),
                     None)
            if u is None:
                with graph.inserting_after(h):
                    u = emit(graph, aten.transpose.int, h, 1, 2)
        unshifted = [m for m in u.users if m.target is aten.mul.Tensor and u in m.args and m not in copies]
        if not _sum_of(copies, unshifted, h):
            continue
        largest = max(copies.values())
        with graph.inserting_after(u):
            pad = emit(graph, aten.pad.default, u, [largest, 0] if time == 2 else [0, 0, largest, 0])
        with graph.inserting_after(pad):
            windows = {s: emit(graph, aten.slice.Tensor, pad, time, largest - s, -s if s else _END)
                       for s in sorted(set(copies.values()) | {0})}
        source = next((c.meta["stack_trace"] for c in copies if c.meta.get("stack_trace")), None)
        for node in [pad, *windows.values()]:
            if source and not node.meta.get("stack_trace"):
                node.meta["stack_trace"] = source
        for copy, s in copies.items():
            copy.replace_all_uses_with(windows[s])
        order = {n: i for i, n in enumerate(graph.nodes)}
        for copy in sorted(copies, key=order.__getitem__, reverse=True):  # (a copy of a copy reads a window)
            if not copy.users:
                graph.erase_node(copy)
        if len(unshifted) == 1:  # u itself, the tap of shift 0
            unshifted[0].replace_input_with(u, windows[0])
        for node in [*windows.values(), pad, u]:
            if not node.users:
                graph.erase_node(node)


def _sum_of(copies: dict[fx.Node, int], unshifted: list[fx.Node], h: fx.Node) -> bool:
    """Whether the weighted copies (and the one product of u itself) are summed by one tree of adds whose other
    terms are not computed from h (a bias, zeros): a conv of their own, not part of a longer sum (the causal half of
    a centred conv's windows)."""
    products = {m for c in copies for m in c.users if m.target is aten.mul.Tensor} | set(unshifted[:1])
    roots, adds = set(), set()
    for node in products:
        while len(node.users) == 1 and (user := next(iter(node.users))).target is aten.add.Tensor:
            adds.add(user)
            node = user
        roots.add(node)
    terms = {a for add in adds for a in add.args if isinstance(a, fx.Node)} - adds - products
    return len(roots) == 1 and not any(computed_from([t], {h}) for t in terms)


_END = 2 ** 63 - 1  # a slice to the end (Python's x[..., s:])


def _per_channel(w: Any, d: int, dtype: torch.dtype, taps: int, time: int) -> bool:
    """``w`` broadcasts over the windows ([B, D, T(, taps)] with time 2, [B, T, D(, taps)] with time 1) as one
    value per channel (and tap): shape [..1, D, 1(, taps)], or [..1, D(, taps)] channels last."""
    val = _val(w)
    want = ((d, 1) if time == 2 else (d,)) + ((taps,) if taps else ())
    return isinstance(val, torch.Tensor) and val.dtype == dtype and tuple(val.shape[-len(want):]) == want \
        and val.dim() <= len(want) + 1 and all(s == 1 for s in val.shape[:-len(want)])


def _other_factor(mul: fx.Node, x: fx.Node) -> Any:
    return mul.args[1] if mul.args[0] is x else mul.args[0]


def _unfolded_conv(pad: fx.Node, taps: int, time: int) -> tuple[fx.Node, list[fx.Node], None] | None:
    """``(P.unfold(time, K, 1) * w).sum(-1)``: (the sum, [w], no bias)."""
    pad_val = _val(pad)
    for unfold in pad.users:
        if unfold.target is not aten.unfold.default or unfold.args[1] % 3 != time \
                or tuple(unfold.args[2:4]) != (taps, 1) or len(unfold.users) != 1:
            continue
        (mul,) = unfold.users
        if mul.target is aten.einsum.default and (found := _taps_by_einsum(mul, unfold, time)) is not None:
            w, taps_first = found  # einsum("bctk,ck->bct", windows, w): w [D, K] (or [K, D], "kc"), each channel's taps
            channels = pad_val.shape[3 - time]
            if taps_first and _per_channel(w, taps, pad_val.dtype, channels, 1):
                with pad.graph.inserting_before(mul):
                    return mul, [emit(pad.graph, aten.transpose.int, w, 0, 1)], None
            if not taps_first and _per_channel(w, channels, pad_val.dtype, taps, 1):
                return mul, [w], None
        if mul.target is not aten.mul.Tensor or len(mul.users) != 1:
            continue
        (total,) = mul.users
        w = _other_factor(mul, unfold)
        if total.target is aten.sum.dim_IntList and [d % 4 for d in total.args[1]] == [3] \
                and not (total.args[2] if len(total.args) > 2 else False) and total.kwargs.get("dtype") is None \
                and _per_channel(w, pad_val.shape[3 - time], pad_val.dtype, taps, time):
            return total, [w], None
    return None


def _taps_by_einsum(node: fx.Node, windows: fx.Node, time: int) -> tuple[fx.Node, bool] | None:
    """(w, whether w is [K, D]) when ``node`` is ``einsum("bctk,ck->bct", windows, w)`` (any letters, w's "ck" or
    "kc"): the windows [B, D, T, K] (or [B, T, D, K] with time 1) weighted by w and summed over the taps."""
    equation, operands = node.args[0], node.args[1]
    if not isinstance(equation, str) or len(operands) != 2 or operands[0] is not windows:
        return None
    inputs, _, output = equation.replace(" ", "").partition("->")
    terms = inputs.split(",")
    if len(terms) != 2 or len(terms[0]) != 4 or len(set(terms[0])) != 4:
        return None
    a, b = terms
    if output != a[:3] or b not in (a[3 - time] + a[3], a[3] + a[3 - time]):
        return None
    return operands[1], b[0] == a[3]


_ZEROS = (aten.zeros_like.default, aten.zeros.default, aten.new_zeros.default)


def _windowed_conv(pad: fx.Node, taps: int, time: int) -> tuple[fx.Node, list[fx.Node], fx.Node | None] | None:
    """``Σ_k w_k · P[..., k:k+T]`` (``P[:, k:k+T]`` with time 1), a per-channel bias it may start from, or zeros
    of its shape nothing else reads (``out = torch.zeros_like(h)``, then ``out = out + …``): (the root of the
    sum, [w_0 .. w_{K−1}], the bias or None)."""
    pad_val = _val(pad)
    length = pad_val.shape[time] - (taps - 1)  # symbolic under dynamic shapes: compared without a guard
    weights: dict[int, Any] = {}  # window start -> its weight
    products: dict[fx.Node, int] = {}  # w_k · window -> k
    for window in pad.users:
        start = (window.args[2] if len(window.args) > 2 else None) or 0
        if window.target is not aten.slice.Tensor or window.args[1] % 3 != time or len(window.users) != 1 \
                or (window.args[4] if len(window.args) > 4 else 1) != 1 or not isinstance(start, int) \
                or not statically_known_true(_val(window).shape[time] == length) or start in weights:
            return None
        (mul,) = window.users
        w = _other_factor(mul, window) if mul.target is aten.mul.Tensor else None
        if w is None or len(mul.users) != 1 or not _per_channel(w, pad_val.shape[3 - time], pad_val.dtype, 0, time):
            return None
        weights[start], products[mul] = w, start
    if sorted(weights) != list(range(taps)):
        return None
    channels = pad_val.shape[3 - time]

    def bias_leaf(x):  # a per-channel tensor the sum starts from (z = b[:, None].expand(-1, T), then z + …)
        x = x.args[0] if isinstance(x, fx.Node) and x.target is aten.expand.default else x
        return isinstance(x, fx.Node) and _per_channel(x, channels, pad_val.dtype, 0, time)

    def zeros_leaf(x, total):  # zeros the sum starts from: the windows' shape and dtype, read by the sum alone
        return isinstance(x, fx.Node) and x.target in _ZEROS and len(x.users) == 1 and same_shape(total, x) \
            and same_shape(next(iter(products)), x) and _val(x).dtype == _val(total).dtype == pad_val.dtype

    # the products summed by a tree of adds and nothing else (a literal 0: Python's sum starts there; zeros;
    # or a bias)
    adds, roots, biases, zeros = set(), set(), set(), set()
    for node in products:
        while len(node.users) == 1:
            (user,) = node.users
            if user.target is not aten.add.Tensor or user.kwargs:
                break
            other = user.args[1] if user.args[0] is node else user.args[0]
            if zeros_leaf(other, user):
                zeros.add(other)
            elif bias_leaf(other):
                biases.add(other)
            elif not (other in products or isinstance(other, fx.Node) and other.target is aten.add.Tensor
                      or not isinstance(other, fx.Node) and other == 0):
                break
            adds.add(user)
            node = user
        roots.add(node)
    if len(roots) != 1 or not adds or len(biases) > 1 or len(zeros) > 1 or any(
            not (arg in products or arg in adds or arg in biases or arg in zeros
                 or not isinstance(arg, fx.Node) and arg == 0)
            for add in adds for arg in add.args):
        return None
    (root,) = roots
    bias = next(iter(biases), None)
    if bias is not None and sum(arg is bias for add in adds for arg in add.args) != 1:
        return None  # the bias added more than once
    if bias is not None and bias.target is aten.expand.default:
        bias = bias.args[0]
    return root, [weights[k] for k in range(taps)], bias


def collapse_captured(gm: fx.GraphModule) -> fx.GraphModule:
    """Dynamo's ``gm`` made functional, with each subexpression computed once.

    Before loops are rolled up: a loop whose steps write an expression again at each use
    has steps that differ at its first or last step (the last step's state has fewer
    readers), which no longer reads as one loop. What changes is changed on a copy, so that
    Dynamo's graph stays as captured for the fallback if the pipeline fails later; a graph
    with nothing to change (the common case) is returned as it is, uncopied. The copy's code
    is generated only if it is run: the pipeline reads its nodes, and code for tens of
    thousands of unrolled nodes takes longer than everything else done here."""
    graph = gm.graph
    if _has_in_place_ops(graph) or _has_captured_spellings(graph) or _slices_to_sink(graph):
        graph = graph.__deepcopy__()  # node metas (fake values) are shared, not copied
        sink_per_step_slices(graph)
        alpha_as_products(graph)
        float_inputs_as_tensors(graph)
        fold_scalar_constants(graph)
        unbind_as_selects(graph)
        unpacked_pieces_together(graph)
        slot_writes_as_stacks(graph)
        out_arguments_as_assignments(graph)
        whole_writes_as_assignments(graph)
        functionalize(graph)
    merges = common_subexpressions(graph, apart=_step_slice)
    if graph is gm.graph:
        if not merges:
            return gm
        graph = graph.__deepcopy__()
        copies = dict(zip(gm.graph.nodes, graph.nodes))  # a copy keeps the order of the nodes
        merges = {copies[node]: copies[earlier] for node, earlier in merges.items()}
    _merge(graph, merges)
    graph.lint()
    collapsed = _LazyGraphModule(gm, graph)
    collapsed.meta.update(gm.meta)
    return collapsed


def _slices_to_sink(graph: fx.Graph) -> list[tuple[fx.Node, fx.Node]]:
    """(slice, its first reader) for each per-step slice taken before another step of its loop has begun
    reading: ``for k_t, v_t in zip(k, v)`` has Dynamo take every ``k[t]`` and ``v[t]`` before the first step.
    Such a slice has, between it and its first reader, the first reader of another slice of the same tensor,
    and each slice of that tensor is read only before the next one is (one step each: not gates split once,
    ``a, e = g[..., 0], g[..., 1]``, and read at every step); then every slice of it is moved."""
    from hecate.compiler.loops import _time_slice

    order = {node: i for i, node in enumerate(graph.nodes)}
    by_source = {}
    for node in graph.nodes:
        if node.users and node.op in ("call_function", "call_method") and (found := _time_slice(node)) is not None:
            by_source.setdefault(found[0], []).append((found[2], node, min(node.users, key=order.__getitem__)))
    moves = []
    for slices in by_source.values():
        slices.sort(key=lambda s: s[0])
        firsts = sorted(order[first] for _, _, first in slices)
        early = any((i := bisect.bisect_right(firsts, order[node])) < len(firsts) and firsts[i] < order[first]
                    for _, node, first in slices)
        one_step_each = all(max(order[u] for u in a[1].users) < order[b[2]] for a, b in zip(slices, slices[1:]))
        if early and one_step_each:
            moves += [(node, first) for _, node, first in slices]
    return moves


def sink_per_step_slices(graph: fx.Graph) -> None:
    """Each per-step slice moved to just before its first reader, so that every step of an unrolled loop
    takes its own slices (a view computes nothing and sees the same values wherever it is taken)."""
    for node, first in _slices_to_sink(graph):
        first.prepend(node)


def _step_slice(node: fx.Node) -> tuple | None:
    """(x, dim, index) when ``node`` reads one index of a tensor x (``k[:, t]``), else None.

    Kept apart by the common subexpressions of Dynamo's graph: merged into the same slice taken before the
    loop (``k[:, 0]`` read for its shape), step 0 would lose its slice and no longer read as the other
    steps. A view computes nothing, so nothing is recomputed."""
    from hecate.compiler.loops import _time_slice

    found = _time_slice(node) if node.op in ("call_function", "call_method") else None
    return None if found is None else found[:3]


def _has_captured_spellings(graph: fx.Graph) -> bool:
    """Whether one of the rewrites of Dynamo's spellings below may have something to do."""
    return any(n.op == "call_method" and n.target == "item" or n.op != "placeholder" and n.target in _UNBINDS
               or n.op == "call_function" and (n.target is operator.setitem or isinstance(n.kwargs.get("out"), fx.Node))
               or n.op == "call_function" and n.target in _SCALAR_ARITHMETIC and not n.all_input_nodes
               for n in graph.nodes) or any(True for _ in _unpacked_apart(graph))


# arithmetic a Python float and a 0-d float64 tensor enter alike (ATen wraps a Python float as one)
_SCALAR_ARITHMETIC = (operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.pow)


_ALPHA_SUMS = ("add", "add_", "sub", "sub_", torch.add, torch.sub)


def alpha_as_products(graph: fx.Graph) -> None:
    """``x.add_(y, alpha=a)`` with a number a computed in the graph (``-self.lr`` under dynamic=True) →
    ``x.add_(y * a)``: the same sum, and a reaches a tensor product, as :func:`float_inputs_as_tensors` reads it."""
    for node in list(graph.nodes):
        alpha = node.kwargs.get("alpha")
        if node.op not in ("call_method", "call_function") or node.target not in _ALPHA_SUMS \
                or not isinstance(alpha, fx.Node) or len(node.args) != 2 or set(node.kwargs) != {"alpha"} \
                or not isinstance(_val(node.args[1]), torch.Tensor):
            continue
        with graph.inserting_before(node):
            scaled = graph.call_function(operator.mul, (node.args[1], alpha))
        scaled.meta["stack_trace"] = node.meta.get("stack_trace")
        scaled.meta["example_value"] = _val(node.args[1]) * _val(alpha)
        node.args, node.kwargs = (node.args[0], scaled), {}


def float_inputs_as_tensors(graph: fx.Graph) -> None:
    """Read an unspecialised float input as the 0-d float64 tensor Dynamo passes it as, not as ``.item()``.

    Under ``dynamic=True`` Dynamo passes a module's float attribute (``self.eta = 0.1``) as a 0-d
    float64 tensor and each use calls ``.item()`` on it: a loop's steps then each read their own
    SymFloat, which neither rolls up nor matches a gate. Exact where every value it reaches is Python
    arithmetic ending in a floating tensor with dims: ATen takes a Python float as a 0-d float64
    tensor, and a tensor with dims sets the result's dtype over either. Elsewhere (an int tensor, a
    0-d tensor, a call such as ``math.sqrt``) the ``.item()`` stays.
    """
    for node in list(graph.nodes):
        if not (node.op == "call_method" and node.target == "item" and len(node.args) == 1 and not node.kwargs):
            continue
        source = node.args[0]
        value = _val(source)
        if not (isinstance(value, torch.Tensor) and value.dim() == 0 and value.dtype == torch.float64):
            continue
        reached = _scalar_arithmetic_reached(node)
        if reached is None:
            continue
        node.replace_all_uses_with(source)
        graph.erase_node(node)
        for scalar in reached:  # now 0-d tensors: their fake values follow
            scalar.meta["example_value"] = scalar.target(*fx.node.map_arg(scalar.args, _val))


def fold_scalar_constants(graph: fx.Graph) -> None:
    """Replace Python arithmetic on literals (``1 - 0.05`` where Dynamo specialised ``self.decay``) by its value.

    Dynamo computes such a value once and every step of a loop reads that node; as a literal in
    each step instead, the steps read alike again. Exact: Python computes the same number."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _SCALAR_ARITHMETIC or node.kwargs \
                or not all(type(a) in (int, float, bool) for a in node.args):
            continue
        value = node.target(*node.args)
        for user in list(node.users):
            user.args, user.kwargs = fx.node.map_aggregate((user.args, user.kwargs),
                                                           lambda a: value if a is node else a)
        graph.erase_node(node)


_UNBINDS = ("unbind", torch.unbind, aten.unbind.int)


def unbind_as_selects(graph: fx.Graph) -> None:
    """``x.unbind(d)[t]`` → ``x.select(d, t)``, made just before its first reader when each piece is read
    in one step of a loop (before the next piece is first read), else where the unbind was.

    ``for k_t in k.unbind(1)`` takes every step's slice before the loop starts; made where each
    step reads it, the slice is inside its step as in ``k[:, t]``, and the steps read alike. Gates
    split once, ``a, e = g.unbind(-1)``, and read at every step stay before the loop.
    Exact: unbind's pieces are those selects (views of x)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        if node.target not in _UNBINDS or node.op not in ("call_function", "call_method") or not node.args:
            continue
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        if not isinstance(dim, int) or len(node.args) > 2 or set(node.kwargs) - {"dim"} \
                or not all(u.target is operator.getitem and isinstance(u.args[1], int) for u in node.users):
            continue
        per_step = _read_step_by_step(sorted((p for p in node.users if p.users), key=lambda p: p.args[1]), order)
        for piece in list(node.users):
            if not piece.users:
                continue
            first_reader = min(piece.users, key=order.__getitem__) if per_step else node.next
            with graph.inserting_before(first_reader):
                select = (graph.call_function(aten.select.int, (node.args[0], dim, piece.args[1]))
                          if isinstance(node.target, torch._ops.OpOverload)
                          else graph.call_method("select", (node.args[0], dim, piece.args[1])))
            select.meta.update(piece.meta)
            piece.replace_all_uses_with(select)
            graph.erase_node(piece)
        if not any(u.users for u in node.users):
            for piece in list(node.users):
                graph.erase_node(piece)
            graph.erase_node(node)


def _read_step_by_step(pieces: list[fx.Node], order: dict[fx.Node, int]) -> bool:
    """Whether the pieces of one tensor (in index order) are read one after the other, each alike, as the steps
    of a loop read theirs (q, k, v = x.unbind(2), then relu(q), relu(k) and v read at every step, are no steps)."""
    return all(max(order[u] for u in a.users) < min(order[u] for u in b.users) for a, b in zip(pieces, pieces[1:])) \
        and len({tuple(sorted(str(u.target) for u in p.users)) for p in pieces}) == 1


def unpacked_pieces_together(graph: fx.Graph) -> None:
    """``q, k, v = x`` (a tensor unpacked along dim 0: Dynamo takes each ``x[i]`` where it is first read) → the
    pieces made together after x, as an unbind's are, unless each step of a loop reads its own piece. Exact:
    the same views, taken earlier from a tensor nothing writes."""
    for node, pieces in list(_unpacked_apart(graph)):
        anchor = node
        for piece in pieces:
            anchor.append(piece)
            anchor = piece


def _unpacked_apart(graph: fx.Graph) -> Iterator[tuple[fx.Node, list[fx.Node]]]:
    """(x, its pieces x[0], .., x[n − 1] in order) for each tensor unpacked along dim 0 whose pieces are made apart
    and not read step by step."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in graph.nodes:
        value = _val(node)
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or not isinstance(value.shape[0], int):
            continue
        pieces = [u for u in node.users if u.target is operator.getitem and isinstance(u.args[1], int)
                  and not isinstance(u.args[1], bool) and u.users]
        n = value.shape[0]
        if len(pieces) != n or sorted(p.args[1] % n for p in pieces) != list(range(n)):
            continue
        pieces.sort(key=lambda p: p.args[1] % n)
        together = [order[p] for p in pieces] == list(range(order[node] + 1, order[node] + 1 + n))
        if not together and not _read_step_by_step(pieces, order) and written_in_place(node) is None:
            yield node, pieces


# calls that make a tensor nothing else holds (its values are never read here: every slot is written)
_FILLED = (torch.zeros, torch.zeros_like, "new_zeros", torch.ones, torch.ones_like, "new_ones", torch.full,
           torch.full_like, "new_full",  # fresh tensors of known values, as Dynamo and (below) torch.export write them
           aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default, aten.ones.default,
           aten.ones_like.default, aten.new_ones.default, aten.full.default, aten.full_like.default,
           aten.new_full.default)
_FRESH = (torch.empty, torch.empty_like, "new_empty", aten.empty.memory_format, aten.empty_like.default,
          aten.new_empty.default) + _FILLED
# methods whose result, taken of a fresh tensor nothing else reads, is fresh too (it is that tensor, or a copy):
# ``torch.zeros(B, T, D).to(v)``, as reference code allocates outputs
_STILL_FRESH = ("to", "type_as", "float", "double", "half", "bfloat16", "contiguous", "clone", "cpu", "cuda")


def _fresh(node: fx.Node) -> bool:
    """Whether ``node`` makes a tensor nothing else holds: a fresh allocation, or a cast or copy of one read by
    nothing else."""
    if node.op in ("call_function", "call_method") and node.target in _FRESH:
        return not node.kwargs.get("requires_grad")
    return node.op == "call_method" and node.target in _STILL_FRESH and isinstance(node.args[0], fx.Node) \
        and len(node.args[0].users) == 1 and _fresh(node.args[0])


def slot_writes_as_stacks(graph: fx.Graph) -> None:
    """``out = torch.empty(B, T, D)`` (or zeros, ones, a fill, or a buffer the caller passes in, in a call that
    records no gradients: written back once), then ``out[:, t] = y_t`` (or ``out[:, t].copy_(y_t)``) for
    every t → ``out = torch.stack([y_0, .., y_{T−1}], 1)``, made where out is first read (slots of width 1,
    ``out[:, t:t + 1] = y_t``, → ``torch.cat``).

    Exact where: out is made fresh, each of its T slots along one dim is written exactly once (or, where out
    is made of known values, at most once: a slot left unwritten, as a loop over ``range(1, T)`` leaves slot 0, is
    read from out), by a value of the slot's shape, dtype and device (no broadcast, no cast), out is read
    only after the last write, no y_t is written to afterwards, and grad mode and autocast stay
    as they are throughout. Then out holds the y_t, and stack makes the same values (and gradients); a loop's
    steps then no longer write into one tensor, and collect their outputs as a loop rolled up does."""
    from hecate.compiler.loops import _getitem_slices, _time_slice
    from torch.fx.experimental.symbolic_shapes import is_concrete_int

    grad = torch.is_grad_enabled()
    for out in [n for n in graph.nodes if _fresh(n) and not (len(n.users) == 1 and _fresh(next(iter(n.users))))
                or n.op == "placeholder"]:
        order = {n: i for i, n in enumerate(graph.nodes)}  # (again for each: a rewrite before adds nodes)
        value = _val(out)
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or out.op == "placeholder" and (grad or any(
                n is not out and n.op == "placeholder" and _same_storage(n, out) for n in graph.nodes)):
            continue  # (a caller's buffer written where gradients are recorded would record them, or another input
            # sees its writes: left as written)
        written_back = out.op == "placeholder"  # the caller's buffer: its values written back once after the stack
        writes, slots, kept = [], {}, set()  # the nodes that write (and the views they write into), slot -> value
        for user in out.users:  # written, whether each slot keeps its dim
            if user.op == "call_function" and user.target is operator.setitem and user.args[0] is out \
                    and len(user.args) == 3 and not user.users:
                readings = _getitem_slices(out, value.dim(), user.args[1])  # one slot: one integer index
                where, y = readings[0] if len(readings) == 1 else None, user.args[2]
                written = [user]
            elif _time_slice(user) is not None and len(user.users) == 1:
                (copy,) = user.users
                if not ((copy.op, copy.target) in (("call_method", "copy_"), ("call_function", aten.copy_.default))
                        and copy.args[0] is user and len(copy.args) == 2 and not copy.kwargs and not copy.users):
                    continue
                where, y, written = _time_slice(user), copy.args[1], [user, copy]
            else:
                continue
            y_value = _val(y)
            if where is None or where[3] not in (None, ("keep",)) or not isinstance(y_value, torch.Tensor) \
                    or (where[1], where[2]) in slots or y_value.dtype != value.dtype or y_value.device != value.device \
                    or tuple(y_value.shape) != tuple(value.shape[:where[1]] + ((1,) if where[3] else ())
                                                     + value.shape[where[1] + 1:]):
                continue
            slots[(where[1], where[2])] = y
            kept.add(where[3] is not None)
            writes += written
        dims = {dim for dim, _ in slots}
        if len(dims) != 1 or len(kept) != 1:
            continue
        (dim,), (keep,) = dims, kept  # keep: slots of width 1, out[:, t:t + 1] = y, joined by cat
        size = value.shape[dim]
        last_slot = max(t for _, t in slots)
        # a symbolic size (dynamic=True: the buffer zeros_like(v), the loop over k.shape[1], specialised): the
        # slots up to the last one written are stacked, the rest read from out as it was made, as long as it is
        every = {(dim, t) for t in range(int(size) if is_concrete_int(size) else last_slot + 1)}
        if not set(slots) <= every or set(slots) != every and not (_filled(out) or written_back):
            continue
        last = max(order[w] for w in writes)
        readers = [u for u in out.users if u not in writes]
        if any(order[r] < last for r in readers) or _written_after(graph, list(slots.values()), order, order[out]) \
                or any(n.target in _MODE_CHANGES for n in graph.nodes if order[out] < order[n] < last):
            continue
        first_reader = min(readers, key=order.__getitem__, default=next(iter(reversed(graph.nodes))))
        unwritten = []  # the slots left as made (zeros, a fill), read from out (not from a step's value: a loop's own)
        aten_graph = "val" in out.meta  # (torch.export's graph: ATen calls, fake values as ``val``)
        key = "val" if aten_graph else "example_value"
        with graph.inserting_before(first_reader):
            for t in range(len(every)):
                if (dim, t) not in slots:
                    slot = ((aten.narrow.default if aten_graph else torch.narrow, (out, dim, t, 1)) if keep
                            else (aten.select.int if aten_graph else torch.select, (out, dim, t)))
                    slots[(dim, t)] = graph.call_function(*slot)
                    slots[(dim, t)].meta[key] = slot[0](_val(out), *slot[1][1:])
                    unwritten.append(slots[(dim, t)])
            join = (aten.cat.default if keep else aten.stack.default) if aten_graph else torch.cat if keep \
                else torch.stack
            stack = graph.call_function(join, ([slots[(dim, t)] for t in range(len(every))], dim))
            if not is_concrete_int(size):
                stack.meta[key] = join([_val(slots[(dim, t)]) for t in range(len(every))], dim)
                unwritten += _with_the_rest_of(graph, out, dim, len(every), stack, aten_graph)
                stack = unwritten[-1]
        stack.meta.update(out.meta)
        out.replace_all_uses_with(stack, delete_user_cb=lambda u: u not in writes and u not in unwritten
                                  and not (written_back and u.op == "output"))  # (a buffer returned is itself)
        for node in sorted(writes, key=order.__getitem__, reverse=True):
            graph.erase_node(node)
        if written_back:
            with graph.inserting_before(graph.output_node()):
                write = graph.call_method("copy_", (out, stack))
            write.meta.update({"example_value": value, WRITTEN_BACK: True})
            continue
        while out is not None and not out.users:  # the allocation, and what it was cast or copied from
            source = out.args[0] if out.op == "call_method" and out.target in _STILL_FRESH else None
            graph.erase_node(out)
            out = source if isinstance(source, fx.Node) and not source.users else None


def _with_the_rest_of(graph: fx.Graph, out: fx.Node, dim: int, n: int, stack: fx.Node,
                      aten_graph: bool) -> list[fx.Node]:
    """The nodes of ``cat([stack, out.narrow(dim, n, out.size(dim) − n)], dim)``: the first n slots stacked, the
    rest as ``out`` was made (none where its symbolic size is n); ATen calls in ``aten_graph`` (torch.export's)."""
    value = _val(out)  # (its fake values computed as the graph's are, by the fake tensors' own mode)

    def call(aten_op: Any, dynamo_op: Any, args: tuple) -> fx.Node:  # (Dynamo's graph: a method by its name)
        if aten_graph:
            return graph.call_function(aten_op, args)
        return graph.call_method(dynamo_op, args) if isinstance(dynamo_op, str) else graph.call_function(dynamo_op,
                                                                                                         args)
    size = call(aten.sym_size.int, "size", (out, dim))
    rest = graph.call_function(operator.sub, (size, n))
    tail = call(aten.narrow.default, "narrow", (out, dim, n, rest))
    whole = call(aten.cat.default, torch.cat, ([stack, tail], dim))
    key = "val" if aten_graph else "example_value"
    size.meta[key] = value.size(dim)
    rest.meta[key] = size.meta[key] - n
    tail.meta[key] = value.narrow(dim, n, rest.meta[key])
    whole.meta[key] = torch.cat([_val(stack), tail.meta[key]], dim)
    return [size, rest, tail, whole]


def _filled(node: fx.Node) -> bool:
    """Whether ``node`` (fresh, :func:`_fresh`) is made of known values (zeros, ones, a fill), or is a cast or
    copy of such a tensor."""
    while node.op == "call_method" and node.target in _STILL_FRESH:
        node = node.args[0]
    return node.target in _FILLED


def _written_after(graph: fx.Graph, values: list[fx.Node], order: dict[fx.Node, int], start: int) -> bool:
    """Whether a node after position ``start`` writes into the storage of one of ``values``."""
    storages = {_storage(v) for v in values} - {None}
    return any(order[n] > start and mutates(n) and n.args and _storage(n.args[0]) in storages for n in graph.nodes)


def _scalar_arithmetic_reached(item: fx.Node) -> list[fx.Node] | None:
    """The scalar arithmetic nodes computed from ``item``, in graph order, if all of its values end in
    floating tensors with dims (see :func:`float_inputs_as_tensors`); else None."""
    reached, pending = [], [item]
    while pending:
        for user in pending.pop().users:
            if user in reached:
                continue
            if user.op != "call_function" or user.target not in _SCALAR_ARITHMETIC or user.kwargs:
                return None
            value = _val(user)
            if isinstance(value, torch.Tensor):
                others = [_val(a) for a in user.args if isinstance(a, fx.Node) and isinstance(_val(a), torch.Tensor)]
                if not (value.dtype.is_floating_point and value.dim() >= 1
                        and any(o.dim() >= 1 and o.dtype == value.dtype for o in others)):
                    return None
            elif isinstance(value, (float, torch.SymFloat)):
                reached.append(user)
                pending.append(user)
            else:
                return None
    position = {n: i for i, n in enumerate(item.graph.nodes)}
    return sorted(reached, key=position.__getitem__)


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
    out = next(iter(reversed(graph.nodes)))
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
        # the overload that takes the same arguments: not always of the same name (pow_.Scalar raises a tensor
        # to a number, pow.Scalar a number to a tensor: its twin is pow.Tensor_Scalar)
        arguments = [str(a.type) for a in node.target._schema.arguments]
        names = [node.target._overloadname] + (packet.overloads() if packet is not None else [])
        for overload in names:
            twin = getattr(packet, overload, None) if packet is not None else None
            if twin is not None and not twin._schema.is_mutable \
                    and [str(a.type) for a in twin._schema.arguments] == arguments:
                return "call_function", twin
    return None


# in-place ops whose out-of-place twin is missing (x.fill, x.copy) or has no derivative (aten.copy)
_NO_TWIN = {"fill", "copy", "zero", "set", "resize", "resize_as", "fill_diagonal"}


def _assignment(node: fx.Node) -> bool:
    """``x.copy_(y)`` with y of x's shape, dtype and device (as Dynamo writes ``x.addcmul_(a, b, value=c)``: an
    ``fma`` copied into x): what x holds after it is y's values, which a clone of y holds too (and its gradient
    flows to y, as the copy's does)."""
    if not (node.op == "call_method" and node.target == "copy_" or node.target is aten.copy_.default) \
            or len(node.args) != 2 or node.kwargs.get("non_blocking"):
        return False
    dst, src = (_val(a) if isinstance(a, fx.Node) else None for a in node.args)
    return isinstance(dst, torch.Tensor) and isinstance(src, torch.Tensor) and dst.shape == src.shape \
        and dst.dtype == src.dtype and dst.device == src.device


def _same_as_out_of_place(node: fx.Node) -> bool:
    """Whether ``node``'s out-of-place twin exists, is differentiable and computes what the write stores: an
    in-place op keeps its tensor's dtype, the out-of-place one promotes it (``y.add_(w64)`` of a float32 y)."""
    if _assignment(node):
        return True
    op, target = _out_of_place(node)
    name = target if isinstance(target, str) else getattr(target, "__name__", "").split(".")[0]
    if name in _NO_TWIN or op == "call_method" and not hasattr(torch.Tensor, target):
        return False
    kept = _val(node.args[0]) if node.args and isinstance(node.args[0], fx.Node) else None
    if not isinstance(kept, torch.Tensor):
        return False
    for arg in list(node.args[1:]) + list(node.kwargs.values()):
        value = _val(arg) if isinstance(arg, fx.Node) else arg
        if isinstance(value, torch.Tensor) and value.dtype != kept.dtype and (
                torch.promote_types(kept.dtype, value.dtype) != kept.dtype if value.dim() > 0
                else value.dtype.is_floating_point != kept.dtype.is_floating_point):
            return False  # a wider tensor with dims, or a 0-d one of another kind, promotes the result (a bool
            # mask does not)
        if isinstance(value, float) and not kept.dtype.is_floating_point:
            return False
    return True


def _storage(node: Any) -> StorageWeakRef | None:
    value = _val(node) if isinstance(node, fx.Node) else None
    if not isinstance(value, torch.Tensor):
        return None
    try:
        return StorageWeakRef(value.untyped_storage())
    except Exception:  # e.g. a tensor subclass without storage
        return None


def out_arguments_as_assignments(graph: fx.Graph) -> None:
    """``torch.add(M, u, out=M)`` → ``M.copy_(torch.add(M, u))``: the result computed, then copied into ``out``
    (an assignment :func:`functionalize` reads). Exact where the result has out's shape, dtype and device (no
    resize, no cast). (Where an argument requires a gradient eager refuses ``out=``, and Dynamo captures no graph.)"""
    for node in list(graph.nodes):
        out = node.kwargs.get("out") if node.op == "call_function" else None
        if not isinstance(out, fx.Node) or not isinstance(_val(out), torch.Tensor):
            continue
        kwargs = {key: value for key, value in node.kwargs.items() if key != "out"}
        fakes = fx.node.map_arg((node.args, kwargs), _val)
        try:  # (in the mode of out's own fake value: Dynamo's, which the tracing context's may not be)
            with getattr(_val(out), "fake_mode", None) or contextlib.nullcontext():
                value = node.target(*fakes[0], **fakes[1])
        except Exception:  # noqa: BLE001  (not a call its fake values run: left as written)
            continue
        if not isinstance(value, torch.Tensor) or value.shape != _val(out).shape or value.dtype != _val(out).dtype \
                or value.device != _val(out).device:
            continue
        with graph.inserting_before(node):
            result = graph.call_function(node.target, node.args, kwargs)
        result.meta["example_value"] = value
        node.op, node.target, node.args, node.kwargs = "call_method", "copy_", (out, result), {}


def whole_writes_as_assignments(graph: fx.Graph) -> None:
    """A write into all of x through a view, ``x[:] = y``, ``x[...].copy_(y)``, ``x.view(B * H, D, D).copy_(y)``
    → ``x.copy_(y')`` with y' y laid out as x (``y.reshape_as(x)`` for a view that reshapes), which
    :func:`functionalize` reads as an assignment: x holds y' from there on.

    Exact where the view is x's every element once, in x's order (the same sizes and strides, or both
    contiguous: a reshape), y has the view's shape, dtype and device (no broadcast, no cast), and nothing else
    reads the view or the write's result."""
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is operator.setitem and len(node.args) == 3 \
                and not node.users and isinstance(node.args[0], fx.Node) and _whole_index(node.args[1]):
            x, view, y = node.args[0], node.args[0], node.args[2]
        elif (node.op == "call_method" and node.target == "copy_" or node.target is aten.copy_.default) \
                and len(node.args) == 2 and not node.kwargs and not node.users \
                and isinstance(node.args[0], fx.Node) and node.args[0].op in ("call_function", "call_method") \
                and node.args[0].args and isinstance(node.args[0].args[0], fx.Node) and len(node.args[0].users) == 1:
            view, y = node.args
            x = view.args[0]
        else:
            continue
        x_value, view_value, y_value = _val(x), _val(view), _val(y)
        if not all(isinstance(v, torch.Tensor) for v in (x_value, view_value, y_value)) \
                or not _same_storage(view, x) or y_value.shape != view_value.shape \
                or y_value.dtype != x_value.dtype or y_value.device != x_value.device:
            continue
        as_laid_out = view_value.shape == x_value.shape and view_value.stride() == x_value.stride()
        if view_value.storage_offset() != x_value.storage_offset() or not (as_laid_out or (
                view_value.numel() == x_value.numel() and view_value.is_contiguous() and x_value.is_contiguous())):
            continue
        with graph.inserting_before(node):
            if not as_laid_out and _reshaped_from(y, x_value.shape) is not None:
                y = _reshaped_from(y, x_value.shape)  # new.reshape(B * H, D, D) written into M.view(B * H, D, D)
            elif not as_laid_out:
                y = graph.call_method("reshape_as", (y, x))
                y.meta["example_value"] = y_value.reshape(x_value.shape)
            write = graph.call_method("copy_", (x, y))
        write.meta["example_value"] = x_value
        graph.erase_node(node)
        if view is not x and not view.users:
            graph.erase_node(view)


# Dynamo's spellings of a reshape (ATen's: _RESHAPES)
_CAPTURED_RESHAPES = ("view", "reshape", "view_as", "reshape_as", "flatten", "unflatten", torch.reshape,
                      torch.flatten, torch.unflatten)


def _reshaped_from(node: fx.Node, shape: torch.Size) -> fx.Node | None:
    """z where ``node`` reshapes a z of ``shape`` (its elements in the same order: reshaped back, it is z)."""
    source = node.args[0] if node.op in ("call_method", "call_function") and node.target in _CAPTURED_RESHAPES \
        and node.args and isinstance(node.args[0], fx.Node) else None
    value = _val(source) if source is not None else None
    return source if isinstance(value, torch.Tensor) and value.shape == shape else None


def _whole_index(index: Any) -> bool:
    """Whether ``x[index]`` is all of x as it is laid out: ``x[:]``, ``x[...]``, ``x[:, :]``."""
    parts = index if isinstance(index, tuple) else (index,)
    return sum(p is Ellipsis for p in parts) <= 1 and all(
        p is Ellipsis or isinstance(p, slice) and p == slice(None) for p in parts)


def _same_storage(a: fx.Node, b: fx.Node) -> bool:
    """Whether ``a`` and ``b`` hold tensors of one storage (not where either holds none: a size, a number)."""
    first, second = _storage(a), _storage(b)
    return first is not None and second is not None and first == second


def _has_in_place_ops(graph: fx.Graph) -> bool:
    return any(_out_of_place(n) is not None for n in graph.nodes)


def functionalize(graph: fx.Graph) -> bool:
    """Replace each in-place op on a tensor that nothing else aliases by its out-of-place op;
    return whether any was replaced.

    A storage qualifies when exactly one node computes it (not a graph input or attribute,
    not a view of another node) and every other node holding it is an in-place op on it:
    then no view can observe the mutations, and reading each op's result wherever the
    tensor is read afterwards is exactly what the mutation did.

    An input written in place (a module's buffer, ``self.M.mul_(a).add_(u)`` at every step) qualifies
    too where it requires no gradient, is not returned and nothing else holds its storage: its ops
    are made out of place and the last value copied into it where the graph returns, as the writes left it.
    """
    if not _has_in_place_ops(graph):  # most graphs: no need to group every node by its storage
        return False
    order = {n: i for i, n in enumerate(graph.nodes)}
    grad_enabled = _grad_modes(graph)
    changed = False
    groups: dict[StorageWeakRef, list[fx.Node]] = {}
    returned = set(graph.output_node().all_input_nodes)
    for node in graph.nodes:
        key = _storage(node)
        if key is not None:
            groups.setdefault(key, []).append(node)
    for members in groups.values():
        root, *mutations = members
        if root.op == "get_attr" or _out_of_place(root) is not None or not mutations \
                or all(n.meta.get(WRITTEN_BACK) for n in mutations):
            continue
        written_back = root.op == "placeholder"  # an input (a module's buffer) written in place: written back
        if written_back and (_val(root).requires_grad and torch.is_grad_enabled() or any(
                n in returned for n in members) or any(
                _out_of_place(n) is None or not n.args or n.args[0] not in members for n in mutations)):
            continue  # (an input returned is returned as itself, which a copy is not; a write into an input that
            # requires a gradient is recorded by autograd, unless the graph is compiled to run without gradients)
        if any(_out_of_place(n) is None or not n.args or n.args[0] not in members for n in mutations):
            mutations = _mutation_of_a_view(members, order) or _views_after_the_writes(members, order)
            if not mutations:
                continue
        if not all(_same_as_out_of_place(n) and grad_enabled[n] for n in mutations):
            continue  # (a write under no_grad keeps the tensor's gradient, which its out-of-place twin would not)
        changed = True
        for node in mutations:  # in program order: each reads the previous one's result
            current = node.args[0]
            if _assignment(node):  # x.copy_(y): x is y's values from here on, a tensor of its own
                node.op, node.target = ("call_function", aten.clone.default) if isinstance(
                    node.target, torch._ops.OpOverload) else ("call_method", "clone")
                node.args, node.kwargs = (node.args[1],), {}
            else:
                node.op, node.target = _out_of_place(node)
            position = order[node]
            current.replace_all_uses_with(node, delete_user_cb=lambda u: order.get(u, -1) > position)
            if isinstance(node.target, torch._ops.OpOverload):
                _refake(node)  # a fresh tensor now
        if written_back:  # the input holds the last value when the graph returns, as it did
            with graph.inserting_before(graph.output_node()):
                last = mutations[-1]
                write = graph.call_function(aten.copy_.default, (root, last)) \
                    if isinstance(last.target, torch._ops.OpOverload) else graph.call_method("copy_", (root, last))
            write.meta.update({key: root.meta[key] for key in ("val", "example_value") if key in root.meta},
                              **{WRITTEN_BACK: True})
    return changed


WRITTEN_BACK = "hecate_written_back"  # the meta key of an input's write-back (:func:`functionalize`)


def _mutation_of_a_view(members: list[fx.Node], order: dict[fx.Node, int]) -> list[fx.Node]:
    """[m] when the one in-place op m of a storage writes a view X of a fresh tensor (``F.silu(h.mT, inplace=True)``)
    and nothing reads the tensor or its views after m but through X: then m's result wherever X is read later
    is what the mutation did. Else []."""
    mutations = [n for n in members[1:] if _out_of_place(n) is not None]
    if len(mutations) != 1 or not mutations[0].args or mutations[0].args[0] not in members:
        return []
    (m,), x = mutations, mutations[0].args[0]
    of_result = {m}  # m's result and views of it: what reads the mutated values as m's result
    for n in members:
        if n is not m and n is not members[0] and not _view_of(n, members):
            return []  # another writer, or an alias that is not a view
        if n.args and (n.args[0] in of_result or n.args[0] is x and order[n] > order[m]):
            of_result.add(n)  # (a view of X taken after m: it reads m's result once m is out of place)
        elif n is not x and n is not m and any(order[u] > order[m] for u in n.users):
            return []  # read after the mutation other than through X
    return [m]


def _views_after_the_writes(members: list[fx.Node], order: dict[fx.Node, int]) -> list[fx.Node]:
    """The in-place ops of a fresh tensor's storage when every other node holding it is a view taken after the
    last of them (``M = M.clone(); M.mul_(a); M.addcmul_(v, k); M.transpose(-1, -2)``): each view then reads
    the last op's result, which it still does once the ops are out of place. Else []."""
    writes = [n for n in members[1:] if _out_of_place(n) is not None]
    if not writes or any(not n.args or n.args[0] not in members or n.target is aten.detach_.default for n in writes):
        return []  # (torch.tensor(c)'s detach_ writes no value: it stays, as the constant it marks)
    last = max(order[n] for n in writes)
    for n in members[1:]:  # what else holds the storage is an alias of it: a view
        if n not in writes and not (n.op in ("call_function", "call_method") and order[n] > last):
            return []
    return writes


def _view_of(node: fx.Node, members: list[fx.Node]) -> bool:
    """Whether ``node`` is a view of one of ``members`` that writes nothing (:func:`aliases`)."""
    return node.op in ("call_function", "call_method") and bool(node.args) and node.args[0] in members \
        and not mutates(node) and aliases(node)


def _refake(node: fx.Node) -> None:
    from torch._guards import detect_fake_mode

    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    tensors = [v for v in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor)]
    fake_mode = detect_fake_mode(tensors)
    if fake_mode is None:
        return
    with fake_mode:
        if node.target is aten.pad.default and isinstance(args[0], torch.Tensor):
            # pad's decomposition would fix every symbolic size of its input (a guard per size); its value is
            # the input's, each dim widened by its amounts (F.pad's pairs run from the last dim back)
            shape = list(args[0].shape)
            for i, (before, after) in enumerate(zip(args[1][::2], args[1][1::2])):
                shape[-1 - i] = shape[-1 - i] + before + after
            node.meta["val"] = args[0].new_empty(shape)
        else:
            node.meta["val"] = node.target(*args, **kwargs)


# ---------------------------------------------------------------- local rewrites

def pairs_after_other_dims(graph: fx.Graph) -> None:
    """A pairwise score built with other dims after its pair dims, then permuted to put the pairs last::

        kl = 0.5 * f(mu.unsqueeze(2), mu.unsqueeze(1), ...).sum(-1)   # [B, i, j, H] from beliefs [B, T, H, K]
        kl.permute(0, 3, 1, 2)                                         # [B, H, i, j]

    is computed in the permuted layout from the start: the permute is moved up through the pointwise ops and
    the sums over the last dim (features) to the operands, so the score is built [B, H, i, j, K] and summed to
    [B, H, i, j] itself. Exact: a pointwise op computes each element from the same elements of its operands in
    any layout, and the sum adds the same features."""
    for user in list(graph.nodes):
        order = _permutation(user)
        x = user.args[0] if order is not None else None
        if order is None or len(order) < 3 or not order[-2] < order[-1] < len(order) - 1 or not isinstance(x, fx.Node):
            continue  # (only pair dims with other dims after them, moved last in their order)
        cone = _pointwise_cone(x, len(order))
        if x not in cone or not any(_pair_at(n, order[-2], order[-1]) for n in cone):
            continue
        before, done = user.prev, {}
        with graph.inserting_before(user):
            moved = _permuted(graph, x, order, cone, done)
        _keep_source(before, user)
        user.replace_all_uses_with(moved)


def _pointwise_cone(x: fx.Node, rank: int) -> set[fx.Node]:
    """``x`` and what it is computed by through pointwise ops (of ``rank`` dims, or one more under a sum over the
    last dim), and sums over the last dim (``rank + 1`` dims summed to ``rank``), up to their other operands."""
    cone, todo = set(), [(x, rank)]
    while todo:
        n, r = todo.pop()
        value = _val(n)
        if n in cone or n.op != "call_function" or not isinstance(value, torch.Tensor) or value.dim() != r:
            continue
        if _sums_last_dim(n):
            cone.add(n)
            todo.append((n.args[0], r + 1))
        elif is_pointwise(n):
            cone.add(n)
            todo.extend((a, r) for a in n.all_input_nodes)
    return cone


def _sums_last_dim(n: fx.Node) -> bool:
    """``x.sum(-1)`` (not keeping the dim)."""
    if n.target is not aten.sum.dim_IntList or n.kwargs or not isinstance(_val(n.args[0]), torch.Tensor):
        return False
    rank = _val(n.args[0]).dim()
    return list(n.args[1]) in ([rank - 1], [-1]) and not (len(n.args) > 2 and n.args[2]) and len(n.args) <= 3


def _permuted(graph: fx.Graph, x: Any, order: list[int], cone: set[fx.Node], done: dict) -> Any:
    """A node computing ``x.permute(order)``: through the ``cone`` (:func:`_pointwise_cone`) and any pointwise op,
    the same ops on permuted operands (so ``lv`` and ``lv.exp()`` stay one tensor and its exp); through an
    unsqueeze, the unsqueeze of the permuted tensor; a tensor of fewer dims as it broadcasts (size-1 dims in
    front); other tensors permuted; numbers as they are."""
    if not isinstance(x, fx.Node) or not isinstance(_val(x), torch.Tensor):
        return x
    key = (x, tuple(order))
    if key not in done:
        rank = _val(x).dim()
        unsqueezed = 0 if rank < len(order) else x.args[1] % rank if x.target is aten.unsqueeze.default else None
        if x in cone and _sums_last_dim(x):
            done[key] = emit(graph, aten.sum.dim_IntList,
                              _permuted(graph, x.args[0], order + [len(order)], cone, done), [-1])
        elif x in cone or is_pointwise(x):
            done[key] = emit(graph, x.target, *fx.node.map_arg(
                x.args, lambda a: _permuted(graph, a, order, cone, done)), **x.kwargs)
        elif unsqueezed is not None:  # the permute moved through the size-1 dim to the tensor unsqueezed
            inner = [o - (o > unsqueezed) for o in order if o != unsqueezed]
            done[key] = emit(graph, aten.unsqueeze.default,
                              _permuted(graph, x if rank < len(order) else x.args[0], inner, cone, done),
                              order.index(unsqueezed))
        elif order == sorted(order):
            done[key] = x
        else:
            done[key] = emit(graph, aten.permute.default, x, order)
    return done[key]


def _pair_at(node: fx.Node, i: int, j: int) -> bool:
    """Whether ``node`` broadcasts an operand [.., N, 1, ..] against one [.., 1, N, ..] at dims i and j."""
    out = _val(node)
    shapes = [(1,) * (out.dim() - _val(a).dim()) + tuple(_val(a).shape) for a in node.all_input_nodes
              if isinstance(_val(a), torch.Tensor)]
    return any(statically_known_true(a[i] == 1) and statically_known_true(b[j] == 1)
               and not statically_known_true(a[j] == 1) and not statically_known_true(b[i] == 1)
               for a in shapes for b in shapes)


def _grad_modes(graph: fx.Graph) -> dict[fx.Node, bool]:
    """Whether gradients are enabled where each node runs (``torch.no_grad()`` regions disable them)."""
    enabled, grad_enabled = True, {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target is torch._C._set_grad_enabled:
            enabled = bool(node.args[0])
        grad_enabled[node] = enabled
    return grad_enabled


def detach_no_grad_results(graph: fx.Graph) -> None:
    """A value computed under ``torch.no_grad()`` and read where gradients are enabled again is read
    through ``detach``: no gradient flows back through it, and a pass now sees that (a fused op
    spanning the region's end would let gradients through what the user computed without them)."""
    grad_enabled = _grad_modes(graph)
    for node in list(grad_enabled):
        later = [u for u in node.users if grad_enabled.get(u, True)]
        if grad_enabled[node] or not later or not isinstance(_val(node), torch.Tensor) or mutates(node):
            continue  # (a write under no_grad returns the tensor it wrote into, which keeps its gradient)
        with graph.inserting_after(node):
            detached = emit(graph, aten.detach.default, node)
        detached.meta["stack_trace"] = node.meta.get("stack_trace")  # the user's line inside the region
        for user in later:
            user.replace_input_with(node, detached)


def softmax_spellings(graph: fx.Graph) -> None:
    """``exp(log_softmax(x, d))`` and ``e / e.sum(d, keepdim=True)`` with ``e = exp(x − x.amax(d, keepdim=True))``
    (or ``x.max(d, keepdim=True)[0]``) → ``softmax(x, d)``: the same values, so passes read one softmax.
    So is ``softmax(x − x.amax(d, keepdim=True), d)`` (the row max detached or not): a softmax does not
    change with a shift along its dim, nor does its gradient.

    ``x − x.logsumexp(d, keepdim=True)`` → ``log_softmax(x, d)`` (so its exp is a softmax too).

    The softmax of ``exp(x) / Σ exp(x)`` without the max subtracted is left alone: it overflows where
    softmax does not, so it does not compute the same.

    A (log-)softmax's ``dtype=`` that is its input's dtype converts nothing: dropped."""
    for node in list(graph.nodes):
        if node.target in (aten.softmax.int, aten.log_softmax.int) and len(node.args) == 3 \
                and isinstance(node.args[0], fx.Node) and node.args[2] == getattr(_val(node.args[0]), "dtype", None):
            node.args = node.args[:2]
        for target, of in ((aten.log_softmax.int, _log_softmax_of), (aten.softmax.int, _softmax_of)):
            x, dim = of(node)
            if x is not None:
                before = node.prev
                with graph.inserting_before(node):
                    node.replace_all_uses_with(emit(graph, target, x, dim))
                _keep_source(before, node)
                graph.erase_node(node)
                break
    for node in list(graph.nodes):
        if node.target in (aten.softmax.int, aten.log_softmax.int) and len(node.args) == 2 and not node.kwargs \
                and isinstance(_val(node.args[0]), torch.Tensor) and (rank := _val(node.args[0]).dim()) >= 4 \
                and 2 <= (d := node.args[1] % rank) < rank - 1 \
                and statically_known_true(_val(node.args[0]).shape[d - 1] == _val(node.args[0]).shape[d]):
            # over the key dim of pairs with other dims after them ([B, i, j, H] over j): over the last dim of the
            # pairs permuted last, [B, H, i, j], then permuted back (each row's softmax is the same)
            order = [*range(d - 1), *range(d + 1, rank), d - 1, d]
            before = node.prev
            with graph.inserting_before(node):
                moved = emit(graph, node.target, emit(graph, aten.permute.default, node.args[0], order), -1)
                node.replace_all_uses_with(emit(graph, aten.permute.default, moved,
                                                [order.index(i) for i in range(rank)]))
            _keep_source(before, node)
            graph.erase_node(node)


def _keep_source(before: fx.Node, node: fx.Node) -> None:
    """The nodes a rewrite inserted between ``before`` and ``node`` take ``node``'s source line (the user's
    line a near-miss shows) where they have none."""
    new = before.next
    while new is not node:
        if not new.meta.get("stack_trace") and node.meta.get("stack_trace"):
            new.meta["stack_trace"] = node.meta["stack_trace"]
        new = new.next


def _log_softmax_of(node: fx.Node) -> tuple[Any, int | None]:
    """(x, d) when ``node`` is ``x − x.logsumexp(d, keepdim=True)``."""
    if node.op != "call_function" or node.target is not aten.sub.Tensor or node.kwargs \
            or not all(isinstance(a, fx.Node) for a in node.args):
        return None, None
    x, lse = node.args
    if lse.target is aten.logsumexp.default and lse.args[0] is x and len(lse.args) > 2 and lse.args[2] is True \
            and len(lse.args[1]) == 1 and not lse.kwargs:
        return x, lse.args[1][0]
    return None, None


def _softmax_of(node: fx.Node) -> tuple[Any, int | None]:
    """(x, d) when ``node`` computes softmax(x, d) in one of the spellings of :func:`softmax_spellings`."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
        return None, None
    arg = node.args[0]
    if node.target is aten.softmax.int and (len(node.args) < 3 or node.args[2] is None) \
            and arg.target is aten.sub.Tensor and arg.kwargs.get("alpha", 1) == 1 and isinstance(arg.args[1], fx.Node) \
            and is_row_max(undetached(arg.args[1]), arg.args[0], node.args[1]):
        return arg.args[0], node.args[1]
    if node.target is aten.exp.default and arg.target in (aten.log_softmax.int, aten._log_softmax.default) \
            and (len(arg.args) < 3 or arg.args[2] in (None, False)) and not arg.kwargs.get("dtype"):
        return arg.args[0], arg.args[1]
    if node.target is not aten.div.Tensor or not isinstance(node.args[1], fx.Node):
        return None, None
    total = node.args[1]
    if total.target is not aten.sum.dim_IntList or total.args[0] is not arg or total.kwargs.get("dtype") \
            or len(total.args) < 3 or total.args[2] is not True or len(total.args[1]) != 1:
        return None, None
    dim = total.args[1][0]
    if arg.target is not aten.exp.default or not isinstance(arg.args[0], fx.Node) \
            or arg.args[0].target is not aten.sub.Tensor or arg.args[0].kwargs.get("alpha", 1) != 1:
        return None, None
    x, peak = arg.args[0].args
    peak = undetached(peak)
    if not isinstance(peak, fx.Node) or not is_row_max(peak, x, dim):
        return None, None
    return x, dim


def undetached(node: Any) -> Any:
    while isinstance(node, fx.Node) and node.target in (aten.detach.default, aten.alias.default):
        node = node.args[0]
    return node


def is_row_max(peak: fx.Node, x: Any, dim: int) -> bool:
    """Whether ``peak`` is ``x.amax(dim, keepdim=True)`` or ``x.max(dim, keepdim=True)[0]``."""
    if peak.target is aten.amax.default:
        return peak.args[0] is x and list(peak.args[1]) == [dim] and len(peak.args) > 2 and peak.args[2] is True
    if peak.target is operator.getitem and peak.args[1] == 0 and isinstance(peak.args[0], fx.Node):
        m = peak.args[0]
        return m.target is aten.max.dim and m.args[0] is x and m.args[1] == dim and len(m.args) > 2 and m.args[2]
    return False


def _val(node: Any) -> Any:
    """A node's fake value (``val`` in ATen graphs, ``example_value`` in Dynamo's), or the literal itself."""
    return node.meta.get("val", node.meta.get("example_value")) if isinstance(node, fx.Node) else node


def emit(graph: fx.Graph, target: Any, *args: Any, **kwargs: Any) -> fx.Node:
    """A new call of ``target`` at the graph's insertion point, with its fake value (``meta["val"]``)."""
    new = graph.call_function(target, args, kwargs)
    _refake(new)
    return new


def _rewrite(graph: fx.Graph, node: fx.Node, outputs: set[fx.Node]) -> fx.Node | None:
    """The node that computes what ``node`` computes in the normal form (None: keep ``node``)."""
    target, args = node.target, node.args
    if target in _COPIES:
        # (a copy handed to torch.cond stays: its operands must not alias each other, and chunks of one projection
        # do)
        if node not in outputs and isinstance(args[0], fx.Node) and _same_layout_free(node) \
                and not any(user.target is torch.ops.higher_order.cond for user in node.users):
            return args[0]
        return None
    if target is aten.to.dtype and len(args) == 2 and not node.kwargs and isinstance(_val(args[0]), torch.Tensor) \
            and args[1] == _val(args[0]).dtype and node not in outputs and not _switches_autocast(graph):
        return args[0]  # x.float() of a float32 x: x itself (to() returns its input when nothing changes)
    if target in _DROPOUTS and len(args) == 3 and (args[2] is False or args[1] == 0) and not node.kwargs \
            and node not in outputs:
        return args[0]  # F.dropout(x, p, training=False), nn.Dropout in eval(), or p = 0: x itself
    if target in _RESHAPES and node not in outputs and same_shape(node, args[0]):
        return args[0]  # h.view(B, T, D) of an h [B, T, D]: h itself
    if target in _AXIS_MOVES and not node.kwargs and isinstance(_val(node), torch.Tensor):
        with graph.inserting_before(node):  # swapaxes, movedim: the transpose or permute they are
            return emit(graph, aten.permute.default, args[0], _moved_axes(node))
    if target in (aten.mT.default, aten.t.default) and isinstance(_val(node), torch.Tensor) and _val(node).dim() >= 2:
        rank = _val(node).dim()  # x.mT, x.t(): the transpose of the last two dims, as x.transpose(1, 2) writes it
        with graph.inserting_before(node):
            return emit(graph, aten.transpose.int, args[0], rank - 2, rank - 1)
    if target is aten.ones_like.default and isinstance(_val(node), torch.Tensor) \
            and set(node.kwargs) <= {"dtype", "layout", "device", "pin_memory", "memory_format"} \
            and node.kwargs.get("layout") in (None, torch.strided):
        return _ones_of_the_shape(graph, node)
    if target is aten.expand_as.default and isinstance(_val(args[1]), torch.Tensor):
        return _expand_as(graph, node)
    if target is aten.slice.Tensor and _whole_slice(node):
        return args[0]
    if target is aten.narrow.default and all(isinstance(a, int) for a in args[1:]):
        with graph.inserting_before(node):
            cut = emit(graph, aten.slice.Tensor, args[0], args[1], args[2], args[2] + args[3])
            return _rewrite(graph, cut, outputs) or cut
    if target in _ADD_PRODUCTS and isinstance(args[0], fx.Node):
        return _add_product(graph, node, outputs)
    if target in (aten.matmul.default, aten.bmm.default, aten.mm.default) and len(node.kwargs) == 0:
        a, b = (_val(x) for x in args)
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() >= 2 and b.dim() >= 2 \
                and a.shape[-1] == 1 and b.shape[-2] == 1 and a.dtype == b.dtype:
            with graph.inserting_before(node):
                return emit(graph, aten.mul.Tensor, args[0], args[1])
        if (scaled := _diagonal_product(graph, node)) is not None:
            return scaled
        if (rows := _row_scaled(args[0], outputs)) is not None:
            scaled, divide = rows  # (a / n) @ v → (a @ v) / n for n one number per row of a: the row's scale
            with graph.inserting_before(node):
                product = emit(graph, target, args[0].args[0], args[1])
                return emit(graph, divide, product, scaled)
        return None
    if target is aten.einsum.default and (scaled := _einsum_of_row_scaled(graph, node, outputs)) is not None:
        return scaled
    if target is aten.einsum.default:
        explicit = _einsum_without_ellipsis(graph, node) or node
        explicit = _einsum_of_permuted(graph, explicit) or explicit
        return _einsum(graph, node, outputs) if explicit is node else (_einsum(graph, explicit, outputs) or explicit)
    if target in (aten.outer.default, aten.ger.default) and not node.kwargs:
        with graph.inserting_before(node):  # torch.outer(a, b): a[:, None] * b, as the other spellings are
            return emit(graph, aten.mul.Tensor, emit(graph, aten.unsqueeze.default, args[0], -1), args[1])
    if target is aten.lerp.Scalar and not node.kwargs and isinstance(args[2], (int, float)) \
            and not isinstance(args[2], bool):
        a, b, w = args  # torch.lerp(a, b, w) for a number w: (1 − w)·a + w·b (the same up to rounding)
        with graph.inserting_before(node):
            return emit(graph, aten.add.Tensor, emit(graph, aten.mul.Tensor, a, 1 - w),
                         emit(graph, aten.mul.Tensor, b, w))
    if target is aten.add.Tensor and not node.kwargs and all(isinstance(a, fx.Node) for a in args) \
            and args[1].target is aten.neg.default:
        with graph.inserting_before(node):  # a + (−b) → a − b (exactly: negation is exact)
            return emit(graph, aten.sub.Tensor, args[0], args[1].args[0])
    if target is aten.sub.Tensor and not node.kwargs and isinstance(args[0], fx.Node) \
            and isinstance(args[1], (int, float)) and not isinstance(args[1], bool):
        with graph.inserting_before(node):  # x − c → x + (−c)
            return emit(graph, aten.add.Tensor, args[0], -args[1])
    if target is aten.add.Tensor and not node.kwargs and args[0] is args[1] and isinstance(args[0], fx.Node) \
            and isinstance(_val(args[0]), torch.Tensor) and _val(args[0]).dtype.is_floating_point:
        with graph.inserting_before(node):  # x + x → x * 2 (exactly)
            return emit(graph, aten.mul.Tensor, args[0], 2)
    scaled_by_number = target in (aten.mul.Tensor, aten.div.Tensor) and len(args) == 2 \
        and isinstance(args[1], (int, float)) and not isinstance(args[1], bool) and args[1] != 0 \
        and math.isfinite(args[1])
    if target in (aten.neg.default, aten.mul.Tensor, aten.div.Tensor) and isinstance(args[0], fx.Node) \
            and args[0].target in (aten.masked_fill.Scalar, aten.where.ScalarOther, aten.where.ScalarSelf) \
            and not node.kwargs:
        return _through_masked_fill(graph, node)
    if (target is aten.neg.default or scaled_by_number) and isinstance(args[0], fx.Node) \
            and args[0].target is aten.add.Tensor and not args[0].kwargs and len(args[0].users) == 1 \
            and args[0] not in outputs and all(isinstance(a, fx.Node) for a in args[0].args) \
            and sum(map(depends_on_sizes_only, args[0].args)) == 1:
        # −(kl + m) → (−kl) + (−m), and so (kl + m) / c, m made of sizes and constants (a mask of 0 and +inf on
        # the KL): the mask then on the score the softmax reads. Exact for a mask (0 and ±inf stay so); a
        # finite m rounds apart at most once
        with graph.inserting_before(node):
            return emit(graph, aten.add.Tensor, *(emit(graph, target, a, *args[1:]) for a in args[0].args))
    if target is aten.where.self and len(args) == 3:
        return _where_of_a_number(graph, node)
    if target in (aten.masked_fill.Tensor, aten.index_put.default):
        return _masked_fill_of_a_number(graph, node)
    if target is aten.cat.default and not node.kwargs and (padded := _cat_of_zeros(graph, node)) is not None:
        return padded
    if target is aten.stack.default and not node.kwargs and (unfolded := _stacked_windows(graph, node)) is not None:
        return unfolded
    if target is aten.transpose.int and isinstance(args[0], fx.Node) and args[0].target is aten.cat.default \
            and isinstance(_val(args[0]), torch.Tensor) and not args[0].kwargs:
        return _cat_transposed(graph, node)
    if target in (aten.softmax.int, aten.log_softmax.int) and len(args) == 2 and not node.kwargs \
            and isinstance(_val(args[0]), torch.Tensor) and _val(args[0]).dim() >= 2 \
            and args[1] % _val(args[0]).dim() == _val(args[0]).dim() - 2 \
            and _val(args[0]).shape[-1] == _val(args[0]).shape[-2]:
        # over dim −2 of a square [.., N, N] score (one laid out [j, i]): over the last dim of its transpose
        with graph.inserting_before(node):
            flipped = emit(graph, target, _transposed(graph, args[0]), -1)
            return emit(graph, aten.transpose.int, flipped, -2, -1)
    if target is aten.slice.Tensor and len(args) > 1 and isinstance(args[0], fx.Node) and not node.kwargs \
            and args[0].target is aten.unsqueeze.default and isinstance(_val(node), torch.Tensor) \
            and (u := _squeezed_dim(args[0])) is not None and args[1] % _val(node).dim() != u:
        d = args[1] % _val(node).dim()  # y.unsqueeze(2)[..., :T] → y[..., :T].unsqueeze(2): the slice by the conv
        with graph.inserting_before(node):
            cut = emit(graph, aten.slice.Tensor, args[0].args[0], d if d < u else d - 1, *args[2:])
            return emit(graph, aten.unsqueeze.default, cut, u)
    if target is aten.permute.default and _permutation(node) in ([1, 2, 0], [2, 0, 1]):
        # a sequence-first [T, B, D] ↔ [B, D, T] in one permute: the batch swap and the T/D swap, the latter next
        # to the [B, D, T] side (where a conv is), as (1, 2, 0) = swap(0, 1) then swap(1, 2). Exact: views.
        first, second = ((0, 1), (1, 2)) if _permutation(node) == [1, 2, 0] else ((1, 2), (0, 1))
        with graph.inserting_before(node):
            return emit(graph, aten.transpose.int, emit(graph, aten.transpose.int, args[0], *first), *second)
    if target is aten.slice.Tensor and len(args) > 1 and _permutation(args[0]) is not None:
        return _slice_before_permute(graph, node, outputs)
    if _permutation(node) is not None and isinstance(args[0], fx.Node) and zero_pad_amounts(args[0]) is not None:
        return _pad_after_permute(graph, node, outputs)
    if target is aten.conv2d.default:
        return _conv2d_over_one_row(graph, node, outputs)
    if (target in (aten.squeeze.dim, aten.squeeze.dims) or target is aten.select.int and args[2] in (0, -1)) \
            and isinstance(args[0], fx.Node) and args[0].target is aten.unsqueeze.default \
            and _squeezed_dim(node) == _squeezed_dim(args[0]):
        return args[0].args[0]  # x.unsqueeze(d).squeeze(d), x[:, :, None][:, :, 0]: x
    if target is aten.squeeze.dim and isinstance(args[0], fx.Node) and zero_pad_amounts(args[0]) is not None \
            and isinstance(args[0].args[0], fx.Node) \
            and args[0].args[0].target is aten.unsqueeze.default \
            and _squeezed_dim(node) == _squeezed_dim(args[0].args[0]) is not None \
            and len(zero_pad_amounts(args[0])) // 2 < _val(node).dim() + 1 - _squeezed_dim(node):
        pad = args[0]  # F.pad(x.unsqueeze(2), (K-1, 0)).squeeze(2) → F.pad(x, (K-1, 0)): the row is not padded
        with graph.inserting_before(node):
            return emit(graph, aten.pad.default, pad.args[0].args[0], *pad.args[1:], **pad.kwargs)
    if (target is aten.mul.Tensor and len(args) == 2 and args[0] is args[1] and isinstance(args[0], fx.Node)
            or target is aten.square.default):
        with graph.inserting_before(node):
            return emit(graph, aten.pow.Tensor_Scalar, args[0], 2)
    scaled = target in (aten.mul.Tensor, aten.div.Tensor) and len(args) == 2 and not node.kwargs \
        and isinstance(args[1], (int, float)) and not isinstance(args[1], bool)
    if (target is aten.neg.default or scaled) and isinstance(args[0], fx.Node) and args[0].op == "call_function" \
            and args[0].target in (_RESHAPES if scaled else _RESHAPES + _PERMUTES) and len(args[0].users) == 1 \
            and args[0] not in outputs:
        # −x.flatten(0, 1) → (−x).flatten(0, 1), −x.mT → (−x).mT, x.view(-1, V) * c → (x * c).view(-1, V):
        # a score's sign and scale stay with the score
        view = args[0]
        with graph.inserting_before(node):
            return emit(graph, view.target, emit(graph, target, view.args[0], *args[1:]), *view.args[1:],
                         **view.kwargs)
    return None


def _diagonal_of(x: Any) -> fx.Node | None:
    """d where ``x`` is the diagonal matrix of a vector d: ``torch.diag_embed(d)`` on the last two dims, or
    ``torch.diag(d)`` of a d [n]."""
    if not isinstance(x, fx.Node) or x.kwargs or not isinstance(_val(x.args[0]) if x.args else None, torch.Tensor):
        return None
    if x.target is aten.diag_embed.default and tuple(x.args[1:]) in ((), (0,), (0, -2), (0, -2, -1)):
        return x.args[0]
    if x.target is aten.diag.default and _val(x.args[0]).dim() == 1 and tuple(x.args[1:]) in ((), (0,)):
        return x.args[0]
    return None


def _diagonal_product(graph: fx.Graph, node: fx.Node) -> fx.Node | None:
    """``X @ diag(d)`` → ``X * d[..., None, :]`` and ``diag(d) @ X`` → ``d[..., :, None] * X`` (a column or row
    scaled per entry, GLA's M ← M diag(α_t) + v kᵀ): the sum of one product and zeros."""
    a, b = node.args[:2]
    if (d := _diagonal_of(b)) is not None and _val(a).dim() >= 2:
        with graph.inserting_before(node):
            return emit(graph, aten.mul.Tensor, a, emit(graph, aten.unsqueeze.default, d, -2))
    if (d := _diagonal_of(a)) is not None and _val(b).dim() >= 2:
        with graph.inserting_before(node):
            return emit(graph, aten.mul.Tensor, emit(graph, aten.unsqueeze.default, d, -1), b)
    return None


def _row_scaled(a: Any, outputs: set[fx.Node]) -> tuple[fx.Node, Any] | None:
    """(n, div or mul) when ``a`` is ``x / n`` or ``x * (1 / n)`` read by one matrix product alone, with n a tensor
    of one number per row of x ([..., rows, 1]) kept from 0 (``+ ε``, a clamp): the product's rows take the scale
    after it, the same up to rounding (a score normalised before it is read,
    ``(s / (s.sum(-1, keepdim=True) + eps)) @ v``)."""
    if not isinstance(a, fx.Node) or a.target not in (aten.div.Tensor, aten.mul.Tensor) or a.kwargs \
            or len(a.users) != 1 or a in outputs or not all(isinstance(x, fx.Node) for x in a.args) \
            or exp_factor(a.args[0]) is not None:
        return None
    divisor = _under_views(a.args[1])
    if a.target is aten.mul.Tensor:
        divisor = _under_views(divisor.args[0]) if divisor.target is aten.reciprocal.default else None
    if divisor is None or not _kept_from_zero(divisor):
        return None  # a row sum that may be 0: 0/0 would reach other rows' gradients through the product
    x, n = (_val(arg) for arg in a.args)
    if not (isinstance(x, torch.Tensor) and isinstance(n, torch.Tensor)) or x.dim() < 2 or n.dim() < 2 \
            or n.dim() > x.dim() or n.shape[-1] != 1 or n.shape[-2] != x.shape[-2] or x.dtype != n.dtype \
            or torch.broadcast_shapes(x.shape, n.shape) != x.shape:
        return None
    return a.args[1], a.target


def _under_views(x: Any) -> Any:
    """What ``x`` is a view of (``n.unsqueeze(-1)``, ``n.view(...)``: the same numbers)."""
    while isinstance(x, fx.Node) and x.target in _RESHAPES + (aten.unsqueeze.default, aten.expand.default):
        x = x.args[0]
    return x


def _kept_from_zero(n: fx.Node) -> bool:
    """Whether ``n`` is ``s + ε`` or ``s.clamp(min=ε)`` for a number ε > 0 (a normaliser, Σ_s A_ts ≥ 0 for
    positive features)."""
    if n.target is aten.add.Tensor and len(n.args) == 2 and not n.kwargs:
        return any(isinstance(c, (int, float)) and not isinstance(c, bool) and c > 0 for c in n.args)
    if n.target in (aten.clamp.default, aten.clamp_min.default) and len(n.args) > 1:
        return isinstance(n.args[1], (int, float)) and n.args[1] > 0
    return False


def exp_factor(x: Any, depth: int = 4) -> fx.Node | None:
    """The exp ``x`` is, or is a factor of (through products, quotients and zero-fills: exp(s) times masks or
    numbers), else None: β = x / Σ x is then a softmax written out, which stays β (the attention passes read it)."""
    if not isinstance(x, fx.Node):
        return None
    if x.target is aten.exp.default and isinstance(x.args[0], fx.Node):
        return x
    if depth and x.target in (aten.mul.Tensor, aten.div.Tensor, aten.masked_fill.Scalar, aten.where.ScalarOther):
        return next((found for a in x.args if (found := exp_factor(a, depth - 1)) is not None), None)
    return None


def _switches_autocast(graph: fx.Graph) -> bool:
    """Whether ``graph`` enters autocast itself (``with torch.autocast(...)`` in the compiled code): the re-trace
    records the region but not its casts, so a dtype in the graph's values may not be the one at run time."""
    return bool(graph.find_nodes(op="call_function", target=torch.amp.autocast_mode._enter_autocast))


def _cat_of_zeros(graph: fx.Graph, node: fx.Node) -> fx.Node | None:
    """``torch.cat([zeros(B, K-1, D), h], 1)`` → ``F.pad(h, (0, 0, K-1, 0))``: one tensor joined to zeros before
    or after it on one dim is that tensor padded with zeros there (a causal conv's left padding, written as a
    cat). Exact: the same elements. Only for zeros of h's dtype made by ``zeros``/``new_zeros``/``zeros_like``,
    of fixed size on the joined dim, that nothing writes into."""
    parts, out = node.args[0], _val(node)
    if not isinstance(out, torch.Tensor) or not isinstance(parts, (list, tuple)) or len(parts) < 2:
        return None
    rank = out.dim()
    dim = (node.args[1] if len(node.args) > 1 else 0) % rank

    def zeros(part) -> bool:
        value = _val(part)
        return isinstance(part, fx.Node) and part.target in _ZEROS and isinstance(value, torch.Tensor) \
            and value.dtype == out.dtype and value.dim() == rank and isinstance(value.shape[dim], int) \
            and written_in_place(part) is None
    kept = [i for i, part in enumerate(parts) if not zeros(part)]
    if len(kept) != 1 or not isinstance(_val(parts[kept[0]]), torch.Tensor):
        return None
    x = parts[kept[0]]
    if _val(x).dtype != out.dtype or _val(x).dim() != rank or any(
            not statically_known_true(_val(p).shape[d] == out.shape[d])
            for p in parts for d in range(rank) if d != dim):
        return None
    before = sum(_val(p).shape[dim] for p in parts[:kept[0]])
    after = sum(_val(p).shape[dim] for p in parts[kept[0] + 1:])
    amounts = [0] * (2 * (rank - dim))
    amounts[-2:] = [before, after]  # F.pad's amounts run from the last dim back: dim's pair comes last
    with graph.inserting_before(node):
        return emit(graph, aten.pad.default, x, amounts)


def _moved_axes(node: fx.Node) -> list[int]:
    """The permutation ``swapaxes(x, a, b)`` or ``movedim(x, source, destination)`` applies."""
    rank = _val(node).dim()
    if node.target in (aten.swapaxes.default, aten.swapdims.default):
        order = list(range(rank))
        a, b = (d % rank for d in node.args[1:3])
        order[a], order[b] = order[b], order[a]
        return order
    source, destination = ([d] if isinstance(d, int) else list(d) for d in node.args[1:3])
    order: list[int | None] = [None] * rank
    for s, d in zip(source, destination):
        order[d % rank] = s % rank
    rest = iter(d for d in range(rank) if d not in {s % rank for s in source})
    return [next(rest) if o is None else o for o in order]


def _stacked_windows(graph: fx.Graph, node: fx.Node) -> fx.Node | None:
    """``torch.stack([P[..., k:k+L] for k in range(K)], d)``, the K windows of P along one dim, each of length
    L = P's − (K − 1), stacked on a new dim d: ``P.unfold(dim, K, 1)`` (the windows on a last dim), moved to d by a
    permute where d is not last: the same elements in the same places."""
    windows = node.args[0]
    rank = _val(node).dim() if isinstance(_val(node), torch.Tensor) else 0
    if len(windows) < 2 or not all(isinstance(w, fx.Node) and w.target is aten.slice.Tensor for w in windows):
        return None
    stacked = (node.args[1] if len(node.args) > 1 else 0) % rank
    source, dim = windows[0].args[0], windows[0].args[1] % (rank - 1)
    size = _val(source).shape[dim]
    for k, w in enumerate(windows):
        start = (w.args[2] if len(w.args) > 2 else None) or 0
        if not _same_call(w.args[0], source) or w.args[1] % (rank - 1) != dim \
                or (w.args[4] if len(w.args) > 4 else 1) != 1 \
                or start != k or not statically_known_true(_val(w).shape[dim] == size - (len(windows) - 1)):
            return None
    with graph.inserting_before(node):
        unfolded = emit(graph, aten.unfold.default, source, dim, len(windows), 1)
        if stacked == rank - 1:
            return unfolded
        order = [*range(rank - 1)]
        order.insert(stacked, rank - 1)  # the windows' dim (unfold's last) where the stack put it
        return emit(graph, aten.permute.default, unfolded, order)


def _same_call(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` are one node, or the same pure call of the same arguments (a pad written at each
    window, before common subexpressions are merged)."""
    return a is b or isinstance(a, fx.Node) and isinstance(b, fx.Node) and a.op == b.op == "call_function" \
        and a.target == b.target and a.args == b.args and a.kwargs == b.kwargs and not mutates(a)


def _cat_transposed(graph: fx.Graph, node: fx.Node) -> fx.Node | None:
    """``cat([state, x], 1).transpose(1, 2)`` read by a conv → ``cat([state.transpose(1, 2), x.transpose(1, 2)], 2)``:
    a conv state carried as [B, K−1, D] and joined to [B, T, D] on time is the conv's cat([state, x], -1) in
    channels first. Exact: the same elements."""
    cat, (_, d1, d2) = node.args[0], node.args
    rank = _val(cat).dim()
    parts, dim = cat.args[0], (cat.args[1] if len(cat.args) > 1 else 0) % rank
    d1, d2 = d1 % rank, d2 % rank
    # only into a conv, the time dim joined ([B, T, D] → [B, D, T]): the form a conv's carried state takes
    if rank != 3 or {d1, d2} != {1, 2} or dim != 1 or len(parts) != 2 or not node.users \
            or any(u.target not in (aten.conv1d.default, aten.convolution.default) for u in node.users) \
            or not all(isinstance(p, fx.Node) and isinstance(_val(p), torch.Tensor) and _val(p).dim() == rank
                       for p in parts):
        return None
    with graph.inserting_before(node):
        pieces = [emit(graph, aten.transpose.int, p, d1, d2) for p in parts]
        return emit(graph, aten.cat.default, pieces, d2 if dim == d1 else d1 if dim == d2 else dim)


def _transposed(graph: fx.Graph, x: fx.Node) -> fx.Node:
    """``x.transpose(-2, -1)``, a mask on x transposed with it (``s.masked_fill(m, v).mT`` →
    ``s.mT.masked_fill(m.mT, v)``), so that the mask stays on the score a softmax reads."""
    if x.target is aten.masked_fill.Scalar and isinstance(x.args[1], fx.Node) and _val(x.args[1]).dim() >= 2:
        return emit(graph, aten.masked_fill.Scalar, _transposed(graph, x.args[0]),
                     emit(graph, aten.transpose.int, x.args[1], -2, -1), x.args[2])
    return emit(graph, aten.transpose.int, x, -2, -1)


def _through_masked_fill(graph: fx.Graph, node: fx.Node) -> fx.Node | None:
    """``−x.masked_fill(m, ±inf)`` → ``(−x).masked_fill(m, ∓inf)``, and so for ``* c`` and ``/ c`` by a number
    c ≠ 0: the mask ends up on the score a softmax reads (``F.softmax(-kl.masked_fill(future, inf))``).
    Elementwise and exact, so the values and gradients are the same. A finite fill (β zero-filled) stays."""
    fill = node.args[0]
    if fill.target is aten.masked_fill.Scalar:
        x, mask, value = fill.args
    else:  # where(m, x, v) is x.masked_fill(~m, v); where(m, v, x) is x.masked_fill(m, v)
        x, value = fill.args[1:] if fill.target is aten.where.ScalarOther else fill.args[:0:-1]
        if not isinstance(x, fx.Node) or not isinstance(value, float) or math.isfinite(value) \
                or _val(x).shape != _val(fill).shape:
            return None
        with graph.inserting_before(node):
            mask = (emit(graph, aten.logical_not.default, fill.args[0]) if fill.target is aten.where.ScalarOther
                    else fill.args[0])
    if not isinstance(value, float) or math.isfinite(value):
        return None
    if node.target is aten.neg.default:
        op, new_value = (aten.neg.default,), -value
    else:
        c = node.args[1]
        if not isinstance(c, (int, float)) or isinstance(c, bool) or c == 0:
            return None
        op, new_value = (node.target, c), (value * c if node.target is aten.mul.Tensor else value / c)
    with graph.inserting_before(node):
        return emit(graph, aten.masked_fill.Scalar, emit(graph, op[0], x, *op[1:]), mask, new_value)


def _where_of_a_number(graph: fx.Graph, node: fx.Node) -> fx.Node | None:
    """``torch.where(m, x, torch.full_like(x, c))`` → ``torch.where(m, x, c)`` (either branch), when the
    filled tensor adds no dims or sizes to the result: a mask written with a tensor of one number."""
    cond, a, b = node.args
    for i, branch in ((2, b), (1, a)):
        if isinstance(branch, fx.Node) and branch.target in (aten.full_like.default, aten.full.default) \
                and isinstance(branch.args[1], (int, float)) and not isinstance(branch.args[1], bool):
            other, out = (a if i == 2 else b), _val(node)
            if not isinstance(_val(other), torch.Tensor) or {_val(branch).dtype, _val(other).dtype} != {out.dtype} \
                    or torch.broadcast_shapes(_val(cond).shape, _val(other).shape) != out.shape:
                return None
            target = aten.where.ScalarOther if i == 2 else aten.where.ScalarSelf
            with graph.inserting_before(node):
                return emit(graph, target, cond, *((other, branch.args[1]) if i == 2 else (branch.args[1], other)))
    return None


def _masked_fill_of_a_number(graph: fx.Graph, node: fx.Node) -> fx.Node | None:
    """``x.masked_fill(m, torch.tensor(c))`` and ``x[..., m] = c`` (an index_put of one number at a bool mask of
    x's last dims) → ``x.masked_fill(m, c)``: the same values and gradient, one spelling of a mask."""
    x, mask, value = node.args[:3]
    number = number_of(value)
    if number is None or not isinstance(_val(x), torch.Tensor) or not _val(x).dtype.is_floating_point \
            or _val(value).numel() != 1:
        return None
    if node.target is aten.index_put.default:
        accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
        *lead, mask = mask
        if accumulate or any(i is not None for i in lead) or not isinstance(_val(mask), torch.Tensor) \
                or _val(mask).dtype != torch.bool or len(lead) + _val(mask).dim() != _val(x).dim():
            return None
    with graph.inserting_before(node):
        if _val(mask).device != _val(x).device:  # index_put reads a CPU index for a CUDA tensor; masked_fill does not
            mask = emit(graph, aten._to_copy.default, mask, device=_val(x).device)
        return emit(graph, aten.masked_fill.Scalar, x, mask, number)


def _sizes_of(graph: fx.Graph, like: fx.Node) -> list:
    """``like.shape`` as arguments: a symbolic size read by ``sym_size``, as ``like.shape`` reads it."""
    sizes = []
    for d, size in enumerate(_val(like).shape):
        if isinstance(size, torch.SymInt):
            size_node = graph.call_function(aten.sym_size.int, (like, d))
            size_node.meta["val"] = size
            size = size_node
        sizes.append(size)
    return sizes


def _expand_as(graph: fx.Graph, node: fx.Node) -> fx.Node:
    """``x.expand_as(y)`` → ``x.expand(y.shape)``: a broadcast that reads y's sizes, not its values (a gate
    expanded as the memory does not depend on the memory)."""
    x, like = node.args
    with graph.inserting_before(node):
        return emit(graph, aten.expand.default, x, _sizes_of(graph, like))


def _ones_of_the_shape(graph: fx.Graph, node: fx.Node) -> fx.Node:
    """``torch.ones_like(s, dtype=torch.bool)`` → ``torch.ones(s.shape, dtype=torch.bool)``: it reads s's sizes, not
    its values (a causal mask ``ones_like(s).tril()`` is made of sizes, as ``ones(T, T).tril()`` is)."""
    like, value = node.args[0], _val(node)
    with graph.inserting_before(node):
        return emit(graph, aten.ones.default, _sizes_of(graph, like), dtype=value.dtype, device=value.device,
                     pin_memory=False)


_COPIES = (aten.clone.default, aten.contiguous.default, aten.alias.default, aten.lift_fresh.default)
_DROPOUTS = (aten.dropout.default, aten.alpha_dropout.default, aten.feature_dropout.default,
             aten.feature_alpha_dropout.default)

# self·β + (product)·α in one call: torch.baddbmm (batched), torch.addmm (one matrix), torch.addr (an outer product)
_ADD_PRODUCTS = (aten.baddbmm.default, aten.addmm.default, aten.addr.default)


def _add_product(graph: fx.Graph, node: fx.Node, outputs: set[fx.Node]) -> fx.Node | None:
    """``baddbmm(M, a, b, beta=β, alpha=α)`` (so ``addmm``, ``addr``) → ``β·M + α·(a @ b)`` (``addr``: α·a bᵀ),
    the product then read as any (``a [.., D, 1] @ b [.., 1, C]`` is the broadcast multiply ``a * b``).

    With β = 0, M is not read (its NaNs do not propagate) and the result is the product alone. The
    same sums as the fused call, which may round the scaling and the addition once fewer."""
    M, a, b = node.args[:3]
    beta, alpha = node.kwargs.get("beta", 1), node.kwargs.get("alpha", 1)
    values = [_val(x) for x in (M, a, b)]
    if len(node.args) != 3 or set(node.kwargs) - {"beta", "alpha"} \
            or not all(isinstance(v, torch.Tensor) and v.dtype == values[0].dtype for v in values) \
            or not all(isinstance(c, (int, float)) and not isinstance(c, bool) for c in (beta, alpha)):
        return None
    with graph.inserting_before(node):
        if node.target is aten.addr.default:
            product = emit(graph, aten.mul.Tensor, emit(graph, aten.unsqueeze.default, a, -1), b)
        else:
            product = emit(graph, aten.bmm.default if node.target is aten.baddbmm.default else aten.mm.default, a, b)
            product = _rewrite(graph, product, outputs) or product
        if beta == 0:
            return product if alpha == 1 else emit(graph, aten.mul.Tensor, product, alpha)
        kept = M if beta == 1 else emit(graph, aten.mul.Tensor, M, beta)
        return emit(graph, aten.add.Tensor, kept, product, **({} if alpha == 1 else {"alpha": alpha}))


_RESHAPES = (aten.view.default, aten.reshape.default, aten.flatten.using_ints, aten._unsafe_view.default)
_PERMUTES = (aten.transpose.int, aten.permute.default)
_AXIS_MOVES = (aten.swapaxes.default, aten.swapdims.default, aten.movedim.int, aten.movedim.intlist,
               aten.moveaxis.int, aten.moveaxis.intlist)


# the end torch.export writes for a slice to the end of a dim of symbolic size (``x[:, t]`` → slice(x, 0, 0, END))
_SLICE_TO_END = 9223372036854775807


def _whole_slice(node: fx.Node) -> bool:
    """``slice(x, d, 0, END)`` with step 1: a view of all of ``x`` (``x[:, t]`` leaves one before the select)."""
    args = list(node.args) + [None] * (5 - len(node.args))
    _, _, start, end, step = args[:5]
    start, end, step = node.kwargs.get("start", start), node.kwargs.get("end", end), node.kwargs.get("step", step)
    return start in (None, 0) and end in (None, _SLICE_TO_END) and step in (None, 1)


def _same_layout_free(node: fx.Node) -> bool:
    """A copy whose only effect is memory layout or a fresh buffer (no dtype/device change), and whose
    layout no later view needs: ``x.transpose(0, 1).contiguous().view(...)`` keeps its copy (a view of
    the transposed x itself may not exist)."""
    return set(node.kwargs) <= {"memory_format"} and not _views_need_copy(node)


def _views_need_copy(copy: fx.Node) -> bool:
    """Whether a chain of views from ``copy`` fails when run on the copied tensor itself (its strides)."""
    pending = [(copy, _val(copy.args[0]))]
    while pending:
        node, value = pending.pop()
        if not isinstance(value, torch.Tensor):
            return True
        for user in node.users:
            if not (isinstance(user.target, torch._ops.OpOverload)
                    and any(r.alias_info is not None for r in user.target._schema.returns)):
                continue  # not a view: it reads values, not strides
            args, kwargs = fx.node.map_arg((user.args, user.kwargs), lambda a: value if a is node else _val(a))
            try:
                pending.append((user, user.target(*args, **kwargs)))
            except Exception:  # e.g. view() of a tensor whose strides do not allow it
                return True
    return False


def _einsum_pairs(graph: fx.Graph, node: fx.Node, outputs: set[fx.Node]) -> fx.Node | None:
    """``einsum("bhts,ts,bhsd->bhtd", A, M, V)`` → ``einsum("bhts,bhsd->bhtd", einsum("bhts,ts->bhts", A, M), V)``:
    two operands at a time in torch's order, each step keeping the indices a later operand or the output reads,
    each step then in its normal form. The order: the contraction path opt_einsum chose, where torch.einsum
    passed one (pairs of positions; the two leave the list and their product joins its end), else left to right
    (:func:`_first_pair_summing`).
    Each pair is written in the user's order of its operands (a product at its first operand's place). Under
    autocast the operands may differ in dtype: each is cast to the einsum's, as autocast casts them before torch
    contracts."""
    equation, operands = node.args[:2]
    path = node.kwargs.get("path", node.args[2] if len(node.args) > 2 else None)
    inputs, output = equation.replace(" ", "").split("->")
    terms = inputs.split(",")
    dtype = _val(node).dtype
    if len(terms) != len(operands) or not all(isinstance(x, fx.Node) and _val(x).is_floating_point() for x in operands) \
            or (path is not None and (len(path) != 2 * (len(terms) - 1) or any(not isinstance(i, int) for i in path))):
        return None
    with graph.inserting_before(node):  # operands of other dtypes (under autocast): cast first, as autocast does
        operands = [x if _val(x).dtype == dtype else emit(graph, aten._to_copy.default, x, dtype=dtype)
                    for x in operands]
    pending = list(zip(range(len(terms)), terms, operands))  # (place in the user's equation, indices, operand)
    pairs = [tuple(path[i:i + 2]) for i in range(0, len(path), 2)] if path else [None] * (len(terms) - 1)
    for pair in pairs:
        first, second = pair or _first_pair_summing(pending, output)
        if first == second or not 0 <= min(first, second) <= max(first, second) < len(pending):
            return None
        (place, a_term, a), (_, b_term, b) = sorted((pending[first], pending[second]), key=lambda p: p[0])
        pending = [p for i, p in enumerate(pending) if i not in (first, second)]
        later = set(output).union(*(term for _, term, _ in pending))
        wider, narrower = sorted((a_term, b_term), key=len, reverse=True)  # the wider operand's layout
        kept = output if not pending else "".join(dict.fromkeys(c for c in wider + narrower if c in later))
        with graph.inserting_before(node):
            pair = emit(graph, aten.einsum.default, f"{a_term},{b_term}->{kept}", [a, b])
            product = (place, kept, _einsum(graph, pair, outputs) or pair)
        if path:
            pending.append(product)
        else:
            pending.insert(min(first, second), product)
    return pending[0][2]


def _first_pair_summing(pending: list, output: str) -> tuple[int, int]:
    """Without opt_einsum's path: the first two operands, left to right, unless their product is a broadcast
    that sums no index and is larger than either (``"ts,bhtd"``: the mask times the queries, [B, H, T, S, D]);
    then the first pair that sums an index (the queries and keys, over d), else the first that does not grow (the
    scores times the mask last in ``"btd,bsd,bse,ts"``, before the values). So the mask multiplies the scores,
    as where it is written next to them. The order of the products changes their rounding alone."""
    def kept(i, j):
        later = set(output).union(*(term for k, (_, term, _) in enumerate(pending) if k not in (i, j)))
        return {c for c in pending[i][1] + pending[j][1] if c in later}

    def sums(i, j):
        return len(kept(i, j)) < len(set(pending[i][1] + pending[j][1]))

    def grows(i, j):  # the product has indices neither operand has alone (a broadcast outer product)
        return not (kept(i, j) <= set(pending[i][1]) or kept(i, j) <= set(pending[j][1]))
    pairs = [(i, j) for i in range(len(pending)) for j in range(i + 1, len(pending))]
    if sums(0, 1) or not grows(0, 1):
        return 0, 1
    return next((p for p in pairs if sums(*p)), next((p for p in pairs if not grows(*p)), (0, 1)))


def _einsum_without_ellipsis(graph: fx.Graph, node: fx.Node) -> fx.Node | None:
    """``einsum("...id,...jd->...ij", q, k)`` → ``einsum("abid,abjd->abij", q, k)``: the dims ``...`` stands for
    named by letters the equation does not use, right-aligned across the operands as einsum aligns them
    (only where they have equal sizes: one of size 1 broadcasts, which named letters do not)."""
    equation, operands = node.args[0], node.args[1]
    if not isinstance(equation, str) or "..." not in equation or "->" not in equation:
        return None
    inputs, output = equation.replace(" ", "").split("->")
    terms = inputs.split(",")
    vals = [_val(x) for x in operands]
    if len(terms) != len(vals) or any(not isinstance(v, torch.Tensor) for v in vals) \
            or any(t.count("...") > 1 for t in terms + [output]):
        return None
    spans = [v.dim() - len(t.replace("...", "")) if "..." in t else 0 for t, v in zip(terms, vals)]
    width = max(spans)
    free = [c for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in equation][:width]
    if min(spans) < 0 or len(free) < width:
        return None
    sizes: dict[str, Any] = {}
    for term, v, span in zip(terms, vals, spans):
        start = term.find("...")
        for letter, size in zip(free[width - span:], v.shape[start:start + span] if start >= 0 else ()):
            if sizes.setdefault(letter, size) != size:
                return None
    named = [t.replace("...", "".join(free[width - span:])) for t, span in zip(terms, spans)]
    out = output.replace("...", "".join(free))
    with graph.inserting_before(node):
        return emit(graph, aten.einsum.default, ",".join(named) + "->" + out, operands)


def _einsum_of_permuted(graph: fx.Graph, node: fx.Node) -> fx.Node | None:
    """``einsum("bijh,…", x.permute(p), …)`` → ``einsum(eq', x, …)`` with the permuted operand's letters put back
    in x's order: the same contraction of the same elements (β of heads-last pairs read as laid out)."""
    equation, operands = node.args[0], list(node.args[1])
    if not isinstance(equation, str) or "..." in equation or "->" not in equation:
        return None
    inputs, output = equation.replace(" ", "").split("->")
    terms, changed = inputs.split(","), False
    for i, x in enumerate(operands):
        if isinstance(x, fx.Node) and x.target is aten.permute.default and len(terms[i]) == len(x.args[1]):
            order = [d % len(terms[i]) for d in x.args[1]]
            letters = [""] * len(order)
            for position, d in enumerate(order):  # result dim `position` is x's dim d
                letters[d] = terms[i][position]
            terms[i], operands[i], changed = "".join(letters), x.args[0], True
    if not changed:
        return None
    with graph.inserting_before(node):
        return emit(graph, aten.einsum.default, ",".join(terms) + "->" + output, operands)


def _einsum_of_row_scaled(graph: fx.Graph, node: fx.Node, outputs: set[fx.Node]) -> fx.Node | None:
    """``einsum("bhts,bshd->bthd", s / n, v)`` with n [b, h, t, 1] one number per row of s, its summed index last:
    ``einsum(…, s, v) / n'``, n' the row numbers placed in the output's dims, as :func:`_row_scaled` does for a
    matrix product."""
    equation, operands = node.args[0], node.args[1]
    if not isinstance(equation, str) or "->" not in equation or "." in equation or len(operands) != 2:
        return None
    inputs, out = equation.replace(" ", "").split("->")
    terms = inputs.split(",")
    for i, (term, operand) in enumerate(zip(terms, operands)):
        rows = _row_scaled(operand, outputs)
        if rows is None or _val(rows[0]).dim() != len(term) or term[-1] in out or not set(term[:-1]) <= set(out):
            continue
        n, divide = rows
        kept = term[:-1]
        with graph.inserting_before(node):
            product = emit(graph, aten.einsum.default, equation, [operand.args[0] if j == i else x
                                                                   for j, x in enumerate(operands)])
            placed = emit(graph, aten.squeeze.dim, n, -1)
            order = [kept.index(c) for c in out if c in kept]
            if order != sorted(order):
                placed = emit(graph, aten.permute.default, placed, order)
            for dim, c in enumerate(out):
                if c not in kept:
                    placed = emit(graph, aten.unsqueeze.default, placed, dim)
            return emit(graph, divide, product, placed)
    return None


def _einsum(graph: fx.Graph, node: fx.Node, outputs: set[fx.Node]) -> fx.Node | None:
    """``einsum(eq, [x, y])`` as the op it is, each operand permuted (and unsqueezed) into place:

    * nothing summed (``"bhv,bhk->bhvk"``): the broadcast multiply ``x' * y'``;
    * both operands over the same indices (``"bij,bij->b"``): the multiply, summed over the rest;
    * one index summed against a matrix y, nothing else shared (``"btd,ed->bte"``, a projection):
      ``x' @ y'``, with x' [..., d] and y' [d, e], then read as any matmul; an output that puts e
      elsewhere (``"btd,ed->bet"``, channels first) is that product, then one ``permute``.

    Other contractions (batched ones, ``"bthk,bthv->bhvk"``) stay einsums: passes read them by meaning.
    Three operands or more are contracted two at a time, in the order torch contracts them (:func:`_einsum_pairs`)."""
    equation, operands = node.args[0], node.args[1]
    if isinstance(equation, str) and "->" in equation and "." not in equation and len(operands) > 2:
        return _einsum_pairs(graph, node, outputs)
    if not isinstance(equation, str) or "->" not in equation or "." in equation or len(operands) != 2:
        return None
    inputs, output = equation.replace(" ", "").split("->")
    terms = inputs.split(",")
    if len(terms) != 2 or len(set(output)) != len(output):
        return None
    vals = [_val(x) for x in operands]
    if any(not isinstance(v, torch.Tensor) or v.dim() != len(t) for v, t in zip(vals, terms)):
        return None
    if vals[0].dtype != vals[1].dtype or any(len(set(term)) != len(term) for term in terms):
        return None  # mixed dtypes promote; a repeated index is a diagonal
    sizes: dict[str, Any] = {}
    for term, v in zip(terms, vals):
        for letter, size in zip(term, v.shape):
            if sizes.setdefault(letter, size) != size:
                return None  # einsum broadcasts no size-1 dims; leave such equations alone
    summed = [letter for letter in sizes if letter not in output]
    if any(letter not in terms[0] or letter not in terms[1] for letter in summed):
        return None  # an index summed over one operand alone
    if not summed:
        with graph.inserting_before(node):
            placed = [_placed(graph, x, term, output) for term, x in zip(terms, operands)]
            return emit(graph, aten.mul.Tensor, *placed)
    if set(terms[0]) == set(terms[1]):  # an elementwise product, summed ("bij,bij->b"): mul, then sum
        order = output + "".join(summed)
        with graph.inserting_before(node):
            product = emit(graph, aten.mul.Tensor, *(_placed(graph, x, t, order) for t, x in zip(terms, operands)))
            return emit(graph, aten.sum.dim_IntList, product, list(range(len(output), len(order))))
    if len(summed) != 1:
        return None
    (s,) = summed
    pairs = [((x, x_term), (y, y_term)) for (x, x_term), (y, y_term)
             in (zip(operands, terms), zip(reversed(operands), reversed(terms)))
             if len(y_term) == 2 and set(x_term) & set(y_term) == {s}]
    if not pairs:
        return None
    pairs.sort(key=lambda pair: output[-1] not in pair[1][1])  # a product already in the output's order first
    (x, x_term), (y, y_term) = pairs[0]
    (e,) = set(y_term) - {s}
    natural = output.replace(e, "") + e  # the matmul's order: the matrix's free index last
    with graph.inserting_before(node):
        product = emit(graph, aten.matmul.default, _placed(graph, x, x_term, natural[:-1] + s),
                        _placed(graph, y, y_term, s + e))
        product = _rewrite(graph, product, outputs) or product
        if natural != output:  # "btd,ed->bet": x @ W.permute(1, 0), then permuted like any transpose
            product = emit(graph, aten.permute.default, product, [natural.index(letter) for letter in output])
    return product


def _permutation(node: Any) -> list[int] | None:
    """The dims of ``node``'s input that ``node``'s dims are, when it is a ``transpose`` or ``permute`` (or
    ``swapaxes`` / ``movedim``, before the rewrites make them permutes)."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or not isinstance(_val(node), torch.Tensor):
        return None
    rank = _val(node).dim()
    if node.target in _AXIS_MOVES and not node.kwargs:
        return _moved_axes(node)
    if node.target is aten.permute.default:
        return [d % rank for d in node.args[1]]
    if node.target is aten.transpose.int:
        order = list(range(rank))
        a, b = (d % rank for d in node.args[1:3])
        order[a], order[b] = order[b], order[a]
        return order
    return None


def _slice_before_permute(graph: fx.Graph, node: fx.Node, outputs: set[fx.Node]) -> fx.Node:
    """``x.transpose(1, 2)[:, :T]`` → ``x[..., :T].transpose(1, 2)``: the slice on the permuted dim of x, then the
    same transpose or permute. Exact: both are views of the same elements. So a causal conv's first T outputs
    read as one slice right after the conv, sliced before or after transposing back."""
    permute = node.args[0]
    dim = _permutation(permute)[node.args[1] % _val(permute).dim()]
    with graph.inserting_before(node):
        cut = emit(graph, aten.slice.Tensor, permute.args[0], dim, *node.args[2:], **node.kwargs)
        cut = _rewrite(graph, cut, outputs) or cut
        return emit(graph, permute.target, cut, *permute.args[1:])


def _pad_after_permute(graph: fx.Graph, node: fx.Node, outputs: set[fx.Node]) -> fx.Node:
    """``F.pad(h, (0, 0, K-1, 0)).transpose(1, 2)`` → ``F.pad(h.transpose(1, 2), (K-1, 0))``: each dim keeps its
    zeros, now on the dim it moved to. Exact: the same elements, the same zeros. So a causal conv's left padding
    reads as one F.pad right before the conv, padded before or after transposing to [B, D, T]. A pad read
    elsewhere too (a streaming layer's conv state, the padded input's last K−1 steps) stays for those readers."""
    pad, order = node.args[0], _permutation(node)
    rank, amounts = len(order), zero_pad_amounts(node.args[0])
    per_dim = {rank - 1 - i // 2: amounts[i - i % 2:i - i % 2 + 2] for i in range(0, len(amounts), 2)}
    moved = [per_dim.get(order[d], [0, 0]) for d in reversed(range(rank))]  # F.pad's order: the last dim first
    while moved and moved[-1] == [0, 0]:
        moved.pop()
    with graph.inserting_before(node):
        permuted = emit(graph, node.target, pad.args[0], *node.args[1:])
        permuted = _rewrite(graph, permuted, outputs) or permuted
        return emit(graph, aten.pad.default, permuted, [a for pair in moved for a in pair], *pad.args[2:],
                     **pad.kwargs)


def _conv2d_over_one_row(graph: fx.Graph, node: fx.Node, outputs: set[fx.Node]) -> fx.Node | None:
    """``F.conv2d(h.unsqueeze(2), w.unsqueeze(2), b, padding=(0, p), ...)`` over one row with a (1, K) kernel →
    ``F.conv1d(h, w, b, padding=p, ...).unsqueeze(2)``: the same sums (ATen runs a conv1d as that conv2d).
    The row's own stride and dilation do not matter (one output row); its padding must be 0."""
    args = list(node.args) + [None, [1, 1], [0, 0], [1, 1], 1][len(node.args) - 2:]
    x, w, bias, stride, padding, dilation, groups = args[:7]
    x_val, w_val = _val(x), _val(w)
    one_row = [isinstance(v, torch.Tensor) and v.dim() == 4 and type(v.shape[2]) is int and v.shape[2] == 1
               for v in (x_val, w_val)]  # a symbolic height is not asked about: that would guard on it
    if node.kwargs or not all(one_row):
        return None
    stride, padding, dilation = ([v, v] if isinstance(v, int) else list(v) for v in (stride, padding, dilation))
    if padding[0] != 0:
        return None
    with graph.inserting_before(node):
        rows = []
        for t in (x, w):
            squeezed = emit(graph, aten.squeeze.dim, t, 2)
            rows.append(_rewrite(graph, squeezed, outputs) or squeezed)
        conv = emit(graph, aten.conv1d.default, *rows, bias, stride[1:], padding[1:], dilation[1:], groups)
        return emit(graph, aten.unsqueeze.default, conv, 2)


def _squeezed_dim(node: fx.Node) -> int | None:
    """The one dim a ``squeeze(d)`` removes or an ``unsqueeze(d)`` adds, counted in the larger tensor."""
    big = _val(node.args[0]) if node.target is not aten.unsqueeze.default else _val(node)
    dims = node.args[1] if not isinstance(node.args[1], int) else [node.args[1]]
    if not isinstance(big, torch.Tensor) or len(dims) != 1 or big.dim() == 0:
        return None
    return dims[0] % big.dim()


def _placed(graph: fx.Graph, x: fx.Node, term: str, order: str) -> fx.Node:
    """``x``, whose dims are the letters of ``term``, permuted to ``order`` with a size-1 dim for
    each letter of ``order`` it lacks."""
    kept = [letter for letter in order if letter in term]
    permutation = [term.index(letter) for letter in kept]
    if permutation != list(range(len(term))):
        x = emit(graph, aten.permute.default, x, permutation)
    for i, letter in enumerate(order):
        if letter not in term:
            x = emit(graph, aten.unsqueeze.default, x, i)
    return x


# ---------------------------------------------------------------- common subexpressions

def eliminate_common_subexpressions(graph: fx.Graph) -> None:
    """Replace each pure call returning a tensor by an earlier identical call (see :func:`common_subexpressions`)."""
    _merge(graph, common_subexpressions(graph))


def common_subexpressions(graph: fx.Graph, apart: Callable[[fx.Node], tuple | None] = lambda node: None
                          ) -> dict[fx.Node, fx.Node]:
    """Each pure call returning a tensor that repeats an earlier identical call (same op, inputs,
    literals), mapped to that earlier call; ``graph`` is left as it is.

    One pass in program order, hashing each call by (op, target, inputs, literals), with the
    inputs read through the merges already found and the two operands of a sum or product in
    either order. Works on ATen graphs and on Dynamo's
    (``call_method``, Python operators, torch functions). A call merges only with one made since
    the last in-place op (which may have changed its inputs) and the last change of grad mode or
    autocast (under which it computes something else), never when its result is later
    mutated (the two would share one buffer), and two graph outputs never merge into one
    (outputs must not alias each other), nor does a per-step slice ``apart`` names as (x, dim, index). What reads
    two equal slices reads the same, unless a slice of x at another index comes between them: a later step
    began (two loops over the same input each read x[:, 0] in their first step, and each keeps its own first
    step). Whether a call is pure is decided once per op and literals, not per node (a Dynamo-level call is
    traced to ATen to decide it)."""
    outputs = _output_nodes(graph)
    mutated = {_storage(a) for n in graph.nodes if mutates(n) for a in (n, *n.args[:1])} - {None}
    merges: dict[fx.Node, fx.Node] = {}
    same = {}  # merges, and the calls kept apart that repeat an earlier one: what reads either reads the same
    seen: dict[Any, fx.Node] = {}
    purity: dict[Any, bool] = {}
    epoch = 0  # in-place ops so far
    # (x, dim) -> [index of its latest slices, their latest position, the last position of a slice at another index]
    runs: dict[tuple, list] = {}
    position = {}
    for node in graph.nodes:
        position[node] = len(position)
        step = apart(node)
        if step is not None:
            run = runs.setdefault(step[:2], [step[2], -1, -1])
            if run[0] != step[2]:
                run[0], run[2] = step[2], run[1]
            run[1] = position[node]
        if mutates(node) or node.target in _MODE_CHANGES:
            epoch += 1
            continue
        if node.op not in ("call_function", "call_method") or not isinstance(_val(node), torch.Tensor) \
                or mutated and _storage(node) in mutated:
            continue
        try:
            args = _key(node.args, same)
            if _commutative(node):  # a + b and b + a: one key
                args = ("commutative", tuple(sorted(args[1], key=repr)))
            node_key = (node.op, node.target, args, _key(node.kwargs, same), epoch)
        except TypeError:
            continue
        earlier = seen.setdefault(node_key, node)
        if earlier is node or node in outputs and earlier in outputs:
            continue
        kind = (node.op, node.target, _key(fx.node.map_arg((node.args, node.kwargs), lambda _: _ANY_NODE), same))
        if kind not in purity:
            purity[kind] = _pure(node)
        if purity[kind]:
            if step is not None:
                if runs[step[:2]][2] > position[earlier]:
                    seen[node_key] = node  # another step's slice since: this one starts afresh
                else:
                    same[node] = earlier
                continue
            same[node] = earlier
            if node in outputs:
                outputs.add(earlier)
            merges[node] = earlier
    return merges


_COMMUTATIVE = (aten.add.Tensor, aten.mul.Tensor, operator.add, operator.mul, torch.add, torch.mul, "add", "mul")


def _commutative(node: fx.Node) -> bool:
    """A sum or product of two operands, nothing else passed (``alpha`` scales one of them)."""
    return node.target in _COMMUTATIVE and len(node.args) == 2 and not node.kwargs


# calls after which the same op computes something else: with or without gradients, in another dtype
_MODE_CHANGES = (torch._C._set_grad_enabled, torch.amp.autocast_mode._enter_autocast,
                 torch.amp.autocast_mode._exit_autocast)


def _merge(graph: fx.Graph, merges: dict[fx.Node, fx.Node]) -> None:
    """Replace each key of ``merges`` by its value, which comes earlier in ``graph``."""
    for node, earlier in merges.items():
        node.replace_all_uses_with(earlier)
        graph.erase_node(node)


_ANY_NODE = object()  # stands for every node argument when only a call's literals count


def _key(value: Any, merges: dict[fx.Node, fx.Node]) -> Any:
    """A hashable key equal for equal call arguments; a node stands for the node it was merged into."""
    if isinstance(value, fx.Node):
        return ("node", id(merges.get(value, value)))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_key(v, merges) for v in value))
    if value is _ANY_NODE:
        return ("any node",)
    if isinstance(value, dict):
        return ("dict", tuple(sorted((k, _key(v, merges)) for k, v in value.items())))
    if isinstance(value, slice):  # Dynamo's x[:, t]
        return ("slice", _key(value.start, merges), _key(value.stop, merges), _key(value.step, merges))
    if value is Ellipsis:
        return ("Ellipsis",)
    if isinstance(value, float):  # 2.0 and 2 differ in type promotion; -0.0 and 0.0 in sign
        return ("float", value.hex())
    if isinstance(value, (int, bool, str, type(None), torch.dtype, torch.device, torch.layout,
                          torch.memory_format)):
        return (type(value).__name__, value)
    raise TypeError  # an argument this CSE does not compare: keep the node


def _pure(node: fx.Node) -> bool:
    """Whether ``node`` computes its result from its inputs alone: every ATen op it runs is functional and
    draws no random numbers (a Dynamo-level call is traced to ATen to see which ops it runs)."""
    if node.target is operator.getitem:
        return True
    if node.is_impure():
        return False
    if isinstance(node.target, torch._ops.OpOverload):
        return functional_op(node.target)
    aten_graph = _aten_graph(node)
    return aten_graph is not None and all(functional_op(n.target) for n in aten_graph.nodes if n.op == "call_function")


def functional_op(op: Any) -> bool:
    return isinstance(op, torch._ops.OpOverload) and not op._schema.is_mutable \
        and torch.Tag.nondeterministic_seeded not in op.tags


def _aten_graph(node: fx.Node) -> fx.Graph | None:
    """The ATen ops a Dynamo-level call runs, traced on its fake inputs (None if it cannot be traced)."""
    from torch._guards import detect_fake_mode
    from torch.fx.experimental.proxy_tensor import make_fx

    args, kwargs = fx.node.map_arg((node.args, node.kwargs), _val)
    leaves, spec = torch.utils._pytree.tree_flatten((args, kwargs))
    tensors = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
    call = node.target if node.op == "call_function" else lambda self, *a, **k: getattr(self, node.target)(*a, **k)

    def run(*tensor_args):
        filled = list(leaves)
        for i, t in zip(tensors, tensor_args):
            filled[i] = t
        a, k = torch.utils._pytree.tree_unflatten(filled, spec)
        return call(*a, **k)

    fake_mode = detect_fake_mode([leaves[i] for i in tensors])
    try:
        with fake_mode if fake_mode is not None else contextlib.nullcontext():
            return make_fx(run, pre_dispatch=True)(*[leaves[i] for i in tensors]).graph
    except Exception:  # a call make_fx cannot trace: its ops are unknown
        return None
