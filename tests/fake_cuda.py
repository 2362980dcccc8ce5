"""A deferred fake of ``torch.cuda`` on the CPU: what the CUDA transport asks of CUDA, seen.

``CudaTransport(device, cuda=FakeCuda())`` runs the transport's real code
against this object instead of :class:`l2l.relay.cuda_api.TorchCuda`. Tensors
are CPU tensors; what is faked is *time*.

* The compute stream (``current_stream``) is the present: compute runs
  eagerly on the CPU, so work queued on it is done at once.
* A side stream (``Stream``) queues its copies and waits and runs them as
  late as CUDA allows: only when something forces it -- the compute stream
  waiting on one of its events (``wait_event``/``wait_stream``: the producing
  stream is flushed up to that point), a CPU wait (``Event.synchronize``), or
  another stream's wait that is itself being forced. So a consumer that forgot
  to wait reads a copy that has not happened yet.
* A copy's destination is filled with NaN as soon as the GPU could start
  writing it (once the waits queued ahead of it on its stream are satisfied)
  and holds its real value only once the copy runs: reading it early reads NaN.
* A queued copy holds its source and destination *storages* by weak reference
  unless ``record_stream`` was called for them on that stream (then strongly,
  as the caching allocator would keep the block). A storage that died before
  its copy ran is memory the allocator could have handed to someone else: a
  use-after-free, recorded in ``errors`` (and the destination poisoned with
  NaN). So is a source overwritten between the moment the copy may start and
  its run (a buffer reused while a copy still had to read it).
* ``run(stream)`` is the other adversary: it runs a stream's queue *now*, as
  early as its waits allow (forcing what they wait on), for write-after-read
  hazards that late execution hides.

Counters: ``cpu_waits`` (``Event.synchronize`` calls, by thread name: the
CPU blocked on the GPU), ``spin_waits`` (of those, on events made without
``blocking=True``: a CPU spinning), ``copies``, ``pinned`` (pinned
allocations), ``device_scopes`` ((thread name, device) per ``device()``
entered), ``flushes`` (per forced flush: what forced it and the copies it ran,
as ``(stream label, dst pointer, src pointer, nbytes)``).
"""
from __future__ import annotations

import threading
import weakref
from collections import Counter
from contextlib import contextmanager

import torch


class _Mem:
    """A tensor's memory as a queued copy sees it: the storage, held weakly (memory the copy
    does not own) or strongly (``record_stream``), and the view's geometry on it."""

    def __init__(self, t: torch.Tensor, stream: "FakeStream") -> None:
        storage = t.untyped_storage()
        self.storage_id = id(storage)
        self.weak = weakref.ref(storage)
        kept = stream.recorded.get(id(storage))
        self.strong = storage if kept is not None and kept() is storage else None
        self.geometry = (t.dtype, t.storage_offset(), t.size(), t.stride())
        self.snapshot: torch.Tensor | None = None  # the bytes when the copy may start (sources)

    def keep(self) -> None:
        self.strong = self.weak()

    def view(self) -> torch.Tensor | None:
        """The memory as a tensor, or None when the storage was freed."""
        storage = self.weak()
        if storage is None:
            return None
        dtype, offset, size, stride = self.geometry
        return torch.empty(0, dtype=dtype).set_(storage, offset, size, stride)

    def take_snapshot(self) -> None:
        view = self.view()
        if view is not None:
            self.snapshot = _bytes(view).clone()

    def overwritten(self) -> bool:
        """The bytes changed since the snapshot (whoever wrote them: torch, numpy, another copy)."""
        view = self.view()
        return self.snapshot is not None and view is not None and not torch.equal(_bytes(view), self.snapshot)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


class _Copy:
    def __init__(self, stream: "FakeStream", dst: torch.Tensor, src: torch.Tensor) -> None:
        self.stream = stream
        self.dst, self.src = _Mem(dst, stream), _Mem(src, stream)
        self.started = False
        self.info = (stream.label, dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size())

    def refs(self) -> tuple[_Mem, _Mem]:
        return self.dst, self.src

    def ready(self) -> None:
        """The GPU may start this copy now (the waits ahead of it are satisfied): the destination
        reads as NaN until the copy runs, and the source must keep its contents until then."""
        if self.started:
            return
        self.started = True
        self.src.take_snapshot()
        dst = self.dst.view()
        if dst is not None and dst.is_floating_point():
            dst.fill_(float("nan"))

    def run(self, fake: "FakeCuda") -> None:
        label = self.stream.label
        dst, src = self.dst.view(), self.src.view()
        if dst is None:
            fake.errors.append(f"use after free: the destination of a copy on {label} was freed before it ran")
            return
        if src is None:
            fake.errors.append(f"use after free: the source of a copy on {label} was freed before it ran")
            dst.fill_(float("nan"))
            return
        if self.src.overwritten():
            fake.errors.append(f"overwritten source: a copy on {label} read memory rewritten after it was queued")
            dst.fill_(float("nan"))
            return
        dst.copy_(src)
        fake.copies += 1


class _Wait:
    def __init__(self, stream: "FakeStream", position: int) -> None:
        self.stream, self.position = stream, position  # the stream waited on, and how far

    def satisfied(self) -> bool:
        return self.stream.present or self.stream.done >= self.position

    def run(self, fake: "FakeCuda") -> None:
        fake._flush(self.stream, self.position)


class FakeStream:
    def __init__(self, fake: "FakeCuda", device: torch.device, label: str, present: bool = False) -> None:
        self.fake, self.device, self.label, self.present = fake, device, label, present
        self.queue: list = []
        self.issued = 0  # ops ever queued
        self.done = 0    # ops run (the first ``done`` of ``issued``)
        self.recorded: dict[int, weakref.ref] = {}  # storages record_stream'ed on this stream

    def wait_event(self, event: "FakeEvent") -> None:
        with self.fake.lock:
            if event.stream is None or event.stream.present:
                return  # never recorded, or on the present: nothing to wait for
            if self.present:
                self.fake._flush(event.stream, event.position, forced_by=f"{self.label}.wait_event")
            else:
                self.fake._enqueue(self, _Wait(event.stream, event.position))

    def wait_stream(self, other: "FakeStream") -> None:
        event = self.fake.Event()
        event.record(other)
        self.wait_event(event)

    def __repr__(self) -> str:
        return f"FakeStream({self.label})"


class FakeEvent:
    def __init__(self, fake: "FakeCuda", blocking: bool) -> None:
        self.fake, self.blocking = fake, blocking
        self.stream: FakeStream | None = None
        self.position = 0

    def record(self, stream: FakeStream | None = None) -> None:
        with self.fake.lock:
            stream = stream or self.fake._current()
            self.stream, self.position = stream, stream.issued

    def query(self) -> bool:
        return self.stream is None or self.stream.present or self.stream.done >= self.position

    def synchronize(self) -> None:
        """The CPU blocks until the event: counted, and the stream is forced up to it."""
        name = threading.current_thread().name
        with self.fake.lock:
            self.fake.cpu_waits[name] += 1
            if not self.blocking:
                self.fake.spin_waits[name] += 1
            if self.stream is not None and not self.stream.present:
                self.fake._flush(self.stream, self.position, forced_by="synchronize")


class FakeCuda:
    """A stand-in for :class:`l2l.relay.cuda_api.TorchCuda` (see the module docstring)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._local = threading.local()
        self._present: dict[str, FakeStream] = {}
        self.streams: list[FakeStream] = []
        self.cpu_waits: Counter = Counter()
        self.spin_waits: Counter = Counter()
        self.copies = 0
        self.pinned = 0
        self.device_scopes: list[tuple[str, torch.device]] = []
        self.flushes: list[tuple[str, list[tuple]]] = []
        self.errors: list[str] = []
        self._flushing: list | None = None

    # ------------------------------------------------------------ the seam
    def Stream(self, device: torch.device) -> FakeStream:  # noqa: N802
        with self.lock:
            s = FakeStream(self, device, f"s{len(self.streams)}")
            self.streams.append(s)
            return s

    def Event(self, blocking: bool = False) -> FakeEvent:  # noqa: N802
        return FakeEvent(self, blocking)

    def current_stream(self, device: torch.device) -> FakeStream:
        stack = getattr(self._local, "stack", None)
        if stack:
            return stack[-1]
        with self.lock:
            return self._present.setdefault(str(device), FakeStream(self, device, "compute", present=True))

    @contextmanager
    def stream(self, stream: FakeStream):
        stack = self._local.__dict__.setdefault("stack", [])
        stack.append(stream)
        try:
            yield
        finally:
            stack.pop()

    @contextmanager
    def device(self, device: torch.device):
        with self.lock:
            self.device_scopes.append((threading.current_thread().name, device))
        yield

    def pinned_empty(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        with self.lock:
            self.pinned += 1
        t = torch.empty(shape, dtype=dtype)
        if t.is_floating_point():
            t.fill_(float("nan"))  # like cudaHostAlloc: contents undefined
        return t

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with self.lock:
            stream = self._current()
            if stream.present:
                dst.copy_(src)
                self.copies += 1
            else:
                self._enqueue(stream, _Copy(stream, dst, src))

    def record_stream(self, t: torch.Tensor, stream: FakeStream) -> None:
        with self.lock:
            storage = t.untyped_storage()
            sid = id(storage)
            stream.recorded[sid] = weakref.ref(storage)
            for op in stream.queue:
                if isinstance(op, _Copy):
                    for mem in op.refs():
                        if mem.storage_id == sid and mem.weak() is storage:
                            mem.keep()

    # ------------------------------------------------------------ the adversary
    def run(self, stream: FakeStream) -> None:
        """Run everything queued on ``stream`` now: as early as its waits allow."""
        with self.lock:
            self._flush(stream, stream.issued, forced_by="run")

    def synchronize(self) -> None:
        """Every stream drained (``torch.cuda.synchronize``; not counted as a step's wait)."""
        with self.lock:
            for s in self.streams:
                self._flush(s, s.issued, forced_by="synchronize_all")

    def pending(self) -> int:
        return sum(len(s.queue) for s in self.streams)

    # ------------------------------------------------------------ internals
    def _current(self) -> FakeStream:
        stack = getattr(self._local, "stack", None)
        if stack:
            return stack[-1]
        return self.current_stream(torch.device("cpu"))

    def _enqueue(self, stream: FakeStream, op) -> None:
        stream.queue.append(op)
        stream.issued += 1
        self._mark_ready(stream)

    def _mark_ready(self, stream: FakeStream) -> None:
        """Poison the destinations of the copies the GPU could be running now: those with
        no unsatisfied wait ahead of them on their stream."""
        for op in stream.queue:
            if isinstance(op, _Wait):
                if not op.satisfied():
                    return
            else:
                op.ready()

    def _flush(self, stream: FakeStream, position: int, forced_by: str | None = None) -> None:
        outer = self._flushing is None
        if outer:
            self._flushing = []
        try:
            while stream.done < position:
                op = stream.queue[0]  # stays queued while it runs: a wait still blocks what follows it
                if isinstance(op, _Copy):
                    op.ready()
                    op.run(self)
                    self._flushing.append(op.info)
                else:
                    op.run(self)
                stream.queue.pop(0)
                stream.done += 1
                for s in self.streams:  # what this op unblocked may start now
                    self._mark_ready(s)
        finally:
            if outer:
                ran, self._flushing = self._flushing, None
                if ran:
                    self.flushes.append((forced_by or "wait", ran))

    # ------------------------------------------------------------ reading the counters
    def compute_waits(self) -> int:
        """CPU-blocking waits on threads that run the relay (not the EPS's update worker)."""
        return sum(n for name, n in self.cpu_waits.items() if not name.startswith("eps-update"))
