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
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from .config import TrainConfig
from .data import BatchSampler, load_corpus
from .errors import UserError
from .models import build_stack, family
from .train import build_engine, resolve_device


def _time_engines(configs: dict[str, TrainConfig], sampler: BatchSampler, steps: int,
                  warmup: int) -> dict[str, dict]:
    """Median step time of each engine, stepping them in turn so that drift in the
    machine's speed (other load, clocks) falls on all of them alike; for the relay
    also the share of the step its EPS spent updating (busy) and it spent waiting."""
    device = resolve_device(next(iter(configs.values())).device)
    engines = {name: build_engine(cfg, build_stack(cfg.model_config(), cfg.seed), device)
               for name, cfg in configs.items()}
    times = {name: [] for name in engines}
    waits = {name: [] for name in engines}
    peaks = {name: 0 for name in engines}
    busy = {name: 0.0 for name in engines}
    try:
        for step in range(warmup + steps):
            batch = sampler.batch(step)
            for name, engine in engines.items():
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                eps = getattr(engine, "eps", None)
                before = eps.update_seconds if eps is not None else 0.0
                t0 = time.perf_counter()
                result = engine.train_step(batch, step)
                if eps is not None:  # the step's updates belong to the step
                    eps.synchronize()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if step >= warmup:
                    if eps is not None:
                        busy[name] += eps.update_seconds - before
                    times[name].append(time.perf_counter() - t0)
                    waits[name].append(result.eps_wait_s)
                    peaks[name] = max(peaks[name], result.device_peak_bytes)
    finally:
        for engine in engines.values():
            engine.close()
    out = {}
    for name in engines:
        median = statistics.median(times[name])
        out[name] = {"step_s": median, "eps_wait_share": statistics.median(waits[name]) / median,
                     "eps_busy_share": busy[name] / sum(times[name]), "device_peak_bytes": peaks[name]}
    return out


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
        timed = _time_engines(configs, sampler, args.steps, args.warmup)
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
    from .planner import calibrate, measure_rates, predict
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
    from .cli import _Parser
    p = _Parser(prog="l2l bench relay", description=__doc__)
    p.add_argument("--model", default="gpt")
    p.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8, 16])
    p.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--stash", nargs="+", default=["device"], choices=["device", "host"],
                   help="stash policies to time (several: stepped in turn, compared with the first)")
    p.add_argument("--device", default="auto")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--no-plan", dest="plan", action="store_false",
                   help="skip the planner's predictions (they calibrate on a few relay steps first)")
    p.add_argument("--out", default="bench/results")
    return p


def run_bench(what: str, argv: list[str]) -> int:
    if what == "memory":
        from .bench_memory import run_memory_bench
        run_memory_bench(argv)
        return 0
    if what == "workers":
        from .bench_workers import run_workers_bench
        return run_workers_bench(argv)
    if what == "suite":
        from .bench_suite import run_suite
        return run_suite(argv)
    if what != "relay":
        raise UserError(f"unknown benchmark {what!r}; available: relay, eps, memory, workers, suite")
    run_relay_bench(argv)
    return 0


def run_relay_bench(argv: list[str]) -> list[dict]:
    args = _parser().parse_args(argv)
    rows = relay_vs_plain(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "relay_vs_plain.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2) + "\n")
    table = markdown(rows, args)
    (out / "relay_vs_plain.md").write_text(table)
    print("\n" + table)
    return rows
