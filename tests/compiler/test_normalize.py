"""The normal form (hecate.compiler.normalize): spellings collapse, results never change.

``normalize`` (what the pipeline runs) puts the whole graph and every scan body in the normal
form; ``normalize_graph`` is that form on one graph; ``collapse_captured`` is what Dynamo's graph
gets before loops are rolled up (functional, each subexpression once).

Each case traces a function to the ATen graph the passes see (``canonicalize``), checks
what the normal form made of it, and runs the normalised graph against the original on
the same inputs: the outputs must be bit-for-bit equal (the rewrites are exact), except where
an einsum became a matmul: the same sums, which BLAS may add in another order (1e-6 relative).
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F

from hecate.compiler.normalize import (collapse_captured, eliminate_common_subexpressions, functionalize, normalize,
                                      normalize_graph)
from hecate.compiler.pipeline import canonicalize

aten = torch.ops.aten


def _traced(fn, *args):
    """The un-normalised ATen graph of ``fn`` (the pipeline's re-trace without the normal form)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(fn, pre_dispatch=True, tracing_mode="fake")(*args)


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _check_exact(fn, args, gm, rel_tol=0.0):
    """``gm`` computes what ``fn`` computes: bit for bit, or within ``rel_tol`` relative (‖a−b‖/‖b‖)."""
    expected = fn(*[a.clone() for a in args])
    got = gm(*[a.clone() for a in args])
    expected = expected if isinstance(expected, tuple) else (expected,)
    got = got if isinstance(got, (tuple, list)) else (got,)
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert a.shape == b.shape
        if rel_tol == 0.0:
            assert torch.equal(a, b)
        else:
            assert (torch.linalg.norm(a - b) / torch.linalg.norm(b)).item() <= rel_tol


def inplace_updates(M, a, k):
    M = M * 2.0
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
    M = M * 2.0
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


def fused_add_products(M, g, k, M1, g1, k1):
    batched = torch.baddbmm(M, g.unsqueeze(2), k.unsqueeze(1), beta=0.9, alpha=-0.5)
    overwritten = torch.baddbmm(M, g.unsqueeze(2), k.unsqueeze(1), beta=0, alpha=2.0)  # M not read
    one = torch.addmm(M1, g1[:, None], k1[None, :], beta=0.5)
    outer = torch.addr(M1, g1, k1, alpha=-1.0)
    return batched, overwritten, one, outer


def test_add_products_become_a_sum_of_terms():
    """``baddbmm``/``addmm``/``addr`` are β·M + α·(a @ b): the product of a column and a row a broadcast multiply."""
    args = (torch.randn(2, 4, 3), torch.randn(2, 4), torch.randn(2, 3), torch.randn(4, 3), torch.randn(4),
            torch.randn(3))
    gm = normalize_graph(_traced(fused_add_products, *args))
    targets = _targets(gm)
    assert not {aten.baddbmm.default, aten.addmm.default, aten.addr.default, aten.bmm.default,
                aten.mm.default} & set(targets), gm.graph
    _check_exact(fused_add_products, args, gm, rel_tol=1e-6)
    nan = args[0].clone().fill_(float("nan"))  # β = 0 reads nothing of M, not even its NaNs
    assert not fused_add_products(nan, *args[1:])[1].isnan().any() and not gm(nan, *args[1:])[1].isnan().any()


def test_expand_as_is_an_expand_to_the_other_shape():
    """``x.expand_as(M)`` reads M's sizes, not M: the normal form does not read M at all."""
    def gate_as_memory(a, M):
        return a[:, None, None].expand_as(M) * 2

    args = (torch.randn(2), torch.randn(2, 4, 3))
    gm = normalize_graph(_traced(gate_as_memory, *args))
    assert aten.expand_as.default not in _targets(gm)
    _, memory = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert not memory.users, gm.graph
    _check_exact(gate_as_memory, args, gm)


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


def three_squares(x, y):
    d = x - y
    return d * d + d.square() + d ** 2


def test_every_square_spelling_is_one_pow():
    """``d * d``, ``d.square()`` and ``d ** 2`` are one ``pow(d, 2)`` once CSE has run: a value written with
    each in two places (the same KL in two gradient terms) is computed once."""
    args = (torch.randn(3, 4), torch.randn(3, 4))
    gm = normalize_graph(_traced(three_squares, *args))
    targets = _targets(gm)
    assert targets.count(aten.pow.Tensor_Scalar) == 1 and aten.square.default not in targets, gm.graph
    _check_exact(three_squares, args, gm)


def two_differences(x, y):
    return (x + -y) * 3 + (x - y), -x + y


def constants_and_doubles(x):
    return (x - 1.0) * (x + -1.0) - (x + x) * (2 * x)


def test_a_plus_a_negation_is_a_difference():
    """``x + (−y)`` is ``x − y`` (computed once with it); ``−x + y`` keeps its negation first (a score's sign)."""
    args = (torch.randn(3, 4), torch.randn(3, 4))
    gm = normalize_graph(_traced(two_differences, *args))
    targets = _targets(gm)
    assert targets.count(aten.sub.Tensor) == 1 and targets.count(aten.neg.default) == 1, gm.graph
    _check_exact(two_differences, args, gm)


def test_a_number_subtracted_is_added_negated_and_a_double_is_times_two():
    """``x − 1`` and ``x + (−1)`` are one add; ``x + x`` and ``2 * x`` one product."""
    args = (torch.randn(3, 4),)
    gm = normalize_graph(_traced(constants_and_doubles, *args))
    targets = _targets(gm)
    assert targets.count(aten.add.Tensor) == 1 and targets.count(aten.mul.Tensor) == 3, gm.graph
    _check_exact(constants_and_doubles, args, gm)


def commuted(a, b, c):
    return (a + b) * c - c * (b + a), torch.add(a, b, alpha=2), torch.add(b, a, alpha=2)


def test_sums_and_products_merge_in_either_order():
    """``a + b`` and ``b + a`` (and the products of each with c, either way round) are computed once; an add with
    ``alpha`` scales one operand, so its order counts."""
    args = (torch.randn(3, 4), torch.randn(3, 4), torch.randn(3, 4))
    gm = normalize_graph(_traced(commuted, *args))
    targets = _targets(gm)
    assert targets.count(aten.mul.Tensor) == 1 and targets.count(aten.add.Tensor) == 3, gm.graph  # 2 with alpha
    _check_exact(commuted, args, gm)


def copies_views_need(x):
    heads = x.transpose(0, 1).contiguous().view(2, 12)  # a view of the transpose itself cannot exist
    flat = x.contiguous().view(-1)  # x is contiguous already: this copy goes
    return heads, flat, -x.transpose(0, 1).reshape(-1)


def test_copies_a_later_view_needs_are_kept():
    args = (torch.randn(6, 4),)
    gm = normalize_graph(_traced(copies_views_need, *args))
    copies = [n for n in gm.graph.nodes if n.target in (aten.clone.default, aten.contiguous.default)]
    assert len(copies) == 1 and copies[0].args[0].target is aten.transpose.int, gm.graph
    _check_exact(copies_views_need, args, gm)


def test_slice_of_a_whole_dim_is_dropped():
    """``x[:, t]`` of a symbolic-size x is ``slice(x, 0, 0, END)`` then ``select``: the slice is x itself."""
    def whole_then_part(x):
        whole = aten.slice.Tensor(x, 0, 0, 9223372036854775807)
        return whole.select(1, 1) * 2, aten.slice.Tensor(x, 0, 0, 2).select(1, 1)

    x = torch.randn(4, 3)
    gm = normalize_graph(_traced(whole_then_part, x))
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
            M = M * 2.0
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


def projections(x, W, b):
    return torch.einsum("btd,ed->bte", x, W), torch.einsum("ed,btd->bte", W, x) + b, torch.einsum("btd,de->bte", x, W.T)


def test_einsum_that_is_a_tensor_times_a_matrix_becomes_a_matmul():
    args = (torch.randn(2, 3, 4), torch.randn(5, 4), torch.randn(5))
    gm = normalize_graph(_traced(projections, *args))
    targets = _targets(gm)
    assert aten.einsum.default not in targets, gm.graph
    assert targets.count(aten.matmul.default) == 2  # the first two are one x @ W.permute(1, 0) once normal
    _check_exact(projections, args, gm, rel_tol=1e-6)  # einsum's and matmul's kernels may sum in another order


def batched_contractions(k, v, q):
    kv = torch.einsum("bthk,bthv->bhvk", k, v)  # sums t with b, h kept: a batched contraction
    return torch.einsum("bthk,bhvk->bthv", q, kv)


def test_batched_contractions_stay_einsums():
    args = (torch.randn(2, 3, 2, 4), torch.randn(2, 3, 2, 5), torch.randn(2, 3, 2, 4))
    gm = normalize_graph(_traced(batched_contractions, *args))
    assert _targets(gm).count(aten.einsum.default) == 2
    _check_exact(batched_contractions, args, gm)


def pairs_then_heads(mu, logvar):
    """A pairwise score built [B, i, j, H, K] (beliefs [B, N, H, K]), summed over K and permuted to [B, H, i, j]."""
    var = logvar.exp()
    kl = 0.5 * (logvar.unsqueeze(1) - logvar.unsqueeze(2)
                + (var.unsqueeze(2) + (mu.unsqueeze(2) - mu.unsqueeze(1)) ** 2) / var.unsqueeze(1) - 1).sum(-1)
    return kl.permute(0, 3, 1, 2), kl.transpose(-1, -2)


def test_a_permute_that_puts_the_pairs_last_moves_to_the_beliefs():
    """The first output is built [B, H, i, j, K] from the start, the permute moved onto the beliefs (and through
    exp, so lv and exp(lv) stay one tensor and its exp); the second, a transpose that keeps the heads last, is
    left as written. Bit for bit the same values."""
    args = (torch.randn(2, 5, 3, 4), torch.randn(2, 5, 3, 4))
    gm = normalize_graph(_traced(pairs_then_heads, *args))
    permutes = [n for n in gm.graph.nodes if n.target is aten.permute.default]
    assert {tuple(n.args[1]) for n in permutes} == {(0, 2, 1, 3)}, gm.graph  # beliefs [B, N, H, K] → [B, H, N, K]
    assert {n.args[0].target for n in permutes} <= {aten.exp.default} | {n.op for n in gm.graph.nodes} - {
        "call_function"} or all(n.args[0].op == "placeholder" for n in permutes), gm.graph
    _check_exact(pairs_then_heads, args, gm)


def ellipsis_contractions(q, k):
    return torch.einsum("...id,...jd->...ij", q, k), torch.einsum("...d,d->...", q, k[0, 0, 0])


def test_an_ellipsis_is_named_by_letters_before_an_einsum_is_read():
    args = (torch.randn(2, 3, 5, 4), torch.randn(2, 3, 5, 4))
    gm = normalize_graph(_traced(ellipsis_contractions, *args))
    equations = [n.args[0] for n in gm.graph.nodes if n.target is aten.einsum.default]
    assert equations and not any("..." in e for e in equations), gm.graph
    _check_exact(ellipsis_contractions, args, gm, rel_tol=1e-6)


def causal_mask_made_like_the_scores(s):
    return s.masked_fill(~torch.ones_like(s, dtype=torch.bool).tril(), 0.0)


def test_ones_like_reads_only_the_shape():
    args = (torch.randn(2, 4, 4),)
    gm = normalize_graph(_traced(causal_mask_made_like_the_scores, *args))
    assert aten.ones_like.default not in _targets(gm) and aten.ones.default in _targets(gm), gm.graph
    _check_exact(causal_mask_made_like_the_scores, args, gm)


def reads_around_an_in_place_update(x):
    before = x + 1
    x.add_(1)  # x is an input: the update stays in place
    return before, x + 1


def fresh_buffers_one_updated(x):
    a, b = torch.zeros(3), torch.zeros(3)
    view = a[:2]
    a.add_(x)  # a has a view, so the update stays in place: a and b must stay two buffers
    return view * 1, b * 1


def two_equal_outputs(x):
    return x + 1, x + 1


@pytest.mark.parametrize("fn, kept", [(reads_around_an_in_place_update, (aten.add.Tensor, 2)),
                                      (fresh_buffers_one_updated, (aten.zeros.default, 2)),
                                      (two_equal_outputs, (aten.add.Tensor, 2))],
                         ids=lambda v: getattr(v, "__name__", ""))
def test_cse_keeps_apart_what_mutation_or_aliasing_tells_apart(fn, kept):
    args = (torch.randn(3),)
    gm = _traced(fn, *[a.clone() for a in args])
    eliminate_common_subexpressions(gm.graph)
    gm.recompile()
    target, count = kept
    assert _targets(gm).count(target) == count, gm.graph
    _check_exact(fn, args, gm)


def _dynamo_graph(fn, *args):
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=capture, fullgraph=True)(*args)
    torch._dynamo.reset()
    [gm] = graphs
    return gm


def written_at_each_use(x, k):
    a = k[:, 1].unsqueeze(-1) * x
    b = k[:, 1].unsqueeze(-1) + torch.rand_like(x) + torch.rand_like(x)
    return a + b


def test_dynamo_graph_computes_each_subexpression_once_on_a_copy():
    args = (torch.randn(3, 4), torch.randn(3, 2))
    gm = _dynamo_graph(written_at_each_use, *args)
    collapsed = collapse_captured(gm)
    calls = lambda g: [(n.op, n.target) for n in g.graph.nodes if n.op in ("call_function", "call_method")]  # noqa: E731
    assert calls(collapsed).count(("call_method", "unsqueeze")) == 1
    assert calls(collapsed).count(("call_function", torch.rand_like)) == 2  # random: never merged
    assert calls(gm).count(("call_method", "unsqueeze")) == 2  # Dynamo's graph is left as captured
    torch.manual_seed(0)
    expected = gm(*args)
    torch.manual_seed(0)
    assert torch.equal(collapsed(*args)[0], expected[0])


def first_slice_read_for_its_shape(k):
    k0 = k[:, 0]
    M = k0.new_zeros(k0.shape)
    for t in range(2):
        M = M + k[:, t] * 2 + k[:, t] * 2
    return M


def test_dynamo_graph_keeps_per_step_slices_apart():
    """``k[:, 0]`` taken before a loop is not the first step's ``k[:, t]``: each step keeps its own slice
    (the loop proof looks for it there), while what is computed from equal slices is computed once."""
    args = (torch.randn(3, 2),)
    gm = _dynamo_graph(first_slice_read_for_its_shape, *args)
    collapsed = collapse_captured(gm)
    calls = [n.target for n in collapsed.graph.nodes if n.op in ("call_function", "call_method")]
    assert calls.count(operator.getitem) == 5  # k0, and k[:, t] at both uses of both steps
    assert calls.count(operator.mul) == 2  # one product per step
    assert torch.equal(collapsed(*args)[0], gm(*args)[0])


def outputs_into_slots(x):
    out = torch.empty(3, 2, 4)
    for t in range(2):
        out[:, t] = x[:, t] * 2
    return out + 1


def outputs_into_slots_read_early(x):
    out = torch.zeros(3, 2, 4)
    for t in range(2):
        out[:, t] = x[:, t] * 2 + out.sum(1)
    return out


def outputs_into_slots_of_width_one(x):
    out = torch.full((3, 3, 4), 7.0)
    for t in range(1, 3):  # slot 0 left as made
        out[:, t:t + 1] = x[:, t - 1:t] * 2
    return out + 1


def test_outputs_written_into_every_slot_once_are_a_stack():
    """``out[:, t] = y_t`` into a fresh tensor, every slot once, out read after: ``torch.stack`` of the y_t
    (``torch.cat`` of slots of width 1, ``out[:, t:t + 1] = y_t``)."""
    args = (torch.randn(3, 2, 4),)
    for fn, joined in ((outputs_into_slots, torch.stack), (outputs_into_slots_read_early, None),
                       (outputs_into_slots_of_width_one, torch.cat)):
        gm = _dynamo_graph(fn, *args)
        collapsed = collapse_captured(gm)
        targets = [n.target for n in collapsed.graph.nodes]
        assert (joined in targets if joined else operator.setitem in targets), collapsed.graph
        assert (operator.setitem in targets) is (joined is None), collapsed.graph
        assert torch.equal(collapsed(*[a.clone() for a in args])[0], fn(*args))


def _written_whole(write):
    def fn(x):
        state = torch.zeros(2, 3, 4)
        for _ in range(2):
            write(state, (state * 0.5 + x).sin())
        return state * 2
    return fn


def _written_in_part(write):
    def fn(x):
        state = torch.ones(2, 3, 4)
        view = write(state, (state * 0.5 + x).sin())
        return state * 2, view * 3
    return fn


WHOLE_WRITES = {
    "slice": lambda s, y: s.__setitem__(slice(None), y),
    "ellipsis": lambda s, y: s.__setitem__(Ellipsis, y),
    "two_slices": lambda s, y: s.__setitem__((slice(None), slice(None)), y),
    "copy_into_an_ellipsis": lambda s, y: s[...].copy_(y),
    "copy_into_a_flat_view": lambda s, y: s.view(-1).copy_(y.flatten()),
    "copy_into_a_view_of_a_new_shape": lambda s, y: s.view(6, 4).copy_(y.reshape(6, 4)),
    "copy_of_a_value_made_in_the_view's_shape": lambda s, y: s.view(6, 4).copy_(y.reshape(6, 4).cos()),
}
PART_WRITES = {  # each writes part of the state, or a view read after the write, or broadcasts or casts y
    "a_slice_of_the_first_dim": lambda s, y: s.__setitem__(slice(1, None), y[1:]) or s[:1],
    "the_last_column": lambda s, y: (s[..., -1].copy_(y[..., 0]), s[..., :1])[1],
    "a_broadcast_row": lambda s, y: s.__setitem__(slice(None), y[:1]) or s,
    "a_cast_from_double": lambda s, y: s.__setitem__(slice(None), y.double()) or s,
    "a_transposed_view": lambda s, y: s.transpose(1, 2).copy_(y.transpose(1, 2)),
    "a_flat_view_read_after": lambda s, y: s.view(-1).copy_(y.flatten()),
    "every_other_row": lambda s, y: s[:, ::2].copy_(y[:, ::2]),
}


def written_by_out_arguments(x, y):
    state = torch.zeros(3, 4)
    for t in range(2):
        torch.mul(state, 0.5, out=state)
        torch.add(state, x[t] * y[t], out=state)
    return state * 2


def test_a_call_with_an_out_argument_is_an_assignment():
    """``torch.add(M, u, out=M)`` → ``M.copy_(torch.add(M, u))``, then made functional."""
    x, y = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    gm = _dynamo_graph(written_by_out_arguments, x, y)
    collapsed = collapse_captured(gm)
    writes = [n for n in collapsed.graph.nodes if "out" in n.kwargs or n.op == "call_method" and n.target == "copy_"]
    assert not writes, collapsed.code
    assert torch.equal(collapsed(x, y)[0], written_by_out_arguments(x, y))


@pytest.mark.parametrize("name", list(WHOLE_WRITES))
def test_a_write_into_all_of_a_fresh_tensor_is_an_assignment(name):
    """``x[:] = y``, ``x[...].copy_(y)``, ``x.view(s).copy_(y.reshape(s))``: x holds y from there on (the
    loop roller then reads the state as reassigned, ``x = y``)."""
    fn, x = _written_whole(WHOLE_WRITES[name]), torch.randn(2, 3, 4)
    gm = _dynamo_graph(fn, x)
    collapsed = collapse_captured(gm)
    writes = [n for n in collapsed.graph.nodes if n.target in ("copy_", operator.setitem)]
    assert not writes, collapsed.code
    assert torch.equal(collapsed(x)[0], fn(x))


@pytest.mark.parametrize("name", list(PART_WRITES))
def test_a_write_into_part_of_a_tensor_or_a_view_read_after_it_is_kept(name):
    fn, x = _written_in_part(PART_WRITES[name]), torch.randn(2, 3, 4)
    gm = _dynamo_graph(fn, x)
    collapsed = collapse_captured(gm)
    writes = [n for n in collapsed.graph.nodes if n.target in ("copy_", operator.setitem)]
    assert writes, collapsed.code
    for got, expected in zip(collapsed(x), fn(x)):
        assert torch.equal(got, expected)


def input_scaled_in_place_every_step(state, x):
    for t in range(3):
        state.mul_(0.5).add_(x[t])
    return state.sin() * 2


def input_assigned_whole(state, x):
    for t in range(3):
        state[:] = state * 0.5 + x[t]
    return state.sum(0)


def input_written_and_returned(state, x):
    state.add_(x[0])
    return state


def input_written_and_read_through_a_view(state, x):
    row = state[0]
    state.add_(x[0])
    return row * 2


@pytest.mark.parametrize("fn", [input_scaled_in_place_every_step, input_assigned_whole], ids=lambda f: f.__name__)
def test_an_input_written_in_place_is_made_functional_and_written_back_once(fn):
    """A module's buffer updated in place at every step of a loop: the steps read as a state reassigned (a loop
    the roller sees), the input written once where the graph returns, to what the writes left in it."""
    state, x = torch.randn(4, 5), torch.randn(3, 4, 5)
    gm = _dynamo_graph(fn, state.clone(), x)
    collapsed = collapse_captured(gm)
    writes = [n for n in collapsed.graph.nodes if n.op == "call_method" and n.target.endswith("_")
              or n.target is operator.setitem]
    assert [n.target for n in writes] == ["copy_"] and writes[0].next.op == "output", collapsed.code
    ours, eager = state.clone(), state.clone()
    got, want = collapsed(ours, x)[0], fn(eager, x)
    assert torch.equal(got, want) and torch.equal(ours, eager)


@pytest.mark.parametrize("fn", [input_written_and_returned, input_written_and_read_through_a_view],
                         ids=lambda f: f.__name__)
def test_an_input_written_in_place_and_returned_or_viewed_is_kept(fn):
    state, x = torch.randn(4, 5), torch.randn(3, 4, 5)
    gm = _dynamo_graph(fn, state.clone(), x)
    collapsed = collapse_captured(gm)
    assert "add_" in [n.target for n in collapsed.graph.nodes], collapsed.code
    ours, eager = state.clone(), state.clone()
    assert torch.equal(collapsed(ours, x)[0], fn(eager, x)) and torch.equal(ours, eager)


def test_an_input_that_requires_grad_written_in_place_is_kept():
    state, x = torch.randn(4, 5), torch.randn(3, 4, 5)
    gm = _dynamo_graph(input_scaled_in_place_every_step, state.clone(), x)
    next(n for n in gm.graph.nodes if n.op == "placeholder").meta["example_value"].requires_grad_()
    collapsed = collapse_captured(gm)
    assert "mul_" in [n.target for n in collapsed.graph.nodes], collapsed.code


def outputs_into_a_buffer_passed_in(x, out):
    for t in range(2):
        out[:, t] = x[:, t] * 2
    return out.sum(1)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_outputs_into_a_buffer_passed_in_are_a_stack_written_back_where_no_gradient_is_recorded(grad):
    x, out = torch.randn(3, 2, 4), torch.zeros(3, 2, 4)
    with torch.set_grad_enabled(grad):
        gm = _dynamo_graph(outputs_into_a_buffer_passed_in, x, out.clone())
        collapsed = collapse_captured(gm)
    targets = [n.target for n in collapsed.graph.nodes]
    assert (torch.stack in targets) is not grad and (operator.setitem in targets) is grad, collapsed.code
    ours, eager = out.clone(), out.clone()
    assert torch.equal(collapsed(x, ours)[0], outputs_into_a_buffer_passed_in(x, eager)) and torch.equal(ours, eager)


class _Scalars(torch.nn.Module):
    """Float attributes read by float and int tensors: under dynamic=True Dynamo passes each as a 0-d input."""

    def __init__(self):
        super().__init__()
        self.scale, self.shift = 0.3, 1.7

    def forward(self, x, counts):
        return (1 - self.scale) * x + self.scale * 2, counts * self.shift


def test_float_attributes_are_read_as_tensors_where_exact(fresh_dynamo):
    args = (torch.randn(3, 4), torch.arange(5))
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm

    torch.compile(_Scalars(), backend=capture, dynamic=True, fullgraph=True)(*args)
    [gm] = graphs
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    values = [n.meta["example_value"] for n in placeholders]
    assert sum(isinstance(v, torch.Tensor) and v.dtype == torch.float64 for v in values) == 2, gm.code
    collapsed = collapse_captured(gm)
    items = [n for n in collapsed.graph.nodes if n.op == "call_method" and n.target == "item"]
    # the scale reaches only a float tensor with dims: read as a tensor; the shift meets an int
    # tensor (a 0-d float64 tensor would make the result float64, a Python float float32): kept
    assert len(items) == 1, collapsed.code
    inputs = _graph_inputs(gm, args)
    for got, expected in zip(collapsed(*inputs), gm(*inputs)):
        assert got.dtype == expected.dtype and torch.equal(got, expected)


def _graph_inputs(gm, args):
    """Dynamo's graph inputs for ``args``: the tensors, the attributes as 0-d float64 tensors, sizes as ints."""
    by_name = {"L_x_": args[0], "L_counts_": args[1],
               "L_self_scale": torch.tensor(0.3, dtype=torch.float64),
               "L_self_shift": torch.tensor(1.7, dtype=torch.float64)}
    inputs = []
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            value = n.meta["example_value"]
            inputs.append(by_name[n.target] if n.target in by_name else int(value.node.hint))
    return inputs


def repeated_chains(x):
    """The same chain of four ops written 500 times, and a random draw written 500 times."""
    kept = [((x + 1).sin() * 2).sum(0) for _ in range(500)]
    drawn = [torch.rand_like(x) for _ in range(500)]
    return torch.stack(kept), torch.stack(drawn)


def test_cse_merges_every_repeated_chain_in_one_pass_and_no_random_draw():
    """Each repeat merges into the first, a chain's later ops too (they read the merged nodes)."""
    gm = _traced(repeated_chains, torch.randn(4, 3))
    assert len(gm.graph.nodes) > 2500
    eliminate_common_subexpressions(gm.graph)
    gm.recompile()
    targets = _targets(gm)
    for op in (aten.add.Tensor, aten.sin.default, aten.mul.Tensor, aten.sum.dim_IntList):
        assert targets.count(op) == 1, (op, targets.count(op))
    assert targets.count(aten.rand_like.default) == 500
    x = torch.randn(4, 3)
    kept, _ = gm(x)
    assert torch.equal(kept, repeated_chains(x)[0])


def nothing_repeated(x, k):
    return (k[:, 1].unsqueeze(-1) * x).sin()


def test_dynamo_graph_with_nothing_to_change_is_not_copied():
    gm = _dynamo_graph(nothing_repeated, torch.randn(3, 4), torch.randn(3, 2))
    assert collapse_captured(gm) is gm


def updated_in_place_then_read_twice(x):
    h = x * 2.0
    h.add_(1.0)
    return h.sin() + h.sin()


def test_dynamo_graph_updated_in_place_is_made_functional_and_merged_on_a_copy():
    x = torch.randn(5)
    gm = _dynamo_graph(updated_in_place_then_read_twice, x)
    collapsed = collapse_captured(gm)
    methods = lambda g: [n.target for n in g.graph.nodes if n.op == "call_method"]  # noqa: E731
    assert "add_" not in methods(collapsed) and methods(collapsed).count("sin") == 1
    assert "add_" in methods(gm) and methods(gm).count("sin") == 2  # Dynamo's graph is left as captured
    assert torch.equal(collapsed(x)[0], gm(x)[0])


def error_formed_in_place_on_a_view(M, k, v):
    e = (M @ k.unsqueeze(-1)).squeeze(-1)
    e.sub_(v)
    return e.unsqueeze(-1) * k.unsqueeze(-2)  # a view of e taken after the write reads it


def view_taken_before_the_write(M, k, v):
    r = M @ k.unsqueeze(-1)
    e = r.squeeze(-1)
    e.sub_(v)
    return r.sin()  # r, taken before, sees the write


def base_assigned_besides(M, k, v):
    r = M @ k.unsqueeze(-1)
    e = r.squeeze(-1)
    e.sub_(v)
    r[:, 0] = 0.0
    return e * 2


def test_dynamo_graph_write_into_a_view_of_a_fresh_tensor_becomes_out_of_place():
    args = (torch.randn(2, 3, 4), torch.randn(2, 4), torch.randn(2, 3))
    gm = _dynamo_graph(error_formed_in_place_on_a_view, *args)
    assert functionalize(gm.graph)
    gm.recompile()
    assert "sub_" not in [n.target for n in gm.graph.nodes], gm.graph
    assert torch.equal(gm(*_by_name(gm, args))[0], error_formed_in_place_on_a_view(*args))


@pytest.mark.parametrize("fn", [view_taken_before_the_write, base_assigned_besides], ids=lambda f: f.__name__)
def test_dynamo_graph_write_into_a_view_that_another_alias_sees_is_kept(fn):
    args = (torch.randn(2, 3, 4), torch.randn(2, 4), torch.randn(2, 3))
    gm = _dynamo_graph(fn, *args)
    functionalize(gm.graph)
    gm.recompile()
    assert "sub_" in [n.target for n in gm.graph.nodes], gm.graph
    assert torch.equal(gm(*_by_name(gm, args))[0], fn(*args))


def _by_name(gm, args):
    """``args`` (M, k, v) in the order of Dynamo's placeholders."""
    named = dict(zip(("L_M_", "L_k_", "L_v_"), args))
    return [named[n.target] for n in gm.graph.nodes if n.op == "placeholder"]


def three_operands(a, m, v):
    return torch.einsum("bts,ts,bsd->btd", a, m, v)


def test_einsum_of_three_operands_is_contracted_two_at_a_time():
    args = (torch.randn(2, 5, 5), torch.randn(5, 5), torch.randn(2, 5, 3))
    gm = normalize_graph(_traced(three_operands, *args))
    assert all(len(n.args[1]) == 2 for n in gm.graph.nodes if n.target is aten.einsum.default), gm.graph
    _check_exact(three_operands, args, gm)


def channels_first_projections(x, W):
    return torch.einsum("btd,ed->bet", x, W), torch.einsum("ed,btd->bet", W, x), torch.einsum("btd,ed->bte", x, W)


def test_einsum_with_the_output_in_another_order_is_the_matmul_then_one_permute():
    args = (torch.randn(2, 3, 4), torch.randn(5, 4))
    gm = normalize_graph(_traced(channels_first_projections, *args))
    targets = _targets(gm)
    assert aten.einsum.default not in targets and targets.count(aten.matmul.default) == 1, gm.graph
    permutes = [n.args[1] for n in gm.graph.nodes if n.target is aten.permute.default]
    # W's once, and the product's into [b, e, t] for each output (outputs never alias each other)
    assert sorted(permutes) == [[0, 2, 1], [0, 2, 1], [1, 0]], gm.graph
    _check_exact(channels_first_projections, args, gm, rel_tol=1e-6)


def conv_layouts(h, w):
    K = w.shape[-1]
    sliced_after = torch.nn.functional.conv1d(h.transpose(1, 2), w, padding=K - 1, groups=4).transpose(1, 2)[:, :-(K - 1)]
    narrowed_after = torch.nn.functional.conv1d(h.mT, w, padding=K - 1, groups=4).permute(0, 2, 1).narrow(1, 0, 5)
    padded_before = torch.nn.functional.conv1d(torch.nn.functional.pad(h, (0, 0, K - 1, 0)).transpose(1, 2), w, groups=4)
    one_row = torch.nn.functional.conv2d(h.transpose(1, 2).unsqueeze(2), w.unsqueeze(2), padding=(0, K - 1),
                                         groups=4).squeeze(2)
    indexed_row = torch.nn.functional.conv2d(h.transpose(1, 2)[:, :, None], w[:, :, None], padding=(0, K - 1),
                                             groups=4)[:, :, 0]
    return sliced_after, narrowed_after, padded_before, one_row, indexed_row


def test_slices_and_zero_pads_sit_next_to_the_conv_and_a_conv2d_over_one_row_is_a_conv1d():
    args = (torch.randn(2, 5, 4), torch.randn(4, 1, 3))
    gm = normalize_graph(_traced(conv_layouts, *args))
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert not {aten.conv2d.default, aten.squeeze.dim, aten.select.int} & set(_targets(gm)), gm.graph
    for n in nodes:
        if n.target is aten.slice.Tensor:
            assert n.args[0].target is aten.conv1d.default and n.args[1] == 2, gm.graph
        if n.target is aten.pad.default:
            assert list(n.args[1]) == [2, 0] and n.args[0].target is aten.transpose.int, gm.graph
    _check_exact(conv_layouts, args, gm)


def test_a_pad_that_is_not_zeros_keeps_its_place():
    def replicate(h):
        return torch.nn.functional.pad(h, (0, 0, 2, 0), mode="replicate").transpose(1, 2)

    gm = normalize_graph(_traced(replicate, torch.randn(2, 5, 4)))
    pad = next(n for n in gm.graph.nodes if n.target is aten.pad.default)
    assert [u.target for u in pad.users] == [aten.transpose.int], gm.graph


def conv_by_windows(h, w, b):  # h [B, D, T], w [D, K], b [D]
    p = torch.nn.functional.pad(h, (w.shape[1] - 1, 0))
    return sum(w[:, k, None] * p[..., k:k + h.shape[-1]] for k in range(w.shape[1])) + b[:, None]


def conv_by_unfold(h, w, b):
    windows = torch.nn.functional.pad(h, (w.shape[1] - 1, 0)).unfold(-1, w.shape[1], 1)
    return (windows * w[:, None, :]).sum(-1)


def windows_not_causal(h, w, b):  # a centred window: not the causal conv
    p = torch.nn.functional.pad(h, (1, 1))
    return sum(w[:, k, None] * p[..., k:k + h.shape[-1]] for k in range(3))


def windows_weighted_per_sequence(h, w, b):  # weights [B, D, 1]: not one kernel for every sequence
    p = torch.nn.functional.pad(h, (2, 0))
    return sum(h[:, :, :1] * p[..., k:k + h.shape[-1]] for k in range(3))


def conv_by_shifted_copies(h, w, b):  # each tap's copy its own F.pad of a slice
    return h * w[:, 3, None] + sum(torch.nn.functional.pad(h[..., :-s], (s, 0)) * w[:, 3 - s, None] for s in (1, 2, 3))


def conv_by_rolls_kept_by_where(h, w, b):  # torch.where(t >= s, roll, 0): zeros in front whatever h holds
    t = torch.arange(h.shape[-1])
    return sum(torch.where(t >= s, torch.roll(h, s, -1), 0.0) * w[:, 3 - s, None] for s in range(4))


def conv_by_stacked_windows(h, w, b):  # the windows of one pad stacked on a last dim, weighted by einsum
    p = torch.nn.functional.pad(h, (3, 0))
    return torch.einsum("bdtk,dk->bdt", torch.stack([p[..., k:k + h.shape[-1]] for k in range(4)], -1), w)


def rolls_times_a_mask(h, w, b):  # torch.roll(h, s) * (t >= s): 0·inf is NaN where an inf wraps around
    t = torch.arange(h.shape[-1])
    return sum(torch.roll(h, s, -1) * (t >= s) * w[:, 2 - s:3 - s] for s in range(3))


def shifted_copies_in_a_longer_sum(h, w, b):  # the causal half of a centred window set: not a conv of its own
    p = torch.nn.functional.pad(h, (1, 1))
    return sum(p[..., k:k + h.shape[-1]] * w[:, k:k + 1] for k in range(3))


@pytest.mark.parametrize("fn", [conv_by_windows, conv_by_unfold, conv_by_shifted_copies, conv_by_rolls_kept_by_where,
                                conv_by_stacked_windows], ids=lambda f: f.__name__)
def test_causal_conv_written_by_hand_is_a_conv1d(fn):
    """Σ_k w_k · F.pad(h, (K−1, 0))[..., k:k+T] (a bias after it) and the unfold form read as F.conv1d with
    groups=D: the same products, summed in the conv's order (1e-6 relative); so are copies of h shifted each its
    own way (recognised by their values) and the windows stacked on a last dim (unfold)."""
    args = (torch.randn(2, 5, 9), torch.randn(5, 4), torch.randn(5))
    gm = normalize(_traced(fn, *args))
    targets = _targets(gm)
    assert aten.conv1d.default in targets and aten.unfold.default not in targets, gm.graph
    assert aten.slice.Tensor not in targets and aten.sum.dim_IntList not in targets, gm.graph
    _check_exact(fn, args, gm, rel_tol=1e-6)


@pytest.mark.parametrize("fn", [windows_not_causal, windows_weighted_per_sequence, rolls_times_a_mask,
                                shifted_copies_in_a_longer_sum], ids=lambda f: f.__name__)
def test_windowed_sums_that_are_not_the_causal_depthwise_conv_stay(fn):
    args = (torch.randn(2, 5, 9), torch.randn(5, 3), torch.randn(5))
    gm = normalize(_traced(fn, *args))
    assert aten.conv1d.default not in _targets(gm), gm.graph
    _check_exact(fn, args, gm)


def heads_moved_and_merged_back(u):  # [B, T, D] → [B, D, T] through a head split: u.transpose(1, 2)
    return u.view(2, 7, 3, 2).permute(0, 2, 3, 1).reshape(2, 6, 7).cumsum(-1)


def heads_interleaved(u):  # the head dims swapped before the merge: not a move of u's dims
    return u.view(2, 7, 3, 2).permute(0, 3, 2, 1).reshape(2, 6, 7).cumsum(-1)


def test_a_layout_chain_that_only_moves_dims_is_one_permute():
    args = (torch.randn(2, 7, 6),)
    gm = normalize(_traced(heads_moved_and_merged_back, *args))
    targets = _targets(gm)
    assert aten.view.default not in targets and aten.reshape.default not in targets, gm.graph
    _check_exact(heads_moved_and_merged_back, args, gm)
    gm = normalize(_traced(heads_interleaved, *args))
    assert any(t in _targets(gm) for t in (aten.view.default, aten.reshape.default, aten._unsafe_view.default)), \
        gm.graph
    _check_exact(heads_interleaved, args, gm)


def softmax_spelled_with_logsumexp(s):
    return torch.exp(s - s.logsumexp(-1, keepdim=True)), s - s.logsumexp(-1, keepdim=True)


def test_a_logsumexp_shift_is_a_log_softmax_and_its_exp_a_softmax():
    args = (torch.randn(2, 4, 4),)
    gm = normalize_graph(_traced(softmax_spelled_with_logsumexp, *args))
    targets = _targets(gm)
    assert aten.softmax.int in targets and aten.log_softmax.int in targets, gm.graph
    assert aten.logsumexp.default not in targets, gm.graph
    _check_exact(softmax_spelled_with_logsumexp, args, gm, rel_tol=1e-6)


def masks_spelled_otherwise(kl, keep):
    return (torch.softmax(-kl.masked_fill(~keep, float("inf")) / 2, -1),
            torch.softmax(torch.where(keep, -kl, torch.full_like(kl, float("-inf"))), -1))


def test_masks_move_onto_the_score_a_softmax_reads():
    """``−kl.masked_fill(m, inf) / 2`` is ``(−kl / 2).masked_fill(m, −inf)``; ``where(m, s, full_like(s, c))``
    is ``where(m, s, c)``: the mask spellings a pass reads."""
    keep = torch.ones(4, 4, dtype=torch.bool).tril()
    args = (torch.rand(2, 4, 4), keep)
    gm = normalize_graph(_traced(masks_spelled_otherwise, *args))
    fills = [n for n in gm.graph.nodes if n.target is aten.masked_fill.Scalar]
    assert [n.args[2] for n in fills] == [float("-inf")] and all(u.target is aten.softmax.int for u in fills[0].users)
    assert aten.where.ScalarOther in _targets(gm) and aten.full_like.default not in _targets(gm), gm.graph
    _check_exact(masks_spelled_otherwise, args, gm)


def masks_filled_with_a_tensor_or_by_item_assignment(s, keep):
    t = s.clone()
    t[..., ~keep] = float("-inf")
    return s.masked_fill(~keep, torch.tensor(float("-inf"))).softmax(-1), t.softmax(-1)


def test_a_mask_filled_with_a_tensor_of_one_number_or_by_item_assignment_is_a_masked_fill():
    """``s.masked_fill(m, torch.tensor(c))`` and ``s[..., m] = c`` (m a bool mask of s's last dims) are
    ``s.masked_fill(m, c)``."""
    keep = torch.ones(4, 4, dtype=torch.bool).tril()
    args = (torch.rand(2, 4, 4), keep)
    gm = normalize_graph(_traced(masks_filled_with_a_tensor_or_by_item_assignment, *args))
    fills = [n.args[0] for n in gm.graph.nodes if n.target is aten.softmax.int]
    assert len(fills) == 2 and all(n.target is aten.masked_fill.Scalar and n.args[2] == float("-inf")
                                   for n in fills), gm.graph  # (one node: the same fill, merged)
    assert aten.index_put.default not in _targets(gm) and aten.masked_fill.Tensor not in _targets(gm), gm.graph
    _check_exact(masks_filled_with_a_tensor_or_by_item_assignment, args, gm)


def integer_index_assignment(s, rows):
    t = s.clone()
    t[:, rows] = -1e4
    return t.softmax(-1)


def test_an_assignment_at_integer_indices_is_no_mask():
    args = (torch.rand(2, 4, 4), torch.tensor([0, 2]))
    gm = normalize_graph(_traced(integer_index_assignment, *args))
    assert aten.masked_fill.Scalar not in _targets(gm), gm.graph
    _check_exact(integer_index_assignment, args, gm)


def softmax_over_dim_minus_2(s, keep):
    return torch.softmax(s.masked_fill(~keep, float("-inf")), dim=1), torch.log_softmax(s, dim=-2)


def test_a_softmax_over_dim_minus_2_of_a_square_score_is_over_the_last_dim_of_its_transpose():
    keep = torch.ones(4, 4, dtype=torch.bool).tril()
    args = (torch.randn(2, 4, 4), keep)
    gm = normalize_graph(_traced(softmax_over_dim_minus_2, *args))
    softmaxes = [n for n in gm.graph.nodes if n.target in (aten.softmax.int, aten.log_softmax.int)]
    assert [n.args[1] for n in softmaxes] == [-1, -1], gm.graph
    assert softmaxes[0].args[0].target is aten.masked_fill.Scalar, gm.graph  # the mask transposed with the score
    _check_exact(softmax_over_dim_minus_2, args, gm, rel_tol=1e-6)  # the same sums, over a transposed layout


def outer_and_lerp(a, b, M, X):
    return torch.outer(a, b), torch.lerp(M, X, 0.25)


def test_outer_is_a_broadcast_product_and_lerp_a_weighted_sum():
    args = (torch.randn(3), torch.randn(4), torch.randn(3, 4), torch.randn(3, 4))
    gm = normalize_graph(_traced(outer_and_lerp, *args))
    targets = _targets(gm)
    assert aten.outer.default not in targets and aten.lerp.Scalar not in targets, gm.graph
    _check_exact(outer_and_lerp, args, gm, rel_tol=1e-6)  # lerp rounds a + w(b − a), not (1 − w)a + wb


def iterating_the_tensor(x):
    s = x.new_zeros(x.shape[1])
    outs = []
    for x_t in x:  # Dynamo takes x[0], x[1], x[2] before the first step
        s = 0.5 * s + x_t
        outs.append(s * 2)
    return torch.stack(outs)


def test_dynamo_graph_takes_each_step_slice_where_the_step_reads_it():
    args = (torch.randn(3, 2),)
    gm = _dynamo_graph(iterating_the_tensor, *args)
    collapsed = collapse_captured(gm)
    nodes = [n for n in collapsed.graph.nodes if n.op == "call_function"]
    slices = [i for i, n in enumerate(nodes) if n.target is operator.getitem]
    assert len(slices) == 3 and all(nodes[i + 1] in nodes[i].users for i in slices), collapsed.graph
    assert torch.equal(collapsed(*args)[0], gm(*args)[0])


def written_under_no_grad(a, b, c):
    e = a * b
    with torch.no_grad():
        e.sub_(c)  # not recorded by autograd: e keeps a * b's gradient
    return e * a


def clamped_under_no_grad(x, w):
    y = x * w
    torch.set_grad_enabled(False)
    y.clamp_(-0.5, 0.5)
    torch.set_grad_enabled(True)
    return y.sin()


@pytest.mark.parametrize("fn", [written_under_no_grad, clamped_under_no_grad], ids=lambda f: f.__name__)
def test_a_write_under_no_grad_keeps_the_gradient_eager_gives(fn):
    """Made out of place, or read through a detach, the write lost a * b's gradient (grad_b None, grad_a 0.62
    off); it stays in place, as autograd sees it."""
    torch._dynamo.reset()
    inputs = [torch.randn(5, generator=torch.Generator().manual_seed(i)) for i in range(3)][:fn.__code__.co_argcount]
    args, ref_args = [x.clone().requires_grad_() for x in inputs], [x.clone().requires_grad_() for x in inputs]
    got, ref = torch.compile(fn, backend="hecate")(*args), fn(*ref_args)
    assert torch.equal(got, ref)
    grads = torch.autograd.grad(got.sum(), args, allow_unused=True)
    for a, b in zip(grads, torch.autograd.grad(ref.sum(), ref_args, allow_unused=True)):
        assert (a is None) == (b is None) and (a is None or torch.allclose(a, b, rtol=1e-6, atol=0.0))
    torch._dynamo.reset()


def raised_in_place(h):
    y = h * 2.0 + 1.5
    a = y.sum(1)
    y **= 2  # aten.pow_.Scalar: its out-of-place twin is pow.Tensor_Scalar, not pow.Scalar (a number's power)
    y.add_(h, alpha=2.0)
    return h * (a - y.sum(1))[:, None]


def test_an_in_place_op_is_made_out_of_place_with_the_overload_of_its_arguments():
    """``y **= 2`` was an internal error (the overload of the same name takes a number and a tensor)."""
    torch._dynamo.reset()
    h, h_ref = (torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(0)).requires_grad_() for _ in range(2))
    got = torch.compile(raised_in_place, backend="hecate", options={"strict": True})(h)
    ref = raised_in_place(h_ref)
    assert torch.allclose(got, ref, rtol=1e-6, atol=0.0)
    (g,), (r,) = torch.autograd.grad(got.sum(), [h]), torch.autograd.grad(ref.sum(), [h_ref])
    assert torch.allclose(g, r, rtol=1e-6, atol=1e-7)
    torch._dynamo.reset()


def silu_after_a_head_split(h):
    """SiLU and ELU+1 of heads moved by a permute; a sigmoid of the heads moved back."""
    heads = h.view(2, 5, 2, 3).permute(0, 2, 1, 3)
    return F.elu(F.silu(heads)) + 1, torch.sigmoid(heads.transpose(1, 2))


def heads_laid_out_for_a_view(h):
    """A head split read by SiLU and by a clone that lays it out for a view."""
    heads = h.view(2, 5, 2, 3).permute(0, 2, 1, 3)
    return F.silu(heads), heads.clone(memory_format=torch.contiguous_format).view(2, 2, 15) * 2


def _moves(gm):
    return [n for n in gm.graph.nodes if n.target in (aten.permute.default, aten.transpose.int)]


def test_pointwise_ops_of_a_permute_are_computed_before_it():
    """SiLU, ELU and + 1 read the view, the permute after them; the two moves that undo each other are none (the
    sigmoid reads the view). Bit for bit the same values."""
    args = (torch.randn(2, 5, 6),)
    gm = normalize_graph(_traced(silu_after_a_head_split, *args))
    assert [str(p.args[0].target) for p in _moves(gm)] == ["aten.add.Tensor"], gm.graph
    (sigmoid,) = [n for n in gm.graph.nodes if n.target is aten.sigmoid.default]
    assert sigmoid.args[0].target is aten.view.default, gm.graph
    _check_exact(silu_after_a_head_split, args, gm)


def test_a_permute_also_read_by_a_clone_stays_before_its_pointwise_readers():
    """The clone's memory format lays the permute out for the view (moved after it, the view fails); SiLU stays
    after the permute too, as the permute is not moved at all where something else reads it."""
    args = (torch.randn(2, 5, 6),)
    gm = normalize_graph(_traced(heads_laid_out_for_a_view, *args))
    (move,) = _moves(gm)
    assert {u.target for u in move.users} == {aten.silu.default, aten.clone.default}, gm.graph
    _check_exact(heads_laid_out_for_a_view, args, gm)


def products_with_diagonal_matrices(M, a, d):
    return M @ torch.diag_embed(a), torch.diag_embed(a) @ M, M[0] @ torch.diag(d), torch.diag(d) @ M[1]


def test_a_product_with_a_diagonal_matrix_is_a_broadcast_multiply():
    """GLA's M diag(α_t) is M with each column scaled (probe r37: the decay read as a second update term)."""
    args = (torch.randn(2, 4, 4), torch.rand(2, 4), torch.randn(4))
    gm = normalize_graph(_traced(products_with_diagonal_matrices, *args))
    targets = _targets(gm)
    assert aten.matmul.default not in targets and aten.diag_embed.default not in targets \
        and aten.diag.default not in targets, gm.graph
    _check_exact(products_with_diagonal_matrices, args, gm)  # one product plus zeros: the same numbers


def product_with_a_diagonal_off_the_main_one(M, a):
    return M @ torch.diag_embed(a, offset=1)


def test_a_product_with_a_matrix_of_another_diagonal_is_kept():
    args = (torch.randn(2, 5, 5), torch.rand(2, 4))
    gm = normalize_graph(_traced(product_with_a_diagonal_off_the_main_one, *args))
    assert aten.matmul.default in _targets(gm) or aten.bmm.default in _targets(gm), gm.graph
    _check_exact(product_with_a_diagonal_off_the_main_one, args, gm)
