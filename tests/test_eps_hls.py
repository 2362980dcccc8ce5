"""The HLS C++ EPS kernels (hls/eps_kernels.cpp, C-simulation) against the NumPy golden model.

shared/spec/eps-numerics.md is the contract; tests/test_eps_contract.py checks the
NumPy backend against an independent oracle, and its vector generators are reused
here, as tests/test_eps_opencl.py does for the OpenCL kernels: every vector class
of the contract goes through HlsCsimBackend (the HLS source compiled with g++,
called through ctypes) and NumpyBackend from the same state, and p, m, v, the
finite flag and the device copy must agree bit for bit (NaN == NaN). Also through
the EagerParamServer. And the HLS source must keep the kernel names, parameter
names and order of fpga/opencl/eps.cl (fpga/ARGS.md), with one AXI bundle per
buffer.

One HlsCsimBackend serves the whole module (the library is built once into the
user cache); every test takes fresh layer ids from ``new_layer()``.
"""
from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from l2l.eps import AdamWHyper, EagerParamServer, NumpyBackend, StepScalars
from l2l.eps import hls_csim_backend as hcb
from l2l.eps.hls_csim_backend import HlsCsimBackend
from l2l.eps.numerics import COPY_DTYPES, GRAD_DTYPES
from l2l.eps.opencl_backend import KERNEL_SOURCE as CL_SOURCE
from l2l.errors import UserError

from test_eps_contract import (  # tests/ is on sys.path under pytest
    HYPERS,
    SPECIAL_SCALARS,
    _bits_of,
    _copy_tie_values,
    _f32_from_bits,
    _is_nan_bits,
    _nonfinite_cases,
    _odd_f32,
    _round_bits,
    _specials,
    _widen,
    custom_scalars,
    grad_array,
    nonfinite_grads,
    product_tie_inputs,
    wide_f32,
    wide_grad_bits,
)

from eps_twin import DTYPES, FORMS, Twin, assert_same, grads_of, new_layer, oracle_ties, sentinel, wide_state  # noqa: E501

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

TILE = 1024  # eps::TILE in hls/eps_kernels.cpp: elements per burst
@pytest.fixture(scope="module")
def hls():
    backend = HlsCsimBackend()
    yield backend
    backend.close()


# --------------------------------------------------------------------------
# random vectors over every binade; every n class, K, gradient and copy dtype
# --------------------------------------------------------------------------

# around the kernels' tile (1024 elements, one burst per contribution) and twice it; odd sizes
NS = [1, 7, 8, 9, TILE - 1, TILE, TILE + 1, 2 * TILE - 1, 2 * TILE, 2 * TILE + 1, 3001]


@pytest.mark.parametrize("cdtype", DTYPES)
@pytest.mark.parametrize("gdtype", DTYPES)
@pytest.mark.parametrize("K", [1, 2, 4])
@pytest.mark.parametrize("n", NS)
def test_random_wide_vectors(hls, n, K, gdtype, cdtype):
    """p, m, v, g over all binades (subnormals, both zeros) with random hyper-parameters and t."""
    rng = np.random.default_rng(zlib.crc32(f"hls-{n}-{K}-{gdtype}-{cdtype}".encode()))
    p, m, v = wide_state(rng, n)
    grad_bits = [wide_grad_bits(rng, n, gdtype) for _ in range(K)]
    h = HYPERS[int(rng.integers(0, len(HYPERS)))]
    s = StepScalars.compute(h, int(rng.integers(1, 50)), loss_scale=float(2 ** int(rng.integers(0, 17))),
                            divisor=float(K))
    form = FORMS[DTYPES.index(cdtype)]  # every form meets every (n, K, gradient dtype)
    tw = Twin(hls, p, m, v)
    tw.step(grads_of(grad_bits, gdtype), s, cdtype, f"n={n} K={K} {gdtype}->{cdtype} {form}",
            expect_finite=True, form=form)


def test_empty_layer(hls):
    """n = 0: nothing to do, finite, on both."""
    for gdtype, cdtype in itertools.product(DTYPES, DTYPES):
        tw = Twin(hls, np.zeros(0, np.float32))
        tw.step([np.zeros(0, GRAD_DTYPES[gdtype])] * 2, StepScalars.compute(AdamWHyper(), 1), cdtype,
                f"n=0 {gdtype}->{cdtype}", expect_finite=True)
        tw.write_copy(cdtype, "n=0")


@pytest.mark.parametrize("gdtype", DTYPES)
@pytest.mark.parametrize("sname", list(SPECIAL_SCALARS))
def test_special_value_grid(hls, sname, gdtype):
    """Every combination of ±0, subnormals, tiny and huge values in p, m, v, g; every copy dtype."""
    s = SPECIAL_SCALARS[sname]
    P, M, V, G = np.meshgrid(_specials(True), _specials(True), _specials(False),
                             _specials(True, gdtype), indexing="ij")
    p, m, v = (_f32_from_bits(x.reshape(-1)) for x in (P, M, V))
    grads = grads_of([G.reshape(-1)], gdtype)
    for cdtype in DTYPES:
        tw = Twin(hls, p, m, v)
        tw.step(grads, s, cdtype, f"specials {sname} {gdtype}->{cdtype}")


def test_signed_zeros_everywhere(hls):
    """All-zero state and gradients of both signs: the sign of every zero result must agree."""
    n = 16
    signs = np.array([(i >> b) & 1 for i in range(n) for b in range(4)]).reshape(n, 4)
    z = np.where(signs, -0.0, 0.0).astype(np.float32)
    for gdtype in DTYPES:
        for cdtype in DTYPES:
            tw = Twin(hls, z[:, 0].copy(), z[:, 1].copy(), np.zeros(n, np.float32))
            g = z[:, 2].astype(GRAD_DTYPES[gdtype])
            for sname in ("default-t1", "zero-eps", "subnormal-eps"):
                tw.step([g, z[:, 3].astype(GRAD_DTYPES[gdtype])], SPECIAL_SCALARS[sname], cdtype,
                        f"zeros {gdtype}->{cdtype} {sname}")


@pytest.mark.parametrize("gdtype", ["bf16", "fp16"])
def test_every_16_bit_gradient_pattern(hls, gdtype):
    """Widening of every finite bf16 / fp16 bit pattern (subnormals, both zeros): m' = (1 * +0) + g
    exposes g exactly (-0 becomes +0); K = 2 also adds the patterns to their reversal."""
    bits = np.arange(1 << 16, dtype=np.uint64)
    finite = ~_is_nan_bits(bits, gdtype) & ((bits & np.uint64(0x7FFF)) != np.uint64(0x7F80 if gdtype == "bf16"
                                                                                    else 0x7C00))
    bits = bits[finite]
    n = bits.size
    assert np.isfinite(_widen(bits, gdtype)).all()
    z = np.zeros(n, np.float32)
    s = custom_scalars(b1=1.0, omb1=1.0, b2=1.0, omb2=1.0)
    tw = Twin(hls, wide_f32(np.random.default_rng(731), n), z, z)
    tw.step(grads_of([bits], gdtype), s, "fp32", f"every {gdtype} pattern", expect_finite=True)
    np.testing.assert_array_equal(_bits_of(tw.dut.read_state(tw.layer)[1]),
                                  _round_bits(0.0 + _widen(bits, gdtype), "fp32")[0])
    tw = Twin(hls, wide_f32(np.random.default_rng(732), n), z, z)
    tw.step(grads_of([bits, bits[::-1].copy()], gdtype), custom_scalars(inv_scale=0.5), "bf16",
            f"every {gdtype} pattern, K=2")


@pytest.mark.parametrize("cdtype", ["bf16", "fp16"])
def test_narrowing_sweep(hls, cdtype):
    """fp32 -> bf16 / fp16 over a stride of the whole bit space and densely around the fp16
    subnormal, normal and overflow boundaries, both signs (write_copy = eps_copy_<c>)."""
    coarse = np.arange(0, 1 << 32, 4093, dtype=np.uint64)
    dense = np.concatenate([np.arange(0x32FF0000, 0x38900000, 97, dtype=np.uint64),
                            np.arange(0x477F0000, 0x47810000, 1, dtype=np.uint64)])
    bits = np.concatenate([coarse, dense, dense | np.uint64(1 << 31)])
    tw = Twin(hls, _f32_from_bits(bits))
    tw.write_copy(cdtype, f"narrowing sweep {cdtype}")


# --------------------------------------------------------------------------
# constructed ties: arithmetic and device copy
# --------------------------------------------------------------------------


def _reduction_tie_bits(rng, n, K, gdtype):
    """g_0 plus K-1 contributions of half an ulp of g_0: the running sums land on binary32 ties
    (the construction of test_eps_contract.test_ties_in_reduction)."""
    if gdtype == "fp16":
        e = rng.integers(0, 16, n)
        g0 = _round_bits(np.ldexp(1.0 + rng.integers(0, 1024, n) / 1024.0, e), "fp16")[0]
    else:
        mbits = 23 if gdtype == "fp32" else 7
        e = rng.integers(-20, 20, n)
        g0 = _round_bits(np.ldexp(1.0 + rng.integers(0, 1 << mbits, n) * 2.0 ** -mbits, e), "fp32")[0]
        if gdtype == "bf16":
            g0 = g0 >> np.uint64(16)
    g0 = g0 | (rng.integers(0, 2, n, dtype=np.uint64) << np.uint64(15 if gdtype != "fp32" else 31))
    sign = np.where(rng.random((K - 1, n)) < 0.5, -1.0, 1.0)
    rest = [np.ldexp(sign[k], e - 24) for k in range(K - 1)]
    rest_bits = [_round_bits(r, "fp32" if gdtype == "bf16" else gdtype)[0] for r in rest]
    if gdtype == "bf16":
        rest_bits = [b >> np.uint64(16) for b in rest_bits]
    for b, r in zip(rest_bits, rest):
        assert (_widen(b, gdtype) == r).all()
    return [g0] + rest_bits


@pytest.mark.parametrize("gdtype", DTYPES)
@pytest.mark.parametrize("K", [2, 4])
def test_ties_in_reduction(hls, K, gdtype):
    rng = np.random.default_rng(800 + K * 10 + len(gdtype))
    n = 1000
    grad_bits = _reduction_tie_bits(rng, n, K, gdtype)
    p, m, v = wide_state(rng, n)
    s = custom_scalars(inv_scale=0.5)
    assert oracle_ties(p, m, v, grad_bits, gdtype, s, "fp32").ties["acc"] >= n // 3
    for cdtype in DTYPES:
        Twin(hls, p, m, v).step(grads_of(grad_bits, gdtype), s, cdtype,
                                f"reduction ties K={K} {gdtype}->{cdtype}", expect_finite=True)


def test_ties_in_products(hls):
    """Products exactly halfway: factor 1.5 times odd significands."""
    n = 4096
    p, m, v, g, s = product_tie_inputs(np.random.default_rng(811), n)
    o = oracle_ties(p, m, v, [g], "fp32", s, "bf16")
    for op in ("p1", "b1m", "omb1g", "b2v", "ns"):
        assert o.ties[op] >= n // 8, (op, o.ties)
    for cdtype in DTYPES:
        Twin(hls, p, m, v).step(grads_of([g], "fp32"), s, cdtype, f"product ties ->{cdtype}", expect_finite=True)


def test_ties_in_sums(hls):
    """Sums exactly halfway: m' and v' (g half an ulp of m, g*g half an ulp of v), p' (m half an
    ulp of p with v = 0, eps = 1), d (sqrt(v) exact plus eps half an ulp)."""
    rng = np.random.default_rng(812)
    n = 4096
    ones = custom_scalars(decay=1.0, b1=1.0, omb1=1.0, b2=1.0, omb2=1.0, inv_bc2_sqrt=1.0, eps=1.0, neg_step=-1.0)
    cases = []
    # m', v'
    e = rng.integers(-40, 40, n)
    m = (_odd_f32(rng, n, 0, 1) * np.ldexp(1.0, e)).astype(np.float32)
    g = np.ldexp(np.where(rng.random(n) < 0.5, -1.0, 1.0), e - 24)
    v = (np.abs(_odd_f32(rng, n, 0, 1)) * np.ldexp(1.0, 2 * e - 24)).astype(np.float32)
    cases.append(("m' v'", wide_f32(rng, n), m, v, _round_bits(g, "fp32")[0], ones, ("m'", "v'")))
    # p'
    p = _odd_f32(rng, n, -100, 100).astype(np.float32)
    ep = np.floor(np.log2(np.abs(p.astype(np.float64))))
    m = (np.where(rng.random(n) < 0.5, -1.0, 1.0) * np.ldexp(1.0, (ep - 24).astype(int))).astype(np.float32)
    z = np.zeros(n, np.float32)
    cases.append(("p'", p, m, z, _bits_of(z), ones, ("p'",)))
    # d
    ex = 5
    x = np.ldexp(1.0 + (rng.integers(0, 1 << 10, n) * 2 + 1) * 2.0 ** -11, ex)
    v = (x * x).astype(np.float32)
    s_d = custom_scalars(decay=1.0, b1=1.0, b2=1.0, omb2=1.0, inv_bc2_sqrt=1.0, eps=2.0 ** (ex - 24))
    cases.append(("d", wide_f32(rng, n), wide_f32(rng, n), v, _bits_of(z), s_d, ("d",)))
    for name, p, m, v, gb, s, ops in cases:
        o = oracle_ties(p, m, v, [gb], "fp32", s, "fp32")
        for op in ops:
            assert o.ties[op] >= n // 3, (name, op, o.ties)
        for cdtype in DTYPES:
            Twin(hls, p, m, v).step(grads_of([gb], "fp32"), s, cdtype, f"sum ties {name} ->{cdtype}",
                                    expect_finite=True)


@pytest.mark.parametrize("cdtype", DTYPES)
def test_ties_in_device_copy(hls, cdtype):
    """p' exactly halfway for bf16 / fp16 (normal, subnormal, the 65520 overflow edge): through
    a whole update (g = m = v = 0, decay 1: p' = p) and through write_copy."""
    rng = np.random.default_rng(813)
    p = _copy_tie_values(rng, 2000)
    n = p.size
    z = np.zeros(n, np.float32)
    s = custom_scalars(decay=1.0)
    if cdtype != "fp32":
        o = oracle_ties(p, z, z, [_bits_of(z)], "fp32", s, cdtype)
        assert o.ties["copy-" + cdtype] >= (2000 if cdtype == "bf16" else 4000), o.ties
    tw = Twin(hls, p, z, z)
    tw.write_copy(cdtype, "copy ties before the update")
    tw.step([z], s, cdtype, f"copy ties {cdtype}", expect_finite=True)
    tw.write_copy(cdtype, "copy ties after the update")


EXTRA_BITS = [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFF800001, 0x7F7FFFFF, 0x7FBFFFFF,
              0x477FEFFF, 0x477FF000, 0x477FF001, 0xC77FF000, 0x33000000, 0x33000001, 0x1,
              0x807FFFFF, 0x387FC000, 0x38800000, 0x7F7F8000, 0x7F7F7FFF, 0x7F7FFFFF, 0xFF7F8000,
              0x3F808000, 0x3F818000, 0x00008000, 0x00018000, 0x80007FFF,
              # NaNs whose payload lies only in the low 16 bits (bf16 must not turn them into inf)
              0x7F800001, 0xFF800001, 0x7F80FFFF, 0x7F810000, 0x7FFFFFFF, 0xFFC00001,
              # fp16 subnormal edges: below, at and above 2**-25, the largest subnormal's rounding
              0x32FFFFFF, 0x33000000, 0x33000001, 0x337FFFFF, 0x33C00000, 0x387FDFFF, 0x387FE000, 0x387FFFFF]


@pytest.mark.parametrize("cdtype", DTYPES)
def test_write_copy_every_class(hls, cdtype):
    """write_copy right after allocate, on random bit patterns: NaN (any payload), inf,
    overflow to fp16 inf, subnormals, zeros; and after a step that leaves p' = p."""
    rng = np.random.default_rng(814)
    bits = np.concatenate([rng.integers(0, 1 << 32, 1 << 15, dtype=np.uint64), np.array(EXTRA_BITS, np.uint64)])
    p = _f32_from_bits(bits)
    tw = Twin(hls, p)
    tw.write_copy(cdtype, "after allocate")
    z = np.zeros(p.size, np.float32)
    tw.step([z], custom_scalars(decay=1.0), cdtype, f"p' = p on every class ->{cdtype}", expect_finite=True)
    tw.write_copy(cdtype, "after a step")
    # every special pattern at every position of a short layer
    extra = np.array(EXTRA_BITS, np.uint64)
    for r in range(0, extra.size, 5):
        tw = Twin(hls, _f32_from_bits(np.roll(extra, r)))
        tw.write_copy(cdtype, f"specials rotated by {r}")
        z = np.zeros(extra.size, np.float32)
        tw.step([z], custom_scalars(decay=1.0), cdtype, f"p' = p, specials rotated by {r}", expect_finite=True)


# --------------------------------------------------------------------------
# non-finite gradients
# --------------------------------------------------------------------------

@pytest.mark.parametrize("case, K, gdtype", list(_nonfinite_cases()))
def test_nonfinite_gradient_changes_nothing(hls, case, K, gdtype):
    """finite False on both; p, m, v and the device copy untouched; the next finite step agrees
    (the host resets the finite flag per step)."""
    rng = np.random.default_rng(zlib.crc32(f"hls-nf-{case}-{K}-{gdtype}".encode()))
    n = 2 * TILE + 43  # two whole tiles and a partial one
    p, m, v = wide_state(rng, n)
    # the bad element first in the first tile, inside the second tile, last of the partial tile
    for cdtype, i, form in zip(DTYPES, (0, TILE + 3, n - 1), FORMS):
        grad_bits, s = nonfinite_grads(rng, n, case, K, gdtype, i)
        tw = Twin(hls, p, m, v)
        copies = (sentinel(n, cdtype), sentinel(n, cdtype))
        tw.step(grads_of(grad_bits, gdtype), s, cdtype, f"{case} K={K} {gdtype}->{cdtype} at {i} {form}",
                expect_finite=False, form=form, copies=copies)
        for name, got in zip("pmv", tw.dut.read_state(tw.layer)):
            assert_same(got, {"p": p, "m": m, "v": v}[name], f"{case}: HLS {name} changed")
        assert_same(copies[1], sentinel(n, cdtype), f"{case}: device copy written")
        ok_bits = [wide_grad_bits(rng, n, gdtype) for _ in range(K)]
        tw.step(grads_of(ok_bits, gdtype), StepScalars.compute(AdamWHyper(), 1, divisor=float(K)), cdtype,
                f"finite step after {case}", expect_finite=True, form=form, copies=copies)


def test_update_kernel_writes_nothing_when_flag_clear(hls):
    """eps_update_<g>_<c> called directly with *finite == 0 on finite data: no store at all."""
    rng = np.random.default_rng(815)
    n = TILE + 5
    for g, c in itertools.product(DTYPES, DTYPES):
        gr = grad_array(wide_grad_bits(rng, 2 * n, g), g)
        state = [wide_f32(rng, n) for _ in range(3)]
        before = [a.copy() for a in state]
        copy = sentinel(n, c)
        flag = np.zeros(1, np.int32)
        fn = getattr(hls.lib, f"eps_update_{hcb.GRAD_SUFFIX[gr.dtype]}_{hcb.SUFFIX[copy.dtype]}")
        fn(gr.ctypes.data, *(a.ctypes.data for a in state), copy.ctypes.data, flag.ctypes.data, n, 2,
           *StepScalars.compute(AdamWHyper(), 1).as_tuple())
        for a, b in zip(state, before):
            assert_same(a, b, f"{g}->{c}: state written with the flag clear")
        assert_same(copy, sentinel(n, c), f"{g}->{c}: copy written with the flag clear")


# --------------------------------------------------------------------------
# multi-step runs on the same state
# --------------------------------------------------------------------------


def _run_grads(rng, n, K, gdtype):
    """Half realistic gradients, half over all binades."""
    half = n // 2
    scale = 10.0 ** rng.uniform(-6 if gdtype == "fp16" else -10, 3, (K, half))
    real = (rng.standard_normal((K, half)) * scale).astype(GRAD_DTYPES[gdtype])
    wide = [grad_array(wide_grad_bits(rng, n - half, gdtype), gdtype) for _ in range(K)]
    return [np.concatenate([real[k], wide[k]]) for k in range(K)]


LONG_RUNS = [(g, K, c, n, persistent)
             for (g, c), K, n, persistent in zip(itertools.product(DTYPES, DTYPES), itertools.cycle([1, 2, 4]),
                                                 itertools.cycle([3001, 1, 4099, 257, 7]),
                                                 itertools.cycle([True, False]))]
LONG_RUNS.append(("bf16", 2, "bf16", 2 * 32768 + 5, True))


@pytest.mark.parametrize("gdtype, K, cdtype, n, persistent", LONG_RUNS)
def test_long_run(hls, gdtype, K, cdtype, n, persistent):
    """12 steps with step-dependent scalars on the same state, a non-finite step in the middle
    (skipped: t does not advance); every step compared, and write_copy at the start and the end.
    ``persistent``: like the server, one (K, n) gradient block refilled in place and one
    device-copy array per backend for the whole run; otherwise fresh arrays every step, as a list."""
    rng = np.random.default_rng(zlib.crc32(f"hls-long-{gdtype}-{K}-{cdtype}-{n}-{persistent}".encode()))
    half = n // 2
    p0 = np.concatenate([rng.standard_normal(half) * 0.02, wide_f32(rng, n - half)]).astype(np.float32)
    tw = Twin(hls, p0)
    tw.write_copy(cdtype, "initial copy")
    block = np.zeros((K, n), GRAD_DTYPES[gdtype])
    copies = (sentinel(n, cdtype), sentinel(n, cdtype)) if persistent else None
    hyper = AdamWHyper()
    loss_scale = 1024.0 if gdtype == "fp16" else 1.0
    t = 0
    for step in range(1, 13):
        grads = _run_grads(rng, n, K, gdtype)
        if step == 6:
            bad = grads[-1].copy()
            bad[int(rng.integers(0, n))] = np.inf
            grads[-1] = bad
        s = StepScalars.compute(hyper, t + 1, loss_scale=loss_scale, divisor=float(K))
        what = f"step {step} (t={t + 1}) {gdtype} K={K} ->{cdtype} n={n} persistent={persistent}"
        if persistent:
            block[...] = np.stack(grads)
            finite = tw.step(block, s, cdtype, what, expect_finite=step != 6, form="given", copies=copies)
        else:
            finite = tw.step(grads, s, cdtype, what, expect_finite=step != 6)
        t += finite
    assert t == 11
    p = tw.write_copy(cdtype, "final copy")
    assert np.isfinite(tw.ref.read_state(tw.layer)[0][:half]).all() and p.size == n


def test_interleaved_layers(hls):
    """Layers of different sizes and dtypes stepped in turn share the backend's scratch buffers:
    a large layer, then a small one, then the large one again must not see stale data."""
    rng = np.random.default_rng(816)
    plan = [(3001, "fp32", 1, "bf16"), (1, "bf16", 2, "fp16"), (700, "fp16", 4, "fp32"),
            (257, "bf16", 1, "bf16"), (5000, "fp16", 2, "fp16")]
    twins = [(Twin(hls, *wide_state(rng, n)), g, K, c) for n, g, K, c in plan]
    for t in range(1, 11):
        order = rng.permutation(len(twins))
        for j in order:
            tw, gdtype, K, cdtype = twins[j]
            grads = [grad_array(wide_grad_bits(rng, tw.n, gdtype), gdtype) for _ in range(K)]
            form = FORMS[(t + j) % len(FORMS)]
            tw.step(grads, StepScalars.compute(AdamWHyper(), t, divisor=float(K)), cdtype,
                    f"interleaved layer {j} step {t} {form}", expect_finite=True, form=form)


def test_threads_share_one_backend(hls):
    """Two threads stepping different layers at once (the kernels run without the GIL) agree
    with NumPy: per-thread scratch, no shared staging buffer."""
    rng = np.random.default_rng(817)
    twins = [Twin(hls, *wide_state(rng, 20_000)) for _ in range(2)]

    def run(j):
        r = np.random.default_rng(900 + j)
        for t in range(1, 6):
            grads = [grad_array(wide_grad_bits(r, 20_000, "bf16"), "bf16") for _ in range(3)]
            twins[j].step(grads, StepScalars.compute(AdamWHyper(), t, divisor=3.0), "fp16",
                          f"thread {j} step {t}", expect_finite=True)

    with ThreadPoolExecutor(2) as pool:
        for future in [pool.submit(run, j) for j in range(2)]:
            future.result()  # re-raises a thread's failure here


@pytest.mark.parametrize("offset", [1, 3])
def test_unaligned_host_arrays(hls, offset):
    """Gradient block and device copy that start ``offset`` elements into a larger allocation
    (not 16-byte aligned), reused across steps as the server reuses its buffers."""
    rng = np.random.default_rng(820 + offset)
    n, K = 1001, 2
    for gdtype, cdtype in [("fp32", "fp16"), ("fp16", "bf16"), ("bf16", "fp32")]:
        raw = np.zeros(K * n + 8, GRAD_DTYPES[gdtype])
        block = raw[offset:offset + K * n].reshape(K, n)
        craw = [np.zeros(n + 8, COPY_DTYPES[cdtype]) for _ in range(2)]
        copies = tuple(c[offset:offset + n] for c in craw)
        tw = Twin(hls, *wide_state(rng, n))
        for t in range(1, 6):
            block[...] = np.stack([grad_array(wide_grad_bits(rng, n, gdtype), gdtype) for _ in range(K)])
            tw.step(block, StepScalars.compute(AdamWHyper(), t, divisor=float(K)), cdtype,
                    f"offset {offset} {gdtype}->{cdtype} t={t}", expect_finite=True, form="given", copies=copies)
            for c in craw:  # nothing written outside the view
                assert not _bits_of(c[:offset]).any() and not _bits_of(c[offset + n:]).any()


def test_bad_gradient_shape_changes_nothing(hls):
    """Contributions of the wrong length are refused by both backends, and nothing changes."""
    rng = np.random.default_rng(821)
    n = 300
    tw = Twin(hls, *wide_state(rng, n))
    s = StepScalars.compute(AdamWHyper(), 1)
    for grads in ([np.ones(n - 1, np.float32)], np.ones((2, n + 8), np.float32)):
        for be in (tw.ref, tw.dut):
            copy = sentinel(n, "fp32")
            with pytest.raises(ValueError):
                be.step(tw.layer, grads, s, copy)
            assert_same(copy, sentinel(n, "fp32"), f"{be.name}: device copy written by a refused step")
        tw.check_state("after a refused step")
    # refused by the HLS backend alone: mixed dtypes, no contributions, a float64 gradient,
    # a device copy of the wrong dtype or length
    copy = sentinel(n, "fp32")
    for grads, out in (([np.ones(n, np.float32), np.ones(n, np.float16)], copy), ([], copy),
                       ([np.ones(n, np.float64)], copy), ([np.ones(n, np.float32)], np.zeros(n, np.float64)),
                       ([np.ones(n, np.float32)], sentinel(n - 1, "fp32")),
                       ([np.ones(n, np.float32)], np.broadcast_to(sentinel(1, "fp32"), (n,)))):
        with pytest.raises(ValueError):
            tw.dut.step(tw.layer, grads, s, out)
    assert_same(copy, sentinel(n, "fp32"), "device copy written by a refused step")
    tw.check_state("after refused steps")
    tw.step([grad_array(wide_grad_bits(rng, n, "fp32"), "fp32")], s, "bf16", "good step after refused ones",
            expect_finite=True)


def test_strided_copy_out(hls):
    """A device copy that is a strided view: written like NumPy writes it, gaps untouched."""
    rng = np.random.default_rng(822)
    n = 37
    tw = Twin(hls, *wide_state(rng, n))
    wide = [sentinel(2 * n, "fp16") for _ in range(2)]
    tw.step([grad_array(wide_grad_bits(rng, n, "fp32"), "fp32")], StepScalars.compute(AdamWHyper(), 1), "fp16",
            "strided copy_out", expect_finite=True, copies=(wide[0][::2], wide[1][::2]))
    assert_same(wide[1], wide[0], "strided copy_out with the gaps")
    for be, w in zip((tw.ref, tw.dut), wide):
        be.write_copy(tw.layer, w[1::2])
    assert_same(wide[1], wide[0], "strided write_copy")


# --------------------------------------------------------------------------
# state round trip
# --------------------------------------------------------------------------


def test_read_state_round_trip(hls):
    """allocate gives (p, +0, +0); write_state/read_state keep every bit, NaN payloads included;
    a wrong shape raises and changes nothing."""
    rng = np.random.default_rng(823)
    n = 1031
    layer = new_layer()
    p0 = wide_f32(rng, n)
    hls.allocate(layer, p0)
    p, m, v = hls.read_state(layer)
    assert np.array_equal(_bits_of(p), _bits_of(p0))
    assert not _bits_of(m).any() and not _bits_of(v).any()
    p0[0] = 1.0  # allocate copied p
    assert np.array_equal(_bits_of(hls.read_state(layer)[0]), _bits_of(p))
    state = [_f32_from_bits(np.concatenate([rng.integers(0, 1 << 32, n - len(EXTRA_BITS), dtype=np.uint64),
                                            np.array(EXTRA_BITS, np.uint64)])) for _ in range(3)]
    hls.write_state(layer, *state)
    for got, want, name in zip(hls.read_state(layer), state, "pmv"):
        assert got.dtype == np.float32 and np.array_equal(_bits_of(got), _bits_of(want)), name
    got = hls.read_state(layer)
    got[0][...] = 0  # read_state hands out copies
    with pytest.raises(ValueError):
        hls.write_state(layer, state[0], state[1], state[2][:-1])
    with pytest.raises(ValueError):
        hls.write_state(layer, state[0][:-1], state[1], state[2])
    for got, want, name in zip(hls.read_state(layer), state, "pmv"):
        assert np.array_equal(_bits_of(got), _bits_of(want)), f"{name} changed by a rejected write_state"
    # and the loaded state updates like NumPy's (NaN and inf in the state included)
    tw = Twin(hls, state[0], state[1], state[2])
    tw.step([grad_array(wide_grad_bits(rng, n, "fp32"), "fp32")], StepScalars.compute(AdamWHyper(), 3), "fp16",
            "update from a bit-pattern state")


# --------------------------------------------------------------------------
# through the eager param-server
# --------------------------------------------------------------------------

SERVER_HYPER = AdamWHyper(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.05)


def _server_pair(**kw):
    return (EagerParamServer(NumpyBackend(), SERVER_HYPER, **kw), EagerParamServer(HlsCsimBackend(), SERVER_HYPER, **kw))


def _assert_servers_agree(ref, got, layers, what):
    ref.synchronize()
    got.synchronize()
    for layer in layers:
        assert got.step_count(layer) == ref.step_count(layer), (what, layer)
        assert_same(got.fetch(layer), ref.fetch(layer), f"{what}: layer {layer} device copy")
    tr, tg = ref.state_tensors(), got.state_tensors()
    assert tr.keys() == tg.keys()
    for k in tr:
        assert_same(tg[k], tr[k], f"{what}: {k}")
    assert got.state_meta() == ref.state_meta()


@pytest.mark.parametrize("grad_dtype, copy_dtype, contributors",
                         [("bf16", "fp16", 2), ("fp32", "bf16", 1), ("fp16", "fp32", 4)])
def test_server_matches_numpy(grad_dtype, copy_dtype, contributors):
    """Several layers, 8 steps, one non-finite step on one layer, then a checkpoint loaded into
    both servers and 3 more steps: copies, step counts, history and state agree."""
    rng = np.random.default_rng(zlib.crc32(f"hls-srv-{grad_dtype}-{copy_dtype}-{contributors}".encode()))
    sizes = [1, 257, 3001, 40]
    layers = [new_layer() for _ in sizes]
    loss_scale = 1024.0 if grad_dtype == "fp16" else 1.0
    ref, got = _server_pair(copy_dtype=copy_dtype, grad_dtype=grad_dtype, contributors=contributors)
    try:
        for layer, n in zip(layers, sizes):
            p = wide_f32(rng, n) if n < 100 else (rng.standard_normal(n) * 0.05).astype(np.float32)
            ref.add_layer(layer, p)
            got.add_layer(layer, p)
        _assert_servers_agree(ref, got, layers, "after add_layer")

        def one_step(step, bad_layer=None):
            for layer, n in zip(layers, sizes):
                for k in range(contributors):
                    g = (rng.standard_normal(n) * 10.0 ** rng.uniform(-5, 0)).astype(GRAD_DTYPES[grad_dtype])
                    if layer == bad_layer and k == contributors - 1:
                        g[n // 2] = np.nan
                    for srv in (ref, got):
                        srv.gradient_inbox(layer, k)[:] = g
                for srv in (ref, got):  # both servers' updates run eagerly, interleaved
                    for k in range(contributors):
                        srv.push_gradient(layer, k, divisor=float(contributors), loss_scale=loss_scale)
            _assert_servers_agree(ref, got, layers, f"step {step}")

        for step in range(1, 9):
            one_step(step, bad_layer=layers[2] if step == 4 else None)
        assert got.step_count(layers[2]) == 7 and got.step_count(layers[0]) == 8
        assert [r.finite for r in got.history].count(False) == 1
        assert got.history == ref.history

        tensors, meta = {}, {"steps": {}}
        for layer, n in zip(layers, sizes):
            tensors[f"layer{layer}.p"], tensors[f"layer{layer}.m"], tensors[f"layer{layer}.v"] = wide_state(rng, n)
            meta["steps"][str(layer)] = int(rng.integers(1, 100))
        for srv in (ref, got):
            srv.load_state(tensors, meta)
        _assert_servers_agree(ref, got, layers, "after load_state")
        for step in range(9, 12):
            one_step(step)
        assert got.history == ref.history
    finally:
        ref.close()
        got.close()


# --------------------------------------------------------------------------
# the compiled library, its build and cache
# --------------------------------------------------------------------------


def test_library_exports_every_kernel(hls):
    for name in hcb.KERNEL_NAMES:
        assert callable(getattr(hls.lib, name)), name
    assert len(hcb.KERNEL_NAMES) == 15
    nm = shutil.which("nm")
    if nm:  # exactly these eps_* symbols, unmangled (extern "C")
        out = subprocess.run([nm, "-D", "--defined-only", hls.lib._name], capture_output=True, text=True,
                             check=True).stdout
        exported = {line.split()[-1] for line in out.splitlines() if line.split() and line.split()[-1].startswith("eps_")}
        assert exported == set(hcb.KERNEL_NAMES)


def test_build_flags_keep_the_contract_rules():
    assert "-ffp-contract=off" in hcb.CXX_FLAGS and "-fno-fast-math" in hcb.CXX_FLAGS
    for flag in hcb.CXX_FLAGS:
        assert not flag.startswith(("-Ofast", "-ffast-math", "-march", "-mfma", "-funsafe", "-ffinite",
                                    "-fassociative", "-freciprocal")), flag
    src = hcb.kernel_source()
    for banned in ("fma(", "fmaf(", "std::fma", "__builtin_fma", "-ffast-math\"", "ap_int.h", "hls_math"):
        assert banned not in src, banned


def test_build_cache_reuse_and_concurrent_builders(tmp_path, monkeypatch):
    """Two concurrent builders into a fresh cache both succeed with one library and no temporary
    left behind; a second build reuses it; XDG_CACHE_HOME chooses the default place."""
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(hcb.build_library, cache_dir=tmp_path / "cache") for _ in range(2)]
        paths = [f.result() for f in futures]
    assert len(set(paths)) == 1
    files = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert files == [paths[0].name], files
    mtime = os.stat(paths[0]).st_mtime_ns
    assert hcb.build_library(cache_dir=tmp_path / "cache") == paths[0]
    assert os.stat(paths[0]).st_mtime_ns == mtime
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hcb.default_cache_dir() == tmp_path / "xdg" / "l2l" / "hls-csim"
    assert hcb.library_path().parent == tmp_path / "xdg" / "l2l" / "hls-csim"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert hcb.default_cache_dir() == hcb.Path(os.path.expanduser("~")) / ".cache" / "l2l" / "hls-csim"


def test_a_backend_from_its_own_cache_agrees(tmp_path):
    """cache_dir= gives a backend whose library was built there; same bits as the shared one."""
    be = HlsCsimBackend(cache_dir=tmp_path)
    assert list(tmp_path.glob("*.so")) and be.lib._name.startswith(str(tmp_path))
    rng = np.random.default_rng(830)
    tw = Twin(be, *wide_state(rng, 999))
    tw.step([grad_array(wide_grad_bits(rng, 999, "fp16"), "fp16") for _ in range(2)],
            StepScalars.compute(AdamWHyper(), 2, divisor=2.0), "bf16", "own cache", expect_finite=True)


def test_no_compiler_is_one_line_user_error(monkeypatch, tmp_path):
    with pytest.raises(UserError) as info:
        HlsCsimBackend(cxx="no-such-c++-compiler-l2l")
    msg = str(info.value)
    assert "\n" not in msg.strip() and "apt-get install g++" in msg, msg
    monkeypatch.setenv("PATH", str(tmp_path))  # no g++ on PATH
    ok, why = HlsCsimBackend.availability()
    assert not ok and "apt-get install g++" in why and "\n" not in why
    with pytest.raises(UserError, match="apt-get install g++"):
        HlsCsimBackend(cache_dir=tmp_path / "cache")


def test_unwritable_cache_is_one_line_user_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(UserError) as info:
        HlsCsimBackend(cache_dir=blocker / "cache")
    assert "\n" not in str(info.value) and "cache_dir" in str(info.value), info.value


def test_availability_and_name():
    ok, why = HlsCsimBackend.availability()
    assert ok, why
    assert HlsCsimBackend.name == "hls-csim" and "\n" not in why


# --------------------------------------------------------------------------
# one interface for every kernel source (fpga/ARGS.md)
# --------------------------------------------------------------------------

_KIND = {"uint": "uint", "unsigned": "uint", "float": "float"}


def _param(text: str) -> tuple[str, str, bool]:
    """(name, kind: ptr/uint/float, const pointer) of one C parameter declaration."""
    text = re.sub(r"[\s\\]+", " ", text).strip()
    tokens = text.replace("*", " * ").split()
    name = tokens[-1]
    if "*" in tokens:
        return name, "ptr", "const" in tokens[:tokens.index("*")]
    return name, _KIND[tokens[-2]], False


def _cl_signature(source: str, macro: str) -> list[tuple[str, str, bool]]:
    body = re.search(rf"#define {macro}\([\w, ]+\)(.*?)\{{", source, re.DOTALL).group(1)
    return [_param(p) for p in body[body.index("(") + 1:body.rindex(")")].split(",")]


def _hls_macro(source: str, macro: str) -> tuple[str, list[tuple[str, str, bool]], str]:
    """(top function name pattern, parameters, macro body) of an EPS_* macro of the HLS source."""
    found = re.search(rf'#define {macro}\([\w, ]+\)\s*\\?\s*extern "C" void ([\w#]+)\((.*?)\)\s*\{{(.*?)\n\n',
                      source, re.DOTALL)
    assert found, macro
    return found.group(1), [_param(p) for p in found.group(2).split(",")], found.group(3)


def _cl_kernel_names(source: str) -> set[str]:
    copies = re.findall(r"(?<!#define )EPS_UPDATE\(G, GT, (\w+),", source)
    names = {f"eps_check_{g}" for g in re.findall(r"^EPS_CHECK\((\w+),", source, re.MULTILINE)}
    names |= {f"eps_copy_{c}" for c in re.findall(r"^EPS_COPY\((\w+),", source, re.MULTILINE)}
    names |= {f"eps_update_{g}_{c}" for g in re.findall(r"^EPS_UPDATE_ALL_COPIES\((\w+),", source, re.MULTILINE)
              for c in copies}
    return names


@pytest.mark.parametrize("macro", ["EPS_CHECK", "EPS_UPDATE", "EPS_COPY"])
def test_hls_parameters_match_the_opencl_kernels(macro):
    """Same parameter names, kinds, order and const-ness as fpga/opencl/eps.cl; the documented order."""
    cl = _cl_signature(CL_SOURCE.read_text(), macro)
    top, params, body = _hls_macro(hcb.kernel_source(), macro)
    assert top.startswith(macro.lower() + "_"), top
    assert params == cl, (macro, params, cl)
    names = [p[0] for p in params]
    expected = {"EPS_CHECK": ["g", "finite", "n", "k", "inv_scale"],
                "EPS_UPDATE": ["gr", "p", "m", "v", "copy", "finite", "n", "k", *StepScalars.names()],
                "EPS_COPY": ["p", "copy", "n"]}[macro]
    assert names == expected
    # one AXI master bundle per buffer, every scalar and the control on the AXI-lite slave
    maxi = re.findall(r"EPS_MAXI\((\w+), (\w+)\)", body)
    assert [port for port, _ in maxi] == [n for n, kind, _ in params if kind == "ptr"]
    assert len({bundle for _, bundle in maxi}) == len(maxi)
    lite = re.findall(r"EPS_LITE\((\w+)\)", body)
    assert lite == [n for n, kind, _ in params if kind != "ptr"] + ["return"]


def test_hls_kernel_names_match_the_opencl_kernels():
    src = hcb.kernel_source()
    assert _cl_kernel_names(CL_SOURCE.read_text()) == set(hcb.KERNEL_NAMES)
    hls_names = {f"eps_check_{g}" for g in re.findall(r"^EPS_CHECK\((\w+),", src, re.MULTILINE)}
    hls_names |= {f"eps_copy_{c}" for c in re.findall(r"^EPS_COPY\((\w+),", src, re.MULTILINE)}
    copies = re.findall(r"(?<!#define )EPS_UPDATE\(GN, G, (\w+),", src)
    hls_names |= {f"eps_update_{g}_{c}" for g in re.findall(r"^EPS_UPDATE_ALL_COPIES\((\w+),", src, re.MULTILINE)
                  for c in copies}
    assert hls_names == set(hcb.KERNEL_NAMES)
    # the interface pragmas themselves, and II=1 element loops
    maxi = re.search(r"#define EPS_MAXI.*?\n(.*?)\n", src, re.DOTALL).group(0)
    for word in ("HLS INTERFACE m_axi", "offset=slave", "bundle=bundle", "max_widen_bitwidth=512"):
        assert word in maxi, word
    assert "HLS INTERFACE s_axilite" in re.search(r"#define EPS_LITE.*?\n", src).group(0)
    assert src.count("#pragma HLS PIPELINE II=1") >= 5
