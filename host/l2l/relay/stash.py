"""Where micro-batch boundary tensors wait between forward and backward.

Policy ``device`` keeps them on the device: the footprint grows with depth x
micro-batches. Policy ``host`` sends each one to host memory as soon as it is
produced and brings it back just before it is consumed, so the device holds
one micro-batch's boundary at a time: constant in depth and in micro-batch
count (the paper's constant-memory variant).

With an asynchronous transport (CUDA streams, or the threaded CPU pipeline)
the copies overlap compute: the copy out is issued on the copy-out stream as
soon as the tensor is produced, and, given the relay's access ``schedule``
(the groups of keys each compute call reads, in order), the store brings the
next group back on the copy-in stream while the current one computes. One
group ahead, so the device still holds a constant number of boundaries.
"""
from __future__ import annotations

from typing import Hashable, Sequence

import torch

from .ledger import MemoryLedger
from .transport import PendingTensor

POLICIES = ("device", "host")


class BoundaryStore:
    def __init__(self, policy: str, transport, ledger: MemoryLedger,
                 schedule: Sequence[Sequence[Hashable]] = ()) -> None:
        if policy not in POLICIES:
            raise ValueError(f"stash policy must be one of {POLICIES}")
        self.policy = policy
        self.transport = transport
        self.ledger = ledger
        self._items: dict[Hashable, object] = {}
        self._nbytes: dict[Hashable, int] = {}
        self._kind = "stash" if policy == "device" else "host_stash"
        self._schedule = [list(g) for g in schedule] if policy == "host" and transport.asynchronous else []
        self._cursor = -1
        self._ahead: dict[Hashable, PendingTensor] = {}  # prefetched copies on the device

    def put(self, key: Hashable, t: torch.Tensor) -> None:
        t = t.detach()
        n = t.numel() * t.element_size()
        if self.policy == "host":
            t = self.transport.to_host(t)
        self._items[key] = t
        self._nbytes[key] = n
        self.ledger.add(self._kind, n)

    def get(self, key: Hashable) -> torch.Tensor:
        """The tensor on the device; it stays stored."""
        return self._serve(key, consume=False)

    def pop(self, key: Hashable) -> torch.Tensor:
        """The tensor on the device; the store forgets it."""
        return self._serve(key, consume=True)

    def _serve(self, key: Hashable, consume: bool) -> torch.Tensor:
        self._advance(key)
        item = self._items.pop(key) if consume else self._items[key]
        if consume:
            self.ledger.sub(self._kind, self._nbytes.pop(key))
        if self.policy == "device":
            return item
        pending = self._ahead.pop(key, None)
        if pending is not None:
            self.ledger.sub("stash_prefetch", pending.nbytes)
        else:
            pending = self.transport.to_device(item)
        if consume:
            self.transport.release(item, pending)
        return pending.wait()

    def _advance(self, key: Hashable) -> None:
        """Move the schedule's cursor to the group holding ``key``; on arriving at a
        new group, bring the next group's tensors back ahead of their use."""
        if not self._schedule:
            return
        c = max(self._cursor, 0)
        while c < len(self._schedule) and key not in self._schedule[c]:
            c += 1
        if c == len(self._schedule) or c == self._cursor:
            return
        self._cursor = c
        for nxt in self._schedule[c + 1] if c + 1 < len(self._schedule) else ():
            if nxt in self._items and nxt not in self._ahead:
                pending = self.transport.to_device(self._items[nxt])
                self._ahead[nxt] = pending
                self.ledger.add("stash_prefetch", pending.nbytes)

    @property
    def host_side(self) -> list[object]:
        """The containers whose tensors are host memory (booked as ``host_stash``): the
        stored items under policy ``host``, none under ``device``. What the store has
        brought back ahead of use is on the device either way. ``relay/audit.py``
        leaves these out of its measurement of device memory."""
        return [self._items] if self.policy == "host" else []

    def __len__(self) -> int:
        return len(self._items)
