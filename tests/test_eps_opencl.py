"""What only the OpenCL EPS has: its program binary (``--cl-binary``), its work split, its
launches.

The bit-exact comparison of fpga/opencl/eps.cl on PoCL with the NumPy golden
model (every vector class of docs/eps-numerics.md, sizes around the
work-group of float8 work-items, the EagerParamServer) is the shared suite of
tests/test_eps_backends_bitexact.py, which runs the same bodies for every
backend. Here: a program loaded from ``program_binary()`` (what ``--cl-binary``
does with an FPGA build) gives the same bits, and a bad binary file is one line
of UserError, not a crash.
"""
from __future__ import annotations

import itertools
import re

import numpy as np
import pytest

from l2l.eps import OptimizerHyper, NumpyBackend, OpenCLBackend, StepScalars
from l2l.eps.numerics import COPY_DTYPES
from l2l.errors import UserError

from eps_oracle import (  # tests/ is on sys.path under pytest
    NAN_BITS,
    SPECIAL_SCALARS,
    f32_from_bits,
    specials,
    wide_grad_bits,
)

from eps_twin import DTYPES, Twin, assert_same, grads_of, wide_state

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")


# --------------------------------------------------------------------------
# the program binary (--cl-binary)
# --------------------------------------------------------------------------


def test_program_binary_round_trip(tmp_path):
    """program_binary() written to a file and loaded with binary=: the same kernels, the same bits."""
    path = tmp_path / "eps.bin"
    built = OpenCLBackend()
    path.write_bytes(built.program_binary())
    built.close()
    loaded = OpenCLBackend(binary=str(path))
    try:
        assert sorted(loaded.program.kernel_names.split(";")) == sorted(built.program.kernel_names.split(";"))
        rng = np.random.default_rng(717)
        for (gdtype, cdtype), K, n in zip(itertools.product(DTYPES, DTYPES), itertools.cycle([1, 2, 4]),
                                          itertools.cycle([1, 7, 257, 3001])):
            tw = Twin(loaded, *wide_state(rng, n))
            tw.write_copy(cdtype, "binary: after write_state")
            for t in range(1, 5):
                grad_bits = [wide_grad_bits(rng, n, gdtype) for _ in range(K)]
                if t == 3:
                    grad_bits[0][n // 2] = NAN_BITS[gdtype]
                tw.step(grads_of(grad_bits, gdtype), StepScalars.compute(OptimizerHyper(), t, divisor=float(K)),
                        cdtype, f"binary: {gdtype} K={K} ->{cdtype} n={n} t={t}", expect_finite=t != 3)
        # special values through the loaded program too
        P, M, V, G = np.meshgrid(specials(True), specials(True), specials(False), specials(True),
                                 indexing="ij")
        tw = Twin(loaded, *(f32_from_bits(x.reshape(-1)) for x in (P, M, V)))
        tw.step([f32_from_bits(G.reshape(-1))], SPECIAL_SCALARS["subnormal-eps"], "fp16", "binary: specials")
    finally:
        loaded.close()


def _assert_one_line_user_error(path, what):
    with pytest.raises(UserError) as info:
        OpenCLBackend(binary=str(path))
    msg = str(info.value)
    assert msg and "\n" not in msg.strip(), f"{what}: message is not one line: {msg!r}"
    assert str(path) in msg, f"{what}: message does not name the file: {msg!r}"


def test_bad_binary_missing_file(tmp_path):
    _assert_one_line_user_error(tmp_path / "no-such-program.bin", "missing file")
    _assert_one_line_user_error(tmp_path, "a directory")


@pytest.mark.parametrize("content", [b"this is not an OpenCL program binary\n" * 40, b"", b"\x7fELF" + bytes(200)],
                         ids=["text", "empty", "elf-header"])
def test_bad_binary_garbage_file(tmp_path, content):
    path = tmp_path / "garbage.bin"
    path.write_bytes(content)
    _assert_one_line_user_error(path, f"garbage file {content[:8]!r}")


# --------------------------------------------------------------------------
# the check kernel's chunks and regions
# --------------------------------------------------------------------------


def _check_boundaries(be: OpenCLBackend, n: int, k: int) -> list[int]:
    """Element positions on both sides of every chunk boundary of eps_check's regions, in
    every lane of its unrolled pass and in the remainder after it (first chunk of the
    second region), the vectors left past the regions, and the tail, as eps.cl cuts them
    for this launch."""
    from l2l.eps.opencl_backend import kernel_source
    from l2l.eps.opencl_backend import regions as regions_of
    unroll = int(re.search(r"#define CHECK_UNROLL (\d+)", kernel_source()).group(1))
    items, _ = be.launch_shape("eps_check_f32", n, k)
    vw, regions = be.vector_width, regions_of("eps_check_f32", k)
    nv = n // vw
    region = nv // regions
    starts = sorted({c * region // items for c in range(items + 1)})
    positions = {0, n - 1, regions * region * vw, nv * vw - 1}
    for r in range(regions):
        for start in starts:
            j = r * region + start
            positions |= {j * vw, j * vw - 1, j * vw + vw - 1}
    first = region + starts[0]
    positions |= {(first + u) * vw + u % vw for u in range(unroll + 3)}
    return sorted(i for i in positions if 0 <= i < n)


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("vector_width", [8, 16])
@pytest.mark.parametrize("launch", ["chunks", "vectors", "task"])
def test_check_finds_every_position(launch, vector_width, k):
    """eps_check walks chunks of 4, 2 or 1 regions (by K) in lockstep, 8 vectors a pass,
    and stores its verdict once: an inf or a NaN in any contribution on either side of
    every chunk boundary in any region, in each lane of the pass and in the remainder after
    it, in the vectors left past the regions and in the n % VW tail still clears the flag,
    and the layer is left as it was."""
    vw = vector_width
    chunk = 11  # one unrolled pass of 8 vectors and 3 more
    n = (4 * 5 * chunk + 3) * vw + 5  # K = 1: 4 regions of 5 chunks, 3 vectors left over, a tail of 5
    be = OpenCLBackend(launch=launch, min_chunk=chunk, vector_width=vw)
    try:
        positions = _check_boundaries(be, n, k)
        if launch == "chunks":
            assert be.launch_shape("eps_check_f32", n, k) == ({1: 5, 2: 10, 4: 20}[k], 1)
            assert len(positions) >= 40
        rng = np.random.default_rng(77)
        p, m, v = wide_state(rng, n)
        s = StepScalars.compute(OptimizerHyper(), 1)
        for c, (i, bad) in enumerate(zip(positions, itertools.cycle([np.inf, np.nan, -np.inf]))):
            tw = Twin(be, p, m, v)
            g = (rng.standard_normal((k, n)) * 1e-3).astype(np.float32)
            g[c % k, i] = bad
            tw.step(list(g), s, "fp32", f"{bad} at {i} of {n} in contribution {c % k} of {k}", expect_finite=False)
            tw.check_state(f"after {bad} at {i}")
        tw.step([np.ones(n, np.float32)], s, "fp32", "finite layer", expect_finite=True)
    finally:
        be.close()


# --------------------------------------------------------------------------
# the update's decay boundary in every launch shape
# --------------------------------------------------------------------------


@pytest.mark.parametrize("launch", ["chunks", "vectors", "task"])
def test_decay_boundary_in_every_shape(launch):
    """eps_update decays whole vectors below n_decay, selects lanes in the one vector that
    straddles it, leaves the vectors past it undecayed, and decides the tail element by
    element. Every boundary in and around the first two vectors, on both sides of a chunk
    edge and half a vector past it, and in the tail; one work-item per chunk of 3 vectors,
    per vector (most items with none) or one for all; both vector widths; K = 1 and 2."""
    for vw in (8, 16):
        chunk = 3
        n = 10 * chunk * vw + 5  # ten chunks of three vectors, a tail of 5
        be = OpenCLBackend(launch=launch, min_chunk=chunk, vector_width=vw)
        try:
            edges = (chunk * vw, 5 * chunk * vw)
            boundaries = sorted({*range(2 * vw + 2), *(e + d for e in edges for d in (-1, 0, 1, vw // 2)),
                                 *range(n - 6, n + 1)})
            rng = np.random.default_rng(vw)
            tw = Twin(be, *wide_state(rng, n))
            for t, nd in enumerate(boundaries, start=1):
                K, cdtype = 1 + t % 2, DTYPES[t % 3]
                grads = [(rng.standard_normal(n) * 1e-2).astype(np.float32) for _ in range(K)]
                s = StepScalars.compute(OptimizerHyper(lr=1e-2, weight_decay=0.1), t, divisor=float(K))
                tw.step(grads, s, cdtype, f"{launch} VW={vw} n_decay={nd} of {n} K={K} ->{cdtype}",
                        expect_finite=True, n_decay=nd)
        finally:
            be.close()


# --------------------------------------------------------------------------
# launches: arguments set only when changed, the flag reset after every step
# --------------------------------------------------------------------------


def test_a_step_that_fails_midway_leaves_the_next_whole(monkeypatch):
    """The finite flag is reset at the end of a step, not at the start of the next. A step
    whose check cleared it and whose update then failed to launch must still leave it set:
    the next, finite step updates the layer, bit for bit the golden model's first step."""
    rng = np.random.default_rng(3)
    n = 4099
    p = rng.standard_normal(n).astype(np.float32)
    be, ref = OpenCLBackend(), NumpyBackend()
    be.allocate(0, p)
    ref.allocate(0, p)
    real_launch = be._launch

    def update_fails(name, *args, **kw):
        if name.startswith("eps_update"):
            raise RuntimeError("injected launch failure")
        return real_launch(name, *args, **kw)

    monkeypatch.setattr(be, "_launch", update_fails)
    bad = np.full(n, np.inf, np.float32)
    s = StepScalars.compute(OptimizerHyper(), 1)
    with pytest.raises(RuntimeError, match="injected"):
        be.step(0, [bad], s, np.empty(n, np.float32))
    monkeypatch.setattr(be, "_launch", real_launch)
    g = (rng.standard_normal(n) * 1e-3).astype(np.float32)
    a, b = np.empty(n, np.float32), np.empty(n, np.float32)
    assert be.step(0, [g], s, a) and ref.step(0, [g], s, b)
    assert_same(a, b, "device copy after the failed step")
    for name, x, y in zip("pmv", be.read_state(0), ref.read_state(0)):
        assert_same(x, y, f"{name} after the failed step")


def test_hyperparameters_changed_between_steps_reach_the_kernel():
    """Kernel arguments are set only when they differ from the kernel's last launch. Steps
    that change one hyperparameter at a time, and layers taking turns with the kernels, must
    each match the golden model."""
    rng = np.random.default_rng(4)
    n = 1000
    be, ref = OpenCLBackend(), NumpyBackend()
    for layer in (0, 1):
        p = rng.standard_normal(n).astype(np.float32)
        be.allocate(layer, p)
        ref.allocate(layer, p)
    hypers = [OptimizerHyper(), OptimizerHyper(lr=3e-4), OptimizerHyper(lr=3e-4, weight_decay=0.0),
              OptimizerHyper(lr=3e-4, eps=1e-6), OptimizerHyper(lr=3e-4, beta2=0.95)]
    for t, hyper in enumerate(hypers, start=1):
        for layer in (0, 1, 0):
            g = (rng.standard_normal(n) * 1e-2).astype(np.float32)
            s = StepScalars.compute(hyper, t, divisor=float(1 + layer))
            a, b = np.empty(n, np.float32), np.empty(n, np.float32)
            assert be.step(layer, [g], s, a) and ref.step(layer, [g], s, b)
            assert_same(a, b, f"step {t} layer {layer} hyper {hyper}")


def test_kernel_arguments_compare_by_bits():
    from l2l.eps.opencl_backend import _same_arg
    assert _same_arg(np.float32(1.5), np.float32(1.5))
    assert not _same_arg(np.float32(0.0), np.float32(-0.0))
    assert not _same_arg(np.float32(1.0), np.uint32(1065353216))  # same bits, another type
    nan, other_nan = (f32_from_bits(bits)[()] for bits in (NAN_BITS["fp32"], NAN_BITS["fp32"] | 1))
    assert _same_arg(nan, f32_from_bits(NAN_BITS["fp32"])[()]) and not _same_arg(nan, other_nan)
    assert not _same_arg(np.uint32(7), np.uint32(8))


# --------------------------------------------------------------------------
# streaming stores for the device copy (x86 CPU devices)
# --------------------------------------------------------------------------


def _copy_at(n: int, cdtype: str, misalign: int) -> np.ndarray:
    """A device-copy array whose data start ``misalign`` bytes past a 64-byte boundary."""
    dtype = np.dtype(COPY_DTYPES[cdtype])
    raw = np.zeros(n * dtype.itemsize + 128, np.uint8)
    start = (-raw.ctypes.data) % 64 + misalign
    return raw[start:start + n * dtype.itemsize].view(dtype)


@pytest.mark.parametrize("streaming", ["1", "0"])
@pytest.mark.parametrize("vector_width", [8, 16])
def test_device_copy_bits_do_not_depend_on_its_alignment(streaming, vector_width, monkeypatch):
    """The update writes the copy with streaming stores when built for them and the copy
    is aligned for them (a whole float8 or float16 register), with plain stores otherwise:
    the same bits either way, and on a non-finite step nothing is written by either route."""
    monkeypatch.setenv("L2L_CL_STREAMING", streaming)
    be = OpenCLBackend(vector_width=vector_width)
    try:
        options = be.program.get_build_info(be.device, be._cl.program_build_info.OPTIONS)
        assert ("-DL2L_NT_STORES" in options) is be.streaming_stores
        rng = np.random.default_rng(5)
        n = 8 * 300 + 3
        for cdtype, misalign in itertools.product(DTYPES, (0, 2, 4, 16, 32)):
            tw = Twin(be, *wide_state(rng, n))
            copies = (_copy_at(n, cdtype, misalign), _copy_at(n, cdtype, misalign))
            for t in (1, 2, 3):
                g = grads_of([wide_grad_bits(rng, n, "fp32")], "fp32")
                if t == 2:
                    g[0][n // 3] = np.inf
                tw.step(g, StepScalars.compute(OptimizerHyper(), t), cdtype,
                        f"copy {cdtype} at 64+{misalign} t={t}", expect_finite=t != 2, copies=copies)
    finally:
        be.close()


# --------------------------------------------------------------------------
# CPU devices: the state in host memory, the master as the fp32 copy
# --------------------------------------------------------------------------


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(f"u{a.dtype.itemsize}")


def test_the_master_serves_as_the_fp32_copy_bit_for_bit():
    """On a CPU device p is a host array, handed out by master_as_copy; steps writing the copy
    into it (one non-finite among them) and into separate bf16/fp16/fp32 copies between them
    match the golden model with its own master as copy. The update kernel gets p's own buffer
    as its copy (no second buffer over p's memory), and write_copy into p does nothing."""
    rng = np.random.default_rng(11)
    n = 16 * 300 + 5
    be, ref = OpenCLBackend(min_chunk=12), NumpyBackend()
    try:
        assert be._zero_copy
        p0 = rng.standard_normal(n).astype(np.float32)
        be.allocate(0, p0)
        ref.allocate(0, p0)
        mine, golden = be.master_as_copy(0), ref.master_as_copy(0)
        assert mine.dtype == np.float32 and mine.ctypes.data % be._host_align == 0
        assert not np.shares_memory(mine, p0)
        be.write_copy(0, mine)  # a no-op: nothing enqueued, nothing changed
        assert_same(mine, p0, "p after write_copy into itself")
        separate = itertools.cycle([None, "bf16", "fp16", "fp32"])
        for t in range(1, 10):  # the last into the master
            grads = (rng.standard_normal((2, n)) * 1e-2).astype(np.float32)
            if t == 4:
                grads[1, n // 2] = np.nan
            s = StepScalars.compute(OptimizerHyper(lr=1e-2), t, divisor=2.0)
            cdtype = next(separate)
            if cdtype is None:
                a, b = mine, golden
            else:
                a, b = (np.zeros(n, COPY_DTYPES[cdtype]) for _ in range(2))
            assert be.step(0, grads, s, a) is ref.step(0, grads, s, b) is (t != 4)
            assert_same(a, b, f"step {t}: copy {cdtype or 'the master'}")
            for name, x, y in zip("pmv", be.state_view(0), ref.state_view(0)):
                assert_same(x, y, f"step {t}: {name}")
        args = be._last_args["eps_update_f32_f32"]
        assert args[1] is args[4] is be._state[0][0]
        assert all(key[0] != mine.ctypes.data for key in be._host_buffers)
    finally:
        be.close()


def test_state_in_host_memory_round_trip():
    """state_view hands the host arrays themselves, read-only; read_state and read_master
    copies; write_state writes into them; adopt takes writable aligned fp32 vectors as they
    are (others copied); release forgets the layer; a re-adopted layer updates like NumPy's."""
    from l2l.hostmem import aligned_empty
    rng = np.random.default_rng(12)
    n = 1000
    be, ref = OpenCLBackend(), NumpyBackend()
    try:
        state = wide_state(rng, n)
        mine = [aligned_empty(n, np.float32, 4096) for _ in range(3)]
        for dst, src in zip(mine, state):
            dst[...] = src
        be.adopt(0, *mine)
        ref.adopt(0, *(a.copy() for a in state))
        view = be.state_view(0)
        assert all(v.ctypes.data == a.ctypes.data and not v.flags.writeable for v, a in zip(view, mine))
        assert be.master_as_copy(0) is mine[0]
        copies = be.read_state(0)
        assert all(not np.shares_memory(c, a) for c, a in zip(copies, mine))
        assert not np.shares_memory(be.read_master(0), mine[0])
        s = StepScalars.compute(OptimizerHyper(), 2)
        g = [(rng.standard_normal(n) * 1e-3).astype(np.float32)]
        assert be.step(0, g, s, mine[0]) and ref.step(0, g, s, ref.master_as_copy(0))
        for name, x, y in zip("pmv", mine, ref.state_view(0)):  # updated in the adopted arrays
            assert_same(x, y, f"adopted {name} after a step")
        loaded = wide_state(rng, n)
        be.write_state(0, *loaded)
        for x, y in zip(mine, loaded):
            assert_same(x, y, "write_state into the host arrays")
        be.release(0)
        assert 0 not in be._state and 0 not in be._host
        with pytest.raises(KeyError):
            be.master_as_copy(0)
        # not adoptable as they are: float64, read-only, misaligned for the device
        raw = np.zeros(n + 1, np.float32)
        odd = raw[1:] if raw[1:].ctypes.data % be._host_align else raw[:-1]
        odd[...] = loaded[0]
        frozen = loaded[1].copy()
        frozen.flags.writeable = False
        be.adopt(1, odd, frozen, loaded[2].astype(np.float64))
        ref.write_state(0, *loaded)
        taken = be.state_view(1)
        assert not any(np.shares_memory(x, y) for x, y in zip(taken, (odd, frozen)))
        assert all(x.ctypes.data % be._host_align == 0 for x in taken)
        assert be.step(1, g, s, be.master_as_copy(1)) and ref.step(0, g, s, ref.master_as_copy(0))
        for name, x, y in zip("pmv", be.read_state(1), ref.read_state(0)):
            assert_same(x, y, f"copied-in {name} after a step")
    finally:
        be.close()


def test_a_runtime_that_copies_host_memory_keeps_device_buffers(monkeypatch):
    """A runtime may cache a USE_HOST_PTR buffer's memory (the spec allows it; a map still
    returns the host address). Played here by buffers that copy the host memory when made:
    the probe sees the stale copy, the backend warns and keeps its state, gradients and
    copies in buffers of its own, gives no master as the copy, and still gives NumPy's bits."""
    from l2l.eps import EagerParamServer

    def copying_buffer(self, nbytes, owner, arg, hostbuf=None):
        mf = self._cl.mem_flags
        buf = (self._cl.Buffer(self.context, mf.READ_WRITE, max(nbytes, 4)) if hostbuf is None else
               self._cl.Buffer(self.context, mf.READ_WRITE | mf.COPY_HOST_PTR, hostbuf=hostbuf))
        self._bind(owner, arg, buf)
        return buf

    monkeypatch.setattr(OpenCLBackend, "_new_buffer", copying_buffer)
    with pytest.warns(RuntimeWarning, match="not seen computing in the host memory"):
        be = OpenCLBackend()
    assert not be._zero_copy
    hyper = OptimizerHyper(lr=1e-2)
    got = EagerParamServer(be, hyper, share_masters=True)
    ref = EagerParamServer(NumpyBackend(), hyper, share_masters=True)
    try:
        rng = np.random.default_rng(13)
        n = 3001
        w = rng.standard_normal(n).astype(np.float32)
        for srv in (got, ref):
            srv.add_layer(0, w)
        assert be.master_as_copy(0) is None and got.copy_bytes == 4 * n and ref.copy_bytes == 0
        for step in range(3):
            g = rng.standard_normal(n).astype(np.float32)
            for srv in (got, ref):
                srv.gradient_inbox(0)[...] = g
                srv.push_gradient(0, divisor=1.0)
                srv.synchronize()
            assert_same(got.fetch(0), ref.fetch(0), f"step {step}: copy")
    finally:
        got.close()
        ref.close()
