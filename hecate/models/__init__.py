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

from hecate.models import fep, memory, short_conv  # noqa: E402

EXAMPLES: dict[str, Example] = {
    **short_conv.EXAMPLES,
    "lp_memory": memory.lp_memory_example,
    "hebbian_memory": memory.hebbian_memory_example,
    "pure_fep": fep.demo_example,
}
