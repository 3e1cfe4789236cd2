"""Where one training step of the FEP transformer spends its time, by kernel (torch.profiler).

The model and step are those of ``benchmarks/fep.py``'s ``train_step`` (1 layer, 2 Q-flow steps,
B = 1), compiled with ``backend="hecate"`` and ``fallback="eager"`` (Hecate's fusions, the rest
eager: it compiles in seconds) or with Inductor. Prints the profiler's table, sorted by the
device time each kernel takes itself, and writes it to ``--out`` when given.

    PYTHONPATH=. python3 benchmarks/profile_fep.py --device cuda --n 1024 --k 16 [--backend inductor]
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from hecate.models.fep import PureFEPConfig, PureFEPTransformer


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--n", type=int, default=1024)
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--backend", choices=("hecate", "inductor", "eager"), default="hecate")
    parser.add_argument("--steps", type=int, default=3, help="profiled steps (after 2 warm-up steps)")
    parser.add_argument("--rows", type=int, default=30)
    parser.add_argument("--out", help="also write the table to this file")
    args = parser.parse_args()

    config = PureFEPConfig(vocab_size=64, embed_dim=args.k, n_layers=1, max_seq_len=args.n, n_vfe_steps=2)
    torch.manual_seed(0)
    model = PureFEPTransformer(config).to(args.device)
    ids = torch.randint(0, 64, (1, args.n + 1), device=args.device)
    inputs, targets = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    if args.backend == "hecate":
        forward = torch.compile(model, backend="hecate", options={"fallback": "eager"})
    elif args.backend == "inductor":
        forward = torch.compile(model)
    else:
        forward = model

    def step():
        model.zero_grad(set_to_none=True)
        _, loss = forward(inputs, targets)
        loss.backward()

    for _ in range(2):
        step()
    if args.backend == "hecate":
        from hecate import last_report
        print(last_report())
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            step()
        if args.device == "cuda":
            torch.cuda.synchronize()
    sort = "self_cuda_time_total" if args.device == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=args.rows, max_name_column_width=70)
    title = f"{args.backend} train step, N={args.n} K={args.k}, {args.steps} steps, {args.device}"
    print(title)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(title + "\n" + table + "\n")


if __name__ == "__main__":
    main()
