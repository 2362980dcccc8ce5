"""The harness shared by the bit-exact suites of every non-NumPy EPS backend.

A :class:`Twin` holds one layer in a fresh NumpyBackend (the golden model) and
in the backend under test, steps both from the same state and compares p, m, v,
the finite flag and the device copy bit for bit (NaN == NaN).

:data:`UNDER_TEST` lists the backends that tests/test_eps_backends_bitexact.py
runs every vector class of the contract through, with the layer sizes at which
each one's kernels change path. Adding a backend there (an RTL simulation, say)
gives it the whole suite; what only one backend has (OpenCL's program binaries,
the HLS build cache and kernel interface) stays in tests/test_eps_opencl.py and
tests/test_eps_hls.py.
"""
from __future__ import annotations

import dataclasses
import itertools
import re
import zlib
from typing import Callable

import numpy as np

from l2l.eps import EpsBackend, HlsCsimBackend, NumpyBackend, OpenCLBackend, StepScalars
from l2l.eps import hls_csim_backend
from l2l.eps.numerics import COPY_DTYPES

from eps_oracle import (  # tests/ is on sys.path under pytest
    Oracle,
    assert_bits,
    bits_of,
    grad_array,
    is_nan_bits,
    wide_f32,
)

FMT_OF = {np.dtype(np.float32): "fp32", COPY_DTYPES["bf16"]: "bf16", np.dtype(np.float16): "fp16"}
DTYPES = ["fp32", "bf16", "fp16"]
_LAYER_IDS = itertools.count(10_000)


def new_layer() -> int:
    """A layer id no other test uses on a module-shared backend."""
    return next(_LAYER_IDS)


# --------------------------------------------------------------------------
# comparison helpers
# --------------------------------------------------------------------------


def _hex(a, i) -> str:
    a = np.ascontiguousarray(a)
    width = a.dtype.itemsize * 2
    return f"0x{int(bits_of(a)[i]):0{width}x}"


def assert_same(got, want, what, inputs=None):
    """``got`` has ``want``'s dtype, shape and bits (NaN == NaN); on failure the inputs
    of the first differing elements are in the message (``inputs``: a dict, or a function
    that makes one, called only on failure).

    The usual outcome, every bit equal, is decided on the raw unsigned view alone: the
    NaN rule is evaluated only where bits differ. Same verdict as comparing widened bit
    patterns everywhere, at a fraction of the cost on the suites' multi-million-element
    layers."""
    got, want = np.ascontiguousarray(got), np.ascontiguousarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, got.shape, want.dtype, want.shape)
    fmt = FMT_OF[got.dtype]
    raw = np.dtype(f"u{got.dtype.itemsize}")
    differ = np.flatnonzero(got.view(raw) != want.view(raw))
    if differ.size == 0:
        return
    a, e = bits_of(got), bits_of(want)
    if (is_nan_bits(a[differ], fmt) & is_nan_bits(e[differ], fmt)).all():
        return
    ok = (a == e) | (is_nan_bits(a, fmt) & is_nan_bits(e, fmt))
    detail = ""
    if callable(inputs):
        inputs = inputs()
    if inputs:
        arrays = {k: x for k, x in inputs.items() if isinstance(x, np.ndarray)}
        scal = {k: x for k, x in inputs.items() if not isinstance(x, np.ndarray)}
        rows = []
        for i in np.flatnonzero(~ok)[:4]:
            rows.append(f"  input [{i}]: " + ", ".join(f"{k}={_hex(x, i)}" for k, x in arrays.items()))
        rows.append("  scalars: " + ", ".join(f"{k}={x!r}" for k, x in scal.items()))
        detail = "\n" + "\n".join(rows)
    assert_bits(got, e, fmt, f"{what} (backend vs NumPy){detail}")


def sentinel(n: int, cdtype: str) -> np.ndarray:
    """A device-copy array filled with a recognisable pattern (bits 0x5a5a...)."""
    out = np.empty(n, COPY_DTYPES[cdtype])
    out.view(np.uint8)[:] = 0x5A
    return out


def scalar_dict(s: StepScalars) -> dict:
    return {k: f"0x{int(np.asarray(v).view(np.uint32)):08x}" for k, v in zip(StepScalars.names(), s.as_tuple())}


class Twin:
    """One layer held by a fresh NumpyBackend and by the backend under test (``dut``), stepped in lockstep."""

    def __init__(self, backend, p, m=None, v=None, layer=None):
        self.ref, self.dut = NumpyBackend(threads=1), backend
        self.layer = new_layer() if layer is None else layer
        self.n = p.shape[0]
        for be in (self.ref, self.dut):
            be.allocate(self.layer, p)
            if m is not None:
                be.write_state(self.layer, p, m, v)
        self.check_state("after allocate/write_state")

    def check_state(self, what, inputs=None):
        ref, got = self.ref.read_state(self.layer), self.dut.read_state(self.layer)
        for name, r, g in zip("pmv", ref, got):
            assert_same(g, r, f"{what}: {name}", inputs)
        return ref

    def step(self, grads, s: StepScalars, cdtype: str, what: str, expect_finite=None, form="list",
             copies=None, n_decay=None) -> bool:
        """One update on both; ``grads`` is a list of K arrays, passed as ``form`` (see
        as_form). ``copies``: (NumPy's, the backend's) device-copy arrays reused across steps;
        by default fresh arrays holding a sentinel. ``n_decay``: the decay boundary, passed
        to both only when given (None: the step as a caller that knows no groups makes it)."""
        p, m, v = self.ref.read_state(self.layer)
        inputs = {"p": p, "m": m, "v": v, **{f"g{k}": g for k, g in enumerate(grads)}, **scalar_dict(s)}
        inputs["copy"] = cdtype
        inputs["form"] = form
        inputs["n_decay"] = n_decay
        kw = {} if n_decay is None else {"n_decay": n_decay}
        c_ref, c_dut = copies if copies is not None else (sentinel(self.n, cdtype), sentinel(self.n, cdtype))
        before = c_dut.copy()
        arg = as_form(grads, form)
        f_ref = self.ref.step(self.layer, arg, s, c_ref, **kw)
        f_dut = self.dut.step(self.layer, arg, s, c_dut, **kw)
        assert f_dut is f_ref, f"{what}: finite flag {self.dut.name} {f_dut} vs NumPy {f_ref}"
        if expect_finite is not None:
            assert f_ref is expect_finite, f"{what}: test vectors meant to give finite={expect_finite}"
        self.check_state(what, inputs)
        assert_same(c_dut, c_ref, f"{what}: device copy {cdtype}", inputs)
        if not f_ref:  # nothing written: what was there before is still there
            assert_same(c_dut, before, f"{what}: device copy written on a non-finite step")
        return f_ref

    def write_copy(self, cdtype: str, what: str):
        c_ref, c_dut = sentinel(self.n, cdtype), sentinel(self.n, cdtype)
        self.ref.write_copy(self.layer, c_ref)
        self.dut.write_copy(self.layer, c_dut)
        assert_same(c_dut, c_ref, f"{what}: write_copy {cdtype}",
                    lambda: {"p": self.ref.read_state(self.layer)[0]})  # p has not changed since
        return c_ref


def grads_of(grad_bits, gdtype):
    return [grad_array(b, gdtype) for b in grad_bits]


FORMS = ["list", "block", "strided"]


def as_form(grads, form):
    """The K contributions as a backend receives them: a list of K arrays ("list"), one
    C-contiguous (K, n) array ("block", what the server passes), or a non-contiguous (K, n)
    view ("strided": every other column of a wider array); "given": ``grads`` itself."""
    if form == "given":
        return grads
    if form == "list":
        return list(grads)
    if form == "block":
        return np.stack(grads)
    assert form == "strided"
    wide = np.zeros((len(grads), 2 * grads[0].shape[0]), grads[0].dtype)
    wide[:, ::2] = np.stack(grads)
    return wide[:, ::2]


def wide_state(rng, n):
    return wide_f32(rng, n), wide_f32(rng, n), wide_f32(rng, n, nonneg=True)


def oracle_ties(p, m, v, grad_bits, gdtype, s, cdtype) -> Oracle:
    """The contract oracle's tie counters for these inputs: proves a construction really ties."""
    o = Oracle()
    g, finite = o.reduce(grad_bits, gdtype, s.inv_scale)
    assert finite
    p2, _, _ = o.adamw(p.astype(np.float64), m.astype(np.float64), v.astype(np.float64), g, s)
    o.copy_bits(p2, cdtype)
    return o


# --------------------------------------------------------------------------
# the backends under test
# --------------------------------------------------------------------------


def _around(*sizes: int) -> tuple[int, ...]:
    """One below, at and one above each size."""
    return tuple(n + d for n in sizes for d in (-1, 0, 1))


def _hls_tile() -> int:
    """eps::TILE of hls/eps_kernels.cpp (elements per burst), read from the source so that the
    edge sizes follow the kernels if the tile changes."""
    found = re.search(r"constexpr unsigned TILE = (\d+);", hls_csim_backend.kernel_source())
    assert found, "hls/eps_kernels.cpp no longer says `constexpr unsigned TILE = <n>;`"
    return int(found.group(1))


def _hls_block() -> int:
    """eps::BLOCK (elements per dataflow region), as a multiple of TILE in the source."""
    found = re.search(r"constexpr unsigned BLOCK = (\d+) \* TILE;", hls_csim_backend.kernel_source())
    assert found, "hls/eps_kernels.cpp no longer says `constexpr unsigned BLOCK = <k> * TILE;`"
    return int(found.group(1)) * HLS_TILE


HLS_TILE = _hls_tile()
HLS_BLOCK = _hls_block()
OPENCL_CHUNK = 12  # vectors a chunk takes at least, in tests: small layers cut into many chunks,
# each one unrolled pass of eps_check (8 vectors) and a remainder
NUMPY_GRAIN = 256  # elements a threaded NumPy range is a multiple of, in tests: small layers cut into ranges


@dataclasses.dataclass(frozen=True)
class BackendUnderTest:
    """What the shared bit-exact suite needs to know about one backend besides its interface.

    ``make`` builds one with default options. ``edge_sizes``: the layer sizes n of the random
    vector test, around the sizes where the kernels change path (vector width, work-group,
    tile), since that is where an off-by-one in a loop bound or a tail would show. A layer of
    ``nonfinite_n`` elements gets its one non-finite gradient element at each of
    ``nonfinite_at`` in turn: the first element, inside a later block, the last element of a
    partial block, each a different branch of the kernels' loops. ``split_at(backend, n)``:
    element indices where an n-element update's work changes hands or path (a work-item's
    chunk, a thread's range, a block, the scalar tail), around which the decay boundary
    ``n_decay`` is put (the parameter groups); ``groups_n``, the layer size for that."""

    name: str
    make: Callable[[], EpsBackend]
    edge_sizes: tuple[int, ...]
    nonfinite_n: int
    nonfinite_at: tuple[int, int, int]
    groups_n: int
    split_at: Callable[[EpsBackend, int], tuple[int, ...]]


def _opencl_split(be, n: int) -> tuple[int, ...]:
    """eps_update's chunk starts as eps.cl cuts them for this launch (the second, third and
    last work-item's), and its scalar tail."""
    vw, items = be.vector_width, be.launch_shape("eps_update_f32_f32", n)[0]
    nv = n // vw
    starts = [c * nv // items * vw for c in range(1, items)]
    return (*starts[:2], *starts[-1:], nv * vw)


def _numpy_split(be, n: int) -> tuple[int, ...]:
    """The threads' ranges (l2l/eps/threads.py RangePool)."""
    return tuple(lo for lo, _ in be._pool.ranges(n)[1:])


def _hls_split(be, n: int) -> tuple[int, ...]:
    """The dataflow blocks (eps::BLOCK, one region each)."""
    return tuple(range(HLS_BLOCK, n, HLS_BLOCK))


UNDER_TEST: dict[str, BackendUnderTest] = {be.name: be for be in (
    # OpenCL (fpga/opencl/eps.cl): vectors of 8 or 16 elements (the device's width) plus a
    # scalar tail; the update cut into chunks of at least OPENCL_CHUNK vectors, a work-item
    # each; the check walking four regions so cut, 8 vectors a pass, its last work-item
    # also taking the vectors left past the regions. Sizes around one vector of either
    # width, around several chunks of the update (384) and of the check (1536), and where
    # the chunk count reaches its cap of 64 per compute unit. The non-finite layer is 24
    # vectors a region and one left over, with a tail of 3: the first element, one in the
    # second check chunk of the third region, the last.
    BackendUnderTest(OpenCLBackend.name, lambda: OpenCLBackend(min_chunk=OPENCL_CHUNK),
                     edge_sizes=(1, *_around(8, 16, 384, 1536), 3001, 8193),
                     nonfinite_n=97 * 16 + 3,
                     nonfinite_at=(0, 65 * 16 + 3, 97 * 16 + 2),
                     groups_n=3005, split_at=_opencl_split),
    # NumPy on several threads (l2l/eps/threads.py): the layer cut into one contiguous range of
    # whole grains per thread (the last takes the rest), each range walked in chunks; against
    # one thread. Sizes around one, two and three grains (one range, then two, then three)
    # and past them; the non-finite element in the first, second and last range.
    BackendUnderTest(NumpyBackend.name, lambda: NumpyBackend(threads=3, grain=NUMPY_GRAIN),
                     edge_sizes=(1, *_around(NUMPY_GRAIN, 2 * NUMPY_GRAIN, 3 * NUMPY_GRAIN), 3001),
                     nonfinite_n=3 * NUMPY_GRAIN + 5,
                     nonfinite_at=(0, NUMPY_GRAIN + 7, 3 * NUMPY_GRAIN + 4),
                     groups_n=3005, split_at=_numpy_split),
    # HLS (hls/eps_kernels.cpp): tiles of HLS_TILE, one burst per contribution and tile; a few
    # small sizes too. The non-finite layer is two whole tiles and a partial one.
    BackendUnderTest(HlsCsimBackend.name, HlsCsimBackend,
                     edge_sizes=(1, 7, 8, 9, *_around(HLS_TILE, 2 * HLS_TILE), 3001),
                     nonfinite_n=2 * HLS_TILE + 43,
                     nonfinite_at=(0, HLS_TILE + 3, 2 * HLS_TILE + 42),
                     groups_n=HLS_BLOCK + 3005, split_at=_hls_split),
)}


def rng_for(backend: EpsBackend, *words) -> np.random.Generator:
    """A generator seeded by the backend's name and a test's words (its name and parameters):
    the same vectors on every run and under any test order or worker, and other vectors for
    each backend, so that two backends do not share the blind spots of one seed."""
    return np.random.default_rng(zlib.crc32("-".join(str(w) for w in (backend.name, *words)).encode()))
