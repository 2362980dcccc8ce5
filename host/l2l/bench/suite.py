"""``l2l bench suite``: the performance suite in one command.

(a) EPS update throughput of every backend beside the measured memory roofline
(``l2l bench eps``); (b) relay step time against ``plain --checkpointing`` and
``plain`` across depths and micro-batch counts, with the planner's prediction
for each (``l2l bench relay``); (c) device memory against depth and micro-batch
count, with and without ``--stash host`` (``l2l bench memory``). Writes each
part's JSON and Markdown plus ``suite.json`` and ``suite.md``, which start
with the headline figures. The GPU part, ``bench/gpu_check.py``, runs on its
own on a CUDA machine.
"""
from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch

from ..options import Parser
from .eps import main_row, markdown as eps_markdown, run_eps_bench_result
from .memory import run_memory_bench
from .output import regenerate_section
from .relay import run_relay_bench


def _parser() -> Parser:
    p = Parser(prog="l2l bench suite", description=__doc__)
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks the suite runs, measures nothing useful")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--results", default=None,
                   help=f"Markdown file whose suite section (between {BEGIN} and {END}) is regenerated "
                        "(default: docs/results.md when it exists here; not with --quick; '' for none)")
    return p


BEGIN = "<!-- l2l bench suite: begin -->"
END = "<!-- l2l bench suite: end -->"


def results_block(text: str, when: str, machine: str) -> str:
    """The suite's Markdown as a section of the results file: headings demoted two levels."""
    body = "\n".join("##" + line if line.startswith("#") else line for line in text.splitlines())
    return f"Last run: {when}, {machine}.\n\n" + body


def _sizes(quick: bool) -> dict[str, list[str]]:
    if quick:
        return {"eps": ["--numel", "65536", "--repeats", "2", "--warmup", "1", "--no-deepspeed"],
                "relay": ["--layers", "2", "--micro-batches", "1", "4", "--d-model", "32", "--heads", "2",
                          "--seq-len", "16", "--batch-size", "4", "--steps", "2", "--warmup", "1"],
                "memory": ["--layers", "2", "4", "--micro-batch-counts", "2", "4", "--d-model", "32",
                           "--heads", "2", "--seq-len", "16"]}
    # batch 128: at M = 8 a micro-batch is still 16 sequences (2,048 tokens), the regime
    # L2L is for (many micro-batches of a size the device runs efficiently); smaller
    # ones cost any engine, which the same-M baseline column shows (README)
    return {"eps": [], "relay": ["--layers", "2", "4", "8", "--micro-batches", "1", "4", "8",
                                 "--batch-size", "128"], "memory": []}


def headline(eps: dict, relay: list[dict], memory: dict) -> dict:
    """The figures the project's goals are stated in."""
    opencl = main_row(eps, "opencl") or {}  # at the most threads measured
    at_m4 = [r for r in relay if r["micro_batches"] >= 4]
    errors = [abs(r["prediction_error"]) for r in relay if "prediction_error" in r]
    return {
        "eps_opencl_roofline_fraction": opencl.get("roofline_fraction_same_round"),
        "eps_opencl_roofline_fraction_by_state": [  # the host's bandwidth states (bench_eps.bandwidth_states)
            {"roofline_gb_s": st["roofline_gb_s"], "fraction": st["fractions"].get(opencl.get("id"))}
            for st in eps.get("bandwidth_states", [])],
        "eps_opencl_vs_torch_fused": opencl.get("vs_torch_fused"),
        "l2l_vs_plain_ckpt_worst_at_m4_plus": max((r["ratio_vs_plain_ckpt"] for r in at_m4), default=None),
        "l2l_vs_plain_ckpt_best_at_m4_plus": min((r["ratio_vs_plain_ckpt"] for r in at_m4), default=None),
        "l2l_vs_plain_ckpt_same_m_worst": max((r["ratio_vs_plain_ckpt_same_m"] for r in relay), default=None),
        "eps_wait_share_worst": max(r["eps_wait_share"] for r in relay),
        "planner_error_worst": max(errors) if errors else None,
        "planner_error_mean": sum(errors) / len(errors) if errors else None,
        "memory_spread": memory["spread"],
    }


def _fmt(x, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def _by_state(states: list[dict]) -> str:
    """' (76–82 GB/s: 79%; 139–150 GB/s: 73%)' when the host's bandwidth changed state."""
    if len(states) < 2:
        return ""
    return " (" + "; ".join(f"{st['roofline_gb_s'][0]:.0f}–{st['roofline_gb_s'][1]:.0f} GB/s: "
                            f"{_fmt(st['fraction'], '.0%')}" for st in states) + ")"


def markdown(head: dict, parts: dict[str, str], seconds: float) -> str:
    spread = head["memory_spread"]
    lines = [
        f"# l2l performance suite ({seconds / 60:.1f} min)", "",
        "| figure | value |", "|---|---:|",
        f"| OpenCL EPS, share of the memory roofline (same round) | {_fmt(head['eps_opencl_roofline_fraction'], '.0%')}"
        f"{_by_state(head['eps_opencl_roofline_fraction_by_state'])} |",
        f"| OpenCL EPS vs torch fused AdamW (+ reduce + cast) | {_fmt(head['eps_opencl_vs_torch_fused'], '.2f')}x |",
        f"| l2l / plain+ckpt at M >= 4, best .. worst | {_fmt(head['l2l_vs_plain_ckpt_best_at_m4_plus'], '.3f')} .. "
        f"{_fmt(head['l2l_vs_plain_ckpt_worst_at_m4_plus'], '.3f')} |",
        f"| l2l / plain+ckpt at the same M (gradient accumulation), worst | "
        f"{_fmt(head['l2l_vs_plain_ckpt_same_m_worst'], '.3f')} |",
        f"| relay waiting on the EPS, worst share of a step | {head['eps_wait_share_worst']:.1%} |",
        f"| planner step-time error, mean / worst | {_fmt(head['planner_error_mean'], '.1%')} / "
        f"{_fmt(head['planner_error_worst'], '.1%')} |",
        f"| device peak spread over depth, stash device / host | {spread['depth/device']:.1%} / {spread['depth/host']:.1%} |",
        f"| device peak spread over M (fixed micro-batch), stash device / host | "
        f"{spread['micro_batches/device']:.1%} / {spread['micro_batches/host']:.1%} |",
        "",
    ]
    for title, table in parts.items():
        lines += [f"## {title}", "", table.strip(), ""]
    return "\n".join(lines)


def run_suite(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    sizes = _sizes(args.quick)
    out = ["--out", args.out]
    t0 = time.perf_counter()
    eps = run_eps_bench_result(sizes["eps"] + out)
    relay = run_relay_bench(sizes["relay"] + out)
    memory = run_memory_bench(sizes["memory"] + out)
    seconds = time.perf_counter() - t0
    head = headline(eps, relay, memory)
    folder = Path(args.out)
    (folder / "suite.json").write_text(json.dumps({"headline": head, "eps": eps, "relay": relay,
                                                   "memory": memory, "seconds": seconds}, indent=2) + "\n")
    parts = {"(a) EPS throughput": eps_markdown(eps),
             "(b) step time": (folder / "relay_vs_plain.md").read_text(),
             "(c) device memory": (folder / "bench_memory.md").read_text()}
    text = markdown(head, parts, seconds)
    (folder / "suite.md").write_text(text)
    print("\n" + text.split("\n## ")[0])
    print(f"written: {folder / 'suite.md'}, {folder / 'suite.json'}")
    results = args.results
    if results is None:
        results = "" if args.quick or not Path("docs/results.md").exists() else "docs/results.md"
    if results:
        when = time.strftime("%Y-%m-%d %H:%M %Z")
        machine = f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}"
        regenerate_section(Path(results), results_block(text, when, machine), begin=BEGIN, end=END)
        print(f"regenerated the suite section of {results}")
    return 0
