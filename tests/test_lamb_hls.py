"""LAMB in the HLS C++ EPS (hls/eps_kernels.cpp, ``eps_lamb_norms_<g>`` then the host's fold then
``eps_lamb_step_<c>``, C-simulated by ``--eps hls-csim``) against the NumPy golden model, bit for
bit (NaN == NaN): p, m, v, the finite flag, the device copy and the 16-lane partial sums the
norm pass hands to the fold; the kernels called directly (the sums against
``numerics.lamb_norms``), through the EagerParamServer and from the command line. Also what only
the LAMB kernels add: their interface (the argument order, the ctypes types, eps.cl's once it
has them), their links in hls/u280.cfg and hls/u50.cfg and ``make -C hls KERNELS=lamb``.

The golden model itself is checked against the contract in tests/test_lamb.py; the directives of
every kernel, these included, in tests/test_hls_pragmas.py.
"""
from __future__ import annotations

import itertools
import re
import shutil
import subprocess
import zlib

import numpy as np
import pytest

from l2l.checkpoint import load_latest
from l2l.eps import EagerParamServer, HlsCsimBackend, NumpyBackend, OptimizerHyper, numerics
from l2l.eps import hls_csim_backend as hcb
from l2l.eps.contract import LambScalars, LambStep, step_scalars
from l2l.eps.numerics import GRAD_DTYPES, LANES
from l2l.metrics import read_metrics

from conftest import ROOT, run_cli
from eps_oracle import grad_array, nonfinite_cases, nonfinite_grads, wide_f32, wide_grad_bits
from eps_twin import DTYPES, HLS_BLOCK, HLS_TILE, assert_same, new_layer, sentinel
from test_lion_hls import _hls_params, _params

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

HYPER = OptimizerHyper(lr=2e-3, beta1=0.9, beta2=0.99, eps=1e-6, weight_decay=0.05, optimizer="lamb")
HYPERS = [HYPER, OptimizerHyper(optimizer="lamb"),
          OptimizerHyper(lr=1e-2, beta1=0.8, beta2=0.95, eps=1e-8, weight_decay=1.0, optimizer="lamb")]
NO_DECAY = OptimizerHyper(lr=2e-3, beta1=0.9, beta2=0.99, eps=1e-6, weight_decay=0.0, optimizer="lamb")
BIG_N = 70_000  # a tensor across the block boundary at 65536 (eps::BLOCK == shards.BLOCK)
assert HLS_BLOCK == numerics.BLOCK < BIG_N < 2 * HLS_BLOCK


@pytest.fixture(scope="module")
def hls():
    return HlsCsimBackend()


def lamb_scalars(hyper=HYPER, t=1, **kw) -> LambScalars:
    s = step_scalars(hyper, t, **kw)
    assert isinstance(s, LambScalars)
    return s


def with_inv_scale(s: LambScalars, inv_scale) -> LambScalars:
    return LambScalars(**{**dict(zip(s.names(), s.as_tuple())), "inv_scale": np.float32(inv_scale),
                          "lr": s.lr, "adapt": s.adapt})


def _recording(step: LambStep, into: list) -> LambStep:
    """``step`` whose fold also keeps a copy of the sums it was handed."""
    def steps(sums):
        into.append(np.array(sums, copy=True))
        return step.steps(sums)
    return LambStep(step.scalars, step.segments, steps)


class LambTwin:
    """One LAMB layer, ``(p, m, v)`` over tensors starting at ``starts``, in a one-thread
    NumpyBackend and in the HLS backend, stepped in lockstep; every step compares p, m, v, the
    flag, the copy and the sums each backend handed to the host's fold, bit for bit."""

    def __init__(self, dut, p, m=None, v=None, starts=(0,)):
        self.ref, self.dut, self.layer, self.n = NumpyBackend(threads=1), dut, new_layer(), p.shape[0]
        self.starts = tuple(starts)
        for be in (self.ref, self.dut):
            be.allocate(self.layer, p, moments=2)
            if m is not None:
                be.write_state(self.layer, p, m, v)
        self.check_state("after allocate/write_state")

    def check_state(self, what, inputs=None):
        ref, got = self.ref.read_state(self.layer), self.dut.read_state(self.layer)
        assert len(ref) == len(got) == 3
        for name, r, g in zip("pmv", ref, got):
            assert_same(g, r, f"{what}: {name}", inputs)
        return ref

    def step(self, grads, s: LambScalars, cdtype: str, what: str, expect_finite=None, n_decay=None) -> bool:
        p, m, v = self.ref.read_state(self.layer)
        inputs = lambda: {"p": p, "m": m, "v": v, **{f"g{k}": g for k, g in enumerate(grads)},  # noqa: E731
                          **{k: float(x) for k, x in zip(s.names(), s.as_tuple())}, "n_decay": n_decay}
        kw = {} if n_decay is None else {"n_decay": n_decay}
        step = numerics.as_step(s, self.n, n_decay, self.starts)
        sums_ref, sums_dut = [], []
        c_ref, c_dut = sentinel(self.n, cdtype), sentinel(self.n, cdtype)
        f_ref = self.ref.step(self.layer, list(grads), _recording(step, sums_ref), c_ref, **kw)
        f_dut = self.dut.step(self.layer, list(grads), _recording(step, sums_dut), c_dut, **kw)
        assert f_dut is f_ref, f"{what}: finite flag hls {f_dut} vs NumPy {f_ref}"
        if expect_finite is not None:
            assert f_ref is expect_finite, f"{what}: vectors meant to give finite={expect_finite}"
        assert len(sums_dut) == len(sums_ref) == int(f_ref), f"{what}: the fold ran {len(sums_dut)} times"
        for a, b in zip(sums_dut, sums_ref):
            assert a.shape == b.shape == (step.segments.count, 2, LANES)
            assert_same(a.reshape(-1), b.reshape(-1), f"{what}: the norm pass's sums")
        self.check_state(what, inputs)
        assert_same(c_dut, c_ref, f"{what}: device copy {cdtype}", inputs)
        if not f_ref:
            assert_same(c_dut, sentinel(self.n, cdtype), f"{what}: copy written on a non-finite step")
            for name, a, b in zip("pmv", self.dut.read_state(self.layer), (p, m, v)):
                assert_same(a, b, f"{what}: {name} written on a non-finite step")
        return f_ref


# --------------------------------------------------------------------------
# vectors
# --------------------------------------------------------------------------


def _tensor_values(rng, size, gdtype, K, kind):
    """(p, m, v, K gradients) of one tensor: ``ordinary`` (normal values of a few scales: finite
    sums whose low bits follow the order of the additions), ``zeros`` (p all zeros of both signs:
    its trust ratio is 1) or ``wide`` (every binade, subnormals and zeros of both signs, small
    enough that the squares' sums stay finite)."""
    gt = GRAD_DTYPES[gdtype]
    if kind == "wide":
        p = wide_f32(rng, size, max_abs=1e15)
        m = wide_f32(rng, size, max_abs=1e8)
        v = wide_f32(rng, size, nonneg=True, max_abs=1e16)
        grads = [grad_array(wide_grad_bits(rng, size, gdtype, max_abs=1e8), gdtype) for _ in range(K)]
        return p, m, v, grads
    scale = 10.0 ** rng.integers(-3, 2)
    p = (rng.standard_normal(size) * scale * 10.0 ** rng.uniform(-1, 1, size)).astype(np.float32)
    if kind == "zeros":
        p = np.where(rng.random(size) < 0.5, np.float32(-0.0), np.float32(0.0)).astype(np.float32)
    m = (rng.standard_normal(size) * 1e-2).astype(np.float32)
    v = np.abs(rng.standard_normal(size) * 1e-3).astype(np.float32)
    grads = [(rng.standard_normal(size) * 10.0 ** rng.uniform(-4, 0, size)).astype(gt) for _ in range(K)]
    return p, m, v, grads


def layer(rng, sizes, gdtype="fp32", K=1, kinds=None):
    """A layer of tensors of ``sizes`` (in order; ``kinds`` per tensor, default ordinary): the
    concatenated (p, m, v, grads) and the tensors' starts."""
    kinds = kinds or ["ordinary"] * len(sizes)
    parts = [_tensor_values(rng, size, gdtype, K, kind) for size, kind in zip(sizes, kinds)]
    p, m, v = (np.concatenate([part[j] for part in parts]) for j in range(3))
    grads = [np.concatenate([part[3][k] for part in parts]) for k in range(K)]
    starts = list(np.cumsum([0, *sizes[:-1]]))
    return p, m, v, grads, starts


# several tensors: a 1-element one, 15 and 17 (less and more than one row of the 16 lanes), an
# all-zeros one (trust 1), a wide-valued one, one across a 1024-element tile
SMALL_SIZES = [1, 15, 17, 300, 200, HLS_TILE + 40, 33]
SMALL_KINDS = ["ordinary", "ordinary", "ordinary", "zeros", "wide", "ordinary", "ordinary"]
# a layer past one block: the fourth tensor crosses 65536 (two segments), the last is tiny
BIG_SIZES = [3, 997, 1000, 66_000, BIG_N - 68_000 - 1, 1]
BIG_KINDS = ["ordinary", "zeros", "wide", "ordinary", "ordinary", "ordinary"]
assert sum(BIG_SIZES) == BIG_N


def _segments_cross_the_block(starts, n):
    seg = numerics.lamb_segments(starts, n)
    assert HLS_BLOCK in seg.bounds and np.count_nonzero(seg.tensor == 3) == 2, seg
    return seg


# --------------------------------------------------------------------------
# the kernels against the golden model, through the backend
# --------------------------------------------------------------------------


@pytest.mark.parametrize("K", [1, 2, 3])
@pytest.mark.parametrize("gdtype, cdtype", list(itertools.product(DTYPES, DTYPES)))
def test_every_dtype_pair_and_contribution_count(hls, gdtype, cdtype, K):
    """Three steps on one layer of several tensors (state carried over): the first with
    inv_scale 1, then 1/K with a loss scale for fp16 gradients, other hyper-parameters; the
    decay boundary at a tensor start, then at n."""
    rng = np.random.default_rng([921, DTYPES.index(gdtype), DTYPES.index(cdtype), K])
    p, m, v, grads, starts = layer(rng, SMALL_SIZES, gdtype, K, SMALL_KINDS)
    n = p.shape[0]
    tw = LambTwin(hls, p, m, v, starts)
    tw.step(grads, lamb_scalars(), cdtype, f"{gdtype}->{cdtype} K={K} step 1", expect_finite=True,
            n_decay=starts[4])
    for t, hyper in ((2, HYPERS[1]), (3, HYPERS[2])):
        grads = layer(rng, SMALL_SIZES, gdtype, K, SMALL_KINDS)[3]
        s = lamb_scalars(hyper, t, loss_scale=1024.0 if gdtype == "fp16" else 1.0, divisor=float(K))
        tw.step(grads, s, cdtype, f"{gdtype}->{cdtype} K={K} step {t}", expect_finite=True,
                n_decay=n if t == 2 else None)


@pytest.mark.parametrize("gdtype, cdtype, K", [("fp32", "fp32", 1), ("bf16", "bf16", 2), ("fp16", "fp32", 3)])
def test_tensor_across_the_block_boundary(hls, gdtype, cdtype, K):
    """A layer of 70000 elements whose fourth tensor crosses 65536 (two segments of one tensor,
    their sums folded together on the host), an all-zeros and a wide-valued tensor among them."""
    rng = np.random.default_rng([922, DTYPES.index(gdtype), K])
    p, m, v, grads, starts = layer(rng, BIG_SIZES, gdtype, K, BIG_KINDS)
    _segments_cross_the_block(starts, BIG_N)
    tw = LambTwin(hls, p, m, v, starts)
    for t in (1, 2):
        s = lamb_scalars(HYPER, t, divisor=float(K))
        tw.step(grads, s, cdtype, f"{gdtype}->{cdtype} K={K} step {t}", expect_finite=True, n_decay=starts[4])
        grads = layer(rng, BIG_SIZES, gdtype, K, BIG_KINDS)[3]


def _decay_boundaries():
    starts = list(np.cumsum([0, *BIG_SIZES[:-1]]))
    return [0, 1, starts[1], starts[3], starts[4], HLS_BLOCK - 1, HLS_BLOCK, HLS_BLOCK + 1, BIG_N - 1, BIG_N]


@pytest.mark.parametrize("n_decay", _decay_boundaries())
def test_decay_boundary(hls, n_decay):
    """n_decay at 0, at tensor starts, at n, and inside tensors (inside a segment, and at the
    block boundary that cuts a tensor in two): the boundary is cut per segment. A tensor starting
    below n_decay is adapted; elements past it add no weight decay to their update."""
    rng = np.random.default_rng([923, n_decay])
    p, m, v, grads, starts = layer(rng, BIG_SIZES, "fp32", 2, BIG_KINDS)
    tw = LambTwin(hls, p, m, v, starts)
    tw.step(grads, lamb_scalars(HYPERS[2], 2, divisor=2.0), "bf16", f"n_decay={n_decay}", expect_finite=True,
            n_decay=n_decay)


@pytest.mark.parametrize("sizes", [[1], [15], [17], [16], [1, 15, 17], [15, 1, 1, 17, 2]])
def test_tiny_layers_and_tensors(hls, sizes):
    """Layers of tiny tensors only: fewer elements than lanes, exactly one row, one more."""
    rng = np.random.default_rng([924, len(sizes), sum(sizes)])
    p, m, v, grads, starts = layer(rng, sizes, "bf16", 2)
    tw = LambTwin(hls, p, m, v, starts)
    for t, n_decay in ((1, None), (2, starts[-1]), (3, 0)):
        grads = layer(rng, sizes, "bf16", 2)[3]
        tw.step(grads, lamb_scalars(HYPER, t, divisor=2.0), "fp16", f"{sizes} step {t}", expect_finite=True,
                n_decay=n_decay)


def test_no_weight_decay_adapts_no_tensor(hls):
    """weight_decay 0: no tensor takes its trust ratio (every step size is -lr), u2 = u."""
    rng = np.random.default_rng(925)
    p, m, v, grads, starts = layer(rng, SMALL_SIZES, "fp32", 1, SMALL_KINDS)
    s = lamb_scalars(NO_DECAY)
    assert not s.adapt and s.wd == 0
    seg = numerics.lamb_segments(starts, p.shape[0])
    steps = numerics.lamb_steps(numerics.lamb_norms(p.copy(), m.copy(), v.copy(), grads[0], s, seg), seg, s,
                                p.shape[0])
    assert np.all(steps == np.float32(-NO_DECAY.lr))
    tw = LambTwin(hls, p, m, v, starts)
    for t in (1, 2, 3):
        tw.step(grads, lamb_scalars(NO_DECAY, t), "bf16", f"weight_decay 0, step {t}", expect_finite=True)
        grads = layer(rng, SMALL_SIZES, "fp32", 1, SMALL_KINDS)[3]


def test_nonfinite_state_follows_the_golden_model(hls):
    """State the host loaded holding inf and NaN (a checkpoint's bits): NaN and inf squares in
    the sums, step sizes the fold makes of them, NaN p'."""
    rng = np.random.default_rng(926)
    p, m, v, grads, starts = layer(rng, SMALL_SIZES, "fp32", 1)
    special = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0], np.float32)
    for tensor in (1, 5):  # specials in two tensors; the others keep finite norms
        lo, hi = starts[tensor], starts[tensor + 1]
        p[lo:hi:3] = rng.choice(special, len(range(lo, hi, 3)))
        m[lo + 1:hi:3] = rng.choice(special, len(range(lo + 1, hi, 3)))
        v[lo + 2:hi:5] = rng.choice(special[[0, 2, 3]], len(range(lo + 2, hi, 5)))
    tw = LambTwin(hls, p, m, v, starts)
    tw.step(grads, lamb_scalars(), "bf16", "inf/NaN state", expect_finite=True)


@pytest.mark.parametrize("case, K, gdtype", list(nonfinite_cases()))
def test_nonfinite_gradient_changes_nothing(hls, case, K, gdtype):
    """Flag false, no fold, p, m, v and the copy untouched, wherever the bad element is: the
    first element, inside the second tile, the last element."""
    rng = np.random.default_rng([927, K, DTYPES.index(gdtype), zlib.crc32(case.encode())])
    p, m, v, _, starts = layer(rng, SMALL_SIZES, gdtype, K, SMALL_KINDS)
    n = p.shape[0]
    tw = LambTwin(hls, p, m, v, starts)
    for i in (0, HLS_TILE + 3, n - 1):
        grad_bits, adamw = nonfinite_grads(rng, n, case, K, gdtype, i)
        s = with_inv_scale(lamb_scalars(), adamw.inv_scale)
        tw.step([grad_array(b, gdtype) for b in grad_bits], s, "bf16", f"{case} K={K} {gdtype} at {i}",
                expect_finite=False)


def test_long_run_stays_bit_identical(hls):
    """Many steps on one state, a non-finite step among them: a one-ulp difference would grow."""
    rng = np.random.default_rng(928)
    sizes = [64, 1, 500, HLS_TILE + 7, 100]
    p, m, v, grads, starts = layer(rng, sizes, "fp32", 2)
    tw = LambTwin(hls, p, starts=starts)
    hyper = OptimizerHyper(lr=3e-3, beta1=0.9, beta2=0.99, eps=1e-6, weight_decay=0.1, optimizer="lamb")
    for t in range(1, 31):
        grads = layer(rng, sizes, "fp32", 2)[3]
        if t == 7:
            grads[1][500] = np.inf
        tw.step(grads, lamb_scalars(hyper, t, divisor=2.0), "bf16", f"step {t}", expect_finite=t != 7,
                n_decay=starts[3])


def test_optimizers_state_shape_and_segments_checked(hls):
    """hls-csim runs LAMB; a LAMB step on Lion's state, or with segments that do not cover the
    layer, is refused before any kernel runs: nothing changes."""
    assert HlsCsimBackend.optimizers == {"adamw", "lion", "lamb"}
    rng = np.random.default_rng(929)
    n = 100
    p, m, v, grads, starts = layer(rng, [40, 60], "fp32", 1)
    lion_layer, lamb_layer = new_layer(), new_layer()
    hls.allocate(lion_layer, p, moments=1)
    hls.allocate(lamb_layer, p)
    hls.write_state(lamb_layer, p, m, v)
    s = lamb_scalars()
    with pytest.raises(ValueError, match="lamb step on a layer with 1 moments"):
        hls.step(lion_layer, grads, numerics.as_step(s, n, None, starts), np.empty(n, np.float32))
    good = numerics.lamb_segments(starts, n)
    bad = [numerics.Segments(np.array([0, 40], np.int64), np.array([0]), good.tensor_starts),  # stops short
           numerics.Segments(np.array([0, 60, 40, 100], np.int64), np.array([0, 1, 1]), good.tensor_starts),
           numerics.Segments(np.array([5, 40, 100], np.int64), good.tensor, good.tensor_starts)]
    for seg in bad:
        copy = sentinel(n, "fp32")
        with pytest.raises(ValueError, match="LAMB segments"):
            hls.step(lamb_layer, grads, LambStep(s, seg, lambda sums: np.zeros(seg.count, np.float32)), copy)
        for name, a, b in zip("pmv", hls.read_state(lamb_layer), (p, m, v)):
            assert_same(a, b, f"{name} changed by a refused step")
        assert_same(copy, sentinel(n, "fp32"), "copy written by a refused step")


# --------------------------------------------------------------------------
# the kernels called directly: the sums against numerics.lamb_norms
# --------------------------------------------------------------------------


def _norms(hls, gr, state, seg, sums, flag, n, k, n_decay, s):
    g = hcb.GRAD_SUFFIX[gr.dtype]
    getattr(hls.lib, f"eps_lamb_norms_{g}")(gr.ctypes.data, *(a.ctypes.data for a in state), seg.ctypes.data,
                                            sums.ctypes.data, flag.ctypes.data, n, k, n_decay, seg.shape[0] - 1,
                                            *s.as_tuple())


def _apply(hls, state, copy, seg, steps, flag, n, n_decay, s):
    c = hcb.SUFFIX[copy.dtype]
    getattr(hls.lib, f"eps_lamb_step_{c}")(*(a.ctypes.data for a in state), copy.ctypes.data, seg.ctypes.data,
                                           steps.ctypes.data, flag.ctypes.data, n, n_decay, seg.shape[0] - 1,
                                           *s.as_tuple())


def _sums_sentinel(nseg):
    out = np.empty(nseg * 2 * LANES, np.float32)
    out.view(np.uint32)[:] = 0x7FA5A5A5  # a NaN no kernel writes: a lane left unwritten shows
    return out


@pytest.mark.parametrize("K", [1, 2, 3])
@pytest.mark.parametrize("gdtype", DTYPES)
def test_kernels_match_lamb_norms_and_lamb_apply(hls, gdtype, K):
    """eps_lamb_norms_<g>: the sums (every lane of every segment), m' and v' against
    numerics.lamb_norms on the reduced gradient, p untouched; then eps_lamb_step_<c> for every
    copy dtype from those sums' step sizes against numerics.lamb_apply."""
    rng = np.random.default_rng([930, DTYPES.index(gdtype), K])
    p, m, v, grads, starts = layer(rng, BIG_SIZES, gdtype, K, BIG_KINDS)
    n = BIG_N
    seg = _segments_cross_the_block(starts, n)
    n_decay = starts[4] + 5  # inside a tensor
    s = lamb_scalars(HYPER, 2, divisor=float(K))
    g = np.empty(n, np.float32)
    assert numerics.reduce_gradients(grads, s.inv_scale, g)
    want = [a.copy() for a in (p, m, v)]
    want_sums = numerics.lamb_norms(*want, g, s, seg, n_decay=n_decay)
    gr = np.ascontiguousarray(np.stack(grads))
    state, sums, flag = [a.copy() for a in (p, m, v)], _sums_sentinel(seg.count), np.ones(1, np.int32)
    bounds = seg.bounds.astype(np.uint32)
    _norms(hls, gr, state, bounds, sums, flag, n, K, n_decay, s)
    assert flag[0] == 1
    assert_same(sums, want_sums.reshape(-1), f"{gdtype} K={K}: sums")
    for name, a, b in zip("pmv", state, want):
        assert_same(a, b, f"{gdtype} K={K}: {name} after the norm pass")
    assert_same(state[0], p, "the norm pass wrote p")
    assert np.isfinite(want_sums).all() and (want_sums[seg.tensor == 1, 0] == 0).all()  # the zeros tensor: |p| = 0
    steps = numerics.lamb_steps(want_sums, seg, s, n_decay)
    assert steps[seg.tensor == 1][0] == np.float32(-HYPER.lr) and len(set(steps.tolist())) > 3
    for cdtype in DTYPES:
        ref, got = [a.copy() for a in want], [a.copy() for a in want]
        c_ref, c_got = sentinel(n, cdtype), sentinel(n, cdtype)
        numerics.lamb_apply(*ref, s, seg, steps, copy_out=c_ref, n_decay=n_decay)
        _apply(hls, got, c_got, bounds, steps, np.ones(1, np.int32), n, n_decay, s)
        for name, a, b in zip("pmv", got, ref):
            assert_same(a, b, f"{gdtype} K={K} -> {cdtype}: {name} after the step pass")
        assert_same(c_got, c_ref, f"{gdtype} K={K} -> {cdtype}: copy")


def test_lane_sums_are_one_rounded_addition_each_in_index_order(hls):
    """One segment of values chosen so that the order of additions shows: lane j's elements
    j, j+16, ... are 1, then 2**-24 (lost against 1 one at a time), ...; a segment starting
    mid-row (after a 5-element tensor) counts its lanes from its own first element. Against
    the contract written out as a loop."""
    n = 5 + 16 * 40 + 9
    starts = [0, 5]
    g = np.zeros(n, np.float32)
    p = np.zeros(n, np.float32)
    rng = np.random.default_rng(931)
    for i in range(n):
        p[i] = np.float32(1.0) if (i - 5) % 37 == 0 else np.float32(2.0 ** -12 * (1 + rng.integers(0, 8) / 8))
    m, v = np.zeros(n, np.float32), np.zeros(n, np.float32)
    s = lamb_scalars(NO_DECAY)
    seg = numerics.lamb_segments(starts, n)
    want = np.zeros((seg.count, 2, LANES), np.float32)
    for k in range(seg.count):
        lo, hi = int(seg.bounds[k]), int(seg.bounds[k + 1])
        for i in range(lo, hi):
            j = (i - lo) % LANES
            want[k, 0, j] = np.float32(want[k, 0, j] + np.float32(p[i] * p[i]))
    sums, flag = _sums_sentinel(seg.count), np.ones(1, np.int32)
    state = [p.copy(), m.copy(), v.copy()]
    _norms(hls, g[None, :].copy(), state, seg.bounds.astype(np.uint32), sums, flag, n, 1, n, s)
    got = sums.reshape(seg.count, 2, LANES)
    assert_same(got[:, 0].reshape(-1), want[:, 0].reshape(-1), "p*p lanes")
    assert (got[:, 1] == 0).all()  # g = m = v = 0: u2 = 0 / eps = 0
    # the order shows: the sum of the same values in another order differs somewhere
    shuffled = np.zeros_like(want[:, 0])
    for k in range(seg.count):
        lo, hi = int(seg.bounds[k]), int(seg.bounds[k + 1])
        for i in reversed(range(lo, hi)):
            j = (i - lo) % LANES
            shuffled[k, j] = np.float32(shuffled[k, j] + np.float32(p[i] * p[i]))
    assert not np.array_equal(shuffled.view(np.uint32), want[:, 0].view(np.uint32))


def test_kernels_write_nothing_when_flag_clear(hls):
    rng = np.random.default_rng(932)
    p, m, v, grads, starts = layer(rng, [5, HLS_TILE + 5], "fp32", 2)
    n = p.shape[0]
    bounds = numerics.lamb_segments(starts, n).bounds.astype(np.uint32)
    s = lamb_scalars()
    gr = np.ascontiguousarray(np.stack(grads))
    for g, c in itertools.product(DTYPES, DTYPES):
        state = [a.copy() for a in (p, m, v)]
        sums = _sums_sentinel(bounds.shape[0] - 1)
        _norms(hls, gr.astype(GRAD_DTYPES[g]), state, bounds, sums, np.zeros(1, np.int32), n, 2, n, s)
        copy = sentinel(n, c)
        _apply(hls, state, copy, bounds, np.full(bounds.shape[0] - 1, -1.0, np.float32), np.zeros(1, np.int32), n,
               n, s)
        for a, b, name in zip(state, (p, m, v), "pmv"):
            assert_same(a, b, f"{g}->{c}: {name} written with the flag clear")
        assert_same(sums, _sums_sentinel(bounds.shape[0] - 1), f"{g}: sums written with the flag clear")
        assert_same(copy, sentinel(n, c), f"{g}->{c}: copy written with the flag clear")


def test_decay_boundary_past_n_acts_as_n(hls):
    rng = np.random.default_rng(933)
    p, m, v, grads, starts = layer(rng, [7, HLS_BLOCK - 7, 9], "fp32", 1)
    n = p.shape[0]
    bounds = numerics.lamb_segments(starts, n).bounds.astype(np.uint32)
    s = lamb_scalars(HYPERS[2])
    out = []
    for n_decay in (n, n + 1, 2 * HLS_BLOCK, (1 << 32) - 1):
        state, sums, copy = [a.copy() for a in (p, m, v)], _sums_sentinel(bounds.shape[0] - 1), sentinel(n, "bf16")
        _norms(hls, grads[0], state, bounds, sums, np.ones(1, np.int32), n, 1, n_decay, s)
        steps = np.linspace(-1e-3, -2e-3, bounds.shape[0] - 1).astype(np.float32)
        _apply(hls, state, copy, bounds, steps, np.ones(1, np.int32), n, n_decay, s)
        out.append((n_decay, state, sums, copy))
    for n_decay, state, sums, copy in out[1:]:
        for a, b, name in zip(state, out[0][1], "pmv"):
            assert_same(a, b, f"n_decay={n_decay}: {name}")
        assert_same(sums, out[0][2], f"n_decay={n_decay}: sums")
        assert_same(copy, out[0][3], f"n_decay={n_decay}: copy")


# --------------------------------------------------------------------------
# through the eager param-server
# --------------------------------------------------------------------------


@pytest.mark.parametrize("grad_dtype, contributors", [("fp32", 1), ("bf16", 2)])
def test_server_matches_numpy(grad_dtype, contributors):
    """EagerParamServer(..., OptimizerHyper(optimizer="lamb")) with bf16 copies: layers of several
    tensors (``add_layer(..., tensor_starts=)``, one across the block boundary, an all-zeros one)
    with decay boundaries at tensor starts, one non-finite step on one layer, a checkpoint loaded
    into both, more steps: copies, step counts, history and state agree."""
    rng = np.random.default_rng([934, contributors])
    # (tensor sizes, n_decay at a tensor start): one tensor; four tensors; the big layer (its
    # fourth tensor across the block, its second all zeros); nothing decayed
    shapes = [([1], 1), ([1, 16, 40, 200], 1 + 16 + 40), (BIG_SIZES, sum(BIG_SIZES[:4])), ([10, 30], 0)]
    layers = [new_layer() for _ in shapes]
    kw = {"copy_dtype": "bf16", "grad_dtype": grad_dtype, "contributors": contributors}
    ref = EagerParamServer(NumpyBackend(threads=1), HYPER, **kw)
    got = EagerParamServer(HlsCsimBackend(), HYPER, **kw)
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
                    srv.push_gradient(layer_id, k, divisor=float(contributors), loss_scale=1.0)
        agree(f"step {step}")

    try:
        for layer_id, (tensor_sizes, _), d in zip(layers, shapes, decays):
            p, _, _, _, starts = layer(rng, tensor_sizes, "fp32", 1,
                                       ["zeros" if size == 997 else "ordinary" for size in tensor_sizes])
            for srv in (ref, got):
                srv.add_layer(layer_id, p, n_decay=d, tensor_starts=starts)
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
        for step in range(5, 7):
            one_step(step)
        assert got.history == ref.history
    finally:
        ref.close()
        got.close()


# --------------------------------------------------------------------------
# from the command line
# --------------------------------------------------------------------------

TINY = ["--layers", "2", "--d-model", "32", "--heads", "2", "--seq-len", "32", "--batch-size", "8",
        "--micro-batches", "2", "--eval-batches", "1", "--no-progress", "--eval-every", "0", "--steps", "4",
        "--optimizer", "lamb", "--lr", "3e-3"]


@pytest.mark.heavy
def test_cli_hls_csim_lamb_run_is_the_numpy_run(tmp_path):
    """``l2l train --eps hls-csim --optimizer lamb`` is ``--eps numpy --optimizer lamb`` bit for
    bit: every loss and the final checkpoint's tensors (p, m and v)."""
    runs = {}
    for eps in ("numpy", "hls-csim"):
        out = tmp_path / eps
        r = run_cli("train", *TINY, "--eps", eps, "--out", str(out))
        assert r.returncode == 0, r.stderr
        runs[eps] = out
    losses = {eps: [x["loss"] for x in read_metrics(out / "metrics.jsonl")] for eps, out in runs.items()}
    assert len(losses["numpy"]) == 4 and losses["hls-csim"] == losses["numpy"], losses
    want, got = load_latest(runs["numpy"]).tensors, load_latest(runs["hls-csim"]).tensors
    assert want.keys() == got.keys()
    assert any(k.endswith(".v") for k in want), sorted(want)
    for k in want:
        assert want[k].dtype == got[k].dtype and np.array_equal(want[k].view(np.uint8), got[k].view(np.uint8)), k


# --------------------------------------------------------------------------
# the interface: argument order, ctypes types, the OpenCL twin, the links and the Makefile
# --------------------------------------------------------------------------

NORMS_ARGS = ["gr", "p", "m", "v", "seg", "sums", "finite", "n", "k", "n_decay", "nseg", *LambScalars.names()]
STEP_ARGS = ["p", "m", "v", "copy", "seg", "steps", "finite", "n", "n_decay", "nseg", *LambScalars.names()]
CL_SOURCE = ROOT / "fpga" / "opencl" / "eps.cl"


@pytest.mark.parametrize("macro, args, family", [("EPS_LAMB_NORMS", NORMS_ARGS, "eps_lamb_norms"),
                                                 ("EPS_LAMB_STEP", STEP_ARGS, "eps_lamb_step")])
def test_lamb_kernels_take_the_documented_order(macro, args, family):
    """Buffers, then n (k), n_decay, nseg, then the nine LambScalars in their order; one m_axi
    bundle per buffer numbered by position; every scalar on the s_axilite slave; a top function
    per dtype; the backend's ctypes types (pointer, 32-bit unsigned, float) match, one by one."""
    assert LambScalars.names() == ("b1", "omb1", "b2", "omb2", "inv_bc2_sqrt", "eps", "inv_bc1", "wd", "inv_scale")
    names, pointers, body = _hls_params(macro)
    assert names == args
    maxi = re.findall(r"EPS_MAXI\((\w+), (\w+)\)", body)
    assert maxi == [(port, f"gmem{i}") for i, port in enumerate(pointers)]
    assert re.findall(r"EPS_LITE\((\w+)\)", body) == [n for n in names if n not in pointers] + ["return"]
    assert {f"{family}_{x}" for x in hcb.KINDS} <= set(hcb.KERNEL_NAMES)
    found = re.search(rf'#define {macro}\([\w, ]+\)\s*\\?\s*extern "C" void [\w#]+\((.*?)\)\s*\{{',
                      hcb.kernel_source(), re.S)
    kinds = []
    for param in found.group(1).split(","):
        param = re.sub(r"[\s\\]+", " ", param)
        kinds.append(hcb._ptr if "*" in param else hcb._float if "float" in param else hcb._uint)
    assert hcb._ARGTYPES[family] == kinds
    assert hcb.kernel_family(f"{family}_bf16") == family


@pytest.mark.parametrize("macro", ["EPS_LAMB_NORMS", "EPS_LAMB_STEP"])
def test_lamb_parameters_match_the_opencl_kernels(macro):
    """The same parameter names and order as eps.cl's."""
    src = CL_SOURCE.read_text()
    found = re.search(rf"#define {macro}\([\w, ]+\)(.*?)\{{", src, re.S)
    assert found is not None, f"fpga/opencl/eps.cl defines no {macro}"
    body = found.group(1)
    assert _params(body[body.index("(") + 1:body.rindex(")")]) == _hls_params(macro)[0]


@pytest.mark.parametrize("card", ["u280", "u50"])
def test_link_config_places_the_lamb_buffers(card):
    """Each LAMB kernel's ports in the banks their roles have in eps_update (gr, p, m, v, copy),
    and seg, sums and steps with the flag (tests/test_lion_hls.py checks every kernel's lines)."""
    text = (ROOT / "hls" / f"{card}.cfg").read_text()
    sp = {(k, port): int(bank) for k, port, bank in re.findall(r"(?m)^sp=(\w+)_1\.(\w+):HBM\[(\d+)\]$", text)}
    update = {port: bank for (k, port), bank in sp.items() if k == "eps_update_f32_f32"}
    for g in hcb.KINDS:
        want = {**{port: update[port] for port in ("gr", "p", "m", "v", "finite")},
                "seg": update["finite"], "sums": update["finite"]}
        assert {port: bank for (k, port), bank in sp.items() if k == f"eps_lamb_norms_{g}"} == want
        want = {**{port: update[port] for port in ("p", "m", "v", "copy", "finite")},
                "seg": update["finite"], "steps": update["finite"]}
        assert {port: bank for (k, port), bank in sp.items() if k == f"eps_lamb_step_{g}"} == want


LAMB_SET = ["eps_check_f32", "eps_lamb_norms_f32", "eps_lamb_step_f32", "eps_lamb_step_bf16", "eps_copy_f32",
            "eps_copy_bf16"]


@pytest.mark.skipif(shutil.which("make") is None or shutil.which("awk") is None, reason="needs make and awk")
@pytest.mark.parametrize("card", ["u280", "u50"])
def test_makefile_kernels_lamb(tmp_path, card):
    """``make -C hls KERNELS=lamb``: what a LAMB run with fp32 gradients and fp32 or bf16 copies
    calls, in the link config it writes (a stand-in for v++: only the config is made)."""
    hls_dir = tmp_path / "hls"
    shutil.copytree(ROOT / "hls", hls_dir, ignore=shutil.ignore_patterns("build"))
    platform = {"u280": "xilinx_u280_gen3x16_xdma_1_202211_1", "u50": "xilinx_u50_gen3x16_xdma_5_202210_1"}[card]
    target = f"build/{platform}/hw/link.cfg"
    r = subprocess.run(["make", "-s", "-C", str(hls_dir), "VPP=true", f"PLATFORM={platform}", target,
                        "KERNELS=lamb"], capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    text = (hls_dir / target).read_text()
    assert [k for k, _ in re.findall(r"(?m)^nk=(\w+):1:(\w+)$", text)] == [k for k in hcb.KERNEL_NAMES if k in LAMB_SET]
    assert {k for k, _ in re.findall(r"(?m)^sp=(\w+)_1\.(\w+):", text)} == set(LAMB_SET)
