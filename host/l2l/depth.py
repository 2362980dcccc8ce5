"""Dynamic depth: which blocks a training step runs.

L2L holds only the executing layer on the device, so a step may run any subset of
the blocks at no memory cost: the relay neither fetches nor computes a block left
out, passes its input straight on and its gradient straight back, and the EPS,
given no gradient for it, leaves its weights, moments and step count untouched --
what ``torch.optim.AdamW`` does for a parameter whose ``.grad`` is None.

A *depth policy* is any function ``step -> blocks to leave out`` (0-based block
numbers). It must depend on the step alone, so that a resumed run leaves out the
same blocks the uninterrupted run would have. :class:`LayerDrop` is the built-in
one (``--layer-drop P``); pass your own to :func:`l2l.train.train` as ``depth=``.

LayerDrop here is Fan et al.'s (2019) and fairseq's / transformers' ``layerdrop``:
each block is left out of a step with probability P, independently, and the
blocks that run are not rescaled; evaluation runs every block. The draw for a
step comes from a generator seeded by the run's seed and the step number.
"""
from __future__ import annotations

from collections.abc import Callable, Collection

import numpy as np

from .seeds import derive_seed

DepthPolicy = Callable[[int], Collection[int]]


class LayerDrop:
    """Leave each of ``blocks`` blocks out of a step with probability ``p``, drawn from
    (``seed``, step) alone."""

    def __init__(self, p: float, blocks: int, seed: int = 0) -> None:
        if not 0.0 <= p < 1.0:
            raise ValueError(f"layer-drop probability must be in [0, 1), not {p}")
        self.p = p
        self.blocks = blocks
        self.seed = seed

    def __call__(self, step: int) -> frozenset[int]:
        if self.p == 0.0:
            return frozenset()
        draw = np.random.default_rng(derive_seed(self.seed, "layer-drop", step)).random(self.blocks)
        return frozenset(int(b) for b in np.flatnonzero(draw < self.p))


def blocks_left_out(policy: DepthPolicy, step: int, blocks: int) -> frozenset[int]:
    """What ``policy`` leaves out of ``step``, checked: block numbers in ``0..blocks - 1``."""
    chosen = policy(step)
    try:
        skip = frozenset(int(b) for b in chosen)
    except (TypeError, ValueError):
        raise ValueError(f"a depth policy returns block numbers; at step {step} it returned {chosen!r}") from None
    return checked_skip(skip, blocks, f"the depth policy at step {step}")


def checked_skip(skip: Collection[int], blocks: int, who: str = "a step") -> frozenset[int]:
    """``skip`` as a set of block numbers, refused unless each is one of the model's ``blocks``
    (what every engine's ``train_step(skip_blocks=...)`` takes)."""
    skip = frozenset(skip)
    if not skip <= set(range(blocks)):
        raise ValueError(f"{who} left out blocks {sorted(skip)}, outside the model: its blocks are 0..{blocks - 1}")
    return skip
