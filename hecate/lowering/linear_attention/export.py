"""Export of ``linear_attention``: causal as one ONNX ``Scan`` (memory_scan's, in its Hebbian mode);
non-causal as two MatMuls; from opset 27 causal as one ``LinearAttention`` (:func:`linear_attention_fused_onnx`);
ATen decomposition for torch-mlir (the reference: the causal loop
unrolled over the static T, or the einsums)."""

from __future__ import annotations

import torch
from onnxscript import ir
from onnxscript import opset18 as op

from hecate.lowering.linear_attention.naive import linear_attention_naive
from hecate.lowering.memory_scan.export import as_state, recurrence_onnx, zeros_state
from hecate.lowering.onnx_fused import (call_fused, dims, fused_translation, may_run_no_step, merge_heads, note,
                                        static_dim, use_fused, with_a_zero_step, without_the_zero_step)
from hecate.lowering.registry import decomposition, onnx_translation

_FLOAT = 1  # onnx TensorProto.FLOAT


def _axes(*axes):
    return op.Constant(value_ints=list(axes))


@onnx_translation(torch.ops.hecate.linear_attention.default)
def linear_attention_onnx(k, v, q, alpha=None, m0=None, z0=None, normalize=False, eps=1e-6, causal=True):
    out_dtype = v.dtype
    k, v, q = (op.Cast(x, to=_FLOAT) for x in (k, v, q))
    if not causal:
        kt = op.Transpose(k, perm=[0, 2, 3, 1])                          # [B, H, Dk, T]
        M = op.MatMul(op.Transpose(v, perm=[0, 2, 3, 1]), op.Transpose(kt, perm=[0, 1, 3, 2]))  # [B, H, Dv, Dk]
        qh = op.Transpose(q, perm=[0, 2, 1, 3])                          # [B, H, T, Dk]
        y = op.Transpose(op.MatMul(qh, op.Transpose(M, perm=[0, 1, 3, 2])), perm=[0, 2, 1, 3])  # [B, T, H, Dv]
        z = op.ReduceSum(k, _axes(1), keepdims=0)                       # [B, H, Dk]
        if normalize:
            den = op.ReduceSum(op.Mul(q, op.Unsqueeze(z, _axes(1))), _axes(-1), keepdims=1)
            y = op.Div(y, op.Add(den, op.Constant(value_float=eps)))
        else:
            z = op.Mul(z, op.Constant(value_float=0.0))
    else:
        gate_shape = op.Shape(k, start=0, end=3)
        ones = op.ConstantOfShape(gate_shape, value=ir.tensor([1.0], dtype=ir.DataType.FLOAT))
        forget = op.Sub(op.Constant(value_float=1.0), op.Cast(alpha, to=_FLOAT)) if alpha is not None \
            else op.Mul(ones, op.Constant(value_float=0.0))
        v_rows = op.Concat(v, op.Unsqueeze(ones, _axes(-1)), axis=-1) if normalize else v
        M0 = op.Cast(m0, to=_FLOAT) if m0 is not None else zeros_state(k, v)
        if normalize:
            Z0 = op.Cast(z0, to=_FLOAT) if z0 is not None else op.ReduceSum(M0, _axes(2), keepdims=0)
            if z0 is None:
                Z0 = op.Mul(Z0, op.Constant(value_float=0.0))
            A0 = op.Concat(M0, op.Unsqueeze(Z0, _axes(2)), axis=2)
        else:
            A0 = M0
        y_rows, A, _ = recurrence_onnx(k, v_rows, q, forget, ones, A0, 2.0, 1.0, 1e-6, 0.0, 2.0, hebbian=True)
        return _split_value_column(y_rows, A, v, normalize, eps, out_dtype)
    if out_dtype != ir.DataType.FLOAT:
        y = op.Cast(y, to=int(out_dtype))
    return y, as_state(M, out_dtype), as_state(z, out_dtype)


def _split_value_column(y_rows, A, v, normalize, eps, out_dtype):
    """(y, M, z) from a recurrence run on v' = [v, 1] (normalised: y = y'[:Dv] / (y'[Dv] + eps), the state's
    last row is z) or on v itself (z zeros)."""
    if normalize:
        dv = op.Shape(v, start=3, end=4)
        end = op.Constant(value_ints=[2**62])
        y = op.Div(op.Slice(y_rows, op.Constant(value_ints=[0]), dv, _axes(3)),
                   op.Add(op.Slice(y_rows, dv, end, _axes(3)), op.Constant(value_float=eps)))
        M = op.Slice(A, op.Constant(value_ints=[0]), dv, _axes(2))
        z = op.Squeeze(op.Slice(A, dv, end, _axes(2)), _axes(2))
    else:
        y, M = y_rows, A
        z = op.Mul(op.ReduceSum(A, _axes(2), keepdims=0), op.Constant(value_float=0.0))
    if out_dtype != ir.DataType.FLOAT:
        y = op.Cast(y, to=int(out_dtype))
    return y, as_state(M, out_dtype), as_state(z, out_dtype)


@decomposition(torch.ops.hecate.linear_attention.default)
def linear_attention_decomposition(k, v, q, alpha=None, m0=None, z0=None, normalize=False, eps=1e-6, causal=True):
    return linear_attention_naive(k, v, q, alpha, m0, z0, normalize, eps, causal)


def _causal_misfit(args) -> str:
    if not args["causal"]:
        return "non-causal: φ(Q)(φ(K)ᵀV) is two MatMuls, no recurrence"
    if static_dim(args["k"], 2) is None:
        return "the number of heads is not static"
    return ""


@fused_translation(torch.ops.hecate.linear_attention.default)
def linear_attention_fused_onnx(*args, **kwargs):
    """Causal as ``LinearAttention`` (``gated`` with g = log α, ``linear`` without α); the normaliser as
    one more value column v' = [v, 1], so the operator's read is [M q, z·q]."""
    a = use_fused("hecate.linear_attention", lambda a: "Scan" if a["causal"] else "MatMul", linear_attention_onnx,
                  args, kwargs, _causal_misfit,
                  mapped=("k", "v", "q", "alpha", "m0", "z0", "normalize", "eps", "causal"))
    if a is None:
        return linear_attention_onnx(*args, **kwargs)
    out_dtype = a["v"].dtype
    k, v, q = (op.Cast(a[n], to=_FLOAT) for n in ("k", "v", "q"))
    normalize = a["normalize"]
    H = static_dim(a["k"], 2)
    B, T, _, Dk = dims(a["k"], 0, 1, 2, 3) or (None,) * 4
    Dv = static_dim(a["v"], 3)
    Dv_rows = Dv + 1 if Dv is not None and normalize else Dv
    head_shape = op.Shape(k, start=0, end=3)                                  # [B, T, H]
    if normalize:
        ones = op.ConstantOfShape(head_shape, value=ir.tensor([1.0], dtype=ir.DataType.FLOAT))
        v = op.Concat(v, op.Unsqueeze(ones, _axes(-1)), axis=-1)            # [B, T, H, Dv + 1]
    past = None
    if a["m0"] is not None or (normalize and a["z0"] is not None):
        M0 = op.Cast(a["m0"], to=_FLOAT) if a["m0"] is not None else zeros_state(k, a["v"])
        if normalize:
            Z0 = op.Cast(a["z0"], to=_FLOAT) if a["z0"] is not None else op.ConstantOfShape(
                op.Concat(op.Shape(k, start=0, end=1), op.Shape(k, start=2, end=4), axis=0),
                value=ir.tensor([0.0], dtype=ir.DataType.FLOAT))
            M0 = op.Concat(M0, op.Unsqueeze(Z0, _axes(2)), axis=2)           # [B, H, Dv + 1, Dk]
        past = op.Transpose(M0, perm=[0, 1, 3, 2])
    decay = None if a["alpha"] is None else op.Log(op.Cast(a["alpha"], to=_FLOAT))
    rule = "linear" if decay is None else "gated"
    padded = may_run_no_step(a["k"])
    if padded:
        q, k, v = (with_a_zero_step(x) for x in (q, k, v))
        decay = None if decay is None else with_a_zero_step(decay)
    packed = [merge_heads(x) for x in (q, k, v)]
    y_rows, state = call_fused("LinearAttention", *packed, past, decay,
                               shapes=([B, None if padded else T, H * Dv_rows if Dv_rows else None], [B, H, Dk, Dv_rows]),
                               update_rule=rule, q_num_heads=H, kv_num_heads=H, scale=1.0)
    note("hecate.linear_attention", f"LinearAttention({rule})",
         ("M ← αM + v kᵀ with g = log α" if decay is not None else "M ← M + v kᵀ")
         + ("; normaliser as value column v' = [v, 1]" if normalize else ""))
    if padded:
        y_rows = without_the_zero_step(y_rows, a["k"])
    rows = op.Shape(v, start=3, end=4)                                       # Dv (+ 1): no -1 beside a T of 0
    y_rows = op.Reshape(y_rows, op.Concat(head_shape, rows, axis=0))
    A = op.Transpose(state, perm=[0, 1, 3, 2])                               # [B, H, Dv (+ 1), Dk]
    return _split_value_column(y_rows, A, a["v"], normalize, a["eps"], out_dtype)
