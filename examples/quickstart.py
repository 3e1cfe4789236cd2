"""Hecate in one minute: compile a key/query preprocessing block, train a step, compare with eager.

    python examples/quickstart.py

The model is plain PyTorch (hecate/models/short_conv.py): for keys and queries, a projection,
a depthwise causal conv (kernel 4), SiLU and the feature map φ(x) = elu(x) + 1, split into heads.
``torch.compile(model, backend="hecate")`` replaces each of the two chains by one
``torch.ops.hecate.qk_preprocess`` call and compiles the rest with Inductor.
"""

import copy
import time

import torch

import hecate
from hecate.models.short_conv import KeyQueryPreprocess
from hecate.testing import rel_err


def train_step(model, x, target, lr=0.1):
    """One SGD step on a linear-attention score loss; returns (φ(q), φ(k), loss)."""
    q, k = model(x)
    scores = torch.einsum("bthd,bshd->bhts", q, k)  # φ(q)ᵀφ(k)
    loss = (scores.mean(-1) - target).square().mean()
    model.zero_grad()
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
    return q.detach(), k.detach(), loss.detach()


def main() -> None:
    torch.manual_seed(0)
    model = KeyQueryPreprocess(d_model=64, d_key=64, n_heads=4, kernel_size=4, activation="silu", phi="elu1")
    eager_model = copy.deepcopy(model)
    x = torch.randn(4, 128, 64)
    target = torch.randn(4, 4, 128)

    start = time.perf_counter()
    compiled = torch.compile(model, backend="hecate")  # the "hecate" backend is an entry point: no import needed
    *outputs, loss = train_step(compiled, x, target)
    print(f"compiled, ran forward and backward, took an SGD step in {time.perf_counter() - start:.1f} s")
    *ref_outputs, ref_loss = train_step(eager_model, x, target)

    for name, got, ref in zip(("phi(q)", "phi(k)", "loss"), [*outputs, loss], [*ref_outputs, ref_loss]):
        print(f"{name:7s} relative error vs eager {rel_err(got, ref):.1e}")
        assert rel_err(got, ref) <= 1e-5
    worst = max(rel_err(p, p_ref) for p, p_ref in zip(model.parameters(), eager_model.parameters()))
    print(f"parameters after the step: worst relative error vs eager {worst:.1e}\n")
    assert worst <= 1e-5

    report = hecate.last_report()
    print(report)
    assert report.count("qk_preprocess") == 2


if __name__ == "__main__":
    main()
