"""Export of ``memory_scan``: an ONNX ``Scan`` over T, and an ATen decomposition for torch-mlir.

From opset 27 the p = 2 memory is one ``LinearAttention(gated_delta)`` instead
(:func:`memory_scan_fused_onnx`; :mod:`hecate.lowering.onnx_fused`).

ONNX: the recurrence becomes ONE ``Scan`` node (not T copies of the step): the
state A (and the momentum buffer S) are the Scan's carried state, k, v, q, α, η
(and a per-step momentum decay β) are scanned along axis 1 (T) and y is the scan output stacked along axis 1. The
step body is written with onnxscript standard ops and recorded into its own
graph, which becomes the Scan's ``body`` attribute.

MLIR: the decomposition is the reference loop of :mod:`.naive` unrolled over the
(static) T: plain ATen ops that torch-mlir lowers to linalg. The graph grows with
T; ONNX is the export that keeps the loop rolled.

Not exported: packed sequences (``cu_seqlens``), whose boundaries are data.
"""

from __future__ import annotations

import onnxscript
import torch
from onnxscript import ir
from onnxscript import opset18 as op

from hecate.lowering import pointwise
from hecate.lowering.memory_scan.naive import memory_scan_naive
from hecate.lowering.onnx_fused import (MIN_RETENTION, call_fused, dims, fused_translation, may_run_no_step,
                                        merge_heads, note, static_dim, use_fused, with_a_zero_step,
                                        without_the_zero_step)
from hecate.lowering.registry import decomposition, onnx_translation

_FLOAT = 1  # onnx TensorProto.FLOAT


def _bias_grad(e, p: float, a: float, eps: float, bias: str):
    if bias:
        return pointwise.to_onnx(bias, e)
    if p == 2.0:
        return op.Mul(e, op.Constant(value_float=2.0))
    sign = op.Tanh(op.Mul(e, op.Constant(value_float=a)))
    if p == 1.0:
        return sign
    power = op.Pow(op.Add(op.Mul(e, e), op.Constant(value_float=eps)), op.Constant(value_float=(p - 1.0) / 2.0))
    return op.Mul(op.Mul(sign, power), op.Constant(value_float=p))


def _lq_normalize(A, q_norm: float, eps: float):
    if q_norm == 2.0:
        return A
    s = op.ReduceSum(op.Pow(op.Abs(A), op.Constant(value_float=q_norm)),
                     op.Constant(value_ints=[-2, -1]), keepdims=1)
    scale = op.Pow(op.Add(s, op.Constant(value_float=eps)), op.Constant(value_float=-(q_norm - 2.0) / q_norm))
    return op.Mul(A, scale)


def _step(A, S, k_t, v_t, q_t, alpha_t, eta_t, p, a, eps, momentum, q_norm, hebbian, bias, beta_t=None,
          decay_first=False):
    """One token on [B, H, Dv, Dk] states; k_t, q_t [B, H, Dk]; v_t [B, H, Dv]; gates (β_t too) [B, H]."""
    k_row = op.Unsqueeze(k_t, op.Constant(value_ints=[-2]))        # [B, H, 1, Dk]
    gates = op.Constant(value_ints=[-2, -1])
    keep_t = op.Sub(op.Constant(value_float=1.0), alpha_t)          # [B, H]
    if hebbian:  # U = −v kᵀ: the memory is not read
        g = op.Neg(v_t)
    else:
        W = _lq_normalize(A, q_norm, eps)
        read = op.ReduceSum(op.Mul(W, k_row), op.Constant(value_ints=[-1]), keepdims=0)  # [B, H, Dv]
        if decay_first:  # the error of the decayed memory
            read = op.Mul(read, op.Unsqueeze(keep_t, op.Constant(value_ints=[-1])))
        e = op.Sub(read, v_t)
        g = _bias_grad(e, p, a, eps, bias)
    g = op.Unsqueeze(g, op.Constant(value_ints=[-1]))
    eta_u = op.Mul(op.Mul(g, k_row), op.Unsqueeze(eta_t, gates))   # η_t U [B, H, Dv, Dk]
    keep = op.Unsqueeze(keep_t, gates)
    if momentum != 0.0:
        decay = op.Constant(value_float=momentum)
        if beta_t is not None:
            decay = op.Mul(op.Unsqueeze(beta_t, gates), decay)
        S = op.Sub(op.Mul(S, decay), eta_u)
        A = op.Add(op.Mul(keep, A), S)
    else:
        A = op.Sub(op.Mul(keep, A), eta_u)
    q_row = op.Unsqueeze(q_t, op.Constant(value_ints=[-2]))
    y_t = op.ReduceSum(op.Mul(_lq_normalize(A, q_norm, eps), q_row), op.Constant(value_ints=[-1]), keepdims=0)
    return A, S, y_t


_BODIES = 0  # Scan bodies recorded so far (their values' names carry the count)


def _scan_body(opset, A0, k, v, q, alpha, eta, p, a, eps, momentum, q_norm, hebbian, bias, beta=None,
               decay_first=False) -> ir.Graph:
    """Record one step into its own graph: inputs (A, [S], k_t, v_t, q_t, α_t, η_t, [β_t]), outputs (A, [S], y_t)."""
    from torch.onnx._internal.exporter import _building

    def value(name, like, drop_axis=None):
        dims = list(like.shape) if like.shape is not None else None
        if dims is not None and drop_axis is not None:
            del dims[drop_axis]
        return ir.Value(name=name, shape=ir.Shape(dims) if dims is not None else None,
                        type=ir.TensorType(ir.DataType.FLOAT))

    use_momentum = momentum != 0.0
    A = value("memory_scan_A", A0)
    S = value("memory_scan_S", A0) if use_momentum else None
    sliced = [value(f"memory_scan_{n}_t", x, 1) for n, x in
              (("k", k), ("v", v), ("q", q), ("alpha", alpha), ("eta", eta), ("beta", beta)) if x is not None]
    recorder = _building.OpRecorder(opset, {})
    with onnxscript.evaluator.default_as(recorder):
        A_next, S_next, y_t = _step(A, S, *sliced[:5], p, a, eps, momentum, q_norm, hebbian, bias,
                                    sliced[5] if beta is not None else None, decay_first)
        # Scan outputs must be fresh values, not graph inputs passed through
        A_next = op.Identity(A_next)
        if use_momentum:
            S_next = op.Identity(S_next)
    states_in = [A, S] if use_momentum else [A]
    states_out = [A_next, S_next] if use_momentum else [A_next]
    # names of the body's own values, unique in the model: the onnx C API version converter (to opset 27)
    # infers shapes with the outer graph's value_info in scope, and a body value named like an outer one
    # (val_7, ...) took the outer one's shape, which onnxruntime then refuses
    global _BODIES
    _BODIES += 1
    for i, out in enumerate(out for node in recorder.nodes for out in node.outputs):
        out.name = f"memory_scan_step{_BODIES}_{i}"
    return ir.Graph([*states_in, *sliced], [*states_out, y_t], nodes=recorder.nodes, name="memory_scan_step")


def zeros_state(k, v):
    """ONNX zeros [B, H, Dv, Dk] (FLOAT) shaped after k [B, T, H, Dk] and v [B, T, H, Dv]."""
    shape = op.Concat(op.Shape(k, start=0, end=1), op.Shape(k, start=2, end=3),
                      op.Shape(v, start=3, end=4), op.Shape(k, start=3, end=4), axis=0)
    return op.ConstantOfShape(shape, value=ir.tensor([0.0], dtype=ir.DataType.FLOAT))


def as_state(state, inputs_dtype):
    """A final state in the dtype the op returns it in: float32 (its state's, at any input precision), float64
    for float64 inputs. The translation computes in float32 either way: a float64 model runs these ops in float32
    in onnxruntime."""
    return op.Cast(state, to=int(inputs_dtype)) if inputs_dtype == ir.DataType.DOUBLE else state


def recurrence_onnx(k, v, q, alpha, eta, A0, p, a, eps, momentum, q_norm, hebbian=False, bias="", S0=None,
                    beta=None, decay_first=False):
    """One ONNX ``Scan`` over T for FLOAT k, v, q [B, T, H, ·], gates [B, T, H] (a per-step momentum decay
    ``beta`` too, or None), A0 (and with momentum S0, zeros when None) [B, H, Dv, Dk].

    Returns (y [B, T, H, Dv] FLOAT, A_final, S_final or None). Shared with ``hecate.linear_attention``
    (``hebbian``).
    """
    from torch.onnx._internal.exporter import _core
    from torch.onnx._internal.exporter._torchlib.ops.hop import call_op

    if k.shape is not None and v.shape is not None:
        A0.shape = ir.Shape([k.shape[0], k.shape[2], v.shape[3], k.shape[3]])
    use_momentum = momentum != 0.0
    given = k
    # (a momentum buffer given nonzero moves the memory through any step: no zero step then)
    padded = may_run_no_step(k) and (not use_momentum or S0 is None)
    if padded:
        k, v, q, alpha, eta = (with_a_zero_step(x, first=use_momentum) for x in (k, v, q, alpha, eta))
        beta = None if beta is None else with_a_zero_step(beta, first=True)
    body = _scan_body(_core.current_tracer.opset, A0, k, v, q, alpha, eta, p, a, eps, momentum, q_norm, hebbian,
                      bias, beta, decay_first)
    if use_momentum and S0 is None:
        S0 = op.Mul(A0, op.Constant(value_float=0.0))
    inits = [A0, S0] if use_momentum else [A0]
    scanned = [x for x in (k, v, q, alpha, eta, beta) if x is not None]
    outputs = call_op("Scan", *inits, *scanned, _num_outputs=len(inits) + 1, body=body,
                      num_scan_inputs=len(scanned), scan_input_axes=[1] * len(scanned), scan_output_axes=[1])
    y = without_the_zero_step(outputs[-1], given, first=use_momentum) if padded else outputs[-1]
    return y, outputs[0], outputs[1] if use_momentum else None


@onnx_translation(torch.ops.hecate.memory_scan.default)
def memory_scan_onnx(k, v, q, alpha, eta, m0=None, cu_seqlens=None, p=2.0, a=10.0, eps=1e-6,
                     momentum=0.0, q_norm=2.0, bias="", s0=None, beta=None, decay_first=False):
    if cu_seqlens is not None:
        raise NotImplementedError("memory_scan ONNX export: packed sequences (cu_seqlens) are not supported; "
                                  "export with a padded batch")
    out_dtype = v.dtype
    k, v, q, alpha, eta = (op.Cast(x, to=_FLOAT) for x in (k, v, q, alpha, eta))
    A0 = zeros_state(k, v) if m0 is None else op.Cast(m0, to=_FLOAT)
    S0 = None if s0 is None else op.Cast(s0, to=_FLOAT)
    beta = None if beta is None else op.Cast(beta, to=_FLOAT)
    y, A_final, S_final = recurrence_onnx(k, v, q, alpha, eta, A0, p, a, eps, momentum, q_norm, bias=bias, S0=S0,
                                          beta=beta, decay_first=decay_first)
    if out_dtype != ir.DataType.FLOAT:
        y = op.Cast(y, to=int(out_dtype))
    if S_final is None:   # no momentum buffer: an empty [0]
        S_final = _empty_state()
    return y, as_state(A_final, out_dtype), as_state(S_final, out_dtype)


def _empty_state():
    """The s_final of a call without momentum: an empty FLOAT [0]."""
    return op.ConstantOfShape(op.Constant(value_ints=[0]), value=ir.tensor([0.0], dtype=ir.DataType.FLOAT))


@decomposition(torch.ops.hecate.memory_scan.default)
def memory_scan_decomposition(k, v, q, alpha, eta, m0=None, cu_seqlens=None, p=2.0, a=10.0, eps=1e-6,
                              momentum=0.0, q_norm=2.0, bias="", s0=None, beta=None, decay_first=False):
    if cu_seqlens is not None:
        raise NotImplementedError("memory_scan decomposition: packed sequences (cu_seqlens) are not supported")
    return memory_scan_naive(k, v, q, alpha, eta, m0, None, p, a, eps, momentum, q_norm, bias, s0, beta, decay_first)


def _gated_delta_misfit(args) -> str:
    """Why this call is not a gated delta rule ("" when it is)."""
    if args["cu_seqlens"] is not None:
        return "packed sequences (cu_seqlens): LinearAttention has no sequence boundaries"
    if args["p"] != 2.0:
        return f"l_p bias with p={args['p']:g}: only p = 2 is a delta rule (error linear in M)"
    if args["momentum"] != 0.0:
        return f"momentum {args['momentum']:g}: a second state the operator does not carry"
    if args["q_norm"] != 2.0:
        return f"MONETA q_norm={args['q_norm']:g}: the read and the error use the normalised memory"
    if static_dim(args["k"], 2) is None:
        return "the number of heads is not static"
    return ""


@fused_translation(torch.ops.hecate.memory_scan.default)
def memory_scan_fused_onnx(*args, **kwargs):
    """p = 2 as ``LinearAttention(gated_delta)`` (derivation: :mod:`hecate.lowering.onnx_fused`), else the Scan."""
    a = use_fused("hecate.memory_scan", "Scan", memory_scan_onnx, args, kwargs, _gated_delta_misfit,
                  mapped=("k", "v", "q", "alpha", "eta", "m0", "cu_seqlens", "p", "a", "eps", "momentum", "q_norm",
                          "decay_first"))
    if a is None:
        return memory_scan_onnx(*args, **kwargs)
    out_dtype = a["v"].dtype
    k, v, q, alpha, eta = (op.Cast(a[n], to=_FLOAT) for n in ("k", "v", "q", "alpha", "eta"))
    H = static_dim(a["k"], 2)
    # γ = 1 − α held away from 0 (α = 1 still reads the old memory through M k); γ < 0 stays and gives NaN
    keep = op.Sub(op.Constant(value_float=1.0), alpha)
    tiny = op.Constant(value_float=MIN_RETENTION)
    keep = op.Where(op.Less(op.Abs(keep), tiny), tiny, keep)               # [B, T, H]
    if a["decay_first"]:  # the operator's own order: β = 2η, v as is
        beta, v_kept = op.Mul(eta, op.Constant(value_float=2.0)), v
    else:
        beta = op.Div(op.Mul(eta, op.Constant(value_float=2.0)), keep)    # β = 2η/γ
        v_kept = op.Mul(v, op.Unsqueeze(keep, op.Constant(value_ints=[-1])))   # v' = γ v
    log_keep, padded = op.Log(keep), may_run_no_step(a["k"])
    if padded:
        q, k, v_kept, log_keep, beta = (with_a_zero_step(x) for x in (q, k, v_kept, log_keep, beta))
    packed = [merge_heads(x) for x in (q, k, v_kept)]
    past = None if a["m0"] is None else op.Transpose(op.Cast(a["m0"], to=_FLOAT), perm=[0, 1, 3, 2])
    B, T, _, Dk = dims(a["k"], 0, 1, 2, 3) or (None,) * 4
    Dv = static_dim(a["v"], 3)
    y, state = call_fused("LinearAttention", *packed, past, log_keep, beta,
                          shapes=([B, None if padded else T, H * Dv if Dv else None], [B, H, Dk, Dv]),
                          update_rule="gated_delta", q_num_heads=H, kv_num_heads=H, scale=1.0)
    note("hecate.memory_scan", "LinearAttention(gated_delta)",
         "p = 2, decay first: M ← γM − 2η(γMk − v)kᵀ with γ = 1 − α is gated delta with g = log γ, β = 2η"
         if a["decay_first"] else
         "p = 2: M ← γM − 2η(Mk − v)kᵀ with γ = 1 − α is gated delta with g = log γ, β = 2η/γ, v' = γv")
    y = op.Reshape(without_the_zero_step(y, a["k"]) if padded else y, op.Shape(a["v"]))
    if out_dtype != ir.DataType.FLOAT:
        y = op.Cast(y, to=int(out_dtype))
    return (y, as_state(op.Transpose(state, perm=[0, 1, 3, 2]), out_dtype),
            as_state(_empty_state(), out_dtype))   # gated delta: no momentum buffer
