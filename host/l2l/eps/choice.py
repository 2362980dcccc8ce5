"""Which EPS backend a run gets: ``--eps auto`` resolved on this host.

Auto takes the fastest EPS that runs on the host's CPU: the OpenCL EPS on an OpenCL
CPU device when one is listed (PoCL: 80-110% of the memory roofline), else the NumPy
EPS on every core. Never a GPU (the training's own, whose memory and time the relay
needs) and never an FPGA or other accelerator: those run the EPS only when named
(``--eps opencl --cl-device ...`` or ``--cl-binary``). Every backend gives the same
bits (docs/eps-numerics.md), so the choice changes speed, never the trajectory.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..errors import UserError
from . import make_backend
from .backend import EpsBackend
from .opencl_backend import OpenCLBackend, cpu_device
from .threads import available_cpus

AUTO = "auto"


@dataclass(frozen=True)
class EpsChoice:
    """A backend by name with its constructor options, and why it was chosen."""

    asked: str  # what the run asked for: auto or a backend's name
    name: str
    options: dict = field(default_factory=dict)
    why: str = "named by --eps"
    target: str = ""  # under auto: the device it found, before anything is built (``l2l info``)

    def record(self, backend: EpsBackend) -> dict:
        """What summary.json keeps of the choice, with what the built backend runs on."""
        return {"asked": self.asked, "backend": self.name, "runs_on": backend.describe(), "why": self.why}

    def line(self, backend: EpsBackend) -> str:
        """The run's first lines: which EPS, on what, and why."""
        how = f"--eps {self.asked}" if self.asked != AUTO else f"--eps auto: {self.why}"
        return f"EPS {self.name} on {backend.describe()} ({how})"

    def gpu_advice(self, device_type: str) -> str | None:
        """One line when a GPU trains against the NumPy EPS that auto fell back to: there the
        EPS sets the step's pace (on an H200 box, 5% MFU against 40% with the OpenCL EPS)."""
        if device_type != "cuda" or self.asked != AUTO or self.name != "numpy":
            return None
        return ("on a GPU the EPS sets the step's pace and the NumPy EPS is ~10x slower than the OpenCL "
                "EPS on the same cores (an H200 box: 5% MFU against 40%, docs/results.md \"On a GPU\"): "
                "pip install 'l2l[opencl]'")


def choose(asked: str, *, cl_platform: str | None = None, cl_device: str | None = None,
           cl_binary: str | None = None, threads: int | None = None, optimizer: str = "adamw",
           board_url: str | None = None) -> EpsChoice:
    """The backend ``asked`` names, or for ``auto`` this host's fastest CPU EPS that runs
    ``optimizer``."""
    if asked != AUTO:
        options = {"threads": threads} if asked == "numpy" else {}
        if asked == "opencl":
            options = {"platform": cl_platform, "device": cl_device, "binary": cl_binary, "threads": threads}
        if asked == "board":
            options = {"url": board_url}
        return EpsChoice(asked, asked, options)
    found, what = cpu_device()
    if found is not None and optimizer not in OpenCLBackend.optimizers:
        found, what = None, f"the OpenCL EPS does not run {optimizer}"
    if found is None:
        cpus = threads or available_cpus()
        return EpsChoice(AUTO, "numpy", {"threads": threads}, f"{what}: the NumPy EPS on every core",
                         f"{cpus} CPU thread{'s' if cpus > 1 else ''}")
    platform, device = found
    return EpsChoice(AUTO, "opencl", {"platform": str(platform), "device": str(device), "threads": threads},
                     "an OpenCL CPU device is listed: the fastest EPS on this host's CPU", what)


def build(choice: EpsChoice) -> tuple[EpsBackend, EpsChoice]:
    """The backend of ``choice``, and the choice it is. Under auto, an OpenCL EPS that fails to
    start (a broken platform, a kernel the runtime cannot build) leaves the NumPy EPS, said in
    the choice's why; a backend named by --eps fails with its own error."""
    try:
        return make_backend(choice.name, **choice.options), choice
    except Exception as exc:  # noqa: BLE001 -- auto falls back; the reason is kept
        if choice.asked != AUTO or choice.name == "numpy":
            raise
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        fallback = replace(choice, name="numpy", options={"threads": choice.options.get("threads")},
                           why=f"the OpenCL EPS on the CPU did not start ({reason}); the NumPy EPS on every core")
        return make_backend("numpy", **fallback.options), fallback


def check_threads(asked: str, threads: int | None) -> None:
    """``--eps-threads`` applies to the CPU's backends (numpy, opencl, auto); one line otherwise."""
    if threads is not None and threads < 1:
        raise UserError(f"--eps-threads must be at least 1 (got {threads})")
    if threads is not None and asked not in (AUTO, "numpy", "opencl"):
        raise UserError(f"--eps-threads applies to --eps auto, numpy or opencl, not {asked}")
