"""LAMB on the OpenCL EPS (fpga/opencl/eps.cl: ``eps_lamb_norms_<g>``, the host's fold,
``eps_lamb_step_<c>``) against the golden model, ``NumpyBackend(threads=1)``, bit for bit (NaN ==
NaN): p, m, v, the finite flag, the device copy and the 16-lane partial sums the norm pass hands
to the fold; the kernels called directly (the sums against ``numerics.lamb_norms``, the step
against ``numerics.lamb_apply``), through the EagerParamServer and from the command line.

Vector classes: layers of several tensors (1, 15, 17 elements; an all-zeros one, whose trust
ratio is 1; a wide-valued one; tensors starting at offsets that are no multiple of a vector or
of the 16 lanes), a tensor across the 65536-element block boundary (~70000 elements), every
gradient dtype with every copy dtype, K = 1, 2, 3, non-finite gradients (nothing written), the
decay boundary at 0, at tensor starts, inside a row of lanes and at n, weight_decay 0, both vector
widths (float8: two accumulators a row; float16: one) and every launch shape; then the
zero-copy master serving as the copy, programs loaded from a binary (one built before LAMB
still runs AdamW), segments that change between steps, refused steps. The golden model itself
is checked against the contract in tests/test_lamb.py; the HLS twin in tests/test_lamb_hls.py
(whose harness this file shares).
"""
from __future__ import annotations

import itertools
import re
import zlib

import numpy as np
import pytest

from l2l.checkpoint import load_latest
from l2l.eps import EagerParamServer, NumpyBackend, OpenCLBackend, OptimizerHyper, StepScalars, numerics
from l2l.eps.contract import LambStep, LionScalars
from l2l.eps.numerics import COPY_DTYPES, GRAD_DTYPES, LANES
from l2l.eps.opencl_backend import BINARY_VECTOR, BUILD_OPTIONS, kernel_source
from l2l.errors import UserError
from l2l.metrics import read_metrics

from conftest import run_cli
from eps_oracle import grad_array, nonfinite_cases, nonfinite_grads
from eps_twin import DTYPES, OPENCL_CHUNK, assert_same, new_layer, sentinel
from test_lamb_hls import (BIG_KINDS, BIG_N, BIG_SIZES, HYPER, HYPERS, NO_DECAY, SMALL_KINDS, SMALL_SIZES,
                           LambTwin, lamb_scalars, layer, with_inv_scale, _sums_sentinel)

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

SUFFIX = {"fp32": "f32", "bf16": "bf16", "fp16": "f16"}
SHAPES = list(itertools.product(["chunks", "vectors", "task"], [8, 16]))


@pytest.fixture(scope="module", params=[8, 16], ids=["VW8", "VW16"])
def backend(request):
    """The default launch on a CPU device (chunks), small chunks: many work-items on small layers."""
    be = OpenCLBackend(min_chunk=OPENCL_CHUNK, vector_width=request.param)
    yield be
    be.close()


@pytest.fixture(scope="module", params=SHAPES, ids=[f"{launch}-VW{vw}" for launch, vw in SHAPES])
def shaped(request):
    """Every launch shape at either vector width; chunks of 3 vectors (many work-items)."""
    launch, vw = request.param
    be = OpenCLBackend(launch=launch, min_chunk=3, vector_width=vw)
    yield be
    be.close()


def _starts(sizes):
    return [int(x) for x in np.cumsum([0, *sizes[:-1]])]


# --------------------------------------------------------------------------
# the program
# --------------------------------------------------------------------------


def test_program_has_every_lamb_kernel(backend):
    """eps_lamb_norms_<g> (20 arguments) and eps_lamb_step_<c> (19) for every dtype (fpga/ARGS.md)."""
    cl = backend._cl
    for x in ("f32", "bf16", "f16"):
        assert backend._kernels[f"eps_lamb_norms_{x}"].get_info(cl.kernel_info.NUM_ARGS) == 20
        assert backend._kernels[f"eps_lamb_step_{x}"].get_info(cl.kernel_info.NUM_ARGS) == 19
    assert OpenCLBackend.optimizers == {"adamw", "lion", "lamb"}


# --------------------------------------------------------------------------
# through the backend: every dtype pair, K, the block boundary, the decay boundary
# --------------------------------------------------------------------------


@pytest.mark.parametrize("K", [1, 2, 3])
@pytest.mark.parametrize("gdtype, cdtype", list(itertools.product(DTYPES, DTYPES)))
def test_every_dtype_pair_and_contribution_count(backend, gdtype, cdtype, K):
    """Three steps on one layer of several tensors (1, 15, 17 elements, an all-zeros one, a
    wide-valued one; most starting off a vector boundary), state carried over: inv_scale 1, then
    1/K with a loss scale for fp16 gradients, other hyper-parameters; the decay boundary at a
    tensor start, then at n, then none given."""
    rng = np.random.default_rng([1921, backend.vector_width, DTYPES.index(gdtype), DTYPES.index(cdtype), K])
    p, m, v, grads, starts = layer(rng, SMALL_SIZES, gdtype, K, SMALL_KINDS)
    n = p.shape[0]
    tw = LambTwin(backend, p, m, v, starts)
    tw.step(grads, lamb_scalars(), cdtype, f"{gdtype}->{cdtype} K={K} step 1", expect_finite=True,
            n_decay=starts[4])
    for t, hyper in ((2, HYPERS[1]), (3, HYPERS[2])):
        grads = layer(rng, SMALL_SIZES, gdtype, K, SMALL_KINDS)[3]
        s = lamb_scalars(hyper, t, loss_scale=1024.0 if gdtype == "fp16" else 1.0, divisor=float(K))
        tw.step(grads, s, cdtype, f"{gdtype}->{cdtype} K={K} step {t}", expect_finite=True,
                n_decay=n if t == 2 else None)


@pytest.mark.parametrize("gdtype, cdtype, K", [("fp32", "fp32", 1), ("bf16", "bf16", 2), ("fp16", "fp32", 3),
                                               ("fp32", "fp16", 2)])
def test_tensor_across_the_block_boundary(backend, gdtype, cdtype, K):
    """A layer of 70000 elements whose fourth tensor crosses 65536 (two segments of one tensor,
    their sums folded together on the host), an all-zeros and a wide-valued tensor among them."""
    rng = np.random.default_rng([1922, backend.vector_width, DTYPES.index(gdtype), K])
    p, m, v, grads, starts = layer(rng, BIG_SIZES, gdtype, K, BIG_KINDS)
    seg = numerics.lamb_segments(starts, BIG_N)
    assert numerics.BLOCK in seg.bounds and np.count_nonzero(seg.tensor == 3) == 2
    tw = LambTwin(backend, p, m, v, starts)
    for t in (1, 2):
        tw.step(grads, lamb_scalars(HYPER, t, divisor=float(K)), cdtype, f"{gdtype}->{cdtype} K={K} step {t}",
                expect_finite=True, n_decay=starts[4])
        grads = layer(rng, BIG_SIZES, gdtype, K, BIG_KINDS)[3]


def _decay_boundaries():
    starts = _starts(BIG_SIZES)
    return [0, 1, starts[1], starts[2] + 5, starts[3], starts[3] + 16 * 7 + 9, starts[4],
            numerics.BLOCK - 1, numerics.BLOCK, numerics.BLOCK + 1, BIG_N - 1, BIG_N]


def test_decay_boundary_in_every_shape(shaped):
    """n_decay at 0, 1, at tensor starts, inside tensors (inside a row of 16 lanes, mid-vector),
    at the block boundary that cuts a tensor in two and at n: the norm pass's rows below it,
    across it (a per-lane select) and past it; the step pass's runs on either side, in every
    launch shape and vector width."""
    rng = np.random.default_rng([1923, shaped.vector_width, zlib.crc32(shaped._shape["eps_lamb_norms_f32"].encode())])
    p, m, v, grads, starts = layer(rng, BIG_SIZES, "fp32", 2, BIG_KINDS)
    tw = LambTwin(shaped, p, m, v, starts)
    for t, n_decay in enumerate(_decay_boundaries(), start=1):
        grads = layer(rng, BIG_SIZES, "fp32", 2, BIG_KINDS)[3]
        tw.step(grads, lamb_scalars(HYPERS[2], t, divisor=2.0), DTYPES[t % 3], f"n_decay={n_decay}",
                expect_finite=True, n_decay=n_decay)


def test_decay_boundary_at_every_lane(shaped):
    """A segment starting 3 elements in (off every vector boundary), the decay boundary at each
    of its first 40 elements in turn: every lane of the first and second row, either half of a
    float8 row, and the tail; the tensor after it adapted or not by where it falls."""
    rng = np.random.default_rng([1924, shaped.vector_width])
    sizes = [3, 37, 70, 5]
    p, m, v, grads, starts = layer(rng, sizes, "bf16", 1)
    tw = LambTwin(shaped, p, m, v, starts)
    for t, n_decay in enumerate(range(3, 44), start=1):
        grads = layer(rng, sizes, "bf16", 1)[3]
        tw.step(grads, lamb_scalars(HYPER, t), "fp32", f"n_decay={n_decay}", expect_finite=True, n_decay=n_decay)


@pytest.mark.parametrize("sizes", [[1], [15], [16], [17], [8, 9], [1, 15, 17], [15, 1, 1, 17, 2], [33, 31, 7]])
def test_tiny_layers_and_tensors(shaped, sizes):
    """Layers of tiny tensors only: fewer elements than lanes or than a vector, exactly one row,
    one more; every launch shape (most work-items own no segment)."""
    rng = np.random.default_rng([1925, len(sizes), sum(sizes), shaped.vector_width])
    p, m, v, grads, starts = layer(rng, sizes, "fp16", 2)
    tw = LambTwin(shaped, p, m, v, starts)
    for t, n_decay in ((1, None), (2, starts[-1]), (3, 0), (4, 1)):
        grads = layer(rng, sizes, "fp16", 2)[3]
        tw.step(grads, lamb_scalars(HYPER, t, divisor=2.0, loss_scale=64.0), "bf16", f"{sizes} step {t}",
                expect_finite=True, n_decay=n_decay)


def test_no_weight_decay_adapts_no_tensor(backend):
    """weight_decay 0: no tensor takes its trust ratio (every step size is -lr), u2 = u."""
    rng = np.random.default_rng(1926)
    p, m, v, grads, starts = layer(rng, SMALL_SIZES, "fp32", 1, SMALL_KINDS)
    s = lamb_scalars(NO_DECAY)
    assert not s.adapt and s.wd == 0
    tw = LambTwin(backend, p, m, v, starts)
    for t in (1, 2, 3):
        tw.step(grads, lamb_scalars(NO_DECAY, t), "bf16", f"weight_decay 0, step {t}", expect_finite=True)
        grads = layer(rng, SMALL_SIZES, "fp32", 1, SMALL_KINDS)[3]


def test_nonfinite_state_follows_the_golden_model(backend):
    """State holding inf and NaN (a checkpoint's bits): NaN and inf squares in the sums, the
    step sizes the fold makes of them, NaN p'."""
    rng = np.random.default_rng(1927)
    p, m, v, grads, starts = layer(rng, SMALL_SIZES, "fp32", 1)
    special = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0], np.float32)
    for tensor in (1, 5):
        lo, hi = starts[tensor], starts[tensor + 1]
        p[lo:hi:3] = rng.choice(special, len(range(lo, hi, 3)))
        m[lo + 1:hi:3] = rng.choice(special, len(range(lo + 1, hi, 3)))
        v[lo + 2:hi:5] = rng.choice(special[[0, 2, 3]], len(range(lo + 2, hi, 5)))
    tw = LambTwin(backend, p, m, v, starts)
    tw.step(grads, lamb_scalars(), "bf16", "inf/NaN state", expect_finite=True)


@pytest.mark.parametrize("case, K, gdtype", list(nonfinite_cases()))
def test_nonfinite_gradient_changes_nothing(backend, case, K, gdtype):
    """Flag false, no fold, p, m, v and the copy untouched, wherever the bad element is: the
    first element, in a tensor's rows, the last element (a segment's lane-by-lane tail)."""
    rng = np.random.default_rng([1928, K, DTYPES.index(gdtype), zlib.crc32(case.encode())])
    p, m, v, _, starts = layer(rng, SMALL_SIZES, gdtype, K, SMALL_KINDS)
    n = p.shape[0]
    tw = LambTwin(backend, p, m, v, starts)
    for i in (0, starts[3] + 40, n - 1):
        grad_bits, adamw = nonfinite_grads(rng, n, case, K, gdtype, i)
        s = with_inv_scale(lamb_scalars(), adamw.inv_scale)
        tw.step([grad_array(b, gdtype) for b in grad_bits], s, "bf16", f"{case} K={K} {gdtype} at {i}",
                expect_finite=False)
    grads = layer(rng, SMALL_SIZES, gdtype, K, SMALL_KINDS)[3]
    tw.step(grads, lamb_scalars(HYPER, 2, divisor=float(K)), "bf16", "finite after", expect_finite=True)


def test_long_run_stays_bit_identical(backend):
    """Many steps on one state, a non-finite step among them: a one-ulp difference would grow."""
    rng = np.random.default_rng(1929)
    sizes = [64, 1, 500, 1031, 100]
    p, m, v, grads, starts = layer(rng, sizes, "fp32", 2)
    tw = LambTwin(backend, p, starts=starts)
    hyper = OptimizerHyper(lr=3e-3, beta1=0.9, beta2=0.99, eps=1e-6, weight_decay=0.1, optimizer="lamb")
    for t in range(1, 31):
        grads = layer(rng, sizes, "fp32", 2)[3]
        if t == 7:
            grads[1][500] = np.inf
        tw.step(grads, lamb_scalars(hyper, t, divisor=2.0), "bf16", f"step {t}", expect_finite=t != 7,
                n_decay=starts[3])


# --------------------------------------------------------------------------
# the kernels called directly
# --------------------------------------------------------------------------


def _buf(be, a):
    cl = be._cl
    return cl.Buffer(be.context, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR,
                     hostbuf=np.ascontiguousarray(a).view(np.uint8).reshape(-1))


def _read(be, buf, like):
    out = np.empty_like(like)
    be._cl.enqueue_copy(be.queue, out.view(np.uint8).reshape(-1), buf, is_blocking=True)
    return out


def _norms(be, gr, state, seg, sums, flag, n, k, n_decay, s):
    """eps_lamb_norms_<g> on these host arrays (copied in and, state and sums, back)."""
    bufs = [_buf(be, a) for a in (gr, *state, seg, sums, flag)]
    be._launch(f"eps_lamb_norms_{SUFFIX[numerics_name(gr.dtype)]}", n, *bufs, np.uint32(n), np.uint32(k),
               np.uint32(n_decay), np.uint32(seg.shape[0] - 1), *s.as_tuple(), segments=seg.shape[0] - 1)
    for i, a in enumerate(state):
        a[...] = _read(be, bufs[1 + i], a)
    sums[...] = _read(be, bufs[5], sums)


def _apply(be, state, copy, seg, steps, flag, n, n_decay, s):
    """eps_lamb_step_<c> on these host arrays (copied in, state and copy back)."""
    bufs = [_buf(be, a) for a in (*state, copy, seg, steps, flag)]
    be._launch(f"eps_lamb_step_{SUFFIX[numerics_name(copy.dtype)]}", n, *bufs, np.uint32(n), np.uint32(n_decay),
               np.uint32(seg.shape[0] - 1), *s.as_tuple())
    for i, a in enumerate(state):
        a[...] = _read(be, bufs[i], a)
    copy[...] = _read(be, bufs[3], copy)


def numerics_name(dtype) -> str:
    return next(k for k, d in COPY_DTYPES.items() if d == dtype)


@pytest.mark.parametrize("K", [1, 2, 3])
@pytest.mark.parametrize("gdtype", DTYPES)
def test_kernels_match_lamb_norms_and_lamb_apply(shaped, gdtype, K):
    """eps_lamb_norms_<g>: the sums (every lane of every segment), m' and v' against
    numerics.lamb_norms on the reduced gradient, p untouched; then eps_lamb_step_<c> for every
    copy dtype from those sums' step sizes against numerics.lamb_apply; every launch shape."""
    rng = np.random.default_rng([1930, DTYPES.index(gdtype), K, shaped.vector_width])
    p, m, v, grads, starts = layer(rng, BIG_SIZES, gdtype, K, BIG_KINDS)
    n = BIG_N
    seg = numerics.lamb_segments(starts, n)
    n_decay = starts[4] + 5  # inside a tensor
    s = lamb_scalars(HYPER, 2, divisor=float(K))
    g = np.empty(n, np.float32)
    assert numerics.reduce_gradients(grads, s.inv_scale, g)
    want = [a.copy() for a in (p, m, v)]
    want_sums = numerics.lamb_norms(*want, g, s, seg, n_decay=n_decay)
    gr = np.ascontiguousarray(np.stack(grads))
    state, sums, flag = [a.copy() for a in (p, m, v)], _sums_sentinel(seg.count), np.ones(1, np.int32)
    bounds = seg.bounds.astype(np.uint32)
    _norms(shaped, gr, state, bounds, sums, flag, n, K, n_decay, s)
    assert_same(sums, want_sums.reshape(-1), f"{gdtype} K={K}: sums")
    for name, a, b in zip("pmv", state, want):
        assert_same(a, b, f"{gdtype} K={K}: {name} after the norm pass")
    assert_same(state[0], p, "the norm pass wrote p")
    assert np.isfinite(want_sums).all() and (want_sums[seg.tensor == 1, 0] == 0).all()  # the zeros tensor
    steps = numerics.lamb_steps(want_sums, seg, s, n_decay)
    assert steps[seg.tensor == 1][0] == np.float32(-HYPER.lr) and len(set(steps.tolist())) > 3
    for cdtype in DTYPES:
        ref, got = [a.copy() for a in want], [a.copy() for a in want]
        c_ref, c_got = sentinel(n, cdtype), sentinel(n, cdtype)
        numerics.lamb_apply(*ref, s, seg, steps, copy_out=c_ref, n_decay=n_decay)
        _apply(shaped, got, c_got, bounds, steps, np.ones(1, np.int32), n, n_decay, s)
        for name, a, b in zip("pmv", got, ref):
            assert_same(a, b, f"{gdtype} K={K} -> {cdtype}: {name} after the step pass")
        assert_same(c_got, c_ref, f"{gdtype} K={K} -> {cdtype}: copy")


def test_lane_sums_are_one_rounded_addition_each_in_index_order(shaped):
    """Segments of values chosen so that the order of additions shows (1, then values lost
    against it one at a time), starting mid-vector (after 5 elements, after 5 + 16*40 + 9):
    lane j takes the segment's elements j, j+16, ... counted from its own first element,
    rows then the tail. Against the contract written out as a loop, and unlike the same
    values summed in reverse."""
    sizes = [5, 16 * 40 + 9, 16 * 3 + 11]
    n = sum(sizes)
    starts = _starts(sizes)
    rng = np.random.default_rng([1931, shaped.vector_width])
    p = np.zeros(n, np.float32)
    for i in range(n):
        p[i] = np.float32(1.0) if (i - 5) % 37 == 0 else np.float32(2.0 ** -12 * (1 + rng.integers(0, 8) / 8))
    m, v, g = np.zeros(n, np.float32), np.zeros(n, np.float32), np.zeros((1, n), np.float32)
    s = lamb_scalars(NO_DECAY)
    seg = numerics.lamb_segments(starts, n)
    want = np.zeros((seg.count, 2, LANES), np.float32)
    shuffled = np.zeros((seg.count, LANES), np.float32)
    for k in range(seg.count):
        lo, hi = int(seg.bounds[k]), int(seg.bounds[k + 1])
        for i in range(lo, hi):
            want[k, 0, (i - lo) % LANES] += np.float32(p[i] * p[i])
        for i in reversed(range(lo, hi)):
            shuffled[k, (i - lo) % LANES] += np.float32(p[i] * p[i])
    assert want.dtype == np.float32 and not np.array_equal(shuffled.view(np.uint32), want[:, 0].view(np.uint32))
    sums, flag = _sums_sentinel(seg.count), np.ones(1, np.int32)
    _norms(shaped, g, [p.copy(), m, v], seg.bounds.astype(np.uint32), sums, flag, n, 1, n, s)
    got = sums.reshape(seg.count, 2, LANES)
    assert_same(got[:, 0].reshape(-1), want[:, 0].reshape(-1), "p*p lanes")
    assert (got[:, 1] == 0).all()  # g = m = v = 0: u2 = 0 / eps = 0


def test_kernels_write_nothing_when_flag_clear(shaped):
    rng = np.random.default_rng(1932)
    p, m, v, grads, starts = layer(rng, [5, 1100], "fp32", 2)
    n = p.shape[0]
    bounds = numerics.lamb_segments(starts, n).bounds.astype(np.uint32)
    s = lamb_scalars()
    gr = np.ascontiguousarray(np.stack(grads))
    for g, c in zip(DTYPES, ["bf16", "fp16", "fp32"]):
        state = [a.copy() for a in (p, m, v)]
        sums = _sums_sentinel(bounds.shape[0] - 1)
        _norms(shaped, gr.astype(GRAD_DTYPES[g]), state, bounds, sums, np.zeros(1, np.int32), n, 2, n, s)
        copy = sentinel(n, c)
        _apply(shaped, state, copy, bounds, np.full(bounds.shape[0] - 1, -1.0, np.float32), np.zeros(1, np.int32),
               n, n, s)
        for a, b, name in zip(state, (p, m, v), "pmv"):
            assert_same(a, b, f"{g}->{c}: {name} written with the flag clear")
        assert_same(sums, _sums_sentinel(bounds.shape[0] - 1), f"{g}: sums written with the flag clear")
        assert_same(copy, sentinel(n, c), f"{g}->{c}: copy written with the flag clear")


def test_decay_boundary_past_n_acts_as_n(backend):
    rng = np.random.default_rng(1933)
    p, m, v, grads, starts = layer(rng, [7, 300, 9], "fp32", 1)
    n = p.shape[0]
    bounds = numerics.lamb_segments(starts, n).bounds.astype(np.uint32)
    s = lamb_scalars(HYPERS[2])
    out = []
    for n_decay in (n, n + 1, 2 * numerics.BLOCK, (1 << 32) - 1):
        state, sums, copy = [a.copy() for a in (p, m, v)], _sums_sentinel(bounds.shape[0] - 1), sentinel(n, "bf16")
        _norms(backend, grads[0], state, bounds, sums, np.ones(1, np.int32), n, 1, n_decay, s)
        steps = np.linspace(-1e-3, -2e-3, bounds.shape[0] - 1).astype(np.float32)
        _apply(backend, state, copy, bounds, steps, np.ones(1, np.int32), n, n_decay, s)
        out.append((n_decay, state, sums, copy))
    for n_decay, state, sums, copy in out[1:]:
        for a, b, name in zip(state, out[0][1], "pmv"):
            assert_same(a, b, f"n_decay={n_decay}: {name}")
        assert_same(sums, out[0][2], f"n_decay={n_decay}: sums")
        assert_same(copy, out[0][3], f"n_decay={n_decay}: copy")


def test_an_empty_segment_gets_zero_sums(shaped):
    """Bounds with an empty segment (the host's segments have none; the kernels' contract
    allows non-decreasing bounds): its sums are +0, the others the golden model's."""
    rng = np.random.default_rng(1934)
    p, m, v, grads, _ = layer(rng, [40, 60], "fp32", 1)
    n = p.shape[0]
    seg = numerics.Segments(np.array([0, 40, 40, 100], np.int64), np.array([0, 1, 1]), np.array([0, 40]))
    s = lamb_scalars()
    want = [a.copy() for a in (p, m, v)]
    want_sums = numerics.lamb_norms(*want, grads[0], s, seg)
    state, sums = [a.copy() for a in (p, m, v)], _sums_sentinel(3)
    _norms(shaped, grads[0], state, seg.bounds.astype(np.uint32), sums, np.ones(1, np.int32), n, 1, n, s)
    assert_same(sums, want_sums.reshape(-1), "sums")
    assert (want_sums[1] == 0).all() and not np.signbit(want_sums[1]).any()


# --------------------------------------------------------------------------
# the master as the copy, segments, refused steps, programs from a binary
# --------------------------------------------------------------------------


def test_the_master_serves_as_the_fp32_copy_bit_for_bit():
    """On a CPU device p is a host array, handed out by master_as_copy: LAMB steps writing the
    copy into it (one non-finite among them) and into separate copies between them match the
    golden model with its own master as copy; the step kernel gets p's own buffer as its copy."""
    rng = np.random.default_rng(1935)
    sizes = [16 * 300 + 5, 3, 1000, 77]
    n, starts = sum(sizes), _starts(sizes)
    be, ref = OpenCLBackend(min_chunk=12), NumpyBackend(threads=1)
    try:
        assert be._zero_copy
        p0 = rng.standard_normal(n).astype(np.float32)
        be.allocate(0, p0)
        ref.allocate(0, p0)
        mine, golden = be.master_as_copy(0), ref.master_as_copy(0)
        separate = itertools.cycle([None, "bf16", "fp16", "fp32"])
        for t in range(1, 10):
            grads = (rng.standard_normal((2, n)) * 1e-2).astype(np.float32)
            if t == 4:
                grads[1, n // 2] = np.nan
            step = numerics.as_step(lamb_scalars(HYPER, t, divisor=2.0), n, starts[2], starts)
            cdtype = next(separate)
            a, b = (mine, golden) if cdtype is None else (np.zeros(n, COPY_DTYPES[cdtype]) for _ in range(2))
            assert be.step(0, grads, step, a, n_decay=starts[2]) is ref.step(0, grads, step, b, n_decay=starts[2]) \
                is (t != 4)
            assert_same(a, b, f"step {t}: copy {cdtype or 'the master'}")
            for name, x, y in zip("pmv", be.state_view(0), ref.state_view(0)):
                assert_same(x, y, f"step {t}: {name}")
        args = be._last_args["eps_lamb_step_f32"]
        assert args[0] is args[3] is be._state[0][0]
    finally:
        be.close()


def test_segments_cached_per_layer_and_renewed_when_they_change(backend):
    """The segment bounds go to the device once per layer: the same buffer serves later steps;
    a step over other tensor starts uploads its own (and the bits follow them)."""
    rng = np.random.default_rng(1936)
    sizes = [100, 900, 37]
    p, m, v, grads, starts = layer(rng, sizes, "fp32", 1)
    tw = LambTwin(backend, p, m, v, starts)
    tw.step(grads, lamb_scalars(HYPER, 1), "fp32", "first", expect_finite=True)
    first = backend._segments[tw.layer][1]
    tw.step(grads, lamb_scalars(HYPER, 2), "fp32", "same segments", expect_finite=True)
    assert backend._segments[tw.layer][1] is first
    tw.starts = (0, 500, 1000)
    tw.step(grads, lamb_scalars(HYPER, 3), "fp32", "other segments", expect_finite=True)
    assert backend._segments[tw.layer][1] is not first
    backend.release(tw.layer)
    assert tw.layer not in backend._segments


def test_refused_lamb_steps_change_nothing(backend):
    """A LAMB step on Lion's state, segments that do not cover the layer, or a Lion step on a
    LAMB layer: ValueError before any kernel runs; nothing changes."""
    rng = np.random.default_rng(1937)
    p, m, v, grads, starts = layer(rng, [40, 60], "fp32", 1)
    n = p.shape[0]
    lion_layer, lamb_layer = new_layer(), new_layer()
    backend.allocate(lion_layer, p, moments=1)
    backend.allocate(lamb_layer, p)
    backend.write_state(lamb_layer, p, m, v)
    s = lamb_scalars()
    copy = sentinel(n, "fp32")
    with pytest.raises(ValueError, match="lamb step on a layer with 1 moments"):
        backend.step(lion_layer, grads, numerics.as_step(s, n, None, starts), copy)
    with pytest.raises(ValueError, match="lion step on a layer with 2 moments"):
        backend.step(lamb_layer, grads, LionScalars.compute(OptimizerHyper(optimizer="lion"), 1), copy)
    good = numerics.lamb_segments(starts, n)
    bad = [numerics.Segments(np.array([0, 40], np.int64), np.array([0]), good.tensor_starts),
           numerics.Segments(np.array([0, 60, 40, 100], np.int64), np.array([0, 1, 1]), good.tensor_starts),
           numerics.Segments(np.array([5, 40, 100], np.int64), good.tensor, good.tensor_starts)]
    for seg in bad:
        with pytest.raises(ValueError, match="LAMB segments"):
            backend.step(lamb_layer, grads, LambStep(s, seg, lambda sums: np.zeros(seg.count, np.float32)), copy)
    for name, a, b in zip("pmv", backend.read_state(lamb_layer), (p, m, v)):
        assert_same(a, b, f"{name} changed by a refused step")
    assert_same(copy, sentinel(n, "fp32"), "copy written by a refused step")


def test_program_binary_round_trip(tmp_path):
    """program_binary() loaded with binary=: LAMB's bits too, every dtype pair, a non-finite step."""
    path = tmp_path / "eps.bin"
    built = OpenCLBackend()
    path.write_bytes(built.program_binary())
    built.close()
    loaded = OpenCLBackend(binary=str(path))
    try:
        rng = np.random.default_rng(1938)
        for (gdtype, cdtype), K in zip(itertools.product(DTYPES, DTYPES), itertools.cycle([1, 2, 3])):
            p, m, v, _, starts = layer(rng, SMALL_SIZES, gdtype, K, SMALL_KINDS)
            tw = LambTwin(loaded, p, m, v, starts)
            for t in range(1, 4):
                grads = layer(rng, SMALL_SIZES, gdtype, K, SMALL_KINDS)[3]
                if t == 2:
                    grads[0][len(p) // 2] = np.nan
                tw.step(grads, lamb_scalars(HYPER, t, divisor=float(K)), cdtype,
                        f"binary: {gdtype} K={K} ->{cdtype} t={t}", expect_finite=t != 2, n_decay=starts[3])
    finally:
        loaded.close()


def test_a_binary_built_before_lamb_still_runs_adamw(tmp_path):
    """A program without the eps_lamb kernels (a binary built before LAMB) loads and runs
    AdamW; a LAMB step on it is one UserError naming the kernel, before anything is written."""
    import pyopencl as cl
    src = kernel_source()
    old = re.sub(r"^EPS_LAMB_(NORMS|STEP)\(.*\)$", "", src, flags=re.M)
    assert old != src
    built = OpenCLBackend(vector_width=BINARY_VECTOR)
    program = cl.Program(built.context, old).build(options=BUILD_OPTIONS + [f"-DVW={BINARY_VECTOR}"])
    path = tmp_path / "old.bin"
    path.write_bytes(program.get_info(cl.program_info.BINARIES)[0])
    built.close()
    be = OpenCLBackend(binary=str(path))
    try:
        assert not any(name.startswith("eps_lamb_") for name in be._kernels)
        rng = np.random.default_rng(1939)
        n = 3001
        p = rng.standard_normal(n).astype(np.float32)
        ref = NumpyBackend(threads=1)
        for b in (be, ref):
            b.allocate(0, p)
        g = [(rng.standard_normal(n) * 1e-2).astype(np.float32)]
        a, b = np.empty(n, np.float32), np.empty(n, np.float32)
        s = StepScalars.compute(OptimizerHyper(), 1)
        assert be.step(0, g, s, a) and ref.step(0, g, s, b)
        assert_same(a, b, "AdamW on a program without LAMB")
        be.allocate(1, p)
        copy = sentinel(n, "bf16")
        with pytest.raises(UserError, match="no kernel eps_lamb_norms_f32"):
            be.step(1, g, numerics.as_step(lamb_scalars(), n), copy)
        assert_same(copy, sentinel(n, "bf16"), "copy written by the refused LAMB step")
        for name, x, y in zip("pmv", be.read_state(1), (p, np.zeros(n, np.float32), np.zeros(n, np.float32))):
            assert_same(x, y, f"{name} written by the refused LAMB step")
    finally:
        be.close()


# --------------------------------------------------------------------------
# the server, the command line
# --------------------------------------------------------------------------


@pytest.mark.parametrize("grad_dtype, copy_dtype, contributors, share",
                         [("fp32", "bf16", 1, False), ("bf16", "bf16", 2, False), ("fp16", "bf16", 3, False),
                          ("fp32", "fp32", 2, True)])
def test_server_matches_numpy(grad_dtype, copy_dtype, contributors, share):
    """EagerParamServer(..., OptimizerHyper(optimizer="lamb")): layers of several tensors
    (``add_layer(..., tensor_starts=)``, one across the block boundary, an all-zeros one) with
    decay boundaries at tensor starts, one non-finite step on one layer, a checkpoint loaded
    into both, more steps: copies, step counts, history and state agree. With share_masters
    the OpenCL EPS's masters are the fp32 copies."""
    rng = np.random.default_rng([1940, DTYPES.index(grad_dtype), contributors])
    shapes = [([1], 1), ([1, 16, 40, 200], 1 + 16 + 40), (BIG_SIZES, sum(BIG_SIZES[:4])), ([10, 30], 0)]
    layers = [new_layer() for _ in shapes]
    loss_scale = 1024.0 if grad_dtype == "fp16" else 1.0
    kw = {"copy_dtype": copy_dtype, "grad_dtype": grad_dtype, "contributors": contributors, "share_masters": share}
    ref = EagerParamServer(NumpyBackend(threads=1), HYPER, **kw)
    got = EagerParamServer(OpenCLBackend(min_chunk=OPENCL_CHUNK), HYPER, **kw)
    sizes = [sum(sz) for sz, _ in shapes]
    decays = [d for _, d in shapes]

    def agree(what):
        ref.synchronize()
        got.synchronize()
        for layer_id in layers:
            assert got.step_count(layer_id) == ref.step_count(layer_id), (what, layer_id)
            assert_same(got.fetch(layer_id), ref.fetch(layer_id), f"{what}: layer {layer_id} device copy")
        tr, tg = ref.state_tensors(), got.state_tensors()
        assert tr.keys() == tg.keys() and any(k.endswith(".v") for k in tr), sorted(tr)
        for k in tr:
            assert_same(tg[k], tr[k], f"{what}: {k}")
        assert got.state_meta() == ref.state_meta()

    def one_step(step, bad_layer=None):
        for layer_id, n in zip(layers, sizes):
            for k in range(contributors):
                g = (rng.standard_normal(n) * 10.0 ** rng.uniform(-5, 0)).astype(GRAD_DTYPES[grad_dtype])
                if layer_id == bad_layer and k == contributors - 1:
                    g[n // 2] = np.nan
                for srv in (ref, got):
                    srv.gradient_inbox(layer_id, k)[:] = g
            for srv in (ref, got):
                for k in range(contributors):
                    srv.push_gradient(layer_id, k, divisor=float(contributors), loss_scale=loss_scale)
        agree(f"step {step}")

    try:
        for layer_id, (tensor_sizes, _), d in zip(layers, shapes, decays):
            p, _, _, _, starts = layer(rng, tensor_sizes, "fp32", 1,
                                       ["zeros" if size == 997 else "ordinary" for size in tensor_sizes])
            for srv in (ref, got):
                srv.add_layer(layer_id, p, n_decay=d, tensor_starts=starts)
        if share:
            assert got.copy_bytes == 0 and all(got.fetch(x) is got.backend.master_as_copy(x) for x in layers)
        agree("after add_layer")
        for step in range(1, 5):
            one_step(step, bad_layer=layers[2] if step == 3 else None)
        assert got.step_count(layers[2]) == 3 and got.step_count(layers[0]) == 4
        assert got.history == ref.history
        tensors = {}
        meta = {"optimizer": "lamb", "steps": {}, "n_decay": {str(lay): d for lay, d in zip(layers, decays)}}
        for layer_id, (tensor_sizes, _) in zip(layers, shapes):
            p, m, v, _, _ = layer(rng, tensor_sizes, "fp32", 1)
            tensors[f"layer{layer_id}.p"], tensors[f"layer{layer_id}.m"], tensors[f"layer{layer_id}.v"] = p, m, v
            meta["steps"][str(layer_id)] = int(rng.integers(1, 100))
        for srv in (ref, got):
            srv.load_state(tensors, meta)
        agree("after load_state")
        for step in range(5, 8):
            one_step(step)
        assert got.history == ref.history
    finally:
        ref.close()
        got.close()


TINY = ["--layers", "2", "--d-model", "32", "--heads", "2", "--seq-len", "32", "--batch-size", "8",
        "--micro-batches", "2", "--eval-batches", "1", "--no-progress", "--eval-every", "0", "--no-plot",
        "--plan", "off", "--steps", "5", "--optimizer", "lamb", "--lr", "3e-3", "--weight-decay", "0.1"]


def test_train_with_lamb_on_opencl_is_the_numpy_run(tmp_path):
    """``l2l train --eps opencl --optimizer lamb`` gives the NumPy EPS's losses and final
    checkpoint, bit for bit (p, m and v)."""
    runs = {}
    for eps in ("numpy", "opencl"):
        out = tmp_path / eps
        r = run_cli("train", *TINY, "--eps", eps, "--out", str(out))
        assert r.returncode == 0, r.stderr[-3000:]
        runs[eps] = out
    losses = {eps: [x["loss"] for x in read_metrics(out / "metrics.jsonl")] for eps, out in runs.items()}
    assert len(losses["numpy"]) == 5 and losses["opencl"] == losses["numpy"], losses
    want, got = load_latest(runs["numpy"]).tensors, load_latest(runs["opencl"]).tensors
    assert want.keys() == got.keys() and any(k.endswith(".v") for k in got)
    for k in want:
        assert np.array_equal(np.asarray(want[k]).view(np.uint8), np.asarray(got[k]).view(np.uint8)), k
