"""`l2l train` as a user runs it: records, bad input, crash and resume."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from l2l.checkpoint import load_latest
from l2l.metrics import read_metrics

from conftest import run_cli
from shared_runs import cli_once

TINY = ["--layers", "2", "--d-model", "32", "--heads", "2", "--seq-len", "32", "--batch-size", "8",
        "--micro-batches", "2", "--eval-batches", "1", "--warmup-steps", "2", "--lr", "3e-3"]
STEPS = 12


def _train(out, *extra, env=None):
    return run_cli("train", *TINY, "--out", str(out), "--no-progress", *extra, env=env)


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    out, r = cli_once(tmp_path_factory, "train_cli-reference",
                      lambda out: _train(out, "--steps", str(STEPS), "--save-every", "2", "--eval-every", "4"))
    assert r.returncode == 0, r.stderr
    return out


def _final(out):
    losses = [rec["loss"] for rec in read_metrics(out / "metrics.jsonl")]
    return losses, load_latest(out).tensors


def test_run_writes_metrics_plot_summary_and_checkpoint(reference_run):
    recs = read_metrics(reference_run / "metrics.jsonl")
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    for r in recs:
        assert {"step", "loss", "tokens_per_s", "device_peak_bytes", "device_weight_peak_bytes"} <= r.keys()
        assert r["tokens_per_s"] > 0 and r["device_peak_bytes"] >= r["device_weight_peak_bytes"] > 0
    assert [r["step"] for r in recs if r["val_loss"] is not None] == [4, 8, 12]
    assert (reference_run / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((reference_run / "summary.json").read_text())
    assert summary["final_val_loss"] < summary["initial_val_loss"]
    assert load_latest(reference_run).step == STEPS


def test_host_memory_is_logged_per_step_and_its_peak_summarized(reference_run):
    """The process's resident set per step and its peak: the kernel's figures, in bytes
    (kB read as bytes would be 1024x too small: below torch's own footprint)."""
    recs = read_metrics(reference_run / "metrics.jsonl")
    summary = json.loads((reference_run / "summary.json").read_text())
    rss = [r["host_rss_bytes"] for r in recs]
    eps_state = 12 * sum(a.size for k, a in load_latest(reference_run).tensors.items() if k.endswith(".p"))
    assert all(100 * 2**20 < b < 24 * 2**30 for b in rss)
    assert summary["host_peak_bytes"] >= max(rss) and summary["host_peak_bytes"] > eps_state


def test_sigkill_mid_training_then_resume_is_exact(reference_run, tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "l2l", "train", *TINY, "--out", str(out), "--no-progress",
           "--steps", str(STEPS), "--save-every", "2", "--eval-every", "4"]
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    metrics = out / "metrics.jsonl"
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 5:
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    killed_at = load_latest(out).step
    assert 0 < killed_at < STEPS
    r = _train(out, "--steps", str(STEPS), "--save-every", "2", "--eval-every", "4", "--resume")
    assert r.returncode == 0, r.stderr
    want_losses, want_state = _final(reference_run)
    got_losses, got_state = _final(out)
    assert got_losses == want_losses
    assert want_state.keys() == got_state.keys()
    for k in want_state:
        assert np.array_equal(want_state[k], got_state[k]), k


def test_kill_during_save_resumes_from_previous_checkpoint(reference_run, tmp_path):
    out = tmp_path / "run"
    r = run_cli("train", *TINY, "--out", str(out), "--no-progress", "--steps", str(STEPS), "--save-every", "2",
                "--eval-every", "4", fault=("kill-in-save", 6))
    assert r.returncode == -signal.SIGKILL
    assert load_latest(out).step == 4
    r = _train(out, "--steps", str(STEPS), "--save-every", "2", "--eval-every", "4", "--resume")
    assert r.returncode == 0, r.stderr
    assert _final(out)[0] == _final(reference_run)[0]
    for k, v in _final(reference_run)[1].items():
        assert np.array_equal(v, _final(out)[1][k])


def test_checkpoints_cross_engines(tmp_path):
    """The baseline's checkpoint resumes in the relay (same per-layer p, m, v format)."""
    out = tmp_path / "run"
    assert _train(out, "--steps", "4", "--engine", "plain").returncode == 0
    r = _train(out, "--steps", "6", "--resume")
    assert r.returncode == 0, r.stderr
    losses = [rec["loss"] for rec in read_metrics(out / "metrics.jsonl")]
    assert len(losses) == 6 and losses[-1] < losses[0]


def _one_line_error(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("l2l: error: "), r.stderr
    assert "Traceback" not in r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.mark.parametrize("args, needle", [
    (["--model", "resnet"], "unknown model"),
    (["--eps", "abacus"], "unknown EPS backend"),
    (["--layers", "0"], "--layers"),
    (["--micro-batches", "3"], "does not divide"),
    (["--engine", "magic"], "unknown engine"),
    (["--d-model", "30", "--heads", "4"], "multiple of --heads"),
    (["--accumulate"], "--accumulate applies to --engine plain"),
    (["--steps", "ten"], "invalid int"),
])
def test_bad_settings_exit_2_with_one_line(tmp_path, args, needle):
    r = run_cli("train", "--out", str(tmp_path / "run"), *args)
    _one_line_error(r, needle)
    assert not (tmp_path / "run").exists()


def test_bad_data_exits_2(tmp_path):
    _one_line_error(run_cli("train", "--out", str(tmp_path / "a"), "--data", str(tmp_path / "nope")), "nope")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    _one_line_error(run_cli("train", "--out", str(tmp_path / "b"), "--data", str(empty)), "empty")
    (tmp_path / "emptydir").mkdir()
    _one_line_error(run_cli("train", "--out", str(tmp_path / "c"), "--data", str(tmp_path / "emptydir")))


def test_resume_refuses_another_config_and_touches_nothing(reference_run):
    before = {p: p.read_bytes() for p in reference_run.rglob("*") if p.is_file()}
    r = _train(reference_run, "--steps", str(STEPS + 2), "--resume", "--d-model", "64")
    _one_line_error(r, "d_model")
    r = _train(reference_run, "--steps", str(STEPS + 2))  # no --resume: refuse to overwrite
    _one_line_error(r, "already holds a run")
    after = {p: p.read_bytes() for p in reference_run.rglob("*") if p.is_file()}
    assert before == after


def test_corrupt_checkpoint_is_refused(tmp_path):
    out = tmp_path / "run"
    assert _train(out, "--steps", "2").returncode == 0
    tensors = next((out / "checkpoints").glob("step-*")) / "tensors.safetensors"
    data = bytearray(tensors.read_bytes())
    data[-5] ^= 0xFF
    tensors.write_bytes(bytes(data))
    _one_line_error(_train(out, "--steps", "4", "--resume"), "corrupt")


def test_resume_of_a_finished_run_changes_nothing(reference_run):
    before = {p: p.read_bytes() for p in reference_run.rglob("*") if p.is_file()}
    _one_line_error(_train(reference_run, "--steps", str(STEPS), "--resume"), "already at step")
    assert before == {p: p.read_bytes() for p in reference_run.rglob("*") if p.is_file()}


def test_resume_without_checkpoint(tmp_path):
    _one_line_error(_train(tmp_path / "none", "--steps", "2", "--resume"), "no checkpoint")


def test_info_lists_backends():
    r = run_cli("info")
    assert r.returncode == 0
    assert "eps numpy" in r.stdout and "torch" in r.stdout


@pytest.mark.parametrize("model", ["hf-gpt2", "hf-bert"])
def test_transformers_models_train_from_the_cli(tmp_path, model):
    out = tmp_path / model
    r = _train(out, "--model", model, "--steps", "3", "--dropout", "0.1")
    assert r.returncode == 0, r.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_val_loss"] < summary["initial_val_loss"]


def test_bench_relay_writes_json_and_table(tmp_path):
    r = run_cli("bench", "relay", "--layers", "1", "--micro-batches", "1", "2", "--d-model", "32",
                "--heads", "2", "--seq-len", "16", "--batch-size", "4", "--steps", "1", "--warmup", "0",
                "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    rows = json.loads((tmp_path / "relay_vs_plain.json").read_text())["rows"]
    assert [row["micro_batches"] for row in rows] == [1, 2]
    assert all(row["l2l_step_s"] > 0 and row["ratio_vs_plain_ckpt"] > 0 for row in rows)
    assert "| layers | M |" in (tmp_path / "relay_vs_plain.md").read_text()


def test_the_cli_raises_glibc_mmap_threshold_unless_told_not_to(monkeypatch):
    """`l2l` serves large activations from the heap instead of a fresh mmap per use
    (host/l2l/hostmem.py); L2L_MALLOC_TUNING=0 keeps glibc's defaults."""
    import platform
    from l2l.hostmem import tune_host_allocator
    monkeypatch.setenv("L2L_MALLOC_TUNING", "0")
    assert tune_host_allocator() is False
    monkeypatch.delenv("L2L_MALLOC_TUNING")
    assert tune_host_allocator() is (platform.system() == "Linux" and platform.libc_ver()[0] == "glibc")
