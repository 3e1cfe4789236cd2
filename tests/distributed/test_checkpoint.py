"""torch.distributed.checkpoint: save from 2 ranks, load into 1 process, train on.

Two ranks train the FSDP2-sharded, Hecate-compiled LpMemory for 2 Adam steps and save
model and optimizer (each rank writes its shards). One process, with no process group,
loads the checkpoint into the plain model and a fresh optimizer and trains 2 more steps,
compiled with Hecate. Its losses must be those of one process trained 4 steps without
interruption.
"""

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from tests.distributed.harness import CASES, local_batch, rel, run_on_ranks, shard

CASE = CASES["lp_memory"]
OPTIONS = {"fallback": "eager"}


def _adam(model):
    return torch.optim.Adam(model.parameters(), lr=1e-2)


def _steps(model, forward, optimizer, batch, steps):
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = CASE.loss(forward, batch)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _train_and_save(rank, world_size, checkpoint_dir):
    model = shard(CASE.build(), world_size)
    optimizer = _adam(model)
    compiled = torch.compile(model, backend="hecate", options=OPTIONS)
    losses = _steps(model, compiled, optimizer, local_batch(CASE.batch(), rank, world_size), 2)
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=checkpoint_dir)
    return losses


def test_checkpoint_saved_by_2_ranks_resumes_in_1_process_with_the_uninterrupted_losses(tmp_path):
    rank_losses = run_on_ranks(_train_and_save, str(tmp_path))

    model = CASE.build()
    optimizer = _adam(model)
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(tmp_path))  # no process group: one process reads every shard
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    compiled = torch.compile(model, backend="hecate", options=OPTIONS)
    resumed = _steps(model, compiled, optimizer, CASE.batch(), 2)

    torch._dynamo.reset()
    model = CASE.build()
    uninterrupted = _steps(model, model, _adam(model), CASE.batch(), 4)

    # the global batch's loss is the mean of the two equal halves'
    before = [sum(step) / 2 for step in zip(*rank_losses)]
    for got, want in zip(before + resumed, uninterrupted, strict=True):
        assert rel(torch.tensor(got), torch.tensor(want)) <= 1e-5, (before + resumed, uninterrupted)
    # each step moves the loss by far more than the tolerance, so resuming from the wrong step shows
    assert all(rel(torch.tensor(a), torch.tensor(b)) > 1e-2 for a, b in zip(uninterrupted, uninterrupted[1:]))
