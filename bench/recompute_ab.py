"""Backward with recompute, three ways: torch checkpoint, recompute-then-backward, the relay's.

Times forward + backward through N GPT blocks, alternating between:
  checkpoint  torch.utils.checkpoint (non-reentrant; stops recomputing early
              once backward has every saved tensor it needs)
  recompute   per block: forward without grad, then recompute y = block(x)
              with grad and y.backward(g) -- the relay before its early stop
  relay       per block: forward recording the graph without saved tensors,
              then the early-stopping recompute and backward of
              l2l/relay/recompute.py -- what the relay does now
The gap between the first two is the early stop (README, "Measured figures").

    python bench/recompute_ab.py [--layers 8] [--d-model 256] [--batch 16] [--seq 128] [--rounds 14]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils.checkpoint import checkpoint

from l2l.models import ModelConfig, build_stack
from l2l.relay.binding import WeightBinding
from l2l.relay.recompute import Recorder, WeightSinks


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
    blocks = [layer.module for layer in build_stack(cfg, 0, materialize=True).layers[1:-1]]
    x0 = torch.randn(args.batch, args.seq, args.d_model)
    g0 = torch.randn_like(x0)

    def clear() -> None:
        for b in blocks:
            for p in b.parameters():
                p.grad = None

    def with_checkpoint() -> float:
        clear()
        t0 = time.perf_counter()
        y = x0.detach().requires_grad_()
        for b in blocks:
            y = checkpoint(b, y, use_reentrant=False)
        y.backward(g0)
        return time.perf_counter() - t0

    def recompute_then_backward() -> float:
        clear()
        t0 = time.perf_counter()
        xs = [x0]
        with torch.no_grad():
            for b in blocks:
                xs.append(b(xs[-1]))
        g = g0
        for k in range(len(blocks) - 1, -1, -1):
            x = xs[k].detach().requires_grad_()
            blocks[k](x).backward(g)
            g = x.grad
        return time.perf_counter() - t0

    # the relay's way needs parameter-less modules and flat gradient buffers
    twins = [build_stack(cfg, 0, materialize=True).layers[1 + i].module for i in range(len(blocks))]
    weights = [{n: p.detach() for n, p in b.named_parameters()} for b in blocks]
    bindings = [WeightBinding(t, torch.device("cpu")) for t in twins]
    grads = [{n: torch.zeros_like(w) for n, w in ws.items()} for ws in weights]
    recorder = Recorder(torch.device("cpu"))

    def relay() -> float:
        for gs in grads:
            for t in gs.values():
                t.zero_()
        t0 = time.perf_counter()
        xs, recs, sinks = [x0], [], []
        for binding, ws in zip(bindings, weights):
            sinks.append(WeightSinks())
            with binding.bound(recorder.tap_weights(ws, sinks[-1])) as module:
                y, rec = recorder.forward(module, xs[-1])
            xs.append(y)
            recs.append(rec)
        g = g0
        for k in range(len(blocks) - 1, -1, -1):
            sinks[k].grads = grads[k]
            with bindings[k].bound(recorder.leaves(weights[k])) as module:
                x = recorder.leaf(xs[k])
                g = recs[k].backward(lambda: module(x), g)
        return time.perf_counter() - t0

    runs = {"checkpoint": with_checkpoint, "recompute": recompute_then_backward, "relay": relay}
    times = {name: [] for name in runs}
    for i in range(args.rounds):
        for name, fn in runs.items():
            t = fn()
            if i >= 3:
                times[name].append(t)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    print(f"{args.layers} blocks d{args.d_model}, batch {args.batch}x{args.seq}, {torch.get_num_threads()} threads, "
          f"forward + backward: checkpoint {med['checkpoint']:.4f} s, recompute-then-backward "
          f"{med['recompute']:.4f} s ({med['recompute'] / med['checkpoint']:.3f}x), relay {med['relay']:.4f} s "
          f"({med['relay'] / med['checkpoint']:.3f}x)")


if __name__ == "__main__":
    main()
