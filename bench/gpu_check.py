"""What only a GPU shows, in one run sized for a short device lease (< 8 min on one H200).

    python bench/gpu_check.py --out bench/results/gpu          # on a CUDA machine
    python bench/gpu_check.py --smoke --out /tmp/gpu-smoke     # tiny shapes, any device (checks the script)

1. Device memory against depth: ``device_peak_bytes`` (torch.cuda.max_memory_allocated)
   of one relay step at several depths, with ``--stash device`` and ``--stash host``.
   The claim: flat in depth with the host stash; growing by one boundary per
   layer per micro-batch with the device stash.
2. Throughput against the baseline at a model the baseline fits: tokens/s and
   model-FLOPs utilisation (6 * params * tokens/s over ``--peak-tflops``) for
   the relay, ``plain --checkpointing`` and ``plain``.
3. Overlap of copies and compute: the relay with its copy-stream prefetch,
   and with prefetch switched off (weights fetched when needed).
4. The largest model tried with the relay: params, host bytes, device peak.

Writes ``gpu_check.json`` and ``gpu_check.md`` under ``--out`` and prints the
table; every section is time-boxed so that a partial result still comes back.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from l2l.config import TrainConfig
from l2l.data import BatchSampler, load_corpus
from l2l.models import build_stack, family
from l2l.relay.engine import RelayEngine
from l2l.build import build_engine, resolve_device


def _sampler(corpus, cfg: TrainConfig) -> BatchSampler:
    return BatchSampler(corpus.train, cfg.seq_len, cfg.batch_size, family(cfg.model).objective, seed=0)


def _steps(cfg: TrainConfig, corpus, steps: int, warmup: int, *, prefetch: bool = True) -> dict:
    device = resolve_device(cfg.device)
    stack = build_stack(cfg.model_config(), 0)
    engine = build_engine(cfg, stack, device)
    if not prefetch and isinstance(engine, RelayEngine):
        engine._prefetch = lambda i: None  # fetch each layer only when it is needed
    sampler = _sampler(corpus, cfg)
    times, peaks, waits = [], [], []
    try:
        for step in range(warmup + steps):
            batch = sampler.batch(step)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            result = engine.train_step(batch, step)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if step >= warmup:
                times.append(time.perf_counter() - t0)
                peaks.append(result.device_peak_bytes)
                waits.append(result.eps_wait_s)
    finally:
        engine.close()
        del engine
        if device.type == "cuda":
            torch.cuda.empty_cache()
    step_s = statistics.median(times)
    tokens_per_s = cfg.batch_size * cfg.seq_len / step_s
    return {"params": stack.num_params, "step_s": step_s, "tokens_per_s": tokens_per_s,
            "device_peak_bytes": max(peaks), "eps_wait_s": statistics.median(waits)}


def _mfu(row: dict, peak_tflops: float) -> float:
    return 6 * row["params"] * row["tokens_per_s"] / (peak_tflops * 1e12)


def memory_vs_depth(base: TrainConfig, corpus, depths, deadline: float) -> list[dict]:
    rows = []
    for stash in ("device", "host"):
        for layers in depths:
            if time.monotonic() > deadline:
                return rows
            r = _steps(replace(base, layers=layers, stash=stash), corpus, steps=1, warmup=1)
            rows.append({"stash": stash, "layers": layers, "device_peak_bytes": r["device_peak_bytes"],
                         "params": r["params"]})
            print(f"memory: stash {stash:6s} L={layers:3d}  peak {r['device_peak_bytes'] / 2**30:.3f} GiB", flush=True)
    return rows


def throughput(base: TrainConfig, corpus, peak_tflops: float, steps: int, deadline: float) -> list[dict]:
    rows = []
    variants = [("l2l", base), ("plain+ckpt", replace(base, engine="plain", checkpointing=True)),
                ("plain", replace(base, engine="plain")), ("l2l, no prefetch", base)]
    for name, cfg in variants:
        if time.monotonic() > deadline:
            break
        try:
            r = _steps(cfg, corpus, steps=steps, warmup=2, prefetch=name != "l2l, no prefetch")
        except torch.cuda.OutOfMemoryError:
            rows.append({"engine": name, "status": "out of memory"})
            continue
        r.update(engine=name, status="ok", mfu=_mfu(r, peak_tflops))
        rows.append(r)
        print(f"throughput: {name:16s} {r['tokens_per_s']:,.0f} tok/s  MFU {r['mfu']:.1%}  "
              f"peak {r['device_peak_bytes'] / 2**30:.2f} GiB", flush=True)
    return rows


HOST_BYTES_PER_PARAM = 28  # EPS p, m, v, copy, inbox (20) + the fp32 model while it is built (4) + slack


def _available_host_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def largest(base: TrainConfig, corpus, layer_counts, deadline: float) -> list[dict]:
    """Deeper and deeper relay models, stopping before host memory would run out
    (the kernel's OOM killer would take every result with it)."""
    rows = []
    per_layer = 12 * base.d_model ** 2  # attention 4d^2 + MLP 8d^2, biases ignored
    for layers in layer_counts:
        if time.monotonic() > deadline:
            break
        if HOST_BYTES_PER_PARAM * per_layer * layers > 0.8 * _available_host_bytes():
            rows.append({"layers": layers, "status": "skipped: would not fit in host memory"})
            break
        cfg = replace(base, layers=layers, stash="host")
        try:
            r = _steps(cfg, corpus, steps=1, warmup=1)
        except (torch.cuda.OutOfMemoryError, MemoryError) as exc:
            rows.append({"layers": layers, "status": type(exc).__name__})
            break
        r.update(layers=layers, status="ok", host_bytes=20 * r["params"])
        rows.append(r)
        print(f"largest: L={layers} {r['params'] / 1e9:.2f}B params, step {r['step_s']:.1f}s, "
              f"device peak {r['device_peak_bytes'] / 2**30:.2f} GiB", flush=True)
    return rows


def markdown(result: dict) -> str:
    lines = [f"GPU check on {result['device']} (torch {result['torch']}), {result['mode']} mode.", ""]
    lines += ["Device memory vs depth (one relay step):", "",
              "| stash | layers | params | device peak (GiB) |", "|---|---:|---:|---:|"]
    lines += [f"| {r['stash']} | {r['layers']} | {r['params'] / 1e6:.1f}M | {r['device_peak_bytes'] / 2**30:.3f} |"
              for r in result["memory"]]
    lines += ["", "Throughput (same model, data, seed):", "",
              "| engine | tokens/s | MFU | device peak (GiB) | EPS wait (s) |", "|---|---:|---:|---:|---:|"]
    for r in result["throughput"]:
        if r.get("status") != "ok":
            lines.append(f"| {r['engine']} | {r.get('status')} | | | |")
        else:
            lines.append(f"| {r['engine']} | {r['tokens_per_s']:,.0f} | {r['mfu']:.1%} | "
                         f"{r['device_peak_bytes'] / 2**30:.2f} | {r['eps_wait_s']:.3f} |")
    lines += ["", "Largest relay models tried (--stash host):", "",
              "| layers | params | host bytes (20 B/param) | step (s) | device peak (GiB) |", "|---:|---:|---:|---:|---:|"]
    for r in result["largest"]:
        if r.get("status") != "ok":
            lines.append(f"| {r['layers']} | {r.get('status')} | | | |")
        else:
            lines.append(f"| {r['layers']} | {r['params'] / 1e9:.2f}B | {r['host_bytes'] / 2**30:.0f} GiB | "
                         f"{r['step_s']:.2f} | {r['device_peak_bytes'] / 2**30:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on whatever device there is")
    ap.add_argument("--peak-tflops", type=float, default=494.7,
                    help="device peak for MFU (default: H100/H200 dense TF32, 494.7)")
    ap.add_argument("--minutes", type=float, default=7.0, help="overall time box")
    ap.add_argument("--out", default="bench/results/gpu")
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        raise SystemExit("gpu_check: no CUDA device visible; run with --smoke to check the script on the CPU")
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 master weights, TF32 matmuls: what fp32 users run
        torch.backends.cudnn.allow_tf32 = True
    start = time.monotonic()
    budget = args.minutes * 60
    corpus = load_corpus(None)
    if args.smoke:
        mem = TrainConfig(d_model=64, heads=4, seq_len=64, batch_size=8, micro_batches=4, progress=False)
        thr = replace(mem, layers=4)
        big = replace(mem, d_model=128)
        depths, counts, steps = [2, 4], [2, 4], 2
    else:
        mem = TrainConfig(d_model=1024, heads=16, seq_len=1024, batch_size=16, micro_batches=4, progress=False)
        thr = replace(mem, layers=24, d_model=2048, heads=16, batch_size=16, micro_batches=4)
        big = replace(mem, d_model=8192, heads=64, seq_len=1024, batch_size=8, micro_batches=4)  # 0.8B/layer
        depths, counts, steps = [4, 8, 16, 32], [1, 2, 4, 6], 5
    device = torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu"
    result = {"device": device, "torch": torch.__version__, "mode": "smoke" if args.smoke else "full",
              "peak_tflops": args.peak_tflops}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result.update(memory=[], throughput=[], largest=[])

    def save() -> None:  # after every section: a lease that ends early still returns something
        result["seconds"] = time.monotonic() - start
        (out / "gpu_check.json").write_text(json.dumps(result, indent=2) + "\n")

    result["memory"] = memory_vs_depth(mem, corpus, depths, start + 0.30 * budget)
    save()
    result["throughput"] = throughput(thr, corpus, args.peak_tflops, steps, start + 0.75 * budget)
    save()
    result["largest"] = largest(big, corpus, counts, start + budget)
    save()
    table = markdown(result)
    (out / "gpu_check.md").write_text(table)
    print("\n" + table)


if __name__ == "__main__":
    main()
