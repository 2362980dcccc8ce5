"""``l2l plan --machines R``: each machine's host memory and the EPS's collectives in the step."""
from __future__ import annotations

import json

import pytest

from conftest import run_cli

SHAPE = ["--layers", "4", "--d-model", "256", "--heads", "4", "--seq-len", "64", "--batch-size", "16",
         "--micro-batches", "16", "--device", "cpu", "--flops", "5e10", "--eps-rate", "2e8", "--link-gbps", "0"]


def _plan(*args: str) -> dict:
    r = run_cli("plan", *SHAPE, *args, "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)["prediction"]


def test_each_machine_holds_its_share_of_the_eps_state():
    one, four = _plan("--devices", "4"), _plan("--machines", "4")
    params = one["params"]
    # one process of 4 CPU workers: p, m, v, and the masters serve as the fp32 copies
    assert one["host_state_bytes"] == 12 * params and one["collective_bytes"] == 0
    # 4 machines: 12/4 bytes a parameter of state, and every device copy (4 bytes: no longer the masters)
    assert four["host_state_bytes"] == 3 * params + 4 * params
    replicated = _plan("--machines", "4", "--eps-layout", "replicated")   # a whole EPS each, as one process
    assert replicated["host_state_bytes"] == 12 * params
    assert four["machines"] == 4 and four["eps_layout"] == "sharded"



GPU = ["--link-gbps", "25", "--flops", "4e14", "--precision", "bf16"]  # CUDA-rate plans: a link, a GPU's rate


def test_k_gpus_split_each_pass():
    """K GPUs each run M/(R*K) of a pass's micro-batches at the GPU's rate: K = 2 halves the
    compute at the same M; the FLOPs (the machine's) stay. On the CPU the K workers share
    the cores the rate was measured on: the same compute."""
    one, two = _plan(*GPU), _plan("--devices", "2", *GPU)
    assert two["compute_s"] == pytest.approx(one["compute_s"] / 2, rel=1e-9)
    assert two["flops"] == one["flops"] > 0
    assert two["device_ledger_bytes"] < one["device_ledger_bytes"]  # each GPU stashes its 8 micro-batches, not 16
    cpu_one, cpu_two = _plan(), _plan("--devices", "2")
    assert cpu_two["compute_s"] == pytest.approx(cpu_one["compute_s"], rel=1e-9)
    machines = _plan("--machines", "2", "--devices", "2", *GPU)   # 16 micro-batches over 4 GPUs
    assert machines["compute_s"] == pytest.approx(one["compute_s"] / 4, rel=1e-9)
    assert machines["flops"] == pytest.approx(one["flops"] / 2, rel=1e-9)

def test_the_network_is_in_the_step():
    free, slow = _plan("--machines", "2"), _plan("--machines", "2", "--network-gbps", "0.01")
    assert free["collective_bytes"] == slow["collective_bytes"] > 0
    assert free["collective_s"] == 0.0 and slow["collective_s"] > 0
    # 2 machines: each sends half of what all send; at 10 MB/s that is the collectives' time
    assert slow["collective_s"] == pytest.approx(slow["collective_bytes"] / 2 / 1e7, rel=1e-6)
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
