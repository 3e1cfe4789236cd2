"""Train a Hecate-compiled memory layer on several processes: DDP or FSDP2.

    torchrun --nproc-per-node 2 examples/train_distributed.py           # DDP, CPU, gloo
    torchrun --nproc-per-node 2 examples/train_distributed.py --fsdp    # FSDP2 (fully_shard)

On a machine with GPUs the same command runs one process per GPU and uses NCCL
(``--nproc-per-node`` = the number of GPUs). Nothing in the model knows about it: the
model is ``hecate.models.memory.LpMemory`` (q/k projection → causal conv → SiLU → φ, and
the per-token l_p memory loop), wrapped as usual and compiled with ``backend="hecate"``.

Each rank trains on its own batches to read back, through the memory, the token seen
``--lag`` steps earlier (default 0: the current one), prints its fusion report (the graphs it compiled and what Hecate fused in them), and
rank 0 prints the loss averaged over the ranks. Under DDP, Dynamo cuts the forward at
gradient-bucket boundaries (``--bucket-cap-mb``); a cut through a pattern is listed in
the report with what to change.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from hecate.compiler.distributed import collect_reports
from hecate.models.memory import LpMemory


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fsdp", action="store_true", help="shard with FSDP2 instead of DDP")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank and step")
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--lag", type=int, default=0, help="the target at t is the input at t - lag")
    parser.add_argument("--bucket-cap-mb", type=float, default=None, help="DDP's gradient bucket size")
    parser.add_argument("--fallback", choices=("inductor", "eager"), default="inductor",
                        help="what compiles the rest of the graph")
    return parser.parse_args()


def batch(generator: torch.Generator, args: argparse.Namespace, device: torch.device):
    x = torch.randn(args.batch, args.seq_len, args.d_model, generator=generator).to(device)
    target = F.pad(x, (0, 0, args.lag, 0))[:, : args.seq_len]  # x shifted right by lag tokens
    return x, target


def main() -> None:
    args = parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    torch.manual_seed(0)  # the same initial weights on every rank
    model = LpMemory(args.d_model, n_heads=4, d_k=8, d_v=8, p=2.0, alpha=None, eta=0.02,
                     phi="elu1").to(device)
    if args.fsdp:
        mesh = init_device_mesh(device.type, (world_size,))
        fully_shard(model.qk, mesh=mesh)  # the q/k block is its own unit: gathered, used, resharded
        wrapped = fully_shard(model, mesh=mesh)
    else:
        wrapped = DDP(model, device_ids=[device.index] if cuda else None, bucket_cap_mb=args.bucket_cap_mb)
    compiled = torch.compile(wrapped, backend="hecate", options={"fallback": args.fallback})
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(1000 + rank)  # each rank its own data

    start = time.perf_counter()
    with collect_reports() as report:
        for step in range(args.steps):
            x, target = batch(generator, args, device)
            out, _ = compiled(x)
            loss = F.mse_loss(out, target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss)
            if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
                print(f"step {step:4d}  loss {mean_loss.item() / world_size:.4f}  "
                      f"({time.perf_counter() - start:.1f} s)", flush=True)

    reports = [None] * world_size
    dist.all_gather_object(reports, str(report))
    if rank == 0:
        wrapper = "FSDP2" if args.fsdp else "DDP"
        for r, text in enumerate(reports):
            print(f"\n== rank {r} ({wrapper}, {device.type}) ==\n{text}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
