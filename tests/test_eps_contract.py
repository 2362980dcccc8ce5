"""The NumPy EPS (the golden model) against an independent evaluation of the contract.

docs/eps-numerics.md is the contract; tests/eps_oracle.py evaluates it
by another route (binary64 arithmetic and integer rounding, never a NumPy
cast) and generates its vector classes. Results are compared as bit patterns;
NaNs compare as "both NaN".
"""
from __future__ import annotations

import math
import struct
import zlib

import numpy as np
import pytest

from l2l.eps import OptimizerHyper, NumpyBackend, StepScalars
from l2l.eps import numerics
from l2l.eps.numerics import CHUNK, COPY_DTYPES, GRAD_DTYPES

from eps_oracle import (  # tests/ is on sys.path under pytest
    HYPERS,
    SPECIAL_SCALARS,
    Oracle,
    assert_bits,
    assert_f32,
    bf16_bits_from_f32_bits,
    bits_of,
    copy_tie_values,
    custom_scalars,
    f32_from_bits,
    f32_value,
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

# Overflow, inf and NaN are contract behaviour here; NumPy's RuntimeWarnings about them are noise.
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")


def run_backend(p, m, v, grads, s, cdtype, layer=0):
    """One NumpyBackend step on the given state; returns (finite, p, m, v, copy)."""
    be = NumpyBackend()
    be.allocate(layer, p)
    be.write_state(layer, p, m, v)
    copy = np.empty(p.shape[0], COPY_DTYPES[cdtype])
    finite = be.step(layer, grads, s, copy)
    return (finite, *be.read_state(layer), copy)


def check_step(p, m, v, grad_bits, gdtype, s, cdtype, oracle=None, what=""):
    """Run the backend and the oracle on one step and compare everything bit for bit."""
    oracle = oracle or Oracle()
    grads = [grad_array(b, gdtype) for b in grad_bits]
    finite, p_, m_, v_, copy = run_backend(p, m, v, grads, s, cdtype)
    g, ofinite = oracle.reduce(grad_bits, gdtype, s.inv_scale)
    assert finite == ofinite, what
    assert finite, f"{what}: test vectors meant to be finite"
    ep, em, ev = oracle.adamw(p.astype(np.float64), m.astype(np.float64), v.astype(np.float64), g, s)
    # also the reduction on its own
    red = np.empty(p.shape[0], np.float32)
    assert numerics.reduce_gradients(grads, s.inv_scale, red) is True
    assert_f32(red, g, f"{what} reduced g")
    assert_f32(p_, ep, f"{what} p'")
    assert_f32(m_, em, f"{what} m'")
    assert_f32(v_, ev, f"{what} v'")
    assert_bits(copy, oracle.copy_bits(ep, cdtype), cdtype, f"{what} copy")
    return oracle


# --------------------------------------------------------------------------
# the oracle itself
# --------------------------------------------------------------------------


def test_oracle_rounding_against_struct():
    rng = np.random.default_rng(0)
    # binary64 -> binary32: random doubles in and around the binary32 range, halfway cases too
    xs = list(rng.standard_normal(2000) * 10.0 ** rng.integers(-46, 39, 2000))
    f = [1.0, 2.0 ** -149, 2.0 ** -150, 3 * 2.0 ** -151, 2.0 ** -126 - 2.0 ** -150, 1 + 2.0 ** -24,
         1 + 3 * 2.0 ** -24, -(1 + 2.0 ** -24), 3.4028234663852886e38, 2.0 ** 128 - 2.0 ** 103,
         2.0 ** 128 - 2.0 ** 104 + 1e20, 0.0, -0.0, 1e-300]
    xs += f
    bits, _ = round_bits(xs, "fp32")
    for x, b in zip(xs, bits):
        try:
            want = struct.unpack("<I", struct.pack("<f", x))[0]
        except OverflowError:
            want = 0x7F800000 | (0x80000000 if x < 0 else 0)
        assert int(b) == want, (x, hex(int(b)), hex(want))
    # binary32 -> binary16: every class, halfway cases included
    ys = list(f32_value(rng.integers(0, 1 << 32, 4000, dtype=np.uint64)))
    ys += [65504.0, 65519.0, 65520.0, 65536.0, 2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -26, 2.0 ** -26,
           1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, 2.0 ** -14 - 2.0 ** -25, -65520.0]
    bits, _ = round_bits(ys, "fp16")
    for y, b in zip(ys, bits):
        if math.isnan(y):
            assert is_nan_bits(b, "fp16"), y
            continue
        try:
            want = struct.unpack("<H", struct.pack("<e", y))[0]
        except OverflowError:
            want = 0x7C00 | (0x8000 if y < 0 else 0)
        assert int(b) == want, (y, hex(int(b)), hex(want))
    # bfloat16 from the uint32 pattern: hand-checked cases
    cases = {0x3F808000: 0x3F80, 0x3F818000: 0x3F82, 0x3F808001: 0x3F81, 0x7F7FFFFF: 0x7F80,
             0xFF7FFFFF: 0xFF80, 0x00008000: 0x0000, 0x00018000: 0x0002, 0x80007FFF: 0x8000,
             0x7F800000: 0x7F80, 0x7F7F8000: 0x7F80, 0x7F7E8000: 0x7F7E}
    got, _ = bf16_bits_from_f32_bits(np.array(list(cases), np.uint64))
    assert [int(x) for x in got] == list(cases.values())
    nan, _ = bf16_bits_from_f32_bits(np.array([0x7F800001, 0xFFC00000], np.uint64))
    assert is_nan_bits(nan, "bf16").all()
    # fp16 widening against struct
    hb = np.arange(1 << 16, dtype=np.uint64)
    w = widen(hb, "fp16")
    for i in range(0, 1 << 16, 97):
        want = struct.unpack("<e", struct.pack("<H", i))[0]
        assert (math.isnan(want) and math.isnan(w[i])) or w[i] == want, i


def _scalars_oracle(h: OptimizerHyper, t: int, loss_scale: float, divisor: float) -> dict:
    f64 = np.float64
    one = f64(1.0)
    vals = {
        "decay": one - f64(h.lr) * f64(h.weight_decay),
        "b1": f64(h.beta1),
        "omb1": one - f64(h.beta1),
        "b2": f64(h.beta2),
        "omb2": one - f64(h.beta2),
        "inv_bc2_sqrt": one / np.sqrt(one - np.power(f64(h.beta2), f64(t))),
        "eps": f64(h.eps),
        "neg_step": -f64(h.lr) / (one - np.power(f64(h.beta1), f64(t))),
        "inv_scale": one / (f64(loss_scale) * f64(divisor)),
    }
    return {k: int(round_bits(v, "fp32")[0][0]) for k, v in vals.items()}


@pytest.mark.parametrize("hi", range(len(HYPERS)))
def test_step_scalars_table(hi):
    h = HYPERS[hi]
    assert StepScalars.names() == ("decay", "b1", "omb1", "b2", "omb2", "inv_bc2_sqrt", "eps",
                                   "neg_step", "inv_scale")
    for t in list(range(1, 40)) + [100, 1000, 12345, 10 ** 6]:
        for loss_scale, divisor in [(1.0, 1.0), (1024.0, 3.0), (65536.0, 8.0), (0.5, 1.0), (1.0, 7.0)]:
            s = StepScalars.compute(h, t, loss_scale, divisor)
            want = _scalars_oracle(h, t, loss_scale, divisor)
            for name, val in zip(StepScalars.names(), s.as_tuple()):
                assert isinstance(val, np.float32), (name, type(val))
                got = int(np.asarray(val).view(np.uint32))
                assert got == want[name], (h, t, loss_scale, divisor, name, hex(got), hex(want[name]))
            # and each scalar is within half an ulp (+ a few binary64 ulps) of the exact value
            bc2 = 1.0 - h.beta2 ** t
            assert math.isclose(float(s.inv_bc2_sqrt), 1.0 / math.sqrt(bc2), rel_tol=2.0 ** -23)


def test_step_scalars_reject_t0():
    with pytest.raises(ValueError):
        StepScalars.compute(OptimizerHyper(), 0)


# --------------------------------------------------------------------------
# the update, vector class by vector class
# --------------------------------------------------------------------------

NS = [1, 7, 33, CHUNK + 3]


@pytest.mark.parametrize("cdtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("gdtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("K", [1, 2, 4])
@pytest.mark.parametrize("n", NS)
def test_random_wide_vectors(n, K, gdtype, cdtype):
    """Random p, m, v, g over many binades (subnormals and both zeros included)."""
    seed = zlib.crc32(f"{n}-{K}-{gdtype}-{cdtype}".encode())
    rng = np.random.default_rng(seed)
    p = wide_f32(rng, n)
    m = wide_f32(rng, n)
    v = wide_f32(rng, n, nonneg=True)
    grad_bits = [wide_grad_bits(rng, n, gdtype) for _ in range(K)]
    h = HYPERS[int(rng.integers(0, len(HYPERS)))]
    s = StepScalars.compute(h, int(rng.integers(1, 50)), loss_scale=float(2 ** int(rng.integers(0, 17))),
                            divisor=float(K))
    check_step(p, m, v, grad_bits, gdtype, s, cdtype, what=f"n={n} K={K} {gdtype}->{cdtype}")


@pytest.mark.parametrize("gdtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("sname", list(SPECIAL_SCALARS))
def test_special_value_grid(sname, gdtype):
    """Every combination of zeros (both signs), subnormals, tiny/huge values in p, m, v, g."""
    s = SPECIAL_SCALARS[sname]
    P, M, V, G = np.meshgrid(specials(True), specials(True), specials(False),
                             specials(True, gdtype), indexing="ij")
    p, m, v = (f32_from_bits(x.reshape(-1)) for x in (P, M, V))
    cdtype = {"fp32": "bf16", "bf16": "fp16", "fp16": "fp32"}[gdtype]
    check_step(p, m, v, [G.reshape(-1)], gdtype, s, cdtype, what=f"specials {sname} {gdtype}")


@pytest.mark.parametrize("gdtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("K", [2, 4])
def test_ties_in_reduction(K, gdtype):
    """Contributions whose exact running sum lies halfway between two binary32 values."""
    rng = np.random.default_rng(K * 10 + len(gdtype))
    n = 1000
    if gdtype == "fp16":
        e = rng.integers(0, 16, n)
        g0 = round_bits(np.ldexp(1.0 + rng.integers(0, 1024, n) / 1024.0, e), "fp16")[0]
    else:
        e = rng.integers(-20, 20, n)
        mant = rng.integers(0, 1 << (23 if gdtype == "fp32" else 7), n) * 2.0 ** -(23 if gdtype == "fp32" else 7)
        g0 = round_bits(np.ldexp(1.0 + mant, e), "fp32")[0]
        if gdtype == "bf16":
            g0 = g0 >> np.uint64(16)
    g0 = g0 | (rng.integers(0, 2, n, dtype=np.uint64) << np.uint64(15 if gdtype != "fp32" else 31))
    sign = np.where(rng.random((K - 1, n)) < 0.5, -1.0, 1.0)
    rest = [np.ldexp(sign[k], e - 24) for k in range(K - 1)]  # half an ulp of g0
    fmt = "fp32" if gdtype == "bf16" else gdtype
    rest_bits = [round_bits(r, fmt)[0] for r in rest]
    if gdtype == "bf16":
        rest_bits = [b >> np.uint64(16) for b in rest_bits]
    for b, r in zip(rest_bits, rest):  # the half-ulps are exact in the gradient format
        assert (widen(b, gdtype) == r).all()
    p = wide_f32(rng, n)
    m = wide_f32(rng, n)
    v = wide_f32(rng, n, nonneg=True)
    s = custom_scalars(inv_scale=0.5)
    o = check_step(p, m, v, [g0] + rest_bits, gdtype, s, "fp32", what=f"reduction ties K={K} {gdtype}")
    assert o.ties["acc"] >= n // 3, o.ties


def test_ties_in_products():
    """Products exactly halfway (p*decay, b1*m, b2*v, omb1*g, ...)."""
    n = 4096
    p, m, v, g, s = product_tie_inputs(np.random.default_rng(11), n)
    o = check_step(p, m, v, [g], "fp32", s, "bf16", what="product ties")
    for op in ("p1", "b1m", "omb1g", "b2v", "ns"):
        assert o.ties[op] >= n // 8, (op, o.ties)


def test_ties_in_sums():
    """Sums exactly halfway: m + (half ulp of m), v + g*g, p + (-m'/d), sqrt(v)*1 + eps."""
    rng = np.random.default_rng(12)
    n = 4096
    o = Oracle()
    # m' = m + g and v' = v + g*g with g half an ulp of m, and g*g half an ulp of v
    e = rng.integers(-40, 40, n)
    m = (odd_f32(rng, n, 0, 1) * np.ldexp(1.0, e)).astype(np.float32)
    g = np.ldexp(np.where(rng.random(n) < 0.5, -1.0, 1.0), e - 24)
    v = (np.abs(odd_f32(rng, n, 0, 1)) * np.ldexp(1.0, 2 * e - 24)).astype(np.float32)
    p = wide_f32(rng, n)
    s = custom_scalars(decay=1.0, b1=1.0, omb1=1.0, b2=1.0, omb2=1.0, inv_bc2_sqrt=1.0, eps=1.0, neg_step=-1.0)
    check_step(p, m, v, [round_bits(g, "fp32")[0]], "fp32", s, "fp16", oracle=o, what="sum ties m', v'")
    assert o.ties["m'"] >= n // 3 and o.ties["v'"] >= n // 3, o.ties
    # p' = p + (-m) with g = 0, v = 0 (so d = eps = 1): m = -(half an ulp of p)
    p = odd_f32(rng, n, -100, 100).astype(np.float32)
    ep = np.floor(np.log2(np.abs(p.astype(np.float64))))
    m = (np.where(rng.random(n) < 0.5, -1.0, 1.0) * np.ldexp(1.0, (ep - 24).astype(int))).astype(np.float32)
    z = np.zeros(n, np.float32)
    check_step(p, m, z, [bits_of(z)], "fp32", s, "bf16", oracle=o, what="sum ties p'")
    assert o.ties["p'"] >= n // 3, o.ties
    # d = sqrt(v) + eps: v = x*x exact with x of 12 significant bits, eps half an ulp of x
    ex = 5
    j = rng.integers(0, 1 << 10, n) * 2 + 1
    x = np.ldexp(1.0 + j * 2.0 ** -11, ex)
    v = (x * x).astype(np.float32)
    assert (v.astype(np.float64) == x * x).all()
    s_d = custom_scalars(decay=1.0, b1=1.0, b2=1.0, omb2=1.0, inv_bc2_sqrt=1.0, eps=2.0 ** (ex - 24))
    check_step(wide_f32(rng, n), wide_f32(rng, n), v, [bits_of(z)], "fp32", s_d, "fp32", oracle=o,
               what="sum ties d")
    assert o.ties["d"] >= n // 2, o.ties


@pytest.mark.parametrize("cdtype", ["bf16", "fp16", "fp32"])
def test_ties_in_device_copy(cdtype):
    """p' whose discarded bits are exactly half, through a whole update (p' = p) and device_copy."""
    rng = np.random.default_rng(13)
    p = copy_tie_values(rng, 2000)
    n = p.size
    z = np.zeros(n, np.float32)
    s = custom_scalars(decay=1.0)  # g = m = v = 0: p' = p + (-0) = p
    o = check_step(p, z, z, [bits_of(z)], "fp32", s, cdtype, what=f"copy ties {cdtype}")
    if cdtype != "fp32":
        assert o.ties["copy-" + cdtype] >= (2000 if cdtype == "bf16" else 4000), o.ties
    out = np.empty(n, COPY_DTYPES[cdtype])
    numerics.device_copy(p, out)
    assert_bits(out, Oracle().copy_bits(p.astype(np.float64), cdtype), cdtype, f"device_copy {cdtype}")


@pytest.mark.parametrize("cdtype", ["bf16", "fp16", "fp32"])
def test_device_copy_every_class(cdtype):
    """device_copy on random bit patterns: NaN, inf, overflow, subnormals, zeros."""
    rng = np.random.default_rng(14)
    bits = rng.integers(0, 1 << 32, 1 << 18, dtype=np.uint64)
    extra = [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFF800001, 0x7F7FFFFF,
             0x477FEFFF, 0x477FF000, 0x477FF001, 0xC77FF000, 0x33000000, 0x33000001, 0x1,
             0x807FFFFF, 0x387FC000, 0x38800000, 0x7F7F8000, 0x7F7F7FFF]
    bits = np.concatenate([bits, np.array(extra, np.uint64)])
    p = f32_from_bits(bits)
    out = np.empty(p.size, COPY_DTYPES[cdtype])
    numerics.device_copy(p, out)
    assert_bits(out, Oracle().copy_bits(f32_value(bits), cdtype), cdtype, f"device_copy {cdtype}")


def test_device_copy_rejects_other_dtypes():
    with pytest.raises(ValueError):
        numerics.device_copy(np.zeros(3, np.float32), np.zeros(3, np.float64))
    assert set(COPY_DTYPES) == {"fp32", "bf16", "fp16"} and set(GRAD_DTYPES) == {"fp32", "bf16", "fp16"}


def test_reduce_gradients_rejects_bad_input():
    out = np.empty(4, np.float32)
    with pytest.raises(ValueError):
        numerics.reduce_gradients([], np.float32(1), out)
    with pytest.raises(ValueError):
        numerics.reduce_gradients([np.zeros(5, np.float32)], np.float32(1), out)


@pytest.mark.parametrize("case, K, gdtype", list(nonfinite_cases()))
def test_nonfinite_gradient_changes_nothing(case, K, gdtype):
    rng = np.random.default_rng(K)
    n = 37
    p, m = wide_f32(rng, n), wide_f32(rng, n)
    v = wide_f32(rng, n, nonneg=True)
    i = int(rng.integers(0, n))
    grad_bits, s = nonfinite_grads(rng, n, case, K, gdtype, i)
    grads = [grad_array(b, gdtype) for b in grad_bits]
    red = np.empty(n, np.float32)
    assert numerics.reduce_gradients(grads, s.inv_scale, red) is False
    be = NumpyBackend()
    be.allocate(3, p)
    be.write_state(3, p, m, v)
    copy = np.empty(n, COPY_DTYPES["bf16"])
    copy.view(np.uint16)[:] = 0x1234  # sentinel
    assert be.step(3, grads, s, copy) is False
    p_, m_, v_ = be.read_state(3)
    for got, want, name in ((p_, p, "p"), (m_, m, "m"), (v_, v, "v")):
        assert_bits(got, bits_of(want), "fp32", f"{case}: {name} changed")
    assert (copy.view(np.uint16) == 0x1234).all(), "device copy was written"


# --------------------------------------------------------------------------
# a long run: the oracle keeps its own state, so any drift would accumulate
# --------------------------------------------------------------------------


@pytest.mark.parametrize("gdtype,K,cdtype", [("fp32", 1, "fp16"), ("bf16", 2, "bf16"), ("fp16", 4, "fp32")])
def test_long_run(gdtype, K, cdtype):
    rng = np.random.default_rng(99 + K)
    n = CHUNK + 3
    half = n // 2
    p0 = np.concatenate([(rng.standard_normal(half) * 0.02), wide_f32(rng, n - half)]).astype(np.float32)
    hyper = OptimizerHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    be = NumpyBackend()
    be.allocate(0, p0)
    copy = np.empty(n, COPY_DTYPES[cdtype])
    be.write_copy(0, copy)
    assert_bits(copy, Oracle().copy_bits(p0.astype(np.float64), cdtype), cdtype, "initial copy")
    o = Oracle()
    op, om, ov = p0.astype(np.float64), np.zeros(n), np.zeros(n)
    steps = 12
    for t in range(1, steps + 1):
        if gdtype == "fp16":
            real = rng.standard_normal((K, half)) * 10.0 ** rng.uniform(-6, 3, (K, half))
            real_bits = [round_bits(r, "fp16")[0] for r in real]
        else:
            real = rng.standard_normal((K, half)) * 10.0 ** rng.uniform(-10, 3, (K, half))
            real_bits = [round_bits(r, "fp32")[0] for r in real]
            if gdtype == "bf16":
                real_bits = [b >> np.uint64(16) for b in real_bits]
        grad_bits = [np.concatenate([rb, wide_grad_bits(rng, n - half, gdtype)]) for rb in real_bits]
        s = StepScalars.compute(hyper, t, loss_scale=1024.0 if gdtype == "fp16" else 1.0, divisor=float(K))
        g, finite = o.reduce(grad_bits, gdtype, s.inv_scale)
        assert finite
        op, om, ov = o.adamw(op, om, ov, g, s)
        assert be.step(0, [grad_array(b, gdtype) for b in grad_bits], s, copy) is True
        p_, m_, v_ = be.read_state(0)
        assert_f32(p_, op, f"step {t} p")
        assert_f32(m_, om, f"step {t} m")
        assert_f32(v_, ov, f"step {t} v")
        assert_bits(copy, o.copy_bits(op, cdtype), cdtype, f"step {t} copy")
    # the realistic half really moved and stayed finite
    assert np.isfinite(op[:half]).all() and not np.array_equal(op[:half], p0[:half].astype(np.float64))


# --------------------------------------------------------------------------
# torch.optim.AdamW agreement
# --------------------------------------------------------------------------


def test_agrees_with_torch_adamw():
    import torch
    rng = np.random.default_rng(2024)
    n = 50_000
    hyper = OptimizerHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    p0 = (rng.standard_normal(n) * 0.02).astype(np.float32)
    w = torch.nn.Parameter(torch.from_numpy(p0.copy()))
    opt = torch.optim.AdamW([w], lr=hyper.lr, betas=(hyper.beta1, hyper.beta2), eps=hyper.eps,
                            weight_decay=hyper.weight_decay, foreach=False)
    be = NumpyBackend()
    be.allocate(0, p0)
    copy = np.empty(n, np.float32)
    for t in range(1, 11):
        g = (rng.standard_normal(n) * 10.0 ** rng.uniform(-4, 0)).astype(np.float32)
        w.grad = torch.from_numpy(g.copy())
        opt.step()
        assert be.step(0, [g], StepScalars.compute(hyper, t), copy) is True
    ours = be.read_state(0)[0].astype(np.float64)
    theirs = w.detach().numpy().astype(np.float64)
    rel = float(np.max(np.abs(ours - theirs)) / np.max(np.abs(theirs)))
    print(f"\nNumPy EPS vs torch.optim.AdamW after 10 steps: max|diff|/max|w| = {rel:.3e}")
    assert rel <= 1e-6, f"max|diff|/max|w| = {rel:.3e}"
    assert np.array_equal(copy, ours.astype(np.float32))


@pytest.mark.parametrize("gdtype", ["bf16", "fp16"])
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_one_unscaled_narrow_contribution_updates_from_itself(gdtype, bad):
    """K = 1 and a scale of 1 (bf16 training): the NumPy EPS widens the gradient a chunk at a
    time instead of reducing it into a layer-sized buffer: the same bits as the reduction,
    and a non-finite element (found by its exponent bits) still changes nothing."""
    rng = np.random.default_rng(7)
    n = 3 * numerics.CHUNK + 11  # several chunks and a tail
    p, m = wide_f32(rng, n), wide_f32(rng, n)
    v = wide_f32(rng, n, nonneg=True)
    g = (rng.standard_normal(n) * 1e-2).astype(GRAD_DTYPES[gdtype])
    s = StepScalars.compute(OptimizerHyper(lr=1e-3), 3, 1.0, 1.0)
    assert s.inv_scale == np.float32(1) and numerics.unreduced([g], s.inv_scale, n) is g
    widened = np.empty(n, np.float32)
    assert numerics.reduce_gradients([g], s.inv_scale, widened)
    want = [a.copy() for a in (p, m, v)]
    want_copy = np.empty(n, COPY_DTYPES["bf16"])
    numerics.adamw_update(*want, widened, s, copy_out=want_copy)
    be = NumpyBackend()
    be.allocate(0, p)
    be.write_state(0, p, m, v)
    copy = np.empty(n, COPY_DTYPES["bf16"])
    assert be.step(0, [g], s, copy) is True
    for got, exp in zip(be.read_state(0), want):
        assert np.array_equal(got.view(np.uint32), exp.view(np.uint32))
    assert np.array_equal(copy.view(np.uint16), want_copy.view(np.uint16))
    g[2 * numerics.CHUNK + 5] = bad
    before = be.read_state(0)
    assert be.step(0, [g], s, copy) is False
    for got, exp in zip(be.read_state(0), before):
        assert np.array_equal(got.view(np.uint32), exp.view(np.uint32))
