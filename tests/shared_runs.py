"""Runs that several tests read, made once for the whole test session, xdist workers included.

A module- or session-scoped fixture is made once per xdist worker, and ``-n 2`` spreads a
module's tests over both workers, so each shared run would be made twice (and
pytest 9's node ids defeat xdist's ``--dist loadgroup``). Here the first worker to ask
makes the run under a file lock in the session's shared base directory; the other waits
for it and reads the same files. Only for runs the tests read and never change.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Callable

import numpy as np


def _shared_root(tmp_path_factory) -> Path:
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared-runs"
    root.mkdir(exist_ok=True)
    return root


def made_once(tmp_path_factory, name: str, make: Callable[[Path], None]) -> Path:
    """The directory ``make(directory)`` fills, made by one worker of the session; a
    failed ``make`` leaves nothing behind, so the next test to ask tries again and fails alike."""
    root = _shared_root(tmp_path_factory)
    out, done = root / name, root / f"{name}.done"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            make(out)
            done.touch()
    return out


def cli_once(tmp_path_factory, name: str, run: Callable[[Path], subprocess.CompletedProcess],
             leaf: str = "run") -> tuple[Path, subprocess.CompletedProcess]:
    """``run(out)`` (a CLI run writing to ``out``, a new path named ``leaf``) made once for the
    session: ``out`` and the process's exit status and output, as the run that made it saw them."""
    def make(directory: Path) -> None:
        proc = run(directory / leaf)
        (directory / "proc.json").write_text(json.dumps(
            {"args": [str(a) for a in proc.args], "returncode": proc.returncode,
             "stdout": proc.stdout, "stderr": proc.stderr}))
    directory = made_once(tmp_path_factory, name, make)
    saved = json.loads((directory / "proc.json").read_text())
    return directory / leaf, subprocess.CompletedProcess(saved["args"], saved["returncode"], saved["stdout"],
                                                          saved["stderr"])


# ------------------------------------------------------------------ comparing two runs

def bits(a: np.ndarray) -> np.ndarray:
    """An array's bytes: equal bits, not equal values (NaN payloads, -0.0)."""
    return np.ascontiguousarray(a).view(np.uint8)


def run_losses(run: Path) -> list[float]:
    """The training losses a run wrote, step by step."""
    from l2l.metrics import read_metrics
    return [x["loss"] for x in read_metrics(run / "metrics.jsonl")]


def same_run(a: Path, b: Path) -> None:
    """The same losses at every step and the same bits in every tensor of the last checkpoint."""
    from l2l.checkpoint import load_latest
    assert run_losses(a) == run_losses(b)
    want, got = load_latest(a).tensors, load_latest(b).tensors
    assert want.keys() == got.keys() and all(np.array_equal(bits(want[k]), bits(got[k])) for k in want)


# ------------------------------------------------------------------ a model directory's weights

def named_master_weights(directory: Path, weights: list[np.ndarray]) -> dict[str, np.ndarray]:
    """An engine's master weights (one flat vector per EPS entry) by the checkpoint tensor names
    of the model ``directory``, for comparison with a transformers model's parameters."""
    from l2l.models.pretrained import checkpoint_keys
    stack, keys = checkpoint_keys(str(directory))
    named = {}
    for e, flat in enumerate(weights):
        for slot, key in zip(stack.entry_layout(e)[1].slots, keys[e]):
            named[key] = flat[slot.offset:slot.offset + slot.numel].reshape(slot.shape)
    return named
