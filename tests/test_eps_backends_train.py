"""Training with the OpenCL or HLS C-sim EPS is training with the NumPy EPS, bit for bit."""
from __future__ import annotations

import json

import numpy as np
import pyopencl as cl
import pytest

from l2l.checkpoint import load_latest
from l2l.eps import OptimizerHyper, HlsCsimBackend, NumpyBackend, OpenCLBackend, StepScalars
from l2l.eps.numerics import COPY_DTYPES
from l2l.eps.opencl_backend import BUILD_OPTIONS, kernel_source
from l2l.errors import UserError
from l2l.metrics import read_metrics
from l2l.models import ModelConfig

from conftest import ROOT, relay, run_cli, run_python, sampler_for
from shared_runs import cli_once

TINY = ["--layers", "2", "--d-model", "32", "--heads", "2", "--seq-len", "32", "--batch-size", "8",
        "--micro-batches", "2", "--eval-batches", "1", "--no-progress", "--eval-every", "0"]


@pytest.fixture(scope="module")
def numpy_run(tmp_path_factory):
    """The NumPy EPS's 6-step run of TINY, the reference every other backend's run must equal
    (made once for the session)."""
    ref, r = cli_once(tmp_path_factory, "eps_backends_train-numpy",
                      lambda out: run_cli("train", *TINY, "--steps", "6", "--eps", "numpy", "--out", str(out)))
    assert r.returncode == 0, r.stderr
    return ref


@pytest.fixture(scope="module")
def program_binary(tmp_path_factory):
    """``l2l opencl-binary``'s program, built once for the tests that load or damage it."""
    binary, r = cli_once(tmp_path_factory, "eps_backends_train-binary",
                         lambda out: run_cli("opencl-binary", "--out", str(out)), leaf="eps.bin")
    assert r.returncode == 0 and binary.stat().st_size > 0, r.stderr
    return binary


@pytest.mark.parametrize("backend", [OpenCLBackend, HlsCsimBackend])
@pytest.mark.parametrize("family", ["gpt", "hf-bert"])
def test_per_step_losses_and_weights_are_identical(corpus, family, backend):
    cfg = ModelConfig(family=family, layers=2, d_model=32, heads=2, seq_len=32, dropout=0.1)
    hyper = OptimizerHyper(lr=2e-3)
    sampler = sampler_for(corpus, cfg, batch_size=8)
    a = relay(cfg, hyper, micro_batches=4, backend=NumpyBackend())
    b = relay(cfg, hyper, micro_batches=4, backend=backend())
    for step in range(8):
        batch = sampler.batch(step)
        assert a.train_step(batch, step).loss == b.train_step(batch, step).loss
    for wa, wb in zip(a.master_weights(), b.master_weights()):
        assert np.array_equal(wa.view(np.uint32), wb.view(np.uint32))


@pytest.mark.parametrize("eps", ["opencl", "hls-csim"])
def test_checkpoints_cross_between_backends(tmp_path, eps, numpy_run):
    ref, mixed = numpy_run, tmp_path / "mixed"
    assert run_cli("train", *TINY, "--steps", "3", "--out", str(mixed), "--eps", eps,
                   "--schedule-steps", "6").returncode == 0
    r = run_cli("train", *TINY, "--steps", "6", "--out", str(mixed), "--resume")
    assert r.returncode == 0, r.stderr
    assert [x["loss"] for x in read_metrics(ref / "metrics.jsonl")] == \
           [x["loss"] for x in read_metrics(mixed / "metrics.jsonl")]
    want, got = load_latest(ref).tensors, load_latest(mixed).tensors
    assert want.keys() == got.keys() and all(np.array_equal(want[k], got[k]) for k in want)


def test_opencl_run_is_the_numpy_run_without_a_copy(tmp_path, numpy_run):
    """``l2l train --eps opencl`` on the CPU is the NumPy run's 6 steps, bit for bit (every loss,
    the final checkpoint), and like the NumPy EPS it keeps no fp32 copy beside its masters
    (the server's copy_bytes in summary.json), with nothing said about the runtime."""
    run = tmp_path / "opencl"
    r = run_cli("train", *TINY, "--steps", "6", "--out", str(run), "--eps", "opencl", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert "RuntimeWarning" not in r.stderr, r.stderr
    assert [x["loss"] for x in read_metrics(numpy_run / "metrics.jsonl")] == \
           [x["loss"] for x in read_metrics(run / "metrics.jsonl")]
    want, got = load_latest(numpy_run).tensors, load_latest(run).tensors
    assert want.keys() == got.keys() and all(np.array_equal(want[k], got[k]) for k in want)
    for out in (numpy_run, run):
        assert json.loads((out / "summary.json").read_text())["eps_copy_bytes"] == 0, out


def test_bad_binary_is_one_line_exit_2(tmp_path):
    junk = tmp_path / "eps.xclbin"
    junk.write_bytes(b"not a program")
    r = run_cli("train", *TINY, "--steps", "1", "--out", str(tmp_path / "run"), "--eps", "opencl",
                "--cl-binary", str(junk))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--cl-binary" in r.stderr, r.stderr
    assert not (tmp_path / "run").exists()
    r = run_cli("train", *TINY, "--steps", "1", "--out", str(tmp_path / "run2"), "--cl-device", "0")
    assert r.returncode == 2 and "choose the device of --eps opencl" in r.stderr


def test_program_binary_through_the_cli_trains_identically(tmp_path, numpy_run, program_binary):
    """The first 3 steps of the NumPy run's 6-step schedule, with the loaded binary."""
    loaded = tmp_path / "loaded"
    r = run_cli("train", *TINY, "--steps", "3", "--schedule-steps", "6", "--out", str(loaded), "--eps", "opencl",
                "--cl-binary", str(program_binary))
    assert r.returncode == 0, r.stderr
    assert [x["loss"] for x in read_metrics(numpy_run / "metrics.jsonl")][:3] == \
           [x["loss"] for x in read_metrics(loaded / "metrics.jsonl")]


def test_damaged_binary_is_refused_not_a_crash(tmp_path, program_binary):
    """PoCL aborts inside clBuildProgram on a truncated binary; the backend probes it first."""
    truncated = tmp_path / "truncated.bin"
    truncated.write_bytes(program_binary.read_bytes()[:2000])
    r = run_cli("train", *TINY, "--steps", "1", "--out", str(tmp_path / "run"), "--eps", "opencl",
                "--cl-binary", str(truncated))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "damaged" in r.stderr, r.stderr


def test_no_platform_is_one_line_naming_what_to_install(tmp_path):
    """No OpenCL platform listed (tests/opencl_standin_l2l.py hides them all)."""
    standin = str(ROOT / "tests" / "opencl_standin_l2l.py")
    r = run_python(standin, "none", "train", *TINY, "--steps", "1", "--out", str(tmp_path / "run"), "--eps", "opencl")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "no OpenCL platform" in r.stderr and "pocl-opencl-icd" in r.stderr
    info = run_python(standin, "none", "info")
    assert info.returncode == 0 and any(line.startswith("eps opencl") and "unavailable" in line
                                        for line in info.stdout.splitlines())


@pytest.mark.parametrize("vector_width", [8, 16])
@pytest.mark.parametrize("launch", ["task", "vectors", "chunks"])
def test_every_launch_shape_gives_the_same_bits(launch, vector_width):
    """The kernels cut their vectors into chunks by the global size: FPGA kernels run as tasks
    (one work-item looping over n), GPUs a work-item per vector, CPUs a few long chunks; and
    the vectors are float8 or float16. The same source, launched and built each way, agrees
    with the golden model; at 140,013 elements the default chunks shape cuts both the update
    and the check into several chunks."""
    rng = np.random.default_rng(5)
    backend, ref = OpenCLBackend(launch=launch, vector_width=vector_width), NumpyBackend()
    assert set(backend._shape.values()) == {launch} and backend.vector_width == vector_width
    for layer, n in enumerate((1, 9, 17, 1000, 4099, 140_013)):
        p = rng.standard_normal(n).astype(np.float32)
        backend.allocate(layer, p)
        ref.allocate(layer, p)
        for t in range(1, 4):
            grads = rng.standard_normal((2, n)).astype(np.float32)
            s = StepScalars.compute(OptimizerHyper(), t, divisor=2.0)
            a, b = np.empty(n, np.float32), np.empty(n, np.float32)
            assert backend.step(layer, grads, s, a) and ref.step(layer, grads, s, b)
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
        for x, y in zip(backend.read_state(layer), ref.read_state(layer)):
            assert np.array_equal(x.view(np.uint32), y.view(np.uint32))
    if launch == "chunks":
        assert backend.launch_shape("eps_update_f32_f32", 140_013)[0] >= 4
        assert backend.launch_shape("eps_check_f32", 140_013)[0] >= 2


def test_launch_shape_by_device_and_kernel():
    """Source kernels on a CPU device run as chunks (an NDRange), float16 where the device
    prefers that width; an unknown shape or width is refused."""
    backend = OpenCLBackend()
    assert set(backend._shape.values()) == {"chunks"}
    assert backend.vector_width == (16 if backend.device.preferred_vector_width_float >= 16 else 8)
    with pytest.raises(ValueError, match="launch must be one of"):
        OpenCLBackend(launch="ndrange")
    with pytest.raises(ValueError, match="vector_width must be one of"):
        OpenCLBackend(vector_width=4)


def _binary_of(tmp_path, source: str, name: str):
    backend = OpenCLBackend()
    program = cl.Program(backend.context, source).build()
    path = tmp_path / name
    path.write_bytes(program.get_info(cl.program_info.BINARIES)[0])
    return path


def test_loaded_binary_must_expose_the_eps_kernels(tmp_path):
    wrong = _binary_of(tmp_path, "__kernel void eps_check_f32(__global float *g) {}", "wrong.bin")
    with pytest.raises(UserError, match="eps_check_f32 takes 1 arguments, expected 5"):
        OpenCLBackend(binary=str(wrong))
    other = _binary_of(tmp_path, "__kernel void saxpy(__global float *x) {}", "other.bin")
    with pytest.raises(UserError, match="no EPS kernels"):
        OpenCLBackend(binary=str(other))


def test_a_kernel_missing_from_the_binary_is_named(tmp_path):
    source = kernel_source().replace("EPS_COPY(bf16, ushort)", "")  # a binary built without one kernel
    backend = OpenCLBackend()
    path = tmp_path / "partial.bin"
    path.write_bytes(cl.Program(backend.context, source).build(options=BUILD_OPTIONS)
                     .get_info(cl.program_info.BINARIES)[0])
    partial = OpenCLBackend(binary=str(path))
    partial.allocate(0, np.ones(10, np.float32))
    partial.write_copy(0, np.empty(10, np.float32))  # present: fine
    with pytest.raises(UserError, match="no kernel eps_copy_bf16"):
        partial.write_copy(0, np.empty(10, COPY_DTYPES["bf16"]))
