"""bf16 and fp16 on the device, fp32 masters in the EPS; fp16's eager loss scaling."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from l2l.eps import OptimizerHyper, EagerParamServer, NumpyBackend
from l2l.metrics import read_metrics
from l2l.models import ModelConfig, build_stack
from l2l.relay.engine import RelayEngine
from l2l.relay.parallel import DataParallelRelay
from l2l.relay.scaler import LossScaler

from l2l.baseline import PlainEngine

from conftest import CPU, run_cli, sampler_for
from shared_runs import made_once
from test_cuda_fake import CFG as TIED_CFG, _stack as tiny_gpt

CFG = ModelConfig(layers=2, d_model=64, heads=4, seq_len=64)
HYPER = OptimizerHyper(lr=3e-3)


def _engine(precision: str, backend=None) -> RelayEngine:
    eps = EagerParamServer(backend or NumpyBackend(), HYPER, copy_dtype=precision, grad_dtype=precision)
    return RelayEngine(build_stack(CFG, 0), eps, CPU, micro_batches=2, precision=precision)


def _train(engine: RelayEngine, sampler, steps: int) -> list[float]:
    return [engine.train_step(sampler.batch(s), s).loss for s in range(steps)]


def _trained_40_steps(corpus, precision: str) -> tuple[RelayEngine, float]:
    """An engine after 40 steps at ``precision`` and its validation loss."""
    engine = _engine(precision)
    _train(engine, sampler_for(corpus, CFG, batch_size=8), 40)
    return engine, engine.evaluate(sampler_for(corpus, CFG, batch_size=8, seed=99).fixed_batches(2))


@pytest.fixture(scope="session")
def fp32_40_steps(tmp_path_factory, corpus) -> float:
    """The fp32 reference's validation loss, trained once for the session (both workers)."""
    def make(directory):
        (directory / "loss.json").write_text(json.dumps(_trained_40_steps(corpus, "fp32")[1]))
    return json.loads((made_once(tmp_path_factory, "fp32-40-steps", make) / "loss.json").read_text())


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_trains_like_fp32(corpus, precision, fp32_40_steps):
    low, b = _trained_40_steps(corpus, precision)
    a = fp32_40_steps
    # a 40-step proxy of the acceptance run (the default model, 300 steps: README); early in
    # training the low-precision runs land within a few percent of fp32, either side
    assert abs(b - a) / a <= 0.05, (a, b)
    assert b < 0.8 * 5.55  # it trained
    w = low.eps.fetch(1)  # the device copy is in the device dtype, from fp32 masters
    assert w.dtype.itemsize == 2 and low.master_weights()[1].dtype == np.float32


class OverflowAt(NumpyBackend):
    """Puts an inf into one layer's gradient at one update, as an fp16 overflow would."""

    def __init__(self, layer: int, update: int) -> None:
        super().__init__()
        self.layer, self.update, self.count = layer, update, 0

    def step(self, layer, grads, scalars, copy_out, n_decay=None):
        if layer == self.layer:
            self.count += 1
            if self.count == self.update:
                grads = np.array(grads, copy=True)
                grads[0][3] = np.inf
        return super().step(layer, grads, scalars, copy_out, n_decay)


def test_injected_overflow_skips_that_layer_only_and_backs_off(corpus):
    sampler = sampler_for(corpus, CFG, batch_size=8)
    engine = _engine("fp16", OverflowAt(layer=2, update=2))
    first = engine.train_step(sampler.batch(0), 0)
    second = engine.train_step(sampler.batch(1), 1)
    third = engine.train_step(sampler.batch(2), 2)
    engine.eps.synchronize()
    assert first.loss_scale == second.loss_scale == 2.0 ** 16
    assert third.skipped_layers == 1 and third.loss_scale == 2.0 ** 15   # the scale backed off once
    steps = [engine.eps.step_count(i) for i in range(len(engine.layers))]
    assert steps[2] == 2 and all(t == 3 for i, t in enumerate(steps) if i != 2)  # only layer 2 skipped


def test_scaler_grows_after_clean_steps():
    s = LossScaler(scale=8.0, growth_interval=3)
    for overflowed in (False, False, True, False, False, False):
        s.update(overflowed)
    assert s.scale == 8.0 and s.clean_steps == 0  # 8 -> 4 (overflow) -> 8 (3 clean steps)


def test_fp16_resume_is_exact(tmp_path):
    tiny = ["--layers", "2", "--d-model", "32", "--heads", "2", "--seq-len", "32", "--batch-size", "8",
            "--micro-batches", "2", "--eval-batches", "1", "--no-progress", "--eval-every", "0",
            "--precision", "fp16"]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert run_cli("train", *tiny, "--steps", "6", "--out", str(whole)).returncode == 0
    assert run_cli("train", *tiny, "--steps", "3", "--schedule-steps", "6", "--out", str(parts)).returncode == 0
    r = run_cli("train", *tiny, "--steps", "6", "--out", str(parts), "--resume")
    assert r.returncode == 0, r.stderr
    want = [(x["loss"], x["loss_scale"]) for x in read_metrics(whole / "metrics.jsonl")]
    assert [(x["loss"], x["loss_scale"]) for x in read_metrics(parts / "metrics.jsonl")] == want


def _strict_pair(precision: str, *, clip: float | None, scale: float | None = None):
    """The relay in --overflow strict and the plain engine (GradScaler for fp16), same start."""
    cfg = ModelConfig(layers=2, d_model=64, heads=4, seq_len=64, dropout=0.0)
    eps = EagerParamServer(NumpyBackend(), HYPER, copy_dtype=precision, grad_dtype=precision)
    relay = RelayEngine(build_stack(cfg, 0), eps, CPU, micro_batches=2, precision=precision,
                        overflow="strict", clip_grad_norm=clip)
    if scale is not None:
        relay.scaler.scale = scale
    base = PlainEngine(build_stack(cfg, 0), HYPER, CPU, precision=precision, clip_grad_norm=clip,
                       loss_scale=scale)
    return cfg, relay, base


def test_strict_fp16_matches_gradscaler(corpus):
    """--overflow strict: the same steps skipped, the same scales, losses within 1e-3.

    The initial scale 2**20 makes the first steps overflow (the fp16 gradients of a
    loss times 2**20 are inf) until the scale has backed off far enough.
    """
    cfg, relay, base = _strict_pair("fp16", clip=1.0, scale=2.0 ** 20)
    sampler = sampler_for(corpus, cfg, batch_size=8)
    skipped = []
    for step in range(10):
        a = relay.train_step(sampler.batch(step), step)
        b = base.train_step(sampler.batch(step), step)
        assert a.loss_scale == b.loss_scale, step
        assert a.skipped_layers == b.skipped_layers, step
        assert abs(a.loss - b.loss) <= 1e-3 * abs(b.loss), (step, a.loss, b.loss)
        if not a.skipped_layers:
            assert abs(a.grad_norm - b.grad_norm) <= 1e-3 * b.grad_norm, (step, a.grad_norm, b.grad_norm)
        skipped.append(a.skipped_layers > 0)
    assert skipped[0] and not skipped[-1], skipped  # both behaviours were exercised
    relay.eps.synchronize()
    steps = {relay.eps.step_count(i) for i in range(len(relay.layers))}
    assert steps == {skipped.count(False)}  # a skipped step left every layer's count alone


def test_strict_clipping_matches_clip_grad_norm(corpus):
    """fp32, --clip-grad-norm below the gradients' norm: the relay clips as torch does."""
    cfg, relay, base = _strict_pair("fp32", clip=0.5)
    sampler = sampler_for(corpus, cfg, batch_size=8)
    for step in range(6):
        a = relay.train_step(sampler.batch(step), step)
        b = base.train_step(sampler.batch(step), step)
        assert a.grad_norm > 0.5  # the clip was active
        assert abs(a.grad_norm - b.grad_norm) <= 1e-4 * b.grad_norm, (step, a.grad_norm, b.grad_norm)
        assert abs(a.loss - b.loss) <= 1e-5 * b.loss, (step, a.loss, b.loss)
    unclipped = _strict_pair("fp32", clip=None)[1]
    for step in range(6):
        unclipped.train_step(sampler.batch(step), step)
    # clipping changed the trajectory: the weights differ from an unclipped run
    assert not np.array_equal(relay.master_weights()[1], unclipped.master_weights()[1])


def test_strict_injected_overflow_skips_the_whole_step(corpus):
    """One layer's inf makes the whole step skip (every layer), and the scale backs off at once."""
    cfg, relay, _ = _strict_pair("fp16", clip=None)
    sampler = sampler_for(corpus, cfg, batch_size=8)
    hand_over = relay._hand_over

    def poisoned(i, fetched, scale, _step=[0]):
        if i == 2 and _step[0] == 1:
            fetched.grads[0][3] = float("inf")  # the layer's own entry
        if i == 0:
            _step[0] += 1
        return hand_over(i, fetched, scale)

    relay._hand_over = poisoned
    results = [relay.train_step(sampler.batch(s), s) for s in range(3)]
    relay.eps.synchronize()
    assert [r.skipped_layers for r in results] == [0, relay.stack.num_entries, 0]
    assert [r.loss_scale for r in results] == [2.0 ** 16, 2.0 ** 16, 2.0 ** 15]
    assert {relay.eps.step_count(i) for i in range(len(relay.layers))} == {2}


def test_skipped_counts_eps_entries_a_tied_embedding_included(corpus):
    """An fp16 step whose every gradient overflows (scale 2**40) on a GPT whose head is tied to
    its token embedding: pre, 3 blocks, post and the tied entry are 6 EPS entries, and every
    engine reports 6 skipped -- the strict relay, strict with 2 workers, the plain engine's
    GradScaler, and the eager relay (a step late, when the updates settle), whose count is
    the EPS's records of skipped updates."""
    entries = tiny_gpt(tied=True).num_entries
    assert entries == len(tiny_gpt(tied=True).layers) + 1 == 6
    batches = sampler_for(corpus, TIED_CFG, batch_size=8).fixed_batches(2)

    def eps(contributors: int = 1):
        return EagerParamServer(NumpyBackend(), HYPER, copy_dtype="fp16", grad_dtype="fp16",
                                contributors=contributors)

    strict = RelayEngine(tiny_gpt(tied=True), eps(), CPU, micro_batches=2, precision="fp16", overflow="strict")
    two = DataParallelRelay([tiny_gpt(tied=True), tiny_gpt(tied=True)], eps(2), [CPU, CPU], micro_batches=2,
                            precision="fp16", overflow="strict")
    eager = RelayEngine(tiny_gpt(tied=True), eps(), CPU, micro_batches=2, precision="fp16")
    plain = PlainEngine(tiny_gpt(tied=True), HYPER, CPU, precision="fp16", loss_scale=2.0 ** 40)
    for relay in (strict, eager, *two.workers):
        relay.scaler.scale = 2.0 ** 40
    try:
        assert strict.train_step(batches[0], 0).skipped_layers == entries
        assert two.train_step(batches[0], 0).skipped_layers == entries
        assert plain.train_step(batches[0], 0).skipped_layers == entries
        eager.train_step(batches[0], 0)
        assert eager.train_step(batches[1], 1).skipped_layers == entries
    finally:
        for engine in (strict, two, eager):
            engine.close()


def test_clipping_needs_strict(tmp_path):
    r = run_cli("train", "--clip-grad-norm", "1.0", "--out", str(tmp_path / "r"))
    assert r.returncode == 2 and "--overflow strict" in r.stderr and "Traceback" not in r.stderr


def test_plain_fp16_uses_gradscaler(corpus):
    """The baseline in fp16: fp32 masters, fp16 compute, a GradScaler that backs off on overflow."""
    cfg = ModelConfig(layers=2, d_model=64, heads=4, seq_len=64, dropout=0.0)
    base = PlainEngine(build_stack(cfg, 0), HYPER, CPU, precision="fp16", loss_scale=2.0 ** 40)
    sampler = sampler_for(corpus, cfg, batch_size=8)
    first = base.train_step(sampler.batch(0), 0)
    assert first.skipped_layers == base.stack.num_entries and base.scaler.get_scale() == 2.0 ** 39
    assert all(p.dtype == torch.float32 for p in base.params)
