"""``l2l plan``: the command line of the planner."""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, replace

from ..build import resolve_device
from ..config import TrainConfig
from .measure import calibrate, measure_rates
from .model import Rates, choose_micro_batches, predict
from .report import format_plan
from ..options import BATCH, DEVICE, EPS, MODEL, RELAY, Parser, add_options, config_from
from .shapes import dtype_bytes_of

def _parser() -> argparse.ArgumentParser:
    p = Parser(prog="l2l plan", description="Predict a relay step's time and memory from the model's shape and "
               "the machine's rates (measured here unless given).")
    add_options(p, MODEL + BATCH + DEVICE)
    add_options(p, [o for o in RELAY + EPS if o.flag in ("--stash", "--precision", "--devices", "--eps")])
    p.add_argument("--dtype-bytes", type=int, default=None,
                   help="bytes per weight/gradient/activation element (default: what --precision computes in)")
    p.add_argument("--flops", type=float, default=None, help="device compute rate, FLOP/s (default: measured)")
    p.add_argument("--link-gbps", type=float, default=None,
                   help="host<->device bandwidth, GB/s (default: measured; 0 or inf: zero-copy)")
    p.add_argument("--eps-rate", type=float, default=None, help="EPS update rate, elements/s (default: measured)")
    p.add_argument("--efficiency", type=float, default=None,
                   help="achieved share of --flops (default: calibrated with real relay steps when measuring, else 1)")
    p.add_argument("--per-call-us", type=float, default=None,
                   help="fixed cost of one layer's forward call on one micro-batch, µs (default: calibrated, else 0)")
    p.add_argument("--no-calibrate", action="store_true", help="skip the relay steps that calibrate the efficiency")
    p.add_argument("--memory-budget-gib", type=float, default=None, help="device memory for choosing M")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    return p


def _rates_of(args, cfg: TrainConfig, dtype_bytes: int) -> Rates:
    given_link = args.link_gbps is not None
    link = None if not given_link or args.link_gbps == 0 or math.isinf(args.link_gbps) else args.link_gbps * 1e9
    if args.flops is not None and args.eps_rate is not None and given_link:
        rates = Rates(flops_per_s=args.flops, link_bytes_per_s=link, eps_elems_per_s=args.eps_rate,
                      device="cpu" if link is None else "cuda", notes={"measured": []})
    else:
        device = resolve_device(args.device)
        rates = measure_rates(device, cfg, calibrate_steps=False, dtype_bytes=dtype_bytes)
        given = {"link": given_link, "eps": args.eps_rate is not None, "compute": args.flops is not None}
        rates = replace(rates, notes={**rates.notes, "measured": [k for k in rates.notes["measured"]
                                                                  if not given[k]]})
        if given_link:
            rates = replace(rates, link_bytes_per_s=link, link_out_bytes_per_s=None,
                            device="cpu" if link is None else "cuda")
        if args.eps_rate is not None:
            rates = replace(rates, eps_elems_per_s=args.eps_rate)
        if args.flops is not None:
            rates = replace(rates, flops_per_s=args.flops)
        elif not args.no_calibrate and args.efficiency is None and args.per_call_us is None:
            rates = calibrate(cfg, rates, device, dtype_bytes=dtype_bytes)
    if args.efficiency is not None:
        rates = replace(rates, efficiency=args.efficiency)
    if args.per_call_us is not None:
        rates = replace(rates, per_call_s=args.per_call_us * 1e-6)
    return rates


def run_plan(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    cfg = config_from(args, progress=False).check()
    db = dtype_bytes_of(cfg, args.dtype_bytes)
    rates = _rates_of(args, cfg, db)
    prediction = predict(cfg, rates, dtype_bytes=db)
    budget = None if args.memory_budget_gib is None else int(args.memory_budget_gib * 2**30)
    choice = choose_micro_batches(cfg, rates, device_memory_bytes=budget, dtype_bytes=db)
    if args.json:
        print(json.dumps({"prediction": prediction.to_dict(), "rates": rates.to_dict(),
                          "micro_batches": asdict(choice)}, indent=2, default=str))
    else:
        print(format_plan(prediction, rates, choice))
    return 0
