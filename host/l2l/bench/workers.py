"""``l2l bench workers``: throughput of 1, 2, 4 relay workers feeding one EPS.

The same global batch and micro-batch size for every K (``--devices K``), the
engines stepped in turn. Reports tokens/s, the speed-up over one worker, the
EPS's busy share of a step (its update time over the step time: where the one
EPS would become the limit) and the share the workers spent waiting on it.
On a CPU-only machine the workers share the cores, so the speed-up says how
well K workers fill them; on a GPU box each worker has its own device.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from ..build import resolve_device
from ..config import TrainConfig
from ..data import BatchSampler, load_corpus
from ..errors import UserError
from ..models import family
from ..options import BATCH, DEVICE, EPS, MODEL, Parser, add_options
from .output import save_results
from .timing import time_engines


def run(args) -> list[dict]:
    device = resolve_device(args.device)
    base = TrainConfig(layers=args.layers, d_model=args.d_model, heads=args.heads, seq_len=args.seq_len,
                       batch_size=args.batch_size, micro_batches=args.micro_batches, eps=args.eps,
                       device=device.type, progress=False)
    sampler = BatchSampler(load_corpus(None).train, base.seq_len, base.batch_size,
                           family(base.model).objective, seed=0)
    timed = time_engines({k: replace(base, devices=k).check() for k in args.workers}, sampler,
                          args.steps, args.warmup)
    one = timed[args.workers[0]]["step_s"]
    rows = []
    for k, r in timed.items():
        t = r["step_s"]
        rows.append({"workers": k, "step_s": t, "tokens_per_s": base.batch_size * base.seq_len / t,
                     "speedup": one / t, "eps_busy_share": r["eps_busy_share"],
                     "eps_wait_share": r["eps_wait_share"]})
        print(f"K={k}: {t:.3f} s/step, {rows[-1]['tokens_per_s']:,.0f} tok/s, x{one / t:.2f}, "
              f"EPS busy {r['eps_busy_share']:.1%}, waited {r['eps_wait_share']:.1%}", flush=True)
    return rows


def markdown(rows: list[dict], args) -> str:
    head = (f"gpt {args.layers} blocks d{args.d_model}, seq {args.seq_len}, global batch {args.batch_size} as "
            f"{args.micro_batches} micro-batches, EPS {args.eps}, device {args.device}, median of {args.steps} steps "
            f"after {args.warmup}, engines in turn; torch threads {torch.get_num_threads()}.\n\n"
            "| workers | step (s) | tokens/s | speed-up | EPS busy | waited on EPS |\n|---:|---:|---:|---:|---:|---:|\n")
    return head + "".join(f"| {r['workers']} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | {r['speedup']:.2f}x "
                          f"| {r['eps_busy_share']:.1%} | {r['eps_wait_share']:.1%} |\n" for r in rows)


def _parser():
    p = Parser(prog="l2l bench workers", description=__doc__)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4], help="worker counts (--devices K) to time")
    add_options(p, [o for o in MODEL if o.flag in ("--layers", "--d-model", "--heads", "--seq-len")] + list(BATCH)
                + list(DEVICE) + [o for o in EPS if o.flag == "--eps"],
                defaults={"layers": 4, "d_model": 256, "heads": 4, "seq_len": 128, "batch_size": 16,
                          "micro_batches": 8})
    p.add_argument("--steps", type=int, default=6, help="timed steps per engine (default %(default)s)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default %(default)s)")
    p.add_argument("--out", default="bench/results", help="folder for the JSON and Markdown results")
    return p


def run_workers_bench(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if any(args.micro_batches % k for k in args.workers):
        raise UserError(f"--micro-batches {args.micro_batches} must be a multiple of every worker count")
    rows = run(args)
    save_results(args.out, "bench_workers", {"args": vars(args), "rows": rows}, markdown(rows, args))
    return 0
