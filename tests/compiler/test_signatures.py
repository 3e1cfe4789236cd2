"""Never silent: a family's signature left unfused is reported with the user's source line,
whatever the spelling, and only once."""

import torch
import torch.nn.functional as F
from torch._higher_order_ops.scan import scan

import hecate
from hecate.testing import assert_close


def pairwise_l1_attention(mu, v):
    d = (mu[:, :, None, :] - mu[:, None, :, :]).abs().sum(-1)  # pairwise, but not a KL
    beta = torch.softmax(-d, -1)
    return beta @ v


def tanh_retention_memory(k, v):
    M = torch.zeros(k.shape[0], k.shape[2], k.shape[2])
    ys = []
    for t in range(k.shape[1]):
        M = torch.tanh(M) + torch.einsum("bi,bj->bij", v[:, t], k[:, t])  # tanh: not a retention gate
        ys.append(M.sum(-1))
    return torch.stack(ys, 1)


def _tanh_step(M, xs):
    k_t, v_t = xs
    M = torch.tanh(M) + v_t.unsqueeze(-1) * k_t.unsqueeze(-2)
    return M, M.sum(-1)


def tanh_retention_scan(k, v):
    M = torch.zeros(k.shape[0], k.shape[2], k.shape[2])
    _, ys = scan(_tanh_step, M, (k.transpose(0, 1), v.transpose(0, 1)))
    return ys


_strided = torch.nn.Conv1d(6, 6, 3, groups=6, stride=2)


def strided_depthwise(x):
    return F.silu(_strided(x.transpose(1, 2))).transpose(1, 2)


def _only_miss(report, family):
    misses = [m for m in report.misses if m.pattern == family]
    assert len(misses) == 1, str(report)
    assert misses[0].source.startswith("test_signatures.py:"), str(report)
    return misses[0]


def test_pairwise_softmax_that_is_not_kl_is_reported():
    report = hecate.explain(pairwise_l1_attention, torch.randn(2, 5, 3), torch.randn(2, 5, 4))
    miss = _only_miss(report, "kl_attention")
    assert "pairwise score" in miss.reason and "is not −KL(q_i ‖ q_j)/κ" in miss.reason  # the kl pass's own reason
    assert "torch.softmax(-d, -1)" in miss.source
    assert report.fusions == []


def memory_with_a_softmax_of_its_error(q, k, v):
    """A memory loop whose g(e) is softmax(e): its update's outer products broadcast [.., D, 1] against
    [.., 1, D] on the way to the next step's softmax, which is over e [B, D], no pairwise score."""
    M, ys = torch.zeros(q.shape[0], 4, 4), []
    for t in range(q.shape[1]):
        e = torch.einsum("bk,bkv->bv", k[:, t], M) - v[:, t]
        M = M - 0.2 * torch.einsum("bk,bv->bkv", k[:, t], e.softmax(-1))
        ys.append(torch.einsum("bk,bkv->bv", q[:, t], M))
    return torch.stack(ys, 1)


def test_a_softmax_over_no_pairs_gets_no_kl_attention_miss():
    """Only the memory's reason (probe r17: a kl_attention near-miss named a pairwise [4, 4] score here)."""
    report = hecate.explain(memory_with_a_softmax_of_its_error, *(torch.randn(2, 5, 4) for _ in range(3)))
    assert [m.pattern for m in report.misses] == ["memory_scan"], str(report)
    assert "softmax" in report.misses[0].reason, str(report)


def kl_attention_by_products(mu, var):
    """KL(q_i‖q_j) expanded into matrix products (no [B, N, N, K] tensor)."""
    log_var = var.log()
    kl2 = (log_var.sum(-1)[:, None, :] - log_var.sum(-1)[:, :, None] + var @ (1 / var).mT
           + (mu ** 2) @ (1 / var).mT - 2 * mu @ (mu / var).mT + (mu ** 2 / var).sum(-1)[:, None, :] - mu.shape[-1])
    return F.softmax(-0.5 * kl2, -1) @ mu


def test_gaussian_score_by_matrix_products_fuses_and_plain_attention_is_left_alone():
    mu, var = torch.randn(2, 5, 3), torch.rand(2, 5, 3) + 0.5
    report = hecate.explain(kl_attention_by_products, mu, var)
    assert report.count("kl_attention") == 1 and not report.misses, str(report)
    # dot-product attention adds no number per query or key to q·kᵀ: no Gaussian score, nothing to report
    assert hecate.explain(lambda q, k: F.softmax(q @ k.mT, -1) @ k, mu, var).misses == []


def test_unrolled_outer_product_state_is_reported_once_with_its_line():
    report = hecate.explain(tanh_retention_memory, torch.randn(2, 6, 3), torch.randn(2, 6, 3))
    assert len(report.misses) == 1, str(report)  # the loop's note and the chain are one miss
    [miss] = report.misses
    # (reported under linear_attention: its outer product v ⊗ k does not read the state, a Hebbian update)
    assert miss.pattern == "linear_attention" and "6 steps is not a memory step" in miss.reason
    assert "compiled unrolled" in miss.reason
    assert miss.source.startswith("test_signatures.py:") and "torch.einsum" in miss.source


def test_unrolled_outer_product_state_is_reported_when_loops_are_not_rolled(monkeypatch):
    import hecate.compiler.pipeline as pipeline

    monkeypatch.setattr(pipeline, "roll_loops", lambda gm, only=None: None)
    report = hecate.explain(tanh_retention_memory, torch.randn(2, 4, 3), torch.randn(2, 4, 3))
    miss = _only_miss(report, "linear_attention")
    # the normal form reads the einsum as the outer product v_t ⊗ k_t, so the steps are named (a Hebbian update:
    # under linear_attention)
    assert "4 memory update step(s) M ← a·M + (outer product)" in miss.reason


def test_scan_body_with_outer_product_state_is_reported():
    report = hecate.explain(tanh_retention_scan, torch.randn(2, 6, 3), torch.randn(2, 6, 3))
    miss = _only_miss(report, "linear_attention")
    assert "6 steps is not a memory step" in miss.reason  # the memory pass's own reason


def test_depthwise_conv_that_is_not_fused_is_reported_once():
    report = hecate.explain(strided_depthwise, torch.randn(2, 8, 6))
    miss = _only_miss(report, "qk_preprocess")
    assert "stride" in miss.reason and "_strided(x.transpose(1, 2))" in miss.source


def kl_decode_by_products(mu, logvar, prior_mu, prior_logvar, targets, per_position_terms=True):
    """The KL to every token's prior expanded into matrix products (no [B, N, V, K] tensor); without its
    per-position terms it is the KL only up to a number per position (the same cross-entropy, not the logits)."""
    var, precision = logvar.exp(), (-prior_logvar).exp()
    kl = 0.5 * ((var + mu ** 2) @ precision.T - 2 * mu @ (prior_mu * precision).T
                + (prior_mu ** 2 * precision).sum(-1) + prior_logvar.sum(-1))
    if per_position_terms:
        kl = kl - 0.5 * (logvar.sum(-1, keepdim=True) + mu.shape[-1])
    return F.cross_entropy(-kl.flatten(0, 1), targets.flatten())


def test_kl_decode_by_matrix_products_fuses_and_without_its_terms_is_reported_and_a_plain_lm_head_is_not():
    mu, logvar, targets = torch.randn(2, 5, 3), torch.randn(2, 5, 3), torch.randint(0, 7, (2, 5))
    prior_mu, prior_logvar = torch.randn(7, 3), torch.randn(7, 3)
    report = hecate.explain(kl_decode_by_products, mu, logvar, prior_mu, prior_logvar, targets)
    assert report.count("kl_decode") == 1 and not report.misses, str(report)
    miss = _only_miss(hecate.explain(lambda *a: kl_decode_by_products(*a, per_position_terms=False), mu, logvar,
                                     prior_mu, prior_logvar, targets), "kl_decode")
    assert "made by matrix products" in miss.reason and "F.cross_entropy(-kl" in miss.source, miss
    # logits from a linear head read no variance: not a Gaussian score
    head = lambda h, w, y: F.cross_entropy((h @ w.T).flatten(0, 1), y.flatten())  # noqa: E731
    assert hecate.explain(head, mu, prior_mu, targets).misses == []


def shared_variance_logits(mu, logvar, prior_mu, log_s2, extra_log_terms=0):
    """−KL to token priors of one shared variance s² (one product, the cross term), returned as logits; with
    ``extra_log_terms`` more copies of log s² than the K the KL has, off by a number and no KL."""
    K = mu.shape[-1]
    kl = 0.5 * ((K + extra_log_terms) * log_s2 - logvar.sum(-1, keepdim=True)
                + ((logvar.exp() + mu ** 2).sum(-1, keepdim=True) - 2 * mu @ prior_mu.T
                   + (prior_mu ** 2).sum(-1)) / log_s2.exp() - K)
    return -kl


def test_returned_logits_with_one_product_and_wrong_terms_are_reported(fresh_dynamo):
    """The logits of a shared prior variance have one product with the tokens; with a term off they are no KL, and
    returned as they are they are reported, not left silent (probe r13a c07)."""
    mu, logvar, prior_mu, log_s2 = torch.randn(2, 5, 3), torch.randn(2, 5, 3), torch.randn(7, 3), torch.tensor(0.3)
    report = hecate.explain(shared_variance_logits, mu, logvar, prior_mu, log_s2)
    assert report.count("kl_decode") == 1 and not report.misses, str(report)
    wrong = hecate.explain(lambda *a: shared_variance_logits(*a, extra_log_terms=1), mu, logvar, prior_mu, log_s2)
    miss = _only_miss(wrong, "kl_decode")
    assert "made by matrix products" in miss.reason, miss


def gated_two_steps_first_written_out(q, k, v):
    """T = 2, the first step written before the loop as its update v_0 k_0ᵀ: one step is left, no loop to roll."""
    M = v[:, 0, :, None] * k[:, 0, None, :]
    ys = [(M @ q[:, 0, :, None])[..., 0]]
    M = 0.9 * M + v[:, 1, :, None] * k[:, 1, None, :]
    ys.append((M @ q[:, 1, :, None])[..., 0])
    return torch.stack(ys, 1), M


def test_a_single_step_after_a_first_state_written_as_its_update_is_reported():
    """0.9·v_0 k_0ᵀ + v_1 k_1ᵀ: both terms are outer products, of one tensor's steps 0 and 1 (probe r14a: silent)."""
    report = hecate.explain(gated_two_steps_first_written_out, *(torch.randn(2, 2, 4) for _ in range(3)))
    miss = _only_miss(report, "linear_attention")
    assert "1 memory update step(s)" in miss.reason, miss
    # a rank-2 matrix of two unrelated outer products is no memory step
    rank_two = lambda a, b, c, d: a[:, :, None] * b[:, None, :] + c[:, :, None] * d[:, None, :]  # noqa: E731
    assert hecate.explain(rank_two, *(torch.randn(2, 4) for _ in range(4))).misses == []


def test_symbolic_sizes_are_compared_not_hashed(fresh_dynamo):
    """Under dynamic=True the sizes the search compares are symbolic: two products of a [B, T, D] input (the
    decode search's candidates) compile, strict, and are reported as nothing."""
    def two_heads(x, w1, w2):
        return x @ w1 + x @ w2

    args = (torch.randn(2, 5, 3), torch.randn(3, 6), torch.randn(3, 6))
    got = torch.compile(two_heads, backend="hecate", dynamic=True, options={"fallback": "eager"})(*args)
    assert torch.allclose(got, two_heads(*args))
    assert hecate.last_report().misses == [], str(hecate.last_report())


def test_enabled_families_only():
    report = hecate.explain(strided_depthwise, torch.randn(2, 8, 6), options={"patterns": ["kl_attention"]})
    assert report.misses == []


def test_look_alikes_outside_the_families_are_not_reported():
    def attention_with_alibi(q, k, v):
        pos = torch.arange(q.shape[1], dtype=q.dtype)
        bias = -(pos[:, None] - pos[None, :]).abs()  # pairwise, but no feature axis: not a KL
        return torch.softmax(q @ k.transpose(1, 2) + bias, -1) @ v

    def dense_conv(x):
        return F.conv1d(x, torch.ones(4, 4, 3))

    report = hecate.explain(attention_with_alibi, *(torch.randn(2, 5, 4) for _ in range(3)))
    assert report.misses == [], str(report)
    conv_misses = hecate.explain(dense_conv, torch.randn(2, 4, 7)).misses  # the qk pass's own "groups=1" only
    assert [m.reason.split(";")[0] for m in conv_misses] == ["conv1d has groups=1 and weight (4, 4, 3)"]


def test_fused_family_leaves_no_signature():
    from hecate.models.short_conv import KeyQueryPreprocess

    block = KeyQueryPreprocess(d_model=8, n_heads=2, kernel_size=3)
    report = hecate.explain(block, torch.randn(2, 5, 8))
    assert report.count("qk_preprocess") == 2 and report.misses == [], str(report)


def hebbian_states_by_cumsum_summed_whole(k, v, q):
    """Every step's state at once, summed whole: no read y_t = M_t q_t the pass could fuse."""
    states = torch.cumsum(k.unsqueeze(-1) * v.unsqueeze(-2), dim=1)
    return states.sum((-2, -1)) * q.sum(-1)


def test_cumulated_outer_products_are_reported():
    k, v, q = torch.randn(2, 5, 3), torch.randn(2, 5, 4), torch.randn(2, 5, 3)
    miss = _only_miss(hecate.explain(hebbian_states_by_cumsum_summed_whole, k, v, q), "linear_attention")
    assert "cumulative sum of outer products" in miss.reason and "torch.cumsum(k.unsqueeze(-1)" in miss.source, miss
    # a cumulative sum of vectors (a running mean) is not a state
    assert hecate.explain(lambda x: torch.cumsum(x, 1) / 3, q).misses == []


def test_hand_written_conv_missing_a_window_is_reported():
    """Σ_k w_k · F.pad(h, (K−1, 0))[..., k:k+T] over k = 0..K−2 only: h shifted by K−1..1, never h itself, which
    is not a causal conv (its last window is missing), and said so."""
    def missing_last_window(h, w):
        padded, t = F.pad(h, (3, 0)), h.shape[-1]
        return F.silu(sum(w[:, k, None] * padded[..., k:k + t] for k in range(3)))

    h, w = torch.randn(2, 6, 7), torch.randn(6, 4)
    miss = _only_miss(hecate.explain(missing_last_window, h, w), "qk_preprocess")
    assert "reads 3 of its 4 shifted windows (offsets [0, 1, 2])" in miss.reason, miss
    got = torch.compile(missing_last_window, backend="hecate", options={"fallback": "eager"})(h, w)
    assert torch.equal(got, missing_last_window(h, w))


def test_the_last_windows_of_a_longer_pad_are_the_conv_of_their_own_kernel():
    """Σ_{k=1..K−1} w_k · F.pad(h, (K−1, 0))[..., k:k+T]: the copies of h shifted by K−2..0, a causal conv of kernel
    K−1 (read by their values), fused; the miss it was ("reads 3 of its 4 windows") was not what it computes."""
    def first_window_left_out(x, w):
        h = x.transpose(1, 2)
        padded, t = F.pad(h, (3, 0)), h.shape[-1]
        return F.silu(sum(w[:, k, None] * padded[..., k:k + t] for k in range(1, 4))).transpose(1, 2)

    x, w = torch.randn(2, 7, 6), torch.randn(6, 4)
    got = torch.compile(first_window_left_out, backend="hecate", options={"fallback": "eager"})(x, w)
    report = hecate.last_report()
    assert report.count("qk_preprocess") == 1 and not report.misses, str(report)
    assert "conv(K=3)" in report.fusions[0].detail, str(report)
    assert_close("output", got, first_window_left_out(x, w), 1e-5)


class BufferWrittenBeforeALoop(torch.nn.Module):
    def __init__(self, d=4):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(d, d))
        self.register_buffer("scale", torch.ones(d))

    def forward(self, h):
        self.scale[0] = 3.0  # an item assignment into a buffer: a write whose tensor is a graph input
        return torch.stack([h[:, t] @ ((self.w * self.scale) @ self.w.t()) for t in range(h.shape[1])], 1)


def test_a_write_into_a_graph_input_is_no_internal_error():
    """The search for states written in place through views walked up from a graph input (no arguments)."""
    torch._dynamo.reset()
    model, h = BufferWrittenBeforeALoop(), torch.randn(2, 5, 4)
    expected = BufferWrittenBeforeALoop()
    expected.load_state_dict(model.state_dict())
    got = torch.compile(model, backend="hecate", options={"strict": True, "fallback": "eager"})(h)
    assert torch.allclose(got, expected(h), rtol=1e-6, atol=1e-6)
    assert not hecate.last_report().misses, str(hecate.last_report())
    torch._dynamo.reset()


def anti_causal_cumsum(q, k, v):  # M_t = Σ_{s≥t} k_s v_sᵀ by flipping: the future's state, no op's
    kv = (k.unsqueeze(-1) * v.unsqueeze(-2)).flip(1).cumsum(1).flip(1)
    return torch.einsum("btk,btkv->btv", q, kv)


def test_a_cumulative_sum_of_outer_products_from_the_end_is_reported():
    """Summed from the end (probe r10b found it silent): not fused, and reported as a cumulated state."""
    args = [torch.randn(2, 6, 4) for _ in range(3)]
    miss = _only_miss(hecate.explain(anti_causal_cumsum, *args), "linear_attention")
    assert "a cumulative sum of outer products" in miss.reason and "flip(1).cumsum(1)" in miss.source, miss
