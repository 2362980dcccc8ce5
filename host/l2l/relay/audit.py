"""Device memory measured, not only booked: what the relay can reach, against its ledger.

On the CPU device ``device_peak_bytes`` is the relay's own ledger
(``ledger.py``): bytes booked where the relay fetches, stashes and releases.
This module measures the same thing independently, without reading the
ledger: it walks the engine's object graph, collects every tensor on the
engine's device that the relay can reach, and sums the bytes of their
storages (overlapping storages counted once). At a layer boundary
(``RelayEngine.boundary_hooks``) that is the relay's working set -- fetched,
prefetched and resident layer weights, gradient buffers, the device stash and
stashed tensors brought back ahead of use -- and it must equal the ledger's
current device bytes. A stash that keeps a tensor after the ledger released
it, or weights uploaded without being booked, make the two differ.

The walk descends generically into dicts, lists, tuples, sets, deques and
instances of classes defined in the ``l2l`` package or derived from one
(through ``__dict__`` and ``__slots__``), and into a leaf tensor's ``.grad``. It does not descend into
functions, bound methods, modules, threads, executors, locks or any other
object, torch's included (an autograd graph, an ``nn.Module``). It stops at --
by structure, never by asking the ledger -- what is not the relay's device
working set:

* the model template: ``engine.stack``, ``engine.layers`` and each layer,
  ``engine.bindings`` and each binding. Their parameters are meta
  placeholders; their buffers (a causal mask, say) are moved to the device once
  at construction and belong to the model, not to a step. A fetched layer
  refers to its template layer and binding, so they are stops wherever met.
* the EPS (``engine.eps``): the master weights, optimizer state, device copies
  and gradient inboxes are host arrays. On the CPU a fetched layer's weights and
  gradient buffer are zero-copy views of the EPS's device copy and inbox; they
  are counted where the relay holds them (the fetched layer), not through the
  EPS.
* the ledger (``engine.ledger``): the thing under test is never read.
* the transport's host-side pools (``transport.pool``, ``transport.pinned``):
  reusable host staging buffers for the host stash and for pinned uploads.
* with stash policy ``host``, the store's stored items
  (:attr:`BoundaryStore.host_side`): host copies, booked as ``host_stash``.
  (On the CPU transport the "host" copy is the tensor itself; the relay still
  treats it as host memory.) Tensors the store has brought back ahead of use
  are device tensors and are counted.

Not reachable from the engine, hence outside the measurement (and outside the
ledger too): ``train_step``'s locals -- the step's input micro-batches
(token ids and targets), the running loss, the recorded forward graphs
(``recompute.Recording``; each holds a 0-d root tensor and no data) -- and
tensors a transport's copy thread holds while a copy is in flight. The engine
drops its locals that refer to released layers before each boundary.
"""
from __future__ import annotations

import collections
from typing import Callable

import torch

_CONTAINERS = (dict, list, tuple, set, frozenset, collections.deque)


def _is_l2l(obj: object) -> bool:
    """An instance of a class of the ``l2l`` package, or of a subclass of one (a
    user's stash or transport built on the package's)."""
    return any((c.__module__ or "").split(".")[0] == "l2l" for c in type(obj).__mro__)


def _stops(engine) -> set[int]:
    """ids of the objects the walk does not enter (see the module docstring)."""
    stops = [engine.stack, engine.layers, *engine.layers, engine.bindings, *engine.bindings,
             engine.eps, engine.ledger]
    for name in ("pool", "pinned"):
        stops.append(getattr(engine.transport, name, None))
    store = getattr(engine, "_store", None)
    if store is not None:
        stops.extend(store.host_side)
    return {id(o) for o in stops if o is not None}


def _on(device: torch.device, t: torch.Tensor) -> bool:
    if t.device.type != device.type or t.device.type == "meta":
        return False
    if device.index is None or t.device.index is None:
        return True
    return t.device.index == device.index


def reachable_tensors(engine) -> list[torch.Tensor]:
    """Every tensor on ``engine.device`` reachable from ``engine``, the stops aside."""
    device = engine.device
    stops = _stops(engine)
    seen: set[int] = set()
    found: list[torch.Tensor] = []
    todo: list[object] = [engine]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or id(obj) in stops:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if _on(device, obj):
                found.append(obj)
            if obj.is_leaf and obj.grad is not None:
                todo.append(obj.grad)
        elif isinstance(obj, dict):
            todo.extend(obj.keys())
            todo.extend(obj.values())
        elif isinstance(obj, _CONTAINERS):
            todo.extend(obj)
        elif _is_l2l(obj) and not isinstance(obj, type):
            todo.extend(getattr(obj, "__dict__", {}).values())
            for cls in type(obj).__mro__:
                for slot in getattr(cls, "__slots__", ()):
                    if hasattr(obj, slot):
                        todo.append(getattr(obj, slot))
    return found


def storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the tensors' storages, each byte once (storages that overlap, such as
    two torch views of one host array, are merged as address ranges)."""
    spans = sorted({(s.data_ptr(), s.data_ptr() + s.nbytes())
                    for s in (t.untyped_storage() for t in tensors) if s.nbytes() > 0})
    total, end = 0, None
    for lo, hi in spans:
        if end is None or lo >= end:
            total += hi - lo
            end = hi
        elif hi > end:
            total += hi - end
            end = hi
    return total


def reachable_device_bytes(engine) -> int:
    """Device bytes the relay can reach now (see the module docstring); never reads the ledger."""
    return storage_bytes(reachable_tensors(engine))


class BoundaryAudit:
    """A boundary hook that records, at every layer boundary, the measured device
    bytes beside the ledger's current device bytes.

    ``engine.boundary_hooks.append(BoundaryAudit())``; then ``records`` holds
    ``(phase, layer, measured, booked)`` per boundary and :attr:`worst` the largest
    ``|measured - booked|`` seen (0 when the ledger books exactly what is held).
    """

    def __init__(self) -> None:
        self.records: list[tuple[str, int, int, int]] = []

    def __call__(self, engine, phase: str, layer: int) -> None:
        self.records.append((phase, layer, reachable_device_bytes(engine), engine.ledger.device_bytes()))

    @property
    def worst(self) -> int:
        return max((abs(m - b) for _, _, m, b in self.records), default=0)

    def mismatches(self) -> list[tuple[str, int, int, int]]:
        return [r for r in self.records if r[2] != r[3]]


def audited(engine) -> BoundaryAudit:
    """Attach a :class:`BoundaryAudit` to ``engine`` and return it."""
    audit = BoundaryAudit()
    hooks: list[Callable] = engine.boundary_hooks
    hooks.append(audit)
    return audit
