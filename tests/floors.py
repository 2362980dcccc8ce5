"""The lowest versions ``pyproject.toml`` declares, as pip requirements, for ``make test-oldest``.

Each runtime dependency, the ``hf`` and ``opencl`` extras and the test runner (pytest,
pytest-xdist) is pinned
at its ``>=`` floor, so the venv built from them runs the tests at the low end of every range.
Pins, not a "lowest" resolver: a floor that cannot be installed, or that contradicts another
(transformers' own tokenizers range, say), fails the install instead of being raised quietly.

``python tests/floors.py`` prints the pins, one a line (Python 3.11+: ``tomllib``).
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
TEST_RUNNER = ("pytest", "pytest-xdist")
_FLOOR = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*>=\s*([0-9][^,;\s]*)")


def declared(pyproject: Path = PYPROJECT) -> list[str]:
    """The requirement strings make test-oldest pins: the dependencies, the hf and opencl
    extras, and the test extra's runner."""
    import tomllib
    project = tomllib.loads(pyproject.read_text())["project"]
    extras = project["optional-dependencies"]
    runner = [r for r in extras["test"] if re.split(r"[<>=!~;\s\[]", r, maxsplit=1)[0] in TEST_RUNNER]
    return [*project["dependencies"], *extras["hf"], *extras["opencl"], *runner]


def pin(requirement: str) -> str:
    """``name>=X...`` as ``name==X``; a requirement without a floor has no oldest version."""
    match = _FLOOR.match(requirement)
    if match is None:
        raise ValueError(f"{requirement!r} has no '>=' floor to test at")
    return f"{match[1]}=={match[2]}"


def floors(pyproject: Path = PYPROJECT) -> list[str]:
    """One ``name==floor`` pin per declared requirement, each name once."""
    pins = {}
    for requirement in declared(pyproject):
        name, _, version = pin(requirement).partition("==")
        if pins.setdefault(name.lower(), (name, version))[1] != version:
            raise ValueError(f"{name} is declared with two floors: {pins[name.lower()][1]} and {version}")
    return [f"{name}=={version}" for name, version in pins.values()]


if __name__ == "__main__":
    sys.stdout.write("".join(line + "\n" for line in floors()))
