"""`pip install .` (a wheel, not editable) gives an l2l with every EPS backend this machine has.

The repository is cloned (so untracked files stay out; uncommitted edits of tracked files
are applied on top, so that the test checks the working tree), installed into a fresh venv,
and run from a directory outside any checkout. The venv borrows this interpreter's
packages (torch, pyopencl, setuptools...) through a ``.pth`` line that puts them *after*
its own site-packages: nothing is downloaded, and the l2l that runs is the installed copy,
which ``l2l info`` proves by naming kernel sources inside the venv.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--steps", "1", "--layers", "2", "--d-model", "32", "--heads", "2", "--seq-len", "32",
        "--batch-size", "8", "--micro-batches", "2", "--eval-batches", "1", "--no-plot", "--no-progress"]


def _run(cmd, cwd, env, timeout=300) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc


LEFT_OUT = shutil.ignore_patterns(".git", ".venv", "runs", "results", "build", "*.egg-info", "__pycache__",
                                  ".pytest_cache")


def _clone(dest: Path) -> Path:
    """A clean clone of this checkout with its uncommitted changes to tracked files (outside
    a git checkout, e.g. an unpacked archive: a copy of the tree without its build products)."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        shutil.copytree(ROOT, dest, ignore=LEFT_OUT)
        return dest
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(ROOT), str(dest)], check=True)
    diff = subprocess.run(["git", "-C", str(ROOT), "diff", "--binary", "HEAD"], check=True,
                          capture_output=True).stdout
    if diff:
        subprocess.run(["git", "-C", str(dest), "apply", "--whitespace=nowarn", "-"], input=diff, check=True)
    return dest


def _setuptools_ok() -> bool:
    """Whether this interpreter's setuptools meets pyproject's build requirement (then no
    build isolation, which would fetch setuptools from PyPI)."""
    try:
        import setuptools
    except ImportError:
        return False
    return int(setuptools.__version__.split(".")[0]) >= 77


def test_wheel_install_runs_every_backend(tmp_path):
    src = _clone(tmp_path / "src")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    purelib = Path(subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  check=True, capture_output=True, text=True).stdout.strip())
    (purelib / "zz_borrowed.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}  # no PYTHONPATH=host
    # PoCL keeps its compiled kernels under XDG_CACHE_HOME too: pointed at the cache the other
    # tests filled, the OpenCL run does not compile the same program again
    pocl_cache = os.environ.get("POCL_CACHE_DIR") or \
        str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pocl" / "kcache")
    env.update(PYTHONNOUSERSITE="1", OMP_NUM_THREADS="1", XDG_CACHE_HOME=str(tmp_path / "cache"),
               PIP_DISABLE_PIP_VERSION_CHECK="1", POCL_CACHE_DIR=pocl_cache)
    isolation = ["--no-build-isolation"] if _setuptools_ok() else []
    _run([py, "-m", "pip", "install", "-q", "--no-deps", *isolation, src], cwd=tmp_path, env=env)

    installed = purelib / "l2l"
    assert installed.is_dir() and not list(purelib.glob("__editable__*")), "not a regular install"
    shipped = {p.relative_to(src / "host").as_posix() for p in (src / "host" / "l2l").rglob("*.py")}
    missing = sorted(p for p in shipped if not (purelib / p).is_file())
    assert not missing, f"not in the wheel (add their package to pyproject's packages): {missing}"

    work = tmp_path / "elsewhere"
    work.mkdir()
    l2l = venv / "bin" / "l2l"
    info = _run([l2l, "info"], cwd=work, env=env).stdout
    sources = {}
    for line in info.splitlines():
        if line.startswith("source "):
            kind, rest = line.split()[1], line.split(None, 2)[2]
            sources[kind] = rest
    assert set(sources) == {"opencl", "hls", "rtl"}, info
    assert sources["opencl"] == f"{installed / 'kernels' / 'opencl' / 'eps.cl'} (package data)", info
    assert sources["hls"] == f"{installed / 'kernels' / 'hls' / 'eps_kernels.cpp'} (package data)", info
    assert sources["rtl"] == f"{installed / 'kernels' / 'rtl' / 'l2l_eps_kernel.v'} (package data)", info
    assert (installed / "eps" / "rtl_harness.cpp").is_file()
    assert re.search(r"^eps hls-csim +available", info, re.M), info

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the layer relay hands each layer to the device and back; " * 2000)
    # make test installs an OpenCL platform (PoCL), so the installed l2l must find one
    assert re.search(r"^eps opencl +available", info, re.M), f"the installed l2l has no OpenCL EPS:\n{info}"
    backends = ["hls-csim", "opencl"]
    runs = {eps: subprocess.Popen([str(c) for c in (l2l, "train", "--eps", eps, *TINY, "--data", corpus,
                                                    "--out", tmp_path / f"run-{eps}")],
                                  cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for eps in backends}  # side by side: most of each run is starting Python and torch
    for eps, proc in runs.items():
        output, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"l2l train --eps {eps} exited {proc.returncode}:\n{output}"
        assert (tmp_path / f"run-{eps}" / "summary.json").is_file(), output
    # the C-simulation library went to the user cache, nothing was written next to the source
    assert list((tmp_path / "cache" / "l2l" / "hls-csim").glob("*.so"))
    assert sorted(p.name for p in (installed / "kernels" / "hls").iterdir()) == ["eps_kernels.cpp"]


def test_checkout_finds_sources_at_their_home():
    """Run from this checkout (``pip install -e .`` or ``PYTHONPATH=host``), l2l takes the
    kernel sources from fpga/opencl and hls/ of the same checkout: there are no copies."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "host")}  # this checkout's l2l, whatever is installed
    probe = ("import l2l, json; from l2l import kernels; print(json.dumps([l2l.__file__] + "
             "[[str(p), how] for p, how in map(kernels.locate, ('opencl', 'hls'))]))")
    found = json.loads(_run([sys.executable, "-c", probe], cwd=ROOT, env=env).stdout)
    assert Path(found[0]).resolve().parent == ROOT / "host" / "l2l"
    assert found[1:] == [[str(ROOT / "fpga" / "opencl" / "eps.cl"), "source checkout"],
                         [str(ROOT / "hls" / "eps_kernels.cpp"), "source checkout"]]
    assert not (ROOT / "host" / "l2l" / "kernels" / "opencl").exists()
    assert not (ROOT / "host" / "l2l" / "kernels" / "hls").exists()
