"""ONNX translation and ATen decomposition of ``hecate::qk_preprocess`` (filled in below)."""
