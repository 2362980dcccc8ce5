"""Which files a text data path names: the rules of ``--data`` and ``l2l tokenizer train --data``.

A file is taken as it is. Below a folder: every regular file in sorted order, skipping
hidden files and dirs (names starting with ``.``) and files that look binary (a NUL byte
in their first :data:`BINARY_SNIFF_BYTES`) or are empty; symlinked dirs are not followed.
:mod:`l2l.data` reads the files under a byte budget, :mod:`l2l.tokenizer` trains on them
whole: both take the rules from here so that they cannot drift apart.
"""
from __future__ import annotations

import os

from .errors import UserError

BINARY_SNIFF_BYTES = 8192  # a NUL in this prefix marks a file binary


def looks_binary(head: bytes) -> bool:
    """Whether a file whose first :data:`BINARY_SNIFF_BYTES` are ``head`` is binary."""
    return b"\0" in head


def folder_files(root: str) -> list[str]:
    """Relative paths of every non-hidden regular file below ``root``, in sorted walk order."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            full = os.path.join(dirpath, name)
            if not name.startswith(".") and os.path.isfile(full):
                out.append(os.path.relpath(full, root))
    return out


def text_files(path: str | os.PathLike) -> list[str]:
    """The files ``--data PATH`` reads, as paths, in order: a single file as it is; below a
    folder, empty and binary files skipped. Raises :class:`UserError` when there is nothing to read."""
    p = os.fspath(path)
    if not os.path.exists(p):
        raise UserError(f"data path not found: {p}")
    if os.path.isfile(p):
        if os.path.getsize(p) == 0:
            raise UserError(f"data file is empty: {p}")
        return [p]
    if not os.path.isdir(p):
        raise UserError(f"data path is neither a file nor a folder: {p}")
    out = []
    for rel in folder_files(p):
        full = os.path.join(p, rel)
        try:
            with open(full, "rb") as f:
                head = f.read(BINARY_SNIFF_BYTES)
        except OSError as e:
            raise UserError(f"cannot read {full}: {e.strerror or e}") from None
        if head and not looks_binary(head):
            out.append(full)
    if not out:
        raise UserError(f"no non-empty text files in folder {p}")
    return out
