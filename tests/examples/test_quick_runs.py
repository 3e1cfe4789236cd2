"""``--quick`` smoke runs write to git-ignored files, never over the committed results.

``examples/char_lm.py --quick`` runs here end to end (~10 s on 2 cores); the benchmarks'
``--quick`` runs compile each variant and take tens of seconds, so for them this checks where they write.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _load(relative: str):
    spec = importlib.util.spec_from_file_location(pathlib.Path(relative).stem, ROOT / relative)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ignored_and_untracked(path: pathlib.Path) -> bool:
    ignored = subprocess.run(["git", "check-ignore", "-q", str(path)], cwd=ROOT).returncode == 0
    tracked = subprocess.run(["git", "ls-files", "--error-unmatch", str(path)], cwd=ROOT,
                             capture_output=True).returncode == 0
    return ignored and not tracked


pytestmark = pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(),
                                reason="needs a git checkout")


def test_char_lm_quick_writes_under_an_ignored_folder():
    char_lm = _load("examples/char_lm.py")
    quick = pathlib.Path(char_lm.parse_args(["--quick"]).out)
    full = pathlib.Path(char_lm.parse_args([]).out)
    assert full == ROOT / "examples" / "results"
    assert quick != full and _ignored_and_untracked(quick / "char_lm-quick.json"), quick


def test_char_lm_quick_runs_in_seconds_and_leaves_the_committed_results_alone(tmp_path):
    committed = [ROOT / "examples" / "results" / f"char_lm.{ext}" for ext in ("json", "png")]
    before = [path.read_bytes() for path in committed]
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "char_lm.py"), "--quick", "--no-progress",
                          "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((tmp_path / "char_lm-quick.json").read_text())
    assert set(result["models"]) == {"fep", "baseline"}, result["models"].keys()
    assert result["within_20_percent_of_baseline"] is None  # a smoke run claims nothing
    assert (tmp_path / "char_lm-quick.png").stat().st_size > 0
    assert [path.read_bytes() for path in committed] == before


@pytest.mark.parametrize("ext", ["json", "png"])
def test_benchmark_quick_results_are_ignored_and_the_full_ones_committed(ext):
    sys.path.insert(0, str(ROOT))
    try:
        from benchmarks.common import result_path
    finally:
        sys.path.remove(str(ROOT))
    quick = pathlib.Path(result_path("qk_preprocess", "cpu", ext, quick=True))
    full = pathlib.Path(result_path("qk_preprocess", "cpu", ext))
    assert _ignored_and_untracked(quick), quick
    assert not subprocess.run(["git", "check-ignore", "-q", str(full)], cwd=ROOT).returncode == 0, full
