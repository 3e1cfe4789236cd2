"""Hecate's passes: one module per pattern, each ``run(gm, report)``.

A pass finds its pattern in the canonical (pre-dispatch ATen) graph, replaces
each match by one ``torch.ops.hecate.*`` call, and writes every fusion and every
near-miss (with its reason) into the :class:`~hecate.passes.report.FusionReport`.
They run in the order listed in :data:`PASSES`.

The pass modules are imported on first use of ``PASSES``, so importing
``hecate.passes.report`` (which the compiler and every pass need) loads no pass.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

from torch import fx

from hecate.passes.report import FusionReport

Pass = Callable[[fx.GraphModule, FusionReport], None]

# pattern name -> (module, entry point), in the order the passes run
_ENTRY_POINTS = {
    "qk_preprocess": ("hecate.passes.qk_preprocess", "run"),
    "memory_scan": ("hecate.passes.memory_scan", "run_memory_scan"),
    "linear_attention": ("hecate.passes.linear_attention", "run"),
    "kl_attention": ("hecate.passes.kl_attention", "run"),
    "kl_decode": ("hecate.passes.kl_decode", "run"),
}


def __getattr__(name: str) -> Any:
    if name != "PASSES":
        raise AttributeError(f"module 'hecate.passes' has no attribute {name!r}")
    passes: dict[str, Pass] = {pattern: getattr(importlib.import_module(module), entry)
                               for pattern, (module, entry) in _ENTRY_POINTS.items()}
    globals()["PASSES"] = passes  # built once; later reads (and tests' monkeypatching) see this dict
    return passes
