"""``l2l plan --fit``: the largest model that fits the memory limits, against ``predict()``
itself (the found size fits, the next size up does not), the limit that binds, and the
command as a user runs it."""
from __future__ import annotations

import json
import re
import shlex
from dataclasses import replace

import pytest

from l2l.cli import main
from l2l.config import TrainConfig
from l2l.errors import UserError
from l2l.hostmem import available_memory
from l2l.planner import Rates, predict
from l2l.planner import fit as fit_module
from l2l.planner.fit import Limits, _largest, depth_model, fit, fit_rates

from conftest import ROOT, run_cli

GIB = 2**30


@pytest.fixture(autouse=True)
def _no_recorded_runtime(monkeypatch):
    """fit() counts the runtime this process recorded when `l2l` started (an in-process main()
    records it): the comparisons here are with the default, whatever ran before."""
    from l2l import hostmem
    monkeypatch.setattr(hostmem, "_runtime_resident", None)


CPU_RATES = Rates(flops_per_s=1e12, link_bytes_per_s=None)
CUDA_RATES = Rates(flops_per_s=1e12, link_bytes_per_s=25e9)


def _predicted(cfg: TrainConfig, rates: Rates) -> tuple[int, int, int]:
    p = predict(cfg, rates)
    return p.params, p.host_total_bytes, p.device_total_bytes


def _check_against_predict(cfg: TrainConfig, found, rates: Rates, limits: Limits) -> None:
    """The found size's figures are predict()'s, within the limits; the next size up's exceed one."""
    s, n = found.found, found.next
    assert (s.params, s.host_bytes, s.device_bytes) == _predicted(replace(cfg, layers=s.layers, d_model=s.d_model),
                                                                  rates)
    assert (n.params, n.host_bytes, n.device_bytes) == _predicted(replace(cfg, layers=n.layers, d_model=n.d_model),
                                                                  rates)
    assert s.host_bytes <= limits.host_bytes
    assert limits.device_bytes is None or s.device_bytes <= limits.device_bytes
    assert n.host_bytes > limits.host_bytes or (limits.device_bytes is not None
                                                and n.device_bytes > limits.device_bytes)


# ---------------------------------------------------------------- the search


def test_layers_fit_exactly_at_a_limit_between_two_depths():
    cfg = TrainConfig()
    at_200, at_201 = predict(replace(cfg, layers=200), CPU_RATES), predict(replace(cfg, layers=201), CPU_RATES)
    limits = Limits((at_200.host_total_bytes + at_201.host_total_bytes) // 2)
    found = fit(cfg, limits)
    assert found.found.layers == 200 and found.next.layers == 201
    assert found.binding == "host"
    _check_against_predict(cfg, found, CPU_RATES, limits)
    # at the limit itself, 200 still fits; a byte less, it does not
    assert fit(cfg, Limits(at_200.host_total_bytes)).found.layers == 200
    assert fit(cfg, Limits(at_200.host_total_bytes - 1)).found.layers == 199


@pytest.mark.parametrize("cfg", [TrainConfig(), TrainConfig(stash="host", micro_batches=8, precision="bf16"),
                                 TrainConfig(d_model=96, heads=3, seq_len=64, dropout=0.1)])
def test_layers_fit_two_gib_of_host_memory(cfg):
    limits = Limits(2 * GIB)
    found = fit(cfg, limits)
    assert found.found.layers > 16  # deep enough to be extrapolated: checked against predict() itself
    assert found.search == "layers" and found.binding == "host"
    assert (found.found.d_model, found.found.heads) == (cfg.d_model, cfg.heads)
    _check_against_predict(cfg, found, CPU_RATES, limits)


def test_d_model_fit_is_a_multiple_of_heads():
    cfg = TrainConfig(layers=3, heads=6, seq_len=64)
    limits = Limits(GIB // 2)
    found = fit(cfg, limits, "d-model")
    d = found.found.d_model
    assert d % 6 == 0 and d > 6 and found.found.layers == 3
    assert found.next.d_model == d + 6
    _check_against_predict(cfg, found, CPU_RATES, limits)


def test_device_binds_on_cuda_where_host_is_plenty():
    cfg = TrainConfig(seq_len=64)
    limits = Limits(host_bytes=64 * GIB, device_bytes=GIB // 4)
    found = fit(cfg, limits)
    assert found.binding == "device"
    _check_against_predict(cfg, found, CUDA_RATES, limits)
    assert found.next.device_bytes > limits.device_bytes and found.next.host_bytes < limits.host_bytes
    # CUDA's figure counts the next layer's weights arriving (prefetch): more than zero-copy's
    s = found.found
    assert s.device_bytes > predict(replace(cfg, layers=s.layers), CPU_RATES).device_total_bytes


def test_host_binds_on_cuda_where_the_device_is_plenty():
    cfg = TrainConfig(seq_len=64)
    limits = Limits(host_bytes=GIB // 4, device_bytes=64 * GIB)
    found = fit(cfg, limits, "d-model")
    assert found.binding == "host"
    _check_against_predict(cfg, found, CUDA_RATES, limits)
    assert found.next.device_bytes < limits.device_bytes


def test_the_cpu_has_no_device_limit():
    """On the CPU device only the host figure counts, however large the device figure."""
    cfg = TrainConfig()
    found = fit(cfg, Limits(GIB))
    assert found.found.device_bytes > 0 and found.next.over(Limits(GIB)).keys() == {"host"}
    assert fit_rates(False).zero_copy and not fit_rates(True).zero_copy


def test_smallest_model_that_does_not_fit_is_a_user_error():
    with pytest.raises(UserError, match=r"smallest.*gpt 1 layer x d128.*needs host .* of 1.0 MiB"):
        fit(TrainConfig(), Limits(2**20))
    with pytest.raises(UserError, match=r"needs device"):
        fit(TrainConfig(), Limits(64 * GIB, 2**20), "d-model")


def test_the_search_stops_at_its_cap():
    found = fit(TrainConfig(d_model=4, heads=1, seq_len=8, batch_size=4), Limits(1 << 50))
    assert found.found.layers == fit_module.MAX_LAYERS and found.next is None and found.binding == "cap"


@pytest.mark.parametrize("n", [1, 2, 3, 7, 8, 9, 1000, 1023, 1024, 1025])
def test_largest_finds_the_last_true(n):
    assert _largest(lambda k: k <= n, cap=1 << 20) == n
    assert _largest(lambda k: k <= n, cap=5) == min(n, 5)
    assert _largest(lambda k: False, cap=10) is None


# ---------------------------------------------------------------- deep models, extrapolated


@pytest.mark.parametrize("cfg", [TrainConfig(), TrainConfig(stash="host", micro_batches=8),
                                 TrainConfig(devices=2, precision="fp16"),
                                 TrainConfig(model="hf-bert", d_model=64, heads=2, seq_len=32)])
@pytest.mark.parametrize("rates", [CPU_RATES, CUDA_RATES], ids=["cpu", "cuda"])
def test_depth_model_is_predict_at_every_depth(cfg, rates):
    if cfg.model.startswith("hf-"):
        pytest.importorskip("transformers")
    db = {"fp32": 4, "fp16": 2}[cfg.precision]
    at = depth_model(cfg, rates, db)
    for layers in (1, 2, 16, 17, 40, 133):
        assert at(layers) == _predicted(replace(cfg, layers=layers), rates), layers


def test_depth_model_predicts_each_depth_where_the_line_does_not_hold(monkeypatch):
    """Figures that are not affine in depth are not extrapolated: each depth is predicted."""
    calls = []

    def curved(cfg, rates, db):
        calls.append(cfg.layers)
        return cfg.layers, cfg.layers ** 2, cfg.layers
    monkeypatch.setattr(fit_module, "_exact", curved)
    at = depth_model(TrainConfig(), CPU_RATES, 4)
    assert at(100) == (100, 10_000, 100) and 100 in calls
    found = fit(TrainConfig(), Limits(50 * 50))
    assert found.found.layers == 50 and found.next.host_bytes == 51 * 51


# ---------------------------------------------------------------- the command


def test_cli_fits_two_gib(tmp_path):
    r = run_cli("plan", "--fit", "--host-memory", "2")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    # the CLI counts its own runtime (its resident set as it started), so its answer is
    # checked against predict() at the depth it names, not against a fit in this process
    layers = int(re.fullmatch(r"l2l plan --fit layers: gpt (\d+) layers x d128, 4 heads: .* parameters",
                              lines[0]).group(1))
    assert lines[0].endswith(f"{fit_module.count(predict(TrainConfig(layers=layers), CPU_RATES).params)} parameters")
    assert "of 2.00 GiB given (--host-memory)  <- binds" in lines[1]
    assert lines[2] == "  device: the CPU (counted in host)"
    assert lines[3].startswith(f"  next:   {layers + 1} layers") and "would need host" in lines[3]
    train = lines[4].split("train:  ", 1)[1]
    assert shlex.split(train)[:6] == ["l2l", "train", "--model", "gpt", "--layers", str(layers)]

    r = run_cli("plan", "--fit", "--host-memory", "2", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["fit"] == "layers" and out["d_model"] == 128
    assert out["host_limit_bytes"] == 2 * GIB and out["device_limit_bytes"] is None
    assert 0 < out["host_bytes"] <= 2 * GIB < out["next"]["host_bytes"]
    assert out["next"]["layers"] == out["layers"] + 1 and out["binding"] == "host"
    assert out["params"] == predict(TrainConfig(layers=out["layers"]), CPU_RATES).params


def test_lion_fits_a_model_a_fifth_larger_than_adamw():
    """Lion keeps one moment (8 bytes of state a parameter, not 12): in the same host memory
    ``--fit`` names a model at least 1.2x AdamW's, and the train line carries the optimizer."""
    found = {}
    for optimizer in ("adamw", "lion"):
        r = run_cli("plan", "--fit", "--host-memory", "2", "--optimizer", optimizer, "--json")
        assert r.returncode == 0, r.stderr
        found[optimizer] = json.loads(r.stdout)
    assert found["lion"]["params"] >= 1.2 * found["adamw"]["params"], found
    assert "--optimizer lion" in found["lion"]["train"] and "--optimizer" not in found["adamw"]["train"]


def test_cli_fits_a_width_and_a_device_limit():
    """``--device cuda --device-memory`` plans for a GPU, with or without one here."""
    r = run_cli("plan", "--fit", "d-model", "--heads", "6", "--layers", "3", "--device", "cuda",
                "--device-memory", "0.25", "--host-memory", "64", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["fit"] == "d-model" and out["d_model"] % 6 == 0 and out["binding"] == "device"
    assert out["device_bytes"] <= GIB // 4 < out["next"]["device_bytes"]
    assert out["next"]["d_model"] == out["d_model"] + 6 and out["train"].endswith("--device cuda")


def test_cli_fits_this_machines_available_memory():
    available = available_memory()
    r = run_cli("plan", "--fit", "--json")
    if available is None:  # no /proc/meminfo: the limit must be given, and the command says so
        assert r.returncode == 2 and "--host-memory" in r.stderr and "Traceback" not in r.stderr
        return
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["host_limit_from"].startswith("95% of available (MemAvailable")
    assert 0.5 * available < out["host_limit_bytes"] < available  # read again a moment apart, a margin kept
    assert out["host_bytes"] <= out["host_limit_bytes"] < out["next"]["host_bytes"]


def test_readme_example_runs_as_written():
    line = "l2l plan --fit --host-memory 16"
    assert f"\n{line}\n" in (ROOT / "README.md").read_text()
    r = run_cli(*shlex.split(line)[1:])
    assert r.returncode == 0, r.stderr
    assert "of 16.00 GiB given (--host-memory)  <- binds" in r.stdout and "l2l train --model gpt" in r.stdout


def _one_line_error(r) -> str:
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and r.stdout == ""
    return r.stderr


def test_cli_bad_input_is_one_line(tmp_path):
    assert "invalid choice: 'widths'" in _one_line_error(run_cli("plan", "--fit", "widths"))
    assert "--host-memory must be a positive" in _one_line_error(run_cli("plan", "--fit", "--host-memory", "0"))
    model_dir = tmp_path / "my-model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert "model directory" in _one_line_error(run_cli("plan", "--fit", "--model", str(model_dir)))


@pytest.mark.parametrize("argv,message", [
    (["--fit", "--host-memory", "-1"], "--host-memory must be a positive"),
    (["--fit", "--host-memory", "nan"], "--host-memory must be a positive"),
    (["--fit", "--host-memory", "lots"], "invalid float value"),
    (["--fit", "--host-memory", "0.001"], "not even the smallest model fits"),
    (["--fit", "--device", "cuda", "--device-memory", "0", "--host-memory", "1"], "--device-memory must be"),
    (["--fit", "--device", "cpu", "--device-memory", "4"], "--device-memory applies to a CUDA device"),
    (["--host-memory", "4"], "apply to --fit"),
    (["--fit", "--flops", "1e12"], "drop --flops"),
    (["--fit", "d-model", "--heads", "0"], "must be positive"),
])
def test_bad_fit_options_are_one_line(argv, message, capsys):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
