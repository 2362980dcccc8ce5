"""Many machines: one EPS per machine, agreeing through torch.distributed.

Launched with ``torchrun`` (or any launcher that sets ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT``). Every machine runs the same relay over its
shard of the global batch, and its EPS reduces the box's contributions as
usual; then, on the EPS worker thread, the box's summed gradient of each layer
is all-reduced (sum) across machines with gloo before the update, so every
machine applies the same update to the same bits. The all-reduce of one layer
runs on the EPS thread while the relay goes on with the next layer's backward.

Gloo, not NCCL: the reduced gradient lives in host memory (the EPS), so the
collective moves host tensors. A process group per thread keeps the threads apart:
the EPS thread's gradient all-reduces on one, the training loop's loss sum and
weight checksums on another, a sharded EPS's gather of the device copies on a
third, so their collectives never interleave.

A machine that dies makes a collective on the others fail (the connection
closes) or time out (``L2L_DIST_TIMEOUT`` seconds, default 30): they stop with
one line (:class:`~l2l.errors.PeerLostError`, exit code 1), never hang.
Checkpoints are written by rank 0 only and hold the global state, so a run
resumes with any number of machines.
"""
from __future__ import annotations

import hashlib
import os
import warnings
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
    copy_group: object   # the sharded EPS's gather thread's collectives
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
        copy_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise PeerLostError(f"could not join the {world} machines at "
                            f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}: {_first_line(exc)}") from None
    _CURRENT = Dist(rank=dist.get_rank(), world=world, grad_group=grad_group,
                    main_group=dist.group.WORLD, copy_group=copy_group, timeout_s=timeout_s)
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


def _gather_f64(values: list[float], what: str) -> list[list[float]]:
    """Every machine's ``values`` (as many on each), by rank, on the training loop's group;
    ``[values]`` in one process."""
    d = _CURRENT
    if d is None:
        return [[float(v) for v in values]]
    import torch.distributed as dist
    t = torch.tensor(values, dtype=torch.float64)
    out = [torch.empty_like(t) for _ in range(d.world)]
    try:
        dist.all_gather(out, t, group=d.main_group)
    except RuntimeError as exc:
        raise _lost(what, exc) from None
    return [o.tolist() for o in out]


def each_machine(value: float, what: str) -> list[float]:
    """Every machine's ``value``, by rank; ``[value]`` in one process."""
    return [v for (v,) in _gather_f64([value], what)]


def sum_over_machines(parts: list[float]) -> float:
    """The sum of every worker's ``parts`` over the machines (the training loop's group), added
    in worker order (rank, then worker) from 0.0: the same float one process with all the
    workers adds. One process: ``sum(parts)``."""
    return float(sum(x for machine in _gather_f64(parts, "the loss gather") for x in machine))


TEXT_BYTES = 256  # the longest text the machines exchange (a run id, a directory name, a file's digest)


def _text_tensor(text: str) -> torch.Tensor:
    """``text`` as a fixed-size uint8 tensor (two bytes of length, then UTF-8) for a collective."""
    data = text.encode("utf-8")
    if len(data) > TEXT_BYTES:
        raise ValueError(f"{len(data)} bytes of text, more than {TEXT_BYTES}")
    t = torch.zeros(TEXT_BYTES + 2, dtype=torch.uint8)
    t[0], t[1] = len(data) // 256, len(data) % 256
    t[2:2 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else t[2:2]
    return t


def _text_of(t: torch.Tensor) -> str:
    return bytes(t[2:2 + int(t[0]) * 256 + int(t[1])].tolist()).decode("utf-8")


def agree_text(text: str, what: str = "agreeing on the run's id") -> str:
    """Rank 0's ``text`` on every machine (the training loop's group); ``text`` in one process."""
    d = _CURRENT
    if d is None:
        return text
    import torch.distributed as dist
    t = _text_tensor(text)
    try:
        dist.broadcast(t, src=0, group=d.main_group)
    except RuntimeError as exc:
        raise _lost(what, exc) from None
    return _text_of(t)


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


# ---------------------------------------------------------------------------
# the sharded EPS's collectives (l2l.eps.sharded_server)
# ---------------------------------------------------------------------------
def _bytes(a: np.ndarray) -> torch.Tensor:
    """``a``'s memory as a uint8 tensor (no copy): collectives move bytes, whatever the dtype
    (ml_dtypes' bfloat16 has no torch equivalent through NumPy). A read-only ``a`` (a backend's
    own state, lent for a checkpoint) is only ever sent, never written."""
    b = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    if b.flags.writeable:
        return torch.from_numpy(b)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The given NumPy array is not writable", UserWarning)
        return torch.from_numpy(b)


class ShardCollectives:
    """What a sharded EPS asks of the machines. The update path (:meth:`to_owners`,
    :meth:`all_finite`, :meth:`lamb_sums`) runs on the EPS worker thread, on the gradient
    group, entry by entry in the order every machine pushes them; the copies' :meth:`gather`
    on the gather thread (:mod:`l2l.eps.gather`), on its group, in the relay's declared order;
    the state path (:meth:`from_owners`, :meth:`to_root`, :meth:`sum_f64`, the texts of a
    checkpoint) on the training loop's thread, on its group.
    Each wraps a failed collective into one :class:`~l2l.errors.PeerLostError` line."""

    def __init__(self, d: Dist) -> None:
        self.rank, self.world, self._d = d.rank, d.world, d
        self.sent_bytes = 0  # what the update path handed its collectives for the other machines

    def to_owners(self, entry: int, rows: np.ndarray, bounds: list[tuple[int, int]]) -> np.ndarray:
        """Every machine's ``rows`` (C, n) restricted to each owner's columns ``bounds[r]``, sent
        to that owner: returns the (world, C, len) rows of this machine's columns, by sender."""
        import torch.distributed as dist
        c = rows.shape[0]
        # grouped by owner: one row is that already (the slices are in rank order), several are not
        send = rows.reshape(-1) if c <= 1 else np.concatenate([rows[:, lo:hi].reshape(-1) for lo, hi in bounds])
        lo, hi = bounds[self.rank]
        recv = np.empty((self.world, c, hi - lo), rows.dtype)
        size = rows.dtype.itemsize * c
        self.sent_bytes += size * sum(b - a for r, (a, b) in enumerate(bounds) if r != self.rank)
        try:
            dist.all_to_all_single(_bytes(recv), _bytes(send),
                                   output_split_sizes=[size * (hi - lo)] * self.world,
                                   input_split_sizes=[size * (b - a) for a, b in bounds],
                                   group=self._d.grad_group)
        except RuntimeError as exc:
            raise _lost(f"the gradient exchange of entry {entry}", exc) from None
        return recv

    def all_finite(self, entry: int, finite: bool) -> bool:
        """Whether every owner's slice of the entry reduced to finite values."""
        import torch.distributed as dist
        t = torch.tensor([1 if finite else 0], dtype=torch.int32)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._d.grad_group)
        except RuntimeError as exc:
            raise _lost(f"the finite flag of entry {entry}", exc) from None
        return bool(t.item())

    def lamb_sums(self, entry: int, sums: np.ndarray) -> np.ndarray:
        """LAMB's per-segment sums of squares of every segment of the entry (float64), summed over
        the machines, on the EPS thread's group between the two passes of an update: each
        segment's from its owner, 0.0 from the others, so the sum is exact in any order (a
        binary32 value, subnormals too, is a normal float64). Not booked in :attr:`sent_bytes`,
        which counts the gradients (the planner's formula), as the finite flag is not."""
        import torch.distributed as dist
        t = torch.from_numpy(np.array(sums, dtype=np.float64))
        try:
            dist.all_reduce(t, group=self._d.grad_group)
        except RuntimeError as exc:
            raise _lost(f"LAMB's norms of entry {entry}", exc) from None
        return t.numpy()

    def gather(self, entry: int, full: np.ndarray, bounds: list[tuple[int, int]]) -> None:
        """``full[lo:hi]`` from the owner of each slice to every machine, in place (each owner
        wrote its own slice): the device copies, on the gather thread's group."""
        self._broadcasts(self._d.copy_group, f"the weights of entry {entry}", full, bounds)

    def from_owners(self, entry: int, full: np.ndarray, bounds: list[tuple[int, int]]) -> None:
        """As :meth:`gather`, on the training loop's group (state reads: masters, digests)."""
        self._broadcasts(self._d.main_group, f"the state of entry {entry}", full, bounds)

    @staticmethod
    def _broadcasts(group, what: str, full: np.ndarray, bounds: list[tuple[int, int]]) -> None:
        import torch.distributed as dist
        try:
            for src, (lo, hi) in enumerate(bounds):
                if hi > lo:
                    dist.broadcast(_bytes(full[lo:hi]), src=src, group=group)
        except RuntimeError as exc:
            raise _lost(what, exc) from None

    def to_root(self, entry: int, part: np.ndarray | None, full: np.ndarray | None,
                bounds: list[tuple[int, int]]) -> None:
        """Each owner's ``part`` (its slice) into rank 0's ``full``; the others pass ``full=None``."""
        import torch.distributed as dist
        group = self._d.main_group
        try:
            for src, (lo, hi) in enumerate(bounds):
                if hi <= lo:
                    continue
                if self.rank == 0:
                    if src == 0:
                        full[lo:hi] = part
                    else:
                        dist.recv(_bytes(full[lo:hi]), src=src, group=group)
                elif src == self.rank:
                    dist.send(_bytes(part), dst=0, group=group)
        except RuntimeError as exc:
            raise _lost(f"the state of entry {entry}", exc) from None

    def sum_f64(self, what: str, values: np.ndarray) -> np.ndarray:
        """``values`` (float64) summed over the machines elementwise. Used where the sum is exact
        whatever the collective's order: each element from one machine (the others give 0.0),
        or whole numbers (byte counts)."""
        import torch.distributed as dist
        t = torch.from_numpy(np.array(values, dtype=np.float64))
        try:
            dist.all_reduce(t, group=self._d.main_group)
        except RuntimeError as exc:
            raise _lost(what, exc) from None
        return t.numpy()

    def agree_text(self, text: str) -> str:
        """Rank 0's ``text`` on every machine (:func:`agree_text`)."""
        return agree_text(text, "agreeing on a checkpoint or a digest")

    def gather_text(self, text: str) -> list[str]:
        """Every machine's ``text``, by rank, on every machine."""
        import torch.distributed as dist
        t = _text_tensor(text)
        out = [torch.empty_like(t) for _ in range(self.world)]
        try:
            dist.all_gather(out, t, group=self._d.main_group)
        except RuntimeError as exc:
            raise _lost("a checkpoint's file list", exc) from None
        return [_text_of(o) for o in out]


def shard_collectives() -> ShardCollectives | None:
    """The sharded EPS's collectives on this machine's process groups; None in one process."""
    return ShardCollectives(_CURRENT) if _CURRENT is not None else None
