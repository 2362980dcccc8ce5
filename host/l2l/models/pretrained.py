"""A local Hugging Face model directory as a layer stack, its weights read layer by layer.

``--model DIR`` names a directory holding ``config.json`` and safetensors weights
(``model.safetensors``, or shards listed in ``model.safetensors.index.json``). The
family comes from the config's ``model_type``; each family is a recipe in ``hf.py``.
The architecture is built on the meta device (no memory, no initialisation), cut
into pre / blocks / post, and each layer gets a *source*: a function that reads
that layer's tensors from the safetensors files (lazily, one tensor at a time, by
the names the full model gives them) into one fp32 vector. The EPS calls the
sources one layer after the other, so a load holds the EPS state plus about one
layer, never the whole model in torch. ``--init random`` builds the same
architecture from the config with fresh weights instead.

Supported now: Llama (grouped-query attention, RoPE and its scaling variants, as
transformers implements them), Mistral, Qwen2 (qkv bias) and Qwen3 (q/k norm),
with untied input and output embeddings. Not yet (issue 14): tied embeddings
(refused with one line, not silently untied), GPT-2 and BERT directories, the
directory's tokenizer (tokens are bytes, ids 0-255 of the model's vocabulary),
and export back. Mistral's sliding window is not applied: no sequence here is
longer than the window of any released Mistral (4096).

Pickle weights (``pytorch_model.bin``, ``*.pt``, ``*.pth``) are never loaded: the
directory is refused with a line saying to convert them to safetensors.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from ..errors import UserError
from .stack import LayerStack

DECODER_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED = DECODER_TYPES
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


def objective_of(directory: str | Path) -> str:
    return "causal"  # every supported family is a decoder


class SafetensorsWeights:
    """Tensors of a checkpoint by name, read lazily from one or several safetensors files."""

    def __init__(self, directory: str | Path) -> None:
        root = Path(directory)
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
        file = self._files.get(name)
        if file is None:
            raise UserError(f"{self.root}: the checkpoint has no tensor {name!r}")
        from safetensors import safe_open
        with safe_open(str(file), framework="pt") as f:
            return f.get_tensor(name)


def build_pretrained(directory: str, init: str) -> LayerStack:
    """The model in ``directory`` as a layer stack; ``init`` "pretrained" reads its weights
    (layer by layer, when the EPS asks), "random" initialises them (the caller seeds)."""
    if init not in INITS:
        raise UserError(f"unknown --init {init!r}; choose one of {', '.join(INITS)}")
    if init == "random":
        from transformers import AutoModelForCausalLM

        from .hf import DECODER, cut_model
        config, stack_config = _configs(directory)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
        return cut_model(DECODER, model, stack_config)
    weights = SafetensorsWeights(directory)
    stack, keys = checkpoint_keys(directory)
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
    from transformers import AutoModelForCausalLM

    from .hf import DECODER, cut_model
    config, stack_config = _configs(directory)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    # the rotary embedding's frequencies are a buffer computed at construction, not a
    # weight: build that small module for real
    model.model.rotary_emb = type(model.model.rotary_emb)(config=model.config)
    names = {id(p): n for n, p in model.named_parameters()}
    stack = cut_model(DECODER, model, stack_config)
    keys = []
    for e in range(stack.num_entries):
        i, layout = stack.entry_layout(e)
        keys.append([names[id(stack.layers[i].module.get_parameter(s.name))] for s in layout.slots])
    return stack, keys


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
