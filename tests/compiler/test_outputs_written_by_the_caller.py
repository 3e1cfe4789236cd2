"""What a compiled model returns, written into by the caller as eager allows (probe r39).

Truncated backpropagation carries a state between chunks and cuts it, ``S.detach_()``; a decoder resets
its memory in place, ``M.zero_()`` or ``M.add_(1)``. Eager's results are tensors of their own. The fused
graph's were views: the memory a fused loop returns is a reshape of one of the op's outputs, and the
qk chain's φ a transpose where the user's code made a new tensor after it. With ``fallback="eager"``
(the fused graph run as it is) autograd refused both writes ("a view ... of a function that returns
multiple views", "Can't detach views in-place"). Each case here fuses, writes as the caller does, and
equals eager after the write (≤ 1e-5); the gradients taken before the cut equal eager's.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hecate
from hecate.testing import assert_close
from tests.compiler.test_output_written_in_place import D, QK

TOL = 1e-5


class HebbianReadFirst(nn.Module):  # y_t = M_{t−1} q_t, then M ← 0.9 M + v kᵀ; the final memory returned
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        memory, ys = x.new_zeros(x.shape[0], D, D), []
        for t in range(x.shape[1]):
            ys.append(torch.einsum("bij,bj->bi", memory, q[:, t]))
            memory = 0.9 * memory + v[:, t, :, None] * k[:, t, None, :]
        return torch.stack(ys, 1), memory


class DeltaRule(nn.Module):  # the delta rule, read after the write; the final memory returned
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        k = F.normalize(k, dim=-1)
        memory, ys = x.new_zeros(x.shape[0], D, D), []
        for t in range(x.shape[1]):
            error = memory @ k[:, t, :, None] - v[:, t, :, None]
            memory = 0.95 * memory - 0.4 * error * k[:, t, None, :]
            ys.append((memory @ q[:, t, :, None])[..., 0])
        return torch.stack(ys, 1), memory


def _as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


@pytest.mark.parametrize("model, op", [(QK, "qk_preprocess"), (HebbianReadFirst, "linear_attention"),
                                       (DeltaRule, "memory_scan")], ids=["qk", "hebbian_read_first", "delta_rule"])
@pytest.mark.parametrize("write", ["detach_", "add_"])
def test_an_output_written_in_place_by_the_caller_as_eager_allows(model, op, write, fresh_dynamo):
    torch.manual_seed(0)
    module, x = model(), torch.randn(2, 4, D)
    compiled = torch.compile(module, backend="hecate", options={"fallback": "eager"})
    got, expected = _as_tuple(compiled(x)), _as_tuple(module(x))
    assert hecate.last_report().count(op) == 1, str(hecate.last_report())
    weights = [torch.linspace(-1, 1, e.numel()).view_as(e) for e in expected]
    grads = [torch.autograd.grad(sum((o * w).sum() for o, w in zip(outs, weights)), list(module.parameters()))
             for outs in (got, expected)]
    for a, b in zip(*grads):
        assert_close("parameter gradient", a, b, TOL)
    for a, b in zip(got, expected):
        if write == "detach_":  # truncated backpropagation: the state cut between chunks
            a.detach_(), b.detach_()
            assert not a.requires_grad
        else:  # a state reset in place
            a.add_(1.0), b.add_(1.0)
        assert_close("output after the write", a, b, TOL)
