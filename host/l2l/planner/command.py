"""``l2l plan``: the command line of the planner (``--fit``: the search is ``fit.py``'s)."""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, replace

from ..build import resolve_device
from ..config import TrainConfig
from ..errors import UserError
from ..hostmem import available_memory
from ..lora.spec import enabled as lora_enabled
from .fit import SEARCHES, Limits, count, describe, fit
from .measure import calibrate, measure_rates
from .model import Machines, Rates, choose_micro_batches, predict
from .report import format_plan, mib
from ..options import BATCH, DEVICE, EPS, LORA, MODEL, OPTIMIZER, RELAY, Parser, add_options, config_from
from .disk import DiskRates, format_disk, free_bytes, plan_disk, probe_disk
from .shapes import dtype_bytes_of

def _parser() -> argparse.ArgumentParser:
    p = Parser(prog="l2l plan", description="Predict a relay step's time and memory from the model's shape and "
               "the machine's rates (measured here unless given).")
    add_options(p, MODEL + BATCH + DEVICE)
    add_options(p, [o for o in LORA if o.flag in ("--lora-rank", "--lora-targets", "--lora-base-dtype", "--lora-init")])
    add_options(p, [o for o in RELAY + EPS + OPTIMIZER
                    if o.flag in ("--stash", "--precision", "--devices", "--eps", "--eps-threads", "--eps-offload",
                                  "--eps-offload-window", "--eps-offload-copies", "--eps-layout", "--optimizer")])
    p.add_argument("--dtype-bytes", type=int, default=None,
                   help="bytes per weight/gradient/activation element (default: what --precision computes in)")
    p.add_argument("--flops", type=float, default=None,
                   help="device compute rate, FLOP/s: one GPU's, each of --devices has its own; the CPU's is the "
                        "box's, which its --devices workers share (default: measured)")
    p.add_argument("--link-gbps", type=float, default=None,
                   help="host<->device bandwidth, GB/s (default: measured; 0 or inf: zero-copy)")
    p.add_argument("--eps-rate", type=float, default=None, help="EPS update rate, elements/s (default: measured)")
    p.add_argument("--efficiency", type=float, default=None,
                   help="achieved share of --flops (default: calibrated with real relay steps when measuring, else 1)")
    p.add_argument("--per-call-us", type=float, default=None,
                   help="fixed cost of one layer's forward call on one micro-batch, µs (default: calibrated, else 0)")
    p.add_argument("--disk-read-gbps", type=float, default=None,
                   help="with --eps-offload: the disk's read bandwidth, GB/s (default: measured in DIR)")
    p.add_argument("--disk-write-gbps", type=float, default=None,
                   help="with --eps-offload: the disk's write bandwidth, GB/s (default: measured in DIR)")
    p.add_argument("--machines", type=int, default=1,
                   help="plan for R machines under torchrun, each with --devices workers: each machine's host "
                        "memory, and the EPS's collectives in the step (default 1)")
    p.add_argument("--network-gbps", type=float, default=None,
                   help="with --machines: each machine's network bandwidth, GB/s each way (default: free)")
    p.add_argument("--no-calibrate", action="store_true", help="skip the relay steps that calibrate the efficiency")
    p.add_argument("--memory-budget-gib", type=float, default=None, help="device memory for choosing M")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--fit", nargs="?", const="layers", default=None, choices=SEARCHES,
                   help="print the largest model that fits this machine's memory, searching layers (default) "
                        "or d-model; the other shape options as given; nothing is measured")
    p.add_argument("--host-memory", type=float, default=None, metavar="GIB",
                   help="with --fit: host memory to fit in, GiB (default: 95%% of what is available now, MemAvailable)")
    p.add_argument("--device-memory", type=float, default=None, metavar="GIB",
                   help="with --fit on CUDA: device memory to fit in, GiB (default: free now; given, "
                        "--device cuda needs no GPU here)")
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
    if args.fit is not None:
        return _run_fit(args)
    if args.host_memory is not None or args.device_memory is not None:
        raise UserError("--host-memory and --device-memory apply to --fit")
    if args.eps_offload is None and (args.disk_read_gbps is not None or args.disk_write_gbps is not None):
        raise UserError("--disk-read-gbps and --disk-write-gbps apply to --eps-offload")
    cfg = config_from(args, progress=False).check()
    machines = _machines_of(args, cfg)
    db = dtype_bytes_of(cfg, args.dtype_bytes)
    disk_rates = None if cfg.eps_offload is None else _disk_rates_of(args, cfg)  # a bad DIR fails first
    rates = _rates_of(args, cfg, db)
    prediction = predict(cfg, rates, dtype_bytes=db, machines=machines)
    budget = None if args.memory_budget_gib is None else int(args.memory_budget_gib * 2**30)
    # the choice of M is one machine's (several: M is a multiple of machines x devices, given)
    choice = choose_micro_batches(cfg, rates, device_memory_bytes=budget, dtype_bytes=db) \
        if machines.count == 1 else None
    tier = None if cfg.eps_offload is None else plan_disk(cfg, prediction, disk_rates)
    if args.json:
        print(json.dumps({"prediction": prediction.to_dict(), "rates": rates.to_dict(),
                          "micro_batches": None if choice is None else asdict(choice), "disk": None if tier is None else tier.to_dict()},
                         indent=2, default=str))
    else:
        print(format_plan(prediction, rates, choice) + ("" if tier is None else "\n\n" + format_disk(tier)))
    return 0


def _machines_of(args, cfg: TrainConfig) -> Machines:
    if args.machines < 1:
        raise UserError(f"--machines must be at least 1 (got {args.machines})")
    if args.network_gbps is not None and not (args.network_gbps > 0 and math.isfinite(args.network_gbps)):
        raise UserError(f"--network-gbps must be a positive number (got {args.network_gbps})")
    if args.machines == 1 and args.network_gbps is not None:
        raise UserError("--network-gbps applies to --machines 2 or more")
    if cfg.micro_batches % (args.machines * cfg.devices):
        raise UserError(f"--micro-batches {cfg.micro_batches} must be a multiple of --machines x --devices "
                        f"({args.machines} x {cfg.devices})")
    return Machines.of(cfg, args.machines, args.network_gbps)


def _disk_rates_of(args, cfg: TrainConfig) -> DiskRates:
    """The disk's bandwidth: given (both), else measured in --eps-offload DIR."""
    read, write = args.disk_read_gbps, args.disk_write_gbps
    if (read is None) != (write is None):
        raise UserError("give both --disk-read-gbps and --disk-write-gbps, or neither (then both are measured)")
    if read is not None:
        return DiskRates(read * 1e9, write * 1e9)
    return probe_disk(cfg.eps_offload)


# ---------------------------------------------------------------- --fit

_RATE_OPTIONS = ("flops", "link_gbps", "eps_rate", "efficiency", "per_call_us", "memory_budget_gib",
                 "disk_read_gbps", "disk_write_gbps")


def _gib(flag: str, value: float) -> int:
    if not (value > 0 and math.isfinite(value)):
        raise UserError(f"{flag} must be a positive number of GiB (got {value})")
    return int(value * 2**30)


HOST_SHARE = 0.95  # of MemAvailable, what --fit plans to use by default


def _limits(args) -> tuple[Limits, str, str]:
    """The limits, and where each came from (for the report)."""
    on_cuda = args.device == "cuda" and args.device_memory is not None or resolve_device(args.device).type == "cuda"
    if args.host_memory is not None:
        host, host_from = _gib("--host-memory", args.host_memory), "given (--host-memory)"
    else:
        available = available_memory()
        if available is None:
            raise UserError("this machine's available memory is unknown (no /proc/meminfo): give --host-memory GIB")
        # a margin for the prediction (within a few percent, docs/results.md) and the rest of
        # the machine: the page cache a checkpoint fills, other processes starting
        host = int(available * HOST_SHARE)
        host_from = f"{HOST_SHARE:.0%} of available (MemAvailable {available / 2**30:.2f} GiB)"
    if not on_cuda:
        if args.device_memory is not None:
            raise UserError("--device-memory applies to a CUDA device; the CPU device's memory is host memory "
                            "(--host-memory)")
        return Limits(host), host_from, ""
    if args.device_memory is not None:
        return Limits(host, _gib("--device-memory", args.device_memory)), host_from, "given (--device-memory)"
    import torch
    free, _ = torch.cuda.mem_get_info(resolve_device(args.device))
    return Limits(host, free), host_from, "free (cuda mem_get_info)"


def _train_flags(cfg: TrainConfig, device: str) -> str:
    """The ``l2l train`` options that give the found model the memory it was planned with. A LoRA
    run trains a model directory (``DIR``), whose config fixes the shape: not the built-in's flags."""
    shape = ["--model", "DIR"] if lora_enabled(cfg) else \
        ["--model", cfg.model, "--layers", cfg.layers, "--d-model", cfg.d_model, "--heads", cfg.heads]
    flags = [*shape, "--seq-len", cfg.seq_len, "--batch-size", cfg.batch_size, "--micro-batches", cfg.micro_batches]
    default = TrainConfig()
    for flag in ("dropout", "stash", "precision", "devices", "eps_offload", "eps_offload_window",
                 "eps_offload_copies", "optimizer", "lora_rank", "lora_targets", "lora_base_dtype"):
        value = getattr(cfg, flag)
        if value != getattr(default, flag):
            flags += ["--" + flag.replace("_", "-")] + ([] if value is True else [value])
    if device != "auto":
        flags += ["--device", device]
    return "l2l train " + " ".join(str(f) for f in flags)


def _run_fit(args) -> int:
    from ..models.pretrained import is_model_dir
    if is_model_dir(args.model):
        raise UserError(f"--fit searches the built-in models' shape; {args.model} is a model directory, "
                        "whose config fixes it")
    given = [o for o in _RATE_OPTIONS if getattr(args, o) is not None] + (["no_calibrate"] if args.no_calibrate else [])
    if given:
        raise UserError(f"--fit plans memory alone, which no rate changes: drop --{given[0].replace('_', '-')}")
    limits, host_from, device_from = _limits(args)
    disk_from = ""
    if args.eps_offload is not None:  # the state goes to disk: its free space is the state's limit
        limits = replace(limits, disk_bytes=free_bytes(args.eps_offload))
        disk_from = f"free on --eps-offload {args.eps_offload}'s filesystem"
    cfg = config_from(args, progress=False)
    if args.fit == "d-model":
        cfg = replace(cfg, d_model=cfg.heads)  # searched; checked as the smallest, heads wide
    cfg = cfg.check()
    found = fit(cfg, limits, args.fit, dtype_bytes=args.dtype_bytes)
    s, n = found.found, found.next
    shaped = replace(cfg, layers=s.layers, d_model=s.d_model)
    train = _train_flags(shaped, args.device)
    if args.json:
        print(json.dumps({
            "fit": found.search, "model": cfg.model, "layers": s.layers, "d_model": s.d_model, "heads": s.heads,
            "params": s.params, "host_bytes": s.host_bytes, "host_limit_bytes": limits.host_bytes,
            "host_limit_from": host_from, "device": "cuda" if limits.on_cuda else "cpu",
            "device_bytes": s.device_bytes, "device_limit_bytes": limits.device_bytes,
            "disk_bytes": s.disk_bytes if limits.disk_bytes is not None else None,
            "disk_limit_bytes": limits.disk_bytes, "binding": found.binding,
            "next": None if n is None else {"layers": n.layers, "d_model": n.d_model, "params": n.params,
                                            "host_bytes": n.host_bytes, "device_bytes": n.device_bytes,
                                            "disk_bytes": n.disk_bytes,
                                            "over": sorted(n.over(limits))},
            "train": train}, indent=2))
        return 0
    mark = {found.binding: "  <- binds"}
    lines = [f"l2l plan --fit {found.search}: {describe(cfg.model, s)}",
             f"  host:   {mib(s.host_bytes)} predicted of {mib(limits.host_bytes)} {host_from}" + mark.get("host", "")]
    if limits.on_cuda:
        lines.append(f"  device: {mib(s.device_bytes)} predicted of {mib(limits.device_bytes)} {device_from}"
                     + mark.get("device", ""))
    else:
        lines.append("  device: the CPU (counted in host)")
    if limits.disk_bytes is not None:
        lines.append(f"  disk:   {mib(s.disk_bytes)} of state files of {mib(limits.disk_bytes)} {disk_from}"
                     + mark.get("disk", ""))
    if n is None:
        lines.append(f"  next:   none: the search stops at {s.layers if found.search == 'layers' else s.d_model}")
    else:
        size = f"{n.layers} layers" if found.search == "layers" else f"d{n.d_model}"
        needs = [f"{where} {mib(need)} ({mib(need - limit)} over)" for where, need, limit in
                 (("host", n.host_bytes, limits.host_bytes), ("device", n.device_bytes, limits.device_bytes),
                  ("disk", n.disk_bytes, limits.disk_bytes))
                 if where in n.over(limits)]
        lines.append(f"  next:   {size} ({count(n.params)} parameters) would need " + " and ".join(needs))
    if lora_enabled(cfg):
        lines.append(f"  base:   DIR, a model directory of at most {count(s.params)} parameters (this shape: "
                     f"{s.layers} blocks of d {s.d_model}); l2l plan --model DIR --lora-rank ... checks one")
    lines.append(f"  train:  {train}")
    print("\n".join(lines))
    return 0
