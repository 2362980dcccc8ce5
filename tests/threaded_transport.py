"""The CUDA transport's pipeline on the CPU, for tests: copy threads for streams, futures for events.

A third implementation of the transport interface (``l2l/relay/transport.py``), with real
copies, so that the relay's overlap and ordering can be tested where no GPU is; on a CPU
it is slower than the zero-copy ``CpuTransport`` and so not part of the package.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from l2l.relay.transport import TORCH_DTYPES, HostPool, PendingTensor, StashedTensor, as_torch
from l2l.hostmem import aligned_empty


@dataclass
class CopyRecord:
    """One copy as the trace sees it: when the relay asked for it, and when each thread
    (by ident) first waited for it."""
    kind: str
    asked: float
    waits: dict[int, float] = field(default_factory=dict)


class ThreadedTransport:
    """The CUDA pipeline with threads: a copy-in and a copy-out worker, real copies.

    ``copy_delay_s`` adds a fixed time to every copy, a slow link, so a test
    can see overlap without depending on memcpy speed. ``trace`` (when a list)
    receives a :class:`CopyRecord` for every copy, ``kind`` one of ``weights``,
    ``gradient``, ``stash_out``, ``stash_in``.
    """

    asynchronous = True

    def __init__(self, device: torch.device, *, copy_delay_s: float = 0.0, trace: list | None = None) -> None:
        if device.type != "cpu":
            raise ValueError("ThreadedTransport runs on the CPU device")
        self.device = device
        self.copy_delay_s = copy_delay_s
        self.trace = trace
        self.copy_in = ThreadPoolExecutor(max_workers=1, thread_name_prefix="l2l-copy-in")
        self.copy_out = ThreadPoolExecutor(max_workers=1, thread_name_prefix="l2l-copy-out")
        self.pool = HostPool(lambda shape, dtype: torch.empty(shape, dtype=dtype))

    def _submit(self, pool: ThreadPoolExecutor, kind: str, dst: torch.Tensor, src: torch.Tensor,
                after: Callable[[], object] | None = None) -> Callable[[], None]:
        """The copy queued on ``pool``; returns the wait for it."""
        record = CopyRecord(kind, time.perf_counter())
        if self.trace is not None:
            self.trace.append(record)
        future = pool.submit(self._copy, dst, src, after)

        def wait() -> None:
            record.waits.setdefault(threading.get_ident(), time.perf_counter())
            future.result()
        return wait

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, after: Callable[[], object] | None = None):
        if after is not None:
            after()
        if self.copy_delay_s:
            time.sleep(self.copy_delay_s)
        dst.copy_(src)

    def host_alloc(self, n: int, dtype: np.dtype) -> np.ndarray:
        return aligned_empty(n, dtype)

    def upload(self, host: np.ndarray) -> PendingTensor:
        src = as_torch(host)
        dst = torch.empty_like(src)
        return PendingTensor(dst, self._submit(self.copy_in, "weights", dst, src))

    def gradient_buffer(self, inbox: np.ndarray) -> torch.Tensor:
        return torch.zeros(inbox.shape[0], dtype=TORCH_DTYPES[inbox.dtype])

    def download_gradient(self, grad: torch.Tensor, inbox: np.ndarray) -> Callable[[], None]:
        return self._submit(self.copy_out, "gradient", as_torch(inbox), grad)

    def to_host(self, t: torch.Tensor) -> StashedTensor:
        host, reused_after = self.pool.take(t.shape, t.dtype)  # the copy thread waits, not the compute thread
        return StashedTensor(host, written=self._submit(self.copy_out, "stash_out", host, t, reused_after))

    def to_device(self, s: StashedTensor) -> PendingTensor:
        dst = torch.empty_like(s.host)
        return PendingTensor(dst, self._submit(self.copy_in, "stash_in", dst, s.host, s.wait_written))

    def release(self, s: StashedTensor, pending: PendingTensor) -> None:
        self.pool.give(s.host, pending.done)

    def close(self) -> None:
        self.copy_in.shutdown(wait=True)
        self.copy_out.shutdown(wait=True)
