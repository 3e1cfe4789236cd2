"""Linear attention over the whole sequence, recognised by evaluation → ``hecate.linear_attention``:
the parallel form ``(φ(Q) φ(K)ᵀ ⊙ D) V`` and (at the end) every step's state by a cumulative sum.

    y_t = Σ_{s≤t} D_ts (q_t · k_s) v_s,   D_ts = γ^{t−s}   (γ = 1: plain causal linear attention;
                                                              γ < 1: a decaying mask, RetNet's retention)

is the Hebbian recurrence M_t = γ M_{t−1} + v_t k_tᵀ, y_t = M_t q_t written for all t at once:
researchers train with it because it is parallel over t, at the price of the [T, T] score.
The op computes the recurrence (chunked), never forming the score.

Recognised by what it computes, whatever spells the mask (``tril``, a product with a
``tril(ones)`` or decay matrix, ``masked_fill``/``where`` with 0) or the transpose: for
``y = A @ V`` where A is a [..., T, T] tensor computed from one product ``S = Q @ Kᵀ`` (and
nothing else but constants), the subgraph from (Q, K, V) to y is evaluated at random float64
points and compared with the formula above, D read off the subgraph itself (its value at
q = k = e₁, where every q_t · k_s is 1). A mask that reads one tensor of the graph (a buffer or
parameter of γ or log γ per head, RetNet's decay) is checked at random draws of it to be
γ^(t−s) with γ that tensor's values, and γ is read from it at run time (so it may change or
learn). A mask of a gate per step, D_ts = Π_{s<r≤t} g_r (Mamba-2's exp(segsum(a)), gated linear
attention's cumulative products), is found the same way from D's first subdiagonal (g_t) at random
gates, and the op takes the gates as its keep factors at run time. A normaliser
``y / (A.sum(-1, keepdim=True) + eps)``
is recognised the same way. The products are ``@``/``bmm`` or einsums with their letters in any
order; once each operand is permuted to [*L, T, D] (L: none, a batch, or a batch and heads) the
replacement feeds the op's [B, T, H, D] and permutes the result back to y's layout.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from hecate.compiler.normalize import emit, is_row_max, undetached
from hecate.passes.gaussian import evaluate
from hecate.passes.matching import (NotFused, bound_reason, descendants, first_threshold, made_in_forward,
                                    nodes_between, replace_with_function, shifted_size, size_hint, snapped,
                                    tensors_read)
from hecate.passes.report import FusionReport

aten = torch.ops.aten
_PRODUCTS = (aten.matmul.default, aten.bmm.default)
_SEARCH = 12  # ops between the score product and the masked score: a mask is a few of them


def fuse_parallel_forms(gm: fx.GraphModule, report: FusionReport) -> None:
    def recognise(y):
        form = _parallel_form(y)
        return None if form is None else (form,)
    _fuse_each(gm, report, _products(gm), recognise, _fuse, "linear attention in its parallel form (φ(Q)φ(K)ᵀ ⊙ D) V")
    _report_one_token_forms(gm, report)


def _sliced_per_step(x: fx.Node, depth: int = 6) -> bool:
    """Whether ``x`` is read off a tensor at an integer index (``k[:, t]``: a step of a loop, whose q_t · k_t is
    [..., 1, 1] at any length), looking up through ``depth`` ops."""
    frontier = [x]
    for _ in range(depth):
        if any(n.target is aten.select.int for n in frontier):
            return True
        frontier = [i for n in frontier if n.op == "call_function" for i in n.all_input_nodes]
    return False


def _report_one_token_forms(gm: fx.GraphModule, report: FusionReport) -> None:
    """The parallel form over one token (T = 1): its [..., 1, 1] score Q Kᵀ times V [..., 1, E] is an elementwise
    product (the normal form makes a size-1 matmul one), no [T, T] score to avoid and nothing to fuse; reported
    so that it is not silent. Not where a softmax reads the score (softmax attention, not this family)."""
    pointwise = (aten.mul.Tensor, aten.div.Tensor, aten.add.Tensor, aten.sub.Tensor, aten.where.self,
                 aten.masked_fill.Scalar, aten.tril.default, aten.triu.default, aten.clone.default)
    for score in _products(gm):
        shape = _shape(score)
        form = _matrix_product(score, key_major=True) if shape is not None and shape[-2:] == ("1", "1") else None
        if form is None or score._erased or _shape(form[0]) != _shape(form[1]) or _shape(form[0])[-1] == "1" \
                or any(_sliced_per_step(x) for x in form[:2]):
            continue
        frontier, reads_v = [score], None
        for _ in range(_SEARCH):
            nxt = []
            for node in frontier:
                for user in node.users:
                    if user.target is aten.mul.Tensor and reads_v is None:
                        other = next((a for a in user.args if isinstance(a, fx.Node) and a is not node), None)
                        other_shape = _shape(other)
                        if other_shape is not None and len(other_shape) == len(shape) and \
                                other_shape[-2] == "1" and other_shape[-1] != "1":
                            reads_v = user
                            continue
                    if user.target in pointwise:
                        nxt.append(user)
            frontier = nxt
        if reads_v is not None:
            report.add_miss("linear_attention", "linear attention in its parallel form (φ(Q)φ(K)ᵀ ⊙ D) V over one "
                            "token (T = 1, a [..., 1, 1] score): an elementwise product (q·k) v with nothing to fuse, "
                            "compiled as written", nodes=[score, reads_v])


def _products(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _PRODUCTS + (aten.einsum.default,)]


def _fuse_each(gm: fx.GraphModule, report: FusionReport, candidates: list[fx.Node], recognise, fuse,
               what: str) -> None:
    """``fuse(gm, node, *found, report)`` for each candidate node ``recognise`` finds a form at (None: not this
    family); a reason either gives is a near-miss."""
    for node in candidates:
        if node._erased or not node.users:
            continue  # erased by an earlier fusion
        try:
            found = recognise(node)
            if found is not None:
                fuse(gm, node, *found, report)
        except NotFused as why:
            report.add_miss("linear_attention", f"{what}: {why}", nodes=[node])


def _shape(node) -> tuple | None:
    """The shape, sizes as text (a symbol compares by name: no guard is added under dynamic shapes)."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(str(s) for s in val.shape) if isinstance(val, torch.Tensor) else None


@dataclass
class _Form:
    """The parallel form found at y = A @ V: its nodes, and each operand's permutation to the
    canonical layout (Q, K [*L, T, D], V [*L, T, E], A [*L, T, T]) and y's from it (None: as is)."""

    a: fx.Node
    score: fx.Node
    q: fx.Node
    k: fx.Node
    v: fx.Node
    perms: dict[str, list[int] | None]
    shared: bool = False  # q, k [B, T, D] shared by the heads of v [B, H, T, E] (Mamba-2's B and C, one group)

    def canonical(self, name: str, value: torch.Tensor) -> torch.Tensor:
        perm = self.perms[name]
        value = value if perm is None else value.permute(perm)
        return value.unsqueeze(1) if self.shared and name in ("q", "k") else value  # (broadcast over the heads)

    def as_y(self, value: torch.Tensor) -> torch.Tensor:
        """A canonical [*L, T, E] value in y's own layout."""
        perm = self.perms["y"]
        return value if perm is None else value.permute(perm)


def _parallel_form(y: fx.Node) -> _Form | None:
    """The parallel form's structure at ``y`` (not yet its values)."""
    outer = _matrix_product(y, key_major=False)
    if outer is None:
        return None
    a, v, pa, pv, py = outer
    sa, sv = _permuted(_shape(a), pa), _permuted(_shape(v), pv)
    if sa is None or sv is None or len(sa) < 2 or len(sa) != len(sv):
        return None
    score, _ = _score_product(a, _shape(a))
    inner = _matrix_product(score, key_major=True) if score is not None else None
    if inner is None:
        return None
    q, k, pq, pk, ps = inner
    sq, sk = _permuted(_shape(q), pq), _permuted(_shape(k), pk)
    # a score [B, T, T] shared by the heads of A [B, H, T, T]: q and k are, and the op reads them per head
    shared = len(_shape(score)) == 3 < len(sa) and pa is None and ps is None
    if sq is None or sq[-1] != sk[-1] or sk[:-1] != (sv[:1] + sv[2:-1] if shared else sv[:-1]) or len(sv) > 5 \
            or len(sv) == 5 and shared or pa != _inverse(ps):
        return None  # (A is the masked score: the same layout)
    if sa[-1] != sa[-2]:
        if sq[:-2] != sk[:-2]:
            return None
        if score is a:  # no mask: the non-causal form, over queries and keys of other lengths
            raise NotFused(f"its score is [..., {sa[-2]}, {sa[-1]}] with no mask: queries and keys of "
                           + ("two length symbols (a recompile, or dynamic=True, makes each input's length its own; "
                              "compute q and k from one tensor, or compile with dynamic=False)"
                              if all(_symbolic(d) for d in (sa[-1], sa[-2])) else "other lengths")
                           + "; the op's non-causal form takes one length")
        if not all(_symbolic(d) for d in (sa[-1], sa[-2])):
            raise NotFused(f"its masked score is [..., {sa[-2]}, {sa[-1]}]: queries and keys of other lengths (a "
                           "cache of earlier keys, say); the op's causal mask is over one length, T queries against "
                           "the same T keys")
        raise NotFused(f"its score is [..., {sa[-2]}, {sa[-1]}]: torch.compile gave the queries' length and the keys' "
                       "two symbols (it saw no reason they are equal: a recompile, or dynamic=True, makes each "
                       "input's length its own), so the mask on it cannot be proved causal for every length; give "
                       "q and k one length by computing both from one tensor (q, k = qk.chunk(2, -1)), or compile "
                       "with dynamic=False")
    if sq != sk:
        return None
    return _Form(a, score, q, k, v, {"a": pa, "q": pq, "k": pk, "v": pv, "y": py}, shared)


def _symbolic(size: str) -> bool:
    return not size.isdigit()


def _inverse(perm: list[int] | None) -> list[int] | None:
    return None if perm is None else sorted(range(len(perm)), key=perm.__getitem__)


def _permuted(shape: tuple | None, perm: list[int] | None) -> tuple | None:
    return shape if shape is None or perm is None else tuple(shape[i] for i in perm)


def _matrix_product(node: fx.Node, key_major: bool):
    """(X, Y, X's permutation, Y's, the result's) for a product of X [*L, t, c] with Y over c:
    Y [*L, c, s] (``key_major=False``: A @ V) or Y [*L, s, c] (``key_major=True``: the score
    Q Kᵀ, Y = K), the result [*L, t, s]. Spelled ``@``/``bmm`` (the score's K transposed by
    ``.mT``, ``transpose``, ``permute``) or an einsum whose letters may sit anywhere
    (``"bts,bse->bte"``, ``"bthd,bshd->bhts"``). Permutations take each operand to that
    layout and the canonical result to the node's own (None: already so)."""
    if node.target in _PRODUCTS:
        x, y = node.args[:2]
        if not key_major:
            return x, y, None, None, None
        k = _untransposed(y)
        return None if k is None else (x, k, None, None, None)
    if node.target is not aten.einsum.default or len(node.args[1]) != 2 or not isinstance(node.args[0], str):
        return None
    inputs, _, out = node.args[0].replace(" ", "").partition("->")
    terms = inputs.split(",")
    if len(terms) != 2 or any(len(set(t)) != len(t) for t in (*terms, out)):
        return None
    a, b = terms
    contracted = (set(a) & set(b)) - set(out)
    t, s = set(a) - set(b), set(b) - set(a)
    lead = [letter for letter in out if letter in a and letter in b]
    if len(contracted) != 1 or len(t) != 1 or len(s) != 1 or set(out) != set(lead) | t | s:
        return None
    (c,), (t,), (s,) = contracted, t, s
    x_order, y_order = lead + [t, c], lead + ([s, c] if key_major else [c, s])
    canonical = lead + [t, s]

    def perm(term, order):
        p = [term.index(letter) for letter in order]
        return None if p == list(range(len(p))) else p

    out_perm = [canonical.index(letter) for letter in out]
    return (*node.args[1], perm(a, x_order), perm(b, y_order),
            None if out_perm == list(range(len(out_perm))) else out_perm)


def _score_product(a: fx.Node, shape: tuple) -> tuple[fx.Node | None, set]:
    """The one [..., T, T] product A is computed from (through pointwise ops and masks), if any,
    and the nodes between them; for A [B, H, T, T], a [B, T, T] one shared by the heads too."""
    shapes = (shape, shape[:1] + shape[2:]) if len(shape) == 4 else (shape,)
    frontier, seen, products, exps = [a], set(), [], []
    for _ in range(_SEARCH):
        nxt = []
        for node in frontier:
            if node in seen or not isinstance(node, fx.Node) or node.op != "call_function":
                continue
            seen.add(node)
            if node.target in _PRODUCTS + (aten.einsum.default,) and _shape(node) in shapes:
                products.append(node)
            else:
                if node.target in (aten.softmax.int, aten._softmax.default, aten.exp.default):
                    exps.append(node)
                nxt += node.all_input_nodes
        frontier = nxt
    if len(products) != 1:
        return None, seen
    if any(_reads(e, products[0], seen) for e in exps):
        return None, seen  # the scores exponentiated: softmax attention, not linear (an exp of the decay is)
    return products[0], seen


def _reads(node: fx.Node, source: fx.Node, within: set) -> bool:
    """Whether ``node`` is computed from ``source`` through nodes of ``within``."""
    stack, visited = [node], set()
    while stack:
        n = stack.pop()
        if n is source:
            return True
        if n in visited or n not in within:
            continue
        visited.add(n)
        stack += n.all_input_nodes
    return False


def _untransposed(node: fx.Node) -> fx.Node | None:
    """X for a node that is X with its last two dims swapped (``.mT``, ``transpose(-1, -2)``, ``permute``; a
    leading dim added after the swap, ``k.T[None]``, is added before it instead: the same values)."""
    if node.op != "call_function":
        return None
    rank = len(_shape(node) or ())
    if node.target == aten.unsqueeze.default and isinstance(node.args[0], fx.Node) \
            and node.args[1] % rank < rank - 2 and (x := _untransposed(node.args[0])) is not None:
        with node.graph.inserting_before(node):
            unsqueezed = emit(node.graph, aten.unsqueeze.default, x, node.args[1] % rank)
            node.replace_all_uses_with(emit(node.graph, aten.transpose.int, unsqueezed, -2, -1))
        node.graph.erase_node(node)
        return unsqueezed
    if node.target in (aten.mT.default, aten.t.default) or node.target == aten.numpy_T.default and rank == 2:
        return node.args[0]
    if node.target == aten.transpose.int and {d % rank for d in node.args[1:3]} == {rank - 2, rank - 1}:
        return node.args[0]
    if node.target == aten.permute.default and list(node.args[1]) == [*range(rank - 2), rank - 1, rank - 2]:
        return node.args[0]
    return None


def _sizes(node: fx.Node, size=size_hint) -> list[int]:
    return [size(s) for s in node.meta["val"].shape]


def _draw(node: fx.Node, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(_sizes(node), dtype=torch.float64, generator=generator)


# how a tensor the mask reads may hold the decay per head: γ itself, or log γ (RetNet's exp((t−s) log γ))
_GAMMA_FROM = {"γ": lambda x: x, "log γ": torch.exp}
_GAMMA_DRAW = {"γ": lambda u: u, "log γ": torch.log}
# how one number read at run time may scale the score: by itself (a learned scale) or its reciprocal (a temperature)
_SCALE_FROM = {"c": lambda x: x, "1/c": torch.reciprocal, "exp c": torch.exp}


@dataclass
class _Decay:
    """The mask D [*L, T, T] at the draw, D_ts = c·γ^(t−s): the scale c of the score (``(q @ kᵀ) * d**-0.5 * m``);
    γ per head (or one) when constant, else read at run time from ``tensor`` (γ or log γ per head, ``form``);
    ``drawn`` the tensor's value at the draw. With ``per_token`` a gate per step instead, D_ts = c·Π_{s<r≤t} g_r
    (Mamba-2's exp(segsum(a)), gated linear attention's parallel form): g [*L, T] is γ(tensor) with the tensor's
    dims permuted and placed by ``per_token`` (permutation, dims of [*L, T]) and broadcast over the rest."""

    d: torch.Tensor
    scale: float
    gammas: list[float] | None = None
    tensor: fx.Node | None = None
    form: str = "γ"
    drawn: torch.Tensor | None = None
    per_token: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    row_scale: torch.Tensor | None = None  # c_t per query (and head), [T] or [H, T]: D_ts = c_t·γ^(t−s)
    scale_form: str | None = None  # c read at run time from ``tensor`` (one number), γ the numbers in ``gammas``
    causal: bool = True  # False: no mask at all, D = c everywhere (φ(Q)φ(K)ᵀ V = φ(Q)(φ(K)ᵀ V))
    # D_ts = c·γ^(t−s) for s < t alone (tril(·, -1)): each query reads the state before its own step, whose
    # mask D[1:, :-1] = (c·γ)·γ^(t−s) for s ≤ t is the op's (c, γ above are that one's)
    strict: bool = False
    # with ``per_token``: a factor w_s per key as well, D_ts = c·w_s·Π_{s<r≤t} g_r (mLSTM's input gate,
    # exp(F_t − F_s + i_s); the inclusive product Π_{s≤r≤t} g_r = g_s·Π_{s<r≤t} g_r), which scales the keys
    strength: "_Strength | None" = None
    # the values drawn at the draw for the other tensors the mask reads (a strength's)
    others: dict = field(default_factory=dict)


@dataclass
class _Strength:
    """A factor w per key read at run time: w = form(tensor), the tensor's dims permuted and placed by ``layout``
    (as a gate's, :func:`_gate_layout`) and broadcast to the keys' [*L, T]."""

    tensor: fx.Node
    form: str  # a key of _GAMMA_FROM: "γ" (w itself) or "log γ" (log w)
    layout: tuple[tuple[int, ...], tuple[int, ...]]


def _decays(form: _Form, size=size_hint) -> _Decay:
    """D [*L, T, T] and γ per head for the mask A applies to the scores: A at q = k = e₁ (every
    q_t · k_s = 1), checked to be γ^{t−s} below the diagonal, one γ per head ([B, H, T, T])
    or one for all, the same in every sequence. A mask that reads one tensor of the graph (a
    buffer or parameter of per-head γ or log γ) is checked at two random draws of it, γ in (0.5, 1),
    and its γ read from that tensor at run time. Sizes are read by ``size``."""
    empty = [name for name in ("q", "k", "v") if 0 in _sizes(getattr(form, name), size)]
    if empty:
        raise NotFused(f"{empty[0]} {_sizes(getattr(form, empty[0]), size)} has no elements (a batch of 0 "
                       "sequences, say): there is no mask to read, and nothing to compute")
    values = {}
    for name in ("q", "k"):
        node = getattr(form, name)
        ones = torch.zeros(_sizes(node, size), dtype=torch.float64)
        form.canonical(name, ones)[..., 0] = 1.0  # a view: the feature dim in the node's own layout
        values[node] = ones
    values.setdefault(form.v, torch.zeros(_sizes(form.v, size), dtype=torch.float64))  # (v may be k itself)
    # beside the score (the mask may read the queries too: gates computed from them, drawn as any gate tensor)
    inputs = tensors_read([form.a], stop=[form.score])
    inputs = [n for n in inputs if not made_in_forward(n)]  # (a torch.tensor(-inf) fill: evaluate reads it)
    if not inputs:
        full = _decay_values(form, dict(values), size)
        strict = _strictly_below(full)
        d = full[..., 1:, :-1] if strict else full  # (strict: the mask of the state before each step)
        try:
            if strict and d.shape[-1] < 2:
                raise NotFused("its mask D is strictly causal (s < t) over two tokens: the γ of its decay is not "
                               "known from one pair")
            scale = _scale(d)
            if strict:
                return _Decay(full, scale, _gammas(d / scale, None), strict=True)
        except _ScaledPerQuery:  # RetNet's D / sqrt(Σ_s D_ts): the op's rows scaled after it
            rows = d.diagonal(dim1=-2, dim2=-1)  # [*L, T]
            if rows.dim() > 1 and not torch.equal(rows, rows[:1].expand_as(rows)):
                raise NotFused("its mask D has a scale per query that differs between sequences") from None
            return _Decay(d, 1.0, _gammas(d / rows.unsqueeze(-1), None),
                          row_scale=rows[0] if rows.dim() > 1 else rows)
        if d.shape[-1] > 1 and bool((d == scale).all()):
            return _Decay(d, scale, [1.0], causal=False)
        return _Decay(d, scale, _gammas(d / scale, None))
    named = ", ".join(f"{n.name} of shape {list(_sizes(n))}" for n in inputs)
    why = (f"its mask D reads {named}, taken by the graph as input (a buffer, parameter or argument), "
           "whose values are not known when compiling; the mask must be computed from sizes and constants, "
           "or be γ^(t−s) with γ (or log γ) per head read from one tensor, or computed from such tensors "
           "(sigmoid(p), say), or Π_{s<r≤t} g_r with a gate g (or log g) per step read so (exp(segsum(a)), say)")
    candidates = [inputs[0]] if len(inputs) == 1 else []
    candidates += [n for n in _values_computed_from(form, inputs) if n not in candidates]
    candidates += [n for n in inputs if n not in candidates]  # (read beside another: a γ beside a learned scale)
    candidates = [n for n in candidates if n not in (form.q, form.k, form.v)]  # (their values are the score's)
    for tensor in candidates:
        if not tensor.meta["val"].is_floating_point():
            continue
        generator = torch.Generator().manual_seed(0)
        for gamma_form, draw in _GAMMA_DRAW.items():
            found = None
            for _ in range(2):
                drawn = draw(0.5 + 0.5 * torch.rand(_sizes(tensor, size), dtype=torch.float64, generator=generator))
                gammas = _GAMMA_FROM[gamma_form](drawn).flatten()
                try:
                    d = _decay_values(form, {**values, tensor: drawn}, size)  # NotFused: it reads more than this
                    scale = _scale(d)
                    if _gammas(d / scale, gammas) is None or found is not None and found.scale != scale:
                        break
                except _ScaledPerQuery as scaled:  # a truer reason than the tensor it reads
                    why = str(scaled)
                    break
                except NotFused:
                    break
                found = found or _Decay(d, scale, None, tensor, gamma_form, drawn)
            else:
                return found
        found = _per_token_decay(form, values, tensor, size, inputs) or _scale_read(form, values, tensor, size)
        if found is not None:
            return found
    raise NotFused(_STABILISED if _stabilised(form) else why)


_STABILISED = ("its mask D has its exponent's maximum over the keys subtracted, exp(log D − max_s log D) (xLSTM's "
               "stabiliser), so that each D_ts depends on every key of its row: the op takes no such mask; without "
               "the stabiliser, D = exp(F_t − F_s + i_s) of gates per step fuses")


def _stabilised(form: _Form) -> bool:
    """Whether the mask is computed from ``x − max(x, keys)``: a row max subtracted from the values it is of."""
    seen, stack = set(), [form.a]
    while stack:
        node = stack.pop()
        if node in seen or node in (form.score, form.q, form.k, form.v):
            continue
        seen.add(node)
        if node.target is aten.sub.Tensor and len(node.args) == 2 and all(isinstance(a, fx.Node) for a in node.args):
            x, peak = node.args
            rank = getattr(x.meta.get("val"), "dim", lambda: 0)()
            if rank and any(is_row_max(undetached(peak), x, dim) for dim in (-1, rank - 1)):
                return True
        stack += node.all_input_nodes
    return False


def _scale_read(form: _Form, values: dict, tensor: fx.Node, size) -> _Decay | None:
    """The score scaled by a number read at run time, one or one per head ([H], [H, 1, 1]), ``tensor``, its
    reciprocal or its exp (a learned scale, a learned temperature ``s / exp(log τ)``, a bias in log space
    ``exp((t−s) log γ + b)``), over a mask of constant γ: D = c·γ^(t−s) at two draws of it, or None."""
    generator = torch.Generator().manual_seed(2)
    for scale_form, of in _SCALE_FROM.items():
        found = None
        for _ in range(2):
            drawn = 0.5 + torch.rand(_sizes(tensor, size), dtype=torch.float64, generator=generator)
            try:
                d = _decay_values(form, {**values, tensor: drawn}, size)
                c = of(drawn).reshape(-1)
                if c.numel() != 1 and not (d.dim() == 4 and c.numel() == d.shape[1]):
                    return None  # not one number, nor one per head of [B, H, T, T]
                gammas = _gammas(d / (c.reshape(()) if c.numel() == 1 else c.view(1, -1, 1, 1)), None)
            except NotFused:
                break
            if found is not None and not all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(found.gammas, gammas)):
                break
            found = found or _Decay(d, 1.0, gammas, tensor, drawn=drawn, scale_form=scale_form)
        else:
            return found
    return None


def _per_token_decay(form: _Form, values: dict, tensor: fx.Node, size, inputs: list[fx.Node]) -> _Decay | None:
    """The mask as c·Π_{s<r≤t} g_r, a gate g_r per step read from ``tensor`` (g itself, or log g: Mamba-2's
    exp(segsum(a)) with a = Δt·A, a cumulative product of gates, their log-sigmoids summed), or None; times a
    strength w_s per key read from another of the mask's ``inputs`` or the gates themselves (:class:`_Strength`).

    At two draws of the tensor (gates in (0.5, 1)), and of the mask's other inputs, D's diagonal gives c·w_s and
    D_ts / D_ss the gate mask, whose first subdiagonal gives the gates of steps 1..T−1 (g_0 multiplies nothing);
    a permutation of the tensor's dims, broadcast to [*L, T], must give them, and D / D_ss must be the products of
    those gates (0 above the diagonal). A tensor with no dim of steps is one gate for every step (γ per head, or
    one: γ^(t−s)), as read beside a learned scale of the score, which is then a strength the same for every key.

    The other inputs are first those the gates are not computed from; then all of them, the gates' own sources
    drawn apart from the gates (mLSTM's i = f(x) beside F = cumsum(logsigmoid(x))): D, proved for gates and
    strength drawn independently, holds for the values the graph computes them from."""
    sources = set(tensors_read([tensor]))
    apart = [n for n in inputs if n not in sources]
    for others in (apart, list(inputs)) if len(apart) < len(inputs) else (apart,):
        found = _per_token_decay_reading(form, values, tensor, size, others)
        if found is not None:
            return found
    return None


def _per_token_decay_reading(form: _Form, values: dict, tensor: fx.Node, size,
                             others: list[fx.Node]) -> _Decay | None:
    """:func:`_per_token_decay` with ``others`` the mask's inputs drawn beside the gates."""
    if any(not n.meta["val"].is_floating_point() for n in others):
        return None
    generator = torch.Generator().manual_seed(1)
    for gamma_form, draw in _GAMMA_DRAW.items():
        found = None
        for _ in range(2):
            gates = 0.5 + 0.5 * torch.rand(_sizes(tensor, size), dtype=torch.float64, generator=generator)
            drawn = {n: 0.5 + 0.5 * torch.rand(_sizes(n, size), dtype=torch.float64, generator=generator)
                     for n in others}
            memo = {**values, tensor: draw(gates), **drawn}
            try:
                d = _decay_values(form, memo, size)  # (memo: every node of the mask evaluated, for the strength)
            except NotFused:  # the mask reads more than these tensors
                return None
            if d.dim() < 2 or d.shape[-1] < 2 or d.shape[-1] != d.shape[-2]:
                return None
            strict = _strictly_below(d)
            if strict:  # D_ts for s < t alone: D[1:, :-1] = c·w_s·g_t·Π_{s<r≤t−1} g_r, the row's own gate g_t
                found_strict = _strictly_causal_gates(form, d, gates, memo, others, tensor, gamma_form)
                if found_strict is None or found is not None and (
                        found.per_token != found_strict[0] or found.strength != found_strict[1]
                        or not math.isclose(found.scale, found_strict[2], rel_tol=1e-9)):
                    break
                perm, strength, scale = found_strict
                found = found or _Decay(d, scale, None, tensor, gamma_form, draw(gates), perm, strength=strength,
                                        others=drawn, strict=True)
                continue
            diagonal = d.diagonal(dim1=-2, dim2=-1)  # [*L, T]: c·w_s
            scale = float(diagonal.flatten()[0])
            if scale == 0.0 or not bool((diagonal != 0).all()):
                break
            strength, constant = None, bool((diagonal == scale).all())
            if not constant or others:  # (a diagonal the other tensors read may set: a learned scale)
                computed = _values_computed_from(form, others) if others else []
                strength, c = _key_strength(diagonal, [*others, *computed, tensor], memo, gamma_form)
                if strength is None and not constant:
                    break  # (the tensor read in another form may be: log γ where γ was tried)
                scale = c if strength is not None else scale
            perm = _gate_layout(gates, d / diagonal.unsqueeze(-2))
            if perm is None or found is not None and (found.per_token != perm or found.strength != strength
                                                      or not math.isclose(found.scale, scale, rel_tol=1e-9)):
                break
            found = found or _Decay(d, scale, None, tensor, gamma_form, draw(gates), perm, strength=strength,
                                    others=drawn)
        else:
            return found
    return None


def _strictly_causal_gates(form: _Form, d: torch.Tensor, gates: torch.Tensor, memo: dict, others: list[fx.Node],
                           tensor: fx.Node, gamma_form: str) -> tuple | None:
    """(gate layout, strength, c) of a strictly causal mask D_ts = c·w_s·Π_{s<r≤t} g_r (s < t), or None. Its rows
    from step 1, E = D[1:, :-1], are E_ts = c·w_s·g_{t+1}·Π_{s<r≤t} g_r: E over its diagonal is the gates' mask from
    step 1 on, the diagonal over g_{s+1} is c·w_s for s < T − 1 (w_{T−1} is read by no query). Over two steps the
    one pair is c·g_1 where the mask reads the gates alone (a factor per key would be that same number)."""
    lead_t = (*d.shape[:-2], d.shape[-1])
    if d.shape[-1] == 2:  # one pair, D_10 = c·w_0·g_1: the gate alone (no other tensor read), by its layout
        if others:
            return None
        for perm, places, g in _layouts(gates, lead_t):
            ratio = d[..., 1, 0] / g[..., 1]
            c = float(ratio.flatten()[0])
            if c != 0.0 and torch.allclose(ratio, torch.full_like(ratio, c), rtol=1e-9, atol=0.0):
                return (perm, places), None, c
        return None
    e = d[..., 1:, :-1]
    diagonal = e.diagonal(dim1=-2, dim2=-1)  # [*L, T − 1]
    if not bool((diagonal != 0).all()):
        return None
    perm = _gate_layout(gates, e / diagonal.unsqueeze(-2), first=1)
    if perm is None:
        return None
    g = _placed(_squeezed(gates).permute(perm[0]), perm[1], lead_t)
    weights = torch.cat([diagonal / g[..., 1:], torch.ones_like(diagonal[..., :1])], -1)  # c·w_s; w_{T−1} unread
    scale, known = float(weights.flatten()[0]), d.shape[-1] - 1
    constant = torch.allclose(weights[..., :known], torch.full_like(weights[..., :known], scale), rtol=1e-9, atol=0.0)
    if constant and not others:
        return perm, None, scale
    computed = _values_computed_from(form, others) if others else []
    strength, c = _key_strength(weights, [*others, *computed, tensor], memo, gamma_form, known)
    if strength is None:
        return (perm, None, scale) if constant else None
    return perm, strength, c


def _key_strength(diagonal: torch.Tensor, candidates: list[fx.Node], memo: dict,
                  gate_form: str, known: int | None = None) -> tuple[_Strength | None, float]:
    """(w, c) with D's diagonal c·w_s (its first ``known`` steps), w read from one of ``candidates`` (the mask's
    other inputs, then the gates' tensor, read in the gates' form ``gate_form``) as w or log w, at the values
    ``memo`` drew; (None, 0) if none gives it."""
    for node in candidates:
        value = memo.get(node)  # (a node of the mask not evaluated: not what it reads)
        if not isinstance(value, torch.Tensor) or _squeezed(value).dim() > diagonal.dim():
            continue
        for strength_form, of in _GAMMA_FROM.items():
            if node is candidates[-1] and strength_form != gate_form:
                continue  # (the gates' own tensor: in the gates' form)
            layout, ratio = _layout(of(value), diagonal, known)
            if layout is not None:
                return _Strength(node, strength_form, layout), ratio
    return None, 0.0


def _layouts(x: torch.Tensor, lead_t: tuple):
    """Each (permutation of x's dims, the dims of [*L, T] they take, x so placed and broadcast to [*L, T]): a
    tensor per step (its last dim the steps'), shared by what it has no dim of (a gate [B, T] shared by the heads
    of [B, H, T]); or one with no dim of steps, the same at every step (γ per head [H], or one)."""
    x = _squeezed(x)
    lead, perms = len(lead_t) - 1, list(itertools.permutations(range(x.dim())))
    steps_last = [(p, c + (lead,)) for p in perms for c in itertools.combinations(range(lead), x.dim() - 1)] \
        if x.dim() else []
    no_steps = [(p, c) for p in perms for c in itertools.combinations(range(lead), x.dim())]
    for perm, places in steps_last + no_steps:
        g = x.permute(perm)
        if any(g.shape[i] not in (1, lead_t[p]) for i, p in enumerate(places)):
            continue
        yield perm, places, _placed(g, places, lead_t)


def _squeezed(x: torch.Tensor) -> torch.Tensor:
    """``x`` without its dims of size 1 (a factor per key raised to the pairs' [.., 1, T] before it is scaled), the
    dims :func:`_layouts` permutes. A size Dynamo left symbolic is never 1 (it specialises 1)."""
    ones = tuple(i for i, s in enumerate(x.shape) if isinstance(s, int) and s == 1)
    return x.squeeze(ones) if ones else x  # (an empty squeeze is traced as a view_of no ONNX exporter translates)


def _placed(g: torch.Tensor, places: tuple, lead_t) -> torch.Tensor:
    """``g`` (dims already permuted) viewed with its dims at ``places`` of [*L, T] and broadcast to it."""
    view = [1] * len(lead_t)
    for i, p in enumerate(places):
        view[p] = g.shape[i]
    return g.reshape(view).expand(*lead_t)


def _layout(x: torch.Tensor, target: torch.Tensor, known: int | None = None) -> tuple[tuple | None, float]:
    """((permutation, places), c) such that x placed so is ``target`` [*L, T] divided by one number c (on its first
    ``known`` steps, where the rest is read by nothing); else (None, 0)."""
    for perm, places, placed in _layouts(x, tuple(target.shape)):
        ratio = (target / placed)[..., :known]
        c = float(ratio.flatten()[0])
        if c != 0.0 and torch.allclose(ratio, torch.full_like(ratio, c), rtol=1e-9, atol=0.0):
            return (perm, places), c
    return None, 0.0


def _gate_layout(gates: torch.Tensor, d: torch.Tensor,
                 first: int = 0) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(the permutation of the gates' dims, the dims of D's [*L, T] they take, the last T) that, broadcast over the
    others (a gate [B, T] shared by the heads of [B, H, T]), make D_ts = Π_{s<r≤t} g_r; or None. ``first`` = 1: D
    is that mask from step 1 on, [*L, T − 1, T − 1] (a strictly causal one's, whose gate g_0 nothing reads)."""
    steps = torch.arange(d.shape[-1] + first)
    below = steps[:, None] >= steps[None, :]
    lead_t = (*d.shape[:-2], d.shape[-1] + first)
    for perm, places, g in _layouts(gates, lead_t):
        logs = torch.log(g).clone()
        logs[..., 0] = 0.0
        total = logs.cumsum(-1)
        expected = torch.where(below, torch.exp(total[..., :, None] - total[..., None, :]), 0.0)
        if torch.allclose(d, expected[..., first:, first:], rtol=1e-6, atol=1e-30):
            return perm, places
    return None


def _values_computed_from(form: _Form, inputs: list[fx.Node], most: int = 8) -> list[fx.Node]:
    """The values the mask's graph inputs may reach it through, nearest the mask first (at most ``most``): those
    computed from them (and constants) with no more elements than they have, γ or log γ per head computed from a
    parameter (``sigmoid(p)``, ``-softplus(p)``), or log gates per step (Mamba-2's Δt·A) before they are summed
    and raised to the pairs. Each is tried: one the mask reads its inputs around is not known there and fails."""
    stop = {form.score, form.q, form.k, form.v}
    ancestors, stack = set(), [form.a]
    while stack:
        node = stack.pop()
        if node in ancestors or node in stop:
            continue
        ancestors.add(node)
        stack += node.all_input_nodes
    largest = max(math.prod(_sizes(n)) for n in inputs)
    length = size_hint(form.a.meta["val"].shape[-1])

    def small(node: fx.Node) -> bool:  # computed from the inputs and constants alone, at most their size
        val = node.meta.get("val")
        pairwise = isinstance(val, torch.Tensor) and val.dim() >= 2 and all(
            size_hint(s) == length for s in val.shape[-2:])  # (the mask's own [.., T, T]: never what it reads)
        return isinstance(val, torch.Tensor) and not pairwise and val.numel() <= largest \
            and set(tensors_read([node])) <= set(inputs) \
            and not any(isinstance(a, fx.Node) and not isinstance(a.meta.get("val"), torch.Tensor)
                        for a in node.all_input_nodes)  # no size read: the same value at every length
    order = {n: i for i, n in enumerate(form.a.graph.nodes)}
    found = [n for n in ancestors if n.op == "call_function" and small(n)]
    return sorted(found, key=order.__getitem__, reverse=True)[:most]


def _strictly_below(d: torch.Tensor) -> bool:
    """Whether the mask D is 0 on its diagonal and not below it (``tril(·, diagonal=-1)``: each query reads the
    keys before its own)."""
    return d.shape[-1] > 1 and bool((d.diagonal(dim1=-2, dim2=-1) == 0).all()) \
        and bool((d.diagonal(offset=-1, dim1=-2, dim2=-1) != 0).any())


def _decay_values(form: _Form, values: dict, size=size_hint) -> torch.Tensor:
    try:
        return form.canonical("a", evaluate(form.a, values, size))
    except NotFused as e:
        raise NotFused(f"its mask D is not known when compiling ({e}); the mask must be computed from sizes and "
                       "constants") from None


_NOT_CAUSAL = "its mask D is not causal with D_ts = c·γ^(t−s), 0 < γ ≤ 1 (a decay the recurrence keeps)"


class _ScaledPerQuery(NotFused):
    """The mask is c_t·γ^(t−s): a decay the op takes, with a scale per query it does not."""


def _scale(d: torch.Tensor) -> float:
    """c of a mask D_ts = c·γ^(t−s): its diagonal, one number (the score's scale: 1 for a bare mask)."""
    diagonal = d.diagonal(dim1=-2, dim2=-1)
    scale = float(diagonal.flatten()[0])
    if scale == 0.0 or not torch.allclose(diagonal, torch.full_like(diagonal, scale), rtol=1e-6, atol=0.0):
        why = _not_causal(d)  # a score divided by its row sums is c_t·1^(t−s) too: that reason says more
        if str(why) == _NOT_CAUSAL and bool((diagonal != 0).all()):
            try:
                _gammas(d / diagonal.unsqueeze(-1), None)
            except NotFused:
                pass
            else:
                raise _ScaledPerQuery("its mask D is causal with D_ts = c_t·γ^(t−s), a scale c_t per query (a row "
                                      "normalisation such as D / sqrt(Σ_s D_ts)) computed from what the graph reads "
                                      "at run time; the op takes one c; scale the product's rows by c_t after it, "
                                      "(φ(Q)φ(K)ᵀ ⊙ γ^(t−s)) V · c_t, which fuses")
        raise why
    return scale


def _not_causal(d: torch.Tensor) -> NotFused:
    """Why the mask D (A where every q_t·k_s = 1) is none of the op's: a score divided by its sums per query or
    per key before the product reads as a D whose rows (or columns) sum to 1."""
    m = d.reshape(-1, *d.shape[-2:])[0]
    if m.shape[-1] > 1 and bool((m == torch.diag(m.diagonal())).all()):
        return NotFused("its mask D is diagonal (a decay γ = 0: no token reads an earlier one), so the product is "
                        "elementwise, y_t = (φ(q_t)·φ(k_t)) v_t, with no state to carry; nothing to fuse")
    for dim, what in ((-1, "over the keys (Σ_s A_ts, per query)"), (-2, "over the queries (Σ_t A_ts, per key)")):
        sums = m.sum(dim)
        if m.shape[-1] > 1 and bool(torch.isclose(sums[sums != 0], torch.ones((), dtype=sums.dtype), rtol=1e-6).all()) \
                and bool((sums != 0).any()):
            extra = ("; the op's normaliser is per query, (A @ V) / (Σ_s A_ts + ε)" if dim == -2 else
                     ": linear attention fuses that normaliser as (A @ V) / (Σ_s A_ts + ε), ε > 0 a number; "
                     "here ε is 0 or no number, so a row summing to 0 is 0/0, whose NaN the product spreads "
                     "to other rows' gradients")
            return NotFused(f"its score is divided by its sum {what} before the product{extra}")
    return NotFused(_NOT_CAUSAL)


def _gammas(d: torch.Tensor, read: torch.Tensor | None) -> list[float] | None:
    """γ per head (or one) of the mask D when causal with D_ts = γ^(t−s), else NotFused; with ``read``
    (γ per head or one, flat), None unless those are D's γ."""
    heads = d[0] if d.dim() == 4 else d.reshape(-1, *d.shape[-2:])[:1]  # [H or 1, T, T]
    if d.dim() == 4 and not bool((d == heads).all()) or d.dim() < 4 and not bool((d == heads[0]).all()):
        raise NotFused("its mask differs between sequences")
    t = d.shape[-1]
    steps = torch.arange(t, dtype=torch.float64)
    below = steps[:, None] >= steps[None, :]
    gammas = [float(h[1, 0]) if t > 1 else 1.0 for h in heads]
    if read is not None:
        if read.numel() not in (1, len(heads)) or t < 2:
            return None
        gammas = [float(g) for g in read.expand(len(heads))]
    for gamma, h in zip(gammas, heads):
        expected = torch.where(below, gamma ** (steps[:, None] - steps[None, :]), 0.0)
        # the model computes its decay in its own precision (γ^(t−s) in float32, say), where a small γ's far
        # powers underflow (0.05^79: a denormal, or 0): below 1e-30 of the diagonal's 1, no float sum keeps them
        if not (0.0 < gamma <= 1.0 and torch.allclose(h, expected, rtol=1e-6, atol=1e-30)):
            if read is not None:
                return None
            raise _not_causal(d)
    return gammas if len(set(gammas)) > 1 else gammas[:1]


def _same_at_other_sizes(decay: _Decay, other: _Decay | None) -> None:
    """NotFused unless the scale and decay found at the example's sizes are those at others (``other``, None where
    the mask is none of the op's there; dynamic shapes): a scale 1/√D or a decay 1 − 1/T read from sizes is
    another number at every size, and the op takes numbers."""
    same = other is not None and math.isclose(decay.scale, other.scale, rel_tol=1e-9) \
        and decay.tensor is other.tensor and decay.form == other.form and decay.per_token == other.per_token \
        and _same_row_scale(decay.row_scale, other.row_scale) and decay.causal == other.causal \
        and decay.strict == other.strict and decay.strength == other.strength \
        and (decay.gammas is None) == (other.gammas is None) \
        and (decay.gammas is None or len(decay.gammas) == len(other.gammas)
             and all(math.isclose(a, b, rel_tol=1e-9) for a, b in zip(decay.gammas, other.gammas)))
    if not same:
        raise NotFused("its mask, score scale or decay is computed from sizes (1/√D, γ = 1 − 1/T, "
                       "j ≤ i + (T − 6), say) and is another at other sizes, which torch.compile's dynamic "
                       "shapes run this graph at; "
                       "the op takes one causal mask and numbers")


def _same_row_scale(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return a is None and b is None or a is not None and b is not None and a.shape == b.shape \
        and torch.allclose(a, b, rtol=1e-9, atol=0.0)


def _normaliser(y: fx.Node, values: dict, expected_den: torch.Tensor, size=size_hint) -> tuple[fx.Node, float] | None:
    """(the division node, eps) when y's only reader divides it by Σ_s A_ts + eps (or multiplies it by
    the reciprocal of that), evaluated with sizes read by ``size``."""
    if len(y.users) != 1:
        return None
    (div,) = y.users
    if div.target == aten.div.Tensor and div.args[0] is y:
        other, inverted = div.args[1], False
    elif div.target == aten.mul.Tensor and y in div.args[:2]:
        other, inverted = div.args[1] if div.args[0] is y else div.args[0], True
    else:
        return None
    if not isinstance(other, fx.Node) or other is y:
        return None
    try:
        den = evaluate(other, values, size)
    except NotFused:
        return None
    if inverted:
        den = 1.0 / den
    if den.shape != expected_den.shape:
        return None
    eps = (den - expected_den).flatten()
    if not torch.allclose(eps, eps[0].expand_as(eps), rtol=0.0, atol=1e-12):
        return None
    return div, snapped(float(eps[0]))


def _same_eps_at_other_sizes(y: fx.Node, form: _Form, eps: float) -> None:
    """NotFused unless the normaliser's eps at other sizes (dynamic shapes) is ``eps``: an eps read from sizes
    (1e-2·T, or (A + c).sum(-1), which adds T·c) is another number at every size, and the op takes one."""
    length = form.a.meta["val"].shape[-1]
    time = length.node.expr.free_symbols if isinstance(length, torch.SymInt) else set()
    for size in (shifted_size, lambda s: shifted_size(s, only=time)):
        try:
            decay = _decays(form, size)
            generator = torch.Generator().manual_seed(1)
            values = {n: torch.randn(_sizes(n, size), dtype=torch.float64, generator=generator)
                      for n in (form.q, form.k, form.v)}
            if decay.tensor is not None:
                values[decay.tensor] = decay.drawn
            values.update(decay.others)
            q, k, v = (form.canonical(name, values[getattr(form, name)]) for name in ("q", "k", "v"))
            other = _normaliser(y, values, form.as_y(((q @ k.mT) * decay.d).sum(-1, keepdim=True)), size)
        except (NotFused, RuntimeError):
            continue
        if other is not None and math.isclose(other[1], eps, rel_tol=1e-9, abs_tol=1e-15):
            return
        break
    raise NotFused(f"its normaliser Σ_s A_ts + ε has ε = {eps:g} at these sizes, computed from sizes (1e-2·T, or "
                   "(A + c).sum(-1), which adds T·c), so another at the other sizes torch.compile's dynamic shapes "
                   "run this graph at, or not found there; the op takes one number")


def _fuse(gm: fx.GraphModule, y: fx.Node, form: _Form, report: FusionReport) -> None:
    if not hasattr(torch.ops.hecate, "linear_attention"):
        raise NotFused("the op hecate.linear_attention is not registered (import hecate.lowering)")
    decay = _decays(form)
    dynamic = any(isinstance(s, torch.SymInt) for n in (form.q, form.k, form.v) for s in n.meta["val"].shape)
    if dynamic:
        # every size shifted; where that breaks the graph's own shapes (a dynamic head count against a buffer
        # of one γ per head), the length alone
        length = form.a.meta["val"].shape[-1]
        time = length.node.expr.free_symbols if isinstance(length, torch.SymInt) else set()
        other = None
        for size in (shifted_size, lambda s: shifted_size(s, only=time)):
            try:
                other = _decays(form, size)
            except NotFused:
                break
            except RuntimeError:
                continue
            break
        _same_at_other_sizes(decay, other)
    generator = torch.Generator().manual_seed(0)
    values = {n: _draw(n, generator) for n in (form.q, form.k, form.v)}  # (form.canonical: q, k per head)
    if decay.tensor is not None:
        values[decay.tensor] = decay.drawn
    values.update(decay.others)
    q, k, v = (form.canonical(name, values[getattr(form, name)]) for name in ("q", "k", "v"))
    scores = (q @ k.mT) * decay.d
    memo = dict(values)  # every node's value at the points (the bounds check reads them)
    if not torch.allclose(evaluate(y, memo, size_hint, as_made=True), form.as_y(scores @ v), rtol=1e-6, atol=1e-9):
        raise NotFused("A @ V differs from Σ_s D_ts (q_t·k_s) v_s at random points")
    dtypes = {n.meta["val"].dtype for n in (form.q, form.k, form.v)}
    if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
        raise NotFused(f"q, k, v have dtypes {sorted(map(str, dtypes))}; linear_attention needs one floating dtype")
    normaliser = _normaliser(y, dict(values), form.as_y(scores.sum(-1, keepdim=True)))
    if normaliser is not None and decay.row_scale is not None:
        raise NotFused("its mask D has a scale c_t per query and the product is normalised by the masked score's "
                       "row sums: (c_t·y_t)/(c_t·z_t + ε) is the op's normaliser with ε/c_t, one ε per query; the "
                       "op takes one number")
    if normaliser is not None and decay.strict and not normaliser[1] > 0:
        raise NotFused(f"its strictly causal mask leaves the first query no key, and the normaliser's ε is "
                       f"{normaliser[1]:g}: y_0 = 0 / (0 + ε) is 0/0 there (NaN, which its backward spreads as the "
                       "masked product does); with ε > 0 it fuses")
    if normaliser is not None and dynamic:
        _same_eps_at_other_sizes(y, form, normaliser[1])
    replaced, out = [y, form.a], y
    if normaliser is not None:
        out = normaliser[0]
        replaced.append(out)
    reads = ([decay.tensor] if decay.tensor is not None else []) + \
        ([decay.strength.tensor] if decay.strength is not None else [])
    inputs = [form.q, form.k, form.v] + reads + list(decay.others)
    bound = first_threshold(nodes_between(inputs, [out]), memo)
    if bound is not None:
        raise NotFused(bound_reason(bound, "it"))
    eps = normaliser[1] if normaliser is not None else 1e-6
    _, between = _score_product(form.a, _shape(form.a))
    gammas = decay.gammas if decay.tensor is None or decay.scale_form else _GAMMA_FROM[decay.form]
    scale = _SCALE_FROM[decay.scale_form] if decay.scale_form else decay.scale
    row_scale = None if decay.row_scale is None else decay.row_scale.tolist()
    replace_with_function(gm, replaced, _linear_attention_of(form.perms, gammas, scale, normaliser is not None,
                                                             eps, decay.per_token, row_scale, decay.causal,
                                                             decay.strict, decay.strength, form.shared),
                          [form.k, form.v, form.q] + reads,
                          outputs=[out])
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in sorted((n for n in between | {form.score} if not n._erased), key=order.__getitem__, reverse=True):
        if not node.users:  # the score and its mask, now read by nothing
            gm.graph.erase_node(node)
    report.add_fusion("linear_attention", "hecate.linear_attention", len(replaced) + 1,
                      ("strictly causal (s < t) (φ(Q)φ(K)ᵀ ⊙ D) V" if decay.strict else
                       "causal (φ(Q)φ(K)ᵀ ⊙ D) V" if decay.causal else "non-causal (φ(Q)φ(K)ᵀ) V") + ", parallel form"
                      + (f", decay γ={'/'.join(f'{g:g}' for g in gammas)}" if not callable(gammas) and gammas != [1.0]
                         else f", decay {decay.form} per {'step' if _per_step(decay, form) else 'head'} "
                              f"{_source(decay.tensor)} at run time" if callable(gammas) else "")
                      + (f", score scaled by {decay.scale:g}" if decay.scale != 1.0 else "")
                      + (f", score scaled by {decay.scale_form} {_source(decay.tensor)} at run time"
                         if decay.scale_form else "")
                      + (", rows scaled per query (c_t·γ^(t−s))" if decay.row_scale is not None else "")
                      + (f", keys scaled by {'a factor' if decay.strength.form == 'γ' else 'exp of a factor'} "
                         f"{_source(decay.strength.tensor)} at run time" if decay.strength is not None else "")
                      + (", normalised" if normaliser is not None else ""))


def _step_shifted(x: torch.Tensor, dim: int, by: int) -> torch.Tensor:
    """``x`` moved one step along its time dim ``dim``, zeros where nothing moved in: ``by`` = −1 gives each step
    the next one's value (the query each state before a step is read with), 1 the previous one's."""
    n = x.shape[dim]
    zeros = torch.zeros_like(x.narrow(dim, 0, 1))
    return torch.cat([x.narrow(dim, 1, n - 1), zeros], dim) if by < 0 else \
        torch.cat([zeros, x.narrow(dim, 0, n - 1)], dim)


def _per_step(decay: _Decay, form: _Form) -> bool:
    """Whether the decay read at run time is a gate per step (its tensor placed at the steps' dim of [*L, T])."""
    return decay.per_token is not None and (len(_sizes(form.k)) - 2) in decay.per_token[1]


def _source(value: fx.Node) -> str:
    """Where a decay read at run time comes from, in the user's terms: the tensor, or the tensors it is computed
    from (never an inner node's name)."""
    inputs = tensors_read([value])
    names = ", ".join(n.name for n in inputs)
    return f"read from {names}" if inputs == [value] else f"computed from {names}"


def _linear_attention_of(perms: dict, gammas, scale, normalise: bool, eps: float,
                         per_token: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
                         row_scale: list | None = None,
                         causal: bool = True, strict: bool = False, strength: _Strength | None = None,
                         shared: bool = False):
    """The replacement: the op over [B, T, H, D] views of the canonical [T, D] / [B, T, D] /
    [B, H, T, D] inputs, with the per-head (or one) decay γ as the keep factor of every step:
    ``gammas`` the numbers, or the function giving them from the tensor the mask reads (with ``per_token``,
    a gate per step: the tensor's dims permuted so, broadcast to the canonical [*L, T]). The score's
    scale c multiplies the queries (the normaliser's too, as the mask's c does): a number, or the function
    giving it from the tensor read (then ``gammas`` are numbers); a scale c_t per query
    (``row_scale``, [T] or [H, T]) the op's rows. A ``strict`` mask (s < t) reads, for each query, the state
    before its step: the op's read at step t − 1 with the query of step t, and 0 at t = 0. A ``strength`` w per
    key (read from the tensor after the gates') scales the keys."""
    def parallel_form_with_decay_read(k: torch.Tensor, v: torch.Tensor, q: torch.Tensor,
                                      read: torch.Tensor) -> torch.Tensor:
        return parallel_form_as_recurrence(k, v, q, read)

    def parallel_form_with_gates_and_strengths(k: torch.Tensor, v: torch.Tensor, q: torch.Tensor,
                                               read: torch.Tensor, strength_read: torch.Tensor) -> torch.Tensor:
        return parallel_form_as_recurrence(k, v, q, read, strength_read)

    def parallel_form_as_recurrence(k: torch.Tensor, v: torch.Tensor, q: torch.Tensor,
                                    read: torch.Tensor | None = None,
                                    strength_read: torch.Tensor | None = None) -> torch.Tensor:
        k, v, q = (x if perms[name] is None else x.permute(perms[name]) for x, name in ((k, "k"), (v, "v"), (q, "q")))
        if shared:  # q, k [B, T, D] → [B, H, T, D]: each head reads them (their gradients sum over the heads)
            k, q = (x.unsqueeze(1).expand(*v.shape[:-1], x.shape[-1]) for x in (k, q))
        rank = q.dim()
        if strength is not None:  # w_s [*L, T] times the keys (its gradient through the product)
            perm, places = strength.layout
            w = _placed(_squeezed(_GAMMA_FROM[strength.form](strength_read)).permute(perm), places, k.shape[:-1])
            k = k * w.unsqueeze(-1).to(k.dtype)

        def to_op(x):  # [T, D] / [B, T, D] / [B, H, T, D] / [B, C, H, T, D] (C: Mamba-2's chunks) → [B·C, T, H, D]
            return x[None, :, None] if rank == 2 else x[:, :, None] if rank == 3 else \
                x.transpose(1, 2) if rank == 4 else x.flatten(0, 1).transpose(1, 2)

        if callable(scale):  # one number (or one per head) read at run time, its gradient through the product
            c = scale(read).reshape(-1)
            q = q * (c.reshape(()) if c.numel() == 1 else c.view(1, -1, 1, 1)).to(q.dtype)  # [B, H, T, D]: per head
        elif scale != 1.0:
            q = q * scale
        read = None if callable(scale) else read  # (then the tensor read is the scale's, and γ are numbers)
        g = None
        if read is not None and per_token is not None:  # a gate per step, [*L, T]
            perm, places = per_token
            g = _placed(_squeezed(gammas(read)).permute(perm), places, k.shape[:-1])
        if strict:  # [.., T, D]: the query of step t read after step t − 1 (and its own step's gate: D_ts holds g_t)
            q = _step_shifted(q if g is None else q * g.unsqueeze(-1).to(q.dtype), -2, -1)
        k_, v_, q_ = to_op(k), to_op(v), to_op(q)
        alpha: Any
        if g is not None:  # the gates, [*L, T] → the op's [B, T, H]
            alpha = (g[None, :, None] if rank == 2 else g[:, :, None] if rank == 3 else
                     g.transpose(1, 2) if rank == 4 else g.flatten(0, 1).transpose(1, 2))
            alpha = alpha.to(k_.dtype).contiguous()
        elif read is not None:  # γ per head (or one) from the tensor, its gradient summed back through the expand
            alpha = gammas(read).reshape(-1).to(k_.dtype).expand(k_.shape[:3]).contiguous()
        else:
            alpha = None if gammas == [1.0] else \
                torch.tensor(gammas, dtype=k_.dtype, device=k_.device).expand(k_.shape[:3]).contiguous()
        y = torch.ops.hecate.linear_attention(k_, v_, q_, alpha, None, None, normalise, eps, causal)[0]
        y = y[0, :, 0] if rank == 2 else y[:, :, 0] if rank == 3 else y.transpose(1, 2) if rank == 4 else \
            y.transpose(1, 2).unflatten(0, q.shape[:2])
        if strict:  # y_0 reads no key
            y = _step_shifted(y, -2, 1)
        if row_scale is not None:
            y = y * torch.tensor(row_scale, dtype=y.dtype, device=y.device)[..., None]
        return y if perms["y"] is None else y.permute(perms["y"])

    # make_fx traces every parameter of the function it is given: the tensor read is one only where there is one
    if strength is not None:
        return parallel_form_with_gates_and_strengths
    return parallel_form_with_decay_read if callable(gammas) or callable(scale) else \
        lambda k, v, q: parallel_form_as_recurrence(k, v, q)


# ---------------------------------------------------------------- the cumulative-sum form, any layout

def fuse_cumulated_forms(gm: fx.GraphModule, report: FusionReport) -> None:
    """``M_t = cumsum(k ⊗ v or v ⊗ k, dim=1)`` read by q in any spelling (an einsum, ``@`` either side,
    a product and a sum) → the op, recognised by evaluating the read against the formula.

    The form the pattern pass reads (M_t laid out [Dv, Dk], ``(M_t @ q.unsqueeze(-1)).squeeze(-1)``,
    with m0, a normaliser or the last state read) is fused there first; this takes the other
    layouts and reads of the plain form. k, v, q are [B, T, D], [B, T, H, D] or [B, H, T, D] (the
    cumulative sum then over dim 2)."""
    _fuse_each(gm, report, list(gm.graph.find_nodes(op="call_function", target=aten.cumsum.default)),
               _cumulated_form, _fuse_cumulated, "causal M_t = Σ_{s≤t} v_s k_sᵀ by cumsum")


def fuse_noncausal_products(gm: fx.GraphModule, report: FusionReport) -> None:
    """``φ(Q) (φ(K)ᵀ V)`` by two products in any spelling (``q @ (k.mT @ v)``, einsums over [B, H, T, D]) → the
    op's non-causal form, recognised by evaluating the read against the formula. k, v, q are [*L, T, D] with time
    next to the features (the [B, T, H, D] einsums the pattern pass reads are fused there first)."""
    _fuse_each(gm, report, _products(gm), _noncausal_product, _fuse_noncausal,
               "non-causal φ(Q)(φ(K)ᵀV) by matrix products")


def _operands(node: fx.Node) -> list:
    return list(node.args[1]) if node.target is aten.einsum.default else list(node.args[:2])


def _noncausal_product(read: fx.Node) -> tuple | None:
    """(k, v, q, kv) when ``read`` [*L, T, Dv] reads q [*L, T, Dk] and kv [*L, Dk, Dv] (or [*L, Dv, Dk]), a product
    of two [*L, T, ·] tensors summed over T (by the product, or an outer product then ``sum`` over T) that nothing
    else reads. Keys of another length than the queries (two symbols after a recompile) are NotFused."""
    shape = _sizes_of(read)
    if shape is None or len(shape) < 3:
        return None
    for kv in _operands(read):
        others = [x for x in _operands(read) if x is not kv]
        if not isinstance(kv, fx.Node) or len(others) != 1 or len(kv.users) != 1 or kv.op != "call_function":
            continue
        product = kv
        if kv.target is aten.sum.dim_IntList and len(kv.args[1]) == 1 and isinstance(kv.args[0], fx.Node) \
                and len(kv.args[0].users) == 1:
            product = kv.args[0]  # Σ_t k_t ⊗ v_t: the outer products, then their sum over time
        if product.target not in _PRODUCTS + (aten.einsum.default, aten.mul.Tensor):
            continue
        q, (a, b) = others[0], (list(_operands(product)) + [None, None])[:2]
        for _ in range(2):  # k.mT @ v reads k itself; an outer product by broadcasting reads k[..., None] and v
            a, b = (x.args[0] if isinstance(x, fx.Node) and len(x.users) == 1 and (
                x.target is aten.unsqueeze.default or _swaps_last_two(x)) else x for x in (a, b))
        lead, t = shape[:-2], shape[-2]
        if not _same_sizes(_sizes_of(kv), lead, drop=2) or not isinstance(q, fx.Node) \
                or not _same_sizes(_sizes_of(q), lead + (t,), drop=1):
            continue
        keys = [_sizes_of(x) for x in (a, b)]
        if any(k is None or len(k) != len(shape) or not _same_sizes(k[:-2], lead) for k in keys) \
                or not statically_known_true(keys[0][-2] == keys[1][-2]):
            continue
        if not statically_known_true(keys[0][-2] == t):
            raise NotFused(f"its keys have length {keys[0][-2]} and its queries {t}: torch.compile gave them two "
                           "symbols (a recompile, or dynamic=True, makes each input's length its own), and the op "
                           "takes queries and keys of one length; compute q and k from one tensor, or compile with "
                           "dynamic=False")
        return a, b, q, kv
    return None


def _swaps_last_two(node: fx.Node) -> bool:
    """Whether ``node`` is ``x.mT`` (a transpose or permute of the last two dims alone): not a head split's
    ``transpose(1, 2)``, which makes the [*L, T, D] operand itself."""
    rank = len(_sizes_of(node) or ())
    if node.target is aten.transpose.int:
        return {d % rank for d in node.args[1:3]} == {rank - 1, rank - 2} if rank else False
    if node.target is aten.permute.default:
        return list(node.args[1]) == [*range(rank - 2), rank - 1, rank - 2] or \
            [d % rank for d in node.args[1]] == [*range(rank - 2), rank - 1, rank - 2]
    return False


def _sizes_of(node) -> tuple | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _same_sizes(sizes: tuple | None, expected: tuple, drop: int = 0) -> bool:
    """Whether ``sizes`` without their last ``drop`` dims are ``expected``, as expressions (under dynamic shapes a
    size may be written ((s0**2)//s0) in one tensor and s0 in another)."""
    if sizes is None:
        return False
    sizes = sizes[:len(sizes) - drop]
    return len(sizes) == len(expected) and all(statically_known_true(a == b) for a, b in zip(sizes, expected))


def _fuse_noncausal(gm: fx.GraphModule, read: fx.Node, x: fx.Node, y: fx.Node, q: fx.Node, kv: fx.Node,
                    report: FusionReport) -> None:
    generator = torch.Generator().manual_seed(0)
    values = {n: _draw(n, generator) for n in {x, y, q}}
    memo = dict(values)
    try:
        got = evaluate(read, memo, size_hint)
    except NotFused:
        return  # it reads more than k, v and q: not this form
    for k, v in ((x, y), (y, x)):
        if _same_sizes(_sizes_of(k), _sizes_of(q)) \
                and got.shape == values[v].shape[:-2] + (values[q].shape[-2], values[v].shape[-1]) \
                and torch.allclose(got, values[q] @ (values[k].mT @ values[v]), rtol=1e-6, atol=1e-9):
            break
    else:
        return  # another product of three tensors (attention without a softmax, say): not linear attention
    _check_read_by_meaning(k, v, q, read, memo)
    replace_with_function(gm, [read], _noncausal_as_op, [k, v, q], outputs=[read])
    report.add_fusion("linear_attention", "hecate.linear_attention", 2,
                      "non-causal φ(Q)(φ(K)ᵀV) by matrix products, read by meaning")


def _check_read_by_meaning(k: fx.Node, v: fx.Node, q: fx.Node, read: fx.Node, values: dict) -> None:
    """What a form read by evaluation must also be: k, v, q of one floating dtype, and no bound or branch on data
    between them and the read (``values``: the nodes' values at the point checked)."""
    dtypes = {n.meta["val"].dtype for n in (k, v, q)}
    if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
        raise NotFused(f"k, v, q have dtypes {sorted(map(str, dtypes))}; linear_attention needs one floating dtype")
    bound = first_threshold(nodes_between([k, v, q], [read]), values)
    if bound is not None:
        raise NotFused(bound_reason(bound, "it"))


def _noncausal_as_op(k: torch.Tensor, v: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """[*L, T, D] → the op's [B, T, H, D] with the leading dims as B·H = prod(L), H = 1, and back."""
    def bthd(x):
        return x.reshape(-1, x.shape[-2], 1, x.shape[-1])
    y = torch.ops.hecate.linear_attention(bthd(k), bthd(v), bthd(q), None, None, None, False, 1e-6, False)[0]
    return y.reshape(*q.shape[:-1], v.shape[-1])


def _unsqueezed(node: fx.Node, dim: int) -> fx.Node | None:
    """X for ``X.unsqueeze(dim)`` (dim counted in the result)."""
    if node.op == "call_function" and node.target == aten.unsqueeze.default:
        rank = len(_shape(node))
        if node.args[1] % rank == dim % rank:
            return node.args[0]
    return None


def _cumulated_form(cumsum: fx.Node):
    """(x, y, q, read, region, time dim) for M = cumsum(x ⊗ y, t) read into ``read`` with q, if shaped so: t is 1,
    or 2 for states [B, H, T, Dv, Dk]."""
    product, shape = cumsum.args[0], _sizes_of(cumsum)
    if shape is None or len(shape) not in (4, 5) or cumsum.args[1] % len(shape) not in range(1, len(shape) - 2) \
            or product.op != "call_function" or product.target != aten.mul.Tensor:
        return None
    rank = len(shape)
    a, b = product.args[:2]
    x, y = _unsqueezed(a, rank - 1), _unsqueezed(b, rank - 2)
    if x is None or y is None:
        x, y = _unsqueezed(b, rank - 1), _unsqueezed(a, rank - 2)
    if x is None or y is None:
        return None
    per_token = shape[:-2]
    region, frontier = [], [cumsum]
    for _ in range(6):  # the read: a few views, a product, a sum or squeeze
        frontier = [u for n in frontier for u in n.users]
        region += frontier
        reads = [n for n in frontier if _same_sizes(_sizes_of(n), per_token, drop=1)
                 and any(statically_known_true(_sizes_of(n)[-1] == d) for d in shape[-2:])]
        if reads:
            break
    else:
        return None
    read = reads[0]
    region = [n for n in region if n is read or read in descendants(n, 6)]  # on the way to the read only
    if any(u not in region for n in [cumsum, *region] if n is not read for u in n.users):
        return None  # the states are read elsewhere too: the pattern pass or the signatures say so
    # (the outer products themselves may be read too: Σ_{s<t} as the cumsum minus the step's own, cumsum − kv)
    inputs = {i for n in region for i in n.all_input_nodes} - set(region) - {cumsum, product}
    if len(inputs) != 1:
        return None
    (q,) = inputs
    for _ in range(2):  # q.unsqueeze(...) / q[..., None, :]
        if q.op == "call_function" and q.target == aten.unsqueeze.default:
            q = q.args[0]
    if not _same_sizes(_sizes_of(q), per_token, drop=1):
        return None
    return x, y, q, read, region, cumsum.args[1] % len(shape)


def _fuse_cumulated(gm: fx.GraphModule, cumsum: fx.Node, x: fx.Node, y: fx.Node, q: fx.Node, read: fx.Node,
                    region: list, time: int, report: FusionReport) -> None:
    inside = set(region) | {cumsum}
    generator = torch.Generator().manual_seed(0)
    values = {n: _draw(n, generator) for n in {x, y, q}}
    memo = dict(values)
    got = evaluate(read, memo, size_hint)
    for k, v in ((x, y), (y, x)):
        if not _same_sizes(_sizes_of(k), _sizes_of(q)) or got.shape != values[v].shape:
            continue
        heads_first = values[q].dim() == 3 or time == 2  # [B, T, D] or [B, H, T, D]: time next to the features
        kk, vv, qq = (values[n] if heads_first else values[n].transpose(1, 2) for n in (k, v, q))
        # y_t = M_t q_t, or M_{t−1} q_t (the states shifted a step: an exclusive prefix sum)
        for strict in (False, True):
            expected = (qq @ kk.mT).tril(-1 if strict else 0) @ vv
            if not heads_first:
                expected = expected.transpose(1, 2)
            if torch.allclose(got, expected, rtol=1e-6, atol=1e-9):
                break
        else:
            continue
        break
    else:
        raise NotFused("its read differs from y_t = M_t q_t, and from M_{t−1} q_t, at random points")
    _check_read_by_meaning(k, v, q, read, memo)
    as_op = _cumulated_as_op if time == 1 else _heads_first_cumulated_as_op
    replace_with_function(gm, [read], functools.partial(as_op, strict=strict), [k, v, q], outputs=[read])
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in sorted((n for n in inside | {cumsum.args[0], *cumsum.args[0].all_input_nodes} if not n._erased),
                       key=order.__getitem__, reverse=True):
        if not node.users and node.op == "call_function":
            gm.graph.erase_node(node)
    report.add_fusion("linear_attention", "hecate.linear_attention", len(inside) + 3,
                      "causal M_t = Σ_{s≤t} v_s φ(k_s)ᵀ by cumsum, "
                      + ("y_t = M_{t−1} φ(q_t)" if strict else "y_t = M_t φ(q_t)") + ", read by meaning")


def _cumulated_as_op(k: torch.Tensor, v: torch.Tensor, q: torch.Tensor, strict: bool = False) -> torch.Tensor:
    """[B, T, (H,) D] → the op; ``strict``: each query reads the state before its step (an exclusive prefix sum)."""
    if strict:
        q = _step_shifted(q, 1, -1)
    if q.dim() == 3:  # one head: the op's head dim added and taken away
        y = torch.ops.hecate.linear_attention(k[:, :, None], v[:, :, None], q[:, :, None], None, None, None,
                                              False, 1e-6, True)[0][:, :, 0]
    else:
        y = torch.ops.hecate.linear_attention(k, v, q, None, None, None, False, 1e-6, True)[0]
    return _step_shifted(y, 1, 1) if strict else y


def _heads_first_cumulated_as_op(k: torch.Tensor, v: torch.Tensor, q: torch.Tensor,
                                 strict: bool = False) -> torch.Tensor:
    """[B, H, T, D] → the op's [B, T, H, D] and back."""
    return _cumulated_as_op(k.transpose(1, 2), v.transpose(1, 2), q.transpose(1, 2), strict).transpose(1, 2)
