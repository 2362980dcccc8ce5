"""``l2l bench relay``: relay step time against the in-memory baseline.

Same model, data and seed for every engine; the relay runs the batch as M
micro-batches, the baseline runs it whole, with (``plain+ckpt``, the same
recompute the relay pays) and without activation checkpointing, and also as
the same M micro-batches with checkpointing and gradient accumulation
(``plain+ckpt M``): that ratio isolates what the relay itself costs from what
smaller micro-batches cost any engine. Reports the median step time after
warm-up, the ratios and the share of the step the relay spent waiting on the
EPS. Writes JSON and a Markdown table.
"""
from __future__ import annotations

import argparse
from dataclasses import replace

from ..build import resolve_device
from ..config import TrainConfig
from ..data import BatchSampler, load_corpus
from ..models import family
from ..options import BATCH, DEVICE, MODEL, RELAY, Parser, add_options
from ..planner import calibrate, measure_rates, predict
from .output import save_results
from .timing import time_engines


def relay_vs_plain(args: argparse.Namespace) -> list[dict]:
    corpus = load_corpus(None)
    rows = []
    for layers in args.layers:
        base = TrainConfig(model=args.model, layers=layers, d_model=args.d_model, heads=args.heads,
                           seq_len=args.seq_len, batch_size=args.batch_size, device=args.device,
                           progress=False).check()
        sampler = BatchSampler(corpus.train, base.seq_len, base.batch_size,
                               family(base.model).objective, seed=0)
        ms = [m for m in args.micro_batches if base.batch_size % m == 0]
        configs = {"plain_ckpt": replace(base, engine="plain", checkpointing=True),
                   "plain": replace(base, engine="plain")}
        stashes = args.stash
        configs.update({_l2l(m, st): replace(base, micro_batches=m, stash=st) for m in ms for st in stashes})
        configs.update({f"plain_ckpt_m{m}": replace(base, engine="plain", checkpointing=True, accumulate=True,
                                                    micro_batches=m) for m in ms if m > 1})
        timed = time_engines(configs, sampler, args.steps, args.warmup)
        predicted = _predictions(base, [configs[_l2l(m, stashes[0])] for m in ms], args) if args.plan else {}
        for m, stash in ((m, st) for m in ms for st in stashes):
            l2l, ckpt, plain = timed[_l2l(m, stash)], timed["plain_ckpt"], timed["plain"]
            ckpt_m = timed.get(f"plain_ckpt_m{m}", ckpt)
            row = {"layers": layers, "micro_batches": m, "stash": stash, "l2l_step_s": l2l["step_s"],
                   "plain_ckpt_step_s": ckpt["step_s"], "plain_step_s": plain["step_s"],
                   "plain_ckpt_same_m_step_s": ckpt_m["step_s"],
                   "ratio_vs_plain_ckpt": l2l["step_s"] / ckpt["step_s"],
                   "ratio_vs_plain_ckpt_same_m": l2l["step_s"] / ckpt_m["step_s"],
                   "ratio_vs_plain": l2l["step_s"] / plain["step_s"],
                   "eps_wait_share": l2l["eps_wait_share"],
                   "l2l_tokens_per_s": base.batch_size * base.seq_len / l2l["step_s"],
                   "l2l_device_peak_bytes": l2l["device_peak_bytes"]}
            if stash != stashes[0]:  # the same step with the first stash policy, timed in turn
                row["vs_first_stash"] = l2l["step_s"] / timed[_l2l(m, stashes[0])]["step_s"]
            elif m in predicted:
                row["predicted_step_s"] = predicted[m]
                row["prediction_error"] = predicted[m] / l2l["step_s"] - 1.0
            rows.append(row)
            print(f"L={layers:3d} M={m:2d} {stash:6s}  l2l {row['l2l_step_s']:.3f}s  plain+ckpt {row['plain_ckpt_step_s']:.3f}s"
                  f"  plain {row['plain_step_s']:.3f}s  ratio {row['ratio_vs_plain_ckpt']:.3f}"
                  f"  (same M {row['ratio_vs_plain_ckpt_same_m']:.3f})"
                  f"  eps wait {row['eps_wait_share']:.1%}", flush=True)
    return rows


def _l2l(m: int, stash: str) -> str:
    return f"l2l_m{m}_{stash}"


_RATES: dict = {}


def _predictions(base: TrainConfig, cfgs: list[TrainConfig], args: argparse.Namespace) -> dict[int, float]:
    """The planner's step time for each relay configuration (micro-batches -> s), from
    rates measured and calibrated once per model width on this machine."""
    key = (base.model, base.d_model, base.heads, base.seq_len, base.batch_size, base.device)
    if key not in _RATES:
        device = resolve_device(base.device)
        rates = measure_rates(device, base, calibrate_steps=False)
        _RATES[key] = calibrate(base, rates, device)
    return {c.micro_batches: predict(c, _RATES[key]).step_s for c in cfgs}


def markdown(rows: list[dict], args: argparse.Namespace) -> str:
    head = (f"Model {args.model} d{args.d_model} h{args.heads}, seq {args.seq_len}, batch {args.batch_size}, "
            f"device {args.device}, median of {args.steps} steps after {args.warmup} warm-up, engines stepped in turn; "
            f"stash {' and '.join(args.stash)}.\n\n"
            "`plain+ckpt M`: the same M micro-batches, checkpointed, gradients accumulated.\n\n"
            "| layers | M | stash | l2l step (s) | plain+ckpt (s) | plain+ckpt M (s) | plain (s) | l2l / plain+ckpt "
            "| l2l / plain+ckpt M | l2l / plain | EPS wait | planner (s) | planner error |\n"
            "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
    body = "".join(f"| {r['layers']} | {r['micro_batches']} | {r['stash']} | {r['l2l_step_s']:.3f} | {r['plain_ckpt_step_s']:.3f} "
                   f"| {r['plain_ckpt_same_m_step_s']:.3f} | {r['plain_step_s']:.3f} | {r['ratio_vs_plain_ckpt']:.3f} "
                   f"| {r['ratio_vs_plain_ckpt_same_m']:.3f} | {r['ratio_vs_plain']:.3f} "
                   f"| {r['eps_wait_share']:.1%} | "
                   + (f"{r['predicted_step_s']:.3f} | {r['prediction_error']:+.1%} |\n" if "predicted_step_s" in r
                      else "— | — |\n") for r in rows)
    others = [r for r in rows if "vs_first_stash" in r]
    if others:
        ratios = [r["vs_first_stash"] for r in others]
        body += (f"\nStep time with `--stash {others[0]['stash']}` over `--stash {args.stash[0]}`, timed in turn: "
                 f"{min(ratios):.3f}x .. {max(ratios):.3f}x.\n")
    return head + body


def _parser() -> argparse.ArgumentParser:
    p = Parser(prog="l2l bench relay", description=__doc__)
    shape = {"layers": [2, 4, 8, 16], "micro_batches": [1, 2, 4, 8], "d_model": 256, "heads": 4, "seq_len": 128,
             "batch_size": 16, "stash": ["device"]}
    add_options(p, [o for o in MODEL if o.flag != "--dropout"] + list(BATCH) + list(DEVICE)
                + [o for o in RELAY if o.flag == "--stash"],
                defaults=shape, several=("layers", "micro_batches", "stash"))
    p.add_argument("--steps", type=int, default=8, help="timed steps per engine (default %(default)s)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default %(default)s)")
    p.add_argument("--no-plan", dest="plan", action="store_false",
                   help="skip the planner's predictions (they calibrate on a few relay steps first)")
    p.add_argument("--out", default="bench/results", help="folder for the JSON and Markdown results")
    return p


def run_relay_bench(argv: list[str]) -> list[dict]:
    args = _parser().parse_args(argv)
    rows = relay_vs_plain(args)
    save_results(args.out, "relay_vs_plain", {"args": vars(args), "rows": rows}, markdown(rows, args))
    return rows
