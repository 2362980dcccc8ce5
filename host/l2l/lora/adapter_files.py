"""PEFT adapter directories, both ways: ``adapter_config.json`` and ``adapter_model.safetensors``.

The tensor names are the ones ``PeftModel.save_pretrained`` writes: the model's parameter name
under ``base_model.model.``, without the adapter's name (``...q_proj.lora_A.weight``), so
``peft.PeftModel.from_pretrained(base, DIR)`` loads what l2l writes and l2l starts from what
peft wrote (``--lora-init DIR``).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..errors import UserError
from ..models.weight_files import stored_tensors_of
from .spec import ADAPTER_WEIGHTS

PREFIX = "base_model.model."


def peft_key(name: str, adapter: str) -> str:
    """peft's saved name of the model's adapter parameter ``name`` (adapter ``adapter``)."""
    for part in ("lora_A", "lora_B"):
        name = name.replace(f".{part}.{adapter}.", f".{part}.")
    return PREFIX + name


class AdapterWeights:
    """A PEFT adapter file's tensors, read one EPS entry at a time."""

    def __init__(self, directory: str | Path) -> None:
        self.path = Path(directory) / ADAPTER_WEIGHTS
        self.tensors = stored_tensors_of(self.path)

    def entry(self, layout, keys: list[str]) -> np.ndarray:
        from safetensors import safe_open
        flat = np.empty(layout.numel, np.float32)
        into = torch.from_numpy(flat)
        with safe_open(str(self.path), framework="pt") as f:
            for slot, key in zip(layout.slots, keys):
                stored = self.tensors.get(key)
                if stored is None:
                    raise UserError(f"{self.path}: no tensor {key!r} (adapter of another model or targets?)")
                if stored.shape != tuple(slot.shape):
                    raise UserError(f"{self.path}: tensor {key!r} has shape {stored.shape}, the run's adapter "
                                    f"{tuple(slot.shape)}")
                into[slot.offset:slot.offset + slot.numel].copy_(f.get_tensor(key).reshape(-1))
        return flat
