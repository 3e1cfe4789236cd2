"""Metamorphic fuzzing: a model's Dynamo graph rewritten into an equivalent spelling must
fuse the same ops and compute what eager computes.

Hypothesis draws a short list of rewrites (:mod:`tests.fuzz.rewrites`); each example
rewrites the captured graph before Hecate sees it, compiles it with the hecate backend
(fallback eager, so only Hecate's work is timed) and compares with the unrewritten graph:
the same number of each fused op, and outputs equal to eager within 1e-5 relative.
Examples are derandomised so CI runs the same ones; HECATE_FUZZ_EXAMPLES raises the count.
"""

from __future__ import annotations

import collections
import functools
import os

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from torch import fx

import hecate
from hecate.compiler.backend import hecate_backend
from tests.fuzz.rewrites import REWRITES, apply_rewrites

EXAMPLES = int(os.environ.get("HECATE_FUZZ_EXAMPLES", "3"))


def _qk():
    from hecate.models.short_conv import KeyQueryPreprocess
    return KeyQueryPreprocess(d_model=8, n_heads=2, kernel_size=3), (torch.randn(2, 5, 8),)


def _lp_memory():
    from hecate.models.memory import LpMemory
    return LpMemory(8, n_heads=2, d_k=4, d_v=4, p=3.0, alpha=None, eta=None, phi="elu1"), (torch.randn(2, 4, 8),)


def _hebbian():
    from hecate.models.memory import HebbianMemory
    return HebbianMemory(8, n_heads=2, d_k=4, d_v=4, alpha=None, normalise=True), (torch.randn(2, 4, 8),)


def _pure_fep():
    from hecate.models.fep import PureFEPConfig, PureFEPTransformer
    config = PureFEPConfig(vocab_size=16, embed_dim=4, n_layers=1, max_seq_len=8, n_vfe_steps=1)
    ids = torch.randint(0, 16, (2, 6))
    return PureFEPTransformer(config), (ids[:, :-1].contiguous(), ids[:, 1:].contiguous())


MODELS = {"qk_preprocess": _qk, "lp_memory": _lp_memory, "hebbian_memory": _hebbian, "pure_fep": _pure_fep}


@functools.cache
def _captured(name: str) -> tuple[fx.GraphModule, list, list[torch.Tensor], collections.Counter]:
    """Dynamo's graph of the model, its inputs, eager's outputs and the unrewritten fused-op counts."""
    torch.manual_seed(0)
    model, args = MODELS[name]()
    graphs = []

    def capture(gm, example_inputs):
        graphs.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=capture)(*args)
    torch._dynamo.reset()
    [(gm, inputs)] = graphs
    with torch.no_grad():
        expected = _outputs(gm(*inputs))
    return gm, inputs, expected, _compile(gm, inputs)[1]


def _outputs(result) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(result) if isinstance(t, torch.Tensor)]


def _compile(gm: fx.GraphModule, inputs: list) -> tuple[list[torch.Tensor], collections.Counter]:
    compiled = hecate_backend(gm, inputs, {"fallback": "eager"})
    with torch.no_grad():
        got = _outputs(compiled(*inputs))
    return got, collections.Counter(f.op for f in hecate.last_report().fusions)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return (torch.linalg.norm(a - b) / torch.linalg.norm(b).clamp_min(1e-30)).item()


def _check(name: str, choices) -> list[str]:
    """Rewrite the model's graph as ``choices`` say and check it fuses as the original and
    equals eager; return the rewrites done."""
    gm, inputs, expected, fused = _captured(name)
    rewritten = fx.GraphModule(gm, gm.graph.__deepcopy__())
    done = apply_rewrites(rewritten, choices)
    with torch.no_grad():  # the rewrite itself is exact, or this test's rewriter is wrong
        for a, b in zip(_outputs(rewritten(*inputs)), expected):
            assert _rel(a, b) <= 1e-6, ("the rewriter changed the values", done)
    got, counts = _compile(rewritten, inputs)
    assert counts == fused, f"after the rewrites {done}:\n{hecate.last_report()}"
    for a, b in zip(got, expected):
        assert _rel(a, b) <= 1e-5, done
    return done


rewrite_lists = st.lists(st.tuples(st.sampled_from(list(REWRITES)), st.integers(0, 1000)), min_size=1, max_size=6)


@pytest.mark.parametrize("name", list(MODELS))
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          phases=[Phase.explicit, Phase.generate],  # no shrinking: each example compiles for seconds
          suppress_health_check=[HealthCheck.too_slow])
@given(choices=rewrite_lists)
def test_rewritten_graph_fuses_the_same_and_equals_eager(name, choices):
    _check(name, choices)


@pytest.mark.parametrize("name", [n for n in MODELS if n != "qk_preprocess"])  # it reads nothing twice
def test_every_expression_written_at_each_use(name):
    """Every shared expression of the model written again at each of its uses (one compile; the
    random draws above rewrite one site at a time): equal subexpressions collapse before matching."""
    done = _check(name, [("written at each use", None)])
    assert done, f"{name} has no expression read twice: the case tests nothing"


@pytest.mark.parametrize("name", list(MODELS))
def test_every_pointwise_function_under_a_transpose(name):
    """Every sigmoid, exp, tanh, SiLU, ELU, ReLU and softplus of a matrix applied to its transpose and transposed
    back (one compile): the normal form computes pointwise ops before permutes and joins the two transposes, so
    every fusion covers what it covered before (a chain cut at the transpose would still count one fusion)."""
    gm, inputs, _, _ = _captured(name)
    _compile(gm, inputs)
    before = sorted(f.detail for f in hecate.last_report().fusions)
    done = _check(name, [("pointwise under a transpose", None)])
    assert done, f"{name} has no pointwise function of a matrix: the case tests nothing"
    assert sorted(f.detail for f in hecate.last_report().fusions) == before, (done, str(hecate.last_report()))
