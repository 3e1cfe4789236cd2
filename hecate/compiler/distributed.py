"""Hecate under torch.distributed: DDP's graph splitting, and the fusion reports of one rank.

Under ``DistributedDataParallel``, Dynamo's ``DDPOptimizer`` cuts each captured graph at
gradient-bucket boundaries (every ``bucket_cap_mb`` of parameters, counted from the end
of the forward) and hands the backend one piece at a time, so that each bucket's
all-reduce can start while the rest of the backward runs. A cut can fall inside a
pattern: no pass then sees it whole, and it is fused in part or not at all. Where the
cuts fall depends only on parameter sizes, so Hecate cannot move them; instead, when it
compiles the pieces of a split, it also runs its passes over the whole graph once and
reports each fusion the pieces lost, with what to change.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import operator
import sys
from typing import Iterator

import torch
from torch import fx

from hecate.compiler.options import Options
from hecate.passes.report import Fusion, FusionReport

ADVICE = ("set torch._dynamo.config.optimize_ddp = False (one graph; DDP then all-reduces after "
          "the whole backward) or a larger bucket_cap_mb")


@dataclasses.dataclass
class _Split:
    """What Hecate knows about one DDPOptimizer split while its pieces are compiled."""

    pieces: int  # how many graphs DDP cut the forward into
    whole: list[Fusion] | None  # what the passes fuse in the uncut graph (None: not known)
    fused: list[Fusion] = dataclasses.field(default_factory=list)  # what the pieces fused so far
    compiled: int = 0


def check_ddp_split(gm: fx.GraphModule, options: Options, report: FusionReport) -> None:
    """If ``gm`` is one piece of a DDP graph split, say in ``report`` which fusions the cuts cost.

    Called by the backend after fusing ``gm`` (``report`` is that piece's report). The
    comparison with the uncut graph is written into the report of the split's last piece.
    A failure to check is reported, never raised: the pieces compile as usual either way.
    """
    submod_compiler = _ddp_submod_compiler(gm)
    if submod_compiler is None:
        return
    split = getattr(submod_compiler, "_hecate_split", None)
    if split is None:  # the first piece: the other pieces are still uncompiled graphs
        try:
            whole = _fuse_whole(submod_compiler, options)
        except Exception as e:  # noqa: BLE001  a failed check must not fail the user's compile
            whole = None
            first_line = str(e).splitlines()[0] if str(e) else ""
            report.add_miss("ddp_split", "could not fuse the graph DDP split as a whole, so fusions its "
                            f"cuts cost are not reported ({type(e).__name__}: {first_line})", "DDP split")
        split = submod_compiler._hecate_split = _Split(_piece_count(submod_compiler.module), whole)
    split.compiled += 1
    split.fused.extend(report.fusions)
    if split.compiled == split.pieces and split.whole is not None:
        _report_lost_fusions(split, report)


def _ddp_submod_compiler(gm: fx.GraphModule):
    """DDPOptimizer's ``SubmodCompiler`` when ``gm`` is one of its pieces, else None.

    DDPOptimizer marks each piece with its reason for the graph break, and hands the
    backend only the piece: the graph of all pieces is on its ``SubmodCompiler`` (an FX
    Interpreter running that graph), which is up the stack while a piece compiles.
    """
    reason = getattr(gm, "compile_subgraph_reason", None)
    if "DDPOptimizer" not in str(getattr(reason, "reason", "")):
        return None
    from torch._dynamo.backends.distributed import SubmodCompiler

    frame = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, SubmodCompiler):
            return candidate
        frame = frame.f_back
    return None


def _piece_count(split_gm: fx.GraphModule) -> int:
    return sum(node.op == "call_module" for node in split_gm.graph.nodes)


def _fuse_whole(submod_compiler, options: Options) -> list[Fusion]:
    """The fusions Hecate's passes find in the graph before DDP cut it."""
    from hecate.compiler.pipeline import fuse

    split_gm = submod_compiler.module
    placeholders = [n for n in split_gm.graph.nodes if n.op == "placeholder"]
    example_inputs = [submod_compiler.env[n] for n in placeholders]
    quiet = dataclasses.replace(options, dump_dir=None, print_report=False)
    _, whole = fuse(_inline_pieces(split_gm), example_inputs, quiet)
    return whole.fusions


def _inline_pieces(split_gm: fx.GraphModule) -> fx.GraphModule:
    """One flat graph from ``split_module``'s graph of pieces (node metadata kept)."""
    flat = fx.Graph()
    env: dict[fx.Node, object] = {}
    for node in split_gm.graph.nodes:
        if node.op == "call_module":
            piece = split_gm.get_submodule(node.target)
            inputs = iter(fx.node.map_arg(node.args, env.__getitem__))
            piece_env: dict[fx.Node, fx.Node] = {}
            for inner in piece.graph.nodes:
                if inner.op == "placeholder":
                    piece_env[inner] = next(inputs)
                elif inner.op == "output":
                    env[node] = _piece_result(node, fx.node.map_arg(inner.args[0], piece_env.__getitem__))
                else:
                    copy = flat.node_copy(inner, piece_env.__getitem__)
                    if inner.op == "get_attr":  # the piece's attributes live under its name
                        copy.target = f"{node.target}.{inner.target}"
                    piece_env[inner] = copy
        elif node.op == "call_function" and node.target is operator.getitem \
                and isinstance(env[node.args[0]], (tuple, list)):
            env[node] = env[node.args[0]][node.args[1]]
        else:
            env[node] = flat.node_copy(node, env.__getitem__)
    return fx.GraphModule(split_gm, flat)


def _piece_result(call: fx.Node, outputs):
    """What the pieces' caller reads from a piece's outputs.

    DDPOptimizer rewrites a piece's single output into a 1-tuple when it compiles the piece
    (and unwraps it when calling it); the pieces' caller reads multiple outputs with ``getitem``.
    """
    if isinstance(outputs, (tuple, list)) and len(outputs) == 1 \
            and not any(user.target is operator.getitem for user in call.users):
        return outputs[0]
    return outputs


def _report_lost_fusions(split: _Split, report: FusionReport) -> None:
    lost = (collections.Counter((f.pattern, f.detail) for f in split.whole)
            - collections.Counter((f.pattern, f.detail) for f in split.fused))
    if not lost:
        return
    cap = _bucket_cap_mb()
    buckets = "buckets" if cap is None else f"buckets of bucket_cap_mb={cap:g}"
    for pattern, detail in sorted(lost.elements()):
        report.add_miss(pattern, f"DDP split the pattern across buckets: DDP's graph splitting ({buckets}) "
                        f"put parts of {detail or pattern} in different graphs, so it is fused in part "
                        f"or not at all; {ADVICE}", f"DDP split, {split.pieces} graphs")


def _bucket_cap_mb() -> float | None:
    module = torch.nn.parallel.DistributedDataParallel._get_active_ddp_module()
    return None if module is None else module.bucket_bytes_cap / 2**20


@contextlib.contextmanager
def collect_reports() -> Iterator[FusionReport]:
    """One report for every graph the hecate backend compiles inside the ``with`` block.

    Under DDP one forward can reach the backend as several graphs (DDP's graph splitting);
    this adds them up, so a rank's report says what was fused in the whole model.
    """
    from hecate.compiler import backend

    combined = FusionReport()
    first = len(backend._REPORTS)
    try:
        yield combined
    finally:
        for report in backend._REPORTS[first:]:
            combined.extend(report)
