"""A family inside a ``torch.cond`` branch.

Dynamo keeps ``torch.cond(pred, true_fn, false_fn, operands)`` as a higher-order call on two branch graphs. Each
branch goes through Hecate's pipeline on its own, as a checkpointed region's body does, and the call stays: the
branch the predicate picks is the one that runs (probe r41: a family inside a branch was neither fused nor
reported). A memory update inside a branch called at every step of a loop is reported once, with the loop to write.
"""

import pytest
import torch
import torch.nn.functional as F

import hecate
from hecate.testing import assert_outputs_and_gradients_close

TOL = 1e-5


def delta_rule(q, k, v):
    M, ys = q.new_zeros(q.shape[0], v.shape[-1], k.shape[-1]), []
    for t in range(q.shape[1]):
        e = (M @ k[:, t, :, None])[..., 0] - v[:, t]
        M = 0.95 * M - 0.5 * e[..., None] * k[:, t, None, :]
        ys.append((M @ q[:, t, :, None])[..., 0])
    return torch.stack(ys, 1)


def hebbian(q, k, v):
    S, ys = q.new_zeros(q.shape[0], v.shape[-1], k.shape[-1]), []
    for t in range(q.shape[1]):
        S = 0.9 * S + torch.einsum("bi,bj->bij", v[:, t], k[:, t])
        ys.append(torch.einsum("bij,bj->bi", S, q[:, t]))
    return torch.stack(ys, 1)


def kl_attention(mu, logvar, v):
    var, d = logvar.exp(), mu[:, :, None] - mu[:, None]
    kl = 0.5 * (logvar[:, None] - logvar[:, :, None] + (var[:, :, None] + d * d) / var[:, None] - 1).sum(-1)
    return torch.softmax(-kl, -1) @ v


def distance_attention(q, k, v):  # (not q @ kᵀ: torch's cond then lays the branches' gradients out differently)
    return torch.softmax(-((q[:, :, None] - k[:, None]) ** 2).sum(-1), -1) @ v


def memory_chosen(flag, q, k, v):
    return torch.cond(flag, delta_rule, hebbian, (q, F.normalize(k, dim=-1), v))


def memory_or_not(flag, q, k, v):
    return torch.cond(flag, hebbian, lambda q, k, v: 2 * q + v, (q, k, v))


def attention_chosen(flag, q, k, v):
    return torch.cond(flag, kl_attention, distance_attention, (q, k, v))


def update_chosen_every_step(flag, q, k, v):
    def delta_step(M, kt, vt):
        return 0.95 * M - 0.5 * ((M @ kt[..., None])[..., 0] - vt)[..., None] * kt[:, None, :]

    def hebbian_step(M, kt, vt):
        return 0.9 * M + vt[..., None] * kt[:, None, :]

    k = F.normalize(k, dim=-1)
    M, ys = q.new_zeros(q.shape[0], v.shape[-1], k.shape[-1]), []
    for t in range(q.shape[1]):
        M = torch.cond(flag, delta_step, hebbian_step, (M, k[:, t], v[:, t]))
        ys.append((M @ q[:, t, :, None])[..., 0])
    return torch.stack(ys, 1)


def _inputs():
    torch.manual_seed(0)
    return [torch.randn(2, 5, 3) for _ in range(3)]


def _compare(fn, flag, compiled):
    args = _inputs()
    got_in, ref_in = ([a.clone().requires_grad_() for a in args] for _ in range(2))
    got = compiled(torch.tensor(flag), *got_in)
    assert_outputs_and_gradients_close(got, fn(torch.tensor(flag), *ref_in), got_in, ref_in, TOL)


@pytest.mark.parametrize("fn, fused, missed", [
    (memory_chosen, {"memory_scan": 1, "linear_attention": 1}, []),
    (memory_or_not, {"linear_attention": 1}, []),
    (attention_chosen, {"kl_attention": 1}, ["is not a pairwise KL(q_i‖q_j) between diagonal Gaussians"]),
], ids=["memories", "memory_or_not", "attention"])
@pytest.mark.parametrize("fallback", ["eager", "inductor"])
def test_a_family_in_a_branch_is_fused_and_the_predicate_picks_the_branch(fn, fused, missed, fallback, fresh_dynamo):
    """Each branch fused on its own (the distance attention reported as the KL it is not); both predicate values
    through one compiled graph equal eager, forward and gradients (a branch that ran the other's code would
    differ), also where one branch is fused and the other is not."""
    compiled = torch.compile(fn, backend="hecate", options={"fallback": fallback, "strict": True})
    _compare(fn, True, compiled)
    report = hecate.last_report()
    assert {p: report.count(p) for p in fused} == fused, str(report)
    assert len(report.misses) == len(missed) and all(r in m.reason for m, r in zip(report.misses, missed)), \
        str(report)
    _compare(fn, False, compiled)


def test_an_update_chosen_at_every_step_is_reported_once_with_the_loop_to_write(fresh_dynamo):
    compiled = torch.compile(update_chosen_every_step, backend="hecate", options={"fallback": "eager",
                                                                                  "strict": True})
    _compare(update_chosen_every_step, True, compiled)
    report = hecate.last_report()
    assert not report.fusions and {m.pattern for m in report.misses} == {"memory_scan", "linear_attention"}, \
        str(report)
    for miss in report.misses:
        assert "inside a torch.cond branch called at every step of a loop (5 calls)" in miss.reason, str(report)
        assert "choose between whole loops instead" in miss.reason and "test_cond.py" in miss.source, str(report)
    _compare(update_chosen_every_step, False, compiled)
