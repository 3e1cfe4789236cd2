"""Hecate's fused ops, ``torch.ops.hecate.*``: one folder per op.

Each folder reads top to bottom: ``naive.py`` (what it computes, the plain
PyTorch reference), ``kernels.py`` (Triton forward and backward), ``op.py`` (the
``torch.library.custom_op``: schema, fake, autograd, CPU and Triton paths) and
``export.py`` (ONNX translation and ATen decomposition, registered in
:mod:`hecate.lowering.registry`). Importing this package registers every op.
"""

from hecate.lowering import kl_attention, kl_decode, linear_attention, memory_scan, qk_preprocess  # noqa: E402,F401
