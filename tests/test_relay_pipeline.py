"""L2L-p on the CPU: the CUDA pipeline's shape with copy threads (ThreadedTransport).

Weights come in on a copy-in thread while the previous layer computes,
gradients and stashed activations go out on a copy-out thread, stashed
activations come back one compute call ahead. The tests check that this
changes no bit of training, that the copies really overlap compute, and that
with ``--stash host`` the device holds a constant amount however deep the
model and however many micro-batches.
"""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from l2l.eps import OptimizerHyper, EagerParamServer, NumpyBackend
from l2l.models import ModelConfig, build_stack
from l2l.relay import recompute
from l2l.relay.engine import RelayEngine
from threaded_transport import ThreadedTransport

from conftest import CPU, sampler_for

CFG = ModelConfig(layers=3, d_model=32, heads=2, seq_len=16, dropout=0.1)
HYPER = OptimizerHyper(lr=3e-3)


def _engine(cfg, *, micro_batches, stash, transport=None):
    eps = EagerParamServer(NumpyBackend(), HYPER)
    return RelayEngine(build_stack(cfg, 0), eps, CPU, micro_batches=micro_batches, stash=stash,
                       seed=0, transport=transport)


@pytest.mark.parametrize("stash", ["device", "host"])
def test_threaded_pipeline_changes_no_bit(corpus, stash):
    sampler = sampler_for(corpus, CFG, batch_size=4)
    ref = _engine(CFG, micro_batches=2, stash="device")
    piped = _engine(CFG, micro_batches=2, stash=stash, transport=ThreadedTransport(CPU))
    try:
        for step in range(3):
            a, b = ref.train_step(sampler.batch(step), step), piped.train_step(sampler.batch(step), step)
            assert a.loss == b.loss, step
        for wa, wb in zip(ref.master_weights(), piped.master_weights()):
            np.testing.assert_array_equal(wa, wb)
    finally:
        ref.close()
        piped.close()


def _compute_intervals(engine, monkeypatch) -> list[tuple[float, float]]:
    """(start, end) of every layer call on the compute thread, through module hooks,
    and of every recompute-and-backward (whose recompute stops early, so its module
    call never returns to a forward hook)."""
    spans, starts = [], {}
    main = threading.get_ident()
    replay = recompute.Recording.backward

    def timed_replay(self, *args):
        t0 = time.perf_counter()
        try:
            return replay(self, *args)
        finally:
            spans.append((t0, time.perf_counter()))

    monkeypatch.setattr(recompute.Recording, "backward", timed_replay)

    def pre(module, args):
        if threading.get_ident() == main:
            starts[id(module)] = time.perf_counter()

    def post(module, args, out):
        if threading.get_ident() == main and id(module) in starts:
            spans.append((starts.pop(id(module)), time.perf_counter()))

    for layer in engine.layers:
        layer.module.register_forward_pre_hook(pre)
        layer.module.register_forward_hook(post)
    return spans


def test_copies_overlap_compute(corpus, monkeypatch):
    """Every kind of copy is hidden under compute: the relay asks for it, then computes (a layer
    call starts) before it waits for the copy, if it ever does. This is the compute thread's own
    order, so it holds however the OS schedules the copy threads (on a loaded 2-core machine they
    often wait for a core); the copies take 1 ms each, a slow link, so where a core is free they
    really run beside the layer calls."""
    cfg = ModelConfig(layers=4, d_model=128, heads=2, seq_len=64, dropout=0.0)
    trace: list = []
    engine = _engine(cfg, micro_batches=4, stash="host",
                     transport=ThreadedTransport(CPU, copy_delay_s=0.001, trace=trace))
    spans = _compute_intervals(engine, monkeypatch)
    sampler = sampler_for(corpus, cfg, batch_size=16)
    compute = threading.get_ident()
    try:
        engine.train_step(sampler.batch(0), 0)
        engine.eps.synchronize()
    finally:
        engine.close()

    def hidden(copy) -> bool:
        needed = copy.waits.get(compute, float("inf"))
        return any(copy.asked < c0 < needed for c0, _ in spans)

    kinds = {}
    for copy in trace:
        hit, total = kinds.get(copy.kind, (0, 0))
        kinds[copy.kind] = (hit + hidden(copy), total + 1)
    assert set(kinds) == {"weights", "gradient", "stash_out", "stash_in"}, kinds
    for kind, (hit, total) in kinds.items():
        # the first weights (layer 0) and the last gradient have nothing to hide under
        assert hit >= total - 1, (kind, hit, total)


def _peak(corpus, layers: int, micro_batches: int, batch_size: int) -> int:
    cfg = ModelConfig(layers=layers, d_model=64, heads=2, seq_len=32, dropout=0.0)
    engine = _engine(cfg, micro_batches=micro_batches, stash="host", transport=ThreadedTransport(CPU))
    try:
        return engine.train_step(sampler_for(corpus, cfg, batch_size).batch(0), 0).device_peak_bytes
    finally:
        engine.close()


def test_host_stash_with_prefetch_keeps_device_memory_flat(corpus):
    """Prefetching one compute call ahead holds a constant number of boundaries on the device."""
    assert _peak(corpus, 16, 4, 8) <= 1.05 * _peak(corpus, 4, 4, 8)
    # the same micro-batch size (2 sequences): 2 vs 16 micro-batches
    assert _peak(corpus, 4, 16, 32) <= 1.05 * _peak(corpus, 4, 2, 4)


def test_host_buffers_are_reused_across_steps(corpus):
    transport = ThreadedTransport(CPU)
    engine = _engine(CFG, micro_batches=2, stash="host", transport=transport)
    sampler = sampler_for(corpus, CFG, batch_size=4)
    try:
        engine.train_step(sampler.batch(0), 0)
        after_first = transport.pool.allocated
        for step in range(1, 4):
            engine.train_step(sampler.batch(step), step)
        assert after_first > 0 and transport.pool.allocated == after_first
    finally:
        engine.close()
