"""A bad safetensors checkpoint is refused at start-up, in one line and exit code 2, before
anything is written: no run directory, no ``--eps-offload`` files (``models/weight_files.py``).

Each case spoils a tiny sharded Llama written by transformers in one way; only headers are
read to find it.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from conftest import run_cli

INDEX = "model.safetensors.index.json"


def _sharded_llama(root: Path) -> Path:
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    out = root / "llama"
    transformers.LlamaForCausalLM(config).save_pretrained(out, max_shard_size="20KB")
    return out


def _shard_of(directory: Path, tensor: str) -> Path:
    return directory / json.loads((directory / INDEX).read_text())["weight_map"][tensor]


def _edit_index(directory: Path, edit) -> None:
    index = json.loads((directory / INDEX).read_text())
    edit(index["weight_map"])
    (directory / INDEX).write_text(json.dumps(index))


def _rewrite(directory: Path, tensor: str, value: torch.Tensor) -> None:
    from safetensors.torch import load_file, save_file
    shard = _shard_of(directory, tensor)
    tensors = load_file(shard)
    tensors[tensor] = value
    save_file(tensors, shard, metadata={"format": "pt"})


UP = "model.layers.1.mlp.up_proj.weight"
HEAD = "lm_head.weight"


def _missing_shard(d: Path) -> str:
    shard = _shard_of(d, HEAD)
    shard.unlink()
    return shard.name


def _wrong_shard(d: Path) -> str:
    other = _shard_of(d, "model.embed_tokens.weight").name
    assert other != _shard_of(d, UP).name
    _edit_index(d, lambda m: m.update({UP: other}))
    return "holds no tensor"


def _not_in_index(d: Path) -> str:
    _edit_index(d, lambda m: m.pop(UP))
    return f"has no tensor {UP!r}"


def _truncated(d: Path) -> str:
    shard = _shard_of(d, HEAD)
    shard.write_bytes(shard.read_bytes()[:-100])
    return "truncated"


def _bad_header(d: Path) -> str:
    shard = _shard_of(d, HEAD)
    data = bytearray(shard.read_bytes())
    data[8:16] = b"not json"
    shard.write_bytes(bytes(data))
    return "not a readable safetensors file"


def _wrong_shape(d: Path) -> str:
    _rewrite(d, UP, torch.zeros(48, 31))
    return "has shape (48, 31), the config says (48, 32)"


def _integer_dtype(d: Path) -> str:
    _rewrite(d, UP, torch.zeros(48, 32, dtype=torch.int32))
    return "is I32"


CASES = [_missing_shard, _wrong_shard, _not_in_index, _truncated, _bad_header, _wrong_shape, _integer_dtype]


@pytest.mark.parametrize("spoil", CASES, ids=[c.__name__.strip("_") for c in CASES])
def test_a_bad_checkpoint_is_refused_before_anything_is_written(spoil, tmp_path):
    directory = _sharded_llama(tmp_path)
    assert len(set(json.loads((directory / INDEX).read_text())["weight_map"].values())) > 2
    needle = spoil(directory)
    data = tmp_path / "data.txt"
    data.write_text("a few words of text to train on, repeated. " * 50)
    out, offload = tmp_path / "out", tmp_path / "eps"
    r = run_cli("train", "--model", str(directory), "--data", str(data), "--seq-len", "16", "--batch-size", "2",
                "--micro-batches", "1", "--steps", "1", "--eval-batches", "1", "--no-progress", "--plan", "off",
                "--eps-offload", str(offload), "--out", str(out))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("l2l: error:"), r.stderr[-3000:]
    assert needle in lines[0], lines[0]
    assert not out.exists() and not offload.exists()
