"""The Hebbian / linear-attention family, in every form a user writes it, → ``hecate.linear_attention``.

``spec/linear-attention-feature-maps.md``, HOPE Eq 5 (``spec/feature-maps-phi.md``); k, q are φ(k), φ(q):

* the per-token loop and the scan: ``M ← α_t M + v_t kᵀ_t, y_t = M q_t``, optionally normalised
  by ``z ← α_t z + k_t``, recognised in a scan body by :mod:`hecate.passes.memory_step` (loops arrive
  rolled up by :mod:`hecate.compiler.loops`);
* causal by cumulative sum (no decay): ``M_t = Σ_{s≤t} v_s k_sᵀ (+ m0)``, ``y_t = M_t q_t``,
  normalised by ``q_t · Σ_{s≤t} k_s + eps``; the [B, T, H, Dv, Dk] tensor of all M_t is never built;
* non-causal: ``φ(Q)(φ(K)ᵀV)`` by einsum, normalised by ``φ(Q)·Σ_t φ(k_t) + eps``;
* the parallel form ``(φ(Q)φ(K)ᵀ ⊙ D) V`` with a causal or decaying mask D, recognised by
  evaluation in :mod:`hecate.passes.linear_attention_parallel`.

Tensors are [B, T, H, D] (time on dim 1), as the op takes them. A form that matches but
differs (another time dim, the cumulated states read elsewhere, an einsum over other
indices) is reported as a near-miss and left as it is.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import fx

from hecate.passes.linear_attention_parallel import fuse_cumulated_forms, fuse_noncausal_products, \
    fuse_parallel_forms
from hecate.passes.report import FusionReport
from hecate.passes.memory_step import fuse_scans, report_unrolled_updates
from hecate.passes.matching import Match, NotFused, find_matches, flat_args, literal_slots, pattern_graph, \
    replace_with_function, same_literal

aten = torch.ops.aten
_EPS = 3.5e-7  # a distinctive eps traced into the patterns, read back from each match


# ---------------------------------------------------------------- the forms, as a user writes them

def _cumsum(k, v, q):
    Ms = torch.cumsum(v.unsqueeze(-1) * k.unsqueeze(-2), dim=1)  # [B, T, H, Dv, Dk]
    return (Ms @ q.unsqueeze(-1)).squeeze(-1), Ms


def _cumsum_m0(k, v, q, m0):
    Ms = torch.cumsum(v.unsqueeze(-1) * k.unsqueeze(-2), dim=1) + m0.unsqueeze(1)
    return (Ms @ q.unsqueeze(-1)).squeeze(-1), Ms


def _normalised(form: Callable) -> Callable:
    def normalised(k, v, q, *m0):
        y, Ms = form(k, v, q, *m0)
        return y / ((torch.cumsum(k, dim=1) * q).sum(-1, keepdim=True) + _EPS), Ms
    return normalised


def _noncausal(k, v, q):
    kv = torch.einsum("bthk,bthv->bhvk", k, v)
    return torch.einsum("bthk,bhvk->bthv", q, kv)


def _noncausal_normalised(k, v, q):
    return _noncausal(k, v, q) / (torch.einsum("bthk,bhk->bth", q, k.sum(1)).unsqueeze(-1) + _EPS)


@functools.cache
def _forms() -> list[tuple[str, bool, bool, fx.Graph]]:
    """(form, normalised, with m0, pattern) of each form, traced once from zeros (B=2 T=3 H=2 Dk=5 Dv=4),
    larger ones first so they match first."""
    # distinct tensors: make_fx binds one placeholder per tensor object
    k, v, q, m0 = torch.zeros(2, 3, 2, 5), torch.zeros(2, 3, 2, 4), torch.zeros(2, 3, 2, 5), torch.zeros(2, 2, 4, 5)
    return [("cumsum", True, True, pattern_graph(_normalised(_cumsum_m0), k, v, q, m0)),
            ("cumsum", True, False, pattern_graph(_normalised(_cumsum), k, v, q)),
            ("cumsum", False, True, pattern_graph(_cumsum_m0, k, v, q, m0)),
            ("cumsum", False, False, pattern_graph(_cumsum, k, v, q)),
            ("noncausal", True, False, pattern_graph(_noncausal_normalised, k, v, q)),
            ("noncausal", False, False, pattern_graph(_noncausal, k, v, q))]


# ---------------------------------------------------------------- checking a match

def _eps(match: Match, pattern: fx.Graph) -> float:
    """Check every structural literal of the match; return its eps (1e-6 when the form has none)."""
    eps = 1e-6
    for pn, i, role, expected in literal_slots(pattern, {_EPS: "eps"}):
        gn = match.internal.nodes_map[pn]
        got = flat_args(gn)[i]
        if role == "eps":
            if not isinstance(got, (int, float)) or isinstance(got, bool):
                raise NotFused(f"the normaliser adds {got!r}, expected a number eps")
            eps = float(got)
        elif pn.target is aten.einsum.default:
            continue  # equations are read by meaning, in _einsum_roles
        elif not same_literal(pn, gn, i, expected, got):
            what = "the time dim of the cumulative sum" if pn.target is aten.cumsum.default else f"{gn.name}"
            raise NotFused(f"{what} has {got!r} where the pattern has {expected!r} "
                            "(linear_attention takes [B, T, H, D] tensors, time on dim 1)")
    return eps


def _terms(equation: str) -> tuple[list[str], str]:
    inputs, _, output = equation.replace(" ", "").partition("->")
    return inputs.split(","), output


def _einsum_roles(match: Match) -> tuple[fx.Node, fx.Node]:
    """Read the einsums by meaning (any index letters, either layout of φ(K)ᵀV); return (k, v).

    ``M = einsum(a,b->m, x, y)`` must sum over time with b, h kept and one feature index of each
    operand: M [B, H, ·, ·]; ``y = einsum(c,d->o, q, M)`` must contract q's feature index with
    one of M's and keep the other. The operand whose index q contracts with is k.
    """
    nodes = [match.internal.nodes_map[pn] for pn in match.pattern.nodes if pn.target is aten.einsum.default]
    (eq1, (x, y)), (eq2, _) = nodes[0].args, nodes[1].args
    (a, b), m = _terms(eq1)
    (c, d), o = _terms(eq2)
    reason = (f"einsums {eq1!r} and {eq2!r} ({nodes[0].name}, {nodes[1].name}) are not φ(Q)(φ(K)ᵀV) over "
              "[B, T, H, D] tensors (e.g. 'bthk,bthv->bhvk' then 'bthk,bhvk->bthv')")
    shapes_ok = all(len(t) == 4 for t in (a, b, c, d, m, o)) and len(set(a)) == len(set(b)) == len(set(c)) == 4
    if not (shapes_ok and a[:3] == b[:3] and a[3] != b[3] and m[:2] == a[0] + a[2] and set(m[2:]) == {a[3], b[3]}
            and d[:2] == c[0] + c[2] and c[3] in d[2:] and o == c[:3] + d[2:].replace(c[3], "")):
        raise NotFused(reason)
    if len(nodes) == 3:  # the normaliser q · Σ_t k_t: einsum(q, k.sum(1))
        (e, f), g = _terms(nodes[2].args[0])
        if not (len(e) == 4 and e[:3] == g and f == e[0] + e[2] + e[3]):
            raise NotFused(f"the normaliser einsum {nodes[2].args[0]!r} is not q_t · Σ_s k_s (e.g. 'bthk,bhk->bth')")
    k_is_x = m[2 + d[2:].index(c[3])] == a[3]
    return (x, y) if k_is_x else (y, x)


def _check_inputs(k: fx.Node, v: fx.Node, q: fx.Node, ranks: tuple[int, ...] = (4,)) -> None:
    kv, vv, qv = (n.meta["val"] for n in (k, v, q))
    if kv.dim() not in ranks or vv.dim() != kv.dim() or qv.dim() != kv.dim() or kv.shape != qv.shape \
            or kv.shape[:-1] != vv.shape[:-1]:
        raise NotFused(f"k {list(kv.shape)}, v {list(vv.shape)}, q {list(qv.shape)}: linear_attention needs "
                        "k, q [B, T, H, Dk] and v [B, T, H, Dv]" + (" (or one head, [B, T, D])" if 3 in ranks else ""))
    if not kv.dtype == vv.dtype == qv.dtype:
        raise NotFused(f"k, v, q have dtypes {kv.dtype}, {vv.dtype}, {qv.dtype}; linear_attention needs one")


def _final_state_reads(states: fx.Node, match: Match) -> list[fx.Node]:
    """The reads of the cumulated states M_t outside the match: each must be the last one, M_T."""
    rank, T = states.meta["val"].dim(), states.meta["val"].shape[1]
    inside = set(match.nodes)
    reads = [u for u in states.users if u not in inside]
    for u in reads:
        if not (u.target is aten.select.int and u.args[1] % rank == 1 and u.args[2] % T == T - 1):
            raise NotFused(f"the cumulated states M_t ({states.name}, [B, T, H, Dv, Dk]) are read by {u.name} "
                            f"({str(u.target).removesuffix('.default')}); linear_attention returns only the last")
    return reads


# ---------------------------------------------------------------- the pass

def run(gm: fx.GraphModule, report: FusionReport) -> None:
    """Fuse the loop and scan forms (as memory_scan does), then the cumsum and non-causal forms."""
    fuse_scans(gm, report, "linear_attention")
    report_unrolled_updates(gm, report)
    fuse_parallel_forms(gm, report)
    deferred = []  # the patterns' misses: the form may still be read by meaning below
    for form, normalise, with_m0, pattern in _forms():
        for match in find_matches(gm, pattern):  # a form's matches do not overlap
            try:
                _fuse(gm, match, pattern, form, normalise, with_m0, report)
            except NotFused as why:
                deferred.append((("linear_attention", f"{_describe(form, normalise)}: {why}", match.where()),
                                 match.outputs))
    fuse_cumulated_forms(gm, report)  # the cumsum form in the layouts and reads the patterns do not spell
    fuse_noncausal_products(gm, report)  # the non-causal form by products the patterns do not spell
    for miss, outputs in deferred:
        if not any(node._erased for node in outputs):
            report.add_miss(*miss)


def _fuse(gm: fx.GraphModule, match: Match, pattern: fx.Graph, form: str, normalise: bool, with_m0: bool,
          report: FusionReport) -> None:
    k, v, q, *m0 = match.inputs
    eps = _eps(match, pattern)
    causal, final_reads = form == "cumsum", []
    if causal:
        final_reads = _final_state_reads(match.outputs[1], match)
    else:
        k, v = _einsum_roles(match)
    _check_inputs(k, v, q, (3, 4) if causal else (4,))
    if not hasattr(torch.ops.hecate, "linear_attention"):
        raise NotFused("the op hecate.linear_attention is not registered (import hecate.lowering)")
    nodes = len(match.nodes)
    if k.meta["val"].dim() == 3:  # one head, [B, T, D]: the op's head dim added and taken away
        replace_with_function(gm, match, _single_head(normalise, eps), [k, v, q, *m0])
    else:
        def fused(k, v, q, m0):  # y, and the final state M_T where the cumsum's last step is read
            y, m, _ = torch.ops.hecate.linear_attention(k, v, q, None, m0, None, normalise, eps, causal)
            return (y, m) if causal else y

        replace_with_function(gm, match, fused, [k, v, q, m0[0] if with_m0 else None])
    for read in final_reads:  # select(M_t, 1, -1) now reads M_T, the op's second result, itself
        read.replace_all_uses_with(read.args[0])
        gm.graph.erase_node(read)
    report.add_fusion("linear_attention", "hecate.linear_attention", nodes + len(final_reads),
                      _describe(form, normalise) + (", from m0" if with_m0 else ""))


def _single_head(normalise: bool, eps: float) -> Callable:
    def causal_single_head(k, v, q, *m0):  # [B, T, D] → the op's [B, T, 1, D]; M0 [B, Dv, Dk] → [B, 1, Dv, Dk]
        y, m, _ = torch.ops.hecate.linear_attention(k[:, :, None], v[:, :, None], q[:, :, None], None,
                                                     m0[0][:, None] if m0 else None, None, normalise, eps, True)
        return y[:, :, 0], m[:, 0]
    return causal_single_head


def _describe(form: str, normalise: bool) -> str:
    what = {"cumsum": "causal M_t = Σ_{s≤t} v_s φ(k_s)ᵀ by cumsum, y_t = M_t φ(q_t)",
            "noncausal": "non-causal φ(Q)(φ(K)ᵀV) by einsum"}[form]
    return what + (", normalised" if normalise else "")
