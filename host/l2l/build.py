"""A :class:`~l2l.config.TrainConfig` turned into an engine: the one place that knows
which engine class plays the :class:`~l2l.engine.Engine` role for a configuration."""
from __future__ import annotations

import uuid
from pathlib import Path

import torch

from . import distributed
from .baseline import PlainEngine
from .config import TrainConfig
from .engine import Engine
from .eps import EagerParamServer, OptimizerHyper
from .eps.choice import build as build_backend
from .eps.copy_window import DiskCopies
from .eps.contract import OPTIMIZERS
from .eps.disk_tier import DiskTier, copy_layout, state_layout
from .eps.numerics import COPY_DTYPES
from .eps.offload_backend import OffloadedBackend
from .eps.sharded_server import ShardedParamServer
from .eps.shards import ShardLayout
from .errors import UserError
from .models import LayerStack
from .relay.engine import RelayEngine
from .relay.parallel import DataParallelRelay
from .relay.transport import gather_alloc, make_transports


OFFLOAD_MACHINES = ("--eps-offload with several machines (torchrun) needs --eps-layout sharded, and does not take "
                    "--eps-offload-copies yet (docs/disk-tier.md)")


def check_offload_machines(cfg: TrainConfig, world: int) -> None:
    """``--eps-offload`` under torchrun takes the sharded EPS (each machine its slices' files)
    and keeps the device copies in memory; otherwise one line."""
    if world > 1 and cfg.eps_offload is not None and (cfg.eps_layout != "sharded" or cfg.eps_offload_copies):
        raise UserError(OFFLOAD_MACHINES)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is visible to this PyTorch build")
    return torch.device(name)


def hyper_of(cfg: TrainConfig) -> OptimizerHyper:
    return OptimizerHyper(lr=cfg.lr, beta1=cfg.beta1, beta2=cfg.beta2, eps=cfg.adam_eps,
                          weight_decay=cfg.weight_decay, optimizer=cfg.optimizer)


def shard_layout(stack: LayerStack, world: int) -> ShardLayout:
    """Which machine owns which slices of ``stack``'s EPS entries (a sharded EPS)."""
    return ShardLayout({e: stack.entry_numel(e) for e in range(stack.num_entries)}, world)


def offload_tiers(cfg: TrainConfig, stack: LayerStack, run_id: str, *, rank: int = 0,
                  world: int = 1) -> tuple[DiskTier, DiskTier | None]:
    """The disk tiers of ``--eps-offload`` for ``stack``'s EPS entries (those with parameters):
    the state's, and with ``--eps-offload-copies`` the copies' (else None), their directory
    checked (free space for both): nothing in it is changed yet. Under torchrun (a sharded
    EPS) each machine's tier holds its slices only, in ``DIR/rank-<rank>-of-<world>``."""
    if world > 1:
        layout = shard_layout(stack, world)
        numels = {e: layout.slice_of(e, rank).numel for e in range(stack.num_entries)}
        directory = str(Path(cfg.eps_offload) / f"rank-{rank}-of-{world}")
    else:
        numels = {e: stack.entry_numel(e) for e in range(stack.num_entries)}
        directory = cfg.eps_offload
    tier = DiskTier(directory, run_id, {e: n for e, n in numels.items() if n > 0},
                    layout=state_layout(len(OPTIMIZERS[cfg.optimizer].moments)))
    return tier, copy_tier(cfg, tier) if cfg.eps_offload_copies else None


def copy_tier(cfg: TrainConfig, state: DiskTier) -> DiskTier:
    """The files of the device copies (``--eps-offload-copies``), beside ``state``'s."""
    return DiskTier(cfg.eps_offload, state.run_id, state.numels, layout=copy_layout(COPY_DTYPES[cfg.precision]),
                    also_needs=state.total_bytes() - state.held_bytes)


def build_engine(cfg: TrainConfig, stack: LayerStack, device: torch.device, *, rank: int = 0,
                 world: int = 1, offload: tuple[DiskTier, DiskTier | None] | None = None) -> Engine:
    """The engine of ``cfg`` around ``stack``; under torchrun, this machine's (``rank`` of
    ``world``): it runs micro-batches ``rank*M/world ..`` of the global M, and its EPS
    all-reduces. ``cfg`` is expected checked (:meth:`TrainConfig.check`). With
    ``--eps-offload`` the EPS backend is wrapped to keep its state in files: ``offload``'s
    tiers (:func:`offload_tiers`, checked by the caller before it wrote anything), or new
    ones for a new run id."""
    if cfg.micro_batches % (world * cfg.devices):
        raise UserError(f"--micro-batches {cfg.micro_batches} must be a multiple of machines x --devices "
                        f"({world} x {cfg.devices})")
    check_router_balance(cfg, stack, world)
    if world > 1 and stack.frozen is not None:
        raise UserError("--lora-rank runs on one machine for now (not under torchrun with several)")
    if cfg.engine == "plain":
        return PlainEngine(stack, hyper_of(cfg), device, checkpointing=cfg.checkpointing,
                           precision=cfg.precision, clip_grad_norm=cfg.clip_grad_norm,
                           micro_batches=cfg.micro_batches if cfg.accumulate else 1)
    devices = worker_devices(device, cfg.devices)
    transports = make_transports(devices)
    if cfg.eps_offload_copies and device.type == "cuda":
        raise UserError("--eps-offload-copies is not supported with --device cuda yet (docs/disk-tier.md)")
    backend, choice = build_backend(cfg.eps_choice())
    copies = None
    if cfg.eps_offload is not None:
        try:
            check_offload_machines(cfg, world)
            tier, copy_files = offload or offload_tiers(cfg, stack, uuid.uuid4().hex, rank=rank, world=world)
            if copy_files is not None:
                copies = DiskCopies(copy_files, window=cfg.eps_offload_window)
        except BaseException:
            backend.close()
            raise
        backend = OffloadedBackend(backend, tier, window=cfg.eps_offload_window)
    common = dict(copy_dtype=cfg.precision, grad_dtype=cfg.precision, contributors=cfg.devices,
                  host_alloc=transports[0].host_alloc)
    if world > 1 and cfg.eps_layout == "sharded":
        eps = ShardedParamServer(backend, hyper_of(cfg), layout=shard_layout(stack, world),
                                 net=distributed.shard_collectives(), gather_alloc=gather_alloc(transports),
                                 share_masters=device.type == "cpu", **common)
    else:
        eps = EagerParamServer(backend, hyper_of(cfg), **common,
                               all_reduce=distributed.cross_machine_reduce() if world > 1 else None,
                               share_masters=device.type == "cpu", copies=copies)
    eps.choice = choice
    m = cfg.micro_batches // world
    if cfg.devices == 1:
        return RelayEngine(stack, eps, device, micro_batches=m, stash=cfg.stash,
                           seed=cfg.seed, transport=transports[0], precision=cfg.precision,
                           overflow=cfg.overflow, clip_grad_norm=cfg.clip_grad_norm, micro_batch_offset=rank * m)
    stacks = [stack] + [stack.skeleton() for _ in devices[1:]]  # one model's weights, read once
    return DataParallelRelay(stacks, eps, devices, micro_batches=m, stash=cfg.stash,
                             seed=cfg.seed, precision=cfg.precision, overflow=cfg.overflow,
                             clip_grad_norm=cfg.clip_grad_norm, transports=transports,
                             dropout=cfg.dropout > 0, micro_batch_offset=rank * m)


def check_router_balance(cfg: TrainConfig, stack: LayerStack, world: int) -> None:
    """An MoE model's load-balancing loss counts the routing of the whole batch before any
    backward (``models/router_balance.py``): one worker's relay, or the plain engine on one
    micro-batch. Across workers the counts would need an all-reduce l2l does not make."""
    if not stack.router_balance.active:
        return
    if cfg.engine == "plain" and cfg.accumulate and cfg.micro_batches > 1:
        raise UserError("--accumulate with a router load-balancing loss (output_router_logits): the plain engine "
                        "would back-propagate a micro-batch before the batch's routing is counted; use --engine l2l")
    if world * cfg.devices > 1:
        raise UserError(f"a router load-balancing loss (output_router_logits) needs the whole batch's routing on one "
                        f"worker; this run has {world * cfg.devices} (machines x --devices)")


def worker_devices(device: torch.device, count: int) -> list[torch.device]:
    """``count`` relay workers: GPUs 0..count-1 (from this process's first), or the CPU ``count`` times."""
    if device.type != "cuda":
        return [device] * count
    first = device.index or 0
    if first + count > torch.cuda.device_count():
        raise UserError(f"--devices {count}: only {torch.cuda.device_count() - first} CUDA device(s) visible")
    return [torch.device("cuda", first + i) for i in range(count)]


def relay(stack: LayerStack, *, lr: float = 3e-3, weight_decay: float = 0.01, betas: tuple[float, float] = (0.9, 0.99),
          adam_eps: float = 1e-8, micro_batches: int = 4, device: str | torch.device = "cpu", eps: str = "auto",
          stash: str = "device", precision: str = "fp32", seed: int = 0) -> RelayEngine:
    """A relay engine for a stack of your own (the public API's entry point): the EPS with
    ``eps``'s backend holds the fp32 masters and runs AdamW; the relay runs each layer over
    ``micro_batches`` micro-batches on ``device``. Bad values get one-line :class:`UserError`\\ s."""
    cfg = TrainConfig(lr=lr, weight_decay=weight_decay, beta1=betas[0], beta2=betas[1], adam_eps=adam_eps,
                      micro_batches=micro_batches, device=str(device), eps=eps, stash=stash, precision=precision,
                      seed=seed, batch_size=micro_batches, progress=False).check()
    return build_engine(cfg, stack, resolve_device(cfg.device))
