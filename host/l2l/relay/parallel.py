"""Data-parallel L2L in one box: K relay workers feeding one eager param-server.

Each worker is a :class:`~l2l.relay.engine.RelayEngine` on its own device (GPU
k, or the CPU for all of them) running the L2L schedule over its shard of the
global batch: the global batch is cut into M micro-batches of B/M sequences
and worker k takes micro-batches ``k*M/K .. (k+1)*M/K - 1``, so the dropout
seeds (derived from the global micro-batch index) and the micro-batch size do
not depend on K. A worker's layer gradient is contribution k of that layer to
the EPS, which reduces the K contributions in contract order (k = 0, 1, ...),
updates once, and every worker then fetches the same weights. There is no
all-reduce between the devices: the EPS is where gradients meet.

The workers are threads: torch releases the GIL inside its kernels; each runs
its step with its own GPU current (through its transport's ``device_scope``). On the CPU
device they share torch's single CPU generator, so with dropout they take
turns while drawing masks (``rng_lock``); GPUs each have their own.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Collection

import numpy as np
import torch

from ..data import Batch
from ..eps import EagerParamServer
from ..models import LayerStack
from ..engine import StepResult
from .engine import RelayEngine, commit_held_step
from .transport import make_transports


class DataParallelRelay:
    name = "l2l"

    def __init__(self, stacks: list[LayerStack], eps: EagerParamServer, devices: list[torch.device], *,
                 micro_batches: int, stash: str = "device", seed: int = 0, precision: str = "fp32",
                 overflow: str = "eager", clip_grad_norm: float | None = None, transports=None,
                 dropout: bool = True, micro_batch_offset: int = 0) -> None:
        k = len(stacks)
        if k < 1 or len(devices) != k:
            raise ValueError("one stack and one device per worker")
        if eps.contributors != k:
            raise ValueError(f"the EPS expects {eps.contributors} contributors, not {k}")
        if micro_batches % k:
            raise ValueError(f"{micro_batches} micro-batches do not split over {k} workers")
        per = micro_batches // k
        if transports is None:
            transports = make_transports(devices)  # on CUDA, one pinned registry for the EPS's arrays
        rng_lock = threading.Lock() if dropout and any(d.type == "cpu" for d in devices) and k > 1 else None
        self.eps = eps
        self.overflow = overflow
        self.clip_grad_norm = clip_grad_norm
        self.workers = [
            RelayEngine(stack, eps, device, micro_batches=per, stash=stash, seed=seed,
                        transport=transports[i], precision=precision,
                        overflow=overflow, clip_grad_norm=clip_grad_norm, contributor=i,
                        micro_batch_offset=micro_batch_offset + i * per, owns_step=False, rng_lock=rng_lock)
            for i, (stack, device) in enumerate(zip(stacks, devices))]
        self.layers = self.workers[0].layers
        self._pool = ThreadPoolExecutor(max_workers=k, thread_name_prefix="l2l-worker")

    @property
    def scaler(self):
        return self.workers[0].scaler

    def train_step(self, batch: Batch, step: int, *, global_targets: int | None = None,
                   skip_blocks: Collection[int] = ()) -> StepResult:
        """One optimizer step of ``batch``, each worker on its shard (``global_targets``: the
        loss's divisor when ``batch`` is itself this machine's shard of a larger batch), every
        worker leaving out the same ``skip_blocks``."""
        k = len(self.workers)
        targets = global_targets or batch.num_targets
        shards = batch.split(k)
        strict = self.overflow == "strict"
        if strict:
            self.eps.synchronize()
            self.eps.hold()
        futures = [self._pool.submit(_on_device, w, w.train_step, shard, step, global_targets=targets,
                                   skip_blocks=skip_blocks)
                   for w, shard in zip(self.workers, shards)]
        results, errors = [], []
        for f in futures:
            try:
                results.append(f.result())
            except BaseException as exc:  # the first failure is the one to report
                errors.append(exc)
        if errors:
            raise errors[0]
        skipped, grad_norm = results[0].skipped_layers, None
        if strict:
            skipped, grad_norm = commit_held_step(self.eps, self.clip_grad_norm, [w.scaler for w in self.workers])
        return StepResult(
            loss=float(sum(r.loss for r in results)),  # each is its shard's share of the global mean
            parts=[r.loss for r in results],
            tokens=batch.inputs.numel(),
            eps_wait_s=max(r.eps_wait_s for r in results),
            device_peak_bytes=max(r.device_peak_bytes for r in results),
            device_weight_peak_bytes=max(r.device_weight_peak_bytes for r in results),
            loss_scale=results[0].loss_scale,
            skipped_layers=skipped,
            grad_norm=grad_norm,
            host_stash_bytes=sum(r.host_stash_bytes for r in results),
        )

    def evaluate(self, batches: list[Batch]) -> float:
        return self.workers[0].evaluate(batches)

    def set_lr(self, lr: float) -> None:
        self.workers[0].set_lr(lr)  # the workers share one EPS

    def state_tensors(self) -> dict[str, np.ndarray]:
        return self.eps.state_tensors()

    def state_arrays(self):
        return self.eps.state_arrays()

    def state_meta(self) -> dict:
        for w in self.workers:
            w.settle_previous_step()
        return self.workers[0].state_meta()

    def load_state(self, tensors: dict[str, np.ndarray], meta: dict) -> None:
        self.workers[0].load_state(tensors, meta)
        for w in self.workers[1:]:
            w.adopt_loaded_state(meta)

    def master_weights(self) -> list[np.ndarray]:
        return self.workers[0].master_weights()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        try:
            self.eps.close()
        finally:
            for w in self.workers:
                if hasattr(w.transport, "close"):
                    w.transport.close()


def _on_device(worker: RelayEngine, fn, *args, **kwargs):
    """Run ``fn`` on a pool thread with the worker's device current (a thread starts on GPU 0,
    where the kernels, cuBLAS handles and random generator it reaches for by default live)."""
    scope = getattr(worker.transport, "device_scope", None)
    if scope is None:  # a transport with no device to select (the CPU's, copy threads)
        return fn(*args, **kwargs)
    with scope():
        return fn(*args, **kwargs)
