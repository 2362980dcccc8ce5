"""The EPS contract evaluated independently, and the generators of its vector classes.

One module for every suite that needs them: tests/test_eps_contract.py (the
golden model against this oracle), the backend suites (tests/eps_twin.py,
tests/test_eps_backends_bitexact.py, ...) and the RTL testbenches
(sim/eps_vectors.py), so all of them draw from the same distributions and
judge by the same evaluation.

docs/eps-numerics.md is the contract. The oracle here evaluates it by a
different route than l2l.eps.numerics:

* every binary32 operation is evaluated in binary64 (NumPy float64) and then
  rounded to binary32 by integer manipulation of the binary64 bit pattern
  (``round_bits``), never by a NumPy or ml_dtypes cast. Double rounding
  (exact -> binary64 -> binary32) is innocuous here: binary64 has 53 >= 2*24 + 2
  significand bits, and for ``+ - * / sqrt`` of binary32 operands the binary64
  result can never land exactly on a binary32 midpoint unless the exact result
  is that midpoint (Figueroa 1995). Products of two binary32 values are exact in
  binary64 (48 bits, exponent range far inside binary64's); sums whose result
  is binary32-subnormal are exact (multiples of 2**-149 below 2**-126); a
  quotient or square root differs from any <= 25-bit midpoint by far more
  than 2**-53 relative. So subnormal results round correctly too.
* bfloat16 rounding is done on the uint32 pattern (add 0x7fff + lsb, shift),
  binary16 rounding by the same bit-level rounder as binary32 with the
  binary16 parameters, and both are checked against Python's ``struct``.
* bfloat16 / binary16 gradients are widened by decoding their bit patterns.

Results are compared as bit patterns; NaNs compare as "both NaN".
"""
from __future__ import annotations

import collections
import math

import ml_dtypes
import numpy as np

from l2l.eps import LambScalars, LionScalars, OptimizerHyper, StepScalars

# --------------------------------------------------------------------------
# The oracle
# --------------------------------------------------------------------------

# (mantissa bits, emin, exponent bits, total bits)
FMT = {"fp32": (23, -126, 8, 32), "fp16": (10, -14, 5, 16), "bf16": (7, -126, 8, 16)}
UINT = {32: np.uint32, 16: np.uint16}


def round_bits(x, fmt: str):
    """Round float64 ``x`` to ``fmt`` nearest-even by integer arithmetic.

    Returns (bit patterns as uint64, mask of exact ties). Overflow gives inf
    with the sign of ``x``; subnormal results are kept; NaN stays NaN.
    """
    mbits, emin, ebits, total = FMT[fmt]
    x = np.ascontiguousarray(np.asarray(x, dtype=np.float64)).reshape(-1)
    b = x.view(np.uint64)
    sign = b >> np.uint64(63)
    E = ((b >> np.uint64(52)) & np.uint64(0x7FF)).astype(np.int64)
    frac = b & np.uint64((1 << 52) - 1)
    inf_bits = ((1 << ebits) - 1) << mbits
    is_nan = (E == 0x7FF) & (frac != 0)
    is_inf = (E == 0x7FF) & (frac == 0)
    # binary64 subnormals (< 2**-1022) are far below half the smallest target subnormal
    fin = (E != 0x7FF) & (E != 0)
    M = frac | np.uint64(1 << 52)                      # x = M * 2**(E - 1075)
    e = E - 1023                                       # unbiased exponent of x
    q = np.maximum(e - mbits, emin - mbits)            # exponent of the target quantum
    s = np.clip(q - (E - 1075), 1, 63).astype(np.uint64)  # bits to discard (>= 29 for finite)
    R = M >> s
    rem = M & ((np.uint64(1) << s) - np.uint64(1))
    half = np.uint64(1) << (s - np.uint64(1))
    up = (rem > half) | ((rem == half) & ((R & np.uint64(1)) == 1))
    R = R + up.astype(np.uint64)
    # one formula for normal and subnormal results; a carry bumps the exponent
    bits = (np.maximum(q - (emin - mbits), 0).astype(np.uint64) << np.uint64(mbits)) + R
    bits = np.minimum(bits, np.uint64(inf_bits))       # overflow -> inf
    out = np.where(fin, bits, np.uint64(0))
    out = np.where(is_inf, np.uint64(inf_bits), out)
    out = np.where(is_nan, np.uint64(inf_bits | (1 << (mbits - 1))), out)
    out = out | (sign << np.uint64(total - 1))
    ties = fin & (rem == half)
    return out, ties


def bf16_bits_from_f32_bits(u):
    """bfloat16 nearest-even from binary32 bit patterns, on the integer pattern."""
    u = np.asarray(u).astype(np.uint64)
    nan = (u & np.uint64(0x7FFFFFFF)) > np.uint64(0x7F800000)
    lsb = (u >> np.uint64(16)) & np.uint64(1)
    r = ((u + np.uint64(0x7FFF) + lsb) >> np.uint64(16)) & np.uint64(0xFFFF)  # overflow -> inf
    r = np.where(nan, ((u >> np.uint64(16)) | np.uint64(0x40)) & np.uint64(0xFFFF), r)
    ties = ~nan & ((u & np.uint64(0xFFFF)) == np.uint64(0x8000))
    return r, ties


def f32_value(bits):
    """binary32 bit patterns -> float64 values (widening is exact; signalling NaNs come out quiet)."""
    with np.errstate(invalid="ignore"):
        return np.asarray(bits).astype(np.uint32).view(np.float32).astype(np.float64)


def widen(bits, gdtype: str):
    """Decode gradient bit patterns (fp32/bf16/fp16) to float64, exactly."""
    bits = np.asarray(bits)
    if gdtype == "fp32":
        return f32_value(bits)
    if gdtype == "bf16":
        return f32_value(bits.astype(np.uint32) << np.uint32(16))
    assert gdtype == "fp16"
    b = bits.astype(np.int64)
    sign = np.where(b >> 15, -1.0, 1.0)
    ex = (b >> 10) & 0x1F
    man = b & 0x3FF
    mag = np.ldexp((man + np.where(ex > 0, 1024, 0)).astype(np.float64), np.maximum(ex, 1) - 25)
    mag = np.where(ex == 0x1F, np.where(man == 0, np.inf, np.nan), mag)
    return sign * mag


def is_nan_bits(bits, fmt):
    mbits, _, ebits, total = FMT[fmt]
    inf_bits = ((1 << ebits) - 1) << mbits
    return (np.asarray(bits).astype(np.uint64) & np.uint64((1 << (total - 1)) - 1)) > np.uint64(inf_bits)


class Oracle:
    """The contract, one binary64 operation + one bit-level rounding at a time."""

    def __init__(self) -> None:
        self.ties: collections.Counter = collections.Counter()

    def r(self, x, op: str):
        bits, ties = round_bits(x, "fp32")
        self.ties[op] += int(ties.sum())
        return f32_value(bits)

    def reduce(self, grad_bits, gdtype: str, inv_scale):
        acc = widen(grad_bits[0], gdtype)
        with np.errstate(all="ignore"):
            for gb in grad_bits[1:]:
                acc = self.r(acc + widen(gb, gdtype), "acc")
            g = self.r(acc * float(inv_scale), "g")
        return g, bool(np.isfinite(g).all())

    def adamw(self, p, m, v, g, s: StepScalars):
        r = self.r
        f = {k: float(val) for k, val in zip(StepScalars.names(), s.as_tuple())}
        with np.errstate(all="ignore"):
            p1 = r(p * f["decay"], "p1")
            b1m = r(f["b1"] * m, "b1m")
            omb1g = r(f["omb1"] * g, "omb1g")
            m2 = r(b1m + omb1g, "m'")
            gg = r(g * g, "gg")
            omb2gg = r(f["omb2"] * gg, "omb2gg")
            b2v = r(f["b2"] * v, "b2v")
            v2 = r(b2v + omb2gg, "v'")
            sq = r(np.sqrt(v2), "sqrt")
            sc = r(sq * f["inv_bc2_sqrt"], "sc")
            d = r(sc + f["eps"], "d")
            qt = r(m2 / d, "q")
            ns = r(f["neg_step"] * qt, "ns")
            p2 = r(p1 + ns, "p'")
        return p2, m2, v2

    def lion(self, p, m, g, s: LionScalars, n_decay: int | None = None):
        """docs/eps-numerics.md "Lion update": the step's sign decided on the rounded ``c``."""
        r = self.r
        f = {k: float(val) for k, val in zip(LionScalars.names(), s.as_tuple())}
        n_decay = p.shape[0] if n_decay is None else n_decay
        with np.errstate(all="ignore"):
            p1 = np.concatenate([r(p[:n_decay] * f["decay"], "p1"), p[n_decay:]])
            b1m = r(f["b1"] * m, "b1m")
            omb1g = r(f["omb1"] * g, "omb1g")
            c = r(b1m + omb1g, "c")
            up, down = r(p1 + f["neg_lr"], "p'+"), r(p1 - f["neg_lr"], "p'-")
            p2 = np.where(c > 0, up, np.where(c < 0, down, p1))
            b2m = r(f["b2"] * m, "b2m")
            omb2g = r(f["omb2"] * g, "omb2g")
            m2 = r(b2m + omb2g, "m'")
        return p2, m2

    def lamb(self, p, m, v, g, s: LambScalars, bounds, tensor, tensor_starts, n_decay: int):
        """docs/eps-numerics.md "LAMB update": both passes, the lane sums one rounded addition at a
        time, the host's fold in binary64 in segment then lane order."""
        r = self.r
        f = {k: float(val) for k, val in zip(LambScalars.names(), s.as_tuple())}
        n = p.shape[0]
        with np.errstate(all="ignore"):
            m2 = r(r(f["b1"] * m, "b1m") + r(f["omb1"] * g, "omb1g"), "m'")
            v2 = r(r(f["b2"] * v, "b2v") + r(f["omb2"] * r(g * g, "gg"), "omb2gg"), "v'")
            d = r(r(np.sqrt(v2), "sqrt") * f["inv_bc2_sqrt"], "sc")
            d = r(d + f["eps"], "d")
            u = r(r(m2 / d, "q") * f["inv_bc1"], "u")
            decayed = np.arange(n) < n_decay
            u2 = np.where(decayed, r(u + r(f["wd"] * p, "wdp"), "u2"), u)
            pp, uu = r(p * p, "pp"), r(u2 * u2, "uu")
        sums = np.zeros((len(tensor), 2, 16))
        for k in range(len(tensor)):
            for j, x in enumerate((pp, uu)):
                seg = x[int(bounds[k]):int(bounds[k + 1])]
                rows = np.zeros(-(-seg.size // 16) * 16)
                rows[:seg.size] = seg  # squares are >= +0: the padding's +0 changes no lane
                for row in rows.reshape(-1, 16):  # each lane a left fold in index order
                    sums[k, j] = r(sums[k, j] + row, "acc")
        totals = {}
        for k, t in enumerate(tensor):
            for lane in range(16):
                w, q = totals.get(t, (0.0, 0.0))
                totals[t] = (w + float(sums[k, 0, lane]), q + float(sums[k, 1, lane]))
        steps = np.empty(len(tensor))
        for k, t in enumerate(tensor):
            w, q = math.sqrt(totals[t][0]), math.sqrt(totals[t][1])
            trust = w / q if w > 0 and q > 0 else 1.0
            if not (s.adapt and tensor_starts[t] < n_decay):
                trust = 1.0
            steps[k] = f32_value(round_bits(np.array([-s.lr * trust]), "fp32")[0])[0]
        seg = np.repeat(np.arange(len(tensor)), np.diff(bounds))
        with np.errstate(all="ignore"):
            p2 = r(p + r(steps[seg] * u2, "ns"), "p'")
        return p2, m2, v2, sums

    def copy_bits(self, p, cdtype: str):
        if cdtype == "bf16":
            f32bits, _ = round_bits(p, "fp32")  # identity on binary32 values
            bits, ties = bf16_bits_from_f32_bits(f32bits)
        else:
            bits, ties = round_bits(p, cdtype)
        self.ties["copy-" + cdtype] += int(ties.sum())
        return bits


# --------------------------------------------------------------------------
# bit patterns and the vector classes' generators
# --------------------------------------------------------------------------


def bits_of(arr):
    arr = np.ascontiguousarray(arr)
    return arr.view(UINT[arr.dtype.itemsize * 8]).astype(np.uint64)


def assert_bits(actual, expected_bits, fmt: str, what: str):
    """``actual`` (an array of ``fmt``) equals ``expected_bits``; NaN == NaN."""
    a = bits_of(actual).reshape(-1)
    e = np.asarray(expected_bits, dtype=np.uint64).reshape(-1)
    assert a.shape == e.shape, (what, a.shape, e.shape)
    ok = (a == e) | (is_nan_bits(a, fmt) & is_nan_bits(e, fmt))
    if not ok.all():
        bad = np.flatnonzero(~ok)
        width = FMT[fmt][3] // 4
        rows = [f"  [{i}] got 0x{int(a[i]):0{width}x} expected 0x{int(e[i]):0{width}x}" for i in bad[:8]]
        raise AssertionError(f"{what}: {bad.size} of {a.size} elements differ\n" + "\n".join(rows))


def assert_f32(actual, expected_values, what):
    bits, _ = round_bits(expected_values, "fp32")  # exact: the values are binary32
    assert_bits(actual, bits, "fp32", what)


def f32_from_bits(bits):
    return np.asarray(bits, dtype=np.uint64).astype(np.uint32).view(np.float32)


def grad_array(bits, gdtype):
    """The implementation's view of gradient bit patterns."""
    if gdtype == "fp32":
        return np.asarray(bits, np.uint64).astype(np.uint32).view(np.float32)
    b = np.asarray(bits, np.uint64).astype(np.uint16)
    return b.view(ml_dtypes.bfloat16) if gdtype == "bf16" else b.view(np.float16)


def wide_f32(rng, n, *, nonneg=False, max_abs=3.4e38):
    """binary32 values over every binade from subnormals up to ``max_abs``, both signs."""
    kind = rng.integers(0, 5, n)
    logu = 10.0 ** rng.uniform(-45.5, math.log10(max_abs), n)
    max_bits = int(np.float32(max_abs).view(np.uint32))
    anybits = f32_value(rng.integers(0, max_bits, n, dtype=np.uint64))
    subn = f32_value(rng.integers(1, 1 << 23, n, dtype=np.uint64))
    ordinary = rng.standard_normal(n) * 10.0 ** rng.integers(-4, 3, n)
    x = np.select([kind == 0, kind == 1, kind == 2, kind == 3], [logu, anybits, subn, ordinary], 0.0)
    if nonneg:
        x = np.abs(x)
    else:
        x = x * np.where(rng.random(n) < 0.5, -1.0, 1.0)  # zeros of both signs too
    return np.asarray(x, dtype=np.float64).astype(np.float32)  # inputs only; not part of the oracle


def wide_grad_bits(rng, n, gdtype, *, max_abs=1e37):
    """Finite gradient bit patterns of ``gdtype`` over its binades (zeros, subnormals too)."""
    if gdtype == "fp32":
        return bits_of(wide_f32(rng, n, max_abs=max_abs))
    if gdtype == "bf16":
        return bits_of(wide_f32(rng, n, max_abs=max_abs)) >> np.uint64(16)  # truncation: inputs only
    bits = rng.integers(0, 0x7C00, n, dtype=np.uint64)  # every finite fp16 magnitude
    kind = rng.random(n)
    bits = np.where(kind < 0.1, np.uint64(0), bits)                                   # zeros
    bits = np.where((kind >= 0.1) & (kind < 0.2), rng.integers(1, 0x400, n, dtype=np.uint64), bits)  # subnormals
    return bits | (rng.integers(0, 2, n, dtype=np.uint64) << np.uint64(15))


def custom_scalars(**kw) -> StepScalars:
    base = dict(decay=1.0, b1=0.9, omb1=0.1, b2=0.999, omb2=0.001, inv_bc2_sqrt=1.0,
                eps=1e-8, neg_step=-1e-3, inv_scale=1.0)
    base.update(kw)
    return StepScalars(**{k: np.float32(v) for k, v in base.items()})


# --------------------------------------------------------------------------
# hyper-parameters, special values, ties
# --------------------------------------------------------------------------

HYPERS = [OptimizerHyper(), OptimizerHyper(lr=3e-4, beta1=0.95, beta2=0.98, eps=1e-6, weight_decay=0.1),
          OptimizerHyper(lr=0.1, beta1=0.5, beta2=0.9999, eps=1e-12, weight_decay=0.0),
          OptimizerHyper(lr=1.7e-5, beta1=0.0, beta2=0.0, eps=1e-30, weight_decay=1e-4)]


def specials(signed: bool, fmt="fp32"):
    if fmt == "fp32":
        mags = [0.0, 2.0 ** -149, 0x400000 * 2.0 ** -149, 0x7FFFFF * 2.0 ** -149, 2.0 ** -126,
                1.0, 1e-20, 1e20, 3.4028234663852886e38, 1.5e-40]
    elif fmt == "bf16":
        mags = [0.0, 2.0 ** -133, 2.0 ** -127, 2.0 ** -126, 1.0, 2.0 ** -60, 2.0 ** 60, 3.3895313892515355e38]
    else:
        mags = [0.0, 2.0 ** -24, 2.0 ** -15, 1023 * 2.0 ** -24, 2.0 ** -14, 1.0, 65504.0, 0.0078125]
    vals = [m for m in mags] + ([-m for m in mags] if signed else [])
    if fmt == "fp32":
        return round_bits(vals, "fp32")[0]
    return round_bits(vals, fmt)[0] if fmt == "fp16" else bf16_bits_from_f32_bits(round_bits(vals, "fp32")[0])[0]


SPECIAL_SCALARS = {
    "default-t1": StepScalars.compute(OptimizerHyper(), 1),
    "big-t1000": StepScalars.compute(OptimizerHyper(lr=0.1, weight_decay=0.1), 1000, 1024.0, 2.0),
    "no-decay": StepScalars.compute(OptimizerHyper(weight_decay=0.0), 3),
    "subnormal-eps": custom_scalars(eps=2.0 ** -149, inv_bc2_sqrt=2.0 ** -20, neg_step=-1e-30),
    "zero-eps": custom_scalars(eps=0.0, decay=0.5, b1=1.0, omb1=2.0 ** -100),
}


def odd_f32(rng, n, lo_exp, hi_exp, max_frac_bits=1 << 21):
    """Values 2**e * (1 + j * 2**-23) with j odd: half the ulp is the lowest product bit."""
    j = rng.integers(0, max_frac_bits // 2, n) * 2 + 1
    e = rng.integers(lo_exp, hi_exp, n)
    return np.ldexp(1.0 + j * 2.0 ** -23, e) * np.where(rng.random(n) < 0.5, -1.0, 1.0)


def product_tie_inputs(rng, n):
    """p, m, v, g and scalars whose products land exactly halfway: factor 1.5 times odd significands."""
    p = odd_f32(rng, n, -120, 120).astype(np.float32)
    m = odd_f32(rng, n, -120, 120).astype(np.float32)
    v = np.abs(odd_f32(rng, n, -120, 120)).astype(np.float32)
    g = round_bits(odd_f32(rng, n, -60, 60), "fp32")[0]
    s = custom_scalars(decay=1.5, b1=1.5, omb1=1.5, b2=1.5, omb2=0.75, inv_bc2_sqrt=1.5, neg_step=-1.5)
    return p, m, v, g, s


def copy_tie_values(rng, n):
    """binary32 values exactly halfway for bf16 (low 16 bits 0x8000) and for fp16 (normal,
    subnormal and the overflow boundary 65520)."""
    bf = (rng.integers(0, 0x7F7F, n, dtype=np.uint64) << np.uint64(16)) | np.uint64(0x8000)
    e = rng.integers(-14, 16, n)
    j = rng.integers(0, 1 << 10, n)
    fp = np.ldexp(1.0 + j / 1024.0 + 2.0 ** -11, e)                   # normal fp16 halfway
    sub = np.ldexp(rng.integers(0, 1 << 10, n) + 0.5, -24)            # fp16 subnormal halfway
    edge = np.array([65520.0, 65519.99609375, 65504.0 + 8.0, 2.0 ** -25, 3 * 2.0 ** -25,
                     2.0 ** -14 - 2.0 ** -25, 65536.0, 1e10])
    vals = np.concatenate([f32_value(bf), fp, sub, edge])
    vals = vals * np.where(rng.random(vals.size) < 0.5, -1.0, 1.0)
    return vals.astype(np.float32)


# --------------------------------------------------------------------------
# non-finite gradients
# --------------------------------------------------------------------------

INF_BITS = {"fp32": 0x7F800000, "bf16": 0x7F80, "fp16": 0x7C00}
NAN_BITS = {"fp32": 0x7FC00000, "bf16": 0x7FC0, "fp16": 0x7E00}
SIGN_BITS = {"fp32": 1 << 31, "bf16": 1 << 15, "fp16": 1 << 15}
MAX_BITS = {"fp32": 0x7F7FFFFF, "bf16": 0x7F7F, "fp16": 0x7BFF}


def nonfinite_grads(rng, n, case, K, gdtype, i):
    """Gradient bit patterns whose reduced g is non-finite at element ``i`` (and the scalars)."""
    grad_bits = [wide_grad_bits(rng, n, gdtype, max_abs=1e30) for _ in range(K)]
    s = StepScalars.compute(OptimizerHyper(), 1, divisor=float(K))
    if case == "+inf":
        grad_bits[K - 1][i] = INF_BITS[gdtype]
    elif case == "-inf":
        grad_bits[0][i] = INF_BITS[gdtype] | SIGN_BITS[gdtype]
    elif case == "nan":
        grad_bits[K // 2][i] = NAN_BITS[gdtype]
    elif case == "inf-inf":
        grad_bits[0][i] = INF_BITS[gdtype]
        grad_bits[1][i] = INF_BITS[gdtype] | SIGN_BITS[gdtype]
    elif case == "sum-overflow":
        for gb in grad_bits:
            gb[i] = MAX_BITS[gdtype]
        s = custom_scalars(inv_scale=1.0)
    else:  # scale-overflow, at element i only: every other element is a zero
        for gb in grad_bits:
            gb &= np.uint64(SIGN_BITS[gdtype])
        grad_bits[0][i] = MAX_BITS[gdtype]
        s = custom_scalars(inv_scale=3e38)
    assert not Oracle().reduce(grad_bits, gdtype, s.inv_scale)[1]
    return grad_bits, s



def nonfinite_cases():
    """Every (case, K, dtype) that can happen: inf-inf needs two contributions,
    and only a sum of several fp32/bf16 values can overflow binary32."""
    for case in ["+inf", "-inf", "nan", "inf-inf", "sum-overflow", "scale-overflow"]:
        for K in [1, 2, 4]:
            for gdtype in ["fp32", "bf16", "fp16"]:
                if case == "inf-inf" and K == 1:
                    continue
                if case == "sum-overflow" and (K == 1 or gdtype == "fp16"):
                    continue
                yield case, K, gdtype
