"""Moving layer weights, gradients and stashed activations between EPS and device.

:class:`CpuTransport` is for the CPU device: host and device memory are one,
so a "transfer" hands the EPS's buffer to torch without a copy.
:class:`CudaTransport` copies on dedicated streams from pinned host buffers,
ordered by events: weights in on a copy stream (so the next layer's weights
arrive while the current one computes), gradients out into the EPS's pinned
inbox, the EPS worker waiting on the copy's event before it reads.
"""
from __future__ import annotations

from typing import Callable

import ml_dtypes
import numpy as np
import torch

_TORCH_OF = {
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
    """A device tensor whose producing copy may still be in flight."""

    def __init__(self, tensor: torch.Tensor, event: "torch.cuda.Event | None" = None) -> None:
        self._tensor, self._event = tensor, event

    def wait(self) -> torch.Tensor:
        if self._event is not None:
            torch.cuda.current_stream(self._tensor.device).wait_event(self._event)
            self._event = None
        return self._tensor


class CpuTransport:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def host_alloc(self, n: int, dtype: np.dtype) -> np.ndarray:
        return np.empty(n, dtype=dtype)

    def upload(self, host: np.ndarray) -> PendingTensor:
        return PendingTensor(as_torch(host))

    def gradient_buffer(self, inbox: np.ndarray) -> torch.Tensor:
        """On the CPU the relay accumulates straight into the EPS inbox."""
        return as_torch(inbox).zero_()

    def download_gradient(self, grad: torch.Tensor, inbox: np.ndarray) -> Callable[[], None] | None:
        return None  # already in place

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        return t  # host and device memory are one; the ledger records the move

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t


class CudaTransport:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.copy_in = torch.cuda.Stream(device)
        self.copy_out = torch.cuda.Stream(device)
        self._pinned: dict[int, torch.Tensor] = {}

    def host_alloc(self, n: int, dtype: np.dtype) -> np.ndarray:
        t = torch.empty(n, dtype=_TORCH_OF[np.dtype(dtype)], pin_memory=True)
        self._pinned[t.data_ptr()] = t
        a = t.view(torch.int16).numpy().view(dtype) if t.dtype == torch.bfloat16 else t.numpy()
        return a

    def _pinned_tensor(self, host: np.ndarray) -> torch.Tensor:
        t = self._pinned.get(host.ctypes.data)
        return t if t is not None else as_torch(host)

    def upload(self, host: np.ndarray) -> PendingTensor:
        src = self._pinned_tensor(host)
        compute = torch.cuda.current_stream(self.device)
        dst = torch.empty(src.shape, dtype=src.dtype, device=self.device)  # owned by compute stream
        self.copy_in.wait_stream(compute)
        with torch.cuda.stream(self.copy_in):
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.copy_in)
        return PendingTensor(dst, done)

    def gradient_buffer(self, inbox: np.ndarray) -> torch.Tensor:
        return torch.zeros(inbox.shape[0], dtype=_TORCH_OF[inbox.dtype], device=self.device)

    def download_gradient(self, grad: torch.Tensor, inbox: np.ndarray) -> Callable[[], None]:
        dst = self._pinned_tensor(inbox)
        self.copy_out.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_out):
            dst.copy_(grad, non_blocking=True)
            grad.record_stream(self.copy_out)
            done = torch.cuda.Event()
            done.record(self.copy_out)
        return done.synchronize

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        h.copy_(t, non_blocking=True)  # same stream as its producer: ordered, and t may be freed
        return h

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, non_blocking=True)


def make_transport(device: torch.device):
    return CudaTransport(device) if device.type == "cuda" else CpuTransport(device)
