"""``l2l bench host``: the host memory of whole training runs against the planner's figure.

Each configuration is one ``l2l train`` in a process of its own (model build, the
step-0 evaluation, two steps, a checkpoint after each, the final evaluation), as a
user runs it. The run's ``summary.json`` gives its peak resident set (``VmHWM``), its
resident set as the command started (torch and l2l imported, no model: the idle
process) and the planner's prediction (``--plan quick``: memory needs no
calibration). The table shows bytes per parameter above the idle process, the byte
budget's floor (the optimizer's state, 12 bytes for AdamW and 8 for Lion, + the device
copy's bytes) and the prediction's error.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..eps.contract import OPTIMIZERS
from ..errors import UserError
from ..options import Parser
from .output import publish

SIZES = {"quick": [(2, 64, 4)], "full": [(8, 1024, 16), (16, 1024, 16), (64, 512, 8)]}
BEGIN = "<!-- l2l bench host: begin -->"
END = "<!-- l2l bench host: end -->"


def _parser() -> Parser:
    p = Parser(prog="l2l bench host", description=__doc__)
    p.add_argument("--quick", action="store_true", help="one tiny model: checks the benchmark runs")
    p.add_argument("--precisions", nargs="+", default=["fp32", "bf16"])
    p.add_argument("--stash", nargs="+", default=["device", "host"])
    p.add_argument("--optimizers", nargs="+", default=["adamw", "lion"], choices=list(OPTIMIZERS))
    p.add_argument("--out", default="bench/results")
    p.add_argument("--results", default=None,
                   help=f"Markdown file whose section between {BEGIN} and {END} is regenerated "
                        "(default: docs/results.md when it exists here, not with --quick)")
    return p


def measure(layers: int, d_model: int, heads: int, precision: str, stash: str, workdir: Path,
            optimizer: str = "adamw") -> dict:
    """One ``l2l train`` run's host figures, from its summary."""
    out = workdir / f"L{layers}-d{d_model}-{precision}-{stash}-{optimizer}"
    cmd = [sys.executable, "-m", "l2l", "train", "--layers", str(layers), "--d-model", str(d_model),
           "--heads", str(heads), "--seq-len", "64", "--batch-size", "2", "--micro-batches", "1",
           "--steps", "2", "--save-every", "1", "--eval-batches", "1", "--precision", precision,
           "--stash", stash, "--optimizer", optimizer, "--plan", "quick", "--no-plot", "--out", str(out)]
    t0 = time.perf_counter()
    run = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if run.returncode:
        last = (run.stderr.strip().splitlines() or ["no message"])[-1]
        raise UserError(f"l2l bench host: {layers} x d{d_model} {precision} --stash {stash} --optimizer {optimizer} "
                        f"failed: {last}")
    s = json.loads((out / "summary.json").read_text())
    shutil.rmtree(out)  # its checkpoints: 12 bytes a parameter each, two of them
    peak, idle, params = s["host_peak_bytes"], s["host_runtime_bytes"], s["params"]
    predicted = s["plan"]["predicted_host_bytes"]
    stash_bytes = s.get("host_stash_bytes", 0)
    return {"layers": layers, "d_model": d_model, "precision": precision, "stash": stash, "optimizer": optimizer,
            "params": params,
            "idle_bytes": idle, "peak_bytes": peak, "predicted_bytes": predicted, "host_stash_bytes": stash_bytes,
            "bytes_per_param": (peak - idle) / params,
            "bytes_per_param_without_stash": (peak - idle - stash_bytes) / params,
            "floor_bytes_per_param": s["plan"]["predicted_host_state_bytes"] / params,
            "prediction_error": peak / predicted - 1, "run_s": time.perf_counter() - t0}


def markdown(rows: list[dict], command: str) -> str:
    lines = ["### Whole runs against the byte budget and the plan",
             "",
             f"`{command}`: per row one `l2l train` (build, evaluation, 2 steps of batch 2 x 64 tokens, "
             "a checkpoint after each), GPT on the CPU. *Bytes/param*: peak resident set above the idle "
             "process (torch and l2l imported), per parameter, and the same without the host stash "
             "(`--stash host`: the stashed boundaries, booked by the relay's ledger, reported apart); "
             "*floor*: the EPS's state (p and the optimizer's moments: 12 bytes for AdamW, 8 for Lion) and "
             "device copies (none in fp32 on the CPU, where the masters serve as the copies).",
             "",
             "| model | params | optimizer | precision | stash | idle GiB | peak GiB | bytes/param | without stash "
             "| floor | predicted GiB | error |",
             "|---|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['layers']} x d{r['d_model']} | {r['params'] / 1e6:.1f}M | {r.get('optimizer', 'adamw')} "
                     f"| {r['precision']} | {r['stash']} "
                     f"| {r['idle_bytes'] / 2**30:.2f} | {r['peak_bytes'] / 2**30:.2f} | {r['bytes_per_param']:.2f} "
                     f"| {r['bytes_per_param_without_stash']:.2f} "
                     f"| {r['floor_bytes_per_param']:g} | {r['predicted_bytes'] / 2**30:.2f} "
                     f"| {r['prediction_error']:+.1%} |")
    return "\n".join(lines) + "\n"


def run_host_bench(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    sizes = SIZES["quick" if args.quick else "full"]
    rows = []
    with tempfile.TemporaryDirectory(prefix="l2l-bench-host-") as tmp:
        for layers, d, heads in sizes:
            for precision in args.precisions:
                for stash in args.stash:
                    for optimizer in args.optimizers:
                        rows.append(measure(layers, d, heads, precision, stash, Path(tmp), optimizer))
                        r = rows[-1]
                        print(f"{layers} x d{d} {precision} {stash} {optimizer}: {r['bytes_per_param']:.2f} "
                              f"bytes/param, prediction {r['prediction_error']:+.1%}", flush=True)
    command = " ".join(["l2l bench host", *argv])
    table = markdown(rows, command)
    publish(args, "host", {"command": command, "rows": rows}, table, begin=BEGIN, end=END)
    return 0
