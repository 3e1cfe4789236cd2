"""The key/query preprocessing chain, written the plain way: the reference every path is checked against.

Spec (``short-causal-conv.md``, ``feature-maps-phi.md``, ``linear-attention-feature-maps.md``)::

    u[b, t, :]  = W_proj x[b, t, :] + b_proj                       (projection; skipped when W_proj is None)
    z[b, t, c]  = Σ_{j=0}^{K-1} w[c, 0, j] · u[b, t-(K-1)+j, c] + b_conv[c]
                  with u[b, s, c] = 0 for s < 0                     (depthwise causal conv, left-padded)
    a           = silu(z) = z · sigmoid(z)   or   a = z            (activation)
    out         = φ(a)                                             (elementwise feature map)

Elementwise φ kinds: identity; elu1 = elu(a) + 1; relu; relu2 = relu(a)²; exp = exp(min(a, phi_scalar));
or any elementwise φ the user wrote, given as a :mod:`hecate.lowering.pointwise` expression of a (e.g.
``"sigmoid(x);mul(x,%0)"``): the kinds are its fast paths.
Matrix φ kinds act on each head a_h = a[b, t, h·Dh:(h+1)·Dh] (H = D / Dh heads, one W_phi [d_phi, Dh] shared
by all heads) and give [B, T, H·d_phi]:
    linear:          φ(a_h) = W_phi a_h                                        phi_params = [W_phi]
    random_fourier:  φ(a_h) = sqrt(2/d_phi) · cos(W_phi a_h + b_phi)           phi_params = [W_phi, b_phi [d_phi]]
    performer:       φ(a_h) = exp(W_phi a_h − ‖a_h‖²/2) / sqrt(d_phi)          phi_params = [W_phi]  (FAVOR+)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from hecate.lowering import pointwise

ACTIVATIONS = ("silu", "none")
ELEMENTWISE_PHI = ("identity", "elu1", "relu", "relu2", "exp")
MATRIX_PHI = ("linear", "random_fourier", "performer")
PHI_PARAM_COUNT = {"linear": 1, "random_fourier": 2, "performer": 1}
PHI_KINDS = ELEMENTWISE_PHI + MATRIX_PHI


def is_pointwise_phi(phi: str) -> bool:
    """Whether ``phi`` is a user's elementwise φ (a pointwise expression) rather than a kind name."""
    return phi not in PHI_KINDS


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
    if phi in MATRIX_PHI:
        w_phi = phi_params[0]                                                     # [d_phi, Dh]
        d_phi, head_dim = w_phi.shape
        B, T, D = a.shape
        heads = a.reshape(B, T, D // head_dim, head_dim)                          # [B, T, H, Dh]
        pre = F.linear(heads, w_phi)                                              # [B, T, H, d_phi]
        if phi == "random_fourier":
            pre = math.sqrt(2.0 / d_phi) * torch.cos(pre + phi_params[1])
        elif phi == "performer":
            pre = torch.exp(pre - heads.square().sum(-1, keepdim=True) / 2) / math.sqrt(d_phi)
        return pre.flatten(2)
    return pointwise.evaluate(phi, a)


def qk_preprocess_reference(x: torch.Tensor, proj_weight: torch.Tensor | None, proj_bias: torch.Tensor | None,
                            conv_weight: torch.Tensor, conv_bias: torch.Tensor | None, activation: str,
                            phi: str, phi_params: list[torch.Tensor], phi_scalar: float) -> torch.Tensor:
    """projection → depthwise causal conv1d → activation → φ, with F.linear and F.conv1d."""
    u = F.linear(x, proj_weight, proj_bias) if proj_weight is not None else x   # [B, T, D]
    D, _, K = conv_weight.shape
    u_padded = F.pad(u.transpose(1, 2), (K - 1, 0))                               # [B, D, K-1+T]
    z = F.conv1d(u_padded, conv_weight, conv_bias, groups=D).transpose(1, 2)      # [B, T, D]
    return apply_phi(apply_activation(z, activation), phi, phi_params, phi_scalar)
