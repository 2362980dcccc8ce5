"""The CUDA transport's code, run on the CPU through a deferred fake of ``torch.cuda``.

``tests/fake_cuda.py`` runs every copy the transport queues on a side stream as
late as CUDA allows, poisons destinations with NaN until their copy runs,
records a copy whose memory was freed (no ``record_stream``) or rewritten before
it ran, and poisons a copy not ordered after the compute kernels that wrote its
memory (no ``wait_stream``). Training through it must equal the zero-copy
``CpuTransport`` bit for bit: a missing wait shows as NaN or another bit, a missing
``record_stream`` as an error in ``fake.errors``. The counters bound how often the CPU blocks on the GPU.
"""
from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from l2l.eps import OptimizerHyper, EagerParamServer, NumpyBackend
from l2l.models import Layer, LayerStack, ModelConfig, build_stack
from l2l.relay.engine import RelayEngine
from l2l.relay.parallel import DataParallelRelay
from l2l.relay.pinned import PinnedRegistry
from l2l.relay.transport import CudaTransport
from fake_cuda import FakeCuda
from transport_mutants import STREAMS, Switch, name_streams, routed_transport

from conftest import CPU, sampler_for

CFG = ModelConfig(layers=3, d_model=32, heads=2, seq_len=16, dropout=0.1)
HYPER = OptimizerHyper(lr=3e-3)
STEPS = 3


def _stack(tied: bool = False) -> LayerStack:
    """The tiny GPT; ``tied``: its head shares the token embedding (a shared EPS entry, fetched
    and given a gradient beside both the pre and the post stage)."""
    stack = build_stack(CFG, 0, materialize=True)
    if not tied:
        return stack
    stack.layers[-1].module.lm_head.weight = stack.layers[0].module.tok.weight
    tied_stack = LayerStack([Layer(l.name, l.kind, l.module) for l in stack.layers], stack.config, stack.vocab_size)
    assert len(tied_stack.shared) == 1
    return tied_stack


def _build(workers: int, stash: str, precision: str, fake: FakeCuda | None, tied: bool = False,
           transport=CudaTransport):
    """A relay (one engine, or ``workers`` data-parallel ones), through the fake or the CPU transport."""
    pinned = PinnedRegistry()  # the workers share it, as make_transports does
    transports = None if fake is None else [transport(CPU, cuda=fake, pinned=pinned) for _ in range(workers)]
    for t in transports or ():
        name_streams(t)
    kwargs = {} if fake is None else {"host_alloc": transports[0].host_alloc}
    eps = EagerParamServer(NumpyBackend(), HYPER, copy_dtype=precision, grad_dtype=precision,
                           contributors=workers, **kwargs)
    if workers == 1:
        return RelayEngine(_stack(tied), eps, CPU, micro_batches=2, stash=stash, seed=0,
                           precision=precision, transport=None if fake is None else transports[0])
    return DataParallelRelay([_stack(tied) for _ in range(workers)], eps, [CPU] * workers,
                             micro_batches=2 * workers, stash=stash, seed=0, precision=precision,
                             transports=transports)


def _train(engine, corpus, steps: int = STEPS, fake: FakeCuda | None = None, per_step: list | None = None):
    """Train ``steps`` steps; with ``fake``, this thread's kernels are watched (data-parallel
    workers are watched through their ``device_scope``)."""
    sampler = sampler_for(corpus, CFG, batch_size=4)
    losses = []
    try:
        with fake if fake is not None else contextlib.nullcontext():
            for step in range(steps):
                before = None if fake is None else fake.compute_waits()
                losses.append(engine.train_step(sampler.batch(step), step).loss)
                if per_step is not None:
                    per_step.append(fake.compute_waits() - before)
        return losses, engine.master_weights()
    finally:
        engine.close()


def _gradient_pushes(workers: int, tied: bool = False) -> int:
    """Gradient contributions per step: one per (layer part, worker)."""
    stack = _stack(tied)
    return workers * sum(len(stack.parts(i)) for i in range(len(stack.layers)))


def _mismatches(corpus, workers: int, stash: str, precision: str, fake: FakeCuda, steps: int = STEPS,
                tied: bool = False, transport=CudaTransport) -> list[str]:
    """What the harness finds wrong with training through ``fake`` against the CPU transport."""
    ref_losses, ref_weights = _train(_build(workers, stash, precision, None, tied), corpus, steps)
    per_step: list[int] = []
    losses, weights = _train(_build(workers, stash, precision, fake, tied, transport), corpus, steps, fake=fake,
                             per_step=per_step)
    found = list(fake.errors)
    if losses != ref_losses:
        found.append(f"losses {losses} != {ref_losses}")
    found += [f"master weights of entry {e} differ" for e, (a, b) in enumerate(zip(ref_weights, weights))
              if not np.array_equal(a, b)]
    if fake.pending():
        found.append(f"{fake.pending()} operations still queued after the run")
    # The relay's threads never block on the GPU: every wait of theirs is a stream wait.
    if per_step != [0] * steps:
        found.append(f"CPU-blocking waits on the relay's threads per step: {per_step}")
    # The only CPU waits are the EPS worker's: one per gradient it reads from its pinned inbox.
    eps_waits = sum(n for name, n in fake.cpu_waits.items() if name.startswith("eps-update"))
    if eps_waits > steps * _gradient_pushes(workers, tied):
        found.append(f"EPS worker waits {eps_waits} > {steps * _gradient_pushes(workers, tied)}")
    if sum(fake.spin_waits.values()):
        found.append(f"CPU spinning on non-blocking events: {dict(fake.spin_waits)}")
    return found


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stash", ["device", "host"])
@pytest.mark.parametrize("workers", [1, 2])
def test_fake_cuda_equals_cpu_transport(corpus, workers, stash, precision):
    """Bit for bit (losses, master weights), no use-after-free, no CPU wait on the relay's
    threads, at most one CPU wait per gradient on the EPS worker, none of them spinning."""
    fake = FakeCuda()
    assert _mismatches(corpus, workers, stash, precision, fake) == []
    assert fake.copies > 0


@pytest.mark.parametrize("workers", [1, 2])
def test_a_tied_embedding_through_the_fake_equals_cpu_transport(corpus, workers):
    """The shared entry's extra upload and gradient hand-over per user, ordered as the rest."""
    fake = FakeCuda()
    assert _mismatches(corpus, workers, "host", "bf16", fake, tied=True) == []


def test_harness_catches_a_missing_stream_wait(corpus, monkeypatch):
    """The compute stream no longer waits for the weights' copy: it reads NaN, and the harness fails."""
    monkeypatch.setattr(CudaTransport, "_waiter", lambda self, done: (lambda: None))
    found = _mismatches(corpus, 1, "device", "fp32", FakeCuda(), steps=1)
    assert any("losses" in f for f in found), found


def test_harness_catches_copies_not_ordered_after_compute(corpus):
    """Without ``wait_stream(compute)`` a copy may run before the compute kernels that wrote its
    source (a gradient, a stashed activation) or last used its destination's memory: the fake
    serves it unfinished, and both the loss (stash) and the weights (gradients) go wrong."""
    switch = Switch()
    routed, sites = routed_transport(switch)
    switch.off = (next(s for s in sites if ":wait_stream@" in s), "*")
    fake = FakeCuda()
    found = _mismatches(corpus, 1, "host", "fp32", fake, steps=1, transport=routed.CudaTransport)
    assert any("losses" in f for f in found), found
    assert any("master weights" in f for f in found), found
    unordered = {f.split()[3].rstrip(":") for f in found if f.startswith("unordered copy on")}
    assert unordered == set(STREAMS), found[:5]


def test_harness_catches_a_missing_record_stream(corpus):
    """Without record_stream a stashed activation dropped by the relay is freed under its queued
    copy out: the fake reports the use-after-free (and the poisoned stash changes the loss)."""
    fake = FakeCuda()
    fake.record_stream = lambda t, stream: None
    found = _mismatches(corpus, 1, "host", "fp32", fake, steps=1)
    assert any("use after free: the source" in f for f in found), found
    assert any("losses" in f for f in found), found


# ----------------------------------------------------------------- pinned memory

def test_inbox_rows_of_one_block_are_found():
    """The EPS allocates a layer's K inboxes as one (K, n) block: row k is found inside the
    allocation, and exactly its n elements are copied (a registry keyed by start address gave
    row 0 the whole block: a size mismatch with two workers)."""
    with FakeCuda() as fake:
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


# ----------------------------------------------------------------- ordering and allocator safety

def _fill(t: CudaTransport, values: list[float]) -> np.ndarray:
    host = t.host_alloc(len(values), np.float32)
    host[:] = values
    return host


def test_dropped_copies_keep_their_memory():
    """A copy-in whose result is dropped before it ran (an error path, a prefetch never used)
    keeps its device destination alive (record_stream), and so does a copy out its source."""
    with FakeCuda() as fake:
        t = CudaTransport(CPU, cuda=fake)
        pending = t.upload(_fill(t, [1.0, 2.0]))
        del pending
        stashed = t.to_host(torch.ones(3))  # the tensor is dropped at once, like the relay's activations
        back = t.to_device(stashed)
        del back
        t.download_gradient(torch.ones(2), t.host_alloc(2, np.float32))
        fake.synchronize()
        assert fake.errors == []


@pytest.mark.parametrize("ordered", [True, False])
def test_reused_stash_buffer_is_ordered_on_the_gpu(monkeypatch, ordered):
    """A host buffer given back while its copy back may not have run is reused after it by a
    stream wait, not a CPU wait: even when the copy out into it runs as early as allowed, the
    copy back reads the old contents. ``ordered=False`` removes that wait: the fake sees the
    buffer rewritten under the queued copy."""
    with FakeCuda() as fake:
        t = CudaTransport(CPU, cuda=fake)
        if not ordered:
            take = t.pool.take
            monkeypatch.setattr(t.pool, "take", lambda shape, dtype: (take(shape, dtype)[0], None))
        first = t.to_host(torch.full((4,), 1.0))
        back = t.to_device(first)
        t.release(first, back)  # as the stash does: given back before the copy back is waited on
        second = t.to_host(torch.full((4,), 2.0))
        assert second.host is first.host
        fake.run(t.stash_out)  # the adversary: the copy out into the reused buffer runs now
        values = back.wait().tolist()
        assert fake.compute_waits() == 0  # the reuse cost the CPU nothing
        if ordered:
            assert values == [1.0] * 4 and fake.errors == []
            assert t.to_device(second).wait().tolist() == [2.0] * 4
        else:
            assert any("overwritten source" in e for e in fake.errors), fake.errors


def test_cpu_waits_are_blocking_events():
    """The EPS worker waits on the CPU for a gradient's copy out: on a blocking event (it sleeps)."""
    with FakeCuda() as fake:
        t = CudaTransport(CPU, cuda=fake)
        inbox = t.host_alloc(3, np.float32)
        t.download_gradient(torch.full((3,), 5.0), inbox)()
        assert inbox.tolist() == [5.0] * 3
        assert sum(fake.cpu_waits.values()) == 1 and sum(fake.spin_waits.values()) == 0


def _copy_kinds(engine, fake: FakeCuda):
    """Each forced flush's copies by kind: weights (from an EPS copy), gradient (into an inbox), stash."""
    eps = engine.eps
    ranges = {"weights": [eps.fetch(e) for e in eps.layers],
              "gradient": [eps.gradient_inbox(e, k) for e in eps.layers for k in range(eps.contributors_of(e))]}

    def kind(info):
        _, dst, src, _ = info
        for name, ptr in (("weights", src), ("gradient", dst)):
            if any(a.ctypes.data <= ptr < a.ctypes.data + a.nbytes for a in ranges[name] if a.nbytes):
                return name
        return "stash"

    return [(forced_by, [kind(op) for op in ops]) for forced_by, ops in fake.flushes]


def test_stash_never_waits_behind_weights(corpus):
    """A stashed activation brought back ahead of its use does not queue behind the next layer's
    whole weights: no forced flush that runs a stash copy runs a weights copy."""
    with FakeCuda() as fake:
        engine = _build(1, "host", "fp32", fake)
        sampler = sampler_for(corpus, CFG, batch_size=4)
        try:
            engine.train_step(sampler.batch(0), 0)
            flushes = _copy_kinds(engine, fake)
        finally:
            engine.close()
        mixed = [f for f in flushes if "stash" in f[1] and "weights" in f[1]]
        assert any("stash" in kinds for _, kinds in flushes)
        assert mixed == [], mixed[:3]


# ----------------------------------------------------------------- threads and generators

def test_data_parallel_workers_select_their_device(corpus):
    """Each worker thread runs its step with its device current (torch.cuda.device(d)), not on GPU 0."""
    fake = FakeCuda()
    engine = _build(2, "device", "fp32", fake)
    sampler = sampler_for(corpus, CFG, batch_size=4)
    try:
        for step in range(2):
            engine.train_step(sampler.batch(step), step)
    finally:
        engine.close()
    assert len(fake.device_scopes) == 2 * 2, fake.device_scopes
    assert all(name.startswith("l2l-worker") and device == CPU for name, device in fake.device_scopes)


def test_replay_rng_on_cuda_forks_only_the_device_generator(monkeypatch):
    """On CUDA the scope reseeds and restores the device's generator and never touches the
    CPU generator (fork_rng saved and restored it on every micro-batch)."""
    from l2l.relay import rng

    device_gen = torch.Generator().manual_seed(123)  # stands for cuda:1's generator
    gens = (torch.Generator(), device_gen)
    monkeypatch.setattr(torch.cuda, "default_generators", gens, raising=False)
    # what fork_rng(device_type="cuda") calls, on the stand-in generators
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device=0: gens[int(device)].get_state())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device=0: gens[int(device)].set_state(state))
    cpu_calls = []
    for name in ("get_rng_state", "set_rng_state"):
        real = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, _real=real, _name=name: (cpu_calls.append(_name), _real(*a))[1])
    before = device_gen.get_state()
    with rng.replay_rng(torch.device("cuda", 1), 7):
        first = torch.rand(3, generator=device_gen)
    with rng.replay_rng(torch.device("cuda", 1), 7):
        again = torch.rand(3, generator=device_gen)
    assert torch.equal(first, again)
    assert torch.equal(device_gen.get_state(), before)
    assert cpu_calls == []


class _RouteChecked(EagerParamServer):
    """Holds each worker's fetches to the route it declared before the pass: what a sharded
    EPS gathers by (``l2l.eps.gather``), so a wrong route would stall or mismatch there."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.routes: dict[int, list[int]] = {}
        self.fetched: dict[int, list[int]] = {}
        self.passes = 0

    def declare_route(self, worker, route, *, train, consumers):
        assert self.fetched.get(worker, []) == self.routes.get(worker, []), "the last pass left its route"
        assert consumers == (self.contributors if train else 1)
        self.routes[worker], self.fetched[worker] = list(route), []
        self.passes += 1

    def fetch(self, layer, worker=0):
        done = self.fetched.setdefault(worker, [])
        done.append(layer)
        assert done == self.routes[worker][:len(done)], f"worker {worker} fetched {done}, declared {self.routes[worker]}"
        return super().fetch(layer, worker)


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("on_fake_gpu", [False, True])
def test_the_relay_fetches_the_route_it_declares(corpus, workers, on_fake_gpu):
    """Training steps and an evaluation, on the CPU transport and on the (asynchronous) fake
    GPU one, whose prefetch and resident layer change the fetch order: each pass fetches
    exactly the entries it declared, in order (a tied embedding's too)."""
    fake = FakeCuda() if on_fake_gpu else None
    pinned = PinnedRegistry()
    transports = [CudaTransport(CPU, cuda=fake, pinned=pinned) for _ in range(workers)] if fake else None
    eps = _RouteChecked(NumpyBackend(), HYPER, contributors=workers,
                        **({"host_alloc": transports[0].host_alloc} if fake else {}))
    stacks = [_stack(tied=True) for _ in range(workers)]
    engine = RelayEngine(stacks[0], eps, CPU, micro_batches=2, seed=0, transport=transports[0] if fake else None) \
        if workers == 1 else DataParallelRelay(stacks, eps, [CPU] * workers, micro_batches=2 * workers, seed=0,
                                               transports=transports)
    sampler = sampler_for(corpus, CFG, batch_size=4)
    try:
        with fake if fake is not None else contextlib.nullcontext():
            engine.train_step(sampler.batch(0), 0)
            engine.evaluate([sampler.batch(1), sampler.batch(2)])
            engine.train_step(sampler.batch(3), 3)
    finally:
        engine.close()
    assert eps.passes == 2 * workers + 1
    assert all(eps.fetched[w] == eps.routes[w] for w in eps.routes)
    last = len(stacks[0].layers) - 1
    trained = eps.routes[workers - 1]   # the last pass of a worker that does not evaluate: a step
    assert len(trained) == sum(len(stacks[0].parts(i)) for i in range(last + 1)) + \
        sum(len(stacks[0].parts(i)) for i in range(last - 1 - (1 if fake else 0), -1, -1))
