"""The CUDA transport's code, run on the CPU through a deferred fake of ``torch.cuda``.

``tests/fake_cuda.py`` runs every copy the transport queues on a side stream as
late as CUDA allows, poisons destinations with NaN until their copy runs and
records a copy whose memory was freed (no ``record_stream``) or rewritten before
it ran. Training through it must equal the zero-copy ``CpuTransport`` bit for
bit: a missing wait shows as NaN or another bit, a missing ``record_stream`` as an
error in ``fake.errors``. The counters bound how often the CPU blocks on the GPU.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from l2l.eps import AdamWHyper, EagerParamServer, NumpyBackend
from l2l.models import ModelConfig, build_stack
from l2l.relay.engine import RelayEngine
from l2l.relay.parallel import DataParallelRelay
from l2l.relay.pinned import PinnedRegistry
from l2l.relay.transport import CudaTransport
from fake_cuda import FakeCuda

from conftest import CPU, sampler_for

CFG = ModelConfig(layers=3, d_model=32, heads=2, seq_len=16, dropout=0.1)
HYPER = AdamWHyper(lr=3e-3)
STEPS = 3


def _build(workers: int, stash: str, precision: str, fake: FakeCuda | None):
    """A relay (one engine, or ``workers`` data-parallel ones), through the fake or the CPU transport."""
    pinned = PinnedRegistry()  # the workers share it, as make_transports does
    transports = None if fake is None else [CudaTransport(CPU, cuda=fake, pinned=pinned) for _ in range(workers)]
    kwargs = {} if fake is None else {"host_alloc": transports[0].host_alloc}
    eps = EagerParamServer(NumpyBackend(), HYPER, copy_dtype=precision, grad_dtype=precision,
                           contributors=workers, **kwargs)
    if workers == 1:
        return RelayEngine(build_stack(CFG, 0), eps, CPU, micro_batches=2, stash=stash, seed=0,
                           precision=precision, transport=None if fake is None else transports[0])
    return DataParallelRelay([build_stack(CFG, 0) for _ in range(workers)], eps, [CPU] * workers,
                             micro_batches=2 * workers, stash=stash, seed=0, precision=precision,
                             transports=transports)


def _train(engine, corpus, steps: int = STEPS, fake: FakeCuda | None = None, per_step: list | None = None):
    sampler = sampler_for(corpus, CFG, batch_size=4)
    losses = []
    try:
        for step in range(steps):
            before = None if fake is None else fake.compute_waits()
            losses.append(engine.train_step(sampler.batch(step), step).loss)
            if per_step is not None:
                per_step.append(fake.compute_waits() - before)
        return losses, engine.master_weights()
    finally:
        engine.close()


def _gradient_pushes(workers: int) -> int:
    """Gradient contributions per step: one per (layer part, worker)."""
    stack = build_stack(CFG, 0)
    return workers * sum(len(stack.parts(i)) for i in range(len(stack.layers)))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stash", ["device", "host"])
@pytest.mark.parametrize("workers", [1, 2])
def test_fake_cuda_equals_cpu_transport(corpus, workers, stash, precision):
    ref_losses, ref_weights = _train(_build(workers, stash, precision, None), corpus)
    fake = FakeCuda()
    per_step: list[int] = []
    losses, weights = _train(_build(workers, stash, precision, fake), corpus, fake=fake, per_step=per_step)
    assert fake.errors == []
    assert losses == ref_losses
    for a, b in zip(ref_weights, weights):
        np.testing.assert_array_equal(a, b)
    assert fake.copies > 0 and fake.pending() == 0
    # The relay's threads never block on the GPU: every wait is a stream wait. The only CPU
    # waits are the EPS worker's, one per gradient it reads from its pinned inbox.
    assert per_step == [0] * STEPS, per_step
    eps_waits = sum(n for name, n in fake.cpu_waits.items() if name.startswith("eps-update"))
    assert eps_waits <= STEPS * _gradient_pushes(workers), fake.cpu_waits
    assert sum(fake.spin_waits.values()) == 0, fake.spin_waits  # a CPU that waits sleeps


# ----------------------------------------------------------------- pinned memory

def test_inbox_rows_of_one_block_are_found():
    """The EPS allocates a layer's K inboxes as one (K, n) block: row k is found inside the
    allocation, and exactly its n elements are copied (a registry keyed by start address gave
    row 0 the whole block: a size mismatch with two workers)."""
    fake = FakeCuda()
    t = CudaTransport(CPU, cuda=fake)
    block = t.host_alloc(3 * 5, np.float32).reshape(3, 5)
    block[:] = -1.0
    for k in range(3):
        grad = torch.full((5,), float(k))
        t.download_gradient(grad, block[k])()
    np.testing.assert_array_equal(block, np.repeat(np.arange(3, dtype=np.float32)[:, None], 5, axis=1))
    up = t.upload(block[1][1:4])
    assert up.wait().tolist() == [1.0, 1.0, 1.0]
    assert fake.errors == []


def test_pageable_memory_is_an_error():
    """A host array outside the transport's pinned allocations is refused with a clear message
    (a silent pageable fallback makes every CUDA copy synchronous)."""
    t = CudaTransport(CPU, cuda=FakeCuda())
    with pytest.raises(ValueError, match="not in pinned memory"):
        t.upload(np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="not in pinned memory"):
        t.download_gradient(torch.zeros(4), np.zeros(4, np.float32))
    inside = t.host_alloc(8, np.float32)
    with pytest.raises(ValueError, match="not in pinned memory"):  # runs past the allocation's end
        t.upload(np.lib.stride_tricks.as_strided(inside[4:], shape=(8,)))
