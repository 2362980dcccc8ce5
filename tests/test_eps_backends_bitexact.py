"""Every non-NumPy EPS backend against the NumPy golden model, bit for bit: one suite.

docs/eps-numerics.md is the contract; tests/test_eps_contract.py checks the
NumPy backend against an independent oracle (tests/eps_oracle.py), whose vector
generators are reused here: every vector class of the contract goes through the backend under test and
NumpyBackend from the same state, and p, m, v, the finite flag and the device copy
must agree bit for bit (NaN == NaN). Also through the EagerParamServer.

The same bodies serve every backend of ``eps_twin.UNDER_TEST`` (OpenCL on PoCL,
HLS C-simulation): a backend must meet the contract in the same way, so one copy
of each test keeps them from drifting apart. What differs is only where each
one's kernels change path (vector width and work-group, or tile), which
``UNDER_TEST`` holds; the test ids start with the backend's name. What only one
backend has lives in tests/test_eps_opencl.py and tests/test_eps_hls.py.

One backend of each kind serves the whole module (building the OpenCL program
costs a second); every test takes fresh layer ids from ``new_layer()``, so tests
never see each other's layers.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from l2l.eps import OptimizerHyper, EagerParamServer, NumpyBackend, StepScalars
from l2l.eps.numerics import COPY_DTYPES, GRAD_DTYPES

from eps_oracle import (  # tests/ is on sys.path under pytest
    HYPERS,
    SPECIAL_SCALARS,
    bits_of,
    copy_tie_values,
    custom_scalars,
    f32_from_bits,
    grad_array,
    is_nan_bits,
    nonfinite_cases,
    nonfinite_grads,
    odd_f32,
    product_tie_inputs,
    round_bits,
    specials,
    wide_f32,
    wide_grad_bits,
    widen,
)

from eps_twin import (DTYPES, FORMS, UNDER_TEST, Twin, assert_same, grads_of, new_layer, oracle_ties, rng_for,
                      sentinel, wide_state)

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")


@pytest.fixture(scope="module")
def _instances():
    """The backends this module has built, by name, closed when the module is done."""
    made = {}
    yield made
    for be in made.values():
        be.close()


@pytest.fixture(params=list(UNDER_TEST))
def backend(request, _instances):
    """The backend under test, one instance per kind for the whole module, built on first use.
    Kept here rather than in a parametrised module-scoped fixture, which pytest would tear
    down and rebuild whenever consecutive tests want different kinds (as the per-backend
    sizes of test_random_wide_vectors make them)."""
    if request.param not in _instances:
        _instances[request.param] = UNDER_TEST[request.param].make()
    return _instances[request.param]


# --------------------------------------------------------------------------
# random vectors over every binade; every n class, K, gradient and copy dtype
# --------------------------------------------------------------------------

# each backend at its own edge sizes (the ids read opencl-2047-..., hls-csim-1025-...)
EDGE_SIZES = [(name, n) for name, be in UNDER_TEST.items() for n in be.edge_sizes]


@pytest.mark.parametrize("cdtype", DTYPES)
@pytest.mark.parametrize("gdtype", DTYPES)
@pytest.mark.parametrize("K", [1, 2, 4])
@pytest.mark.parametrize("backend, n", EDGE_SIZES, indirect=["backend"])
def test_random_wide_vectors(backend, n, K, gdtype, cdtype):
    """p, m, v, g over all binades (subnormals, both zeros) with random hyper-parameters and t."""
    rng = rng_for(backend, "wide", n, K, gdtype, cdtype)
    p, m, v = wide_state(rng, n)
    grad_bits = [wide_grad_bits(rng, n, gdtype) for _ in range(K)]
    h = HYPERS[int(rng.integers(0, len(HYPERS)))]
    s = StepScalars.compute(h, int(rng.integers(1, 50)), loss_scale=float(2 ** int(rng.integers(0, 17))),
                            divisor=float(K))
    form = FORMS[DTYPES.index(cdtype)]  # every form meets every (n, K, gradient dtype)
    tw = Twin(backend, p, m, v)
    tw.step(grads_of(grad_bits, gdtype), s, cdtype, f"n={n} K={K} {gdtype}->{cdtype} {form}",
            expect_finite=True, form=form)


@pytest.mark.parametrize("gdtype", DTYPES)
@pytest.mark.parametrize("sname", list(SPECIAL_SCALARS))
def test_special_value_grid(backend, sname, gdtype):
    """Every combination of ±0, subnormals, tiny and huge values in p, m, v, g; every copy dtype."""
    s = SPECIAL_SCALARS[sname]
    P, M, V, G = np.meshgrid(specials(True), specials(True), specials(False),
                             specials(True, gdtype), indexing="ij")
    p, m, v = (f32_from_bits(x.reshape(-1)) for x in (P, M, V))
    grads = grads_of([G.reshape(-1)], gdtype)
    for cdtype in DTYPES:
        tw = Twin(backend, p, m, v)
        tw.step(grads, s, cdtype, f"specials {sname} {gdtype}->{cdtype}")


def test_signed_zeros_everywhere(backend):
    """All-zero state and gradients of both signs: the sign of every zero result must agree."""
    n = 16
    signs = np.array([(i >> b) & 1 for i in range(n) for b in range(4)]).reshape(n, 4)
    z = np.where(signs, -0.0, 0.0).astype(np.float32)
    for gdtype in DTYPES:
        for cdtype in DTYPES:
            tw = Twin(backend, z[:, 0].copy(), z[:, 1].copy(), np.zeros(n, np.float32))
            g = z[:, 2].astype(GRAD_DTYPES[gdtype])
            for sname in ("default-t1", "zero-eps", "subnormal-eps"):
                tw.step([g, z[:, 3].astype(GRAD_DTYPES[gdtype])], SPECIAL_SCALARS[sname], cdtype,
                        f"zeros {gdtype}->{cdtype} {sname}")


@pytest.mark.parametrize("gdtype", ["bf16", "fp16"])
def test_every_16_bit_gradient_pattern(backend, gdtype):
    """Widening of every finite bf16 / fp16 bit pattern (subnormals, both zeros): m' = (1 * +0) + g
    exposes g exactly (-0 becomes +0); K = 2 also adds the patterns to their reversal."""
    bits = np.arange(1 << 16, dtype=np.uint64)
    inf_bits = np.uint64(0x7F80 if gdtype == "bf16" else 0x7C00)
    bits = bits[~is_nan_bits(bits, gdtype) & ((bits & np.uint64(0x7FFF)) != inf_bits)]
    n = bits.size
    assert np.isfinite(widen(bits, gdtype)).all()
    z = np.zeros(n, np.float32)
    s = custom_scalars(b1=1.0, omb1=1.0, b2=1.0, omb2=1.0)
    rng = rng_for(backend, "16-bit", gdtype)
    tw = Twin(backend, wide_f32(rng, n), z, z)
    tw.step(grads_of([bits], gdtype), s, "fp32", f"every {gdtype} pattern", expect_finite=True)
    np.testing.assert_array_equal(bits_of(tw.dut.read_state(tw.layer)[1]),
                                  round_bits(0.0 + widen(bits, gdtype), "fp32")[0])
    tw = Twin(backend, wide_f32(rng, n), z, z)
    tw.step(grads_of([bits, bits[::-1].copy()], gdtype), custom_scalars(inv_scale=0.5), "bf16",
            f"every {gdtype} pattern, K=2")


@pytest.mark.parametrize("cdtype", ["bf16", "fp16"])
def test_narrowing_sweep(backend, cdtype):
    """fp32 -> bf16 / fp16 over a stride of the whole bit space and densely around the fp16
    subnormal, normal and overflow boundaries, both signs (write_copy = eps_copy_<c>)."""
    coarse = np.arange(0, 1 << 32, 4093, dtype=np.uint64)
    dense = np.concatenate([np.arange(0x32FF0000, 0x38900000, 97, dtype=np.uint64),
                            np.arange(0x477F0000, 0x47810000, 1, dtype=np.uint64)])
    bits = np.concatenate([coarse, dense, dense | np.uint64(1 << 31)])
    tw = Twin(backend, f32_from_bits(bits))
    tw.write_copy(cdtype, f"narrowing sweep {cdtype}")


# --------------------------------------------------------------------------
# constructed ties: arithmetic and device copy
# --------------------------------------------------------------------------


def _reduction_tie_bits(rng, n, K, gdtype):
    """g_0 plus K-1 contributions of half an ulp of g_0: the running sums land on binary32 ties
    (the construction of test_eps_contract.test_ties_in_reduction)."""
    if gdtype == "fp16":
        e = rng.integers(0, 16, n)
        g0 = round_bits(np.ldexp(1.0 + rng.integers(0, 1024, n) / 1024.0, e), "fp16")[0]
    else:
        mbits = 23 if gdtype == "fp32" else 7
        e = rng.integers(-20, 20, n)
        g0 = round_bits(np.ldexp(1.0 + rng.integers(0, 1 << mbits, n) * 2.0 ** -mbits, e), "fp32")[0]
        if gdtype == "bf16":
            g0 = g0 >> np.uint64(16)
    g0 = g0 | (rng.integers(0, 2, n, dtype=np.uint64) << np.uint64(15 if gdtype != "fp32" else 31))
    sign = np.where(rng.random((K - 1, n)) < 0.5, -1.0, 1.0)
    rest = [np.ldexp(sign[k], e - 24) for k in range(K - 1)]
    rest_bits = [round_bits(r, "fp32" if gdtype == "bf16" else gdtype)[0] for r in rest]
    if gdtype == "bf16":
        rest_bits = [b >> np.uint64(16) for b in rest_bits]
    for b, r in zip(rest_bits, rest):
        assert (widen(b, gdtype) == r).all()
    return [g0] + rest_bits


@pytest.mark.parametrize("gdtype", DTYPES)
@pytest.mark.parametrize("K", [2, 4])
def test_ties_in_reduction(backend, K, gdtype):
    """Contributions whose running sum lands exactly halfway between two binary32 values
    (at least a third of the elements, counted by the oracle); every copy dtype."""
    rng = rng_for(backend, "reduction-ties", K, gdtype)
    n = 1000
    grad_bits = _reduction_tie_bits(rng, n, K, gdtype)
    p, m, v = wide_state(rng, n)
    s = custom_scalars(inv_scale=0.5)
    assert oracle_ties(p, m, v, grad_bits, gdtype, s, "fp32").ties["acc"] >= n // 3
    for cdtype in DTYPES:
        Twin(backend, p, m, v).step(grads_of(grad_bits, gdtype), s, cdtype,
                                    f"reduction ties K={K} {gdtype}->{cdtype}", expect_finite=True)


def test_ties_in_products(backend):
    """Products exactly halfway: factor 1.5 times odd significands."""
    n = 4096
    p, m, v, g, s = product_tie_inputs(rng_for(backend, "product-ties"), n)
    o = oracle_ties(p, m, v, [g], "fp32", s, "bf16")
    for op in ("p1", "b1m", "omb1g", "b2v", "ns"):
        assert o.ties[op] >= n // 8, (op, o.ties)
    for cdtype in DTYPES:
        Twin(backend, p, m, v).step(grads_of([g], "fp32"), s, cdtype, f"product ties ->{cdtype}",
                                    expect_finite=True)


def _sum_tie_cases(rng, n):
    """(name, p, m, v, gradient bits, scalars, operations that tie) for the sums: m' and v' (g half
    an ulp of m, g*g half an ulp of v), p' (m half an ulp of p with v = 0, eps = 1), d (sqrt(v)
    exact plus eps half an ulp)."""
    ones = custom_scalars(decay=1.0, b1=1.0, omb1=1.0, b2=1.0, omb2=1.0, inv_bc2_sqrt=1.0, eps=1.0, neg_step=-1.0)
    cases = []
    # m', v'
    e = rng.integers(-40, 40, n)
    m = (odd_f32(rng, n, 0, 1) * np.ldexp(1.0, e)).astype(np.float32)
    g = np.ldexp(np.where(rng.random(n) < 0.5, -1.0, 1.0), e - 24)
    v = (np.abs(odd_f32(rng, n, 0, 1)) * np.ldexp(1.0, 2 * e - 24)).astype(np.float32)
    cases.append(("m' v'", wide_f32(rng, n), m, v, round_bits(g, "fp32")[0], ones, ("m'", "v'")))
    # p'
    p = odd_f32(rng, n, -100, 100).astype(np.float32)
    ep = np.floor(np.log2(np.abs(p.astype(np.float64))))
    m = (np.where(rng.random(n) < 0.5, -1.0, 1.0) * np.ldexp(1.0, (ep - 24).astype(int))).astype(np.float32)
    z = np.zeros(n, np.float32)
    cases.append(("p'", p, m, z, bits_of(z), ones, ("p'",)))
    # d
    ex = 5
    x = np.ldexp(1.0 + (rng.integers(0, 1 << 10, n) * 2 + 1) * 2.0 ** -11, ex)
    v = (x * x).astype(np.float32)
    s_d = custom_scalars(decay=1.0, b1=1.0, b2=1.0, omb2=1.0, inv_bc2_sqrt=1.0, eps=2.0 ** (ex - 24))
    cases.append(("d", wide_f32(rng, n), wide_f32(rng, n), v, bits_of(z), s_d, ("d",)))
    return cases


def test_ties_in_sums(backend):
    """Sums exactly halfway (see _sum_tie_cases), each case proved to tie by the oracle."""
    n = 4096
    for name, p, m, v, gb, s, ops in _sum_tie_cases(rng_for(backend, "sum-ties"), n):
        o = oracle_ties(p, m, v, [gb], "fp32", s, "fp32")
        for op in ops:
            assert o.ties[op] >= n // 3, (name, op, o.ties)
        for cdtype in DTYPES:
            Twin(backend, p, m, v).step(grads_of([gb], "fp32"), s, cdtype, f"sum ties {name} ->{cdtype}",
                                        expect_finite=True)


@pytest.mark.parametrize("cdtype", DTYPES)
def test_ties_in_device_copy(backend, cdtype):
    """p' exactly halfway for bf16 / fp16 (normal, subnormal, the 65520 overflow edge): through
    a whole update (g = m = v = 0, decay 1: p' = p) and through write_copy."""
    p = copy_tie_values(rng_for(backend, "copy-ties", cdtype), 2000)
    n = p.size
    z = np.zeros(n, np.float32)
    s = custom_scalars(decay=1.0)
    if cdtype != "fp32":
        o = oracle_ties(p, z, z, [bits_of(z)], "fp32", s, cdtype)
        assert o.ties["copy-" + cdtype] >= (2000 if cdtype == "bf16" else 4000), o.ties
    tw = Twin(backend, p, z, z)
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
def test_write_copy_every_class(backend, cdtype):
    """write_copy right after allocate, on random bit patterns: NaN (any payload), inf,
    overflow to fp16 inf, subnormals, zeros; and after a step that leaves p' = p. Then every
    special pattern at every position of a short layer (len(EXTRA_BITS) % 8 == 1: each one
    passes through OpenCL's scalar tail once, and through every vector lane)."""
    rng = rng_for(backend, "write-copy", cdtype)
    bits = np.concatenate([rng.integers(0, 1 << 32, 1 << 15, dtype=np.uint64), np.array(EXTRA_BITS, np.uint64)])
    p = f32_from_bits(bits)
    tw = Twin(backend, p)
    tw.write_copy(cdtype, "after allocate")
    z = np.zeros(p.size, np.float32)
    tw.step([z], custom_scalars(decay=1.0), cdtype, f"p' = p on every class ->{cdtype}", expect_finite=True)
    tw.write_copy(cdtype, "after a step")
    extra = np.array(EXTRA_BITS, np.uint64)
    z = np.zeros(extra.size, np.float32)
    for r in range(extra.size):
        tw = Twin(backend, f32_from_bits(np.roll(extra, r)))
        tw.write_copy(cdtype, f"specials rotated by {r}")
        tw.step([z], custom_scalars(decay=1.0), cdtype, f"p' = p, specials rotated by {r}", expect_finite=True)


# --------------------------------------------------------------------------
# parameter groups: the decay boundary n_decay
# --------------------------------------------------------------------------


def _decay_boundaries(backend, n: int) -> list[int]:
    """n_decay at 0, 1, n - 1, n and on both sides of, at and a half-vector past every place
    where the backend's split of the layer changes (UNDER_TEST.split_at), and an odd one inside
    each piece: most are not multiples of the vector width (8 or 16)."""
    cuts = UNDER_TEST[backend.name].split_at(backend, n)
    assert cuts and all(0 < c < n for c in cuts), cuts
    near = {c + d for c in cuts for d in (-1, 0, 1, 8)}
    inside = {(a + b) // 2 | 1 for a, b in zip((0, *cuts), (*cuts, n))}
    return sorted(b for b in {0, 1, n - 1, n, *near, *inside} if 0 <= b <= n)


def test_parameter_groups(backend):
    """Weight decay on elements [0, n_decay) only: one layer per K (1, 2) stepped once per
    boundary of _decay_boundaries, the gradient and copy dtypes in turn, bit for bit NumPy's
    on one thread. A step without n_decay decays everything, as n_decay = n does."""
    n = UNDER_TEST[backend.name].groups_n
    boundaries = _decay_boundaries(backend, n)
    hyper = OptimizerHyper(lr=1e-2, weight_decay=0.1)  # decay 0.999: p * decay != p for every normal p
    rng = rng_for(backend, "groups")
    for K in (1, 2):
        tw = Twin(backend, *wide_state(rng, n))
        for t, nd in enumerate([*boundaries, None], start=1):
            gdtype, cdtype = DTYPES[t % 3], DTYPES[(t + K) % 3]
            grads = [grad_array(wide_grad_bits(rng, n, gdtype), gdtype) for _ in range(K)]
            s = StepScalars.compute(hyper, t, divisor=float(K))
            assert s.decay != 1.0
            tw.step(grads, s, cdtype, f"n_decay={nd} of {n} K={K} {gdtype}->{cdtype}", expect_finite=True,
                    form=FORMS[t % len(FORMS)], n_decay=nd)


def test_bad_decay_boundary_refused(backend):
    """n_decay outside [0, n] is refused with ValueError before anything is written, by the
    backend under test as by NumPy; a good step follows."""
    rng = rng_for(backend, "bad-n-decay")
    n = 300
    tw = Twin(backend, *wide_state(rng, n))
    s = StepScalars.compute(OptimizerHyper(weight_decay=0.1), 1)
    g = [grad_array(wide_grad_bits(rng, n, "fp32"), "fp32")]
    for nd in (-1, n + 1, 1 << 32):
        for be in (tw.ref, tw.dut):
            copy = sentinel(n, "bf16")
            with pytest.raises(ValueError, match="n_decay"):
                be.step(tw.layer, g, s, copy, n_decay=nd)
            assert_same(copy, sentinel(n, "bf16"), f"{be.name}: device copy written with n_decay={nd}")
        tw.check_state(f"after n_decay={nd} refused")
    tw.step(g, s, "bf16", "good step after refused ones", expect_finite=True, n_decay=n // 2 + 1)


# --------------------------------------------------------------------------
# non-finite gradients
# --------------------------------------------------------------------------

@pytest.mark.parametrize("case, K, gdtype", list(nonfinite_cases()))
def test_nonfinite_gradient_changes_nothing(backend, case, K, gdtype):
    """finite False on both; p, m, v and the device copy untouched; the next finite step agrees
    (the finite flag is reset per step, by the device or by the host driver). The bad element
    goes first, inside a later block, last of a partial block (UNDER_TEST.nonfinite_at)."""
    rng = rng_for(backend, "nonfinite", case, K, gdtype)
    spec = UNDER_TEST[backend.name]
    n = spec.nonfinite_n
    p, m, v = wide_state(rng, n)
    for cdtype, i, form in zip(DTYPES, spec.nonfinite_at, FORMS):
        grad_bits, s = nonfinite_grads(rng, n, case, K, gdtype, i)
        tw = Twin(backend, p, m, v)
        copies = (sentinel(n, cdtype), sentinel(n, cdtype))
        tw.step(grads_of(grad_bits, gdtype), s, cdtype, f"{case} K={K} {gdtype}->{cdtype} at {i} {form}",
                expect_finite=False, form=form, copies=copies)
        for name, got in zip("pmv", tw.dut.read_state(tw.layer)):
            assert_same(got, {"p": p, "m": m, "v": v}[name], f"{case}: {backend.name} {name} changed")
        assert_same(copies[1], sentinel(n, cdtype), f"{case}: device copy written")
        ok_bits = [wide_grad_bits(rng, n, gdtype) for _ in range(K)]
        tw.step(grads_of(ok_bits, gdtype), StepScalars.compute(OptimizerHyper(), 1, divisor=float(K)), cdtype,
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
def test_long_run(backend, gdtype, K, cdtype, n, persistent):
    """12 steps with step-dependent scalars on the same state, a non-finite step in the middle
    (skipped: t does not advance); every step compared, and write_copy at the start and the end.
    ``persistent``: like the server, one (K, n) gradient block refilled in place and one
    device-copy array per backend for the whole run (a backend that maps host memory must
    see the new gradients, and keep the last good copy through the skipped step);
    otherwise fresh arrays every step, passed as a list."""
    rng = rng_for(backend, "long", gdtype, K, cdtype, n, persistent)
    half = n // 2
    p0 = np.concatenate([rng.standard_normal(half) * 0.02, wide_f32(rng, n - half)]).astype(np.float32)
    tw = Twin(backend, p0)
    tw.write_copy(cdtype, "initial copy")
    block = np.zeros((K, n), GRAD_DTYPES[gdtype])
    copies = (sentinel(n, cdtype), sentinel(n, cdtype)) if persistent else None
    hyper = OptimizerHyper()
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


def test_interleaved_layers(backend):
    """Layers of different sizes and dtypes stepped in turn share the backend's scratch buffers:
    a large layer, then a small one, then the large one again must not see stale data."""
    rng = rng_for(backend, "interleaved")
    plan = [(3001, "fp32", 1, "bf16"), (1, "bf16", 2, "fp16"), (700, "fp16", 4, "fp32"),
            (257, "bf16", 1, "bf16"), (5000, "fp16", 2, "fp16")]
    twins = [(Twin(backend, *wide_state(rng, n)), g, K, c) for n, g, K, c in plan]
    for t in range(1, 11):
        order = rng.permutation(len(twins))
        for j in order:
            tw, gdtype, K, cdtype = twins[j]
            grads = [grad_array(wide_grad_bits(rng, tw.n, gdtype), gdtype) for _ in range(K)]
            form = FORMS[(t + j) % len(FORMS)]
            tw.step(grads, StepScalars.compute(OptimizerHyper(), t, divisor=float(K)), cdtype,
                    f"interleaved layer {j} step {t} {form}", expect_finite=True, form=form)


@pytest.mark.parametrize("offset", [1, 3])
def test_unaligned_host_arrays(backend, offset):
    """Gradient block and device copy that start ``offset`` elements into a larger allocation
    (not 16-byte aligned), reused across steps as the server reuses its buffers."""
    rng = rng_for(backend, "unaligned", offset)
    n, K = 1001, 2
    for gdtype, cdtype in [("fp32", "fp16"), ("fp16", "bf16"), ("bf16", "fp32")]:
        raw = np.zeros(K * n + 8, GRAD_DTYPES[gdtype])
        block = raw[offset:offset + K * n].reshape(K, n)
        craw = [np.zeros(n + 8, COPY_DTYPES[cdtype]) for _ in range(2)]
        copies = tuple(c[offset:offset + n] for c in craw)
        tw = Twin(backend, *wide_state(rng, n))
        for t in range(1, 6):
            block[...] = np.stack([grad_array(wide_grad_bits(rng, n, gdtype), gdtype) for _ in range(K)])
            tw.step(block, StepScalars.compute(OptimizerHyper(), t, divisor=float(K)), cdtype,
                    f"offset {offset} {gdtype}->{cdtype} t={t}", expect_finite=True, form="given", copies=copies)
            for c in craw:  # nothing written outside the view
                assert not bits_of(c[:offset]).any() and not bits_of(c[offset + n:]).any()


def test_bad_gradient_shape_changes_nothing(backend):
    """Contributions of the wrong length are refused by both backends, and nothing changes."""
    rng = rng_for(backend, "bad-shape")
    n = 300
    tw = Twin(backend, *wide_state(rng, n))
    s = StepScalars.compute(OptimizerHyper(), 1)
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


def test_strided_copy_out(backend):
    """A device copy that is a strided view, from step and from write_copy: written like NumPy
    writes it, gaps untouched (and p, m, v not updated without writing the copy)."""
    rng = rng_for(backend, "strided")
    n = 37
    tw = Twin(backend, *wide_state(rng, n))
    wide = [sentinel(2 * n, "fp16") for _ in range(2)]
    tw.step([grad_array(wide_grad_bits(rng, n, "fp32"), "fp32")], StepScalars.compute(OptimizerHyper(), 1), "fp16",
            "strided copy_out", expect_finite=True, copies=(wide[0][::2], wide[1][::2]))
    assert_same(wide[1], wide[0], "strided copy_out with the gaps")
    for be, w in zip((tw.ref, tw.dut), wide):
        be.write_copy(tw.layer, w[1::2])
    assert_same(wide[1], wide[0], "strided write_copy")


# --------------------------------------------------------------------------
# state round trip
# --------------------------------------------------------------------------


def test_read_state_round_trip(backend):
    """allocate copies p and gives (p, +0, +0); write_state/read_state keep every bit, NaN
    payloads included, and read_state hands out copies; a wrong shape raises and changes nothing."""
    rng = rng_for(backend, "round-trip")
    n = 1031
    layer = new_layer()
    p0 = wide_f32(rng, n)
    backend.allocate(layer, p0)
    p, m, v = backend.read_state(layer)
    assert np.array_equal(bits_of(p), bits_of(p0))
    assert not bits_of(m).any() and not bits_of(v).any()
    p0[0] = 1.0  # allocate copied p
    assert np.array_equal(bits_of(backend.read_state(layer)[0]), bits_of(p))
    state = [f32_from_bits(np.concatenate([rng.integers(0, 1 << 32, n - len(EXTRA_BITS), dtype=np.uint64),
                                            np.array(EXTRA_BITS, np.uint64)])) for _ in range(3)]
    backend.write_state(layer, *state)
    for got, want, name in zip(backend.read_state(layer), state, "pmv"):
        assert got.dtype == np.float32 and np.array_equal(bits_of(got), bits_of(want)), name
    got = backend.read_state(layer)
    got[0][...] = 0  # read_state hands out copies
    master = backend.read_master(layer)
    assert master.dtype == np.float32 and np.array_equal(bits_of(master), bits_of(state[0]))
    master[...] = 0  # and so does read_master
    with pytest.raises(ValueError):
        backend.write_state(layer, state[0], state[1], state[2][:-1])
    with pytest.raises(ValueError):
        backend.write_state(layer, state[0][:-1], state[1], state[2])
    for got, want, name in zip(backend.read_state(layer), state, "pmv"):
        assert np.array_equal(bits_of(got), bits_of(want)), f"{name} changed by a rejected write_state"
    # and the loaded state updates like NumPy's (NaN and inf in the state included)
    tw = Twin(backend, state[0], state[1], state[2])
    tw.step([grad_array(wide_grad_bits(rng, n, "fp32"), "fp32")], StepScalars.compute(OptimizerHyper(), 3), "fp16",
            "update from a bit-pattern state")


# --------------------------------------------------------------------------
# through the eager param-server
# --------------------------------------------------------------------------

SERVER_HYPER = OptimizerHyper(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.05)


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
def test_server_matches_numpy(backend, grad_dtype, copy_dtype, contributors):
    """Several layers, 8 steps, one non-finite step on one layer, then a checkpoint loaded into
    both servers and 3 more steps: copies, step counts, history and state agree. The server
    under test gets a backend of its own (EagerParamServer.close() closes its backend); the
    module's ``backend`` only says which kind."""
    rng = rng_for(backend, "server", grad_dtype, copy_dtype, contributors)
    sizes = [1, 257, 3001, 40]
    layers = [new_layer() for _ in sizes]
    loss_scale = 1024.0 if grad_dtype == "fp16" else 1.0
    kw = {"copy_dtype": copy_dtype, "grad_dtype": grad_dtype, "contributors": contributors}
    ref = EagerParamServer(NumpyBackend(), SERVER_HYPER, **kw)
    got = EagerParamServer(UNDER_TEST[backend.name].make(), SERVER_HYPER, **kw)
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

        records, cursor = [], 0  # the server keeps only the last few steps' records: read each step's
        for step in range(1, 9):
            one_step(step, bad_layer=layers[2] if step == 4 else None)
            got.synchronize()
            new, cursor = got.records_since(cursor)
            records += new
        assert got.step_count(layers[2]) == 7 and got.step_count(layers[0]) == 8
        assert [r.finite for r in records].count(False) == 1 and len(records) == 8 * len(layers)
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


def test_server_sharing_masters_matches_numpy(backend):
    """EagerParamServer(share_masters=True), as on the CPU device in fp32: a backend that says
    it gives its masters as the copies (the OpenCL EPS on a CPU device) does, and the server
    keeps no copy of its own (copy_bytes); one that does not keeps its copies. Either way
    the run is NumPy's bit for bit, through a non-finite step and a checkpoint load."""
    rng = rng_for(backend, "shared masters")
    sizes = [257, 3001]
    layers = [new_layer() for _ in sizes]
    ref = EagerParamServer(NumpyBackend(), SERVER_HYPER, share_masters=True)
    got = EagerParamServer(UNDER_TEST[backend.name].make(), SERVER_HYPER, share_masters=True)
    try:
        for layer, n in zip(layers, sizes):
            p = (rng.standard_normal(n) * 0.05).astype(np.float32)
            ref.add_layer(layer, p)
            got.add_layer(layer, p)
        shares = type(got.backend).shares_masters()
        assert shares is (got.backend.master_as_copy(layers[0]) is not None)
        assert ref.copy_bytes == 0 and got.copy_bytes == (0 if shares else 4 * sum(sizes))
        assert not shares or all(got.fetch(layer) is got.backend.master_as_copy(layer) for layer in layers)

        def one_step(step, bad_layer=None):
            for layer, n in zip(layers, sizes):
                g = (rng.standard_normal(n) * 1e-2).astype(np.float32)
                if layer == bad_layer:
                    g[n // 3] = np.inf
                for srv in (ref, got):
                    srv.gradient_inbox(layer)[:] = g
                    srv.push_gradient(layer, divisor=1.0)
            _assert_servers_agree(ref, got, layers, f"step {step}")

        for step in range(1, 6):
            one_step(step, bad_layer=layers[1] if step == 3 else None)
        tensors = {f"layer{layer}.{k}": a for layer, n in zip(layers, sizes)
                   for k, a in zip("pmv", wide_state(rng, n))}
        meta = {"steps": {str(layer): 7 for layer in layers}}
        for srv in (ref, got):
            srv.load_state(tensors, meta)
        _assert_servers_agree(ref, got, layers, "after load_state")
        for step in range(6, 8):
            one_step(step)
    finally:
        ref.close()
        got.close()


# --------------------------------------------------------------------------
# arguments refused, degenerate layers
# --------------------------------------------------------------------------


def test_empty_layer(backend):
    """n = 0: nothing to do, finite; no zero-length device buffer is ever asked for."""
    for gdtype, cdtype in itertools.product(DTYPES, DTYPES):
        tw = Twin(backend, np.zeros(0, np.float32))
        tw.step([np.zeros(0, GRAD_DTYPES[gdtype])] * 2, StepScalars.compute(OptimizerHyper(), 1), cdtype,
                f"n=0 {gdtype}->{cdtype}", expect_finite=True)
        tw.write_copy(cdtype, "n=0")


def test_malformed_step_refused(backend):
    """Refused with ValueError before anything is written: mixed gradient dtypes, no
    contributions, a float64 gradient, a device copy of the wrong dtype or length or a
    read-only one. (Contributions of the wrong length: test_bad_gradient_shape_changes_nothing.)"""
    rng = np.random.default_rng(821)
    n = 300
    tw = Twin(backend, *wide_state(rng, n))
    s = StepScalars.compute(OptimizerHyper(), 1)
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
