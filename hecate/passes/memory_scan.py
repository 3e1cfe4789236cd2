"""Roll an unrolled per-token memory loop (or a ``scan``) up into ONE ``hecate.memory_scan``.

Dynamo unrolls ``for t in range(T): state, y_t = step(state, k[:, t], ...)`` into T
copies of the step. This pass

1. finds every copy of the step, written below as the PyTorch a user writes
   (``spec/lp-attentional-bias.md``: l_2 / l_1 / general l_p bias; plain GD,
   GD with momentum, MONETA L_q retention), traced with :func:`pattern_graph`;
2. chains the copies through the memory state and proves they are one recurrence
   (:func:`_verify_chain`): same ops (the pattern), same literals at every step
   (p, a, eps, β, q, dims), step t's state input is step t−1's state output and
   nothing else reads an intermediate state, the per-step inputs are
   ``select(src, time_dim, t)`` of the same tensors at consecutive t, the extra
   states (momentum buffer) start at zero and are unused after the loop;
3. replaces the whole chain by one ``memory_scan(k, v, q, alpha, eta, m0, None, p, a,
   eps, momentum, q_norm)`` on the sliced source tensors, whose ``y`` stands for the
   stacked per-step reads and whose ``m_final`` stands for the last state.

It does the same for ``torch.ops.higher_order.scan`` whose body is the step (in the
backend, a Python loop arrives here as such a scan: :mod:`hecate.compiler.loops` rolls
Dynamo's copies back up before re-tracing; the unrolled path serves ``torch.export``'s
graph and loops that could not be rolled), and,
as the "linear_attention" pass, for the Hebbian / fast-weight step
``M ← α_t M + v_t φ(k_t)ᵀ, y_t = M φ(q_t)`` (optionally normalised by
``z ← α_t z + φ(k_t)``, ``y_t / (z·φ(q_t) + eps)``), replaced by one ``linear_attention``.
Chains that fail a check are left as they are (still correct) and reported as
near-misses with the reason.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch.fx.passes.utils.matcher_utils import InternalMatch, SubgraphMatcher

from hecate.compiler.report import FusionReport
from hecate.passes.matching import Match, flat_args, literal_slots, pattern_graph, same_literal

aten = torch.ops.aten

# Distinctive literal values traced into the patterns, so the pass can tell where
# each hyper-parameter sits in a matched step (every other literal is structural
# and must equal the pattern's).
_P, _A, _EPS, _BETA, _Q = 2.75, 11.5, 3.5e-7, 0.625, 3.25
_SENTINELS = {_P: "p", _A: "a", _EPS: "eps", _BETA: "momentum", _Q: "q_norm",
              (_P - 1) / 2: "p_power", (_Q - 2) / _Q: "q_power"}


# ---------------------------------------------------------------- the step, as a user writes it

def _bias_l2(e):
    return 2 * e


def _bias_l1(e):
    return torch.tanh(_A * e)


def _bias_lp(e):
    return _P * torch.tanh(_A * e) * (e * e + _EPS) ** ((_P - 1) / 2)


def _lq_normalise(A):
    return A / (A.abs().pow(_Q).sum((-2, -1), keepdim=True) + _EPS) ** ((_Q - 2) / _Q)


def _identity(M):
    return M


def _plain_step(bias: Callable, normalise: Callable) -> Callable:
    def step(M, k_t, v_t, q_t, alpha_t, eta_t):
        alpha_t, eta_t = alpha_t[..., None, None], eta_t[..., None, None]
        e = (normalise(M) @ k_t.unsqueeze(-1)).squeeze(-1) - v_t
        grad = bias(e).unsqueeze(-1) * k_t.unsqueeze(-2)
        M = (1 - alpha_t) * M - eta_t * grad
        return M, (normalise(M) @ q_t.unsqueeze(-1)).squeeze(-1)
    return step


def _momentum_step(bias: Callable) -> Callable:
    def step(M, S, k_t, v_t, q_t, alpha_t, eta_t):
        alpha_t, eta_t = alpha_t[..., None, None], eta_t[..., None, None]
        e = (M @ k_t.unsqueeze(-1)).squeeze(-1) - v_t
        grad = bias(e).unsqueeze(-1) * k_t.unsqueeze(-2)
        S = _BETA * S - eta_t * grad
        M = (1 - alpha_t) * M + S
        return M, S, (M @ q_t.unsqueeze(-1)).squeeze(-1)
    return step


def _hebbian_step(M, k_t, v_t, q_t, alpha_t):
    M = alpha_t[..., None, None] * M + v_t.unsqueeze(-1) * k_t.unsqueeze(-2)
    return M, (M @ q_t.unsqueeze(-1)).squeeze(-1)


def _hebbian_normalised_step(M, z, k_t, v_t, q_t, alpha_t):
    M = alpha_t[..., None, None] * M + v_t.unsqueeze(-1) * k_t.unsqueeze(-2)
    y = (M @ q_t.unsqueeze(-1)).squeeze(-1)
    z = alpha_t.unsqueeze(-1) * z + k_t
    return M, z, y / ((z * q_t).sum(-1, keepdim=True) + _EPS)


@dataclass
class _Variant:
    """One form of the step: its pattern and where its hyper-parameters sit."""

    bias: str  # "l2", "l1", "lp"; "hebbian" for the linear-attention family
    retention: str  # "plain", "momentum", "moneta"; "hebbian", "hebbian-normalised"
    pattern: fx.Graph
    states: tuple[str, ...]  # the chained states: ("M",), ("M", "S") with momentum, ("M", "z") normalised
    roles: tuple[str, ...]  # the per-step inputs after the states

    @property
    def n_state(self) -> int:
        return len(self.states)

    @property
    def op(self) -> str:
        return "linear_attention" if self.bias == "hebbian" else "memory_scan"
    # (pattern node, arg position) -> role ("p", "a", ...) or None for a structural literal
    literal_slots: list[tuple[fx.Node, int, str | None, Any]] = field(default_factory=list)

    @property
    def name(self) -> str:
        if self.bias == "hebbian":
            return "Hebbian" + (" normalised" if self.retention == "hebbian-normalised" else "")
        return {"plain": "GD", "momentum": "GD with momentum", "moneta": "MONETA L_q retention"}[
            self.retention] + f", {self.bias} bias"


_VARIANTS: list[_Variant] | None = None
_LP_ROLES = ("k", "v", "q", "alpha", "eta")
_HEBBIAN_ROLES = ("k", "v", "q", "alpha")


def _variants(op: str | None = None) -> list[_Variant]:
    """The step patterns (traced once, B=2, H=3, Dv=4, Dk=5), all or those replaced by ``op``."""
    global _VARIANTS
    if _VARIANTS is None:
        # distinct tensors per argument: make_fx binds one placeholder per tensor object
        M, S, k, v, q, alpha, eta = (torch.randn(2, 3, 4, 5), torch.randn(2, 3, 4, 5), torch.randn(2, 3, 5),
                                     torch.randn(2, 3, 4), torch.randn(2, 3, 5), torch.rand(2, 3), torch.rand(2, 3))
        z = torch.randn(2, 3, 5)
        variants = []
        for bias_name, bias in (("l2", _bias_l2), ("l1", _bias_l1), ("lp", _bias_lp)):
            for retention in ("plain", "momentum", "moneta"):
                if retention == "momentum":
                    fn, example, states = _momentum_step(bias), (M, S, k, v, q, alpha, eta), ("M", "S")
                else:
                    fn = _plain_step(bias, _lq_normalise if retention == "moneta" else _identity)
                    example, states = (M, k, v, q, alpha, eta), ("M",)
                variants.append(_Variant(bias_name, retention, pattern_graph(fn, *example), states, _LP_ROLES))
        variants.append(_Variant("hebbian", "hebbian-normalised",
                                 pattern_graph(_hebbian_normalised_step, M, z, k, v, q, alpha),
                                 ("M", "z"), _HEBBIAN_ROLES))
        variants.append(_Variant("hebbian", "hebbian", pattern_graph(_hebbian_step, M, k, v, q, alpha),
                                 ("M",), _HEBBIAN_ROLES))
        for variant in variants:
            variant.literal_slots = literal_slots(variant.pattern, _SENTINELS)
        _VARIANTS = variants
    return [v for v in _VARIANTS if op is None or v.op == op]


# ---------------------------------------------------------------- finding the steps

@dataclass
class _Step:
    """One matched copy of the step."""

    variant: _Variant
    match: Match
    nodes: set[fx.Node]
    state_in: list[fx.Node]
    state_out: list[fx.Node]
    y: fx.Node
    per_step: dict[str, fx.Node]  # variant.roles ("k", "v", "q", "alpha"[, "eta"]) -> graph node
    literals: list[Any]  # the graph's literal at each of variant.literal_slots



def _find_steps(graph: fx.Graph, variant: _Variant) -> list[_Step]:
    """Every copy of ``variant``'s step in ``graph``, in linear time.

    This is :func:`hecate.passes.matching.find_matches` (torch's SubgraphMatcher, literals as
    wildcards, matched subgraphs self-contained) without its per-match cycle check, which
    walks everything downstream of the match and so costs O(T²) on an unrolled loop.
    The check is not needed here: a fused chain's inputs are the sources of the
    per-step slices and the initial state, which precede every step (see
    :func:`_verify_chain`), so replacing the chain cannot create a cycle.
    """
    matcher = SubgraphMatcher(variant.pattern, match_output=False, match_placeholder=False,
                              remove_overlapping_matches=True, ignore_literals=True)
    (anchor,) = matcher.pattern_anchors  # the read y_t: the state outputs feed it
    steps, claimed = [], set()
    for gn in graph.nodes:
        if gn.op != "call_function" or gn.target != anchor.target:
            continue
        internal = InternalMatch(anchors=[anchor])
        if not matcher._match_nodes(anchor, gn, internal):
            continue
        internal.placeholder_nodes = [internal.nodes_map[pn] for pn in matcher.pattern_placeholder_nodes]
        internal.returning_nodes = [internal.nodes_map[pn] for pn in matcher.pattern_returning_nodes]
        if not matcher._is_contained(internal.nodes_map):
            continue
        match = Match(variant.pattern, internal)
        nodes = set(match.nodes)
        if nodes & claimed:
            continue
        claimed |= nodes
        inputs, outputs = match.inputs, match.outputs
        n = variant.n_state
        literals = [flat_args(internal.nodes_map[pn])[i] for pn, i, _, _ in variant.literal_slots]
        steps.append(_Step(variant, match, nodes, inputs[:n], outputs[:n], outputs[n],
                           dict(zip(variant.roles, inputs[n:])), literals))
    return steps


# ---------------------------------------------------------------- proving a chain is one recurrence

class _NotFused(Exception):
    """A chain that is not one fusable recurrence; the message is the near-miss reason."""


def _read_params(step: _Step) -> dict[str, float]:
    """p, a, eps, momentum, q_norm of a step; checks every structural literal."""
    variant, params = step.variant, {}
    for (pn, i, role, pattern_value), value in zip(variant.literal_slots, step.literals):
        if role is None:
            if not same_literal(pn, step.match.internal.nodes_map[pn], i, pattern_value, value):
                raise _NotFused(f"{_op_name(pn)} has literal {value!r} where the {variant.name} step "
                                f"has {pattern_value!r}")
            continue
        if not isinstance(value, (int, float)):
            raise _NotFused(f"{role} is {value!r}, expected a number")
        if role in params and params[role] != value:
            raise _NotFused(f"{role} differs inside one step ({params[role]} and {value}); "
                            f"hecate.{variant.op} takes one value")
        params[role] = float(value)
    if variant.bias == "hebbian":
        return {"eps": params.get("eps", 1e-6)}
    p = {"l2": 2.0, "l1": 1.0, "lp": params.get("p")}[variant.bias]
    q = params.get("q_norm", 2.0)
    if "p_power" in params and not math.isclose(params["p_power"], (p - 1) / 2, rel_tol=1e-9):
        raise _NotFused(f"the |e| approximator's exponent is {params['p_power']}, not (p−1)/2 = {(p - 1) / 2} "
                        f"for p = {p}")
    if "q_power" in params and not math.isclose(params["q_power"], (q - 2) / q, rel_tol=1e-9):
        raise _NotFused(f"the L_q norm's exponent is {params['q_power']}, not (q−2)/q = {(q - 2) / q} for q = {q}")
    if variant.bias == "lp" and p in (1.0, 2.0):
        raise _NotFused(f"the general l_p form is written with p = {p:g}; memory_scan computes the exact "
                        f"fast path at p = {p:g} ({'2e' if p == 2 else 'tanh(a·e)'}), which differs from "
                        "p·tanh(a·e)·(e²+eps)^((p−1)/2)")
    if p < 1:
        raise _NotFused(f"p = {p:g}: the l_p bias needs p >= 1")
    if variant.retention == "moneta" and q == 2.0:
        raise _NotFused("the L_q normalisation is written with q = 2, which memory_scan treats as no normalisation")
    return {"p": p, "a": params.get("a", 10.0), "eps": params.get("eps", 1e-6),
            "momentum": params.get("momentum", 0.0), "q_norm": q}


def _op_name(node: fx.Node) -> str:
    return str(node.target).removesuffix(".default")


@dataclass
class _Source:
    """A [B, T, ...] tensor the fused op reads whole, built from what the steps slice."""

    node: fx.Node
    time_dim: int  # the dim the steps select along (-1 when constant)
    start: int
    constant: bool = False


def _per_step_source(role: str, nodes: list[fx.Node]) -> _Source:
    """The tensor ``nodes[t] = select(src, dim, start + t)`` read from, or one node used at every step."""
    first = nodes[0]
    if role in ("alpha", "eta") and all(n is first for n in nodes):
        return _Source(first, time_dim=-1, start=0, constant=True)
    srcs = []
    for t, n in enumerate(nodes):
        if n.op != "call_function" or n.target != aten.select.int:
            raise _NotFused(f"{role} at step {t} is {n.name} ({_op_name(n) if n.op == 'call_function' else n.op}), "
                            f"not a slice select(x, time_dim, t) of one tensor")
        src, dim, index = n.args
        rank = src.meta["val"].dim()
        size = src.meta["val"].shape[dim % rank]
        srcs.append((src, dim % rank, index % size))
    src, dim, start = srcs[0]
    for t, (s, d, index) in enumerate(srcs):
        if s is not src or d != dim:
            raise _NotFused(f"{role} at step {t} slices {s.name} along dim {d}, "
                            f"step 0 slices {src.name} along dim {dim}")
        if index != start + t:
            raise _NotFused(f"{role} at step {t} reads time index {index}, expected {start + t} (steps must "
                            "visit consecutive tokens in order)")
    return _Source(src, dim, start)


def _is_zeros(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if node.target in (aten.zeros_like.default, aten.new_zeros.default, aten.zeros.default):
        return True
    if node.target in (aten.full.default, aten.new_full.default, aten.full_like.default):
        fill = node.args[1] if node.target == aten.full_like.default else node.args[-1]
        return fill == 0
    return False


def _verify_chain(chain: list[_Step]) -> tuple[dict[str, float], dict[str, _Source]]:
    """Prove ``chain`` is one recurrence memory_scan computes; raise :class:`_NotFused` if not."""
    params = _read_params(chain[0])
    for t, step in enumerate(chain[1:], 1):
        for (pn, i, role, _), got, first in zip(step.variant.literal_slots, step.literals, chain[0].literals):
            if got != first:
                what = role if role else f"literal #{i} of {_op_name(pn)}"
                raise _NotFused(f"{what} changes between steps: {first!r} at step 0, {got!r} at step {t}")
    for t, (prev, step) in enumerate(zip(chain, chain[1:]), 1):
        for s, (out, inp) in enumerate(zip(prev.state_out, step.state_in)):
            if out is not inp:
                raise _NotFused(f"state {s} of step {t} is {inp.name}, not the state step {t - 1} produced")
            outside = [u for u in out.users if u not in step.nodes and u not in prev.nodes]
            if outside:
                raise _NotFused(f"the memory state after step {t - 1} ({out.name}) is also read by "
                                f"{_op_name(outside[0])} ({outside[0].name}) outside the recurrence; "
                                "memory_scan only returns the final state")
    last = chain[-1]
    for s in range(1, last.variant.n_state):
        if last.variant.states[s] != "S":  # the normaliser z goes in and comes out of linear_attention
            continue
        if not _is_zeros(chain[0].state_in[s]):
            raise _NotFused(f"the momentum buffer starts as {chain[0].state_in[s].name}, not zeros "
                            "(memory_scan starts it at zero)")
        if any(u not in last.nodes for u in last.state_out[s].users):
            raise _NotFused(f"the final momentum buffer ({last.state_out[s].name}) is used after the loop; "
                            "memory_scan does not return it")
    sources = {role: _per_step_source(role, [s.per_step[role] for s in chain]) for role in last.variant.roles}
    _check_shapes(chain[0], sources)
    return params, sources


def _check_shapes(step: _Step, sources: dict[str, _Source]) -> None:
    M = step.state_in[0].meta["val"]
    if M.dim() != 4:
        raise _NotFused(f"the memory state has shape {list(M.shape)}, memory_scan needs [B, H, Dv, Dk]")
    B, H, Dv, Dk = M.shape
    expected = {"k": [B, H, Dk], "q": [B, H, Dk], "v": [B, H, Dv], "alpha": [B, H], "eta": [B, H]}
    for role in step.variant.roles:
        shape = expected[role]
        got = list(step.per_step[role].meta["val"].shape)
        if got != list(shape):
            raise _NotFused(f"{role}_t has shape {got}, memory_scan needs {list(shape)} for a state of "
                            f"shape {list(M.shape)}")
    dtypes = {r: step.per_step[r].meta["val"].dtype for r in ("k", "v", "q")}
    if len(set(dtypes.values())) != 1 or M.dtype not in (torch.float32, torch.float64):
        raise _NotFused(f"dtypes k/v/q {sorted(str(d) for d in dtypes.values())} and state {M.dtype}: "
                        f"hecate.{step.variant.op} needs one input dtype and an fp32/fp64 state")


# ---------------------------------------------------------------- assembling chains

def _chains(steps: list[_Step]) -> list[list[_Step]]:
    """Steps linked through their first state (M), each chain in loop order."""
    by_input = {s.state_in[0]: s for s in steps}
    produced = {s.state_out[0] for s in steps}
    chains = []
    for s in steps:
        if s.state_in[0] in produced:
            continue
        chain = [s]
        while chain[-1].state_out[0] in by_input:
            chain.append(by_input[chain[-1].state_out[0]])
        chains.append(chain)
    return chains


def _reaches(src: fx.Node, dst: fx.Node, limit: int = 2000) -> bool:
    """Whether ``dst`` is downstream of ``src`` (looking at most ``limit`` nodes ahead)."""
    seen, frontier = {src}, [src]
    while frontier and len(seen) < limit:
        nxt = []
        for n in frontier:
            for u in n.users:
                if u is dst:
                    return True
                if u not in seen:
                    seen.add(u)
                    nxt.append(u)
        frontier = nxt
    return False


# ---------------------------------------------------------------- replacing

def _fake(node: fx.Node) -> fx.Node:
    """Give a new node its fake value by running its target on the fake values of its args."""
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
    tensors = [v for v in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor)]
    fake_mode = detect_fake_mode(tensors)
    if fake_mode is not None:
        with fake_mode:
            node.meta["val"] = node.target(*args, **kwargs)
    return node


def _call(graph: fx.Graph, target: Any, *args: Any) -> fx.Node:
    return _fake(graph.call_function(target, args))


def _whole(graph: fx.Graph, src: _Source, length: int, batch_heads: list[int]) -> fx.Node:
    """The [B, T, ...] tensor of the chain's per-step inputs."""
    if src.constant:  # a gate that is the same [B, H] tensor at every step
        return _call(graph, aten.expand.default, _call(graph, aten.unsqueeze.default, src.node, 1),
                     [batch_heads[0], length, batch_heads[1]])
    x = src.node
    if src.time_dim != 1:
        x = _call(graph, aten.movedim.int, x, src.time_dim, 1)
    if src.start != 0 or x.meta["val"].shape[1] != length:
        x = _call(graph, aten.slice.Tensor, x, 1, src.start, src.start + length)
    return x


def _emit(gm: fx.GraphModule, variant: _Variant, init: list[fx.Node], sources: dict[str, _Source],
          length: int, params: dict[str, float]) -> tuple[fx.Node, list[fx.Node | None]]:
    """Insert the fused op after the last of its inputs.

    Returns its y [B, T, H, Dv] and, per chained state, the node standing for the final
    state (None for the momentum buffer, which memory_scan does not return).
    """
    graph = gm.graph
    B, H = init[0].meta["val"].shape[:2]
    position = {n: i for i, n in enumerate(graph.nodes)}
    last_input = max(list(init) + [s.node for s in sources.values()], key=position.__getitem__)
    with graph.inserting_before(last_input.next):
        whole = {role: _whole(graph, sources[role], length, [B, H]) for role in variant.roles}
        m0 = None if _is_zeros(init[0]) else init[0]
        if variant.op == "memory_scan":
            call = _call(graph, torch.ops.hecate.memory_scan.default,
                         whole["k"], whole["v"], whole["q"], whole["alpha"], whole["eta"], m0, None,
                         params["p"], params["a"], params["eps"], params["momentum"], params["q_norm"])
            finals = {"M": 1}
        else:
            normalise = "z" in variant.states
            z0 = None if not normalise or _is_zeros(init[1]) else init[1]
            call = _call(graph, torch.ops.hecate.linear_attention.default,
                         whole["k"], whole["v"], whole["q"], whole["alpha"], m0, z0, normalise,
                         params["eps"], True)
            finals = {"M": 1, "z": 2}
        y = _call(graph, operator.getitem, call, 0)
        final_states = [_call(graph, operator.getitem, call, finals[name]) if name in finals else None
                        for name in variant.states]
    return y, final_states


def _replace_loop(gm: fx.GraphModule, order: dict[fx.Node, int], chain: list[_Step],
                  params: dict[str, float], sources: dict[str, _Source]) -> int:
    graph = gm.graph
    last = chain[-1]
    y, final_states = _emit(gm, last.variant, chain[0].state_in, sources, len(chain), params)
    step_nodes = set().union(*(s.nodes for s in chain))
    for old, new in zip(last.state_out, final_states):
        if new is not None:
            old.replace_all_uses_with(new, delete_user_cb=lambda u: u not in step_nodes)
    ys = [s.y for s in chain]
    stacks = {u for y_t in ys for u in y_t.users
              if u.target == aten.stack.default and list(u.args[0]) == ys}
    for stack in stacks:  # torch.stack(ys, dim) of all the reads, in order: the op's y itself
        dim = (stack.args[1] if len(stack.args) > 1 else 0) % stack.meta["val"].dim()
        with graph.inserting_after(y):
            new = y if dim == 1 else _call(graph, aten.movedim.int, y, 1, dim)
        stack.replace_all_uses_with(new)
        graph.erase_node(stack)
    for t, y_t in enumerate(ys):
        if any(u not in step_nodes for u in y_t.users):
            with graph.inserting_after(y):
                y_t.replace_all_uses_with(_call(graph, aten.select.int, y, 1, t),
                                          delete_user_cb=lambda u: u not in step_nodes)
    replaced = len(step_nodes) + len(stacks)
    for node in sorted(step_nodes, key=order.__getitem__, reverse=True):
        if not node.users:
            graph.erase_node(node)
    return replaced


def _describe(variant: _Variant, params: dict[str, float], steps: int, form: str) -> str:
    """The report's detail: the variant, p, and how many steps were rolled up."""
    if variant.bias == "hebbian":
        what = "Hebbian M ← α M + v φ(k)ᵀ"
        if "z" in variant.states:
            what += ", normalised by z ← α z + φ(k)"
        return f"{what}; {form} rolled up {steps} steps"
    bias = {"l2": "l_2 bias p=2 (2e fast path)", "l1": "l_1 bias p=1 (tanh fast path)",
            "lp": f"l_p bias p={params['p']:g} (general form)"}[variant.bias]
    retention = {"plain": "GD", "momentum": f"GD with momentum β={params['momentum']:g}",
                 "moneta": f"MONETA L_q retention q={params['q_norm']:g}"}[variant.retention]
    return f"{retention}, {bias}; {form} rolled up {steps} steps"


# ---------------------------------------------------------------- the scan higher-order op

def _scan_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.higher_order.scan]


def _fuse_scan(gm: fx.GraphModule, node: fx.Node, op: str, report: FusionReport) -> None:
    """Replace ``scan(step_body, init, xs, ())`` whose body is exactly one step replaced by ``op``.

    The body's states and per-step inputs may come in any order (a rolled-up loop orders
    its carries by where they are computed).
    """
    body_attr, init, xs, additional = node.args[:4]
    body: fx.GraphModule = getattr(gm, body_attr.target)
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    body_out = list(next(reversed(body.graph.nodes)).args[0])
    compute = [n for n in body.graph.nodes if n.op == "call_function"]
    for variant in _variants(op):
        steps = _find_steps(body.graph, variant)
        if len(steps) != 1:
            continue
        step = steps[0]
        inputs = step.state_in + [step.per_step[r] for r in variant.roles]
        outputs = step.state_out + [step.y]
        if (len(step.nodes) != len(compute) or additional or sorted(inputs, key=placeholders.index) != placeholders
                or sorted(outputs, key=body_out.index) != body_out):
            report.add_miss(op, f"scan body contains a {variant.name} step but also other inputs, "
                            "outputs or ops", node.name)
            return
        # the scan's operands and results in the variant's order (states, then roles; states, then y)
        operands = [(list(init) + list(xs))[placeholders.index(n)] for n in inputs]
        state_init, per_step = operands[:variant.n_state], operands[variant.n_state:]
        result_index = [body_out.index(n) for n in outputs]
        results = {i: user for user in node.users for i, r in enumerate(result_index) if user.args[1] == r}
        try:
            params = _read_params(step)
            _check_scan_inputs(variant, state_init, results)
            if not hasattr(torch.ops.hecate, op):
                raise _NotFused(f"the op hecate.{op} is not registered (import hecate.lowering)")
        except _NotFused as why:
            report.add_miss(op, f"scan over a {variant.name} step: {why}", node.name)
            return
        graph = gm.graph
        sources = {}
        for role, x in zip(variant.roles, per_step):
            if x.op == "call_function" and x.target == aten.movedim.int and x.args[2] == 0:
                sources[role] = _Source(x.args[0], x.args[1] % x.args[0].meta["val"].dim(), 0)
            else:  # xs are scanned along dim 0
                sources[role] = _Source(x, 0, 0)
        T = xs[0].meta["val"].shape[0]
        y, final_states = _emit(gm, variant, state_init, sources, T, params)
        for i, user in results.items():
            if i == variant.n_state:  # the stacked reads, [T, B, H, Dv]
                with graph.inserting_after(y):
                    user.replace_all_uses_with(_call(graph, aten.movedim.int, y, 1, 0))
            elif final_states[i] is not None:
                user.replace_all_uses_with(final_states[i])
            graph.erase_node(user)
        graph.erase_node(node)
        if "hecate_rolled_loop" in node.meta:  # a Python loop Dynamo unrolled, rolled up before tracing
            report.add_fusion(op, f"hecate.{op}", T * len(compute) + 1, _describe(variant, params, T, "loop"))
        else:
            report.add_fusion(op, f"hecate.{op}", len(compute) + 1,
                              _describe(variant, params, T, "scan higher-order op"))
        return


def _check_scan_inputs(variant: _Variant, init: list[fx.Node], results: dict[int, fx.Node]) -> None:
    """``init``: the initial states in the variant's order; ``results``: state index (or n_state: y) -> getitem."""
    for s, name in enumerate(variant.states):
        if name != "S":
            continue
        if not _is_zeros(init[s]):
            raise _NotFused(f"the momentum buffer starts as {init[s].name}, not zeros")
        if s in results and results[s].users:
            raise _NotFused("the final momentum buffer is used after the scan; memory_scan does not return it")
    M = init[0].meta["val"]
    if M.dim() != 4:
        raise _NotFused(f"the memory state has shape {list(M.shape)}, hecate.{variant.op} needs [B, H, Dv, Dk]")


# ---------------------------------------------------------------- the passes

def _run(op: str) -> Callable[[fx.GraphModule, FusionReport], None]:
    def run(gm: fx.GraphModule, report: FusionReport) -> None:
        for node in _scan_nodes(gm):
            _fuse_scan(gm, node, op, report)
        for variant in _variants(op):
            steps = _find_steps(gm.graph, variant)
            if not steps:
                continue
            chains = _chains(steps)
            fragments = _broken_loops(chains)
            order = {n: i for i, n in enumerate(gm.graph.nodes)}
            for chain in chains:
                where = f"{chain[0].y.name} .. {chain[-1].y.name}"
                if id(chain) in fragments:
                    report.add_miss(op, fragments[id(chain)], where)
                    continue
                try:
                    params, sources = _verify_chain(chain)
                    if not hasattr(torch.ops.hecate, op):
                        raise _NotFused(f"the op hecate.{op} is not registered (import hecate.lowering)")
                except _NotFused as why:
                    report.add_miss(op, f"{len(chain)} {variant.name} steps not fused: {why}", where)
                    continue
                replaced = _replace_loop(gm, order, chain, params, sources)
                report.add_fusion(op, f"hecate.{op}", replaced, _describe(variant, params, len(chain), "loop"))
    run.__doc__ = f"Replace every unrolled loop (and scan) of a step that hecate.{op} computes by one call."
    return run


run_memory_scan = _run("memory_scan")
run_linear_attention = _run("linear_attention")


def _broken_loops(chains: list[list[_Step]]) -> dict[int, str]:
    """Chains that are pieces of one loop with a step in between that is not the memory step."""
    reasons = {}
    for a in chains:
        for b in chains:
            if a is b or _k_source(a) is not _k_source(b) or not _reaches(a[-1].state_out[0], b[0].state_in[0]):
                continue
            msg = (f"one loop with a step that differs: {len(a)} {a[0].variant.name} steps end at "
                   f"{a[-1].state_out[0].name}, whose next step is not the same computation (a different "
                   f"op or p), then {len(b)} more steps follow from {b[0].state_in[0].name}")
            reasons[id(a)] = reasons[id(b)] = msg
    return reasons


def _k_source(chain: list[_Step]) -> fx.Node:
    k = chain[0].per_step["k"]
    return k.args[0] if k.op == "call_function" and k.target == aten.select.int else k
