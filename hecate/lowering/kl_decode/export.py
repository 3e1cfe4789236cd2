"""``hecate.kl_decode_*`` for export: ONNX translations and ATen decompositions (matmul form)."""

from __future__ import annotations

import torch
from onnxscript import opset18 as op

from hecate.lowering.kl_decode import matmul_form
from hecate.lowering.registry import decomposition, onnx_translation

KL_DECODE_LOGITS = torch.ops.hecate.kl_decode_logits.default
KL_DECODE_CE = torch.ops.hecate.kl_decode_ce.default
_DOUBLE = 11  # onnx TensorProto.DOUBLE


@decomposition(KL_DECODE_LOGITS)
def kl_decode_logits_decomposition(mu, var, prior_mu, prior_var, tau):
    return matmul_form.logits(mu, var, prior_mu, prior_var, tau)


@decomposition(KL_DECODE_CE)
def kl_decode_ce_decomposition(mu, var, prior_mu, prior_var, targets, tau, ignore_index):
    return matmul_form.ce(mu, var, prior_mu, prior_var, targets, tau, ignore_index)


def _axes(*axes):
    return op.Constant(value_ints=list(axes))


def _scalar(value, like):
    return op.CastLike(op.Constant(value_float=float(value)), like)


def _logits(mu, var, prior_mu, prior_var, tau):
    """[M, V] logits −(c_i + a_i·b_v + d_v)/τ, means shifted by the prior bank's mean."""
    half = _scalar(0.5, mu)
    shift = op.ReduceMean(prior_mu, _axes(0), keepdims=1)
    mu_c, pm_c = op.Sub(mu, shift), op.Sub(prior_mu, shift)
    a = op.Concat(op.Add(var, op.Mul(mu_c, mu_c)), mu_c, axis=-1)
    c = op.Mul(_scalar(-0.5, mu), op.ReduceSum(op.Add(op.Log(var), _scalar(1.0, mu)), _axes(-1), keepdims=0))
    inv = op.Reciprocal(prior_var)
    b = op.Concat(op.Mul(half, inv), op.Neg(op.Mul(pm_c, inv)), axis=-1)
    d = op.Mul(half, op.ReduceSum(op.Add(op.Log(prior_var), op.Mul(op.Mul(pm_c, pm_c), inv)), _axes(-1),
                                  keepdims=0))
    kl = op.Add(op.Add(op.Unsqueeze(c, _axes(-1)), op.MatMul(a, op.Transpose(b, perm=[1, 0]))),
                op.Unsqueeze(d, _axes(0)))
    return op.Mul(kl, _scalar(-1.0 / tau, mu))


@onnx_translation(KL_DECODE_LOGITS)
def kl_decode_logits_onnx(mu, var, prior_mu, prior_var, tau: float):
    return _logits(mu, var, prior_mu, prior_var, tau)


@onnx_translation(KL_DECODE_CE)
def kl_decode_ce_onnx(mu, var, prior_mu, prior_var, targets, tau: float, ignore_index: int):
    z = _logits(mu, var, prior_mu, prior_var, tau)
    lse = op.ReduceLogSumExp(z, _axes(-1), keepdims=0)
    ignored = op.Equal(targets, op.CastLike(op.Constant(value_int=ignore_index), targets))
    safe = op.Where(ignored, op.CastLike(op.Constant(value_int=0), targets), targets)
    z_target = op.Squeeze(op.GatherElements(z, op.Unsqueeze(safe, _axes(-1)), axis=1), _axes(-1))
    loss = op.Where(ignored, _scalar(0.0, mu), op.Sub(lse, z_target))
    return loss, op.Cast(lse, to=_DOUBLE)  # the op's lse is float64
