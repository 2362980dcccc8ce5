"""``l2l bench shard``: the EPS sharded across machines, on this box, ranks over loopback.

Three questions, each answered by whole ``l2l train`` runs launched as users launch them
(one process for one machine, ``torchrun`` for several):

- **Memory**: each rank's peak resident set (``VmHWM``, read by every rank from ``/proc`` and
  gathered into ``summary.json``; not a ledger) per parameter at R = 1, 2, 4, against the
  goal ``16.5 / R + 1.5`` bytes (fp32) and against the planner's ``host_total_bytes`` for
  the same run (``l2l plan --machines R``).
- **Capacity**: each rank gets a memory limit L (a cgroup of its own, as ``l2l bench
  offload`` makes; L half-way between the R = 4 rank's peak and one process's): one process
  under L is killed or fails, 4 ranks under L each train the model for 10 steps.
- **Cost**: the step at R = 2 sharded against replicated (``--eps-layout``) on a smaller
  model, the median step of three alternated runs each, and the bytes the sharded run's
  collectives moved a step against the planner's formula.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..errors import UserError
from ..options import Parser
from .offload import MemoryLimit
from .output import add_output_options, publish

BEGIN = "<!-- l2l bench shard: begin -->"
END = "<!-- l2l bench shard: end -->"
RANKS = (1, 2, 4)
CAPACITY_RANKS = 4
CAPACITY_STEPS = 10
COST_ROUNDS, COST_STEPS = 3, 6
CGROUPS_ENV = "L2L_BENCH_CGROUPS"  # the cgroup.procs file of each local rank, ':'-separated


def _parser() -> Parser:
    p = Parser(prog="l2l bench shard", description=__doc__)
    p.add_argument("--quick", action="store_true",
                   help="tiny models, no limit, R = 2 only: checks the benchmark runs")
    p.add_argument("--large", default="24x1024", help="LAYERSxD_MODEL of the memory and capacity runs (fp32)")
    p.add_argument("--small", default="8x512", help="LAYERSxD_MODEL of the cost runs")
    p.add_argument("--steps", type=int, default=3, help="steps of each memory run")
    p.add_argument("--no-capacity", action="store_true", help="skip the capacity runs (the longest part)")
    add_output_options(p, BEGIN, END)
    return p


def _shape(text: str) -> tuple[int, int]:
    try:
        layers, d = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise UserError(f"l2l bench shard: {text!r} is not LAYERSxD_MODEL (e.g. 24x1024)") from None
    return layers, d


def _model(layers: int, d: int, batch: int) -> list[str]:
    return ["--layers", str(layers), "--d-model", str(d), "--heads", str(max(1, d // 64)), "--seq-len", "64",
            "--batch-size", str(batch), "--micro-batches", str(batch)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(ranks: int, model: list[str], out: Path, *, steps: int, extra: list[str] = (),
          limits: list[MemoryLimit] | None = None, timeout: float = 3600) -> dict:
    """One run: ``python -m l2l train`` (one rank) or ``torchrun`` on loopback; its summary and
    step records, or its exit code and last line when it failed."""
    args = ["train", *model, "--steps", str(steps), "--save-every", "0", "--eval-every", "0", "--eval-batches", "1",
            "--plan", "off", "--no-plot", "--no-progress", "--device", "cpu", "--out", str(out), *extra]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # what torchrun sets for each of several ranks
    if limits:
        env[CGROUPS_ENV] = ":".join(str(lim.procs) for lim in limits)
        launch = [sys.executable, "-m", "l2l.bench.cgroup_exec"]
    else:
        launch = [sys.executable]
    if ranks == 1:
        cmd = [*launch, "-m", "l2l", *args]
        if limits:
            env["LOCAL_RANK"] = "0"
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
               "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), "--no-python",
               *launch, "-m", "l2l", *args]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    run_s = time.perf_counter() - t0
    if proc.returncode:
        lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip() and not ln.startswith("W")]
        return {"ok": False, "returncode": proc.returncode, "last_line": (lines or ["no message"])[-1], "run_s": run_s}
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    steps_done = [r for r in records if "step_time_s" in r]
    return {"ok": True, "summary": summary, "step_times": [r["step_time_s"] for r in steps_done],
            "losses": [r["loss"] for r in steps_done], "run_s": run_s}


def plan(ranks: int, model: list[str], layout: str = "sharded") -> dict:
    """The planner's prediction for one rank of the same run (rates given: memory and bytes
    do not depend on them)."""
    cmd = [sys.executable, "-m", "l2l", "plan", *model, "--device", "cpu", "--machines", str(ranks),
           "--eps-layout", layout, "--flops", "1e9", "--eps-rate", "1e8", "--link-gbps", "0", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode:
        raise UserError(f"l2l bench shard: l2l plan failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(proc.stdout)["prediction"]


def peaks(run: dict) -> list[int]:
    s = run["summary"]
    return s.get("machines_host_peak_bytes") or [s["host_peak_bytes"]]


def run_shard_bench(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    (large_l, large_d), (small_l, small_d) = _shape(args.large), _shape(args.small)
    ranks, steps = RANKS, args.steps
    if args.quick:
        (large_l, large_d), (small_l, small_d), ranks, steps = (2, 64), (2, 64), (2,), 2
    large, small = _model(large_l, large_d, 4), _model(small_l, small_d, 8)
    base = Path(tempfile.mkdtemp(prefix="l2l-bench-shard-"))
    t_start = time.perf_counter()
    memory, capacity, cost = [], None, {}
    try:
        for r in ranks:
            print(f"memory: {large_l} x d{large_d} fp32 at R = {r} ...", flush=True)
            run = train(r, large, base / f"mem-{r}", steps=steps)
            if not run["ok"]:
                raise UserError(f"l2l bench shard: the run at R = {r} failed: {run['last_line']}")
            predicted = plan(r, large)["host_total_bytes"]
            params = run["summary"]["params"]
            measured = peaks(run)
            memory.append({"ranks": r, "params": params, "peak_bytes": measured, "predicted_bytes": predicted,
                           "peak_per_param": max(measured) / params, "goal_per_param": 16.5 / r + 1.5,
                           "predicted_error": max(measured) / predicted - 1, "step_times": run["step_times"]})
            shutil.rmtree(base / f"mem-{r}", ignore_errors=True)
        if not args.no_capacity:
            one, many = max(memory[0]["peak_bytes"]), max(memory[-1]["peak_bytes"])
            limit_bytes = None if args.quick else (one + many) // 2
            capacity = {"limit_bytes": limit_bytes, "ranks": ranks[-1] if args.quick else CAPACITY_RANKS}
            for r, key, n in ((1, "one", 2), (capacity["ranks"], "many", CAPACITY_STEPS)):
                limits = [MemoryLimit(limit_bytes, name=f"l2l-bench-shard-{os.getpid()}-{r}-{i}") for i in range(r)] \
                    if limit_bytes else None
                print(f"capacity: {large_l} x d{large_d} at R = {r}"
                      + (f" under {limits[0].how} = {limit_bytes / 2**30:.2f} GiB each" if limits else "") + " ...",
                      flush=True)
                try:
                    run = train(r, large, base / f"cap-{r}", steps=n, limits=limits)
                    kills = [lim.oom_kills() for lim in limits] if limits else []
                finally:
                    for lim in limits or []:
                        lim.close()
                capacity[key] = {"ranks": r, "steps": n, "ok": run["ok"], "oom_kills": kills,
                                 "returncode": run.get("returncode"),
                                 "last_line": run.get("last_line"), "run_s": run["run_s"],
                                 "steps_done": len(run.get("step_times", [])),
                                 "peak_bytes": peaks(run) if run["ok"] else None}
                shutil.rmtree(base / f"cap-{r}", ignore_errors=True)
        # alternated rounds: this box's speed drifts by more than the difference asked about
        for round_ in range(1 if args.quick else COST_ROUNDS):
            for layout in ("sharded", "replicated"):
                print(f"cost: {small_l} x d{small_d} at R = 2, --eps-layout {layout} (round {round_ + 1}) ...",
                      flush=True)
                run = train(2, small, base / f"cost-{layout}", steps=3 if args.quick else COST_STEPS,
                            extra=["--eps-layout", layout])
                shutil.rmtree(base / f"cost-{layout}", ignore_errors=True)
                if not run["ok"]:
                    raise UserError(f"l2l bench shard: the {layout} run failed: {run['last_line']}")
                c = cost.setdefault(layout, {"step_times": [], "losses": [],
                                             "collective_bytes_per_step": run["summary"].get("collective_bytes_per_step")})
                c["step_times"] += run["step_times"][1:]  # the first step of a run warms up
                c["losses"].append(run["losses"])
        for c in cost.values():
            c["step_s"] = statistics.median(c["step_times"])
        cost["planned_bytes"] = plan(2, small)["collective_bytes"]
    finally:
        shutil.rmtree(base, ignore_errors=True)
    result = {"large": f"{large_l}x{large_d}", "small": f"{small_l}x{small_d}", "memory": memory,
              "capacity": capacity, "cost": cost, "bench_s": time.perf_counter() - t_start}
    command = " ".join(["l2l bench shard", *argv])
    publish(args, "shard", {"command": command, **result}, markdown(result, command), begin=BEGIN, end=END)
    return 0


def markdown(r: dict, command: str) -> str:
    gib = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
    lines = [f"### The EPS across machines (`{command}`)", "",
             f"Ranks on this box over loopback, one worker each, CPU, fp32; memory and capacity on "
             f"{r['large']} (LAYERSxD_MODEL), cost on {r['small']}. Peak resident set: each rank's `VmHWM`.", "",
             "| R | params | peak per rank (max) | bytes / param | goal 16.5/R + 1.5 | planner | planner error |",
             "|---|---|---|---|---|---|---|"]
    for m in r["memory"]:
        lines.append(f"| {m['ranks']} | {m['params'] / 1e6:.0f}M | {gib(max(m['peak_bytes']))} | "
                     f"{m['peak_per_param']:.2f} | {m['goal_per_param']:.2f} | {gib(m['predicted_bytes'])} | "
                     f"{m['predicted_error']:+.1%} |")
    cap = r["capacity"]
    if cap:
        lim = gib(cap["limit_bytes"]) if cap["limit_bytes"] else "none (--quick)"
        lines += ["", f"Capacity, each rank under a memory limit of {lim}:", "",
                  "| run | steps asked | result |", "|---|---|---|"]
        for key in ("one", "many"):
            c = cap[key]
            how = "killed (SIGKILL)" if c.get("returncode") in (-9, 137) else f"exit {c.get('returncode')}"
            got = (f"trained ({c['steps_done']} steps, peak {gib(max(c['peak_bytes']))} per rank)" if c["ok"] else
                   f"failed: {how}, OOM kills {c['oom_kills']}: {c.get('last_line')!s}"[:200])
            lines.append(f"| R = {c['ranks']} | {c['steps']} | {got} |")
    c = r["cost"]
    sh, rep = c["sharded"], c["replicated"]
    measured = sh["collective_bytes_per_step"]
    lines += ["", f"Cost at R = 2 ({r['small']}, the median of {len(sh['step_times'])} steps each, runs alternated): "
              f"sharded {sh['step_s']:.2f} s, replicated "
              f"{rep['step_s']:.2f} s: **{sh['step_s'] / rep['step_s']:.2f}x**. Collective bytes a step: "
              f"measured {measured / 1e6:.2f} MB, planner {c['planned_bytes'] / 1e6:.2f} MB "
              f"({measured / c['planned_bytes'] - 1:+.2%}).", ""]
    return "\n".join(lines)
