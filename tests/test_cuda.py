"""On a CUDA GPU: every fused op's Triton path, compiled models, and faithful numerics, on real hardware.

Without a GPU these tests are skipped (CI has none; the same kernels run there under the interpreter).
``benchmarks/gpu_check.sh`` runs them, with the other ``cuda``-marked tests, on a lent GPU.

* each op on CUDA against its float64 reference on the CPU, forward and every gradient, with every buffer
  the launchers allocate poisoned (NaN) so an unwritten element shows;
* ``torch.library.opcheck`` on CUDA tensors;
* NaN in an input gives NaN where the ATen path gives NaN (the kernels' max/min must not drop it);
* every model of ``hecate.models.EXAMPLES`` compiled with ``backend="hecate"`` on CUDA fuses what it fuses
  on the CPU and equals eager, output and parameter gradients.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import hecate
import hecate.lowering  # noqa: F401
from hecate.lowering.kl_attention.naive import kl_attention_naive
from hecate.lowering.kl_attention.op import OUTPUT_NAMES
from hecate.lowering.kl_decode.naive import kl_decode_logits_naive
from hecate.lowering.linear_attention.naive import linear_attention_naive
from hecate.lowering.memory_scan.naive import memory_scan_naive
from hecate.models import EXAMPLES
from hecate.testing import assert_close
from tests.lowering.test_kl_decode import wide_belief_case

pytestmark = pytest.mark.cuda

TOL = 1e-4  # fp32 kernels (IEEE dots, fp32 accumulation) against float64


@pytest.fixture
def poison_allocations(monkeypatch):
    """Every float buffer allocated with empty/empty_like/new_empty starts as NaN."""
    def poison(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    empty, empty_like, new_empty = torch.empty, torch.empty_like, torch.Tensor.new_empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: poison(empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: poison(empty_like(*a, **kw)))
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *a, **kw: poison(new_empty(self, *a, **kw)))


def _leaves(tensors, device, dtype=torch.float32):
    """float64 CPU leaves and their copies on ``device`` in ``dtype``, all requiring grad (None stays None)."""
    ref = [t.detach().double().requires_grad_() if t is not None else None for t in tensors]
    dev = [t.detach().to(device, dtype).requires_grad_() if t is not None else None for t in tensors]
    return ref, dev


def _compare(names, got, ref, grad_names, got_inputs, ref_inputs, tol):
    """Outputs (±inf where the reference has them) and the gradients of Σ w·out, w random, vs the reference."""
    got, ref = [got] if torch.is_tensor(got) else list(got), [ref] if torch.is_tensor(ref) else list(ref)
    weights = [torch.randn(r.shape, dtype=torch.float64) for r in ref]
    for name, g, r in zip(names, got, ref):
        g = g.detach().cpu().double()
        assert torch.equal(torch.isinf(g), torch.isinf(r.detach())), name
        assert_close(name, torch.where(torch.isinf(g), 0.0, g), torch.where(torch.isinf(r), 0.0, r.detach()), tol)

    def loss(outs, device):
        return sum(torch.where(torch.isinf(o), 0.0, o * w.to(device, o.dtype)).sum() for o, w in zip(outs, weights))

    wrt_got = [t for t in got_inputs if t is not None]
    wrt_ref = [t for t in ref_inputs if t is not None]
    grads = torch.autograd.grad(loss(got, "cuda"), wrt_got, allow_unused=True)
    ref_grads = torch.autograd.grad(loss(ref, "cpu"), wrt_ref, allow_unused=True)
    for name, g, r in zip(grad_names, grads, ref_grads):
        if r is None or r.norm() == 0:
            continue
        assert g is not None, name
        assert_close(name, g.cpu().double(), r, tol)


# ---------------------------------------------------------------------------------------------
# ops against their references


# the last: the FEP model's widths at K = 64 (values 3K+1), whose backward needs fewer pipelining stages than
# Triton's default to fit an H100's shared memory; the op must run its kernels there, not the matmul form
@pytest.mark.parametrize("b,n,k,dv,dw", [(2, 19, 5, 3, 4), (2, 300, 64, 64, 0), (1, 257, 16, 0, 32),
                                         (1, 150, 64, 193, 193)])
@pytest.mark.parametrize("causal,mask_diagonal", [(False, False), (True, False), (True, True)])
@pytest.mark.filterwarnings("error:hecate.kl_attention:RuntimeWarning")
def test_kl_attention(b, n, k, dv, dw, causal, mask_diagonal, poison_allocations):
    # spread so that KL/κ is O(1) at every K: β is neither one-hot nor uniform
    mu, var = torch.randn(b, n, k) * k ** -0.5, 0.5 + torch.rand(b, n, k)
    ref_in, dev_in = _leaves((mu, var, torch.randn(b, n, dv), torch.randn(b, n, dw)), "cuda")
    got = torch.ops.hecate.kl_attention(*dev_in, 0.7, causal, mask_diagonal)
    ref = kl_attention_naive(*ref_in, 0.7, causal, mask_diagonal)
    _compare(OUTPUT_NAMES, got, ref, ("d mu", "d var", "d row_values", "d col_values"), dev_in, ref_in, TOL)


@pytest.mark.parametrize("pattern", ["causal", "random"])
def test_kl_attention_mask_given_at_run_time(pattern, poison_allocations):
    """A causal mask given as a tensor runs the kernels; a mask of no kernel's pattern the matmul form on the GPU."""
    b, n, k = 2, 67, 8
    allowed = torch.ones(n, n, dtype=torch.bool).tril() if pattern == "causal" else torch.rand(n, n) < 0.7
    mu, var = torch.randn(b, n, k) * k ** -0.5, 0.5 + torch.rand(b, n, k)
    ref_in, dev_in = _leaves((mu, var, torch.randn(b, n, 3), torch.randn(b, n, 5)), "cuda")
    got = torch.ops.hecate.kl_attention(*dev_in, 0.7, False, False, None, allowed.cuda())
    ref = kl_attention_naive(*ref_in, 0.7, False, False, allowed)
    _compare(OUTPUT_NAMES, got, ref, ("d mu", "d var", "d row_values", "d col_values"), dev_in, ref_in, TOL)


@pytest.mark.parametrize("m,v,k", [(37, 23, 5), (1000, 3001, 64)])
def test_kl_decode(m, v, k, poison_allocations):
    params = (torch.randn(m, k), 0.3 + torch.rand(m, k), torch.randn(v, k), 0.3 + torch.rand(v, k))
    targets = torch.randint(0, v, (m,))
    targets[m // 2] = -100
    ref_in, dev_in = _leaves(params, "cuda")
    grad_names = ("d mu", "d var", "d prior_mu", "d prior_var")
    loss, lse = torch.ops.hecate.kl_decode_ce(*dev_in, targets.cuda(), 0.8, -100)
    logits = kl_decode_logits_naive(*ref_in, 0.8)
    assert_close("lse", lse.cpu().double(), torch.logsumexp(logits, -1).detach(), TOL)  # auxiliary: no gradient
    _compare(("loss",), loss, F.cross_entropy(logits, targets, reduction="none"), grad_names, dev_in, ref_in, TOL)
    got = torch.ops.hecate.kl_decode_logits(*dev_in, 1.3)
    _compare(("logits",), got, kl_decode_logits_naive(*ref_in, 1.3), grad_names, dev_in, ref_in, TOL)


@pytest.mark.parametrize("belief,value", [("mu", float("inf")), ("var", float("inf")), ("var", 0.0),
                                          ("mu", float("nan"))])
def test_kl_attention_belief_not_finite(belief, value):
    """One belief at μ = inf, v = inf, v = 0 or NaN: the kernels' outputs and gradients are NaN and ±inf where the
    reference's are, and equal elsewhere (a NaN query row reaches every column sum and ∂/∂V, as eager's does)."""
    b, n, k = 2, 37, 5
    mu, var, rv, cv = torch.randn(b, n, k), 0.5 + torch.rand(b, n, k), torch.randn(b, n, 3), torch.randn(b, n, 4)
    (mu if belief == "mu" else var)[0, 20, 1] = value
    weights = [torch.randn(b, n, 3), torch.randn(b, n, 3), torch.randn(b, n)] + [torch.randn(b, n, 4)] * 3

    def run(fn, device, dtype):
        x = [t.to(device, dtype).requires_grad_() for t in (mu, var, rv, cv)]
        out = fn(*x, 0.8, True, False)
        total = sum((o * w.to(device, dtype)).sum() for o, w in zip(out[:6], weights))
        return [t.detach().cpu().double() for t in list(out) + list(torch.autograd.grad(total, x))]

    got = run(torch.ops.hecate.kl_attention, "cuda", torch.float32)
    ref = run(kl_attention_naive, "cpu", torch.float64)
    for name, g, r in zip(list(OUTPUT_NAMES) + ["d mu", "d var", "d row_values", "d col_values"], got, ref):
        assert torch.equal(torch.isnan(g), torch.isnan(r)) and torch.equal(torch.isinf(g), torch.isinf(r)), name
        finite = torch.isfinite(r)
        assert_close(name, g[finite], r[finite], TOL)


@pytest.mark.parametrize("output", range(6), ids=OUTPUT_NAMES[:6])
def test_kl_attention_output_read_with_a_gradient_of_zero_is_nan_as_in_eager(output):
    """A NaN belief and one output read under a loss weighted by 0: the kernels' backward reads that output's
    gradient (0 · NaN = NaN reaches the beliefs' gradients, as in the reference); an output given no gradient
    is left out."""
    b, n, k = 2, 37, 5
    mu, var, rv, cv = torch.randn(b, n, k), 0.5 + torch.rand(b, n, k), torch.randn(b, n, 3), torch.randn(b, n, 4)
    mu[1, 9, 2] = float("nan")

    def grads(fn, device, dtype):
        x = [t.to(device, dtype).requires_grad_() for t in (mu, var, rv, cv)]
        out = fn(*x, 0.8, True, False)
        return [g.detach().cpu() for g in torch.autograd.grad((out[output] * 0).sum(), x[:2])]

    got, ref = grads(torch.ops.hecate.kl_attention, "cuda", torch.float32), grads(kl_attention_naive, "cpu", torch.float64)
    assert torch.isnan(ref[0]).any()  # what the test is about
    for name, g, r in zip(("d mu", "d var"), got, ref):
        assert torch.equal(torch.isnan(g), torch.isnan(r)), (name, torch.isnan(g).sum(), torch.isnan(r).sum())


def test_kl_decode_targets_out_of_range():
    params = [t.cuda() for t in (torch.randn(4, 3), torch.rand(4, 3) + 0.5, torch.randn(5, 3), torch.rand(5, 3) + 0.5)]
    for bad in (5, -1):
        with pytest.raises(IndexError, match="targets"):
            torch.ops.hecate.kl_decode_ce(*params, torch.tensor([0, 1, bad, 2], device="cuda"), 1.0, -100)


@pytest.mark.parametrize("causal,normalize,gated,init", [(True, False, True, True), (True, True, True, True),
                                                         (False, True, False, False), (False, False, False, False)])
@pytest.mark.parametrize("T", [7, 300])
def test_linear_attention(causal, normalize, gated, init, T, poison_allocations):
    B, H, Dk, Dv = 2, 3, 32, 48
    k, q = F.elu(torch.randn(B, T, H, Dk)) + 1, F.elu(torch.randn(B, T, H, Dk)) + 1
    alpha = torch.sigmoid(torch.randn(B, T, H) + 2) if gated else None
    m0 = torch.randn(B, H, Dv, Dk) if init else None
    z0 = torch.rand(B, H, Dk) + 1 if init and normalize else None
    ref_in, dev_in = _leaves((k, torch.randn(B, T, H, Dv), q, alpha, m0, z0), "cuda")
    got = torch.ops.hecate.linear_attention(*dev_in, normalize, 1e-6, causal)
    ref = linear_attention_naive(*ref_in, normalize, 1e-6, causal)
    names = ("y", "m_final", "z_final")[:len(ref)]
    _compare(names, got[:len(ref)], ref, ("dk", "dv", "dq", "dalpha", "dm0", "dz0"), dev_in, ref_in, TOL)


@pytest.mark.parametrize("p, q_norm", [(2.0, 2.0), (3.0, 4.0)], ids=["p2", "moneta"])
def test_memory_scan_per_step_momentum_decay(p, q_norm, poison_allocations):
    """S ← (momentum · β_t) S − η U with β [B, T, H]: the kernels keep the pre-step buffers for dβ (T = 70 crosses
    the checkpoint segments)."""
    B, T, H, Dk, Dv = 2, 70, 2, 16, 8
    k = F.normalize(torch.randn(B, T, H, Dk), dim=-1)
    inputs = (k, torch.randn(B, T, H, Dv), torch.randn(B, T, H, Dk), torch.sigmoid(torch.randn(B, T, H) - 2),
              0.3 * torch.sigmoid(torch.randn(B, T, H)), 0.3 * torch.randn(B, H, Dv, Dk), 0.1 * torch.randn(B, H, Dv, Dk),
              torch.sigmoid(torch.randn(B, T, H) + 1))
    ref_in, dev_in = _leaves(inputs, "cuda")

    def call(fn, x):
        k, v, q, alpha, eta, m0, s0, beta = x
        return fn(k, v, q, alpha, eta, m0, None, p, 10.0, 1e-6, 0.9, q_norm, "", s0, beta)

    _compare(("y", "m_final", "s_final"), call(torch.ops.hecate.memory_scan, dev_in), call(memory_scan_naive, ref_in),
             ("dk", "dv", "dq", "dalpha", "deta", "dm0", "ds0", "dbeta"), dev_in, ref_in, TOL)


@pytest.mark.parametrize("p", [2.0, 3.0], ids=["p2", "p3"])
def test_memory_scan_decay_first(p, poison_allocations):
    """Gated DeltaNet's order, e = (1 − α_t) W k − v, at T = 70: p = 2 in the chunk kernels, p = 3 in the recurrent
    ones."""
    B, T, H, Dk, Dv = 2, 70, 2, 16, 8
    k = F.normalize(torch.randn(B, T, H, Dk), dim=-1)
    inputs = (k, torch.randn(B, T, H, Dv), torch.randn(B, T, H, Dk), torch.sigmoid(torch.randn(B, T, H) - 1),
              0.4 * torch.sigmoid(torch.randn(B, T, H)), 0.3 * torch.randn(B, H, Dv, Dk))
    ref_in, dev_in = _leaves(inputs, "cuda")

    def call(fn, x):
        return fn(*x, None, p, 10.0, 1e-6, 0.0, 2.0, "", None, None, True)[:2]

    _compare(("y", "m_final"), call(torch.ops.hecate.memory_scan, dev_in), call(memory_scan_naive, ref_in),
             ("dk", "dv", "dq", "dalpha", "deta", "dm0"), dev_in, ref_in, TOL)


@pytest.mark.parametrize("T", [6, 70], ids=["recurrent", "chunked"])
@pytest.mark.parametrize("decay_first", [False, True], ids=["decay_after", "decay_first"])
def test_memory_scan_keeps_decays_near_zero(T, decay_first, poison_allocations):
    """Kept fractions 1 − α of 1e-6 and below, α given in float64 (as the pass gives it): the kernels read 1 − α
    from the float64 α, so ∂L/∂M0 ∝ Π(1 − α_t) keeps its digits, in the recurrent and the chunk kernels."""
    B, H, Dk, Dv = 2, 2, 8, 4
    k = F.normalize(torch.randn(B, T, H, Dk), dim=-1)
    inputs = (k, torch.randn(B, T, H, Dv), torch.randn(B, T, H, Dk), 0.4 * torch.sigmoid(torch.randn(B, T, H)),
              torch.randn(B, H, Dv, Dk))
    keep = 1e-6 * torch.rand(B, T, H, dtype=torch.float64)
    ref_in, dev_in = _leaves(inputs, "cuda")
    ref_keep, dev_keep = keep.clone().requires_grad_(), keep.cuda().requires_grad_()

    def call(fn, x, keep):
        k, v, q, eta, m0 = x
        return fn(k, v, q, 1 - keep, eta, m0, None, 2.0, 10.0, 1e-6, 0.0, 2.0, "", None, None, decay_first)[:2]

    _compare(("y", "m_final"), call(torch.ops.hecate.memory_scan, dev_in, dev_keep),
             call(memory_scan_naive, ref_in, ref_keep), ("dk", "dv", "dq", "deta", "dm0", "dkeep"),
             dev_in + [dev_keep], ref_in + [ref_keep], TOL)


def test_kl_decode_ce_wide_belief_keeps_its_gradients():
    """A belief of variance e^6.5 against priors near 1 (logits near −550): the kernels' float64 lse, split into two
    fp32 parts, keeps every gradient within 10× eager fp32's own error against float64 (and 1e-5)."""
    params, targets = wide_belief_case()

    def grads(fn, dtype, device):
        x = [p.to(device, dtype).requires_grad_() for p in params]
        return [t.cpu().double() for t in torch.autograd.grad(fn(*x), x)]

    def eager(*p):
        return F.cross_entropy(kl_decode_logits_naive(*p, 1.0), targets.to(p[0].device))

    ref, own = grads(eager, torch.float64, "cpu"), grads(eager, torch.float32, "cpu")
    got = grads(lambda *p: torch.ops.hecate.kl_decode_ce(*p, targets.cuda(), 1.0, -100)[0].mean(), torch.float32,
                "cuda")
    for name, a, e, r in zip(("d mu", "d var", "d prior_mu", "d prior_var"), got, own, ref):
        error, eager_error = ((a - r).norm() / r.norm()).item(), ((e - r).norm() / r.norm()).item()
        assert error <= max(10 * eager_error, 1e-6) and error <= 1e-5, (name, error, eager_error)


# ---------------------------------------------------------------------------------------------
# opcheck on CUDA tensors


def _qk_args(phi="elu1", B=2, T=9, D_in=5, D=6, K=4):
    return (torch.randn(B, T, D_in, device="cuda"), torch.randn(D, D_in, device="cuda"), torch.randn(D, device="cuda"),
            torch.randn(D, 1, K, device="cuda"), torch.randn(D, device="cuda"), "silu", phi, [], 0.5)


def _memory_args(B=2, T=5, H=2, Dk=4, Dv=3):
    c = lambda *s: torch.randn(*s, device="cuda")  # noqa: E731
    return (c(B, T, H, Dk) * 0.5, c(B, T, H, Dv), c(B, T, H, Dk), torch.sigmoid(c(B, T, H) - 2),
            0.3 * torch.sigmoid(c(B, T, H)), c(B, H, Dv, Dk) * 0.3, None, 2.5, 10.0, 1e-6, 0.5, 2.0)


@pytest.mark.parametrize("name", ["qk_preprocess", "memory_scan", "kl_attention", "kl_decode_ce", "linear_attention"])
def test_opcheck(name):
    c = lambda *s: torch.randn(*s, device="cuda")  # noqa: E731
    u = lambda *s: torch.rand(*s, device="cuda") + 0.5  # noqa: E731
    args = {
        "qk_preprocess": _qk_args(),
        "memory_scan": _memory_args(),
        "kl_attention": (c(2, 9, 3), u(2, 9, 3), c(2, 9, 2), c(2, 9, 4), 0.8, True, False),
        "kl_decode_ce": (c(6, 3), u(6, 3), c(7, 3), u(7, 3), torch.randint(0, 7, (6,), device="cuda"), 0.8, -100),
        "linear_attention": (u(2, 5, 2, 4), c(2, 5, 2, 3), u(2, 5, 2, 4), torch.sigmoid(c(2, 5, 2)), None, None,
                             True, 1e-6, True),
    }[name]
    args = tuple(a.requires_grad_() if torch.is_tensor(a) and a.is_floating_point() else a for a in args)
    torch.library.opcheck(getattr(torch.ops.hecate, name).default, args)


# ---------------------------------------------------------------------------------------------
# NaN propagates as in ATen


def _nan_pattern_matches(run, args, index):
    """run(*args) with one NaN input element on CUDA and on the CPU (ATen path): same NaN positions."""
    cpu = [a.clone() if torch.is_tensor(a) else a for a in args]
    cpu[0].view(-1)[index] = float("nan")
    gpu = [a.cuda() if torch.is_tensor(a) else a for a in cpu]
    ref, got = run(*cpu), run(*gpu)
    ref, got = [ref] if torch.is_tensor(ref) else ref, [got] if torch.is_tensor(got) else got
    for r, g in zip(ref, got):
        assert torch.isnan(r).any()
        assert torch.equal(torch.isnan(g.cpu()), torch.isnan(r))


@pytest.mark.parametrize("phi", ["elu1", "relu", "relu2", "exp"])
def test_qk_preprocess_propagates_nan(phi):
    args = [a.cpu() if torch.is_tensor(a) else a for a in _qk_args(phi)]
    args[1] = torch.eye(6, 5)  # the projection carries the NaN to one channel only
    _nan_pattern_matches(torch.ops.hecate.qk_preprocess, args, 7)


def test_memory_scan_and_kl_attention_propagate_nan():
    args = [a.cpu() if torch.is_tensor(a) else a for a in _memory_args()]
    _nan_pattern_matches(lambda *a: torch.ops.hecate.memory_scan(*a)[:2], args, 11)
    kl = (torch.randn(2, 9, 3), torch.rand(2, 9, 3) + 0.5, torch.randn(2, 9, 2), torch.randn(2, 9, 4))
    _nan_pattern_matches(lambda *a: torch.ops.hecate.kl_attention(*a, 0.8, True, False)[:3], kl, 40)


# ---------------------------------------------------------------------------------------------
# inputs that are no error: a mask per sequence, a NaN gate, a diverging state, a batch with every target ignored


def test_kl_attention_mask_per_sequence(poison_allocations):
    """A mask given per sequence ([B, N, N]: causal and a key-padding mask of its own per sequence)."""
    b, n, k = 2, 67, 8
    keep = torch.rand(b, n) < 0.8
    keep[:, 0] = True  # every query keeps a key
    allowed = keep[:, None, :] & torch.ones(n, n, dtype=torch.bool).tril()
    mu, var = torch.randn(b, n, k) * k ** -0.5, 0.5 + torch.rand(b, n, k)
    ref_in, dev_in = _leaves((mu, var, torch.randn(b, n, 3), torch.randn(b, n, 5)), "cuda")
    got = torch.ops.hecate.kl_attention(*dev_in, 0.7, False, False, None, allowed.cuda())
    ref = kl_attention_naive(*ref_in, 0.7, False, False, allowed)
    _compare(OUTPUT_NAMES, got, ref, ("d mu", "d var", "d row_values", "d col_values"), dev_in, ref_in, TOL)


def _finite_steps(y):
    """[B, H]: how many steps from the first are finite, after asserting that the finite steps are a prefix."""
    finite = torch.isfinite(y).all(-1).cpu()  # [B, T, H]
    steps = finite.long().cumprod(1).sum(1)
    assert torch.equal(finite.sum(1), steps), "a finite step after a non-finite one"
    return steps


def _same_where_finite(name, got, ref):
    """got (CUDA) finite exactly where ref (the CPU op, float32) is, which must have non-finite values, and
    equal there."""
    got = got.cpu()
    assert torch.equal(torch.isfinite(got), torch.isfinite(ref)), name
    assert not torch.isfinite(ref).all(), f"{name}: the case must reach a non-finite value"
    finite = torch.isfinite(ref)
    assert_close(name, got[finite].double(), ref[finite].double(), TOL)


def test_memory_scan_nan_gate_at_a_chunked_length():
    """At T = 70 finite inputs take the chunk kernels; a NaN gate takes the recurrent kernels and gives what the
    CPU op gives: finite reads before its step, NaN from it on."""
    B, T, H, Dk, Dv = 2, 70, 2, 16, 8
    alpha = torch.sigmoid(torch.randn(B, T, H) - 2)
    alpha[0, 3, 1] = float("nan")
    args = (torch.randn(B, T, H, Dk) * 0.5, torch.randn(B, T, H, Dv), torch.randn(B, T, H, Dk), alpha,
            0.3 * torch.sigmoid(torch.randn(B, T, H)), torch.randn(B, H, Dv, Dk) * 0.3, None, 2.0, 10.0, 1e-6, 0.0,
            2.0)
    ref = torch.ops.hecate.memory_scan(*args)[:2]
    got = torch.ops.hecate.memory_scan(*(a.cuda() if torch.is_tensor(a) else a for a in args))[:2]
    _same_where_finite("y", got[0], ref[0])
    assert torch.equal(torch.isfinite(got[1].cpu()), torch.isfinite(ref[1])), "m_final"


def test_memory_scan_diverging_state_at_a_chunked_length():
    """A delta rule whose state overflows (keys of norm 30, η = 0.5: ×450 a step) with finite inputs: the chunk
    kernels' results are not finite, so the recurrent kernels recompute them. Each head's reads stay finite up to
    the step where its state overflows, as on the CPU; that step may differ by one (the state's last finite
    value within rounding of the float32 limit on one and not the other; seen on an H100), never by a chunk's
    length, as the chunk products' NaN would spread it."""
    B, T, H, Dk, Dv = 2, 70, 2, 16, 8
    args = (30 * F.normalize(torch.randn(B, T, H, Dk), dim=-1), torch.randn(B, T, H, Dv), torch.randn(B, T, H, Dk),
            torch.zeros(B, T, H), torch.full((B, T, H), 0.5), torch.randn(B, H, Dv, Dk) * 0.3, None, 2.0, 10.0, 1e-6,
            0.0, 2.0)
    ref = torch.ops.hecate.memory_scan(*args)[0]
    got = torch.ops.hecate.memory_scan(*(a.cuda() if torch.is_tensor(a) else a for a in args))[0]
    steps, ref_steps = _finite_steps(got), _finite_steps(ref)
    assert (ref_steps >= 5).all() and (ref_steps < T).all(), ref_steps
    assert ((steps - ref_steps).abs() <= 1).all(), (steps, ref_steps)
    assert_close("y of the first steps", got[:, :5].cpu().double(), ref[:, :5].double(), TOL)


def test_linear_attention_nan_gate_at_a_chunked_length():
    B, T, H, Dk, Dv = 2, 70, 2, 16, 8
    k, q = F.elu(torch.randn(B, T, H, Dk)) + 1, F.elu(torch.randn(B, T, H, Dk)) + 1
    alpha = torch.sigmoid(torch.randn(B, T, H) + 2)
    alpha[1, 2, 0] = float("nan")
    args = (k, torch.randn(B, T, H, Dv), q, alpha, torch.randn(B, H, Dv, Dk), torch.rand(B, H, Dk) + 1,
            True, 1e-6, True)
    ref = torch.ops.hecate.linear_attention(*args)[0]
    got = torch.ops.hecate.linear_attention(*(a.cuda() if torch.is_tensor(a) else a for a in args))[0]
    _same_where_finite("y", got, ref)


def test_kl_decode_ce_every_target_ignored():
    """The mean over a batch with every target ignored gives each row an infinite gradient; the ignored rows
    still get 0, as in ATen (not inf · 0 = NaN)."""
    params = [p.cuda().requires_grad_() for p in (torch.randn(6, 3), torch.rand(6, 3) + 0.5, torch.randn(9, 3),
                                                  torch.rand(9, 3) + 0.5)]
    targets = torch.full((6,), -100, device="cuda")
    loss, _ = torch.ops.hecate.kl_decode_ce(*params, targets, 0.8, -100)
    grads = torch.autograd.grad(loss.sum() / (targets != -100).sum(), params)
    for name, g in zip(("d mu", "d var", "d prior_mu", "d prior_var"), grads):
        assert torch.equal(g, torch.zeros_like(g)), (name, g)


# ---------------------------------------------------------------------------------------------
# the models, compiled


def _run(model, args):
    """The model's floating outputs and the gradients of Σ (out·w) for every parameter (w fixed per shape)."""
    out = model(*args)
    outs = [o for o in (out if isinstance(out, (tuple, list)) else [out]) if torch.is_tensor(o) and o.is_floating_point()]
    params = [p for p in model.parameters() if p.requires_grad]
    total = sum((o * torch.linspace(-1, 1, o.numel(), device=o.device).view_as(o)).sum() for o in outs)
    return outs, torch.autograd.grad(total, params, allow_unused=True) if total.requires_grad else []


def _fusions(model, args) -> list[str]:
    """The ops Hecate's passes fuse in the model on the CPU (explain: the passes alone, no Inductor)."""
    torch._dynamo.reset()
    return sorted(f.op for f in hecate.explain(model, *args).fusions)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_model_compiled_on_cuda(name):
    model, args = EXAMPLES[name]()
    cpu_fusions = _fusions(copy.deepcopy(model), args)
    model = model.cuda()
    args = tuple(a.cuda() if torch.is_tensor(a) else a for a in args)
    eager = copy.deepcopy(model)
    torch._dynamo.reset()
    outs, grads = _run(torch.compile(model, backend="hecate"), args)
    assert sorted(f.op for f in hecate.last_report().fusions) == cpu_fusions, str(hecate.last_report())
    ref_outs, ref_grads = _run(eager, args)
    assert all(torch.isfinite(r).all() for r in ref_outs), f"{name}: the example itself is not finite in eager"
    for i, (o, r) in enumerate(zip(outs, ref_outs)):
        assert_close(f"output {i}", o, r, TOL)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    for pname, g, r in zip(names, grads, ref_grads):
        if r is not None and r.norm() > 0:
            assert_close(f"d {pname}", g, r, TOL)
