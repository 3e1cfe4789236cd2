"""Export with Hecate's fusions: ONNX for onnxruntime, MLIR through torch-mlir.

Both start from ``torch.export`` (whose graph is the same pre-dispatch ATen form
the backend canonicalises to), run the same passes on it, and then translate:
each fused op carries its own ONNX translation and its own ATen decomposition
(:mod:`hecate.lowering.registry`).

Shapes. By default the batch and sequence dimensions stay dynamic: dimensions 0 and 1
of every tensor argument are exported as ``torch.export.Dim.AUTO``, so one ONNX file
runs at any batch size and length; a dimension the model's code fixes (a weight's
width, a head count) comes out static, and a warning names the batch or sequence
dimension that did. A Python loop over T fixes T in ``torch.export``'s graph; once fused,
T is made dynamic again where the graph holds it only in its sizes (:mod:`hecate.compiler.lengths`). ``dynamic_shapes="static"`` (or ``None``) fixes
every shape to the example's; a dict or tuple is handed to ``torch.export`` as is.

Streaming (``mode``). A model that generates token by token implements

    initial_state(batch) -> tuple of tensors     the state before the first token
    prefill(x) -> (out, state)                   the whole prompt, and the state after it
    step(x_t, state) -> (out_t, state)           one token, with the state carried

``mode="prefill"`` exports ``prefill`` (ONNX inputs ``x``; outputs ``out``, ``new_state_0``, ...),
``mode="decode"`` exports ``step`` (inputs ``x_t``, ``state_0``, ...; outputs ``out_t``,
``new_state_0``, ...; a tuple output becomes ``out_t_0``, ``out_t_1``, ...). For ``"decode"``, ``args`` is ``(x_t,)`` (the state then comes from
``initial_state``) or ``(x_t, state)``.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import sys
import warnings
from typing import Any, Mapping, Sequence

import torch
from torch.export import Dim
from torch.export.graph_signature import TensorArgument
from torch.fx.experimental.symbolic_shapes import is_concrete_int
from torch.utils import _pytree as pytree

from hecate.compiler.lengths import generic_in_length
from hecate.compiler.normalize import normalize
from hecate.compiler.options import parse_options
from hecate.compiler.pipeline import fuse_rolled_loops, run_passes
from hecate.passes.report import FusionReport

MLIR_OUTPUT_TYPES = ("torch", "linalg-on-tensors", "tosa", "stablehlo", "raw")
MODES = ("forward", "prefill", "decode")
_DIM_NAMES = {0: "batch", 1: "sequence"}


class _Streaming(torch.nn.Module):
    """A model's ``prefill`` or ``step`` as a forward with flat inputs and outputs.

    prefill: x → (*out, *state);  decode: (x_t, *state) → (*out_t, *state), where
    ``out`` is the method's output flattened (a tensor or a tuple of them).
    """

    def __init__(self, model: torch.nn.Module, mode: str):
        super().__init__()
        self.model, self.mode = model, mode

    def forward(self, x, *state):
        if self.mode == "prefill":
            out, new_state = self.model.prefill(x)
        else:
            out, new_state = self.model.step(x, tuple(state))
        return (*pytree.tree_leaves(out), *new_state)


def _streaming_program(model: torch.nn.Module, args: Sequence[Any], mode: str):
    """(module to export, flat example args, ONNX input names, output names) for a streaming ``mode``."""
    needs = ("initial_state", "step") if mode == "decode" else ("prefill",)
    missing = [m for m in needs if not callable(getattr(model, m, None))]
    if missing:
        raise TypeError(f"mode={mode!r} exports the model's streaming methods, but {type(model).__name__} "
                        f"has no {', '.join(missing)}() (expected initial_state(batch), prefill(x) -> (out, state), "
                        "step(x_t, state) -> (out_t, state))")
    if mode == "prefill":
        if len(args) != 1:
            raise ValueError(f"mode='prefill' takes args=(x,), got {len(args)} argument(s)")
        flat_args, x_name, out_name = tuple(args), "x", "out"
    else:
        if len(args) == 1:
            state = tuple(model.initial_state(args[0].shape[0]))
        elif len(args) == 2:
            state = tuple(args[1])
        else:
            raise ValueError(f"mode='decode' takes args=(x_t,) or (x_t, state), got {len(args)} argument(s)")
        flat_args, x_name, out_name = (args[0], *state), "x_t", "out_t"
    with torch.no_grad():  # one eager call names the outputs
        out, state = model.prefill(*flat_args) if mode == "prefill" else model.step(flat_args[0], flat_args[1:])
    n_out = len(pytree.tree_leaves(out))
    out_names = [out_name] if n_out == 1 else [f"{out_name}_{i}" for i in range(n_out)]
    state_in = [f"state_{i}" for i in range(len(state))] if mode == "decode" else []
    state_out = [f"new_state_{i}" for i in range(len(state))]  # ONNX names are unique: not state_i again
    return _Streaming(model, mode), flat_args, [x_name, *state_in], [*out_names, *state_out]


def _auto_dynamic_shapes(args: Sequence[Any], mode: str) -> tuple:
    """Dims 0 (batch) and 1 (sequence) of each tensor as ``Dim.AUTO``; a decode step has no sequence."""
    def spec(i, x):
        if not isinstance(x, torch.Tensor) or x.ndim == 0:
            return None
        with_sequence = mode == "forward" or (mode == "prefill" and i == 0)
        return {d: Dim.AUTO for d in range(min(x.ndim, 2 if with_sequence else 1))}

    return tuple(spec(i, x) for i, x in enumerate(args))


def _resolve_dynamic_shapes(dynamic_shapes: Any, args: Sequence[Any], mode: str):
    if dynamic_shapes is None or dynamic_shapes == "static":
        return None
    if isinstance(dynamic_shapes, str):
        if dynamic_shapes != "auto":
            raise ValueError(f"dynamic_shapes must be 'auto', 'static', None, or torch.export's dict/tuple "
                             f"of dims, got {dynamic_shapes!r}")
        return _auto_dynamic_shapes(args, mode)
    return dynamic_shapes


def _per_argument(dynamic_shapes: Any, module: torch.nn.Module, n_args: int) -> Any:
    """A dynamic_shapes spec as one entry per argument (torch.export also takes it keyed by forward's parameter
    names)."""
    if isinstance(dynamic_shapes, Mapping):
        return tuple(dynamic_shapes.get(name) for name in list(inspect.signature(module.forward).parameters)[:n_args])
    return dynamic_shapes


def _quietly_fixable(dynamic_shapes: Any, shapes: Any, module: torch.nn.Module, n_args: int) -> tuple | None:
    """Per flat argument, the dims torch.export may fix without a word: each batch/sequence dim under
    ``"auto"``, and each dim a user's own spec marks ``Dim.AUTO`` (a ``Dim.DYNAMIC`` or named dim it
    fixes raises instead)."""
    if isinstance(dynamic_shapes, str):
        return shapes if dynamic_shapes == "auto" else None
    specs = _per_argument(dynamic_shapes, module, n_args)
    if not isinstance(specs, (tuple, list)):
        return None

    def auto(spec):
        dims = spec.items() if isinstance(spec, Mapping) else enumerate(spec) if isinstance(spec, (tuple, list)) \
            else ()
        return {d: hint for d, hint in dims if isinstance(hint, type(Dim.AUTO)) and hint == Dim.AUTO}

    return tuple(auto(spec) for spec in specs)


def _fixed_dims(program: torch.export.ExportedProgram, args: Sequence[Any], names: Sequence[str] | None,
                requested: tuple, only_shared_sizes: bool) -> list[tuple[str, int, int]]:
    """(input name, dim, size) for each requested dim the model's code fixed.

    With ``only_shared_sizes`` (every tensor's dims 0 and 1 requested, as under "auto") only
    the batch and the sequence length count, those of the first tensor argument: a dim of
    another size (a state's head count, a feature width) is not expected to be dynamic.
    """
    placeholders = [s.arg.name for s in program.graph_signature.input_specs
                    if s.kind == torch.export.graph_signature.InputKind.USER_INPUT]
    names = names or placeholders
    values = {n.name: n.meta.get("val") for n in program.graph.nodes if n.op == "placeholder"}
    first = next((x for x, spec in zip(args, requested) if spec), None)
    if first is None:
        return []
    fixed = []
    for name, placeholder, spec, x in zip(names, placeholders, requested, args):
        val = values.get(placeholder)
        if not spec or not isinstance(val, torch.Tensor):
            continue
        fixed += [(name, d, x.shape[d]) for d in spec
                  if d < val.ndim and is_concrete_int(val.shape[d]) and x.shape[d] >= 1
                  and (not only_shared_sizes or d < first.ndim and x.shape[d] == first.shape[d])]
    return fixed


def _plain_shape_reads(program: torch.export.ExportedProgram) -> None:
    """Rewrite the dynamic-shape graph's shape bookkeeping into what a static export reads.

    With symbolic dims ``torch.export`` reads sizes of intermediate tensors (``sym_size``)
    and keeps full-range slices (``x[:, t]`` is ``slice(x, 0, 0, ∞)`` then ``select``).
    Passes should see one spelling, as in the static graph: a size the export fixed becomes
    its int, a dynamic size is read off the input that carries it, and a slice that keeps a
    whole dimension is its input.
    """
    graph = program.graph_module.graph
    input_dims = {}  # symbol → (placeholder, dim)
    for node in graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        for d, size in enumerate(val.shape if isinstance(val, torch.Tensor) else ()):
            if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol:
                input_dims.setdefault(size.node.expr, (node, d))
    for node in list(graph.find_nodes(op="call_function", target=torch.ops.aten.sym_size.int)):
        size = node.meta.get("val")
        if is_concrete_int(size):
            node.replace_all_uses_with(int(size))
        elif isinstance(size, torch.SymInt) and size.node.expr in input_dims:
            node.args = input_dims[size.node.expr]
    for node in list(graph.find_nodes(op="call_function", target=torch.ops.aten.slice.Tensor)):
        x, dim, start, end, step = (*node.args, None, None, None, None)[:5]
        if start in (None, 0) and step in (None, 1) and isinstance(end, int) and end >= 2 ** 62:
            node.replace_all_uses_with(x)
    graph.eliminate_dead_code()
    program.graph_module.recompile()


def export_program(model: torch.nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None,
                   options: Mapping[str, Any] | None = None, *, dynamic_shapes: Any = "static",
                   mode: str = "forward") -> tuple[torch.export.ExportedProgram, FusionReport]:
    """``torch.export`` the model (or its ``mode``'s streaming method) and apply Hecate's passes.

    ``dynamic_shapes``: "static" (default here), "auto" or torch.export's own specification.
    """
    program, report, _ = _export(model, args, kwargs, options, dynamic_shapes, mode)
    return program, report


def _export(model, args, kwargs, options, dynamic_shapes, mode):
    import hecate.lowering  # noqa: F401  registers the ops and their translations

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple of example inputs, got {type(args).__name__}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {list(MODES)}, got {mode!r}")
    opts = parse_options(options)
    if mode == "forward":
        module, flat_args = model, tuple(args)
        input_names = output_names = None  # the exporter names them after forward's parameters
    else:
        if kwargs:
            raise ValueError(f"mode={mode!r} takes no kwargs, got {sorted(kwargs)}")
        module, flat_args, input_names, output_names = _streaming_program(model, args, mode)
    shapes = _resolve_dynamic_shapes(dynamic_shapes, flat_args, mode)
    # a streaming forward is forward(x, *state): torch.export wants the state's shapes as one tuple
    export_shapes = (shapes[0], tuple(shapes[1:])) if mode == "decode" and isinstance(shapes, (tuple, list)) \
        else shapes
    quiet = _quietly_fixable(dynamic_shapes, shapes, module, len(flat_args))

    def fused(example: tuple) -> tuple[torch.export.ExportedProgram, FusionReport, list]:
        with _user_frames_recorded(model):
            program = torch.export.export(module, example, dict(kwargs or {}), dynamic_shapes=export_shapes)
        fixed = _fixed_dims(program, example, input_names, quiet, only_shared_sizes=isinstance(dynamic_shapes, str)) \
            if quiet else []
        if shapes is not None:
            _plain_shape_reads(program)
        report = FusionReport(graphs=1)
        _fuse_branches(program.graph_module, opts, report)
        normalize(program.graph_module)  # what the passes read (the bodies of a user's scan too); loops roll in it
        placeholders = [n.meta["val"] for n in program.graph.find_nodes(op="placeholder")]
        rolled = fuse_rolled_loops(program.graph_module, placeholders, opts, report, dump_name="export")
        if rolled is not None:
            gm, report = rolled
            _install_graph(program, gm)
        else:
            run_passes(program.graph_module, opts, report, dump_name="export")
        _lift_constants(program)
        return program, report, fixed

    program, report, fixed = fused(flat_args)
    if fixed and {d for _, d, _ in fixed} == {1} and mode != "decode" and not kwargs:
        # a Python loop over T fixed the length: once fused, the graph may hold T only in its sizes
        generic = generic_in_length(program, lambda example: fused(example)[0], module, flat_args,
                                    _per_argument(export_shapes, module, len(flat_args)))
        if generic is not None:  # its inputs are named by position: give them the model's names back
            input_names = input_names or list(program.graph_signature.user_inputs)
            program, fixed = generic, []
    for name, d, size in fixed:
        why = ("torch.export specialises a dimension of size 1 in the example; export with an example of at least 2 "
               "to keep it dynamic") if size == 1 else (
               "the model's code specialises it (a Python loop over it does, where the fused graph still depends on "
               "it; write the loop with torch's scan to keep it dynamic)")
        what = f"the {_DIM_NAMES[d]} dimension (dim {d})" if isinstance(dynamic_shapes, str) else \
            f"dim {d}, marked Dim.AUTO,"
        warnings.warn(f"export: {what} of input {name!r} is fixed at {size} in "
                      f"the exported graph: {why}", stacklevel=3)
    return program, report, (flat_args, input_names, output_names)


@contextlib.contextmanager
def _user_frames_recorded(model: torch.nn.Module):
    """Let each node's stack trace keep the model's own frames, not only ``forward``'s.

    torch.export records the frames of ``forward`` methods alone, so a line inside a
    streaming model's ``prefill``/``step``, or a helper they call, reads as the caller's
    (Hecate's own wrapper, in streaming modes). While exporting, every function defined by
    the model's classes and their modules is one of torch's stack-trace anchors too."""
    anchors = getattr(torch.fx.proxy, "_STACK_TRACE_ANCHORS", None)
    if not isinstance(anchors, set):  # (a torch without them: the reports name forward's lines)
        yield
        return
    added = set()
    for cls in {type(m) for m in model.modules()}:
        if cls.__module__.split(".")[0] == "torch":
            continue
        defined = [*vars(cls).values(), *vars(sys.modules.get(cls.__module__, cls)).values()]
        added |= {(f.__code__.co_filename, f.__code__.co_name) for f in defined if inspect.isfunction(f)}
    added -= anchors
    anchors |= added
    try:
        yield
    finally:
        anchors -= added


def _fuse_branches(gm: torch.fx.GraphModule, opts, report: FusionReport) -> None:
    """Each ``torch.cond`` branch of an exported graph fused as the graph itself is, in place (its fusions and
    misses join ``report``; the cond stays, so each branch still runs only where its predicate says)."""
    for node in gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.cond):
        for branch in node.args[1:3]:
            body, branch_report = getattr(gm, branch.target), FusionReport()
            normalize(body)  # (with the bodies of a scan in the branch)
            values = [n.meta["val"] for n in body.graph.find_nodes(op="placeholder")]
            rolled = fuse_rolled_loops(body, values, opts, branch_report, dump_name="export")
            if rolled is not None:
                fused, branch_report = rolled
                setattr(gm, branch.target, fused)
            else:
                run_passes(body, opts, branch_report, dump_name="export")
            report.fusions += branch_report.fusions
            report.misses += branch_report.misses


def _lift_constants(program: torch.export.ExportedProgram) -> None:
    """The tensors a fusion made constants of the graph (a decay mask's γ, as ``get_attr``) become the program's
    lifted constants, as torch.export keeps every constant: its verifier refuses a graph reading others."""
    from torch._export.passes.lift_constants_pass import ConstantAttrMap, lift_constants_pass

    gm = program.graph_module
    nodes = [n for n in gm.graph.find_nodes(op="get_attr") if isinstance(getattr(gm, n.target, None), torch.Tensor)
             and n.target not in program.state_dict and n.target not in program.constants]
    made = [n.target for n in nodes]
    for node in nodes:
        node.meta.setdefault("nn_module_stack", {})  # (made by Hecate, in no module of the user's)
    if made:
        program.constants.update(lift_constants_pass(gm, program.graph_signature, ConstantAttrMap()))
        for name in made:
            delattr(gm, name)


def _install_graph(program: torch.export.ExportedProgram, gm: torch.fx.GraphModule) -> None:
    """Make ``gm`` (a re-trace of ``program``'s graph, same inputs and outputs) the program's graph.

    The re-trace names its inputs ``arg0_1``, ...: they take back the names the program's
    signature refers to, and the signature's outputs follow the new output nodes.
    """
    old_inputs = program.graph.find_nodes(op="placeholder")
    new_inputs = gm.graph.find_nodes(op="placeholder")
    for old, new in zip(old_inputs, new_inputs, strict=True):
        new._rename(old.name)
        new.target = old.target
    outputs = gm.graph.output_node().args[0]
    for spec, node in zip(program.graph_signature.output_specs, outputs, strict=True):
        if isinstance(spec.arg, TensorArgument) and isinstance(node, torch.fx.Node):
            spec.arg = TensorArgument(name=node.name)
    root = program.graph_module
    for name, module in gm.named_children():
        setattr(root, name, module)
    root.graph = gm.graph
    root.recompile()


@contextlib.contextmanager
def _quiet_onnx_exporter():
    """Silence what torch's ONNX exporter prints that says nothing about the user's model.

    It logs a warning per torchvision op when torchvision is not installed, a pytree
    deprecation warning from its own internals, and that onnxscript's version converter hands
    the opset conversion to onnx's (which it does for every opset Hecate asks for).
    """
    loggers = [logging.getLogger(name) for name in ("torch.onnx._internal.exporter._registration",
                                                    "onnxscript.version_converter")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _opset_every_node_has(model) -> None:
    """Raise the model's default-domain opset to the first that defines each of its operators. torch.onnx
    builds the graph at opset 18 and converts it to the one asked for; its own translations may use a newer
    operator (``Gelu``, opset 20), the conversion then fails, and the model stays at 18 with a node
    onnxruntime rejects there. Opsets 19 and 20 extend the operators of 18 without changing them, except
    GridSample and DFT (which the models here do not use)."""
    import onnx
    from onnxscript import ir

    version = model.opset_imports.get("", None)
    if version is None:
        return
    needed = version
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.domain != "":
            continue
        for v in range(needed, onnx.defs.onnx_opset_version() + 1):
            try:
                onnx.defs.get_schema(node.op_type, v, "")
            except onnx.defs.SchemaError:
                continue
            needed = v
            break
    model.opset_imports[""] = needed


def _name_dynamic_dims(model) -> None:
    """Name the dynamic dims of the ONNX graph after what they are ("batch", "sequence"), not s77, s27.

    A dim is named after the first input position it appears at (dim 0: batch, dim 1:
    sequence); a second symbol at the same position gets a suffix (batch_1). A size the
    export fixed but wrote as a symbol ("5") becomes the number.
    """
    import onnx_ir as ir

    names: dict[str, str | int] = {}
    for value in model.graph.inputs:
        for d, dim in enumerate(list(value.shape or ())[:2]):
            if isinstance(dim, ir.SymbolicDim) and dim.value and dim.value.isdigit():
                names[dim.value] = int(dim.value)  # a size the export fixed, written as a symbol
            elif isinstance(dim, ir.SymbolicDim) and dim.value and dim.value not in names:
                base = _DIM_NAMES[d]
                taken = sum(str(n).split("_")[0] == base for n in names.values())
                names[dim.value] = base if not taken else f"{base}_{taken}"
    if not names:
        return

    def rename(value):
        if value is not None and value.shape is not None:
            value.shape = ir.Shape([(names[dim.value] if isinstance(names[dim.value], int)
                                     else ir.SymbolicDim(names[dim.value]))
                                    if isinstance(dim, ir.SymbolicDim) and dim.value in names else dim
                                    for dim in value.shape])

    graphs = [model.graph]
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        for value in node.outputs:
            rename(value)
        graphs += [a.value for a in node.attributes.values() if a.type == ir.AttributeType.GRAPH]
    for graph in graphs:  # the graph's and each Scan body's inputs and outputs
        for value in (*graph.inputs, *graph.outputs):
            rename(value)


def export_onnx(model: torch.nn.Module, args: Sequence[Any], path: str | os.PathLike, *,
                dynamic_shapes: Any = "auto", mode: str = "forward",
                kwargs: Mapping[str, Any] | None = None, options: Mapping[str, Any] | None = None,
                opset_version: int | None = None, fused_domain: str = "") -> FusionReport:
    """Write ``model`` with Hecate's fused ops to an ONNX file at ``path``.

    Fused ops become standard ONNX ops through their translations (a memory recurrence
    is one ``Scan`` over any length), so plain onnxruntime (CPU or CUDA provider) runs
    the file. ``dynamic_shapes``: "auto" (default: batch and sequence dynamic), "static"
    or None (the example's shapes), or torch.export's specification. ``mode``: "forward",
    "prefill" or "decode" (see the module docstring). Returns the fusion report;
    ``report.onnx_forms`` says which ONNX form each fused op took and why.
    ``opset_version``: None is 27 where onnx/onnxruntime have it (recurrences that fit become
    ``LinearAttention``, the short conv ``CausalConvWithState``), else torch.onnx's default; below
    27 every recurrence is a ``Scan``. ``fused_domain="com.microsoft"`` writes those two operators
    as onnxruntime's native kernels (:mod:`hecate.lowering.onnx_fused`).
    """
    from hecate.lowering.onnx_fused import check_arguments, finish_model, onnx_translations

    check_arguments(opset_version, fused_domain)
    program, report, (flat_args, input_names, output_names) = _export(
        model, args, kwargs, options, dynamic_shapes, mode)
    with _quiet_onnx_exporter(), onnx_translations(opset_version, fused_domain) as (table, opset_version, forms):
        onnx_program = torch.onnx.export(program, flat_args, kwargs=dict(kwargs or {}), dynamo=True,
                                         custom_translation_table=table, verbose=False,
                                         input_names=input_names, output_names=output_names,
                                         opset_version=opset_version, external_data=False)
    report.onnx_forms = forms
    finish_model(onnx_program, fused_domain)
    _opset_every_node_has(onnx_program.model)
    _name_dynamic_dims(onnx_program.model)
    onnx_program.save(os.fspath(path))
    return report


def export_mlir(model: torch.nn.Module, args: Sequence[Any], *, output_type: str = "torch",
                kwargs: Mapping[str, Any] | None = None, options: Mapping[str, Any] | None = None) -> str:
    """Import ``model`` into MLIR with torch-mlir and return the module as text.

    ``output_type`` is one of "torch", "linalg-on-tensors", "tosa", "stablehlo", "raw".
    Fused ops are decomposed into ATen first (torch-mlir knows no hecate op). Shapes are
    the example's (the decomposition of a recurrence unrolls it over T).
    """
    if output_type not in MLIR_OUTPUT_TYPES:
        raise ValueError(f"output_type must be one of {list(MLIR_OUTPUT_TYPES)}, got {output_type!r}")
    try:
        from torch_mlir.fx import export_and_import, get_decomposition_table
    except ImportError as e:  # an optional dependency
        raise ImportError("export_mlir needs torch-mlir: pip install 'hecate[mlir]' "
                          "(from a clone: pip install -e '.[mlir]')") from e
    from hecate.lowering.registry import DECOMPOSITIONS

    program, _ = export_program(model, args, kwargs, options)
    table = {**get_decomposition_table(), **DECOMPOSITIONS}
    return str(export_and_import(program, output_type=output_type, decomposition_table=table))
