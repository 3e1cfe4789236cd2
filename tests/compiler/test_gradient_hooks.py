"""Gradient hooks registered inside the compiled code (``y.register_hook(fn)`` in ``forward``).

Dynamo records such a hook as a ``register_hook`` call in its graph. The re-trace to ATen used to
run it on a fake tensor and keep nothing: the hook was dropped, on any model (probe r27: every
gradient 2× eager's under a hook halving it). It is now kept in the traced graph, so the fallback
registers it. A hook on a value a family computes inside would not be called by the fused op's
backward: that family is left as written and the report says why. Every case equals eager,
outputs and gradients (≤ 1e-5).
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hecate
from hecate.testing import assert_outputs_and_gradients_close
from tests.compiler.test_output_written_in_place import KLDecodeLogits

TOL = 1e-5


def kl_attention(mu, var, hook_on_scores=False):  # causal β = softmax(−KL(q_i‖q_j)/2), β @ μ
    mi, mj, vi, vj = mu[:, :, None], mu[:, None], var[:, :, None], var[:, None]
    kl = 0.5 * (torch.log(vj / vi) + (vi + (mi - mj) ** 2) / vj - 1).sum(-1)
    if hook_on_scores:
        kl.register_hook(lambda g: g * 0.5)
    n = mu.shape[1]
    return (-kl / 2).masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf")).softmax(-1) @ mu


class KLBlock(nn.Module):
    def __init__(self, d=6, k=4, hook_on_scores=False):
        super().__init__()
        self.enc, self.hook_on_scores = nn.Linear(d, 2 * k), hook_on_scores

    def forward(self, x):
        mu, raw = self.enc(x).chunk(2, -1)
        return kl_attention(mu, F.softplus(raw) + 1e-2, self.hook_on_scores)


class HookedOutput(nn.Module):
    """The inner block's output scaled in backward by a buffer the hook closes over."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, x):
        y = self.inner(x)
        y.register_hook(lambda g: g * self.scale)
        return y * 1.0


class HookedBeforeAndAfterItsUse(nn.Module):
    """y read once before its hook is registered and once after: the hook sees the sum of both gradients."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        y = self.inner(x)
        z = y.square()
        y.register_hook(lambda g: g * 0.5)
        return z + y


class DeltaRule(nn.Module):
    """M_t = M_{t−1} − η (M_{t−1} k_t − v_t) k_tᵀ, y_t = M_t k_t; a hook at every step on the error, or on the
    state after the step's read (the last state's hook has no reader after it, and acts)."""

    def __init__(self, d=6, hook_on=None):
        super().__init__()
        self.k, self.v, self.hook_on = nn.Linear(d, d), nn.Linear(d, d), hook_on

    def forward(self, x):
        k, v = F.normalize(self.k(x), dim=-1), self.v(x)
        memory, ys = x.new_zeros(x.shape[0], x.shape[2], x.shape[2]), []
        for t in range(x.shape[1]):
            error = torch.einsum("bij,bj->bi", memory, k[:, t]) - v[:, t]
            if self.hook_on == "errors":
                error.register_hook(lambda g: g * 0.5)
            memory = memory - 0.1 * torch.einsum("bi,bj->bij", error, k[:, t])
            ys.append(torch.einsum("bij,bj->bi", memory, k[:, t]))
            if self.hook_on == "states":
                memory.register_hook(lambda g: g * 0.5)
        return torch.stack(ys, 1)


def _compile_and_compare(model, shape, fallback):
    torch.manual_seed(0)
    x = torch.randn(*shape)
    xc, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    got = torch.compile(model, backend="hecate", options={"fallback": fallback, "strict": True})(xc)
    report = hecate.last_report()
    params = list(model.parameters())
    assert_outputs_and_gradients_close(got, model(xe), [xc, *params], [xe, *params], TOL)
    return report


OUTPUT_HOOKED = {
    "kl_attention": (lambda: HookedOutput(KLBlock()), (2, 7, 6), "kl_attention"),
    "memory_loop": (lambda: HookedOutput(DeltaRule()), (2, 5, 6), "memory_scan"),
    "kl_attention_read_before_the_hook": (lambda: HookedBeforeAndAfterItsUse(KLBlock()), (2, 7, 6), "kl_attention"),
    "kl_decode_logits": (lambda: HookedOutput(KLDecodeLogits()), (2, 7, 6), "kl_decode"),
    "linear": (lambda: HookedOutput(nn.Linear(6, 6)), (2, 7, 6), None),
}


@pytest.mark.parametrize("fallback", ["eager", "inductor"])
@pytest.mark.parametrize("name", list(OUTPUT_HOOKED))
def test_a_hook_on_a_fused_output_is_called(name, fallback, fresh_dynamo):
    make, shape, pattern = OUTPUT_HOOKED[name]
    report = _compile_and_compare(make(), shape, fallback)
    if pattern is not None:
        assert report.count(pattern) == 1 and not report.misses, str(report)


@pytest.mark.parametrize("model,pattern", [
    (lambda: KLBlock(hook_on_scores=True), "kl_attention"),
    (lambda: DeltaRule(hook_on="errors"), "memory_scan"),
    (lambda: DeltaRule(hook_on="states"), "memory_scan"),
], ids=["on_the_kl_scores", "on_a_memory_error_at_every_step", "on_the_memory_after_each_read"])
def test_a_hook_inside_a_family_leaves_it_unfused_and_is_reported(model, pattern, fresh_dynamo):
    report = _compile_and_compare(model(), (2, 5, 6), "eager")
    assert report.count(pattern) == 0, str(report)
    (miss,) = [m for m in report.misses if m.pattern == pattern]
    assert "gradient hook" in miss.reason and "register_hook" in miss.reason, miss.reason


def test_the_same_loop_without_hooks_fuses(fresh_dynamo):  # (what the test above leaves unfused is the hook's doing)
    assert _compile_and_compare(DeltaRule(), (2, 5, 6), "eager").count("memory_scan") == 1


class HookedFinalState(nn.Module):
    """The loop's final state returned with the reads, a hook on it: the last step read that state too, so the hook
    acts on that read's gradient as well (probe r29: fused, the hook saw only the returned state's)."""

    def __init__(self):
        super().__init__()
        self.loop = DeltaRule()

    def forward(self, x):
        k, v = F.normalize(self.loop.k(x), dim=-1), self.loop.v(x)
        memory, ys = x.new_zeros(x.shape[0], x.shape[2], x.shape[2]), []
        for t in range(x.shape[1]):
            error = torch.einsum("bij,bj->bi", memory, k[:, t]) - v[:, t]
            memory = memory - 0.1 * torch.einsum("bi,bj->bij", error, k[:, t])
            ys.append(torch.einsum("bij,bj->bi", memory, k[:, t]))
        memory.register_hook(lambda g: g * 0.1)
        return torch.stack(ys, 1), memory


def test_a_hook_on_a_loops_final_state_leaves_it_unfused_and_is_reported(fresh_dynamo):
    report = _compare_and_check_reason(HookedFinalState(), "memory_scan")
    assert report.count("memory_scan") == 0


def _compare_and_check_reason(model, pattern):
    report = _compile_and_compare(model, (2, 5, 6), "eager")
    (miss,) = [m for m in report.misses if m.pattern == pattern]
    assert "gradient hook" in miss.reason and "register_hook" in miss.reason, miss.reason
    return report


class CheckpointedHook(nn.Module):
    """A hook inside a torch.utils.checkpoint region: torch re-traces the region's body through the checkpoint's
    own rule, which dropped the hook (probe r29: gradients of the opposite sign under a hook g ↦ −g)."""

    def __init__(self):
        super().__init__()
        self.inner = KLBlock()

    def forward(self, x):
        def region(x):
            y = self.inner(x)
            y.register_hook(lambda g: -g)
            return y
        return torch.utils.checkpoint.checkpoint(region, x, use_reentrant=False) + x.sum(-1, keepdim=True)


def test_a_hook_inside_a_checkpoint_is_called_and_reported(fresh_dynamo):
    report = _compile_and_compare(CheckpointedHook(), (2, 7, 6), "eager")
    (miss,) = report.misses
    assert miss.pattern == "hecate" and "inside a torch.utils.checkpoint region" in miss.reason, miss.reason


def test_a_hook_on_a_fused_output_under_dynamic_shapes(fresh_dynamo):
    """Under dynamic=True the hook's body reads the sizes, which the re-trace passes as symbols (probe r29: an
    internal error)."""
    torch.manual_seed(0)
    model = HookedOutput(KLBlock())
    x = torch.randn(2, 7, 6)
    xc, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    got = torch.compile(model, backend="hecate", dynamic=True, options={"fallback": "eager", "strict": True})(xc)
    assert hecate.last_report().count("kl_attention") == 1, str(hecate.last_report())
    params = list(model.parameters())
    assert_outputs_and_gradients_close(got, model(xe), [xc, *params], [xe, *params], TOL)
