"""Tokenizers: raw bytes, or a Hugging Face tokenizer directory read from local files.

One small interface, :class:`Tokenizer`, that training and sampling can use
without knowing which kind they hold:

``vocab_size``
    Number of ids; every id from ``encode`` is below it.
``encode(text) -> list[int]``
    The ids of ``text`` alone: no special tokens are added (no BOS, no EOS, no
    ``[CLS]``); whoever joins documents puts ``eos_id`` between them.
``decode(ids) -> str``
    The text of ``ids``; special tokens are kept, so ``decode(encode(s)) == s``.
``eos_id``
    The end-of-text id placed between documents (a tokenizer with no end-of-text
    token but a separator, BERT's ``[SEP]``, gives that), or ``None`` when the
    tokenizer has neither (bytes: documents are joined with a newline byte, see
    :mod:`l2l.data`).
``mask_id``
    The id the masked-LM objective puts in place of a hidden token (BERT's
    ``[MASK]``; for bytes 256, the one id after them), or ``None``.
``name``, ``description``
    A short label and a one-line summary for logs.

:class:`ByteTokenizer` is what the project has used so far: ids 0..255 are the
UTF-8 bytes of the text. :class:`HFTokenizer` loads a directory as Hugging Face
writes it (``tokenizer.json``, ``tokenizer_config.json``, perhaps
``special_tokens_map.json`` and ``chat_template.jinja``) with the
``tokenizers`` library, from local files only. :func:`train_bpe` trains a
byte-level BPE on text files and writes such a directory, one that
``transformers.AutoTokenizer.from_pretrained(dir, local_files_only=True)``
loads too.

Text files for training are found by :func:`text_files`, with the rules of
``--data`` in :mod:`l2l.data` (a file, or every regular file below a folder in
sorted order, skipping hidden files and dirs and files with a NUL byte in their
first 8 KiB). The rules are restated here rather than imported so that
:mod:`l2l.data` can import this module without an import cycle.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from typing import Iterator, Protocol, Sequence, runtime_checkable

from .errors import UserError

BYTE_VOCAB = 256                 # ids of ByteTokenizer (as l2l.models.config.BYTE_VOCAB)
BYTE_MASK = BYTE_VOCAB           # its masked-LM mask id (as l2l.models.config.MASK_TOKEN)
EOS_TOKEN = "<|endoftext|>"      # the end-of-text token train_bpe adds
MIN_BPE_VOCAB = BYTE_VOCAB + 1   # the 256 byte symbols and EOS_TOKEN
BINARY_SNIFF_BYTES = 8192        # as l2l.data: a NUL in this prefix marks a file binary
_CHUNK_CHARS = 1 << 20           # train_bpe feeds the trainer about this much text at a time


@runtime_checkable
class Tokenizer(Protocol):
    """What training needs from a tokenizer (see the module docstring)."""

    vocab_size: int
    eos_id: int | None
    mask_id: int | None
    name: str
    description: str
    fingerprint: str  # changes when the tokenizer would encode differently

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """Ids 0..255 are the UTF-8 bytes of the text; no end-of-text token (``eos_id`` is None)."""

    vocab_size = BYTE_VOCAB
    eos_id: int | None = None
    mask_id: int | None = BYTE_MASK
    chat_template: str | None = None
    name = "bytes"
    fingerprint = "bytes"
    description = "bytes: UTF-8 bytes as ids 0..255, no end-of-text token"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        """Invalid UTF-8 (a model's output may be any bytes) becomes U+FFFD."""
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face tokenizer directory, read with the ``tokenizers`` library from local files.

    ``backend`` is the :class:`tokenizers.Tokenizer`; ``eos_token`` comes from
    ``tokenizer_config.json`` or else ``special_tokens_map.json`` (None when
    neither names one); ``chat_template`` from ``chat_template.jinja`` or else
    ``tokenizer_config.json`` (None when there is none).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        if not os.path.isdir(self.path):
            what = "is not a directory" if os.path.exists(self.path) else "not found"
            raise UserError(f"tokenizer directory {what}: {self.path}")
        file = os.path.join(self.path, "tokenizer.json")
        if not os.path.isfile(file):
            raise UserError(f"no tokenizer.json in tokenizer directory {self.path}")
        tokenizers = _tokenizers()
        with open(file, "rb") as f:  # what identifies it, e.g. for a cache of tokenized data
            self.fingerprint = hashlib.sha256(f.read()).hexdigest()
        try:
            self.backend = tokenizers.Tokenizer.from_file(file)
        except Exception as e:  # the library raises a bare Exception for any parse error
            raise UserError(f"cannot load {file}: {_one_line(e)}") from None
        config = _read_json(os.path.join(self.path, "tokenizer_config.json"))
        special = _read_json(os.path.join(self.path, "special_tokens_map.json"))
        def special_token(key: str) -> str | None:
            return _token_text(config.get(key)) or _token_text(special.get(key))
        self.eos_token = special_token("eos_token") or special_token("sep_token")
        self.eos_id = self._id_of(self.eos_token, "eos")
        self.mask_id = self._id_of(special_token("mask_token"), "mask")
        self.chat_template = _chat_template(self.path, config)
        self.vocab_size = self.backend.get_vocab_size(with_added_tokens=True)
        self.name = os.path.basename(os.path.normpath(os.path.abspath(self.path)))
        kind = type(self.backend.model).__name__
        eos = f"eos {self.eos_token!r} (id {self.eos_id})" if self.eos_token else "no eos token"
        self.description = f"{self.path}: {kind}, vocab {self.vocab_size:,}, {eos}"

    def _id_of(self, token: str | None, role: str) -> int | None:
        if token is None:
            return None
        found = self.backend.token_to_id(token)
        if found is None:
            raise UserError(f"{role} token {token!r} of {self.path} is not in its vocabulary")
        return found

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Several texts at once (the library spreads them over the cores)."""
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=False)


def load_tokenizer(spec: str | None, model_dir: str | None = None) -> ByteTokenizer | HFTokenizer:
    """``"bytes"``: :class:`ByteTokenizer`; a directory path: :class:`HFTokenizer`;
    ``None``: the tokenizer of ``model_dir`` when it has a ``tokenizer.json``, else bytes.

    (A directory literally named ``bytes`` is spelled ``./bytes``.)
    """
    if spec == "bytes":
        return ByteTokenizer()
    if spec is not None:
        return HFTokenizer(spec)
    if model_dir is None:
        return ByteTokenizer()
    if not os.path.isdir(model_dir):
        raise UserError(f"model directory not found: {model_dir}")
    if os.path.exists(os.path.join(model_dir, "tokenizer.json")):
        return HFTokenizer(model_dir)
    return ByteTokenizer()


# --------------------------------------------------------------------------
# Training


def text_files(path: str | os.PathLike) -> list[str]:
    """The files ``--data PATH`` reads (see the module docstring), as paths, in order.

    A single file is taken as it is; below a folder, empty and binary files are
    skipped. Raises :class:`UserError` when there is nothing to read.
    """
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
    for dirpath, dirnames, filenames in os.walk(p):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            full = os.path.join(dirpath, name)
            if name.startswith(".") or not os.path.isfile(full):
                continue
            try:
                with open(full, "rb") as f:
                    head = f.read(BINARY_SNIFF_BYTES)
            except OSError as e:
                raise UserError(f"cannot read {full}: {e.strerror or e}") from None
            if head and b"\0" not in head:
                out.append(full)
    if not out:
        raise UserError(f"no non-empty text files in folder {p}")
    return out


def train_bpe(files: Sequence[str], vocab_size: int, out_dir: str | os.PathLike) -> HFTokenizer:
    """Train a byte-level BPE with ``<|endoftext|>`` as end-of-text token on ``files``; write it to ``out_dir``.

    The directory holds ``tokenizer.json``, ``tokenizer_config.json`` (eos
    token, ``tokenizer_class`` PreTrainedTokenizerFast) and
    ``special_tokens_map.json``. It is written to a temporary directory beside
    ``out_dir`` and renamed into place, so ``out_dir`` is either complete or
    absent. An existing non-empty ``out_dir`` is refused. Files are read as
    UTF-8 (invalid bytes become U+FFFD). The trainer may stop below
    ``vocab_size`` when the text has fewer distinct merges to make.
    """
    out = os.fspath(out_dir)
    if vocab_size < MIN_BPE_VOCAB:
        raise UserError(f"vocab size must be at least {MIN_BPE_VOCAB} (256 byte symbols and {EOS_TOKEN}), "
                        f"got {vocab_size}")
    if not files:
        raise UserError("no files to train the tokenizer on")
    _check_out_dir(out)
    tk = _tokenizers()
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN],
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
                                     show_progress=False)
    tok.train_from_iterator(_text_chunks(files), trainer)

    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(out))}.tmp-", dir=parent)
    try:
        tok.save(os.path.join(tmp, "tokenizer.json"))
        _write_json(os.path.join(tmp, "tokenizer_config.json"), {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": EOS_TOKEN,
            "add_prefix_space": False,
            "clean_up_tokenization_spaces": False,  # else transformers' decode edits spaces before punctuation
        })
        _write_json(os.path.join(tmp, "special_tokens_map.json"), {"eos_token": EOS_TOKEN})
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it 0700
        _check_out_dir(out)  # may have appeared while training
        try:
            os.rename(tmp, out)  # replaces an empty directory
        except OSError as e:
            raise UserError(f"cannot create tokenizer directory {out}: {e.strerror or e}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return HFTokenizer(out)


def _text_chunks(files: Sequence[str]) -> Iterator[str]:
    """Each file's text, in pieces of about ``_CHUNK_CHARS`` cut at line ends (a whole file may be large)."""
    for path in files:
        try:
            with open(path, encoding="utf-8", errors="replace", newline="") as f:
                piece: list[str] = []
                size = 0
                for line in f:
                    piece.append(line)
                    size += len(line)
                    if size >= _CHUNK_CHARS:
                        yield "".join(piece)
                        piece, size = [], 0
                if piece:
                    yield "".join(piece)
        except OSError as e:
            raise UserError(f"cannot read {path}: {e.strerror or e}") from None


def _check_out_dir(out: str) -> None:
    if os.path.isdir(out):
        if os.listdir(out):
            raise UserError(f"output directory exists and is not empty: {out}")
    elif os.path.exists(out):
        raise UserError(f"output path exists and is not a directory: {out}")


# --------------------------------------------------------------------------
# Helpers


def _tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise UserError("Hugging Face tokenizers need the tokenizers package: pip install tokenizers") from None
    return tokenizers


def _read_json(path: str) -> dict:
    """A JSON object file's contents; ``{}`` when the file is absent."""
    if not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read {path}: {_one_line(e)}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} does not hold a JSON object")
    return data


def _write_json(path: str, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, ensure_ascii=False)
        f.write("\n")


def _token_text(value) -> str | None:
    """A special token as the config files write it: a string, or ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _chat_template(path: str, config: dict) -> str | None:
    """``chat_template.jinja`` (transformers 5 writes it), else the config's ``chat_template``:
    a string, or a list of ``{"name", "template"}`` of which the one named ``default``."""
    jinja = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja):
        try:
            with open(jinja, encoding="utf-8") as f:
                return f.read()
        except OSError as e:
            raise UserError(f"cannot read {jinja}: {e.strerror or e}") from None
    value = config.get("chat_template")
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    return value if isinstance(value, str) else None


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
