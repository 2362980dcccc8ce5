"""The largest LoRA base this machine trains: ``l2l plan --fit --lora-rank R`` against AdamW's fit, then
that base trained for a few steps here.

1. ``l2l plan --fit`` twice at the same shape options (``--d-model``, ``--heads``, the batch), once
   for a full fine-tune with AdamW and once with ``--lora-rank R``: the parameter counts each names.
2. A Llama model directory with as many parameters as the LoRA fit names, in bf16, random weights
   (only the bytes matter): the built-in GPT's blocks of ``12 d^2`` parameters are Llama blocks with
   ``intermediate_size = 8 d / 3``, and the byte vocabulary. A base this size does not fit in memory
   twice, so it is not built as a model and saved: its tensors -- the names and shapes
   ``from_config`` on the meta device gives -- are drawn one at a time and written into
   safetensors shards with an index, as ``save_pretrained`` lays them out.
3. ``l2l plan --model DIR --lora-rank R`` and ``l2l train --model DIR --lora-rank R --steps N`` on it,
   in fresh processes; the run's summary gives its host peak, beside the plan's.

    python bench/lora_fit.py [--d-model 2048] [--heads 16] [--rank 16] [--steps 3] [--out DIR]

The output is JSON; docs/lora.md keeps the figures. It writes a checkpoint of about 2 bytes a
parameter of the fit (20 GiB on this project's 23 GiB machine): give --out a disk with room.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def fit(shape: list[str], *extra: str) -> dict:
    r = subprocess.run([sys.executable, "-m", "l2l", "plan", "--fit", *shape, "--json", *extra],
                       capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"l2l plan --fit failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout)


def write_llama(root: Path, blocks: int, d_model: int, heads: int, seq_len: int) -> tuple[Path, int]:
    """A bf16 Llama of ``blocks`` GPT-sized blocks over bytes in ``root/base``, written shard by shard
    with l2l's own export writer (``l2l.export.write_model_dir``; its config from ``root/config``),
    and its parameter count."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig
    from l2l.export import SHARD_BYTES, plan_shards, write_model_dir
    config = LlamaConfig(vocab_size=256, hidden_size=d_model, intermediate_size=8 * d_model // 3,
                         num_hidden_layers=blocks, num_attention_heads=heads, num_key_value_heads=heads,
                         max_position_embeddings=max(seq_len, 128), tie_word_embeddings=False)
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in AutoModelForCausalLM.from_config(config).named_parameters()}
    config.save_pretrained(root / "config")
    names = list(shapes)
    gen = torch.Generator().manual_seed(0)

    def drawn(members: list[int]):
        for k in members:
            name = names[k]
            yield name, torch.ones(shapes[name]) if name.endswith("norm.weight") else \
                torch.randn(shapes[name], generator=gen) * 0.02

    base = root / "base"
    base.mkdir(parents=True, exist_ok=True)
    shards = plan_shards([2 * shapes[n].numel() for n in names], SHARD_BYTES)
    write_model_dir(base, root / "config", "bf16", [drawn(m) for m in shards])
    return base, sum(s.numel() for s in shapes.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=None, help="where the base and the run go (default: a temporary directory)")
    args = ap.parse_args()
    shape = ["--d-model", str(args.d_model), "--heads", str(args.heads), "--seq-len", str(args.seq_len),
             "--batch-size", "1", "--micro-batches", "1"]
    adamw, lora = fit(shape), fit(shape, "--lora-rank", str(args.rank))
    root = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="l2l-lora-fit-"))
    base, params = write_llama(root, lora["layers"], args.d_model, args.heads, args.seq_len)
    run_args = ["--model", str(base), "--lora-rank", str(args.rank), "--seq-len", str(args.seq_len),
                "--batch-size", "1", "--micro-batches", "1"]
    plan = subprocess.run([sys.executable, "-m", "l2l", "plan", *run_args, "--json", "--no-calibrate",
                           "--eps-rate", "1e8", "--flops", "1e10"], capture_output=True, text=True)
    if plan.returncode:
        sys.exit(f"l2l plan failed: {plan.stderr[-2000:]}")
    run = root / "run"
    r = subprocess.run([sys.executable, "-m", "l2l", "train", *run_args, "--steps", str(args.steps),
                        "--eval-batches", "1", "--no-plot", "--no-progress", "--plan", "off", "--out", str(run)],
                       capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"l2l train failed:\n{r.stderr[-3000:]}")
    summary = json.loads((run / "summary.json").read_text())
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    print(json.dumps({
        "adamw_fit_params": adamw["params"], "lora_fit_params": lora["params"],
        "ratio": round(lora["params"] / adamw["params"], 2), "lora_fit_layers": lora["layers"],
        "lora_fit_host_bytes": lora["host_bytes"], "host_limit_bytes": lora["host_limit_bytes"],
        "base_params": params, "planned_host_bytes": json.loads(plan.stdout)["prediction"]["host_total_bytes"],
        "host_peak_bytes": summary["host_peak_bytes"], "steps": args.steps, "losses": losses,
        "adapter_params": summary["params"]}, indent=2))


if __name__ == "__main__":
    main()
