"""docs/eps-numerics.md is the EPS contract the repository cites, and it names the step scalars
that l2l.eps.contract.StepScalars holds, in the same order."""
from __future__ import annotations

import dataclasses
import re
import subprocess
from pathlib import Path


from l2l.eps.contract import LambScalars, LionScalars, StepScalars

ROOT = Path(__file__).resolve().parents[1]
DOC = "docs/eps-numerics.md"
OLD = "shared" + "/spec"  # spelt in two pieces so that this file does not cite it


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True).stdout
    return [p for p in out.decode().split("\0") if p]


def _citing_old_spec(paths) -> list[str]:
    found = []
    for rel in paths:
        path = ROOT / rel
        if rel == DOC or not path.is_file():  # a deleted but still tracked file, a submodule
            continue
        if OLD.encode() in path.read_bytes():
            found.append(rel)
    return found


def test_sources_cite_the_contract_in_the_repository():
    found = _citing_old_spec(p for p in _tracked())
    assert not found, f"cite {DOC}, not {OLD}: {found}"


def _section(text: str, title: str) -> str:
    found = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert found, f"{DOC} has no section '## {title}'"
    return found.group(1)


def test_step_scalar_table_names_the_dataclass_fields():
    section = _section((ROOT / DOC).read_text(encoding="utf-8"), "Step scalars")
    names = re.findall(r"^\| `(\w+)` \|", section, re.M)
    fields = [f.name for f in dataclasses.fields(StepScalars)]
    assert names == fields, f"{DOC} 'Step scalars' table: {names}, StepScalars: {fields}"


def test_doc_has_the_sections_the_sources_cite():
    text = (ROOT / DOC).read_text(encoding="utf-8")
    for title in ["Arithmetic rules", "Step scalars", "Gradient reduction", "The finite flag",
                  "AdamW update", "Device copy", "One argument order for every kernel source",
                  "How it is tested"]:
        _section(text, title)
    assert "### What the tests must cover" in text  # cited by sim/eps_vectors.py


def test_lion_scalar_table_names_the_dataclass_fields():
    section = _section((ROOT / DOC).read_text(encoding="utf-8"), "Lion update")
    names = re.findall(r"^\| `(\w+)` \|", section, re.M)
    fields = [f.name for f in dataclasses.fields(LionScalars)]
    assert names == fields, f"{DOC} 'Lion update' table: {names}, LionScalars: {fields}"


def test_lamb_scalar_table_names_the_kernel_scalars():
    section = _section((ROOT / DOC).read_text(encoding="utf-8"), "LAMB update")
    names = re.findall(r"^\| `(\w+)` \|", section, re.M)
    assert names == list(LambScalars.names()), f"{DOC} 'LAMB update' table: {names}"
