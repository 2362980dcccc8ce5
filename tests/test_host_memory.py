"""Host memory: a model built and read layer by layer, a run within its byte budget, and a
planner whose host figure is the process's measured peak (docs/host-memory.md)."""
from __future__ import annotations

import json
import weakref

import numpy as np
import pytest
import torch

from l2l.checkpoint import LazyArrays, load_latest, save_checkpoint
from l2l.eps import OptimizerHyper, EagerParamServer
from l2l.eps.numpy_backend import NumpyBackend
from l2l.models import ModelConfig, build_stack

from conftest import run_cli

CFG = ModelConfig(layers=3, d_model=32, heads=2, seq_len=16)


def test_the_gpt_is_built_as_shapes_and_each_layer_made_alone():
    stack = build_stack(CFG, seed=5)
    assert all(p.is_meta for layer in stack.layers for p in layer.module.parameters())
    first = [stack.initial_weights(e) for e in range(stack.num_entries)]
    backwards = [stack.initial_weights(e) for e in reversed(range(stack.num_entries))][::-1]
    assert all(np.array_equal(a, b) for a, b in zip(first, backwards))  # any order, same weights
    assert not np.array_equal(first[1], first[2])  # each block its own draws
    other_seed = build_stack(CFG, seed=6).initial_weights(1)
    assert not np.array_equal(first[1], other_seed)
    real = build_stack(CFG, seed=5, materialize=True)
    assert all(np.array_equal(layer.layout.flatten(layer.module), w) for layer, w in zip(real.layers, first))
    block = dict(real.layers[1].module.named_parameters())
    assert torch.all(block["ln1.weight"] == 1) and torch.all(block["fc.bias"] == 0)
    assert 0.015 < float(block["fc.weight"].detach().std()) < 0.025


def _counting(arrays: dict[str, np.ndarray]) -> tuple[LazyArrays, dict]:
    """``arrays`` as lazy arrays that count how many of them are alive at once."""
    seen = {"alive": 0, "most": 0}

    def gone() -> None:
        seen["alive"] -= 1

    def read(key: str) -> np.ndarray:
        a = arrays[key].copy()
        seen["alive"] += 1
        seen["most"] = max(seen["most"], seen["alive"])
        weakref.finalize(a, gone)
        return a
    return LazyArrays({k: (a.shape, a.dtype) for k, a in arrays.items()}, read), seen


def test_the_eps_loads_a_checkpoint_one_layer_at_a_time(tmp_path):
    eps = EagerParamServer(NumpyBackend(), OptimizerHyper(lr=1e-3))
    for layer in range(6):
        eps.add_layer(layer, np.full(100, layer, np.float32))
    state = {f"layer{i}.{k}": np.full(100, 10 * i + "pmv".index(k), np.float32) for i in range(6) for k in "pmv"}
    lazy, seen = _counting(state)
    eps.load_state(lazy, {"steps": {str(i): i for i in range(6)}})
    assert seen["most"] <= 3  # one layer's p, m, v
    assert all(np.array_equal(eps.state_tensors()[k], a) for k, a in state.items())
    # and through a checkpoint file: its tensors are read when asked for
    save_checkpoint(tmp_path, 1, eps.state_arrays(), {"steps": {}})
    ck = load_latest(tmp_path)
    assert isinstance(ck.tensors, LazyArrays)
    assert all(np.array_equal(ck.tensors[k], a) for k, a in state.items())


def test_a_bad_shape_in_a_checkpoint_changes_nothing():
    eps = EagerParamServer(NumpyBackend(), OptimizerHyper(lr=1e-3))
    for layer in range(2):
        eps.add_layer(layer, np.full(10, layer, np.float32))
    state = {f"layer{i}.{k}": np.zeros(10 if i == 0 else 11, np.float32) for i in range(2) for k in "pmv"}
    lazy, seen = _counting(state)
    with pytest.raises(ValueError, match="layer1"):
        eps.load_state(lazy, {"steps": {"0": 1, "1": 1}})
    assert seen["most"] == 0  # checked from the shapes alone, nothing read
    assert np.array_equal(eps.state_tensors()["layer0.p"], np.zeros(10, np.float32))


# A GPT of 42.8M parameters: big enough that the EPS state outweighs the runtime; 32 tokens a
# step keep its compute (bf16 matmuls are slow on CPUs) to about 15 s a run.
SHAPE = ["--layers", "24", "--d-model", "384", "--heads", "6", "--seq-len", "16", "--batch-size", "2",
         "--micro-batches", "1", "--steps", "2", "--save-every", "1", "--eval-batches", "1", "--no-plot"]


@pytest.mark.parametrize("precision,stash", [("fp32", "device"), ("bf16", "host")])
def test_a_whole_run_keeps_to_its_byte_budget_and_the_planner_predicts_its_peak(tmp_path, precision, stash):
    """Build, evaluation, two steps with a checkpoint after each, from the command line:
    the peak resident set above the idle process is the EPS's p, m, v and device copy (none
    in fp32 on the CPU: the masters serve as the copies) and little more, and the forecast
    ``l2l train`` prints is within 10% of it."""
    out = tmp_path / "run"
    r = run_cli("train", *SHAPE, "--precision", precision, "--stash", stash, "--plan", "quick", "--out", str(out),
                timeout=600, fresh=True)  # its resident set is the measurement: nothing pre-imported
    assert r.returncode == 0, r.stderr
    summary = json.loads((out / "summary.json").read_text())
    floor = 12 + (0 if precision == "fp32" else 2)
    per_param = (summary["host_peak_bytes"] - summary["host_runtime_bytes"]) / summary["params"]
    print(f"\n{precision} {stash}: {per_param:.2f} bytes/param (floor {floor}), peak "
          f"{summary['host_peak_bytes'] / 2**30:.3f} GiB, predicted {summary['plan']['predicted_host_bytes'] / 2**30:.3f}")
    # the data, the planner's measurements and a few layers' transients are about 150 MiB
    # here (3.7 bytes/param at 42.8M); a whole model in torch, a whole checkpoint copy or an
    # inbox per layer would each add 4 to 12 more
    assert floor <= per_param <= floor + 5.0
    predicted = summary["plan"]["predicted_host_bytes"]
    assert abs(summary["host_peak_bytes"] / predicted - 1) <= 0.10
    assert "host peak" in r.stdout and "GiB predicted" in r.stdout


def test_plan_shows_the_host_figure_term_by_term():
    r = run_cli("plan", "--layers", "4", "--d-model", "256", "--heads", "4", "--flops", "1e11", "--eps-rate", "1e9",
                "--link-gbps", "0")
    assert r.returncode == 0, r.stderr
    for term in ("host memory (peak RSS)", "runtime", "EPS state", "transients"):
        assert term in r.stdout


def test_bench_host_measures_a_run_against_the_plan(tmp_path):
    r = run_cli("bench", "host", "--quick", "--precisions", "fp32", "--stash", "device", "--out", str(tmp_path),
                timeout=600, fresh=True)
    assert r.returncode == 0, r.stderr
    adamw, lion = json.loads((tmp_path / "host.json").read_text())["rows"]  # both optimizers by default
    for row in (adamw, lion):
        assert row["peak_bytes"] > row["idle_bytes"] > 0 and row["params"] > 0
        assert row["prediction_error"] == pytest.approx(row["peak_bytes"] / row["predicted_bytes"] - 1)
    # fp32 on the CPU: the masters are the copies, so the floor is the state, p, m, v or p, m
    assert (adamw["optimizer"], adamw["floor_bytes_per_param"]) == ("adamw", 12)
    assert (lion["optimizer"], lion["floor_bytes_per_param"]) == ("lion", 8)
    assert "| 2 x d64 | " in (tmp_path / "host.md").read_text() and "| lion |" in (tmp_path / "host.md").read_text()


TRIM_PROBE = r"""
import json, sys, numpy as np
from l2l import hostmem
hostmem.tune_host_allocator()  # freed memory stays with the process, as under the l2l command
trimmer = hostmem.HeapTrimmer(slack=int(sys.argv[1]) << 20)
def resident():
    return hostmem.memory_status()["RssAnon"]
trimmer()  # where it measures from
big, small = [], []
for layer in range(40):  # 1 MiB a layer that dies, then something small that outlives it
    big.append(np.ones(1 << 18, np.float32))
    small.append(np.ones(64, np.float32))
before = resident()
del big  # 40 MiB of holes between the survivors: free, and still resident
holes = resident()
trimmed = trimmer()
print(json.dumps({"before": before, "holes": holes, "after": resident(), "trimmed": trimmed,
                  "active": trimmer.active}))
"""


def _trim_probe(slack_mib: int) -> dict:
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", TRIM_PROBE, str(slack_mib)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_the_heap_trimmer_gives_back_resident_holes_past_its_slack():
    """Memory freed between survivors stays resident under the raised trim threshold; the
    trimmer hands it back once it passes the slack (measured independently, by the resident
    set), and leaves it below the slack."""
    got = _trim_probe(16)
    assert got["active"] and got["trimmed"]
    assert got["holes"] > got["before"] - (4 << 20)  # freeing alone gave nothing back
    assert got["after"] < got["holes"] - (32 << 20)  # the trim did
    kept = _trim_probe(64)  # 40 MiB of holes: under this slack
    assert not kept["trimmed"] and kept["after"] > kept["holes"] - (4 << 20)
