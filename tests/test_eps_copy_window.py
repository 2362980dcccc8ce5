"""The copy window's buffers under chosen interleavings (l2l.eps.copy_window).

The update's thread and the relay's thread share the window's buffers. Here the window's
lock is a stand-in that stops the update's thread between two of its critical sections
until the test lets it go, so the relay's fetches (and their evictions) run in that gap in
a fixed order, and that after every critical section checks the module's invariant: a
buffer is in one place at a time (serving one entry, or spare), and the buffer serving an
entry holds that entry. Every fetch is checked against the entry's known contents.
"""
from __future__ import annotations

import threading
import uuid

import numpy as np
import pytest

from l2l.eps.copy_window import DiskCopies
from l2l.eps.disk_tier import DiskTier, copy_layout

N, ENTRIES = 256, 8
TIMEOUT = 10.0  # seconds; only ever reached when something hangs


class SteppedLock:
    """A lock that pauses one armed thread before its ``after``-th next acquisition (1: the
    next) until :meth:`go`, and records every broken invariant when any thread lets go."""

    def __init__(self, copies: DiskCopies) -> None:
        self._lock, self._copies = threading.Lock(), copies
        self._armed: threading.Thread | None = None
        self._left = 0
        self.paused, self._go = threading.Event(), threading.Event()
        self.broken: list[str] = []

    def arm(self, thread: threading.Thread, after: int) -> None:
        self._armed, self._left = thread, after

    def go(self) -> None:
        self._go.set()

    def __enter__(self):
        if threading.current_thread() is self._armed:
            self._left -= 1
            if self._left == 0:
                self._armed = None
                self.paused.set()
                assert self._go.wait(TIMEOUT), "the test never let the paused thread go"
        self._lock.acquire()
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.broken += _broken(self._copies)
        finally:
            self._lock.release()


def _broken(copies: DiskCopies) -> list[str]:
    """What breaks the window's invariant now (its lock held)."""
    places: dict[int, list[str]] = {}
    for e, held in copies._mem.items():
        places.setdefault(id(held), []).append(f"entry {e}")
        if held.slab.entry != e:
            places[id(held)].append(f"(it holds entry {held.slab.entry})")
    for spares in copies._spare.values():
        for held in spares:
            places.setdefault(id(held), []).append("spare")
    return [" and ".join(p) for p in places.values() if len(p) > 1]


@pytest.fixture
def window(tmp_path):
    """A window of 1 over ENTRIES equal-sized copies, entry e's copy all e; its lock stepped."""
    tier = DiskTier(tmp_path, uuid.uuid4().hex, {e: N for e in range(ENTRIES)}, layout=copy_layout(np.float32))
    copies = DiskCopies(tier, window=1)
    for e in range(ENTRIES):
        held = copies.buffer(e)
        held.array[...] = e
        copies.store(e, held)
    copies._lock = lock = SteppedLock(copies)
    yield copies, lock
    lock.go()
    copies.close()


def _fetch(copies: DiskCopies, want: dict[int, float], entry: int) -> None:
    """Fetch ``entry``, check it, let go of it and wait for the reads it started (so that
    which buffers are idle is the same on every run)."""
    got = copies.fetch(entry)
    assert np.all(got == want[entry]), f"fetch({entry}) gave the copy {got[0]:g}, not {want[entry]:g}"
    del got
    with copies._lock:
        reads = [h.read for h in copies._mem.values() if h.read is not None]
    for fut in reads:
        fut.exception(TIMEOUT)


def _rewrite_during(copies: DiskCopies, lock: SteppedLock, rewrite, after: int, fetches, want) -> None:
    """Run ``rewrite`` on a thread of its own, paused before its ``after``-th lock acquisition
    while the relay fetches ``fetches``; then let it finish."""
    box: dict = {}

    def run():
        try:
            rewrite()
        except BaseException as exc:  # noqa: BLE001 -- handed to the test
            box["error"] = exc
    th = threading.Thread(target=run, daemon=True)
    lock.arm(th, after)
    th.start()
    assert lock.paused.wait(TIMEOUT), "the rewrite never reached its pause"
    for e in fetches:
        _fetch(copies, want, e)
    lock.go()
    th.join(TIMEOUT)
    assert not th.is_alive() and "error" not in box, box


def test_an_eviction_in_an_updates_gap_does_not_give_its_old_copy_back_twice(window):
    """An update takes the entry's old copy out and gives it back later; in between, the relay
    moves far away and its eviction runs. The old copy must reach the spares once: given back
    twice, it serves another entry and is lent again for a third, and a fetch returns
    another entry's weights."""
    copies, lock = window
    want = {e: float(e) for e in range(ENTRIES)}
    for e in range(4):  # forward as far as entry 3: its copy is in memory, read and idle
        _fetch(copies, want, e)
    held = copies.buffer(3)
    held.array[...] = want[3] = 103.0

    # pause the update after it took entry 3's old copy out: before its next critical section
    _rewrite_during(copies, lock, lambda: copies.updated(3, held), after=2, fetches=[7, 6], want=want)
    assert lock.broken == [], lock.broken
    for e in (0, 5, 1, 2, 3, 4, 5, 6, 7, 3):  # given back twice, entry 3's old copy would serve 0 and 5
        _fetch(copies, want, e)
    copies.flush()
    assert lock.broken == [], lock.broken


def test_a_store_is_not_read_ahead_while_it_writes(window):
    """A store (a checkpoint's load) writes the entry's file; a look-ahead in the meantime
    must not bring the old file's copy back to serve the entry's fetches."""
    copies, lock = window
    want = {e: float(e) for e in range(ENTRIES)}
    _fetch(copies, want, 0)
    held = copies.buffer(3)
    held.array[...] = 203.0

    real_store = copies.tier.store
    started, written = threading.Event(), threading.Event()

    def gated_store(slab):  # the file write, held until the relay has fetched its neighbour
        started.set()
        assert written.wait(TIMEOUT)
        real_store(slab)
    copies.tier.store = gated_store
    th = threading.Thread(target=copies.store, args=(3, held), daemon=True)
    th.start()
    assert started.wait(TIMEOUT)
    _fetch(copies, want, 1)
    _fetch(copies, want, 2)  # the route ahead: entry 3
    written.set()
    th.join(TIMEOUT)
    assert not th.is_alive()
    copies.tier.store = real_store
    want[3] = 203.0
    _fetch(copies, want, 3)
    assert lock.broken == [], lock.broken
