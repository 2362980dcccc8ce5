"""bf16 and fp16 on the device, fp32 masters in the EPS; fp16's eager loss scaling."""
from __future__ import annotations

import numpy as np
import pytest

from l2l.eps import AdamWHyper, EagerParamServer, NumpyBackend
from l2l.metrics import read_metrics
from l2l.models import ModelConfig, build_stack
from l2l.relay.engine import RelayEngine
from l2l.relay.scaler import LossScaler

from conftest import CPU, run_cli, sampler_for

CFG = ModelConfig(layers=2, d_model=64, heads=4, seq_len=64)
HYPER = AdamWHyper(lr=3e-3)


def _engine(precision: str, backend=None) -> RelayEngine:
    eps = EagerParamServer(backend or NumpyBackend(), HYPER, copy_dtype=precision, grad_dtype=precision)
    return RelayEngine(build_stack(CFG, 0), eps, CPU, micro_batches=2, precision=precision)


def _train(engine: RelayEngine, sampler, steps: int) -> list[float]:
    return [engine.train_step(sampler.batch(s), s).loss for s in range(steps)]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_trains_like_fp32(corpus, precision):
    sampler = sampler_for(corpus, CFG, batch_size=8)
    val = sampler_for(corpus, CFG, batch_size=8, seed=99).fixed_batches(2)
    ref, low = _engine("fp32"), _engine(precision)
    _train(ref, sampler, 40)
    _train(low, sampler, 40)
    a, b = ref.evaluate(val), low.evaluate(val)
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

    def step(self, layer, grads, scalars, copy_out):
        if layer == self.layer:
            self.count += 1
            if self.count == self.update:
                grads = np.array(grads, copy=True)
                grads[0][3] = np.inf
        return super().step(layer, grads, scalars, copy_out)


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


def test_low_precision_baseline_is_refused(tmp_path):
    r = run_cli("train", "--engine", "plain", "--precision", "bf16", "--out", str(tmp_path / "r"))
    assert r.returncode == 2 and "--engine l2l only" in r.stderr
