"""Export of ``linear_attention``: causal as one ONNX ``Scan`` (memory_scan's, in its Hebbian mode);
non-causal as two MatMuls; ATen decomposition for torch-mlir (the reference: the causal loop
unrolled over the static T, or the einsums)."""

from __future__ import annotations

import torch
from onnxscript import ir
from onnxscript import opset18 as op

from hecate.lowering.linear_attention.naive import linear_attention_naive
from hecate.lowering.memory_scan.export import recurrence_onnx, zeros_state
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
        if normalize:
            dv = op.Shape(v, start=3, end=4)
            y = op.Div(op.Slice(y_rows, op.Constant(value_ints=[0]), dv, _axes(3)),
                       op.Add(op.Slice(y_rows, dv, op.Constant(value_ints=[2**62]), _axes(3)),
                              op.Constant(value_float=eps)))
            M = op.Slice(A, op.Constant(value_ints=[0]), dv, _axes(2))
            z = op.Squeeze(op.Slice(A, dv, op.Constant(value_ints=[2**62]), _axes(2)), _axes(2))
        else:
            y, M = y_rows, A
            z = op.Mul(op.ReduceSum(A, _axes(2), keepdims=0), op.Constant(value_float=0.0))
    if out_dtype != ir.DataType.FLOAT:
        y = op.Cast(y, to=int(out_dtype))
    return y, M, z


@decomposition(torch.ops.hecate.linear_attention.default)
def linear_attention_decomposition(k, v, q, alpha=None, m0=None, z0=None, normalize=False, eps=1e-6, causal=True):
    return linear_attention_naive(k, v, q, alpha, m0, z0, normalize, eps, causal)
