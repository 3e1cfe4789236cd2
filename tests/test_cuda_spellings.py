"""On a CUDA GPU: the spelling corpora compiled with ``backend="hecate"`` fuse as on the CPU and equal eager.

The spelling tests (``tests/spellings``) check every spelling on the CPU, where the fused ops run their ATen
path (or the Triton kernels under the interpreter). What the passes put around an op (shifted queries of a
strict gate, the normaliser's [v, 1] column, a transposed input or output, views of the heads) then reaches
the Triton kernels only here, with Inductor's CUDA code around it: each spelling runs on CUDA, inputs,
parameters and every tensor it makes itself (``torch.device("cuda")`` as the default device), and its
outputs and the gradients of its inputs and parameters are compared with eager on CUDA.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from hecate.compiler.distributed import collect_reports
from hecate.testing import assert_close
from tests.spellings import test_belief_flow_spellings as flows
from tests.spellings import test_kl_spellings as kl
from tests.spellings import test_linear_attention_parallel_spellings as parallel
from tests.spellings import test_memory_spellings as memory
from tests.spellings import test_qk_spellings as qk

pytestmark = pytest.mark.cuda

DEVICE = "cuda"
TOL = 1e-4  # fp32 kernels against fp32 eager: each sums in its own order (TF32 off in both)


@pytest.fixture(autouse=True)
def no_tf32():
    """Eager's cuDNN convolutions use TF32 by default; the reference must be fp32 as the kernels are."""
    previous = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    torch._dynamo.reset()
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = previous
    torch._dynamo.reset()


def _skip_if_dynamo_alone_fails(fn, args):
    """Skip where Dynamo itself fails on the spelling with ``backend="eager"`` too, before any backend runs: the
    Dynamo of torch 2.11 makes some tensors a spelling makes itself (``torch.arange(n)``, ``torch.eye(n)``) on the
    CPU under a default CUDA device, where eager makes them on CUDA."""
    torch._dynamo.reset()
    try:
        torch.compile(fn, backend="eager")(*args)
    except torch._dynamo.exc.TorchRuntimeError as error:
        pytest.skip(f"Dynamo (torch {torch.__version__}) fails on it with backend='eager' too: "
                    f"{str(error).splitlines()[0][:160]}")


def _fuses_on_cuda_as_in_eager(fn, args, op, count=1, params=(), default_device=True):
    """``fn`` compiled by Hecate on CUDA fuses ``count`` × ``op`` with no near-miss of it, and its outputs and
    the gradients of ``args`` and ``params`` (under Σ w·out, w random) equal eager's on CUDA within TOL. The
    report adds up every graph of the call: under a default device Dynamo splits some spellings where it
    does not otherwise (``Tensor.unflatten``), each piece fusing what it holds. ``default_device=False``: the
    tensors the spelling makes itself stay on the CPU."""
    args = [a.to(DEVICE) for a in args]
    floats = [a for a in args if a.is_floating_point()]
    with torch.device(DEVICE) if default_device else contextlib.nullcontext():
        compiled = torch.compile(fn, backend="hecate", options={"fallback": "eager"})
        got_args = [a.clone().requires_grad_() if a.is_floating_point() else a for a in args]
        with collect_reports() as report:
            try:
                got = torch.utils._pytree.tree_leaves(compiled(*got_args))
            except torch._dynamo.exc.TorchRuntimeError:
                _skip_if_dynamo_alone_fails(fn, args)
                raise
        ref_args = [a.clone().requires_grad_() if a.is_floating_point() else a for a in args]
        ref = torch.utils._pytree.tree_leaves(fn(*ref_args))
    assert report.count(op) == count, str(report)
    assert not [m for m in report.misses if m.pattern == op], str(report)
    assert len(got) == len(ref) and floats
    for i, (g, r) in enumerate(zip(got, ref)):
        assert_close(f"output {i}", g, r, TOL)
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(r.shape, generator=generator).to(DEVICE) for r in ref]
    wrt_got = [a for a in got_args if a.requires_grad] + list(params)
    wrt_ref = [a for a in ref_args if a.requires_grad] + list(params)
    grads = torch.autograd.grad(sum((o * w).sum() for o, w in zip(got, weights)), wrt_got, allow_unused=True,
                                materialize_grads=True)
    ref_grads = torch.autograd.grad(sum((o * w).sum() for o, w in zip(ref, weights)), wrt_ref, allow_unused=True,
                                    materialize_grads=True)
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        assert_close(f"gradient {i}", g, r, TOL)


@pytest.mark.parametrize("fn,draw", kl.ATTENTION, ids=[f.__name__ for f, _ in kl.ATTENTION])
def test_kl_attention_spelling_on_cuda(fn, draw):
    _fuses_on_cuda_as_in_eager(fn, (torch.randn(kl.B, kl.N, kl.K), draw((kl.B, kl.N, kl.K))), "kl_attention")


@pytest.mark.parametrize("fn", kl.DECODE, ids=[f.__name__ for f in kl.DECODE])
def test_kl_decode_spelling_on_cuda(fn):
    targets = torch.randint(0, kl.V, (kl.B, kl.N))
    if fn is kl.d_distributions_ignore_index:
        targets[0, 1] = -100
    query_draw = kl._logvar if fn is kl.d_logits_returned else kl._var
    args = (torch.randn(kl.B, kl.N, kl.K), query_draw((kl.B, kl.N, kl.K)), torch.randn(kl.V, kl.K),
            kl._PRIOR_DRAW.get(fn, kl._var)((kl.V, kl.K)), targets)
    _fuses_on_cuda_as_in_eager(fn, args, "kl_decode")


@pytest.mark.parametrize("fn", parallel.FUNCTIONS, ids=[f.__name__ for f in parallel.FUNCTIONS])
def test_linear_attention_parallel_spelling_on_cuda(fn):
    torch.manual_seed(0)
    _fuses_on_cuda_as_in_eager(fn, [torch.randn(parallel.B, parallel.T, parallel.D) for _ in range(3)],
                               "linear_attention")


@pytest.mark.parametrize("name", list(memory.SPELLINGS))
def test_memory_spelling_on_cuda(name):
    fn, op = memory.SPELLINGS[name]
    _fuses_on_cuda_as_in_eager(fn, [x.detach() for x in memory._inputs()], op)


@pytest.mark.parametrize("fn", list(memory._PER_KEY_READS) + list(memory._BONUS_READS), ids=lambda f: f.__name__)
def test_a_decay_per_key_dim_on_cuda(fn):
    """GLA, HGRN2 and RWKV-5/6 [B, H, T, D]: the memory split per row, the op's reads per row summed after it, and
    the bonus read apart, with Inductor's CUDA code around the kernels."""
    g = torch.Generator().manual_seed(0)
    shape = (2, 2, 5, 4)
    if fn in memory._BONUS_READS:  # r, k, v, the decay's log-log, the bonus u [H, D]
        args = [torch.randn(shape, generator=g), torch.randn(shape, generator=g) / 2, torch.randn(shape, generator=g),
                torch.randn(shape, generator=g) / 2 - 0.5, torch.randn(shape[1], shape[3], generator=g) / 2]
    else:  # q, k, v, the gate's logits (HGRN2: no k)
        args = [torch.randn(shape, generator=g) / 2] + [torch.randn(shape, generator=g) for _ in range(3)]
        args = [args[0]] + args[2:] if fn is memory.hgrn2 else args
    _fuses_on_cuda_as_in_eager(fn, args, "linear_attention")


@pytest.mark.parametrize("name", list(qk.SPELLINGS))
def test_qk_spelling_on_cuda(name):
    spelling, _ = qk.SPELLINGS[name]
    model = qk.Block(spelling).to(DEVICE)
    _fuses_on_cuda_as_in_eager(model, (torch.randn(qk.B, qk.T, qk.D_IN),), "qk_preprocess",
                               params=list(model.parameters()))


@pytest.mark.parametrize("name", list(flows.FLOWS))
def test_belief_flow_on_cuda(name):
    make, steps = flows.FLOWS[name]
    torch.manual_seed(0)
    model = make().to(DEVICE)
    _fuses_on_cuda_as_in_eager(model, (torch.randn(flows.B, flows.N, flows.D),), "kl_attention", count=steps,
                               params=list(model.parameters()))


def test_a_cpu_bool_index_into_a_cuda_tensor():
    """``kl[:, mask] = inf`` with the mask made on the CPU, as eager's indexing allows for a CUDA tensor: the
    normal form's ``masked_fill`` reads the mask moved to the scores' device."""
    _fuses_on_cuda_as_in_eager(kl.a_kl_set_to_inf_by_item_assignment,
                               (torch.randn(kl.B, kl.N, kl.K), kl._var((kl.B, kl.N, kl.K))), "kl_attention",
                               default_device=False)


@pytest.mark.parametrize("name", ["delta_rule_with_a_python_step_size_schedule", "hebbian_decay_by_the_step_index"])
def test_a_python_number_per_step_reaches_the_kernels_on_cuda(name):
    """The loop rolled up reads a number that differs between the steps as a [T] tensor, made on the inputs'
    device (it was made on the CPU: the Triton kernels refused the pointer)."""
    fn, op = memory.SPELLINGS[name]
    _fuses_on_cuda_as_in_eager(fn, [x.detach() for x in memory._inputs()], op, default_device=False)
