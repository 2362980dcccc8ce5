"""`l2l train --eps-offload DIR` as a user runs it: the same run as in memory, crash and
resume, and bad input as one line with nothing changed (docs/disk-tier.md)."""
from __future__ import annotations

import os
import shutil
import signal

import numpy as np
import pytest

from l2l.checkpoint import load_latest
from l2l.eps.disk_tier import BLOCK, entry_file

from conftest import run_cli
from test_cli_modes import _one_line_error  # noqa: F401  (also used by test_eps_offload_copies)
from test_train_cli import TINY, _final
from shared_runs import cli_once

RUN = ["--steps", "4", "--save-every", "2", "--eval-every", "2", "--no-plot"]


def _train(out, *extra, env=None):
    return run_cli("train", *TINY, "--out", str(out), "--no-progress", *RUN, *extra, env=env)


def _assert_same_run(got, want):
    got_losses, got_state = _final(got)
    want_losses, want_state = _final(want)
    assert got_losses == want_losses
    assert got_state.keys() == want_state.keys()
    for k in want_state:
        assert np.array_equal(got_state[k], want_state[k]), k


def _snapshot(path):
    return {p.relative_to(path): p.read_bytes() for p in path.rglob("*") if p.is_file()} if path.exists() else None


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """run(eps, precision, disk): the out directory of that run (made once per session)."""
    def run(eps, precision, disk):
        def train(out):
            offload = ["--eps-offload", f"{out}.eps"] if disk else []
            return _train(out, "--eps", eps, "--precision", precision, *offload)
        out, r = cli_once(tmp_path_factory, "eps_offload_cli-" + "-".join((eps, precision, "disk" if disk else "ram")),
                          train)
        assert r.returncode == 0, r.stderr
        return out
    return run


@pytest.mark.parametrize("eps", ["numpy", "opencl"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_offload_trains_bit_identically(runs, eps, precision):
    disk = runs(eps, precision, True)
    _assert_same_run(disk, runs(eps, precision, False))
    # the state files are real: they end holding the final master weights
    state = load_latest(disk).tensors
    raw = (disk.parent / f"{disk.name}.eps" / entry_file(1)).read_bytes()
    p = state["layer1.p"]
    assert raw[BLOCK:BLOCK + p.nbytes] == p.astype("<f4").tobytes()


def test_offload_with_two_workers_and_held_steps(runs, tmp_path):
    """--devices 2 (two relay workers, one EPS) and --overflow strict (updates committed in
    ascending order, announced to the tier): this fp32 run never overflows, so it is the
    same run as the one-worker eager reference, bit for bit."""
    out = tmp_path / "run"
    r = _train(out, "--devices", "2", "--overflow", "strict", "--eps-offload", str(tmp_path / "eps"))
    assert r.returncode == 0, r.stderr
    _assert_same_run(out, runs("numpy", "fp32", False))


def _faulty(fault, n, out, *extra):
    return run_cli("train", *TINY, "--out", str(out), "--no-progress", *RUN, *extra, fault=(fault, n))


@pytest.mark.parametrize("fault, n", [
    ("kill-in-update", 14),  # the 14th of 4 entries x 4 steps: mid-backward of step 4, files half-updated
    ("kill-in-save", 4),     # inside the save of step 4, its files written, not committed
])
def test_sigkill_then_resume_is_exact(runs, tmp_path, fault, n):
    out, state = tmp_path / "run", tmp_path / "eps"
    r = _faulty(fault, n, out, "--eps-offload", str(state))
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    assert load_latest(out).step == 2
    r = _train(out, "--resume", "--eps-offload", str(state))
    assert r.returncode == 0, r.stderr
    _assert_same_run(out, runs("numpy", "fp32", False))


def test_bad_directories_are_one_line_and_change_nothing(runs, tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("mine")
    r = _train(tmp_path / "r1", "--eps-offload", str(a_file / "eps"))
    _one_line_error(r, "--eps-offload", "cannot create")
    assert a_file.read_text() == "mine" and not (tmp_path / "r1").exists()

    other = runs("numpy", "fp32", True)  # a DIR holding another run's state
    held = other.parent / f"{other.name}.eps"
    before = _snapshot(held)
    r = _train(tmp_path / "r2", "--eps-offload", str(held))
    _one_line_error(r, "holds the EPS state of another run")
    assert _snapshot(held) == before and not (tmp_path / "r2").exists()

    empty = tmp_path / "empty"
    empty.mkdir()
    r = run_cli("train", *TINY, "--out", str(tmp_path / "r3"), "--no-progress", *RUN, "--eps-offload", str(empty),
                fault=("free-bytes", 4096))
    _one_line_error(r, "GiB more", "GiB free")
    assert not any(empty.iterdir()) and not (tmp_path / "r3").exists()



@pytest.mark.parametrize("args, needle", [
    (["--engine", "plain"], "--eps-offload applies to --engine l2l"),
    (["--eps-offload-window", "0"], "--eps-offload-window must be at least 1"),
])
def test_bad_offload_settings_are_one_line(tmp_path, capsys, args, needle):
    """Refused by the config's checks, before anything is built (in-process: the CLI's own main)."""
    from l2l.cli import main
    assert main(["train", "--out", str(tmp_path / "run"), "--eps-offload", str(tmp_path / "eps"), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("l2l: error: ") and needle in err[0], err
    assert not (tmp_path / "run").exists() and not (tmp_path / "eps").exists()


def test_a_truncated_state_file_is_one_line_and_changes_nothing(runs, tmp_path):
    src = runs("numpy", "fp32", True)
    out, state = tmp_path / "run", tmp_path / "eps"
    shutil.copytree(src, out)
    shutil.copytree(src.parent / f"{src.name}.eps", state)
    cut = state / entry_file(2)
    size = cut.stat().st_size
    os.truncate(cut, size - BLOCK)
    before = _snapshot(tmp_path)
    r = _train(out, "--resume", "--steps", "6", "--eps-offload", str(state))
    _one_line_error(r, str(cut), f"truncated: {size - BLOCK} of {size} bytes")
    assert _snapshot(tmp_path) == before
