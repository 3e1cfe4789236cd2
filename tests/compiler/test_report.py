import torch

import hecate
from hecate import FusionReport


def test_report_table_lists_fusions_and_misses():
    r = FusionReport(graphs=2)
    r.add_fusion("qk_preprocess", "hecate.qk_preprocess", 7, "linear → conv → silu")
    r.add_miss("qk_preprocess", "conv1d has groups=1; the pattern needs a depthwise conv", "conv1d_1")
    text = str(r)
    assert "1 fused, 1 not fused, 2 graph(s)" in text
    assert "hecate.qk_preprocess" in text and "linear → conv → silu" in text
    assert "groups=1" in text
    assert "graph nodes: conv1d_1" in text  # no source line known: the node names locate it
    assert r.count("qk_preprocess") == 1 and r.count("kl_attention") == 0


def _train_step_inside(model, opt, x):
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def test_a_graph_with_nothing_to_fuse_says_where_the_others_are(fresh_dynamo):
    """Probe r35: a training step compiled whole left last_report() with the optimizer's graph alone, "0 fused",
    nothing saying the forward had a report of its own."""
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.compile(_train_step_inside, backend="hecate", options={"fallback": "eager"})(model, opt, torch.randn(4, 3))
    report = hecate.last_report()
    assert not report.fusions and all(m.pattern == "hecate" for m in report.misses), str(report)
    assert "each has its own report; hecate.explain(fn, *args) reports them all" in str(report)
    fused = FusionReport(graphs=1)
    fused.add_fusion("kl_attention", "hecate.kl_attention", 9)
    assert "each has its own report" not in str(fused)


def test_extend_merges_graphs():
    a, b = FusionReport(graphs=1), FusionReport(graphs=1)
    b.add_miss("memory_scan", "p changes between steps")
    a.extend(b)
    assert a.graphs == 2 and len(a.misses) == 1


def _softmax_twice(x):
    y = torch.softmax(x, -1)
    return torch.softmax(y * 2, -1)


def test_miss_shows_the_users_source_line_not_node_names():
    """A miss made from graph nodes names the user's file and line; node names only in the verbose form."""
    report = FusionReport()

    def recording_backend(gm, example_inputs):
        softmaxes = [n for n in gm.graph.nodes if n.target is torch.softmax]
        report.add_miss("example", "the second softmax reads a scaled score", nodes=softmaxes[1:])
        return gm.forward

    torch._dynamo.reset()
    torch.compile(_softmax_twice, backend=recording_backend)(torch.randn(2, 3))
    torch._dynamo.reset()
    [miss] = report.misses
    assert miss.source.startswith("test_report.py:") and "torch.softmax(y * 2, -1)" in miss.source
    text = str(report)
    assert f"at {miss.source}" in text
    assert miss.where and miss.where not in text  # internal names stay out of the user's view
    assert f"graph nodes: {miss.where}" in report.format(verbose=True)


def test_report_shows_source_through_explain():
    """Through the real pipeline (ATen re-trace), a pass's miss still carries the user's line."""
    conv = torch.nn.Conv1d(4, 4, 3, groups=1, padding=2)

    def keys(x):
        return torch.nn.functional.silu(conv(x.transpose(1, 2))[..., : x.shape[1]]).transpose(1, 2)

    report = hecate.explain(keys, torch.randn(2, 5, 4), options={"patterns": ["qk_preprocess"]})
    misses = [m for m in report.misses if m.pattern == "qk_preprocess"]
    assert misses, str(report)
    assert all(m.source.startswith("test_report.py:") for m in misses), str(report)
    assert "conv(x.transpose(1, 2))" in str(report)


def _split_by_the_user(x):
    y = x.sin()
    torch._dynamo.graph_break()
    return y.cos()


def test_explain_says_why_dynamo_split_the_code(fresh_dynamo):
    report = hecate.explain(_split_by_the_user, torch.randn(3))
    assert report.graphs == 2 and report.graph_breaks == [
        "Call to `torch._dynamo.graph_break()`: User-inserted graph break. Message: None"], report.graph_breaks
    assert "Dynamo graph breaks" in str(report) and "torch._dynamo.graph_break()" in str(report)
    assert hecate.explain(lambda x: x.sin(), torch.randn(3)).graph_breaks == []


def _printing(x):
    y = x.sin()
    print("between the layers")
    return y.cos()


def test_a_graph_break_is_named_by_what_dynamo_could_not_trace(fresh_dynamo, capsys):
    """probe r36: a print gave only "Failed to trace builtin operator", naming neither print nor its line."""
    report = hecate.explain(_printing, torch.randn(3))
    assert report.graphs == 2 and len(report.graph_breaks) == 1 and "`print`" in report.graph_breaks[0], \
        report.graph_breaks


def _memory_loop_broken_at_every_step(q, k, v):
    S, outs = torch.zeros(2, 2, 4, 4), []
    for i in range(q.shape[2]):
        S = 0.9 * S + k[:, :, i, :, None] * v[:, :, i, None, :]
        torch._dynamo.graph_break()
        outs.append(torch.einsum("bhd,bhdm->bhm", q[:, :, i], S))
    return torch.stack(outs, 2)


def test_a_break_inside_a_loop_says_nothing_was_compiled(fresh_dynamo):
    """A graph break inside a loop makes Dynamo run the code eagerly: no graph, so no pass sees the memory loop;
    the report says so instead of standing empty (probe r18)."""
    report = hecate.explain(_memory_loop_broken_at_every_step, *[torch.randn(2, 2, 7, 4) for _ in range(3)])
    assert report.graphs == 0 and report.graph_breaks, str(report)
    assert "Dynamo compiled no graph" in str(report) and "out of the loop" in str(report), str(report)
    assert "Dynamo compiled no graph" not in str(hecate.explain(_split_by_the_user, torch.randn(3)))


def test_the_same_reason_at_the_same_line_is_shown_once_with_its_count():
    """Three runs of one loop rolled up apart (probe r12a) give three misses, shown as one line with "(3 places)";
    the misses themselves are all kept, and a miss without a source line is never merged."""
    from hecate.passes.report import Miss

    r = FusionReport(graphs=1)
    r.misses += [Miss("memory_scan", "not a memory step", f"scan_{i}", "model.py:7: S = S + v") for i in range(3)]
    r.misses += [Miss("memory_scan", "not a memory step", "scan_9"), Miss("memory_scan", "not a memory step", "x")]
    text = r.format(verbose=True)
    assert len(r.misses) == 5 and "5 not fused" in text
    assert text.count("not a memory step (3 places)") == 1 and text.count("at model.py:7") == 1
    assert "graph nodes: scan_0, scan_1, scan_2" in text
    assert text.count("not a memory step\n") == 2  # the two without a source line, apart


def _memory_by_autograd_grad(k, v, q):
    """Titans' memory as researchers first write it: the step is the autograd gradient of the memory's loss."""
    m, ys = torch.zeros(k.shape[0], k.shape[-1], k.shape[-1], requires_grad=True), []
    for t in range(k.shape[1]):
        loss = ((m @ k[:, t, :, None]).squeeze(-1) - v[:, t]).pow(2).sum()
        (g,) = torch.autograd.grad(loss, m, create_graph=True)
        m = m - 0.1 * g
        ys.append((m @ q[:, t, :, None]).squeeze(-1))
    return torch.stack(ys, 1)


def test_a_memory_stepped_by_autograd_grad_is_told_what_fuses(fresh_dynamo):
    """Dynamo does not trace torch.autograd.grad: the loop runs eagerly, and the report says to write the gradient
    in closed form (which fuses), besides Dynamo's own message."""
    report = hecate.explain(_memory_by_autograd_grad, *[torch.randn(2, 5, 4) for _ in range(3)])
    assert any("torch.autograd.grad" in r for r in report.graph_breaks), report.graph_breaks
    assert "write the gradient in closed form" in str(report) and "memory_scan" in str(report), str(report)
    # the same break in a Q-flow: its advice is a free energy's (probe r43: told of a memory's ‖M k − v‖² alone)
    assert "∂F/∂μ written with the β-weighted mean differences" in str(report) and "kl_attention" in str(report)
    assert "closed form" not in str(hecate.explain(_memory_loop_broken_at_every_step,
                                                   *[torch.randn(2, 2, 7, 4) for _ in range(3)]))


def _printing_in_a_checkpoint(x):
    return torch.utils.checkpoint.checkpoint(_printing, x, use_reentrant=False)


def test_a_break_inside_a_checkpoint_region_names_the_region(fresh_dynamo):
    """A print inside a checkpointed region: Dynamo runs the region whole as Python, no graph; the note names
    regions beside loops (probe r41: it spoke of a loop only)."""
    report = hecate.explain(_printing_in_a_checkpoint, torch.randn(3, requires_grad=True))
    assert report.graphs == 0 and report.graph_breaks, str(report)
    assert "one inside a torch.utils.checkpoint region" in str(report) and "out of the loop or region" in str(report)


def test_a_line_of_fx_generated_code_is_not_the_users():
    """torch.export re-traces a scan's body from its generated code: that frame, last in the trace, was named as
    the source (``<eval_with_key>.13:5: getitem = child_1[...]``). The line before it is the user's; with no
    other frame there is no line to give."""
    from hecate.passes.report import source_line

    user = 'File "/home/me/model.py", line 12, in step\n    M = M + v[:, :, None] * k[:, None, :]\n'
    generated = 'File "<eval_with_key>.13", line 5, in forward\n    getitem = child_1[(slice(None), None)]\n'
    node = torch.fx.Graph().placeholder("x")
    node.meta["stack_trace"] = user + generated
    assert source_line([node]) == "model.py:12: M = M + v[:, :, None] * k[:, None, :]"
    node.meta["stack_trace"] = generated
    assert source_line([node]) == ""
