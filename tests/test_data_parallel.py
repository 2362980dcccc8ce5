"""Data-parallel L2L: K workers feeding one EPS in a box, and machines under torchrun."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import replace

import numpy as np
import pytest
import torch

from l2l.config import TrainConfig
from l2l.data import BatchSampler
from l2l.metrics import read_metrics
from l2l.models import build_stack, family
from l2l.build import build_engine

from conftest import ROOT, run_cli, run_torchrun

CFG = TrainConfig(layers=3, d_model=64, heads=4, seq_len=32, batch_size=8, micro_batches=4,
                  dropout=0.1, progress=False)
TINY = ["--layers", "2", "--d-model", "32", "--heads", "2", "--seq-len", "32", "--batch-size", "8",
        "--micro-batches", "4", "--eval-every", "0", "--eval-batches", "1", "--no-plot"]


def _losses(corpus, cfg: TrainConfig, steps: int = 4):
    sampler = BatchSampler(corpus.train, cfg.seq_len, cfg.batch_size, family(cfg.model).objective, seed=0)
    engine = build_engine(cfg.check(), build_stack(cfg.model_config(), cfg.seed), torch.device("cpu"))
    try:
        return [engine.train_step(sampler.batch(i), i).loss for i in range(steps)], engine.master_weights()
    finally:
        engine.close()


@pytest.mark.parametrize("eps", ["numpy", "opencl", "hls-csim"])
def test_two_devices_match_one(corpus, eps):
    """--devices 2 on the same global batch: per-step losses within 1e-6 relative (dropout on:
    each global micro-batch keeps its seed whichever worker runs it)."""
    one, w1 = _losses(corpus, replace(CFG, eps=eps))
    two, w2 = _losses(corpus, replace(CFG, eps=eps, devices=2))
    for a, b in zip(one, two):
        assert abs(a - b) <= 1e-6 * abs(a), (one, two)
    for a, b in zip(w1, w2):
        # Adam turns last-bit gradient differences (another summation order) into ~lr-sized steps
        # where a gradient is near zero; the weights agree to a small fraction of lr
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    assert one[-1] < one[0]


def test_strict_mode_with_workers(corpus):
    one, _ = _losses(corpus, replace(CFG, overflow="strict", clip_grad_norm=0.5))
    two, _ = _losses(corpus, replace(CFG, overflow="strict", clip_grad_norm=0.5, devices=2))
    for a, b in zip(one, two):
        assert abs(a - b) <= 1e-6 * abs(a), (one, two)


def test_extra_workers_allocate_no_weights():
    """--devices 4 of a model built with its weights in torch (hf-gpt2): building the engine
    around the stack allocates no parameter storage for workers 1..3 (a worker's weights
    come from the EPS), where it used to build and initialise three more whole models. Their
    stacks are the first one's shapes: every parameter a meta placeholder, a tied one still
    one, the same buffers."""
    cfg = replace(CFG, model="hf-gpt2", devices=4, dropout=0.0).check()
    stack = build_stack(cfg.model_config(), cfg.seed)
    allocated = []

    def count(module, name, param):
        if param is not None and not param.is_meta:
            allocated.append(param.untyped_storage().nbytes())

    hook = torch.nn.modules.module.register_module_parameter_registration_hook(count)
    try:
        engine = build_engine(cfg, stack, torch.device("cpu"))
    finally:
        hook.remove()
    try:
        assert sum(allocated) == 0, f"{len(allocated)} parameters, {sum(allocated)} bytes"
        first, *others = [w.stack for w in engine.workers]
        assert len(others) == 3 and all(s is not first for s in others)
        for other in others:
            assert other.signature() == first.signature()
            for a, b in zip(first.layers, other.layers):
                assert a.module is not b.module
                assert all(p.is_meta for p in b.module.parameters())
                for (na, ba), (nb, bb) in zip(a.module.named_buffers(), b.module.named_buffers()):
                    assert na == nb and torch.equal(ba, bb)
    finally:
        engine.close()


def test_devices_must_divide_the_micro_batches(tmp_path):
    r = run_cli("train", "--devices", "3", "--out", str(tmp_path / "r"))
    assert r.returncode == 2 and "--devices 3" in r.stderr and "Traceback" not in r.stderr


# ----------------------------------------------------------------- machines

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "host"), **extra}


def _rank(rank: int, port: int, args: list[str], kill_at_step: int | None = None) -> subprocess.Popen:
    env = _env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), L2L_DIST_TIMEOUT="20")
    l2l = ["-m", "l2l"] if kill_at_step is None else [str(ROOT / "tests" / "faulty_l2l.py"), "kill-at-step",
                                                      str(kill_at_step)]
    return subprocess.Popen([sys.executable, *l2l, "train", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_torchrun_two_machines_match_one_process(tmp_path):
    args = [*TINY, "--steps", "6", "--check-every", "3", "--no-progress"]
    r = run_torchrun("--nproc-per-node", "2", "--master-port", str(_free_port()), "-m", "l2l",
                     "train", *args, "--out", str(tmp_path / "two"), env=_env())
    assert r.returncode == 0, r.stderr[-3000:]
    assert run_cli("train", *args, "--out", str(tmp_path / "one")).returncode == 0
    one = [m["loss"] for m in read_metrics(tmp_path / "one" / "metrics.jsonl")]
    two = [m["loss"] for m in read_metrics(tmp_path / "two" / "metrics.jsonl")]
    assert len(one) == len(two) == 6
    for a, b in zip(one, two):
        assert abs(a - b) <= 1e-6 * abs(a), (one, two)
    digests = json.loads((tmp_path / "two" / "summary.json").read_text())["machines_weights_sha256"]
    assert len(digests) == 1  # the EPS is sharded (the default): one digest of the global masters


def test_replicated_eps_layout_keeps_a_whole_eps_per_machine(tmp_path):
    """--eps-layout replicated: each rank holds the whole EPS and all-reduces; the ranks'
    digests agree, and the run matches one process within 1e-6 (the cross-machine sum's
    order is gloo's there)."""
    args = [*TINY, "--steps", "3", "--no-progress"]
    r = run_torchrun("--nproc-per-node", "2", "--master-port", str(_free_port()), "-m", "l2l",
                     "train", *args, "--eps-layout", "replicated", "--out", str(tmp_path / "replicated"), env=_env())
    assert r.returncode == 0, r.stderr[-3000:]
    assert run_cli("train", *args, "--out", str(tmp_path / "one")).returncode == 0
    digests = json.loads((tmp_path / "replicated" / "summary.json").read_text())["machines_weights_sha256"]
    assert len(digests) == 2 and digests[0] == digests[1]  # both ranks hold the same master weights
    rep, one = ([m["loss"] for m in read_metrics(tmp_path / d / "metrics.jsonl")] for d in ("replicated", "one"))
    for a, b in zip(rep, one):
        assert abs(a - b) <= 1e-6 * abs(a), (rep, one)


def test_a_dead_machine_stops_the_other_and_resume_continues(tmp_path):
    out = tmp_path / "run"
    args = [*TINY, "--steps", "8", "--save-every", "2", "--no-progress", "--out", str(out)]
    port = _free_port()
    survivor = _rank(0, port, args)
    victim = _rank(1, port, args, kill_at_step=5)  # SIGKILLed as step 6 starts
    assert victim.wait(timeout=120) == -9
    start = time.monotonic()
    _, err = survivor.communicate(timeout=90)
    assert survivor.returncode == 1 and time.monotonic() - start < 60, err
    lines = [l for l in err.strip().splitlines() if l]
    assert len(lines) == 1 and "rank 0 of 2" in lines[0] and "--resume" in lines[0], err
    # the last checkpoint is step 4; both machines resume and finish the run
    port = _free_port()
    ranks = [_rank(r, port, [*args, "--resume"]) for r in (0, 1)]
    for p in ranks:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
    steps = [m["step"] for m in read_metrics(out / "metrics.jsonl")]
    assert steps[-1] == 8 and steps == sorted(set(steps))


def test_bench_workers_reports_each_worker_count(tmp_path):
    r = run_cli("bench", "workers", "--layers", "2", "--d-model", "32", "--heads", "2", "--seq-len", "16",
                "--batch-size", "8", "--micro-batches", "4", "--workers", "1", "2", "--steps", "2", "--warmup", "1",
                "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads((tmp_path / "bench_workers.json").read_text())["rows"]
    assert [row["workers"] for row in rows] == [1, 2]
    assert rows[0]["speedup"] == 1.0 and all(0 <= row["eps_busy_share"] < 1 for row in rows)


def test_checkpoint_of_two_machines_resumes_in_one_process(tmp_path):
    """Rank 0 writes the global state, so a run started on two machines continues on one:
    the resumed steps match the same run done in one process throughout, within 1e-6."""
    out, ref = tmp_path / "run", tmp_path / "ref"
    args = [*TINY, "--no-progress", "--save-every", "3"]
    port = _free_port()
    ranks = [_rank(r, port, [*args, "--steps", "3", "--schedule-steps", "6", "--out", str(out)]) for r in (0, 1)]
    for p in ranks:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
    r = run_cli("train", *args, "--steps", "6", "--out", str(out), "--resume")
    assert r.returncode == 0, r.stderr
    assert run_cli("train", *args, "--steps", "6", "--out", str(ref)).returncode == 0
    got = [m["loss"] for m in read_metrics(out / "metrics.jsonl")]
    want = [m["loss"] for m in read_metrics(ref / "metrics.jsonl")]
    assert len(got) == len(want) == 6
    for a, b in zip(got, want):
        assert abs(a - b) <= 1e-6 * abs(b), (got, want)
