"""The relay trains exactly what the in-memory baseline trains (fp32, CPU)."""
from __future__ import annotations

import numpy as np
import pytest

from l2l.eps import OptimizerHyper
from l2l.models import ModelConfig, build_stack
from l2l.relay.rng import derive_seed, replay_rng

from conftest import CPU, plain, relay, sampler_for

# Adam divides by sqrt(v): where a gradient is pure rounding noise (a key bias,
# whose true gradient is zero; a rarely seen byte's embedding row) both engines
# take lr-sized steps in noise-chosen directions. The weight gap therefore
# scales with lr; 5e-4 keeps it well inside the 1e-5 bound on every family.
HYPER = OptimizerHyper(lr=5e-4, weight_decay=0.01, beta2=0.99)


@pytest.mark.parametrize("family", ["gpt", "hf-gpt2", "hf-bert"])
def test_relay_matches_plain_for_20_steps(family, corpus):
    cfg = ModelConfig(family=family, layers=2, d_model=32, heads=2, seq_len=32)
    sampler = sampler_for(corpus, cfg, batch_size=8, seed=3)
    l2l, base = relay(cfg, HYPER, micro_batches=4, seed=3), plain(cfg, HYPER, seed=3)
    worst_loss = 0.0
    for step in range(20):
        batch = sampler.batch(step)
        a, b = l2l.train_step(batch, step).loss, base.train_step(batch, step).loss
        worst_loss = max(worst_loss, abs(a - b) / abs(b))
    wa, wb = l2l.master_weights(), base.master_weights()
    scale = max(float(np.abs(w).max()) for w in wb)
    worst_weight = max(float(np.abs(x - y).max()) for x, y in zip(wa, wb)) / scale
    print(f"\n{family}: largest loss rel diff {worst_loss:.3g}, weight diff / max|w| {worst_weight:.3g}")
    assert worst_loss <= 1e-5
    assert worst_weight <= 1e-5
    # and it did train: the comparison is not between two frozen models
    assert max(float(np.abs(x - y).max()) for x, y in zip(wa, [l.layout.flatten(l.module)
               for l in build_stack(cfg, 3, materialize=True).layers])) > 1e-3


def test_micro_batch_count_does_not_change_the_step(corpus):
    cfg = ModelConfig(layers=2, d_model=32, heads=2, seq_len=32)
    batch = sampler_for(corpus, cfg, batch_size=8).batch(0)
    losses = []
    for m in (1, 2, 8):
        engine = relay(cfg, HYPER, micro_batches=m)
        losses.append(engine.train_step(batch, 0).loss)
        losses.append(engine.train_step(batch, 1).loss)
    assert np.allclose(losses[0::2], losses[0], rtol=1e-6) and np.allclose(losses[1::2], losses[1], rtol=1e-5)


def _reference_gradients(cfg, batch, micro_batches, step, seed, *, seed_shift=0):
    """In-memory forward+backward of the whole model, micro-batch by micro-batch, of the
    batch's mean token loss, drawing each (layer, micro-batch)'s dropout masks from the
    relay's seeds."""
    stack = build_stack(cfg, seed, materialize=True)
    stack.train(True)
    for mb_index, mb in enumerate(batch.split(micro_batches)):
        x = mb.inputs
        for i, layer in enumerate(stack.layers):
            with replay_rng(CPU, derive_seed(seed, step, i, mb_index) + seed_shift):
                x = layer.module(x, mb.targets) if layer.kind == "post" else layer.module(x)
        (x / batch.num_targets).backward()
    return [np.concatenate([dict(l.module.named_parameters())[s.name].grad.reshape(-1).numpy()
                            for s in l.layout.slots]) for l in stack.layers]


def test_recompute_replays_the_forward_dropout_masks(corpus):
    cfg = ModelConfig(layers=3, d_model=32, heads=2, seq_len=32, dropout=0.2)
    batch = sampler_for(corpus, cfg, batch_size=8).batch(0)
    engine = relay(cfg, HYPER, micro_batches=4, seed=5)
    engine.eps.hold()  # updates held: each layer's gradient stays in its own inbox to be read
    engine.train_step(batch, step=7)
    engine.eps.synchronize()
    got = [engine.eps.gradient_inbox(i).copy() for i in range(len(engine.layers))]
    want = _reference_gradients(cfg, batch, 4, step=7, seed=5)
    for g, w in zip(got, want):
        assert np.abs(g - w).max() <= 1e-5 * np.abs(w).max()
    # the test can fail: other masks give other gradients
    other = _reference_gradients(cfg, batch, 4, step=7, seed=5, seed_shift=1)
    assert max(np.abs(g - o).max() / np.abs(o).max() for g, o in zip(got, other)) > 1e-2


def test_plain_accumulating_over_micro_batches_takes_the_same_step(corpus):
    """`--engine plain --accumulate` (the same-M baseline of `l2l bench relay`) trains what
    the whole-batch step trains."""
    from l2l.baseline import PlainEngine
    cfg = ModelConfig(layers=2, d_model=32, heads=2, seq_len=32)
    sampler = sampler_for(corpus, cfg, batch_size=8)
    runs = []
    for m in (1, 4):
        engine = PlainEngine(build_stack(cfg, 0), HYPER, CPU, checkpointing=True, micro_batches=m)
        runs.append(([engine.train_step(sampler.batch(s), s).loss for s in range(3)], engine.master_weights()))
    (la, wa), (lb, wb) = runs
    np.testing.assert_allclose(la, lb, rtol=1e-6)
    for x, y in zip(wa, wb):
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-6)
