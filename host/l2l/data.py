"""The data room: a byte-level corpus, a train/validation split, and batches.

Tokens are raw bytes (0..255), so no tokenizer has to be shipped or agreed on;
the masked-LM objective adds one extra token, :data:`MASK_TOKEN` (256), so a
model trained with ``objective="mlm"`` needs ``BYTE_VOCAB + 1`` embeddings.

Default corpus
    The running interpreter's own standard library ``.py`` sources, so a
    trainer works out of the box with no download. Walked in sorted order;
    ``site-packages``/``dist-packages``, ``__pycache__``, hidden dirs, the
    build-specific ``config-*`` dir and ``_sysconfigdata_*.py`` are skipped,
    and so are test directories (``test``, ``tests``, ``idle_test``): several
    distributions ship those as a separate package and they hold deliberately
    odd bytes, so dropping them keeps "same Python version -> same corpus".
    CPython 3.11 gives ~720 files / ~12 MB, read in well under a second.

``--data PATH``
    A text file, or a folder: every regular file below it in sorted order,
    skipping hidden files and dirs and any file with a NUL byte in its first
    8 KiB (our rule for "binary"; :mod:`l2l.data_files`). Symlinked dirs are not followed.

Files are joined with one newline byte between them, and the joined stream
is capped at ``max_bytes`` (the last file taken is cut to fit), taking files
in sorted order so the cap is deterministic too.

Split
    By document: a file goes to validation when a hash of its relative path
    says so (1 in :data:`VAL_EVERY`), so adding a file elsewhere never moves
    other files between splits. A single file is split by bytes instead: the
    last :data:`VAL_FRACTION` goes to validation.

Cache
    The joined bytes (or token ids) are kept in the cache (:func:`token_cache_dir`),
    keyed by the documents' paths and bytes, and the run memory-maps them read-only:
    a run holds the pages it samples, not the data set, in its resident set. A cache that
    cannot be written leaves the arrays in memory. Each data set is kept once, as large as
    its bytes (or 4 bytes a token); nothing prunes the directory: remove it to reclaim the
    space.

Batches
    :class:`BatchSampler` makes the batch of step ``s`` from ``(seed, s)``
    alone, so resuming from a checkpoint only needs ``{"seed", "next_step"}``.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
from safetensors.numpy import save_file

from .checkpoint import mapped_safetensors
from .data_files import BINARY_SNIFF_BYTES, folder_files, looks_binary
from .errors import UserError
from .models.config import BYTE_VOCAB, MASK_TOKEN
from .models.stack import IGNORE_INDEX
from .tokenizer import Tokenizer

DEFAULT_MAX_BYTES = 32 * 2**20  # 32 MiB; the stdlib corpus fits well inside
VAL_EVERY = 20                  # 1 in 20 documents go to validation
VAL_FRACTION = 0.05             # single-document inputs: last 5% of bytes
SEPARATOR = b"\n"               # joins documents
OBJECTIVES = ("causal", "mlm")
TOKENIZE_CHUNK = 256            # documents handed to the tokenizer at once

MLM_PICK = 0.15                 # BERT: share of positions predicted
MLM_MASK = 0.8                  # ... of which replaced by MASK_TOKEN
MLM_RANDOM = 0.1                # ... of which replaced by a random byte

_STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__",
                     "test", "tests", "idle_test"}

# Tags that keep the training and validation random streams apart.
_TRAIN_STREAM = 0x747261696E   # "train"
_VAL_STREAM = 0x76616C         # "val"


# --------------------------------------------------------------------------
# Corpus


@dataclass(frozen=True)
class Corpus:
    """Train and validation bytes (uint8 arrays) plus a one-line description."""

    train: np.ndarray
    val: np.ndarray
    description: str
    num_files: int


def load_corpus(path: str | os.PathLike | None = None,
                max_bytes: int = DEFAULT_MAX_BYTES, tokenizer: Tokenizer | None = None) -> Corpus:
    """Load ``path`` (a file, a ``.jsonl`` file, or a folder), or the stdlib sources when ``None``,
    as bytes or, given a ``tokenizer`` other than bytes, as its token ids (cached on disk).

    Raises :class:`UserError` (one line) for a missing, unreadable or empty
    input, or one too small to split.
    """
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    if path is None:
        root = sysconfig.get_paths()["stdlib"]
        files = _stdlib_files(root)
        source = f"python {sys.version.split()[0]} stdlib .py sources"
        docs = _read_docs(root, files, max_bytes, skip_binary=True)
        if not docs:
            raise UserError(f"no Python sources found in the stdlib at {root}")
    else:
        p = os.fspath(path)
        source = p
        if not os.path.exists(p):
            raise UserError(f"data path not found: {p}")
        if os.path.isdir(p):
            root = p
            docs = _read_docs(root, folder_files(root), max_bytes,
                              skip_binary=True)
            if not docs:
                raise UserError(f"no non-empty text files in folder {p}")
        elif os.path.isfile(p) and p.endswith(".jsonl"):
            docs = _jsonl_docs(p, max_bytes)
        elif os.path.isfile(p):
            root = os.path.dirname(p) or "."
            docs = _read_docs(root, [os.path.basename(p)], max_bytes,
                              skip_binary=False)
            if not docs:
                raise UserError(f"data file is empty: {p}")
        else:
            raise UserError(f"data path is neither a file nor a folder: {p}")

    total = sum(len(d) for _, d in docs) + len(SEPARATOR) * (len(docs) - 1)
    n = len(docs)
    what = f"{source}: {n} file{'s' if n != 1 else ''}" if not str(source).endswith(".jsonl") else \
        f"{source}: {n} record{'s' if n != 1 else ''}"
    if tokenizer is None or tokenizer.fingerprint == "bytes":
        arrays, _ = cached_arrays(_docs_key("bytes", docs), lambda: dict(zip(("train", "val"), _split(docs, source))))
        train, val = arrays["train"], arrays["val"]
        description = f"{what}, {total:,} bytes (train {train.size:,}, val {val.size:,})"
        return Corpus(train=train, val=val, description=description, num_files=n)
    (train, val), cached = _tokenized(docs, source, tokenizer)
    description = (f"{what}, {total:,} bytes as {train.size + val.size:,} tokens of {tokenizer.name} "
                   f"(train {train.size:,}, val {val.size:,}{'; cached' if cached else ''})")
    return Corpus(train=train, val=val, description=description, num_files=n)


def _jsonl_docs(path: str, max_bytes: int) -> list[tuple[str, bytes]]:
    """One document per record's ``text`` field, up to ``max_bytes`` of text in all."""
    docs, budget = [], max_bytes
    for number, record in jsonl_records(path):
        text = record.get("text") if isinstance(record, dict) else None
        if not isinstance(text, str):
            sft = isinstance(record, dict) and ({"prompt", "completion"} <= record.keys() or "messages" in record)
            raise UserError(f"{path}:{number}: " + ("a prompt/completion or chat record in a file of text "
                            "records (the first record decides how a .jsonl file is read)"
                            if sft else "no 'text' field (a string) in this record"))
        data = text.encode("utf-8")[:budget]
        if data:
            docs.append((f"{os.path.basename(path)}:{number}", data))
            budget -= len(data) + len(SEPARATOR)
        if budget <= len(SEPARATOR):
            break
    if not docs:
        raise UserError(f"{path}: no record with text")
    return docs


def jsonl_records(path: str) -> Iterator[tuple[int, object]]:
    """(line number, parsed record) of each non-blank line of a ``.jsonl`` file; what cannot
    be read or parsed is one line naming the file (and the line)."""
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise UserError(f"{path}:{number}: not JSON ({e.msg})") from None
                    yield number, record
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 ({e.reason})") from None
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror or e}") from None


def _stdlib_files(root: str) -> list[str]:
    """Relative paths of the stdlib's ``.py`` files that every install shares."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames
            if d not in _STDLIB_SKIP_DIRS and not d.startswith(".")
            and not d.startswith("config-"))
        for name in sorted(filenames):
            if name.endswith(".py") and not name.startswith("_sysconfigdata_"):
                out.append(os.path.relpath(os.path.join(dirpath, name), root))
    return out


def _read_docs(root: str, rel_paths: list[str], max_bytes: int,
               skip_binary: bool) -> list[tuple[str, bytes]]:
    """Read files in order until the joined stream reaches ``max_bytes``.

    Empty files and (if ``skip_binary``) binary files are skipped; only as
    much of each file is read as the budget still allows.
    """
    docs: list[tuple[str, bytes]] = []
    budget = max_bytes
    for rel in rel_paths:
        sep = len(SEPARATOR) if docs else 0
        if budget <= sep:
            break
        full = os.path.join(root, rel)
        try:
            with open(full, "rb") as f:
                head = f.read(min(BINARY_SNIFF_BYTES, budget - sep))
                if skip_binary and looks_binary(head):
                    continue
                data = head + f.read(max(budget - sep - len(head), 0))
        except OSError as e:
            raise UserError(f"cannot read {full}: {e.strerror or e}") from None
        if not data:
            continue
        docs.append((rel.replace(os.sep, "/"), data))
        budget -= sep + len(data)
    return docs


def is_val_document(rel_path: str) -> bool:
    """Stable per-document split: depends only on the path's own bytes."""
    return _path_hash(rel_path) % VAL_EVERY == 0


def _path_hash(rel_path: str) -> int:
    digest = hashlib.sha256(rel_path.encode("utf-8", "surrogateescape"))
    return int.from_bytes(digest.digest()[:8], "big")


def _split(docs: list[tuple[str, bytes]], source: str
           ) -> tuple[np.ndarray, np.ndarray]:
    """Split documents into (train, val) byte arrays; both end up non-empty."""
    train, val = _split_docs(docs, source)
    return (np.frombuffer(SEPARATOR.join(train), dtype=np.uint8).copy(),
            np.frombuffer(SEPARATOR.join(val), dtype=np.uint8).copy())


def _split_docs(docs: list[tuple[str, bytes]], source: str) -> tuple[list[bytes], list[bytes]]:
    """(train documents, validation documents), both non-empty: by a hash of each path,
    or a single document by bytes (its last :data:`VAL_FRACTION`)."""
    if len(docs) == 1:
        data = docs[0][1]
        if len(data) < 2:
            raise UserError(f"{source} has {len(data)} byte; too small to "
                            "split into train and validation")
        n_val = max(1, int(len(data) * VAL_FRACTION))
        return [data[:-n_val]], [data[-n_val:]]

    val_mask = [is_val_document(rel) for rel, _ in docs]
    # Small folders may hash every file to one side; move the file whose hash
    # is most extreme so the fix-up is still deterministic.
    if not any(val_mask):
        val_mask[min(range(len(docs)), key=lambda i: _path_hash(docs[i][0]))] = True
    if all(val_mask):
        val_mask[max(range(len(docs)), key=lambda i: _path_hash(docs[i][0]))] = False
    return ([d for (_, d), v in zip(docs, val_mask) if not v],
            [d for (_, d), v in zip(docs, val_mask) if v])


def _tokenized(docs: list[tuple[str, bytes]], source: str, tokenizer: Tokenizer
               ) -> tuple[tuple[np.ndarray, np.ndarray], bool]:
    """Each side's documents as token ids; from the cache when this data and tokenizer were
    seen before. ((train, val), cached).

    Each document is exactly what the tokenizer gives the whole text
    (:meth:`~l2l.tokenizer.Tokenizer.encode_documents`: a Llama tokenizer's BOS at its
    start, BERT's ``[CLS]`` ... ``[SEP]`` around it), and ``eos_id`` goes between two
    documents unless the first already ends with it (BERT's ``[SEP]`` is its ``eos_id``,
    so BERT documents follow each other as ``[CLS] a [SEP] [CLS] b [SEP]``)."""
    def tokenize() -> dict[str, np.ndarray]:
        sides = {}
        eos = tokenizer.eos_id
        from tqdm import tqdm
        for name, side in zip(("train", "val"), _split_docs(docs, source)):
            ids: list[int] = []
            for i in tqdm(range(0, len(side), TOKENIZE_CHUNK), desc=f"tokenizing {name}", unit="chunk",
                          disable=len(side) <= TOKENIZE_CHUNK, leave=False):
                texts = [d.decode("utf-8", errors="replace") for d in side[i:i + TOKENIZE_CHUNK]]
                for encoded in tokenizer.encode_documents(texts):
                    if ids and eos is not None and ids[-1] != eos:
                        ids.append(eos)
                    ids += encoded
            sides[name] = np.asarray(ids, dtype=np.int32)
        return sides
    arrays, cached = cached_arrays(_docs_key(f"{tokenizer.fingerprint}/{tokenizer.eos_id}", docs), tokenize)
    return (arrays["train"], arrays["val"]), cached


def _docs_key(encoding: str, docs: list[tuple[str, bytes]]) -> str:
    """The cache key of these documents (paths and bytes) in this encoding, split and joined
    by today's rules (a change to them must not reuse an old split)."""
    split = f"split {VAL_EVERY} {VAL_FRACTION} {SEPARATOR.hex()}"
    key = hashlib.sha256(f"{encoding}/{split}/{len(docs)}".encode())
    for rel, data in docs:
        key.update(rel.encode("utf-8", "surrogateescape") + b"\0" + hashlib.sha256(data).digest())
    return key.hexdigest()


def cached_arrays(key: str, make: Callable[[], dict[str, np.ndarray]]) -> tuple[dict[str, np.ndarray], bool]:
    """The arrays cached under ``key`` in :func:`token_cache_dir`, else ``make()``'s, cached
    (written atomically; a damaged entry is made again, not trusted). (arrays, were cached).

    The arrays are read-only memory maps of the cache file, as nanoGPT maps its token files:
    a run holds the pages it has sampled, clean pages the kernel can drop, not the data
    set in its anonymous memory."""
    cache = token_cache_dir() / f"{key}.safetensors"
    if cache.is_file():
        try:
            return mapped_safetensors(cache), True
        except (ValueError, OSError):
            with contextlib.suppress(OSError):
                cache.unlink(missing_ok=True)
    arrays = make()
    tmp = cache.with_name(f".{cache.name}.{os.getpid()}.tmp")
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        save_file(arrays, tmp)  # its failures are safetensors' own error type, not OSError
        os.replace(tmp, cache)
        return mapped_safetensors(cache), False
    except Exception:  # a cache that cannot be written (read-only, full): the arrays in memory
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        return arrays, False


def token_cache_dir() -> Path:
    """Where tokenized data is kept between runs: ``$L2L_CACHE`` or ``$XDG_CACHE_HOME/l2l/tokens``
    (``~/.cache/l2l/tokens``). Entries are keyed by the data's bytes and the tokenizer."""
    if os.environ.get("L2L_CACHE"):
        return Path(os.environ["L2L_CACHE"]) / "tokens"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "l2l" / "tokens"


# --------------------------------------------------------------------------
# Batches


@dataclass
class Batch:
    """Token ids and their targets; ``IGNORE_INDEX`` marks positions without loss."""

    inputs: torch.Tensor   # LongTensor[B, T]
    targets: torch.Tensor  # LongTensor[B, T]

    @property
    def num_targets(self) -> int:
        """Positions that carry loss: the divisor of a summed token loss."""
        return int((self.targets != IGNORE_INDEX).sum().item())

    @property
    def batch_size(self) -> int:
        return self.inputs.shape[0]

    def split(self, m: int) -> list["Batch"]:
        """``m`` equal micro-batches along the batch dim, in order."""
        b = self.inputs.shape[0]
        if m < 1 or b % m:
            raise ValueError(f"batch size {b} is not divisible into {m} micro-batches")
        return [Batch(i, t) for i, t in zip(self.inputs.chunk(m), self.targets.chunk(m))]

    def to(self, device, non_blocking: bool = False) -> "Batch":
        return Batch(self.inputs.to(device, non_blocking=non_blocking),
                     self.targets.to(device, non_blocking=non_blocking))


class StepSampler:
    """Batch ``s`` a pure function of ``(seed, s)``: what every sampler shares.

    Pure per-step batches make resuming exact (only ``next_step`` has to be
    saved) and let any step be replayed for debugging. Validation batches come
    from a stream of their own. A sampler supplies :meth:`_make`.
    """

    train_stream = _TRAIN_STREAM
    val_stream = _VAL_STREAM
    seed: int
    next_step: int

    def batch(self, step: int) -> Batch:
        """The training batch of ``step``; same answer every call."""
        if step < 0:
            raise ValueError(f"step must be non-negative, got {step}")
        return self._make(np.random.default_rng([self.train_stream, self.seed, int(step)]))

    def next(self) -> Batch:
        """The batch of ``next_step``, then advance it."""
        b = self.batch(self.next_step)
        self.next_step += 1
        return b

    __next__ = next

    def __iter__(self):
        return self

    def state_dict(self) -> dict:
        """JSON-able data position for a checkpoint."""
        return {"seed": self.seed, "next_step": self.next_step}

    def load_state_dict(self, state: dict) -> None:
        self.seed = int(state["seed"])
        self.next_step = int(state["next_step"])

    def fixed_batches(self, n_batches: int) -> list[Batch]:
        """The same ``n_batches`` batches on every call, apart from training steps."""
        return [self._make(np.random.default_rng([self.val_stream, self.seed, i])) for i in range(n_batches)]

    def _make(self, rng: np.random.Generator) -> Batch:
        raise NotImplementedError


class BatchSampler(StepSampler):
    """Random windows of a token array (bytes or token ids); see :class:`StepSampler`."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int,
                 objective: str = "causal", seed: int = 0, *, name: str = "data",
                 mask_id: int = MASK_TOKEN, vocab_size: int = BYTE_VOCAB):
        """``mask_id`` and ``vocab_size`` (the range random replacements come from) serve
        the masked-LM objective: the tokenizer's ``[MASK]`` and vocabulary, or bytes'."""
        if objective not in OBJECTIVES:
            raise UserError(f"unknown objective {objective!r}; "
                            f"choose one of {', '.join(OBJECTIVES)}")
        if seq_len < 1 or batch_size < 1:
            raise UserError(f"seq_len and batch_size must be positive, "
                            f"got {seq_len} and {batch_size}")
        if seed < 0:
            raise UserError(f"seed must be non-negative, got {seed}")
        tokens = np.asarray(tokens)
        if tokens.ndim != 1 or tokens.dtype.kind not in "ui":
            raise TypeError(f"tokens must be a 1-D integer array (bytes or token ids), got "
                            f"{tokens.dtype} with shape {tokens.shape}")
        self.tokens = tokens
        self.seq_len = int(seq_len)
        self.batch_size = int(batch_size)
        self.objective = objective
        self.mask_id, self.vocab_size = int(mask_id), int(vocab_size)
        self.seed = int(seed)
        self.next_step = 0
        # causal needs one extra byte for the shifted targets
        self.window = self.seq_len + (1 if objective == "causal" else 0)
        if tokens.size < self.window:
            raise UserError(
                f"{name} split has {tokens.size} bytes but one {objective} "
                f"sequence of seq_len {seq_len} needs {self.window}; "
                "use a shorter seq_len or more data")
        self._offsets = np.arange(self.window)

    # -- internals -----------------------------------------------------------

    def _make(self, rng: np.random.Generator) -> Batch:
        starts = rng.integers(0, self.tokens.size - self.window + 1,
                              size=self.batch_size)
        windows = self.tokens[starts[:, None] + self._offsets].astype(np.int64)
        if self.objective == "causal":
            inputs, targets = windows[:, :-1], windows[:, 1:]
        else:
            inputs, targets = _mask(windows, rng, self.mask_id, self.vocab_size)
        return Batch(torch.from_numpy(np.ascontiguousarray(inputs)),
                     torch.from_numpy(np.ascontiguousarray(targets)))


def _mask(windows: np.ndarray, rng: np.random.Generator, mask_id: int = MASK_TOKEN,
          vocab_size: int = BYTE_VOCAB) -> tuple[np.ndarray, np.ndarray]:
    """BERT-style corruption: pick 15% (>= 1 per row), 80/10/10 mask/random/keep.

    Exactly ``max(1, round(0.15 * T))`` positions per row keeps the number of
    targets per batch constant, so loss scales don't jitter between steps.
    """
    b, t = windows.shape
    k = max(1, int(round(MLM_PICK * t)))
    picked_cols = np.argsort(rng.random((b, t)), axis=1)[:, :k]
    picked = np.zeros((b, t), dtype=bool)
    np.put_along_axis(picked, picked_cols, True, axis=1)

    targets = np.where(picked, windows, IGNORE_INDEX)
    inputs = windows.copy()
    u = rng.random((b, t))
    to_mask = picked & (u < MLM_MASK)
    to_random = picked & (u >= MLM_MASK) & (u < MLM_MASK + MLM_RANDOM)
    inputs[to_mask] = mask_id
    inputs[to_random] = rng.integers(0, vocab_size, size=int(to_random.sum()))
    return inputs, targets
