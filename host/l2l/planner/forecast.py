"""The planner's forecast for a training run, printed beside what the run measures.

``l2l train`` asks :mod:`l2l.planner` for the step time and device memory it
expects before the first step, and at the end prints both next to the measured
median step time and device peak (and records all four in ``summary.json``),
so a user sees at once whether the run behaved as planned -- and the planner
is checked on every real run, not only in its own benchmark.

``--plan auto`` (the default) measures the device's matmul rate and the EPS
update rate (about a second) and calibrates the model's efficiency with a few
real relay steps of the same shape cut to 4 blocks when that costs at most 3 s
or 5% of the predicted run; ``calibrated`` always does, ``quick`` never does (the
pure-FLOP model, which predicts short), ``off`` skips the forecast.

With ``--eps-offload`` the host figure is the planner's disk model's
(:func:`~l2l.planner.disk.host_bytes_with_tier`: the state, and with
``--eps-offload-copies`` the copies, replaced by their windows). The step time stays the
compute's: timing the disk needs its bandwidth, which ``l2l plan --eps-offload DIR``
measures (256 MiB each way) and a training run should not pay for; the calibration's
steps keep their state in memory, so they write nothing in DIR.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, replace

import torch

from ..config import TrainConfig
from ..hostmem import memory_status
from .measure import calibrate, calibration_micro_batches, measure_rates
from .disk import entry_numels, host_bytes_with_tier, state_in_memory_bytes
from .model import Machines, predict
from .report import summary_line

CALIBRATION_SHARE = 0.05  # auto calibrates when that costs at most this share of the run,
CALIBRATION_FREE_S = 3.0  # or at most this many seconds


@dataclass
class Forecast:
    step_s: float
    device_bytes: int      # what the relay's ledger peaks at (device_peak_bytes on the CPU)
    host_bytes: int        # the planner's host memory: the process's peak resident set
    host_state_bytes: int  # of which the EPS's p, m, v and device copies (the byte budget's floor)
    calibrated: bool
    text: str              # the planner's one-line summary

    def compare(self, step_times: list[float], device_peak_bytes: int,
                host_peak_bytes: int | None = None) -> tuple[str, dict]:
        """One line and a dict comparing the forecast with what the run measured."""
        # the first step pays allocation and warm-up; the median of the rest is the steady state
        steady = step_times[1:] or step_times
        measured = statistics.median(steady)
        err = measured / self.step_s - 1.0
        line = (f"l2l: step time {measured:.3f} s measured (median), {self.step_s:.3f} s predicted "
                f"({err:+.0%}{'' if self.calibrated else ', uncalibrated'}); device peak "
                f"{device_peak_bytes / 2**20:,.1f} MiB measured, {self.device_bytes / 2**20:,.1f} MiB predicted")
        if host_peak_bytes:
            line += (f"; host peak {host_peak_bytes / 2**30:,.2f} GiB measured, {self.host_bytes / 2**30:,.2f} GiB "
                     f"predicted ({host_peak_bytes / self.host_bytes - 1:+.0%})")
        record = {"predicted_step_s": self.step_s, "measured_step_s": measured,
                  "predicted_device_bytes": self.device_bytes, "predicted_host_bytes": self.host_bytes,
                  "predicted_host_state_bytes": self.host_state_bytes,
                  "measured_host_peak_bytes": host_peak_bytes, "plan_calibrated": self.calibrated}
        return line, record


def forecast(cfg: TrainConfig, device: torch.device, mode: str, world: int = 1) -> Forecast | None:
    """The planner's prediction for ``cfg`` on ``device`` (None for the plain engine or mode off),
    for one of ``world`` machines under torchrun (its share of the batch and of a sharded EPS;
    the network free: the rates measured here know nothing of it); call it before building
    the model: the host figure starts from what the process holds."""
    if mode == "off" or cfg.engine != "l2l":
        return None
    machines = Machines.of(cfg, world)
    runtime = memory_status().get("VmRSS")  # called before the model: the run's fixed host cost
    in_memory = replace(cfg, eps_offload=None, eps_offload_copies=False)  # what the measurements run
    rates = measure_rates(device, in_memory, calibrate_steps=False)
    if runtime:  # with the EPS backend's own runtime (loaded by the measurement, kept by the run)
        rates = replace(rates, runtime_bytes=runtime + rates.notes.get("eps_runtime_bytes", 0))
    calibrated = mode == "calibrated"
    if mode == "auto":
        budget = max(CALIBRATION_FREE_S, CALIBRATION_SHARE * predict(cfg, rates, machines=machines).step_s * cfg.steps)
        calibrated = _calibration_cost_s(cfg, rates) <= budget
    if calibrated:
        rates = calibrate(in_memory, rates, device)
    p = predict(cfg, rates, machines=machines)  # with the tier, the copies counted in memory (no masters to share)
    host, state = p.host_total_bytes, p.host_state_bytes
    if cfg.eps_offload is not None:
        host = host_bytes_with_tier(p, entry_numels(cfg), cfg.eps_offload_window, cfg.eps_offload_copies)
        state = 0 if cfg.eps_offload_copies else p.host_state_bytes - state_in_memory_bytes(p)
    # the peak so far (imports, the data, these measurements) bounds the run's from below:
    # a small model's EPS fits in what the measurements freed
    peak_so_far = memory_status().get("VmHWM", 0)
    return Forecast(step_s=p.step_s, device_bytes=p.device_ledger_bytes,
                    host_bytes=max(host, peak_so_far), host_state_bytes=state,
                    calibrated=calibrated,
                    text=summary_line(p))


def _calibration_cost_s(cfg: TrainConfig, rates) -> float:
    """Seconds :func:`l2l.planner.calibrate` would take: 6 steps at M=1 and M=max (4 blocks)."""
    small = replace(cfg, layers=max(1, min(cfg.layers, 4)))
    return 6 * sum(predict(replace(small, micro_batches=m), rates).step_s for m in calibration_micro_batches(cfg))
