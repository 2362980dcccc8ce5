"""The relay: L2L's schedule, layers outer and micro-batches inner.

Forward: each layer is fetched from the EPS once and run over all M
micro-batches; each micro-batch's layer input is stashed, and its autograd
graph is recorded without the tensors it saves (``recompute.py``). The post
stage runs forward and backward at once (its weights are already here).
Backward walks the layers in reverse: fetch, recompute each micro-batch from
its stash with the forward's dropout masks -- only as far as the recorded graph
needs, like torch's checkpoint with early stop -- back-propagate the upstream
gradient through the recorded graph, accumulate the layer's gradient over the
M micro-batches into one flat buffer, hand it to the EPS -- which updates the
layer on its worker while the relay goes on -- and free the layer.

A step may run a subset of the blocks (dynamic depth, ``l2l.depth``): the rest
are neither fetched nor computed nor updated. A LoRA run's layers bind their
frozen base weights (``LayerStack.frozen``, ``l2l.lora``) beside the EPS's
adapters, which alone take gradients.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace
from typing import Callable, Collection

import numpy as np
import torch

from ..data import Batch
from ..depth import checked_skip
from ..engine import StepResult
from ..eps import EagerParamServer
from ..eps.numerics import COPY_DTYPES
from ..hostmem import process_heap_trimmer
from ..models import FlatLayout, Layer, LayerStack
from .binding import WeightBinding
from .ledger import MemoryLedger
from .recompute import Recorder, WeightSinks
from .rng import derive_seed, replay_rng
from .scaler import LossScaler, scaler_for
from .stash import BoundaryStore
from .transport import TORCH_DTYPES, make_transport


class _FetchedLayer:
    """One layer's weights on the device: its own flat buffer and those of the shared
    parameters it uses (tied embeddings), bound as named views."""

    def __init__(self, layer: Layer, binding: WeightBinding,
                 parts: list[tuple[int, int, FlatLayout, torch.Tensor]],
                 frozen: dict[str, torch.Tensor] | None = None) -> None:
        self.layer = layer
        self.binding = binding
        self.parts = parts  # (EPS entry, place among its users, layout, device weights)
        self.frozen = frozen or {}  # frozen weights (a LoRA run's base): bound, never trained
        self.grads: list[torch.Tensor] = []  # one buffer per part, once given
        self.params: dict[str, torch.Tensor] = {}
        for _, _, layout, weights in parts:
            self.params.update(layout.views(weights))

    def grad_views(self) -> dict[str, torch.Tensor]:
        views: dict[str, torch.Tensor] = {}
        for (_, _, layout, _), grad in zip(self.parts, self.grads):
            views.update(layout.views(grad))
        return views

    def enable_grad(self) -> None:
        """Make each view a leaf whose ``.grad`` is its slice of the gradient buffers."""
        grads = self.grad_views()
        for name, view in self.params.items():
            view.requires_grad_(True)
            view.grad = grads[name]

    def __call__(self, *args):
        with self.bound(self.params) as module:
            return module(*args)

    def bound(self, weights: dict[str, torch.Tensor]):
        """The layer's module computing with ``weights`` (graph taps, or recompute leaves)
        and its frozen weights, which never enter the graph as leaves."""
        return self.binding.bound({**self.frozen, **weights})


class RelayEngine:
    name = "l2l"

    def __init__(self, stack: LayerStack, eps: EagerParamServer, device: torch.device, *,
                 micro_batches: int, stash: str = "device", seed: int = 0,
                 transport=None, precision: str = "fp32", overflow: str = "eager",
                 clip_grad_norm: float | None = None, contributor: int = 0,
                 micro_batch_offset: int = 0, owns_step: bool = True, rng_lock=None) -> None:
        """``contributor``, ``micro_batch_offset`` and ``owns_step`` make this engine one
        worker of a data-parallel relay (``relay/parallel.py``): its gradients are
        that contribution to the shared EPS, its micro-batches are global micro-batches
        ``offset, offset + 1, ...`` (for the dropout seeds), and with ``owns_step``
        False the coordinator, not this worker, holds and commits strict steps.
        ``rng_lock``: CPU workers share torch's one CPU generator, so with dropout
        they take turns through this lock while they draw masks."""
        if overflow not in ("eager", "strict"):
            raise ValueError(f"overflow must be 'eager' or 'strict', not {overflow!r}")
        if clip_grad_norm is not None and overflow != "strict":
            raise ValueError("clip_grad_norm needs overflow='strict': eager updates cannot wait for the global norm")
        self.stack = stack
        self.eps = eps
        self.device = device
        self.micro_batches = micro_batches
        self.stash_policy = stash
        self.seed = seed
        self.transport = transport or make_transport(device)
        self.ledger = MemoryLedger()
        self.scaler: LossScaler = scaler_for(precision)
        self.overflow = overflow
        self.clip_grad_norm = clip_grad_norm
        self.contributor = contributor
        self.micro_batch_offset = micro_batch_offset
        self.owns_step = owns_step
        self.rng_lock = rng_lock
        self._history_seen = 0
        self.layers = stack.layers
        stack.check_frozen()
        # an entry with nothing to train (a LoRA layer no target matches) is not the EPS's
        self.parts = [[p for p in stack.parts(i) if p[2].numel or stack.frozen is None] for i in range(len(self.layers))]
        self.compute_dtype = TORCH_DTYPES[COPY_DTYPES[precision]]
        if stack.frozen is not None and self.transport.asynchronous:  # its copies need the transport's memory
            stack.frozen.rehome(self.transport.host_alloc)
        self.bindings = []
        for i, layer in enumerate(self.layers):  # the model's weights leave it a layer at a time
            for e, _, _ in self.parts[i]:
                if e not in eps.layers:
                    eps.add_layer(e, stack.initial_weights(e), users=stack.entry_users(e),
                                  n_decay=stack.entry_n_decay(e),
                                  tensor_starts=[s.offset for s in stack.entry_layout(e)[1].slots])
            self.bindings.append(WeightBinding(layer.module, device))
        self._prefetched: dict[int, object] = {}
        self._resident: dict[int, _FetchedLayer] = {}
        self._recorder = Recorder(device)
        self._store: BoundaryStore | None = None  # the running step's stash (None between steps)
        self.boundary_hooks: list[Callable[[RelayEngine, str, int], None]] = []
        self.heap_trimmer = process_heap_trimmer()  # the host heap's holes, handed back between layers
        self.heap_trimmer.trim()  # and the build's, now

    # ------------------------------------------------------------ weights
    def _prefetch(self, i: int) -> None:
        """Start uploading layer ``i``'s weights (asynchronous transports only); the
        device buffers are booked as ``weights_prefetch`` until :meth:`_fetch` takes them."""
        if 0 <= i < len(self.layers) and i not in self._prefetched and self.transport.asynchronous:
            pending = self._upload(i)
            self._prefetched[i] = pending
            self.ledger.add("weights_prefetch", sum(p.nbytes for p in pending))

    def _upload(self, i: int) -> list:
        """Layer ``i``'s entries, fetched from the EPS (on this worker's route) and sent to the device,
        then its frozen weights (a LoRA run's base) from the stack's frozen store."""
        pending = [self.transport.upload(self.eps.fetch(e, self.contributor)) for e, _, _ in self.parts[i]]
        if self.stack.frozen is not None:
            pending += [self.transport.upload(host) for _, host, _ in self.stack.frozen.arrays(i)]
        return pending

    def _fetch(self, i: int) -> _FetchedLayer:
        resident = self._resident.pop(i, None)
        if resident is not None:  # kept from the forward: no round trip
            return resident
        pending = self._prefetched.pop(i, None)
        if pending is not None:
            self.ledger.sub("weights_prefetch", sum(p.nbytes for p in pending))
        else:
            pending = self._upload(i)
        parts = [(e, user, layout, p.wait()) for (e, user, layout), p in zip(self.parts[i], pending)]
        frozen = None
        if self.stack.frozen is not None:  # cast on the device, in its stream order
            frozen = {name: p.wait().view(shape).to(self.compute_dtype) for (name, _, shape), p in
                      zip(self.stack.frozen.arrays(i), pending[len(self.parts[i]):])}
        fetched = _FetchedLayer(self.layers[i], self.bindings[i], parts, frozen)
        self.ledger.add("weights", _fetched_bytes(fetched))
        return fetched

    def _keeps_resident(self, i: int, running: list[int]) -> bool:
        """Whether the forward keeps layer ``i`` on the device for the backward, which starts
        with it right after the post stage: the step's last running block (an asynchronous
        transport, a step that runs a block)."""
        return i == running[-1] and i > 0 and self.transport.asynchronous

    def _route(self, layers) -> list[int]:
        """The EPS entries fetched for ``layers``, in order."""
        return [e for i in layers for e, _, _ in self.parts[i]]

    def _train_route(self, running: list[int]) -> list[int]:
        """The entries a training step that runs the layers ``running`` (pre and blocks) fetches,
        in the order it fetches them (declared to the EPS, which may prepare them ahead):
        forward and post, then backward."""
        last = len(self.layers) - 1
        backward = [i for i in reversed(running) if self._has_backward(i) and not self._keeps_resident(i, running)]
        return self._route([*running, last, *backward])

    def running_layers(self, skip_blocks: Collection[int] = ()) -> list[int]:
        """The layers a training step runs before the post stage: the pre stage and every block
        (0-based block numbers; block ``b`` is layer ``b + 1``) not in ``skip_blocks``."""
        blocks = len(self.layers) - 2
        skip = checked_skip(skip_blocks, blocks)
        for b in skip:
            if self.layers[b + 1].shared:
                raise ValueError(f"block {b} uses a parameter shared with another layer: it cannot be skipped")
        return [0, *(b + 1 for b in range(blocks) if b not in skip)]

    def _has_backward(self, i: int) -> bool:
        """Whether the backward runs layer ``i``: all but a pre stage with nothing to train (a LoRA
        run's embedding), whose input is token ids -- it is neither fetched nor computed then."""
        return i > 0 or (i == 0 and bool(self.parts[0]))

    def _release(self, fetched: _FetchedLayer) -> None:
        self.ledger.sub("weights", _fetched_bytes(fetched))
        self.ledger.sub("grads", sum(_nbytes(g) for g in fetched.grads))

    def _contributor(self, user: int) -> int:
        """This worker's row in the entry's inbox: users outer, workers inner."""
        return user * self.eps.contributors + self.contributor

    def _with_grad(self, i: int, fetched: _FetchedLayer, sinks: WeightSinks | None = None) -> None:
        """Give the layer its gradient buffers: as its leaves' ``.grad`` (the post stage,
        whose forward and backward are one), or through the sinks of its recorded graph."""
        for e, user, _, _ in fetched.parts:
            inbox = self.eps.gradient_inbox(e, self._contributor(user))
            fetched.grads.append(self.transport.gradient_buffer(inbox))
            self.ledger.add("grads", _nbytes(fetched.grads[-1]))
        if sinks is None:
            fetched.enable_grad()
        else:
            sinks.grads = fetched.grad_views()

    def _hand_over(self, i: int, fetched: _FetchedLayer, scale: float) -> None:
        for (e, user, _, _), grad in zip(fetched.parts, fetched.grads):
            contributor = self._contributor(user)
            ready = self.transport.download_gradient(grad, self.eps.gradient_inbox(e, contributor))
            self.eps.push_gradient(e, contributor, divisor=1.0, loss_scale=scale, ready=ready)

    def settle_previous_step(self) -> int:
        """Wait for the previous step's updates (the forward needs layer 0 first, whose
        update is queued last, so this costs no overlap), count the layers whose
        gradient overflowed, and move the loss scale."""
        self.eps.synchronize()
        records, self._history_seen = self.eps.records_since(self._history_seen)
        if not records or self.overflow == "strict":  # strict: settled at commit
            return 0
        skipped = sum(not r.finite for r in records)
        self.scaler.update(skipped > 0)
        return skipped

    def _commit(self) -> tuple[int, float]:
        return commit_held_step(self.eps, self.clip_grad_norm, [self.scaler])

    # ------------------------------------------------------------ helpers
    def _split(self, batch: Batch):
        return [(mb.inputs.to(self.device, non_blocking=True), mb.targets.to(self.device, non_blocking=True))
                for mb in batch.split(self.micro_batches)]

    def _rng(self, step: int, i: int, j: int):
        scope = replay_rng(self.device, derive_seed(self.seed, step, i, self.micro_batch_offset + j))
        return scope if self.rng_lock is None else _locked(self.rng_lock, scope)

    def _track(self, t: torch.Tensor) -> int:
        n = _nbytes(t)
        self.ledger.add("boundary", n)
        return n

    def _boundary(self, phase: str, i: int) -> None:
        for hook in self.boundary_hooks:
            hook(self, phase, i)
        self.heap_trimmer()

    # ------------------------------------------------------------ training
    def train_step(self, batch: Batch, step: int, *, global_targets: int | None = None,
                   skip_blocks: Collection[int] = ()) -> StepResult:
        """One optimizer step over ``batch``; weights update eagerly, layer by layer.

        ``global_targets``: the loss's divisor when ``batch`` is one worker's shard of
        a larger batch (the reported loss is then this shard's share of the mean).

        ``skip_blocks``: blocks (0-based) this step leaves out (dynamic depth,
        ``l2l.depth``): their input passes straight to the next running layer and
        their gradient straight back; they are neither fetched nor computed, and the
        EPS gets no gradient for them, so their weights, moments and step counts stay
        as they were.

        Layer boundaries: each hook in ``boundary_hooks`` is called as
        ``hook(engine, phase, i)`` after the forward of layer ``i`` (phase
        ``"forward"``, ``i`` from 0 to L-2), after the post stage (``"post"``,
        ``i`` = L-1: its gradient handed over, its weights released) and after
        each backward layer's hand-over and release (``"backward"``, ``i`` from
        L-2 down to 0) -- the running layers only, with ``skip_blocks``. There,
        everything the relay holds on the device for the step is reachable from
        the engine -- fetched, prefetched and resident weights and their
        gradients, and the stash (``engine._store`` during a step) -- and
        nothing it has released is: ``relay/audit.py`` measures it
        and compares it with the ledger. Hooks must only look: a hook that
        computes on the device or changes the engine changes the step.
        """
        try:
            return self._train_step(batch, step, global_targets, self.running_layers(skip_blocks))
        finally:
            self._store = None

    def _train_step(self, batch: Batch, step: int, global_targets: int | None, running: list[int]) -> StepResult:
        self.stack.train(True)
        self.ledger.reset_peaks()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        wait_before = self.eps.wait_seconds
        skipped = self.settle_previous_step()
        scale = self.scaler.scale
        # Backward runs on the loss mean times the scale, so fp16 gradients have the
        # magnitude torch's GradScaler would give; the EPS divides the scale out
        # (the contract's inv_scale = 1 / (loss_scale * divisor), divisor 1 here).
        divisor = global_targets or batch.num_targets
        multiplier = scale / divisor
        mbs = self._split(batch)
        last = len(self.layers) - 1
        after = dict(zip(running, [*running[1:], last]))  # the layer each running layer's output goes to
        before = dict(zip(running[1:], running))
        self.eps.declare_route(self.contributor, self._train_route(running), train=True,
                               consumers=self.eps.contributors)
        store = self._store = BoundaryStore(self.stash_policy, self.transport, self.ledger,
                                            schedule=_stash_schedule(running, last, len(mbs)))

        # forward: pre and blocks, stashing each layer's input and recording each
        # call's graph (no saved tensors) for an early-stopping recompute
        self.stack.router_balance.start(scale)  # MoE routers count the whole step's routing
        recordings, sinks = {}, {}
        with torch.no_grad():
            for i in running:
                layer = self._fetch(i)
                self._prefetch(after[i])
                sinks[i] = WeightSinks()
                with layer.bound(self._recorder.tap_weights(layer.params, sinks[i])) as module:
                    for j, (tokens, _) in enumerate(mbs):
                        x = tokens if i == 0 else store.get(("act", i, j))
                        held = 0 if i == 0 else self._track(x)
                        with self._rng(step, i, j):
                            y, recordings[i, j] = self._recorder.forward(module, x)
                        store.put(("act", after[i], j), y)
                        self.ledger.sub("boundary", held)
                        del x, y
                if self._keeps_resident(i, running):
                    self._resident[i] = layer
                else:
                    self._release(layer)
                del layer  # released: no local keeps its weights alive
                self.eps.poll()
                self._boundary("forward", i)

        aux_loss = self.stack.router_balance.finish()  # counted once: not again in the recompute

        # post stage: forward and backward at once
        grad_norm = None
        if self.overflow == "strict" and self.owns_step:
            self.eps.hold()
        layer = self._fetch(last)
        if running[-1] not in self._resident:
            self._prefetch(running[-1])
        self._with_grad(last, layer)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for j, (_, targets) in enumerate(mbs):
            h = store.pop(("act", last, j)).requires_grad_(True)
            held = self._track(h)
            with self._rng(step, last, j):
                part = layer(h, targets)
            (part * multiplier).backward()
            loss_sum += part.detach()
            store.put(("grad", last, j), h.grad)
            self.ledger.sub("boundary", held)
            del h, part
        self._hand_over(last, layer, scale)
        self._release(layer)
        del layer
        self._boundary("post", last)

        # backward: blocks and pre in reverse, recomputed from the stash
        for i in reversed(running):
            if not self._has_backward(i):  # a pre stage with nothing to train
                for j in range(len(mbs)):
                    store.pop(("grad", after[0], j))  # the gradient it would take goes nowhere
                recordings.clear()
                sinks.pop(0)
                self._boundary("backward", 0)
                continue
            layer = self._fetch(i)
            if self._has_backward(before.get(i, -1)):
                self._prefetch(before[i])
            self._with_grad(i, layer, sinks.pop(i))
            with layer.bound(self._recorder.leaves(layer.params)) as module:
                for j, (tokens, _) in enumerate(mbs):
                    x = tokens if i == 0 else store.pop(("act", i, j))
                    upstream = store.pop(("grad", after[i], j))
                    held = self._track(upstream) + (0 if i == 0 else self._track(x))
                    x = self._recorder.leaf(x)
                    with self._rng(step, i, j):
                        grad_x = recordings.pop((i, j)).backward(lambda: module(x), upstream)
                    if i > 0:
                        store.put(("grad", i, j), grad_x)
                    self.ledger.sub("boundary", held)
                    del x, upstream, grad_x
            self._hand_over(i, layer, scale)
            self._release(layer)
            del layer
            self.eps.poll()
            self._boundary("backward", i)

        assert len(store) == 0, "stash not drained"
        if self.overflow == "strict" and self.owns_step:
            skipped, grad_norm = self._commit()
        loss = loss_sum.item() / divisor + aux_loss
        return StepResult(
            loss=loss,
            tokens=batch.inputs.numel(),
            eps_wait_s=self.eps.wait_seconds - wait_before,
            device_peak_bytes=self._device_peak(),
            device_weight_peak_bytes=self.ledger.weight_peak,
            loss_scale=scale,
            skipped_layers=skipped,
            grad_norm=grad_norm,
            host_stash_bytes=self.ledger.host_stash_peak,
        )

    def _device_peak(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return self.ledger.peak

    # ------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self, batches: list[Batch]) -> float:
        """Mean token loss over ``batches``, relayed layer by layer without stashing."""
        self.stack.train(False)
        try:
            total, count = 0.0, 0
            # one worker evaluates (a data-parallel relay's first)
            self.eps.declare_route(self.contributor, self._route(range(len(self.layers))) * len(batches),
                                   train=False, consumers=1)
            for batch in batches:
                mbs = self._split(batch)
                xs = [tokens for tokens, _ in mbs]
                self.stack.router_balance.start()
                for i in range(len(self.layers)):
                    layer = self._fetch(i)
                    self._prefetch(i + 1)
                    if i < len(self.layers) - 1:
                        xs = [layer(x) for x in xs]
                    else:
                        total += sum(float(layer(x, t)) for x, (_, t) in zip(xs, mbs))
                    self._release(layer)
                    del layer  # released: the next layer's fetch does not hold it too
                total += self.stack.router_balance.finish() * batch.num_targets  # as transformers reports it
                count += batch.num_targets
            return total / count
        finally:
            self.stack.train(True)

    def set_lr(self, lr: float) -> None:
        """Updates pushed from now on use ``lr`` (the EPS reads its hyper-parameters at push time)."""
        self.eps.hyper = replace(self.eps.hyper, lr=lr)

    # ------------------------------------------------------------ state
    def state_tensors(self) -> dict[str, np.ndarray]:
        return self.eps.state_tensors()

    def state_arrays(self):
        return self.eps.state_arrays()

    def state_meta(self) -> dict:
        self.settle_previous_step()
        return {**self.eps.state_meta(), "loss_scaler": self.scaler.state_dict()}

    def load_state(self, tensors: dict[str, np.ndarray], meta: dict) -> None:
        self.eps.load_state(tensors, meta)
        self.adopt_loaded_state(meta)

    def adopt_loaded_state(self, meta: dict) -> None:
        """The shared EPS was just loaded (by this worker or another): take the checkpoint's
        loss scale and start reading update records from here."""
        if "loss_scaler" in meta:
            self.scaler.load_state_dict(meta["loss_scaler"])
        self._history_seen = self.eps.records_total

    def master_weights(self) -> list[np.ndarray]:
        """fp32 master weights per EPS entry, flat (the EPS's, after the queued updates):
        each layer's own, then each shared parameter's."""
        return [self.eps.master(e) if self.stack.entry_numel(e) else np.zeros(0, np.float32)
                for e in range(self.stack.num_entries)]

    def close(self) -> None:
        """Let queued updates finish and stop the EPS worker (never raises a worker error twice:
        :meth:`EagerParamServer.close`)."""
        try:
            self.eps.close()
        finally:
            if hasattr(self.transport, "close"):
                self.transport.close()


def commit_held_step(eps: EagerParamServer, clip_grad_norm: float | None,
                     scalers: list[LossScaler]) -> tuple[int, float]:
    """--overflow strict: apply the whole held step or none of it, and move every loss scale
    now. (skipped EPS entries -- all of them, a tied parameter's included, or none --, global
    gradient norm); eager mode counts its skipped entries the same way."""
    result = eps.commit(clip_grad_norm)
    for scaler in scalers:
        scaler.update(not result.finite)
    return (0 if result.finite else len(eps.layers)), result.grad_norm


@contextmanager
def _locked(lock, scope):
    with lock, scope:
        yield


def _stash_schedule(running: list[int], last: int, micro_batches: int) -> list[list[tuple]]:
    """The stash keys each compute call reads, in the order the relay calls them, for a step
    that runs the layers ``running`` and then the post stage ``last``: the blocks' forward
    (layer inputs), the post stage, then the backward (layer input and upstream gradient).
    The store prefetches one call ahead."""
    after = dict(zip(running, [*running[1:], last]))
    groups = [[("act", i, j)] for i in running[1:] for j in range(micro_batches)]
    groups += [[("act", last, j)] for j in range(micro_batches)]
    for i in reversed(running):
        groups += [([("act", i, j)] if i > 0 else []) + [("grad", after[i], j)] for j in range(micro_batches)]
    return groups


def _fetched_bytes(fetched: _FetchedLayer) -> int:
    return sum(_nbytes(w) for *_, w in fetched.parts) + sum(_nbytes(w) for w in fetched.frozen.values())


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
