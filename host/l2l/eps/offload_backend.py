"""Any EPS backend with its state (``p`` and the moments) on disk: a window of layers in memory, the rest in files.

L2L updates entries in a fixed order (backward: the highest entry first, entry 0 last, then
the next step's backward from the top again; a held step commits in ascending order and
says so through :meth:`expect`). So :class:`OffloadedBackend` reads the next ``window``
entries ahead on one thread, hands each to the inner backend just before its update
(:meth:`EpsBackend.adopt`), takes it back after (:meth:`EpsBackend.release`) and writes it
behind on another thread, at most ``window`` entries waiting. In memory at once: at most
``window`` entries read ahead, ``window`` waiting to be written and the one updating. An
entry the window did not foresee (a tied embedding, updated when its last contribution
arrives) is read when asked for: correct, only slower. A skipped (non-finite) update
writes nothing. The inner backend sees host arrays as always, so numpy, OpenCL and the
HLS C-simulation all run on disk unchanged, with the same bits.

Everything else (device copies, checkpoints, a resume's load) goes through the files,
after the entry's pending write.

**One place per slab.** No slab is reused: each read makes its own, which passes from the
reader (a future in ``_ahead``) to the one update that pops it (under the lock) to the
writer, then dies; so none can be held twice, the hazard of the copies' buffer pool
(:mod:`l2l.eps.copy_window`). Only :meth:`step` runs on the server's worker; the server
makes the state calls while that worker is idle (after ``synchronize``), and
:meth:`expect` at a commit names only held entries, whose last updates are done (each
one's check waited for it): a read ahead never races its entry's update.

The copies' window lends reusable buffers to the relay's threads for as long as their
views live, in the fetch order it predicts; this one hands a slab to one update at a time
in the update order it is told. They share the pattern of a reader and a writer thread,
not a buffer discipline: one implementation of both would be larger than the two.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Sequence

import numpy as np

from .backend import EpsBackend, check_state, read_only
from .contract import StepScalars
from .disk_tier import DiskTier, IoLedger, Slab


class OffloadedBackend(EpsBackend):
    name = "offload"

    def __init__(self, inner: EpsBackend, tier: DiskTier, window: int = 2) -> None:
        if window < 1:
            raise ValueError(f"window must be at least 1 layer, not {window}")
        self.inner, self.tier, self.window = inner, tier, window
        tier.prepare()
        self._order = sorted(tier.numels, reverse=True)  # the default: backward, wrapping to the top
        self._hint: list[int] | None = None
        self._ahead: OrderedDict[int, Future] = OrderedDict()   # entry -> its read (a Slab)
        self._writes: OrderedDict[int, Future] = OrderedDict()  # entry -> its write, oldest first
        self._fresh: Slab | None = None  # the entry just allocated or loaded, for its write_copy
        self._raised: set[int] = set()  # the I/O errors already raised (by id)
        self._lock = threading.Lock()
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eps-disk-read")
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eps-disk-write")
        self.reads_ahead = 0   # updates served by the read-ahead
        self.reads_on_demand = 0  # updates that waited for their read

    def describe(self) -> str:
        return f"{self.inner.describe()}, its state in files in {self.tier.directory}"

    # ------------------------------------------------------------ order
    def expect(self, order: list[int]) -> None:
        order = [e for e in order if e in self.tier.numels]
        self._hint = order or None
        if order:
            self._read_ahead(order[:self.window])

    def _upcoming(self, entry: int) -> list[int]:
        """The entries expected after ``entry``'s update, nearest first (at most ``window``)."""
        hint = self._hint
        if hint is not None and entry in hint:
            rest = hint[hint.index(entry) + 1:]
            if rest:
                return rest[:self.window]
            self._hint = None  # the held step is done: the next backward, from the top
            return [e for e in self._order if e != entry][:self.window]
        self._hint = None
        i = self._order.index(entry)
        return (self._order[i + 1:] + self._order[:i])[:self.window]

    def _read_ahead(self, upcoming: list[int]) -> None:
        """Keep reads of exactly ``upcoming`` in the window: others are dropped (they are clean
        copies), then the missing ones queued, each after its entry's pending write."""
        dropped = []
        with self._lock:
            for entry in list(self._ahead):
                if entry not in upcoming:
                    fut = self._ahead.pop(entry)
                    if not fut.cancel():
                        dropped.append(fut)
        for fut in dropped:  # a read under way still holds memory: let it finish first
            fut.exception()
        with self._lock:
            for entry in upcoming:
                if entry not in self._ahead:
                    self._ahead[entry] = self._reader.submit(self._read_after, entry, self._writes.get(entry))

    def _read_after(self, entry: int, write: Future | None) -> Slab:
        if write is not None:
            write.result()
        return self.tier.read(entry)

    # ------------------------------------------------------------ entries in and out
    def _take(self, entry: int) -> Slab:
        """The entry's state for its update: from the window, or read now."""
        with self._lock:
            fut = self._ahead.pop(entry, None)
        if fut is not None:
            self.reads_ahead += 1
            return self._value(fut)
        self.reads_on_demand += 1
        self._wait_write(entry)
        return self.tier.read(entry)

    def _current(self, entry: int) -> tuple[Slab, bool]:
        """(the entry's state as in its file, whether the caller may keep it) without
        disturbing the window: the slab just written, one read ahead, or a new read."""
        held = self._in_memory(entry)
        if held is not None:
            return held, False
        self._wait_write(entry)
        return self.tier.read(entry), True

    def _in_memory(self, entry: int) -> Slab | None:
        """The entry's state as in its file when the window holds it: the slab just written,
        or one read ahead; else None."""
        fresh = self._fresh
        if fresh is not None and fresh.entry == entry:
            return fresh
        with self._lock:
            fut = self._ahead.get(entry)
        return self._value(fut) if fut is not None else None

    def _forget(self, entry: int) -> None:
        """The entry is about to be rewritten: drop its read ahead and wait for its pending write."""
        with self._lock:
            fut = self._ahead.pop(entry, None)
        if fut is not None and not fut.cancel():
            fut.exception()
        self._wait_write(entry)
        if self._fresh is not None and self._fresh.entry == entry:
            self._fresh = None

    def _outcome(self, fut: Future) -> None:
        """Wait for a write, raising its I/O error only once: a write that failed is also what
        the reads queued after it and every later wait would raise again (the first raise
        has ended the run; ``close`` then cleans up quietly)."""
        exc = fut.exception()
        if exc is not None and id(exc) not in self._raised:
            self._raised.add(id(exc))
            raise exc

    def _value(self, fut: Future) -> Slab:
        """A read's slab; its error (perhaps the failed write it waited for) counts as raised."""
        try:
            return fut.result()
        except BaseException as exc:
            self._raised.add(id(exc))
            raise

    def _wait_write(self, entry: int) -> None:
        with self._lock:
            fut = self._writes.get(entry)
        if fut is not None:
            self._outcome(fut)  # an I/O error surfaces here, in the caller's thread

    def _write_behind(self, slab: Slab) -> None:
        """Queue the slab's write; at most ``window`` writes wait (the oldest is waited for)."""
        self._settle_writes()
        while True:
            with self._lock:
                self._writes.pop(slab.entry, None)  # its former write is done (_take waited for it)
                if len(self._writes) < self.window:
                    self._writes[slab.entry] = self._writer.submit(self.tier.store, slab)
                    return
                oldest = next(iter(self._writes.values()))
            self._outcome(oldest)
            self._settle_writes()

    def _settle_writes(self) -> None:
        """Forget the finished writes, raising the first one that failed."""
        with self._lock:
            done = [(e, f) for e, f in self._writes.items() if f.done()]
            for e, _ in done:
                del self._writes[e]
        for _, fut in done:
            self._outcome(fut)

    @property
    def optimizers(self) -> frozenset[str]:
        return self.inner.optimizers

    def _moments(self) -> int:
        return self.tier.layout.regions - 1

    def _store_now(self, entry: int, *arrays: np.ndarray) -> None:
        self._forget(entry)
        slab = self.tier.slab(entry)
        for dst, src in zip(slab.arrays, arrays):
            dst[...] = src
        self.tier.store(slab)
        self._fresh = slab

    # ------------------------------------------------------------ EpsBackend
    def allocate(self, layer: int, p: np.ndarray, moments: int = 2) -> None:
        if layer not in self.tier.numels:
            raise ValueError(f"entry {layer} is not one of the disk tier's")
        if moments != self._moments():
            raise ValueError(f"entry {layer}: {moments} moments, the tier's files hold {self._moments()}")
        p = np.asarray(p, dtype=np.float32).reshape(-1)
        if p.shape != (self.tier.numels[layer],):
            raise ValueError(f"entry {layer}: {p.shape[0]} weights, the tier holds {self.tier.numels[layer]}")
        self._forget(layer)
        slab = self.tier.slab(layer)  # zeroed: the moments start at zero
        slab.arrays[0][...] = p
        self.tier.store(slab)
        self._fresh = slab

    def step(self, layer: int, grads: Sequence[np.ndarray], scalars: StepScalars,
             copy_out: np.ndarray, n_decay: int | None = None) -> bool:
        self._fresh = None
        self._settle_writes()
        slab = self._take(layer)
        self._read_ahead(self._upcoming(layer))  # the next reads overlap this update
        self.inner.adopt(layer, *slab.arrays)
        try:
            finite = self.inner.step(layer, grads, scalars, copy_out, n_decay=n_decay)
            if finite:  # a skipped update changed nothing: nothing to write
                for dst, src in zip(slab.arrays, self.inner.state_view(layer)):
                    if dst.ctypes.data != src.ctypes.data:  # the inner backend kept a copy of its own
                        dst[...] = src
                self._write_behind(slab)
        finally:
            self.inner.release(layer)
        return finite

    def write_copy(self, layer: int, copy_out: np.ndarray) -> None:
        slab, _ = self._current(layer)
        self.inner.adopt(layer, *slab.arrays)
        try:
            self.inner.write_copy(layer, copy_out)
        finally:
            self.inner.release(layer)

    def read_state(self, layer: int):
        slab, own = self._current(layer)
        return tuple(a if own else a.copy() for a in slab.arrays)

    def read_master(self, layer: int) -> np.ndarray:
        """``p`` from the window, else from the file's ``p`` region alone (m and v stay on disk)."""
        held = self._in_memory(layer)
        if held is not None:
            return held.arrays[0].copy()
        self._wait_write(layer)
        return self.tier.read_masters(layer)

    def state_view(self, layer: int):
        slab, _ = self._current(layer)
        return tuple(read_only(a) for a in slab.arrays)

    def write_state(self, layer: int, p: np.ndarray, *moments: np.ndarray) -> None:
        check_state(layer, (p, *moments), self.tier.numels[layer], self._moments())
        self._store_now(layer, p, *moments)

    def flush(self) -> None:
        """Wait for every pending write (raising the first that failed): the files, and the
        tier's ledger (:attr:`DiskTier.io`), as of after the last update."""
        with self._lock:
            pending = list(self._writes.values())
        for fut in pending:
            self._outcome(fut)
        self._settle_writes()

    def disk_ledger(self, *, settle: bool) -> IoLedger:
        if settle:
            self.flush()
        return self.tier.io

    def close(self) -> None:
        """Wait for the pending writes (raising the first that failed), then close the files
        and the inner backend."""
        try:
            with self._lock:
                ahead, self._ahead = list(self._ahead.values()), OrderedDict()
            for fut in ahead:
                fut.cancel()
            self._reader.shutdown(wait=True)
            self._writer.shutdown(wait=True)
            self._fresh = None
            self._settle_writes()
        finally:
            self.tier.close()
            self.inner.close()
