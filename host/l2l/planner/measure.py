"""The machine's rates, measured: a matmul, the host<->device link, the EPS update, and the
relay's achieved efficiency and per-call cost, fitted to real relay steps (:func:`calibrate`)."""
from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import replace

import torch

from ..build import build_engine
from ..config import TrainConfig
from ..models import build_stack
from .model import Rates, divisors, pass_kinds, predict, serial_micro_batches
from .shapes import dtype_bytes_of

# ---------------------------------------------------------------- measuring

def _median_time(fn, repeats: int, sync=None) -> float:
    times = []
    for _ in range(repeats):
        if sync:
            sync()
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_matmul(device: torch.device, tokens: int, d_model: int, *, dtype=torch.float32,
                   repeats: int = 5, min_time_s: float = 0.02) -> float:
    """FLOP/s of ``(tokens x d) @ (d x 4d)``, the shape of a block's MLP at one micro-batch."""
    a = torch.randn(tokens, d_model, device=device, dtype=dtype)
    w = torch.randn(4 * d_model, d_model, device=device, dtype=dtype)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
    torch.nn.functional.linear(a, w)
    one = max(_median_time(lambda: torch.nn.functional.linear(a, w), 2, sync), 1e-7)
    inner = max(1, int(min_time_s / one))

    def run():
        for _ in range(inner):
            torch.nn.functional.linear(a, w)
    return 2.0 * tokens * d_model * 4 * d_model * inner / _median_time(run, repeats, sync)


def measure_link(device: torch.device, nbytes: int = 64 << 20, repeats: int = 5) -> tuple[float | None, float | None]:
    """(host->device, device->host) bytes/s of pinned copies; (None, None) on the CPU (zero-copy)."""
    if device.type != "cuda":
        return None, None
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    def sync():
        torch.cuda.synchronize(device)
    dev.copy_(host, non_blocking=True)
    host.copy_(dev, non_blocking=True)
    h2d = _median_time(lambda: dev.copy_(host, non_blocking=True), repeats, sync)
    d2h = _median_time(lambda: host.copy_(dev, non_blocking=True), repeats, sync)
    return nbytes / h2d, nbytes / d2h


def measure_eps(name: str = "numpy", numel: int = 4 << 20, repeats: int = 3, **options) -> float:
    """Elements/s of one EPS layer update (reduce one fp32 gradient, AdamW, fp32 copy) on a new
    backend ``name``."""
    from ..eps import make_backend
    backend = make_backend(name, **options)
    try:
        return measure_backend(backend, numel, repeats)
    finally:
        backend.close()


def measure_backend(backend, numel: int = 4 << 20, repeats: int = 3, optimizer: str = "adamw") -> float:
    """Elements/s of one ``optimizer`` update of a ``numel``-element layer on ``backend`` (layer 0
    is taken)."""
    import numpy as np

    from ..eps import OPTIMIZERS, OptimizerHyper
    from ..eps.contract import step_scalars
    from ..eps.numerics import as_step
    rng = np.random.default_rng(0)
    backend.allocate(0, rng.standard_normal(numel, dtype=np.float32), len(OPTIMIZERS[optimizer].moments))
    grads = (rng.standard_normal((1, numel), dtype=np.float32) * np.float32(1e-3))
    copy = np.empty(numel, np.float32)
    step = iter(range(1, 1 << 30))
    hyper = OptimizerHyper(optimizer=optimizer)

    def run():
        backend.step(0, grads, as_step(step_scalars(hyper, next(step), divisor=1.0), numel), copy)
    run()
    return numel / _median_time(run, repeats)


def synthetic_batch(cfg: TrainConfig, seed: int = 0):
    """A batch of random byte tokens in ``cfg``'s shape, for timing (no corpus needed)."""
    from ..data import Batch
    from ..models.config import BYTE_VOCAB
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, BYTE_VOCAB, (cfg.batch_size, cfg.seq_len + 1), generator=g)
    return Batch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def time_relay_steps(cfgs: Sequence[TrainConfig], device: torch.device | str = "cpu", *, steps: int = 3,
                     warmup: int = 1) -> list[float]:
    """Median step seconds of each of ``cfgs``' relays, built together and stepped in
    turn, so that drift in the machine's speed falls on all of them alike."""
    device = torch.device(device)
    cfgs = [replace(c, engine="l2l", device=device.type) for c in cfgs]
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
    engines = []
    try:
        for c in cfgs:
            engines.append(build_engine(c, build_stack(c.model_config(), c.seed), device))
        batches = [synthetic_batch(c) for c in cfgs]
        times: list[list[float]] = [[] for _ in cfgs]
        for step in range(warmup + steps):
            for k, engine in enumerate(engines):
                if sync:
                    sync()
                t0 = time.perf_counter()
                engine.train_step(batches[k], step)
                if sync:
                    sync()
                if step >= warmup:
                    times[k].append(time.perf_counter() - t0)
        return [statistics.median(t) for t in times]
    finally:
        for engine in engines:
            engine.close()


def _fit_terms(cfg: TrainConfig, rates: Rates, db: int | None) -> tuple[float, float, float]:
    """(compute seconds at efficiency 1 and no per-call cost, per-call units, the rest of
    the step: exposed transfers and EPS) of ``cfg``'s predicted step."""
    base = replace(rates, efficiency=1.0, per_call_s=0.0)
    p = predict(cfg, base, dtype_bytes=db)
    # the calls in a row, as the step's compute counts them (K GPUs: one worker's)
    units = serial_micro_batches(cfg, base) * sum(1 if kind == "fwd" else 3 for kind in pass_kinds(len(p.layer_params)))
    return p.compute_s - p.stash_transfer_s, units, p.step_s - p.compute_s + p.stash_transfer_s


def calibration_micro_batches(cfg: TrainConfig) -> list[int]:
    """The two micro-batch counts :func:`calibrate` times: the fewest and the most (up to 8) that
    divide the batch and split over ``cfg.devices`` workers (1 and 8 for one worker)."""
    ms = [m for m in divisors(cfg.batch_size) if m % cfg.devices == 0]
    return sorted({ms[0], max([m for m in ms if m <= 8 * cfg.devices] or ms[:1])})


def calibrate(cfg: TrainConfig, rates: Rates, device: torch.device | str = "cpu", *, layers: int = 4,
              micro_batches: Sequence[int] | None = None, steps: int = 5, warmup: int = 1,
              dtype_bytes: int | None = None) -> Rates:
    """Fit ``rates.efficiency`` and ``rates.per_call_s`` to real relay steps.

    Times ``steps`` relay steps (median, after ``warmup``) of ``cfg`` cut to
    ``layers`` blocks, at each of ``micro_batches`` (default: 1 and the largest
    divisor of the batch up to 8), the engines stepped in turn, and solves by
    least squares over those points ``measured - (exposed transfers and EPS) =
    A / efficiency + N * per_call_s``, where ``A`` is the step's compute at the
    matmul rate and ``N`` counts its calls (a forward call 1, a recompute +
    backward call 3, per layer per micro-batch). Two micro-batch counts
    separate the two: the FLOPs stay, the calls multiply. If the fit gives a
    negative per-call cost (noise, or one point), the per-call cost is 0 and
    the efficiency is fitted alone. The efficiency is relative to the measured
    matmul rate, so for models of the calibrated shape an error in that rate
    cancels.
    """
    small = replace(cfg, layers=max(1, min(cfg.layers, layers)))
    ms = list(micro_batches) if micro_batches else calibration_micro_batches(cfg)
    cfgs = [replace(small, micro_batches=m) for m in ms]
    measured = time_relay_steps(cfgs, device, steps=steps, warmup=warmup)
    fitted = fit_calibration(rates, list(zip(cfgs, measured)), dtype_bytes=dtype_bytes)
    notes = dict(fitted.notes)
    notes["calibration"] = {**notes["calibration"], "model": small.model, "layers": small.layers,
                            "d_model": small.d_model, "seq_len": small.seq_len, "batch_size": small.batch_size,
                            "steps": steps}
    return replace(fitted, notes=notes)


def fit_calibration(rates: Rates, timed: Sequence[tuple[TrainConfig, float]], *,
                    dtype_bytes: int | None = None) -> Rates:
    """``rates`` with ``efficiency`` and ``per_call_s`` fitted to relay steps already
    timed: ``(config, seconds)`` pairs (see :func:`calibrate`)."""
    points = []
    for c, measured in timed:
        a, n, rest = _fit_terms(c, rates, dtype_bytes)
        points.append({"micro_batches": c.micro_batches, "measured_s": measured, "a": a, "n": n,
                       "y": max(measured - rest, 1e-9)})
    inv_e, per_call = _least_squares(points)
    if per_call < 0 or inv_e <= 0:
        per_call = 0.0
        inv_e = sum(p["y"] * p["a"] for p in points) / sum(p["a"] ** 2 for p in points)
    notes = dict(rates.notes)
    notes["calibration"] = {"points": [{"layers": c.layers, "micro_batches": c.micro_batches, "measured_s": t}
                                       for c, t in timed]}
    return replace(rates, efficiency=1.0 / inv_e, per_call_s=per_call, notes=notes)


def _least_squares(points: list[dict]) -> tuple[float, float]:
    """(1/efficiency, per_call_s) minimising the relative error of ``y = a x + n c``."""
    if len(points) < 2:
        p = points[0]
        return p["y"] / p["a"], 0.0
    # weight each point by 1/y: every configuration counts alike, whatever its length
    saa = sum((p["a"] / p["y"]) ** 2 for p in points)
    snn = sum((p["n"] / p["y"]) ** 2 for p in points)
    san = sum(p["a"] * p["n"] / p["y"] ** 2 for p in points)
    say = sum(p["a"] / p["y"] for p in points)
    sny = sum(p["n"] / p["y"] for p in points)
    det = saa * snn - san * san
    if abs(det) < 1e-12 * saa * snn:
        return say / saa, 0.0
    return (say * snn - sny * san) / det, (saa * sny - san * say) / det


def measure_rates(device: torch.device | str = "cpu", cfg: TrainConfig | None = None, *,
                  calibrate_steps: bool = True, layers: int = 4,
                  steps: int = 5, dtype_bytes: int | None = None) -> Rates:
    """The rates of this machine for ``cfg`` (default: the default TrainConfig).

    * compute: FLOP/s of a ``(b*T x d) @ (d x 4d)`` matmul (b = B/M sequences:
      one micro-batch through a block's MLP), median of 5, with torch's threads
      as they are set now;
    * link: pinned host<->device copies of 64 MiB on CUDA; None on the CPU
      (zero-copy);
    * EPS: one update of a 4M-element layer with the backend ``cfg`` gets (``--eps auto``
      resolved as the run resolves it);
    * efficiency and per-call cost: :func:`calibrate`, ``steps`` relay steps of
      ``cfg`` cut to ``layers`` blocks at M = 1 and 8 (about 6 s for the bench's
      d 256 shape on this project's CPU); with ``calibrate_steps`` False,
      efficiency 1 and no per-call cost: the pure-FLOP model.
    """
    device = torch.device(device)
    cfg = cfg or TrainConfig()
    db = dtype_bytes_of(cfg, dtype_bytes)
    dtype = {4: torch.float32, 2: torch.bfloat16 if getattr(cfg, "precision", "") != "fp16" else torch.float16,
             8: torch.float64}.get(db, torch.float32)
    flops = measure_matmul(device, (cfg.batch_size // cfg.micro_batches) * cfg.seq_len, cfg.d_model, dtype=dtype)
    link_in, link_out = measure_link(device)
    from ..eps.choice import build
    from ..hostmem import memory_status
    before = memory_status().get("VmRSS", 0)
    backend, choice = build(cfg.eps_choice())
    # what the backend's runtime keeps resident once loaded (PoCL and its compiler: tens of
    # MiB), a fixed host cost of the run beside the interpreter's
    runtime = max(0, memory_status().get("VmRSS", 0) - before)
    try:
        eps_rate = measure_backend(backend, backend.probe_numel, optimizer=cfg.optimizer)
        notes = {"device": str(device), "torch_threads": torch.get_num_threads(), "eps_backend": choice.name,
                 "eps_runs_on": backend.describe(), "eps_runtime_bytes": runtime,
                 "measured": ["compute", "link", "eps"]}
    finally:
        backend.close()
    rates = Rates(flops_per_s=flops, link_bytes_per_s=link_in, link_out_bytes_per_s=link_out,
                  eps_elems_per_s=eps_rate, device=device.type, notes=notes)
    if calibrate_steps:
        rates = calibrate(cfg, rates, device, layers=layers, steps=steps, dtype_bytes=dtype_bytes)
    return rates
