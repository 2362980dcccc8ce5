"""The EPS contract's vector classes for Lion, as cases for the RTL testbenches.

A :class:`LionCase` is one Lion layer update's inputs: the state ``p, m``
(binary32), K gradient contributions as bit patterns of the gradient dtype and
the Lion step scalars (:class:`~l2l.eps.contract.LionScalars`). Its golden
results come from the golden model only: :meth:`LionCase.reduced` (g and the
finite flag, ``numerics.reduce_gradients``) and :meth:`LionCase.updated`
(p', m' and the device copy, ``numerics.lion_update``).

:func:`make_case` builds the classes of docs/eps-numerics.md "What the tests
must cover" that apply to Lion, from sim/eps_vectors.py's where they carry
over (the same value generators; v is dropped and the scalars become Lion's):

- ``wide``: p, m, g over every binade, zeros of both signs, subnormals;
  scalars ``LionScalars.compute`` of a random hyper-parameter set and step;
- ``specials-<set>``: rows of the special-value grid under each of
  :data:`SPECIAL_LION` (a subnormal and a zero ``neg_lr`` among them);
- ``ties-products``: every product (p*decay, b1*m, omb1*g, b2*m, omb2*g)
  exactly halfway; ``ties-sums``: c and m' exactly halfway, and
  ``p1 +- neg_lr`` exactly halfway on every element; ``ties-copy``: p exactly
  halfway for the bf16 and fp16 copy (c is zero there, so p' = p);
  ``ties-reduction``: the reduction's sums halfway (K >= 2);
- ``czero``: c a zero of either sign -- m and g zeros of both signs, products
  that underflow to zero, and ``b1*m == -(omb1*g)`` exactly -- beside
  ordinary elements;
- ``train``: a training run's values; ``nonfinite-<how>``: a reduced g that
  is inf or NaN somewhere (the kernel must write nothing).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

import eps_vectors as ev
from l2l.eps import LionScalars, OptimizerHyper, StepScalars
from l2l.eps import numerics
from l2l.eps.numerics import COPY_DTYPES


def lion_scalars(**kw) -> LionScalars:
    """Lion scalars from keyword values (binary32), the rest at plain defaults."""
    base = dict(decay=1.0, b1=0.9, omb1=0.1, b2=0.99, omb2=0.01, neg_lr=-1e-3, inv_scale=1.0)
    base.update(kw)
    return LionScalars(**{k: np.float32(v) for k, v in base.items()})


def from_adamw(s: StepScalars) -> LionScalars:
    """An AdamW class's scalars as Lion's: the shared five and inv_scale as they are, AdamW's
    neg_step as neg_lr (a binary32 step of the same size)."""
    return LionScalars(decay=s.decay, b1=s.b1, omb1=s.omb1, b2=s.b2, omb2=s.omb2, neg_lr=s.neg_step,
                       inv_scale=s.inv_scale)


SPECIAL_LION = {
    "default": LionScalars.compute(OptimizerHyper(optimizer="lion"), 1),
    "big-lr": LionScalars.compute(OptimizerHyper(lr=0.1, beta1=0.5, beta2=0.9, weight_decay=0.1,
                                                 optimizer="lion"), 7, 1024.0, 2.0),
    "no-decay": LionScalars.compute(OptimizerHyper(weight_decay=0.0, optimizer="lion"), 3),
    "subnormal-lr": lion_scalars(neg_lr=-2.0 ** -149, decay=1.0 - 2.0 ** -24, b1=2.0 ** -130, omb1=2.0 ** -140),
    "zero-lr": lion_scalars(neg_lr=-0.0, decay=0.5, b1=1.0, omb1=2.0 ** -100),
}


@dataclass
class LionCase:
    """One Lion layer update: state, K contributions (bit patterns of ``gdtype``) and scalars."""

    name: str
    p: np.ndarray
    m: np.ndarray
    grad_bits: list
    gdtype: str
    s: LionScalars
    meta: dict = field(default_factory=dict)
    n_decay: int | None = None      # None: every element decayed; above n: as n (the RTL clamps)

    @property
    def n(self) -> int:
        return int(self.p.shape[0])

    @property
    def K(self) -> int:
        return len(self.grad_bits)

    @property
    def decayed(self) -> int:
        """How many elements are weight-decayed: n_decay within [0, n] (the golden model's range)."""
        return self.n if self.n_decay is None else min(int(self.n_decay), self.n)

    @property
    def n_decay_arg(self) -> int:
        """The value for the kernel's n_decay register (uint32): n when the case has none."""
        return self.n if self.n_decay is None else int(self.n_decay)

    def grads(self) -> list:
        return [ev.grad_array(b, self.gdtype) for b in self.grad_bits]

    def grad_words(self, k: int) -> np.ndarray:
        return np.asarray(self.grad_bits[k], np.uint64).astype(ev.UINT_OF[ev.DTYPE_BITS[self.gdtype]])

    def reduced(self):
        """Golden g (binary32) and the finite flag."""
        g = np.empty(self.n, np.float32)
        finite = numerics.reduce_gradients(self.grads(), self.s.inv_scale, g)
        return g, finite

    def updated(self, cdtype: str, g: np.ndarray | None = None):
        """Golden (p', m', copy) from this state and ``g`` (default: the golden reduced g),
        computed whatever the flag says (skipping is the kernel's job)."""
        if g is None:
            g = self.reduced()[0]
        p, m = self.p.copy(), self.m.copy()
        c = np.empty(self.n, COPY_DTYPES[cdtype])
        numerics.lion_update(p, m, g.copy(), self.s, c, n_decay=self.decayed)
        return p, m, c


def _of(c: ev.Case, s: LionScalars | None = None, name: str | None = None) -> LionCase:
    return LionCase(name or c.name, c.p, c.m, c.grad_bits, c.gdtype, s or from_adamw(c.s), dict(c.meta), c.n_decay)


# --------------------------------------------------------------------------
# builders: (rng, n, K, gdtype) -> LionCase
# --------------------------------------------------------------------------


def wide(rng, n, K, gdtype):
    c = ev.wide(rng, n, K, gdtype)
    h = ev.HYPERS[int(rng.integers(0, len(ev.HYPERS)))]
    s = LionScalars.compute(h, int(rng.integers(1, 50)), loss_scale=float(2 ** int(rng.integers(0, 17))),
                            divisor=float(K))
    return _of(c, s)


def _specials_builder(sname):
    def build(rng, n, K, gdtype):
        c = ev.BUILDERS["specials-default-t1"](rng, n, K, gdtype)
        return _of(c, SPECIAL_LION[sname], f"specials-{sname}")
    return build


def ties_products(rng, n, K, gdtype):
    """p*decay, b1*m, omb1*g, b2*m and omb2*g exactly halfway (odd significands times 1.5 or
    0.75): fp32 g, K = 1."""
    p, m, _, g, _ = ev.product_tie_inputs(rng, n)
    s = lion_scalars(decay=1.5, b1=1.5, omb1=1.5, b2=1.5, omb2=0.75, neg_lr=-1.5)
    return LionCase("ties-products", p, m, [g], "fp32", s)


def ties_sums(rng, n, K, gdtype):
    """Every sum exactly halfway: c = m + g and m' = m + g with g half an ulp of m (all four
    interpolation scalars 1), and p' = p +- 1 with p in [2**24, 2**25) (ulp 2) and odd: fp32 g,
    K = 1. c is never a zero here, so every element steps."""
    sign = np.where(rng.random(n) < 0.5, -1.0, 1.0)
    e = rng.integers(-40, 40, n)
    m = ev.odd_f32(rng, n, 0, 1) * np.ldexp(1.0, e)
    g = sign * np.ldexp(1.0, e - 24)
    p = ev.odd_f32(rng, n, 24, 25)
    s = lion_scalars(decay=1.0, b1=1.0, omb1=1.0, b2=1.0, omb2=1.0, neg_lr=-1.0)
    out = LionCase("ties-sums", p.astype(np.float32), m.astype(np.float32), [ev.round_bits(g, "fp32")[0]],
                   "fp32", s)
    assert (out.p.astype(np.float64) == p).all() and (out.m.astype(np.float64) == m).all()
    return out


def ties_copy(rng, n, K, gdtype):
    """p exactly halfway for the bf16 / fp16 copy, g = m = 0 (c = +0, so p' = p * 1.0 = p)."""
    c = ev.ties_copy(rng, n, K, gdtype)
    return _of(c, lion_scalars(decay=1.0))


def ties_reduction(rng, n, K, gdtype):
    return _of(ev.ties_reduction(rng, n, K, gdtype))


def czero(rng, n, K, gdtype):
    """c = b1*m + omb1*g a zero of either sign where p' must be p1 exactly, its sign of zero
    included: m and g zeros of both signs; m = +-0 beside the dtype's smallest g (fp32:
    omb1 * 2**-149 underflows to a signed zero; bf16: c is a tiny subnormal, which must step;
    fp16: g = +-0); (fp32 g) b1*m == -(omb1*g) exactly, whose sum is +0; the rest ordinary.
    p is wide, zeros of both signs included. K contributions: the first holds the pattern,
    the others are zeros of both signs (the sum keeps it), inv_scale = 1."""
    s = LionScalars.compute(OptimizerHyper(lr=3e-4, beta1=0.9, beta2=0.99, weight_decay=0.3, optimizer="lion"), 1)
    p = ev.wide_f32(rng, n, max_abs=1e30)
    m = ev.wide_f32(rng, n, max_abs=1e30)
    gw = ev.wide_f32(rng, n, max_abs=1e30).astype(np.float64)
    kind = rng.integers(0, 4 if gdtype == "fp32" else 3, n)
    sgn = lambda: np.where(rng.random(n) < 0.5, -1.0, 1.0)  # noqa: E731
    zero_m = sgn() * 0.0
    # 0: m, g signed zeros; 1: m a signed zero, g the smallest subnormal of the dtype (omb1 * g -> +-0)
    tiny = {"fp32": 2.0 ** -149, "bf16": 2.0 ** -133, "fp16": 2.0 ** -24}[gdtype]
    k = rng.integers(1, 1 << 10, n) * 2.0 ** -20
    m = np.select([kind == 0, kind == 1, kind == 3], [zero_m, zero_m, k], m.astype(np.float64))
    g = np.select([kind == 0, kind == 1, kind == 3],
                  [sgn() * 0.0, sgn() * (tiny if gdtype != "fp16" else 0.0), -(float(s.b1) * k / float(s.omb1))], gw)
    m = m.astype(np.float32)
    fmt = "fp16" if gdtype == "fp16" else "fp32"
    if gdtype == "fp16":
        g = np.where(kind == 2, np.clip(g, -6e4, 6e4), g)
    bits = ev.round_bits(g, fmt)[0]
    if gdtype == "bf16":
        bits = bits >> np.uint64(16)
    zeros = [(rng.integers(0, 2, n, dtype=np.uint64) << np.uint64(31 if gdtype == "fp32" else 15))
             for _ in range(K - 1)]
    s = LionScalars(**{**dict(zip(s.names(), s.as_tuple())), "inv_scale": np.float32(1.0)})
    return LionCase("czero", p, m, [bits, *zeros], gdtype, s)


def train(rng, n, K, gdtype):
    """Values like a training run's: small weights, gradients over 1e-10 .. 1e3 (1e-6 .. for fp16),
    Lion's scalars of a realistic run (fp16: loss scale 1024)."""
    c = ev.train(rng, n, K, gdtype)
    h = OptimizerHyper(lr=1e-4, beta1=0.9, beta2=0.99, weight_decay=0.1, optimizer="lion")
    s = LionScalars.compute(h, int(rng.integers(1, 20)), loss_scale=1024.0 if gdtype == "fp16" else 1.0,
                            divisor=float(K))
    return _of(c, s)


def _nonfinite_builder(how):
    def build(rng, n, K, gdtype):
        return _of(ev.BUILDERS[f"nonfinite-{how}"](rng, n, K, gdtype))
    return build


BUILDERS: dict[str, Callable] = {
    "wide": wide,
    **{f"specials-{k}": _specials_builder(k) for k in SPECIAL_LION},
    "ties-products": ties_products,
    "ties-sums": ties_sums,
    "ties-copy": ties_copy,
    "ties-reduction": ties_reduction,
    "czero": czero,
    "train": train,
    **{f"nonfinite-{h}": _nonfinite_builder(h) for h in ev.NONFINITE},
}

# the datapath's classes (the reduced g is the golden model's): every class but the reduction's
LION_KINDS = ["wide", *(f"specials-{k}" for k in SPECIAL_LION), "ties-products", "ties-sums", "ties-copy",
              "czero", "train", "nonfinite-nan", "nonfinite-+inf"]
# the kernel's classes at any gradient dtype and K (the reducer in front)
KERNEL_KINDS = ["wide", "specials-default", "specials-subnormal-lr", "specials-zero-lr", "czero", "train",
                "ties-reduction", *(f"nonfinite-{h}" for h in ev.NONFINITE)]


def applicable(kind: str, K: int, gdtype: str) -> bool:
    """Whether ``kind`` exists for (K, gdtype)."""
    if kind in ("ties-products", "ties-sums", "ties-copy"):
        return K == 1 and gdtype == "fp32"
    return ev.reduce_applicable(kind, K, gdtype)


def make_case(kind: str, rng, n: int, K: int, gdtype: str) -> LionCase:
    """One Lion case of class ``kind`` with n elements and K contributions of ``gdtype`` (the
    product / sum / copy tie classes fix K = 1 and fp32 gradients)."""
    if kind not in BUILDERS:
        raise KeyError(f"unknown Lion vector class {kind!r}; one of {', '.join(BUILDERS)}")
    c = BUILDERS[kind](rng, n, K, gdtype)
    assert c.n == n and all(np.asarray(b).shape == (n,) for b in c.grad_bits)
    assert c.p.dtype == np.float32 and c.m.dtype == np.float32 and isinstance(c.s, LionScalars)
    return c
