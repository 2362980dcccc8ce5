"""The EPS contract's vector classes as reusable cases for the RTL testbenches.

A :class:`Case` is one layer update's inputs: the state ``p, m, v`` (binary32),
K gradient contributions as bit patterns of the gradient dtype, and the step
scalars. Its golden results come from the golden model ``l2l.eps.numerics``
(never from a tolerance): :meth:`Case.reduced` (g and the finite flag) and
:meth:`Case.updated` (p', m', v' and the device copy).

:func:`make_case` builds the classes of docs/eps-numerics.md "What the
tests must cover": random vectors over every binade with zeros of both signs
and subnormals (``wide``), the special-value grid (``specials-<scalars>``),
exact ties in the reduction, the products, the sums and the device copy,
non-finite gradients (``nonfinite-<how>``) and realistic training values
(``train``). A case's ``n_decay`` is its decay boundary (the parameter groups:
elements below it are weight-decayed; None means all, a value above n acts as
n, as the RTL's register does); :func:`decay_boundaries` lists the boundaries
worth testing for a beat / burst / block shape. The value generators shared with the NumPy-side suite
(tests/eps_oracle.py) are imported from it, so both suites draw from
the same distributions; the tie constructions here are this module's own.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

_TESTS = Path(__file__).resolve().parents[1] / "tests"
if str(_TESTS) not in sys.path:
    sys.path.insert(0, str(_TESTS))

from l2l.eps import OptimizerHyper, StepScalars  # noqa: E402
from l2l.eps import numerics  # noqa: E402
from l2l.eps.numerics import COPY_DTYPES  # noqa: E402

from eps_oracle import (  # noqa: E402  (tests/ on sys.path)
    HYPERS,
    SPECIAL_SCALARS,
    bits_of,
    copy_tie_values,
    custom_scalars,
    grad_array,
    nonfinite_grads,
    odd_f32,
    product_tie_inputs,
    round_bits,
    specials,
    wide_f32,
    wide_grad_bits,
)

GDTYPE_CODE = {"fp32": 0, "bf16": 1, "fp16": 2}     # the RTL GDTYPE / CDTYPE parameter values
DTYPE_BITS = {"fp32": 32, "bf16": 16, "fp16": 16}
UINT_OF = {32: np.uint32, 16: np.uint16}

NONFINITE = ["+inf", "-inf", "nan", "inf-inf", "sum-overflow", "scale-overflow"]


@dataclass
class Case:
    """One layer update: state, K contributions (bit patterns of ``gdtype``) and scalars."""

    name: str
    p: np.ndarray
    m: np.ndarray
    v: np.ndarray
    grad_bits: list
    gdtype: str
    s: StepScalars
    meta: dict = field(default_factory=dict)
    n_decay: int | None = None      # None: every element decayed; above n: as n (the RTL clamps)

    @property
    def decayed(self) -> int:
        """How many elements are weight-decayed: n_decay within [0, n] (the golden model's range)."""
        return self.n if self.n_decay is None else min(int(self.n_decay), self.n)

    @property
    def n_decay_arg(self) -> int:
        """The value for the kernel's n_decay register (uint32): n when the case has none."""
        return self.n if self.n_decay is None else int(self.n_decay)

    @property
    def n(self) -> int:
        return int(self.p.shape[0])

    @property
    def K(self) -> int:
        return len(self.grad_bits)

    def grads(self) -> list:
        """The contributions as arrays of the gradient dtype (what a backend receives)."""
        return [grad_array(b, self.gdtype) for b in self.grad_bits]

    def grad_words(self, k: int) -> np.ndarray:
        """Contribution k as unsigned words of the gradient width (uint32 or uint16)."""
        return np.asarray(self.grad_bits[k], np.uint64).astype(UINT_OF[DTYPE_BITS[self.gdtype]])

    def reduced(self):
        """Golden g (binary32) and the finite flag."""
        g = np.empty(self.n, np.float32)
        finite = numerics.reduce_gradients(self.grads(), self.s.inv_scale, g)
        return g, finite

    def updated(self, cdtype: str, g: np.ndarray | None = None):
        """Golden (p', m', v', copy) from this state and ``g`` (default: the golden reduced g).

        The update is computed whatever the finite flag says: the datapath computes
        every element; skipping a non-finite layer is the kernel's job."""
        if g is None:
            g = self.reduced()[0]
        p, m, v = self.p.copy(), self.m.copy(), self.v.copy()
        c = np.empty(self.n, COPY_DTYPES[cdtype])
        numerics.adamw_update(p, m, v, g.copy(), self.s, c, n_decay=self.decayed)
        return p, m, v, c


def words(a: np.ndarray) -> np.ndarray:
    """An array's elements as unsigned words of its width (bit patterns)."""
    a = np.ascontiguousarray(a)
    return a.view(UINT_OF[a.dtype.itemsize * 8])


def f32(bits) -> np.ndarray:
    return np.asarray(bits, np.uint64).astype(np.uint32).view(np.float32)


# --------------------------------------------------------------------------
# builders: (rng, n, K, gdtype) -> Case
# --------------------------------------------------------------------------


def _wide_state(rng, n):
    return wide_f32(rng, n), wide_f32(rng, n), wide_f32(rng, n, nonneg=True)


def _random_scalars(rng, K):
    h = HYPERS[int(rng.integers(0, len(HYPERS)))]
    return StepScalars.compute(h, int(rng.integers(1, 50)), loss_scale=float(2 ** int(rng.integers(0, 17))),
                               divisor=float(K))


def wide(rng, n, K, gdtype):
    """Random p, m, v, g over many binades, zeros of both signs, subnormals."""
    p, m, v = _wide_state(rng, n)
    grad_bits = [wide_grad_bits(rng, n, gdtype) for _ in range(K)]
    return Case("wide", p, m, v, grad_bits, gdtype, _random_scalars(rng, K))


def _specials_builder(sname):
    def build(rng, n, K, gdtype):
        """Random rows of the special-value grid (zeros, subnormals, tiny, huge) under one scalar set."""
        sp, sv, sg = specials(True), specials(False), specials(True, gdtype)
        pick = lambda vals: np.asarray(vals, np.uint64)[rng.integers(0, len(vals), n)]  # noqa: E731
        p, m, v = f32(pick(sp)), f32(pick(sp)), f32(pick(sv))
        grad_bits = [pick(sg) for _ in range(K)]
        return Case(f"specials-{sname}", p, m, v, grad_bits, gdtype, SPECIAL_SCALARS[sname])
    return build


def ties_reduction(rng, n, K, gdtype):
    """Contributions whose exact running sum lies halfway between two binary32 values:
    g_0 = +-2**e (1 + f), every later g_k = +-2**(e-24), half an ulp of g_0."""
    if gdtype == "fp16":
        e = rng.integers(0, 16, n)
        g0 = round_bits(np.ldexp(1.0 + rng.integers(0, 1024, n) / 1024.0, e), "fp16")[0]
    else:
        e = rng.integers(-20, 20, n)
        fb = 23 if gdtype == "fp32" else 7
        g0 = round_bits(np.ldexp(1.0 + rng.integers(0, 1 << fb, n) * 2.0 ** -fb, e), "fp32")[0]
        if gdtype == "bf16":
            g0 = g0 >> np.uint64(16)
    sbit = np.uint64(31 if gdtype == "fp32" else 15)
    g0 = g0 | (rng.integers(0, 2, n, dtype=np.uint64) << sbit)
    rest = []
    for _ in range(K - 1):
        r = np.ldexp(np.where(rng.random(n) < 0.5, -1.0, 1.0), e - 24)
        b = round_bits(r, "fp16" if gdtype == "fp16" else "fp32")[0]
        rest.append(b >> np.uint64(16) if gdtype == "bf16" else b)
    p, m, v = _wide_state(rng, n)
    return Case("ties-reduction", p, m, v, [g0] + rest, gdtype, custom_scalars(inv_scale=0.5))


def ties_products(rng, n, K, gdtype):
    """Products exactly halfway (p*decay, b1*m, b2*v, omb1*g, neg_step*q): fp32 g, K = 1."""
    p, m, v, g, s = product_tie_inputs(rng, n)
    return Case("ties-products", p, m, v, [g], "fp32", s)


def ties_sums(rng, n, K, gdtype):
    """Sums exactly halfway: m' = m + g and v' = v + g*g with g half an ulp of m and g*g
    half an ulp of v (a third of the elements); p' = p + (-m) with m half an ulp of p
    (a third); d = sqrt(v) + eps with eps half an ulp of sqrt(v) (the rest)."""
    s = custom_scalars(decay=1.0, b1=1.0, omb1=1.0, b2=1.0, omb2=1.0, inv_bc2_sqrt=1.0, eps=1.0,
                       neg_step=-1.0)
    sel = rng.integers(0, 3, n)
    sign = np.where(rng.random(n) < 0.5, -1.0, 1.0)
    # class 0: m' and v' ties
    e = rng.integers(-40, 40, n)
    m0 = odd_f32(rng, n, 0, 1) * np.ldexp(1.0, e)
    g0 = sign * np.ldexp(1.0, e - 24)
    v0 = np.abs(odd_f32(rng, n, 0, 1)) * np.ldexp(1.0, 2 * e - 24)
    # class 1: p' tie, g = v = 0 so d = eps = 1 and p' = p - m
    p1 = odd_f32(rng, n, -100, 100)
    ep = np.floor(np.log2(np.abs(p1)))
    m1 = sign * np.ldexp(1.0, (ep - 24).astype(int))
    # class 2: d tie needs eps = half an ulp of sqrt(v); that is a scalar, so it is carried by
    # class 0/1's eps = 1 here: sqrt(v) = 2**24 * (1 + odd/2**11) has an ulp of 2 ... use
    # v = x*x with x = 2**24 (1 + j 2**-11), j odd: ulp(x) = 2, half = 1 = eps.
    j = rng.integers(0, 1 << 10, n) * 2 + 1
    x = np.ldexp(1.0 + j * 2.0 ** -11, 24)
    v2 = x * x
    p = np.where(sel == 1, p1, wide_f32(rng, n).astype(np.float64))
    m = np.select([sel == 0, sel == 1], [m0, m1], wide_f32(rng, n).astype(np.float64))
    v = np.select([sel == 0, sel == 1], [v0, 0.0], v2)
    g = np.where(sel == 0, g0, 0.0)
    g_bits = round_bits(g, "fp32")[0]
    out = Case("ties-sums", p.astype(np.float32), m.astype(np.float32), v.astype(np.float32), [g_bits],
               "fp32", s)
    assert (out.v.astype(np.float64) == v).all() and (out.m.astype(np.float64) == m).all()
    return out


def ties_copy(rng, n, K, gdtype):
    """p' exactly halfway for bf16 / fp16 (normal, subnormal, overflow edge): g = m = v = 0."""
    vals = copy_tie_values(rng, max(1, n // 3 + 1))
    p = vals[rng.integers(0, vals.size, n)]
    z = np.zeros(n, np.float32)
    return Case("ties-copy", p, z.copy(), z.copy(), [bits_of(z)], "fp32", custom_scalars(decay=1.0))


def _nonfinite_builder(how):
    def build(rng, n, K, gdtype):
        """A reduced g that is inf or NaN at a few elements (the flag must drop)."""
        kk = K
        if how == "inf-inf" and K < 2:
            kk = 2
        if how == "sum-overflow" and (K < 2 or gdtype == "fp16"):
            raise ValueError("sum-overflow needs K >= 2 and fp32/bf16")
        i = int(rng.integers(0, n))
        grad_bits, s = nonfinite_grads(rng, n, how, kk, gdtype, i)
        p, m, v = _wide_state(rng, n)
        return Case(f"nonfinite-{how}", p, m, v, grad_bits, gdtype, s, {"at": i})
    return build


def train(rng, n, K, gdtype):
    """Values like a training run's: small weights, gradients over 1e-10 .. 1e3."""
    p = (rng.standard_normal(n) * 0.02).astype(np.float32)
    m = (rng.standard_normal(n) * 1e-4).astype(np.float32)
    v = np.abs(rng.standard_normal(n) * 1e-8).astype(np.float32)
    lo = -6 if gdtype == "fp16" else -10
    real = rng.standard_normal((K, n)) * 10.0 ** rng.uniform(lo, 3, (K, n))
    fmt = "fp16" if gdtype == "fp16" else "fp32"
    grad_bits = [round_bits(r, fmt)[0] for r in real]
    if gdtype == "bf16":
        grad_bits = [b >> np.uint64(16) for b in grad_bits]
    s = StepScalars.compute(OptimizerHyper(), int(rng.integers(1, 20)),
                            loss_scale=1024.0 if gdtype == "fp16" else 1.0, divisor=float(K))
    return Case("train", p, m, v, grad_bits, gdtype, s)


BUILDERS: dict[str, Callable] = {
    "wide": wide,
    **{f"specials-{k}": _specials_builder(k) for k in SPECIAL_SCALARS},
    "ties-reduction": ties_reduction,
    "ties-products": ties_products,
    "ties-sums": ties_sums,
    "ties-copy": ties_copy,
    **{f"nonfinite-{h}": _nonfinite_builder(h) for h in NONFINITE},
    "train": train,
}

# classes meaningful for the reducer (they honour the gradient dtype and K) and for the AdamW datapath
REDUCE_KINDS = ["wide", "specials-default-t1", "ties-reduction", "train"] + [f"nonfinite-{h}" for h in NONFINITE]
ADAMW_KINDS = ["wide", *(f"specials-{k}" for k in SPECIAL_SCALARS), "ties-products", "ties-sums", "ties-copy",
               "train", "nonfinite-nan", "nonfinite-+inf"]


def decay_boundaries(n: int, lanes: int, burst: int | None = None, block: int | None = None) -> list[int]:
    """The n_decay values that matter for a layer of n elements streamed in beats of ``lanes``
    (bursts of ``burst`` beats, reducer blocks of ``block`` beats): 0, n, inside the first and
    the last beat, on a beat edge, on a burst and a block edge, and above n (n + 1 and the
    largest uint32: the kernel must treat them as n). Sorted, no repeats."""
    cand = {0, n, n + 1, 0xFFFF_FFFF, min(1, n), lanes // 2 + 1, n - 1, lanes, n - n % lanes}
    for beats in (burst, block):
        if beats:
            cand |= {beats * lanes, beats * lanes + 1, beats * lanes - 1}
    return sorted(x for x in cand if 0 <= x <= n or x in (n + 1, 0xFFFF_FFFF))


def make_case(kind: str, rng, n: int, K: int, gdtype: str) -> Case:
    """One case of class ``kind`` with n elements and K contributions of ``gdtype``
    (the adamw-only tie classes fix K = 1 and fp32 gradients)."""
    if kind not in BUILDERS:
        raise KeyError(f"unknown vector class {kind!r}; one of {', '.join(BUILDERS)}")
    c = BUILDERS[kind](rng, n, K, gdtype)
    assert c.n == n and all(np.asarray(b).shape == (n,) for b in c.grad_bits)
    for a in (c.p, c.m, c.v):
        assert a.dtype == np.float32
    return c


def reduce_applicable(kind: str, K: int, gdtype: str) -> bool:
    """Whether ``kind`` exists for (K, gdtype) (as in the NumPy-side suite)."""
    if kind == "nonfinite-inf-inf":
        return K >= 2
    if kind == "nonfinite-sum-overflow":
        return K >= 2 and gdtype != "fp16"
    if kind == "ties-reduction":
        return K >= 2
    return True
