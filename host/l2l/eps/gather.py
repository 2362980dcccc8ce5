"""The sharded EPS's device copies, gathered from their owners a window ahead of the relay.

Each machine keeps only its slice of every entry's device copy. The relay fetches whole
copies, in an order it knows before a pass starts (a training step: forward ascending,
backward descending; an evaluation: ascending per batch), and declares that order, its
**route** (:meth:`CopyGather.declare`). One thread per machine walks the routes in the
order they were declared, and for each position gathers the entry's slices from their
owners into a new buffer (R broadcasts, :meth:`~l2l.distributed.ShardCollectives.gather`,
on a process group of its own), at most :data:`GATHER_WINDOW` positions ahead of the
slowest of the machine's workers: the gather of the next layer runs while the relay
computes the current one, and a machine holds the window plus the copy each worker
computes with, never every copy.

**Why every machine gathers in the same order.** A collective pairs the i-th call of each
machine. The routes are a function of the model and of the passes, which every machine
runs alike, and the gather thread follows them and nothing else: not the timing of the
relay, which differs between machines (a machine with K workers takes the first worker's
declaration of a training step as its route; the others join it).

**Why a gathered copy is the one the relay would have read.** A step's updates land after
the step's last fetch of each entry (an entry's gradient is handed over after its last
use in the step), and a training pass updates exactly the entries on its route (a step
that leaves a block out, ``l2l.depth``, neither fetches nor updates it), so a pass needs,
of each entry, the updates of the training passes declared before it whose routes hold
the entry, and no other. The gather of an entry waits until the server has settled that many
updates of it (applied or, not finite, skipped: ``wait_settled``); its slice is read
before the entry's next update can start, which needs the relay to have fetched it.

**Lifetime.** A position's buffer leaves the window once each consumer of the pass (its
workers; one for an evaluation) has fetched it; the relay then holds it as long as it
computes with the layer (on the CPU its weights are views of the buffer). Buffers are not
reused: each gather allocates (``alloc``: pinned memory on CUDA, from torch's caching
host allocator, which reuses a block only after the copies that read it have run).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

GATHER_WINDOW = 1  # gathered entries not yet fetched by every worker, at most, per machine
WAIT_S = 0.2       # how often a waiting caller looks for an error elsewhere


@dataclass
class _Pass:
    route: list[int]
    consumers: int
    train: bool
    trained_before: dict[int, int]  # entry -> training passes declared before this one that update it
    joined: set[int] = field(default_factory=set)
    done: int = 0                 # consumers that fetched the whole route


class CopyGather:
    """The copies of one sharded EPS, gathered as the relay's declared routes need them.

    ``local(entry)``: this machine's slice of the entry's copy; ``bounds(entry)``: every
    machine's ``(lo, hi)``; ``gather(entry, full, bounds)``: the collective filling ``full``
    from the owners; ``wait_settled(entry, n)``: blocks until the server has settled ``n``
    updates of the entry; ``check()``: raises the server's error, if any."""

    def __init__(self, *, numels: dict[int, int], dtype: np.dtype, rank: int,
                 local: Callable[[int], np.ndarray], bounds: Callable[[int], list[tuple[int, int]]],
                 gather: Callable[[int, np.ndarray, list[tuple[int, int]]], None],
                 wait_settled: Callable[[int, int], None], check: Callable[[], None],
                 alloc: Callable[[int, np.dtype], np.ndarray], window: int = GATHER_WINDOW) -> None:
        if window < 1:
            raise ValueError("the gather window must hold at least one entry")
        self._numels, self._dtype, self._rank = numels, np.dtype(dtype), rank
        self._local, self._bounds, self._gather = local, bounds, gather
        self._wait_settled, self._check, self._alloc = wait_settled, check, alloc
        self.window = window
        self._cv = threading.Condition()
        self._passes: dict[int, _Pass] = {}
        self._declared = 0       # passes declared so far: the next one's index
        self._trained: dict[int, int] = {}  # entry -> training passes declared so far that update it
        self._cursor: dict[int, tuple[int, int]] = {}  # worker -> (pass, next position)
        self._ready: dict[tuple[int, int], np.ndarray] = {}
        self._taken: dict[tuple[int, int], int] = {}
        self._in_window = 0      # positions gathered or being gathered, not yet fetched by all
        self.peak_in_window = 0
        self.gathered = 0        # positions gathered (a test's and a benchmark's figure)
        self.sent_bytes = 0      # what this machine's slices of training passes sent the others
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="eps-gather", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------- the relay's side
    def declare(self, worker: int, route: list[int], *, train: bool, consumers: int) -> None:
        """``worker`` will fetch ``route`` next: a new pass, or (``consumers`` > 1) the oldest
        pass of the same route that ``worker`` has not joined yet."""
        with self._cv:
            self._raise()
            index = None
            if consumers > 1:
                index = next((i for i, p in sorted(self._passes.items()) if p.consumers == consumers
                              and p.train == train and worker not in p.joined and p.route == route), None)
            if index is None:
                index = self._declared
                entries = set(route)
                self._passes[index] = _Pass(list(route), consumers, train,
                                            {e: self._trained.get(e, 0) for e in entries})
                self._declared += 1
                if train:
                    for e in entries:
                        self._trained[e] = self._trained.get(e, 0) + 1
            self._passes[index].joined.add(worker)
            self._cursor[worker] = (index, 0)
            self._cv.notify_all()

    def fetch(self, worker: int, entry: int) -> np.ndarray:
        """The whole copy of ``entry``, the next position of ``worker``'s route."""
        with self._cv:
            if worker not in self._cursor:
                raise RuntimeError(f"fetch of entry {entry} before its pass declared a route")
            index, pos = self._cursor[worker]
            p = self._passes[index]
            if pos >= len(p.route) or p.route[pos] != entry:
                expected = p.route[pos] if pos < len(p.route) else "nothing"
                raise RuntimeError(f"fetch of entry {entry} where the declared route has {expected}")
            key = (index, pos)
            while key not in self._ready:
                self._raise()
                self._check()
                self._cv.wait(WAIT_S)
            copy = self._ready[key]
            self._taken[key] = self._taken.get(key, 0) + 1
            if self._taken[key] == p.consumers:
                del self._ready[key], self._taken[key]
                self._in_window -= 1
            self._cursor[worker] = (index, pos + 1)
            if pos + 1 == len(p.route):
                p.done += 1
                del self._cursor[worker]
                if p.done == p.consumers:
                    del self._passes[index]
            self._cv.notify_all()
            return copy

    def close(self) -> None:
        """Stop the thread (it ends at its next wait, or after the collective under way)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=5 * WAIT_S)

    # ----------------------------------------------------------- the gather thread
    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def _next(self, index: int, pos: int) -> tuple[int, int] | None:
        """The position after ``(index, pos)`` once it is declared and the window has room;
        None when closed."""
        with self._cv:
            while True:
                if self._closed:
                    return None
                p = self._passes.get(index)
                if p is not None and pos >= len(p.route):
                    index, pos = index + 1, 0
                    continue
                if p is not None and self._in_window < self.window:
                    self._in_window += 1
                    self.peak_in_window = max(self.peak_in_window, self._in_window)
                    return index, pos
                if p is None and index < self._declared:  # fully fetched already (an empty route)
                    index, pos = index + 1, 0
                    continue
                self._cv.wait(WAIT_S)

    def _run(self) -> None:
        index, pos = 0, 0
        try:
            while (at := self._next(index, pos)) is not None:
                index, pos = at
                with self._cv:
                    p = self._passes[index]
                    entry, trained_before, train = p.route[pos], p.trained_before[p.route[pos]], p.train
                copy = self._gather_one(entry, trained_before, train)
                with self._cv:
                    self._ready[(index, pos)] = copy
                    self.gathered += 1
                    self._cv.notify_all()
                pos += 1
        except BaseException as exc:  # raised to the relay at its next fetch
            with self._cv:
                self._error = exc
                self._cv.notify_all()

    def _gather_one(self, entry: int, updates: int, train: bool) -> np.ndarray:
        n = self._numels[entry]
        full = self._alloc(n, self._dtype)
        if n == 0:
            return full
        self._wait_settled(entry, updates)
        bounds = self._bounds(entry)
        lo, hi = bounds[self._rank]
        full[lo:hi] = self._local(entry)
        self._gather(entry, full, bounds)
        if train:
            self.sent_bytes += (hi - lo) * full.itemsize * (len(bounds) - 1)
        return full
