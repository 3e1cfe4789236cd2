"""The Pure FEP transformer (spec ``pure-fep-transformer.md``), in plain PyTorch.

No embedding, no projection, no MLP, no activation: every token position i holds
a diagonal Gaussian belief ``q_i = N(μ_i, σ_i²)``; a token prior bank ``π_v``
both encodes (``q_i ← π_{x_i}``) and decodes (``logits_v = −KL(q_i‖π_v)/τ``);
each layer holds position priors ``p_i`` and moves the beliefs by Q-flow, a few
natural-gradient steps on the variational free energy (§1.1, §3.4)

    F = α Σ_i KL(q_i‖p_i) + λ_β Σ_ij β_ij KL(q_i‖q_j) + Σ_i CE_i,
    β_ij = softmax_j(−KL(q_i‖q_j)/κ)   (masked: causal, optionally without j = i).

Training combines backprop (the Q-flow is unrolled and differentiable, so the
loss reaches every prior) with the spec's P-flow (§5.2, §5.3), see
:meth:`PureFEPTransformer.train_step`.

Notation used in the docstrings: ``v = σ² + eps`` is the variance every KL uses,
``KL_ij = KL(q_i‖q_j)``, ``Ā_i = Σ_j β_ij KL_ij`` (row i's alignment energy).

Two places where the spec, read literally, leaks information in a causal
language model, and what the options do about it:

* Others-aligning-to-i (§4.1 term 3): ``∂F/∂μ_i`` contains ``Σ_j β_ji ∂KL_ji/∂μ_i``,
  and under a causal mask ``β_ji ≠ 0`` only for ``j ≥ i``: later beliefs move
  earlier ones, so position i sees token ``x_{i+1}`` (its own target).
  ``q_flow_gradient="joint"`` (default, the spec) keeps it: the exact gradient of
  the joint F. ``q_flow_gradient="agent"`` drops the terms of other rows, so
  each belief descends its own free energy
  ``F_i = α KL(q_i‖p_i) + λ_β Σ_j β_ij KL_ij + CE_i`` (product rule through its
  own β row included); this is causal (tested).
* The observation term inside Q-flow needs the targets, i.e. the next tokens.
  With targets given and ``observation_in_q_flow=True`` (default, the spec)
  beliefs are pulled toward the answer before it is decoded; without targets
  (evaluation, generation) the observation term is dropped — F has no CE term.
  ``observation_in_q_flow=False`` drops it in training too, so training and
  evaluation run the same Q-flow.

Numerical safety: every variance is ``σ² + eps``; every σ (beliefs, position and
token priors) is floored at ``sqrt(variance_floor)``; the σ update is
multiplicative (positive) and each natural-gradient step is clipped to a trust
region of MAX_FISHER_STEP Fisher units;
a row whose keys are all masked (the first row with a causal mask and the
diagonal masked) gets β = 0 instead of softmax's NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

# Trust region of one natural-gradient step: |Δμ_k| ≤ c·σ_k and |Δ log σ_k| ≤ c.
# Normal steps are far smaller (examples/char_lm.py's setting: median |Δμ| ≈ 0.003σ
# to 0.007σ, under 0.01% of elements clipped after 100 training steps); it stops one
# huge gradient (e.g. (μ_i − μ_j)/v_j with v_j ≪ v_i) from overshooting into overflow.
MAX_FISHER_STEP = 1.0

Q_FLOW_GRADIENTS = ("joint", "agent")


@dataclass
class PureFEPConfig:
    """§6.1, plus the options the spec's investigation needs (last block)."""

    # Architecture
    vocab_size: int = 256
    embed_dim: int = 64
    n_layers: int = 4
    max_seq_len: int = 128

    # VFE weights
    alpha: float = 0.1          # self-coupling weight
    lambda_beta: float = 1.0    # alignment weight
    kappa: float = 1.0          # attention temperature
    tau: float = 1.0            # output temperature

    # Q-flow (fast timescale)
    n_vfe_steps: int = 10
    lr_mu: float = 0.1
    lr_sigma: float = 0.01

    # P-flow (slow timescale)
    lr_prior: float = 0.01
    lr_token_prior: float = 0.01

    # Numerical stability
    variance_floor: float = 1e-4
    eps: float = 1e-6

    # Options (not in §6.1)
    causal: bool = True                 # β_ij = 0 for j > i
    mask_diagonal: bool = False         # β_ii = 0 (a belief is always closest to itself)
    q_flow_gradient: str = "joint"      # "joint": ∂F/∂q_i; "agent": ∂F_i/∂q_i (causal), see module doc
    observation_in_q_flow: bool = True  # use the CE term in Q-flow when targets are given

    def __post_init__(self):
        positive_ints = ("vocab_size", "embed_dim", "n_layers", "max_seq_len")
        for name in positive_ints:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"PureFEPConfig.{name} must be a positive int, got {value!r}")
        if not isinstance(self.n_vfe_steps, int) or self.n_vfe_steps < 0:
            raise ValueError(f"PureFEPConfig.n_vfe_steps must be an int >= 0, got {self.n_vfe_steps!r}")
        for name in ("kappa", "tau", "eps", "variance_floor"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"PureFEPConfig.{name} must be > 0, got {value!r}")
        for name in ("alpha", "lambda_beta", "lr_mu", "lr_sigma", "lr_prior", "lr_token_prior"):
            value = getattr(self, name)
            if not value >= 0:
                raise ValueError(f"PureFEPConfig.{name} must be >= 0, got {value!r}")
        if self.q_flow_gradient not in Q_FLOW_GRADIENTS:
            raise ValueError(f"PureFEPConfig.q_flow_gradient must be one of {list(Q_FLOW_GRADIENTS)}, "
                             f"got {self.q_flow_gradient!r}")

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


# ---------------------------------------------------------------------------
# §3: the VFE terms
# ---------------------------------------------------------------------------

def kl_self_coupling(μ_q, σ_q, μ_p, σ_p, eps=1e-6):
    """§3.1 ``KL(q‖p)`` for diagonal Gaussians, summed over K: (B, N).

    KL = ½ Σ_k [log(σ_pk²/σ_qk²) + σ_qk²/σ_pk² + (μ_qk − μ_pk)²/σ_pk² − 1]
    """
    var_q = σ_q.square() + eps
    var_p = σ_p.square() + eps

    log_ratio = torch.log(var_p / var_q)
    trace_term = var_q / var_p
    mahal_term = (μ_q - μ_p).square() / var_p

    kl = 0.5 * (log_ratio + trace_term + mahal_term - 1.0)
    return kl.sum(dim=-1)


def kl_pairwise(μ_q, σ_q, eps=1e-6):
    """§3.2 ``KL(q_i‖q_j)`` for all pairs: (B, N, N), row i, column j."""
    B, N, K = μ_q.shape
    var_q = σ_q.square() + eps  # (B, N, K)

    μ_i = μ_q.unsqueeze(2)  # (B, N, 1, K)
    μ_j = μ_q.unsqueeze(1)  # (B, 1, N, K)
    var_i = var_q.unsqueeze(2)
    var_j = var_q.unsqueeze(1)

    log_ratio = torch.log(var_j / var_i)  # (B, N, N, K)
    trace_term = var_i / var_j
    mahal_term = (μ_i - μ_j).square() / var_j

    kl = 0.5 * (log_ratio + trace_term + mahal_term - 1.0)
    return kl.sum(dim=-1)  # (B, N, N)


def compute_attention(kl_matrix, kappa=1.0, mask=None):
    """§1.3 ``β_ij = softmax_j(−KL_ij/κ)`` over the keys ``mask[i, j]`` allows.

    A row with no allowed key would be softmax of all −inf (NaN); it gets β = 0
    (no alignment term) — the trailing masked_fill is a no-op on every other row.
    """
    logits = -kl_matrix / kappa  # (B, N, N)

    if mask is not None:
        logits = logits.masked_fill(~mask, float('-inf'))

    β = F.softmax(logits, dim=-1)
    if mask is not None:
        β = β.masked_fill(~mask, 0.0)
    return β


def attention_mask(n: int, causal: bool, mask_diagonal: bool, device=None):
    """The boolean (N, N) mask ``mask[i, j]``: may belief i attend to belief j.

    None when every pair is allowed (full attention, diagonal kept).
    """
    if not causal and not mask_diagonal:
        return None
    mask = torch.ones(n, n, device=device, dtype=torch.bool)
    if causal:
        mask = torch.tril(mask)
    if mask_diagonal:
        mask = mask & ~torch.eye(n, device=device, dtype=torch.bool)
    return mask


def kl_to_token_priors(μ_q, σ_q, μ_tokens, σ_tokens, eps=1e-6):
    """``KL(q_i‖π_v)`` against every token prior: (B, N, V) (the §3.3 broadcast)."""
    var_q = σ_q.square() + eps
    var_t = σ_tokens.square() + eps

    μ_i = μ_q.unsqueeze(2)  # (B, N, 1, K)
    var_i = var_q.unsqueeze(2)
    μ_v = μ_tokens  # (V, K), broadcasts as (1, 1, V, K)
    var_v = var_t

    log_ratio = torch.log(var_v / var_i)  # (B, N, V, K)
    trace_term = var_i / var_v
    mahal_term = (μ_i - μ_v).square() / var_v

    kl = 0.5 * (log_ratio + trace_term + mahal_term - 1.0)
    return kl.sum(dim=-1)  # (B, N, V)


class TokenPriorBank(nn.Module):
    """§2.2 one prior ``π_v = N(μ_v, σ_v²)`` per token: embedding and output at once.

    ENCODING: ``q_i ← π_{token[i]}``; DECODING: ``logits_v = −KL(q_i‖π_v)/τ``.
    """

    def __init__(self, vocab_size: int, embed_dim: int, variance_floor: float = 1e-4):
        super().__init__()
        # scale 1/sqrt(K): two token priors start ~1 nat apart (E KL = 1), so the
        # initial decode is near uniform instead of ~K nats sharp
        self.mu = nn.Parameter(torch.randn(vocab_size, embed_dim) / math.sqrt(embed_dim))
        self.log_sigma = nn.Parameter(torch.zeros(vocab_size, embed_dim))
        self.sigma_min = math.sqrt(variance_floor)

    @property
    def sigma(self):
        """σ_v, floored like the beliefs' (σ² ≥ variance_floor)."""
        return self.log_sigma.exp().clamp(min=self.sigma_min)

    def encode(self, token_ids):
        return self.mu[token_ids], self.sigma[token_ids]

    def decode(self, μ_q, σ_q, tau=1.0, eps=1e-6):
        """(B, N, V) logits ``−KL(q‖π_v)/τ``."""
        return -kl_to_token_priors(μ_q, σ_q, self.mu, self.sigma, eps) / tau


def observation_likelihood(μ_q, σ_q, token_priors, target_ids, tau=1.0, eps=1e-6):
    """§3.3 ``−log p(y_i|q_i)`` with ``p(y|q) ∝ exp(−KL(q‖π_y)/τ)``: (B, N)."""
    B, N, K = μ_q.shape
    V = token_priors.mu.shape[0]
    logits = token_priors.decode(μ_q, σ_q, tau, eps)  # (B, N, V)
    loss = F.cross_entropy(
        logits.reshape(-1, V),
        target_ids.reshape(-1),
        reduction='none'
    ).view(B, N)
    return loss


def compute_vfe(μ_q, σ_q, μ_p, σ_p, mask, token_priors, target_ids, config, β=None):
    """§3.4 ``F = α Σ KL(q_i‖p_i) + λ_β Σ β_ij KL(q_i‖q_j) + Σ CE_i``.

    β defaults to the attention of the beliefs themselves, so autograd of F
    includes the product rule through β (the reference for the analytic
    gradients). ``target_ids=None`` drops the observation term. Returns
    ``(F, {"F_self", "F_align", "F_obs"})`` as tensors.
    """
    check_beliefs(μ_q, σ_q, μ_p, σ_p)
    kl_self = kl_self_coupling(μ_q, σ_q, μ_p, σ_p, config.eps)
    F_self = config.alpha * kl_self.sum()

    kl_matrix = kl_pairwise(μ_q, σ_q, config.eps)
    if β is None:
        β = compute_attention(kl_matrix, config.kappa, mask)
    alignment = (β * kl_matrix).sum(dim=-1)
    F_align = config.lambda_beta * alignment.sum()

    if target_ids is None:
        F_obs = torch.zeros((), dtype=μ_q.dtype, device=μ_q.device)
    else:
        F_obs = observation_likelihood(μ_q, σ_q, token_priors, target_ids, config.tau, config.eps).sum()
    return F_self + F_align + F_obs, {'F_self': F_self, 'F_align': F_align, 'F_obs': F_obs}


# ---------------------------------------------------------------------------
# §4: analytic gradients of F
# ---------------------------------------------------------------------------

def compute_observation_gradient(μ_q, σ_q, token_priors, target_ids, tau=1.0, eps=1e-6):
    """``(∂CE/∂μ_i, ∂CE/∂v_i)`` of ``CE_i = −log softmax_v(ℓ_iv)[y_i]``, ``ℓ_iv = −KL(q_i‖π_v)/τ``.

    With ``e_iv = softmax(ℓ_i)_v − [v = y_i]`` (= ∂CE_i/∂ℓ_iv) and token variances s_v:
        ∂ℓ_iv/∂μ_i = −(μ_i − μ_v)/(τ s_v)           ∂ℓ_iv/∂v_i = −(1/s_v − 1/v_i)/(2τ)
        ∂CE/∂μ_i = −(μ_i · (e_i @ 1/s) − e_i @ (μ/s)) / τ
        ∂CE/∂v_i = −(e_i @ 1/s − (Σ_v e_iv)/v_i) / (2τ)      (Σ_v e_iv = 0 up to rounding)
    """
    V = token_priors.mu.shape[0]
    var_q = σ_q.square() + eps
    var_t = token_priors.sigma.square() + eps  # (V, K)
    logits = token_priors.decode(μ_q, σ_q, tau, eps)  # (B, N, V)
    err = F.softmax(logits, dim=-1) - F.one_hot(target_ids, V).to(logits.dtype)  # (B, N, V)
    precision_t = 1.0 / var_t
    err_precision = err @ precision_t  # (B, N, K)
    grad_mu = -(μ_q * err_precision - err @ (token_priors.mu * precision_t)) / tau
    grad_var = -(err_precision - err.sum(dim=-1, keepdim=True) / var_q) / (2 * tau)
    return grad_mu, grad_var


def compute_mu_gradient(μ_q, σ_q, μ_p, σ_p, β, kl_matrix, token_priors, targets, config):
    """§4.1 ``∂F/∂μ_i`` (``∂F_i/∂μ_i`` with ``q_flow_gradient="agent"``).

    Write the alignment energy row by row, ``A_i = Σ_j β_ij KL_ij``. Since
    ``∂β_ij/∂KL_il = −β_ij(δ_jl − β_il)/κ``,

        dA_i = Σ_l W_il dKL_il,   W_il = β_il − β_il (KL_il − Ā_i)/κ .

    μ_i enters KL_ij (first slot, row i) and KL_ji (second slot, row j), so

        ∂A/∂μ_i = Σ_j W_ij (μ_i − μ_j)/v_j        [direct + product rule through row i's β]
                + Σ_j W_ji (μ_i − μ_j)/v_i        [others aligning to i, + product rule through row j's β]

    The β part of the direct term is the spec's form ``Σ_j ∂β_ij/∂μ_i · KL_ij``
    with ``∂β_ij/∂μ_i = −β_ij (g_ij − Σ_l β_il g_il)/κ``, ``g_ij = ∂KL_ij/∂μ_i``;
    the spec's others term uses β_ji alone, the product rule through row j's
    softmax adds ``−β_ji (KL_ji − Ā_j)/κ``. Masked entries have β = 0, so the
    mask needs no further care. Plus ``α (μ_i − μ_pi)/v_pi`` and the observation
    gradient (:func:`compute_observation_gradient`) when ``targets`` is given.
    """
    B, N, K = μ_q.shape
    var_q = σ_q.square() + config.eps
    var_p = σ_p.square() + config.eps

    # 1. Self-coupling: ∂KL(q_i||p_i)/∂μ_qi
    grad_self = (μ_q - μ_p) / var_p  # (B, N, K)

    # 2. Alignment, i aligning to others j: ∂KL(q_i||q_j)/∂μ_qi = (μ_qi − μ_qj) / var_qj
    var_j = var_q.unsqueeze(1)  # (B, 1, N, K)
    μ_diff = μ_q.unsqueeze(2) - μ_q.unsqueeze(1)  # (B, N, N, K): μ_i − μ_j
    grad_kl_direct = μ_diff / var_j  # (B, N, N, K)

    grad_align_direct = (β.unsqueeze(-1) * grad_kl_direct).sum(dim=2)  # (B, N, K)

    # Product rule through β: ∂β_ij/∂μ_qi = −β_ij·[∂KL_ij/∂μ_qi − Σ_l β_il·∂KL_il/∂μ_qi] / κ
    mean_grad_kl = (β.unsqueeze(-1) * grad_kl_direct).sum(dim=2, keepdim=True)  # (B, N, 1, K)
    grad_beta = -β.unsqueeze(-1) * (grad_kl_direct - mean_grad_kl) / config.kappa  # (B, N, N, K)
    grad_align_beta = (grad_beta * kl_matrix.unsqueeze(-1)).sum(dim=2)  # (B, N, K)

    grad_align = grad_align_direct + grad_align_beta

    if config.q_flow_gradient == "joint":
        # 3. Others aligning to i: Σ_j W_ji·∂KL(q_j||q_i)/∂μ_qi, ∂KL(q_j||q_i)/∂μ_qi = (μ_qi − μ_qj)/var_qi
        grad_others_to_i = -μ_diff.transpose(1, 2) / var_q.unsqueeze(2)  # (B, N, N, K), [i, j]
        grad_align_others = (β.transpose(1, 2).unsqueeze(-1) * grad_others_to_i).sum(dim=2)

        # ... and through row j's softmax: W_ji − β_ji = −β_ji (KL_ji − Ā_j) / κ
        row_alignment = (β * kl_matrix).sum(dim=-1, keepdim=True)  # (B, N, 1): Ā_j
        others_beta = -β * (kl_matrix - row_alignment) / config.kappa  # (B, N, N), [j, i]
        grad_align_others_beta = (others_beta.transpose(1, 2).unsqueeze(-1) * grad_others_to_i).sum(dim=2)

        grad_align = grad_align + grad_align_others + grad_align_others_beta

    total_grad = config.alpha * grad_self + config.lambda_beta * grad_align

    # 4. Observation
    if targets is not None:
        grad_obs, _ = compute_observation_gradient(μ_q, σ_q, token_priors, targets, config.tau, config.eps)
        total_grad = total_grad + grad_obs

    return total_grad


def compute_sigma_gradient(μ_q, σ_q, μ_p, σ_p, β, kl_matrix, token_priors, targets, config):
    """§4.2 ``∂F/∂σ_i = 2σ_i ∂F/∂v_i``, the alignment part completed.

    Same bookkeeping as :func:`compute_mu_gradient` (``dA = Σ W_il dKL_il``), with
    the variance derivatives of ``KL_ij = ½Σ[log v_j − log v_i + v_i/v_j + (μ_i−μ_j)²/v_j − 1]``:

        first slot  (row i):  ∂KL_ij/∂v_i = ½ (1/v_j − 1/v_i)
        second slot (row j):  ∂KL_ji/∂v_i = ½ (1/v_i − (v_j + (μ_j − μ_i)²)/v_i²)

    so
        ∂A/∂v_i = Σ_j β_ij h_ij − Σ_j β_ij (h_ij − Σ_l β_il h_il) KL_ij/κ     [direct, product rule]
                + Σ_j β_ji h'_ji − Σ_j β_ji (KL_ji − Ā_j) h'_ji/κ             [others, product rule]

    with ``h_ij = ∂KL_ij/∂v_i`` and ``h'_ji = ∂KL_ji/∂v_i`` (``Σ_j β_ij (h_ij − h̄_i) KL_ij
    = Σ_j β_ij h_ij (KL_ij − Ā_i)``: the same W as for the mean). The "agent"
    gradient keeps the first line only. Self-coupling: ``α ½(1/v_pi − 1/v_i)``;
    observation: :func:`compute_observation_gradient`. Because ``v = σ² + eps``,
    ``∂v/∂σ = 2σ`` exactly.
    """
    var_q = σ_q.square() + config.eps
    var_p = σ_p.square() + config.eps

    # Self-coupling: ∂KL(q||p)/∂var_q = ½(1/var_p − 1/var_q)
    grad_var_self = 0.5 * (1.0 / var_p - 1.0 / var_q)

    # Alignment, i aligning to j: ∂KL(q_i||q_j)/∂var_qi = ½(1/var_qj − 1/var_qi)
    inv_var = 1.0 / var_q
    grad_kl_var_direct = 0.5 * (inv_var.unsqueeze(1) - inv_var.unsqueeze(2))  # (B, N, N, K)
    grad_var_align_direct = (β.unsqueeze(-1) * grad_kl_var_direct).sum(dim=2)

    mean_grad_kl_var = (β.unsqueeze(-1) * grad_kl_var_direct).sum(dim=2, keepdim=True)
    grad_var_beta = -β.unsqueeze(-1) * (grad_kl_var_direct - mean_grad_kl_var) / config.kappa
    grad_var_align_beta = (grad_var_beta * kl_matrix.unsqueeze(-1)).sum(dim=2)

    grad_var_align = grad_var_align_direct + grad_var_align_beta

    if config.q_flow_gradient == "joint":
        # Others aligning to i: ∂KL(q_j||q_i)/∂var_qi = ½(1/var_qi − (var_qj + (μ_qj − μ_qi)²)/var_qi²)
        μ_diff = μ_q.unsqueeze(2) - μ_q.unsqueeze(1)  # (B, N, N, K): μ_i − μ_j
        var_i = var_q.unsqueeze(2)
        grad_kl_var_others = 0.5 * (1.0 / var_i - (var_q.unsqueeze(1) + μ_diff.square()) / var_i.square())
        grad_var_align_others = (β.transpose(1, 2).unsqueeze(-1) * grad_kl_var_others).sum(dim=2)

        row_alignment = (β * kl_matrix).sum(dim=-1, keepdim=True)  # (B, N, 1): Ā_j
        others_beta = -β * (kl_matrix - row_alignment) / config.kappa  # (B, N, N), [j, i]
        grad_var_align_others_beta = (others_beta.transpose(1, 2).unsqueeze(-1) * grad_kl_var_others).sum(dim=2)

        grad_var_align = grad_var_align + grad_var_align_others + grad_var_align_others_beta

    total_grad_var = config.alpha * grad_var_self + config.lambda_beta * grad_var_align

    if targets is not None:
        _, grad_var_obs = compute_observation_gradient(μ_q, σ_q, token_priors, targets, config.tau, config.eps)
        total_grad_var = total_grad_var + grad_var_obs

    # ∂F/∂σ = 2σ · ∂F/∂var
    return 2 * σ_q * total_grad_var


def natural_gradient_step(μ_q, σ_q, grad_μ, grad_σ, lr_μ=0.1, lr_σ=0.01, variance_floor=1e-4):
    """§4.3 one natural-gradient step (Fisher–Rao metric of a diagonal Gaussian).

        μ_new = μ − η_μ σ² ∂F/∂μ                 (G_μμ = 1/σ²)
        σ_new = σ · exp(−η_σ σ² ∂F/∂v)           (natural gradient on log σ, G = 2:
                                                  ½ ∂F/∂log σ = σ² ∂F/∂v = ½ σ ∂F/∂σ)

    The σ update is multiplicative, so σ stays positive, and σ is floored at
    ``sqrt(variance_floor)`` (σ² ≥ floor). Both steps are clipped to the trust
    region ``MAX_FISHER_STEP`` (|Δμ| ≤ c σ, |Δ log σ| ≤ c).
    """
    var_q = σ_q.square()
    max_μ_step = MAX_FISHER_STEP * σ_q
    μ_new = μ_q - torch.clamp(lr_μ * var_q * grad_μ, min=-max_μ_step, max=max_μ_step)

    log_step = (-lr_σ * 0.5 * σ_q * grad_σ).clamp(-MAX_FISHER_STEP, MAX_FISHER_STEP)
    σ_new = σ_q * torch.exp(log_step)
    σ_new = σ_new.clamp(min=math.sqrt(variance_floor))
    return μ_new, σ_new


# ---------------------------------------------------------------------------
# §5: the two timescales
# ---------------------------------------------------------------------------

def q_flow(μ_q, σ_q, μ_p, σ_p, mask, token_priors, targets, config, attention=None):
    """§5.1 ``n_vfe_steps`` natural-gradient steps on F with the priors fixed.

    β is recomputed from the current beliefs at every step. ``targets=None``
    (or ``config.observation_in_q_flow=False``) drops the observation term.
    Returns ``(μ_q, σ_q, β)``, β of the last step (None when n_vfe_steps = 0).
    ``attention``, a list, receives β of every step (for inspection, Phase 4.3).
    """
    check_beliefs(μ_q, σ_q, μ_p, σ_p)
    if not config.observation_in_q_flow:
        targets = None
    β = None
    for step in range(config.n_vfe_steps):
        kl_matrix = kl_pairwise(μ_q, σ_q, config.eps)
        β = compute_attention(kl_matrix, config.kappa, mask)
        if attention is not None:
            attention.append(β.detach())

        grad_μ = compute_mu_gradient(μ_q, σ_q, μ_p, σ_p, β, kl_matrix, token_priors, targets, config)
        grad_σ = compute_sigma_gradient(μ_q, σ_q, μ_p, σ_p, β, kl_matrix, token_priors, targets, config)

        μ_q, σ_q = natural_gradient_step(μ_q, σ_q, grad_μ, grad_σ,
                                         config.lr_mu, config.lr_sigma, config.variance_floor)
    return μ_q, σ_q, β


def p_flow(μ_p, σ_p, μ_q, σ_q, errors, config):
    """§5.2 position priors drift toward the batch-mean beliefs, faster where errors are high.

        s_n = sqrt(clamp(e_n / (mean(e) + 1e-6), 0.5, 2))
        μ_p ← μ_p + lr_prior · s_n · (mean_b μ_q[b, n] − μ_p[n])

    ``errors``: (N,) per-position prediction error. σ_p is kept (the spec's
    "optional" variance update is not made). Returns ``(μ_p_new, σ_p)``.
    """
    μ_q_avg = μ_q.mean(dim=0)  # (N, K)

    mean_error = errors.mean()
    relative_error = errors / (mean_error + 1e-6)  # (N,)
    lr_scale = torch.sqrt(relative_error.clamp(0.5, 2.0))

    lr_per_pos = config.lr_prior * lr_scale.unsqueeze(-1)  # (N, 1)
    μ_p_new = μ_p + lr_per_pos * (μ_q_avg - μ_p)
    return μ_p_new, σ_p


def update_token_priors(token_priors, μ_q, target_ids, lr_token_prior):
    """§5.3 move each target token's prior mean toward the beliefs that predicted it.

    Vectorised form of the spec's loop ``for b, n: μ_v += lr (μ_q[b, n] − μ_v)``
    with ``v = target_ids[b, n]``, visiting (b, n) in row-major order. For a token
    met c times, with beliefs x_1..x_c in that order, the loop gives

        μ_v ← (1 − lr)^c μ_v + Σ_t lr (1 − lr)^(c − t) x_t

    so each occurrence is weighted by its rank t among the occurrences of its
    token (stable sort), and the sum is one ``index_add_``. In place, no grad.
    """
    with torch.no_grad():
        mu = token_priors.mu
        V, K = mu.shape
        targets = target_ids.reshape(-1)
        beliefs = μ_q.reshape(-1, K).to(mu.dtype)
        M = targets.numel()

        counts = torch.bincount(targets, minlength=V)  # (V,)
        order = torch.sort(targets, stable=True).indices
        group_start = torch.cumsum(counts, 0) - counts  # first sorted index of each token
        rank_sorted = torch.arange(M, device=targets.device) - group_start[targets[order]]
        rank = torch.empty_like(rank_sorted)
        rank[order] = rank_sorted  # 0-based rank of each occurrence among its token's
        remaining = (counts[targets] - 1 - rank).to(mu.dtype)  # later occurrences of the same token

        keep = 1.0 - lr_token_prior
        weights = lr_token_prior * keep ** remaining  # (M,)
        update = torch.zeros_like(mu).index_add_(0, targets, weights.unsqueeze(-1) * beliefs)
        mu.mul_((keep ** counts.to(mu.dtype)).unsqueeze(-1)).add_(update)


# ---------------------------------------------------------------------------
# Input checks (value checks only in eager: under tracing they would be data-dependent)
# ---------------------------------------------------------------------------

def _values_checkable(*tensors) -> bool:
    if torch.compiler.is_compiling():
        return False
    from torch._subclasses.fake_tensor import FakeTensor
    return not any(isinstance(t, FakeTensor) for t in tensors)


def check_beliefs(μ_q, σ_q, μ_p, σ_p):
    """Raise ValueError unless the shapes line up and every σ is positive."""
    if μ_q.dim() != 3:
        raise ValueError(f"μ_q must be (batch, seq_len, embed_dim), got shape {tuple(μ_q.shape)}")
    if σ_q.shape != μ_q.shape:
        raise ValueError(f"σ_q must have μ_q's shape {tuple(μ_q.shape)}, got {tuple(σ_q.shape)}")
    expected_prior = tuple(μ_q.shape[1:])
    for name, t in (("μ_p", μ_p), ("σ_p", σ_p)):
        if tuple(t.shape[-2:]) != expected_prior or t.dim() not in (2, 3):
            raise ValueError(f"{name} must be (seq_len, embed_dim) = {expected_prior} "
                             f"(or batched), got shape {tuple(t.shape)}")
    if _values_checkable(σ_q, σ_p):
        for name, t in (("σ_q", σ_q), ("σ_p", σ_p)):
            if not bool((t > 0).all()):
                raise ValueError(f"{name} must be > 0 everywhere (a standard deviation), "
                                 f"got min {float(t.min()):.3g}")


def _check_token_ids(name, ids, vocab_size, max_seq_len, batch_shape=None):
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name} must be an int64 tensor of token ids, got "
                         f"{ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__}")
    if ids.dim() != 2:
        raise ValueError(f"{name} must be (batch, seq_len), got shape {tuple(ids.shape)}")
    if batch_shape is not None and tuple(ids.shape) != batch_shape:
        raise ValueError(f"{name} must have input_ids' shape {batch_shape}, got {tuple(ids.shape)}")
    if ids.shape[1] > max_seq_len:
        raise ValueError(f"{name} has seq_len {ids.shape[1]} > max_seq_len {max_seq_len} "
                         f"(the position priors cover {max_seq_len} positions)")
    if ids.shape[1] < 1:
        raise ValueError(f"{name} must have seq_len >= 1, got {ids.shape[1]}")
    if _values_checkable(ids) and ids.numel() > 0:
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"{name} must hold ids in [0, {vocab_size}), got values in [{lo}, {hi}]")


# ---------------------------------------------------------------------------
# §6: the model
# ---------------------------------------------------------------------------

class PositionPriors(nn.Module):
    """§2.3 one layer's position-dependent priors ``p_n = N(μ_pn, σ_pn²)``."""

    def __init__(self, max_seq_len: int, embed_dim: int):
        super().__init__()
        self.mu = nn.Parameter(torch.randn(max_seq_len, embed_dim) * 0.1)
        self.log_sigma = nn.Parameter(torch.zeros(max_seq_len, embed_dim))


class PureFEPTransformer(nn.Module):
    """§6.2 the Pure FEP transformer: token prior bank + per-layer position priors + Q-flow."""

    def __init__(self, config: PureFEPConfig):
        super().__init__()
        self.config = config
        self.token_priors = TokenPriorBank(config.vocab_size, config.embed_dim, config.variance_floor)
        self.position_priors = nn.ModuleList(
            PositionPriors(config.max_seq_len, config.embed_dim) for _ in range(config.n_layers))

    def forward(self, input_ids, target_ids=None, return_beliefs=False, return_logits=True,
                reduction="mean", attention=None):
        """``(logits (B, N, V), loss or None)``; with ``return_beliefs`` also the
        list of each layer's output beliefs ``(μ_q, σ_q)`` (what P-flow uses).

        ``reduction`` is F.cross_entropy's ("mean", "sum" or "none": per token, (B·N,)).
        ``return_logits=False`` puts None in the logits' place: training that only needs
        the loss then never forms the (B, N, V) logits once compiled (decode and
        cross-entropy fuse). ``attention``, a list, receives one list per layer of β
        (B, N, N) at every Q-flow step (eager inspection, Phase 4.3)."""
        config = self.config
        _check_token_ids("input_ids", input_ids, config.vocab_size, config.max_seq_len)
        if target_ids is not None:
            _check_token_ids("target_ids", target_ids, config.vocab_size, config.max_seq_len,
                             tuple(input_ids.shape))
        B, N = input_ids.shape

        # ENCODING: beliefs start at the token priors
        μ_q, σ_q = self.token_priors.encode(input_ids)  # (B, N, K)

        mask = attention_mask(N, config.causal, config.mask_diagonal, input_ids.device)

        beliefs = []
        for priors in self.position_priors:
            μ_p = priors.mu[:N]  # (N, K)
            σ_p = priors.log_sigma[:N].exp().clamp(min=math.sqrt(config.variance_floor))
            layer_attention = None if attention is None else []
            μ_q, σ_q, β = q_flow(μ_q, σ_q, μ_p, σ_p, mask, self.token_priors, target_ids, config,
                                 layer_attention)
            if attention is not None:
                attention.append(layer_attention)
            beliefs.append((μ_q, σ_q))

        # DECODING: logits via KL to the token priors
        logits = self.token_priors.decode(μ_q, σ_q, config.tau, config.eps)  # (B, N, V)

        loss = None
        if target_ids is not None:
            loss = F.cross_entropy(logits.view(-1, config.vocab_size), target_ids.reshape(-1),
                                   reduction=reduction)
        if not return_logits:
            logits = None
        if return_beliefs:
            return logits, loss, beliefs
        return logits, loss

    def train_step(self, input_ids, target_ids, optimizer, forward=None):
        """One training step: backprop on the priors, then P-flow (§6.2 ``train_step``).

        1. forward (Q-flow unrolled) and ``loss.backward()``: the gradient reaches the
           token and position priors through every Q-flow step; ``optimizer.step()``.
        2. P-flow, no grad: each layer's position priors move toward that layer's
           batch-mean output beliefs, weighted by the per-position loss (§5.2);
           the target tokens' priors move toward the final beliefs (§5.3).

        ``forward`` is the callable to run (e.g. ``torch.compile(model)``), default
        the model itself. Returns the loss (a detached scalar tensor).
        """
        forward = self if forward is None else forward
        config = self.config
        optimizer.zero_grad(set_to_none=True)
        _, token_loss, beliefs = forward(input_ids, target_ids, return_beliefs=True,
                                         return_logits=False, reduction="none")
        loss = token_loss.mean()
        loss.backward()
        optimizer.step()

        with torch.no_grad():
            B, N = input_ids.shape
            errors = token_loss.detach().view(B, N).mean(dim=0)  # per-position loss (N,)
            if config.lr_prior > 0:
                for priors, (μ_q, σ_q) in zip(self.position_priors, beliefs):
                    μ_p_new, _ = p_flow(priors.mu[:N], priors.log_sigma[:N].exp(),
                                        μ_q.detach(), σ_q.detach(), errors, config)
                    priors.mu[:N] = μ_p_new
            if config.lr_token_prior > 0:
                update_token_priors(self.token_priors, beliefs[-1][0].detach(), target_ids,
                                    config.lr_token_prior)
        return loss.detach()


def demo_example():
    """A small model and ``(input_ids, target_ids)`` for ``hecate explain pure_fep``."""
    config = PureFEPConfig(vocab_size=32, embed_dim=8, n_layers=2, max_seq_len=16, n_vfe_steps=2)
    model = PureFEPTransformer(config)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (2, 9), generator=generator)
    return model, (ids[:, :-1].contiguous(), ids[:, 1:].contiguous())
