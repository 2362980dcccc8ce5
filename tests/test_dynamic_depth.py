"""Dynamic depth: a step runs a subset of the blocks (``--layer-drop``, or a depth policy).

The relay must train what the in-memory baseline trains when both leave out the same
blocks (torch's AdamW skips a parameter without a gradient), leave a skipped block's EPS
state bit for bit as it was, resume to the same bits, and hold no more device memory than
a full-depth step -- measured, not only booked.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from l2l.checkpoint import load_latest
from l2l.config import TrainConfig
from l2l.depth import LayerDrop, blocks_left_out
from l2l.eps import OptimizerHyper
from l2l.errors import UserError
from l2l.metrics import read_metrics
from l2l.models import ModelConfig
from l2l.relay.audit import audited
from l2l.train import train

from conftest import CPU, plain, relay, run_cli, sampler_for
from shared_runs import cli_once

HYPER = OptimizerHyper(lr=5e-4, weight_decay=0.01, beta2=0.99)  # as test_relay_equivalence.py, and why
BLOCKS = 4
TINY = ["--layers", str(BLOCKS), "--d-model", "32", "--heads", "2", "--seq-len", "32", "--batch-size", "8",
        "--micro-batches", "4", "--eval-batches", "1", "--warmup-steps", "2", "--lr", "5e-4",
        "--no-progress", "--no-plot"]
DROP = 0.2
STEPS = 20


def _train(out, *extra):
    return run_cli("train", *TINY, "--out", str(out), "--layer-drop", str(DROP), *extra)


@pytest.fixture(scope="module")
def dropped_run(tmp_path_factory):
    """20 steps of --layer-drop 0.2 through the command line, the relay, a checkpoint at 10 and 20."""
    out, r = cli_once(tmp_path_factory, "depth-l2l", lambda out: _train(out, "--steps", str(STEPS),
                                                                         "--save-every", "10"))
    assert r.returncode == 0, r.stderr
    return out


def test_layer_drop_on_the_command_line_equals_the_baseline_step_by_step(dropped_run, tmp_path):
    base = tmp_path / "plain"
    r = _train(base, "--steps", str(STEPS), "--engine", "plain")
    assert r.returncode == 0, r.stderr
    relayed, baseline = read_metrics(dropped_run / "metrics.jsonl"), read_metrics(base / "metrics.jsonl")
    draw = LayerDrop(DROP, BLOCKS, seed=0)
    for a, b in zip(relayed, baseline, strict=True):
        assert a["skipped_blocks"] == b["skipped_blocks"] == sorted(draw(a["step"] - 1))
        assert abs(a["loss"] - b["loss"]) <= 1e-5, (a["step"], a["loss"], b["loss"])
    skipped = [len(a["skipped_blocks"]) for a in relayed]
    assert sum(skipped) > 0 and min(skipped) < BLOCKS  # the draws left blocks out, and not every one
    wa = load_latest(dropped_run).tensors
    wb = load_latest(base).tensors
    for key in wa:
        if key.endswith(".p"):
            np.testing.assert_allclose(wa[key], wb[key], rtol=0, atol=1e-5)


def test_resume_mid_run_repeats_the_draws_and_the_bits(dropped_run, tmp_path):
    out = tmp_path / "resumed"
    assert _train(out, "--steps", "10", "--schedule-steps", str(STEPS)).returncode == 0
    r = _train(out, "--steps", str(STEPS), "--resume")
    assert r.returncode == 0, r.stderr
    whole, halves = read_metrics(dropped_run / "metrics.jsonl"), read_metrics(out / "metrics.jsonl")
    assert [(m["skipped_blocks"], m["loss"]) for m in halves] == [(m["skipped_blocks"], m["loss"]) for m in whole]
    a, b = load_latest(dropped_run), load_latest(out)
    assert a.step == b.step == STEPS
    for key in a.tensors:
        assert np.array_equal(a.tensors[key], b.tensors[key]), key


def test_two_devices_leave_out_the_same_blocks(dropped_run, tmp_path):
    out = tmp_path / "two"
    r = _train(out, "--steps", "6", "--schedule-steps", str(STEPS), "--devices", "2")
    assert r.returncode == 0, r.stderr
    one = read_metrics(dropped_run / "metrics.jsonl")[:6]
    for a, b in zip(read_metrics(out / "metrics.jsonl"), one, strict=True):
        assert a["skipped_blocks"] == b["skipped_blocks"]
        assert abs(a["loss"] - b["loss"]) <= 1e-6


def test_the_disk_tier_reads_ahead_past_the_blocks_left_out(dropped_run, tmp_path):
    """--eps-offload reads entries ahead of their updates in the route's order: a left-out
    block is not on the route, and the bits are the in-memory run's."""
    out = tmp_path / "disk"
    r = _train(out, "--steps", "6", "--schedule-steps", str(STEPS), "--eps-offload", str(tmp_path / "eps"),
               "--eps-offload-copies")
    assert r.returncode == 0, r.stderr
    one = read_metrics(dropped_run / "metrics.jsonl")[:6]
    assert [(m["skipped_blocks"], m["loss"]) for m in read_metrics(out / "metrics.jsonl")] == \
        [(m["skipped_blocks"], m["loss"]) for m in one]


@pytest.mark.parametrize("value", ["1", "-0.1", "1.5"])
def test_a_layer_drop_outside_0_1_is_one_line(tmp_path, value):
    r = run_cli("train", "--out", str(tmp_path / "run"), "--layer-drop", value)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "--layer-drop must be in [0, 1)" in r.stderr
    assert not (tmp_path / "run").exists()


def _blocks_state(engine, block: int) -> dict[str, np.ndarray]:
    tensors = engine.state_tensors()
    return {k: v.copy() for k, v in tensors.items() if k.startswith(f"layer{block + 1}.")}


def test_a_skipped_block_keeps_its_eps_state_bit_for_bit(corpus):
    cfg = ModelConfig(layers=3, d_model=32, heads=2, seq_len=32)
    sampler = sampler_for(corpus, cfg, 8)
    engine = relay(cfg, HYPER, micro_batches=2)
    try:
        for step in range(2):
            engine.train_step(sampler.batch(step), step)
        before = [_blocks_state(engine, b) for b in range(3)]
        steps_before = engine.state_meta()["steps"]
        engine.train_step(sampler.batch(2), 2, skip_blocks={1})
        after = [_blocks_state(engine, b) for b in range(3)]
        steps_after = engine.state_meta()["steps"]
    finally:
        engine.close()
    assert before[1].keys() == {"layer2.p", "layer2.m", "layer2.v"}
    for key in before[1]:
        assert np.array_equal(before[1][key], after[1][key]), key
    assert steps_after["2"] == steps_before["2"] == 2  # no bias-correction count either
    for b in (0, 2):  # the blocks that ran did update
        assert not np.array_equal(before[b][f"layer{b + 1}.p"], after[b][f"layer{b + 1}.p"])
        assert steps_after[str(b + 1)] == 3


def test_the_baseline_leaves_a_skipped_block_as_torch_adamw_does(corpus):
    """The yardstick itself: a block without a gradient keeps its weights and AdamW state."""
    cfg = ModelConfig(layers=2, d_model=32, heads=2, seq_len=32)
    sampler = sampler_for(corpus, cfg, 8)
    engine = plain(cfg, HYPER)
    engine.train_step(sampler.batch(0), 0)
    before = _blocks_state(engine, 0)
    engine.train_step(sampler.batch(1), 1, skip_blocks=[0])
    after = _blocks_state(engine, 0)
    assert all(np.array_equal(before[k], after[k]) for k in before)
    assert engine.state_meta()["steps"]["1"] == 1


@pytest.mark.parametrize("transport, stash", [("cpu", "device"), ("threaded", "host"), ("threaded", "device")])
def test_dropping_blocks_holds_no_more_device_memory_and_the_audit_agrees(corpus, transport, stash):
    """At every boundary of every step the memory the relay can reach equals its ledger
    (relay/audit.py), also when the last block is left out (the threaded transport keeps the
    last running block resident for the backward). The device peak of a step with blocks
    left out is the full-depth one when two blocks or more run (the blocks are alike) -- less,
    with the device stash, by exactly the stashed inputs of the blocks that did not run."""
    cfg = ModelConfig(layers=4, d_model=64, heads=2, seq_len=32)
    sampler = sampler_for(corpus, cfg, 4)
    block_stash = 4 * 32 * 64 * 4  # a block's input over the step's 2 micro-batches of 2 sequences, fp32
    skips = {"full": [()] * 4, "dropped": [(3,), (0, 2), (1, 2, 3), (0, 1, 2, 3)]}
    peaks = {}
    for name, steps in skips.items():
        engine = relay(cfg, HYPER, micro_batches=2, stash=stash)
        if transport == "threaded":
            from threaded_transport import ThreadedTransport
            engine.transport = ThreadedTransport(CPU)
        audit = audited(engine)
        try:
            peaks[name] = [engine.train_step(sampler.batch(k), k, skip_blocks=s).device_peak_bytes
                           for k, s in enumerate(steps)]
        finally:
            engine.close()
        assert audit.mismatches() == []
        assert max(m for _, _, m, _ in audit.records) > 0
        running = [5 - len(s) for s in steps]  # the pre stage and the blocks that ran
        assert len(audit.records) == sum(2 * r + 1 for r in running)
    for full, dropped, skip in zip(peaks["full"], peaks["dropped"], skips["dropped"]):
        if 4 - len(skip) >= 2:
            assert full - dropped == (len(skip) * block_stash if stash == "device" else 0), skip
        else:  # one block or none: never two on the device at once, a full step's worst moment
            assert dropped < full


def test_relay_with_a_threaded_pipeline_matches_the_baseline_when_blocks_are_left_out(corpus):
    """Prefetch and the resident last block follow the step's running blocks."""
    from threaded_transport import ThreadedTransport
    cfg = ModelConfig(family="hf-gpt2", layers=BLOCKS, d_model=32, heads=2, seq_len=32)
    sampler = sampler_for(corpus, cfg, 8, seed=3)
    a, b = relay(cfg, HYPER, micro_batches=2, seed=3), plain(cfg, HYPER, seed=3)
    a.transport = ThreadedTransport(CPU)
    try:
        for step, skip in enumerate([(3,), (), (0, 1, 2, 3), (1,), (0, 3), (2,)]):
            batch = sampler.batch(step)
            la = a.train_step(batch, step, skip_blocks=skip).loss
            lb = b.train_step(batch, step, skip_blocks=skip).loss
            assert abs(la - lb) <= 1e-5 * lb
    finally:
        a.close()
    for wa, wb in zip(a.master_weights(), b.master_weights()):
        np.testing.assert_allclose(wa, wb, rtol=0, atol=1e-5)


def test_a_users_depth_policy_drives_the_run(tmp_path, corpus):
    """The Python API: a function of the step chooses the blocks; the run records them."""
    cfg = TrainConfig(layers=3, d_model=32, heads=2, seq_len=32, batch_size=4, micro_batches=2, steps=4,
                      eval_batches=1, progress=False, plot=False, out=str(tmp_path / "run"))
    train(cfg, depth=lambda step: [step % 3] if step % 2 else [])
    assert [m["skipped_blocks"] for m in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [[], [1], [], [0]]
    with pytest.raises(UserError, match="give one"):
        train(TrainConfig(layer_drop=0.1, out=str(tmp_path / "two")), depth=lambda step: [])
    with pytest.raises(UserError, match="blocks are 0..2"):
        train(TrainConfig(**{**cfg.to_dict(), "out": str(tmp_path / "bad")}), depth=lambda step: [3])


def test_layer_drop_draws_depend_on_seed_and_step_alone():
    draw = LayerDrop(0.5, 8, seed=7)
    assert [draw(s) for s in range(6)] == [LayerDrop(0.5, 8, seed=7)(s) for s in range(6)]
    assert len({draw(s) for s in range(6)}) > 1 and draw(0) != LayerDrop(0.5, 8, seed=8)(0)
    assert LayerDrop(0.0, 8)(3) == frozenset()
    rate = np.mean([len(LayerDrop(0.2, 10, seed=1)(s)) for s in range(400)]) / 10
    assert 0.17 < rate < 0.23
    with pytest.raises(ValueError, match="block numbers"):
        blocks_left_out(lambda s: "x", 0, 4)
    with pytest.raises(ValueError, match="outside"):
        relay(ModelConfig(layers=2, d_model=32, heads=2, seq_len=32), HYPER, micro_batches=1).running_layers([2])
