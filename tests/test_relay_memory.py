"""Device memory of the relay is constant in depth (CPU ledger)."""
from __future__ import annotations

import pytest

from l2l.eps import OptimizerHyper
from l2l.models import ModelConfig

from conftest import relay, sampler_for


def _peaks(corpus, layers: int, micro_batches: int, stash: str, batch_size: int):
    cfg = ModelConfig(layers=layers, d_model=64, heads=2, seq_len=32)
    engine = relay(cfg, OptimizerHyper(), micro_batches=micro_batches, stash=stash)
    result = engine.train_step(sampler_for(corpus, cfg, batch_size).batch(0), 0)
    engine.close()
    return result.device_peak_bytes, result.device_weight_peak_bytes


def test_weight_footprint_is_flat_in_depth(corpus):
    _, w4 = _peaks(corpus, 4, 4, "device", 8)
    _, w32 = _peaks(corpus, 32, 4, "device", 8)
    assert w32 <= 1.05 * w4


def test_host_stash_makes_device_memory_flat_in_depth_and_micro_batches(corpus):
    p4, _ = _peaks(corpus, 4, 4, "host", 8)
    p32, _ = _peaks(corpus, 32, 4, "host", 8)
    assert p32 <= 1.05 * p4
    # same micro-batch size (2 sequences), 2 vs 16 micro-batches
    m2, _ = _peaks(corpus, 4, 2, "host", 4)
    m16, _ = _peaks(corpus, 4, 16, "host", 32)
    assert m16 <= 1.05 * m2


def test_device_stash_grows_with_depth_times_micro_batches(corpus):
    """What README states: the device stash holds one boundary per layer per micro-batch."""
    p4, _ = _peaks(corpus, 4, 4, "device", 8)
    p32, _ = _peaks(corpus, 32, 4, "device", 8)
    boundary = 8 * 32 * 64 * 4  # whole batch's activations at one layer boundary, fp32
    assert p32 - p4 == pytest.approx(28 * boundary, rel=0.01)
