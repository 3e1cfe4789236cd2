"""Linear attention over the whole sequence as researchers write it for training: the parallel form
(φ(Q)φ(K)ᵀ ⊙ D) V, and every step's state by a cumulative sum in any layout and read.

Each spelling must fuse into ONE ``hecate.linear_attention`` (the recurrence; neither the [T, T]
score nor the [T, Dv, Dk] states are formed) and equal eager, outputs and input gradients, within 1e-5 relative (fp32), static
and under ``dynamic=True``. Softmax attention and an anti-causal mask are not linear attention:
the first is left alone, the second is reported with its reason.
"""

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hecate
from hecate.testing import assert_close

TOL = 1e-5
B, T, D = 2, 7, 4


def phi(x):
    return F.elu(x) + 1


def tril_method(q, k, v):
    return (phi(q) @ phi(k).transpose(-1, -2)).tril() @ v


def times_tril_of_ones(q, k, v):
    n = q.shape[-2]
    return ((phi(q) @ phi(k).mT) * torch.tril(torch.ones(n, n))) @ v


def masked_fill_bmm(q, k, v):
    n = q.shape[1]
    scores = torch.bmm(phi(q), phi(k).transpose(1, 2))
    return torch.bmm(scores.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), 0.0), v)


def normalised(q, k, v):
    a = torch.tril(phi(q) @ phi(k).transpose(-1, -2))
    return (a @ v) / (a.sum(-1, keepdim=True) + 1e-6)


def where_arange_relu_features(q, k, v):
    n = q.shape[-2]
    t = torch.arange(n)
    scores = F.relu(q) @ F.relu(k).permute(0, 2, 1)
    return torch.where(t[:, None] >= t[None, :], scores, torch.zeros_like(scores)) @ v


def retention(q, k, v):  # one decay γ = 0.9: RetNet's retention with a single scale
    n = q.shape[-2]
    t = torch.arange(n)
    decay = torch.where(t[:, None] >= t[None, :], 0.9 ** (t[:, None] - t[None, :]).float(), 0.0)
    return ((q @ k.transpose(-2, -1)) * decay) @ v


def one_sequence(q, k, v):  # [T, D]: no batch
    return torch.tril(phi(q[0]) @ phi(k[0]).T) @ v[0]


def one_sequence_given_a_batch_dim_after_the_transpose(q, k, v):  # k.T[None]: the batch dim added after .T
    n = torch.arange(q.shape[1])
    decay = torch.tril(0.8 ** (n[:, None] - n[None, :]).float())
    return ((phi(q[0])[None] @ phi(k[0]).T[None]) * decay) @ v[0][None]


class MultiHead(nn.Module):
    """[B, H, T, Dh] heads, projections, the heads merged back."""

    def __init__(self, heads=2):
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(D, 3 * D, bias=False), nn.Linear(D, D)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (z.view(b, n, self.heads, -1).transpose(1, 2) for z in self.qkv(x).chunk(3, -1))
        y = torch.tril(phi(q) @ phi(k).transpose(-2, -1)) @ v
        return self.out(y.transpose(1, 2).reshape(b, n, D))


class MultiScaleRetention(nn.Module):
    """RetNet: one decay per head, γ_h = 1 − 2^(−2−h), the decay matrix built per head."""

    def __init__(self, heads=2, decay_in_a_buffer=False):
        super().__init__()
        self.heads, self.qkv = heads, nn.Linear(D, 3 * D, bias=False)
        self.decay_in_a_buffer = decay_in_a_buffer
        if decay_in_a_buffer:
            self.register_buffer("gammas", self._gammas())

    def _gammas(self):
        return 1 - 2.0 ** (-2 - torch.arange(self.heads, dtype=torch.float32))

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (z.view(b, n, self.heads, -1).transpose(1, 2) for z in self.qkv(x).chunk(3, -1))
        t = torch.arange(n, device=x.device)
        gap = (t[:, None] - t[None, :]).float()
        gammas = self.gammas if self.decay_in_a_buffer else self._gammas()
        decay = torch.where(gap >= 0, gammas[:, None, None] ** gap, torch.zeros(()))  # [H, T, T]
        return ((q @ k.transpose(-1, -2)) * decay) @ v


def einsum_scores_and_read(q, k, v):
    scores = torch.einsum("btd,bsd->bts", phi(q), phi(k)).tril()
    return torch.einsum("bts,bsd->btd", scores, v)


def einsum_heads_in_place(q, k, v):  # [B, T, H, D] kept, scores [B, H, T, S]
    q, k, v = (x.view(x.shape[0], x.shape[1], 2, -1) for x in (q, k, v))
    scores = torch.einsum("bthd,bshd->bhts", phi(q), phi(k))
    return torch.einsum("bhts,bshd->bthd", scores.tril(), v).flatten(2)


def einsum_time_major_scores(q, k, v):  # scores laid out [T, S, B], the mask broadcast over B
    scores = torch.einsum("btd,bsd->tsb", phi(q), phi(k))
    mask = torch.tril(torch.ones(q.shape[1], q.shape[1]))[:, :, None]
    return torch.einsum("tsb,bsd->btd", scores * mask, v)


def cumsum_key_value_layout_einsum_read(q, k, v):  # M_t laid out [Dk, Dv], read by einsum
    states = torch.cumsum(phi(k).unsqueeze(-1) * v.unsqueeze(-2), dim=1)
    return torch.einsum("btd,btde->bte", phi(q), states)


def cumsum_outer_by_einsum_read_by_product_and_sum(q, k, v):
    states = torch.cumsum(torch.einsum("bte,btd->bted", v, phi(k)), 1)
    return (states * phi(q)[:, :, None, :]).sum(-1)


def cumsum_heads_method_row_vector_read(q, k, v):  # [B, T, H, Dh], q read as a row vector from the left
    q, k, v = (x.view(x.shape[0], x.shape[1], 2, -1) for x in (phi(q), phi(k), v))
    states = (k[..., :, None] * v[..., None, :]).cumsum(dim=1)
    return (q.unsqueeze(-2) @ states).squeeze(-2).flatten(2)


def triu_bool_masked_fill_einsum(q, k, v):  # the future masked by triu(ones, 1).bool(), i/j letters
    n = q.shape[1]
    s = torch.einsum("bid,bjd->bij", F.elu(q) + 1, F.elu(k) + 1)
    return torch.einsum("bij,bjd->bid", s.masked_fill(torch.ones(n, n).triu(1).bool(), 0.0), v)


def arange_comparison_float_mask(q, k, v):  # the mask an arange comparison cast to the dtype, multiplied in
    n = q.size(-2)
    i = torch.arange(n)
    causal = (i[None, :] <= i[:, None]).to(q.dtype)
    return (phi(q) @ phi(k).mT * causal) @ v


def normalised_by_reciprocal(q, k, v):  # the normaliser multiplied as a reciprocal, its own eps
    a = torch.tril(phi(q) @ phi(k).mT)
    return (a @ v) * torch.reciprocal(a.sum(dim=-1, keepdim=True) + 1e-5)


def normalised_by_clamp(q, k, v):  # a clamp is not + eps: A @ V fuses, the clamped division stays as written
    a = torch.tril(phi(q) @ phi(k).mT)
    return (a @ v) / a.sum(-1, keepdim=True).clamp(min=1e-6)


def retention_linspace_gammas(q, k, v):  # RetNet's γ_h = 1 − exp(linspace(log 1/32, log 1/512)), built in forward
    b, n, _ = q.shape
    q, k, v = (z.view(b, n, 2, -1).transpose(1, 2) for z in (q, k, v))
    gammas = 1 - torch.exp(torch.linspace(math.log(1 / 32), math.log(1 / 512), 2))
    t = torch.arange(n).float()
    decay = torch.tril(gammas[:, None, None] ** (t[:, None] - t[None, :]).clamp(min=0))
    return ((q @ k.transpose(-1, -2)) * decay[None] @ v).transpose(1, 2).reshape(b, n, -1)


def scaled_scores_times_tril(q, k, v):  # the score scaled by d^-1/2 before the causal mask, as softmax attention is
    m = torch.tril(torch.ones(q.shape[1], q.shape[1]))
    return (phi(q) @ phi(k).mT * q.shape[-1] ** -0.5 * m) @ v


def scaled_scores_masked_fill(q, k, v):  # divided by sqrt(d), the future filled with 0
    s = (phi(q) @ phi(k).mT) / math.sqrt(q.shape[-1])
    return s.masked_fill(torch.ones(q.shape[1], q.shape[1], dtype=torch.bool).triu(1), 0.0) @ v


def scaled_retention_normalised(q, k, v):  # γ = 0.9, the score scaled by 0.5 after the decay, normalised
    t = torch.arange(q.shape[1], dtype=q.dtype)
    decay = torch.tril(0.9 ** (t[:, None] - t[None, :]).clamp(min=0))
    a = (phi(q) @ phi(k).mT) * decay * 0.5
    return (a @ v) / (a.sum(-1, keepdim=True) + 1e-6)


def einsum_with_the_mask_as_an_operand(q, k, v):  # one einsum over the scores, the mask and the values
    a = phi(q) @ phi(k).mT
    return torch.einsum("bts,ts,bsd->btd", a, torch.tril(torch.ones(q.shape[1], q.shape[1])), v)


def einsum_with_the_mask_first(q, k, v):  # the mask the first operand: the pair kept in the scores' layout
    a = phi(q) @ phi(k).mT
    return torch.einsum("ts,bts,bsd->btd", torch.tril(torch.ones(q.shape[1], q.shape[1])), a, v)


def einsum_of_four_with_the_mask_first(q, k, v):  # mask, q, k, v in one einsum: left to right the mask times q
    n = q.shape[1]  # would be a [B, T, S, D] broadcast; the queries and keys are contracted first
    return torch.einsum("ts,btd,bsd,bse->bte", torch.ones(n, n).tril(), phi(q), phi(k), v)


def einsum_of_four_with_the_mask_last(q, k, v):  # q, k, v, mask: left to right the scores times v would be a
    n = q.shape[1]  # [B, T, S, E] broadcast; the mask multiplies the scores first
    return torch.einsum("btd,bsd,bse,ts->bte", phi(q), phi(k), v, torch.ones(n, n).tril())


def scaled_and_masked_in_place(q, k, v):  # the score scaled, then its future zeroed, both in place
    s = phi(q) @ phi(k).mT
    s.mul_(0.5)
    s.masked_fill_(torch.ones(q.shape[1], q.shape[1], dtype=torch.bool).triu(1), 0.0)
    return s @ v


def einsum_with_an_ellipsis(q, k, v):  # "...id,...jd->...ij": the leading dims left to the ellipsis
    s = torch.einsum("...id,...jd->...ij", phi(q), phi(k)).tril()
    return torch.einsum("...ij,...jd->...id", s, v)


def mask_made_like_the_scores(q, k, v):  # the causal mask as ones_like(s, dtype=bool).tril(), applied by where
    s = phi(q) @ phi(k).mT
    return torch.where(torch.ones_like(s, dtype=torch.bool).tril(), s, torch.zeros_like(s)) @ v


def normalised_on_the_score(q, k, v):  # each row of the masked score divided by its sum before the values are read
    a = torch.tril(phi(q) @ phi(k).mT)
    return (a / (a.sum(-1, keepdim=True) + 1e-6)) @ v


def normalised_on_the_score_heads_by_einsum(q, k, v):  # [B, T, H, D] kept, the score [B, H, T, S] normalised
    b, t, d = q.shape
    q, k, v = (x.view(b, t, 2, d // 2) for x in (phi(q), phi(k), v))
    s = torch.einsum("bthd,bshd->bhts", q, k).masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool), 1), 0.0)
    s = s / (s.sum(-1, keepdim=True) + 1e-6)
    return torch.einsum("bhts,bshd->bthd", s, v).reshape(b, t, d)


def normalised_on_the_score_by_reciprocal(q, k, v):  # times 1 / (Σ + ε), the sum without keepdim then unsqueezed
    a = torch.tril(phi(q) @ phi(k).mT)
    return (a * torch.reciprocal(a.sum(-1) + 1e-6).unsqueeze(-1)) @ v


def cumsum_exclusive_states(q, k, v):  # y_t = M_{t−1} q_t: the states shifted a step, zeros first (probe r21)
    states = (phi(k).unsqueeze(-1) * v.unsqueeze(-2)).cumsum(1)
    states = torch.cat([torch.zeros_like(states[:, :1]), states[:, :-1]], 1)
    return (phi(q).unsqueeze(-1) * states).sum(-2)


def cumsum_minus_the_step_own(q, k, v):  # Σ_{s<t} as the inclusive cumsum minus the step's own (probe r22)
    outer = phi(k).unsqueeze(-1) * v.unsqueeze(-2)
    return (phi(q).unsqueeze(-1) * (outer.cumsum(1) - outer)).sum(-2)


def strictly_causal(q, k, v):  # each query reads the keys before its own (s < t): the state before its step
    n = q.shape[-2]
    return ((phi(q) @ phi(k).mT) * torch.tril(torch.ones(n, n), diagonal=-1)) @ v


def strictly_causal_retention_by_where(q, k, v):  # γ^(t−s) for s < t, 0 elsewhere, the score scaled
    n = torch.arange(q.shape[-2])
    dist = n[:, None] - n[None, :]
    decay = torch.where(dist > 0, 0.8 ** dist.clamp(min=0).float(), 0.0)
    return ((q @ k.mT) * 0.5 * decay) @ v


def strictly_causal_normalised(q, k, v):  # the strict mask's row sums: the first row's 0 / (0 + ε) is 0
    a = (phi(q) @ phi(k).mT).tril(-1)
    return (a @ v) / (a.sum(-1, keepdim=True) + 1e-3)


FUNCTIONS = [normalised_on_the_score, normalised_on_the_score_heads_by_einsum, normalised_on_the_score_by_reciprocal, einsum_with_an_ellipsis, mask_made_like_the_scores, cumsum_key_value_layout_einsum_read, cumsum_outer_by_einsum_read_by_product_and_sum,
             cumsum_heads_method_row_vector_read, tril_method, times_tril_of_ones, masked_fill_bmm, normalised, where_arange_relu_features, retention,
             one_sequence, einsum_scores_and_read, einsum_heads_in_place, einsum_time_major_scores,
             triu_bool_masked_fill_einsum, arange_comparison_float_mask, normalised_by_reciprocal, normalised_by_clamp,
             retention_linspace_gammas, scaled_scores_times_tril, scaled_scores_masked_fill,
             scaled_retention_normalised, einsum_with_the_mask_as_an_operand, einsum_with_the_mask_first,
             einsum_of_four_with_the_mask_first, einsum_of_four_with_the_mask_last,
             scaled_and_masked_in_place, strictly_causal, strictly_causal_retention_by_where,
             strictly_causal_normalised, one_sequence_given_a_batch_dim_after_the_transpose,
             cumsum_exclusive_states, cumsum_minus_the_step_own]


def _check(fn, args, dynamic, params=()):
    args_c = [a.clone().requires_grad_() for a in args]
    args_e = [a.clone().requires_grad_() for a in args]
    got = torch.compile(fn, backend="hecate", dynamic=dynamic, options={"strict": True})(*args_c)
    report = hecate.last_report()
    ref = fn(*args_e)
    assert_close("output", got, ref, TOL)
    weight = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
    grads_got = torch.autograd.grad((got * weight).sum(), [*args_c, *params])
    grads_ref = torch.autograd.grad((ref * weight).sum(), [*args_e, *params])
    for i, (g, r) in enumerate(zip(grads_got, grads_ref)):
        assert_close(f"grad {i}", g, r, TOL)
    return report


# a scale read from the head size: another number at each size the dynamic graph runs at
SCALED_BY_THE_HEAD_SIZE = (scaled_scores_times_tril, scaled_scores_masked_fill)


def small_decay_over_a_long_sequence(q, k, v):  # γ = 0.05 at T = 80: the far powers underflow in float32
    n = torch.arange(q.shape[-2])
    dist = n[:, None] - n[None, :]
    return ((phi(q) @ phi(k).mT) * ((0.05 ** dist.clamp(min=0).float()) * (dist >= 0))) @ v


def normalised_on_the_score_without_eps(q, k, v):  # a row summing to 0 is 0/0, spread by the product's backward
    a = torch.tril(phi(q) @ phi(k).mT)
    return (a / a.sum(-1, keepdim=True)) @ v


def normalised_per_key(q, k, v):  # divided by the sums over the queries: not the op's normaliser
    a = torch.tril(phi(q) @ phi(k).mT)
    return (a / (a.sum(-2, keepdim=True) + 1e-6)) @ v


def _decay(t, gamma=0.9):
    n = torch.arange(t)
    dist = n[:, None] - n[None, :]
    return (gamma ** dist.clamp(min=0).float()) * (dist >= 0)


def decay_normalised_per_row(q, k, v):  # RetNet's D / sqrt(Σ_s D_ts): a scale per query on top of γ^(t−s)
    d = _decay(q.shape[-2])
    return ((phi(q) @ phi(k).mT) * (d / d.sum(-1, keepdim=True).sqrt())) @ v


def decay_with_the_row_scale_after_the_product(q, k, v):  # what the reason for the one above suggests
    d = _decay(q.shape[-2])
    return ((phi(q) @ phi(k).mT) * d) @ v / d.sum(-1, keepdim=True).sqrt()


def decay_of_zero(q, k, v):  # γ = 0: D is the identity, each token reads itself alone
    return ((phi(q) @ phi(k).mT) * _decay(q.shape[-2], 0.0)) @ v


@pytest.mark.parametrize("fn", [einsum_with_the_mask_as_an_operand, einsum_with_the_mask_first], ids=lambda f: f.__name__)
def test_an_einsum_of_three_operands_under_autocast_is_reported(fn, fresh_dynamo):
    """Under autocast(bf16) the einsum's operands differ in dtype (the scores bf16, the mask and the values fp32):
    the normal form casts each to the einsum's dtype, as autocast does, before contracting two at a time. The
    einsum was left whole and the family unreported (probe r26); now it is reported, and equals eager."""
    args = [torch.randn(B, T, D, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = torch.compile(fn, backend="hecate", options={"fallback": "eager"})(*args)
        ref = fn(*args)
    report = hecate.last_report()
    assert report.count("linear_attention") + len([m for m in report.misses if m.pattern == "linear_attention"]) == 1, \
        str(report)
    assert got.dtype == ref.dtype == torch.bfloat16
    assert_close("output", got.float(), ref.float(), 1e-2)


class DecayReadByItem(nn.Module):
    """γ a parameter read as a number by ``.item()``: no gradient reaches it in eager."""

    def __init__(self):
        super().__init__()
        self.gamma = nn.Parameter(torch.tensor(0.8))

    def forward(self, q, k, v):
        t = torch.arange(q.shape[1])
        dist = t[:, None] - t[None, :]
        decay = torch.where(dist >= 0, self.gamma.item() ** dist.clamp(min=0).float(), 0.0)
        return ((phi(q) @ phi(k).mT) * decay) @ v


def test_a_decay_read_by_item_is_reported_and_its_parameter_gets_no_gradient(fresh_dynamo):
    """With ``capture_scalar_outputs`` Dynamo keeps ``gamma.item()`` in the graph: eager gives γ no gradient
    (a number carries none). The op would read γ from the parameter and give it one (31.9 here, probe r26):
    a gradient stop, reported; compiled as written, γ's gradient None as in eager."""
    model = DecayReadByItem()
    args = [torch.randn(B, T, D, requires_grad=True) for _ in range(3)]
    with torch._dynamo.config.patch(capture_scalar_outputs=True):  # (monkeypatch's undo deletes a config entry)
        torch.compile(model, backend="hecate", options={"fallback": "eager"})(*args).sum().backward()
    report = hecate.last_report()
    assert not report.fusions and "a number read by .item()" in report.misses[0].reason, str(report)
    assert model.gamma.grad is None


def test_a_decay_of_zero_is_reported_as_an_elementwise_product(fresh_dynamo):
    """γ = 0 makes D the identity, whose rows also sum to 1: reported as the elementwise product it is, not as a score
    divided by its row sums (probe r19)."""
    torch.manual_seed(0)
    report = _check(decay_of_zero, [torch.randn(B, T, D) for _ in range(3)], False)
    assert not report.fusions and "its mask D is diagonal" in report.misses[0].reason, str(report)


@pytest.mark.parametrize("fn", [decay_normalised_per_row, decay_with_the_row_scale_after_the_product],
                         ids=lambda f: f.__name__)
def test_a_decay_mask_scaled_per_query_fuses(fn, fresh_dynamo):
    """D_ts = c_t·γ^(t−s) (RetNet's row normalisation of the decay, from sizes and constants): the op's rows scaled
    by c_t after it (reported as not causal in probe r18, then as a scale per query with this rewrite suggested)."""
    torch.manual_seed(0)
    report = _check(fn, [torch.randn(B, T, D) for _ in range(3)], False)
    assert report.count("linear_attention") == 1 and not report.misses, str(report)


def retention_per_head_normalised(q, k, v):  # [B, H, T, D]: torchscale's γ per head, D / sqrt(Σ_s D_ts)
    gammas = 1 - 2.0 ** (-5 - torch.arange(q.shape[1], dtype=q.dtype))
    t = torch.arange(q.shape[2], dtype=q.dtype)
    d = torch.tril(gammas[:, None, None] ** (t[:, None] - t[None, :]).clamp(min=0))
    return ((q @ k.mT) * (d / d.sum(-1, keepdim=True).sqrt())) @ v


def test_a_decay_mask_per_head_scaled_per_query_fuses(fresh_dynamo):
    """c_t per head and query ([H, T]) and γ per head: the op runs with the heads' γ, its rows scaled by c."""
    torch.manual_seed(0)
    report = _check(retention_per_head_normalised, [torch.randn(B, 3, T, D) for _ in range(3)], False)
    assert report.count("linear_attention") == 1 and not report.misses, str(report)
    assert "rows scaled per query" in report.fusions[0].detail, report.fusions[0].detail


def test_a_decay_mask_scaled_per_query_under_dynamic_shapes_is_reported(fresh_dynamo):
    """c_t depends on the length (another at every length under dynamic=True), and there on γ too: the default
    γ = 0.9 of the helper making the mask becomes an input of the graph, so c_t is known only at run time."""
    compiled = torch.compile(decay_normalised_per_row, backend="hecate", dynamic=True, options={"fallback": "eager"})
    for length in (T, T + 2):
        args = [torch.randn(B, length, D, generator=torch.Generator().manual_seed(i)) for i in range(3)]
        assert_close(f"output at T = {length}", compiled(*args), decay_normalised_per_row(*args), TOL)
        report = hecate.last_report()
        assert not report.fusions and report.misses, str(report)
        assert "computed from sizes" in report.misses[0].reason or "a scale c_t per query" in report.misses[0].reason


@pytest.mark.parametrize("fn,reason", [
    (normalised_on_the_score_without_eps, "divided by its sum over the keys (Σ_s A_ts, per query) before the product"),
    (normalised_per_key, "divided by its sum over the queries (Σ_t A_ts, per key) before the product"),
], ids=lambda x: getattr(x, "__name__", None))
def test_a_score_normalised_unlike_the_op_is_reported(fn, reason, fresh_dynamo):
    torch.manual_seed(0)
    report = _check(fn, [torch.randn(B, T, D) for _ in range(3)], False)
    assert not report.fusions and reason in report.misses[0].reason, str(report)


def test_a_decay_whose_far_powers_underflow_fuses(fresh_dynamo):
    """γ^(t−s) computed in float32 is a denormal or 0 far from the diagonal (probe r9a): the op's products of γ
    underflow alike, so the mask is the decay's."""
    torch.manual_seed(0)
    report = _check(small_decay_over_a_long_sequence, [torch.randn(B, 80, D) for _ in range(3)], False)
    assert [f.detail for f in report.fusions if f.pattern == "linear_attention"] == \
        ["causal (φ(Q)φ(K)ᵀ ⊙ D) V, parallel form, decay γ=0.05"], str(report)


def keys_read_as_values(q, k):  # the keys are the values: (QKᵀ ⊙ D) K (probe r27)
    n = q.shape[-2]
    return ((q @ k.mT) * torch.ones(n, n).tril()) @ k


def one_tensor_as_queries_keys_and_values(x):  # x attends to itself: (x xᵀ ⊙ D) x, a decay γ = 0.8
    t = torch.arange(x.shape[-2])
    return ((x @ x.mT) * torch.tril(0.8 ** (t[:, None] - t[None, :]).float())) @ x


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("fn", [keys_read_as_values, one_tensor_as_queries_keys_and_values], ids=lambda f: f.__name__)
def test_one_tensor_read_in_two_roles_fuses(fn, dynamic, fresh_dynamo):
    """The mask is found at q = k = e₁ whatever else reads those tensors: the values being the keys gave a
    mask of zeros off the diagonal ("D is diagonal, nothing to fuse")."""
    torch.manual_seed(0)
    args = [torch.randn(B, T, D) for _ in range(fn.__code__.co_argcount)]
    assert _check(fn, args, dynamic).count("linear_attention") == 1


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("fn", FUNCTIONS, ids=[f.__name__ for f in FUNCTIONS])
def test_parallel_form_fuses_and_equals_eager(fn, dynamic, fresh_dynamo):
    torch.manual_seed(0)
    report = _check(fn, [torch.randn(B, T, D) for _ in range(3)], dynamic)
    if dynamic and fn in SCALED_BY_THE_HEAD_SIZE:
        assert not report.fusions and "computed from sizes" in report.misses[0].reason, str(report)
    else:
        assert report.count("linear_attention") == 1 and not report.misses, str(report)


def length_dependent_mask(q, k, v):  # causal at T = 7 alone: j ≤ i + (T − 7)
    i = torch.arange(q.shape[1])
    return ((q @ k.mT) * (i[None, :] <= i[:, None] + (q.shape[1] - 7)).float()) @ v


def decay_from_the_length(q, k, v):  # γ = 1 − 1/T: another decay at every length
    t = torch.arange(q.shape[1], dtype=q.dtype)
    decay = torch.tril((1 - 1 / q.shape[1]) ** (t[:, None] - t[None, :]).clamp(min=0))
    return ((q @ k.mT) * decay) @ v


def normaliser_eps_from_the_length(q, k, v):  # ε = 1e-2·T: another ε at every length
    a = torch.tril(phi(q) @ phi(k).mT)
    return (a @ v) / (a.sum(-1, keepdim=True) + 1e-2 * q.shape[1])


class _ContractionPath:
    """opt_einsum as torch.einsum reads it, with a path of its own (opt_einsum itself is not a CI dependency)."""

    enabled, strategy = True, "auto"

    def __init__(self, pairs):
        self.pairs = pairs

    def is_available(self):
        return True

    def get_opt_einsum(self):
        return self

    def contract_path(self, equation, *operands, optimize):
        return self.pairs, None


@pytest.mark.parametrize("pairs", [[(0, 1), (0, 1)], [(1, 0), (1, 0)]], ids=["opt_einsum's", "the pairs reversed"])
@pytest.mark.parametrize("fn", [einsum_with_the_mask_as_an_operand, einsum_with_the_mask_first], ids=lambda f: f.__name__)
def test_an_einsum_of_three_operands_fuses_in_opt_einsums_order(fn, pairs, monkeypatch, fresh_dynamo):
    """With opt_einsum installed, torch.einsum contracts in the path it chose (each pair's product joins the end
    of the list, here (scores, mask) first, then (values, product)): the normal form follows that path, each
    pair in the user's operand order. It took such einsums only without opt_einsum, and left them unreported
    (probe: the GPU machine has opt_einsum)."""
    monkeypatch.setattr(torch.backends, "opt_einsum", _ContractionPath(pairs))
    torch.manual_seed(0)
    report = _check(fn, [torch.randn(B, T, D) for _ in range(3)], dynamic=False)
    assert report.count("linear_attention") == 1 and not report.misses, str(report)


@pytest.mark.parametrize("fn", [length_dependent_mask, decay_from_the_length, normaliser_eps_from_the_length],
                         ids=lambda f: f.__name__)
def test_mask_or_decay_computed_from_sizes_is_checked_at_other_sizes(fn, fresh_dynamo):
    """Under dynamic shapes the graph runs at other lengths: a mask, decay or normaliser ε from sizes is read at
    two, and is not taken for the one it is at the example's length (it was: 0.96 relative off eager at T = 9
    for a mask; 3e-3 for ε = 1e-2·T, probe r13b)."""
    compiled = torch.compile(fn, backend="hecate", dynamic=True, options={"fallback": "eager"})
    for length in (T, T + 2):
        args = [torch.randn(B, length, D, generator=torch.Generator().manual_seed(i)) for i in range(3)]
        assert_close(f"output at T = {length}", compiled(*args), fn(*args), TOL)
        report = hecate.last_report()
        assert not report.fusions and "computed from sizes" in report.misses[0].reason, str(report)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("module", [MultiHead, MultiScaleRetention], ids=lambda m: m.__name__)
def test_multihead_parallel_form_fuses_and_equals_eager(module, dynamic, fresh_dynamo):
    torch.manual_seed(0)
    model = module()
    report = _check(model, [torch.randn(B, T, D)], dynamic, list(model.parameters()))
    assert report.count("linear_attention") == 1 and not report.misses, str(report)
    if module is MultiScaleRetention:
        assert "decay γ=0.75/0.875" in report.fusions[0].detail, report.fusions[0].detail


def softmax_attention(q, k, v):
    n = q.shape[-2]
    scores = (q @ k.mT).masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), float("-inf"))
    return scores.softmax(-1) @ v


def anticausal(q, k, v):
    return (phi(q) @ phi(k).mT).triu() @ v


def noncausal_by_matmul(q, k, v):  # φ(Q) (φ(K)ᵀ V) over [B, H, T, D]
    return phi(q) @ (phi(k).transpose(-1, -2) @ v)


def noncausal_by_heads_first_einsums(q, k, v):
    kv = torch.einsum("bhsd,bhse->bhde", phi(k), v)
    return torch.einsum("bhtd,bhde->bhte", phi(q), kv)


def cumsum_over_heads_first_states(q, k, v):  # M_t of every step [B, H, T, Dv, Dk], summed over dim 2
    kv = torch.cumsum(v.unsqueeze(-1) * phi(k).unsqueeze(-2), dim=2)
    return (kv @ phi(q).unsqueeze(-1)).squeeze(-1)


HEADS_FIRST = [noncausal_by_matmul, noncausal_by_heads_first_einsums, cumsum_over_heads_first_states]


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("fn", HEADS_FIRST, ids=[f.__name__ for f in HEADS_FIRST])
def test_heads_first_layouts_fuse_and_equal_eager(fn, dynamic, fresh_dynamo):
    """[B, H, T, D] tensors, time next to the features: read by evaluation, the op called over [B, T, H, D]. As
    many heads as sequences: under dynamic=True one symbol, which a product's shape may write ((s0**2)//s0)."""
    torch.manual_seed(0)
    report = _check(fn, [torch.randn(B, B, T, D) for _ in range(3)], dynamic)
    assert report.count("linear_attention") == 1 and not report.misses, str(report)


def noncausal_over_split_heads(q, k, v):  # [B, T, H, D] split into heads by transpose(1, 2), as projections are
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    return phi(q) @ (phi(k).transpose(-1, -2) @ v)


def noncausal_over_heads_split_from_a_projection(q, k, v):  # [B, T, H·D] viewed [B, T, H, D], heads first
    def heads(x):
        return x.view(x.shape[0], x.shape[1], 2, -1).transpose(1, 2)
    return (phi(heads(q)) @ (phi(heads(k)).mT @ heads(v))).transpose(1, 2).flatten(2)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("fn,shape", [(noncausal_over_split_heads, (B, T, 2, D)),
                                      (noncausal_over_heads_split_from_a_projection, (B, T, 2 * D))],
                         ids=["split_heads", "projection"])
def test_noncausal_products_over_heads_split_by_a_transpose_fuse(fn, shape, dynamic, fresh_dynamo):
    """A head split's transpose(1, 2) makes the [B, H, T, D] operands: only a transpose of the last two dims (k.mT)
    is the product's own (probe r23: the split's transpose was taken for it, and nothing was fused or said)."""
    torch.manual_seed(0)
    report = _check(fn, [torch.randn(shape) for _ in range(3)], dynamic)
    assert report.count("linear_attention") == 1 and not report.misses, str(report)
    assert report.fusions[0].detail.startswith("non-causal"), report.fusions[0].detail


def test_softmax_attention_is_not_linear_attention(fresh_dynamo):
    report = _check(softmax_attention, [torch.randn(B, T, D) for _ in range(3)], False)
    assert report.count("linear_attention") == 0 and not report.misses, str(report)


def one_token_masked(k, v, q):
    n = q.shape[-2]
    return ((q @ k.mT) * torch.tril(torch.ones(n, n))) @ v


def test_the_parallel_form_over_one_token_is_reported_not_silent(fresh_dynamo):
    """At T = 1 the score is [..., 1, 1] and the normal form makes both products elementwise: nothing to fuse, and
    the report says so (it said nothing)."""
    report = _check(one_token_masked, [torch.randn(B, 2, 1, D) for _ in range(3)], False)
    assert report.count("linear_attention") == 0, str(report)
    [miss] = report.misses
    assert "over one token (T = 1" in miss.reason, miss


def test_softmax_attention_over_one_token_is_not_reported_as_linear_attention(fresh_dynamo):
    report = _check(softmax_attention, [torch.randn(B, 1, D) for _ in range(3)], False)
    assert report.count("linear_attention") == 0 and not report.misses, str(report)


def strictly_causal_normalised_without_eps(q, k, v):  # row 0 sums to 0: 0/0 there
    a = (phi(q) @ phi(k).mT).tril(-1)
    return (a @ v) / a.sum(-1, keepdim=True)


def test_a_strictly_causal_form_normalised_without_eps_is_reported(fresh_dynamo):
    """Eager's first row is 0/0 = NaN; the op's read before the first step would be 0 (probe r22): reported."""
    args = [torch.randn(B, T, D) for _ in range(3)]
    got = torch.compile(strictly_causal_normalised_without_eps, backend="hecate", options={"strict": True})(*args)
    report = hecate.last_report()
    assert report.count("linear_attention") == 0, str(report)
    [miss] = report.misses
    assert "leaves the first query no key" in miss.reason, miss
    ref = strictly_causal_normalised_without_eps(*args)
    assert torch.equal(got.isnan(), ref.isnan()) and got.isnan()[:, 0].all()


def test_anticausal_mask_is_reported_with_its_reason(fresh_dynamo):
    report = _check(anticausal, [torch.randn(B, T, D) for _ in range(3)], False)
    assert report.count("linear_attention") == 0, str(report)
    [miss] = report.misses
    assert "mask D is not causal" in miss.reason and "anticausal" not in miss.reason, miss
    assert miss.source.startswith("test_linear_attention_parallel_spellings.py:"), miss.source


def _masked(k, v, q):
    return (q @ k.mT).tril() @ v


def _cached(k, v, q):
    return ((q @ k.mT) * torch.ones(q.shape[1], k.shape[1]).tril(k.shape[1] - q.shape[1])) @ v


@pytest.mark.parametrize("fn, lengths, symbols, reason", [
    (_masked, (T, T), True, ["two symbols", "dynamic=True"]),
    (_cached, (6, 3), False, ["queries and keys of other lengths", "[..., 3, 6]"])], ids=["two_symbols", "a_cache"])
def test_a_masked_score_over_two_lengths_is_reported(fn, lengths, symbols, reason, fresh_dynamo):
    """mark_dynamic on each input gives q's and k's lengths their own symbols: the mask on a score [.., s_q, s_k]
    cannot be proved causal; three queries against six keys (a cache of earlier keys) masked by tril with an
    offset are not the op's causal mask over one length. Reported, not silent."""
    (t_k, t_q) = lengths
    k, v, q = torch.randn(B, t_k, D), torch.randn(B, t_k, D), torch.randn(B, t_q, D)
    if symbols:
        for x in (k, v, q):
            torch._dynamo.mark_dynamic(x, 1)
    got = torch.compile(fn, backend="hecate", options={"fallback": "eager"})(k, v, q)
    report = hecate.last_report()
    assert report.count("linear_attention") == 0, str(report)
    [miss] = report.misses
    assert all(r in miss.reason for r in reason), miss
    assert_close("y", got, fn(k, v, q), TOL)


def test_a_bound_on_the_score_is_reported_not_dropped(fresh_dynamo):
    """(q kᵀ).clamp(−10, 10): the same as q kᵀ at the random points checked, not at large scores; reported."""
    def clamped(k, v, q):
        return (q @ k.mT).clamp(-10, 10).tril() @ v
    args = [torch.randn(B, T, D) * 3 for _ in range(3)]
    got = torch.compile(clamped, backend="hecate", options={"fallback": "eager"})(*args)
    report = hecate.last_report()
    assert report.count("linear_attention") == 0, str(report)
    [miss] = report.misses
    assert "applies clamp" in miss.reason and "a bound or branch on data" in miss.reason, miss
    assert_close("y", got, clamped(*args), TOL)


def test_decay_of_a_tensor_constant_fuses(fresh_dynamo):
    """γ^(t−s) with γ = torch.tensor(0.9) built in forward: a constant (detached, it stops no gradient)."""
    def retention(k, v, q):
        idx = torch.arange(q.shape[1])
        diff = idx[:, None] - idx[None, :]
        decay = (torch.tensor(0.9) ** diff.clamp(min=0).float()) * (diff >= 0)
        return ((q @ k.mT) * decay) @ v
    report = _check(retention, [torch.randn(B, T, D) for _ in range(3)], False)
    assert report.count("linear_attention") == 1 and not report.misses, str(report)


def test_normaliser_is_fused_with_its_eps(fresh_dynamo):
    report = _check(normalised_by_reciprocal, [torch.randn(B, T, D) for _ in range(3)], False)
    assert report.fusions[0].detail.endswith("normalised"), report.fusions[0].detail
    report = _check(normalised_by_clamp, [torch.randn(B, T, D) for _ in range(3)], False)
    assert not report.fusions[0].detail.endswith("normalised"), report.fusions[0].detail


# --- the decay read from a buffer or parameter: γ (or log γ) per head, read at run time -------------

class RetNetLogDecayBuffer(nn.Module):
    """torchscale's retention: log γ per head in a buffer, the decay exp((t−s) log γ) with +inf above the diagonal."""

    def __init__(self, heads=2):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v = (nn.Linear(D, D, bias=False) for _ in range(3))
        self.register_buffer("log_decay", torch.log(1 - 2.0 ** (-5 - torch.arange(heads, dtype=torch.float))))

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (f(x).view(b, n, self.heads, -1).transpose(1, 2) for f in (self.q, self.k, self.v))
        index = torch.arange(n, dtype=x.dtype)
        future = ~torch.tril(torch.ones(n, n, dtype=torch.bool))
        mask = torch.nan_to_num(torch.exp((index[:, None] - index[None, :]).masked_fill(future, float("inf"))
                                          * self.log_decay[:, None, None]))
        return ((q @ k.transpose(-1, -2)) * mask) @ v


class ScaledRetNetLogDecayBuffer(RetNetLogDecayBuffer):
    """torchscale's retention with the score scaled by d^-1/2 (its queries' scaling written on the score)."""

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (f(x).view(b, n, self.heads, -1).transpose(1, 2) for f in (self.q, self.k, self.v))
        index = torch.arange(n, dtype=x.dtype)
        diff = index[:, None] - index[None, :]
        mask = torch.exp(diff * self.log_decay[:, None, None]).masked_fill(diff < 0, 0.0)
        return (q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 * mask) @ v


class GammaBufferHeadsLast(nn.Module):
    """a γ buffer [H, 1, 1], heads kept [B, T, H, Dh], einsum scores, torch.where of an arange comparison."""

    def __init__(self, heads=2):
        super().__init__()
        self.heads = heads
        self.register_buffer("gamma", torch.tensor([0.9, 0.6]).view(heads, 1, 1))

    def forward(self, q, k, v):
        b, n, _ = q.shape
        q, k, v = (z.reshape(b, n, self.heads, -1) for z in (q, k, v))
        i = torch.arange(n)
        gap = (i.view(-1, 1) - i.view(1, -1)).to(q.dtype)
        decay = torch.where(i.view(-1, 1) >= i.view(1, -1), torch.pow(self.gamma, gap), torch.zeros_like(gap))
        s = torch.einsum("bthd,bshd->bhts", q, k) * decay
        return torch.einsum("bhts,bshd->bthd", s, v).reshape(b, n, -1)


class _PerHeadDecay(nn.Module):
    """Heads split from [B, T, H·Dh], (φ(Q)φ(K)ᵀ ⊙ D) V per head with the decay D [H, T, T] of ``decay``, merged."""

    heads = 2

    def forward(self, q, k, v):
        b, n, _ = q.shape
        q, k, v = (z.view(b, n, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        return (((phi(q) @ phi(k).mT) * self.decay(n, q.dtype)) @ v).transpose(1, 2).flatten(2)


class LearnedDecay(_PerHeadDecay):
    """a learned γ per head (nn.Parameter [H], its gradient checked), the future masked by triu."""

    def __init__(self):
        super().__init__()
        self.gamma = nn.Parameter(torch.tensor([0.95, 0.8]))

    def decay(self, n, dtype):
        t = torch.arange(n, dtype=dtype)
        d = self.gamma.view(-1, 1, 1) ** (t[:, None] - t[None, :]).clamp(min=0)
        return d.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), 0.0)


class ScalarGammaBuffer(nn.Module):
    """one γ for every head, a 0-d buffer."""

    def __init__(self):
        super().__init__()
        self.register_buffer("gamma", torch.tensor(0.85))

    def forward(self, q, k, v):
        t = torch.arange(q.shape[1])
        gap = t[:, None] - t[None, :]
        return ((phi(q) @ phi(k).mT) * torch.where(gap >= 0, self.gamma ** gap, 0.0)) @ v


class SigmoidGamma(_PerHeadDecay):
    """γ = sigmoid(p), p learned per head: the decay is computed from the parameter, not held in it."""

    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.tensor([2.0, 0.5]))

    def decay(self, n, dtype):
        t = torch.arange(n)
        gap = (t[:, None] - t[None, :]).to(dtype)
        return torch.where(gap >= 0, torch.sigmoid(self.p)[:, None, None] ** gap, 0.0)


class LogSigmoidDecay(_PerHeadDecay):
    """log γ = logsigmoid(p) per head, the decay exp((t − s) log γ), the future cut by tril."""

    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.tensor([3.0, 1.0]))

    def decay(self, n, dtype):
        t = torch.arange(n, dtype=dtype)
        return torch.exp((t[:, None] - t[None, :]).clamp(min=0) * F.logsigmoid(self.p).view(-1, 1, 1)).tril()


class LearnedScaleOverAGammaBuffer(nn.Module):
    """A learned 0-d scale of the score beside γ in a buffer, one or per head (the mask reads both: probe r21)."""

    def __init__(self, gamma=(0.85,)):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(0.7))
        self.register_buffer("gamma", torch.tensor(gamma) if len(gamma) > 1 else torch.tensor(gamma[0]))

    def forward(self, q, k, v):
        b, n, _ = q.shape
        heads = 1 if self.gamma.dim() == 0 else self.gamma.shape[0]
        q, k, v = (z.view(b, n, heads, -1).transpose(1, 2) for z in (q, k, v))
        t = torch.arange(n)
        gamma = self.gamma if self.gamma.dim() == 0 else self.gamma[:, None, None]
        decay = torch.tril(gamma ** (t[:, None] - t[None, :]).float())
        return ((q @ k.mT) * self.scale * decay @ v).transpose(1, 2).reshape(b, n, -1)


DECAY_READ = [RetNetLogDecayBuffer, ScaledRetNetLogDecayBuffer, GammaBufferHeadsLast, LearnedDecay, ScalarGammaBuffer,
              lambda: MultiScaleRetention(decay_in_a_buffer=True), SigmoidGamma, LogSigmoidDecay,
              LearnedScaleOverAGammaBuffer, lambda: LearnedScaleOverAGammaBuffer((0.9, 0.6))]


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("make", DECAY_READ, ids=[m.__name__ if isinstance(m, type) else f"lambda_{i}"
                                                  for i, m in enumerate(DECAY_READ)])
def test_decay_read_from_a_buffer_or_parameter_fuses_and_equals_eager(make, dynamic, fresh_dynamo):
    """γ is read from the tensor at run time: a buffer changed between calls, or a learned γ, is honoured."""
    torch.manual_seed(0)
    model = make()
    args = [torch.randn(B, T, D) for _ in range(1 if isinstance(model, (RetNetLogDecayBuffer, MultiScaleRetention))
                                             else 3)]
    report = _check(model, args, dynamic, list(model.parameters()))
    assert report.count("linear_attention") == 1 and not report.misses, str(report)
    how = "computed from l_self_parameters_p_" if isinstance(model, (SigmoidGamma, LogSigmoidDecay)) else "read from"
    assert how in report.fusions[0].detail and "at run time" in report.fusions[0].detail, report.fusions[0]


def test_decay_buffer_changed_after_compiling_is_honoured(fresh_dynamo):
    model = GammaBufferHeadsLast()
    compiled = torch.compile(model, backend="hecate", options={"strict": True})
    args = [torch.randn(B, T, D) for _ in range(3)]
    compiled(*args)
    model.gamma.copy_(torch.tensor([0.5, 0.99]).view(2, 1, 1))
    assert_close("output after the buffer changed", compiled(*args), model(*args), TOL)


class CausalMaskBuffer(nn.Module):
    """GPT style: tril(ones(max_len, max_len)) registered once and sliced to the length."""

    def __init__(self, max_len=16):
        super().__init__()
        self.register_buffer("mask", torch.tril(torch.ones(max_len, max_len)).view(1, max_len, max_len))

    def forward(self, q, k, v):
        n = q.shape[1]
        return (phi(q) @ phi(k).transpose(1, 2)).masked_fill(self.mask[:, :n, :n] == 0, 0.0) @ v


def test_mask_read_from_a_buffer_is_reported_not_assumed(fresh_dynamo):
    """A buffer's values may change between calls: a whole mask held in one is not a constant the op can
    take, and is not a decay per head."""
    model = CausalMaskBuffer()
    report = _check(model, [torch.randn(B, T, D) for _ in range(3)], False)
    assert report.count("linear_attention") == 0, str(report)
    [miss] = report.misses
    assert "buffer, parameter or argument" in miss.reason and "of shape [1, 16, 16]" in miss.reason, miss
    assert "γ (or log γ) per head read from one tensor" in miss.reason, miss
    assert miss.source.startswith("test_linear_attention_parallel_spellings.py:"), miss.source


def mask_written_after_it_is_made(q, k, v):  # tril, then one entry set by item assignment
    m = torch.tril(torch.ones(q.shape[1], q.shape[1]))
    m[0, 0] = 3.0
    return ((q @ k.mT) * m) @ v


def decay_set_by_item_assignment(q, k, v):  # a per-head γ tensor built in forward, one entry set after
    q, k, v = (x.view(x.shape[0], x.shape[1], 2, -1).transpose(1, 2) for x in (q, k, v))
    g = torch.full((2,), 0.9)
    g[1] = 0.5
    t = torch.arange(q.shape[2], dtype=q.dtype)
    decay = torch.tril(g[:, None, None] ** (t[:, None] - t[None, :]).clamp(min=0))
    return ((q @ k.mT) * decay) @ v


def queries_written_after_the_scores(q, k, v):  # the scores from q, then the input q zeroed in place, then A @ V
    a = (q @ k.mT) * torch.tril(torch.ones(q.shape[1], q.shape[1]))
    q.mul_(0.0)
    return a @ v


@pytest.mark.parametrize("fn", [mask_written_after_it_is_made, decay_set_by_item_assignment],
                         ids=lambda f: f.__name__)
def test_a_mask_written_in_place_is_not_read_as_made(fn, fresh_dynamo):
    """Evaluated from what computes it, a mask or decay written in place afterwards would miss the write (it
    was fused as the plain causal mask / γ = 0.9). A mask with an entry written is reported; a γ per head made by
    torch.full with one slot written is the stack of its slots, γ = 0.9 and 0.5, which fuses. Compiled == eager."""
    torch.manual_seed(0)
    args = [torch.randn(B, T, D) for _ in range(3)]
    got = torch.compile(fn, backend="hecate", options={"fallback": "eager"})(*[a.clone() for a in args])
    assert_close("output", got, fn(*args), TOL)
    report = hecate.last_report()
    if fn is decay_set_by_item_assignment:
        assert [f.detail for f in report.fusions] == ["causal (φ(Q)φ(K)ᵀ ⊙ D) V, parallel form, decay γ=0.9/0.5"], \
            str(report)
    else:
        assert not report.fusions and "written in place" in report.misses[0].reason, str(report)


def test_queries_written_after_the_scores_read_them_fuse(fresh_dynamo):
    """The scores read q, then the code zeroes q in place, then A @ V: the op reads a copy of q taken where the
    scores read it, and the caller's q is zeroed as eager zeroes it (it was reported as written in place)."""
    torch.manual_seed(0)
    args = [torch.randn(B, T, D) for _ in range(3)]
    mine, theirs = [a.clone() for a in args], [a.clone() for a in args]
    got = torch.compile(queries_written_after_the_scores, backend="hecate", options={"fallback": "eager"})(*mine)
    assert_close("output", got, queries_written_after_the_scores(*theirs), TOL)
    assert torch.equal(mine[0], theirs[0]) and not mine[0].any()
    report = hecate.last_report()
    assert report.count("linear_attention") == 1 and not report.misses, str(report)


class RetentionOverHeadInputs(nn.Module):
    """[B, H, T, D] inputs (every dim dynamic under dynamic=True) against a log γ buffer of the H heads."""

    def __init__(self, heads=2):
        super().__init__()
        self.register_buffer("log_gamma", torch.log(1 - 2.0 ** (-5 - torch.arange(heads, dtype=torch.float))))

    def forward(self, q, k, v):
        i = torch.arange(q.shape[2])
        diff = i[:, None] - i[None, :]
        mask = torch.exp(diff[None] * self.log_gamma[:, None, None]).masked_fill(diff[None] < 0, 0.0)
        return (q @ k.transpose(-1, -2) * 0.5 * mask) @ v


def test_decay_buffer_per_head_against_dynamic_head_inputs_fuses(fresh_dynamo):
    """Read at a second size, the head count of the inputs moved against the buffer's (a shape error): the
    length alone is moved then, and the decay, the same at both lengths, fuses."""
    model = RetentionOverHeadInputs()
    compiled = torch.compile(model, backend="hecate", dynamic=True, options={"strict": True})
    for length in (6, 5):
        args = [torch.randn(2, 2, length, 4, generator=torch.Generator().manual_seed(i)) for i in range(3)]
        assert_close(f"output at T = {length}", compiled(*args), model(*args), TOL)
        assert hecate.last_report().count("linear_attention") == 1, str(hecate.last_report())


# --- a gate per step: Mamba-2's exp(segsum(a)), gated linear attention's parallel form ----------------------------


def _segsum_by_differences(a):  # a [..., T] → [..., T, T]: Σ_{s<r≤t} a_r below the diagonal, −inf above
    n = a.shape[-1]
    total = torch.cumsum(a, -1)
    pairs = total[..., :, None] - total[..., None, :]
    return pairs.masked_fill(~torch.tril(torch.ones(n, n, dtype=torch.bool)), float("-inf"))


def _segsum_by_masked_cumsum(a):  # the Mamba-2 reference's: a repeated over a new axis, masked, summed down it
    n = a.shape[-1]
    a = a[..., None].expand(*a.shape, n)
    a = a.masked_fill(~torch.tril(torch.ones(n, n, dtype=torch.bool), diagonal=-1), 0)
    return torch.cumsum(a, dim=-2).masked_fill(~torch.tril(torch.ones(n, n, dtype=torch.bool)), -torch.inf)


def ssd_segsum_by_differences(c, b, x, a):  # C, B [B, H, T, N], X [B, H, T, P], a = log gates [B, H, T]
    return ((c @ b.transpose(-1, -2)) * torch.exp(_segsum_by_differences(a))) @ x


def ssd_segsum_by_masked_cumsum(c, b, x, a):
    return torch.einsum("bhts,bhsp->bhtp", torch.einsum("bhtn,bhsn->bhts", c, b) * _segsum_by_masked_cumsum(a).exp(),
                        x)


def ssd_shared_by_the_heads(c, b, x, a):  # Mamba-2's one group: C, B [B, T, N] for every head, X [B, T, H, P]
    scores = c @ b.transpose(1, 2)  # [B, T, T]
    return torch.einsum("bhls,bshp->blhp", scores[:, None] * torch.exp(_segsum_by_masked_cumsum(a)), x)


def ssd_shared_by_the_heads_in_one_einsum(c, b, x, a):  # the Mamba-2 reference's three-operand contraction
    return torch.einsum("bls,bhls,bshp->blhp", torch.einsum("bln,bsn->bls", c, b),
                        torch.exp(_segsum_by_differences(a)), x)


def gla_cumulative_product_ratio(q, k, v, f):  # one head [B, T, D], gates sigmoid(f) [B, T]: Π g by a ratio
    g = torch.sigmoid(f).cumprod(-1)
    decay = torch.tril(g[:, :, None] / g[:, None, :])
    return ((phi(q) @ phi(k).mT) * decay) @ v


def gla_log_sigmoid_heads_last_gates(q, k, v, f):  # [B, H, T, D], gates [B, T, H] as log-sigmoids summed in time
    total = F.logsigmoid(f).transpose(1, 2).cumsum(-1)  # [B, H, T]
    n = q.shape[-2]
    below = torch.ones(n, n, dtype=torch.bool).tril()
    decay = torch.where(below, torch.exp(total.unsqueeze(-1) - total.unsqueeze(-2)), 0.0)
    return (q @ k.mT * decay) @ v


class Mamba2Mixer(nn.Module):
    """The SSD mixer's quadratic form: A = −exp(A_log) per head, a = Δt·A per step [B, T, H], L = exp(segsum(a))."""

    def __init__(self, heads=3):
        super().__init__()
        self.A_log = nn.Parameter(torch.linspace(-1.0, 0.5, heads))

    def forward(self, c, b, x, dt):
        a = (F.softplus(dt) * -torch.exp(self.A_log)).transpose(1, 2)  # [B, H, T]
        return ((c @ b.mT) * torch.exp(_segsum_by_differences(a))) @ x


class Mamba2JointProjection(nn.Module):
    """Mamba-2's layout: one projection gives C, B and Δt, split apart (the mask reads the same tensor as the
    queries and keys; its gates were crowded out of the tensors tried by the mask's own [T, T] nodes, probe r21)."""

    def __init__(self, width=6, heads=3, state=4):
        super().__init__()
        self.heads, self.state = heads, state
        self.in_proj = nn.Linear(width, 2 * heads * state + heads)
        self.A_log = nn.Parameter(torch.linspace(-1.0, 0.5, heads))

    def forward(self, u, x):  # u [B, T, width], x [B, H, T, P]
        b, n, _ = u.shape
        c, bb, dt = torch.split(self.in_proj(u), [self.heads * self.state, self.heads * self.state, self.heads], -1)
        c, bb = (t.view(b, n, self.heads, self.state).transpose(1, 2) for t in (c, bb))
        a = (F.softplus(dt) * -torch.exp(self.A_log)).transpose(1, 2)  # [B, H, T]
        return ((c @ bb.mT) * torch.exp(_segsum_by_differences(a))) @ x


def gla_gate_shared_by_the_heads(q, k, v, f):  # [B, H, T, D] with one gate per sequence and step, [B, T]
    total = F.logsigmoid(f).cumsum(-1)[:, None]  # [B, 1, T]
    return ((q @ k.mT) * torch.exp(total[..., :, None] - total[..., None, :]).tril()) @ v


def _gated_inputs(layout, steps=T):
    g = torch.Generator().manual_seed(0)
    if layout == "ssd_shared":  # C, B [B, T, N] shared by the heads, X [B, T, H, P], log gates a < 0 [B, H, T]
        return [torch.randn(B, steps, 4, generator=g), torch.randn(B, steps, 4, generator=g),
                torch.randn(B, steps, 3, 5, generator=g), -F.softplus(torch.randn(B, 3, steps, generator=g))]
    if layout == "ssd":  # C, B, X [B, H, T, ·] and log gates a < 0 [B, H, T]
        return [torch.randn(B, 3, steps, 4, generator=g), torch.randn(B, 3, steps, 4, generator=g),
                torch.randn(B, 3, steps, 5, generator=g), -F.softplus(torch.randn(B, 3, steps, generator=g))]
    if layout == "shared":
        return [torch.randn(B, 3, T, D, generator=g) for _ in range(3)] + [torch.randn(B, T, generator=g) + 1]
    if layout == "one_head":
        return [torch.randn(B, T, D, generator=g) for _ in range(3)] + [torch.randn(B, T, generator=g) + 2]
    return [torch.randn(B, 3, T, D, generator=g) for _ in range(3)] + [torch.randn(B, T, 3, generator=g) + 1]


def gla_clamped_gates(q, k, v, f):  # the gates clamped before their products: the clamped values are the gates
    g = torch.sigmoid(f).clamp(max=0.9).cumprod(-1)
    return ((q @ k.mT) * torch.tril(g[:, :, None] / g[:, None, :])) @ v


GATED = [(ssd_segsum_by_differences, "ssd"), (ssd_segsum_by_masked_cumsum, "ssd"),
         (ssd_shared_by_the_heads, "ssd_shared"), (ssd_shared_by_the_heads_in_one_einsum, "ssd_shared"),
         (gla_cumulative_product_ratio, "one_head"), (gla_log_sigmoid_heads_last_gates, "heads"),
         (gla_clamped_gates, "one_head"), (gla_gate_shared_by_the_heads, "shared")]


def mlstm_input_gate(q, k, v, f, i):  # mLSTM's D_ts = exp(F_t − F_s + i_s): forget gates per step, input gate per key
    total = F.logsigmoid(f).cumsum(-1)  # [B, H, T]
    n = total.shape[-1]
    log_d = (total[..., :, None] - total[..., None, :] + i[..., None, :]).masked_fill(
        ~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    return ((q @ k.mT / 2.0) * log_d.exp()) @ v


def gates_inclusive_of_the_key(q, k, v, f):  # D_ts = Π_{s≤r≤t} g_r: the key's own gate too, by a ratio
    g = torch.sigmoid(f)
    total = g.cumprod(-1)
    return ((q @ k.mT) * torch.tril(total[..., :, None] / total[..., None, :] * g[..., None, :])) @ v


def gates_inclusive_of_the_key_in_log_space(q, k, v, f):  # the same as exp of sums of log-sigmoids
    log_g = F.logsigmoid(f)
    total = log_g.cumsum(-1)
    return ((q @ k.mT) * torch.exp(total[..., :, None] - total[..., None, :] + log_g[..., None, :]).tril()) @ v


def gates_computed_from_the_queries(q, k, v, f, i):  # g_t = σ(Σ_d q_td): the mask reads q beside the score
    total = F.logsigmoid(q.sum(-1)).cumsum(-1)
    return ((q @ k.mT) * torch.exp(total[..., :, None] - total[..., None, :]).tril()) @ v


def mlstm_gates_from_one_input(q, k, v, f):  # i_s = tanh(f_s) / 3 from the forget gates' own input
    total = F.logsigmoid(f).cumsum(-1)
    n = total.shape[-1]
    log_d = (total[..., :, None] - total[..., None, :] + (torch.tanh(f) / 3)[..., None, :]).masked_fill(
        ~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    return ((q @ k.mT) * log_d.exp()) @ v


STRENGTHS = [mlstm_input_gate, gates_inclusive_of_the_key, gates_inclusive_of_the_key_in_log_space,
             mlstm_gates_from_one_input]


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_gates_computed_from_the_queries_fuse(dynamic, fresh_dynamo):
    """The gates read from a node computed from q (it was reported as differing from the formula at random points,
    probe r21: the mask was evaluated with the queries of the score's check)."""
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(B, 3, T, D, generator=g) for _ in range(3)]
    report = _check(lambda q, k, v: gates_computed_from_the_queries(q, k, v, None, None), args, dynamic)
    assert report.count("linear_attention") == 1 and not report.misses, str(report)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("fn", STRENGTHS, ids=[f.__name__ for f in STRENGTHS])
def test_gates_per_step_with_a_factor_per_key_fuse_and_equal_eager(fn, dynamic, fresh_dynamo):
    """D_ts = w_s·Π_{s<r≤t} g_r: the factor per key (mLSTM's exp(i_s), the key's own gate) is read off D's
    diagonal at random draws, from an input or the gates' own tensor; the op's keys are scaled by it at run time,
    and both gates get their gradient."""
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(B, 3, T, D, generator=g) for _ in range(3)] + [torch.randn(B, 3, T, generator=g) + 2,
                                                                       0.5 * torch.randn(B, 3, T, generator=g)]
    report = _check(fn, args[:5 if fn is mlstm_input_gate else 4], dynamic)
    assert report.count("linear_attention") == 1 and not report.misses, str(report)
    assert "keys scaled by" in report.fusions[0].detail and "per step" in report.fusions[0].detail, report.fusions[0]


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("fn,layout", GATED, ids=[f.__name__ for f, _ in GATED])
def test_a_gate_per_step_fuses_and_equals_eager(fn, layout, dynamic, fresh_dynamo):
    """D_ts = Π_{s<r≤t} g_r, a gate per step (and head, and sequence) read from an input: recognised from D's
    first subdiagonal (g_t) and its products at two draws; the op takes the gates as its keep factors at run time,
    and the gates get their gradient through it."""
    report = _check(fn, _gated_inputs(layout), dynamic)
    assert report.count("linear_attention") == 1 and not report.misses, str(report)
    assert "per step" in report.fusions[0].detail and "at run time" in report.fusions[0].detail, report.fusions[0]


def strictly_causal_ssd(c, b, x, a):  # exp(segsum(a)) for s < t alone: each query reads the state before its step
    return ((c @ b.mT) * torch.exp(_segsum_by_differences(a)).tril(-1)) @ x


def strictly_causal_gla_normalised(q, k, v, f):  # Π_{s<r≤t} σ(f_r) by a ratio of cumprods, s < t, row sums + ε
    total = torch.sigmoid(f).cumprod(-1)
    a = (phi(q) @ phi(k).mT) * torch.tril(total[..., :, None] / total[..., None, :], -1)
    return (a @ v) / (a.sum(-1, keepdim=True) + 1e-2)


def strictly_causal_mlstm(q, k, v, f, i):  # exp(F_t − F_s + i_s) for s < t: an input gate per key beside the gates
    total = F.logsigmoid(f).cumsum(-1)
    n = total.shape[-1]
    log_d = (total[..., :, None] - total[..., None, :] + i[..., None, :]).masked_fill(
        ~torch.ones(n, n, dtype=torch.bool).tril(-1), float("-inf"))
    return ((q @ k.mT) * log_d.exp()) @ v


def strictly_causal_mlstm_from_one_input(q, k, v, f):  # as above, i = 0.3·tanh(f) (probe r24 l03: reported)
    total = F.logsigmoid(f).cumsum(-1)
    n = total.shape[-1]
    log_d = (total[..., :, None] - total[..., None, :] + 0.3 * torch.tanh(f)[..., None, :]).masked_fill(
        ~torch.ones(n, n, dtype=torch.bool).tril(-1), float("-inf"))
    return ((q @ k.mT) * log_d.exp()) @ v


STRICT_GATED = [strictly_causal_ssd, strictly_causal_gla_normalised, strictly_causal_mlstm,
                strictly_causal_mlstm_from_one_input]


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("fn", STRICT_GATED, ids=lambda f: f.__name__)
def test_strictly_causal_gates_per_step_fuse_and_equal_eager(fn, dynamic, fresh_dynamo):
    """D_ts = w_s·Π_{s<r≤t} g_r for s < t alone: the rows from step 1 carry their own gate g_t, which scales each
    query before it reads the state of the step before (probe r22: reported as an input not known when compiling);
    the gates, the factor per key and every input get eager's gradient."""
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(B, 3, T, D, generator=g) for _ in range(3)] + [torch.randn(B, 3, T, generator=g) + 1,
                                                                       0.5 * torch.randn(B, 3, T, generator=g)]
    if fn is strictly_causal_ssd:
        args[3] = -torch.rand(B, 3, T, generator=g)  # log gates
    report = _check(fn, args[:5 if fn is strictly_causal_mlstm else 4], dynamic)
    assert report.count("linear_attention") == 1 and not report.misses, str(report)
    assert report.fusions[0].detail.startswith("strictly causal") and "per step" in report.fusions[0].detail, \
        report.fusions[0]


def test_strictly_causal_gates_over_two_steps(fresh_dynamo):
    """At T = 2 a strictly causal gated mask has one pair, D_10 = w_0·g_1: read as the gate g_1 where the mask reads
    the gates alone (probe r24: reported, though it fuses at T = 3); with an input gate per key beside them the two
    are one number, which draws cannot tell apart: reported, and equal to eager."""
    args = [torch.randn(B, 3, 2, D) for _ in range(3)] + [-torch.rand(B, 3, 2), 0.5 * torch.randn(B, 3, 2)]
    report = _check(strictly_causal_ssd, args[:4], False)
    assert report.count("linear_attention") == 1 and not report.misses, str(report)
    report = _check(strictly_causal_mlstm, args, False)
    assert report.count("linear_attention") == 0 and report.misses, str(report)


def test_a_gate_per_step_over_two_steps_fuses(fresh_dynamo):
    """At T = 2 the mask has one gate below the diagonal, D_10 = g_1: still the products of the gates (it was reported
    as a tensor whose values are not known, probe r20)."""
    report = _check(ssd_segsum_by_differences, _gated_inputs("ssd", steps=2), False)
    assert report.count("linear_attention") == 1 and not report.misses, str(report)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_mamba2_mixer_fuses_and_equals_eager(dynamic, fresh_dynamo):
    """Δt per step and A_log per head reach the mask through Δt·A: that product is the gate's log, read at run time
    (A_log gets its gradient)."""
    model = Mamba2Mixer()
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(B, 3, T, 4, generator=g), torch.randn(B, 3, T, 4, generator=g),
            torch.randn(B, 3, T, 5, generator=g), torch.randn(B, T, 3, generator=g)]
    report = _check(model, args, dynamic, list(model.parameters()))
    assert report.count("linear_attention") == 1 and not report.misses, str(report)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_mamba2_with_one_projection_split_into_queries_keys_and_gates_fuses(dynamic, fresh_dynamo):
    model = Mamba2JointProjection()
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(B, T, 6, generator=g), torch.randn(B, 3, T, 5, generator=g)]
    report = _check(model, args, dynamic, list(model.parameters()))
    assert report.count("linear_attention") == 1 and not report.misses, str(report)


def gates_of_the_queries_alone(q, k, v, f):  # D_ts = g_t: its subdiagonal is g_t, but not its products
    n = q.shape[1]
    return ((q @ k.mT) * torch.tril(torch.sigmoid(f)[:, :, None].expand(-1, -1, n))) @ v


def gates_of_the_keys_alone(q, k, v, f):  # D_ts = g_s: not a product of gates between s and t
    n = q.shape[1]
    return ((q @ k.mT) * torch.tril(torch.sigmoid(f)[:, None, :].expand(-1, n, -1))) @ v


@pytest.mark.parametrize("fn", [gates_of_the_queries_alone, gates_of_the_keys_alone], ids=lambda f: f.__name__)
def test_a_mask_read_from_an_input_that_is_not_gates_per_step_is_reported(fn, fresh_dynamo):
    """What is not D_ts = Π_{s<r≤t} g_r of values read from the input stays as written, with a reason, and equal."""
    args = _gated_inputs("one_head")
    got = torch.compile(fn, backend="hecate", options={"fallback": "eager"})(*args)
    report = hecate.last_report()
    assert report.count("linear_attention") == 0 and report.misses, str(report)
    assert_close("output", got, fn(*args), TOL)


def mlstm_stabilised(q, k, v, f, i):  # xLSTM's parallel_stabilized_simple: the row max out of the exponent
    total = F.logsigmoid(f).cumsum(-1)
    n = total.shape[-1]
    log_d = (total[..., :, None] - total[..., None, :] + i[..., None, :]).masked_fill(
        ~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    peak = log_d.max(dim=-1, keepdim=True).values
    c = (q @ k.mT / 2.0) * torch.exp(log_d - peak)
    normaliser = torch.maximum(c.sum(-1, keepdim=True).abs(), torch.exp(-peak))
    return (c / (normaliser + 1e-6)) @ v


def test_the_stabilised_mlstm_mask_is_reported_as_stabilised(fresh_dynamo):
    """exp(log D − max_s log D) depends on every key of the row: reported as such, not as gates read from inputs
    (probe r37: the reason named the gates, which fuse in the mask without the stabiliser)."""
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(B, 3, T, D, generator=g) for _ in range(3)] + [torch.randn(B, 3, T, generator=g) + 2,
                                                                       0.5 * torch.randn(B, 3, T, generator=g)]
    got = torch.compile(mlstm_stabilised, backend="hecate", options={"fallback": "eager"})(*args)
    report = hecate.last_report()
    reasons = [m.reason for m in report.misses if m.pattern == "linear_attention"]
    assert report.count("linear_attention") == 0 and len(reasons) == 1, str(report)
    assert "xLSTM's stabiliser" in reasons[0] and "taken by the graph as input" not in reasons[0], reasons[0]
    assert_close("output", got, mlstm_stabilised(*args), TOL)


# --- the score scaled by one number learned -------------------------------------------------------------------------


class LearnedScoreScale(nn.Module):
    """A learned scale folded into the causal mask, s · tril(ones)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(0.5))

    def forward(self, q, k, v):
        n = q.shape[1]
        return ((phi(q) @ phi(k).mT) * (self.scale * torch.tril(torch.ones(n, n)))) @ v


class LearnedTemperatureRetention(nn.Module):
    """A learned temperature, the score divided by exp(log τ), over a decay γ = 0.9, normalised with + 1 (a smaller
    ε makes ∂/∂τ a cancellation: at 1e-3 eager fp32 errs 4e-4 against float64, the fused op 2e-4)."""

    def __init__(self):
        super().__init__()
        self.log_tau = nn.Parameter(torch.tensor(0.3))

    def forward(self, q, k, v):
        a = (phi(q) @ phi(k).mT) / self.log_tau.exp() * _decay(q.shape[1])
        return (a @ v) / (a.sum(-1, keepdim=True) + 1.0)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("module", [LearnedScoreScale, LearnedTemperatureRetention], ids=lambda m: m.__name__)
def test_a_learned_score_scale_fuses_and_equals_eager(module, dynamic, fresh_dynamo):
    """One number read at run time scales the score (or divides it): the op's queries are scaled by it, and the
    parameter gets its gradient (a 0-d tensor beside the mask crashed the pass once: strict mode raises that)."""
    torch.manual_seed(0)
    model = module()
    report = _check(model, [torch.randn(B, T, D) for _ in range(3)], dynamic, list(model.parameters()))
    assert report.count("linear_attention") == 1 and not report.misses, str(report)
    assert "at run time" in report.fusions[0].detail and "score scaled by" in report.fusions[0].detail


def noncausal_by_summed_outer_products(q, k, v):  # Σ_t k_t ⊗ v_t by an einsum's outer products and sum over t
    kv = torch.einsum("bhtk,bhtv->bhtkv", phi(k), v).sum(dim=2)
    return torch.einsum("bhtk,bhkv->bhtv", phi(q), kv)


@pytest.mark.parametrize("fn", [noncausal_by_matmul, noncausal_by_summed_outer_products], ids=lambda f: f.__name__)
def test_noncausal_form_recompiled_at_a_second_length_is_reported(fn, fresh_dynamo):
    """A second length makes Dynamo recompile with the queries' and the keys' lengths two symbols: the op takes one
    length, so the form is reported there (it was silent: no fusion and no miss, probe r20); the first compile
    fuses, and both equal eager."""
    compiled = torch.compile(fn, backend="hecate", options={"fallback": "eager", "strict": True})
    for length, fused in ((T, True), (T + 2, False)):
        args = [torch.randn(B, 2, length, D, generator=torch.Generator().manual_seed(i)) for i in range(3)]
        assert_close(f"output at T = {length}", compiled(*args), fn(*args), TOL)
        report = hecate.last_report()
        if fused:
            assert report.count("linear_attention") == 1 and not report.misses, str(report)
        else:
            assert not report.fusions and "two symbols" in report.misses[0].reason, str(report)


def noncausal_scores_first(q, k, v):  # (φ(Q) φ(K)ᵀ) V: the [T, T] score formed, no mask
    return (phi(q) @ phi(k).transpose(-1, -2)) @ v


def noncausal_scores_first_normalised(q, k, v):  # each row of the unmasked score's product over its sum (+ ε)
    a = phi(q) @ phi(k).mT
    return (a @ v) / (a.sum(-1, keepdim=True) + 1e-6)


def noncausal_scaled_scores_by_einsum(q, k, v):  # scaled, the score and the read by einsums
    a = torch.einsum("btd,bsd->bts", phi(q), phi(k)) * 0.5
    return torch.einsum("bts,bse->bte", a, v)


NONCAUSAL_SCORES = [noncausal_scores_first, noncausal_scores_first_normalised, noncausal_scaled_scores_by_einsum]


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("fn", NONCAUSAL_SCORES, ids=lambda f: f.__name__)
def test_noncausal_scores_formed_first_fuse_and_equal_eager(fn, dynamic, fresh_dynamo):
    """No mask at all, D = c everywhere: the op's non-causal form φ(Q)(φ(K)ᵀ V), which never forms the [T, T]
    score (it was reported as a mask that is not causal, probe r20)."""
    torch.manual_seed(0)
    report = _check(fn, [torch.randn(B, T, D) for _ in range(3)], dynamic)
    assert report.count("linear_attention") == 1 and not report.misses, str(report)
    assert report.fusions[0].detail.startswith("non-causal"), report.fusions[0].detail


class DecayTimesLearnedScale(nn.Module):
    """γ^(t−s) below the diagonal (γ = 0.9 in float32) times a learned number c."""

    def __init__(self):
        super().__init__()
        self.c = nn.Parameter(torch.tensor(0.7))

    def forward(self, q, k, v):
        i = torch.arange(q.shape[-2])
        n = (i[:, None] - i[None, :]).float()
        return ((q @ k.mT) * (torch.where(n >= 0, 0.9 ** n, 0.0) * self.c)) @ v


class LogDecayWithABias(nn.Module):
    """The mask in log space with a learned bias: exp((t−s) log γ + b), the future at −inf."""

    def __init__(self):
        super().__init__()
        self.b = nn.Parameter(torch.tensor(-0.3))

    def forward(self, q, k, v):
        i = torch.arange(q.shape[-2])
        n = (i[:, None] - i[None, :]).float()
        return ((q @ k.mT) * (n * math.log(0.9) + self.b).masked_fill(n < 0, float("-inf")).exp()) @ v


class ScalePerHead(nn.Module):
    """A learned scale per head [H, 1, 1] on the causal score of [B, H, T, D]."""

    def __init__(self):
        super().__init__()
        self.s = nn.Parameter(torch.tensor([0.5, 2.0]).view(2, 1, 1))

    def forward(self, q, k, v):
        return ((q @ k.mT) * self.s * torch.tril(torch.ones(q.shape[-2], q.shape[-2]))) @ v


class LogDecayPerHeadFilledByATensor(nn.Module):
    """log γ per head from a parameter, the future filled with torch.tensor(-inf), a constant made in forward."""

    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.tensor([2.0, 0.5]))

    def forward(self, q, k, v):
        i = torch.arange(q.shape[-2])
        n = (i[:, None] - i[None, :]).float()
        logd = torch.where(n >= 0, F.logsigmoid(self.p)[:, None, None] * n, torch.tensor(float("-inf")))
        return ((q @ k.mT) * logd.exp()) @ v


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("module", [DecayTimesLearnedScale, LogDecayWithABias, ScalePerHead,
                                    LogDecayPerHeadFilledByATensor], ids=lambda m: m.__name__)
def test_learned_scales_and_constant_fills_beside_a_decay_fuse(module, dynamic, fresh_dynamo):
    """A learned scale beside a decay, one or per head, or in log space as a bias; a fill made by torch.tensor in
    forward (known when compiling): each fuses and equals eager, parameters' gradients included (probe r20: each
    was reported as a tensor whose values are not known, or as a scale per query)."""
    torch.manual_seed(0)
    model = module()
    args = [torch.randn(B, 2, T, D) for _ in range(3)]
    report = _check(model, args, dynamic, list(model.parameters()))
    assert report.count("linear_attention") == 1 and not report.misses, str(report)


def test_noncausal_scores_recompiled_at_a_second_length_are_reported(fresh_dynamo):
    """(φ(Q)φ(K)ᵀ) V with no mask at a second length: the queries' and keys' lengths are two symbols, the op's
    non-causal form takes one; reported (it was silent, probe r20), and equal to eager."""
    compiled = torch.compile(noncausal_scores_first, backend="hecate", options={"fallback": "eager", "strict": True})
    for length, fused in ((T, True), (T + 2, False)):
        args = [torch.randn(B, length, D, generator=torch.Generator().manual_seed(i)) for i in range(3)]
        assert_close(f"output at T = {length}", compiled(*args), noncausal_scores_first(*args), TOL)
        report = hecate.last_report()
        assert report.count("linear_attention") == int(fused) and (fused or "two length symbols" in
                                                                   report.misses[0].reason), str(report)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_a_batch_of_zero_sequences_is_reported_as_such(dynamic, fresh_dynamo):
    """At batch 0 the scores have no elements, so neither has D read at them: reported with that reason, and the
    empty result returned (probe r30: an IndexError in the pass, under strict)."""
    def fn(q, k, v):
        t = torch.arange(q.shape[1])
        return ((q @ k.mT) * torch.tril(0.9 ** (t[:, None] - t[None, :]).float())) @ v

    compiled = torch.compile(fn, backend="hecate", dynamic=dynamic, options={"fallback": "eager", "strict": True})
    for b in (2, 0) if dynamic else (0,):
        args = [torch.randn(b, T, D) for _ in range(3)]
        got = compiled(*args)
        assert got.shape == (b, T, D)
        if b:
            assert_close(f"output at B = {b}", got, fn(*args), TOL)
    report = hecate.last_report()
    assert not report.fusions and "has no elements (a batch of 0 sequences" in report.misses[0].reason, str(report)


def ssd_in_chunks(c, b, x, a, chunks=2):  # the Mamba-2 reference's diagonal blocks: a chunk dim beside the batch
    n, steps, h, p = x.shape
    c, b, x = (t.reshape(n, chunks, steps // chunks, h, -1) for t in (c, b, x))
    decay = torch.exp(_segsum_by_masked_cumsum(a.reshape(n, chunks, steps // chunks, h).permute(0, 3, 1, 2)))
    return torch.einsum("bclhn,bcshn,bhcls,bcshp->bclhp", c, b, decay, x).reshape(n, steps, h, p)


def causal_with_a_dim_of_one_beside_the_batch(q, k, v):  # [B, 1, H, T, D]
    n = q.shape[-2]
    return ((q @ k.transpose(-1, -2)) * torch.tril(torch.ones(n, n))) @ v


# (the chunks' length T / C under dynamic=True is a size expression the decay check sees change: reported)
@pytest.mark.parametrize("fn,dynamic", [(ssd_in_chunks, False), (causal_with_a_dim_of_one_beside_the_batch, False),
                                        (causal_with_a_dim_of_one_beside_the_batch, True)],
                         ids=lambda x: getattr(x, "__name__", f"dynamic={x}"))
def test_a_chunk_dim_beside_the_batch_fuses(fn, dynamic, fresh_dynamo):
    """Queries, keys and values [B, C, H, T, D]: each chunk is its own sequence, the op's batch B·C (probe r31: the
    Mamba-2 reference's chunked form was neither fused nor reported)."""
    g = torch.Generator().manual_seed(0)
    if fn is ssd_in_chunks:
        args = [torch.randn(B, 8, 3, 4, generator=g), torch.randn(B, 8, 3, 4, generator=g),
                torch.randn(B, 8, 3, 5, generator=g), -F.softplus(torch.randn(B, 8, 3, generator=g))]
    else:
        args = [torch.randn(B, 1, 3, T, D, generator=g) for _ in range(3)]
    report = _check(fn, args, dynamic)
    assert report.count("linear_attention") == 1 and not report.misses, str(report)
