"""``hecate.kl_decode_ce`` / ``hecate.kl_decode_logits``: decoding through the token prior bank, −KL(q‖π_v)/τ."""

from hecate.lowering.kl_decode import op  # noqa: F401  registers the ops
from hecate.lowering.kl_decode import export  # noqa: F401  registers their ONNX translations and decompositions
