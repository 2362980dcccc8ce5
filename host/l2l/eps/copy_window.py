"""The EPS's device copies on disk (``--eps-offload-copies``): a read-ahead window in fetch order.

The relay fetches every layer's device copy twice a step, in a fixed order: ascending in
forward (and in evaluation), descending in backward. :class:`DiskCopies` keeps each
entry's copy in a file of its own (the :class:`~l2l.eps.disk_tier.DiskTier` layout
:func:`~l2l.eps.disk_tier.copy_layout`, checked like the state files) and, at each fetch,
predicts the direction from the last two fetches of neighbouring entries and reads the
next ``window`` entries ahead on one thread (the route turns at either end, as backward
follows forward). A fetch not predicted is read there and then: correct, only slower.
An update writes its new copy into a spare buffer, which then serves the fetches of that
entry and is written behind on another thread (at most ``window`` writes wait).

**When a buffer may be reused.** The relay may read a fetched copy until it releases the
layer (a torch view over the array, on the CPU without a copy; an asynchronous transport
also holds the next layer's, one ahead). So a fetch hands out one array per buffer,
made with ``np.frombuffer`` so that every view torch or numpy derives from it keeps it
alive, and a buffer is reused only when that array is dead (a weak reference says so).
A buffer still lent is never written: when every spare one is, a new one is made. On the
CPU the relay holds one layer at a time (it releases layer ``i`` before it fetches
``i + 1``), so the buffers alive are: ``window`` read ahead, the one fetched and the one
before it (kept for a second worker's fetch), ``window`` waiting to be written, the one an
update is writing, and :data:`SPARES` spares: ``2 * window + 5`` at most
(tests/test_eps_offload_copies.py counts them). A pool of ``window + 2`` would do for the
fetches alone; the write-behind needs its own ``window`` so that an update never waits for
the relay to let go of a copy. An asynchronous (CUDA) transport copies from the
buffer on a stream the CPU does not wait for, so a dead array does not prove the copy ran:
``--eps-offload-copies`` is refused with ``--device cuda`` until a fence is built.

**One place per buffer.** A buffer is in one place at a time: serving one entry (in
``_mem``), spare, or in the hands of the one call that took it out (an update's new copy
from :meth:`~DiskCopies.buffer` to :meth:`~DiskCopies.updated`; an entry's old copy, taken
out by ``updated`` or ``store``, until they give it back). Only the call holding it moves
it, under the lock; and an entry whose file is being replaced is not read ahead, so its
old copy cannot come back, and be given back twice, while the lock is let go (a buffer
spare twice would serve two entries at once: a fetch would hand out another entry's
weights). tests/test_eps_copy_window.py interleaves the threads to check it.
"""
from __future__ import annotations

import bisect
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from .disk_tier import BLOCK, DiskTier, Slab

SPARES = 2  # unlent spare buffers kept per size between uses


class _Copy:
    """One buffer: the image of an entry's copy file, and what is happening to it."""

    def __init__(self, slab: Slab) -> None:
        self.slab = slab
        self.read: Future | None = None    # the read that fills it, while under way
        self.write: Future | None = None   # its write to the file, once queued
        self._lent: weakref.ref | None = None

    @property
    def array(self) -> np.ndarray:
        """The copy, for the update to write into (never handed to the relay)."""
        return self.slab.arrays[0]

    def lend(self) -> np.ndarray:
        """The array the relay reads: one per buffer while any view of it lives."""
        lent = self._lent() if self._lent is not None else None
        if lent is None:
            n = self.slab.numel * self.slab.layout.dtype.itemsize
            lent = np.frombuffer(memoryview(self.slab.raw[BLOCK:BLOCK + n]), self.slab.layout.dtype)
            self._lent = weakref.ref(lent)
        return lent

    def lent(self) -> bool:
        return self._lent is not None and self._lent() is not None

    def idle(self) -> bool:
        return (self.read is None or self.read.done()) and (self.write is None or self.write.done())


class DiskCopies:
    """The device copies of a :class:`DiskTier` of the copy layout, ``window`` read ahead."""

    def __init__(self, tier: DiskTier, window: int = 2) -> None:
        if window < 1:
            raise ValueError(f"window must be at least 1 entry, not {window}")
        tier.prepare()
        self.tier, self.window = tier, window
        self._entries = sorted(tier.numels)
        self._mem: dict[int, _Copy] = {}              # entry -> its current copy in memory
        self._spare: dict[int, list[_Copy]] = {}      # numel -> buffers to reuse once not lent
        self._lock = threading.Lock()
        self._last: int | None = None
        self._keep: set[int] = set()  # the entries the last fetch wants in memory
        self._replacing: set[int] = set()  # entries whose old copy an update or store took out: not read ahead
        self._step = -1  # the predicted direction in the entry order: -1 backward, +1 forward
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eps-copy-read")
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eps-copy-write")
        self.reads_ahead = 0     # fetches served by a read ahead (or an update's new copy)
        self.reads_on_demand = 0  # fetches that read the file there and then

    # ------------------------------------------------------------ the relay's side
    def fetch(self, entry: int) -> np.ndarray:
        """The entry's copy as of its last update (the caller waited for a pending one)."""
        with self._lock:
            held = self._mem.get(entry)
            if held is None:
                self.reads_on_demand += 1
                held = self._mem[entry] = self._buffer(entry)
                held.read = Future()
                mine = held
            else:
                self.reads_ahead += 1
                mine = None
            # lent before the lock is let go: another worker's look-ahead may evict and refill
            # any buffer not lent (several relay workers fetch from their own threads)
            lent = held.lend()
            self._steer(entry)
            self._look_ahead(entry)
        if mine is not None:
            try:
                self.tier.read(entry, into=mine.slab)
                mine.read.set_result(None)
            except BaseException as exc:
                mine.read.set_exception(exc)
                with self._lock:
                    if self._mem.get(entry) is mine:
                        del self._mem[entry]
                raise
        if held.read is not None:
            held.read.result()  # a damaged file: its one-line error, here
        return lent

    def _steer(self, entry: int) -> None:
        """The direction of the fetches: set by two fetches of neighbouring entries, kept
        across others (a repeated fetch, a tied embedding's out of order)."""
        last, self._last = self._last, entry
        if last is not None:
            i, j = self._index(last), self._index(entry)
            if abs(j - i) == 1:
                self._step = j - i

    def _index(self, entry: int) -> int:
        return bisect.bisect_left(self._entries, entry)

    def _route(self, entry: int) -> list[int]:
        """The next ``window`` entries after ``entry`` in the predicted direction, turning at the ends."""
        out, i, step, n = [], self._index(entry), self._step, len(self._entries)
        for _ in range(2 * n):
            if len(out) >= self.window:
                break
            if not 0 <= i + step < n:
                step = -step
                if not 0 <= i + step < n:
                    break
            i += step
            e = self._entries[i]
            if e != entry and e not in out:
                out.append(e)
        return out

    def _look_ahead(self, entry: int) -> None:
        """Keep in memory the fetched entry, the one before, the route and the unwritten; read
        the route's missing entries; give the rest back to the spares (lock held)."""
        route = self._route(entry)
        self._keep = {entry, self._last_but_one(entry), *route}
        self._evict()
        for e in route:
            if e not in self._mem and e not in self._replacing:
                held = self._mem[e] = self._buffer(e)
                held.read = self._reader.submit(self.tier.read, e, held.slab)

    def _evict(self) -> None:
        """Give back to the spares every copy in memory that is neither to be kept nor busy (lock held)."""
        for e in list(self._mem):
            held = self._mem[e]
            if e in self._keep or not held.idle():
                continue
            del self._mem[e]
            if held.write is not None:
                held.write.result()  # a failed write is raised here: the relay's thread, or the update's
            self._give_back(held)

    def _last_but_one(self, entry: int) -> int:
        i = self._index(entry) - self._step
        return self._entries[i] if 0 <= i < len(self._entries) else entry

    # ------------------------------------------------------------ buffers
    def _buffer(self, entry: int) -> _Copy:
        """A buffer for ``entry``: a spare one with no I/O under way and no view alive, else a new
        one (lock held)."""
        spares = self._spare.setdefault(self.tier.numels[entry], [])
        for k, held in enumerate(spares):
            if held.idle() and not held.lent():
                del spares[k]
                self.tier.retarget(held.slab, entry)
                held.read = held.write = None
                return held
        return _Copy(self.tier.slab(entry))

    def _give_back(self, held: _Copy) -> None:
        spares = self._spare.setdefault(held.slab.numel, [])
        spares.append(held)
        unlent = [h for h in spares if not h.lent()]
        for extra in unlent[SPARES:]:  # the rest are freed (an I/O under way holds its own reference);
            # lent ones wait here until their views die
            spares.remove(extra)

    # ------------------------------------------------------------ the update's side
    def buffer(self, entry: int) -> _Copy:
        """A buffer for the entry's new copy (``.array``): then :meth:`updated` or :meth:`discard`."""
        with self._lock:
            return self._buffer(entry)

    def updated(self, entry: int, held: _Copy) -> None:
        """``held`` has the entry's new copy: it serves the entry's fetches from now on, and is
        written behind (at most ``window`` writes wait: the oldest is waited for)."""
        old = self._take_out(entry)
        if old is not None and old.read is not None:
            old.read.exception()  # a read of the old copy still filling its buffer: not under the write
        with self._lock:
            self._replacing.discard(entry)
            self._mem[entry] = held
            held.write = self._writer.submit(self.tier.store, held.slab)  # after the entry's older writes
            if old is not None:
                self._give_back(old)
            waiting = [h.write for h in self._mem.values() if h.write is not None and not h.write.done()]
        for fut in waiting[:max(0, len(waiting) - self.window)]:
            fut.result()
        with self._lock:
            self._evict()  # the relay may be fetching far from here: written copies go

    def discard(self, held: _Copy) -> None:
        """The update was skipped: the buffer holds nothing."""
        with self._lock:
            self._give_back(held)

    def store(self, entry: int, held: _Copy) -> None:
        """Write ``held`` as the entry's copy now (a new entry, a checkpoint loaded)."""
        old = self._take_out(entry)
        try:
            if old is not None:
                for fut in (old.read, old.write):
                    if fut is not None:
                        fut.exception()
            self.tier.store(held.slab)
        finally:
            with self._lock:
                self._replacing.discard(entry)
                if old is not None:
                    self._give_back(old)
                self._give_back(held)

    def _take_out(self, entry: int) -> _Copy | None:
        """The entry's copy in memory, now the caller's to give back; the entry is not read
        ahead until the caller has put its new copy in place."""
        with self._lock:
            self._replacing.add(entry)
            return self._mem.pop(entry, None)

    # ------------------------------------------------------------ accounting, end
    def buffers_alive(self) -> int:
        """Copy buffers in memory now (the tier's footprint, in entries)."""
        with self._lock:
            return len(self._mem) + sum(len(s) for s in self._spare.values())

    def flush(self) -> None:
        """Wait for every pending write of a copy (raising the first that failed)."""
        with self._lock:
            pending = [h.write for h in self._mem.values() if h.write is not None]
        for fut in pending:
            fut.result()

    def close(self) -> None:
        """Wait for the pending writes (raising the first that failed), then close the files."""
        try:
            self._reader.shutdown(wait=True)
            self._writer.shutdown(wait=True)
            with self._lock:
                held = list(self._mem.values())
            for h in held:
                if h.write is not None:
                    h.write.result()
        finally:
            self.tier.close()
