"""``torch.ops.hecate.qk_preprocess``: projection → depthwise causal conv1d → SiLU → φ, fused.

``naive`` (the reference), ``kernels`` (Triton, imported on first use), ``op`` (the custom ops),
``export`` (ONNX translation, ATen decomposition). Importing this package registers them.
"""

from hecate.lowering.qk_preprocess import export, op  # noqa: F401
