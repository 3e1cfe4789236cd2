"""Spawn ranks for the distributed tests and the small training problems they share.

``run_on_ranks(fn, *args)`` starts ``world_size`` processes (gloo, CPU, a free local
port), runs ``fn(rank, world_size, *args)`` in each and returns what each rank returned
(saved with ``torch.save`` and loaded back here, so results may hold tensors and
fusion reports). A rank that raises makes ``mp.spawn`` raise in the test.

``CASES`` maps a model family of ``hecate.models`` to a tiny instance, a global batch
and its loss, so DDP, FSDP2 and the single-process reference train the same problem;
``WIDE_CASES`` the same with parameters large enough for DDP to split the graph.
``train`` runs the SGD steps every test compares, ``shard`` applies FSDP2.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from hecate.models.fep import PureFEPConfig, PureFEPTransformer
from hecate.models.memory import HebbianMemory, LpMemory
from hecate.models.short_conv import KeyQueryPreprocess


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, out_dir: str, fn: Callable, args: tuple) -> None:
    torch.set_num_threads(1)  # two ranks on a 2-core machine
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    try:
        torch.save(fn(rank, world_size, *args), os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()  # every rank's result is on disk
    except BaseException:
        dist.destroy_process_group()
        raise
    # Leave without the interpreter's teardown: once in a CI run a rank aborted there ("terminate called without
    # an active exception", a C++ thread still joinable in a destructor) after its result was saved, and
    # mp.spawn failed the test for it. The ranks' results are what the tests check, and they are saved.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_on_ranks(fn: Callable, *args, world_size: int = 2) -> list:
    """``[fn(0, world_size, *args), fn(1, world_size, *args), ...]``, each run in its own process."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_rank_main, args=(world_size, free_port(), out_dir, fn, args), nprocs=world_size)
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False)
                for r in range(world_size)]


@dataclass(frozen=True)
class Case:
    """A model family, a global batch (split along dim 0 between ranks) and its loss."""

    build: Callable[[], nn.Module]
    batch: Callable[[], tuple[torch.Tensor, ...]]
    loss: Callable[[nn.Module, tuple[torch.Tensor, ...]], torch.Tensor]  # mean over the batch
    patterns: tuple[str, ...]  # what the compiled model must fuse


def _mse_to_zero(model, batch):
    out, _ = model(*batch)
    return out.square().mean()


def _qk_loss(model, batch):
    q, k = model(*batch)
    return (q * k).sum(-1).mean()


def _fep_loss(model, batch):
    _, loss = model(*batch, return_logits=False)
    return loss


def _seeded(build):
    def seeded_build():
        torch.manual_seed(0)
        return build()
    return seeded_build


def _x(batch: int = 4, seq: int = 6, d: int = 16):
    return (0.5 * torch.randn(batch, seq, d, generator=torch.Generator().manual_seed(1)),)


def _token_ids(vocab_size: int = 16):
    ids = torch.randint(0, vocab_size, (4, 7), generator=torch.Generator().manual_seed(1))
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


# P-flow (train_step's no-grad prior updates) averages over the local batch, so it is
# left out here: these cases train the priors by backprop, which DDP/FSDP keep in sync.
FEP_CONFIG = PureFEPConfig(vocab_size=16, embed_dim=4, n_layers=1, max_seq_len=8, n_vfe_steps=2,
                           lr_prior=0.0, lr_token_prior=0.0)

CASES: dict[str, Case] = {
    "qk_preprocess": Case(_seeded(lambda: KeyQueryPreprocess(16, n_heads=2, phi="elu1")), _x, _qk_loss,
                          ("qk_preprocess",)),
    "lp_memory": Case(_seeded(lambda: LpMemory(16, n_heads=2, d_k=4, d_v=4, p=3.0, alpha=None, eta=0.02,
                                               phi="elu1")), _x, _mse_to_zero,
                      ("qk_preprocess", "memory_scan")),
    "hebbian_memory": Case(_seeded(lambda: HebbianMemory(16, n_heads=2, d_k=4, d_v=4, alpha=None,
                                                         normalise=True)), _x, _mse_to_zero,
                           ("qk_preprocess", "linear_attention")),
    "pure_fep": Case(_seeded(lambda: PureFEPTransformer(FEP_CONFIG)), _token_ids, _fep_loss,
                     ("kl_attention", "kl_decode")),
}


# The same families with projections and token priors of 1 MiB each (d_model = 1024,
# vocabulary 4096 × K 64): with bucket_cap_mb=1, the smallest bucket Dynamo's DDPOptimizer
# accepts (its first bucket is fixed at 1 MiB), DDP's graph splitting cuts these forwards
# into several graphs. The compute stays small (B·T = 12 tokens).
WIDE_FEP_CONFIG = PureFEPConfig(vocab_size=4096, embed_dim=64, n_layers=1, max_seq_len=8,
                                n_vfe_steps=1, lr_prior=0.0, lr_token_prior=0.0)

WIDE_CASES: dict[str, Case] = {
    "qk_preprocess": Case(_seeded(lambda: KeyQueryPreprocess(1024, d_key=256, n_heads=2, phi="elu1")),
                          lambda: _x(d=1024), _qk_loss, ("qk_preprocess",)),
    "lp_memory": Case(_seeded(lambda: LpMemory(1024, n_heads=32, d_k=8, d_v=8, p=3.0, alpha=None,
                                               eta=0.02, phi="elu1")),
                      lambda: _x(d=1024), _mse_to_zero, ("qk_preprocess", "memory_scan")),
    "hebbian_memory": Case(_seeded(lambda: HebbianMemory(1024, n_heads=32, d_k=8, d_v=8, alpha=None,
                                                         normalise=True)),
                           lambda: _x(d=1024), _mse_to_zero, ("qk_preprocess", "linear_attention")),
    "pure_fep": Case(_seeded(lambda: PureFEPTransformer(WIDE_FEP_CONFIG)),
                     lambda: _token_ids(WIDE_FEP_CONFIG.vocab_size), _fep_loss, ("kl_attention", "kl_decode")),
}


def train(model: nn.Module, forward: Callable, batch: tuple, loss: Callable, steps: int = 2) -> dict:
    """``steps`` of SGD; each step's gradients, the parameters after the last, the losses.

    ``forward`` is what runs the model (the model itself, or a compiled DDP/FSDP wrapper of it).
    """
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    grads, losses = [], []
    for _ in range(steps):
        optimizer.zero_grad()
        value = loss(forward, batch)
        value.backward()
        grads.append({name: full_tensor(p.grad).clone() for name, p in model.named_parameters()})
        losses.append(float(value))
        optimizer.step()
    params = {name: full_tensor(p.detach()).clone() for name, p in model.named_parameters()}
    return {"grads": grads, "params": params, "losses": losses}


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor: an FSDP2 shard (DTensor) all-gathered, anything else as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def assert_trains_like(result: dict, reference: dict, tol: float = 1e-5) -> None:
    """Every step's gradients and the final parameters within ``tol`` (relative) of the reference."""
    for step, (grads, ref_grads) in enumerate(zip(result["grads"], reference["grads"], strict=True)):
        for name, ref in ref_grads.items():
            assert rel(grads[name], ref) <= tol, f"step {step} grad {name}: rel {rel(grads[name], ref):.2e}"
    for name, ref in reference["params"].items():
        assert rel(result["params"][name], ref) <= tol, f"param {name}: rel {rel(result['params'][name], ref):.2e}"


def shard(model, world_size):
    """The memory layers shard their q/k block as its own unit; the FEP transformer reads its
    priors as attributes, not through a submodule's forward, so it is one unit."""
    mesh = init_device_mesh("cpu", (world_size,))
    if hasattr(model, "qk"):
        fully_shard(model.qk, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def local_batch(batch: tuple[torch.Tensor, ...], rank: int, world_size: int) -> tuple[torch.Tensor, ...]:
    """This rank's equal share of the global batch (dim 0)."""
    return tuple(t.chunk(world_size)[rank] for t in batch)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖."""
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))
