"""``torch.compile(model, backend="hecate", options={...})`` (or ``mode=...``).

Registered as a ``torch_dynamo_backends`` entry point in ``pyproject.toml``, so it
works without ``import hecate``. Dynamo calls :func:`hecate_backend` once per
captured graph.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import pathlib
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import fx

from hecate.compiler.distributed import check_ddp_split
from hecate.compiler.logs import stage
from hecate.compiler.options import Options, parse_options
from hecate.compiler.pipeline import describe_error, fuse_or_original, warn_once
from hecate.passes.report import FusionReport

def _resolve_gaussian_kl_dispatch() -> None:
    """Resolve ``kl_divergence``'s dispatch for the diagonal-Gaussian pairs, as their first eager call would.

    The first ``kl_divergence`` of a pair of distribution types searches torch.distributions'
    registry with ``min`` over a generator, which Dynamo does not trace: the graph breaks there
    and the KL passes never see the score and its softmax together. Once resolved, the pair is a
    dictionary lookup and traces. This runs when the backend is looked up, before any tracing.
    """
    from torch.distributions import Independent, Normal, kl_divergence

    x = torch.zeros(1)
    kl_divergence(Independent(Normal(x, x + 1), 1), Independent(Normal(x, x + 1), 1))  # and Normal, Normal


_resolve_gaussian_kl_dispatch()

# One report per graph compiled in this process, newest last (see last_report()).
_REPORTS: list[FusionReport] = []


def hecate_backend(gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor],
                   options: Mapping[str, Any] | None = None, mode: str | None = None) -> Callable:
    """Fuse Hecate's patterns in ``gm`` and compile the rest with the fallback.

    ``mode`` is ``torch.compile``'s (it passes it to the backend when given instead of
    ``options``): Inductor compiles the rest in that mode ("max-autotune", "reduce-overhead"...).
    """
    import hecate.lowering  # noqa: F401  registers torch.ops.hecate.*

    opts = parse_options(options)
    mode_config = {}
    if mode is not None:
        from torch._inductor import list_mode_options

        mode_config = list_mode_options(mode)  # raises for a mode Inductor does not know
    with _saved_tensors_hooks_paused():
        aten_gm, report = fuse_or_original(gm, example_inputs, opts)
    check_ddp_split(gm, opts, report)
    _REPORTS.append(report)
    if opts.print_report:
        print(report)
    if aten_gm is gm:
        return _compile_rest(gm, example_inputs, opts, mode_config)
    if opts.fallback == "eager":
        return _outputs_as_dynamo_gave(aten_gm, gm)
    try:
        return _compile_rest(aten_gm, example_inputs, opts, {**_FUSED_GRAPH_CONFIG, **mode_config})
    except torch._dynamo.exc.RestartAnalysis:
        raise  # Dynamo asks to trace again (e.g. Inductor tensorifying a float): a request, not a failure
    except Exception as e:  # the fused graph must never cost the user the compile
        if opts.strict:
            raise
        reason = (f"internal error compiling the fused graph with {opts.fallback}: {describe_error(e)}; "
                  "the graph is compiled as Dynamo captured it, without fusions")
        report.add_miss("hecate", reason)
        warn_once("fallback compile", e, reason)
        return _compile_rest(gm, example_inputs, opts, mode_config)


# Inductor settings for a graph with Hecate's ops. A cat whose inputs Inductor computes into the cat's buffer (the
# fused ops join the tensors β weighs into one operand) leaves those inputs as strided views of it; one saved for
# the backward under dynamic shapes then had its stride fixed at the first size (42 for 7·6), and the backward
# failed at the next size ("expected size 4==4, stride 30==42"). A pointwise cat writes a buffer of its own.
_FUSED_GRAPH_CONFIG = {"force_pointwise_cat": True}


def _outputs_as_dynamo_gave(aten_gm: fx.GraphModule, gm: fx.GraphModule) -> Callable:
    """``aten_gm`` run as it is (the eager fallback), each output that is a view where Dynamo's own graph gave a
    tensor of its own returned as one (a copy). The fused graph's outputs are views eager's are not: the memory a
    fused loop returns is a reshape of one of the op's outputs, a qk chain's φ a transpose where the user's code made
    a new tensor after it. The caller may write into what eager gives it (M.add_(1), S.detach_() between
    truncated-backpropagation chunks), which autograd refuses on such a view."""
    outputs = list(gm.graph.output_node().args[0])
    own = [not _is_view(o.meta.get("example_value")) if isinstance(o, fx.Node) else False for o in outputs]
    if not any(own):
        return aten_gm

    def run(*args):
        results = aten_gm(*args)
        if not isinstance(results, (tuple, list)) or len(results) != len(own):
            return results
        return type(results)(r.clone() if mine and isinstance(r, torch.Tensor) and r._is_view() else r
                             for r, mine in zip(results, own))

    return run


def _is_view(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value._is_view()


def _saved_tensors_hooks_paused():
    """The user's saved-tensor hooks do not see the passes' tracing (fake tensors that require grad save
    some): a first call inside ``torch.utils.checkpoint`` would otherwise save more tensors than its
    recomputation does, a ``CheckpointError`` in backward. Dynamo pauses them so for its own tracing."""
    pause = getattr(torch._dynamo.utils, "_disable_saved_tensors_hooks_during_tracing", contextlib.nullcontext)
    return pause()


def _compile_rest(gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor], opts: Options,
                  mode_config: Mapping[str, Any]) -> Callable:
    if opts.fallback == "eager":
        return gm
    from torch._inductor.compile_fx import compile_fx

    # Inductor's on-disk caches do not see changes to Hecate's ops and decompositions;
    # tagging the cache key with Hecate's source keeps a stale artifact from being reused.
    with stage("fallback compile (inductor)", opts.progress), \
            torch.compiler.config.patch(cache_key_tag=f"hecate-{_source_hash()}"):
        return compile_fx(gm, list(example_inputs), config_patches=dict(mode_config) or None)


@functools.cache
def _source_hash() -> str:
    package = pathlib.Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def last_report() -> FusionReport:
    """The fusion report of the graph the hecate backend compiled most recently."""
    if not _REPORTS:
        raise RuntimeError("the hecate backend has not compiled a graph yet in this process: call the "
                           "torch.compile'd model first; where Dynamo hands it no graph (the code broken inside its "
                           "loop, or at its start, runs eagerly), hecate.explain(model, *args) says why")
    return _REPORTS[-1]
