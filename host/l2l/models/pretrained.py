"""A local Hugging Face model directory as a layer stack, its weights read layer by layer.

``--model DIR`` names a directory holding ``config.json`` and safetensors weights
(``model.safetensors``, or shards listed in ``model.safetensors.index.json``). The
family comes from the config's ``model_type``; each family is a line of
:data:`FAMILIES` naming its recipe (``hf.py``), its transformers class and its
objective. The architecture is built on the meta device (no memory, no
initialisation), cut into pre / blocks / post, and each EPS entry gets a *source*:
a function that reads that entry's tensors from the safetensors files (lazily, one
tensor at a time, by the names the full model gives them) into one fp32 vector.
The EPS calls the sources one entry after the other, so a load holds the EPS state
plus about one layer, never the whole model in torch. ``--init random`` builds the
same architecture from the config with fresh weights instead.

Supported: Llama (grouped-query attention, RoPE and its scaling variants, as
transformers implements them), Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm), GPT-2
and BERT (masked LM), with tied or untied input and output embeddings. A tied
embedding stays one tensor: the stack finds it in the pre and post stages and keeps
it as one shared EPS entry (``stack.py``), read from and exported under the name
``save_pretrained`` gives it (the input embedding's). Mistral's sliding window is
not applied: no sequence here is longer than the window of any released Mistral
(4096). Checkpoints saved from a base model (GPT-2's ``h.0...`` rather than
``transformer.h.0...``) are read too.

Pickle weights (``pytorch_model.bin``, ``*.pt``, ``*.pth``) are never loaded: the
directory is refused with a line saying to convert them to safetensors.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import UserError
from .hf_version import dtype_kwarg
from .stack import LayerStack


@dataclass(frozen=True)
class PretrainedFamily:
    recipe: str                 # the name of its Recipe in hf.py
    auto_class: str             # the transformers Auto class that builds it
    objective: str              # "causal" | "mlm"
    positions: str | None = None  # config key bounding --seq-len (learned position embeddings)


FAMILIES = {
    "llama": PretrainedFamily("DECODER", "AutoModelForCausalLM", "causal"),
    "mistral": PretrainedFamily("DECODER", "AutoModelForCausalLM", "causal"),
    "qwen2": PretrainedFamily("DECODER", "AutoModelForCausalLM", "causal"),
    "qwen3": PretrainedFamily("DECODER", "AutoModelForCausalLM", "causal"),
    "gpt2": PretrainedFamily("GPT2", "AutoModelForCausalLM", "causal", "n_positions"),
    "bert": PretrainedFamily("BERT", "AutoModelForMaskedLM", "mlm", "max_position_embeddings"),
}
SUPPORTED = tuple(FAMILIES)
INITS = ("pretrained", "random")
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
PICKLES = ("*.bin", "*.pt", "*.pth", "*.ckpt")


def is_model_dir(name: str) -> bool:
    """Whether ``--model name`` names a local model directory (rather than a built-in family)."""
    return Path(name).is_dir() and (Path(name) / "config.json").is_file()


def read_config(directory: str | Path) -> dict:
    path = Path(directory) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"{path}: not a readable model config ({exc})") from None
    model_type = config.get("model_type")
    if model_type not in SUPPORTED:
        raise UserError(f"{directory}: model_type {model_type!r} is not supported; supported families: "
                        f"{', '.join(SUPPORTED)}")
    return config


def family_of(directory: str | Path) -> PretrainedFamily:
    return FAMILIES[read_config(directory)["model_type"]]


def model_shape(directory: str | Path) -> tuple[int, int, int]:
    """(blocks, width, attention heads) as the config gives them, under any family's key names."""
    config = read_config(directory)
    def first(*keys):
        return next(config[k] for k in keys if k in config)
    try:
        return (first("num_hidden_layers", "n_layer"), first("hidden_size", "n_embd"),
                first("num_attention_heads", "n_head"))
    except StopIteration:
        raise UserError(f"{directory}: config.json lacks the model's depth, width or head count") from None


class SafetensorsWeights:
    """Tensors of a checkpoint by name, read lazily from one or several safetensors files."""

    def __init__(self, directory: str | Path, base_prefix: str = "") -> None:
        """``base_prefix``: the base model's attribute (``transformer``, ``bert``), which a
        checkpoint saved from the base model alone leaves out of its names."""
        root = Path(directory)
        self.base_prefix = base_prefix + "." if base_prefix else ""
        if (root / INDEX).is_file():
            try:
                weight_map = json.loads((root / INDEX).read_text())["weight_map"]
            except (OSError, json.JSONDecodeError, KeyError) as exc:
                raise UserError(f"{root / INDEX}: not a readable safetensors index ({exc})") from None
            self._files = {name: root / shard for name, shard in weight_map.items()}
        elif (root / SINGLE).is_file():
            from safetensors import safe_open
            with safe_open(str(root / SINGLE), framework="pt") as f:
                self._files = {name: root / SINGLE for name in f.keys()}
        else:
            pickles = sorted(p.name for pattern in PICKLES for p in root.glob(pattern))
            if pickles:
                raise UserError(f"{root}: weights only as pickle ({', '.join(pickles)}), which l2l never loads; "
                                "convert them to safetensors (e.g. save_pretrained(..., safe_serialization=True))")
            raise UserError(f"{root}: no {SINGLE} or {INDEX}")
        self.root = root

    def read(self, name: str) -> torch.Tensor:
        stored = name
        if stored not in self._files and self.base_prefix and name.startswith(self.base_prefix):
            stored = name[len(self.base_prefix):]
        file = self._files.get(stored)
        if file is None:
            raise UserError(f"{self.root}: the checkpoint has no tensor {name!r}")
        from safetensors import safe_open
        with safe_open(str(file), framework="pt") as f:
            return f.get_tensor(stored)


def build_pretrained(directory: str, init: str, seq_len: int | None = None) -> LayerStack:
    """The model in ``directory`` as a layer stack; ``init`` "pretrained" reads its weights
    (entry by entry, when the EPS asks), "random" initialises them (the caller seeds).
    ``seq_len`` is checked against learned position embeddings."""
    if init not in INITS:
        raise UserError(f"unknown --init {init!r}; choose one of {', '.join(INITS)}")
    config = read_config(directory)
    family = FAMILIES[config["model_type"]]
    if seq_len is not None and family.positions is not None:
        limit = config.get(family.positions)
        if limit is not None and seq_len > limit:
            raise UserError(f"--seq-len {seq_len} is longer than the {limit} positions {directory} has "
                            f"({family.positions})")
    if init == "random":
        config, stack_config = _configs(directory)
        return _cut(family, _auto(family).from_config(config, attn_implementation="sdpa", **dtype_kwarg(torch.float32)),
                    stack_config)
    stack, keys, base_prefix = _meta_stack(directory)
    weights = SafetensorsWeights(directory, base_prefix)
    for e, entry_keys in enumerate(keys):
        reader = _reader(weights, stack.entry_layout(e)[1], entry_keys)
        if e < len(stack.layers):
            stack.layers[e].source = reader
        else:
            stack.shared[e - len(stack.layers)].source = reader
    return stack


def checkpoint_keys(directory: str) -> tuple[LayerStack, list[list[str]]]:
    """The directory's model as a layer stack on the meta device (no weights), and per
    EPS entry (each layer's own parameters, then each shared one) the checkpoint's name
    of each slot of its flat layout, in layout order. A tied parameter has the name the
    model gives it first (the input embedding's), the one ``save_pretrained`` writes."""
    stack, keys, _ = _meta_stack(directory)
    return stack, keys


def _meta_stack(directory: str) -> tuple[LayerStack, list[list[str]], str]:
    """:func:`checkpoint_keys`, and the attribute of the model's base model (its prefix)."""
    family = family_of(directory)
    config, stack_config = _configs(directory)
    with torch.device("meta"):
        model = _auto(family).from_config(config, attn_implementation="sdpa", **dtype_kwarg(torch.float32))
    recipe = _recipe(family)
    if recipe.block_aux:
        # a rotary embedding's frequencies are a buffer computed at construction, not a
        # weight: build that small module for real
        owner, _, attr = recipe.block_aux.rpartition(".")
        aux = model.get_submodule(recipe.block_aux)
        setattr(model.get_submodule(owner), attr, type(aux)(config=model.config))
    _compute_buffers(model)
    names = {id(p): n for n, p in model.named_parameters()}
    stack = _cut(family, model, stack_config)
    keys = []
    for e in range(stack.num_entries):
        i, layout = stack.entry_layout(e)
        keys.append([names[id(stack.layers[i].module.get_parameter(s.name))] for s in layout.slots])
    return stack, keys, type(model).base_model_prefix


def _compute_buffers(model: torch.nn.Module) -> None:
    """Buffers a module computes at construction that the meta device left without values
    (GPT-2's causal mask before transformers 5.x): each such module type is built once more
    from the config, for real, and lends its buffers (not its weights) to every instance."""
    real = {}
    for module in model.modules():
        empty = [name for name, b in module.named_buffers(recurse=False) if b.is_meta]
        if module is model or not empty:
            continue
        if type(module) not in real:
            real[type(module)] = type(module)(config=model.config)  # transformers' modules take their config
        for name in empty:
            setattr(module, name, getattr(real[type(module)], name))


def _recipe(family: PretrainedFamily):
    from . import hf
    return getattr(hf, family.recipe)


def _auto(family: PretrainedFamily):
    import transformers
    return getattr(transformers, family.auto_class)


def _cut(family: PretrainedFamily, model: torch.nn.Module, stack_config: dict) -> LayerStack:
    from .hf import cut_model
    return cut_model(_recipe(family), model, stack_config)


def _configs(directory: str):
    """(the transformers config, the stack's config as checkpoints record it)."""
    from transformers import AutoConfig
    config_dict = read_config(directory)
    config = AutoConfig.from_pretrained(directory, local_files_only=True)
    config._attn_implementation = "sdpa"
    return config, {"directory": str(Path(directory).resolve()), "model_type": config_dict["model_type"],
                    "config": config_dict}


def _reader(weights: SafetensorsWeights, layout, keys: list[str]):
    def read() -> np.ndarray:
        flat = np.empty(layout.numel, np.float32)
        into = torch.from_numpy(flat)
        for slot, key in zip(layout.slots, keys):
            t = weights.read(key)
            if tuple(t.shape) != slot.shape:
                raise UserError(f"{weights.root}: tensor {key!r} has shape {tuple(t.shape)}, the config says "
                                f"{slot.shape}")
            # converted as it is copied: no fp32 temporary of a bf16/fp16 tensor
            into[slot.offset:slot.offset + slot.numel].copy_(t.reshape(-1))
            del t
        return flat
    return read
