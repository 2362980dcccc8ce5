"""Supervised fine-tuning data: prompt/completion and chat records, the loss on answers only.

A ``.jsonl`` file whose records are ``{"prompt": ..., "completion": ...}`` or
``{"messages": [{"role": ..., "content": ...}, ...]}`` is a set of *examples*, not a
text stream. Each example is one sequence: its tokens, and a mask of the tokens
the loss counts -- the completion (and the end-of-text token after it), or every
assistant turn of a chat. With a Hugging Face tokenizer the ids are transformers' own
(:class:`l2l.tokenizer.HFTokenizer`), so the model trains on what it sees at inference:

Chats
    The ids are ``apply_chat_template(messages, tokenize=True)``: the template's
    special tokens (e.g. ``{{ bos_token }}``) included, nothing added. Where the
    template marks the assistant's text with ``{% generation %}``, the mask is
    transformers' ``return_assistant_tokens_mask``.
    Otherwise an assistant turn is the text that rendering the conversation up to and
    including it adds to rendering it up to the turn with the generation prompt (so the
    header ``<|im_start|>assistant\n`` is not learnt; the turn's content and its end
    token are), and the tokens that overlap those characters in the rendered text
    (its character offsets) are the ones learnt: transformers' rule for
    ``{% generation %}`` spans, so the same template with the marks gives the same mask.
Prompt/completion
    ``prompt + completion`` is tokenized as one text, with the special tokens the
    tokenizer adds to a text (BOS), so a SentencePiece tokenizer puts no word-start
    piece at the seam that it would not put there in the whole text; the tokens that
    overlap the completion's characters are learnt (a token that straddles the seam
    too), then the end-of-text token, appended unless the tokenizer already ended the
    text with it.

Bytes (no chat template) take a completion as the prompt's bytes then the completion's.
An example longer than ``--seq-len`` + 1 tokens keeps its first tokens; a shorter
one is padded with targets the loss ignores. Batches are examples drawn at random,
batch ``s`` a pure function of ``(seed, s)`` as for text. Tokenized examples are
cached on disk like tokenized text (:func:`l2l.data.token_cache_dir`).
"""
from __future__ import annotations

import bisect
import hashlib
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from .data import Batch, StepSampler, cached_arrays, is_val_document, jsonl_records
from .errors import UserError, one_line
from .models.stack import IGNORE_INDEX
from .tokenizer import HFTokenizer, Tokenizer

_TRAIN_STREAM = 0x736674   # "sft": training draws, apart from the text sampler's
_VAL_STREAM = 0x73667476   # "sftv"
_GENERATION_MARK = re.compile(r"\{%-?\s*generation\s*-?%\}")  # as transformers looks for it


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
        marked = _marks_generation(tokenizer) if any(_kind(r) == "chat" for _, r in records) else False
        val = [is_val_document(where) for where, _ in records]
        if not any(val):
            val[-1] = True
        if all(val):
            val[0] = False
        arrays = {}
        for side, want in (("train", False), ("val", True)):
            packed = _pack([_encode(r, where, tokenizer, marked) for (where, r), v in zip(records, val) if v == want])
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


def _encode(record: dict, where: str, tokenizer: Tokenizer, marked: bool) -> tuple[list[int], list[int]]:
    """(ids, mask) of one example (see the module docstring)."""
    if _kind(record) == "completion":
        prompt, completion = record.get("prompt"), record.get("completion")
        if not isinstance(prompt, str) or not isinstance(completion, str) or not completion:
            raise UserError(f"{where}: 'prompt' and 'completion' must both be strings, the completion non-empty")
        if isinstance(tokenizer, HFTokenizer):
            ids, mask = _completion(tokenizer.hf, prompt, completion)
        else:  # bytes: one text is its two parts' bytes
            head, tail = tokenizer.encode(prompt), tokenizer.encode(completion)
            ids, mask = head + tail, [0] * len(head) + [1] * len(tail)
        eos = tokenizer.eos_id
        if eos is not None:
            if ids and ids[-1] == eos:  # the tokenizer ended the text with it: the completion's end
                mask[-1] = 1
            else:
                ids, mask = ids + [eos], mask + [1]
        return ids, mask
    messages = record["messages"]
    if not (isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages)):
        raise UserError(f"{where}: 'messages' must be a list of {{role, content}} strings")
    if not any(m["role"] == "assistant" for m in messages):
        raise UserError(f"{where}: a chat with no assistant turn has nothing to learn")
    from jinja2.exceptions import TemplateError
    try:
        return _marked_chat(tokenizer.hf, messages) if marked else _chat(tokenizer.hf, messages, where)
    except (TemplateError, ValueError) as e:  # a template's raise_exception, or transformers refusing
        raise UserError(f"{where}: the chat template failed: {one_line(e)}") from None


def _completion(hf, prompt: str, completion: str) -> tuple[list[int], list[int]]:
    """``prompt + completion`` tokenized as one text, with the special tokens ``hf(text)`` adds;
    the tokens that overlap the completion's characters are the ones learnt."""
    text = prompt + completion
    encoded = hf(text, return_offsets_mapping=True)
    ids = list(encoded["input_ids"])
    return ids, _overlapping(encoded["offset_mapping"], [(len(prompt), len(text))])


def _marked_chat(hf, messages: list[dict]) -> tuple[list[int], list[int]]:
    """A template with ``{% generation %}`` marks: transformers' own ids and assistant mask."""
    out = hf.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    return list(out["input_ids"]), [int(x) for x in out["assistant_masks"]]


def _chat(hf, messages: list[dict], where: str) -> tuple[list[int], list[int]]:
    """``apply_chat_template(messages, tokenize=True)``, and the tokens that overlap an assistant
    turn's characters in the rendered text: rendering the conversation up to each assistant turn
    with the generation prompt, and up to and including it without, the second text extends the
    first by that turn."""
    ids = _ids(hf.apply_chat_template(messages, tokenize=True))
    text = hf.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        if i == 0:
            raise UserError(f"{where}: a chat that opens with the assistant needs a chat template with "
                            "{% generation %} marks (the text before the turn cannot be rendered)")
        before = hf.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        after = hf.apply_chat_template(messages[:i + 1], tokenize=False)
        if not after.startswith(before) or not text.startswith(after):
            raise UserError(f"{where}: the chat template does not render a conversation as a growing text")
        spans.append((len(before), len(after)))
    encoded = hf(text, add_special_tokens=False, return_offsets_mapping=True)
    if list(encoded["input_ids"]) != ids:
        raise UserError(f"{where}: the chat template's text, tokenized, is not what apply_chat_template gives "
                        "(a template that renders differently each time?)")
    return ids, _overlapping(encoded["offset_mapping"], spans)


def _ids(result) -> list[int]:
    """``apply_chat_template(..., tokenize=True)``'s ids: a list (transformers 4) or a BatchEncoding (5)."""
    return list(result["input_ids"] if isinstance(result, Mapping) else result)


def _overlapping(offsets, spans: list[tuple[int, int]]) -> list[int]:
    """1 for each token whose characters ``[start, end)`` overlap one of ``spans`` (sorted, disjoint),
    else 0: transformers' rule for ``{% generation %}`` spans. The tokens a tokenizer adds have
    empty offsets at 0 and overlap nothing."""
    ends = [b for _, b in spans]
    mask = []
    for start, end in offsets:
        k = bisect.bisect_right(ends, start)  # the first span that ends after the token starts
        mask.append(int(k < len(spans) and spans[k][0] < end))
    return mask


def _marks_generation(tokenizer: Tokenizer) -> bool:
    """Whether the tokenizer's chat template marks the assistant's text with ``{% generation %}``;
    one line when it has no template (every transformers in the declared range reads the marks)."""
    source = getattr(tokenizer, "chat_template", None)
    if not source:
        raise UserError(f"chat records need a tokenizer with a chat template; {tokenizer.description} has none")
    return bool(_GENERATION_MARK.search(source))


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
