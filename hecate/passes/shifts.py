"""Copies of one tensor shifted in time with zeros in front, recognised by their values.

A hand-written causal conv reads x shifted by s = 0 … K−1, each copy written its own way: ``F.pad(u[..., :-s],
(s, 0))``, ``F.pad(u, (s, 0))[..., :T]``, ``torch.cat([zeros, u[:, :-s]], 1)``, ``torch.where(t >= s, torch.roll(u,
s, 1), 0)``. :func:`shifted_copy` evaluates a candidate against u shifted, so the spelling does not matter; the
normal form makes such copies windows of one pad (:func:`hecate.compiler.normalize.shifted_copies_as_windows`), and
the report names those it could not.
"""

from __future__ import annotations

import math

import torch
from torch import fx

from hecate.passes.gaussian import evaluate
from hecate.passes.matching import NotFused, depends_on_sizes_only, shifted_size, size_hint

aten = torch.ops.aten

# the ops a copy of h shifted in time with zeros in front is written with (and the size-only masks, zeros and
# numbers they read): F.pad and a slice either side of it, torch.cat of zeros, torch.roll times a mask of t ≥ s,
# and the transposes the normal form moves a slice or pad through
_SHIFTING = {aten.pad.default, aten.constant_pad_nd.default, aten.slice.Tensor, aten.cat.default, aten.roll.default,
             aten.mul.Tensor, aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf, aten.masked_fill.Scalar,
             aten.transpose.int}
# tensors made of one value, of another's shape: not what a copy is made from
_SHAPE_ONLY = {aten.zeros_like.default, aten.new_zeros.default, aten.ones_like.default, aten.new_ones.default,
               aten.full_like.default, aten.new_full.default}
_MOVING = {aten.pad.default, aten.constant_pad_nd.default, aten.cat.default, aten.roll.default}  # (one makes a shift)
_LARGEST_DRAW = 1 << 22  # elements of h drawn to evaluate a copy (float64: 32 MiB)


def _value(node):
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def shifted_copy(copy: fx.Node) -> tuple[fx.Node, bool, int, int] | None:
    """(h, whether u = hᵀ, time dim, s) when ``copy`` [B, ·, ·] is u shifted by s ≥ 0 along dim 1 or 2 (dim None
    for u itself), zeros in front, u = h or h.transpose(1, 2), computed from h by the ops of _SHIFTING and from
    sizes alone; else None."""
    if copy.target not in _SHIFTING - {aten.transpose.int} or getattr(_value(copy), "dim", lambda: 0)() != 3 \
            or not _value(copy).is_floating_point() or depends_on_sizes_only(copy):
        return None
    sources, stack, seen = set(), [copy], set()
    while stack:  # the one tensor the copy is made from, through shifting ops
        node = stack.pop()
        if node in seen or not isinstance(node, fx.Node) or depends_on_sizes_only(node) or node.target in _SHAPE_ONLY:
            continue
        seen.add(node)
        if node.target in _SHIFTING and len(seen) < 12:
            stack += node.all_input_nodes
        else:
            sources.add(node)
    if len(sources) != 1 or not any(n.target in _MOVING for n in seen):
        return None
    (h,) = sources
    if getattr(_value(h), "dim", lambda: 0)() != 3:
        return None
    sizes = [size_hint] + ([shifted_size] if any(isinstance(d, torch.SymInt) for d in _value(h).shape) else [])
    found = None
    for size in sizes:
        shape = [size(d) for d in _value(h).shape]
        # one sequence first (a copy is made the same in each; where the graph baked the batch in, all of them)
        for shape in ([1, *shape[1:]], shape) if shape[0] > 1 else (shape,):
            if math.prod(shape) > _LARGEST_DRAW:
                continue
            x = torch.rand(shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64) + 1.0  # no zero
            try:
                got = evaluate(copy, {h: x}, size_hint=size)
            except (NotFused, RuntimeError, TypeError, ValueError, IndexError):  # not evaluable: not read so
                continue
            if isinstance(got, torch.Tensor) and got.shape[0] == shape[0]:
                break
        else:
            return None
        shifts = []
        for swapped, u in ((False, x), (True, x.transpose(1, 2))):
            if not isinstance(got, torch.Tensor) or got.shape != u.shape:
                continue
            for time in (1, 2):  # s: the steps of zeros in front (u has no zero), then u itself
                s = int((got == 0).movedim(time, 0).flatten(1).all(-1).int().cumprod(0).sum())
                length = u.shape[time]
                if s < length and torch.equal(got.narrow(time, s, length - s), u.narrow(time, 0, length - s)):
                    shifts.append((swapped, time, s))
        if len(shifts) == 2 and shifts[0][2] == shifts[1][2] == 0:  # u itself: shifted by 0 along either dim
            shifts = [(shifts[0][0], None, 0)]
        if len(shifts) != 1 or found is not None and found != shifts[0]:
            return None
        found = shifts[0]
        _, time, s = found
        try:  # zeros in front whatever h holds: not a product with a mask (torch.roll(h) * m is NaN there at an inf)
            front = evaluate(copy, {h: torch.full(shape, math.inf, dtype=torch.float64)}, size_hint=size)
        except (NotFused, RuntimeError, TypeError, ValueError, IndexError):  # not evaluable: not read so
            return None
        if s and bool(front.narrow(time, 0, s).any()):
            return None
    return (h, *found)
