"""The documentation a clone reads points only at files the clone has."""

from __future__ import annotations

import pathlib
import re
import sys

import pytest
import torch

import hecate

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
# paths of the material the project was written from, which a clone does not have
OUTSIDE = re.compile(r"\.\./shared|(?<![\w-])spec/|DESIGN\.md")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_mentions_no_path_a_clone_lacks(doc):
    text = doc.read_text()
    hits = [line.strip() for line in text.splitlines() if OUTSIDE.search(line)]
    assert not hits, f"{doc.name} mentions files outside the repository: {hits}"
    missing = [target for target in LINK.findall(text)
               if "://" not in target and not (doc.parent / target).exists()]
    assert not missing, f"{doc.name} links to files that do not exist: {missing}"


def test_docs_cover_the_design_patterns_deviations_and_deployment():
    names = {p.name for p in DOCS}
    assert {"design.md", "patterns.md", "deviations.md", "deployment.md"} <= names, names


def test_export_mlir_without_torch_mlir_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_mlir", None)  # as if torch-mlir were not installed
    monkeypatch.setitem(sys.modules, "torch_mlir.fx", None)
    with pytest.raises(ImportError, match=r"pip install -e '\.\[mlir\]'"):
        hecate.export_mlir(torch.nn.Linear(2, 2), (torch.randn(1, 2),))
