"""memory_scan: the CPU path and the reference, forward and every gradient, and bad inputs."""

from __future__ import annotations

import pytest
import torch

import hecate.lowering  # noqa: F401  (registers the op)
from hecate.lowering.dispatch import triton_on_cpu
from hecate.lowering.memory_scan import cpu, kernels
from hecate.lowering.memory_scan.naive import memory_scan_naive
from hecate.testing import assert_close

from memory_scan_cases import CASES, GRAD_NAMES, Case, grads_of, make_inputs

op = torch.ops.hecate.memory_scan


def _op_fn(case):
    return lambda *x: op(*x, *case.scalars())


def _naive_fn(case):
    return lambda *x: memory_scan_naive(*x, *case.scalars())[:2]


@pytest.fixture
def small_chunk(monkeypatch):
    # several checkpoint segments even at T = 7
    monkeypatch.setattr(cpu, "CHUNK", 3)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_cpu_path_matches_reference_float64(case, small_chunk):
    inputs = make_inputs(case)
    y_ref, m_ref = memory_scan_naive(*inputs, *case.scalars())[:2]
    dy, dm = torch.randn_like(y_ref), torch.randn_like(m_ref)
    y, m, grads = grads_of(_op_fn(case), inputs, dy, dm)
    _, _, grads_ref = grads_of(_naive_fn(case), inputs, dy, dm)
    assert_close("y", y, y_ref, 1e-12)
    assert_close("m_final", m, m_ref, 1e-12)
    names = [n for n, x in zip(GRAD_NAMES, inputs[:6]) if x is not None]
    for name, g, g_ref in zip(names, grads, grads_ref):
        assert_close(name, g, g_ref, 1e-11)


@pytest.mark.parametrize("case", [CASES[3], CASES[4]], ids=lambda c: c.name)
def test_cpu_path_float32_matches_float64_reference(case):
    inputs64 = make_inputs(case)
    inputs32 = [x.detach().float().requires_grad_() if x is not None and x.is_floating_point() else x
                for x in inputs64]
    y_ref, m_ref = memory_scan_naive(*inputs64, *case.scalars())[:2]
    dy, dm = torch.randn_like(y_ref), torch.randn_like(m_ref)
    y, m, grads = grads_of(_op_fn(case), inputs32, dy, dm)
    _, _, grads_ref = grads_of(_naive_fn(case), inputs64, dy, dm)
    assert y.dtype == torch.float32 and m.dtype == torch.float32
    assert_close("y", y, y_ref, 1e-5)
    assert_close("m_final", m, m_ref, 1e-5)
    for name, g, g_ref in zip(GRAD_NAMES, grads, grads_ref):
        assert_close(name, g, g_ref, 1e-5)


@pytest.mark.parametrize("case", [Case("p2.5_momentum", p=2.5, momentum=0.5, T=3),
                                  Case("p1", p=1.0, T=3), Case("moneta", p=3.0, q_norm=4.0, T=3)],
                         ids=lambda c: c.name)
def test_reference_gradcheck_float64(case):
    k, v, q, alpha, eta, m0, _ = make_inputs(case, B=1, H=1, Dk=3, Dv=2)
    assert torch.autograd.gradcheck(lambda *x: memory_scan_naive(*x, None, *case.scalars()),
                                    (k, v, q, alpha, eta, m0))


def test_op_gradcheck_float64():
    case = Case("p2.5_momentum", p=2.5, momentum=0.5, T=4)
    k, v, q, alpha, eta, m0, _ = make_inputs(case, B=1, H=1, Dk=3, Dv=2)
    assert torch.autograd.gradcheck(lambda *x: op(*x, None, *case.scalars()), (k, v, q, alpha, eta, m0))


def delta_rule(k, v, q, beta, m0):
    """The classic delta rule, written independently: M ← M + β_t (v_t − M k_t) k_tᵀ ; y_t = M q_t."""
    B, T, H, _ = k.shape
    M = m0.clone()
    ys = []
    for t in range(T):
        for b in range(B):
            for h in range(H):
                kt, vt = k[b, t, h], v[b, t, h]
                M[b, h] = M[b, h] + beta[b, t, h] * torch.outer(vt - M[b, h] @ kt, kt)
        ys.append(torch.einsum("bhvk,bhk->bhv", M, q[:, t]))
    return torch.stack(ys, 1), M


def test_p2_without_retention_is_the_delta_rule():
    k, v, q, _, eta, m0, _ = (x.detach() if isinstance(x, torch.Tensor) else x for x in make_inputs(CASES[0]))
    y, m = op(k, v, q, torch.zeros_like(eta), eta, m0, None, 2.0, 10.0, 1e-6, 0.0, 2.0)[:2]
    y_ref, m_ref = delta_rule(k, v, q, 2.0 * eta, m0)
    assert_close("y", y, y_ref, 1e-12)
    assert_close("m_final", m, m_ref, 1e-12)


def test_opcheck_cpu():
    case = Case("p2.5_momentum", p=2.5, momentum=0.5, T=5)
    k, v, q, alpha, eta, m0, _ = make_inputs(case, dtype=torch.float32)
    torch.library.opcheck(op.default, (k, v, q, alpha, eta, m0, None, *case.scalars()))
    torch.library.opcheck(op.default, (k, v, q, alpha, eta, None, None, 1.0, 10.0, 1e-6, 0.0, 2.0))
    kp, vp, qp, ap, ep, m0p, cu = make_inputs(CASES[-1], dtype=torch.float32)
    torch.library.opcheck(op.default, (kp, vp, qp, ap, ep, m0p, cu, *CASES[-1].scalars()))
    y = torch.randn(2, 5, 2, 3)
    torch.library.opcheck(torch.ops.hecate.memory_scan_backward.default,
                          (y, torch.randn(2, 2, 3, 5), k.detach(), v.detach(), q.detach(), alpha.detach(),
                           eta.detach(), m0.detach(), None, *case.scalars()))


def test_compiled_call_matches_eager(fresh_dynamo):
    case = CASES[3]
    inputs = make_inputs(case, dtype=torch.float32)
    compiled = torch.compile(lambda *x: op(*x, *case.scalars()), backend="hecate", fullgraph=True,
                             options={"fallback": "eager"})
    y_ref, m_ref = op(*inputs, *case.scalars())[:2]
    dy, dm = torch.randn_like(y_ref), torch.randn_like(m_ref)
    y, m, grads = grads_of(compiled, inputs, dy, dm)
    _, _, grads_ref = grads_of(_op_fn(case), inputs, dy, dm)
    assert_close("y", y, y_ref, 1e-6)
    assert_close("m_final", m, m_ref, 1e-6)
    for name, g, g_ref in zip(GRAD_NAMES, grads, grads_ref):
        assert_close(name, g, g_ref, 1e-6)


def _good():
    return [x.detach() if isinstance(x, torch.Tensor) else x for x in make_inputs(CASES[0], dtype=torch.float32)]


def _call(k, v, q, alpha, eta, m0, cu, p=2.0, a=10.0, eps=1e-6, momentum=0.0, q_norm=2.0):
    return op(k, v, q, alpha, eta, m0, cu, p, a, eps, momentum, q_norm)


def test_rejects_p_below_one():
    with pytest.raises(ValueError, match=r"p must be a finite number >= 1.*got 0\.5"):
        _call(*_good(), p=0.5)


def test_rejects_q_norm_below_one():
    with pytest.raises(ValueError, match=r"q_norm must be .*>= 1.*got 0\.5"):
        _call(*_good(), q_norm=0.5)


def test_rejects_mismatched_shapes_naming_both():
    k, v, q, alpha, eta, m0, cu = _good()
    with pytest.raises(ValueError, match=r"q shape \(2, 7, 2, 4\) must equal k shape \(2, 7, 2, 5\)"):
        _call(k, v, q[..., :4], alpha, eta, m0, cu)
    with pytest.raises(ValueError, match=r"v shape \(2, 6, 2, 3\).*k shape \(2, 7, 2, 5\)"):
        _call(k, v[:, :6], q, alpha, eta, m0, cu)
    with pytest.raises(ValueError, match=r"eta shape \(2, 7\) must be \[B, T, H\] = \(2, 7, 2\)"):
        _call(k, v, q, alpha, eta[..., 0], m0, cu)
    with pytest.raises(ValueError, match=r"m0 shape \(2, 2, 5, 3\) must be .*\(2, 2, 3, 5\)"):
        _call(k, v, q, alpha, eta, m0.transpose(-1, -2), cu)


def test_rejects_mixed_dtypes():
    k, v, q, alpha, eta, m0, cu = _good()
    with pytest.raises(TypeError, match=r"k, v and q must share one dtype.*v torch.float64"):
        _call(k, v.double(), q, alpha, eta, m0, cu)


@pytest.mark.parametrize("T", [7, 70], ids=["recurrent", "chunked_length"])
@pytest.mark.parametrize("name,bad", [("alpha", float("nan")), ("eta", float("inf"))])
def test_a_non_finite_gate_is_carried_from_its_step_as_the_loop_carries_it(name, bad, T):
    """A NaN or inf gate (a diverged training step) is no error: the state carries it from that step on and the
    reads before it stay finite, as in the reference loop (at T = 70 too, where finite gates take the chunked
    form, whose dense products would spread it to the reads before)."""
    k, v, q, alpha, eta, m0, cu = [x.detach() if isinstance(x, torch.Tensor) else x
                                   for x in make_inputs(Case("p2", T=T), dtype=torch.float32)]
    gates = {"alpha": alpha.clone(), "eta": eta.clone()}
    gates[name][0, 3, 1] = bad
    y, m_final, _ = _call(k, v, q, gates["alpha"], gates["eta"], m0, cu)
    y_ref, m_ref = memory_scan_naive(k, v, q, gates["alpha"], gates["eta"], m0, cu, 2.0, 10.0, 1e-6, 0.0, 2.0)[:2]
    assert torch.equal(torch.isfinite(y), torch.isfinite(y_ref)) and not torch.isfinite(y_ref[0, 3:, 1]).all()
    assert torch.isfinite(y[0, :3]).all() and torch.isfinite(y[1]).all()
    finite = torch.isfinite(y_ref)
    assert_close("y where finite", y[finite], y_ref[finite], 1e-5)
    assert torch.equal(torch.isfinite(m_final), torch.isfinite(m_ref))


def test_a_diverging_state_overflows_where_the_loop_overflows():
    """Finite inputs whose delta rule diverges (keys of norm 30: ‖k‖² η > 2): the state reaches inf at some step.
    At T = 70 the chunked form's products would meet that inf inside its chunk and put NaN in the reads before
    it; the op gives the recurrence's result instead: finite reads up to the step that overflows."""
    k, v, q, alpha, eta, m0, cu = [x.detach() if isinstance(x, torch.Tensor) else x
                                   for x in make_inputs(Case("p2", T=70), dtype=torch.float32)]
    k = 30 * torch.nn.functional.normalize(k, dim=-1)
    alpha, eta = torch.zeros_like(alpha), torch.full_like(eta, 0.5)
    assert cu is None
    y, m_final, _ = _call(k, v, q, alpha, eta, m0, cu)
    y_rec, m_rec, _ = cpu.forward_recurrent(k, v, q, alpha, eta, m0, 2.0, 10.0, 1e-6, 0.0, 2.0)
    y_ref = memory_scan_naive(k, v, q, alpha, eta, m0, cu, 2.0, 10.0, 1e-6, 0.0, 2.0)[0]
    finite = torch.isfinite(y_rec)
    assert finite[:, :5].all() and not finite.all()  # it overflows, and not from the first step
    assert torch.equal(torch.isfinite(y), finite) and torch.equal(torch.isfinite(m_final), torch.isfinite(m_rec))
    # (where the state has grown large, the reference's rounding diverges too: the first steps are compared)
    assert_close("y of the first steps", y[:, :5], y_ref[:, :5], 1e-5)


def test_rejects_bad_cu_seqlens():
    k, v, q, alpha, eta, m0, cu = [x.detach() if isinstance(x, torch.Tensor) else x
                                   for x in make_inputs(CASES[-1], dtype=torch.float32)]
    with pytest.raises(ValueError, match=r"cu_seqlens must be non-decreasing, got \[0, 5, 3, 7\]"):
        _call(k, v, q, alpha, eta, m0, torch.tensor([0, 5, 3, 7], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"cu_seqlens must start at 0 and end at T = 7, got \[0, 3, 3, 6\]"):
        _call(k, v, q, alpha, eta, m0, torch.tensor([0, 3, 3, 6], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"with cu_seqlens the batch is packed, so B must be 1"):
        kb, vb, qb, ab, eb, _, _ = _good()
        _call(kb, vb, qb, ab, eb, None, torch.tensor([0, 7], dtype=torch.int32))


def test_a_diverging_state_takes_the_recurrent_form_before_it_overflows():
    """Keys of norm 1.8 and η = 1: the delta rule's state grows along each key (×5.5), to 3e25 at T = 70, finite. Past
    chunked.DIVERGED the chunked form's products have rounded its small terms away (probe r17 t19: 7e-6 off
    float64 against eager's 3e-6), so the op gives the recurrence's results, as eager computes them."""
    k, v, q, alpha, eta, m0, cu = [x.detach() if isinstance(x, torch.Tensor) else x
                                   for x in make_inputs(Case("p2", T=70), dtype=torch.float32)]
    k = 1.8 * torch.nn.functional.normalize(k, dim=-1)
    alpha, eta = torch.zeros_like(alpha), torch.ones_like(eta)
    y, m_final, _ = _call(k, v, q, alpha, eta, m0, cu)
    y_rec, m_rec, _ = cpu.forward_recurrent(k, v, q, alpha, eta, m0, 2.0, 10.0, 1e-6, 0.0, 2.0)
    assert torch.isfinite(y_rec).all() and y_rec.abs().max() > 1e18
    assert torch.equal(y, y_rec) and torch.equal(m_final, m_rec)
    with triton_on_cpu():  # the Triton path alike: its recurrent kernels' results
        y_t, m_t, _ = _call(k, v, q, alpha, eta, m0, cu)
        y_k, m_k, _ = kernels.forward(k, v, q, alpha, eta, m0, cu, 2.0, 10.0, 1e-6, 0.0, 2.0)
    assert torch.equal(y_t, y_k) and torch.equal(m_t, m_k)
