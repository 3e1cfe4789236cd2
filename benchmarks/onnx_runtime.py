"""One memory model exported three ways, run in onnxruntime on CPU: Scan vs opset 27's fused operators.

The models are ``hecate.models.memory.LpMemory`` at p = 2 (data-dependent α, fixed η; the memory becomes
``LinearAttention(gated_delta)``) and ``HebbianMemory`` (gated, normalised; ``LinearAttention(gated)``),
whole layers: projections, short conv + SiLU + φ, the recurrence (written with torch's ``scan``, which
``torch.export`` keeps rolled at any T; the Python-loop form is unrolled T times by the export and
costs minutes at T = 1024), the output projection. Each is
exported by ``hecate.export_onnx`` at every T (the files have static shapes):

* ``scan``: ``opset_version=18``, the recurrence as one ONNX ``Scan``, the conv as ``Conv``;
* ``onnx27``: opset 27, the ONNX-domain ``LinearAttention`` / ``CausalConvWithState`` (onnxruntime 1.32
  has no kernel for the ONNX-domain LinearAttention: it runs the operator's ONNX function, a Scan);
* ``ort_kernel``: opset 27 with ``fused_domain="com.microsoft"``, onnxruntime's native kernels of the
  same operators.

Each file runs in one ``InferenceSession`` (CPUExecutionProvider, ``--threads`` intra-op threads) on the
same input; the JSON records the median time per call, the relative error of each output against
PyTorch, and the environment (device, versions, shapes).

``--models memory_scan_op,linear_attention_op`` times the fused op alone on already-projected inputs
(unit-norm keys, k, v, q [B, T, H, d]), which is what the operators replace.

    PYTHONPATH=. python3 benchmarks/onnx_runtime.py [--quick] [--lengths 256,1024,4096,8192]
    PYTHONPATH=. python3 benchmarks/onnx_runtime.py --models memory_scan_op,linear_attention_op --name onnx_runtime-ops

Writes results/<name>-cpu.json and a PNG beside it (``--quick``: <name>-quick-cpu.*, git-ignored).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RESULTS, plot_bars, write_json  # noqa: E402

import hecate  # noqa: E402
import hecate.lowering  # noqa: E402,F401  (registers torch.ops.hecate.*)
from hecate.models.memory import HebbianMemory, LpMemory  # noqa: E402

FORMS = {"scan": dict(opset_version=18), "onnx27": dict(), "ort_kernel": dict(fused_domain="com.microsoft")}


class RecurrenceOnly(torch.nn.Module):
    """The fused op alone on already-projected inputs: what the operator replaces, without the layers' matmuls."""

    def __init__(self, op: str):
        super().__init__()
        self.op = op

    def forward(self, k, v, q, alpha, eta, m0):
        if self.op == "memory_scan":  # p = 2, no momentum: LinearAttention(gated_delta)
            return torch.ops.hecate.memory_scan(k, v, q, alpha, eta, m0, None, 2.0, 10.0, 1e-6, 0.0, 2.0)
        return torch.ops.hecate.linear_attention(k, v, q, alpha, m0, None, False, 1e-6, True)[:2]  # gated


def make_inputs(name: str, T: int, args) -> tuple:
    if name not in ("memory_scan_op", "linear_attention_op"):
        return (torch.randn(args.batch, T, args.d_model) * 0.5,)
    B, H, d = args.batch, args.heads, args.d_head
    k = torch.nn.functional.normalize(torch.randn(B, T, H, d), dim=-1)
    return (k, torch.randn(B, T, H, d), torch.randn(B, T, H, d), torch.rand(B, T, H) * 0.1, torch.rand(B, T, H) * 0.4,
            torch.zeros(B, H, d, d))


def make_model(name: str, d_model: int, heads: int, d_head: int) -> torch.nn.Module:
    torch.manual_seed(0)
    if name in ("memory_scan_op", "linear_attention_op"):
        return RecurrenceOnly(name.removesuffix("_op"))
    if name == "lp_memory_p2":
        # a fixed step η = 1/(4 d): 2η‖φ(k)‖² stays below 2 so the memory does not diverge at long T
        return LpMemory(d_model, n_heads=heads, d_k=d_head, d_v=d_head, p=2.0, alpha=None, eta=1 / (4 * d_head),
                        phi="elu1", use_scan=True).eval()
    return HebbianMemory(d_model, n_heads=heads, d_k=d_head, d_v=d_head, alpha=None, normalise=True,
                         use_scan=True).eval()


def call_times(fn, repeat: int, max_seconds: float) -> list[float]:
    """Milliseconds of each of ``repeat`` calls after one warm-up (fewer past ``max_seconds``).

    Both the median and the minimum are reported: on a shared machine the minimum is the steadier.
    """
    fn()
    times, start = [], time.perf_counter()
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
        if time.perf_counter() - start > max_seconds:
            break
    return times


def bench_cell(name: str, T: int, args, workdir: str) -> dict:
    import onnxruntime as ort

    model = make_model(name, args.d_model, args.heads, args.d_head)
    inputs = make_inputs(name, T, args)
    with torch.no_grad():
        reference = model(*inputs)
    cell = {"model": name, "T": T}
    for form, export_kwargs in FORMS.items():
        path = os.path.join(workdir, f"{name}-{T}-{form}.onnx")
        report = hecate.export_onnx(model, inputs, path, **export_kwargs)
        options = ort.SessionOptions()
        options.intra_op_num_threads = args.threads
        session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        feeds = {i.name: x.numpy() for i, x in zip(session.get_inputs(), inputs)}
        outputs = session.run(None, feeds)
        errors = [float((torch.from_numpy(o) - r).norm() / r.norm()) for o, r in zip(outputs, reference)]
        times = call_times(lambda: session.run(None, feeds), args.repeat, args.max_seconds)
        cell[form] = {"ms": statistics.median(times), "min_ms": min(times), "calls": len(times),
                      "rel_err_vs_pytorch": errors, "forms": [f"{f.op}: {f.form}" for f in report.onnx_forms]}
        print(f"{name} T={T} {form}: median {cell[form]['ms']:.2f} ms, min {min(times):.2f} ms "
              f"(rel err {max(errors):.1e})", flush=True)
    for form in ("onnx27", "ort_kernel"):
        cell[form]["speedup_vs_scan"] = cell["scan"]["ms"] / cell[form]["ms"]
    return cell


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="T = 64 only, to a git-ignored file")
    parser.add_argument("--lengths", default="256,1024,4096,8192")
    parser.add_argument("--models", default="lp_memory_p2,hebbian",
                        help="layers lp_memory_p2, hebbian; the recurrence alone: memory_scan_op, linear_attention_op")
    parser.add_argument("--name", default="onnx_runtime", help="results/<name>-cpu.json")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--d-head", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1,
                        help="onnxruntime intra-op threads (default 1: on a shared machine more threads are noise)")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--max-seconds", type=float, default=10.0, help="stop repeating a cell after this long")
    args = parser.parse_args()
    import onnx
    import onnxruntime

    lengths = [64] if args.quick else [int(t) for t in args.lengths.split(",")]
    with tempfile.TemporaryDirectory() as workdir:
        cells = [bench_cell(name, T, args, workdir) for name in args.models.split(",") for T in lengths]
    name = f"{args.name}-quick" if args.quick else args.name
    path = write_json(name, "cpu", {
        "versions": {"onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__},
        "shapes": {"batch": args.batch, "d_model": args.d_model, "heads": args.heads, "d_k": args.d_head,
                   "d_v": args.d_head, "lengths": lengths},
        "threads": args.threads,
        "forms": {"scan": "opset 18: the recurrence as one ONNX Scan, the conv as Conv",
                  "onnx27": "opset 27: ONNX-domain LinearAttention / CausalConvWithState (onnxruntime 1.32 runs "
                            "LinearAttention as its ONNX function, a Scan)",
                  "ort_kernel": "opset 27, fused_domain='com.microsoft': onnxruntime's native kernels"},
        "cells": cells})
    labels = [f"{c['model']} T={c['T']}" for c in cells]
    plot_bars(os.path.join(RESULTS, f"{name}-cpu.png"), "onnxruntime CPU: Scan vs fused operators", labels,
              {form: [c[form]["ms"] for c in cells] for form in FORMS})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
