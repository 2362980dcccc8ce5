"""Every OpenCL buffer is set as a kernel argument before anything is enqueued on it.

XRT places a buffer in a memory bank when the buffer is first set as a kernel
argument; a buffer written, filled, migrated or mapped before that lands in a
default bank that the compute unit may not reach (docs/fpga.md, "Bank
placement"). PoCL has no banks, so this test checks the order instead: it hands
the backend a logging stand-in for the pyopencl module, drives it as training
does (layers, K = 1 and 2 contributions, fp32 and 16-bit gradients and copies,
every launch shape, through the backend and through the EagerParamServer), and
fails on any command enqueued on a buffer that no kernel argument has held yet.
It also checks that each buffer only ever serves one argument role (one bank in
hls/u280.cfg), and that the log saw every kernel and every buffer, so it cannot
pass on a run that made none.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from l2l.eps import OptimizerHyper, EagerParamServer, LionScalars, NumpyBackend, OpenCLBackend, StepScalars
from l2l.eps import opencl_backend
from l2l.eps.contract import LambScalars
from l2l.eps.numerics import COPY_DTYPES, GRAD_DTYPES, as_step

from eps_twin import DTYPES, assert_same  # tests/ is on sys.path under pytest
from test_kernel_interface import _params

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

# The role of each buffer argument, by kernel family and index (fpga/ARGS.md): a role has
# one bank in hls/u280.cfg. eps_check's g and eps_update's (and eps_lion's, eps_lamb_norms')
# gr are one role, the gradients. LAMB's seg, sums and steps are roles of their own.
ROLES = {"check": ("grads", "finite"),
         "update": ("grads", "p", "m", "v", "copy", "finite"),
         "lion": ("grads", "p", "m", "copy", "finite"),
         "lamb_norms": ("grads", "p", "m", "v", "seg", "sums", "finite"),
         "lamb_step": ("p", "m", "v", "copy", "seg", "steps", "finite"),
         "copy": ("p", "copy")}
ALL_ROLES = {"grads", "p", "m", "v", "copy", "finite", "seg", "sums", "steps"}
ALL_KERNELS = ({f"eps_check_{g}" for g in ("f32", "bf16", "f16")}
               | {f"eps_update_{g}_{c}" for g, c in itertools.product(("f32", "bf16", "f16"), repeat=2)}
               | {f"eps_lion_{g}_{c}" for g, c in itertools.product(("f32", "bf16", "f16"), repeat=2)}
               | {f"eps_lamb_norms_{g}" for g in ("f32", "bf16", "f16")}
               | {f"eps_lamb_step_{c}" for c in ("f32", "bf16", "f16")}
               | {f"eps_copy_{c}" for c in ("f32", "bf16", "f16")})


class LoggedKernel:
    """A pyopencl kernel whose argument settings go to the log; everything else passes through."""

    def __init__(self, log: CallLog, kernel, name: str) -> None:
        self._log, self._kernel, self.name = log, kernel, name

    def set_arg(self, index: int, arg) -> None:
        self._log.bound(self.name, index, arg)
        self._kernel.set_arg(index, arg)

    def set_args(self, *args) -> None:
        for index, arg in enumerate(args):
            self._log.bound(self.name, index, arg)
        self._kernel.set_args(*args)

    def __call__(self, *args, **kw):
        raise AssertionError("kernel launched by __call__, which this log does not follow")

    def __getattr__(self, name):
        return getattr(self._kernel, name)


class CallLog:
    """pyopencl as the backend sees it: buffers made, kernel arguments set and commands
    enqueued are logged; any other enqueue_* is refused, so a new kind of write cannot slip
    past the log. A command on a buffer no kernel argument has held is a fault."""

    def __init__(self, cl) -> None:
        self._cl = cl
        self.buffers: list = []  # every buffer made, in order (kept alive, so ids stay unique)
        self.index: dict[int, int] = {}  # id(buffer) -> its place in self.buffers
        self.host_ptr: set[int] = set()  # ids of buffers over host memory (USE_HOST_PTR)
        self.roles: dict[int, set[str]] = {}  # id(buffer) -> roles of the arguments it was set as
        self.used: set[int] = set()  # ids of buffers a command or a launch used
        self.launched: set[str] = set()
        self.faults: list[str] = []

    def __getattr__(self, name):
        if name.startswith("enqueue_"):
            raise AssertionError(f"the backend calls pyopencl.{name}, which this log does not follow")
        return getattr(self._cl, name)

    # ------------------------------------------------ made and bound
    def Buffer(self, context, flags, *args, **kw):
        buf = self._cl.Buffer(context, flags, *args, **kw)
        self.index[id(buf)] = len(self.buffers)
        self.buffers.append(buf)
        if flags & self._cl.mem_flags.USE_HOST_PTR:
            self.host_ptr.add(id(buf))
        return buf

    def Kernel(self, program, name: str):
        return LoggedKernel(self, self._cl.Kernel(program, name), name)

    def bound(self, kernel: str, index: int, arg) -> None:
        if id(arg) in self.index:
            self.roles.setdefault(id(arg), set()).add(ROLES[opencl_backend.kernel_family(kernel)][index])

    # ------------------------------------------------ enqueued
    def _touch(self, call: str, *objects) -> None:
        for obj in objects:
            if id(obj) not in self.index:
                continue  # a host array
            self.used.add(id(obj))
            if id(obj) not in self.roles:
                self.faults.append(f"{call} on buffer #{self.index[id(obj)]} before any kernel argument held it")

    def enqueue_copy(self, queue, dest, src, **kw):
        self._touch("enqueue_copy", dest, src)
        return self._cl.enqueue_copy(queue, dest, src, **kw)

    def enqueue_fill_buffer(self, queue, mem, *args, **kw):
        self._touch("enqueue_fill_buffer", mem)
        return self._cl.enqueue_fill_buffer(queue, mem, *args, **kw)

    def enqueue_migrate_mem_objects(self, queue, mem_objects, *args, **kw):
        self._touch("enqueue_migrate_mem_objects", *mem_objects)
        return self._cl.enqueue_migrate_mem_objects(queue, mem_objects, *args, **kw)

    def enqueue_map_buffer(self, queue, buf, *args, **kw):
        self._touch("enqueue_map_buffer", buf)
        return self._cl.enqueue_map_buffer(queue, buf, *args, **kw)

    def enqueue_nd_range_kernel(self, queue, kernel, *args, **kw):
        assert isinstance(kernel, LoggedKernel), "a kernel the log did not make"
        self.launched.add(kernel.name)
        return self._cl.enqueue_nd_range_kernel(queue, kernel._kernel, *args, **kw)

    def mark_launch_args(self, *buffers) -> None:
        """Buffers a launch used (set through set_arg, so bound by definition)."""
        self.used.update(id(b) for b in buffers if id(b) in self.index)


@pytest.fixture
def log(monkeypatch):
    """The backend's pyopencl replaced by a CallLog over the real one."""
    logged = CallLog(opencl_backend._cl())
    monkeypatch.setattr(opencl_backend, "_cl", lambda: logged)
    real_launch = OpenCLBackend._launch

    def launch(self, name, n, *args, **kw):
        logged.mark_launch_args(*args)
        return real_launch(self, name, n, *args, **kw)

    monkeypatch.setattr(OpenCLBackend, "_launch", launch)
    return logged


def _copy_out(n: int, cdtype: str, strided: bool) -> np.ndarray:
    """A device copy: contiguous (a CPU device wraps it) or a strided view (it goes through a
    device buffer and a read)."""
    dtype = COPY_DTYPES[cdtype]
    return np.empty(2 * n, dtype)[::2] if strided else np.empty(n, dtype)


def _drive_backend(be, ref, rng) -> None:
    """Two AdamW layers, two Lion layers and two LAMB layers (of several tensors) through every
    gradient and copy dtype, K = 1 and 2, gradients as one block and as separate arrays, copies
    contiguous and strided; then a checkpoint's round trip. ``ref`` (the NumPy golden model)
    takes the same calls: the bits must not change."""
    sizes = {0: 3001, 1: 40, 2: 2003, 3: 24, 4: 3001, 5: 40}
    lion = {2, 3}
    lamb = {4: [0, 17, 1000], 5: [0, 5]}  # the LAMB layers' tensor starts
    for layer, n in sizes.items():
        p = rng.standard_normal(n).astype(np.float32)
        be.allocate(layer, p, 1 if layer in lion else 2)
        ref.allocate(layer, p, 1 if layer in lion else 2)
    for cdtype, strided in itertools.product(DTYPES, (False, True)):
        for layer, n in sizes.items():
            a, b = _copy_out(n, cdtype, strided), _copy_out(n, cdtype, strided)
            be.write_copy(layer, a)
            ref.write_copy(layer, b)
            assert_same(a, b, f"write_copy {cdtype} strided={strided}")
    t = 0
    for gdtype, cdtype, k in itertools.product(DTYPES, DTYPES, (1, 2)):
        for separate in (False, True):  # (K, n) block as the server's inbox, or K arrays
            t += 1
            adamw = StepScalars.compute(OptimizerHyper(), t, divisor=float(k))
            lion_s = LionScalars.compute(OptimizerHyper(optimizer="lion"), t, divisor=float(k))
            lamb_s = LambScalars.compute(OptimizerHyper(optimizer="lamb"), t, divisor=float(k))
            for layer, n in sizes.items():
                block = (rng.standard_normal((k, n)) * 1e-2).astype(GRAD_DTYPES[gdtype])
                grads = list(block) if separate else block
                a, b = _copy_out(n, cdtype, separate), _copy_out(n, cdtype, separate)
                s = lion_s if layer in lion else as_step(lamb_s, n, None, lamb[layer]) if layer in lamb else adamw
                assert be.step(layer, grads, s, a) and ref.step(layer, grads, s, b)
                assert_same(a, b, f"step {t}: {gdtype} -> {cdtype}, K={k}, separate={separate}")
    for layer in sizes:
        state = be.read_state(layer)
        assert len(state) == (2 if layer in lion else 3)
        for what, x, y in zip("pmv", state, ref.read_state(layer)):
            assert_same(x, y, f"layer {layer} {what}")
        be.write_state(layer, *state)


def _drive_server(be, grad_dtype: str, copy_dtype: str, contributors: int, rng) -> None:
    """The EagerParamServer's own traffic: layers added, inboxes pushed, copies fetched, a
    checkpoint taken and loaded. Closes ``be`` (the server closes its backend)."""
    kw = {"grad_dtype": grad_dtype, "copy_dtype": copy_dtype, "contributors": contributors}
    ref = EagerParamServer(NumpyBackend(), OptimizerHyper(), **kw)
    got = EagerParamServer(be, OptimizerHyper(), **kw)
    sizes = {10: 1000, 11: 24}
    try:
        for layer, n in sizes.items():
            p = rng.standard_normal(n).astype(np.float32)
            ref.add_layer(layer, p)
            got.add_layer(layer, p)
        for step in range(3):
            if step == 2:
                tensors, meta = got.state_tensors(), got.state_meta()
                ref.load_state(tensors, meta)
                got.load_state(tensors, meta)
            for layer, n in sizes.items():
                for c in range(contributors):
                    g = (rng.standard_normal(n) * 1e-2).astype(GRAD_DTYPES[grad_dtype])
                    for srv in (ref, got):
                        srv.gradient_inbox(layer, c)[:] = g
                        srv.push_gradient(layer, c, divisor=float(contributors))
            for layer in sizes:
                assert_same(got.fetch(layer), ref.fetch(layer), f"server step {step} layer {layer}")
    finally:
        ref.close()
        got.close()


SERVER_CASES = {"task": ("fp32", "fp32", 1), "chunks": ("bf16", "fp16", 2), "vectors": ("fp16", "bf16", 2)}


@pytest.mark.parametrize("zero_copy", [True, False], ids=["cpu-zero-copy", "card-copies"])
@pytest.mark.parametrize("launch", ["task", "chunks", "vectors"])
def test_every_buffer_is_a_kernel_argument_before_its_first_command(log, launch, zero_copy):
    """``card-copies`` turns off the CPU device's zero-copy path, so gradients go in and copies
    come out through device buffers and copies, as on a card; ``cpu-zero-copy`` wraps the
    host's arrays (USE_HOST_PTR) instead, as PoCL does. (The zero-copy probe, run when the
    backend is built, wraps two small arrays either way.)"""
    rng = np.random.default_rng(1717)
    be = OpenCLBackend(launch=launch, min_chunk=4)
    probe = set(log.host_ptr)
    be._zero_copy = zero_copy
    _drive_backend(be, NumpyBackend(), rng)
    _drive_server(be, *SERVER_CASES[launch], rng)

    assert log.faults == [], "\n".join(log.faults[:20])
    made = set(log.index)
    assert len(made) >= 10 and made == log.used, "every buffer made was used"
    unbound = made - set(log.roles)
    assert not unbound, f"buffers never set as a kernel argument: {sorted(log.index[i] for i in unbound)}"
    mixed = {log.index[i]: sorted(r) for i, r in log.roles.items() if len(r) > 1}
    assert not mixed, f"buffers serving arguments of different roles (banks): {mixed}"
    assert set().union(*log.roles.values()) == ALL_ROLES
    assert log.launched == ALL_KERNELS == set(be._kernels)
    assert bool(log.host_ptr - probe) is zero_copy  # the USE_HOST_PTR buffers were in the log too


def test_the_log_catches_a_write_before_binding(log):
    """The log itself: a buffer written before any kernel argument held it is a fault."""
    be = OpenCLBackend()
    before = len(log.faults)
    stray = be._cl.Buffer(be.context, be._cl.mem_flags.READ_WRITE, 64)
    be._cl.enqueue_copy(be.queue, stray, np.zeros(16, np.float32), is_blocking=True)
    assert log.faults[before:] == [f"enqueue_copy on buffer #{log.index[id(stray)]} before any kernel argument held it"]
    with pytest.raises(AssertionError, match="does not follow"):
        be._cl.enqueue_write_buffer


def test_binding_a_new_buffer_keeps_the_launch_cache_true():
    """A launch sets only the arguments that changed since the kernel's last launch. Binding
    a new layer's p, m, v (or the flag) to an eps_update kernel changes that kernel's arguments
    between its launches: the layer stepped before must still get its own p, m, v after."""
    rng = np.random.default_rng(2323)
    be, ref = OpenCLBackend(), NumpyBackend()
    n = 1000
    p = rng.standard_normal(n).astype(np.float32)
    be.allocate(0, p)
    ref.allocate(0, p)
    new_layers = itertools.count(1)
    for t, (gdtype, cdtype) in enumerate(itertools.product(DTYPES, DTYPES), start=1):
        for _ in range(2):  # the second step after another layer was allocated
            g = (rng.standard_normal((1, n)) * 1e-2).astype(GRAD_DTYPES[gdtype])
            s = StepScalars.compute(OptimizerHyper(), t)
            a, b = np.empty(n, COPY_DTYPES[cdtype]), np.empty(n, COPY_DTYPES[cdtype])
            assert be.step(0, g, s, a) and ref.step(0, g, s, b)
            assert_same(a, b, f"{gdtype} -> {cdtype}")
            be.allocate(next(new_layers), rng.standard_normal(n).astype(np.float32))
    for what, x, y in zip("pmv", be.read_state(0), ref.read_state(0)):
        assert_same(x, y, what)


def test_bound_arguments_are_the_kernels_own():
    """The backend binds a buffer by argument name (BUFFER_ARGS): each name sits at that place
    in the kernel source (and so in fpga/ARGS.md, which test_kernel_interface holds it to),
    and no buffer argument is left out (buffers come first, then n)."""
    source = opencl_backend.kernel_source()
    for family, args in opencl_backend.BUFFER_ARGS.items():
        params = _params(source, f"eps_{family}")
        assert {name: params.index(name) for name in args} == args, family
        assert params[:len(args)] == list(args) and params[len(args)] == "n", family
