"""What Hecate fused, what it did not, and why.

It sits below the passes (compiler → passes → lowering): every pass writes into it and
the compiler reads it.

Every pass writes into one :class:`FusionReport`: a :class:`Fusion` for each
subgraph it replaced by a ``torch.ops.hecate.*`` op, a :class:`Miss` for each
subgraph that almost matched (the graph is left as it was, so the result is
still correct) with the reason in words a user can act on.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch


@dataclass(frozen=True)
class Fusion:
    """One subgraph replaced by one fused op."""

    pattern: str  # pattern name, e.g. "qk_preprocess"
    op: str  # the op that replaced it, e.g. "hecate.qk_preprocess"
    nodes_replaced: int  # how many graph nodes the op stands for
    detail: str = ""  # what variant matched, e.g. "linear → conv(K=4) → silu → elu+1"


@dataclass(frozen=True)
class Miss:
    """A subgraph that almost matched a pattern and was left unfused."""

    pattern: str
    reason: str  # what differed, in words: "conv1d has groups=1; the pattern needs depthwise (groups=8)"
    where: str = ""  # the graph nodes involved, for finding it in a dump
    source: str = ""  # the user's source line the subgraph came from ("model.py:42: y = beta @ v")


@dataclass
class FusionReport:
    """The result of running Hecate's passes over one or more captured graphs."""

    fusions: list[Fusion] = field(default_factory=list)
    misses: list[Miss] = field(default_factory=list)
    graphs: int = 0  # how many FX graphs Dynamo handed to the backend
    onnx_forms: list = field(default_factory=list)  # export_onnx: the ONNX form each fused op took, and why
    graph_breaks: list[str] = field(default_factory=list)  # hecate.explain: why Dynamo split the code, first lines

    def add_fusion(self, pattern: str, op: str, nodes_replaced: int, detail: str = "") -> None:
        self.fusions.append(Fusion(pattern, op, nodes_replaced, detail))

    def add_miss(self, pattern: str, reason: str, where: str = "", nodes: Iterable[Any] = ()) -> None:
        """Record a near-miss; ``nodes`` (graph nodes of the subgraph) give the user's source line
        (and name the nodes when ``where`` is not given)."""
        nodes = list(nodes)
        where = where or ", ".join(n.name for n in nodes if hasattr(n, "name"))
        self.misses.append(Miss(pattern, reason, where, source_line(nodes)))

    def extend(self, other: "FusionReport") -> None:
        self.fusions.extend(other.fusions)
        self.misses.extend(other.misses)
        self.graphs += other.graphs
        self.graph_breaks.extend(other.graph_breaks)

    def count(self, pattern: str) -> int:
        """How many times ``pattern`` was fused."""
        return sum(f.pattern == pattern for f in self.fusions)

    def __str__(self) -> str:
        return self.format()

    def format(self, verbose: bool = False) -> str:
        """The report as text: each miss with its reason and the user's source line.

        ``verbose`` also names the graph nodes of each miss (what ``where`` holds), for
        finding it in a ``dump_dir`` dump; without it they are shown only for a miss whose
        source line is unknown.
        """
        lines = [f"Hecate fusion report: {len(self.fusions)} fused, {len(self.misses)} not fused, "
                 f"{self.graphs} graph(s)"]
        if self.fusions:
            rows = [("pattern", "op", "nodes", "detail")]
            rows += [(f.pattern, f.op, str(f.nodes_replaced), f.detail) for f in self.fusions]
            lines += ["", "Fused:"] + _table(rows)
        if self.misses:
            lines += ["", "Not fused:"]
            width = max(len(m.pattern) for m in self.misses)
            indent = " " * (width + 4)
            # the same reason at the same line (a loop rolled up in several runs, a layer applied twice) once,
            # with how many places it stands for
            places: dict[tuple, list[Miss]] = {}
            for m in self.misses:
                places.setdefault((m.pattern, m.reason, m.source) if m.source else (id(m),), []).append(m)
            for same in places.values():
                m = same[0]
                times = f" ({len(same)} places)" if len(same) > 1 else ""
                lines.append(f"  {m.pattern.ljust(width)}  {m.reason}{times}")
                if m.source:
                    lines.append(f"{indent}at {m.source}")
                if m.where and (verbose or not m.source):
                    lines.append(f"{indent}graph nodes: {', '.join(x.where for x in same if x.where)}")
        if self.graphs == 1 and not self.fusions and all(m.pattern == "hecate" for m in self.misses) \
                and not self.graph_breaks:  # (a miss of "hecate" is the pipeline's own note, of no pattern)
            lines.append("(the report of one graph: where Dynamo splits a call into several graphs, as a training "
                         "step's optimizer step or a graph break does, each has its own report; "
                         "hecate.explain(fn, *args) reports them all)")
        if self.graph_breaks:
            lines += ["", "Dynamo graph breaks (each piece is compiled as its own graph: a pattern split across "
                      "pieces cannot be fused):"]
            lines += [f"  {reason}" for reason in self.graph_breaks]
            lines += [f"  {hint}" for text, hint in _BREAK_HINTS.items() if any(text in r for r in self.graph_breaks)]
            if not self.graphs:
                lines += ["  Dynamo compiled no graph: it ran the code eagerly around these breaks (a break inside a "
                          "loop does this, and one inside a torch.utils.checkpoint region or a torch.cond branch, "
                          "which Dynamo then runs whole as Python), so nothing in it was fused; move the break "
                          "(graph_break(), print, .item(), float(tensor)) out of the loop or region"]
        return "\n".join(lines)


# what a user can do about a graph break Dynamo names, where a fusion depends on it
_BREAK_HINTS = {
    "torch.autograd.grad": "torch.autograd.grad is not traced (torch._dynamo.config.trace_autograd_ops is off): a "
                           "step that follows the gradient of a loss runs eagerly; write the gradient in closed "
                           "form: for a memory's ‖M k − v‖², 2 (M k − v) kᵀ (p·|e|^(p−1)·sign(e) kᵀ for the l_p "
                           "loss), and the loop fuses as memory_scan; for a Q-flow's free energy, ∂F/∂μ written "
                           "with the β-weighted mean differences Σ_j β_ij (μ_i − μ_j)/σ²_j, and each step fuses "
                           "as kl_attention",
}


_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep  # torch's own frames


def source_line(nodes: Iterable[Any]) -> str:
    """``file:line: code`` of the innermost user frame of the first node that has a stack trace.

    Dynamo records each node's Python stack (``node.meta["stack_trace"]``); its last
    ``File ..., line N`` entry outside torch itself (``torch.vmap``'s own frames come last
    inside a vmap) is the user's own line. A frame of FX's generated code (``<eval_with_key>``,
    where torch.export re-traces a scan's body) is nobody's line.
    """
    for node in nodes:
        trace = getattr(node, "meta", {}).get("stack_trace") or ""
        frames = [f for f in re.findall(r'File "([^"]+)", line (\d+), in [^\n]*\n\s*([^\n]*)', trace)
                  if not f[0].startswith("<eval_with_key>")]
        users = [f for f in frames if not f[0].startswith(_TORCH_DIR)] or frames
        if users:
            path, line, code = users[-1]
            return f"{os.path.basename(path)}:{line}: {code.strip()}"
    return ""


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for n, row in enumerate(rows):
        out.append("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        if n == 0:
            out.append("  " + "  ".join("-" * w for w in widths))
    return out
