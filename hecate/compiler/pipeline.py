"""The pipeline every captured graph goes through.

Dynamo graph (torch-level, many spellings)
  → canonicalise: re-trace to the pre-autograd ATen graph (``make_fx(pre_dispatch=True)``),
    so ``nn.Linear``/``F.linear`` both read ``aten.linear``, ``x.transpose``/``torch.transpose``
    both read ``aten.transpose``, and composite ops such as ``aten.linear`` are kept whole
  → the enabled passes, in registration order, each replacing its subgraphs by one
    ``torch.ops.hecate.*`` call and writing fusions and near-misses into the report
  → the fallback compiler (Inductor or eager) for everything that is left.

Substitution happens before autograd, so a fused op's backward is its own fused backward.
"""

from __future__ import annotations

import itertools
import os
from typing import Sequence

import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx

from hecate.compiler.options import Options
from hecate.compiler.report import FusionReport

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
        return make_fx(gm, pre_dispatch=True)(*fake_inputs)


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
