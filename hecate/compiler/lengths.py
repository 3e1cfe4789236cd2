"""A sequence length fixed by the model's Python loop, made dynamic again after fusion.

``torch.export`` traces a Python loop ``for t in range(x.shape[1])`` once per step, so the
exported graph holds exactly T steps and T is fixed. Once Hecate has rolled the loop into
one fused op over the whole sequence, the graph usually does not depend on T any more,
except through the sizes written into it (``view(y, [B, T, D])``). Such a graph is made
length-generic by comparison, not by trusting it:

1. the model is exported and fused at the example length T₁ and again at T₂ = T₁ + 1;
2. the two graphs must be the same nodes and the same literals, except integers that differ
   between them, each read as the affine size ``a·T + b`` through both points;
3. those integers become ``a·T + b`` of the input's length, and the graph is exported again
   with T dynamic;
4. the result must equal the model in eager at a third length before it is used.

Anything else (a constant tensor whose shape follows T, a float that does, a different
graph, a mismatch at the third length) keeps the length fixed, and the caller's warning says so.
"""

from __future__ import annotations

import math

import operator
from typing import Any, Callable, Sequence

import torch
from torch import fx
from torch.export.graph_signature import InputKind, OutputKind

_SEQUENCE = 1  # the sequence dim of a [B, T, ...] input


class _NotGeneric(Exception):
    """The two exports differ in more than the length's integers."""


def lengthened(args: Sequence[Any], length: int, extra: int) -> tuple:
    """``args`` with each tensor whose dim 1 is ``length`` made ``extra`` steps longer (its last step
    repeated: still valid token ids, still in the inputs' range)."""
    def grow(x):
        if isinstance(x, torch.Tensor) and x.ndim > _SEQUENCE and x.shape[_SEQUENCE] == length:
            return torch.cat([x, x[:, -1:].expand(-1, extra, *x.shape[2:])], dim=_SEQUENCE)
        return x

    return tuple(grow(x) for x in args)


def generic_in_length(first: torch.export.ExportedProgram, export: Callable[[tuple], torch.export.ExportedProgram],
                      module: torch.nn.Module, args: Sequence[Any],
                      dynamic_shapes: tuple) -> torch.export.ExportedProgram | None:
    """The fused program of ``module`` with the sequence length dynamic, or None where it cannot be.

    ``first`` is the fused program at the example ``args`` (its length fixed by the model's code);
    ``export(args)`` exports and fuses at other ``args``; ``dynamic_shapes`` is the per-argument
    spec for the final export.
    """
    carrier = next((i for i, x in enumerate(args) if isinstance(x, torch.Tensor) and x.ndim > _SEQUENCE), None)
    if carrier is None:
        return None
    length = args[carrier].shape[_SEQUENCE]
    try:  # the model may refuse longer inputs (an input whose dim 1 only happens to equal T)
        second = export(lengthened(args, length, 1))
    except Exception:
        return None
    try:
        graph = _generalised(first.graph_module, second.graph_module, length,
                             first.graph_signature.user_inputs[carrier])
        generic = _Program(first, graph)
    except _NotGeneric:
        return None
    try:  # torch.export may still fix T (a guard on it the sizes alone did not show)
        program = torch.export.export(generic, tuple(args), dynamic_shapes=(tuple(dynamic_shapes),))
    except Exception:
        return None
    if not _checks_at(program, module, lengthened(args, length, 3)):
        return None
    return program


def _generalised(first: fx.GraphModule, second: fx.GraphModule, length: int, sequence_input: str) -> fx.Graph:
    """``first``'s graph with each integer that differs from ``second``'s (exported one step longer)
    replaced by its affine size in the length of the input named ``sequence_input``."""
    nodes1, nodes2 = list(first.graph.nodes), list(second.graph.nodes)
    if len(nodes1) != len(nodes2):
        raise _NotGeneric("the exports have different numbers of nodes")
    position = {n: i for i, n in enumerate(nodes1)} | {n: i for i, n in enumerate(nodes2)}
    sizes: dict[tuple[int, int], Any] = {}  # (a, b) -> the node computing a·T + b

    def merge(a, b):
        if isinstance(a, fx.Node):
            if not isinstance(b, fx.Node) or position[a] != position[b]:
                raise _NotGeneric(f"{a.name} reads different nodes")
            return a
        if isinstance(a, (list, tuple)) and type(a) is type(b) and len(a) == len(b):
            return type(a)(merge(x, y) for x, y in zip(a, b))
        if isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
            return {k: merge(a[k], b[k]) for k in a}
        if type(a) is type(b) and (a == b or type(a) is float and math.isnan(a) and math.isnan(b)):
            return a  # (a NaN literal, which a kl_attention fusion writes, never equals itself)
        if type(a) is int and type(b) is int:
            slope = b - a  # the second export is one step longer
            sizes.setdefault((slope, a - slope * length), None)
            return _Size(slope, a - slope * length)
        raise _NotGeneric(f"{a!r} differs from {b!r}")

    merged = []
    for n1, n2 in zip(nodes1, nodes2):
        if n1.op != n2.op or n1.target != n2.target:
            raise _NotGeneric(f"{n1.name} is {n1.target} in one export and {n2.target} in the other")
        if n1.op == "get_attr" and not _same_constant(getattr(first, n1.target), getattr(second, n2.target)):
            raise _NotGeneric(f"the constant {n1.target} depends on the length")
        merged.append((n1, merge(n1.args, n2.args), merge(n1.kwargs, n2.kwargs)))
    if not sizes:
        raise _NotGeneric("nothing in the graph depends on the length")

    graph = fx.Graph()
    env: dict[fx.Node, Any] = {}
    for n1, _, _ in merged:
        if n1.op == "placeholder":
            env[n1] = graph.placeholder(n1.name)
    by_name = {n.name: n for n in nodes1 if n.op == "placeholder"}
    t = graph.call_function(torch.ops.aten.sym_size.int, (env[by_name[sequence_input]], _SEQUENCE))
    for slope, offset in sizes:
        size = graph.call_function(operator.mul, (t, slope)) if slope != 1 else t
        sizes[(slope, offset)] = graph.call_function(operator.add, (size, offset)) if offset else size

    def resolve(a):
        if isinstance(a, _Size):
            return sizes[(a.slope, a.offset)]
        return env[a] if isinstance(a, fx.Node) else a

    for n1, args, kwargs in merged:
        if n1.op != "placeholder":
            env[n1] = new = graph.node_copy(n1, lambda a: env[a])
            new.args = fx.node.map_aggregate(args, resolve)
            new.kwargs = fx.node.map_aggregate(kwargs, resolve)
    return graph


class _Size:
    """a·T + b, an integer of the first export that follows the length."""

    def __init__(self, slope: int, offset: int):
        self.slope, self.offset = slope, offset


def _same_constant(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool((a == b).all())
    return isinstance(a, fx.GraphModule) and isinstance(b, fx.GraphModule) or a is b


class _Program(torch.nn.Module):
    """A fused exported program's graph (with generalised sizes) as a module over the user's inputs."""

    def __init__(self, program: torch.export.ExportedProgram, graph: fx.Graph):
        super().__init__()
        specs = program.graph_signature
        if any(s.kind != OutputKind.USER_OUTPUT for s in specs.output_specs):
            raise _NotGeneric("the program mutates buffers")
        self.graph_module = fx.GraphModule(program.graph_module, graph)
        self.lifted: list[tuple[int, str]] = []  # (input position, attribute holding it)
        values = {**program.state_dict, **program.constants}
        for i, spec in enumerate(specs.input_specs):
            if spec.kind == InputKind.USER_INPUT:
                continue
            if spec.kind not in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
                raise _NotGeneric(f"an input of kind {spec.kind}")
            name = f"lifted_{i}"
            value = values[spec.target]
            if isinstance(value, torch.nn.Parameter):
                self.register_parameter(name, value)
            else:
                self.register_buffer(name, value)
            self.lifted.append((i, name))
        self.n_inputs = len(specs.input_specs)
        self.out_spec = program.call_spec.out_spec  # the user's output structure (a tensor, not a 1-tuple)

    def forward(self, *user_args):
        inputs: list[Any] = [None] * self.n_inputs
        for i, name in self.lifted:
            inputs[i] = getattr(self, name)
        rest = iter(user_args)
        inputs = [next(rest) if x is None else x for x in inputs]
        outputs = self.graph_module(*inputs)
        return torch.utils._pytree.tree_unflatten(list(outputs), self.out_spec) if self.out_spec else outputs


def _checks_at(program: torch.export.ExportedProgram, module: torch.nn.Module, args: tuple, tol: float = 1e-5) -> bool:
    """Whether the generic program equals the module in eager at ``args`` (another length)."""
    try:
        with torch.no_grad():
            got = torch.utils._pytree.tree_leaves(program.module()(*args))
            expected = [e for e in torch.utils._pytree.tree_leaves(module(*args)) if isinstance(e, torch.Tensor)]
    except Exception:
        return False
    if len(got) != len(expected):
        return False
    for g, e in zip(got, expected):
        if g.shape != e.shape or g.dtype != e.dtype:
            return False
        if e.is_floating_point():
            if not torch.isfinite(e).all() or (g - e).norm() > tol * e.norm().clamp_min(1e-30):
                return False
        elif not torch.equal(g, e):
            return False
    return True
