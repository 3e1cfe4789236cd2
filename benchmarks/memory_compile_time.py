"""Compile time of an l_p memory layer written as a per-token loop (and as ``scan``), vs T.

Dynamo unrolls the loop into T copies of the step. Hecate rolls the copies back up into
a scan before re-tracing (hecate.compiler.loops) and fuses it into one ``memory_scan`` op,
so what it re-traces, matches and hands to Inductor no longer grows with T; Inductor on
the same model compiles all T copies. Each measurement runs in a fresh subprocess with
a time limit (a run past it is recorded as "did not finish in N s").

Per run (model ``LpMemory(32, n_heads=2, d_k=d_v=8, p=3, data-dependent gates)``, B=2):
  compile_s   first call (forward + backward) minus a warm call: everything compiling costs
  backend_s   time inside the backend function (Hecate: canonicalise + passes + Inductor
              on the rest; Inductor: compile_fx of the forward, the backward compiles lazily
              and is in compile_s only)
  dynamo_s    first forward minus backend_s minus a warm forward: Dynamo tracing the
              Python loop (grows with T for every backend)
  cse_s, roll_s, canonicalize_s, passes_s (Hecate only): parts of backend_s (merging common
              subexpressions in Dynamo's graph, rolling the loop up, re-tracing to ATen, the
              passes; the rest is Inductor)
  warm_ms     a warm forward + backward

``python3 benchmarks/memory_compile_time.py [--quick] [--timeout S]``
writes results/memory_compile_time-cpu.json and a plot beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)


def worker(backend: str, T: int, use_scan: bool) -> dict:
    """One measurement in this (fresh) process; returns the numbers as a dict."""
    import torch

    from hecate.models.memory import LpMemory

    torch.manual_seed(0)
    model = LpMemory(32, n_heads=2, d_k=8, d_v=8, p=3.0, alpha=None, eta=None, use_scan=use_scan)
    x = torch.randn(2, T, 32, requires_grad=True)
    timings = {"backend_s": 0.0, "cse_s": 0.0, "roll_s": 0.0, "canonicalize_s": 0.0, "passes_s": 0.0}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                timings[name] += time.perf_counter() - start
        return wrapper

    if backend == "hecate":
        import hecate.compiler.backend as hb
        import hecate.compiler.pipeline as pipeline

        pipeline.collapse_captured = timed("cse_s", pipeline.collapse_captured)
        pipeline.roll_loops = timed("roll_s", pipeline.roll_loops)
        pipeline.canonicalize = timed("canonicalize_s", pipeline.canonicalize)
        pipeline.run_passes = timed("passes_s", pipeline.run_passes)
        inner = timed("backend_s", lambda gm, ex: hb.hecate_backend(gm, ex, options={"fallback": "inductor"}))
    elif backend == "inductor":
        from torch._inductor.compile_fx import compile_fx

        inner = timed("backend_s", compile_fx)
    else:
        raise ValueError(f"backend must be 'hecate' or 'inductor', got {backend!r}")
    compiled = torch.compile(model, backend=inner)

    def fwd():
        return compiled(x)

    def fwd_bwd():
        y, m = compiled(x)
        (y.square().sum() + m.sum()).backward()

    start = time.perf_counter()
    out = fwd()
    first_fwd = time.perf_counter() - start
    (out[0].square().sum() + out[1].sum()).backward()
    first_total = time.perf_counter() - start
    warm_fwd = min(_time(fwd) for _ in range(3))
    warm_total = min(_time(fwd_bwd) for _ in range(3))
    result = {"compile_s": first_total - warm_total, "backend_s": timings["backend_s"],
              "dynamo_s": first_fwd - timings["backend_s"] - warm_fwd, "warm_ms": warm_total * 1e3}
    if backend == "hecate":
        import hecate

        report = hecate.last_report()
        result.update(cse_s=timings["cse_s"], roll_s=timings["roll_s"], canonicalize_s=timings["canonicalize_s"],
                      passes_s=timings["passes_s"], fused=[f.detail for f in report.fusions], missed=[m.reason for m in report.misses])
    eager = min(_time(lambda: model(x)[0].square().sum().backward()) for _ in range(2))
    result["eager_ms"] = eager * 1e3
    return result


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run_one(backend: str, T: int, use_scan: bool, timeout: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", backend, str(T)] + (["--scan"] if use_scan else [])
    # no on-disk compile caches: every run compiles from scratch
    env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE), TORCHINDUCTOR_FX_GRAPH_CACHE="0",
               TORCHINDUCTOR_AUTOGRAD_CACHE="0")
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"status": f"did not finish in {timeout:.0f} s"}
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        return {"status": "failed", "error": proc.stderr[-2000:]}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result.update(status="ok", process_wall_s=wall)
    return result


def plot(runs: list[dict], quick: bool = False) -> None:
    from common import plot_bars, result_path

    lengths = sorted({r["T"] for r in runs})
    labels = [f"{form} T={T}" for form in ("loop", "scan") for T in lengths]

    def series(backend, key):
        by = {(r["form"], r["T"]): r for r in runs if r["backend"] == backend}
        return [by[(f, T)].get(key) if (f, T) in by and by[(f, T)]["status"] == "ok" else None
                for f in ("loop", "scan") for T in lengths]

    plot_bars(result_path("memory_compile_time", "cpu", "png", quick),
              "compile time (first fwd+bwd − warm); no bar = did not finish / failed / not run", labels,
              {"hecate": series("hecate", "compile_s"), "hecate: Dynamo trace": series("hecate", "dynamo_s"),
               "hecate: backend": series("hecate", "backend_s"),
               "hecate: common subexpressions (in backend)": series("hecate", "cse_s"),
               "hecate: roll up the loop (in backend)": series("hecate", "roll_s"),
               "hecate: canonicalise (in backend)": series("hecate", "canonicalize_s"),
               "hecate: passes (in backend)": series("hecate", "passes_s"),
               "inductor": series("inductor", "compile_s")},
              ylabel="seconds")


BACKENDS, FORMS = "hecate,inductor", "loop,scan"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="Hecate on the loop form at T = 16 only, into the git-ignored results/quick/")
    parser.add_argument("--lengths", help="comma-separated T values (default 64,256,1024)")
    parser.add_argument("--backends", default=BACKENDS, help=f"comma-separated (default {BACKENDS})")
    parser.add_argument("--forms", default=FORMS, help=f"comma-separated (default {FORMS})")
    parser.add_argument("--merge", action="store_true",
                        help="keep the runs already in the JSON file, replacing those measured again")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per compile (default 600)")
    parser.add_argument("--plot-only", action="store_true", help="redraw the plot from the JSON file")
    parser.add_argument("--worker", nargs=2, metavar=("BACKEND", "T"), help=argparse.SUPPRESS)
    parser.add_argument("--scan", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker[0], int(args.worker[1]), args.scan)))
        return

    from common import result_path, write_json

    json_path = result_path("memory_compile_time", "cpu", "json", args.quick)
    if args.plot_only:
        with open(json_path) as f:
            plot(json.load(f)["runs"], args.quick)
        return
    if args.lengths:
        lengths = [int(t) for t in args.lengths.split(",")]
    else:
        lengths = [16] if args.quick else [64, 256, 1024]
    # quick: Inductor alone takes minutes even at T = 16
    backends = ["hecate"] if args.quick and args.backends == BACKENDS else args.backends.split(",")
    forms = ["loop"] if args.quick and args.forms == FORMS else args.forms.split(",")
    runs = []
    for form in forms:
        for backend in backends:
            gave_up = None
            for T in lengths:
                if gave_up is not None:  # a longer T cannot finish sooner
                    runs.append({"form": form, "backend": backend, "T": T,
                                 "status": f"not run: T={gave_up} did not finish or failed"})
                    continue
                result = run_one(backend, T, form == "scan", args.timeout)
                result.update(form=form, backend=backend, T=T)
                runs.append(result)
                print(json.dumps({k: v for k, v in result.items() if k != "error"}), flush=True)
                if result["status"] != "ok":
                    gave_up = T
    if args.merge and os.path.exists(json_path):
        with open(json_path) as f:
            measured = {(r["form"], r["backend"], r["T"]) for r in runs}
            runs = [r for r in json.load(f)["runs"] if (r["form"], r["backend"], r["T"]) not in measured] + runs
    runs.sort(key=lambda r: (r["form"], r["backend"], r["T"]))
    path = write_json("memory_compile_time", "cpu", {
        "model": "LpMemory(32, n_heads=2, d_k=8, d_v=8, p=3, data-dependent gates), B=2",
        "timeout_s": args.timeout, "runs": runs}, quick=args.quick)
    plot(runs, args.quick)
    print(path)


if __name__ == "__main__":
    main()
