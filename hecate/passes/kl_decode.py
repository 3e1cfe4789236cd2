"""Pass ``kl_decode``: logits −KL(q‖π_v)/τ against the token prior bank [→ cross-entropy] → one op.

What the model writes (spec §2.2, §3.3; ``TokenPriorBank.decode``)::

    kl = 0.5 * (log(var_t / var_i) + var_i / var_t + (μ_i − μ_t)² / var_t − 1).sum(-1)   # [B,N,V,K] → [B,N,V]
    logits = −kl / τ
    loss = F.cross_entropy(logits.view(-1, V), targets.view(-1))          # optional

What replaces it:

* logits used only by that cross-entropy → ``hecate.kl_decode_ce`` (per-token loss, then the
  reduction the model asked for): neither [B,N,V,K] nor [B,N,V] is formed;
* logits used by anything else too (returned to the user, or the softmax of the Q-flow's
  observation gradient) → ``hecate.kl_decode_logits``, the matmul form: [B,N,V] is formed
  because it is asked for, [B,N,V,K] is not; a cross-entropy on it stays as it is.

Literals are verified (0.5, 1.0, the unsqueeze dim, the sum dim); τ must be a number > 0.
"""

from __future__ import annotations

import torch
from torch import fx

from hecate.compiler.report import FusionReport
from hecate.passes.gaussian import inline, shape_of, short
from hecate.passes.matching import Match, find_matches, pattern_graph, restore_topological_order

PATTERN = "kl_decode"
aten = torch.ops.aten


def _kl_logits(mu, var, prior_mu, prior_var):
    mu_i, var_i = mu.unsqueeze(2), var.unsqueeze(2)
    kl = 0.5 * (torch.log(prior_var / var_i) + var_i / prior_var + (mu_i - prior_mu).square() / prior_var - 1.0)
    return -kl.sum(dim=-1) / 1.0


_FREE_LITERALS = {(aten.div.Tensor, 1): "tau", (aten.sum.dim_IntList, 1): "sum_dims"}
_PATTERN: list[fx.Graph] = []

# cross_entropy_loss(input, target, weight=None, reduction=Mean, ignore_index=-100, label_smoothing=0.0)
_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}


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


def _pattern() -> fx.Graph:
    if not _PATTERN:
        _PATTERN.append(pattern_graph(_kl_logits, torch.randn(2, 3, 4), torch.rand(2, 3, 4) + 0.5,
                                      torch.randn(5, 4), torch.rand(5, 4) + 0.5))
    return _PATTERN[0]


def run(gm: fx.GraphModule, report: FusionReport) -> None:
    import hecate.lowering.kl_decode  # noqa: F401  the ops must exist before we insert them

    for match in find_matches(gm, _pattern()):
        _fuse(gm, match, report)


def _fuse(gm: fx.GraphModule, match: Match, report: FusionReport) -> None:
    logits = match.outputs[0]
    where = logits.name
    mu, var, prior_mu, prior_var = match.inputs
    q_shape, p_shape = shape_of(mu), shape_of(prior_mu)
    if prior_mu.target == aten.unsqueeze.default and prior_mu.args[0] is mu:
        return  # KL(q_i ‖ q_j) between the beliefs themselves: the attention's, not a decode
    if (q_shape is None or p_shape is None or len(q_shape) != 3 or len(p_shape) != 2
            or shape_of(var) != q_shape or shape_of(prior_var) != p_shape or q_shape[2] != p_shape[1]):
        report.add_miss(PATTERN, f"KL of beliefs {q_shape}/{shape_of(var)} to priors {p_shape}/{shape_of(prior_var)}: "
                                 "the op needs beliefs [B, N, K] and a prior bank [V, K]", where)
        return
    diffs, free = literal_differences(match, _FREE_LITERALS)
    if free.get("sum_dims") not in ([-1], [3]):
        diffs.append(f"KL summed over dims {free.get('sum_dims')}, not over the feature dim (-1)")
    tau = free.get("tau")
    if not isinstance(tau, (int, float)) or not tau > 0:
        diffs.append(f"temperature τ = {tau!r}; the op needs a number > 0")
    if diffs:
        report.add_miss(PATTERN, "; ".join(diffs), where)
        return
    ce = _cross_entropy_user(logits, p_shape[0])
    tau = float(tau)
    if isinstance(ce, str):
        def logits_fn(mu, var, prior_mu, prior_var):
            b, n, k = mu.shape
            flat = torch.ops.hecate.kl_decode_logits(mu.reshape(b * n, k), var.reshape(b * n, k), prior_mu,
                                                     prior_var, tau)
            return flat.reshape(b, n, prior_mu.shape[0])

        new, = inline(gm.graph, logits_fn, [mu, var, prior_mu, prior_var], logits)
        logits.replace_all_uses_with(new)
        report.add_fusion(PATTERN, "hecate.kl_decode_logits", len(match.nodes),
                          f"logits in matmul form, τ={tau:g}; cross-entropy not fused: {ce}")
        return
    ce_node, targets, reduction, ignore_index = ce

    def loss_fn(mu, var, prior_mu, prior_var, targets):
        b, n, k = mu.shape
        loss, _ = torch.ops.hecate.kl_decode_ce(mu.reshape(b * n, k), var.reshape(b * n, k), prior_mu, prior_var,
                                                targets, tau, ignore_index)
        if reduction == "sum":
            return loss.sum()
        if reduction == "mean":  # as F.cross_entropy: the mean over the targets not ignored
            return loss.sum() / (targets != ignore_index).sum().to(loss.dtype)
        return loss

    new, = inline(gm.graph, loss_fn, [mu, var, prior_mu, prior_var, targets], ce_node)
    ce_node.replace_all_uses_with(new)
    view = ce_node.args[0]
    gm.graph.erase_node(ce_node)
    if not view.users and view is not logits:
        gm.graph.erase_node(view)
    restore_topological_order(gm.graph)
    report.add_fusion(PATTERN, "hecate.kl_decode_ce", len(match.nodes) + 2,
                      f"logits + cross-entropy ({reduction}), τ={tau:g}; [B, N, V] not formed")


def _cross_entropy_user(logits: fx.Node, v: int):
    """(the cross_entropy node, flat targets, reduction, ignore_index) when logits feed only that; else why not."""
    users = list(logits.users)
    if len(users) != 1:
        names = ", ".join(f"{u.name} ({short(u.target) if u.op == 'call_function' else u.op})" for u in users)
        return f"logits are also used by {names}"
    view = users[0]
    if view.target not in (aten.view.default, aten.reshape.default) or list(view.args[1]) not in ([-1, v],):
        return f"logits feed {view.name} ({short(view.target)}), not a view(-1, V) into cross-entropy"
    ce_users = list(view.users)
    if len(ce_users) != 1 or ce_users[0].target != aten.cross_entropy_loss.default or ce_users[0].args[0] is not view:
        return f"the flattened logits {view.name} are used by something other than one cross-entropy"
    ce = ce_users[0]
    args = list(ce.args) + [None] * (6 - len(ce.args))
    weight, reduction, ignore_index, smoothing = args[2], args[3], args[4], args[5]
    weight = ce.kwargs.get("weight", weight)
    reduction = ce.kwargs.get("reduction", 1 if reduction is None else reduction)
    ignore_index = ce.kwargs.get("ignore_index", -100 if ignore_index is None else ignore_index)
    smoothing = ce.kwargs.get("label_smoothing", 0.0 if smoothing is None else smoothing)
    if weight is not None or smoothing not in (0, 0.0) or reduction not in _REDUCTIONS:
        return (f"cross-entropy {ce.name} has weight={weight}, label_smoothing={smoothing}, reduction={reduction}; "
                "the fused op supports no class weights and no smoothing")
    targets = args[1]
    if shape_of(targets) != (shape_of(view)[0],):
        return f"cross-entropy targets {targets.name} of shape {shape_of(targets)} are not one id per row"
    return ce, targets, _REDUCTIONS[reduction], int(ignore_index)
