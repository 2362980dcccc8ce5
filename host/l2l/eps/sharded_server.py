"""The EPS split across machines: each of R ranks owns a slice of every entry.

The layout (:class:`~l2l.eps.shards.ShardLayout`) gives each rank contiguous
whole blocks of each entry; the rank's backend holds the fp32 masters and
moments of its slices only, and runs their updates, and the rank keeps its
slices of the device copies. The relay runs every layer, so the whole copies
it fetches are gathered from their owners a window ahead of it
(:mod:`l2l.eps.gather`). Every rank keeps the step counts of all entries
(bookkeeping, the same everywhere).

One entry's update, on every rank's EPS thread, in the order every rank pushes:

1. **Gradients to their owners**: each rank sends each owner the owner's
   columns of its raw (contributors, n) inbox (``all_to_all_single``); the owner
   folds the R x C rows it receives in the contract's order -- for a tied entry
   user first, then worker ``rank * K + k`` -- so R machines of K workers give
   the bits of one machine of R x K workers (``docs/eps-numerics.md``).
2. **One flag**: the owners agree on the entry's finite flag (a MIN all-reduce),
   so every slice of an entry updates, or none does.
3. **Update**, each owner its slice, writing its slice of the device copy, which
   the gather thread of every rank reads once the update is settled.

LAMB's trust ratios need norms over whole tensors, and a tensor may span slices.
Its segments (tensors cut at every block boundary) lie wholly in one slice, so
each owner's first pass gives the sums of its own segments, the same bits at any
R. Between the passes every rank -- an owner from inside its backend's step, a
rank with no slice of the entry by itself -- puts its segments' 2 x 16 lane sums
where they sit among the entry's segments in a float64 vector of zeros, and one
all-reduce on the update's group (exact: each element comes from one owner)
gives every rank all of them; each folds the whole entry as one machine does
(``numerics.lamb_steps``) and keeps its slice's step sizes. That is 256 bytes a
segment of the entry (2 x 16 float64) in each rank's all-reduce, once per finite
update: an all-reduce every rank joins, after the agreed flag, in push order
(a non-finite update joins none, on every rank).

Held steps (``--overflow strict``) fold and check in step 1, keep the unscaled
fold, and agree at the commit on one vector of per-layer flags and per-block
sums of squares (each element from one owner, the others adding 0.0: exact), so
the global norm is the same sum in the same order for any R.

Checkpoints: each machine writes its slices to a file of its own in the step's
directory, rank 0 the manifest last (:meth:`state_pieces`,
:func:`~l2l.checkpoint.save_sharded_checkpoint`); loading assembles each entry
from the pieces, so a run resumes at any R.
"""
from __future__ import annotations

import hashlib
import threading
from dataclasses import replace

import numpy as np

from ..checkpoint import LazyArrays
from ..distributed import ShardCollectives
from ..errors import UserError
from ..hostmem import aligned_empty
from .backend import EpsBackend
from .contract import LambScalars, LambStep, StepScalars
from .gather import GATHER_WINDOW, WAIT_S, CopyGather
from .numerics import LANES, decayed_part, lamb_segments, lamb_steps, reduce_gradients
from .server import EagerParamServer, HostAlloc, UpdateRecord, block_sumsqs
from .shards import BLOCK, ShardLayout

INBOX_LIMIT = 3  # gradient blocks in flight on a machine, at most (EagerParamServer.inbox_limit)


class ShardedParamServer(EagerParamServer):
    def __init__(self, backend: EpsBackend, hyper, *, layout: ShardLayout, net: ShardCollectives,
                 gather_alloc: HostAlloc = aligned_empty, window: int = GATHER_WINDOW, **kw) -> None:
        """``gather_alloc`` allocates the gathered copies (pinned on CUDA; they are not kept)."""
        if {"all_reduce", "copies"} & kw.keys():
            raise UserError("a sharded EPS reduces by owner, and keeps its device copies in memory")
        super().__init__(backend, hyper, **kw)
        if layout.world != net.world:
            raise ValueError(f"a layout for {layout.world} ranks on {net.world} machines")
        if self.optimizer.name == "lamb" and layout.block % BLOCK:
            raise ValueError(f"slices of {layout.block}-element blocks would split LAMB's segments "
                             f"(cut every {BLOCK} elements)")
        self.layout = layout
        self.net = net
        self.rank = net.rank
        self._settled: dict[int, int] = {}  # updates of each entry applied or skipped, in this process
        self._settling = threading.Condition()
        self._closing = False
        # the layer each worker fills, a tied entry's (filled from the post to the pre stage),
        # one updating: the EPS thread waits for the other machines, the relay need not run ahead
        self.inbox_limit = INBOX_LIMIT
        self.copies_gather = CopyGather(
            numels=self._numel, dtype=self.copy_dtype, rank=self.rank, local=self._copies.__getitem__,
            bounds=self._bounds, gather=net.gather, wait_settled=self._wait_settled, check=self.poll,
            alloc=gather_alloc, window=window)

    # ----------------------------------------------------------- where things are
    def _bounds(self, layer: int) -> list[tuple[int, int]]:
        return [(s.lo, s.hi) for s in self.layout.slices(layer)]

    def _on_backend(self, layer: int) -> bool:
        return self._copy_numel(layer) > 0

    def _copy_numel(self, layer: int) -> int:
        return self.layout.slice_of(layer, self.rank).numel

    def _local(self, layer: int, a: np.ndarray) -> np.ndarray:
        s = self.layout.slice_of(layer, self.rank)
        return np.ascontiguousarray(np.asarray(a)[s.lo:s.hi], dtype=np.float32)

    def _local_decay(self, layer: int) -> int:
        s = self.layout.slice_of(layer, self.rank)
        return decayed_part(s.lo, s.hi, self._n_decay[layer])

    def add_layer(self, layer: int, p: np.ndarray, users: int = 1, n_decay: int | None = None,
                  tensor_starts=None) -> None:
        if layer not in self.layout.numels or self.layout.numels[layer] != np.asarray(p).size:
            raise ValueError(f"entry {layer} of {np.asarray(p).size} elements is not in the shard layout")
        super().add_layer(layer, p, users, n_decay, tensor_starts)
        self._settled[layer] = 0

    # ----------------------------------------------------------- copies
    def declare_route(self, worker: int, route: list[int], *, train: bool, consumers: int) -> None:
        self.copies_gather.declare(worker, route, train=train, consumers=consumers)

    def fetch(self, layer: int, worker: int = 0) -> np.ndarray:
        """The layer's whole device copy, gathered from its owners (:mod:`l2l.eps.gather`)."""
        self.poll()
        return self.copies_gather.fetch(worker, layer)

    @property
    def sent_bytes(self) -> int:
        """What this machine handed its collectives for the others in training steps: the
        gradients to their owners, its slices of the copies the relay fetched."""
        return self.net.sent_bytes + self.copies_gather.sent_bytes

    def _record(self, record: UpdateRecord) -> None:
        super()._record(record)
        with self._settling:
            self._settled[record.layer] += 1
            self._settling.notify_all()

    def _wait_settled(self, layer: int, updates: int) -> None:
        """Until ``updates`` updates of the entry are settled (the gather thread's wait)."""
        with self._settling:
            while self._settled[layer] < updates:
                if self._error is not None or self._closing:
                    raise RuntimeError(f"entry {layer}: the EPS stopped before its update")
                self._settling.wait(WAIT_S)

    def close(self) -> None:
        with self._settling:
            self._closing = True
        self.copies_gather.close()
        super().close()

    # ----------------------------------------------------------- updates
    def _fold(self, layer: int, inv_scale: np.float32) -> tuple[np.ndarray, bool]:
        """This rank's slice of the reduced gradient (the contributions of every machine, in
        the contract's order, times ``inv_scale``) and its finite flag."""
        recv = self.net.to_owners(layer, self._inbox(layer, wait=False), self._bounds(layer))
        k = self.contributors
        users = self._contributors[layer] // k
        rows = [recv[r, u * k + j] for u in range(users) for r in range(self.layout.world) for j in range(k)]
        g = np.empty(recv.shape[2], np.float32)
        finite = reduce_gradients(rows, inv_scale, g) if g.size else True
        return g, finite

    def _apply(self, layer: int, scalars: StepScalars | LambStep) -> bool:
        if self._numel[layer] == 0:
            return True
        mine = self.layout.slice_of(layer, self.rank)
        summed = self._summed.pop(layer, None)
        if summed is not None:  # a committed held step: checked finite on every rank
            finite = True
            if mine.numel:
                finite = self.backend.step(layer, [summed], scalars, self._copies[layer],
                                           n_decay=self._local_decay(layer))
        else:
            g, local = self._fold(layer, scalars.inv_scale)
            finite = self.net.all_finite(layer, local)
            if finite and mine.numel:  # g is already scaled: times 1.0 is exact
                self.backend.step(layer, [g], _unscaled(scalars), self._copies[layer],
                                  n_decay=self._local_decay(layer))
        if finite and not mine.numel and isinstance(scalars, LambStep):
            scalars.steps(np.zeros((0, 2, LANES), np.float32))  # no slice here: it joins the owners' norms
        return finite

    def _lamb_step(self, layer: int, scalars: LambScalars) -> LambStep:
        """This rank's segments, whose fold first sums every rank's sums (:meth:`_lamb_fold`)."""
        s = self.layout.slice_of(layer, self.rank)
        segments = lamb_segments(self._tensor_starts[layer], self._numel[layer], s.lo, s.hi)
        return LambStep(scalars, segments, lambda sums: self._lamb_fold(layer, scalars, s.lo, sums))

    def _lamb_fold(self, layer: int, scalars: LambScalars, lo: int, sums: np.ndarray) -> np.ndarray:
        """The step sizes of this rank's segments from ``sums``, theirs ((nseg, 2, LANES), from
        element ``lo``): a collective of every rank, then the one-machine fold of the entry's
        segments (its tensors' global starts, its own decay boundary)."""
        whole = lamb_segments(self._tensor_starts[layer], self._numel[layer])
        first = int(np.searchsorted(whole.bounds[:-1], lo))
        here = slice(first, first + sums.shape[0])
        vec = np.zeros((whole.count, 2, LANES), np.float64)
        vec[here] = sums  # binary32 into float64: exact
        total = self.net.lamb_sums(layer, vec.reshape(-1)).reshape(vec.shape)
        return lamb_steps(total, whole, scalars, self._n_decay[layer])[here]

    def _held_check(self, layer: int, inv_scale: np.float32) -> tuple[bool, list[float]]:
        if self._numel[layer] == 0:
            return True, []
        summed, _ = self._fold(layer, np.float32(1.0))  # the unscaled fold; the commit scales it
        self._summed[layer] = summed
        self._return_inbox(layer)  # the slice is all the commit needs
        g = np.empty_like(summed)
        finite = reduce_gradients([summed], inv_scale, g) if g.size else True
        return finite, block_sumsqs(g) if finite else []

    def _agree(self, checks: dict[int, tuple]) -> tuple[bool, list[float]]:
        """One float64 vector over the machines: per held layer the count of non-finite
        slices, then every block's sum of squares where its owner put it."""
        blocks = {layer: -(-self._numel[layer] // self.layout.block) for layer in checks}
        offsets, at = {}, len(checks)
        for layer in checks:
            offsets[layer] = at
            at += blocks[layer]
        vec = np.zeros(at, np.float64)
        for i, (layer, c) in enumerate(checks.items()):
            if not self._on_backend(layer):
                continue
            if not c[0]:
                vec[i] = 1.0
            else:
                first = offsets[layer] + self.layout.slice_of(layer, self.rank).lo // self.layout.block
                vec[first:first + len(c[1])] = c[1]
        total = self.net.sum_f64("the gradient norm", vec)
        return not total[:len(checks)].any(), [float(x) for x in total[len(checks):]]

    # ----------------------------------------------------------- state
    def state_arrays(self) -> LazyArrays:
        raise RuntimeError("a sharded EPS holds slices: its checkpoint is written by every machine "
                           "(state_pieces, checkpoint.save_sharded_checkpoint)")

    def state_pieces(self) -> tuple[LazyArrays, dict[str, int], dict[str, int]]:
        """This machine's part of every ``layer{i}.<state>`` (p and the moments), read from the backend one entry at a
        time as asked for (after the pending updates), where each part starts, and every whole
        array's length: what :func:`~l2l.checkpoint.save_sharded_checkpoint` writes."""
        mine = {layer: self.layout.slice_of(layer, self.rank) for layer in self.layers}
        names = self.optimizer.state
        starts = {f"layer{layer}.{k}": s.lo for layer, s in mine.items() for k in names}
        numels = {f"layer{layer}.{k}": self._numel[layer] for layer in self.layers for k in names}
        return self._backend_state({layer: s.numel for layer, s in mine.items() if s.numel}), starts, numels

    def master(self, layer: int) -> np.ndarray:
        """The entry's whole fp32 masters, on every rank: a collective, every rank calls it."""
        self.synchronize()
        n = self._numel[layer]
        full = np.empty(n, np.float32)
        if self._on_backend(layer):
            s = self.layout.slice_of(layer, self.rank)
            full[s.lo:s.hi] = self.backend.read_master(layer)
        if n:
            self.net.from_owners(layer, full, self._bounds(layer))
        return full

    def masters_digest(self) -> str:
        """:func:`~l2l.distributed.weights_digest` of the global masters, on every rank (rank 0
        hashes the entries as their owners send them): a collective."""
        self.synchronize()
        h = hashlib.sha256()
        for layer in sorted(self.layers, key=lambda e: f"layer{e}.p"):  # weights_digest's name order
            name, n = f"layer{layer}.p", self._numel[layer]
            part = self.backend.read_master(layer) if self._on_backend(layer) else None
            full = np.empty(n, np.float32) if self.rank == 0 else None
            if n:
                self.net.to_root(layer, part, full, self._bounds(layer))
            if self.rank == 0:
                h.update(name.encode())
                h.update(full.tobytes())
        return self.net.agree_text(h.hexdigest() if self.rank == 0 else "")


def _unscaled(scalars: StepScalars | LambStep):
    """The scalars with ``inv_scale`` 1: for a gradient the fold has already scaled."""
    if isinstance(scalars, LambStep):
        return replace(scalars, scalars=replace(scalars.scalars, inv_scale=np.float32(1.0)))
    return replace(scalars, inv_scale=np.float32(1.0))
