"""docs/custom-model.md's example runs as written: the public API trains a model of one's own."""
from __future__ import annotations

import re
import subprocess
import sys

import torch

from conftest import ROOT, run_python


def test_the_custom_model_example_runs_and_learns(tmp_path):
    text = (ROOT / "docs" / "custom-model.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) == 1
    script = tmp_path / "example.py"
    script.write_text(blocks[0])
    r = run_python(str(script), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", r.stdout).groups())
    assert last < first / 2


def test_import_l2l_alone_loads_nothing_heavy():  # a fresh interpreter: the tests' zygote has torch loaded
    r = subprocess.run([sys.executable, "-c", "import sys, l2l; print('torch' in sys.modules, sorted(l2l.__all__))"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("False"), r.stdout + r.stderr



class _Loss(torch.nn.Module):
    def forward(self, h, targets):
        return h.sum() * 0 + (targets >= 0).sum().float()


def test_l2l_relay_is_the_function_after_the_relay_package_is_imported():
    """``l2l.RelayEngine`` imports the ``l2l.relay`` package, which Python then sets as ``l2l.relay``;
    the documented ``l2l.relay(stack, ...)`` still builds an engine."""
    import l2l
    assert l2l.RelayEngine.__module__ == "l2l.relay.engine"
    stack = l2l.LayerStack([l2l.Layer("pre", "pre", torch.nn.Embedding(8, 4)),
                            l2l.Layer("block.0", "block", torch.nn.Linear(4, 4)),
                            l2l.Layer("post", "post", _Loss())], config={"name": "tiny"}, vocab_size=8)
    engine = l2l.relay(stack, micro_batches=1)
    try:
        assert isinstance(engine, l2l.RelayEngine)
    finally:
        engine.close()
