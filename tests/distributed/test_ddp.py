"""DDP: Hecate-compiled models train on 2 ranks as one process does on the global batch.

Each test spawns 2 ranks (gloo, CPU). Every rank wraps the model in
``DistributedDataParallel``, compiles it with ``backend="hecate"``, trains 2 SGD steps on
its half of the batch and sends back its gradients, parameters and fusion report. The
reference is the eager model trained in this process on the whole batch.
"""

import collections
import functools

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import hecate
from hecate.compiler.distributed import collect_reports
from tests.distributed.harness import (CASES, WIDE_CASES, assert_trains_like, local_batch, rel,
                                       run_on_ranks, train)


def _train_ddp(rank, world_size, case_name, wide, bucket_cap_mb, options, optimize_ddp=True):
    torch._dynamo.config.optimize_ddp = optimize_ddp
    case = (WIDE_CASES if wide else CASES)[case_name]
    model = case.build()
    compiled = torch.compile(DDP(model, bucket_cap_mb=bucket_cap_mb), backend="hecate", options=options)
    with collect_reports() as report:
        result = train(model, compiled, local_batch(case.batch(), rank, 2), case.loss)
    return {**result, "report": report}


def _reference(case):
    model = case.build()
    return train(model, model, case.batch(), case.loss)


def _fusions(report):
    return sorted((f.pattern, f.detail) for f in report.fusions)


@pytest.mark.parametrize("case_name", list(CASES))
def test_ddp_trains_like_one_process_and_fuses_on_every_rank(case_name):
    case = CASES[case_name]
    ranks = run_on_ranks(_train_ddp, case_name, False, None, {"fallback": "eager"})
    # what one process fuses in the model on a rank's share of the batch
    expected = _fusions(hecate.explain(functools.partial(case.loss, case.build()), local_batch(case.batch(), 0, 2)))
    assert {p for p, _ in expected} >= set(case.patterns)
    reference = _reference(case)
    for rank in ranks:
        assert rank["report"].graphs == 1  # default 25 MiB buckets: DDP does not split these models
        assert _fusions(rank["report"]) == expected
        assert_trains_like(rank, reference)


SPLIT_MISS = "DDP split the pattern across buckets"


def _lost_to_split(report):
    return collections.Counter(m.pattern for m in report.misses if m.reason.startswith(SPLIT_MISS))


def _train_split_and_whole(rank, world_size):
    """The wide KeyQueryPreprocess with 1 MiB buckets (Inductor compiles the pieces), then with
    optimize_ddp=False (eager fallback)."""
    split = _train_ddp(rank, world_size, "qk_preprocess", True, 1, {"fallback": "inductor"})
    torch._dynamo.reset()
    whole = _train_ddp(rank, world_size, "qk_preprocess", True, 1, {"fallback": "eager"},
                       optimize_ddp=False)
    return split, whole


@pytest.mark.slow
def test_ddp_1mib_buckets_cut_a_qk_chain_the_report_says_so_and_optimize_ddp_false_keeps_it():
    case = WIDE_CASES["qk_preprocess"]
    expected = _fusions(hecate.explain(functools.partial(case.loss, case.build()), local_batch(case.batch(), 0, 2)))
    reference = _reference(case)
    for split, whole in run_on_ranks(_train_split_and_whole):
        # DDPOptimizer cuts the forward after k's projection: q's φ lands in the second graph
        assert split["report"].graphs == 2
        assert _lost_to_split(split["report"]) == {"qk_preprocess": 1}
        assert "optimize_ddp = False" in split["report"].misses[0].reason
        assert split["report"].count("qk_preprocess") == 2  # k's chain whole, q's up to SiLU
        assert _fusions(split["report"]) != expected
        assert_trains_like(split, reference)
        assert whole["report"].graphs == 1
        assert _fusions(whole["report"]) == expected and not whole["report"].misses
        assert_trains_like(whole, reference)


@pytest.mark.parametrize("case_name", ["lp_memory", "hebbian_memory", "pure_fep"])
def test_ddp_1mib_buckets_split_graph_trains_like_one_process_and_reports_every_lost_fusion(case_name):
    case = WIDE_CASES[case_name]
    expected = _fusions(hecate.explain(functools.partial(case.loss, case.build()), local_batch(case.batch(), 0, 2)))
    reference = _reference(case)
    for rank in run_on_ranks(_train_ddp, case_name, True, 1, {"fallback": "eager"}):
        report = rank["report"]
        assert report.graphs > 1
        # every fusion of the uncut graph is either made by a piece or reported as cut by DDP
        lost = collections.Counter(expected) - collections.Counter(_fusions(report))
        assert _lost_to_split(report) == collections.Counter(pattern for pattern, _ in lost.elements())
        assert_trains_like(rank, reference)
        if case_name != "pure_fep":  # the memory loop has no parameters inside: DDP never cuts it
            scan = case.patterns[-1]
            assert report.count(scan) == 1 and _lost_to_split(report)[scan] == 0


@pytest.fixture
def one_rank_group(tmp_path, fresh_dynamo):
    """A 1-rank gloo group in this process: DDP and its graph splitting run without spawning."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_ddp_split_check_that_fails_is_reported_and_the_pieces_still_compile(one_rank_group, monkeypatch):
    import hecate.compiler.distributed as distributed

    def broken(*args):
        raise RuntimeError("cannot inline")

    monkeypatch.setattr(distributed, "_fuse_whole", broken)
    case = WIDE_CASES["qk_preprocess"]
    model = case.build()
    compiled = torch.compile(DDP(model, bucket_cap_mb=1), backend="hecate", options={"fallback": "eager"})
    batch = case.batch()
    with collect_reports() as report:
        got = compiled(*batch)
    want = model(*batch)
    assert report.graphs == 2
    assert [m.pattern for m in report.misses] == ["ddp_split"]
    assert "could not fuse the graph DDP split as a whole" in report.misses[0].reason
    assert "RuntimeError: cannot inline" in report.misses[0].reason
    for g, w in zip(got, want, strict=True):
        assert rel(g, w) <= 1e-5
