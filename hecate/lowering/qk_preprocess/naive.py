"""The key/query preprocessing chain, written the plain way: the reference every path is checked against.

Spec (``short-causal-conv.md``, ``feature-maps-phi.md``, ``linear-attention-feature-maps.md``)::

    u[b, t, :]  = W_proj x[b, t, :] + b_proj                       (projection; skipped when W_proj is None)
    z[b, t, c]  = Σ_{j=0}^{K-1} w[c, 0, j] · u[b, t-(K-1)+j, c] + b_conv[c]
                  with u[b, s, c] = 0 for s < 0                     (depthwise causal conv, left-padded)
    a           = silu(z) = z · sigmoid(z)   or   a = z            (activation)
    out         = φ(a)                                             (elementwise feature map)

Elementwise φ kinds: identity; elu1 = elu(a) + 1; relu; relu2 = relu(a)²; exp = exp(min(a, phi_scalar)).
Matrix φ kind: linear, φ(a)[b, t, h, :] = W_phi a[b, t, h, :] with phi_params = [W_phi [d_phi, Dh]] shared by
the H = D / Dh heads (channels c = h·Dh + i); the output is [B, T, H·d_phi].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = ("silu", "none")
ELEMENTWISE_PHI = ("identity", "elu1", "relu", "relu2", "exp")
MATRIX_PHI = ("linear",)
PHI_KINDS = ELEMENTWISE_PHI + MATRIX_PHI


def apply_activation(z: torch.Tensor, activation: str) -> torch.Tensor:
    return F.silu(z) if activation == "silu" else z


def apply_phi(a: torch.Tensor, phi: str, phi_params: list[torch.Tensor], phi_scalar: float) -> torch.Tensor:
    """The feature map φ(a) on a [B, T, D]."""
    if phi == "identity":
        return a
    if phi == "elu1":
        return F.elu(a) + 1
    if phi == "relu":
        return F.relu(a)
    if phi == "relu2":
        return F.relu(a).square()
    if phi == "exp":
        return torch.exp(torch.clamp(a, max=phi_scalar))
    if phi == "linear":
        (w_phi,) = phi_params                                                     # [d_phi, Dh]
        B, T, D = a.shape
        return F.linear(a.reshape(B, T, D // w_phi.shape[1], w_phi.shape[1]), w_phi).flatten(2)
    raise ValueError(f"phi must be one of {list(PHI_KINDS)}, got {phi!r}")


def qk_preprocess_reference(x: torch.Tensor, proj_weight: torch.Tensor | None, proj_bias: torch.Tensor | None,
                            conv_weight: torch.Tensor, conv_bias: torch.Tensor | None, activation: str,
                            phi: str, phi_params: list[torch.Tensor], phi_scalar: float) -> torch.Tensor:
    """projection → depthwise causal conv1d → activation → φ, with F.linear and F.conv1d."""
    u = F.linear(x, proj_weight, proj_bias) if proj_weight is not None else x   # [B, T, D]
    D, _, K = conv_weight.shape
    u_padded = F.pad(u.transpose(1, 2), (K - 1, 0))                               # [B, D, K-1+T]
    z = F.conv1d(u_padded, conv_weight, conv_bias, groups=D).transpose(1, 2)      # [B, T, D]
    return apply_phi(apply_activation(z, activation), phi, phi_params, phi_scalar)
