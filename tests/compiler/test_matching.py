"""replace_with_function: a replacement written as a PyTorch function, traced under the graph's
fake mode and inlined, so sizes it reads stay symbolic under dynamic shapes."""

import pytest
import torch
from torch import fx

import hecate
from hecate.passes import PASSES
from hecate.passes.matching import find_matches, pattern_graph, replace_with_function


def _tanh_by_rows(gm: fx.GraphModule, report) -> None:
    """Replace each tanh(x) by the same tanh computed on x reshaped by its own sizes."""
    for node in [n for n in gm.graph.nodes if n.target is torch.ops.aten.tanh.default]:
        def rows(x):
            return torch.tanh(x.reshape(x.shape[0], -1)).reshape(x.shape)

        replace_with_function(gm, [node], rows, [node.args[0]], outputs=[node])
        report.add_fusion("rows", "aten.tanh", 1)


def _model(x):
    return torch.tanh(x) * 2 + x


@pytest.fixture
def rows_pass(monkeypatch):
    monkeypatch.setitem(PASSES, "rows", _tanh_by_rows)


def _rel(a, b):
    return (torch.linalg.norm(a - b) / torch.linalg.norm(b)).item()


@pytest.mark.parametrize("dynamic", [True, None])  # None: static first, dynamic on recompile
@pytest.mark.parametrize("fallback", ["eager", "inductor"])
def test_replacement_reading_shape_recompiles_at_new_batch(fallback, dynamic, rows_pass, fresh_dynamo):
    compiled = torch.compile(_model, backend="hecate", dynamic=dynamic,
                             options={"patterns": ["rows"], "fallback": fallback})
    for batch in (2, 3, 5):
        x = torch.randn(batch, 4, 3)
        assert _rel(compiled(x), _model(x)) <= 1e-6
        assert hecate.last_report().count("rows") == 1


def test_sizes_become_sym_size_nodes_not_literals(rows_pass, fresh_dynamo):
    graphs = []

    def keep(gm, example_inputs):
        from hecate.compiler.options import parse_options
        from hecate.compiler.pipeline import fuse

        fused, _ = fuse(gm, example_inputs, parse_options({"patterns": ["rows"]}))
        graphs.append(fused)
        return fused

    torch.compile(_model, backend=keep, dynamic=True)(torch.randn(3, 4, 3))
    [gm] = graphs
    targets = [n.target for n in gm.graph.nodes]
    assert torch.ops.aten.sym_size.int in targets
    for node in gm.graph.nodes:
        leaves = torch.utils._pytree.tree_leaves((node.args, node.kwargs))
        assert not any(isinstance(a, torch.SymInt) for a in leaves), node.format_node()


def test_match_with_two_outputs_and_a_constant():
    def pattern(x):
        s = torch.sigmoid(x)
        return s * x, s

    def model(x):
        s = torch.sigmoid(x)
        return (s * x).sum() + s.mean()

    def replacement(x):
        s = torch.reciprocal(1 + torch.exp(-x)) * torch.tensor(1.0)  # a constant becomes a buffer of gm
        return x * s, s

    gm = hecate.compiler.pipeline.canonicalize(fx.symbolic_trace(model), [torch.randn(4, 3)])
    [match] = find_matches(gm, pattern_graph(pattern, torch.zeros(4, 3)))
    new = replace_with_function(gm, match, replacement, match.inputs)
    gm.graph.lint()
    gm.recompile()
    assert len(new) == 2 and all("val" in n.meta for n in new)
    targets = [n.target for n in gm.graph.nodes]
    assert torch.ops.aten.sigmoid.default not in targets and torch.ops.aten.reciprocal.default in targets
    x = torch.randn(4, 3)
    assert _rel(gm(x), model(x)) <= 1e-6


def test_wrong_number_of_outputs_is_named():
    gm = hecate.compiler.pipeline.canonicalize(fx.symbolic_trace(_model), [torch.randn(2, 3)])
    tanh = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.tanh.default)
    with pytest.raises(ValueError, match="returned 2 tensor\\(s\\) for 1 output\\(s\\)"):
        replace_with_function(gm, [tanh], lambda x: (x, x), [tanh.args[0]], outputs=[tanh])


def test_a_replacement_reading_what_it_replaces_is_refused_and_the_graph_kept():
    """An input computed from a replaced output would make a cycle (the pass then looped without end and took
    all memory): NotFused, the graph as it was."""
    from hecate.passes.matching import NotFused

    gm = hecate.compiler.pipeline.canonicalize(fx.symbolic_trace(_model), [torch.randn(2, 3)])
    tanh = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.tanh.default)
    downstream = next(iter(tanh.users))
    before = [(n.name, n.target) for n in gm.graph.nodes]
    with pytest.raises(NotFused, match="a cycle"):
        replace_with_function(gm, [tanh], lambda x: x.sin(), [downstream], outputs=[tanh])
    assert [(n.name, n.target) for n in gm.graph.nodes] == before


def test_topological_order_of_a_cyclic_graph_is_an_error():
    from hecate.passes.matching import restore_topological_order

    graph = fx.Graph()
    x = graph.placeholder("x")
    a = graph.call_function(torch.sin, (x,))
    b = graph.call_function(torch.cos, (a,))
    graph.output(b)
    a.args = (b,)  # a reads b, which reads a
    with pytest.raises(RuntimeError, match="cycle"):
        restore_topological_order(graph)


def test_matches_share_a_view_of_their_inputs():
    """``w.T`` computed once for two products (the normal form's CSE): both products match, and
    replacing one keeps the transpose for the other."""
    from hecate.compiler.normalize import normalize_graph
    from torch.fx.experimental.proxy_tensor import make_fx

    def two_products(a, b, w):
        return a @ w.T, b @ w.T

    args = (torch.randn(2, 4), torch.randn(3, 4), torch.randn(5, 4))
    gm = normalize_graph(make_fx(two_products, pre_dispatch=True, tracing_mode="fake")(*args))
    [transpose] = [n for n in gm.graph.nodes if n.target is torch.ops.aten.numpy_T.default]
    assert len(transpose.users) == 2
    pattern = pattern_graph(lambda x, w: x @ w.T, torch.randn(2, 4), torch.randn(5, 4))
    matches = find_matches(gm, pattern)
    assert len(matches) == 2 and all(transpose in m.nodes for m in matches)
    replace_with_function(gm, matches[0], lambda x, w: torch.nn.functional.linear(x, w), matches[0].inputs)
    gm.recompile()
    for got, expected in zip(gm(*args), two_products(*args)):
        assert (torch.linalg.norm(got - expected) / torch.linalg.norm(expected)).item() <= 1e-6
