"""``l2l bench eps``: elements per second of one full EPS layer update, against memory bandwidth.

One update is what the EPS does per layer: reduce K gradient contributions
(sum, scale, finite check), the optimizer (``--optimizer``: AdamW on fp32 ``p, m, v``, Lion
on ``p, m``), and the device copy in the copy dtype. It is memory-bound on any CPU, so every method is reported
with the bytes per element it moves (counted from its implementation, per
method), the bandwidth that implies, and the fraction of this machine's
bandwidth roofline measured in the same run, plus the ratio to torch's fused
CPU AdamW doing the same job. Peers: torch.optim.AdamW(fused=True) and, when
importable, DeepSpeedCPUAdam (never a dependency). torch has no Lion: for Lion the
torch row is the plain engine's ``l2l.lion.Lion`` (per-op, unfused), and the peer
DeepSpeedCPULion when importable.

Thread counts (``--threads N ...``, default 1 and the CPUs of this process's
affinity): each CPU method runs at each count -- the NumPy EPS with N threads,
the OpenCL EPS on a sub-device of N compute units of the CPU device ``--eps
auto`` takes, torch's fused AdamW and DeepSpeedCPUAdam with N OpenMP threads
(:func:`set_threads`); the HLS C-simulation once, on its one thread. A second
table gives each method's rate and share of the roofline per count and its
speed-up from the fewest threads to the most; the row ``--eps auto`` would run
is marked.

All methods of all counts and the bandwidth kernels run in turn, in short
blocks, so that drift in the machine's speed (other load, clocks) falls on all
alike; the figure is the median of the timed runs (see _time_in_turn).

Byte convention (STREAM's): bytes the code reads plus bytes it writes; the
read-for-ownership a store to a line not yet in cache adds (write-allocate)
is not counted anywhere. The roofline is the best kernel, in practice an
in-place one that pays no such read, as AdamW's stores to p, m, v do not; a
method's stores to separate outputs (reduced gradient, device copy, staging
buffers) do pay it, uncounted, which lowers its fraction a little.
"""
from __future__ import annotations

import argparse
import itertools
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..eps import BACKENDS, OPTIMIZERS, OptimizerHyper, make_backend
from ..eps.contract import inv_scale as inv_scale_of, step_scalars
from ..lion import Lion
from ..eps.choice import EpsChoice, choose
from ..eps.numerics import COPY_DTYPES, GRAD_DTYPES, as_step
from ..eps.threads import available_cpus
from ..errors import UserError
from ..hostmem import aligned_empty
from ..options import Parser
from .output import save_results

_TORCH_DTYPES = {COPY_DTYPES["fp32"]: torch.float32, COPY_DTYPES["bf16"]: torch.bfloat16,
                 COPY_DTYPES["fp16"]: torch.float16}


@dataclass
class Method:
    """One timed thing: a full update (or a part, or a bandwidth kernel) and its byte count."""

    key: str
    label: str
    threads: int | None  # the threads it ran on (None: not a CPU thread count, e.g. an accelerator)
    threads_note: str = ""  # how, where the count alone does not say
    bytes_per_elem: float = 0.0
    counted: str = ""
    run: Callable[[], None] | None = None
    status: str = "ok"
    omp_threads: int | None = None  # torch's and OpenMP's thread count, set before each of its blocks
    times: list[float] = field(default_factory=list)
    rounds: list[int] = field(default_factory=list)  # the round of each time
    cpu: list[float] = field(default_factory=list)  # the process's CPU seconds over each time's

    @property
    def id(self) -> str:
        """The row's name in the JSON: the method at its thread count."""
        return self.key if self.threads is None else f"{self.key}@{self.threads}"


# ---------------------------------------------------------------- threads

_OPENMP_RUNTIMES = ("libgomp", "libiomp", "libomp")


def openmp_runtimes() -> list[str]:
    """The OpenMP runtimes loaded in this process (torch's; a C++ extension built with
    -fopenmp may bring another, which torch.set_num_threads does not reach)."""
    found = set()
    try:
        for line in Path("/proc/self/maps").read_text().splitlines():
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and Path(parts[5]).name.startswith(_OPENMP_RUNTIMES) and ".so" in parts[5]:
                found.add(parts[5])
    except OSError:  # not Linux: torch's own setting is all there is
        pass
    return sorted(found)


def set_threads(n: int) -> dict[str, int]:
    """torch's threads, and every loaded OpenMP runtime's (for this thread: the one that runs
    the optimizers), set to ``n``; what each runtime then reports (omp_get_max_threads)."""
    import ctypes
    torch.set_num_threads(n)
    seen = {}
    for path in openmp_runtimes():
        try:
            lib = ctypes.CDLL(path)  # already loaded: the same library, not a second copy
            lib.omp_set_num_threads(ctypes.c_int(n))
            seen[Path(path).name] = int(lib.omp_get_max_threads())
        except (OSError, AttributeError):
            continue
    return seen


# ---------------------------------------------------------------- inputs

def _as_torch(a: np.ndarray) -> torch.Tensor:
    """A zero-copy torch view of a NumPy array (bfloat16 goes through its bits)."""
    if a.dtype == GRAD_DTYPES["bf16"]:
        return torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _inputs(n: int, k: int, gdtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """Initial weights and K distinct gradient contributions (distinct, so each is really read),
    as one (K, n) block: the layout of the EPS server's gradient inboxes."""
    rng = np.random.default_rng(0)
    p0 = rng.standard_normal(n, dtype=np.float32)
    grads = (rng.standard_normal((k, n), dtype=np.float32) * np.float32(1e-3)).astype(gdtype)
    return p0, grads


# ---------------------------------------------------------------- EPS backends

def _eps_bytes(name: str, k: int, gs: int, cs: int, inv_scale: float = 1.0,
               optimizer: str = "adamw") -> tuple[float, str]:
    """Bytes per element the backend's step moves, read off its implementation. ``inv_scale``
    as the step sees it (binary32): the NumPy EPS's path depends on it. The state (``p`` and
    the optimizer's moments: p,m,v 12 bytes for AdamW, p,m 8 for Lion) is read and written once."""
    state = OPTIMIZERS[optimizer].state
    names, sb = ",".join(state), 4 * len(state)
    if optimizer == "lamb":  # two passes: the norms (m, v written), then p from p, m', v'
        passes = "norm pass reads p,m,v 12, writes m,v 8; step pass reads p,m,v 12, writes p 4"
        if name == "numpy" and k == 1 and np.float32(inv_scale) == np.float32(1.0):
            return gs + gs + 36 + cs, f"grads read by the finite check {gs} and the norm pass {gs}; {passes}; copy {cs}"
        if name == "numpy":
            return k * gs + 4 + 4 + 36 + cs, (f"reduce: grads {k}x{gs}, g written 4, read 4 by the norm pass; "
                                              f"{passes}; copy {cs}")
        if name in ("opencl", "hls-csim", "rtl"):
            return 2 * k * gs + 36 + cs, f"check kernel and norm kernel read grads {k}x{gs} each; {passes}; copy {cs}"
        return k * gs + 36 + cs, f"algorithmic minimum of two passes: grads {k}x{gs}; {passes}; copy {cs}"
    if name == "numpy":
        if k == 1 and np.float32(inv_scale) == np.float32(1.0):
            note = (f"one contribution, inv_scale 1: no reduced gradient (numerics.unreduced); the finite "
                    f"check reads the grads {gs}, the update reads them again {gs} (widened per chunk, in cache) "
                    f"+ {names} {sb}, writes {names} {sb} and the copy {cs} (chunked: the rest stays in cache)")
            return gs + gs + 2 * sb + cs, note
        note = (f"reduce (numerics.reduce_gradients): grads read {k}x{gs}, reduced g written 4 (scale and finite "
                f"check per chunk, in cache); {optimizer} reads {names},g {sb + 4}, writes {names} {sb}; copy "
                f"written {cs} (chunked: the rest stays in cache)")
        return k * gs + 4 + sb + 4 + sb + cs, note
    if name == "opencl":
        note = (f"CPU device, zero-copy host buffers: check kernel reads grads {k}x{gs}; update kernel reads "
                f"grads {k}x{gs} + {names} {sb}, writes {names} {sb} and the copy {cs}")
        return 2 * k * gs + 2 * sb + cs, note
    if name == "hls-csim":
        note = (f"check kernel reads grads {k}x{gs}; update kernel reads grads {k}x{gs} (into a local tile) "
                f"+ {names} {sb}, writes {names} {sb} and the copy {cs}")
        return 2 * k * gs + 2 * sb + cs, note
    if name == "rtl":
        note = (f"the kernel's AXI ports: check pass reads grads {k}x{gs}; update pass reads grads {k}x{gs} "
                f"+ {names} {sb}, writes {names} {sb} and the copy {cs} (host staging copies not counted)")
        return 2 * k * gs + 2 * sb + cs, note
    return k * gs + 2 * sb + cs, "algorithmic minimum (implementation not inspected)"


def _eps_step(backend, p0, grads, copy_dtype, hyper: OptimizerHyper, inv_scale: float) -> Callable[[], None]:
    """``step()`` on layer 0 of ``backend`` as the EPS calls it per layer."""
    backend.allocate(0, p0, len(OPTIMIZERS[hyper.optimizer].moments))
    copy_out = aligned_empty(p0.shape[0], copy_dtype)  # as the EPS server allocates it: line-aligned
    copy_out[:] = 0
    counter = itertools.count(1)

    def run():
        scalars = as_step(step_scalars(hyper, next(counter), divisor=1.0 / inv_scale), p0.shape[0])
        if not backend.step(0, grads, scalars, copy_out):
            raise RuntimeError("benchmark gradients were not finite")
    return run


HLS_THREADS = "C-simulation: one host thread, the dataflow regions in sequence"
RTL_THREADS = "Verilator: one host thread, one clock at a time"
# the RTL simulation runs at about 0.4 M elements/s: timed in the table only on layers up to this size,
# and its clocks measured on a layer of at most this size (_rtl_line)
RTL_NUMEL = 1 << 16


def _eps_methods(p0, grads, copy_dtype, hyper: OptimizerHyper, inv_scale: float, counts: list[int],
                 auto: EpsChoice) -> tuple[list[Method], list]:
    """Per thread count, one Method per CPU EPS backend (numpy: ``NumpyBackend(threads=N)``;
    opencl: a sub-device of N compute units of the CPU device ``--eps auto`` takes); the
    HLS C-simulation once (it is one thread whatever the count)."""
    methods, opened = [], []
    k, gs, cs = len(grads), grads[0].dtype.itemsize, copy_dtype.itemsize
    inv = inv_scale_of(divisor=1.0 / inv_scale)

    def add(name: str, count: int | None, note: str, **options) -> None:
        label = f"EPS {name}: step()"
        if hyper.optimizer not in BACKENDS[name].optimizers:
            methods.append(Method(name, label, count, note, status=f"unavailable: does not run {hyper.optimizer}"))
            return
        try:
            backend = make_backend(name, **options)
        except Exception as exc:  # noqa: BLE001 -- a count the device cannot run is a row that says why
            why = (str(exc).splitlines() or [type(exc).__name__])[0]
            methods.append(Method(name, label, count, note, status=f"unavailable: {why}"))
            return
        opened.append(backend)
        ran_on = getattr(backend, "threads", count)
        device = getattr(backend, "device", None)
        if device is not None and hasattr(device, "max_compute_units"):
            ran_on = device.max_compute_units if device.type & _cl_cpu() else None
            cus = device.max_compute_units
            note = f"{cus} OpenCL compute unit{'s' if cus > 1 else ''} of {device.name.strip()}" + (
                " (a sub-device)" if getattr(device, "parent_device", None) else "")
        nbytes, counted = _eps_bytes(name, k, gs, cs, inv, hyper.optimizer)
        if getattr(backend, "streaming_stores", False):
            counted += " (the copy with streaming stores: no write-allocate read of it)"
        methods.append(Method(name, label, ran_on, note, nbytes, counted,
                              _eps_step(backend, p0, grads, copy_dtype, hyper, inv_scale)))

    for name, cls in BACKENDS.items():
        ok, why = cls.availability()
        if not ok:
            methods.append(Method(name, f"EPS {name}: step()", None, status=f"unavailable: {why}"))
            continue
        if name == "numpy":
            for n in counts:
                add(name, n, "NumpyBackend(threads=N): one contiguous range of the layer per thread (RangePool)",
                    threads=n)
        elif name == "opencl" and auto.name == "opencl":
            for n in counts:  # the device --eps auto takes, kept to n of its compute units
                add(name, n, "", **{**auto.options, "threads": n})
        elif name == "opencl":  # no OpenCL CPU device: the device it would take unnamed, once
            add(name, None, "not a CPU device: its own compute units")
        elif name == "hls-csim":
            add(name, 1, HLS_THREADS)
        elif name == "rtl" and p0.shape[0] > 4 * RTL_NUMEL:
            methods.append(Method(name, f"EPS {name}: step()", None, status=f"skipped: a simulation, timed on "
                                  f"layers up to {4 * RTL_NUMEL:,} elements; its clocks: the RTL line below"))
        elif name == "rtl":
            add(name, 1, RTL_THREADS)
        elif name == "board" and hyper.optimizer in cls.optimizers:  # the link sets its pace: needs a board
            methods.append(Method(name, f"EPS {name}: step()", None, status="skipped: needs a board (--eps board "
                                  "--board-url); the simulated SoC: python -m l2l.eps.board_sim --bench"))
        else:
            add(name, None, "")
    return methods, opened


def rtl_clocks(n: int, k: int, gdtype, cdtype, hyper: OptimizerHyper, steps: int = 3) -> dict:
    """The RTL kernel's simulated clocks per element (ap_start to the interrupt, both passes) and
    the simulation's wall rate, over ``steps`` updates of a layer of ``n`` elements after one
    untimed (which builds the model if the cache has none)."""
    from ..eps.rtl_backend import SHAPE, RtlBackend
    ok, why = RtlBackend.availability()
    if not ok:
        return {"status": f"unavailable: {why}"}
    if hyper.optimizer not in RtlBackend.optimizers:
        return {"status": f"unavailable: does not run {hyper.optimizer}"}
    p0, grads = _inputs(n, k, gdtype)
    backend = RtlBackend()
    try:
        run = _eps_step(backend, p0, grads, cdtype, hyper, 1.0)
        run()
        before = backend.stats()
        t0 = time.perf_counter()
        for _ in range(steps):
            run()
        wall = time.perf_counter() - t0
        after = backend.stats()
    finally:
        backend.close()
    clocks, seconds = after["clocks"] - before["clocks"], after["seconds"] - before["seconds"]
    return {"status": "ok", "numel": n, "contributions": k, "lanes": SHAPE["LANES"], "updates": steps,
            "launches_per_update": (after["launches"] - before["launches"]) / steps,
            "clocks_per_elem": clocks / (steps * n), "clocks_per_elem_per_lane": clocks / (steps * n) * SHAPE["LANES"],
            "sim_clocks_per_s": clocks / seconds, "wall_elems_per_s": steps * n / wall}


def _rtl_markdown(rtl: dict | None) -> str:
    if not rtl:
        return ""
    if rtl["status"] != "ok":
        return f"\nRTL kernel (--eps rtl): {rtl['status']}.\n"
    return (f"\nRTL kernel (--eps rtl, fpga/rtl/l2l_eps_kernel.v in Verilator, LANES {rtl['lanes']}), "
            f"{rtl['numel']:,} elements, K = {rtl['contributions']}, {rtl['updates']} updates: "
            f"{rtl['clocks_per_elem']:.3f} simulated clocks per element ({rtl['clocks_per_elem_per_lane']:.2f} "
            f"per element per lane; {rtl['launches_per_update']:g} launch(es) an update, ap_start to interrupt), "
            f"the simulation at {rtl['sim_clocks_per_s'] / 1e3:.0f} k clocks/s, "
            f"{rtl['wall_elems_per_s'] / 1e6:.3f} M elements/s of wall time through step().\n")


def _cl_cpu() -> int:
    import pyopencl as cl
    return cl.device_type.CPU


# ---------------------------------------------------------------- torch-style optimizers

def _optimizer_methods(p0, grads, copy_dtype, hyper: OptimizerHyper, inv_scale: float, counts: list[int],
                       deepspeed: bool = True) -> tuple[list[Method], dict]:
    """torch fused AdamW (and DeepSpeedCPUAdam when importable) doing the EPS's whole job, at
    each thread count; and what DeepSpeed's threads follow.

    The job around the optimizer step is written the plain torch way: the
    reduce as whole-tensor passes, the scale and the finite check the contract
    asks for in one pass (GradScaler's op: ``torch.isfinite(g).all()`` is
    several times slower than the whole update on CPU), then the cast to the
    copy dtype. Each pass is counted.

    Threads: torch's ops run on its OpenMP pool (``torch.set_num_threads``);
    DeepSpeedCPUAdam's step is a ``#pragma omp parallel for`` in its C++
    extension (csrc/includes/cpu_adam.h), so it takes the OpenMP runtime's
    thread count: torch's runtime when the extension's libgomp is the one torch
    loaded, else its own. :func:`set_threads` sets every loaded runtime; the
    row says which the extension brought.
    """
    n, k = p0.shape[0], len(grads)
    gs, cs = grads[0].dtype.itemsize, copy_dtype.itemsize
    tgrads = [_as_torch(g) for g in grads]
    scale = torch.tensor(inv_scale, dtype=torch.float32)
    found_inf = torch.zeros(1)
    around = (gs + 4) + (k - 1) * (gs + 8) + 8 + 4 + cs
    around_note = (f"reduce copy_ reads {gs} writes 4" + (f", {k - 1} add_ read {gs}+4 write 4" if k > 1 else "")
                   + f"; unscale+check in place reads 4 writes 4; cast reads p 4, writes {cs}")

    def full_job(opt, p, gbuf, copy):
        @torch.no_grad()
        def run():
            gbuf.copy_(tgrads[0])  # widens bf16/fp16 exactly
            for g in tgrads[1:]:
                gbuf.add_(g)
            found_inf.zero_()  # GradScaler's own one-pass scale and inf/NaN check
            torch._amp_foreach_non_finite_check_and_unscale_([gbuf], found_inf, scale)
            if found_inf.item():
                raise RuntimeError("benchmark gradients were not finite")
            opt.step()
            copy.copy_(p)
        return run

    def tensors():
        p = torch.nn.Parameter(torch.from_numpy(p0.copy()))
        p.grad = torch.zeros(n, dtype=torch.float32)
        return p, p.grad, torch.empty(n, dtype=_TORCH_DTYPES[copy_dtype])

    kw = {"lr": hyper.lr, "betas": (hyper.beta1, hyper.beta2), "eps": hyper.eps, "weight_decay": hyper.weight_decay}
    torch_note = "torch.set_num_threads (OpenMP)"
    if hyper.optimizer == "lamb":  # torch has none; timm's is a test reference, not installed for users
        return [Method("torch-fused", "torch LAMB", None, status="none: torch has no LAMB")], {"status": "none"}
    if hyper.optimizer == "lion":
        return _lion_methods(full_job, tensors, counts, hyper, around, around_note, torch_note, deepspeed)
    step_note = "step reads p,m,v,g 16, writes p,m,v 12"
    methods = []
    for t in counts:
        p, gbuf, copy = tensors()
        opt = torch.optim.AdamW([p], fused=True, **kw)
        methods += [
            Method("torch-fused", "torch AdamW(fused) + reduce + check + cast", t, torch_note, 28 + around,
                   f"{step_note}; {around_note}", full_job(opt, p, gbuf, copy), omp_threads=t),
            Method("torch-fused-step", "torch AdamW(fused) step alone", t, torch_note, 28.0, step_note, opt.step,
                   omp_threads=t),
        ]
    label = "DeepSpeedCPUAdam + reduce + check + cast"
    if not deepspeed:
        return methods + [Method("deepspeed-cpu-adam", label, None, status="skipped")], {"status": "skipped"}
    before = openmp_runtimes()
    status = "ok"
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        p, gbuf, copy = tensors()
        DeepSpeedCPUAdam([p], adamw_mode=True, **kw).step()  # builds or loads its extension: fail here
    except ImportError:
        status = "not installed"
    except Exception as exc:  # noqa: BLE001 -- a peer that fails to load is reported, not fatal
        status = f"unusable: {(str(exc).splitlines() or [type(exc).__name__])[0]}"
    if status != "ok":
        return methods + [Method("deepspeed-cpu-adam", label, None, status=status)], {"status": status}
    own = [r for r in openmp_runtimes() if r not in before]
    runtime = (f"its own OpenMP runtime ({', '.join(Path(r).name for r in own)}), set with omp_set_num_threads"
               if own else "OpenMP, the runtime torch loaded (torch.set_num_threads)")
    for t in counts:
        p, gbuf, copy = tensors()
        ds = DeepSpeedCPUAdam([p], adamw_mode=True, **kw)
        methods.append(Method("deepspeed-cpu-adam", label, t, runtime, 28 + around,
                              f"{step_note}; {around_note}", full_job(ds, p, gbuf, copy), omp_threads=t))
    return methods, {"status": "ok", "threads_from": runtime, "own_runtimes": own}


def _lion_methods(full_job, tensors, counts, hyper: OptimizerHyper, around: int, around_note: str,
                  torch_note: str, deepspeed: bool) -> tuple[list[Method], dict]:
    """Lion's torch rows: the plain engine's l2l.lion.Lion (torch has none; per-op, each op a
    pass over memory) doing the whole job, and DeepSpeedCPULion when importable."""
    kw = {"lr": hyper.lr, "betas": (hyper.beta1, hyper.beta2), "weight_decay": hyper.weight_decay}
    # mul_(decay) r4 w4; m*b1 r4 w4; g*omb1 r4 w4; add r8 w4; sign r4 w4; mul_ r4 w4; p+step r8 w4;
    # c != 0 r4 w1; where r9 w4; copy_ r4 w4; m*b2 in place r4 w4; g*omb2 r4 w4; add_ r8 w4
    step_bytes, step_note = 133, "l2l.lion.Lion step: 13 whole-tensor passes (its ops read 73, write 60 bytes)"
    methods = []
    for t in counts:
        p, gbuf, copy = tensors()
        opt = Lion([p], **kw)
        methods += [
            Method("torch-fused", "torch Lion (l2l.lion, unfused) + reduce + check + cast", t, torch_note,
                   step_bytes + around, f"{step_note}; {around_note}", full_job(opt, p, gbuf, copy), omp_threads=t),
            Method("torch-fused-step", "torch Lion (l2l.lion, unfused) step alone", t, torch_note, float(step_bytes),
                   step_note, opt.step, omp_threads=t),
        ]
    label = "DeepSpeedCPULion + reduce + check + cast"
    if not deepspeed:
        return methods + [Method("deepspeed-cpu-lion", label, None, status="skipped")], {"status": "skipped"}
    try:
        from deepspeed.ops.lion import DeepSpeedCPULion
        p, gbuf, copy = tensors()
        DeepSpeedCPULion([p], **kw).step()
    except ImportError:
        return methods + [Method("deepspeed-cpu-lion", label, None, status="not installed")], {"status": "not installed"}
    except Exception as exc:  # noqa: BLE001 -- a peer that fails to load is reported, not fatal
        status = f"unusable: {(str(exc).splitlines() or [type(exc).__name__])[0]}"
        return methods + [Method("deepspeed-cpu-lion", label, None, status=status)], {"status": status}
    for t in counts:
        p, gbuf, copy = tensors()
        ds = DeepSpeedCPULion([p], **kw)
        methods.append(Method("deepspeed-cpu-lion", label, t, "OpenMP", 20 + around,
                              f"step reads p,m,g 12, writes p,m 8; {around_note}", full_job(ds, p, gbuf, copy),
                              omp_threads=t))
    return methods, {"status": "ok"}


# ---------------------------------------------------------------- roofline

def _stream_methods(n: int, threads: int) -> list[Method]:
    """STREAM-like kernels over fp32 arrays of the layer's size: the bandwidth roofline.

    NumPy runs on one thread and torch on ``threads``; the best of them is taken
    as what this machine can move. The in-place kernels store to lines they have
    just read, as AdamW does to p, m, v, so they pay no write-allocate read; the
    out-of-place ones do, uncounted.
    """
    a, b, c = (np.full(n, 1.0, np.float32) for _ in range(3))
    ta, tb, tc = (torch.from_numpy(x) for x in (a, b, c))
    return [
        Method("numpy-copy", "np.copyto(b, a)", 1, "", 8.0, "read 4, write 4", lambda: np.copyto(b, a)),
        Method("numpy-add", "np.add(a, b, out=c)", 1, "", 12.0, "read 8, write 4", lambda: np.add(a, b, out=c)),
        Method("numpy-add-inplace", "np.add(a, b, out=a)", 1, "", 12.0, "read 8, write 4",
               lambda: np.add(a, b, out=a)),
        Method("torch-copy", "b.copy_(a)", threads, "", 8.0, "read 4, write 4", lambda: tb.copy_(ta),
               omp_threads=threads),
        Method("torch-add", "torch.add(a, b, out=c)", threads, "", 12.0, "read 8, write 4",
               lambda: torch.add(ta, tb, out=tc), omp_threads=threads),
        Method("torch-add-inplace", "a.add_(b)", threads, "", 12.0, "read 8, write 4", lambda: ta.add_(tb),
               omp_threads=threads),
    ]


# ---------------------------------------------------------------- timing and report

BLOCK = 2  # timed runs of one method back to back within a round


def _time_in_turn(methods: list[Method], warmup: int, repeats: int) -> None:
    """Rounds of short blocks: each method runs ``warmup`` untimed then up to BLOCK timed
    steps, then the next method. Blocks keep one method's threads alone on the cores
    (switching between OpenMP and PoCL thread pools every step costs both); rounds
    spread drift in the machine's speed over all methods alike."""
    runnable = [m for m in methods if m.run is not None]
    done, round_, omp = 0, 0, None
    while done < repeats:
        block = min(BLOCK, repeats - done)
        for m in runnable:
            if m.omp_threads is not None and m.omp_threads != omp:  # torch's and OpenMP's, outside the clock
                set_threads(m.omp_threads)
                omp = m.omp_threads
            for _ in range(warmup):
                m.run()
            for _ in range(block):
                c0 = time.process_time()  # every thread of the process: the cores the method kept busy
                t0 = time.perf_counter()
                m.run()
                t = time.perf_counter() - t0
                m.cpu.append((time.process_time() - c0) / t)
                m.times.append(t)
                m.rounds.append(round_)
        done += block
        round_ += 1


def _round_rooflines(stream: list[Method], n: int) -> dict[int, float]:
    """Each round's roofline, GB/s: the best bandwidth kernel's median in that round. The
    bandwidth a shared host grants drifts from second to second, so a method is held
    against the roofline measured beside it."""
    rounds = sorted({r for k in stream for r in k.rounds})
    return {r: max(k.bytes_per_elem * n / statistics.median(t for t, q in zip(k.times, k.rounds) if q == r) / 1e9
                   for k in stream if r in k.rounds) for r in rounds}


def _round_fractions(m: Method, roofs: dict[int, float], n: int) -> dict[int, float]:
    """The method's bandwidth over the roofline, per round."""
    return {r: m.bytes_per_elem * n / statistics.median(t for t, q in zip(m.times, m.rounds) if q == r) / 1e9
            / roofs[r] for r in sorted(set(m.rounds))}


SHORT_OF_THREADS = 0.75  # a multi-threaded row that kept fewer cores busy than this share of its threads

STATE_RATIO = 1.3  # rounds whose rooflines differ by more than this are two bandwidth states


def bandwidth_states(roofs: dict[int, float]) -> list[list[int]]:
    """The rounds grouped by the bandwidth the host granted. Some shared hosts flip between
    two states (here about 70 and 140 GB/s); a share of the roofline means little without
    its state. One group unless the fastest round's roofline is over STATE_RATIO times the
    slowest's; then two, cut at the widest gap between the sorted rooflines."""
    order = sorted(roofs, key=roofs.__getitem__)
    if not order or roofs[order[-1]] <= STATE_RATIO * roofs[order[0]]:
        return [order] if order else []
    gaps = [roofs[b] / roofs[a] for a, b in zip(order, order[1:])]
    cut = max(range(len(gaps)), key=gaps.__getitem__) + 1
    return [order[:cut], order[cut:]]


def _row(m: Method, n: int) -> dict:
    row = {"method": m.key, "id": m.id, "label": m.label, "status": m.status, "threads": m.threads,
           "threads_note": m.threads_note or None, "auto": False,
           "bytes_per_elem": m.bytes_per_elem or None, "bytes_counted": m.counted or None,
           "seconds": None, "min_seconds": None, "elems_per_s": None, "gb_s": None, "cpu_per_wall": None}
    if m.times:
        s = statistics.median(m.times)
        row.update(seconds=s, min_seconds=min(m.times), elems_per_s=n / s, gb_s=n * m.bytes_per_elem / s / 1e9,
                   cpu_per_wall=statistics.median(m.cpu))
    return row


def _auto_target(auto: EpsChoice, rows: list[dict]) -> dict:
    """The row a run under ``--eps auto`` would be: its backend at its default thread count
    (every CPU of this process's affinity; for OpenCL, at most the device's compute units).
    An OpenCL EPS that did not start at that count leaves the NumPy EPS, as ``choice.build``
    does."""
    cpus = available_cpus()
    name, why, threads = auto.name, auto.why, cpus
    if name == "opencl":
        from ..eps.opencl_backend import choose_device, default_threads
        threads = default_threads(choose_device(auto.options.get("platform"), auto.options.get("device"))[1])
        row = next((r for r in rows if r["method"] == name and r["threads"] == threads), None)
        if row is not None and row["status"] != "ok":
            name, threads, why = "numpy", cpus, f"the OpenCL EPS on the CPU did not start ({row['status']})"
    row = next((r for r in rows if r["method"] == name and r["threads"] == threads and r["status"] == "ok"), None)
    if row is not None:
        row["auto"] = True
    return {"backend": name, "threads": threads, "why": why, "target": auto.target,
            "row": row["id"] if row else None}


def _scaling(rows: list[dict]) -> dict:
    """Per method measured at more than one count: each count's rate and same-round share, and
    the speed-up from the fewest threads to the most."""
    out = {}
    for key in dict.fromkeys(r["method"] for r in rows):
        at = {r["threads"]: r for r in rows if r["method"] == key and r["threads"] is not None and r["elems_per_s"]}
        if not at:
            continue
        lo, hi = min(at), max(at)
        out[key] = {"label": at[lo]["label"],
                    "threads": {str(t): {"elems_per_s": r["elems_per_s"],
                                         "roofline_fraction_same_round": r["roofline_fraction_same_round"]}
                                for t, r in sorted(at.items())},
                    "speedup": at[hi]["elems_per_s"] / at[lo]["elems_per_s"] if hi > lo else None,
                    "speedup_from": lo, "speedup_to": hi}
    return out


def main_row(result: dict, method: str) -> dict | None:
    """``method``'s row at the most threads it ran on (where a one-figure summary wants it)."""
    rows = [r for r in result["rows"] if r["method"] == method]
    return max(rows, key=lambda r: (r["status"] == "ok", r["threads"] or 0), default=None)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run(args: argparse.Namespace) -> dict:
    n, k = args.numel, args.contributions
    counts = args.threads
    gdtype, cdtype = GRAD_DTYPES[args.grad_dtype], COPY_DTYPES[args.copy_dtype]
    hyper = OptimizerHyper(optimizer=args.optimizer)
    load_before = os.getloadavg()[0]
    torch_threads = torch.get_num_threads()
    roof_threads = max(max(counts), available_cpus())
    auto = choose("auto")
    p0, grads = _inputs(n, k, gdtype)
    stream = _stream_methods(n, roof_threads)
    eps, opened = _eps_methods(p0, grads, cdtype, hyper, args.inv_scale, counts, auto)
    try:
        optimizers, deepspeed = _optimizer_methods(p0, grads, cdtype, hyper, args.inv_scale, counts,
                                                   not args.no_deepspeed)
        methods = eps + optimizers
        _time_in_turn(stream + methods, args.warmup, args.repeats)
        rtl = rtl_clocks(min(n, RTL_NUMEL), k, gdtype, cdtype, hyper)
    finally:
        for backend in opened:
            backend.close()
        omp_seen = set_threads(roof_threads)
        torch.set_num_threads(torch_threads)
    kernels = [_row(m, n) for m in stream]
    best = max(kernels, key=lambda r: r["gb_s"])
    roofline = best["gb_s"]
    minimum = k * gdtype.itemsize + (36 if args.optimizer == "lamb" else 2 * OPTIMIZERS[args.optimizer].state_bytes) \
        + cdtype.itemsize
    rows = [_row(m, n) for m in methods]
    refs = {r["threads"]: r["elems_per_s"] for r in rows if r["method"] == "torch-fused"}
    roofs = _round_rooflines(stream, n)
    states = bandwidth_states(roofs)
    per_round = {m.id: _round_fractions(m, roofs, n) for m in methods if m.times}
    for r, m in zip(rows, methods):
        ok = r["elems_per_s"] is not None
        ref = refs.get(r["threads"] if r["threads"] is not None else max(counts))
        r["roofline_fraction"] = r["gb_s"] / roofline if ok else None
        r["roofline_fraction_same_round"] = statistics.median(per_round[m.id].values()) if ok else None
        r["vs_torch_fused"] = r["elems_per_s"] / ref if ok and ref else None
    return {
        "args": vars(args),
        "env": {"cpu": _cpu_name(), "logical_cpus": os.cpu_count(), "affinity_cpus": available_cpus(),
                "torch": torch.__version__, "roofline_threads": {"numpy": 1, "torch": roof_threads},
                "numpy": np.__version__, "openmp_runtimes": omp_seen, "deepspeed": deepspeed,
                "loadavg_1min_before": load_before, "loadavg_1min_after": os.getloadavg()[0]},
        "eps_auto": _auto_target(auto, rows),
        "roofline": {"gb_s": roofline, "kernel": best["method"], "kernels": kernels,
                     "convention": "bytes read + bytes written; write-allocate reads not counted"},
        "bandwidth_states": [
            {"rounds": len(group), "roofline_gb_s": [min(roofs[q] for q in group), max(roofs[q] for q in group)],
             "fractions": {key: statistics.median(f[q] for q in group if q in f)
                           for key, f in per_round.items() if any(q in f for q in group)}}
            for group in states],
        "minimum_bytes_per_elem": minimum,
        "bound_elems_per_s": roofline * 1e9 / minimum,
        "rows": rows,
        "rtl": rtl,
        "scaling": _scaling(rows),
        "short_of_threads": [r["id"] for r in rows if (r["threads"] or 0) > 1 and r["cpu_per_wall"] is not None
                             and r["cpu_per_wall"] < SHORT_OF_THREADS * r["threads"]],
    }


_OPTIMIZER_WORDS = {"adamw": "AdamW on fp32 p/m/v", "lion": "Lion on fp32 p/m",
                    "lamb": "LAMB on fp32 p/m/v (a norm pass, then a step pass)"}


def _num(x, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def _threads_cell(r: dict) -> str:
    if r["threads"] is None:
        return "—"
    if r["threads_note"] in (HLS_THREADS, RTL_THREADS):
        return f"{r['threads']} ({'C-sim' if r['threads_note'] == HLS_THREADS else 'RTL sim'})"
    return str(r["threads"])


def _auto_line(result: dict) -> str:
    auto = result.get("eps_auto")
    if not auto:
        return ""
    where = (f"the row marked in the auto column" if auto["row"] else
             f"not among the rows measured (run with --threads {auto['threads']})")
    return (f"`--eps auto` on this host takes {auto['backend']} on {auto['threads']} thread"
            f"{'s' if auto['threads'] != 1 else ''} ({auto['why']}{'; ' + auto['target'] if auto['target'] else ''}): "
            f"{where}.\n\n")


def markdown(result: dict) -> str:
    a, env, roof = result["args"], result["env"], result["roofline"]
    kernels = ", ".join(f"{r['label']} ({r['threads']} thr) {r['gb_s']:.1f}" for r in roof["kernels"])
    ds = env.get("deepspeed", {})
    ds_threads = f" DeepSpeedCPUAdam: {ds['threads_from']}." if ds.get("threads_from") else ""
    head = (f"Full EPS layer update on {a['numel']:,} elements: {a['contributions']} x {a['grad_dtype']} gradient "
            f"contribution(s) reduced, {_OPTIMIZER_WORDS[a.get('optimizer', 'adamw')]}, {a['copy_dtype']} device copy. "
            f"{env['cpu']}, {env['logical_cpus']} logical CPUs ({env['affinity_cpus']} in this process's affinity), "
            f"torch {env['torch']}. Each method at each thread count ({', '.join(map(str, a['threads']))}): "
            f"the NumPy EPS with that many threads, the OpenCL EPS on a sub-device of that many compute units, "
            f"torch and its peers with torch.set_num_threads and omp_set_num_threads on every OpenMP runtime "
            f"loaded ({', '.join(f'{k}: {v}' for k, v in env['openmp_runtimes'].items()) or 'none found'} "
            f"after the run).{ds_threads} "
            f"Median of {a['repeats']} timed runs, in blocks of up to {BLOCK} after {a['warmup']} warm-up each, "
            f"all methods of all counts in turn. "
            f"Load average before/after {env['loadavg_1min_before']:.2f}/{env['loadavg_1min_after']:.2f}: "
            f"other processes on these cores slow the multi-threaded methods most.\n\n"
            f"Roofline {roof['gb_s']:.1f} GB/s (best of: {kernels} GB/s; {roof['convention']}). "
            f"'CPU s / wall s': the process's CPU time over the wall time of a timed run, median: the "
            f"cores the method kept busy (spinning included), a check that it ran on its threads. "
            f"'Of roofline, same round': the median over rounds of the method's bandwidth over the best "
            f"kernel's in the same round (the bandwidth a shared host grants drifts between rounds). "
            f"Algorithmic minimum {result['minimum_bytes_per_elem']} B/element, so at most "
            f"{result['bound_elems_per_s'] / 1e9:.2f} G elements/s.\n\n"
            + _auto_line(result) +
            "| method | threads | CPU s / wall s | auto | G elem/s | B/elem counted | GB/s | of roofline "
            "| of roofline, same round | vs torch fused + reduce + cast, same threads |\n"
            "|---|---:|---:|:---:|---:|---:|---:|---:|---:|---:|\n")
    body = ""
    for r in result["rows"]:
        label = r["label"] if r["status"] == "ok" else f"{r['label']} ({r['status']})"
        eps = None if r["elems_per_s"] is None else r["elems_per_s"] / 1e9
        frac = "—" if r["roofline_fraction"] is None else f"{r['roofline_fraction']:.0%}"
        paired = "—" if r["roofline_fraction_same_round"] is None else f"{r['roofline_fraction_same_round']:.0%}"
        body += (f"| {label} | {_threads_cell(r)} | {_num(r.get('cpu_per_wall'), '.2f')} "
                 f"| {'✓' if r.get('auto') else ''} | {_num(eps, '.3f')} "
                 f"| {_num(r['bytes_per_elem'], 'g')} | {_num(r['gb_s'], '.1f')} | {frac} | {paired} "
                 f"| {_num(r['vs_torch_fused'], '.2f')} |\n")
    counted = {}
    for r in result["rows"]:
        if r["bytes_counted"]:
            counted.setdefault(r["method"], r["bytes_counted"])
    notes = "".join(f"- {key}: {text}\n" for key, text in counted.items())
    by_method: dict[str, dict] = {}
    for r in result["rows"]:
        if r["threads_note"]:
            by_method.setdefault(r["method"], {})[r["threads"]] = r["threads_note"]
    threads = "".join(
        f"- {key}: {next(iter(notes.values()))}\n" if len(set(notes.values())) == 1 else
        "".join(f"- {key} at {t}: {note}\n" for t, note in notes.items())
        for key, notes in by_method.items())
    short = result.get("short_of_threads")
    if short:
        body += (f"\nThese rows kept fewer cores busy than {SHORT_OF_THREADS:.0%} of their threads (CPU s / "
                 f"wall s): {', '.join(short)}. Other processes held the cores, so their rates and speed-ups "
                 f"say little about the method; rerun on a quiet machine.\n")
    return (head + body + _rtl_markdown(result.get("rtl")) + _scaling_markdown(result) + _states_markdown(result)
            + "\nBytes counted per element:\n" + notes + "\nThreads:\n" + threads)


def _scaling_markdown(result: dict) -> str:
    """Each method's rate and same-round share of the roofline per thread count, and the
    speed-up from the fewest threads to the most."""
    scaling = result.get("scaling", {})
    counts = sorted({int(t) for s in scaling.values() for t in s["threads"]})
    if not scaling or len(counts) < 2:
        return ""
    lo, hi = counts[0], counts[-1]
    head = ("\nScaling (same runs as above):\n\n| method | "
            + " | ".join(f"{t} thr: G elem/s | {t} thr: of roofline, same round" for t in counts)
            + f" | speed-up, {lo} → {hi} threads |\n|---|" + "---:|---:|" * len(counts) + "---:|\n")
    lines = ""
    for s in scaling.values():
        cells = []
        for t in counts:
            at = s["threads"].get(str(t))
            cells += ["—", "—"] if at is None else [
                f"{at['elems_per_s'] / 1e9:.3f}", _num(at["roofline_fraction_same_round"], ".0%")]
        if s["speedup"] is None:
            up = "—"
        else:
            up = f"{s['speedup']:.2f}x" + ("" if (s["speedup_from"], s["speedup_to"]) == (lo, hi)
                                            else f" ({s['speedup_from']} → {s['speedup_to']})")
        lines += f"| {s['label']} | " + " | ".join(cells) + f" | {up} |\n"
    return head + lines


def _states_markdown(result: dict) -> str:
    """The same-round share of the roofline per bandwidth state, when the host changed state
    during the run (see bandwidth_states)."""
    states = result.get("bandwidth_states", [])
    if len(states) < 2:
        return ""
    lines = ["", f"The host's bandwidth changed state during the run (round rooflines more than "
                 f"{STATE_RATIO}x apart); the same-round share of the roofline in each:", ""]
    for st in states:
        lo, hi = st["roofline_gb_s"]
        shares = ", ".join(f"{key} {f:.0%}" for key, f in st["fractions"].items())
        lines.append(f"- {lo:.0f}–{hi:.0f} GB/s ({st['rounds']} rounds): {shares}")
    return "\n".join(lines) + "\n"


def _parser() -> argparse.ArgumentParser:
    p = Parser(prog="l2l bench eps", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=16 << 20, help="elements in the layer (default %(default)s)")
    p.add_argument("-k", "--contributions", type=int, default=1, help="gradient contributions K (default 1)")
    p.add_argument("--optimizer", choices=list(OPTIMIZERS), default="adamw",
                   help="the update timed: adamw (p, m, v), lion (p, m) or lamb (p, m, v, two passes) "
                        "(default adamw)")
    p.add_argument("--grad-dtype", choices=list(GRAD_DTYPES), default="fp32")
    p.add_argument("--copy-dtype", choices=list(COPY_DTYPES), default="fp32")
    p.add_argument("--inv-scale", type=float, default=1.0, help="1 / (loss scale * divisor) (default 1)")
    p.add_argument("--threads", type=int, nargs="+", metavar="N", default=None,
                   help="thread counts to time each CPU method at (default: 1 and the CPUs in this "
                        "process's affinity)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--no-deepspeed", action="store_true",
                   help="skip DeepSpeedCPUAdam even when importable (its first use compiles a C++ extension)")
    p.add_argument("--out", default="bench/results")
    return p


def run_eps_bench(argv: list[str]) -> int:
    run_eps_bench_result(argv)
    return 0


def run_eps_bench_result(argv: list[str]) -> dict:
    args = _parser().parse_args(argv)
    if args.numel < 1 or args.contributions < 1 or args.repeats < 1 or args.warmup < 0 or not args.inv_scale > 0:
        raise UserError("--numel, --contributions and --repeats must be >= 1, --warmup >= 0, --inv-scale > 0")
    if args.threads is not None and min(args.threads) < 1:
        raise UserError(f"--threads: counts must be at least 1 (got {' '.join(map(str, args.threads))})")
    args.threads = sorted(set(args.threads or (1, available_cpus())))
    result = run(args)
    name = "bench_eps" if args.optimizer == "adamw" else f"bench_eps_{args.optimizer}"  # each its own file
    save_results(args.out, name, result, markdown(result))
    return result
