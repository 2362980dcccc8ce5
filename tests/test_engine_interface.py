"""Every engine plays the one Engine role: the relay, K relay workers on one EPS, the baseline."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from l2l.build import build_engine
from l2l.config import TrainConfig
from l2l.engine import Engine, StepResult
from l2l.eps.disk_tier import BLOCK
from l2l.models import build_stack

from conftest import CPU, sampler_for

BASE = TrainConfig(layers=2, d_model=32, heads=2, seq_len=16, batch_size=4, micro_batches=2, progress=False)
CONFIGS = {"relay": BASE, "two workers": replace(BASE, devices=2),
           "two workers, strict": replace(BASE, devices=2, overflow="strict"),
           "baseline": replace(BASE, engine="plain")}


@pytest.mark.parametrize("name", CONFIGS)
def test_engine_role_and_its_learning_rate(name, corpus):
    cfg = CONFIGS[name].check()
    engine = build_engine(cfg, build_stack(cfg.model_config(), cfg.seed), CPU)
    try:
        assert isinstance(engine, Engine)
        sampler = sampler_for(corpus, cfg.model_config(), cfg.batch_size)
        before = engine.master_weights()
        engine.set_lr(0.0)  # lr 0: AdamW moves nothing (decay 1 - lr*wd = 1, step -lr*... = 0)
        result = engine.train_step(sampler.batch(0), 0)
        assert isinstance(result, StepResult) and np.isfinite(result.loss)
        after = engine.master_weights()
        assert all(np.array_equal(a, b) for a, b in zip(before, after))
        engine.set_lr(1e-2)
        engine.train_step(sampler.batch(1), 1)
        moved = engine.master_weights()
        assert all(not np.array_equal(a, b) for a, b in zip(after, moved))
        val = engine.evaluate([sampler.batch(2)])
        assert np.isfinite(val) and engine.master_weights()[0].tobytes() == moved[0].tobytes()
        tensors, meta = engine.state_tensors(), engine.state_meta()
        assert set(tensors) == {f"layer{i}.{k}" for i in range(4) for k in "pmv"}
        assert meta["steps"] in ({str(i): 2 for i in range(4)}, {i: 2 for i in range(4)})
    finally:
        engine.close()


def test_master_weights_read_the_masters_alone_from_the_disk_tier(corpus, tmp_path):
    """With the state on disk, master_weights() reads each entry's header and p region alone (the
    moments stay on disk; the entries the window holds are not read) and gives a checkpoint's p."""
    cfg = replace(BASE, eps_offload=str(tmp_path / "eps")).check()
    engine = build_engine(cfg, build_stack(cfg.model_config(), cfg.seed), CPU)
    try:
        engine.train_step(sampler_for(corpus, cfg.model_config(), cfg.batch_size).batch(0), 0)
        state = engine.state_tensors()  # after the updates; the reads ahead are done
        tier = engine.eps.backend.tier
        bytes_before, reads_before = tier.io.read_bytes, dict(tier.io.reads)
        masters = engine.master_weights()
        read = {e: n - reads_before.get(e, 0) for e, n in tier.io.reads.items() if n != reads_before.get(e, 0)}
    finally:
        engine.close()
    assert len(read) >= len(tier.numels) - cfg.eps_offload_window and set(read.values()) == {1}, read
    assert tier.io.read_bytes - bytes_before == sum(BLOCK + tier.layout.region_bytes(tier.numels[e]) for e in read)
    assert [m.tobytes() for m in masters] == [state[f"layer{e}.p"].tobytes() for e in range(len(masters))]
