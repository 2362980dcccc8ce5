"""Host peak of a LoRA run over a large frozen base: bytes a base parameter above the runtime.

Writes Llamas (by default 168M and 271M parameters) in bf16 with ``save_pretrained`` (random weights:
only the bytes matter), then runs ``l2l train --model DIR --lora-rank R`` in a fresh process
for a few tiny steps and reads its summary: ``host_peak_bytes`` (VmHWM, build to summary)
minus ``host_runtime_bytes`` (the process before any model), over the base's parameter count.
The goal (docs/lora.md) is <= 3 bytes a base parameter plus the adapters' state: the bf16
store is 2, and a layer's fp32 compute copy and the activations are the rest.

    python bench/lora_host_memory.py [--layers 8 16] [--hidden 1024] [--rank 16] [--precision fp32] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def write_base(directory: Path, layers: int, hidden: int, vocab: int) -> int:
    """A bf16 Llama saved to ``directory``; returns its parameter count."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64,
                         max_position_embeddings=256, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, nargs="+", default=[8, 16],
                    help="depths to run; with two or more, the bytes each added base parameter costs too")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--precision", default="fp32", help="what the device computes in (fp32: each layer's frozen "
                    "weights are cast to an fp32 copy on the way; bf16: the store's own tensors, no copy)")
    ap.add_argument("--out", default=None, help="where the model and the run go (default: a temporary directory)")
    args = ap.parse_args()
    root = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="l2l-lora-mem-"))
    results = [measure(root / f"layers-{n}", n, args) for n in args.layers]
    out = {"runs": results}
    if len(results) > 1:  # the slope: what each base parameter costs, the constant costs apart
        a, b = results[0], results[-1]
        out["marginal_bytes_per_base_param"] = round(
            (b["above_runtime_bytes"] - a["above_runtime_bytes"]) / (b["base_params"] - a["base_params"]), 3)
    print(json.dumps(out, indent=2))


def measure(root: Path, layers: int, args) -> dict:
    base = root / "base"
    params = write_base(base, layers, args.hidden, args.vocab)
    run = root / "run"
    r = subprocess.run([sys.executable, "-m", "l2l", "train", "--model", str(base), "--lora-rank", str(args.rank),
                        "--steps", str(args.steps), "--batch-size", "2", "--micro-batches", "1", "--seq-len", "32",
                        "--eval-batches", "1", "--no-plot", "--no-progress", "--plan", "off", "--out", str(run),
                        "--precision", args.precision],
                       capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"l2l train failed:\n{r.stderr[-3000:]}")
    summary = json.loads((run / "summary.json").read_text())
    adapters = summary["params"]  # what the EPS trains
    above = summary["host_peak_bytes"] - summary["host_runtime_bytes"]
    state = adapters * 12  # fp32 master and AdamW's two moments (the CPU shares the master as the copy)
    return {"layers": layers, "hidden": args.hidden, "precision": args.precision, "eps": summary["eps"]["backend"],
            "base_params": params, "adapter_params": adapters,
            "host_peak_bytes": summary["host_peak_bytes"], "host_runtime_bytes": summary["host_runtime_bytes"],
            "above_runtime_bytes": above, "adapter_state_bytes": state,
            "bytes_per_base_param": round((above - state) / params, 3), "goal": 3.0}


if __name__ == "__main__":
    main()
