"""Belief flows (several KL-attention steps, each moving the beliefs) and free energies, as researchers write them.

Each module below runs S steps of pairwise-KL attention whose beliefs change from step to
step (the next means read the previous means *and*, through β, the variances), and some sum
the alignment energy Σ_ij β_ij KL_ij in their own way. Every step must fuse into its own
``kl_attention`` (no near-miss), and the compiled module must equal eager (relative error
≤ 1e-5, fp32), outputs and the gradients of the input and every parameter.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hecate
from hecate.testing import assert_close, assert_outputs_and_gradients_close

TOL = 1e-5
B, N, D = 2, 7, 6


def kl_logvar(mu, logvar):  # KL(q_i ‖ q_j) over log-variances: [B, N, D] → [B, N, N]
    var = logvar.exp()
    d = mu.unsqueeze(2) - mu.unsqueeze(1)
    return 0.5 * ((var.unsqueeze(2) + d * d) / var.unsqueeze(1) + logvar.unsqueeze(1) - logvar.unsqueeze(2) - 1).sum(-1)


def kl_var(mu, var):  # KL over variances, None-indexing, ** 2
    diff = mu[:, :, None, :] - mu[:, None, :, :]
    return 0.5 * (var[:, :, None] / var[:, None] + diff ** 2 / var[:, None] - 1
                  + var[:, None].log() - var[:, :, None].log()).sum(-1)


class MeansFollowAttention(nn.Module):
    """μ ← μ − λ(μ − βμ): only the means move; the variances are the encoder's."""

    def __init__(self, steps=3, lr=0.1):
        super().__init__()
        self.steps, self.lr, self.enc = steps, lr, nn.Linear(D, 2 * D)

    def forward(self, x):
        mu, logvar = self.enc(x).chunk(2, -1)
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
        for _ in range(self.steps):
            kl = kl_logvar(mu, logvar)
            attn = kl.neg().div(0.7).masked_fill(~causal, float("-inf")).softmax(-1)
            mu = mu - self.lr * (mu - attn @ mu)
        return mu


class GradientOfTheAlignmentByEinsum(nn.Module):
    """μ ← μ − λ Σ_j β_ij (μ_i − μ_j)/σ²_j by an einsum over the pair differences, beside the energy Σ β·KL (probe
    r30: every step fused, and each later step's softmax also reported as a ratio of exps that is no softmax)."""

    def __init__(self, steps=3):
        super().__init__()
        self.steps, self.enc = steps, nn.Linear(D, 2 * D)

    def forward(self, x):
        mu, rho = self.enc(x).chunk(2, -1)
        var, energy = F.softplus(rho) + 0.05, 0.0
        for _ in range(self.steps):
            d = mu.unsqueeze(2) - mu.unsqueeze(1)
            kl = 0.5 * (var.unsqueeze(2) / var.unsqueeze(1) + d ** 2 / var.unsqueeze(1) - 1
                        + var.unsqueeze(1).log() - var.unsqueeze(2).log()).sum(-1)
            beta = F.softmax(-kl / 2.0, dim=-1)
            energy = energy + (beta * kl).sum((-1, -2)).mean()
            mu = mu - 0.3 * torch.einsum("bij,bijk->bik", beta, d / var.unsqueeze(1))
        return mu, energy


class MeansAndVariancesMove(nn.Module):
    """Both parameters move each step (β read by ``@`` and by ``torch.bmm``)."""

    def __init__(self, steps=3):
        super().__init__()
        self.steps, self.enc = steps, nn.Linear(D, 2 * D)

    def forward(self, x):
        mu, logvar = self.enc(x).chunk(2, -1)
        for _ in range(self.steps):
            beta = torch.softmax(-kl_logvar(mu, logvar), dim=-1)
            mu = 0.5 * mu + 0.5 * beta @ mu
            logvar = 0.9 * logvar + 0.1 * torch.bmm(beta, logvar)
        return mu, logvar


class LayerPerStep(nn.Module):
    """A ModuleList, one projection per step; ``torch.distributions`` KL; a mask from ``arange`` by ``where``."""

    def __init__(self, steps=2):
        super().__init__()
        self.layers, self.enc = nn.ModuleList(nn.Linear(D, D) for _ in range(steps)), nn.Linear(D, 2 * D)

    def forward(self, x):
        mu, std = self.enc(x).chunk(2, -1)
        std = F.softplus(std) + 1e-3
        n = x.shape[1]
        allowed = torch.arange(n)[:, None] >= torch.arange(n)[None, :]
        for layer in self.layers:
            p = torch.distributions.Normal(mu.unsqueeze(-2), std.unsqueeze(-2))
            q = torch.distributions.Normal(mu.unsqueeze(-3), std.unsqueeze(-3))
            kl = torch.distributions.kl_divergence(p, q).sum(-1)
            mu = mu + layer(torch.where(allowed, -kl, float("-inf")).softmax(-1) @ mu)
        return mu


class CentredAlignment(nn.Module):
    """The means move along β_ij (KL_ij − Ā_i), Ā_i = Σ_j β_ij KL_ij (the softmax's own gradient form), the mean
    taken off by adding its negation: a sum over the keys that feeds back into the terms summed again."""

    def __init__(self, steps=2):
        super().__init__()
        self.steps, self.enc = steps, nn.Linear(D, 2 * D)

    def forward(self, x):
        mu, logvar = self.enc(x).chunk(2, -1)
        for _ in range(self.steps):
            kl = kl_logvar(mu, logvar)
            beta = torch.softmax(-kl, -1)
            mean_kl = (beta * kl).sum(-1, keepdim=True)
            mu = mu - 0.1 * (beta * (kl + -mean_kl)) @ mu
        return mu


ENERGIES = {  # Σ β KL, summed over keys and more, or averaged
    "sum": lambda a, kl: (a * kl).sum(),
    "mean": lambda a, kl: (a * kl).mean(),
    "sum_pairs": lambda a, kl: (a * kl).sum((1, 2)),
    "sum_pairs_keepdim": lambda a, kl: torch.sum(a * kl, dim=(-2, -1), keepdim=True),
    "sum_batch_and_keys": lambda a, kl: (a * kl).sum((0, 2)),
    "mean_over_keys": lambda a, kl: (a * kl).mean(-1),
    "einsum_per_sequence": lambda a, kl: torch.einsum("bij,bij->b", a, kl),
    "einsum_total": lambda a, kl: torch.einsum("bij,bij->", a, kl),
}


class FreeEnergyAlongTheFlow(nn.Module):
    """A learned variance shared by every position; the alignment energy of every step returned."""

    def __init__(self, energy, steps=3):
        super().__init__()
        self.energy, self.steps = energy, steps
        self.enc, self.var = nn.Linear(D, D), nn.Parameter(torch.rand(D) + 0.5)

    def forward(self, x):
        mu, var = self.enc(x), self.var.expand(x.shape[0], x.shape[1], D)
        total = 0
        for _ in range(self.steps):
            kl = kl_var(mu, var)
            att = F.softmax(-kl / 0.5, -1)
            total = total + self.energy(att, kl).mean()
            mu = mu - 0.2 * (mu - torch.einsum("bij,bjd->bid", att, mu))
        return mu, total


class FlowThenDecode(nn.Module):
    """A step moving means and log-variances by attention (β @ μ, β @ log v: one op, two spans of its sums),
    then KL decoding against token priors, the cross-entropy returned."""

    def __init__(self, vocab=7):
        super().__init__()
        self.enc = nn.Linear(D, 2 * D)
        self.prior_mu, self.prior_logvar = nn.Parameter(torch.randn(vocab, D)), nn.Parameter(torch.zeros(vocab, D))

    def forward(self, x):
        mu, logvar = self.enc(x).chunk(2, -1)
        beta = torch.softmax(-kl_logvar(mu, logvar), dim=-1)
        mu, logvar = beta @ mu, beta @ logvar
        kl = 0.5 * (self.prior_logvar - logvar.unsqueeze(2) + (logvar.exp().unsqueeze(2)
                    + (mu.unsqueeze(2) - self.prior_mu) ** 2) / self.prior_logvar.exp() - 1).sum(-1)
        targets = torch.arange(x.shape[1]).remainder(self.prior_mu.shape[0]).expand(x.shape[0], -1)
        return F.cross_entropy(-kl.reshape(-1, kl.shape[-1]), targets.reshape(-1))


def test_decode_after_a_step_moving_means_and_variances_fuses(fresh_dynamo):
    """The decode reads the beliefs as the attention op's sums, kept in the graph's dtype without a cast (a cast
    rounded the values the decode is recognised at)."""
    torch.manual_seed(0)
    model = FlowThenDecode()
    x = torch.randn(B, N, D)
    xc, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    got = torch.compile(model, backend="hecate", options={"strict": True})(xc)
    report = hecate.last_report()
    assert [f.op for f in report.fusions] == ["hecate.kl_attention", "hecate.kl_decode_ce"], str(report)
    params = list(model.parameters())
    assert_outputs_and_gradients_close(got, model(xe), [xc, *params], [xe, *params], TOL)


FLOWS = {
    "means_follow_attention": (MeansFollowAttention, 3),
    "means_and_variances_move": (MeansAndVariancesMove, 3),
    "gradient_of_the_alignment_by_einsum": (GradientOfTheAlignmentByEinsum, 3),
    "layer_per_step": (LayerPerStep, 2),
    "centred_alignment": (CentredAlignment, 2),
    **{f"free_energy_{name}": ((lambda e=e: FreeEnergyAlongTheFlow(e)), 3) for name, e in ENERGIES.items()},
}


@pytest.mark.parametrize("name", list(FLOWS))
def test_every_step_fuses_and_equals_eager(name, fresh_dynamo):
    make, steps = FLOWS[name]
    torch.manual_seed(0)
    model = make()
    x = torch.randn(B, N, D)
    compiled = torch.compile(model, backend="hecate", options={"strict": True})
    xc, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    got, ref = compiled(xc), model(xe)
    report = hecate.last_report()
    assert report.count("kl_attention") == steps, str(report)
    assert not report.misses, str(report)
    params = list(model.parameters())
    assert_outputs_and_gradients_close(got, ref, [xc, *params], [xe, *params], TOL)


@pytest.mark.parametrize("name", ["mean", "mean_over_keys", "sum_pairs", "einsum_total"])
def test_energies_fuse_under_dynamic_shapes_at_other_sizes(name, fresh_dynamo):
    torch.manual_seed(0)
    model = FreeEnergyAlongTheFlow(ENERGIES[name], steps=2)
    compiled = torch.compile(model, backend="hecate", dynamic=True, options={"strict": True})
    for batch, length in [(2, 7), (3, 5), (4, 9)]:
        x = torch.randn(batch, length, D)
        got, ref = compiled(x), model(x)
        report = hecate.last_report()
        assert report.count("kl_attention") == 2 and not report.misses, str(report)
        for i, (g, r) in enumerate(zip(got, ref)):
            assert_close(f"output {i} at {batch}x{length}", g, r, TOL)
