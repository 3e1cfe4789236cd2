"""``torch.ops.hecate.memory_scan``: the l_p associative-memory recurrence (see :mod:`.op`)."""

from hecate.lowering.memory_scan import op  # noqa: F401  (registers the op)
from hecate.lowering.memory_scan.naive import memory_scan_naive  # noqa: F401
from hecate.lowering.memory_scan import export  # noqa: F401  (registers the ONNX translation and decomposition)
