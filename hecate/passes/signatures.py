"""Never silent: the family signatures still in the graph after the passes, reported.

A pass reports the near-misses it recognises; a spelling it does not recognise at all would
leave no trace. This module looks, after the passes, for what each family computes,
whatever the spelling, and reports every occurrence left unfused that its pass did not
already report, with the first reason it can give and the user's source line:

* ``kl_attention``: a softmax over a pairwise ``[..., N, N]`` score made by broadcasting an
  ``[..., N, 1, ...]`` operand against an ``[..., 1, N, ...]`` one, over a feature axis that
  is then reduced (``[B, N, N, K]`` → ``[B, N, N]``), as the pairwise KL is; or made by matrix
  products of per-position tensors with the log of one, as the KL expanded into products is;
* ``memory_scan`` / ``linear_attention``: a loop-carried matrix state updated by an outer
  product, in a rolled ``scan`` body or in a chain of unrolled steps, or cumulated by ``cumsum``;
* ``qk_preprocess``: a depthwise conv1d (groups = channels); a causal conv written by hand that the
  normal form could not read as a conv1d (weights not one per channel, windows combined by more than
  a sum): a tensor zero-padded (P, 0) on its last dim read through its P + 1 shifted windows (slices at
  offsets 0..P, or ``unfold(-1, P + 1, 1)``), or through some of them only;
* ``kl_decode``: a softmax (or cross-entropy, logsumexp) over the vocabulary of logits made by
  broadcasting the beliefs against per-token tensors with a log of the features, or by matrix
  products of the beliefs with per-token tensors and the log of one, as the KL to the priors
  expanded is.

Found by what the graph computes (broadcast shapes, pointwise tags, contraction sizes),
not by op spellings.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Iterable, Iterator

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from hecate.passes.matching import (EMITTED, INPUT_WRITTEN_ADVICE, aliases, descendants, is_pointwise, mutates,
                                    pad_fill, padded_dims, written_tensor, zero_padded_dims)
from hecate.passes.report import FusionReport, source_line
from hecate.passes.shifts import shifted_copy

aten = torch.ops.aten

# family -> the patterns whose misses already explain it
_FAMILIES = {
    "kl_attention": ("kl_attention",),
    "memory_scan": ("memory_scan", "linear_attention", "loops"),
    "linear_attention": ("memory_scan", "linear_attention", "loops"),
    "qk_preprocess": ("qk_preprocess",),
    "kl_decode": ("kl_decode",),
}
_SOFTMAX = (aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default)
_CONV = (aten.conv1d.default, aten.convolution.default)
_PRODUCTS = (aten.matmul.default, aten.bmm.default, aten.mm.default)
_OUTER = (aten.outer.default, aten.ger.default)
_SEARCH = 64  # how many ancestors a search visits: a family's subgraph is a few dozen ops


def report_unfused_signatures(gm: fx.GraphModule, enabled: Iterable[str], report: FusionReport) -> None:
    """Add a miss for each family signature in ``gm`` whose family is enabled and not yet reported."""
    enabled = set(enabled)
    found: list[tuple[str, str, list[fx.Node]]] = []
    if "kl_attention" in enabled:
        found += [("kl_attention", reason, nodes) for reason, nodes in _pairwise_softmaxes(gm.graph)]
    if enabled & {"memory_scan", "linear_attention"}:
        found += [("memory_scan", reason, nodes) for reason, nodes in _rolled_states(gm)]
        # the pipeline's note on each loop it rolled up but no pass fused, in loop order, is about
        # the same loop as each unrolled chain: it gets the chain's source line instead of a twin
        loops = [i for i, m in enumerate(report.misses) if m.pattern == "loops" and not m.source]
        found += [("linear_attention", reason, nodes) for reason, nodes in _cumulated_outer_products(gm.graph)]
        for reason, nodes in _unrolled_states(gm.graph):
            if loops:
                i = loops.pop(0)
                report.misses[i] = dataclasses.replace(report.misses[i], source=source_line(nodes))
            else:
                found.append(("memory_scan", reason, nodes))
    if "qk_preprocess" in enabled:
        found += [("qk_preprocess", reason, nodes) for reason, nodes in _depthwise_convs(gm.graph)]
        found += [("qk_preprocess", reason, nodes) for reason, nodes in _hand_written_convs(gm.graph)]
        found += [("qk_preprocess", reason, nodes) for reason, nodes in _shifted_copies(gm.graph)]
    found += [(family, reason, nodes) for family, reason, nodes in _scores_row_by_row(gm) if family in enabled]
    if "kl_attention" in enabled:
        found += [("kl_attention", reason, nodes) for reason, nodes in _softmaxes_row_by_row(gm.graph)]
    if "kl_decode" in enabled:
        found += [("kl_decode", reason, nodes) for reason, nodes in _decode_scores_by_pairs(gm.graph)]
        found += [("kl_decode", reason, nodes) for reason, nodes in _decode_scores_by_products(gm.graph)]
    for family, reason, nodes in found:
        if all(n.meta.get(EMITTED) for n in nodes):
            continue  # (the windows of a cat a fusion made to join its operands, say: not the user's code)
        if not _already_reported(gm.graph, report, family, nodes):
            report.add_miss(family, reason, nodes=nodes)


def _already_reported(graph: fx.Graph, report: FusionReport, family: str, nodes: list[fx.Node]) -> bool:
    """Whether a miss of ``family`` names one of ``nodes`` or their source line, or (a second softmax or
    loss over the same pairwise score, say) reads the same broadcast pair node ``nodes[-1]``."""
    names = {n.name for n in nodes}
    sources = {source_line([n]) for n in nodes} - {""}
    by_name = {n.name: n for n in graph.nodes}
    for miss in report.misses:
        if miss.pattern not in _FAMILIES[family]:
            continue
        named = set(re.findall(r"[A-Za-z_]\w*", miss.where))
        if miss.source in sources or names & named:
            return True
        if _pair_dims(nodes[-1]) and any(nodes[-1] in _ancestors(by_name[name]) for name in named if name in by_name):
            return True
    return False


# ---- shapes ---------------------------------------------------------------------------------

def _shape(node) -> tuple | None:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def _is(size, n) -> bool:
    return statically_known_true(size == n)


def _tensor_args(node: fx.Node) -> list[fx.Node]:
    return [a for a in node.all_input_nodes if _shape(a) is not None]


def _pair_dims(node: fx.Node) -> tuple[int, int] | None:
    """The output dims (i, j) of a pointwise op broadcasting [.., N, 1, ..] against [.., 1, M, ..]."""
    if not is_pointwise(node):
        return None
    out, args = _shape(node), _tensor_args(node)
    if out is None or len(args) != 2:
        return None
    a, b = ((1,) * (len(out) - len(s)) + s for s in (_shape(args[0]), _shape(args[1])))
    for i in range(len(out)):
        for j in range(i + 1, len(out)):
            for x, y in ((a, b), (b, a)):
                if (_is(x[j], 1) and _is(y[i], 1) and not _is(out[i], 1) and not _is(out[j], 1)
                        and _is(x[i], out[i]) and _is(y[j], out[j])):
                    return i, j
    return None


def _ancestors(node: fx.Node, limit: int = _SEARCH) -> Iterator[fx.Node]:
    """The nodes ``node`` reads, breadth first, up to ``limit`` of them."""
    seen, queue = {node}, [node]
    while queue and len(seen) <= limit:
        for parent in queue.pop(0).all_input_nodes:
            if parent not in seen:
                seen.add(parent)
                queue.append(parent)
                yield parent


def _where_in(score: fx.Node, pairs: fx.Node) -> tuple[dict[int, int], list[int]] | None:
    """Where each dim of the pair tensor ``pairs`` is in ``score``, which reduces it (pair dim → score dim), and
    the pair dims reduced on the way; None where the way from one to the other is not pointwise ops and sums."""
    rank, node, on_the_way = len(_shape(pairs)), pairs, set(_ancestors(score))
    where, reduced = {d: d for d in range(rank)}, []
    while node is not score:
        users = [u for u in node.users if u is score or u in on_the_way]
        if len(users) != 1:
            return None
        user, now = users[0], len(_shape(node) or ())
        if is_pointwise(user):
            grown = len(_shape(user) or ()) - now  # (leading dims a broadcast adds)
            where = {d: at + grown for d, at in where.items()}
        elif user.target is aten.sum.dim_IntList and len(user.args) >= 2 and not (len(user.args) > 2 and user.args[2]) \
                and not user.kwargs:
            gone = sorted(d % now for d in user.args[1])
            reduced += [d for d, at in where.items() if at in gone]
            where = {d: at - sum(g < at for g in gone) for d, at in where.items() if at not in gone}
        else:
            return None
        node = user
    return where, sorted(reduced)


# ---- kl_attention: softmax over a pairwise score ------------------------------------------

def _pairwise_softmaxes(graph: fx.Graph) -> Iterator[tuple[str, list[fx.Node]]]:
    for softmax in (n for t in _SOFTMAX for n in graph.find_nodes(op="call_function", target=t)):
        score = _shape(softmax.args[0])
        if score is None or len(score) < 2:
            continue
        for node in _ancestors(softmax):
            dims = _pair_dims(node)
            out = _shape(node)
            if dims and len(out) > len(score) and not _is(out[dims[0]], out[dims[1]]) \
                    and _is(score[-2], out[dims[0]]) and _is(score[-1], out[dims[1]]) and _per_sequence_keys(node, dims) \
                    and any(a.target in (aten.log.default, aten.exp.default) for a in _ancestors(softmax)):
                yield (f"a softmax over a pairwise [{out[dims[0]]}, {out[dims[1]]}] score between two sets of "
                       f"positions, [.., {out[dims[0]]}, 1, ..] against [.., 1, {out[dims[1]]}, ..] (queries against "
                       "other keys: cross-attention): kl_attention fuses self-attention, the KL between the beliefs "
                       "of one sequence, KL(q_i‖q_j) over [..., N, K] at both ends; compiled as written",
                       [softmax, node])
                break
            if dims and len(out) > len(score) and _is(out[dims[0]], out[dims[1]]) \
                    and sum(_is(size, out[dims[0]]) for size in score) >= 2:  # (a score over the pairs)
                n = out[dims[0]]
                built = (f"a softmax over a pairwise [{n}, {n}] score, built by broadcasting "
                         f"[.., {n}, 1, ..] against [.., 1, {n}, ..] and reducing a feature axis,")
                over = softmax.args[1] % len(score) if len(softmax.args) > 1 and isinstance(softmax.args[1], int) \
                    else None
                placed = _where_in(softmax.args[0], node)
                i, j = (placed[0].get(dims[0]), placed[0].get(dims[1])) if placed else (None, None)
                if over is not None and over == i:
                    yield (f"{built} is normalised over its queries' dim {over} (i), not its keys' dim {j} (j): "
                           "kl_attention is a softmax over the keys for each query; compiled as written",
                           [softmax, node])
                    break
                summed = [d for d in (placed[1] if placed else []) if d != len(out) - 1]
                if placed and (i, j) == (len(score) - 2, len(score) - 1) and summed:
                    yield (f"{built} also sums the pairs over their dim(s) {summed} of {list(out)} beside the "
                           "features (one KL over the heads' features together): kl_attention reads one feature "
                           "dim, [..., N, K]; move those dims into the features, the beliefs [..., N, H·K] "
                           "(x.transpose(1, 2).flatten(-2) of [B, H, N, K]), for the same KL; compiled as written",
                           [softmax, node])
                    break
                if dims != (len(out) - 3, len(out) - 2):  # the pair dims not just before the features
                    yield (f"{built} has its pair dims at {dims} of the {len(out)}-dim pair space {list(out)}, "
                           "other dims (heads, say) after them: kl_attention reads scores [..., N, N] of beliefs "
                           "[..., N, K], the leading dims first (heads before the positions, [B, H, N, K]); "
                           "compiled as written", [softmax, node])
                    break
                yield (f"{built} is not a pairwise KL(q_i‖q_j) between diagonal Gaussians that "
                       "kl_attention reads (μ and σ² as two [..., N, K] tensors broadcast at their position "
                       "dim)", [softmax, node])
                break
        else:
            distance = next((a for a in _ancestors(softmax) if a.target is aten.cdist.default
                             and (_shape(a) or ())[-2:] == tuple(score[-2:])), None)
            if distance is not None and _is(score[-1], score[-2]):
                n = score[-1]
                yield (f"a softmax over a pairwise [{n}, {n}] score made by torch.cdist: kl_attention reads the KL "
                       "written per pair, μ and σ² broadcast as [..., N, 1, K] against [..., 1, N, K] (a squared "
                       "distance is one: ((z[..., :, None, :] - z[..., None, :, :]) ** 2).sum(-1) for "
                       "torch.cdist(z, z) ** 2); compiled as written", [softmax, distance])
                continue
            product = _gaussian_score_by_products(softmax, score)
            if product is not None:
                n = score[-1]
                yield (f"a softmax over a pairwise [{n}, {n}] score made by matrix products of per-position "
                       f"tensors, with the log of one (as a Gaussian KL expanded into products has): kl_attention "
                       "reads the KL written per pair, μ and σ² broadcast as [..., N, 1, K] against "
                       "[..., 1, N, K]; compiled as written", [softmax, product])


def _per_sequence_keys(pairs: fx.Node, dims: tuple[int, int]) -> bool:
    """Whether the keys' side of ``pairs`` (the operand of size 1 at the queries' dim) has a dim of its own before
    the pair dims (a batch: keys of each sequence, not a bank of token priors)."""
    out = _shape(pairs)
    for arg in _tensor_args(pairs):
        shape = (1,) * (len(out) - len(_shape(arg))) + _shape(arg)
        if _is(shape[dims[0]], 1) and not _is(shape[dims[1]], 1):
            return any(not _is(size, 1) for size in shape[:dims[0]])
    return False


def _gaussian_score_by_products(softmax: fx.Node, score: tuple) -> fx.Node | None:
    """A matrix product making the square score, when the score also reads log of an [..., N, K] tensor."""
    if not _is(score[-1], score[-2]):
        return None
    ancestors = list(_ancestors(softmax))
    product = next((a for a in ancestors if a.target in _PRODUCTS + (aten.einsum.default,)
                    and (_shape(a) or ())[-2:] == tuple(score[-2:])), None)
    logs = [a for a in ancestors if a.target in (aten.log.default, aten.log2.default, aten.log10.default)
            and (lambda shape: shape is not None and len(shape) >= 2 and _is(shape[-2], score[-1])
                 and not _is(shape[-1], score[-1]))(_shape(a.args[0]))]
    return product if product is not None and logs else None


# ---- kl_decode: a softmax over the vocabulary of a Gaussian score by products -----------------

_LOGIT_READERS = _SOFTMAX + (aten.cross_entropy_loss.default, aten.logsumexp.default)


def _decode_scores_by_pairs(graph: fx.Graph) -> Iterator[tuple[str, list[fx.Node]]]:
    """A (log-)softmax, cross-entropy or logsumexp over (or a return of) logits built by broadcasting per-position
    beliefs [..., N, 1, K] against per-token tensors [V, K] and reducing K, with a log or exp of the
    features on the way (the variances of a Gaussian KL), that kl_decode left: a layout or a
    consumer it does not take."""
    readers = [n for t in _LOGIT_READERS for n in graph.find_nodes(op="call_function", target=t)]
    returned = [n for out in graph.find_nodes(op="output") for n in out.all_input_nodes
                if n.op == "call_function" and n.target not in _LOGIT_READERS]  # the logits returned
    for reader in readers + returned:
        logits = _shape(reader.args[0] if reader in readers else reader)
        if logits is None or reader in returned and len(logits) < 2:
            continue
        ancestors = list(_ancestors(reader))
        # the KL's sum over the features: the [..., N, V, K] pairs reduced to the logits' rank
        sums = [a for a in ancestors if a.target is aten.sum.dim_IntList and len(_shape(a.args[0]) or ()) > len(logits)]
        for node in ancestors if sums else ():
            dims, out = _pair_dims(node), _shape(node)
            if not dims or len(out) <= len(logits) or _is(out[dims[0]], out[dims[1]]):
                continue
            width, vocab, features = out[-1], logits[-1], out[dims[1] + 1:]
            if len(features) > 1 and any(a.target in (aten.log.default, aten.exp.default) for a in ancestors) \
                    and any(_token_bank(a, vocab, *features) for a in ancestors) and _is(out[dims[1]], vocab):
                yield (f"logits over {vocab} tokens built by broadcasting per-position beliefs against per-token "
                       f"[{vocab}, {', '.join(map(str, features))}] tensors, the pairs summed over "
                       f"{len(features)} dims after the tokens (heads and features): kl_decode reads one feature "
                       f"dim, beliefs [..., N, K] against a bank [V, K]; flatten those dims into one (x.flatten(-"
                       f"{len(features)}) of the beliefs and of the bank) for the same KL; compiled as written",
                       [reader, node])
                break
            if any(a.target in (aten.log.default, aten.exp.default) and _is((_shape(a) or (None,))[-1], width)
                   for a in ancestors) and any(_token_bank(a, vocab, width) for a in ancestors):
                if any(a.target in (aten.add.Tensor, aten.sub.Tensor) and len(_shape(a) or ()) >= 2
                       and any(_token_bank(t, vocab) for t in _tensor_args(a)) for a in [reader, *ancestors]):
                    yield (f"logits over {vocab} tokens that are −KL(q_i‖π_v)/τ plus a per-token tensor [{vocab}] "
                           "(a log-prior, a bias): kl_decode fuses the −KL/τ logits alone, returned or read by a "
                           "softmax or cross-entropy; compiled as written", [reader, node])
                    break
                tokens_first = _is(out[dims[0]], vocab) and not _is(out[dims[1]], vocab)
                layout = (f" (here the tokens come first: the pairs are laid out [{out[dims[0]]}, {out[dims[1]]}], "
                          "tokens by positions)") if tokens_first else ""
                yield (f"logits over {vocab} tokens built by broadcasting per-position beliefs "
                       f"[..., 1, {width}] against per-token [{vocab}, {width}] tensors{layout} were not fused: "
                       "kl_decode fuses logits that are −KL(q_i‖π_v)/τ of diagonal Gaussians (the beliefs and "
                       "the token priors each a mean and a variance, log-variance, standard deviation or "
                       "precision), laid out [..., N, V] and returned or read as they are by a softmax, or by "
                       "cross-entropy over their last dim after a view(-1, V); these are not both; compiled as "
                       "written",
                       [reader, node])
                break


def _token_bank(node: fx.Node, vocab: Any, *features: Any) -> bool:
    """Whether ``node`` is a per-token tensor [V, *features] (leading dims of 1 allowed): a bank of token priors
    [V, K] (or [V, H, K]), or with no features one number per token [V] (a log-prior)."""
    shape, n = _shape(node), len(features) + 1
    return shape is not None and len(shape) >= n and _is(shape[-n], vocab) \
        and all(_is(s, f) for s, f in zip(shape[len(shape) - len(features):], features)) \
        and all(_is(s, 1) for s in shape[:-n])


def _decode_scores_by_products(graph: fx.Graph) -> Iterator[tuple[str, list[fx.Node]]]:
    """Logits over V tokens made by matrix products of per-position [..., N, K] tensors with per-token
    [V, K] ones, reading the log (or exp: log-variances) of a [V, K] or [..., N, K] tensor: the KL to
    token priors expanded into products (the broadcast form is kl_decode's own). The logits are read by
    a (log-)softmax or cross-entropy, or returned; returned ones need two such products (the squared-mean
    and the cross term) or one and a per-token sum over the features, so a linear head beside a variance does
    not count."""
    readers = _LOGIT_READERS
    sinks = [(n, 1) for t in readers for n in graph.find_nodes(op="call_function", target=t)]
    sinks += [(n, 2) for out in graph.find_nodes(op="output") for n in out.all_input_nodes
              if n.op == "call_function" and n.target not in readers]
    for sink, needed in sinks:
        logits = _shape(sink if needed == 2 else sink.args[0])
        if logits is None or len(logits) < 2 or _is(logits[-1], logits[-2]):
            continue  # a square score is kl_attention's
        vocab = logits[-1]
        ancestors = list(_ancestors(sink))
        products = [a for a in ancestors if a.target in _PRODUCTS + (aten.einsum.default,)
                    and _is((_shape(a) or (None,))[-1], vocab)  # (the per-token operand: [V, K] or its transpose)
                    and any(len(_shape(x) or ()) == 2 and any(_is(s, vocab) for s in _shape(x))
                            for x in a.all_input_nodes)]
        # (sizes may be symbolic: compared by _is, never hashed)
        widths = [w for p in products for x in p.all_input_nodes if (w := (_shape(x) or (None,))[-1]) is not None
                  and not _is(w, vocab)]
        # a per-token sum over the features (‖π_v‖² of a prior variance shared by every feature and token, whose KL
        # has one product, the cross term) counts as the second
        token_sums = [a for a in ancestors if a.target is aten.sum.dim_IntList and len(_shape(a.args[0]) or ()) >= 2
                      and _is(_shape(a.args[0])[-2], vocab) and any(_is(_shape(a.args[0])[-1], w) for w in widths)]
        if len(products) + bool(token_sums) < needed:
            continue
        # the variances: a log of them, or an exp of log-variances
        logs = [a for a in ancestors if a.target in (aten.log.default, aten.exp.default)
                and len(_shape(a.args[0]) or ()) >= 2 and any(_is(_shape(a.args[0])[-1], w) for w in widths)]
        if logs:
            yield (f"logits over {vocab} tokens made by matrix products of per-position beliefs with "
                   "per-token tensors, with the log or exp of one (as the KL to token priors expanded into "
                   "products has), are not −KL(q_i‖π_v)/τ of diagonal Gaussians where checked: kl_decode fuses "
                   "the KL expanded into products with all its terms (those per position and per token too), "
                   "or written per (position, token) pair; compiled as written", [sink, products[0]])


# ---- a Gaussian score computed row by row in a loop ----------------------------------------

def _scores_row_by_row(gm: fx.GraphModule) -> Iterator[tuple[str, str, list[fx.Node]]]:
    """A loop that carries nothing (rolled up as a map) whose step broadcasts its row against a whole
    [..., N, K] tensor, with a log or exp of the features, and reduces K: one query's softmax per step (the
    attention row by row: kl_attention), or one token's logits per step stacked and read by a cross-entropy or
    softmax (the decode token by token: kl_decode). The fused ops take the whole score written at once."""
    for scan in gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.scan):
        if scan.args[1]:
            continue  # it carries a state: the memory families'
        body = getattr(gm, scan.args[0].target)
        inputs = [n for n in body.graph.nodes if n.op == "placeholder"]
        rows, whole = inputs[:len(scan.args[2])], inputs[len(scan.args[2]):]
        if not any(len(_shape(w) or ()) >= 2 for w in whole) or not rows \
                or not any(n.target in (aten.log.default, aten.exp.default) for n in body.graph.nodes) \
                or not any(n.target is aten.sum.dim_IntList for n in body.graph.nodes):
            continue
        softmax = next((n for t in _SOFTMAX for n in body.graph.find_nodes(op="call_function", target=t)), None)
        if softmax is not None:
            yield ("kl_attention", "a softmax over one position's scores against all N positions in each step of "
                   "a loop over the positions (the attention row by row), the row broadcast against the whole "
                   "[..., N, K] tensor with a log or exp of the features: kl_attention fuses the pairwise KL "
                   "score written at once, μ and σ² broadcast as [..., N, 1, K] against [..., 1, N, K]",
                   [scan, softmax])
        elif any(r.target in _LOGIT_READERS for n in scan.users for r in descendants(n, 8)):
            yield ("kl_decode", "logits built one token at a time in a loop over the vocabulary (each step's row "
                   "of per-token tensors broadcast against the whole [..., N, K] beliefs with a log or exp of the "
                   "features), then stacked and read by a cross-entropy or softmax: kl_decode fuses the logits "
                   "written at once, the beliefs [..., N, 1, K] against the priors [V, K]",
                   [scan, next(n for n in reversed(body.graph.nodes) if n.op == "call_function")])


def _softmaxes_row_by_row(graph: fx.Graph) -> Iterator[tuple[str, list[fx.Node]]]:
    """Several softmaxes, each over one query's scores against a slice of the positions (``mu[:, :i + 1]``: causal
    by slicing, so the steps differ in shape and no loop rolls them up), each score a sum over the features of a
    broadcast [..., M, K] with a log or exp: the attention row by row, written out step by step."""
    rows = []
    for softmax in (n for t in _SOFTMAX for n in graph.find_nodes(op="call_function", target=t)):
        score = _shape(softmax.args[0])
        if score is None or _pair_dims(softmax.args[0]) is not None:
            continue
        ancestors = list(_ancestors(softmax))
        if not any(a.target in (aten.log.default, aten.exp.default) for a in ancestors) \
                or not any(a.target in (aten.slice.Tensor, aten.select.int) for a in ancestors):  # rows picked
            continue
        if any(a.target is aten.sum.dim_IntList and len(_shape(a.args[0]) or ()) >= 2
               and _is(_shape(a.args[0])[-2], score[-1]) and not _is(score[-1], 1) for a in ancestors):
            rows.append(softmax)
    if len(rows) >= 2:
        yield ("a softmax over one query's scores against the positions (sliced up to the query for a causal "
               "mask) in each step of a loop over the positions (the attention row by row), each "
               "row broadcast against the positions with a log or exp of the features: kl_attention fuses the "
               "pairwise KL score written at once, μ and σ² broadcast as [..., N, 1, K] against [..., 1, N, K], "
               "causal by masked_fill(~tril, float('-inf')); compiled as written", [rows[0]])


# ---- memory: a matrix state updated by an outer product -----------------------------------

def _is_outer_product(node: fx.Node) -> bool:
    """A product over the last two axes that sums over nothing: v ⊗ k however written."""
    if node.op != "call_function":
        return False
    if node.target in _OUTER:
        return True
    if node.target in _PRODUCTS:
        a = _shape(node.args[0])
        return a is not None and len(a) >= 2 and _is(a[-1], 1)
    if node.target is aten.einsum.default:
        inputs, _, output = node.args[0].replace(" ", "").partition("->")
        operands = inputs.split(",")
        return len(operands) >= 2 and set("".join(operands)) <= set(output) and len(output) >= 2
    shape = _shape(node)
    return shape is not None and _pair_dims(node) == (len(shape) - 2, len(shape) - 1)


def _cumulated_outer_products(graph: fx.Graph) -> Iterator[tuple[str, list[fx.Node]]]:
    """A cumulative sum of outer products: the Hebbian state of every step at once."""
    for cumsum in graph.find_nodes(op="call_function", target=aten.cumsum.default):
        product = cumsum.args[0]
        while isinstance(product, fx.Node) and product.target is aten.flip.default:
            product = product.args[0]  # summed from the end: Σ_{s≥t} (anti-causal)
        if isinstance(product, fx.Node) and _is_outer_product(product) and _is_matrix(_shape(product)):
            yield ("a cumulative sum of outer products (the Hebbian state M_t = Σ_{s≤t} v_s k_sᵀ of every step) "
                   "that linear_attention does not read in this form (it reads M_t = cumsum(v.unsqueeze(-1) * "
                   "k.unsqueeze(-2), dim=1) laid out [B, T, H, Dv, Dk], read as (M_t @ q.unsqueeze(-1)).squeeze(-1), "
                   "or the loop); compiled as written", [cumsum])


def _is_matrix(shape: tuple | None) -> bool:
    return shape is not None and len(shape) >= 2 and not _is(shape[-1], 1) and not _is(shape[-2], 1)


def _rolled_states(gm: fx.GraphModule) -> Iterator[tuple[str, list[fx.Node]]]:
    for scan in gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.scan):
        body = getattr(gm, scan.args[0].target)
        carries = [n for n in body.graph.nodes if n.op == "placeholder"][:len(scan.args[1])]
        [output] = body.graph.find_nodes(op="output")
        for carry, update in zip(carries, output.args[0]):
            if not _is_matrix(_shape(carry)) or not isinstance(update, fx.Node):
                continue
            ancestors = list(_ancestors(update))
            outer = next((n for n in [update] + ancestors if _is_outer_product(n)), None)
            if outer is not None and carry in ancestors:
                ops = sorted({str(n.target).removeprefix("aten.").removesuffix(".default")
                              for n in body.graph.nodes if n.op == "call_function"})
                yield (f"a loop carries a {_dims(_shape(carry))} state updated by an outer product each "
                       f"step, but its step is not one memory_scan or linear_attention fuses (the step "
                       f"calls {', '.join(ops)})", [update, outer, scan])


def _unrolled_states(graph: fx.Graph) -> Iterator[tuple[str, list[fx.Node]]]:
    """Chains of matrix updates ``S' = f(S, u ⊗ w)``, each reading the previous one."""
    updates = {}  # pointwise node combining an outer product into a matrix -> that outer product
    inputs = {}  # a state written in place that is (a view of) an input -> that input
    for node in graph.nodes:
        if is_pointwise(node) and _is_matrix(_shape(node)) and len(_tensor_args(node)) == 2 \
                and not _is_outer_product(node):
            outer = next((n for n in _ancestors(node, limit=4)
                          if _is_outer_product(n) and _shape(n) == _shape(node)), None)
            if outer is not None:
                updates[node] = outer
    for node in graph.nodes:  # a part of the state updated in place through a view: M2[:, :2].sub_(η e kᵀ)
        if not (mutates(node) and len(node.args) > 1 and isinstance(node.args[0], fx.Node)
                and isinstance(node.args[1], fx.Node)):
            continue
        outer = next((n for n in [node.args[1], *_ancestors(node.args[1], limit=4)] if _is_outer_product(n)), None)
        state = node.args[0]
        while aliases(state) and isinstance(state.args[0], fx.Node):
            state = state.args[0]
        if outer is not None and state is not node.args[0] and _is_matrix(_shape(state)):
            updates[state] = outer
        base = written_tensor(state)
        if outer is not None and isinstance(base, fx.Node) and base.op == "placeholder":
            inputs[node] = inputs[state] = base  # (the chain holds the write, or the view it writes)
    previous = {}
    for node in updates:
        earlier = _previous_state(node, updates)
        if earlier is not None:
            previous[node] = earlier
    heads = [n for n in updates if n in previous and n not in previous.values()]
    for last in heads:  # one miss per chain, located at its first step
        chain = [last]
        while chain[-1] in previous:
            chain.append(previous[chain[-1]])
        first = chain[-1]
        written = next((inputs[n] for n in chain if n in inputs), None)
        yield (f"a {_dims(_shape(first))} state is updated by an outer product in {len(chain)} chained "
               "steps (an unrolled loop), but the step is not one memory_scan or linear_attention "
               "fuses" + (f"; the steps write into the input {written.name} in place: {INPUT_WRITTEN_ADVICE}"
                          if written is not None else ""), [first] + chain[::-1][1:])


def _previous_state(update: fx.Node, updates: dict[fx.Node, fx.Node]) -> fx.Node | None:
    """The update ``update`` carries its state from: reached through nodes of the state's shape
    (retention such as ``(1 - α) * M`` keeps it), as a loop-carried state is, and not through
    this step's own outer-product term (``- η · g ⊗ k``)."""
    shape, outer = _shape(update), updates[update]
    seen, queue = {update}, [update]
    while queue and len(seen) <= _SEARCH:
        for parent in queue.pop(0).all_input_nodes:
            if parent in seen or _shape(parent) != shape or parent is outer \
                    or outer in set(_ancestors(parent, limit=4)):
                continue
            if parent in updates:
                return parent
            seen.add(parent)
            queue.append(parent)
    return None


def _dims(shape: tuple) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


# ---- qk_preprocess: a depthwise conv1d -----------------------------------------------------

def _depthwise_convs(graph: fx.Graph) -> Iterator[tuple[str, list[fx.Node]]]:
    for target in _CONV:
        for conv in graph.find_nodes(op="call_function", target=target):
            x, w = _shape(conv.args[0]), _shape(conv.args[1])
            if x is None or w is None or len(w) != 3:
                continue
            args = dict(zip([a.name for a in target._schema.arguments], conv.args)) | conv.kwargs
            if args.get("transposed", False):
                continue
            channels, kernel = w[0], w[2]
            if not (_is(args.get("groups", 1), channels) and _is(w[1], 1) and not _is(channels, 1)):
                continue
            stride, dilation = (_first(args.get(k, 1)) for k in ("stride", "dilation"))
            if stride != 1:
                why = f"it has stride {stride}; qk_preprocess fuses stride 1"
            elif dilation != 1:
                why = f"it has dilation {dilation}; qk_preprocess fuses dilation 1"
            else:
                why = ("qk_preprocess fuses a causal one: conv1d(padding=K-1) then [..., :T], or "
                       "F.pad(x, (K-1, 0)) then conv1d, on [B, T, D] inputs transposed to [B, D, T]")
            yield f"depthwise conv1d ({channels} channels, kernel {kernel}) not fused: {why}", [conv]


def _hand_written_convs(graph: fx.Graph) -> Iterator[tuple[str, list[fx.Node]]]:
    """A conv written by hand (Σ_k w[:, k] · F.pad(x, (K-1, 0))[..., k:k+T], or over ``unfold``): a tensor
    zero-padded on one dim, its time, read through shifted windows of the unpadded length (slices of it at
    two offsets or more, or ``unfold(time, P + 1, 1)``)."""
    for pad, shape, padded, fill in _padded_tensors(graph):
        ((time, (before, after)),) = padded.items()
        p = before + after
        starts, unfolded = set(), False
        for user in pad.users:
            if user.target is aten.slice.Tensor and user.args[1] % len(shape) == time \
                    and (user.args[4] if len(user.args) > 4 else 1) == 1 and _is(_shape(user)[time], shape[time] - p):
                starts.add(user.args[2] if len(user.args) > 2 else 0)
            unfolded |= user.target is aten.unfold.default and user.args[1] % len(shape) == time \
                and tuple(user.args[2:4]) == (p + 1, 1)
        if not unfolded and len(starts) < 2:
            continue
        index = "..., " if time == len(shape) - 1 else ":, " * time
        how = f"unfold({time}, {p + 1}, 1)" if unfolded else f"slices [{index}k:k+T] for k in {sorted(starts)}"
        padding = f"zero-padded ({before}, {after}) on " + ("its last dim" if time == len(shape) - 1 else f"dim {time}")
        if fill is not None:
            yield (f"a conv written by hand over a tensor padded ({before}, {after}) with {fill}, read through "
                   f"its shifted windows ({how}), not fused: "
                   + ("qk_preprocess takes a carried state as F.conv1d(torch.cat([state, x], -1), w, groups=D), not "
                      "as a conv written by hand over it" if "state" in fill else
                      "only zeros of the tensor's dtype that nothing writes into read as a causal conv's padding"
                      if "zeros" in fill else "a causal conv pads with zeros, so its first outputs would differ")
                   + " (qk_preprocess fuses Σ_k w_k · F.pad(h, (K-1, 0))[..., k:k+T]); compiled as written",
                   [pad])
        elif after:
            yield (f"a conv written by hand over a tensor {padding}, read through its shifted windows ({how}), "
                   f"not fused: padded after, its output at t reads positions up to t + {after}, so it is not "
                   f"causal (qk_preprocess fuses a causal conv: padded K-1 before and 0 after); compiled as written",
                   [pad])
        elif unfolded or starts == set(range(p + 1)):
            yield (f"a causal conv of kernel {p + 1} written by hand (a tensor {padding}, read through its "
                   f"{p + 1} shifted windows by {how}) not fused: it reads as a conv when the windows are weighted "
                   "one value per channel (w_k [D, 1], or [D] channels last; [D, 1, K] over unfold) and summed, "
                   "else write F.conv1d(F.pad(x, (K-1, 0)), w, groups=D); compiled as written", [pad])
        elif starts < set(range(p + 1)):
            yield (f"a conv written by hand over a tensor {padding} reads {len(starts)} of its {p + 1} shifted "
                   f"windows (offsets {sorted(starts)}), not all of them as a causal conv of kernel {p + 1} does "
                   "(pad by one less than the windows it reads); compiled as written", [pad])


# ops that make a tensor of one value: joined to a tensor by torch.cat, they pad it with that value
_FILLED = {aten.ones.default: "ones", aten.new_ones.default: "ones", aten.ones_like.default: "ones",
           aten.full.default: "full", aten.new_full.default: "full", aten.full_like.default: "full",
           aten.zeros.default: "zeros", aten.new_zeros.default: "zeros", aten.zeros_like.default: "zeros"}


def _padded_tensors(graph: fx.Graph) -> Iterator[tuple[fx.Node, tuple, dict[int, tuple[int, int]], str | None]]:
    """(node, its shape, {dim: (before, after)}, fill) for each tensor padded on one dim by fixed amounts: by
    ``F.pad`` (fill None when with zeros, else its value or mode) or by ``torch.cat`` with a tensor of one value
    (the zero ones the normal form made an F.pad; those left are another dtype, or written into)."""
    for node in graph.nodes:
        shape = _shape(node)
        if shape is None or node.op != "call_function":
            continue
        if (padded := padded_dims(node)) is not None:
            mode, value = pad_fill(node)
            fill = None if zero_padded_dims(node) is not None else \
                f"F.pad value={value}" if mode == "constant" else f"F.pad mode={mode!r}"
        elif node.target is aten.cat.default and len(node.args[0]) >= 2:
            parts, dim = node.args[0], (node.args[1] if len(node.args) > 1 else 0) % len(shape)
            made = [_FILLED.get(getattr(p, "target", None)) for p in parts]
            unfilled = [i for i, m in enumerate(made) if m is None]
            if len(unfilled) == 1:
                main = unfilled[0]
                fill = "torch.cat with " + ", ".join(f"torch.{m}" for m in made if m)
                if "zeros" in made:  # what the normal form leaves: the zeros are another dtype or written into
                    fill += " (zeros of another dtype than the tensor, or written into)"
            elif len(parts) == 2 and not any(made):
                main, fill = 1, "torch.cat with a tensor joined in front (a carried state)"
            else:
                continue
            sizes = [(_shape(p) or (None,) * len(shape))[dim] for i, p in enumerate(parts) if i != main]
            if not all(isinstance(n, int) for n in sizes):
                continue
            padded = {dim: (sum(sizes[:main]), sum(sizes[main:]))}
        else:
            continue
        if len(padded) == 1:
            yield node, shape, padded, fill


def _shifted_copies(graph: fx.Graph) -> Iterator[tuple[str, list[fx.Node]]]:
    """A conv written by hand as shift-and-add that the normal form did not make a conv: copies of one tensor shifted
    along one dim by two amounts or more, each by its own zero pad cut back to the length
    (``F.pad(h, (0, 0, i, 0))[:, :T]``) or by ``torch.roll``, or any copies :func:`shifted_copy` reads as shifted
    with zeros in front (and the tensor itself) multiplied by weights."""
    shifts: dict[tuple, dict[int, fx.Node]] = {}
    for node in graph.nodes:
        if node.target is aten.pad.default:
            padded = zero_padded_dims(node)
            if padded is None or len(padded) != 1:
                continue
            ((dim, (before, after)),) = padded.items()
            if before > 0 and after == 0 and any(
                    u.target is aten.slice.Tensor and u.args[1] % len(_shape(node)) == dim
                    and (u.args[2] if len(u.args) > 2 else 0) == 0 for u in node.users):
                shifts.setdefault(("F.pad", node.args[0], dim), {})[before] = node
        elif node.target is aten.roll.default and len(node.args) > 2 and len(node.args[1]) == len(node.args[2]) == 1:
            shape = _shape(node)
            if shape is not None and node.args[1][0] > 0:
                shifts.setdefault(("torch.roll", node.args[0], node.args[2][0] % len(shape)), {})[node.args[1][0]] \
                    = node
    written = {source for _, source, _ in shifts}
    for mul in graph.find_nodes(op="call_function", target=aten.mul.Tensor):
        for copy in mul.args:
            found = shifted_copy(copy) if isinstance(copy, fx.Node) else None
            if found is not None and found[0] not in written:
                h, swapped, time, s = found
                # (u itself, shifted by 0, on whichever dim the others are)
                shifts.setdefault(("copies shifted", h, swapped), {})[(time, s)] = copy
    for (how, source, dim), by in list(shifts.items()):
        if how == "copies shifted":  # (h, u = hᵀ): one dim of time
            del shifts[(how, source, dim)]
            times = {t for t, s in by if s}
            if len(times) == 1:
                (time,) = times
                shifts[(how, source, time)] = {s: node for (t, s), node in by.items() if t in (time, None)}
    for (how, source, dim), by in shifts.items():
        if len(by) >= 2:
            rolled = " (torch.roll then a product with a 0/1 mask is NaN where an inf or NaN wraps around to " \
                "the front, 0·inf, where a conv's padding gives 0: torch.where(t >= s, torch.roll(h, s, dim), 0) " \
                "is exact)" if how == "torch.roll" else \
                ": these are such copies, but each must be weighted by one value per channel and the products added " \
                "in one sum (a copy scaled before its weight, or weighted twice, is not)" \
                if how == "copies shifted" else ""
            yield (f"a conv written by hand as shifted copies of one tensor {list(_shape(source) or ())} ({how} by "
                   f"{sorted(by)} on dim {dim}, "
                   "each its own shift) not fused: qk_preprocess reads a causal conv as copies shifted with zeros in "
                   "front (F.pad and slices, torch.cat of zeros, torch.where of a roll), or F.conv1d" + rolled +
                   "; compiled as written", list(by.values()))


def _first(value):
    """A conv's 1-d stride or dilation, written as an int or a one-element list."""
    return value[0] if isinstance(value, (list, tuple)) else value
