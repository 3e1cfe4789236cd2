"""``qk_preprocess``: projection → depthwise causal conv1d → SiLU → φ as one ``hecate.qk_preprocess``.

The chain (spec ``short-causal-conv.md``, ``feature-maps-phi.md``) is written in
many spellings, so the pattern is composed from small spelling *pieces*, each a
PyTorch function traced to a pattern and found with :func:`find_matches`:

    [projection] → swap to [B,D,T] → causal conv → tail stages

* projection (optional): ``nn.Linear`` / ``F.linear``, ``x @ W.T`` (or ``W.t()``,
  ``W.transpose(0, 1)``, ``W.permute(1, 0)``, and ``einsum("btd,ed->bte", x, W)`` in the
  normal form) with an optional ``+ b``;
* swap [B,T,D] ↔ [B,D,T]: ``transpose``, ``.mT``, ``permute(0, 2, 1)``;
* causal conv: ``F.conv1d(x, w, b, padding=K-1, groups=D)[..., :T]`` (also ``nn.Conv1d``),
  or ``F.conv1d(F.pad(x, (K-1, 0)), w, b, groups=D)``; streaming, with the K−1 inputs before x
  carried as a state in place of the zero padding, ``F.conv1d(torch.cat([state, x], -1), w, b,
  groups=D)`` or the same with ``padding=K-1`` keeping x's outputs ``[..., K-1:K-1+T]`` (the op's
  ``conv_state``; the next state the graph computes from the cat stays, a slice); the padding is zeros
  (``F.pad`` in mode circular / replicate / reflect, or ``nn.Conv1d(padding_mode=...)``, is reported);
  a conv2d over one row, and padding or slicing on the other side of a transpose, read as these in the
  normal form (:mod:`hecate.compiler.normalize`);
* a decode step's window product (:func:`_window_step`): ``window = torch.cat([state, x_t[:, None]], 1)``,
  ``z = Σ_k window[:, k] · w[:, k]`` (+ b) in any spelling (einsum, a product and a sum, ...), read
  by evaluating it; the op runs on the one token and its [B, 1, D] result is squeezed;
* tail stages, each at most once, SiLU before φ: the swap back to [B,T,D]
  (without it the chain's [B,D,T] output is the op's [B,T,D] transposed back); SiLU (``F.silu``, ``z * sigmoid(z)``,
  ``sigmoid(z) * z``); a head split [B,T,D] → [B,T,H,Dh] after the swap back
  (``view``/``reshape``/``unflatten``; re-emitted after the op, since SiLU and φ
  act per channel or per head); φ: any elementwise function of the activation
  (read by what it computes: the largest pointwise subgraph after it, up to the
  first operation that is not elementwise or reads another tensor, is passed to
  the op as a :mod:`hecate.lowering.pointwise` expression; ELU+1, ReLU, squared
  ReLU, exp(min(·, c)) and exp, when they are the whole of it, take the op's fast
  paths), or a matrix map applied per head after the swap back (learned linear
  ``F.linear(a, W)`` / ``a @ W.T``, random Fourier, Performer FAVOR+), which ends
  the chain; one written another way (``0.5 * (z ** 2).sum(-1)``, ``z.norm() ** 2``, an einsum)
  is read by its values (:func:`_matrix_phi_by_value`). A sequence-first [T, B, D] chain
  (``permute(1, 2, 0)`` in, ``permute(2, 0, 1)`` back) is the op's with the batch swapped: the
  projection reads x.transpose(0, 1), φ may come after the swap back.

Pieces are linked where one's output is the next one's input and is used by
nothing else, so the whole chain is one subgraph whose intermediates nobody
else reads; it is replaced by one call. Partial chains (conv alone, conv → SiLU,
projection → conv, ...) fuse the same way. A φ that mixes features other than
the matrix maps above (polynomial, residual MLP, ...) is left to the fallback:
the chain stops before it and the report says what reads it.

Literals are wildcards when matching; each piece's literals are then checked
(padding K−1 on the left only, first T outputs kept, groups = channels = D,
stride 1, dilation 1, weight [D, 1, K], transposes swapping T and D, ...). A conv1d
that fails a check, or that no chain explains, is reported as a near-miss with
the reason, and the graph around it is left as it was.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
import torch.nn.functional as F
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.fx.passes.utils.matcher_utils import InternalMatch

from hecate.passes.report import FusionReport
from hecate.lowering import pointwise
from hecate.passes.gaussian import evaluate
from hecate.passes.matching import (Match, NotFused, computed_from, descendants, find_matches, is_pointwise,
                                    is_register_hook, pad_fill, pattern_graph, replace_with_op, size_hint, val)

PATTERN = "qk_preprocess"
OP_NAME = "hecate.qk_preprocess"

aten = torch.ops.aten
CONV1D_OPS = (aten.conv1d.default, aten.conv1d.padding)

# Example shapes for tracing the pieces; every literal they produce is a wildcard. The example
# tensors are zeros: tracing reads no values, and drawing random ones would move the user's RNG.
_B, _T, _D, _K = 2, 5, 6, 4


@dataclass(frozen=True)
class Piece:
    """One spelling of one stage: ``fn`` traced to a pattern; ``check`` reads its literals.

    ``check(match)`` returns None when the literals fit, else the reason they do not.
    ``value`` is what the stage contributes to the op's arguments (e.g. φ's kind).
    """

    stage: str  # "projection" | "swap" | "conv" | "activation" | "heads" | "phi"
    fn: Callable
    example: tuple
    check: Callable[[Match], str | None]
    value: str = ""
    pattern: fx.Graph = field(init=False, compare=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "pattern", pattern_graph(self.fn, *self.example))


def _arg(node: fx.Node, index: int, name: str, default=None):
    """Argument ``index`` / ``name`` of a call, or its schema default when omitted."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _equal(a, b) -> bool:
    """``a == b`` for sizes, lists of them and literals, a size an argument may hold as a node (``groups=h.shape[1]``
    under dynamic shapes: a sym_size node) read as its value; an answer not known for every size is no."""
    a, b = (fx.node.map_aggregate(x, lambda y: y.meta.get("val") if isinstance(y, fx.Node) else y) for x in (a, b))
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b) \
            and all(map(_equal, a, b))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    return bool(statically_known_true(a == b))


def _shape(node) -> tuple:
    return tuple(val(node).shape)


# ---------------------------------------------------------------- projection pieces

def _check_projection(match: Match) -> str | None:
    out = match.outputs[0]
    if isinstance(match.inputs[0], fx.Node) and val(match.inputs[0]).dim() != 3:
        return f"projection input has shape {_shape(match.inputs[0])}; the fused op needs [B, T, D_in]"
    weight = _projection_weight(match)
    if val(weight).dim() != 2:
        return f"projection weight has shape {_shape(weight)}; the fused op needs [D, D_in]"
    if out.target == aten.add.Tensor:
        if _arg(out, 2, "alpha", 1) != 1:
            return f"projection bias is added with alpha={_arg(out, 2, 'alpha', 1)}; the fused op needs alpha 1"
        bias = out.args[1]
        if not isinstance(bias, fx.Node) or _shape(bias) != (val(weight).shape[0],):
            got = _shape(bias) if isinstance(bias, fx.Node) else repr(bias)
            return f"projection bias is {got}; the fused op needs a [D] = [{val(weight).shape[0]}] tensor"
    return None


def _projection_weight(match: Match) -> fx.Node:
    """The [D, D_in] weight of a projection match (under its transpose for the matmul spellings)."""
    for node in match.nodes:
        if node.target == aten.linear.default:
            return node.args[1]
        if node.target == aten.matmul.default:
            return node.args[1].args[0]
    raise AssertionError("projection match without linear or matmul")


def _projection_bias(match: Match) -> fx.Node | None:
    out = match.outputs[0]
    if out.target == aten.add.Tensor:
        return out.args[1]
    if out.target == aten.linear.default:
        return _arg(out, 2, "bias")
    return None


def _check_weight_transpose(match: Match) -> str | None:
    for node in match.nodes:
        if node.target == aten.transpose.int and {d % 2 for d in node.args[1:3]} != {0, 1}:
            return f"weight transpose swaps dims {node.args[1:3]}, not (0, 1)"
        if node.target == aten.permute.default and [d % 2 for d in node.args[1]] != [1, 0]:
            return f"weight permute{tuple(node.args[1])} is not (1, 0)"
    return _check_projection(match)


# W.permute(1, 0) is also the normal form of einsum("btd,ed->bte", x, W)
# (W.t() and x.mT are transpose(0, 1) and transpose(1, 2) in the normal form)
_WEIGHT_TRANSPOSES = {"W.T": lambda w: w.T, "W.transpose(0, 1)": lambda w: w.transpose(0, 1),
                      "W.permute(1, 0)": lambda w: w.permute(1, 0)}
_x_in = torch.zeros(_B, _T, _D + 1)
_w_proj, _b_proj = torch.zeros(_D, _D + 1), torch.zeros(_D)


def _projection_pieces() -> list[Piece]:
    pieces = [Piece("projection", lambda x, w, b: F.linear(x, w, b), (_x_in, _w_proj, _b_proj),
                    _check_projection, "linear")]
    for spelling, transposed in _WEIGHT_TRANSPOSES.items():
        with_bias, without_bias = _matmul_spellings(transposed)
        pieces.append(Piece("projection", with_bias, (_x_in, _w_proj, _b_proj),
                            _check_weight_transpose, f"x @ {spelling} + b"))
        pieces.append(Piece("projection", without_bias, (_x_in, _w_proj),
                            _check_weight_transpose, f"x @ {spelling}"))
    return pieces


def _matmul_spellings(transposed: Callable) -> tuple[Callable, Callable]:
    def with_bias(x, w, b):
        return x @ transposed(w) + b

    def without_bias(x, w):
        return x @ transposed(w)

    return with_bias, without_bias


# ---------------------------------------------------------------- swap [B,T,D] <-> [B,D,T] pieces

def _check_swap(match: Match) -> str | None:
    node = match.outputs[0]
    x = match.inputs[0]
    if val(x).dim() != 3:
        return f"{node.target.__name__} of a {val(x).dim()}-D tensor; the chain is [B, T, D] ↔ [B, D, T]"
    if node.target == aten.transpose.int:
        dims = {d % 3 for d in node.args[1:3]}
        if dims != {1, 2}:
            return f"transpose{tuple(node.args[1:3])} does not swap the T and D dims (1, 2)"
    if node.target == aten.permute.default and [d % 3 for d in node.args[1]] != [0, 2, 1]:
        return f"permute{tuple(node.args[1])} is not (0, 2, 1)"
    return None


_x_btd = torch.zeros(_B, _T, _D)
def _swap_pieces() -> list[Piece]:
    return [
        Piece("swap", lambda x: x.transpose(1, 2), (_x_btd,), _check_swap, "transpose"),
        Piece("swap", lambda x: x.permute(0, 2, 1), (_x_btd,), _check_swap, "permute"),
    ]


# ---------------------------------------------------------------- causal conv pieces

def _check_conv_common(conv: fx.Node) -> str | None:
    """Checks every depthwise causal conv1d spelling shares: depthwise, stride 1, dilation 1."""
    x, weight = val(conv.args[0]), val(conv.args[1])
    if x.dim() != 3:
        return f"conv1d input has shape {tuple(x.shape)}; the pattern needs [B, D, T]"
    channels = x.shape[1]
    groups = _arg(conv, 6, "groups", 1)
    if not _equal(groups, channels) or not _equal(weight.shape[:2], (channels, 1)):
        return (f"conv1d has groups={groups} and weight {tuple(weight.shape)}; the pattern needs a depthwise conv "
                f"(groups = channels = {channels}, weight [{channels}, 1, K])")
    stride = list(_arg(conv, 3, "stride", [1]))
    if not _equal(stride, [1]):
        return f"conv1d has stride={stride}; the pattern needs stride 1"
    dilation = list(_arg(conv, 5, "dilation", [1]))
    if not _equal(dilation, [1]):
        return f"conv1d has dilation={dilation}; the fused op supports dilation 1 only"
    bias = _arg(conv, 2, "bias")
    if bias is not None and not _equal(_shape(bias), (channels,)):
        return f"conv1d bias has shape {_shape(bias)}; the pattern needs [{channels}]"
    return _padded_with_other_than_zeros(conv)


# what a padding mode other than zeros puts before the first token
_PAD_MODES = {"circular": "wraps the sequence around (the first outputs read the last tokens)",
              "replicate": "repeats the edge tokens",
              "reflect": "mirrors the tokens next to the edges (the first outputs read future tokens)"}


def _padded_with_other_than_zeros(conv: fx.Node) -> str | None:
    """The reason a conv1d reading ``F.pad(x, ..., mode=m)`` with m not zeros (also ``nn.Conv1d(padding_mode=m)``,
    which pads so) is no causal conv, or None."""
    pad = conv.args[0]
    if not (isinstance(pad, fx.Node) and pad.target == aten.pad.default):
        return None
    mode, value = pad_fill(pad)
    if mode == "constant" and value in (None, 0):
        return None
    if mode == "constant":
        padded = f"F.pad value={value}, not zeros"
    else:
        what = _PAD_MODES.get(mode, "does not pad with zeros")
        padded = f"F.pad mode={mode!r} (as nn.Conv1d padding_mode={mode!r} pads), which {what}"
    return f"conv1d input is padded with {padded}: not a causal zero-padded conv (K−1 zeros on the left)"


def _carried_state(conv: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(state [B, D, S], x [B, D, T]) when the conv reads ``torch.cat([state, x], time)``, i.e. the inputs before
    x carried from the previous chunk in place of the zero padding; None otherwise."""
    cat = conv.args[0]
    if not (isinstance(cat, fx.Node) and cat.target == aten.cat.default) or val(cat).dim() != 3:
        return None
    parts, dim = cat.args[0], _arg(cat, 1, "dim", 0)
    if len(parts) != 2 or dim % 3 != 2:
        return None
    return parts[0], parts[1]


def _check_state(conv: fx.Node, state: fx.Node) -> str | None:
    k, steps = val(conv.args[1]).shape[2], val(state).shape[2]
    if not _equal(steps, k - 1):
        return (f"conv1d reads cat([state, x]) with a state of {steps} steps; a causal conv of kernel {k} carries "
                f"the K−1={k - 1} inputs before x")
    return None


def _check_conv_then_slice(match: Match) -> str | None:
    conv, cut = match.node(aten.conv1d.default), match.node(aten.slice.Tensor)
    reason = _check_conv_common(conv)
    if reason:
        return reason
    k, seq_len = val(conv.args[1]).shape[2], val(conv.args[0]).shape[2]
    padding = list(_arg(conv, 4, "padding", [0]))
    dim, start, step = cut.args[1], _arg(cut, 2, "start"), _arg(cut, 4, "step", 1)
    carried = _carried_state(conv)
    if carried is not None and _equal(padding, [0]):  # causal_conv1d_update's reference: out[..., -T:] of all T
        reason = _check_state(conv, carried[0])
        if reason is None and (dim % 3 != 2 or step != 1 or not _equal(val(cut).shape[2], val(conv).shape[2])):
            reason = (f"conv1d over cat([state, x]) without padding, sliced (dim={dim}, start={start}, step={step}) "
                      f"to {val(cut).shape[dim]} of its {val(conv).shape[2]} outputs: not x's T outputs")
        return reason
    if not _equal(padding, [k - 1]):
        return (f"conv1d padding={padding} with kernel {k}: a causal conv pads K−1={k - 1} and keeps the first "
                f"T outputs")
    if carried is not None:   # output K−1+t is x[t]'s: its window ends at index K−1+t of cat([state, x])
        reason = _check_state(conv, carried[0])
        if reason:
            return reason
        seq_len = val(carried[1]).shape[2]
        if dim % 3 != 2 or not _equal(start, k - 1) or step != 1 or not _equal(val(cut).shape[2], seq_len):
            return (f"conv1d over cat([state, x]) pads {k - 1} on both sides but the slice (dim={dim}, start={start}, "
                    f"step={step}) keeps {val(cut).shape[dim]} outputs, not the T={seq_len} from K−1={k - 1} "
                    f"(x's outputs)")
        return None
    if dim % 3 != 2 or start not in (0, None) or step != 1 or not _equal(val(cut).shape[2], seq_len):
        return (f"conv1d pads {k - 1} on both sides but the slice (dim={dim}, start={start}, step={step}) keeps "
                f"{val(cut).shape[dim]} outputs, not the first T={seq_len}: not causal")
    return None


def _check_pad_then_conv(match: Match) -> str | None:
    conv, pad = match.node(aten.conv1d.default), match.node(aten.pad.default)
    reason = _check_conv_common(conv)
    if reason:
        return reason
    k = val(conv.args[1]).shape[2]
    amounts = list(pad.args[1])  # its mode is zeros (_check_conv_common)
    if not _equal(amounts[:2], [k - 1, 0]) or not all(_equal(a, 0) for a in amounts[2:]):
        return f"F.pad pads {tuple(amounts)} with kernel {k}; a causal conv pads (K−1, 0) = ({k - 1}, 0)"
    padding = list(_arg(conv, 4, "padding", [0]))
    if not _equal(padding, [0]):
        return f"conv1d after F.pad also pads {padding}; a causal conv pads only on the left"
    return None


def _check_unpadded_conv(match: Match) -> str | None:
    """A conv1d neither sliced nor after F.pad is causal as a pointwise (K = 1) conv, or over cat([state, x])."""
    conv = match.node(aten.conv1d.default)
    reason = _check_conv_common(conv)
    if reason:
        return reason
    k, padding = val(conv.args[1]).shape[2], list(_arg(conv, 4, "padding", [0]))
    if any(padding):
        return (f"conv1d padding={padding} pads both sides (kernel {k}) and no slice keeps the first T outputs: "
                f"outputs see future tokens, not causal")
    carried = _carried_state(conv)
    if carried is not None:
        return _check_state(conv, carried[0])
    if k != 1:
        return f"conv1d has no padding (kernel {k}) and no F.pad(K−1, 0) before it: not a causal conv"
    return None


_x_bdt, _w_conv, _b_conv = torch.zeros(_B, _D, _T), torch.zeros(_D, 1, _K), torch.zeros(_D)
def _conv_pieces() -> list[Piece]:
    return [
        Piece("conv", lambda x, w, b: F.conv1d(x, w, b, padding=_K - 1, groups=_D)[..., :_T],
              (_x_bdt, _w_conv, _b_conv), _check_conv_then_slice, "conv1d(padding=K-1)[..., :T]"),
        Piece("conv", lambda x, w, b: F.conv1d(F.pad(x, (_K - 1, 0)), w, b, groups=_D),
              (_x_bdt, _w_conv, _b_conv), _check_pad_then_conv, "F.pad(K-1, 0) → conv1d"),
        # any other conv1d: only K = 1 is causal without padding; tried last
        Piece("conv", lambda x, w, b: F.conv1d(x, w, b, groups=_D), (_x_bdt, _w_conv[..., :1], _b_conv),
              _check_unpadded_conv, "conv1d(K=1)"),
    ]


# ---------------------------------------------------------------- tail pieces: activation, heads, φ

def _no_literals(match: Match) -> str | None:
    return None


def _check_heads(match: Match) -> str | None:
    x, out = val(match.inputs[0]), val(match.outputs[0])
    if x.dim() not in (2, 3) or out.dim() != x.dim() + 1 or tuple(out.shape[:-2]) != tuple(x.shape[:-1]) \
            or out.shape[-2] * out.shape[-1] != x.shape[-1]:
        return f"reshape {tuple(x.shape)} → {tuple(out.shape)} is not a head split [B, T, D] → [B, T, H, D/H]"
    return None


def _check_elu_plus_one(match: Match) -> str | None:
    elu, add = match.node(aten.elu.default), match.node(aten.add.Tensor)
    alpha, scale, input_scale = _arg(elu, 1, "alpha", 1), _arg(elu, 2, "scale", 1), _arg(elu, 3, "input_scale", 1)
    if (alpha, scale, input_scale) != (1, 1, 1):
        return f"elu(alpha={alpha}, scale={scale}, input_scale={input_scale}) is not the ELU of ELU+1"
    other, add_alpha = add.args[1], _arg(add, 2, "alpha", 1)
    if isinstance(other, fx.Node) or other != 1 or add_alpha != 1:
        return f"elu(x) + {other if not isinstance(other, fx.Node) else other.name} is not ELU+1"
    return None


def _check_square(match: Match, what: str = "relu(x)", meaning: str = "the squared ReLU") -> str | None:
    """The pattern's ``x ** 2`` (the normal form of every square) matched a power of 2, not another."""
    for node in match.nodes:
        if node.target == aten.pow.Tensor_Scalar and node.args[1] != 2:
            return f"{what} ** {node.args[1]} is not {meaning}"
    return None


def _check_clamped_exp(match: Match) -> str | None:
    clamp = next(n for n in match.nodes if n.target != aten.exp.default)
    if clamp.target == aten.clamp.default:
        low, high = _arg(clamp, 1, "min"), _arg(clamp, 2, "max")
        if low is not None or not isinstance(high, (int, float)):
            return f"exp(clamp(x, min={low}, max={high})) is not exp(min(x, c)) with a constant c"
    elif not isinstance(clamp.args[1], (int, float)):
        return f"exp(clamp_max(x, {clamp.args[1]})) needs a constant bound"
    return None


def _check_linear_phi(match: Match) -> str | None:
    linear = match.node(aten.linear.default)
    if _arg(linear, 2, "bias") is not None:
        return "the linear feature map has a bias; φ(k) = W_phi k has none"
    return _check_phi_weight(match)


def _check_phi_weight(match: Match) -> str | None:
    z, weight = val(match.inputs[0]), val(match.inputs[1])
    if weight.dim() != 2 or weight.shape[1] != z.shape[-1]:
        return f"feature-map weight {tuple(weight.shape)} is not [d_phi, {z.shape[-1]}]"
    return None


def _is_close(value, expected: float) -> bool:
    return isinstance(value, (int, float)) and math.isclose(value, expected, rel_tol=1e-6)


def _check_random_fourier(match: Match) -> str | None:
    reason = _check_phi_weight(match)
    if reason:
        return reason
    d_phi = val(match.inputs[1]).shape[0]
    if val(match.inputs[2]).shape != (d_phi,):
        return f"random Fourier bias has shape {_shape(match.inputs[2])}, not [d_phi] = [{d_phi}]"
    scale = match.outputs[0].args[1]
    if not _is_close(scale, math.sqrt(2.0 / d_phi)):
        return f"random Fourier features scaled by {scale}, not sqrt(2/d_phi) = {math.sqrt(2.0 / d_phi):.6g}"
    return None


def _check_performer(match: Match) -> str | None:
    reason = _check_phi_weight(match) or _check_square(match, "k", "the square in ‖k‖²")
    if reason:
        return reason
    z, d_phi = val(match.inputs[0]), val(match.inputs[1]).shape[0]
    total = match.node(aten.sum.dim_IntList)
    dims, keepdim = [d % z.dim() for d in total.args[1]], _arg(total, 2, "keepdim", False)
    if dims != [z.dim() - 1] or not keepdim:
        return f"‖k‖² sums over dims {total.args[1]} (keepdim={keepdim}), not the feature dim"
    outer = match.outputs[0]  # exp(...) / sqrt(d_phi); the other division halves ‖k‖²
    inner = next(n for n in match.nodes if n.target == aten.div.Tensor and n is not outer)
    half, scale = inner.args[1], outer.args[1]
    if not _is_close(half, 2.0) or not _is_close(scale, math.sqrt(d_phi)):
        return (f"exp(Wk − ‖k‖²/{half}) / {scale} is not the FAVOR+ map exp(Wk − ‖k‖²/2) / sqrt(d_phi) "
                f"(sqrt(d_phi) = {math.sqrt(d_phi):.6g})")
    return None


_w_phi, _b_phi = torch.zeros(_D + 2, _D), torch.zeros(_D + 2)  # d_phi ≠ D


def _linear_phi(z, w):
    return F.linear(z, w)


def _linear_phi_matmul(z, w):
    return z @ w.T


def _random_fourier(z, w, b):
    return math.sqrt(2.0 / w.shape[0]) * torch.cos(z @ w.T + b)


def _random_fourier_linear(z, w, b):
    return math.sqrt(2.0 / w.shape[0]) * torch.cos(F.linear(z, w, b))


def _performer(z, w):
    return torch.exp(z @ w.T - (z ** 2).sum(dim=-1, keepdim=True) / 2) / math.sqrt(w.shape[0])


# What each matrix φ computes, for recognising one written another way by its values (:func:`_matrix_phi_by_value`)
_MATRIX_PHI_VALUES = {"linear": (_linear_phi_matmul, False), "random_fourier": (_random_fourier, True),
                      "performer": (_performer, False)}  # (φ(z, W[, b]), whether it reads a bias)


MATRIX_PHI = ("linear", "random_fourier", "performer")
"""φ kinds that mix the feature dimension: they act per head, after the head split, and end the chain."""


def _tail_pieces() -> list[Piece]:
    x = (_x_btd,)
    return [
        Piece("activation", lambda z: F.silu(z), x, _no_literals, "silu"),
        Piece("activation", lambda z: z * torch.sigmoid(z), x, _no_literals, "silu"),
        Piece("activation", lambda z: torch.sigmoid(z) * z, x, _no_literals, "silu"),
        Piece("heads", lambda z: z.view(_B, _T, 2, _D // 2), x, _check_heads),
        Piece("heads", lambda z: z.reshape(_B, _T, 2, _D // 2), x, _check_heads),
        Piece("heads", lambda z: z.unflatten(-1, (2, _D // 2)), x, _check_heads),
        # a decode step's [B, D]
        Piece("heads", lambda z: z.view(_B, 2, _D // 2), (_x_btd[:, 0],), _check_heads),
        Piece("heads", lambda z: z.reshape(_B, 2, _D // 2), (_x_btd[:, 0],), _check_heads),
        # φ: longest spellings first, so relu² is tried before relu (r.square() and r * r are r ** 2 in the
        # normal form)
        Piece("phi", lambda z: F.elu(z) + 1, x, _check_elu_plus_one, "elu1"),
        Piece("phi", lambda z: F.relu(z) ** 2, x, _check_square, "relu2"),
        Piece("phi", lambda z: torch.exp(torch.clamp(z, max=10.0)), x, _check_clamped_exp, "exp"),
        Piece("phi", lambda z: torch.exp(torch.clamp_max(z, 10.0)), x, _check_clamped_exp, "exp"),
        Piece("phi", lambda z: torch.exp(z), x, _no_literals, "exp"),
        Piece("phi", lambda z: F.relu(z), x, _no_literals, "relu"),
        Piece("phi", _random_fourier, (_x_btd, _w_phi, _b_phi), _check_random_fourier, "random_fourier"),
        Piece("phi", _random_fourier_linear, (_x_btd, _w_phi, _b_phi), _check_random_fourier, "random_fourier"),
        Piece("phi", _performer, (_x_btd, _w_phi), _check_performer, "performer"),
        Piece("phi", _linear_phi, (_x_btd, _w_phi), _check_linear_phi, "linear"),
        Piece("phi", _linear_phi_matmul, (_x_btd, _w_phi), _check_phi_weight, "linear"),
    ]


_PIECES: list[Piece] | None = None


def pieces() -> list[Piece]:
    """Every spelling piece, traced once on first use."""
    global _PIECES
    if _PIECES is None:
        _PIECES = _projection_pieces() + _swap_pieces() + _conv_pieces() + _tail_pieces()
    return _PIECES


# ---------------------------------------------------------------- linking pieces into chains

@dataclass
class _Found:
    piece: Piece
    match: Match

    @property
    def input(self):
        return self.match.inputs[0]

    @property
    def output(self) -> fx.Node:
        return self.match.outputs[0]


@dataclass
class _State:
    """The conv's carried state: ``cat`` = cat([state, x]) it reads, ``node`` the state [B, D, K−1] in it, and
    ``swap`` the [B, K−1, D] → [B, D, K−1] transpose that made it (None: the op gets a transpose of ``node``)."""

    cat: fx.Node
    node: fx.Node
    swap: _Found | None

    @property
    def op_input(self) -> fx.Node | None:
        """The [B, K−1, D] state the op reads, when the graph has it."""
        return self.swap.input if self.swap is not None else None

    @property
    def covered(self) -> list[fx.Node]:
        """The nodes the op replaces: the cat (and the state's transpose) unless another reader keeps the cat."""
        if len(self.cat.users) != 1:
            return []
        return [self.cat] + (self.swap.match.nodes if self.swap is not None else [])


@dataclass
class _Window:
    """A decode step's conv written as its window product: z [B, D] = Σ_k window[:, k] · w[:, k] (+ b) over
    window = cat([state [B, K−1, D], x_t [B, 1, D]], 1), or ``channels_first`` over a rolling window
    cat([state [B, D, K−1], x_t [B, D, 1]], 2) (``cache[..., 1:]`` and the new column). ``weight`` is the tensor
    the product reads, in ``layout`` "D1K" (the nn.Conv1d weight), "DK" or "KD"; ``nodes`` the product (and the
    bias add)."""

    cat: fx.Node
    weight: fx.Node
    layout: str
    bias: fx.Node | None
    nodes: list[fx.Node]
    output: fx.Node
    channels_first: bool = False
    keepdim: bool = False  # z [B, 1, D] (summed with keepdim=True over a [B, K, D] window), the op's own layout

    @property
    def state(self) -> fx.Node:
        return self.cat.args[0][0]

    @property
    def x(self) -> fx.Node:
        return self.cat.args[0][1]


@dataclass
class _Chain:
    projection: _Found | None
    swap_in: _Found | None      # None for a window step, which has no swaps and no conv1d
    conv: _Found | None
    tail: list[_Found]
    state: _State | None = None
    window: _Window | None = None
    batch_swap: fx.Node | None = None   # the [T, B, D] → [B, T, D] transpose between the projection and swap_in
    channels_first: bool = False  # no swap back: the chain's output is [B, D, T], the op's result transposed

    @property
    def parts(self) -> list[_Found]:
        return [p for p in [self.projection, self.swap_in, self.conv, *self.tail] if p is not None]

    @property
    def output(self) -> fx.Node:
        """The last node the op stands for."""
        return self.tail[-1].output if self.tail else self.window.output if self.window else self.conv.output

    @property
    def kernel_size(self) -> int:
        if self.window is not None:
            return val(self.window.cat).shape[2 if self.window.channels_first else 1]
        return val(self.conv.match.node(aten.conv1d.default).args[1]).shape[2]

    def stage(self, name: str) -> _Found | None:
        return next((p for p in self.tail if p.piece.stage == name), None)


class _Index:
    """Every piece match in the graph, looked up by the node it reads or produces."""

    def __init__(self, gm: fx.GraphModule):
        self.by_output: dict[tuple[str, fx.Node], list[_Found]] = {}
        self.by_input: dict[fx.Node, list[_Found]] = {}
        self.conv_by_node: dict[fx.Node, _Found] = {}
        for piece in pieces():
            for match in find_matches(gm, piece.pattern):
                found = _Found(piece, match)
                self.by_output.setdefault((piece.stage, found.output), []).append(found)
                if piece.stage in ("swap", "activation", "heads", "phi") and isinstance(found.input, fx.Node):
                    self.by_input.setdefault(found.input, []).append(found)
                if piece.stage == "conv":  # the first conv spelling that covers a conv1d wins
                    self.conv_by_node.setdefault(match.node(aten.conv1d.default), found)

    def producer(self, stage: str, node: fx.Node) -> _Found | None:
        """The ``stage`` piece whose output is ``node`` and is read only by its consumer."""
        if not isinstance(node, fx.Node) or len(node.users) != 1:
            return None
        return next(iter(self.by_output.get((stage, node), [])), None)

    def consumers(self, node: fx.Node) -> list[_Found]:
        """The tail pieces reading ``node`` that contain every user of ``node``."""
        return [f for f in self.by_input.get(node, []) if set(node.users) <= set(f.match.nodes)]


def _conv_input_node(conv: _Found) -> fx.Node:
    """x [B, D, T]: what the conv (or its F.pad) reads; with a carried state, the part of the cat after it."""
    if conv.piece.check is _check_pad_then_conv:
        return conv.match.node(aten.pad.default).args[0]
    conv_node = conv.match.node(aten.conv1d.default)
    carried = _carried_state(conv_node)
    return carried[1] if carried is not None else conv_node.args[0]


def _state_of(conv: _Found, index: _Index) -> _State | None:
    """The carried state of a conv over cat([state, x]) (None for a conv over zero padding)."""
    conv_node = conv.match.node(aten.conv1d.default)
    carried = _carried_state(conv_node) if conv.piece.check is not _check_pad_then_conv else None
    if carried is None:
        return None
    swap = index.producer("swap", carried[0])
    if swap is not None and swap.piece.check(swap.match):
        swap = None
    return _State(conv_node.args[0], carried[0], swap)


def _build_chain(conv_node: fx.Node, index: _Index, report: FusionReport) -> _Chain | str:
    """The fusable chain around ``conv_node``, or the reason there is none."""
    if conv_node.target == aten.conv1d.padding:
        return (f"conv1d padding={conv_node.args[4]!r} pads both sides (or none): a causal conv pads K−1 on "
                f"the left only")
    common = _check_conv_common(conv_node)
    if common:
        return common
    conv = index.conv_by_node[conv_node]
    reason = conv.piece.check(conv.match)
    if reason:
        return reason

    # a pad read beside the conv too (a prefill's state: the padded input's last K−1 steps) keeps what it pads,
    # so the op reads that as it is rather than computing its producers again
    padded_elsewhere = conv.piece.check is _check_pad_then_conv and len(conv.match.node(aten.pad.default).users) > 1
    swap_in = None if padded_elsewhere else index.producer("swap", _conv_input_node(conv))
    if swap_in is None and _state_of(conv, index) is not None:
        return (f"conv1d input {_conv_input_node(conv).name} is not a [B, T, D] → [B, D, T] transpose used only by "
                f"the conv; the fused op reads [B, T, D] and its carried state [B, K−1, D]")
    reason = swap_in.piece.check(swap_in.match) if swap_in is not None else None
    if reason:
        return reason

    # (no swap in: the conv reads a [B, D, T] tensor as it is, which the op reads transposed)
    batch_swap = _batch_swap(swap_in.input) if swap_in is not None and len(swap_in.input.users) == 1 else None
    projection = index.producer("projection", batch_swap.args[0] if batch_swap is not None else swap_in.input) \
        if swap_in is not None else None
    if projection is None:
        batch_swap = None
    if projection is not None:
        reason = projection.piece.check(projection.match)
        if reason:
            report.add_miss(PATTERN, f"projection not fused: {reason}", projection.match.where())
            projection = None

    tail = _walk_tail(conv.output, index, report)
    # (no swap back: the chain stays [B, D, T], SiLU and an elementwise φ per channel alike; the op's [B, T, D]
    # result transposed back is what it computes)
    chain = _Chain(projection, swap_in, conv, tail, _state_of(conv, index), batch_swap=batch_swap,
                   channels_first=not any(p.piece.stage == "swap" for p in tail))
    reason = _check_dtypes(chain)
    return reason or chain


def _batch_swap(node: fx.Node) -> fx.Node | None:
    """``node`` when it is ``h.transpose(0, 1)`` of a [T, B, D] h read by it alone (a sequence-first layout, whose
    projection then acts on [T, B, D]: the op projects x.transpose(0, 1) instead, the same rows), else None."""
    if node is None or node.target is not aten.transpose.int or val(node).dim() != 3 \
            or {d % 3 for d in node.args[1:3]} != {0, 1} or not isinstance(node.args[0], fx.Node) \
            or len(node.args[0].users) != 1:
        return None
    return node


def _walk_tail(node: fx.Node, index: _Index, report: FusionReport, channels_last: bool = False) -> list[_Found]:
    """The tail stages after the conv, each at most once: swap back, SiLU (before φ), head split
    (after the swap back), φ. The order of the rest is free: they are elementwise or layout-only,
    except a matrix φ, which needs the channels last (after the swap back) and ends the chain.
    An elementwise φ is read where no other stage follows (:func:`_elementwise_phi`).
    ``channels_last``: the conv's output is already [..., D] (a window step): no swap back."""
    tail: list[_Found] = []
    while True:
        done = {p.piece.stage for p in tail}
        found = None
        for candidate in index.consumers(node):
            stage, matrix = candidate.piece.stage, candidate.piece.value in MATRIX_PHI
            if stage in done or (stage == "activation" and "phi" in done) or (stage == "swap" and channels_last) \
                    or ((stage == "heads" or matrix) and "swap" not in done and not channels_last) \
                    or (stage == "phi" and not matrix):
                continue
            reason = candidate.piece.check(candidate.match)
            if reason:
                report.add_miss(PATTERN, f"{stage} not fused: {reason}", candidate.match.where())
                continue
            found = candidate
            break
        if found is None and "phi" not in done:
            found = _elementwise_phi(node, index)
        if found is None and "phi" not in done and ("swap" in done or channels_last):
            found = _matrix_phi_by_value(node)
        if found is None and "swap" in done and "batch" not in done and _batch_swap(_only_user(node)) is not None:
            found = _single(_only_user(node), _Stage("batch"))  # [B, T, D] → [T, B, D]: the op's output swapped
        if found is None:
            return [p for p in tail if p is not tail[-1] or p.piece.stage != "batch"]  # a swap last stays
        tail.append(found)
        if found.piece.value in MATRIX_PHI:  # the feature dim changed: nothing after it is per channel
            return tail
        node = found.output


@dataclass(frozen=True)
class _Stage:
    """A tail stage found by reading the graph, not by a piece: ``stage`` "phi" when φ is the user's own
    elementwise function (``value`` its expression), "batch" for a [B, T, D] → [T, B, D] transpose."""

    stage: str
    value: str = ""

    @staticmethod
    def check(match: Match) -> str | None:
        return None


def _only_user(node: fx.Node) -> fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _single(node: fx.Node, stage: _Stage, inputs: list | None = None, output: fx.Node | None = None) -> _Found:
    """``stage`` covering ``node`` (or the region from ``inputs`` to ``output``), assembled here: no fixed pattern."""
    covered = {node: node} if isinstance(node, fx.Node) else {n: n for n in node}
    return _Found(stage, Match(fx.Graph(), InternalMatch(
        anchors=[], nodes_map=covered, placeholder_nodes=inputs or [node.args[0]], returning_nodes=[output or node])))


def _elementwise_phi(node: fx.Node, index: _Index) -> _Found | None:
    """φ = the largest elementwise function of ``node`` the graph computes next (every reader of ``node``
    inside it), or None. A φ piece covering exactly that function is the op's fast path for it."""
    output, region = pointwise.grow(node)
    if not region or not set(node.users) <= set(region):
        return None
    if val(output).dtype != val(node).dtype:      # e.g. a comparison: the op returns the activation's dtype
        return None
    for candidate in index.consumers(node):
        if candidate.piece.stage == "phi" and candidate.piece.value not in MATRIX_PHI \
                and set(candidate.match.nodes) == set(region) and candidate.piece.check(candidate.match) is None:
            return candidate
    expression = pointwise.extract(node, output)
    return _single(region, _Stage("phi", "identity" if expression == "x" else expression), [node], output)


_PHI_SEARCH = 24  # nodes a feature map written out may take


def _matrix_phi_by_value(node: fx.Node) -> _Found | None:
    """φ = a feature map the op fuses (:data:`_MATRIX_PHI_VALUES`) written another way (``0.5 * (z ** 2).sum(-1)``,
    ``z.norm(dim=-1) ** 2``, ``F.linear(z, W)`` in FAVOR+): the function of ``node`` the graph computes next
    (every reader of ``node`` inside it) from one weight [d_phi, D] (and a bias [d_phi]) read from the graph's
    inputs, equal to one of them at random points (float64, a private generator). None otherwise."""
    region, outside = [], []
    pending = list(node.users)
    while pending and len(region) <= _PHI_SEARCH:
        user = pending.pop(0)
        if user in region or user.op != "call_function" or is_register_hook(user.target):
            continue
        ins = user.all_input_nodes
        if not all(x is node or x in region or not computed_from([x], {node}) for x in ins):
            continue
        region.append(user)
        outside += [x for x in ins if x is not node and x not in region and x not in outside]
        pending += list(user.users)
    exits = [n for n in region if any(u not in region for u in n.users)]
    params = [p for x in outside if (p := _param_behind_views(x)) is not None]
    if len(exits) != 1 or not set(node.users) <= set(region) or len(params) != len(outside) \
            or not isinstance(val(node).shape[-1], int) or val(exits[0]).dtype != val(node).dtype:
        return None
    weights = [p for p in dict.fromkeys(params) if val(p).dim() == 2 and val(p).shape[1] == val(node).shape[-1]]
    if len(weights) != 1:
        return None
    (w,), d_phi = weights, val(weights[0]).shape[0]
    biases = [p for p in dict.fromkeys(params) if p is not w and tuple(val(p).shape) == (d_phi,)]
    if len(biases) + 1 != len(dict.fromkeys(params)) or len(biases) > 1 or tuple(val(exits[0]).shape) != (
            *val(node).shape[:-1], d_phi):
        return None
    gen = torch.Generator().manual_seed(20261126)
    z = torch.randn(2, 3, val(node).shape[-1], generator=gen, dtype=torch.float64)
    values = {w: torch.randn(d_phi, val(node).shape[-1], generator=gen, dtype=torch.float64) / 2}
    values.update({b: torch.rand(d_phi, generator=gen, dtype=torch.float64) * 6 for b in biases})
    try:
        got = evaluate(exits[0], {node: z, **values})
    except Exception:  # noqa: BLE001  (not evaluable at these sizes: not recognised)
        return None
    for kind, (phi, reads_bias) in _MATRIX_PHI_VALUES.items():
        if reads_bias == bool(biases) and torch.allclose(got, phi(z, *values.values()), rtol=1e-9, atol=1e-12):
            return _single(region, _Stage("phi", kind), [node, w, *biases], exits[0])
    return None


def _param_behind_views(x: fx.Node) -> fx.Node | None:
    """The graph input (a parameter, buffer or argument) ``x`` is, or is a transpose or view of."""
    while x.op == "call_function" and x.target in (aten.transpose.int, aten.permute.default, aten.numpy_T.default,
                                                   aten.t.default, aten.detach.default):
        x = x.args[0]
    return x if x.op in ("placeholder", "get_attr") else None


def _check_dtypes(chain: _Chain) -> str | None:
    tensors = [n for n in _op_tensor_args(chain) if isinstance(n, fx.Node)]
    tensors += [chain.state.node] if chain.state is not None else []
    tensors += [chain.window.state] if chain.window is not None else []
    dtypes = {val(n).dtype for n in tensors}
    if len(dtypes) > 1:
        return f"inputs have mixed dtypes {sorted(map(str, dtypes))}; the fused op needs one dtype"
    return None


def _op_tensor_args(chain: _Chain) -> list:
    """[x, proj_weight, proj_bias, conv_weight, conv_bias]; a window step's conv_weight is the tensor its
    product reads (:func:`_window_weight` gives the op's [D, 1, K])."""
    if chain.window is not None:
        return [chain.window.x, None, None, chain.window.weight, chain.window.bias]
    conv_node = chain.conv.match.node(aten.conv1d.default)
    if chain.projection is not None:
        x = chain.projection.input
        weight, bias = _projection_weight(chain.projection.match), _projection_bias(chain.projection.match)
    else:
        x, weight, bias = chain.swap_in.input if chain.swap_in is not None else _conv_input_node(chain.conv), None, None
    return [x, weight, bias, conv_node.args[1], _arg(conv_node, 2, "bias")]


# ---------------------------------------------------------------- a decode step's window product

# How a window step's weight is laid out: the [D, K] matrix the product reads, and the op's [D, 1, K] from it.
_WINDOW_LAYOUTS = {"D1K": (lambda w: w[:, 0], ()), "DK": (lambda w: w, ((aten.unsqueeze.default, (1,)),)),
                   "KD": (lambda w: w.t(), ((aten.t.default, ()), (aten.unsqueeze.default, (1,))))}
_WINDOW_SEARCH = 8  # nodes between the window and z: an einsum, or a product and a sum, and the weight's views


def _window_step(cat: fx.Node) -> _Window | None:
    """The conv a decode step writes as z = Σ_k window[:, k] · w[:, k] (+ b) over window = cat([state, x_t], 1),
    read by evaluating the product at random float64 points (a private generator); None if ``cat`` is not one."""
    parts, dim = cat.args[0], _arg(cat, 1, "dim", 0)
    window = val(cat)
    if window.dim() != 3 or len(parts) != 2 or dim % 3 not in (1, 2) or val(parts[1]).shape[dim % 3] != 1 \
            or not window.dtype.is_floating_point:
        return None
    channels_first = dim % 3 == 2
    batch, channels = window.shape[0], window.shape[1 if channels_first else 2]
    # (a product by matmul: unsqueeze, matmul, squeeze, squeeze; a z [B, 1, D] only where none is [B, D])
    for z in sorted(descendants(cat, depth=5), key=lambda n: tuple(getattr(val(n), "shape", ())) != (batch, channels)):
        keepdim = not channels_first and tuple(val(z).shape) == (batch, 1, channels)
        if tuple(val(z).shape) != (batch, channels) and not keepdim or val(z).dtype != window.dtype:
            continue
        found = _window_product(cat, z, channels_first)
        if found is not None:
            nodes, weight, layout = found
            bias, output = _bias_add(z, channels)
            return _Window(cat, weight, layout, bias, nodes + ([output] if bias is not None else []), output,
                           channels_first, keepdim)
    return None


def _window_product(cat: fx.Node, z: fx.Node, channels_first: bool) -> tuple[list[fx.Node], fx.Node, str] | None:
    """(the nodes computing z from the window and one weight tensor, that tensor, its layout) when z is
    Σ_k window[:, k] · w[:, k] (window[:, :, k] where ``channels_first``) at random points; None otherwise."""
    region, leaves, stack = [], [], [z]
    while stack:
        node = stack.pop()
        if node is cat or node in region or node in leaves:
            continue
        if node.op != "call_function":
            leaves.append(node)
            continue
        if len(region) == _WINDOW_SEARCH or not isinstance(node.target, torch._ops.OpOverload) \
                or node.target._schema.is_mutable or torch.Tag.nondeterministic_seeded in node.target.tags:
            return None
        region.append(node)
        stack.extend(node.all_input_nodes)
    if len(leaves) != 1 or not isinstance(val(leaves[0]), torch.Tensor):
        return None
    reads_window = {n for n in region if cat in _ancestors_in(n, region)}
    if any(u not in region for n in reads_window - {z} for u in n.users):
        return None                                   # an intermediate someone else reads
    window = val(cat)
    k, channels = (window.shape[2], window.shape[1]) if channels_first else (window.shape[1], window.shape[2])
    # the taps: the one tensor read, or what the product reads computed from it alone (w.flip(-1), w[:, 1:])
    for weight in [leaves[0]] + [n for n in region if n not in reads_window]:
        layouts = [name for name, shape in (("D1K", (channels, 1, k)), ("DK", (channels, k)), ("KD", (k, channels)))
                   if _equal(tuple(val(weight).shape), shape)]
        product = [n for n in region if n not in _ancestors_in(weight, region) and n is not weight]
        found = _product_reads_as_conv(cat, z, weight, layouts, product, channels_first) if layouts else None
        if found is not None:
            return found
    return None


def _product_reads_as_conv(cat: fx.Node, z: fx.Node, weight: fx.Node, layouts: list[str], region: list[fx.Node],
                           channels_first: bool) -> tuple[list[fx.Node], fx.Node, str] | None:
    """(region, weight, its layout) when ``region`` computes z = Σ_k window[:, k] · w[:, k] from the window and
    ``weight`` in one of ``layouts``, at random float64 points; None otherwise."""
    window = val(cat)
    k, channels = (window.shape[2], window.shape[1]) if channels_first else (window.shape[1], window.shape[2])
    order = {n: i for i, n in enumerate(cat.graph.nodes)}
    region.sort(key=order.__getitem__)
    generator = torch.Generator().manual_seed(0)
    k, channels = size_hint(k), size_hint(channels)  # (symbolic under dynamic=True: drawn at their values now)
    batch = window.shape[0] if isinstance(window.shape[0], int) else 2
    points = {cat: torch.randn(batch, k, channels, generator=generator, dtype=torch.float64),
              weight: torch.randn(tuple(map(size_hint, val(weight).shape)), generator=generator,
                                  dtype=torch.float64)}
    if channels_first:
        points[cat] = points[cat].transpose(1, 2)
    try:
        for node in region:
            points[node] = node.target(*fx.node.map_arg(node.args, points.__getitem__),
                                       **fx.node.map_arg(node.kwargs, points.__getitem__))
    except Exception:  # noqa: BLE001 - a region that does not run on these points is not the product
        return None
    for layout in layouts:
        expected = torch.einsum("bdk,dk->bd" if channels_first else "bkd,dk->bd", points[cat],
                                _WINDOW_LAYOUTS[layout][0](points[weight]))
        got = points[z].reshape(expected.shape) if points[z].numel() == expected.numel() else None
        if got is not None and torch.allclose(got, expected, rtol=1e-9, atol=1e-12):  # (z [B, D], or [B, 1, D])
            return region, weight, layout
    return None


def _ancestors_in(node: fx.Node, region: list[fx.Node]) -> set[fx.Node]:
    """What ``node`` reads, transitively, through ``region``."""
    seen, stack = set(), list(node.all_input_nodes)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            if n in region:
                stack.extend(n.all_input_nodes)
    return seen


def _bias_add(z: fx.Node, channels) -> tuple[fx.Node | None, fx.Node]:
    """(b, z + b) when z's one reader adds a [D] bias; else (None, z)."""
    if len(z.users) != 1:
        return None, z
    add = next(iter(z.users))
    if add.target != aten.add.Tensor or _arg(add, 2, "alpha", 1) != 1:
        return None, z
    other = add.args[1] if add.args[0] is z else add.args[0]
    if not isinstance(other, fx.Node) or tuple(val(other).shape) != (channels,):
        return None, z
    return other, add


def _window_weight(gm: fx.GraphModule, window: _Window) -> fx.Node:
    """The op's conv_weight [D, 1, K] from the tensor the window product reads (views inserted after it)."""
    node = window.weight
    for target, literals in _WINDOW_LAYOUTS[window.layout][1]:
        with gm.graph.inserting_after(node):
            view = gm.graph.call_function(target, (node, *literals))
        view.meta["val"] = target(val(node), *literals)
        node = view
    return node


# ---------------------------------------------------------------- the pass

def _tokens_as_transposed_steps(graph: fx.Graph) -> None:
    """One token x_t [B, D] joined to a conv state [B, D, S] as ``x_t.unsqueeze(-1)`` [B, D, 1] (causal_conv1d_update's
    reference) → ``x_t.unsqueeze(1).transpose(1, 2)``: the same view, the [B, T, D] → [B, D, T] swap of a sequence
    of one step, which a streaming conv reads."""
    for cat in graph.find_nodes(op="call_function", target=aten.cat.default):
        parts, dim = cat.args[0], _arg(cat, 1, "dim", 0)
        token = parts[-1] if len(parts) == 2 and isinstance(parts[-1], fx.Node) else None
        if token is None or token.target != aten.unsqueeze.default or val(cat).dim() != 3 or dim % 3 != 2 \
                or token.args[1] % 3 != 2 or val(token.args[0]).dim() != 2 \
                or not any(u.target in CONV1D_OPS for u in cat.users):
            continue
        with graph.inserting_before(token):
            step = graph.call_function(aten.unsqueeze.default, (token.args[0], 1))
            step.meta = {**token.meta, "val": val(token.args[0]).unsqueeze(1)}
            swapped = graph.call_function(aten.transpose.int, (step, 1, 2))
            swapped.meta = {**token.meta, "val": val(step).transpose(1, 2)}
        token.replace_all_uses_with(swapped)
        graph.erase_node(token)


def run(gm: fx.GraphModule, report: FusionReport) -> None:
    """Replace every projection → causal conv → SiLU → φ chain (or partial chain) by one op."""
    import hecate.lowering  # noqa: F401  registers torch.ops.hecate.qk_preprocess

    op = torch.ops.hecate.qk_preprocess.default
    _tokens_as_transposed_steps(gm.graph)
    index = _Index(gm)
    chains = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in CONV1D_OPS:
            chain = _build_chain(node, index, report)
            if isinstance(chain, str):
                report.add_miss(PATTERN, chain, node.name)
            else:
                chains.append(chain)
        elif node.op == "call_function" and node.target == aten.cat.default:
            window = _window_step(node)
            if window is not None:
                chain = _Chain(None, None, None, _walk_tail(window.output, index, report, channels_last=True),
                               window=window)
                reason = _check_dtypes(chain)
                if reason:
                    report.add_miss(PATTERN, f"decode step's window product: {reason}", window.output.name)
                else:
                    chains.append(chain)
    # Replaced from the last: a chain's op then reads the inputs its match found (a chain fed by the one before it
    # reads that chain's output, which the earlier chain's op takes over when it is replaced after). The report
    # lists them in the graph's order.
    first = len(report.fusions)
    for chain in reversed(_without_overlaps(chains)):
        try:
            _replace(gm, chain, op, report)
        except NotFused as why:  # found only when replacing: gradients that stop inside the chain
            report.add_miss(PATTERN, str(why), nodes=[n for part in chain.parts for n in part.match.nodes])
    report.fusions[first:] = report.fusions[first:][::-1]


def _without_overlaps(chains: list[_Chain]) -> list[_Chain]:
    """The chains, none computing a value an earlier one computes. Stacked chains meet where one's matrix φ is the
    next one's projection (``chain(chain(x, W1), W2)``: silu(..) @ W2.T is both): the earlier chain keeps it as its
    φ, the later one reads the product as its input. (Chains may share views of a weight, W.T of one φ for q and
    k: each op reads it.)"""
    computed: set[fx.Node] = set()
    kept = []
    for chain in chains:
        if chain.projection is not None and chain.projection.output in computed:
            chain = replace(chain, projection=None, batch_swap=None)
        computed |= _nodes(chain)
        kept.append(chain)
    return kept


def _nodes(chain: _Chain, window: bool = True) -> set[fx.Node]:
    """Every node a chain's op stands for (``window=False``: but those of its step's window)."""
    nodes = {node for part in chain.parts for node in part.match.nodes}
    if chain.batch_swap is not None:
        nodes.add(chain.batch_swap)
    if chain.state is not None:
        nodes |= set(chain.state.covered)
    if chain.window is not None and window:
        nodes |= {chain.window.cat, *chain.window.nodes}
    return nodes


def _replace(gm: fx.GraphModule, chain: _Chain, op, report: FusionReport) -> None:
    phi, heads = chain.stage("phi"), chain.stage("heads")
    phi_kind = phi.piece.value if phi is not None else "identity"
    phi_params = phi.match.inputs[1:] if phi is not None else []  # W_phi (and b_phi) of a matrix φ
    args = _op_tensor_args(chain) + [
        "silu" if chain.stage("activation") else "none", phi_kind, phi_params, _phi_scalar(phi)]
    # One match covering every node the op stands for. They key themselves: two parts may come
    # from the same piece (the swap in and the swap back), whose pattern nodes would collide.
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    covered = {node: node for node in sorted(_nodes(chain), key=order.__getitem__)}
    nodes_replaced = len(_nodes(chain, window=False))
    if chain.batch_swap is not None:
        x = chain.projection.input
        with gm.graph.inserting_before(chain.batch_swap):
            args[0] = gm.graph.call_function(aten.transpose.int, (x, 0, 1))
        args[0].meta["val"] = val(x).transpose(0, 1)
    if chain.swap_in is None and chain.window is None:  # x [B, D, T] read as it is: the op's [B, T, D] its transpose
        with gm.graph.inserting_after(args[0]):
            transposed = gm.graph.call_function(aten.transpose.int, (args[0], 1, 2))
        transposed.meta["val"] = val(args[0]).transpose(1, 2)
        args[0] = transposed
    if chain.state is not None:
        args.append(_state_argument(gm, chain.state))
        if not chain.state.covered:  # a cat another node reads stays, and with it x's transpose
            nodes_replaced -= len(chain.swap_in.match.nodes)
    if chain.window is not None:
        args[3] = _window_weight(gm, chain.window)
        args.append(chain.window.state)
        if chain.window.channels_first:  # the op's x [B, 1, D] and state [B, K−1, D]
            for i in (0, -1):
                with gm.graph.inserting_before(chain.window.cat):
                    swapped = gm.graph.call_function(aten.transpose.int, (args[i], 1, 2))
                swapped.meta["val"] = val(args[i]).transpose(1, 2)
                args[i] = swapped
        # the window itself stays when the step also returns window[:, 1:] as its next state
        nodes_replaced += _erased([chain.window.cat, *chain.window.nodes], chain.window.output)
    match = Match(fx.Graph(), InternalMatch(anchors=[], nodes_map=covered, returning_nodes=[chain.output]))
    detail = _describe(chain, phi_kind, _phi_scalar(phi))
    result = val(chain.output)  # [B, T, H, Dh or d_phi] when the chain splits heads; [B, (H,) D] for a window step
    call = replace_with_op(gm, match, op, args)
    # the op returns [B, T, C]: a window step squeezes its one token; SiLU and φ ran after the head split, and
    # as they act per channel (per head for a matrix φ) the op's [B, T, H·Dh] result is split instead.
    layout = []
    if chain.window is not None and not chain.window.keepdim:
        layout.append((aten.squeeze.dim, (1,)))
    if chain.stage("batch") is not None:
        layout.append((aten.transpose.int, (0, 1)))
        nodes_replaced -= 1  # the swap to sequence first is still there, after the op
    if heads is not None:
        layout.append((aten.unflatten.int, (-1, list(result.shape[-2:]))))
        nodes_replaced -= 1  # a head split is still there
    if chain.channels_first:
        layout.append((aten.transpose.int, (1, 2)))
    last = call
    for target, literals in layout:
        with gm.graph.inserting_after(last):
            reshaped = gm.graph.call_function(target, (last, *literals))
        reshaped.meta["val"] = target(val(last), *literals)
        last.replace_all_uses_with(reshaped, delete_user_cb=lambda user: user is not reshaped)
        last = reshaped
    report.add_fusion(PATTERN, OP_NAME, nodes_replaced, detail)


def _erased(nodes: list[fx.Node], output: fx.Node) -> int:
    """How many of ``nodes`` a replacement of ``output`` erases: those no other node reads."""
    order = {n: i for i, n in enumerate(output.graph.nodes)}
    gone: set[fx.Node] = set()
    for node in sorted(nodes, key=order.__getitem__, reverse=True):
        if node is output or all(u in gone for u in node.users):
            gone.add(node)
    return len(gone)


def _state_argument(gm: fx.GraphModule, state: _State) -> fx.Node:
    """The op's conv_state [B, K−1, D]: the tensor the graph transposed into the cat, or a new transpose."""
    if state.op_input is not None:
        return state.op_input
    with gm.graph.inserting_after(state.node):
        swapped = gm.graph.call_function(aten.transpose.int, (state.node, 1, 2))
    swapped.meta["val"] = val(state.node).transpose(1, 2)
    return swapped


def _phi_scalar(phi: _Found | None) -> float:
    """exp's clamp bound c of exp(min(x, c)); +inf for an unclamped exp; 0 for the other kinds."""
    if phi is None or phi.piece.value != "exp":
        return 0.0
    for node in phi.match.nodes:
        if node.target == aten.clamp.default:
            return float(_arg(node, 2, "max"))
        if node.target == aten.clamp_max.default:
            return float(node.args[1])
    return math.inf


_PHI_NAMES = {"elu1": "elu+1", "relu": "relu", "relu2": "relu²",
              "linear": "linear φ", "random_fourier": "random Fourier φ", "performer": "Performer φ"}


def _describe(chain: _Chain, phi_kind: str, phi_scalar: float) -> str:
    """The variant, e.g. "linear → conv(K=4) → silu → elu+1 [B,T,H,Dh]"; the layout is the op's input's."""
    k = chain.kernel_size
    steps = [chain.projection.piece.value] if chain.projection else []
    if chain.window is not None:
        steps.append(f"window step conv(K={k}, carried state)")
    else:
        steps.append(f"conv(K={k}, carried state)" if chain.state is not None else f"conv(K={k})")
    if chain.stage("activation"):
        steps.append("silu")
    if phi_kind == "exp":
        steps.append("exp" if math.isinf(phi_scalar) else f"exp(min(·, {phi_scalar:g}))")
    elif phi_kind in MATRIX_PHI:
        d_phi = val(chain.stage("phi").match.inputs[1]).shape[0]
        steps.append(f"{_PHI_NAMES[phi_kind]}(d_phi={d_phi})")
    elif phi_kind != "identity":
        steps.append(_PHI_NAMES.get(phi_kind, f"φ = {phi_kind}"))
    layout = "[B,T,H,Dh]" if chain.stage("heads") else "[B,D,T], the op's [B,T,D] transposed" \
        if chain.channels_first else "[B,T,D]"
    if chain.swap_in is None and chain.window is None:
        layout += " from x [B,D,T] read transposed"
    if chain.window is not None:
        layout = layout.replace("T,", "")
    text = " → ".join(steps) + " " + layout
    if phi_kind == "identity":  # what reads the output where φ would be (a view of it, a head split, is no φ)
        readers = [u for u in chain.output.users if u.op == "call_function" and not getattr(u.target, "is_view", False)]
        names = ", ".join(sorted({str(u.target) for u in readers}))
        elementwise = [u for u in readers if is_pointwise(u) and u.all_input_nodes == [chain.output]]
        if len(readers) == 1 and elementwise:
            text += f"; read by {names}, elementwise but not an operation Hecate generates into the kernel"
        elif elementwise:  # (an elementwise reader beside others: the value they share is what the op gives)
            text += f"; read by {names}: a value more than one op reads ends the chain, each reading the op's output"
        elif readers:
            text += f"; read by {names}, left to the fallback (not a φ the op fuses)"
    return text
