"""Every ordering call of the CUDA transport is needed: without any one, the fake CUDA sees it.

The transport orders its copies with ``wait_stream`` (a copy after the compute
kernels that wrote its source or last used its destination's memory),
``wait_event`` (compute after a copy in; a copy back after the copy out; a reused
host buffer's copy out after its copy back) and ``record_stream`` (the allocator
keeps a dropped tensor's block until its copy ran). The mutation test switches
each call site off in turn, on each stream it is reached on, and requires the
checks below -- the transport's four kinds of copy through ``tests/fake_cuda.py``,
a few milliseconds each -- to find something wrong every time.
"""
from __future__ import annotations

import contextlib
import math

import numpy as np
import torch

from l2l.relay.transport import CudaTransport
from fake_cuda import FakeCuda
from transport_mutants import STREAMS, Switch, name_streams, routed_transport

from conftest import CPU


def _transport(cls, fake: FakeCuda):
    t = cls(CPU, cuda=fake)
    name_streams(t)
    return t


def _expect(found: list[str], what: str, got: list[float], want: list[float]) -> None:
    if got != want:
        found.append(f"{what}: {['nan' if math.isnan(v) else v for v in got]} != {want}")


def _weights_in(cls) -> list[str]:
    """Weights uploaded and computed with; a prefetch dropped before its copy ran."""
    found: list[str] = []
    with FakeCuda() as fake:
        t = _transport(cls, fake)
        host = t.host_alloc(4, np.float32)
        host[:] = [1.0, 2.0, 3.0, 4.0]
        weights = t.upload(host).wait()
        _expect(found, "weights", (weights * 2).tolist(), [2.0, 4.0, 6.0, 8.0])
        unused = t.upload(host)
        del unused
        fake.synchronize()
    return found + fake.errors


def _gradient_out(cls) -> list[str]:
    """A gradient written by compute kernels, handed over, dropped, then read by the EPS worker."""
    found: list[str] = []
    with FakeCuda() as fake:
        t = _transport(cls, fake)
        inbox = t.host_alloc(3, np.float32)
        grad = t.gradient_buffer(inbox)
        grad.add_(torch.tensor([1.0, 2.0, 3.0]))
        ready = t.download_gradient(grad, inbox)
        del grad  # the relay releases its buffer once handed over
        ready()
        _expect(found, "gradient", inbox.tolist(), [1.0, 2.0, 3.0])
    return found + fake.errors


def _stash_round_trip(cls) -> list[str]:
    """An activation written by compute, stashed to the host and dropped, brought back and
    computed with; a copy back dropped before it ran (a prefetch never used)."""
    found: list[str] = []
    with FakeCuda() as fake:
        t = _transport(cls, fake)
        activation = torch.arange(4, dtype=torch.float32) + 1
        stashed = t.to_host(activation)
        del activation
        unused = t.to_device(stashed)
        del unused
        back = t.to_device(stashed)
        _expect(found, "stash", (back.wait() * 1).tolist(), [1.0, 2.0, 3.0, 4.0])
        t.release(stashed, back)
        fake.synchronize()
    return found + fake.errors


def _stash_buffer_reused_early(cls) -> list[str]:
    """A host buffer given back before its copy back ran, reused, and the copy out into it run
    as early as CUDA allows: the copy back still reads the old contents."""
    found: list[str] = []
    with FakeCuda() as fake:
        t = _transport(cls, fake)
        first = t.to_host(torch.full((4,), 1.0))
        back = t.to_device(first)
        t.release(first, back)
        second = t.to_host(torch.full((4,), 2.0))
        fake.run(t.stash_out)
        _expect(found, "first stash", back.wait().tolist(), [1.0] * 4)
        _expect(found, "second stash", t.to_device(second).wait().tolist(), [2.0] * 4)
    return found + fake.errors


CHECKS = (_weights_in, _gradient_out, _stash_round_trip, _stash_buffer_reused_early)


def _problems(cls) -> list[str]:
    return [f"{check.__name__}: {p}" for check in CHECKS for p in check(cls)]


def _method(site: str) -> str:
    return site.split(":")[1].split("@")[0]


def test_every_ordering_call_is_needed():
    """The transport passes the checks; switched off at any one call site on any one stream it
    reaches, it fails them (a surviving mutant is a wait the fake cannot tell from none)."""
    assert _problems(CudaTransport) == []
    switch = Switch()
    routed, sites = routed_transport(switch)
    assert _problems(routed.CudaTransport) == []
    assert {site for site, _ in switch.reached} == set(sites), "a call site the checks never reach"
    for method in ("wait_stream", "record_stream"):  # every copy is ordered after compute, and kept
        assert {s for site, s in switch.reached if _method(site) == method} == set(STREAMS), switch.reached
    survivors = []
    for mutant in sorted(switch.reached):
        switch.off = mutant
        if not _problems(routed.CudaTransport):
            survivors.append(mutant)
    assert survivors == [], f"removing these ordering calls goes unnoticed: {survivors}"


def test_compute_on_an_unwatched_thread_is_an_error():
    """The fake sees compute kernels only on watched threads: the compute stream used on any
    other is an error, not an ordering silently left unchecked."""
    for watched in (False, True):
        fake = FakeCuda()
        t = _transport(CudaTransport, fake)
        with fake if watched else contextlib.nullcontext():
            t.upload(t.host_alloc(2, np.float32)).wait()
        unseen = [e for e in fake.errors if "does not see" in e]
        assert len(unseen) == (0 if watched else 1), fake.errors
