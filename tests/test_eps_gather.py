"""The sharded EPS's copy gather (``l2l.eps.gather``), R machines as threads.

The properties the torchrun tests cannot see from outside: every machine gathers the same
entries in the same order however its K workers interleave; a fetch returns the copy of
the updates settled before its pass and never a later one; no machine holds more than
the window ahead of its slowest worker; a wrong fetch or a failed collective is one error
at the relay, not a hang.
"""
from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest

from l2l.eps.gather import CopyGather


class Team:
    """R machines' broadcasts: every call is the same entry on every machine (or an error)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.barrier = threading.Barrier(world)
        self.slots: list = [None] * world
        self.calls: list[list[int]] = [[] for _ in range(world)]

    def gather(self, rank: int):
        def call(entry: int, full: np.ndarray, bounds) -> None:
            self.calls[rank].append(entry)
            lo, hi = bounds[rank]
            self.slots[rank] = (entry, full[lo:hi].copy())
            self.barrier.wait(timeout=20)
            entries = {s[0] for s in self.slots}
            assert entries == {entry}, f"machines gathered different entries at once: {entries}"
            for r, (a, b) in enumerate(bounds):
                full[a:b] = self.slots[r][1]
            self.barrier.wait(timeout=20)
        return call


class Machine:
    """One machine's slices: entry e's element i holds ``1000 * version + i`` once ``version``
    updates of e are settled; the update of a pass bumps it at the pass's end."""

    def __init__(self, rank: int, world: int, numels: dict[int, int], team: Team, window: int) -> None:
        self.rank, self.world, self.numels = rank, world, numels
        self.version = {e: 0 for e in numels}
        self.cv = threading.Condition()
        self.slices = {e: self.values(e, 0)[slice(*self.bounds(e)[rank])] for e in numels}
        self.gather = CopyGather(numels=numels, dtype=np.float32, rank=rank, local=self.slices.__getitem__,
                                 bounds=self.bounds, gather=team.gather(rank), wait_settled=self.wait_settled,
                                 check=lambda: None, alloc=lambda n, d: np.empty(n, d), window=window)

    def values(self, e: int, version: int) -> np.ndarray:
        return 1000.0 * version + np.arange(self.numels[e], dtype=np.float32)

    def bounds(self, e: int):
        n = self.numels[e]
        cuts = [n * r // self.world for r in range(self.world + 1)]
        return list(zip(cuts, cuts[1:]))

    def settle(self, e: int) -> None:
        with self.cv:
            self.version[e] += 1
            self.slices[e][:] = self.values(e, self.version[e])[slice(*self.bounds(e)[self.rank])]
            self.cv.notify_all()

    def settle_late(self, entries: list[int]) -> None:
        for e in entries:
            time.sleep(0.005)
            self.settle(e)

    def wait_settled(self, e: int, n: int) -> None:
        with self.cv:
            assert self.cv.wait_for(lambda: self.version[e] >= n, timeout=20)


def _run(world: int, workers: int, passes: list[tuple[bool, list[int]]], numels, window=2, seed=0):
    team = Team(world)
    machines = [Machine(r, world, numels, team, window) for r in range(world)]
    errors, seen = [], {}

    def worker(m: Machine, k: int, barrier: threading.Barrier) -> None:
        rng = random.Random(seed * 100 + m.rank * 10 + k)
        try:
            trained = 0
            for n, (train, route) in enumerate(passes):
                if train or k == 0:  # one worker evaluates, between steps
                    m.gather.declare(k, route, train=train, consumers=workers if train else 1)
                    for pos, e in enumerate(route):
                        time.sleep(rng.random() * 0.002)
                        copy = m.gather.fetch(k, e)
                        seen[m.rank, k, n, pos] = copy.copy()
                        assert np.array_equal(copy, m.values(e, trained)), (m.rank, k, n, pos, e)
                        assert m.gather.peak_in_window <= window
                barrier.wait(timeout=20)  # the pass ends for every worker of the machine
                if train:
                    if k == 0:  # the step's updates, late, in backward order, on the EPS thread
                        threading.Thread(target=m.settle_late, args=(sorted(numels, reverse=True),)).start()
                    trained += 1
        except BaseException as exc:  # noqa: BLE001 -- reported by the test
            errors.append(exc)

    threads = []
    for m in machines:
        barrier = threading.Barrier(workers)
        for k in range(workers):
            threads.append(threading.Thread(target=worker, args=(m, k, barrier)))
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for m in machines:
        m.gather.close()
    return machines, team, errors, seen


NUMELS = {0: 5, 1: 40, 2: 33, 3: 0, 4: 17}
TRAIN = [0, 1, 2, 3, 4, 2, 1, 0]  # forward and post, then backward (entry 3: an empty pre stage)
EVAL = [0, 1, 2, 3, 4] * 2


@pytest.mark.parametrize("world,workers", [(2, 1), (3, 2), (4, 3)])
def test_every_machine_gathers_the_route_in_one_order_and_sees_settled_updates(world, workers):
    passes = [(True, TRAIN), (False, EVAL), (True, TRAIN), (True, TRAIN), (False, EVAL)]
    machines, team, errors, seen = _run(world, workers, passes, NUMELS, seed=world)
    assert errors == []
    expected = [e for train, route in passes for e in route if NUMELS[e]]
    assert all(calls == expected for calls in team.calls)    # same entries, same order, once per position
    for m in machines:
        assert m.gather.gathered == sum(len(r) for _, r in passes)
        assert 1 <= m.gather.peak_in_window <= m.gather.window
    assert len(seen) == world * (workers * 3 * len(TRAIN) + 2 * len(EVAL))


def test_the_gather_runs_ahead_of_a_slow_relay_by_the_window_only():
    team = Team(1)
    m = Machine(0, 1, NUMELS, team, window=2)
    m.gather.declare(0, TRAIN, train=True, consumers=1)
    deadline = time.time() + 10
    while m.gather.gathered < 2 and time.time() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    assert m.gather.gathered == 2 and m.gather.peak_in_window == 2   # ahead, but no further
    assert np.array_equal(m.gather.fetch(0, 0), m.values(0, 0))
    deadline = time.time() + 10
    while m.gather.gathered < 3 and time.time() < deadline:
        time.sleep(0.01)
    assert m.gather.gathered == 3
    m.gather.close()


def test_a_fetch_off_the_route_is_an_error():
    team = Team(1)
    m = Machine(0, 1, NUMELS, team, window=2)
    with pytest.raises(RuntimeError, match="before its pass declared"):
        m.gather.fetch(0, 0)
    m.gather.declare(0, TRAIN, train=True, consumers=1)
    with pytest.raises(RuntimeError, match="route has 0"):
        m.gather.fetch(0, 1)
    m.gather.close()


def test_a_failed_collective_reaches_the_relay():
    def broken(entry, full, bounds):
        raise ConnectionError("a machine died")
    g = CopyGather(numels=NUMELS, dtype=np.float32, rank=0, local=lambda e: np.zeros(NUMELS[e], np.float32),
                   bounds=lambda e: [(0, NUMELS[e])], gather=broken, wait_settled=lambda e, n: None,
                   check=lambda: None, alloc=lambda n, d: np.empty(n, d))
    g.declare(0, TRAIN, train=True, consumers=1)
    with pytest.raises(ConnectionError, match="a machine died"):
        g.fetch(0, 0)
    g.close()


def test_lent_buffers_are_reused_only_when_let_go_and_after_the_fence():
    """CUDA's gathered copies (``relay/transport.py`` ``LentBuffers``): a buffer the relay still
    holds is never handed out again; one it let go of is, after the uploads' fence."""
    from l2l.relay.transport import LentBuffers
    made, fences = [], []

    def alloc(n, dtype):
        made.append(np.empty(n, dtype))
        return made[-1]
    lend = LentBuffers(alloc, lambda: fences.append(len(made)))
    a = lend(8, np.float32)
    b = lend(8, np.float32)                       # a is still held: a new buffer
    assert len(made) == 2 and not np.shares_memory(a, b) and fences == []
    a[:] = 1.0
    del a
    c = lend(8, np.float32)                       # a's buffer, after the fence
    assert len(made) == 2 and np.shares_memory(c, made[0]) and fences == [2]
    d = lend(4, np.float32)                       # another size: its own buffer
    assert len(made) == 3 and d.size == 4
    del b, c, d
