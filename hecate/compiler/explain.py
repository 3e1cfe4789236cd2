"""``hecate.explain(model_or_fn, *args, **kwargs) -> FusionReport``."""

from __future__ import annotations

import collections
from typing import Any, Callable, Mapping

import torch
from torch._dynamo.utils import counters

from hecate.compiler.options import parse_options
from hecate.compiler.pipeline import fuse_or_original
from hecate.passes.report import FusionReport


def explain(model_or_fn: Callable, *args: Any, options: Mapping[str, Any] | None = None,
            **kwargs: Any) -> FusionReport:
    """Say what ``torch.compile(model_or_fn, backend="hecate")`` would fuse for these inputs.

    Dynamo captures the graphs as it would for a real compile and Hecate's passes
    run on them with fake tensors. Neither the fused kernels nor Inductor run: the
    call executes the captured graphs unfused, in eager mode, once. Dynamo's cache
    is reset first so the capture is fresh. Where Dynamo split the code (a graph break),
    ``report.graph_breaks`` says why.
    """
    if not callable(model_or_fn):
        raise TypeError(f"explain() needs a model or function to call, got {type(model_or_fn).__name__}")
    import hecate.lowering  # noqa: F401

    opts = parse_options(options)
    report = FusionReport()

    def recording_backend(gm, example_inputs):
        report.extend(fuse_or_original(gm, example_inputs, opts)[1])
        return gm.forward  # the unfused graph, run eagerly

    # graph_break: Dynamo split the frame and resumed after; unimplemented: it left the frame to Python
    breaks = lambda: counters["graph_break"] + counters["unimplemented"]  # noqa: E731
    before = breaks()
    torch._dynamo.reset()
    try:
        torch.compile(model_or_fn, backend=recording_backend)(*args, **kwargs)
    finally:
        torch._dynamo.reset()
    report.graph_breaks = _break_reasons(breaks() - before)
    return report


def _break_reasons(reasons: collections.Counter) -> list[str]:
    """Dynamo's graph-break messages, each by its first line and its explanation, which names what was called
    ("Failed to trace builtin operator: ... `print` ..."; the rest is Dynamo's advice and links)."""
    firsts = collections.Counter()
    for message, n in reasons.items():
        lines = [line.strip() for line in message.strip().splitlines()]
        explained = next((line.removeprefix("Explanation:").strip() for line in lines[1:]
                          if line.startswith("Explanation:")), "")
        firsts[lines[0] + (f": {explained}" if explained else "")] += n
    return [reason + (f" ({n}×)" if n > 1 else "") for reason, n in firsts.items()]
