"""FSDP2 (``fully_shard``): Hecate-compiled models train on 2 ranks as one process does.

Each rank shards the model's parameters over a 2-rank CPU mesh (gloo), compiles it with
``backend="hecate"`` and trains 2 SGD steps on its half of the batch. FSDP2's all-gathers
and reshards run in its module hooks, outside the captured graph (Dynamo's default
``skip_fsdp_hooks``), so the passes see the same graph as without FSDP. Gradients and
parameters are gathered (``full_tensor``) and compared with the eager model trained in
this process on the whole batch.
"""

import functools

import pytest
import torch

import hecate
from hecate.compiler.distributed import collect_reports
from tests.distributed.harness import CASES, assert_trains_like, local_batch, run_on_ranks, shard, train


def _train_fsdp(rank, world_size, case_name):
    case = CASES[case_name]
    model = shard(case.build(), world_size)
    compiled = torch.compile(model, backend="hecate", options={"fallback": "eager"})
    with collect_reports() as report:
        result = train(model, compiled, local_batch(case.batch(), rank, world_size), case.loss)
    return {**result, "report": report}


@pytest.mark.parametrize("case_name", ["lp_memory", "pure_fep"])
def test_fsdp2_trains_like_one_process_and_fuses_on_every_rank(case_name):
    case = CASES[case_name]
    batch = local_batch(case.batch(), 0, 2)
    expected = sorted((f.pattern, f.detail) for f in hecate.explain(functools.partial(case.loss, case.build()), batch).fusions)
    model = case.build()
    reference = train(model, model, case.batch(), case.loss)
    for rank in run_on_ranks(_train_fsdp, case_name):
        assert sorted((f.pattern, f.detail) for f in rank["report"].fusions) == expected
        assert {f.pattern for f in rank["report"].fusions} >= set(case.patterns)
        assert_trains_like(rank, reference)
