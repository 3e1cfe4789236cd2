"""hecate.kl_attention: fused vs the spec's broadcast form, both paths, forward and every gradient."""

import contextlib

import onnxruntime as ort
import pytest
import torch

import hecate
import hecate.lowering  # noqa: F401
from hecate.lowering.dispatch import triton_on_cpu
from hecate.lowering.kl_attention.naive import kl_attention_naive
from hecate.lowering.kl_attention.op import OUTPUT_NAMES
from hecate.testing import assert_close, assert_close_nonfinite, rel_err

OP = torch.ops.hecate.kl_attention

MASKS = [(False, False), (True, False), (True, True), (False, True)]  # (causal, mask_diagonal)


def _poison(t):
    return t.fill_(float("nan")) if t.dtype.is_floating_point else t


def _path(name):
    return triton_on_cpu() if name == "triton" else contextlib.nullcontext()


def _inputs(b, n, k, dv, dw, var_range=(0.3, 1.5), mu_scale=1.0, dtype=torch.float32):
    lo, hi = var_range
    mu = (torch.randn(b, n, k, dtype=dtype) * mu_scale).requires_grad_()
    var = (lo * (hi / lo) ** torch.rand(b, n, k, dtype=dtype)).requires_grad_()  # log-uniform in [lo, hi]
    rv = torch.randn(b, n, dv, dtype=dtype, requires_grad=True)
    cv = torch.randn(b, n, dw, dtype=dtype, requires_grad=True)
    return mu, var, rv, cv


def _weighted_sum(outputs, weights):
    """Σ w·out over every output (−inf lse of an empty row excluded: it has no gradient)."""
    total = 0
    for out, w in zip(outputs, weights):
        total = total + torch.where(torch.isinf(out), 0.0, out * w.to(out.dtype)).sum()
    return total


def _check_against_reference(mu, var, rv, cv, kappa, causal, mask_diagonal, path, tol):
    with _path(path):
        got = OP(mu, var, rv, cv, kappa, causal, mask_diagonal)
    args64 = [t.detach().double().requires_grad_() for t in (mu, var, rv, cv)]
    ref = kl_attention_naive(*args64, kappa, causal, mask_diagonal)
    weights = [torch.randn(r.shape, dtype=torch.float64) for r in ref]
    for name, g, r in zip(OUTPUT_NAMES, got, ref):
        assert torch.equal(torch.isinf(g), torch.isinf(r)), name
        assert_close(name, torch.where(torch.isinf(g), 0.0, g), torch.where(torch.isinf(r), 0.0, r).float(), tol)
    with _path(path):
        grads = torch.autograd.grad(_weighted_sum(got, weights), (mu, var, rv, cv))
    ref_grads = torch.autograd.grad(_weighted_sum(ref, weights), args64)
    for name, g, r in zip(("d mu", "d var", "d row_values", "d col_values"), grads, ref_grads):
        assert torch.isfinite(g).all(), name
        if r.numel() == 0:
            assert g.shape == r.shape, name
        elif r.norm() > 1e-6 * max(1.0, float(args64[0].detach().norm())):
            assert_close(name, g, r.float(), tol)
        else:  # the exact gradient vanishes (N = 1): what is left is rounding
            assert g.abs().max() < 1e-4, (name, g.abs().max())


@pytest.mark.parametrize("path", ["cpu", "triton"])
@pytest.mark.parametrize("causal,mask_diagonal", MASKS)
def test_matches_reference_odd_shapes(path, causal, mask_diagonal):
    mu, var, rv, cv = _inputs(2, 19, 5, 3, 4)  # N not a multiple of the tile, 2K = 10 not a power of two
    _check_against_reference(mu, var, rv, cv, 0.7, causal, mask_diagonal, path, 2e-5)


@pytest.mark.parametrize("causal,mask_diagonal", MASKS)
def test_cpu_path_over_several_row_blocks(causal, mask_diagonal):
    """N = BLOCK_ROWS + 21: the op's CPU path runs two blocks of query rows, the second one short."""
    from hecate.lowering.kl_attention.matmul_form import BLOCK_ROWS

    mu, var, rv, cv = _inputs(2, BLOCK_ROWS + 21, 5, 3, 4)
    _check_against_reference(mu, var, rv, cv, 0.7, causal, mask_diagonal, "cpu", 2e-5)


@pytest.mark.parametrize("path", ["cpu", "triton"])
@pytest.mark.parametrize("causal,mask_diagonal", MASKS)
def test_single_position(path, causal, mask_diagonal):
    """N = 1: the only key is the query itself; with the diagonal masked the row has no key at all."""
    mu, var, rv, cv = _inputs(2, 1, 3, 2, 2)
    _check_against_reference(mu, var, rv, cv, 1.0, causal, mask_diagonal, path, 2e-5)
    if mask_diagonal:
        with _path(path):
            out = OP(mu, var, rv, cv, 1.0, causal, mask_diagonal)
        for name, o in zip(OUTPUT_NAMES[:-1], out[:-1]):
            assert torch.equal(o, torch.zeros_like(o)), name  # β = 0 on a row with no key: sums are 0, not NaN
        assert torch.isneginf(out[-1]).all()


@pytest.mark.parametrize("path", ["cpu", "triton"])
@pytest.mark.parametrize("dv,dw", [(0, 3), (3, 0)])
def test_without_row_or_column_values(path, dv, dw):
    mu, var, rv, cv = _inputs(1, 20, 4, dv, dw)
    _check_against_reference(mu, var, rv, cv, 0.5, True, False, path, 2e-5)


@pytest.mark.parametrize("bm,bn", [(32, 16), (16, 32)])
@pytest.mark.parametrize("causal,mask_diagonal", MASKS)
def test_kernels_with_unequal_tiles(monkeypatch, bm, bn, causal, mask_diagonal):
    """Row and key tiles of different sizes (the launches are 16×16; benchmarks/kl_attention_tiles.py times
    others): the causal bounds of the row and column loops hold for either."""
    from hecate.lowering.kl_attention import op

    launch = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=4)
    monkeypatch.setattr(op, "forward_launch", lambda k: launch)
    monkeypatch.setattr(op, "backward_launch", lambda: launch)
    mu, var, rv, cv = _inputs(2, 45, 5, 3, 4)  # row blocks and key blocks both end short
    _check_against_reference(mu, var, rv, cv, 0.7, causal, mask_diagonal, "triton", 2e-5)


class _SharedMemoryLimited:
    """A kernel that launches only when pipelined at most ``fits`` stages deep (as on a GPU whose shared
    memory holds fewer), recording the depths asked for."""

    def __init__(self, kernel, fits):
        from triton.runtime.errors import OutOfResources

        self.kernel, self.fn, self.fits, self.asked, self._error = kernel, kernel.fn, fits, [], OutOfResources

    def __getitem__(self, grid):
        def launch(*args, num_stages, **config):
            self.asked.append(num_stages)
            if num_stages > self.fits:
                raise self._error(245760, 232448, "shared memory")
            return self.kernel[grid](*args, num_stages=num_stages, **config)
        return launch


@pytest.mark.parametrize("fits", [2, 0], ids=["fewer stages", "never"])
def test_kernel_that_does_not_fit_shared_memory(monkeypatch, fits):
    """A kernel too big for the GPU's shared memory at Triton's default pipelining is launched with fewer
    stages (once found, the depth is reused); one that fits at none runs the matmul form, with a warning.
    Either way the op computes the reference."""
    from hecate.lowering.kl_attention import kernels, op

    monkeypatch.setattr(op, "_stages_that_fit", {})
    limited = _SharedMemoryLimited(kernels._bwd_cols, fits)
    monkeypatch.setattr(kernels, "_bwd_cols", limited)
    mu, var, rv, cv = _inputs(2, 19, 5, 3, 4)
    with (pytest.warns(RuntimeWarning, match="_bwd_cols") if not fits else contextlib.nullcontext()):
        _check_against_reference(mu, var, rv, cv, 0.7, True, False, "triton", 2e-5)
    assert limited.asked == [3, 2, 1] if not fits else limited.asked == [3, 2]
    if fits:
        with triton_on_cpu():
            torch.autograd.grad(sum(o.sum() for o in OP(mu, var, rv, cv, 0.7, True, False)[:-1]), mu)
        assert limited.asked == [3, 2, 2]


def test_triton_writes_every_output(monkeypatch):
    """Every buffer the Triton path allocates starts as NaN: an unwritten element would stay NaN."""
    mu, var, rv, cv = _inputs(2, 21, 3, 2, 3)
    real_new_empty, real_empty_like = torch.Tensor.new_empty, torch.empty_like
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *s, **kw: _poison(real_new_empty(self, *s, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda t, **kw: _poison(real_empty_like(t, **kw)))
    temperature = torch.tensor(1.1, requires_grad=True)  # its per-row sums are a buffer of their own
    for causal, mask_diagonal in [(True, False), (False, False)]:
        with triton_on_cpu():
            out = OP(mu, var, rv, cv, 0.9, causal, mask_diagonal, temperature)
            grads = torch.autograd.grad(sum(o.sum() for o in out), (mu, var, rv, cv, temperature))
        for name, o in zip(OUTPUT_NAMES, out):
            assert not torch.isnan(o).any(), name
        for g in grads:
            assert not torch.isnan(g).any()
    monkeypatch.undo()
    ref = kl_attention_naive(mu.detach(), var.detach(), rv.detach(), cv.detach(), 0.9 * 1.1, False, False)
    assert_close("row_sum", out[0], ref[0], 2e-5)


@pytest.mark.parametrize("path", ["cpu", "triton"])
@pytest.mark.parametrize("case", ["tiny variances", "huge variances", "small kappa", "mixed scales"])
def test_numerical_safety(path, case):
    """Extreme variances and a sharp softmax give finite results, close to the fp64 broadcast form.

    With κ small or variances spread over six decades and the diagonal kept, β is one-hot on
    KL_ii = 0 and the β·KL sums are pure rounding; the diagonal is masked there so they
    measure something. The bound is the tolerance or 4× the error of the spec's own fp32
    broadcast form, whichever is larger (fp32 KL of terms ~1e6 carries that rounding).
    """
    kappa, var_range, mu_scale, tol = {
        "tiny variances": (1.0, (1e-4, 1e-3), 0.05, 1e-3),
        "huge variances": (1.0, (1e3, 1e4), 30.0, 1e-4),
        "small kappa": (0.01, (0.5, 2.0), 1.0, 1e-3),
        "mixed scales": (0.3, (1e-3, 1e3), 1.0, 1e-3),
    }[case]
    mask_diagonal = case in ("small kappa", "mixed scales")
    mu, var, rv, cv = _inputs(1, 13, 4, 2, 2, var_range, mu_scale)
    with _path(path):
        out = OP(mu, var, rv, cv, kappa, True, mask_diagonal)
        grads = torch.autograd.grad(sum(o.sum() for o in out), (mu, var, rv, cv))
    assert all(torch.isfinite(o).all() for o in out[:-1])
    assert torch.isfinite(out[-1][:, 1:]).all()  # lse: −inf only on row 0 when it has no key
    assert all(torch.isfinite(g).all() for g in grads)
    ref = kl_attention_naive(mu.double(), var.double(), rv.double(), cv.double(), kappa, True, mask_diagonal)
    ref32 = kl_attention_naive(mu.detach(), var.detach(), rv.detach(), cv.detach(), kappa, True, mask_diagonal)
    finite = lambda t: torch.where(torch.isinf(t), 0.0, t)  # noqa: E731
    for name, o, r, r32 in zip(OUTPUT_NAMES, out, ref, ref32):
        bound = max(tol, 4 * rel_err(finite(r32), finite(r)))
        assert_close(name, finite(o), finite(r).float(), bound)


def test_bad_inputs_raise_clear_errors():
    mu, var, rv, cv = (t.detach() for t in _inputs(1, 4, 3, 2, 2))
    with pytest.raises(ValueError, match=r"mu must be \[B, N, K\], got shape \(4, 3\)"):
        OP(mu[0], var[0], rv, cv, 1.0, True, False)
    with pytest.raises(ValueError, match=r"var must have mu's shape \(1, 4, 3\), got \(1, 4, 2\)"):
        OP(mu, var[..., :2], rv, cv, 1.0, True, False)
    with pytest.raises(ValueError, match=r"row_values must be \[B, N, D\] with B, N = \(1, 4\), got shape \(1, 3, 2\)"):
        OP(mu, var, rv[:, :3], cv, 1.0, True, False)
    with pytest.raises(ValueError, match=r"col_values must have mu's dtype torch.float32, got torch.float64"):
        OP(mu, var, rv, cv.double(), 1.0, True, False)
    with pytest.raises(ValueError, match=r"kappa must be a finite number > 0, got -1.0"):
        OP(mu, var, rv, cv, -1.0, True, False)
    with pytest.raises(ValueError, match=r"temperature must be a 0-d floating tensor, got shape \(1,\)"):
        OP(mu, var, rv, cv, 1.0, True, False, torch.ones(1))


@pytest.mark.parametrize("path", ["cpu", "triton"])
def test_opcheck(path):
    mu, var, rv, cv = _inputs(1, 5, 2, 2, 3)
    with _path(path):
        torch.library.opcheck(OP, (mu, var, rv, cv, 0.8, True, False))
        torch.library.opcheck(OP, (mu, var, rv, cv, 1.3, False, True))
        torch.library.opcheck(OP, (mu, var, rv, cv, 0.5, True, True, torch.tensor(1.7, requires_grad=True)))
        torch.library.opcheck(OP, (mu, var, rv, cv, 0.5, True, False, torch.tensor(0.0, requires_grad=True), None,
                                   True))
        torch.library.opcheck(OP, (mu, var, rv, cv, 0.7, False, False, None, torch.ones(5, 5, dtype=torch.bool).tril()))
        torch.library.opcheck(OP, (mu, var, rv, cv, 0.7, False, False, None, _random_mask(5, 1)))
        torch.library.opcheck(OP, (mu, var, rv, cv, 0.7, True, False, None, _per_sequence_mask(mu.shape[0], 5)))


def _random_mask(n, seed):
    allowed = torch.rand(n, n, generator=torch.Generator().manual_seed(seed)) < 0.6
    allowed[3] = False  # a row with no allowed key
    return allowed


def _per_sequence_mask(b, n):
    """[B, N, N]: sequence b's keys before b + 1 padding (a key-padding mask, left padded: its first rows have no
    allowed key under a causal mask)."""
    keep = torch.arange(n) >= torch.arange(1, b + 1)[:, None]
    return keep[:, None, :].expand(b, n, n).clone()


@pytest.mark.parametrize("path", ["cpu", "triton"])
@pytest.mark.parametrize("mask", ["causal", "causal_no_self", "random", "causal_per_sequence", "per_sequence"])
def test_mask_given_at_run_time(path, mask):
    """``allowed`` [N, N] or [B, N, N]: a mask equal to one the kernels take runs them (as the flags would); any
    other runs the matmul form. Every output and gradient against the broadcast reference with that mask,
    float64."""
    from hecate.lowering.kl_attention.naive import allowed_keys

    n = 19
    allowed = {"causal": allowed_keys(n, True, False), "causal_no_self": allowed_keys(n, True, True),
               "random": _random_mask(n, 3), "causal_per_sequence": allowed_keys(n, True, False).expand(2, n, n),
               "per_sequence": _per_sequence_mask(2, n) & allowed_keys(n, True, False)}[mask]
    mu, var, rv, cv = _inputs(2, n, 5, 3, 4)
    with _path(path):
        got = OP(mu, var, rv, cv, 0.7, False, False, None, allowed)
    args64 = [t.detach().double().requires_grad_() for t in (mu, var, rv, cv)]
    ref = kl_attention_naive(*args64, 0.7, False, False, allowed)
    weights = [torch.randn(r.shape, dtype=torch.float64) for r in ref]
    for name, g, r in zip(OUTPUT_NAMES, got, ref):
        assert torch.equal(torch.isinf(g), torch.isinf(r)), name
        assert_close(name, torch.where(torch.isinf(g), 0.0, g), torch.where(torch.isinf(r), 0.0, r).float(), 2e-5)
    with _path(path):
        grads = torch.autograd.grad(_weighted_sum(got, weights), (mu, var, rv, cv))
    ref_grads = torch.autograd.grad(_weighted_sum(ref, weights), args64)
    for name, g, r in zip(("d mu", "d var", "d row_values", "d col_values"), grads, ref_grads):
        assert_close(name, g, r.float(), 2e-5)


def test_mask_given_at_run_time_over_several_row_blocks():
    """A mask of no kernel's pattern on the CPU path's blocks of query rows (the second one short)."""
    from hecate.lowering.kl_attention.matmul_form import BLOCK_ROWS

    n = BLOCK_ROWS + 21
    allowed = _random_mask(n, 5)
    mu, var, rv, cv = _inputs(1, n, 3, 2, 2)
    got = OP(mu, var, rv, cv, 0.9, True, False, None, allowed)  # the flags' mask and the given one, together
    keys = torch.ones(n, n, dtype=torch.bool).tril() & allowed
    ref = kl_attention_naive(*(t.detach().double() for t in (mu, var, rv, cv)), 0.9, False, False, keys)
    for name, g, r in zip(OUTPUT_NAMES, got, ref):
        assert_close(name, torch.where(torch.isinf(g), 0.0, g), torch.where(torch.isinf(r), 0.0, r).float(), 2e-5)


def test_mask_given_at_run_time_is_checked():
    mu, var, rv, cv = _inputs(1, 5, 2, 2, 3)
    with pytest.raises(ValueError, match=r"allowed must be a bool \[N, N\] or \[B, N, N\] tensor with B, N = 1, 5, "
                                         r"got shape \(5, 4\)"):
        OP(mu, var, rv, cv, 1.0, False, False, None, torch.ones(5, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"got shape \(2, 5, 5\)"):
        OP(mu, var, rv, cv, 1.0, False, False, None, torch.ones(2, 5, 5, dtype=torch.bool))


@pytest.mark.parametrize("path", ["cpu", "triton"])
@pytest.mark.parametrize("causal,mask_diagonal", MASKS)
def test_temperature_known_at_run_time_and_its_gradient(path, causal, mask_diagonal):
    """κ = kappa · temperature (a learned 0-d tensor): every output and every gradient, the temperature's
    included, against the broadcast reference in float64 at κ = 0.6 · 1.4, on odd shapes."""
    mu, var, rv, cv = _inputs(2, 19, 5, 3, 4)
    temperature = torch.tensor(1.4, requires_grad=True)
    with _path(path):
        got = OP(mu, var, rv, cv, 0.6, causal, mask_diagonal, temperature)
    args64 = [t.detach().double().requires_grad_() for t in (mu, var, rv, cv, temperature)]
    ref = kl_attention_naive(*args64[:4], 0.6 * args64[4], causal, mask_diagonal)
    weights = [torch.randn(r.shape, dtype=torch.float64) for r in ref]
    for name, g, r in zip(OUTPUT_NAMES, got, ref):
        assert_close(name, torch.where(torch.isinf(g), 0.0, g), torch.where(torch.isinf(r), 0.0, r).float(), 2e-5)
    with _path(path):
        grads = torch.autograd.grad(_weighted_sum(got, weights), (mu, var, rv, cv, temperature))
    ref_grads = torch.autograd.grad(_weighted_sum(ref, weights), args64)
    for name, g, r in zip(("d mu", "d var", "d row_values", "d col_values", "d temperature"), grads, ref_grads):
        assert_close(name, g, r.float(), 2e-5)


@pytest.mark.parametrize("path", ["cpu", "triton"])
@pytest.mark.parametrize("temperature", [-0.7, float("inf")], ids=["negative", "infinite"])
def test_any_run_time_temperature_computes_what_eager_does(path, temperature):
    """A run-time κ is not checked against a range: −KL/κ for a negative κ, and 0 (uniform β) for an
    infinite one (an inverse temperature annealed from 0), as the model's own code computes them."""
    mu, var, rv, cv = (t.detach() for t in _inputs(2, 7, 3, 2, 3))
    with _path(path):
        got = OP(mu, var, rv, cv, 1.0, True, False, torch.tensor(temperature))
    ref = kl_attention_naive(mu.double(), var.double(), rv.double(), cv.double(), temperature, True, False)
    for name, g, r in zip(OUTPUT_NAMES[:-1], got, ref):
        assert_close(name, g, r.float(), 2e-5)


@pytest.mark.parametrize("path", ["cpu", "triton"])
@pytest.mark.parametrize("value", [0.0, 1e-40, 0.8], ids=["zero", "underflowed", "positive"])
def test_inverse_temperature_and_its_gradient_at_zero(path, value):
    """κ = kappa / temperature: the score −KL · temperature / kappa is linear in the temperature, so every output
    and gradient is finite and equals the reference's where the temperature is 0 (a learned scale that starts
    at 0, or underflows), where κ = kappa · (1/t) would give a NaN gradient (probe r18)."""
    mu, var, rv, cv = _inputs(2, 9, 3, 2, 3)
    temperature = torch.tensor(value, requires_grad=True)
    with _path(path):
        got = OP(mu, var, rv, cv, 0.5, True, False, temperature, None, True)
    args64 = [t.detach().double().requires_grad_() for t in (mu, var, rv, cv, temperature)]
    ref = kl_attention_naive(*args64[:4], None, True, False, inverse_kappa=args64[4] / 0.5)
    weights = [torch.randn(r.shape, dtype=torch.float64) for r in ref]
    for name, g, r in zip(OUTPUT_NAMES, got, ref):
        assert_close(name, g, r.float(), 2e-5)
    with _path(path):
        grads = torch.autograd.grad(_weighted_sum(got, weights), (mu, var, rv, cv, temperature))
    ref_grads = torch.autograd.grad(_weighted_sum(ref, weights), args64)
    for name, g, r in zip(("d mu", "d var", "d row_values", "d col_values", "d temperature"), grads, ref_grads):
        assert torch.isfinite(g).all(), name
        assert_close(name, g, r.float(), 2e-5)


class _Attention(torch.nn.Module):
    def __init__(self, causal, mask_diagonal, learned_temperature=False, mask_buffer=False):
        super().__init__()
        self.causal, self.mask_diagonal = causal, mask_diagonal
        self.temperature = torch.nn.Parameter(torch.tensor(1.3)) if learned_temperature else None
        self.inverse = learned_temperature == "inverse"
        masks = {False: None, True: _random_mask(6, 2), "per_sequence": _per_sequence_mask(2, 6)}
        self.register_buffer("allowed", masks[mask_buffer])

    def forward(self, mu, var, rv, cv):
        return OP(mu, var, rv, cv, 0.7, self.causal, self.mask_diagonal, self.temperature, self.allowed, self.inverse)


@pytest.mark.parametrize("causal,mask_diagonal,learned_temperature,mask_buffer",
                         [(True, True, False, False), (False, False, False, False), (True, False, True, False),
                          (False, False, False, True), (True, False, True, True), (True, False, False, "per_sequence"),
                          (True, False, "inverse", False)])
def test_onnx_translation_runs_in_onnxruntime(tmp_path, causal, mask_diagonal, learned_temperature, mask_buffer):
    args = tuple(t.detach() for t in _inputs(2, 6, 3, 2, 3))
    model = _Attention(causal, mask_diagonal, learned_temperature, mask_buffer)
    path = tmp_path / "kl_attention.onnx"
    hecate.export_onnx(model, args, path)
    session = ort.InferenceSession(str(path))
    got = session.run(None, {i.name: a.numpy() for i, a in zip(session.get_inputs(), args)})
    for name, g, r in zip(OUTPUT_NAMES, got, model(*args)):
        g = torch.from_numpy(g)
        assert torch.equal(torch.isinf(g), torch.isinf(r)), name
        assert_close(name, torch.where(torch.isinf(g), 0.0, g), torch.where(torch.isinf(r), 0.0, r), 1e-4)


@pytest.mark.parametrize("output_type", ["torch", "linalg-on-tensors"])
def test_mlir_export(output_type):
    args = tuple(t.detach() for t in _inputs(1, 5, 3, 2, 2))
    text = hecate.export_mlir(_Attention(True, False, learned_temperature=True), args, output_type=output_type)
    assert "hecate" not in text and "torch.operator" not in text
    args = tuple(t.detach() for t in _inputs(1, 6, 3, 2, 2))
    text = hecate.export_mlir(_Attention(False, False, mask_buffer=True), args, output_type=output_type)
    assert "hecate" not in text and "torch.operator" not in text
    assert ("linalg.generic" in text or "linalg.matmul" in text or "linalg.batch_matmul" in text) \
        if output_type == "linalg-on-tensors" else "torch.aten.bmm" in text or "torch.aten.matmul" in text


# stability: no less accurate than eager fp32, against float64, where the dot form cancels


def _clustered_beliefs(b, n, k, log_var_range, spread, gen):
    """Pairs of near beliefs (KL small, carrying β), pairs spread `spread` σ apart, variances e^±range."""
    log_var = (torch.rand(b, n, k, generator=gen, dtype=torch.float64) * 2 - 1) * log_var_range
    sigma = (0.5 * log_var).exp()
    mu = 5.0 + spread / 2 * sigma * torch.randn(b, n, k, generator=gen, dtype=torch.float64)
    half = n // 2
    mu[:, 1::2] = mu[:, ::2][:, :half] + 0.3 * sigma[:, 1::2] * torch.randn(b, half, k, generator=gen,
                                                                              dtype=torch.float64)
    log_var[:, 1::2] = log_var[:, ::2][:, :half] + 0.1 * torch.randn(b, half, k, generator=gen, dtype=torch.float64)
    return mu, log_var.exp()


def _outputs_and_grads(fn, inputs, dtype, out_weights, kappa, causal):
    args = [t.to(dtype).requires_grad_() for t in inputs]
    outs = fn(*args, kappa, causal, False)[:6]
    loss = sum((o.double() * w).sum() for o, w in zip(outs, out_weights))
    return [o.detach() for o in outs] + list(torch.autograd.grad(loss, args))


@pytest.mark.parametrize("path", ["cpu", "triton"])
@pytest.mark.parametrize("log_var_range,spread,kappa", [(7.0, 30.0, 1.0), (7.0, 30.0, 1e-3), (1.0, 30.0, 1e-3),
                                                         (7.0, 1.0, 0.1)])
def test_no_less_stable_than_eager(path, log_var_range, spread, kappa):
    """Σβ·KL, β-weighted sums and every gradient within 10× of eager fp32's own error vs float64."""
    gen = torch.Generator().manual_seed(0)
    b, n, k = 2, 12, 4
    mu, var = _clustered_beliefs(b, n, k, log_var_range, spread, gen)
    inputs = (mu, var, torch.randn(b, n, 3, generator=gen, dtype=torch.float64),
              torch.randn(b, n, 2, generator=gen, dtype=torch.float64))
    weights = [torch.randn(s, generator=gen, dtype=torch.float64)
               for s in [(b, n, 3), (b, n, 3), (b, n), (b, n, 2), (b, n, 2), (b, n, 2)]]
    ref = _outputs_and_grads(kl_attention_naive, inputs, torch.float64, weights, kappa, True)
    eager = _outputs_and_grads(kl_attention_naive, inputs, torch.float32, weights, kappa, True)
    with _path(path):
        fused = _outputs_and_grads(OP, inputs, torch.float32, weights, kappa, True)
    names = list(OUTPUT_NAMES[:6]) + ["d mu", "d var", "d row_values", "d col_values"]
    for name, r, e, f in zip(names, ref, eager, fused):
        eager_err, fused_err = rel_err(e.double(), r), rel_err(f.double(), r)
        assert fused_err <= 10 * eager_err + 1e-7, f"{name}: fused {fused_err:.2e}, eager fp32 {eager_err:.2e}"


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("belief,value", [("mu", float("nan")), ("mu", float("inf")), ("mu", -float("inf")),
                                          ("var", float("inf")), ("var", 0.0)])
@pytest.mark.parametrize("path", ["cpu", "triton"])
def test_a_belief_that_is_not_finite_gives_what_the_reference_gives(path, belief, value, causal):
    """A NaN or infinite μ, or a variance of inf or 0, in one belief: every output and gradient is NaN where the
    broadcast form's is, ±inf where its is, and equal elsewhere. A key at μ = inf is at KL = inf from every
    other belief (β = 0 there, the rest finite): the matmul form's c_i + a_i·b_j + d_j would be inf − inf, so
    such beliefs take the per-pair form; a query row that is NaN has β NaN at its masked keys too, as a softmax
    over a row holding NaN does, and the kernels give every column sum and ∂/∂V_j of its sequence that NaN."""
    mu, var, rv, cv = (t.detach() for t in _inputs(1, 6, 3, 2, 2))
    (mu if belief == "mu" else var)[0, 2, 1] = value
    weights = [torch.randn(1, 6, d) for d in (2, 2)] + [torch.randn(1, 6)] + [torch.randn(1, 6, 2)] * 3

    def run(fn):
        inputs = [t.clone().requires_grad_() for t in (mu, var, rv, cv)]
        outputs = fn(*inputs, 0.9, causal, False)
        total = sum((o * w).sum() for o, w in zip(outputs[:6], weights))
        return list(outputs) + list(torch.autograd.grad(total, inputs))

    with _path(path):
        got = run(OP)
    ref = run(kl_attention_naive)
    for name, g, r in zip(list(OUTPUT_NAMES) + ["d mu", "d var", "d row_values", "d col_values"], got, ref):
        assert torch.equal(torch.isnan(g), torch.isnan(r)), name
        assert torch.equal(torch.isinf(g), torch.isinf(r)), name
        finite = torch.isfinite(r)
        assert torch.equal(g[~finite & ~torch.isnan(r)], r[~finite & ~torch.isnan(r)]), name
        assert_close(name, g.detach()[finite], r.detach()[finite], 1e-5)


@pytest.mark.parametrize("path", ["cpu", "triton"])
def test_float64_is_computed_in_float64(path):
    inputs = [t.detach().double().requires_grad_() for t in _inputs(2, 5, 3, 2, 2)]
    with _path(path):
        got = OP(*inputs, 0.7, True, True)
    ref = kl_attention_naive(*inputs, 0.7, True, True)
    for name, g, r in zip(OUTPUT_NAMES[:6], got, ref):
        assert g.dtype == torch.float64
        assert_close(name, g, r, 1e-12)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float64, 1e-13)])
@pytest.mark.parametrize("dv,dw", [(3, 4), (0, 2), (2, 0)])
@pytest.mark.parametrize("causal,mask_diagonal", MASKS)
def test_row_blocks_equal_one_block(causal, mask_diagonal, dv, dw, dtype, tol):
    """The CPU path's blocks of 16 query rows (N = 37: blocks of 16, 16, 5) give what one block of N rows
    gives, forward and every gradient, within `tol` relative (the sums over blocks only reorder roundings),
    contiguous as the fake kernels promise (the column sums are formed transposed)."""
    from hecate.lowering.kl_attention import matmul_form

    mu, var, rv, cv = (t.detach() for t in _inputs(2, 37, 3, dv, dw, dtype=dtype))
    kappa = 0.6
    assert len(matmul_form.row_blocks(37, causal, 16)) == 3
    one = matmul_form.forward(mu, var, rv, cv, kappa, causal, mask_diagonal, block_rows=37)
    blocked = matmul_form.forward(mu, var, rv, cv, kappa, causal, mask_diagonal, block_rows=16)
    for name, b, o in zip(OUTPUT_NAMES, blocked, one):
        assert b.shape == o.shape and b.dtype == o.dtype and b.is_contiguous() and o.is_contiguous(), name
        assert_close_nonfinite(name, b, o, tol)  # lse: −inf on row 0 when causal and diagonal-masked
    grads = [torch.randn(o.shape, dtype=dtype) for o in one]
    one = matmul_form.backward(mu, var, rv, cv, grads, kappa, causal, mask_diagonal, block_rows=37)
    blocked = matmul_form.backward(mu, var, rv, cv, grads, kappa, causal, mask_diagonal, block_rows=16)
    for name, b, o in zip(("d mu", "d var", "d row_values", "d col_values"), blocked, one):
        assert b.shape == o.shape and b.dtype == o.dtype and b.is_contiguous() and o.is_contiguous(), name
        if o.numel():
            assert_close(name, b, o, tol)
