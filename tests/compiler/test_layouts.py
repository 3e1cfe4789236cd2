"""Fused ops fed tensors laid out other than [B, N, ...]: time-major beliefs, priors stored [K, V],
memory inputs stored [T, B, D]. Under the Inductor fallback the compiled graph asserts every op's
output strides against its fake, so the forward and backward must both give what the fake says."""

import pytest
import torch
import torch.nn.functional as F

import hecate
from hecate.testing import assert_outputs_and_gradients_close


def kl_time_major(mu_nbk, var_nbk):  # beliefs stored [N, B, K], attention over N
    mu, var = mu_nbk.transpose(0, 1), var_nbk.transpose(0, 1)
    mi, mj, vi, vj = mu[:, :, None], mu[:, None], var[:, :, None], var[:, None]
    kl = 0.5 * (torch.log(vj / vi) + (vi + (mi - mj) ** 2) / vj - 1).sum(-1)
    return (F.softmax(-kl, -1) @ mu).transpose(0, 1)


def decode_priors_by_column(mu, var, prior_mu_kv, prior_var_kv):  # the priors stored [K, V], one column a token
    prior_mu, prior_var = prior_mu_kv.T, prior_var_kv.T
    kl = 0.5 * ((var[:, :, None] + (mu[:, :, None] - prior_mu) ** 2) / prior_var
                + prior_var.log() - var[:, :, None].log() - 1).sum(-1)
    return -kl


def hebbian_time_major(k, v, q):  # per-step inputs stored [T, B, D], the output stacked time-major
    m = k.new_zeros(k.shape[1], v.shape[2], k.shape[2])
    ys = []
    for t in range(k.shape[0]):
        m = m + v[t].unsqueeze(-1) * k[t].unsqueeze(-2)
        ys.append(m @ q[t].unsqueeze(-1))
    return torch.stack(ys).squeeze(-1)


def _positive(*shape):
    return torch.rand(*shape) + 0.2


CASES = [
    (kl_time_major, "kl_attention", lambda: (torch.randn(6, 2, 4), _positive(6, 2, 4))),
    (decode_priors_by_column, "kl_decode",
     lambda: (torch.randn(2, 5, 3), _positive(2, 5, 3), torch.randn(3, 7), _positive(3, 7))),
    (hebbian_time_major, "linear_attention", lambda: (torch.randn(5, 2, 3), torch.randn(5, 2, 4), torch.randn(5, 2, 3))),
]


@pytest.mark.parametrize("fallback", ["inductor", "eager"])
@pytest.mark.parametrize("fn,pattern,draw", CASES, ids=[c[0].__name__ for c in CASES])
def test_other_layouts_fuse_and_equal_eager_forward_and_backward(fn, pattern, draw, fallback, fresh_dynamo):
    args = [a.requires_grad_() for a in draw()]
    ref_args = [a.detach().clone().requires_grad_() for a in args]
    compiled = torch.compile(fn, backend="hecate", options={"fallback": fallback})
    got = compiled(*args)
    assert hecate.last_report().count(pattern) >= 1, str(hecate.last_report())
    assert_outputs_and_gradients_close(got, fn(*ref_args), args, ref_args, 1e-5)
