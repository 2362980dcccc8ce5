"""A model directory as a layer stack whose layers train LoRA adapters over a frozen base.

peft's own ``inject_adapter_in_model`` puts its ``LoraLayer`` modules into the model while
it is still on the meta device (no weights, no memory), before it is cut into pre / blocks /
post, so each layer's module carries peft's adapters under peft's names
(``...q_proj.lora_A.default.weight``) and computes with peft's forward. peft marks everything
but the adapters frozen (``requires_grad`` False); the stack lays out only what trains
(``models/stack.py``), so each layer's EPS entry is its adapters, and the frozen weights go
to :class:`~.frozen.FrozenBase`, read from the directory's safetensors under their own names
(peft's ``.base_layer`` taken out).

The adapters start as peft starts them (``LoraLayer.reset_lora_parameters`` with
``init_lora_weights=True``: A kaiming-uniform with a = sqrt(5), B zeros), one seeded generator
per EPS entry, or from a PEFT adapter directory (``--lora-init DIR``).
"""
from __future__ import annotations

import math
import warnings
from functools import partial

import numpy as np
import torch
from torch import nn

from ..errors import UserError
from ..models.pretrained import meta_stack, read_config
from ..models.stack import LayerStack
from ..models.weight_files import SafetensorsWeights
from ..seeds import derive_seed
from .adapter_files import AdapterWeights, peft_key
from .frozen import FrozenBase
from .spec import LoraSpec, check_model, lora_spec

ADAPTER = "default"  # peft's adapter name, which its saved files leave out


def build_lora_stack(cfg, seed: int) -> LayerStack:
    """``cfg.model``'s stack with ``cfg``'s LoRA adapters (``cfg`` checked by TrainConfig.check)."""
    check_model(cfg)
    directory = cfg.model
    spec = lora_spec(cfg, read_config(directory)["model_type"])
    weights = SafetensorsWeights(directory)  # every file checked before the model is built

    def inject(model: nn.Module) -> None:
        check_targets(model, spec)
        inject_adapters(model, spec)

    stack, names, base_prefix = meta_stack(directory, decay_groups=not cfg.weight_decay_all, prepare=inject)
    stack.config["tensors"] = weights.digest()
    stack.config["lora"] = spec.to_dict()
    frozen = []
    for layer in stack.layers:
        params = dict(layer.module.named_parameters())
        wanted = {name: base_name(names[id(params[name])]) for name in layer.frozen_names}
        stored = weights.check([(key, tuple(params[name].shape)) for name, key in wanted.items()], base_prefix)
        frozen.append(dict(zip(wanted, stored)))
    stack.frozen = FrozenBase(weights, frozen, spec.base_dtype)
    init = AdapterWeights(spec.init) if spec.init is not None else None
    for e, layer in enumerate(stack.layers):
        params = dict(layer.module.named_parameters())
        keys = [peft_key(names[id(params[slot.name])], ADAPTER) for slot in layer.layout.slots]
        if init is not None:
            layer.source = partial(init.entry, layer.layout, keys)
        else:
            layer.source = partial(initial_adapters, layer.layout, derive_seed(seed, "lora-init", e))
    return stack


def inject_adapters(model: nn.Module, spec: LoraSpec) -> None:
    """peft's LoRA modules into ``model`` (on the meta device), everything else frozen. peft's
    warning about an adapter on a tied weight is not shown: the export refuses to merge one
    (``lora/export.py``), and the adapter itself trains and loads as peft's does."""
    from peft import inject_adapter_in_model
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*", category=UserWarning)
        inject_adapter_in_model(spec.peft_config(), model, adapter_name=ADAPTER, low_cpu_mem_usage=True)


def base_name(name: str) -> str:
    """The base weight's own name of a frozen parameter under peft (``q_proj.base_layer.weight``)."""
    return name.replace(".base_layer.", ".")


def check_targets(model: nn.Module, spec: LoraSpec) -> None:
    """One line for a target that matches no module, one that is not a linear layer, or a rank
    larger than a targeted layer (``min(in, out)``). A target matches as peft matches a list:
    the module's name, or its name's last dotted parts."""
    modules = dict(model.named_modules())
    linear = sorted({name.rsplit(".", 1)[-1] for name, m in modules.items() if isinstance(m, nn.Linear)})
    for target in spec.targets:
        found = [(name, m) for name, m in modules.items() if name == target or name.endswith("." + target)]
        if not found:
            raise UserError(f"--lora-targets {target}: no module of the model is named so; its linear layers: "
                            f"{', '.join(linear)}")
        for name, m in found:
            if not isinstance(m, nn.Linear):
                raise UserError(f"--lora-targets {target}: {name} is a {type(m).__name__}; l2l adapts linear "
                                f"layers ({', '.join(linear)})")
            if spec.rank > min(m.in_features, m.out_features):
                raise UserError(f"--lora-rank {spec.rank} is larger than {name} ({m.in_features} in, "
                                f"{m.out_features} out): at most {min(m.in_features, m.out_features)}")


def initial_adapters(layout, seed: int) -> np.ndarray:
    """An entry's adapters as peft initialises them: each ``lora_A`` kaiming-uniform (a = sqrt(5)),
    each ``lora_B`` zeros; drawn from one generator seeded for the entry."""
    flat = torch.zeros(layout.numel)
    gen = torch.Generator().manual_seed(seed)
    for slot in layout.slots:
        if ".lora_A." in slot.name:
            view = flat[slot.offset:slot.offset + slot.numel].view(slot.shape)
            nn.init.kaiming_uniform_(view, a=math.sqrt(5), generator=gen)
    return flat.numpy()
