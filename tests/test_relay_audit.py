"""Device memory measured, not only booked: at every layer boundary the device bytes the
relay can reach (``relay/audit.py``, which never reads the ledger) equal the ledger's
current device bytes -- for both stashes, on the zero-copy CPU transport and on the
threaded pipeline (prefetched weights, stash brought back ahead of use) -- and a stash
that keeps a tensor after the ledger released it is caught."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from l2l.eps import OptimizerHyper
from l2l.models import ModelConfig
from l2l.relay import engine as relay_engine
from l2l.relay.audit import audited, reachable_device_bytes
from l2l.relay.stash import BoundaryStore

from conftest import CPU, relay, sampler_for


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    # tiny layers: on a shared 2-core machine torch's thread pool only adds spinning
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _threaded(engine):
    """Put ``engine`` on the threaded CPU pipeline (asynchronous: prefetches weights and
    brings the host stash back ahead of use). The one place that names the transport."""
    from threaded_transport import ThreadedTransport
    engine.transport = ThreadedTransport(CPU)
    return engine


def _run(corpus, layers: int, stash: str, transport: str, steps: int = 2, micro_batches: int = 2):
    cfg = ModelConfig(layers=layers, d_model=64, heads=2, seq_len=32)
    engine = relay(cfg, OptimizerHyper(), micro_batches=micro_batches, stash=stash)
    if transport == "threaded":
        _threaded(engine)
    audit = audited(engine)
    sampler = sampler_for(corpus, cfg, 2 * micro_batches)
    try:
        for k in range(steps):
            engine.train_step(sampler.batch(k), k)
        return audit, len(engine.layers)
    finally:
        engine.close()


def _boundaries(layers: int) -> list[tuple[str, int]]:
    """The boundaries of one step of a relay of ``layers`` layers (pre, blocks, post)."""
    last = layers - 1
    return ([("forward", i) for i in range(last)] + [("post", last)]
            + [("backward", i) for i in range(last - 1, -1, -1)])


@pytest.mark.parametrize("transport", ["cpu", "threaded"])
@pytest.mark.parametrize("stash", ["device", "host"])
@pytest.mark.parametrize("layers", [4, 32])
def test_reachable_device_bytes_equal_the_ledger_at_every_boundary(corpus, layers, stash, transport):
    audit, relayed = _run(corpus, layers, stash, transport)
    assert relayed == layers + 2  # pre, blocks, post
    assert [(p, i) for p, i, _, _ in audit.records] == 2 * _boundaries(relayed)
    assert audit.mismatches() == []
    measured = [m for _, _, m, _ in audit.records]
    if stash == "device" or transport == "threaded":
        assert max(measured) > 0  # something was measured: the check is not 0 == 0
    if stash == "device":
        # the device stash grows through the forward: one boundary per block per micro-batch
        act = 2 * 32 * 64 * 4
        forward = [m for _, _, m, _ in audit.records[:relayed - 1]]
        if transport == "cpu":
            assert forward == [(i + 1) * 2 * act for i in range(relayed - 1)]
    # after the backward nothing is held
    assert audit.records[-1][2:] == (0, 0)


def test_prefetched_weights_are_measured_and_booked(corpus):
    """The threaded transport uploads the next layer's weights ahead of its fetch: the
    audit sees them, so the ledger must book them (``weights_prefetch``)."""
    audit, _ = _run(corpus, 4, "device", "threaded", steps=1)
    cpu, _ = _run(corpus, 4, "device", "cpu", steps=1)
    extra = [t[2] - c[2] for t, c in zip(audit.records, cpu.records)]
    # a layer's weights in flight (or resident) at every boundary but the last
    assert all(e > 0 for e in extra[:-1]) and extra[-1] == 0
    assert audit.mismatches() == []


class _LeakyStore(BoundaryStore):
    """A stash that keeps every tensor it hands out for good (the ledger releases them)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.kept: list[torch.Tensor] = []

    def pop(self, key):
        t = super().pop(key)
        self.kept.append(t)
        return t


@pytest.mark.parametrize("stash,transport", [("device", "cpu"), ("host", "cpu"), ("host", "threaded")])
def test_a_stash_that_keeps_released_tensors_is_caught(corpus, monkeypatch, stash, transport):
    monkeypatch.setattr(relay_engine, "BoundaryStore", _LeakyStore)
    audit, relayed = _run(corpus, 4, stash, transport, steps=1)
    bad = audit.mismatches()
    assert bad, "the audit did not see the leak"
    # the first pop is the post stage's: from there on the audit measures more than is booked
    assert [(p, i) for p, i, _, _ in bad] == _boundaries(relayed)[relayed - 1:]
    assert all(measured > booked for _, _, measured, booked in bad)


def test_the_audit_changes_no_training_result(corpus):
    cfg = ModelConfig(layers=4, d_model=64, heads=2, seq_len=32)
    runs = []
    for with_audit in (False, True):
        engine = _threaded(relay(cfg, OptimizerHyper(), micro_batches=2, stash="host"))
        if with_audit:
            audited(engine)
        sampler = sampler_for(corpus, cfg, 4)
        try:
            runs.append(([engine.train_step(sampler.batch(k), k).loss for k in range(2)], engine.master_weights()))
        finally:
            engine.close()
    (loss_a, w_a), (loss_b, w_b) = runs
    assert loss_a == loss_b
    assert all(np.array_equal(a, b) for a, b in zip(w_a, w_b))


def test_between_steps_the_relay_reaches_no_device_memory(corpus):
    cfg = ModelConfig(layers=4, d_model=64, heads=2, seq_len=32)
    engine = relay(cfg, OptimizerHyper(), micro_batches=2, stash="device")
    try:
        engine.train_step(sampler_for(corpus, cfg, 4).batch(0), 0)
        assert engine._store is None
        assert reachable_device_bytes(engine) == 0 == engine.ledger.device_bytes()
    finally:
        engine.close()
