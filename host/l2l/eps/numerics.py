"""The golden model: the EPS contract written plainly in NumPy binary32.

Every line is one binary32 operation rounded to nearest-even, in the
contract's order; NumPy never fuses ``a * b + c`` and keeps subnormals. Work
is done in cache-sized chunks with preallocated scratch so that the golden
model is also a usable CPU EPS. Other backends are tested bit for bit
against these functions.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import ml_dtypes
import numpy as np

from .contract import LambScalars, LambStep, LionScalars, StepScalars
from .shards import BLOCK

# Elements per pass. Each chunk's several passes (7 live fp32 arrays, 1.8 MiB) stay in the last
# level cache. Measured on a 2-core EPYC host (16.8M elements, one update): 64K elements beat
# 32K by 10% on one thread and by 15-30% on two, where each ufunc call (one GIL release and
# reacquire) must carry enough work; 128K gave nothing more.
CHUNK = 1 << 16

COPY_DTYPES = {
    "fp32": np.dtype(np.float32),
    "bf16": np.dtype(ml_dtypes.bfloat16),
    "fp16": np.dtype(np.float16),
}
GRAD_DTYPES = COPY_DTYPES


def reduce_gradients(grads: Sequence[np.ndarray], inv_scale: np.float32, out: np.ndarray) -> bool:
    """``out = (g_0 + g_1 + ... + g_{K-1}) * inv_scale``, left fold; True when all finite.

    ``grads`` is a sequence of K arrays of n elements, or one (K, n) array.
    """
    if len(grads) == 0:
        raise ValueError("at least one gradient contribution")
    with np.errstate(all="ignore"):  # inf/NaN are data here: the flag reports them
        return _reduce(grads, inv_scale, out)


def _reduce(grads: Sequence[np.ndarray], inv_scale: np.float32, out: np.ndarray) -> bool:
    n = out.shape[0]
    for g in grads:
        if g.shape != (n,):
            raise ValueError(f"gradient of shape {g.shape}, expected ({n},)")
    finite = True
    for lo in range(0, n, CHUNK):
        hi = min(lo + CHUNK, n)
        acc = out[lo:hi]
        acc[...] = grads[0][lo:hi]  # widening to binary32 is exact
        for g in grads[1:]:
            np.add(acc, g[lo:hi], out=acc, dtype=np.float32, casting="unsafe")
        np.multiply(acc, inv_scale, out=acc)
        finite = finite and bool(np.isfinite(acc).all())  # while the chunk is in cache
    return finite


def unreduced(grads: Sequence[np.ndarray], inv_scale: np.float32, n: int) -> np.ndarray | None:
    """The reduced gradient of ``n`` elements with no buffer, where the reduction is the
    identity: one contribution and a scale of 1 (``g * 1`` is ``g``, bit for bit, and
    widening bfloat16 or binary16 to binary32 is exact, so :func:`adamw_update` widens it a
    chunk at a time); else None (and :func:`reduce_gradients` does the work, and the checks)."""
    if len(grads) != 1 or inv_scale != np.float32(1.0):
        return None
    g = grads[0]
    return g if g.dtype in GRAD_DTYPES.values() and g.shape == (n,) and g.flags.c_contiguous else None


# a 16-bit float is inf or NaN when its exponent bits are all ones
_EXPONENT_BITS = {COPY_DTYPES["bf16"]: np.uint16(0x7F80), COPY_DTYPES["fp16"]: np.uint16(0x7C00)}


def all_finite(a: np.ndarray) -> bool:
    """Whether every element is finite, a chunk at a time (no array of flags the size of ``a``);
    16-bit floats by their exponent bits (ml_dtypes' own ``isfinite`` is several times slower)."""
    mask = _EXPONENT_BITS.get(a.dtype)
    if mask is not None:
        bits = a.view(np.uint16)
        return not any(bool(np.any(np.bitwise_and(bits[lo:lo + CHUNK], mask) == mask))
                       for lo in range(0, a.shape[0], CHUNK))
    return all(bool(np.isfinite(a[lo:lo + CHUNK]).all()) for lo in range(0, a.shape[0], CHUNK))


class _Scratch:
    """Per-thread scratch for one chunk, so an update allocates nothing per call."""

    def __init__(self) -> None:
        self.a = np.empty(CHUNK, np.float32)
        self.b = np.empty(CHUNK, np.float32)
        self.g = np.empty(CHUNK, np.float32)  # a narrow gradient's chunk, widened


def adamw_update(p: np.ndarray, m: np.ndarray, v: np.ndarray, g: np.ndarray,
                 s: StepScalars, copy_out: np.ndarray | None = None,
                 scratch: _Scratch | None = None, n_decay: int | None = None) -> None:
    """AdamW in place on ``p, m, v`` from the reduced gradient ``g``; then the device copy.

    Weight decay applies to elements ``[0, n_decay)`` only (default: all): the entry's layout
    puts its decayed parameters first (the parameter groups). The device copy (fp32, bf16 or
    fp16, per ``copy_out.dtype``) is written chunk by chunk while ``p'`` is still in cache:
    one pass over memory.
    """
    n = p.shape[0]
    n_decay = decay_boundary(n, n_decay)
    with np.errstate(all="ignore"):  # overflow to inf is a defined result, not an error
        _adamw(p, m, v, g, s, copy_out, scratch or _Scratch(), n_decay)


def decay_boundary(n: int, n_decay: int | None) -> int:
    """An update's decay boundary over ``n`` elements: ``n_decay`` (default all), in ``[0, n]``."""
    n_decay = n if n_decay is None else n_decay
    if not 0 <= n_decay <= n:
        raise ValueError(f"n_decay {n_decay} outside [0, {n}]")
    return n_decay


def decayed_part(lo: int, hi: int, n_decay: int) -> int:
    """How many of elements ``[lo, hi)`` of an entry lie below its decay boundary: the
    ``n_decay`` of that range seen as an entry of its own (a thread's range, a shard)."""
    return min(max(n_decay - lo, 0), hi - lo)


def _adamw(p, m, v, g, s: StepScalars, copy_out, scratch: _Scratch, n_decay: int) -> None:
    n = p.shape[0]
    s = _ZeroDim(s)
    for lo in range(0, n, CHUNK):
        hi = min(lo + CHUNK, n)
        k = hi - lo
        pc, mc, vc, gc = p[lo:hi], m[lo:hi], v[lo:hi], g[lo:hi]
        a, b = scratch.a[:k], scratch.b[:k]
        if gc.dtype != np.float32:  # a narrow contribution (unreduced): widened, exactly
            scratch.g[:k] = gc
            gc = scratch.g[:k]
        d = decayed_part(lo, hi, n_decay)
        np.multiply(pc[:d], s.decay, out=pc[:d])  # p1 = p * decay; past n_decay p1 = p
        np.multiply(s.b1, mc, out=mc)             # b1 * m
        np.multiply(s.omb1, gc, out=a)            # omb1 * g
        np.add(mc, a, out=mc)                     # m' = (b1*m) + (omb1*g)
        np.multiply(gc, gc, out=a)                # g * g
        np.multiply(s.omb2, a, out=a)             # omb2 * (g*g)
        np.multiply(s.b2, vc, out=vc)             # b2 * v
        np.add(vc, a, out=vc)                     # v' = (b2*v) + (omb2*(g*g))
        np.sqrt(vc, out=b)                        # sqrt(v')
        np.multiply(b, s.inv_bc2_sqrt, out=b)     # sqrt(v') * inv_bc2_sqrt
        np.add(b, s.eps, out=b)                   # d = (...) + eps
        np.divide(mc, b, out=a)                   # m' / d
        np.multiply(s.neg_step, a, out=a)         # neg_step * (m'/d)
        np.add(pc, a, out=pc)                     # p' = p1 + (...)
        if copy_out is not None:
            device_copy(pc, copy_out[lo:hi])


def lion_update(p: np.ndarray, m: np.ndarray, g: np.ndarray, s: LionScalars,
                copy_out: np.ndarray | None = None, scratch: _Scratch | None = None,
                n_decay: int | None = None) -> None:
    """Lion in place on ``p, m`` from the reduced gradient ``g``; then the device copy.

    The step is the sign of ``c = b1*m + omb1*g``: ``p' = p1 + neg_lr`` where ``c > 0``,
    ``p1 - neg_lr`` where ``c < 0``, and ``p1`` itself where ``c`` is a zero of either sign
    (``torch.sign`` is 0 there). Computed as ``p1 + neg_lr * sign(c)``: NumPy's sign is +0 at
    either zero, so the step there is -0, and ``p1 + -0`` is ``p1``, its sign of zero included.
    Weight decay applies to ``[0, n_decay)`` as in :func:`adamw_update`.
    """
    n = p.shape[0]
    n_decay = decay_boundary(n, n_decay)
    with np.errstate(all="ignore"):
        _lion(p, m, g, s, copy_out, scratch or _Scratch(), n_decay)


def _lion(p, m, g, s: LionScalars, copy_out, scratch: _Scratch, n_decay: int) -> None:
    n = p.shape[0]
    s = _ZeroDim(s)
    for lo in range(0, n, CHUNK):
        hi = min(lo + CHUNK, n)
        k = hi - lo
        pc, mc, gc = p[lo:hi], m[lo:hi], g[lo:hi]
        a, b = scratch.a[:k], scratch.b[:k]
        if gc.dtype != np.float32:
            scratch.g[:k] = gc
            gc = scratch.g[:k]
        d = decayed_part(lo, hi, n_decay)
        np.multiply(pc[:d], s.decay, out=pc[:d])  # p1 = p * decay; past n_decay p1 = p
        np.multiply(s.b1, mc, out=a)              # b1 * m
        np.multiply(s.omb1, gc, out=b)            # omb1 * g
        np.add(a, b, out=a)                       # c = (b1*m) + (omb1*g)
        np.sign(a, out=b)                         # -1, +1, or +0 where c is a zero of either sign
        np.multiply(b, s.neg_lr, out=a)           # neg_lr, -neg_lr or -0, exactly (sign into another
        #                                           array: NumPy's in-place sign is 9x slower, unvectorized)
        np.add(pc, a, out=pc)                     # p' = p1 + (...): p1 itself where c is a zero
        np.multiply(s.b2, mc, out=mc)             # b2 * m
        np.multiply(s.omb2, gc, out=b)            # omb2 * g
        np.add(mc, b, out=mc)                     # m' = (b2*m) + (omb2*g)
        if copy_out is not None:
            device_copy(pc, copy_out[lo:hi])


# ---------------------------------------------------------------- LAMB

LANES = 16  # interleaved binary32 accumulators of a segment's sums of squares


@dataclass(frozen=True)
class Segments:
    """The pieces LAMB's norms are summed over: an entry's tensors cut at every
    :data:`~l2l.eps.shards.BLOCK` boundary, so a sharded EPS (slices of whole blocks) holds
    whole segments and the sums do not depend on the machine count.

    ``bounds``: segment ``s`` is elements ``[bounds[s], bounds[s+1])`` of those held (from 0);
    ``tensor``: the entry's tensor each lies in; ``tensor_starts``: each tensor's first
    element in the entry (the decayed ones are those below ``n_decay``)."""
    bounds: np.ndarray
    tensor: np.ndarray
    tensor_starts: np.ndarray

    @property
    def count(self) -> int:
        return self.tensor.shape[0]


def lamb_segments(tensor_starts: Sequence[int], n: int, lo: int = 0, hi: int | None = None) -> Segments:
    """The segments of elements ``[lo, hi)`` (whole blocks, or the whole entry) of an entry of
    ``n`` elements whose tensors start at ``tensor_starts`` (the layout's offsets, 0 first).
    An empty range has none (an entry with no elements; a machine's empty slice)."""
    hi = n if hi is None else hi
    starts = np.asarray(sorted(set(int(t) for t in tensor_starts)), np.int64)
    if starts.size == 0 or starts[0] != 0 or (n and starts[-1] >= n):
        raise ValueError(f"tensor starts {list(starts)} do not tile an entry of {n} elements")
    if hi == lo:
        return Segments(np.zeros(1, np.int64), np.zeros(0, np.int64), starts)
    cuts = np.union1d(starts, np.arange(0, n, BLOCK, dtype=np.int64))
    cuts = cuts[(cuts >= lo) & (cuts < hi)]
    if lo not in cuts:
        raise ValueError(f"elements [{lo}, {hi}) do not start a segment")
    bounds = np.append(cuts, hi) - lo
    tensor = np.searchsorted(starts, cuts, side="right") - 1
    return Segments(bounds, tensor, starts)


def _lamb_update_term(p, m, v, s, d: int, a, b):
    """``u2`` of LAMB into ``a`` (``b`` scratch), from ``p`` and the new moments; the first
    ``d`` elements decayed. The same operations in both passes: the second recomputes it."""
    np.sqrt(v, out=b)                       # sqrt(v')
    np.multiply(b, s.inv_bc2_sqrt, out=b)   # sqrt(v') * inv_bc2_sqrt
    np.add(b, s.eps, out=b)                 # d = (...) + eps
    np.divide(m, b, out=a)                  # q = m' / d
    np.multiply(a, s.inv_bc1, out=a)        # u = q * inv_bc1
    np.multiply(s.wd, p[:d], out=b[:d])     # wd * p (decayed elements)
    np.add(a[:d], b[:d], out=a[:d])         # u2 = u + wd*p; past n_decay u2 = u
    return a


def _lane_sums(x: np.ndarray, out: np.ndarray) -> None:
    """``out[j]`` = binary32 sum of ``x[j], x[j + LANES], ...`` in index order, from +0."""
    full = x.shape[0] // LANES * LANES
    out[...] = 0.0
    if full:
        np.add.reduce(x[:full].reshape(-1, LANES), axis=0, dtype=np.float32, out=out)  # row by row
    tail = x.shape[0] - full
    np.add(out[:tail], x[full:], out=out[:tail])


def lamb_norms(p, m, v, g, s: LambScalars, segments: Segments, *, n_decay: int | None = None,
               first: int = 0, last: int | None = None, out: np.ndarray | None = None,
               scratch: _Scratch | None = None) -> np.ndarray:
    """LAMB's first pass over segments ``[first, last)``: ``m'`` and ``v'`` in place, and per
    segment the :data:`LANES` binary32 sums of ``p*p`` and of ``u2*u2`` ((nseg, 2, LANES) in
    ``out``). ``p`` is not changed."""
    n = p.shape[0]
    n_decay = decay_boundary(n, n_decay)
    last = segments.count if last is None else last
    out = np.zeros((segments.count, 2, LANES), np.float32) if out is None else out
    scratch = scratch or _Scratch()
    z = _ZeroDim(s)
    with np.errstate(all="ignore"):
        for k in range(first, last):
            lo, hi = int(segments.bounds[k]), int(segments.bounds[k + 1])
            c = hi - lo
            pc, mc, vc, gc = p[lo:hi], m[lo:hi], v[lo:hi], g[lo:hi]
            a, b = scratch.a[:c], scratch.b[:c]
            if gc.dtype != np.float32:
                scratch.g[:c] = gc
                gc = scratch.g[:c]
            np.multiply(z.b1, mc, out=mc)        # b1 * m
            np.multiply(z.omb1, gc, out=a)       # omb1 * g
            np.add(mc, a, out=mc)                # m' = (b1*m) + (omb1*g)
            np.multiply(gc, gc, out=a)           # g * g
            np.multiply(z.omb2, a, out=a)        # omb2 * (g*g)
            np.multiply(z.b2, vc, out=vc)        # b2 * v
            np.add(vc, a, out=vc)                # v' = (b2*v) + (omb2*(g*g))
            np.multiply(pc, pc, out=a)           # p * p
            _lane_sums(a, out[k, 0])
            u2 = _lamb_update_term(pc, mc, vc, z, decayed_part(lo, hi, n_decay), a, b)
            np.multiply(u2, u2, out=a)           # u2 * u2
            _lane_sums(a, out[k, 1])
    return out


def lamb_steps(sums: np.ndarray, segments: Segments, s: LambScalars, n_decay: int) -> np.ndarray:
    """The host's fold: each tensor's sums of squares in binary64 (its segments in order, each
    segment's lanes in order), its trust ratio ``|p| / |u2|`` (1 where either is 0, or where
    the tensor is not adapted: not decayed, or no weight decay) and the binary32 step size
    ``-lr * trust`` of each segment, rounded once."""
    wide = sums.astype(np.float64)
    ntensors = segments.tensor_starts.shape[0]
    totals = np.zeros((ntensors, 2))
    for t in np.unique(segments.tensor):
        rows = wide[segments.tensor == t]  # segment order
        for j in range(2):
            totals[t, j] = np.cumsum(rows[:, j, :].reshape(-1))[-1]  # a sequential sum, in that order
    w, u = np.sqrt(totals[:, 0]), np.sqrt(totals[:, 1])
    with np.errstate(all="ignore"):
        trust = np.where((w > 0) & (u > 0), w / u, 1.0)
    adapted = (segments.tensor_starts < n_decay) & s.adapt
    trust = np.where(adapted, trust, 1.0)
    return (-s.lr * trust[segments.tensor]).astype(np.float32)


def lamb_apply(p, m, v, s: LambScalars, segments: Segments, steps: np.ndarray, *,
               copy_out: np.ndarray | None = None, n_decay: int | None = None, first: int = 0,
               last: int | None = None, scratch: _Scratch | None = None) -> None:
    """LAMB's second pass over segments ``[first, last)``: ``u2`` again from ``p, m', v'``,
    ``p' = p + steps[s] * u2``, and the device copy."""
    n = p.shape[0]
    n_decay = decay_boundary(n, n_decay)
    last = segments.count if last is None else last
    scratch = scratch or _Scratch()
    z = _ZeroDim(s)
    with np.errstate(all="ignore"):
        for k in range(first, last):
            lo, hi = int(segments.bounds[k]), int(segments.bounds[k + 1])
            c = hi - lo
            pc = p[lo:hi]
            a, b = scratch.a[:c], scratch.b[:c]
            u2 = _lamb_update_term(pc, m[lo:hi], v[lo:hi], z, decayed_part(lo, hi, n_decay), a, b)
            np.multiply(steps[k], u2, out=a)     # step * u2
            np.add(pc, a, out=pc)                # p' = p + (...)
            if copy_out is not None:
                device_copy(pc, copy_out[lo:hi])


def as_step(scalars, n: int, n_decay: int | None = None, tensor_starts: Sequence[int] = (0,)):
    """What a backend's ``step`` takes for these scalars on an entry of ``n`` elements: the
    scalars themselves, or for LAMB a :class:`~l2l.eps.contract.LambStep` over the entry's
    tensors (default one) with the golden model's fold between the passes."""
    if not isinstance(scalars, LambScalars):
        return scalars
    segments = lamb_segments(tensor_starts, n)
    n_decay = n if n_decay is None else n_decay
    return LambStep(scalars, segments, lambda sums: lamb_steps(sums, segments, scalars, n_decay))


def update_rule(scalars):
    """The golden model's update for these step scalars' optimizer, called as
    ``rule(p, *moments, g, scalars, copy_out=, scratch=, n_decay=)``."""
    if isinstance(scalars, StepScalars):
        return adamw_update
    if isinstance(scalars, LionScalars):
        return lion_update
    raise TypeError(f"not step scalars: {type(scalars).__name__}")


class _ZeroDim:
    """The scalars as 0-d binary32 arrays: the same operands to a ufunc, taken in about half
    the time of a NumPy scalar (less time holding the GIL, which threads contend for)."""

    def __init__(self, s: StepScalars) -> None:
        for name, value in zip(s.names(), s.as_tuple()):
            setattr(self, name, np.asarray(value, dtype=np.float32))


def device_copy(p: np.ndarray, out: np.ndarray) -> None:
    """Round ``p`` into ``out``'s dtype (identity, bfloat16 or binary16), nearest-even."""
    if out.dtype in (COPY_DTYPES["fp32"], COPY_DTYPES["bf16"], COPY_DTYPES["fp16"]):
        np.copyto(out, p, casting="unsafe")  # ml_dtypes and NumPy both round to nearest-even
    else:
        raise ValueError(f"unsupported device-copy dtype {out.dtype}")


def make_scratch() -> _Scratch:
    return _Scratch()
