"""Many machines: one EPS per machine, agreeing through torch.distributed.

Launched with ``torchrun`` (or any launcher that sets ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT``). Every machine runs the same relay over its
shard of the global batch, and its EPS reduces the box's contributions as
usual; then, on the EPS worker thread, the box's summed gradient of each layer
is all-reduced (sum) across machines with gloo before the update, so every
machine applies the same update to the same bits. The all-reduce of one layer
runs on the EPS thread while the relay goes on with the next layer's backward.

Gloo, not NCCL: the reduced gradient lives in host memory (the EPS), so the
collective moves host tensors. Two process groups keep the two threads apart:
the EPS thread's gradient all-reduces on one, the training loop's loss sum and
weight checksums on the other, so their collectives never interleave.

A machine that dies makes a collective on the others fail (the connection
closes) or time out (``L2L_DIST_TIMEOUT`` seconds, default 30): they stop with
one line (:class:`~l2l.errors.PeerLostError`, exit code 1), never hang.
Checkpoints are written by rank 0 only and hold the global state, so a run
resumes with any number of machines.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch

from .errors import PeerLostError, UserError


@dataclass
class Dist:
    rank: int
    world: int
    grad_group: object   # the EPS thread's collectives
    main_group: object   # the training loop's collectives
    timeout_s: float


_CURRENT: Dist | None = None


def current() -> Dist | None:
    return _CURRENT


def setup() -> Dist | None:
    """Join the process group when launched as one of several ranks; None for one process."""
    global _CURRENT
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return None
    if _CURRENT is not None:
        return _CURRENT
    import torch.distributed as dist
    for var in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        if var not in os.environ:
            raise UserError(f"WORLD_SIZE={world} but {var} is not set: launch with torchrun")
    timeout_s = float(os.environ.get("L2L_DIST_TIMEOUT", "30"))
    try:
        dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
        grad_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise PeerLostError(f"could not join the {world} machines at "
                            f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}: {_first_line(exc)}") from None
    _CURRENT = Dist(rank=dist.get_rank(), world=world, grad_group=grad_group,
                    main_group=dist.group.WORLD, timeout_s=timeout_s)
    return _CURRENT


def teardown() -> None:
    global _CURRENT
    if _CURRENT is not None:
        import torch.distributed as dist
        dist.destroy_process_group()
        _CURRENT = None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _lost(what: str, exc: BaseException) -> PeerLostError:
    d = _CURRENT
    who = f"rank {d.rank} of {d.world}" if d else "this rank"
    return PeerLostError(f"{who}: {what} failed, a machine died or stopped answering "
                         f"({_first_line(exc)}); restart all machines with --resume")


def cross_machine_reduce():
    """The EPS's all-reduce hook (None in a one-process run): sums a layer's box
    gradient over the machines, in place, on the gradient group."""
    d = _CURRENT
    if d is None:
        return None
    import torch.distributed as dist

    def all_reduce(layer: int, g: np.ndarray) -> None:
        try:
            dist.all_reduce(torch.from_numpy(g), op=dist.ReduceOp.SUM, group=d.grad_group)
        except RuntimeError as exc:
            raise _lost(f"the gradient all-reduce of layer {layer}", exc) from None
    return all_reduce


def sum_over_machines(x: float) -> float:
    """``x`` summed over the machines (the training loop's group); ``x`` alone in one process."""
    d = _CURRENT
    if d is None:
        return x
    import torch.distributed as dist
    t = torch.tensor([x], dtype=torch.float64)
    try:
        dist.all_reduce(t, group=d.main_group)
    except RuntimeError as exc:
        raise _lost("the loss all-reduce", exc) from None
    return float(t.item())


def barrier() -> None:
    d = _CURRENT
    if d is None:
        return
    import torch.distributed as dist
    try:
        dist.barrier(group=d.main_group)
    except RuntimeError as exc:
        raise _lost("a barrier", exc) from None


def weights_digest(tensors: dict[str, np.ndarray]) -> str:
    """SHA-256 over every master-weight tensor, in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        if name.endswith(".p"):
            h.update(name.encode())
            h.update(np.ascontiguousarray(tensors[name]).tobytes())
    return h.hexdigest()


def check_agreement(tensors: dict[str, np.ndarray], step: int) -> list[str]:
    """Every machine's master weights hash the same, or a clear error; returns each
    machine's digest, by rank."""
    digest = weights_digest(tensors)
    d = _CURRENT
    if d is None:
        return [digest]
    import torch.distributed as dist
    gathered: list = [None] * d.world
    try:
        dist.all_gather_object(gathered, digest, group=d.main_group)
    except RuntimeError as exc:
        raise _lost("the weight checksum", exc) from None
    if len(set(gathered)) != 1:
        raise RuntimeError(f"step {step}: the machines' master weights differ "
                           f"({', '.join(g[:12] for g in gathered)}): the EPSes diverged")
    return gathered
