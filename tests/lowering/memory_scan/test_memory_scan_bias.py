"""memory_scan with the user's own bias gradient g(e) (a pointwise expression): CPU path, Triton kernels
under the interpreter, opcheck and export, forward and gradients against a plain PyTorch loop calling g."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import hecate
import hecate.lowering  # noqa: F401
from hecate.lowering import pointwise
from hecate.lowering.dispatch import triton_on_cpu
from hecate.lowering.memory_scan import kernels
from hecate.testing import assert_close

from memory_scan_cases import GRAD_NAMES, Case, grads_of, make_inputs

op = torch.ops.hecate.memory_scan

BIASES = {
    "huber": lambda e: torch.where(e.abs() <= 0.5, e, 0.5 * torch.sign(e)),        # ∂ Huber(δ = 0.5)
    "p3_abs_sign": lambda e: 3 * e.abs() ** 2 * torch.sign(e),                     # ∂|e|³, exact
    "invented": lambda e: torch.tanh(2 * e) * (1 + 0.5 * e.square()) + 0.1 * F.softplus(e) - 0.1 * F.softplus(-e),
}


def reference(k, v, q, alpha, eta, m0, g, momentum=0.0):
    """The memory loop written plainly with the user's g: e = M k − v ; M ← (1 − α) M − η g(e) kᵀ ; y = M q."""
    B, T, H, Dk = k.shape
    M = m0.clone() if m0 is not None else k.new_zeros(B, H, v.shape[-1], Dk)
    S = torch.zeros_like(M)
    ys = []
    for t in range(T):
        e = torch.einsum("bhvk,bhk->bhv", M, k[:, t]) - v[:, t]
        U = g(e)[..., None] * k[:, t, :, None, :]
        if momentum:
            S = momentum * S - eta[:, t, :, None, None] * U
            M = (1 - alpha[:, t, :, None, None]) * M + S
        else:
            M = (1 - alpha[:, t, :, None, None]) * M - eta[:, t, :, None, None] * U
        ys.append(torch.einsum("bhvk,bhk->bhv", M, q[:, t]))
    return torch.stack(ys, 1), M


def scalars(name: str, momentum: float = 0.0):
    # p, a are ignored with a bias (p = 7 would give different results if they were read)
    return (7.0, 3.0, 1e-6, momentum, 2.0, pointwise.trace(BIASES[name]))


def check(name: str, run, inputs64, dtype, tol, momentum=0.0):
    inputs = [x.detach().to(dtype).requires_grad_() if isinstance(x, torch.Tensor) and x.is_floating_point() else x
              for x in inputs64]
    y_ref, m_ref = reference(*(x.detach() if x is not None else None for x in inputs64[:6]), BIASES[name], momentum)
    dy, dm = torch.randn_like(y_ref), torch.randn_like(m_ref)
    y_ref, m_ref, grads_ref = grads_of(lambda *x: reference(*x[:6], BIASES[name], momentum), inputs64, dy, dm)
    y, m, grads = grads_of(lambda *x: run(*x, *scalars(name, momentum)), inputs, dy, dm)
    assert_close(f"{name} y", y, y_ref, tol)
    assert_close(f"{name} m_final", m, m_ref, tol)
    for grad_name, g, g_ref in zip(GRAD_NAMES, grads, grads_ref):
        assert_close(f"{name} {grad_name}", g, g_ref, tol)


@pytest.mark.parametrize("name", BIASES)
def test_cpu_path_matches_the_plain_loop(name):
    check(name, op, make_inputs(Case("bias")), torch.float64, 1e-10)


@pytest.mark.parametrize("name", BIASES)
def test_triton_matches_the_plain_loop(name, monkeypatch):
    monkeypatch.setattr(kernels, "MAX_BLOCK_V", 2)            # two value tiles, three checkpoint segments
    monkeypatch.setattr(kernels, "MAX_BLOCK_V_BACKWARD", 2)
    monkeypatch.setattr(kernels, "CHUNK", 3)
    with triton_on_cpu():
        check(name, op, make_inputs(Case("bias")), torch.float32, 1e-5)


def test_triton_with_momentum():
    with triton_on_cpu():
        check("huber", op, make_inputs(Case("bias")), torch.float32, 1e-5, momentum=0.4)


def test_bias_2e_equals_the_p2_fast_path():
    inputs = make_inputs(Case("p2"))
    y_fast, m_fast = op(*inputs, 2.0, 10.0, 1e-6, 0.0, 2.0)[:2]
    y, m = op(*inputs, 2.0, 10.0, 1e-6, 0.0, 2.0, pointwise.trace(lambda e: e + e))[:2]
    assert_close("y", y, y_fast, 1e-12)
    assert_close("m_final", m, m_fast, 1e-12)


def test_opcheck_with_a_bias():
    k, v, q, alpha, eta, m0, _ = make_inputs(Case("bias", T=4), dtype=torch.float32)
    torch.library.opcheck(op.default, (k, v, q, alpha, eta, m0, None, *scalars("invented")))
    with triton_on_cpu():
        torch.library.opcheck(op.default, (k, v, q, alpha, eta, m0, None, *scalars("huber")),
                              test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def test_a_malformed_bias_is_refused():
    k, v, q, alpha, eta, m0, _ = make_inputs(Case("bias"), dtype=torch.float32)
    with pytest.raises(ValueError, match="memory_scan: bias must be '' or a pointwise expression.*unknown operation"):
        op(k, v, q, alpha, eta, m0, None, 2.0, 10.0, 1e-6, 0.0, 2.0, "cosh(x)")


class BiasScan(torch.nn.Module):
    def forward(self, k, v, q, alpha, eta, m0):
        return op(k, v, q, alpha, eta, m0, None, *scalars("invented"))[:2]


def test_onnx_export_with_a_bias(tmp_path):
    import onnxruntime

    args = tuple(x.detach() for x in make_inputs(Case("bias"), dtype=torch.float32)[:6])
    path = tmp_path / "bias.onnx"
    hecate.export_onnx(BiasScan(), args, path)
    session = onnxruntime.InferenceSession(str(path))
    y_onnx, m_onnx = session.run(None, {i.name: a.numpy() for i, a in zip(session.get_inputs(), args)})
    y, m = reference(*args, BIASES["invented"])
    assert_close("y", torch.from_numpy(y_onnx), y, 1e-5)
    assert_close("m_final", torch.from_numpy(m_onnx), m, 1e-5)


def test_mlir_export_with_a_bias():
    args = tuple(x.detach() for x in make_inputs(Case("bias", T=3), dtype=torch.float32)[:6])
    text = hecate.export_mlir(BiasScan(), args, output_type="torch")
    assert "hecate" not in text and "torch.aten.tanh" in text


_COMPILE_WITH_A_BIAS = """
import torch
from hecate.lowering import pointwise
from hecate.lowering.memory_scan import kernels
from hecate.testing import compile_for_gpu, kernel_signature
bias = pointwise.trace(lambda e: torch.where(e.abs() <= 0.5, e, 0.5 * torch.sign(e)) + torch.tanh(e))
# the backward kernel holds both: g in its recomputation (the forward's _memory_step) and g'
constexprs = dict(H=4, DK=64, DV=64, BK=64, BV=16, CHUNK=32, P_MODE=3, USE_MOMENTUM=False, LQ=False, VARLEN=False,
                  HEBBIAN=False, BIAS=pointwise.triton_function(bias),
                  BIAS_DERIVATIVE=pointwise.triton_function(pointwise.derivative(bias)))
scalars = {"T": "i32", "ROWS": "i32", "p": "fp32", "a": "fp32", "eps": "fp32", "momentum": "fp32",
           "q_norm": "fp32", "cu_seqlens": "*i32"}
kernel = kernels.memory_scan_bwd_kernel
types = {n: scalars.get(n, "*fp32") for n in kernel.arg_names if n not in constexprs}
ptx = compile_for_gpu(kernel, kernel_signature(kernel, constexprs, types), constexprs)
assert ".entry memory_scan_bwd_kernel" in ptx
print("compiled")
"""


def test_kernels_with_a_bias_compile_for_a_gpu_without_one():
    """The generated g and g' inside the backward kernel compile to PTX for sm_90 (in a python without TRITON_INTERPRET)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    try:
        import triton.backends.nvidia  # noqa: F401
    except ImportError:
        pytest.skip("triton has no NVIDIA backend here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(hecate.__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", _COMPILE_WITH_A_BIAS], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
