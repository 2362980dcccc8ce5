"""The eager param-server: bookkeeping around a backend, and the eagerness itself.

The relay pushes a layer's gradient contributions; when all contributors of
an entry are in (one per data-parallel worker, times the number of layers that
use the entry: a tied embedding gets one from the pre and one from the post
stage), its update is queued on a background worker and the relay goes on
with the next layer at once. ``fetch(layer)`` waits for that layer's
pending update only. A failed update is re-raised in the caller's thread at
the next ``fetch``/``push_gradient``/``poll`` -- the relay polls at every layer,
so an error surfaces within one layer of compute, never as a hang.

Held updates (``--overflow strict``): between :meth:`hold` and :meth:`commit`
a pushed layer is only checked -- its reduced gradient's finite flag and sum of
squares, computed on the worker by the golden model's reduction -- and not
applied. :meth:`commit` then decides for the whole step, as
``torch.amp.GradScaler`` does: every layer updates (optionally with its
gradient clipped to a global norm) or none does.
"""
from __future__ import annotations

import math
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np

from ..checkpoint import LazyArrays, spec_of
from ..errors import EpsWorkerError, PeerLostError, UserError
from ..hostmem import aligned_empty
from .backend import EpsBackend
from .copy_window import DiskCopies
from .disk_tier import IoLedger, timeline
from .contract import OPTIMIZERS, LambScalars, LambStep, OptimizerHyper, inv_scale, step_scalars
from .numerics import COPY_DTYPES, GRAD_DTYPES, as_step, reduce_gradients
from .shards import BLOCK

INBOX_WAIT_S = 0.2  # how often a caller waiting for an inbox looks for an update's error
HISTORY_STEPS = 4  # update records kept: this many steps' worth (one record per layer and step)

HostAlloc = Callable[[int, np.dtype], np.ndarray]


def block_sumsqs(g: np.ndarray, block: int = BLOCK) -> list[float]:
    """Each :data:`~l2l.eps.shards.BLOCK`-element block's sum of squares, in float64 (the norm is
    a decision, not contract arithmetic): blocks, not the whole entry, so the figures are the
    same when the entry is split between machines on block boundaries."""
    return [float(np.einsum("i,i->", g[lo:lo + block], g[lo:lo + block], dtype=np.float64))
            for lo in range(0, g.shape[0], block)]


@dataclass
class CommitResult:
    finite: bool        # every held layer's reduced gradient was finite
    grad_norm: float    # global L2 norm of the reduced gradients (inf/nan when not finite)
    clip_coef: float    # factor applied to every gradient (1.0: not clipped)


@dataclass
class UpdateRecord:
    layer: int
    step: int  # the layer's step count after the update (unchanged when skipped)
    finite: bool


class EagerParamServer:
    def __init__(self, backend: EpsBackend, hyper: OptimizerHyper, *, copy_dtype: str = "fp32",
                 grad_dtype: str = "fp32", contributors: int = 1,
                 host_alloc: HostAlloc = aligned_empty,
                 all_reduce: Callable[[int, np.ndarray], None] | None = None,
                 share_masters: bool = False, copies: DiskCopies | None = None) -> None:
        """``all_reduce(layer, g)``, when given, sums the box's reduced (unscaled, fp32)
        gradient of a layer over the machines in place before the update
        (``l2l.distributed``); every machine then updates from the same bits.

        ``share_masters``: the device computes in host memory (the CPU), so with fp32
        copies a backend that keeps its masters there may hand them out as the copies
        (:meth:`EpsBackend.master_as_copy`): 12 bytes a parameter instead of 16. The
        relay reads a layer only after :meth:`fetch` waited for its update and hands
        its gradient over only once it is done with it -- the discipline that already
        lets the update write a separate copy in place.

        ``copies``: the device copies live in files (``--eps-offload-copies``), a few in
        memory (:class:`~l2l.eps.copy_window.DiskCopies`); ``share_masters`` then does not
        apply (the masters are on disk too)."""
        if contributors < 1:
            raise ValueError("contributors must be >= 1")
        self.backend = backend
        self.choice = None  # how the backend was chosen (l2l.eps.choice.EpsChoice), for the run's record
        self.hyper = hyper  # read at push time: a schedule may change lr between steps
        self.optimizer = OPTIMIZERS[hyper.optimizer]  # fixed for the run: it shapes the state
        if self.optimizer.name not in backend.optimizers:
            raise UserError(f"the {backend.name} EPS does not run {self.optimizer.name} "
                            f"(it runs {', '.join(sorted(backend.optimizers))})")
        self.copy_dtype = COPY_DTYPES[copy_dtype]
        self.grad_dtype = GRAD_DTYPES[grad_dtype]
        self.contributors = contributors
        self.share_masters = share_masters and copies is None
        self.copies = copies
        self._alloc = host_alloc
        self._numel: dict[int, int] = {}
        self._n_decay: dict[int, int] = {}  # entry -> its decay boundary (the parameter groups)
        self._tensor_starts: dict[int, tuple[int, ...]] = {}  # entry -> its tensors' offsets (LAMB's norms)
        self._contributors: dict[int, int] = {}
        self._steps: dict[int, int] = {}
        self._copies: dict[int, np.ndarray] = {}
        self._shared: set[int] = set()  # layers whose copy is the backend's master itself
        self._inboxes: dict[int, np.ndarray] = {}  # layer -> its (contributors, n) block, while in flight
        self._free_inboxes: dict[tuple[int, int], list[np.ndarray]] = {}  # (contributors, n) -> spare blocks
        self.inbox_blocks = 0  # blocks ever allocated: the layers in flight at once, not the depth
        self._arrived: dict[int, dict[int, Callable[[], None] | None]] = {}
        self._pending: dict[int, Future] = {}
        self._lock = threading.Lock()
        self._inbox_returned = threading.Condition(self._lock)
        self.inbox_limit: int | None = None  # blocks in flight at most (a caller waits); None: no limit
        self._error: BaseException | None = None
        self._error_told = False  # poll() has raised it to a caller
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eps-update")
        self.wait_seconds = 0.0    # time callers spent blocked on pending updates
        self.update_seconds = 0.0  # time the worker spent updating
        # the latest updates, oldest first: bounded (a few steps' worth), read through records_since
        self.history: deque[UpdateRecord] = deque()
        self.records_total = 0  # records ever made: a reader's cursor
        self.all_reduce = all_reduce
        self._summed: dict[int, np.ndarray] = {}  # held layers' all-reduced gradients (strict + machines)
        self._holding = False
        self._held: dict[int, Future] = {}  # layer -> future of (finite, sumsq, divisor, loss_scale, hyper)

    # ----------------------------------------------------------- layers
    def add_layer(self, layer: int, p: np.ndarray, users: int = 1, n_decay: int | None = None,
                  tensor_starts=None) -> None:
        """A new entry with initial weights ``p``; ``users`` layers (each on every one of the
        ``contributors`` workers) give it a gradient contribution per step. Weight decay
        applies to its first ``n_decay`` elements (default: all; the layout's parameter groups).
        ``tensor_starts``: where each of its tensors begins (the layout's offsets; default one
        tensor), over which LAMB takes its norms."""
        if layer in self._numel:
            raise ValueError(f"layer {layer} already added")
        if users < 1:
            raise ValueError("users must be >= 1")
        p = np.ascontiguousarray(p, dtype=np.float32).reshape(-1)
        n_decay = p.shape[0] if n_decay is None else int(n_decay)
        if not 0 <= n_decay <= p.shape[0]:
            raise ValueError(f"layer {layer}: n_decay {n_decay} outside [0, {p.shape[0]}]")
        self._n_decay[layer] = n_decay
        self._tensor_starts[layer] = tuple(sorted({0, *(int(t) for t in (tensor_starts or ()))}))
        self._numel[layer] = p.shape[0]
        self._contributors[layer] = self.contributors * users
        self._steps[layer] = 0
        shared = None
        if self._on_backend(layer):
            self.backend.allocate(layer, self._local(layer, p), len(self.optimizer.moments))
            if self._on_disk(layer):
                self._store_copy(layer)
                return
            if self.share_masters and self.copy_dtype == np.float32:
                shared = self.backend.master_as_copy(layer)
        if shared is not None:
            self._copies[layer] = shared
            self._shared.add(layer)
            return
        self._copies[layer] = self._alloc(self._copy_numel(layer), self.copy_dtype)
        self._fill_copy(layer, p)

    def _copy_numel(self, layer: int) -> int:
        """The elements of the layer's device copy this EPS keeps: all (a sharded EPS: its slice's)."""
        return self._numel[layer]

    def _local(self, layer: int, a: np.ndarray) -> np.ndarray:
        """The part of an entry-long array this EPS keeps: all of it (a sharded EPS: its slice)."""
        return a

    def _local_decay(self, layer: int) -> int:
        """The decay boundary of the part of the entry this EPS keeps (a sharded EPS: its slice's)."""
        return self._n_decay[layer]

    def _fill_copy(self, layer: int, p: np.ndarray) -> None:
        """Write the layer's device copy of its masters ``p`` (just allocated or loaded)."""
        if self._on_backend(layer):
            self.backend.write_copy(layer, self._copies[layer])

    def _on_backend(self, layer: int) -> bool:
        """An entry with no elements (a pre stage whose one weight is a tied embedding, held
        by the shared entry) is bookkeeping only: backends never see a zero-length buffer."""
        return self._numel[layer] > 0

    def _on_disk(self, layer: int) -> bool:
        """The layer's device copy lives in a file (``--eps-offload-copies``)."""
        return self.copies is not None and self._numel[layer] > 0

    def _store_copy(self, layer: int) -> None:
        """Write the layer's device copy of its current masters to its file."""
        held = self.copies.buffer(layer)
        self.backend.write_copy(layer, held.array)
        self.copies.store(layer, held)

    @property
    def copy_bytes(self) -> int:
        """Host bytes of the device copies kept apart from the masters: none where each master
        serves as its copy (``share_masters`` and a backend that gives them, so a backend that
        could not shows here); the copy files' window (``copies``) is not counted."""
        return sum(c.nbytes for layer, c in self._copies.items() if layer not in self._shared)

    @property
    def layers(self) -> list[int]:
        return sorted(self._numel)

    def numel(self, layer: int) -> int:
        return self._numel[layer]

    def step_count(self, layer: int) -> int:
        return self._steps[layer]

    def contributors_of(self, layer: int) -> int:
        """Contributions the entry waits for each step (workers times users)."""
        return self._contributors[layer]

    # ----------------------------------------------------------- traffic
    def declare_route(self, worker: int, route: list[int], *, train: bool, consumers: int) -> None:
        """``worker`` will fetch the entries of ``route`` next, in that order (a training step
        when ``train``, which ``consumers`` workers run; an evaluation, one). A server holding
        every copy has nothing to prepare; a sharded one gathers them ahead
        (:mod:`l2l.eps.gather`)."""

    def fetch(self, layer: int, worker: int = 0) -> np.ndarray:
        """The layer's device copy, once its pending update (if any) is done (``worker``: the
        one fetching, on its declared route)."""
        self._wait(layer)
        if self._on_disk(layer):
            return self.copies.fetch(layer)
        return self._copies[layer]

    def gradient_inbox(self, layer: int, contributor: int = 0) -> np.ndarray:
        """Host buffer where ``contributor`` writes the layer's gradient this step.

        The contributors' inboxes of a layer are the rows of one (contributors, n)
        block, so a backend can take all K contributions as one buffer; they are
        reduced in row order (the contract's order). A block exists only while its
        layer is in flight: it is taken when the first contributor asks and handed
        back, for the next layer of its shape, once the layer's update has read it
        (held steps keep theirs until the commit). So the inboxes cost a few layers,
        not 4 bytes a parameter, as long as the updates keep up with the relay; with
        :attr:`inbox_limit` set, a caller waits rather than let more blocks be in flight.
        """
        return self._inbox(layer, wait=True)[contributor]

    def _inbox(self, layer: int, *, wait: bool) -> np.ndarray:
        """The layer's (contributors, n) block, taken now if it is not in flight yet; ``wait``:
        for a block to come back first when :attr:`inbox_limit` are out (never on the EPS
        thread, which is what gives them back)."""
        with self._lock:  # K workers ask at once: one block per layer
            while wait and layer not in self._inboxes and self.inbox_limit and len(self._inboxes) >= self.inbox_limit:
                if self._error is not None:  # no update will hand one back
                    break
                self._inbox_returned.wait(INBOX_WAIT_S)
            if layer not in self._inboxes:
                shape = (self._contributors[layer], self._numel[layer])
                spare = self._free_inboxes.get(shape)
                if spare:
                    self._inboxes[layer] = spare.pop()
                else:
                    self._inboxes[layer] = self._alloc(shape[0] * shape[1], self.grad_dtype).reshape(shape)
                    self.inbox_blocks += 1
            return self._inboxes[layer]

    def _return_inbox(self, layer: int) -> None:
        """The layer's update has read its gradients: its block serves the next layer of its shape."""
        with self._lock:
            block = self._inboxes.pop(layer, None)
            if block is not None:
                self._free_inboxes.setdefault(block.shape, []).append(block)
                self._inbox_returned.notify_all()

    def push_gradient(self, layer: int, contributor: int = 0, *, divisor: float,
                      loss_scale: float = 1.0, ready: Callable[[], None] | None = None) -> None:
        """Declare ``gradient_inbox(layer, contributor)`` filled (or filled once ``ready()`` returns).

        ``divisor`` turns the summed gradient into the loss's mean (the
        contract's ``inv_scale = 1 / (loss_scale * divisor)``); every
        contributor of a step must pass the same one.
        """
        self.poll()
        if not 0 <= contributor < self._contributors[layer]:
            raise ValueError(f"contributor {contributor} out of range")
        with self._lock:
            arrived = self._arrived.setdefault(layer, {})
            if contributor in arrived:
                raise RuntimeError(f"layer {layer}: contributor {contributor} pushed twice in one step")
            arrived[contributor] = ready
            if len(arrived) < self._contributors[layer]:
                return
            del self._arrived[layer]
            ready_all = [arrived[k] for k in sorted(arrived)]
            previous = self._pending.get(layer)
            if self._holding:
                if layer in self._held:
                    raise RuntimeError(f"layer {layer} pushed twice while updates are held")
                self._held[layer] = self._worker.submit(
                    self._check, layer, previous, ready_all, self.hyper, float(divisor), float(loss_scale))
                return
            self._pending[layer] = self._worker.submit(
                self._update, layer, previous, ready_all, self.hyper, float(divisor), float(loss_scale))

    # ----------------------------------------------------------- held updates
    def hold(self) -> None:
        """Check, but do not apply, the layers pushed until :meth:`commit`."""
        if self._holding:
            raise RuntimeError("updates are already held")
        self._holding = True

    def commit(self, max_norm: float | None = None) -> CommitResult:
        """Apply every held layer's update, or none when any gradient was not finite.

        With ``max_norm``, gradients whose global L2 norm exceeds it are scaled
        by ``max_norm / (norm + 1e-6)`` (``torch.nn.utils.clip_grad_norm_``);
        the factor enters the contract's ``inv_scale`` through the divisor, so
        every backend applies it with the same single rounding. Updates queue
        in layer order -- the next forward needs layer 0 first.
        """
        if not self._holding:
            raise RuntimeError("commit() without hold()")
        self._holding = False
        held, self._held = self._held, {}
        checks = {layer: fut.result() for layer, fut in sorted(held.items())}
        self.poll()
        finite, sumsqs = self._agree(checks)
        norm = math.sqrt(sum(sumsqs)) if finite else math.inf
        coef = 1.0
        if finite and max_norm is not None:
            coef = min(1.0, max_norm / (norm + 1e-6))
        if not finite:
            self._summed.clear()
            for layer in checks:
                self._record(UpdateRecord(layer, self._steps[layer], False))
            return CommitResult(False, norm, coef)
        self.backend.expect([layer for layer in checks if self._on_backend(layer)])  # a disk tier reads ahead
        with self._lock:
            for layer, (_, _, divisor, loss_scale, hyper) in checks.items():
                self._pending[layer] = self._worker.submit(
                    self._update, layer, None, [], hyper, divisor / coef, loss_scale)
        return CommitResult(True, norm, coef)

    def _check(self, layer: int, previous: Future | None, ready: list, hyper: OptimizerHyper,
               divisor: float, loss_scale: float):
        try:
            if previous is not None:
                previous.result()
            for wait in ready:
                if wait is not None:
                    wait()
            start = time.perf_counter()
            finite, sumsqs = self._held_check(layer, inv_scale(loss_scale, divisor))
            self.update_seconds += time.perf_counter() - start
            return finite, sumsqs, divisor, loss_scale, hyper
        except BaseException as exc:
            if self._error is None:
                self._error = exc
            raise

    def _held_check(self, layer: int, inv_scale: np.float32) -> tuple[bool, list[float]]:
        """A held layer's finite flag and its reduced gradient's sums of squares, per block."""
        g = np.empty(self._numel[layer], np.float32)
        grads = self._gradients(layer)
        if self.all_reduce is not None:
            self._summed[layer] = grads
        finite = reduce_gradients(grads, inv_scale, g)
        return finite, block_sumsqs(g) if finite else [math.inf]

    def _agree(self, checks: dict[int, tuple]) -> tuple[bool, list[float]]:
        """Whether every held layer is finite, and every block's sum of squares in layer then
        block order (what the global norm adds up)."""
        finite = all(c[0] for c in checks.values())
        return finite, [x for c in checks.values() for x in c[1]]

    def _record(self, record: UpdateRecord) -> None:
        with self._lock:
            self.history.append(record)
            self.records_total += 1
            while len(self.history) > HISTORY_STEPS * max(1, len(self._numel)):
                self.history.popleft()

    def records_since(self, cursor: int) -> tuple[list[UpdateRecord], int]:
        """The update records made since ``cursor`` (a former ``records_total``), and the new cursor.
        Only the last :data:`HISTORY_STEPS` steps' records are kept: a reader reads every step."""
        with self._lock:
            missed = self.records_total - cursor
            if missed > len(self.history):
                raise RuntimeError(f"{missed - len(self.history)} update records were dropped before they were read")
            return list(self.history)[len(self.history) - missed:], self.records_total

    def poll(self) -> None:
        """Raise the first worker error, if any."""
        if self._error is not None:
            self._error_told = True
        if isinstance(self._error, (PeerLostError, UserError, OSError)):
            raise self._error  # already one clear line (a lost machine; a damaged --eps-offload file; a disk error)
        if self._error is not None:
            raise EpsWorkerError(f"EPS update failed: {self._error!r}") from self._error

    def synchronize(self) -> None:
        for layer in list(self._pending):
            self._wait(layer)

    _TOTALS = ("read_bytes", "read_s", "write_bytes", "write_s")

    def _disk_ledgers(self, *, settle: bool = False) -> dict[str, IoLedger]:
        """The disk tier's ledgers: the state files' (``"state"``) and, with
        ``--eps-offload-copies``, the copy files' (``"copies"``); after their pending writes
        when ``settle``. Empty without the tier."""
        ledgers = {}
        state = self.backend.disk_ledger(settle=settle)
        if state is not None:
            ledgers["state"] = state
        if self.copies is not None:
            if settle:
                self.copies.flush()
            ledgers["copies"] = self.copies.tier.io
        return ledgers

    def disk_io_now(self) -> dict | None:
        """The disk tier's ledger totals as they stand (read/write bytes and seconds, state and
        copy files together), without waiting for pending updates or writes: cheap enough
        for every step's record, with the clock of the tier's call log (``t``). None without
        the tier."""
        ledgers = [led.as_dict() for led in self._disk_ledgers().values()]
        if not ledgers:
            return None
        return {**{k: sum(t[k] for t in ledgers) for k in self._TOTALS}, "t": time.perf_counter()}

    def disk_calls(self) -> list:
        """Every logged call of the disk tier, the state files' and the copies', in one list
        (:attr:`~l2l.eps.disk_tier.IoLedger.calls`); empty without the tier."""
        return [c for led in self._disk_ledgers().values() for c in led.calls]

    def disk_timeline(self, start: float | None = None, end: float | None = None) -> dict | None:
        """:func:`~l2l.eps.disk_tier.timeline` of :meth:`disk_calls` between ``start`` and ``end``;
        None once the call log was full (a long run: its figures would be the early calls')."""
        if any(led.calls_dropped for led in self._disk_ledgers().values()):
            return None
        return timeline(self.disk_calls(), start, end)

    def disk_io(self) -> dict | None:
        """With ``--eps-offload``: the disk tier's own ledger of its I/O (bytes and seconds
        inside its reads and writes, per direction; :class:`~l2l.eps.disk_tier.IoLedger`)
        after the pending updates and writes, for the state files and, with
        ``--eps-offload-copies``, the copy files, their sum and the timeline of their calls.
        None without the tier."""
        self.synchronize()
        tiers = {name: led.as_dict() for name, led in self._disk_ledgers(settle=True).items()}
        if not tiers:
            return None
        total = {k: sum(t[k] for t in tiers.values()) for k in self._TOTALS}
        return {**total, **tiers, "timeline": self.disk_timeline()}

    def close(self) -> None:
        """Let the queued updates finish, then release the worker, the copy files and the backend.

        A step's last updates belong to the state it leaves (what a caller reads afterwards,
        the disk tier's files), so they are applied, not dropped; once an update has failed the
        queued ones are cancelled instead (the state is no step's). An update error no caller
        was told of (it came while close waited) is raised here, after the release; one
        already raised is not raised again."""
        self._worker.shutdown(wait=True, cancel_futures=self._error is not None)
        try:
            if self.copies is not None:
                self.copies.close()
        finally:
            self.backend.close()
        if not self._error_told:
            self.poll()

    # ----------------------------------------------------------- worker
    def _update(self, layer: int, previous: Future | None, ready: list, hyper: OptimizerHyper,
                divisor: float, loss_scale: float) -> UpdateRecord:
        try:
            if previous is not None:
                previous.result()
            for wait in ready:
                if wait is not None:
                    wait()
            start = time.perf_counter()
            t = self._steps[layer] + 1
            scalars = step_scalars(hyper, t, loss_scale, divisor)
            if isinstance(scalars, LambScalars):  # its trust ratios need the entry's tensors
                scalars = self._lamb_step(layer, scalars)
            finite = self._apply(layer, scalars)
            self._return_inbox(layer)
            if finite:
                self._steps[layer] = t
            self.update_seconds += time.perf_counter() - start
            record = UpdateRecord(layer, self._steps[layer], finite)
            self._record(record)
            return record
        except BaseException as exc:  # surfaced to the relay by poll()/fetch()
            if self._error is None:
                self._error = exc
            raise

    def _lamb_step(self, layer: int, scalars: LambScalars) -> LambStep:
        return as_step(scalars, self._numel[layer], self._n_decay[layer], self._tensor_starts[layer])

    def _apply(self, layer: int, scalars) -> bool:
        """Reduce the layer's gradients and, when finite, update it and its device copy."""
        grads = self._summed.pop(layer, None)
        if grads is None:
            grads = self._gradients(layer)
        if self._on_disk(layer):
            held = self.copies.buffer(layer)
            finite = self.backend.step(layer, grads, scalars, held.array, n_decay=self._local_decay(layer))
            if finite:
                self.copies.updated(layer, held)
            else:
                self.copies.discard(held)
            return finite
        if not self._on_backend(layer):
            return True
        return self.backend.step(layer, grads, scalars, self._copies[layer], n_decay=self._local_decay(layer))

    def _gradients(self, layer: int) -> np.ndarray:
        """The layer's contributions as the backend takes them: the (K, n) inbox; across
        machines, the box's sum (contract order, unscaled, so inf and NaN carry through)
        all-reduced over the machines, as one contribution."""
        inbox = self._inbox(layer, wait=False)  # allocated even if no contributor asked for it
        if self.all_reduce is None:
            return inbox
        g = np.empty((1, inbox.shape[1]), np.float32)
        reduce_gradients(inbox, np.float32(1.0), g[0])  # times 1.0: exact
        self.all_reduce(layer, g[0])
        return g

    def _wait(self, layer: int) -> None:
        self.poll()
        fut = self._pending.get(layer)
        if fut is None:
            return
        if not fut.done():
            start = time.perf_counter()
            try:
                fut.result()
            except BaseException:
                pass
            self.wait_seconds += time.perf_counter() - start
        self.poll()
        with self._lock:
            if self._pending.get(layer) is fut:
                del self._pending[layer]

    # ----------------------------------------------------------- checkpoints
    def state_tensors(self) -> dict[str, np.ndarray]:
        """``layer{i}.<state>`` fp32 arrays of every layer (``p`` and the optimizer's moments:
        ``.m``, ``.v`` for AdamW), after pending updates: a snapshot."""
        return {k: np.array(a) for k, a in self.state_arrays().items()}

    def state_arrays(self) -> LazyArrays:
        """The same arrays, read from the backend one entry at a time as they are asked for
        (a checkpoint holds one entry's state, not a copy of all): read them before the next
        update. The pending updates are waited for now."""
        return self._backend_state({layer: self._numel[layer] for layer in self.layers})

    def _backend_state(self, lengths: dict[int, int]) -> LazyArrays:
        """``layer{i}.<state>`` of the layers in ``lengths`` (what the backend holds of each: its
        length), read from the backend one entry at a time, after the pending updates."""
        self.synchronize()
        last: dict[int, tuple[np.ndarray, ...]] = {}
        names = self.optimizer.state

        def read(key: str) -> np.ndarray:
            layer = int(key[len("layer"):key.index(".")])
            if layer not in last:
                last.clear()
                last[layer] = self.backend.state_view(layer) if self._on_backend(layer) else \
                    (np.zeros(0, np.float32),) * len(names)
            return last[layer][names.index(key[key.index(".") + 1:])]
        specs = {f"layer{layer}.{k}": ((n,), np.dtype(np.float32)) for layer, n in lengths.items() for k in names}
        return LazyArrays(specs, read)

    def master(self, layer: int) -> np.ndarray:
        """A copy of the layer's fp32 master weights after the pending updates (the backend is
        read while its worker is idle, as for a checkpoint): ``p`` alone, the moments are not
        read (:meth:`EpsBackend.read_master`)."""
        self.synchronize()
        if not self._on_backend(layer):
            return np.zeros(0, np.float32)
        return self.backend.read_master(layer)

    def state_meta(self) -> dict:
        return {"steps": {str(k): v for k, v in self._steps.items()},
                "n_decay": {str(k): v for k, v in self._n_decay.items()},
                "optimizer": self.optimizer.name}

    def load_state(self, tensors: Mapping[str, np.ndarray], meta: dict) -> None:
        """Replace every layer's state: every name, shape and step count is checked before
        anything is written, then each layer is read and written in turn (from a
        checkpoint's lazy arrays, one layer's state at a time)."""
        self.synchronize()
        saved_opt = meta.get("optimizer", "adamw")  # checkpoints from before Lion are AdamW's
        if saved_opt != self.optimizer.name:
            raise ValueError(f"the checkpoint holds {saved_opt} state, this run's optimizer is {self.optimizer.name}")
        names = self.optimizer.state
        staged = {}
        for layer in self.layers:
            try:
                specs = [spec_of(tensors, f"layer{layer}.{k}") for k in names]
                steps = int(meta["steps"][str(layer)])
            except KeyError as exc:
                raise ValueError(f"checkpoint lacks {exc.args[0]}") from None
            # a checkpoint from before the parameter groups decayed every element
            saved = int(meta.get("n_decay", {}).get(str(layer), self._numel[layer]))
            if saved != self._n_decay[layer]:
                raise ValueError(f"layer{layer}: the checkpoint weight-decays {saved} of its {self._numel[layer]} "
                                 f"elements, this run {self._n_decay[layer]}: another parameter grouping "
                                 f"(--weight-decay-all decays every element, as runs before the groups did)")
            for name, (shape, dtype) in zip(names, specs):
                if shape != (self._numel[layer],) or dtype != np.float32:
                    raise ValueError(f"layer{layer}.{name}: {dtype}{list(shape)}, "
                                     f"expected float32[{self._numel[layer]}]")
            staged[layer] = steps
        for layer, steps in staged.items():
            state = [tensors[f"layer{layer}.{k}"] for k in names]
            self._steps[layer] = steps
            if self._on_backend(layer):
                self.backend.write_state(layer, *(self._local(layer, a) for a in state))
                if self._on_disk(layer):
                    self._store_copy(layer)
                    continue
            if layer in self._copies:
                self._fill_copy(layer, state[0])
            del state
