"""Spelling corpus for the qk_preprocess family: projection → short causal conv → SiLU → φ, written as
different researchers write it. Each spelling must fuse (the whole chain in one hecate.qk_preprocess, no
near-miss) and the compiled model must equal eager, forward and every gradient.

The spellings vary independently: projection (nn.Linear, F.linear, x @ W.T, torch.matmul), the layout swap
(transpose, .mT, permute), the conv (nn.Conv1d + slice, F.pad + F.conv1d, narrow, a weight built from a
[D, K] parameter by None-indexing), SiLU (F.silu, nn.SiLU, sigmoid products, by hand), heads, and φ (the
built-in maps in other words, and functions nobody listed); the projection as an einsum in any index layout,
the causal padding or slicing on either side of the transpose, a conv2d over one row, a causal conv written by
hand as shifted windows (slices or unfold) weighted per channel and summed, in either layout.

What is not a causal zero-padded conv (circular, replicate, reflect or non-zero padding, windows padded
after) must not fuse and must
be reported with that reason.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hecate
from hecate.testing import assert_close, assert_outputs_and_gradients_close

TOL = 1e-5
B, T, D_IN, D, K, H = 2, 7, 5, 6, 4, 2


class Block(nn.Module):
    """The weights every spelling may use; ``spelling(self, x)`` is the forward a researcher wrote."""

    def __init__(self, spelling):
        super().__init__()
        self.spelling = spelling
        self.proj = nn.Linear(D_IN, D)
        self.conv = nn.Conv1d(D, D, K, groups=D, padding=K - 1)
        self.kernel = nn.Parameter(torch.randn(D, K) * 0.5)          # a depthwise kernel kept as [D, K]
        self.conv_no_bias = nn.Conv1d(D, D, K, groups=D, padding=K - 1, bias=False)
        self.omega = nn.Parameter(torch.randn(8, D) * 0.3)              # a feature map's weight [d_phi, D]
        self.phase = nn.Parameter(torch.rand(8) * 6)                     # and its bias [d_phi]
        self.silu = nn.SiLU()
        self.elu = nn.ELU()
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn_like(p) * 0.5)

    def forward(self, x):
        return self.spelling(self, x)


def _conv_slice(m, u):          # [B, D, T] → [B, D, T]
    return m.conv(u)[..., :u.shape[-1]]


def _pad_conv(m, u):
    return F.conv1d(F.pad(u, (K - 1, 0)), m.conv.weight, m.conv.bias, groups=D)


def _windows_from_zeros(m, h):   # [B, T, D] channels last: the sum starts from zeros_like(h), one window per tap
    padded, z = F.pad(h, (0, 0, K - 1, 0)), torch.zeros_like(h)
    for k in range(K):
        z = z + m.kernel[:, k] * padded[:, k:k + h.shape[1]]
    return z


def _shifted_copies(m, h):   # [B, T, D]: shift-and-add, each tap its own pad cut back to the length
    z = m.kernel[:, K - 1] * h
    for i in range(1, K):
        z = z + m.kernel[:, K - 1 - i] * F.pad(h, (0, 0, i, 0))[:, :h.shape[1]]
    return z


def _rolled_copies(m, h):   # [B, T, D]: torch.roll, the wrapped tokens zeroed
    t = torch.arange(h.shape[1])
    z = m.kernel[:, K - 1] * h
    for i in range(1, K):
        z = z + torch.roll(h, i, 1) * (t >= i)[None, :, None] * m.kernel[:, K - 1 - i]
    return z


def _pads_of_slices(m, u):   # [B, D, T]: each tap's copy its own F.pad of a slice, h·w + shift(h, 1)·w + ...
    def shift(x, s):
        return F.pad(x[..., :-s], (s, 0))
    return u * m.kernel[:, K - 1, None] + sum(shift(u, i) * m.kernel[:, K - 1 - i, None] for i in range(1, K))


def _cats_of_zeros(m, h):   # [B, T, D]: each shift joins its own zeros in front, the taps in a loop
    z = h * m.kernel[:, K - 1]
    for i in range(1, K):
        z = z + torch.cat([torch.zeros_like(h[:, :i]), h[:, :-i]], 1) * m.kernel[:, K - 1 - i]
    return z


def _rolled_copies_kept_by_where(m, h):   # [B, T, D]: torch.roll, the wrapped tokens replaced by torch.where
    t = torch.arange(h.shape[1])[None, :, None]
    return sum(torch.where(t >= i, torch.roll(h, i, 1), 0.0) * m.kernel[:, K - 1 - i] for i in range(K))


def _stacked_windows(m, u):   # [B, D, T]: the K windows of one pad stacked on a last dim, weighted by einsum
    padded = F.pad(u, (K - 1, 0))
    windows = torch.stack([padded[..., k:k + u.shape[-1]] for k in range(K)], -1)
    return torch.einsum("bdtk,dk->bdt", windows, m.kernel)


def _rolled_copies_by_where_of_zeros(m, h):   # [B, T, D]: where(t < i, zeros_like(h), roll(h, i, 1))
    t = torch.arange(h.shape[1])[None, :, None]
    return sum(torch.where(t < i, torch.zeros_like(h), torch.roll(h, i, 1)) * m.kernel[:, K - 1 - i] for i in range(K))


def _a_copy_scaled_before_its_weight(m, u):   # [B, D, T]: 2 · shift(u, 1) · w — the conv of 2·w_1, not read so
    def shift(x, s):
        return F.pad(x[..., :-s], (s, 0))
    return u * m.kernel[:, K - 1, None] + 2.0 * shift(u, 1) * m.kernel[:, K - 2, None] \
        + sum(shift(u, i) * m.kernel[:, K - 1 - i, None] for i in range(2, K))


def _windows_stacked_in_front(m, u):   # [B, D, T]: the windows stacked on dim 1, [B, K, D, T], a pad written per window
    windows = torch.stack([F.pad(u, (K - 1, 0))[..., k:k + u.shape[-1]] for k in range(K)], 1)
    return torch.einsum("bkdt,dk->bdt", windows, m.kernel)


def _windows_of_cat_zeros(m, h):   # [B, T, D]: padded by joining K-1 zero tokens in front, one window per tap
    padded = torch.cat([torch.zeros(h.shape[0], K - 1, h.shape[2]), h], dim=1)
    return sum(m.kernel[:, k] * padded[:, k:k + h.shape[1]] for k in range(K))


def _windows_from_the_bias(m, u):   # [B, D, T]: the sum starts from the bias, one window added per tap
    padded, z = F.pad(u, (K - 1, 0)), m.conv.bias[:, None].expand(-1, u.shape[-1])
    for k in range(K):
        z = z + m.kernel[:, k:k + 1] * padded[..., k:k + u.shape[-1]]
    return z


# name: (forward, the fusion's detail)
SPELLINGS = {
    "nn.Linear, nn.Conv1d + [..., :T], F.silu, ELU+1": (
        lambda m, x: F.elu(F.silu(_conv_slice(m, m.proj(x).transpose(1, 2)).transpose(1, 2))) + 1,
        "linear → conv(K=4) → silu → elu+1 [B,T,D]"),
    "F.linear, F.pad + F.conv1d, z * sigmoid(z), relu": (
        lambda m, x: F.relu((lambda z: z * torch.sigmoid(z))(
            _pad_conv(m, F.linear(x, m.proj.weight, m.proj.bias).transpose(1, 2)).transpose(1, 2))),
        "linear → conv(K=4) → silu → relu [B,T,D]"),
    "x @ W.T + b, [:, :, :T], sigmoid(z) * z, relu ** 2": (
        lambda m, x: F.relu((lambda z: torch.sigmoid(z) * z)(
            m.conv((x @ m.proj.weight.T + m.proj.bias).transpose(1, 2))[:, :, :x.shape[1]].transpose(1, 2))) ** 2,
        "x @ W.T + b → conv(K=4) → silu → relu² [B,T,D]"),
    "torch.matmul(x, W.t()), .mT, nn.SiLU, 1 + nn.ELU": (
        lambda m, x: 1 + m.elu(m.silu(_pad_conv(m, torch.matmul(x, m.proj.weight.t()).mT).mT)),
        "x @ W.transpose(0, 1) → conv(K=4) → silu → elu+1 [B,T,D]"),
    "permute(0, 2, 1), silu before the transpose back, exp(clamp)": (
        lambda m, x: torch.exp(torch.clamp(
            F.silu(_conv_slice(m, m.proj(x).permute(0, 2, 1))).permute(0, 2, 1), max=5.0)),
        "linear → conv(K=4) → silu → exp(min(·, 5)) [B,T,D]"),
    "transpose(-1, -2), slice [..., :-(K-1)], softplus": (
        lambda m, x: F.softplus(F.silu(m.conv(m.proj(x).transpose(-1, -2))[..., :-(K - 1)].transpose(-1, -2))),
        "linear → conv(K=4) → silu → φ = gt(x,20.0);exp(x);log1p(%1);where(%0,x,%2) [B,T,D]"),
    "heads by view, ELU+1 per head": (
        lambda m, x: F.elu(F.silu(_conv_slice(m, m.proj(x).transpose(1, 2)).transpose(1, 2))
                           .view(x.shape[0], x.shape[1], H, D // H)) + 1,
        "linear → conv(K=4) → silu → elu+1 [B,T,H,Dh]"),
    "heads by reshape(B, T, H, -1), an invented φ": (
        lambda m, x: (lambda z: torch.sigmoid(z) * z + 0.5 * z.square())(
            F.silu(_pad_conv(m, m.proj(x).transpose(1, 2)).transpose(1, 2)).reshape(*x.shape[:2], H, -1)),
        "linear → conv(K=4) → silu → φ = pow(x,2.0);mul(0.5,%0);sigmoid(x);mul(x,%2);add(%1,%3) [B,T,H,Dh]"),
    "heads by unflatten, z.relu().pow(2)": (
        lambda m, x: F.silu(_conv_slice(m, m.proj(x).transpose(1, 2)).transpose(1, 2))
        .unflatten(-1, (H, D // H)).relu().pow(2),
        "linear → conv(K=4) → silu → relu² [B,T,H,Dh]"),
    "heads split by view + transpose(1, 2), SiLU and ELU+1 after the split (probe r25)": (
        lambda m, x: F.elu(F.silu(_conv_slice(m, m.proj(x).transpose(1, 2)).transpose(1, 2)
                                  .view(x.shape[0], x.shape[1], H, D // H).transpose(1, 2))) + 1,
        "linear → conv(K=4) → silu → elu+1 [B,T,H,Dh]"),
    "heads split by view + permute(0, 2, 1, 3) after SiLU, then z * sigmoid(z) + 1": (
        lambda m, x: (lambda z: z * torch.sigmoid(z) + 1)(
            F.silu(_pad_conv(m, m.proj(x).transpose(1, 2)).transpose(1, 2))
            .view(x.shape[0], x.shape[1], H, D // H).permute(0, 2, 1, 3)),
        "linear → conv(K=4) → silu → φ = sigmoid(x);mul(x,%0);add(1.0,%1) [B,T,H,Dh]"),
    "heads moved by unflatten + movedim(2, 1), relu² after": (
        lambda m, x: F.relu(F.silu(_conv_slice(m, m.proj(x).transpose(1, 2)).transpose(1, 2))
                            .unflatten(-1, (H, D // H)).movedim(2, 1)) ** 2,
        "linear → conv(K=4) → silu → relu² [B,T,H,Dh]"),
    "heads by a helper, view + permute(0, 2, 1, 3).contiguous(), φ after it (probe r25 models)": (
        lambda m, x: F.elu(F.silu(_conv_slice(m, m.proj(x).transpose(1, 2)).transpose(1, 2))
                           .view(x.shape[0], x.shape[1], H, D // H).permute(0, 2, 1, 3).contiguous()) + 1,
        "linear → conv(K=4) → silu → elu+1 [B,T,H,Dh]"),
    "ELU+1 by hand with torch.where": (
        lambda m, x: (lambda a: torch.where(a > 0, a + 1, torch.exp(a)))(
            F.silu(_conv_slice(m, m.proj(x).transpose(1, 2)).transpose(1, 2))),
        "linear → conv(K=4) → silu → φ = gt(x,0.0);add(1.0,x);exp(x);where(%0,%1,%2) [B,T,D]"),
    "SiLU by hand z / (1 + exp(-z)), no φ": (
        lambda m, x: (lambda z: z / (1 + torch.exp(-z)))(_pad_conv(m, m.proj(x).transpose(1, 2)).transpose(1, 2)),
        "linear → conv(K=4) → φ = neg(x);exp(%0);add(1.0,%1);div(x,%2) [B,T,D]"),
    "gelu(tanh) after silu, z.sigmoid() * z method form": (
        lambda m, x: F.gelu((lambda z: z.sigmoid() * z)(
            _conv_slice(m, m.proj(x).transpose(1, 2)).transpose(1, 2)), approximate="tanh"),
        "linear → conv(K=4) → silu → φ = pow(x,3.0);mul(0.044715,%0);add(x,%1);mul(0.7978845608028654,%2);"
        "tanh(%3);add(1.0,%4);mul(0.5,x);mul(%5,%6) [B,T,D]"),
    "depthwise weight built from a [D, K] kernel with unsqueeze(1), squared-ReLU times a scale": (
        lambda m, x: 0.5 * F.relu(F.silu(F.conv1d(F.pad(F.linear(x, m.proj.weight).transpose(1, 2), (K - 1, 0)),
                                                  m.kernel.unsqueeze(1), groups=D).transpose(1, 2))) ** 2,
        "linear → conv(K=4) → silu → φ = relu(x);pow(%0,2.0);mul(0.5,%1) [B,T,D]"),
    "F.pad with explicit mode and value, leaky_relu φ": (
        lambda m, x: F.leaky_relu(F.silu(F.conv1d(F.pad(m.proj(x).transpose(1, 2), (K - 1, 0), mode="constant",
                                                        value=0.0), m.conv.weight, m.conv.bias, groups=D)
                                         .transpose(1, 2)), 0.1),
        "linear → conv(K=4) → silu → φ = gt(x,0.0);mul(0.1,x);where(%0,x,%1) [B,T,D]"),
    "an l_p-style φ: |a|^1.5 · sign(a) + a": (
        lambda m, x: (lambda a: a.abs() ** 1.5 * torch.sign(a) + a)(
            F.silu(_conv_slice(m, m.proj(x).transpose(1, 2)).transpose(1, 2))),
        "linear → conv(K=4) → silu → φ = abs(x);pow(%0,1.5);sign(x);mul(%1,%2);add(x,%3) [B,T,D]"),
    "hardswish, hardsigmoid and log-sigmoid in φ (probe r36: reported as not a φ)": (
        lambda m, x: (lambda z: F.hardswish(z) + F.hardsigmoid(z) - F.logsigmoid(z))(
            F.silu(_conv_slice(m, m.proj(x).transpose(1, 2)).transpose(1, 2))),
        "linear → conv(K=4) → silu → φ = le(x,-3.0);ge(x,3.0);add(3.0,x);div(%2,6.0);where(%1,1.0,%3);"
        "where(%0,0.0,%4);mul(x,%2);div(%6,6.0);where(%1,x,%7);where(%0,0.0,%8);add(%5,%9);lt(x,0.0);exp(x);"
        "log1p(%12);sub(x,%13);neg(x);exp(%15);log1p(%16);neg(%17);where(%11,%14,%18);sub(%10,%19) [B,T,D]"),
    "no projection, conv on the input, cosine features": (
        lambda m, x: torch.cos(F.silu(_pad_conv(m, torch.cat([x, x[..., :1]], -1).transpose(1, 2)).transpose(1, 2))),
        "conv(K=4) → silu → φ = cos(x) [B,T,D]"),
    "einsum projection, conv padding as a tuple, a Huber-like φ": (
        lambda m, x: (lambda a: torch.where(a.abs() < 1, 0.5 * a * a, a.abs() - 0.5))(F.silu(F.conv1d(
            torch.einsum("btd,ed->bte", x, m.proj.weight).transpose(1, 2), m.conv.weight, m.conv.bias,
            padding=(K - 1,), groups=D)[..., :x.shape[1]].transpose(1, 2))),
        "x @ W.permute(1, 0) → conv(K=4) → silu → φ = abs(x);lt(%0,1.0);mul(0.5,x);mul(x,%2);add(-0.5,%0);where(%1,%3,%4) "
        "[B,T,D]"),
    "narrow for the causal slice": (
        lambda m, x: F.elu(F.silu(m.conv(m.proj(x).transpose(1, 2)).narrow(2, 0, x.shape[1]).transpose(1, 2))) + 1,
        "linear → conv(K=4) → silu → elu+1 [B,T,D]"),
    "x[:, :, None]-style weight: kernel[:, None, :]": (
        lambda m, x: F.relu(F.silu(F.conv1d(F.pad(m.proj(x).transpose(1, 2), (K - 1, 0)), m.kernel[:, None, :],
                                            groups=D).transpose(1, 2))),
        "linear → conv(K=4) → silu → relu [B,T,D]"),
    ".contiguous() between stages": (
        lambda m, x: F.elu(F.silu(_conv_slice(m, m.proj(x).transpose(1, 2).contiguous()).transpose(1, 2)
                                  .contiguous())) + 1,
        "linear → conv(K=4) → silu → elu+1 [B,T,D]"),
    # the projection as an einsum in any index layout, the layouts of the conv's padding and slicing, a conv2d
    # over one row: one normal form (hecate.compiler.normalize)
    "einsum('btd,ed->bet') straight to channels first, a rational φ": (
        lambda m, x: (lambda a: a / (1 + a.abs()))(F.silu(
            m.conv(torch.einsum("btd,ed->bet", x, m.proj.weight))[..., :x.shape[1]].transpose(1, 2))),
        "x @ W.permute(1, 0) → conv(K=4) → silu → φ = abs(x);add(1.0,%0);div(x,%1) [B,T,D]"),
    "einsum('ed,btd->bet'), weight first, F.pad then conv1d": (
        lambda m, x: F.elu(F.silu(F.conv1d(F.pad(torch.einsum("ed,btd->bet", m.proj.weight, x), (K - 1, 0)),
                                           m.conv.weight, m.conv.bias, groups=D).mT)) + 1,
        "x @ W.permute(1, 0) → conv(K=4) → silu → elu+1 [B,T,D]"),
    "einsum('btd,de->bet') with W.T, nn.Conv1d(bias=False)": (
        lambda m, x: F.relu(F.silu(m.conv_no_bias(torch.einsum("btd,de->bet", x, m.proj.weight.T))[..., :x.shape[1]]
                                   .transpose(1, 2))),
        "x @ W.T → conv(K=4) → silu → relu [B,T,D]"),
    "slice after transposing back: [:, :T]": (
        lambda m, x: F.elu(F.silu(F.conv1d(m.proj(x).transpose(1, 2), m.conv.weight, m.conv.bias, padding=K - 1,
                                           groups=D).transpose(1, 2)[:, :x.shape[1]])) + 1,
        "linear → conv(K=4) → silu → elu+1 [B,T,D]"),
    "slice after transposing back: [:, :-(K-1)], x * torch.sigmoid(x)": (
        lambda m, x: (lambda a: a * torch.sigmoid(a))(m.conv(m.proj(x).transpose(1, 2)).transpose(1, 2)[:, :-(K - 1)]),
        "linear → conv(K=4) → silu [B,T,D]"),
    "narrow after permuting back, nn.Conv1d(bias=False)": (
        lambda m, x: F.silu(m.conv_no_bias(m.proj(x).permute(0, 2, 1)).permute(0, 2, 1).narrow(1, 0, x.shape[1])) ** 2,
        "linear → conv(K=4) → silu → φ = pow(x,2.0) [B,T,D]"),
    "F.pad(h, (0, 0, K-1, 0)) on [B, T, D] before transposing": (
        lambda m, x: F.elu(F.silu(F.conv1d(F.pad(m.proj(x), (0, 0, K - 1, 0)).transpose(1, 2), m.conv.weight,
                                           m.conv.bias, groups=D).transpose(1, 2))) + 1,
        "linear → conv(K=4) → silu → elu+1 [B,T,D]"),
    "conv2d over one row with a (1, K) kernel, an invented φ": (
        lambda m, x: (lambda a: torch.log1p(a * a) + 0.1 * a)(F.silu(F.conv2d(
            m.proj(x).transpose(1, 2).unsqueeze(2), m.conv.weight.unsqueeze(2), m.conv.bias, padding=(0, K - 1),
            groups=D).squeeze(2)[..., :x.shape[1]].transpose(1, 2))),
        "linear → conv(K=4) → silu → φ = pow(x,2.0);log1p(%0);mul(0.1,x);add(%1,%2) [B,T,D]"),
    "conv2d over one row, F.pad on [B, T, D] first, x * sigmoid(x) before transposing back": (
        lambda m, x: F.relu((lambda a: a * torch.sigmoid(a))(F.conv2d(
            F.pad(x @ m.proj.weight.T + m.proj.bias, (0, 0, K - 1, 0)).transpose(1, 2)[:, :, None],
            m.kernel[:, None, None, :], groups=D)[:, :, 0]).transpose(1, 2)),
        "x @ W.T + b → conv(K=4) → silu → relu [B,T,D]"),
    # a causal conv written by hand: the normal form reads it as F.conv1d(F.pad(h, (K-1, 0)), W, groups=D)
    "by hand: sum(w[:, k] · F.pad(h, (K-1, 0))[..., k:k+T])": (
        lambda m, x: F.silu(sum(m.kernel[:, k, None] * F.pad(m.proj(x).transpose(1, 2), (K - 1, 0))[..., k:k + x.shape[1]]
                                for k in range(K)).transpose(1, 2)),
        "linear → conv(K=4) → silu [B,T,D]"),
    "by hand: F.pad(h, (K-1, 0)).unfold(-1, K, 1), weighted and summed": (
        lambda m, x: F.silu((F.pad(m.proj(x).transpose(1, 2), (K - 1, 0)).unfold(-1, K, 1) * m.kernel[:, None, :])
                            .sum(-1).transpose(1, 2)),
        "linear → conv(K=4) → silu [B,T,D]"),
    "by hand: F.pad(h, (K-1, 0)).unfold(-1, K, 1) weighted by einsum('bctk,ck->bct', ·, w), + bias": (
        lambda m, x: F.silu((torch.einsum("bctk,ck->bct", F.pad(m.proj(x).transpose(1, 2), (K - 1, 0)).unfold(-1, K, 1),
                                          m.kernel) + m.conv.bias[:, None]).transpose(1, 2)),
        "linear → conv(K=4) → silu [B,T,D]"),
    "by hand channels last: the unfold windows weighted by einsum('btck,kc->btc', ·, w.T), taps first": (
        lambda m, x: F.silu(torch.einsum("btck,kc->btc", F.pad(m.proj(x), (0, 0, K - 1, 0)).unfold(1, K, 1),
                                         m.kernel.T)),
        "linear → conv(K=4) → silu [B,T,D]"),
    "by hand channels last: F.pad(h, (0, 0, K-1, 0)).unfold(1, K, 1) weighted by einsum('btck,ck->btc', ·, w)": (
        lambda m, x: F.silu(torch.einsum("btck,ck->btc", F.pad(m.proj(x), (0, 0, K - 1, 0)).unfold(1, K, 1),
                                         m.kernel)),
        "linear → conv(K=4) → silu [B,T,D]"),
    "by hand: the windows summed in pairs, nn.Conv1d's own weight, + bias after, exp(clamp)": (
        lambda m, x: torch.exp(torch.clamp(F.silu(_hand_conv_in_pairs(m, m.proj(x).transpose(1, 2))).transpose(1, 2),
                                           max=5.0)),
        "linear → conv(K=4) → silu → exp(min(·, 5)) [B,T,D]"),
    "by hand channels last: sum(F.pad(h, (0, 0, K-1, 0))[:, k:k+T] * w[:, k]) on [B, T, D], relu": (
        lambda m, x: F.relu(F.silu(sum(F.pad(m.proj(x), (0, 0, K - 1, 0))[:, k:k + x.shape[1]] * m.kernel[:, k]
                                       for k in range(K)))),
        "linear → conv(K=4) → silu → relu [B,T,D]"),
    "by hand channels last: F.pad(h, (0, 0, K-1, 0)).unfold(1, K, 1) * w [D, K], summed, + bias": (
        lambda m, x: F.silu((F.pad(m.proj(x), (0, 0, K - 1, 0)).unfold(1, K, 1) * m.kernel).sum(-1) + m.conv.bias),
        "linear → conv(K=4) → silu [B,T,D]"),
    "h.view(B, T, D) (nothing reshaped), swapaxes(1, 2), movedim(1, -1) back": (
        lambda m, x: F.silu(_conv_slice(m, m.proj(x).view(x.shape[0], x.shape[1], D).swapaxes(1, 2)).movedim(1, -1)),
        "linear → conv(K=4) → silu [B,T,D]"),
    "permute then reshape to the same [B, D, T], movedim(-1, 1) in, swapdims back": (
        lambda m, x: F.silu(_pad_conv(m, m.proj(x).movedim(-1, 1).reshape(x.shape[0], D, x.shape[1]))
                            .swapdims(-1, -2)),
        "linear → conv(K=4) → silu [B,T,D]"),
    "conv2d over one row padded before it: F.conv2d(F.pad(u[:, :, None], (K-1, 0)), w[D, 1, 1, K])": (
        lambda m, x: F.silu(F.conv2d(F.pad(m.proj(x).transpose(1, 2).unsqueeze(2), (K - 1, 0)),
                                     m.kernel[:, None, None, :], groups=D).squeeze(2).transpose(1, 2)),
        "linear → conv(K=4) → silu [B,T,D]"),
    "conv2d over one row with padding (0, K-1), the row's first T outputs kept": (
        lambda m, x: F.silu(F.conv2d(m.proj(x).transpose(1, 2).unsqueeze(2), m.kernel[:, None, None, :],
                                     padding=(0, K - 1), groups=D)[..., :x.shape[1]].squeeze(2).transpose(1, 2)),
        "linear → conv(K=4) → silu [B,T,D]"),
    "by hand from the bias: z = b[:, None].expand(-1, T), then z + w[:, k:k+1] · window in a loop": (
        lambda m, x: F.silu(_windows_from_the_bias(m, m.proj(x).transpose(1, 2)).transpose(1, 2)),
        "linear → conv(K=4) → silu [B,T,D]"),
    "by hand, shift-and-add: each tap its own F.pad(h, (0, 0, i, 0))[:, :T]": (
        lambda m, x: F.silu(_shifted_copies(m, m.proj(x))), "linear → conv(K=4) → silu [B,T,D]"),
    "by hand, shift-and-add: each tap's copy F.pad(u[..., :-i], (i, 0)) after the transpose": (
        lambda m, x: F.silu(_pads_of_slices(m, m.proj(x).transpose(1, 2))).transpose(1, 2),
        "linear → conv(K=4) → silu [B,T,D]"),
    "by hand, shift-and-add: each tap's copy torch.cat([zeros, h[:, :-i]], 1)": (
        lambda m, x: F.silu(_cats_of_zeros(m, m.proj(x))), "linear → conv(K=4) → silu [B,T,D]"),
    "by hand, torch.where(t < i, zeros_like(h), torch.roll(h, i, 1))": (
        lambda m, x: F.silu(_rolled_copies_by_where_of_zeros(m, m.proj(x))), "linear → conv(K=4) → silu [B,T,D]"),
    "by hand, torch.where(t >= i, torch.roll(h, i, 1), 0)": (
        lambda m, x: F.silu(_rolled_copies_kept_by_where(m, m.proj(x))), "linear → conv(K=4) → silu [B,T,D]"),
    "channels first by a head split moved and merged back: view(B, T, H, Dh).permute(0, 2, 3, 1).reshape(B, D, T)": (
        lambda m, x: F.silu(_pad_conv(m, m.proj(x).view(*x.shape[:2], H, D // H).permute(0, 2, 3, 1)
                                      .reshape(x.shape[0], D, x.shape[1])).transpose(1, 2)),
        "linear → conv(K=4) → silu [B,T,D]"),
    "a per-channel gain g[:, None] on [B, D, T], then SiLU, kept channels first": (
        lambda m, x: F.silu(_pad_conv(m, m.proj(x).transpose(1, 2)) * m.phase[:D, None]).transpose(1, 2),
        "linear → conv(K=4) [B,D,T], the op's [B,T,D] transposed; read by aten.mul.Tensor, left to the fallback (not "
        "a φ the op fuses)"),
    "by hand, the K windows of one pad stacked on a last dim and weighted by einsum('bdtk,dk->bdt')": (
        lambda m, x: F.silu(_stacked_windows(m, m.proj(x).transpose(1, 2))).transpose(1, 2),
        "linear → conv(K=4) → silu [B,T,D]"),
    "by hand, the windows stacked on dim 1, F.pad written per window, read by einsum('bkdt,dk->bdt')": (
        lambda m, x: F.silu(_windows_stacked_in_front(m, m.proj(x).transpose(1, 2))).transpose(1, 2),
        "linear → conv(K=4) → silu [B,T,D]"),
    "by hand channels last from zeros: z = zeros_like(h), then z + w[:, k] · window in a loop": (
        lambda m, x: F.silu(_windows_from_zeros(m, m.proj(x))),
        "linear → conv(K=4) → silu [B,T,D]"),
    "a gain before SiLU (z * 2.0): SiLU of the scaled z, not SiLU, generated into φ": (
        lambda m, x: F.silu(_conv_slice(m, m.proj(x).transpose(1, 2)).transpose(1, 2) * 2.0),
        "linear → conv(K=4) → φ = mul(2.0,x);sigmoid(%0);mul(%0,%1) [B,T,D]"),
    "F.silu(inplace=True) on the transposed conv output, relu": (
        lambda m, x: F.relu(F.silu(_conv_slice(m, m.proj(x).transpose(1, 2)).transpose(1, 2), inplace=True)),
        "linear → conv(K=4) → silu → relu [B,T,D]"),
    "nn.SiLU(inplace=True) before the transpose back, ELU+1": (
        lambda m, x: F.elu(nn.SiLU(inplace=True)(_conv_slice(m, m.proj(x).transpose(1, 2))).transpose(1, 2)) + 1,
        "linear → conv(K=4) → silu → elu+1 [B,T,D]"),
    "F.dropout(training=False) between every stage": (
        lambda m, x: F.relu(F.silu(F.dropout(_conv_slice(m, F.dropout(m.proj(x), 0.1, training=False)
                                                      .transpose(1, 2)).transpose(1, 2), 0.1, training=False))),
        "linear → conv(K=4) → silu → relu [B,T,D]"),
    "by hand channels last, padded by torch.cat with zeros before": (
        lambda m, x: F.elu(F.silu(_windows_of_cat_zeros(m, m.proj(x)))) + 1,
        "linear → conv(K=4) → silu → elu+1 [B,T,D]"),
    "F.conv1d over torch.cat([h.new_zeros(B, D, K-1), h], -1) (a zero state joined in front)": (
        lambda m, x: F.silu(F.conv1d(torch.cat([(u := m.proj(x).transpose(1, 2)).new_zeros(x.shape[0], D, K - 1), u],
                                               -1), m.conv.weight, m.conv.bias, groups=D).transpose(1, 2)),
        "linear → conv(K=4) → silu [B,T,D]"),
    "F.dropout(p=0.0) in training between the projection and the conv (an identity)": (
        lambda m, x: F.relu(F.silu(_conv_slice(m, F.dropout(m.proj(x), 0.0, training=True).transpose(1, 2)))
                            .transpose(1, 2)),
        "linear → conv(K=4) → silu → relu [B,T,D]"),
    "FAVOR+ φ written with 0.5 * (z ** 2).sum(-1) and the weight by F.linear": (
        lambda m, x: (lambda z: torch.exp(F.linear(z, m.omega) - 0.5 * (z ** 2).sum(-1, keepdim=True)) / math.sqrt(8))(
            F.silu(_conv_slice(m, m.proj(x).transpose(1, 2))).transpose(1, 2)),
        "linear → conv(K=4) → silu → Performer φ(d_phi=8) [B,T,D]"),
    "FAVOR+ φ written with ‖z‖ = z.norm(dim=-1) squared": (
        lambda m, x: (lambda z: torch.exp(z @ m.omega.T - z.norm(dim=-1, keepdim=True) ** 2 / 2) * 8 ** -0.5)(
            F.silu(_conv_slice(m, m.proj(x).transpose(1, 2))).transpose(1, 2)),
        "linear → conv(K=4) → silu → Performer φ(d_phi=8) [B,T,D]"),
    "random Fourier φ written cos(z Wᵀ + b) · (2 / d_phi) ** 0.5 by einsum": (
        lambda m, x: (lambda z: torch.cos(torch.einsum("btd,fd->btf", z, m.omega) + m.phase) * (2 / 8) ** 0.5)(
            F.silu(_conv_slice(m, m.proj(x).transpose(1, 2))).transpose(1, 2)),
        "linear → conv(K=4) → silu → random Fourier φ(d_phi=8) [B,T,D]"),
    "sequence first: [T, B, D] projected, permute(1, 2, 0) into the conv, permute(2, 0, 1) back": (
        lambda m, x: F.elu(F.silu(_pad_conv(m, m.proj(x.transpose(0, 1)).permute(1, 2, 0))).permute(2, 0, 1)) + 1,
        "linear → conv(K=4) → silu → elu+1 [B,T,D]"),
    "sequence first: x @ W.T + b on [T, B, D], transpose(0, 1) then transpose(1, 2), relu before permuting back": (
        lambda m, x: F.relu(F.silu(_conv_slice(m, (x.transpose(0, 1) @ m.proj.weight.T + m.proj.bias)
                                                .transpose(0, 1).transpose(1, 2)))).permute(2, 0, 1),
        "x @ W.T + b → conv(K=4) → silu → relu [B,T,D]"),
}


def _hand_conv_in_pairs(m, h):
    """Σ_k W[:, 0, k] h_padded[..., k:k+T] with the terms added two by two, last window first, then the bias."""
    p, t = F.pad(h, (K - 1, 0)), h.shape[-1]
    terms = [p[:, :, k:k + t] * m.conv.weight[:, :, k] for k in reversed(range(K))]
    return (terms[0] + terms[1]) + (terms[2] + terms[3]) + m.conv.bias[:, None]


def _fuses_and_matches_eager(model, args, detail, input_names):
    """Compile ``model``: one qk_preprocess fusion described as ``detail``, no near-miss, and the output
    and every gradient (inputs and parameters) equal to eager within TOL."""
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="hecate", options={"fallback": "eager"})
    inputs = [a.clone().requires_grad_() for a in args]
    ref_inputs = [a.clone().requires_grad_() for a in args]
    got = compiled(*inputs)
    report = hecate.last_report()
    assert [f.detail for f in report.fusions if f.pattern == "qk_preprocess"] == [detail], str(report)
    assert report.misses == [], str(report)
    weight = torch.randn_like(got)
    (got * weight).sum().backward()
    got_grads = {n: p.grad for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    ref = model(*ref_inputs)
    (ref * weight).sum().backward()
    assert_close("output", got, ref, TOL)
    for name, a, r in zip(input_names, inputs, ref_inputs):
        assert_close(f"d/d{name}", a.grad, r.grad, TOL)
    for n, p in model.named_parameters():
        if p.grad is None:
            assert got_grads[n] is None, n
        else:
            assert_close(f"d/d{n}", got_grads[n], p.grad, TOL)
    torch._dynamo.reset()


@pytest.mark.parametrize("name", list(SPELLINGS))
def test_spelling_fuses_and_matches_eager(name):
    spelling, detail = SPELLINGS[name]
    _fuses_and_matches_eager(Block(spelling), (torch.randn(B, T, D_IN),), detail, ("x",))

class _Preprocess(nn.Module):  # Linear → causal conv → SiLU → ReLU, [B, T, C] in and out
    def __init__(self, c):
        super().__init__()
        self.lin = nn.Linear(c, c, bias=False)
        self.conv = nn.Conv1d(c, c, K, groups=c, padding=K - 1)

    def forward(self, x):
        return F.relu(F.silu(self.conv(self.lin(x).transpose(1, 2))[..., :x.shape[1]])).transpose(1, 2)


def test_two_preprocessing_modules_stacked_both_fuse(fresh_dynamo):
    """b(a(x)): the second chain projects the first one's output (probe r36: replacing the first chain erased the
    output the second one's match read, an internal error, nothing fused)."""
    model = nn.Sequential(_Preprocess(D), _Preprocess(D))
    x = torch.randn(B, T, D)
    inputs, ref_inputs = [x.clone().requires_grad_()], [x.clone().requires_grad_()]
    got = torch.compile(model, backend="hecate", options={"fallback": "eager"})(*inputs)
    report = hecate.last_report()
    assert report.count("qk_preprocess") == 2 and not report.misses, str(report)
    params = list(model.parameters())
    assert_outputs_and_gradients_close(got, model(*ref_inputs), inputs + params, ref_inputs + params, TOL)


def _stacked_chains(x, w1, c1, b1, w2, c2, b2):  # no φ: the next chain's x @ W.T is also a matrix φ of the first
    def chain(h, w, c, b):
        u = F.conv1d((h @ w.T).transpose(1, 2), c, b, padding=K - 1, groups=D)[..., :h.shape[1]]
        return F.silu(u).transpose(1, 2)
    return chain(chain(x, w1, c1, b1), w2, c2, b2)


def test_a_chain_whose_projection_is_the_matrix_phi_of_the_one_before_fuses_as_its_own(fresh_dynamo):
    """silu(..) @ W2.T both ends the first chain (a matrix φ) and starts the second (its projection): the first
    keeps it as its φ, the second reads the product as its input (probe r36: both claimed it, an internal error)."""
    args = [torch.randn(B, T, D)] + [torch.randn(D, D) / D ** 0.5, torch.randn(D, 1, K), torch.randn(D)] * 2
    inputs, ref_inputs = ([a.clone().requires_grad_() for a in args] for _ in range(2))
    got = torch.compile(_stacked_chains, backend="hecate", options={"fallback": "eager"})(*inputs)
    report = hecate.last_report()
    assert report.count("qk_preprocess") == 2 and not report.misses, str(report)
    assert sorted(f.detail.split(" → ")[0] for f in report.fusions) == ["conv(K=4)", "x @ W.T"], str(report)
    assert_outputs_and_gradients_close(got, _stacked_chains(*ref_inputs), inputs, ref_inputs, TOL)


SHIFTED_COPIES = ["by hand, shift-and-add: each tap's copy F.pad(u[..., :-i], (i, 0)) after the transpose",
                  "by hand, shift-and-add: each tap's copy torch.cat([zeros, h[:, :-i]], 1)",
                  "by hand, torch.where(t >= i, torch.roll(h, i, 1), 0)"]


@pytest.mark.parametrize("name", SHIFTED_COPIES)
def test_copies_shifted_by_hand_fuse_at_two_lengths_under_dynamic_shapes(name, fresh_dynamo):
    """Each copy is recognised by its values as h shifted with zeros in front, at the example's length and at
    another (probe r23: these spellings were neither fused nor reported); one graph serves both lengths."""
    model = Block(SPELLINGS[name][0])
    compiled = torch.compile(model, backend="hecate", dynamic=True, options={"fallback": "eager"})
    for length in (T, T + 4):
        x = torch.randn(B, length, D_IN)
        assert_close(f"output at T = {length}", compiled(x), model(x), TOL)
        assert hecate.last_report().count("qk_preprocess") == 1, str(hecate.last_report())


HEADS_SPLIT_FIRST = ["heads split by view + transpose(1, 2), SiLU and ELU+1 after the split (probe r25)",
                     "heads split by view + permute(0, 2, 1, 3) after SiLU, then z * sigmoid(z) + 1",
                     "heads moved by unflatten + movedim(2, 1), relu² after",
                     "heads by a helper, view + permute(0, 2, 1, 3).contiguous(), φ after it (probe r25 models)"]


@pytest.mark.parametrize("name", HEADS_SPLIT_FIRST)
def test_pointwise_after_a_head_split_fuses_at_two_sizes_under_dynamic_shapes(name, fresh_dynamo):
    """SiLU and φ after the heads are moved by a permute are computed before it in the normal form, with the sizes
    symbolic too (probe r25: the shapes compared as a set of SymInts crashed the compile)."""
    model = Block(SPELLINGS[name][0])
    compiled = torch.compile(model, backend="hecate", dynamic=True, options={"fallback": "eager", "strict": True})
    for batch, length in ((B, T), (B + 1, T + 4)):
        x = torch.randn(batch, length, D_IN)
        assert_close(f"output at B = {batch}, T = {length}", compiled(x), model(x), TOL)
        report = hecate.last_report()
        assert [f.detail for f in report.fusions] == [SPELLINGS[name][1]], str(report)


def _conv_with_sizes_read_from_tensors(x, w, conv_weight):  # groups and the left pad read off the tensors
    h = (x @ w.T).transpose(1, 2)
    return F.silu(F.conv1d(F.pad(h, (conv_weight.shape[-1] - 1, 0)), conv_weight, groups=h.shape[1])).transpose(1, 2)


def test_a_conv_whose_groups_and_pad_are_read_off_its_tensors_fuses_under_dynamic_shapes(fresh_dynamo):
    """``groups=h.shape[1]``, ``F.pad(h, (w.shape[-1] - 1, 0))``: under dynamic=True these are sizes of the graph
    (nodes), equal to the channels and K − 1 for every size; they were compared as numbers and reported with
    reasons that contradict themselves ("groups=s55 … needs groups = channels = s55", probe r30)."""
    compiled = torch.compile(_conv_with_sizes_read_from_tensors, backend="hecate", dynamic=True,
                             options={"fallback": "eager", "strict": True})
    for batch, length, d, k in ((B, T, D, K), (B + 1, T + 3, D + 2, K - 1)):
        args = [torch.randn(batch, length, D_IN), torch.randn(d, D_IN), torch.randn(d, 1, k)]
        args = [a.requires_grad_() for a in args]
        ref_args = [a.detach().clone().requires_grad_() for a in args]
        assert_outputs_and_gradients_close(compiled(*args), _conv_with_sizes_read_from_tensors(*ref_args), args,
                                           ref_args, TOL)
        assert hecate.last_report().count("qk_preprocess") == 1, str(hecate.last_report())


def test_corpus_size():
    assert len(SPELLINGS) >= 45


def test_hand_written_conv_keeps_the_dtype_of_its_zeros_and_reads_its_input_before_a_write():
    """Summed from float64 zeros the sum is float64 (the conv was float32); the input zeroed in place after the
    windows are taken is not padded again where the sum is (the conv read the zeros); summed into zeros of a
    larger shape it keeps that shape (the conv returned the windows' shape)."""
    def from_float64_zeros(h, w):
        p, out = F.pad(h, (0, 0, K - 1, 0)), torch.zeros_like(h, dtype=torch.float64)
        for k in range(K):
            out = out + w[:, k] * p[:, k:k + h.shape[1]]
        return out

    def input_zeroed_after_the_windows(x, w):
        h = x * 2
        p = F.pad(h, (0, 0, K - 1, 0))
        h.zero_()
        return sum(w[:, k] * p[:, k:k + x.shape[1]] for k in range(K)) + h

    def into_bigger_zeros(h, w):  # the sum broadcast into zeros of a larger shape: no conv's output
        p, out = F.pad(h, (0, 0, K - 1, 0)), torch.zeros(2, *h.shape)
        for k in range(K):
            out = out + w[:, k] * p[:, k:k + h.shape[1]]
        return out

    for fn in (from_float64_zeros, input_zeroed_after_the_windows, into_bigger_zeros):
        torch._dynamo.reset()
        x, w = torch.randn(B, T, D), torch.randn(D, K)
        got, ref = torch.compile(fn, backend="hecate", options={"fallback": "eager"})(x, w), fn(x, w)
        assert got.dtype == ref.dtype and got.shape == ref.shape
        assert_close(fn.__name__, got, ref, TOL)
    torch._dynamo.reset()


# ---------------------------------------------------------------- what is not a causal conv, or is not read as one

# name: (forward, the reason reported)
NOT_FUSED = {
    "nn.Conv1d(padding_mode='circular') then [..., :T]": (
        lambda m, x: F.silu(m.circular(m.proj(x).transpose(1, 2))[..., :x.shape[1]].transpose(1, 2)),
        "conv1d input is padded with F.pad mode='circular' (as nn.Conv1d padding_mode='circular' pads), which wraps "
        "the sequence around (the first outputs read the last tokens): not a causal zero-padded conv"),
    "nn.Conv1d(padding_mode='replicate') then [..., :T]": (
        lambda m, x: F.silu(m.replicate(m.proj(x).transpose(1, 2))[..., :x.shape[1]].transpose(1, 2)),
        "F.pad mode='replicate' (as nn.Conv1d padding_mode='replicate' pads), which repeats the edge tokens: not a "
        "causal zero-padded conv"),
    "F.pad(..., (K-1, 0), mode='replicate') then conv1d": (
        lambda m, x: F.silu(F.conv1d(F.pad(m.proj(x).transpose(1, 2), (K - 1, 0), mode="replicate"), m.conv.weight,
                                     m.conv.bias, groups=D).transpose(1, 2)),
        "F.pad mode='replicate' (as nn.Conv1d padding_mode='replicate' pads), which repeats the edge tokens"),
    "F.pad(..., (K-1, 0), mode='reflect') then conv1d": (
        lambda m, x: F.silu(F.conv1d(F.pad(m.proj(x).transpose(1, 2), (K - 1, 0), mode="reflect"), m.conv.weight,
                                     m.conv.bias, groups=D).transpose(1, 2)),
        "F.pad mode='reflect' (as nn.Conv1d padding_mode='reflect' pads), which mirrors the tokens next to the "
        "edges (the first outputs read future tokens)"),
    "F.pad(..., (K-1, 0), value=1.0) then conv1d": (
        lambda m, x: F.silu(F.conv1d(F.pad(m.proj(x).transpose(1, 2), (K - 1, 0), value=1.0), m.conv.weight,
                                     m.conv.bias, groups=D).transpose(1, 2)),
        "conv1d input is padded with F.pad value=1.0, not zeros: not a causal zero-padded conv"),
    "by hand, centred: F.pad(h, (1, K-2)) read through its K windows": (
        lambda m, x: F.silu(sum(m.kernel[:, k, None] * F.pad(m.proj(x).transpose(1, 2), (1, K - 2))[..., k:k + x.shape[1]]
                                for k in range(K)).transpose(1, 2)),
        "a conv written by hand over a tensor zero-padded (1, 2) on its last dim, read through its shifted windows "
        "(slices [..., k:k+T] for k in [0, 1, 2, 3]), not fused: padded after, its output at t reads positions up "
        "to t + 2, so it is not causal"),
    "by hand channels last, padded after: F.pad(h, (0, 0, 0, K-1)).unfold(1, K, 1)": (
        lambda m, x: F.silu((F.pad(m.proj(x), (0, 0, 0, K - 1)).unfold(1, K, 1) * m.kernel).sum(-1)),
        "a conv written by hand over a tensor zero-padded (0, 3) on dim 1, read through its shifted windows "
        "(unfold(1, 4, 1)), not fused: padded after, its output at t reads positions up to t + 3, so it is not "
        "causal"),
    "SiLU's gate detached, sigmoid(z).detach() * z (a straight-through SiLU)": (
        lambda m, x: (lambda z: F.elu(torch.sigmoid(z).detach() * z) + 1)(
            _conv_slice(m, m.proj(x).transpose(1, 2)).transpose(1, 2)),
        "gradients stop inside it"),
    "by hand, the windows weighted by the data (not one kernel)": (
        lambda m, x: F.silu(sum(F.pad(h, (K - 1, 0))[..., k:k + x.shape[1]] * h[:, :, :1]
                                for h in [m.proj(x).transpose(1, 2)] for k in range(K)).transpose(1, 2)),
        "a causal conv of kernel 4 written by hand (a tensor zero-padded (3, 0) on its last dim, read through its 4 "
        "shifted windows by slices [..., k:k+T] for k in [0, 1, 2, 3]) not fused: it reads as a conv when the windows are "
        "weighted one value per channel"),
    "by hand channels last over F.pad(h, (0, 0, K-1, 0), value=1.0)": (
        lambda m, x: F.silu(sum(m.kernel[:, k] * F.pad(m.proj(x), (0, 0, K - 1, 0), value=1.0)[:, k:k + x.shape[1]]
                                for k in range(K))),
        "a conv written by hand over a tensor padded (3, 0) with F.pad value=1.0, read through its shifted windows "
        "(slices [:, k:k+T] for k in [0, 1, 2, 3]), not fused: a causal conv pads with zeros"),
    "by hand, padded by torch.cat with ones (not zeros)": (
        lambda m, x: F.silu(sum(m.kernel[:, k] * torch.cat([torch.ones(x.shape[0], K - 1, D), m.proj(x)], 1)
                                [:, k:k + x.shape[1]] for k in range(K))),
        "a conv written by hand over a tensor padded (3, 0) with torch.cat with torch.ones, read through its shifted "
        "windows (slices [:, k:k+T] for k in [0, 1, 2, 3]), not fused: a causal conv pads with zeros"),
    "by hand, padded by torch.cat with zeros and ones": (
        lambda m, x: F.silu(sum(m.kernel[:, k] * torch.cat([torch.zeros(x.shape[0], 1, D), torch.ones(x.shape[0], K - 2, D),
                                                            m.proj(x)], 1)[:, k:k + x.shape[1]] for k in range(K))),
        "padded (3, 0) with torch.cat with torch.zeros, torch.ones"),
    "by hand over torch.cat([state, h]) (a carried state in front)": (
        lambda m, x: F.silu(sum(m.kernel[:, k] * torch.cat([m.proj(x[:, :K - 1]) * 0.5, m.proj(x)], 1)[:, k:k + x.shape[1]]
                                for k in range(K))),
        "qk_preprocess takes a carried state as F.conv1d(torch.cat([state, x], -1), w, groups=D)"),
    "by hand, one copy scaled before its weight, 2 · F.pad(u[..., :-1], (1, 0)) · w": (
        lambda m, x: F.silu(_a_copy_scaled_before_its_weight(m, m.proj(x).transpose(1, 2))).transpose(1, 2),
        "(copies shifted by [1, 2, 3] on dim 2, each its own shift) not fused"),
    "by hand, torch.roll(h, i, 1) with the wrapped tokens zeroed by a product with a mask": (
        lambda m, x: F.silu(_rolled_copies(m, m.proj(x))),
        "(torch.roll by [1, 2, 3] on dim 1, each its own shift) not fused: qk_preprocess reads a causal conv as "
        "copies shifted with zeros in front (F.pad and slices, torch.cat of zeros, torch.where of a roll), or "
        "F.conv1d (torch.roll then a product with a 0/1 mask is NaN where an inf or NaN wraps around"),
}


@pytest.mark.parametrize("name", list(NOT_FUSED))
def test_not_a_causal_conv_or_not_read_as_one_is_reported_and_matches_eager(name):
    spelling, reason = NOT_FUSED[name]
    model = Block(spelling)
    model.circular = nn.Conv1d(D, D, K, groups=D, padding=K - 1, padding_mode="circular")
    model.replicate = nn.Conv1d(D, D, K, groups=D, padding=K - 1, padding_mode="replicate")
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="hecate", options={"fallback": "eager"})
    x = torch.randn(B, T, D_IN)
    got = compiled(x)
    report = hecate.last_report()
    assert report.fusions == [], str(report)
    assert [m.pattern for m in report.misses] == ["qk_preprocess"], str(report)
    assert reason in report.misses[0].reason, report.misses[0].reason
    assert_close("output", got, model(x), TOL)
    torch._dynamo.reset()


# ---------------------------------------------------------------- with a carried conv state

class StatefulBlock(Block):
    """``spelling(self, x, state)``: x [B, T, D_in] (or a decode step's x_t [B, D_in]) after the conv's state
    [B, K−1, D], the K−1 projected inputs before it. ``taps`` is a depthwise kernel kept as [K, D]."""

    def __init__(self, spelling):
        super().__init__(spelling)
        self.taps = nn.Parameter(torch.randn(K, D) * 0.5)

    def forward(self, x, state):
        return self.spelling(self, x, state)


def _window(m, x_t, state):     # [B, K, D]: the K−1 carried inputs, then the projected token
    return torch.cat([state, m.proj(x_t).unsqueeze(1)], dim=1)


# name: (forward, whether it is a one-token decode step, the fusion's detail)
STATEFUL_SPELLINGS = {
    "F.conv1d over cat([state.transpose, u], -1)": (
        lambda m, x, s: F.silu(F.conv1d(torch.cat([s.transpose(1, 2), m.proj(x).transpose(1, 2)], -1),
                                        m.conv.weight, m.conv.bias, groups=D).transpose(1, 2)),
        False, "linear → conv(K=4, carried state) → silu [B,T,D]"),
    "nn.Conv1d(padding=K-1) over cat([state.mT, u]), x's outputs [K-1:-(K-1)]": (
        lambda m, x, s: F.elu(F.silu(m.conv(torch.cat([s.mT, m.proj(x).mT], 2))[..., K - 1:-(K - 1)].mT)) + 1,
        False, "linear → conv(K=4, carried state) → silu → elu+1 [B,T,D]"),
    "cat([state, u], 1) on [B, T, D], then the transpose and a conv without padding": (
        lambda m, x, s: F.silu(F.conv1d(torch.cat([s, m.proj(x)], 1).transpose(1, 2), m.conv.weight, m.conv.bias,
                                        groups=D).transpose(1, 2)),
        False, "linear → conv(K=4, carried state) → silu [B,T,D]"),
    "step: einsum('bkd,dk->bd') with conv.weight[:, 0, :], + bias": (
        lambda m, x, s: F.silu(torch.einsum("bkd,dk->bd", _window(m, x, s), m.conv.weight[:, 0, :]) + m.conv.bias),
        True, "window step conv(K=4, carried state) → silu [B,D]"),
    "step: (window * kernel.T).sum(1), sigmoid product, relu": (
        lambda m, x, s: F.relu((lambda z: z * torch.sigmoid(z))((_window(m, x, s) * m.kernel.T).sum(1))),
        True, "window step conv(K=4, carried state) → silu → relu [B,D]"),
    "step: taps [K, D], torch.sum(window * taps, dim=1) + bias, heads": (
        lambda m, x, s: F.elu(F.silu(torch.sum(_window(m, x, s) * m.taps, dim=1) + m.conv.bias)
                              .view(x.shape[0], H, D // H)) + 1,
        True, "window step conv(K=4, carried state) → silu → elu+1 [B,H,Dh]"),
    "step: window.transpose(1, 2) * conv.weight.squeeze(1), .sum(-1)": (
        lambda m, x, s: F.silu((_window(m, x, s).transpose(1, 2) * m.conv.weight.squeeze(1)).sum(-1)),
        True, "window step conv(K=4, carried state) → silu [B,D]"),
}


@pytest.mark.parametrize("name", list(STATEFUL_SPELLINGS))
def test_stateful_spelling_fuses_with_its_state_and_matches_eager(name):
    spelling, step, detail = STATEFUL_SPELLINGS[name]
    args = (torch.randn(B, D_IN) if step else torch.randn(B, T, D_IN), torch.randn(B, K - 1, D))
    _fuses_and_matches_eager(StatefulBlock(spelling), args, detail, ("x", "state"))


def test_generated_phi_compiles_with_inductor(fresh_dynamo):
    """The default fallback: Inductor lowers the op's backward under fake mode; the derivative of a generated
    φ (softplus) is traced outside it (it failed there, and the graph was compiled without fusions)."""
    model = Block(lambda m, x: F.softplus(F.silu(_conv_slice(m, m.proj(x).transpose(1, 2)).transpose(1, 2))))
    x = torch.randn(B, T, D_IN, requires_grad=True)
    got = torch.compile(model, backend="hecate")(x)
    report = hecate.last_report()
    assert report.count("qk_preprocess") == 1 and not report.misses, str(report)
    ref_x = x.detach().clone().requires_grad_()
    ref = model(ref_x)
    assert_close("output", got, ref, TOL)
    (g,), (r,) = torch.autograd.grad(got.sum(), x), torch.autograd.grad(ref.sum(), ref_x)
    assert_close("dx", g, r, TOL)


@pytest.mark.parametrize("layout, detail", [
    ("channels last, padded on time then transposed", "conv(K=4) → silu [B,T,D]"),
    ("padded after the transpose", "conv(K=4) → silu [B,T,D] from x [B,D,T] read transposed")])
def test_a_prefill_that_also_returns_its_conv_state_fuses_the_conv(layout, detail, fresh_dynamo):
    """A streaming layer's prefill joins a zero state in front of the projected input, convolves, and returns
    the padded input's last K−1 steps as the state to decode from: the padded tensor has a second reader, and
    the conv is still the causal conv it is."""
    class Prefill(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(D_IN, D)
            self.conv = nn.Conv1d(D, D, K, groups=D)

        def forward(self, x):
            u = self.proj(x)
            if layout.startswith("channels last"):
                padded = torch.cat([torch.zeros(x.shape[0], K - 1, D), u], 1)              # [B, K-1+T, D]
                y, state = self.conv(padded.transpose(1, 2)), padded[:, -(K - 1):]
            else:
                padded = torch.cat([u.new_zeros(x.shape[0], D, K - 1), u.transpose(1, 2)], -1)  # [B, D, K-1+T]
                y, state = self.conv(padded), padded[..., -(K - 1):].transpose(1, 2)
            return F.silu(y).transpose(1, 2), state

    model, x = Prefill(), torch.randn(B, T, D_IN, requires_grad=True)
    got = torch.compile(model, backend="hecate", options={"fallback": "eager"})(x)
    report = hecate.last_report()
    # the projection stays outside, computed once: the state reads its output too
    assert [f.detail for f in report.fusions] == [detail], str(report)
    assert report.misses == [], str(report)
    x_ref = x.detach().clone().requires_grad_()
    assert_outputs_and_gradients_close(got, model(x_ref), [x, *model.parameters()], [x_ref, *model.parameters()],
                                       TOL)
