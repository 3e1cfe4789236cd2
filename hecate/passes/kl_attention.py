"""Pass ``kl_attention``: the spec's pairwise-KL softmax and every β-weighted sum read from it → one op.

What the model writes (spec §3.2, §4.1, §4.2; ``hecate/models/fep.py``)::

    kl = 0.5 * (log(var_j / var_i) + var_i / var_j + (μ_i − μ_j)² / var_j − 1).sum(-1)   # [B,N,N,K] → [B,N,N]
    β  = softmax((−kl / κ).masked_fill(~mask, −inf), dim=-1)  [.masked_fill(~mask, 0)]
    ... (β.unsqueeze(-1) * (μ_i − μ_j) / var_j).sum(dim=2) ...       # and a dozen more such sums

What replaces it: ``hecate.kl_attention(μ, var, V, W, κ, causal, mask_diagonal)`` (see its
op.py), whose outputs are the sums Σ_j β_ij V_j, Σ_j β_ij KL_ij V_j, Σ_j β_ij KL_ij,
Σ_j β_ji W_j, Σ_j β_ji KL_ji W_j and Σ_j β_ji (Σ_l β_jl KL_jl) W_j.

How (two steps):

1. The core ``kl → −kl/κ → masked_fill(−inf) → softmax(-1)`` is a pattern written as the
   PyTorch above (:func:`_core_masked`, :func:`_core_full`), its literals verified
   (0.5, 1.0, −inf, the unsqueeze dims, the softmax dim) and the mask read
   structurally: ``tril(ones)`` is causal, ``~eye`` masks the diagonal, their ``&`` both.
2. Everything computed from β and kl until a sum over the key axis j is read as a
   polynomial in the pair space (i, j, k) (:class:`_PairAlgebra`): each term is a
   coefficient times β_ij or β_ji, optionally times KL of the same orientation,
   times per-position factors that depend on i only or on j only (``x.unsqueeze(2)``,
   ``x.unsqueeze(1)``, keepdim sums, transposes swapping the two). That is exactly what
   the spec's gradients are, e.g. ``(μ_i − μ_j)/v_j = μ_i · (1/v_j) − (μ_j/v_j)``. A
   sum over j of such a term is ``(i-factors) · (op output for the j-factors)``; the j-factors
   become the op's row values V (β_ij terms) or column values W (β_ji terms). The
   sums are then rebuilt from the op's outputs and the [B, N, N(, K)] nodes die.

A user that reads β or kl whole (β returned by the model, β.sum(), ...) gets them in the
matmul form, [B, N, N], formed beside the op (never [B, N, N, K]); the report says so.
Otherwise it is all-or-nothing per β: if something computed from β or kl is used in a
way the algebra cannot read (a sum over another axis, a non-separable expression), the
graph is left as is and the reason is reported.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import fx
from torch._guards import detect_fake_mode

from hecate.compiler.report import FusionReport
from hecate.passes.matching import Match, find_matches, pattern_graph, restore_topological_order

PATTERN = "kl_attention"
OP_NAME = "hecate.kl_attention"
aten = torch.ops.aten


# ---------------------------------------------------------------------------------------------
# 1. the core: pairwise KL and its masked softmax, written as the spec writes it


def _kl_pairwise(mu, var):
    mu_i, mu_j = mu.unsqueeze(2), mu.unsqueeze(1)
    var_i, var_j = var.unsqueeze(2), var.unsqueeze(1)
    kl = 0.5 * (torch.log(var_j / var_i) + var_i / var_j + (mu_i - mu_j).square() / var_j - 1.0)
    return kl.sum(dim=-1)


def _core_masked(mu, var, mask):
    kl = _kl_pairwise(mu, var)
    logits = (-kl / 1.0).masked_fill(~mask, float("-inf"))
    return F.softmax(logits, dim=-1), kl


def _core_full(mu, var):
    kl = _kl_pairwise(mu, var)
    return F.softmax(-kl / 1.0, dim=-1), kl


_PATTERNS: dict[str, fx.Graph] = {}


def _patterns() -> dict[str, fx.Graph]:
    if not _PATTERNS:
        mu, var = torch.randn(2, 3, 4), torch.rand(2, 3, 4) + 0.5
        mask = torch.ones(3, 3, dtype=torch.bool).tril()
        _PATTERNS["masked"] = pattern_graph(_core_masked, mu, var, mask)
        _PATTERNS["full"] = pattern_graph(_core_full, mu, var)
    return _PATTERNS


# literals the pattern may see differently in a graph: (target, arg index) -> check
_FREE_LITERALS = {
    (aten.div.Tensor, 1): "kappa",  # −kl / κ
    (aten.softmax.int, 1): "softmax_dim",
    (aten.sum.dim_IntList, 1): "sum_dims",
}  # (op, argument index) -> name


def literal_differences(match: Match, free_literals: dict) -> tuple[list[str], dict[str, object]]:
    """Differences between the pattern's literals and the graph's, except the free ones.

    ``free_literals`` maps (op, argument index) to a name; those literals may differ
    and are returned by name (a division's name applies only to a division of a negation,
    the "−x / t" of a temperature). Returns (differences in words, the free literals found).
    """
    diffs, free = [], {}
    for p, g in match.internal.nodes_map.items():
        if p.op != "call_function":
            continue
        for index, (pa, ga) in enumerate(zip(p.args, g.args)):
            if isinstance(pa, fx.Node):
                continue
            key = free_literals.get((p.target, index))
            if key is not None and (p.target != aten.div.Tensor or p.args[0].target == aten.neg.default):
                free[key] = ga
            elif pa != ga:
                diffs.append(f"{g.name} ({short(g.target)}) has {ga!r} where the spec's form has {pa!r}")
        if len(p.args) != len(g.args) and p.target != aten.sum.dim_IntList:
            diffs.append(f"{g.name} ({short(g.target)}) has arguments {g.args[len(p.args):]!r} the spec's form lacks")
    return diffs, free


def short(target) -> str:
    return getattr(target, "__name__", str(target))


def _shape(node: fx.Node) -> list | None:
    """The shape of ``node``'s value (sizes read from the value, so a symbolic N compares too)."""
    val = node.meta.get("val")
    return list(val.shape) if isinstance(val, torch.Tensor) else None


def _read_mask(mask: fx.Node, n: int) -> tuple[bool, bool] | str:
    """(causal, mask_diagonal) when ``mask`` is tril(ones), ~eye or their &; else why not."""
    def is_tril_ones(node):
        return (isinstance(node, fx.Node) and node.target == aten.tril.default
                and (len(node.args) < 2 or node.args[1] == 0)
                and isinstance(node.args[0], fx.Node) and node.args[0].target == aten.ones.default
                and _shape(node.args[0]) == [n, n])

    def is_not_eye(node):
        return (isinstance(node, fx.Node) and node.target == aten.bitwise_not.default
                and isinstance(node.args[0], fx.Node) and node.args[0].target == aten.eye.default
                and _shape(node.args[0]) == [n, n] and len(node.args[0].args) == 1)

    if is_tril_ones(mask):
        return True, False
    if is_not_eye(mask):
        return False, True
    if mask.target in (aten.__and__.Tensor, aten.bitwise_and.Tensor):
        a, b = mask.args[:2]
        if (is_tril_ones(a) and is_not_eye(b)) or (is_tril_ones(b) and is_not_eye(a)):
            return True, True
    what = short(mask.target) if mask.op == "call_function" else f"{mask.op} {mask.name}"
    return (f"attention mask {mask.name} ({what}) is not the causal lower-triangular mask "
            f"torch.tril(torch.ones({n}, {n})), the diagonal mask ~torch.eye({n}), or their &")


# ---------------------------------------------------------------------------------------------
# 2. the algebra of what is computed from β


class _NotSeparable(Exception):
    """An expression the pair algebra cannot read; the message says which node and why."""


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
    """A per-position tensor entering the pair space; ``node`` normalised to [B or 1, N, K or 1]."""

    source: fx.Node  # the graph node as it appears in the expression
    normalize: str  # "as_is", "squeeze2", "squeeze1", "transpose" (how to get [B, N, K'] from source)
    per_k: bool  # K' = K (True) or 1


_ELEMENTWISE = {aten.mul.Tensor, aten.div.Tensor, aten.add.Tensor, aten.sub.Tensor, aten.neg.default,
                aten.square.default, aten.reciprocal.default, aten.pow.Tensor_Scalar,
                aten.unsqueeze.default, aten.transpose.int}


@dataclass
class _PairAlgebra:
    """Reads nodes computed from β and KL as polynomials (see the module docstring)."""

    beta: fx.Node
    kl: fx.Node
    n: int
    roots: set = field(default_factory=set)  # the sums over j, read as leaves once reduced
    leaves: dict = field(default_factory=dict)  # leaf id -> _Leaf
    visited: set = field(default_factory=set)  # pair-space nodes read
    memo: dict = field(default_factory=dict)
    pair_memo: dict = field(default_factory=dict)
    escapes: list = field(default_factory=list)  # (β or KL, a user that reads it whole): formed for it

    def read(self, node) -> Poly:
        if not isinstance(node, fx.Node):
            if isinstance(node, (int, float)) and not isinstance(node, bool):
                return {(): float(node)} if node != 0 else {}
            raise _NotSeparable(f"literal {node!r} of type {type(node).__name__}")
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
        if node in (self.beta, self.kl):
            return True
        if node in self.roots:
            return False
        if node.target == aten.unsqueeze.default and not self.is_pair(node.args[0]):
            return _rank(node.args[0]) == 3 and node.args[1] % 4 in (1, 2)
        if node.target in _ELEMENTWISE:
            return any(self.is_pair(a) for a in node.args)
        return False

    def _leaf(self, node: fx.Node, role: str, normalize: str, per_k: bool) -> Poly:
        key = (node.name, normalize)
        self.leaves[key] = _Leaf(node, normalize, per_k)
        return {(((("L", key, role)), 1),): 1.0}

    def _read(self, node: fx.Node) -> Poly:
        if node is self.beta:
            self.visited.add(node)
            return {((("P", False), 1),): 1.0}
        if node is self.kl:
            self.visited.add(node)
            return {((("S", False), 1),): 1.0}
        if not self.is_pair(node):
            return self._outside_leaf(node)
        self.visited.add(node)
        t, args = node.target, node.args
        if t == aten.unsqueeze.default:
            x, dim = args
            if self.is_pair(x):
                if _rank(x) == 3 and dim in (-1, 3):
                    return self.read(x)
                raise _NotSeparable(f"{node.name} unsqueezes a pair tensor at dim {dim}, not at the end")
            return self._leaf(x, "i" if dim % 4 == 2 else "j", "as_is", shape_of(x)[-1] != 1)
        if t == aten.transpose.int:
            if sorted(d % _rank(node) for d in args[1:3]) != [1, 2]:
                raise _NotSeparable(f"{node.name} transposes dims {args[1:3]}, not the two position dims")
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
        raise _NotSeparable(f"{node.name} ({short(t)}) is not an elementwise op the fused op can express")

    def _inverse(self, denominator, node) -> Poly:
        if not isinstance(denominator, fx.Node):
            if denominator == 0:
                raise _NotSeparable(f"{node.name} divides by 0")
            return {(): 1.0 / float(denominator)}
        d = self.read(denominator)
        if len(d) != 1:
            raise _NotSeparable(f"{node.name} divides by a sum of terms ({denominator.name})")
        (factors, coef), = d.items()
        if any(f[0] in ("P", "S") for f, _ in factors):
            raise _NotSeparable(f"{node.name} divides by an expression of β or KL ({denominator.name})")
        return {_mono({f: -p for f, p in factors}): 1.0 / coef}

    def _outside_leaf(self, node: fx.Node) -> Poly:
        """A tensor computed outside the pair space, broadcast into it: classify it by its shape."""
        shape = shape_of(node)
        if shape is None:
            raise _NotSeparable(f"{node.name} has no shape information")
        rank = len(shape)
        if rank == 4:
            i_dim, j_dim = shape[1], shape[2]
            if j_dim == 1:
                return self._leaf(node, "i", "squeeze2", shape[3] != 1)
            if i_dim == 1:
                return self._leaf(node, "j", "squeeze1", shape[3] != 1)
        if rank == 3:
            # a [B, N, N] frame: [B, N, 1] is per-query, [B, 1, N] per-key (N = 1: the same)
            if shape[2] == 1:
                return self._leaf(node, "i", "as_is", False)
            if shape[1] == 1:
                return self._leaf(node, "j", "transpose", False)
        raise _NotSeparable(f"{node.name} of shape {list(shape)} is neither per-query nor per-key")


def shape_of(node):
    """The static shape of a node's fake value (None without one)."""
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def _rank(node) -> int:
    s = shape_of(node)
    return len(s) if s is not None else -1


def _sum_over_keys(node: fx.Node) -> bool:
    """``x.sum(dim=2[, keepdim])`` of a [B, N, N, K] tensor or ``x.sum(-1[, keepdim])`` of [B, N, N]."""
    if node.target != aten.sum.dim_IntList or len(node.args) < 2:
        return False
    rank = _rank(node.args[0])
    dims = [d % rank for d in node.args[1]] if rank > 0 else None
    if node.kwargs.get("dtype") is not None:
        return False
    return (rank == 4 and dims == [2]) or (rank == 3 and dims == [2])


# ---------------------------------------------------------------------------------------------
# the pass


def run(gm: fx.GraphModule, report: FusionReport) -> None:
    import hecate.lowering.kl_attention  # noqa: F401  the op must exist before we insert it

    for kind, pattern in _patterns().items():
        for match in find_matches(gm, pattern):
            _fuse(gm, match, kind == "masked", report)


def _fuse(gm: fx.GraphModule, match: Match, masked: bool, report: FusionReport) -> None:
    softmax = match.node(aten.softmax.int)
    kl = match.node(aten.sum.dim_IntList)
    where = softmax.name
    mu, var = match.inputs[0], match.inputs[1]
    shape = shape_of(mu)
    if shape is None or len(shape) != 3 or shape_of(var) != shape:
        report.add_miss(PATTERN, f"pairwise KL of μ {shape} and var {shape_of(var)}: the op needs two [B, N, K] "
                                 "tensors of the same shape", where)
        return
    n = shape[1]
    diffs, free = literal_differences(match, _FREE_LITERALS)
    if free.get("softmax_dim") not in (-1, 2):
        diffs.append(f"softmax over dim {free.get('softmax_dim')}, the attention needs the key dim (-1)")
    if free.get("sum_dims") not in ([-1], [3]):
        diffs.append(f"KL summed over dims {free.get('sum_dims')}, not over the feature dim (-1)")
    kappa = free.get("kappa")
    if not isinstance(kappa, (int, float)) or not kappa > 0:
        diffs.append(f"temperature κ = {kappa!r}; the op needs a number > 0")
    if diffs:
        report.add_miss(PATTERN, "; ".join(diffs), where)
        return

    causal = mask_diagonal = False
    beta = softmax
    if masked:
        mask = match.inputs[2]
        read = _read_mask(mask, n)
        if isinstance(read, str):
            report.add_miss(PATTERN, read, where)
            return
        causal, mask_diagonal = read
        # compute_attention's "β.masked_fill(~mask, 0)" (zeros on rows with no key) is what the op gives
        users = list(softmax.users)
        if (len(users) == 1 and users[0].target == aten.masked_fill.Scalar and users[0].args[2] == 0
                and users[0].args[1].target == aten.bitwise_not.default and users[0].args[1].args[0] is mask):
            beta = users[0]

    algebra = _PairAlgebra(beta=beta, kl=kl, n=n)
    roots = _find_roots(algebra, set(match.nodes))
    if isinstance(roots, str):
        report.add_miss(PATTERN, roots, where)
        return
    algebra.roots = set(roots)
    try:
        plan = _plan(algebra, roots)
    except _NotSeparable as e:
        report.add_miss(PATTERN, f"a sum over the keys reads β in a way the fused op cannot express: {e}", where)
        return
    outside = _outside_users(algebra, roots, match)
    if outside:
        report.add_miss(PATTERN, outside, where)
        return
    replaced = len(match.nodes) + len(algebra.visited | set(roots))
    _rewrite(gm, algebra, roots, plan, mu, var, float(kappa), causal, mask_diagonal)
    mode = ("causal" if causal else "full") + (", diagonal masked" if mask_diagonal else "")
    if algebra.escapes:
        mode += ", [B, N, N] formed for " + ", ".join(sorted({u.name for _, u in algebra.escapes}))
    report.add_fusion(PATTERN, OP_NAME, replaced,
                      f"{mode}, κ={kappa:g}, {len(roots)} β-weighted sums (row values {plan.v_width}, "
                      f"column values {plan.w_width} wide)")


def _find_roots(algebra: _PairAlgebra, core: set) -> list[fx.Node] | str:
    """The sums over j that the values computed from β and KL flow into (graph order)."""
    roots, seen, stack = [], set(core), [algebra.beta, algebra.kl]
    while stack:
        node = stack.pop()
        for user in node.users:
            if user in seen:
                continue
            seen.add(user)
            if node in (algebra.beta, algebra.kl) and not _sum_over_keys(user) and user.target not in _ELEMENTWISE:
                algebra.escapes.append((node, user))  # e.g. β returned: the op forms β [B, N, N] for it
                continue
            if _sum_over_keys(user):
                roots.append(user)
            elif user.target == aten.sum.dim_IntList:
                return (f"{user.name} sums a tensor computed from β over dims {user.args[1]}; the fused op "
                        "gives sums over the key dim only")
            elif user.target in _ELEMENTWISE:
                stack.append(user)
            elif user.op == "output":
                return f"β or KL (through {node.name}) is an output of the graph; the fused op does not form it"
            else:
                return (f"{user.name} ({short(user.target)}) uses {node.name}, computed from β or KL; the fused "
                        "op cannot provide it")
    order = {nd: i for i, nd in enumerate(algebra.beta.graph.nodes)}
    return sorted(roots, key=order.__getitem__)


def _outside_users(algebra: _PairAlgebra, roots, match: Match) -> str | None:
    inside = algebra.visited | set(roots) | set(match.nodes)
    escapes = set(algebra.escapes)
    for node in algebra.visited:
        for user in node.users:
            if user not in inside and (node, user) not in escapes:
                return (f"{user.name} ({short(user.target)}) uses {node.name}, a [B, N, N] tensor the fused op "
                        "does not form")
    return None


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
        poly = algebra.read(root.args[0])
        terms = []
        for factors, coef in poly.items():
            p = [(f, e) for f, e in factors if f[0] == "P"]
            s = [(f, e) for f, e in factors if f[0] == "S"]
            leaves = [(f, e) for f, e in factors if f[0] == "L"]
            if len(p) != 1 or p[0][1] != 1:
                raise _NotSeparable(f"{root.name}: a term without exactly one factor β ({_describe(factors)})")
            flipped = p[0][0][1]
            if s and (len(s) != 1 or s[0][1] != 1 or s[0][0][1] != flipped):
                raise _NotSeparable(f"{root.name}: a term with KL other than once, in β's orientation")
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
                    raise _NotSeparable(f"{root.name}: a per-key factor ({src.name}) is itself a sum over β")
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


class Emitter:
    """Inserts aten calls before a node, each with its fake value (for later passes and export)."""

    def __init__(self, graph: fx.Graph, before: fx.Node):
        self.graph, self.before = graph, before
        self.fake_mode = detect_fake_mode([n.meta.get("val") for n in before.all_input_nodes])

    def __call__(self, target, *args) -> fx.Node:
        with self.graph.inserting_before(self.before):
            node = self.graph.call_function(target, args)
        vals = [a.meta["val"] if isinstance(a, fx.Node) else
                [x.meta["val"] if isinstance(x, fx.Node) else x for x in a] if isinstance(a, (list, tuple)) else a
                for a in args]
        if self.fake_mode is not None:
            with self.fake_mode:
                node.meta["val"] = target(*vals)
        return node


def _rewrite(gm, algebra: _PairAlgebra, roots, plan: _Plan, mu, var, kappa, causal, mask_diagonal):
    graph = gm.graph
    emit = Emitter(graph, roots[-1])
    if emit.fake_mode is None:
        emit.fake_mode = detect_fake_mode([_val(mu)])
    b, n, k = shape_of(mu)
    new_value: dict[fx.Node, fx.Node] = {}

    leaf_cache, product_cache = {}, {}

    def leaf_tensor(key) -> fx.Node:
        if key not in leaf_cache:
            leaf_cache[key] = normalized_leaf(key)
        return leaf_cache[key]

    def normalized_leaf(key) -> fx.Node:
        leaf = algebra.leaves[key]
        src = new_value.get(leaf.source, leaf.source)
        if leaf.normalize == "squeeze2":
            return emit(aten.squeeze.dim, src, 2)
        if leaf.normalize == "squeeze1":
            return emit(aten.squeeze.dim, src, 1)
        if leaf.normalize == "transpose":
            return emit(aten.transpose.int, src, 1, 2)
        return src

    def product(leaves) -> fx.Node | None:
        if leaves not in product_cache:
            product_cache[leaves] = leaf_product(leaves)
        return product_cache[leaves]

    def leaf_product(leaves) -> fx.Node | None:
        out = None
        for key, power in leaves:
            t = leaf_tensor(key)
            if power < 0:
                t, power = emit(aten.reciprocal.default, t), -power
            for _ in range(power):
                out = t if out is None else emit(aten.mul.Tensor, out, t)
        return out

    def features(products) -> tuple[fx.Node, list[tuple[int, int]]]:
        cols, spans, start = [], [], 0
        for leaves in products:
            t = product(leaves)
            width = k if (t is not None and shape_of(t)[-1] != 1) else 1
            t = emit(aten.new_ones.default, mu, [b, n, 1]) if t is None else t
            t = emit(aten.expand.default, t, [b, n, width])
            if _val(t).dtype != _val(mu).dtype:
                t = emit(aten.to.dtype, t, _val(mu).dtype)
            cols.append(t)
            spans.append((start, start + width))
            start += width
        if not cols:
            return emit(aten.new_zeros.default, mu, [b, n, 0]), spans
        return (cols[0] if len(cols) == 1 else emit(aten.cat.default, cols, -1)), spans

    v, v_spans = features(plan.v_features)
    w, w_spans = features(plan.w_features)
    plan.v_width, plan.w_width = (v_spans[-1][1] if v_spans else 0), (w_spans[-1][1] if w_spans else 0)
    call = emit(torch.ops.hecate.kl_attention.default, mu, var, v, w, kappa, causal, mask_diagonal)
    names = ("row_sum", "row_kl_sum", "energy", "col_sum", "col_kl_sum", "col_energy_sum")
    outputs = {name: emit(operator.getitem, call, i) for i, name in enumerate(names)}

    for root in roots:
        total = None
        for term in plan.terms[root]:
            if term.output == "energy":
                t = emit(aten.unsqueeze.default, outputs["energy"], -1)  # [B, N, 1]
            else:
                start, end = (v_spans if term.output.startswith("row") else w_spans)[term.feature]
                t = emit(aten.slice.Tensor, outputs[term.output], -1, start, end)
            i_part = product(term.i_leaves)
            if i_part is not None:
                t = emit(aten.mul.Tensor, t, i_part)
            if term.coef != 1.0:
                t = emit(aten.mul.Tensor, t, term.coef)
            total = t if total is None else emit(aten.add.Tensor, total, t)
        target = list(shape_of(root))
        if total is None:
            total = emit(aten.new_zeros.default, mu, target)
        width = target[-1] if _rank(root.args[0]) == 4 else 1  # a [B,N,N,K'] sum keeps K'; [B,N,N] none
        total = emit(aten.expand.default, total, [b, n, width])
        total = emit(aten.reshape.default, total, target)
        new_value[root] = total
        root.replace_all_uses_with(total)
    if algebra.escapes:
        _form_beta_for_escapes(graph, emit, algebra, mu, var, kappa, causal, mask_diagonal)
    for root in reversed(roots):
        graph.erase_node(root)
    restore_topological_order(graph)


def _form_beta_for_escapes(graph, emit, algebra, mu, var, kappa, causal, mask_diagonal):
    """β and KL [B, N, N] in the matmul form (never [B, N, N, K]) for users that read them whole.

    The matmul form is traced to ATen and inlined, so autograd, Inductor and the exporters
    see ordinary ops.
    """
    from torch.fx.experimental.proxy_tensor import make_fx

    from hecate.lowering.kl_attention.matmul_form import scores_and_beta

    def kl_and_beta(m, v):
        kl, beta, _ = scores_and_beta(m, v, kappa, causal, mask_diagonal)
        return kl, beta

    with emit.fake_mode:
        traced = make_fx(kl_and_beta, pre_dispatch=True)(_val(mu), _val(var))
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    with graph.inserting_before(emit.before):
        kl, beta = graph.graph_copy(traced.graph, dict(zip(placeholders, (mu, var))))
    formed = {algebra.beta: beta, algebra.kl: kl}
    for node, user in algebra.escapes:
        user.replace_input_with(node, formed[node])


def _val(node):
    return node.meta["val"]
