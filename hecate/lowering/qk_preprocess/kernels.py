"""Triton kernels of ``hecate::qk_preprocess``: forward and backward.

Notation: x [B, T, D_in], W_proj [D, D_in], b_proj [D], w_conv [D, K] (the [D, 1, K] weight viewed flat),
b_conv [D], out [B, T, D]. H = K - 1 is the conv's causal halo.

Forward, one program per (D block, T block, batch): its tile holds BLOCK_T rows t = t0 - H + r
(r = 0 .. BLOCK_T-1), i.e. the BLOCK_T - H rows it writes plus the H rows before them. It computes the
projection u for the whole tile with tl.dot (recomputing the halo rows rather than reading them from
another program), the conv as K row-shifted copies of u (tl.gather inside the tile), activation and φ
in registers, and writes its BLOCK_T - H output rows once.

Backward, kernel 1, one program per (D block, T block, batch): the tile holds rows t = s0 - H + r. It
recomputes u and z, forms dz = g · φ'(a) · act'(z) for rows r >= H, then du[t] = Σ_j w[:, j] dz[t + H - j]
(the conv transposed, reading up to H rows ahead) for the BLOCK_T - 2H rows it owns, and the partial
sums of dw_conv[c, j] = Σ_t dz[t, c] u[t - H + j, c] and db_conv = Σ_t dz over its owned rows (summed over
programs on the host). Then dx = du W_proj, dW_proj = duᵀ x, db_proj = Σ du are matmuls/sums (cuBLAS).

Matrix φ (linear, random Fourier, Performer; W_phi [d_phi, Dh]): a program's channel block is one head
(BLOCK_D >= Dh, channels past Dh zeroed), the forward computes pre = a W_phiᵀ [BLOCK_T, BLOCK_P] by tl.dot
in BLOCK_P feature chunks and writes φ(pre) per chunk; the backward recomputes pre per chunk, forms
dpre = dφ · φ'(pre), da = dpre W_phi (− a Σ_p dpre for the Performer's −‖a‖²/2), and the partial
dW_phi = dpreᵀ a [B·n_t·H, d_phi, Dh] and db_phi = Σ dpre [B·n_t·H, d_phi] over its owned rows, summed on
the host.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from hecate.lowering import pointwise
from hecate.lowering.dispatch import interpreting
from hecate.lowering.qk_preprocess.naive import MATRIX_PHI, is_pointwise_phi

ACTIVATION_CODES = {"none": 0, "silu": 1}
PHI_CODES = {"identity": 0, "elu1": 1, "relu": 2, "relu2": 3, "exp": 4,
             "linear": 5, "random_fourier": 6, "performer": 7}
LINEAR_PHI = tl.constexpr(PHI_CODES["linear"])          # the matrix kinds are the codes >= LINEAR_PHI
RANDOM_FOURIER_PHI = tl.constexpr(PHI_CODES["random_fourier"])
PERFORMER_PHI = tl.constexpr(PHI_CODES["performer"])
POINTWISE_PHI = -1    # a user's elementwise φ, generated (PHI_FN, PHI_DERIVATIVE); below the matrix codes


@triton.jit
def _projected_tile(x_ptr, w_ptr, pb_ptr, state_ptr, b, t, c, T, D, D_in, K: tl.constexpr,
                    HAS_PROJ: tl.constexpr, HAS_PROJ_BIAS: tl.constexpr, HAS_STATE: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
                    INPUT_PRECISION: tl.constexpr):
    """u[t, c] for the tile's rows t [BLOCK_T] and channels c [BLOCK_D], fp32; 0 where t >= T, and where t < 0
    the carried state conv_state[b, K-1+t, c] (0 without one)."""
    row_ok = (t >= 0) & (t < T)                                             # [BLOCK_T]
    col_ok = c < D                                                          # [BLOCK_D]
    if HAS_PROJ:
        u = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
        x_rows = x_ptr + b * T * D_in + t[:, None] * D_in                   # [BLOCK_T, 1]
        for k0 in range(0, D_in, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)                                  # [BLOCK_K]
            k_ok = k < D_in
            x_tile = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_T, BLOCK_K]
            w_tile = tl.load(w_ptr + c[None, :] * D_in + k[:, None],
                             mask=col_ok[None, :] & k_ok[:, None], other=0.0)  # [BLOCK_K, BLOCK_D] = W_projᵀ tile
            u = tl.dot(x_tile, w_tile, u, input_precision=INPUT_PRECISION)
        if HAS_PROJ_BIAS:
            u += tl.load(pb_ptr + c, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        u = tl.where(row_ok[:, None], u, 0.0)                              # causal zero padding, bias included
    else:
        u = tl.load(x_ptr + b * T * D + t[:, None] * D + c[None, :],
                    mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    if HAS_STATE:
        in_state = (t < 0) & (t >= -(K - 1))
        u += tl.load(state_ptr + (b * (K - 1) + (K - 1) + t)[:, None] * D + c[None, :],
                     mask=in_state[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    return u


@triton.jit
def _shift_rows(v, r, shift, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """v[r + shift] for each tile row r (clamped into the tile; callers mask the rows that fall outside)."""
    src = tl.minimum(tl.maximum(r + shift, 0), BLOCK_T - 1)                 # [BLOCK_T]
    index = src[:, None] + tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.int32)     # [BLOCK_T, BLOCK_D]
    return tl.gather(v, index, axis=0)


@triton.jit
def _causal_conv(u, cw_ptr, cb_ptr, r, c, D, K: tl.constexpr, HAS_CONV_BIAS: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """z[r] = Σ_j w[c, j] u[r - (K-1) + j] + b_conv[c]; valid for tile rows r >= K-1."""
    col_ok = c < D
    z = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(K):
        w_j = tl.load(cw_ptr + c * K + j, mask=col_ok, other=0.0).to(tl.float32)   # [BLOCK_D]
        if j == K - 1:
            z += u * w_j[None, :]
        else:
            z += _shift_rows(u, r, j - (K - 1), BLOCK_T, BLOCK_D) * w_j[None, :]
    if HAS_CONV_BIAS:
        z += tl.load(cb_ptr + c, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    return z


@triton.jit
def _activation(z, ACTIVATION: tl.constexpr):
    a = z
    if ACTIVATION == 1:
        a = z * tl.sigmoid(z)
    return a


@triton.jit
def _phi(a, phi_scalar, PHI: tl.constexpr, PHI_FN: tl.constexpr):
    # tl.where forms, not tl.maximum / tl.minimum, which drop NaN: a NaN in a stays NaN, as in torch
    out = a                                                              # identity
    if PHI == -1:   # the user's φ (POINTWISE_PHI)
        out = PHI_FN(a)
    elif PHI == 1:  # elu(a) + 1
        out = tl.where(a > 0, a + 1.0, tl.exp(a))
    elif PHI == 2:  # relu
        out = tl.where(a < 0, 0.0, a)
    elif PHI == 3:  # relu(a)^2
        out = tl.where(a < 0, 0.0, a) * tl.where(a < 0, 0.0, a)
    elif PHI == 4:  # exp(min(a, phi_scalar))
        out = tl.exp(tl.where(a > phi_scalar, phi_scalar, a))
    return out


@triton.jit
def _grad_z(g, z, phi_scalar, ACTIVATION: tl.constexpr, PHI: tl.constexpr, PHI_DERIVATIVE: tl.constexpr):
    """dz = g · φ'(a) · act'(z), with torch's subgradients (relu' = [not a <= 0], clamp passes a <= max);
    NaN in a gives what the ATen path gives (no tl.maximum / tl.minimum, which drop NaN)."""
    s = tl.sigmoid(z)                                                    # unused (and removed) without SiLU
    a = _activation(z, ACTIVATION)
    if PHI == -1:     # the user's φ: φ' traced from autograd (POINTWISE_PHI)
        g = g * PHI_DERIVATIVE(a)
    elif PHI == 1:    # (linear φ arrives here with g = ∂L/∂a already)
        g = g * tl.where(a <= 0, tl.exp(a), 1.0)
    elif PHI == 2:
        g = tl.where(a <= 0, 0.0, g)
    elif PHI == 3:
        g = g * 2.0 * tl.where(a < 0, 0.0, a)
    elif PHI == 4:
        g = tl.where(a <= phi_scalar, g * tl.exp(a), 0.0)
    if ACTIVATION == 1:
        g = g * s * (1.0 + z * (1.0 - s))
    return g


@triton.jit
def _matrix_phi_pre(a, phi_w_ptr, phi_b_ptr, p, i, CH, d_phi, PHI: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """pre = a W_phiᵀ (+ b_phi for random Fourier) for the features p [BLOCK_P]: [BLOCK_T, BLOCK_P]."""
    w_phi_t = tl.load(phi_w_ptr + p[None, :] * CH + i[:, None], mask=(i < CH)[:, None] & (p < d_phi)[None, :],
                      other=0.0).to(tl.float32)                             # [BLOCK_D, BLOCK_P] = W_phiᵀ
    pre = tl.dot(a, w_phi_t, input_precision=INPUT_PRECISION)
    if PHI == RANDOM_FOURIER_PHI:
        pre += tl.load(phi_b_ptr + p, mask=p < d_phi, other=0.0).to(tl.float32)[None, :]
    return pre


@triton.jit
def _forward_kernel(x_ptr, w_ptr, pb_ptr, cw_ptr, cb_ptr, phi_w_ptr, phi_b_ptr, out_ptr, state_ptr, T, D, D_in, CH,
                    d_phi, out_width, phi_scalar, feature_scale,
                    K: tl.constexpr, HAS_PROJ: tl.constexpr, HAS_PROJ_BIAS: tl.constexpr, HAS_STATE: tl.constexpr,
                    HAS_CONV_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, PHI: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr,
                    INPUT_PRECISION: tl.constexpr, PHI_FN: tl.constexpr):
    # grid: (cdiv(D, CH), cdiv(T, BLOCK_T - (K-1)), B); each program takes CH channels (BLOCK_D, or one head
    # of Dh for linear φ). Channel blocks vary fastest so programs reading the same x rows run together.
    # out [B, T, out_width]: out_width = D, or H·d_phi for matrix φ.
    pid_d = tl.program_id(0)
    pid_t = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    r = tl.arange(0, BLOCK_T)                                               # tile row
    t = pid_t * (BLOCK_T - (K - 1)) - (K - 1) + r                           # [BLOCK_T] sequence position
    i = tl.arange(0, BLOCK_D)
    c = pid_d * CH + i                                                      # [BLOCK_D] channel
    u = _projected_tile(x_ptr, w_ptr, pb_ptr, state_ptr, b, t, c, T, D, D_in, K, HAS_PROJ, HAS_PROJ_BIAS, HAS_STATE,
                        BLOCK_T, BLOCK_D, BLOCK_K, INPUT_PRECISION)         # [BLOCK_T, BLOCK_D]
    z = _causal_conv(u, cw_ptr, cb_ptr, r, c, D, K, HAS_CONV_BIAS, BLOCK_T, BLOCK_D)
    rows = (r >= K - 1) & (t < T)                                           # the halo rows are not ours
    out_rows = out_ptr + b * T * out_width + t[:, None] * out_width         # [BLOCK_T, 1]
    if PHI >= LINEAR_PHI:
        a = tl.where((i < CH)[None, :], _activation(z, ACTIVATION), 0.0)   # one head; columns past it zeroed
        half_sq_norm = 0.5 * tl.sum(a * a, axis=1)                          # [BLOCK_T] ‖a_h‖²/2 (Performer)
        for p0 in range(0, d_phi, BLOCK_P):
            p = p0 + tl.arange(0, BLOCK_P)                                  # [BLOCK_P] feature
            features = _matrix_phi_pre(a, phi_w_ptr, phi_b_ptr, p, i, CH, d_phi, PHI, INPUT_PRECISION)
            if PHI == RANDOM_FOURIER_PHI:
                features = feature_scale * tl.cos(features)
            elif PHI == PERFORMER_PHI:
                features = feature_scale * tl.exp(features - half_sq_norm[:, None])
            tl.store(out_rows + pid_d * d_phi + p[None, :], features.to(out_ptr.dtype.element_ty),
                     mask=rows[:, None] & (p < d_phi)[None, :])
    else:
        out = _phi(_activation(z, ACTIVATION), phi_scalar, PHI, PHI_FN)
        tl.store(out_rows + c[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=rows[:, None] & ((i < CH) & (c < D))[None, :])


@triton.jit
def _backward_conv_kernel(g_ptr, x_ptr, w_ptr, pb_ptr, cw_ptr, cb_ptr, phi_w_ptr, phi_b_ptr,
                          du_ptr, dcw_partial_ptr, dcb_partial_ptr, dphi_partial_ptr, dphib_partial_ptr,
                          state_ptr, dstate_ptr,
                          T, D, D_in, CH, d_phi, out_width, phi_scalar, feature_scale,
                          K: tl.constexpr, HAS_PROJ: tl.constexpr, HAS_PROJ_BIAS: tl.constexpr, HAS_STATE: tl.constexpr,
                          HAS_CONV_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, PHI: tl.constexpr,
                          WRITE_DU: tl.constexpr, WRITE_DCW: tl.constexpr, WRITE_DCB: tl.constexpr,
                          WRITE_DPHI: tl.constexpr, WRITE_DPHIB: tl.constexpr, WRITE_DSTATE: tl.constexpr,
                          BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr,
                          INPUT_PRECISION: tl.constexpr, PHI_DERIVATIVE: tl.constexpr):
    # grid: (cdiv(D, CH), cdiv(T, BLOCK_T - 2(K-1)), B). Tile rows r ↔ t = s0 - (K-1) + r; the
    # program owns rows r in [K-1, BLOCK_T - (K-1)), i.e. t in [s0, s0 + BLOCK_T - 2(K-1)).
    # g = ∂L/∂out [B, T, out_width]. dcw_partial [B·n_t, K, D] and dcb_partial [B·n_t, D] (fp32) get one
    # row per (batch, T block); dphi_partial [B·n_t·H, d_phi, Dh] and dphib_partial [B·n_t·H, d_phi] one
    # slice per program. dstate [B, K-1, D] = du at t < 0, written by the first T block.
    pid_d = tl.program_id(0)
    pid_t = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    H: tl.constexpr = K - 1
    r = tl.arange(0, BLOCK_T)
    t = pid_t * (BLOCK_T - 2 * H) - H + r                                   # [BLOCK_T]
    i = tl.arange(0, BLOCK_D)
    c = pid_d * CH + i                                                      # [BLOCK_D]
    col_ok = (i < CH) & (c < D)
    u = _projected_tile(x_ptr, w_ptr, pb_ptr, state_ptr, b, t, c, T, D, D_in, K, HAS_PROJ, HAS_PROJ_BIAS, HAS_STATE,
                        BLOCK_T, BLOCK_D, BLOCK_K, INPUT_PRECISION)         # [BLOCK_T, BLOCK_D]
    z = _causal_conv(u, cw_ptr, cb_ptr, r, c, D, K, HAS_CONV_BIAS, BLOCK_T, BLOCK_D)
    z_rows = (r >= H) & (t < T)                                             # rows whose z is known and real
    z_ok = z_rows[:, None] & col_ok[None, :]
    owned_rows = (r >= H) & (r < BLOCK_T - H) & (t < T)
    owned = owned_rows[:, None] & col_ok[None, :]
    g_rows = g_ptr + b * T * out_width + t[:, None] * out_width             # [BLOCK_T, 1]
    if PHI >= LINEAR_PHI:
        # per BLOCK_P feature chunk: dpre = dφ · φ'(pre), da += dpre W_phi, partial dW_phi += dpreᵀ a and
        # db_phi += Σ dpre over the owned rows
        a = tl.where((i < CH)[None, :], _activation(z, ACTIVATION), 0.0)   # one head; columns past it zeroed
        half_sq_norm = 0.5 * tl.sum(a * a, axis=1)                          # [BLOCK_T]
        g = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)                  # becomes ∂L/∂a
        g_pre_sum = tl.zeros([BLOCK_T], dtype=tl.float32)                   # Σ_p dpre (Performer)
        program = (b * tl.num_programs(1) + pid_t) * tl.num_programs(0) + pid_d
        for p0 in range(0, d_phi, BLOCK_P):
            p = p0 + tl.arange(0, BLOCK_P)
            g_pre = tl.load(g_rows + pid_d * d_phi + p[None, :], mask=z_rows[:, None] & (p < d_phi)[None, :],
                            other=0.0).to(tl.float32)                       # [BLOCK_T, BLOCK_P] = dφ
            if PHI != LINEAR_PHI:
                pre = _matrix_phi_pre(a, phi_w_ptr, phi_b_ptr, p, i, CH, d_phi, PHI, INPUT_PRECISION)
                if PHI == RANDOM_FOURIER_PHI:
                    g_pre = g_pre * (-feature_scale) * tl.sin(pre)
                else:
                    g_pre = g_pre * feature_scale * tl.exp(pre - half_sq_norm[:, None])
                g_pre = tl.where(z_rows[:, None], g_pre, 0.0)               # no 0·inf from rows we do not own
                g_pre_sum += tl.sum(g_pre, axis=1)
            w_phi = tl.load(phi_w_ptr + p[:, None] * CH + i[None, :], mask=(p < d_phi)[:, None] & (i < CH)[None, :],
                            other=0.0).to(tl.float32)                       # [BLOCK_P, BLOCK_D]
            g = tl.dot(g_pre, w_phi, g, input_precision=INPUT_PRECISION)
            g_owned = tl.where(owned_rows[:, None], g_pre, 0.0)
            if WRITE_DPHI:
                dphi = tl.dot(tl.trans(g_owned), a, input_precision=INPUT_PRECISION)   # [BLOCK_P, BLOCK_D]
                tl.store(dphi_partial_ptr + (program * d_phi + p[:, None]) * CH + i[None, :], dphi,
                         mask=(p < d_phi)[:, None] & (i < CH)[None, :])
            if WRITE_DPHIB:
                tl.store(dphib_partial_ptr + program * d_phi + p, tl.sum(g_owned, axis=0), mask=p < d_phi)
        if PHI == PERFORMER_PHI:                                            # ∂(−‖a‖²/2)/∂a = −a
            g -= a * g_pre_sum[:, None]
    else:
        g = tl.load(g_rows + c[None, :], mask=z_ok, other=0.0).to(tl.float32)
    dz = tl.where(z_ok, _grad_z(g, z, phi_scalar, ACTIVATION, PHI, PHI_DERIVATIVE), 0.0)   # [BLOCK_T, BLOCK_D]
    if WRITE_DU or WRITE_DSTATE:
        du = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
        for j in tl.static_range(K):
            w_j = tl.load(cw_ptr + c * K + j, mask=col_ok, other=0.0).to(tl.float32)
            if j == H:
                du += dz * w_j[None, :]
            else:
                du += _shift_rows(dz, r, H - j, BLOCK_T, BLOCK_D) * w_j[None, :]
        if WRITE_DU:
            tl.store(du_ptr + b * T * D + t[:, None] * D + c[None, :], du.to(du_ptr.dtype.element_ty), mask=owned)
        if WRITE_DSTATE:    # rows t in [-(K-1), 0): the carried inputs (only the first T block has them)
            state_rows = (t < 0) & (r < H)
            tl.store(dstate_ptr + (b * H + r)[:, None] * D + c[None, :], du.to(dstate_ptr.dtype.element_ty),
                     mask=state_rows[:, None] & col_ok[None, :])
    dz_owned = tl.where(owned, dz, 0.0)
    program = b * tl.num_programs(1) + pid_t
    if WRITE_DCW:
        for j in tl.static_range(K):
            if j == H:
                u_j = u
            else:
                u_j = _shift_rows(u, r, j - H, BLOCK_T, BLOCK_D)
            tl.store(dcw_partial_ptr + (program * K + j) * D + c, tl.sum(dz_owned * u_j, axis=0), mask=col_ok)
    if WRITE_DCB:
        tl.store(dcb_partial_ptr + program * D + c, tl.sum(dz_owned, axis=0), mask=col_ok)


# --------------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------------

def _blocks(K: int) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_D, BLOCK_K). BLOCK_T leaves at least 2(K-1) + 1 rows for the backward's two halos."""
    if interpreting():  # tiny tiles keep the interpreter fast; tl.dot needs >= 16
        return max(16, triton.next_power_of_2(4 * (K - 1) + 1)), 16, 16
    return max(64, triton.next_power_of_2(4 * (K - 1) + 1)), 64, 32


def _launch_config(x: torch.Tensor, conv_weight: torch.Tensor, phi: str, phi_params) -> dict:
    """Block sizes and the channel split: CH channels per program (a whole head of Dh for matrix φ)."""
    D, _, K = conv_weight.shape
    BLOCK_T, BLOCK_D, BLOCK_K = _blocks(K)
    CH, d_phi, BLOCK_P, feature_scale = BLOCK_D, 0, 16, 1.0
    if phi in MATRIX_PHI:
        d_phi, CH = phi_params[0].shape
        BLOCK_D = max(16, triton.next_power_of_2(CH))
        BLOCK_P = 16 if interpreting() else min(64, max(16, triton.next_power_of_2(d_phi)))
        feature_scale = {"linear": 1.0, "random_fourier": (2.0 / d_phi) ** 0.5, "performer": d_phi ** -0.5}[phi]
    return dict(K=K, CH=CH, d_phi=d_phi, out_width=D // CH * d_phi if phi in MATRIX_PHI else D,
                feature_scale=feature_scale, BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D, BLOCK_K=BLOCK_K, BLOCK_P=BLOCK_P,
                INPUT_PRECISION=_input_precision(x))


def _input_precision(x: torch.Tensor) -> str:
    """fp32 matmuls follow torch's TF32 setting (off by default), as cuBLAS would."""
    if x.dtype == torch.float32 and x.is_cuda and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def _flags(proj_weight, proj_bias, conv_bias, activation: str, phi: str, conv_state) -> dict:
    return dict(HAS_PROJ=proj_weight is not None, HAS_PROJ_BIAS=proj_bias is not None,
                HAS_CONV_BIAS=conv_bias is not None, ACTIVATION=ACTIVATION_CODES[activation],
                PHI=POINTWISE_PHI if is_pointwise_phi(phi) else PHI_CODES[phi], HAS_STATE=conv_state is not None)


def _phi_function(phi: str, derivative: bool):
    """The generated Triton φ (or φ') of a user's pointwise φ; None for the kinds."""
    if not is_pointwise_phi(phi):
        return None
    return pointwise.triton_function(pointwise.derivative(phi) if derivative else phi)


def launch_forward(out: torch.Tensor, x: torch.Tensor, proj_weight: torch.Tensor | None,
                   proj_bias: torch.Tensor | None, conv_weight: torch.Tensor, conv_bias: torch.Tensor | None,
                   activation: str, phi: str, phi_params: Sequence[torch.Tensor], phi_scalar: float,
                   conv_state: torch.Tensor | None = None) -> None:
    """Write the op's output into ``out`` [B, T, D or H·d_phi] (contiguous inputs)."""
    B, T, D_in = x.shape
    D = conv_weight.shape[0]
    cfg = _launch_config(x, conv_weight, phi, phi_params)
    CH, d_phi, out_width, scale = cfg.pop("CH"), cfg.pop("d_phi"), cfg.pop("out_width"), cfg.pop("feature_scale")
    grid = (triton.cdiv(D, CH), triton.cdiv(T, cfg["BLOCK_T"] - (cfg["K"] - 1)), B)
    phi_weight, phi_bias = _phi_tensors(phi, phi_params, x)
    _forward_kernel[grid](x, proj_weight if proj_weight is not None else x, proj_bias if proj_bias is not None else x,
                          conv_weight, conv_bias if conv_bias is not None else x, phi_weight, phi_bias, out,
                          conv_state if conv_state is not None else x,
                          T, D, D_in, CH, d_phi, out_width, float(phi_scalar), scale,
                          **_flags(proj_weight, proj_bias, conv_bias, activation, phi, conv_state), **cfg,
                          PHI_FN=_phi_function(phi, derivative=False))


def _phi_tensors(phi: str, phi_params: Sequence[torch.Tensor], dummy: torch.Tensor):
    """(W_phi, b_phi) pointers for the kernels, ``dummy`` where the kind has none."""
    return (phi_params[0] if phi in MATRIX_PHI else dummy, phi_params[1] if phi == "random_fourier" else dummy)


def launch_backward_conv(du: torch.Tensor | None, dcw_partial: torch.Tensor | None, dcb_partial: torch.Tensor | None,
                         dphi_partial: torch.Tensor | None, dphib_partial: torch.Tensor | None,
                         grad_out: torch.Tensor, x: torch.Tensor,
                         proj_weight: torch.Tensor | None, proj_bias: torch.Tensor | None, conv_weight: torch.Tensor,
                         conv_bias: torch.Tensor | None, activation: str, phi: str,
                         phi_params: Sequence[torch.Tensor], phi_scalar: float,
                         conv_state: torch.Tensor | None = None, dstate: torch.Tensor | None = None) -> None:
    """Kernel 1 of the backward: writes du [B, T, D], dcw_partial [B·n_t, K, D], dcb_partial [B·n_t, D],
    dphi_partial [B·n_t·H, d_phi, Dh], dphib_partial [B·n_t·H, d_phi], dstate [B, K-1, D] (each only when
    given)."""
    B, T, D_in = x.shape
    D = conv_weight.shape[0]
    cfg = _launch_config(x, conv_weight, phi, phi_params)
    CH, d_phi, out_width, scale = cfg.pop("CH"), cfg.pop("d_phi"), cfg.pop("out_width"), cfg.pop("feature_scale")
    grid = (triton.cdiv(D, CH), backward_row_blocks(T, cfg["K"]), B)
    phi_weight, phi_bias = _phi_tensors(phi, phi_params, x)
    written = [du, dcw_partial, dcb_partial, dphi_partial, dphib_partial]
    _backward_conv_kernel[grid](
        grad_out, x, proj_weight if proj_weight is not None else x, proj_bias if proj_bias is not None else x,
        conv_weight, conv_bias if conv_bias is not None else x, phi_weight, phi_bias,
        *[t if t is not None else x for t in written],
        conv_state if conv_state is not None else x, dstate if dstate is not None else x,
        T, D, D_in, CH, d_phi, out_width, float(phi_scalar), scale,
        **_flags(proj_weight, proj_bias, conv_bias, activation, phi, conv_state),
        WRITE_DU=du is not None, WRITE_DCW=dcw_partial is not None, WRITE_DCB=dcb_partial is not None,
        WRITE_DPHI=dphi_partial is not None, WRITE_DPHIB=dphib_partial is not None, WRITE_DSTATE=dstate is not None,
        **cfg, PHI_DERIVATIVE=_phi_function(phi, derivative=True))


def backward_row_blocks(T: int, K: int) -> int:
    """How many T blocks the backward conv kernel's grid has (rows of the partial dconv buffers, per batch)."""
    BLOCK_T = _blocks(K)[0]
    return triton.cdiv(T, BLOCK_T - 2 * (K - 1))


def _contiguous(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    return [t.contiguous() if t is not None else None for t in tensors]


def forward(x: torch.Tensor, proj_weight: torch.Tensor | None, proj_bias: torch.Tensor | None,
            conv_weight: torch.Tensor, conv_bias: torch.Tensor | None, activation: str, phi: str,
            phi_params: Sequence[torch.Tensor], phi_scalar: float,
            conv_state: torch.Tensor | None = None) -> torch.Tensor:
    x, proj_weight, proj_bias, conv_weight, conv_bias, conv_state = _contiguous(
        x, proj_weight, proj_bias, conv_weight, conv_bias, conv_state)
    phi_params = _contiguous(*phi_params)
    D = conv_weight.shape[0]
    width = D // phi_params[0].shape[1] * phi_params[0].shape[0] if phi in MATRIX_PHI else D
    out = torch.empty(x.shape[0], x.shape[1], width, dtype=x.dtype, device=x.device)
    launch_forward(out, x, proj_weight, proj_bias, conv_weight, conv_bias, activation, phi, phi_params, phi_scalar,
                   conv_state)
    return out


def backward(grad_out: torch.Tensor, x: torch.Tensor, proj_weight: torch.Tensor | None,
             proj_bias: torch.Tensor | None, conv_weight: torch.Tensor, conv_bias: torch.Tensor | None,
             activation: str, phi: str, phi_params: Sequence[torch.Tensor], phi_scalar: float,
             mask: Sequence[bool], conv_state: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """Gradients of (x, proj_weight, proj_bias, conv_weight, conv_bias, W_phi, b_phi, conv_state); empty where
    ``mask`` is False."""
    grad_out, x, proj_weight, proj_bias, conv_weight, conv_bias, conv_state = _contiguous(
        grad_out, x, proj_weight, proj_bias, conv_weight, conv_bias, conv_state)
    phi_params = _contiguous(*phi_params)
    B, T, D_in = x.shape
    D, _, K = conv_weight.shape
    n_partial = B * backward_row_blocks(T, K)
    f32 = dict(dtype=torch.float32, device=x.device)
    du = torch.empty(B, T, D, dtype=x.dtype, device=x.device) if (mask[0] or mask[1] or mask[2]) else None
    dcw_partial = torch.empty(n_partial, K, D, **f32) if mask[3] else None
    dcb_partial = torch.empty(n_partial, D, **f32) if mask[4] else None
    dphi_partial = dphib_partial = None
    if mask[5] or mask[6]:
        d_phi, head_dim = phi_params[0].shape
        n_head_partial = n_partial * (D // head_dim)
        dphi_partial = torch.empty(n_head_partial, d_phi, head_dim, **f32) if mask[5] else None
        dphib_partial = torch.empty(n_head_partial, d_phi, **f32) if mask[6] else None
    dstate = torch.empty(B, K - 1, D, dtype=x.dtype, device=x.device) if mask[7] else None
    launch_backward_conv(du, dcw_partial, dcb_partial, dphi_partial, dphib_partial, grad_out, x, proj_weight,
                         proj_bias, conv_weight, conv_bias, activation, phi, phi_params, phi_scalar, conv_state, dstate)
    grads = [x.new_empty(0) for _ in range(7)] + [dstate if dstate is not None else x.new_empty(0)]
    if dcw_partial is not None:
        grads[3] = dcw_partial.sum(0).t().unsqueeze(1).to(conv_weight.dtype).contiguous()   # [D, 1, K]
    if dcb_partial is not None:
        grads[4] = dcb_partial.sum(0).to(conv_bias.dtype)
    if dphi_partial is not None:
        grads[5] = dphi_partial.sum(0).to(phi_params[0].dtype)                               # [d_phi, Dh]
    if dphib_partial is not None:
        grads[6] = dphib_partial.sum(0).to(phi_params[1].dtype)                              # [d_phi]
    if du is not None:
        if proj_weight is None:
            grads[0] = du
        else:
            du_rows = du.view(B * T, D)
            if mask[0]:
                grads[0] = (du_rows @ proj_weight).view(B, T, D_in)
            if mask[1]:
                grads[1] = du_rows.t() @ x.view(B * T, D_in)
            if mask[2]:
                grads[2] = du_rows.sum(0, dtype=torch.float32).to(proj_bias.dtype)
    return tuple(grads)
