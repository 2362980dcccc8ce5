"""What every training engine is: the one interface the training loop talks to.

Three engines play this role -- the relay (:class:`~l2l.relay.engine.RelayEngine`),
K relay workers on one EPS (:class:`~l2l.relay.parallel.DataParallelRelay`) and
the in-memory baseline (:class:`~l2l.baseline.PlainEngine`) -- and the loop in
:mod:`l2l.train`, the benchmarks and the planner's calibration use only what
:class:`Engine` declares, never an engine's type. :func:`l2l.build.build_engine`
makes the one a :class:`~l2l.config.TrainConfig` asks for.

Checkpoint state is one format for all of them (per layer ``i``: flat fp32
``layer{i}.p``, ``.m``, ``.v`` plus a meta dict with the step counts), so a
run can move between engines.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Mapping, Protocol, runtime_checkable

import numpy as np

from .data import Batch


@dataclass
class StepResult:
    """What one optimizer step reports."""

    loss: float
    tokens: int
    eps_wait_s: float
    device_peak_bytes: int
    device_weight_peak_bytes: int
    loss_scale: float = 1.0      # the scale this step's backward used
    # EPS entries (a layer's own weights, or a tied parameter) whose update was skipped for a
    # non-finite gradient: in eager mode those of the previous step (known when its updates
    # settle), with --overflow strict this step's (all or none); every engine counts so
    skipped_layers: int = 0
    grad_norm: float | None = None   # global gradient norm (--overflow strict, or clipping)
    host_stash_bytes: int = 0        # the host stash's peak this step (--stash host), all workers
    parts: list[float] | None = None  # each worker's share of ``loss``, in worker order (None: one)


@runtime_checkable
class Engine(Protocol):
    """A model being trained: steps, evaluation, its learning rate, its state."""

    name: str  # "l2l" | "plain"

    def train_step(self, batch: Batch, step: int, *, global_targets: int | None = None,
                   skip_blocks: Collection[int] = ()) -> StepResult:
        """One optimizer step over ``batch`` (0-based ``step`` seeds dropout). ``global_targets``:
        the loss's divisor when ``batch`` is this process's shard of a larger batch. ``skip_blocks``:
        the blocks (0-based) the step leaves out, whose state it leaves untouched (``l2l.depth``)."""

    def evaluate(self, batches: list[Batch]) -> float:
        """Mean token loss over ``batches``, without dropout, changing no state."""

    def set_lr(self, lr: float) -> None:
        """The learning rate of the updates from the next step on (the schedule's lever)."""

    def state_tensors(self) -> dict[str, np.ndarray]:
        """Per layer ``layer{i}.p``, ``.m``, ``.v``: flat fp32, the checkpoint's tensors (a snapshot)."""

    def state_arrays(self) -> Mapping[str, np.ndarray]:
        """The same tensors as a checkpoint writes them: possibly made one at a time as they are
        read (:class:`~l2l.checkpoint.LazyArrays`), so read them before the next step."""

    def state_meta(self) -> dict:
        """Everything else a checkpoint needs (step counts, loss scale), JSON-serialisable."""

    def load_state(self, tensors: dict[str, np.ndarray], meta: dict) -> None:
        """Take a checkpoint written by :meth:`state_tensors` and :meth:`state_meta` (any engine's)."""

    def master_weights(self) -> list[np.ndarray]:
        """Flat fp32 master weights per layer."""

    def close(self) -> None:
        """Finish queued work and release workers; the engine is not used afterwards."""
