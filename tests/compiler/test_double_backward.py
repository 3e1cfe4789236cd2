"""A gradient that is differentiated again (``create_graph=True``: a gradient penalty) through each fused op.

The ops' fused backward has no autograd formula of its own; under ``create_graph`` each op's backward runs through
its ATen decomposition instead, so the compiled code (``fallback="eager"``: Inductor's backward is not
differentiable either, with or without Hecate) gives eager's penalty and its gradients. Probe r36 found the three
families raising "no autograd formula was registered" for their backward ops.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import hecate
from hecate.testing import assert_close

B, T, D, V = 2, 5, 3, 4


def delta_rule(k, v, q):
    M, ys = k.new_zeros(B, D, D), []
    for t in range(T):
        e = (M @ k[:, t, :, None])[..., 0] - v[:, t]
        M = 0.9 * M - 0.3 * e[..., None] * k[:, t, None, :]
        ys.append((M @ q[:, t, :, None])[..., 0])
    return torch.stack(ys, 1)


def hebbian(k, v, q):
    M, ys = k.new_zeros(B, D, D), []
    for t in range(T):
        M = 0.8 * M + v[:, t, :, None] * k[:, t, None, :]
        ys.append((M @ q[:, t, :, None])[..., 0])
    return torch.stack(ys, 1)


def kl_attention(mu, logvar, values):
    var = logvar.exp()
    kl = 0.5 * (var[:, :, None] / var[:, None] + (mu[:, :, None] - mu[:, None]) ** 2 / var[:, None] - 1
                + logvar[:, None] - logvar[:, :, None]).sum(-1)
    causal = torch.ones(T, T, dtype=torch.bool).triu(1)
    return (-kl).masked_fill(causal, float("-inf")).softmax(-1) @ values


def preprocessing(x, w, conv, b):
    u = F.conv1d((x @ w.T).transpose(1, 2), conv, b, padding=1, groups=D)[..., :T]
    return F.elu(F.silu(u)).transpose(1, 2) + 1


def decode(mu, logvar, prior_mu, prior_logvar):
    var, prior_var = logvar.exp(), prior_logvar.exp()
    kl = 0.5 * (var[:, :, None] / prior_var + (mu[:, :, None] - prior_mu) ** 2 / prior_var - 1 + prior_logvar
                - logvar[:, :, None]).sum(-1)
    return F.cross_entropy(-kl.flatten(0, 1), torch.arange(B * T) % V)


def _sequences(n):
    return lambda: [torch.randn(B, T, D) / 2 for _ in range(n)]


FAMILIES = {  # (the code, its inputs, the pattern that fuses it)
    "delta_rule": (delta_rule, _sequences(3), "memory_scan"),
    "hebbian": (hebbian, _sequences(3), "linear_attention"),
    "kl_attention": (kl_attention, _sequences(3), "kl_attention"),
    "qk_preprocess": (preprocessing, lambda: [torch.randn(B, T, D), torch.randn(D, D) / 2, torch.randn(D, 1, 2),
                                              torch.randn(D)], "qk_preprocess"),
    "kl_decode": (decode, lambda: _sequences(2)() + [torch.randn(V, D), torch.randn(V, D) / 2], "kl_decode"),
}


def _penalised(fn, inputs):
    """(fn's output) plus its gradient's squared norm w.r.t. the first input, and that total's gradients."""
    out = fn(*inputs)
    (grad,) = torch.autograd.grad((out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum(), inputs[0],
                                  create_graph=True)
    total = out.square().sum() + grad.square().sum()
    return total, torch.autograd.grad(total, inputs)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_gradient_penalty_through_a_fused_op_equals_eager(name, fresh_dynamo):
    fn, make_args, pattern = FAMILIES[name]
    torch.manual_seed(0)
    args = make_args()
    inputs, ref_inputs = ([a.clone().requires_grad_() for a in args] for _ in range(2))
    compiled = torch.compile(fn, backend="hecate", options={"fallback": "eager"})
    total, grads = _penalised(compiled, inputs)
    assert hecate.last_report().count(pattern) == 1, str(hecate.last_report())
    ref_total, ref_grads = _penalised(fn, ref_inputs)
    assert_close("penalised total", total, ref_total, 1e-5)
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        assert_close(f"d total / d input {i}", g, r, 1e-5)
