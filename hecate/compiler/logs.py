"""Hecate's log, switched on the way torch's own logs are.

    TORCH_LOGS="hecate"   every pass decision (fusions, near-misses with the user's source
                          line) and the time of each compile stage
    TORCH_LOGS="+hecate"  the same at DEBUG level

or from Python: ``torch._logging.set_logs(modules={"hecate": logging.INFO})``.
``options={"progress": True}`` prints the stages to stderr as they run, log or not.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from typing import Iterator

import torch._logging

log = logging.getLogger("hecate")
torch._logging._internal.register_log("hecate", "hecate")


@contextlib.contextmanager
def stage(name: str, progress: bool) -> Iterator[None]:
    """Time one compile stage: log it, and print it to stderr when ``progress`` is asked for."""
    if progress:
        print(f"hecate: {name} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
        yield
    finally:
        elapsed = time.perf_counter() - start
        log.info("stage %s: %.3f s", name, elapsed)
        if progress:
            print(f"hecate: {name} done in {elapsed:.2f} s", file=sys.stderr, flush=True)
