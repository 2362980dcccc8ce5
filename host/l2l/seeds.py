"""Seeds derived from the run's one seed: a stream of its own for each use (a layer's
initial weights, a micro-batch's dropout masks), independent of the order they are drawn in."""
from __future__ import annotations

import hashlib


def derive_seed(base: int, *key: int | str) -> int:
    """A 63-bit seed for ``key`` under the run seed ``base``."""
    digest = hashlib.blake2b(repr((base, *key)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)
