"""ONNX opset 27's fused recurrences: which Hecate op becomes ``LinearAttention`` / ``CausalConvWithState``.

What the two operators compute, as checked in onnxruntime 1.32 with one-node graphs against a
plain PyTorch loop (``tests/export/test_onnx_opset27.py`` checks it again on every run)::

    LinearAttention(query, key, value, past_state?, decay?, beta?) -> (output, present_state)
        query, key [B, T, H·d_k], value [B, T, H·d_v]: heads packed, head h = channels h·d : (h+1)·d
        state S [B, H, d_k, d_v] (Hecate's memory M [B, H, d_v, d_k] is Sᵀ); zeros when absent
        linear       S ← S + k vᵀ
        gated        S ← e^g S + k vᵀ                     g: decay in log space, [B, T, H] per head
                                                          or [B, T, H·d_k] per key row of S
        delta        S ← S + β k (v − Sᵀk)ᵀ               β: [B, T, H] or [B, T, 1]
        gated_delta  S ← e^g S + β k (v − e^g Sᵀk)ᵀ
        output       o_t = scale · S_tᵀ q_t               (read after the update; scale 0 means
                                                          1/sqrt(d_k), so Hecate passes scale = 1)
        Keys are used as given: no L2 normalisation inside (the schema's "should be L2-normalised"
        is advice for stability, not a computation).

    CausalConvWithState(input [B, C, T], weight [C, 1, K], bias [C]?, past_state [B, C, K−1]?)
        -> (output [B, C, T], present_state [B, C, K−1])
        output  = act(conv1d(cat(past_state or zeros, input), weight, bias, groups=C)), act ∈ none | silu
        present = the last K−1 columns of cat(past_state or zeros, input)

Hecate's ops in those terms (each translation below notes which form it took and why):

* ``linear_attention`` (causal): M ← α M + v kᵀ is ``gated`` with g = log α (``linear`` without α);
  the normaliser z ← α z + k rides along as one more value column, v' = [v, 1], as in the op itself,
  so one ``LinearAttention`` gives both M q and z·q. Needs α ≥ 0 (the models' sigmoid and fixed
  gates): a negative α has no log and comes out NaN, never a silently different number.
  Non-causal: two MatMuls, as at any opset.
* ``memory_scan`` at p = 2, no momentum, q_norm = 2: (1 − α) M − 2η (M k − v) kᵀ is ``gated_delta``
  with e^g = γ = 1 − α, β = 2η/γ and v' = γ v (γM − βγ M k kᵀ + β v' kᵀ term by term). γ = 0
  (α = 1: the old memory still enters through M k) is held at γ ≥ ``MIN_RETENTION``; the error is
  MIN_RETENTION·M. γ < 0 (α > 1) comes out NaN. General p, p = 1, momentum, MONETA (q_norm ≠ 2) and
  packed sequences keep their ``Scan``.
* ``qk_preprocess``: the short causal conv (+ SiLU) is ``CausalConvWithState``; projection before and
  φ after stay ordinary ops.

Where the file runs: onnxruntime 1.32 has no CPU kernel for the ONNX-domain ``LinearAttention``; it
runs the operator's ONNX function, itself a ``Scan`` (and that function needs static shapes on the
operator's outputs). The same operator with the same inputs, attributes and semantics in the
``com.microsoft`` domain is onnxruntime's native kernel: ``fused_domain="com.microsoft"`` writes that
one (a file only onnxruntime runs).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import logging
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from hecate.lowering.registry import ONNX_TRANSLATIONS

FUSED_OPSET = 27  # the first ONNX opset with LinearAttention and CausalConvWithState
FUSED_DOMAINS = ("", "com.microsoft")
MIN_RETENTION = 1e-12  # γ = 1 − α is held at least this for log γ and β = 2η/γ (see the module doc)

# torch.onnx builds the graph at its own opset (18) and converts it to the requested one; a
# default-domain node of an opset-27-only operator stops that conversion. The fused nodes are
# therefore written in this placeholder domain and moved to their real domain after the export.
_PLACEHOLDER_DOMAIN = "hecate.fused"

_log = logging.getLogger("hecate.export")


@dataclass(frozen=True)
class OnnxForm:
    """How one fused op was written into the ONNX file."""

    op: str  # "hecate.memory_scan"
    form: str  # "LinearAttention(gated_delta)", "Scan", "CausalConvWithState(silu)", ...
    reason: str  # why this form: what fitted, or what did not


@dataclass
class _Export:
    opset: int | None  # None: torch.onnx's default
    forms: list[OnnxForm]


_CURRENT: contextvars.ContextVar[_Export | None] = contextvars.ContextVar("hecate_onnx_export", default=None)
FUSED_TRANSLATIONS: dict[torch._ops.OpOverload, Callable] = {}


def fused_translation(op: torch._ops.OpOverload) -> Callable[[Callable], Callable]:
    """Register ``fn`` as ``op``'s translation at opset ≥ 27; it calls :func:`use_fused` to choose its form."""

    def register(fn: Callable) -> Callable:
        FUSED_TRANSLATIONS[op] = fn
        return fn

    return register


@functools.cache
def fused_ops_supported() -> tuple[bool, str]:
    """(whether the installed onnx and onnxruntime know opset 27's fused operators, why not)."""
    try:
        import onnx.defs
        onnx.defs.get_schema("LinearAttention", FUSED_OPSET)
        onnx.defs.get_schema("CausalConvWithState", FUSED_OPSET)
    except Exception as e:  # noqa: BLE001 - any failure means "not available"
        return False, f"the installed onnx has no opset-{FUSED_OPSET} LinearAttention/CausalConvWithState ({e})"
    try:
        from onnxruntime.capi import onnxruntime_pybind11_state as ort_c
    except ImportError as e:
        return False, f"onnxruntime is not installed ({e})"
    known = {(s.domain, s.name) for s in ort_c.get_all_operator_schema()
             if s.name in ("LinearAttention", "CausalConvWithState") and s.since_version <= FUSED_OPSET}
    if {("", "LinearAttention"), ("", "CausalConvWithState")} - known:
        return False, f"the installed onnxruntime does not know opset {FUSED_OPSET}'s LinearAttention/CausalConvWithState"
    return True, ""


def default_opset() -> int | None:
    """27 where onnx and onnxruntime support it, else None (torch.onnx's default, with Scan)."""
    return FUSED_OPSET if fused_ops_supported()[0] else None


def use_fused(op: str, fallback_form: str | Callable[[dict], str], fallback: Callable, args: tuple, kwargs: dict,
              misfit: Callable[[dict], str], mapped: tuple[str, ...]) -> dict | None:
    """The arguments by name (``fallback``'s signature, defaults filled) when ``op`` takes the fused operator.

    ``misfit(arguments)`` returns "" when the call fits the operator, else the reason it does not;
    an argument outside ``mapped`` that is given (not its default) does not fit either, so an
    argument added to the op later keeps the op on ``fallback`` until it is mapped here. A call that
    does not fit (or an opset below 27) is noted as ``fallback_form`` (or ``fallback_form(arguments)``)
    and gives None: the caller then runs ``fallback``, its translation before opset 27.
    """
    signature = inspect.signature(fallback)
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    arguments = bound.arguments
    unmapped = [name for name, value in arguments.items()
                if name not in mapped and not _is_default(value, signature.parameters[name].default)]
    if callable(fallback_form):
        fallback_form = fallback_form(arguments)
    export = _CURRENT.get()
    if export is None or export.opset is None or export.opset < FUSED_OPSET:
        opset = "torch.onnx's default opset" if export is None or export.opset is None else f"opset {export.opset}"
        note(op, fallback_form, f"{opset} < {FUSED_OPSET}")
        return None
    why_not = f"{', '.join(unmapped)} not mapped onto the fused operator" if unmapped else misfit(arguments)
    if why_not:
        note(op, fallback_form, why_not)
        return None
    return arguments


def _is_default(value, default) -> bool:
    return value is default or (isinstance(value, (bool, int, float, str)) and value == default)


def note(op: str, form: str, reason: str) -> None:
    export = _CURRENT.get()
    if export is not None:
        export.forms.append(OnnxForm(op, form, reason))
    _log.info("ONNX export: %s -> %s (%s)", op, form, reason)


def call_fused(op_type: str, *inputs, shapes: tuple, **attributes):
    """One fused-operator node (in the placeholder domain until :func:`finish_model`) with FLOAT outputs.

    ``shapes``: one list of dims per output, set on the outputs because onnxruntime's inlining of the
    ONNX-domain operator's function needs them.
    """
    from onnxscript import ir
    from torch.onnx._internal.exporter._torchlib.ops.hop import call_op

    outputs = call_op(op_type, *inputs, _num_outputs=len(shapes), _domain=_PLACEHOLDER_DOMAIN, **attributes)
    for value, dims in zip(outputs, shapes):
        value.type = ir.TensorType(ir.DataType.FLOAT)
        if dims is not None:
            value.shape = ir.Shape(dims)
    return outputs


def static_dim(value, axis: int) -> int | None:
    """The size of ``value`` along ``axis`` when it is a known integer, else None."""
    if value.shape is None or not isinstance(value.shape[axis], int):
        return None
    return value.shape[axis]


def merge_heads(x):
    """[B, T, H, D] as [B, T, H·D], the merged size computed from the shape: a -1 is not inferred beside a dim of 0
    (T = 0, a loop of one token whose first step was written before the loop, runs no step)."""
    from onnxscript import opset18 as op

    return op.Reshape(x, op.Concat(op.Shape(x, start=0, end=2), op.ReduceProd(op.Shape(x, start=2), keepdims=1),
                                   axis=0))


def may_run_no_step(x) -> bool:
    """Whether ``x`` [B, T, ...] may have T = 0 (not a static length of at least 1): a loop of one token whose last
    write is dead (the state not returned) rolls into T − 1 = 0 steps, which onnxruntime's Scan and its
    LinearAttention refuse."""
    return x.shape is None or not (isinstance(x.shape[1], int) and x.shape[1] >= 1)


def with_a_zero_step(x, first: bool = False):
    """``x`` [B, T, ...] FLOAT with one more step at the end (``first``: at the start), every element zero: a zero
    key writes nothing and a zero log-decay (or forget rate) keeps the state as it is; the step's output is
    dropped (:func:`without_the_zero_step`). A momentum buffer moves the memory through any step unless it is
    still zero: its zero step goes first."""
    from onnxscript import ir
    from onnxscript import opset18 as op

    shape = op.Concat(op.Shape(x, start=0, end=1), op.Constant(value_ints=[1]), op.Shape(x, start=2), axis=0)
    zeros = op.Expand(op.Constant(value=ir.tensor([0.0], dtype=ir.DataType.FLOAT)), shape)
    return op.Concat(*((zeros, x) if first else (x, zeros)), axis=1)


def without_the_zero_step(y, like, first: bool = False):
    """``y`` [B, T + 1, ...] without the step :func:`with_a_zero_step` added: as many steps as ``like`` [B, T, ...]
    has."""
    from onnxscript import opset18 as op

    start, end = ([1], op.Constant(value_ints=[2 ** 63 - 1])) if first else ([0], op.Shape(like, start=1, end=2))
    return op.Slice(y, op.Constant(value_ints=start), end, op.Constant(value_ints=[1]))


def dims(value, *axes):
    """The dims of ``value`` at ``axes`` (ints or symbolic), or None when its shape is unknown."""
    return None if value.shape is None else [value.shape[a] for a in axes]


def check_arguments(opset_version: int | None, fused_domain: str) -> None:
    """Raise for an opset or a fused domain the export cannot write, naming it (before the model is exported)."""
    if fused_domain not in FUSED_DOMAINS:
        raise ValueError(f"fused_domain must be one of {list(FUSED_DOMAINS)}, got {fused_domain!r}")
    if opset_version is not None and (type(opset_version) is not int or opset_version < 18):
        raise ValueError(f"opset_version must be None (the newest supported) or an int ≥ 18, got {opset_version!r}")


@contextlib.contextmanager
def onnx_translations(opset_version: int | None = None,
                      fused_domain: str = "") -> Iterator[tuple[dict, int | None, list[OnnxForm]]]:
    """(translation table, opset for torch.onnx.export, the list of forms filled during the export).

    ``opset_version`` None: 27 where supported, else torch.onnx's default. Below 27 every
    recurrence is a ``Scan`` (and the conv a ``Conv``), as before opset 27 existed.
    """
    check_arguments(opset_version, fused_domain)
    if opset_version is None:
        opset_version = default_opset()
    elif opset_version >= FUSED_OPSET:
        supported, why = fused_ops_supported()
        if not supported:
            raise ValueError(f"opset_version={opset_version} needs LinearAttention/CausalConvWithState: {why}; "
                             f"pass opset_version < {FUSED_OPSET} for the Scan form")
    table = {**ONNX_TRANSLATIONS, **FUSED_TRANSLATIONS}
    export = _Export(opset_version, [])
    token = _CURRENT.set(export)
    try:
        yield table, opset_version, export.forms
    finally:
        _CURRENT.reset(token)


def finish_model(onnx_program, fused_domain: str = "") -> None:
    """Move the fused nodes from the placeholder domain to ``fused_domain`` (in place)."""
    from onnxscript import ir

    model = onnx_program.model
    moved = False
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.domain == _PLACEHOLDER_DOMAIN:
            node.domain = fused_domain
            node.version = None
            moved = True
    model.opset_imports.pop(_PLACEHOLDER_DOMAIN, None)
    if moved and fused_domain:
        model.opset_imports[fused_domain] = 1
