"""Pass ``kl_attention``: the pairwise-KL softmax and every β-weighted sum read from it → one op.

What a model computes (spec §3.2, §4.1, §4.2; ``hecate/models/fep.py`` is one spelling)::

    KL_ij = KL(N(μ_i, v_i) ‖ N(μ_j, v_j))                 # [*L, N, N], from the [*L, N, N, K] broadcast
    β     = softmax(−KL / κ  over the allowed keys, dim=-1)
    ... Σ_j β_ij V_j (β @ V, einsum, (β[..., None] * V[:, None]).sum(-2)), Σ_j β_ij KL_ij, ...

What replaces it: ``hecate.kl_attention(μ, v, V, W, κ, causal, mask_diagonal)`` (see its op.py),
whose outputs are the sums Σ_j β_ij V_j, Σ_j β_ij KL_ij V_j, Σ_j β_ij KL_ij, Σ_j β_ji W_j,
Σ_j β_ji KL_ji W_j and Σ_j β_ji (Σ_l β_jl KL_jl) W_j.

L is any number of leading dims: none (one sequence, beliefs [N, K]), a batch [B], a batch and
heads [B, H], ... The positions are always the last two dims of the score and the last but one
of the beliefs; the replacement folds L into the op's B ([*L, N, K] → [prod(L), N, K]) and
unfolds its outputs. μ and σ² may broadcast against each other over L (one σ² for every head), and
σ² may be the same at every position: one per feature [K], per head [H, 1, K], per sequence
[B, 1, K], or 0-d; the replacement broadcasts it to the means' [*L, N, K] (its gradient is summed
back by the broadcast's backward).

How, by what the code computes rather than how it is spelled:

1. Every softmax over the key axis of a [*L, N, N] score is a candidate. Masks are peeled off
   (``masked_fill(·, −inf)``, ``torch.where(·, ·, −inf)``, an additive mask): each is evaluated
   (it depends on sizes only) and compared with the masks the op knows: none, causal j ≤ i,
   no-self j ≠ i, both.
2. The score's subgraph is cut where per-position tensors [*L, N, K] are broadcast into the pair
   space (``x.unsqueeze(-3)`` / ``x.unsqueeze(-2)``, ``x[:, None]``). If it is a pairwise score, it is
   evaluated in float64 at random points (a private generator) and must equal −KL(q_i‖q_j)/κ
   for one of the per-position tensors as the means and another, or a tensor the score reads that
   is the same at every position (size 1 or absent at the position dim), as variance, log-variance,
   standard deviation, log-std or precision. So the log/ratio/square spelling,
   ``torch.distributions.kl_divergence`` of ``Normal``s, a KL computed per term and summed,
   any temperature spelling all read the same. The roles found (at positive values near 1) are
   confirmed at means of either sign and variances e^-8..e^8 (``gaussian.far_draw``): a relu or abs
   of a mean, a clamp or floor of a variance inside the pair space is not the KL there. A κ that
   changes with a 0-d tensor t of the graph (a learned temperature, a buffer, a float
   torch.compile(dynamic=True) passes in) is found by giving t a value per draw: κ = c·t or c/t,
   passed to the op as its run-time ``temperature``.
   Nodes of the score equal to γ·KL (γ a number) are KL factors.
3. Everything computed from β and KL until a sum over the key axis j (``sum(dim=2)``, a matmul,
   bmm or einsum with per-key values) is read as a polynomial in the pair space (i, j, k)
   (:class:`_PairAlgebra`): each term is a coefficient times β_ij or β_ji, optionally times KL
   of the same orientation, times per-position factors of i only or j only. A sum over j of
   such a term is ``(i-factors) · (op output for the j-factors)``; the j-factors become the op's
   row values V (β_ij terms) or column values W (β_ji terms). The replacement is written as
   Python (:func:`_replacement`) and traced under the graph's fake mode, so shapes stay symbolic.

β or KL read whole (β returned by the model, β.sum(), ...) is formed beside the op in the matmul
form, [*L, N, N] (never [*L, N, N, K]); the report says so. A row with no allowed key gives what
the model's code gives: NaN from the softmax of all −inf, or 0 where the model zero-fills β at
the masked keys. If something computed from β or KL is used in a way the algebra cannot read,
the graph is left as is and the first reason is reported with the user's source line.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from hecate.compiler.normalize import emit, exp_factor, is_row_max, undetached
from hecate.passes.report import FusionReport
from hecate.passes.gaussian import (VARIANCE_FROM, Temperature, _is_noop, equals_scaled, evaluate, far_draw,
                                    gaussian_kl, independent, nearest_sources, proportion, run_time_temperature,
                                    shape_of, short, sources_shaped, strip_noops, where_read_apart)
from hecate.passes.matching import (NotFused, bound_reason, constant_tensor, depends_on_sizes_only, first_threshold,
                                    is_one, is_zeros, nodes_between, number_of, replace_with_function,
                                    same_shape, shifted_size, size_hint, tensors_read, written_in_place)

PATTERN = "kl_attention"
OP_NAME = "hecate.kl_attention"
aten = torch.ops.aten
_NEG_INF = float("-inf")


# ---------------------------------------------------------------------------------------------
# 1. the score and its mask, by what they compute


@dataclass
class _Score:
    """A softmax recognised as pairwise-KL attention."""

    softmax: fx.Node
    beta: fx.Node  # the softmax, or its zero-fill at the masked keys
    mean: fx.Node  # [*L, N, K]
    # the variance through VARIANCE_FROM[parameterisation]: [*L, N, K], or the same at every position ([K], 0-d, ...)
    scale: fx.Node
    parameterisation: str
    kappa: "float | Temperature"
    causal: bool
    mask_diagonal: bool
    empty_rows_nan: bool  # a row with no allowed key is NaN (the softmax's), not 0
    additive_mask: bool  # the mask is added to the score (its backward lets a NaN row reach the KL)
    kl_scales: dict  # node -> γ for the score's nodes whose value is γ · KL_ij
    draw: dict  # the per-position tensors' values the score was evaluated at, and ("kl",): KL there
    nodes: list  # the score's nodes and its masking, up to the softmax
    rank: int  # the score's dims: its leading dims (batch, heads, ...; maybe none), then [N, N]
    # masks read at run time (a causal mask a model keeps in a buffer): (node, "masked" | "allowed")
    run_time_masks: list = field(default_factory=list)
    # the zero-fills of β's factors that :func:`_unfill_weighted_by_beta` took out: put back unless fused
    unfilled: list = field(default_factory=list)
    # tensors the score reads that β does not depend on (a number per query added to it): the op does not read
    # them, but their gradient is 0, not None, and a non-finite one makes its row NaN, as in eager
    ignored: list = field(default_factory=list)


VANISHING_FILL = -1000.0  # exp(−1000) is 0 in float64


def _peel_masks(x: fx.Node) -> tuple[fx.Node, list[tuple[fx.Node, str]], list[fx.Node], bool]:
    """(the unmasked logits, [(mask node, kind), ...], the nodes peeled, whether a mask is added to the score).
    Kinds: "masked" / "allowed" (filled with −inf where the mask is True / False), "additive", and for a finite
    fill (masked_fill or torch.where) "vanishing" / "vanishing_allowed" or "finite" (:func:`_fill_kind`)."""
    masks, peeled, added = [], [], False
    while True:
        peeled.append(x)
        x = strip_noops(x)
        t, args = x.target, x.args
        # (mask, kind, score) of a fill: masked_fill(s, m, c) and where(m, c, s) fill where m, where(m, s, c) where
        # not m; c = −inf is the op's own mask, a finite c is read by _fill_kind
        if t == aten.masked_fill.Scalar and isinstance(args[2], (int, float)) and not isinstance(args[2], bool):
            fill = (args[1], "masked", args[0], float(args[2]))
        elif t == aten.where.ScalarOther or t == aten.where.self and number_of(args[2]) is not None:
            fill = (args[0], "allowed", args[1], number_of(args[2]))
        elif t == aten.where.ScalarSelf or t == aten.where.self and number_of(args[1]) is not None:
            fill = (args[0], "masked", args[2], number_of(args[1]))
        else:
            fill = None
        if fill is not None and isinstance(fill[3], float) and not math.isnan(fill[3]) and fill[3] < math.inf:
            mask, kind, x, value = fill
            masks.append((mask, kind if value == _NEG_INF else _fill_kind(value, kind)))
        elif t == aten.add.Tensor and x.kwargs.get("alpha", 1) == 1 and all(isinstance(a, fx.Node) for a in args):
            constant = [a for a in args if depends_on_sizes_only(a)]
            fills = [(a, fill) for a in args if (fill := _neg_inf_fill(a)) is not None]
            if len(constant) == 1:
                masks.append((constant[0], _additive_kind(constant[0])))
                x = args[1] if constant[0] is args[0] else args[0]
            elif len(fills) == 1:  # s + where(m, 0, -inf) read at run time: masked_fill(s, ~m, -inf) for s < +inf
                (a, fill), added = fills[0], True
                masks.append(fill)
                x = args[1] if a is args[0] else args[0]
            elif len(finite := [a for a in args if _scaled_by_vanishing_number(a)]) == 1:
                # s + (1 − m)·finfo.min read at run time: reported by _allowed, as a finite fill read so
                masks.append((finite[0], "vanishing_added"))
                x = args[1] if finite[0] is args[0] else args[0]
            else:
                break
        elif t == aten.sub.Tensor and x.kwargs.get("alpha", 1) == 1 and all(isinstance(a, fx.Node) for a in args) \
                and depends_on_sizes_only(args[0]) != depends_on_sizes_only(args[1]):
            # c − s or s − c, a mask c made from sizes: rewritten −s + c or −c + s (exact in IEEE), the spellings
            # the op reads
            total, negated = _as_sum_of_the_negation(x)
            peeled = [total if p is x else p for p in peeled]
            if depends_on_sizes_only(args[0]):
                masks.append((args[0], "additive"))
                x = negated
            else:
                masks.append((negated, _additive_kind(negated)))
                x = args[0]
        else:
            break
        peeled.append(x)
    return x, masks, peeled, added


def _as_sum_of_the_negation(difference: fx.Node) -> tuple[fx.Node, fx.Node]:
    """Replace ``a − b`` by ``(−b) + a`` in the graph (the same values: IEEE subtraction is the addition of the
    negation); returns (the sum, −b)."""
    a, b = difference.args
    graph = difference.graph
    with graph.inserting_before(difference):
        negated = graph.call_function(aten.neg.default, (b,))
        total = graph.call_function(aten.add.Tensor, (negated, a))
    negated.meta.update({k: v for k, v in b.meta.items() if k in ("val", "tensor_meta")})
    total.meta.update(difference.meta)
    if "stack_trace" in difference.meta:
        negated.meta["stack_trace"] = difference.meta["stack_trace"]
    difference.replace_all_uses_with(total)
    graph.erase_node(difference)
    return total, negated


def _fill_value(node: fx.Node) -> float | None:
    """The finite number a masked_fill or where fills with, or None."""
    if node.target == aten.masked_fill.Scalar:
        return node.args[2]
    if node.target in (aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.self):
        numbers = [number_of(a) for a in node.args[1:]]
        return next((n for n in numbers if n is not None and math.isfinite(n)), None)
    return None


def _fill_kind(value: float, kind: str) -> str:
    """The kind of a mask filled with a finite ``value``: "vanishing" (masked where True) or "vanishing_allowed"
    (allowed where True) when its exp vanishes beside a score of 0, the op's −inf where every query keeps its own
    key (whose score, −KL_ii/κ = 0, bounds the row's max from below; exp(fill − max) is 0 in float64 too); else
    "finite", reported once the score is a KL's."""
    if value > VANISHING_FILL:
        return "finite"
    return "vanishing" if kind == "masked" else "vanishing_allowed"


def _additive_kind(mask: fx.Node) -> str:
    """The kind of a mask made from sizes that is added to the score: "vanishing_added" when it holds 0 and finite
    numbers at or below VANISHING_FILL (``(1 − causal) * -1e9``, ``finfo.min``), as a finite fill; else
    "additive" (0 and −inf, or what :func:`_allowed` reports)."""
    try:
        value = evaluate(mask, {}, size_hint=size_hint)
    except NotFused:
        return "additive"
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        return "additive"
    finite = value[torch.isfinite(value) & (value != 0)]
    below = bool(((value == 0) | (value <= VANISHING_FILL)).all())
    return "vanishing_added" if finite.numel() and below else "additive"


def _scaled_by_vanishing_number(node: fx.Node) -> bool:
    """Whether ``node`` is a tensor times a finite number at or below VANISHING_FILL (an additive mask
    ``(1 − m) * torch.finfo(dtype).min``, ``m * -1e9``)."""
    node = strip_noops(node)
    if node.target not in (aten.mul.Tensor, aten.mul.Scalar):
        return False
    numbers = [c for a in node.args if (c := number_of(a)) is not None]
    return len(numbers) == 1 and math.isfinite(numbers[0]) and numbers[0] <= VANISHING_FILL


def _neg_inf_fill(node: fx.Node) -> tuple[fx.Node, str] | None:
    """(cond, "masked" | "allowed") when ``node`` holds −inf where cond is True (False) and 0 elsewhere:
    ``zeros.masked_fill(cond, -inf)``, ``torch.where(cond, 0, -inf)`` and their kin."""
    node = strip_noops(node)
    t, args = node.target, node.args
    if t == aten.masked_fill.Scalar and is_zeros(args[0]) and args[2] == _NEG_INF:
        return args[1], "masked"
    if t in (aten.where.self, aten.where.Scalar, aten.where.ScalarSelf, aten.where.ScalarOther):
        when_true, when_false = number_of(args[1]), number_of(args[2])
        if (when_true, when_false) == (0, _NEG_INF):
            return args[0], "allowed"
        if (when_true, when_false) == (_NEG_INF, 0):
            return args[0], "masked"
    return None


def _broadcast_side(node: fx.Node, rank: int, n) -> tuple[fx.Node, str] | None:
    """(x, "i" | "j") when ``node`` is a [*L, N, K] tensor x (``rank`` = len(L) + 2 dims) broadcast as
    [*L, N, 1, K] ("i") or [*L, 1, N, K] ("j"). ``n``: the score's N; an x of size 1 at the position
    dim ([B, 1, K]) where N is not 1 is shared across positions, not per position (see :func:`_shared`)."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    x, out = node.args[0], shape_of(node)
    src = shape_of(x)
    lead = rank - 2
    if node.target == aten.unsqueeze.default and src is not None and len(src) == rank - 1 and out is not None \
            and len(out) == rank and src[-1] == n and node.args[1] % rank in (lead, lead + 1):
        # a per-position number [*L, N] (a log-determinant Σ_k log v) broadcast into the score [*L, N, N]
        return strip_noops(x), ("i" if node.args[1] % rank == lead + 1 else "j")
    if src is None or out is None or len(src) != rank or len(out) != rank + 1 or _shared(src, rank, n):
        return None
    if node.target == aten.unsqueeze.default:
        dim = node.args[1] % (rank + 1)
    elif (node.target in (aten.view.default, aten.reshape.default) and out[-1] == src[-1]
          and out[:lead] == src[:lead]):
        dim = (lead + 1 if (out[lead + 1] == 1 and out[lead] == src[lead])
               else lead if (out[lead] == 1 and out[lead + 1] == src[lead]) else None)
    else:
        return None
    if dim not in (lead, lead + 1):
        return None
    return strip_noops(x), ("i" if dim == lead + 1 else "j")


_PRODUCTS = (aten.matmul.default, aten.bmm.default, aten.einsum.default)


def _product_operands(node: fx.Node, rank: int) -> tuple[fx.Node, fx.Node] | None:
    """(x, y) when ``node`` computes x @ yᵀ over their last dim: matmul or bmm with y transposed, or an
    einsum such as ``"bik,bjk->bij"``."""
    if node.target is aten.einsum.default:
        equation, operands = node.args[0], node.args[1]
        inputs, _, out = equation.replace(" ", "").partition("->")
        terms = inputs.split(",")
        if len(terms) != 2 or len(operands) != 2 or not all(len(t) == rank for t in terms + [out]):
            return None
        (a, b), lead = terms, out[:-2]
        if not (a[:-2] == b[:-2] == lead and a[-1] == b[-1] and a[-2] == out[-2] and b[-2] == out[-1]
                and len(set(out + a[-1])) == rank + 1):
            return None
        return strip_noops(operands[0]), strip_noops(operands[1])
    if len(node.args) != 2 or not all(isinstance(a, fx.Node) for a in node.args):
        return None
    x, y = strip_noops(node.args[0]), strip_noops(node.args[1])
    if not (y.target is aten.transpose.int and {d % rank for d in y.args[1:]} == {rank - 2, rank - 1}
            or y.target is aten.permute.default and list(y.args[1])[-2:] in ([rank - 1, rank - 2], [-1, -2])):
        return None
    return x, strip_noops(y.args[0])


_GATHERS = (aten.repeat_interleave.self_int, aten.repeat_interleave.self_Tensor, aten.repeat.default,
            aten.index.Tensor, aten.index_select.default)


def _gathered_pairs(logits: fx.Node, n, depth: int = 24) -> fx.Node | None:
    """A per-position tensor gathered into every pair, [..., N·N, K] (``mu.repeat_interleave(n, 1)``,
    ``mu[:, ii]``), that the score [..., N, N] is computed from within ``depth`` ops, else None."""
    seen, frontier = set(), [logits]
    for _ in range(depth):
        parents = []
        for node in frontier:
            for x in node.all_input_nodes:
                if x in seen or x.op != "call_function":
                    continue
                seen.add(x)
                shape = shape_of(x)
                if x.target in _GATHERS and shape is not None and len(shape) >= 2 and x.meta["val"].is_floating_point() \
                        and statically_known_true(shape[-2] == n * n):
                    return x
                parents.append(x)
        frontier = parents
    return None


def _product_sides(node: fx.Node, rank: int, n) -> list[tuple[fx.Node, str]] | None:
    """[(x, "i"), ..., (y, "j"), ...] when ``node`` is a matrix product x @ yᵀ [*L, N, N] of per-position tensors
    x, y [*L, N, K]: those, and the per-position tensors [*L, N, ·] they are computed from, on their side."""
    out = shape_of(node)
    if node.target not in _PRODUCTS or out is None or len(out) != rank \
            or not (statically_known_true(out[-1] == n) and statically_known_true(out[-2] == n)):
        return None
    operands = _product_operands(node, rank)
    if operands is None:
        return None
    x, y = operands
    if any(shape_of(t) is None or len(shape_of(t)) != rank for t in (x, y)):
        return None

    def per_position(shape):
        return len(shape) == rank and statically_known_true(shape[-2] == n)
    return [(t, side) for t, side in ((x, "i"), (y, "j")) for t in [t] + sources_shaped(t, per_position)]


def _walk_to_the_pairs(logits: fx.Node, rank: int, n, with_products: bool) -> tuple[dict, dict, list, set]:
    """({broadcast per-position tensor: sides}, {per-position tensor of a matrix product x_i · y_j and what it is
    computed from: sides}, the score's nodes, the broadcasts and products where the walk up from ``logits``
    stopped). Without ``with_products`` a product is one of the score's nodes."""
    bases: dict[fx.Node, set] = {}
    products: dict[fx.Node, set] = {}
    nodes, broadcasts, seen, stack = [], set(), set(), [logits]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        side = _broadcast_side(node, rank, n)
        product = _product_sides(node, rank, n) if with_products and side is None else None
        if side is not None:
            bases.setdefault(side[0], set()).add(side[1])
            broadcasts.add(node)
        elif product is not None:
            for x, s in product:
                products.setdefault(x, set()).add(s)
            broadcasts.add(node)
        elif node.op == "call_function":
            nodes.append(node)
            stack.extend(node.all_input_nodes)
    return bases, products, nodes, broadcasts


def _score_inputs(logits: fx.Node, rank: int) -> tuple[dict, list[fx.Node], list[fx.Node], list[fx.Node]]:
    """({broadcast per-position tensor: sides}, [tensors the same at every position], the score's nodes,
    [other tensors it reads]).

    The tensors no belief flows into meet the pair space as inputs of the score's ops that read the
    beliefs. Those the same at every position (:func:`_shared`) are listed with what they are computed
    from that is too (``log_var`` [K] and ``log_var.exp()[None, None]`` [1, 1, 1, K]): a shared
    variance is one of them; the others stop the fusion."""
    n = shape_of(logits)[-1]
    bases, products, nodes, broadcasts = _walk_to_the_pairs(logits, rank, n, with_products=True)
    if products and any(len(shape_of(b)) == rank - 1 for b in bases):
        # the KL expanded into products: Σ_k a_ik b_jk plus numbers per query and per key (Σ_k log v_jk)
        for x, sides in products.items():
            bases.setdefault(x, set()).update(sides)
    elif products:  # a product alone (q·kᵀ) is dot-product attention, not this family: its nodes are the score's
        bases, _, nodes, broadcasts = _walk_to_the_pairs(logits, rank, n, with_products=False)
    order = {node: i for i, node in enumerate(logits.graph.nodes)}
    nodes.sort(key=order.__getitem__)
    paired = set(broadcasts)  # the nodes a belief flows into
    for node in nodes:
        if any(i in paired for i in node.all_input_nodes):
            paired.add(node)
    frames = defaultdict(set)  # what the pair-space nodes read that no belief flows into -> their dims
    for node in nodes:
        if node in paired:
            for x in node.all_input_nodes:
                if x not in paired and (not depends_on_sizes_only(x) or _made_from_size_number(x)):  # (tuple: None)
                    frames[x].add(_rank(node) if shape_of(node) is not None else None)
    shared = {x for x, fs in frames.items() if all(_shared(shape_of(x), rank, n, frame) for frame in fs)}
    others = [x for x in frames if x not in shared]
    seen, stack = set(shared), [i for x in shared for i in x.all_input_nodes]
    while stack:  # what those are computed from, as long as it is the same at every position too
        x = stack.pop()
        if x not in seen and x not in frames and not depends_on_sizes_only(x) and _shared(shape_of(x), rank, n):
            shared.add(x)
            stack.extend(x.all_input_nodes)
        seen.add(x)
    return bases, sorted(shared, key=order.__getitem__), nodes, others


def _shared(shape, rank: int, n, frame: int | None = None) -> bool:
    """Whether a tensor of ``shape`` is the same at every position, as a variance [K], [H, 1, K],
    [B, 1, K] or a 0-d one is (N = ``n`` not 1): of size 1 or absent at both position dims of the
    ``frame`` it is read in, the pair space [*L, N, N, K] (``rank`` + 1 dims, ``rank`` = len(L) + 2)
    or the score [*L, N, N] (``rank``; there a [N] is per key); without a frame, at the position
    dim of the beliefs' [*L, N, K] or at both of the pair space."""
    if shape is None or size_hint(n) == 1:
        return False
    if frame is None:
        frame, positions = (rank + 1, (-3, -2)) if len(shape) == rank + 1 else (rank, (-2,))
    else:
        positions = {rank + 1: (-3, -2), rank: (-2, -1)}.get(frame, ())
    if not positions or len(shape) > frame:
        return False
    return all(len(shape) < -p or (isinstance(shape[p], int) and shape[p] == 1) for p in positions)


def _not_a_product(node: fx.Node) -> bool:
    return not (node.op == "call_function" and node.target in (aten.matmul.default, aten.bmm.default,
                                                                 aten.einsum.default))


def _describe_other(node: fx.Node) -> str:
    """Why a score input that is not a belief stops the fusion, in the user's terms."""
    value = node.meta.get("val")
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        return (f"a 0-d tensor {node.name} that is neither the KL's variance nor a temperature it is divided or "
                "multiplied by (κ = c·t or c/t)")
    contractions = sorted((u for u in node.users if u.target is aten.einsum.default),  # the pair space's first
                          key=lambda u: -max(map(len, u.args[0].partition("->")[0].split(","))))
    if isinstance(value, torch.Tensor) and contractions:
        return (f"{node.name} of shape {list(value.shape)}, contracted with the pair space by einsum "
                f"{contractions[0].args[0]!r}: kl_attention reads the KL written per pair, μ and σ² broadcast as "
                "[..., N, 1, K] against [..., 1, N, K] and summed over K, or multiplied out into matrix products")
    if isinstance(value, torch.Tensor) and not _not_a_product(node) and value.dim() >= 2 \
            and statically_known_true(value.shape[-1] == value.shape[-2]):
        return (f"{node.name}, a matrix product of per-position tensors (a term of the KL expanded into products, "
                "such as the trace Σ_k v_ik / v_jk): kl_attention reads the KL written per pair, μ and σ² broadcast "
                "as [..., N, 1, K] against [..., 1, N, K]")
    if isinstance(value, torch.Tensor) and value.dim() >= 2 and tensors_read([node]) \
            and statically_known_true(value.shape[-1] == value.shape[-2]):
        return (f"{node.name}, a pair-shaped tensor {list(value.shape)} read from {_source_names(node)} at run time "
                "and added to the score (a score bias, or a 0/−inf mask kept in a buffer): the op takes no bias, "
                "and a mask as bool, masked_fill(mask == 0, float('-inf')), which fuses")
    along = ("query" if is_one(value.shape[-1]) else "key" if is_one(value.shape[-2]) else None) \
        if isinstance(value, torch.Tensor) and value.dim() >= 2 else None
    how = {u.target for u in node.users}
    if along is not None and how & {aten.add.Tensor, aten.sub.Tensor}:
        return (f"{node.name}, a tensor {list(value.shape)} of one number per {along} added to the score (an additive "
                "mask, 0/−inf per key, or a bias): the op takes no bias; a padding mask as bool, "
                "masked_fill(~keep, float('-inf')), fuses")
    if along is not None and how & {aten.mul.Tensor, aten.div.Tensor}:
        return (f"{node.name}, a tensor {list(value.shape)} of one number per {along} that scales the score (a "
                "temperature κ per position): kl_attention takes one κ, a number or a 0-d tensor read at run time")
    if isinstance(value, torch.Tensor):
        return (f"{node.name}, a tensor of shape {list(value.shape)} that is neither laid out per position like "
                "the means ([..., N, K]) nor the same at every position (size 1 or absent at the position dim, "
                "as a shared variance is)")
    return f"a value computed at run time ({node.name}) that is not a tensor"


def _size_numbers_as_tensors(graph: fx.Graph) -> None:
    """Multiply or divide a floating tensor by a 0-d tensor of a number computed from sizes torch.compile passes in
    (κ = √K under dynamic=True), not by that number: the score then reads it as it reads a learned temperature,
    drawn when the KL is checked and passed to the op at run time. Exact: ATen takes a Python number as such a
    0-d tensor (it casts to the floating tensor's dtype either way)."""
    for node in list(graph.nodes):
        if node.target not in (aten.mul.Tensor, aten.div.Tensor) or len(node.args) != 2 or node.kwargs:
            continue
        for i, (tensor, number) in enumerate(zip(node.args, reversed(node.args))):
            if i == 1 and node.target is aten.div.Tensor:
                break  # (a number divided by a tensor is no temperature)
            if _is_size_number(number) and isinstance(val := tensor.meta.get("val"), torch.Tensor) \
                    and val.is_floating_point() and val.dim() >= 2:
                with graph.inserting_before(node):
                    as_tensor = emit(graph, aten.scalar_tensor.default, number, dtype=torch.float64)
                node.args = tuple(as_tensor if a is number else a for a in node.args)
                break


def _is_size_number(node: Any) -> bool:
    """Whether ``node`` is a number computed at run time from sizes (a SymInt or SymFloat, not a tensor)."""
    return isinstance(node, fx.Node) and isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat))


def _made_from_size_number(node: fx.Node) -> bool:
    """Whether ``node`` is a 0-d tensor of a number computed at run time from sizes (see
    :func:`_size_numbers_as_tensors`): read like a temperature tensor, not evaluated as a constant."""
    return node.target is aten.scalar_tensor.default and _is_size_number(node.args[0])


def _recognise(softmax: fx.Node) -> _Score | None:
    """The attention ``softmax`` computes, or None when its score is not a pairwise one.

    Raises NotFused (the reason in the user's terms) for a pairwise score the op cannot take.
    """
    x, dim = softmax.args[0], softmax.args[1]
    shape = shape_of(x)
    if shape is None or len(shape) < 2:
        return None
    rank = len(shape)
    logits, masks, peeled, added = _peel_masks(x)
    bases, shared, nodes, others = _score_inputs(logits, rank)
    if not any(sides == {"i", "j"} and len(shape_of(b)) == rank for b, sides in bases.items()):
        gathered = _gathered_pairs(logits, shape[-1])
        if gathered is not None:
            raise NotFused(f"the pairs are gathered, not broadcast ({gathered.name}, {short(gathered.target)} to "
                           f"{list(shape_of(gathered))}, then viewed as [N, N]): kl_attention reads a score of μ and "
                           "σ² broadcast as [..., N, 1, K] against [..., 1, N, K] (or expanded to those and "
                           "flattened), which fuses")
        return None  # not a score of broadcast pairs of features (e.g. q @ kᵀ): not this family
    if dim % rank != rank - 1:
        raise NotFused(f"softmax over dim {dim} of the {_dims(rank)} pairwise score does not normalise over "
                       "the keys (dim -1)")
    writer = written_in_place(softmax)
    if writer is not None:
        raise NotFused(f"β is written in place after the softmax ({writer.name}): the fused op's sums are those "
                       "of the softmax as computed")
    for node in nodes:  # t · kl.masked_fill(m, ±inf), t a 0-d tensor: t's sign decides 0 or NaN weights
        fill = node.args[2] if node.target is aten.masked_fill.Scalar else None
        if isinstance(fill, float) and math.isinf(fill) and any(
                u.target in (aten.mul.Tensor, aten.div.Tensor) and any(
                    isinstance(a, fx.Node) and a is not node and shape_of(a) == () for a in u.args)
                for u in node.users):
            raise NotFused("the mask is applied before a temperature held as a tensor (masked_fill(±inf), then "
                           "× or / a 0-d tensor t): whether masked pairs get weight 0 or NaN turns on t's sign, "
                           "not known when compiling; apply the mask after the temperature, "
                           "(t · kl).masked_fill(mask, -inf), which fuses")
    flags = [x for x in [*bases, *shared, *others] if _is_bool(x) and any(map(_is_bool, tensors_read([x])))]
    if flags:  # a bool tensor the masks peeled do not account for
        raise NotFused(_stray_mask_reason(flags[0]))
    if others:  # a matrix product first: the KL expanded into products says most
        raise NotFused(f"the pairwise score also reads {_describe_other(min(others, key=_not_a_product))}")
    k = {size_hint(shape_of(b)[-1]) for b in bases if len(shape_of(b)) == rank}
    both = {size_hint(shape_of(b)[-1]) for b, sides in bases.items() if len(shape_of(b)) == rank and len(sides) == 2}
    if len(k) > 1 and len(both) == 1:  # (the beliefs, read on both sides, under features joined from them:
        k = both                       # the KL expanded by hand into [v + μ², μ]·[1/2v, −μ/v])
    if len(k) == 2 and 1 in k:  # (a variance one number per position, σ² [.., N, 1] against means [.., N, K])
        raise NotFused(f"the score reads per-position tensors of one feature [..., N, 1] beside ones of {max(k)} "
                       "(an isotropic variance, one per position for every feature?): kl_attention reads the KL of "
                       "per-feature variances; expand it to the means' features, var.expand_as(mu), which fuses")
    if len(k) != 1:
        raise NotFused(f"the score's per-position tensors have different feature sizes {sorted(k)}")
    kappa, mean, scale, param, memo = _match_kl(logits, list(bases), shared, rank - 2, k.pop())
    bound = first_threshold(nodes_between([mean, scale] + ([kappa.node] if isinstance(kappa, Temperature) else []),
                                          [logits]), memo)
    if bound is not None:  # (a clamp the far draw does not reach: v_j.clamp(min=1e-4), μ_j.clamp(-10, 10))
        raise NotFused(bound_reason(bound, "the pairwise score (the KL at the points checked)"))
    finite = [node for node, kind in masks if kind == "finite"]
    if finite:
        fill = next((f for u in finite[0].users for f in [_fill_value(u)] if f is not None), None)
        raise NotFused(f"the KL score is masked with {'a finite number' if fill is None else f'{fill:g}'}, whose exp "
                       f"does not vanish: the masked keys keep a weight the op's −inf masking drops; a fill of "
                       f"{VANISHING_FILL:g} or below (-1e9) or float('-inf') fuses")
    _check_leading_dims(shape, mean, scale, param)
    kl_scales = {}
    # γ·KL with γ a number: not a node the temperature reaches (its γ changes with the temperature)
    tempered = _computed_from(kappa.node, nodes) if isinstance(kappa, Temperature) else set()
    for n in nodes:
        if shape_of(n) == shape and n in memo and n not in tempered:
            gamma = proportion(memo[n], memo[("kl",)])
            if gamma is not None:
                kl_scales[n] = gamma
    draw = {key: value for key, value in memo.items() if key in bases or key in shared or key == ("kl",)}
    # the masks built from sizes at the example's length and, where it is symbolic, at another: one kind at both
    lengths = _lengths(shape)
    alloweds, run_time_masks = zip(*(_allowed(masks, shape, size) for size in lengths))
    if _mask_kind_or_none(alloweds[0]) is None and all(_run_time_mask(node, kind, shape, made_here=True)
                                                        for node, kind in masks):
        # a bool mask made from sizes that is none of the kernels' (a sliding window): the op takes the graph's
        # own mask at run time, as it takes one passed in
        alloweds = tuple(torch.ones_like(a) for a in alloweds)
        run_time_masks = tuple(list(masks) for _ in lengths)
    kinds = [_mask_kind(alloweds[0])] + [_mask_kind_or_none(a) for a in alloweds[1:]]
    if len(set(kinds)) > 1:
        raise NotFused(f"the attention mask built from sizes allows {int(alloweds[0].sum())} of "
                       f"{alloweds[0].shape[0]}×{alloweds[0].shape[0]} pairs at this length, {int(alloweds[1].sum())} "
                       f"of {alloweds[1].shape[0]}×{alloweds[1].shape[0]} at another: it is not one of the op's "
                       "masks at every length (it reads the length beyond the score's shape)")
    (causal, mask_diagonal), allowed, run_time_masks = kinds[0], alloweds[0], run_time_masks[0]
    if (mask_diagonal or run_time_masks) and any(kind.startswith("vanishing") for _, kind in masks):
        drops = "drops each query's own key" if mask_diagonal else \
            "is combined with one read at run time, which may drop a query's own key"
        raise NotFused("the KL score is masked with a finite number (masked_fill with -1e9, or an added "
                       f"(1 − mask)·-1e9, say) and the mask {drops}: "
                       "it equals the op's −inf masking only where every query keeps its own key (whose score, 0, "
                       "bounds the row from below); a row with no allowed key gets uniform weights where the op "
                       "gives NaN; masked_fill with float('-inf') fuses")
    # with a mask read at run time, the rows with no allowed key are known at run time
    has_empty_row = mask_diagonal and (causal or allowed.shape[0] == 1) or bool(run_time_masks)
    beta, empty_rows_nan = softmax, has_empty_row
    users = list(softmax.users)
    if len(users) == 1 and all(_zero_fill_of_masked(users[0], softmax, a, size) for a, size in zip(alloweds, lengths)):
        beta, empty_rows_nan = users[0], False
    unfilled = [] if has_empty_row else _unfill_weighted_by_beta(beta, alloweds, lengths)
    additive = added or any(kind in ("additive", "vanishing_added") for _, kind in masks)
    read = {mean, scale} | ({kappa.node} if isinstance(kappa, Temperature) else set())
    ignored = [b for b in independent([*bases, *shared]) if b not in read and not _computed_from(b, list(read))
               and isinstance(b.meta.get("val"), torch.Tensor) and b.meta["val"].is_floating_point()]
    return _Score(softmax, beta, mean, scale, param, kappa, causal, mask_diagonal, empty_rows_nan, additive,
                  kl_scales, draw, [n for n in peeled if n is not logits] + nodes, rank, run_time_masks, unfilled,
                  ignored)


def _stray_mask_reason(flag: fx.Node) -> str:
    """Why a bool tensor passed in stops the fusion: the op that applies it (through views and other bools)."""
    user, stack = None, [flag]
    while stack and user is None:
        for u in stack.pop().users:
            if _is_bool(u):
                stack.append(u)
            elif user is None:
                user = u
    fill = [a for a in user.args if not isinstance(a, fx.Node)] if user is not None else []
    return (f"the score reads the bool tensor {flag.name} (from {_source_names(flag)}) through "
            f"{user.name + ' (' + short(user.target) if user is not None else 'a view ('}"
            f"{', with ' + ', '.join(map(repr, fill)) if fill else ''}), which is no mask of −inf the op takes: "
            "masked_fill(mask, float('-inf')), torch.where(mask, s, float('-inf')) or an added "
            "zeros(...).masked_fill(mask, float('-inf')) fuse")


def _is_bool(node: fx.Node) -> bool:
    """Whether ``node`` holds a bool tensor (a mask, or a comparison)."""
    return getattr(node.meta.get("val"), "dtype", None) == torch.bool


def _check_leading_dims(shape, mean: fx.Node, scale: fx.Node, param: str) -> None:
    """The score's leading dims are μ's and σ²'s, one of them 1 where the other spans a dim (NotFused if not):
    so the replacement reads each leading size off μ or σ², and folds them into the op's B. A σ² shared
    across positions may have fewer dims ([K], 0-d): it is read as broadcasting does, from the right."""
    m, s = shape_of(mean), shape_of(scale)
    s = (1,) * (len(m) - len(s)) + s
    for d, size in enumerate(shape[:-2]):
        if not ((m[d] == size and s[d] in (1, size)) or (s[d] == size and m[d] == 1)):
            raise NotFused(f"the score {_dims(len(shape))} is {list(shape)} but the means {mean.name} are "
                           f"{list(m)} and the {param} {scale.name} {list(s)}: its leading dim {d} is not theirs "
                           "(it broadcasts against something else)")


def _dims(rank: int) -> str:
    """How a pairwise score of ``rank`` dims is named in reasons: [N, N], [B, N, N], [B, H, N, N], ..."""
    lead = ["B", "H"][:rank - 2] + [f"L{i}" for i in range(2, rank - 2)]
    return "[" + ", ".join(lead + ["N", "N"]) + "]"


def _kl_scale(node: fx.Node, draw: dict, rank: int) -> float | None:
    """γ when ``node`` computes γ · KL_ij from the same beliefs (a second copy of the KL, say); else None."""
    shape = shape_of(node)
    if shape is None or len(shape) != rank or not statically_known_true(shape[-1] == shape[-2]):
        return None
    bases, shared, _, others = _score_inputs(node, rank)
    if others or not bases or any(b not in draw for b in [*bases, *shared]):
        return None
    try:
        value = evaluate(node, dict(draw))
    except Exception:  # not evaluable at the draw's sizes: not recognisable as a KL
        return None
    return proportion(value, draw[("kl",)]) if isinstance(value, torch.Tensor) else None


def _pairwise_kl(m, v):
    """KL(q_i ‖ q_j) [*L, N, N] of beliefs [*L, N, K]."""
    return gaussian_kl(m.unsqueeze(-2), v.unsqueeze(-2), m.unsqueeze(-3), v.unsqueeze(-3))


# Largest pairwise broadcast [*L, N, N, K] evaluated at a score's own sizes (float64: 128 MiB).
_MAX_OWN_SIZE_DRAW = 2 ** 24


def _draws(logits, bases, shape, constants, own_sizes: bool = False) -> list:
    """Two (draw, evaluated values, score) at random float64 beliefs of ``shape(base)``, a positive range each,
    and the ``constants`` (node → value) the score reads; ``own_sizes``: at the graph's sizes, where its
    expands are real (see :func:`evaluate`)."""
    gen = torch.Generator().manual_seed(20251123)
    draws = []
    for low, high in ((0.3, 2.0), (0.05, 4.0)):
        env = {b: low + (high - low) * torch.rand(shape(b), generator=gen, dtype=torch.float64) for b in bases}
        memo = {**constants, **env}
        draws.append((env, memo, evaluate(logits, memo, expand=own_sizes)))
    return draws


def _match_kl(logits, bases, shared, lead, k):
    """:func:`_match_kl_drawing` the tensors the beliefs are computed from; where that fails, drawing instead the
    value each is turned into before the score reads it in several places (``var = softplus(raw) + 1e-3``, read
    as ``1/var``, ``var + μ²`` and ``log var`` by a KL multiplied out): the variance a parameterisation of
    ``raw`` gives. The first attempt's reason stands where neither matches."""
    try:
        return _match_kl_drawing(logits, bases, shared, lead, k, lift=False)
    except NotFused as first:
        try:
            return _match_kl_drawing(logits, bases, shared, lead, k, lift=True)
        except NotFused:
            raise first from None


def _match_kl_drawing(logits, bases, shared, lead, k, lift):
    """(κ, mean, scale, parameterisation, evaluated values) with logits = −KL/κ; else NotFused.

    ``bases`` the per-position tensors [*L, N, K] (``lead`` = len(L)), ``shared`` those the same at
    every position (see :func:`_score_inputs`): each one of up to ``lead`` + 2 dims is tried as the
    variance, broadcast to the means' [*L, N, K], never as the means. What the others are not computed
    from is drawn (the graph's constants are read): the per-position tensors [2, .., 2, 5, k], the
    shared ones at their own sizes but 2 for a leading dim the beliefs span; or all at their own sizes
    where the score bakes its sizes in (``mu.view(n, 1, k)`` of a static graph)."""
    constants = {b: (v.double() if v.is_floating_point() else v) for b in shared
                 if (v := constant_tensor(b)) is not None}  # read, not drawn
    numbers = {b for b in bases if len(shape_of(b)) == lead + 1}  # per-position numbers [*L, N]
    # a number computed from a tensor [*L, N, K] the score does not broadcast (Σ log v beside exp(log v)):
    # that tensor is drawn, so the number and the broadcast tensors keep their relation
    sources = [s for b in numbers if not _computed_from_any(b, bases) for s in _feature_sources(b, lead, k)]
    bases = bases + [s for s in dict.fromkeys(sources) if s not in bases]
    drawn = [b for b in independent(bases + shared) if b not in constants]
    if lift:
        lifted = [where_read_apart(b, set(bases)) for b in drawn]
        if lifted == drawn:
            raise NotFused("nothing to draw in its place")
        bases, drawn = bases + [b for b in lifted if b not in bases], lifted
    means = [b for b in bases if b in drawn and b not in numbers]
    scales = [b for b in drawn if b not in shared and b not in numbers] + [b for b in shared
                                                                          if len(shape_of(b)) <= lead + 2]

    def small(b):
        if b not in shared:
            return (2,) * lead + ((5,) if b in numbers else (5, k))
        own = [1 if isinstance(s, int) and s == 1 else None for s in shape_of(b)]  # None: a size the beliefs span
        return tuple(s or 2 for s in own[:-2]) + tuple(s or k for s in own[-2:])

    own_sizes = False
    try:
        draws = _draws(logits, drawn, small, constants)
    except NotFused:
        raise
    except Exception as error:  # a spelling that cannot run at other sizes: try its own
        own_sizes = True
        own = {b: tuple(size_hint(s) for s in shape_of(b)) for b in drawn}
        n = max(s[-2] for b, s in own.items() if b not in shared)
        if math.prod(max(s[d] for b, s in own.items() if b not in shared) for d in range(lead)) * n * n * k \
                > _MAX_OWN_SIZE_DRAW:
            raise NotFused(f"the pairwise score could not be evaluated to check it is a KL ({type(error).__name__}: "
                           f"{str(error).splitlines()[0] if str(error) else ''}), and its own sizes are too large "
                           "to evaluate it at") from None
        try:
            draws = _draws(logits, drawn, own.__getitem__, constants, own_sizes=True)
        except NotFused:
            raise
        except Exception as e:
            raise NotFused(f"the pairwise score could not be evaluated to check it is a KL ({type(e).__name__}: "
                           f"{str(e).splitlines()[0] if str(e) else ''})") from None
    reversed_found, near_one_only, per_slice_found, drawn_values = None, None, None, draws[0][1]
    for mean in means:
        # the means alone: a squared distance ½‖μ_i − μ_j‖² is the KL of unit-variance Gaussians
        for scale, params in [(s, VARIANCE_FROM) for s in scales if s is not mean] + [(mean, _UNIT)]:
            if not _broadcasts(drawn_values, mean, scale):
                continue
            for param, to_var in params.items():
                alphas = []
                for _, memo, value in draws:
                    m, v = torch.broadcast_tensors(memo[mean], to_var(memo[scale]))
                    kl = _pairwise_kl(m, v)
                    alphas.append(proportion(_over_keys(value), _over_keys(kl)))
                    if alphas[-1] is None and proportion(value, kl.transpose(-1, -2)) is not None:
                        reversed_found = (mean, scale, param)
                    if alphas[-1] is None and _scaled_per_slice(_over_keys(value), _over_keys(kl)):
                        per_slice_found = (mean, scale, param)
                if all(a is not None and a < 0 for a in alphas):
                    kappa = float(f"{-1.0 / alphas[0]:.12g}") if math.isclose(alphas[0], alphas[1], rel_tol=1e-9) \
                        else run_time_temperature([-1.0 / a for a in alphas], [memo for _, memo, _ in draws],
                                                  [b for b in shared if b is not scale])
                    if kappa is not None and not _far_from_one(logits, draws[0][0], constants, mean, scale, param,
                                                               alphas[0], own_sizes):
                        near_one_only = (mean, scale, param)
                    elif kappa is not None:
                        memo = draws[0][1]
                        memo[("kl",)] = _pairwise_kl(*torch.broadcast_tensors(memo[mean], to_var(memo[scale])))
                        return kappa, mean, scale, param, memo
    if near_one_only is not None:
        mean, scale, param = near_one_only
        raise NotFused(f"the pairwise score is −KL(q_i ‖ q_j)/κ of {mean.name} and the {param} {scale.name} where "
                       "they are near 1, but not at means of either sign and variances far from 1 (e^-8..e^8): it "
                       "computes something the KL does not there (a relu, abs, clamp or floor of a mean, a "
                       "variance or the KL itself?)")
    if per_slice_found is not None:
        raise NotFused(f"the pairwise score is −KL(q_i ‖ q_j)/κ of {per_slice_found[0].name} and the "
                       f"{per_slice_found[2]} {per_slice_found[1].name} with a κ of its own for each head (or batch "
                       "row): kl_attention takes one κ, a number or c·t or c/t of one 0-d tensor")
    if reversed_found is not None:
        pairs = f"{reversed_found[0].name} and the {reversed_found[2]} {reversed_found[1].name}"
        # one computation, two readings: which the user wrote shows as a transpose before the softmax (a softmax over
        # dim −2 reaches the matcher as one over dim −1 of the transposed score)
        if _swaps_the_pair_dims(logits):
            raise NotFused(f"the softmax normalises −KL(q_i ‖ q_j) of {pairs} over the queries (dim −2), for each key "
                           "(the same as normalising KL(q_j ‖ q_i), key to query, over the keys): the fused op "
                           "normalises −KL(q_i ‖ q_j) over the keys (dim −1)")
        raise NotFused(f"the score is KL(q_j ‖ q_i) (key to query) of {pairs}; the fused op computes KL(q_i ‖ q_j)")
    names, variances = ", ".join(b.name for b in means), "another"
    if shared:
        names += (" (per position) and " + ", ".join(b.name for b in drawn if b in shared)
                  + " (the same at every position)")
        variances += ", or one the same at every position,"
    scalars = [b for b in shared if len(shape_of(b)) == 0]
    kappa = "κ > 0" + (f", a number or c·t or c/t of the 0-d {', '.join(b.name for b in scalars)} it reads"
                       if scalars else "")
    raise NotFused(f"the pairwise score over {names} is not −KL(q_i ‖ q_j)/κ of diagonal Gaussians ({kappa}) "
                   f"for any per-position one as the means and {variances} as {', '.join(VARIANCE_FROM)} "
                   "(nor of unit variance)")


def _far_from_one(logits, env, constants, mean, scale, param, gamma, own_sizes) -> bool:
    """Whether the score is still γ · KL at means of either sign and variances far from 1 (:func:`far_draw`):
    found at positive values near 1, relu(μ_j) or v.clamp(min=0.02) would pass for μ and v."""
    memo = {**constants, **far_draw(env, [mean], {} if scale is mean else {scale: param}, seed=20251126)}
    try:
        value = evaluate(logits, memo, expand=own_sizes)  # memo: a scale computed from what was drawn, too
        to_var = _UNIT.get(param) or VARIANCE_FROM[param]
        kl = _pairwise_kl(*torch.broadcast_tensors(memo[mean], to_var(memo[scale])))
    except Exception:  # noqa: BLE001  (an op undefined there: not the KL, which is)
        return False
    return isinstance(value, torch.Tensor) and equals_scaled(_over_keys(value), _over_keys(kl), gamma)


def _scaled_per_slice(value: torch.Tensor, kl: torch.Tensor) -> bool:
    """Whether ``value`` [*L, N, N] is −KL/κ with a κ > 0 of its own for each leading index (a κ per head), and
    not one κ for all."""
    if value.shape != kl.shape or value.dim() < 3:
        return False
    gammas = [proportion(v, r) for v, r in zip(value.reshape(-1, *value.shape[-2:]), kl.reshape(-1, *kl.shape[-2:]))]
    return all(g is not None and g < 0 for g in gammas) and not all(math.isclose(g, gammas[0]) for g in gammas)


def _over_keys(score: torch.Tensor) -> torch.Tensor:
    """``score`` less each row's mean: what a softmax over the keys reads of it. A term per query (the KL's
    −d, or −log v_i, left out as constants of the softmax) is no difference."""
    return score - score.mean(-1, keepdim=True)


def _computed_from_any(node: fx.Node, bases: list) -> bool:
    return node not in independent([node] + [b for b in bases if b is not node])


def _feature_sources(node: fx.Node, lead: int, k: int) -> list[fx.Node]:
    """The nearest tensors [*L, N, K] ``node`` is computed from (its log-variances, say)."""
    return nearest_sources(node, lambda shape: len(shape) == lead + 2 and size_hint(shape[-1]) == k)


def _swaps_the_pair_dims(node: fx.Node) -> bool:
    """Whether ``node`` is a transpose of the last two dims (what a softmax over dim −2 becomes in the normal form)."""
    node = strip_noops(node)
    if node.target is aten.transpose.int:
        rank = len(shape_of(node))
        return {d % rank for d in node.args[1:3]} == {rank - 2, rank - 1}
    if node.target is aten.permute.default:
        perm = list(node.args[1])
        return perm[:-2] == list(range(len(perm) - 2)) and [p % len(perm) for p in perm[-2:]] == \
            [len(perm) - 1, len(perm) - 2]
    return False


def _kappa_text(kappa) -> str:
    return f"{kappa:g}" if isinstance(kappa, float) else str(kappa)


def _computed_from(source: fx.Node, nodes: list[fx.Node]) -> set[fx.Node]:
    """Those of ``nodes`` (in graph order) that read ``source``, directly or through others of them."""
    reached = {source}
    for n in nodes:
        if any(i in reached for i in n.all_input_nodes):
            reached.add(n)
    return reached - {source}


_UNIT = {"unit variance": torch.ones_like}  # the variance of a KL read off the means alone (scale = the means)


def _broadcasts(values: dict, mean, scale) -> bool:
    """Whether ``scale`` was evaluated and broadcasts against ``mean`` (a shared tensor [N] does not, say)."""
    try:
        torch.broadcast_shapes(values[mean].shape, values[scale].shape)
    except (KeyError, RuntimeError):
        return False
    return True


def _lengths(shape) -> list:
    """How to read sizes when evaluating a mask: at the example's, and where the length is symbolic (dynamic
    shapes) also at another length, since a mask built from sizes may be causal at one length alone
    (``j <= i + (n − 6)``)."""
    return [size_hint] + ([shifted_size] if isinstance(shape[-1], torch.SymInt) else [])


def _allowed(masks, shape, size=size_hint) -> tuple[torch.Tensor, list]:
    """([N, N] bool: which keys the peeled masks computed from sizes and constants allow, evaluated with sizes
    read by ``size``; the masks read from the graph's inputs, the same for every sequence and head: the op
    takes those at run time)."""
    n = size(shape[-1])
    allowed, run_time = torch.ones(n, n, dtype=torch.bool), []
    for node, kind in masks:
        try:
            value = evaluate(node, {}, size_hint=size)
        except NotFused as e:
            if _run_time_mask(node, kind, shape):
                run_time.append((node, kind))
                continue
            if kind.startswith("vanishing"):
                raise NotFused("the KL score is masked with a finite number (masked_fill with -1e9, or an added "
                               "(1 − mask)·-1e9, say) by a mask read "
                               "at run time: that equals the op's −inf masking only where every query keeps its own "
                               "key, which a mask known at run time alone does not promise; masked_fill with "
                               "float('-inf') fuses") from None
            raise NotFused(f"attention mask {node.name}: {e}") from None
        if not isinstance(value, torch.Tensor) or value.dim() > len(shape) or any(d != 1 for d in value.shape[:-2]):
            raise NotFused(f"attention mask {node.name} differs along the leading dims of the {_dims(len(shape))} "
                           "score (between sequences or heads); the op's masks are the same for every sequence")
        value = value.reshape(value.shape[-2:]) if value.dim() >= 2 else value
        value = value.expand(n, n)
        if kind in ("additive", "vanishing_added"):
            kept = value[~((value == 0) | (value <= VANISHING_FILL))]
            if kept.numel():
                raise NotFused(f"a tensor made from sizes is added to the scores and holds {float(kept[0]):g}, "
                               f"neither 0 nor a mask value (−inf, or {VANISHING_FILL:g} and below, whose exp "
                               "vanishes): a score bias, which the op does not take")
            value = value == 0
        elif kind in ("masked", "vanishing"):
            value = ~value.bool()
        allowed = allowed & value.bool()
    return allowed, run_time


def _run_time_mask(node: fx.Node, kind: str, shape, made_here: bool = False) -> bool:
    """Whether ``node`` is a bool mask read from the graph's inputs (or, ``made_here``, one the graph makes) that
    the op can take at run time: over the queries and keys (or the keys alone), the same for every sequence and
    head or one per sequence or head (a key-padding mask [B, 1, N]), its leading dims 1 or the score's."""
    value = node.meta.get("val")
    if kind not in ("masked", "allowed") or not isinstance(value, torch.Tensor) or value.dtype != torch.bool \
            or not (made_here or tensors_read([node])) or value.dim() > len(shape):
        return False
    lead, pairs = value.shape[:-2], value.shape[-2:]
    n = shape[-1]
    return all(is_one(d) or statically_known_true(d == s) for d, s in zip(reversed(lead), reversed(shape[:-2]))) \
        and all(is_one(d) or statically_known_true(d == n) for d in pairs)


def _mask_kind(allowed: torch.Tensor) -> tuple[bool, bool]:
    from hecate.lowering.kl_attention.naive import allowed_keys

    n = allowed.shape[0]
    for causal in (False, True):
        for mask_diagonal in (False, True):
            if torch.equal(allowed, allowed_keys(n, causal, mask_diagonal)):
                return causal, mask_diagonal
    raise NotFused(f"the attention mask allows {int(allowed.sum())} of {n}×{n} pairs and is none of: all keys, "
                   "causal (j ≤ i), no self (j ≠ i), causal without self; the op supports those")


def _mask_kind_or_none(allowed: torch.Tensor) -> tuple[bool, bool] | None:
    try:
        return _mask_kind(allowed)
    except NotFused:
        return None


def _unfill_weighted_by_beta(beta: fx.Node, alloweds, lengths) -> list:
    """β · x.masked_fill(m, 0) → β · x where m fills only pairs the attention masks (``kl.masked_fill(mask, 0)``,
    written to keep 0 · inf out of Σ β·KL): the fused op's sums read x at the allowed pairs alone, as the fill
    does. Not where a query may have no allowed key (see :func:`_zero_fill_reason`). Only for the fusion: a product left unfused gets its fill back (:func:`_refill`), as 0 · inf is NaN
    where x is infinite at a masked pair (a log-probability there). Returns what :func:`_refill` puts back."""
    unfilled = []
    for product in list(beta.users):
        if product.target is not aten.mul.Tensor or beta not in product.args[:2]:
            continue
        other = product.args[1] if product.args[0] is beta else product.args[0]
        fill = _zero_fill(other)
        if fill is None or not same_shape(fill[0], other) or len(other.users) != 1:
            continue
        x, cond, filled_where = fill
        filled = [_filled_pairs(cond, filled_where, a.shape, size) for a, size in zip(alloweds, lengths)]
        if any(f is None or bool((f & a).any()) for f, a in zip(filled, alloweds)):
            continue
        product.replace_input_with(other, x)
        unfilled.append((product, x, other.target, other.args, other.kwargs, dict(other.meta)))
        other.graph.erase_node(other)
    return unfilled


def _zero_fill(node: Any) -> tuple[fx.Node, fx.Node, bool] | None:
    """(x, cond, whether the fill is where cond is True) of ``x.masked_fill(cond, 0)`` or ``where(cond, x, 0)``."""
    if isinstance(node, fx.Node) and node.target is aten.masked_fill.Scalar and node.args[2] == 0:
        return node.args[0], node.args[1], True
    if isinstance(node, fx.Node) and node.target is aten.where.ScalarOther and node.args[2] == 0:
        return node.args[1], node.args[0], False
    return None


def _zero_fill_reason(fill: fx.Node) -> str:
    return (f"β is read times {fill.name}, a pair tensor zeroed by a mask (x.masked_fill(m, 0)) that is not the "
            "attention's, or the attention may leave a query no key (a mask read at run time, or one dropping each "
            "query's own key): at such a query's pairs eager's gradients through the zeroed x are 0 and the op's NaN; "
            "Σ β·x without the fill fuses")


def _filled_pairs(cond: fx.Node, filled_where: bool, shape, size) -> torch.Tensor | None:
    """The [N, N] pairs (``shape``) a zero-fill reaches, ``cond`` evaluated with sizes read by ``size``; None where
    it cannot be evaluated or differs between sequences or heads (no mask of the op's)."""
    try:
        value = evaluate(cond, {}, size_hint=size)
    except NotFused:
        return None
    if not isinstance(value, torch.Tensor) or any(d != 1 for d in value.shape[:-2]):
        return None
    value = (value.reshape(value.shape[-2:]) if value.dim() >= 2 else value).bool().expand(shape)
    return value if filled_where else ~value


def _refill(unfilled: list) -> None:
    """Put back the zero-fills :func:`_unfill_weighted_by_beta` took out of products that were not fused."""
    for product, x, target, args, kwargs, meta in unfilled:
        with product.graph.inserting_before(product):
            fill = product.graph.call_function(target, args, kwargs)
        fill.meta = meta
        product.replace_input_with(x, fill)


def _zero_fill_of_masked(user: fx.Node, softmax: fx.Node, allowed: torch.Tensor, size=size_hint) -> bool:
    """Whether ``user`` is β with 0 at the masked keys (``masked_fill(~mask, 0)``, ``where(mask, β, 0)``), the
    fill's mask evaluated with sizes read by ``size``."""
    fill = _zero_fill(user)
    if fill is None or fill[0] is not softmax:
        return False
    filled = _filled_pairs(fill[1], fill[2], allowed.shape, size)
    return filled is not None and torch.equal(~filled, allowed)


# ---------------------------------------------------------------------------------------------
# 2. the algebra of what is computed from β


# A factor: ("P", flipped) β, ("S", flipped) KL, ("L", leaf id, role) a per-position tensor.
# A monomial: (coef, ((factor, power), ...) sorted). A polynomial: {factors: coef}.
Poly = dict


def _mono(factors: dict) -> tuple:
    return tuple(sorted((f, p) for f, p in factors.items() if p != 0))


def _poly_mul(a: Poly, b: Poly) -> Poly:
    out: Poly = defaultdict(float)
    for fa, ca in a.items():
        for fb, cb in b.items():
            merged = dict(fa)
            for f, p in fb:
                merged[f] = merged.get(f, 0) + p
            out[_mono(merged)] += ca * cb
    return {k: v for k, v in out.items() if v != 0}


def _poly_add(a: Poly, b: Poly, scale: float = 1.0) -> Poly:
    out = dict(a)
    for f, c in b.items():
        out[f] = out.get(f, 0.0) + scale * c
    return {k: v for k, v in out.items() if v != 0}


def _poly_scale(a: Poly, s: float) -> Poly:
    return {k: v * s for k, v in a.items()} if s != 0 else {}


def _flip(factor):
    kind = factor[0]
    if kind in ("P", "S"):
        return (kind, not factor[1])
    return (kind, factor[1], "j" if factor[2] == "i" else "i")


def _poly_transpose(a: Poly) -> Poly:
    return {_mono({_flip(f): p for f, p in fs}): c for fs, c in a.items()}


@dataclass
class _Leaf:
    """A per-position tensor entering the pair space; ``node`` normalised to [*L (or 1s), N, K or 1]."""

    source: fx.Node  # the graph node as it appears in the expression
    # how to get [*L, N, K'] from source: "as_is"; "squeeze_j" ([*L, N, 1, K]); "squeeze_i" ([*L, 1, N, K]);
    # "transpose" ([*L, 1, N] or values [*L, D, N])
    normalize: str
    per_k: bool  # K' = K (True) or 1


_ELEMENTWISE = {aten.mul.Tensor, aten.div.Tensor, aten.add.Tensor, aten.sub.Tensor, aten.neg.default,
                aten.square.default, aten.reciprocal.default, aten.pow.Tensor_Scalar,
                aten.unsqueeze.default, aten.transpose.int}


@dataclass
class _PairAlgebra:
    """Reads nodes computed from β and KL as polynomials (see the module docstring)."""

    beta: fx.Node
    kl_scales: dict  # node -> γ: the nodes whose value is γ · KL_ij
    rank: int  # the score's: [*L, N, N] (L = rank − 2 leading dims), the pair space [*L, N, N, K]
    kl_of: Any = None  # node -> γ or None: recognises another node computing γ · KL_ij
    roots: set = field(default_factory=set)  # the sums over j, read as leaves once reduced
    leaves: dict = field(default_factory=dict)  # leaf id -> _Leaf
    visited: set = field(default_factory=set)  # pair-space nodes read
    memo: dict = field(default_factory=dict)
    pair_memo: dict = field(default_factory=dict)
    root_memo: dict = field(default_factory=dict)
    escapes: list = field(default_factory=list)  # (β or KL, a user that reads it whole): formed for it

    def read(self, node) -> Poly:
        if not isinstance(node, fx.Node):
            if isinstance(node, (int, float)) and not isinstance(node, bool):
                return {(): float(node)} if node != 0 else {}
            raise NotFused(f"literal {node!r} of type {type(node).__name__}")
        if node not in self.memo:
            self.memo[node] = self._read(node)
        return self.memo[node]

    def is_pair(self, node) -> bool:
        """Whether ``node`` lives in the pair space (depends on β or KL, or broadcasts i against j)."""
        if not isinstance(node, fx.Node):
            return False
        if node not in self.pair_memo:
            self.pair_memo[node] = self._is_pair(node)
        return self.pair_memo[node]

    def _is_pair(self, node: fx.Node) -> bool:
        if node is self.beta or node in self.kl_scales:
            return True
        if self.kl_of is not None and node.op == "call_function" and node.target not in _ELEMENTWISE:
            gamma = self.kl_of(node)
            if gamma is not None:
                self.kl_scales[node] = gamma
                return True
        if node in self.roots:
            return False
        if node.target == aten.unsqueeze.default and not self.is_pair(node.args[0]):
            lead = self.rank - 2  # [*L, N, K] → [*L, 1, N, K] (j) or [*L, N, 1, K] (i)
            return _rank(node.args[0]) == self.rank and node.args[1] % (self.rank + 1) in (lead, lead + 1)
        if node.target in _ELEMENTWISE or _is_noop(node):
            return any(self.is_pair(a) for a in node.args)
        return False

    def _arithmetic_of_roots(self, node: fx.Node) -> bool:
        """Whether ``node`` is arithmetic (neg, a product, ...) on sums over j that the op replaces: it is read
        term by term, as the op's outputs times the rest. (Taken whole, as a value the op reads, it would be
        computed from the op's own outputs: ``kl + (−Σ_j β_ij KL_ij)``.)"""
        if node in self.roots or node.op != "call_function":
            return False
        if node not in self.root_memo:
            self.root_memo[node] = (node.target in _ELEMENTWISE or _is_noop(node)) and any(
                isinstance(a, fx.Node) and (a in self.roots or self._arithmetic_of_roots(a)) for a in node.args)
        return self.root_memo[node]

    def _leaf(self, node: fx.Node, role: str, normalize: str, per_k: bool) -> Poly:
        key = (node.name, normalize)
        self.leaves[key] = _Leaf(node, normalize, per_k)
        return {(((("L", key, role)), 1),): 1.0}

    def _read(self, node: fx.Node) -> Poly:
        if node is self.beta:
            self.visited.add(node)
            return {((("P", False), 1),): 1.0}
        if not self.is_pair(node) and not self._arithmetic_of_roots(node):  # (recognises another copy of the KL)
            return self._outside_leaf(node)
        if node in self.kl_scales:
            self.visited.add(node)
            return {((("S", False), 1),): self.kl_scales[node]}
        self.visited.add(node)
        t, args = node.target, node.args
        if _is_noop(node):
            return self.read(args[0])
        if t == aten.unsqueeze.default:
            x, dim = args
            if self.is_pair(x):
                if _rank(x) == self.rank and dim % (self.rank + 1) == self.rank:
                    return self.read(x)
                raise NotFused(f"{node.name} unsqueezes a pair tensor at dim {dim}, not at the end")
            return self._leaf(x, "i" if dim % (self.rank + 1) == self.rank - 1 else "j", "as_is",
                              shape_of(x)[-1] != 1)
        if t == aten.transpose.int:
            if sorted(d % _rank(node) for d in args[1:3]) != [self.rank - 2, self.rank - 1]:
                raise NotFused(f"{node.name} transposes dims {args[1:3]}, not the two position dims")
            return _poly_transpose(self.read(args[0]))
        if t == aten.neg.default:
            return _poly_scale(self.read(args[0]), -1.0)
        if t == aten.mul.Tensor:
            return _poly_mul(self.read(args[0]), self.read(args[1]))
        if t in (aten.add.Tensor, aten.sub.Tensor):
            alpha = node.kwargs.get("alpha", 1)
            return _poly_add(self.read(args[0]), self.read(args[1]), alpha if t == aten.add.Tensor else -alpha)
        if t == aten.square.default:
            x = self.read(args[0])
            return _poly_mul(x, x)
        if t == aten.pow.Tensor_Scalar and args[1] == 2:
            x = self.read(args[0])
            return _poly_mul(x, x)
        if t == aten.div.Tensor:
            return _poly_mul(self.read(args[0]), self._inverse(args[1], node))
        if t == aten.reciprocal.default:
            return self._inverse(args[0], node)
        raise NotFused(f"{node.name} ({short(t)}) is not an elementwise op the fused op can express")

    def _inverse(self, denominator, node) -> Poly:
        if not isinstance(denominator, fx.Node):
            if denominator == 0:
                raise NotFused(f"{node.name} divides by 0")
            return {(): 1.0 / float(denominator)}
        d = self.read(denominator)
        if len(d) != 1:
            raise NotFused(f"{node.name} divides by a sum of terms ({denominator.name})")
        (factors, coef), = d.items()
        if any(f[0] in ("P", "S") for f, _ in factors):
            raise NotFused(f"{node.name} divides by an expression of β or KL ({denominator.name})")
        return {_mono({f: -p for f, p in factors}): 1.0 / coef}

    def _outside_leaf(self, node: fx.Node) -> Poly:
        """A tensor computed outside the pair space, broadcast into it: classify it by its shape."""
        shape = shape_of(node)
        if shape is None:
            raise NotFused(f"{node.name} has no shape information")
        if len(shape) == self.rank + 1:  # the [*L, N, N, K] frame
            if shape[-2] == 1:
                return self._leaf(node, "i", "squeeze_j", shape[-1] != 1)
            if shape[-3] == 1:
                return self._leaf(node, "j", "squeeze_i", shape[-1] != 1)
        if len(shape) == self.rank:
            # the [*L, N, N] frame: [*L, N, 1] is per-query, [*L, 1, N] per-key (N = 1: the same)
            if shape[-1] == 1:
                return self._leaf(node, "i", "as_is", False)
            if shape[-2] == 1:
                return self._leaf(node, "j", "transpose", False)
        if _zero_fill(node) is not None:
            raise NotFused(_zero_fill_reason(node))
        raise NotFused(f"{node.name} of shape {list(shape)} is neither per-query nor per-key")


def _rank(node) -> int:
    s = shape_of(node)
    return len(s) if s is not None else -1


def _sum_over_keys(node: fx.Node, rank: int) -> bool:
    """``x.sum(dim=-2[, keepdim])`` of a [*L, N, N, K] tensor or ``x.sum(-1[, keepdim])`` of [*L, N, N]
    (``rank`` = len(L) + 2: the key axis is dim rank − 1 of both)."""
    if node.target != aten.sum.dim_IntList or len(node.args) < 2 or node.args[1] is None:
        return False
    summed = _rank(node.args[0])
    if summed not in (rank, rank + 1) or node.kwargs.get("dtype") is not None:
        return False
    return [d % summed for d in node.args[1]] == [rank - 1]


_SUMS = {aten.sum.dim_IntList: "sum", aten.sum.default: "sum", aten.mean.dim: "mean", aten.mean.default: "mean"}


def _split_key_sum(node: fx.Node, rank: int, positions: fx.Node) -> fx.Node | None:
    """A sum or mean over the key dim and others (``(β * kl).sum((-1, -2))``, ``(β * kl).mean()``)
    rewritten as the key-dim sum the op gives, then the rest (a mean also divides by the key
    count); returns the key-dim sum."""
    kind = _SUMS.get(node.target)
    if kind is None or node.kwargs.get("dtype") is not None:
        return None
    x = node.args[0]
    summed = _rank(x)
    if summed not in (rank, rank + 1):
        return None
    if len(node.args) < 2 or node.args[1] is None or list(node.args[1]) == []:
        dims, keep = list(range(summed)), False
    else:
        dims = sorted({d % summed for d in node.args[1]})
        keep = bool(node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))
    if rank - 1 not in dims or (kind == "sum" and len(dims) < 2):
        return None
    rest = [d if keep or d < rank - 1 else d - 1 for d in dims if d != rank - 1]
    graph, steps = node.graph, [(aten.sum.dim_IntList, [rank - 1], keep)]
    if rest:
        steps.append((aten.sum.dim_IntList if kind == "sum" else aten.mean.dim, rest, keep))
    new = []
    with graph.inserting_before(node):
        if kind == "mean":  # divided by the key count: a symbol under dynamic shapes, read off the positions
            n_keys = x.meta["val"].shape[rank - 1]
            if not isinstance(n_keys, int):
                n_keys = graph.call_function(aten.sym_size.int, (positions, _rank(positions) - 2))
                n_keys.meta["val"] = positions.meta["val"].shape[-2]
            steps.append((aten.div.Tensor, n_keys))
        for target, *args in steps:
            new.append(graph.call_function(target, (new[-1] if new else x, *args)))
            new[-1].meta = {k: v for k, v in node.meta.items() if k in ("stack_trace", "nn_module_stack")}
            new[-1].meta["val"] = target(new[-2].meta["val"] if len(new) > 1 else x.meta["val"],
                                         *(a.meta["val"] if isinstance(a, fx.Node) else a for a in args))
    node.replace_all_uses_with(new[-1])
    graph.erase_node(node)
    return new[0]


def _matmul_reader(node: fx.Node, is_pair, rank: int) -> tuple[fx.Node, fx.Node, bool, bool] | None:
    """(pair operand P, per-key values X, X given as [*L, D, N], P read transposed) for Σ_j P_ij X_j.

    ``P @ X`` (X may broadcast over P's leading dims), ``torch.bmm(P, X)``,
    ``torch.einsum("bij,bjd->bid", P, X)`` (any letters, any number of leading ones shared by P, X
    and the result, X in either layout; "bji,bjd->bid" reads Pᵀ). ``rank``: P's, [*L, N, N].
    """
    if node.target in (aten.matmul.default, aten.bmm.default):
        p, x = node.args[:2]
        if is_pair(p) and not is_pair(x) and _rank(p) == rank and 2 <= _rank(x) <= rank:
            return p, x, False, False
        return None
    if node.target != aten.einsum.default or len(node.args[1]) != 2:
        return None
    equation, operands = node.args[0].replace(" ", ""), list(node.args[1])
    if "->" not in equation or "." in equation:
        return None
    lhs, out = equation.split("->")
    letters = lhs.split(",")
    pair = [i for i, op in enumerate(operands) if is_pair(op)]
    if (len(pair) != 1 or any(len(t) != rank for t in letters + [out]) or _rank(operands[pair[0]]) != rank
            or len(set(letters[pair[0]])) != rank or len(set(out)) != rank):
        return None
    pair_letters, xs = letters[pair[0]], letters[1 - pair[0]]
    lead, i, j = pair_letters[:-2], pair_letters[-2], pair_letters[-1]
    transposed = out[:-1] == lead + j
    kept, summed = (j, i) if transposed else (i, j)
    if out[:-1] != lead + kept:
        return None
    d = out[-1]
    if xs == lead + summed + d:
        return operands[pair[0]], operands[1 - pair[0]], False, transposed
    if xs == lead + d + summed:
        return operands[pair[0]], operands[1 - pair[0]], True, transposed
    return None


def _einsum_laid_out_as_matmul(graph: fx.Graph, node: fx.Node, beta: fx.Node) -> None:
    """``einsum("bhij,bjhd->bihd", β, X)`` (β [*L, N, N] and per-key values X, X and the result in other index
    orders than β's, as a [B, T, H, D] layout has them): X permuted to [*L, N, D], the einsum in β's order, its
    result permuted back, so :func:`_matmul_reader` reads it. Exact: the same products summed."""
    if node.target != aten.einsum.default or len(node.args[1]) != 2 or node.args[1][0] is not beta \
            or _matmul_reader(node, lambda x: x is beta, _rank(beta)) is not None:
        return
    equation = node.args[0].replace(" ", "")
    if "->" not in equation or "." in equation:
        return
    (p, x), out = equation.split("->")[0].split(","), equation.split("->")[1]
    lead, i, j = p[:-2], p[-2], p[-1]
    free = set(x) - set(p)
    if len(set(p)) != len(p) or len(free) != 1 or set(x) != set(lead) | {j} | free or set(out) != set(lead) | {i} | free \
            or len(x) != len(set(x)) or len(out) != len(set(out)):
        return
    (d,) = free
    canonical_x, canonical_out = lead + j + d, lead + i + d
    with graph.inserting_before(node):
        values = emit(graph, aten.permute.default, node.args[1][1], [x.index(c) for c in canonical_x])
        summed = emit(graph, aten.einsum.default, f"{p},{canonical_x}->{canonical_out}", [beta, values])
        result = emit(graph, aten.permute.default, summed, [canonical_out.index(c) for c in out])
    for new in (values, summed, result):
        new.meta["stack_trace"] = node.meta.get("stack_trace")
    node.replace_all_uses_with(result)
    graph.erase_node(node)


# ---------------------------------------------------------------------------------------------
# the pass


def run(gm: fx.GraphModule, report: FusionReport) -> None:
    import hecate.lowering.kl_attention  # noqa: F401  the op must exist before we insert it

    _size_numbers_as_tensors(gm.graph)
    users_code = set(gm.graph.nodes)  # (what a fusion writes, β as exp(s − lse) / …, is no candidate below)
    for softmax in [n for n in gm.graph.nodes if n.target == aten.softmax.int]:
        if _renormalised(softmax):
            continue  # softmax(s) · mask / Σ (softmax(s) · mask): the softmax written out, fused below
        for user in list(softmax.users):
            _einsum_laid_out_as_matmul(gm.graph, user, softmax)
        score = None
        try:
            score = _recognise(softmax)
            if score is not None and not _fuse(gm, score, report):
                _refill(score.unfilled)
        except NotFused as e:
            if score is not None:
                _refill(score.unfilled)
            shape = shape_of(softmax)
            if shape and is_one(shape[-1]):  # torch.compile specialises a length of 1: a graph for N = 1 alone
                # (why the match failed is not told: a pair tensor [B, 1, 1] has no size that tells it from a
                # per-query one, so the reason found may name the wrong tensor)
                e = NotFused("a softmax over one key (N = 1, in the graph torch.compile makes for length 1 alone): "
                             "every score is KL_ii = 0 and β = 1, so the attention is its values; nothing to fuse, "
                             "compiled as written; other lengths compile their own graph")
            report.add_miss(PATTERN, str(e), softmax.name, nodes=[softmax])
    for beta in [n for n in gm.graph.nodes if n.target == aten.div.Tensor and n in users_code]:
        written = _unshifted_softmax_of(beta)
        rank = len(shape_of(beta) or ())
        if written is not None and rank >= 2 and _pairwise(written[0], rank):
            try:
                _fuse_written_softmax(gm, beta, *written, report=report)
            except NotFused as e:
                report.add_miss(PATTERN, str(e), beta.name, nodes=[beta])
        elif written is None and rank >= 2 and isinstance(beta.args[0], fx.Node) \
                and (e := exp_factor(beta.args[0])) is not None and _pairwise(e.args[0], rank):
            report.add_miss(PATTERN, "a ratio of exp(s) over a pairwise score that is not exp(s) / Σ_j exp(s) over "
                            "the keys of the same exp (the sum over another dim or of another tensor, a term added "
                            "to it, or a factor that is no 0/1 mask): not the softmax kl_attention fuses",
                            beta.name, nodes=[beta])


def _pairwise(x: fx.Node, rank: int) -> bool:
    """Whether ``x`` is a score of pairs: computed from tensors broadcast per query and per key."""
    return any(sides == {"i", "j"} for sides in _score_inputs(x, rank)[0].values())




_WRITTEN_SOFTMAX = ("β written as exp(s) / Σ exp(s) over a pairwise score, without the row max subtracted first or "
                    "with a 0/1 mask multiplied after the exp, is the softmax only where no row underflows to 0/0: "
                    "where s = −KL/κ with κ > 0 a number and the self pair allowed (s ≤ s_ii = 0, so Σ ≥ 1)")


def _fuse_written_softmax(gm: fx.GraphModule, beta: fx.Node, x: fx.Node, mask: fx.Node | None, how: str,
                          report: FusionReport) -> None:
    """Fuse β = exp(x) / Σ_j exp(x) (x maybe less its row max; the exp maybe × a 0/1 ``mask`` made of sizes, ``how``
    "times", or zeroed where a bool ``mask`` is True, "filled", or False, "kept") as softmax(x.masked_fill(masked,
    −inf)) when that is what it computes: x = −KL/κ written per pair, κ ≥ 1e-3 a number, the self pair allowed.
    Then x_ij ≤ x_ii = 0 (KL ≥ 0, KL_ii = 0), so the row max is 0 and Σ ≥ 1: nothing overflows or underflows to
    0/0, and the two agree to rounding (a KL multiplied out into products, or a tiny κ, can round x_ij above 0 by
    enough for exp to overflow, probe r13a). Raises NotFused (nothing changed) otherwise."""
    graph = gm.graph
    if mask is not None and how == "times":
        shape = shape_of(beta)
        if not depends_on_sizes_only(mask):
            raise NotFused(f"{_WRITTEN_SOFTMAX}; the mask {mask.name} multiplied after the exp is read from the "
                           "graph's inputs, its values (0/1 or weights) not known when compiling; "
                           "masked_fill(~mask, float('-inf')) before torch.softmax fuses")
        for size in _lengths(shape):
            value = evaluate(mask, {}, size_hint=size)
            if not isinstance(value, torch.Tensor) or not bool(((value == 0) | (value == 1)).all()):
                raise NotFused(f"{_WRITTEN_SOFTMAX}; the mask {mask.name} multiplied after the exp is not all 0 "
                               "and 1 (a weighting, not a mask)")
    added = []
    with graph.inserting_before(beta):
        score = x
        if mask is not None:
            if how != "filled":
                added.append(graph.call_function(*((aten.eq.Scalar, (mask, 0)) if how == "times" else
                                                   (aten.logical_not.default, (mask,)))))
            added.append(graph.call_function(aten.masked_fill.Scalar,
                                             (x, mask if how == "filled" else added[-1], _NEG_INF)))
            score = added[-1]
        added.append(graph.call_function(aten.softmax.int, (score, -1)))
    for node in added:
        node.meta["val"] = node.target(*[a.meta["val"] if isinstance(a, fx.Node) else a for a in node.args])
        node.meta["stack_trace"] = beta.meta.get("stack_trace")
    softmax, recognised = added[-1], None
    try:
        recognised = _recognise(softmax)
        if recognised is None:
            raise NotFused(_WRITTEN_SOFTMAX)
        why = ("its κ is read from a tensor, whose sign is not known when compiling"
               if isinstance(recognised.kappa, Temperature) else
               "its mask excludes the self pair" if recognised.mask_diagonal else
               "its mask is read at run time" if recognised.run_time_masks else
               "its score is −KL/κ plus a number per query (a softmax's constant, which the ratio's underflow "
               "does not ignore)" if not _is_minus_kl(x, recognised) else
               f"its κ = {recognised.kappa:g} is below 1e-3, which magnifies the KL's rounding below 0 into "
               "scores whose exp may overflow" if recognised.kappa < 1e-3 else
               "its KL is multiplied out into matrix products, whose cancellation can leave it below 0 by enough "
               "for exp to overflow" if any(n.target in _PRODUCTS for n in nodes_between(
                   [recognised.mean, recognised.scale], [x])) else None)
        if why:
            raise NotFused(f"{_WRITTEN_SOFTMAX}; {why}")
    except NotFused:
        if recognised is not None:
            _refill(recognised.unfilled)
        for node in reversed(added):
            graph.erase_node(node)
        raise
    # the softmax computes β: it takes β's place (and stays, equal to it, if the fusion below fails)
    beta.replace_all_uses_with(softmax)
    _erase_unread([beta])
    if not _fuse(gm, recognised, report):
        _refill(recognised.unfilled)


def _is_minus_kl(x: fx.Node, score: _Score) -> bool:
    """Whether ``x`` is −KL_ij/κ itself where it is finite (−inf elsewhere), at the points the score was
    recognised at: not only up to a number per query, as a softmax reads it."""
    try:
        value = evaluate(x, dict(score.draw))
    except NotFused:
        return False
    expected = -score.draw[("kl",)] / score.kappa
    if not isinstance(value, torch.Tensor) or value.shape != expected.shape \
            or bool((~torch.isfinite(value) & (value != _NEG_INF)).any()):
        return False
    return equals_scaled(torch.where(torch.isfinite(value), value, expected), score.draw[("kl",)],
                         -1.0 / score.kappa)


def _erase_unread(nodes: list[fx.Node]) -> None:
    """Erase ``nodes`` no node reads, and what they read that is then unread, up the graph."""
    pending, erased = list(nodes), set()
    while pending:
        node = pending.pop()
        if node in erased or node.users or node.op != "call_function":
            continue
        inputs = node.all_input_nodes
        node.graph.erase_node(node)
        erased.add(node)
        pending.extend(inputs)


def _renormalised(softmax: fx.Node) -> bool:
    """Whether ``softmax`` is read only as e in e · mask / Σ (e · mask) (a softmax over every key masked and
    normalised again): exp(s − max) / Z whose Z cancels, the softmax written out with a mask."""
    if len(softmax.users) != 1:
        return False
    (masked,) = softmax.users
    return any(d.target == aten.div.Tensor and d.args[0] is masked and _unshifted_softmax_of(d) is not None
               for d in masked.users)


def _unshifted_softmax_of(node: fx.Node) -> tuple[fx.Node, fx.Node | None, str] | None:
    """(s, mask, how) for ``e / e.sum(-1, keepdim=True)`` with e = exp(s) (the normal form made e = exp(s − max) a
    softmax already), or e = exp(s), exp(s − s's row max) or softmax(s) over the last dim (exp(s − max) / Z, whose
    Z cancels) times a mask (``how`` "times"), zeroed where a bool mask is True (``masked_fill(m, 0)``: "filled")
    or False (``where(m, e, 0)``: "kept"); mask None: none."""
    if len(node.args) != 2 or not all(isinstance(a, fx.Node) for a in node.args):
        return None
    e, total = node.args
    rank = len(shape_of(e) or ())
    if not (rank and total.target == aten.sum.dim_IntList and total.args[0] is e and len(total.args) > 2
            and total.args[2] and [d % rank for d in total.args[1]] == [rank - 1]):
        return None
    mask, how = None, "times"
    while e.target in (aten.mul.Tensor, aten.div.Tensor) and len(e.args) == 2 and isinstance(e.args[0], fx.Node) \
            and (c := number_of(e.args[1])) is not None and c != 0 and math.isfinite(c):
        e = e.args[0]  # c · exp(s) · m: c cancels in the ratio
    def exp_of(a):  # exp(s), or a softmax over the last dim
        return a.target == aten.exp.default or a.target == aten.softmax.int and a.args[1] % rank == rank - 1

    if e.target == aten.mul.Tensor and len(e.args) == 2 and all(isinstance(a, fx.Node) for a in e.args):
        exps = [i for i, a in enumerate(e.args) if exp_of(a)]
        if len(exps) != 1:
            return None
        e, mask = e.args[exps[0]], e.args[1 - exps[0]]
    elif e.target == aten.masked_fill.Scalar and e.args[2] == 0 and isinstance(e.args[0], fx.Node):
        e, mask, how = e.args[0], e.args[1], "filled"
    elif e.target in (aten.where.ScalarOther, aten.where.self) and number_of(e.args[2]) == 0 \
            and isinstance(e.args[1], fx.Node):
        e, mask, how = e.args[1], e.args[0], "kept"
    if not (isinstance(e, fx.Node) and (e.target == aten.exp.default or mask is not None and exp_of(e))
            and isinstance(e.args[0], fx.Node)):
        return None
    s = e.args[0]
    if mask is not None and s.target == aten.sub.Tensor and s.kwargs.get("alpha", 1) == 1 \
            and isinstance(s.args[1], fx.Node) \
            and any(is_row_max(undetached(s.args[1]), s.args[0], d) for d in (-1, rank - 1)):
        s = s.args[0]  # the row max: a shift the softmax does not change
    if mask is not None and how != "times" and getattr(mask.meta.get("val"), "dtype", None) != torch.bool:
        return None
    return s, mask, how


def _fuse(gm: fx.GraphModule, score: _Score, report: FusionReport) -> bool:
    """Replace the attention by the op (True), or leave it when nothing reads β (False); NotFused otherwise."""
    algebra = _PairAlgebra(beta=score.beta, kl_scales=score.kl_scales, rank=score.rank,
                           kl_of=lambda node: _kl_scale(node, score.draw, score.rank))
    core = {score.softmax, *score.nodes}
    roots = _find_roots(algebra, core, score.mean)
    algebra.roots = set(roots)
    try:
        plan = _plan(algebra, roots)
    except NotFused as e:
        raise NotFused(f"a sum over the keys reads β in a way the fused op cannot express: {e}") from None
    outside = _outside_users(algebra, roots, core)
    if outside:
        raise NotFused(outside)
    lead = shape_of(score.softmax)[:-2]
    for root in roots:
        if shape_of(root)[:len(lead)] != lead:
            raise NotFused(f"{root.name} is {list(shape_of(root))}: its values broadcast the attention "
                           f"{list(shape_of(score.softmax))} over more leading dims (sequences or heads) than the "
                           "beliefs have; the op gives one sum per row of β")
    if not roots and not algebra.escapes:
        return False  # β is not used
    _rewrite(gm, algebra, roots, plan, score)
    mode = ("causal" if score.causal else "full") + (", diagonal masked" if score.mask_diagonal else "")
    if score.run_time_masks:
        sources = ", ".join(filter(None, (_source_names(m) for m, _ in score.run_time_masks)))
        mode += (", mask read at run time " + (f"from {sources}" if sources else "as the graph makes it (none of "
                                                "the kernels' patterns at this length)")
                 + " (the kernels run where it is all keys, causal, no self or causal without self)")
    if score.empty_rows_nan and not score.run_time_masks:  # (a run-time mask's empty rows are NaN, as in eager)
        mode += ", NaN on rows with no key"
    if algebra.escapes:
        mode += f", {_dims(score.rank)} formed for " + ", ".join(sorted({u.name for _, u in algebra.escapes}))
    report.add_fusion(PATTERN, OP_NAME, len(score.nodes) + len(algebra.visited | set(roots)) + 1,
                      f"{mode}, {score.parameterisation}, κ={_kappa_text(score.kappa)}, {len(roots)} β-weighted sums "
                      f"(row values {plan.v_width}, column values {plan.w_width} wide)")
    return True


def _find_roots(algebra: _PairAlgebra, core: set, positions: fx.Node) -> list[fx.Node]:
    """The sums over j that the values computed from β and KL flow into (graph order).

    ``positions`` is a per-position tensor [*L, N, K] (the means): where a mean over the keys
    needs their count N, it is read from there."""
    roots, seen = [], set(core)
    stack = [algebra.beta] + list(algebra.kl_scales)
    whole = set(stack)
    while stack:
        node = stack.pop()
        for user in list(node.users):
            if user in seen or user in algebra.kl_scales:
                continue
            seen.add(user)
            if _sum_over_keys(user, algebra.rank) or _matmul_reader(user, algebra.is_pair, algebra.rank) is not None:
                roots.append(user)
            elif (key_sum := _split_key_sum(user, algebra.rank, positions)) is not None:
                seen.add(key_sum)
                roots.append(key_sum)
            elif user.target in _ELEMENTWISE or _is_noop(user):
                stack.append(user)
            elif node in whole:
                algebra.escapes.append((node, user))  # e.g. β returned: formed [*L, N, N] for it
            elif user.target == aten.sum.dim_IntList:
                raise NotFused(f"{user.name} sums a tensor computed from β over dims {user.args[1]}; the fused "
                               "op gives sums over the key dim only")
            elif user.op == "output":
                raise NotFused(f"{node.name}, a {_dims(algebra.rank)} tensor computed from β or KL, is an output "
                               "of the graph; the fused op does not form it")
            else:
                raise NotFused(f"{user.name} ({short(user.target)}) uses {node.name}, computed from β or KL; "
                               "the fused op cannot provide it")
    order = {nd: i for i, nd in enumerate(algebra.beta.graph.nodes)}
    return sorted(roots, key=order.__getitem__)


def _outside_users(algebra: _PairAlgebra, roots, core: set) -> str | None:
    """The first use of a tensor computed from β or KL that the fused op does not provide, or None.

    The factors read from the beliefs alone (``μ.unsqueeze(-2)``, ``μ_i − μ_j``) may have other
    readers (the decode's ``μ_i − m_v``, once equal subexpressions are one node): they stay for them."""
    inside = algebra.visited | set(roots) | core
    escapes = set(algebra.escapes)
    for node in algebra.visited & _computed_from_beta_or_kl(algebra):
        if node in algebra.kl_scales:
            continue  # the score's own nodes stay for their other users
        for user in node.users:
            if user not in inside and (node, user) not in escapes:
                return (f"{user.name} ({short(user.target)}) uses {node.name}, a tensor over the pairs (i, j) the "
                        "fused op does not form")
    return None


def _computed_from_beta_or_kl(algebra: _PairAlgebra) -> set[fx.Node]:
    """The nodes the algebra read that β or a KL factor flows into."""
    found, stack = set(), [algebra.beta, *algebra.kl_scales]
    while stack:
        for user in stack.pop().users:
            if user in algebra.visited and user not in found:
                found.add(user)
                stack.append(user)
    return found


def _root_poly(algebra: _PairAlgebra, root: fx.Node) -> Poly:
    if _sum_over_keys(root, algebra.rank):
        return algebra.read(root.args[0])
    pair, values, values_transposed, pair_transposed = _matmul_reader(root, algebra.is_pair, algebra.rank)
    poly = algebra.read(pair)
    if pair_transposed:
        poly = _poly_transpose(poly)
    per_key = algebra._leaf(values, "j", "transpose" if values_transposed else "as_is", True)
    return _poly_mul(poly, per_key)


@dataclass
class _Term:
    coef: float
    i_leaves: tuple  # ((leaf key, power), ...)
    output: str  # "row_sum", "row_kl_sum", "energy", "col_sum", "col_kl_sum", "col_energy_sum"
    feature: int | None  # index into the row or column features (None for energy)


@dataclass
class _Plan:
    terms: dict  # root -> list[_Term]
    v_features: list  # j-leaf products (tuples of (leaf key, power)), row values
    w_features: list  # column values
    energy_roots: set
    v_width: int = 0
    w_width: int = 0


def _plan(algebra: _PairAlgebra, roots: list[fx.Node]) -> _Plan:
    plan = _Plan(terms={}, v_features=[], w_features=[], energy_roots=set())
    for root in roots:
        poly = _root_poly(algebra, root)
        terms = []
        for factors, coef in poly.items():
            p = [(f, e) for f, e in factors if f[0] == "P"]
            s = [(f, e) for f, e in factors if f[0] == "S"]
            leaves = [(f, e) for f, e in factors if f[0] == "L"]
            if len(p) != 1 or p[0][1] != 1:
                raise NotFused(f"{root.name}: a term without exactly one factor β ({_describe(factors)})")
            flipped = p[0][0][1]
            if s and (len(s) != 1 or s[0][1] != 1 or s[0][0][1] != flipped):
                raise NotFused(f"{root.name}: a term with KL other than once, in β's orientation")
            with_kl = bool(s)
            i_leaves = tuple((f[1], e) for f, e in leaves if f[2] == "i")
            j_leaves = tuple((f[1], e) for f, e in leaves if f[2] == "j")
            energy_j, rest_j = [], []
            for key, e in j_leaves:
                src = algebra.leaves[key].source
                if src not in algebra.roots:
                    rest_j.append((key, e))
                elif src in plan.energy_roots and e == 1 and flipped and not with_kl and not energy_j:
                    energy_j.append((key, e))  # Σ_j β_ji Ā_j W_j: the op's col_energy_sum
                else:
                    raise NotFused(f"{root.name}: a per-key factor ({src.name}) is itself a sum over β")
            rest_j = tuple(rest_j)
            if not flipped:
                if with_kl and not rest_j:
                    terms.append(_Term(coef, i_leaves, "energy", None))
                    continue
                out = "row_kl_sum" if with_kl else "row_sum"
                features = plan.v_features
            else:
                out = "col_energy_sum" if energy_j else ("col_kl_sum" if with_kl else "col_sum")
                features = plan.w_features
            if rest_j not in features:
                features.append(rest_j)
            terms.append(_Term(coef, i_leaves, out, features.index(rest_j)))
        plan.terms[root] = terms
        if len(terms) == 1 and terms[0].output == "energy" and terms[0].coef == 1.0 and not terms[0].i_leaves:
            plan.energy_roots.add(root)
    return plan


def _describe(factors) -> str:
    names = []
    for f, e in factors:
        if f[0] == "P":
            names.append("β_ji" if f[1] else "β_ij")
        elif f[0] == "S":
            names.append("KL_ji" if f[1] else "KL_ij")
        else:
            names.append(f"{f[1][0]}_{f[2]}")
        if e != 1:
            names[-1] += f"^{e}"
    return " · ".join(names) or "a constant"


# ---------------------------------------------------------------------------------------------
# rewriting the graph


def _source_names(node: fx.Node) -> str:
    return ", ".join(n.name for n in tensors_read([node]))


def _rewrite(gm, algebra: _PairAlgebra, roots, plan: _Plan, score: _Score) -> None:
    """Replace the roots (and β/KL where read whole) by the op's outputs, via :func:`_replacement`."""
    leaf_keys = [key for key, leaf in algebra.leaves.items() if leaf.source not in algebra.roots]
    tempered = isinstance(score.kappa, Temperature)
    masks = [node for node, _ in score.run_time_masks]
    inputs = [score.mean, score.scale] + ([score.kappa.node] if tempered else []) + masks + score.ignored \
        + [algebra.leaves[key].source for key in leaf_keys]
    escaping = sorted({node for node, _ in algebra.escapes}, key=lambda n: n.name)

    def fn(mean, scale, *values):
        temperature, values = (values[0], values[1:]) if tempered else (None, values)
        mask_values, values = values[:len(masks)], values[len(masks):]
        ignored, leaf_values = values[:len(score.ignored)], values[len(score.ignored):]
        return _replacement(algebra, roots, plan, score, dict(zip(leaf_keys, leaf_values)), escaping, mean, scale,
                            temperature, mask_values, ignored)

    replaced = list(roots) + escaping  # β / KL read whole: every reader gets the formed one
    replace_with_function(gm, replaced, fn, inputs, outputs=replaced)


def _zero_per_query(x: torch.Tensor, queries: list) -> torch.Tensor:
    """``x``, a tensor the score reads that β does not depend on (a number per query added to it), as 0 where it
    is finite, NaN elsewhere (eager's row of β is NaN there: inf − inf), per query [*L, N] where ``x`` is one
    number per query, else summed; its gradient is 0, or NaN where ``x`` is not finite, as eager's."""
    zero = x * torch.where(torch.isfinite(x), 0.0, float("nan"))
    rank = len(queries)  # [*L, N]
    if zero.dim() >= rank and all(s == 1 for s in zero.shape[rank:]) \
            and all(a == 1 or a == b for a, b in zip(zero.shape[:rank], queries)):
        return zero.reshape(zero.shape[:rank])
    return zero.sum()


def _in_dtype_of(node: fx.Node, value: torch.Tensor) -> torch.Tensor:
    """``value`` in the dtype the graph gave ``node`` (under autocast, not the op's); no cast where it is (a pass
    reading the values computed from it checks them at float64 points, which a cast would round)."""
    dtype = node.meta["val"].dtype
    return value if value.dtype == dtype else value.to(dtype)


def _rows_of_no_finite_score(score, lse, unfold, empty_rows, allowed, mean, var, nan_rows=None):
    """For a softmax β: the function making NaN what eager's softmax makes NaN on a row whose allowed keys all
    score −inf (a query of variance 0 against keys of variance > 0: KL = +inf to each), where the op gives 0 (its
    lse is −inf, as on a row the mask leaves empty, which the caller handles); else None.

    Eager's row of β is NaN at every key, so the row's sums are NaN, and every column sum of its sequence; in the
    backward the NaN reaches the values f_j of every key, the row's column values, and through the row's scores
    the beliefs of the row and of its allowed keys (all beliefs of the sequence where the term reads the KL). The
    NaN is added with ``where`` (whose backward gives the other rows 0, not 0 · NaN); found at run time from lse."""
    if score.beta is not score.softmax:
        return None  # (a zero-filled β keeps 0 at the masked keys: not followed here)
    from hecate.lowering.kl_attention.naive import allowed_keys

    n = mean.shape[-2]
    rows = torch.isneginf(unfold(lse))  # [*L, N]
    if nan_rows is not None:  # (and the rows a number per query not finite makes NaN)
        rows = rows | nan_rows
    if empty_rows is not None:
        rows = rows & ~empty_rows
    belief = (mean + var).sum(-1)  # [*L, N]
    if allowed is not None:  # the row's belief and its allowed keys'
        keys = allowed_keys(n, score.causal, score.mask_diagonal, mean.device)
        keys = keys & (allowed if allowed.dim() == 2 else unfold(allowed))
        reach = belief + (keys.to(belief.dtype) @ belief.unsqueeze(-1)).squeeze(-1)
    else:  # (no [N, N] formed for the masks made from sizes: sums up to the row, or over all)
        keys = belief.cumsum(-1) if score.causal else belief.sum(-1, keepdim=True)
        reach = belief + keys - (belief if score.mask_diagonal else 0.0)
    every_belief = belief.sum(-1, keepdim=True)
    any_row = rows.any(-1)[..., None]  # [*L, 1]
    nan = float("nan")

    def with_nan(total, terms, v, w):
        """(every row value v and column value w read, not the term's slice of them: the NaN of a row reaches
        each value its β weighs, whichever sum reads it, and slices of the features' cat would look like a
        hand-written conv's windows to the report's signatures)"""
        reached = torch.zeros_like(reach)
        column = False
        for term in terms:
            if term.output.startswith("row"):  # every key's value, through the row's β
                reached = reached + v.sum((-1, -2))[..., None]
            elif term.output.startswith("col"):  # the row's own column values
                reached = reached + w.sum(-1)
                column = True
            reached = reached + (every_belief if "kl" in term.output or term.output == "energy" else reach)
        # (× NaN only where selected: elsewhere × 1, so that the zero gradient ``where`` gives is not 0 · NaN)
        if column:  # a column sum adds up every row: NaN in every column of the sequence
            per_sequence = torch.where(rows, reached, 0.0).sum(-1, keepdim=True) * torch.where(any_row, nan, 1.0)
            return total + torch.where(any_row, per_sequence, 0.0).unsqueeze(-1).to(total.dtype)
        return torch.where(rows.unsqueeze(-1), (reached * torch.where(rows, nan, 1.0)).unsqueeze(-1).to(total.dtype),
                           total)

    return with_nan


def _replacement(algebra, roots, plan, score, leaf_values, escaping, mean, scale, temperature=None, mask_values=(),
                 ignored=()):
    """The roots' values (then β / γ·KL for the nodes read whole) from one ``hecate.kl_attention`` call;
    ``temperature`` the value of the 0-d tensor a run-time κ is read from, ``mask_values`` those of the masks
    read at run time, ``ignored`` those of the tensors the score reads that β does not depend on."""
    from hecate.lowering.kl_attention.matmul_form import scores_and_beta
    from hecate.lowering.kl_attention.naive import allowed_keys

    # μ and σ² may share leading dims by broadcasting (one variance for every head): the op takes both whole, in
    # the dtype the graph's KL has (means of a bf16 Linear under autocast beside float32 variances: float32)
    mean, var = torch.broadcast_tensors(mean, {**VARIANCE_FROM, **_UNIT}[score.parameterisation](scale))
    dtype = torch.result_type(mean, var)
    mean, var = mean.to(dtype), var.to(dtype)
    *lead, n, k = mean.shape
    root_values: dict[fx.Node, torch.Tensor] = {}

    def fold(t):  # [*L, N, D] → [prod(L), N, D], the op's B
        return t.reshape(math.prod(lead), *t.shape[-2:])

    def unfold(t):  # [prod(L), N, ...] → [*L, N, ...]
        return t.reshape(*lead, *t.shape[1:])

    def leaf(key):
        src = leaf_values[key] if key in leaf_values else root_values[algebra.leaves[key].source]
        how = algebra.leaves[key].normalize
        if how == "squeeze_j":
            return src.squeeze(-2)
        if how == "squeeze_i":
            return src.squeeze(-3)
        if how == "transpose":
            return src.transpose(-1, -2)
        return src

    def product(leaves):
        out = None
        for key, power in leaves:
            t = leaf(key) ** power if power != 1 else leaf(key)
            out = t if out is None else out * t
        return out

    def features(products):
        cols, spans, start = [], [], 0
        for leaves in products:
            t = product(leaves)
            t = mean.new_ones(*lead, n, 1) if t is None else t
            t = t.expand(*lead, n, t.shape[-1]).to(mean.dtype)
            cols.append(t)
            spans.append((start, start + t.shape[-1]))
            start += t.shape[-1]
        return (torch.cat(cols, -1) if cols else mean.new_zeros(*lead, n, 0)), spans

    v, v_spans = features(plan.v_features)
    w, w_spans = features(plan.w_features)
    plan.v_width, plan.w_width = v.shape[-1], w.shape[-1]
    if temperature is None:
        kappa, run_time = score.kappa, None
    else:  # κ = c · t^power: the op's kappa · temperature, the power taken here (autograd carries it to t)
        kappa, run_time = score.kappa.scale, temperature  # κ = c·t, or c/t read as an inverse temperature
    allowed = None
    for value, (_, kind) in zip(mask_values, score.run_time_masks):
        value = value if kind == "allowed" else ~value
        if value.dim() <= 2 or all(s == 1 for s in value.shape[:-2]):  # [.., N, N] or [N] (per key) → [N, N]
            value = (value.reshape(value.shape[-2:]) if value.dim() >= 2 else value).expand(n, n)
        else:  # one per sequence (a key-padding mask [B, 1, N]) → the op's [B·H, N, N]
            value = fold(value.expand(*lead, n, n))
        allowed = value if allowed is None else allowed & value
    allowed = None if allowed is None else allowed.contiguous()
    sums = torch.ops.hecate.kl_attention(fold(mean), fold(var), fold(v), fold(w), kappa, score.causal,
                                         score.mask_diagonal, run_time, allowed,
                                         run_time is not None and score.kappa.power != 1)
    outputs = dict(zip(("row_sum", "row_kl_sum", "energy", "col_sum", "col_kl_sum", "col_energy_sum"),
                       map(unfold, sums)))
    empty_rows, nan_scale = None, float("nan")
    if allowed is not None:  # the rows with no allowed key, and in which sequences, known at run time
        keys = allowed_keys(n, score.causal, score.mask_diagonal, mean.device)
        empty_rows = ~(allowed & keys).any(-1)  # [N], or [*L, N] with a mask per sequence
        if score.beta is not score.softmax:  # β zero-filled where the masks built from sizes mask: a row's NaN
            empty_rows = empty_rows & keys.any(-1)  # stays where they allow a key (the fill zeroes the rest)
        empty_rows = empty_rows if empty_rows.dim() == 1 else unfold(empty_rows)
        nan_scale = torch.where(empty_rows.any(-1), float("nan"), 0.0).to(mean.dtype)
    elif score.empty_rows_nan:  # the softmax over no key is NaN: its row's sums, and every column sum
        empty_rows = torch.arange(n, device=mean.device) == 0 if score.causal else torch.ones(n, dtype=torch.bool,
                                                                                              device=mean.device)
    def nan_of_empty_rows(term, feature):
        """NaN, computed from what eager's NaN row of β reaches in the backward (softmax over no key): the
        values f_j of Σ_j β_ij f_j at every key j, the column values at the empty rows, and the beliefs when
        the term reads the KL or the mask is added to the score (its backward does not stop the NaN)."""
        reached = []
        if feature is not None:
            # (where, not a product: its backward gives the other rows 0, not 0 · NaN)
            reached.append(feature if term.output.startswith("row") else
                           torch.where(empty_rows.unsqueeze(-1), feature, 0.0))
        if "kl" in term.output or "energy" in term.output or score.additive_mask:
            reached += [mean, var]
        # (0, not NaN, where a mask read at run time leaves no row empty: nothing of NaN reaches a gradient);
        # per sequence: a sequence's NaN row reaches that sequence's values and beliefs alone
        per_sequence = sum(x.flatten(len(lead)).sum(-1) for x in reached) if reached else mean.new_zeros(lead)
        return (per_sequence * nan_scale)[..., None, None]

    # 0 from what β does not depend on (NaN where not finite), so that it gets eager's gradient, not None
    anchor = sum((_zero_per_query(x, lead + [n]) for x in ignored), mean.new_zeros(*lead, n)) if ignored else None
    nan_rows = None if anchor is None else torch.isnan(anchor)
    if score.additive_mask:  # a NaN belief makes its scores NaN at masked pairs too, which the added mask keeps:
        # eager's every row of the sequence is NaN; so does a key's variance of 0 (KL_ij = −inf + inf), where the
        # user's formula is written in the variances (or standard deviations) themselves
        bad = torch.isnan(mean + var)
        if score.parameterisation in ("variance", "standard deviation"):
            bad = bad | (var == 0)
        any_nan = bad.flatten(-2).any(-1)[..., None].expand(*lead, n)
        nan_rows = any_nan if nan_rows is None else nan_rows | any_nan
    no_score = _rows_of_no_finite_score(score, sums[6], unfold, empty_rows, allowed, mean, var, nan_rows)

    for root in roots:
        total, nan = None, None
        for term in plan.terms[root]:
            feature = None
            if term.output == "energy":
                t = outputs["energy"].unsqueeze(-1)
            else:
                start, end = (v_spans if term.output.startswith("row") else w_spans)[term.feature]
                t = outputs[term.output][..., start:end]
                feature = (v if term.output.startswith("row") else w)[..., start:end]
            if empty_rows is not None:
                nan = nan_of_empty_rows(term, feature) if nan is None else nan + nan_of_empty_rows(term, feature)
            i_part = product(term.i_leaves)
            if i_part is not None:
                t = t * i_part
            if term.coef != 1.0:
                t = t * term.coef
            total = t if total is None else total + t
        if total is None:
            total = mean.new_zeros(*lead, n, 1)
        if empty_rows is not None and nan is not None:
            if any(term.output.startswith("col") for term in plan.terms[root]):
                total = total + nan  # a column sum adds up every row, the empty one too
            else:
                total = torch.where(empty_rows.unsqueeze(-1), nan.to(total.dtype), total)
        if no_score is not None:
            total = no_score(total, plan.terms[root], v, w)
        if anchor is not None:
            total = total + anchor.unsqueeze(-1).to(total.dtype)
        # the root is [*L, N] + tail, tail (), (1,), (W,) or (1, W); a symbolic W is the terms' width (sizes
        # are read off the traced tensors, never the graph's SymInts)
        tail = root.meta["val"].shape[len(lead) + 1:]
        summed_pairs = _sum_over_keys(root, score.rank) and _rank(root.args[0]) == score.rank
        width = 1 if summed_pairs else tail[-1] if isinstance(tail[-1], int) else total.shape[-1]
        target = [*lead, n] + [1 if isinstance(s, int) and s == 1 else width for s in tail]
        # the dtype the graph gave the sum (under autocast, not the op's)
        root_values[root] = _in_dtype_of(root, total.expand(*lead, n, width).reshape(target))
    formed = []
    if escaping:
        kl, beta, _ = map(unfold, scores_and_beta(fold(mean), fold(var),
                                                  kappa if run_time is None else kappa * run_time
                                                  if score.kappa.power == 1 else kappa / run_time,
                                                  score.causal, score.mask_diagonal,
                                                  None if allowed is None else ~allowed))
        if empty_rows is not None:
            beta = torch.where(empty_rows.unsqueeze(-1), float("nan"), beta)
        for node in escaping:
            value = beta if node is algebra.beta else kl * algebra.kl_scales[node]
            if anchor is not None and node is algebra.beta:
                value = value + anchor.unsqueeze(-1).to(value.dtype)
            formed.append(_in_dtype_of(node, value))
    return [root_values[r] for r in roots] + formed

