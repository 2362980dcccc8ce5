"""The bench/ scripts still run (tiny shapes): a device lease must not be spent on a broken script."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import ROOT


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_gpu_check_smoke(tmp_path):
    r = _run("bench/gpu_check.py", "--smoke", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert len(result["memory"]) == 4 and len(result["largest"]) == 2
    assert {row["engine"] for row in result["throughput"]} == {"l2l", "plain+ckpt", "plain", "l2l, no prefetch"}
    assert all(row["tokens_per_s"] > 0 for row in result["throughput"])
    assert "Device memory vs depth" in (tmp_path / "gpu_check.md").read_text()


def test_recompute_ab_runs():
    r = _run("bench/recompute_ab.py", "--layers", "2", "--d-model", "32", "--heads", "2",
             "--batch", "2", "--seq", "16", "--rounds", "4")
    assert r.returncode == 0, r.stderr
    assert "per-layer recompute" in r.stdout
