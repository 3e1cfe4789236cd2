"""The chunked CPU form of the linear recurrences (p = 2 delta rule, Hebbian) against the per-token CPU loop
and the float64 loop reference: outputs, final states and every gradient, at lengths around the chunk size,
with gates that keep everything, forget everything (keep 0) or vary per token; and the op's choice of form."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import hecate.lowering  # noqa: F401
from hecate.lowering.linear_attention.naive import linear_attention_naive
from hecate.lowering.memory_scan import chunked, cpu
from hecate.lowering.memory_scan.naive import memory_scan_naive
from hecate.testing import assert_close, assert_close_nonfinite

from memory_scan_cases import GRAD_NAMES, Case, make_inputs

TOL = {torch.float32: 1e-5, torch.float64: 1e-10}
LENGTHS = [1, 63, 64, 65, 130, 200]   # below, at and around one and several chunks (C = 64)
KEEP_ZERO_AT = (0, 17, 63, 64, 129)   # α = 1 at a chunk's first, middle and last token, and the next chunk's first


def _gates(alpha, eta, gates):
    """The forget rate α for ``gates``: data-dependent (as made), 0 (the plain delta rule: keep all), or
    data-dependent with α = 1 (keep 0) at ``KEEP_ZERO_AT``."""
    alpha = alpha.detach().clone()
    if gates == "delta_rule":
        alpha.zero_()
    elif gates == "keep_zero":
        alpha[:, [t for t in KEEP_ZERO_AT if t < alpha.shape[1]]] = 1.0
    return alpha.requires_grad_(), eta


def _reference(k, v, q, alpha, eta, m0, hebbian):
    """(y, m_final) of the float64 loop: memory_scan at p = 2, or the Hebbian memory A ← (1 − α) A + η v kᵀ as
    linear attention with keep 1 − α and value η v."""
    if hebbian:
        y, m, _ = linear_attention_naive(k, v * eta.unsqueeze(-1), q, 1.0 - alpha, m0)
        return y, m
    return memory_scan_naive(k, v, q, alpha, eta, m0)[:2]


def _with_grads(fn, inputs, dy, dm):
    """Outputs of ``fn`` and the gradients of ⟨y, dy⟩ + ⟨m_final, dm⟩ with respect to ``inputs``."""
    y, m = fn(*inputs)[:2]
    return y, m, torch.autograd.grad((y * dy).sum() + (m * dm).sum(), inputs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("gates", ["data_dependent", "delta_rule", "keep_zero"])
@pytest.mark.parametrize("T", LENGTHS)
@pytest.mark.parametrize("hebbian", [False, True], ids=["p2", "hebbian"])
def test_chunked_matches_the_loop_and_the_reference(hebbian, T, gates, dtype):
    """chunked.forward / backward (called directly, also below MIN_T) vs cpu.forward_recurrent /
    backward_recurrent vs the float64 loop under autograd; Dk = 5, Dv = 3."""
    k, v, q, alpha, eta, m0, _ = make_inputs(Case("p2", T=T))
    alpha, eta = _gates(alpha, eta, gates)
    reference_inputs = [k, v, q, alpha, eta, m0]
    y_ref, m_ref = _reference(*reference_inputs, hebbian)
    dy, dm = torch.randn_like(y_ref), torch.randn_like(m_ref)
    _, _, grads_ref = _with_grads(lambda *x: _reference(*x, hebbian), reference_inputs, dy, dm)

    inputs = [x.detach().to(dtype) for x in reference_inputs]
    scalars = (2.0, 10.0, 1e-6, 0.0, 2.0)
    forms = {
        "chunked": (chunked.forward(*inputs, hebbian),
                    chunked.backward(dy.to(dtype), dm.to(dtype), *inputs, hebbian)),
        "recurrent": (cpu.forward_recurrent(*inputs, *scalars, hebbian),
                      cpu.backward_recurrent(dy.to(dtype), dm.to(dtype), *inputs, *scalars, hebbian)),
    }
    for form, ((y, m, s), grads) in forms.items():
        assert y.dtype == dtype and m.dtype == dtype and s.numel() == 0 and grads[6].numel() == 0, form
        assert_close(f"{form} y", y, y_ref, TOL[dtype])
        assert_close(f"{form} m_final", m, m_ref, TOL[dtype])
        for name, g, g_ref in zip(GRAD_NAMES, grads, grads_ref):
            assert g.dtype == dtype, (form, name)
            assert_close(f"{form} {name}", g, g_ref, TOL[dtype])
    (y_c, m_c, _), grads_c = forms["chunked"]
    (y_r, m_r, _), grads_r = forms["recurrent"]
    assert_close("chunked vs recurrent y", y_c, y_r, TOL[dtype])
    assert_close("chunked vs recurrent m_final", m_c, m_r, TOL[dtype])
    for name, g_c, g_r in zip(GRAD_NAMES, grads_c, grads_r):
        assert_close(f"chunked vs recurrent {name}", g_c, g_r, TOL[dtype])


@pytest.fixture
def calls(monkeypatch):
    """How often chunked.forward and chunked.backward ran (the CPU path's choice of form)."""
    count = {"forward": 0, "backward": 0}
    for name in count:
        original = getattr(chunked, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            count[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(chunked, name, counted)
    return count


def _op_grads(k, v, q, alpha, eta, m0, cu_seqlens, scalars, bias=""):
    inputs = [k, v, q, alpha, eta, m0]
    y, m = torch.ops.hecate.memory_scan(*inputs, cu_seqlens, *scalars, bias)[:2]
    return y, m, torch.autograd.grad(y.sum() + m.sum(), inputs)


@pytest.mark.parametrize("T,scalars,bias,chunked_runs", [
    (64, (2.0, 10.0, 1e-6, 0.0, 2.0), "", True),
    (63, (2.0, 10.0, 1e-6, 0.0, 2.0), "", False),      # below MIN_T
    (64, (2.5, 10.0, 1e-6, 0.0, 2.0), "", False),      # l_p, p ≠ 2: nonlinear in the state
    (64, (2.0, 10.0, 1e-6, 0.5, 2.0), "", False),      # momentum
    (64, (2.0, 10.0, 1e-6, 0.0, 4.0), "", False),      # MONETA's L_q retention
    (64, (2.0, 10.0, 1e-6, 0.0, 2.0), "mul(x,2.0)", False),   # a user bias (even 2e) is not inspected
], ids=["p2_T64", "p2_T63", "p2.5", "momentum", "moneta", "user_bias"])
def test_memory_scan_op_runs_chunked_exactly_where_it_applies(T, scalars, bias, chunked_runs, calls):
    inputs = [x.detach().float().requires_grad_() for x in make_inputs(Case("p2", T=T))[:6]]
    y, m, grads = _op_grads(*inputs, None, scalars, bias)
    assert calls == {"forward": int(chunked_runs), "backward": int(chunked_runs)}
    y_ref, m_ref, grads_ref = _op_grads(*[x.detach().double().requires_grad_() for x in inputs], None, scalars, bias)
    assert_close("y", y, y_ref, 1e-5)
    assert_close("m_final", m, m_ref, 1e-5)
    for name, g, g_ref in zip(GRAD_NAMES, grads, grads_ref):
        assert_close(name, g, g_ref, 1e-5)


def test_memory_scan_op_runs_chunked_per_packed_sequence(calls):
    """cu_seqlens: each sequence picks its form by its own length (70 and 130 chunked; 0 and 3 by the loop)."""
    case = Case("varlen", cu_seqlens=(0, 0, 70, 73, 203))
    reference_inputs = list(make_inputs(case)[:6])
    cu_seqlens = make_inputs(case)[6]
    reference_inputs[3], reference_inputs[4] = _gates(reference_inputs[3], reference_inputs[4], "keep_zero")
    y_ref, m_ref = memory_scan_naive(*reference_inputs, cu_seqlens)[:2]
    dy, dm = torch.randn_like(y_ref), torch.randn_like(m_ref)
    _, _, grads_ref = _with_grads(lambda *x: memory_scan_naive(*x, cu_seqlens), reference_inputs, dy, dm)
    inputs = [x.detach().float().requires_grad_() for x in reference_inputs]
    y, m, grads = _with_grads(lambda *x: torch.ops.hecate.memory_scan(*x, cu_seqlens), inputs, dy.float(), dm.float())
    assert calls == {"forward": 2, "backward": 2}
    assert_close("y", y, y_ref, 1e-5)
    assert_close("m_final", m, m_ref, 1e-5)
    for name, g, g_ref in zip(GRAD_NAMES, grads, grads_ref):
        assert_close(name, g, g_ref, 1e-5)


def _linear_attention_inputs(T, gates, dtype=torch.float64, B=2, H=2, Dk=5, Dv=3):
    k = F.elu(torch.randn(B, T, H, Dk, dtype=dtype)) + 1   # φ = elu + 1 keeps the normaliser positive
    q = F.elu(torch.randn(B, T, H, Dk, dtype=dtype)) + 1
    v = torch.randn(B, T, H, Dv, dtype=dtype)
    keep = {"none": None, "data_dependent": torch.sigmoid(torch.randn(B, T, H, dtype=dtype) + 2)}.get(gates)
    if gates == "keep_zero":
        keep = torch.sigmoid(torch.randn(B, T, H, dtype=dtype) + 2)
        keep[:, [t for t in KEEP_ZERO_AT if t < T]] = 0.0
    m0 = torch.randn(B, H, Dv, Dk, dtype=dtype)
    z0 = torch.rand(B, H, Dk, dtype=dtype) + 1
    return [x.requires_grad_() if x is not None else None for x in (k, v, q, keep, m0, z0)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("gates", ["none", "data_dependent", "keep_zero"])
@pytest.mark.parametrize("T", [65, 200])
@pytest.mark.parametrize("normalize", [True, False], ids=["normalised", "plain"])
def test_linear_attention_runs_chunked_and_matches(normalize, T, gates, dtype, calls, monkeypatch):
    """Causal linear_attention at T >= MIN_T runs the chunked form (the [v, 1] value carries the normaliser):
    y, M, z and every gradient vs the per-token loop (the op with MIN_T out of reach) and the float64 loop."""
    reference_inputs = _linear_attention_inputs(T, gates)
    present = [x for x in reference_inputs if x is not None]
    names = [n for n, x in zip(("dk", "dv", "dq", "dalpha", "dm0", "dz0"), reference_inputs) if x is not None]
    if not normalize:   # no normaliser state
        reference_inputs[5] = None
        names, present = names[:-1], present[:-1]
    flags = (normalize, 1e-6, True)
    refs = linear_attention_naive(*reference_inputs, *flags)
    cotangents = [torch.randn_like(r) for r in refs]

    def run(fn, inputs):
        outs = fn(*inputs)
        wrt = [x for x in inputs if x is not None]
        return outs, torch.autograd.grad(sum((o * c.to(o.dtype)).sum() for o, c in zip(outs, cotangents)), wrt)

    _, grads_ref = run(lambda *x: linear_attention_naive(*x, *flags), reference_inputs)
    inputs = [x.detach().to(dtype).requires_grad_() if x is not None else None for x in reference_inputs]
    op = lambda *x: torch.ops.hecate.linear_attention(*x, *flags)  # noqa: E731
    forms = {"chunked": run(op, inputs)}
    assert calls == {"forward": 2 if normalize else 1, "backward": 1}   # the normalised backward re-reads y
    monkeypatch.setattr(chunked, "MIN_T", 10**9)
    forms["recurrent"] = run(op, inputs)
    assert calls == {"forward": 2 if normalize else 1, "backward": 1}
    for form, (outs, grads) in forms.items():
        for name, o, r in zip(("y", "m_final", "z_final"), outs, refs):
            assert_close(f"{form} {name}", o, r, TOL[dtype])
        for name, g, r in zip(names, grads, grads_ref):
            assert_close(f"{form} {name}", g, r, TOL[dtype])
    for name, a, b in zip(("y", "m_final", "z_final", *names), [*forms["chunked"][0], *forms["chunked"][1]],
                          [*forms["recurrent"][0], *forms["recurrent"][1]]):
        assert_close(f"chunked vs recurrent {name}", a, b, TOL[dtype])


POISONS = {"nan": float("nan"), "inf": float("inf")}


@pytest.mark.filterwarnings("ignore:invalid value encountered")
@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("hebbian", [False, True], ids=["p2", "hebbian"])
def test_poisoned_inputs_propagate_as_in_the_loop(hebbian, poison, calls):
    """A NaN or inf in k, v or q reaches exactly the outputs it reaches in the loop: the reads from its token
    on, never those before it in its chunk (which the dense chunk products would poison: the CPU path keeps
    such inputs on the loop), nor other heads or batch elements."""
    T = 130
    reference_inputs = [x.detach() for x in make_inputs(Case("p2", T=T))[:6]]
    reference_inputs[0][0, 100, 1, 3] = POISONS[poison]   # chunk 1, token 36 of 64
    reference_inputs[1][0, 110, 0, 1] = POISONS[poison]
    reference_inputs[2][0, 120, 1, 0] = POISONS[poison]
    reference_inputs = [x.requires_grad_() for x in reference_inputs]
    if hebbian:
        k, v, q, alpha, _, m0 = reference_inputs
        reference_inputs = [k, v, q, 1.0 - alpha.detach(), m0]
        fn = lambda *x: torch.ops.hecate.linear_attention(*x[:4], x[4], None, False, 1e-6, True)[:2]  # noqa: E731
        reference = lambda *x: linear_attention_naive(*x[:4], x[4])[:2]  # noqa: E731
        names = ["dk", "dv", "dq", "dalpha", "dm0"]
    else:
        fn = lambda *x: torch.ops.hecate.memory_scan(*x, None)[:2]  # noqa: E731
        reference = lambda *x: memory_scan_naive(*x)[:2]  # noqa: E731
        names = GRAD_NAMES
    reference_inputs = [x.detach().requires_grad_() for x in reference_inputs]
    y_ref, m_ref = reference(*reference_inputs)
    dy, dm = torch.randn_like(y_ref), torch.randn_like(m_ref)
    _, _, grads_ref = _with_grads(reference, reference_inputs, dy, dm)
    inputs = [x.detach().float().requires_grad_() for x in reference_inputs]
    y, m, grads = _with_grads(fn, inputs, dy.float(), dm.float())
    assert calls == {"forward": 0, "backward": 0}
    assert torch.isfinite(y[0, :100]).all() and not torch.isfinite(y[0, 100:]).all() and torch.isfinite(y[1]).all()
    assert_close_nonfinite("y", y, y_ref, 1e-5)
    assert_close_nonfinite("m_final", m, m_ref, 1e-5)
    if poison == "nan":   # with inf the loop's hand-written reverse meets inf · 0 where autograd's does not
        for name, g, g_ref in zip(names, grads, grads_ref):
            assert_close_nonfinite(name, g, g_ref, 1e-5)


def test_chunked_would_spread_a_nan_backwards_in_its_chunk():
    """Why the CPU path keeps non-finite inputs on the loop: the chunk's dense products reach earlier reads."""
    k, v, q, alpha, eta, m0, _ = [x.detach() if isinstance(x, torch.Tensor) else x
                                  for x in make_inputs(Case("p2", T=64))]
    k[0, 40, 0, 0] = float("nan")
    y = chunked.forward(k, v, q, alpha, eta, m0, hebbian=False)[0]
    assert torch.isfinite(cpu.forward_recurrent(k, v, q, alpha, eta, m0, 2.0, 10.0, 1e-6, 0.0, 2.0)[0][0, :40]).all()
    assert not torch.isfinite(y[0, :40]).all()


@pytest.mark.parametrize("hebbian", [False, True], ids=["p2", "hebbian"])
def test_bf16_inputs_run_in_an_fp32_state(hebbian):
    """bf16 k, v, q: both forms compute in fp32 from the same bf16 values; y and dk, dv, dq leave in bf16
    (rounded: 2⁻⁸ relative per element), the state and the gate gradients in fp32."""
    k, v, q, alpha, eta, m0 = [x.detach().float() for x in make_inputs(Case("p2", T=130))[:6]]
    k, v, q = (x.to(torch.bfloat16) for x in (k, v, q))
    dy, dm = torch.randn(v.shape).to(torch.bfloat16), torch.randn(m0.shape)
    scalars = (2.0, 10.0, 1e-6, 0.0, 2.0)
    y, m, _ = chunked.forward(k, v, q, alpha, eta, m0, hebbian)
    y_r, m_r, _ = cpu.forward_recurrent(k, v, q, alpha, eta, m0, *scalars, hebbian)
    grads = chunked.backward(dy, dm, k, v, q, alpha, eta, m0, hebbian)
    grads_r = cpu.backward_recurrent(dy, dm, k, v, q, alpha, eta, m0, *scalars, hebbian)
    assert y.dtype == torch.bfloat16 and m.dtype == torch.float32
    assert_close("y", y, y_r, 1e-2)
    assert_close("m_final", m, m_r, 1e-5)
    for name, g, g_r in zip(GRAD_NAMES, grads, grads_r):
        assert g.dtype == g_r.dtype, name
        assert_close(name, g, g_r, 1e-2 if g.dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_a_non_finite_element_anywhere_is_seen_by_the_one_sync_check(bad, dtype):
    """chunked.all_finite reads sums: one NaN or ±inf in any tensor makes it False (+inf beside −inf too), finite
    tensors (and None) make it True."""
    x, y = torch.randn(3, 70, 2, 5, dtype=dtype), torch.randn(3, 70, 2, dtype=dtype)
    assert chunked.all_finite([x, None, y])
    y[1, 33, 0] = bad
    assert not chunked.all_finite([x, None, y])
    x[0, 0, 0, 0], x[2, 1, 1, 1] = float("inf"), float("-inf")
    assert not chunked.all_finite([x])
