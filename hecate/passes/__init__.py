"""Hecate's passes: one module per pattern, each ``run(gm, report)``.

A pass finds its pattern in the canonical (pre-dispatch ATen) graph, replaces
each match by one ``torch.ops.hecate.*`` call, and writes every fusion and every
near-miss (with its reason) into the :class:`~hecate.compiler.report.FusionReport`.
They run in the order listed here.
"""

from __future__ import annotations

from typing import Callable

from torch import fx

from hecate.compiler.report import FusionReport

Pass = Callable[[fx.GraphModule, FusionReport], None]

from hecate.passes import kl_attention, kl_decode, linear_attention, memory_scan, qk_preprocess  # noqa: E402

PASSES: dict[str, Pass] = {
    "qk_preprocess": qk_preprocess.run,
    "memory_scan": memory_scan.run,
    "linear_attention": linear_attention.run,
    "kl_attention": kl_attention.run,
    "kl_decode": kl_decode.run,
}
