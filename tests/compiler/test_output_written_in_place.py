"""A family's output written in place after the family (``y[:, 0] = 0``, ``y[:, -1].add_(1)``).

The write comes after the family's last read, so it changes nothing the fused op computes: the op
fuses and the code writes into a copy of its result (never into the result itself, which its
backward may have saved). Probe r27 found every family refused here ("would see it at another point
than the code does"). Each case fuses and equals eager, outputs and gradients (≤ 1e-5).
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hecate
from hecate.testing import assert_close, assert_outputs_and_gradients_close

TOL = 1e-5
D = 6


class QK(nn.Module):  # projection → causal depthwise conv → SiLU → elu + 1
    def __init__(self):
        super().__init__()
        self.proj, self.conv = nn.Linear(D, D), nn.Conv1d(D, D, 3, groups=D, padding=2)

    def forward(self, x):
        h = self.conv(self.proj(x).transpose(1, 2))[..., :x.shape[1]].transpose(1, 2)
        return F.elu(F.silu(h)) + 1


class DeltaRule(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        q, k, v = self.q(x), F.normalize(self.k(x), dim=-1), self.v(x)
        memory, ys = x.new_zeros(x.shape[0], D, D), []
        for t in range(x.shape[1]):
            error = torch.einsum("bvk,bk->bv", memory, k[:, t]) - v[:, t]
            memory = 0.95 * memory - 0.4 * torch.einsum("bv,bk->bvk", error, k[:, t])
            ys.append(torch.einsum("bvk,bk->bv", memory, q[:, t]))
        return torch.stack(ys, 1)


class Hebbian(nn.Module):  # M_t = 0.9 M_{t−1} + v_t φ(k_t)ᵀ, y_t = M_t φ(q_t)
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        q, k = F.elu(q) + 1, F.elu(k) + 1
        memory, ys = x.new_zeros(x.shape[0], D, D), []
        for t in range(x.shape[1]):
            memory = 0.9 * memory + v[:, t, :, None] * k[:, t, None, :]
            ys.append((memory @ q[:, t, :, None]).squeeze(-1))
        return torch.stack(ys, 1)


class ParallelForm(nn.Module):  # (relu(Q) relu(K)ᵀ ⊙ γ^(t−s)) V
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        t = torch.arange(x.shape[1])
        decay = torch.tril(0.85 ** (t[:, None] - t[None, :]).clamp(min=0).float())
        return ((F.relu(q) @ F.relu(k).transpose(-1, -2)) * decay) @ v


class KLAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(D, 2 * D)

    def forward(self, x):
        mu, raw = self.enc(x).chunk(2, -1)
        var = F.softplus(raw) + 1e-2
        kl = 0.5 * (torch.log(var[:, None] / var[:, :, None]) + (var[:, :, None] + (mu[:, :, None] - mu[:, None]) ** 2)
                    / var[:, None] - 1).sum(-1)
        n = x.shape[1]
        return (-kl).masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf")).softmax(-1) @ mu


class KLDecodeLogits(nn.Module):  # −KL(q_t ‖ π_v) / 0.8 against 7 token priors
    def __init__(self):
        super().__init__()
        self.enc, self.prior_mu, self.prior_raw = nn.Linear(D, 2 * 4), nn.Parameter(torch.randn(7, 4)), \
            nn.Parameter(torch.randn(7, 4))

    def forward(self, x):
        mu, raw = self.enc(x).chunk(2, -1)
        var, prior_var = F.softplus(raw) + 1e-2, F.softplus(self.prior_raw) + 1e-2
        kl = 0.5 * (torch.log(prior_var / var[..., None, :]) + (var[..., None, :] + (mu[..., None, :] - self.prior_mu)
                                                                  ** 2) / prior_var - 1).sum(-1)
        return -kl / 0.8


class WrittenAfter(nn.Module):
    def __init__(self, family, write):
        super().__init__()
        self.family, self.write = family, write

    def forward(self, x):
        y = self.family(x)
        if self.write == "slice assigned":
            y[:, 0] = 0.0
        else:
            y[:, -1].add_(1.0)
        return y


FAMILIES = {QK: "qk_preprocess", DeltaRule: "memory_scan", Hebbian: "linear_attention",
            ParallelForm: "linear_attention", KLAttention: "kl_attention", KLDecodeLogits: "kl_decode"}


@pytest.mark.parametrize("write", ["slice assigned", "slice added to in place"])
@pytest.mark.parametrize("family", list(FAMILIES), ids=lambda f: f.__name__)
def test_an_output_written_in_place_after_the_family_fuses(family, write, fresh_dynamo):
    torch.manual_seed(0)
    model = WrittenAfter(family(), write)
    x = torch.randn(2, 5, D)
    xc, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    got = torch.compile(model, backend="hecate", options={"fallback": "eager", "strict": True})(xc)
    report = hecate.last_report()
    assert report.count(FAMILIES[family]) == 1 and not report.misses, str(report)
    params = list(model.parameters())
    assert_outputs_and_gradients_close(got, model(xe), [xc, *params], [xe, *params], TOL)


def delta_rule_then_keys_written(q, k, v):
    memory, ys = k.new_zeros(k.shape[0], v.shape[-1], k.shape[-1]), []
    for t in range(k.shape[1]):
        error = torch.einsum("bvk,bk->bv", memory, k[:, t]) - v[:, t]
        memory = memory - 0.4 * torch.einsum("bv,bk->bvk", error, k[:, t])
        ys.append(torch.einsum("bvk,bk->bv", memory, q[:, t]))
    k.add_(1.0)  # after the loop's last read
    return torch.stack(ys, 1)


def parallel_form_then_keys_written(q, k, v):
    n = q.shape[1]
    y = ((q @ k.mT) * torch.tril(torch.ones(n, n))) @ v
    k[:, 0] = 0.0
    return y


def kl_attention_then_values_written(q, k, v):  # beliefs (μ = q, var = softplus(k)), β read against v
    var = F.softplus(k)
    kl = 0.5 * (torch.log(var[:, None] / var[:, :, None]) + (var[:, :, None] + (q[:, :, None] - q[:, None]) ** 2)
                / var[:, None] - 1).sum(-1)
    y = torch.softmax(-kl, -1) @ v
    v.mul_(2.0)
    return y


# (with q's gradient where eager's backward does not read the tensor written: the memory is read, not the keys)
WRITTEN_INPUTS = {delta_rule_then_keys_written: ("memory_scan", True),
                  parallel_form_then_keys_written: ("linear_attention", False),
                  kl_attention_then_values_written: ("kl_attention", False)}


@pytest.mark.parametrize("fn", list(WRITTEN_INPUTS), ids=lambda f: f.__name__)
def test_an_input_written_in_place_after_the_family_fuses(fn, fresh_dynamo):
    """A tensor the family reads, written in place after its last read: the op reads a copy taken before (its
    backward may save what it reads), and the caller's tensor is written as eager writes it (probe r29: reported
    as written at another point). Where eager's own backward reads the tensor written it cannot differentiate
    (it finds the tensor modified): those run under no_grad."""
    pattern, with_grad = WRITTEN_INPUTS[fn]
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 5, D), torch.randn(2, 5, D), torch.randn(2, 5, D)
    qc, qe = q.clone().requires_grad_(with_grad), q.clone().requires_grad_(with_grad)
    kc, vc, ke, ve = k.clone(), v.clone(), k.clone(), v.clone()
    with torch.set_grad_enabled(with_grad):
        got = torch.compile(fn, backend="hecate", options={"fallback": "eager", "strict": True})(qc, kc, vc)
        report = hecate.last_report()
        ref = fn(qe, ke, ve)
    assert report.count(pattern) == 1 and not report.misses, str(report)
    if with_grad:
        assert_outputs_and_gradients_close(got, ref, [qc], [qe], TOL)
    else:
        assert_close("output", got, ref, TOL)
    assert torch.equal(kc, ke) and torch.equal(vc, ve)
