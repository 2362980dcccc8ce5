"""What only a GPU shows, in one run sized for a short device lease (whole run < 8 min on one H200).

    python bench/gpu_check.py --dry-run                         # here, no GPU: the plan, and whether it fits
    python bench/gpu_check.py --out bench/results/gpu           # on the CUDA machine
    python bench/gpu_check.py --smoke --out /tmp/gpu-smoke      # tiny shapes, any device (checks the script)
    python bench/gpu_check.py --sections throughput,batch --out o  # only those sections (start-up always runs)

Sections, in order (each a time box inside the whole-run budget, ``--minutes``, default 8):

0. EPS probe: one 4M-element update with the NumPy and the OpenCL (PoCL, host CPU) EPS;
   every later row uses the faster (NumPy when OpenCL is not usable), and says so. Beside
   them, the backend ``--eps auto`` takes on that box and its rate (``eps_probe.auto``).
1. Correctness, on a small model, under ``torch.use_deterministic_algorithms`` (TF32 off,
   attention on SDPA's math path): the relay against ``--engine plain`` (fp32 and bf16,
   dropout 0: the plain engine draws its own dropout masks), ``--stash host`` against
   ``--stash device`` with dropout 0.1 (fp32 and bf16: must be bit-identical), the copy-stream
   prefetch on against off (bf16, dropout 0.1: bit-identical), and the
   relay's first-step gradients with dropout 0.1 against an in-memory reference drawing
   the relay's per-(layer, micro-batch) masks (the CUDA RNG replay). PASS/FAIL per row.
2. Device memory against depth: one relay step at several depths, ``--stash device`` and
   ``--stash host``; measured peaks beside the planner's.
3. Throughput against the baseline: the relay, ``plain --checkpointing`` and ``plain``
   (both accumulating the same micro-batches, so that they fit); tokens/s, MFU, wall and
   CUDA-event step times, the EPS wait.
4. Batch: the relay and ``plain --checkpointing`` at four times the throughput rows' batch
   (the same micro-batch size): the relay's compute per step grows with the batch while its
   EPS work does not, so this is where the updates hide behind the GPU.
5. Overlap: the relay with its copy-stream prefetch, and without (weights fetched when needed).
6. The largest relay model: its depth computed from the host-memory arithmetic below (and
   the time left), not found by trial; one build and two steps.

Memory arithmetic (``--dry-run``, and before every row): device bytes are the planner's
(``l2l.planner.predict``); host bytes are the EPS state (fp32 p, m, v), the pinned
buffers -- each layer's device copy and gradient inbox and each host-stash buffer -- as
torch's pinned allocator holds them (each rounded up to a power of two:
``l2l.relay.pinned.pinned_block_bytes``), and the fp32 model while it is built. A row is
refused when it would not fit the device machine (``DEVICE_BYTES``, ``HOST_BYTES``: the
H200 machine's, constants here because this CPU machine cannot see it) or its time box.

Every row is written to ``gpu_check.json`` and ``gpu_check.md`` under ``--out`` as it
finishes (atomically: a temporary file renamed); a section that runs out of time records
what it has and why; a watchdog ends the run at the budget with the files in place.
``--smoke`` runs the same code on tiny shapes, under PyTorch's CUDA sanitizer on a GPU.
"""
from __future__ import annotations

import os

# cuBLAS reads this when it starts; the correctness section's deterministic GEMMs need it
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from dataclasses import asdict, dataclass, field, replace  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from l2l.hostmem import memory_status, reset_peak_resident  # noqa: E402
from l2l.build import build_engine, resolve_device  # noqa: E402
from l2l.config import TrainConfig  # noqa: E402
from l2l.data import BatchSampler, load_corpus  # noqa: E402
from l2l.models import build_stack, family  # noqa: E402
from l2l.planner import Rates, layer_shapes, predict  # noqa: E402
from l2l.eps.choice import build as build_eps, choose as choose_eps  # noqa: E402
from l2l.planner.measure import measure_backend, measure_eps  # noqa: E402
from l2l.planner.model import activation_bytes  # noqa: E402
from l2l.planner.shapes import EPS_STATE_BYTES, dtype_bytes_of  # noqa: E402
from l2l.relay.engine import RelayEngine  # noqa: E402
from l2l.relay.pinned import pinned_block_bytes  # noqa: E402
from l2l.relay.rng import derive_seed, replay_rng  # noqa: E402

GiB = 1 << 30

# ------------------------------------------------------------------ the device machine
# What the H200 machine has (this machine cannot see it; --host-bytes/--device-bytes override).
DEVICE_BYTES = 141 * 10**9       # one H200: 141 GB of HBM3e
HOST_BYTES = 128 * GiB           # host memory as that machine reports it
HOST_RESERVE = 12 * GiB          # kernel, page cache floor, python + torch + CUDA runtime, corpus
DEVICE_RESERVE = 6 * 10**9       # CUDA context, cuBLAS workspaces, caching-allocator fragmentation
PEAK_TFLOPS = {"bf16": 989.4, "fp16": 989.4, "fp32": 494.7}  # H200 SXM dense (fp32 = TF32)
# Assumed rates of that machine for the time estimates (none measured yet):
EFFICIENCY = 0.4                 # the relay's share of the matmul peak
PER_CALL_S = 30e-6               # launches + autograd + Python per layer call
LINK_BYTES_PER_S = 40e9          # pinned PCIe Gen5 x16, either way
EPS_ELEMS_PER_S = 1.0e9          # OpenCL EPS on 16 cores (NumPy, single-threaded: ~2e8)
BUILD_PARAMS_PER_S = 4.7e7       # model init + EPS allocation; measured on this project's 2-core CPU
ROW_OVERHEAD_S = 2.0             # sampler, close, gc, cache flushes per row
STARTUP_S = 20.0                 # imports, CUDA init, corpus, EPS probe

BUDGET_S = 8 * 60
BOXES = {"startup": 20, "correctness": 25, "memory": 60, "throughput": 90, "batch": 80, "overlap": 50,
         "largest": 125}
SECTIONS = tuple(k for k in BOXES if k != "startup")
MARGIN_S = 30  # never planned: the watchdog's and the last files' share

TOL_FP32 = 2e-5  # CPU suite: relay within 1e-5 of plain over 20 steps; x2 for cuBLAS picking other kernels
TOL_BF16 = 2e-3  # half of bf16's unit roundoff (2^-8 = 3.9e-3): the loss is a mean over b*T tokens whose
#                  roundings at other places (micro-batch vs whole-batch GEMMs, the relay's bf16 gradient
#                  sum over M) mostly cancel; a systematic error of one rounding step fails
TOL_REPLAY = 1e-5  # CPU suite's bound on gradients vs the reference with the relay's masks
CORRECTNESS_LR = 5e-4  # the CPU equivalence suite's: Adam's noise-direction steps scale with lr


# ------------------------------------------------------------------ the plan

@dataclass
class Row:
    section: str
    name: str
    cfg: TrainConfig
    steps: int = 1
    warmup: int = 1
    prefetch: bool = True
    pair: TrainConfig | None = None  # correctness: what ``cfg`` is compared against
    pair_prefetch: bool = True       # correctness: the pair's copy-stream prefetch
    check: str = ""                  # correctness: "loss" | "bitwise" | "replay"
    tol: float = 0.0


def _model(d_model: int, heads: int, layers: int, seq_len: int, batch: int, m: int, **kw) -> TrainConfig:
    return TrainConfig(d_model=d_model, heads=heads, layers=layers, seq_len=seq_len, batch_size=batch,
                       micro_batches=m, progress=False, devices=1, **kw)


def plan(smoke: bool, largest_scale: float, machine: "Machine") -> list[Row]:
    """The rows of the run, in order. The largest model's depth comes from :func:`size_largest`."""
    if smoke:
        small = _model(32, 2, 2, 32, 8, 4, lr=CORRECTNESS_LR)
        mem = _model(64, 4, 2, 64, 8, 4)
        depths = [2, 4]
        thr = _model(64, 4, 4, 64, 8, 4, precision="bf16")
        ovl = thr
        batch = replace(thr, batch_size=32, micro_batches=16)
        big = _model(64, 4, 1, 64, 8, 4, precision="bf16", stash="host")
        steps, cor_steps, max_layers = 2, 3, 4
    else:
        small = _model(256, 4, 4, 256, 8, 4, lr=CORRECTNESS_LR)
        mem = _model(1024, 16, 4, 1024, 16, 4)
        depths = [4, 8, 16, 32]
        # batch 64 x 1024 tokens: the relay's compute per layer fetch outlasts the EPS update
        thr = _model(2048, 16, 16, 1024, 64, 8, precision="bf16")
        ovl = replace(thr, layers=8)
        batch = replace(thr, batch_size=256, micro_batches=32)  # 8 sequences a micro-batch, as thr
        # d 9216: a block's bf16 copy (2.04 GB) sits just under 2 GiB, so the pinned
        # allocator's power-of-two rounding wastes 5% (d 8192: 1.61 GB -> 2 GiB, 33%)
        big = _model(9216, 72, 1, 1024, 8, 4, precision="bf16", stash="host")
        steps, cor_steps, max_layers = 4, 5, 64
    rows = []
    for precision, tol in (("fp32", TOL_FP32), ("bf16", TOL_BF16)):
        c = replace(small, precision=precision)
        rows.append(Row("correctness", f"l2l vs plain, {precision}, dropout 0", c, cor_steps, 0,
                        pair=replace(c, engine="plain"), check="loss", tol=tol))
    for precision in ("fp32", "bf16"):
        c = replace(small, precision=precision, dropout=0.1, stash="host")
        rows.append(Row("correctness", f"stash host vs device, {precision}, dropout 0.1", c, cor_steps, 0,
                        pair=replace(c, stash="device"), check="bitwise"))
    c = replace(small, precision="bf16", dropout=0.1)  # the copy stream changes when, never what
    rows.append(Row("correctness", "prefetch on vs off, bf16, dropout 0.1", c, cor_steps, 0, pair=c,
                    pair_prefetch=False, check="bitwise"))
    rows.append(Row("correctness", "dropout replay: gradients vs reference, fp32, dropout 0.1",
                    replace(small, dropout=0.1), 1, 0, check="replay", tol=TOL_REPLAY))
    for stash in ("device", "host"):
        rows += [Row("memory", f"stash {stash}, L={n}", replace(mem, layers=n, stash=stash), 1, 1) for n in depths]
    rows += [Row("throughput", "l2l", thr, steps, 2),
             Row("throughput", "plain --checkpointing", replace(thr, engine="plain", checkpointing=True,
                                                               accumulate=True), steps, 2),
             Row("throughput", "plain", replace(thr, engine="plain", accumulate=True), steps, 2)]
    b = f"batch {batch.batch_size}, M {batch.micro_batches}"
    rows += [Row("batch", f"l2l, {b}", batch, max(2, steps // 2), 1),
             Row("batch", f"plain --checkpointing, {b}", replace(batch, engine="plain", checkpointing=True,
                                                                 accumulate=True), max(2, steps // 2), 1)]
    rows += [Row("overlap", "l2l, prefetch", ovl, steps, 2),
             Row("overlap", "l2l, no prefetch", ovl, steps, 2, prefetch=False)]
    layers, _ = size_largest(big, machine, BOXES["largest"], max_layers)
    layers = max(1, round(max(layers, 1) * largest_scale))
    rows.append(Row("largest", f"L={layers}", replace(big, layers=layers), 1, 1))
    for r in rows:  # an impossible setting fails here, in the dry run, not on the lease
        r.cfg.check()
        if r.pair is not None:
            r.pair.check()
    return rows


# ------------------------------------------------------------------ the arithmetic

@dataclass
class Machine:
    device_bytes: int = DEVICE_BYTES
    host_bytes: int = HOST_BYTES
    eps_rate: float = EPS_ELEMS_PER_S
    build_rate: float = BUILD_PARAMS_PER_S
    step_factor: float = 1.0  # measured / predicted step time, once rows have run

    @property
    def usable_host(self) -> int:
        return self.host_bytes - HOST_RESERVE

    @property
    def usable_device(self) -> int:
        return self.device_bytes - DEVICE_RESERVE

    def rates(self, cfg: TrainConfig) -> Rates:
        return Rates(flops_per_s=PEAK_TFLOPS[cfg.precision] * 1e12, efficiency=EFFICIENCY, per_call_s=PER_CALL_S,
                     link_bytes_per_s=LINK_BYTES_PER_S, eps_elems_per_s=self.eps_rate, device="cuda")


@dataclass
class Estimate:
    params: int
    host: dict      # bytes by part; "total" is what must fit
    device: int
    step_s: float
    seconds: float  # the whole row: build(s) and every step

    def problems(self, m: Machine, box_s: float | None) -> list[str]:
        out = []
        if self.host["total"] > m.usable_host:
            out.append(f"host {self.host['total'] / GiB:.1f} GiB > {m.usable_host / GiB:.1f} GiB usable "
                       f"({m.host_bytes / GiB:.0f} GiB - {HOST_RESERVE / GiB:.0f} GiB reserve)")
        if self.device > m.usable_device:
            out.append(f"device {self.device / GiB:.1f} GiB > {m.usable_device / GiB:.1f} GiB usable")
        if box_s is not None and self.seconds > box_s:
            out.append(f"estimated {self.seconds:.0f} s > its section's {box_s:.0f} s box")
        return out


def host_bytes(cfg: TrainConfig, stash_boundaries: int) -> dict:
    """Host bytes of a relay of ``cfg``: the larger of the build phase (fp32 model + EPS state +
    device copies) and the training phase (EPS state + copies + inboxes + host stash), pinned
    buffers counted as the pinned allocator holds them."""
    shapes = layer_shapes(cfg)
    db = dtype_bytes_of(cfg)
    entries = [s.params - s.counted_before for s in shapes]
    params = sum(entries)
    eps = params * EPS_STATE_BYTES + 2 * 4 * max(entries)  # p, m, v + the backend's reduce scratch
    copies = sum(pinned_block_bytes(n * db) for n in entries)
    inboxes = sum(pinned_block_bytes(n * db * cfg.devices) for n in entries)
    act = cfg.batch_size // cfg.micro_batches * cfg.seq_len * cfg.d_model * db
    stash = stash_boundaries * pinned_block_bytes(act)
    build = 4 * params + eps + copies + 2 * 4 * max(entries)  # + one entry flattened and copied
    train = eps + copies + inboxes + stash
    return {"eps": eps, "pinned_copies": copies, "pinned_inboxes": inboxes, "pinned_stash": stash,
            "pinned_requested": params * db * (1 + cfg.devices) + stash_boundaries * act,
            "build_phase": build, "train_phase": train, "total": max(build, train)}


def estimate(row: Row, m: Machine) -> Estimate:
    cfgs = [row.cfg] + ([row.pair] if row.pair is not None else [])
    ests = [_estimate_one(c, m, row.steps + row.warmup) for c in cfgs]
    if row.check == "replay":  # the in-memory reference: one more model and step
        ests.append(_estimate_one(replace(row.cfg, engine="plain"), m, 1))
    first = ests[0]
    return Estimate(first.params, max((e.host for e in ests), key=lambda h: h["total"]),
                    max(e.device for e in ests), first.step_s, sum(e.seconds for e in ests) + ROW_OVERHEAD_S)


def _estimate_one(cfg: TrainConfig, m: Machine, steps: int) -> Estimate:
    relay_cfg = replace(cfg, engine="l2l", checkpointing=False, accumulate=False)
    p = predict(relay_cfg, m.rates(relay_cfg))
    db = p.dtype_bytes
    build_s = p.params / m.build_rate
    if cfg.engine == "l2l":
        act = cfg.batch_size // cfg.micro_batches * cfg.seq_len * cfg.d_model * db
        host = host_bytes(cfg, p.host_stash_bytes // act if cfg.stash == "host" else 0)
        step_s = p.step_s * m.step_factor
        return Estimate(p.params, host, p.device_total_bytes, step_s, build_s + steps * step_s)
    # plain: the fp32 model built on the host and moved; on the device fp32 weights, gradients,
    # AdamW's two moments, the cast copy below fp32, and the activations of one micro-batch
    # (accumulating) or of the whole batch
    shapes = layer_shapes(cfg)
    mb = cfg.micro_batches if cfg.accumulate else 1
    per_layer = activation_bytes(replace(cfg, micro_batches=mb), shapes, db)
    boundary = cfg.batch_size // mb * cfg.seq_len * cfg.d_model * db
    acts = (cfg.layers * boundary + per_layer) if cfg.checkpointing else cfg.layers * per_layer
    device = p.params * (16 + (db if db < 4 else 0)) + acts
    host = {"eps": 0, "pinned_copies": 0, "pinned_inboxes": 0, "pinned_stash": 0, "pinned_requested": 0,
            "build_phase": 4 * p.params, "train_phase": 0, "total": 4 * p.params}
    # no recompute without checkpointing: 3/4 of the relay's compute; no EPS, no link
    step_s = p.compute_s * (1.0 if cfg.checkpointing else 0.75) * m.step_factor
    return Estimate(p.params, host, device, step_s, build_s + steps * step_s)


def size_largest(big: TrainConfig, m: Machine, box_s: float, max_layers: int) -> tuple[int, str]:
    """The deepest relay of ``big``'s width that fits the host, the device and ``box_s``."""
    best, why = 0, f"the cap of {max_layers} layers"
    for n in range(1, max_layers + 1):
        problems = estimate(Row("largest", "", replace(big, layers=n), 1, 1), m).problems(m, box_s)
        if problems:
            why = problems[0]
            break
        best = n
    return best, why


# ------------------------------------------------------------------ budget and report

class Budget:
    """One clock for the run: section boxes inside the whole-run budget."""

    def __init__(self, total_s: float) -> None:
        self.start = time.monotonic()
        self.end = self.start + total_s
        self.scale = total_s / BUDGET_S
        self.deadline = self.end

    def open(self, section: str, last: bool = False) -> float:
        """Start ``section``: its deadline is its box from now, never past the budget's end less the margin."""
        stop = self.end - MARGIN_S * self.scale
        self.deadline = stop if last else min(time.monotonic() + BOXES[section] * self.scale, stop)
        return self.deadline

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.start


class Report:
    """The result, rewritten whole (JSON and Markdown, atomically) after every row."""

    def __init__(self, out: Path, meta: dict) -> None:
        self.out = out
        self.result = {**meta, "sections": {}}
        self._lock = threading.Lock()
        out.mkdir(parents=True, exist_ok=True)

    def section(self, name: str, **info) -> dict:
        with self._lock:
            s = self.result["sections"].setdefault(name, {"status": "running", "rows": []})
            s.update(info)
        self.save()
        return s

    def row(self, section: str, row: dict) -> None:
        with self._lock:
            self.result["sections"][section]["rows"].append(row)
        self.save()

    def save(self) -> None:
        with self._lock:
            self.result["seconds"] = time.monotonic() - self.result["_start"]
            text = json.dumps({k: v for k, v in self.result.items() if not k.startswith("_")}, indent=2,
                              default=str) + "\n"
            for name, content in (("gpu_check.json", text), ("gpu_check.md", markdown(self.result))):
                tmp = self.out / f".{name}.tmp"
                tmp.write_text(content)
                os.replace(tmp, self.out / name)


# ------------------------------------------------------------------ running one engine

def pinned_held(engine) -> tuple[int, int]:
    """(requested, held by the allocator) pinned bytes of a relay's transport; (0, 0) without one."""
    t = getattr(engine, "transport", None)
    if t is None or not hasattr(t, "pinned"):
        return 0, 0
    sizes = t.pool.buffer_sizes
    return (t.pinned.requested_bytes() + sum(sizes), t.pinned.held_bytes() + sum(map(pinned_block_bytes, sizes)))


def host_allocator_stats() -> dict | None:
    """torch's own pinned-allocator figures (rounded block sizes), where this torch has them."""
    stats = getattr(torch.cuda.memory, "host_memory_stats", None)
    if stats is None or not torch.cuda.is_available():
        return None
    s = stats()
    return {"held_current": s.get("allocated_bytes.current"), "held_peak": s.get("allocated_bytes.peak")}


def free_caches(device: torch.device) -> None:
    """Between rows: every cache emptied, every peak reset, so one row's cached pinned
    blocks neither hide nor inflate the next one's use."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        empty_host = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None) \
            or getattr(torch._C, "_host_emptyCache", None)
        if empty_host is not None:
            empty_host()
        torch.cuda.reset_peak_memory_stats(device)
        reset_host = getattr(torch.cuda.memory, "reset_peak_host_memory_stats", None)
        if reset_host is not None:
            reset_host()
    reset_peak_resident()


def run_engine(cfg: TrainConfig, corpus, device: torch.device, *, steps: int, warmup: int,
               prefetch: bool = True, inspect=None, hold: bool = False) -> dict:
    """Build ``cfg``'s engine, run ``warmup + steps`` steps, and measure: wall and CUDA-event
    (compute stream) step times, the device peak, host RSS and pinned bytes. ``inspect(engine)``
    runs before the engine is closed; its result is returned as ``"inspect"``. ``hold``: the
    EPS holds the updates, so each layer's gradient stays in its inbox for ``inspect`` (an
    inbox is otherwise handed to another layer once its update has read it)."""
    free_caches(device)
    rss_before = memory_status().get("VmRSS", 0)
    t0 = time.perf_counter()
    stack = build_stack(cfg.model_config(), cfg.seed)
    engine = build_engine(cfg, stack, device)
    build_s = time.perf_counter() - t0
    if not prefetch and isinstance(engine, RelayEngine):
        engine._prefetch = lambda i: None  # fetch each layer only when it is needed
    if hold:
        engine.eps.hold()
    sampler = BatchSampler(corpus.train, cfg.seq_len, cfg.batch_size, family(cfg.model).objective, seed=0)
    cuda = device.type == "cuda"
    walls, gpus, peaks, waits, drains, busy, losses = [], [], [], [], [], [], []
    out = {}
    try:
        for step in range(warmup + steps):
            batch = sampler.batch(step)
            if cuda:
                torch.cuda.synchronize(device)
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
            eps = getattr(engine, "eps", None)
            busy_before = eps.update_seconds if eps is not None else 0.0
            t = time.perf_counter()
            result = engine.train_step(batch, step)
            returned = time.perf_counter()
            if eps is not None:  # the step's updates belong to the step: the drain is the EPS's tail
                eps.synchronize()
            if cuda:
                end.record()
                torch.cuda.synchronize(device)
            wall = time.perf_counter() - t
            losses.append(result.loss)
            if step >= warmup:
                walls.append(wall)
                gpus.append(begin.elapsed_time(end) / 1e3 if cuda else None)
                peaks.append(result.device_peak_bytes)
                waits.append(result.eps_wait_s)
                drains.append(time.perf_counter() - returned if eps is not None else 0.0)
                busy.append(eps.update_seconds - busy_before if eps is not None else 0.0)
        requested, held = pinned_held(engine)
        out.update(pinned_requested=requested, pinned_held=held, host_allocator=host_allocator_stats())
        if inspect is not None:
            out["inspect"] = inspect(engine)
    finally:
        engine.close()
        del engine, stack
    status = memory_status()
    out.update(params=sum(n for n in _entry_sizes(cfg)), build_s=build_s, losses=losses,
               step_s=statistics.median(walls) if walls else None,
               gpu_step_s=statistics.median(gpus) if gpus and gpus[0] is not None else None,
               device_peak_bytes=max(peaks) if peaks else None,
               eps_wait_s=statistics.median(waits) if waits else None,
               eps_drain_s=statistics.median(drains) if drains else None,
               eps_busy_s=statistics.median(busy) if busy else None,
               host_rss_before=rss_before, host_rss_peak=status.get("VmHWM"))
    if out["step_s"]:
        out["tokens_per_s"] = cfg.batch_size * cfg.seq_len / out["step_s"]
    free_caches(device)
    return out


def _entry_sizes(cfg: TrainConfig) -> list[int]:
    return [s.params - s.counted_before for s in layer_shapes(cfg)]


# ------------------------------------------------------------------ sections

@contextmanager
def deterministic():
    """Deterministic kernels (warnings recorded, not raised), TF32 off, attention on SDPA's math path."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        with warnings.catch_warnings(record=True) as caught, sdpa_kernel([SDPBackend.MATH]):
            warnings.simplefilter("always")
            yield caught
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


def reference_gradients(cfg: TrainConfig, batch, device: torch.device, seed_shift: int = 0) -> list[np.ndarray]:
    """Step 0's gradients of the whole model in memory, micro-batch by micro-batch, each
    (layer, micro-batch) drawing its dropout masks from the relay's seed (plus ``seed_shift``)."""
    stack = build_stack(cfg.model_config(), cfg.seed, materialize=True)
    stack.train(True)
    for layer in stack.layers:
        layer.module.to(device)
    for j, mb in enumerate(batch.split(cfg.micro_batches)):
        x, targets = mb.inputs.to(device), mb.targets.to(device)
        for i, layer in enumerate(stack.layers):
            with replay_rng(device, derive_seed(cfg.seed, 0, i, j) + seed_shift):
                x = layer.module(x, targets) if layer.kind == "post" else layer.module(x)
        (x / batch.num_targets).backward()
    return [torch.cat([dict(layer.module.named_parameters())[s.name].grad.reshape(-1).float().cpu()
                       for s in layer.layout.slots]).numpy() for layer in stack.layers]


def check_row(row: Row, corpus, device: torch.device) -> dict:
    """One correctness row: the two runs (or the run and its reference) and the verdict."""
    def weights(engine):
        return [w.copy() for w in engine.master_weights()]

    if row.check == "replay":
        def inbox(engine):
            engine.eps.synchronize()
            return [engine.eps.gradient_inbox(i).astype(np.float32).copy() for i in range(len(engine.layers))]
        a = run_engine(row.cfg, corpus, device, steps=1, warmup=0, inspect=inbox, hold=True)
        batch = BatchSampler(corpus.train, row.cfg.seq_len, row.cfg.batch_size, family(row.cfg.model).objective,
                             seed=0).batch(0)
        def gap(shift: int) -> float:
            want = reference_gradients(row.cfg, batch, device, seed_shift=shift)
            return max(float(np.abs(g - w).max() / np.abs(w).max()) for g, w in zip(a["inspect"], want))
        diff, control = gap(0), gap(1)  # the control: other masks must give other gradients
        return {"max_rel_diff": diff, "control_diff": control,
                "measure": "max |g - g_ref| / max |g_ref| over layers; control: reference with other masks",
                "result": "PASS" if diff <= row.tol and control > 100 * row.tol else "FAIL"}
    a = run_engine(row.cfg, corpus, device, steps=row.steps, warmup=0, inspect=weights, prefetch=row.prefetch)
    b = run_engine(row.pair, corpus, device, steps=row.steps, warmup=0, inspect=weights,
                   prefetch=row.pair_prefetch)
    la, lb = np.array(a["losses"]), np.array(b["losses"])
    diff = float(np.max(np.abs(la - lb) / np.abs(lb)))
    wdiff = max(float(np.abs(x - y).max()) for x, y in zip(a["inspect"], b["inspect"]))
    out = {"losses": a["losses"], "pair_losses": b["losses"], "max_rel_diff": diff,
           "max_weight_diff": wdiff, "measure": "max over steps of |loss - loss_pair| / |loss_pair|"}
    if row.check == "bitwise":
        same = la.tobytes() == lb.tobytes() and all(x.tobytes() == y.tobytes()
                                                   for x, y in zip(a["inspect"], b["inspect"]))
        out["result"] = "PASS" if same else "FAIL"
    else:
        out["result"] = "PASS" if diff <= row.tol else "FAIL"
    return out


def run_section(name: str, rows: list[Row], ctx: dict, *, last: bool = False) -> None:
    """Run ``rows`` inside the section's box: before each, check that its estimate fits the
    machine (as measured here) and the time left; record each row as it ends."""
    report, budget, machine, device = ctx["report"], ctx["budget"], ctx["machine"], ctx["device"]
    budget.open(name, last)
    start = time.monotonic()
    report.section(name, status="running", box_s=round(budget.left(), 1))
    for row in rows:
        ctx["current"] = f"{name}: {row.name}"
        est = estimate(row, machine)
        problems = est.problems(ctx["live"], budget.left()) if budget.left() > 0 else ["the section's box is spent"]
        base = {"row": row.name, "precision": row.cfg.precision, "engine": row.cfg.engine,
                "stash": row.cfg.stash, "layers": row.cfg.layers, "eps": row.cfg.eps,
                "planned_host_bytes": est.host["total"], "planned_pinned_held": sum(
                    est.host[k] for k in ("pinned_copies", "pinned_inboxes", "pinned_stash")),
                "planned_device_bytes": est.device, "planned_s": est.seconds, "planned_step_s": est.step_s}
        if problems:
            report.row(name, {**base, "status": "skipped: " + "; ".join(problems)})
            print(f"{name}: {row.name}: skipped: {'; '.join(problems)}", flush=True)
            continue
        t = time.monotonic()
        try:
            r = check_row(row, ctx["corpus"], device) if row.check else run_engine(
                row.cfg, ctx["corpus"], device, steps=row.steps, warmup=row.warmup, prefetch=row.prefetch)
            r.pop("inspect", None)
            r["status"] = "ok"
        except (torch.cuda.OutOfMemoryError, MemoryError) as exc:
            r = {"status": f"{type(exc).__name__}: {_first_line(exc)}"}
        except Exception as exc:  # noqa: BLE001 -- recorded, and the run goes on to the next row
            r = {"status": f"error: {type(exc).__name__}: {_first_line(exc)}"}
            ctx["errors"].append(f"{name}: {row.name}: {r['status']}")
            free_caches(device)
        r["row_s"] = time.monotonic() - t
        if r.get("step_s") and r.get("params") and device.type == "cuda":
            r["mfu"] = 6 * r["params"] * r["tokens_per_s"] / (PEAK_TFLOPS[row.cfg.precision] * 1e12)
        _learn(ctx, r, est)
        report.row(name, {**base, **r})
        print(f"{name}: {row.name}: {_summary(r)}", flush=True)
    ran = sum(r.get("status") == "ok" for r in report.result["sections"][name]["rows"])
    status = "ok" if ran == len(rows) else f"partial: {ran} of {len(rows)} rows ran (each other row says why)"
    report.section(name, status=status, seconds=round(time.monotonic() - start, 1))


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:200]


def _learn(ctx: dict, r: dict, est: Estimate) -> None:
    """Measured rates from the rows so far, for the time estimates of the rows to come."""
    m = ctx["live"]
    if r.get("params", 0) >= 10**7 and r.get("build_s"):
        ctx["build_rates"].append(r["params"] / r["build_s"])
        m.build_rate = max(ctx["build_rates"])
    if r.get("step_s") and est.step_s > 0 and r.get("params", 0) >= 10**7:
        ctx["step_ratios"].append(r["step_s"] / (est.step_s / m.step_factor))
        m.step_factor = max(1.0, statistics.median(ctx["step_ratios"]))


def _summary(r: dict) -> str:
    if r.get("status") != "ok":
        return r.get("status", "")
    if "result" in r:
        return f"{r['result']} (max rel diff {r['max_rel_diff']:.3g})"
    parts = [f"step {r['step_s']:.3f} s"]
    if r.get("gpu_step_s") is not None:
        parts.append(f"GPU {r['gpu_step_s']:.3f} s")
    if r.get("tokens_per_s"):
        parts.append(f"{r['tokens_per_s']:,.0f} tok/s")
    if r.get("device_peak_bytes") is not None:
        parts.append(f"device peak {r['device_peak_bytes'] / GiB:.2f} GiB")
    parts.append(f"pinned held {r.get('pinned_held', 0) / GiB:.2f} GiB")
    return ", ".join(parts)


def probe_eps(smoke: bool) -> dict:
    """Elements/s of one update with each host EPS; the faster one runs every row. Beside
    them, what ``--eps auto`` takes on this box (built as a run builds it) and its rate: a
    report, the rows still use the faster."""
    numel = (1 << 18) if smoke else (4 << 20)
    rates, why = {}, {}
    for name in ("numpy", "opencl"):
        try:
            rates[name] = measure_eps(name, numel=numel)
        except Exception as exc:  # noqa: BLE001 -- OpenCL missing or broken: say why, use NumPy
            rates[name], why[name] = None, f"{type(exc).__name__}: {_first_line(exc)}"
    chosen = "opencl" if rates.get("opencl") and rates["opencl"] > rates["numpy"] else "numpy"
    try:
        backend, choice = build_eps(choose_eps("auto"))
        try:
            auto = {"backend": choice.name, "runs_on": backend.describe(), "why": choice.why,
                    "rate": measure_backend(backend, numel)}
        finally:
            backend.close()
        auto["same_as_chosen"] = auto["backend"] == chosen
    except Exception as exc:  # noqa: BLE001 -- reported; the run goes on with the probe's choice
        auto = {"backend": None, "rate": None, "error": f"{type(exc).__name__}: {_first_line(exc)}"}
    return {"rates": rates, "unavailable": why, "chosen": chosen, "auto": auto}


def _auto_summary(probe: dict) -> str:
    """One line: what --eps auto takes on this box, at what rate, against the probe's choice."""
    auto = probe.get("auto") or {}
    if not auto.get("backend"):
        return f"--eps auto: did not start ({auto.get('error', 'not probed')})"
    agree = ("the same as the probe's" if auto["same_as_chosen"]
             else f"the rows use the probe's faster {probe['chosen']}")
    return (f"--eps auto takes {auto['backend']} on {auto['runs_on']}: {auto['rate']:.3g} elem/s ({agree}; "
            f"{auto['why']})")


# ------------------------------------------------------------------ markdown

def _g(x, fmt="{:.2f}", div=1) -> str:
    return "" if x is None else fmt.format(x / div)


def _b(x) -> str:
    """Bytes, in the unit that shows them."""
    if x is None:
        return ""
    return f"{x / GiB:.2f} GiB" if abs(x) >= GiB else f"{x / 2**20:.1f} MiB"


COLUMNS = {
    "correctness": [("check", lambda r: r["row"]), ("max rel diff", lambda r: _g(r.get("max_rel_diff"), "{:.3g}")),
                    ("tolerance", lambda r: r.get("tolerance", "")), ("result", lambda r: r.get("result", ""))],
    "memory": [("row", lambda r: r["row"]), ("device peak", lambda r: _b(r.get("device_peak_bytes"))),
               ("planned device", lambda r: _b(r["planned_device_bytes"])),
               ("pinned held", lambda r: _b(r.get("pinned_held"))),
               ("planned pinned", lambda r: _b(r["planned_pinned_held"])),
               ("torch pinned peak", lambda r: _b((r.get("host_allocator") or {}).get("held_peak"))),
               ("host RSS peak - before", lambda r: _b(r["host_rss_peak"] - r["host_rss_before"])
                if r.get("host_rss_peak") else "")],
    "throughput": [("engine", lambda r: r["row"]), ("tokens/s", lambda r: _g(r.get("tokens_per_s"), "{:,.0f}")),
                   ("MFU", lambda r: _g(r.get("mfu"), "{:.1%}")), ("step s (wall)", lambda r: _g(r.get("step_s"), "{:.3f}")),
                   ("step s (GPU events)", lambda r: _g(r.get("gpu_step_s"), "{:.3f}")),
                   ("planned step s", lambda r: _g(r.get("planned_step_s"), "{:.3f}")),
                   ("EPS busy s", lambda r: _g(r.get("eps_busy_s"), "{:.3f}")),
                   ("EPS wait s", lambda r: _g(r.get("eps_wait_s"), "{:.3f}")),
                   ("EPS drain s", lambda r: _g(r.get("eps_drain_s"), "{:.3f}")),
                   ("device peak", lambda r: _b(r.get("device_peak_bytes")))],
    "largest": [("row", lambda r: r["row"]), ("params", lambda r: _g(r.get("params"), "{:.2f}B", 1e9)),
                ("build s", lambda r: _g(r.get("build_s"), "{:.0f}")), ("step s", lambda r: _g(r.get("step_s"), "{:.2f}")),
                ("host RSS peak", lambda r: _b(r.get("host_rss_peak"))),
                ("planned host", lambda r: _b(r["planned_host_bytes"])),
                ("pinned held", lambda r: _b(r.get("pinned_held"))),
                ("torch pinned peak", lambda r: _b((r.get("host_allocator") or {}).get("held_peak"))),
                ("device peak", lambda r: _b(r.get("device_peak_bytes"))),
                ("planned device", lambda r: _b(r["planned_device_bytes"]))],
}
COLUMNS["overlap"] = COLUMNS["batch"] = COLUMNS["throughput"]
TITLES = {"startup": "Start-up and EPS probe", "correctness": "Correctness (deterministic, TF32 off, SDPA math path)",
          "memory": "Device memory against depth (one relay step)",
          "throughput": "Throughput against the baseline (same model, data, seed)",
          "batch": "A larger batch: the EPS behind the GPU",
          "overlap": "Overlap: copy-stream prefetch on and off", "largest": "The largest relay model"}


def markdown(result: dict) -> str:
    eps = result.get("eps_probe", {})
    lines = [f"GPU check on {result['device']} (torch {result['torch']}), {result['mode']} mode, "
             f"{result.get('seconds', 0):.0f} s of a {result['budget_s']:.0f} s budget.", "",
             f"EPS: {eps.get('chosen', '?')} (elements/s: " + ", ".join(
                 f"{k} {v:.3g}" if v else f"{k} unavailable" for k, v in eps.get("rates", {}).items()) + ")"
             + f"; --devices 1; CUBLAS_WORKSPACE_CONFIG={result.get('cublas_workspace')}; "
             f"sanitizer {'on' if result.get('sanitizer') else 'off'}.", "",
             f"EPS {_auto_summary(eps)}.", ""]
    if result.get("aborted"):
        lines += [f"**Stopped: {result['aborted']}**", ""]
    for name, s in result["sections"].items():
        lines += [f"### {TITLES.get(name, name)}", "", f"Status: {s['status']}.", ""]
        cols = COLUMNS.get(name)
        if not cols or not s["rows"]:
            continue
        lines += ["| " + " | ".join(h for h, _ in cols) + " |", "|" + "---|" * len(cols)]
        for r in s["rows"]:
            if r.get("status") != "ok":
                lines.append(f"| {r['row']} | {r.get('status')} |" + " |" * (len(cols) - 2))
            else:
                lines.append("| " + " | ".join(str(f(r)) for _, f in cols) + " |")
        if name == "correctness" and s.get("nondeterministic"):
            lines += ["", "Nondeterministic ops reported: " + "; ".join(s["nondeterministic"])]
        lines.append("")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ dry run

def dry_run(rows: list[Row], m: Machine, budget_s: float) -> int:
    """The plan's rows with their bytes and time; exit 2 (one line per offending row) when
    a row would not fit the device machine or its box, or the total overruns the budget."""
    print(f"Plan for one H200 ({m.device_bytes / 1e9:.0f} GB device memory, {m.usable_device / GiB:.1f} GiB usable), "
          f"host {m.host_bytes / GiB:.0f} GiB ({m.usable_host / GiB:.0f} GiB usable); "
          f"pinned buffers rounded up to powers of two; assumed EPS {m.eps_rate:.2g} elem/s, "
          f"build {m.build_rate:.2g} params/s, link {LINK_BYTES_PER_S / 1e9:.0f} GB/s, efficiency {EFFICIENCY}.\n")
    head = (f"{'section':12s} {'row':58s} {'params':>8s} {'host GiB':>9s} {'(EPS':>6s} {'pinned':>7s} "
            f"{'stash)':>7s} {'device GiB':>10s} {'est s':>6s}")
    print(head)
    print("-" * len(head))
    offending, total, by_section = [], STARTUP_S, {}
    for row in rows:
        est = estimate(row, m)
        h = est.host
        problems = est.problems(m, BOXES[row.section] * budget_s / BUDGET_S)
        by_section[row.section] = by_section.get(row.section, 0.0) + est.seconds
        total += est.seconds
        print(f"{row.section:12s} {row.name:58s} {est.params / 1e9:7.2f}B {h['total'] / GiB:9.1f} "
              f"{h['eps'] / GiB:6.1f} {(h['pinned_copies'] + h['pinned_inboxes']) / GiB:7.1f} "
              f"{h['pinned_stash'] / GiB:7.2f} {est.device / GiB:10.1f} {est.seconds:6.0f}"
              + ("  REFUSED" if problems else ""))
        if problems:
            offending.append(f"refused: {row.section} / {row.name}: " + "; ".join(problems))
    for section, s in by_section.items():  # rows that fit alone but not together
        box = BOXES[section] * budget_s / BUDGET_S
        if s > box and not any(f": {section} / " in line for line in offending):
            offending.append(f"refused: section {section}: estimated {s:.0f} s > its {box:.0f} s box")
    big = next(r.cfg for r in rows if r.section == "largest")
    fit, why = size_largest(big, m, BOXES["largest"] * budget_s / BUDGET_S, 64)
    print(f"\nlargest: d_model {big.d_model}, {big.precision}, --stash host: {fit} layers fit; one more would "
          f"exceed: {why}" + (f" (planned {big.layers}: --largest-scale)" if big.layers != fit else ""))
    planned = budget_s - MARGIN_S * budget_s / BUDGET_S
    print(f"estimated total {total:.0f} s (start-up {STARTUP_S:.0f} s included) of the {budget_s:.0f} s budget "
          f"({planned:.0f} s planned, {MARGIN_S * budget_s / BUDGET_S:.0f} s margin); boxes: "
          + ", ".join(f"{k} {v * budget_s / BUDGET_S:.0f} s" for k, v in BOXES.items()))
    if total > planned:
        offending.append(f"refused: the plan: estimated {total:.0f} s > {planned:.0f} s")
    if offending:
        print("\n".join(offending), file=sys.stderr)
        return 2
    print("plan fits: every row within the device machine's memory and its section's box")
    return 0


# ------------------------------------------------------------------ main

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on whatever device there is")
    ap.add_argument("--dry-run", action="store_true", help="print the plan with its bytes and time; exit 2 "
                    "if a row would not fit the device machine")
    ap.add_argument("--minutes", type=float, default=BUDGET_S / 60, help="whole-run budget (default 8)")
    ap.add_argument("--host-bytes", type=float, default=HOST_BYTES,
                    help=f"host memory of the device machine (default {HOST_BYTES / GiB:.0f} GiB)")
    ap.add_argument("--device-bytes", type=float, default=DEVICE_BYTES,
                    help=f"device memory (default {DEVICE_BYTES / 1e9:.0f} GB)")
    ap.add_argument("--eps-rate", type=float, default=EPS_ELEMS_PER_S, help="EPS elements/s assumed by the plan")
    ap.add_argument("--largest-scale", type=float, default=1.0,
                    help="multiply the largest model's computed depth (a check that oversize plans are refused)")
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help=f"comma-separated sections to run (default all: {','.join(SECTIONS)}); start-up always runs")
    ap.add_argument("--out", default="bench/results/gpu")
    args = ap.parse_args()
    chosen = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(chosen) - set(SECTIONS))
    if unknown or not chosen:
        ap.error(f"--sections: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(SECTIONS)}")

    budget_s = args.minutes * 60
    machine = Machine(device_bytes=int(args.device_bytes), host_bytes=int(args.host_bytes), eps_rate=args.eps_rate)
    if args.dry_run:
        return dry_run(plan(args.smoke, args.largest_scale, machine), machine, budget_s)

    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        raise SystemExit("gpu_check: no CUDA device visible; run with --smoke (or --dry-run) on the CPU")
    sanitizer = False
    if cuda and args.smoke:  # before any CUDA work: every kernel and copy is checked for stream races
        import torch.cuda._sanitizer as csan
        csan.enable_cuda_sanitizer()
        sanitizer = True
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 rows: TF32 matmuls, what fp32 users run
        torch.backends.cudnn.allow_tf32 = True
    budget = Budget(budget_s)
    device = resolve_device("auto")
    name = torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu"
    report = Report(Path(args.out), {"_start": budget.start, "device": name, "torch": torch.__version__,
                                     "mode": "smoke" if args.smoke else "full", "budget_s": budget_s,
                                     "devices": 1, "sanitizer": sanitizer,
                                     "cublas_workspace": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
                                     "tolerances": {"l2l vs plain fp32": TOL_FP32, "l2l vs plain bf16": TOL_BF16,
                                                    "stash host vs device": "bit-identical",
                                                    "dropout replay": TOL_REPLAY}})
    ctx = {"report": report, "budget": budget, "machine": machine, "device": device, "current": "start-up",
           "build_rates": [], "step_ratios": [], "errors": []}
    live = replace(machine)
    if cuda:  # what this machine really has
        live.device_bytes = min(live.device_bytes, torch.cuda.mem_get_info(device)[1])
        live.host_bytes = min(live.host_bytes, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    elif args.smoke:  # the CPU: host and device memory are one; the smoke shapes are tiny
        live.host_bytes = live.device_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    ctx["live"] = live

    def watchdog() -> None:  # the whole-run budget is a hard limit: files as they are, then out
        report.result["aborted"] = f"whole-run budget of {budget_s:.0f} s reached during {ctx['current']}"
        report.save()
        print(f"gpu_check: {report.result['aborted']}", file=sys.stderr, flush=True)
        os._exit(3)
    timer = threading.Timer(budget_s - 3, watchdog)
    timer.daemon = True
    timer.start()

    budget.open("startup")
    report.section("startup", status="running")
    ctx["corpus"] = load_corpus(None)
    probe = report.result["eps_probe"] = probe_eps(args.smoke)
    live.eps_rate = machine.eps_rate = probe["rates"][probe["chosen"]]
    print(f"EPS: {probe['chosen']} ({probe['rates']})", flush=True)
    print(f"EPS {_auto_summary(probe)}", flush=True)
    # what lives for the whole run (torch, the corpus, the report) out of every gc.collect()
    # free_caches makes between rows: each would otherwise walk all of it again (0.2 s a row)
    gc.freeze()
    report.section("startup", status="ok", seconds=round(budget.elapsed(), 1))

    rows = [replace(r, cfg=replace(r.cfg, eps=probe["chosen"]),
                    pair=replace(r.pair, eps=probe["chosen"]) if r.pair is not None else None)
            for r in plan(args.smoke, 1.0, machine)]
    sections = {}
    for r in rows:
        sections.setdefault(r.section, []).append(r)
    if "correctness" in chosen:
        with deterministic() as caught:
            run_section("correctness", sections["correctness"], ctx)
            for r, out in zip(sections["correctness"], report.result["sections"]["correctness"]["rows"]):
                out["tolerance"] = "bit-identical" if r.check == "bitwise" else r.tol
            notes = sorted({str(w.message).splitlines()[0][:160] for w in caught if "determinis" in str(w.message)})
            report.section("correctness", nondeterministic=notes)
    for name in ("memory", "throughput", "batch", "overlap"):
        if name in chosen:
            run_section(name, sections[name], ctx, last=name == chosen[-1])
    if "largest" in chosen:
        # the largest model: sized again from the arithmetic, with the build and EPS rates measured so far
        big = sections["largest"][0].cfg
        budget.open("largest", last=True)
        layers, why = size_largest(big, live, budget.left(), 4 if args.smoke else 64)
        report.section("largest", sized=f"{layers} layers; one more would exceed: {why}")
        run_section("largest", [Row("largest", f"L={layers}", replace(big, layers=max(layers, 1)), 1, 1)], ctx,
                    last=True)
    timer.cancel()
    report.save()
    print("\n" + markdown(report.result))
    failed = [r["row"] for r in report.result["sections"].get("correctness", {}).get("rows", [])
              if r.get("result") == "FAIL"]
    if failed:
        print("gpu_check: correctness FAILED: " + "; ".join(failed), file=sys.stderr)
    if ctx["errors"]:
        print("gpu_check: rows that raised: " + "; ".join(ctx["errors"]), file=sys.stderr)
    return 1 if failed or ctx["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
