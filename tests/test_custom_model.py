"""docs/custom-model.md's example runs as written: the public API trains a model of one's own."""
from __future__ import annotations

import re
import subprocess
import sys

from conftest import ROOT


def test_the_custom_model_example_runs_and_learns(tmp_path):
    text = (ROOT / "docs" / "custom-model.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) == 1
    script = tmp_path / "example.py"
    script.write_text(blocks[0])
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", r.stdout).groups())
    assert last < first / 2


def test_import_l2l_alone_loads_nothing_heavy():
    r = subprocess.run([sys.executable, "-c", "import sys, l2l; print('torch' in sys.modules, sorted(l2l.__all__))"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("False"), r.stdout + r.stderr
