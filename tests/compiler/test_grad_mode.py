"""Code run under ``torch.no_grad()`` / ``detach`` / autocast keeps its meaning through Hecate:
no common subexpression is shared across a change of grad mode or autocast, and no fused op
lets gradients through where the user's code stops them."""

import pytest
import torch
import torch.nn.functional as F

import hecate
from hecate.testing import assert_close, assert_outputs_and_gradients_close


def same_expression_with_and_without_grad(x):
    with torch.no_grad():
        a = x.sin() * 2
    b = x.sin() * 2  # identical call, but this one is differentiated
    return a + b


@pytest.mark.parametrize("fallback", ["eager", "inductor"])
def test_an_expression_under_no_grad_is_not_shared_with_its_twin_outside(fallback, fresh_dynamo):
    x = torch.randn(7, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    got = torch.compile(same_expression_with_and_without_grad, backend="hecate", options={"fallback": fallback})(x)
    assert_outputs_and_gradients_close(got, same_expression_with_and_without_grad(x_ref), [x], [x_ref], 1e-6)


def same_product_in_and_out_of_autocast(x, w):
    with torch.autocast("cpu", torch.bfloat16):
        low = x @ w
    return low.float() + x @ w  # the second product in float32


def test_an_expression_under_autocast_is_not_shared_with_its_twin_outside(fresh_dynamo):
    x, w = torch.randn(4, 8), torch.randn(8, 3)
    got = torch.compile(same_product_in_and_out_of_autocast, backend="hecate", options={"fallback": "eager"})(x, w)
    assert_close("output", got, same_product_in_and_out_of_autocast(x, w), 1e-6)


def _kl(mu, var):
    mi, mj, vi, vj = mu[:, :, None], mu[:, None], var[:, :, None], var[:, None]
    return 0.5 * (torch.log(vj / vi) + (vi + (mi - mj) ** 2) / vj - 1).sum(-1)


def score_without_grad(mu, var):  # β from a KL computed without gradients, the values differentiated
    with torch.no_grad():
        kl = _kl(mu, var)
    return F.softmax(-kl, -1) @ mu


def score_detached(mu, var):
    return F.softmax(-_kl(mu, var).detach(), -1) @ mu


@pytest.mark.parametrize("fn", [score_without_grad, score_detached])
def test_a_score_whose_gradient_the_user_stops_is_reported_not_fused(fn, fresh_dynamo):
    mu, var = torch.randn(2, 5, 3, requires_grad=True), (torch.rand(2, 5, 3) + 0.2).requires_grad_()
    refs = [mu.detach().clone().requires_grad_(), var.detach().clone().requires_grad_()]
    got = torch.compile(fn, backend="hecate", options={"fallback": "eager"})(mu, var)
    report = hecate.last_report()
    assert report.count("kl_attention") == 0, str(report)
    assert any("gradients stop inside it" in m.reason for m in report.misses if m.pattern == "kl_attention"), \
        str(report)
    out, ref = got, fn(*refs)
    assert_close("output", out, ref, 1e-6)
    weights = torch.randn(ref.shape)
    g_mu, = torch.autograd.grad((out * weights).sum(), [mu])
    r_mu, = torch.autograd.grad((ref * weights).sum(), [refs[0]])
    assert_close("grad mu", g_mu, r_mu, 1e-5)


def attention_and_decode_under_no_grad_read_after(mu, var, prior_mean, prior_log_var):
    """KL attention and KL decode logits made inside ``with torch.no_grad():`` and returned from it, beside a term
    with gradients: every fused output is read through detach, as eager's are (probe r33: kl_decode refused, as if
    the fused op would let gradients through)."""
    with torch.no_grad():
        mu_next = F.softmax(-_kl(mu, var), -1) @ mu
        d = mu_next[..., None, :] - prior_mean
        logits = -0.5 * (prior_log_var - var.log()[..., None, :] + (var[..., None, :] + d ** 2)
                         / prior_log_var.exp() - 1).sum(-1)
    return logits, (mu * var).sum()


def test_fused_ops_made_under_no_grad_and_read_after_it_fuse_without_gradients(fresh_dynamo):
    torch.manual_seed(0)
    mu, var = torch.randn(2, 5, 3, requires_grad=True), (torch.rand(2, 5, 3) + 0.2).requires_grad_()
    prior_mean, prior_log_var = torch.randn(7, 3, requires_grad=True), (0.2 * torch.randn(7, 3)).requires_grad_()
    inputs = [mu, var, prior_mean, prior_log_var]
    refs = [x.detach().clone().requires_grad_() for x in inputs]
    fn = attention_and_decode_under_no_grad_read_after
    (logits, energy) = torch.compile(fn, backend="hecate", options={"fallback": "eager", "strict": True})(*inputs)
    report = hecate.last_report()
    assert report.count("kl_attention") == 1 and report.count("kl_decode") == 1 and not report.misses, str(report)
    ref_logits, ref_energy = fn(*refs)
    assert not logits.requires_grad and not ref_logits.requires_grad
    assert_close("logits", logits, ref_logits, 1e-5)
    got = torch.autograd.grad(energy, [mu, var])
    want = torch.autograd.grad(ref_energy, refs[:2])
    for name, g, r in zip(("mu", "var"), got, want):
        assert_close(f"grad {name}", g, r, 1e-6)


def shifted_by_detached_row_max(mu, var):  # the stable-softmax idiom: the shift does not change β or its gradient
    s = -_kl(mu, var)
    return F.softmax(s - s.amax(-1, keepdim=True).detach(), -1) @ mu


def test_softmax_of_a_score_shifted_by_its_detached_row_max_fuses(fresh_dynamo):
    mu, var = torch.randn(2, 5, 3, requires_grad=True), (torch.rand(2, 5, 3) + 0.2).requires_grad_()
    refs = [mu.detach().clone().requires_grad_(), var.detach().clone().requires_grad_()]
    got = torch.compile(shifted_by_detached_row_max, backend="hecate", options={"fallback": "eager"})(mu, var)
    assert hecate.last_report().count("kl_attention") == 1, str(hecate.last_report())
    assert_outputs_and_gradients_close(got, shifted_by_detached_row_max(*refs), [mu, var], refs, 1e-5)


def delta_rule_error_without_grad(k, v, q):  # the memory's error term computed under no_grad, in a loop
    m = k.new_zeros(k.shape[0], v.shape[-1], k.shape[-1])
    ys = []
    for t in range(k.shape[1]):
        kt, vt = k[:, t], v[:, t]
        with torch.no_grad():
            err = torch.einsum("bvk,bk->bv", m, kt) - vt
        m = m - 0.1 * err[:, :, None] * kt[:, None, :]
        ys.append(torch.einsum("bvk,bk->bv", m, q[:, t]))
    return torch.stack(ys, 1)


def test_a_memory_loop_whose_gradient_the_user_stops_is_reported_not_fused(fresh_dynamo):
    args = [torch.randn(2, 6, 3, requires_grad=True), torch.randn(2, 6, 4, requires_grad=True),
            torch.randn(2, 6, 3, requires_grad=True)]
    refs = [a.detach().clone().requires_grad_() for a in args]
    got = torch.compile(delta_rule_error_without_grad, backend="hecate", options={"fallback": "eager"})(*args)
    report = hecate.last_report()
    assert report.count("memory_scan") == 0, str(report)
    assert any("gradients stop inside it" in m.reason for m in report.misses), str(report)
    ref = delta_rule_error_without_grad(*refs)
    assert_close("output", got, ref, 1e-6)
    weights = torch.randn(ref.shape)
    grads = torch.autograd.grad((got * weights).sum(), args, allow_unused=True)
    ref_grads = torch.autograd.grad((ref * weights).sum(), refs, allow_unused=True)
    assert ref_grads[1] is None and grads[1] is None  # v reaches the output only through the no_grad error
    for name, g, r in zip(("k", "q"), grads[::2], ref_grads[::2]):
        assert_close(f"grad {name}", g, r, 1e-5)


# ---------------------------------------------------------------- what a loop's steps share, read in its own mode

def shared_under_no_grad(h, w):
    with torch.no_grad():
        s = torch.tanh(w) * 3.0
    return torch.stack([h[:, t] * s for t in range(h.shape[1])], 1)


def shared_under_autocast(h, w):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        s = w @ w.t()
    return torch.stack([h[:, t] @ s.float() for t in range(h.shape[1])], 1)


def test_what_every_step_reads_stays_in_its_no_grad_region(fresh_dynamo):
    """Loop rolling moves what the steps share before the loop; moved out of ``no_grad`` it got a gradient."""
    h, w = torch.randn(2, 5, 4, requires_grad=True), torch.randn(4, requires_grad=True)
    out = torch.compile(shared_under_no_grad, backend="hecate", options={"fallback": "eager"})(h, w)
    assert_close("output", out, shared_under_no_grad(h, w), 1e-6)
    assert torch.autograd.grad(out.sum(), [h, w], allow_unused=True)[1] is None


def test_what_every_step_reads_stays_in_its_autocast_region(fresh_dynamo):
    """Moved out of autocast, the product ran in float32 (2e-3 off); kept there, its ``.float()`` must stay (the
    re-trace records the region but not its casts: the product's value in the graph says float32)."""
    h, w = torch.randn(2, 5, 4), torch.randn(4, 4)
    for fallback in ("eager", "inductor"):
        torch._dynamo.reset()
        got = torch.compile(shared_under_autocast, backend="hecate", options={"fallback": fallback})(h, w)
        assert_close(f"output ({fallback})", got, shared_under_autocast(h, w), 1e-6)


def test_what_every_step_reads_keeps_enable_grad_under_no_grad(fresh_dynamo):
    def f(h, w):
        with torch.enable_grad():
            s = torch.tanh(w) * 3.0
        return torch.stack([h[:, t] * s for t in range(h.shape[1])], 1), s

    h, w = torch.randn(2, 5, 4), torch.randn(4, requires_grad=True)
    with torch.no_grad():
        _, s = torch.compile(f, backend="hecate", options={"fallback": "eager"})(h, w)
    assert s.requires_grad


def test_a_fused_memory_loop_keeps_its_step_size_out_of_autograd(fresh_dynamo):
    """η computed under no_grad before a delta-rule loop that fuses: η gets no gradient, as in eager."""
    def delta(x, wk, eta_logit):
        k = F.normalize(x @ wk, dim=-1)
        with torch.no_grad():
            eta = torch.sigmoid(eta_logit)
        M, ys = x.new_zeros(x.shape[0], 4, 4), []
        for t in range(x.shape[1]):
            e = torch.einsum("bij,bj->bi", M, k[:, t]) - x[:, t]
            M = M - eta * torch.einsum("bi,bj->bij", e, k[:, t])
            ys.append(torch.einsum("bij,bj->bi", M, k[:, t]))
        return torch.stack(ys, 1)

    x, wk, eta_logit = torch.randn(2, 5, 4), torch.randn(4, 4, requires_grad=True), torch.tensor(0.3, requires_grad=True)
    got = torch.compile(delta, backend="hecate", options={"fallback": "eager"})(x, wk, eta_logit)
    assert hecate.last_report().count("memory_scan") == 1, str(hecate.last_report())
    ref = delta(x, wk, eta_logit)
    assert_close("output", got, ref, 1e-5)
    grads = torch.autograd.grad(got.sum(), [wk, eta_logit], allow_unused=True)
    ref_grads = torch.autograd.grad(ref.sum(), [wk, eta_logit], allow_unused=True)
    assert grads[1] is None and ref_grads[1] is None
    assert_close("d wk", grads[0], ref_grads[0], 1e-5)
