from hecate import FusionReport


def test_report_table_lists_fusions_and_misses():
    r = FusionReport(graphs=2)
    r.add_fusion("qk_preprocess", "hecate.qk_preprocess", 7, "linear → conv → silu")
    r.add_miss("qk_preprocess", "conv1d has groups=1; the pattern needs a depthwise conv", "conv1d_1")
    text = str(r)
    assert "1 fused, 1 not fused, 2 graph(s)" in text
    assert "hecate.qk_preprocess" in text and "linear → conv → silu" in text
    assert "groups=1" in text and "conv1d_1" in text
    assert r.count("qk_preprocess") == 1 and r.count("kl_attention") == 0


def test_extend_merges_graphs():
    a, b = FusionReport(graphs=1), FusionReport(graphs=1)
    b.add_miss("memory_scan", "p changes between steps")
    a.extend(b)
    assert a.graphs == 2 and len(a.misses) == 1
