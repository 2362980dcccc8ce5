"""The tables of docs/scale-out.md: ``l2l plan --machines R --devices K`` on Llama shapes.

Writes config-only Llama directories (7B: Llama-2; 70B and 405B: Llama-3.1, grouped-query
attention) to a temporary folder and plans each row with the planner ``l2l plan`` runs
(:func:`l2l.planner.predict`; every rate given, so nothing is measured and the tables are
the same on any machine). Each row's exact ``l2l plan`` command is in the JSON it writes.

    python bench/scale_out.py [--host-gbs 400] [--eps-share 0.5] [--out bench/results] [--results docs/scale-out.md]

The inputs are stated at the top of this file and in docs/scale-out.md, which says which
of them were measured on the project's machine.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import replace
from pathlib import Path

from l2l.bench.eps import _eps_bytes
from l2l.bench.output import regenerate_section
from l2l.config import TrainConfig
from l2l.planner.model import RUNTIME_BYTES, Machines, Rates, predict

BEGIN = "<!-- bench/scale_out.py: begin -->"
END = "<!-- bench/scale_out.py: end -->"

# Llama shapes (public configs); only what LlamaConfig needs to build the stack on the meta device
SHAPES = {
    "7B": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=32, vocab_size=32000, rope_theta=10000.0),
    "70B": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
    "405B": dict(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126, num_attention_heads=128,
                 num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
}
SETUPS = [("7B", 1, 1), ("7B", 1, 8), ("70B", 2, 8), ("70B", 4, 8), ("405B", 8, 8), ("405B", 16, 8)]
NETWORK_GBITS = (100, 400)       # each machine's link, each way (stated)

SEQ_LEN = 4096
BATCH = 1024                     # sequences: 4,194,304 tokens a step, one sequence a micro-batch
GPU_FLOPS = 6e14                 # a layer's bf16 matmuls on an H100/H200-class GPU (stated: ~60% of 989 TFLOP/s)
GPU_LINK_GBS = 50                # host<->GPU, PCIe Gen5 x16, each way (stated)
GPU_BYTES = 141e9                # H200 (stated); an H100's 80 GB is noted where it matters
HOST_TIB = (1, 2)                # host memory a machine, the fits columns (stated)


def eps_bytes_per_element(contributions: int) -> float:
    """Bytes the OpenCL EPS moves a parameter with ``contributions`` bf16 gradient rows and a
    bf16 copy, as ``l2l bench eps`` counts them: ``4 C + 26`` (the rows read twice)."""
    return _eps_bytes("opencl", contributions, 2, 2)[0]


def eps_rate(contributions: int, host_gbs: float, share: float) -> float:
    """Elements/s of a machine's EPS: memory-bound, so ``share`` of the host's bandwidth over the
    bytes an element moves. A sharded owner folds every worker's raw rows: R * K of them."""
    return share * host_gbs * 1e9 / eps_bytes_per_element(contributions)


def write_shapes(root: Path) -> dict[str, Path]:
    dirs = {}
    for name, shape in SHAPES.items():
        d = root / f"llama-{name.lower()}"
        d.mkdir(parents=True, exist_ok=True)
        config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "max_position_embeddings": 8192,
                  "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "silu", **shape}
        (d / "config.json").write_text(json.dumps(config, indent=1) + "\n")
        dirs[name] = d
    return dirs


def command(name: str, cfg: TrainConfig, machines: int, gbits: float | None, rate: float) -> str:
    """The ``l2l plan`` line that prints this row (the model directory as this script writes it)."""
    flags = [f"--model llama-{name.lower()}/ --init random", f"--seq-len {cfg.seq_len}",
             f"--batch-size {cfg.batch_size}", f"--micro-batches {cfg.micro_batches}", "--precision bf16",
             f"--devices {cfg.devices}", f"--stash {cfg.stash}", "--eps opencl"]
    if machines > 1:
        flags.append(f"--machines {machines}" + (f" --network-gbps {gbits / 8:g}" if gbits else ""))
    flags.append(f"--flops {GPU_FLOPS:g} --link-gbps {GPU_LINK_GBS:g} --eps-rate {rate:.3g}")
    return "l2l plan " + " ".join(flags)


def _plan(base: TrainConfig, batch: int, rates: Rates, machines: Machines) -> tuple[TrainConfig, object]:
    """``batch`` sequences with the stash on the GPU if it fits there, else in host memory."""
    for stash in ("device", "host"):
        cfg = replace(base, batch_size=batch, micro_batches=batch, stash=stash)
        p = predict(cfg, rates, machines=machines)
        if p.device_total_bytes <= GPU_BYTES:
            break
    return cfg, p


def plan_setup(name: str, model: Path, r: int, k: int, host_gbs: float, share: float) -> list[dict]:
    """One setup, at each stated link: the largest batch up to 4M tokens (halving) whose machine
    fits the larger stated host memory, and the largest that fits each stated size."""
    rate = float(f"{eps_rate(r * k, host_gbs, share):.3g}")
    rates = Rates(flops_per_s=GPU_FLOPS, link_bytes_per_s=GPU_LINK_GBS * 1e9, eps_elems_per_s=rate,
                  device="cuda", runtime_bytes=RUNTIME_BYTES)
    base = TrainConfig(model=str(model), init="random", seq_len=SEQ_LEN, precision="bf16", devices=k, eps="opencl",
                       device="cuda")
    free = Machines(r, None, "sharded")  # memory does not depend on the network
    largest = {}
    batch = BATCH
    while batch >= r * k and len(largest) < len(HOST_TIB):
        _, p = _plan(base, batch, rates, free)
        for tib in HOST_TIB:
            if tib not in largest and p.host_total_bytes <= tib * 2**40 and p.device_total_bytes <= GPU_BYTES:
                largest[tib] = batch
        batch //= 2
    batch = largest.get(max(HOST_TIB), r * k)
    rows = []
    for gbits in (NETWORK_GBITS if r > 1 else (None,)):
        machines = Machines(r, None if gbits is None else gbits / 8 * 1e9, "sharded")
        cfg, p = _plan(base, batch, rates, machines)
        rows.append({"model": name, "machines": r, "devices": k, "network_gbits": gbits, "eps_rate": rate,
                     "batch": batch, "tokens": batch * SEQ_LEN, "stash": cfg.stash,
                     "largest_batch": {f"{t}TiB": largest.get(t) for t in HOST_TIB},
                     "command": command(name, cfg, r, gbits, rate), "prediction": p.to_dict()})
    return rows


def _gib(n: float) -> str:
    return f"{n / 2**30:,.0f}"


def _tokens(batch: int | None) -> str:
    return "none" if batch is None else f"{batch * SEQ_LEN / 2**20:g}M"


def tables(rows: list[dict], host_gbs: float, share: float) -> str:
    fit = ["| model | R × K | tokens a step | stash | GPU GiB | host GiB a machine | EPS state | stash | "
           "gathered copies | rest | most tokens that fit " + " / ".join(f"{t} TiB" for t in HOST_TIB) + " |",
           "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    time = ["| model | R × K | link | tokens | step s | tokens/s | TFLOP/s a GPU | compute s | EPS busy s "
            "(update + exchange) | EPS exposed s | gathers s | gathers exposed s | link exposed s |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        p = row["prediction"]
        setup = f"{row['model']} | {row['machines']} × {row['devices']}"
        if row["network_gbits"] in (None, NETWORK_GBITS[0]):  # memory: one row a setup
            host = p["host_total_bytes"]
            rest = host - p["host_eps_bytes"] - p["host_stash_bytes"] - p["host_gather_bytes"]
            most = " / ".join(_tokens(b) for b in row["largest_batch"].values())
            fit.append(f"| {setup} | {_tokens(row['batch'])} | {row['stash']} | {_gib(p['device_total_bytes'])} | "
                       f"{_gib(host)} | {_gib(p['host_eps_bytes'])} | {_gib(p['host_stash_bytes'])} | "
                       f"{_gib(p['host_gather_bytes'])} | {_gib(rest)} | {most} |")
        link = f"{row['network_gbits']} Gb/s" if row["network_gbits"] else "—"
        gpu = p["achieved_flops_per_s"] / row["devices"] / 1e12
        update = p["eps_update_s"] - p["collective_s"]
        time.append(f"| {setup} | {link} | {_tokens(row['batch'])} | {p['step_s']:,.0f} | {p['tokens_per_s']:,.0f} | "
                    f"{gpu:,.0f} | {p['compute_s']:,.0f} | {update:,.0f} + {p['collective_s']:,.0f} | "
                    f"{p['eps_exposed_s']:,.1f} | {p['gather_s']:,.1f} | {p['gather_exposed_s']:,.1f} | "
                    f"{p['transfer_exposed_s']:,.1f} |")
    rates = ", ".join(f"{c}: {eps_rate(c, host_gbs, share) / 1e9:.2g}"
                      for c in sorted({r["machines"] * r["devices"] for r in rows}))
    head = (f"Generated by `python bench/scale_out.py --host-gbs {host_gbs:g} --eps-share {share:g}`: "
            f"seq {SEQ_LEN}, bf16, one sequence a micro-batch; GPU {GPU_FLOPS / 1e12:g} TFLOP/s, "
            f"{GPU_BYTES / 1e9:g} GB, {GPU_LINK_GBS} GB/s to the host; the EPS's G elements/s at R × K "
            f"contributions: {rates}.")
    return "\n".join([head, "", "**What fits** (GiB; host memory is each machine's peak)", "", *fit, "",
                      "**Where the time goes** (seconds a step, at the tokens that fit "
                      f"{max(HOST_TIB)} TiB)", "", *time])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host-gbs", type=float, default=400.0, help="a machine's host memory bandwidth, GB/s (stated)")
    ap.add_argument("--eps-share", type=float, default=0.5,
                    help="the EPS's share of that bandwidth (measured here: l2l bench eps, the OpenCL EPS)")
    ap.add_argument("--out", default="bench/results", help="folder for scale_out.json")
    ap.add_argument("--results", default="docs/scale-out.md",
                    help=f"Markdown file whose section between {BEGIN} and {END} is regenerated ('' for none)")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        dirs = write_shapes(Path(tmp))
        for name, r, k in SETUPS:
            for row in plan_setup(name, dirs[name], r, k, args.host_gbs, args.eps_share):
                rows.append(row)
                print(row["command"], flush=True)
    for row in rows:
        row["prediction"].pop("layers_detail", None)
        row["prediction"]["config"]["model"] = f"llama-{row['model'].lower()}/"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "scale_out.json").write_text(json.dumps(rows, indent=1) + "\n")
    text = tables(rows, args.host_gbs, args.eps_share)
    print(text)
    if args.results:
        regenerate_section(Path(args.results), text, begin=BEGIN, end=END)


if __name__ == "__main__":
    main()
