"""The frozen base of a LoRA run: every base weight once, in bf16 (or fp16), on the host.

Nothing trains these weights, so they need no fp32 master and no optimizer state: 2 bytes a
parameter instead of the EPS's 12-16. They are read from the model directory's safetensors
one tensor at a time (``models/weight_files.py``) and converted as they arrive, so the host
never holds more than the store plus one tensor in its stored dtype -- never the fp32 model.
A tied weight (input and output embedding) is one tensor here, bound in both layers.
The relay asks for a layer's frozen weights when it fetches the layer
(:meth:`FrozenBase.tensors`); they go to the device in the store's dtype and are cast
to the compute dtype there.
"""
from __future__ import annotations

import torch

from ..models.weight_files import SafetensorsWeights

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class FrozenBase:
    def __init__(self, weights: SafetensorsWeights, layers: list[dict[str, str]], dtype: str) -> None:
        """``layers[i]``: layer ``i``'s frozen parameter names -> the stored tensor names (checked)."""
        self.layers = layers
        self.dtype = DTYPES[dtype]
        self.store: dict[str, torch.Tensor] = {}
        for names in layers:
            for key in names.values():
                if key not in self.store:
                    t = weights.read(key)
                    # a copy of its own even when the file's dtype is the store's: a tensor read
                    # from safetensors may map the file, which could change under the run
                    self.store[key] = t.to(self.dtype, copy=True)
                    del t

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.store.values())

    @property
    def numel(self) -> int:
        return sum(t.numel() for t in self.store.values())

    def tensors(self, i: int, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Layer ``i``'s frozen weights on ``device`` in ``dtype`` (moved, then cast there)."""
        return {name: self.store[key].to(device).to(dtype) for name, key in self.layers[i].items()}

    def __deepcopy__(self, memo):  # a skeleton stack (another worker) shares the one store
        return self
