"""The planner's disk tier (``l2l plan --eps-offload DIR``): the traffic against the real
stack's entries, the I/O hidden under compute on hand-built slots, the host memory with
the window, the command line, and ``--fit`` against DIR's free space."""
from __future__ import annotations

import json
import math
import shutil
from dataclasses import replace

import pytest

from l2l.config import TrainConfig
from l2l.models import build_stack
from l2l.planner import Rates, predict
from l2l.planner.disk import DiskRates, Slot, entry_numels, overlap, plan_disk, probe_disk

from conftest import run_cli
from faulty_l2l import disk_usage_reporting

RATES = Rates(flops_per_s=1e10, link_bytes_per_s=None, runtime_bytes=200 << 20)
GIVEN = ["--flops", "1e10", "--eps-rate", "5e8", "--link-gbps", "0"]  # no rate measured: fast


def _padded(n: int) -> int:
    """One of p, m, v in a state file, by hand: 4 bytes an element, up to a 4 KiB block."""
    return math.ceil(4 * n / 4096) * 4096


@pytest.mark.parametrize("model", ["gpt", "hf-gpt2"])
def test_traffic_is_24_bytes_a_param_plus_padding_of_the_real_entries(model, tmp_path):
    cfg = TrainConfig(model=model, layers=2, d_model=32, heads=2, seq_len=16, eps_offload=str(tmp_path))
    stack = build_stack(cfg.model_config(), 0)
    real = [stack.entry_numel(e) for e in range(stack.num_entries) if stack.entry_numel(e) > 0]
    assert sorted(entry_numels(cfg).values()) == sorted(real)
    d = plan_disk(cfg, predict(cfg, RATES), DiskRates(1e9, 1e9), free=1 << 40)
    padding = sum(2 * (4096 + 3 * (_padded(n) - 4 * n)) for n in real)  # header + padding, read and written
    assert d.traffic_bytes == 24 * sum(real) + padding
    assert d.params == sum(real)


def test_io_all_hidden_when_compute_is_long():
    slots = [Slot(f"e{k}", 1.0, 100 << 20, 100 << 20) for k in range(4)]
    io, exposed, _ = overlap(slots, DiskRates(1e9, 1e9))
    assert io == pytest.approx(4 * 2 * (100 << 20) / 1e9)
    assert exposed == 0.0


def test_io_exposed_is_io_less_compute_when_compute_is_short():
    slots = [Slot(f"e{k}", 0.001, 1 << 30, 1 << 30) for k in range(4)]
    io, exposed, detail = overlap(slots, DiskRates(2e9, 1e9))
    assert io == pytest.approx(4 * ((1 << 30) / 2e9 + (1 << 30) / 1e9))
    assert exposed == pytest.approx(io - 4 * 0.001)
    assert [s["exposed_s"] for s in detail] == pytest.approx([io / 4 - 0.001] * 4)


def test_plan_hides_io_under_backward_and_drops_the_state_from_host(tmp_path):
    cfg = TrainConfig(layers=8, d_model=256, heads=4, seq_len=64, batch_size=8, micro_batches=1,
                      eps_offload=str(tmp_path), eps_offload_window=3)
    p = predict(cfg, RATES)
    fast = plan_disk(cfg, p, DiskRates(1e12, 1e12), free=1 << 40)
    slow = plan_disk(cfg, p, DiskRates(1e6, 1e6), free=1 << 40)
    # the embedding's backward has no matmul: only its slot shows the fast disk, for microseconds
    assert fast.exposed_s < 1e-4 * p.step_s and fast.step_s == pytest.approx(p.step_s, rel=1e-4)
    assert slow.exposed_s > 0.9 * slow.io_s and slow.step_s == pytest.approx(p.step_s + slow.exposed_s)
    assert slow.io_s == pytest.approx(slow.traffic_bytes / 1e6)  # every byte once, at 1 MB/s
    block = 12 * 256 ** 2 + 13 * 256
    largest = 4096 + 3 * _padded(block)
    assert fast.window_bytes == 7 * largest
    assert fast.host_total_bytes == p.host_total_bytes - 12 * p.params + 7 * largest


def test_probe_measures_through_the_tier_and_leaves_nothing(tmp_path):
    where = tmp_path / "new"
    rates = probe_disk(where, 8 << 20)
    assert rates.measured and rates.read_bytes_per_s > 0 and rates.write_bytes_per_s > 0
    assert rates.probe_bytes >= 8 << 20
    assert not where.exists()  # created for the probe, removed after
    (tmp_path / "kept").mkdir()
    probe_disk(tmp_path / "kept", 1 << 20)
    assert list((tmp_path / "kept").iterdir()) == []


def test_plan_command_prints_the_disk_lines(tmp_path):
    run = run_cli("plan", "--eps-offload", str(tmp_path / "eps"), *GIVEN)
    assert run.returncode == 0, run.stderr
    for line in ("disk tier (--eps-offload", "traffic per step", "disk bandwidth", "measured",
                 "disk I/O per step", "hidden under backward", "host memory with tier"):
        assert line in run.stdout
    run = run_cli("plan", "--eps-offload", str(tmp_path / "eps"), *GIVEN, "--disk-read-gbps", "1",
                  "--disk-write-gbps", "0.5", "--json")
    assert run.returncode == 0, run.stderr
    disk = json.loads(run.stdout)["disk"]
    assert disk["read_bytes_per_s"] == 1e9 and disk["write_bytes_per_s"] == 5e8 and not disk["measured"]
    assert disk["traffic_bytes"] == 2 * disk["state_file_bytes"]


def test_a_bad_dir_is_one_line(tmp_path):
    (tmp_path / "file").write_text("x")
    run = run_cli("plan", "--eps-offload", str(tmp_path / "file" / "eps"), *GIVEN)
    assert run.returncode == 2
    assert run.stderr.strip().count("\n") == 0 and "--eps-offload" in run.stderr and "cannot create" in run.stderr


def test_fit_with_the_tier_is_bound_by_the_disk(tmp_path):
    free = 3 << 30
    run = run_cli("plan", "--fit", "--eps-offload", str(tmp_path / "eps"), "--host-memory", "64", "--d-model",
                  "512", "--heads", "8", "--json", fault=("free-bytes", free))
    assert run.returncode == 0, run.stderr
    doc = json.loads(run.stdout)
    assert doc["binding"] == "disk" and doc["disk_limit_bytes"] == free
    assert doc["disk_bytes"] <= free < doc["next"]["disk_bytes"]
    assert doc["next"]["over"] == ["disk"]
    assert "--eps-offload" in doc["train"]
    # the state's 12 bytes a parameter are off the host figure: 64 GiB of host would hold far less in memory
    assert doc["host_bytes"] < 12 * doc["params"]
    text = run_cli("plan", "--fit", "--eps-offload", str(tmp_path / "eps"), "--host-memory", "64", "--d-model",
                   "512", "--heads", "8", fault=("free-bytes", free))
    assert text.returncode == 0 and "disk:" in text.stdout and "<- binds" in text.stdout.split("disk:")[1]


def test_probe_reads_back_the_first_written_after_all_writes_each_synced(tmp_path, monkeypatch):
    import os
    synced = []
    real = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (synced.append(fd), real(fd))[1])
    rates = probe_disk(tmp_path / "p", 4 << 20, chunk=1 << 20)
    ops = [(c["op"], c["entry"]) for c in rates.chunks]
    n = len(ops) // 2
    assert n == 4  # 4 MiB in 1 MiB entries (each a little over: header and padding)
    assert ops == [("write", e) for e in range(n)] + [("read", e) for e in range(n)]  # first written, first read
    writes = [c for c in rates.chunks if c["op"] == "write"]
    assert all(c["synced"] and c["s"] > 0 for c in writes)
    assert len(synced) >= n  # an fdatasync in each write's timed span (and the tier's own where buffered)
    assert rates.probe_bytes == sum(c["bytes"] for c in writes) >= 4 << 20
    whole = rates.probe_bytes / sum(c["s"] for c in writes)
    assert rates.write_bytes_per_s == pytest.approx(whole)  # the whole transfer, not one chunk's
    assert all(0 < c["call_s"] <= c["s"] for c in writes)  # the write call alone, inside its synced span
    calls = rates.probe_bytes / sum(c["call_s"] for c in writes)
    assert rates.write_call_bytes_per_s == pytest.approx(calls) and calls >= rates.write_bytes_per_s
    lo, mid, hi = rates.spread("read")
    assert lo <= mid <= hi
    assert not (tmp_path / "p").exists()


def test_the_mixed_phase_reads_and_writes_every_entry_at_once(tmp_path):
    """``mixed=True``: after the two phases, every entry read and every entry rewritten (synced)
    on two threads at once; its rate is all those bytes over the phase's wall time, so at least
    each thread's own (the other's calls overlap them) and no more than the two added."""
    rates = probe_disk(tmp_path / "p", 4 << 20, chunk=1 << 20, mixed=True)
    reads = [c for c in rates.chunks if c["op"] == "mixed read"]
    writes = [c for c in rates.chunks if c["op"] == "mixed write"]
    assert sorted(c["entry"] for c in reads) == sorted(c["entry"] for c in writes) == [0, 1, 2, 3]
    assert [c["entry"] for c in writes] == [2, 3, 0, 1]  # half the entries ahead of the reader
    assert all(c["synced"] for c in writes) and not any(c["synced"] for c in reads)
    moved = sum(c["bytes"] for c in reads + writes)
    assert moved == 2 * rates.probe_bytes
    each = [sum(c["bytes"] for c in cs) / sum(c["s"] for c in cs) for cs in (reads, writes)]
    assert rates.mixed_bytes_per_s <= 1.01 * sum(each)
    assert rates.mixed_bytes_per_s >= 0.5 * min(each)  # the threads' start and join, no more
    assert [c["op"] for c in rates.chunks[:8]] == ["write"] * 4 + ["read"] * 4  # the two phases as before
    assert probe_disk(tmp_path / "q", 1 << 20).mixed_bytes_per_s is None  # only when asked
    assert not (tmp_path / "p").exists()


def test_sustained_size_is_a_tenth_of_free_space_at_least_1_gib(tmp_path, monkeypatch):
    from l2l.planner.disk import sustained_bytes
    monkeypatch.setattr(shutil, "disk_usage", disk_usage_reporting(100 << 30))
    assert sustained_bytes(tmp_path) == 2 << 30
    monkeypatch.setattr(shutil, "disk_usage", disk_usage_reporting(15 << 30))
    assert sustained_bytes(tmp_path) == (15 << 30) // 10 // (256 << 20) * (256 << 20)
    monkeypatch.setattr(shutil, "disk_usage", disk_usage_reporting(3 << 30))
    assert sustained_bytes(tmp_path) == 1 << 30


def test_with_the_copies_on_disk_the_plan_counts_their_files_and_traffic(tmp_path):
    """--eps-offload-copies: the space the run's start-up check asks for (state and copy files)
    and the copies' traffic (read by the forward and the backward, written by the update)."""
    base = TrainConfig(layers=2, d_model=32, heads=2, seq_len=16, precision="bf16", eps_offload=str(tmp_path))
    real = list(entry_numels(base).values())
    state = sum(4096 + 3 * _padded(n) for n in real)
    copy = sum(4096 + _padded_bytes(2 * n) for n in real)
    apart = plan_disk(base, predict(base, RATES), DiskRates(1e9, 1e9), free=1 << 40)
    both = plan_disk(replace(base, eps_offload_copies=True), predict(base, RATES), DiskRates(1e9, 1e9), free=1 << 40)
    assert apart.state_file_bytes == state and apart.traffic_bytes == 2 * state
    assert both.state_file_bytes == state + copy and both.traffic_bytes == 2 * state + 3 * copy


def _padded_bytes(nbytes: int) -> int:
    return -(-nbytes // 4096) * 4096
