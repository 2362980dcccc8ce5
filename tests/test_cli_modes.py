"""Every mode of `l2l train`, run as a user runs it: a subprocess with default planning.

No run here passes ``--no-progress`` or ``--plan`` (but the test of each plan
mode): the default ``--plan auto`` forecasts -- and calibrates on real relay
steps -- before the first step, so every mode is also checked together with
the planner that the user gets by default.

Runs that several tests look at are module fixtures; the rest are one run per
test. Each run is a tiny model for a few steps: a few seconds on a 2-core CPU.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import pytest

from l2l.checkpoint import load_latest
from l2l.distributed import weights_digest
from l2l.metrics import read_metrics

from conftest import ROOT, run_cli, run_torchrun
from shared_runs import cli_once

TINY = ["--layers", "2", "--d-model", "32", "--heads", "2", "--seq-len", "32", "--batch-size", "8",
        "--eval-batches", "1", "--no-plot"]
QUICK = [*TINY, "--micro-batches", "2", "--steps", "2"]
# the --devices comparisons, torchrun and the resumes: 4 micro-batches (so 2 per worker or
# machine), 4 steps of one 4-step lr schedule, a checkpoint every 2 steps
STEPS = 4
LONG = [*TINY, "--micro-batches", "4", "--schedule-steps", str(STEPS), "--save-every", "2"]
PLAN_LINE = "l2l: plan ("
REL = 1e-6


@dataclass
class Run:
    out: Path
    proc: subprocess.CompletedProcess

    @property
    def stdout_lines(self) -> list[str]:
        return self.proc.stdout.splitlines()

    @cached_property
    def records(self) -> list[dict]:
        return read_metrics(self.out / "metrics.jsonl")

    @property
    def losses(self) -> list[float]:
        return [r["loss"] for r in self.records]

    @cached_property
    def summary(self) -> dict:
        return json.loads((self.out / "summary.json").read_text())

    @cached_property
    def tensors(self) -> dict[str, np.ndarray]:
        return load_latest(self.out).tensors


def _train(out: Path, *args: str) -> Run:
    return Run(out, run_cli("train", *args, "--out", str(out)))


def _shared(tmp_path_factory, name: str, *args: str) -> Run:
    """``_train`` of ``args``, run once for the whole session (xdist workers included)."""
    return Run(*cli_once(tmp_path_factory, f"cli_modes-{name}", lambda out: run_cli("train", *args, "--out", str(out))))


def _trained(run: Run, steps: int) -> Run:
    """``run`` exited 0 and left a whole record of ``steps`` steps with finite losses."""
    assert run.proc.returncode == 0, run.proc.stderr[-3000:]
    assert "Traceback" not in run.proc.stderr
    assert [r["step"] for r in run.records] == list(range(1, steps + 1))
    assert all(math.isfinite(x) and x > 0 for x in run.losses), run.losses
    assert run.summary["steps"] == steps and run.summary["final_loss"] == run.losses[-1]
    assert math.isfinite(run.summary["final_val_loss"])
    ck = load_latest(run.out)
    assert ck is not None and ck.step == steps
    assert all(np.isfinite(t).all() for t in ck.tensors.values())
    return run


def _close(got: list[float], want: list[float], rel: float = REL) -> None:
    assert len(got) == len(want), (got, want)
    for a, b in zip(got, want):
        assert abs(a - b) <= rel * abs(b), (got, want)


def _same_tensors(got: dict, want: dict, *, exact: bool = False, rel: float = REL) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        if exact:
            assert np.array_equal(got[k], want[k]), k
        else:  # within 1e-6 of the tensor's scale: the same sums in another order differ in the last
            # bits, which Adam's m/sqrt(v) magnifies element by element where a gradient is near zero
            want64 = want[k].astype(np.float64)
            err = np.abs(got[k].astype(np.float64) - want64).max()
            assert err <= rel * np.abs(want64).max(), (k, err, np.abs(want64).max())


def _planned(run: Run) -> None:
    """The default planning ran: the forecast before the first step, the comparison at the end."""
    lines = run.stdout_lines
    plan = [i for i, l in enumerate(lines) if l.startswith(PLAN_LINE)]
    compare = [i for i, l in enumerate(lines) if l.startswith("l2l: step time ") and "predicted" in l]
    first = [i for i, l in enumerate(lines) if l.startswith("l2l: step 0 validation loss")]
    assert len(plan) == 1 and len(compare) == 1, run.proc.stdout
    assert (first == [] or plan[0] < first[0]) and compare[0] > plan[0], run.proc.stdout
    # at the end: only the validation summary may follow the comparison
    assert all(l.startswith("l2l: validation loss ") for l in lines[compare[0] + 1:]), run.proc.stdout
    assert run.summary["plan"]["predicted_step_s"] > 0 and run.summary["plan"]["measured_step_s"] > 0


def _one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("l2l: error: "), proc.stderr
    for n in needles:
        assert n in lines[0], lines[0]


# ------------------------------------------------------------------ shared runs

DEFAULTS = {"eps": "numpy", "precision": "fp32", "stash": "device", "plan": "auto"}


@pytest.fixture(scope="module")
def quick_ref(tmp_path_factory) -> Run:
    """The defaults (numpy EPS, fp32, device stash, plan auto), 2 micro-batches, 2 steps."""
    return _trained(_shared(tmp_path_factory, "quick", *QUICK), 2)


@pytest.fixture(scope="module")
def explicit_defaults(tmp_path_factory) -> Run:
    """QUICK with every default of DEFAULTS named on the command line: the run of each mode
    test whose value is the default (one run, not four)."""
    flags = [x for option, value in DEFAULTS.items() for x in (f"--{option}", value)]
    return _trained(_shared(tmp_path_factory, "explicit", *QUICK, *flags), 2)


def _mode_run(tmp_path, explicit_defaults: Run, option: str, value: str) -> Run:
    if DEFAULTS[option] == value:
        return explicit_defaults
    return _trained(_train(tmp_path / "run", *QUICK, f"--{option}", value), 2)


@pytest.fixture(scope="module")
def one_device(tmp_path_factory) -> Run:
    return _trained(_shared(tmp_path_factory, "one", *LONG, "--steps", str(STEPS)), STEPS)


@pytest.fixture(scope="module")
def two_devices(tmp_path_factory) -> Run:
    return _trained(_shared(tmp_path_factory, "two", *LONG, "--steps", str(STEPS),
                           "--devices", "2"), STEPS)


@pytest.fixture(scope="module")
def two_devices_strict(tmp_path_factory) -> Run:
    return _trained(_shared(tmp_path_factory, "two-strict", *LONG, "--steps", str(STEPS),
                           "--devices", "2", "--overflow", "strict"), STEPS)


@pytest.fixture(scope="module")
def plain_full(tmp_path_factory) -> Run:
    return _trained(_shared(tmp_path_factory, "plain", *LONG, "--steps", str(STEPS),
                           "--engine", "plain"), STEPS)


# ------------------------------------------------------------------ --devices

def test_default_run_plans_and_trains(one_device):
    _planned(one_device)
    assert one_device.summary["initial_val_loss"] > 0
    assert "x 2 workers" not in one_device.stdout_lines[0]


@pytest.mark.parametrize("fixture", ["two_devices", "two_devices_strict"])
def test_two_devices_match_one_per_step(request, one_device, fixture):
    """--devices 2 (eager or strict) runs the same global batch as --devices 1: fp32 on the
    CPU, every step's loss and the final master weights and moments agree within 1e-6."""
    two = request.getfixturevalue(fixture)
    assert "x 2 workers" in two.stdout_lines[0], two.proc.stdout
    _planned(two)
    _close(two.losses, one_device.losses)
    _same_tensors(two.tensors, one_device.tensors)
    assert two.summary["final_val_loss"] == pytest.approx(one_device.summary["final_val_loss"], rel=REL)


@pytest.mark.parametrize("args, needle", [
    (["--micro-batches", "3"], "--devices 2"),
    (["--micro-batches", "4", "--engine", "plain"], "--devices applies to --engine l2l"),
    (["--micro-batches", "4", "--resume"], "no checkpoint"),
])
def test_devices_user_error_is_one_line(tmp_path, args, needle):
    out = tmp_path / "run"
    r = run_cli("train", *TINY, "--steps", "2", "--devices", "2", *args, "--out", str(out))
    _one_line_error(r, needle)
    assert not (out / "metrics.jsonl").exists()


# ------------------------------------------------------------------ torchrun

def test_torchrun_two_ranks_match_one_process(tmp_path, one_device):
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "L2L_DIST_TIMEOUT": "120",
           # the ranks import l2l as run_cli's children do (the inherited PYTHONPATH), else this checkout's
           "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT / "host")]))}
    proc = run_torchrun("--standalone", "--nproc-per-node", "2", "-m", "l2l", "train",
                        *LONG, "--steps", str(STEPS), "--out", str(out), env=env)
    run = _trained(Run(out, proc), STEPS)
    assert "2 machines" in proc.stdout, proc.stdout  # rank 0 speaks for the run, once
    assert proc.stdout.count("l2l: l2l engine") == 1, proc.stdout
    _close(run.losses, one_device.losses)
    _same_tensors(run.tensors, one_device.tensors)
    # the EPS is sharded (the default): one digest of the global masters, rank 0's checkpoint's
    assert run.summary["machines_weights_sha256"] == [run.summary["weights_sha256"]] == [weights_digest(run.tensors)]


# ------------------------------------------------------------------ EPS backends, precision, stash

@pytest.mark.parametrize("eps", ["numpy", "opencl", "hls-csim"])
def test_eps_backend(tmp_path, quick_ref, explicit_defaults, eps):
    """Every EPS backend computes the numpy contract's bits: the same losses and state as the default run."""
    run = _mode_run(tmp_path, explicit_defaults, "eps", eps)
    _planned(run)
    assert json.loads((run.out / "config.json").read_text())["eps"] == eps
    assert run.losses == quick_ref.losses
    _same_tensors(run.tensors, quick_ref.tensors, exact=True)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_precision(tmp_path, quick_ref, explicit_defaults, precision):
    run = _mode_run(tmp_path, explicit_defaults, "precision", precision)
    _planned(run)
    # the EPS keeps fp32 master weights and moments whatever the device computes in
    assert all(t.dtype == np.float32 for t in run.tensors.values())
    if precision == "fp32":
        assert run.losses == quick_ref.losses
        _same_tensors(run.tensors, quick_ref.tensors, exact=True)
        assert all(r["loss_scale"] in (None, 1.0) for r in run.records)
    else:  # the same weights on the same batches, rounded to 8 or 11 bits: close, not equal
        _close(run.losses, quick_ref.losses, rel=1e-3)
        assert run.losses != quick_ref.losses
        _same_tensors(run.tensors, quick_ref.tensors, rel=5e-2)
    if precision == "fp16":  # dynamic loss scaling
        assert all(r["loss_scale"] is not None and r["loss_scale"] > 1 for r in run.records)


@pytest.mark.parametrize("stash", ["device", "host"])
def test_stash(tmp_path, quick_ref, explicit_defaults, stash):
    """Where stashed activations wait changes no number."""
    run = _mode_run(tmp_path, explicit_defaults, "stash", stash)
    _planned(run)
    assert run.losses == quick_ref.losses
    _same_tensors(run.tensors, quick_ref.tensors, exact=True)


# ------------------------------------------------------------------ the plain engine

@pytest.mark.parametrize("flags", [[], ["--checkpointing"], ["--accumulate"], ["--accumulate", "--checkpointing"]],
                         ids=["whole-batch", "checkpointing", "accumulate", "accumulate-checkpointing"])
def test_plain_engine(tmp_path, quick_ref, flags):
    """The baseline in each of its modes trains the same model as the relay, the same numbers
    but for rounding (torch's AdamW, not the EPS; other summation orders)."""
    run = _trained(_train(tmp_path / "run", *QUICK, "--engine", "plain", *flags), 2)
    assert run.stdout_lines[0].startswith("l2l: plain engine"), run.proc.stdout
    assert run.summary["plan"] is None and PLAN_LINE not in run.proc.stdout  # the planner plans the relay
    _close(run.losses, quick_ref.losses, rel=1e-5)
    _same_tensors(run.tensors, quick_ref.tensors, rel=1e-5)


# ------------------------------------------------------------------ --plan

@pytest.mark.parametrize("mode", ["auto", "calibrated", "quick", "off"])
def test_plan_mode(tmp_path, quick_ref, explicit_defaults, mode):
    run = _mode_run(tmp_path, explicit_defaults, "plan", mode)
    assert run.losses == quick_ref.losses  # the planner's calibration steps leave the run alone
    if mode == "off":
        assert PLAN_LINE not in run.proc.stdout and " predicted" not in run.proc.stdout, run.proc.stdout
        assert run.summary["plan"] is None
        return
    _planned(run)
    plan_line = next(l for l in run.stdout_lines if l.startswith(PLAN_LINE))
    if mode == "quick":
        assert plan_line.startswith("l2l: plan (uncalibrated)") and run.summary["plan"]["plan_calibrated"] is False
    if mode == "calibrated":
        assert plan_line.startswith("l2l: plan (calibrated)") and run.summary["plan"]["plan_calibrated"] is True


# ------------------------------------------------------------------ --resume

@pytest.mark.parametrize("flags, fixture", [
    pytest.param([], "one_device", id="l2l"),
    pytest.param(["--devices", "2"], "two_devices", id="l2l-devices-2"),
    pytest.param(["--engine", "plain"], "plain_full", id="plain"),
])
def test_resume_equals_uninterrupted(request, tmp_path, flags, fixture):
    """Train 2 steps (a checkpoint at 2), resume to 4: per-step losses and final state
    bit-identical to the uninterrupted 4-step run."""
    whole = request.getfixturevalue(fixture)
    out = tmp_path / "run"
    _trained(_train(out, *LONG, *flags, "--steps", "2"), 2)
    resumed = _trained(_train(out, *LONG, *flags, "--steps", str(STEPS), "--resume"), STEPS)
    assert any(l.startswith("l2l: resumed from ") and "at step 2" in l for l in resumed.stdout_lines), \
        resumed.proc.stdout
    assert resumed.losses == whole.losses
    _same_tensors(resumed.tensors, whole.tensors, exact=True)
