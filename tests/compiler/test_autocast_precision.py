"""Under ``torch.autocast`` a fused op computes in the precision eager computes the code it replaces in.

Autocast lowers matmuls and convolutions, not elementwise code: a KL written out term by term, a memory read as
``(M * k).sum(-1)``, a cumsum of outer products run in float32 under autocast, bit for bit as without it. The
ops cast their inputs to the autocast dtype as a matmul's are, which is right for a chain that starts with one
(tests/models/test_short_conv.py, tests/models/test_memory.py) and was 2e-3 off eager for these (probe r30).
"""

import pytest
import torch
import torch.nn.functional as F

import hecate
from hecate.testing import assert_outputs_and_gradients_close

TOL = 1e-5  # eager under autocast is float32 here: so is the fused result, to float32 rounding


def kl_decode_written_out(mu, logvar, prior_mu, prior_logvar):
    var, prior_var = logvar.exp(), prior_logvar.exp()
    kl = 0.5 * (prior_logvar - logvar[:, :, None] + (var[:, :, None] + (mu[:, :, None] - prior_mu) ** 2) / prior_var
                - 1).sum(-1)
    return -kl


def kl_attention_read_by_a_broadcast_sum(mu, logvar, values):
    var = logvar.exp()
    kl = 0.5 * (torch.log(var[:, None] / var[:, :, None]) + (var[:, :, None] + (mu[:, :, None] - mu[:, None]) ** 2)
                / var[:, None] - 1).sum(-1)
    beta = torch.softmax(-kl, dim=-1)
    return (beta[..., None] * values[:, None]).sum(2)


def delta_rule_read_elementwise(k, v, q):
    M, ys = torch.zeros(k.shape[0], v.shape[-1], k.shape[-1]), []
    for t in range(k.shape[1]):
        kt = F.normalize(k[:, t], dim=-1)
        error = (M * kt[:, None]).sum(-1) - v[:, t]
        M = 0.95 * M - 0.3 * error[:, :, None] * kt[:, None]
        ys.append((M * q[:, t, None]).sum(-1))
    return torch.stack(ys, 1)


def linear_attention_by_cumsum(q, k, v):
    q, k = F.elu(q) + 1, F.elu(k) + 1
    return (torch.cumsum(v[..., None] * k[..., None, :], 1) * q[..., None, :]).sum(-1)


CASES = {
    "kl_decode": (kl_decode_written_out, lambda: (torch.randn(2, 4, 3), 0.5 * torch.randn(2, 4, 3),
                                                  torch.randn(7, 3), 0.5 * torch.randn(7, 3))),
    "kl_attention": (kl_attention_read_by_a_broadcast_sum, lambda: (torch.randn(2, 5, 3), 0.5 * torch.randn(2, 5, 3),
                                                                    torch.randn(2, 5, 4))),
    "memory_scan": (delta_rule_read_elementwise, lambda: (torch.randn(2, 5, 4), torch.randn(2, 5, 3),
                                                          torch.randn(2, 5, 4))),
    "linear_attention": (linear_attention_by_cumsum, lambda: (torch.randn(2, 6, 4), torch.randn(2, 6, 4),
                                                              torch.randn(2, 6, 3))),
}


# (one family under Inductor shows its runtime keeps the op in float32 too; Inductor is slow on CPU)
@pytest.mark.parametrize("pattern,fallback", [(p, "eager") for p in CASES] + [("memory_scan", "inductor")])
def test_elementwise_code_under_autocast_stays_float32(pattern, fallback, fresh_dynamo):
    fn, make = CASES[pattern]
    torch.manual_seed(0)
    args = [x.requires_grad_() for x in make()]
    ref_args = [x.detach().clone().requires_grad_() for x in args]
    compiled = torch.compile(fn, backend="hecate", options={"fallback": fallback})
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, ref = compiled(*args), fn(*ref_args)
    assert hecate.last_report().count(pattern) == 1, str(hecate.last_report())
    assert got.dtype == ref.dtype == torch.float32
    assert_outputs_and_gradients_close(got, ref, args, ref_args, TOL)
