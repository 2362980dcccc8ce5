"""Host memory for a training process: glibc's allocator tuned, and line-aligned arrays.

glibc serves an allocation above its mmap threshold with a fresh ``mmap`` and
returns it to the kernel when freed; the threshold adapts upwards on its own,
but never past 32 MiB. A layer activation above that size is then mapped,
page-faulted in (zeroed) 4 KiB at a time and unmapped again at every use. On
this project's 2-core CPU that cost the relay 5-8% of a step at batch 64 and
one micro-batch (a block's MLP activation of 64 x 128 x 1024 fp32 is 33.5 MiB),
and the in-memory baseline about as much; with the threshold raised the gap
between them at M = 1 went from 1.077x to 1.008-1.012x. So the ``l2l``
command raises the threshold to 1 GiB before it trains, plans or benchmarks
(the usual advice for PyTorch on CPUs, where jemalloc or tcmalloc do the same
job), and the trim threshold with it. Freed memory then stays with the process
for reuse; ``L2L_MALLOC_TUNING=0`` keeps glibc's defaults. Importing ``l2l`` as
a library changes nothing. A LoRA run, whose large transients are copies of its
frozen base, has blocks of 32 MiB and more returned at free again
(:func:`return_large_blocks`).

:func:`aligned_empty` is how the EPS allocates its host arrays (device copies,
gradient inboxes): on cache-line boundaries, for vector kernels and streaming
stores.

:func:`memory_status` reads what the kernel says the process holds (resident set
and its peak), the measurement the training log, the run summary and
``l2l bench load`` report; :func:`reset_peak_resident` starts a new peak.
:func:`available_memory` is what a new process could take now, the limit
``l2l plan --fit`` plans against by default.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 1 << 30
# Setting the mmap threshold switches off glibc's adaptation, which would also have
# raised the trim threshold: without this, memory freed at the top of the heap goes
# back to the kernel at once and is faulted in again at the next step.
TRIM_THRESHOLD = 1 << 30
_tuned = False  # tune_host_allocator took effect in this process (the l2l command's doing)


def tune_host_allocator() -> bool:
    """Raise glibc's mmap and trim thresholds (see the module docstring); True when it took effect."""
    if os.environ.get("L2L_MALLOC_TUNING", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    global _tuned
    _tuned = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    return _tuned


LARGE_BLOCK = 32 << 20  # glibc's own ceiling for its adaptive mmap threshold


def return_large_blocks() -> bool:
    """For a run whose large transients are copies of a streamed frozen base (LoRA: each layer's
    frozen weights cast to the compute dtype, the embedding's among them): serve allocations of
    32 MiB and more with their own ``mmap`` again, so each goes back to the kernel when freed,
    and let the heap's top go back too. With the tuned 1 GiB thresholds these copies churned the
    heap and the resident set grew step by step (0.95B base: 3.0-3.2 bytes a base parameter at
    the peak, 2.8 with this). A LoRA run holds the base, not optimizer state: memory is what it
    is for. Only after :func:`tune_host_allocator`: a process that did not tune (l2l as a library,
    ``L2L_MALLOC_TUNING=0``) keeps glibc's own adaptive thresholds. True when it took effect."""
    if not _tuned:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    return mallopt(M_MMAP_THRESHOLD, LARGE_BLOCK) == 1 and mallopt(M_TRIM_THRESHOLD, 2 * LARGE_BLOCK) == 1


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


class HeapTrimmer:
    """Gives the heap's resident holes back to the kernel, within a time budget.

    glibc before 2.38 serves an aligned allocation (torch asks for 64-byte
    alignment) by over-allocating and splitting, so a freed activation can leave
    a chunk too small for the same request in the next layer, and each layer
    touches fresh pages; with the trim threshold raised
    (:func:`tune_host_allocator`) they stay resident, about 2 MiB a layer at
    128 tokens and d 512 (docs/host-memory.md). Called at each layer boundary,
    this measures the resident memory the allocator holds free (anonymous
    resident set minus the bytes in use, ``mallinfo2`` over all arenas) and,
    once it grew by ``slack`` since the last trim, calls ``malloc_trim(0)``:
    the free pages go back, and only those the next layers reuse are faulted
    in again. That refault is a trim's cost: the first layer after a trim
    shows how many bytes it is, and the time to fault a page in is measured
    once per process. A trim waits until ``1 / budget`` times that cost has
    passed since the last one, so trimming takes at most about ``budget`` of
    the run's time: where activations are small it trims every few layers,
    where they are large it rarely does. ``L2L_MALLOC_TUNING=0`` or a C library
    without these calls makes it a no-op.
    """

    def __init__(self, slack: int = 8 << 20, budget: float = 0.01) -> None:
        self.slack = slack
        self.budget = budget
        self.trims = 0
        self._after: int | None = None   # resident free bytes right after the last trim
        self._last = 0.0                 # when the last trim was
        self._refault = 0                # the most a layer faulted back in after a trim
        self._measuring = False
        self._lock = threading.Lock()  # the relay's workers (--devices K) share the process's heap
        self._libc = None
        if os.environ.get("L2L_MALLOC_TUNING", "1") != "0" and sys.platform.startswith("linux"):
            try:
                libc = ctypes.CDLL(None)
                libc.mallinfo2.restype = _MallInfo2
                libc.malloc_trim.argtypes = [ctypes.c_size_t]
                self._libc = libc
            except (OSError, AttributeError):  # not glibc, or older than 2.33
                self._libc = None

    @property
    def active(self) -> bool:
        return self._libc is not None

    def resident_free(self) -> int:
        """Anonymous resident bytes not in use by any allocation: the allocator's resident
        free memory (plus thread stacks and the like, which do not grow between layers)."""
        info = self._libc.mallinfo2()
        return memory_status().get("RssAnon", 0) - int(info.uordblks) - int(info.hblkhd)

    def trim(self) -> None:
        """Trim now, and measure from here: once the model is built, what reading the data, the
        planner's measurements and the initial weights left free goes back before training."""
        if self._libc is None:
            return
        with self._lock:
            self._trim()

    def _trim(self) -> None:
        self._libc.malloc_trim(0)
        self.trims += 1
        self._after = self.resident_free()
        self._last = time.perf_counter()

    def __call__(self) -> bool:
        """Trim if the resident free memory grew by the slack and the time budget allows; True
        when it trimmed."""
        if self._libc is None:
            return False
        with self._lock:
            return self._maybe_trim()

    def _maybe_trim(self) -> bool:
        free = self.resident_free()
        if self._after is None or free < self._after:
            self._after = free
            return False
        if self._measuring:
            self._refault = max(self._refault, free - self._after)
            self._measuring = False
        if free - self._after < self.slack:
            return False
        cost = self._refault * fault_seconds_per_byte()
        if time.perf_counter() - self._last < cost / self.budget:
            return False
        self._trim()
        self._measuring = True
        return True


_process_trimmer: HeapTrimmer | None = None


def process_heap_trimmer() -> HeapTrimmer:
    """The process's one trimmer: the heap is the process's, so the relay's workers share it
    (one budget, one measurement), whichever engine asks first makes it."""
    global _process_trimmer
    if _process_trimmer is None:
        _process_trimmer = HeapTrimmer()
    return _process_trimmer


_fault_seconds_per_byte: float | None = None


def fault_seconds_per_byte() -> float:
    """What faulting fresh anonymous memory in costs here (the kernel zeroes each page): timed
    once per process on 16 MiB, the cost of a trim's refault."""
    global _fault_seconds_per_byte
    if _fault_seconds_per_byte is None:
        size = 16 << 20
        region = mmap.mmap(-1, size)
        pages = np.frombuffer(region, np.uint8)
        start = time.perf_counter()
        pages[::mmap.PAGESIZE] = 1
        _fault_seconds_per_byte = (time.perf_counter() - start) / size
        del pages
        region.close()
    return _fault_seconds_per_byte


def aligned_empty(n: int, dtype, align: int = 64) -> np.ndarray:
    """``np.empty`` starting on an ``align``-byte boundary (a cache line): vector kernels
    and streaming stores (the OpenCL EPS on a CPU) want whole lines."""
    dtype = np.dtype(dtype)
    raw = np.empty(n * dtype.itemsize + align, np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start:start + n * dtype.itemsize].view(dtype)


STATUS_FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")


def memory_status() -> dict[str, int]:
    """This process's resident set (``VmRSS``), its peak since start or the last reset
    (``VmHWM``) and their parts, in bytes, from ``/proc/self/status``; empty where
    there is no such file (not Linux)."""
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in STATUS_FIELDS:
            out[key] = int(value.split()[0]) * 1024  # the kernel writes kB
    return out


def reset_peak_resident() -> bool:
    """Reset ``VmHWM`` to the current resident set; True when the kernel did."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    s = memory_status()
    return s["VmHWM"] <= s["VmRSS"] + (1 << 20)


def available_memory() -> int | None:
    """Bytes the kernel reckons a new process could take now without swapping
    (``MemAvailable`` in ``/proc/meminfo``: free memory plus the page cache and
    slabs it can reclaim); None where there is no such figure (not Linux)."""
    try:
        text = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key == "MemAvailable":
            return int(value.split()[0]) * 1024  # the kernel writes kB
    return None


_runtime_resident: int | None = None


def record_runtime_resident() -> None:
    """Note the resident set now as the runtime's own (the ``l2l`` command calls this as it
    starts, torch and l2l imported, no model built): the planner's fixed host cost."""
    global _runtime_resident
    import torch  # noqa: F401  (the runtime is mostly torch's: count it whether or not it was imported yet)
    _runtime_resident = memory_status().get("VmRSS")


def runtime_resident() -> int | None:
    """What :func:`record_runtime_resident` noted; None when it was not called (or not Linux)."""
    return _runtime_resident
