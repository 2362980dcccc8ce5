"""l2l's token ids and loss masks against transformers', bit for bit.

The tests write their own tokenizers with the ``tokenizers`` library (no hub) in the styles of
Llama-3 (BOS in the tokenizer and in the template, header tokens), Mistral/Llama-2
(SentencePiece-style ``▁`` pieces, ``[INST]``, a BOS-adding ``LlamaTokenizerFast``), Qwen2
(ChatML, no BOS) and a template with ``{% generation %}`` marks. Every id is compared with
``AutoTokenizer``'s ``apply_chat_template(..., tokenize=True)`` or ``__call__``; every mask with
transformers' ``return_assistant_tokens_mask``: a template without marks is written a second time
with them around each assistant turn, and l2l's mask from the unmarked one must equal
transformers' mask from the marked one.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from conftest import run_cli
from l2l.data import load_corpus
from l2l.errors import UserError
from l2l.sft import load_examples
from l2l.tokenizer import HFTokenizer, load_tokenizer

CHATS = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What moves on?"},
     {"role": "assistant", "content": "The relay moves on to the next layer."},
     {"role": "user", "content": "And the server?"},
     {"role": "assistant", "content": "It updates each layer, eagerly."}],
    [{"role": "user", "content": "hello how are you today?"}, {"role": "assistant", "content": "I am fine, thank you."}],
    [{"role": "user", "content": "Über die Brücke?"}, {"role": "assistant", "content": " naïve Leute ins Café 🙂 "},
     {"role": "user", "content": "def add(a, b):\n    return a + b"}, {"role": "assistant", "content": "a + b\n"}],
    [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}, {"role": "user", "content": "left open"}],
]
COMPLETIONS = [("The relay moves on to the", " next layer"), ("Q: what does the server do?\nA:", " it updates"),
               ("def add(a, b):", "\n    return a + b"), ("hello how are", " you today?"), ("naï", "ve Leute")]
DOCUMENTS = ["the relay moves on to the next layer while the server updates it",
             "hello how are you today? I am fine, thank you.",
             "Über die Brücke gehen naïve Leute ins Café; emoji 🙂 tabs\tand  double spaces.",
             "def add(a, b):\n    return a + b\n", " leading space and trailing space "]

# Each style: the template l2l gets, and the same template with {% generation %} marks around what
# the assistant says (its content and its end-of-turn token), which transformers' mask reads.
LLAMA3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
          "{% if m['role'] == 'assistant' %}@{{ m['content'] | trim }}<|eot_id|>@"
          "{% else %}{{ m['content'] | trim }}<|eot_id|>{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
LLAMA2 = ("{% if messages[0]['role'] == 'system' %}{% set sys = '<<SYS>>\n' + messages[0]['content'] + '\n<</SYS>>\n\n' %}"
          "{% set msgs = messages[1:] %}{% else %}{% set sys = '' %}{% set msgs = messages %}{% endif %}"
          "{% for m in msgs %}{% if m['role'] == 'user' %}{{ bos_token + '[INST] ' + (sys if loop.first else '')"
          " + m['content'].strip() + ' [/INST]' }}{% else %}@{{ ' ' + m['content'].strip() + ' ' + eos_token }}@"
          "{% endif %}{% endfor %}")
CHATML = ("{% for m in messages %}{% if loop.first and m['role'] != 'system' %}<|im_start|>system\nYou are helpful."
          "<|im_end|>\n{% endif %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}"
          "@{{ m['content'] }}<|im_end|>\n@{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
ZEPHYR = ("{% for m in messages %}<|{{ m['role'] }}|>\n{% if m['role'] == 'assistant' %}@{{ m['content'] }}"
          "{{ eos_token }}@\n{% else %}{{ m['content'] }}{{ eos_token }}\n{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def _unmarked(template: str) -> str:
    return template.replace("@", "")


def _marked(template: str) -> str:
    parts = template.split("@")
    return "".join(p if i % 2 == 0 else "{% generation %}" + p + "{% endgeneration %}" for i, p in enumerate(parts))


def _alphabet() -> list[str]:
    texts = [m["content"] for c in CHATS for m in c] + [p + c for p, c in COMPLETIONS] + DOCUMENTS
    texts += [LLAMA3, LLAMA2, CHATML, ZEPHYR, "You are helpful. system user assistant"]
    return sorted({ch for t in texts for ch in t.replace(" ", "▁")} | {"▁"})


def _train(pre, decoder, specials: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer, tok.decoder = pre, decoder
    alphabet = pre_tokenizers.ByteLevel.alphabet() if isinstance(pre, pre_tokenizers.ByteLevel) else _alphabet()
    tok.train_from_iterator(DOCUMENTS * 4 + [m["content"] for c in CHATS for m in c] * 4,
                            trainers.BpeTrainer(vocab_size=420, special_tokens=specials, initial_alphabet=alphabet,
                                                show_progress=False))
    return tok


def _write(directory: Path, tok: Tokenizer, config: dict) -> Path:
    directory.mkdir(parents=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def _llama3(directory: Path) -> Path:
    tok = _train(pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel(),
                 ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"])
    tok.post_processor = processors.TemplateProcessing(  # as Llama-3's tokenizer.json: BOS before every text
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", tok.token_to_id("<|begin_of_text|>"))])
    return _write(directory, tok, {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
                                   "eos_token": "<|eot_id|>", "clean_up_tokenization_spaces": False,
                                   "chat_template": _unmarked(LLAMA3)})


def _llama2(directory: Path) -> Path:
    tok = _train(pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first"),
                 decoders.Metaspace(replacement="▁", prepend_scheme="first"), ["<unk>", "<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(  # as Llama-2's and Mistral's tokenizer.json
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return _write(directory, tok, {"tokenizer_class": "LlamaTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                                   "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False,
                                   "legacy": False, "chat_template": _unmarked(LLAMA2)})


def _chatml(directory: Path, template: str, tokenizer_class: str) -> Path:
    tok = _train(pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel(),
                 ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|user|>", "<|assistant|>", "<|system|>"])
    return _write(directory, tok, {"tokenizer_class": tokenizer_class, "eos_token": "<|im_end|>",
                                   "pad_token": "<|endoftext|>", "chat_template": template})


STYLES = {"llama3": (_llama3, LLAMA3), "llama2": (_llama2, LLAMA2),
          "qwen2": (lambda d: _chatml(d, _unmarked(CHATML), "Qwen2TokenizerFast"), CHATML),
          "generation": (lambda d: _chatml(d, _marked(ZEPHYR), "PreTrainedTokenizerFast"), ZEPHYR)}


@pytest.fixture(scope="session")
def tokenizer_dirs(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("styles")
    return {name: make(base / name) for name, (make, _) in STYLES.items()}


def _auto(directory: Path):
    return transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


def _ids(result) -> list[int]:
    return list(result["input_ids"] if hasattr(result, "keys") else result)


def _jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _examples(examples) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Every example of both splits, as (ids, mask), sorted: the split is not the point here."""
    out = []
    for side in (examples.train, examples.val):
        for i in range(len(side)):
            ids, mask = side.example(i)
            out.append((tuple(ids.tolist()), tuple(mask.tolist())))
    return sorted(out)


def _transformers_chat(hf, chat: list[dict], style: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """transformers' ids of ``chat`` with the directory's template, and its assistant mask from the
    marked template (the same text: the ids must agree)."""
    ids = _ids(hf.apply_chat_template(chat, tokenize=True))
    marked = hf.apply_chat_template(chat, chat_template=_marked(STYLES[style][1]), tokenize=True,
                                    return_dict=True, return_assistant_tokens_mask=True)
    assert list(marked["input_ids"]) == ids
    return tuple(ids), tuple(marked["assistant_masks"])


def _chats_for(style: str) -> list[list[dict]]:
    if style == "llama2":  # its template takes a system prompt only first, and users and assistants in turn
        return [c for c in CHATS if all(m["role"] != "system" for m in c[1:])]
    return CHATS


@pytest.mark.parametrize("style", list(STYLES))
def test_chat_ids_and_assistant_masks_are_transformers(style, tokenizer_dirs, tmp_path):
    directory = tokenizer_dirs[style]
    hf = _auto(directory)
    chats = _chats_for(style)
    data = _jsonl(tmp_path / "chats.jsonl", [{"messages": c} for c in chats])
    got = _examples(load_examples(str(data), load_tokenizer(str(directory))))
    want = sorted(_transformers_chat(hf, c, style) for c in chats)
    assert got == want
    for ids, mask in want:  # the comparison is not vacuous: both kinds of token, and Llama's BOS first
        assert 0 < sum(mask) < len(mask)
        if style in ("llama3", "llama2"):
            assert ids[0] == hf.bos_token_id
        if style == "llama3":  # the template's {{ bos_token }}, once: apply_chat_template adds none
            assert ids.count(hf.bos_token_id) == 1


@pytest.mark.parametrize("style", ["llama3", "llama2", "qwen2"])
def test_prompt_completion_is_one_text_as_transformers_tokenizes_it(style, tokenizer_dirs, tmp_path):
    """ids: ``tokenizer(prompt + completion)`` then eos; mask: the completion's tokens as transformers'
    ``{% generation %}`` mask finds them in that text, then the eos."""
    directory = tokenizer_dirs[style]
    hf = _auto(directory)
    data = _jsonl(tmp_path / "pc.jsonl", [{"prompt": p, "completion": c} for p, c in COMPLETIONS])
    got = _examples(load_examples(str(data), load_tokenizer(str(directory))))
    seam = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}"
            "{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}{% endfor %}")
    want = []
    for prompt, completion in COMPLETIONS:
        ids = hf(prompt + completion)["input_ids"]
        plain = hf.apply_chat_template([{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}],
                                       chat_template=seam, tokenize=True, return_dict=True,
                                       return_assistant_tokens_mask=True)
        added = len(ids) - len(plain["input_ids"])  # the special tokens tokenizer(text) adds first (a BOS)
        assert ids[added:] == list(plain["input_ids"]) and added == (1 if style != "qwen2" else 0)
        want.append((tuple(ids + [hf.eos_token_id]), tuple([0] * added + list(plain["assistant_masks"]) + [1])))
    assert got == sorted(want)
    # the seam of a SentencePiece-style tokenizer: no word-start piece that the whole text does not have
    if style == "llama2":
        prompt, completion = COMPLETIONS[4]
        assert hf(prompt + completion)["input_ids"] != hf(prompt)["input_ids"] + hf(completion, add_special_tokens=False)[
            "input_ids"]


@pytest.mark.parametrize("style", ["llama3", "llama2"])
def test_plain_text_documents_are_what_the_tokenizer_gives_each(style, tokenizer_dirs, tmp_path):
    """Each document is ``tokenizer(doc)["input_ids"]`` (BOS first), with eos between documents."""
    directory = tokenizer_dirs[style]
    hf = _auto(directory)
    folder = tmp_path / "docs"
    folder.mkdir()
    for i, doc in enumerate(DOCUMENTS):
        (folder / f"doc{i}.txt").write_text(doc, encoding="utf-8")
    corpus = load_corpus(str(folder), tokenizer=load_tokenizer(str(directory)))
    eos = hf.eos_token_id
    pieces = []
    for side in (corpus.train, corpus.val):
        cuts = np.flatnonzero(side == eos)
        pieces += [tuple(p.tolist()) for p in np.split(side, cuts) if p.size]
    pieces = [p[1:] if p[0] == eos else p for p in pieces]  # np.split keeps each eos at the start of the next
    assert sorted(pieces) == sorted(tuple(hf(doc)["input_ids"]) for doc in DOCUMENTS)
    assert all(p[0] == hf.bos_token_id for p in pieces)
    assert sum(int((side == eos).sum()) for side in (corpus.train, corpus.val)) == len(DOCUMENTS) - 2


def test_a_change_of_tokenizer_settings_is_not_served_from_the_cache(tokenizer_dirs, tmp_path, monkeypatch):
    """tokenizer_config.json changes the ids too (here: a special token it adds): a new cache entry."""
    monkeypatch.setenv("L2L_CACHE", str(tmp_path / "cache"))
    directory = tmp_path / "llama2"
    shutil.copytree(tokenizer_dirs["llama2"], directory)
    folder = tmp_path / "docs"
    folder.mkdir()
    for i, doc in enumerate(DOCUMENTS):
        (folder / f"doc{i}.txt").write_text(doc, encoding="utf-8")
    first = load_corpus(str(folder), tokenizer=load_tokenizer(str(directory)))
    again = load_corpus(str(folder), tokenizer=load_tokenizer(str(directory)))
    assert "cached" not in first.description and "cached" in again.description
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "additional_special_tokens": ["relay"]}))
    changed = load_corpus(str(folder), tokenizer=load_tokenizer(str(directory)))
    assert "cached" not in changed.description
    relay = _auto(directory).convert_tokens_to_ids("relay")
    assert (first.train == relay).sum() + (first.val == relay).sum() == 0
    assert (changed.train == relay).sum() + (changed.val == relay).sum() > 0


def test_a_template_that_renders_differently_each_time_is_one_line(tokenizer_dirs, tmp_path):
    directory = tmp_path / "qwen2"
    shutil.copytree(tokenizer_dirs["qwen2"], directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    drifting = _unmarked(CHATML) + "{% if messages | length > 2 %}{{ range(1000) | random }}{% endif %}"
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": drifting}))
    data = _jsonl(tmp_path / "chats.jsonl", [{"messages": CHATS[3]}] * 3)
    with pytest.raises(UserError, match="not what apply_chat_template gives") as e:
        load_examples(str(data), load_tokenizer(str(directory)))
    assert "\n" not in str(e.value)


def test_a_tokenizer_directory_without_transformers_is_one_line(tokenizer_dirs, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # what `import transformers` meets when it is missing
    with pytest.raises(UserError, match=r"pip install 'l2l\[hf\]'"):
        HFTokenizer(tokenizer_dirs["llama3"])


def test_train_on_chats_trains_on_transformers_ids(tokenizer_dirs, tmp_path):
    """``l2l train --data chats.jsonl --model DIR`` (a tiny Llama with the Llama-3-style tokenizer): the
    token arrays the run cached and trained on are transformers' ids and assistant masks."""
    from safetensors.numpy import load_file
    hf = _auto(tokenizer_dirs["llama3"])
    model = tmp_path / "llama"
    config = transformers.LlamaConfig(vocab_size=len(hf), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                                      bos_token_id=hf.bos_token_id, eos_token_id=hf.eos_token_id)
    transformers.LlamaForCausalLM(config).save_pretrained(model)
    for f in tokenizer_dirs["llama3"].iterdir():
        shutil.copy(f, model / f.name)
    data = _jsonl(tmp_path / "chats.jsonl", [{"messages": c} for c in CHATS])
    cache = tmp_path / "cache"
    r = run_cli("train", "--model", str(model), "--data", str(data), "--seq-len", "128", "--batch-size", "2",
                "--micro-batches", "1", "--steps", "1", "--eval-batches", "1", "--plan", "off", "--no-plot",
                "--out", str(tmp_path / "run"), env={"L2L_CACHE": str(cache)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"{len(CHATS)} examples" in r.stdout and "in answers" in r.stdout
    [file] = (cache / "tokens").glob("*.safetensors")
    arrays = load_file(str(file))
    got = []
    for side in ("train", "val"):
        ids, mask, offsets = (arrays[f"{side}.{k}"] for k in ("ids", "mask", "offsets"))
        got += [(tuple(ids[a:b].tolist()), tuple(mask[a:b].tolist())) for a, b in zip(offsets[:-1], offsets[1:])]
    assert sorted(got) == sorted(_transformers_chat(hf, c, "llama3") for c in CHATS)
    assert json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])["step"] == 1
