"""The chunked form of the recurrences that are linear in the state.

Two members of ``memory_scan`` update the state linearly (per head, A [Dv, Dk], keep
a_t = 1 − α_t)::

    p = 2 (no momentum, q_norm = 2, no user bias):  A_t = a_t A_{t−1} + w_t k_tᵀ,  w_t = 2η_t (v_t − A_{t−1} k_t)
    Hebbian (linear attention):                     A_t = a_t A_{t−1} + w_t k_tᵀ,  w_t = η_t v_t

The first is the gated delta rule (g = a, β = 2η/a, v' = a v); with α = 0 the delta rule.
Everything else (general p, p = 1, a user bias g(e), momentum, MONETA's q_norm) is
nonlinear in the state and stays fused-recurrent.

Within a chunk of C tokens starting from A_0, with P[t, s] = Π_{r=s+1..t} a_r (P[t, t] = 1)
and γ_t = Π_{r≤t} a_r, the state is A_t = γ_t A_0 + Σ_{s≤t} P[t, s] w_s k_sᵀ, so the
delta-rule w's solve one unit lower-triangular system per chunk, independent of A_0 but
for one product::

    (I + L) W = diag(b) V − diag(b γ_{t−1}) K A_0ᵀ,   L[t, s] = b_t P[t−1, s] (k_s · k_t)  (s < t)
    W = U − Ŵ A_0ᵀ,   U = (I + L)⁻¹ diag(b) V,   Ŵ = (I + L)⁻¹ diag(b γ_{t−1}) K
    Y = diag(γ) Q A_0ᵀ + (P ⊙ Q Kᵀ) W            (P lower-triangular, diagonal included)
    A_C = γ_C A_0 + Wᵀ diag(P[C, :]) K

(Hebbian: L = 0, b = η.) U and Ŵ of every chunk are computed at once; only the C-step
hops between chunk boundaries are sequential. P is formed by a cumulative product, not
as a ratio of γ's, so a keep factor of 0 is exact.
"""

from __future__ import annotations

CHUNK = 64   # tokens per chunk
MIN_T = 64   # below this the fused-recurrent form is as fast (fla switches near the same length)


def applies(p: float, bias: str, momentum: float, q_norm: float, hebbian: bool) -> bool:
    """Whether the recurrence is linear in the state, so that a chunked form exists."""
    return hebbian or (p == 2.0 and not bias and momentum == 0.0 and q_norm == 2.0)


def uses_chunked(T: int, p: float, bias: str, momentum: float, q_norm: float, hebbian: bool) -> bool:
    """The op's choice: chunked when a chunked form exists and the sequence is at least ``MIN_T`` long."""
    return T >= MIN_T and applies(p, bias, momentum, q_norm, hebbian)
