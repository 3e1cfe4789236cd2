"""The chunk kernels of the delta rule and the Hebbian recurrence (under the interpreter on CPU) against the
float64 per-token recurrences: forward y and final state, the chunked backward's gradients, and the op dispatch
that takes them."""

from __future__ import annotations

import dataclasses
from typing import Optional

import pytest
import torch

import hecate.lowering  # noqa: F401
from hecate.lowering.dispatch import triton_on_cpu
from hecate.lowering.linear_attention.naive import linear_attention_naive
from hecate.lowering.memory_scan import chunk_kernels, chunked
from hecate.lowering.memory_scan.naive import memory_scan_naive
from hecate.testing import assert_close, assert_close_nonfinite

from test_memory_scan_kernels import poisoned_allocations  # noqa: F401  (a fixture)

CHUNK = 16  # small chunks keep the interpreter fast; T = 67 and 130 still span several, with a tail
DK, DV = 12, 20  # neither a power of two; Dv spans two value tiles of 16 (see small_value_tiles)


@pytest.fixture
def small_value_tiles(monkeypatch):
    monkeypatch.setattr(chunk_kernels, "MAX_BLOCK_V", 16)


@dataclasses.dataclass(frozen=True)
class ChunkCase:
    name: str
    T: int
    gates: str = "data"          # "data": sigmoid of noise per token; "fixed": one α, η expanded;
    #                              "no_forget": α = 0; "keep0": data with α = 1 (keep factor 0) at some tokens
    with_m0: bool = True
    cu_seqlens: Optional[tuple[int, ...]] = None  # packed (B = 1); lengths may be 0


CASES = [
    ChunkCase("T1", 1),
    ChunkCase("T5_fixed_no_m0", 5, gates="fixed", with_m0=False),
    ChunkCase("T64_no_forget", 64, gates="no_forget"),
    ChunkCase("T67_keep0", 67, gates="keep0"),
    ChunkCase("T130", 130),
    ChunkCase("varlen", 70, cu_seqlens=(0, 21, 21, 53, 70)),  # lengths 21, 0, 32, 17: chunks restart per sequence
]


def make_inputs(case: ChunkCase, dtype=torch.float64, dk=DK, dv=DV):
    """(k, v, q, alpha, eta, m0, cu_seqlens); B = 2, H = 1 unpacked, B = 1, H = 2 packed."""
    B, H = (2, 1) if case.cu_seqlens is None else (1, 2)
    T = case.T
    k = torch.randn(B, T, H, dk, dtype=dtype) * 1.4 / dk ** 0.5  # ‖k‖ ≈ 1.4: 2η‖k‖² < 2 keeps the delta rule stable
    v = torch.randn(B, T, H, dv, dtype=dtype)
    q = torch.randn(B, T, H, dk, dtype=dtype)
    if case.gates == "fixed":
        alpha, eta = torch.full((B, T, H), 0.1, dtype=dtype), torch.full((B, T, H), 0.15, dtype=dtype)
    else:
        alpha = torch.sigmoid(torch.randn(B, T, H, dtype=dtype) - 2.0)
        eta = 0.3 * torch.sigmoid(torch.randn(B, T, H, dtype=dtype))
    if case.gates == "no_forget":
        alpha = torch.zeros_like(alpha)
    if case.gates == "keep0":
        alpha[:, 2::7] = 1.0  # every 7th token from t = 2: inside chunks, at a chunk's first (t = 16), in the tail
        alpha[:, 31] = 1.0    # and at a chunk's last token
    n_states = B if case.cu_seqlens is None else len(case.cu_seqlens) - 1
    m0 = torch.randn(n_states, H, dv, dk, dtype=dtype) * 0.3 if case.with_m0 else None
    cu = torch.tensor(case.cu_seqlens, dtype=torch.int32) if case.cu_seqlens is not None else None
    return k, v, q, alpha, eta, m0, cu


def hebbian_reference(k, v, q, alpha, eta, m0, cu_seqlens):
    """(y, m_final) of A ← (1 − α) A + η v kᵀ, y = A q: linear attention with keep 1 − α and values η v."""
    if cu_seqlens is None:
        return linear_attention_naive(k, eta[..., None] * v, q, 1.0 - alpha, m0)[:2]
    bounds = cu_seqlens.tolist()
    parts = [hebbian_reference(k[:, bos:eos], v[:, bos:eos], q[:, bos:eos], alpha[:, bos:eos], eta[:, bos:eos],
                               None if m0 is None else m0[n:n + 1], None)
             for n, (bos, eos) in enumerate(zip(bounds[:-1], bounds[1:]))]
    return torch.cat([y for y, _ in parts], 1), torch.cat([m for _, m in parts], 0)


def delta_reference(k, v, q, alpha, eta, m0, cu_seqlens):
    return memory_scan_naive(k, v, q, alpha, eta, m0, cu_seqlens)[:2]


def _as(inputs, dtype, kvq_dtype=None):
    """Floating inputs in ``dtype`` (k, v, q in ``kvq_dtype`` when given), as fresh leaves needing grad."""
    return [x.detach().to(kvq_dtype if kvq_dtype is not None and i < 3 else dtype).requires_grad_()
            if isinstance(x, torch.Tensor) and x.is_floating_point() else x for i, x in enumerate(inputs)]


@pytest.mark.parametrize("hebbian", [False, True], ids=["delta", "hebbian"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_forward_matches_recurrence(case, hebbian, small_value_tiles, poisoned_allocations):  # noqa: F811
    inputs64 = make_inputs(case)
    y_ref, m_ref = (hebbian_reference if hebbian else delta_reference)(*inputs64)
    y, m, s = chunk_kernels.forward(*[x.detach() if x is not None else None for x in _as(inputs64, torch.float32)],
                                    hebbian=hebbian, chunk=CHUNK)
    assert_close("y", y, y_ref, 1e-5)
    assert_close("m_final", m, m_ref, 1e-5)
    assert s.numel() == 0


GRAD_NAMES = ["dk", "dv", "dq", "dalpha", "deta", "dm0"]


def _chunk_gradients(inputs, dy, dm, hebbian):
    """Gradients of ⟨y, dy⟩ + ⟨m_final, dm⟩ from the chunk kernels (the zeros-shaped dm0 without m0 is dropped)."""
    grads = chunk_kernels.backward(dy.float(), dm.float(), *inputs, hebbian=hebbian, chunk=CHUNK)
    return [g for g, x in zip(grads, inputs[:6]) if x is not None]


@pytest.mark.parametrize("hebbian", [False, True], ids=["delta", "hebbian"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_backward_matches_recurrence(case, hebbian, small_value_tiles, poisoned_allocations):  # noqa: F811
    inputs64 = _as(make_inputs(case), torch.float64)
    y_ref, m_ref = (hebbian_reference if hebbian else delta_reference)(*inputs64)
    dy, dm = torch.randn_like(y_ref), torch.randn_like(m_ref)
    wrt = [x for x in inputs64[:6] if x is not None]
    grads_ref = torch.autograd.grad((y_ref * dy).sum() + (m_ref * dm).sum(), wrt)
    grads = _chunk_gradients([x.detach() if x is not None else None for x in _as(inputs64, torch.float32)], dy, dm,
                             hebbian)
    names = [n for n, x in zip(GRAD_NAMES, inputs64[:6]) if x is not None]
    for name, g, g_ref in zip(names, grads, grads_ref):
        assert_close(name, g, g_ref, 1e-5)


@pytest.mark.parametrize("hebbian", [False, True], ids=["delta", "hebbian"])
@pytest.mark.parametrize("dtype, tol", [(torch.float16, 2e-3), (torch.bfloat16, 1.5e-2)], ids=["fp16", "bf16"])
def test_half_inputs_keep_an_fp32_state(dtype, tol, hebbian, small_value_tiles):
    """fp16/bf16 k, v, q: y and the gradients of k, v, q in the input dtype, the fp32 state and the gate and state
    gradients fp32, all against the float64 recurrence on the same (rounded) inputs."""
    case = ChunkCase("T67", 67, cu_seqlens=(0, 30, 67))
    inputs = [x.detach() if x is not None else None for x in _as(make_inputs(case), torch.float32, dtype)]
    reference_inputs = _as(inputs, torch.float64)
    y_ref, m_ref = (hebbian_reference if hebbian else delta_reference)(*reference_inputs)
    y, m, _ = chunk_kernels.forward(*inputs, hebbian=hebbian, chunk=CHUNK)
    assert y.dtype == dtype and m.dtype == torch.float32
    assert_close("y", y, y_ref, tol)
    assert_close("m_final", m, m_ref, 1e-5)
    dy, dm = torch.randn_like(y_ref), torch.randn_like(m_ref)
    grads_ref = torch.autograd.grad((y_ref * dy).sum() + (m_ref * dm).sum(), reference_inputs[:6])
    for name, g, g_ref, x in zip(GRAD_NAMES, _chunk_gradients(inputs, dy, dm, hebbian), grads_ref, inputs):
        assert g.dtype == x.dtype
        assert_close(name, g, g_ref, tol)


@pytest.mark.parametrize("hebbian", [False, True], ids=["delta", "hebbian"])
def test_nan_key_propagates_as_in_the_recurrence(hebbian):
    """A NaN key entry at token 20 (chunk 16..31) of batch 0: y is NaN exactly where the recurrence's is from
    token 20 on (all of batch 0) and before the chunk (nowhere), and so is m_final; the finite rest agrees. (The
    chunk's own tokens 16..19 may turn NaN too: its matrix products mix its tokens.)"""
    k, v, q, alpha, eta, m0, _ = make_inputs(ChunkCase("T40", 40))
    k[0, 20, 0, 5] = float("nan")
    y_ref, m_ref = (hebbian_reference if hebbian else delta_reference)(k, v, q, alpha, eta, m0, None)
    y, m, _ = chunk_kernels.forward(k.float(), v.float(), q.float(), alpha.float(), eta.float(), m0.float(), None,
                                    hebbian=hebbian, chunk=CHUNK)
    assert bool(torch.isnan(y_ref[0, 20:]).all())
    assert_close_nonfinite("y before the chunk", y[:, :CHUNK], y_ref[:, :CHUNK], 1e-5)
    assert_close_nonfinite("y from token 20", y[:, 20:], y_ref[:, 20:], 1e-5)
    assert_close_nonfinite("m_final", m, m_ref, 1e-5)


def test_chunk_must_be_a_power_of_two_of_at_least_16():
    k, v, q, alpha, eta, m0, _ = [x.float() if x is not None else None for x in make_inputs(ChunkCase("T5", 5))]
    with pytest.raises(ValueError, match="chunk must be a power of two >= 16, got 24"):
        chunk_kernels.forward(k, v, q, alpha, eta, m0, None, chunk=24)


@pytest.fixture
def chunk_calls(monkeypatch):
    """Chunked dispatch from T = chunked.MIN_T with chunks of CHUNK tokens; counts the chunk kernels' launches."""
    monkeypatch.setattr(chunked, "CHUNK", CHUNK)
    calls = []
    for name in ("forward", "backward"):
        original = getattr(chunk_kernels, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(chunk_kernels, name, counted)
    return calls


def test_memory_scan_delta_rule_takes_the_chunk_kernels(chunk_calls, small_value_tiles):
    """torch.ops.hecate.memory_scan at p = 2, T = 67 >= MIN_T, packed: forward and backward through the chunk
    kernels; y, m_final and every gradient equal the recurrence."""
    case = ChunkCase("varlen", 67, cu_seqlens=(0, 40, 67))
    inputs64 = _as(make_inputs(case), torch.float64)
    inputs32 = _as(inputs64, torch.float32)
    y_ref, m_ref = delta_reference(*inputs64)
    dy, dm = torch.randn_like(y_ref), torch.randn_like(m_ref)
    with triton_on_cpu():
        y, m, _ = torch.ops.hecate.memory_scan(*inputs32)
        grads = torch.autograd.grad((y * dy.float()).sum() + (m * dm.float()).sum(), inputs32[:6])
    assert chunk_calls == ["forward", "backward"]
    assert_close("y", y, y_ref, 1e-5)
    assert_close("m_final", m, m_ref, 1e-5)
    grads_ref = torch.autograd.grad((y_ref * dy).sum() + (m_ref * dm).sum(), inputs64[:6])
    for name, g, g_ref in zip(GRAD_NAMES, grads, grads_ref):
        assert_close(name, g, g_ref, 1e-5)


def test_non_finite_inputs_take_the_recurrent_kernels_and_stay_eager_exact(chunk_calls, small_value_tiles):
    """A NaN key at token 50 of batch 0 (T = 67, chunks of 16): the op sends it to the fused-recurrent
    kernels, so the tokens before 50 stay finite and equal the recurrence, as in eager."""
    inputs = make_inputs(ChunkCase("T67", 67))
    inputs[0][0, 50, 0, 5] = float("nan")
    y_ref, m_ref = delta_reference(*_as(inputs, torch.float64))
    inputs = _as(inputs, torch.float32)
    with triton_on_cpu():
        y, m, _ = torch.ops.hecate.memory_scan(*inputs)
    assert chunk_calls == []
    assert bool(torch.isfinite(y[0, :50]).all()) and bool(torch.isnan(y_ref[0, 50:]).all())
    assert_close_nonfinite("y", y, y_ref, 1e-5)
    assert_close_nonfinite("m_final", m, m_ref, 1e-5)


def test_normalised_linear_attention_takes_the_chunk_kernels(chunk_calls, small_value_tiles):
    """torch.ops.hecate.linear_attention, causal and normalised (values [v, 1]), T = 67: forward and backward
    through the chunk kernels; y, M, z and the gradients of k, v, q, α, m0, z0 equal the recurrence."""
    B, T, H = 2, 67, 1
    k = torch.rand(B, T, H, DK, dtype=torch.float64)  # positive features keep z · q away from 0
    v, q = torch.randn(B, T, H, DV, dtype=torch.float64), torch.rand(B, T, H, DK, dtype=torch.float64)
    alpha = torch.sigmoid(torch.randn(B, T, H, dtype=torch.float64) + 2.0)
    m0, z0 = torch.randn(B, H, DV, DK, dtype=torch.float64), torch.rand(B, H, DK, dtype=torch.float64)
    inputs64 = _as((k, v, q, alpha, m0, z0), torch.float64)
    inputs32 = _as(inputs64, torch.float32)
    outputs_ref = linear_attention_naive(*inputs64, normalize=True)
    cotangents = [torch.randn_like(x) for x in outputs_ref]
    with triton_on_cpu():
        outputs = torch.ops.hecate.linear_attention(*inputs32, True, 1e-6, True)
        grads = torch.autograd.grad(sum((x * c.float()).sum() for x, c in zip(outputs, cotangents)), inputs32)
    assert "forward" in chunk_calls and "backward" in chunk_calls
    for name, x, x_ref in zip(("y", "m_final", "z_final"), outputs, outputs_ref):
        assert_close(name, x, x_ref, 1e-5)
    grads_ref = torch.autograd.grad(sum((x * c).sum() for x, c in zip(outputs_ref, cotangents)), inputs64)
    for name, g, g_ref in zip(("dk", "dv", "dq", "dalpha", "dm0", "dz0"), grads, grads_ref):
        assert_close(name, g, g_ref, 1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("hebbian", [False, True], ids=["delta", "hebbian"])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", [ChunkCase("T300", 300), ChunkCase("varlen", 300, cu_seqlens=(0, 100, 100, 300))],
                         ids=lambda c: c.name)
def test_cuda_matches_recurrence(case, dtype, tol, hebbian):
    """On a GPU, at the op's chunk size (chunked.CHUNK) and head sizes Dk = 64, Dv = 48: y, m_final and the
    gradients against the float64 recurrence."""
    inputs64 = _as(make_inputs(case, dk=64, dv=48), torch.float64)
    inputs = [x.detach().to("cuda") if x is not None else None for x in _as(inputs64, torch.float32, dtype)]
    y_ref, m_ref = (hebbian_reference if hebbian else delta_reference)(*inputs64)
    dy, dm = torch.randn_like(y_ref), torch.randn_like(m_ref)
    y, m, _ = chunk_kernels.forward(*inputs, hebbian=hebbian)
    grads = chunk_kernels.backward(dy.float().cuda(), dm.float().cuda(), *inputs, hebbian=hebbian)
    grads_ref = torch.autograd.grad((y_ref * dy).sum() + (m_ref * dm).sum(), inputs64[:6])
    assert_close("y", y.cpu(), y_ref, tol)
    assert_close("m_final", m.cpu(), m_ref, tol)
    for name, g, g_ref in zip(GRAD_NAMES, grads, grads_ref):
        assert_close(name, g.cpu(), g_ref, tol)
