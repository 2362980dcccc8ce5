"""The pinned host allocations a CUDA transport made, found again from any array inside one.

The EPS allocates its host arrays through the transport (``host_alloc``) and then
hands the relay numpy views of them: a layer's device copy, or one row of the
layer's (K, n) gradient inbox block, whose row k starts k*n elements into the
allocation. To copy asynchronously the transport needs the pinned torch tensor
behind such a view, so the registry finds the allocation that *contains* the
view's bytes and returns exactly those bytes.

A view of memory the registry does not hold is an error, not a fallback: a
pageable source makes CUDA stage the copy synchronously, so every upload would
silently block the CPU (and every download race with the EPS reading it).
The K data-parallel workers share one registry: the EPS allocates once, through
the first worker's transport, and every worker reads the same arrays.
"""
from __future__ import annotations

import bisect
import threading

import numpy as np
import torch


def pinned_block_bytes(nbytes: int) -> int:
    """Bytes torch's pinned (CachingHostAllocator) block for a request of ``nbytes`` holds:
    the request rounded up to the next power of two (0 for 0). A 3.2 GB layer copy holds
    4 GiB of page-locked host memory, and the block stays cached after it is freed until
    ``torch.accelerator.empty_host_cache()``."""
    return 0 if nbytes <= 0 else 1 << (int(nbytes) - 1).bit_length()


class PinnedRegistry:
    def __init__(self) -> None:
        self._starts: list[int] = []
        self._blocks: list[tuple[int, int, torch.Tensor]] = []  # (start, end, tensor), by start
        self._lock = threading.Lock()  # the EPS allocates inboxes from the workers' threads

    def add(self, t: torch.Tensor) -> None:
        start = t.data_ptr()
        end = start + t.numel() * t.element_size()
        with self._lock:
            i = bisect.bisect_right(self._starts, start)
            self._starts.insert(i, start)
            self._blocks.insert(i, (start, end, t))

    def bytes_of(self, host: np.ndarray) -> torch.Tensor:
        """The pinned bytes (uint8) under ``host``, a contiguous view into a registered allocation."""
        if not host.flags.c_contiguous:
            raise ValueError("pinned transfers need a contiguous host array")
        lo, n = host.ctypes.data, host.nbytes
        if n == 0:  # an entry with no elements (a pre stage whose weight is shared)
            return torch.empty(0, dtype=torch.uint8)
        with self._lock:
            i = bisect.bisect_right(self._starts, lo) - 1
            block = self._blocks[i] if i >= 0 else None
        if block is None or not (block[0] <= lo and lo + n <= block[1]):
            raise ValueError(
                f"host array at {lo:#x} ({n} bytes) is not in pinned memory this transport allocated: "
                "allocate it with the transport's host_alloc (EagerParamServer(host_alloc=...)); "
                "a pageable copy would block the CPU at every transfer")
        start, _, t = block
        return t.view(-1).view(torch.uint8)[lo - start:lo - start + n]

    def __len__(self) -> int:
        return len(self._blocks)

    def requested_bytes(self) -> int:
        """Bytes asked for by the registered allocations."""
        with self._lock:
            return sum(end - start for start, end, _ in self._blocks)

    def held_bytes(self) -> int:
        """Bytes the pinned allocator holds for them (each rounded up: :func:`pinned_block_bytes`)."""
        with self._lock:
            return sum(pinned_block_bytes(end - start) for start, end, _ in self._blocks)
