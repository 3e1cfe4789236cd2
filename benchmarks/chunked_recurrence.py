"""The chunked CPU form of the linear recurrences vs the per-token CPU loop vs the eager loop.

Two ops, each in the form the op picks at T >= 64 (chunked) and in the per-token CPU loop it ran
before (the same op with ``chunked.MIN_T`` out of reach), side by side in one run:
``hecate.memory_scan`` at p = 2 (the gated delta rule) and causal ``hecate.linear_attention`` (gated,
not normalised). "eager" is the plain per-token loop reference (``memory_scan_naive``,
``linear_attention_naive``) under autograd. B = 2, H = 16 (B·H = 32), d_k = d_v = d, fp32.

Every time is the median of a few calls (the machine may be shared: the repeats and the cap on
seconds per measurement are in the JSON). The eager loop runs at T <= 1024 only (the JSON says so).

    PYTHONPATH=. python3 benchmarks/chunked_recurrence.py [--quick] [--threads 1]

Writes results/chunked_recurrence-cpu.json and two PNGs beside it (forward; forward+backward).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (forward_backward, forward_only, median_time, plot_bars, result_path,  # noqa: E402
                    write_json)

import hecate.lowering  # noqa: E402,F401
from hecate.lowering.linear_attention.naive import linear_attention_naive  # noqa: E402
from hecate.lowering.memory_scan import chunked  # noqa: E402
from hecate.lowering.memory_scan.naive import memory_scan_naive  # noqa: E402

B, H = 2, 16
EAGER_MAX_T = 1024          # the eager loop under autograd: one Python step per token (minutes beyond)


def inputs(op, T, d, requires_grad):
    g = torch.Generator().manual_seed(0)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, d, generator=g), dim=-1)
    v = torch.randn(B, T, H, d, generator=g)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, d, generator=g), dim=-1)
    if op == "memory_scan":
        alpha = torch.sigmoid(torch.randn(B, T, H, generator=g) - 3)       # forget rate
        eta = 0.3 * torch.sigmoid(torch.randn(B, T, H, generator=g))
        tensors = (k, v, q, alpha, eta, torch.zeros(B, H, d, d))
    else:
        keep = torch.sigmoid(torch.randn(B, T, H, generator=g) + 3)
        tensors = (k, v, q, keep, torch.zeros(B, H, d, d))
    return [x.requires_grad_(requires_grad) for x in tensors]


def op_call(op):
    """(y, m_final) of the op (the CPU path picks the form)."""
    if op == "memory_scan":
        return lambda k, v, q, alpha, eta, m0: torch.ops.hecate.memory_scan(k, v, q, alpha, eta, m0, None)[:2]
    return lambda k, v, q, keep, m0: torch.ops.hecate.linear_attention(k, v, q, keep, m0, None, False, 1e-6,
                                                                       True)[:2]


def eager_call(op):
    if op == "memory_scan":
        return lambda *x: memory_scan_naive(*x)[:2]
    return lambda k, v, q, keep, m0: linear_attention_naive(k, v, q, keep, m0)[:2]


class per_token:
    """The op with the chunked form out of reach: the per-token CPU loop it ran before."""

    def __enter__(self):
        self.min_t, chunked.MIN_T = chunked.MIN_T, 10**12

    def __exit__(self, *exc):
        chunked.MIN_T = self.min_t


def run(args):
    torch.set_num_threads(args.threads)
    lengths = [128] if args.quick else [1024, 4096, 16384]  # --quick: two chunks of 64
    dims = [32] if args.quick else [64, 128]
    labels, series = [], {mode: {"chunked": [], "per-token loop": [], "eager loop": []}
                          for mode in ("forward", "forward+backward")}
    rows = []
    for op in ("memory_scan", "linear_attention"):
        for d in dims:
            for T in lengths:
                row = {"op": op, "B": B, "H": H, "T": T, "d_k": d, "d_v": d}
                for mode, builder in (("forward", forward_only), ("forward+backward", forward_backward)):
                    x = inputs(op, T, d, requires_grad=mode != "forward")
                    res = {"chunked_ms": median_time(builder(op_call(op), x), "cpu", warmup=1,
                                                     repeat=args.repeat, max_seconds=args.max_seconds)}
                    with per_token():   # slow: no warm-up call (no compile or cache to warm)
                        res["per_token_ms"] = median_time(builder(op_call(op), x), "cpu", warmup=0,
                                                          repeat=args.repeat, max_seconds=args.max_seconds)
                    res["speedup_vs_per_token"] = res["per_token_ms"] / res["chunked_ms"]
                    if T > EAGER_MAX_T:
                        res["eager_ms"] = None
                        res["eager_note"] = f"skipped: the eager loop takes minutes at T > {EAGER_MAX_T}"
                    else:
                        res["eager_ms"] = median_time(builder(eager_call(op), x), "cpu", warmup=0,
                                                      repeat=args.repeat, max_seconds=args.max_seconds)
                        res["speedup_vs_eager"] = res["eager_ms"] / res["chunked_ms"]
                    row[mode] = res
                    for name, key in (("chunked", "chunked_ms"), ("per-token loop", "per_token_ms"),
                                      ("eager loop", "eager_ms")):
                        series[mode][name].append(res[key])
                    print(f"{op} d={d} T={T} {mode}: {res}", flush=True)
                labels.append(f"{op} d={d} T={T}")
                rows.append(row)

    payload = {
        "shapes": {"B": B, "H": H, "T": lengths, "d": dims, "dtype": "float32"},
        "threads": args.threads,
        "timing": {"statistic": "median", "repeat": args.repeat, "max_seconds_per_measurement": args.max_seconds,
                   "warmup_calls": {"chunked": 1, "per_token": 0, "eager": 0}},
        "notes": [
            f"chunked: the op as it runs at T >= {chunked.MIN_T} (chunk C = {chunked.CHUNK}); per-token: the same "
            "op with chunked.MIN_T out of reach (the CPU loop it ran before); eager: the plain loop reference "
            "under autograd",
            "memory_scan: p = 2, data-dependent forget rate and step, m0 = 0; linear_attention: causal, gated "
            "keep, not normalised, m0 = 0",
            "a measurement stops repeating once it has spent max_seconds (then fewer than `repeat` calls)",
            f"skipped: eager beyond T = {EAGER_MAX_T} (minutes per call)",
        ],
        "results": rows,
    }
    path = write_json("chunked_recurrence", "cpu", payload, quick=args.quick)
    png = result_path("chunked_recurrence", "cpu", "png", quick=args.quick)
    plot_bars(png, f"chunked vs per-token CPU forms, forward; B·H={B * H}, {args.threads} thread(s)", labels,
              series["forward"])
    plot_bars(png.replace(".png", "-fwd-bwd.png"),
              f"chunked vs per-token CPU forms, forward+backward; B·H={B * H}, {args.threads} thread(s)", labels,
              series["forward+backward"])
    print(f"wrote {path}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a smoke run: T = 128, d = 32")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (default 1)")
    parser.add_argument("--repeat", type=int, default=3, help="calls per measurement (the median is reported)")
    parser.add_argument("--max-seconds", type=float, default=20.0,
                        help="stop repeating a measurement once it has spent this long")
    run(parser.parse_args())
