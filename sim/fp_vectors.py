"""Operand generators and bit-exact comparison for the RTL floating-point units.

Every generator returns raw bit patterns (``np.uint32`` for binary32,
``np.uint16`` for bfloat16/binary16) so a testbench can drive them straight
onto a bus, and every reference is NumPy binary32 (or ``ml_dtypes.bfloat16`` /
``np.float16`` for the conversions): round to nearest even, subnormals kept.
Results are compared bit for bit, except that two NaNs are equal whatever
their payloads (``docs/eps-numerics.md``).

All randomness comes from a caller-supplied ``np.random.Generator`` so every
test is reproducible from its seed.

Operand classes (binary32):

- :func:`random_binades` -- sign, all 256 exponent codes (0 = zero/subnormal,
  255 = inf/NaN) and mantissa uniform.
- :func:`edge_values` / :func:`edge_pairs` -- the special values and their
  full cross product.
- :func:`tie_pairs_add` / :func:`tie_pairs_mul` -- exact sums/products that
  lie exactly halfway between two binary32 values (checked by :func:`is_tie`).
- :func:`overflow_pairs` / :func:`underflow_pairs` -- results at and beyond
  the largest finite value, and in or below the subnormal range.
- :func:`cancellation_pairs` -- nearly equal magnitudes of opposite sign
  (massive cancellation, exact zeros, normal->subnormal).
- :func:`operand_pairs` -- a shuffled mix of all of the above.
- :func:`narrowing_values` -- binary32 inputs for the fp32->bf16/fp16
  conversions: ties, overflow boundary, binary16 subnormal range.
- :func:`all_half_bits` -- all 65536 16-bit patterns.
"""
from __future__ import annotations

from typing import Callable

import ml_dtypes
import numpy as np

U32 = np.uint32
U16 = np.uint16

# Named binary32 bit patterns.
POS_ZERO = 0x00000000
NEG_ZERO = 0x80000000
MIN_SUBNORMAL = 0x00000001
MAX_SUBNORMAL = 0x007FFFFF
MIN_NORMAL = 0x00800000
MAX_FINITE = 0x7F7FFFFF
POS_INF = 0x7F800000
NEG_INF = 0xFF800000
QNAN = 0x7FC00000          # the canonical quiet NaN the RTL generates
SNAN = 0x7F800001          # a signalling NaN (quiet bit clear, payload 1)
ONE = 0x3F800000
TWO = 0x40000000
HALF = 0x3F000000

# ---------------------------------------------------------------------------
# Bit views


def f32(bits) -> np.ndarray:
    """binary32 bit patterns (any int array/scalar) viewed as ``np.float32``."""
    return np.asarray(bits, dtype=np.uint64).astype(U32).view(np.float32)


def bits32(x) -> np.ndarray:
    """``np.float32`` values as their ``np.uint32`` bit patterns."""
    return np.asarray(x, dtype=np.float32).view(U32)


def is_nan32(bits) -> np.ndarray:
    """True where a binary32 bit pattern is a NaN (any payload, either sign)."""
    b = np.asarray(bits, dtype=np.uint64)
    return (b & 0x7FFFFFFF) > 0x7F800000


def is_nan16(bits, fmt: str) -> np.ndarray:
    """True where a 16-bit pattern is a NaN in ``fmt`` ('bf16' or 'fp16')."""
    b = np.asarray(bits, dtype=np.uint64) & 0x7FFF
    return b > (0x7F80 if fmt == "bf16" else 0x7C00)


# ---------------------------------------------------------------------------
# References (NumPy binary32 / ml_dtypes), vectorised, on bit patterns


def ref_add(a, b) -> np.ndarray:
    """Bits of ``float32(a) + float32(b)``."""
    with np.errstate(all="ignore"):
        return bits32(np.add(f32(a), f32(b), dtype=np.float32))


def ref_sub(a, b) -> np.ndarray:
    """Bits of ``float32(a) - float32(b)``."""
    with np.errstate(all="ignore"):
        return bits32(np.subtract(f32(a), f32(b), dtype=np.float32))


def ref_addsub(a, b, sub) -> np.ndarray:
    """Bits of ``a - b`` where ``sub`` is true, ``a + b`` elsewhere."""
    sub = np.asarray(sub, dtype=bool)
    return np.where(sub, ref_sub(a, b), ref_add(a, b)).astype(U32)


def ref_mul(a, b) -> np.ndarray:
    """Bits of ``float32(a) * float32(b)``."""
    with np.errstate(all="ignore"):
        return bits32(np.multiply(f32(a), f32(b), dtype=np.float32))


def ref_div(a, b) -> np.ndarray:
    """Bits of ``float32(a) / float32(b)`` (correctly rounded)."""
    with np.errstate(all="ignore"):
        return bits32(np.divide(f32(a), f32(b), dtype=np.float32))


def ref_sqrt(a) -> np.ndarray:
    """Bits of ``sqrt(float32(a))`` (correctly rounded)."""
    with np.errstate(all="ignore"):
        return bits32(np.sqrt(f32(a), dtype=np.float32))


def ref_bf16_to_fp32(h) -> np.ndarray:
    """Bits of the exact widening of bfloat16 patterns ``h`` to binary32."""
    x = np.asarray(h, dtype=np.uint64).astype(U16).view(ml_dtypes.bfloat16)
    return bits32(x.astype(np.float32))


def ref_fp16_to_fp32(h) -> np.ndarray:
    """Bits of the exact widening of binary16 patterns ``h`` to binary32."""
    x = np.asarray(h, dtype=np.uint64).astype(U16).view(np.float16)
    return bits32(x.astype(np.float32))


def ref_fp32_to_bf16(a) -> np.ndarray:
    """bfloat16 bits of binary32 ``a`` rounded to nearest even (ml_dtypes)."""
    with np.errstate(all="ignore"):
        return f32(a).astype(ml_dtypes.bfloat16).view(U16)


def ref_fp32_to_fp16(a) -> np.ndarray:
    """binary16 bits of binary32 ``a`` rounded to nearest even; overflow -> inf."""
    with np.errstate(all="ignore"):
        return f32(a).astype(np.float16).view(U16)


def check_numpy_ieee() -> None:
    """Raise if this process's NumPy does not round to nearest even or flushes subnormals.

    A testbench runs inside the simulator's Python; a library that set
    FTZ/DAZ or a different rounding mode would silently change every reference.
    """
    probes = [
        (ref_add(MIN_SUBNORMAL, MIN_SUBNORMAL), 0x00000002),    # subnormal + subnormal
        (ref_mul(MIN_NORMAL, HALF), 0x00400000),                 # normal -> subnormal, no FTZ
        (ref_mul(0x00400000, TWO), MIN_NORMAL),                  # subnormal input, no DAZ
        (ref_add(ONE, 0x33800000), ONE),                         # 1 + 2^-24: tie -> even (down)
        (ref_add(0x3F800001, 0x33800000), 0x3F800002),           # odd + half ulp: tie -> even (up)
        (ref_fp32_to_bf16(0x3F808000), 0x3F80),                  # bf16 tie -> even
        (ref_fp32_to_bf16(0x3F818000), 0x3F82),
        (ref_fp32_to_fp16(0x477FF000), 0x7C00),                  # 65520 -> inf
        (ref_fp32_to_fp16(0x33000000), 0x0000),                  # 2^-25: tie between 0 and 2^-24 -> 0
        (ref_fp32_to_fp16(0x33C00000), 0x0002),                  # 1.5 * 2^-24 -> tie -> 2 * 2^-24
    ]
    for got, want in probes:
        if int(np.asarray(got).reshape(-1)[0]) != want:
            raise RuntimeError(f"NumPy reference is not IEEE RNE with subnormals: got "
                               f"{int(np.asarray(got).reshape(-1)[0]):#x}, want {want:#x}")


# ---------------------------------------------------------------------------
# Comparison


def same_bits(actual, expected, width: int = 32, fmt: str | None = None) -> np.ndarray:
    """Elementwise True where ``actual`` and ``expected`` have equal bits or are both NaN.

    ``width`` is 32 (binary32) or 16; for 16 give ``fmt`` = 'bf16' or 'fp16'.
    """
    a = np.asarray(actual, dtype=np.uint64)
    e = np.asarray(expected, dtype=np.uint64)
    if width == 32:
        both_nan = is_nan32(a) & is_nan32(e)
    elif width == 16:
        if fmt not in ("bf16", "fp16"):
            raise ValueError("width=16 needs fmt='bf16' or 'fp16'")
        both_nan = is_nan16(a, fmt) & is_nan16(e, fmt)
    else:
        raise ValueError(f"width {width}")
    return (a == e) | both_nan


def mismatches(actual, expected, width: int = 32, fmt: str | None = None) -> np.ndarray:
    """Indices where :func:`same_bits` is False."""
    return np.flatnonzero(~same_bits(actual, expected, width, fmt))


def describe_mismatches(actual, expected, operands: dict[str, np.ndarray] | None = None,
                        width: int = 32, fmt: str | None = None, limit: int = 8) -> str:
    """'' when all match, else a report of the count and the first ``limit`` mismatches in hex."""
    bad = mismatches(actual, expected, width, fmt)
    if bad.size == 0:
        return ""
    digits = width // 4
    lines = [f"{bad.size} of {np.asarray(expected).size} differ"]
    for i in bad[:limit]:
        ops = ", ".join(f"{k}={int(v[i]):#0{v.dtype.itemsize * 2 + 2}x}"
                        for k, v in ((k, np.asarray(v)) for k, v in (operands or {}).items()))
        lines.append(f"  [{i}] {ops}: got {int(np.asarray(actual)[i]):#0{digits + 2}x} "
                     f"want {int(np.asarray(expected)[i]):#0{digits + 2}x}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# Tie detection (exact, through float64)


def is_tie(exact: np.ndarray) -> np.ndarray:
    """True where float64 ``exact`` lies exactly halfway between two adjacent finite binary32 values.

    Use with sums and products of binary32 values that float64 holds exactly
    (any product; a sum whose exponents differ by at most 29).
    """
    s = np.asarray(exact, dtype=np.float64)
    with np.errstate(all="ignore"):
        r = s.astype(np.float32)
        other = 2.0 * s - r.astype(np.float64)
        o32 = other.astype(np.float32)
        adjacent = np.nextafter(r, o32) == o32
        return (np.isfinite(r) & np.isfinite(o32) & (r.astype(np.float64) != s)
                & (o32.astype(np.float64) == other) & (o32 != r) & adjacent)


def exact_sum(a, b) -> np.ndarray:
    """``a + b`` in float64 (exact when the exponents differ by at most 29)."""
    return f32(a).astype(np.float64) + f32(b).astype(np.float64)


def exact_product(a, b) -> np.ndarray:
    """``a * b`` in float64 (always exact for finite binary32 operands)."""
    return f32(a).astype(np.float64) * f32(b).astype(np.float64)


# ---------------------------------------------------------------------------
# Generators


def _pack(sign, exp, man) -> np.ndarray:
    sign = np.asarray(sign, dtype=np.uint64)
    exp = np.asarray(exp, dtype=np.uint64)
    man = np.asarray(man, dtype=np.uint64)
    return ((sign << 31) | (exp << 23) | (man & 0x7FFFFF)).astype(U32)


def _signs(rng, n) -> np.ndarray:
    return rng.integers(0, 2, n, dtype=np.uint64)


def _mans(rng, n) -> np.ndarray:
    return rng.integers(0, 1 << 23, n, dtype=np.uint64)


def random_binades(rng: np.random.Generator, n: int) -> np.ndarray:
    """``n`` binary32 patterns: sign, exponent code (0..255) and mantissa each uniform.

    About 1/256 are zero/subnormal and 1/256 inf/NaN.
    """
    return _pack(_signs(rng, n), rng.integers(0, 256, n, dtype=np.uint64), _mans(rng, n))


def random_finite(rng: np.random.Generator, n: int, emin: int = 0, emax: int = 254) -> np.ndarray:
    """``n`` finite patterns with exponent code uniform in ``[emin, emax]`` (0 = subnormal)."""
    return _pack(_signs(rng, n), rng.integers(emin, emax + 1, n, dtype=np.uint64), _mans(rng, n))


def edge_values() -> np.ndarray:
    """The binary32 special values, both signs: zeros, subnormal and normal limits, inf, NaNs, small exact numbers."""
    mags = [
        POS_ZERO, MIN_SUBNORMAL, 0x00000002, 0x00000003, 0x00400000, MAX_SUBNORMAL - 1, MAX_SUBNORMAL,
        MIN_NORMAL, MIN_NORMAL + 1, 0x00FFFFFF, 0x01000000,
        HALF, 0x3F7FFFFF, ONE, 0x3F800001, 0x3FC00000, TWO, 0x40400000,
        0x33800000, 0x34000000,        # 2^-24, 2^-23: half and one ulp of 1
        0x7E800000, 0x7EFFFFFF, 0x7F000000, 0x7F7FFFFE, MAX_FINITE,
        POS_INF, QNAN, 0x7FFFFFFF, SNAN, 0x7FA00000,
    ]
    mags = np.array(mags, dtype=np.uint64)
    return np.concatenate([mags, mags | 0x80000000]).astype(U32)


def edge_pairs() -> tuple[np.ndarray, np.ndarray]:
    """Every ordered pair of :func:`edge_values` (3600 pairs)."""
    e = edge_values()
    a, b = np.meshgrid(e, e, indexing="ij")
    return a.reshape(-1).copy(), b.reshape(-1).copy()


def tie_pairs_add(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` pairs whose exact sum is (mostly) exactly halfway between two binary32 values.

    ``b``'s exponent is ``d`` = 1..24 below ``a``'s and the ``d`` low bits of
    ``b``'s 24-bit significand are ``10...0``, so the part shifted out below
    ``a``'s ulp is exactly half an ulp. A carry-out or a cancellation moves the
    rounding point and can spoil the tie; :func:`is_tie` on :func:`exact_sum`
    says which pairs really tie (typically well over half). Signs are random,
    so both addition and subtraction of the magnitudes occur.
    """
    d = rng.integers(1, 25, n, dtype=np.uint64)
    ea = rng.integers(25, 255, n, dtype=np.uint64)        # eb = ea - d >= 1: b normal
    eb = ea - d
    ma = _mans(rng, n)
    sig_b = (1 << 23) | _mans(rng, n)
    low_mask = (np.uint64(1) << d) - np.uint64(1)
    sig_b = (sig_b & ~low_mask) | (np.uint64(1) << (d - np.uint64(1)))
    a = _pack(_signs(rng, n), ea, ma)
    b = _pack(_signs(rng, n), eb, sig_b)
    swap = rng.integers(0, 2, n).astype(bool)
    return np.where(swap, b, a).astype(U32), np.where(swap, a, b).astype(U32)


def tie_pairs_mul(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` pairs whose exact product is (mostly) exactly halfway between two binary32 values.

    Normal results (about 3/4): ``b``'s significand is ``(2^j + 1) * 2^(23-j)``
    (``j`` = 1 gives 1.5) and ``a``'s significand ends in ``1 0^(j-1)`` and is
    small enough that the product keeps 24+j bits: the ``j`` bits dropped are
    exactly ``10...0``. Subnormal results (the rest): ``a`` times a power of
    two that shifts ``a`` into the subnormal range dropping exactly the bits
    ``10...0`` of its significand. :func:`is_tie` on :func:`exact_product`
    confirms the ties.
    """
    n_sub = n // 4
    n_norm = n - n_sub
    # normal-range ties
    j = rng.integers(1, 23, n_norm, dtype=np.uint64)
    one = np.uint64(1)
    sig_b = ((one << j) + one) << (np.uint64(23) - j)
    limit = ((one << (np.uint64(24) + j)) - one) // ((one << j) + one)   # sig_a * (2^j + 1) < 2^(24+j)
    hi_range = (limit >> j) - ((one << np.uint64(23)) >> j)              # choices of the bits above the low j
    top = (rng.random(n_norm) * hi_range.astype(np.float64)).astype(np.uint64)
    sig_a = ((((one << np.uint64(23)) >> j) + top) << j) | (one << (j - one))
    # exponents: product exponent (unbiased) uniform in [-126, 127]
    ep = rng.integers(-126, 128, n_norm)
    ea_u = rng.integers(np.maximum(-126, ep - 127), np.minimum(127, ep + 126) + 1)
    eb_u = ep - ea_u
    a_n = _pack(_signs(rng, n_norm), (ea_u + 127).astype(np.uint64), sig_a)
    b_n = _pack(_signs(rng, n_norm), (eb_u + 127).astype(np.uint64), sig_b)
    # subnormal-range ties: a * 2^k with a shift of s bits into the subnormal range
    s = rng.integers(1, 24, n_sub, dtype=np.uint64)                      # bits dropped
    sig = (one << np.uint64(23)) | _mans(rng, n_sub)
    sig = (sig & ~((one << s) - one)) | (one << (s - one))
    # result = sig * 2^(ea_u - 23 + k); subnormal grid is 2^-149: need ea_u - 23 + k = -149 - s
    # (a's unbiased exponent ea_u, so ea_u + k = -126 - s; k in [-149, 127] needs ea_u <= 23 - s)
    ea_u = rng.integers(-126, 24 - s.astype(np.int64))
    k = -126 - s.astype(np.int64) - ea_u
    kb = np.where(k >= -126, ((k + 127).astype(np.uint64) << 23), one << (k + 149).astype(np.uint64))
    a_s = _pack(_signs(rng, ea_u.size), (ea_u + 127).astype(np.uint64), sig)
    b_s = (_signs(rng, ea_u.size) << 31 | kb).astype(U32)
    a = np.concatenate([a_n, a_s])
    b = np.concatenate([b_n, b_s])
    swap = rng.integers(0, 2, a.size).astype(bool)
    return np.where(swap, b, a).astype(U32), np.where(swap, a, b).astype(U32)


def overflow_pairs(rng: np.random.Generator, n: int, op: str) -> tuple[np.ndarray, np.ndarray]:
    """``n`` pairs whose ``op`` ('add' or 'mul') result is at or beyond the largest finite value.

    add: same-sign operands in the top two binades plus the exact boundary
    ``MAX_FINITE +/- 2^103 (+/- 1 ulp)`` (half an ulp of MAX_FINITE, which
    rounds up to inf). mul: exponent sums around 2^128.
    """
    if op == "add":
        m = n - 8
        s = _signs(rng, m)
        a = _pack(s, np.full(m, 254, np.uint64), _mans(rng, m))
        b = _pack(s, rng.integers(250, 255, m, dtype=np.uint64), _mans(rng, m))
        half_ulp = 0x73000000                                 # 2^103
        fixed_a = [MAX_FINITE, MAX_FINITE, MAX_FINITE, MAX_FINITE | NEG_ZERO,
                   MAX_FINITE, 0x7F7FFFFE, MAX_FINITE, MAX_FINITE | NEG_ZERO]
        fixed_b = [half_ulp, half_ulp - 1, half_ulp + 1, half_ulp | NEG_ZERO,
                   MAX_FINITE, half_ulp, 0x73000000 | NEG_ZERO, MAX_FINITE | NEG_ZERO]
        return (np.concatenate([a, np.array(fixed_a, U32)]).astype(U32),
                np.concatenate([b, np.array(fixed_b, U32)]).astype(U32))
    if op == "mul":
        ep = rng.integers(124, 135, n)                        # unbiased product exponent near 128
        ea_u = rng.integers(np.maximum(-126, ep - 127), 128)
        eb_u = np.clip(ep - ea_u, -126, 127)
        return (_pack(_signs(rng, n), (ea_u + 127).astype(np.uint64), _mans(rng, n)),
                _pack(_signs(rng, n), (eb_u + 127).astype(np.uint64), _mans(rng, n)))
    raise ValueError(op)


def underflow_pairs(rng: np.random.Generator, n: int, op: str) -> tuple[np.ndarray, np.ndarray]:
    """``n`` pairs whose ``op`` ('add' or 'mul') result is subnormal, zero, or near the normal limit.

    add: subnormal and smallest-normal operands of either sign (sums of
    subnormals are exact; carries into the normal range). mul: unbiased
    product exponents from -155 to -120, both operands normal or one
    subnormal, so results round into the subnormal range, to the smallest
    normal, or to zero.
    """
    if op == "add":
        return random_finite(rng, n, 0, 2), random_finite(rng, n, 0, 2)
    if op == "mul":
        half = n // 2
        ep = rng.integers(-155, -119, half)
        ea_u = rng.integers(np.maximum(-126, ep - 127), np.minimum(127, ep + 126) + 1)
        eb_u = ep - ea_u
        a1 = _pack(_signs(rng, half), (ea_u + 127).astype(np.uint64), _mans(rng, half))
        b1 = _pack(_signs(rng, half), (eb_u + 127).astype(np.uint64), _mans(rng, half))
        m = n - half
        a2 = random_finite(rng, m, 0, 0)                       # subnormal times something small-ish
        b2 = random_finite(rng, m, 100, 160)
        return np.concatenate([a1, a2]).astype(U32), np.concatenate([b1, b2]).astype(U32)
    raise ValueError(op)


def cancellation_pairs(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` pairs ``(a, -(a +/- a few ulps))`` and exponent-neighbour pairs: catastrophic cancellation.

    Covers exact zero results (``x - x``), long normalisation shifts and
    normal operands whose difference is subnormal.
    """
    a = random_finite(rng, n, 1, 254)
    delta = rng.integers(-40, 41, n)
    kind = rng.integers(0, 3, n)
    mag = (a & U32(0x7FFFFFFF)).astype(np.int64)
    bmag = np.clip(mag + np.where(kind == 0, 0, delta), 0, MAX_FINITE)
    bmag = np.where(kind == 2, np.clip(mag - (1 << 23) + delta, 0, MAX_FINITE), bmag)  # one binade below
    b = ((~a.astype(np.uint64) & 0x80000000) | bmag.astype(np.uint64)).astype(U32)
    low = rng.random(n) < 0.2                                # some near the subnormal boundary
    a = np.where(low, random_finite(rng, n, 1, 3), a).astype(U32)
    b = np.where(low, (~a.astype(np.uint64) & 0x80000000 | random_finite(rng, n, 0, 2).astype(np.uint64)
                       & 0x7FFFFFFF).astype(U32), b).astype(U32)
    return a, b


def near_pairs(rng: np.random.Generator, n: int, span: int = 30) -> tuple[np.ndarray, np.ndarray]:
    """``n`` finite pairs whose exponent codes differ by at most ``span`` (either sign).

    For addition these exercise the alignment shift, the guard/round/sticky
    bits and the normalisation on every pair, unlike uniformly random
    exponents, whose sum is mostly just the larger operand.
    """
    ea = rng.integers(0, 255, n)
    eb = np.clip(ea + rng.integers(-span, span + 1, n), 0, 254)
    return (_pack(_signs(rng, n), ea.astype(np.uint64), _mans(rng, n)),
            _pack(_signs(rng, n), eb.astype(np.uint64), _mans(rng, n)))


def operand_pairs(rng: np.random.Generator, n: int, op: str = "add") -> tuple[np.ndarray, np.ndarray]:
    """``n`` shuffled pairs for ``op`` ('add' or 'mul'): a mix of every class.

    About a third :func:`random_binades`, and the rest split between finite
    values over the full exponent range, ties, overflow, underflow and (for
    add) cancellation and :func:`near_pairs`. The edge cross product is
    separate (:func:`edge_pairs`).
    """
    parts_n = n // 12
    gens: list[Callable[[], tuple[np.ndarray, np.ndarray]]] = [
        lambda: (random_finite(rng, 2 * parts_n), random_finite(rng, 2 * parts_n)),
        lambda: (tie_pairs_add if op == "add" else tie_pairs_mul)(rng, parts_n),
        lambda: overflow_pairs(rng, parts_n, op),
        lambda: underflow_pairs(rng, parts_n, op),
    ]
    if op == "add":
        gens.append(lambda: cancellation_pairs(rng, parts_n))
        gens.append(lambda: near_pairs(rng, 2 * parts_n))
    elif op != "mul":
        raise ValueError(op)
    a_parts, b_parts = [], []
    for g in gens:
        x, y = g()
        a_parts.append(x)
        b_parts.append(y)
    rest = n - sum(x.size for x in a_parts)
    a_parts.append(random_binades(rng, rest))
    b_parts.append(random_binades(rng, rest))
    a = np.concatenate(a_parts).astype(U32)
    b = np.concatenate(b_parts).astype(U32)
    perm = rng.permutation(n)
    return a[perm], b[perm]


# ---------------------------------------------------------------------------
# 16-bit inputs and narrowing inputs


def all_half_bits() -> np.ndarray:
    """All 65536 16-bit patterns (for bf16->fp32 and fp16->fp32: exhaustive)."""
    return np.arange(1 << 16, dtype=U16)


def narrowing_values(rng: np.random.Generator, n: int, fmt: str) -> np.ndarray:
    """``n`` binary32 inputs for the fp32->``fmt`` ('bf16' or 'fp16') conversion.

    A shuffled mix of: random binades; exact ties at the target precision
    (low bits ``10...0``) including, for fp16, ties in its subnormal range;
    values one ulp either side of a tie; the overflow boundary; and, for fp16,
    the whole binary16 exponent range and below it (results 0 or min subnormal).
    The binary32 :func:`edge_values` are included first.
    """
    one = np.uint64(1)
    parts = [edge_values()]
    q = n // 8
    parts.append(random_binades(rng, q))
    if fmt == "bf16":
        x = random_binades(rng, 3 * q).astype(np.uint64)
        tie = (x & ~np.uint64(0xFFFF)) | np.uint64(0x8000)
        parts += [tie, tie + one, tie - one]
        top = _pack(_signs(rng, q), np.full(q, 254, np.uint64), np.uint64(0x7F0000) | _mans(rng, q) & 0xFFFF)
        parts.append(top)                                    # around bf16 max: 0x7F7F8000 rounds to inf
        parts.append(random_finite(rng, q, 0, 0))            # binary32 subnormals stay bf16 subnormals
    elif fmt == "fp16":
        parts.append(random_finite(rng, q, 127 - 30, 127 + 17))     # fp16 range and a bit beyond
        # normal fp16 ties: binary32 exponent in fp16 normal range, low 13 bits 1 0^12
        x = random_finite(rng, q, 127 - 14, 127 + 15).astype(np.uint64)
        tie = (x & ~np.uint64(0x1FFF)) | np.uint64(0x1000)
        parts += [tie, tie + one, tie - one]
        # subnormal fp16 ties: (2k+1) * 2^-25 .. scaled: value = (2k+1) * 2^(-25 - s), s >= 0 keeps it a tie
        # only for s = 0; others are below-tie/ above-tie points of the subnormal grid.
        k = rng.integers(0, 1 << 10, q)
        odd = (2 * k + 1).astype(np.float64) * 2.0 ** -25
        sub_ties = bits32(odd.astype(np.float32)).astype(np.uint64) | (_signs(rng, q) << 31)
        parts += [sub_ties, sub_ties + one, sub_ties - one]
        # overflow boundary: 65504 (max), 65519.99.., 65520 (tie -> inf), 65536
        m = (0x477FE000 + rng.integers(-0x4000, 0x6000, q)).astype(np.uint64) | (_signs(rng, q) << 31)
        parts.append(m)
    else:
        raise ValueError(fmt)
    x = np.concatenate([p.astype(np.uint64) for p in parts]).astype(U32)
    x = x[: n] if x.size >= n else np.concatenate([x, random_binades(rng, n - x.size)])
    head = edge_values().size
    return np.concatenate([x[:head], rng.permutation(x[head:])]).astype(U32)
