"""What Hecate's tests compare with: relative error, poisoned outputs, CUDA checks."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``‖actual − expected‖ / ‖expected‖`` in float64 (0 when both are zero).

    NaN anywhere in ``actual`` (an unwritten poisoned element) gives NaN, which
    fails every ``<=`` tolerance check.
    """
    if actual.shape != expected.shape:
        raise AssertionError(f"shape mismatch: actual {tuple(actual.shape)} vs expected {tuple(expected.shape)}")
    a, b = actual.detach().double(), expected.detach().double()
    denom = b.norm()
    diff = (a - b).norm()
    if denom == 0:
        return float(diff)
    return float(diff / denom)


def assert_close(name: str, actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    """Assert ``rel_err(actual, expected) <= tol`` with a message naming the tensor."""
    err = rel_err(actual, expected)
    if not err <= tol:  # also catches NaN
        raise AssertionError(f"{name}: relative error {err:.3e} > tolerance {tol:.1e}")


def assert_outputs_and_gradients_close(got, ref, wrt_got, wrt_ref, tol: float) -> None:
    """Outputs (any nesting of tensors) within ``tol``, and so the gradients of one fixed random
    weighting of them with respect to ``wrt_got`` and ``wrt_ref`` (each side's own inputs, then
    any parameters they share)."""
    got, ref = torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(ref)
    for i, (g, r) in enumerate(zip(got, ref, strict=True)):
        assert_close(f"output {i}", g, r, tol)
    weights = [torch.randn(r.shape, generator=torch.Generator().manual_seed(i)) for i, r in enumerate(ref)]
    grads_got = torch.autograd.grad(sum((o * w).sum() for o, w in zip(got, weights)), list(wrt_got))
    grads_ref = torch.autograd.grad(sum((o * w).sum() for o, w in zip(ref, weights)), list(wrt_ref))
    for i, (g, r) in enumerate(zip(grads_got, grads_ref)):
        assert_close(f"grad {i}", g, r, tol)


def assert_close_nonfinite(name: str, actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    """NaN, +inf and −inf exactly where ``expected`` has them, and the finite rest within ``tol``
    (:func:`assert_close` on the finite elements)."""
    for what, test in (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
        got, want = test(actual.detach().cpu()), test(expected.detach().cpu())
        if not torch.equal(got, want):
            raise AssertionError(f"{name}: {what} at {int(got.sum())} elements, expected at {int(want.sum())}; "
                                 f"first difference at {tuple((got != want).nonzero()[0].tolist())}")
    finite = torch.isfinite(expected.detach().cpu())
    assert_close(name, actual.detach().cpu()[finite], expected.detach().cpu()[finite], tol)


def poisoned(*shape: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> torch.Tensor:
    """A NaN-filled tensor: any element a kernel forgets to write stays NaN."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


@contextlib.contextmanager
def bf16_dot_in_interpreter() -> Iterator[None]:
    """Under ``TRITON_INTERPRET=1``, let ``tl.dot`` read bf16 operands as the GPU does: the interpreter keeps bf16
    as its raw uint16 bits and multiplies those (garbage). Here they are widened to fp32 first, which is what a
    bf16 tensor-core dot computes (exact products, fp32 accumulation; only the summation order differs). Every
    other part of a bf16 kernel (loads, casts, stores) the interpreter already runs faithfully."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    create_dot = interpreter.InterpreterBuilder.create_dot

    def widened(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        data = interpreter._convert_float(handle.data, tl.bfloat16, tl.float32, None).view(np.float32)
        return interpreter.TensorHandle(data, tl.float32)

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, widened(a), widened(b), d, input_precision, max_num_imprecise_acc)

    interpreter.InterpreterBuilder.create_dot = dot
    try:
        yield
    finally:
        interpreter.InterpreterBuilder.create_dot = create_dot


# --- compiling Triton kernels for a GPU that is not here -------------------------------------------------------
# TRITON_INTERPRET=1 (how CI runs the kernels) accepts code the GPU compiler rejects, so tests also compile each
# kernel to PTX. Triton reads TRITON_INTERPRET when it is imported: the compiling runs in a fresh python without it.

def kernel_signature(kernel, constexprs: dict, types: dict[str, str]) -> dict[str, str]:
    """The Triton signature of ``kernel`` (a ``@triton.jit`` function) for :func:`compile_for_gpu`:
    ``"constexpr"`` for the names in ``constexprs``, ``types[name]`` ("*bf16", "*fp32", "i32", "fp32", ...) for
    every other argument."""
    names = list(kernel.arg_names)
    unknown = sorted((set(constexprs) | set(types)) - set(names))
    if unknown:
        raise ValueError(f"kernel_signature: {kernel.__name__} has no arguments {unknown}; its arguments are {names}")
    missing = [n for n in names if n not in constexprs and n not in types]
    if missing:
        raise ValueError(f"kernel_signature: arguments {missing} of {kernel.__name__} need a type or a constexpr value")
    return {n: "constexpr" if n in constexprs else types[n] for n in names}


def compile_for_gpu(kernel, signature: dict[str, str], constexprs: dict, arch: int = 90) -> str:
    """Compile ``kernel`` for CUDA sm_``arch`` (no GPU needed) and return its PTX.

    Pointer arguments are taken as 16-byte aligned, as Triton's launcher marks fresh torch allocations.
    Raises when this process imported triton under ``TRITON_INTERPRET=1`` (see :func:`compile_for_gpu_in_subprocess`).
    """
    return _compile_for_gpu(kernel, signature, constexprs, arch).asm["ptx"]


def kernel_resources(kernel, signature: dict[str, str], constexprs: dict, num_warps: int = 4,
                     arch: int = 90) -> dict[str, int]:
    """``{"registers": per thread, "stack_bytes": per thread}`` of ``kernel`` compiled for sm_``arch`` (no GPU
    needed), as ``cuobjdump -res-usage`` reads them from the cubin. A stack frame in a kernel that makes no
    calls is spilled registers: local-memory traffic in every iteration that touches them."""
    import os
    import re
    import subprocess
    import tempfile

    import triton

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    cubin = _compile_for_gpu(kernel, signature, constexprs, arch, num_warps).asm["cubin"]
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    if found is None:
        raise RuntimeError(f"kernel_resources: no REG/STACK line in cuobjdump's output:\n{usage[-2000:]}")
    return {"registers": int(found.group(1)), "stack_bytes": int(found.group(2))}


def _compile_for_gpu(kernel, signature: dict[str, str], constexprs: dict, arch: int, num_warps: int = 4):
    import os

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("compile_for_gpu: TRITON_INTERPRET is set; compile in a process without it "
                           "(compile_for_gpu_in_subprocess)")
    names = list(kernel.arg_names)
    aligned = {(names.index(n),): [["tt.divisibility", 16]] for n, t in signature.items() if t.startswith("*")}
    source = ASTSource(kernel, signature, constexprs={(names.index(n),): v for n, v in constexprs.items()},
                       attrs=aligned)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})


def compile_for_gpu_in_subprocess(jobs: dict[str, tuple[object, dict[str, str], dict]], arch: int = 90,
                                  timeout: float = 600) -> dict[str, str | None]:
    """Run :func:`compile_for_gpu` for each job ``{name: (kernel, signature, constexprs)}`` (kernels defined at
    module level, imported again there) in a fresh python without ``TRITON_INTERPRET``. Returns ``{name: None}``
    where the PTX holds the kernel's entry, else ``{name: the error}``; one failing kernel does not stop the others."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    by_path = {name: (f"{kernel.fn.__module__}:{kernel.fn.__name__}", signature, constexprs)
               for name, (kernel, signature, constexprs) in jobs.items()}
    done = subprocess.run([sys.executable, "-m", "hecate.testing", str(arch)], input=json.dumps(by_path), env=env,
                          capture_output=True, text=True, timeout=timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith(_RESULTS)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"compile_for_gpu_in_subprocess: exit {done.returncode}\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len(_RESULTS):])


_RESULTS = "compile_for_gpu results: "


def _compile_job(job: tuple[str, dict[str, str], dict], arch: int) -> str | None:
    import importlib
    import traceback

    where, signature, constexprs = job
    module, attr = where.split(":")
    kernel = getattr(importlib.import_module(module), attr)
    try:
        ptx = compile_for_gpu(kernel, signature, constexprs, arch)
    except Exception:  # noqa: BLE001 - reported per kernel to the test that asked
        return traceback.format_exc()[-3000:]
    return None if f".entry {attr}" in ptx else f"no .entry {attr} in the PTX"


def _compile_jobs_from_stdin(arch: int) -> None:
    """The subprocess of :func:`compile_for_gpu_in_subprocess`: compiles the jobs on every core (forked workers)."""
    import functools
    import json
    import multiprocessing
    import os
    import sys

    jobs = json.load(sys.stdin)
    workers = max(1, min(len(jobs), len(os.sched_getaffinity(0))))
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        errors = pool.map(functools.partial(_compile_job, arch=arch), list(jobs.values()), chunksize=1)
    print(_RESULTS + json.dumps(dict(zip(jobs, errors))))


if __name__ == "__main__":
    import sys

    _compile_jobs_from_stdin(int(sys.argv[1]))
