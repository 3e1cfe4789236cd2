"""ONNX (onnxruntime) and MLIR (torch-mlir) export of a model that calls the fused op directly."""

import pytest
import torch

import hecate
import hecate.lowering  # noqa: F401  registers torch.ops.hecate.*
from hecate.testing import rel_err

OP = torch.ops.hecate.qk_preprocess.default


class DirectCall(torch.nn.Module):
    def __init__(self, d_in, d, k, projection, bias, activation, phi):
        super().__init__()
        self.proj = torch.nn.Linear(d_in, d, bias=bias) if projection else None
        self.conv = torch.nn.Conv1d(d, d, k, groups=d, bias=bias)
        self.activation, self.phi = activation, phi
        # matrix φ on heads of 3 channels, 5 features each
        matrix = phi in ("linear", "random_fourier", "performer")
        self.phi_weight = torch.nn.Parameter(torch.randn(5, 3) * 0.5) if matrix else None
        self.phi_bias = torch.nn.Parameter(torch.rand(5) * 6.28) if phi == "random_fourier" else None

    def forward(self, x):
        proj_weight = self.proj.weight if self.proj is not None else None
        proj_bias = self.proj.bias if self.proj is not None else None
        phi_params = [p for p in (self.phi_weight, self.phi_bias) if p is not None]
        return OP(x, proj_weight, proj_bias, self.conv.weight, self.conv.bias, self.activation, self.phi,
                  phi_params, 0.5)


VARIANTS = {
    "full-silu-elu1": dict(projection=True, bias=True, activation="silu", phi="elu1"),
    "full-silu-relu2": dict(projection=True, bias=True, activation="silu", phi="relu2"),
    "nobias-none-relu": dict(projection=True, bias=False, activation="none", phi="relu"),
    "conv-only-silu-exp": dict(projection=False, bias=True, activation="silu", phi="exp"),
    "conv-only-none-identity": dict(projection=False, bias=False, activation="none", phi="identity"),
    "full-silu-linear": dict(projection=True, bias=True, activation="silu", phi="linear"),
    "full-silu-random-fourier": dict(projection=True, bias=True, activation="silu", phi="random_fourier"),
    "conv-only-none-performer": dict(projection=False, bias=True, activation="none", phi="performer"),
}


def _model_and_input(variant):
    kw = VARIANTS[variant]
    d_in, d = (7, 6) if kw["projection"] else (6, 6)
    return DirectCall(d_in, d, 4, **kw).eval(), torch.randn(2, 9, d_in)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_onnx_export_matches_pytorch(variant, tmp_path):
    import onnxruntime as ort

    model, x = _model_and_input(variant)
    path = tmp_path / "qk.onnx"
    hecate.export_onnx(model, (x,), path)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    err = rel_err(torch.from_numpy(got), model(x))
    assert err <= 1e-4, f"onnxruntime vs PyTorch relative error {err:.2e} > 1e-4"


@pytest.mark.parametrize("output_type", ["torch", "linalg-on-tensors"])
@pytest.mark.parametrize("variant", ["full-silu-elu1", "conv-only-silu-exp", "full-silu-random-fourier",
                                     "conv-only-none-performer"])
def test_mlir_export_has_no_hecate_op(variant, output_type):
    model, x = _model_and_input(variant)
    text = hecate.export_mlir(model, (x,), output_type=output_type)
    assert "func.func @main" in text
    assert "hecate" not in text
    assert "torch.operator" not in text
