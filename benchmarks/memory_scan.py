"""The l_p memory recurrence: eager loop vs Inductor (unrolled; scan form) vs Hecate's memory_scan.

The function timed is the recurrence of ``hecate.models.memory.LpMemory`` on
already-projected φ(k), v, φ(q) and per-token gates, written as a user writes it:
a Python ``for t in range(T)`` loop (Dynamo unrolls it) and, for the scan form,
``torch._higher_order_ops.scan`` over the same step. At every T, Hecate compiles
the scan form with ``backend="hecate"`` (its recognition pass turns it into one
``hecate.memory_scan``; if the report shows no such fusion, the op is called
directly and the JSON says so) and Inductor compiles the same scan form. At small
T, where Inductor compiles the unrolled loop in reasonable time (its compile time
grows with T: DESIGN.md), both also compile the loop form.

    PYTHONPATH=. python3 benchmarks/memory_scan.py [--quick] [--device cpu|cuda]

Writes results/memory_scan-<device>.json and a PNG beside it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch._higher_order_ops.scan import scan

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (forward_backward, forward_only, median_time, plot_bars, result_path, warm_compilers,  # noqa: E402
                    write_json)

import hecate  # noqa: E402
import hecate.lowering  # noqa: E402,F401

# per step of eager autograd: M, W, the update and a few [B, H, Dv, Dk] temporaries are saved
EAGER_BACKWARD_MAX_BYTES = 3 * 2**30


def make_step(p: float, a: float = 10.0, eps: float = 1e-6):
    def bias_gradient(e):
        if p == 2.0:
            return 2 * e
        if p == 1.0:
            return torch.tanh(a * e)
        return p * torch.tanh(a * e) * (e * e + eps) ** ((p - 1) / 2)

    def step(M, k_t, v_t, q_t, alpha_t, eta_t):
        alpha_t, eta_t = alpha_t[..., None, None], eta_t[..., None, None]
        e = (M @ k_t.unsqueeze(-1)).squeeze(-1) - v_t
        grad = bias_gradient(e).unsqueeze(-1) * k_t.unsqueeze(-2)
        M = (1 - alpha_t) * M - eta_t * grad
        return M, (M @ q_t.unsqueeze(-1)).squeeze(-1)

    return step


def make_loop(p: float):
    step = make_step(p)

    def memory_loop(k, v, q, alpha, eta, m0):
        M, ys = m0, []
        for t in range(k.shape[1]):
            M, y_t = step(M, k[:, t], v[:, t], q[:, t], alpha[:, t], eta[:, t])
            ys.append(y_t)
        return torch.stack(ys, 1), M

    return memory_loop


def make_scan(p: float):
    step = make_step(p)

    def memory_scan_form(k, v, q, alpha, eta, m0):
        M, y = scan(lambda M, xs: step(M, *xs), m0, (k, v, q, alpha, eta), dim=1)
        return y, M

    return memory_scan_form


def direct_op(p: float):
    def call(k, v, q, alpha, eta, m0):
        return torch.ops.hecate.memory_scan(k, v, q, alpha, eta, m0, None, p, 10.0, 1e-6, 0.0, 2.0)[:2]

    return call


def fla_delta_rule():
    """fla's fused_recurrent_delta_rule (CUDA only), or None when fla is not importable."""
    try:
        from fla.ops.delta_rule import fused_recurrent_delta_rule
    except Exception:  # noqa: BLE001 - fla is optional
        return None

    def call(k, v, q, alpha, eta, m0):
        # at p = 2 and α = 0 the recurrence is the delta rule with β = 2η (fla keeps S as [Dk, Dv])
        return fused_recurrent_delta_rule(q, k, v, beta=2 * eta, scale=1.0, initial_state=m0.transpose(-1, -2),
                                          output_final_state=True)

    return call


def inputs(B, H, T, d, device, requires_grad):
    g = torch.Generator().manual_seed(0)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, d, generator=g), dim=-1)
    v = torch.randn(B, T, H, d, generator=g)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, d, generator=g), dim=-1)
    alpha = torch.sigmoid(torch.randn(B, T, H, generator=g) - 3)
    eta = 0.3 * torch.sigmoid(torch.randn(B, T, H, generator=g))
    m0 = torch.zeros(B, H, d, d)
    return [x.to(device).requires_grad_(requires_grad) for x in (k, v, q, alpha, eta, m0)]


def timed_compile(fn, args, backend, backward, options=None):
    """Compile and run once (forward, plus backward if asked): returns (compiled fn, seconds of that first call).

    The first call is compile plus one run: callers subtract a steady-state run to report compile time."""
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=backend, **({"options": options} if options else {}))
    start = time.perf_counter()
    (forward_backward if backward else forward_only)(compiled, args)()
    return compiled, time.perf_counter() - start


def hecate_fused() -> bool:
    report = hecate.last_report()
    return report is not None and any(f.op == "hecate.memory_scan" for f in report.fusions)


def hecate_compiled(fn, x, backward, p, probe):
    """(callable, first-call seconds or None, mode): Hecate's compile of ``fn`` when its pass rolls the
    recurrence up (checked first on the small ``probe`` inputs with the eager fallback, so an un-rolled
    loop never reaches Inductor), else the direct op call."""
    timed_compile(fn, probe, "hecate", backward, {"fallback": "eager"})
    if not hecate_fused():
        return direct_op(p), None, "direct memory_scan call (the pass did not roll the recurrence up)"
    compiled, secs = timed_compile(fn, x, "hecate", backward)
    return compiled, secs, "torch.compile(backend='hecate'), rolled into one memory_scan"


def run(args):
    device = args.device
    # compile times must not come from a previous run's cache
    torch._inductor.config.force_disable_caches = True
    if device == "cpu":
        torch.set_num_threads(args.threads)
    B, H = 2, 16
    if args.quick:
        lengths, dims, unrolled_lengths, repeat = [64], [32], [4], 3  # T = 64: the chunked form's first length
        general_p_max_T = 64
    else:
        lengths, dims, unrolled_lengths, repeat = args.lengths, args.dims, args.unrolled_lengths, 5
        general_p_max_T = 1024
    rows, labels, unrolled = [], [], []
    warm_compilers(device)

    def save(complete: bool) -> str:
        """The JSON as measured so far (after every row: a run stopped early keeps what it measured)."""
        payload = {
            "what": "l_p memory recurrence (LpMemory step on projected inputs), B*H = 32",
            "quick": args.quick,
            "notes": [
                "T=4096 rows: 1 timed run, no warm-up, to keep the CPU run to a few minutes; "
                f"general p (p=3) only up to T={general_p_max_T}",
                *([f"CPU runs use torch.set_num_threads({args.threads}) (2-core machine shared with other jobs: "
                   "more threads oversubscribe it)",
                   "the machine is shared (2 cores, other jobs running): CPU timings are noisy"]
                  if device == "cpu" else []),
                "eager forward+backward is skipped where autograd would hold more than "
                f"{EAGER_BACKWARD_MAX_BYTES / 2**30:.0f} GiB of per-step states",
                "hecate forward+backward = memory_scan forward + memory_scan_backward (re-runs the forward "
                "keeping a checkpoint every CHUNK steps, then recomputes each segment)",
                "compile_s = first call (compile + one run) minus one steady-state run, Inductor caches disabled, "
                "after one warm-up compile per backend in the process",
                "Inductor could not compile the scan form on this torch (InductorError DataDependentOutputException "
                "in decompose_scan_to_while_loop, even for a trivial scan body): its timings are null, error recorded",
            ],
            "rows": rows,
            "inductor_unrolled": unrolled,
        }
        return write_json("memory_scan", device, {**payload, "complete": complete}, quick=args.quick)

    fwd_series = {"eager loop": [], "inductor scan form": [], "hecate": []}
    bwd_series = {"eager loop": [], "inductor scan form": [], "hecate": []}
    for d in dims:
        for p in ((2.0,) if args.quick else (2.0, 3.0)):  # --quick: the chunked p = 2 path only
            for T in lengths:
                if p != 2.0 and T > general_p_max_T:
                    continue
                reps, warm = (repeat, 1) if T < 4096 else (1, 0)
                row = {"B": B, "H": H, "T": T, "d_k": d, "d_v": d, "p": p, "repeats": reps, "warmup": warm}
                print(f"p={p} T={T} d={d}", flush=True)
                loop, scan_form = make_loop(p), make_scan(p)
                for mode, builder in (("forward", forward_only), ("forward+backward", forward_backward)):
                    backward = mode != "forward"
                    x = inputs(B, H, T, d, device, requires_grad=backward)
                    res = {}
                    state_bytes = B * H * d * d * 4
                    if backward and 4 * T * state_bytes > EAGER_BACKWARD_MAX_BYTES:
                        res["eager_ms"] = None
                        res["eager_note"] = (f"skipped: eager autograd keeps ~4 states per step, "
                                             f"~{4 * T * state_bytes / 2**30:.1f} GiB")
                    else:
                        res["eager_ms"] = median_time(builder(loop, x), device, warmup=warm, repeat=reps)
                    try:
                        compiled, first = timed_compile(scan_form, x, "inductor", backward)
                        res["inductor_scan_ms"] = median_time(builder(compiled, x), device, warmup=warm, repeat=reps)
                        res["inductor_scan_compile_s"] = max(0.0, first - res["inductor_scan_ms"] / 1e3)
                    except Exception as e:  # noqa: BLE001 - recorded in the JSON
                        res["inductor_scan_ms"] = None
                        res["inductor_scan_error"] = f"{type(e).__name__}: {str(e)[:200]}"
                    probe = inputs(B, H, 16, d, device, requires_grad=backward)
                    fn, first, res["hecate_mode"] = hecate_compiled(scan_form, x, backward, p, probe)
                    res["hecate_ms"] = median_time(builder(fn, x), device, warmup=warm, repeat=reps)
                    res["hecate_compile_s"] = None if first is None else max(0.0, first - res["hecate_ms"] / 1e3)
                    if res["eager_ms"]:
                        res["hecate_speedup_vs_eager"] = res["eager_ms"] / res["hecate_ms"]
                    if res.get("inductor_scan_ms"):
                        res["hecate_speedup_vs_inductor_scan"] = res["inductor_scan_ms"] / res["hecate_ms"]
                    fla = fla_delta_rule() if device == "cuda" and p == 2.0 else None
                    if fla is not None:
                        x0 = [t.detach().requires_grad_(backward) for t in x]
                        x0[3] = torch.zeros_like(x0[3])  # α = 0: the plain delta rule
                        try:
                            res["fla_fused_recurrent_delta_rule_ms"] = median_time(builder(fla, x0), device,
                                                                                   repeat=reps)
                        except Exception as e:  # noqa: BLE001 - fla is optional: recorded, not fatal
                            res["fla_error"] = f"{type(e).__name__}: {str(e)[:200]}"
                        res["hecate_alpha0_ms"] = median_time(builder(direct_op(p), x0), device, repeat=reps)
                    row[mode] = res
                    series = fwd_series if mode == "forward" else bwd_series
                    series["eager loop"].append(res["eager_ms"])
                    series["inductor scan form"].append(res.get("inductor_scan_ms"))
                    series["hecate"].append(res["hecate_ms"])
                    print(f"  {mode}: {res}", flush=True)
                labels.append(f"p={p:g} T={T} d={d}")
                rows.append(row)
                save(complete=False)

    # Inductor on the unrolled loop: only where it compiles in reasonable time
    for T in unrolled_lengths:
        d, p = dims[0], 2.0
        loop = make_loop(p)
        entry = {"B": B, "H": H, "T": T, "d_k": d, "d_v": d, "p": p}
        for mode, builder in (("forward", forward_only), ("forward+backward", forward_backward)):
            backward = mode != "forward"
            x = inputs(B, H, T, d, device, requires_grad=backward)
            compiled, first = timed_compile(loop, x, "inductor", backward)
            res = {"inductor_unrolled_ms": median_time(builder(compiled, x), device, repeat=repeat),
                   "eager_ms": median_time(builder(loop, x), device, repeat=repeat)}
            res["inductor_unrolled_compile_s"] = first - res["inductor_unrolled_ms"] / 1e3
            fn, first, res["hecate_mode"] = hecate_compiled(loop, x, backward, p, x)
            res["hecate_ms"] = median_time(builder(fn, x), device, repeat=repeat)
            res["hecate_compile_s"] = None if first is None else first - res["hecate_ms"] / 1e3
            entry[mode] = res
            print(f"unrolled T={T} {mode}: {res}", flush=True)
        unrolled.append(entry)
        save(complete=False)

    path = save(complete=True)
    png = result_path("memory_scan", device, "png", args.quick)
    plot_bars(png, f"memory_scan forward ({device}); B·H=32", labels, fwd_series)
    plot_bars(png.replace(".png", "-fwd-bwd.png"), f"memory_scan forward+backward ({device}); B·H=32",
              labels, bwd_series)
    print("wrote", path, png)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a smoke run: p = 2, T = 64, d = 32, unrolled T = 4")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (default 1)")
    parser.add_argument("--dims", type=lambda s: [int(d) for d in s.split(",")], default=[64, 128],
                        help="d_k = d_v values, comma-separated (default 64,128)")
    parser.add_argument("--lengths", type=lambda s: [int(t) for t in s.split(",")], default=[256, 1024, 4096],
                        help="T values of the scan form, comma-separated (default 256,1024,4096)")
    parser.add_argument("--unrolled-lengths", type=lambda s: [int(t) for t in s.split(",") if t], default=[16, 32],
                        help="T values where Inductor also compiles the unrolled loop (default 16,32; '' for none)")
    run(parser.parse_args())
