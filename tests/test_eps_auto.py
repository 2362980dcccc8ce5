"""``--eps auto``, the default: the fastest EPS on the host's CPU, never the GPU.

A GPU box with its vendor's OpenCL driver lists the GPU before PoCL's CPU device; here a
stand-in GPU is listed first (tests/opencl_standin_l2l.py runs ``l2l`` with it). Auto and an
unnamed ``--eps opencl`` must take the CPU device; the GPU runs the EPS only when named; with no
OpenCL CPU device auto takes the NumPy EPS on every core. Each run says what it took in its
first lines and summary.json, and every choice trains to the same bits.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from l2l.errors import UserError
from l2l.eps import choice as eps_choice
from l2l.eps import NumpyBackend, opencl_backend
from l2l.metrics import read_metrics

from conftest import ROOT, run_cli, run_python
from shared_runs import cli_once

STANDIN = str(ROOT / "tests" / "opencl_standin_l2l.py")
TINY = ["--layers", "2", "--d-model", "32", "--heads", "2", "--seq-len", "32", "--batch-size", "8",
        "--micro-batches", "2", "--eval-batches", "1", "--eval-every", "0", "--steps", "3", "--no-plot",
        "--plan", "off"]


def standin(*args: str, listing: str = "gpu-first"):
    """``l2l ARGS`` with the stand-in GPU listed first (or with no OpenCL platform: ``none``)."""
    return run_python(STANDIN, listing, *args)


@pytest.fixture(scope="module")
def auto_run(tmp_path_factory):
    """The default run (no --eps) on the host with the stand-in GPU listed first."""
    out, r = cli_once(tmp_path_factory, "eps_auto-standin", lambda out: standin("train", *TINY, "--out", str(out)))
    assert r.returncode == 0, r.stderr
    return out, r


def _summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def _losses(out: Path) -> list[float]:
    return [x["loss"] for x in read_metrics(out / "metrics.jsonl")] + [_summary(out)["final_val_loss"]]


def test_auto_takes_the_cpu_device_not_the_gpu_listed_first(auto_run):
    out, r = auto_run
    eps = _summary(out)["eps"]
    assert eps["asked"] == "auto" and eps["backend"] == "opencl", eps
    assert not eps["runs_on"].startswith("Stand-in GPU"), eps
    line = next(x for x in r.stdout.splitlines() if x.startswith("l2l: EPS "))
    assert line.startswith(f"l2l: EPS opencl on {eps['runs_on']}") and "--eps auto" in line, line


def test_info_says_what_auto_takes():
    r = standin("info")
    line = next(x for x in r.stdout.splitlines() if x.startswith("eps auto"))
    assert "takes opencl on" in line and "Stand-in" not in line, line


def test_unnamed_opencl_takes_the_cpu_and_a_named_gpu_runs_with_the_same_bits(auto_run, tmp_path):
    unnamed = standin("train", *TINY, "--eps", "opencl", "--out", str(tmp_path / "unnamed"))
    assert unnamed.returncode == 0, unnamed.stderr
    assert not _summary(tmp_path / "unnamed")["eps"]["runs_on"].startswith("Stand-in GPU")
    named = standin("train", *TINY, "--eps", "opencl", "--cl-device", "stand-in gpu", "--out", str(tmp_path / "gpu"))
    assert named.returncode == 0, named.stderr
    assert _summary(tmp_path / "gpu")["eps"]["runs_on"].startswith("Stand-in GPU (Stand-in GPU platform)")
    assert _losses(tmp_path / "gpu") == _losses(tmp_path / "unnamed") == _losses(auto_run[0])


def test_without_an_opencl_cpu_device_auto_takes_numpy_on_every_core(auto_run, tmp_path):
    r = standin("train", *TINY, "--out", str(tmp_path / "run"), listing="none")
    assert r.returncode == 0, r.stderr
    eps = _summary(tmp_path / "run")["eps"]
    cpus = len(os.sched_getaffinity(0))
    assert eps["backend"] == "numpy" and eps["runs_on"] == f"{cpus} CPU thread{'s' if cpus > 1 else ''}", eps
    assert "no OpenCL platform" in eps["why"], eps
    assert _losses(tmp_path / "run") == _losses(auto_run[0])
    assert "on a GPU the EPS" not in r.stdout  # the advice is for a GPU's run only


def test_a_gpu_run_on_the_numpy_eps_auto_fell_back_to_is_told_to_install_opencl():
    """On a GPU the EPS sets the pace (docs/results.md "On a GPU": 5% against 40% MFU): a run
    that auto left on the NumPy EPS says how to get the OpenCL one; nothing else does."""
    fell_back = eps_choice.EpsChoice("auto", "numpy", why="pyopencl is not installed")
    advice = fell_back.gpu_advice("cuda")
    assert advice and "pip install 'l2l[opencl]'" in advice and "\n" not in advice
    assert fell_back.gpu_advice("cpu") is None
    assert eps_choice.EpsChoice("auto", "opencl").gpu_advice("cuda") is None
    assert eps_choice.EpsChoice("numpy", "numpy").gpu_advice("cuda") is None  # named: the user's choice


def test_eps_threads_sets_the_cpu_eps_threads(tmp_path):
    r = run_cli("train", *TINY, "--eps-threads", "1", "--out", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr
    assert _summary(tmp_path / "run")["eps"]["runs_on"].endswith(", 1 compute unit")
    for bad, says in ((["--eps-threads", "0"], "at least 1"), (["--eps", "hls-csim", "--eps-threads", "2"],
                                                                "applies to --eps auto, numpy or opencl")):
        r = run_cli("train", *TINY, *bad, "--out", str(tmp_path / "bad"))
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and says in r.stderr, r.stderr


def test_auto_takes_opencl_for_lion_and_numpy_for_an_optimizer_opencl_does_not_run(monkeypatch):
    """The OpenCL EPS runs Lion (eps_lion_*) and LAMB (eps_lamb_*): auto takes it for
    --optimizer lion and lamb as for AdamW. For an optimizer it did not run, auto would leave
    it for the NumPy EPS and say why."""
    found, what = eps_choice.cpu_device()
    assert found is not None, f"make setup-test installs an OpenCL CPU platform: {what}"
    for optimizer in ("adamw", "lion", "lamb"):
        chosen = eps_choice.choose("auto", optimizer=optimizer)
        assert chosen.name == "opencl", (optimizer, chosen)
    monkeypatch.setattr(opencl_backend.OpenCLBackend, "optimizers", frozenset({"adamw"}))
    chosen = eps_choice.choose("auto", optimizer="lion")
    assert chosen.name == "numpy" and "the OpenCL EPS does not run lion" in chosen.why, chosen
    chosen = eps_choice.choose("auto", optimizer="lamb")
    assert chosen.name == "numpy" and "the OpenCL EPS does not run lamb" in chosen.why, chosen
    assert eps_choice.choose("auto", optimizer="adamw").name == "opencl"


@pytest.mark.parametrize("optimizer", ["lion", "lamb"])
def test_train_under_auto_runs_on_opencl(tmp_path, optimizer):
    r = run_cli("train", *TINY, "--optimizer", optimizer, "--out", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr
    eps = _summary(tmp_path / "run")["eps"]
    assert eps["asked"] == "auto" and eps["backend"] == "opencl", eps


class _Device:
    def __init__(self, name: str, kind: int) -> None:
        self.name, self.type = name, kind


class _Platform:
    def __init__(self, name: str, devices: list) -> None:
        self.name, self._devices = name, devices

    def get_devices(self):
        return self._devices


def test_opencl_device_rule(monkeypatch):
    """Unnamed: a CPU device, or with a binary an accelerator; a GPU only when named."""
    cl = opencl_backend._cl()
    t = cl.device_type
    gpu, cpu, fpga = _Device("Vendor GPU", t.GPU), _Device("Host CPU", t.CPU), _Device("FPGA card", t.ACCELERATOR)
    monkeypatch.setattr(cl, "get_platforms", lambda: [_Platform("gpu", [gpu]), _Platform("fpga", [fpga]),
                                                      _Platform("cpu", [cpu])])
    assert opencl_backend.choose_device()[1] is cpu
    assert opencl_backend.choose_device(binary=True)[1] is fpga
    assert opencl_backend.choose_device(device="vendor")[1] is gpu
    assert opencl_backend.cpu_device()[0] == (2, 0)
    monkeypatch.setattr(cl, "get_platforms", lambda: [_Platform("gpu", [gpu])])
    with pytest.raises(UserError, match="only when named"):
        opencl_backend.choose_device()
    assert opencl_backend.cpu_device()[0] is None


def test_auto_falls_back_to_numpy_when_the_opencl_eps_does_not_start(monkeypatch):
    made = []

    def make_backend(name, **options):
        if name == "opencl":
            raise RuntimeError("building eps.cl failed:\nsome compiler log")
        made.append(name)
        return NumpyBackend(**options)
    monkeypatch.setattr(eps_choice, "make_backend", make_backend)
    asked = eps_choice.EpsChoice("auto", "opencl", {"platform": "0", "device": "0", "threads": None}, "listed")
    backend, chosen = eps_choice.build(asked)
    try:
        assert made == ["numpy"] and chosen.name == "numpy"
        assert "did not start (building eps.cl failed:)" in chosen.why
    finally:
        backend.close()
    with pytest.raises(RuntimeError):  # a backend named by --eps fails with its own error
        eps_choice.build(eps_choice.EpsChoice("opencl", "opencl", {}))


def _cpu_platforms() -> list[int]:
    """Indices of the OpenCL platforms with a CPU device (the system's PoCL, the opencl extra's)."""
    try:
        cl = opencl_backend._cl()
        return [i for i, p in enumerate(cl.get_platforms())
                if any(d.type & cl.device_type.CPU for d in p.get_devices())]
    except Exception:  # noqa: BLE001 -- none listed: the test below says so
        return []


@pytest.mark.parametrize("platform", _cpu_platforms() or [None])
def test_every_opencl_cpu_platform_here_gives_the_numpy_bits(platform):
    """Whichever CPU platform auto finds first (Debian's PoCL, PyPI's pocl-binary-distribution),
    the EPS's bits are NumPy's: three steps of a layer of several chunks, fp32 and bf16 copies.
    Each in a process of its own, as a run uses one: two PoCLs, each with its own LLVM,
    building and running kernels in one process have crashed it."""
    assert platform is not None, "no OpenCL CPU platform: make setup installs one"
    r = run_python("-c", f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
                   f"import test_eps_auto; test_eps_auto.same_bits_on({platform})", fresh=True)
    assert r.returncode == 0, r.stderr[-3000:]


def same_bits_on(platform: int) -> None:
    import numpy as np
    from l2l.eps import OptimizerHyper, OpenCLBackend, StepScalars
    from l2l.eps.numerics import COPY_DTYPES
    rng = np.random.default_rng(platform)
    n = 70_001
    p0 = rng.standard_normal(n, dtype=np.float32)
    cl_be, ref = OpenCLBackend(platform=str(platform), min_chunk=64), NumpyBackend(threads=1)
    try:
        for be in (cl_be, ref):
            be.allocate(0, p0)
        for t, dtype in zip((1, 2, 3), ("fp32", "bf16", "fp32")):
            g = (rng.standard_normal((2, n), dtype=np.float32) * np.float32(1e-3))
            s = StepScalars.compute(OptimizerHyper(), t, loss_scale=4.0)
            copies = [np.empty(n, COPY_DTYPES[dtype]) for _ in range(2)]
            assert cl_be.step(0, g, s, copies[0]) and ref.step(0, g, s, copies[1])
            assert copies[0].view(np.uint8).tobytes() == copies[1].view(np.uint8).tobytes(), (platform, t)
        for a, b in zip(cl_be.read_state(0), ref.read_state(0)):
            assert a.view(np.uint32).tobytes() == b.view(np.uint32).tobytes()
    finally:
        cl_be.close()
