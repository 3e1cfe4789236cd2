"""memory_scan with ``decay_first``: the error read from the decayed memory, e = (1 − α_t) W_{t−1} k_t − v_t.

That is Gated DeltaNet's order (decay the memory, then run the delta rule on it). Every path (the CPU loop and
its chunked form, the Triton recurrent and chunk kernels under the interpreter, the ONNX Scan, the ATen
decomposition) against the float64 reference, forward and every gradient, alpha's included; the reference
against the recurrence written out by hand.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import hecate.lowering  # noqa: F401
from hecate.lowering.dispatch import triton_on_cpu
from hecate.lowering.memory_scan import chunk_kernels, chunked
from hecate.lowering.memory_scan.naive import memory_scan_naive
from hecate.testing import assert_close

from test_chunk_kernels import CASES as CHUNK_CASES, CHUNK, make_inputs, small_value_tiles  # noqa: F401
from test_memory_scan_beta import assert_onnx_scan_matches, small_chunks  # noqa: F401  (small_chunks: a fixture)
from test_memory_scan_kernels import poisoned_allocations  # noqa: F401  (a fixture)

op = torch.ops.hecate.memory_scan
NAMES = ("dk", "dv", "dq", "dalpha", "deta", "dm0")
HUBER = "abs(x);le(%0,1.0);sign(x);where(%1,x,%2)"  # g(e) = e where |e| <= 1, else sign(e)
# (p, bias): the delta rule (2e), the general l_p, a generated bias
CASES = {"p2": (2.0, ""), "p3": (3.0, ""), "huber": (2.0, HUBER)}


def _inputs(T=7, B=2, H=2, Dk=5, Dv=3, dtype=torch.float64, seed=0):
    """(k, v, q, alpha, eta, m0), leaves requiring grad; unit keys, α_t in (0, 1)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    k = r(B, T, H, Dk)
    k = k / k.norm(dim=-1, keepdim=True)
    xs = (k, r(B, T, H, Dv), r(B, T, H, Dk), torch.sigmoid(r(B, T, H) - 1), 0.4 * torch.sigmoid(r(B, T, H)),
          0.3 * r(B, H, Dv, Dk))
    return [x.requires_grad_() for x in xs]


def _call(fn, xs, case):
    p, bias = CASES[case]
    return fn(*xs, None, p, 10.0, 1e-6, 0.0, 2.0, bias, None, None, True)[:2]


def _check(fn, case, tol, dtype, T=7, context=contextlib.nullcontext):
    """``fn`` on the inputs in ``dtype`` against the float64 reference: y, m_final and the gradients of Σ w·out."""
    ref_in = _inputs(T=T)
    ref = _call(memory_scan_naive, ref_in, case)
    weights = [torch.randn_like(o) for o in ref]
    ref_grads = torch.autograd.grad(sum((o * w).sum() for o, w in zip(ref, weights)), ref_in)
    xs = [x.detach().to(dtype).requires_grad_() for x in ref_in]
    with context():
        out = _call(fn, xs, case)
        grads = torch.autograd.grad(sum((o * w.to(o.dtype)).sum() for o, w in zip(out, weights)), xs)
    for name, o, r in zip(("y", "m_final"), out, ref):
        assert_close(name, o, r, tol)
    for name, g, r in zip(NAMES, grads, ref_grads):
        assert_close(name, g, r, tol)


def test_reference_is_the_gated_delta_rule():
    """The reference against Gated DeltaNet written out: M ← a·M; M ← M − 2η (M k − v) kᵀ; y = M q."""
    k, v, q, alpha, eta, m0 = (x.detach() for x in _inputs())
    M, ys = m0, []
    for t in range(k.shape[1]):
        M = (1 - alpha[:, t, :, None, None]) * M
        e = (M @ k[:, t, :, :, None]) - v[:, t, :, :, None]
        M = M - 2 * eta[:, t, :, None, None] * e @ k[:, t, :, None, :]
        ys.append((M @ q[:, t, :, :, None])[..., 0])
    y, m_final, _ = memory_scan_naive(k, v, q, alpha, eta, m0, None, 2.0, decay_first=True)
    assert_close("y", y, torch.stack(ys, 1), 1e-12)
    assert_close("m_final", m_final, M, 1e-12)
    plain = memory_scan_naive(k, v, q, alpha, eta, m0, None, 2.0)[0]
    assert (plain - y).norm() > 1e-3 * y.norm(), "decay_first must change the recurrence"


@pytest.mark.parametrize("case", sorted(CASES))
def test_cpu_path_matches_the_reference(case, small_chunks):
    _check(op, case, 1e-12, torch.float64)


def test_cpu_path_at_a_chunked_length_runs_the_chunked_form(monkeypatch):
    """From chunked.MIN_T the p = 2 step runs in the chunked form, decay_first too (the error's decays P and γ
    instead of P⁻ and γ⁻), forward and backward, and equals the reference."""
    calls = []
    for name in ("forward", "backward"):
        original = getattr(chunked, name)
        monkeypatch.setattr(chunked, name, lambda *a, _f=original, _n=name, **kw: calls.append(_n) or _f(*a, **kw))
    _check(op, "p2", 1e-12, torch.float64, T=150)
    assert calls == ["forward", "backward"], calls


def _with_keep_zero(inputs):
    """The chunk cases' inputs with α = 1 (a keep factor of 0) at a token inside a chunk and at a chunk's first."""
    k, v, q, alpha, eta, m0, cu = inputs
    alpha = alpha.clone()
    alpha[:, 3::16] = 1.0
    return k, v, q, alpha, eta, m0, cu


@pytest.mark.parametrize("case", CHUNK_CASES, ids=lambda c: c.name)
def test_chunk_kernels_match_the_reference(case, small_value_tiles, poisoned_allocations):  # noqa: F811
    inputs64 = [x.requires_grad_() if isinstance(x, torch.Tensor) and x.is_floating_point() else x
                for x in _with_keep_zero(make_inputs(case))]
    y_ref, m_ref, _ = memory_scan_naive(*inputs64, decay_first=True)
    dy, dm = torch.randn_like(y_ref), torch.randn_like(m_ref)
    wrt = [x for x in inputs64[:6] if x is not None]
    grads_ref = torch.autograd.grad((y_ref * dy).sum() + (m_ref * dm).sum(), wrt)
    inputs = [x.detach().float() if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in inputs64]
    with triton_on_cpu():
        y, m, _ = chunk_kernels.forward(*inputs, chunk=CHUNK, decay_first=True)
        grads = chunk_kernels.backward(dy.float(), dm.float(), *inputs, chunk=CHUNK, decay_first=True)
    assert_close("y", y, y_ref, 1e-5)
    assert_close("m_final", m, m_ref, 1e-5)
    for name, g, r in zip(NAMES, [g for g, x in zip(grads, inputs64[:6]) if x is not None], grads_ref):
        assert_close(name, g, r, 1e-5)


@pytest.mark.parametrize("case", sorted(CASES))
def test_triton_kernels_match_the_reference(case, small_chunks, poisoned_allocations):
    _check(op, case, 1e-5, torch.float32, context=triton_on_cpu)


def test_chunks_carried_through_m_final_equal_the_whole():
    k, v, q, alpha, eta, m0 = (x.detach() for x in _inputs(T=10))
    run = lambda xs, m: op(*xs, m, None, 2.0, 10.0, 1e-6, 0.0, 2.0, "", None, None, True)  # noqa: E731
    whole = run((k, v, q, alpha, eta), m0)
    first = run([x[:, :6] for x in (k, v, q, alpha, eta)], m0)
    second = run([x[:, 6:] for x in (k, v, q, alpha, eta)], first[1])
    assert_close("y", torch.cat([first[0], second[0]], 1), whole[0], 1e-12)
    assert_close("m_final", second[1], whole[1], 1e-12)


def test_opcheck():
    k, v, q, alpha, eta, m0 = [x.detach().float().requires_grad_() for x in _inputs(T=4)]
    torch.library.opcheck(op.default, (k, v, q, alpha, eta, m0, None, 2.0, 10.0, 1e-6, 0.0, 2.0, "", None, None,
                                       True))


def test_decay_first_with_momentum_or_moneta_is_refused():
    k, v, q, alpha, eta, m0 = (x.detach() for x in _inputs())
    with pytest.raises(ValueError, match=r"decay_first .* needs momentum=0 and q_norm=2, got momentum=0.9"):
        op(k, v, q, alpha, eta, m0, None, 2.0, 10.0, 1e-6, 0.9, 2.0, "", None, None, True)
    with pytest.raises(ValueError, match=r"decay_first .* got momentum=0.0, q_norm=4.0"):
        op(k, v, q, alpha, eta, m0, None, 2.0, 10.0, 1e-6, 0.0, 4.0, "", None, None, True)


class _DecayFirst(torch.nn.Module):
    def forward(self, k, v, q, alpha, eta, m0):
        return op(k, v, q, alpha, eta, m0, None, 3.0, 10.0, 1e-6, 0.0, 2.0, "", None, None, True)


def test_onnx_scan_decays_before_the_error(tmp_path):
    args = tuple(x.detach().float() for x in _inputs())
    assert_onnx_scan_matches(_DecayFirst(), args, tmp_path / "memory_scan_decay_first.onnx", ("y", "m_final"))


def test_decomposition_is_the_reference():
    from hecate.lowering.memory_scan.export import memory_scan_decomposition

    k, v, q, alpha, eta, m0 = (x.detach() for x in _inputs())
    got = memory_scan_decomposition(k, v, q, alpha, eta, m0, None, 3.0, 10.0, 1e-6, 0.0, 2.0, "", None, None, True)
    for name, g, r in zip(("y", "m_final"), got, _DecayFirst()(k, v, q, alpha, eta, m0)):
        assert_close(name, g, r, 1e-12)
