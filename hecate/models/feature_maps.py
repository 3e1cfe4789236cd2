"""Feature maps φ: R^d → R^d_phi applied to keys and queries before the memory.

Formulas from ``spec/feature-maps-phi.md`` ("Feature Map Types", Types 1–6) and
``spec/linear-attention-feature-maps.md`` (Feature Maps 1–6). Every map acts on
the last dimension, so it works on [B, T, D] and on per-head [B, T, H, Dh]
tensors alike. The same φ instance must be used for keys and queries (spec
feature-maps-phi, Implementation Note 3).

Elementwise maps (identity, ELU+1, ReLU, squared ReLU, exp) keep d_phi = d;
the matrix maps (learned linear, random Fourier, polynomial, residual MLP,
Performer) mix the last dimension.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class IdentityFeatureMap(nn.Module):
    """Type 1: φ(k) = k (d_phi = d)."""

    def forward(self, k: torch.Tensor) -> torch.Tensor:
        return k


class LinearFeatureMap(nn.Module):
    """Type 2: φ(k) = W_phi @ k with a learned W_phi [d_phi, d]; d_phi may differ from d."""

    def __init__(self, d: int, d_phi: int):
        super().__init__()
        self.proj = nn.Linear(d, d_phi, bias=False)

    def forward(self, k: torch.Tensor) -> torch.Tensor:
        return self.proj(k)


class RandomFourierFeatures(nn.Module):
    """Type 3: φ(k) = sqrt(2/d_phi) · cos(W_rand @ k + b_rand), W_rand and b_rand fixed.

    With W_rand ~ N(0, 1/σ²) and b_rand ~ U[0, 2π), φ(k)ᵀφ(q) ≈ exp(−‖k − q‖² / 2σ²)
    (the Gaussian kernel), more closely as d_phi grows.
    """

    def __init__(self, d: int, d_phi: int, sigma: float = 1.0):
        super().__init__()
        if sigma <= 0:
            raise ValueError(f"sigma must be > 0, got {sigma}")
        self.d_phi = d_phi
        self.register_buffer("w_rand", torch.randn(d_phi, d) / sigma)
        self.register_buffer("b_rand", torch.rand(d_phi) * 2 * math.pi)

    def forward(self, k: torch.Tensor) -> torch.Tensor:
        return math.sqrt(2.0 / self.d_phi) * torch.cos(k @ self.w_rand.T + self.b_rand)


class PolynomialFeatures(nn.Module):
    """Type 4, degree 2: φ(k) = [k; k ⊗ k] (d_phi = d + d²)."""

    def forward(self, k: torch.Tensor) -> torch.Tensor:
        outer = k.unsqueeze(-1) * k.unsqueeze(-2)  # [..., d, d]
        return torch.cat([k, outer.flatten(-2)], dim=-1)


class ResidualMLPFeatureMap(nn.Module):
    """Type 5: φ(k) = k + W_1 @ σ(W_2 @ k) (d_phi = d), W_1 [d, d_hidden], W_2 [d_hidden, d] learned."""

    def __init__(self, d: int, d_hidden: int):
        super().__init__()
        self.w2 = nn.Linear(d, d_hidden, bias=False)
        self.w1 = nn.Linear(d_hidden, d, bias=False)

    def forward(self, k: torch.Tensor) -> torch.Tensor:
        return k + self.w1(F.silu(self.w2(k)))


class EluPlusOne(nn.Module):
    """Type 6 / Feature Map 1: φ(k) = elu(k) + 1 > 0 (Katharopoulos et al. 2020).

    ``spelling``: "elu_plus_1" writes ``F.elu(k) + 1``, "one_plus_elu" writes ``1 + F.elu(k)``.
    """

    def __init__(self, spelling: str = "elu_plus_1"):
        super().__init__()
        check_choice("spelling", spelling, ("elu_plus_1", "one_plus_elu"))
        self.spelling = spelling

    def forward(self, k: torch.Tensor) -> torch.Tensor:
        if self.spelling == "elu_plus_1":
            return F.elu(k) + 1
        return 1 + F.elu(k)


class ReLUFeatureMap(nn.Module):
    """Feature Map 2: φ(k) = relu(k)."""

    def forward(self, k: torch.Tensor) -> torch.Tensor:
        return F.relu(k)


class SquaredReLU(nn.Module):
    """Feature Map 5: φ(k) = relu(k)².

    ``spelling``: "pow" (``F.relu(k) ** 2``), "square" (``torch.square``), "mul" (``r * r``).
    """

    def __init__(self, spelling: str = "pow"):
        super().__init__()
        check_choice("spelling", spelling, ("pow", "square", "mul"))
        self.spelling = spelling

    def forward(self, k: torch.Tensor) -> torch.Tensor:
        r = F.relu(k)
        if self.spelling == "pow":
            return r ** 2
        if self.spelling == "square":
            return torch.square(r)
        return r * r


class ClampedExp(nn.Module):
    """Feature Map 6, stabilised: φ(k) = exp(min(k, max_val)) (no overflow for k > max_val)."""

    def __init__(self, max_val: float = 10.0):
        super().__init__()
        self.max_val = float(max_val)

    def forward(self, k: torch.Tensor) -> torch.Tensor:
        return torch.exp(torch.clamp(k, max=self.max_val))


class PerformerFeatures(nn.Module):
    """Performer positive random features (FAVOR+, Choromanski et al. 2021).

    φ(k) = exp(W k − ‖k‖²/2) / sqrt(m), W [m, d] fixed, so that
    E[φ(q)ᵀφ(k)] = exp(qᵀk) (the softmax kernel) with every feature > 0.
    With ``orthogonal=True`` the rows of W are orthogonal within each block of d
    rows (orthogonal random features), each rescaled to the norm of a Gaussian
    vector, which keeps the estimator unbiased and lowers its variance.
    """

    def __init__(self, d: int, m: int, orthogonal: bool = True):
        super().__init__()
        self.m = m
        self.register_buffer("w_rand", _orthogonal_gaussian(m, d) if orthogonal else torch.randn(m, d))

    def forward(self, k: torch.Tensor) -> torch.Tensor:
        sq_norm = k.square().sum(dim=-1, keepdim=True) / 2
        return torch.exp(k @ self.w_rand.T - sq_norm) / math.sqrt(self.m)


def _orthogonal_gaussian(m: int, d: int) -> torch.Tensor:
    """m rows, orthogonal within each block of d, with the norms of N(0, I_d) samples."""
    blocks = []
    for start in range(0, m, d):
        q, r = torch.linalg.qr(torch.randn(d, d))
        q = q * torch.sign(torch.diagonal(r))  # makes q Haar-distributed, so each row is uniform on the sphere
        blocks.append(q.T[: min(d, m - start)])
    norms = torch.randn(m, d).norm(dim=1, keepdim=True)
    return torch.cat(blocks) * norms


FEATURE_MAPS = ("identity", "linear", "random_fourier", "poly2", "mlp",
                "elu1", "relu", "relu2", "exp", "performer")
"""The φ kinds :func:`make_feature_map` builds."""

ELEMENTWISE_FEATURE_MAPS = ("identity", "elu1", "relu", "relu2", "exp")


def make_feature_map(kind: str, d: int, d_phi: int | None = None, **kwargs) -> nn.Module:
    """The feature map ``kind`` (one of :data:`FEATURE_MAPS`) on vectors of size ``d``.

    ``d_phi`` (default ``d``; ``2 * d`` for the random maps) sizes the learned
    linear, random Fourier and Performer maps, and is the hidden size of the MLP.
    Extra keyword arguments go to the map (e.g. ``spelling``, ``max_val``, ``sigma``).
    """
    check_choice("phi", kind, FEATURE_MAPS)
    if kind == "identity":
        return IdentityFeatureMap()
    if kind == "linear":
        return LinearFeatureMap(d, d_phi or d)
    if kind == "random_fourier":
        return RandomFourierFeatures(d, d_phi or 2 * d, **kwargs)
    if kind == "poly2":
        return PolynomialFeatures()
    if kind == "mlp":
        return ResidualMLPFeatureMap(d, d_phi or d)
    if kind == "elu1":
        return EluPlusOne(**kwargs)
    if kind == "relu":
        return ReLUFeatureMap()
    if kind == "relu2":
        return SquaredReLU(**kwargs)
    if kind == "exp":
        return ClampedExp(**kwargs)
    return PerformerFeatures(d, d_phi or 2 * d, **kwargs)


def check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
