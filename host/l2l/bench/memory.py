"""``l2l bench memory``: device memory of the relay against depth and micro-batch count.

One training step per configuration, ``--stash device`` and ``--stash host``,
and the planner's prediction beside each: device memory should not grow with
depth (weights) and, with the host stash, not with the micro-batch count at a
fixed micro-batch size either. ``device_peak_bytes`` is
``torch.cuda.max_memory_allocated`` on CUDA and the relay's ledger on the CPU.

Beside the ledger, an independent measurement (``relay/audit.py``): at every
layer boundary of both steps, the device bytes the relay can reach, found by
walking its objects, against the ledger's current device bytes;
``audit_max_diff_bytes`` is the largest difference over all boundaries (0:
the ledger books exactly what the relay holds).
"""
from __future__ import annotations

import argparse
from dataclasses import replace

import torch

from ..build import build_engine, resolve_device
from ..config import TrainConfig
from ..errors import UserError
from ..models import build_stack
from ..options import BATCH, DEVICE, MODEL, Parser, add_options
from ..planner.measure import synthetic_batch
from ..planner.model import Rates, predict
from .output import save_results
from ..relay.audit import audited


def _peak(cfg: TrainConfig, device: torch.device) -> tuple[int, int, int]:
    """(device peak, weights + gradients peak, largest |audit - ledger| at a boundary)."""
    engine = build_engine(cfg, build_stack(cfg.model_config(), cfg.seed), device)
    try:
        audit = audited(engine)
        batch = synthetic_batch(cfg)
        engine.train_step(batch, 0)  # the first step allocates what later steps reuse
        result = engine.train_step(batch, 1)
        return result.device_peak_bytes, result.device_weight_peak_bytes, audit.worst
    finally:
        engine.close()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def sweep(args: argparse.Namespace) -> list[dict]:
    device = resolve_device(args.device)
    base = TrainConfig(d_model=args.d_model, heads=args.heads, seq_len=args.seq_len,
                       device=device.type, progress=False)
    # memory does not depend on the rates; any rates give the planner's ledger replay
    rates = Rates(flops_per_s=1e12, link_bytes_per_s=None if device.type == "cpu" else 1e10,
                  eps_elems_per_s=1e9, device=device.type)
    cases = [("depth", replace(base, layers=n, micro_batches=args.micro_batches,
                               batch_size=args.micro_batches * args.micro_batch_size)) for n in args.layers]
    cases += [("micro_batches", replace(base, layers=args.fixed_layers, micro_batches=m,
                                        batch_size=m * args.micro_batch_size)) for m in args.micro_batch_counts]
    rows = []
    for sweep_name, cfg in cases:
        for stash in ("device", "host"):
            c = replace(cfg, stash=stash).check()
            peak, weights, audit_diff = _peak(c, device)
            predicted = predict(c, rates).device_ledger_bytes
            rows.append({"sweep": sweep_name, "layers": c.layers, "micro_batches": c.micro_batches,
                         "batch_size": c.batch_size, "stash": stash, "device_peak_bytes": peak,
                         "device_weight_peak_bytes": weights, "predicted_ledger_bytes": predicted,
                         "audit_max_diff_bytes": audit_diff})
            print(f"{sweep_name:13s} L={c.layers:3d} M={c.micro_batches:3d} stash {stash:6s} "
                  f"peak {peak / 2**20:9.2f} MiB  weights {weights / 2**20:8.2f} MiB  "
                  f"planner {predicted / 2**20:9.2f} MiB  audit-ledger {audit_diff} B", flush=True)
    return rows


def spread(rows: list[dict], sweep_name: str, stash: str) -> float:
    """max/min - 1 of device_peak_bytes across one sweep: 0 means flat."""
    peaks = [r["device_peak_bytes"] for r in rows if r["sweep"] == sweep_name and r["stash"] == stash]
    return max(peaks) / min(peaks) - 1.0


def markdown(rows: list[dict], args: argparse.Namespace) -> str:
    head = (f"Device memory, d {args.d_model}, seq {args.seq_len}, {args.micro_batch_size} sequences per "
            f"micro-batch, device {args.device}; second step of each configuration.\n\n"
            "| sweep | layers | M | stash | device peak (MiB) | weights + grads (MiB) | planner (MiB) "
            "| max \\|audit - ledger\\| (B) |\n"
            "|---|---:|---:|---|---:|---:|---:|---:|\n")
    body = "".join(f"| {r['sweep']} | {r['layers']} | {r['micro_batches']} | {r['stash']} "
                   f"| {r['device_peak_bytes'] / 2**20:.2f} | {r['device_weight_peak_bytes'] / 2**20:.2f} "
                   f"| {r['predicted_ledger_bytes'] / 2**20:.2f} | {r['audit_max_diff_bytes']} |\n" for r in rows)
    tail = "\nSpread of the device peak (max/min - 1): " + ", ".join(
        f"{s} over {w}: {spread(rows, w, s):.1%}" for w in ("depth", "micro_batches") for s in ("device", "host")) + "\n"
    tail += ("\naudit: the device bytes the relay can reach at each layer boundary (relay/audit.py, "
             "which does not read the ledger) against the ledger's current device bytes; the column is "
             "the largest difference over both steps' boundaries.\n")
    return head + body + tail


def _parser() -> argparse.ArgumentParser:
    p = Parser(prog="l2l bench memory", description=__doc__)
    add_options(p, [o for o in MODEL if o.flag in ("--layers", "--d-model", "--heads", "--seq-len")]
                + [o for o in BATCH if o.flag == "--micro-batches"] + list(DEVICE),
                defaults={"layers": [4, 8, 16, 32], "micro_batches": 4, "d_model": 256, "heads": 4, "seq_len": 128},
                several=("layers",))
    p.add_argument("--fixed-layers", type=int, default=4, help="depth in the micro-batch sweep")
    p.add_argument("--micro-batch-counts", type=int, nargs="+", default=[2, 4, 8, 16])
    p.add_argument("--micro-batch-size", type=int, default=2, help="sequences per micro-batch")
    p.add_argument("--out", default="bench/results", help="folder for the JSON and Markdown results")
    return p


def run_memory_bench(argv: list[str]) -> dict:
    args = _parser().parse_args(argv)
    args.device = resolve_device(args.device).type
    if min(args.layers + args.micro_batch_counts + [args.micro_batches, args.fixed_layers, args.micro_batch_size]) < 1:
        raise UserError("layers, micro-batch counts and sizes must be >= 1")
    rows = sweep(args)
    result = {"args": vars(args), "rows": rows,
              "spread": {f"{w}/{s}": spread(rows, w, s) for w in ("depth", "micro_batches") for s in ("device", "host")}}
    save_results(args.out, "bench_memory", result, markdown(rows, args))
    return result
