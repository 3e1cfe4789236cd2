"""The short causal conv and the key/query block: the spec's equation, causality, streaming."""

import pytest
import torch
import torch.nn.functional as F

from hecate.models.short_conv import KeyQueryPreprocess, ShortCausalConv
from hecate.testing import assert_close


def _randomize(module: torch.nn.Module) -> None:
    """Non-zero biases (the spec initialises them to zero), so tests see them."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.5)


def _spec_conv(x, w, bias, activation):
    """spec "Depthwise Causal Conv1D": out[b,t,c] = Σ_j w[c,j] · x_pad[b,t+j,c] + bias[c], loops written out."""
    B, T, D = x.shape
    K = w.shape[1]
    x_pad = torch.cat([torch.zeros(B, K - 1, D, dtype=x.dtype), x], dim=1)
    out = torch.zeros(B, T, D, dtype=x.dtype)
    for t in range(T):
        for j in range(K):
            out[:, t, :] += w[:, j] * x_pad[:, t + j, :]
    if bias is not None:
        out += bias
    return out * torch.sigmoid(out) if activation == "silu" else out


@pytest.mark.parametrize("conv_style", ["conv1d_slice", "pad_conv1d"])
@pytest.mark.parametrize("activation", ["silu", "none"])
@pytest.mark.parametrize("kernel_size,T", [(4, 7), (4, 2), (3, 5), (1, 3)])
def test_conv_matches_spec_equation(conv_style, activation, kernel_size, T):
    conv = ShortCausalConv(6, kernel_size, activation=activation, conv_style=conv_style).double()
    _randomize(conv)
    x = torch.randn(2, T, 6, dtype=torch.float64)
    expected = _spec_conv(x, conv.conv.weight[:, 0, :], conv.conv.bias, activation)
    assert_close("conv output", conv(x), expected, 1e-12)


def test_conv_is_causal():
    conv = ShortCausalConv(5)
    _randomize(conv)
    x = torch.randn(1, 9, 5)
    y = conv(x)
    x2 = x.clone()
    x2[:, 6] += 10.0
    y2 = conv(x2)
    assert torch.equal(y[:, :6], y2[:, :6])  # the past does not see token 6
    assert not torch.allclose(y[:, 6:], y2[:, 6:])


def test_spellings_agree():
    torch.manual_seed(1)
    x = torch.randn(3, 6, 10)
    ref = ShortCausalConv(10)
    _randomize(ref)
    for conv_style in ("conv1d_slice", "pad_conv1d"):
        for silu_style in ("silu", "sigmoid_mul"):
            other = ShortCausalConv(10, conv_style=conv_style, silu_style=silu_style)
            other.load_state_dict(ref.state_dict())
            assert_close(f"{conv_style}/{silu_style}", other(x), ref(x), 1e-6)


@pytest.mark.parametrize("kernel_size", [1, 2, 4])
@pytest.mark.parametrize("bias", [True, False])
def test_conv_stepwise_equals_full_sequence(kernel_size, bias):
    conv = ShortCausalConv(7, kernel_size, bias=bias).double()
    _randomize(conv)
    x = torch.randn(2, 6, 7, dtype=torch.float64)
    state = conv.initial_state(2)
    assert state.shape == (2, kernel_size - 1, 7)
    outs = []
    for t in range(x.shape[1]):
        y_t, state = conv.step(x[:, t], state)
        outs.append(y_t)
    assert_close("stepwise", torch.stack(outs, 1), conv(x), 1e-12)
    assert torch.equal(state, x[:, x.shape[1] - (kernel_size - 1):])  # the last K−1 inputs


@pytest.mark.parametrize("phi", ["elu1", "performer", "poly2"])
@pytest.mark.parametrize("n_heads", [None, 2])
def test_block_stepwise_equals_full_sequence(phi, n_heads):
    block = KeyQueryPreprocess(8, 6, n_heads=n_heads, phi=phi).double()
    _randomize(block)
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    q, k = block(x)
    state = block.initial_state(2)
    qs, ks = [], []
    for t in range(5):
        (q_t, k_t), state = block.step(x[:, t], state)
        qs.append(q_t)
        ks.append(k_t)
    assert_close("q", torch.stack(qs, 1), q, 1e-12)
    assert_close("k", torch.stack(ks, 1), k, 1e-12)


def test_block_keys_and_queries_have_separate_weights_and_shared_phi():
    block = KeyQueryPreprocess(8, 6, n_heads=3, phi="relu2")
    assert block.q_proj.weight is not block.k_proj.weight
    assert block.q_conv.conv.weight is not block.k_conv.conv.weight
    q, k = block(torch.randn(2, 4, 8))
    assert q.shape == k.shape == (2, 4, 3, 2)
    flat = KeyQueryPreprocess(8, 6, phi="poly2")
    q, _ = flat(torch.randn(2, 4, 8))
    assert q.shape == (2, 4, 6 + 36)


def test_block_equation():
    """q = φ(silu(conv_q(W_Q x + b))) against F.linear/F.conv1d written independently."""
    block = KeyQueryPreprocess(5, 4, phi="elu1", proj_bias=True).double()
    _randomize(block)
    x = torch.randn(2, 7, 5, dtype=torch.float64)
    u = F.linear(x, block.q_proj.weight, block.q_proj.bias)
    w, b = block.q_conv.conv.weight, block.q_conv.conv.bias
    z = F.conv1d(F.pad(u.transpose(1, 2), (3, 0)), w, b, groups=4).transpose(1, 2)
    expected = F.elu(F.silu(z)) + 1
    assert_close("q", block(x)[0], expected, 1e-12)


@pytest.mark.parametrize("proj_style", ["linear", "functional", "matmul"])
@pytest.mark.parametrize("proj_bias", [True, False])
def test_block_projection_spellings_agree(proj_style, proj_bias):
    ref = KeyQueryPreprocess(6, 4, phi="relu", proj_bias=proj_bias)
    other = KeyQueryPreprocess(6, 4, phi="relu", proj_bias=proj_bias, proj_style=proj_style)
    other.load_state_dict(ref.state_dict())
    x = torch.randn(2, 3, 6)
    for a, b in zip(other(x), ref(x)):
        assert_close(proj_style, a, b, 1e-6)


@pytest.mark.parametrize("kwargs,message", [
    (dict(activation="gelu"), r"activation must be one of \['silu', 'none'\], got 'gelu'"),
    (dict(conv_style="same"), r"conv_style must be one of \['conv1d_slice', 'pad_conv1d'\], got 'same'"),
    (dict(silu_style="swish"), r"silu_style must be one of \['silu', 'sigmoid_mul'\], got 'swish'"),
    (dict(kernel_size=0), r"kernel_size must be >= 1, got 0"),
])
def test_conv_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ShortCausalConv(4, **kwargs)


@pytest.mark.parametrize("kwargs,message", [
    (dict(n_heads=4, d_key=6), r"n_heads=4 must divide d_key=6"),
    (dict(proj_style="einsum"), r"proj_style must be one of \['linear', 'functional', 'matmul'\], got 'einsum'"),
    (dict(phi="softmax"), r"phi must be one of \[.*'performer'\], got 'softmax'"),
])
def test_block_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        KeyQueryPreprocess(8, **kwargs)


@pytest.mark.parametrize("phi", ["elu1", "performer"])
def test_compiled_block_under_autocast_returns_eager_dtype(phi, fresh_dynamo):
    """Under CPU bf16 autocast eager's linear and conv1d run in bf16; the fused chain does too."""
    import hecate

    block = KeyQueryPreprocess(8, 6, n_heads=2, phi=phi)
    _randomize(block)
    x = torch.randn(2, 5, 8)
    with torch.autocast("cpu", torch.bfloat16):
        expected = block(x)
        got = torch.compile(block, backend="hecate", options={"fallback": "eager"})(x)
    assert hecate.last_report().count("qk_preprocess") == 2, str(hecate.last_report())
    for name, g, e in zip(("q", "k"), got, expected):
        assert g.dtype == e.dtype == torch.bfloat16
        assert_close(name, g, e, 2e-2)


@pytest.mark.parametrize("kernel_size", [1, 3, 4])
@pytest.mark.parametrize("phi", ["elu1", "performer"])
def test_block_chunks_carrying_the_state_equal_the_whole_sequence(kernel_size, phi):
    block = KeyQueryPreprocess(8, 6, n_heads=2, kernel_size=kernel_size, phi=phi).double()
    _randomize(block)
    x = torch.randn(2, 9, 8, dtype=torch.float64)
    q, k = block(x)
    state, qs, ks = None, [], []
    for start, stop in ((0, 2), (2, 7), (7, 9)):     # a chunk shorter than K−1 too
        q_c, k_c = block(x[:, start:stop], state)
        state = block.next_state(x[:, start:stop], state)
        qs.append(q_c)
        ks.append(k_c)
    assert_close("q", torch.cat(qs, 1), q, 1e-12)
    assert_close("k", torch.cat(ks, 1), k, 1e-12)
    _, step_state = block.step(x[:, -1], block.next_state(x[:, :-1]))
    for name, a, b in zip(("queries' state", "keys' state"), state, step_state):
        assert_close(name, a, b, 1e-12)
