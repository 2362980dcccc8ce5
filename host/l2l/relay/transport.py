"""Moving layer weights, gradients and stashed activations between EPS and device.

Two transports, one interface (what :class:`~l2l.relay.engine.RelayEngine`
and :class:`~l2l.relay.stash.BoundaryStore` call):

* :class:`CpuTransport` -- the CPU device: host and device memory are one, so
  a "transfer" hands the EPS's buffer to torch without a copy.
* :class:`CudaTransport` -- L2L-p on a GPU: weights in on a copy-in stream
  (the next layer's arrive while the current one computes), gradients and
  stashed activations out on a copy-out stream, stashed activations back in on
  the copy-in stream ahead of their use, all ordered by CUDA events; pinned
  host buffers come from a pool and are reused, not allocated per step.

The tests drive the CUDA transport's pipeline on the CPU with real copies on
threads (``tests/threaded_transport.py``), so its overlap and ordering are
tested where no GPU is.

Every asynchronous result is a :class:`PendingTensor` whose ``wait()`` orders
the consumer after the copy (a stream wait on CUDA, a join on the CPU).
"""
from __future__ import annotations

import threading
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
    after the copy; ``host_wait`` blocks the host until the copy is done, for
    reusing its source buffer.
    """

    def __init__(self, tensor: torch.Tensor, wait: Callable[[], object] | None = None,
                 host_wait: Callable[[], object] | None = None) -> None:
        self._tensor, self._wait = tensor, wait
        self.host_wait = host_wait or wait

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
    step). A buffer returns to the pool with the wait that says its last copy
    out of it is done; it is reused only after that wait.
    """

    def __init__(self, make: Callable[[tuple, torch.dtype], torch.Tensor]) -> None:
        self._make = make
        self._free: dict[tuple, list[tuple[torch.Tensor, Callable[[], object] | None]]] = defaultdict(list)
        self._lock = threading.Lock()
        self.allocated = 0  # buffers ever made: flat after the first step

    def take(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        key = (tuple(shape), dtype)
        with self._lock:
            free = self._free[key]
            item = free.pop() if free else None
        if item is None:
            self.allocated += 1
            return self._make(tuple(shape), dtype)
        buf, done = item
        if done is not None:
            done()
        return buf

    def give(self, buf: torch.Tensor, done: Callable[[], object] | None) -> None:
        with self._lock:
            self._free[(tuple(buf.shape), buf.dtype)].append((buf, done))


class CudaTransport:
    asynchronous = True

    def __init__(self, device: torch.device, cuda=None, pinned: PinnedRegistry | None = None) -> None:
        """``cuda``: what the transport uses of ``torch.cuda`` (:class:`~l2l.relay.cuda_api.TorchCuda`,
        the default); the tests pass a fake that runs on the CPU. ``pinned``: the registry of
        pinned host allocations, shared by the transports of one EPS's workers."""
        self.device = device
        self.cuda = cuda if cuda is not None else TorchCuda()
        self.copy_in = self.cuda.Stream(device)
        self.copy_out = self.cuda.Stream(device)
        self.pinned = pinned if pinned is not None else PinnedRegistry()
        self.pool = HostPool(self.cuda.pinned_empty)

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

    def _copy_in(self, dst: torch.Tensor, src: torch.Tensor, after=None) -> PendingTensor:
        self.copy_in.wait_stream(self._compute())  # dst was allocated on the compute stream
        if after is not None:
            self.copy_in.wait_event(after)
        with self.cuda.stream(self.copy_in):
            self.cuda.copy_(dst, src)
            done = self.cuda.Event()
            done.record(self.copy_in)
        return PendingTensor(dst, self._waiter(done), done.synchronize)

    def upload(self, host: np.ndarray) -> PendingTensor:
        src = self._pinned_tensor(host)
        return self._copy_in(torch.empty(src.shape, dtype=src.dtype, device=self.device), src)

    def gradient_buffer(self, inbox: np.ndarray) -> torch.Tensor:
        return torch.zeros(inbox.shape[0], dtype=TORCH_DTYPES[inbox.dtype], device=self.device)

    def _copy_out(self, dst: torch.Tensor, src: torch.Tensor):
        self.copy_out.wait_stream(self._compute())
        with self.cuda.stream(self.copy_out):
            self.cuda.copy_(dst, src)
            self.cuda.record_stream(src, self.copy_out)  # the allocator keeps src until the copy is done
            done = self.cuda.Event()
            done.record(self.copy_out)
        return done

    def download_gradient(self, grad: torch.Tensor, inbox: np.ndarray) -> Callable[[], None]:
        return self._copy_out(self._pinned_tensor(inbox), grad).synchronize

    def to_host(self, t: torch.Tensor) -> StashedTensor:
        host = self.pool.take(t.shape, t.dtype)
        # the copy back in waits on this event on the GPU; the CPU never blocks on it
        return StashedTensor(host, event=self._copy_out(host, t))

    def to_device(self, s: StashedTensor) -> PendingTensor:
        return self._copy_in(torch.empty(s.host.shape, dtype=s.host.dtype, device=self.device),
                             s.host, after=s.event)

    def release(self, s: StashedTensor, pending: PendingTensor) -> None:
        """The stash is consumed: its pinned buffer is reusable once the copy back has run."""
        self.pool.give(s.host, pending.host_wait)


def make_transport(device: torch.device, pinned: PinnedRegistry | None = None):
    """CUDA streams on a GPU, zero-copy on the CPU."""
    return CudaTransport(device, pinned=pinned) if device.type == "cuda" else CpuTransport(device)


def make_transports(devices: list[torch.device]) -> list:
    """One transport per data-parallel worker; on CUDA they share one pinned registry, since the
    EPS allocates its host arrays once (through the first) and every worker reads them."""
    pinned = PinnedRegistry()
    return [make_transport(d, pinned) for d in devices]
