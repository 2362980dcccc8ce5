"""What an EPS backend is: a place where layer state lives and an update runs.

The :class:`~l2l.eps.server.EagerParamServer` owns the bookkeeping (step
counts, scalars, eagerness, errors); a backend owns only storage and
arithmetic, so a backend whose state lives in another memory (an FPGA
card's DRAM behind OpenCL) fits the same interface: gradients go in as host
arrays, device copies come out into host arrays, and state crosses only for
checkpoints.

A layer's state is its fp32 master weights ``p`` and the optimizer's moments, all of ``n``
binary32 elements: ``(p, m, v)`` for AdamW, ``(p, m)`` for Lion
(:data:`~l2l.eps.contract.OPTIMIZERS`). The step scalars' type says which optimizer a step
runs; a backend lists those it runs in :attr:`EpsBackend.optimizers`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Sequence

import numpy as np

from .contract import StepScalars, optimizer_of
from .numerics import COPY_DTYPES, GRAD_DTYPES


class EpsBackend(ABC):
    name: ClassVar[str]
    optimizers: ClassVar[frozenset[str]] = frozenset({"adamw"})  # those whose updates it runs
    probe_numel: ClassVar[int] = 4 << 20  # the layer the planner's rate probe updates (l2l.planner.measure)

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        """(usable here, one-line reason); shown by ``l2l info``."""
        return True, "ok"

    def describe(self) -> str:
        """What this instance runs on, in a few words (a run's first lines, summary.json)."""
        return self.name
    @classmethod
    def shares_masters(cls, **options) -> bool:
        """Whether one built with ``options`` gives its masters as the CPU device's fp32 copies
        (:meth:`master_as_copy`), said without building one: the planner counts the copies by
        it. Default: no."""
        return False

    @abstractmethod
    def allocate(self, layer: int, p: np.ndarray, moments: int = 2) -> None:
        """Create the layer's state: master weights ``p`` (fp32) and ``moments`` zero moments."""

    @abstractmethod
    def step(self, layer: int, grads: Sequence[np.ndarray], scalars: StepScalars,
             copy_out: np.ndarray, n_decay: int | None = None) -> bool:
        """Reduce ``grads`` (K arrays of n, or one (K, n) array), and if all finite
        update the layer by the optimizer of ``scalars`` and write its device copy. Weight decay applies to the layer's first
        ``n_decay`` elements (default: all of them; the parameter groups, decayed first).

        Returns the finite flag; when False nothing of the layer changed.
        """

    @abstractmethod
    def write_copy(self, layer: int, copy_out: np.ndarray) -> None:
        """Write the device copy of the current master weights (after allocate/load)."""

    @abstractmethod
    def read_state(self, layer: int) -> tuple[np.ndarray, ...]:
        """Host copies of ``(p, *moments)`` for a checkpoint."""

    def read_master(self, layer: int) -> np.ndarray:
        """A host copy of the layer's fp32 master weights ``p`` alone (the trained weights, for
        an export or a comparison): a backend moves ``p`` only, not the moments (a third of
        :meth:`read_state`'s traffic). The default is :meth:`read_state`'s ``p``."""
        return self.read_state(layer)[0]

    def state_view(self, layer: int) -> tuple[np.ndarray, ...]:
        """``(p, *moments)`` to read now and drop before the next step: a backend that keeps the
        state in host memory returns its own arrays, read-only, so a checkpoint copies nothing
        it does not write; the default is :meth:`read_state`'s copies."""
        return self.read_state(layer)

    @abstractmethod
    def write_state(self, layer: int, p: np.ndarray, *moments: np.ndarray) -> None:
        """Replace the layer's state (from a checkpoint): as many moments as it has."""

    def master_as_copy(self, layer: int) -> np.ndarray | None:
        """The layer's fp32 master weights themselves, to serve as its fp32 device copy where
        the device computes in host memory (the CPU): the copy would be a duplicate, 4 bytes
        a parameter. Only a backend that keeps ``p`` in host memory for the whole run, and
        updates it in place, can give it; the default is None (the server keeps a copy)."""
        return None

    def adopt(self, layer: int, p: np.ndarray, *moments: np.ndarray) -> None:
        """Take ``(p, *moments)`` as the layer's state, as if allocated and loaded (a disk tier hands
        a layer in just before its update). The caller does not use the arrays again, so a
        backend keeping its state in host memory may take them without a copy; the default
        allocates and writes them."""
        self.allocate(layer, p, len(moments))
        self.write_state(layer, p, *moments)

    def release(self, layer: int) -> None:  # noqa: B027 -- optional: a backend may keep everything
        """Drop the layer's state from this backend's memory (a disk tier holds it); the layer is
        unknown here until the next :meth:`allocate` or :meth:`adopt`. Default: keep it."""

    def expect(self, order: list[int]) -> None:  # noqa: B027 -- a hint: only a disk tier reads ahead
        """The next updates come in this entry order (held steps commit in ascending order); a
        backend that reads state ahead of its updates reads in this order. Default: ignored."""

    def disk_ledger(self, *, settle: bool):
        """A backend whose state is in files (the disk tier): its own account of that I/O
        (:class:`~l2l.eps.disk_tier.IoLedger`), after its pending writes when ``settle``;
        None for state in memory."""
        return None

    def close(self) -> None:  # noqa: B027 -- optional: most backends hold nothing to release
        """Release device resources."""


class HostState:
    """State access for a backend whose layers' ``(p, *moments)`` are host arrays in
    ``self._state`` (NumPy, the HLS C-simulation): checkpoints read and write them directly."""

    _state: dict[int, tuple[np.ndarray, ...]]

    def release(self, layer: int) -> None:
        self._state.pop(layer, None)

    def read_state(self, layer: int):
        return tuple(a.copy() for a in self._state[layer])

    def read_master(self, layer: int) -> np.ndarray:
        return self._state[layer][0].copy()

    def state_view(self, layer: int):
        return tuple(read_only(a) for a in self._state[layer])

    def write_state(self, layer: int, p: np.ndarray, *moments: np.ndarray) -> None:
        state = self._state[layer]
        check_state(layer, (p, *moments), state[0].shape[0], len(state) - 1)
        for dst, src in zip(state, (p, *moments)):
            dst[...] = src


def check_step(grads, copy_out: np.ndarray, n: int, n_decay: int | None = None) -> None:
    """A step's arguments against the contract, all checked before anything is written:
    K >= 1 contributions of one gradient dtype and ``n`` elements each, a writable device copy
    of ``n`` elements in a copy dtype, a decay boundary in ``[0, n]``. ValueError names the
    first that is wrong."""
    if n_decay is not None and not 0 <= n_decay <= n:
        raise ValueError(f"n_decay {n_decay} outside [0, {n}]")
    if len(grads) == 0:
        raise ValueError("at least one gradient contribution")
    if len({np.dtype(g.dtype) for g in grads}) != 1:
        raise ValueError("gradient contributions must share one dtype")
    if np.dtype(grads[0].dtype) not in GRAD_DTYPES.values():
        raise ValueError(f"gradient of dtype {grads[0].dtype}; expected float32, bfloat16 or float16")
    for g in grads:
        if g.shape != (n,):
            raise ValueError(f"gradient of shape {g.shape}, expected ({n},)")
    check_copy(copy_out, n)


def check_copy(copy_out: np.ndarray, n: int) -> None:
    """A device copy to write: a copy dtype, ``n`` elements, writable."""
    if copy_out.dtype not in COPY_DTYPES.values():
        raise ValueError(f"device copy of dtype {copy_out.dtype}; expected float32, bfloat16 or float16")
    if copy_out.shape != (n,):
        raise ValueError(f"device copy of shape {copy_out.shape}, expected ({n},)")
    if not copy_out.flags.writeable:
        raise ValueError("device copy is read-only")


def check_state(layer: int, arrays, n: int, moments: int) -> None:
    """State to write: ``p`` and ``moments`` moments, each ``n`` elements. Checked before any
    is written: no half-loaded layer."""
    if len(arrays) != 1 + moments:
        raise ValueError(f"layer {layer}: {len(arrays) - 1} moments given, the layer has {moments}")
    for a in arrays:
        if np.shape(a) != (n,):
            raise ValueError(f"layer {layer}: state of shape {np.shape(a)}, expected ({n},)")


def check_optimizer(backend: "EpsBackend", scalars, moments: int) -> None:
    """A step's optimizer against the backend's and the layer's state."""
    opt = optimizer_of(scalars)
    if opt.name not in backend.optimizers:
        raise ValueError(f"the {backend.name} EPS does not run {opt.name}")
    if len(opt.moments) != moments:
        raise ValueError(f"a {opt.name} step on a layer with {moments} moments")


def lamb_bounds(step, n: int) -> np.ndarray:
    """A LAMB step's segment bounds as kernels take them (``seg``): uint32[nseg + 1] from 0 to
    ``n``, non-decreasing; ValueError before any kernel runs when they are not."""
    bounds = np.asarray(step.segments.bounds)
    if bounds.ndim != 1 or bounds.shape[0] < 2 or bounds[0] != 0 or bounds[-1] != n \
            or np.any(np.diff(bounds) < 0):
        raise ValueError(f"LAMB segments {bounds.tolist()[:8]}... do not cover a layer of {n} elements")
    if bounds.shape[0] - 1 != step.segments.count:
        raise ValueError(f"LAMB segments: {bounds.shape[0]} bounds for {step.segments.count} segments")
    return np.ascontiguousarray(bounds, dtype=np.uint32)  # every bound <= n < 2**32: exact


def read_only(a: np.ndarray) -> np.ndarray:
    """A view of ``a`` that cannot be written through."""
    view = a.view()
    view.flags.writeable = False
    return view


def adoptable(a: np.ndarray) -> np.ndarray:
    """``a`` itself when a host-memory backend may keep and update it in place (a writable
    contiguous fp32 vector), else such a copy of it: what :meth:`EpsBackend.adopt` takes."""
    if a.dtype == np.float32 and a.ndim == 1 and a.flags.c_contiguous and a.flags.writeable:
        return a
    return np.array(a, dtype=np.float32, copy=True).reshape(-1)
