"""``hecate.kl_attention`` for export: an ONNX translation and an ATen decomposition.

Both are the matmul form of :mod:`.matmul_form` (scores ``c_i + a_i·b_j + d_j``, a
masked softmax that gives 0 on rows with no allowed key, then matmuls), so they
form [B, N, N] but never [B, N, N, K]; standard ONNX ops only.
"""

from __future__ import annotations

import torch
from onnxscript import opset18 as op

from hecate.lowering.kl_attention import matmul_form
from hecate.lowering.registry import decomposition, onnx_translation

KL_ATTENTION = torch.ops.hecate.kl_attention.default


@decomposition(KL_ATTENTION)
def kl_attention_decomposition(mu, var, row_values, col_values, kappa, causal, mask_diagonal, temperature=None,
                               allowed=None, inverse_temperature=False):
    kappa = kappa if temperature is None else kappa / temperature if inverse_temperature else kappa * temperature
    return matmul_form.forward(mu, var, row_values, col_values, kappa, causal, mask_diagonal,
                               masked=None if allowed is None else ~allowed)


def _axes(*axes):
    return op.Constant(value_ints=list(axes))


def _scalar(value, like):
    return op.CastLike(op.Constant(value_float=float(value)), like)


@onnx_translation(KL_ATTENTION)
def kl_attention_onnx(mu, var, row_values, col_values, kappa: float, causal: bool, mask_diagonal: bool,
                      temperature=None, allowed=None, inverse_temperature=False):
    half = _scalar(0.5, mu)
    mu_c = op.Sub(mu, op.ReduceMean(mu, _axes(1), keepdims=1))
    mu_sq = op.Mul(mu_c, mu_c)
    inv = op.Reciprocal(var)
    log_var = op.Log(var)
    a = op.Concat(op.Add(var, mu_sq), mu_c, axis=-1)  # [B, N, 2K]
    b = op.Concat(op.Mul(half, inv), op.Neg(op.Mul(mu_c, inv)), axis=-1)
    c = op.Mul(_scalar(-0.5, mu), op.ReduceSum(op.Add(log_var, _scalar(1.0, mu)), _axes(-1), keepdims=0))
    d = op.Mul(half, op.ReduceSum(op.Add(log_var, op.Mul(mu_sq, inv)), _axes(-1), keepdims=0))
    kl = op.Add(op.Add(op.Unsqueeze(c, _axes(-1)), op.MatMul(a, op.Transpose(b, perm=[0, 2, 1]))),
                op.Unsqueeze(d, _axes(1)))  # [B, N, N]
    scale = _scalar(-1.0 / kappa, mu)  # −1/κ, κ = kappa · temperature (kappa / temperature)
    if temperature is not None:
        scale = (op.Mul if inverse_temperature else op.Div)(scale, op.CastLike(temperature, mu))
    logits = op.Mul(kl, scale)
    if causal or mask_diagonal:
        n = op.Squeeze(op.Shape(mu, start=1, end=2), _axes(0))
        pos = op.Range(op.Constant(value_int=0), n, op.Constant(value_int=1))
        i, j = op.Unsqueeze(pos, _axes(1)), op.Unsqueeze(pos, _axes(0))
        if causal and mask_diagonal:
            keys = op.Less(j, i)
        elif causal:
            keys = op.LessOrEqual(j, i)
        else:
            keys = op.Not(op.Equal(j, i))
        allowed = keys if allowed is None else op.And(keys, allowed)
    if allowed is not None:
        logits = op.Where(allowed, logits, _scalar(float("-inf"), mu))
        kl = op.Where(allowed, kl, _scalar(0.0, mu))
    m = op.ReduceMax(logits, _axes(-1), keepdims=1)
    m = op.Where(op.IsInf(m), _scalar(0.0, mu), m)  # a row with no allowed key: p = exp(−inf) = 0
    p = op.Exp(op.Sub(logits, m))
    total = op.ReduceSum(p, _axes(-1), keepdims=1)
    beta = op.Div(p, op.Max(total, _scalar(torch.finfo(torch.float32).tiny, mu)))
    lse = op.Squeeze(op.Add(m, op.Log(total)), _axes(-1))
    beta_kl = op.Mul(beta, kl)
    energy = op.ReduceSum(beta_kl, _axes(-1), keepdims=0)
    beta_t = op.Transpose(beta, perm=[0, 2, 1])
    return (op.MatMul(beta, row_values), op.MatMul(beta_kl, row_values), energy,
            op.MatMul(beta_t, col_values), op.MatMul(op.Transpose(beta_kl, perm=[0, 2, 1]), col_values),
            op.MatMul(beta_t, op.Mul(op.Unsqueeze(energy, _axes(-1)), col_values)), lse)
