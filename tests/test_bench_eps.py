"""Smoke test of ``l2l bench eps`` on a tiny layer: every method runs and the report is written."""
from __future__ import annotations

import json

from l2l.bench.eps import run_eps_bench


def test_bench_eps_writes_json_and_table(tmp_path):
    argv = ["--numel", "4096", "--repeats", "1", "--warmup", "1", "--no-deepspeed", "--out", str(tmp_path)]
    assert run_eps_bench(argv) == 0
    result = json.loads((tmp_path / "bench_eps.json").read_text())
    rows = {r["method"]: r for r in result["rows"]}
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


def test_bench_eps_mixed_dtypes_and_contributions(tmp_path):
    argv = ["--numel", "1000", "-k", "3", "--grad-dtype", "bf16", "--copy-dtype", "fp16",
            "--repeats", "1", "--warmup", "0", "--no-deepspeed", "--out", str(tmp_path)]
    assert run_eps_bench(argv) == 0
    result = json.loads((tmp_path / "bench_eps.json").read_text())
    rows = {r["method"]: r for r in result["rows"]}
    assert result["minimum_bytes_per_elem"] == 3 * 2 + 24 + 2
    assert rows["numpy"]["bytes_per_elem"] == 3 * 2 + 4 + 28 + 2
    assert rows["opencl"]["bytes_per_elem"] == 2 * 3 * 2 + 24 + 2
    assert all(r["elems_per_s"] > 0 for r in rows.values() if r["status"] == "ok")


def test_bench_eps_reports_its_bandwidth_states(tmp_path):
    argv = ["--numel", "4096", "--repeats", "4", "--warmup", "0", "--no-deepspeed", "--out", str(tmp_path)]
    run_eps_bench(argv)
    result = json.loads((tmp_path / "bench_eps.json").read_text())
    states = result["bandwidth_states"]
    assert 1 <= len(states) <= 2 and sum(s["rounds"] for s in states) == 2  # 4 repeats, blocks of 2
    for s in states:
        lo, hi = s["roofline_gb_s"]
        assert 0 < lo <= hi and set(s["fractions"]) >= {"numpy", "opencl", "torch-fused"}


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
