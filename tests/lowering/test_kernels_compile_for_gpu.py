"""Every Triton kernel of qk_preprocess, kl_attention, kl_decode and memory_scan's chunk kernels compiles to PTX
for sm_90.

CI runs the kernels only under TRITON_INTERPRET=1, which accepts code the GPU compiler rejects. Each case
below is one kernel with one set of constexprs as its launcher passes them on a GPU (block sizes of the
non-interpreted path, bf16 or fp32 pointers as the op allocates them); together the cases take every
constexpr branch at least once. (memory_scan's fused-recurrent kernels, which linear_attention runs too, are
compiled in tests/lowering/memory_scan/test_memory_scan_kernels.py.) All cases compile in one subprocess.
"""

from __future__ import annotations

import pytest

from hecate.lowering.kl_attention import kernels as kl_attention_kernels
from hecate.lowering.kl_attention import op as kl_attention_op
from hecate.lowering.kl_decode import kernels as kl_decode_kernels
from hecate.lowering.memory_scan import chunk_kernels
from hecate.lowering.qk_preprocess import kernels as qk_kernels
from hecate.testing import compile_for_gpu_in_subprocess, kernel_signature

# --- qk_preprocess: kernels._blocks(K) off the interpreter gives BLOCK_T = max(64, 2^⌈log2(4(K-1)+1)⌉),
# BLOCK_D = 64, BLOCK_K = 32; matrix φ: BLOCK_D = 2^⌈log2 Dh⌉, BLOCK_P = min(64, 2^⌈log2 d_phi⌉), else 16.
# Every tensor pointer has x's dtype except the backward's fp32 partial sums; INPUT_PRECISION is "tf32"
# unless x is fp32 with TF32 off ("ieee").
QK_SCALARS = dict(T="i32", D="i32", D_in="i32", CH="i32", d_phi="i32", out_width="i32", phi_scalar="fp32",
                  feature_scale="fp32")
QK_FLOAT_PARTIALS = ("dcw_partial_ptr", "dcb_partial_ptr", "dphi_partial_ptr", "dphib_partial_ptr")


def _qk_types(kernel, x_dtype: str) -> dict[str, str]:
    return {n: ("*fp32" if n in QK_FLOAT_PARTIALS else f"*{x_dtype}") for n in kernel.arg_names if n.endswith("_ptr")} \
        | QK_SCALARS


def _qk_flags(proj, proj_bias, conv_bias, activation, phi, state=False):
    return dict(HAS_PROJ=proj, HAS_PROJ_BIAS=proj_bias, HAS_CONV_BIAS=conv_bias,
                ACTIVATION=qk_kernels.ACTIVATION_CODES[activation], PHI=qk_kernels.PHI_CODES[phi], HAS_STATE=state)


def _qk_blocks(K, dtype, head_dim=None, d_phi=None):
    block_d = 64 if head_dim is None else max(16, 1 << (head_dim - 1).bit_length())
    block_p = 16 if d_phi is None else min(64, max(16, 1 << (d_phi - 1).bit_length()))
    return dict(K=K, BLOCK_T=max(64, 1 << (4 * (K - 1)).bit_length()), BLOCK_D=block_d, BLOCK_K=32,
                BLOCK_P=block_p, INPUT_PRECISION="ieee" if dtype == "fp32" else "tf32")


# (name, flags, blocks, x dtype): each φ kind once in fp32 or in both half dtypes (bf16, fp16), the other flags
# (a carried conv state included) varied across them
_QK_HALF_SETTINGS = [
    ("elu1_proj_silu_state", _qk_flags(True, True, True, "silu", "elu1", state=True), dict(K=4)),
    ("relu_proj_nobias", _qk_flags(True, False, True, "silu", "relu"), dict(K=3)),
    ("exp_proj_state", _qk_flags(True, True, False, "silu", "exp", state=True), dict(K=4)),
    ("linear_phi", _qk_flags(True, False, True, "silu", "linear"), dict(K=4, head_dim=64, d_phi=64)),
    ("random_fourier_state", _qk_flags(False, False, True, "none", "random_fourier", state=True),
     dict(K=4, head_dim=24, d_phi=32)),
    ("performer", _qk_flags(True, True, True, "silu", "performer"), dict(K=4, head_dim=64, d_phi=32)),
]
QK_SETTINGS = [
    ("identity_fp32", _qk_flags(False, False, False, "none", "identity", state=True), _qk_blocks(4, "fp32"), "fp32"),
    ("relu2_proj_fp32", _qk_flags(True, True, True, "none", "relu2"), _qk_blocks(4, "fp32"), "fp32"),
] + [(f"{name}_{dtype}", flags, _qk_blocks(dtype=dtype, **shape), dtype)
     for dtype in ("bf16", "fp16") for name, flags, shape in _QK_HALF_SETTINGS]


def _qk_writes(phi: str, index: int, state: bool) -> dict:
    """Which backward outputs a case writes: all the op has, except every third case drops dconv."""
    matrix = phi in ("linear", "random_fourier", "performer")
    return dict(WRITE_DU=True, WRITE_DCW=index % 3 != 1, WRITE_DCB=index % 3 != 1, WRITE_DPHI=matrix,
                WRITE_DPHIB=phi == "random_fourier", WRITE_DSTATE=state)


CASES = {}
for i, (name, flags, blocks, x_dtype) in enumerate(QK_SETTINGS):
    phi = next(k for k, v in qk_kernels.PHI_CODES.items() if v == flags["PHI"])
    CASES[f"qk_preprocess_forward-{name}"] = (
        qk_kernels._forward_kernel, _qk_types(qk_kernels._forward_kernel, x_dtype), flags | blocks | {"PHI_FN": None})
    CASES[f"qk_preprocess_backward_conv-{name}"] = (
        qk_kernels._backward_conv_kernel, _qk_types(qk_kernels._backward_conv_kernel, x_dtype),
        flags | _qk_writes(phi, i, flags["HAS_STATE"]) | blocks | {"PHI_DERIVATIVE": None})

# --- kl_attention (op.py): μ, v, log v and everything the backward allocates are fp32; row values
# and the forward's outputs have mu's dtype (bf16 here). BLOCK_* = max(16, 2^⌈log2 width⌉); the tiles are those
# of forward_launch() and backward_launch().
# FEP widths for K: DV = 3K+1, column pass 2(3K+1).
KL_SCALARS = dict(N="i32", K="i32", DV="i32", DW="i32", neg_inv_kappa="fp32")
# the forward writes its outputs (lse included) in mu's dtype; the backward gets lse back as fp32
KL_FORWARD_BF16 = {"rv_ptr", "row_ptr", "row_kl_ptr", "energy_ptr", "lse_ptr", "col_ptr", "col_kl_ptr"}
KL_BACKWARD_BF16 = {"rv_ptr", "grad_rv_ptr"}


def _kl_types(kernel, bf16: set[str]) -> dict[str, str]:
    return {n: ("*bf16" if n in bf16 else "*fp32") for n in kernel.arg_names if n.endswith("_ptr")} | \
        {n: t for n, t in KL_SCALARS.items() if n in kernel.arg_names}


KA = kl_attention_kernels
for masks, widths, tag in [
        (dict(CAUSAL=True, MASK_DIAGONAL=True), dict(BLOCK_D=16, BLOCK_V=32, BLOCK_W=64), "causal_K8"),
        (dict(CAUSAL=False, MASK_DIAGONAL=False), dict(BLOCK_D=16, BLOCK_V=64, BLOCK_W=128), "full_K16")]:
    blocks = {k: v for k, v in kl_attention_op.forward_launch(widths["BLOCK_D"]).items() if k.startswith("BLOCK")} | \
        dict(BLOCK_D=widths["BLOCK_D"])
    has_values = tag.startswith("causal")  # the full case runs without row values (HAS_V = False, BLOCK_V = 16)
    CASES[f"kl_attention_fwd_rows-{tag}"] = (
        KA._fwd_rows, _kl_types(KA._fwd_rows, KL_FORWARD_BF16 if has_values else KL_FORWARD_BF16 - {"rv_ptr"}),
        masks | blocks | dict(HAS_V=has_values, BLOCK_V=widths["BLOCK_V"] if has_values else 16))
    CASES[f"kl_attention_fwd_cols-{tag}"] = (KA._fwd_cols, _kl_types(KA._fwd_cols, KL_FORWARD_BF16),
                                             masks | blocks | dict(BLOCK_W=widths["BLOCK_W"]))
    backward_blocks = {k: v for k, v in kl_attention_op.backward_launch().items() if k.startswith("BLOCK")} | \
        dict(BLOCK_D=widths["BLOCK_D"])
    CASES[f"kl_attention_bwd_col_values-{tag}"] = (KA._bwd_col_values, _kl_types(KA._bwd_col_values, set()),
                                                   masks | backward_blocks | dict(BLOCK_W=widths["BLOCK_W"]))
    # with values and columns (bf16 row values), then with neither (their pointers are the fp32 means)
    values = (dict(HAS_V=True, HAS_W=True, BLOCK_V=widths["BLOCK_V"], BLOCK_W=widths["BLOCK_W"]) if has_values
              else dict(HAS_V=False, HAS_W=False, BLOCK_V=16, BLOCK_W=16))
    bf16 = KL_BACKWARD_BF16 if has_values else set()
    for kernel in (KA._bwd_rows, KA._bwd_cols):
        # the row kernel also sums ∂L/∂κ per row for a run-time temperature (with values, here)
        kappa = dict(KAPPA_GRAD=has_values) if kernel is KA._bwd_rows else {}
        CASES[f"kl_attention{kernel.fn.__name__}-{tag}"] = (kernel, _kl_types(kernel, bf16),
                                                            masks | backward_blocks | values | kappa)

# --- kl_decode (op.py): features fp32, targets int64, loss/lse/logits in mu's dtype (bf16), the backward's
# lse and grads fp32; tiles 64×64, BLOCK_D = max(16, 2^⌈log2 2K⌉) (K = 16 here).
KD = kl_decode_kernels
DECODE_TILES = dict(BLOCK_M=64, BLOCK_V=64, BLOCK_D=32)
DECODE_SCALARS = dict(M="i32", V="i32", D2="i32", neg_inv_tau="fp32", ignore_index="i32")


def _decode_types(kernel, bf16: set[str]) -> dict[str, str]:
    types = {n: ("*bf16" if n in bf16 else "*i64" if n == "t_ptr" else "*fp32")
             for n in kernel.arg_names if n.endswith("_ptr")}
    return types | {n: t for n, t in DECODE_SCALARS.items() if n in kernel.arg_names}


CASES["kl_decode_logits"] = (KD._logits, _decode_types(KD._logits, {"z_ptr"}), DECODE_TILES)
CASES["kl_decode_ce_fwd"] = (KD._ce_fwd, _decode_types(KD._ce_fwd, {"loss_ptr", "lse_ptr"}), DECODE_TILES)
CASES["kl_decode_ce_bwd_rows"] = (KD._ce_bwd_rows, _decode_types(KD._ce_bwd_rows, set()), DECODE_TILES)
CASES["kl_decode_ce_bwd_cols"] = (KD._ce_bwd_cols, _decode_types(KD._ce_bwd_cols, set()), DECODE_TILES)

# --- memory_scan chunk kernels (chunk_kernels.py): k, v, q, y and the backward's dy, dv in the input dtype; u, w_hat,
# the gates, the states and the gradient partials fp32; chunks of chunked.CHUNK = 64, Dk = Dv = 64 (BK = 64,
# BV = MAX_BLOCK_V = 32), the products as three TF32 ones (DOT = "tf32x3", what sm_80 and newer take). They
# still compile slowly (the backward ~20 s on one core), so each flag is taken on and off across few cases.
CHUNK_INPUT_DTYPE = {"k", "v", "q", "y", "dy", "dv"}
CHUNK_SCALARS = dict(T="i32", ROWS="i32", cu_seqlens="*i32")
CHUNK_BLOCKS = dict(H=4, DK=64, DV=64, BK=64, BV=32, CHUNK=64, DOT="tf32x3")


def _chunk_types(kernel, constexprs: dict, dtype: str) -> dict[str, str]:
    return {n: CHUNK_SCALARS.get(n, f"*{dtype}" if n in CHUNK_INPUT_DTYPE else "*fp32") for n in kernel.arg_names
            if n not in constexprs}


CK = chunk_kernels
for kernel, flags, dtype in [
        (CK.delta_prepare_kernel, dict(VARLEN=True), "bf16"),
        (CK.chunk_forward_kernel, dict(HAS_M0=True, STORE_STATES=False, VARLEN=True, HEBBIAN=False), "bf16"),
        (CK.chunk_forward_kernel, dict(HAS_M0=False, STORE_STATES=True, VARLEN=False, HEBBIAN=True), "fp32"),
        (CK.chunk_backward_kernel, dict(VARLEN=False, HEBBIAN=False), "bf16"),
        (CK.chunk_backward_kernel, dict(VARLEN=True, HEBBIAN=True), "fp32")]:
    tag = ",".join(f"{name}={value}" for name, value in flags.items())
    CASES[f"memory_scan_{kernel.fn.__name__}-{tag}-{dtype}"] = (
        kernel, _chunk_types(kernel, CHUNK_BLOCKS | flags, dtype), CHUNK_BLOCKS | flags)


@pytest.fixture(scope="module")
def compiled():
    try:
        import triton.backends.nvidia  # noqa: F401
    except ImportError:
        pytest.skip("triton has no NVIDIA backend here")
    jobs = {name: (kernel, kernel_signature(kernel, constexprs, types), constexprs)
            for name, (kernel, types, constexprs) in CASES.items()}
    # the chunk kernels' fp32 dots take minutes to compile on a small machine: more than the default 600 s in all
    return compile_for_gpu_in_subprocess(jobs, arch=90, timeout=1800)


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_compiles_for_sm90(case, compiled):
    assert compiled[case] is None, f"{case} does not compile for sm_90:\n{compiled[case]}"


SPILL_CHECK = """
from hecate.lowering.kl_attention import kernels, op
from hecate.testing import kernel_resources, kernel_signature
k, dv, dw = 16, 49, 98  # the FEP transformer at K = 16
launch = {"num_warps": 4} | op.backward_launch()
constexprs = dict(CAUSAL=True, MASK_DIAGONAL=False, HAS_V=True, HAS_W=True, BLOCK_D=op._block(k),
                  BLOCK_V=op._block(dv), BLOCK_W=op._block(dw), BLOCK_M=launch["BLOCK_M"], BLOCK_N=launch["BLOCK_N"])
used = {}
for kernel in (kernels._bwd_rows, kernels._bwd_cols):
    types = {n: "*fp32" for n in kernel.arg_names if n.endswith("_ptr")} | dict(N="i32", K="i32", DV="i32", DW="i32",
                                                                              neg_inv_kappa="fp32")
    own = constexprs | (dict(KAPPA_GRAD=True) if kernel is kernels._bwd_rows else {})  # a run-time κ: the most held
    used[kernel.fn.__name__] = kernel_resources(kernel, kernel_signature(kernel, own, types), own,
                                                launch["num_warps"])
print(used)
"""


# Spilled bytes per thread the backward may keep at its launch. At 32×32 tiles the kernels spilled 8–10 KB and
# took 7 ms per call on an H200 (N = 1024, K = 16). At 16×16 the column kernel keeps 48 B with 4 warps and none
# with 8, yet 4 warps ran faster on an H100 (2.1 against 2.9 ms, benchmarks/kl_attention_tiles.py).
SMALL_SPILL_BYTES = 256


def test_kl_attention_backward_launch_spills_no_more_than_a_few_registers():
    """The backward kernels at their launch spill no more than a few registers (not the KBs of the 32×32
    launch)."""
    import ast
    import os
    import subprocess
    import sys
    from pathlib import Path

    try:
        import triton.backends.nvidia  # noqa: F401
    except ImportError:
        pytest.skip("triton has no NVIDIA backend here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    done = subprocess.run([sys.executable, "-c", SPILL_CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    used = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    for name, resources in used.items():
        assert resources["registers"] > 0, name
        assert resources["stack_bytes"] <= SMALL_SPILL_BYTES, f"{name} spills at its launch: {resources}"
