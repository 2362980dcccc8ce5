"""The frozen base of a LoRA run: every base weight once, in bf16 (or fp16), on the host.

Nothing trains these weights, so they need no fp32 master and no optimizer state: 2 bytes a
parameter instead of the EPS's 12-16. They are read from the model directory's safetensors
one tensor at a time (``models/weight_files.py``) and converted as they are copied in, so the
host never holds more than the store plus one tensor in its stored dtype -- never the fp32
model. A tied weight (input and output embedding) is one array here, bound in both layers.

The relay sends a layer's frozen weights to the device beside its EPS weights, through the same
transport (``relay/engine.py``): on CUDA from pinned memory on the copy-in stream, prefetched a
layer ahead -- the relay moves the store into its transport's host memory once
(:meth:`FrozenBase.rehome`) -- and on the CPU as zero-copy views; there they are cast to the
compute dtype.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from ..eps.numerics import COPY_DTYPES
from ..hostmem import aligned_empty
from ..models.weight_files import SafetensorsWeights
from ..relay.transport import as_torch

DTYPES = {"bf16": COPY_DTYPES["bf16"], "fp16": COPY_DTYPES["fp16"]}  # the store's NumPy dtypes

HostAlloc = Callable[[int, np.dtype], np.ndarray]


class FrozenBase:
    def __init__(self, weights: SafetensorsWeights, layers: list[dict[str, str]], dtype: str,
                 alloc: HostAlloc = aligned_empty) -> None:
        """``layers[i]``: layer ``i``'s frozen parameter names -> the stored tensor names (checked)."""
        self.layers = layers
        self.dtype = DTYPES[dtype]
        self.store: dict[str, np.ndarray] = {}   # stored name -> its flat array
        self.shapes: dict[str, tuple[int, ...]] = {}
        for names in layers:
            for key in names.values():
                if key not in self.store:
                    t = weights.read(key)  # may map the file: copied out at once, converted as it is
                    flat = alloc(t.numel(), self.dtype)
                    as_torch(flat).copy_(t.reshape(-1))
                    self.store[key], self.shapes[key] = flat, tuple(t.shape)
                    del t

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.store.values())

    @property
    def numel(self) -> int:
        return sum(a.size for a in self.store.values())

    def rehome(self, alloc: HostAlloc) -> None:
        """Move every array into memory from ``alloc`` (a CUDA transport's pinned memory, which its
        asynchronous copies need), one at a time: the host holds one array twice at most."""
        for key, old in self.store.items():
            new = alloc(old.size, self.dtype)
            new[:] = old
            self.store[key] = new
            del old

    def arrays(self, i: int) -> list[tuple[str, np.ndarray, tuple[int, ...]]]:
        """Layer ``i``'s frozen weights: (parameter name, flat host array, shape), in a fixed order."""
        return [(name, self.store[key], self.shapes[key]) for name, key in self.layers[i].items()]

    def __deepcopy__(self, memo):  # a skeleton stack (another worker) shares the one store
        return self
