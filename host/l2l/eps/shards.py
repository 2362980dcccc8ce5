"""Which machine owns which part of each EPS entry, when the EPS is sharded.

Each of R machines (ranks) owns a contiguous slice of every entry: its fp32
masters, both moments, the update and the device copy of those elements. Slices
are whole blocks of :data:`BLOCK` elements from the entry's start (the last block
may be short), so an entry of at most one block goes whole to one rank, and a
block never straddles two ranks: the per-block sums of squares behind the global
gradient norm are the same numbers whatever R is (``docs/eps-numerics.md``).

An entry's blocks are split as evenly as whole blocks allow; the ranks that take
an extra block (or the one that takes a small entry whole) are those holding the
fewest elements so far, ties to the lowest rank, in entry order: a deterministic
function of the entry sizes and R, which every rank computes for itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

BLOCK = 1 << 16  # elements; 256 KiB of fp32


@dataclass(frozen=True)
class Slice:
    lo: int
    hi: int

    @property
    def numel(self) -> int:
        return self.hi - self.lo


class ShardLayout:
    """The owners of every entry's slices, for ``world`` ranks (entries with no
    elements have no owner: they never reach a backend)."""

    def __init__(self, numels: Mapping[int, int], world: int, block: int = BLOCK) -> None:
        if world < 1:
            raise ValueError("world must be >= 1")
        if block < 1:
            raise ValueError("block must be >= 1")
        self.world = world
        self.block = block
        self.numels = dict(numels)
        self._slices: dict[int, list[Slice]] = {}
        load = [0] * world
        for entry in sorted(self.numels):
            n = self.numels[entry]
            blocks = -(-n // block)
            base, extra = divmod(blocks, world)
            takers = set(sorted(range(world), key=lambda r: (load[r], r))[:extra])
            slices, lo = [], 0
            for r in range(world):
                hi = min(n, lo + (base + (r in takers)) * block)
                slices.append(Slice(lo, hi))
                load[r] += hi - lo
                lo = hi
            self._slices[entry] = slices
        self.held = load  # elements each rank owns

    def slices(self, entry: int) -> list[Slice]:
        """Every rank's slice of ``entry``, by rank (empty ones included)."""
        return self._slices[entry]

    def slice_of(self, entry: int, rank: int) -> Slice:
        return self._slices[entry][rank]

    def owners(self, entry: int) -> list[int]:
        """The ranks holding a non-empty slice of ``entry``, in element order."""
        return [r for r, s in enumerate(self._slices[entry]) if s.numel]
