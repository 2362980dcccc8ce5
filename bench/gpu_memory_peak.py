"""What is live on the GPU at the relay's device peak, against what the planner counts.

    python bench/gpu_memory_peak.py --out bench/results/gpu-peak     # on a CUDA machine (~1 min)

For each configuration: one warm-up step, then one step under PyTorch's allocator history
(``torch.cuda.memory._record_memory_history``). The trace is replayed to the moment the
allocated bytes peak, and the blocks live then are grouped by the innermost l2l source line
that allocated them. Beside it: the planner's device figure and its parts (weights, gradients,
stash and boundaries, activations). Written to ``memory_peak.json`` and ``memory_peak.md``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check as gc_  # noqa: E402  -- the device machine's rates and the run helpers

from l2l.build import build_engine, resolve_device  # noqa: E402
from l2l.config import TrainConfig  # noqa: E402
from l2l.data import BatchSampler, load_corpus  # noqa: E402
from l2l.models import build_stack, family  # noqa: E402
from l2l.planner import predict  # noqa: E402

MiB = 1 << 20


def configs(smoke: bool) -> dict[str, TrainConfig]:
    base = dict(progress=False, devices=1, precision="bf16", stash="host")
    if smoke:
        return {"smoke d64": TrainConfig(d_model=64, heads=4, layers=2, seq_len=64, batch_size=8, micro_batches=4,
                                         **base)}
    return {"d1024 L4 b16 M4 (gpu_check memory row)": TrainConfig(d_model=1024, heads=16, layers=4, seq_len=1024,
                                                                   batch_size=16, micro_batches=4, **base),
            "d4096 L2 b8 M4": TrainConfig(d_model=4096, heads=32, layers=2, seq_len=1024, batch_size=8,
                                          micro_batches=4, **base)}


def frame_key(frames: list[dict]) -> str:
    """The l2l frames (file:line function, at most three, in the trace's order), else the first frame."""
    ours = [f"{f['filename'].split('/l2l/', 1)[1]}:{f.get('line')} {f.get('name')}"
            for f in frames if "/l2l/" in f.get("filename", "")]
    if ours:
        return " < ".join(ours[:3])
    if frames:
        f = frames[0]
        return f"{f.get('filename', '?').rsplit('/', 1)[-1]}:{f.get('line')} {f.get('name')}"
    return "(no frames)"


def live_at_peak(trace: list[dict]) -> tuple[int, dict[str, list[int]]]:
    """Replay an allocator trace: the peak of allocated bytes over the trace (counting from the
    blocks alive when it began as unknown) and the blocks alive at that moment, by frame key."""
    live: dict[int, tuple[int, str]] = {}
    cur = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for e in trace:
        action, addr, size = e.get("action"), e.get("addr"), e.get("size", 0)
        if action == "alloc":
            live[addr] = (size, frame_key(e.get("frames", [])))
            cur += size
            if cur > peak:
                peak, at_peak = cur, dict(live)
        elif action == "free_requested" and addr in live:
            cur -= live.pop(addr)[0]
    groups: dict[str, list[int]] = defaultdict(list)
    for size, key in at_peak.values():
        groups[key].append(size)
    return peak, groups


def run(name: str, cfg: TrainConfig, corpus, device: torch.device, cuda: bool) -> dict:
    stack = build_stack(cfg.model_config(), cfg.seed)
    engine = build_engine(cfg, stack, device)
    sampler = BatchSampler(corpus.train, cfg.seq_len, cfg.batch_size, family(cfg.model).objective, seed=0)
    p = predict(replace(cfg, engine="l2l"), gc_.Machine().rates(cfg))
    out = {"config": name, "planned_device_bytes": p.device_total_bytes, "planned_ledger_bytes": p.device_ledger_bytes,
           "planned_weights_bytes": p.device_weight_bytes, "planned_activation_bytes": p.activation_bytes,
           "layer_params": p.layer_params}
    try:
        engine.train_step(sampler.batch(0), 0)
        engine.eps.synchronize()
        if cuda:
            torch.cuda.synchronize(device)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
        t = time.perf_counter()
        result = engine.train_step(sampler.batch(1), 1)
        engine.eps.synchronize()
        out["step_s"] = time.perf_counter() - t
        out["ledger_weight_peak"] = result.device_weight_peak_bytes
        out["result_device_peak"] = result.device_peak_bytes
        if cuda:
            torch.cuda.synchronize(device)
            out["max_allocated"] = torch.cuda.max_memory_allocated(device)
            out["allocated_before_step"] = base
            snap = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            trace = snap["device_traces"][device.index or 0]
            peak, groups = live_at_peak(trace)
            out["trace_peak_above_base"] = peak
            out["live_at_peak"] = sorted(([k, sum(v), len(v), max(v)] for k, v in groups.items()),
                                         key=lambda r: -r[1])
            # blocks alive before the step began (the trace does not show their allocation)
            out["live_before_step"] = base
    finally:
        engine.close()
        del engine, stack
        if cuda:
            torch.cuda.empty_cache()
    return out


def markdown(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        lines += [f"### {r['config']}", "",
                  f"- planned device {r['planned_device_bytes'] / MiB:.1f} MiB (ledger {r['planned_ledger_bytes'] / MiB:.1f}, "
                  f"weights+grads {r['planned_weights_bytes'] / MiB:.1f}, activations {r['planned_activation_bytes'] / MiB:.1f}); "
                  f"layers' params {r['layer_params']}",
                  f"- measured: max_allocated {r.get('max_allocated', 0) / MiB:.1f} MiB, of which alive before the step "
                  f"{r.get('allocated_before_step', 0) / MiB:.1f} MiB; trace peak above that "
                  f"{r.get('trace_peak_above_base', 0) / MiB:.1f} MiB; ledger weight peak "
                  f"{(r.get('ledger_weight_peak') or 0) / MiB:.1f} MiB; step {r.get('step_s', 0):.2f} s", "",
                  "| allocated at (innermost l2l frame) | MiB live at peak | blocks | largest MiB |", "|---|---|---|---|"]
        for key, total, n, big in r.get("live_at_peak", [])[:30]:
            lines.append(f"| `{key}` | {total / MiB:.1f} | {n} | {big / MiB:.1f} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="a tiny model on whatever device there is")
    ap.add_argument("--out", default="bench/results/gpu-peak")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        raise SystemExit("gpu_memory_peak: no CUDA device visible; --smoke runs the script on the CPU")
    device = resolve_device("auto")
    corpus = load_corpus(None)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, cfg in configs(args.smoke).items():
        try:
            rows.append(run(name, cfg, corpus, device, cuda))
        except Exception as exc:  # noqa: BLE001 -- recorded; the next configuration still runs
            rows.append({"config": name, "error": f"{type(exc).__name__}: {exc}"[:400], "planned_device_bytes": 0,
                         "planned_ledger_bytes": 0, "planned_weights_bytes": 0, "planned_activation_bytes": 0,
                         "layer_params": []})
        (out / "memory_peak.json").write_text(json.dumps(rows, indent=1) + "\n")
        (out / "memory_peak.md").write_text(markdown(rows))
        print(markdown(rows[-1:]), rows[-1].get("error", ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
