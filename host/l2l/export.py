"""``l2l export RUN_DIR --out DIR``: a run's latest checkpoint as a Hugging Face model directory.

For runs of a model directory (``--model DIR``): the master weights of the latest
checkpoint, named as the source checkpoint names them, in safetensors shards (with an
index when there are several) in the chosen dtype, beside the model's config (its
dtype set to the export's) and its tokenizer and generation files, taken from the run's
own copy of them (``run_model.py``) or from ``--model DIR``, so the export needs nothing
from where the model was when it trained. The checkpoint is
verified first and then read one layer at a time, one shard in memory at most, and
the directory is written under a temporary name and renamed into place when complete.
"""
from __future__ import annotations

import json
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

from .checkpoint import load_latest
from .config import TrainConfig
from .errors import UserError
from .models.expert_weights import stored_pieces
from .models.pretrained import checkpoint_keys
from .run_model import COMPANIONS, export_source, same_model

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
SHARD_BYTES = 2 << 30


def export(run_dir: str | Path, out: str | Path, dtype: str = "fp32", shard_bytes: int = SHARD_BYTES,
           model: str | None = None) -> Path:
    """Write the run's latest checkpoint to ``out``; returns ``out``. ``model``: the model
    directory the run trained (default: the run's copy of its config and tokenizer)."""
    out = check_target(out, dtype)
    ck = load_latest(run_dir)
    if ck is None:
        raise UserError(f"{run_dir} holds no checkpoint to export")
    cfg = TrainConfig.from_record(ck.meta["config"])
    if "model_type" not in ck.meta.get("signature", {}).get("config", {}):
        raise UserError(f"{run_dir} trained {cfg.model!r}: export writes Hugging Face directories for runs of a "
                        "model directory (--model DIR), whose config and tensor names it reuses")
    source = export_source(run_dir, model)
    stack, keys = checkpoint_keys(str(source), decay_groups=not cfg.weight_decay_all)
    if not same_model(ck.meta["signature"], stack.signature()):
        raise UserError(f"{source} does not match the model {run_dir} trained (its config differs)")

    entries = range(stack.num_entries)  # each layer's own tensors, then each tied one (written once)
    shards = plan_shards([stack.entry_numel(e) * DTYPES[dtype].itemsize for e in entries], shard_bytes)

    def tensors_of(entry_ids: list[int]):
        for e in entry_ids:
            flat = torch.from_numpy(ck.tensors[f"layer{e}.p"])
            for slot, key in zip(stack.entry_layout(e)[1].slots, keys[e]):
                part = flat[slot.offset:slot.offset + slot.numel].view(slot.shape)
                for piece in stored_pieces(stack.config["model_type"], key, slot.shape):  # experts: one each
                    yield piece.name, part[piece.index]

    with staged(out) as tmp:
        write_model_dir(tmp, source, dtype, [tensors_of(ids) for ids in shards])
    return out


def check_target(out: str | Path, dtype: str) -> Path:
    """The export's ``--dtype`` and ``--out`` checked: a known dtype, a new or empty directory."""
    if dtype not in DTYPES:
        raise UserError(f"unknown --dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out} already exists and is not an empty directory")
    return out


@contextmanager
def staged(out: Path) -> Iterator[Path]:
    """A temporary directory beside ``out``, renamed to ``out`` when the block completes and
    removed when it fails: an export is whole or absent."""
    tmp = out.with_name(f".{out.name}.export-tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_model_dir(tmp: Path, source: Path, dtype: str, shards: list) -> None:
    """A Hugging Face model directory in ``tmp``: each shard's ``(name, tensor)`` pairs (made as
    the shard is written, one shard in memory at most) in ``dtype``, the index when there are
    several, ``source``'s config with its dtype set, and its tokenizer and generation files."""
    from safetensors.torch import save_file
    files = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    weight_map, total = {}, 0
    for file, named in zip(files, shards):
        tensors = {}
        for name, t in named:
            out = t.to(DTYPES[dtype]).contiguous()
            tensors[name] = out.clone() if out.data_ptr() == t.data_ptr() else out  # never a view of the source
            weight_map[name] = file
            total += tensors[name].numel() * DTYPES[dtype].itemsize
        save_file(tensors, str(tmp / file), metadata={"format": "pt"})
        del tensors
    if len(files) > 1:
        (tmp / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    config = json.loads((source / "config.json").read_text())
    config["dtype"] = DTYPE_NAMES[dtype]
    if "torch_dtype" in config:
        config["torch_dtype"] = DTYPE_NAMES[dtype]
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in COMPANIONS:
        if (source / name).is_file():
            shutil.copy2(source / name, tmp / name)


def plan_shards(layer_bytes: list[int], limit: int) -> list[list[int]]:
    """Consecutive entries per shard, each shard at most ``limit`` bytes (or one entry)."""
    shards: list[list[int]] = [[]]
    size = 0
    for i, n in enumerate(layer_bytes):
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += n
    return shards
