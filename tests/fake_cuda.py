"""A deferred fake of ``torch.cuda`` on the CPU: what the CUDA transport asks of CUDA, seen.

``CudaTransport(device, cuda=FakeCuda())`` runs the transport's real code
against this object instead of :class:`l2l.relay.cuda_api.TorchCuda`. Tensors
are CPU tensors; what is faked is *time*: every stream runs as late as CUDA
allows, so a consumer that is not ordered after its producer sees it unfinished.

What it models:

* Compute kernels. A thread that runs the relay is *watched* (``with fake:``, or
  inside ``fake.device(d)``, which the transport's ``device_scope`` enters): every
  torch operation it runs while its current stream is the compute stream
  (``current_stream``) is a kernel queued there, at the next position of that
  stream, and the fake notes which storages it wrote (its outputs and the
  arguments its schema marks as written; an allocation is a write too, standing
  for the block's previous users in the caching allocator). Kernels compute
  eagerly on the CPU, but their results reach another stream only through an
  ordering: a copy on a side stream that reads or writes a storage compute last
  wrote at position ``k`` must be queued after a wait that covers position ``k``
  of the compute stream -- directly (``wait_stream``, ``wait_event`` on an event
  recorded there) or through other streams' events (every stream and event
  carries a vector clock of what it is ordered after). A copy that is not
  ("unordered") ran while the kernel may still be writing, or while its output
  memory was still in use: its destination is NaN (garbage) and ``errors`` says so.
* Side streams (``Stream``) queue their copies and waits and run them as late
  as CUDA allows: only when something forces it -- the compute stream waiting on
  one of its events (``wait_event``/``wait_stream``: the producing stream is
  flushed up to that point), a CPU wait (``Event.synchronize``), or another
  stream's wait that is itself being forced. So a consumer that forgot to wait
  reads a copy that has not happened yet.
* A copy's destination is filled with NaN as soon as the GPU could start
  writing it (once the waits queued ahead of it on its stream are satisfied)
  and holds its real value only once the copy runs: reading it early reads NaN.
* The caching allocator: a queued copy holds its source and destination
  *storages* by weak reference unless ``record_stream`` was called for them on
  that stream (then strongly, as the allocator would keep the block). A storage
  that died before its copy ran is memory the allocator could have handed to
  someone else: a use-after-free, recorded in ``errors`` (and the destination
  poisoned with NaN). So is a source overwritten between the moment the copy
  may start and its run (a buffer reused while a copy still had to read it).
* ``run(stream)`` is the other adversary: it runs a stream's queue *now*, as
  early as its waits allow (forcing what they wait on), for write-after-read
  hazards that late execution hides.

Kernels are seen through a ``TorchDispatchMode`` on each watched thread: the one
place where every operation, the backward's included, shows without changing
the relay. Compute used on a thread that is not watched is an error, so an
ordering is never left unchecked silently.

What it does not model:

* kernels on a side stream (an error: the transport queues only copies there);
* several devices: one compute stream per device name, shared by the threads
  that use it (the tests' workers all run on the CPU);
* finer than a storage: a write to any view of it is a write to all of it, and
  the allocator's real reuse of blocks is stood for by the allocation itself
  (so a copy is held to the order CUDA needs, or a stricter one);
* host memory (``pinned_empty``) as compute's: the CPU writes and reads it in
  its own program order, ordered against copies by ``Event.synchronize``;
* compute running late relative to the CPU (the CPU reads device memory only
  through copies);
* compute's reads: a copy into a device tensor that compute may still be
  reading is caught only through its allocation (the transport copies into
  fresh device tensors only);
* time itself: overlap is ``tests/threaded_transport.py``'s business.

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
from torch.utils._python_dispatch import TorchDispatchMode


class _Kernels(TorchDispatchMode):
    """A watched thread's torch operations, each handed to :meth:`FakeCuda._kernel` once it ran."""

    def __init__(self, fake: "FakeCuda") -> None:
        super().__init__()
        self.fake = fake

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # it only observes: guarding it from the compiler would import torch._dynamo (seconds)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not func.is_view:  # a view reads and writes no memory
            self.fake._kernel(func, args, kwargs, out)
        return out


_WRITTEN_ARGS: dict = {}  # operator -> (position or None if keyword-only, name) of each argument it writes


def _written(func, args: tuple, kwargs: dict, out) -> list[torch.Tensor]:
    """The tensors an operation wrote: its outputs and the arguments its schema marks as written."""
    spec = _WRITTEN_ARGS.get(func)
    if spec is None:
        spec = _WRITTEN_ARGS[func] = [(None if a.kwarg_only else i, a.name)
                                      for i, a in enumerate(func._schema.arguments)
                                      if a.alias_info is not None and a.alias_info.is_write]
    values = [out] + [args[i] if i is not None and i < len(args) else kwargs.get(name) for i, name in spec]
    return list(_tensors(values))


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _tensors(v)


def _merge(clock: dict, other: dict) -> None:
    """``clock`` is also ordered after everything ``other`` is."""
    for stream, position in other.items():
        if clock.get(stream, 0) < position:
            clock[stream] = position


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
    def __init__(self, fake: "FakeCuda", stream: "FakeStream", dst: torch.Tensor, src: torch.Tensor) -> None:
        self.stream = stream
        self.dst, self.src = _Mem(dst, stream), _Mem(src, stream)
        self.started = False
        self.info = (stream.label, dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size())
        # decided now, from the waits queued ahead of it: what it touches that compute wrote unseen
        self.unordered = [f"unordered copy on {stream.label}: it {role} memory compute last wrote at "
                          f"kernel {k}, but {stream.label} waits for compute's kernels up to {seen} only"
                          for role, t in (("writes", dst), ("reads", src))
                          for k, seen in [fake._unseen_write(stream, t)] if k]

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
            problems = [f"use after free: the source of a copy on {label} was freed before it ran"]
        elif self.src.overwritten():
            problems = [f"overwritten source: a copy on {label} read memory rewritten after it was queued"]
        else:
            problems = []
        problems += self.unordered
        if problems:  # what it wrote is garbage
            fake.errors.extend(problems)
            if dst.is_floating_point():
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
        self.issued = 0  # ops ever queued (on the compute stream: kernels)
        self.done = 0    # ops run (the first ``done`` of ``issued``; side streams)
        self.clock: dict[FakeStream, int] = {}  # how far into each other stream what it queues next is ordered
        self.recorded: dict[int, weakref.ref] = {}  # storages record_stream'ed on this stream

    def wait_event(self, event: "FakeEvent") -> None:
        with self.fake._guard():
            if event.stream is None:
                return  # never recorded: nothing to wait for
            _merge(self.clock, event.clock)
            if event.stream.present:
                return  # compute ran its kernels already: the clock carries the order
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
        self.clock: dict[FakeStream, int] = {}

    def record(self, stream: FakeStream | None = None) -> None:
        with self.fake._guard():
            stream = stream or self.fake._current()
            self.stream, self.position = stream, stream.issued
            self.clock = {**stream.clock, stream: stream.issued}

    def query(self) -> bool:
        return self.stream is None or self.stream.present or self.stream.done >= self.position

    def synchronize(self) -> None:
        """The CPU blocks until the event: counted, and the stream is forced up to it."""
        name = threading.current_thread().name
        with self.fake._guard():
            self.fake.cpu_waits[name] += 1
            if not self.blocking:
                self.fake.spin_waits[name] += 1
            if self.stream is not None and not self.stream.present:
                self.fake._flush(self.stream, self.position, forced_by="synchronize")


class FakeCuda:
    """A stand-in for :class:`l2l.relay.cuda_api.TorchCuda` (see the module docstring).

    ``with fake:`` watches the calling thread's kernels (``device()`` does the same for
    the thread that enters it)."""

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
        self._host: dict[int, weakref.ref] = {}  # pinned storages, by address
        self._writes: dict[int, tuple[FakeStream, int]] = {}  # device storage address -> compute's last write
        self._unwatched: set[str] = set()

    def __enter__(self) -> "FakeCuda":
        watch = self._watching()
        watch.__enter__()
        self._local.__dict__.setdefault("exits", []).append(watch)
        return self

    def __exit__(self, *exc) -> None:
        self._local.exits.pop().__exit__(*exc)

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
        name = threading.current_thread().name
        if not getattr(self._local, "watched", False) and name not in self._unwatched:
            with self.lock:
                self._unwatched.add(name)
                self.errors.append(f"the compute stream is used on thread {name}, whose kernels the fake "
                                   "does not see: run it inside `with fake:` or fake.device()")
        return self._compute(device)

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
        with self._watching():
            yield

    def pinned_empty(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        with self._guard():
            self.pinned += 1
            t = torch.empty(shape, dtype=dtype)
            if t.is_floating_point():
                t.fill_(float("nan"))  # like cudaHostAlloc: contents undefined
            storage = t.untyped_storage()
            self._host[storage.data_ptr()] = weakref.ref(storage)
        return t

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        stream = self._current()
        if stream.present:
            dst.copy_(src)  # a kernel on the compute stream, seen like any other
            with self.lock:
                self.copies += 1
            return
        with self._guard():
            self._enqueue(stream, _Copy(self, stream, dst, src))

    def record_stream(self, t: torch.Tensor, stream: FakeStream) -> None:
        with self._guard():
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
        with self._guard():
            self._flush(stream, stream.issued, forced_by="run")

    def synchronize(self) -> None:
        """Every stream drained (``torch.cuda.synchronize``; not counted as a step's wait)."""
        with self._guard():
            for s in self.streams:
                self._flush(s, s.issued, forced_by="synchronize_all")

    def pending(self) -> int:
        return sum(len(s.queue) for s in self.streams)

    # ------------------------------------------------------------ internals
    @contextmanager
    def _guard(self):
        """The lock, and the fake's own torch operations are no kernels."""
        with self.lock:
            self._local.internal = getattr(self._local, "internal", 0) + 1
            try:
                yield
            finally:
                self._local.internal -= 1

    @contextmanager
    def _watching(self):
        if getattr(self._local, "watched", False):
            yield
            return
        self._local.watched = True
        try:
            with _Kernels(self):
                yield
        finally:
            self._local.watched = False

    def _compute(self, device: torch.device) -> FakeStream:
        key = str(device)
        stream = self._present.get(key)
        if stream is None:
            with self.lock:
                stream = self._present.setdefault(key, FakeStream(self, device, "compute", present=True))
        return stream

    def _current(self) -> FakeStream:
        stack = getattr(self._local, "stack", None)
        if stack:
            return stack[-1]
        return self._compute(torch.device("cpu"))

    def _is_host(self, storage) -> bool:
        ref = self._host.get(storage.data_ptr())
        return ref is not None and ref() is storage

    def _kernel(self, func, args: tuple, kwargs: dict, out) -> None:
        """A watched thread ran ``func``: a kernel queued on its current stream, which wrote its outputs."""
        if getattr(self._local, "internal", 0):
            return  # the fake's own bookkeeping
        stream = self._current()
        with self.lock:
            if not stream.present:
                self.errors.append(f"a kernel ({func}) on side stream {stream.label}: "
                                   "the fake models only copies there")
                return
            stream.issued += 1
            for t in _written(func, args, kwargs, out):
                if t.layout is torch.strided:
                    storage = t.untyped_storage()
                    if storage.nbytes() and not self._is_host(storage):
                        self._writes[storage.data_ptr()] = (stream, stream.issued)

    def _unseen_write(self, stream: FakeStream, t: torch.Tensor) -> tuple[int, int] | tuple[None, None]:
        """Compute's last write to ``t``'s device memory, if ``stream`` is not ordered after it
        (and how far into compute it is ordered); (None, None) for host memory or an ordered write."""
        storage = t.untyped_storage()
        write = None if self._is_host(storage) else self._writes.get(storage.data_ptr())
        if write is None:
            return None, None
        producer, position = write
        seen = stream.clock.get(producer, 0)
        return (position, seen) if seen < position else (None, None)

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
