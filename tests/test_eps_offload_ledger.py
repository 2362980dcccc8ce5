"""The disk tier's own ledger of its I/O (``summary.json`` ``eps_disk``), checked two ways:
against the schedule (each file's size times the times the run must move it) and against
the kernel's count of the process's block I/O (docs/disk-tier.md, "The tier's ledger")."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from l2l.data import load_corpus
from l2l.eps.disk_tier import STATE, copy_layout

STEPS = 2
MODEL = ["--layers", "3", "--d-model", "128", "--heads", "4", "--seq-len", "32", "--batch-size", "2",
         "--micro-batches", "1", "--eval-batches", "1"]


def _run(tmp_path: Path):
    """One `l2l train --eps-offload --eps-offload-copies` in a child; its summary and the
    kernel's block-I/O counters of that child (wait4's rusage: the /proc/PID/io read_bytes
    and write_bytes of the whole process, in 512-byte units)."""
    out, eps = tmp_path / "run", tmp_path / "eps"
    cmd = [sys.executable, "-m", "l2l", "train", *MODEL, "--steps", str(STEPS), "--save-every", "0",
           "--plan", "off", "--no-plot", "--no-progress", "--out", str(out), "--eps-offload", str(eps),
           "--eps-offload-copies", "--eps-offload-window", "1"]
    load_corpus(None)  # the data cache made here: the child only maps it, and its writes are the run's
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    _, status, usage = os.wait4(proc.pid, 0)
    err = proc.stderr.read().decode()
    proc.stderr.close()
    assert os.waitstatus_to_exitcode(status) == 0, err
    summary = json.loads((out / "summary.json").read_text())
    numels = {int(e): n for e, n in json.loads((eps / "manifest.json").read_text())["entries"].items()}
    out_bytes = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    marks = [json.loads(line).get("eps_disk") for line in (out / "metrics.jsonl").read_text().splitlines()
             if line.strip() and "step_time_s" in line]
    summary["_marks"] = marks
    return summary, numels, usage, out_bytes


def test_the_ledger_matches_the_schedule_and_the_kernel(tmp_path):
    summary, numels, usage, out_bytes = _run(tmp_path)
    led = summary["eps_disk"]
    copy = copy_layout("<f4")
    for kind, lay in (("state", STATE), ("copies", copy)):
        t = led[kind]
        assert set(t["reads"]) == set(t["writes"]) == {str(e) for e in numels}, kind
        # bytes are whole files: each file's size times the times it moved
        assert t["read_bytes"] == sum(lay.file_bytes(numels[int(e)]) * n for e, n in t["reads"].items())
        assert t["write_bytes"] == sum(lay.file_bytes(numels[int(e)]) * n for e, n in t["writes"].items())
        assert t["read_s"] > 0 and t["write_s"] > 0
        # written at the start (the initial weights) and once by each step's update
        assert all(n == STEPS + 1 for n in t["writes"].values()), (kind, t["writes"])
    # the state: read by each step's update and once by the final checkpoint (the read ahead
    # after the last update, of the top entry, is what the checkpoint takes for that entry)
    assert all(n == STEPS + 1 for n in led["state"]["reads"].values()), led["state"]["reads"]
    # the copies: fetched twice a step and once per evaluation (two), some served from memory
    assert all(1 <= n <= 2 * STEPS + 2 for n in led["copies"]["reads"].values()), led["copies"]["reads"]
    state_files = sum(STATE.file_bytes(n) for n in numels.values())
    copy_files = sum(copy.file_bytes(n) for n in numels.values())
    assert led["write_bytes"] == (STEPS + 1) * (state_files + copy_files)
    assert led["read_bytes"] == led["state"]["read_bytes"] + led["copies"]["read_bytes"]
    # the ledger before the steps (the build wrote every file once) and after each step (bench
    # offload's ledger over the steps only): totals that only grow, within the run's
    start, marks = summary["eps_disk_at_start"], summary["_marks"]
    assert start["write_bytes"] == state_files + copy_files
    assert len(marks) == STEPS
    keys = ("read_bytes", "read_s", "write_bytes", "write_s")
    for before, after in zip([start, *marks], [*marks, led]):
        assert all(before[k] <= after[k] for k in keys), (before, after)
    assert marks[-1]["write_bytes"] >= start["write_bytes"] + (STEPS - 1) * (state_files + copy_files)

    # the kernel's count: with O_DIRECT each tier read and write is block I/O of the process;
    # the rest of what it reads comes from the page cache (the Python code, warm), and the
    # rest of what it writes is --out (the checkpoint, metrics, summary) and the manifests
    kernel_read, kernel_write = usage.ru_inblock * 512, usage.ru_oublock * 512
    if kernel_read == 0 and kernel_write == 0:
        return  # no block device under the temp dir (tmpfs): nothing to compare with
    slack = 1 << 20
    # code pages: under the suite's parallel load the kernel may evict the interpreter's and read
    # them back during the run (clean clones' make test measured 3.2 MB, and 6.4 MB once, over
    # the ledger; the ledger's own reads are 36 MB here, so a missed state read still shows)
    code_pages = 8 << 20
    assert led["read_bytes"] - slack <= kernel_read <= 1.03 * led["read_bytes"] + slack + code_pages, \
        (kernel_read, led["read_bytes"])
    assert led["write_bytes"] + out_bytes - slack <= kernel_write <= 1.03 * (led["write_bytes"] + out_bytes) + slack, \
        (kernel_write, led["write_bytes"], out_bytes)


def test_the_run_logs_its_calls_and_their_timeline(tmp_path):
    """summary.json ``eps_disk``: the timeline of every call (state and copies) adds up to the
    ledger's totals, and the steps' timeline lies inside it, between the marks' clocks."""
    summary, _, _, _ = _run(tmp_path)
    led, start, marks = summary["eps_disk"], summary["eps_disk_at_start"], summary["_marks"]
    whole, steps = led["timeline"], led["timeline_steps"]
    assert led["state"]["calls_dropped"] == led["copies"]["calls_dropped"] == 0
    assert sum(led[k]["calls_logged"] for k in ("state", "copies")) == whole["read"]["calls"] + whole["write"]["calls"]
    for op in ("read", "write"):
        assert abs(whole[op]["bytes"] - led[f"{op}_bytes"]) <= 1e-6 * led[f"{op}_bytes"]
        assert abs(whole[op]["s"] - led[f"{op}_s"]) <= 1e-6 * led[f"{op}_s"]
        assert 0 < steps[op]["bytes"] < whole[op]["bytes"]
    assert start["t"] < marks[0]["t"] < marks[-1]["t"]
    assert abs(steps["span_s"] - (marks[-1]["t"] - start["t"])) < 1e-9
    for t in (whole, steps):
        assert 0 < t["busy_s"] <= t["span_s"]
        assert max(t["read_busy_s"], t["write_busy_s"]) <= t["busy_s"] <= t["read_busy_s"] + t["write_busy_s"] + 1e-9
        assert abs(t["both_s"] - (t["read_busy_s"] + t["write_busy_s"] - t["busy_s"])) < 1e-6
        assert t["busy_bytes_per_s"] == pytest.approx((t["read"]["bytes"] + t["write"]["bytes"]) / t["busy_s"])
