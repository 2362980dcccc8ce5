"""What an EPS backend is: a place where layer state lives and an update runs.

The :class:`~l2l.eps.server.EagerParamServer` owns the bookkeeping (step
counts, scalars, eagerness, errors); a backend owns only storage and
arithmetic, so a backend whose ``p, m, v`` live in another memory (an FPGA
card's DRAM behind OpenCL) fits the same interface: gradients go in as host
arrays, device copies come out into host arrays, and state crosses only for
checkpoints.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Sequence

import numpy as np

from .contract import StepScalars


class EpsBackend(ABC):
    name: ClassVar[str]

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        """(usable here, one-line reason); shown by ``l2l info``."""
        return True, "ok"

    @abstractmethod
    def allocate(self, layer: int, p: np.ndarray) -> None:
        """Create the layer's state: master weights ``p`` (fp32), zero moments."""

    @abstractmethod
    def step(self, layer: int, grads: Sequence[np.ndarray], scalars: StepScalars,
             copy_out: np.ndarray) -> bool:
        """Reduce ``grads`` (K arrays of n, or one (K, n) array), and if all finite
        update the layer and write its device copy.

        Returns the finite flag; when False nothing of the layer changed.
        """

    @abstractmethod
    def write_copy(self, layer: int, copy_out: np.ndarray) -> None:
        """Write the device copy of the current master weights (after allocate/load)."""

    @abstractmethod
    def read_state(self, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Host copies of ``(p, m, v)`` for a checkpoint."""

    def state_view(self, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(p, m, v)`` to read now and drop before the next step: a backend that keeps the
        state in host memory returns its own arrays, read-only, so a checkpoint copies nothing
        it does not write; the default is :meth:`read_state`'s copies."""
        return self.read_state(layer)

    @abstractmethod
    def write_state(self, layer: int, p: np.ndarray, m: np.ndarray, v: np.ndarray) -> None:
        """Replace the layer's state (from a checkpoint)."""

    def close(self) -> None:  # noqa: B027 -- optional: most backends hold nothing to release
        """Release device resources."""


def read_only(a: np.ndarray) -> np.ndarray:
    """A view of ``a`` that cannot be written through."""
    view = a.view()
    view.flags.writeable = False
    return view
