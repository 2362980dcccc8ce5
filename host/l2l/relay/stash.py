"""Where micro-batch boundary tensors wait between forward and backward.

Policy ``device`` keeps them on the device: the footprint grows with depth x
micro-batches. Policy ``host`` sends each one to host memory as soon as it is
produced and brings it back just before it is consumed, so the device holds
one micro-batch's boundary at a time: constant in depth and in micro-batch
count (the paper's constant-memory variant).
"""
from __future__ import annotations

from typing import Hashable

import torch

from .ledger import MemoryLedger

POLICIES = ("device", "host")


class BoundaryStore:
    def __init__(self, policy: str, transport, ledger: MemoryLedger) -> None:
        if policy not in POLICIES:
            raise ValueError(f"stash policy must be one of {POLICIES}")
        self.policy = policy
        self.transport = transport
        self.ledger = ledger
        self._items: dict[Hashable, torch.Tensor] = {}
        self._kind = "stash" if policy == "device" else "host_stash"

    def put(self, key: Hashable, t: torch.Tensor) -> None:
        t = t.detach()
        if self.policy == "host":
            t = self.transport.to_host(t)
        self._items[key] = t
        self.ledger.add(self._kind, _nbytes(t))

    def get(self, key: Hashable) -> torch.Tensor:
        """The tensor on the device; it stays stored."""
        t = self._items[key]
        return t if self.policy == "device" else self.transport.to_device(t)

    def pop(self, key: Hashable) -> torch.Tensor:
        t = self._items.pop(key)
        self.ledger.sub(self._kind, _nbytes(t))
        return t if self.policy == "device" else self.transport.to_device(t)

    def __len__(self) -> int:
        return len(self._items)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
