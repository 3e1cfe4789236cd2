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

PASSES: dict[str, Pass] = {}
from hecate.passes import memory_scan  # noqa: E402,F401  registers "memory_scan", "linear_attention"
