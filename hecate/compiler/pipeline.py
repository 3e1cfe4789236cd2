"""The pipeline every captured graph goes through.

Dynamo graph (torch-level, many spellings)
  → roll the loops Dynamo unrolled back up into scans (:mod:`hecate.compiler.loops`), so
    what follows sees a loop body once, not T times
  → canonicalise: re-trace to the pre-autograd ATen graph (``make_fx(pre_dispatch=True)``),
    so ``nn.Linear``/``F.linear`` both read ``aten.linear``, ``x.transpose``/``torch.transpose``
    both read ``aten.transpose``, and composite ops such as ``aten.linear`` are kept whole
  → the enabled passes, in registration order, each replacing its subgraphs by one
    ``torch.ops.hecate.*`` call and writing fusions and near-misses into the report
  → the fallback compiler (Inductor or eager) for everything that is left.

A rolled loop that no pass fuses would reach the fallback as a scan, which Inductor cannot
compile on CPU; such a graph is run through the pipeline again unrolled, as Dynamo gave it.

Substitution happens before autograd, so a fused op's backward is its own fused backward.
"""

from __future__ import annotations

import itertools
import os
from typing import Sequence

import torch
from torch import fx
from torch.fx import traceback as fx_traceback
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx

from hecate.compiler.loops import RolledGraph, roll_loops
from hecate.compiler.normalize import normalize
from hecate.compiler.options import Options
from hecate.compiler.report import FusionReport

# the passes that fuse a scan; rolling loops up serves no other
_SCAN_PASSES = ("memory_scan", "linear_attention")

_graph_counter = itertools.count()


def canonicalize(gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor]) -> fx.GraphModule:
    """Re-trace a Dynamo graph to the pre-autograd ATen graph the passes match on."""
    fake_mode = detect_fake_mode(example_inputs)
    if fake_mode is None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    with fake_mode:
        fake_inputs = [fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) else x
                       for x in example_inputs]
        # run node by node so each ATen node keeps the user's source line (meta["stack_trace"])
        with fx_traceback.preserve_node_meta():
            return normalize(make_fx(fx.Interpreter(gm).run, pre_dispatch=True)(*fake_inputs))


def fuse(gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor],
         options: Options) -> tuple[fx.GraphModule, FusionReport]:
    """Dynamo's graph → the ATen graph with Hecate's ops in it, and what was fused and why."""
    rolled = roll_loops(gm) if any(p in options.patterns for p in _SCAN_PASSES) else None
    report = FusionReport(graphs=1)
    if rolled is not None:
        try:
            aten_gm = canonicalize(rolled.gm, example_inputs)
            rolled.mark(aten_gm)
        except Exception as e:  # e.g. a body torch's scan rejects; the unrolled graph is always valid
            report.add_miss("loops", f"rolled-up loop(s) of {rolled.steps} steps could not be traced "
                            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                            "compiled unrolled", "")
        else:
            rolled_report = FusionReport(graphs=1)
            run_passes(aten_gm, options, rolled_report)
            unfused = RolledGraph.unfused(aten_gm)
            if not unfused:
                return aten_gm, rolled_report
            # why the scan passes did not fuse the rolled loop (the other passes report again below)
            report.misses.extend(m for m in rolled_report.misses if m.pattern in _SCAN_PASSES)
            for steps, ops in unfused:
                report.add_miss("loops", f"a Python loop of {steps} steps is not a step any pass fuses "
                                f"(its body calls {', '.join(ops)}); compiled unrolled", "")
    return run_passes(canonicalize(gm, example_inputs), options, report), report


def run_passes(gm: fx.GraphModule, options: Options, report: FusionReport,
               dump_name: str | None = None) -> fx.GraphModule:
    """Run the enabled passes over ``gm`` in place; return it."""
    from hecate.passes import PASSES

    if dump_name is None:
        dump_name = f"graph{next(_graph_counter)}"
    _dump(options, dump_name, "0_before", gm)
    for n, name in enumerate(p for p in PASSES if p in options.patterns):
        PASSES[name](gm, report)
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()
        _dump(options, dump_name, f"{n + 1}_after_{name}", gm)
    return gm


def _dump(options: Options, graph_name: str, stage: str, gm: fx.GraphModule) -> None:
    if options.dump_dir is None:
        return
    os.makedirs(options.dump_dir, exist_ok=True)
    path = os.path.join(options.dump_dir, f"{graph_name}.{stage}.txt")
    with open(path, "w") as f:
        f.write(gm.print_readable(print_output=False, include_stride=True))
