"""The HLS C-simulation EPS: the Vitis HLS kernels of hls/eps_kernels.cpp, run on the host.

The HLS source is plain C++17 (its ``#pragma HLS`` lines are ignored by g++),
so the very kernels an FPGA build synthesises are compiled here into a shared
library and called through ctypes on NumPy arrays: ``p, m, v`` live in host
memory, which plays the card's DRAM. One update is the host driver's sequence
for the card: finite flag set to 1, ``eps_check_<g>`` over the K contributions
(back to back in one buffer), the optimizer's update kernel (which writes nothing
when the flag was cleared), flag read back. The step scalars' type picks the
update kernel (:data:`UPDATE_KERNELS`): ``eps_update_<g>_<c>`` on ``(p, m, v)`` for
AdamW, ``eps_lion_<g>_<c>`` on ``(p, m)`` for Lion. LAMB (a
:class:`~l2l.eps.contract.LambStep`) is two kernels on ``(p, m, v)``
(:data:`LAMB_KERNELS`): ``eps_lamb_norms_<g>`` (m', v' and each segment's 16-lane
partial sums), the host's fold of the sums into one step size per segment
(``LambStep.steps``), then ``eps_lamb_step_<c>`` (p' and the copy). Same
semantics as the NumPy backend, bit for bit (docs/eps-numerics.md);
tests/test_eps_backends_bitexact.py checks AdamW, tests/test_lion_hls.py Lion,
tests/test_lamb_hls.py LAMB.

The source is found by :mod:`l2l.kernels` (the checkout's ``hls/``, or the copy an
installed l2l carries as package data). Build: ``g++`` with :data:`CXX_FLAGS`
(``-ffp-contract=off``, never ``-ffast-math``), on first use, into
``$XDG_CACHE_HOME/l2l/hls-csim/<sha256>.so`` (``~/.cache`` by default; the
``cache_dir`` option overrides), where the hash covers the source, the flags and
the compiler's version: an edited source is rebuilt, an unchanged one is reused
across processes. The library is written under a temporary name and renamed into
place, so concurrent builders (test workers) never see a half-written file.
Nothing is written next to the source: an install in a read-only site-packages
builds as a checkout does.

Options: ``cxx`` (compiler, default ``g++``), ``cache_dir``.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Sequence

import numpy as np

from .. import kernels
from ..errors import UserError
from .backend import EpsBackend, HostState, adoptable, check_optimizer, check_step, lamb_bounds
from .contract import LambStep, StepScalars, optimizer_of
from .numerics import COPY_DTYPES, GRAD_DTYPES, LANES

KERNEL_SOURCE = kernels.source_path("hls")  # hls/eps_kernels.cpp, or its installed copy (l2l.kernels)
DEFAULT_CXX = "g++"
INSTALL_HINT = "apt-get install g++"
CXX_FLAGS = ["-O2", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=off", "-fno-fast-math",
             "-Wno-unknown-pragmas"]
if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"):
    CXX_FLAGS.append("-mno-fma")  # belt and braces: -ffp-contract=off already forbids contraction

SUFFIX = {COPY_DTYPES["fp32"]: "f32", COPY_DTYPES["bf16"]: "bf16", COPY_DTYPES["fp16"]: "f16"}
GRAD_SUFFIX = {GRAD_DTYPES[k]: SUFFIX[COPY_DTYPES[k]] for k in GRAD_DTYPES}
KINDS = ("f32", "bf16", "f16")
KERNEL_NAMES = ([f"eps_check_{g}" for g in KINDS] + [f"eps_update_{g}_{c}" for g in KINDS for c in KINDS]
                + [f"eps_lion_{g}_{c}" for g in KINDS for c in KINDS]
                + [f"eps_lamb_norms_{g}" for g in KINDS] + [f"eps_lamb_step_{c}" for c in KINDS]
                + [f"eps_copy_{c}" for c in KINDS])
# each one-pass optimizer's update kernel family (eps_<family>_<g>_<c>), by contract.OPTIMIZERS name
UPDATE_KERNELS = {"adamw": "eps_update", "lion": "eps_lion"}
# LAMB's two passes: the norms (eps_lamb_norms_<g>), then the step (eps_lamb_step_<c>)
LAMB_KERNELS = ("eps_lamb_norms", "eps_lamb_step")
MAX_N = (1 << 32) - 1  # n and k are 32-bit kernel arguments

_ptr, _uint, _float = ctypes.c_void_p, ctypes.c_uint, ctypes.c_float
_ARGTYPES = {
    "eps_check": [_ptr, _ptr, _uint, _uint, _float],
    "eps_update": [_ptr] * 6 + [_uint, _uint, _uint] + [_float] * 9,  # n, k, n_decay, the step scalars
    "eps_lion": [_ptr] * 5 + [_uint, _uint, _uint] + [_float] * 7,  # n, k, n_decay, the Lion scalars
    "eps_lamb_norms": [_ptr] * 7 + [_uint] * 4 + [_float] * 9,  # n, k, n_decay, nseg, the LAMB scalars
    "eps_lamb_step": [_ptr] * 7 + [_uint] * 3 + [_float] * 9,  # n, n_decay, nseg, the LAMB scalars
    "eps_copy": [_ptr, _ptr, _uint],
}



def kernel_family(name: str) -> str:
    """A kernel's family, its name without the dtype suffixes: ``eps_update_f32_bf16`` ->
    ``eps_update``, ``eps_lamb_norms_f16`` -> ``eps_lamb_norms``."""
    parts = name.split("_")
    while parts[-1] in KINDS:
        parts.pop()
    return "_".join(parts)


_lock = threading.Lock()
_libraries: dict[tuple[str, str], ctypes.CDLL] = {}


def kernel_source() -> str:
    return KERNEL_SOURCE.read_text()


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "l2l" / "hls-csim"


def _compiler(cxx: str | None) -> str:
    name = cxx or DEFAULT_CXX
    path = shutil.which(name)
    if path is None:
        raise UserError(f"--eps hls-csim needs a C++ compiler: {name} not found ({INSTALL_HINT})")
    return path


def _compiler_version(path: str) -> str:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60, check=False)
    except OSError as exc:
        raise UserError(f"--eps hls-csim: cannot run {path} ({exc}); {INSTALL_HINT}") from None
    return out.stdout.strip()


def library_path(cxx: str | None = None, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the C-simulation library for this source, these flags and this compiler lives."""
    path = _compiler(cxx)
    key = hashlib.sha256()
    for part in (KERNEL_SOURCE.read_bytes(), "\0".join(CXX_FLAGS).encode(), _compiler_version(path).encode(),
                 path.encode(), platform.machine().encode()):
        key.update(part)
        key.update(b"\0\1\0")
    return Path(cache_dir or default_cache_dir()) / f"eps_kernels-{key.hexdigest()[:32]}.so"


def build_library(cxx: str | None = None, cache_dir: str | os.PathLike | None = None) -> Path:
    """Compile hls/eps_kernels.cpp unless the cache already holds this build; its path."""
    if not KERNEL_SOURCE.is_file():
        raise UserError(f"--eps hls-csim: {kernels.describe('hls')}")
    target = library_path(cxx, cache_dir)
    if target.is_file():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=target.stem + ".", suffix=".tmp.so", dir=target.parent)
    except OSError as exc:
        raise UserError(f"--eps hls-csim: cannot write the kernel library into {target.parent} "
                        f"({exc.strerror}); set XDG_CACHE_HOME or the cache_dir option") from None
    os.close(fd)
    try:
        cmd = [_compiler(cxx), *CXX_FLAGS, "-o", tmp, str(KERNEL_SOURCE)]
        child = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
        if child.returncode != 0:
            raise RuntimeError(f"compiling {KERNEL_SOURCE} failed ({' '.join(cmd)}):\n{child.stderr}")
        os.replace(tmp, target)  # atomic: a concurrent builder's identical file is replaced whole
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load_library(cxx: str | None = None, cache_dir: str | os.PathLike | None = None) -> ctypes.CDLL:
    """The kernels as a ctypes library with argument types set (built on first use, once per process)."""
    with _lock:
        path = build_library(cxx, cache_dir)
        key = (str(path), cxx or DEFAULT_CXX)
        lib = _libraries.get(key)
        if lib is None:
            lib = ctypes.CDLL(str(path))  # CDLL calls release the GIL
            for name in KERNEL_NAMES:
                fn = getattr(lib, name)
                fn.argtypes = _ARGTYPES[kernel_family(name)]
                fn.restype = None
            _libraries[key] = lib
        return lib


def _addr(a: np.ndarray) -> int:
    return a.ctypes.data


class HlsCsimBackend(HostState, EpsBackend):
    name = "hls-csim"
    optimizers = frozenset({*UPDATE_KERNELS, "lamb"})

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        if not KERNEL_SOURCE.is_file():
            return False, kernels.describe("hls")
        path = shutil.which(DEFAULT_CXX)
        if path is None:
            return False, f"no C++ compiler ({DEFAULT_CXX}): {INSTALL_HINT}"
        version = _compiler_version(path).splitlines()
        return True, f"C-simulation of {KERNEL_SOURCE.name} with {version[0] if version else path}"

    def __init__(self, cxx: str | None = None, cache_dir: str | os.PathLike | None = None) -> None:
        self.lib = load_library(cxx, cache_dir)
        self._fn = {name: getattr(self.lib, name) for name in KERNEL_NAMES}
        self._state: dict[int, tuple[np.ndarray, ...]] = {}  # layer -> (p, *moments)
        self._local = threading.local()  # per-thread scratch: the server steps on a worker thread

    # ------------------------------------------------------------ host-side staging
    def _scratch(self, key: str, n: int, dtype: np.dtype) -> np.ndarray:
        """A contiguous scratch array of ``n`` elements (per thread, grown as needed)."""
        bufs = self._local.__dict__.setdefault("bufs", {})
        buf = bufs.get((key, dtype))
        if buf is None or buf.shape[0] < n:
            buf = bufs[(key, dtype)] = np.empty(max(n, 1), dtype)
        return buf[:n]

    def _gradient_block(self, grads, n: int) -> tuple[np.ndarray, int, np.dtype]:
        """The K contributions back to back in one C-contiguous buffer; (buffer, k, dtype).

        Everything is checked here, before any kernel runs: a refused step changes nothing.
        """
        if isinstance(grads, np.ndarray) and grads.ndim == 2:
            k, dtype = grads.shape[0], grads.dtype
            if grads.shape[1] != n:
                raise ValueError(f"gradient of shape {grads.shape[1:]}, expected ({n},)")
        else:
            k = len(grads)
            if k == 0:
                raise ValueError("at least one gradient contribution")
            for g in grads:
                if g.shape != (n,):
                    raise ValueError(f"gradient of shape {g.shape}, expected ({n},)")
            dtype = grads[0].dtype
            if any(g.dtype != dtype for g in grads):
                raise ValueError("gradient contributions must share one dtype")
        if k == 0:
            raise ValueError("at least one gradient contribution")
        if k > MAX_N or k * n >= 1 << 63:
            raise ValueError(f"{k} contributions of {n} elements: too many for the kernel")
        if dtype not in GRAD_SUFFIX:
            raise ValueError(f"unsupported gradient dtype {dtype}; one of {', '.join(GRAD_DTYPES)}")
        if isinstance(grads, np.ndarray) and grads.ndim == 2 and grads.flags.c_contiguous:
            return grads, k, dtype
        if k == 1 and grads[0].flags.c_contiguous:
            return grads[0], k, dtype
        block = self._scratch("grads", k * n, dtype).reshape(k, n)
        for c in range(k):
            block[c] = grads[c]
        return block, k, dtype

    @staticmethod
    def _check_copy(copy_out: np.ndarray, n: int) -> str:
        if copy_out.dtype not in SUFFIX:
            raise ValueError(f"unsupported device-copy dtype {copy_out.dtype}")
        if copy_out.shape != (n,):
            raise ValueError(f"device copy of shape {copy_out.shape}, expected ({n},)")
        if not copy_out.flags.writeable:
            raise ValueError("device copy is read-only")
        return SUFFIX[copy_out.dtype]

    def _copy_target(self, copy_out: np.ndarray) -> np.ndarray:
        """Where the kernel writes the copy: ``copy_out`` itself, or scratch for a strided view."""
        if copy_out.flags.c_contiguous:
            return copy_out
        return self._scratch("copy", copy_out.shape[0], copy_out.dtype)

    # ------------------------------------------------------------ EpsBackend
    def allocate(self, layer: int, p: np.ndarray, moments: int = 2) -> None:
        p = np.array(p, dtype=np.float32, copy=True, order="C")
        if p.ndim != 1:
            raise ValueError(f"layer {layer}: master weights of shape {p.shape}, expected one dimension")
        if p.shape[0] > MAX_N:
            raise ValueError(f"layer {layer}: {p.shape[0]} elements; the kernels take at most {MAX_N}")
        self._state[layer] = (p,) + tuple(np.zeros_like(p) for _ in range(moments))

    def adopt(self, layer: int, p: np.ndarray, *moments: np.ndarray) -> None:
        """Takes the arrays themselves when they are writable contiguous fp32 vectors: no copy."""
        if p.shape[0] > MAX_N:
            raise ValueError(f"layer {layer}: {p.shape[0]} elements; the kernels take at most {MAX_N}")
        self._state[layer] = tuple(adoptable(a) for a in (p, *moments))


    def step(self, layer: int, grads: Sequence[np.ndarray], scalars: StepScalars,
             copy_out: np.ndarray, n_decay: int | None = None) -> bool:
        state = self._state[layer]
        n = state[0].shape[0]
        check_step(grads, copy_out, n, n_decay)  # the shared contract, before any kernel runs
        check_optimizer(self, scalars, len(state) - 1)  # one we run, on state of its shape
        seg = lamb_bounds(scalars, n) if isinstance(scalars, LambStep) else None
        block, k, gdtype = self._gradient_block(grads, n)
        c = self._check_copy(copy_out, n)
        g = GRAD_SUFFIX[gdtype]
        target = self._copy_target(copy_out)
        n_decay = n if n_decay is None else n_decay
        flag = np.ones(1, np.int32)  # the host sets the flag; eps_check clears it
        self._fn[f"eps_check_{g}"](_addr(block), _addr(flag), n, k, scalars.inv_scale)
        if seg is not None:
            self._lamb(state, block, k, g, c, target, flag, n, n_decay, seg, scalars)
        else:
            kernel = UPDATE_KERNELS[optimizer_of(scalars).name]
            # buffers (gr, the state, copy, finite), n, k, n_decay, the scalars in their table order
            self._fn[f"{kernel}_{g}_{c}"](_addr(block), *(_addr(a) for a in state), _addr(target), _addr(flag),
                                          n, k, n_decay, *scalars.as_tuple())
        finite = bool(flag[0])
        if finite and target is not copy_out:
            copy_out[...] = target
        return finite

    def _lamb(self, state, block, k: int, g: str, c: str, target: np.ndarray, flag: np.ndarray, n: int,
              n_decay: int, seg: np.ndarray, step: LambStep) -> None:
        """LAMB's two kernels and the host's fold between them; nothing when the flag is clear."""
        nseg = seg.shape[0] - 1
        scalars = step.scalars.as_tuple()  # the nine kernel scalars, in LambScalars order
        sums = np.zeros((nseg, 2, LANES), np.float32)
        norms, apply = LAMB_KERNELS
        # buffers (gr, p, m, v, seg, sums, finite), n, k, n_decay, nseg, the scalars
        self._fn[f"{norms}_{g}"](_addr(block), *(_addr(a) for a in state), _addr(seg), _addr(sums), _addr(flag),
                                 n, k, n_decay, nseg, *scalars)
        if not flag[0]:  # nothing was written: no fold, no second pass
            return
        steps = np.ascontiguousarray(step.steps(sums), dtype=np.float32)
        if steps.shape != (nseg,):
            raise RuntimeError(f"LAMB step sizes of shape {steps.shape}, expected ({nseg},)")
        # buffers (p, m, v, copy, seg, steps, finite), n, n_decay, nseg, the scalars
        self._fn[f"{apply}_{c}"](*(_addr(a) for a in state), _addr(target), _addr(seg), _addr(steps), _addr(flag),
                                 n, n_decay, nseg, *scalars)

    def write_copy(self, layer: int, copy_out: np.ndarray) -> None:
        p = self._state[layer][0]
        n = p.shape[0]
        c = self._check_copy(copy_out, n)
        target = self._copy_target(copy_out)
        self._fn[f"eps_copy_{c}"](_addr(p), _addr(target), n)
        if target is not copy_out:
            copy_out[...] = target

