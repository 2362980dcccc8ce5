"""Replayable randomness: the same dropout masks in forward and in recompute.

Each (step, layer, micro-batch) gets its own seed derived from the run seed;
forward and backward-recompute enter the same scope, so they draw the same
masks on the relay's device (CPU or CUDA generator). The global RNG streams
are left as they were. A resumed run re-derives the same seeds, so no
generator state needs checkpointing.
"""
from __future__ import annotations

import hashlib
from contextlib import contextmanager
from typing import Iterator

import torch


def derive_seed(base: int, *key: int) -> int:
    digest = hashlib.blake2b(repr((base, *key)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


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
