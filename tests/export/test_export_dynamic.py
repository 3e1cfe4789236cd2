"""One ONNX file per model and per fused op runs in onnxruntime at several batch sizes and lengths.

``hecate.export_onnx`` keeps the batch and sequence dimensions dynamic by default; each
case exports once at an example shape and compares onnxruntime with PyTorch at 3 batch
sizes × 3 lengths (relative error ≤ 1e-5, fp32).
"""

from __future__ import annotations

import inspect
import itertools
import logging
import warnings

import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim

import hecate
import hecate.lowering  # noqa: F401  registers torch.ops.hecate.*
from hecate.models.fep import PureFEPConfig, PureFEPTransformer
from hecate.models.memory import HebbianMemory, LpMemory
from hecate.models.short_conv import KeyQueryPreprocess
from hecate.testing import assert_close

BATCHES, LENGTHS = (1, 3, 4), (2, 6, 13)
EXAMPLE_BATCH, EXAMPLE_LENGTH = 2, 5
TOL = 1e-5


def _run_grid(path, model, make_args):
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for batch, length in itertools.product(BATCHES, LENGTHS):
        args = make_args(batch, length)
        got = session.run(None, {i.name: a.numpy() for i, a in zip(session.get_inputs(), args)})
        with torch.no_grad():
            expected = model(*args)
        expected = [e for e in (expected if isinstance(expected, tuple) else (expected,)) if e is not None]
        assert len(got) == len(expected), (len(got), len(expected))
        for n, (g, e) in enumerate(zip(got, expected)):
            assert torch.isfinite(e).all(), f"PyTorch's output {n} at batch {batch}, length {length} is not finite"
            assert_close(f"output {n} at batch {batch}, length {length}", torch.from_numpy(g).to(e.dtype), e, TOL)


def _export_and_check(tmp_path, model, make_args, expect_op=None, dynamic_dims=("batch", "sequence"),
                      dynamic_shapes="auto"):
    model = model.eval()
    path = tmp_path / "model.onnx"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = hecate.export_onnx(model, make_args(EXAMPLE_BATCH, EXAMPLE_LENGTH), path,
                                    dynamic_shapes=dynamic_shapes)
    static = [str(w.message) for w in caught if "in the exported graph" in str(w.message)]
    assert not static, static  # a batch or sequence dimension that came out static warns
    if expect_op is not None:
        assert expect_op in [f.op for f in report.fusions], str(report)
    graph = onnx.load(str(path)).graph
    assert all(n.domain in ("", "ai.onnx") for n in graph.node), [n.domain for n in graph.node]
    first = [d.dim_param for d in graph.input[0].type.tensor_type.shape.dim]
    assert tuple(first[:2]) == dynamic_dims, first  # the dynamic dims named after what they are
    _run_grid(path, model, make_args)
    return graph


def _x(d, scale=1.0):
    return lambda b, t: (scale * torch.randn(b, t, d),)


def test_qk_preprocess_model(tmp_path):
    model = KeyQueryPreprocess(12, n_heads=3, phi="elu1")
    _export_and_check(tmp_path, model, _x(12), "hecate.qk_preprocess")


class HandWrittenConv(torch.nn.Module):
    """A causal conv written as windows of one pad, channels last: the normal form makes it a conv1d."""

    def __init__(self, d=6, k=4, padded_by_cat=False):
        super().__init__()
        self.proj, self.kernel, self.padded_by_cat = torch.nn.Linear(d, d), torch.nn.Parameter(torch.randn(d, k)), padded_by_cat

    def forward(self, x):
        h, k = self.proj(x), self.kernel.shape[1]
        p = torch.cat([h.new_zeros(h.shape[0], k - 1, h.shape[2]), h], 1) if self.padded_by_cat \
            else torch.nn.functional.pad(h, (0, 0, k - 1, 0))
        return torch.nn.functional.silu(sum(self.kernel[:, i] * p[:, i:i + x.shape[1]] for i in range(k)))


@pytest.mark.parametrize("padded_by_cat", [False, True], ids=["F.pad", "torch.cat"])
def test_hand_written_conv_exports_with_batch_and_length_dynamic(padded_by_cat, tmp_path):
    """The pads the normal form writes keep their sizes symbolic (pad's decomposition fixed each one, and the file
    came out static at the example's batch and length, with no warning)."""
    _export_and_check(tmp_path, HandWrittenConv(padded_by_cat=padded_by_cat), _x(6), "hecate.qk_preprocess")


def test_qk_preprocess_performer_model(tmp_path):
    model = KeyQueryPreprocess(12, n_heads=2, phi="performer")
    _export_and_check(tmp_path, model, _x(12), "hecate.qk_preprocess")


MEMORIES = {  # (model, the fused op, the ONNX operator its recurrence becomes at the default opset)
    # momentum and MONETA's L_q retention use the same Scan translation: see test_memory_scan_op
    "lp_p3_gated": (lambda: LpMemory(12, n_heads=2, d_k=4, d_v=3, p=3.0, alpha=None, eta=0.05, phi="elu1",
                                     use_scan=True), "hecate.memory_scan", "Scan"),
    "lp_p2_gated": (lambda: LpMemory(12, n_heads=2, d_k=4, d_v=3, p=2.0, alpha=None, eta=None, phi="elu1",
                                     use_scan=True), "hecate.memory_scan", "LinearAttention"),
    "hebbian_normalised": (lambda: HebbianMemory(12, n_heads=2, d_k=4, d_v=3, alpha=None, normalise=True,
                                                 use_scan=True), "hecate.linear_attention", "LinearAttention"),
}


@pytest.mark.parametrize("name", list(MEMORIES))
def test_memory_model_is_one_fused_recurrence_over_any_length(name, tmp_path):
    """The scan over a dynamic length is fused and exported as one recurrence, whatever the length."""
    make_model, fused_op, onnx_op = MEMORIES[name]
    # inputs of scale 0.5 keep the l_p recurrence stable over 13 steps
    graph = _export_and_check(tmp_path, make_model(), _x(12, scale=0.5), fused_op)
    ops = [n.op_type for n in graph.node]
    assert ops.count(onnx_op) == 1 and ops.count("Scan") + ops.count("LinearAttention") == 1, ops
    assert "Loop" not in ops, ops


def test_hebbian_noncausal_form(tmp_path):
    model = HebbianMemory(12, n_heads=2, d_k=4, d_v=3, alpha=1.0, normalise=True, form="noncausal")
    _export_and_check(tmp_path, model, _x(12), "hecate.linear_attention")


class _UnbindLoop(torch.nn.Module):
    """The delta rule over zip(x.unbind(1), ...): torch.export's ATen unbind, read as per-step selects."""

    def forward(self, k, v, q):
        M, ys = k.new_zeros(k.shape[0], v.shape[-1], k.shape[-1]), []
        for k_t, v_t, q_t in zip(k.unbind(1), v.unbind(1), q.unbind(1)):
            e = (M @ k_t[..., None])[..., 0] - v_t
            M = 0.9 * M - 0.2 * e[..., None] * k_t[:, None, :]
            ys.append((M @ q_t[..., None])[..., 0])
        return torch.stack(ys, 1)


class _GatedBlock(torch.nn.Module):
    """A researcher's gated delta-rule layer: one projection chunked, a loop over range(T), heads by view."""

    def __init__(self, d=12, heads=2):
        super().__init__()
        self.heads, self.qkv, self.gate = heads, torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, heads)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, -1) for z in self.qkv(x).chunk(3, -1))
        k = torch.nn.functional.normalize(k, dim=-1)
        beta = torch.sigmoid(self.gate(x))
        M, ys = x.new_zeros(b, self.heads, d // self.heads, d // self.heads), []
        for i in range(t):
            e = torch.einsum("bhvk,bhk->bhv", M, k[:, i]) - v[:, i]
            M = M - beta[:, i, :, None, None] * torch.einsum("bhv,bhk->bhvk", e, k[:, i])
            ys.append(torch.einsum("bhvk,bhk->bhv", M, q[:, i]))
        return x + torch.stack(ys, 1).reshape(b, t, d)


class _OutputsIntoABuffer(torch.nn.Module):
    """The delta rule writing each step's read into a buffer made before the loop, out[:, t] = y (probe r36: export
    left it unfused, and the length fixed, where torch.compile fuses it)."""

    def __init__(self, make):
        super().__init__()
        self.make = make

    def forward(self, k, v, q):
        M, out = k.new_zeros(k.shape[0], v.shape[-1], k.shape[-1]), self.make(v)
        for t in range(k.shape[1]):
            e = (M @ k[:, t, :, None]).squeeze(-1) - v[:, t]
            M = M - 0.5 * e[:, :, None] * k[:, t, None, :]
            out[:, t] = (M @ q[:, t, :, None]).squeeze(-1)
        return out


class _BeliefsThenMemory(torch.nn.Module):
    """Causal KL attention over beliefs from Linear layers, then the gated delta-rule layer (probe r36: together,
    the length came out fixed: a NaN literal the KL fusion writes compared unequal to itself across exports)."""

    def __init__(self, d=12):
        super().__init__()
        self.mu, self.logvar, self.memory = torch.nn.Linear(d, d), torch.nn.Linear(d, d), _GatedBlock(d)

    def forward(self, x):
        mu, var = self.mu(x), self.logvar(x).exp()
        mi, vi, mj, vj = mu[:, :, None], var[:, :, None], mu[:, None], var[:, None]
        kl = 0.5 * (vi / vj + (mi - mj) ** 2 / vj - 1 + vj.log() - vi.log()).sum(-1)
        n = x.shape[1]
        beta = (-kl).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        return self.memory(x + beta @ mu)


def _SEQUENCES(b, t):  # k, v, q
    return torch.randn(b, t, 4), torch.randn(b, t, 3), torch.randn(b, t, 4)


LOOPS = {  # Python loops over T: torch.export unrolls them (fixing T); once fused, the length is dynamic again
    "lp_memory": (lambda: LpMemory(12, n_heads=2, d_k=4, d_v=3), _x(12, scale=0.5), "hecate.memory_scan"),
    "hebbian_memory": (lambda: HebbianMemory(12, n_heads=2, d_k=4, d_v=3), _x(12), "hecate.linear_attention"),
    "unbind_loop": (_UnbindLoop, _SEQUENCES, "hecate.memory_scan"),
    "gated_block": (_GatedBlock, _x(12, scale=0.5), "hecate.memory_scan"),
    "beliefs_then_memory": (_BeliefsThenMemory, _x(12, scale=0.5), "hecate.memory_scan"),
    "outputs_into_zeros": (lambda: _OutputsIntoABuffer(torch.zeros_like), _SEQUENCES, "hecate.memory_scan"),
    "outputs_into_empty": (lambda: _OutputsIntoABuffer(lambda v: torch.empty(v.shape)), _SEQUENCES,
                           "hecate.memory_scan"),
}


@pytest.mark.parametrize("name", list(LOOPS))
def test_python_loop_over_the_length_exports_with_the_length_dynamic(name, tmp_path):
    make_model, make_args, fused_op = LOOPS[name]
    torch.manual_seed(0)
    model = make_model()
    graph = _export_and_check(tmp_path, model, make_args, fused_op)
    names = list(inspect.signature(model.forward).parameters)[:len(make_args(1, 1))]  # those given
    assert [i.name for i in graph.input] == names, [i.name for i in graph.input]  # the model's names, as unrolled


class _GatedHebbian(torch.nn.Module):
    def forward(self, k, v, q):
        M, ys = k.new_zeros(k.shape[0], v.shape[-1], k.shape[-1]), []
        for t in range(k.shape[1]):
            M = 0.9 * M + v[:, t, :, None] * k[:, t, None, :]
            ys.append((M @ q[:, t, :, None]).squeeze(-1))
        return torch.stack(ys, 1)


@pytest.mark.parametrize("opset", [None, 18], ids=["opset_default", "opset_18"])
@pytest.mark.parametrize("model", [_UnbindLoop, _GatedHebbian], ids=["delta_rule", "hebbian"])
def test_a_float64_model_loads_and_runs_in_onnxruntime(model, opset, tmp_path):
    """The translations compute in float32; the final state leaves in the op's own dtype, float64 for float64
    inputs (probe r36: at opset 18 onnxruntime refused the file, a Scan's state typed float where the graph said
    double). Values to float32 precision."""
    model = model().double().eval()
    path = tmp_path / "model.onnx"
    report = hecate.export_onnx(model, tuple(a.double() for a in _SEQUENCES(2, 5)), path, opset_version=opset)
    assert report.fusions, str(report)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for batch, length in ((2, 5), (3, 7)):
        args = tuple(a.double() for a in _SEQUENCES(batch, length))
        (got,) = session.run(None, {i.name: a.numpy() for i, a in zip(session.get_inputs(), args)})
        with torch.no_grad():
            assert_close(f"output at batch {batch}, length {length}", torch.from_numpy(got), model(*args), TOL)


class _ReadFirst(torch.nn.Module):
    """y_t = M_{t−1} q_t, the memory not returned: torch.export drops the last step's write (dead), so the loop
    rolls into T − 1 steps and the last read follows it; at T = 1 the fused op runs no step."""

    def __init__(self, rule: str):
        super().__init__()
        self.rule = rule

    def forward(self, k, v, q):
        M, ys = k.new_zeros(k.shape[0], v.shape[-1], k.shape[-1]), []
        S = torch.zeros_like(M)
        for t in range(k.shape[1]):
            ys.append((M @ q[:, t, :, None])[..., 0])
            if self.rule == "hebbian":
                M = 0.9 * M + 0.5 * v[:, t, :, None] * k[:, t, None, :]
                continue
            kt = F.normalize(k[:, t], dim=-1)
            error = (M @ kt[..., None])[..., 0] - v[:, t]
            if self.rule == "delta_rule":
                M = 0.9 * M - 0.5 * error[..., None] * kt[:, None, :]
            else:  # a momentum buffer (Titans)
                S = 0.8 * S - 0.3 * error[..., None] * kt[:, None, :]
                M = 0.9 * M + S
        return torch.stack(ys, 1)


@pytest.mark.parametrize("opset", [None, 18], ids=["opset_default", "opset_18"])
@pytest.mark.parametrize("rule", ["hebbian", "delta_rule", "momentum"])
def test_a_loop_that_runs_no_step_at_one_token_runs_in_onnxruntime(rule, opset, tmp_path):
    """onnxruntime refuses a Scan or a LinearAttention over 0 steps (a Reshape of -1 beside a 0, or SIGFPE at
    opset 18: probe r42); the translations run one more step that writes 0 without decay, and drop its output.
    A momentum buffer moves the memory even then: its zero step runs first, while the buffer is still zero."""
    model, path = _ReadFirst(rule).eval(), tmp_path / "model.onnx"
    report = hecate.export_onnx(model, _SEQUENCES(2, 5), path, opset_version=opset)
    assert report.fusions, str(report)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for batch, length in ((2, 1), (1, 2), (3, 6)):
        args = _SEQUENCES(batch, length)
        (got,) = session.run(None, {i.name: a.numpy() for i, a in zip(session.get_inputs(), args)})
        with torch.no_grad():
            assert_close(f"output at batch {batch}, length {length}", torch.from_numpy(got), model(*args), TOL)


@pytest.mark.parametrize("rule", ["hebbian", "delta_rule"])
def test_a_program_generalised_in_the_length_returns_what_the_model_returns(rule):
    """The torch program re-exported with T symbolic returned its outputs as a tuple where the model returns one
    tensor (probe r42)."""
    from hecate.compiler.export import export_program

    model = _ReadFirst(rule).eval()
    program, report = export_program(model, _SEQUENCES(2, 5), dynamic_shapes="auto")
    assert report.fusions, str(report)
    for length in (5, 8):
        args = _SEQUENCES(3, length)
        with torch.no_grad():
            got, expected = program.module()(*args), model(*args)
        assert isinstance(got, torch.Tensor), type(got)
        assert_close(f"length {length}", got, expected, TOL)


class _RWKV6(torch.nn.Module):
    """RWKV-6's wkv: o_t = r_tᵀ (S + diag(u) k_t v_tᵀ), S ← diag(w_t) S + k_t v_tᵀ, the state stored [Dk, Dv]."""

    def __init__(self, d=4):
        super().__init__()
        self.rkvw = torch.nn.Linear(d, 4 * d)
        self.u = torch.nn.Parameter(torch.randn(d) * 0.5)

    def forward(self, x):
        r, k, v, w = self.rkvw(x).chunk(4, -1)
        w = torch.exp(-torch.exp(w))
        S, outs = x.new_zeros(x.shape[0], x.shape[-1], x.shape[-1]), []
        for t in range(x.shape[1]):
            kv = k[:, t, :, None] * v[:, t, None, :]
            outs.append(torch.einsum("bk,bkv->bv", r[:, t], S + self.u[:, None] * kv))
            S = w[:, t, :, None] * S + kv
        return torch.stack(outs, 1)


def test_rwkv6_exports_fused_with_no_miss_for_its_last_bonus_read(tmp_path):
    """torch.export drops the last step's dead write, so the last read, r (S + u k vᵀ), follows the rolled loop:
    its bonus sum was reported as one memory update step not rolled up (probe r42 c06)."""
    torch.manual_seed(0)
    model, path = _RWKV6().eval(), tmp_path / "rwkv6.onnx"
    report = hecate.export_onnx(model, _x(4)(2, 5), path)
    assert [f.op for f in report.fusions] == ["hecate.linear_attention"] and not report.misses, str(report)
    _run_grid(path, model, _x(4))


class _MemoryChosenByCond(torch.nn.Module):
    """torch.cond between a Hebbian loop and a delta rule, on the data: its operands are chunks of one projection,
    cloned so that they do not alias (torch.cond's rule)."""

    def __init__(self, d=4):
        super().__init__()
        self.qkv = torch.nn.Linear(d, 3 * d)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        operands = (q.clone(), F.normalize(k, dim=-1), v.clone())
        return torch.cond(x.mean() > 0, _GatedHebbian().forward, _UnbindLoop().forward, operands)


def test_each_branch_of_a_cond_is_fused_on_export(tmp_path):
    """Both branches fused (probe r42: the clones were dropped as no-op copies, and the ONNX exporter's re-trace
    refused operands that alias; nothing was fused or reported); onnxruntime equals eager on either branch."""
    torch.manual_seed(0)
    model, path = _MemoryChosenByCond().eval(), tmp_path / "cond.onnx"
    x = torch.randn(2, 5, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the length stays fixed: the loops sit inside the branches)
        report = hecate.export_onnx(model, (x,), path)
    assert sorted(f.pattern for f in report.fusions) == ["linear_attention", "memory_scan"], str(report)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for sample in (x.abs() + 0.1, -x.abs() - 0.1):  # the predicate true, then false
        (got,) = session.run(None, {session.get_inputs()[0].name: sample.numpy()})
        with torch.no_grad():
            assert_close("onnxruntime", torch.from_numpy(got), model(sample), TOL)


class _DeltaRuleByScan(torch.nn.Module):
    """The delta rule written with torch's scan, the error's outer product a matmul of [B, D, 1] by [B, 1, D]."""

    def forward(self, k, v, q):
        from torch._higher_order_ops.scan import scan

        def step(M, xs):
            kt, vt, qt = xs
            M = M - 0.5 * (M @ kt[:, :, None] - vt[:, :, None]) @ kt[:, None, :]
            return M, (M @ qt[:, :, None]).squeeze(-1)

        k = F.normalize(k, dim=-1)
        return scan(step, k.new_zeros(k.shape[0], v.shape[-1], k.shape[-1]), (k, v, q), dim=1)[1]


def test_a_users_scan_is_fused_on_export_as_under_compile(tmp_path):
    """The scan's body is put in the normal form on export as under torch.compile (probe r42: it was not, so the
    matmul outer product was no outer product, and the unfused dynamic scan then failed in the ONNX exporter)."""
    _export_and_check(tmp_path, _DeltaRuleByScan(), _SEQUENCES, "hecate.memory_scan")


class _ScanChosenByCond(torch.nn.Module):
    """torch.cond between the delta rule by scan on the keys and on the keys negated."""

    def forward(self, k, v, q):
        scan = _DeltaRuleByScan()
        return torch.cond(k.sum() > 0, lambda k, v, q: scan(k, v, q), lambda k, v, q: scan(-k, v, q), (k, v, q))


def test_a_users_scan_inside_a_cond_branch_is_fused_on_export(tmp_path):
    """A branch's scan body is put in the normal form too (it was not: each branch's graph was, not the scans in
    it, so the matmul outer product was no outer product and neither branch fused)."""
    model, path = _ScanChosenByCond(), tmp_path / "cond_scan.onnx"
    args = _SEQUENCES(2, 5)
    report = hecate.export_onnx(model, args, path)
    assert [f.op for f in report.fusions] == ["hecate.memory_scan"] * 2, str(report)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for sign in (1, -1):  # the predicate true, then false
        sample = (sign * args[0].abs(), *args[1:])
        (got,) = session.run(None, {i.name: a.numpy() for i, a in zip(session.get_inputs(), sample)})
        assert_close("onnxruntime", torch.from_numpy(got), model(*sample), TOL)


class _LengthInTheArithmetic(torch.nn.Module):
    """A loop whose outputs are scaled by the step's index t + 1, a Python number each step: the steps differ, the
    loop stays unrolled, and the graph holds T steps. (Scaled by 1/T, the read's function is fused, T symbolic.)"""

    def forward(self, k, v):
        M, ys = k.new_zeros(k.shape[0], v.shape[-1], k.shape[-1]), []
        for t in range(k.shape[1]):
            M = 0.9 * M + v[:, t, :, None] * k[:, t, None, :]
            ys.append((M @ k[:, t, :, None])[..., 0] * (t + 1))
        return torch.stack(ys, 1)


class _ReadScaledByTheLength(torch.nn.Module):
    """A loop whose reads are divided by T inside it: a function of the read the fused graph computes from T."""

    def forward(self, k, v):
        M, ys = k.new_zeros(k.shape[0], v.shape[-1], k.shape[-1]), []
        for t in range(k.shape[1]):
            M = 0.9 * M + v[:, t, :, None] * k[:, t, None, :]
            ys.append((M @ k[:, t, :, None])[..., 0] / k.shape[1])
        return torch.stack(ys, 1)


def test_a_function_of_the_read_that_reads_the_length_exports_with_it_symbolic(tmp_path):
    model = _ReadScaledByTheLength()
    hecate.export_onnx(model, (torch.randn(2, 5, 4), torch.randn(2, 5, 3)), tmp_path / "scaled.onnx")
    session = ort.InferenceSession(str(tmp_path / "scaled.onnx"), providers=["CPUExecutionProvider"])
    args = (torch.randn(3, 7, 4), torch.randn(3, 7, 3))  # another batch and length
    feeds = {i.name: a.numpy() for i, a in zip(session.get_inputs(), args)}
    assert_close("onnxruntime", torch.from_numpy(session.run(None, feeds)[0]), model(*args), 1e-5)


def test_a_length_the_fused_graph_still_depends_on_stays_fixed_and_warns(tmp_path):
    model, args = _LengthInTheArithmetic(), (torch.randn(2, 5, 4), torch.randn(2, 5, 3))
    with pytest.warns(UserWarning, match=r"sequence dimension \(dim 1\) of input 'k' is fixed at 5"):
        hecate.export_onnx(model, args, tmp_path / "fixed.onnx")
    session = ort.InferenceSession(str(tmp_path / "fixed.onnx"), providers=["CPUExecutionProvider"])
    assert session.get_inputs()[0].shape[1:] == [5, 4], session.get_inputs()[0].shape
    feeds = {i.name: a.numpy() for i, a in zip(session.get_inputs(), args)}
    assert_close("onnxruntime", torch.from_numpy(session.run(None, feeds)[0]), model(*args), 1e-5)


@pytest.mark.parametrize("given_as", ["tuple", "dict by name"])
def test_a_length_marked_dim_auto_in_the_users_own_spec_stays_dynamic_through_a_loop(given_as, tmp_path):
    """The user's own dynamic_shapes marking the length Dim.AUTO gets what "auto" gets: a Python loop fixed it in
    torch.export, the fused graph has it back (probe r42: it came out fixed at the example's 5, silently)."""
    dims = {0: Dim.AUTO, 1: Dim.AUTO}
    spec = (dims, dims, dims) if given_as == "tuple" else {"k": dims, "v": dims, "q": dims}
    _export_and_check(tmp_path, _GatedHebbian(), _SEQUENCES, "hecate.linear_attention", dynamic_shapes=spec)


def test_a_dim_marked_dim_auto_in_the_users_own_spec_that_stays_fixed_warns(tmp_path):
    model, args = _LengthInTheArithmetic(), (torch.randn(2, 5, 4), torch.randn(2, 5, 3))
    with pytest.warns(UserWarning, match=r"dim 1, marked Dim.AUTO, of input 'k' is fixed at 5"):
        hecate.export_onnx(model, args, tmp_path / "fixed.onnx", dynamic_shapes=({1: Dim.AUTO}, {1: Dim.AUTO}))


def test_an_example_of_size_one_warns_that_the_dimension_is_fixed(tmp_path):
    """torch.export specialises a dim of size 1 in the example: the batch comes out static, said (probe r42: it
    was silent)."""
    with pytest.warns(UserWarning, match=r"batch dimension \(dim 0\) of input 'x' is fixed at 1 .* at least 2"):
        hecate.export_onnx(QKPreprocess(), (torch.randn(1, 5, 7),), tmp_path / "batch_one.onnx")


def test_static_opt_out(tmp_path):
    model, x = QKPreprocess(), torch.randn(2, 5, 7)
    hecate.export_onnx(model, (x,), tmp_path / "static.onnx", dynamic_shapes="static")
    session = ort.InferenceSession(str(tmp_path / "static.onnx"), providers=["CPUExecutionProvider"])
    assert session.get_inputs()[0].shape == [2, 5, 7]
    with pytest.raises(ValueError, match="dynamic_shapes must be"):
        hecate.export_onnx(model, (x,), tmp_path / "bad.onnx", dynamic_shapes="batch")


def test_pure_fep_model(tmp_path):
    config = PureFEPConfig(vocab_size=11, embed_dim=4, n_layers=1, max_seq_len=16, n_vfe_steps=1)
    model = PureFEPTransformer(config)

    def ids(b, t):
        return torch.randint(0, 11, (b, t)), torch.randint(0, 11, (b, t))

    _export_and_check(tmp_path, model, ids, "hecate.kl_attention")


# --- the fused ops called directly ----------------------------------------------------------------------------

class MemoryScan(torch.nn.Module):
    def forward(self, k, v, q, alpha, eta, m0):
        return torch.ops.hecate.memory_scan(k, v, q, alpha, eta, m0, None, 2.5, 10.0, 1e-6, 0.5, 2.0)


def _memory_scan_args(b, t):
    # unit-norm keys and η ≤ 0.2 keep the l_p recurrence stable at every length
    k = torch.nn.functional.normalize(torch.randn(b, t, 2, 4), dim=-1)
    return (k, torch.randn(b, t, 2, 3), torch.randn(b, t, 2, 4),
            torch.rand(b, t, 2) * 0.2, torch.rand(b, t, 2) * 0.2, torch.randn(b, 2, 3, 4))


def test_memory_scan_op(tmp_path):
    _export_and_check(tmp_path, MemoryScan(), _memory_scan_args)


class LinearAttention(torch.nn.Module):
    def forward(self, k, v, q, alpha, m0, z0):
        return torch.ops.hecate.linear_attention(k, v, q, alpha, m0, z0, True, 1e-6, True)


def test_linear_attention_op(tmp_path):
    def args(b, t):
        return (torch.rand(b, t, 2, 4), torch.randn(b, t, 2, 3), torch.rand(b, t, 2, 4),
                torch.rand(b, t, 2) * 0.5 + 0.5, torch.randn(b, 2, 3, 4), torch.rand(b, 2, 4))

    _export_and_check(tmp_path, LinearAttention(), args)


class QKPreprocess(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(7, 6)
        self.conv = torch.nn.Conv1d(6, 6, 4, groups=6)

    def forward(self, x):
        return torch.ops.hecate.qk_preprocess(x, self.proj.weight, self.proj.bias, self.conv.weight,
                                              self.conv.bias, "silu", "elu1", [], 0.0)


def test_qk_preprocess_op(tmp_path):
    _export_and_check(tmp_path, QKPreprocess(), _x(7))


def _beliefs(b, n, k=3):
    return torch.randn(b, n, k), torch.rand(b, n, k) + 0.3


class KLAttention(torch.nn.Module):
    def forward(self, mu, var, row_values, col_values):
        return torch.ops.hecate.kl_attention(mu, var, row_values, col_values, 0.8, False, False)


def test_kl_attention_op(tmp_path):
    _export_and_check(tmp_path, KLAttention(),
                      lambda b, n: (*_beliefs(b, n), torch.randn(b, n, 2), torch.randn(b, n, 3)))


class KLDecode(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.prior_mu = torch.nn.Parameter(torch.randn(5, 3))
        self.prior_var = torch.nn.Parameter(torch.rand(5, 3) + 0.3)

    def forward(self, mu, var, targets):
        loss, lse = torch.ops.hecate.kl_decode_ce(mu, var, self.prior_mu, self.prior_var, targets, 0.7, -100)
        return loss, lse, torch.ops.hecate.kl_decode_logits(mu, var, self.prior_mu, self.prior_var, 0.7)


def test_kl_decode_ops(tmp_path):
    # the ops take rows [R, K]: a batch of B·T tokens
    def args(b, t):
        mu, var = _beliefs(1, b * t)
        return mu[0], var[0], torch.randint(0, 5, (b * t,))

    rows = {0: Dim.AUTO}  # [R, K]: only the rows are dynamic (K is the priors')
    _export_and_check(tmp_path, KLDecode(), args, dynamic_dims=("batch", ""), dynamic_shapes=(rows, rows, rows))


def test_export_prints_nothing_but_hecate(tmp_path, capfd, caplog):
    """No torchvision registration warnings, no onnxscript version-converter notice: only what is about the model."""
    model = KeyQueryPreprocess(8, kernel_size=3).eval()
    with warnings.catch_warnings(), caplog.at_level(logging.INFO):
        warnings.simplefilter("error")  # a warning would be about the model; this one has none to give
        hecate.export_onnx(model, (torch.randn(EXAMPLE_BATCH, EXAMPLE_LENGTH, 8),), tmp_path / "qk.onnx")
    logged = [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.WARNING]
    out, err = capfd.readouterr()
    assert not logged and out == "" and err == "", (logged, out, err)


def test_an_operator_newer_than_opset_18_loads_in_onnxruntime(tmp_path):
    """nn.GELU is written as ONNX Gelu (opset 20): torch.onnx builds at 18 and its conversion fails on it; the
    model's opset is raised to 20, where onnxruntime loads it."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()).eval()
    x = torch.randn(2, 5, 8)
    path = tmp_path / "gelu.onnx"
    hecate.export_onnx(model, (x,), path)
    proto = onnx.load(path)
    assert "Gelu" in {n.op_type for n in proto.graph.node}
    assert {o.domain: o.version for o in proto.opset_import}[""] >= 20
    (got,) = ort.InferenceSession(str(path)).run(None, {proto.graph.input[0].name: x.numpy()})
    assert_close("y", torch.from_numpy(got), model(x), 1e-5)


class _RetentionLM(torch.nn.Module):
    """Token ids → embedding → RetNet's parallel retention, its decay built from T = x.shape[1]: under
    torch.export that size is read off the int input (sym_size), which is no read of its values."""

    def __init__(self, vocab=11, d=8, heads=2):
        super().__init__()
        self.emb, self.heads = torch.nn.Embedding(vocab, d), heads
        self.qkv = torch.nn.Linear(d, 3 * d, bias=False)
        self.register_buffer("log_gamma", torch.log(1 - 2.0 ** (-5 - torch.arange(heads, dtype=torch.float32))))

    def forward(self, x):
        b, t = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(self.emb(x)).chunk(3, -1))
        idx = torch.arange(t)
        diff = (idx[:, None] - idx[None, :]).float()
        decay = torch.exp(diff * self.log_gamma[:, None, None]).masked_fill(diff < 0, 0.0)
        return ((q @ k.transpose(-1, -2)) * decay @ v).transpose(1, 2).reshape(b, t, -1)


def test_retention_over_token_ids_is_fused_on_export(tmp_path):
    torch.manual_seed(0)
    model, x = _RetentionLM().eval(), torch.randint(0, 11, (3, 6))
    path = tmp_path / "retention.onnx"
    report = hecate.export_onnx(model, (x,), path)
    assert report.count("linear_attention") == 1 and not report.misses, str(report)
    session = ort.InferenceSession(str(path))
    for shape in [(3, 6), (2, 9)]:
        tokens = torch.randint(0, 11, shape)
        (got,) = session.run(None, {session.get_inputs()[0].name: tokens.numpy()})
        assert_close(f"y {shape}", torch.from_numpy(got), model(tokens), 1e-5)


class _ParallelDecay(torch.nn.Module):
    """(QKᵀ ⊙ D) V with one constant decay γ^(t−s): the fused op reads γ as a constant the fusion makes, which
    the exported program must hold among its own (probe r29: the export raised SpecViolationError)."""

    def __init__(self, d=8):
        super().__init__()
        self.qkv = torch.nn.Linear(d, 3 * d, bias=False)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        i = torch.arange(x.shape[1])
        decay = (0.8 ** (i[:, None] - i[None, :]).clamp(min=0).float()) * torch.ones(x.shape[1], x.shape[1]).tril()
        return (q @ k.mT * decay) @ v


class _Mamba2Parallel(torch.nn.Module):
    """Mamba-2's parallel form, exp(segsum(a)) with a = −softplus(·) per step: the fusion's gate layout had an
    empty squeeze, which torch.onnx cannot translate (probe r29)."""

    def __init__(self, d=8):
        super().__init__()
        self.proj, self.gate = torch.nn.Linear(d, 3 * d, bias=False), torch.nn.Linear(d, 1)

    def forward(self, x):
        q, k, v = self.proj(x).chunk(3, -1)
        cs = torch.cumsum(-torch.nn.functional.softplus(self.gate(x)).squeeze(-1), dim=-1)  # [B, T]
        t = x.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        decay = torch.exp((cs[:, :, None] - cs[:, None, :]).masked_fill(~causal, float("-inf")))
        return ((q @ k.mT) * decay) @ v


@pytest.mark.parametrize("model", [_ParallelDecay, _Mamba2Parallel], ids=lambda m: m.__name__.strip("_"))
def test_parallel_forms_export_fused(model, tmp_path):
    torch.manual_seed(0)
    _export_and_check(tmp_path, model(), _x(8, 0.5), expect_op="hecate.linear_attention")


def test_a_constant_a_fusion_makes_is_lifted_for_mlir_too():
    pytest.importorskip("torch_mlir")
    text = hecate.export_mlir(_ParallelDecay().eval(), (torch.randn(2, 5, 8),), output_type="torch")
    assert "func.func" in text and "hecate" not in text and "torch.operator" not in text, text[:500]
