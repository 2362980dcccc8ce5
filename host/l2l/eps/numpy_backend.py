"""The NumPy EPS: state in host DRAM, arithmetic by :mod:`l2l.eps.numerics` (the golden model),
on every core this process may use (:mod:`l2l.eps.threads`), with one thread's bits."""
from __future__ import annotations

import threading
from typing import Sequence

import numpy as np

from . import numerics
from .backend import EpsBackend, HostState, adoptable, check_copy, check_optimizer, check_step
from .contract import LambStep, StepScalars
from .threads import RangePool, available_cpus


class NumpyBackend(HostState, EpsBackend):
    name = "numpy"
    optimizers = frozenset({"adamw", "lion", "lamb"})

    @classmethod
    def shares_masters(cls, **options) -> bool:
        return True

    def __init__(self, threads: int | None = None, grain: int = numerics.CHUNK) -> None:
        """``threads``: how many threads compute an update (default: every CPU in this
        process's affinity mask); ``grain``: the elements a thread's range is a multiple of."""
        self.threads = threads or available_cpus()
        self._pool = RangePool(self.threads, grain)
        self._state: dict[int, tuple[np.ndarray, ...]] = {}  # layer -> (p, *moments)
        self._local = threading.local()  # per-thread scratch: no allocation per update

    def describe(self) -> str:
        return f"{self.threads} CPU thread{'s' if self.threads > 1 else ''}"

    def _scratch(self):
        if not hasattr(self._local, "scratch"):
            self._local.scratch = numerics.make_scratch()
        return self._local.scratch

    def _reduced(self, n: int) -> np.ndarray:
        """A reduced-gradient buffer of ``n`` elements, shared by all layers of this thread."""
        buf = getattr(self._local, "reduced", None)
        if buf is None or buf.shape[0] < n:
            buf = self._local.reduced = np.empty(n, np.float32)
        return buf[:n]

    def allocate(self, layer: int, p: np.ndarray, moments: int = 2) -> None:
        p = np.array(p, dtype=np.float32, copy=True)
        self._state[layer] = (p,) + tuple(np.zeros_like(p) for _ in range(moments))

    def adopt(self, layer: int, p: np.ndarray, *moments: np.ndarray) -> None:
        """Takes the arrays themselves when they are writable contiguous fp32 vectors: no copy."""
        self._state[layer] = tuple(adoptable(a) for a in (p, *moments))

    def master_as_copy(self, layer: int) -> np.ndarray:
        return self._state[layer][0]


    def step(self, layer: int, grads: Sequence[np.ndarray], scalars: StepScalars,
             copy_out: np.ndarray, n_decay: int | None = None) -> bool:
        state = self._state[layer]
        n = state[0].shape[0]
        check_step(grads, copy_out, n, n_decay)  # the ranges below see only slices of the arguments
        check_optimizer(self, scalars, len(state) - 1)
        rule = None if isinstance(scalars, LambStep) else numerics.update_rule(scalars)
        g = numerics.unreduced(grads, scalars.inv_scale, n)  # one unscaled contribution: itself, widened per chunk
        if g is not None:
            finite = self._pool.map(lambda lo, hi: numerics.all_finite(g[lo:hi]), n)
        else:
            g = self._reduced(n)
            finite = self._pool.map(lambda lo, hi: numerics.reduce_gradients(
                [c[lo:hi] for c in grads], scalars.inv_scale, g[lo:hi]), n)
        if not all(finite):  # every range checked before any is updated: a refused step changes nothing
            return False
        copy = None if copy_out is state[0] else copy_out
        n_decay = n if n_decay is None else n_decay
        if isinstance(scalars, LambStep):
            self._lamb(state, g, scalars, copy, n_decay)
            return True

        def update(lo: int, hi: int) -> None:
            rule(*(a[lo:hi] for a in state), g[lo:hi], scalars,
                 copy_out=None if copy is None else copy[lo:hi], scratch=self._scratch(),
                 n_decay=numerics.decayed_part(lo, hi, n_decay))
        self._pool.map(update, n)
        return True

    def _lamb(self, state, g, step: LambStep, copy, n_decay: int) -> None:
        """LAMB's two passes, each thread taking the segments that start in its range (whole
        segments: a thread's range may cut one, its sums may not be cut)."""
        p, m, v = state
        seg = step.segments
        sums = np.zeros((seg.count, 2, numerics.LANES), np.float32)

        def mine(lo: int, hi: int) -> tuple[int, int]:
            return (int(np.searchsorted(seg.bounds[:-1], lo)), int(np.searchsorted(seg.bounds[:-1], hi)))

        def norms(lo: int, hi: int) -> None:
            first, last = mine(lo, hi)
            numerics.lamb_norms(p, m, v, g, step.scalars, seg, n_decay=n_decay, first=first, last=last,
                                out=sums, scratch=self._scratch())
        self._pool.map(norms, p.shape[0])
        steps = step.steps(sums)

        def apply(lo: int, hi: int) -> None:
            first, last = mine(lo, hi)
            numerics.lamb_apply(p, m, v, step.scalars, seg, steps, copy_out=copy, n_decay=n_decay,
                                first=first, last=last, scratch=self._scratch())
        self._pool.map(apply, p.shape[0])

    def write_copy(self, layer: int, copy_out: np.ndarray) -> None:
        p = self._state[layer][0]
        check_copy(copy_out, p.shape[0])
        if copy_out is not p:  # the master serving as its own copy is already written
            self._pool.map(lambda lo, hi: numerics.device_copy(p[lo:hi], copy_out[lo:hi]), p.shape[0])


    def close(self) -> None:
        self._pool.close()
