"""Bytes the relay holds on the device, by kind, with peaks.

On CUDA the allocator's own peak is the truth and this ledger only adds the
weights-and-gradients figure beside it; on the CPU device, where host and
device memory are one, the ledger is the accounting: it counts what the relay
holds across layer boundaries (layer weights, their gradients, stashed
activations, boundary gradients), not the transient tensors inside one
layer's compute.

Kinds: ``weights`` (fetched layers), ``weights_prefetch`` (a layer's weights
uploaded ahead of their fetch by an asynchronous transport; moved to
``weights`` when fetched), ``grads`` (gradient buffers), ``boundary`` (a
stashed tensor in use by the layer computing), ``stash`` (the device stash),
``stash_prefetch`` (host-stashed tensors brought back ahead of their use) and
``host_stash`` (the host stash). Kinds starting with ``host_`` are host
memory; the others are device memory (:meth:`MemoryLedger.device_bytes`).

``relay/audit.py`` checks this booking against an independent measurement:
the device tensors the relay can reach at each layer boundary.
"""
from __future__ import annotations

from collections import Counter

WEIGHT_KINDS = ("weights", "weights_prefetch", "grads")


class MemoryLedger:
    def __init__(self) -> None:
        self.current: Counter[str] = Counter()
        self.peak = 0
        self.weight_peak = 0
        self.host_stash_peak = 0

    def add(self, kind: str, nbytes: int) -> None:
        self.current[kind] += nbytes
        self._observe()

    def sub(self, kind: str, nbytes: int) -> None:
        self.current[kind] -= nbytes
        if self.current[kind] < 0:
            raise AssertionError(f"ledger went negative for {kind}")

    def device_bytes(self) -> int:
        """Device bytes booked now: every kind but the ``host_`` ones."""
        return sum(v for k, v in self.current.items() if not k.startswith("host_"))

    def _observe(self) -> None:
        self.peak = max(self.peak, self.device_bytes())
        self.weight_peak = max(self.weight_peak, sum(self.current[k] for k in WEIGHT_KINDS))
        self.host_stash_peak = max(self.host_stash_peak, self.current["host_stash"])

    def reset_peaks(self) -> None:
        self.peak = self.weight_peak = self.host_stash_peak = 0
        self._observe()
