"""Short depthwise causal convolution on keys and queries, and the block around it.

``spec/short-causal-conv.md``: project, then a depthwise causal conv1d
(kernel 4 by default, left zero-padded so output t sees inputs t−K+1..t), then
SiLU (Mamba/Based convention) or no activation (H3/Hyena), then the feature
map φ (``spec/feature-maps-phi.md``). Keys and queries have separate projection
and conv weights (Option A).

The modules write the same computation in the spellings researchers use, chosen
in the constructor so that tests can cover each one:

* projection ``proj_style``: "linear" (``nn.Linear``), "functional" (``F.linear``),
  "matmul" (``x @ W.T + b``);
* conv ``conv_style``: "conv1d_slice" (``nn.Conv1d(padding=K-1)`` then keep the
  first T outputs) or "pad_conv1d" (``F.pad`` K−1 zeros on the left, then ``F.conv1d``);
* SiLU ``silu_style``: "silu" (``F.silu``) or "sigmoid_mul" (``z * torch.sigmoid(z)``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hecate.models.feature_maps import check_choice, make_feature_map

ACTIVATIONS = ("silu", "none")
CONV_STYLES = ("conv1d_slice", "pad_conv1d")
SILU_STYLES = ("silu", "sigmoid_mul")
PROJ_STYLES = ("linear", "functional", "matmul")


class ShortCausalConv(nn.Module):
    """Depthwise causal conv1d over [B, T, D] with optional SiLU (spec "Depthwise Causal Conv1D").

    out[b, t, c] = act(Σ_{j=0}^{K−1} w[c, j] · x_pad[b, t + j, c] + bias[c]),
    x_pad = x left-padded with K−1 zeros. Weights are held by an
    ``nn.Conv1d(d, d, K, groups=d)`` (weight [D, 1, K]), Kaiming-uniform
    initialised with fan_in = K; the bias starts at zero (spec "Configuration Defaults").

    For decoding, :meth:`step` takes one token and the last K−1 inputs
    (the streaming state of spec Implementation Note 3) and gives the same
    output as :meth:`forward` on the whole sequence.
    """

    def __init__(self, d: int, kernel_size: int = 4, bias: bool = True, activation: str = "silu",
                 conv_style: str = "conv1d_slice", silu_style: str = "silu"):
        super().__init__()
        if kernel_size < 1:
            raise ValueError(f"kernel_size must be >= 1, got {kernel_size}")
        check_choice("activation", activation, ACTIVATIONS)
        check_choice("conv_style", conv_style, CONV_STYLES)
        check_choice("silu_style", silu_style, SILU_STYLES)
        self.d, self.kernel_size = d, kernel_size
        self.activation, self.conv_style, self.silu_style = activation, conv_style, silu_style
        padding = kernel_size - 1 if conv_style == "conv1d_slice" else 0
        self.conv = nn.Conv1d(d, d, kernel_size, groups=d, padding=padding, bias=bias)
        if bias:
            nn.init.zeros_(self.conv.bias)

    def forward(self, x: torch.Tensor, state: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, D] → [B, T, D]. ``state`` [B, K−1, D]: the inputs before x (a chunk's left context, from
        :meth:`next_state`), read instead of the zero padding; None: x starts the sequence."""
        seq_len = x.shape[1]
        x = x.transpose(1, 2)  # [B, D, T]: conv1d wants channels first
        if state is not None:
            z = F.conv1d(torch.cat([state.transpose(1, 2), x], -1), self.conv.weight, self.conv.bias, groups=self.d)
        elif self.conv_style == "conv1d_slice":
            z = self.conv(x)[..., :seq_len]  # padding=K−1 on both sides: keep the causal T outputs
        else:
            z = F.conv1d(F.pad(x, (self.kernel_size - 1, 0)), self.conv.weight, self.conv.bias,
                         groups=self.d)
        return self._activate(z.transpose(1, 2))

    def initial_state(self, batch: int) -> torch.Tensor:
        """The streaming state before the first token: K−1 zero inputs, [B, K−1, D]."""
        w = self.conv.weight
        return torch.zeros(batch, self.kernel_size - 1, self.d, dtype=w.dtype, device=w.device)

    def next_state(self, x: torch.Tensor, state: torch.Tensor | None = None) -> torch.Tensor:
        """The streaming state after x [B, T, D] (which followed ``state``): the last K−1 inputs, [B, K−1, D]."""
        context = torch.cat([state if state is not None else self.initial_state(x.shape[0]).to(x), x], 1)
        return context[:, context.shape[1] - (self.kernel_size - 1):]

    def step(self, x_t: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One decoding step: x_t [B, D], state [B, K−1, D] (the previous K−1 inputs, oldest first).

        Returns (out_t [B, D], new state [B, K−1, D]).
        """
        window = torch.cat([state, x_t.unsqueeze(1)], dim=1)  # [B, K, D], x_pad[t .. t+K−1]
        z = torch.einsum("bkd,dk->bd", window, self.conv.weight[:, 0, :])
        if self.conv.bias is not None:
            z = z + self.conv.bias
        return self._activate(z), window[:, 1:]

    def _activate(self, z: torch.Tensor) -> torch.Tensor:
        if self.activation == "none":
            return z
        if self.silu_style == "silu":
            return F.silu(z)
        return z * torch.sigmoid(z)


class KeyQueryPreprocess(nn.Module):
    """Keys and queries for a memory: q, k = φ(act(conv_q(W_Q x))), φ(act(conv_k(W_K x))).

    spec short-causal-conv "Integration Point" (steps 2–3) and Implementation
    Note 5 (project → conv → φ). Separate projection and conv weights for keys
    and queries; one φ shared by both (spec feature-maps-phi, Note 3).

    ``n_heads``: with ``None`` the outputs are [B, T, d_key] and φ acts on d_key;
    otherwise they are [B, T, H, d_key / H] and φ acts per head (on d_key / H).
    ``phi`` is a name from :data:`hecate.models.feature_maps.FEATURE_MAPS` or a module;
    ``phi_kwargs`` go to :func:`make_feature_map`.
    """

    def __init__(self, d_model: int, d_key: int | None = None, n_heads: int | None = None,
                 kernel_size: int = 4, activation: str = "silu", phi: str | nn.Module = "elu1",
                 proj_bias: bool = False, conv_bias: bool = True, proj_style: str = "linear",
                 conv_style: str = "conv1d_slice", silu_style: str = "silu", **phi_kwargs):
        super().__init__()
        d_key = d_key or d_model
        check_choice("proj_style", proj_style, PROJ_STYLES)
        if n_heads is not None and d_key % n_heads:
            raise ValueError(f"n_heads={n_heads} must divide d_key={d_key}")
        self.d_key, self.n_heads, self.proj_style = d_key, n_heads, proj_style
        self.q_proj = nn.Linear(d_model, d_key, bias=proj_bias)
        self.k_proj = nn.Linear(d_model, d_key, bias=proj_bias)
        conv_args = dict(kernel_size=kernel_size, bias=conv_bias, activation=activation,
                         conv_style=conv_style, silu_style=silu_style)
        self.q_conv = ShortCausalConv(d_key, **conv_args)
        self.k_conv = ShortCausalConv(d_key, **conv_args)
        d_phi_in = d_key // n_heads if n_heads else d_key
        self.phi = phi if isinstance(phi, nn.Module) else make_feature_map(phi, d_phi_in, **phi_kwargs)

    def forward(self, x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, d_model] → (φ(q), φ(k)), each [B, T, d_phi] or [B, T, H, d_phi]. ``state``: the convs' left
        context (queries', keys') from :meth:`next_state` when x continues a sequence; None: x starts it."""
        q_state, k_state = state if state is not None else (None, None)
        q = self.q_conv(self._project(x, self.q_proj), q_state)
        k = self.k_conv(self._project(x, self.k_proj), k_state)
        return self.phi(self._heads(q)), self.phi(self._heads(k))

    def next_state(self, x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """The streaming state after x (which followed ``state``): only its last K−1 tokens are projected."""
        tail = x[:, max(x.shape[1] - (self.q_conv.kernel_size - 1), 0):]
        q_state, k_state = state if state is not None else (None, None)
        return (self.q_conv.next_state(self._project(tail, self.q_proj), q_state),
                self.k_conv.next_state(self._project(tail, self.k_proj), k_state))

    def initial_state(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Streaming state (queries', keys') for :meth:`step`."""
        return self.q_conv.initial_state(batch), self.k_conv.initial_state(batch)

    def step(self, x_t: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor]):
        """One decoding step: x_t [B, d_model] → ((φ(q_t), φ(k_t)), new state)."""
        q_t, q_state = self.q_conv.step(self._project(x_t, self.q_proj), state[0])
        k_t, k_state = self.k_conv.step(self._project(x_t, self.k_proj), state[1])
        return (self.phi(self._heads(q_t)), self.phi(self._heads(k_t))), (q_state, k_state)

    def _project(self, x: torch.Tensor, proj: nn.Linear) -> torch.Tensor:
        if self.proj_style == "linear":
            return proj(x)
        if self.proj_style == "functional":
            return F.linear(x, proj.weight, proj.bias)
        y = x @ proj.weight.T
        return y if proj.bias is None else y + proj.bias

    def _heads(self, y: torch.Tensor) -> torch.Tensor:
        if self.n_heads is None:
            return y
        return y.view(*y.shape[:-1], self.n_heads, self.d_key // self.n_heads)


def qk_preprocess_example() -> tuple[nn.Module, tuple]:
    """Keys and queries with ELU+1 over 4 heads: both chains fuse into hecate.qk_preprocess."""
    torch.manual_seed(0)
    return KeyQueryPreprocess(d_model=32, d_key=32, n_heads=4, phi="elu1"), (torch.randn(2, 16, 32),)


def qk_preprocess_performer_example() -> tuple[nn.Module, tuple]:
    """Performer FAVOR+ φ over 4 heads: a feature map that mixes each head's features."""
    torch.manual_seed(0)
    return (KeyQueryPreprocess(d_model=32, d_key=32, n_heads=4, phi="performer", d_phi=16),
            (torch.randn(2, 16, 32),))


class BidirectionalConvMixer(nn.Module):
    """Token mixing for an encoder: a centred (non-causal) depthwise conv and a dense causal conv.

    Neither is the short causal depthwise conv of the spec: the first sees K//2 future
    tokens, the second mixes channels (groups=1). Hecate leaves both alone and says why.
    """

    def __init__(self, d: int, kernel_size: int = 3):
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.centred = nn.Conv1d(d, d, kernel_size, groups=d, padding=kernel_size // 2)
        self.dense = nn.Conv1d(d, d, kernel_size, padding=kernel_size - 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = self.proj(x).transpose(1, 2)
        mixed = self.centred(u) + self.dense(u)[..., : x.shape[1]]
        return F.silu(mixed.transpose(1, 2))


def near_miss_example() -> tuple[nn.Module, tuple]:
    """A centred conv and a dense conv: no fusion, two near-misses with their reasons."""
    torch.manual_seed(0)
    return BidirectionalConvMixer(16), (torch.randn(2, 10, 16),)


EXAMPLES = {
    "qk_preprocess": qk_preprocess_example,
    "qk_preprocess_performer": qk_preprocess_performer_example,
    "qk_preprocess_near_miss": near_miss_example,
}
