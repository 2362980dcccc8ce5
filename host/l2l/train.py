"""The training run: config in, model trained, record and checkpoints out.

Data flows one way: corpus -> sampler -> engine (relay + EPS, or the plain
baseline) -> metrics, checkpoints, plot. This module only orchestrates; the
schedule lives in :mod:`l2l.relay`, the optimizer in :mod:`l2l.eps`.
"""
from __future__ import annotations

import base64
import json
import math
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from . import checkpoint as ckpt
from . import distributed
from .build import build_engine, check_offload_machines, offload_tiers, resolve_device
from .config import LEGACY_DEFAULTS, TrainConfig
from .data import BatchSampler, load_corpus
from .depth import DepthPolicy, LayerDrop, blocks_left_out
from .engine import Engine
from .eps.disk_tier import check_run_id
from .eps.sharded_server import ShardedParamServer
from .errors import UserError
from .hostmem import memory_status, return_large_blocks, runtime_resident
from .lora.build import build_lora_stack
from .lora.spec import check_model as check_lora_model, enabled as lora_enabled
from .lr_schedule import lr_at
from .metrics import MetricsLog, plot_metrics
from .models import build_stack, family
from .models.pretrained import is_model_dir
from .planner.forecast import forecast
from .run_model import keep_model, model_copy, resumed, same_model
from .sft import ExampleSampler, is_sft_data, load_examples
from .tokenizer import load_tokenizer

FORMAT = "l2l-train/1"
RUN_ID_FILE = "run-id.json"  # the run's id, which its --eps-offload state files carry


@dataclass
class RunSummary:
    out: str
    steps: int
    initial_val_loss: float | None
    final_val_loss: float | None
    final_loss: float | None
    mean_tokens_per_s: float | None
    device_peak_bytes: int
    device_weight_peak_bytes: int
    host_peak_bytes: int | None = None  # the process's peak resident set (VmHWM), build to summary
    host_runtime_bytes: int | None = None  # its resident set as the l2l command started, before any model
    host_stash_bytes: int = 0  # the host stash's peak (--stash host), within host_peak_bytes, reported apart
    params: int | None = None
    plan: dict | None = None  # the planner's forecast beside the measured figures (l2l engine)
    machines_weights_sha256: list | None = None  # torchrun: each machine's master-weight digest, last check
    collective_bytes_per_step: float | None = None  # sharded EPS: bytes the machines' collectives moved
    weights_sha256: str | None = None  # torchrun: SHA-256 of the final fp32 masters (weights_digest)
    machines_host_peak_bytes: list | None = None  # torchrun: each machine's peak resident set (VmHWM), by rank
    # --eps-offload: the disk tier's ledger of its own I/O over the whole run (build, steps,
    # evaluations, checkpoints): read/write bytes and seconds inside its calls, in total and
    # for "state" and "copies" (their per-entry read and write counts too); docs/disk-tier.md
    eps_disk: dict | None = None
    eps_disk_at_start: dict | None = None  # the ledger's totals before the first step (eps_disk_now)
    eps: dict | None = None  # the EPS backend: asked (auto or a name), backend, what it runs on, why (l2l.eps.choice)
    # the EPS's device copies in host memory apart from its masters (EagerParamServer.copy_bytes):
    # 0 on the CPU in fp32 where the masters serve as the copies; None without an EPS
    eps_copy_bytes: int | None = None


def _rng_meta() -> dict:
    state = {"torch_cpu": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if torch.cuda.is_available():
        state["torch_cuda"] = [base64.b64encode(s.numpy().tobytes()).decode()
                               for s in torch.cuda.get_rng_state_all()]
    return state


def _restore_rng(meta: dict) -> None:
    def tensor(b64: str) -> torch.Tensor:
        return torch.from_numpy(np.frombuffer(base64.b64decode(b64), dtype=np.uint8).copy())
    torch.set_rng_state(tensor(meta["torch_cpu"]))
    if torch.cuda.is_available() and "torch_cuda" in meta:
        torch.cuda.set_rng_state_all([tensor(s) for s in meta["torch_cuda"]])


def _check_resumable(cfg: TrainConfig, saved: dict, stack, where: Path) -> None:
    if saved.get("format") != FORMAT:
        raise UserError(f"{where} is not an l2l training checkpoint (format {saved.get('format')!r})")
    theirs = saved["trajectory"]
    defaults = {**TrainConfig().to_dict(), **LEGACY_DEFAULTS}  # keys added after the checkpoint was written
    # a model directory is the same model wherever it is now: the signature compares its content
    by_content = {"model"} if "model_type" in stack.config else set()
    for key, mine in cfg.trajectory().items():
        was = theirs.get(key, defaults.get(key))
        if key not in by_content and was != mine:
            hint = " (--weight-decay-all decays every parameter, as runs before the parameter groups did)" \
                if key == "weight_decay_all" else ""
            raise UserError(f"checkpoint in {where} is from another run: {key} was {was!r}, now {mine!r}{hint}")
    if not same_model(saved["signature"], stack.signature()):
        raise UserError(f"checkpoint in {where} does not match the model's layer layout")


def _offload_run(out: Path) -> str:
    """The run's id for its --eps-offload state files: the one in ``out`` (a resume, or a start
    that was killed before its first checkpoint), else a new one."""
    path = out / RUN_ID_FILE
    try:
        doc = json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        return uuid.uuid4().hex
    except (OSError, UnicodeDecodeError, ValueError):
        doc = None
    try:
        return check_run_id(doc["run_id"])
    except (TypeError, KeyError, ValueError):
        raise UserError(f"{path} is corrupt: it should hold the run's id (remove it to start the run's "
                        "--eps-offload state afresh)") from None


def run_dir(cfg: TrainConfig) -> Path:
    return Path(cfg.out or f"runs/{cfg.model}-{cfg.engine}")


def train(cfg: TrainConfig, depth: DepthPolicy | None = None) -> RunSummary:
    """Train as ``cfg`` says. ``depth``: which blocks each step leaves out (``l2l.depth``; a
    function of the step alone, so a resume repeats it); default ``--layer-drop``'s draw."""
    cfg = resumed(cfg, run_dir(cfg))  # a run of a model directory resumes from its own copy
    cfg.check()
    if depth is not None and cfg.layer_drop:
        raise UserError("a depth policy and --layer-drop both choose the blocks a step runs: give one")
    if lora_enabled(cfg):
        check_lora_model(cfg)  # before any data is read
        return_large_blocks()  # its large transients are the base's compute copies (hostmem.py)
    machines = distributed.setup()  # None unless launched as one of several ranks
    try:
        return _train(cfg, machines, depth)
    finally:
        distributed.teardown()


def _train(cfg: TrainConfig, machines, depth: DepthPolicy | None) -> RunSummary:
    rank, world = (machines.rank, machines.world) if machines else (0, 1)
    if world > 1:
        if cfg.engine != "l2l":
            raise UserError("torchrun with several machines needs --engine l2l")
        if cfg.eps == "board":
            raise UserError("--eps board with several machines is not supported: one board holds one machine's EPS")
        check_offload_machines(cfg, world)
        if rank != 0:  # rank 0 speaks and writes for the run
            cfg = replace(cfg, progress=False, plot=False, plan="off")
    out = run_dir(cfg)
    device = resolve_device(cfg.device)
    saved = None
    if cfg.resume:
        saved = ckpt.load_latest(out)
        if saved is None:
            raise UserError(f"--resume: no checkpoint in {out}")
        if cfg.schedule_steps is None:  # extending --steps keeps the run's own lr schedule
            cfg = replace(cfg, schedule_steps=saved.meta.get("trajectory", {}).get("schedule_steps"))
    elif ckpt.list_checkpoints(out) or (out / "metrics.jsonl").exists():
        raise UserError(f"{out} already holds a run; pass --resume to continue it or choose another --out")

    tokenizer = load_tokenizer(cfg.tokenizer, cfg.model if is_model_dir(cfg.model) else None)
    objective = family(cfg.model).objective
    if is_sft_data(cfg.data):  # prompt/completion or chat examples: the loss on the answers only
        if objective != "causal":
            raise UserError(f"{cfg.data}: prompt/completion and chat examples train a causal model, not {cfg.model}")
        corpus = load_examples(cfg.data, tokenizer)
        pad = tokenizer.eos_id or 0
        sampler = ExampleSampler(corpus.train, cfg.seq_len, cfg.batch_size, seed=cfg.seed, pad_id=pad, name="train")
        val_batches = ExampleSampler(corpus.val, cfg.seq_len, cfg.batch_size, seed=cfg.seed, pad_id=pad,
                                     name="val").fixed_batches(cfg.eval_batches)
    else:
        if objective == "mlm" and tokenizer.mask_id is None:
            raise UserError(f"{cfg.model} learns masked tokens, and {tokenizer.description} has no mask token")
        corpus = load_corpus(cfg.data, tokenizer=tokenizer)
        masking = dict(mask_id=tokenizer.mask_id, vocab_size=tokenizer.vocab_size) if objective == "mlm" else {}
        sampler = BatchSampler(corpus.train, cfg.seq_len, cfg.batch_size, objective, seed=cfg.seed, name="train",
                               **masking)
        val_batches = BatchSampler(corpus.val, cfg.seq_len, cfg.batch_size, objective, seed=cfg.seed,
                                   name="val", **masking).fixed_batches(cfg.eval_batches)
    stack = build_lora_stack(cfg, cfg.seed) if lora_enabled(cfg) else build_stack(cfg.model_config(), cfg.seed)
    if depth is None and cfg.layer_drop:
        depth = LayerDrop(cfg.layer_drop, len(stack.layers) - 2, cfg.seed)
    if tokenizer.vocab_size > stack.vocab_size:
        raise UserError(f"the tokenizer ({tokenizer.description}) has {tokenizer.vocab_size:,} tokens, more than "
                        f"the model's {stack.vocab_size:,} embeddings")
    if saved is not None:
        _check_resumable(cfg, saved.meta, stack, saved.path)
    offload_run = offload = None
    if cfg.eps_offload is not None:
        if saved is not None and saved.step >= cfg.steps:
            raise UserError(f"{out} is already at step {saved.step}; pass a larger --steps to continue it")
        offload_run = distributed.agree_text(_offload_run(out))  # rank 0's, when a new run draws one
        offload = offload_tiers(cfg, stack, offload_run, rank=rank, world=world)  # DIR checked, nothing written
    distributed.barrier()  # every machine has checked the run directory before rank 0 writes to it
    if offload_run is not None and rank == 0:  # before the state files: a killed start keeps its id
        out.mkdir(parents=True, exist_ok=True)
        ckpt.atomic_write_bytes(out / RUN_ID_FILE, (json.dumps({"run_id": offload_run}) + "\n").encode())
    # the forecast before the model: its fixed host cost is what the process holds now, and
    # what its measurements allocate is reused by the EPS instead of adding to the peak;
    # under torchrun the others would wait on rank 0's calibration: plan only when asked.
    # With --eps-offload the host figure is the disk model's (planner/forecast.py)
    plan_mode = cfg.plan_mode if world == 1 or cfg.plan else "off"
    plan = forecast(cfg, device, plan_mode, world) \
        if saved is None or saved.step < cfg.steps else None
    distributed.barrier()
    engine = build_engine(cfg, stack, device, rank=rank, world=world, offload=offload)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        if is_model_dir(cfg.model) and (saved is None or model_copy(out) is None):
            keep_model(cfg.model, out, stack.config.get("tensors"))  # what resume and export need of it
    try:
        return _run(cfg, out, device, corpus, sampler, val_batches, stack, engine, saved, plan, rank, world, depth)
    finally:
        engine.close()


def _run(cfg, out, device, corpus, sampler, val_batches, stack, engine: Engine, saved, plan, rank=0,
         world=1, depth: DepthPolicy | None = None) -> RunSummary:
    main = rank == 0
    start = 0
    initial_val = None
    if saved is not None:
        engine.load_state(saved.tensors, saved.meta["engine"])
        sampler.load_state_dict(saved.meta["data"])
        _restore_rng(saved.meta["rng"])
        start = saved.step
        initial_val = saved.meta.get("initial_val_loss")
        if start >= cfg.steps:
            raise UserError(f"{out} is already at step {start}; pass a larger --steps to continue it")
    if main:
        (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")

    say = _printer(cfg)
    trained = f"{stack.num_params / 1e6:.2f}M params" + (
        "" if stack.frozen is None else f" of LoRA adapters over {stack.frozen.numel / 1e6:.2f}M frozen")
    say(f"l2l: {cfg.engine} engine, {_model_line(cfg, stack)} ({trained}) on {device}"
        + (f" x {cfg.devices} workers" if cfg.devices > 1 else "")
        + (f", {world} machines" if world > 1 else "") + f"; data: {corpus.description}")
    eps = getattr(engine, "eps", None)  # the plain baseline has none
    if eps is not None and eps.choice is not None:
        say(f"l2l: {eps.choice.line(eps.backend)}")
        advice = eps.choice.gpu_advice(device.type)
        if advice:
            say(f"l2l: {advice}")
    if saved is not None:
        say(f"l2l: resumed from {saved.path} at step {start}")
    if plan is not None:
        say(f"l2l: plan ({'calibrated' if plan.calibrated else 'uncalibrated'}) {plan.text}")
    if start == 0:
        initial_val = engine.evaluate(val_batches)
        say(f"l2l: step 0 validation loss {initial_val:.4f}")

    log = MetricsLog(out / "metrics.jsonl", resume_from_step=start) if main else None
    bar = _progress(cfg, start)
    last_val, last_loss, tps_seen, step_times, digests = None, None, [], [], None
    peak = weight_peak = host_stash = 0
    disk_now = getattr(eps, "disk_io_now", None) if cfg.eps_offload is not None else None
    disk_at_start = disk_now() if disk_now is not None else None  # the ledger before the steps: the build's
    disk_mark = None  # the ledger at the last step's record
    try:
        for step in range(start, cfg.steps):
            lr = lr_at(step, lr=cfg.lr, warmup_steps=cfg.warmup_steps,
                       total_steps=cfg.total_schedule_steps, min_lr_ratio=cfg.min_lr_ratio)
            engine.set_lr(lr)
            batch = sampler.next()
            skip = _left_out(depth, step, len(stack.layers) - 2)
            t0 = time.perf_counter()
            if world > 1:  # this machine's shard; the loss's divisor stays the global batch's
                result = engine.train_step(batch.split(world)[rank], step, global_targets=batch.num_targets,
                                           skip_blocks=skip)
                result.loss = distributed.sum_over_machines(result.parts or [result.loss])
            else:
                result = engine.train_step(batch, step, skip_blocks=skip)
            dt = time.perf_counter() - t0
            step_times.append(dt)
            if not math.isfinite(result.loss):
                raise UserError(f"loss became {result.loss} at step {step + 1}; lower --lr")
            done = step + 1
            val = None
            if (cfg.eval_every and done % cfg.eval_every == 0) or done == cfg.steps:
                val = last_val = engine.evaluate(val_batches)
            tps = batch.inputs.numel() / dt  # the global batch, over all machines
            tps_seen.append(tps)
            last_loss = result.loss
            peak = max(peak, result.device_peak_bytes)
            weight_peak = max(weight_peak, result.device_weight_peak_bytes)
            host_stash = max(host_stash, result.host_stash_bytes)
            if world > 1 and cfg.check_every and (done % cfg.check_every == 0 or done == cfg.steps):
                digests = _check_machines(engine, done)
            host_rss = memory_status().get("VmRSS")
            disk_mark = disk_now() if disk_now is not None else None
            if log is not None:
                log.write({"step": done, "loss": result.loss, "val_loss": val, "lr": lr,
                           "tokens_per_s": tps, "step_time_s": dt, "eps_wait_s": result.eps_wait_s,
                           "host_rss_bytes": host_rss, "device_peak_bytes": result.device_peak_bytes,
                           "device_weight_peak_bytes": result.device_weight_peak_bytes,
                           "loss_scale": result.loss_scale, "skipped_layers": result.skipped_layers,
                           "grad_norm": result.grad_norm,
                           **({"skipped_blocks": sorted(skip)} if depth is not None else {}),
                           **({"eps_disk": disk_mark} if disk_mark is not None else {})})
            bar.update(1)
            bar.set_postfix_str(f"loss {result.loss:.3f} | {tps:,.0f} tok/s | dev {result.device_peak_bytes / 2**20:.1f} MiB"
                                + (f" | host {host_rss / 2**30:.2f} GiB" if host_rss else "")
                                + (f" | val {val:.3f}" if val is not None else ""))
            if ((cfg.save_every and done % cfg.save_every == 0) or done == cfg.steps) and (main or sharded(engine)):
                _save(cfg, out, done, engine, sampler, stack, initial_val)
    finally:
        bar.close()
        if log is not None:
            log.close()
    if cfg.steps == 0 and saved is None and (main or sharded(engine)):  # a run of no steps records the model
        _save(cfg, out, 0, engine, sampler, stack, initial_val)

    if main and cfg.plot and (out / "metrics.jsonl").stat().st_size:
        plot_metrics(out / "metrics.jsonl", out / "metrics.png",
                     title=f"{cfg.engine} {_model_line(cfg, stack)}",
                     initial_val_loss=initial_val)
    summary = RunSummary(out=str(out), steps=cfg.steps, initial_val_loss=initial_val,
                         final_val_loss=last_val, final_loss=last_loss,
                         mean_tokens_per_s=float(np.mean(tps_seen)) if tps_seen else None,
                         device_peak_bytes=peak, device_weight_peak_bytes=weight_peak,
                         host_peak_bytes=memory_status().get("VmHWM"), host_runtime_bytes=runtime_resident(),
                         host_stash_bytes=host_stash,
                         params=stack.num_params)
    summary.machines_weights_sha256 = digests
    # under torchrun: the final masters' digest, equal for any number of machines (and to
    # distributed.weights_digest of the last checkpoint's tensors, which a one-process run has)
    summary.weights_sha256 = digests[0] if digests else None
    if world > 1:
        summary.machines_host_peak_bytes = [int(x) for x in distributed.each_machine(
            summary.host_peak_bytes or 0, "the machines' peak memory")]
    if sharded(engine) and cfg.steps > start:  # what the machines sent each other a step, all together
        summary.collective_bytes_per_step = float(eps.net.sum_f64("the byte count", [eps.sent_bytes])[0]) / (cfg.steps - start)
    if eps is not None:
        summary.eps_copy_bytes = eps.copy_bytes
        if eps.choice is not None:
            summary.eps = eps.choice.record(eps.backend)
    if cfg.eps_offload is not None and eps is not None:
        summary.eps_disk = eps.disk_io()
        summary.eps_disk_at_start = disk_at_start
        if summary.eps_disk is not None and disk_at_start is not None and disk_mark is not None:
            # the calls between the first step's start and the last step's record
            summary.eps_disk["timeline_steps"] = eps.disk_timeline(disk_at_start["t"], disk_mark["t"])
    if plan is not None and step_times:
        line, summary.plan = plan.compare(step_times, peak, summary.host_peak_bytes)
        say(line)
    if main:
        ckpt.atomic_write_bytes(out / "summary.json",
                                (json.dumps(summary.__dict__, indent=2) + "\n").encode())
    if last_val is not None and initial_val is not None:
        say(f"l2l: validation loss {initial_val:.4f} -> {last_val:.4f} "
            f"({last_val / initial_val:.0%} of step 0); record in {out}")
    return summary


def _left_out(depth: DepthPolicy | None, step: int, blocks: int) -> frozenset[int]:
    """The blocks ``depth`` leaves out of ``step`` (none without a policy); a policy's mistake
    is the user's, in one line."""
    if depth is None:
        return frozenset()
    try:
        return blocks_left_out(depth, step, blocks)
    except ValueError as exc:
        raise UserError(str(exc)) from None


def sharded(engine) -> bool:
    """The engine's EPS is split across the machines (``--eps-layout sharded`` under torchrun)."""
    return isinstance(getattr(engine, "eps", None), ShardedParamServer)


def _check_machines(engine, step: int) -> list[str]:
    """Each machine's digest of the master weights, which must agree (replicated EPS); with a
    sharded EPS, the one digest of the global masters (each rank owns a part of them)."""
    if sharded(engine):
        return [engine.eps.masters_digest()]
    return distributed.check_agreement(engine.state_arrays(), step)


def _save(cfg, out: Path, step: int, engine, sampler, stack, initial_val) -> None:
    meta = {"format": FORMAT, "config": cfg.to_dict(), "trajectory": cfg.trajectory(),
            "signature": stack.signature(), "engine": engine.state_meta(),
            "data": sampler.state_dict(), "rng": _rng_meta(), "initial_val_loss": initial_val}
    if sharded(engine):  # every machine writes its slices; rank 0 the manifest
        pieces, starts, numels = engine.eps.state_pieces()
        ckpt.save_sharded_checkpoint(out, step, pieces, starts, numels, meta, engine.eps.net, keep=cfg.keep_checkpoints)
    else:
        ckpt.save_checkpoint(out, step, engine.state_arrays(), meta, keep=cfg.keep_checkpoints)


def _model_line(cfg: TrainConfig, stack) -> str:
    """What the run trains, in a few words: the shape options of a built-in model, or a
    directory's family and depth (its shape comes from its config, not the options)."""
    if "model_type" in stack.config:
        return f"{stack.config['model_type']} from {cfg.model}, {len(stack.layers) - 2} blocks"
    return f"{cfg.model} {cfg.layers} layers x d{cfg.d_model}"


def _printer(cfg: TrainConfig):
    def say(msg: str) -> None:
        if cfg.progress:
            print(msg, flush=True)
    return say


def _progress(cfg: TrainConfig, start: int):
    from tqdm import tqdm
    return tqdm(total=cfg.steps, initial=start, disable=not cfg.progress, unit="step",
                dynamic_ncols=True, mininterval=1.0, desc="train")
