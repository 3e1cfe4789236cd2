"""A memory update written as a product with the identity, read as the sum it is.

DeltaNet's paper writes its step in the Householder form (spec eq. 2e with the l_2 bias, M stored [Dv, Dk])::

    M ← M (I − β k kᵀ) + β v kᵀ

which is the delta rule ``M ← M − β (M k − v) kᵀ``: one outer product with the key. :mod:`memory_step` reads
a step as retention plus *one* update term; here the body is first put in that shape, by three exact identities
of the algebra (rounding aside):

1. ``A (I ± X) = A ± A X`` and ``(I ± X) A = A ± X A`` for an identity matrix I (``torch.eye`` or
   ``torch.diag(torch.ones(d))``, expanded or viewed, made before the loop or inside it, never written into, as
   large as the matrix it is added to), and ``A I = A``; a gate outside, ``a (A (I − X) + Y)``, distributed first;
2. ``A (c · x yᵀ) = c · (A x) yᵀ`` and ``(c · x yᵀ) A = c · x (yᵀ A)``, where x is a column [.., D, 1], yᵀ a row
   [.., 1, D] and c numbers per matrix [.., 1, 1];
3. ``Σ_i s_i · F · R_i = F · Σ_i s_i · R_i``: the update terms' common factors F (the same graph nodes, and a
   common number) taken out.

Step 3 turns ``−β (M k) kᵀ + β v kᵀ`` into ``β (v − M k) kᵀ``. :func:`combined` rewrites a copy of the body; the
memory step is then recognised on the copy, which is installed only if it is one (else the body stays as written).
"""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import torch
from torch import fx

from hecate.compiler.normalize import emit
from hecate.passes.matching import computed_from, eliminate_dead_code, written_in_place
from hecate.passes.memory_heads import ROW_GATES
from hecate.passes.memory_step import _VIEWS, _Product, _product, _terms

aten = torch.ops.aten

_MATMULS = (aten.matmul.default, aten.bmm.default, aten.mm.default)


def combined(body: fx.GraphModule, state: int, identities: set[int]) -> fx.GraphModule | None:
    """A copy of scan ``body`` whose new state ``state`` is retention plus one update term, or None if the
    identities above change nothing. ``identities``: the indices of the body's inputs that are identity matrices
    (read off the graph around the scan, where the body sees only an input)."""
    body = copy.deepcopy(body)
    graph = body.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    M_in, M_out = placeholders[state], next(iter(reversed(graph.nodes))).args[0][state]
    if ROW_GATES in body.meta and M_out.target is aten.unsqueeze.default:
        M_out = M_out.args[0]  # a memory carried per row: the new state as the step writes it
    eyes = {placeholders[i] for i in identities}
    build = _Builder(graph, M_out.next)
    terms, written = [], _terms(M_out)
    distributed = _distributed(build, written)
    expanded = distributed is not written
    for sign, term in distributed:
        parts = _expanded(build, term, eyes)
        expanded = expanded or parts is not None
        terms += [(sign * s, t) for s, t in parts] if parts is not None else [(sign, term)]
    keeps = [_product(t).factors.count(M_in) == 1 for _, t in terms]
    kept = [term for term, keep in zip(terms, keeps) if keep]
    update = [term for term, keep in zip(terms, keeps) if not keep]
    together = _retention_together(build, kept, M_in)
    expanded, kept = expanded or together is not kept, together
    products = _collected(build, update)
    factored = _common_factored(build, products) if products and (len(products) > 1 or len(update) > 1) else None
    if factored is None and not expanded:
        return None
    new = build.sum(kept + ([(1.0, factored)] if factored is not None else update))
    M_out.replace_all_uses_with(new)
    eliminate_dead_code(graph)
    body.recompile()
    return body


def _retention_together(build: _Builder, kept: list[tuple[float, Any]], M_in: fx.Node) -> list[tuple[float, Any]]:
    """The terms Σ s_i c_i · M that keep the old memory (``M + f·(a·M + u − M)``: M, f·a·M and −f·M) as one,
    (Σ s_i c_i) · M, the c_i gates that do not read M; ``kept`` as it is where there is one, or another term."""
    if len(kept) < 2:
        return kept
    gates, number = [], 0.0
    for sign, term in kept:
        prod = _factors(term) if isinstance(term, fx.Node) else None
        if prod is None or prod.factors.count(M_in) != 1:
            return kept
        others = [f for f in prod.factors if f is not M_in]
        if any(computed_from([f], {M_in}) for f in others + prod.divisors) or prod.divisors and not others:
            return kept
        if others:
            gates.append((sign * prod.coef, build.product(1.0, others, prod.divisors)))
        else:
            number += sign * prod.coef
    if not gates:
        return [(1.0, build.product(number, [M_in], []))]
    decay = build.sum(gates)
    decay = decay if number == 0 else build.call(aten.add.Tensor, decay, number)
    return [(1.0, build.call(aten.mul.Tensor, decay, M_in))]


def identity_inputs(gm: fx.GraphModule, node: fx.Node) -> set[int]:
    """The indices of scan ``node``'s body inputs that are identity matrices in ``gm``."""
    _, init, xs, invariants = node.args[:4]
    outer = list(init) + list(xs) + list(invariants)
    first = len(init) + len(xs)  # per-step slices of xs are no matrices every step shares
    return {i for i, x in enumerate(outer) if i >= first and _is_identity(x)}


def _is_identity(node: Any) -> bool:
    """``torch.eye(n)`` that nothing writes into, through views that keep its last two dims
    (``eye(d).expand(B, d, d)``, ``eye(d)[None]``). Where it is read, it must also be as large as the matrix it
    is added to (an ``eye(1)`` broadcasts to all ones): see :func:`_identity`."""
    if not isinstance(node, fx.Node) or written_in_place(node) is not None:
        return False
    while node.op == "call_function" and node.args and isinstance(node.args[0], fx.Node) \
            and node.target in _VIEWS | {aten.expand.default, aten.detach.default} \
            and _shape(node) is not None and _shape(node.args[0]) is not None \
            and len(_shape(node.args[0])) >= 2 and _shape(node)[-2:] == _shape(node.args[0])[-2:]:
        node = node.args[0]  # (an eye(1) expanded to [d, d] is all ones: the last two dims must stay)
    if node.op != "call_function":
        return False
    if node.target in (aten.diag.default, aten.diag_embed.default) and len(node.args) == 1:
        return _is_ones(node.args[0])  # torch.diag(torch.ones(d))
    return node.target is aten.eye.default or node.target is aten.eye.m and node.args[0] == node.args[1]


def _is_ones(node: Any) -> bool:
    """A vector of ones nothing writes into (``torch.ones(d)``, ``full((d,), 1)``, ``x.new_ones(d)``)."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or written_in_place(node) is not None \
            or len(_shape(node) or ()) != 1:
        return False
    if node.target in (aten.ones.default, aten.new_ones.default, aten.ones_like.default):
        return True
    return node.target in (aten.full.default, aten.new_full.default, aten.full_like.default) \
        and node.args[-1 if node.target is aten.new_full.default else 1] == 1


def _distributed(build: _Builder, terms: list[tuple[float, Any]]) -> list[tuple[float, Any]]:
    """Each term c · (Σ s_i t_i), c elementwise factors (a gate outside the step: ``a (M (I − β k kᵀ) + β v kᵀ)``,
    one per matrix, or per row, ``exp(−Δ)[:, :, None] (h + x Bᵀ)``), as the terms Σ s_i · c · t_i."""
    out = []
    for sign, term in terms:
        prod = _factors(term) if isinstance(term, fx.Node) else None
        sums = [f for f in prod.factors if len(_terms(f)) > 1 and not _is_number(f)] if prod is not None else []
        if len(sums) != 1:
            out.append((sign, term))
            continue
        rest = [f for f in prod.factors if f is not sums[0]]
        out += [(sign * s, build.product(prod.coef, rest + [t], prod.divisors) if isinstance(t, fx.Node)
                 else None) for s, t in _terms(sums[0])]
        if any(t is None for _, t in out):
            return terms  # a number in the sum: left as written
    return out if len(out) != len(terms) else terms


def _expanded(build: _Builder, term: Any, eyes: set[fx.Node]) -> list[tuple[float, fx.Node]] | None:
    """``term`` = c · A B with B (or A) the identity, an outer product, or a sum with the identity in it
    (``A (I ± X)``), as the terms it is: A; c · (A x) yᵀ; A ± A X (identities 1 and 2); None if none applies."""
    prod = _factors(term)
    for f in prod.factors:
        operands = _matmul_operands(f)
        if operands is None:
            continue
        for side in (1, 0):  # A B, then B A
            other, rest = operands[1 - side], [h for h in prod.factors if h is not f]
            if _identity(operands[side], operands[side], eyes):
                return [(1.0, build.product(prod.coef, rest + [other], prod.divisors))]
            outer = _outer_product(operands[side])
            if outer is not None:
                return [(1.0, build.product(prod.coef, rest + [_reassociated(build, other, outer, side)],
                                            prod.divisors))]
            scaled = _factors(operands[side])  # c · (I ± X) with numbers per matrix c
            for g in scaled.factors:
                parts = _terms(g)
                numbers = [h for h in scaled.factors + scaled.divisors if h is not g]
                if not any(_identity(t, g, eyes) for _, t in parts) or not all(map(_is_number, numbers)) \
                        or any(not _identity(t, g, eyes) and _shape(t) != _shape(g) for _, t in parts):
                    continue  # (a part broadcast into the sum, (I − c) for numbers c, is no matrix of its own)
                factors = rest + [h for h in scaled.factors if h is not g]
                divisors = prod.divisors + scaled.divisors
                out = []
                for s, t in parts:
                    if _identity(t, g, eyes):
                        piece = other
                    else:
                        outer = _outer_product(t)
                        piece = _reassociated(build, other, outer, side) if outer is not None else \
                            build.call(aten.matmul.default, *((other, t) if side == 1 else (t, other)))
                    out.append((s, build.product(prod.coef * scaled.coef, factors + [piece], divisors)))
                return out
    return None


def _matmul_operands(f: Any) -> tuple[fx.Node, fx.Node] | None:
    """(A, B) where ``f`` is the matrix product A B: matmul, bmm, mm, or an einsum that is one over shared leading
    indices (``"bhij,bhjk->bhik"``)."""
    if not isinstance(f, fx.Node) or f.op != "call_function":
        return None
    if f.target in _MATMULS:
        return f.args[0], f.args[1]
    if f.target is aten.einsum.default and len(f.args[1]) == 2 and isinstance(f.args[0], str):
        equation = f.args[0].replace(" ", "")
        if "->" in equation and "." not in equation:
            (a, b), out = equation.split("->")[0].split(","), equation.split("->")[1]
            lead = a[:-2]
            if len(a) == len(b) == len(out) >= 2 and len(set(a + b[-1])) == len(a) + 1 and b[:-2] == lead \
                    and out == lead + a[-2] + b[-1] and b[-2] == a[-1]:
                return f.args[1][0], f.args[1][1]
    return None


def _identity(t: Any, where: Any, eyes: set[fx.Node]) -> bool:
    """Whether ``t`` is an identity matrix as large as ``where`` (the sum it is a term of, or itself) in its last
    two dims: an ``eye(1)`` broadcast is all ones."""
    shape, whole = _shape(t), _shape(where)
    return (t in eyes or _is_identity(t)) and shape is not None and whole is not None and len(shape) >= 2 \
        and shape[-2:] == whole[-2:] and shape[-1] == shape[-2]


def _is_number(node: Any) -> bool:
    """A number per matrix: a 0-d tensor or one of size 1 in the last two dims."""
    shape = _shape(node)
    return shape is not None and (len(shape) == 0 or len(shape) >= 2 and shape[-1] == 1 and shape[-2] == 1)


def _outer_product(X: Any) -> tuple[float, list[fx.Node], fx.Node, fx.Node] | None:
    """X = c · x yᵀ as (coef, numbers per matrix, x [.., D, 1], yᵀ [.., 1, E]), or None."""
    prod = _factors(X) if isinstance(X, fx.Node) else None
    if prod is None or prod.divisors:
        return None
    shapes = [_shape(f) for f in prod.factors]
    if not all(s is not None for s in shapes):
        return None
    columns = [f for f, s in zip(prod.factors, shapes) if len(s) >= 2 and s[-1] == 1 and s[-2] != 1]
    rows = [f for f, s in zip(prod.factors, shapes) if len(s) >= 2 and s[-2] == 1 and s[-1] != 1]
    numbers = [f for f in prod.factors if _is_number(f)]
    if len(columns) != 1 or len(rows) != 1 or len(numbers) != len(prod.factors) - 2:
        return None
    return prod.coef, numbers, columns[0], rows[0]


def _reassociated(build: _Builder, A: fx.Node, outer: tuple, side: int) -> fx.Node:
    """A X (side 1) or X A (side 0), as c · (A x) yᵀ or c · x (yᵀ A) for X = c · x yᵀ (identity 2)."""
    coef, numbers, x, y = outer
    pair = [build.call(aten.matmul.default, A, x), y] if side == 1 else [x, build.call(aten.matmul.default, y, A)]
    return build.product(coef, numbers + pair, [])


def _collected(build: _Builder, update: list[tuple[float, Any]]) -> list[_Product]:
    """The update terms as one sum of products, each sum inside them multiplied out and like products added
    (DeltaNet's paper: ``v_new = β v + (1 − β) v_old``, ``M − v_old kᵀ + v_new kᵀ`` is ``M + β (v − v_old) kᵀ``);
    the terms as written where no two products add up."""
    products: dict[tuple, _Product] = {}
    merged = False
    for sign, term in update:
        expanded = _sum_of_products(build, term)
        if expanded is None:
            expanded = [_factors(term)]
        for prod in expanded:
            key = (tuple(sorted(map(id, prod.factors))), tuple(sorted(map(id, prod.divisors))))
            if key in products:
                products[key].coef += sign * prod.coef
                merged = True
            else:
                prod.coef *= sign
                products[key] = prod
    if not merged:  # nothing to add up: the terms as written (multiplied out, a (1 − α) factor would split them)
        products = {i: _factors(term) for i, (_, term) in enumerate(update)}
        for prod, (sign, _) in zip(products.values(), update):
            prod.coef *= sign
    return [prod for prod in products.values() if prod.coef != 0]


_MAX_TERMS = 16


def _sum_of_products(build: _Builder, x: Any) -> list[_Product] | None:
    """``x`` multiplied out into Σ coef · Π factors / Π divisors (through add, sub, mul, neg, division by a number,
    and an unsqueeze of the last or the second-last dim, an outer product's column or row, which every factor takes
    at the same place from the right, where they broadcast from), or None past :data:`_MAX_TERMS` terms or where a
    number stands alone."""
    if isinstance(x, tuple):  # ("mul" | "div", a, b) from addcmul / addcdiv
        kind, a, b = x
        return _times(_sum_of_products(build, a), _sum_of_products(build, b)) if kind == "mul" else None
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return [_Product(coef=float(x))]
    if not isinstance(x, fx.Node):
        return None
    parts = _terms(x)
    if len(parts) > 1:
        out = []
        for sign, part in parts:
            expanded = _sum_of_products(build, part)
            if expanded is None:
                return None
            for prod in expanded:
                prod.coef *= sign
            out += expanded
        return out if len(out) <= _MAX_TERMS else None
    if x.op == "call_function" and not x.kwargs:
        if x.target is aten.mul.Tensor:
            return _times(_sum_of_products(build, x.args[0]), _sum_of_products(build, x.args[1]))
        if x.target is aten.neg.default:
            return _times([_Product(coef=-1.0)], _sum_of_products(build, x.args[0]))
        if x.target is aten.div.Tensor and isinstance(x.args[1], (int, float)) and x.args[1] != 0:
            return _times([_Product(coef=1.0 / x.args[1])], _sum_of_products(build, x.args[0]))
        rank = len(_shape(x) or ())
        dim = x.args[1] % rank - rank if x.target is aten.unsqueeze.default and rank else 0
        if dim in (-1, -2) and len(_terms(x.args[0])) + len(_factors(x.args[0]).factors) > 2:
            inner = _sum_of_products(build, x.args[0])  # (a number is the same number unsqueezed)
            if inner is None:
                return None
            out = [_Product(prod.coef, [build.unsqueezed(f, dim) for f in prod.factors],
                            [build.unsqueezed(d, dim) for d in prod.divisors]) for prod in inner]
            return None if any(f is None for prod in out for f in prod.factors + prod.divisors) else out
    return [_Product(1.0, [x], [])]


def _times(a: list[_Product] | None, b: list[_Product] | None) -> list[_Product] | None:
    if a is None or b is None or len(a) * len(b) > _MAX_TERMS:
        return None
    return [_Product(p.coef * q.coef, p.factors + q.factors, p.divisors + q.divisors) for p in a for q in b]


def _common_factored(build: _Builder, prods: list[_Product]) -> fx.Node | None:
    """Σ s_i · F · R_i as F · Σ s_i · R_i for the factors F every term has (identity 3), or None if none (one
    term: that product)."""
    if len(prods) == 1:
        (prod,) = prods
        return build.product(prod.coef, prod.factors, prod.divisors) if prod.factors else None
    common = Counter(prods[0].factors)
    for prod in prods[1:]:
        common &= Counter(prod.factors)
    common_divisors = Counter(prods[0].divisors)
    for prod in prods[1:]:
        common_divisors &= Counter(prod.divisors)
    if not common:
        return None
    rests = []
    for prod in prods:
        factors, divisors = list(prod.factors), list(prod.divisors)
        for f in common.elements():
            factors.remove(f)
        for d in common_divisors.elements():
            divisors.remove(d)
        rests.append((prod.coef, build.product(1.0, factors, divisors) if factors or divisors else None))
    if any(rest is None for _, rest in rests):
        return None  # a term that is F alone: nothing left to sum as a tensor of its own
    scale = abs(rests[0][0])  # (a common number too: 0.7 (M k) kᵀ − 0.7 v kᵀ is 0.7 (M k − v) kᵀ)
    inner = build.sum([(coef / scale, rest) for coef, rest in rests])
    return build.product(scale, list(common.elements()) + [inner], list(common_divisors.elements()))


def _factors(node: Any) -> _Product:
    """``node`` as coef · Π factors / Π divisors, not through views (the factors multiply back to its value)."""
    return _product(node, views=False)


def _shape(node: Any) -> tuple | None:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


class _Builder:
    """New ATen nodes before the body's output, each with its fake value (``meta["val"]``)."""

    def __init__(self, graph: fx.Graph, before: fx.Node):
        self.graph, self.before, self.unsqueezes = graph, before, {}
        self.earlier = set()  # the nodes before the new ones, which they may read
        for node in graph.nodes:
            if node is before:
                break
            self.earlier.add(node)

    def call(self, target: Any, *args: Any) -> fx.Node:
        with self.graph.inserting_before(self.before):
            return emit(self.graph, target, *args)

    def unsqueezed(self, x: fx.Node, dim: int = -1) -> fx.Node | None:
        """``x.unsqueeze(dim)`` (dim −1 or −2, counted from the right), one node per x and dim: the graph's own where
        it has one; a 0-d x as it is (it broadcasts); None where x has no dim to insert it before."""
        rank = len(_shape(x) or ())
        if rank == 0:
            return x
        if rank < -dim - 1:
            return None
        if (x, dim) not in self.unsqueezes:
            own = [u for u in x.users if u.target is aten.unsqueeze.default and u.args[0] is x
                   and u.args[1] % (rank + 1) == rank + 1 + dim and u in self.earlier]
            self.unsqueezes[x, dim] = own[0] if own else self.call(aten.unsqueeze.default, x, dim)
        return self.unsqueezes[x, dim]

    def product(self, coef: float, factors: list, divisors: list) -> fx.Node:
        """coef · Π factors / Π divisors (factors not empty)."""
        out = factors[0]
        for f in factors[1:]:
            out = self.call(aten.mul.Tensor, out, f)
        for d in divisors:
            out = self.call(aten.div.Tensor, out, d)
        return out if coef == 1.0 else self.call(aten.mul.Tensor, out, coef)

    def sum(self, terms: list[tuple[float, fx.Node]]) -> fx.Node:
        """Σ s · term (terms not empty)."""
        (s, out), rest = terms[0], terms[1:]
        out = out if s == 1.0 else self.call(aten.mul.Tensor, out, s)
        for s, t in rest:
            out = self.call(aten.add.Tensor if s > 0 else aten.sub.Tensor, out,
                            t if abs(s) == 1.0 else self.call(aten.mul.Tensor, t, abs(s)))
        return out
