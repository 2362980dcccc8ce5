"""Where the EPS kernel sources are: ``eps.cl`` (OpenCL) and ``eps_kernels.cpp`` (HLS).

Each source has one home in the repository, ``fpga/opencl/`` and ``hls/``; nothing is
copied into ``host/``. How an l2l finds them (the decision, and why):

* Installed from a wheel (``pip install .``): pyproject.toml maps the packages
  ``l2l.kernels.opencl`` and ``l2l.kernels.hls`` onto ``fpga/opencl`` and ``hls``
  (setuptools ``package-dir``) and ships the sources as their package data, so the wheel
  holds them at ``l2l/kernels/opencl/eps.cl`` and ``l2l/kernels/hls/eps_kernels.cpp``. They
  are found as resources of this package, ``importlib.resources.files("l2l.kernels")``.
* Run from a source checkout (``pip install -e .``, or ``PYTHONPATH=host``): this package
  is ``host/l2l/kernels`` of the checkout, which holds no copies; the sources are taken
  from their home in the same checkout, three directories up.

The packaged copy is looked for first; the checkout is the fallback. The mapped packages
themselves are never imported: under an editable install (setuptools 84) they cannot be
(``import l2l.kernels.opencl`` fails, the directories having no ``__init__.py``), and
setuptools' editable finder on ``sys.meta_path`` points at *the installed* checkout, which
is not this one when another checkout is put first on ``PYTHONPATH`` (git worktrees sharing
a venv). Looking next to this file always gives the sources of the code that is running.
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import NamedTuple

# kind -> (file name, its home in the repository, relative to the root)
SOURCES: dict[str, tuple[str, tuple[str, ...]]] = {
    "opencl": ("eps.cl", ("fpga", "opencl")),
    "hls": ("eps_kernels.cpp", ("hls",)),
    "rtl": ("l2l_eps_kernel.v", ("fpga", "rtl")),  # its directory holds every module (--eps rtl)
}
_CHECKOUT_ROOT = Path(__file__).resolve().parents[3]  # host/l2l/kernels -> the repository root


class KernelSource(NamedTuple):
    path: Path  # where the source is, or (not found) where the installed copy belongs
    origin: str  # "package data", "source checkout", or "not found"

    @property
    def found(self) -> bool:
        return self.origin != "not found"


def _packaged(kind: str, name: str) -> Path | None:
    try:
        candidate = resources.files(__name__) / kind / name
    except (ModuleNotFoundError, TypeError):
        return None
    if not candidate.is_file():
        return None
    return Path(str(candidate))  # an installed wheel is unpacked: a file on disk


def locate(kind: str) -> KernelSource:
    """The source of ``kind`` ("opencl", "hls" or "rtl") and where it was found."""
    name, home = SOURCES[kind]
    packaged = _packaged(kind, name)
    if packaged is not None:
        return KernelSource(packaged, "package data")
    checkout = _CHECKOUT_ROOT.joinpath(*home, name)
    if checkout.is_file():
        return KernelSource(checkout, "source checkout")
    return KernelSource(Path(__file__).resolve().parent / kind / name, "not found")


def source_path(kind: str) -> Path:
    """Path of the source of ``kind``; when it is missing, where an installed copy belongs."""
    return locate(kind).path


def describe(kind: str) -> str:
    """One line for ``l2l info``: the source's path and where it came from."""
    name, home = SOURCES[kind]
    found = locate(kind)
    if not found.found:
        return (f"{name} not found: neither package data ({found.path}) nor a source checkout "
                f"({_CHECKOUT_ROOT.joinpath(*home, name)}); reinstall l2l")
    return f"{found.path} ({found.origin})"
