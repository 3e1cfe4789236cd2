"""``hecate.kl_attention``: softmax(−KL(q_i‖q_j)/κ) attention and the β-weighted sums the Q-flow reads."""

from hecate.lowering.kl_attention import op  # noqa: F401  registers the op
from hecate.lowering.kl_attention import export  # noqa: F401  registers its ONNX translation and decomposition
