"""Replayable randomness: the same dropout masks in forward and in recompute.

Each (step, layer, micro-batch) gets its own seed derived from the run seed;
forward and backward-recompute enter the same scope, so they draw the same
masks on the relay's device (CPU or CUDA generator). The global RNG streams
are left as they were. A resumed run re-derives the same seeds, so no
generator state needs checkpointing.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from ..seeds import derive_seed  # noqa: F401  (the relay's seeds are derived here, too)


@contextmanager
def replay_rng(device: torch.device, seed: int) -> Iterator[None]:
    """Draw from a generator seeded with ``seed``, then put the generator back as it was.

    On CUDA only the device's generator is saved, seeded and restored: dropout on
    the GPU draws from it alone, and ``torch.random.fork_rng`` would also save and
    restore the CPU generator on every micro-batch of every layer for nothing.
    """
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        generator = torch.cuda.default_generators[index]
        state = generator.get_state()
        generator.manual_seed(seed)
        try:
            yield
        finally:
            generator.set_state(state)
    else:
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            yield
