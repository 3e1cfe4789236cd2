"""Export of ``hecate::qk_preprocess``: an ONNX translation (standard ONNX ops) and an ATen decomposition.

ONNX: MatMul (+ Add) for the projection; Transpose to [B, D, T], Pad K-1 zeros on the left, Conv with
group=D (the depthwise causal conv; a carried conv state is concatenated in front instead of the zero
padding), Transpose back; Sigmoid·Mul for SiLU; Elu/Relu/Mul/Min/Exp for φ (a user's pointwise φ in the
ops :func:`hecate.lowering.pointwise.to_onnx` writes), Reshape to heads + MatMul (+ Cos / Exp, ReduceSum) for the matrix φ kinds.
From opset 27 the conv (+ SiLU) is one ``CausalConvWithState`` (:func:`qk_preprocess_fused_onnx`).
ATen: the op's own ATen path (:func:`~hecate.lowering.qk_preprocess.op.forward_aten`), so torch-mlir sees
only ops it knows.
"""

from __future__ import annotations

import math

import torch
from onnxscript import ir
from onnxscript import opset18 as ox

from hecate.lowering import pointwise
from hecate.lowering.onnx_fused import call_fused, dims, fused_translation, note, use_fused
from hecate.lowering.qk_preprocess.naive import ACTIVATIONS, MATRIX_PHI, PHI_KINDS, is_pointwise_phi
from hecate.lowering.qk_preprocess.op import backward_aten, check_inputs, effective_mask, forward_aten
from hecate.lowering.registry import decomposition, onnx_translation


def _project(x, proj_weight, proj_bias):
    if proj_weight is None:
        return x                                                             # [B, T, D]
    u = ox.MatMul(x, ox.Transpose(proj_weight, perm=[1, 0]))
    return ox.Add(u, proj_bias) if proj_bias is not None else u


def _phi(a, D, phi, phi_params, phi_scalar):
    """φ on the activation a [B, T, D]."""
    if is_pointwise_phi(phi):
        return pointwise.to_onnx(phi, a)
    if phi == "elu1":
        return ox.Add(ox.Elu(a), ox.CastLike(ox.Constant(value_float=1.0), a))
    if phi == "relu":
        return ox.Relu(a)
    if phi == "relu2":
        r = ox.Relu(a)
        return ox.Mul(r, r)
    if phi == "exp":
        return ox.Exp(ox.Min(a, ox.CastLike(ox.Constant(value_float=float(phi_scalar)), a)))
    if phi in MATRIX_PHI:                                                   # per head: [B, T, H, Dh] · W_phiᵀ
        phi_weight = phi_params[0]
        d_phi, head_dim = phi_weight.shape
        heads = ox.Reshape(a, ox.Constant(value_ints=[0, 0, D // head_dim, head_dim]))
        features = ox.MatMul(heads, ox.Transpose(phi_weight, perm=[1, 0]))   # [B, T, H, d_phi]
        if phi == "random_fourier":
            features = ox.Mul(ox.Cos(ox.Add(features, phi_params[1])),
                              ox.CastLike(ox.Constant(value_float=math.sqrt(2.0 / d_phi)), a))
        elif phi == "performer":
            half_sq_norm = ox.Mul(ox.ReduceSum(ox.Mul(heads, heads), ox.Constant(value_ints=[-1]), keepdims=1),
                                  ox.CastLike(ox.Constant(value_float=0.5), a))
            features = ox.Mul(ox.Exp(ox.Sub(features, half_sq_norm)),
                              ox.CastLike(ox.Constant(value_float=1.0 / math.sqrt(d_phi)), a))
        return ox.Reshape(features, ox.Constant(value_ints=[0, 0, D // head_dim * d_phi]))
    return ox.Identity(a)


@onnx_translation(torch.ops.hecate.qk_preprocess.default)
def qk_preprocess_onnx(x, proj_weight, proj_bias, conv_weight, conv_bias, activation, phi, phi_params, phi_scalar,
                       conv_state=None):
    if activation not in ACTIVATIONS:
        raise ValueError(f"qk_preprocess ONNX export: unsupported activation={activation!r}")
    D, _, K = conv_weight.shape
    u = _project(x, proj_weight, proj_bias)                                  # [B, T, D]
    if conv_state is None:
        u_padded = ox.Pad(ox.Transpose(u, perm=[0, 2, 1]),                   # [B, D, K-1+T]
                          ox.Constant(value_ints=[0, 0, K - 1, 0, 0, 0]))
    else:                                                                    # the carried K-1 inputs first
        u_padded = ox.Transpose(ox.Concat(conv_state, u, axis=1), perm=[0, 2, 1])
    if conv_bias is not None:
        z = ox.Conv(u_padded, conv_weight, conv_bias, group=D)               # [B, D, T]
    else:
        z = ox.Conv(u_padded, conv_weight, group=D)
    a = ox.Transpose(z, perm=[0, 2, 1])                                      # [B, T, D]
    if activation == "silu":
        a = ox.Mul(a, ox.Sigmoid(a))
    return _phi(a, D, phi, phi_params, phi_scalar)


def _conv_misfit(args) -> str:
    if args["activation"] not in ACTIVATIONS or not (args["phi"] in PHI_KINDS or is_pointwise_phi(args["phi"])):
        return f"activation={args['activation']!r} / phi={args['phi']!r} not exportable"
    if args["x"].dtype != ir.DataType.FLOAT:
        return f"dtype {args['x'].dtype}: the translation writes the fused conv for FLOAT"
    if args["conv_weight"].shape[2] < 2:
        return "kernel size 1: a pointwise scale, no causal window"
    return ""


@fused_translation(torch.ops.hecate.qk_preprocess.default)
def qk_preprocess_fused_onnx(*args, **kwargs):
    """The depthwise causal conv (+ SiLU) as ``CausalConvWithState``; projection and φ as ordinary ops."""
    a = use_fused("hecate.qk_preprocess", "Pad + Conv", qk_preprocess_onnx, args, kwargs, _conv_misfit,
                  mapped=("x", "proj_weight", "proj_bias", "conv_weight", "conv_bias", "activation", "phi",
                          "phi_params", "phi_scalar", "conv_state"))
    if a is None:
        return qk_preprocess_onnx(*args, **kwargs)
    conv_weight = a["conv_weight"]
    D, _, K = conv_weight.shape
    u = ox.Transpose(_project(a["x"], a["proj_weight"], a["proj_bias"]), perm=[0, 2, 1])   # [B, D, T]
    B, T = dims(a["x"], 0, 1) or (None, None)
    past = None if a["conv_state"] is None else ox.Transpose(a["conv_state"], perm=[0, 2, 1])   # [B, D, K-1]
    z, _ = call_fused("CausalConvWithState", u, conv_weight, a["conv_bias"], past,
                      shapes=([B, D, T], [B, D, K - 1]), activation=a["activation"])
    # present_state is not used: the op has one output, and the graph's next state stays the slice it is
    note("hecate.qk_preprocess", f"CausalConvWithState({a['activation']})",
         f"depthwise causal conv K={K}" + (" + SiLU" if a["activation"] == "silu" else "")
         + (", past_state = the carried conv state" if past is not None else "")
         + (f", then φ={a['phi']} as ordinary ops" if a["phi"] != "identity" else ""))
    return _phi(ox.Transpose(z, perm=[0, 2, 1]), D, a["phi"], a["phi_params"], a["phi_scalar"])


@decomposition(torch.ops.hecate.qk_preprocess.default)
def qk_preprocess_decomposition(x, proj_weight, proj_bias, conv_weight, conv_bias, activation, phi, phi_params,
                                phi_scalar, conv_state=None):
    check_inputs(x, proj_weight, proj_bias, conv_weight, conv_bias, activation, phi, phi_params, conv_state)
    return forward_aten(x, proj_weight, proj_bias, conv_weight, conv_bias, activation, phi, phi_params, phi_scalar,
                        conv_state)


@decomposition(torch.ops.hecate.qk_preprocess_backward.default)
def qk_preprocess_backward_decomposition(grad_out, x, proj_weight, proj_bias, conv_weight, conv_bias, activation,
                                         phi, phi_params, phi_scalar, output_mask, conv_state=None):
    check_inputs(x, proj_weight, proj_bias, conv_weight, conv_bias, activation, phi, phi_params, conv_state)
    mask = effective_mask(output_mask, proj_weight, proj_bias, conv_bias, phi, conv_state)
    return backward_aten(grad_out, x, proj_weight, proj_bias, conv_weight, conv_bias, activation, phi, phi_params,
                         phi_scalar, mask, conv_state)
