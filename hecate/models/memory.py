"""Associative memory layers with the l_p attentional bias, and their Hebbian sibling.

Plain PyTorch, written the way a researcher writes them: a per-token Python loop
(or, with ``use_scan=True``, torch's ``scan`` higher-order op over the same step).
Spec: ``lp-attentional-bias.md`` (MIRAS Eqs 10-12, 24-25), ``feature-maps-phi.md``
(HOPE Eqs 5 and 51), ``linear-attention-feature-maps.md``, ``short-causal-conv.md``.

Shapes: x [B, T, d_model]; per head, keys/queries φ(k), φ(q) [d_phi] (d_phi = d_k for
the element-wise feature maps; the learned linear, random Fourier and Performer maps have
their own d_phi, poly-2 has d_k + d_k²), values [d_v], memory M [d_v, d_phi]
(``feature-maps-phi.md``, Note 2).
"""

from __future__ import annotations

import torch
from torch import nn
from torch._higher_order_ops.scan import scan

from hecate.models.feature_maps import ELEMENTWISE_FEATURE_MAPS, FEATURE_MAPS, make_feature_map
from hecate.models.short_conv import KeyQueryPreprocess


def _constant(name: str, doc: str) -> property:
    """A float attribute the step reads, kept where ``torch.compile(dynamic=True)`` sees a constant.

    Under dynamic=True Dynamo turns a float attribute into a graph input (a float64 tensor): the step's
    p, a, eps would be data, which a ``scan`` cannot take in and the memory passes cannot read as the
    step's numbers. A tuple of floats it keeps as constants, guarded by value (setting it recompiles).
    """
    def get(self) -> float:
        return getattr(self, "_" + name)[0]

    def set(self, value: float) -> None:
        setattr(self, "_" + name, (float(value),))

    return property(get, set, doc=doc)


def _check_gate(name: str, value: float | None) -> None:
    if value is not None and not (isinstance(value, (int, float)) and 0.0 <= value <= 1.0):
        raise ValueError(f"{name} must be a number in [0, 1] (a fixed gate) or None "
                         f"(a data-dependent gate), got {value!r}")


class _GatedMemory(nn.Module):
    """What the memory layers share: q/k/v with short conv and φ, per-token gates, output."""

    def __init__(self, d_model: int, n_heads: int, d_k: int, d_v: int, phi: str,
                 gates: dict[str, float | None], d_phi: int | None = None):
        super().__init__()
        for name, value in gates.items():
            _check_gate(name, value)
        if phi not in FEATURE_MAPS:
            raise ValueError(f"phi must be one of {FEATURE_MAPS}, got {phi!r}")
        if d_phi is not None and phi in ELEMENTWISE_FEATURE_MAPS + ("poly2",):
            raise ValueError(f"d_phi={d_phi} sizes the learned linear, random Fourier, MLP and Performer maps; "
                             f"phi={phi!r} fixes its own size, so d_phi must be None")
        # projection → causal depthwise conv (K=4) → SiLU → φ, separate weights for q and k
        phi_kwargs = {} if d_phi is None else {"d_phi": d_phi}
        self.qk = KeyQueryPreprocess(d_model, d_key=n_heads * d_k, n_heads=n_heads, phi=phi, **phi_kwargs)
        # the size of φ(k): M is [d_v, d_phi] per head (read from φ's output on zeros)
        self.n_heads, self.d_phi, self.d_v = n_heads, self.qk.phi(torch.zeros(1, d_k)).shape[-1], d_v
        self.v = nn.Linear(d_model, n_heads * d_v, bias=False)
        self.out = nn.Linear(n_heads * d_v, d_model, bias=False)
        # one-element tuples: constants under torch.compile(dynamic=True), as the step's floats (see _constant)
        self.fixed_gates = {n: (float(v),) for n, v in gates.items() if v is not None}
        # data-dependent gate: sigmoid of a projection of x_t, one per head
        self.gate_proj = nn.ModuleDict({n: nn.Linear(d_model, n_heads) for n, v in gates.items() if v is None})

    def gate(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """The gate ``name`` per token and head, [B, T, H]."""
        if name in self.gate_proj:
            return torch.sigmoid(self.gate_proj[name](x))
        return x.new_full((x.shape[0], x.shape[1], self.n_heads), self.fixed_gates[name][0])

    def qkv(self, x: torch.Tensor, conv_state: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """φ(q), φ(k) [B, T, H, d_phi] and v [B, T, H, d_v]; ``conv_state``: the short convs' left context when x
        continues a sequence (:meth:`KeyQueryPreprocess.next_state`)."""
        B, T, _ = x.shape
        q, k = self.qk(x, conv_state)
        v = self.v(x).view(B, T, self.n_heads, self.d_v)
        return q, k, v

    def check_state(self, m0: torch.Tensor | None, x: torch.Tensor) -> None:
        expected = (x.shape[0], self.n_heads, self.d_v, self.d_phi)
        if m0 is not None and tuple(m0.shape) != expected:
            raise ValueError(f"m0 must have shape [B, H, d_v, d_phi] = {list(expected)}, got {list(m0.shape)}")


class LpMemory(_GatedMemory):
    """A multi-head associative memory trained online with the l_p attentional bias.

    Per head and token t (``lp-attentional-bias.md``, ``feature-maps-phi.md``)::

        e_t = M φ(k_t) − v_t                                     (Eq 11, φ of HOPE Eq 5)
        g_t = 2 e_t                                   if p = 2   (L2 fast path)
              tanh(a e_t)                             if p = 1   (L1 fast path, Eq 12)
              p · tanh(a e_t) ⊙ (e_t² + eps)^((p−1)/2)  else      (Remark 5 approximators)
        M  ← (1 − α_t) M − η_t g_t φ(k_t)ᵀ                        (retention + update)
        y_t = M φ(q_t)                                            (read after the update)

    Variants:
      * ``momentum = β > 0``: GD with momentum, the higher-order momentum of HOPE Eq 51
        with the gradient taken in feature space:  S ← β S − η_t φ_g(g_t φ(k_t)ᵀ),
        M ← (1 − α_t) M + S  (S starts at zero). φ_g (``gradient_phi``, element-wise,
        default identity) is Eq 51's feature map on the whole gradient, with P_i = I.
      * ``q_norm = q ≠ 2``: MONETA (p, q) with L_q retention (MIRAS Eqs 24-25):
        A ← (1 − α_t) A − η_t g_t φ(k_t)ᵀ,  W = A / ‖A‖_q^(q−2) (‖·‖_q entrywise per head,
        computed as (Σ|A|^q + eps)^(1/q)); e_t and y_t read W; the state carried is A.

    α_t (forget rate, as in the spec's ``(1 − α_t) W`` retention, also for MONETA whose
    Eq 25 writes the keep factor) and η_t are fixed numbers, or data-dependent gates
    σ(W x_t + b) per head when given as ``None``. Eq 51 here applies φ (the key feature
    map) to the gradient's key factor; a separate nonlinearity on the whole gradient is
    not modelled. ``forward(x, m0=None) -> (out, m_final)``: m0/m_final are the memory
    (the accumulator A for MONETA), [B, H, d_v, d_phi]. For chunked processing,
    ``forward_chunk(x, state=None) -> (out, state)`` carries the whole state (the short
    convs' left context, the memory, the momentum buffer): chunk by chunk equals the
    whole sequence.
    """

    p = _constant("p", "the l_p exponent of the attentional bias")
    a = _constant("a", "the tanh sharpness of the p = 1 and general-p bias gradients")
    eps = _constant("eps", "the smoothing of (e² + eps) and of MONETA's norm")
    momentum = _constant("momentum", "β of GD with momentum (0: plain GD)")
    q_norm = _constant("q_norm", "q of MONETA's L_q retention (2: none)")

    def __init__(self, d_model: int, n_heads: int = 2, d_k: int = 8, d_v: int = 8, *,
                 p: float = 2.0, a: float = 10.0, eps: float = 1e-6,
                 alpha: float | None = 0.1, eta: float | None = 0.1,
                 momentum: float = 0.0, q_norm: float = 2.0, phi: str = "identity", d_phi: int | None = None,
                 gradient_phi: str = "identity", use_scan: bool = False):
        super().__init__(d_model, n_heads, d_k, d_v, phi, {"alpha": alpha, "eta": eta}, d_phi)
        if not (isinstance(p, (int, float)) and p >= 1):
            raise ValueError(f"p must be a number >= 1 (the l_p exponent), got {p!r}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
        if not q_norm >= 2.0:
            raise ValueError(f"q_norm must be >= 2 (L_q retention), got {q_norm!r}")
        if momentum > 0 and q_norm != 2.0:
            raise ValueError(f"momentum={momentum} with q_norm={q_norm}: choose GD with momentum "
                             "or MONETA L_q retention, not both")
        if gradient_phi not in ELEMENTWISE_FEATURE_MAPS:
            raise ValueError(f"gradient_phi must be one of {ELEMENTWISE_FEATURE_MAPS}, got {gradient_phi!r}")
        if gradient_phi != "identity" and momentum == 0:
            raise ValueError(f"gradient_phi={gradient_phi!r} maps the gradient entering the momentum buffer "
                             "(HOPE Eq 51): it needs momentum > 0, got momentum=0")
        # Eq 51's φ on the whole gradient; None when it is the identity (plain momentum)
        self.gradient_phi = None if gradient_phi == "identity" else make_feature_map(gradient_phi, d_k)
        self.p, self.a, self.eps, self.momentum, self.q_norm = p, a, eps, momentum, q_norm
        self.use_scan = use_scan

    @property
    def lq_power(self) -> float:
        """(q − 2) / q: ‖A‖_q^(q−2) = (Σ|A|^q)^((q−2)/q)."""
        return (self.q_norm - 2) / self.q_norm

    def bias_gradient(self, e: torch.Tensor) -> torch.Tensor:
        """∂/∂(Mk) of ‖Mk − v‖_p^p with the spec's fast paths at p = 2 and p = 1."""
        if self.p == 2.0:
            return 2 * e
        if self.p == 1.0:
            return torch.tanh(self.a * e)
        return self.p * torch.tanh(self.a * e) * (e * e + self.eps) ** ((self.p - 1) / 2)

    def lq_normalise(self, A: torch.Tensor) -> torch.Tensor:
        """W = A / ‖A‖_q^(q−2) = A / (Σ|A|^q + eps)^((q−2)/q), the sum over each head's [d_v, d_k]."""
        return A / (A.abs().pow(self.q_norm).sum((-2, -1), keepdim=True) + self.eps) ** self.lq_power

    def step(self, state: tuple, k_t, v_t, q_t, alpha_t, eta_t):
        """One token: ``state`` is (M,), or (M, S) with momentum; for MONETA M is the accumulator A."""
        alpha_t, eta_t = alpha_t[..., None, None], eta_t[..., None, None]
        M = state[0]
        W = self.lq_normalise(M) if self.q_norm != 2.0 else M
        e = (W @ k_t.unsqueeze(-1)).squeeze(-1) - v_t
        grad = self.bias_gradient(e).unsqueeze(-1) * k_t.unsqueeze(-2)  # g φ(k)ᵀ
        if self.momentum > 0:
            if self.gradient_phi is not None:
                grad = self.gradient_phi(grad)
            S = self.momentum * state[1] - eta_t * grad
            M = (1 - alpha_t) * M + S
            new_state = (M, S)
        else:
            M = (1 - alpha_t) * M - eta_t * grad
            new_state = (M,)
        W = self.lq_normalise(M) if self.q_norm != 2.0 else M
        return new_state, (W @ q_t.unsqueeze(-1)).squeeze(-1)

    def forward(self, x: torch.Tensor, m0: torch.Tensor | None = None):
        out, state = self._run(x, m0)
        return out, state[0]

    def forward_chunk(self, x: torch.Tensor, state: tuple | None = None):
        """One chunk of a sequence: ``state`` is None at its start, else the state :meth:`forward_chunk` returned
        for the previous chunk: (conv state (queries', keys') [B, K−1, d_key] each, M [B, H, d_v, d_phi], S, the
        momentum buffer, or None without momentum). Returns (out, the state after x)."""
        conv_state, m0, s0 = state if state is not None else (None, None, None)
        out, (M, *S) = self._run(x, m0, s0, conv_state)
        return out, (self.qk.next_state(x, conv_state), M, S[0] if S else None)

    def _run(self, x: torch.Tensor, m0: torch.Tensor | None = None, s0: torch.Tensor | None = None,
             conv_state: tuple | None = None):
        """(out, final (M,) or (M, S)) from the initial M, S (zeros when None) and the convs' left context."""
        self.check_state(m0, x)
        B, T, _ = x.shape
        q, k, v = self.qkv(x, conv_state)
        alpha, eta = self.gate("alpha", x), self.gate("eta", x)
        M = x.new_zeros(B, self.n_heads, self.d_v, self.d_phi) if m0 is None else m0
        if self.momentum > 0:
            state = (M, torch.zeros_like(M) if s0 is None else s0)
        else:
            state = (M,)
        if self.use_scan:
            # scan slices xs along dim 1 and stacks the per-step y along dim 1 again
            state, y = scan(lambda s, xs: self.step(s, *xs), state, (k, v, q, alpha, eta), dim=1)
        else:
            ys = []
            for t in range(T):
                state, y_t = self.step(state, k[:, t], v[:, t], q[:, t], alpha[:, t], eta[:, t])
                ys.append(y_t)
            y = torch.stack(ys, dim=1)  # [B, T, H, d_v]
        return self.out(y.reshape(B, T, -1)), state


class HebbianMemory(_GatedMemory):
    """Fast-weight / linear-attention memory (HOPE Eq 5; ``linear-attention-feature-maps.md``).

    Per head and token t::

        M ← α_t M + v_t φ(k_t)ᵀ          y_t = M φ(q_t)
        normalise=True:  z ← α_t z + φ(k_t),   y_t = M φ(q_t) / (z · φ(q_t) + eps)

    ``form``:
      * "loop": the recurrence as a Python loop (``use_scan=True``: the scan higher-order op);
      * "cumsum": causal linear attention without decay, M_t = Σ_{s≤t} v_s φ(k_s)ᵀ by cumulative sum
        (needs a fixed α = 1);
      * "noncausal": φ(Q)(φ(K)ᵀV) with einsum (needs a fixed α = 1).
    ``forward(x, m0=None) -> (out, m_final)`` (m_final is None for the non-causal form).
    """

    FORMS = ("loop", "cumsum", "noncausal")
    eps = _constant("eps", "the normaliser's eps in y / (z·φ(q) + eps)")

    def __init__(self, d_model: int, n_heads: int = 2, d_k: int = 8, d_v: int = 8, *,
                 alpha: float | None = 0.9, normalise: bool = False, eps: float = 1e-6,
                 phi: str = "elu1", d_phi: int | None = None, form: str = "loop", use_scan: bool = False):
        super().__init__(d_model, n_heads, d_k, d_v, phi, {"alpha": alpha}, d_phi)
        if form not in self.FORMS:
            raise ValueError(f"form must be one of {self.FORMS}, got {form!r}")
        if form != "loop" and alpha != 1.0:
            raise ValueError(f"form={form!r} has no decay: it needs alpha=1.0, got {alpha!r}")
        self.normalise, self.eps, self.form, self.use_scan = normalise, eps, form, use_scan

    def step(self, state: tuple, k_t, v_t, q_t, alpha_t):
        """One token: ``state`` is (M,) or (M, z) with the normaliser."""
        M = alpha_t[..., None, None] * state[0] + v_t.unsqueeze(-1) * k_t.unsqueeze(-2)
        y = (M @ q_t.unsqueeze(-1)).squeeze(-1)
        if not self.normalise:
            return (M,), y
        z = alpha_t.unsqueeze(-1) * state[1] + k_t
        return (M, z), y / ((z * q_t).sum(-1, keepdim=True) + self.eps)

    def forward(self, x: torch.Tensor, m0: torch.Tensor | None = None):
        self.check_state(m0, x)
        B, T, _ = x.shape
        q, k, v = self.qkv(x)
        if self.form == "noncausal":
            if m0 is not None:
                raise ValueError("m0 must be None for the non-causal form (it has no recurrent state)")
            kv = torch.einsum("bthk,bthv->bhvk", k, v)
            y = torch.einsum("bthk,bhvk->bthv", q, kv)
            if self.normalise:
                y = y / (torch.einsum("bthk,bhk->bth", q, k.sum(1)).unsqueeze(-1) + self.eps)
            return self.out(y.reshape(B, T, -1)), None
        if self.form == "cumsum":
            Ms = torch.cumsum(v.unsqueeze(-1) * k.unsqueeze(-2), dim=1)  # [B, T, H, d_v, d_phi]
            if m0 is not None:
                Ms = Ms + m0.unsqueeze(1)
            y = (Ms @ q.unsqueeze(-1)).squeeze(-1)
            if self.normalise:
                y = y / ((torch.cumsum(k, dim=1) * q).sum(-1, keepdim=True) + self.eps)
            return self.out(y.reshape(B, T, -1)), Ms[:, -1]
        alpha = self.gate("alpha", x)
        M = x.new_zeros(B, self.n_heads, self.d_v, self.d_phi) if m0 is None else m0
        state = (M, x.new_zeros(B, self.n_heads, self.d_phi)) if self.normalise else (M,)
        if self.use_scan:
            # scan slices xs along dim 1 and stacks the per-step y along dim 1 again
            state, y = scan(lambda s, xs: self.step(s, *xs), state, (k, v, q, alpha), dim=1)
        else:
            ys = []
            for t in range(T):
                state, y_t = self.step(state, k[:, t], v[:, t], q[:, t], alpha[:, t])
                ys.append(y_t)
            y = torch.stack(ys, dim=1)
        return self.out(y.reshape(B, T, -1)), state[0]


def lp_memory_example() -> tuple[nn.Module, tuple]:
    """``hecate explain lp_memory``: p = 3, data-dependent gates, φ = elu+1, T = 16.

    η's gate starts near σ(−5) ≈ 0.007: the p = 3 step grows with e², so with keys that are not normalised
    (‖φ(k)‖ ≈ 3 here) an η near 0.5, what a default bias gives, makes the memory diverge within a few tokens."""
    torch.manual_seed(0)
    model = LpMemory(32, n_heads=2, d_k=8, d_v=8, p=3.0, alpha=None, eta=None, phi="elu1")
    with torch.no_grad():
        model.gate_proj["eta"].bias.fill_(-5.0)
    return model, (torch.randn(2, 16, 32),)


def hebbian_memory_example() -> tuple[nn.Module, tuple]:
    """``hecate explain hebbian_memory``: normalised fast weights, gated decay, T = 16."""
    torch.manual_seed(0)
    model = HebbianMemory(32, n_heads=2, d_k=8, d_v=8, alpha=None, normalise=True)
    return model, (torch.randn(2, 16, 32),)
