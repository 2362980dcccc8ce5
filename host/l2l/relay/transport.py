"""Moving layer weights, gradients and stashed activations between EPS and device.

Two transports, one interface (what :class:`~l2l.relay.engine.RelayEngine`
and :class:`~l2l.relay.stash.BoundaryStore` call):

* :class:`CpuTransport` -- the CPU device: host and device memory are one, so
  a "transfer" hands the EPS's buffer to torch without a copy.
* :class:`CudaTransport` -- L2L-p on a GPU: weights in on a copy-in stream
  (the next layer's arrive while the current one computes), gradients out on a
  copy-out stream, stashed activations out and back in (ahead of their use) on
  two streams of their own, all ordered by CUDA events; pinned host buffers
  come from a pool and are reused, not allocated per step.

The seam: :class:`CudaTransport` takes what it uses of ``torch.cuda`` -- streams,
events, the stream context, the device context, pinned allocation, the
asynchronous copy and ``record_stream`` -- as one object, ``cuda``
(:class:`~l2l.relay.cuda_api.TorchCuda` by default, which is ``torch.cuda``
itself). The tests hand it a deferred fake (``tests/fake_cuda.py``) that runs
each side-stream copy as late as CUDA allows, poisons destinations until their
copy runs, catches memory freed or rewritten under a queued copy and serves a
copy not ordered after the compute kernels that wrote its memory garbage, so the
transport's CUDA code runs, and its ordering is checked, where no GPU is. They
also drive the same pipeline with real copies on threads
(``tests/threaded_transport.py``) to see its overlap.

Every asynchronous result is a :class:`PendingTensor` whose ``wait()`` orders
the consumer after the copy (a stream wait on CUDA, a join on the CPU).
"""
from __future__ import annotations

import threading
import weakref
from collections import defaultdict
from typing import Callable

import ml_dtypes
import numpy as np
import torch

from ..hostmem import aligned_empty
from .cuda_api import TorchCuda
from .pinned import PinnedRegistry

TORCH_DTYPES = {
    np.dtype(np.float32): torch.float32,
    np.dtype(np.float16): torch.float16,
    np.dtype(ml_dtypes.bfloat16): torch.bfloat16,
}


def as_torch(a: np.ndarray) -> torch.Tensor:
    """Zero-copy torch view of a host array (bfloat16 through its bit pattern)."""
    if a.dtype == np.dtype(ml_dtypes.bfloat16):
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


class PendingTensor:
    """A device tensor whose producing copy may still be in flight.

    ``wait()`` orders the consumer (the compute stream, or the compute thread)
    after the copy. ``done`` is what orders a later reuse of the copy's source
    buffer after it (:class:`HostPool`): the copy's CUDA event, which the
    reusing stream waits on (the CPU does not), or a callable that blocks until
    the copy has run (copy threads); by default ``wait``.
    """

    def __init__(self, tensor: torch.Tensor, wait: Callable[[], object] | None = None,
                 done: object | None = None) -> None:
        self._tensor, self._wait = tensor, wait
        self.done = done if done is not None else wait

    def wait(self) -> torch.Tensor:
        if self._wait is not None:
            self._wait()
            self._wait = None
        return self._tensor

    @property
    def nbytes(self) -> int:
        return self._tensor.numel() * self._tensor.element_size()


class StashedTensor:
    """A stashed activation in host memory, and what orders its copy back after its copy out:
    ``written`` (blocks until written, threads) or ``event`` (a CUDA event the copy-in stream waits on)."""

    def __init__(self, host: torch.Tensor, written: Callable[[], object] | None = None,
                 event: "torch.cuda.Event | None" = None) -> None:
        self.host, self._written, self.event = host, written, event

    def wait_written(self) -> None:
        if self._written is not None:
            self._written()
            self._written = None


class CpuTransport:
    asynchronous = False  # nothing to overlap: no prefetch

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def host_alloc(self, n: int, dtype: np.dtype) -> np.ndarray:
        return aligned_empty(n, dtype)

    def upload(self, host: np.ndarray) -> PendingTensor:
        return PendingTensor(as_torch(host))

    def gradient_buffer(self, inbox: np.ndarray) -> torch.Tensor:
        """On the CPU the relay accumulates straight into the EPS inbox."""
        return as_torch(inbox).zero_()

    def download_gradient(self, grad: torch.Tensor, inbox: np.ndarray) -> Callable[[], None] | None:
        return None  # already in place

    def to_host(self, t: torch.Tensor):
        return t  # host and device memory are one; the ledger records the move

    def to_device(self, t) -> PendingTensor:
        return PendingTensor(t)

    def release(self, stashed, pending: PendingTensor) -> None:
        pass


class HostPool:
    """Host buffers for stashed activations, by (shape, dtype), reused across steps.

    ``make`` allocates (pinned memory on CUDA: slow to allocate, so never per
    step). A buffer returns to the pool with what says its last copy out of it
    is done (:attr:`PendingTensor.done`), and :meth:`take` hands that back with
    the buffer: the caller orders its write into the buffer after it -- on
    CUDA the stream that writes waits on the event, so neither the pool nor the
    CPU ever blocks on the GPU.
    """

    def __init__(self, make: Callable[[tuple, torch.dtype], torch.Tensor]) -> None:
        self._make = make
        self._free: dict[tuple, list[tuple[torch.Tensor, object | None]]] = defaultdict(list)
        self._lock = threading.Lock()
        self.allocated = 0  # buffers ever made: flat after the first step
        self.buffer_sizes: list[int] = []  # bytes requested for each (pinned: the allocator rounds each up)

    def take(self, shape: torch.Size, dtype: torch.dtype) -> tuple[torch.Tensor, object | None]:
        """A buffer, and what a write into it must come after (None for a new buffer)."""
        key = (tuple(shape), dtype)
        with self._lock:
            free = self._free[key]
            item = free.pop() if free else None
        if item is None:
            buf = self._make(tuple(shape), dtype)
            with self._lock:
                self.allocated += 1
                self.buffer_sizes.append(buf.numel() * buf.element_size())
            return buf, None
        return item

    def give(self, buf: torch.Tensor, done: object | None) -> None:
        with self._lock:
            self._free[(tuple(buf.shape), buf.dtype)].append((buf, done))


class LentBuffers:
    """Host buffers handed out and taken back without being told: the sharded EPS's gathered
    copies on CUDA (``l2l.eps.gather``), whose pinned allocations are slow and stay registered.

    A buffer is reused once the array lent for it is dead (the relay dropped it after queuing
    its upload: the upload reads the pinned tensor behind it, not the array) and ``fence()``
    has returned (the queued uploads have run)."""

    def __init__(self, alloc: Callable[[int, np.dtype], np.ndarray], fence: Callable[[], None]) -> None:
        self._alloc, self._fence = alloc, fence
        self._buffers: dict[tuple[int, str], list[tuple[np.ndarray, weakref.ref]]] = defaultdict(list)
        self._lock = threading.Lock()

    def __call__(self, n: int, dtype: np.dtype) -> np.ndarray:
        key = (n, np.dtype(dtype).str)
        with self._lock:
            mine = self._buffers[key]
            i = next((i for i, (_, lent) in enumerate(mine) if lent() is None), None)
            buf = self._alloc(n, dtype) if i is None else mine.pop(i)[0]
        if i is not None:
            self._fence()
        lent = buf.view()
        with self._lock:
            self._buffers[key].append((buf, weakref.ref(lent)))
        return lent


class CudaTransport:
    """The transport on a GPU: four side streams, all ordered by events, none by the CPU.

    ``copy_in`` brings weights, ``copy_out`` takes gradients away, ``stash_out`` and
    ``stash_in`` move stashed activations. The stash has streams of its own so that a
    stashed tensor brought back ahead of its use never queues behind the next layer's
    whole weights (nor its copy out behind a gradient): a stream runs in order.

    Allocator safety: a device tensor a side stream reads or writes was allocated on the
    compute stream, so every copy is (1) queued after the compute stream's work so far
    (the producer of its source, the last user of its destination's memory) and (2)
    ``record_stream``-ed on its side stream, so the caching allocator does not hand the
    block out again before the copy has run even when the tensor is dropped first.
    Host buffers are the EPS's arrays and the pool's, which outlive the copies.

    The CPU waits on a copy only where it has to read the host result: the EPS worker
    before it reduces a gradient. Those events are blocking (the CPU sleeps, not spins);
    every other event is waited on by a stream.
    """

    asynchronous = True

    def __init__(self, device: torch.device, cuda=None, pinned: PinnedRegistry | None = None) -> None:
        """``cuda``: what the transport uses of ``torch.cuda`` (:class:`~l2l.relay.cuda_api.TorchCuda`,
        the default); the tests pass a fake that runs on the CPU. ``pinned``: the registry of
        pinned host allocations, shared by the transports of one EPS's workers."""
        self.device = device
        self.cuda = cuda if cuda is not None else TorchCuda()
        self.copy_in = self.cuda.Stream(device)
        self.copy_out = self.cuda.Stream(device)
        self.stash_in = self.cuda.Stream(device)
        self.stash_out = self.cuda.Stream(device)
        self.pinned = pinned if pinned is not None else PinnedRegistry()
        self.pool = HostPool(self.cuda.pinned_empty)

    def device_scope(self):
        """Context for a thread that runs the relay on this device: it makes the device current
        (a data-parallel worker thread starts on device 0)."""
        return self.cuda.device(self.device)

    def _compute(self):
        return self.cuda.current_stream(self.device)

    def _waiter(self, done) -> Callable[[], None]:
        return lambda: self._compute().wait_event(done)

    def host_alloc(self, n: int, dtype: np.dtype) -> np.ndarray:
        t = self.cuda.pinned_empty((n,), TORCH_DTYPES[np.dtype(dtype)])
        self.pinned.add(t)
        return t.view(torch.int16).numpy().view(dtype) if t.dtype == torch.bfloat16 else t.numpy()

    def _pinned_tensor(self, host: np.ndarray) -> torch.Tensor:
        """The pinned tensor under ``host`` (a view into one of ``host_alloc``'s allocations);
        an error for any other memory (see ``relay/pinned.py``)."""
        return self.pinned.bytes_of(host).view(TORCH_DTYPES[host.dtype]).view(host.shape)

    def _copy(self, stream, dst: torch.Tensor, src: torch.Tensor, device_side: torch.Tensor, *,
              after=(), blocking: bool = False):
        """``dst <- src`` on ``stream`` after the compute stream's work so far and the events
        ``after``; ``device_side`` (the one of the two on the device) is kept by the allocator
        until the copy has run. Returns the copy's event."""
        stream.wait_stream(self._compute())
        for event in after:
            if event is not None:
                stream.wait_event(event)
        with self.cuda.stream(stream):
            self.cuda.copy_(dst, src)
            done = self.cuda.Event(blocking=blocking)
            done.record(stream)
        self.cuda.record_stream(device_side, stream)
        return done

    def _copy_in(self, stream, src: torch.Tensor, after=()) -> PendingTensor:
        dst = torch.empty(src.shape, dtype=src.dtype, device=self.device)
        done = self._copy(stream, dst, src, dst, after=after)
        return PendingTensor(dst, self._waiter(done), done)

    def upload(self, host: np.ndarray) -> PendingTensor:
        return self._copy_in(self.copy_in, self._pinned_tensor(host))

    def uploads_done(self) -> None:
        """Block until every upload queued so far has run (a host buffer may be written again)."""
        self.copy_in.synchronize()

    def gradient_buffer(self, inbox: np.ndarray) -> torch.Tensor:
        return torch.zeros(inbox.shape[0], dtype=TORCH_DTYPES[inbox.dtype], device=self.device)

    def download_gradient(self, grad: torch.Tensor, inbox: np.ndarray) -> Callable[[], None]:
        """The EPS worker calls the returned wait before it reads the inbox: a CPU wait, so blocking."""
        return self._copy(self.copy_out, self._pinned_tensor(inbox), grad, grad, blocking=True).synchronize

    def to_host(self, t: torch.Tensor) -> StashedTensor:
        host, reused_after = self.pool.take(t.shape, t.dtype)
        # written after the copy back that last read the buffer, and read back after this
        # event: both orders are stream waits, the CPU never blocks on them
        return StashedTensor(host, event=self._copy(self.stash_out, host, t, t, after=(reused_after,)))

    def to_device(self, s: StashedTensor) -> PendingTensor:
        return self._copy_in(self.stash_in, s.host, after=(s.event,))

    def release(self, s: StashedTensor, pending: PendingTensor) -> None:
        """The stash is consumed: its pinned buffer is reusable once the copy back has run."""
        self.pool.give(s.host, pending.done)


def make_transport(device: torch.device, pinned: PinnedRegistry | None = None):
    """CUDA streams on a GPU, zero-copy on the CPU."""
    return CudaTransport(device, pinned=pinned) if device.type == "cuda" else CpuTransport(device)


def gather_alloc(transports: list) -> Callable[[int, np.dtype], np.ndarray]:
    """How a sharded EPS allocates the copies it gathers for these workers: on the CPU a new
    array each time, given back to the system as soon as the relay lets go of the layer (its
    weights are views of it); on CUDA pinned buffers, reused after the uploads that read them
    (:class:`LentBuffers`)."""
    if not transports[0].asynchronous:
        return transports[0].host_alloc
    return LentBuffers(transports[0].host_alloc, lambda: [t.uploads_done() for t in transports])


def make_transports(devices: list[torch.device]) -> list:
    """One transport per data-parallel worker; on CUDA they share one pinned registry, since the
    EPS allocates its host arrays once (through the first) and every worker reads them."""
    pinned = PinnedRegistry()
    return [make_transport(d, pinned) for d in devices]
