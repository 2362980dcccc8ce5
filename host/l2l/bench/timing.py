"""Engines timed in turn: the one way every benchmark times training steps."""
from __future__ import annotations

import statistics
import time

import torch

from ..build import build_engine, resolve_device
from ..config import TrainConfig
from ..data import BatchSampler
from ..models import build_stack


def time_engines(configs: dict[str, TrainConfig], sampler: BatchSampler, steps: int,
                  warmup: int) -> dict[str, dict]:
    """Median step time of each engine, stepping them in turn so that drift in the
    machine's speed (other load, clocks) falls on all of them alike; for the relay
    also the share of the step its EPS spent updating (busy) and it spent waiting."""
    device = resolve_device(next(iter(configs.values())).device)
    engines = {name: build_engine(cfg, build_stack(cfg.model_config(), cfg.seed), device)
               for name, cfg in configs.items()}
    times = {name: [] for name in engines}
    waits = {name: [] for name in engines}
    peaks = {name: 0 for name in engines}
    busy = {name: 0.0 for name in engines}
    try:
        for step in range(warmup + steps):
            batch = sampler.batch(step)
            for name, engine in engines.items():
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                eps = getattr(engine, "eps", None)
                before = eps.update_seconds if eps is not None else 0.0
                t0 = time.perf_counter()
                result = engine.train_step(batch, step)
                if eps is not None:  # the step's updates belong to the step
                    eps.synchronize()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if step >= warmup:
                    if eps is not None:
                        busy[name] += eps.update_seconds - before
                    times[name].append(time.perf_counter() - t0)
                    waits[name].append(result.eps_wait_s)
                    peaks[name] = max(peaks[name], result.device_peak_bytes)
    finally:
        for engine in engines.values():
            engine.close()
    out = {}
    for name in engines:
        median = statistics.median(times[name])
        out[name] = {"step_s": median, "eps_wait_share": statistics.median(waits[name]) / median,
                     "eps_busy_share": busy[name] / sum(times[name]), "device_peak_bytes": peaks[name]}
    return out
