"""Smoke test of ``l2l bench eps`` on a tiny layer: every method runs and the report is written."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import run_cli
from l2l.bench.eps import run_eps_bench
from l2l.errors import UserError


def test_bench_eps_writes_json_and_table(tmp_path):
    argv = ["--numel", "4096", "--repeats", "1", "--warmup", "1", "--no-deepspeed", "--threads", "1",
            "--out", str(tmp_path)]
    assert run_eps_bench(argv) == 0
    result = json.loads((tmp_path / "bench_eps.json").read_text())
    rows = {r["method"]: r for r in result["rows"]}
    assert all(r["threads"] in (1, None) for r in result["rows"])
    for key in ("numpy", "opencl", "torch-fused", "torch-fused-step"):
        assert rows[key]["status"] == "ok", rows[key]
        assert rows[key]["elems_per_s"] > 0 and rows[key]["bytes_per_elem"] > 0
        assert rows[key]["bytes_counted"]
    assert rows["torch-fused"]["vs_torch_fused"] == 1.0
    assert rows["deepspeed-cpu-adam"]["status"] == "skipped"  # a peer, never a dependency
    assert result["roofline"]["gb_s"] > 0
    assert result["minimum_bytes_per_elem"] == 4 + 24 + 4
    # one contribution, inv_scale 1: no reduced gradient; the grads read twice (check, update)
    assert rows["numpy"]["bytes_per_elem"] == 4 + 4 + 24 + 4
    table = (tmp_path / "bench_eps.md").read_text()
    assert "| EPS numpy: step() |" in table and "torch AdamW(fused)" in table and "Roofline" in table


def test_bench_eps_times_lion_with_its_own_bytes(tmp_path):
    """``--optimizer lion`` from the command line: p and m (8 bytes) read and written, the torch
    row is the plain engine's Lion; a backend that does not run Lion says so in its row."""
    from l2l.eps import BACKENDS
    r = run_cli("bench", "eps", "--optimizer", "lion", "--numel", "4096", "--repeats", "1", "--warmup", "1",
                "--no-deepspeed", "--threads", "1", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads((tmp_path / "bench_eps_lion.json").read_text())
    rows = {x["method"]: x for x in result["rows"]}
    assert result["minimum_bytes_per_elem"] == 4 + 16 + 4
    assert rows["numpy"]["status"] == "ok" and rows["numpy"]["bytes_per_elem"] == 4 + 4 + 16 + 4
    for name, cls in BACKENDS.items():
        if cls.availability()[0] and "lion" not in cls.optimizers:
            assert rows[name]["status"] == "unavailable: does not run lion", rows[name]
    assert rows["torch-fused"]["status"] == "ok" and "l2l.lion" in rows["torch-fused"]["label"]
    assert rows["deepspeed-cpu-lion"]["status"] == "skipped"


def test_bench_eps_times_lamb_on_every_backend(tmp_path):
    """``--optimizer lamb``: every EPS backend available here runs it (none says "unavailable"),
    OpenCL and the HLS C-simulation with their two passes' bytes: the check and the norm pass
    read the gradients, the norm pass p, m, v in and m, v out, the step pass p, m, v in and p
    and the copy out (2·4 + 36 + 4); the torch row says torch has no LAMB."""
    from l2l.eps import BACKENDS
    r = run_cli("bench", "eps", "--optimizer", "lamb", "--numel", "70000", "--repeats", "1", "--warmup", "1",
                "--no-deepspeed", "--threads", "1", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads((tmp_path / "bench_eps_lamb.json").read_text())
    rows = {x["method"]: x for x in result["rows"]}
    assert result["minimum_bytes_per_elem"] == 4 + 36 + 4
    for name, cls in BACKENDS.items():
        if name == "board":  # a board runs what its bitstream was built for (AdamW), and is not timed here
            assert rows[name]["status"].startswith(("skipped: needs a board", "unavailable")), rows[name]
        elif cls.availability()[0]:
            assert "lamb" in cls.optimizers and rows[name]["status"] == "ok", rows[name]
    for name in ("opencl", "hls-csim"):
        if rows[name]["status"] == "ok":
            assert rows[name]["bytes_per_elem"] == 2 * 4 + 36 + 4, rows[name]
    assert rows["opencl"]["status"] == "ok" or not BACKENDS["opencl"].availability()[0]
    assert rows["torch-fused"]["status"].startswith("none"), rows["torch-fused"]


def test_bench_eps_mixed_dtypes_and_contributions(tmp_path):
    argv = ["--numel", "1000", "-k", "3", "--grad-dtype", "bf16", "--copy-dtype", "fp16", "--threads", "1",
            "--repeats", "1", "--warmup", "0", "--no-deepspeed", "--out", str(tmp_path)]
    assert run_eps_bench(argv) == 0
    result = json.loads((tmp_path / "bench_eps.json").read_text())
    rows = {r["method"]: r for r in result["rows"]}
    assert result["minimum_bytes_per_elem"] == 3 * 2 + 24 + 2
    assert rows["numpy"]["bytes_per_elem"] == 3 * 2 + 4 + 28 + 2
    assert rows["opencl"]["bytes_per_elem"] == 2 * 3 * 2 + 24 + 2
    assert all(r["elems_per_s"] > 0 for r in rows.values() if r["status"] == "ok")


def test_bench_eps_reports_its_bandwidth_states(tmp_path):
    argv = ["--numel", "4096", "--repeats", "4", "--warmup", "0", "--no-deepspeed", "--threads", "1",
            "--out", str(tmp_path)]
    run_eps_bench(argv)
    result = json.loads((tmp_path / "bench_eps.json").read_text())
    states = result["bandwidth_states"]
    assert 1 <= len(states) <= 2 and sum(s["rounds"] for s in states) == 2  # 4 repeats, blocks of 2
    for s in states:
        lo, hi = s["roofline_gb_s"]
        assert 0 < lo <= hi and set(s["fractions"]) >= {"numpy@1", "opencl@1", "torch-fused@1"}


def test_rounds_split_into_bandwidth_states_at_the_widest_gap():
    """A shared host that flips between about 70 and 140 GB/s: the rounds fall into two
    states, cut where the rooflines jump; drift within one state is not a second state."""
    from l2l.bench.eps import bandwidth_states
    assert bandwidth_states({0: 72.0, 1: 141.0, 2: 75.0, 3: 69.0, 4: 138.0}) == [[3, 0, 2], [4, 1]]
    assert bandwidth_states({0: 72.0, 1: 80.0, 2: 68.0, 3: 85.0}) == [[2, 0, 1, 3]]
    assert bandwidth_states({0: 70.0}) == [[0]]
    assert bandwidth_states({}) == []


def test_numpy_bytes_follow_its_path():
    """The NumPy EPS skips the reduced gradient only for one contribution at inv_scale 1
    (numerics.unreduced): then it reads the gradient twice; else it writes and reads it back."""
    from l2l.bench.eps import _eps_bytes
    assert _eps_bytes("numpy", 1, 4, 4)[0] == 4 + 4 + 24 + 4
    assert _eps_bytes("numpy", 1, 2, 2, inv_scale=1.0)[0] == 2 + 2 + 24 + 2
    assert _eps_bytes("numpy", 1, 4, 4, inv_scale=0.5)[0] == 4 + 4 + 16 + 12 + 4
    assert _eps_bytes("numpy", 2, 2, 4)[0] == 2 * 2 + 4 + 16 + 12 + 4
    assert "unreduced" in _eps_bytes("numpy", 1, 4, 4)[1] and "reduce_gradients" in _eps_bytes("numpy", 2, 4, 4)[1]


def test_bench_eps_threads_through_the_cli(tmp_path):
    """`l2l bench eps --threads 1 2`: every CPU method at each count, in the same rounds; the
    counts recorded per row, the NumPy EPS's bytes by its path, the same-round shares, the
    scaling table, and the row --eps auto would run."""
    r = run_cli("bench", "eps", "--threads", "2", "1", "2", "--numel", "4096", "--repeats", "2", "--warmup", "0",
                "--no-deepspeed", "--out", str(tmp_path), timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads((tmp_path / "bench_eps.json").read_text())
    assert result["args"]["threads"] == [1, 2]  # sorted, deduplicated
    rows = result["rows"]
    for key in ("numpy", "opencl", "torch-fused", "torch-fused-step"):
        mine = [x for x in rows if x["method"] == key]
        assert [x["threads"] for x in mine] == [1, 2], mine
        assert [x["id"] for x in mine] == [f"{key}@1", f"{key}@2"]
        for x in mine:
            assert x["status"] == "ok" and x["elems_per_s"] > 0, x
            assert 0 < x["roofline_fraction_same_round"] and x["threads_note"] and x["cpu_per_wall"] > 0
    numpy = [x for x in rows if x["method"] == "numpy"]
    assert all(x["bytes_per_elem"] == 4 + 4 + 24 + 4 and "unreduced" in x["bytes_counted"] for x in numpy)
    opencl = [x for x in rows if x["method"] == "opencl"]
    assert [x["threads_note"].split()[0] for x in opencl] == ["1", "2"]  # the compute units it ran on
    hls = [x for x in rows if x["method"] == "hls-csim"]
    assert len(hls) == 1 and (hls[0]["status"] != "ok" or hls[0]["threads"] == 1)  # once: a simulation
    assert [x["threads"] for x in rows if x["method"] == "deepspeed-cpu-adam"] == [None]  # skipped
    fused = {x["threads"]: x for x in rows if x["method"] == "torch-fused"}
    for x in rows:  # each held against torch at its own count
        if x["vs_torch_fused"] is not None and x["threads"] in fused:
            assert x["vs_torch_fused"] == pytest.approx(x["elems_per_s"] / fused[x["threads"]]["elems_per_s"])
    # every method of every count in every round: each has a share of each round's roofline
    for state in result["bandwidth_states"]:
        assert set(state["fractions"]) >= {f"{k}@{t}" for k in ("numpy", "opencl", "torch-fused") for t in (1, 2)}
    scaling = result["scaling"]
    for key in ("numpy", "opencl", "torch-fused", "torch-fused-step"):
        s = scaling[key]
        assert set(s["threads"]) == {"1", "2"} and (s["speedup_from"], s["speedup_to"]) == (1, 2)
        assert s["speedup"] == pytest.approx(s["threads"]["2"]["elems_per_s"] / s["threads"]["1"]["elems_per_s"])
        assert all(v["roofline_fraction_same_round"] > 0 for v in s["threads"].values())
    auto = result["eps_auto"]
    marked = [x["id"] for x in rows if x["auto"]]
    assert auto["backend"] in ("numpy", "opencl")
    assert marked == ([f"{auto['backend']}@{auto['threads']}"] if auto["threads"] in (1, 2) else [])
    assert auto["row"] == (marked[0] if marked else None)
    assert result["env"]["roofline_threads"]["torch"] >= 2
    assert set(result["short_of_threads"]) <= {x["id"] for x in rows if x["threads"] == 2}  # flagged, never 1
    table = (tmp_path / "bench_eps.md").read_text()
    assert "| EPS numpy: step() | 1 |" in table and "| EPS numpy: step() | 2 |" in table
    assert "| method | threads | CPU s / wall s | auto |" in table and "`--eps auto` on this host takes" in table
    assert "speed-up, 1 → 2 threads" in table and "| 2 thr: G elem/s |" in table


def test_bench_eps_refuses_a_zero_thread_count(tmp_path):
    with pytest.raises(UserError, match="--threads"):
        run_eps_bench(["--threads", "1", "0", "--out", str(tmp_path)])


def test_set_threads_reaches_torch_and_every_openmp_runtime():
    from l2l.bench.eps import openmp_runtimes, set_threads
    before = torch.get_num_threads()
    try:
        seen = set_threads(1)
        assert torch.get_num_threads() == 1 and all(v == 1 for v in seen.values())
        assert len(seen) == len(openmp_runtimes())  # torch's libgomp at least, on Linux
    finally:
        set_threads(before)
