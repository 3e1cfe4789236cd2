"""memory_scan's Triton kernels (under the interpreter on CPU) against the float64 reference."""

from __future__ import annotations

import pytest
import torch

import hecate.lowering  # noqa: F401
from hecate.lowering.dispatch import triton_on_cpu
from hecate.lowering.memory_scan import kernels
from hecate.lowering.memory_scan.naive import memory_scan_naive
from hecate.testing import assert_close, compile_for_gpu_in_subprocess, kernel_signature

from memory_scan_cases import CASES, GRAD_NAMES, Case, grads_of, make_inputs

op = torch.ops.hecate.memory_scan


@pytest.fixture
def small_blocks(monkeypatch):
    # two value tiles for Dv = 3 (partials summed) and several checkpoint segments at T = 7
    monkeypatch.setattr(kernels, "MAX_BLOCK_V", 2)
    monkeypatch.setattr(kernels, "MAX_BLOCK_V_BACKWARD", 2)
    monkeypatch.setattr(kernels, "CHUNK", 3)


@pytest.fixture
def poisoned_allocations(monkeypatch):
    """Every buffer the launcher allocates starts NaN: an element a kernel forgets to write shows."""
    empty, empty_like = torch.empty, torch.empty_like

    def nan_empty(*args, **kwargs):
        return empty(*args, **kwargs).fill_(float("nan"))

    def nan_empty_like(*args, **kwargs):
        return empty_like(*args, **kwargs).fill_(float("nan"))

    monkeypatch.setattr(kernels.torch, "empty", nan_empty)
    monkeypatch.setattr(kernels.torch, "empty_like", nan_empty_like)


def _to32(inputs):
    return [x.detach().float().requires_grad_() if isinstance(x, torch.Tensor) and x.is_floating_point() else x
            for x in inputs]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_triton_matches_reference(case, small_blocks, poisoned_allocations):
    inputs64 = make_inputs(case)
    inputs32 = _to32(inputs64)
    y_ref, m_ref = memory_scan_naive(*inputs64, *case.scalars())[:2]
    dy, dm = torch.randn_like(y_ref), torch.randn_like(m_ref)
    with triton_on_cpu():
        y, m, grads = grads_of(lambda *x: op(*x, *case.scalars()), inputs32, dy, dm)
    _, _, grads_ref = grads_of(lambda *x: memory_scan_naive(*x, *case.scalars()), inputs64, dy, dm)
    assert_close("y", y, y_ref, 1e-5)
    assert_close("m_final", m, m_ref, 1e-5)
    names = [n for n, x in zip(GRAD_NAMES, inputs64[:6]) if x is not None]
    for name, g, g_ref in zip(names, grads, grads_ref):
        assert_close(name, g, g_ref, 1e-5)


def test_triton_p2_without_retention_is_the_delta_rule():
    from test_memory_scan_op import delta_rule

    k, v, q, _, eta, m0, _ = [x.detach().float() if isinstance(x, torch.Tensor) else x for x in make_inputs(CASES[0])]
    with triton_on_cpu():
        y, m = op(k, v, q, torch.zeros_like(eta), eta, m0, None, 2.0, 10.0, 1e-6, 0.0, 2.0)[:2]
    y_ref, m_ref = delta_rule(k.double(), v.double(), q.double(), 2.0 * eta.double(), m0.double())
    assert_close("y", y, y_ref, 1e-6)
    assert_close("m_final", m, m_ref, 1e-6)


@pytest.mark.parametrize("dtype, tol", [(torch.float16, 2e-3), (torch.bfloat16, 1.5e-2)], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", [Case("p2.5_momentum", p=2.5, momentum=0.5), Case("moneta_p3_q4", p=3.0, q_norm=4.0),
                                  Case("varlen", p=2.5, momentum=0.3, cu_seqlens=(0, 3, 3, 7))], ids=lambda c: c.name)
def test_triton_half_inputs_keep_an_fp32_state(case, dtype, tol, small_blocks):
    """fp16/bf16 k, v, q (the kernels have no tl.dot, so the interpreter runs their bf16 loads, casts and stores as
    the GPU does): y in the input dtype, fp32 state, forward and gradients vs the float64 loop on the same
    (rounded) inputs."""
    inputs = [x.detach().to(dtype if i < 3 else torch.float32).requires_grad_()
              if isinstance(x, torch.Tensor) and x.is_floating_point() else x
              for i, x in enumerate(make_inputs(case))]
    reference_inputs = [x.detach().double().requires_grad_() if isinstance(x, torch.Tensor) and x.is_floating_point()
                        else x for x in inputs]
    y_ref, m_ref = memory_scan_naive(*reference_inputs, *case.scalars())[:2]
    dy, dm = torch.randn_like(y_ref), torch.randn_like(m_ref)
    with triton_on_cpu():
        y, m, grads = grads_of(lambda *x: op(*x, *case.scalars()), inputs, dy, dm)
    _, _, grads_ref = grads_of(lambda *x: memory_scan_naive(*x, *case.scalars()), reference_inputs, dy, dm)
    assert y.dtype == dtype and m.dtype == torch.float32
    assert_close("y", y, y_ref, tol)
    assert_close("m_final", m, m_ref, 1e-5)
    names = [n for n, x in zip(GRAD_NAMES, inputs[:6]) if x is not None]
    for name, g, g_ref in zip(names, grads, grads_ref):
        assert g.dtype == inputs[GRAD_NAMES.index(name)].dtype
        assert_close(name, g, g_ref, tol)


def test_opcheck_triton():
    case = Case("p2.5_momentum", p=2.5, momentum=0.5, T=3)
    k, v, q, alpha, eta, m0, _ = [x.detach() if isinstance(x, torch.Tensor) else x
                                  for x in make_inputs(case, dtype=torch.float32, B=1, H=1)]
    with triton_on_cpu():
        torch.library.opcheck(op.default, (k, v, q, alpha, eta, m0, None, *case.scalars()),
                              test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", [Case("p2", T=300), Case("p3", p=3.0, T=300), Case("p1", p=1.0, T=300),
                                  Case("moneta", p=3.0, q_norm=4.0, T=300),
                                  Case("varlen", p=2.5, momentum=0.3, cu_seqlens=(0, 100, 100, 300))],
                         ids=lambda c: c.name)
def test_cuda_matches_reference(case, dtype):
    inputs64 = make_inputs(case, B=2, H=2, Dk=64, Dv=48, unit_keys=True)
    inputs = [x.detach().to("cuda", dtype if i < 3 else torch.float32).requires_grad_()
              if isinstance(x, torch.Tensor) and x.is_floating_point() else (x.cuda() if x is not None else None)
              for i, x in enumerate(inputs64)]
    y_ref, m_ref = memory_scan_naive(*inputs64, *case.scalars())[:2]
    dy, dm = torch.randn_like(y_ref), torch.randn_like(m_ref)
    y, m, grads = grads_of(lambda *x: op(*x, *case.scalars()), inputs, dy.cuda(), dm.cuda())
    _, _, grads_ref = grads_of(lambda *x: memory_scan_naive(*x, *case.scalars()), inputs64, dy, dm)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert_close("y", y.cpu(), y_ref, tol)
    assert_close("m_final", m.cpu(), m_ref, tol)
    names = [n for n, x in zip(GRAD_NAMES, inputs64[:6]) if x is not None]
    for name, g, g_ref in zip(names, grads, grads_ref):
        assert_close(name, g.cpu(), g_ref, tol)


# memory_scan's argument types as the launcher passes them (k, v, q, y and their gradients in the input dtype; the
# states, the gates and the state gradients fp32)
_SCALAR_TYPES = {"T": "i32", "ROWS": "i32", "p": "fp32", "a": "fp32", "eps": "fp32", "momentum": "fp32",
                 "q_norm": "fp32", "cu_seqlens": "*i32"}
_INPUT_DTYPE = {"k", "v", "q", "y", "dy", "dv"}


def _memory_scan_types(kernel, constexprs, dtype):
    return {n: _SCALAR_TYPES.get(n, f"*{dtype}" if n in _INPUT_DTYPE else "*fp32")
            for n in kernel.arg_names if n not in constexprs}


def test_kernels_compile_for_a_gpu_without_one():
    """The interpreter accepts code the GPU compiler rejects: compile both kernels to PTX for sm_90, each
    constexpr branch once (general p + momentum with a carried buffer + packed; p = 1 + MONETA; p = 2 + Hebbian),
    each in bf16, fp16 and fp32."""
    try:
        import triton.backends.nvidia  # noqa: F401
    except ImportError:
        pytest.skip("triton has no NVIDIA backend here")
    jobs = {}
    for dtype in ("bf16", "fp16", "fp32"):
        for p_mode, momentum, lq, varlen, hebbian in [(0, True, False, True, False), (1, False, True, False, False),
                                                      (2, False, False, False, True)]:
            common = dict(H=4, DK=64, DV=64, BK=64, CHUNK=32, P_MODE=p_mode, USE_MOMENTUM=momentum, LQ=lq,
                          VARLEN=varlen, HEBBIAN=hebbian, BIAS=None)
            fwd = dict(common, BV=64 if lq else 32, HAS_M0=True, HAS_S0=momentum, STORE_Y=True, STORE_FINAL=True,
                       STORE_CKPT=True)
            bwd = dict(common, BV=64 if lq else 16, BIAS_DERIVATIVE=None)
            for kernel, constexprs in [(kernels.memory_scan_fwd_kernel, fwd), (kernels.memory_scan_bwd_kernel, bwd)]:
                signature = kernel_signature(kernel, constexprs, _memory_scan_types(kernel, constexprs, dtype))
                jobs[f"{kernel.fn.__name__} P_MODE={p_mode} {dtype}"] = (kernel, signature, constexprs)
    errors = {name: error for name, error in compile_for_gpu_in_subprocess(jobs, arch=90).items() if error}
    assert not errors, "\n".join(f"{name}:\n{error}" for name, error in errors.items())
