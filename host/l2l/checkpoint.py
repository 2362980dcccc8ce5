"""Crash-safe training checkpoints: named numpy arrays plus JSON metadata.

A run keeps its checkpoints under ``<run_dir>/checkpoints/``::

    checkpoints/
        LATEST                  text: name of the newest complete checkpoint
        step-00000120/
            tensors.safetensors arrays (safetensors: raw bytes, nothing executable)
            meta.json           format version, step, size + SHA-256 of the
                                tensor file, and the trainer's own metadata
        step-00000123/          a run of several machines (format version 2):
            shard-00000-of-00002.safetensors   each machine's slices, ``name@start``
            shard-00001-of-00002.safetensors
            meta.json           every file's size and SHA-256, written last by rank 0
        .tmp-...                a save in progress, or one that was killed

Why it is safe to kill the process at any instant:

* A checkpoint is written into a ``.tmp-*`` directory, every file is fsynced,
  then the directory, and only then is it renamed to ``step-XXXXXXXX``. A
  ``step-*`` directory therefore only ever appears complete.
* ``LATEST`` is replaced atomically (temp file, fsync, ``os.replace``, fsync of
  the directory) after the rename, so it always names a complete checkpoint.
* Old checkpoints and stale ``.tmp-*`` entries are deleted only after
  ``LATEST`` names the new one.
* ``meta.json`` records the size and SHA-256 of the tensor file, so a torn or
  bit-rotted file is reported instead of silently resuming from garbage.

Decisions the layout leaves open:

* Saving a step whose directory already exists (e.g. a run resumed from an
  older checkpoint reaches the same step again) replaces it: the old
  directory is first renamed to ``.tmp-replaced-<name>``, the new one takes
  its name, then it is deleted with the other stale entries. If the process
  dies between those two renames and ``LATEST`` names that step, loading
  uses the ``.tmp-replaced-<name>`` copy, so the run is never left without a
  good checkpoint.
* If ``LATEST`` is missing (a crash after the first save's rename but before
  ``LATEST`` was written, or someone deleted it), :func:`load_latest` falls
  back to the newest ``step-*`` directory that verifies, with a warning. If
  ``LATEST`` exists but names a missing or corrupt checkpoint, that is an
  error: silently resuming from an older step would hide data loss.
* Pruning keeps the new checkpoint and the ``keep - 1`` newest ones with a
  lower step. Directories with a *higher* step (left by a run that was
  resumed from an older checkpoint) are left alone; re-reaching that step
  replaces them.

One process saves into a run directory at a time; nothing here locks.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Protocol

import numpy as np

from .errors import UserError, one_line

__all__ = [
    "Checkpoint",
    "LazyArrays",
    "spec_of",
    "FORMAT_VERSION",
    "atomic_write_bytes",
    "fsync_dir",
    "fsync_write_text",
    "list_checkpoints",
    "load_checkpoint",
    "load_latest",
    "save_checkpoint",
    "save_sharded_checkpoint",
    "step_dir_name",
]

FORMAT_NAME = "l2l-checkpoint"
FORMAT_VERSION = 1
SHARDED_VERSION = 2  # the tensors in one file per machine (save_sharded_checkpoint)
_KNOWN_VERSIONS = frozenset({FORMAT_VERSION, SHARDED_VERSION})

CHECKPOINTS_DIR = "checkpoints"
LATEST_FILE = "LATEST"
TENSORS_FILE = "tensors.safetensors"
SHARD_FILE = "shard-{rank:05d}-of-{world:05d}.safetensors"
META_FILE = "meta.json"
TMP_PREFIX = ".tmp-"
_REPLACED_PREFIX = TMP_PREFIX + "replaced-"

_STEP_DIR_RE = re.compile(r"step-(\d{8,})")
_HASH_CHUNK = 4 << 20

# dtypes safetensors.numpy reads back, by the name the safetensors header gives them;
# anything else (bfloat16, float128, object, ...) would fail on load, so refuse on save.
_SAFETENSORS_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
    "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8",
    "bool": "BOOL", "complex64": "C64",
}
_SUPPORTED_DTYPES = frozenset(_SAFETENSORS_DTYPES)
_NUMPY_DTYPES = {code: np.dtype(name).newbyteorder("<") for name, code in _SAFETENSORS_DTYPES.items()}
# bytes per element of every dtype :func:`safetensors_header` sizes, by its header name
SAFETENSORS_ITEMSIZES = {**{code: dtype.itemsize for code, dtype in _NUMPY_DTYPES.items()},
                         "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1}


class LazyArrays(Mapping):
    """Named arrays whose shapes and dtypes are known up front and whose data is made when
    read: what :func:`save_checkpoint` writes one array at a time, so a save holds one
    array beside the file, not a copy of the whole state. Read them before their source
    changes (an engine's, before it trains again)."""

    def __init__(self, specs: Mapping[str, tuple[tuple[int, ...], np.dtype]],
                 read: Callable[[str], np.ndarray]) -> None:
        self._specs = {k: (tuple(shape), np.dtype(dtype)) for k, (shape, dtype) in specs.items()}
        self._read = read

    def spec(self, key: str) -> tuple[tuple[int, ...], np.dtype]:
        return self._specs[key]

    def __getitem__(self, key: str) -> np.ndarray:
        shape, dtype = self._specs[key]
        a = np.asarray(self._read(key), order="C")
        if a.shape != shape or a.dtype != dtype:
            raise ValueError(f"{key}: read {a.dtype}{list(a.shape)}, announced {dtype}{list(shape)}")
        return a

    def __iter__(self) -> Iterator[str]:
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)


def spec_of(tensors: Mapping[str, np.ndarray], key: str) -> tuple[tuple[int, ...], np.dtype]:
    """An array's shape and dtype, without reading it when ``tensors`` are :class:`LazyArrays`."""
    if isinstance(tensors, LazyArrays):
        return tensors.spec(key)
    a = np.asarray(tensors[key])
    return tuple(a.shape), a.dtype


@dataclass
class Checkpoint:
    """A verified checkpoint: its step, arrays, the trainer's meta, and where it lives.
    ``tensors`` reads each array from the file when it is asked for (a resume holds one
    layer's state at a time, not the whole checkpoint)."""

    step: int
    tensors: Mapping[str, np.ndarray]
    meta: dict[str, Any]
    path: Path


# --------------------------------------------------------------------------
# Durable small-file helpers (also used by other modules, e.g. metrics).


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory so renames/creations inside it survive power loss."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Replace ``path`` with ``data`` so readers see the old or new file, never a torn one.

    Writes a sibling temp file, fsyncs it, ``os.replace``s it over ``path``
    and fsyncs the directory so the replacement itself is durable.
    """
    path = Path(path)
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        _remove_quietly(tmp)
        raise
    fsync_dir(path.parent)


def fsync_write_text(path: str | os.PathLike, text: str) -> None:
    """Atomically and durably replace ``path`` with UTF-8 ``text`` (see :func:`atomic_write_bytes`)."""
    atomic_write_bytes(path, text.encode("utf-8"))


# --------------------------------------------------------------------------
# Save


def step_dir_name(step: int) -> str:
    """Directory name for ``step``; zero-padded so names sort like steps."""
    return f"step-{step:08d}"


def save_checkpoint(
    run_dir: str | os.PathLike,
    step: int,
    tensors: Mapping[str, np.ndarray],
    meta: Mapping[str, Any],
    keep: int = 2,
    before_commit: Callable[[], None] | None = None,
) -> Path:
    """Durably save ``tensors`` and ``meta`` as the checkpoint for ``step``; return its directory.

    ``meta`` must be JSON-serialisable; it round-trips with JSON's rules
    (tuples come back as lists, dict keys as strings). When this returns,
    ``LATEST`` names the new checkpoint and at most ``keep`` checkpoints with
    step <= ``step`` remain. ``before_commit`` runs once the new files are
    durable but not yet in place (fault-injection point for crash tests).
    """
    step, meta = _checked_call(step, keep, meta)
    specs = _checked_specs(tensors)
    ckpt_dir, tmp = _new_tmp(run_dir, step)
    try:
        tensor_path = tmp / TENSORS_FILE
        _write_safetensors(tensor_path, tensors, specs, metadata={"format": FORMAT_NAME, "step": str(step)})
        nbytes, digest = _hash(tensor_path, fsync=True)
    except BaseException:
        _remove_quietly(tmp)
        raise
    files = {"file": TENSORS_FILE, "bytes": nbytes, "sha256": digest, "count": len(tensors)}
    return _commit(tmp, ckpt_dir, step, keep, FORMAT_VERSION, files, meta, before_commit)


def _checked_call(step, keep, meta) -> tuple[int, dict]:
    """``step`` and ``meta`` as a save writes them, or the error, before anything touches the disk."""
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep must be an int >= 1, got {keep!r}")
    if not isinstance(meta, Mapping):
        raise TypeError(f"meta must be a dict, got {type(meta).__name__}")
    meta = dict(meta)
    json.dumps(meta)  # fail on non-JSON meta now
    return int(step), meta


def _new_tmp(run_dir: str | os.PathLike, step: int) -> tuple[Path, Path]:
    """The run's checkpoint directory (made if missing) and a new temporary directory in it."""
    ckpt_dir = Path(run_dir) / CHECKPOINTS_DIR
    if not ckpt_dir.is_dir():
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        fsync_dir(ckpt_dir.parent)
    tmp = ckpt_dir / f"{TMP_PREFIX}{step_dir_name(step)}-{os.getpid()}-{secrets.token_hex(4)}"
    os.mkdir(tmp)
    return ckpt_dir, tmp


def _commit(tmp: Path, ckpt_dir: Path, step: int, keep: int, version: int, tensors: dict, meta: dict,
            before_commit: Callable[[], None] | None = None) -> Path:
    """Write ``meta.json`` (the tensor files' record ``tensors``) last into ``tmp``, whose tensor
    files are durable, then make it the step's directory, name it in ``LATEST`` and prune."""
    name = step_dir_name(step)
    try:
        doc = {"format": FORMAT_NAME, "version": version, "step": step, "tensors": tensors, "meta": meta}
        with open(tmp / META_FILE, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(tmp)
        if before_commit is not None:
            before_commit()
        final = _move_into_place(tmp, ckpt_dir, name)
    except BaseException:
        _remove_quietly(tmp)
        raise
    fsync_write_text(ckpt_dir / LATEST_FILE, name + "\n")
    _prune(ckpt_dir, step, keep)
    return final


class Team(Protocol):
    """The machines saving one checkpoint together (``l2l.distributed.ShardCollectives``)."""
    rank: int
    world: int

    def agree_text(self, text: str) -> str:
        """Rank 0's ``text`` on every machine."""

    def gather_text(self, text: str) -> list[str]:
        """Every machine's ``text``, by rank, on every machine."""


def save_sharded_checkpoint(run_dir: str | os.PathLike, step: int, pieces: Mapping[str, np.ndarray],
                            starts: Mapping[str, int], numels: Mapping[str, int], meta: Mapping[str, Any],
                            team: Team, keep: int = 2) -> Path:
    """:func:`save_checkpoint` by several machines at once, each writing its own pieces: every
    machine calls it with its ``pieces`` (a part of each named 1-D array, from element
    ``starts[name]``), the same ``numels`` (each whole array's length) and, from rank 0, the
    ``meta`` written. Each machine writes and fsyncs its file in the one temporary directory
    rank 0 made; rank 0 then writes ``meta.json`` with every file's size and SHA-256 (format
    version 2), last, and commits the directory as :func:`save_checkpoint` does. A machine
    that dies leaves a ``.tmp-*`` directory, never a step. Returns the checkpoint's directory."""
    step, meta = _checked_call(step, keep, meta)
    ckpt_dir = Path(run_dir) / CHECKPOINTS_DIR
    tmp = ckpt_dir / team.agree_text(_new_tmp(run_dir, step)[1].name if team.rank == 0 else "")
    file = SHARD_FILE.format(rank=team.rank, world=team.world)
    named = {f"{key}@{int(starts[key])}": key for key in pieces if spec_of(pieces, key)[0] != (0,)}
    local = LazyArrays({k: spec_of(pieces, key) for k, key in named.items()}, lambda k: pieces[named[k]])
    try:
        _write_safetensors(tmp / file, local, _checked_specs(local),
                           metadata={"format": FORMAT_NAME, "step": str(step), "rank": str(team.rank)})
        nbytes, digest = _hash(tmp / file, fsync=True)
        report = f"{nbytes} {digest} {len(local)}"
    except OSError as exc:
        report = "error " + one_line(exc).encode()[:200].decode(errors="ignore")  # a short text for the others
    reports = team.gather_text(report)
    failed = [f"machine {r}: {t[len('error '):]}" for r, t in enumerate(reports) if t.startswith("error ")]
    if failed:
        if team.rank == 0:
            _remove_quietly(tmp)
        raise UserError(f"checkpoint of step {step} not written: {'; '.join(failed)}")
    if team.rank != 0:
        return ckpt_dir / team.agree_text("")
    shards = []
    for r, text in enumerate(reports):
        nbytes, digest, count = text.split()
        shards.append({"file": SHARD_FILE.format(rank=r, world=team.world), "bytes": int(nbytes),
                       "sha256": digest, "count": int(count)})
    files = {"shards": shards, "numels": {k: int(n) for k, n in numels.items()}}
    final = _commit(tmp, ckpt_dir, step, keep, SHARDED_VERSION, files, meta)
    team.agree_text(final.name)  # the others return once the step is committed
    return final


def _checked_specs(tensors: Mapping[str, np.ndarray]) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Validate names and dtypes; each array's (shape, dtype), read from a :class:`LazyArrays`
    without making its data."""
    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors must be a dict of numpy arrays, got {type(tensors).__name__}")
    specs: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
    for key in tensors:
        if not isinstance(key, str) or not key or key == "__metadata__":
            raise ValueError(f"invalid tensor name {key!r}")
        if not isinstance(tensors, LazyArrays) and not isinstance(tensors[key], (np.ndarray, np.generic)):
            raise TypeError(f"tensor {key!r} is a {type(tensors[key]).__name__}, not a numpy array")
        shape, dtype = spec_of(tensors, key)
        if dtype.name not in _SUPPORTED_DTYPES:
            raise TypeError(f"tensor {key!r} has dtype {dtype}, which checkpoints cannot store")
        specs[key] = (tuple(shape), dtype)
    return specs


def _write_safetensors(path: Path, tensors: Mapping[str, np.ndarray],
                       specs: dict[str, tuple[tuple[int, ...], np.dtype]], metadata: dict[str, str]) -> None:
    """Write ``tensors`` as a safetensors file, one array at a time.

    The format is an 8-byte little-endian header length, a JSON header (each tensor's
    dtype, shape and byte range in the data, and ``__metadata__``) padded with spaces to
    8 bytes, then the data. The header needs only the specs, so each array is made (a
    :class:`LazyArrays` reads it then), written and dropped in turn; the library's own
    writer takes every array at once; :func:`_read_safetensors` reads them back one at a time.
    """
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for key, (shape, dtype) in specs.items():
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        header[key] = {"dtype": _SAFETENSORS_DTYPES[dtype.name], "shape": list(shape),
                       "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for key in specs:
            a = np.asarray(tensors[key], order="C")  # safetensors data is little-endian
            a = a.astype(a.dtype.newbyteorder("<"), copy=False)
            f.write(a.reshape(-1).view(np.uint8).data if a.size else b"")
            del a


def _move_into_place(tmp: Path, ckpt_dir: Path, name: str) -> Path:
    """Rename the finished temp dir to ``name``, moving an existing one aside first."""
    final = ckpt_dir / name
    if not os.path.lexists(final):
        os.rename(tmp, final)
        fsync_dir(ckpt_dir)
        return final
    # ``final`` only ever appears complete, so any older aside copy is redundant.
    aside = ckpt_dir / f"{_REPLACED_PREFIX}{name}"
    if os.path.lexists(aside):
        _remove_quietly(aside)
    os.rename(final, aside)
    try:
        os.rename(tmp, final)
    except BaseException:
        try:
            os.rename(aside, final)
        except OSError:
            pass  # load_latest still finds the aside copy
        raise
    fsync_dir(ckpt_dir)
    return final


def _prune(ckpt_dir: Path, step: int, keep: int) -> None:
    """Delete checkpoints beyond ``keep`` and stale temp entries; failures only warn.

    Runs after LATEST names the new checkpoint, so nothing deleted here can
    be the only good one.
    """
    older = sorted((s for s, _ in _step_dirs(ckpt_dir) if s < step), reverse=True)
    doomed = [ckpt_dir / step_dir_name(s) for s in older[keep - 1 :]]
    doomed += [p for p in ckpt_dir.iterdir() if p.name.startswith(TMP_PREFIX)]
    for p in doomed:
        try:
            _remove(p)
        except OSError as e:
            warnings.warn(f"could not delete old checkpoint entry {p}: {e}", RuntimeWarning, stacklevel=3)


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    else:
        p.unlink()


def _remove_quietly(p: Path) -> None:
    try:
        _remove(p)
    except OSError:
        pass


# --------------------------------------------------------------------------
# Load


def _step_dirs(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """(step, path) of every ``step-*`` directory, unsorted; temp entries excluded."""
    out = []
    for p in ckpt_dir.iterdir():
        m = _STEP_DIR_RE.fullmatch(p.name)
        if m and p.is_dir():
            out.append((int(m.group(1)), p))
    return out


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Checkpoint directories of a run, oldest step first (not verified)."""
    ckpt_dir = Path(run_dir) / CHECKPOINTS_DIR
    if not ckpt_dir.is_dir():
        return []
    return [p for _, p in sorted(_step_dirs(ckpt_dir))]


def load_latest(run_dir: str | os.PathLike) -> Checkpoint | None:
    """Load and verify the checkpoint ``LATEST`` names; None if the run has none.

    Without ``LATEST``, falls back to the newest step directory that
    verifies (with a warning). Raises UserError when ``LATEST`` names a
    missing or corrupt checkpoint, or when no checkpoint verifies.
    """
    ckpt_dir = Path(run_dir) / CHECKPOINTS_DIR
    if not ckpt_dir.is_dir():
        return None
    latest = ckpt_dir / LATEST_FILE
    try:
        raw = latest.read_bytes()
    except FileNotFoundError:
        return _load_newest_verifying(ckpt_dir)
    except OSError as e:
        raise UserError(f"cannot read {latest}: {e.strerror or e}") from None
    try:
        name = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        name = None
    if not name or not _STEP_DIR_RE.fullmatch(name):
        raise UserError(f"{latest} is corrupt: it should name a step-XXXXXXXX directory, found {raw[:40]!r}")
    target = ckpt_dir / name
    if not target.exists():
        aside = ckpt_dir / f"{_REPLACED_PREFIX}{name}"
        if aside.is_dir():  # killed while replacing this very step; the old copy is intact
            return load_checkpoint(aside)
        raise UserError(f"{latest} names {target}, which does not exist")
    return load_checkpoint(target)


def _load_newest_verifying(ckpt_dir: Path) -> Checkpoint | None:
    candidates = dict(_step_dirs(ckpt_dir))
    for p in ckpt_dir.iterdir():  # copies orphaned by a kill while replacing a step
        m = _STEP_DIR_RE.fullmatch(p.name[len(_REPLACED_PREFIX) :])
        if p.name.startswith(_REPLACED_PREFIX) and m and p.is_dir():
            candidates.setdefault(int(m.group(1)), p)
    if not candidates:
        return None
    errors = []
    for step in sorted(candidates, reverse=True):
        try:
            ckpt = load_checkpoint(candidates[step])
        except UserError as e:
            errors.append(str(e))
            continue
        why = "; skipped: " + "; ".join(errors) if errors else ""
        warnings.warn(
            f"{ckpt_dir / LATEST_FILE} is missing; resuming from {ckpt.path}{why}",
            RuntimeWarning,
            stacklevel=3,
        )
        return ckpt
    raise UserError(f"no checkpoint in {ckpt_dir} verifies and LATEST is missing; newest: {errors[0]}")


def load_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Load one checkpoint directory after checking its format, size, SHA-256 and the tensor
    file's header; the arrays are read when asked for (:class:`Checkpoint`).

    Any problem raises UserError with a one-line message naming the path.
    """
    path = Path(path)
    where = f"checkpoint {path}"
    if not path.is_dir():
        raise UserError(f"{where} does not exist" if not path.exists() else f"{where} is not a directory")

    meta_path = path / META_FILE
    try:
        raw = meta_path.read_bytes()
    except FileNotFoundError:
        raise UserError(f"{where} is incomplete: {META_FILE} is missing") from None
    except OSError as e:
        raise UserError(f"{where} is unreadable: {META_FILE}: {e.strerror or e}") from None
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{where} is corrupt: {META_FILE} is not valid JSON ({one_line(e)})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise UserError(f"{where} is corrupt: {META_FILE} is not an {FORMAT_NAME} file")
    version = doc.get("version")
    if type(version) is not int or version not in _KNOWN_VERSIONS:
        known = ", ".join(map(str, sorted(_KNOWN_VERSIONS)))
        raise UserError(f"{where} has format version {version!r}; this l2l reads version {known}")
    step, info, user_meta = doc.get("step"), doc.get("tensors"), doc.get("meta")
    files = _tensor_files(info, version)
    if (
        not isinstance(step, int) or isinstance(step, bool) or step < 0
        or not isinstance(user_meta, dict) or files is None
    ):
        raise UserError(f"{where} is corrupt: {META_FILE} lacks step, meta or the tensor files' size/hash")
    m = _STEP_DIR_RE.fullmatch(path.name) or _STEP_DIR_RE.fullmatch(path.name[len(_REPLACED_PREFIX) :])
    if m and int(m.group(1)) != step:
        raise UserError(f"{where} is corrupt: {META_FILE} says step {step}")

    for file in files:
        _verify(path / file["file"], file["bytes"], file["sha256"], where)
    try:
        if version == FORMAT_VERSION:
            tensors = _read_safetensors(path / TENSORS_FILE)
        else:
            tensors = _read_pieces([path / f["file"] for f in files], info["numels"])
    except (OSError, ValueError) as e:
        raise UserError(f"{where} is corrupt: its tensor files cannot be read ({one_line(e)})") from None
    return Checkpoint(step=step, tensors=tensors, meta=user_meta, path=path)


def _tensor_files(info, version: int) -> list[dict] | None:
    """The tensor files ``meta.json`` lists (name, bytes, sha256), or None when malformed:
    version 1 has one, ``tensors.safetensors``; version 2 one per machine, and every
    array's length."""
    if not isinstance(info, dict):
        return None
    if version == FORMAT_VERSION:
        files = [info] if info.get("file") == TENSORS_FILE else None
    else:
        files, numels = info.get("shards"), info.get("numels")
        if not isinstance(files, list) or not files or not isinstance(numels, dict) \
                or not all(isinstance(n, int) and n >= 0 for n in numels.values()):
            return None
        if any(not isinstance(f, dict) or f.get("file") != SHARD_FILE.format(rank=r, world=len(files))
               for r, f in enumerate(files)):
            return None
    ok = files is not None and all(isinstance(f.get("bytes"), int) and isinstance(f.get("sha256"), str)
                                   for f in files)
    return files if ok else None


def _verify(file: Path, expected: int, sha256: str, where: str) -> None:
    """The tensor file is there, of its recorded size and SHA-256, or a one-line UserError."""
    try:
        size = file.stat().st_size
    except FileNotFoundError:
        raise UserError(f"{where} is incomplete: {file.name} is missing") from None
    if size < expected:
        raise UserError(f"{where} is truncated: {file.name} has {size} bytes, expected {expected}")
    if size > expected:
        raise UserError(f"{where} is corrupt: {file.name} has {size} bytes, expected {expected}")
    try:
        _, digest = _hash(file)
    except OSError as e:
        raise UserError(f"{where} is unreadable: {file.name}: {e.strerror or e}") from None
    if digest != sha256:
        raise UserError(f"{where} is corrupt: {file.name} SHA-256 mismatch")


def _read_pieces(files: list[Path], numels: Mapping[str, int]) -> LazyArrays:
    """The whole arrays of a version-2 checkpoint, each assembled from its pieces (``name@start``
    in the machines' files) when asked for; the pieces must tile each array exactly."""
    pieces: dict[str, list[tuple[int, Path, int, int, np.dtype]]] = {name: [] for name in numels}
    dtypes: dict[str, np.dtype] = {}
    for file in files:
        for key, (offset, shape, dtype) in safetensors_layout(file).items():
            name, _, start = key.rpartition("@")
            if name not in pieces or not start.isdigit() or len(shape) != 1:
                raise ValueError(f"{file.name}: unexpected tensor {key!r}")
            pieces[name].append((int(start), file, offset, shape[0], dtype))
            if dtypes.setdefault(name, dtype) != dtype:
                raise ValueError(f"{name}: pieces of different dtypes")
    for name, parts in pieces.items():
        parts.sort(key=lambda p: p[0])
        at = 0
        for start, _, _, count, _ in parts:
            if start != at:
                raise ValueError(f"{name}: its pieces do not cover element {at} exactly")
            at += count
        if at != numels[name]:
            raise ValueError(f"{name}: pieces of {at} elements, the array has {numels[name]}")
    specs = {name: ((numels[name],), dtypes.get(name, np.dtype("<f4")).newbyteorder("=")) for name in numels}

    def read(name: str) -> np.ndarray:
        out = np.empty(*specs[name])
        for start, file, offset, count, dtype in pieces[name]:
            out[start:start + count] = np.fromfile(file, dtype=dtype, count=count, offset=offset)
        return out
    return LazyArrays(specs, read)


def safetensors_header(path: Path) -> dict[str, tuple[int, tuple[int, ...], str]]:
    """A safetensors file's tensors as ``name -> (byte offset in the file, shape, dtype code)``,
    from its header alone (no data is read).

    The header is checked: names, dtypes, shapes, and byte ranges that tile the data to
    the file's end, so a truncated file or a corrupt header is found here. ValueError says
    what is wrong, in one line."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError("no header")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise ValueError(f"a header of {n} bytes in a file of {size}")
        header = json.loads(f.read(n).decode("utf-8"))
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    parsed = []
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            itemsize = SAFETENSORS_ITEMSIZES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            start, stop = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{key}: no dtype this reader knows, shape or data offsets") from None
        parsed.append((start, stop, key, itemsize, shape, info["dtype"]))
    base, layout, end = 8 + n, {}, 0
    for start, stop, key, itemsize, shape, code in sorted(parsed, key=lambda e: e[:2]):
        count = int(np.prod(shape, dtype=np.int64))
        if start != end or stop - start != count * itemsize or min(shape, default=0) < 0:
            raise ValueError(f"{key}: bytes {start}..{stop} do not hold {code}{list(shape)} "
                             f"after byte {end}")
        end = stop
        layout[key] = (base + start, shape, code)
    if base + end > size:
        raise ValueError(f"truncated: its header describes {base + end} bytes, the file has {size}")
    if base + end != size:
        raise ValueError(f"the data ends at byte {base + end} of {size}")
    return layout


def safetensors_layout(path: Path) -> dict[str, tuple[int, tuple[int, ...], np.dtype]]:
    """A safetensors file's arrays as ``name -> (byte offset, shape, little-endian dtype)``,
    its header checked (:func:`safetensors_header`) and every dtype one NumPy reads.
    ValueError says what is wrong."""
    layout = {}
    for key, (offset, shape, code) in safetensors_header(path).items():
        if code not in _NUMPY_DTYPES:
            raise ValueError(f"{key}: no dtype this reader knows ({code})")
        layout[key] = (offset, shape, _NUMPY_DTYPES[code])
    return layout


def _read_safetensors(path: Path) -> LazyArrays:
    """A safetensors file's arrays, each read from the file when asked for.

    The header is read and checked now (:func:`safetensors_layout`); an array is read with
    plain file reads, not a memory map, so what a resume has read stops counting in the
    process's resident set once it is dropped.
    """
    layout = safetensors_layout(path)
    specs = {key: (shape, dtype.newbyteorder("=")) for key, (_, shape, dtype) in layout.items()}

    def read(key: str) -> np.ndarray:
        offset, shape, dtype = layout[key]
        count = int(np.prod(shape, dtype=np.int64))
        a = np.fromfile(path, dtype=dtype, count=count, offset=offset) if count else np.empty(0, dtype)
        return a.astype(dtype.newbyteorder("="), copy=False).reshape(shape)
    return LazyArrays(specs, read)


def mapped_safetensors(path: Path) -> dict[str, np.ndarray]:
    """A safetensors file's arrays as read-only memory maps (header checked as
    :func:`safetensors_layout` does): the pages are read when used, and are the file's
    clean pages, which the kernel can drop under pressure and read again."""
    arrays = {}
    for key, (offset, shape, dtype) in safetensors_layout(path).items():
        if int(np.prod(shape, dtype=np.int64)) == 0:
            arrays[key] = np.empty(shape, dtype)
        else:
            arrays[key] = np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape).view(np.ndarray)
    return arrays


def _hash(path: Path, fsync: bool = False) -> tuple[int, str]:
    """Stream a file once for its size and SHA-256, holding only a small buffer; optionally fsync it."""
    h = hashlib.sha256()
    size = 0
    buf = bytearray(_HASH_CHUNK)
    view = memoryview(buf)
    with open(path, "rb") as f:
        while n := f.readinto(buf):
            h.update(view[:n])
            size += n
        if fsync:
            os.fsync(f.fileno())
    return size, h.hexdigest()
