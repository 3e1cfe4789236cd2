"""Test set-up: without a GPU, Triton kernels run under the CPU interpreter.

TRITON_INTERPRET must be set before triton is first imported (importing torch
does not import it), so it is set here, before any test module imports hecate.
With a GPU the kernels run for real and the ``cuda``-marked tests run too.

HECATE_STRICT=1: an error inside a pass fails the test instead of being contained
and reported (what users get by default).

Inductor's and Triton's on-disk caches go to a fresh folder per run: an artifact left by another
checkout (another signature of a hecate op) must never be served to these tests.
"""

import os
import tempfile

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HECATE_STRICT", "1")
_cache = tempfile.mkdtemp(prefix="hecate-tests-cache-")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(_cache, "inductor"))
os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(_cache, "triton"))

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def fresh_dynamo():
    """Reset Dynamo's caches around a test that compiles."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
