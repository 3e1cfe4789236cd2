"""Which tiles and warps the ``hecate.kl_attention`` kernels should launch with, timed on a GPU.

The op's launches (``op.forward_launch``, ``op.backward_launch``) were chosen from register counts
compiled for sm_90 (``benchmarks/kernel_resources.py``), not from timings. This times the forward op
and the backward op alone, at the FEP transformer's widths (row values 3K+1, column values 3K+1),
causal, for each candidate launch, and writes ``results/kl_attention_tiles-<device>.json`` after
every row (a run stopped at its time limit keeps what it measured). The op's current launch is timed
first; a launch that fits the GPU's shared memory at no pipelining depth is recorded as such (the op
would run its matmul form there).

    PYTHONPATH=. python3 benchmarks/kl_attention_tiles.py [--n 1024] [--ks 16,64]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import environment, median_time, result_path  # noqa: E402
from hecate.lowering.dispatch import triton_on_cpu  # noqa: E402
from hecate.lowering.kl_attention import op  # noqa: E402

# (BLOCK_M, BLOCK_N, warps); the pipelining depth is the deepest that fits the GPU's shared memory (op._launch)
FORWARD = [(16, 16, 4), (32, 16, 4), (16, 32, 4), (32, 16, 8), (16, 16, 8), (32, 32, 4)]
BACKWARD = [(16, 16, 4), (16, 16, 8), (32, 16, 4), (16, 32, 4), (16, 16, 2)]


def _inputs(n: int, k: int, device: str):
    g = torch.Generator(device=device).manual_seed(0)
    mu = torch.randn(1, n, k, device=device, generator=g)
    var = torch.rand(1, n, k, device=device, generator=g) + 0.5
    width = 3 * k + 1
    rv = torch.randn(1, n, width, device=device, generator=g)
    cv = torch.randn(1, n, width, device=device, generator=g)
    return mu, var, rv, cv


def _rel_err(a, b) -> float:
    """‖a − b‖/‖b‖ over all outputs together: a launch must compute what the current one does."""
    a = torch.cat([t.flatten().double() for t in a])
    b = torch.cat([t.flatten().double() for t in b])
    return ((a - b).norm() / b.norm()).item()


def _time(fn, device: str, repeat: int) -> float | str:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # the op's warning that it ran the matmul form instead
            return median_time(fn, device, repeat=repeat)
    except (Exception, RuntimeWarning) as error:  # a launch that does not compile or fit is a result too
        return f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--n", type=int, default=1024)
    parser.add_argument("--ks", default="16,64")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--launches", default="",
                        help="only these launches, comma-separated STAGE:MxNxWARPS (e.g. backward:32x16x4); "
                             "default: every candidate")
    args = parser.parse_args()
    if args.device != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("the kernels run on CUDA, or on the CPU with TRITON_INTERPRET=1 (a smoke run)")
    out = result_path("kl_attention_tiles", args.device, "json")
    record = dict(benchmark="kl_attention_tiles", environment=environment(args.device),
                  what=f"hecate.kl_attention forward op and backward op alone, B = 1, N = {args.n}, causal, "
                       "row and column values of width 3K+1; median ms", rows=[])
    current_forward, current_backward = op.forward_launch, op.backward_launch
    args.launches = _parse_launches(args.launches, parser)
    with triton_on_cpu() if args.device == "cpu" else contextlib.nullcontext():
        _sweep(args, record, out, current_forward, current_backward)
    print(f"wrote {out}")


def _parse_launches(text: str, parser) -> set | None:
    """'backward:32x16x4,...' → {('backward', 32, 16, 4), ...}; None (every launch) for ''."""
    if not text:
        return None
    launches = set()
    for item in text.split(","):
        stage, _, sizes = item.partition(":")
        try:
            bm, bn, warps = (int(x) for x in sizes.split("x"))
        except ValueError:
            parser.error(f"--launches: got {item!r}, expected STAGE:MxNxWARPS such as backward:32x16x4")
        if stage not in ("forward", "backward"):
            parser.error(f"--launches: got stage {stage!r} in {item!r}, expected forward or backward")
        launches.add((stage, bm, bn, warps))
    return launches


def _sweep(args, record, out, current_forward, current_backward):
    for k in (int(k) for k in args.ks.split(",")):
        mu, var, rv, cv = _inputs(args.n, k, args.device)
        run = dict(kappa=1.0, causal=True, mask_diagonal=False)
        outputs = torch.ops.hecate.kl_attention(mu, var, rv, cv, **run)
        grads = [torch.randn_like(o) for o in outputs]
        calls = dict(forward=lambda: torch.ops.hecate.kl_attention(mu, var, rv, cv, **run),
                     backward=lambda: torch.ops.hecate.kl_attention_backward(
                         mu, var, rv, cv, outputs[0], outputs[1], outputs[2], outputs[6], *grads, **run))
        reference = {stage: call() for stage, call in calls.items()}
        for stage, candidates in (("forward", FORWARD), ("backward", BACKWARD)):
            current = current_forward(k) if stage == "forward" else current_backward()
            current = (current["BLOCK_M"], current["BLOCK_N"], current.get("num_warps", 4))
            for bm, bn, warps in [current] + [c for c in candidates if c != current]:
                if args.launches is not None and (stage, bm, bn, warps) not in args.launches:
                    continue
                launch = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps)
                op.forward_launch = (lambda _k: launch) if stage == "forward" else current_forward
                op.backward_launch = (lambda: launch) if stage == "backward" else current_backward
                ms = _time(calls[stage], args.device, args.repeat)
                error = _rel_err(calls[stage](), reference[stage]) if isinstance(ms, float) else None
                record["rows"].append(dict(K=k, stage=stage, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, ms=ms,
                                           rel_err_vs_current=error))
                print(f"K={k:3d} {stage:8s} {bm}x{bn} warps {warps}: {ms} ms, rel. err. {error}", flush=True)
                with open(out, "w") as f:
                    json.dump(record, f, indent=1)
        op.forward_launch, op.backward_launch = current_forward, current_backward


if __name__ == "__main__":
    main()
