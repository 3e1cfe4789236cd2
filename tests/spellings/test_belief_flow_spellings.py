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


class PrecisionsMove(nn.Module):
    """Beliefs in precision form λ = 1/σ², the KL written over λ, and both μ and λ averaged by β each step."""

    def __init__(self, steps=3):
        super().__init__()
        self.steps, self.enc = steps, nn.Linear(D, 2 * D)

    def forward(self, x):
        mu, rho = self.enc(x).chunk(2, -1)
        lam = F.softplus(rho) + 0.5
        for _ in range(self.steps):
            var = 1.0 / lam
            kl = 0.5 * ((lam[:, :, None] / lam[:, None]).log()
                        + lam[:, None] * (var[:, :, None] + (mu[:, :, None] - mu[:, None]) ** 2) - 1).sum(-1)
            beta = torch.softmax(-kl / 2.0, -1)
            mu, lam = beta @ mu, beta @ lam
        return mu, lam


class HeadsUnderAPaddingMask(nn.Module):
    """Heads [B, H, N, D/H], a causal mask and a key-padding mask of the zero tokens, κ = exp(log κ) learned; μ and
    σ² both averaged by β (the second step reads the first step's fused outputs)."""

    def __init__(self, steps=2, heads=2):
        super().__init__()
        self.steps, self.heads, self.enc = steps, heads, nn.Linear(D, 2 * D)
        self.log_kappa = nn.Parameter(torch.tensor(0.1))

    def forward(self, x):
        b, n, _ = x.shape
        mu, rho = self.enc(x).view(b, n, 2 * self.heads, -1).transpose(1, 2).chunk(2, 1)
        var = F.softplus(rho) + 0.1
        padded = x.abs().sum(-1) == 0  # [B, N]: padding tokens are zero vectors
        allowed = torch.ones(n, n, dtype=torch.bool).tril()[None, None] & ~padded[:, None, None, :]
        for _ in range(self.steps):
            kl = 0.5 * (var.log()[:, :, None] - var.log()[:, :, :, None]
                        + (var[:, :, :, None] + (mu[:, :, :, None] - mu[:, :, None]) ** 2) / var[:, :, None] - 1).sum(-1)
            beta = torch.softmax((-kl / self.log_kappa.exp()).masked_fill(~allowed, float("-inf")), dim=-1)
            mu, var = beta @ mu, beta @ var
        return mu, var


FLOWS = {
    "precisions_move": (PrecisionsMove, 3),
    "heads_under_a_padding_mask": (HeadsUnderAPaddingMask, 2),
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


@pytest.mark.parametrize("name", ["means_and_variances_move", "precisions_move", "heads_under_a_padding_mask"])
def test_chained_steps_fuse_under_dynamic_shapes(name, fresh_dynamo):
    """Each step's beliefs are the step before's fused outputs, whose sizes (read off tensors under dynamic=True)
    are no values the next step is computed from, and whose code is Hecate's own, not a family's signature (probe
    r33: the last step refused as "a bound or branch on data", a precision flow's second step as no KL, a conv
    reported over the cat that joins the fused operands)."""
    make, steps = FLOWS[name]
    torch.manual_seed(0)
    model = make()
    compiled = torch.compile(model, backend="hecate", dynamic=True, options={"strict": True})
    for batch, length in [(2, 7), (2, 5)]:
        x = torch.randn(batch, length, D)
        xc, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
        got, ref = compiled(xc), model(xe)
        report = hecate.last_report()
        assert report.count("kl_attention") == steps and not report.misses, str(report)
        params = list(model.parameters())
        assert_outputs_and_gradients_close(got, ref, [xc, *params], [xe, *params], TOL)
