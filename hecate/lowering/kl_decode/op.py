"""``torch.ops.hecate.kl_decode_ce`` and ``torch.ops.hecate.kl_decode_logits``: decoding through the token prior bank.

Schemas::

    kl_decode_ce(Tensor mu, Tensor var, Tensor prior_mu, Tensor prior_var, Tensor targets,
                 float tau, int ignore_index) -> (Tensor loss, Tensor lse)
    kl_decode_logits(Tensor mu, Tensor var, Tensor prior_mu, Tensor prior_var, float tau) -> Tensor logits

    mu, var              [M, K]   beliefs (var > 0; the caller adds any eps)
    prior_mu, prior_var  [V, K]   the token priors π_v
    targets              [M]      int64 token ids
    loss                 [M]      cross-entropy of logits_i· = −KL(q_i‖π_·)/τ at t_i (0 where t_i = ignore_index)
    lse                  [M]      logsumexp_v logits_iv (what the backward recomputes softmax from), float64:
                                  at |logits| ~ 550 fp32 would round it by 3e-5, and every probability with it
    logits               [M, V]   −KL(q_i‖π_v)/τ  (when the model asks for them)

``kl_decode_ce`` never forms [M, V] on the Triton path (online logsumexp over vocab
blocks; the backward recomputes). Neither op forms [M, V, K]. Both are
differentiable in mu, var, prior_mu and prior_var; their backwards are the ops
``hecate.kl_decode_ce_backward`` and ``hecate.kl_decode_logits_backward``.
``kl_decode_logits`` is a GEMM plus a bias: its Triton kernel writes the tile; its
backward is two GEMMs (``torch.mm``, i.e. cuBLAS on CUDA).
"""

from __future__ import annotations

import math

import torch
import triton

from hecate.lowering.dispatch import check_devices, dense, interpreting, use_triton
from hecate.lowering.kl_decode import matmul_form
from hecate.lowering.registry import differentiable_backward


def check_inputs(mu, var, prior_mu, prior_var, tau, targets=None) -> None:
    """Raise a ValueError naming the argument, what it was and what was expected."""
    if mu.dim() != 2 or not mu.dtype.is_floating_point:
        raise ValueError(f"kl_decode: mu must be a floating [M, K] tensor, got shape {tuple(mu.shape)} {mu.dtype}")
    if var.shape != mu.shape or var.dtype != mu.dtype:
        raise ValueError(f"kl_decode: var must match mu ({tuple(mu.shape)}, {mu.dtype}), "
                         f"got {tuple(var.shape)} {var.dtype}")
    if prior_mu.dim() != 2 or prior_mu.shape[1] != mu.shape[1] or prior_mu.dtype != mu.dtype:
        raise ValueError(f"kl_decode: prior_mu must be [V, K={mu.shape[1]}] of dtype {mu.dtype}, "
                         f"got {tuple(prior_mu.shape)} {prior_mu.dtype}")
    if prior_var.shape != prior_mu.shape or prior_var.dtype != mu.dtype:
        raise ValueError(f"kl_decode: prior_var must match prior_mu ({tuple(prior_mu.shape)}), "
                         f"got {tuple(prior_var.shape)} {prior_var.dtype}")
    if prior_mu.shape[0] == 0:
        raise ValueError("kl_decode: the prior bank is empty (V = 0)")
    check_devices("kl_decode", "mu", mu, var=var, prior_mu=prior_mu, prior_var=prior_var, targets=targets)
    if not (isinstance(tau, (int, float)) and math.isfinite(tau) and tau > 0):
        raise ValueError(f"kl_decode: tau must be a finite number > 0, got {tau!r}")
    if targets is not None and (targets.shape != mu.shape[:1] or targets.dtype != torch.int64):
        raise ValueError(f"kl_decode: targets must be int64 of shape [M={mu.shape[0]}], "
                         f"got {tuple(targets.shape)} {targets.dtype}")


def check_targets(targets: torch.Tensor, v: int, ignore_index: int) -> None:
    """As F.cross_entropy: every target is a class in [0, V) or ``ignore_index`` (an error otherwise)."""
    bad = ((targets < 0) | (targets >= v)) & (targets != ignore_index)
    if bool(bad.any()):
        raise IndexError(f"kl_decode_ce: targets must be token ids in [0, V={v}) or ignore_index={ignore_index}, "
                         f"got {targets[bad][0].item()}")


def _use_kernels(mu: torch.Tensor) -> bool:
    """The Triton kernels compute in fp32: float64 runs the ATen path, in float64."""
    return use_triton(mu) and mu.dtype != torch.float64


# ---------------------------------------------------------------------------------------------
# logits


@torch.library.custom_op("hecate::kl_decode_logits", mutates_args=())
def kl_decode_logits(mu: torch.Tensor, var: torch.Tensor, prior_mu: torch.Tensor, prior_var: torch.Tensor,
                     tau: float) -> torch.Tensor:
    check_inputs(mu, var, prior_mu, prior_var, tau)
    if _use_kernels(mu):
        return dense(_triton_logits(mu, var, prior_mu, prior_var, tau))
    return dense(matmul_form.logits(mu, var, prior_mu, prior_var, tau))


@kl_decode_logits.register_fake
def _(mu, var, prior_mu, prior_var, tau):
    check_inputs(mu, var, prior_mu, prior_var, tau)
    return mu.new_empty(mu.shape[0], prior_mu.shape[0])


@torch.library.custom_op("hecate::kl_decode_logits_backward", mutates_args=())
def kl_decode_logits_backward(mu: torch.Tensor, var: torch.Tensor, prior_mu: torch.Tensor, prior_var: torch.Tensor,
                              grad_logits: torch.Tensor, tau: float
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return dense(matmul_form.grad_from_logits(mu, var, prior_mu, prior_var, grad_logits, tau))


@kl_decode_logits_backward.register_fake
def _(mu, var, prior_mu, prior_var, grad_logits, tau):
    return tuple(t.new_empty(t.shape) for t in (mu, var, prior_mu, prior_var))


def _logits_setup(ctx, inputs, output):
    mu, var, prior_mu, prior_var, tau = inputs
    ctx.save_for_backward(mu, var, prior_mu, prior_var)
    ctx.tau = tau


def _logits_backward(ctx, grad_logits):
    mu, var, prior_mu, prior_var = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph=True: this gradient is differentiated again
        return differentiable_backward(torch.ops.hecate.kl_decode_logits.default,
                                       (mu, var, prior_mu, prior_var, ctx.tau), (grad_logits,))
    grads = torch.ops.hecate.kl_decode_logits_backward(mu, var, prior_mu, prior_var, grad_logits, ctx.tau)
    return (*grads, None)


kl_decode_logits.register_autograd(_logits_backward, setup_context=_logits_setup)


# ---------------------------------------------------------------------------------------------
# cross-entropy


@torch.library.custom_op("hecate::kl_decode_ce", mutates_args=())
def kl_decode_ce(mu: torch.Tensor, var: torch.Tensor, prior_mu: torch.Tensor, prior_var: torch.Tensor,
                 targets: torch.Tensor, tau: float, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    check_inputs(mu, var, prior_mu, prior_var, tau, targets)
    check_targets(targets, prior_mu.shape[0], ignore_index)
    if _use_kernels(mu):
        return dense(_triton_ce(mu, var, prior_mu, prior_var, targets, tau, ignore_index))
    return dense(matmul_form.ce(mu, var, prior_mu, prior_var, targets, tau, ignore_index))


@kl_decode_ce.register_fake
def _(mu, var, prior_mu, prior_var, targets, tau, ignore_index):
    check_inputs(mu, var, prior_mu, prior_var, tau, targets)
    return mu.new_empty(mu.shape[0]), mu.new_empty(mu.shape[0], dtype=torch.float64)


@torch.library.custom_op("hecate::kl_decode_ce_backward", mutates_args=())
def kl_decode_ce_backward(mu: torch.Tensor, var: torch.Tensor, prior_mu: torch.Tensor, prior_var: torch.Tensor,
                          targets: torch.Tensor, lse: torch.Tensor, grad_loss: torch.Tensor, tau: float,
                          ignore_index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if _use_kernels(mu):
        return dense(_triton_ce_backward(mu, var, prior_mu, prior_var, targets, lse, grad_loss, tau, ignore_index))
    grad_logits = matmul_form.ce_grad_logits(mu, var, prior_mu, prior_var, targets, lse, grad_loss, tau,
                                             ignore_index)
    return dense(matmul_form.grad_from_logits(mu, var, prior_mu, prior_var, grad_logits, tau))


@kl_decode_ce_backward.register_fake
def _(mu, var, prior_mu, prior_var, targets, lse, grad_loss, tau, ignore_index):
    return tuple(t.new_empty(t.shape) for t in (mu, var, prior_mu, prior_var))


def _ce_setup(ctx, inputs, output):
    mu, var, prior_mu, prior_var, targets, tau, ignore_index = inputs
    ctx.save_for_backward(mu, var, prior_mu, prior_var, targets, output[1])
    ctx.mark_non_differentiable(output[1])
    ctx.config = (tau, ignore_index)


def _ce_backward(ctx, grad_loss, grad_lse):
    """Gradient of the loss only: lse is an auxiliary output (marked non-differentiable)."""
    mu, var, prior_mu, prior_var, targets, lse = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph=True: this gradient is differentiated again
        return differentiable_backward(torch.ops.hecate.kl_decode_ce.default,
                                       (mu, var, prior_mu, prior_var, targets, *ctx.config), (grad_loss, None))
    if grad_loss is None:
        grad_loss = torch.zeros_like(lse)
    grads = torch.ops.hecate.kl_decode_ce_backward(mu, var, prior_mu, prior_var, targets, lse, grad_loss,
                                                   *ctx.config)
    return (*grads, None, None, None)


kl_decode_ce.register_autograd(_ce_backward, setup_context=_ce_setup)


# ---------------------------------------------------------------------------------------------
# Triton path


def _tiles() -> tuple[int, int]:
    return (16, 16) if interpreting() else (64, 64)


def _features(mu, var, prior_mu, prior_var):
    a, c, b, d, muc, pmc = matmul_form.features(mu.float(), var.float(), prior_mu.float(), prior_var.float())
    return a.contiguous(), c.contiguous(), b.contiguous(), d.contiguous(), muc, pmc


def _triton_logits(mu, var, prior_mu, prior_var, tau):
    from hecate.lowering.kl_decode import kernels

    a, c, b, d, _, _ = _features(mu, var, prior_mu, prior_var)
    m, v, d2 = a.shape[0], b.shape[0], a.shape[1]
    z = mu.new_empty(m, v)
    bm, bv = _tiles()
    kernels._logits[(triton.cdiv(m, bm), triton.cdiv(v, bv))](
        a, c, b, d, z, m, v, d2, -1.0 / tau, BLOCK_M=bm, BLOCK_V=bv, BLOCK_D=max(16, triton.next_power_of_2(d2)))
    return z


def _triton_ce(mu, var, prior_mu, prior_var, targets, tau, ignore_index):
    from hecate.lowering.kl_decode import kernels

    a, c, b, d, _, _ = _features(mu, var, prior_mu, prior_var)
    m, v, d2 = a.shape[0], b.shape[0], a.shape[1]
    loss, lse = mu.new_empty(m), mu.new_empty(m, dtype=torch.float64)
    bm, bv = _tiles()
    kernels._ce_fwd[(triton.cdiv(m, bm),)](
        a, c, b, d, targets.contiguous(), loss, lse, m, v, d2, -1.0 / tau, ignore_index,
        BLOCK_M=bm, BLOCK_V=bv, BLOCK_D=max(16, triton.next_power_of_2(d2)))
    return loss, lse


def _triton_ce_backward(mu, var, prior_mu, prior_var, targets, lse, grad_loss, tau, ignore_index):
    from hecate.lowering.gaussian_features import key_features_backward, query_features_backward
    from hecate.lowering.kl_decode import kernels

    a, c, b, d, muc, pmc = _features(mu, var, prior_mu, prior_var)
    m, v, d2 = a.shape[0], b.shape[0], a.shape[1]
    g = torch.where(targets == ignore_index, 0.0, grad_loss.float()).contiguous()
    t = targets.contiguous()
    lse64 = lse.double().contiguous()
    grad_a, grad_c = torch.empty_like(a), torch.empty_like(c)
    grad_b, grad_d = torch.empty_like(b), torch.empty_like(d)
    bm, bv = _tiles()
    meta = dict(BLOCK_M=bm, BLOCK_V=bv, BLOCK_D=max(16, triton.next_power_of_2(d2)))
    kernels._ce_bwd_rows[(triton.cdiv(m, bm),)](a, c, b, d, t, lse64, g, grad_a, grad_c, m, v, d2, -1.0 / tau, **meta)
    kernels._ce_bwd_cols[(triton.cdiv(v, bv),)](a, c, b, d, t, lse64, g, grad_b, grad_d, m, v, d2, -1.0 / tau, **meta)
    gq_mu, gq_var = query_features_backward(muc, var.float(), grad_a, grad_c)
    gk_mu, gk_var = key_features_backward(pmc, prior_var.float(), grad_b, grad_d)
    return (gq_mu.to(mu.dtype), gq_var.to(var.dtype), gk_mu.to(prior_mu.dtype), gk_var.to(prior_var.dtype))
