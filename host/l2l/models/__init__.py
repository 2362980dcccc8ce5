"""Model families by name; each builds a :class:`LayerStack` from a :class:`ModelConfig`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import UserError
from .config import ModelConfig
from .hf_version import need_transformers as _need_transformers
from .stack import IGNORE_INDEX, FlatLayout, Layer, LayerStack, SharedParam


def _build_gpt(cfg: ModelConfig, seed: int) -> LayerStack:
    from .gpt import build_gpt
    return build_gpt(cfg, seed)


def _build_hf_gpt2(cfg: ModelConfig, seed: int) -> LayerStack:
    _need_transformers()
    from .hf import build_hf_gpt2
    return build_hf_gpt2(cfg)


def _build_hf_bert(cfg: ModelConfig, seed: int) -> LayerStack:
    _need_transformers()
    from .hf import build_hf_bert
    return build_hf_bert(cfg)


@dataclass(frozen=True)
class ModelFamily:
    name: str
    objective: str  # "causal": predict the next byte; "mlm": predict masked bytes
    build: Callable[[ModelConfig, int], LayerStack]  # the config and the run's seed


FAMILIES: dict[str, ModelFamily] = {
    "gpt": ModelFamily("gpt", "causal", _build_gpt),
    "hf-gpt2": ModelFamily("hf-gpt2", "causal", _build_hf_gpt2),
    "hf-bert": ModelFamily("hf-bert", "mlm", _build_hf_bert),
}


def _build_pretrained(cfg: ModelConfig, seed: int) -> LayerStack:
    _need_transformers()
    from .pretrained import build_pretrained
    return build_pretrained(cfg.family, cfg.init, cfg.seq_len, decay_groups=cfg.decay_groups)


def family(name: str) -> ModelFamily:
    """A built-in family by name, or the family of a local Hugging Face model directory."""
    if name in FAMILIES:
        return FAMILIES[name]
    from .pretrained import FAMILIES as PRETRAINED, is_model_dir, read_config
    if is_model_dir(name):
        model_type = read_config(name)["model_type"]
        return ModelFamily(model_type, PRETRAINED[model_type].objective, _build_pretrained)
    raise UserError(f"unknown model {name!r}; choose one of {', '.join(FAMILIES)} or a Hugging Face model "
                    "directory (config.json and safetensors weights)")


def build_stack(cfg: ModelConfig, seed: int, *, materialize: bool = False) -> LayerStack:
    """A model's layer stack, initialised deterministically from ``seed``.

    The built-in GPT and model directories come as shapes: each EPS entry's weights are
    made (or read) when the EPS asks, one entry at a time, so training never holds the
    whole model in torch; ``materialize`` gives every layer real CPU parameters with
    those same weights (for computing with the modules directly)."""
    fam = family(cfg.family)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        stack = fam.build(cfg, seed)
    if materialize:
        stack.materialize(torch.device("cpu"))
    return stack


__all__ = ["FAMILIES", "IGNORE_INDEX", "FlatLayout", "Layer", "LayerStack", "ModelConfig",
           "ModelFamily", "SharedParam", "build_stack", "family"]
