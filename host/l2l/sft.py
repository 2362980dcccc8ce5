"""Supervised fine-tuning data: prompt/completion and chat records, the loss on answers only.

A ``.jsonl`` file whose records are ``{"prompt": ..., "completion": ...}`` or
``{"messages": [{"role": ..., "content": ...}, ...]}`` is a set of *examples*, not a
text stream. Each example is one sequence: its tokens, and a mask of the tokens
the loss counts -- the completion (and the end-of-text token after it), or every
assistant turn of a chat. Chats are rendered with the tokenizer's chat template
(Jinja, as transformers renders it: a sandboxed environment, ``messages``,
``add_generation_prompt``, the special tokens); which tokens are the assistant's
is found by rendering the conversation up to each assistant turn, with and without
that turn, so it works with any template.

An example longer than ``--seq-len`` + 1 tokens keeps its first tokens; a shorter
one is padded with targets the loss ignores. Batches are examples drawn at random,
batch ``s`` a pure function of ``(seed, s)`` as for text. Tokenized examples are
cached on disk like tokenized text (:func:`l2l.data.token_cache_dir`).
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

import numpy as np
import torch

from .data import Batch, StepSampler, cached_arrays, is_val_document, jsonl_records
from .errors import UserError
from .models.stack import IGNORE_INDEX
from .tokenizer import Tokenizer

_TRAIN_STREAM = 0x736674   # "sft": training draws, apart from the text sampler's
_VAL_STREAM = 0x73667476   # "sftv"


def is_sft_data(path: str | None) -> bool:
    """Whether ``path`` is a ``.jsonl`` file of prompt/completion or chat records (its first record says)."""
    if not path or not str(path).endswith(".jsonl") or not os.path.isfile(path):
        return False
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    record = json.loads(line)
                    return isinstance(record, dict) and _kind(record) is not None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False  # the text reader reports what is wrong with it
    return False


def _kind(record: dict) -> str | None:
    if "messages" in record:
        return "chat"
    if "prompt" in record or "completion" in record:
        return "completion"
    return None


@dataclass(frozen=True)
class TokenizedExamples:
    """Examples as one id array, a same-length loss mask and where each example starts."""

    ids: np.ndarray      # int32, all examples one after the other
    mask: np.ndarray     # uint8: 1 where the token is one the loss predicts
    offsets: np.ndarray  # int64, len(examples) + 1

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def example(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = self.offsets[i], self.offsets[i + 1]
        return self.ids[a:b], self.mask[a:b]


@dataclass(frozen=True)
class Examples:
    train: TokenizedExamples
    val: TokenizedExamples
    description: str
    num_files: int


def load_examples(path: str, tokenizer: Tokenizer) -> Examples:
    """The examples of ``path``, split by a hash of each record's line (1 in 20 to validation)."""
    records = _records(path)
    template = getattr(tokenizer, "chat_template", None) or ""
    key = hashlib.sha256(f"sft/{tokenizer.fingerprint}/{tokenizer.eos_id}/{template}".encode())
    with open(path, "rb") as f:
        key.update(hashlib.sha256(f.read()).digest())

    def tokenize() -> dict[str, np.ndarray]:
        compiled = _template(tokenizer) if any(_kind(r) == "chat" for _, r in records) else None
        val = [is_val_document(where) for where, _ in records]
        if not any(val):
            val[-1] = True
        if all(val):
            val[0] = False
        arrays = {}
        for side, want in (("train", False), ("val", True)):
            packed = _pack([_encode(r, where, tokenizer, compiled) for (where, r), v in zip(records, val) if v == want])
            arrays.update({f"{side}.{k}": getattr(packed, k) for k in ("ids", "mask", "offsets")})
        return arrays
    a, cached = cached_arrays(key.hexdigest(), tokenize)
    train, val = (TokenizedExamples(a[f"{s}.ids"], a[f"{s}.mask"], a[f"{s}.offsets"]) for s in ("train", "val"))
    answer = int(train.mask.sum() + val.mask.sum())
    description = (f"{path}: {len(records)} examples ({len(train)} train, {len(val)} val), "
                   f"{train.ids.size + val.ids.size:,} tokens of {tokenizer.name}, {answer:,} in answers"
                   + ("; cached" if cached else ""))
    return Examples(train, val, description, len(records))


def _records(path: str) -> list[tuple[str, dict]]:
    out = []
    for number, record in jsonl_records(path):
        if not isinstance(record, dict) or _kind(record) is None:
            raise UserError(f"{path}:{number}: neither prompt/completion nor messages")
        out.append((f"{os.path.basename(path)}:{number}", record))
    if len(out) < 2:
        raise UserError(f"{path}: {len(out)} example(s); training and validation need at least 2")
    return out


def _encode(record: dict, where: str, tokenizer: Tokenizer, template) -> tuple[list[int], list[int]]:
    """(ids, mask) of one example."""
    if _kind(record) == "completion":
        prompt, completion = record.get("prompt"), record.get("completion")
        if not isinstance(prompt, str) or not isinstance(completion, str) or not completion:
            raise UserError(f"{where}: 'prompt' and 'completion' must both be strings, the completion non-empty")
        head = tokenizer.encode(prompt)
        tail = tokenizer.encode(completion) + ([] if tokenizer.eos_id is None else [tokenizer.eos_id])
        return head + tail, [0] * len(head) + [1] * len(tail)
    messages = record["messages"]
    if not (isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages)):
        raise UserError(f"{where}: 'messages' must be a list of {{role, content}} strings")
    if not any(m["role"] == "assistant" for m in messages):
        raise UserError(f"{where}: a chat with no assistant turn has nothing to learn")
    # the text up to each assistant turn and after it: the difference is the assistant's
    ids, mask, done = [], [], ""
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _render(template, messages[:i], True, tokenizer)
        after = _render(template, messages[:i + 1], False, tokenizer)
        if not before.startswith(done) or not after.startswith(before):
            raise UserError(f"{where}: the chat template does not render a conversation as a growing text")
        for text, learn in ((before[len(done):], 0), (after[len(before):], 1)):
            piece = tokenizer.encode(text)
            ids += piece
            mask += [learn] * len(piece)
        done = after
    return ids, mask


def _template(tokenizer: Tokenizer):
    source = getattr(tokenizer, "chat_template", None)
    if not source:
        raise UserError(f"chat records need a tokenizer with a chat template; {tokenizer.description} has none")
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise UserError(f"the chat template of {tokenizer.description} does not parse: {e}") from None


def _render(template, messages: list[dict], add_generation_prompt: bool, tokenizer: Tokenizer) -> str:
    from jinja2.exceptions import TemplateError
    try:
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               eos_token=getattr(tokenizer, "eos_token", None) or "", bos_token="")
    except TemplateError as e:
        raise UserError(f"the chat template failed: {e}") from None


def _pack(examples: list[tuple[list[int], list[int]]]) -> TokenizedExamples:
    lengths = [len(ids) for ids, _ in examples]
    offsets = np.zeros(len(examples) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    ids = np.fromiter((t for e, _ in examples for t in e), np.int32, count=int(offsets[-1]))
    mask = np.fromiter((t for _, m in examples for t in m), np.uint8, count=int(offsets[-1]))
    return TokenizedExamples(ids, mask, offsets)


class ExampleSampler(StepSampler):
    """Batches of whole examples, drawn at random (the step bookkeeping of :class:`l2l.data.StepSampler`).

    Row r of a batch is one example: inputs its first ``seq_len`` tokens, targets the
    next token where the mask says the loss counts it and ``IGNORE_INDEX`` elsewhere
    (and in the padding, whose inputs are ``pad_id``). Examples whose answer starts
    beyond the window are never drawn (one line when no example is left).
    """

    train_stream = _TRAIN_STREAM
    val_stream = _VAL_STREAM

    def __init__(self, examples: TokenizedExamples, seq_len: int, batch_size: int, seed: int = 0, *,
                 pad_id: int = 0, name: str = "data") -> None:
        if len(examples) == 0:
            raise UserError(f"the {name} split has no examples")
        # an example whose answer starts after the first seq_len + 1 tokens has nothing to learn here
        usable = [i for i in range(len(examples))
                  if examples.mask[examples.offsets[i] + 1:min(examples.offsets[i] + seq_len + 1,
                                                              examples.offsets[i + 1])].any()]
        if not usable:
            raise UserError(f"no example of the {name} split has an answer within its first {seq_len + 1} tokens; "
                            "raise --seq-len")
        self.usable = np.asarray(usable, np.int64)
        self.examples = examples
        self.seq_len = int(seq_len)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.pad_id = int(pad_id)
        self.next_step = 0

    def _make(self, rng: np.random.Generator) -> Batch:
        t = self.seq_len
        inputs = np.full((self.batch_size, t), self.pad_id, np.int64)
        targets = np.full((self.batch_size, t), IGNORE_INDEX, np.int64)
        for row, i in enumerate(self.usable[rng.integers(0, len(self.usable), size=self.batch_size)]):
            ids, mask = self.examples.example(int(i))
            ids, mask = ids[:t + 1], mask[:t + 1]
            n = len(ids) - 1
            if n < 1:
                continue
            inputs[row, :n] = ids[:-1]
            targets[row, :n] = np.where(mask[1:] == 1, ids[1:], IGNORE_INDEX)
        return Batch(torch.from_numpy(inputs), torch.from_numpy(targets))
