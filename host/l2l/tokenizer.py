"""Tokenizers: raw bytes, or a Hugging Face tokenizer directory as transformers loads it.

One small interface, :class:`Tokenizer`, that training and sampling can use
without knowing which kind they hold:

``vocab_size``
    Number of ids; every id from ``encode`` is below it.
``encode(text) -> list[int]``
    The ids of ``text`` alone: no special tokens are added (no BOS, no EOS, no
    ``[CLS]``).
``encode_documents(texts) -> list[list[int]]``
    Each text's ids as a whole document: with the special tokens the tokenizer adds
    to a text (a Llama tokenizer's BOS at its start, BERT's ``[CLS]`` ... ``[SEP]``
    around it), exactly ``tokenizer(text)["input_ids"]`` of transformers. Whoever
    joins documents puts ``eos_id`` between them unless a document already ends with
    it (:mod:`l2l.data`).
``decode(ids) -> str``
    The text of ``ids``; special tokens are kept, so ``decode(encode(s)) == s``.
``eos_id``
    The end-of-text id placed between documents (a tokenizer with no end-of-text
    token but a separator, BERT's ``[SEP]``, gives that), or ``None`` when the
    tokenizer has neither (bytes: documents are joined with a newline byte, see
    :mod:`l2l.data`).
``mask_id``
    The id the masked-LM objective puts in place of a hidden token (BERT's
    ``[MASK]``; for bytes :data:`MASK_TOKEN`, the one id after them), or ``None``.
``name``, ``description``
    A short label and a one-line summary for logs.
``fingerprint``
    Changes whenever the tokenizer could give other ids (the key of cached token ids).

:class:`ByteTokenizer` is what the project has used from the start: ids 0..255 are the
UTF-8 bytes of the text, and the built-in models are sized by :data:`BYTE_VOCAB`.
:class:`HFTokenizer` loads a directory as Hugging Face writes it (``tokenizer.json``,
``tokenizer_config.json``, perhaps ``special_tokens_map.json`` and
``chat_template.jinja``) with ``transformers.AutoTokenizer`` from local files only, so
the ids are the ones the model gets from transformers at inference, not a
re-implementation's; transformers is the ``hf`` extra (``pip install 'l2l[hf]'``).
:func:`train_bpe` trains a byte-level BPE with the ``tokenizers`` library on text files
(found by :func:`l2l.data_files.text_files`, the rules of ``--data``) and writes such a
directory.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from typing import Iterator, Protocol, Sequence, runtime_checkable

from .errors import UserError, one_line

BYTE_VOCAB = 256                 # ids of ByteTokenizer: the byte models' vocabulary
MASK_TOKEN = BYTE_VOCAB          # their masked-LM mask id, one after the bytes
EOS_TOKEN = "<|endoftext|>"      # the end-of-text token train_bpe adds
MIN_BPE_VOCAB = BYTE_VOCAB + 1   # the 256 byte symbols and EOS_TOKEN
_CHUNK_CHARS = 1 << 20           # train_bpe feeds the trainer about this much text at a time
_NO_LENGTH_LIMIT = 1 << 62       # a document may be any length: it is cut into windows later
# What HFTokenizer.fingerprint hashes besides the versions: the files transformers builds a
# tokenizer from, and this tag, to be changed with the rules by which l2l asks for ids.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                    "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt",
                    "vocab.txt")
_ID_RULES = "l2l-hf-ids/1: documents tokenizer(text); chats apply_chat_template; completions one text"


@runtime_checkable
class Tokenizer(Protocol):
    """What training needs from a tokenizer (see the module docstring)."""

    vocab_size: int
    eos_id: int | None
    mask_id: int | None
    name: str
    description: str
    fingerprint: str

    def encode(self, text: str) -> list[int]: ...

    def encode_documents(self, texts: Sequence[str]) -> list[list[int]]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """Ids 0..255 are the UTF-8 bytes of the text; no end-of-text token (``eos_id`` is None)."""

    vocab_size = BYTE_VOCAB
    eos_id: int | None = None
    mask_id: int | None = MASK_TOKEN
    chat_template: str | None = None
    name = "bytes"
    fingerprint = "bytes"
    description = "bytes: UTF-8 bytes as ids 0..255, no end-of-text token"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_documents(self, texts: Sequence[str]) -> list[list[int]]:
        """No special tokens: a document is its bytes."""
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        """Invalid UTF-8 (a model's output may be any bytes) becomes U+FFFD."""
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face tokenizer directory, as transformers loads it.

    ``hf`` is ``transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)``
    and every id comes from it: :meth:`encode_documents` is its ``__call__`` (the special
    tokens it adds, e.g. Llama's BOS, included) and :mod:`l2l.sft` takes chats from its
    ``apply_chat_template``. ``backend`` is the :class:`tokenizers.Tokenizer` it wraps.
    ``eos_token`` is its eos token, else its separator (BERT's ``[SEP]``), else None;
    ``chat_template`` its chat template (the one named ``default`` where it has several),
    else None. The directory must hold a ``tokenizer.json`` (a fast tokenizer: chats need
    its character offsets).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        if not os.path.isdir(self.path):
            what = "is not a directory" if os.path.exists(self.path) else "not found"
            raise UserError(f"tokenizer directory {what}: {self.path}")
        if not os.path.isfile(os.path.join(self.path, "tokenizer.json")):
            raise UserError(f"no tokenizer.json in tokenizer directory {self.path}")
        transformers = _transformers()
        self.hf = _auto_tokenizer(transformers, self.path)
        if not self.hf.is_fast:
            raise UserError(f"transformers loads {self.path} as a slow tokenizer ({type(self.hf).__name__}); "
                            "l2l needs a fast one (tokenizer.json)")
        self.hf.model_max_length = _NO_LENGTH_LIMIT  # documents are longer than a context; no warning about it
        self.backend = self.hf.backend_tokenizer
        self.fingerprint = _fingerprint(self.path, self.hf, transformers)
        special = self.hf.special_tokens_map  # the ones set (transformers 4 logs an error for a missing one)
        self.eos_token = special.get("eos_token") or special.get("sep_token")
        self.eos_id = self._id_of(self.eos_token, "eos")
        self.mask_id = self._id_of(special.get("mask_token"), "mask")
        self.chat_template = _chat_template(self.hf)
        self.vocab_size = len(self.hf)
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
        return self.hf(text, add_special_tokens=False)["input_ids"]

    def encode_documents(self, texts: Sequence[str]) -> list[list[int]]:
        """Each text's ids as ``hf(text)["input_ids"]`` gives them (the library spreads them over the cores)."""
        return self.hf(list(texts))["input_ids"]

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


def train_bpe(files: Sequence[str], vocab_size: int, out_dir: str | os.PathLike):
    """Train a byte-level BPE with ``<|endoftext|>`` as end-of-text token on ``files``; write it to ``out_dir``.

    The directory holds ``tokenizer.json``, ``tokenizer_config.json`` (eos
    token, ``tokenizer_class`` PreTrainedTokenizerFast) and
    ``special_tokens_map.json``. It is written to a temporary directory beside
    ``out_dir`` and renamed into place, so ``out_dir`` is either complete or
    absent. An existing non-empty ``out_dir`` is refused. Files are read as
    UTF-8 (invalid bytes become U+FFFD). The trainer may stop below
    ``vocab_size`` when the text has fewer distinct merges to make. Returns the trained
    :class:`tokenizers.Tokenizer` (training needs no transformers; :func:`load_tokenizer`
    reads the directory back).
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
    return tok


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


def _transformers():
    try:
        import transformers
    except ImportError:
        raise UserError("a Hugging Face tokenizer directory is read with transformers: pip install 'l2l[hf]'") from None
    return transformers


def _auto_tokenizer(transformers, path: str):
    """``AutoTokenizer.from_pretrained(path, local_files_only=True)``. A directory that names no
    tokenizer class (no ``tokenizer_class``, no ``config.json``), which transformers 4 refuses
    and 5 loads as its generic fast tokenizer, is loaded as that generic fast tokenizer."""
    try:
        return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # noqa: BLE001 -- whatever transformers cannot load is the directory's: one line
        error = e
    names_class = "tokenizer_class" in _read_json(os.path.join(path, "tokenizer_config.json")) or \
        os.path.exists(os.path.join(path, "config.json"))
    if not names_class:
        try:
            return transformers.PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
        except Exception as e:  # noqa: BLE001
            error = e
    raise UserError(f"cannot load the tokenizer in {path} with transformers: {one_line(error)}") from None


def _fingerprint(path: str, hf, transformers) -> str:
    """What the ids depend on: the tokenizer files, the class transformers chose, the versions
    of transformers and tokenizers, and the rules by which l2l asks for ids (:data:`_ID_RULES`)."""
    import tokenizers
    key = hashlib.sha256(f"{_ID_RULES}/{type(hf).__name__}/{transformers.__version__}/"
                         f"{tokenizers.__version__}".encode())
    for name in _TOKENIZER_FILES:
        file = os.path.join(path, name)
        if os.path.isfile(file):
            with open(file, "rb") as f:
                key.update(name.encode() + b"\0" + hashlib.sha256(f.read()).digest())
    return key.hexdigest()


def _read_json(path: str) -> dict:
    """A JSON object file's contents; ``{}`` when the file is absent."""
    if not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read {path}: {one_line(e)}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} does not hold a JSON object")
    return data


def _write_json(path: str, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, ensure_ascii=False)
        f.write("\n")


def _chat_template(hf) -> str | None:
    """The tokenizer's chat template: the one named ``default`` when it has several, None when none."""
    template = hf.chat_template
    if isinstance(template, dict):
        template = template.get("default")
    return template if isinstance(template, str) and template else None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
