"""``torch.ops.hecate.qk_preprocess``: projection → depthwise causal conv → activation → φ as one op.

Schema (see :mod:`hecate.lowering.qk_preprocess.naive` for the equations)::

    qk_preprocess(x [B, T, D_in] (or [B, T, D] without projection),
                  proj_weight [D, D_in]?, proj_bias [D]?,
                  conv_weight [D, 1, K], conv_bias [D]?,
                  activation: "silu" | "none",
                  phi: elementwise "identity" | "elu1" | "relu" | "relu2" | "exp"
                       or matrix "linear" | "random_fourier" | "performer"
                       or any other elementwise φ as a hecate.lowering.pointwise expression of the
                       activation (e.g. "sigmoid(x);mul(x,%0);mul(x,x);mul(0.5,%2);add(%1,%3)"),
                       generated into the Triton kernels with its derivative traced from autograd,
                  phi_params: [] for the elementwise kinds; [W_phi [d_phi, Dh]] for "linear" and "performer";
                              [W_phi [d_phi, Dh], b_phi [d_phi]] for "random_fourier",
                  phi_scalar: clamp max of "exp" (spec default 10.0), ignored otherwise,
                  conv_state [B, K−1, D]? = None: the K−1 projected inputs before x[:, 0] (oldest first),
                              which the conv reads instead of its zero padding)
        -> [B, T, D] (elementwise φ) or [B, T, H·d_phi] (matrix φ, H = D / Dh heads)

Streaming: the state after x is the last K−1 rows of [conv_state; projected x], :func:`next_conv_state`
(plain ATen beside the op: the op's one output is what the passes emit). A sequence processed in chunks,
each with the state after the previous one, equals the whole sequence (and so do the gradients, those of
conv_state included).

Matrix φ kinds act per head: channels c = h·Dh + i of the activation a form head a_h, and with
pre = W_phi a_h (one W_phi shared by the heads; Dh = D for a single head):
    linear          out[b, t, h·d_phi + p] = pre_p                  (nn.Linear(Dh, d_phi, bias=False))
    random_fourier  sqrt(2/d_phi) · cos(pre_p + b_phi[p])
    performer       exp(pre_p − ‖a_h‖²/2) / sqrt(d_phi)               (FAVOR+ positive random features)
i.e. the model's [B, T, H, Dh] → φ → [B, T, H, d_phi] flattened to [B, T, H·d_phi]. Polynomial and residual-MLP
φ are not fused: fuse the chain up to the activation (phi="identity") and leave φ to Inductor.

Paths: CUDA tensors (and CPU tensors inside :func:`hecate.lowering.dispatch.triton_on_cpu`) run the
Triton kernels of :mod:`.kernels`; CPU tensors, and float64 on every device, run plain ATen
(:func:`forward_aten` / :func:`backward_aten`). Under ``torch.compile`` with Inductor, CPU calls are decomposed into
that same ATen (an Inductor decomposition that declines CUDA tensors), so Inductor fuses them exactly
as it fuses the unfused model, while CUDA keeps the Triton kernels.

The backward is its own op, ``torch.ops.hecate.qk_preprocess_backward``, returning the gradients
of (x, proj_weight, proj_bias, conv_weight, conv_bias, W_phi, b_phi, conv_state); a gradient not asked for in
``output_mask`` (or of an absent tensor) comes back as an empty tensor.
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import torch
import torch.nn.functional as F

from hecate.lowering import pointwise
from hecate.lowering.autocast import register_autocast
from hecate.lowering.dispatch import dense, use_triton_kernels
from hecate.lowering.qk_preprocess.naive import (ACTIVATIONS, MATRIX_PHI, PHI_KINDS, PHI_PARAM_COUNT,
                                                 apply_activation, apply_phi, is_pointwise_phi)
from hecate.lowering.registry import differentiable_backward

GRAD_INPUTS = ("x", "proj_weight", "proj_bias", "conv_weight", "conv_bias", "phi_weight", "phi_bias", "conv_state")


def check_inputs(x: torch.Tensor, proj_weight: torch.Tensor | None, proj_bias: torch.Tensor | None,
                 conv_weight: torch.Tensor, conv_bias: torch.Tensor | None, activation: str, phi: str,
                 phi_params: Sequence[torch.Tensor], conv_state: torch.Tensor | None = None) -> None:
    """Raise a ValueError naming the argument, what it got and what it expected."""
    if x.dim() != 3:
        raise ValueError(f"qk_preprocess: x must be [B, T, D_in] (3-D), got shape {tuple(x.shape)}")
    if not x.dtype.is_floating_point:
        raise ValueError(f"qk_preprocess: x must be a floating-point tensor, got dtype {x.dtype}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"qk_preprocess: activation must be one of {list(ACTIVATIONS)}, got {activation!r}")
    if is_pointwise_phi(phi):
        try:
            pointwise.parse(phi)
        except ValueError as error:
            raise ValueError(f"qk_preprocess: phi must be one of {list(PHI_KINDS)}, got {phi!r}, which is not a "
                             f"pointwise expression of the activation either ({error})") from None
    if phi not in MATRIX_PHI and len(phi_params) != 0:
        raise ValueError(f"qk_preprocess: phi={phi!r} is elementwise and takes no phi_params, "
                         f"got {len(phi_params)} tensor(s)")
    if conv_weight.dim() != 3 or conv_weight.shape[1] != 1 or conv_weight.shape[2] < 1:
        raise ValueError("qk_preprocess: conv_weight must be the depthwise nn.Conv1d(D, D, K, groups=D) "
                         f"weight [D, 1, K], got shape {tuple(conv_weight.shape)}")
    D = conv_weight.shape[0]
    if proj_weight is not None:
        if proj_weight.dim() != 2 or proj_weight.shape[1] != x.shape[2]:
            raise ValueError(f"qk_preprocess: proj_weight must be [D, D_in] = [D, {x.shape[2]}] "
                             f"(nn.Linear layout, D_in = x.shape[-1]), got shape {tuple(proj_weight.shape)}")
        if proj_weight.shape[0] != D:
            raise ValueError(f"qk_preprocess: proj_weight has {proj_weight.shape[0]} output channels but "
                             f"conv_weight has D={D} channels; they must match")
    else:
        if proj_bias is not None:
            raise ValueError("qk_preprocess: proj_bias was given without proj_weight; pass both or neither")
        if x.shape[2] != D:
            raise ValueError(f"qk_preprocess: without a projection x must be [B, T, D] with D={D} "
                             f"(conv_weight channels), got shape {tuple(x.shape)}")
    for name, t in (("proj_bias", proj_bias), ("conv_bias", conv_bias)):
        if t is not None and tuple(t.shape) != (D,):
            raise ValueError(f"qk_preprocess: {name} must be [D] = [{D}], got shape {tuple(t.shape)}")
    phi_weight = phi_bias = None
    if phi in MATRIX_PHI:
        expected = "[W_phi [d_phi, Dh], b_phi [d_phi]]" if phi == "random_fourier" else "[W_phi [d_phi, Dh]]"
        if len(phi_params) != PHI_PARAM_COUNT[phi] or phi_params[0].dim() != 2:
            raise ValueError(f"qk_preprocess: phi={phi!r} takes phi_params={expected}, got shapes "
                             f"{[tuple(p.shape) for p in phi_params]}")
        phi_weight = phi_params[0]
        if D % phi_weight.shape[1] != 0:
            raise ValueError(f"qk_preprocess: phi={phi!r} W_phi is [d_phi, Dh] = {tuple(phi_weight.shape)}, and "
                             f"Dh={phi_weight.shape[1]} must divide D={D} (the channels split into heads of Dh)")
        if phi == "random_fourier":
            phi_bias = phi_params[1]
            if tuple(phi_bias.shape) != (phi_weight.shape[0],):
                raise ValueError(f"qk_preprocess: phi='random_fourier' b_phi must be [d_phi] = "
                                 f"[{phi_weight.shape[0]}], got shape {tuple(phi_bias.shape)}")
    expected_state = (x.shape[0], conv_weight.shape[2] - 1, D)
    if conv_state is not None and tuple(conv_state.shape) != expected_state:
        raise ValueError(f"qk_preprocess: conv_state must be [B, K-1, D] = {list(expected_state)} (the last K-1 "
                         f"projected inputs), got shape {tuple(conv_state.shape)}")
    for name, t in (("proj_weight", proj_weight), ("proj_bias", proj_bias), ("conv_weight", conv_weight),
                    ("conv_bias", conv_bias), ("phi_params[0]", phi_weight), ("phi_params[1]", phi_bias),
                    ("conv_state", conv_state)):
        if t is None:
            continue
        if t.dtype != x.dtype:
            raise ValueError(f"qk_preprocess: {name} has dtype {t.dtype} but x has {x.dtype}; all tensors "
                             "must share one dtype")
        if t.device != x.device:
            raise ValueError(f"qk_preprocess: {name} is on {t.device} but x is on {x.device}")


def output_channels(conv_weight: torch.Tensor, phi: str, phi_params: Sequence[torch.Tensor]) -> int:
    """D for elementwise φ; H·d_phi for matrix φ."""
    D = conv_weight.shape[0]
    if phi in MATRIX_PHI:
        d_phi, head_dim = phi_params[0].shape
        return D // head_dim * d_phi
    return D


# --------------------------------------------------------------------------------------------------
# The ATen path: CPU tensors, the Inductor decomposition on CPU, the MLIR decomposition.
# The conv is written as K shifted slices of the left-padded u in [B, T, D] layout (no transposes),
# so Inductor fuses conv, activation and φ into one loop over u.
# --------------------------------------------------------------------------------------------------

def left_context(u: torch.Tensor, K: int, conv_state: torch.Tensor | None) -> torch.Tensor:
    """[conv_state; u] [B, K-1+T, D]: the K-1 inputs before t = 0 (zeros without a state), then u."""
    return torch.cat([conv_state, u], 1) if conv_state is not None else F.pad(u, (0, 0, K - 1, 0))


def next_conv_state(x: torch.Tensor, proj_weight: torch.Tensor | None, proj_bias: torch.Tensor | None,
                    conv_weight: torch.Tensor, conv_state: torch.Tensor | None = None) -> torch.Tensor:
    """The streaming state after x [B, T, D_in]: the last K-1 rows of [conv_state; projected x], [B, K-1, D]
    (only the last K-1 tokens are projected)."""
    K = conv_weight.shape[2]
    tail = x[:, max(x.shape[1] - (K - 1), 0):]
    u = F.linear(tail, proj_weight, proj_bias) if proj_weight is not None else tail
    context = left_context(u, K, conv_state)
    return context[:, context.shape[1] - (K - 1):]


def causal_conv_aten(u: torch.Tensor, conv_weight: torch.Tensor, conv_bias: torch.Tensor | None,
                     conv_state: torch.Tensor | None = None) -> torch.Tensor:
    """z[b, t, c] = Σ_j w[c, 0, j] u[b, t-(K-1)+j, c] + b[c] on u [B, T, D] → [B, T, D] (u before t = 0 from
    conv_state)."""
    T = u.shape[1]
    K = conv_weight.shape[2]
    w = conv_weight[:, 0, :]                         # [D, K]
    u_padded = left_context(u, K, conv_state)        # [B, K-1+T, D]
    z = u_padded[:, 0:T] * w[:, 0]
    for j in range(1, K):
        z = z + u_padded[:, j:j + T] * w[:, j]
    return z + conv_bias if conv_bias is not None else z


def forward_aten(x: torch.Tensor, proj_weight: torch.Tensor | None, proj_bias: torch.Tensor | None,
                 conv_weight: torch.Tensor, conv_bias: torch.Tensor | None, activation: str, phi: str,
                 phi_params: Sequence[torch.Tensor], phi_scalar: float,
                 conv_state: torch.Tensor | None = None) -> torch.Tensor:
    u = F.linear(x, proj_weight, proj_bias) if proj_weight is not None else x
    a = apply_activation(causal_conv_aten(u, conv_weight, conv_bias, conv_state), activation)
    return apply_phi(a, phi, list(phi_params), phi_scalar)


def matrix_phi_backward(grad_out: torch.Tensor, a: torch.Tensor, phi: str, phi_params: Sequence[torch.Tensor]
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(∂L/∂a, ∂L/∂W_phi, ∂L/∂b_phi or None) from ∂L/∂φ [B, T, H·d_phi] for a matrix φ."""
    phi_weight = phi_params[0]                                        # [d_phi, Dh]
    d_phi, head_dim = phi_weight.shape
    B, T, D = a.shape
    heads = a.reshape(B, T, D // head_dim, head_dim)                  # [B, T, H, Dh]
    grad_pre = grad_out.reshape(B, T, D // head_dim, d_phi)           # ∂L/∂(W_phi a_h), [B, T, H, d_phi]
    if phi == "random_fourier":
        pre = F.linear(heads, phi_weight, phi_params[1])
        grad_pre = grad_pre * (-math.sqrt(2.0 / d_phi)) * torch.sin(pre)
    elif phi == "performer":
        pre = F.linear(heads, phi_weight) - heads.square().sum(-1, keepdim=True) / 2
        grad_pre = grad_pre * torch.exp(pre) / math.sqrt(d_phi)
    grad_heads = grad_pre.matmul(phi_weight)
    if phi == "performer":                                            # the −‖a_h‖²/2 term
        grad_heads = grad_heads - heads * grad_pre.sum(-1, keepdim=True)
    grad_pre_rows = grad_pre.reshape(-1, d_phi)
    grad_weight = grad_pre_rows.t().matmul(heads.reshape(-1, head_dim))
    grad_bias = grad_pre_rows.sum(0) if phi == "random_fourier" else None
    return grad_heads.flatten(2), grad_weight, grad_bias


def phi_backward(grad_out: torch.Tensor, a: torch.Tensor, phi: str, phi_scalar: float) -> torch.Tensor:
    """∂L/∂a from ∂L/∂φ(a) for an elementwise φ (the subgradients torch's elu/relu/clamp backward use)."""
    if phi == "identity":
        return grad_out
    if phi == "elu1":
        return grad_out * torch.where(a <= 0, torch.exp(a), torch.ones_like(a))     # NaN a: 1, as elu's backward
    if phi == "relu":
        return torch.where(a <= 0, torch.zeros_like(grad_out), grad_out)       # NaN a: passes, as relu's backward
    if phi == "relu2":
        return grad_out * 2 * F.relu(a)
    if is_pointwise_phi(phi):
        return grad_out * pointwise.evaluate(pointwise.derivative(phi), a)
    # exp(min(a, s)): clamp passes the gradient where a <= s
    return grad_out * torch.where(a <= phi_scalar, torch.exp(a), torch.zeros_like(a))


def activation_backward(grad_a: torch.Tensor, z: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "none":
        return grad_a
    s = torch.sigmoid(z)
    return grad_a * s * (1 + z * (1 - s))


def effective_mask(output_mask: Sequence[bool], proj_weight: torch.Tensor | None, proj_bias: torch.Tensor | None,
                   conv_bias: torch.Tensor | None, phi: str, conv_state: torch.Tensor | None = None) -> list[bool]:
    """Which of (x, proj_weight, proj_bias, conv_weight, conv_bias, phi_weight, phi_bias, conv_state) get a
    gradient: asked for and present."""
    if len(output_mask) != len(GRAD_INPUTS):
        raise ValueError(f"qk_preprocess_backward: output_mask must have {len(GRAD_INPUTS)} entries "
                         f"{list(GRAD_INPUTS)}, got {len(output_mask)}")
    present = (True, proj_weight is not None, proj_bias is not None, True, conv_bias is not None,
               phi in MATRIX_PHI, phi == "random_fourier", conv_state is not None)
    return [bool(m) and p for m, p in zip(output_mask, present)]


def backward_aten(grad_out: torch.Tensor, x: torch.Tensor, proj_weight: torch.Tensor | None,
                  proj_bias: torch.Tensor | None, conv_weight: torch.Tensor, conv_bias: torch.Tensor | None,
                  activation: str, phi: str, phi_params: Sequence[torch.Tensor], phi_scalar: float,
                  mask: Sequence[bool], conv_state: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """Gradients of (x, proj_weight, proj_bias, conv_weight, conv_bias, phi_weight, phi_bias, conv_state); empty
    where ``mask`` is False. Half-precision inputs are differentiated in float32, each gradient then in its input's
    dtype: sums over the batch, time and the taps accumulate in float32, as the kernels' (and eager's conv and
    linear backward) do; in bf16 the bias gradient was 5e-2 off eager's (probe r31)."""
    if x.dtype in (torch.float16, torch.bfloat16):
        def up(t):
            return t.float() if isinstance(t, torch.Tensor) else t

        grads = backward_aten(up(grad_out), up(x), up(proj_weight), up(proj_bias), up(conv_weight), up(conv_bias),
                              activation, phi, [up(p) for p in phi_params], phi_scalar, mask, up(conv_state))
        inputs = (x, proj_weight, proj_bias, conv_weight, conv_bias, *(list(phi_params) + [None, None])[:2],
                  conv_state)
        return tuple(g.to(x.dtype if i is None else i.dtype) for g, i in zip(grads, inputs))
    T = x.shape[1]
    K = conv_weight.shape[2]
    w = conv_weight[:, 0, :]                                          # [D, K]
    u = F.linear(x, proj_weight, proj_bias) if proj_weight is not None else x
    z = causal_conv_aten(u, conv_weight, conv_bias, conv_state)       # recomputed, [B, T, D]
    a = apply_activation(z, activation)
    grads = [x.new_empty(0) for _ in GRAD_INPUTS]     # distinct tensors: outputs must not alias
    if phi in MATRIX_PHI:
        grad_a, grad_phi_weight, grad_phi_bias = matrix_phi_backward(grad_out, a, phi, phi_params)
        if mask[5]:
            grads[5] = grad_phi_weight
        if mask[6]:
            grads[6] = grad_phi_bias
    else:
        grad_a = phi_backward(grad_out, a, phi, phi_scalar)
    grad_z = activation_backward(grad_a, z, activation)               # [B, T, D]
    if mask[3]:
        u_padded = left_context(u, K, conv_state)                     # [B, K-1+T, D]
        grads[3] = torch.stack([(grad_z * u_padded[:, j:j + T]).sum((0, 1)) for j in range(K)], 1).unsqueeze(1)
    if mask[4]:
        grads[4] = grad_z.sum((0, 1))
    if mask[7]:
        # d conv_state[s] = Σ_{j <= s} w[:, j] dz[s - j]: the state rows feed z[0 .. K-2] only
        grad_z_tail = F.pad(grad_z, (0, 0, 0, K - 1))                  # [B, T+K-1, D], zeros after T
        grads[7] = grad_z.new_zeros(grad_z.shape[0], K - 1, grad_z.shape[2])
        for j in range(K - 1):
            grads[7] = grads[7] + F.pad(grad_z_tail[:, :K - 1 - j] * w[:, j], (0, 0, j, 0))
    if mask[0] or mask[1] or mask[2]:
        # du[t] = Σ_j w[:, j] dz[t + K-1-j]: the conv transposed, reading dz right-padded
        grad_z_padded = F.pad(grad_z, (0, 0, 0, K - 1))               # [B, T+K-1, D]
        grad_u = grad_z_padded[:, K - 1:K - 1 + T] * w[:, 0]
        for j in range(1, K):
            grad_u = grad_u + grad_z_padded[:, K - 1 - j:K - 1 - j + T] * w[:, j]
        if proj_weight is None:
            grads[0] = grad_u
        else:
            if mask[0]:
                grads[0] = grad_u.matmul(proj_weight)                 # [B, T, D_in]
            if mask[1]:
                grads[1] = grad_u.flatten(0, 1).t().matmul(x.flatten(0, 1))   # [D, D_in]
            if mask[2]:
                grads[2] = grad_u.sum((0, 1))
    return tuple(grads)


# --------------------------------------------------------------------------------------------------
# The ops
# --------------------------------------------------------------------------------------------------

@torch.library.custom_op("hecate::qk_preprocess", mutates_args=())
def qk_preprocess(x: torch.Tensor, proj_weight: torch.Tensor | None, proj_bias: torch.Tensor | None,
                  conv_weight: torch.Tensor, conv_bias: torch.Tensor | None, activation: str, phi: str,
                  phi_params: list[torch.Tensor], phi_scalar: float,
                  conv_state: torch.Tensor | None = None) -> torch.Tensor:
    check_inputs(x, proj_weight, proj_bias, conv_weight, conv_bias, activation, phi, phi_params, conv_state)
    if use_triton_kernels(x):
        from hecate.lowering.qk_preprocess import kernels

        return dense(kernels.forward(x, proj_weight, proj_bias, conv_weight, conv_bias, activation, phi, phi_params,
                                     phi_scalar, conv_state))
    return dense(forward_aten(x, proj_weight, proj_bias, conv_weight, conv_bias, activation, phi, phi_params,
                              phi_scalar, conv_state))


@qk_preprocess.register_fake
def _qk_preprocess_fake(x, proj_weight, proj_bias, conv_weight, conv_bias, activation, phi, phi_params, phi_scalar,
                        conv_state=None):
    check_inputs(x, proj_weight, proj_bias, conv_weight, conv_bias, activation, phi, phi_params, conv_state)
    return x.new_empty(x.shape[0], x.shape[1], output_channels(conv_weight, phi, phi_params))


@torch.library.custom_op("hecate::qk_preprocess_backward", mutates_args=())
def qk_preprocess_backward(grad_out: torch.Tensor, x: torch.Tensor, proj_weight: torch.Tensor | None,
                           proj_bias: torch.Tensor | None, conv_weight: torch.Tensor,
                           conv_bias: torch.Tensor | None, activation: str, phi: str,
                           phi_params: list[torch.Tensor], phi_scalar: float, output_mask: list[bool],
                           conv_state: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                      torch.Tensor, torch.Tensor, torch.Tensor]:
    check_inputs(x, proj_weight, proj_bias, conv_weight, conv_bias, activation, phi, phi_params, conv_state)
    mask = effective_mask(output_mask, proj_weight, proj_bias, conv_bias, phi, conv_state)
    if use_triton_kernels(x):
        from hecate.lowering.qk_preprocess import kernels

        return dense(kernels.backward(grad_out, x, proj_weight, proj_bias, conv_weight, conv_bias, activation, phi,
                                      phi_params, phi_scalar, mask, conv_state))
    return dense(backward_aten(grad_out, x, proj_weight, proj_bias, conv_weight, conv_bias, activation, phi,
                               phi_params, phi_scalar, mask, conv_state))


@qk_preprocess_backward.register_fake
def _qk_preprocess_backward_fake(grad_out, x, proj_weight, proj_bias, conv_weight, conv_bias, activation, phi,
                                 phi_params, phi_scalar, output_mask, conv_state=None):
    check_inputs(x, proj_weight, proj_bias, conv_weight, conv_bias, activation, phi, phi_params, conv_state)
    mask = effective_mask(output_mask, proj_weight, proj_bias, conv_bias, phi, conv_state)
    shaped = (x, proj_weight, proj_bias, conv_weight, conv_bias, phi_params[0] if phi in MATRIX_PHI else None,
              phi_params[1] if phi == "random_fourier" else None, conv_state)
    return tuple(t.new_empty(t.shape) if m else x.new_empty(0) for m, t in zip(mask, shaped))


def _setup_context(ctx, inputs, output):
    x, proj_weight, proj_bias, conv_weight, conv_bias, activation, phi, phi_params, phi_scalar, conv_state = inputs
    ctx.save_for_backward(x, proj_weight, proj_bias, conv_weight, conv_bias, conv_state, *phi_params)
    ctx.attrs = (activation, phi, phi_scalar)


def _backward(ctx, grad_out):
    # saved_tensors unpacked once: under torch.utils.checkpoint a second unpack is an error
    x, proj_weight, proj_bias, conv_weight, conv_bias, conv_state, *phi_params = ctx.saved_tensors
    activation, phi, phi_scalar = ctx.attrs
    needs = ctx.needs_input_grad
    if torch.is_grad_enabled():  # create_graph=True: this gradient is differentiated again
        return differentiable_backward(torch.ops.hecate.qk_preprocess.default, (
            x, proj_weight, proj_bias, conv_weight, conv_bias, activation, phi, phi_params, phi_scalar,
            conv_state)[:len(needs)], (grad_out,))
    output_mask = ([bool(n) for n in needs[:5]] + [bool(n) for n in needs[7]] + [False] * (2 - len(phi_params))
                   + [len(needs) > 9 and bool(needs[9])])      # conv_state, when it was passed
    grads = torch.ops.hecate.qk_preprocess_backward(grad_out.contiguous(), x, proj_weight, proj_bias, conv_weight,
                                                    conv_bias, activation, phi, phi_params, phi_scalar, output_mask,
                                                    conv_state)
    grads = [g if m else None for g, m in zip(grads, effective_mask(output_mask, proj_weight, proj_bias, conv_bias,
                                                                     phi, conv_state))]
    grad_phi_params = grads[5:5 + len(phi_params)]
    return (*grads[:5], None, None, grad_phi_params, None, grads[7])[:len(needs)]   # as many as were passed


qk_preprocess.register_autograd(_backward, setup_context=_setup_context)


# Under autocast the chain runs in the autocast dtype, as eager's linear and conv1d do.
register_autocast(qk_preprocess, cast=("x", "proj_weight", "proj_bias", "conv_weight", "conv_bias", "phi_params",
                                       "conv_state"))


# --------------------------------------------------------------------------------------------------
# Inductor on CPU: decompose both ops into the ATen path (Inductor fuses it as it would the plain
# model); CUDA tensors (and the interpreter's triton_on_cpu) decline, keeping the Triton kernels.
# --------------------------------------------------------------------------------------------------

@functools.cache
def _inductor_fallbacks() -> None:
    """Where a decomposition declines (CUDA), Inductor lowers the op itself, but it gives an op that has a
    decomposition no implicit fallback ("both a fallback and a decomp for same op"). Register the fallback
    (a call of the op, strides as in the graph) once, on the first decline: importing Inductor's lowering
    costs seconds that eager users need not pay."""
    from torch._inductor import lowering

    for op in (torch.ops.hecate.qk_preprocess.default, torch.ops.hecate.qk_preprocess_backward.default):
        lowering.make_fallback(op, layout_constraint=getattr(lowering, "constrain_to_fx_strides", None), warn=False,
                               override_decomp=True)


def _declined():
    _inductor_fallbacks()
    return NotImplemented


def _register_inductor_decompositions() -> None:
    from torch._inductor import decomposition as inductor_decomposition
    from torch._inductor.decomposition import register_decomposition

    @register_decomposition(torch.ops.hecate.qk_preprocess.default)
    def _forward_on_cpu(x, proj_weight, proj_bias, conv_weight, conv_bias, activation, phi, phi_params,
                        phi_scalar, conv_state=None):
        if use_triton_kernels(x):
            return _declined()
        check_inputs(x, proj_weight, proj_bias, conv_weight, conv_bias, activation, phi, phi_params, conv_state)
        return forward_aten(x, proj_weight, proj_bias, conv_weight, conv_bias, activation, phi, phi_params,
                            phi_scalar, conv_state)

    @register_decomposition(torch.ops.hecate.qk_preprocess_backward.default)
    def _backward_on_cpu(grad_out, x, proj_weight, proj_bias, conv_weight, conv_bias, activation, phi,
                         phi_params, phi_scalar, output_mask, conv_state=None):
        if use_triton_kernels(x):
            return _declined()
        check_inputs(x, proj_weight, proj_bias, conv_weight, conv_bias, activation, phi, phi_params, conv_state)
        mask = effective_mask(output_mask, proj_weight, proj_bias, conv_bias, phi, conv_state)
        return backward_aten(grad_out, x, proj_weight, proj_bias, conv_weight, conv_bias, activation, phi,
                             phi_params, phi_scalar, mask, conv_state)

    # Inductor memoises its table on first use: drop a copy made before these were registered.
    cached_table = getattr(inductor_decomposition, "fast_random_decomps", None)
    if hasattr(cached_table, "cache_clear"):
        cached_table.cache_clear()


_register_inductor_decompositions()
