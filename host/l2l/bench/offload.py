"""``l2l bench offload``: the EPS disk tier (``--eps-offload``) under a memory limit.

The question: does a run whose EPS state is at least 1.5x the memory it may use train,
with a small resident set, and does the tier stream at the disk's bandwidth? This box
cannot hold such a state against its whole RAM (24 GiB), so the run gets a memory limit
instead: ``l2l train`` runs in a memory cgroup of its own (v2 ``memory.max`` or v1
``memory.limit_in_bytes``; we are root) and "the machine's RAM" of the criterion is that
limit, the state / 1.5. The default large model is deep and narrow (128 x d512 fp32,
~400M params, ~4.8 GB of state; ``--eps-offload-copies``, so the device copies are on
disk too): the tier's windows hold a few entries, so the deeper the model, the smaller
their share of the state.

Measured: the peak resident set (the run's ``summary.json`` ``host_peak_bytes``,
``VmHWM`` read from ``/proc`` while it runs, and each step's ``host_rss_bytes``); the
tier's own ledger of its I/O (``summary.json`` ``eps_disk``: bytes and seconds inside its
reads and writes), whose rate per direction is held against the disk's own sequential
bandwidth (the planner's probe, :func:`~l2l.planner.disk.probe_disk`, in the same
directory, before and after the run) and whose bytes are checked against the kernel's
count (``/proc/PID/io``, sampled every 0.1 s); and the step time of a small model with and
without the tier.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ..config import TrainConfig
from ..errors import UserError
from ..options import Parser
from ..planner.disk import entry_numels, probe_disk, size_of, state_file_bytes, sustained_bytes, traffic
from .output import add_output_options, publish

BEGIN = "<!-- l2l bench offload: begin -->"
END = "<!-- l2l bench offload: end -->"
RAM_RATIO = 1.5             # the state is this many times the memory limit


def _parser() -> Parser:
    p = Parser(prog="l2l bench offload", description=__doc__)
    p.add_argument("--quick", action="store_true", help="tiny models, no limit: checks the benchmark runs")
    p.add_argument("--dir", default=None, help="directory for the state files (default: a new one in the temp dir)")
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=128, help="blocks of the large model")
    p.add_argument("--precision", default="fp32", help="of the large model")
    p.add_argument("--copies-in-memory", action="store_true",
                   help="the large model's device copies stay in memory (default: --eps-offload-copies)")
    p.add_argument("--window", type=int, default=2, help="--eps-offload-window of the large model")
    p.add_argument("--small", default="8x1024", help="LAYERSxD_MODEL timed with and without the tier")
    p.add_argument("--probe-gib", type=float, default=None,
                   help="bytes each way of the disk probe, GiB (default: 2, at most a tenth of the free space, "
                        "at least 1; --quick: 64 MiB)")
    add_output_options(p, BEGIN, END)
    return p


# ---------------------------------------------------------------- a memory limit

class MemoryLimit:
    """A memory cgroup with a limit, for one child process: v2 where the unified hierarchy
    has the memory controller, else v1. ``how`` says which; ``None`` limit: none made."""

    def __init__(self, limit: int | None, name: str | None = None) -> None:
        self.limit, self.path, self.how, self.procs = limit, None, "none", None
        if limit is None:
            return
        name = name or f"l2l-bench-offload-{os.getpid()}"
        v2 = Path("/sys/fs/cgroup")
        v1 = Path("/sys/fs/cgroup/memory")
        errors = []
        for root, limit_file, how in ((v2, "memory.max", "cgroup v2 memory.max"),
                                      (v1, "memory.limit_in_bytes", "cgroup v1 memory.limit_in_bytes")):
            if how.startswith("cgroup v2") and "memory" not in _read(root / "cgroup.controllers"):
                errors.append("cgroup v2: no memory controller")
                continue
            try:
                path = root / name
                path.mkdir()
                (path / limit_file).write_text(str(limit))
                if how.startswith("cgroup v1"):  # no swap to hide in (none here, but say so)
                    try:
                        (path / "memory.memsw.limit_in_bytes").write_text(str(limit))
                    except OSError:
                        pass
            except OSError as exc:
                errors.append(f"{how}: {exc}")
                continue
            self.path, self.how, self.procs = path, how, path / "cgroup.procs"
            return
        raise UserError("l2l bench: cannot make a memory limit (" + "; ".join(errors) + ")")

    def enter(self) -> None:
        """In the child, before exec: join the cgroup."""
        if self.procs is not None:
            self.procs.write_text(str(os.getpid()))

    def peak(self) -> int | None:
        if self.path is None:
            return None
        for f in ("memory.peak", "memory.max_usage_in_bytes"):
            text = _read(self.path / f)
            if text.strip().isdigit():
                return int(text)
        return None

    def oom_kills(self) -> int | None:
        for name in ("memory.events", "memory.oom_control"):  # v2; v1 (kernels since 4.13)
            text = _read(self.path / name) if self.path else ""
            for line in text.splitlines():
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
        text = _read(self.path / "memory.failcnt") if self.path else ""
        return int(text) if text.strip().isdigit() else None

    def close(self) -> None:
        if self.path is not None:
            try:
                self.path.rmdir()
            except OSError:
                pass


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


# ---------------------------------------------------------------- one run

def _watch(pid: int, samples: list, stop: threading.Event) -> None:
    """Every 0.1 s: (time, read_bytes, write_bytes, VmHWM) of the process, from /proc."""
    while not stop.is_set():
        io, status = _read(Path(f"/proc/{pid}/io")), _read(Path(f"/proc/{pid}/status"))
        if io:
            f = dict(line.split(": ") for line in io.splitlines() if ": " in line)
            hwm = next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmHWM")), 0)
            samples.append((time.perf_counter(), int(f["read_bytes"]), int(f["write_bytes"]), hwm))
        stop.wait(0.1)


def train(layers: int, d_model: int, heads: int, precision: str, out: Path, *, offload: Path | None = None,
          window: int = 2, copies: bool = False, limit: MemoryLimit | None = None, steps: int = 2) -> dict:
    """One ``l2l train`` in a process of its own; its summary, step times and /proc samples."""
    cmd = [sys.executable, "-m", "l2l", "train", "--layers", str(layers), "--d-model", str(d_model),
           "--heads", str(heads), "--seq-len", "64", "--batch-size", "2", "--micro-batches", "1",
           "--steps", str(steps), "--save-every", "0", "--eval-batches", "1", "--precision", precision,
           "--plan", "off", "--no-plot", "--out", str(out)]
    if offload is not None:
        cmd += ["--eps-offload", str(offload), "--eps-offload-window", str(window)]
        cmd += ["--eps-offload-copies"] if copies else []
    samples: list = []
    stop = threading.Event()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=limit.enter if limit is not None and limit.procs else None)
    watcher = threading.Thread(target=_watch, args=(proc.pid, samples, stop), daemon=True)
    watcher.start()
    _, err = proc.communicate()
    stop.set()
    watcher.join()
    if proc.returncode:
        last = (err.strip().splitlines() or ["no message"])[-1]
        raise UserError(f"l2l bench offload: {layers} x d{d_model} (exit {proc.returncode}) failed: {last}")
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    step_times = [r["step_time_s"] for r in records if "step_time_s" in r]
    step_rss = [r.get("host_rss_bytes") for r in records if "step_time_s" in r]
    out_bytes = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())  # the checkpoint, logs, summary
    return {"summary": summary, "step_times": step_times, "step_rss": step_rss, "samples": samples,
            "records": [r for r in records if "step_time_s" in r],
            "out_bytes": out_bytes, "run_s": time.perf_counter() - t0}


def busiest(samples: list, column: int, span: float = 1.0) -> float:
    """The highest rate of a /proc counter over any ``span`` seconds of the samples, bytes/s."""
    best = 0.0
    j = 0
    for i in range(len(samples)):
        while samples[i][0] - samples[j][0] > span:
            j += 1
        dt = samples[i][0] - samples[j][0]
        if dt >= 0.5 * span:
            best = max(best, (samples[i][column] - samples[j][column]) / dt)
    return best


# ---------------------------------------------------------------- the benchmark

def steps_ledger(summary: dict, records: list[dict]) -> dict | None:
    """The tier's ledger over the steps only: the last step's record's totals less the totals
    before the first step (``summary.json`` ``eps_disk_at_start``); the build before and the
    final checkpoint after are left out. Per step: each record less the one before. Neither
    waits for pending writes, so a boundary may move a few entries' writes by one step."""
    start = summary.get("eps_disk_at_start")
    marks = [r.get("eps_disk") for r in records]
    if start is None or not marks or any(m is None for m in marks):
        return None
    keys = ("read_bytes", "read_s", "write_bytes", "write_s")
    diff = lambda a, b: {k: a[k] - b[k] for k in keys}  # noqa: E731
    return {"total": diff(marks[-1], start),
            "per_step": [diff(m, p) for m, p in zip(marks, [start, *marks[:-1]])]}


def run_offload_bench(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    small_layers, small_d = (int(x) for x in args.small.lower().split("x"))
    if args.quick:
        args.layers, args.d_model, args.heads, small_layers, small_d = 4, 64, 4, 2, 64
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="l2l-bench-offload-"))
    eps_dir, runs = base / "eps", base / "runs"
    free = shutil.disk_usage(base if base.exists() else base.parent).free
    layers = args.layers
    copies = not args.copies_in_memory
    cfg = TrainConfig(layers=layers, d_model=args.d_model, heads=args.heads, seq_len=64)
    numels = entry_numels(cfg)
    state = state_file_bytes(numels)
    read_step, write_step = traffic(numels, args.precision if copies else None)
    if 2 * write_step > free:  # the state and copy files, then the final checkpoint (p, m, v) beside them
        raise UserError(f"l2l bench offload: {layers} x d{args.d_model} needs about {size_of(2 * write_step)} free "
                        f"there, {size_of(free)} is free")
    limit_bytes = None if args.quick else int(state / RAM_RATIO)
    t_start = time.perf_counter()
    try:
        probe_bytes = (int(args.probe_gib * 2**30) if args.probe_gib else
                       64 << 20 if args.quick else sustained_bytes(base if base.exists() else base.parent))
        print(f"probing the disk in {eps_dir} ({size_of(probe_bytes)} each way) ...", flush=True)
        disk = probe_disk(eps_dir, probe_bytes, mixed=True)
        print(f"disk: read {disk.read_bytes_per_s / 1e9:.2f} GB/s, write {disk.write_bytes_per_s / 1e9:.2f} GB/s, "
              f"both at once {disk.mixed_bytes_per_s / 1e9:.2f} GB/s", flush=True)
        limit = MemoryLimit(limit_bytes)
        try:
            print(f"{layers} x d{args.d_model} ({sum(numels.values()) / 1e6:.0f}M params, state "
                  f"{size_of(state)}) under {limit.how}"
                  + (f" = {size_of(limit_bytes)}" if limit_bytes else "") + " ...", flush=True)
            big = train(layers, args.d_model, args.heads, args.precision, runs / "big", offload=eps_dir,
                        window=args.window, copies=copies, limit=limit)
            cgroup_peak, ooms = limit.peak(), limit.oom_kills()
        finally:
            limit.close()
        print("probing the disk again ...", flush=True)
        disk_after = probe_disk(eps_dir, probe_bytes, mixed=True)
        shutil.rmtree(eps_dir, ignore_errors=True)
        shutil.rmtree(runs / "big", ignore_errors=True)
        times = {}
        for name, offload, on_disk in (("in memory", None, False), ("disk tier", eps_dir, False),
                                       ("disk tier + copies", eps_dir, True)):
            print(f"{small_layers} x d{small_d} fp32, {name} ...", flush=True)
            r = train(small_layers, small_d, max(1, small_d // 64), "fp32", runs / name.replace(" ", "-"),
                      offload=offload, copies=on_disk, steps=4)
            times[name] = statistics.median(r["step_times"][1:] or r["step_times"])
            shutil.rmtree(eps_dir, ignore_errors=True)
            shutil.rmtree(runs / name.replace(" ", "-"), ignore_errors=True)
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    s, samples = big["summary"], big["samples"]
    led = s["eps_disk"]
    steps_led = steps_ledger(s, big["records"])
    # the disk's own sequential rates: the better of the two probes (before and after the run)
    disk_read = max(disk.read_bytes_per_s, disk_after.read_bytes_per_s)
    disk_write = max(disk.write_bytes_per_s, disk_after.write_bytes_per_s)
    steps = len(big["step_times"])
    step_s = statistics.median(big["step_times"][1:] or big["step_times"])
    per_step = read_step + write_step
    # the share of the step the disk would be busy moving that traffic at the probe's rates
    busy = (read_step / disk_read + write_step / disk_write) / step_s
    row = {
        "layers": layers, "d_model": args.d_model, "heads": args.heads, "precision": args.precision,
        "window": args.window, "copies_on_disk": copies, "params": s["params"], "state_file_bytes": state, "limit_bytes": limit_bytes,
        "limit_how": limit.how, "cgroup_peak_bytes": cgroup_peak, "cgroup_oom_or_failcnt": ooms,
        "host_peak_bytes": s["host_peak_bytes"], "vmhwm_bytes": max((x[3] for x in samples), default=None),
        "host_runtime_bytes": s["host_runtime_bytes"], "steps": steps, "step_times": big["step_times"],
        "step_s": step_s, "read_bytes": samples[-1][1] if samples else None,
        "write_bytes": samples[-1][2] if samples else None, "traffic_per_step_bytes": per_step,
        "read_per_step_bytes": read_step, "write_per_step_bytes": write_step,
        "tier_bytes_per_s": per_step / step_s, "disk_busy_share": busy,
        "busiest_read_bytes_per_s": busiest(samples, 1), "busiest_write_bytes_per_s": busiest(samples, 2),
        "disk_read_bytes_per_s": disk_read, "disk_write_bytes_per_s": disk_write,
        "probes": [[disk.read_bytes_per_s, disk.write_bytes_per_s],
                   [disk_after.read_bytes_per_s, disk_after.write_bytes_per_s]],
        "probes_mixed": [disk.mixed_bytes_per_s, disk_after.mixed_bytes_per_s],
        "probes_write_calls": [disk.write_call_bytes_per_s, disk_after.write_call_bytes_per_s],
        "timeline_steps": led.get("timeline_steps"), "timeline": led.get("timeline"),
        "ledger": led, "ledger_read_bytes_per_s": led["read_bytes"] / led["read_s"] if led["read_s"] else None,
        "ledger_write_bytes_per_s": led["write_bytes"] / led["write_s"] if led["write_s"] else None,
        "steps_ledger": steps_led,
        "probe_bytes": disk.probe_bytes,
        "probe_spread": [{op: p.spread(op) for op in ("read", "write")} for p in (disk, disk_after)],
        "probe_chunks": [list(disk.chunks), list(disk_after.chunks)],
        "out_bytes": big["out_bytes"], "step_rss": big["step_rss"],
        "disk_direct": disk.direct, "small": f"{small_layers} x d{small_d}", "small_step_s": times,
        "run_s": big["run_s"], "bench_s": time.perf_counter() - t_start,
    }
    command = " ".join(["l2l bench offload", *argv])
    table = markdown(row, command)
    publish(args, "offload", {"command": command, "row": row}, table, begin=BEGIN, end=END)
    return 0


def markdown(r: dict, command: str) -> str:
    g = lambda n: f"{n / 2**30:.2f} GiB" if n is not None else "—"  # noqa: E731
    rate = lambda n: f"{n / 1e9:.2f} GB/s"  # noqa: E731
    small = r["small_step_s"]
    base = small["in memory"]
    limit = (f"{g(r['limit_bytes'])} ({r['limit_how']}); state / limit = "
             f"{r['state_file_bytes'] / r['limit_bytes']:.2f}" if r["limit_bytes"] else "none (--quick)")
    copies = "`--eps-offload-copies` (the device copies on disk too)" if r["copies_on_disk"] else \
        "the device copies in memory"
    led = r["ledger"]
    share = lambda a, b: f"{a / b:.0%}" if a is not None and b else "—"  # noqa: E731
    proc_w = r["write_bytes"]
    rss = ", ".join(g(x) for x in r["step_rss"] if x is not None) or "—"
    (r0, w0), (r1, w1) = r["probes"]
    sl = (r.get("steps_ledger") or {}).get("total")
    st_read = sl["read_bytes"] / sl["read_s"] if sl and sl["read_s"] else None
    st_write = sl["write_bytes"] / sl["write_s"] if sl and sl["write_s"] else None

    tl = r.get("timeline_steps")
    m0, m1 = r.get("probes_mixed") or (None, None)
    c0, c1 = r.get("probes_write_calls") or (None, None)

    def disk_time(rd: float, wr: float) -> float | None:
        """The seconds the disk would need for the steps' bytes at the probe's own rates."""
        return tl["read"]["bytes"] / rd + tl["write"]["bytes"] / wr if tl and rd and wr else None
    opt = lambda x: rate(x) if x else "—"  # noqa: E731
    timeline_rows = [] if not tl else [
        f"| the steps' tier calls in time (`timeline_steps`, state and copy files): any under way / reads and "
        f"writes at once, share of the steps' window | {tl['busy_s']:.1f} s / {tl['both_s']:.1f} s of "
        f"{tl['span_s']:.1f} s ({share(tl['busy_s'], tl['span_s'])} / {share(tl['both_s'], tl['span_s'])}) |",
        f"| the same: read alone / beside a write; write alone / beside a read (each direction's bytes over "
        f"its calls' seconds in those spans) | {opt(tl['read']['alone_bytes_per_s'])} / "
        f"{opt(tl['read']['overlapped_bytes_per_s'])}; {opt(tl['write']['alone_bytes_per_s'])} / "
        f"{opt(tl['write']['overlapped_bytes_per_s'])} |",
        "| the same: the calls' own rates, p10 / median / p90: read; write | "
        + "; ".join(" / ".join(opt(tl[op][k]) for k in ("call_rate_p10", "call_rate_median", "call_rate_p90"))
                    for op in ("read", "write")) + " |",
        f"| the same: all the bytes over the time any call was under way; the probe's both-at-once rate before / "
        f"after | {opt(tl['busy_bytes_per_s'])}; {opt(m0)} / {opt(m1)} "
        f"({share(tl['busy_bytes_per_s'], m0)} / {share(tl['busy_bytes_per_s'], m1)}) |",
        f"| **the disk's time for the steps' bytes at the probe's own read and write rates / the time the tier had "
        f"I/O under way (probe before / after)** | **{share(disk_time(r0, w0), tl['busy_s'])} / "
        f"{share(disk_time(r1, w1), tl['busy_s'])}** |",
        f"| **the same, the probe's writes timed as the tier's are (the write call alone, unsynced: "
        f"{opt(c0)} / {opt(c1)}), the stricter reference** | **{share(disk_time(r0, c0), tl['busy_s'])} / "
        f"{share(disk_time(r1, c1), tl['busy_s'])}** |",
    ]

    def spread(k: int, op: str) -> str:
        got = r["probe_spread"][k][op]
        return " / ".join(f"{x / 1e9:.2f}" for x in got) + " GB/s" if got else "—"
    lines = [
        "### The EPS disk tier under a memory limit",
        "",
        f"`{command}`: GPT {r['layers']} x d{r['d_model']}, {r['heads']} heads ({r['params'] / 1e6:.0f}M params), "
        f"{r['precision']}, seq 64, batch 2, {r['steps']} steps, `--plan off`, `--eps-offload-window "
        f"{r['window']}`, {copies}, the final checkpoint written at the end; on the CPU, one `l2l train` in a "
        "memory cgroup of its own. The box has 24 GiB of RAM: the cgroup's limit stands for the machine's RAM "
        f"of the criterion. **The disk's own sequential bandwidth** is the sustained probe "
        f"(`probe_disk`, in the same directory, before and after the run): {g(r['probe_bytes'])} each way through "
        "the tier's own O_DIRECT whole-entry I/O, in entries of 256 MiB, made first, then rewritten in place, each "
        "write timed until an `fdatasync` of its file returns (durable: a virtual disk's host may hold O_DIRECT "
        "writes in its cache; the tier itself does not sync), then read back in the order written, first the one "
        "written longest ago; each direction's figure is its whole transfer (bytes over the sum of the entries' "
        "seconds), with the spread of the entries' own rates. (A 256 MiB probe, `l2l plan`'s quick one, "
        "measured the host's cache on this virtual disk: 0.38 to 3.38 GB/s reads, 2.30 to 4.15 GB/s writes.) "
        "**The tier's throughput** is its own ledger (`summary.json` `eps_disk`): the bytes its reads and writes "
        "moved over the seconds spent inside them, per direction, i.e. how fast the tier streams while it moves "
        "data, not how much of the step it fills (a CPU step is compute-bound: that is the busy share below); "
        "over the whole run (build, steps, evaluations, the final checkpoint's reads) and over the steps only "
        "(each step's `metrics.jsonl` record carries the ledger's totals, `eps_disk`, taken without waiting for "
        "pending writes; less `summary.json` `eps_disk_at_start`). The ledger's bytes are checked against the "
        "kernel's count for the process (`/proc/PID/io`: the tier's files are O_DIRECT, so each byte is block "
        "I/O; the run's other writes are `--out`, mainly the checkpoint, which it also reads back once for its "
        "SHA-256: from the disk, as the memory limit evicts it from the page cache). "
        "The tier runs up to four streams at once (the state's read-ahead and write-behind threads, the copies' "
        "two), so each direction's bytes over its own calls' seconds counts the time it shares the disk with the "
        "others as its own. The ledger's log of every call (start and end) says how: the time any call was under "
        "way, reads and writes at once, each direction's rate alone and beside the other, and the fairer figure "
        "(in bold, beside the per-direction ones): the time the disk would need for the steps' bytes read and "
        "written at the probe's own rates, over the time the tier had any I/O under way (100%: the tier moves "
        "its bytes as fast as the disk moves each direction alone). The probe also measures both directions at "
        "once (a third phase: every entry read on one thread while another rewrites them, synced), the reference "
        "for all the tier's bytes over its busy time.",
        "",
        "| figure | value |", "|---|---:|",
        f"| EPS state files (p, m, v; headers, padding) | {g(r['state_file_bytes'])} |",
        f"| memory limit | {limit} |",
        f"| peak resident set: summary `host_peak_bytes` / `VmHWM` seen from /proc | {g(r['host_peak_bytes'])} / "
        f"{g(r['vmhwm_bytes'])} |",
        f"| peak / state | {r['host_peak_bytes'] / r['state_file_bytes']:.0%} (above the idle process "
        f"{g(r['host_runtime_bytes'])}: {(r['host_peak_bytes'] - r['host_runtime_bytes']) / r['state_file_bytes']:.0%}) |",
        f"| resident set after each step (`host_rss_bytes`) | {rss} |",
        f"| cgroup peak (page cache included) / OOM kills or failcnt | {g(r['cgroup_peak_bytes'])} / "
        f"{r['cgroup_oom_or_failcnt']} |",
        f"| step time: each step; median of steps 2.. | {', '.join(f'{t:.1f}' for t in r['step_times'])} s; "
        f"{r['step_s']:.1f} s |",
        f"| tier ledger, whole run: read {g(led['read_bytes'])} in {led['read_s']:.1f} s / written "
        f"{g(led['write_bytes'])} in {led['write_s']:.1f} s | {rate(r['ledger_read_bytes_per_s'])} / "
        f"{rate(r['ledger_write_bytes_per_s'])} |",
        *([f"| tier ledger, the steps only: read {g(sl['read_bytes'])} in {sl['read_s']:.1f} s / written "
           f"{g(sl['write_bytes'])} in {sl['write_s']:.1f} s; read + write seconds / the steps' wall time | "
           f"{rate(st_read)} / {rate(st_write)}; {(sl['read_s'] + sl['write_s']) / sum(r['step_times']):.0%} |"]
          if sl else ["| tier ledger, the steps only | — (no per-step ledger) |"]),
        f"| disk probe, sustained ({g(r['probe_bytes'])} each way, writes until durable), before / after the run: "
        f"read; write | {rate(r0)} / {rate(r1)}; {rate(w0)} / {rate(w1)} |",
        f"| the probe's 256 MiB entries, min / median / max, before; after: read | {spread(0, 'read')}; "
        f"{spread(1, 'read')} |",
        f"| the same: write | {spread(0, 'write')}; {spread(1, 'write')} |",
        f"| **tier throughput / the disk's own (probe before / after), the steps only: read; write** | "
        f"**{share(st_read, r0)} / {share(st_read, r1)}; {share(st_write, w0)} / {share(st_write, w1)}** |",
        f"| the same, the whole run: read; write | "
        f"{share(r['ledger_read_bytes_per_s'], r0)} / {share(r['ledger_read_bytes_per_s'], r1)}; "
        f"{share(r['ledger_write_bytes_per_s'], w0)} / {share(r['ledger_write_bytes_per_s'], w1)} |",
        *timeline_rows,
        f"| cross-check, /proc/PID/io whole run: read vs ledger + `--out`; written vs ledger + `--out` "
        f"({g(r['out_bytes'])}) | {g(r['read_bytes'])} vs {g(led['read_bytes'] + r['out_bytes'])} "
        f"({share(r['read_bytes'], led['read_bytes'] + r['out_bytes'])}); "
        f"{g(proc_w)} vs {g(led['write_bytes'] + r['out_bytes'])} "
        f"({share(proc_w, led['write_bytes'] + r['out_bytes'])}) |",
        f"| tier traffic per step: read / written | {g(r['read_per_step_bytes'])} / {g(r['write_per_step_bytes'])} |",
        f"| the disk's busy share of the step (that traffic at the better probe's rates / step time) | "
        f"{r['disk_busy_share']:.0%} |",
        f"| busiest second of the run (/proc): read / write (share of the better probe) | "
        f"{rate(r['busiest_read_bytes_per_s'])} ({r['busiest_read_bytes_per_s'] / r['disk_read_bytes_per_s']:.0%}) / "
        f"{rate(r['busiest_write_bytes_per_s'])} ({r['busiest_write_bytes_per_s'] / r['disk_write_bytes_per_s']:.0%}) |",
        f"| step time / params, at {2 * 64} tokens a step | {r['step_s'] / r['params'] * 1e9:.0f} ns |",
        f"| {r['small']} fp32 step time: in memory / disk tier / disk tier + copies | {base:.2f} s / "
        f"{small['disk tier']:.2f} s ({small['disk tier'] / base - 1:+.0%}) / {small['disk tier + copies']:.2f} s "
        f"({small['disk tier + copies'] / base - 1:+.0%}) |",
        "",
        f"Whole benchmark: {r['bench_s'] / 60:.1f} min.",
    ]
    return "\n".join(lines) + "\n"
