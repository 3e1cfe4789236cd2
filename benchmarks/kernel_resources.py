"""Registers and spilled bytes per thread of the KL attention kernels, compiled for sm_90 without a GPU.

A stack frame in these kernels (they make no calls) is registers spilled to local memory, reloaded
in every iteration that touches them: the first thing to look at when a kernel is far slower than
its arithmetic. For each FEP width K (row values 3K+1, column values 2(3K+1)) this compiles every
kernel at the tiles and warps ``hecate.lowering.kl_attention.op`` launches it with, and the backward
kernels also at the forward's tiles with 4 warps (how they were launched before 2026-11-26, for
comparison; the column kernel then also summed over query-major tiles, which spilled 9.8 KB per
thread at K = 16 and 14.2 KB at K = 64 at that launch).

    python3 benchmarks/kernel_resources.py [--ks 8,16,64]

Writes results/kernel_resources-sm90.json. Needs Triton's NVIDIA backend (bundled with the pip
wheel), not a GPU; do not set TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import triton

from hecate.lowering.kl_attention import kernels
from hecate.lowering.kl_attention import op
from hecate.testing import kernel_resources, kernel_signature

SCALARS = dict(N="i32", K="i32", DV="i32", DW="i32", neg_inv_kappa="fp32")


def _resources(kernel, constexprs, num_warps):
    types = {n: "*fp32" for n in kernel.arg_names if n.endswith("_ptr")} | \
        {n: t for n, t in SCALARS.items() if n in kernel.arg_names}
    return kernel_resources(kernel, kernel_signature(kernel, constexprs, types), constexprs, num_warps)


def measure(k: int) -> list[dict]:
    dv, dw = 3 * k + 1, 2 * (3 * k + 1)
    widths = dict(BLOCK_D=op._block(k), BLOCK_V=op._block(dv), BLOCK_W=op._block(dw))
    masks = dict(CAUSAL=True, MASK_DIAGONAL=False)
    forward = {"num_warps": 4} | op.forward_launch(k)
    backward = {"num_warps": 4} | op.backward_launch()
    launches = [("forward", forward, ("_fwd_rows", "_fwd_cols")),
                ("backward", backward, ("_bwd_col_values", "_bwd_rows", "_bwd_cols")),
                ("backward at the forward's tiles, 4 warps (the launch before)", forward,
                 ("_bwd_col_values", "_bwd_rows", "_bwd_cols"))]
    extra = {"_fwd_rows": dict(HAS_V=True, BLOCK_V=widths["BLOCK_V"]), "_fwd_cols": dict(BLOCK_W=widths["BLOCK_W"]),
             "_bwd_col_values": dict(BLOCK_W=widths["BLOCK_W"])}
    values = dict(HAS_V=True, HAS_W=True, BLOCK_V=widths["BLOCK_V"], BLOCK_W=widths["BLOCK_W"])
    extra["_bwd_rows"] = values | dict(KAPPA_GRAD=False)  # a number κ: no per-row sums for its gradient
    rows = []
    for launch, config, names in launches:
        for name in names:
            tiles = {key: v for key, v in config.items() if key != "num_warps"}
            constexprs = masks | tiles | dict(BLOCK_D=widths["BLOCK_D"]) | extra.get(name, values)
            used = _resources(getattr(kernels, name), constexprs, config["num_warps"])
            rows.append(dict(K=k, launch=launch, kernel=name, BLOCK_M=tiles["BLOCK_M"], BLOCK_N=tiles["BLOCK_N"],
                             num_warps=config["num_warps"], **used))
            print(f"K={k:3d} {launch:52s} {name:16s} {tiles['BLOCK_M']}x{tiles['BLOCK_N']} "
                  f"warps {config['num_warps']}: {used['registers']} registers, {used['stack_bytes']} B stack",
                  flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ks", default="8,16,64", help="FEP embedding widths K, comma-separated")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        parser.error("unset TRITON_INTERPRET: this compiles the kernels for a GPU")
    rows = [row for k in args.ks.split(",") for row in measure(int(k))]
    out = Path(__file__).parent / "results" / "kernel_resources-sm90.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": "kernel_resources",
        "environment": {"target": "cuda sm_90 (compiled, not run)", "torch": torch.__version__,
                        "triton": triton.__version__, "date": time.strftime("%Y-%m-%d %H:%M")},
        "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
