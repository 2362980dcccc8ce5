"""Backward with recompute: torch checkpoint vs the relay's per-layer recompute.

Times backward through N GPT blocks two ways, alternating between them:
  checkpoint  torch.utils.checkpoint (non-reentrant; stops recomputing early
              once backward has every saved tensor it needs)
  relay       per block: recompute y = block(x) with grad, then y.backward(g),
              as the relay does
Explains most of the relay's cost over `plain --checkpointing` (README,
"Measured figures").

    python bench/recompute_ab.py [--layers 8] [--d-model 256] [--batch 16] [--seq 128] [--rounds 14]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils.checkpoint import checkpoint

from l2l.models import ModelConfig, build_stack


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=14)
    args = ap.parse_args()

    cfg = ModelConfig(layers=args.layers, d_model=args.d_model, heads=args.heads, seq_len=args.seq)
    blocks = [layer.module for layer in build_stack(cfg, 0).layers[1:-1]]
    x0 = torch.randn(args.batch, args.seq, args.d_model)
    g0 = torch.randn_like(x0)

    def clear() -> None:
        for b in blocks:
            for p in b.parameters():
                p.grad = None

    def with_checkpoint() -> float:
        clear()
        y = x0.detach().requires_grad_()
        for b in blocks:
            y = checkpoint(b, y, use_reentrant=False)
        t0 = time.perf_counter()
        y.backward(g0)
        return time.perf_counter() - t0

    def per_layer() -> float:
        clear()
        xs = [x0]
        with torch.no_grad():
            for b in blocks:
                xs.append(b(xs[-1]))
        t0 = time.perf_counter()
        g = g0
        for k in range(len(blocks) - 1, -1, -1):
            x = xs[k].detach().requires_grad_()
            blocks[k](x).backward(g)
            g = x.grad
        return time.perf_counter() - t0

    runs = {"checkpoint": with_checkpoint, "relay": per_layer}
    times = {name: [] for name in runs}
    for i in range(args.rounds):
        for name, fn in runs.items():
            t = fn()
            if i >= 3:
                times[name].append(t)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    print(f"{args.layers} blocks d{args.d_model}, batch {args.batch}x{args.seq}, {torch.get_num_threads()} threads: "
          f"backward with checkpoint {med['checkpoint']:.4f} s, per-layer recompute {med['relay']:.4f} s "
          f"({med['relay'] / med['checkpoint']:.3f}x)")


if __name__ == "__main__":
    main()
