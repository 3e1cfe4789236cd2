"""Compiling leaves the user's RNG alone, and shows what it does: TORCH_LOGS="hecate", progress."""

import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import hecate
from hecate.passes import PASSES


def _draws_random_patterns(gm, report):
    torch.randn(100)  # as a pass tracing its pattern from random examples would


def test_compiling_does_not_move_the_users_rng(monkeypatch, fresh_dynamo):
    monkeypatch.setitem(PASSES, "draws", _draws_random_patterns)
    torch.manual_seed(1)
    before = torch.get_rng_state()
    torch.compile(lambda x: x.sin() + 1, backend="hecate", options={"fallback": "eager"})(torch.ones(3))
    assert torch.equal(torch.get_rng_state(), before)


def test_torch_logs_hecate_shows_decisions_with_source_and_stage_timings(tmp_path):
    script = tmp_path / "user_model.py"
    script.write_text(textwrap.dedent("""
        import torch
        conv = torch.nn.Conv1d(4, 4, 3, groups=4, padding=1)  # centred: not causal
        def keys(x):
            return torch.nn.functional.silu(conv(x.transpose(1, 2))).transpose(1, 2)
        torch.compile(keys, backend="hecate", options={"fallback": "eager"})(torch.randn(2, 5, 4))
    """))
    env = dict(os.environ, TORCH_LOGS="hecate", PYTHONPATH=os.getcwd())
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    log = out.stderr
    assert "qk_preprocess: not fused:" in log and "at user_model.py:5:" in log, log[-3000:]
    for stage in ("roll loops", "re-trace to ATen", "pass qk_preprocess", "pass kl_attention"):
        assert f"stage {stage}:" in log, (stage, log[-3000:])


def test_log_records_fusions(caplog, fresh_dynamo):
    from hecate.models.short_conv import KeyQueryPreprocess

    block = KeyQueryPreprocess(d_model=8, n_heads=2, kernel_size=3)
    with caplog.at_level(logging.INFO, logger="hecate"):
        hecate.explain(block, torch.randn(2, 5, 8))
    fused = [r.getMessage() for r in caplog.records if "fused" in r.getMessage() and r.name.startswith("hecate")]
    assert sum("into hecate.qk_preprocess" in m for m in fused) == 2, fused


def test_progress_prints_each_stage(capsys, fresh_dynamo):
    torch.compile(lambda x: x.cos() * 2, backend="hecate",
                  options={"fallback": "inductor", "progress": True})(torch.randn(4))
    err = capsys.readouterr().err
    for stage in ("re-trace to ATen", "pass memory_scan", "fallback compile (inductor)"):
        assert f"hecate: {stage} ..." in err and f"hecate: {stage} done in" in err, (stage, err)


def test_progress_must_be_bool():
    from hecate.compiler.options import parse_options

    with pytest.raises(hecate.HecateOptionsError, match="'progress' must be True or False, got 1"):
        parse_options({"progress": 1})
