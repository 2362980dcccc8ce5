"""The OpenCL EPS (fpga/opencl/eps.cl on PoCL) against the NumPy golden model, bit for bit.

shared/spec/eps-numerics.md is the contract; tests/test_eps_contract.py checks the
NumPy backend against an independent oracle, and reuses its vector generators
here: every vector class of the contract goes through both backends from the
same state, and p, m, v, the finite flag and the device copy must agree bit for
bit (NaN == NaN). Also through the EagerParamServer, and through a program
loaded from ``program_binary()`` (what ``--cl-binary`` does with an FPGA build).

One OpenCLBackend serves the whole module (building the program costs a
second); every test takes fresh layer ids from ``new_layer()``.
"""
from __future__ import annotations

import itertools
import zlib

import numpy as np
import pytest

from l2l.eps import AdamWHyper, EagerParamServer, NumpyBackend, OpenCLBackend, StepScalars
from l2l.eps.numerics import COPY_DTYPES, GRAD_DTYPES
from l2l.errors import UserError

from test_eps_contract import (  # tests/ is on sys.path under pytest
    HYPERS,
    SPECIAL_SCALARS,
    _NAN,
    _bits_of,
    _copy_tie_values,
    _f32_from_bits,
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

@pytest.fixture(scope="module")
def ocl():
    backend = OpenCLBackend()
    yield backend
    backend.close()


# --------------------------------------------------------------------------
# random vectors over every binade; every n class, K, gradient and copy dtype
# --------------------------------------------------------------------------

# around the vector width (8), the work-group size (256), their product (2048); odd sizes
NS = [1, 7, 8, 9, 255, 256, 257, 2047, 2048, 2049, 3001]


@pytest.mark.parametrize("cdtype", DTYPES)
@pytest.mark.parametrize("gdtype", DTYPES)
@pytest.mark.parametrize("K", [1, 2, 4])
@pytest.mark.parametrize("n", NS)
def test_random_wide_vectors(ocl, n, K, gdtype, cdtype):
    """p, m, v, g over all binades (subnormals, both zeros) with random hyper-parameters and t."""
    rng = np.random.default_rng(zlib.crc32(f"ocl-{n}-{K}-{gdtype}-{cdtype}".encode()))
    p, m, v = wide_state(rng, n)
    grad_bits = [wide_grad_bits(rng, n, gdtype) for _ in range(K)]
    h = HYPERS[int(rng.integers(0, len(HYPERS)))]
    s = StepScalars.compute(h, int(rng.integers(1, 50)), loss_scale=float(2 ** int(rng.integers(0, 17))),
                            divisor=float(K))
    form = FORMS[DTYPES.index(cdtype)]  # every form meets every (n, K, gradient dtype)
    tw = Twin(ocl, p, m, v)
    tw.step(grads_of(grad_bits, gdtype), s, cdtype, f"n={n} K={K} {gdtype}->{cdtype} {form}",
            expect_finite=True, form=form)


@pytest.mark.parametrize("gdtype", DTYPES)
@pytest.mark.parametrize("sname", list(SPECIAL_SCALARS))
def test_special_value_grid(ocl, sname, gdtype):
    """Every combination of ±0, subnormals, tiny and huge values in p, m, v, g; every copy dtype."""
    s = SPECIAL_SCALARS[sname]
    P, M, V, G = np.meshgrid(_specials(True), _specials(True), _specials(False),
                             _specials(True, gdtype), indexing="ij")
    p, m, v = (_f32_from_bits(x.reshape(-1)) for x in (P, M, V))
    grads = grads_of([G.reshape(-1)], gdtype)
    for cdtype in DTYPES:
        tw = Twin(ocl, p, m, v)
        tw.step(grads, s, cdtype, f"specials {sname} {gdtype}->{cdtype}")


def test_signed_zeros_everywhere(ocl):
    """All-zero state and gradients of both signs: the sign of every zero result must agree."""
    n = 16
    signs = np.array([(i >> b) & 1 for i in range(n) for b in range(4)]).reshape(n, 4)
    z = np.where(signs, -0.0, 0.0).astype(np.float32)
    for gdtype in DTYPES:
        for cdtype in DTYPES:
            tw = Twin(ocl, z[:, 0].copy(), z[:, 1].copy(), np.zeros(n, np.float32))
            g = z[:, 2].astype(GRAD_DTYPES[gdtype])
            for sname in ("default-t1", "zero-eps", "subnormal-eps"):
                tw.step([g, z[:, 3].astype(GRAD_DTYPES[gdtype])], SPECIAL_SCALARS[sname], cdtype,
                        f"zeros {gdtype}->{cdtype} {sname}")


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
def test_ties_in_reduction(ocl, K, gdtype):
    rng = np.random.default_rng(700 + K * 10 + len(gdtype))
    n = 1000
    grad_bits = _reduction_tie_bits(rng, n, K, gdtype)
    p, m, v = wide_state(rng, n)
    s = custom_scalars(inv_scale=0.5)
    assert oracle_ties(p, m, v, grad_bits, gdtype, s, "fp32").ties["acc"] >= n // 3
    for cdtype in DTYPES:
        Twin(ocl, p, m, v).step(grads_of(grad_bits, gdtype), s, cdtype,
                                f"reduction ties K={K} {gdtype}->{cdtype}", expect_finite=True)


def test_ties_in_products(ocl):
    """Products exactly halfway: factor 1.5 times odd significands."""
    n = 4096
    p, m, v, g, s = product_tie_inputs(np.random.default_rng(711), n)
    o = oracle_ties(p, m, v, [g], "fp32", s, "bf16")
    for op in ("p1", "b1m", "omb1g", "b2v", "ns"):
        assert o.ties[op] >= n // 8, (op, o.ties)
    for cdtype in DTYPES:
        Twin(ocl, p, m, v).step(grads_of([g], "fp32"), s, cdtype, f"product ties ->{cdtype}", expect_finite=True)


def test_ties_in_sums(ocl):
    """Sums exactly halfway: m' and v' (g half an ulp of m, g*g half an ulp of v), p' (m half an
    ulp of p with v = 0, eps = 1), d (sqrt(v) exact plus eps half an ulp)."""
    rng = np.random.default_rng(712)
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
            Twin(ocl, p, m, v).step(grads_of([gb], "fp32"), s, cdtype, f"sum ties {name} ->{cdtype}",
                                    expect_finite=True)


@pytest.mark.parametrize("cdtype", DTYPES)
def test_ties_in_device_copy(ocl, cdtype):
    """p' exactly halfway for bf16 / fp16 (normal, subnormal, the 65520 overflow edge): through
    a whole update (g = m = v = 0, decay 1: p' = p) and through write_copy."""
    rng = np.random.default_rng(713)
    p = _copy_tie_values(rng, 2000)
    n = p.size
    z = np.zeros(n, np.float32)
    s = custom_scalars(decay=1.0)
    if cdtype != "fp32":
        o = oracle_ties(p, z, z, [_bits_of(z)], "fp32", s, cdtype)
        assert o.ties["copy-" + cdtype] >= (2000 if cdtype == "bf16" else 4000), o.ties
    tw = Twin(ocl, p, z, z)
    tw.write_copy(cdtype, "copy ties before the update")
    tw.step([z], s, cdtype, f"copy ties {cdtype}", expect_finite=True)
    tw.write_copy(cdtype, "copy ties after the update")


EXTRA_BITS = [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFF800001, 0x7F7FFFFF, 0x7FBFFFFF,
              0x477FEFFF, 0x477FF000, 0x477FF001, 0xC77FF000, 0x33000000, 0x33000001, 0x1,
              0x807FFFFF, 0x387FC000, 0x38800000, 0x7F7F8000, 0x7F7F7FFF, 0x7F7FFFFF, 0xFF7F8000,
              0x3F808000, 0x3F818000, 0x00008000, 0x00018000, 0x80007FFF,
              # NaNs whose payload lies only in the low 16 bits (bf16 must not turn them into inf)
              0x7F800001, 0xFF800001, 0x7F80FFFF, 0x7F810000, 0x7FFFFFFF, 0xFFC00001]


@pytest.mark.parametrize("cdtype", DTYPES)
def test_write_copy_every_class(ocl, cdtype):
    """write_copy right after allocate, on random bit patterns: NaN (any payload), inf,
    overflow to fp16 inf, subnormals, zeros; and after a step that leaves p' = p."""
    rng = np.random.default_rng(714)
    bits = np.concatenate([rng.integers(0, 1 << 32, 1 << 15, dtype=np.uint64), np.array(EXTRA_BITS, np.uint64)])
    p = _f32_from_bits(bits)
    tw = Twin(ocl, p)
    tw.write_copy(cdtype, "after allocate")
    z = np.zeros(p.size, np.float32)
    tw.step([z], custom_scalars(decay=1.0), cdtype, f"p' = p on every class ->{cdtype}", expect_finite=True)
    tw.write_copy(cdtype, "after a step")
    # every special pattern once in the scalar tail (n % 8 elements) and once in a vector lane
    extra = np.array(EXTRA_BITS, np.uint64)
    for r in range(extra.size):
        tw = Twin(ocl, _f32_from_bits(np.roll(extra, r)))
        tw.write_copy(cdtype, f"specials rotated by {r}")
        z = np.zeros(extra.size, np.float32)
        tw.step([z], custom_scalars(decay=1.0), cdtype, f"p' = p, specials rotated by {r}", expect_finite=True)


# --------------------------------------------------------------------------
# non-finite gradients
# --------------------------------------------------------------------------

@pytest.mark.parametrize("case, K, gdtype", list(_nonfinite_cases()))
def test_nonfinite_gradient_changes_nothing(ocl, case, K, gdtype):
    """finite False on both; p, m, v and the device copy untouched; the next finite step agrees
    (the device's finite flag is reset per step)."""
    rng = np.random.default_rng(zlib.crc32(f"nf-{case}-{K}-{gdtype}".encode()))
    n = 8 * 256 + 8 * 5 + 3  # two work-groups of 8-element work-items, and a tail of 3
    p, m, v = wide_state(rng, n)
    # the bad element in the first vector, in the second work-group, in the scalar tail
    for cdtype, i, form in zip(DTYPES, (0, 8 * 256 + 3, n - 1), FORMS):
        grad_bits, s = nonfinite_grads(rng, n, case, K, gdtype, i)
        tw = Twin(ocl, p, m, v)
        copies = (sentinel(n, cdtype), sentinel(n, cdtype))
        tw.step(grads_of(grad_bits, gdtype), s, cdtype, f"{case} K={K} {gdtype}->{cdtype} at {i} {form}",
                expect_finite=False, form=form, copies=copies)
        for name, got in zip("pmv", tw.dut.read_state(tw.layer)):
            assert_same(got, {"p": p, "m": m, "v": v}[name], f"{case}: OpenCL {name} changed")
        assert_same(copies[1], sentinel(n, cdtype), f"{case}: device copy written")
        ok_bits = [wide_grad_bits(rng, n, gdtype) for _ in range(K)]
        tw.step(grads_of(ok_bits, gdtype), StepScalars.compute(AdamWHyper(), 1, divisor=float(K)), cdtype,
                f"finite step after {case}", expect_finite=True, form=form, copies=copies)


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
def test_long_run(ocl, gdtype, K, cdtype, n, persistent):
    """12 steps with step-dependent scalars on the same state, a non-finite step in the middle
    (skipped: t does not advance); every step compared, and write_copy at the start and the end.
    ``persistent``: like the server, one (K, n) gradient block refilled in place and one
    device-copy array per backend for the whole run (a backend that maps host memory must
    see the new gradients, and keep the last good copy through the skipped step);
    otherwise fresh arrays every step, passed as a list."""
    rng = np.random.default_rng(zlib.crc32(f"long-{gdtype}-{K}-{cdtype}-{n}-{persistent}".encode()))
    half = n // 2
    p0 = np.concatenate([rng.standard_normal(half) * 0.02, wide_f32(rng, n - half)]).astype(np.float32)
    tw = Twin(ocl, p0)
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


def test_interleaved_layers(ocl):
    """Layers of different sizes and dtypes stepped in turn share the backend's scratch buffers:
    a large layer, then a small one, then the large one again must not see stale data."""
    rng = np.random.default_rng(715)
    plan = [(3001, "fp32", 1, "bf16"), (1, "bf16", 2, "fp16"), (700, "fp16", 4, "fp32"),
            (257, "bf16", 1, "bf16"), (5000, "fp16", 2, "fp16")]
    twins = [(Twin(ocl, *wide_state(rng, n)), g, K, c) for n, g, K, c in plan]
    for t in range(1, 11):
        order = rng.permutation(len(twins))
        for j in order:
            tw, gdtype, K, cdtype = twins[j]
            grads = [grad_array(wide_grad_bits(rng, tw.n, gdtype), gdtype) for _ in range(K)]
            form = FORMS[(t + j) % len(FORMS)]
            tw.step(grads, StepScalars.compute(AdamWHyper(), t, divisor=float(K)), cdtype,
                    f"interleaved layer {j} step {t} {form}", expect_finite=True, form=form)


@pytest.mark.parametrize("offset", [1, 3])
def test_unaligned_host_arrays(ocl, offset):
    """Gradient block and device copy that start ``offset`` elements into a larger allocation
    (not 16-byte aligned), reused across steps as the server reuses its buffers."""
    rng = np.random.default_rng(720 + offset)
    n, K = 1001, 2
    for gdtype, cdtype in [("fp32", "fp16"), ("fp16", "bf16"), ("bf16", "fp32")]:
        raw = np.zeros(K * n + 8, GRAD_DTYPES[gdtype])
        block = raw[offset:offset + K * n].reshape(K, n)
        craw = [np.zeros(n + 8, COPY_DTYPES[cdtype]) for _ in range(2)]
        copies = tuple(c[offset:offset + n] for c in craw)
        tw = Twin(ocl, *wide_state(rng, n))
        for t in range(1, 6):
            block[...] = np.stack([grad_array(wide_grad_bits(rng, n, gdtype), gdtype) for _ in range(K)])
            tw.step(block, StepScalars.compute(AdamWHyper(), t, divisor=float(K)), cdtype,
                    f"offset {offset} {gdtype}->{cdtype} t={t}", expect_finite=True, form="given", copies=copies)
            for c in craw:  # nothing written outside the view
                assert not _bits_of(c[:offset]).any() and not _bits_of(c[offset + n:]).any()


def test_bad_gradient_shape_changes_nothing(ocl):
    """Contributions of the wrong length are refused by both backends, and nothing changes."""
    rng = np.random.default_rng(721)
    n = 300
    tw = Twin(ocl, *wide_state(rng, n))
    s = StepScalars.compute(AdamWHyper(), 1)
    for grads in ([np.ones(n - 1, np.float32)], np.ones((2, n + 8), np.float32)):
        for be in (tw.ref, tw.dut):
            copy = sentinel(n, "fp32")
            with pytest.raises(ValueError):
                be.step(tw.layer, grads, s, copy)
            assert_same(copy, sentinel(n, "fp32"), f"{be.name}: device copy written by a refused step")
        tw.check_state("after a refused step")
    p0 = tw.ref.read_state(tw.layer)[0]
    assert_same(tw.dut.read_state(tw.layer)[0], p0, "p after refused steps")
    tw.step([grad_array(wide_grad_bits(rng, n, "fp32"), "fp32")], s, "bf16", "good step after refused ones",
            expect_finite=True)


def test_strided_copy_out(ocl):
    """A device copy that is a strided view: NumPy writes it; OpenCL should too (and must not
    update p, m, v without writing the copy)."""
    rng = np.random.default_rng(722)
    n = 37
    tw = Twin(ocl, *wide_state(rng, n))
    wide = [sentinel(2 * n, "fp16") for _ in range(2)]
    tw.step([grad_array(wide_grad_bits(rng, n, "fp32"), "fp32")], StepScalars.compute(AdamWHyper(), 1), "fp16",
            "strided copy_out", expect_finite=True, copies=(wide[0][::2], wide[1][::2]))
    assert_same(wide[1], wide[0], "strided copy_out with the gaps")


# --------------------------------------------------------------------------
# state round trip
# --------------------------------------------------------------------------


def test_read_state_round_trip(ocl):
    """allocate gives (p, +0, +0); write_state/read_state keep every bit, NaN payloads included;
    a wrong shape raises and changes nothing."""
    rng = np.random.default_rng(716)
    n = 1031
    layer = new_layer()
    p0 = wide_f32(rng, n)
    ocl.allocate(layer, p0)
    p, m, v = ocl.read_state(layer)
    assert np.array_equal(_bits_of(p), _bits_of(p0))
    assert not _bits_of(m).any() and not _bits_of(v).any()
    state = [_f32_from_bits(np.concatenate([rng.integers(0, 1 << 32, n - len(EXTRA_BITS), dtype=np.uint64),
                                            np.array(EXTRA_BITS, np.uint64)])) for _ in range(3)]
    ocl.write_state(layer, *state)
    for got, want, name in zip(ocl.read_state(layer), state, "pmv"):
        assert got.dtype == np.float32 and np.array_equal(_bits_of(got), _bits_of(want)), name
    with pytest.raises(ValueError):
        ocl.write_state(layer, state[0], state[1], state[2][:-1])
    for got, want, name in zip(ocl.read_state(layer), state, "pmv"):
        assert np.array_equal(_bits_of(got), _bits_of(want)), f"{name} changed by a rejected write_state"
    # and the loaded state updates like NumPy's (NaN and inf in the state included)
    tw = Twin(ocl, state[0], state[1], state[2])
    tw.step([grad_array(wide_grad_bits(rng, n, "fp32"), "fp32")], StepScalars.compute(AdamWHyper(), 3), "fp16",
            "update from a bit-pattern state")


# --------------------------------------------------------------------------
# through the eager param-server
# --------------------------------------------------------------------------

SERVER_HYPER = AdamWHyper(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.05)


def _server_pair(**kw):
    # the OpenCL server gets a backend of its own: EagerParamServer.close() closes its backend
    return (EagerParamServer(NumpyBackend(), SERVER_HYPER, **kw), EagerParamServer(OpenCLBackend(), SERVER_HYPER, **kw))


def _assert_servers_agree(ref, got, layers, what):
    ref.synchronize()
    got.synchronize()  # step_count() does not wait for a pending update
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
    rng = np.random.default_rng(zlib.crc32(f"srv-{grad_dtype}-{copy_dtype}-{contributors}".encode()))
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

        # a checkpoint with arbitrary state and step counts, loaded into both
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
# the program binary (--cl-binary)
# --------------------------------------------------------------------------


def test_program_binary_round_trip(ocl, tmp_path):
    """program_binary() written to a file and loaded with binary=: the same kernels, the same bits."""
    path = tmp_path / "eps.bin"
    path.write_bytes(ocl.program_binary())
    loaded = OpenCLBackend(binary=str(path))
    try:
        assert sorted(loaded.program.kernel_names.split(";")) == sorted(ocl.program.kernel_names.split(";"))
        rng = np.random.default_rng(717)
        for (gdtype, cdtype), K, n in zip(itertools.product(DTYPES, DTYPES), itertools.cycle([1, 2, 4]),
                                          itertools.cycle([1, 7, 257, 3001])):
            tw = Twin(loaded, *wide_state(rng, n))
            tw.write_copy(cdtype, "binary: after write_state")
            for t in range(1, 5):
                grad_bits = [wide_grad_bits(rng, n, gdtype) for _ in range(K)]
                if t == 3:
                    grad_bits[0][n // 2] = _NAN[gdtype]
                tw.step(grads_of(grad_bits, gdtype), StepScalars.compute(AdamWHyper(), t, divisor=float(K)),
                        cdtype, f"binary: {gdtype} K={K} ->{cdtype} n={n} t={t}", expect_finite=t != 3)
        # special values through the loaded program too
        P, M, V, G = np.meshgrid(_specials(True), _specials(True), _specials(False), _specials(True),
                                 indexing="ij")
        tw = Twin(loaded, *(_f32_from_bits(x.reshape(-1)) for x in (P, M, V)))
        tw.step([_f32_from_bits(G.reshape(-1))], SPECIAL_SCALARS["subnormal-eps"], "fp16", "binary: specials")
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
