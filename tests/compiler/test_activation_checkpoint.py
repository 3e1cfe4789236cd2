"""Activation checkpointing (``torch.utils.checkpoint``) around a family: fused inside, still checkpointed.

Dynamo keeps a checkpointed region as a ``tag_activation_checkpoint`` call on a body graph.
The body goes through Hecate's pipeline on its own and the call stays (the region is still
recomputed in the backward); the compiled model equals eager, outputs and gradients (≤ 1e-5).
"""

import functools

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import hecate
from hecate.models.memory import LpMemory
from hecate.testing import assert_outputs_and_gradients_close

TOL = 1e-5


def kl_attention_step(mu, var):  # pairwise-KL attention and its β-weighted means
    d = mu[:, :, None] - mu[:, None]
    kl = 0.5 * (var[:, :, None] / var[:, None] + d ** 2 / var[:, None] - 1 + var[:, None].log()
                - var[:, :, None].log()).sum(-1)
    return torch.softmax(-kl, -1) @ mu


def _save_matmuls(ctx, op, *args, **kwargs):  # selective checkpointing: keep products, recompute the rest
    return CheckpointPolicy.MUST_SAVE if op in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default) \
        else CheckpointPolicy.PREFER_RECOMPUTE


class Checkpointed(nn.Module):
    def __init__(self, inner, selective=False):
        super().__init__()
        self.inner, self.selective = inner, selective

    def forward(self, *args):
        if self.selective:
            context = functools.partial(create_selective_checkpoint_contexts, _save_matmuls)
            return checkpoint(self.inner, *args, use_reentrant=False, context_fn=context)
        return checkpoint(self.inner, *args, use_reentrant=False)


class KLBlock(nn.Module):
    def __init__(self, d=5):
        super().__init__()
        self.enc = nn.Linear(d, 2 * d)

    def forward(self, x):
        mu, logvar = self.enc(x).chunk(2, -1)
        return kl_attention_step(mu, logvar.exp())


CASES = {
    "memory_loop": (lambda: LpMemory(8, n_heads=2, d_k=4, d_v=4), (2, 6, 8), "memory_scan"),
    "kl_attention": (KLBlock, (2, 7, 5), "kl_attention"),
}


@pytest.mark.parametrize("selective", [False, True], ids=["checkpoint", "selective"])
@pytest.mark.parametrize("fallback", ["inductor", "eager"])
@pytest.mark.parametrize("name", list(CASES))
def test_checkpointed_family_is_fused_and_equals_eager(name, fallback, selective, fresh_dynamo, tmp_path):
    make, shape, pattern = CASES[name]
    torch.manual_seed(0)
    model = Checkpointed(make(), selective)
    x = torch.randn(*shape)
    xc, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    compiled = torch.compile(model, backend="hecate", options={"fallback": fallback, "strict": True,
                                                                "dump_dir": str(tmp_path)})
    got, ref = compiled(xc), model(xe)
    report = hecate.last_report()
    assert report.count(pattern) == 1 and not report.misses, str(report)
    params = list(model.parameters())
    assert_outputs_and_gradients_close(got, ref, [xc, *params], [xe, *params], TOL)
    # the region is still a checkpoint: the fused graph calls tag_activation_checkpoint on its body
    dumps = list(tmp_path.glob("*_after_*.txt"))
    assert any("tag_activation_checkpoint" in f.read_text() for f in dumps), [f.name for f in dumps]


@pytest.mark.parametrize("fallback", ["inductor", "eager"])
@pytest.mark.parametrize("name", list(CASES))
def test_a_compiled_model_first_called_inside_a_checkpoint_equals_eager(name, fallback, fresh_dynamo):
    """The compiled model checkpointed from outside (``checkpoint(compiled, x)``), its first call there: the
    compile runs inside the checkpoint's forward, whose saved-tensor hooks count what autograd saves. The
    passes' tracing saved fake tensors there, the recomputation did not: ``CheckpointError`` in backward
    (probe r26, any model, nothing fused or not). Now it runs, fused, and equals eager."""
    make, shape, pattern = CASES[name]
    torch.manual_seed(0)
    model = make()
    x = torch.randn(*shape)
    xc, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    compiled = torch.compile(model, backend="hecate", options={"fallback": fallback, "strict": True})
    got = checkpoint(compiled, xc, use_reentrant=False)
    assert hecate.last_report().count(pattern) == 1, str(hecate.last_report())
    params = list(model.parameters())
    assert_outputs_and_gradients_close(got, model(xe), [xc, *params], [xe, *params], TOL)


@pytest.mark.parametrize("fallback", ["inductor", "eager"])
@pytest.mark.parametrize("name", list(CASES))
def test_a_checkpoint_inside_a_checkpoint_is_fused_and_equals_eager(name, fallback, fresh_dynamo):
    """Nested regions: the inner body is fused through the pipeline of the outer one, and the outer body's
    re-trace goes through the inner region too, which needs the same context as the outer one (probe r41: the
    re-trace failed on the inner region, and the whole graph was left unfused as an internal error)."""
    make, shape, pattern = CASES[name]
    torch.manual_seed(0)
    model = Checkpointed(Checkpointed(make()))
    x = torch.randn(*shape)
    xc, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    got = torch.compile(model, backend="hecate", options={"fallback": fallback, "strict": True})(xc)
    report = hecate.last_report()
    assert report.count(pattern) == 1 and not report.misses, str(report)
    params = list(model.parameters())
    assert_outputs_and_gradients_close(got, model(xe), [xc, *params], [xe, *params], TOL)


def hebbian_step(S, k, v):
    return 0.9 * S + v[..., None] * k[:, None, :]


def hebbian_checkpointed_every_step(q, k, v):
    S, ys = q.new_zeros(q.shape[0], v.shape[-1], k.shape[-1]), []
    for t in range(q.shape[1]):
        S = checkpoint(hebbian_step, S, k[:, t], v[:, t], use_reentrant=False)
        ys.append((S @ q[:, t, :, None])[..., 0])
    return torch.stack(ys, 1)


def test_a_step_checkpointed_inside_the_loop_is_reported_once_with_the_loop_to_checkpoint(fresh_dynamo):
    """Each step its own region: each region holds one update, which is no loop. One reason for the 5 regions,
    saying to checkpoint the whole loop (probe r41: five reasons, each calling the step one written by hand)."""
    args = [torch.randn(2, 5, 3) for _ in range(3)]
    xc, xe = ([a.clone().requires_grad_() for a in args] for _ in range(2))
    got = torch.compile(hebbian_checkpointed_every_step, backend="hecate",
                        options={"fallback": "eager", "strict": True})(*xc)
    report = hecate.last_report()
    assert not report.fusions and len(report.misses) == 1, str(report)
    (miss,) = report.misses
    assert miss.pattern == "linear_attention" and "checkpoint the whole loop instead" in miss.reason, str(report)
    assert "inside a torch.utils.checkpoint region called at every step of a loop (5 calls)" in miss.reason
    assert "return 0.9 * S + v[..., None] * k[:, None, :]" in miss.source, str(report)
    assert_outputs_and_gradients_close(got, hebbian_checkpointed_every_step(*xe), xc, xe, TOL)
