"""The OpenCL EPS's Lion update against its AdamW update and the memory roofline, in one run.

    .venv/bin/python bench/lion_opencl_speed.py                 # 16.8M elements, 20 timed steps each
    .venv/bin/python bench/lion_opencl_speed.py --numel 1000000 --repeats 4   # a quick look

One ``OpenCLBackend.step`` per timed run on one layer (fp32 gradients, K = 1): eps_check
then eps_update (AdamW) or eps_lion (Lion), with a separate fp32 or bf16 device copy, or with
the master serving as the fp32 copy (a CPU device's zero-copy path). Timing, rounds and the
roofline are ``l2l bench eps``'s (host/l2l/bench/eps.py): the methods and STREAM-like kernels
run in turn in short blocks, each method's figure is the median of its timed runs, and its
share of the roofline is the median over rounds of its bandwidth over the best bandwidth
kernel's in the same round.

Bytes per element, two conventions (a copy that is p itself costs none):
  update: what the update kernel moves -- Lion reads g, p, m and writes p, m, copy:
          4 + 8 + 8 + |C|; AdamW reads g, p, m, v and writes p, m, v, copy: 4 + 12 + 12 + |C|;
  step:   the step as ``l2l bench eps`` counts it, eps_check's read of g too (4 more).
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import sys

import numpy as np

from l2l.bench.eps import (Method, _inputs, _round_fractions, _round_rooflines, _stream_methods, _time_in_turn,
                           set_threads)
from l2l.eps import LionScalars, OpenCLBackend, OptimizerHyper, StepScalars
from l2l.eps.numerics import COPY_DTYPES
from l2l.eps.threads import available_cpus
from l2l.hostmem import aligned_empty

OPTIMIZERS = {"adamw": (StepScalars, 2, 12 + 12), "lion": (LionScalars, 1, 8 + 8)}  # scalars, moments, p+state r/w


def _method(be: OpenCLBackend, layer: int, optimizer: str, copy: str, p0, grads) -> Method:
    scalars, moments, state_bytes = OPTIMIZERS[optimizer]
    hyper = OptimizerHyper(optimizer=optimizer)
    be.allocate(layer, p0, moments)
    n = p0.shape[0]
    if copy == "master":
        out, cs = be.master_as_copy(layer), 0
    else:
        out, cs = aligned_empty(n, COPY_DTYPES[copy]), COPY_DTYPES[copy].itemsize
        out[:] = 0
    counter = itertools.count(1)

    def run():
        if not be.step(layer, grads, scalars.compute(hyper, next(counter)), out):
            raise RuntimeError("benchmark gradients were not finite")

    update_bytes = grads.dtype.itemsize + state_bytes + cs
    return Method(f"{optimizer}-{copy}", f"OpenCL {optimizer}, copy {copy}", None,
                  bytes_per_elem=update_bytes, counted=f"update {update_bytes}, step {update_bytes + 4}", run=run)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=16 << 20)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args(argv)
    n = args.numel
    threads = available_cpus()
    p0, grads = _inputs(n, 1, np.dtype(np.float32))
    be = OpenCLBackend()
    print(f"OpenCL: {be.describe()}, VW={be.vector_width}, streaming stores {be.streaming_stores}; "
          f"n={n}, {args.repeats} timed runs each", flush=True)
    stream = _stream_methods(n, threads)
    methods = [_method(be, i, opt, copy, p0, grads) for i, (copy, opt) in
               enumerate(itertools.product(("fp32", "bf16", "master"), ("adamw", "lion")))]
    try:
        _time_in_turn(stream + methods, args.warmup, args.repeats)
    finally:
        be.close()
        set_threads(threads)
    roofs = _round_rooflines(stream, n)
    roof = statistics.median(roofs.values())
    print(f"roofline (best STREAM-like kernel per round): median {roof:.1f} GB/s, "
          f"rounds {min(roofs.values()):.1f}-{max(roofs.values()):.1f}")
    print(f"{'method':<16} {'ms':>7} {'Gelem/s':>8} {'B/el upd':>8} {'GB/s upd':>8} {'roof upd':>8} "
          f"{'GB/s step':>9} {'roof step':>9}")
    rates = {}
    for m in methods:
        s = statistics.median(m.times)
        frac = statistics.median(_round_fractions(m, roofs, n).values())
        step_bytes = m.bytes_per_elem + 4
        rates[m.key] = n / s
        print(f"{m.key:<16} {s * 1e3:7.2f} {n / s / 1e9:8.3f} {m.bytes_per_elem:8.0f} "
              f"{n * m.bytes_per_elem / s / 1e9:8.1f} {frac:8.0%} {n * step_bytes / s / 1e9:9.1f} "
              f"{frac * step_bytes / m.bytes_per_elem:9.0%}")
    for copy in ("fp32", "bf16", "master"):
        print(f"Lion/AdamW elements per second, copy {copy}: {rates[f'lion-{copy}'] / rates[f'adamw-{copy}']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
