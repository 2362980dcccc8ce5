"""cocotb testbench for l2l_fp32_div (a / b) and l2l_fp32_sqrt (sqrt(a)).

One module serves both top levels (the unit is told apart by the top-level
name). Operands are streamed through the pipeline with random clock-enable
stalls (``ce`` = 0, the datapath's backpressure) and random ``in_valid``
bubbles; results are collected on ``out_valid`` at clock-enabled edges and
compared bit for bit with NumPy binary32 (``np.divide`` / ``np.sqrt`` on
float32: correctly rounded, subnormals kept), two NaNs being equal whatever
their payloads. Each result must also leave the pipeline exactly
``L2L_FP32_{DIV,SQRT}_LAT`` clock-enabled cycles after its operands went in
(the latency header is read from fpga/rtl/l2l_fp_latency.vh).

Environment knobs (set by tests/test_rtl_fp_divsqrt.py):
``L2L_FP_SEED`` (default 1), ``L2L_FP_RANDOM`` (random operand pairs,
default 20000), ``L2L_FP_CLASS`` (operands per vector class, default 2000).
"""
from __future__ import annotations

import logging
import os
import re
from collections import deque
from pathlib import Path

import cocotb
import fp_vectors as fv
import numpy as np
from cocotb.clock import Clock
from cocotb.triggers import RisingEdge

U32 = np.uint32
ONE64 = np.uint64(1)

LATENCY_VH = Path(__file__).resolve().parents[1] / "fpga" / "rtl" / "l2l_fp_latency.vh"


def header_latency(name: str) -> int:
    """The value of `define ``name`` in l2l_fp_latency.vh."""
    m = re.search(rf"`define\s+{name}\s+(\d+)", LATENCY_VH.read_text())
    if not m:
        raise RuntimeError(f"{name} not defined in {LATENCY_VH}")
    return int(m.group(1))


def env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


# ---------------------------------------------------------------------------
# Division operand classes (fp_vectors has the unit-independent ones)


def _f64_to_exact_f32_bits(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """binary32 bits of float64 ``x`` and a mask of the values binary32 holds exactly."""
    with np.errstate(all="ignore"):
        r = x.astype(np.float32)
        ok = np.isfinite(r) & (r.astype(np.float64) == x)
    return r.view(U32), ok


def _short_sig(rng, n, max_bits: int) -> np.ndarray:
    """Odd integers of 1..max_bits significant bits (as float64)."""
    bits = rng.integers(1, max_bits + 1, n)
    top = np.left_shift(1, bits - 1).astype(np.int64)
    return (top | (rng.integers(0, 1 << 30, n) & (top - 1)) | 1).astype(np.float64)


def subnormals_all_widths(rng, n: int) -> np.ndarray:
    """Subnormals whose significand has a uniform number (1..23) of significant
    bits, so normalisation sees every leading-zero count; random signs."""
    width = rng.integers(1, 24, n).astype(np.uint64)
    top = ONE64 << (width - ONE64)
    man = top | (rng.integers(0, 1 << 23, n, dtype=np.uint64) & (top - ONE64))
    return (man | (fv._signs(rng, n) << 31)).astype(U32)


def div_subnormal_pairs(rng, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Subnormal dividend, divisor or both (every leading-zero count), against
    finite operands of every binade."""
    k = n // 3
    a = np.concatenate([subnormals_all_widths(rng, k), fv.random_finite(rng, k, 0, 254),
                        subnormals_all_widths(rng, n - 2 * k)])
    b = np.concatenate([fv.random_finite(rng, k, 0, 254), subnormals_all_widths(rng, k),
                        subnormals_all_widths(rng, n - 2 * k)])
    return a.astype(U32), b.astype(U32)


def div_overflow_pairs(rng, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Quotients around the largest finite value and beyond.

    A third: unbiased quotient exponent 125..129 from normal operands. A
    third: large a over subnormal b. A third: a within 8 ulps of MAX_FINITE
    over b within 8 ulps of 1: quotients just below and above the largest
    finite value. (A quotient of 24-bit significands is never within 2^-25
    relative below a power of two, so it never rounds up into infinity:
    overflow is decided by the exponent, and these pairs check that edge.)
    """
    k = n // 3
    eq = rng.integers(125, 130, k)
    eb_u = rng.integers(-126, 127 - eq + 1)
    a1 = fv._pack(fv._signs(rng, k), (eq + eb_u + 127).astype(np.uint64), fv._mans(rng, k))
    b1 = fv._pack(fv._signs(rng, k), (eb_u + 127).astype(np.uint64), fv._mans(rng, k))
    a2 = fv.random_finite(rng, k, 100, 254)
    b2 = fv.random_finite(rng, k, 0, 0)
    m = n - 2 * k
    a3 = ((fv.MAX_FINITE - rng.integers(0, 9, m)).astype(np.uint64) | (fv._signs(rng, m) << 31))
    b3 = ((fv.ONE + rng.integers(-8, 9, m)).astype(np.uint64) | (fv._signs(rng, m) << 31))
    return (np.concatenate([a1, a2, a3.astype(U32)]).astype(U32),
            np.concatenate([b1, b2, b3.astype(U32)]).astype(U32))


def div_underflow_pairs(rng, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Quotients in and below the subnormal range, and around the smallest normal.

    A quarter: unbiased quotient exponent -152..-120 from normal operands (deep
    and shallow subnormals, results that round to zero or to the smallest
    subnormal). A quarter: subnormal a over b in [0.5, 2^30). Half: quotients
    within a few subnormal ulps either side of 2^-126 (largest subnormal,
    smallest normal and their neighbours): a = fl(t * b) with
    t = 2^-126 (1 + d), |d| <= 2^-22, b in [1, 2^40). The round-up carry from
    the largest subnormal into the smallest normal happens for a quotient only
    at the exact tie (2^24 - 1) * 2^-150, which div_tie_pairs holds.
    """
    k = n // 4
    eq = rng.integers(-152, -119, k)
    ea_u = rng.integers(np.maximum(-126, eq - 127), np.minimum(127, eq + 126) + 1)
    eb_u = ea_u - eq
    a1 = fv._pack(fv._signs(rng, k), (ea_u + 127).astype(np.uint64), fv._mans(rng, k))
    b1 = fv._pack(fv._signs(rng, k), (eb_u + 127).astype(np.uint64), fv._mans(rng, k))
    a2 = fv.random_finite(rng, k, 0, 0)
    b2 = fv.random_finite(rng, k, 126, 156)
    m = n - 2 * k
    t = 2.0 ** -126 * (1.0 + rng.uniform(-2.0 ** -22, 2.0 ** -22, m))
    b3 = (rng.uniform(1.0, 2.0, m) * 2.0 ** rng.integers(0, 40, m)).astype(np.float32)
    a3 = (t * b3.astype(np.float64)).astype(np.float32)
    sign = fv._signs(rng, m) << 31
    a3 = (a3.view(U32).astype(np.uint64) ^ sign).astype(U32)
    return (np.concatenate([a1, a2, a3]).astype(U32),
            np.concatenate([b1, b2, b3.view(U32)]).astype(U32))


def div_exact_pairs(rng, n: int) -> tuple[np.ndarray, np.ndarray]:
    """a = b * q exactly, so a / b = q with a zero remainder.

    Half: q and b with short significands (<= 12 bits each, so b * q has <= 24
    bits), exponents over the whole range (pairs binary32 cannot hold are
    dropped). Half: q a power of two, b random (a = b scaled, including into
    and out of the subnormal range). Plus a / a and a / -a.
    """
    h = n // 2
    q = _short_sig(rng, 4 * h, 12) * 2.0 ** rng.integers(-140, 120, 4 * h)
    b = _short_sig(rng, 4 * h, 12) * 2.0 ** rng.integers(-140, 120, 4 * h)
    a = q * b
    a_bits, ok_a = _f64_to_exact_f32_bits(a)
    b_bits, ok_b = _f64_to_exact_f32_bits(b)
    _, ok_q = _f64_to_exact_f32_bits(q)
    keep = np.flatnonzero(ok_a & ok_b & ok_q & (a != 0))[:h]
    a1, b1 = a_bits[keep], b_bits[keep]
    m = n - a1.size
    bb = fv.random_finite(rng, 4 * m, 0, 254)
    p2 = 2.0 ** rng.integers(-60, 61, 4 * m)
    aa = fv.f32(bb).astype(np.float64) * p2
    a2_bits, ok = _f64_to_exact_f32_bits(aa)
    keep = np.flatnonzero(ok & (aa != 0))[: m - 8]
    a2, b2 = a2_bits[keep], bb[keep]
    same = fv.random_finite(rng, 8, 0, 254)
    a3 = same
    b3 = (same.astype(np.uint64) ^ (rng.integers(0, 2, 8).astype(np.uint64) << 31)).astype(U32)
    sign = (fv._signs(rng, a1.size + a2.size) << 31)
    a12 = (np.concatenate([a1, a2]).astype(np.uint64) ^ sign).astype(U32)
    return (np.concatenate([a12, a3]).astype(U32),
            np.concatenate([b1, b2, b3]).astype(U32))


def div_tie_pairs(rng, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Quotients exactly halfway between two binary32 values, and 1 ulp of a off them.

    A binary32 quotient can only tie in the subnormal range: q = w * 2^-150
    with w odd, w < 2^24. b = c * 2^e (c odd, w * c < 2^24), a = w * c *
    2^(e - 150); both are exact binary32 values. w = 1 gives 2^-150 (ties to
    0), w = 2^24 - 1 the midpoint between the largest subnormal and the
    smallest normal (ties up to the smallest normal). A third of the pairs move
    a by one ulp either way: quotients just above and below a tie.
    """
    k = n - n // 3
    cbits = rng.integers(0, 9, k)
    c = (np.left_shift(1, cbits).astype(np.int64) | rng.integers(0, 1 << 9, k)) & (
        np.left_shift(1, cbits + 1).astype(np.int64) - 1) | 1
    wmax = (1 << 24) // c
    w = (rng.integers(0, 1 << 40, k) % np.maximum(wmax // 2, 1)) * 2 + 1
    w[:4] = [1, 3, (1 << 24) - 1, (1 << 24) - 3]
    c[:4] = 1
    w = np.minimum(w, ((1 << 24) - 1) // c) | 1
    e = rng.integers(1, 101, k)
    b64 = c.astype(np.float64) * 2.0 ** e
    a64 = (w * c).astype(np.float64) * 2.0 ** (e - 150)
    a_bits, ok_a = _f64_to_exact_f32_bits(a64)
    b_bits, ok_b = _f64_to_exact_f32_bits(b64)
    assert ok_a.all() and ok_b.all()
    assert fv.is_tie(a64 / b64).all(), "div_tie_pairs: a quotient is not a tie"
    s = (fv._signs(rng, k) << 31, fv._signs(rng, k) << 31)
    a_bits = (a_bits.astype(np.uint64) ^ s[0]).astype(U32)
    b_bits = (b_bits.astype(np.uint64) ^ s[1]).astype(U32)
    m = n - k
    pick = rng.integers(0, k, m)
    step = np.where(rng.integers(0, 2, m) == 1, 1, -1).astype(np.int64)
    a_near = (a_bits[pick].astype(np.int64) + step).astype(U32)
    return (np.concatenate([a_bits, a_near]).astype(U32),
            np.concatenate([b_bits, b_bits[pick]]).astype(U32))


# ---------------------------------------------------------------------------
# Square-root operand classes


def sqrt_subnormals(rng, n: int) -> np.ndarray:
    """Subnormal operands, half with uniform significands and half with a
    uniform number of significant bits (a tenth negative: NaN), plus the
    extremes."""
    h = n // 2
    x = np.concatenate([fv.random_finite(rng, h, 0, 0),
                        subnormals_all_widths(rng, n - h)]).astype(np.uint64)
    x &= np.uint64(0x7FFFFFFF)
    x[: n // 10] |= np.uint64(0x80000000)
    x[-4:] = [fv.MIN_SUBNORMAL, 2, 3, fv.MAX_SUBNORMAL]
    return x.astype(U32)


def sqrt_squares(rng, n: int) -> np.ndarray:
    """Perfect squares s*s (s of <= 12 significant bits, whole range including
    subnormal squares) and their neighbours 1 and 2 ulps above and below."""
    k = n // 5
    s = _short_sig(rng, 3 * k, 12) * 2.0 ** rng.integers(-80, 60, 3 * k)
    x_bits, ok = _f64_to_exact_f32_bits(s * s)
    x = x_bits[ok & (s * s > 0)][:k].astype(np.int64)
    near = [x + d for d in (-2, -1, 1, 2)]
    out = np.concatenate([x] + near)
    out = out[(out > 0) & (out < fv.POS_INF)]
    if out.size < n:
        out = np.concatenate([out, fv.random_finite(rng, n - out.size, 0, 254).astype(np.int64) & 0x7FFFFFFF])
    return out[:n].astype(U32)


def _sqrt_mod_pow2(c: int, k: int) -> int:
    """A square root of c modulo 2^k (c odd, c = 1 mod 8, k >= 3), by Hensel lifting."""
    s = 1
    for j in range(3, k):
        if (s * s - c) % (1 << (j + 1)):
            s += 1 << (j - 1)
    assert (s * s - c) % (1 << k) == 0
    return s


def sqrt_near_ties(rng, n: int) -> np.ndarray:
    """Operands whose root lies a hair above or below a rounding midpoint.

    A midpoint between two binary32 values in [1, 2) is m = M * 2^-24 with M
    odd, 2^24 < M < 2^25. x = X * 2^-23 (X in [2^23, 2^24): even exponent,
    K = 25) or X * 2^-22 (odd exponent, K = 26) is that close to m^2 when
    M^2 = X * 2^K + d for a small odd d: then sqrt(x) = m * sqrt(1 - d / M^2),
    about |d| / 2^26 ulp from m, below it for d > 0 and above for d < 0. M
    comes from the square roots of d modulo 2^K (Hensel lifting), d = 1 or
    7 mod 8 and |d| < 2^20 (so within 2^-6 ulp). The round bit of such a root is decided by the
    sticky bit alone. Exponents are random over the normal range.
    """
    out: list[int] = []
    d_pos = 1
    d_neg = 7
    while len(out) < n:
        for k in (25, 26):
            for d in (d_pos, -d_neg):
                c = d % (1 << k)
                s = _sqrt_mod_pow2(c, k)
                for root in {s, (1 << k) - s, (s + (1 << (k - 1))) % (1 << k),
                             ((1 << k) - s + (1 << (k - 1))) % (1 << k)}:
                    if not (1 << 24) < root < (1 << 25):
                        continue
                    sq = root * root - d
                    assert sq % (1 << k) == 0
                    big_x = sq >> k
                    if not (1 << 23) <= big_x < (1 << 24):
                        continue
                    # unbiased exponent of x: 0 (k = 25) or 1 (k = 26), plus 2e
                    e2 = (k - 25) + 2 * int(rng.integers(-63, 63))
                    out.append(((e2 + 127) << 23) | (big_x - (1 << 23)))
        d_pos += 8
        d_neg += 8
        assert d_pos < (1 << 20) and d_neg < (1 << 20)
    return rng.permutation(np.array(out[:n], dtype=U32))


def div_near_ties(rng, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Normal quotients a hair above or below a rounding midpoint.

    With 24-bit significands A, B (B odd) and an odd 25-bit M, A * 2^25 =
    B * M + r for a small odd r makes 2A/B = (M + r/B) * 2^-24: |r|/B half
    ulps from the midpoint M * 2^-24, above it for r > 0. M = -r / B mod 2^25.
    Quotient exponents are random over the normal range and the bottom of it
    (a few land in the subnormal range, where the midpoint is no longer one).
    """
    a_out: list[int] = []
    b_out: list[int] = []
    mod = 1 << 25
    while len(a_out) < n:
        big_b = int(rng.integers(1 << 22, 1 << 23)) * 2 + 1
        r = int(rng.integers(0, 1 << 12)) * 2 + 1
        r = r if rng.integers(0, 2) else -r
        m = (-r * pow(big_b, -1, mod)) % mod
        if not (1 << 24) < m < mod:
            continue
        num = big_b * m + r
        assert num % mod == 0 and m % 2 == 1
        big_a = num >> 25
        if not (1 << 23) <= big_a < (1 << 24):
            continue
        # quotient a / b = (A / B) * 2^(ea - eb), A / B in (1/2, 1)
        eq = int(rng.integers(-128, 128))
        eb = int(rng.integers(max(-126, -126 - eq), min(127, 127 - eq) + 1))
        ea = eq + eb
        sa, sb = int(rng.integers(0, 2)), int(rng.integers(0, 2))
        a_out.append((sa << 31) | ((ea + 127) << 23) | (big_a - (1 << 23)))
        b_out.append((sb << 31) | ((eb + 127) << 23) | (big_b - (1 << 23)))
    return np.array(a_out, dtype=U32), np.array(b_out, dtype=U32)


# ---------------------------------------------------------------------------
# Testbench


def random_stalls(rng, p: float):
    """An endless iterator of bools, True with probability ``p`` (seeded)."""
    while True:
        yield from (rng.random(4096) < p).tolist()


class TB:
    """Drives a binary32 pipeline unit (fpga/rtl/README.md interface) and checks it."""

    def __init__(self, dut, seed: int = 1):
        self.dut = dut
        self.log = logging.getLogger("cocotb.tb")
        self.log.setLevel(logging.INFO)
        self.name = dut._name
        if self.name == "l2l_fp32_div":
            self.unary = False
            self.lat = header_latency("L2L_FP32_DIV_LAT")
            self.ref = fv.ref_div
        elif self.name == "l2l_fp32_sqrt":
            self.unary = True
            self.lat = header_latency("L2L_FP32_SQRT_LAT")
            self.ref = fv.ref_sqrt
        else:
            raise RuntimeError(f"unexpected top level {self.name}")
        self.rng = np.random.default_rng(seed)
        fv.check_numpy_ieee()
        self.backpressure = None   # iterator: True = stall (ce = 0) on that cycle
        self.idle = None           # iterator: True = bubble (in_valid = 0) on that cycle
        self.cycles = 0            # clock edges used by the last stream()
        # cocotb's C clock: its Python clock is about a quarter of a sweep's CPU. It starts low, so
        # the first edge comes after the writes below, as it did with the Python clock
        cocotb.start_soon(Clock(dut.clk, 4, unit="ns", impl="gpi").start(start_high=False))
        dut.rst.value = 0
        dut.ce.value = 1
        dut.in_valid.value = 0
        dut.a.value = 0
        if not self.unary:
            dut.b.value = 0

    def set_backpressure_generator(self, generator=None):
        self.backpressure = generator

    def set_idle_generator(self, generator=None):
        self.idle = generator

    async def reset(self):
        self.dut.in_valid.value = 0
        self.dut.ce.value = 1
        self.dut.rst.value = 1
        for _ in range(2):
            await RisingEdge(self.dut.clk)
        self.dut.rst.value = 0
        await RisingEdge(self.dut.clk)

    async def stream(self, a: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
        """Push every operand through the unit; return the results in order.

        Checks on the way that every result leaves exactly ``self.lat``
        clock-enabled cycles after its operands were taken, and that no result
        appears that was not asked for.
        """
        dut = self.dut
        clk, d_ce, d_iv, d_a, d_ov, d_y = dut.clk, dut.ce, dut.in_valid, dut.a, dut.out_valid, dut.y
        d_b = None if self.unary else dut.b
        a_list = np.asarray(a, dtype=U32).tolist()
        b_list = None if self.unary else np.asarray(b, dtype=U32).tolist()
        n = len(a_list)
        out: list[int] = []
        taken: deque[int] = deque()     # ce-cycle index at which each operand was taken
        bp, idle = self.backpressure, self.idle
        ce_now, iv_now = 1, 0
        ce_count = 0
        i = 0
        cycles = 0
        d_iv.value = 0
        while len(out) < n:
            await RisingEdge(clk)
            cycles += 1
            # what the unit sampled at this edge (values read now are the pre-edge ones)
            if ce_now:
                ce_count += 1
                if int(d_ov.value):
                    if not taken:
                        raise AssertionError(f"{self.name}: out_valid with nothing in flight")
                    lat = ce_count - taken.popleft()
                    if lat != self.lat:
                        raise AssertionError(f"{self.name}: result {len(out)} after {lat} ce-cycles, "
                                             f"header says {self.lat}")
                    out.append(d_y.value.to_unsigned())
                if iv_now:
                    taken.append(ce_count)
                    i += 1
            # next cycle's inputs
            ce_now = 0 if (bp is not None and next(bp)) else 1
            d_ce.value = ce_now
            nxt = i < n and not (idle is not None and next(idle))
            if nxt:
                d_a.value = a_list[i]
                if d_b is not None:
                    d_b.value = b_list[i]
            if nxt != iv_now:
                d_iv.value = int(nxt)
            iv_now = int(nxt)
            if cycles > 64 * (n + self.lat) + 1000:
                raise AssertionError(f"{self.name}: stuck, {len(out)} of {n} results")
        d_iv.value = 0
        d_ce.value = 1
        # nothing more may come out
        for _ in range(self.lat + 2):
            await RisingEdge(clk)
            if int(d_ov.value):
                raise AssertionError(f"{self.name}: spurious out_valid after the last result")
        self.cycles = cycles
        return np.array(out, dtype=U32)

    async def check(self, label: str, a: np.ndarray, b: np.ndarray | None = None) -> None:
        """Stream operands, compare with NumPy binary32 bit for bit (NaN == NaN),
        and every NaN result must be the canonical 0x7FC00000."""
        a = np.asarray(a, dtype=U32)
        got = await self.stream(a, b)
        want = self.ref(a) if self.unary else self.ref(a, np.asarray(b, dtype=U32))
        ops = {"a": a} if self.unary else {"a": a, "b": np.asarray(b, dtype=U32)}
        report = fv.describe_mismatches(got, want, ops)
        assert not report, f"{self.name} {label}: {report}"
        # a NaN the unit produces is the canonical quiet NaN (fpga/rtl/README.md)
        bad_nan = np.flatnonzero(fv.is_nan32(want) & (got != U32(fv.QNAN)))
        assert bad_nan.size == 0, (f"{self.name} {label}: NaN {int(got[bad_nan[0]]):#010x} is not "
                                   f"{fv.QNAN:#010x} (operand a={int(a[bad_nan[0]]):#010x})")
        self.log.info("%s %s: %d operands bit-exact in %d cycles", self.name, label, a.size, self.cycles)


def stalls(tb: TB, p_ce: float = 0.2, p_idle: float = 0.2) -> None:
    tb.set_backpressure_generator(random_stalls(tb.rng, p_ce) if p_ce else None)
    tb.set_idle_generator(random_stalls(tb.rng, p_idle) if p_idle else None)


# ---------------------------------------------------------------------------
# Tests


async def _setup(dut) -> TB:
    tb = TB(dut, seed=env_int("L2L_FP_SEED", 1))
    await tb.reset()
    return tb


@cocotb.test()
async def test_edges(dut):
    """Every pair of the binary32 edge values (and every edge value for sqrt), with stalls."""
    tb = await _setup(dut)
    stalls(tb)
    if tb.unary:
        await tb.check("edges", fv.edge_values())
    else:
        a, b = fv.edge_pairs()
        await tb.check("edge x edge", a, b)


@cocotb.test()
async def test_classes(dut):
    """Overflow, underflow, smallest-normal carry, exact, tie and near-tie classes."""
    tb = await _setup(dut)
    stalls(tb)
    n = env_int("L2L_FP_CLASS", 2000)
    rng = tb.rng
    if tb.unary:
        await tb.check("subnormals", sqrt_subnormals(rng, n))
        await tb.check("perfect squares and neighbours", sqrt_squares(rng, n))
        await tb.check("roots a hair off a midpoint", sqrt_near_ties(rng, n))
        await tb.check("finite, all binades", fv.random_finite(rng, n, 0, 254))
    else:
        await tb.check("subnormal operands", *div_subnormal_pairs(rng, n))
        await tb.check("overflow", *div_overflow_pairs(rng, n))
        await tb.check("underflow", *div_underflow_pairs(rng, n))
        await tb.check("exact quotients", *div_exact_pairs(rng, n))
        await tb.check("subnormal ties and near ties", *div_tie_pairs(rng, n))
        await tb.check("quotients a hair off a midpoint", *div_near_ties(rng, n))


@cocotb.test()
async def test_random(dut):
    """Random operands over every binade (L2L_FP_RANDOM of them), light stalls."""
    tb = await _setup(dut)
    stalls(tb, 0.05, 0.05)
    n = env_int("L2L_FP_RANDOM", 20000)
    rng = tb.rng
    h = n // 2
    if tb.unary:
        x = np.concatenate([fv.random_binades(rng, h),
                            fv.random_finite(rng, n - h, 0, 254) & U32(0x7FFFFFFF)])
        await tb.check(f"{n} random", rng.permutation(x))
    else:
        a = np.concatenate([fv.random_binades(rng, h), fv.random_finite(rng, n - h, 0, 254)])
        b = np.concatenate([fv.random_binades(rng, h), fv.random_finite(rng, n - h, 0, 254)])
        perm = rng.permutation(n)
        await tb.check(f"{n} random", a[perm], b[perm])


@cocotb.test()
async def test_full_rate(dut):
    """With ce held high and no bubbles the unit takes one operation per cycle:
    N operations finish in exactly N + 1 + latency cycles."""
    tb = await _setup(dut)
    stalls(tb, 0, 0)
    n = 2000
    a = fv.random_finite(tb.rng, n, 0, 254)
    b = None if tb.unary else fv.random_finite(tb.rng, n, 0, 254)
    if tb.unary:
        a &= U32(0x7FFFFFFF)
    await tb.check("full rate", a, b)
    # stream() drives the first operands after its first edge, so they are
    # taken at edge 2, the last at edge n + 1, and its result is read at edge
    # n + 1 + lat: any bubble or stall in the unit would add cycles
    assert tb.cycles == n + 1 + tb.lat, f"{n} operations took {tb.cycles} cycles, want {n + 1 + tb.lat}"
    tb.log.info("%s: %d results in %d cycles: %.4f per cycle, latency %d",
                tb.name, n, tb.cycles, n / tb.cycles, tb.lat)


@cocotb.test()
async def test_reset_clears_valid(dut):
    """rst (synchronous) empties the valid chain, also while ce = 0, and leaves
    the unit working: what was in flight never comes out."""
    tb = await _setup(dut)
    rng = tb.rng
    clk = dut.clk
    for ce_during_rst in (1, 0):
        # fill the pipeline with valid operations, then reset
        dut.ce.value = 1
        dut.in_valid.value = 1
        for _ in range(tb.lat + 3):
            dut.a.value = int(fv.random_finite(rng, 1, 1, 254)[0])
            if not tb.unary:
                dut.b.value = int(fv.random_finite(rng, 1, 1, 254)[0])
            await RisingEdge(clk)
        assert int(dut.out_valid.value) == 1, "pipeline did not fill"
        dut.in_valid.value = 0
        dut.ce.value = ce_during_rst
        dut.rst.value = 1
        await RisingEdge(clk)
        dut.rst.value = 0
        dut.ce.value = 1
        for _ in range(tb.lat + 2):
            await RisingEdge(clk)
            assert int(dut.out_valid.value) == 0, (
                f"out_valid after reset (ce={ce_during_rst} during rst)")
    stalls(tb)
    a = fv.random_finite(rng, 200, 0, 254)
    b = None if tb.unary else fv.random_finite(rng, 200, 0, 254)
    await tb.check("after reset", a & U32(0x7FFFFFFF) if tb.unary else a, b)
