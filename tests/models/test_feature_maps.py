"""Each feature map φ has the spec's formula, checked independently of how the module writes it."""

import math

import pytest
import torch

from hecate.models.feature_maps import (
    FEATURE_MAPS, ClampedExp, EluPlusOne, PerformerFeatures, RandomFourierFeatures, SquaredReLU,
    make_feature_map,
)
from hecate.testing import assert_close, rel_err


def test_identity():
    k = torch.randn(3, 5)
    assert torch.equal(make_feature_map("identity", 5)(k), k)


@pytest.mark.parametrize("spelling", ["elu_plus_1", "one_plus_elu"])
def test_elu_plus_one_is_positive_and_piecewise(spelling):
    k = torch.linspace(-20, 5, 501, dtype=torch.float64)  # float32 rounds 1 − (1 − e^−20) to 0
    phi = EluPlusOne(spelling)(k)
    assert (phi > 0).all()
    neg = k < 0
    assert_close("x < 0: exp(x)", phi[neg], torch.exp(k[neg]), 1e-6)
    assert_close("x >= 0: x + 1", phi[~neg], k[~neg] + 1, 1e-6)


def test_relu():
    k = torch.randn(4, 6)
    assert torch.equal(make_feature_map("relu", 6)(k), torch.where(k > 0, k, torch.zeros_like(k)))


@pytest.mark.parametrize("spelling", ["pow", "square", "mul"])
def test_squared_relu(spelling):
    k = torch.randn(4, 6)
    expected = torch.where(k > 0, k * k, torch.zeros_like(k))
    assert_close(spelling, SquaredReLU(spelling)(k), expected, 1e-7)
    assert (SquaredReLU(spelling)(k) >= 0).all()


def test_clamped_exp_does_not_overflow():
    k = torch.tensor([-3.0, 0.0, 2.0, 50.0, 1e4])
    phi = ClampedExp(max_val=10.0)(k)
    assert torch.isfinite(phi).all() and (phi > 0).all()
    expected = torch.tensor([math.exp(-3), 1.0, math.exp(2), math.exp(10), math.exp(10)])
    assert_close("exp(min(k, 10))", phi, expected, 1e-6)


def test_learned_linear_changes_dimension():
    phi = make_feature_map("linear", 5, d_phi=9)
    k = torch.randn(2, 3, 5)
    out = phi(k)
    assert out.shape == (2, 3, 9)
    assert_close("W_phi k", out, torch.einsum("pd,btd->btp", phi.proj.weight, k), 1e-6)
    out.sum().backward()
    assert phi.proj.weight.grad is not None  # learned by AD


def test_polynomial_dims_and_kernel():
    d = 4
    phi = make_feature_map("poly2", d)
    a, b = torch.randn(d, dtype=torch.float64), torch.randn(d, dtype=torch.float64)
    fa, fb = phi(a), phi(b)
    assert fa.shape == (d + d * d,)
    assert torch.equal(fa[:d], a)
    assert fa[d + 1 * d + 2] == a[1] * a[2]  # (k ⊗ k)[i, j] = k_i k_j
    dot = (a * b).sum()
    assert_close("φ(a)·φ(b) = a·b + (a·b)²", (fa * fb).sum(), dot + dot ** 2, 1e-12)


def test_residual_mlp():
    phi = make_feature_map("mlp", 6, d_phi=10)
    k = torch.randn(3, 6)
    expected = k + torch.nn.functional.silu(k @ phi.w2.weight.T) @ phi.w1.weight.T
    assert_close("k + W1 σ(W2 k)", phi(k), expected, 1e-6)
    with torch.no_grad():
        phi.w1.weight.zero_()
    assert torch.equal(phi(k), k)  # the residual path


def _gaussian_kernel_error(d_phi: int, x: torch.Tensor, y: torch.Tensor, sigma: float) -> float:
    phi = RandomFourierFeatures(x.shape[-1], d_phi, sigma=sigma).double()
    approx = phi(x) @ phi(y).T
    exact = torch.exp(-torch.cdist(x, y) ** 2 / (2 * sigma ** 2))
    return rel_err(approx, exact)


def test_random_fourier_features_approximate_gaussian_kernel():
    torch.manual_seed(3)
    x, y = torch.randn(20, 4, dtype=torch.float64), torch.randn(20, 4, dtype=torch.float64)
    coarse = _gaussian_kernel_error(32, x, y, sigma=2.0)
    fine = _gaussian_kernel_error(8192, x, y, sigma=2.0)
    assert fine < coarse / 4  # Monte Carlo error ~ 1/sqrt(d_phi): 16× the features, ~4× smaller
    assert fine < 0.05


def _softmax_kernel_error(m: int, q: torch.Tensor, k: torch.Tensor, orthogonal: bool) -> float:
    phi = PerformerFeatures(q.shape[-1], m, orthogonal=orthogonal).double()
    return rel_err(phi(q) @ phi(k).T, torch.exp(q @ k.T))


def test_performer_features_positive_and_approximate_softmax_kernel():
    torch.manual_seed(4)
    # small norms: the estimator's variance grows like exp(‖q + k‖²), heavy-tailed for large inputs
    q, k = 0.25 * torch.randn(16, 8, dtype=torch.float64), 0.25 * torch.randn(16, 8, dtype=torch.float64)
    phi = PerformerFeatures(8, 64)
    assert (phi(q.float()) > 0).all()
    coarse = _softmax_kernel_error(16, q, k, orthogonal=True)
    fine = _softmax_kernel_error(4096, q, k, orthogonal=True)
    assert fine < coarse / 4
    assert fine < 0.05


def test_performer_random_features_are_orthogonal_within_blocks():
    w = PerformerFeatures(6, 15).w_rand  # blocks of 6, 6, 3 rows
    for start in (0, 6, 12):
        block = w[start:start + 6]
        gram = block @ block.T
        off_diagonal = gram - torch.diag(torch.diagonal(gram))
        assert off_diagonal.abs().max() < 1e-4 * gram.diagonal().max()
    iid = PerformerFeatures(6, 15, orthogonal=False).w_rand
    assert (iid[:6] @ iid[:6].T - torch.diag((iid[:6] ** 2).sum(1))).abs().max() > 1e-2


@pytest.mark.parametrize("kind", FEATURE_MAPS)
def test_every_map_acts_on_the_last_dim_per_head(kind):
    phi = make_feature_map(kind, 4)
    k = torch.randn(2, 3, 5, 4)  # [B, T, H, Dh]
    per_head = phi(k)
    one_head = phi(k[:, :, 2])
    assert_close(kind, per_head[:, :, 2], one_head, 1e-6)


@pytest.mark.parametrize("kwargs,message", [
    (dict(kind="softmax", d=4), r"phi must be one of \['identity', .*\], got 'softmax'"),
    (dict(kind="relu2", d=4, spelling="cube"), r"spelling must be one of \['pow', 'square', 'mul'\], got 'cube'"),
    (dict(kind="random_fourier", d=4, sigma=0.0), r"sigma must be > 0, got 0.0"),
])
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_feature_map(**kwargs)
