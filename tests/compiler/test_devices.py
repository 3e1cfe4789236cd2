"""The passes build what they add on the device of the graph's tensors, never on the CPU by default.

CI has one device; ``meta`` tensors stand in for a second: a tensor the passes made on the CPU and mixed with
the inputs fails the fake tracing there, as it fails on CUDA (the Triton kernels refuse a CPU pointer). Each
case fused on the CPU; on ``meta`` it must fuse the same way (``hecate.explain`` runs the passes on fake
tensors and the captured graph on ``meta``).
"""

import pytest
import torch

import hecate
from tests.spellings import test_kl_spellings as kl
from tests.spellings import test_memory_spellings as memory


def _fusions_on(device, fn, args):
    report = hecate.explain(fn, *[a.to(device) for a in args])
    return [f.op for f in report.fusions], [(m.pattern, m.reason) for m in report.misses]


def test_a_python_number_per_step_is_read_on_the_inputs_device():
    """η_t = 0.5 / (t + 1) of a Python schedule: the rolled-up loop reads it as a [T] tensor on the inputs'
    device (it was made on the CPU: the loop was not rolled up, and the memory not fused, on another device)."""
    fn, _ = memory.SPELLINGS["delta_rule_with_a_python_step_size_schedule"]
    args = [x.detach() for x in memory._inputs()]
    on_cpu = _fusions_on("cpu", fn, args)
    assert on_cpu == (["hecate.memory_scan"], [])
    assert _fusions_on("meta", fn, args) == on_cpu


def test_a_bool_index_on_the_cpu_into_a_tensor_elsewhere_fuses():
    """``kl[:, mask] = inf`` with the mask on the CPU and the scores on another device (indexing allows it): the
    normal form's masked_fill reads the mask moved to the scores' device (it failed, an internal error)."""
    fn = kl.a_kl_set_to_inf_by_item_assignment  # the mask made by torch.ones(n, n) on the CPU
    args = (torch.randn(kl.B, kl.N, kl.K), kl._var((kl.B, kl.N, kl.K)))
    on_cpu = _fusions_on("cpu", fn, args)
    assert on_cpu == (["hecate.kl_attention"], [])
    assert _fusions_on("meta", fn, args) == on_cpu


def _op_calls():
    b, t, h, d = 1, 3, 1, 2
    k = torch.randn(b, t, h, d)
    return {
        "memory_scan": (lambda **x: torch.ops.hecate.memory_scan(x["k"], k, k, x["alpha"], x["alpha"], None, None),
                        dict(k=k, alpha=torch.rand(b, t, h)), "alpha"),
        "linear_attention": (lambda **x: torch.ops.hecate.linear_attention(x["k"], x["v"], k, None, None, None),
                             dict(k=k, v=torch.randn(b, t, h, 2)), "v"),
        "kl_attention": (lambda **x: torch.ops.hecate.kl_attention(x["mu"], x["var"], x["mu"], x["mu"], 1.0, True, False),
                         dict(mu=torch.randn(1, 3, 2), var=torch.rand(1, 3, 2) + 0.5), "var"),
        "kl_decode": (lambda **x: torch.ops.hecate.kl_decode_logits(x["mu"], x["mu"], x["prior_mu"], x["prior_mu"], 1.0),
                      dict(mu=torch.rand(3, 2) + 0.5, prior_mu=torch.rand(4, 2) + 0.5), "prior_mu"),
    }


@pytest.mark.parametrize("op", ["memory_scan", "linear_attention", "kl_attention", "kl_decode"])
def test_an_op_given_a_tensor_on_another_device_names_it(op):
    """The ops read every tensor from the first one's device (a CPU pointer fails in a Triton kernel): one
    elsewhere is a ValueError naming it, its device and the one expected."""
    call, tensors, moved = _op_calls()[op]
    call(**tensors)  # every tensor on the CPU: runs
    with pytest.raises(ValueError, match=f"{op}: {moved} is on meta, expected .* device cpu"):
        call(**{**tensors, moved: tensors[moved].to("meta")})
