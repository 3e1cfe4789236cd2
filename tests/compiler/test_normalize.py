"""The normal form (hecate.compiler.normalize): spellings collapse, results never change.

``normalize`` (what the pipeline runs) makes the whole graph functional and puts scan bodies
in the whole normal form; ``normalize_graph`` is that whole normal form on one graph.

Each case traces a function to the ATen graph the passes see (``canonicalize``), checks
what the normal form made of it, and runs the normalised graph against the original on
the same inputs: the outputs must be bit-for-bit equal (the rewrites are exact).
"""

from __future__ import annotations

import pytest
import torch

from hecate.compiler.normalize import eliminate_common_subexpressions, functionalize, normalize, normalize_graph
from hecate.compiler.pipeline import canonicalize

aten = torch.ops.aten


def _traced(fn, *args):
    """The un-normalised ATen graph of ``fn`` (the pipeline's re-trace without the normal form)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(fn, pre_dispatch=True, tracing_mode="fake")(*args)


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _check_exact(fn, args, gm):
    expected = fn(*[a.clone() for a in args])
    got = gm(*[a.clone() for a in args])
    expected = expected if isinstance(expected, tuple) else (expected,)
    got = got if isinstance(got, (tuple, list)) else (got,)
    for a, b in zip(got, expected):
        assert a.shape == b.shape and torch.equal(a, b)


def inplace_updates(M, a, k):
    M = M * 1.0
    M.mul_(a)
    M -= k.unsqueeze(-1) * k.unsqueeze(-2)
    M.add_(k.unsqueeze(-1), alpha=-0.5)
    return M


def test_in_place_updates_of_a_fresh_tensor_become_out_of_place():
    args = (torch.randn(2, 3, 3), torch.randn(2, 1, 1), torch.randn(2, 3))
    gm = normalize(_traced(inplace_updates, *args))
    assert not [t for t in _targets(gm) if t._schema.is_mutable], gm.graph
    _check_exact(inplace_updates, args, gm)


def inplace_on_input(M, a):
    M.mul_(a)
    return M + 1


def inplace_through_a_view(M, a):
    M = M * 1.0
    row = M[0]
    M.mul_(a)
    return row + 1  # the view sees the mutation


@pytest.mark.parametrize("fn", [inplace_on_input, inplace_through_a_view], ids=lambda f: f.__name__)
def test_in_place_update_that_an_alias_can_see_is_kept(fn):
    args = (torch.randn(3, 3), torch.randn(3, 3))
    gm = _traced(fn, *args)
    functionalize(gm.graph)
    gm.recompile()
    assert any(t._schema.is_mutable for t in _targets(gm)), gm.graph
    _check_exact(fn, args, gm)


def products(g, k, M, x):
    outer_matmul = g.unsqueeze(-1) @ k.unsqueeze(-2)
    outer_bmm = torch.bmm(g.reshape(6, 4, 1), k.reshape(6, 1, 5)).view(2, 3, 4, 5)
    outer_einsum = torch.einsum("bhv,bhk->bhvk", g, k)
    scaled = torch.einsum("bh,bhvk->bhvk", x, M)
    return outer_matmul, outer_bmm, outer_einsum, scaled


def test_products_that_sum_nothing_become_broadcast_multiplies():
    args = (torch.randn(2, 3, 4), torch.randn(2, 3, 5), torch.randn(2, 3, 4, 5), torch.randn(2, 3))
    gm = normalize_graph(_traced(products, *args))
    targets = _targets(gm)
    assert aten.einsum.default not in targets and aten.bmm.default not in targets
    assert aten.matmul.default not in targets
    _check_exact(products, args, gm)


def contraction(M, k):
    return torch.einsum("bvk,bk->bv", M, k), M @ k.unsqueeze(-1)


def test_contractions_are_kept():
    args = (torch.randn(2, 4, 3), torch.randn(2, 3))
    gm = normalize_graph(_traced(contraction, *args))
    assert aten.einsum.default in _targets(gm)
    _check_exact(contraction, args, gm)


def spellings(x, k):
    a = k[:, 1] * 2 + k[:, 1]  # the same slice at each use
    b = x.narrow(1, 1, 2)
    c = x * x
    d = x.contiguous().clone() + 1
    return a, b, c, d


def test_narrow_square_copies_and_repeated_slices():
    args = (torch.randn(3, 4), torch.randn(3, 4))
    gm = normalize_graph(_traced(spellings, *args))
    targets = _targets(gm)
    assert targets.count(aten.select.int) == 1  # k[:, 1] once
    assert aten.narrow.default not in targets and aten.slice.Tensor in targets
    assert aten.pow.Tensor_Scalar in targets and aten.clone.default not in targets
    _check_exact(spellings, args, gm)


def test_slice_of_a_whole_dim_is_dropped():
    """``x[:, t]`` of a symbolic-size x is ``slice(x, 0, 0, END)`` then ``select``: the slice is x itself."""
    def whole_then_part(x):
        whole = aten.slice.Tensor(x, 0, 0, 9223372036854775807)
        return whole.select(1, 1) * 2, aten.slice.Tensor(x, 0, 0, 2).select(1, 1)

    x = torch.randn(4, 3)
    gm = normalize_graph(_traced(whole_then_part, x), whole=False)
    slices = [n for n in gm.graph.nodes if n.target is aten.slice.Tensor]
    assert [n.args[2:4] for n in slices] == [(0, 2)]  # the whole-dim slice went, x[:2] stayed
    _check_exact(whole_then_part, (x,), gm)


def test_cse_keeps_random_ops_apart():
    def fn(x):
        return torch.rand_like(x) + torch.rand_like(x)

    gm = _traced(fn, torch.randn(3))
    eliminate_common_subexpressions(gm.graph)
    assert _targets(gm).count(aten.rand_like.default) == 2


def test_scan_bodies_are_normalised_too():
    """canonicalize normalises the graph and the body of every scan in it."""
    from torch._higher_order_ops.scan import scan

    def fn(M0, xs):
        def body(M, x):
            M = M * 1.0
            M.mul_(0.5)
            return M + x.unsqueeze(-1) @ x.unsqueeze(-2), M.sum()
        return scan(body, M0, xs)

    args = (torch.randn(3, 3), torch.randn(4, 3))
    gm = canonicalize(_traced(fn, *args), args)
    (body,) = [getattr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"]
    body_targets = _targets(body)
    assert not [t for t in body_targets if isinstance(t, torch._ops.OpOverload) and t._schema.is_mutable]
    assert aten.matmul.default not in body_targets
    _check_exact(fn, args, gm)
