"""What the CUDA transport asks of ``torch.cuda``, as one object it is handed.

:class:`~l2l.relay.transport.CudaTransport` reaches CUDA only through an
instance of :class:`TorchCuda` (its ``cuda`` argument), so the tests can hand
it a fake instead (``tests/fake_cuda.py``) and watch, on a CPU, every stream,
event, copy and allocation the transport asks for, in an order as late as
CUDA allows. This class is the real thing and adds nothing: each method is
the one ``torch.cuda`` call (or tensor method) it is named after.

A copy is ``copy_(dst, src)`` rather than ``dst.copy_(src, non_blocking=True)``
written inline, and ``record_stream(t, stream)`` rather than the tensor method,
because those two are where a fake has to see the stream a copy is queued on
and the tensors it reads and writes.
"""
from __future__ import annotations

import torch


class TorchCuda:
    """The real ``torch.cuda``, for :class:`~l2l.relay.transport.CudaTransport`."""

    def Stream(self, device: torch.device) -> torch.cuda.Stream:  # noqa: N802 -- torch's name
        return torch.cuda.Stream(device)

    def Event(self, blocking: bool = False) -> torch.cuda.Event:  # noqa: N802
        """``blocking``: a CPU waiting on it sleeps instead of spinning (for events the CPU waits on)."""
        return torch.cuda.Event(blocking=blocking)

    def current_stream(self, device: torch.device) -> torch.cuda.Stream:
        return torch.cuda.current_stream(device)

    def stream(self, stream: torch.cuda.Stream):
        """Context: work issued inside is queued on ``stream``."""
        return torch.cuda.stream(stream)

    def device(self, device: torch.device):
        """Context: the calling thread's current device is ``device``."""
        return torch.cuda.device(device)

    def pinned_empty(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """Page-locked host memory: copies from and to it are asynchronous."""
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """An asynchronous copy on the current stream."""
        dst.copy_(src, non_blocking=True)

    def record_stream(self, t: torch.Tensor, stream: torch.cuda.Stream) -> None:
        """The caching allocator keeps ``t``'s block until the work queued on ``stream``
        when ``t`` is freed is done (``t`` was allocated on another stream)."""
        t.record_stream(stream)
