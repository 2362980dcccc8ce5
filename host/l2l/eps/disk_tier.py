"""The EPS state on disk (``--eps-offload DIR``): one checked file per entry, read and written whole.

Layout (docs/disk-tier.md)::

    DIR/manifest.json        format, version, run id, each entry's numel
    DIR/entry00007.state     a 4096-byte header, then p and the optimizer's moments (AdamW:
                             m, v; Lion: m): raw little-endian fp32, each padded to a
                             multiple of 4096 bytes

The header holds the magic ``L2LTIER1``, the format version, the run id, the entry, its numel
and a CRC32 of those fields; every read checks it and the file's size, so a file that is
truncated, damaged or another run's is one line of :class:`~l2l.errors.UserError`, never
garbage weights.

An entry is moved as one image of its file (:class:`Slab`): a 4096-aligned host buffer
read or written with ``preadv``/``pwritev`` in one call per entry (up to 1 GiB a call),
straight from the numpy memory. The state files are ``O_DIRECT`` where the filesystem takes it: they would
otherwise sit in the page cache beside the state in use, which is the memory the tier is
there to save. Where ``O_DIRECT`` is refused (``EINVAL``: tmpfs and some network
filesystems) the I/O is buffered and the pages are dropped after each read and (after
``fdatasync``) each write with ``POSIX_FADV_DONTNEED``.

The files are scratch: a run's committed state is its checkpoints. So writes are not
fsynced, and after a kill the files may be half-updated; a resume rewrites them from the
checkpoint. A file is created under a temporary name and renamed when complete, so a kill
never leaves a short one.
"""
from __future__ import annotations

import bisect
import errno
import json
import os
import shutil
import struct
import threading
import time
import weakref
import zlib
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np

from ..checkpoint import atomic_write_bytes
from ..errors import UserError
from ..hostmem import aligned_empty

MAGIC = b"L2LTIER1"
VERSION = 1
MANIFEST = "manifest.json"
MANIFEST_FORMAT = "l2l-eps-offload"
BLOCK = 4096          # header size, region alignment and buffer alignment (O_DIRECT's unit)
# Bytes per preadv/pwritev call: an entry's image in one call (Linux moves at most 2 GiB - 4 KiB
# a call). Each call returns to Python and waits for the GIL, on a run whose main thread and
# update thread hold it most of the time; 8 MiB chunks cost the tier's threads more than half
# their rate that way on two cores (docs/disk-tier.md, "I/O").
CHUNK = 1 << 30
_FIELDS = struct.Struct("<8sI32sIQ")  # magic, version, run id (32 hex digits), entry, numel
_CRC = struct.Struct("<I")
F32 = np.dtype("<f4")
def free_bytes_at(directory: str | os.PathLike) -> int:
    """Free bytes on ``directory``'s filesystem (it exists)."""
    return shutil.disk_usage(directory).free


class IoLedger:
    """The tier's own account of its I/O: bytes moved and seconds spent inside its whole-entry
    reads and writes (``preadv``/``pwritev`` of an image, and for buffered files the page
    drop after it), per direction, and how many times each entry's file was read and
    written. Thread-safe (the reads and the writes run on two threads): one
    ``perf_counter`` pair and one locked update per entry moved, nothing per chunk.

    The seconds are the time a thread was inside the call, not the wall time: with a read
    and a write under way at once both count, so ``bytes / seconds`` per direction is the
    rate each direction streamed at while it was moving, the figure to hold against the
    disk's own sequential bandwidth (``l2l bench offload``).

    Each call is also logged (:attr:`calls`: its start and end ``perf_counter``, direction
    and bytes; ``time.perf_counter`` is the system's monotonic clock, so another process on
    the machine can place the calls against its own marks), the first :data:`MAX_CALLS` of
    the run (a few MB; ``calls_dropped`` counts the rest), for :func:`timeline`: how much of
    the time reads and writes were under way together, each direction's rate alone and
    overlapped, the bytes a second while any of them was."""

    MAX_CALLS = 1 << 17   # 131072 calls: about 200 steps of a 128-entry model with its copies on disk

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.read_bytes = self.write_bytes = 0
        self.read_s = self.write_s = 0.0
        self.reads: dict[int, int] = {}   # entry -> times its file was read
        self.writes: dict[int, int] = {}  # entry -> times its file was written
        self._starts, self._ends = array("d"), array("d")
        self._sizes = array("q")  # bytes: positive for a read, negative for a write
        self.calls_dropped = 0

    def add(self, write: bool, entry: int, nbytes: int, start: float, end: float) -> None:
        """Book one whole-entry call that ran from ``start`` to ``end`` (``perf_counter``)."""
        seconds = end - start
        with self._lock:
            if write:
                self.write_bytes += nbytes
                self.write_s += seconds
                self.writes[entry] = self.writes.get(entry, 0) + 1
            else:
                self.read_bytes += nbytes
                self.read_s += seconds
                self.reads[entry] = self.reads.get(entry, 0) + 1
            if len(self._starts) < self.MAX_CALLS:
                self._starts.append(start)
                self._ends.append(end)
                self._sizes.append(-nbytes if write else nbytes)
            else:
                self.calls_dropped += 1

    @property
    def calls(self) -> list[tuple[str, float, float, int]]:
        """The logged calls in the order they ended: ``(op, start, end, bytes)``, op "read" or "write"."""
        with self._lock:
            calls = [("write" if n < 0 else "read", a, b, abs(n))
                     for a, b, n in zip(self._starts, self._ends, self._sizes)]
        return sorted(calls, key=lambda c: c[2])  # two threads book their calls: not always in order

    def as_dict(self) -> dict:
        """For ``summary.json``: totals, and the per-entry counts keyed by entry (as strings)."""
        with self._lock:
            return {"read_bytes": self.read_bytes, "read_s": self.read_s,
                    "write_bytes": self.write_bytes, "write_s": self.write_s,
                    "reads": {str(e): n for e, n in sorted(self.reads.items())},
                    "writes": {str(e): n for e, n in sorted(self.writes.items())},
                    "calls_logged": len(self._starts), "calls_dropped": self.calls_dropped}


def _union(spans: list[tuple[float, float]]) -> list[list[float]]:
    """The union of closed intervals, as sorted disjoint ``[start, end]``."""
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _clip(spans: list[list[float]], lo: float, hi: float) -> list[list[float]]:
    """Disjoint sorted intervals cut to ``[lo, hi]``."""
    return [[max(a, lo), min(b, hi)] for a, b in spans if min(b, hi) > max(a, lo)]


def _length(spans: list[list[float]]) -> float:
    return sum(b - a for a, b in spans)


def _intersect(u: list[list[float]], v: list[list[float]]) -> list[list[float]]:
    """The intersection of two sorted disjoint interval lists."""
    out, i, j = [], 0, 0
    while i < len(u) and j < len(v):
        a, b = max(u[i][0], v[j][0]), min(u[i][1], v[j][1])
        if b > a:
            out.append([a, b])
        if u[i][1] < v[j][1]:
            i += 1
        else:
            j += 1
    return out


def _overlap(span: list[float], spans: list[list[float]], ends: list[float]) -> float:
    """How long ``span`` overlaps the sorted disjoint ``spans`` (``ends``: their ends), from the
    first of them that ends after it starts: a log of many calls is not walked per call."""
    a, b = span
    total, i = 0.0, bisect.bisect_right(ends, a)
    while i < len(spans) and spans[i][0] < b:
        total += max(0.0, min(b, spans[i][1]) - max(a, spans[i][0]))
        i += 1
    return total


def timeline(calls, start: float | None = None, end: float | None = None) -> dict:
    """What the logged calls (:attr:`IoLedger.calls`, of one tier or several: the state's and
    the copies') did between ``start`` and ``end`` (``perf_counter``; default: the first
    call's start to the last one's end). A call partly in the window counts its part, its
    bytes in proportion to its time (as if it moved them at an even rate).

    * ``span_s``: the window; ``busy_s``: the time any call was under way; ``read_busy_s``,
      ``write_busy_s``: the time any read (write) was; ``both_s``: reads and writes at once.
    * ``busy_bytes_per_s``: all the bytes over ``busy_s``, the rate of the tier's I/O as a
      whole while it had any in flight (with reads and writes at once each direction's own
      ``bytes / seconds`` counts the shared time twice).
    * per direction (``read``, ``write``): ``bytes``, ``calls``, ``s`` (the seconds inside its
      calls, summed), ``bytes_per_s`` (the ledger's figure), the spread of the calls' own
      rates (``call_rate_min``, ``_p10``, ``_median``, ``_p90``, ``_max``), and the rate
      ``alone`` (the parts of its calls while no call of the other direction was under way)
      and ``overlapped`` (the other parts): ``alone_bytes``, ``alone_s``, ``alone_bytes_per_s``
      and the same for ``overlapped``; ``None`` for a rate over no time.
    """
    calls = list(calls)
    if start is None:
        start = min((c[1] for c in calls), default=0.0)
    if end is None:
        end = max((c[2] for c in calls), default=start)
    inside = [c for c in calls if c[2] > start and c[1] < end and c[2] > c[1]]
    span = max(0.0, end - start)
    unions = {op: _clip(_union([(c[1], c[2]) for c in inside if c[0] == op]), start, end)
              for op in ("read", "write")}
    busy = _clip(_union([(c[1], c[2]) for c in inside]), start, end)
    ends = {op: [b for _, b in spans] for op, spans in unions.items()}
    both = _intersect(unions["read"], unions["write"])
    rate = lambda b, s: b / s if s > 0 else None  # noqa: E731
    out: dict = {"span_s": span, "busy_s": _length(busy), "read_busy_s": _length(unions["read"]),
                 "write_busy_s": _length(unions["write"]), "both_s": _length(both)}
    total = 0.0
    for op, other in (("read", "write"), ("write", "read")):
        moved = secs = alone_b = alone_s = over_b = over_s = 0.0
        rates = []
        for _, a, b, n in (c for c in inside if c[0] == op):
            full = b - a
            part = _clip([[a, b]], start, end)
            s = _length(part)
            if s <= 0:  # only its end point in the window (or the window is empty)
                continue
            nb = n * s / full
            o = _overlap(part[0], unions[other], ends[other])
            moved += nb
            secs += s
            over_s += o
            over_b += nb * o / s
            alone_s += s - o
            alone_b += nb * (s - o) / s
            rates.append(n / full)
        rates.sort()
        pick = lambda q: rates[min(len(rates) - 1, int(q * len(rates)))] if rates else None  # noqa: E731
        out[op] = {"bytes": moved, "calls": len(rates), "s": secs, "bytes_per_s": rate(moved, secs),
                   "call_rate_min": pick(0.0), "call_rate_p10": pick(0.1), "call_rate_median": pick(0.5),
                   "call_rate_p90": pick(0.9), "call_rate_max": rates[-1] if rates else None,
                   "alone_bytes": alone_b, "alone_s": alone_s, "alone_bytes_per_s": rate(alone_b, alone_s),
                   "overlapped_bytes": over_b, "overlapped_s": over_s,
                   "overlapped_bytes_per_s": rate(over_b, over_s)}
        total += moved
    out["busy_bytes_per_s"] = rate(total, out["busy_s"])
    return out


@dataclass(frozen=True)
class Layout:
    """One kind of entry file: its suffix, magic and manifest, and its regions (``regions``
    arrays of ``dtype``, each padded to :data:`BLOCK`). The state files hold ``p`` and the
    moments (:func:`state_layout`; AdamW's: :data:`STATE`); with ``--eps-offload-copies`` the device copies have files of their own
    (:func:`copy_layout`), checked and moved by the same code."""
    suffix: str
    magic: bytes
    manifest: str
    dtype: np.dtype
    regions: int

    def region_bytes(self, numel: int) -> int:
        return -(-self.dtype.itemsize * numel // BLOCK) * BLOCK

    def file_bytes(self, numel: int) -> int:
        return BLOCK + self.regions * self.region_bytes(numel)

    def file_name(self, entry: int) -> str:
        return f"entry{entry:05d}.{self.suffix}"


def state_layout(moments: int = 2) -> Layout:
    """The state files of an optimizer with ``moments`` moments beside ``p``."""
    return Layout("state", MAGIC, MANIFEST, F32, 1 + moments)


STATE = state_layout(2)  # AdamW's


def copy_layout(dtype) -> Layout:
    """The files of the device copies (fp32, bf16 or fp16: the run's ``--precision``)."""
    return Layout("copy", b"L2LCOPY1", "copies.json", np.dtype(dtype), 1)


def file_bytes(numel: int, moments: int = 2) -> int:
    """The size of an entry's state file."""
    return state_layout(moments).file_bytes(numel)


def entry_file(entry: int) -> str:
    return STATE.file_name(entry)


def header(run_id: str, entry: int, numel: int, magic: bytes = MAGIC) -> bytes:
    fields = _FIELDS.pack(magic, VERSION, run_id.encode("ascii"), entry, numel)
    return (fields + _CRC.pack(zlib.crc32(fields))).ljust(BLOCK, b"\0")


def check_run_id(run_id: str) -> str:
    if not (isinstance(run_id, str) and len(run_id) == 32 and all(c in "0123456789abcdef" for c in run_id)):
        raise ValueError(f"a run id is 32 lowercase hex digits (uuid4().hex), not {run_id!r}")
    return run_id


class Slab:
    """One entry's file image in host memory: header, then its regions at their file offsets."""

    def __init__(self, entry: int, numel: int, raw: np.ndarray, layout: Layout = STATE) -> None:
        self.entry, self.numel, self.raw, self.layout = entry, numel, raw, layout

    @property
    def arrays(self) -> tuple[np.ndarray, ...]:
        """The regions (``(p, *moments)`` of a state file): views of ``numel`` elements into the image."""
        lay = self.layout
        r, n = lay.region_bytes(self.numel), lay.dtype.itemsize * self.numel
        return tuple(self.raw[BLOCK + k * r:BLOCK + k * r + n].view(lay.dtype) for k in range(lay.regions))


class DiskTier:
    """The state files of one run in one directory.

    Constructing it checks the directory (creating it when missing) and changes nothing
    else: the manifest of another run, a state file of this run that is short or whose
    header is wrong, or too little free space for the files is a one-line UserError.
    :meth:`prepare` then writes the manifest; :meth:`store` and :meth:`read` move entries.
    ``direct=False`` asks for buffered I/O (what a filesystem without O_DIRECT gets).
    """

    def __init__(self, directory: str | os.PathLike, run_id: str, numels: Mapping[int, int], *,
                 direct: bool = True, layout: Layout = STATE, also_needs: int = 0) -> None:
        """``layout``: which files (the state's by default); ``also_needs``: bytes that other
        files of the run (the state's, beside the copies') will take from the same free space."""
        self.directory = Path(directory)
        self.layout, self.also_needs = layout, also_needs
        self.run_id = check_run_id(run_id)
        self.numels = {int(e): int(n) for e, n in numels.items()}
        if any(n <= 0 for n in self.numels.values()):
            raise ValueError("entries of the disk tier have at least one element")
        self.direct = direct   # O_DIRECT asked for; False once a filesystem refused it
        self.open_flags: dict[int, int] = {}  # entry -> flags its file was opened with
        self._fds: dict[int, int] = {}
        self._lock = threading.Lock()
        self.live_bytes = 0       # slab memory alive now, and its peak: the tier's host footprint
        self.peak_live_bytes = 0
        self.io = IoLedger()      # bytes and seconds of the tier's own reads and writes
        self._check()

    @property
    def where(self) -> str:
        return f"--eps-offload {self.directory}"

    def path(self, entry: int) -> Path:
        return self.directory / self.layout.file_name(entry)

    def _tmp_path(self, entry: int) -> Path:
        return self.directory / (self.layout.file_name(entry) + ".tmp")

    # ------------------------------------------------------------ start-up
    def _check(self) -> None:
        d = self.directory
        try:
            d.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            raise UserError(f"{self.where}: exists and is not a directory") from None
        except OSError as exc:
            raise UserError(f"{self.where}: cannot create it ({exc.strerror or exc})") from None
        if not d.is_dir():
            raise UserError(f"{self.where}: not a directory")
        if not os.access(d, os.W_OK | os.X_OK):
            raise UserError(f"{self.where}: not writable")
        self._check_manifest(d / MANIFEST)
        if self.layout.manifest != MANIFEST:
            self._check_manifest(d / self.layout.manifest)
        held = 0
        for entry, numel in sorted(self.numels.items()):
            path = self.path(entry)
            if os.path.lexists(path):
                self._check_file(entry, path)
                held += self.layout.file_bytes(numel)
        self.held_bytes = held  # already on disk (a resume): no new space needed for them
        need = self.total_bytes() - held + self.also_needs
        free = self.free_bytes()
        if need > free:
            raise UserError(f"{self.where}: the EPS state needs {need / 2**30:.2f} GiB more there, and its "
                            f"filesystem has {free / 2**30:.2f} GiB free")

    def total_bytes(self) -> int:
        """The files' total size, headers and padding included."""
        return sum(self.layout.file_bytes(n) for n in self.numels.values())

    def free_bytes(self) -> int:
        return free_bytes_at(self.directory)

    def _check_manifest(self, path: Path) -> None:
        if not os.path.lexists(path):
            return
        try:
            doc = json.loads(path.read_bytes().decode("utf-8"))
        except (OSError, UnicodeDecodeError, ValueError):
            doc = None
        if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT:
            raise UserError(f"{self.where}: {path.name} is not an l2l EPS offload manifest; give an empty directory")
        if doc.get("version") != VERSION:
            raise UserError(f"{self.where}: {path.name} has format version {doc.get('version')!r}; this l2l "
                            f"writes version {VERSION}")
        if doc.get("run") != self.run_id:
            raise UserError(f"{self.where} holds the EPS state of another run ({doc.get('run')}): give an empty "
                            "directory or remove it")

    def _check_file(self, entry: int, path: Path) -> None:
        """A state file's size and header against this run (the file is not changed)."""
        try:
            size = os.stat(path).st_size
            with open(path, "rb") as f:
                head = f.read(BLOCK)
        except OSError as exc:
            raise UserError(f"{path}: cannot read it ({exc.strerror or exc})") from None
        self._check_image(entry, head, size, path)

    def _check_image(self, entry: int, head: bytes, size: int, path: Path) -> None:
        want = self.layout.file_bytes(self.numels[entry])
        if size < BLOCK:
            raise UserError(f"{path}: truncated: {size} of {want} bytes")
        problem = self._header_problem(entry, bytes(head[:BLOCK]))
        if problem:
            raise UserError(f"{path}: {problem}")
        if size != want:
            raise UserError(f"{path}: truncated: {size} of {want} bytes" if size < want else
                            f"{path}: {size} bytes, expected {want}")

    def _header_problem(self, entry: int, head: bytes) -> str | None:
        magic, version, run, got_entry, numel = _FIELDS.unpack_from(head)
        if magic != self.layout.magic:
            return f"not an l2l EPS {self.layout.suffix} file"
        if _CRC.unpack_from(head, _FIELDS.size)[0] != zlib.crc32(head[:_FIELDS.size]):
            return "damaged header (CRC mismatch)"
        if version != VERSION:
            return f"format version {version}; this l2l reads version {VERSION}"
        run = run.decode("ascii", "replace")
        if run != self.run_id:
            return f"belongs to run {run}, this run is {self.run_id}"
        if got_entry != entry:
            return f"holds entry {got_entry}, expected {entry}"
        if numel != self.numels[entry]:
            return f"holds {numel} parameters, expected {self.numels[entry]}"
        return None

    def prepare(self) -> None:
        """Write the manifest (after the checks: the directory is this run's from now on)."""
        doc = {"format": MANIFEST_FORMAT, "version": VERSION, "run": self.run_id,
               "entries": {str(e): n for e, n in sorted(self.numels.items())}}
        atomic_write_bytes(self.directory / self.layout.manifest, (json.dumps(doc, indent=1) + "\n").encode())
        for entry in self.numels:  # a file a kill left half-created: a new one is written whole
            tmp = self._tmp_path(entry)
            if os.path.lexists(tmp):
                os.unlink(tmp)

    # ------------------------------------------------------------ memory
    def slab(self, entry: int) -> Slab:
        """A zeroed image of the entry's file with its header: the buffer every read and write uses."""
        numel = self.numels[entry]
        raw = aligned_empty(self.layout.file_bytes(numel), np.uint8, align=BLOCK)
        raw[...] = 0
        raw[:BLOCK] = np.frombuffer(header(self.run_id, entry, numel, self.layout.magic), np.uint8)
        nbytes = raw.nbytes
        with self._lock:
            self.live_bytes += nbytes
            self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)
        weakref.finalize(raw.base, self._freed, nbytes)
        return Slab(entry, numel, raw, self.layout)

    def retarget(self, slab: Slab, entry: int) -> None:
        """Make a spare image of an entry of the same size serve ``entry`` (its header rewritten)."""
        if self.numels[entry] != slab.numel:
            raise ValueError(f"a slab of {slab.numel} elements cannot hold entry {entry} ({self.numels[entry]})")
        slab.raw[:BLOCK] = np.frombuffer(header(self.run_id, entry, slab.numel, self.layout.magic), np.uint8)
        slab.entry = entry

    def _freed(self, nbytes: int) -> None:
        with self._lock:
            self.live_bytes -= nbytes

    # ------------------------------------------------------------ I/O
    def _open(self, path: Path, flags: int) -> tuple[int, int]:
        """(fd, flags): O_DIRECT when asked and the filesystem takes it, else buffered."""
        if self.direct and hasattr(os, "O_DIRECT"):
            try:
                return os.open(path, flags | os.O_DIRECT, 0o644), flags | os.O_DIRECT
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.direct = False  # e.g. tmpfs: buffered, with the pages dropped after use
        return os.open(path, flags, 0o644), flags

    def _fd(self, entry: int) -> int:
        with self._lock:
            fd = self._fds.get(entry)
            if fd is None:
                fd, self.open_flags[entry] = self._open(self.path(entry), os.O_RDWR)
                self._fds[entry] = fd
            return fd

    def exists(self, entry: int) -> bool:
        return entry in self._fds or os.path.lexists(self.path(entry))

    def read(self, entry: int, into: Slab | None = None) -> Slab:
        """The entry's file image, its header and size checked (UserError when wrong); read
        ``into`` a spare image of the same size when given."""
        fd = self._fd(entry)
        if into is not None:
            self.retarget(into, entry)
        slab = into if into is not None else self.slab(entry)
        self._read_head(entry, fd, slab.raw)
        return slab

    def read_masters(self, entry: int) -> np.ndarray:
        """The entry's first region alone (a state file's ``p``, the master weights), read
        with the header and checked as :meth:`read` checks: the moments are not read."""
        fd = self._fd(entry)
        numel = self.numels[entry]
        raw = aligned_empty(BLOCK + self.layout.region_bytes(numel), np.uint8, align=BLOCK)
        self._read_head(entry, fd, raw)
        return raw[BLOCK:BLOCK + numel * self.layout.dtype.itemsize].view(self.layout.dtype)

    def _read_head(self, entry: int, fd: int, raw: np.ndarray) -> None:
        """Read the first ``raw.nbytes`` of the entry's file into ``raw`` (booked in the ledger),
        then check its header and the file's size."""
        t0 = time.perf_counter()
        got = _transfer(os.preadv, fd, raw)  # short at EOF: the size check below says so
        self._drop_pages(fd, self.open_flags[entry], wrote=False)
        self.io.add(False, entry, got, t0, time.perf_counter())
        self._check_image(entry, raw[:BLOCK].tobytes(), os.fstat(fd).st_size, self.path(entry))

    def store(self, slab: Slab) -> None:
        """Write the image to the entry's file: in place, or for a new file under a temporary
        name renamed once complete (a kill never leaves a short state file)."""
        entry = slab.entry
        if self.exists(entry):
            fd = self._fd(entry)
            self._write(fd, self.open_flags[entry], slab)
            return
        tmp = self._tmp_path(entry)
        fd, flags = self._open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
        try:
            try:
                os.posix_fallocate(fd, 0, slab.raw.nbytes)  # ENOSPC now, not halfway; one extent
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
            self._write(fd, flags, slab)
            os.rename(tmp, self.path(entry))
        except BaseException:
            os.close(fd)
            raise
        with self._lock:
            self._fds[entry], self.open_flags[entry] = fd, flags

    def _write(self, fd: int, flags: int, slab: Slab) -> None:
        t0 = time.perf_counter()
        put = _transfer(os.pwritev, fd, slab.raw)
        if put != slab.raw.nbytes:
            raise OSError(errno.EIO, f"short write: {put} of {slab.raw.nbytes} bytes", str(self.path(slab.entry)))
        self._drop_pages(fd, flags, wrote=True)
        self.io.add(True, slab.entry, put, t0, time.perf_counter())

    @staticmethod
    def _drop_pages(fd: int, flags: int, wrote: bool) -> None:
        """Buffered I/O only: drop the file's pages from the page cache (dirty ones once written)."""
        if flags & getattr(os, "O_DIRECT", 0):
            return
        if wrote:
            os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def uses_direct(self, entry: int) -> bool:
        return bool(self.open_flags.get(entry, 0) & getattr(os, "O_DIRECT", 0))

    def fd(self, entry: int) -> int:
        """The entry's open file descriptor (tests read its flags from /proc)."""
        return self._fd(entry)

    def close(self) -> None:
        with self._lock:
            fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)


def _transfer(call, fd: int, raw: np.ndarray) -> int:
    """``os.preadv``/``os.pwritev`` of ``raw`` at offset 0, in CHUNK pieces; bytes moved (short at EOF)."""
    view = memoryview(raw).cast("B")
    done = 0
    while done < len(view):
        n = call(fd, [view[done:done + CHUNK]], done)
        if n <= 0:
            break
        done += n
    return done
