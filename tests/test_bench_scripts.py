"""The bench/ scripts still run (tiny shapes): a device lease must not be spent on a broken script."""
from __future__ import annotations

import json
import subprocess

from conftest import ROOT, run_cli, run_python


def _run(*args: str) -> subprocess.CompletedProcess:
    return run_python(*args, cwd=ROOT)


def test_gpu_check_smoke(tmp_path):
    """Every section runs on tiny shapes, the correctness checks pass, and both files say so."""
    r = _run("bench/gpu_check.py", "--smoke", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    sections = result["sections"]
    assert list(sections) == ["startup", "correctness", "memory", "throughput", "batch", "overlap", "largest"]
    assert all(s["status"] == "ok" for s in sections.values()), {k: s["status"] for k, s in sections.items()}
    assert result["eps_probe"]["chosen"] in ("numpy", "opencl") and result["devices"] == 1
    auto = result["eps_probe"]["auto"]  # what --eps auto takes on the box, measured beside the probe
    assert auto["backend"] in ("numpy", "opencl") and auto["rate"] > 0 and auto["runs_on"], auto
    assert auto["same_as_chosen"] == (auto["backend"] == result["eps_probe"]["chosen"])
    assert f"--eps auto takes {auto['backend']}" in r.stdout
    checks = sections["correctness"]["rows"]
    assert len(checks) == 6 and all(c["result"] == "PASS" for c in checks)
    bitwise = [c for c in checks if c["tolerance"] == "bit-identical"]
    assert len(bitwise) == 3 and all(c["max_rel_diff"] == 0 for c in bitwise)
    replay = next(c for c in checks if c["row"].startswith("dropout replay"))
    assert replay["control_diff"] > 1e-3  # the check can fail: other masks, other gradients
    assert [m["row"] for m in sections["memory"]["rows"]] == [
        "stash device, L=2", "stash device, L=4", "stash host, L=2", "stash host, L=4"]
    assert [t["row"] for t in sections["throughput"]["rows"]] == ["l2l", "plain --checkpointing", "plain"]
    assert [t["row"] for t in sections["overlap"]["rows"]] == ["l2l, prefetch", "l2l, no prefetch"]
    assert [t["row"] for t in sections["batch"]["rows"]] == [
        "l2l, batch 32, M 16", "plain --checkpointing, batch 32, M 16"]
    timed = (sections["throughput"]["rows"] + sections["batch"]["rows"] + sections["overlap"]["rows"]
             + sections["largest"]["rows"])
    assert all(t["status"] == "ok" and t["tokens_per_s"] > 0 and t["eps"] == result["eps_probe"]["chosen"]
               for t in timed)
    relay = [t for t in timed if t["engine"] == "l2l"]  # the EPS's work is timed, not only its waits
    assert all(t["eps_busy_s"] > 0 and t["eps_drain_s"] >= 0 for t in relay)
    assert len(sections["largest"]["rows"]) == 1 and "one more would exceed" in sections["largest"]["sized"]
    text = (tmp_path / "gpu_check.md").read_text()
    assert f"EPS --eps auto takes {auto['backend']}" in text
    for title in ("Correctness", "Device memory against depth", "Throughput", "A larger batch", "Overlap",
                  "largest relay model", "EPS busy s", "EPS drain s"):
        assert title in text
    assert not list(tmp_path.glob(".*.tmp"))  # written atomically: no temporary left behind


def test_gpu_check_runs_only_the_sections_asked(tmp_path):
    """``--sections``: start-up and the named sections, nothing else; an unknown name is one line, exit 2."""
    r = _run("bench/gpu_check.py", "--smoke", "--sections", "batch,overlap", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    sections = json.loads((tmp_path / "gpu_check.json").read_text())["sections"]
    assert list(sections) == ["startup", "batch", "overlap"]
    assert all(s["status"] == "ok" for s in sections.values())
    r = _run("bench/gpu_check.py", "--smoke", "--sections", "batch,warp", "--out", str(tmp_path))
    assert r.returncode == 2 and "unknown warp" in r.stderr and "Traceback" not in r.stderr


def test_gpu_check_dry_run_fits_and_refuses_an_oversized_plan():
    """The H200 plan fits (rows, bytes, time under the budget); a largest model scaled past
    the host memory is refused with exit 2 and one line for that row."""
    r = _run("bench/gpu_check.py", "--dry-run")
    assert r.returncode == 0, r.stdout + r.stderr
    for section in ("correctness", "memory", "throughput", "batch", "overlap", "largest"):
        assert f"\n{section} " in r.stdout
    assert "plan fits" in r.stdout and "estimated total" in r.stdout and "REFUSED" not in r.stdout
    r = _run("bench/gpu_check.py", "--dry-run", "--largest-scale", "2")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()  # the row; and the plan's total, which that row now overruns
    assert lines[0].startswith("refused: largest / ") and "host" in lines[0], r.stderr
    assert lines[1:] in ([], ["refused: the plan: " + lines[-1].split("refused: the plan: ")[-1]]), r.stderr
    r = _run("bench/gpu_check.py", "--dry-run", "--host-bytes", str(8 * 2**30))
    assert r.returncode == 2 and all(line.startswith("refused: ") for line in r.stderr.strip().splitlines())


def test_pinned_block_bytes_rounds_up_to_a_power_of_two():
    from l2l.relay.pinned import pinned_block_bytes
    assert [pinned_block_bytes(n) for n in (0, 1, 4096, 4097, 3_200_000_000)] == [0, 1, 4096, 8192, 2**32]


def test_recompute_ab_runs():
    r = _run("bench/recompute_ab.py", "--layers", "2", "--d-model", "32", "--heads", "2",
             "--batch", "2", "--seq", "16", "--rounds", "4")
    assert r.returncode == 0, r.stderr
    assert "recompute-then-backward" in r.stdout and "relay" in r.stdout


def test_bench_suite_quick_writes_headline_and_tables(tmp_path):
    """`l2l bench suite --quick`: all three parts run and the headline figures are filled in."""
    results = tmp_path / "results.md"
    results.write_text("# Results\n\nkept\n\n<!-- l2l bench suite: begin -->\nold figures\n"
                       "<!-- l2l bench suite: end -->\n\nalso kept\n")
    r = run_cli("bench", "suite", "--quick", "--out", str(tmp_path), "--results", str(results), timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    suite = json.loads((tmp_path / "suite.json").read_text())
    head = suite["headline"]
    assert head["eps_opencl_vs_torch_fused"] is not None or "opencl" not in {m["method"] for m in suite["eps"]["rows"]}
    assert head["planner_error_worst"] is not None and head["l2l_vs_plain_ckpt_worst_at_m4_plus"] > 0
    assert head["l2l_vs_plain_ckpt_same_m_worst"] > 0  # the accumulating baseline ran
    # memory: the host stash is flat in depth and in M, the device stash grows with both
    spread = head["memory_spread"]
    assert spread["depth/host"] <= 0.05 and spread["micro_batches/host"] <= 0.05
    assert spread["depth/device"] > 0.05 and spread["micro_batches/device"] > 0.05
    text = (tmp_path / "suite.md").read_text()
    for part in ("(a) EPS throughput", "(b) step time", "(c) device memory"):
        assert part in text
    # the results file's suite section is regenerated in place, the rest left as it was
    regenerated = results.read_text()
    assert "old figures" not in regenerated and "kept\n" in regenerated and "also kept" in regenerated
    section = regenerated.split("<!-- l2l bench suite: begin -->")[1].split("<!-- l2l bench suite: end -->")[0]
    assert "OpenCL EPS vs torch fused AdamW" in section and "#### (c) device memory" in section


def test_bench_load_small(tmp_path):
    """`l2l bench load` on a tiny Llama: a checkpoint generated, loaded in a fresh process,
    two steps trained; the resident-set figures are there and consistent."""
    out = tmp_path / "out"
    r = run_cli("bench", "load", "--params", "2e6", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(out),
                timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "ckpt" / "model.safetensors").is_file() and (tmp_path / "ckpt" / "config.json").is_file()
    result = json.loads((out / "bench_load.json").read_text())
    m, c = result["measure"], result["config"]
    assert abs(c["params"] - 2e6) < 0.1 * 2e6 and m["params"] == c["params"]
    assert m["eps_state_bytes"] == m["params"] * 16  # fp32: p, m, v and the device copy
    assert 0 < m["rss_start"] <= m["rss_before"] <= m["peak_load"]
    assert m["rss_after_load"] <= m["peak_load"] and m["peak_train"] > 0
    assert len(m["step_s"]) == 2 and all(t > 0 for t in m["step_s"])
    assert result["load_above_baseline"] == m["peak_load"] - m["rss_before"]
    assert result["aim_met"] == (result["load_above_baseline"] <= m["eps_state_bytes"] + (1 << 30))
    assert "peak during load - baseline" in (out / "bench_load.md").read_text()


def test_bench_offload_quick_reports_the_timeline_beside_the_ledger(tmp_path):
    """`l2l bench offload --quick`: the per-direction ledger figures, and beside them the steps'
    call timeline and the probe's both-at-once rate (issue 18)."""
    r = run_cli("bench", "offload", "--quick", "--out", str(tmp_path / "out"), "--dir", str(tmp_path / "work"),
                timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    row = json.loads((tmp_path / "out" / "offload.json").read_text())["row"]
    tl = row["timeline_steps"]
    assert 0 < tl["busy_s"] <= tl["span_s"] and tl["read"]["bytes"] > 0 and tl["write"]["bytes"] > 0
    assert all(m > 0 for m in row["probes_mixed"])
    text = (tmp_path / "out" / "offload.md").read_text()
    for figure in ("tier throughput / the disk's own", "reads and writes at once", "read alone / beside a write",
                   "the probe's both-at-once rate", "the time the tier had I/O under way"):
        assert figure in text


def test_bench_shard_quick_measures_each_rank_and_the_planner(tmp_path):
    """`l2l bench shard --quick`: each rank's peak resident set (gathered from every rank, not
    rank 0's alone) beside the planner's figure, and the sharded run's collective bytes
    within 1% of the planner's formula."""
    r = run_cli("bench", "shard", "--quick", "--no-capacity", "--out", str(tmp_path / "out"), timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads((tmp_path / "out" / "shard.json").read_text())
    (two,) = result["memory"]
    assert (two["ranks"], len(two["peak_bytes"])) == (2, 2)
    assert all(p > 50 << 20 for p in two["peak_bytes"]) and two["predicted_bytes"] > 50 << 20
    cost = result["cost"]
    measured = cost["sharded"]["collective_bytes_per_step"]
    assert abs(measured - cost["planned_bytes"]) <= 0.01 * cost["planned_bytes"]
    assert cost["replicated"]["collective_bytes_per_step"] is None   # replicated: no sharded ledger
    assert "planner error" in (tmp_path / "out" / "shard.md").read_text()
