"""Rolling Dynamo's unrolled loops back up into one scan (hecate.compiler.loops).

Each rolled graph is run eagerly and compared with Dynamo's unrolled graph on the same
inputs, so a wrong carry, slice or stack shows as a numerical difference.
"""

import pytest
import torch
import torch.nn.functional as F

import hecate

from hecate.compiler.loops import roll_loops
from hecate.compiler.normalize import normalize_graph
from hecate.compiler.options import parse_options
from hecate.compiler.pipeline import fuse
from hecate.models.memory import LpMemory
from hecate.testing import assert_close, assert_outputs_and_gradients_close

SCAN = torch.ops.higher_order.scan


def _dynamo_graph(fn, *args):
    """Dynamo's graph of ``fn(*args)`` and its example inputs (real tensors)."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=capture, fullgraph=True)(*args)
    torch._dynamo.reset()
    (graph,) = graphs
    return graph


def _scans(gm):
    return [n for n in gm.graph.nodes if n.target is SCAN]


def _check_rolled(fn, *args, steps):
    gm, inputs = _dynamo_graph(fn, *args)
    rolled = roll_loops(gm)
    assert rolled is not None, "the loop was not rolled up"
    assert rolled.steps == steps
    assert len(_scans(rolled.gm)) == len(steps)
    expected, got = gm(*inputs), rolled.gm(*inputs)
    assert len(got) == len(expected)
    for name, a, b in zip(range(len(got)), got, expected):
        assert a.shape == b.shape, (name, a.shape, b.shape)
        assert_close(f"output {name}", a, b, 1e-6)
    return rolled


def rnn(x, h, W):
    """A plain RNN: a carry, a per-step slice along dim 1, an invariant weight, stacked outputs."""
    ys = []
    for t in range(x.shape[1]):
        h = torch.tanh(h @ W + x[:, t])
        ys.append(h * 2)
    return torch.stack(ys, dim=1), h


def test_rnn_loop_is_rolled_into_one_scan():
    rolled = _check_rolled(rnn, torch.randn(3, 7, 5), torch.randn(3, 5), torch.randn(5, 5), steps=[7])
    (scan,) = _scans(rolled.gm)
    body, init, xs, invariants = scan.args
    assert len(init) == 1 and len(xs) == 1 and len(invariants) == 1  # h; x_t; W


def two_states_mixed_slices(a, b, c):
    """Two carries, slices written three ways (dim 0, x[..., t], select), an offset start, stack at dim -1."""
    s, u, outs = a.new_zeros(a.shape[1]), a.new_ones(a.shape[1]), []
    for t in range(2, a.shape[0]):
        s = s * 0.5 + a[t] * u
        u = u + b[..., t].sin()
        outs.append(s - c.select(1, t))
    return torch.stack(outs, -1), s, u


def test_two_carries_and_every_slice_spelling_are_rolled():
    _check_rolled(two_states_mixed_slices, torch.randn(9, 4), torch.randn(4, 9), torch.randn(4, 9), steps=[7])


def states_per_head(x, W):
    """One state per head in a list, the heads a loop inside the loop over time; a per-step input read by every
    head (x_t.sin()), an invariant read by one; per step a stack over the heads (dim -1) and a cat (dim 0)."""
    states, ys, zs = [x.new_zeros(x.shape[0], x.shape[-1]) for _ in range(x.shape[2])], [], []
    for t in range(x.shape[1]):
        shared, yt, zt = x[:, t].sin(), [], []
        for h in range(x.shape[2]):
            states[h] = 0.9 * states[h] + shared[:, h] * (W if h == 0 else 1.0)
            yt.append(states[h].cos())
            zt.append(states[h][None])
        ys.append(torch.stack(yt, -1))
        zs.append(torch.cat(zt, 0))
    return torch.stack(ys, 1), torch.stack(zs, 0), *states


def test_independent_states_are_split_into_one_loop_each():
    rolled = _check_rolled(states_per_head, torch.randn(2, 6, 3, 4), torch.randn(4), steps=[6, 6, 6])
    for scan in _scans(rolled.gm):
        body, init, xs, invariants = scan.args
        assert len(init) == 1  # its own head's state alone


def two_states_stacked_apart(x):
    """Two independent states, each with its own stacked output."""
    s, u, ys, zs = x[:, 0] * 0, x[:, 0] * 0, [], []
    for t in range(x.shape[1]):
        s = s * 0.5 + x[:, t]
        u = u + x[:, t].exp()
        ys.append(s)
        zs.append(u.sin())
    return torch.stack(ys, 1), torch.stack(zs, 1)


def two_states_summed(x):
    """Two independent states whose per-step output is their values added (2·s + u): two loops, the sum taken
    after them on their stacked outputs."""
    s, u, ys = x[:, 0] * 0, x[:, 0] * 0, []
    for t in range(x.shape[1]):
        s = s * 0.5 + x[:, t]
        u = u + x[:, t].exp()
        ys.append(s * 2 + u)
    return torch.stack(ys, 1), s, u


def two_states_through_maximum(x):
    """Two independent states whose per-step output reads both through ``maximum``: one loop."""
    s, u, ys = x[:, 0] * 0, x[:, 0] * 0, []
    for t in range(x.shape[1]):
        s = s * 0.5 + x[:, t]
        u = u + x[:, t].exp()
        ys.append(torch.maximum(s, u))
    return torch.stack(ys, 1), s, u


def test_states_split_only_where_a_stack_or_a_sum_reads_both():
    _check_rolled(two_states_stacked_apart, torch.randn(3, 5), steps=[5, 5])
    _check_rolled(two_states_summed, torch.randn(3, 5), steps=[5, 5])
    _check_rolled(two_states_through_maximum, torch.randn(3, 5), steps=[5])


def two_loops(x):
    h, g = x[:, 0] * 0, x[:, 0] * 0
    for t in range(x.shape[1]):
        h = h + x[:, t].cos()
    for t in range(x.shape[1]):
        g = g * 0.9 + x[:, t] * h
    return h, g


def test_two_loops_in_one_graph_are_both_rolled():
    _check_rolled(two_loops, torch.randn(2, 6), steps=[6, 6])


def intermediate_read(x):
    h, seen = x[:, 0] * 0, 0
    for t in range(x.shape[1]):
        h = h * 0.9 + x[:, t]
        if t == 2:
            seen = h.sum()
    return h + seen


def test_state_read_midway_splits_the_loop_in_two():
    """Reading the state after step 2 ends one scan there; the second starts from its final carry."""
    _check_rolled(intermediate_read, torch.randn(3, 6), steps=[3, 3])


def number_differs(x):
    h = x[:, 0] * 0
    for t in range(x.shape[1]):
        h = h * (0.5 if t == 3 else 0.9) + x[:, t]
    return h


def step_differs(x):
    h = x[:, 0] * 0
    for t in range(x.shape[1]):
        h = (torch.tanh(h) if t == 3 else h) * 0.9 + x[:, t]
    return h


def random_step(x):
    h = x[:, 0] * 0
    for t in range(x.shape[1]):
        h = h * 0.9 + torch.rand_like(h) * x[:, t]
    return h


def test_what_is_not_one_loop_stays_unrolled():
    gm, _ = _dynamo_graph(random_step, torch.randn(3, 6))
    assert roll_loops(gm) is None


def test_a_step_that_differs_ends_one_loop_and_the_rest_is_rolled_again():
    """Step 3 takes tanh of the state first: steps 0-2 are one loop, the tanh stays as written, and steps 3-5 from
    the decay on are another."""
    _check_rolled(step_differs, torch.randn(3, 6), steps=[3, 3])


def test_a_number_that_differs_between_steps_is_read_per_step():
    """Step 3 multiplies by 0.5, the others by 0.9: one loop, the factor a [T] input of the scan."""
    _check_rolled(number_differs, torch.randn(3, 6), steps=[6])


def python_schedule(x):
    h = x[:, 0] * 0
    for t in range(x.shape[1]):
        h = h * (1 - 1 / (t + 2)) + x[:, t] / (t + 1)
    return h


def test_numbers_of_a_python_schedule_are_read_per_step():
    _check_rolled(python_schedule, torch.randn(3, 6), steps=[6])


def powers_of_a_step(x, a):
    """A discounted sum whose factor is a power of the step (γ^(t+1)), plus a term raised to the step's number
    and a number raised to a tensor that the step scales: exponents that differ at every step."""
    h, gamma = x[:, 0] * 0, torch.sigmoid(a)
    for t in range(x.shape[1]):
        h = gamma ** (t + 1) * h + torch.tanh(x[:, t]) ** (t + 2) + 0.5 ** (x[:, t].abs() * t)
    return h


def test_powers_that_differ_at_every_step_are_read_per_step():
    _check_rolled(powers_of_a_step, torch.randn(3, 6), torch.randn(3), steps=[6])


def exponent_changes_once(x):
    h = x[:, 0] * 0
    for t in range(x.shape[1]):
        h = h * 0.9 + x[:, t] ** (1 if t < 3 else 2)
    return h


def bound_differs(x):
    h = x[:, 0] * 0
    for t in range(x.shape[1]):
        h = h * 0.9 + x[:, t].clamp(max=1.0 if t < 3 else 2.0)
    return h


@pytest.mark.parametrize("fn", [exponent_changes_once, bound_differs], ids=["exponent", "clamp_bound"])
def test_a_number_that_changes_once_or_is_no_operand_of_arithmetic_ends_the_loop(fn):
    """An exponent that changes once (p of a schedule: a memory op takes one p, so each run is a loop of its own)
    and a clamp's bound are not read per step: steps 0-2 and 3-5 are two loops."""
    _check_rolled(fn, torch.randn(3, 6), steps=[3, 3])


def _outer(v, k):
    return v.unsqueeze(-1) * k.unsqueeze(-2)


def _read(M, q):
    return (M @ q.unsqueeze(-1)).squeeze(-1)


def decay_differs_at_step_three(q, k, v):
    """A Hebbian memory whose step 3 writes twice as strongly (a product more than the others)."""
    M, ys = torch.zeros(q.shape[0], v.shape[-1], k.shape[-1]), []
    for t in range(q.shape[1]):
        write = v[:, t, :, None] * k[:, t, None, :]
        M = 0.9 * M + (2.0 * write if t == 3 else write)
        ys.append((M @ q[:, t, :, None])[..., 0])
    return torch.stack(ys, 1), M


def decay_differs_at_step_three_with_helpers(q, k, v):
    """The same, the outer product and the read written as helpers."""
    M, ys = torch.zeros(q.shape[0], v.shape[-1], k.shape[-1]), []
    for t in range(q.shape[1]):
        write = _outer(v[:, t], k[:, t])
        M = 0.9 * M + (2.0 * write if t == 3 else write)
        ys.append(_read(M, q[:, t]))
    return torch.stack(ys, 1), M


@pytest.mark.parametrize("fn", [decay_differs_at_step_three, decay_differs_at_step_three_with_helpers],
                         ids=["inline", "helpers"])
def test_the_run_after_a_step_that_differs_starts_its_blocks_as_the_run_before(fn, fresh_dynamo):
    """Blocks starting inside step 3 may also prove a loop over the steps after it (its blocks rotated), which is
    no memory step; the run after the step is rolled with its blocks starting as the run before did, so both runs
    fuse, and what of step 3 is left as written is reported. (A step that differs from the others by a number
    alone is no longer one: the number is read per step.)"""
    args = [torch.randn(2, 7, 4) for _ in range(3)]
    got = torch.compile(fn, backend="hecate", options={"fallback": "eager"})(*args)
    report = hecate.last_report()
    assert report.count("linear_attention") == 2, str(report)
    assert all("rolled up 3 steps" in f.detail for f in report.fusions), str(report)
    assert len(report.misses) == 1 and "written out step by step" in report.misses[0].reason, str(report)
    for name, a, b in zip(("y", "M"), got, fn(*args)):
        assert_close(name, a, b, 1e-5)


def squashed_from_step_three(q, k, v):
    """A Hebbian memory for three steps, then one kept through tanh: the second loop is no memory step."""
    M, ys = torch.zeros(q.shape[0], v.shape[-1], k.shape[-1]), []
    for t in range(q.shape[1]):
        kept = 0.9 * M if t < 3 else 0.9 * torch.tanh(M)
        M = kept + v[:, t, :, None] * k[:, t, None, :]
        ys.append((M @ q[:, t, :, None])[..., 0])
    return torch.stack(ys, 1), M


def test_the_loops_that_fuse_stay_fused_beside_one_that_does_not(fresh_dynamo):
    """One rolled loop the passes cannot fuse used to send the whole graph back unrolled, losing the loop that
    fused: the loops that fused are rolled again alone, the other is compiled unrolled with its reason."""
    args = [torch.randn(2, 7, 4) for _ in range(3)]
    got = torch.compile(squashed_from_step_three, backend="hecate", options={"fallback": "eager"})(*args)
    report = hecate.last_report()
    assert report.count("linear_attention") == 1 and "rolled up 3 steps" in report.fusions[0].detail, str(report)
    assert len(report.misses) == 1 and "through tanh" in report.misses[0].reason, str(report)
    assert "compiled unrolled" in report.misses[0].reason, str(report)
    for name, a, b in zip(("y", "M"), got, squashed_from_step_three(*args)):
        assert_close(name, a, b, 1e-5)


def momentum_decay_differs_at_step_three(q, k, v):
    """Momentum whose step 3 writes the buffer twice as strongly (a product more than the others)."""
    M, S, ys = torch.zeros(q.shape[0], 4, 4), torch.zeros(q.shape[0], 4, 4), []
    for t in range(q.shape[1]):
        e = (M @ k[:, t, :, None])[..., 0] - v[:, t]
        gradient = e[..., None] * k[:, t, None, :]
        S = 0.9 * S + (2.0 * gradient if t == 3 else gradient)
        M = 0.95 * M - 0.1 * S
        ys.append((M @ q[:, t, :, None])[..., 0])
    return torch.stack(ys, 1), M


def test_both_runs_around_a_differing_momentum_step_fuse(fresh_dynamo):
    args = [torch.randn(2, 7, 4) for _ in range(3)]
    got = torch.compile(momentum_decay_differs_at_step_three, backend="hecate", options={"fallback": "eager"})(*args)
    report = hecate.last_report()
    assert report.count("memory_scan") == 2, str(report)
    assert all("β=0.9" in f.detail and "read before" not in f.detail for f in report.fusions), str(report)
    for name, a, b in zip(("y", "M"), got, momentum_decay_differs_at_step_three(*args)):
        assert_close(name, a, b, 1e-5)


def in_place(x):
    """In-place updates of a tensor nothing else aliases: made functional, then rolled."""
    h, ys = x[:, 0] * 0, []
    for t in range(x.shape[1]):
        h = h * 0.9
        h.add_(x[:, t])
        h -= 0.1 * x[:, t]
        ys.append(h.clone())
    return torch.stack(ys, 1), h


def in_place_on_an_input(x, h):
    for t in range(x.shape[1]):
        h.mul_(0.9).add_(x[:, t])  # mutates the caller's tensor: must stay as it is
    return h


def slices_every_spelling(x, g):
    """x[:, t] read at each use, x[:, t, None], narrow, g[:, t, None], g[:, t:t + 1, None], outputs collected by
    cat."""
    h, ys = x[:, 0] * 0, []
    for t in range(x.shape[1]):
        h = h * g[:, t, None] + x[:, t] * x[:, t] + x.narrow(1, t, 1).squeeze(1) + x[:, t:t + 1, :][:, 0] \
            + g[:, t:t + 1, None][:, 0]
        ys.append((h * x[:, t]).unsqueeze(1))
    return torch.cat(ys, dim=1), h


def test_in_place_updates_are_made_functional_and_rolled():
    _check_rolled(in_place, torch.randn(3, 6, 2), steps=[6])


def test_in_place_update_of_an_input_is_left_alone():
    gm, _ = _dynamo_graph(in_place_on_an_input, torch.randn(3, 6), torch.randn(3))
    assert roll_loops(gm) is None


def test_every_slice_spelling_and_cat_are_rolled_with_one_input_per_tensor():
    rolled = _check_rolled(slices_every_spelling, torch.randn(3, 5, 4), torch.rand(3, 5), steps=[5])
    (scan,) = _scans(rolled.gm)
    assert len(scan.args[2]) == 2  # x and g, each sliced once per step however often it is read


def test_loop_in_an_aten_graph_is_rolled():
    """torch.export hands over ATen graphs: per-step inputs are aten.select / aten.slice, outputs aten.stack."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def fn(x, h, W):
        ys = []
        for t in range(x.shape[1]):
            h = torch.tanh(h @ W + x[:, t] + x[:, t:t + 1, 0])
            ys.append(h)
        return torch.stack(ys, dim=1), h

    args = (torch.randn(3, 5, 4), torch.randn(3, 4), torch.randn(4, 4))
    gm = make_fx(fn, tracing_mode="fake")(*args)
    assert torch.ops.aten.select.int in [n.target for n in gm.graph.nodes]
    rolled = roll_loops(gm)
    assert rolled is not None and rolled.steps == [5]
    for a, b in zip(rolled.gm(*args), fn(*args)):
        assert_close("output", a, b, 1e-6)


def test_loop_in_an_exported_graph_of_dynamic_batch_is_rolled():
    """Under a dynamic batch torch.export writes ``x[:, t]`` as a whole-dim slice then a select, and
    sizes are symbolic: still one loop."""
    class Loop(torch.nn.Module):
        def forward(self, x, h, W):
            ys = []
            for t in range(x.shape[1]):
                h = torch.tanh(h @ W + x[:, t])
                ys.append(h)
            return torch.stack(ys, dim=1), h

    args = (torch.randn(3, 5, 4), torch.randn(3, 4), torch.randn(4, 4))
    batch = torch.export.Dim("batch")
    program = torch.export.export(Loop(), args, dynamic_shapes=({0: batch}, {0: batch}, None))
    assert torch.ops.aten.slice.Tensor in [n.target for n in program.graph.nodes]
    assert not isinstance(program.graph.find_nodes(op="placeholder")[0].meta["val"].shape[0], int)
    rolled = roll_loops(normalize_graph(program.graph_module))  # as the export path does
    assert rolled is not None and rolled.steps == [5]
    for batch_size in (2, 7):
        args = (torch.randn(batch_size, 5, 4), torch.randn(batch_size, 4), torch.randn(4, 4))
        for a, b in zip(rolled.gm(*args), Loop()(*args)):
            assert_close("output", a, b, 1e-6)


def test_graph_traced_to_aten_does_not_grow_with_T():
    """What canonicalise re-traces and what the passes match on has one body, at any T."""
    model = LpMemory(8, n_heads=2, d_k=4, d_v=4, p=3.0, alpha=None, eta=None)
    sizes = []
    for T in (4, 16):
        gm, _ = _dynamo_graph(model, torch.randn(2, T, 8))
        rolled = roll_loops(gm)
        assert rolled is not None and rolled.steps == [T]
        sizes.append((len(gm.graph.nodes), len(rolled.gm.graph.nodes)))
    (short_unrolled, short_rolled), (long_unrolled, long_rolled) = sizes
    assert long_unrolled > 3 * short_unrolled  # Dynamo's graph grows with T ...
    assert short_rolled == long_rolled  # ... the rolled one does not


def test_rolled_loop_that_no_pass_fuses_is_compiled_unrolled(fresh_dynamo):
    """A scan would reach the fallback unfused (Inductor cannot compile it on CPU): compile it unrolled. An RNN
    forms no outer product, so it is no memory loop and the report says nothing of it (a Q-flow's belief
    updates neither)."""
    x, h, W = torch.randn(2, 5, 4), torch.randn(2, 4), torch.randn(4, 4)
    gm, inputs = _dynamo_graph(rnn, x, h, W)
    aten_gm, report = fuse(gm, inputs, parse_options({"fallback": "eager"}))
    assert not _scans(aten_gm)
    assert report.fusions == [] and report.misses == [] and report.graphs == 1, str(report)
    expected = rnn(x, h, W)
    got = torch.compile(rnn, backend="hecate")(x, h, W)  # Inductor compiles the unrolled graph
    for a, b in zip(got, expected):
        assert_close("rnn output", a, b, 1e-5)


def _written_then_read_by_every_step(h, w):
    """A tensor written by item assignment, then read by every step: ``z`` is set before ``cat`` reads it."""
    z = torch.zeros(h.shape[0], 2, h.shape[2])
    z[:, 0] = 1.0
    padded = torch.cat([z, h], 1)
    return sum(w[:, k] * padded[:, k:k + h.shape[1]] for k in range(3))


def test_what_steps_share_is_not_moved_before_a_write_it_reads(fresh_dynamo):
    """The steps' shared ``cat`` is computed after the item assignment into what it joins, as written (moved
    before the loop it read the zeros before the write: 0.4 to 4.9 off)."""
    h, w = torch.randn(2, 6, 4), torch.randn(4, 3)
    got = torch.compile(_written_then_read_by_every_step, backend="hecate", options={"fallback": "eager"})(h, w)
    assert_close("output", got, _written_then_read_by_every_step(h, w), 1e-6)


def test_memory_loop_is_fused_through_the_rolled_scan(fresh_dynamo):
    model = LpMemory(8, n_heads=2, d_k=4, d_v=4, p=2.0, momentum=0.5)
    gm, inputs = _dynamo_graph(model, torch.randn(2, 9, 8))
    aten_gm, report = fuse(gm, inputs, parse_options({"fallback": "eager"}))
    assert not _scans(aten_gm)
    assert [n.target for n in aten_gm.graph.nodes].count(torch.ops.hecate.memory_scan.default) == 1
    (fusion,) = [f for f in report.fusions if f.pattern == "memory_scan"]
    assert fusion.detail.endswith("loop rolled up 9 steps"), fusion.detail


def test_loop_rolling_is_skipped_without_the_memory_patterns(fresh_dynamo):
    """Rolling serves only the scan-fusing passes; without them the graph is traced as Dynamo gave it."""
    model = LpMemory(8, n_heads=2, d_k=4, d_v=4)
    gm, inputs = _dynamo_graph(model, torch.randn(2, 5, 8))
    aten_gm, report = fuse(gm, inputs, parse_options({"fallback": "eager", "patterns": ["qk_preprocess"]}))
    assert not _scans(aten_gm) and report.count("memory_scan") == 0
    assert [n.target for n in aten_gm.graph.nodes].count(torch.ops.aten.select.int) >= 5 * 3  # k, v, q per step


def test_rolled_graph_that_cannot_be_traced_is_compiled_unrolled_and_reported(monkeypatch):
    import hecate.compiler.pipeline as pipeline

    model = LpMemory(8, n_heads=2, d_k=4, d_v=4)
    gm, inputs = _dynamo_graph(model, torch.randn(2, 5, 8))
    real = pipeline.canonicalize

    def failing_on_scans(graph_module, example_inputs):
        if _scans(graph_module):
            raise RuntimeError("scan body rejected")
        return real(graph_module, example_inputs)

    monkeypatch.setattr(pipeline, "canonicalize", failing_on_scans)
    aten_gm, report = fuse(gm, inputs, parse_options({"fallback": "eager"}))
    assert report.count("memory_scan") == 0  # the passes fuse rolled loops only
    (miss,) = [m for m in report.misses if m.pattern == "loops"]
    assert "RuntimeError: scan body rejected" in miss.reason and "compiled unrolled" in miss.reason
    assert [m for m in report.misses if m.pattern == "memory_scan" and "written out step by step" in m.reason]


def delta_rule_by_einsum(k, v, q):
    """The p = 2 memory step spelled with einsum, one head, a fixed step size."""
    M, ys = k.new_zeros(k.shape[0], v.shape[-1], k.shape[-1]), []
    for t in range(k.shape[1]):
        e = torch.einsum("bvk,bk->bv", M, k[:, t]) - v[:, t]
        M = M - 0.1 * torch.einsum("bv,bk->bvk", 2 * e, k[:, t])
        ys.append(torch.einsum("bvk,bk->bv", M, q[:, t]))
    return torch.stack(ys, 1), M


def test_memory_step_spelled_with_einsum_is_fused_through_the_rolled_scan(fresh_dynamo):
    k, v, q = torch.randn(2, 6, 3), torch.randn(2, 6, 4), torch.randn(2, 6, 3)
    expected = delta_rule_by_einsum(k, v, q)
    got = torch.compile(delta_rule_by_einsum, backend="hecate", options={"fallback": "eager"})(k, v, q)
    report = hecate.last_report()
    assert report.count("memory_scan") == 1 and not report.misses, str(report)
    for a, b in zip(got, expected):
        assert_close("output", a, b, 1e-5)


def rnn_input_first(x, h, W):
    """The RNN step reading its per-step input first (a step of one starts at its first per-step slice)."""
    ys = []
    for t in range(x.shape[1]):
        h = torch.tanh(x[:, t] + h @ W)
        ys.append(h * 2)
    return torch.stack(ys, dim=1), h


def test_rnn_of_one_step_is_rolled_into_a_scan_of_one():
    """``for t in range(1)`` leaves one copy of the step: the stack of its one output and the state read
    after it (paired with the one input of its shape) still make it a loop."""
    rolled = _check_rolled(rnn_input_first, torch.randn(3, 1, 5), torch.randn(3, 5), torch.randn(5, 5), steps=[1])
    (scan,) = _scans(rolled.gm)
    _, init, xs, invariants = scan.args
    assert len(init) == 1 and len(xs) == 1 and len(invariants) == 1  # h; x_t; W


def test_one_step_whose_carries_cannot_be_told_apart_stays_unrolled():
    """With momentum the step reads two states of M's shape (M and S): which one M's next value
    continues is not in the graph, so the step is left as written (and reported, below)."""
    model = LpMemory(8, n_heads=2, d_k=4, d_v=4, p=2.0, momentum=0.5)
    gm, _ = _dynamo_graph(model, torch.randn(2, 1, 8))
    assert roll_loops(gm) is None


def test_straight_line_code_is_not_a_loop_of_one():
    """A stack of one output of a slice x[:, 0] of a size-1 dim, but no state carried through: not a loop."""
    def fn(x, h):
        return torch.stack([torch.tanh(x[:, 0])], 1), h * 2

    gm, _ = _dynamo_graph(fn, torch.randn(3, 1, 4), torch.randn(3, 4))
    assert roll_loops(gm) is None


def test_one_token_memory_forward_is_fused_as_a_loop_of_one(fresh_dynamo):
    """A one-token forward of the loop form is a memory_scan of one step: outputs and gradients match eager."""
    torch.manual_seed(0)
    model = LpMemory(8, n_heads=2, d_k=4, d_v=4, p=3.0, alpha=None, eta=None)
    x = torch.randn(2, 1, 8, requires_grad=True)
    expected = model(x)
    expected_grads = torch.autograd.grad(expected[0].square().sum() + expected[1].sum(), [x, *model.parameters()])
    got = torch.compile(model, backend="hecate", options={"fallback": "eager"})(x)
    report = hecate.last_report()
    (fusion,) = [f for f in report.fusions if f.pattern == "memory_scan"]
    assert fusion.detail.endswith("loop rolled up 1 step"), fusion.detail
    assert not report.misses, str(report)
    grads = torch.autograd.grad(got[0].square().sum() + got[1].sum(), [x, *model.parameters()])
    for name, a, b in zip(("out", "M"), got, expected):
        assert_close(name, a, b, 1e-5)
    for (name, _), a, b in zip([("x", x), *model.named_parameters()], grads, expected_grads):
        assert_close(f"grad {name}", a, b, 1e-5)


def two_memories_decoding_one_token(x, S, M, W1, W2):
    """A decode step of two layers, a Hebbian memory and then a delta rule reading its output, each with its
    projections, each state passed in and returned side by side (two returned tensors of one shape)."""
    q, k, v = (x @ W1).chunk(3, -1)
    ys = []
    for t in range(x.shape[1]):
        S = 0.9 * S + v[:, t, :, None] * k[:, t, None, :]
        ys.append((S @ q[:, t, :, None])[..., 0])
    q, k, v = (torch.stack(ys, 1) @ W2).chunk(3, -1)
    k, zs = F.normalize(k, dim=-1), []
    for t in range(x.shape[1]):
        M = M - 0.5 * ((M @ k[:, t, :, None])[..., 0] - v[:, t])[..., None] * k[:, t, None, :]
        zs.append((M @ q[:, t, :, None])[..., 0])
    return torch.stack(zs, 1), S, M


def test_a_decode_step_of_two_memory_layers_fuses_both(fresh_dynamo):
    """Each layer's loop is a loop of one step. The two states returned side by side were read as the steps'
    outputs stacked, so each step had two outputs (probe r39 c19); and the read's ``[..., 0]`` of a size-1 dim
    was taken for the step's first per-step slice, so the step began there. Neither fused; both do now."""
    args = [torch.randn(2, 1, 3), torch.randn(2, 3, 3), torch.randn(2, 3, 3), torch.randn(3, 9), torch.randn(3, 9)]
    xc, xe = ([a.clone().requires_grad_() for a in args] for _ in range(2))
    got = torch.compile(two_memories_decoding_one_token, backend="hecate", options={"fallback": "eager"})(*xc)
    report = hecate.last_report()
    assert report.count("linear_attention") == 1 and report.count("memory_scan") == 1 and not report.misses, \
        str(report)
    assert_outputs_and_gradients_close(got, two_memories_decoding_one_token(*xe), xc, xe, 1e-5)


def normalised_hebbian_decoding_one_token(x, M, z, W):
    """A linear transformer's decode step: the memory's decay written first in its line, so ``0.9 * M`` is computed
    before the step's first slice, and the normaliser's after it."""
    q, k, v = (x @ W).chunk(3, -1)
    q, k = F.elu(q) + 1, F.elu(k) + 1
    ys = []
    for t in range(x.shape[1]):
        M = 0.9 * M + v[:, t, :, None] * k[:, t, None, :]
        z = 0.9 * z + k[:, t]
        ys.append((M @ q[:, t, :, None]).squeeze(-1) / (z * q[:, t]).sum(-1, keepdim=True))
    return torch.stack(ys, 1), M, z


def test_a_one_token_step_whose_state_is_decayed_before_its_first_slice_fuses_with_its_normaliser(fresh_dynamo):
    """The decay ``0.9 * M`` computed before the step's first slice was left outside the step of one: the step
    started from 0.9·M and kept M whole, so its normaliser z ← 0.9·z + k no longer had the memory's decay and it
    was reported as not one (probe r42 c19). The scaling belongs to the step."""
    args = [torch.randn(2, 1, 3), torch.randn(2, 3, 3), torch.rand(2, 3) + 1, torch.randn(3, 9)]
    xc, xe = ([a.clone().requires_grad_() for a in args] for _ in range(2))
    got = torch.compile(normalised_hebbian_decoding_one_token, backend="hecate", options={"fallback": "eager"})(*xc)
    report = hecate.last_report()
    assert [f.detail for f in report.fusions] == [
        "Hebbian M ← α M + v φ(k)ᵀ, normalised by z ← α z + φ(k); chunked at T >= 64; loop rolled up 1 step"], \
        str(report)
    assert not report.misses, str(report)
    assert_outputs_and_gradients_close(got, normalised_hebbian_decoding_one_token(*xe), xc, xe, 1e-5)


def test_one_token_memory_forward_with_momentum_is_reported_as_a_single_step(fresh_dynamo):
    model = LpMemory(8, n_heads=2, d_k=4, d_v=4, p=2.0, momentum=0.5)
    x = torch.randn(2, 1, 8)
    got = torch.compile(model, backend="hecate", options={"fallback": "eager"})(x)
    report = hecate.last_report()
    assert report.count("memory_scan") == 0
    (miss,) = [m for m in report.misses if m.pattern == "memory_scan"]
    assert "there is a single step (a loop over one token), or the steps are written out by hand" in miss.reason \
        and "compiled as written" in miss.reason
    for name, a, b in zip(("out", "M"), got, model(x)):
        assert_close(name, a, b, 1e-6)


def _delta_rule_reads(q, k, v):  # each step's read returned apart, as a list
    memory, ys = q.new_zeros(q.shape[0], v.shape[-1], k.shape[-1]), []
    for qt, kt, vt in zip(q.unbind(1), k.unbind(1), v.unbind(1)):
        memory = memory - 0.3 * torch.einsum("bv,bk->bvk", torch.einsum("bvk,bk->bv", memory, kt) - vt, kt)
        ys.append(memory @ qt[..., None])
    return ys


def _hebbian_reads(q, k, v):
    q, k = torch.nn.functional.elu(q) + 1, torch.nn.functional.elu(k) + 1
    memory, ys = q.new_zeros(q.shape[0], v.shape[-1], k.shape[-1]), []
    for t in range(k.shape[1]):
        memory = memory + torch.einsum("be,bd->bed", v[:, t], k[:, t])
        ys.append(torch.einsum("bed,bd->be", memory, q[:, t]))
    return tuple(ys)


@pytest.mark.parametrize("fn,pattern", [(_delta_rule_reads, "memory_scan"), (_hebbian_reads, "linear_attention")],
                         ids=["delta_rule", "hebbian"])
def test_a_loop_whose_reads_are_returned_apart_is_fused(fn, pattern, fresh_dynamo):
    """``return ys`` (a list or tuple of the steps' reads, not stacked): the rolled copy returns the scan's stacked
    reads sliced, ``stack(ys).select(0, t)`` (probe r28: reported as an intermediate state read outside the loop)."""
    torch.manual_seed(0)
    args = [torch.randn(2, 6, 4), torch.randn(2, 6, 4), torch.randn(2, 6, 5)]
    got_args, ref_args = ([a.clone().requires_grad_() for a in args] for _ in range(2))
    got = torch.compile(fn, backend="hecate", options={"fallback": "eager", "strict": True})(*got_args)
    report = hecate.last_report()
    assert report.count(pattern) == 1 and not report.misses, str(report)
    ref = fn(*ref_args)
    assert len(got) == len(ref) == 6
    for t, (g, r) in enumerate(zip(got, ref)):
        assert_close(f"read {t}", g, r, 1e-5)
    weights = [torch.randn(r.shape) for r in ref]
    loss = lambda ys: sum((y * w).sum() for y, w in zip(ys, weights))  # noqa: E731
    for name, g, r in zip("qkv", torch.autograd.grad(loss(got), got_args), torch.autograd.grad(loss(ref), ref_args)):
        assert_close(f"d/d{name}", g, r, 1e-5)


def test_tensors_returned_apart_outside_a_loop_are_returned_as_computed(fresh_dynamo, tmp_path):
    """Two returned tensors of one shape that no loop computes: the graph compiled returns them as they are (the
    stack the rolling tries is undone)."""
    def fn(x, w):
        return x @ w, (x @ w.T).relu()

    torch.compile(fn, backend="hecate", options={"fallback": "eager", "dump_dir": str(tmp_path)})(
        torch.randn(3, 4), torch.randn(4, 4))
    dumps = sorted(tmp_path.glob("*.txt"))
    assert dumps and not any("stack" in d.read_text() or "select" in d.read_text() for d in dumps), \
        [d.name for d in dumps]


def test_views_of_an_input_returned_beside_a_rolled_loop_stay_views(fresh_dynamo):
    """Returned views of an input are left out of the stack the rolling makes of returned tensors: a view is
    returned as one (writing into it writes into the input), as in eager."""
    def fn(x, k):
        memory, ys = x.new_zeros(2, 4, 4), []
        for t in range(x.shape[1]):
            memory = memory + x[:, t, :, None] * k[:, t, None, :]
            ys.append(memory @ k[:, t, :, None])
        return torch.stack(ys, 1), x[:, 0], x[:, 1]

    x, k = torch.randn(2, 5, 4), torch.randn(2, 5, 4)
    _, first, second = torch.compile(fn, backend="hecate", options={"fallback": "eager", "strict": True})(x, k)
    assert hecate.last_report().count("linear_attention") == 1, str(hecate.last_report())
    assert first._base is x and second._base is x
