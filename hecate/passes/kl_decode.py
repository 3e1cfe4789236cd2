"""Pass ``kl_decode``: logits −KL(q‖π_v)/τ against the token prior bank [→ cross-entropy] → one op.

What a model computes (spec §2.2, §3.3; ``TokenPriorBank.decode`` is one spelling)::

    logits_iv = −KL(N(μ_i, v_i) ‖ N(π_v, s_v)) / τ        # [B, N, V], from the [B, N, V, K] broadcast
    loss = F.cross_entropy(logits.view(-1, V), targets.view(-1))          # optional (or over dim 1 of
                                                                          # logits.transpose(1, 2))

What replaces it:

* logits used only by that cross-entropy → ``hecate.kl_decode_ce`` (per-token loss, then the
  reduction the model asked for): neither [B,N,V,K] nor [B,N,V] is formed;
* logits used by anything else too (returned to the user, or the softmax of the Q-flow's
  observation gradient) → ``hecate.kl_decode_logits``, the matmul form: [B,N,V] is formed
  because it is asked for, [B,N,V,K] is not; a cross-entropy on it stays as it is.

Recognised by what it computes: an [..., N, V] tensor (any leading dims: one sequence [N, V], a
batch, heads) computed from beliefs broadcast per query (``x.unsqueeze(-2)``, ``x[:, :, None]``)
against [V, K] prior tensors is evaluated in float64 at
random points and must equal −KL(q_i‖π_v)/τ (τ > 0) for some choice of means and of variance,
log-variance, standard deviation, log-std or precision on each side (:mod:`hecate.passes.gaussian`).
The priors' variance may be per token [V, K], shared by the tokens ([1, K], [K], 0-d: broadcast
to [V, K] before the op, its gradient summed back) or absent (N(π_v, I): ones). A τ read from a 0-d
tensor at run time (a learned temperature, a buffer, a float attribute under dynamic=True; τ = c·t or c/t)
divides the fused logits after the op (they are linear in 1/τ); the cross-entropy then stays as written,
kl_decode_ce taking τ as a number.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from hecate.passes.report import FusionReport
from hecate.passes.gaussian import (VARIANCE_FROM, Temperature, equals_scaled, evaluate, far_draw, gaussian_kl,
                                    independent, nearest_sources, proportion, run_time_temperature, shape_of, short,
                                    sources_shaped, strip_noops, where_read_apart)
from hecate.passes.matching import (NotFused, bound_reason, computed_from, first_threshold, is_register_hook,
                                    nodes_between, number_of, replace_with_function, same_shape, size_hint)

PATTERN = "kl_decode"
aten = torch.ops.aten


# cross_entropy_loss(input, target, weight=None, reduction=Mean, ignore_index=-100, label_smoothing=0.0)
_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}
_CONSUMERS = {aten.softmax.int, aten.log_softmax.int}  # read the logits at their shape


@dataclass
class _Decode:
    logits: fx.Node
    mu: fx.Node
    scale: fx.Node | None  # None: beliefs of unit variance N(μ_i, I)
    param: str
    prior_mu: fx.Node
    prior_scale: fx.Node | None  # None: unit-variance priors N(π_v, I)
    prior_param: str
    tau: "float | Temperature"  # a number, or read from a 0-d tensor at run time
    values: dict | None = None  # every node's value at the first draw (the bounds check reads them)
    featureless: "bool | frozenset" = False  # K = 1 written without its dim: beliefs [..., N] (or the columns
    # [..., N, 1] of this set), priors [V]


def _query_side(node: fx.Node) -> fx.Node | None:
    """x when ``node`` is an [..., N, K] tensor x broadcast per query as [..., N, 1, K], or with its positions
    flattened as [M, 1, K] (``mu.reshape(-1, 1, K)``: the logits are then [M, V])."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    src, out = shape_of(node.args[0]), shape_of(node)
    if src is None or out is None or len(src) < 2 or len(out) < 3 or out[-2] != 1:
        return None
    if node.target == aten.unsqueeze.default and len(out) == len(src) + 1 and node.args[1] % len(out) == len(out) - 2:
        return strip_noops(node.args[0])
    if node.target in (aten.view.default, aten.reshape.default) and out[-1] == src[-1] and (
            len(out) == len(src) + 1 and out[:-2] == src[:-1]
            or len(out) == 3 and len(src) > 2 and statically_known_true(out[0] == math.prod(src[:-1]))):
        return strip_noops(node.args[0])
    return None


def _product_sides(node: fx.Node, score: tuple) -> tuple[fx.Node, fx.Node] | None:
    """(x, y) when ``node`` [..., N, V] is the matrix product x @ yᵀ of a per-position x [..., N, K] and a
    per-token y [V, K]: a matmul with y transposed, or an einsum such as ``"btk,vk->btv"``."""
    shape = shape_of(node)
    if shape is None or len(shape) != len(score) or not all(map(_is, shape, score)):
        return None
    if node.target is aten.einsum.default and len(node.args[1]) == 2:
        inputs, _, out = node.args[0].replace(" ", "").partition("->")
        terms = inputs.split(",")
        if len(terms) != 2 or len(terms[1]) != 2 or terms[0][:-1] != out[:-1] \
                or terms[1] != out[-1] + terms[0][-1] or terms[0][-1] in out:
            return None
        x, y = node.args[1]
    elif node.target in (aten.matmul.default, aten.mm.default, aten.mul.Tensor) and len(node.args) == 2 \
            and isinstance(node.args[1], fx.Node) \
            and strip_noops(node.args[1]).target in (aten.transpose.int, aten.permute.default, aten.numpy_T.default) \
            and len(shape_of(node.args[1]) or ()) == 2:  # (a rank-2 permute, or y.T, is the transpose)
        # (a product over K = 1 is written, or normalised, as the broadcast x [..., N, 1] * yᵀ [1, V])
        x, y = node.args[0], strip_noops(node.args[1]).args[0]
        if node.target is aten.mul.Tensor and not _is((shape_of(x) or (0,))[-1], 1):
            return None
    else:
        return None
    x, y = strip_noops(x), strip_noops(y)
    sx, sy = shape_of(x), shape_of(y)
    if sx is None or sy is None or len(sx) != len(score) or not all(map(_is, sx[:-1], score[:-1])) \
            or len(sy) != 2 or not _is(sy[0], score[-1]) or not _is(sy[1], sx[-1]):
        return None
    return x, y


def _inputs(logits: fx.Node) -> tuple[list, list, list] | None:
    """(per-query belief tensors, prior tensors, 0-d input tensors) the score reads, or None if it reads
    others. A prior tensor is per token [V, K] or shared by every token ([1, K], [K]: a variance
    one per feature); a 0-d tensor may be a prior variance shared by everything, or a temperature
    held as a tensor."""
    score = shape_of(logits)
    queries, priors, scalars, numbers, seen, stack = [], [], [], [], set(), [logits]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        shape = shape_of(node)
        # (a query side is the score's rank + 1: p[None, None, :] of [V] priors, [1, 1, V], is not [.., N=1, 1, K=V])
        q = _query_side(node) if len(shape or ()) == len(score) + 1 else None
        product = _product_sides(node, score)
        if product is not None:  # the KL multiplied out: Σ_k x_ik y_vk of a belief's and a prior's tensors
            queries.append(product[0]) if product[0] not in queries else None
            priors.append(product[1]) if product[1] not in priors else None
        elif q is not None:
            queries.append(q) if q not in queries else None
        elif shape is not None and _per_position_number(shape, score):
            numbers.append(node)  # [..., N, 1]: a number per position (−Σ_k log v_k summed apart); before the
            # priors' [V, K] below, which [N, 1] of one sequence's [N, V] logits would otherwise be taken for
        elif _is(score[-1], 1) and shape is not None and len(shape) == len(score) - 1 >= 2 \
                and all(map(_is, shape, score[:-1])):
            queries.append(node) if node not in queries else None  # V = 1, K = 1 without its dim: the beliefs
            # [..., N] (their [..., N, 1] broadcast is the logits' own shape, which the walk goes through)
        elif shape is not None and len(shape) in (1, 2) and not _in_score(shape, score):
            node = strip_noops(node)
            while node.target is aten.neg.default and shape_of(node.args[0]) == shape:
                node = strip_noops(node.args[0])  # μ_i + (−π_v): the sign is the score's, the prior is π_v
            priors.append(node) if node not in priors else None
        elif shape == ():
            node = strip_noops(node)
            while node.target is aten.neg.default and shape_of(node.args[0]) == ():
                node = strip_noops(node.args[0])  # −t·KL: the sign is the score's, the temperature is t
            scalars.append(node) if node not in scalars else None
        elif shape is not None and not _in_score(shape, score):
            return None  # the walk stays inside the [B, N, V(, K)] score
        elif node.op != "call_function":
            if isinstance(node.meta.get("val"), torch.Tensor):
                return None
        else:
            stack.extend(node.all_input_nodes)
    for number in numbers:  # drawn through what it is computed from, as the beliefs are
        sources = _per_position_sources(number, score[:-1])
        if not sources and number.op in ("placeholder", "get_attr"):
            sources = [number]  # an input [..., N, 1]: beliefs of one dim, a column (against priors [V])
        if not sources:
            return None
        queries += [x for x in sources if x not in queries]
    # and the per-position tensors [..., N, K] of their own K they are computed from (s² and log s read apart)
    lead = score[:-1]

    def per_position(q):  # [..., N, K] of q's K, or [..., N] of a q without a feature dim
        own = len(lead) + (len(shape_of(q)) != len(lead))
        return lambda shape: len(shape) == own and all(map(_is, shape, lead)) \
            and (own == len(lead) or _is(shape[-1], shape_of(q)[-1]))
    sources = [x for q in queries for x in sources_shaped(q, per_position(q))]
    queries = list(dict.fromkeys(queries + sources))
    # a 0-d tensor read through several 0-d values (s² = exp(log s²) beside K·log s²): what they are computed
    # from is drawn, and they evaluated from it, so that they keep their relation; all of them are candidates
    # for the roles (_match draws the independent ones)
    sources = [x for s in scalars for x in sources_shaped(s, lambda shape: shape == ()) if x not in scalars]
    scalars = list(dict.fromkeys(scalars + sources)) if sources else independent(scalars)
    return queries, independent(priors), scalars


def _per_position_number(shape: tuple, score: tuple) -> bool:
    """Whether a tensor of ``shape`` is one number per position against logits ``score`` [..., N, V]: [..., N, 1],
    or with fewer leading dims where N ≠ V ([N, 1] of a τ per position every sequence shares)."""
    if _is(score[-1], 1) or len(shape) < 2 or not _is(shape[-1], 1):
        return False
    if len(shape) == len(score):
        return all(_is(a, b) for a, b in zip(shape, score[:-1]))
    return len(shape) < len(score) and _is(shape[-2], score[-2]) and not _is(score[-2], score[-1]) \
        and all(_is(a, 1) or _is(a, b) for a, b in zip(shape[-3::-1], score[-3::-1]))


def _per_position_sources(node: fx.Node, lead: tuple) -> list[fx.Node]:
    """The nearest per-position tensors [..., N, K] (``lead`` = [..., N]) ``node`` is computed from; those of
    [..., N, 1] where there are none (K = 1, or an isotropic variance); those of [..., N] where there are none of
    either (K = 1 written without its dim: ``mu[..., None] - prior_mu`` of [V] priors)."""
    def per_position(k_is_one):
        return lambda shape: len(shape) == len(lead) + 1 and _is(shape[-1], 1) == k_is_one \
            and all(_is(a, b) for a, b in zip(shape, lead))
    return nearest_sources(node, per_position(False)) or nearest_sources(node, per_position(True)) \
        or nearest_sources(node, lambda shape: len(shape) == len(lead) and all(map(_is, shape, lead)))


def _is(size, other) -> bool:
    """``size == other`` without guarding on a symbolic size: an answer not known for every size is no
    (comparing a dynamic batch with a literal 2 must not pin the batch to 2)."""
    return statically_known_true(size == other)


def _in_score(shape, logits_shape) -> bool:
    """Whether a tensor of ``shape`` lives in the [..., N, V, K] score of [..., N, V] logits: the logits'
    shape (or one broadcasting to it), or a shape broadcasting into [..., N, V, K] (a query's [..., N, 1, K], a
    prior's [1, V, K])."""
    *lead, v = logits_shape
    if len(shape) == len(logits_shape) and all(_is(a, 1) or _is(a, b) for a, b in zip(shape, logits_shape)):
        return True  # (or broadcast to it: [V] priors of K = 1 written without its dim, p[None, None, :])
    if len(shape) == len(lead) + 2:
        return all(_is(a, 1) or _is(a, b) for a, b in zip(shape, (*lead, v)))
    return 2 < len(shape) < len(lead) + 2 and _is(shape[-2], v) and all(_is(a, 1) for a in shape[:-2])


def _recognise(logits: fx.Node) -> _Decode | None:
    shape = shape_of(logits)
    if shape is None or len(shape) < 2 or logits.op != "call_function":
        return None
    found = _inputs(logits)
    if found is None or not found[0] or not found[1]:
        return None
    queries, priors, scalars = found
    v = size_hint(shape[-1])
    # K = 1 written without its dim: beliefs [..., N] broadcast against priors [V] (mu[..., None] - prior_mu); a
    # [..., N, 1] read twice (lv = logvar[..., None]) is found as a query too, and is what it adds the dim to
    if any(len(shape_of(x)) == len(shape) - 1 for x in queries):
        queries = list(dict.fromkeys(map(_without_unit_dims, queries)))
        lifted = {x for x in queries if len(shape_of(x)) == len(shape) - 1}
        # (s / var[..., None] read by a log: a [..., N, 1] number, evaluated from the beliefs, not drawn)
        queries = [x for x in queries if x in lifted or not computed_from([x], lifted)]
    featureless = all(len(shape_of(x)) == len(shape) - 1 for x in queries)
    columns = frozenset()  # beliefs of one dim kept as a column [..., N, 1] against priors [V] of no feature dim
    if not featureless and priors and all(len(shape_of(p)) == 1 for p in priors) \
            and all(len(shape_of(x)) == len(shape) and _is(shape_of(x)[-1], 1) for x in queries):
        featureless, columns = True, frozenset(queries)
    k = {1} if featureless else {size_hint(shape_of(x)[-1]) for x in queries}
    k = k - {1} or k  # a variance [..., N, 1] beside means [..., N, K] is isotropic; all [..., N, 1]: K = 1
    if len(k) != 1:
        return None
    k = k.pop()
    if featureless:
        priors = list(dict.fromkeys(map(_without_unit_dims, priors)))  # p[None, None, :] of [1, 1, V]
        priors = list(dict.fromkeys(priors + [x for p in priors for x in sources_shaped(
            p, lambda shape: len(shape) == 1 and size_hint(shape[0]) in (v, 1))]))
        if any(len(shape_of(x)) != 1 for x in priors):
            return None
        return _matched(logits, queries, priors, scalars, k, v, shape, columns)
    # a number per token [V] (Σ_k log s_vk summed apart) is drawn through the [V, K] tensors it is computed from
    numbers = [x for x in priors if _per_token_number(shape_of(x), k, v)]
    priors = _with_sources([x for x in priors if x not in numbers], k, v)
    own_numbers = []  # an input [V] of its own (a temperature per token): drawn as it is, for the diagnosis
    for number in numbers:  # (Σ_k m_vk² / s_vk + Σ_k log s_vk: through the [V] sums, the nearest [V, K] tensors)
        nearest = nearest_sources(number, lambda shape: len(shape) == 2 and size_hint(shape[-1]) == k
                                  and size_hint(shape[0]) in (v, 1))
        sources = _with_sources(nearest, k, v)
        if not sources and number.op in ("placeholder", "get_attr"):
            own_numbers.append(number)
        elif not sources:
            return None
        priors += [x for x in sources if x not in priors]
    priors = [x for x in priors if x not in numbers]
    if any(size_hint(shape_of(x)[-1]) not in (k, 1) for x in priors) \
            or len(queries) + len(priors) < 2:  # means on each side (a variance each, or unit ones)
        return None
    return _matched(logits, queries, priors + own_numbers, scalars, k, v, shape, False)


def _matched(logits, queries, priors, scalars, k, v, shape, featureless) -> _Decode | None:
    """The decode the logits are, of these candidates for the beliefs, priors and 0-d tensors; None if none."""
    constants = {x: torch.tensor(c, dtype=torch.float64) for x in scalars
                 if (c := number_of(x)) is not None}  # torch.tensor(K) in the model: read, not drawn
    scalars = [x for x in scalars if x not in constants]
    why: list[str] = []  # the nearest decode the logits are not, said where they are none
    decode = _match(logits, queries, priors + scalars, k, v, shape, constants or None, featureless, why)
    if decode is None:  # drawn where each value is first read apart (var = −0.5/η₂ of natural parameters)
        lifted_queries, lifted_priors = _read_apart(queries), _read_apart(priors)
        if lifted_queries != queries or lifted_priors != priors:
            decode = _match(logits, lifted_queries, lifted_priors + scalars, k, v, shape, constants or None,
                            featureless)
    if decode is not None:
        inputs = [decode.mu, decode.scale, decode.prior_mu, decode.prior_scale] + (
            [decode.tau.node] if isinstance(decode.tau, Temperature) else [])
        bound = first_threshold(nodes_between([x for x in inputs if x is not None], [logits]), decode.values)
        if bound is not None:
            raise NotFused(bound_reason(bound, "the logits (the KL at the points checked)"))
    if decode is None and why:
        raise NotFused(why[0])
    if decode is not None or not scalars:
        return decode
    # the KL when the 0-d tensors are 1: it is read besides the beliefs and priors, as a temperature
    if _match(logits, queries, priors, k, v, shape,
              {**constants, **{x: torch.ones((), dtype=torch.float64) for x in scalars}}, featureless):
        names = ", ".join(x.name for x in scalars)
        raise NotFused(f"the logits read {names}, a 0-d tensor, besides the beliefs and priors, and are "
                       "−KL(q_i‖π_v) where it is 1, but not −KL/τ for τ = c·t or c/t of it")
    return None


def _without_unit_dims(node: fx.Node) -> fx.Node:
    """What ``node`` adds dims of 1 to (``x[..., None]``, ``p[None, None, :]``, ``x.unsqueeze(-1)``), or ``node``."""
    def kept(shape):
        return [s for s in shape if not _is(s, 1)]
    while node.op == "call_function" and node.target in (aten.unsqueeze.default, aten.view.default,
                                                         aten.reshape.default) \
            and isinstance(node.args[0], fx.Node) and shape_of(node.args[0]) is not None \
            and len(shape_of(node.args[0])) < len(shape_of(node)) \
            and kept(shape_of(node.args[0])) == kept(shape_of(node)):
        node = node.args[0]
    return node


def _read_apart(tensors: list) -> list:
    """``tensors`` with each drawn one (see :func:`independent`) replaced by where its value is first read apart,
    and what lies between dropped: the draw is then of the variance itself, whatever sign what it is computed from
    has."""
    lifted = {x: y for x in independent(tensors) if (y := where_read_apart(x)) is not x}
    on_the_way = {t for x, y in lifted.items() for t in tensors
                  if t is not y and computed_from([t], {x}) and computed_from([y], {t})}
    return list(dict.fromkeys([t for t in tensors if t not in on_the_way] + list(lifted.values())))


def _per_token_number(shape: tuple, k: int, v: int) -> bool:
    """Whether a tensor of ``shape`` is one number per token against logits [..., N, V]: [V], [1, V] (K ≠ V)."""
    return k != v and len(shape) >= 1 and size_hint(shape[-1]) == v and all(_is(s, 1) for s in shape[:-1])


def _with_sources(priors: list, k: int, v: int) -> list:
    """``priors`` and the per-token or shared tensors ([V, K], [1, K], [K]) they are computed from."""
    def per_token(shape):
        return len(shape) in (1, 2) and size_hint(shape[-1]) == k and (len(shape) == 1 or size_hint(shape[0]) in (v, 1))
    return list(dict.fromkeys(priors + [x for p in priors for x in sources_shaped(p, per_token)]))


# Largest [..., N, V, K] broadcast evaluated at the logits' own sizes (float64: 2 MiB): every node of a graph is a
# candidate for the logits, and most that cannot run at other sizes are no decode.
_MAX_OWN_SIZE_DRAW = 2 ** 18


def _match(logits, queries, priors, k, v, shape, fixed=None, featureless=False, why=None) -> _Decode | None:
    """The decode whose KL the logits are at two random draws of the beliefs [2, .., 3, K] and the
    priors (at their own sizes: [V, K], shared [1, K] / [K] / 0-d), the tensors ``fixed`` held. ``featureless``:
    K = 1 without its dim, beliefs [2, .., 3] and priors [V] (or shared [1], 0-d). ``why``: a list, given, to
    which the nearest decode the logits are not (:func:`_near_decode`) is added when they are none."""
    def own(x):  # a prior's own size: per token [V, K], or shared by the tokens; a number per token [V]
        if featureless is not False or _per_token_number(shape_of(x), k, v):
            return tuple(1 if _is(s, 1) else v for s in shape_of(x))
        return tuple(1 if _is(s, 1) else v if i == len(shape_of(x)) - 2 else k for i, s in enumerate(shape_of(x)))

    def feature(x):  # a belief's own last dims: K (1 where it has 1: an isotropic variance, a τ per position),
        if featureless is False:  # none (featureless), or the column's 1
            return (1,) if _is(shape_of(x)[-1], 1) and k != 1 else (k,)
        return (1,) if x in featureless else ()

    def draw(positions, expand):
        gen = torch.Generator().manual_seed(20251123)
        draws = []
        for low, high in ((0.3, 2.0), (0.05, 4.0)):
            env = {x: low + (high - low) * torch.rand(*positions, *feature(x), generator=gen, dtype=torch.float64)
                   for x in independent(queries)}
            env.update({x: low + (high - low) * torch.rand(own(x), generator=gen, dtype=torch.float64)
                        for x in independent(priors)})
            memo = {**(fixed or {}), **env}
            # (memo: what is computed from those; the logits as made, whatever the code writes into them later)
            draws.append((env, memo, evaluate(logits, memo, expand=expand, as_made=True)))
        return draws

    try:  # at small sizes of the draw's own, else (sizes baked into a reshape) at the graph's, if small
        draws = draw((2,) * (len(shape) - 2) + (3,), False)
    except Exception:
        own_sizes = tuple(size_hint(s) for s in shape[:-1])
        if math.prod(own_sizes) * v * k > _MAX_OWN_SIZE_DRAW:
            return None
        try:
            draws = draw(own_sizes, True)
        except Exception:  # not evaluable: not recognisable
            return None
    priors = [x for x in priors if isinstance(draws[0][1].get(x), torch.Tensor)]
    queries = [x for x in queries if isinstance(draws[0][1].get(x), torch.Tensor)]  # drawn, or computed from those
    near_one_only = None
    per_token = [x for x in priors if own(x) == ((v,) if featureless is not False else (v, k))]  # means per token
    shared = [x for x in priors if x not in per_token]  # [K], [1, K], 0-d: a variance of the beliefs' or the priors'
    def roles():  # (made as they are tried: there may be many)
        return ((mu, scale, param, prior_mu, prior_scale, prior_param)
                for mu in queries
                for scale in queries + shared + [None]  # the beliefs' variance per position, the same at each, or 1
                for prior_mu in per_token
                for prior_scale in priors + [None]  # None: priors of unit variance, N(π_v, I)
                if scale is not mu and prior_scale is not prior_mu
                for param in (_UNIT if scale is None else VARIANCE_FROM)
                for prior_param in (_UNIT if prior_scale is None else VARIANCE_FROM))

    for mu, scale, param, prior_mu, prior_scale, prior_param in roles():
        alphas = []
        for _, memo, value in draws:
            kl = _decode_kl(memo, mu, scale, param, prior_mu, prior_scale, prior_param, queries, featureless)
            alphas.append(proportion(value, kl) if kl is not None else None)
        if not all(a is not None and a < 0 for a in alphas):
            continue
        tau = float(f"{-1.0 / alphas[0]:.12g}") if math.isclose(*alphas, rel_tol=1e-9) else \
            run_time_temperature([-1.0 / a for a in alphas], [memo for _, memo, _ in draws],
                                 [x for x in priors if x not in (prior_mu, prior_scale)])
        if tau is not None:
            if not _far_from_one(logits, draws[0][0], draws[0][1], fixed, alphas[0], queries, mu, scale, param,
                                 prior_mu, prior_scale, prior_param, featureless):
                near_one_only = (mu, prior_mu)
                continue
            return _Decode(logits, mu, scale, param, prior_mu, prior_scale, prior_param, tau, draws[0][1],
                           featureless)
    if why is not None and draws[0][2].numel() <= _MAX_DIAGNOSED:  # (drawn small: each role's KL is formed)
        near = (w for role in itertools.islice(roles(), _MAX_DIAGNOSED_ROLES)
                if (w := _near_decode(draws, role, queries, featureless)) is not None)
        why += [w for w in [next(near, None)] if w is not None]
    if near_one_only is not None:
        mu, prior_mu = near_one_only
        raise NotFused(f"the logits are −KL(q_i ‖ π_v)/τ of {mu.name} and {prior_mu.name} where the means and "
                       "variances are near 1, but not at means of either sign and variances far from 1 (e^-8..e^8): "
                       "they compute something the KL does not there (a relu, abs, clamp or floor of a mean, a "
                       "variance or the logits themselves?)")
    return None


_MAX_DIAGNOSED = 1 << 16  # logits drawn larger than this (at the graph's own sizes) are not diagnosed
_MAX_DIAGNOSED_ROLES = 4096  # nor more readings of the candidates as beliefs and priors than this


def _near_decode(draws, role, queries, featureless) -> str | None:
    """Why the logits are not the decode of ``role`` (beliefs and priors in these parts) where they are one the op
    does not compute, at both draws: the KL the other way, KL(π_v ‖ q_i); or −KL/τ with τ one per token or one per
    position, not one number. None where they are neither."""
    def at_both(test):
        return all(test(value, memo) for _, memo, value in draws)

    def proportional(value, kl):
        return kl is not None and (alpha := proportion(value, kl)) is not None and alpha < 0

    if at_both(lambda value, memo: proportional(value, _decode_kl(memo, *role, queries, featureless, reverse=True))):
        return ("the logits are −KL(π_v ‖ q_i)/τ, the KL from each token's prior to the belief; kl_decode computes "
                "−KL(q_i ‖ π_v)/τ, from the belief to the prior, and the two differ; compiled as written")
    # −1/τ the same along the tokens: a τ per position; along the positions: a τ per token
    for dims, what in (((-1,), "position"), (tuple(range(-len(draws[0][2].shape), -1)), "token")):
        def varies_along_the_other(value, memo, dims=dims):
            kl = _decode_kl(memo, *role, queries, featureless)
            if kl is None or kl.shape != value.shape or not bool((kl.abs() > 1e-9).all()):
                return False
            ratio = value / kl  # −1/τ where it is −KL/τ
            constant = torch.allclose(ratio, ratio.mean(dims, keepdim=True).expand_as(ratio), rtol=1e-7, atol=0.0)
            return constant and bool((ratio < 0).all()) and not torch.allclose(
                ratio, ratio.flatten()[:1].expand_as(ratio), rtol=1e-7, atol=0.0)
        if at_both(varies_along_the_other):
            return (f"the logits are −KL(q_i ‖ π_v)/τ with τ one per {what}; kl_decode divides by one temperature "
                    "(a number, or a 0-d tensor read at run time); compiled as written")
    return None


def _far_from_one(logits, env, memo, fixed, gamma, queries, mu, scale, param, prior_mu, prior_scale,
                  prior_param, featureless) -> bool:
    """Whether the logits are still γ · KL at means of either sign and variances far from 1 (:func:`far_draw`).
    A variance computed from what was drawn (``v = lv.exp().clamp(min=0.5)``) is drawn far itself (its value at
    the draw, ``memo``, gives its shape): where one term reads it and another what it is computed from (the log
    term ``lv``), the logits are no KL there."""
    scales = {x: p for x, p in ((scale, param), (prior_scale, prior_param)) if x is not None}
    memo = {**(fixed or {}), **far_draw(env, [mu, prior_mu], scales, seed=20251126, computed=memo)}
    try:
        value = evaluate(logits, memo, as_made=True)  # memo: a variance computed from what was drawn, too
        kl = _decode_kl(memo, mu, scale, param, prior_mu, prior_scale, prior_param, queries, featureless)
    except Exception:  # noqa: BLE001  (an op undefined there: not the KL, which is)
        return False
    return kl is not None and equals_scaled(value, kl, gamma)


def _with_feature(value, node, featureless):
    """A featureless decode's value with its K = 1 (a column [..., N, 1] of ``featureless``, a set, has it)."""
    return value if isinstance(featureless, frozenset) and node in featureless else value[..., None]


def _decode_kl(memo, mu, scale, param, prior_mu, prior_scale, prior_param, queries,
               featureless=False, reverse=False) -> torch.Tensor | None:
    """KL(q_i ‖ π_v) [..., N, V] (``reverse``: KL(π_v ‖ q_i)) of the beliefs and priors drawn or evaluated
    (``memo``) in these roles; None where their values do not broadcast so. ``featureless``: their K = 1 is added
    (the columns have it)."""
    if featureless is not False:
        memo = {x: _with_feature(memo[x], x, featureless) for x in (mu, scale, prior_mu, prior_scale) if x is not None}
    belief_var = (_UNIT if scale is None else VARIANCE_FROM)[param](memo.get(scale, memo[mu]))
    belief_var = belief_var.unsqueeze(-2) if scale in queries or scale is None else belief_var
    prior_to_var = (_UNIT if prior_scale is None else VARIANCE_FROM)[prior_param]
    belief, prior = (memo[mu].unsqueeze(-2), belief_var), (memo[prior_mu],
                                                           prior_to_var(memo.get(prior_scale, memo[prior_mu])))
    try:
        return gaussian_kl(*prior, *belief) if reverse else gaussian_kl(*belief, *prior)
    except RuntimeError:  # shapes that do not broadcast: not these roles
        return None


def run(gm: fx.GraphModule, report: FusionReport) -> None:
    import hecate.lowering.kl_decode  # noqa: F401  the ops must exist before we insert them

    for node in list(gm.graph.nodes):
        # the last node of the score: something other than an elementwise step of it reads it
        if node.op != "call_function" or not any(
                u.op == "output" or u.target in _CONSUMERS or is_register_hook(u.target)
                or not same_shape(u, node) for u in node.users):
            continue
        try:
            decode = _recognise(node)
            if decode is not None:
                _fuse(gm, decode, report)
        except NotFused as e:
            report.add_miss(PATTERN, str(e), node.name, nodes=[node])


_UNIT = {"unit-variance": torch.ones_like}  # priors N(π_v, I): the variance 1, made like the means


def _fuse(gm: fx.GraphModule, d: _Decode, report: FusionReport) -> None:
    logits, tau = d.logits, d.tau
    inputs = [x for x in (d.mu, d.scale, d.prior_mu, d.prior_scale) if x is not None]
    run_time = isinstance(tau, Temperature)
    if run_time:  # logits = −KL/(c·t^p) = kl_decode_logits(τ = c) / t^p: t read when the model runs
        inputs.append(tau.node)

    def beliefs(*values):  # the op reads the positions flat: [M, K]
        nodes = [x for x in (d.mu, d.scale, d.prior_mu, d.prior_scale) if x is not None]
        values = iter(_with_feature(v, x, d.featureless) if d.featureless is not False else v
                      for v, x in zip(values, nodes))
        mu = next(values)
        scale = None if d.scale is None else next(values)
        prior_mu = next(values)
        prior_scale = None if d.prior_scale is None else next(values)
        k = mu.shape[-1]
        var = _UNIT[d.param](mu) if scale is None else VARIANCE_FROM[d.param](scale)
        # one per position, flattened as the logits' rows are (mu.reshape(-1, 1, K) and var.mT.reshape(-1, 1, K):
        # row i of each), or shared by the positions (its gradient sums)
        var = var.reshape(mu.shape) if var.numel() == mu.numel() else var.expand_as(mu)
        prior_var = _UNIT[d.prior_param](prior_mu) if prior_scale is None else VARIANCE_FROM[d.prior_param](prior_scale)
        # a prior variance shared by the tokens ([1, K], [K], 0-d) broadcast to [V, K]: its gradient sums back; all
        # in the dtype the graph's KL has (means of a bf16 Linear under autocast beside float32 variances: float32)
        dtype = torch.result_type(mu, var)
        dtype = torch.promote_types(dtype, torch.result_type(prior_mu, prior_var))
        return (mu.reshape(-1, k).to(dtype), var.reshape(-1, k).to(dtype), prior_mu.to(dtype),
                prior_var.to(dtype).expand_as(prior_mu))

    what = f"{d.param} beliefs, {d.prior_param} priors, τ={tau if run_time else format(tau, 'g')}"
    ce = _cross_entropy_user(logits, shape_of(logits))
    if run_time and not isinstance(ce, str):
        ce = "τ is read at run time (kl_decode_ce takes τ as a number)"
    if isinstance(ce, str):
        def logits_fn(*values):
            values, t = (values[:-1], values[-1]) if run_time else (values, None)
            mu2, var2, prior_mu, prior_var = beliefs(*values)
            flat = torch.ops.hecate.kl_decode_logits(mu2, var2, prior_mu, prior_var, tau.scale if run_time else tau)
            if run_time:  # autograd carries the temperature's gradient through this product
                flat = flat / t if tau.power == 1 else flat * t
            lead = values[0].shape[:-1] if d.featureless is False or d.mu in d.featureless else values[0].shape
            if logits.meta["val"].dim() == len(lead) + 1:  # else the positions were flattened, as the op's
                flat = flat.reshape(*lead, prior_mu.shape[0])
            return flat.to(logits.meta["val"].dtype)  # the graph's dtype (under autocast, not the op's)

        replace_with_function(gm, [logits], logits_fn, inputs, outputs=[logits])
        report.add_fusion(PATTERN, "hecate.kl_decode_logits", 1,
                          f"logits in matmul form, {what}; cross-entropy not fused: {ce}")
        return
    ce_node, targets, reduction, ignore_index = ce

    def loss_fn(*values):
        targets = values[-1].reshape(-1)  # one id per position: [M], or [B, N] for [B, V, N] logits
        mu2, var2, prior_mu, prior_var = beliefs(*values[:-1])
        loss, _ = torch.ops.hecate.kl_decode_ce(mu2, var2, prior_mu, prior_var, targets, tau, ignore_index)
        loss = loss.to(ce_node.meta["val"].dtype)  # the graph's dtype (under autocast, not the op's)
        if reduction == "sum":
            return loss.sum()
        if reduction == "mean":  # as F.cross_entropy: the mean over the targets not ignored
            return loss.sum() / (targets != ignore_index).sum().to(loss.dtype)
        return loss.reshape(values[-1].shape)

    replace_with_function(gm, [ce_node.args[0], ce_node], loss_fn, inputs + [targets], outputs=[ce_node])
    report.add_fusion(PATTERN, "hecate.kl_decode_ce", 3,
                      f"logits + cross-entropy ({reduction}), {what}; [B, N, V] not formed")


_NLL = (aten.nll_loss_nd.default, aten.nll_loss.default)


def _log_softmax_over_classes(node: fx.Node, shape: tuple) -> bool:
    """Whether ``node`` is a log-softmax over the last dim of [..., V] (``F.log_softmax(logits, -1)``)."""
    return node.op == "call_function" and node.target in (aten.log_softmax.int, aten._log_softmax.default) \
        and node.args[1] % len(shape) == len(shape) - 1 and (len(node.args) < 3 or node.args[2] in (None, False))


def _cross_entropy_user(logits: fx.Node, shape: tuple):
    """(the cross_entropy node, flat targets, reduction, ignore_index) when logits feed only that (or a log-softmax
    over the classes that feeds only an nll_loss, before or after the view: cross-entropy as written out); else why
    not."""
    users = list(logits.users)
    if len(users) != 1:
        names = ", ".join(f"{u.name} ({short(u.target) if u.op == 'call_function' else u.op})" for u in users)
        return f"logits are also used by {names}"
    log_probs = users[0] if _log_softmax_over_classes(users[0], shape) and len(users[0].users) == 1 else None
    if log_probs is not None:  # F.log_softmax(logits, -1) then the view: the same rows, normalised first
        logits, users = log_probs, list(log_probs.users)
    # [N, V] logits go to cross-entropy as they are; [..., N, V] ones through a view(-1, V), or [B, N, V]
    # ones transposed to [B, V, N] (cross-entropy over dim 1, targets [B, N])
    view = logits if len(shape) == 2 else users[0]
    rows = math.prod(shape[:-1])
    if view is not logits and (log_probs is not None or not _classes_at_dim_one(view, shape)) \
            and (view.target not in (aten.view.default, aten.reshape.default, aten.flatten.using_ints)
                 or shape_of(view) != (rows, shape[-1])):
        return (f"logits feed {view.name} ({short(view.target)}), not a view(-1, V) or a transpose to [B, V, N] "
                "into cross-entropy")
    ce_users = list(view.users)
    if log_probs is None and len(ce_users) == 1 and _log_softmax_over_classes(ce_users[0], (rows, shape[-1])):
        log_probs = ce_users[0]  # the view, then F.log_softmax(·, -1)
        ce_users = list(log_probs.users)
    loss = aten.cross_entropy_loss.default if log_probs is None else _NLL
    if len(ce_users) != 1 or ce_users[0].target not in (loss if isinstance(loss, tuple) else (loss,)) \
            or ce_users[0].args[0] is not (view if log_probs is None or log_probs is logits else log_probs):
        return (f"the flattened logits {view.name} are used by something other than one cross-entropy"
                + ("" if log_probs is None else " (a log-softmax into one nll_loss)"))
    ce = ce_users[0]
    args = list(ce.args) + [None] * (6 - len(ce.args))
    weight, reduction, ignore_index, smoothing = args[2], args[3], args[4], args[5]
    weight = ce.kwargs.get("weight", weight)
    reduction = ce.kwargs.get("reduction", 1 if reduction is None else reduction)
    ignore_index = ce.kwargs.get("ignore_index", -100 if ignore_index is None else ignore_index)
    smoothing = ce.kwargs.get("label_smoothing", 0.0 if smoothing is None else smoothing)
    if weight is not None or smoothing not in (0, 0.0) or reduction not in _REDUCTIONS:
        return (f"cross-entropy {ce.name} has weight={weight}, label_smoothing={smoothing}, "
                f"reduction={_REDUCTIONS.get(reduction, reduction)!r}; "
                "the fused op supports no class weights and no smoothing")
    targets = args[1]
    if shape_of(targets) != tuple(shape[:-1] if view is not logits and _classes_at_dim_one(view, shape) else (rows,)):
        return f"cross-entropy targets {targets.name} of shape {shape_of(targets)} are not one id per position"
    return ce, targets, _REDUCTIONS[reduction], int(ignore_index)


def _classes_at_dim_one(node: fx.Node, shape: tuple) -> bool:
    """Whether ``node`` is [B, N, V] logits transposed to [B, V, N], as cross-entropy over a sequence takes them."""
    if len(shape) != 3:
        return False
    if node.target is aten.transpose.int:
        return {d % 3 for d in node.args[1:3]} == {1, 2}
    return node.target is aten.permute.default and [d % 3 for d in node.args[1]] == [0, 2, 1]
