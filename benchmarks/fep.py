"""Pure FEP transformer: spec-style eager vs Inductor vs Hecate, side by side.

Two workloads, N ∈ {256, 1024, 4096}, K ∈ {16, 64} (``--quick``: N = 64, K = 16):

* ``attention``: one Q-flow step's attention as the model writes it — ``kl_pairwise``,
  ``compute_attention`` (causal) and the alignment terms of ``compute_mu_gradient``
  (direct, product rule through β, others aligning to i with their product rule).
  Hecate turns it into one ``hecate.kl_attention`` call. The speed limit is
  ``scaled_dot_product_attention`` on the equivalent problem: queries [a_i, 1] and keys
  [b_j, d_j] of head dim 2K+1, values of width 2K (only the row pass; the op also
  makes the column pass).
* ``train_step``: forward + backward of the whole model (1 layer, 2 Q-flow steps,
  vocabulary 64, batch 1, observation term in the Q-flow), the loss backpropagated
  through the unrolled Q-flow to every prior.

On a CPU, Inductor compiles the unrolled training graph in minutes (~4 min on a shared
2-core machine), so the Inductor-compiled training step (``inductor`` and ``hecate``, whose
fallback is Inductor) is measured only at the sizes in ``--compiled-train-sizes``;
``hecate_eager`` (Hecate's fusions, the rest run eagerly: compiles in seconds) is measured
at every size.

The spec's broadcast form builds [B, N, N, K] tensors: a cell whose estimated peak
memory exceeds ``--max-gib`` is skipped and the reason written to the JSON. Times are
medians in ms; memory is the CUDA peak on a GPU (None on CPU).

    PYTHONPATH=. python3 benchmarks/fep.py [--quick] [--device cpu|cuda]
    PYTHONPATH=. python3 benchmarks/fep.py --workloads attention --sizes 1024x16,4096x16 --merge
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import device_name, median_time, peak_memory_mb, plot_bars, result_path, write_json  # noqa: E402
from hecate.models.fep import (PureFEPConfig, PureFEPTransformer, attention_mask, compute_attention,  # noqa: E402
                               compute_mu_gradient, kl_pairwise)

# live [B, N, N, K] temporaries of the broadcast form (counted in the traced graphs, rounded up)
BROADCAST_LIVE = {"attention": 8, "train_step": 48}


def attention_step(mu, sigma, mu_p, sigma_p, config):
    """One Q-flow step's attention and alignment gradient, as the model writes it."""
    mask = attention_mask(mu.shape[1], True, False, mu.device)
    kl = kl_pairwise(mu, sigma, config.eps)
    beta = compute_attention(kl, config.kappa, mask)
    return compute_mu_gradient(mu, sigma, mu_p, sigma_p, beta, kl, None, None, config)


def sdpa_equivalent(mu, sigma, config):
    """The same softmax as SDPA with head dim 2K+1 (the speed limit for the row pass)."""
    from hecate.lowering.gaussian_features import center, key_features, query_features
    var = sigma.square() + config.eps
    muc = center(mu, 1)
    a, _ = query_features(muc, var)
    b, d = key_features(muc, var)
    q = torch.cat([a, torch.ones_like(d).unsqueeze(-1)], -1).unsqueeze(1)
    k = torch.cat([b, d.unsqueeze(-1)], -1).unsqueeze(1)
    v = torch.cat([1 / var, muc / var], -1).unsqueeze(1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=-1.0 / config.kappa)


def _estimate_gib(workload, b, n, k):
    return BROADCAST_LIVE[workload] * b * n * n * k * 4 / 2**30


def bench_attention(n, k, device, impls, max_gib, repeat):
    config = PureFEPConfig(embed_dim=k, max_seq_len=n)
    gen = torch.Generator().manual_seed(0)
    mu = torch.randn(1, n, k, generator=gen).to(device)
    sigma = (0.5 + torch.rand(1, n, k, generator=gen)).to(device)
    mu_p = (0.1 * torch.randn(n, k, generator=gen)).to(device)
    sigma_p = torch.ones(n, k, device=device)
    fn = lambda m, s: attention_step(m, s, mu_p, sigma_p, config)  # noqa: E731
    return _run_impls("attention", fn, (mu, sigma), n, k, device, impls, max_gib, repeat,
                      extra={"sdpa": lambda: sdpa_equivalent(mu, sigma, config)})


def bench_train_step(n, k, device, impls, max_gib, repeat):
    config = PureFEPConfig(vocab_size=64, embed_dim=k, n_layers=1, max_seq_len=n, n_vfe_steps=2)
    torch.manual_seed(0)
    model = PureFEPTransformer(config).to(device)
    ids = torch.randint(0, 64, (1, n + 1), device=device)
    inputs, targets = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()

    def step(forward):
        def run():
            model.zero_grad(set_to_none=True)
            _, loss = forward(inputs, targets)
            loss.backward()
            return loss
        return run

    return _run_impls("train_step", None, None, n, k, device, impls, max_gib, repeat, model=model, step=step)


COMPILE_SKIP = ("the Inductor compile of the unrolled training graph takes minutes on this CPU; "
                "measured only at --compiled-train-sizes")


def _run_impls(workload, fn, args, n, k, device, impls, max_gib, repeat, extra=None, model=None, step=None):
    # a merged file can hold cells from several cards: each cell says which one measured it
    cell = {"workload": workload, "N": n, "K": k, "B": 1, "date": time.strftime("%Y-%m-%d %H:%M"),
            "device": device_name(device)}
    need = _estimate_gib(workload, 1, n, k)
    for impl in impls:
        if impl in ("eager", "inductor") and need > max_gib:
            cell[impl] = {"skipped": f"the broadcast form needs ~{need:.1f} GiB of [B, N, N, K] temporaries "
                                     f"(> --max-gib {max_gib})"}
            continue
        if isinstance(impl, tuple):  # (name, reason): not measured here
            cell[impl[0]] = {"skipped": impl[1]}
            continue
        torch._dynamo.reset()
        if impl == "eager":
            target = model if model is not None else fn
        elif impl == "inductor":
            target = torch.compile(model if model is not None else fn)
        elif impl == "hecate_eager":
            target = torch.compile(model if model is not None else fn, backend="hecate",
                                   options={"fallback": "eager"})
        else:
            target = torch.compile(model if model is not None else fn, backend="hecate")
        call = step(target) if step is not None else (lambda t=target: t(*args))
        start = time.perf_counter()
        call()
        first = time.perf_counter() - start
        if impl == "eager" and first > 10.0:  # nothing to compile: a call this long is its own measurement
            ms, peak = first * 1e3, None
        else:
            ms = median_time(call, device, warmup=0, repeat=repeat, max_seconds=10.0)
            peak = peak_memory_mb(call, device)
        cell[impl] = {"ms": ms, "first_call_s": first, "peak_mib": peak}
        if impl.startswith("hecate"):
            from hecate import last_report
            report = last_report()
            cell[impl]["fused"] = {p: report.count(p) for p in ("kl_attention", "kl_decode")}
        print(f"  {workload} N={n} K={k} {impl}: {ms:.2f} ms (first call {first:.1f} s)", flush=True)
    for name, call in (extra or {}).items():
        ms = median_time(call, device, warmup=1, repeat=repeat, max_seconds=5.0)
        cell[name] = {"ms": ms, "peak_mib": peak_memory_mb(call, device)}
        print(f"  {workload} N={n} K={k} {name}: {ms:.2f} ms", flush=True)
    return cell


def _key(cell):
    return cell["workload"], cell["N"], cell["K"]


def _merge(old_cells, new_cells):
    """The old cells with the new ones' implementations replacing theirs (new cells added), in the default order."""
    merged = {_key(c): dict(c) for c in old_cells}
    for cell in new_cells:
        merged.setdefault(_key(cell), {}).update(cell)
    order = {w: i for i, w in enumerate(BROADCAST_LIVE)}
    return sorted(merged.values(), key=lambda c: (c["K"], c["N"], order[c["workload"]]))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smoke run: N = 64, K = 16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--max-gib", type=float, default=4.0,
                        help="skip broadcast-form cells whose estimated temporaries exceed this")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--impls", default="eager,inductor,hecate")
    parser.add_argument("--compiled-train-sizes", default="256x16,64x16",
                        help="NxK cells where the Inductor-compiled training step is measured")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads (default 1: on a shared machine OpenMP barriers make timings noise)")
    parser.add_argument("--sizes", help="comma-separated NxK cells (default N ∈ {256, 1024, 4096} × K ∈ {16, 64})")
    parser.add_argument("--workloads", default="attention,train_step", help="comma-separated, of attention,train_step")
    parser.add_argument("--merge", action="store_true",
                        help="keep the cells already in the JSON file; a cell measured again has its "
                             "implementations replaced by the new ones")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    if args.sizes:
        sizes = [tuple(int(x) for x in s.split("x")) for s in args.sizes.split(",")]
    else:
        sizes = [(64, 16)] if args.quick else [(n, k) for k in (16, 64) for n in (256, 1024, 4096)]
    workloads = args.workloads.split(",")
    unknown = set(workloads) - set(BROADCAST_LIVE)
    if unknown:
        parser.error(f"--workloads: unknown {sorted(unknown)}, expected some of {sorted(BROADCAST_LIVE)}")
    impls = args.impls.split(",")
    compiled_train = {tuple(int(x) for x in s.split("x")) for s in args.compiled_train_sizes.split(",") if s}
    cells = []
    name = "fep"
    json_path = result_path(name, args.device, "json", args.quick)
    earlier, kept = [], {}
    if args.merge and os.path.exists(json_path):
        with open(json_path) as f:
            old = json.load(f)
        earlier = old["cells"]
        # what an earlier run kept beside its cells (the runs before, on other cards or launches) stays
        kept = {key: value for key, value in old.items()
                if key not in ("benchmark", "environment", "workloads", "notes", "complete", "cells")}

    def save(measured: list, complete: bool) -> tuple[str, list]:
        """The JSON with the cells measured so far (after every cell: a run stopped early keeps them)."""
        cells = _merge(earlier, measured) if earlier else list(measured)
        for cell in cells:
            base = cell.get("eager", {}).get("ms")
            for impl in ("inductor", "hecate", "hecate_eager", "sdpa"):
                if base and impl in cell and "ms" in cell[impl]:
                    cell[impl]["speedup_vs_eager"] = base / cell[impl]["ms"]
            if "sdpa" in cell and "ms" in cell.get("hecate", {}):
                cell["hecate"]["ratio_to_sdpa"] = cell["hecate"]["ms"] / cell["sdpa"]["ms"]
        path = write_json(name, args.device, {
            "workloads": {"attention": bench_attention.__doc__ or "one Q-flow step's attention + alignment gradient",
                          "train_step": "forward + backward, 1 layer, 2 Q-flow steps, V = 64, B = 1"},
            "notes": "CPU: hecate's kl_attention runs its matmul-form CPU path ([B,N,N] scores, no [B,N,N,K]); "
                     "the rest of the graph goes to Inductor. Memory only measured on CUDA. A cell's date is "
                     "when it was measured (--merge keeps the cells not measured again; older cells have none).",
            "complete": complete,
            "cells": cells, **kept}, quick=args.quick)
        return path, cells

    measured = []
    for n, k in tqdm(sizes, desc="N, K", disable=args.no_progress, dynamic_ncols=True):
        if "attention" in workloads:
            measured.append(bench_attention(n, k, args.device, impls, args.max_gib, args.repeat))
            save(measured, complete=False)
        if "train_step" in workloads:
            train_impls = [i if i == "eager" or (n, k) in compiled_train or args.device == "cuda"
                           else (i, COMPILE_SKIP) for i in impls] + ["hecate_eager"]
            measured.append(bench_train_step(n, k, args.device, train_impls, args.max_gib, args.repeat))
            save(measured, complete=False)
    path, cells = save(measured, complete=True)
    series = {impl: [] for impl in ("eager", "inductor", "hecate", "hecate_eager", "sdpa")
              if any(impl in cell for cell in cells)}
    labels = []
    for cell in cells:
        labels.append(f"{cell['workload']} N={cell['N']} K={cell['K']}")
        for impl in series:
            series[impl].append(cell.get(impl, {}).get("ms"))
    plot_bars(result_path(name, args.device, "png", args.quick), f"Pure FEP transformer ({args.device})", labels,
              series)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
