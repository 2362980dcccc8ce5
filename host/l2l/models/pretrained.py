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
and BERT (masked LM), with tied or untied input and output embeddings; and the
mixture-of-experts Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE (docs/moe.md: their
experts' names on disk in ``expert_weights.py``, their load-balancing loss in
``router_balance.py``). A tied
embedding stays one tensor: the stack finds it in the pre and post stages and keeps
it as one shared EPS entry (``stack.py``), read from and exported under the name
``save_pretrained`` gives it (the input embedding's). A sliding window (Mistral's,
Qwen2's and Qwen3's) applies where transformers applies it (``layer_masks.py``).
Checkpoints saved from a base model (GPT-2's ``h.0...`` rather than
``transformer.h.0...``) are read too.

Pickle weights (``pytorch_model.bin``, ``*.pt``, ``*.pth``) are never loaded: the
directory is refused with a line saying to convert them to safetensors. The safetensors
files are checked whole (headers only) before anything is read or written
(``weight_files.py``).

A model is identified by content, not by where it lies: the stack's config (which
checkpoints record in their signature) holds the ``model_type``, the config and, when the
weights are the directory's, the digest of its tensor index (names, dtypes, shapes).
A run keeps its own copy of the directory without the weights (``l2l/run_model.py``);
``--init checkpoint``, set only by a resume, builds from that copy with zero weights,
which the run's checkpoint then replaces, so a resume reads nothing of the source.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import numpy as np
import torch

from ..errors import UserError
from .expert_weights import Piece, piece_shape, stored_pieces
from .hf_version import dtype_kwarg, need_fused_experts
from .stack import LayerStack
from .weight_files import SafetensorsWeights


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
    "mixtral": PretrainedFamily("MOE_DECODER", "AutoModelForCausalLM", "causal"),
    "qwen2_moe": PretrainedFamily("MOE_DECODER", "AutoModelForCausalLM", "causal"),
    "qwen3_moe": PretrainedFamily("MOE_DECODER", "AutoModelForCausalLM", "causal"),
    "olmoe": PretrainedFamily("MOE_DECODER", "AutoModelForCausalLM", "causal"),
}
SUPPORTED = tuple(FAMILIES)
INITS = ("pretrained", "random")
RESUMED = "checkpoint"  # the init of a resume: zero weights, the run's checkpoint replaces them
COPY_RECORD = "l2l-model.json"  # in a run's copy of its model directory: where it came from, its tensor index


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
    if FAMILIES[model_type].recipe == "MOE_DECODER":
        need_fused_experts(model_type)
        _check_experts(directory, config)
    return config


def _check_experts(directory, config: dict) -> None:
    """A router chooses ``num_experts_per_tok`` of its experts: at least one, at most all."""
    experts = config.get("num_local_experts", config.get("num_experts"))
    top_k = config.get("num_experts_per_tok")
    if isinstance(experts, int) and isinstance(top_k, int) and not 1 <= top_k <= experts:
        raise UserError(f"{directory}: num_experts_per_tok {top_k} with {experts} experts; a router chooses "
                        "between 1 and all of its experts")


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


def build_pretrained(directory: str, init: str, seq_len: int | None = None, *,
                     decay_groups: bool = True) -> LayerStack:
    """The model in ``directory`` as a layer stack; ``init`` "pretrained" reads its weights
    (entry by entry, when the EPS asks), "random" initialises them (the caller seeds).
    ``seq_len`` is checked against learned position embeddings. :data:`RESUMED` builds a
    run's copy of the directory (no weights) with zero weights, for its checkpoint to replace."""
    if init not in (*INITS, RESUMED):
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
                    stack_config, decay_groups)
    if init == RESUMED:
        stack, _, _ = _meta_stack(directory, decay_groups)
        tensors = recorded_tensors(directory)
        if tensors is not None:
            stack.config["tensors"] = tensors
        for e in range(stack.num_entries):
            _set_source(stack, e, partial(np.zeros, stack.entry_numel(e), np.float32))
        return stack
    weights = SafetensorsWeights(directory)  # every file checked before the model is built
    stack, keys, base_prefix = _meta_stack(directory, decay_groups)
    stack.config["tensors"] = weights.digest()
    layouts = [stack.entry_layout(e)[1] for e in range(stack.num_entries)]
    pieces = [[_pieces_in(weights, config["model_type"], key, slot.shape) for slot, key in zip(layout.slots, entry_keys)]
              for layout, entry_keys in zip(layouts, keys)]
    stored = iter(weights.check([(piece.name, piece_shape(slot.shape, piece))
                                 for layout, entry_pieces in zip(layouts, pieces)
                                 for slot, slot_pieces in zip(layout.slots, entry_pieces)
                                 for piece in slot_pieces], base_prefix))
    for e, (layout, entry_pieces) in enumerate(zip(layouts, pieces)):
        _set_source(stack, e, _reader(weights, layout, [[replace(piece, name=next(stored)) for piece in slot_pieces]
                                                        for slot_pieces in entry_pieces]))
    return stack


def _pieces_in(weights: SafetensorsWeights, model_type: str, key: str, shape) -> list[Piece]:
    """Where the parameter ``key`` lies in the files: under its own name if they hold it (a
    fused expert tensor included), else as ``save_pretrained`` writes it (``expert_weights.py``)."""
    if key in weights.tensors:
        return [Piece(key, ())]
    return stored_pieces(model_type, key, tuple(shape))


def recorded_tensors(directory: str | Path) -> str | None:
    """The tensor-index digest a run's copy of a model directory records (None: the run
    started from fresh weights, ``--init random``)."""
    path = Path(directory) / COPY_RECORD
    try:
        return json.loads(path.read_text())["tensors"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{path}: not a readable record of a run's model ({exc})") from None


def _set_source(stack: LayerStack, e: int, reader) -> None:
    if e < len(stack.layers):
        stack.layers[e].source = reader
    else:
        stack.shared[e - len(stack.layers)].source = reader


def checkpoint_keys(directory: str, decay_groups: bool = True) -> tuple[LayerStack, list[list[str]]]:
    """The directory's model as a layer stack on the meta device (no weights), and per
    EPS entry (each layer's own parameters, then each shared one) the checkpoint's name
    of each slot of its flat layout, in layout order. A tied parameter has the name the
    model gives it first (the input embedding's), the one ``save_pretrained`` writes."""
    stack, keys, _ = _meta_stack(directory, decay_groups)
    return stack, keys


def _meta_stack(directory: str, decay_groups: bool) -> tuple[LayerStack, list[list[str]], str]:
    """:func:`checkpoint_keys`, and the attribute of the model's base model (its prefix)."""
    stack, names, base_prefix = meta_stack(directory, decay_groups)
    keys = []
    for e in range(stack.num_entries):
        i, layout = stack.entry_layout(e)
        keys.append([names[id(stack.layers[i].module.get_parameter(s.name))] for s in layout.slots])
    return stack, keys, base_prefix


def meta_stack(directory: str, decay_groups: bool, prepare=None) -> tuple[LayerStack, dict[int, str], str]:
    """The directory's model built on the meta device, changed by ``prepare(model)`` if given
    (LoRA adapters injected, ``l2l.lora``), cut into a stack; with the model's name of each
    parameter (by ``id``) and its base model's attribute (the checkpoint names' prefix)."""
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
    if prepare is not None:
        prepare(model)
    names = {id(p): n for n, p in model.named_parameters()}
    stack = _cut(family, model, stack_config, decay_groups)
    return stack, names, type(model).base_model_prefix


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


def _cut(family: PretrainedFamily, model: torch.nn.Module, stack_config: dict, decay_groups: bool) -> LayerStack:
    from .hf import cut_model
    return cut_model(_recipe(family), model, stack_config, decay_groups=decay_groups)


def _configs(directory: str):
    """(the transformers config, the stack's config as checkpoints record it)."""
    from transformers import AutoConfig
    config_dict = read_config(directory)
    config = AutoConfig.from_pretrained(directory, local_files_only=True)
    config._attn_implementation = "sdpa"
    return config, {"model_type": config_dict["model_type"], "config": config_dict}


def _reader(weights: SafetensorsWeights, layout, stored: list[list[Piece]]):
    """An entry's weights from the checked files, by each slot's stored tensors (its pieces)."""
    def read() -> np.ndarray:
        flat = np.empty(layout.numel, np.float32)
        into = torch.from_numpy(flat)
        for slot, pieces in zip(layout.slots, stored):
            view = into[slot.offset:slot.offset + slot.numel].view(slot.shape)
            for piece in pieces:
                t = weights.read(piece.name)
                # converted as it is copied: no fp32 temporary of a bf16/fp16 tensor
                view[piece.index].copy_(t)
                del t
        return flat
    return read
