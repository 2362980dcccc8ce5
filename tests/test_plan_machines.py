"""``l2l plan --machines R``: each machine's host memory and the EPS's collectives in the step."""
from __future__ import annotations

import json

import pytest

from l2l.eps.gather import GATHER_WINDOW

from conftest import run_cli

SHAPE = ["--layers", "4", "--d-model", "256", "--heads", "4", "--seq-len", "64", "--batch-size", "16",
         "--micro-batches", "16", "--device", "cpu", "--flops", "5e10", "--eps-rate", "2e8", "--link-gbps", "0"]


def _plan(*args: str) -> dict:
    r = run_cli("plan", *SHAPE, *args, "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)["prediction"]


GPU = ["--link-gbps", "25", "--flops", "4e14", "--precision", "bf16"]  # CUDA-rate plans: a link, a GPU's rate


def test_each_machine_holds_its_share_of_the_eps_state():
    one, four = _plan("--devices", "4"), _plan("--machines", "4")
    params, largest = one["params"], max(one["layer_params"])
    # one process of 4 CPU workers: p, m, v, and the masters serve as the fp32 copies
    assert one["host_state_bytes"] == 12 * params and one["collective_bytes"] == 0
    assert one["host_gather_bytes"] == 0
    # 4 machines: 12/4 bytes a parameter of state; the fp32 copy's slice is the masters' slice;
    # whole copies only in the gather's window and in the worker's hands (1)
    assert four["host_state_bytes"] == 3 * params
    assert four["host_gather_bytes"] == (GATHER_WINDOW + 1) * largest * 4
    replicated = _plan("--machines", "4", "--eps-layout", "replicated")   # a whole EPS each, as one process
    assert replicated["host_state_bytes"] == 12 * params and replicated["host_gather_bytes"] == 0
    assert four["machines"] == 4 and four["eps_layout"] == "sharded"


@pytest.mark.parametrize("k", [1, 2])
def test_a_machines_state_falls_as_one_over_r_and_the_window_stays(k):
    """GPU rates, bf16: each of R machines keeps (12 + 2)/R bytes a parameter; the gathered
    copies are a constant window: GATHER_WINDOW ahead, and per worker the one it computes with and the
    one on its way to the GPU."""
    plans = {r: _plan("--machines", str(r), "--devices", str(k), *GPU) for r in (2, 4, 8)}
    params, largest = plans[2]["params"], max(plans[2]["layer_params"])
    for r, p in plans.items():
        assert p["host_state_bytes"] == -(-12 * params // r) + -(-2 * params // r), r
        assert p["host_gather_bytes"] == (GATHER_WINDOW + 2 * k) * largest * 2, r
    assert plans[2]["host_total_bytes"] > plans[4]["host_total_bytes"] > plans[8]["host_total_bytes"]


def test_k_gpus_split_each_pass():
    """K GPUs each run M/(R*K) of a pass's micro-batches at the GPU's rate: K = 2 halves the
    compute at the same M; the FLOPs (the machine's) stay. On the CPU the K workers share
    the cores the rate was measured on: the same compute."""
    one, two = _plan(*GPU), _plan("--devices", "2", *GPU)
    assert two["compute_s"] == pytest.approx(one["compute_s"] / 2, rel=1e-9)
    assert two["flops"] == one["flops"] > 0
    assert two["device_ledger_bytes"] < one["device_ledger_bytes"]  # each GPU stashes its 8 micro-batches, not 16
    # --stash host: each GPU's stash is half as long, and both are in this machine's memory
    host_one, host_two = _plan("--stash", "host", *GPU), _plan("--stash", "host", "--devices", "2", *GPU)
    assert host_two["host_stash_bytes"] == host_one["host_stash_bytes"] > 0
    cpu_one, cpu_two = _plan(), _plan("--devices", "2")
    assert cpu_two["compute_s"] == pytest.approx(cpu_one["compute_s"], rel=1e-9)
    machines = _plan("--machines", "2", "--devices", "2", *GPU)   # 16 micro-batches over 4 GPUs
    assert machines["compute_s"] == pytest.approx(one["compute_s"] / 4, rel=1e-9)
    assert machines["flops"] == pytest.approx(one["flops"] / 2, rel=1e-9)


def test_the_gathers_move_each_fetch_and_hide_behind_compute():
    """Each fetch gathers its layer's copy: every layer twice a step, the post stage (and on a
    GPU the layer before it) once; each
    machine receives (R-1)/R of it. At a fast link the window hides all but the step's first
    gathers; at a slow one the gathers are most of the step."""
    deep = ["--layers", "16", "--flops", "1e12"]  # a block's pass: 0.4 ms or more; its gather at 100 GB/s: 12 µs
    fast = _plan("--machines", "4", *GPU, *deep, "--network-gbps", "100")
    slow = _plan("--machines", "4", *GPU, *deep, "--network-gbps", "0.01")
    n = fast["layer_params"]
    # on a GPU the layer before the post stays on the device for the backward: fetched once
    assert fast["gather_bytes"] == slow["gather_bytes"] == (2 * sum(n) - n[-1] - n[-2]) * 2 * 3
    assert slow["gather_s"] == pytest.approx(slow["gather_bytes"] / 4 / 1e7, rel=1e-9)
    # the EPS thread's collectives are the gradients' exchange alone
    assert slow["collective_s"] == pytest.approx(slow["exchange_bytes"] / 4 / 1e7, rel=1e-9)
    assert slow["collective_bytes"] == slow["exchange_bytes"] + slow["gather_bytes"]   # what the machines book
    # the step waits for the first two gathers at most: the embedding's forward computes nothing
    first_two = (n[0] + n[1]) * 2 * 3 / 4 / 100e9
    assert 0 < fast["gather_exposed_s"] <= first_two < 0.1 * fast["gather_s"]
    assert slow["gather_exposed_s"] > 0.5 * slow["gather_s"]
    assert slow["step_s"] >= (slow["gather_s"] + slow["collective_s"]) * (1 - 1e-9)   # one link carries both


def test_the_network_is_in_the_step():
    free, slow = _plan("--machines", "2"), _plan("--machines", "2", "--network-gbps", "0.01")
    assert free["collective_bytes"] == slow["collective_bytes"] > 0
    assert free["collective_s"] == 0.0 and slow["collective_s"] > 0
    # 2 machines: each sends half of what all send; at 10 MB/s that is the collectives' time
    # (the gradients': the copies go by the gathers, timed apart)
    assert slow["collective_s"] == pytest.approx(slow["exchange_bytes"] / 2 / 1e7, rel=1e-6)
    assert slow["gather_s"] == pytest.approx(slow["gather_bytes"] / 2 / 1e7, rel=1e-6)
    assert slow["step_s"] > free["step_s"]


@pytest.mark.parametrize("args, needle", [
    (["--machines", "0"], "--machines must be at least 1"),
    (["--network-gbps", "10"], "--network-gbps applies to --machines 2 or more"),
    (["--machines", "2", "--network-gbps", "-1"], "--network-gbps must be a positive number"),
    (["--machines", "3"], "--micro-batches 16 must be a multiple of --machines x --devices (3 x 1)"),
])
def test_bad_machines_are_one_line(args, needle):
    r = run_cli("plan", *SHAPE, *args)
    assert r.returncode == 2 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_the_window_lets_a_long_gather_start_early():
    """Four passes of 2, 2, 2 and 1 s; only the last gathers, 4.5 s. With 2 copies in the window
    its gather starts as the first pass is fetched and ends under the third's compute; with 1
    it waits for the second pass's fetch, ends at 6.5 s, and the last pass starts late."""
    from l2l.planner.model import _Pass, _simulate
    passes = [_Pass(i, "fwd", c, 0.0, 0.0, 0.0, gather_s=4.5 if i == 3 else 0.0) for i, c in enumerate((2, 2, 2, 1))]
    assert _simulate(passes, window=2)["step"] == pytest.approx(7.0)
    assert _simulate(passes, window=1)["step"] == pytest.approx(7.5)


def test_train_forecasts_one_of_its_machines():
    """``l2l train --plan`` under torchrun forecasts its machine: of 2, sharded, it holds half
    of p, m, v (on the CPU in fp32 the copy's slice is the masters' own)."""
    import torch

    from l2l.config import TrainConfig
    from l2l.planner import Rates, predict
    from l2l.planner.forecast import forecast
    cfg = TrainConfig(layers=2, d_model=64, heads=2, seq_len=16, batch_size=4, micro_batches=4, steps=1,
                      device="cpu")
    params = predict(cfg, Rates(flops_per_s=1e9)).params
    one, two = (forecast(cfg, torch.device("cpu"), "quick", world=w) for w in (1, 2))
    assert one.host_state_bytes == 12 * params and two.host_state_bytes == 6 * params


@pytest.mark.slow  # about a minute and a half on the project's 2-core machine
def test_the_scale_out_page_is_what_l2l_plan_prints(tmp_path):
    """docs/scale-out.md's tables are bench/scale_out.py's, and a row is the `l2l plan` command
    the script records for it."""
    import shlex
    import sys

    from conftest import ROOT, run_python
    page = tmp_path / "page.md"
    page.write_text((ROOT / "docs" / "scale-out.md").read_text())
    r = run_python("bench/scale_out.py", "--out", str(tmp_path), "--results", str(page), cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert page.read_text() == (ROOT / "docs" / "scale-out.md").read_text()
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import scale_out
    finally:
        sys.path.remove(str(ROOT / "bench"))
    scale_out.write_shapes(tmp_path)
    row = next(r for r in json.loads((tmp_path / "scale_out.json").read_text())
               if (r["model"], r["machines"], r["network_gbits"]) == ("70B", 2, 400))
    plan = run_cli(*shlex.split(row["command"])[1:], "--json", cwd=tmp_path)
    assert plan.returncode == 0, plan.stderr[-2000:]
    got, want = json.loads(plan.stdout)["prediction"], row["prediction"]
    assert got["step_s"] == pytest.approx(want["step_s"], rel=1e-9)
    assert got["host_total_bytes"] - got["host_runtime_bytes"] == want["host_total_bytes"] - want["host_runtime_bytes"]
