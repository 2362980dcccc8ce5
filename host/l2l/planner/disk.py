"""The planner's model of the EPS disk tier (``--eps-offload DIR``, docs/disk-tier.md).

With the tier, each EPS entry's ``p, m, v`` live in a file (``eps/disk_tier.py``) that
is read once and written once per step: the traffic is twice the files' size, 24 bytes
a parameter plus each file's header and padding. The tier reads the next entries of
the update order (backward: descending entry numbers) while one entry updates and
writes the previous one behind it, so the I/O hides under the backward compute of the
entry in between. This module counts the files (:func:`entry_numels`), measures the
disk where they will live (:func:`probe_disk`: the tier's own O_DIRECT I/O), replays
the overlap slot by slot (:func:`overlap`) and gives the host memory the tier leaves
(:func:`host_bytes_with_tier`): the 12 bytes a parameter of state leave memory, a
window of ``2N + 1`` entries of the largest size comes in.

The overlap, per slot: while entry ``e_k`` (the k-th in update order) has its backward
computed and is updated, the disk reads ``e_{k+1}`` and writes ``e_{k-1}``; the
forward pass hosts the write of the step's last entry and the read of the next step's
first. The reads and writes share one disk, so a slot's I/O time is the sum of both
at the measured read and write bandwidths; what exceeds the slot's compute is exposed
(the update waits for its read, or the write queue for its oldest write). A wider
window (``N > 1``) can move I/O from a short slot to an idle one earlier; the model
does not count that, so it errs on the exposed side.
"""
from __future__ import annotations

import errno
import math
import os
import shutil
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..config import TrainConfig
from ..errors import UserError
from ..eps.contract import OPTIMIZERS
from ..eps.disk_tier import DiskTier, copy_layout, file_bytes, free_bytes_at
from ..eps.numerics import COPY_DTYPES
from .model import Prediction
from .shapes import EPS_STATE_BYTES, layer_shapes, with_model_shape

PROBE_BYTES = 256 << 20          # l2l plan's quick probe: one entry of this size each way
SUSTAINED_BYTES = 2 << 30        # l2l bench offload's: past the caches along the way (a VM host's)
PROBE_CHUNK = 256 << 20          # the sustained probe's entries: this size each


# ---------------------------------------------------------------- the files

def entry_numels(cfg: TrainConfig) -> dict[int, int]:
    """The EPS entries with parameters and their sizes, numbered as the relay numbers them:
    one per layer (its own parameters), then one per shared (tied) parameter. The built-in
    GPT by formula (no tied weights); any other family counted on the stack built on the
    meta device, as ``build.offload_tiers`` counts the real one."""
    cfg = with_model_shape(cfg)
    if cfg.model == "gpt":
        return {i: s.params for i, s in enumerate(layer_shapes(cfg))}
    import torch

    from ..models import build_stack
    with torch.device("meta"):
        stack = build_stack(cfg.model_config(), 0)
    return {e: stack.entry_numel(e) for e in range(stack.num_entries) if stack.entry_numel(e) > 0}


def state_file_bytes(numels: dict[int, int], moments: int = 2) -> int:
    """What the state files take on disk: headers and padding included (``moments``: the
    optimizer's, beside p)."""
    return sum(file_bytes(n, moments) for n in numels.values())


def moments_of(x) -> int:
    """The optimizer's moments of a config or a prediction (AdamW 2, Lion 1)."""
    if isinstance(x, Prediction):
        return x.eps_state_bytes // 4 - 1
    return len(OPTIMIZERS[x.optimizer].moments)


def copy_file_bytes(numels: dict[int, int], copy_dtype: str | None) -> int:
    """What the device copies' files take on disk with ``--eps-offload-copies`` (``copy_dtype``
    the run's precision); 0 when the copies stay in memory (None)."""
    if copy_dtype is None:
        return 0
    lay = copy_layout(COPY_DTYPES[copy_dtype])
    return sum(lay.file_bytes(n) for n in numels.values())


def tier_file_bytes(cfg: TrainConfig, numels: dict[int, int]) -> int:
    """Everything the tier keeps on disk for ``cfg``: the state files, and the copies' with
    ``--eps-offload-copies`` (what the run's start-up check asks of the free space)."""
    return state_file_bytes(numels, moments_of(cfg)) + \
        copy_file_bytes(numels, cfg.precision if cfg.eps_offload_copies else None)


def traffic(numels: dict[int, int], copy_dtype: str | None, moments: int = 2) -> tuple[int, int]:
    """(bytes read, bytes written) by the tier in one training step: every state file read
    and written once; with the copies on disk (``copy_dtype``), every copy file read twice
    (the forward's fetch and the backward's) and written once (the update)."""
    state, copies = state_file_bytes(numels, moments), copy_file_bytes(numels, copy_dtype)
    return state + 2 * copies, state + copies


def window_bytes(numels: dict[int, int], window: int, moments: int = 2) -> int:
    """The tier's host memory at most: ``2N + 1`` file images of the largest entry."""
    return (2 * window + 1) * max(file_bytes(n, moments) for n in numels.values())


def copy_window_bytes(numels: dict[int, int], window: int, itemsize: int) -> int:
    """The device copies' buffers in memory with ``--eps-offload-copies`` at most:
    ``2N + 5`` copy-file images of the largest entry (l2l/eps/copy_window.py counts them)."""
    lay = copy_layout(np.dtype(f"<f{itemsize}") if itemsize in (2, 4) else np.dtype(np.float32))
    return (2 * window + 5) * max(lay.file_bytes(n) for n in numels.values())


def state_in_memory_bytes(p: Prediction) -> int:
    """The state (p and the moments) the prediction holds in memory: all of it, or a sharded EPS's 1/R."""
    if p.eps_layout == "sharded" and p.machines > 1:
        return math.ceil(p.eps_state_bytes * p.params / p.machines)
    return p.eps_state_bytes * p.params


def host_bytes_with_tier(p: Prediction, numels: dict[int, int], window: int, copies: bool = False) -> int:
    """The prediction's host peak with the state on disk: less p, m, v, plus the window; with
    ``copies`` (``--eps-offload-copies``) less the device copies too, plus their window.
    Sharded over machines, a machine's window is counted at whole entries (an upper bound)."""
    host = p.host_total_bytes - state_in_memory_bytes(p) + window_bytes(numels, window, moments_of(p))
    if copies:
        copy_bytes = p.host_state_bytes - state_in_memory_bytes(p)  # the prediction's copies, all of them
        itemsize = round(copy_bytes / p.params) if p.params else 4
        host += copy_window_bytes(numels, window, itemsize) - copy_bytes
    return host


def free_bytes(directory: str | os.PathLike) -> int:
    """Free bytes on the filesystem that holds (or will hold) ``directory``: its nearest
    existing ancestor's, as the tier's own start-up check counts it."""
    path = Path(directory).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    if not path.is_dir():
        raise UserError(f"--eps-offload {directory}: {path} is not a directory")
    return free_bytes_at(path)


# ---------------------------------------------------------------- the disk's bandwidth

@dataclass(frozen=True)
class DiskRates:
    """The disk's sequential bandwidth, bytes/s, as the tier moves data. Measured
    (:func:`probe_disk`): each direction's whole transfer, its bytes over its seconds, with
    each entry's own rate in ``chunks`` (the spread) and the writes timed until durable."""

    read_bytes_per_s: float
    write_bytes_per_s: float
    measured: bool = False
    direct: bool | None = None  # the probe's files took O_DIRECT (None: not probed)
    probe_bytes: int = 0        # written, then read, each way (timed)
    chunks: tuple = ()          # per entry moved: {"op", "entry", "bytes", "s", "synced"} (writes also
                                # "call_s": the write call alone, before its sync), in time order
    # with ``mixed``: reads and (synced) writes at once, from two threads as the tier runs them:
    # all the bytes of that phase over its wall time (None: not measured)
    mixed_bytes_per_s: float | None = None

    def __post_init__(self) -> None:
        if not (self.read_bytes_per_s > 0 and self.write_bytes_per_s > 0):
            raise UserError("disk bandwidth must be positive")

    @property
    def write_call_bytes_per_s(self) -> float | None:
        """The probe's writes timed to the end of the write call alone, as the tier's writes
        are (it does not sync them): at least :attr:`write_bytes_per_s`, so the stricter
        reference for the tier's write rate. None when the chunks do not say."""
        calls = [c for c in self.chunks if c["op"] == "write" and "call_s" in c]
        secs = sum(c["call_s"] for c in calls)
        return sum(c["bytes"] for c in calls) / secs if calls and secs > 0 else None

    def spread(self, op: str) -> tuple[float, float, float] | None:
        """(min, median, max) of the per-entry rates of ``op`` ("read"/"write"), bytes/s."""
        rates = sorted(c["bytes"] / c["s"] for c in self.chunks if c["op"] == op and c["s"] > 0)
        return (rates[0], float(np.median(rates)), rates[-1]) if rates else None


def sustained_bytes(directory: str | os.PathLike, target: int = SUSTAINED_BYTES) -> int:
    """The sustained probe's size in ``directory``: ``target``, but no more than a tenth of
    its filesystem's free space (the probe writes twice this: the files are made, then
    rewritten in place, timed), and at least 1 GiB; a multiple of :data:`PROBE_CHUNK`."""
    size = max(1 << 30, min(target, free_bytes(directory) // 10))
    return max(PROBE_CHUNK, size // PROBE_CHUNK * PROBE_CHUNK)


def probe_disk(directory: str | os.PathLike, nbytes: int = PROBE_BYTES, *, chunk: int = PROBE_CHUNK,
               mixed: bool = False) -> DiskRates:
    """Write then read ``nbytes`` in ``directory`` through the tier itself (``DiskTier``: the
    same aligned buffers, whole-entry ``pwritev``/``preadv`` and O_DIRECT as a run), timed.

    ``nbytes`` is split into entries of ``chunk`` bytes (one entry when smaller). Each is
    made first (the tier's fallocate + write + rename; not timed), then all are rewritten in
    place (a run rewrites its files in place), each entry timed from its ``pwritev`` to the
    end of an ``os.fdatasync`` of its file: an O_DIRECT write may still sit in a cache below
    (a virtual disk's host), and the tier does not sync its writes, so the probe waits until
    the data is durable (the write call's own time is kept too, ``call_s``: the tier's
    writes are timed that way, :attr:`DiskRates.write_call_bytes_per_s`). Then the entries are read back in the order they were written,
    first the one written longest ago (O_DIRECT: not from the page cache; and after the
    writes of all the others, so a cache smaller than ``nbytes`` no longer holds it), each
    timed. Each direction's rate is its whole transfer: bytes over the sum of its entries'
    seconds; each entry's record is in ``chunks``.

    With ``mixed``, then a third phase: every entry read on one thread while, on another,
    every entry is rewritten (each until durable, as above), the writer half the entries
    ahead of the reader, both as the tier's read-ahead and write-behind threads run; its
    figure, ``mixed_bytes_per_s``, is all the bytes of the phase over its wall time (the
    disk's rate for both directions at once), and each call's record is in ``chunks`` as
    ``"mixed read"`` and ``"mixed write"``. The probe's directory is removed after,
    and ``directory`` too when the probe created it. A directory the tier refuses (not
    creatable, not writable, too little space) is its one-line UserError."""
    directory = Path(directory)
    created = not directory.exists()
    count = max(1, -(-nbytes // chunk))
    numel = max(1, min(nbytes, chunk) // EPS_STATE_BYTES)
    where = f"--eps-offload {directory}"
    try:
        directory.mkdir(parents=True, exist_ok=True)  # as the run would
    except OSError as exc:
        raise UserError(f"{where}: cannot create it ({exc.strerror or exc})") from None
    if not directory.is_dir():
        raise UserError(f"{where}: not a directory")
    try:
        probe = Path(tempfile.mkdtemp(prefix=".l2l-disk-probe-", dir=directory))
    except OSError as exc:
        raise UserError(f"{where}: not writable ({exc.strerror or exc})") from None
    chunks: list[dict] = []
    mixed_rate = None
    try:
        tier = DiskTier(probe, uuid.uuid4().hex, {e: numel for e in range(count)}, direct=True)
        try:
            slab = tier.slab(0)
            slab.raw[4096:] = 1  # not zeros: nothing along the way may shortcut them
            for e in range(count):  # make the files: allocated, then written once
                tier.retarget(slab, e)
                tier.store(slab)
            for e in range(count):  # rewritten in place, each until durable
                tier.retarget(slab, e)
                t0 = time.perf_counter()
                tier.store(slab)
                t1 = time.perf_counter()
                os.fdatasync(tier.fd(e))
                chunks.append({"op": "write", "entry": e, "bytes": slab.raw.nbytes,
                               "s": time.perf_counter() - t0, "call_s": t1 - t0, "synced": True})
            for e in range(count):  # read back from the first written
                t0 = time.perf_counter()
                tier.read(e, into=slab)
                chunks.append({"op": "read", "entry": e, "bytes": slab.raw.nbytes,
                               "s": time.perf_counter() - t0, "synced": False})
            direct = tier.uses_direct(0)
            if mixed:
                mixed_rate = _mixed(tier, slab, count, chunks)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise UserError(f"{where}: no space for the disk probe ({size_of(count * numel * EPS_STATE_BYTES)})") from None
            raise UserError(f"{where}: the disk probe failed ({exc.strerror or exc})") from None
        finally:
            tier.close()
    finally:
        shutil.rmtree(probe, ignore_errors=True)
        if created:
            shutil.rmtree(directory, ignore_errors=True)

    def rate(op: str) -> tuple[float, int]:
        moved = sum(c["bytes"] for c in chunks if c["op"] == op)
        return moved / sum(c["s"] for c in chunks if c["op"] == op), moved

    (read, size), (write, _) = rate("read"), rate("write")
    return DiskRates(read, write, measured=True, direct=direct, probe_bytes=size, chunks=tuple(chunks),
                     mixed_bytes_per_s=mixed_rate)


def _mixed(tier: DiskTier, slab, count: int, chunks: list[dict]) -> float:
    """The probe's mixed phase (:func:`probe_disk`): all the bytes over the wall time. The
    threads are joined before this returns or raises (an interrupt too): the caller then
    closes the tier's files."""
    spare = tier.slab(0)
    spare.raw[4096:] = 2
    failed: list[BaseException] = []
    stop = threading.Event()

    def reads() -> None:
        try:
            for e in range(count):
                if stop.is_set():
                    return
                t0 = time.perf_counter()
                tier.read(e, into=slab)
                chunks.append({"op": "mixed read", "entry": e, "bytes": slab.raw.nbytes,
                               "s": time.perf_counter() - t0, "synced": False})
        except BaseException as exc:  # raised below, in the caller's thread
            failed.append(exc)

    def writes() -> None:
        try:
            for k in range(count):
                if stop.is_set():
                    return
                e = (k + count // 2) % count
                tier.retarget(spare, e)
                t0 = time.perf_counter()
                tier.store(spare)
                os.fdatasync(tier.fd(e))
                chunks.append({"op": "mixed write", "entry": e, "bytes": spare.raw.nbytes,
                               "s": time.perf_counter() - t0, "synced": True})
        except BaseException as exc:
            failed.append(exc)
    threads = [threading.Thread(target=reads), threading.Thread(target=writes)]
    t0 = time.perf_counter()
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        stop.set()  # an interrupted join: the threads stop after their call under way
        for t in threads:
            if t.ident is not None:
                t.join()
    wall = time.perf_counter() - t0
    if failed:
        raise failed[0]
    return 2 * count * slab.raw.nbytes / wall


def size_of(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB" if n < 2**30 else f"{n / 2**30:,.2f} GiB"


# ---------------------------------------------------------------- the overlap

@dataclass(frozen=True)
class Slot:
    """One stretch of the step the tier's I/O can hide under."""

    name: str
    compute_s: float
    read_bytes: int
    write_bytes: int


def overlap(slots: list[Slot], rates: DiskRates) -> tuple[float, float, list[dict]]:
    """(I/O seconds, exposed seconds, per slot detail): each slot's reads and writes at the
    disk's rates, one after the other (one disk), against the slot's compute."""
    io = exposed = 0.0
    detail = []
    for s in slots:
        s_io = s.read_bytes / rates.read_bytes_per_s + s.write_bytes / rates.write_bytes_per_s
        s_exposed = max(0.0, s_io - s.compute_s)
        io += s_io
        exposed += s_exposed
        detail.append({**asdict(s), "io_s": s_io, "exposed_s": s_exposed})
    return io, exposed, detail


def slots_of(p: Prediction, numels: dict[int, int]) -> list[Slot]:
    """The step's slots in update order (module docstring): each entry's backward (a shared
    entry has none: it updates when its last contribution is in), then the forward."""
    order = sorted(numels, reverse=True)
    backward = {i: d["backward_s"] for i, d in enumerate(p.layers_detail)}
    n, moments = len(order), moments_of(p)
    slots = []
    for k, e in enumerate(order):
        read = file_bytes(numels[order[k + 1]], moments) if k + 1 < n else 0
        write = file_bytes(numels[order[k - 1]], moments) if k else 0
        slots.append(Slot(f"entry {e}", backward.get(e, 0.0), read, write))
    slots.append(Slot("forward", p.forward_s, file_bytes(numels[order[0]], moments),
                      file_bytes(numels[order[-1]], moments)))
    return slots


@dataclass
class DiskPlan:
    """The tier's figures for one step. Times in seconds, sizes in bytes."""

    directory: str
    window: int
    entries: int
    params: int
    state_file_bytes: int        # the files on disk, headers and padding included
    traffic_bytes: int           # per step: every file read once and written once
    free_bytes: int              # on DIR's filesystem
    read_bytes_per_s: float
    write_bytes_per_s: float
    measured: bool
    direct: bool | None
    probe_bytes: int             # what the probe wrote and read, each way (0: given)
    io_s: float                  # the disk busy per step
    exposed_s: float             # what the I/O adds to the step
    hidden_share: float
    step_s: float                # the prediction's step plus the exposed I/O
    window_bytes: int            # the entries in memory at once
    host_total_bytes: int        # the host peak with the tier
    host_total_in_memory_bytes: int  # the same run with the state in memory
    slots: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def plan_disk(cfg: TrainConfig, p: Prediction, rates: DiskRates, *, free: int | None = None) -> DiskPlan:
    """The tier's traffic, its time against the backward compute, and the host memory
    with it, for ``cfg`` predicted as ``p``."""
    numels = entry_numels(cfg)
    files = tier_file_bytes(cfg, numels)
    io, exposed, detail = overlap(slots_of(p, numels), rates)
    return DiskPlan(
        directory=str(cfg.eps_offload), window=cfg.eps_offload_window, entries=len(numels),
        params=sum(numels.values()), state_file_bytes=files,
        traffic_bytes=sum(traffic(numels, cfg.precision if cfg.eps_offload_copies else None, moments_of(cfg))),
        free_bytes=free_bytes(cfg.eps_offload) if free is None else free,
        read_bytes_per_s=rates.read_bytes_per_s, write_bytes_per_s=rates.write_bytes_per_s,
        measured=rates.measured, direct=rates.direct, probe_bytes=rates.probe_bytes, io_s=io, exposed_s=exposed,
        hidden_share=1.0 if io == 0 else 1.0 - exposed / io, step_s=p.step_s + exposed,
        window_bytes=window_bytes(numels, cfg.eps_offload_window, moments_of(cfg)),
        host_total_bytes=host_bytes_with_tier(p, numels, cfg.eps_offload_window, cfg.eps_offload_copies),
        host_total_in_memory_bytes=p.host_total_bytes, slots=detail)


def format_disk(d: DiskPlan) -> str:
    """The disk tier's lines of ``l2l plan``."""
    quick = " (quick: may fit a cache; l2l bench offload's is sustained)" if d.probe_bytes < 1 << 30 else ""
    how = (f"measured, probe: {size_of(d.probe_bytes)} each way{quick}, writes synced"
           + (", O_DIRECT" if d.direct else ", buffered (no O_DIRECT here)") if d.measured else "given")
    fits = "fits" if d.state_file_bytes <= d.free_bytes else "DOES NOT FIT"
    per_param = d.traffic_bytes / d.params
    return "\n".join([
        f"disk tier (--eps-offload {d.directory}, window {d.window}: {2 * d.window + 1} entries in memory)",
        f"{'  state files':<26}{size_of(d.state_file_bytes):>14}   {d.entries} entries; {size_of(d.free_bytes)} "
        f"free there: {fits}",
        f"{'  traffic per step':<26}{size_of(d.traffic_bytes):>14}   read once + written once "
        f"({per_param:.2f} bytes/param with headers and padding)",
        f"{'  disk bandwidth':<26}{'':>14}   read {d.read_bytes_per_s / 1e9:.2f} GB/s, write "
        f"{d.write_bytes_per_s / 1e9:.2f} GB/s ({how})",
        f"{'  disk I/O per step':<26}{d.io_s:10.3f} s   {d.hidden_share:.0%} hidden under backward, "
        f"exposed {d.exposed_s:.3f} s",
        f"{'  step with the tier':<26}{d.step_s:10.3f} s",
        f"{'  host memory with tier':<26}{size_of(d.host_total_bytes):>14}   in memory: "
        f"{size_of(d.host_total_in_memory_bytes)}; less the EPS state (p and the moments), plus the "
        f"window {size_of(d.window_bytes)}",
    ])
