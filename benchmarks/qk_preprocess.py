"""Key/query preprocessing: projection → depthwise causal conv1d → SiLU → ELU+1, eager vs Inductor vs Hecate.

    PYTHONPATH=. python3 benchmarks/qk_preprocess.py            # CPU (or CUDA when present), realistic shapes
    PYTHONPATH=. python3 benchmarks/qk_preprocess.py --quick    # tiny shapes: the compiles dominate

Times, side by side in one run, the forward and forward+backward (gradients of every parameter) of one
plain-PyTorch block compiled three ways: eager, ``torch.compile`` (Inductor), ``torch.compile(backend="hecate")``
(the chain replaced by ``torch.ops.hecate.qk_preprocess``, the rest by Inductor). On CUDA it also times the
unfused sequence run op by op (cuBLAS matmul, then conv, SiLU and φ as separate kernels) and the memory bound:
a plain copy moving the same bytes as reading x once and writing the output once.
Writes ``results/qk_preprocess-<device>.json`` and a plot beside it (``--quick``: under the git-ignored
``results/quick/``).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import hecate  # noqa: E402
from benchmarks.common import (median_time, peak_memory_mb, plot_bars, result_path, warm_compilers,  # noqa: E402
                               write_json)

# phi "elu1": elementwise ELU+1 on [B, T, D]; "performer": FAVOR+ features per head of 64 channels, d_phi = 128
CONFIGS = [dict(B=8, T=2048, D=1024, K=4, phi="elu1"), dict(B=4, T=512, D=256, K=4, phi="elu1"),
           dict(B=4, T=512, D=256, K=4, phi="performer")]
# --quick: one odd shape per φ kind (pointwise, matrix), enough to run every code path once
QUICK_CONFIGS = [dict(B=1, T=37, D=48, K=3, phi="elu1"), dict(B=2, T=64, D=128, K=4, phi="performer")]
HEAD_DIM, PERFORMER_FEATURES = 64, 128


class QKPreprocess(nn.Module):
    """k = φ(silu(causal_conv(W x))) as a researcher writes it (spec: short-causal-conv.md, feature-maps-phi.md)."""

    def __init__(self, d: int, kernel_size: int, phi: str):
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.conv = nn.Conv1d(d, d, kernel_size, groups=d, padding=kernel_size - 1)
        self.phi = phi
        if phi == "performer":
            self.register_buffer("w_rand", torch.randn(PERFORMER_FEATURES, HEAD_DIM))

    def features(self, k: torch.Tensor) -> torch.Tensor:
        if self.phi == "elu1":
            return F.elu(k) + 1
        heads = k.unflatten(-1, (-1, HEAD_DIM))                     # [B, T, H, Dh]
        sq_norm = heads.square().sum(dim=-1, keepdim=True) / 2
        return (torch.exp(heads @ self.w_rand.T - sq_norm) / math.sqrt(PERFORMER_FEATURES)).flatten(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[1]
        k = self.proj(x)                                            # [B, T, D]
        k = self.conv(k.transpose(1, 2))[..., :T].transpose(1, 2)    # causal: keep the first T outputs
        return self.features(F.silu(k))


def unfused_ops(model: QKPreprocess, x: torch.Tensor) -> torch.Tensor:
    """The same chain as separate library calls: cuBLAS matmul, cuDNN conv, SiLU, φ."""
    T = x.shape[1]
    u = torch.addmm(model.proj.bias, x.flatten(0, 1), model.proj.weight.t()).view(*x.shape[:2], -1)
    z = F.conv1d(u.transpose(1, 2), model.conv.weight, model.conv.bias, padding=model.conv.padding,
                 groups=model.conv.groups)[..., :T].transpose(1, 2)
    return model.features(F.silu(z))


def bench_shape(shape: dict, device: str, dtype: torch.dtype, repeat: int) -> dict:
    B, T, D, K = shape["B"], shape["T"], shape["D"], shape["K"]
    model = QKPreprocess(D, K, shape["phi"]).to(device=device, dtype=dtype)
    x = torch.randn(B, T, D, device=device, dtype=dtype)
    with torch.no_grad():
        grad = torch.randn_like(model(x))
    repeat = max(3, repeat)
    row: dict = {"shape": shape, "dtype": str(dtype).replace("torch.", ""), "forward_ms": {}, "train_ms": {},
                 "compile_s": {}}

    report = hecate.explain(model, x)
    row["hecate_fusions"] = [f"{f.pattern}: {f.detail}" for f in report.fusions]
    row["hecate_misses"] = [f"{m.pattern}: {m.reason}" for m in report.misses]

    def train_step(fn):
        def step():
            for p in model.parameters():
                p.grad = None
            fn(x).backward(grad)
        return step

    candidates = {"eager": model}
    for name in ("inductor", "hecate"):
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=name)
        t = time.perf_counter()
        with torch.no_grad():
            compiled(x)
        train_step(compiled)()
        if device == "cuda":
            torch.cuda.synchronize()
        row["compile_s"][name] = round(time.perf_counter() - t, 2)
        candidates[name] = compiled
    row["forward_ms"] = interleaved_medians({k: no_grad_call(fn, x) for k, fn in candidates.items()}, device, repeat)
    row["train_ms"] = interleaved_medians({k: train_step(fn) for k, fn in candidates.items()}, device, repeat)

    if device == "cuda":
        with torch.no_grad():
            row["forward_ms"]["unfused_ops"] = median_time(lambda: unfused_ops(model, x), device, repeat=repeat)
            phi_params = [model.w_rand] if model.phi == "performer" else []
            op_args = (x, model.proj.weight, model.proj.bias, model.conv.weight, model.conv.bias, "silu", model.phi,
                       phi_params, 10.0)
            row["forward_ms"]["hecate_op"] = median_time(lambda: torch.ops.hecate.qk_preprocess(*op_args), device,
                                                         repeat=repeat)
            n = (x.numel() + grad.numel()) // 2       # a copy of n elements reads n and writes n
            src, dst = torch.empty(n, device=device, dtype=dtype), torch.empty(n, device=device, dtype=dtype)
            row["forward_ms"]["copy_bound"] = median_time(lambda: dst.copy_(src), device, repeat=repeat)
            row["peak_memory_mb"] = {k: peak_memory_mb(lambda: candidates[k](x), device) for k in candidates}
        row["hecate_op_over_copy_bound"] = row["forward_ms"]["hecate_op"] / row["forward_ms"]["copy_bound"]
        row["inductor_over_hecate_op"] = row["forward_ms"]["inductor"] / row["forward_ms"]["hecate_op"]
        row["unfused_ops_over_hecate_op"] = row["forward_ms"]["unfused_ops"] / row["forward_ms"]["hecate_op"]
    row["ratio_hecate_over_inductor"] = {
        "forward": row["forward_ms"]["hecate"] / row["forward_ms"]["inductor"],
        "train": row["train_ms"]["hecate"] / row["train_ms"]["inductor"],
    }
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes (seconds)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (CUDA default)")
    parser.add_argument("--repeat", type=int, default=None, help="timed calls per measurement")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads (default: torch's). On a loaded shared machine use 1: a parallel region "
                             "waits for its slowest thread, and descheduled threads stall every op")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device
    dtype = getattr(torch, args.dtype or ("bfloat16" if device == "cuda" else "float32"))
    configs = QUICK_CONFIGS if args.quick else CONFIGS
    torch._inductor.config.force_disable_caches = True  # compile times must not come from an earlier run's cache
    warm_compilers(device)
    rows = []
    for shape in tqdm(configs, desc="qk_preprocess shapes", disable=args.no_progress, dynamic_ncols=True):
        # the big shape takes seconds per step on a CPU: fewer repeats there
        big = shape["B"] * shape["T"] * shape["D"] >= 2 ** 23
        repeat = args.repeat or (3 if args.quick else 5 if big and device == "cpu" else 20)
        row = bench_shape(shape, device, dtype, repeat)
        rows.append(row)
        tqdm.write(f"{shape}: forward ms {fmt(row['forward_ms'])} | train ms {fmt(row['train_ms'])} | "
              f"hecate/inductor fwd {row['ratio_hecate_over_inductor']['forward']:.2f} "
              f"train {row['ratio_hecate_over_inductor']['train']:.2f} | fused: {row['hecate_fusions']}")
    name = "qk_preprocess"
    path = write_json(name, device, {"model": "Linear(D, D) → Conv1d(D, D, K, groups=D, padding=K-1)[..., :T] → "
                                              "SiLU → φ (phi: elu1 = ELU+1; performer = FAVOR+ per head of "
                                              f"{HEAD_DIM}, {PERFORMER_FEATURES} features)",
                                       "notes": ["compile_s: first forward and training step of a fresh compile, "
                                                 "Inductor caches disabled, after one warm-up compile per backend "
                                                 "in the process"],
                                       "rows": rows}, quick=args.quick)
    labels, series = [], {"eager": [], "inductor": [], "hecate": []}
    for row in rows:
        s = row["shape"]
        for kind in ("forward_ms", "train_ms"):
            labels.append(f"B{s['B']} T{s['T']} D{s['D']} {s['phi']} {'fwd' if kind == 'forward_ms' else 'fwd+bwd'}")
            for k in series:
                series[k].append(row[kind][k])
    plot_bars(result_path(name, device, "png", args.quick), f"qk_preprocess on {device} ({dtype})", labels, series)
    print("wrote", path)


def no_grad_call(fn, x):
    def call():
        with torch.no_grad():
            return fn(x)
    return call


def interleaved_medians(fns: dict, device: str, repeat: int, max_seconds: float = 120.0) -> dict:
    """Median ms of each fn, timed in turns (a, b, c, a, b, c, ...) so load from other processes on a
    shared machine falls on all candidates alike."""
    for fn in fns.values():
        fn()
    times = {k: [] for k in fns}
    start = time.perf_counter()
    for _ in range(repeat):
        for k, fn in fns.items():
            times[k].append(1e3 * timed(fn, device))
        if time.perf_counter() - start > max_seconds:
            break
    return {k: statistics.median(v) for k, v in times.items()}


def timed(fn, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t


def fmt(times: dict) -> str:
    return " ".join(f"{k}={v:.3g}" for k, v in times.items())


if __name__ == "__main__":
    main()
