"""The host EPS on several cores: an update cut into contiguous ranges, one per thread.

Every step of the contract is element-wise (the reduce, the finite check, AdamW, the
device copy), so an element gets the same bits whichever range computes it: N threads
give one thread's bits. NumPy releases the GIL inside each ufunc call, so the ranges
run at once; each range is still walked in :data:`~l2l.eps.numerics.CHUNK`-sized
pieces that stay in cache through an element's passes.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

from .numerics import CHUNK

T = TypeVar("T")


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity mask: a container's or taskset's share,
    not the whole machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


class RangePool:
    """``threads`` threads, the caller's included, each computing one contiguous range, a whole
    multiple of ``grain`` elements (by default a chunk; tests make it small to cut small layers)."""

    def __init__(self, threads: int, grain: int = CHUNK) -> None:
        if threads < 1 or grain < 1:
            raise ValueError(f"threads and grain must be at least 1, not {threads} and {grain}")
        self.threads, self.grain = threads, grain
        self._pool = ThreadPoolExecutor(threads - 1, thread_name_prefix="l2l-eps") if threads > 1 else None

    def ranges(self, n: int) -> list[tuple[int, int]]:
        """``[0, n)`` cut into at most ``threads`` ranges of whole grains (the last takes the
        remainder): a layer of fewer than two grains is one range, not worth a hand-off."""
        parts = max(1, min(self.threads, n // self.grain))
        step = -(-n // parts // self.grain) * self.grain if parts > 1 else n
        return [(lo, min(lo + step, n)) for lo in range(0, n, step)] if n else [(0, 0)]

    def map(self, work: Callable[[int, int], T], n: int) -> list[T]:
        """``work(lo, hi)`` over every range of ``[0, n)``; the results in range order. The
        caller computes the first range itself while the pool computes the others."""
        first, *rest = self.ranges(n)
        if not rest:
            return [work(*first)]
        futures = [self._pool.submit(work, lo, hi) for lo, hi in rest]
        try:
            head = work(*first)
        finally:  # never leave a range running on state the caller is about to touch again
            results = [f.result() for f in futures]
        return [head, *results]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
