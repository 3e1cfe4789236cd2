"""memory_scan with a per-step momentum decay ``beta`` [B, T, H] (HOPE Eq 51's α_{i+1}): S ← (momentum · β_t) S − η U.

Every path (the CPU loop, the Triton kernels under the interpreter, the ONNX Scan, the ATen decomposition)
against the float64 reference, forward and every gradient, beta's included.
"""

from __future__ import annotations

import contextlib

import onnxruntime
import pytest
import torch

import hecate
import hecate.lowering  # noqa: F401
from hecate.lowering.dispatch import triton_on_cpu
from hecate.lowering.memory_scan import cpu, kernels
from hecate.lowering.memory_scan.naive import memory_scan_naive
from hecate.testing import assert_close

from test_memory_scan_kernels import poisoned_allocations  # noqa: F401  (a fixture)

op = torch.ops.hecate.memory_scan
NAMES = ("dk", "dv", "dq", "dalpha", "deta", "dm0", "ds0", "dbeta")
# (p, q_norm, momentum): l_2, the general l_p and MONETA, each with the decay β_t itself or scaled
CASES = {"p2": (2.0, 2.0, 1.0), "p3": (3.0, 2.0, 0.7), "moneta": (3.0, 4.0, 1.0)}


def _inputs(T=7, B=2, H=2, Dk=5, Dv=3, dtype=torch.float64, seed=0):
    """(k, v, q, alpha, eta, m0, s0, beta), leaves requiring grad; β_t in (0, 1) per token."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    k = r(B, T, H, Dk)
    k = k / k.norm(dim=-1, keepdim=True)  # unit keys: the l_p updates stay bounded over T
    xs = (k, r(B, T, H, Dv), r(B, T, H, Dk), torch.sigmoid(r(B, T, H) - 2), 0.3 * torch.sigmoid(r(B, T, H)),
          0.3 * r(B, H, Dv, Dk), 0.1 * r(B, H, Dv, Dk), torch.sigmoid(r(B, T, H) + 1))
    return [x.requires_grad_() for x in xs]


def _call(fn, xs, scalars):
    k, v, q, alpha, eta, m0, s0, beta = xs
    p, q_norm, momentum = scalars
    return fn(k, v, q, alpha, eta, m0, None, p, 10.0, 1e-6, momentum, q_norm, "", s0, beta)


def _outputs_and_grads(fn, xs, scalars, weights):
    out = _call(fn, xs, scalars)
    loss = sum((o * w.to(o.dtype)).sum() for o, w in zip(out, weights))
    return out, torch.autograd.grad(loss, xs)


def _check(fn, scalars, tol, dtype, context=contextlib.nullcontext):
    """``fn`` on the inputs in ``dtype`` against the float64 reference: outputs and the gradients of Σ w·out."""
    ref_in = _inputs()
    weights = [torch.randn_like(o) for o in _call(memory_scan_naive, ref_in, scalars)]
    ref, ref_grads = _outputs_and_grads(memory_scan_naive, ref_in, scalars, weights)
    xs = [x.detach().to(dtype).requires_grad_() for x in ref_in]
    with context():
        out, grads = _outputs_and_grads(fn, xs, scalars, weights)
    for name, o, r in zip(("y", "m_final", "s_final"), out, ref):
        assert_close(name, o, r, tol)
    for name, g, r in zip(NAMES, grads, ref_grads):
        assert_close(name, g, r, tol)


@pytest.fixture
def small_chunks(monkeypatch):
    # several checkpoint segments at T = 7 on both paths, two value tiles for Dv = 3 (partials summed)
    monkeypatch.setattr(cpu, "CHUNK", 3)
    monkeypatch.setattr(kernels, "CHUNK", 3)
    monkeypatch.setattr(kernels, "MAX_BLOCK_V", 2)
    monkeypatch.setattr(kernels, "MAX_BLOCK_V_BACKWARD", 2)


@pytest.mark.parametrize("case", sorted(CASES))
def test_cpu_path_matches_the_reference(case, small_chunks):
    _check(op, CASES[case], 1e-12, torch.float64)


@pytest.mark.parametrize("case", sorted(CASES))
def test_triton_kernels_match_the_reference(case, small_chunks, poisoned_allocations):
    _check(op, CASES[case], 1e-5, torch.float32, triton_on_cpu)


def test_beta_of_ones_is_the_fixed_momentum():
    """β_t = 1 everywhere gives exactly the op with the fixed decay ``momentum``: beta multiplies it."""
    k, v, q, alpha, eta, m0, s0, beta = (x.detach() for x in _inputs())
    fixed = op(k, v, q, alpha, eta, m0, None, 2.0, 10.0, 1e-6, 0.6, 2.0, "", s0)
    ones = op(k, v, q, alpha, eta, m0, None, 2.0, 10.0, 1e-6, 0.6, 2.0, "", s0, torch.ones_like(beta))
    varying = op(k, v, q, alpha, eta, m0, None, 2.0, 10.0, 1e-6, 0.6, 2.0, "", s0, beta)
    for a, b in zip(fixed, ones):
        assert torch.equal(a, b)
    assert not torch.allclose(fixed[0], varying[0])


def test_packed_sequences_take_their_own_decays():
    """With cu_seqlens each packed sequence reads its own rows of beta, as when run one by one."""
    k, v, q, alpha, eta, _, _, beta = (x.detach() for x in _inputs(T=9, B=1))
    cu = torch.tensor([0, 4, 9])
    m0, s0 = torch.randn(2, 2, 3, 5, dtype=torch.float64), torch.randn(2, 2, 3, 5, dtype=torch.float64)
    packed = op(k, v, q, alpha, eta, m0, cu, 2.0, 10.0, 1e-6, 0.9, 2.0, "", s0, beta)
    for n, (bos, eos) in enumerate([(0, 4), (4, 9)]):
        part = [x[:, bos:eos] for x in (k, v, q, alpha, eta)]
        alone = op(*part, m0[n:n + 1], None, 2.0, 10.0, 1e-6, 0.9, 2.0, "", s0[n:n + 1], beta[:, bos:eos])
        assert_close("y", packed[0][:, bos:eos], alone[0], 1e-12)
        assert_close("m_final", packed[1][n:n + 1], alone[1], 1e-12)
        assert_close("s_final", packed[2][n:n + 1], alone[2], 1e-12)


def test_chunks_carried_through_m_final_and_s_final_equal_the_whole():
    k, v, q, alpha, eta, m0, s0, beta = (x.detach() for x in _inputs(T=10))
    whole = op(k, v, q, alpha, eta, m0, None, 2.5, 10.0, 1e-6, 1.0, 2.0, "", s0, beta)
    first = op(*(x[:, :6] for x in (k, v, q, alpha, eta)), m0, None, 2.5, 10.0, 1e-6, 1.0, 2.0, "", s0,
               beta[:, :6])
    second = op(*(x[:, 6:] for x in (k, v, q, alpha, eta)), first[1], None, 2.5, 10.0, 1e-6, 1.0, 2.0, "",
                first[2], beta[:, 6:])
    assert_close("y", torch.cat([first[0], second[0]], 1), whole[0], 1e-12)
    assert_close("m_final", second[1], whole[1], 1e-12)
    assert_close("s_final", second[2], whole[2], 1e-12)


def test_opcheck():
    xs = [x.detach().float().requires_grad_() for x in _inputs(T=4)]
    k, v, q, alpha, eta, m0, s0, beta = xs
    torch.library.opcheck(op.default, (k, v, q, alpha, eta, m0, None, 2.0, 10.0, 1e-6, 0.8, 2.0, "", s0, beta))


def test_bad_beta_is_refused():
    k, v, q, alpha, eta, m0, s0, beta = (x.detach() for x in _inputs())
    with pytest.raises(ValueError, match=r"beta scales the momentum decay.*got momentum=0"):
        op(k, v, q, alpha, eta, m0, None, 2.0, 10.0, 1e-6, 0.0, 2.0, "", None, beta)
    with pytest.raises(ValueError, match=r"beta shape \(2, 6, 2\) must be \[B, T, H\] = \(2, 7, 2\)"):
        op(k, v, q, alpha, eta, m0, None, 2.0, 10.0, 1e-6, 1.0, 2.0, "", s0, beta[:, :6])
    with pytest.raises(TypeError, match=r"beta must be a floating tensor"):
        op(k, v, q, alpha, eta, m0, None, 2.0, 10.0, 1e-6, 1.0, 2.0, "", s0, (beta > 0.5).long())


class _WithBeta(torch.nn.Module):
    def forward(self, k, v, q, alpha, eta, m0, s0, beta):
        return op(k, v, q, alpha, eta, m0, None, 3.0, 10.0, 1e-6, 0.9, 2.0, "", s0, beta)


def assert_onnx_scan_matches(model, args, path, names):
    """``model`` exported at opset 18 (the Scan form) runs in onnxruntime and gives its outputs ``names``."""
    hecate.export_onnx(model, args, path, opset_version=18)
    session = onnxruntime.InferenceSession(str(path))
    got = session.run(None, {i.name: a.numpy() for i, a in zip(session.get_inputs(), args)})
    for name, g, r in zip(names, got, model(*args)):
        assert_close(name, torch.from_numpy(g), r, 1e-5)


def test_onnx_scan_reads_the_decays(tmp_path):
    args = tuple(x.detach().float() for x in _inputs())
    assert_onnx_scan_matches(_WithBeta(), args, tmp_path / "memory_scan_beta.onnx", ("y", "m_final", "s_final"))


def test_decomposition_is_the_reference():
    from hecate.lowering.memory_scan.export import memory_scan_decomposition

    k, v, q, alpha, eta, m0, s0, beta = (x.detach() for x in _inputs())
    got = memory_scan_decomposition(k, v, q, alpha, eta, m0, None, 3.0, 10.0, 1e-6, 0.9, 2.0, "", s0, beta)
    for name, g, r in zip(("y", "m_final", "s_final"), got,
                          op(k, v, q, alpha, eta, m0, None, 3.0, 10.0, 1e-6, 0.9, 2.0, "", s0, beta)):
        assert_close(name, g, r, 1e-12)
