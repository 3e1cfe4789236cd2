"""``torch.ops.hecate.kl_attention``: pairwise-KL attention and what the Q-flow reads from it.

Schema::

    kl_attention(Tensor mu, Tensor var, Tensor row_values, Tensor col_values,
                 float kappa, bool causal, bool mask_diagonal, Tensor? temperature=None,
                 Tensor? allowed=None, bool inverse_temperature=False)
        -> (row_sum, row_kl_sum, energy, col_sum, col_kl_sum, col_energy_sum, lse)

    mu, var        [B, N, K]   belief means and variances (var > 0; the caller adds any eps)
    row_values V   [B, N, Dv]  per-key features (Dv may be 0)
    col_values W   [B, N, Dw]  per-query features for the transposed sums (Dw may be 0)
    kappa          > 0         attention temperature, times
    temperature    0-d         a temperature known at run time (learned, or a float torch.compile passes in
                               as a tensor): κ = kappa · temperature, and κ gets its gradient. Any value
                               computes what −KL/κ gives in eager (0 and inf included: an annealed inverse
                               temperature), without the stability bounds below for κ ≤ 0
    inverse_temperature        κ = kappa / temperature instead: the score −KL · temperature / kappa is linear in
                               it, so its gradient stays finite where temperature is 0 (a model that writes
                               −t · KL with t a learned scale that starts at 0)
    causal         key j allowed for query i only if j ≤ i
    mask_diagonal  key i never allowed for query i
    allowed        [N, N] or [B, N, N] bool  a mask known at run time, the same for every sequence (a causal
                               mask a model keeps in a buffer) or one per sequence (a key-padding mask):
                               key j allowed for query i only if allowed[(b,) i, j] too. Each call compares
                               it with the kernels' masks (all keys, causal, no self, causal without self)
                               and runs the kernels with the one it equals; any other mask runs the matmul
                               form

    β_ij           = softmax_j(−KL(q_i‖q_j)/κ) over the allowed keys
    row_sum        [B, N, Dv]  Σ_j β_ij V_j
    row_kl_sum     [B, N, Dv]  Σ_j β_ij KL_ij V_j
    energy         [B, N]      Σ_j β_ij KL_ij
    col_sum        [B, N, Dw]  Σ_k β_ki W_k
    col_kl_sum     [B, N, Dw]  Σ_k β_ki KL_ki W_k
    col_energy_sum [B, N, Dw]  Σ_k β_ki energy_k W_k   (product rule through row k's softmax)
    lse            [B, N]      log Σ_j exp(−KL_ij/κ)   (−inf on a row with no allowed key)

These are exactly the sums the spec's Q-flow needs (see ``hecate/passes/kl_attention.py``
for how its gradient terms map onto them), and neither [B, N, N, K] nor [B, N, N] is
ever formed on the Triton path. A row with no allowed key (N = 1 with the diagonal
masked; row 0 when causal and diagonal-masked) has β_i· = 0: its sums are 0, not NaN
(the pass adds the NaN of a softmax over no key where the model's code has it).
float64 inputs run the ATen path in float64 (the kernels compute in fp32). So does a call on a GPU
whose shared memory holds a kernel's tiles at no pipelining depth, with a RuntimeWarning.

Differentiable in mu, var, row_values, col_values and temperature for every output
(the training step backprops through the unrolled Q-flow). The backward is its own op,
``hecate.kl_attention_backward``, which recomputes β from lse; with ∂L/∂l_ij the
cotangent of the logits l = −KL/κ, ∂L/∂κ = Σ_ij ∂L/∂l_ij · KL_ij / κ².
"""

from __future__ import annotations

import math
import warnings

import torch
import triton
from triton.runtime.errors import OutOfResources

from hecate.lowering.dispatch import check_devices, dense, use_triton
from hecate.lowering.kl_attention import matmul_form
from hecate.lowering.registry import differentiable_backward

OUTPUT_NAMES = ("row_sum", "row_kl_sum", "energy", "col_sum", "col_kl_sum", "col_energy_sum", "lse")


def check_inputs(mu, var, row_values, col_values, kappa, temperature=None, allowed=None) -> None:
    """Raise a ValueError naming the argument, what it was and what was expected (a temperature's value is
    not checked: any value computes what −KL/κ gives in eager)."""
    if mu.dim() != 3:
        raise ValueError(f"kl_attention: mu must be [B, N, K], got shape {tuple(mu.shape)}")
    if not mu.dtype.is_floating_point:
        raise ValueError(f"kl_attention: mu must be a floating tensor, got dtype {mu.dtype}")
    if var.shape != mu.shape:
        raise ValueError(f"kl_attention: var must have mu's shape {tuple(mu.shape)}, got {tuple(var.shape)}")
    if var.dtype != mu.dtype:
        raise ValueError(f"kl_attention: var must have mu's dtype {mu.dtype}, got {var.dtype}")
    check_devices("kl_attention", "mu", mu, var=var, row_values=row_values, col_values=col_values, allowed=allowed)
    for name, t in (("row_values", row_values), ("col_values", col_values)):
        if t.dim() != 3 or t.shape[:2] != mu.shape[:2]:
            raise ValueError(f"kl_attention: {name} must be [B, N, D] with B, N = {tuple(mu.shape[:2])}, "
                             f"got shape {tuple(t.shape)}")
        if t.dtype != mu.dtype:
            raise ValueError(f"kl_attention: {name} must have mu's dtype {mu.dtype}, got {t.dtype}")
    if not (isinstance(kappa, (int, float)) and math.isfinite(kappa) and kappa > 0):
        raise ValueError(f"kl_attention: kappa must be a finite number > 0, got {kappa!r}")
    if mu.shape[1] == 0 or mu.shape[2] == 0:
        raise ValueError(f"kl_attention: mu must have N >= 1 and K >= 1, got shape {tuple(mu.shape)}")
    if temperature is not None:
        if temperature.dim() != 0 or not temperature.dtype.is_floating_point:
            raise ValueError(f"kl_attention: temperature must be a 0-d floating tensor, got shape "
                             f"{tuple(temperature.shape)} and dtype {temperature.dtype}")
    n = mu.shape[1]
    if allowed is not None and (allowed.dtype != torch.bool or allowed.shape not in ((n, n), (mu.shape[0], n, n))):
        raise ValueError(f"kl_attention: allowed must be a bool [N, N] or [B, N, N] tensor with B, N = "
                         f"{mu.shape[0]}, {n}, got shape {tuple(allowed.shape)} and dtype {allowed.dtype}")


def resolve_mask(n: int, causal: bool, mask_diagonal: bool, allowed: torch.Tensor | None
                 ) -> tuple[bool, bool, torch.Tensor | None]:
    """(causal, mask_diagonal, masked): the flags of the kernels' mask that the flags and ``allowed`` together
    equal, masked None; else masked, the [(B,) N, N] pairs not allowed (True), for the matmul form. Reads the
    mask's values (on a GPU, waits for it)."""
    if allowed is None:
        return causal, mask_diagonal, None
    from hecate.lowering.kl_attention.naive import allowed_keys

    combined = allowed & allowed_keys(n, causal, mask_diagonal, allowed.device)
    for kind in ((False, False), (True, False), (False, True), (True, True)):
        if torch.equal(combined, allowed_keys(n, *kind, allowed.device).expand_as(combined)):
            return (*kind, None)
    return False, False, ~combined


def effective_kappa(kappa: float, temperature: torch.Tensor | None,
                    inverse_temperature: bool = False) -> float | torch.Tensor:
    """κ = kappa · temperature (kappa / temperature): a number, or a 0-d tensor (the ATen path reads it as one)."""
    if temperature is None:
        return kappa
    return kappa / temperature if inverse_temperature else kappa * temperature


def _kappa_value(kappa: float, temperature: torch.Tensor | None, inverse_temperature: bool = False) -> float:
    """κ as the number the kernels take (reading a GPU temperature waits for the GPU; a temperature of 0 read as
    an inverse one gives κ = inf)."""
    if temperature is None:
        return kappa
    return effective_kappa(kappa, temperature.double(), inverse_temperature).item()


def temperature_gradient(grad_inverse_kappa: torch.Tensor, kappa: float, temperature: torch.Tensor,
                         inverse_temperature: bool) -> torch.Tensor:
    """∂L/∂temperature from ∂L/∂(1/κ), which the backward paths compute (finite for every κ, inf included):
    1/κ = temperature / kappa, or 1/(kappa · temperature)."""
    if inverse_temperature:
        return (grad_inverse_kappa / kappa).to(temperature.dtype)
    inverse = 1.0 / (kappa * temperature.to(grad_inverse_kappa.dtype))
    return (-grad_inverse_kappa * kappa * inverse * inverse).to(temperature.dtype)


def _finite(mu: torch.Tensor, var: torch.Tensor) -> bool:
    """Whether every belief is finite (μ finite, v finite and > 0), where the matmul form's dot product
    c_i + a_i·b_j + d_j is the per-pair KL. An infinite μ or v makes it inf − inf = NaN on pairs whose KL is
    ±inf or finite in the per-pair form (a key at μ = inf is at KL = inf from every other belief: β = 0 there,
    not NaN). Traced (the decomposition, export) it is taken to be finite: a graph cannot branch on values."""
    if matmul_form.tracing():
        return True
    return bool(torch.isfinite(mu).all()) and bool(torch.isfinite(var).all()) and bool((var > 0).all())


def _inverse_kappa(kappa, temperature, inverse_temperature, mu) -> torch.Tensor:
    """1/κ as a 0-d tensor in the softmax's dtype on mu's device (what the per-pair form takes, and differentiates)."""
    return 1.0 / torch.as_tensor(effective_kappa(kappa, temperature, inverse_temperature),
                                 dtype=matmul_form.softmax_dtype(mu.dtype), device=mu.device)


def _per_pair(mu, var, row_values, col_values, kappa, temperature, inverse_temperature, causal, mask_diagonal,
              masked, inverse_kappa=None):
    """The seven outputs in the per-pair form of the reference (its [B, N, N, K] broadcast: taken only for
    beliefs that are not finite, where the matmul form's cancellation would spread NaN), in the op's dtypes."""
    from hecate.lowering.kl_attention.naive import kl_attention_naive

    dtype = matmul_form.softmax_dtype(mu.dtype)
    if inverse_kappa is None:
        inverse_kappa = _inverse_kappa(kappa, temperature, inverse_temperature, mu)
    outputs = kl_attention_naive(mu.to(dtype), var.to(dtype), row_values.to(dtype), col_values.to(dtype), 1.0,
                                 causal, mask_diagonal, None if masked is None else ~masked,
                                 inverse_kappa=inverse_kappa)
    return tuple(o.to(mu.dtype) for o in outputs)


def _per_pair_backward(mu, var, row_values, col_values, grads, kappa, temperature, inverse_temperature, causal,
                       mask_diagonal, masked, read_outputs):
    """(dμ, dv, d row_values, d col_values, d(1/κ)) of :func:`_per_pair`, by ``torch.func.vjp`` through it (an op's
    body runs below autograd; functorch's transform works there)."""
    inverse_kappa = _inverse_kappa(kappa, temperature, inverse_temperature, mu)
    # only the outputs the graph reads (bit i of ``read_outputs``), as eager computes only those: an unread β·KL at a
    # key of KL = inf (β = 0) would give β the gradient inf · 0 = NaN, and lse's backward is 0 · NaN on a row with no
    # allowed key. An output read with a gradient of 0 is read: 0 · NaN is eager's NaN there.
    read = [i for i in range(len(grads)) if read_outputs >> i & 1]
    if not read:
        return tuple(torch.zeros_like(x) for x in (mu, var, row_values, col_values, inverse_kappa))

    def outputs(mu, var, row_values, col_values, inverse_kappa):
        every = _per_pair(mu, var, row_values, col_values, kappa, temperature, inverse_temperature, causal,
                          mask_diagonal, masked, inverse_kappa)
        return tuple(every[i] for i in read)

    primals, vjp = torch.func.vjp(outputs, mu, var, row_values, col_values, inverse_kappa)
    return vjp(tuple(grads[i].to(o.dtype) for i, o in zip(read, primals)))


@torch.library.custom_op("hecate::kl_attention", mutates_args=())
def kl_attention(mu: torch.Tensor, var: torch.Tensor, row_values: torch.Tensor, col_values: torch.Tensor,
                 kappa: float, causal: bool, mask_diagonal: bool, temperature: torch.Tensor | None = None,
                 allowed: torch.Tensor | None = None, inverse_temperature: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                            torch.Tensor]:
    check_inputs(mu, var, row_values, col_values, kappa, temperature, allowed)
    causal, mask_diagonal, masked = resolve_mask(mu.shape[1], causal, mask_diagonal, allowed)
    if use_triton(mu) and mu.dtype != torch.float64 and masked is None:  # the kernels compute in fp32
        try:
            return dense(_triton_forward(mu, var, row_values, col_values,
                                         _kappa_value(kappa, temperature, inverse_temperature), causal, mask_diagonal))
        except KernelDoesNotFit as error:
            _warn_matmul_form(error)
    if not _finite(mu, var):
        return dense(_per_pair(mu, var, row_values, col_values, kappa, temperature, inverse_temperature, causal,
                               mask_diagonal, masked))
    return dense(matmul_form.forward(mu, var, row_values, col_values,
                                     effective_kappa(kappa, temperature, inverse_temperature), causal,
                                     mask_diagonal, masked=masked))


@kl_attention.register_fake
def _(mu, var, row_values, col_values, kappa, causal, mask_diagonal, temperature=None, allowed=None,
      inverse_temperature=False):
    check_inputs(mu, var, row_values, col_values, kappa, temperature, allowed)
    b, n, _ = mu.shape
    row = mu.new_empty(b, n, row_values.shape[2])
    col = mu.new_empty(b, n, col_values.shape[2])
    return row, row.new_empty(row.shape), mu.new_empty(b, n), col, col.new_empty(col.shape), col.new_empty(col.shape), \
        mu.new_empty(b, n)


@torch.library.custom_op("hecate::kl_attention_backward", mutates_args=())
def kl_attention_backward(mu: torch.Tensor, var: torch.Tensor, row_values: torch.Tensor, col_values: torch.Tensor,
                          row_sum: torch.Tensor, row_kl_sum: torch.Tensor, energy: torch.Tensor, lse: torch.Tensor,
                          grad_row_sum: torch.Tensor, grad_row_kl_sum: torch.Tensor, grad_energy: torch.Tensor,
                          grad_col_sum: torch.Tensor, grad_col_kl_sum: torch.Tensor, grad_col_energy_sum: torch.Tensor,
                          grad_lse: torch.Tensor,
                          kappa: float, causal: bool, mask_diagonal: bool, temperature: torch.Tensor | None = None,
                          allowed: torch.Tensor | None = None, inverse_temperature: bool = False,
                          read_outputs: int = 127
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dμ, dv, d row_values, d col_values, d temperature): the last a 0-d tensor, 0 without a temperature.
    ``read_outputs``: bit i set where the forward's output i has a gradient (is read by the graph)."""
    grads = (grad_row_sum, grad_row_kl_sum, grad_energy, grad_col_sum, grad_col_kl_sum, grad_col_energy_sum, grad_lse)
    with_kappa = temperature is not None
    causal, mask_diagonal, masked = resolve_mask(mu.shape[1], causal, mask_diagonal, allowed)
    out = None
    if use_triton(mu) and mu.dtype != torch.float64 and masked is None:  # the kernels compute in fp32
        try:
            out = _triton_backward(mu, var, row_values, col_values, row_sum, row_kl_sum, energy, lse, grads,
                                   _kappa_value(kappa, temperature, inverse_temperature), causal, mask_diagonal,
                                   with_kappa)
        except KernelDoesNotFit as error:
            _warn_matmul_form(error)
    if out is None and not _finite(mu, var):
        out = _per_pair_backward(mu, var, row_values, col_values, grads, kappa, temperature, inverse_temperature,
                                 causal, mask_diagonal, masked, read_outputs)
    if out is None:
        out = matmul_form.backward(mu, var, row_values, col_values, grads,
                                   effective_kappa(kappa, temperature, inverse_temperature),
                                   causal, mask_diagonal, kappa_grad=with_kappa, masked=masked)
    *grad_inputs, grad_inverse_kappa = out
    grad_temperature = (temperature_gradient(grad_inverse_kappa, kappa, temperature, inverse_temperature)
                        if with_kappa else mu.new_zeros(()))
    return dense((*grad_inputs, grad_temperature))


@kl_attention_backward.register_fake
def _(mu, var, row_values, col_values, row_sum, row_kl_sum, energy, lse, g1, g2, g3, g4, g5, g6, g7,
      kappa, causal, mask_diagonal, temperature=None, allowed=None, inverse_temperature=False, read_outputs=127):
    grad_temperature = temperature.new_empty(()) if temperature is not None else mu.new_empty(())
    return tuple(t.new_empty(t.shape) for t in (mu, var, row_values, col_values)) + (grad_temperature,)


def _setup_context(ctx, inputs, output):
    mu, var, row_values, col_values, kappa, causal, mask_diagonal, *optional = inputs
    temperature, allowed, inverse_temperature = (list(optional) + [None, None, False])[:3]
    row_sum, row_kl_sum, energy, _, _, _, lse = output
    ctx.save_for_backward(mu, var, row_values, col_values, row_sum, row_kl_sum, energy, lse, temperature, allowed)
    ctx.config = (kappa, causal, mask_diagonal)
    ctx.inverse_temperature = inverse_temperature
    ctx.set_materialize_grads(False)  # an output the graph does not read gets None, told apart from a gradient of 0


def _backward(ctx, *grads):
    mu, var, row_values, col_values, row_sum, row_kl_sum, energy, lse, temperature, allowed = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph=True: this gradient is differentiated again
        return differentiable_backward(torch.ops.hecate.kl_attention.default, (
            mu, var, row_values, col_values, *ctx.config, temperature, allowed, ctx.inverse_temperature), grads)
    col_shape = row_sum.new_empty(col_values.shape)
    outputs = (row_sum, row_kl_sum, energy, col_shape, col_shape, col_shape, lse)
    read_outputs = sum(1 << i for i, g in enumerate(grads) if g is not None)
    grads = [torch.zeros_like(o) if g is None else g for g, o in zip(grads, outputs)]
    # a row with no allowed key has lse = −inf and no dependence on anything
    grads[6] = torch.where(torch.isinf(lse), 0.0, grads[6])
    grad_mu, grad_var, grad_rv, grad_cv, grad_temperature = torch.ops.hecate.kl_attention_backward(
        mu, var, row_values, col_values, row_sum, row_kl_sum, energy, lse, *grads, *ctx.config, temperature, allowed,
        ctx.inverse_temperature, read_outputs)
    wanted = temperature is not None and ctx.needs_input_grad[7]
    return grad_mu, grad_var, grad_rv, grad_cv, None, None, None, (grad_temperature if wanted else None), None, None


kl_attention.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------
# Triton path


def _block(d: int) -> int:
    """Padded feature width: a power of two, at least 16 (tl.dot's minimum)."""
    return max(16, triton.next_power_of_2(d))


def forward_launch(k: int) -> dict:
    """Tiles and warps of the forward kernels for belief width ``k``. The score tile is [BLOCK_M, BLOCK_N, K]
    (the KL per pair over K). Timed with ``benchmarks/kl_attention_tiles.py`` (N = 1024, causal, the FEP
    model's widths): at K = 16 (H100, three calls) 16×16 with 4 warps is the fastest of six launches
    (0.29–0.44 ms), 32×32 twice as slow; at K = 64 (H200, two calls) 16×16 with 8 warps takes 0.78 and 0.81 ms
    against 1.24 and 1.29 ms with 4 warps, and tiles 32 wide spill (11–31 ms). Between 16 and 64 nothing is
    timed: 8 warps from K > 32.
    """
    return dict(BLOCK_M=16, BLOCK_N=16, num_warps=8 if k > 32 else 4)


def backward_launch() -> dict:
    """Tiles and warps of the backward kernels, which hold more per tile than the forward ones (the value
    products of dS run over 3K+1 and 2(3K+1) features). At 32×32 tiles, K = 16, the kernels compiled for
    sm_90 keep 8–10 KB per thread on the stack (spilled registers; 7 ms per call on an H200 at N = 1024);
    the column kernel works on transposed tiles, and at 16×16 neither spills with 8 warps; with 4 the column
    kernel keeps 48 B, and runs faster (``benchmarks/kernel_resources.py``). Timed on an H100
    (``benchmarks/kl_attention_tiles.py``, N = 1024, K = 16, two calls): 16×16 with 4 warps 1.9–2.1 ms, with
    8 warps 2.7–2.9, 32×32 with 8 warps 3.8.
    """
    return dict(BLOCK_M=16, BLOCK_N=16, num_warps=4)


class KernelDoesNotFit(RuntimeError):
    """A kernel's tiles need more shared memory than the GPU has, at every pipelining depth tried."""


# (kernel, device, launch) -> the pipelining depth that fits: tried once per process
_stages_that_fit: dict[tuple, int] = {}


def _launch(kernel, grid, *args, **config):
    """Launch ``kernel``, pipelined as deep as the GPU's shared memory allows: Triton's default of 3 stages
    first, then 2, then 1. (The backward at the FEP model's widths for K = 64, value tiles of 256 and 512,
    needs 240 KB at 3 stages; an H100 has 227 KB.) Raises :class:`KernelDoesNotFit` when none fits."""
    key = (kernel.fn.__name__, args[0].device, tuple(sorted(config.items())))
    depths = (_stages_that_fit[key],) if key in _stages_that_fit else (3, 2, 1)
    for stages in depths:
        try:
            kernel[grid](*args, num_stages=stages, **config)
        except OutOfResources as error:
            last = error
            continue
        _stages_that_fit[key] = stages
        return
    raise KernelDoesNotFit(f"{kernel.fn.__name__} at {config}: {last}")


def _warn_matmul_form(error: KernelDoesNotFit) -> None:
    warnings.warn(f"hecate.kl_attention: {error}; this call runs the matmul form (ATen, [B, N, N] scores)",
                  RuntimeWarning, stacklevel=3)


def _beliefs(mu, var):
    """(μ, v, log v) fp32 contiguous [B, N, K]: what the kernels form the per-pair KL from."""
    v = var.float().contiguous()
    return mu.float().contiguous(), v, torch.log(v)


def _triton_forward(mu, var, row_values, col_values, kappa, causal, mask_diagonal):
    from hecate.lowering.kl_attention import kernels

    bsz, n, k = mu.shape
    dv, dw = row_values.shape[2], col_values.shape[2]
    beliefs = _beliefs(mu, var)
    rv = row_values.contiguous()
    row = mu.new_empty(bsz, n, dv)
    row_kl = torch.empty_like(row)
    energy = mu.new_empty(bsz, n)
    lse = mu.new_empty(bsz, n)
    launch = forward_launch(k)
    bm, bn = launch["BLOCK_M"], launch["BLOCK_N"]
    config = dict(CAUSAL=causal, MASK_DIAGONAL=mask_diagonal, BLOCK_D=_block(k), **launch)
    _launch(kernels._fwd_rows, (triton.cdiv(n, bm), bsz),
            *beliefs, rv if dv else beliefs[0], row, row_kl, energy, lse, n, k, dv, _neg_inv(kappa),
            HAS_V=dv > 0, BLOCK_V=_block(dv), **config)
    # the column pass runs over [W, energy ⊙ W]: col_energy_sum is col_sum of the second half
    cv = _energy_scaled(col_values, energy)
    col = mu.new_empty(bsz, n, 2 * dw)
    col_kl = torch.empty_like(col)
    if dw:
        _launch(kernels._fwd_cols, (triton.cdiv(n, bn), bsz),
                *beliefs, lse, cv, col, col_kl, n, k, 2 * dw, _neg_inv(kappa), BLOCK_W=_block(2 * dw), **config)
        # a query whose lse is NaN has β NaN at every key, masked ones too (a softmax over a row holding NaN), and
        # so reaches every column sum of its sequence; the column kernels visit allowed pairs only
        nan_rows = torch.isnan(lse).any(1)[:, None, None]
        col, col_kl = (torch.where(nan_rows, float("nan"), t) for t in (col, col_kl))
    return row, row_kl, energy, col[..., :dw].clone(), col_kl[..., :dw].clone(), col[..., dw:].clone(), lse


def _neg_inv(kappa: float) -> float:
    """−1/κ for the kernels: −inf at κ = 0 (as −KL/0 is in eager), −0 at κ = inf."""
    return -math.inf if kappa == 0 else -1.0 / kappa


def _energy_scaled(col_values, energy):
    """[W, energy ⊙ W] (fp32, contiguous): the column values the column passes run over."""
    w = col_values.float()
    return torch.cat([w, energy.float().unsqueeze(-1) * w], dim=-1).contiguous()


def _triton_backward(mu, var, row_values, col_values, row_sum, row_kl_sum, energy, lse, grads,
                     kappa, causal, mask_diagonal, kappa_grad=False):
    """The formulas of :func:`matmul_form.backward`, with the column values [W, E⊙W]; and ∂L/∂κ (a 0-d
    tensor, 0 unless ``kappa_grad``) from the per-row sums Σ_j ∂L/∂l_ij · KL_ij of the row kernel."""
    from hecate.lowering.kl_attention import kernels

    bsz, n, k = mu.shape
    dv, dw = row_values.shape[2], col_values.shape[2]
    beliefs = _beliefs(mu, var)
    a = beliefs[0]  # a placeholder pointer for absent operands
    rv = row_values.contiguous()
    cv = _energy_scaled(col_values, energy)
    g_row, g_row_kl, g_energy, g_col, g_col_kl, g_col_energy, g_lse = (g.float().contiguous() for g in grads)
    g_cols = torch.cat([g_col, g_col_energy], dim=-1).contiguous()
    g_cols_kl = torch.cat([g_col_kl, torch.zeros_like(g_col_kl)], dim=-1).contiguous()
    launch = backward_launch()
    bm, bn = launch["BLOCK_M"], launch["BLOCK_N"]
    config = dict(CAUSAL=causal, MASK_DIAGONAL=mask_diagonal, BLOCK_D=_block(k), **launch)
    lse32 = lse.float().contiguous()
    energy32 = energy.float()
    rowdot = (g_row * row_sum.float()).sum(-1) + (g_row_kl * row_kl_sum.float()).sum(-1)
    grad_cols = torch.zeros(bsz, n, 2 * dw, device=mu.device)
    if dw:
        # [X, Y] = P [dO3, dO5] + (P∘S) [dO4, 0]
        _launch(kernels._bwd_col_values, (triton.cdiv(n, bm), bsz),
                *beliefs, lse32, g_cols, g_cols_kl, grad_cols, n, k, 2 * dw, _neg_inv(kappa),
                BLOCK_W=_block(2 * dw), **config)
        g_energy = g_energy + (col_values.float() * grad_cols[..., dw:]).sum(-1)
        rowdot = rowdot + (cv * grad_cols).sum(-1)
    rowdot = (rowdot + g_energy * energy32).contiguous()
    g_energy = g_energy.contiguous()
    grad_mu_q, grad_var_q, grad_mu_k, grad_var_k = (torch.empty_like(beliefs[0]) for _ in range(4))
    grad_rv = row_values.new_empty(row_values.shape)
    operands = (*beliefs, lse32, rowdot, rv if dv else a, cv if dw else a,
                g_row if dv else a, g_row_kl if dv else a, g_energy, g_cols if dw else a, g_cols_kl if dw else a,
                g_lse)
    flags = dict(HAS_V=dv > 0, HAS_W=dw > 0, BLOCK_V=_block(dv), BLOCK_W=_block(2 * dw), **config)
    kappa_rows = mu.new_empty(bsz, n, dtype=torch.float32) if kappa_grad else a
    _launch(kernels._bwd_rows, (triton.cdiv(n, bm), bsz),
            *operands, grad_mu_q, grad_var_q, kappa_rows, n, k, dv, 2 * dw, _neg_inv(kappa), KAPPA_GRAD=kappa_grad,
            **flags)
    _launch(kernels._bwd_cols, (triton.cdiv(n, bn), bsz),
            *operands, grad_mu_k, grad_var_k, grad_rv if dv else a, n, k, dv, 2 * dw, _neg_inv(kappa), **flags)
    gq_mu, gq_var, gk_mu, gk_var = grad_mu_q, grad_var_q, grad_mu_k, grad_var_k
    grad_cv = grad_cols[..., :dw] + energy32.unsqueeze(-1) * grad_cols[..., dw:]
    # a query whose lse is NaN has β NaN at masked keys too (see the forward): ∂/∂V_j = Σ_i β_ij (…) reads it at
    # every key j
    grad_rv = torch.where(torch.isnan(lse).any(1)[:, None, None], float("nan"), grad_rv)
    # ∂L/∂(1/κ) (the rows' sums are κ² ∂L/∂κ): finite at κ = inf, where ∂L/∂κ would be 0 and its chain NaN
    grad_inverse_kappa = -kappa_rows.sum(dtype=torch.float64) if kappa_grad else torch.zeros((), device=mu.device)
    return ((gq_mu + gk_mu).to(mu.dtype), (gq_var + gk_var).to(var.dtype), grad_rv,
            grad_cv.to(col_values.dtype), grad_inverse_kappa)
