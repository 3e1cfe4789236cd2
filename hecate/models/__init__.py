"""The spec's models in plain PyTorch, written the way a researcher writes them.

Nothing here imports the compiler: these modules are what Hecate's passes must
recognise, not users of them.

``EXAMPLES`` maps a name to a function returning ``(model, example_args)``;
``hecate explain NAME`` and the examples use it.
"""

from __future__ import annotations

from typing import Callable

import torch

Example = Callable[[], tuple[torch.nn.Module, tuple]]

EXAMPLES: dict[str, Example] = {}
from hecate.models import memory  # noqa: E402,F401  registers lp_memory, hebbian_memory
