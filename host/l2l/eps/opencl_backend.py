"""The OpenCL EPS: layer state in an OpenCL device's memory, kernels from fpga/opencl/eps.cl.

The same kernel source runs on PoCL on any CPU (CI, and a fast CPU EPS) and,
built offline into a binary (``.xclbin``/``.aocx``), on an FPGA card's OpenCL
platform, where ``p, m, v`` sit in the card's DRAM: only gradients go in and
device copies come out. Per update: the K gradient contributions are one device
buffer, back to back (on a CPU device, the host's own inbox, not copied);
``eps_check_*`` clears the layer's finite flag on any inf/NaN in their scaled
sum; ``eps_update_*`` (AdamW on ``p, m, v``) or ``eps_lion_*`` (Lion on ``p, m``)
sums them again, runs the optimizer in place and writes the device copy (doing
nothing when the flag is clear); the copy is read back or,
on a CPU device, mapped. All on one in-order queue, waited for once, with the
flag reset behind the wait for the next step. LAMB (a
:class:`~l2l.eps.contract.LambStep`) is two kernels with the host between them:
``eps_lamb_norms_*`` (m', v' and each segment's 16-lane sums), a wait for the flag
and the sums, the host's fold (``LambStep.steps``), then ``eps_lamb_step_*`` (p' and
the copy).

Platform and device: ``platform``/``device`` options or ``L2L_CL_PLATFORM`` /
``L2L_CL_DEVICE`` (an index or a case-insensitive substring of the name). Unnamed,
the device is a CPU one (kernels built from source), or with a prebuilt binary an
accelerator (the FPGA card it was built for); a GPU only when named: it is the
training's GPU, whose memory and time the relay needs.
"""
from __future__ import annotations

import os
import platform as host_platform
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Sequence

import numpy as np

from .. import kernels
from ..errors import UserError
from ..hostmem import aligned_empty
from .backend import (EpsBackend, adoptable, check_copy, check_optimizer, check_state, check_step, lamb_bounds,
                      read_only)
from .contract import LambScalars, LambStep, LionScalars, StepScalars, optimizer_of
from .numerics import COPY_DTYPES, LANES
from .threads import available_cpus

KERNEL_SOURCE = kernels.source_path("opencl")  # fpga/opencl/eps.cl, or its installed copy (l2l.kernels)
BUILD_OPTIONS = ["-cl-fp32-correctly-rounded-divide-sqrt", "-cl-std=CL1.2"]
NT_OPTION = "-DL2L_NT_STORES"  # x86 CPU devices: the device copy with streaming stores (eps.cl)
INSTALL_HINT = ("install an OpenCL platform: Debian 'apt-get install pocl-opencl-icd', "
                "or 'pip install pocl-binary-distribution'")
VECTOR_WIDTHS = (8, 16)  # elements per vector (VW in eps.cl): float8, or float16 where the device prefers it
BINARY_VECTOR = 8  # what a prebuilt binary is assumed to use unless told (only the launch shape depends on it)
# CPU devices: a work-item per contiguous chunk of at least MIN_CHUNK vectors (32 or 64 KiB
# of fp32), at most CHUNKS_PER_CU per compute unit: long sequential streams, and enough chunks
# that a thread slowed by other load hands its share to the others (16 to 256 chunks on
# 16.8M elements measured alike). Other devices: a work-item per vector, WORK_GROUP a group.
MIN_CHUNK = 1024
CHUNKS_PER_CU = 64
WORK_GROUP = 256
LAUNCHES = ("auto", "chunks", "vectors", "task")
# per fpga/ARGS.md (the updates: with n_decay), by kernel family (kernel_family)
KERNEL_ARGS = {"check": 5, "update": 18, "lion": 15, "lamb_norms": 20, "lamb_step": 19, "copy": 3}
# The buffer arguments of each kernel family, by their fpga/ARGS.md names: the argument a
# device buffer is bound to when it is made (OpenCLBackend._bind).
BUFFER_ARGS = {"check": {"g": 0, "finite": 1},
               "update": {"gr": 0, "p": 1, "m": 2, "v": 3, "copy": 4, "finite": 5},
               "lion": {"gr": 0, "p": 1, "m": 2, "copy": 3, "finite": 4},
               "lamb_norms": {"gr": 0, "p": 1, "m": 2, "v": 3, "seg": 4, "sums": 5, "finite": 6},
               "lamb_step": {"p": 0, "m": 1, "v": 2, "copy": 3, "seg": 4, "steps": 5, "finite": 6},
               "copy": {"p": 0, "copy": 1}}
STATE_ARGS = ("p", "m", "v")  # a layer's state buffers, by their fpga/ARGS.md names (Lion's: p, m)
# Each one-pass optimizer's update kernels, eps_<family>_<g>_<c> (LAMB's two: OpenCLBackend._lamb), and
# the scalar arguments of each optimizer in order
UPDATE_FAMILY = {"adamw": "update", "lion": "lion"}
_SCALAR_NAMES = {cls: cls.names() for cls in (StepScalars, LionScalars, LambScalars)}
_KINDS = ("f32", "bf16", "f16")
PROBE_N = 4 * 16 + 3  # elements of the zero-copy probe: whole vectors of either width and a tail

_PROBE = """
import sys, pyopencl as cl
path, platform, device = sys.argv[1:]
plat = next(p for p in cl.get_platforms() if p.name == platform)
dev = next(d for d in plat.get_devices() if d.name == device)
ctx = cl.Context([dev])
try:
    cl.Program(ctx, [dev], [open(path, 'rb').read()]).build()
except cl.Error:
    sys.exit(1)  # an ordinary error: the parent reports it
"""

_SUFFIX = {COPY_DTYPES["fp32"]: "f32", COPY_DTYPES["bf16"]: "bf16", COPY_DTYPES["fp16"]: "f16"}


def kernel_family(name: str) -> str | None:
    """An EPS kernel's family, the key of KERNEL_ARGS and BUFFER_ARGS: its name without the
    ``eps_`` prefix and the dtype suffixes (``eps_update_f32_bf16`` -> ``update``,
    ``eps_lamb_norms_f16`` -> ``lamb_norms``); None for a name not ``eps_...``."""
    if not name.startswith("eps_"):
        return None
    parts = name.split("_")[1:]
    while len(parts) > 1 and parts[-1] in _KINDS:
        parts.pop()
    return "_".join(parts)


def regions(kernel: str, k: int = 1) -> int:
    """Regions kernel ``kernel`` (``eps_check_f32``...) walks at once for ``k`` contributions:
    eps_check about four streams (check_regions in eps.cl), the others one."""
    if kernel.startswith("eps_check"):
        return 1 if k >= 4 else 2 if k >= 2 else 4
    return 1


def kernel_source() -> str:
    if not KERNEL_SOURCE.is_file():
        raise UserError(f"--eps opencl: {kernels.describe('opencl')} (or give a prebuilt --cl-binary)")
    return KERNEL_SOURCE.read_text()


def _cl():
    # PoCL's CPU worker threads pinned one per core: on a 2-core host the EPS step then
    # held 79-80% of the memory roofline run after run, against 63-76% unpinned (threads
    # migrating under torch's). PoCL reads it when it first loads, so it is set before any
    # platform query; a user's own POCL_AFFINITY wins.
    os.environ.setdefault("POCL_AFFINITY", "1")
    try:
        import pyopencl as cl
    except ImportError:
        raise UserError(f"--eps opencl needs pyopencl: pip install 'l2l[opencl]'; and {INSTALL_HINT}") from None
    return cl


def _pick(items, want: str | None, what: str):
    if want is None or want == "":
        return None
    if want.isdigit():
        index = int(want)
        if index >= len(items):
            raise UserError(f"OpenCL {what} {index} does not exist ({len(items)} found)")
        return items[index]
    for item in items:
        if want.lower() in item.name.lower():
            return item
    raise UserError(f"no OpenCL {what} matches {want!r}; found: {', '.join(i.name for i in items)}")


def _platforms(cl) -> list:
    try:
        return cl.get_platforms()
    except cl.Error:  # the ICD loader's "no platform" (PLATFORM_NOT_FOUND_KHR)
        return []


def _devices(cl, plat) -> list:
    try:
        return plat.get_devices()
    except cl.Error:
        return []


def choose_device(platform: str | None = None, device: str | None = None, *, binary: bool = False):
    """(platform, device) by option, environment variable, or the default rule: the first CPU
    device, or with a prebuilt ``binary`` the first accelerator, then the other of the two. A
    GPU only when named (UserError when it is all there is)."""
    cl = _cl()
    platforms = _platforms(cl)
    if not platforms:
        raise UserError(f"no OpenCL platform found; {INSTALL_HINT}")
    chosen_platform = _pick(platforms, platform or os.environ.get("L2L_CL_PLATFORM"), "platform")
    candidates = [(plat, dev) for plat in ([chosen_platform] if chosen_platform else platforms)
                  for dev in _devices(cl, plat)]
    if not candidates:
        raise UserError(f"no OpenCL device found; {INSTALL_HINT}")
    wanted = device or os.environ.get("L2L_CL_DEVICE")
    if wanted:
        dev = _pick([d for _, d in candidates], wanted, "device")
        return next((p, d) for p, d in candidates if d == dev)
    kinds = (cl.device_type.ACCELERATOR, cl.device_type.CPU) if binary else (cl.device_type.CPU, cl.device_type.ACCELERATOR)
    for kind in kinds:
        for plat, dev in candidates:
            if dev.type & kind:
                return plat, dev
    names = ", ".join(d.name.strip() for _, d in candidates)
    raise UserError(f"the OpenCL devices here are GPUs ({names}): the EPS runs on one only when named "
                    f"(--cl-device NAME), since it shares the GPU with the training; or use --eps numpy")


def cpu_device() -> tuple[tuple[int, int] | None, str]:
    """The first OpenCL CPU device as (platform index, device index within it), and its
    description; or None and why there is none. Never raises: ``--eps auto`` asks it."""
    try:
        cl = _cl()
    except UserError:
        return None, "pyopencl is not installed (pip install 'l2l[opencl]')"
    platforms = _platforms(cl)
    for pi, plat in enumerate(platforms):
        for di, dev in enumerate(_devices(cl, plat)):
            if dev.type & cl.device_type.CPU:
                return (pi, di), f"{dev.name.strip()} on {plat.name.strip()}"
    if not platforms:
        return None, f"no OpenCL platform ({INSTALL_HINT})"
    return None, f"no OpenCL CPU device ({INSTALL_HINT})"


def default_threads(dev) -> int | None:
    """The compute units the EPS takes of ``dev`` unless told: on a CPU device the cores this
    process may use (its affinity mask, not the machine's), at most the device's; elsewhere
    None (all of the device)."""
    if dev.type & _cl().device_type.CPU:
        return min(available_cpus(), dev.max_compute_units)
    return None


def _with_threads(cl, dev, threads: int | None):
    """``dev``, or with ``threads`` (by default :func:`default_threads`) fewer than its compute
    units a sub-device of that many (the EPS kept to its share of the cores); ``threads``
    applies to a CPU device only."""
    if threads is None:
        threads = default_threads(dev)
    if threads is None or threads == dev.max_compute_units:
        return dev
    if not dev.type & cl.device_type.CPU:
        raise UserError(f"--eps-threads applies to an OpenCL CPU device, not {dev.name.strip()}")
    if threads > dev.max_compute_units:
        raise UserError(f"--eps-threads {threads}: {dev.name.strip()} has {dev.max_compute_units} compute units")
    try:
        return dev.create_sub_devices([cl.device_partition_property.EQUALLY, threads])[0]
    except cl.Error as exc:
        raise UserError(f"--eps-threads {threads}: {dev.name.strip()} cannot be divided ({exc})") from None


class OpenCLBackend(EpsBackend):
    name = "opencl"
    optimizers = frozenset({"adamw", "lion", "lamb"})

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        try:
            plat, dev = choose_device()
        except UserError as exc:
            return False, str(exc)
        return True, f"{dev.name.strip()} on {plat.name.strip()}"

    def describe(self) -> str:
        return (f"{self.device.name.strip()} ({self.platform.name.strip()}), "
                f"{self.device.max_compute_units} compute unit{'s' if self.device.max_compute_units > 1 else ''}")

    @classmethod
    def shares_masters(cls, platform: str | None = None, device: str | None = None, binary: str | None = None,
                       **options) -> bool:
        """Where the device chosen is a CPU; a runtime that then fails the zero-copy probe
        (:meth:`_computes_in_host_memory`) is reported when the backend is built, and its
        copies counted by the server (``EagerParamServer.copy_bytes``). No OpenCL: no."""
        try:
            _, dev = choose_device(platform, device, binary=binary is not None)
        except UserError:
            return False
        return bool(dev.type & _cl().device_type.CPU)

    def __init__(self, platform: str | None = None, device: str | None = None,
                 binary: str | None = None, launch: str = "auto", min_chunk: int = MIN_CHUNK,
                 vector_width: int | None = None, threads: int | None = None) -> None:
        """``launch``: the work shape (``launch_shape``). "chunks": a work-item per long
        contiguous chunk of vectors, the shape for a CPU; "vectors": a work-item per vector,
        the shape for a GPU; "task": a single work-item that walks everything, the shape of
        an FPGA kernel; "auto": task for kernels compiled with a required work-group size of
        1 (HLS kernels in an .xclbin), else chunks on a CPU device and vectors on others.
        Every shape gives the same bits. ``min_chunk``: the fewest vectors a chunk takes
        (tests make it small to cut small layers into many chunks). ``vector_width``: the
        kernels' VW, 8 or 16; by default 16 where the device's preferred float vector is that
        wide (AVX-512 CPUs), else 8. The bits do not depend on it either. ``threads``: on a
        CPU device, the compute units (PoCL's threads) the kernels run on (default: all)."""
        if launch not in LAUNCHES:
            raise ValueError(f"launch must be one of {', '.join(LAUNCHES)}, not {launch!r}")
        if min_chunk < 1:
            raise ValueError(f"min_chunk must be at least 1, not {min_chunk}")
        if vector_width not in (None, *VECTOR_WIDTHS):
            raise ValueError(f"vector_width must be one of {VECTOR_WIDTHS}, not {vector_width}")
        self._min_chunk = min_chunk
        cl = self._cl = _cl()
        self.platform, self.device = choose_device(platform, device, binary=binary is not None)
        self.device = _with_threads(cl, self.device, threads)
        self.context = cl.Context([self.device])
        self.queue = cl.CommandQueue(self.context, self.device)
        self.streaming_stores = False  # whether the built program writes the copy with streaming stores
        self.vector_width = vector_width or (BINARY_VECTOR if binary else
                                             16 if self.device.preferred_vector_width_float >= 16 else 8)
        try:
            self.program = self._build(binary)
        except RuntimeError:
            if binary is not None or vector_width is not None or self.vector_width != 16:
                raise
            # a device that prefers float16 on an x86 target without AVX-512 (PoCL 3.0's generic
            # CPU target, where its LLVM does not know this CPU): eps.cl refuses VW=16 there
            self.vector_width = 8
            self.program = self._build(binary)
        self._kernels = {name: cl.Kernel(self.program, name) for name in self.program.kernel_names.split(";")}
        self._check_kernels(binary)
        cpu = bool(self.device.type & cl.device_type.CPU)
        self._shape = {name: launch if launch != "auto" else
                       "task" if self._is_task(kernel) else "chunks" if cpu else "vectors"
                       for name, kernel in self._kernels.items()}
        self._state: dict[int, tuple] = {}  # layer -> its (p, m, v) buffers
        self._host: dict[int, tuple[np.ndarray, ...]] = {}  # layer -> the host arrays they wrap (zero-copy)
        self._numel: dict[int, int] = {}
        self._moments: dict[int, int] = {}  # layer -> its optimizer's moments (no buffers when empty)
        self._scratch: dict[str, object] = {}
        self._last_args: dict[str, tuple] = {}
        self._host_buffers: dict[tuple[int, int, str], object] = {}
        self._segments: dict[int, tuple[np.ndarray, object]] = {}  # layer -> LAMB's seg bounds and their buffer
        # The layer's finite flag: 1 before every step, cleared by eps_check. It is reset at the
        # end of a step, so that the next one starts with its check, not with a write.
        self._flag = self._new_buffer(4, *self._home("finite"))
        self._flag_reset = np.ones(1, np.int32)  # never changed: the source of non-blocking resets
        cl.enqueue_copy(self.queue, self._flag, self._flag_reset, is_blocking=True)
        # On a CPU device the "device memory" is host memory: gradients, the device copy and
        # each layer's p, m, v are host arrays the kernels use in place (USE_HOST_PTR), once
        # the runtime is seen to do so (_computes_in_host_memory). Checkpoints then read the
        # state in place, the disk tier hands its own arrays in, and p serves as the fp32
        # device copy (master_as_copy): 12 bytes a parameter, as on the NumPy EPS.
        self._host_align = max(64, self.device.mem_base_addr_align // 8)  # the device's base alignment, in bytes
        self._zero_copy = cpu and self._computes_in_host_memory()
        if cpu and not self._zero_copy:
            warnings.warn(f"OpenCL: {self.device.name.strip()} was not seen computing in the host memory it "
                          f"is given (USE_HOST_PTR): the EPS keeps its state, gradients and copies in buffers "
                          f"of the runtime's own, and the masters do not serve as the copies "
                          f"(4 more bytes a parameter)", RuntimeWarning, stacklevel=2)

    # ------------------------------------------------------------ program
    def _build(self, binary: str | None):
        cl = self._cl
        if binary is None:
            options = BUILD_OPTIONS + [f"-DVW={self.vector_width}"]
            if self._streaming_stores_possible():
                try:  # the x86 streaming-store path (eps.cl); a runtime that cannot build it gets the plain one
                    program = cl.Program(self.context, kernel_source()).build(options=options + [NT_OPTION])
                    self.streaming_stores = True
                    return program
                except cl.RuntimeError:
                    pass
            program = cl.Program(self.context, kernel_source())
            try:
                return program.build(options=options)
            except cl.RuntimeError as exc:
                raise RuntimeError(f"building {KERNEL_SOURCE} failed:\n{exc}") from exc
        path = Path(binary)
        if not path.is_file():
            raise UserError(f"--cl-binary {binary}: no such file")
        self._probe_binary(path)
        try:
            program = cl.Program(self.context, [self.device], [path.read_bytes()])
            return program.build(options=BUILD_OPTIONS)
        except cl.Error as exc:
            raise UserError(f"--cl-binary {binary}: not a program for {self.device.name.strip()} ({exc})") from None

    def _streaming_stores_possible(self) -> bool:
        """Whether the kernels may use x86 streaming stores: the device is this x86 host's
        CPU with AVX (``L2L_CL_STREAMING=0`` turns them off, e.g. to measure them)."""
        if os.environ.get("L2L_CL_STREAMING", "1") == "0":
            return False
        if not self.device.type & self._cl.device_type.CPU or host_platform.machine() not in ("x86_64", "AMD64"):
            return False
        try:
            return " avx " in f" {Path('/proc/cpuinfo').read_text().replace(chr(10), ' ')} "
        except OSError:
            return False

    def _probe_binary(self, path: Path) -> None:
        """Load the binary in a child process first: some runtimes (PoCL) abort or
        segfault on a damaged binary instead of returning an error."""
        child = subprocess.run(
            [sys.executable, "-c", _PROBE, str(path), self.platform.name, self.device.name],
            capture_output=True, text=True, timeout=300)
        if child.returncode < 0:
            raise UserError(f"--cl-binary {path}: damaged (the OpenCL runtime crashed loading it, "
                            f"signal {-child.returncode})")

    def program_binary(self) -> bytes:
        """The built program's binary for this device (what ``--cl-binary`` loads)."""
        return self.program.get_info(self._cl.program_info.BINARIES)[0]

    # ------------------------------------------------------------ buffers
    # XRT places a buffer in a memory bank (an HBM pseudo-channel) when it is first set as a
    # kernel argument: the bank that argument's port is connected to (hls/u280.cfg). A buffer
    # written, filled, migrated or mapped before that lands in a default bank, which the
    # compute unit may not reach. So every buffer is made by _new_buffer, which sets it as its
    # kernel argument first; only then is anything enqueued on it.

    def _new_buffer(self, nbytes: int, owner: str | None, arg: str, hostbuf: np.ndarray | None = None):
        """A device buffer, set as argument ``arg`` of kernel ``owner`` before any use, so that
        XRT places it in that argument's bank. ``hostbuf``: host memory for it to wrap
        (USE_HOST_PTR, CPU devices) instead of memory of its own."""
        mf = self._cl.mem_flags
        if hostbuf is None:
            buf = self._cl.Buffer(self.context, mf.READ_WRITE, max(nbytes, 4))
        else:  # wraps memory already written: nothing is enqueued on it before _bind either
            buf = self._cl.Buffer(self.context, mf.READ_WRITE | mf.USE_HOST_PTR, hostbuf=hostbuf)
        self._bind(owner, arg, buf)
        return buf

    def _bind(self, owner: str | None, arg: str, buf) -> None:
        """Set ``buf`` as argument ``arg`` (an fpga/ARGS.md name) of kernel ``owner``; the first
        binding decides a buffer's bank on XRT. None: no kernel of this program takes it."""
        if owner is None:
            return
        index = BUFFER_ARGS[kernel_family(owner)][arg]
        self._kernel(owner).set_arg(index, buf)
        last = self._last_args.get(owner)
        if last is not None and index < len(last):  # what _launch believes is set must stay true
            self._last_args[owner] = (*last[:index], buf, *last[index + 1:])

    def _home(self, arg: str) -> tuple[str | None, str]:
        """(kernel, argument) that places a buffer made before the kernel using it is known: a
        layer's p, m, v and the finite flag. An eps_update kernel where the program has one (the
        kernel whose streams matter; also the RTL kernel, which has no eps_check), else a
        kernel of another family with that argument (eps_lion, LAMB's, eps_check, eps_copy).
        hls/u280.cfg keeps an argument in one bank across all kernels, so any of them places
        the buffer for every kernel using it."""
        for family in ("update", "lion", "lamb_norms", "lamb_step", "check", "copy"):
            if arg in BUFFER_ARGS[family]:
                names = sorted(n for n in self._kernels if kernel_family(n) == family)
                if names:
                    return names[0], arg
        return None, arg

    def _buffer(self, key: str, nbytes: int, owner: str, arg: str):
        """The scratch buffer ``key`` of at least ``nbytes``, made bound to ``owner``'s ``arg``.
        It serves every kernel with that argument later, in the bank the first one placed it."""
        buf = self._scratch.get(key)
        if buf is None or buf.size < nbytes:
            buf = self._scratch[key] = self._new_buffer(nbytes, owner, arg)
        return buf

    def _host_buffer(self, a: np.ndarray, owner: str, arg: str):
        """A buffer over host memory ``a`` without a copy (CPU devices), cached per array and
        argument (so memory freed and reused in another role gets a buffer bound to that role)."""
        key = (a.ctypes.data, a.nbytes, arg)
        buf = self._host_buffers.pop(key, None)
        if buf is None:
            buf = self._new_buffer(a.nbytes, owner, arg, hostbuf=a.view(np.uint8).reshape(-1))
        self._host_buffers[key] = buf  # most recent last
        while len(self._host_buffers) > 1024:  # the EPS's own long-lived inboxes and copies
            self._host_buffers.pop(next(iter(self._host_buffers)))
        return buf

    def _computes_in_host_memory(self) -> bool:
        """Whether kernels read and write a USE_HOST_PTR buffer's host memory itself, between
        maps: the host fills the inboxes and the relay reads the masters that way. The spec
        lets a runtime cache the memory instead, synced only at maps (a map then returns the
        host address all the same, so comparing addresses proves nothing); the EPS would train
        on stale gradients and weights. So eps_copy_f32 copies a host-written array into
        another, twice over: the second copy must see the second write, and the host both.
        The arrays start 4 bytes past the device's alignment, as the least aligned memory
        wrapped does (an inbox or a copy aligned only to its elements): a runtime that
        caches only such memory fails too."""
        if "eps_copy_f32" not in self._kernels:
            return False
        src, dst = (aligned_empty(PROBE_N + 1, np.float32, self._host_align)[1:] for _ in range(2))
        src[...], dst[...] = 1.0, 0.0
        bufs = [self._new_buffer(a.nbytes, "eps_copy_f32", arg, hostbuf=_bytes_view(a))
                for a, arg in ((src, "p"), (dst, "copy"))]
        for value in (1.0, 2.0):
            src[...] = value
            self._launch("eps_copy_f32", PROBE_N, *bufs, np.uint32(PROBE_N))
            self.queue.finish()
            if not (dst == value).all():
                return False
        return True

    def _wrap_state(self, layer: int, arrays: tuple[np.ndarray, ...]) -> None:
        """Make host arrays ``(p, *moments)`` the layer's state: each wrapped by a buffer bound to
        its argument (none for an empty layer: no zero-length buffer)."""
        n = arrays[0].shape[0]
        self._host[layer] = arrays
        self._state[layer] = tuple(self._new_buffer(a.nbytes, *self._home(arg), hostbuf=_bytes_view(a))
                                   for a, arg in zip(arrays if n else (), STATE_ARGS))
        self._numel[layer], self._moments[layer] = n, len(arrays) - 1

    def _kernel_array(self, a: np.ndarray) -> np.ndarray:
        """``a`` itself where the kernels may keep and update it (:func:`adoptable`, aligned
        as the device wants its buffers), else such a copy of it."""
        a = adoptable(a)
        if a.ctypes.data % self._host_align == 0:
            return a
        out = aligned_empty(a.shape[0], np.float32, self._host_align)
        out[...] = a
        return out

    def _check_kernels(self, binary: str | None) -> None:
        """A program, above all a vendor-built binary, must expose the EPS kernels with
        the argument counts of fpga/ARGS.md; say which one is wrong before training."""
        where = f"--cl-binary {binary}" if binary else str(KERNEL_SOURCE)
        found = False
        for name, kernel in self._kernels.items():
            family = kernel_family(name)
            if family not in KERNEL_ARGS:
                continue
            found = True
            nargs = kernel.get_info(self._cl.kernel_info.NUM_ARGS)
            if nargs != KERNEL_ARGS[family]:
                raise UserError(f"{where}: kernel {name} takes {nargs} arguments, expected "
                                f"{KERNEL_ARGS[family]} (fpga/ARGS.md)")
        if not found:
            raise UserError(f"{where}: no EPS kernels (eps_check_*, eps_update_*, eps_lion_*, eps_lamb_norms_*, "
                            f"eps_lamb_step_*, eps_copy_*) in the program")

    def _kernel(self, name: str):
        try:
            return self._kernels[name]
        except KeyError:
            raise UserError(f"the OpenCL program has no kernel {name}; rebuild the binary with it "
                            f"(hls/Makefile KERNELS=...)") from None

    def _is_task(self, kernel) -> bool:
        info = self._cl.kernel_work_group_info.COMPILE_WORK_GROUP_SIZE
        return tuple(kernel.get_work_group_info(info, self.device)) == (1, 1, 1)

    def _launch(self, name: str, n: int, *args, k: int = 1, segments: int | None = None):
        """Run ``name`` over ``n`` elements as a task or an NDRange (``launch_shape``). Only the
        arguments that changed since its last launch are set: PoCL takes about 5 us per scalar
        argument, most of a small layer's step, and the hyperparameters rarely change."""
        kernel = self._kernel(name)
        last = self._last_args.pop(name, ())
        for i, arg in enumerate(args):
            if i >= len(last) or not _same_arg(arg, last[i]):
                kernel.set_arg(i, arg)
        self._last_args[name] = args  # only once every argument is set
        global_size, local_size = self.launch_shape(name, n, k, segments)
        return self._cl.enqueue_nd_range_kernel(self.queue, kernel, (global_size,), (local_size,))

    def launch_shape(self, name: str, n: int, k: int = 1, segments: int | None = None) -> tuple[int, int]:
        """(global, local) work size of kernel ``name`` over ``n`` elements and ``k`` gradient
        contributions (and, for LAMB's norm pass, ``segments`` segments: a work-item owns
        whole ones, so on a CPU no more work-items than segments). The kernels cut their
        vectors into chunks by the global size, so any shape gives the same bits."""
        shape = self._shape[name]
        if shape == "task":  # one work-item walks every vector
            return 1, 1
        vectors = n // self.vector_width // regions(name, k)
        if shape == "chunks":
            items = min(CHUNKS_PER_CU * self.device.max_compute_units, vectors // self._min_chunk)
            return max(1, items if segments is None else min(items, segments)), 1
        group = min(WORK_GROUP, self.device.max_work_group_size)
        return -(-(vectors + 1) // group) * group, group

    def _gradients_in(self, grads, owner: str) -> tuple[object, int]:
        """The K contributions as one device buffer, back to back; (buffer, k). A new
        buffer is bound to ``owner``'s (the update kernel's) ``gr``: eps_check reads it too,
        and its ``g`` sits in the same bank (hls/u280.cfg)."""
        cl = self._cl
        block = grads if isinstance(grads, np.ndarray) and grads.ndim == 2 else None  # checked by check_step
        k = len(grads)
        dtype = grads[0].dtype
        if block is not None and block.flags.c_contiguous and block.flags.aligned and self._zero_copy:
            return self._host_buffer(block, owner, "gr"), k
        n = grads[0].shape[0]
        buf = self._buffer(f"g_in.{dtype.itemsize}", k * n * dtype.itemsize, owner, "gr")
        for c, g in enumerate(grads):
            cl.enqueue_copy(self.queue, buf, np.ascontiguousarray(g).view(np.uint8),
                            dst_offset=c * n * dtype.itemsize, is_blocking=False)
        return buf, k

    # ------------------------------------------------------------ EpsBackend
    def allocate(self, layer: int, p: np.ndarray, moments: int = 2) -> None:
        cl = self._cl
        p = np.ascontiguousarray(p, dtype=np.float32)
        n = p.shape[0]
        if self._zero_copy:  # p copied, zero moments: host arrays the kernels work in
            arrays = tuple(aligned_empty(n, np.float32, self._host_align) for _ in range(1 + moments))
            arrays[0][...] = p
            for a in arrays[1:]:
                a[...] = 0.0
            self._wrap_state(layer, arrays)
            return
        bufs = tuple(self._new_buffer(4 * n, *self._home(arg)) for arg in STATE_ARGS[:1 + moments])
        if n:
            cl.enqueue_copy(self.queue, bufs[0], p)
            zeros = np.zeros(n, np.float32)
            for buf in bufs[1:]:
                cl.enqueue_copy(self.queue, buf, zeros)
        self.queue.finish()
        self._state[layer] = bufs
        self._numel[layer], self._moments[layer] = n, moments

    def adopt(self, layer: int, p: np.ndarray, *moments: np.ndarray) -> None:
        """On a CPU device the arrays themselves where the kernels may work in them
        (:meth:`_kernel_array`): no copy. Elsewhere new buffers filled from them at once
        (allocate and write_state would write the moments twice)."""
        if self._zero_copy:
            arrays = [self._kernel_array(a) for a in (p, *moments)]
        else:
            arrays = [np.ascontiguousarray(a, dtype=np.float32).reshape(-1) for a in (p, *moments)]
        n = arrays[0].shape[0]
        if any(a.shape != (n,) for a in arrays):
            raise ValueError(f"layer {layer}: state of shapes {[a.shape for a in arrays]}")
        if self._zero_copy:
            self._wrap_state(layer, tuple(arrays))
            return
        bufs = tuple(self._new_buffer(4 * n, *self._home(arg)) for arg in STATE_ARGS[:len(arrays)])
        for host, dev in zip(arrays, bufs if n else ()):
            self._cl.enqueue_copy(self.queue, dev, host, is_blocking=False)
        self.queue.finish()  # the host arrays may go once this returns
        self._state[layer] = bufs
        self._numel[layer], self._moments[layer] = n, len(arrays) - 1

    def master_as_copy(self, layer: int) -> np.ndarray | None:
        """The host array ``p`` on a CPU device: the update kernel then gets its buffer as the
        copy too (the same buffer: two USE_HOST_PTR buffers over one memory are undefined)."""
        return self._host[layer][0] if self._zero_copy else None

    def _is_master(self, layer: int, copy_out: np.ndarray) -> bool:
        """Whether ``copy_out`` is the layer's host ``p`` itself (:meth:`master_as_copy`)."""
        return layer in self._host and copy_out is self._host[layer][0]

    def release(self, layer: int) -> None:
        self.queue.finish()
        self._state.pop(layer, None)
        self._host.pop(layer, None)
        self._numel.pop(layer, None)
        self._moments.pop(layer, None)
        self._segments.pop(layer, None)

    def step(self, layer: int, grads: Sequence[np.ndarray], scalars: StepScalars | LionScalars | LambStep,
             copy_out: np.ndarray, n_decay: int | None = None) -> bool:
        """``eps_check_<g>``, then the update kernel of the scalars' optimizer: ``eps_update_<g>_<c>``
        (AdamW, state ``p, m, v``) or ``eps_lion_<g>_<c>`` (Lion, state ``p, m``), with its
        arguments in fpga/ARGS.md's order: the buffers, ``n, k, n_decay``, the scalars in their
        field order. LAMB (a :class:`LambStep`): :meth:`_lamb`'s two kernels."""
        cl = self._cl
        n = self._numel[layer]
        check_step(grads, copy_out, n, n_decay)  # before anything is enqueued: a refused step writes nothing
        check_optimizer(self, scalars, self._moments[layer])
        if n == 0:
            return True
        g, c = _SUFFIX[np.dtype(grads[0].dtype)], _SUFFIX[copy_out.dtype]
        if isinstance(scalars, LambStep):
            return self._lamb(layer, grads, scalars, copy_out, g, c, n if n_decay is None else n_decay,
                              lamb_bounds(scalars, n))
        update = f"eps_{UPDATE_FAMILY[optimizer_of(scalars).name]}_{g}_{c}"
        self._kernel(update)  # a program without it (a binary built before Lion) says so before any work
        gbuf, k = self._gradients_in(grads, update)
        state = self._state[layer]
        target = (state[0], True) if self._is_master(layer, copy_out) else self._copy_target(copy_out, update)
        flag = np.zeros(1, np.int32)
        try:
            self._launch(f"eps_check_{g}", n, gbuf, self._flag, np.uint32(n), np.uint32(k), scalars.inv_scale, k=k)
            self._launch(update, n, gbuf, *state, target[0], self._flag, np.uint32(n), np.uint32(k),
                         np.uint32(n if n_decay is None else n_decay), *_scalars(scalars))
            if target[1]:  # the copy is copy_out's own memory: a map (and unmap) hands it to the host
                self._map(target[0], copy_out.nbytes).base.release()
            read = cl.enqueue_copy(self.queue, flag, self._flag, is_blocking=False)
        finally:
            cl.enqueue_copy(self.queue, self._flag, self._flag_reset, is_blocking=False)
        read.wait()  # everything above is enqueued while the kernels run; this is the step's one wait
        if flag[0] and not target[1]:
            self._copy_back(target, copy_out)
        return bool(flag[0])

    def _lamb(self, layer: int, grads, step: LambStep, copy_out: np.ndarray, g: str, c: str, n_decay: int,
              seg: np.ndarray) -> bool:
        """LAMB: ``eps_check_<g>``; ``eps_lamb_norms_<g>`` (m', v' and each segment's sums); a
        wait for the flag and the sums; when finite, the host's fold ``step.steps(sums)``,
        then ``eps_lamb_step_<c>`` (p' and the copy). ``seg``: the segments' bounds, checked."""
        cl = self._cl
        n, nseg = self._numel[layer], seg.shape[0] - 1
        norms, apply = f"eps_lamb_norms_{g}", f"eps_lamb_step_{c}"
        self._kernel(norms)  # a program without them (a binary built before LAMB) says so before any work
        self._kernel(apply)
        gbuf, k = self._gradients_in(grads, norms)
        state = self._state[layer]
        target = (state[0], True) if self._is_master(layer, copy_out) else self._copy_target(copy_out, apply)
        seg_dev = self._segment_buffer(layer, seg, norms)
        sums_dev = self._buffer("lamb.sums", nseg * 2 * LANES * 4, norms, "sums")
        steps_dev = self._buffer("lamb.steps", nseg * 4, apply, "steps")
        scalars = _scalars(step.scalars)
        flag = np.zeros(1, np.int32)
        sums = np.empty((nseg, 2, LANES), np.float32)
        steps = None
        try:
            self._launch(f"eps_check_{g}", n, gbuf, self._flag, np.uint32(n), np.uint32(k), step.inv_scale, k=k)
            self._launch(norms, n, gbuf, *state, seg_dev, sums_dev, self._flag, np.uint32(n), np.uint32(k),
                         np.uint32(n_decay), np.uint32(nseg), *scalars, segments=nseg)
            cl.enqueue_copy(self.queue, flag, self._flag, is_blocking=False)
            cl.enqueue_copy(self.queue, sums, sums_dev, is_blocking=True)  # the step's first wait
            if flag[0]:  # else nothing was written: no fold, no second pass
                steps = np.ascontiguousarray(step.steps(sums), dtype=np.float32)
                if steps.shape != (nseg,):
                    raise RuntimeError(f"LAMB step sizes of shape {steps.shape}, expected ({nseg},)")
                cl.enqueue_copy(self.queue, steps_dev, steps, is_blocking=False)  # steps lives past the wait below
                self._launch(apply, n, *state, target[0], seg_dev, steps_dev, self._flag, np.uint32(n),
                             np.uint32(n_decay), np.uint32(nseg), *scalars)
                if target[1]:  # the copy is copy_out's own memory: a map (and unmap) hands it to the host
                    self._map(target[0], copy_out.nbytes).base.release()
        finally:
            reset = cl.enqueue_copy(self.queue, self._flag, self._flag_reset, is_blocking=False)
        reset.wait()  # the step's second wait
        if flag[0] and not target[1]:
            self._copy_back(target, copy_out)
        return bool(flag[0])

    def _segment_buffer(self, layer: int, seg: np.ndarray, owner: str):
        """The device buffer of the layer's segment bounds (both LAMB kernels' ``seg``), made
        bound to ``owner``'s and written once per layer, again only when the bounds change."""
        cached = self._segments.get(layer)
        if cached is not None and np.array_equal(cached[0], seg):
            return cached[1]
        buf = self._new_buffer(seg.nbytes, owner, "seg")
        self._cl.enqueue_copy(self.queue, buf, seg, is_blocking=False)  # seg is kept with it: alive until copied
        self._segments[layer] = (seg, buf)
        return buf

    def write_copy(self, layer: int, copy_out: np.ndarray) -> None:
        n = self._numel[layer]
        check_copy(copy_out, n)
        if n == 0 or self._is_master(layer, copy_out):  # the master serving as its own copy is already written
            return
        name = f"eps_copy_{_SUFFIX[copy_out.dtype]}"
        target = self._copy_target(copy_out, name)
        self._launch(name, n, self._state[layer][0], target[0], np.uint32(n))
        self._copy_back(target, copy_out)

    def _copy_target(self, copy_out: np.ndarray, owner: str):
        """(device buffer kernel ``owner`` writes the copy into, whether it wraps ``copy_out``
        itself). Wrapped only when its elements are aligned to their size (a kernel pointer
        must be). A new buffer is bound to ``owner``'s ``copy``; eps_update and eps_copy keep
        it in one bank (hls/u280.cfg)."""
        if self._zero_copy and copy_out.flags.c_contiguous and copy_out.flags.aligned:
            return self._host_buffer(copy_out, owner, "copy"), True
        return self._buffer(f"copy.{copy_out.dtype.itemsize}", copy_out.nbytes, owner, "copy"), False

    def _map(self, buf, nbytes: int):
        """Enqueue a map of a USE_HOST_PTR buffer for reading (the spec's way to hand it back
        to the host); the mapping is valid once the queue has reached it."""
        mapped, _ = self._cl.enqueue_map_buffer(self.queue, buf, self._cl.map_flags.READ, 0,
                                                (nbytes,), np.uint8, is_blocking=False)
        return mapped

    def _copy_back(self, target, copy_out: np.ndarray) -> None:
        """Make the device copy visible in ``copy_out``; waits for the queue."""
        copy_dev, wrapped = target
        if wrapped:
            mapped = self._map(copy_dev, copy_out.nbytes)
            self.queue.finish()
            mapped.base.release()
            return
        dense = copy_out if copy_out.flags.c_contiguous and copy_out.flags.aligned else np.empty_like(copy_out, order="C")
        self._cl.enqueue_copy(self.queue, _bytes_view(dense), copy_dev, is_blocking=True)
        if dense is not copy_out:  # e.g. a strided view
            copy_out[...] = dense

    def read_state(self, layer: int):
        return self._read(layer, 1 + self._moments[layer])

    def read_master(self, layer: int) -> np.ndarray:
        return self._read(layer, 1)[0]

    def _read(self, layer: int, regions: int) -> tuple[np.ndarray, ...]:
        """Host copies of the first ``regions`` of the layer's ``(p, *moments)``."""
        if layer in self._host:
            self.queue.finish()
            return tuple(a.copy() for a in self._host[layer][:regions])
        n = self._numel[layer]
        out = tuple(np.empty(n, np.float32) for _ in range(regions))
        for host, dev in zip(out, self._state[layer] if n else ()):
            self._cl.enqueue_copy(self.queue, host, dev, is_blocking=False)
        self.queue.finish()
        return out

    def write_state(self, layer: int, p: np.ndarray, *moments: np.ndarray) -> None:
        n = self._numel[layer]
        arrays = [np.ascontiguousarray(a, dtype=np.float32) for a in (p, *moments)]
        check_state(layer, arrays, n, self._moments[layer])
        if layer in self._host:
            self.queue.finish()
            for dst, src in zip(self._host[layer], arrays):
                dst[...] = src
            return
        for host, dev in zip(arrays, self._state[layer] if n else ()):
            self._cl.enqueue_copy(self.queue, dev, host, is_blocking=False)
        self.queue.finish()

    def state_view(self, layer: int):
        """The host arrays themselves, read-only, on a CPU device (after the queue's work)."""
        if layer not in self._host:
            return super().state_view(layer)
        self.queue.finish()
        return tuple(read_only(a) for a in self._host[layer])

    def close(self) -> None:
        self.queue.finish()


def _scalars(scalars) -> tuple:
    """The step scalars in their field order (the kernels' argument order); not ``as_tuple``,
    whose deep copy takes several microseconds a step."""
    names = _SCALAR_NAMES.get(type(scalars)) or scalars.names()
    return tuple(getattr(scalars, name) for name in names)


def _same_arg(a, b) -> bool:
    """Whether kernel argument ``a`` is what ``b`` set: the same buffer object, or a scalar of
    the same dtype and bits (so -0.0 and NaN payloads count, as the kernels see them)."""
    if a is b:
        return True
    if isinstance(a, np.generic) and isinstance(b, np.generic):
        return a.dtype == b.dtype and a.tobytes() == b.tobytes()
    return False


def _bytes_view(a: np.ndarray) -> np.ndarray:
    """A uint8 view, so pyopencl copies bfloat16 (an ml_dtypes type it does not know) as bytes."""
    return a.view(np.uint8)
