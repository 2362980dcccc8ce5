"""``l2l export RUN --out DIR`` of a LoRA run: a PEFT adapter directory, or (``--merge``) the merged model.

The adapter directory is what ``PeftModel.save_pretrained`` writes: ``adapter_config.json``
(peft's ``LoraConfig``, written by peft) and ``adapter_model.safetensors`` with peft's tensor
names (:mod:`.adapter_files`), so ``PeftModel.from_pretrained(base, DIR)`` loads it.

``--merge`` writes a Hugging Face model directory, as ``l2l export`` of a full fine-tune does:
each targeted weight becomes ``W + (B @ A) * alpha / r`` (what peft's ``merge_and_unload``
computes for a linear layer), in fp32 and then the export's dtype, every other weight as the
base has it. The base is read from the model directory the run trained (``--model DIR``, or
where the run's copy records it came from), one tensor at a time, and must still be the same
tensors (the run records their index's digest).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..checkpoint import load_latest
from ..config import TrainConfig
from ..errors import UserError
from ..export import DTYPES, SHARD_BYTES, check_target, plan_shards, staged, write_model_dir
from ..models.pretrained import COPY_RECORD, meta_stack
from ..models.weight_files import SafetensorsWeights
from ..run_model import export_source, model_copy, same_model
from .adapter_files import peft_key
from .build import ADAPTER, base_name, inject_adapters
from .spec import ADAPTER_WEIGHTS, LoraSpec


def is_lora_run(run_dir: str | Path) -> bool:
    """Whether the run trained LoRA adapters, by the config it recorded as it started: cheap,
    where loading its checkpoint would verify every byte of it once more than the export does."""
    try:
        recorded = json.loads((Path(run_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(recorded, dict) and (recorded.get("lora_rank") is not None or recorded.get("lora_init") is not None)


def export_lora(run_dir: str | Path, out: str | Path, dtype: str = "fp32", model: str | None = None,
                merge: bool = False) -> Path:
    out = check_target(out, dtype)
    ck = load_latest(run_dir)
    if ck is None:
        raise UserError(f"{run_dir} holds no checkpoint to export")
    cfg = TrainConfig.from_record(ck.meta["config"])
    recorded = ck.meta["signature"]["config"]
    spec = LoraSpec(rank=recorded["lora"]["rank"], alpha=recorded["lora"]["alpha"],
                    targets=tuple(recorded["lora"]["targets"]), dropout=recorded["lora"]["dropout"],
                    base_dtype=cfg.lora_base_dtype, init=None)
    source = export_source(run_dir, model)
    stack, names, base_prefix = meta_stack(str(source), decay_groups=not cfg.weight_decay_all,
                                           prepare=lambda m: inject_adapters(m, spec))
    stack.config["lora"] = spec.to_dict()
    if not same_model(ck.meta["signature"], stack.signature()):
        raise UserError(f"{source} does not match the model {run_dir} trained (its config differs)")
    adapters = {}  # the model's name of each adapter tensor -> its trained fp32 value
    for e, layer in enumerate(stack.layers):
        if not layer.layout.numel:
            continue
        params = dict(layer.module.named_parameters())
        flat = torch.from_numpy(ck.tensors[f"layer{e}.p"])
        for name, view in layer.layout.views(flat).items():
            adapters[names[id(params[name])]] = view
    with staged(out) as tmp:
        if merge:
            _write_merged(tmp, _base_dir(run_dir, model, recorded.get("tensors")), source, stack, names,
                          base_prefix, adapters, spec, dtype)
        else:
            _write_adapter(tmp, adapters, spec, source, dtype)
    return out


def _write_adapter(tmp: Path, adapters: dict, spec: LoraSpec, source: Path, dtype: str) -> None:
    from safetensors.torch import save_file
    tensors = {peft_key(name, ADAPTER): t.to(DTYPES[dtype]).contiguous().clone() for name, t in adapters.items()}
    save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = spec.peft_config()
    record = source / COPY_RECORD
    config.base_model_name_or_path = json.loads(record.read_text())["source"] if record.is_file() else str(source)
    config.save_pretrained(str(tmp))


def _base_dir(run_dir, model: str | None, tensors: str | None) -> Path:
    """The base model's weights for a merge: ``--model DIR``, or where the run's copy says it came from."""
    if model is not None:
        base = Path(model)
    else:
        copy = model_copy(run_dir)
        base = Path(json.loads((copy / COPY_RECORD).read_text())["source"]) if copy is not None else None
    if base is None or not (base / "config.json").is_file():
        raise UserError(f"--merge needs the base model's weights: pass --model DIR, the directory {run_dir} trained")
    if tensors is not None and SafetensorsWeights(base).digest() != tensors:
        raise UserError(f"{base}: not the weights {run_dir} trained over (their names, dtypes or shapes differ)")
    return base


def _write_merged(tmp: Path, base: Path, source: Path, stack, names, base_prefix, adapters: dict,
                  spec: LoraSpec, dtype: str) -> None:
    weights = SafetensorsWeights(base)
    frozen = {}  # the base's stored name -> the model's name of the frozen parameter (each once)
    for layer in stack.layers:
        params = dict(layer.module.named_parameters())
        for name in layer.frozen_names:
            model_name = names[id(params[name])]
            key = weights.check([(base_name(model_name), tuple(params[name].shape))], base_prefix)[0]
            frozen.setdefault(key, model_name)
    merged = set(frozen.values())
    for name in adapters:
        module = name.split(".lora_", 1)[0]
        if f"{module}.base_layer.weight" not in merged:  # tied: its weight is another module's too
            raise UserError(f"--merge: {module}'s weight is tied to another module's, which merging would change "
                            "too; export the adapter instead (without --merge)")
    keys = list(frozen)
    sizes = [torch.Size(weights.tensors[k].shape).numel() * DTYPES[dtype].itemsize for k in keys]

    def merged_of(members: list[int]):
        for k in members:
            key, model_name = keys[k], frozen[keys[k]]
            w = weights.read(key).float()
            if model_name.endswith(".base_layer.weight"):  # a targeted linear: W + (B @ A) * scaling
                module = model_name[:-len(".base_layer.weight")]
                a = adapters[f"{module}.lora_A.{ADAPTER}.weight"]
                b = adapters[f"{module}.lora_B.{ADAPTER}.weight"]
                w += (b @ a) * spec.scaling
            yield key, w

    write_model_dir(tmp, source, dtype, [merged_of(m) for m in plan_shards(sizes, SHARD_BYTES)])
