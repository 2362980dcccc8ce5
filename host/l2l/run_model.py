"""A run's own copy of its model directory, so that resume and export need nothing from the source.

A run of ``--model DIR`` keeps ``OUT/model/``: the directory's ``config.json`` and the
files that go with it (tokenizer, chat template, generation config: :data:`COMPANIONS`),
not its weights, and ``l2l-model.json``, which records where it came from and the digest
of its tensor index. A resume builds the model from this copy with zero weights, which the
run's checkpoint replaces, and tokenizes with the copy's tokenizer, so the source may have
moved, be a copy or a link elsewhere, or be gone. ``--model`` on a resume still has to say
which model: if it names an existing directory, that must be the same model (the same
config and, for a run that started from its weights, the same tensor index; only its
config and safetensors headers are read), and a path that no longer exists is taken as
the one the copy stands in for. ``l2l export`` takes its config and companions from the
copy too, or from ``--model DIR``.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

from .checkpoint import atomic_write_bytes, fsync_dir
from .config import TrainConfig
from .errors import UserError
from .models import FAMILIES as BUILT_IN
from .models.pretrained import COPY_RECORD, RESUMED, is_model_dir, read_config, recorded_tensors
from .models.weight_files import SafetensorsWeights

MODEL_COPY = "model"
# what a model directory carries beside its weights and config, copied as it is
COMPANIONS = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
              "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model", "generation_config.json")


def model_copy(run_dir: str | Path) -> Path | None:
    """The run's copy of its model directory; None for a run of a built-in model (or of an
    older l2l, which kept none)."""
    copy = Path(run_dir) / MODEL_COPY
    return copy if (copy / "config.json").is_file() and (copy / COPY_RECORD).is_file() else None


def keep_model(source: str | Path, run_dir: str | Path, tensors: str | None) -> Path:
    """Write ``run_dir``'s copy of the model directory ``source`` (replacing one a killed start
    left): written under a temporary name, synced, then renamed into place. ``tensors``: the
    digest of the tensor index its weights were read from, None for fresh weights."""
    source, run_dir = Path(source), Path(run_dir)
    copy, tmp = run_dir / MODEL_COPY, run_dir / f".{MODEL_COPY}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for name in ("config.json", *COMPANIONS):
        if (source / name).is_file():
            atomic_write_bytes(tmp / name, (source / name).read_bytes())
    record = {"source": str(source.resolve()), "tensors": tensors}
    atomic_write_bytes(tmp / COPY_RECORD, (json.dumps(record, indent=1) + "\n").encode())
    shutil.rmtree(copy, ignore_errors=True)
    os.rename(tmp, copy)
    fsync_dir(run_dir)
    return copy


def resumed(cfg: TrainConfig, run_dir: str | Path) -> TrainConfig:
    """``cfg`` for its run in ``run_dir``: on a resume of a run of a model directory, the model
    is the run's copy (weights from the checkpoint), once ``--model`` is checked to name that
    model."""
    copy = model_copy(run_dir)
    if not cfg.resume or copy is None:
        return cfg
    if cfg.lora_rank is not None or cfg.lora_init is not None:  # the frozen base is read again: it must be there
        check_same_model(cfg.model, copy, run_dir, must_exist=True)
        return replace(cfg, out=str(run_dir))
    check_same_model(cfg.model, copy, run_dir)
    return replace(cfg, model=str(copy), init=RESUMED, out=str(run_dir))


def check_same_model(model: str, copy: Path, run_dir: str | Path, *, must_exist: bool = False) -> None:
    """Refuse ``--model model`` unless it is the model of ``copy`` (see the module's docstring)."""
    source = json.loads((copy / COPY_RECORD).read_text()).get("source")
    if model in BUILT_IN:
        raise UserError(f"{run_dir} trained the model directory {source}; pass it (or where it is now) as --model, "
                        f"not {model!r}")
    if not Path(model).exists() and not must_exist:
        return  # moved or deleted: the run's copy stands in for it
    if not is_model_dir(model):
        raise UserError(f"--model {model}: not a model directory (no config.json)")
    if read_config(model) != read_config(copy):
        raise UserError(f"--model {model} is not the model {run_dir} trained: its config.json differs from "
                        f"{copy / 'config.json'}")
    tensors = recorded_tensors(copy)
    if tensors is not None and SafetensorsWeights(model).digest() != tensors:
        raise UserError(f"--model {model} is not the model {run_dir} trained: its tensors' names, dtypes or "
                        "shapes differ")


def export_source(run_dir: str | Path, model: str | None) -> Path:
    """Where ``l2l export`` takes the run's config and tokenizer from: ``--model`` (checked
    against the run's copy when it has one), else the run's copy."""
    copy = model_copy(run_dir)
    if model is not None:
        if copy is not None:
            check_same_model(model, copy, run_dir, must_exist=True)
        elif not is_model_dir(model):
            raise UserError(f"--model {model}: not a model directory (no config.json)")
        return Path(model)
    if copy is None:
        raise UserError(f"{run_dir} keeps no copy of its model directory (a run of an older l2l); pass --model DIR, "
                        "the directory it trained")
    return copy


def same_model(saved: dict, signature: dict) -> bool:
    """Whether a checkpoint's signature and a stack's describe the same model: the same layers
    and config and, where both record one, the same tensor index. A checkpoint of an older
    l2l named a model directory by its path, which is not compared."""
    def parts(sig: dict) -> tuple[dict, object]:
        sig = json.loads(json.dumps(sig))
        config = sig.get("config")
        if not isinstance(config, dict) or "model_type" not in config:
            return sig, None
        tensors = config.pop("tensors", None)
        config.pop("directory", None)
        return sig, tensors
    (a, a_tensors), (b, b_tensors) = parts(saved), parts(signature)
    return a == b and (a_tensors is None or b_tensors is None or a_tensors == b_tensors)
