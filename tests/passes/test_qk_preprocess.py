"""The qk_preprocess pass end to end: what it fuses in each spelling, what it refuses and why,
and that the compiled model still equals eager (forward and every gradient)."""

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hecate
from hecate.models.short_conv import KeyQueryPreprocess
from hecate.testing import assert_close, assert_outputs_and_gradients_close, rel_err

TOL = 1e-5  # fp32, compiled vs eager

ELEMENTWISE = ["identity", "elu1", "relu", "relu2", "exp"]
PHI_DETAIL = {"identity": "", "elu1": " → elu+1", "relu": " → relu", "relu2": " → relu²", "exp": " → exp(min(·, 10))"}
PROJ_DETAIL = {"linear": "linear", "functional": "linear", "matmul": "x @ W.T + b"}


def _randomize(module: nn.Module) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.5)


def _compare_with_eager(model: nn.Module, *args: torch.Tensor, options=None) -> hecate.FusionReport:
    """Compile with hecate; forward and the gradients of every parameter and input equal eager's."""
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="hecate", options={"fallback": "eager"} if options is None else options)
    inputs = [a.detach().clone().requires_grad_() for a in args]
    ref_inputs = [a.detach().clone().requires_grad_() for a in args]
    got = compiled(*inputs)
    report = hecate.last_report()
    got = got if isinstance(got, tuple) else (got,)
    weights = [torch.randn_like(g) for g in got]  # a loss whose gradient differs per element
    sum(((g * w).sum() for g, w in zip(got, weights))).backward()
    got_grads = {n: p.grad for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    ref = model(*ref_inputs)
    ref = ref if isinstance(ref, tuple) else (ref,)
    sum(((r * w).sum() for r, w in zip(ref, weights))).backward()
    for i, (g, r) in enumerate(zip(got, ref)):
        assert_close(f"output {i}", g, r, TOL)
    for name, p in model.named_parameters():
        if p.grad is None:  # a parameter the spelling does not use
            assert got_grads[name] is None, name
            continue
        assert_close(f"d/d{name}", got_grads[name], p.grad, TOL)
    for i, (a, r) in enumerate(zip(inputs, ref_inputs)):
        assert_close(f"d/dinput{i}", a.grad, r.grad, TOL)
    model.zero_grad()
    torch._dynamo.reset()
    return report


def _details(report: hecate.FusionReport) -> list[str]:
    return [f.detail for f in report.fusions if f.pattern == "qk_preprocess"]


# ---------------------------------------------------------------- every φ kind × every spelling

# Pairwise coverage: every φ kind meets every projection, conv and SiLU spelling (the pass
# recognises each stage by its own pieces, so pairs are what can interact), in both layouts.
CASES = [(phi, proj, ["conv1d_slice", "pad_conv1d"][(i + j) % 2], ["silu", "sigmoid_mul"][(i + j // 2) % 2],
          (i + j) % 3 != 1)
         for i, phi in enumerate(ELEMENTWISE) for j, proj in enumerate(["linear", "functional", "matmul"])]


def test_cases_cover_every_pair_of_spellings():
    choices = [ELEMENTWISE, list(PROJ_DETAIL), ["conv1d_slice", "pad_conv1d"], ["silu", "sigmoid_mul"]]
    for a, b in itertools.combinations(range(4), 2):
        assert {(c[a], c[b]) for c in CASES} == set(itertools.product(choices[a], choices[b])), (a, b)
    for phi in ELEMENTWISE:
        assert {c[4] for c in CASES if c[0] == phi} == {True, False}  # both layouts


@pytest.mark.parametrize("phi,proj_style,conv_style,silu_style,heads", CASES)
def test_every_elementwise_phi_and_spelling_fuses_and_matches_eager(phi, proj_style, conv_style, silu_style, heads):
    model = KeyQueryPreprocess(7, 6, n_heads=3 if heads else None, kernel_size=4, phi=phi,
                               proj_bias=proj_style == "matmul", proj_style=proj_style, conv_style=conv_style,
                               silu_style=silu_style)
    _randomize(model)
    x = torch.randn(2, 5, 7)
    layout = "[B,T,H,Dh]" if heads else "[B,T,D]"
    expected = f"{PROJ_DETAIL[proj_style]} → conv(K=4) → silu{PHI_DETAIL[phi]} {layout}"

    explained = hecate.explain(model, x, options={"fallback": "eager"})
    assert _details(explained) == [expected, expected], str(explained)
    assert explained.misses == []
    assert all(f.op == "hecate.qk_preprocess" for f in explained.fusions)

    compiled_report = _compare_with_eager(model, x)
    assert _details(compiled_report) == [expected, expected]


@pytest.mark.parametrize("phi,phi_kwargs", [("elu1", dict(spelling="one_plus_elu")), ("relu2", dict(spelling="square")),
                                            ("relu2", dict(spelling="mul")), ("exp", dict(max_val=3.5))])
def test_phi_spellings(phi, phi_kwargs):
    model = KeyQueryPreprocess(6, 6, phi=phi, **phi_kwargs)
    _randomize(model)
    report = _compare_with_eager(model, torch.randn(2, 9, 6))
    name = "exp(min(·, 3.5))" if phi == "exp" else PHI_DETAIL[phi][3:]
    assert _details(report) == [f"linear → conv(K=4) → silu → {name} [B,T,D]"] * 2


@pytest.mark.parametrize("phi", ["elu1", "relu", "identity"])
def test_no_activation_kernel_sizes_and_short_sequences(phi):
    for kernel_size, T in [(3, 1), (4, 2), (2, 7)]:
        model = KeyQueryPreprocess(5, 5, kernel_size=kernel_size, activation="none", phi=phi, conv_bias=False)
        _randomize(model)
        report = _compare_with_eager(model, torch.randn(3, T, 5))
        assert _details(report) == [f"linear → conv(K={kernel_size}){PHI_DETAIL[phi]} [B,T,D]"] * 2


@pytest.mark.parametrize("n_heads", [None, 2])
def test_nodes_replaced_counts_every_node_of_the_chain(n_heads, tmp_path):
    """linear, transpose, conv1d, slice, transpose, silu, elu, add: 8 nodes, none left behind."""
    model = KeyQueryPreprocess(6, 6, n_heads=n_heads, phi="elu1")
    report = hecate.explain(model, torch.randn(2, 5, 6), options={"dump_dir": str(tmp_path)})
    assert [f.nodes_replaced for f in report.fusions] == [8, 8]
    after = next(tmp_path.glob("*after_qk_preprocess.txt")).read_text()
    for leftover in ("aten.linear", "aten.transpose", "aten.conv1d", "aten.slice", "aten.silu", "aten.elu"):
        assert leftover not in after, leftover
    assert after.count("torch.ops.hecate.qk_preprocess.default") == 2
    assert after.count("aten.unflatten") == (2 if n_heads else 0)


# ---------------------------------------------------------------- more spellings, written out

class Chain(nn.Module):
    """Parameters of one projection → conv chain; ``spelling(self, x)`` writes the forward."""

    def __init__(self, spelling, d_in=5, d=6, k=4, conv_bias=True):
        super().__init__()
        self.spelling, self.k = spelling, k
        self.w = nn.Parameter(torch.randn(d, d_in) * 0.5)
        self.b = nn.Parameter(torch.randn(d) * 0.5)
        self.cw = nn.Parameter(torch.randn(d, 1, k) * 0.5)
        self.cb = nn.Parameter(torch.randn(d) * 0.5) if conv_bias else None

    def forward(self, x):
        return self.spelling(self, x)


def _causal(m, u):  # [B, D, T] → [B, D, T]
    return F.conv1d(F.pad(u, (m.k - 1, 0)), m.cw, m.cb, groups=u.shape[1])


SPELLED = {
    "mT and silu before the transpose back": (
        lambda m, x: F.silu(_causal(m, (x @ m.w.t()).mT)).mT,
        "x @ W.transpose(0, 1) → conv(K=4) → silu [B,T,D]"),
    "permute, sigmoid(z) * z, exp without clamp": (
        lambda m, x: (lambda z: torch.exp(torch.sigmoid(z) * z))(
            _causal(m, F.linear(x, m.w, m.b).permute(0, 2, 1)).permute(0, 2, 1)),
        "linear → conv(K=4) → silu → exp [B,T,D]"),
    "transpose(-1, -2), W.transpose(0, 1), clamp_max": (
        lambda m, x: torch.exp(torch.clamp_max(F.silu(_causal(m, (x @ m.w.transpose(0, 1) + m.b).transpose(-1, -2))
                                                      .transpose(-1, -2)), 2.0)),
        "x @ W.transpose(0, 1) + b → conv(K=4) → silu → exp(min(·, 2)) [B,T,D]"),
    "reshape heads before silu, nn-style slice [..., :-(K-1)]": (
        lambda m, x: F.relu(F.silu(F.conv1d(F.linear(x, m.w).transpose(1, 2), m.cw, m.cb, padding=m.k - 1,
                                            groups=6)[..., :-(m.k - 1)].transpose(1, 2).reshape(*x.shape[:2], 2, 3))),
        "linear → conv(K=4) → silu → relu [B,T,H,Dh]"),
    "unflatten heads": (
        lambda m, x: F.elu(F.silu(_causal(m, F.linear(x, m.w, m.b).transpose(1, 2)).transpose(1, 2))
                           .unflatten(-1, (3, 2))) + 1,
        "linear → conv(K=4) → silu → elu+1 [B,T,H,Dh]"),
    "pointwise conv (K=1) without padding, bias-free": (
        lambda m, x: F.silu(F.conv1d(F.linear(x, m.w, m.b).transpose(1, 2), m.cw, None, groups=6).transpose(1, 2)),
        "linear → conv(K=1) → silu [B,T,D]", dict(k=1)),
    "silu and φ before the transpose back": (
        lambda m, x: (F.relu(F.silu(_causal(m, F.linear(x, m.w, m.b).transpose(1, 2)))) ** 2).transpose(1, 2),
        "linear → conv(K=4) → silu → relu² [B,T,D]"),
    "conv alone": (
        lambda m, x: _causal(m, torch.cat([x, x[..., :1]], -1).transpose(1, 2)).transpose(1, 2),  # D_in 5 → D 6
        "conv(K=4) [B,T,D]"),
}


@pytest.mark.parametrize("name", list(SPELLED))
def test_written_out_spellings(name):
    spelling, expected, *chain_kwargs = SPELLED[name]
    report = _compare_with_eager(Chain(spelling, **(chain_kwargs[0] if chain_kwargs else {})), torch.randn(2, 7, 5))
    assert _details(report) == [expected], str(report)
    assert report.misses == []


def test_projection_read_elsewhere_is_left_out_of_the_fusion():
    def spelling(m, x):
        u = F.linear(x, m.w, m.b)
        return F.silu(_causal(m, u.transpose(1, 2)).transpose(1, 2)) + u  # u also feeds the residual

    report = _compare_with_eager(Chain(spelling), torch.randn(2, 7, 5))
    assert _details(report) == ["conv(K=4) → silu [B,T,D]; read by aten.add.Tensor, left to the fallback "
                                "(not a φ the op fuses)"]


def test_why_no_phi_is_fused_names_an_elementwise_op_not_generated():
    """probe r36: "(not a φ the op fuses)" where the reader is elementwise (atan is no operation of the generated
    language)."""
    def not_generated(m, x):
        return torch.atan(F.silu(_causal(m, F.linear(x, m.w, m.b).transpose(1, 2))))

    report = _compare_with_eager(Chain(not_generated), torch.randn(2, 7, 5))
    assert _details(report) == ["linear → conv(K=4) → silu [B,D,T], the op's [B,T,D] transposed; read by "
                                "aten.atan.default, elementwise but not an operation Hecate generates into the "
                                "kernel"], str(report)


def test_an_output_read_only_through_a_view_is_described_without_a_phi_left_out():
    """φ = identity and the output read by a permute (heads or time moved first for the memory): a view is no
    φ, so the detail names no reader "left to the fallback" (it did, and read like a near-miss)."""
    def spelling(m, x):
        return F.silu(_causal(m, F.linear(x, m.w, m.b).transpose(1, 2))).permute(2, 0, 1)  # [T, B, D]

    report = _compare_with_eager(Chain(spelling), torch.randn(2, 7, 5))
    assert _details(report) == ["linear → conv(K=4) → silu [B,T,D]"], str(report)


def test_intermediate_read_elsewhere_stops_the_chain_there():
    def spelling(m, x):
        a = F.silu(_causal(m, F.linear(x, m.w, m.b).transpose(1, 2)).transpose(1, 2))
        return F.elu(a) + 1, a  # the SiLU output is returned too

    report = _compare_with_eager(Chain(spelling), torch.randn(2, 7, 5))
    assert _details(report)[0].startswith("linear → conv(K=4) → silu [B,T,D]")


def test_a_conv_output_read_by_silu_and_another_op_ends_the_chain_and_says_so():
    """probe r36 p17: the conv's output is also averaged; SiLU then reads the op's output. The detail said SiLU
    was "not a φ the op fuses"; it names the shared value instead."""
    def spelling(m, x):
        c = _causal(m, F.linear(x, m.w, m.b).transpose(1, 2))
        return F.elu(F.silu(c)) + 1, c.mean(1)

    report = _compare_with_eager(Chain(spelling), torch.randn(2, 7, 5))
    assert _details(report) == ["linear → conv(K=4) [B,D,T], the op's [B,T,D] transposed; read by aten.mean.dim, "
                                "aten.silu.default: a value more than one op reads ends the chain, each reading the "
                                "op's output"], str(report)


# ---------------------------------------------------------------- matrix φ

MATRIX_PHI_DETAIL = {"linear": "linear φ", "random_fourier": "random Fourier φ", "performer": "Performer φ"}


@pytest.mark.parametrize("heads", [2, None])
@pytest.mark.parametrize("phi", ["linear", "random_fourier", "performer", "poly2", "mlp"])
def test_matrix_phi(phi, heads):
    """Learned linear, random Fourier and Performer φ fuse per head; the others fuse up to SiLU, φ is left."""
    model = KeyQueryPreprocess(6, 6, n_heads=heads, phi=phi, d_phi=5)
    _randomize(model)
    report = _compare_with_eager(model, torch.randn(2, 5, 6))
    layout = "[B,T,H,Dh]" if heads else "[B,T,D]"
    if phi in MATRIX_PHI_DETAIL:
        assert _details(report) == [f"linear → conv(K=4) → silu → {MATRIX_PHI_DETAIL[phi]}(d_phi=5) {layout}"] * 2
    else:
        assert len(_details(report)) == 2
        for detail in _details(report):
            assert detail.startswith(f"linear → conv(K=4) → silu {layout}; read by aten."), detail
            assert detail.endswith("left to the fallback (not a φ the op fuses)")
    assert report.misses == []


def test_random_fourier_with_wrong_scale_fuses_only_its_linear_map():
    def spelling(m, x):
        a = F.silu(_causal(m, F.linear(x, m.w, m.b).transpose(1, 2)).transpose(1, 2))
        return 0.5 * torch.cos(a @ m.w_phi.T + m.b_phi)  # sqrt(2/4) would be 0.7071

    chain = Chain(spelling)
    chain.w_phi, chain.b_phi = nn.Parameter(torch.randn(4, 6)), nn.Parameter(torch.randn(4))
    report = _compare_with_eager(chain, torch.randn(2, 7, 5))
    assert _details(report) == ["linear → conv(K=4) → silu → linear φ(d_phi=4) [B,T,D]"]
    assert [m.reason for m in report.misses] == [
        "phi not fused: random Fourier features scaled by 0.5, not sqrt(2/d_phi) = 0.707107"]


def test_linear_phi_with_bias_is_left_and_reported():
    def spelling(m, x):
        a = F.silu(_causal(m, F.linear(x, m.w, m.b).transpose(1, 2)).transpose(1, 2))
        return F.linear(a, m.w_phi, m.b_phi)

    chain = Chain(spelling)
    chain.w_phi, chain.b_phi = nn.Parameter(torch.randn(4, 6)), nn.Parameter(torch.randn(4))
    report = _compare_with_eager(chain, torch.randn(2, 7, 5))
    assert _details(report)[0].startswith("linear → conv(K=4) → silu [B,T,D]; read by aten.linear.default")
    assert [m.reason for m in report.misses] == [
        "phi not fused: the linear feature map has a bias; φ(k) = W_phi k has none"]


# ---------------------------------------------------------------- near-misses

class NearMiss(nn.Module):
    def __init__(self, conv: nn.Conv1d, forward):
        super().__init__()
        self.proj, self.conv, self.fn = nn.Linear(6, 6), conv, forward

    def forward(self, x):
        return F.elu(F.silu(self.fn(self, self.proj(x).transpose(1, 2)).transpose(1, 2))) + 1


NEAR_MISSES = {
    "symmetric padding": (nn.Conv1d(6, 6, 3, groups=6, padding=1), lambda m, u: m.conv(u),
                          "conv1d padding=[1] pads both sides (kernel 3) and no slice keeps the first T outputs"),
    "no padding": (nn.Conv1d(6, 6, 3, groups=6), lambda m, u: m.conv(u),
                   "conv1d has no padding (kernel 3) and no F.pad(K−1, 0) before it: not a causal conv"),
    "groups=1": (nn.Conv1d(6, 6, 4, padding=3), lambda m, u: m.conv(u)[..., :u.shape[2]],
                 "conv1d has groups=1 and weight (6, 6, 4); the pattern needs a depthwise conv (groups = channels = 6"),
    "dilation 2": (nn.Conv1d(6, 6, 4, groups=6, padding=6, dilation=2), lambda m, u: m.conv(u)[..., :u.shape[2]],
                   "conv1d has dilation=[2]; the fused op supports dilation 1 only"),
    "padding='same'": (nn.Conv1d(6, 6, 4, groups=6, padding="same"), lambda m, u: m.conv(u),
                       "conv1d padding='same' pads both sides"),
    "F.pad on both sides": (nn.Conv1d(6, 6, 4, groups=6), lambda m, u: m.conv(F.pad(u, (2, 1))),
                            "F.pad pads (2, 1) with kernel 4; a causal conv pads (K−1, 0) = (3, 0)"),
    "slice keeps the last T": (nn.Conv1d(6, 6, 4, groups=6, padding=3), lambda m, u: m.conv(u)[..., 3:],
                               "keeps 5 outputs, not the first T=5: not causal"),
    "stride 2": (nn.Conv1d(6, 6, 4, groups=6, padding=3, stride=2), lambda m, u: m.conv(u)[..., :3],
                 "conv1d has stride=[2]; the pattern needs stride 1"),
}


@pytest.mark.parametrize("name", list(NEAR_MISSES))
def test_near_miss_is_not_fused_and_says_why(name):
    conv, forward, reason = NEAR_MISSES[name]
    model = NearMiss(conv, forward)
    x = torch.randn(2, 5, 6)
    report = _compare_with_eager(model, x)
    assert report.fusions == []
    assert len(report.misses) == 1, str(report)
    assert report.misses[0].pattern == "qk_preprocess"
    assert reason in report.misses[0].reason, report.misses[0].reason
    assert "conv" in report.misses[0].where


def test_conv_output_kept_channels_first_fuses_transposed_back():
    """No swap back to [B, T, D]: the chain's [B, D, T] output is the op's result transposed (it was a near-miss;
    probe r23 found a per-channel gain g[:, None] on [B, D, T] before SiLU refused so)."""
    def spelling(m, x):
        return F.silu(_causal(m, F.linear(x, m.w, m.b).transpose(1, 2)))  # returns [B, D, T]

    report = _compare_with_eager(Chain(spelling), torch.randn(2, 7, 5))
    assert report.count("qk_preprocess") == 1 and not report.misses, str(report)
    assert "silu [B,D,T], the op's [B,T,D] transposed" in report.fusions[0].detail, str(report)


@pytest.mark.parametrize("back", [False, True], ids=["kept_channels_first", "transposed_back"])
def test_a_channels_first_input_fuses_read_transposed(back):
    """x [B, D, T] given to the conv as it is (a Hyena-style channels-first stack, no transpose in): the op reads x
    transposed (it was reported as an input that is not a transpose)."""
    def spelling(m, u):
        z = F.silu(_causal(m, u))
        return z.transpose(1, 2) if back else z

    report = _compare_with_eager(Chain(spelling, d_in=6), torch.randn(2, 6, 7))
    assert report.count("qk_preprocess") == 1 and not report.misses, str(report)
    assert "from x [B,D,T] read transposed" in report.fusions[0].detail, str(report)


# ---------------------------------------------------------------- φ as any elementwise function

def _with_phi(phi):
    def spelling(m, x):
        return phi(F.silu(_causal(m, F.linear(x, m.w, m.b).transpose(1, 2)).transpose(1, 2)))
    return spelling


POINTWISE_PHIS = {
    "invented": (lambda z: torch.sigmoid(z) * z + 0.5 * z.square(),
                 "φ = pow(x,2.0);mul(0.5,%0);sigmoid(x);mul(x,%2);add(%1,%3)"),
    "softplus": (F.softplus, "φ = gt(x,20.0);exp(x);log1p(%1);where(%0,x,%2)"),
    "relu squared": (lambda z: F.relu(z) ** 2, "relu²"),                      # the fast path
    "ELU + 2": (lambda z: F.elu(z) + 2, "φ = gt(x,0.0);expm1(x);where(%0,x,%1);add(2.0,%2)"),
    "scaled tanh with a clamp": (lambda z: 1.5 * torch.tanh(z.clamp(min=-2.0)) + torch.abs(z) ** 3,
                                 "φ = clamp_min(x,-2.0);tanh(%0);mul(1.5,%1);abs(x);pow(%3,3.0);add(%2,%4)"),
}


@pytest.mark.parametrize("name", list(POINTWISE_PHIS))
def test_any_elementwise_phi_fuses_and_matches_eager(name):
    phi, described = POINTWISE_PHIS[name]
    report = _compare_with_eager(Chain(_with_phi(phi)), torch.randn(2, 7, 5))
    assert _details(report) == [f"linear → conv(K=4) → silu → {described} [B,T,D]"], str(report)
    assert report.misses == []


def test_elementwise_phi_after_the_head_split_through_the_triton_kernels():
    from hecate.lowering.dispatch import triton_on_cpu

    phi, described = POINTWISE_PHIS["invented"]

    def spelling(m, x):
        a = F.silu(_causal(m, F.linear(x, m.w, m.b).transpose(1, 2)).transpose(1, 2))
        return phi(a.view(*x.shape[:2], 2, 3))

    with triton_on_cpu():
        report = _compare_with_eager(Chain(spelling), torch.randn(2, 7, 5))
    assert _details(report) == [f"linear → conv(K=4) → silu → {described} [B,T,H,Dh]"], str(report)


def test_elementwise_phi_stops_at_the_first_op_that_is_not_elementwise():
    """φ(a) = exp(a) · 2 feeds a sum: φ is fused, the sum is left to the fallback."""
    report = _compare_with_eager(Chain(_with_phi(lambda a: (torch.exp(a) * 2).sum(-1))), torch.randn(2, 7, 5))
    assert _details(report) == ["linear → conv(K=4) → silu → φ = exp(x);mul(2.0,%0) [B,T,D]"], str(report)


def test_elementwise_phi_with_another_tensor_is_not_fused_into_the_op():
    def spelling(m, x):
        a = F.silu(_causal(m, F.linear(x, m.w, m.b).transpose(1, 2)).transpose(1, 2))
        return torch.exp(a) * x.sum(-1, keepdim=True)      # reads x: not a function of a alone

    report = _compare_with_eager(Chain(spelling), torch.randn(2, 7, 5))
    assert _details(report) == ["linear → conv(K=4) → silu → exp [B,T,D]"], str(report)


# ---------------------------------------------------------------- Inductor, options, CLI, export

@pytest.mark.slow
@pytest.mark.parametrize("kwargs", [dict(n_heads=2, phi="elu1"),
                                    dict(phi="relu2", proj_style="matmul", proj_bias=True, conv_style="pad_conv1d",
                                         silu_style="sigmoid_mul")])
def test_inductor_fallback(kwargs):
    model = KeyQueryPreprocess(6, 6, **kwargs)
    _randomize(model)
    report = _compare_with_eager(model, torch.randn(2, 5, 6), options={})
    assert report.count("qk_preprocess") == 2


def test_patterns_option_disables_the_fusion():
    model = KeyQueryPreprocess(6, 6, phi="elu1")
    x = torch.randn(2, 5, 6)
    assert hecate.explain(model, x, options={"patterns": []}).fusions == []
    report = _compare_with_eager(model, x, options={"fallback": "eager", "patterns": []})
    assert report.fusions == [] and report.misses == []
    assert hecate.explain(model, x, options={"patterns": ["qk_preprocess"]}).count("qk_preprocess") == 2


def test_dynamic_shapes_fuse_and_match_eager():
    model = KeyQueryPreprocess(6, 6, n_heads=2, phi="relu2")
    _randomize(model)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="hecate", options={"fallback": "eager"}, dynamic=True)
    for T in (3, 8):
        x = torch.randn(2, T, 6)
        for got, ref in zip(compiled(x), model(x)):
            assert_close(f"T={T}", got, ref, TOL)
        assert hecate.last_report().count("qk_preprocess") == 2
    torch._dynamo.reset()


def test_cli_explain_prints_the_report(capsys):
    from hecate.compiler.cli import main

    assert main(["explain", "qk_preprocess", "qk_preprocess_performer", "qk_preprocess_near_miss",
                 "--fallback", "eager"]) == 0
    out = capsys.readouterr().out
    assert "== qk_preprocess ==" in out and "== qk_preprocess_performer ==" in out
    assert out.count("hecate.qk_preprocess") == 4
    assert "0 fused, 2 not fused" in out
    assert "outputs see future tokens, not causal" in out and "conv1d has groups=1" in out
    assert "linear → conv(K=4) → silu → elu+1 [B,T,H,Dh]" in out
    assert "linear → conv(K=4) → silu → Performer φ(d_phi=16) [B,T,H,Dh]" in out


def _fused_example(phi="elu1"):
    model = KeyQueryPreprocess(6, 6, n_heads=2, phi=phi, proj_style="matmul", proj_bias=True, d_phi=5)
    _randomize(model)
    return model, torch.randn(2, 5, 6)


@pytest.mark.parametrize("phi", ["elu1", "linear"])
def test_onnx_export_runs_in_onnxruntime(tmp_path, phi):
    import onnxruntime as ort

    model, x = _fused_example(phi)
    path = tmp_path / "qk.onnx"
    report = hecate.export_onnx(model, (x,), path)
    assert report.count("qk_preprocess") == 2, str(report)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    outputs = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    for got, ref in zip(outputs, model(x)):
        assert rel_err(torch.from_numpy(got), ref) <= 1e-4


@pytest.mark.parametrize("output_type,phi", [("torch", "elu1"), ("linalg-on-tensors", "elu1"),
                                            ("linalg-on-tensors", "linear")])
def test_mlir_export(output_type, phi):
    from hecate.compiler.export import export_program

    model, x = _fused_example(phi)
    _, report = export_program(model, (x,))
    assert report.count("qk_preprocess") == 2
    text = hecate.export_mlir(model, (x,), output_type=output_type)
    assert "func.func @main" in text
    assert "hecate" not in text and "torch.operator" not in text
    if output_type == "linalg-on-tensors":
        assert "linalg." in text and "torch.aten" not in text


def test_fused_model_through_the_triton_kernels():
    """The compiled model with the op on its Triton path (interpreted on CPU) still equals eager."""
    from hecate.lowering.dispatch import triton_on_cpu

    model = KeyQueryPreprocess(5, 6, n_heads=2, phi="elu1", proj_bias=True)
    _randomize(model)
    with triton_on_cpu():
        report = _compare_with_eager(model, torch.randn(2, 3, 5))
    assert report.count("qk_preprocess") == 2


def test_many_chains_in_one_graph():
    """Three stacked blocks: six chains, each replaced after the graph was rebuilt by the previous one."""
    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(KeyQueryPreprocess(6, 6, n_heads=2, phi=phi)
                                        for phi in ("elu1", "relu2", "exp"))

        def forward(self, x):
            for block in self.blocks:
                q, k = block(x)
                x = x + 0.1 * (q * k).flatten(-2)
            return x

    model = Stack()
    _randomize(model)
    report = _compare_with_eager(model, torch.randn(2, 5, 6))
    assert [d.split(" → ")[-1] for d in _details(report)] == \
        ["elu+1 [B,T,H,Dh]"] * 2 + ["relu² [B,T,H,Dh]"] * 2 + ["exp(min(·, 10)) [B,T,H,Dh]"] * 2


def test_narrow_for_the_causal_slice_fuses_and_another_window_is_reported():
    """narrow(2, 0, T) is the slice [..., :T] (the normal form reads it so); narrow(2, 3, T) keeps outputs that
    see the future and is reported as the slice it is."""
    def spelling(start):
        def chain(m, x):
            u = F.linear(x, m.w, m.b).transpose(1, 2)
            return F.silu(F.conv1d(u, m.cw, m.cb, padding=m.k - 1, groups=6).narrow(2, start, x.shape[1])
                          .transpose(1, 2))
        return chain

    report = _compare_with_eager(Chain(spelling(0)), torch.randn(2, 7, 5))
    assert _details(report) == ["linear → conv(K=4) → silu [B,T,D]"] and report.misses == []
    report = _compare_with_eager(Chain(spelling(3)), torch.randn(2, 7, 5))
    assert report.fusions == []
    assert [m.reason for m in report.misses] == [
        "conv1d pads 3 on both sides but the slice (dim=2, start=3, step=1) keeps 7 outputs, not the first T=7: "
        "not causal"]


# ---------------------------------------------------------------- a carried conv state (streaming)

class Streamed(nn.Module):
    """One chunk of a stream: (the block's output on x after ``state``, the state after x)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x, state):
        return self.block(x, state), self.block.next_state(x, state)


def _leaves(tree) -> list[torch.Tensor]:
    return list(tree) if isinstance(tree, (tuple, list)) else [tree]


def _stream_compiled_vs_whole_eager(block: nn.Module, x: torch.Tensor, state, bounds, expected: str):
    """x in chunks through the compiled block, carrying the state, equals eager on the whole of x: outputs, the
    final state, and the gradients of the parameters, of x and of the first state. Each chunk's graph fuses
    ``expected(T)`` (T: the chunk's length)."""
    torch._dynamo.reset()
    compiled = torch.compile(Streamed(block), backend="hecate", options={"fallback": "eager"}, dynamic=False)
    xs = x.detach().clone().requires_grad_()
    states = [s.detach().clone().requires_grad_() for s in _leaves(state)]
    carried, outs = tuple(states) if isinstance(state, tuple) else states[0], []
    for start, stop in zip(bounds[:-1], bounds[1:]):
        out, carried = compiled(xs[:, start:stop], carried)
        outs.append(_leaves(out))
        assert _details(hecate.last_report()) == [expected(stop - start)] * len(_leaves(out)), \
            str(hecate.last_report())
    got = [torch.cat(parts, 1) for parts in zip(*outs)] + _leaves(carried)
    weights = [torch.randn_like(g) for g in got]
    sum((g * w).sum() for g, w in zip(got, weights)).backward()
    got_grads = {n: p.grad for n, p in block.named_parameters()}
    block.zero_grad(set_to_none=True)

    x_ref = x.detach().clone().requires_grad_()
    ref_states = [s.detach().clone().requires_grad_() for s in _leaves(state)]
    out, final = Streamed(block)(x_ref, tuple(ref_states) if isinstance(state, tuple) else ref_states[0])
    ref = _leaves(out) + _leaves(final)
    sum((r * w).sum() for r, w in zip(ref, weights)).backward()
    for i, (g, r) in enumerate(zip(got, ref)):
        assert_close(f"output {i}", g, r, TOL)
    for name, p in block.named_parameters():
        assert_close(f"d/d{name}", got_grads[name], p.grad, TOL)
    assert_close("d/dx", xs.grad, x_ref.grad, TOL)
    for i, (s, r) in enumerate(zip(states, ref_states)):
        assert_close(f"d/dstate{i}", s.grad, r.grad, TOL)
    torch._dynamo.reset()


@pytest.mark.parametrize("kernel_size,bounds", [(4, (0, 2, 7, 9)), (3, (0, 4, 5, 9))],
                         ids=["K4-chunk-shorter-than-state", "K3-one-token-chunk"])
def test_short_conv_streams_in_chunks_with_the_state_fused(kernel_size, bounds):
    """ShortCausalConv.forward(x, state) convolves cat([state, x]): the op with the state as conv_state."""
    from hecate.models.short_conv import ShortCausalConv

    torch.manual_seed(0)
    block = ShortCausalConv(6, kernel_size)
    _randomize(block)
    state = torch.randn(2, kernel_size - 1, 6)
    _stream_compiled_vs_whole_eager(block, torch.randn(2, 9, 6), state, bounds,
                                    lambda T: f"conv(K={kernel_size}, carried state) → silu [B,T,D]")


@pytest.mark.parametrize("kwargs,projection,rest", [
    (dict(n_heads=2, phi="elu1"), "linear", "conv(K=4, carried state) → silu → elu+1 [B,T,H,Dh]"),
    (dict(phi="relu", activation="none", proj_style="matmul", proj_bias=True), "x @ W.T + b",
     "conv(K=4, carried state) → relu [B,T,D]"),
], ids=["heads-elu1", "matmul-no-silu-relu"])
def test_key_query_block_streams_in_chunks_with_the_state_fused(kwargs, projection, rest):
    """KeyQueryPreprocess with its (queries', keys') conv states: both chains fuse with their state. A chunk of
    at most K−1 tokens is all the next state's too, so its projection is read twice and stays outside the op."""
    torch.manual_seed(0)
    block = KeyQueryPreprocess(5, 6, **kwargs)
    _randomize(block)
    state = (torch.randn(3, 3, 6), torch.randn(3, 3, 6))
    _stream_compiled_vs_whole_eager(block, torch.randn(3, 10, 5), state, (0, 3, 4, 10),
                                    lambda T: f"{projection} → {rest}" if T > 3 else rest)


class StatefulSpelling(nn.Module):
    """A chain over cat([state, x]) written by ``spelling(self, u [B, D, T], state [B, K−1, D])``."""

    def __init__(self, spelling, d=6, k=4):
        super().__init__()
        self.spelling, self.k = spelling, k
        self.cw = nn.Parameter(torch.randn(d, 1, k) * 0.5)
        self.cb = nn.Parameter(torch.randn(d) * 0.5)

    def forward(self, x, state):
        return F.silu(self.spelling(self, x.transpose(1, 2), state).transpose(1, 2))


STATEFUL_SPELLINGS = {
    "state kept channels first": lambda m, u, s: F.conv1d(torch.cat([s.permute(0, 2, 1), u], 2), m.cw, m.cb, groups=6),
    "padding=K-1 then keep x's outputs": lambda m, u, s: F.conv1d(
        torch.cat([s.mT, u], -1), m.cw, m.cb, padding=m.k - 1, groups=6)[..., m.k - 1:-(m.k - 1)],
}


@pytest.mark.parametrize("name", list(STATEFUL_SPELLINGS))
def test_stateful_spellings_fuse_and_match_eager(name):
    report = _compare_with_eager(StatefulSpelling(STATEFUL_SPELLINGS[name]), torch.randn(2, 5, 6),
                                 torch.randn(2, 3, 6))
    assert _details(report) == ["conv(K=4, carried state) → silu [B,T,D]"], str(report)
    assert report.misses == []


def test_state_read_elsewhere_keeps_its_cat():
    """The cat is also the next state's source: the op reads the state, the cat stays for the other reader."""
    class Both(StatefulSpelling):
        def forward(self, x, state):
            context = torch.cat([state.transpose(1, 2), x.transpose(1, 2)], -1)
            z = F.conv1d(context, self.cw, self.cb, groups=6)
            return F.silu(z.transpose(1, 2)), context[..., -(self.k - 1):]

    report = _compare_with_eager(Both(None), torch.randn(2, 5, 6), torch.randn(2, 3, 6))
    assert _details(report) == ["conv(K=4, carried state) → silu [B,T,D]"], str(report)
    assert [f.nodes_replaced for f in report.fusions] == [3]    # conv, transpose back, silu: x's transpose stays


STATEFUL_NEAR_MISSES = {
    "state of K-2 steps": (lambda m, u, s: F.conv1d(torch.cat([s[:, 1:].transpose(1, 2), u], -1), m.cw, m.cb,
                                                    groups=6),
                           "conv1d reads cat([state, x]) with a state of 2 steps; a causal conv of kernel 4 carries "
                           "the K−1=3 inputs before x"),
    "padding=K-1 keeping the first T": (
        lambda m, u, s: F.conv1d(torch.cat([s.transpose(1, 2), u], -1), m.cw, m.cb, padding=m.k - 1,
                                 groups=6)[..., :u.shape[2]],
        "conv1d over cat([state, x]) pads 3 on both sides but the slice (dim=2, start=0, step=1) keeps 5 outputs, "
        "not the T=5 from K−1=3 (x's outputs)"),
}


@pytest.mark.parametrize("name", list(STATEFUL_NEAR_MISSES))
def test_stateful_near_miss_is_not_fused_and_says_why(name):
    spelling, reason = STATEFUL_NEAR_MISSES[name]
    report = _compare_with_eager(StatefulSpelling(spelling), torch.randn(2, 5, 6), torch.randn(2, 3, 6))
    assert report.fusions == []
    assert [m.pattern for m in report.misses] == ["qk_preprocess"], str(report)
    assert reason in report.misses[0].reason, report.misses[0].reason


class Stepper(nn.Module):
    """A block's decode step as a forward: (x_t, state) → step(x_t, state)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x_t, state):
        return self.block.step(x_t, state)


@pytest.mark.parametrize("kwargs,expected", [
    (dict(), "window step conv(K=4, carried state) → silu [B,D]"),
    (dict(bias=False, activation="none"), "window step conv(K=4, carried state) [B,D]"),
], ids=["silu-bias", "no-bias-no-activation"])
def test_short_conv_step_decodes_token_by_token_fused(kwargs, expected, tmp_path):
    """ShortCausalConv.step's window product Σ_k window[:, k]·w[:, k] is the conv of one token: compiled, step by
    step from a random state, it equals forward() over the whole sequence (outputs, final state, gradients of the
    weights, the tokens and the first state). The window stays: it is also the next state."""
    from hecate.models.short_conv import ShortCausalConv

    torch.manual_seed(0)
    block = ShortCausalConv(6, 4, **kwargs)
    _randomize(block)
    torch._dynamo.reset()
    compiled = torch.compile(Stepper(block), backend="hecate", options={"fallback": "eager", "dump_dir": str(tmp_path)})
    x = torch.randn(3, 5, 6, requires_grad=True)
    state0 = torch.randn(3, 3, 6, requires_grad=True)
    state, outs = state0, []
    for t in range(x.shape[1]):
        out, state = compiled(x[:, t], state)
        outs.append(out)
    assert _details(hecate.last_report()) == [expected], str(hecate.last_report())
    after = next(tmp_path.glob("*after_qk_preprocess.txt")).read_text()
    assert "aten.einsum" not in after and "aten.cat" in after
    got = [torch.stack(outs, 1), state]
    weights = [torch.randn_like(g) for g in got]
    got_grads = torch.autograd.grad(sum((g * w).sum() for g, w in zip(got, weights)),
                                    [x, state0, *block.parameters()])
    ref = [block(x, state0), block.next_state(x, state0)]
    ref_grads = torch.autograd.grad(sum((r * w).sum() for r, w in zip(ref, weights)),
                                    [x, state0, *block.parameters()])
    for name, g, r in zip(("outputs", "final state"), got, ref):
        assert_close(name, g, r, TOL)
    for name, g, r in zip(["x", "state"] + [n for n, _ in block.named_parameters()], got_grads, ref_grads):
        assert_close(f"d/d{name}", g, r, TOL)
    torch._dynamo.reset()


class WindowProduct(nn.Module):
    def __init__(self, product, d=6, k=4):
        super().__init__()
        self.product = product
        self.kernel = nn.Parameter(torch.randn(d, k) * 0.5)

    def forward(self, x_t, state):
        return F.silu(self.product(self, torch.cat([state, x_t.unsqueeze(1)], 1)))


@pytest.mark.parametrize("product", [
    lambda m, w: (w.square() * m.kernel.T).sum(1),            # not linear in the window
    lambda m, w: (w[:, 1:] * m.kernel.T[1:]).sum(1),           # K−1 of the window's K columns
], ids=["squared-window", "first-column-dropped"])
def test_a_window_product_that_is_not_a_conv_is_left_alone(product):
    report = _compare_with_eager(WindowProduct(product), torch.randn(2, 6), torch.randn(2, 3, 6))
    assert report.fusions == [] and report.misses == [], str(report)


@pytest.mark.parametrize("product", [
    lambda m, w: torch.einsum("bkd,dk->bd", w, m.kernel.flip(-1)),             # taps stored newest first
    lambda m, w: (w * m.kernel.T.softmax(0)).sum(1),                           # taps a function of the parameter
    lambda m, w: (w.transpose(1, 2).unsqueeze(-2) @ m.kernel.unsqueeze(-1)).squeeze(-1).squeeze(-1),  # by matmul
    lambda m, w: (w * m.kernel.T).sum(1, keepdim=True).squeeze(1),             # summed with keepdim, then squeezed
], ids=["flipped-taps", "softmax-taps", "batched-matmul", "keepdim-sum"])
def test_a_window_product_of_taps_computed_from_the_parameter_fuses(product):
    """The taps the product reads may be computed from the parameter (flipped, a softmax of it): the op reads them
    as the graph computes them; the product may be a batched matmul (probe r30: each silent)."""
    torch.manual_seed(0)
    report = _compare_with_eager(WindowProduct(product), torch.randn(2, 6), torch.randn(2, 3, 6))
    assert _details(report) == ["window step conv(K=4, carried state) → silu [B,D]"], str(report)


class TokenKeptAsASequenceOfOne(nn.Module):
    """A decode step on a token [B, 1, D], its window product summed with keepdim=True: z [B, 1, D], the taps the
    nn.Conv1d's own weight (probe r30: silent)."""

    def __init__(self, d=6, k=3):
        super().__init__()
        self.proj, self.conv = nn.Linear(d, d), nn.Conv1d(d, d, k, groups=d, padding=k - 1)

    def forward(self, x, cache):
        window = torch.cat([cache, self.proj(x)], 1)
        z = (window * self.conv.weight[:, 0].T).sum(1, keepdim=True) + self.conv.bias
        return F.elu(F.silu(z)) + 1, window[:, 1:]


def test_a_token_kept_as_a_sequence_of_one_fuses():
    torch.manual_seed(0)
    report = _compare_with_eager(TokenKeptAsASequenceOfOne(), torch.randn(2, 1, 6), torch.randn(2, 2, 6))
    assert _details(report) == ["window step conv(K=3, carried state) → silu → elu+1 [B,D]"], str(report)


def test_window_step_with_as_many_taps_as_channels_finds_its_layout():
    """K = D: a [D, K] and a [K, D] kernel have the same shape; the evaluation tells which one the product reads."""
    for product in (lambda m, w: (w * m.kernel.T).sum(1), lambda m, w: (w * m.kernel).sum(1)):
        report = _compare_with_eager(WindowProduct(product, d=4, k=4), torch.randn(2, 4), torch.randn(2, 3, 4))
        assert _details(report) == ["window step conv(K=4, carried state) → silu [B,D]"], str(report)


class RollingWindow(nn.Module):
    """The conv over a rolling window kept channels first, [B, D, K]: the oldest column dropped, the new token's
    appended, ``cat([cache[..., 1:], h[..., None]], -1)``, weighted per channel and summed over the last dim; one
    decode step, or ``steps`` of them in a loop with SiLU and φ after the steps' outputs are stacked."""

    def __init__(self, steps=None, d=6, k=3):
        super().__init__()
        self.proj, self.kernel, self.steps = nn.Linear(d, d), nn.Parameter(torch.randn(d, k) * 0.5), steps

    def forward(self, x, cache):
        if self.steps is None:  # x [B, D]: one token
            cache = torch.cat([cache[:, :, 1:], self.proj(x)[:, :, None]], -1)
            return F.elu(F.silu((cache * self.kernel).sum(-1))) + 1, cache
        h, outs = self.proj(x), []
        for t in range(self.steps):
            cache = torch.cat([cache[..., 1:], h[:, t].unsqueeze(-1)], dim=-1)
            outs.append(torch.einsum("bdk,dk->bd", cache, self.kernel))
        return F.elu(F.silu(torch.stack(outs, 1))) + 1, cache


class RolledInPlace(nn.Module):
    """Mamba's causal_conv1d_update reference on a copy of the cache: rolled one step in place, its last slot
    written (probe r29: silent)."""

    def __init__(self, d=6, k=3):
        super().__init__()
        self.proj, self.kernel = nn.Linear(d, d), nn.Parameter(torch.randn(d, k) * 0.5)

    def forward(self, x, cache):
        cache = cache.clone()
        cache.copy_(torch.roll(cache, shifts=-1, dims=-1))
        cache[:, :, -1] = self.proj(x)
        return F.silu((cache * self.kernel).sum(-1)), cache


class ShiftedOnACopy(nn.Module):
    """The window shifted on a tensor made in the step, each of its ways (probe r30: each silent)."""

    def __init__(self, shift, d=6, k=3):
        super().__init__()
        self.proj, self.kernel, self.shift = nn.Linear(d, d), nn.Parameter(torch.randn(d, k) * 0.5), shift

    def forward(self, x, cache):
        window = self.shift(cache)
        window[:, :, -1] = self.proj(x)
        return F.silu((window * self.kernel).sum(-1)), window


def _slots_moved(cache):
    window = cache.clone()
    window[:, :, :-1] = window[:, :, 1:].clone()
    return window


SHIFTS_ON_A_COPY = {"a rolled copy, cache.roll(-1, -1).clone()": lambda c: c.roll(-1, dims=-1).clone(),
                    "the roll itself, torch.roll(cache, -1, 2)": lambda c: torch.roll(c, -1, 2),
                    "slots moved by a slice assignment on a clone": _slots_moved}


@pytest.mark.parametrize("module", [RolledInPlace, *SHIFTS_ON_A_COPY], ids=lambda m: getattr(m, "__name__", m))
def test_a_window_shifted_in_place_fuses(module):
    torch.manual_seed(0)
    model = module() if module is RolledInPlace else ShiftedOnACopy(SHIFTS_ON_A_COPY[module])
    report = _compare_with_eager(model, torch.randn(2, 6), torch.randn(2, 6, 3))
    assert _details(report) == ["window step conv(K=3, carried state) → silu [B,D]"], str(report)


def _mamba_reference_update(x, cache, w, kernel):  # causal_conv1d_update's reference: the cache passed in written
    cache.copy_(torch.roll(cache, shifts=-1, dims=-1))
    cache[:, :, -1] = x @ w.T
    return F.silu((cache * kernel).sum(-1))


def _slots_moved_in_the_cache(x, cache, w, kernel):  # the cache passed in, shifted by a slice assignment, returned
    cache[:, :, :-1] = cache[:, :, 1:].clone()
    cache[:, :, -1] = x @ w.T
    return F.silu(torch.einsum("bdk,dk->bd", cache, kernel)), cache


def _rolled_then_copied_back(x, cache, w, kernel):  # transformers' slow path: a rolled copy, copied back
    window = torch.roll(cache, shifts=-1, dims=-1)
    window[:, :, -1] = x @ w.T
    cache.copy_(window)
    return F.silu(torch.sum(window * kernel, dim=-1))


def _window_made_then_copied_into_the_cache(x, cache, w, kernel):  # the window functional, the cache written back
    window = torch.cat([cache[..., 1:], (x @ w.T)[..., None]], -1)
    cache.copy_(window)
    return F.silu((window * kernel).sum(-1))


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("step", [_mamba_reference_update, _slots_moved_in_the_cache, _rolled_then_copied_back,
                                  _window_made_then_copied_into_the_cache], ids=lambda f: f.__name__)
def test_a_window_shifted_in_the_cache_passed_in_fuses_and_writes_the_cache(step, dynamic):
    """The cache passed in is still written, as the code writes it, and the step reads a copy of its columns taken
    before (probe r29, r30: silent; r31: silent under dynamic=True, at every size). Outputs, the cache after, and
    the gradients of x and the weights equal eager's."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    compiled = torch.compile(step, backend="hecate", dynamic=dynamic, options={"fallback": "eager", "strict": True})
    for batch, d, k in ((2, 6, 3), (3, 5, 4)) if dynamic else ((2, 6, 3),):
        leaves = [torch.randn(batch, d), torch.randn(d, d), torch.randn(d, k)]
        _compare_step_writing_its_cache(step, compiled, torch.randn(batch, d, k), leaves)
    torch._dynamo.reset()


def _compare_step_writing_its_cache(step, compiled, cache, leaves):
    """A decode step compiled against eager: the cache it writes in place, its outputs and the gradients of
    ``leaves`` (x, then the weights), and one qk_preprocess fusion with no miss."""
    leaves = [t.requires_grad_() for t in leaves]
    ref_leaves = [t.detach().clone().requires_grad_() for t in leaves]
    ref_cache = cache.clone()
    got = compiled(leaves[0], cache, *leaves[1:])
    report = hecate.last_report()
    ref = step(ref_leaves[0], ref_cache, *ref_leaves[1:])
    assert_close("the cache after the step", cache, ref_cache, 0.0)
    assert_outputs_and_gradients_close(got, ref, leaves, ref_leaves, TOL)
    assert report.count("qk_preprocess") == 1 and not report.misses, str(report)


def _steps_on_the_cache_passed_in(x, cache, w, kernel):  # a loop of decode steps, each shifting the cache in place
    outs = []
    for t in range(x.shape[1]):
        cache.copy_(torch.roll(cache, shifts=-1, dims=-1))
        cache[:, :, -1] = x[:, t] @ w.T
        outs.append(F.silu((cache * kernel).sum(-1)))
    return torch.stack(outs, 1)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_a_loop_of_steps_shifting_the_cache_passed_in_fuses_every_step(dynamic):
    """Each step's writes are the ones after the step before wrote its last slot; the cache as a step finds it is
    what the earlier steps left (probe r32: one step fused, a loop of them silent). Inference: eager's own backward
    finds the cache it saved for a step's product modified by the next."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    x, cache, w, kernel = torch.randn(2, 5, 6), torch.randn(2, 6, 3), torch.randn(6, 6), torch.randn(6, 3)
    ref_cache = cache.clone()
    with torch.no_grad():
        got = torch.compile(_steps_on_the_cache_passed_in, backend="hecate", dynamic=dynamic,
                            options={"fallback": "eager", "strict": True})(x, cache, w, kernel)
        report = hecate.last_report()
        ref = _steps_on_the_cache_passed_in(x, ref_cache, w, kernel)
    assert_close("the cache after the steps", cache, ref_cache, 0.0)
    assert_close("outputs", got, ref, TOL)
    assert report.count("qk_preprocess") == 5 and not report.misses, str(report)
    torch._dynamo.reset()


def _conv1d_update_reference(x, conv_state, weight, bias):  # causal_conv1d's reference, one token, then SiLU
    seqlen, state_len = 1, conv_state.shape[-1]
    x_new = torch.cat([conv_state, x.unsqueeze(-1)], dim=-1)
    conv_state.copy_(x_new[:, :, -state_len:])
    out = F.conv1d(x_new, weight.unsqueeze(1), bias, padding=0, groups=x.shape[1])[:, :, -seqlen:]
    return F.silu(out.squeeze(-1))


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_causal_conv1d_update_reference_fuses_and_writes_the_state(dynamic):
    """A conv over cat([state, x_t.unsqueeze(-1)]) without padding, its last output kept by a slice, the state
    written back in place between the cat and the conv (probe r31: reported as a conv without causal padding)."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    compiled = torch.compile(_conv1d_update_reference, backend="hecate", dynamic=dynamic,
                             options={"fallback": "eager", "strict": True})
    for batch, d, k in ((2, 6, 4), (3, 5, 3)) if dynamic else ((2, 6, 4),):
        _compare_step_writing_its_cache(_conv1d_update_reference, compiled, torch.randn(batch, d, k - 1),
                                        [torch.randn(batch, d), torch.randn(d, k), torch.randn(d)])
    torch._dynamo.reset()


def test_a_window_shifted_by_two_is_left_as_written():
    """roll(-2) then the last slot written is no decode step's window (the slot before it holds a column from two
    steps back): nothing is rewritten, nothing fused."""
    report = _compare_with_eager(ShiftedOnACopy(lambda c: c.roll(-2, dims=-1).clone()), torch.randn(2, 6),
                                 torch.randn(2, 6, 3))
    assert report.count("qk_preprocess") == 0, str(report)


@pytest.mark.parametrize("steps", [None, 5], ids=["one-step", "a-loop-of-steps"])
def test_a_rolling_window_kept_channels_first_fuses(steps):
    """A decode step's window laid out [B, D, K] (probe r28: silent), each step one window-step fusion; equal to
    eager, outputs, the last window and the gradients of every input and weight."""
    torch.manual_seed(0)
    x = torch.randn(2, 6) if steps is None else torch.randn(2, steps, 6)
    report = _compare_with_eager(RollingWindow(steps), x, torch.randn(2, 6, 3))
    assert report.count("qk_preprocess") == (1 if steps is None else steps) and not report.misses, str(report)
    assert all("window step conv(K=3, carried state)" in f.detail for f in report.fusions), str(report)


def _step_on_a_cache(x, cache, w, kernel, b):  # cache [B, K−1, D]; kernel [D, K]
    window = torch.cat([cache, (x @ w.T)[:, None]], 1)
    return F.elu(F.silu(torch.einsum("bkd,dk->bd", window, kernel) + b)) + 1, window[:, 1:]


def test_a_window_step_fuses_with_its_width_symbolic():
    """Under dynamic=True the window's width K and the channels are symbols: the product is drawn at their values
    now, and the step fuses for every K (probe r30: neither fused nor reported under dynamic=True)."""
    torch._dynamo.reset()
    compiled = torch.compile(_step_on_a_cache, backend="hecate", dynamic=True,
                             options={"fallback": "eager", "strict": True})
    for batch, d, k in ((2, 6, 4), (3, 5, 3)):
        args = [torch.randn(batch, 7), torch.randn(batch, k - 1, d), torch.randn(d, 7), torch.randn(d, k),
                torch.randn(d)]
        args = [a.requires_grad_() for a in args]
        ref_args = [a.detach().clone().requires_grad_() for a in args]
        assert_outputs_and_gradients_close(compiled(*args), _step_on_a_cache(*ref_args), args, ref_args, TOL)
        report = hecate.last_report()
        assert report.count("qk_preprocess") == 1 and not report.misses, str(report)
    torch._dynamo.reset()


def test_memory_layer_streams_in_chunks_with_its_convs_fused_with_their_state():
    """LpMemory.forward_chunk carries (the convs' states, M): compiled chunk by chunk, both short convs are
    qk_preprocess with their state and the recurrence memory_scan from M, and the chunks equal eager on the
    whole sequence (outputs, final M, gradients of the weights, x and every initial state)."""
    from hecate.models.memory import LpMemory

    torch.manual_seed(0)
    model = LpMemory(8, n_heads=2, d_k=4, d_v=4, p=2.0, alpha=None, eta=None, phi="elu1", use_scan=True)

    class Chunk(nn.Module):
        def __init__(self):
            super().__init__()
            self.memory = model

        def forward(self, x, q_state, k_state, m):
            out, ((q_state, k_state), m, _) = self.memory.forward_chunk(x, ((q_state, k_state), m, None))
            return out, q_state, k_state, m

    torch._dynamo.reset()
    compiled = torch.compile(Chunk(), backend="hecate", options={"fallback": "eager"}, dynamic=False)
    x = torch.randn(2, 9, 8, requires_grad=True)
    first = [(0.5 * torch.randn(2, 3, 8)).requires_grad_(), (0.5 * torch.randn(2, 3, 8)).requires_grad_(),
             (0.1 * torch.randn(2, 2, 4, 4)).requires_grad_()]
    state, outs = first, []
    for start, stop in ((0, 2), (2, 6), (6, 9)):
        out, *state = compiled(x[:, start:stop], *state)
        outs.append(out)
        report = hecate.last_report()
        assert report.count("memory_scan") == 1 and report.misses == [], str(report)
        details = _details(report)
        assert len(details) == 2 and all("conv(K=4, carried state) → silu → elu+1" in d for d in details), details
    got = [torch.cat(outs, 1), state[2]]
    leaves = [x, *first, *model.parameters()]
    weights = [torch.randn_like(g) for g in got]
    got_grads = torch.autograd.grad(sum((g * w).sum() for g, w in zip(got, weights)), leaves, allow_unused=True)
    out, (_, m, _) = model.forward_chunk(x, (tuple(first[:2]), first[2], None))   # eager, the whole of x
    ref = [out, m]
    ref_grads = torch.autograd.grad(sum((r * w).sum() for r, w in zip(ref, weights)), leaves, allow_unused=True)
    for name, g, r in zip(("outputs", "final M"), got, ref):
        assert_close(name, g, r, TOL)
    names = ["x", "q conv state", "k conv state", "M"] + [n for n, _ in model.named_parameters()]
    for name, g, r in zip(names, got_grads, ref_grads):
        assert (g is None) == (r is None), name
        if r is not None:
            assert_close(f"d/d{name}", g, r, TOL)
    torch._dynamo.reset()


def test_window_step_with_a_bias_of_another_dtype_is_a_near_miss():
    model = WindowProduct(lambda m, w: (w * m.kernel.T).sum(1) + m.bias)
    model.bias = nn.Parameter(torch.randn(6, dtype=torch.float64))
    report = _compare_with_eager(model, torch.randn(2, 6), torch.randn(2, 3, 6))
    assert report.fusions == []
    assert [m.reason for m in report.misses] == [
        "decode step's window product: inputs have mixed dtypes ['torch.float32', 'torch.float64']; the fused op "
        "needs one dtype"], str(report)
