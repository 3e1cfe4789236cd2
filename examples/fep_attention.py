"""What the Pure FEP transformer attends to: β maps per layer and Q-flow step (Phase 4.3).

Loads the model trained by examples/fep_sweep.py (``examples/results/fep_sweep_best.pt``), runs
a sample sentence through it (eager, no targets) and draws ``β_ij = softmax_j(−KL(q_i‖q_j)/κ)``
for every layer (rows) and Q-flow step (columns), and reports the entropy of β per layer and
step beside that of uniform causal attention (what β would be if every earlier belief were
equally close).

    PYTHONPATH=. python3 examples/fep_attention.py
    PYTHONPATH=. python3 examples/fep_attention.py --text "def f(x): return x" --out examples/out

Writes ``fep_attention.png`` and ``fep_attention.json`` to ``--out`` (default examples/results).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

from hecate.models.fep import PureFEPConfig, PureFEPTransformer

HERE = os.path.dirname(os.path.abspath(__file__))
SAMPLE = "The return statement leaves the current function call."


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--weights", default=os.path.join(HERE, "results", "fep_sweep_best.pt"))
    p.add_argument("--text", default=SAMPLE)
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    return p.parse_args(argv)


def entropy(β):
    """Mean over rows (queries) of −Σ_j β_ij log β_ij, in nats; β = 0 contributes 0."""
    return float(-(β * torch.log(β.clamp_min(1e-30))).sum(-1).mean())


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if not os.path.exists(args.weights):
        raise SystemExit(f"--weights {args.weights!r} does not exist: run examples/fep_sweep.py first "
                         "(it saves its best model there)")
    saved = torch.load(args.weights)
    config = PureFEPConfig(**saved["config"])
    model = PureFEPTransformer(config)
    model.load_state_dict(saved["state_dict"])
    index = {c: i for i, c in enumerate(saved["chars"])}
    unknown = sorted(set(args.text) - set(index))
    if unknown:
        raise SystemExit(f"--text has characters the model's vocabulary lacks: {unknown}")
    text = args.text[: config.max_seq_len]
    ids = torch.tensor([[index[c] for c in text]])

    attention: list[list[torch.Tensor]] = []
    with torch.no_grad():
        model(ids, attention=attention)
    N = ids.shape[1]
    uniform = sum(math.log(i + 1) for i in range(N)) / N  # uniform over j ≤ i
    result = {"text": text, "config": config.to_dict(), "uniform_causal_entropy": uniform,
              "entropy": [[entropy(β[0]) for β in layer] for layer in attention]}
    for layer, row in enumerate(result["entropy"]):
        print(f"layer {layer}: entropy of β per Q-flow step {[round(h, 3) for h in row]} nats "
              f"(uniform causal: {uniform:.3f})")

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "fep_attention.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(attention, text, result, os.path.join(args.out, "fep_attention.png"))


def plot(attention, text, result, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, cols = len(attention), max(len(layer) for layer in attention)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 4.2 * rows), squeeze=False)
    labels = [c if c != " " else "␣" for c in text]
    for l, layer in enumerate(attention):
        for s in range(cols):
            ax = axes[l][s]
            if s >= len(layer):
                ax.axis("off")
                continue
            ax.imshow(layer[s][0].numpy(), cmap="viridis", vmin=0, vmax=1)
            ax.set_title(f"layer {l}, Q-flow step {s}: H = {result['entropy'][l][s]:.2f} nats", fontsize=9)
            ax.set_xticks(range(len(text)), labels, fontsize=5)
            ax.set_yticks(range(len(text)), labels, fontsize=5)
            ax.set_xlabel("key j", fontsize=8)
            ax.set_ylabel("query i", fontsize=8)
    fig.suptitle(f"β = softmax(−KL(q_i‖q_j)/κ); uniform causal entropy {result['uniform_causal_entropy']:.2f} nats")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
