"""examples/char_lm.py --quick: the real-run script end to end (both models compiled with hecate)."""

import importlib.util
import json
import math
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _char_lm():
    spec = importlib.util.spec_from_file_location("char_lm", os.path.join(ROOT, "examples", "char_lm.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_corpus_is_pydoc_topics_with_held_out_split():
    data, chars = _char_lm().load_corpus()
    assert data.numel() > 100_000 and len(chars) == int(data.max()) + 1
    assert "".join(chars[i] for i in data[:200].tolist()).strip()  # decodes back to text


@pytest.mark.usefixtures("fresh_dynamo")
def test_quick_run_trains_both_models_and_writes_results(tmp_path):
    results = _char_lm().main(["--quick", "--no-progress", "--out", str(tmp_path)])
    with open(tmp_path / "char_lm-quick.json") as f:  # --quick names its files apart from the committed run's
        saved = json.load(f)
    assert (tmp_path / "char_lm-quick.png").stat().st_size > 10_000
    assert saved["fep_over_baseline_bpc"] == pytest.approx(results["fep_over_baseline_bpc"])
    uniform_bits = math.log2(saved["corpus"]["vocab_size"])
    for name in ("fep", "baseline"):
        model = saved["models"][name]
        assert math.isfinite(model["heldout_bpc"]) and 0 < model["heldout_bpc"] < 2 * uniform_bits, name
        bits = model["train_bits_per_step"]
        assert len(bits) == saved["settings"]["steps"]
        assert sum(bits[-3:]) / 3 < sum(bits[:3]) / 3, f"{name} did not learn: {bits}"
    ratio = saved["models"]["fep"]["parameters"] / saved["models"]["baseline"]["parameters"]
    assert 0.5 < ratio < 2, ratio
    assert saved["models"]["fep"]["fusion_report_first_graph"].startswith("Hecate fusion report")
