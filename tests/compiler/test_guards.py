"""The passes read symbolic sizes without adding guards on them (probe r39).

Comparing a symbolic size with a number (``min(shape) < 2``) or two shapes as tuples makes the shape
environment record a guard: the graph compiled for ``dynamic=True`` then holds only while the guard
does, and the next length recompiles. A KL language model (attention over Gaussian beliefs and the
KL-decode head) compiled once at ``dynamic=True`` runs at every later length without a recompile,
fused and equal to eager; under automatic dynamic shapes it compiles as many frames as ``aot_eager``.
"""

import torch
import torch.nn as nn
from torch._dynamo.utils import counters

import hecate
from hecate.testing import assert_close

TOL = 1e-5


class KLLanguageModel(nn.Module):
    """Token embedding → beliefs N(μ, exp(lv)) → causal softmax(−KL) attention → −KL logits against a prior bank."""

    def __init__(self, vocab=5, d=4, k=3):
        super().__init__()
        self.embed, self.mu, self.log_var = nn.Embedding(vocab, d), nn.Linear(d, k), nn.Linear(d, k)
        self.prior_mu, self.prior_log_var = nn.Parameter(torch.randn(vocab, k)), nn.Parameter(torch.zeros(vocab, k))

    def forward(self, ids):
        x = self.embed(ids)
        mu, lv = self.mu(x), self.log_var(x)
        var = lv.exp()
        kl = 0.5 * (lv[:, None] - lv[:, :, None] + (var[:, :, None] + (mu[:, :, None] - mu[:, None]) ** 2)
                    / var[:, None] - 1).sum(-1)
        n = ids.shape[1]
        future = torch.ones(n, n, dtype=torch.bool, device=ids.device).triu(1)
        beta = torch.softmax((-kl).masked_fill(future, float("-inf")), dim=-1)
        mu = beta @ mu
        prior_var = self.prior_log_var.exp()
        return -0.5 * (self.prior_log_var - lv[:, :, None] + (var[:, :, None] + (mu[:, :, None] - self.prior_mu) ** 2)
                       / prior_var - 1).sum(-1)


def _frames(model, backend, lengths, **kwargs):
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend=backend, **kwargs)
    for n in lengths:
        ids = torch.randint(0, 5, (2, n))
        assert_close(f"logits at length {n}", compiled(ids), model(ids), TOL)
    return counters["frames"]["total"]


def test_a_dynamic_graph_runs_at_every_length_without_a_recompile(fresh_dynamo):
    torch.manual_seed(0)
    model = KLLanguageModel()
    frames = _frames(model, "hecate", [3, 5, 8, 2, 6], dynamic=True, options={"fallback": "eager"})
    assert frames == 1, f"{frames} frames compiled: the first graph was guarded on a length"
    assert {f.pattern for f in hecate.last_report().fusions} == {"kl_attention", "kl_decode"}, str(hecate.last_report())


def test_automatic_dynamic_shapes_compile_as_many_frames_as_aot_eager(fresh_dynamo):
    torch.manual_seed(0)
    model = KLLanguageModel()
    lengths = list(range(2, 9))
    assert _frames(model, "hecate", lengths, options={"fallback": "eager"}) == _frames(model, "aot_eager", lengths)
