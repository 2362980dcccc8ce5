"""``l2l plan --fit``: the largest model of a shape that fits this machine's memory.

Given every shape option but one -- the depth (``layers``) or the width
(``d-model``) -- :func:`fit` finds the largest value whose predicted memory
(:func:`~l2l.planner.model.predict`) fits the limits: ``host_total_bytes``
against the host's and, on a CUDA device, ``device_total_bytes`` against the
device's. On the CPU device there is no device limit: its memory is host
memory, and the host figure counts it.

Memory does not depend on the machine's rates, so nothing is measured: the
prediction runs on fixed rates (:func:`fit_rates`), zero-copy on the CPU and a
finite link on CUDA, where the next layer's weights arrive while one computes
(the prefetch's memory).

``predict`` replays the schedule layer by layer, in time linear in the depth
(about a second at 10,000 blocks) that a search pays tens of times, and a
Hugging Face family is built on the meta device for every prediction. Yet every figure is affine
in the depth once the blocks outnumber the largest layer's terms: each block
adds its parameters' EPS state and its stashed boundaries, and nothing else
changes. So a deep model is predicted at 8 and 9 blocks and extrapolated,
after a third prediction at 16 blocks checks that the line holds there
(exactly, in bytes); where it does not, the deep model is predicted itself.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

from ..config import TrainConfig
from ..errors import UserError
from .model import Rates, predict
from .shapes import dtype_bytes_of

SEARCHES = ("layers", "d-model")
MAX_LAYERS = 1_000_000
MAX_D_MODEL = 1 << 20
DIRECT_LAYERS = 16       # up to this depth, predict() itself; deeper, the line through:
LINE_AT = (8, 9)         # two depths that fix the line (every term affine from 2 blocks on)
LINE_CHECK = 16          # and a third, that must lie on it
CUDA_LINK_BYTES_PER_S = 25e9  # any finite link: on CUDA the prefetched next layer is resident


def fit_rates(on_cuda: bool) -> Rates:
    """Fixed rates for a memory-only prediction: zero-copy on the CPU, a finite link on CUDA."""
    return Rates(flops_per_s=1e12, link_bytes_per_s=CUDA_LINK_BYTES_PER_S if on_cuda else None,
                 device="cuda" if on_cuda else "cpu")


@dataclass(frozen=True)
class Limits:
    """Memory to fit in, bytes. ``device_bytes`` is a CUDA device's; None on the CPU
    device, whose memory is host memory (counted in the host figure). ``disk_bytes``:
    with ``--eps-offload``, the free space for the state files (None: no disk tier)."""

    host_bytes: int
    device_bytes: int | None = None
    disk_bytes: int | None = None

    @property
    def on_cuda(self) -> bool:
        return self.device_bytes is not None


@dataclass(frozen=True)
class Size:
    """One model shape and its predicted memory."""

    layers: int
    d_model: int
    heads: int
    params: int
    host_bytes: int
    device_bytes: int
    disk_bytes: int = 0  # with --eps-offload: the state files

    def over(self, limits: Limits) -> dict[str, float]:
        """Each limit this size exceeds, with its need as a share of the limit."""
        out = {}
        if self.host_bytes > limits.host_bytes:
            out["host"] = self.host_bytes / limits.host_bytes
        if limits.on_cuda and self.device_bytes > limits.device_bytes:
            out["device"] = self.device_bytes / limits.device_bytes
        if limits.disk_bytes is not None and self.disk_bytes > limits.disk_bytes:
            out["disk"] = self.disk_bytes / max(limits.disk_bytes, 1)
        return out

    def fits(self, limits: Limits) -> bool:
        return not self.over(limits)


@dataclass(frozen=True)
class Fit:
    """The largest fitting size, the next size up (None at the search's cap) and the limit that
    binds: the one the next size exceeds (the further, if both), or "cap"."""

    search: str
    found: Size
    next: Size | None
    limits: Limits
    binding: str


def _exact(cfg: TrainConfig, rates: Rates, db: int) -> tuple[int, ...]:
    """(params, host bytes, device bytes), and with ``--eps-offload`` the state files' bytes,
    the host figure then the tier's (state on disk, a window in memory)."""
    p = predict(cfg, rates, dtype_bytes=db)
    if cfg.eps_offload is None:
        return p.params, p.host_total_bytes, p.device_total_bytes
    from .disk import entry_numels, host_bytes_with_tier, tier_file_bytes
    numels = entry_numels(cfg)
    return (p.params, host_bytes_with_tier(p, numels, cfg.eps_offload_window, cfg.eps_offload_copies),
            p.device_total_bytes, tier_file_bytes(cfg, numels))


def depth_model(cfg: TrainConfig, rates: Rates, db: int) -> Callable[[int], tuple[int, ...]]:
    """(params, host bytes, device bytes[, disk bytes]: :func:`_exact`) of ``cfg`` at any depth: predicted up to
    ``DIRECT_LAYERS`` blocks, extrapolated beyond on the checked line (module docstring)."""
    line: list = []
    predicted: dict[int, tuple[int, int, int]] = {}

    def exact(layers: int) -> tuple[int, int, int]:
        if layers not in predicted:
            predicted[layers] = _exact(replace(cfg, layers=layers), rates, db)
        return predicted[layers]

    def at(layers: int) -> tuple[int, int, int]:
        if layers <= DIRECT_LAYERS:
            return exact(layers)
        if not line:
            a, b, c = (exact(n) for n in (*LINE_AT, LINE_CHECK))
            slope = [y - x for x, y in zip(a, b)]
            on_line = all(math.isclose(a_i + (LINE_CHECK - LINE_AT[0]) * s, c_i, rel_tol=1e-12, abs_tol=1)
                          for a_i, s, c_i in zip(a, slope, c))
            line.append((a, slope) if on_line else None)
        if line[0] is None:  # not affine in depth: the slow way
            return exact(layers)
        a, slope = line[0]
        return tuple(int(round(a_i + (layers - LINE_AT[0]) * s)) for a_i, s in zip(a, slope))

    return at


def _largest(fits: Callable[[int], bool], cap: int) -> int | None:
    """The largest n in [1, cap] with ``fits(n)``, for ``fits`` true up to some n and false
    beyond (memory grows with the size): doubling, then halving the gap. None if not even 1."""
    if not fits(1):
        return None
    lo, hi = 1, 2
    while hi <= cap and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, cap + 1)  # fits(lo), not fits(hi) (or hi past the cap)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def fit(cfg: TrainConfig, limits: Limits, search: str = "layers", *, dtype_bytes: int | None = None) -> Fit:
    """The largest ``cfg.layers`` (``search="layers"``) or ``cfg.d_model`` (``"d-model"``, a
    multiple of ``cfg.heads``) whose predicted memory fits ``limits``; the other shape
    options as ``cfg`` has them. UserError when not even the smallest fits."""
    if search not in SEARCHES:
        raise UserError(f"--fit {search!r}: choose {' or '.join(SEARCHES)}")
    if not limits.host_bytes > 0 or (limits.on_cuda and not limits.device_bytes > 0) or \
            (limits.disk_bytes is not None and limits.disk_bytes < 0):
        raise UserError("memory limits must be positive")
    rates = fit_rates(limits.on_cuda)
    db = dtype_bytes_of(cfg, dtype_bytes)
    if search == "layers":
        at = depth_model(cfg, rates, db)

        def size(n: int) -> Size:
            return Size(n, cfg.d_model, cfg.heads, *at(n))
        cap = MAX_LAYERS
    else:
        def size(n: int) -> Size:
            d = n * cfg.heads
            return Size(cfg.layers, d, cfg.heads, *depth_model(replace(cfg, d_model=d), rates, db)(cfg.layers))
        cap = MAX_D_MODEL // cfg.heads

    sizes: dict[int, Size] = {}

    def fits(n: int) -> bool:
        if n not in sizes:
            sizes[n] = size(n)
        return sizes[n].fits(limits)

    n = _largest(fits, cap)
    if n is None:
        raise UserError(_too_small(cfg.model, sizes[1], limits))
    nxt = size(n + 1) if n < cap else None
    if nxt is None:
        binding = "cap"
    else:
        over = nxt.over(limits)
        binding = max(over, key=over.get)
    return Fit(search, sizes[n], nxt, limits, binding)


def _too_small(model: str, s: Size, limits: Limits) -> str:
    from .report import mib
    needs = [f"{where} {mib(need)} of {mib(limit)}" for where, need, limit in
             (("host", s.host_bytes, limits.host_bytes), ("device", s.device_bytes, limits.device_bytes),
              ("disk", s.disk_bytes, limits.disk_bytes))
             if where in s.over(limits)]
    return (f"not even the smallest model fits: {describe(model, s)} needs " + " and ".join(needs))


def describe(model: str, s: Size) -> str:
    """``gpt 58 layers x d1024, 16 heads: 1.23B parameters``"""
    return (f"{model} {s.layers} layer{'s' if s.layers != 1 else ''} x d{s.d_model}, {s.heads} head"
            f"{'s' if s.heads != 1 else ''}: {count(s.params)} parameters")


def count(n: int) -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}" if n < 100 * scale else f"{n / scale:.0f}{suffix}"
    return str(n)
