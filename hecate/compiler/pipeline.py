"""The pipeline every captured graph goes through.

Dynamo graph (torch-level, many spellings)
  → compute each subexpression once (:func:`hecate.compiler.normalize.collapse_captured`), so an
    expression written again at each use reads as one node from here on
  → each ``torch.utils.checkpoint`` region's body and each ``torch.cond`` branch through this same
    pipeline, the call kept
  → roll the loops Dynamo unrolled back up into scans (:mod:`hecate.compiler.loops`), so
    what follows sees a loop body once, not T times
  → canonicalise: re-trace to the pre-autograd ATen graph (``make_fx(pre_dispatch=True)``),
    so ``nn.Linear``/``F.linear`` both read ``aten.linear``, ``x.transpose``/``torch.transpose``
    both read ``aten.transpose``, and composite ops such as ``aten.linear`` are kept whole;
    then the normal form (:mod:`hecate.compiler.normalize`) on the whole graph and every loop body
  → the enabled passes, in registration order, each replacing its subgraphs by one
    ``torch.ops.hecate.*`` call and writing fusions and near-misses into the report
  → the fallback compiler (Inductor or eager) for everything that is left.

A rolled loop that no pass fuses would reach the fallback as a scan, which Inductor cannot
compile on CPU; such a graph is run through the pipeline again unrolled, as Dynamo gave it.

Nothing in here may break a user's compile: a pass that raises leaves the graph exactly as
it was before that pass and the report says "internal error in pass X"; if the pipeline
itself fails, the backend compiles Dynamo's graph unfused (:func:`fuse_or_original`).
``options={"strict": True}`` (``HECATE_STRICT=1``, as in the tests) re-raises instead.
After the passes, :mod:`hecate.passes.signatures` reports every family signature left
unfused that no pass explained, so a miss is never silent.

Substitution happens before autograd, so a fused op's backward is its own fused backward.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import itertools
import logging
import os
import re
import warnings
from typing import Sequence

import torch
from torch import fx
from torch.fx import traceback as fx_traceback
from torch._guards import detect_fake_mode
from torch.fx.experimental import proxy_tensor
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from hecate.compiler.logs import log, stage
from hecate.compiler.loops import RolledGraph, roll_loops, unroll_split_parts
from hecate.compiler.normalize import collapse_captured, normalize
from hecate.compiler.options import Options
from hecate.passes.matching import eliminate_dead_code, free_attribute, is_register_hook, mutates, writes_into
from hecate.passes.memory_step import UNROLLED_UPDATES, forms_outer_product
from hecate.passes.report import FusionReport, Miss, source_line

# the passes that fuse a scan; rolling loops up serves no other
_SCAN_PASSES = ("memory_scan", "linear_attention")

_graph_counter = itertools.count()


def canonicalize(gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor]) -> fx.GraphModule:
    """Re-trace a Dynamo graph to the pre-autograd ATen graph the passes match on."""
    with _checkpoint_bodies_traceable(gm):
        traced = _retrace(gm, example_inputs)
    for body in _checkpoint_bodies(traced):  # the trace copies it over
        if body.meta.get("_checkpoint_context_fn") is _PLAIN_CHECKPOINT:
            del body.meta["_checkpoint_context_fn"]
    return traced


_CHECKPOINT = torch.ops.higher_order.tag_activation_checkpoint


_COND = torch.ops.higher_order.cond


def _checkpoint_bodies(gm: fx.GraphModule) -> list[fx.GraphModule]:
    """The bodies of ``gm``'s checkpoint regions, and of those nested in them or in a ``torch.cond`` branch."""
    found = []
    for node, names, _ in _regions(gm):
        for name in names:
            body = getattr(gm, name)
            found += ([body] if node.target is _CHECKPOINT else []) + _checkpoint_bodies(body)
    return found


def _recompute_all(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.PREFER_RECOMPUTE


_PLAIN_CHECKPOINT = functools.partial(create_selective_checkpoint_contexts, _recompute_all)


@contextlib.contextmanager
def _checkpoint_bodies_traceable(gm: fx.GraphModule):
    """Let the pre-dispatch re-trace through a plain ``torch.utils.checkpoint`` region (and the regions in it).

    torch's pre-dispatch rule for ``tag_activation_checkpoint`` reads the body's
    ``_checkpoint_context_fn``, which Dynamo sets only when the user passed a ``context_fn``;
    a plain checkpoint is given the context it means (recompute everything) while tracing."""
    given = [body for body in _checkpoint_bodies(gm) if "_checkpoint_context_fn" not in body.meta]
    for body in given:
        body.meta["_checkpoint_context_fn"] = _PLAIN_CHECKPOINT
    # torch then warns that the user passed a context_fn, which they did not
    wrap_log, quiet = logging.getLogger("torch._higher_order_ops.wrap"), lambda record: "context_fn" not in record.msg
    wrap_log.addFilter(quiet)
    try:
        yield
    finally:
        wrap_log.removeFilter(quiet)
        for body in given:
            del body.meta["_checkpoint_context_fn"]


def _retrace(gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor]) -> fx.GraphModule:
    fake_mode = detect_fake_mode(example_inputs)
    if fake_mode is None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    with fake_mode:
        fake_inputs = [fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) else x
                       for x in example_inputs]
        # run node by node so each ATen node keeps the user's source line (meta["stack_trace"])
        with fx_traceback.preserve_node_meta():
            traced = make_fx(_Retrace(gm).run, pre_dispatch=True)(*fake_inputs)
    _check_traced_through(traced)
    _keep_input_names(gm, traced)
    for node, x in zip(traced.graph.find_nodes(op="placeholder"), example_inputs):  # (fake values drop it)
        node.meta["requires_grad"] = isinstance(x, torch.Tensor) and x.requires_grad
    return normalize(traced)


class _Retrace(fx.Interpreter):
    """Runs Dynamo's graph node by node under make_fx.

    A gradient hook registered inside the compiled code (``y.register_hook(fn)``) is a
    ``register_hook`` call in Dynamo's graph; run as it is, it would register ``fn`` on a fake
    tensor and leave nothing in the trace. It is written into the trace as the same call instead,
    so the fallback registers it at run time (eager) or while tracing the backward (Inductor)."""

    def call_function(self, target, args, kwargs):
        if not is_register_hook(target):
            return super().call_function(target, args, kwargs)
        tensor, body, *free = args
        tracer = proxy_tensor.get_proxy_mode().tracer
        name = free_attribute(tracer.root, "hook_body")
        tracer.root.register_module(name, body)
        proxies = [proxy_tensor.get_proxy_slot(a, tracer).proxy if isinstance(a, torch.Tensor)
                   else proxy_tensor.fetch_sym_proxy(tracer)(a) if isinstance(a, proxy_tensor.py_sym_types) else a
                   for a in (tensor, *free)]  # (a size under dynamic shapes: its node)
        hooked = tracer.create_proxy("call_function", torch.ops.higher_order.register_hook,
                                     (proxies[0], tracer.create_proxy("get_attr", name, (), {}), *proxies[1:]), {})
        with proxy_tensor.disable_proxy_modes_tracing():
            out = torch.ops.aten.alias.default(tensor)
        # what reads the tensor from here on reads it hooked, as in Dynamo's graph
        return proxy_tensor.track_tensor_tree(out, hooked, constant=None, tracer=tracer)


def _keep_input_names(gm: fx.GraphModule, traced: fx.GraphModule) -> None:
    """The re-trace names its inputs ``arg0_1``, ...: they take back Dynamo's names, which say what each
    input is (``l_self_buffers_gamma_``, ``l_k_``), so reasons that name an input name it in the user's terms."""
    given, inputs = gm.graph.find_nodes(op="placeholder"), traced.graph.find_nodes(op="placeholder")
    if len(given) != len(inputs):
        return
    for old, new in zip(given, inputs):
        new._rename(old.name)
        new.target = new.name
    traced.recompile()


class UntraceableGraph(Exception):
    """Dynamo's graph calls something the re-trace to ATen cannot follow: it is compiled as captured. ``what``
    names it in the report, ``nodes`` are the calls."""

    def __init__(self, reason: str, what: str = "functorch transform", nodes: Sequence[fx.Node] = ()):
        super().__init__(reason)
        self.what, self.nodes = what, list(nodes)


def _check_traced_through(traced: fx.GraphModule) -> None:
    """Raise :class:`UntraceableGraph` if the re-trace recorded a value it did not follow as a constant.

    Dynamo's graph of ``torch.vmap`` calls functorch's batching levels directly; make_fx does not
    trace through them and stores their (fake) result as a constant, a graph that would compute
    nothing at run time."""
    from torch._subclasses.fake_tensor import FakeTensor

    for node in traced.graph.nodes:
        if node.op == "get_attr" and isinstance(getattr(traced, node.target, None), FakeTensor):
            raise UntraceableGraph(_TRANSFORMS)


def transform_calls(gm: fx.GraphModule) -> list[fx.Node]:
    """Dynamo's calls into functorch's transform levels (``torch.vmap``, ``torch.func.grad``).

    Hecate never runs such a graph: a re-trace that stops inside a transform leaves functorch's
    level stack pushed, and the fallback's own compile of the graph then fails."""
    return [n for n in gm.graph.nodes if n.op == "call_function"
            and getattr(n.target, "__module__", "").startswith(("torch._functorch", "torch._C._functorch"))]


_TRANSFORMS = ("the graph calls functorch transforms (torch.vmap, torch.func.grad) that Hecate cannot re-trace to ATen "
               "(to have the rest of the graph fused, call the transformed function through a function decorated with "
               "@torch.compiler.disable, or write it batched, without the transform)")


def fuse_or_original(gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor],
                     options: Options) -> tuple[fx.GraphModule, FusionReport]:
    """:func:`fuse`, or, if the pipeline itself fails, Dynamo's ``gm`` unchanged with the reason
    in the report (``options.strict`` re-raises)."""
    try:
        return fuse(gm, example_inputs, options)
    except UntraceableGraph as e:  # a limit, not a fault: said, never raised
        report = FusionReport(graphs=1)
        report.add_miss("hecate", f"{e}; the graph is compiled as Dynamo captured it, without fusions",
                        e.what, e.nodes)
        return gm, report
    except Exception as e:
        if options.strict:
            raise
        report = FusionReport(graphs=1)
        reason = (f"internal error in Hecate's pipeline: {describe_error(e)}; the graph is compiled as "
                  "Dynamo captured it, without fusions")
        report.add_miss("hecate", reason)
        warn_once("pipeline", e, reason)
        return gm, report


def fuse(gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor],
         options: Options) -> tuple[fx.GraphModule, FusionReport]:
    """Dynamo's graph → the ATen graph with Hecate's ops in it, and what was fused and why."""
    if transform_calls(gm):
        raise UntraceableGraph(_TRANSFORMS, nodes=transform_calls(gm))
    hooked = _hooks_in_checkpoints(gm)
    if hooked:
        raise UntraceableGraph("a gradient hook is registered inside a torch.utils.checkpoint region, which the "
                               "re-trace of the region would drop", "hook in a checkpoint", hooked)
    written = _held_tensors_written(gm, example_inputs)
    if written:
        names = sorted({n.target for n in written})
        names = ", ".join(names) if len(names) <= 3 else f"{len(names)} of them, such as {', '.join(names[:2])}"
        raise UntraceableGraph(f"the graph writes in place into tensors it holds as constants ({names}: an "
                               "optimizer's state and parameters under a compiled opt.step(), say); the re-trace to "
                               "ATen would write into them while compiling", "tensors held by the graph written",
                               written)
    report = FusionReport(graphs=1)
    with stage("common subexpressions", options.progress):
        gm = collapse_captured(gm)
    gm = _fuse_regions(gm, options, report)
    rolled = fuse_rolled_loops(gm, example_inputs, options, report)
    if rolled is not None:
        return rolled
    with stage("re-trace to ATen", options.progress):
        aten_gm = canonicalize(gm, example_inputs)
    return run_passes(aten_gm, options, report), report


def _held_tensors_written(gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor]) -> list[fx.Node]:
    """The ``get_attr`` nodes of the tensors ``gm`` holds (not its inputs: Dynamo lifts a module's parameters and
    buffers to inputs, but keeps an optimizer's state, say, as constants) that it writes in place. make_fx runs an
    op on a real tensor it does not trace for real: re-traced, ``step += 1`` would count one step more than the
    code takes. Found by a run of ``gm`` on fake copies of them, whose version counters count the writes."""
    held = {n: t for n in gm.graph.find_nodes(op="get_attr")
            if isinstance(t := _attribute(gm, n.target), torch.Tensor)}
    if not held or not any(mutates(n) for n in gm.graph.nodes):
        return []
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    with fake_mode:
        copies = {n.target: fake_mode.from_tensor(t) for n, t in held.items()}
        versions = {target: t._version for target, t in copies.items()}
        inputs = [fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in example_inputs]

        class OnCopies(fx.Interpreter):
            def fetch_attr(self, target):
                return copies[target] if target in copies else super().fetch_attr(target)

        try:
            OnCopies(gm).run(*inputs)
        except Exception:  # noqa: BLE001  (not runnable on fakes: under dynamic shapes, say) the writes the graph
            return [n for n in held if writes_into(n)]  # spells out (an optimizer's add_ into a parameter)
    return [n for n in held if copies[n.target]._version != versions[n.target]]


def _attribute(gm: fx.GraphModule, target: str):
    value = gm
    for name in target.split("."):
        value = getattr(value, name, None)
    return value


def _hooks_in_checkpoints(gm: fx.GraphModule) -> list[fx.Node]:
    """The ``register_hook`` calls in ``gm``'s checkpoint bodies: torch re-traces a body through its own rule
    for the checkpoint, which runs such a call on a fake tensor and keeps nothing."""
    return [n for node in gm.graph.find_nodes(op="call_function", target=_CHECKPOINT)
            for n in getattr(gm, node.args[0].target).graph.nodes if is_register_hook(n.target)]


def _fuse_regions(gm: fx.GraphModule, options: Options, report: FusionReport) -> fx.GraphModule:
    """``gm`` with the code inside each ``torch.utils.checkpoint`` region and each ``torch.cond`` branch fused.

    Dynamo keeps such a region as a higher-order call on body graphs (``tag_activation_checkpoint(body, *args)``,
    ``cond(pred, true_body, false_body, args)``); each body goes through this pipeline on its own (its fusions and
    misses join ``report``) and the call stays, so a checkpointed region is still recomputed in the backward and a
    branch still runs only where its predicate says."""
    fused_bodies, steps = {}, {}
    for node, bodies, operands in _regions(gm):
        examples = [a.meta.get("example_value") if isinstance(a, fx.Node) else a for a in operands]
        for name in bodies:
            body = getattr(gm, name)
            fused, body_report = fuse_or_original(body, examples, options)
            report.fusions += body_report.fusions
            for miss in body_report.misses:  # one memory update step per region: gathered by the line it is on
                if UNROLLED_UPDATES in miss.reason:
                    steps.setdefault((node.target, miss.pattern, miss.source), []).append(miss)
                else:
                    report.misses.append(miss)
            if fused is not body:
                fused.meta.update(body.meta)  # a user's context_fn (selective checkpointing) stays
                fused_bodies[name] = fused
    for (target, pattern, source), misses in steps.items():
        if len(misses) == 1:
            report.misses += misses
            continue
        what, advice = _REGION_WORDS[target]
        report.misses.append(Miss(pattern, f"the memory update runs inside a {what} called at every step of a loop "
                                  f"({len(misses)} calls): Hecate rolls up a loop whose steps are plain code, and "
                                  f"reads each {what} on its own, where it is a single step; {advice}, which fuses; "
                                  "compiled as written", misses[0].where, source))
    if not fused_bodies:
        return gm
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    copied = fx.GraphModule(gm, graph)  # Dynamo's graph keeps its own bodies
    for name, fused in fused_bodies.items():
        setattr(copied, name, fused)
    return copied


# what a region is, in the user's words, and how to write its loop so that it fuses
_REGION_WORDS = {
    _CHECKPOINT: ("torch.utils.checkpoint region", "checkpoint the whole loop instead"),
    _COND: ("torch.cond branch", "choose between whole loops instead (a torch.cond whose branches each run the loop)"),
}


def _regions(gm: fx.GraphModule) -> list[tuple[fx.Node, list[str], list]]:
    """(call, the names of its body graphs, its operands) of each checkpoint region and ``torch.cond`` in ``gm``."""
    found = []
    for node in gm.graph.find_nodes(op="call_function", target=_CHECKPOINT):
        found.append((node, [node.args[0].target], list(node.args[1:])))
    for node in gm.graph.find_nodes(op="call_function", target=_COND):
        found.append((node, [node.args[1].target, node.args[2].target], list(node.args[3])))
    return found


def fuse_rolled_loops(gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor], options: Options,
                      report: FusionReport, dump_name: str | None = None) -> tuple[fx.GraphModule, FusionReport] | None:
    """Roll ``gm``'s unrolled loops up, re-trace to ATen and run the passes.

    Returns the fused graph and its report when ``gm`` had loops and the passes fused every one
    of them, or, when some did not, every one of those that did, rolled again without the others (which stay
    unrolled, their reasons in the report); otherwise None, with why in ``report`` (the caller goes on with
    ``gm`` unrolled).
    Serves Dynamo's graphs and torch.export's alike (``example_inputs``: the placeholders' values).
    """
    if not any(p in options.patterns for p in _SCAN_PASSES):
        return None
    fused = _rolled_and_fused(gm, example_inputs, options, report, dump_name)
    if fused is None:
        return None
    aten_gm, rolled_report, rolled = fused
    unrolled = unroll_split_parts(aten_gm, rolled)
    rolled_report.misses = [dataclasses.replace(m, reason=f"{m.reason}; its steps are compiled unrolled")
                            if unrolled & set(m.where.split(", ")) else m for m in rolled_report.misses]
    unfused = RolledGraph.unfused(aten_gm)
    if not unfused:
        return aten_gm, rolled_report
    keep = set(rolled.indices) - RolledGraph.unfused_indices(aten_gm)
    # why the scan passes did not fuse the rolled loop, said once (the other passes report again later)
    # (and the misses about a rolled loop itself: a score computed row by row, say)
    scans = {n.name for n in aten_gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.scan)}
    scan_misses = [m for m in rolled_report.misses if m.pattern in _SCAN_PASSES or scans & set(m.where.split(", "))]
    report.misses.extend(dataclasses.replace(m, reason=f"{m.reason}; the loop is compiled unrolled")
                         for m in scan_misses)
    if not scan_misses:
        for steps, ops in RolledGraph.unfused(aten_gm, forms_outer_product):
            report.add_miss("loops", f"a Python loop of {steps} steps is not a step memory_scan or "
                            f"linear_attention fuses (its body calls {', '.join(ops)}); compiled unrolled")
    # the loops that fused, rolled again without the others (which stay unrolled, as Dynamo gave them; their
    # reasons, said above, are in the report the passes start from, so they are not said again)
    again = _rolled_and_fused(gm, example_inputs, options, report, dump_name, keep) if keep else None
    if again is not None and not RolledGraph.unfused(again[0]):
        return again[0], again[1]
    return None


def _rolled_and_fused(gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor], options: Options,
                      report: FusionReport, dump_name: str | None,
                      only: set[int] | None = None) -> tuple[fx.GraphModule, FusionReport, RolledGraph] | None:
    """``gm`` with its loops (``only`` those of these indices) rolled up, re-traced to ATen and through the passes:
    the graph, its report and the rolled graph; None (why in ``report``) if no loop rolled or the re-trace failed."""
    try:
        with stage("roll loops", options.progress):
            rolled = roll_loops(gm, only)
    except Exception as e:  # the unrolled graph is always valid
        if options.strict:
            raise
        reason = f"internal error rolling loops up: {describe_error(e)}; loops are matched unrolled"
        report.add_miss("loops", reason)
        warn_once("loops", e, reason)
        return None
    if rolled is None:
        return None
    try:
        with stage("re-trace to ATen (loops rolled)", options.progress):
            aten_gm = canonicalize(rolled.gm, example_inputs)
            rolled.mark(aten_gm)
    except Exception as e:  # e.g. a body torch's scan rejects; the unrolled graph is always valid
        report.add_miss("loops", f"rolled-up loop(s) of {rolled.steps} steps could not be traced "
                        f"({describe_error(e)}); compiled unrolled", "")
        return None
    rolled_report = FusionReport(graphs=1)
    if only is not None:
        rolled_report.fusions, rolled_report.misses = list(report.fusions), list(report.misses)
    run_passes(aten_gm, options, rolled_report, dump_name)
    return aten_gm, rolled_report, rolled


def run_passes(gm: fx.GraphModule, options: Options, report: FusionReport,
               dump_name: str | None = None) -> fx.GraphModule:
    """Run the enabled passes over ``gm`` in place, then report the unfused signatures; return it.

    Each pass runs isolated: if it raises, ``gm`` is restored to what it was before that pass
    and the report records the error. Patterns are traced under a forked RNG, so compiling
    never moves the user's random stream.
    """
    from hecate.passes import PASSES
    from hecate.passes.signatures import report_unfused_signatures

    if dump_name is None:
        dump_name = f"graph{next(_graph_counter)}"
    _dump(options, dump_name, "0_before", gm)
    enabled = [p for p in PASSES if p in options.patterns]
    with torch.random.fork_rng(devices=[]):
        for n, name in enumerate(enabled):
            fusions, misses = len(report.fusions), len(report.misses)
            with stage(f"pass {name}", options.progress):
                _run_isolated(name, PASSES[name], gm, options, report)
            _locate_misses(report, misses, gm)
            for f in report.fusions[fusions:]:
                log.info("%s: fused %d nodes into %s (%s)", name, f.nodes_replaced, f.op, f.detail)
            for m in report.misses[misses:]:
                log.info("%s: not fused: %s%s", name, m.reason, f" at {m.source}" if m.source else "")
            _dump(options, dump_name, f"{n + 1}_after_{name}", gm)
        if enabled:
            misses = len(report.misses)
            _run_isolated("signatures", lambda g, r: report_unfused_signatures(g, enabled, r), gm, options, report)
            for m in report.misses[misses:]:
                log.info("not fused: %s%s", m.reason, f" at {m.source}" if m.source else "")
    return gm


def _run_isolated(name: str, run, gm: fx.GraphModule, options: Options, report: FusionReport) -> None:
    """Run one pass; if it raises, put ``gm`` back exactly as it was and report the error."""
    saved = _Snapshot.of(gm)
    recorded = len(report.fusions), len(report.misses)
    try:
        run(gm, report)
        eliminate_dead_code(gm.graph)
        gm.graph.lint()
        gm.recompile()
    except Exception as e:
        if options.strict:
            raise
        nodes = _nodes_in_traceback(e, gm)
        saved.restore(gm)
        # what the pass recorded before failing describes a graph that no longer exists
        del report.fusions[recorded[0]:], report.misses[recorded[1]:]
        reason = f"internal error in pass {name}: {describe_error(e)}; this pass changed nothing"
        report.add_miss(name, reason, nodes=nodes)
        warn_once(name, e, reason)


@dataclasses.dataclass
class _Snapshot:
    """A GraphModule's graph, submodules and attributes, to undo a pass that failed halfway."""

    graph: fx.Graph
    modules: dict
    parameters: dict
    buffers: dict
    attributes: set
    children: dict  # name -> _Snapshot of each GraphModule child (a scan body can be edited in place)

    @staticmethod
    def of(gm: fx.GraphModule) -> "_Snapshot":
        return _Snapshot(copy.deepcopy(gm.graph), dict(gm._modules), dict(gm._parameters), dict(gm._buffers),
                         set(gm.__dict__),
                         {k: _Snapshot.of(m) for k, m in gm._modules.items() if isinstance(m, fx.GraphModule)})

    def restore(self, gm: fx.GraphModule) -> None:
        for key in set(gm.__dict__) - self.attributes:
            delattr(gm, key)
        for table, saved in ((gm._modules, self.modules), (gm._parameters, self.parameters),
                             (gm._buffers, self.buffers)):
            table.clear()
            table.update(saved)
        for name, child in self.children.items():
            child.restore(gm._modules[name])
        gm.graph = self.graph  # the setter re-generates the code


def _locate_misses(report: FusionReport, start: int, gm: fx.GraphModule) -> None:
    """Give the misses from ``start`` on that name graph nodes (``where``) but no source line
    the user's line of those nodes; an unfused subgraph's nodes are still in ``gm``."""
    graphs = [m.graph for m in gm.modules() if isinstance(m, fx.GraphModule)]
    nodes = {n.name: n for graph in reversed(graphs) for n in graph.nodes}  # gm's own names win
    for i in range(start, len(report.misses)):
        miss = report.misses[i]
        if not miss.source and miss.where:
            named = [nodes[w] for w in re.findall(r"[A-Za-z_]\w*", miss.where) if w in nodes]
            report.misses[i] = dataclasses.replace(miss, source=source_line(named))


def _nodes_in_traceback(e: BaseException, gm: fx.GraphModule) -> list[fx.Node]:
    """The graph nodes the innermost frame of ``e``'s traceback was handling, for a source line."""
    graphs = {gm.graph} | {m.graph for m in gm.modules() if isinstance(m, fx.GraphModule)}
    frames = []
    tb = e.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):
        nodes = [v for v in frame.f_locals.values() if isinstance(v, fx.Node) and v.graph in graphs]
        if nodes:
            return nodes
    return []


def describe_error(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


_warned: set[tuple[str, str]] = set()


def warn_once(where: str, e: BaseException, reason: str) -> None:
    """Warn once per process for each place and kind of error (the report has every one)."""
    if (where, type(e).__name__) in _warned:
        return
    _warned.add((where, type(e).__name__))
    warnings.warn(f"hecate: {reason} (options={{'strict': True}} or HECATE_STRICT=1 raises it)", stacklevel=2)


def _dump(options: Options, graph_name: str, step: str, gm: fx.GraphModule) -> None:
    if options.dump_dir is None:
        return
    os.makedirs(options.dump_dir, exist_ok=True)
    path = os.path.join(options.dump_dir, f"{graph_name}.{step}.txt")
    with open(path, "w") as f:
        f.write(gm.print_readable(print_output=False, include_stride=True))
