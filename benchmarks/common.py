"""What every benchmark here shares: timing, the environment record, JSON and plots.

Each benchmark script times eager, Inductor and Hecate side by side in one run
and writes ``results/<name>-<device>.json`` and a plot beside it. Claims in notes
and the README are read off those files. ``--quick`` runs write
``results/quick/<name>-quick-<device>.*`` instead (git-ignored), so a smoke run
never overwrites a measurement.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from typing import Any, Callable

import torch

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
QUICK_RESULTS = os.path.join(RESULTS, "quick")


def result_path(name: str, device: str, ext: str, quick: bool = False) -> str:
    """Where a run's ``ext`` file goes: the committed results, or the git-ignored quick folder."""
    folder = QUICK_RESULTS if quick else RESULTS
    os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, f"{name}{'-quick' if quick else ''}-{device}.{ext}")


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads)"


def environment(device: str) -> dict[str, Any]:
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "device": device_name(device),
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def warm_compilers(device: str) -> None:
    """Compile one small function with Inductor and with Hecate before any row: the first compile in a
    process pays their start-up (imports, Inductor's first code generation), which is no row's compile time."""
    x = torch.randn(8, 8, device=device)
    for backend in ("inductor", "hecate"):
        torch._dynamo.reset()
        torch.compile(lambda t: (t @ t).sin().sum(-1), backend=backend)(x)
    torch._dynamo.reset()


def median_time(fn: Callable[[], Any], device: str, warmup: int = 2, repeat: int = 10,
                max_seconds: float = 20.0) -> float:
    """Median wall time of ``fn()`` in milliseconds (after ``warmup`` calls)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    start = time.perf_counter()
    for _ in range(repeat):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t) * 1e3)
        if time.perf_counter() - start > max_seconds:
            break
    return statistics.median(times)


def forward_only(fn: Callable[..., Any], args: list) -> Callable[[], None]:
    """A timed call of ``fn(*args)`` without autograd."""
    def run():
        with torch.no_grad():
            fn(*args)
    return run


def forward_backward(fn: Callable[..., Any], args: list) -> Callable[[], None]:
    """A timed call of ``fn(*args)`` (returning y and the final state) and the backward of their sums."""
    def run():
        y, m = fn(*args)
        (y.sum() + m.sum()).backward()
        for x in args:
            x.grad = None
    return run


def peak_memory_mb(fn: Callable[[], Any], device: str) -> float | None:
    """Peak CUDA memory of one call of ``fn()`` in MiB (None on CPU)."""
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def write_json(name: str, device: str, payload: dict[str, Any], quick: bool = False) -> str:
    path = result_path(name, device, "json", quick)
    with open(path, "w") as f:
        json.dump({"benchmark": name, "environment": environment(device), **payload}, f, indent=2)
    return path


def plot_bars(path: str, title: str, labels: list[str], series: dict[str, list[float]],
              ylabel: str = "median time (ms)") -> None:
    """One group of bars per label, one bar per series (e.g. eager / inductor / hecate)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(labels)), 4))
    width = 0.8 / max(1, len(series))
    for n, (name, values) in enumerate(series.items()):
        xs = [i + n * width for i in range(len(labels))]
        ax.bar(xs, [v if v is not None else 0 for v in values], width, label=name)
    ax.set_xticks([i + width * (len(series) - 1) / 2 for i in range(len(labels))])
    ax.set_xticklabels(labels, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_yscale("log")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
