"""``torch.ops.hecate.linear_attention``: the Hebbian / linear-attention memory (see :mod:`.op`)."""

from hecate.lowering.linear_attention import op  # noqa: F401  (registers the op)
from hecate.lowering.linear_attention.naive import linear_attention_naive  # noqa: F401
from hecate.lowering.linear_attention import export  # noqa: F401  (registers the ONNX translation and decomposition)
