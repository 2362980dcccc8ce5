"""Shared fixtures: tiny models and the stdlib corpus, small enough for 2 CPU cores."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from l2l.data import BatchSampler, load_corpus
from l2l.eps import OptimizerHyper, EagerParamServer, NumpyBackend
from l2l.models import ModelConfig, build_stack, family
from l2l.baseline import PlainEngine
from l2l.relay.engine import RelayEngine

from cli_zygote import Zygote

CPU = torch.device("cpu")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # One torch thread per xdist worker: two workers with two spinning OpenMP
    # threads each on a 2-core machine slow each other down several times over.
    torch.set_num_threads(1)


def pytest_collection_modifyitems(items):
    """Tests marked ``heavy`` (tens of seconds each) run first. pytest-xdist hands tests out in
    collection order, so a heavy test collected last would leave the other worker idle while
    it runs; started first, the many short tests fill in around them."""
    items.sort(key=lambda item: item.get_closest_marker("heavy") is None)


@pytest.fixture(scope="session", autouse=True)
def _own_data_cache(tmp_path_factory):
    """The tests' cached data (l2l.data.token_cache_dir) in a directory of their own, for them
    and the commands they run: not the user's ~/.cache."""
    before = os.environ.get("L2L_CACHE")
    os.environ["L2L_CACHE"] = str(tmp_path_factory.mktemp("l2l-cache"))
    yield
    if before is None:
        del os.environ["L2L_CACHE"]
    else:
        os.environ["L2L_CACHE"] = before


@pytest.fixture(scope="session")
def corpus():
    return load_corpus(None)


@pytest.fixture(scope="session")
def trainer_decay_names():
    """Hugging Face Trainer's parameter groups of a model: the names it weight-decays
    (``Trainer.get_decay_parameter_names``, imported once: importing Trainer takes seconds)."""
    from transformers import Trainer
    return lambda model: set(Trainer.get_decay_parameter_names(None, model))


def timm_optimizers():
    """timm's own ``Lion`` and ``Lamb`` classes, the references for l2l's, imported without the
    rest of timm: its package imports torchvision, which a CPU-only torch cannot load (the
    Makefile installs timm without dependencies). Its optimizer modules need torch alone."""
    import importlib.util
    import sys
    import types
    if "timm.optim.lion" not in sys.modules:
        spec = importlib.util.find_spec("timm")
        assert spec is not None, "timm is a test dependency: make setup-test installs it"
        root = Path(spec.origin).parent
        for name, path in (("timm", root), ("timm.optim", root / "optim")):
            if name not in sys.modules:  # a bare package: timm's own modules, not its __init__
                pkg = types.ModuleType(name)
                pkg.__path__ = [str(path)]
                sys.modules[name] = pkg
    from timm.optim.lamb import Lamb
    from timm.optim.lion import Lion
    return Lion, Lamb


def trainer_groups(model, decayed: set[str], weight_decay: float) -> list[dict]:
    """Trainer's two parameter groups of ``model``: ``decayed`` and the rest."""
    named = dict(model.named_parameters())
    return [{"params": [p for k, p in named.items() if k in decayed], "weight_decay": weight_decay},
            {"params": [p for k, p in named.items() if k not in decayed], "weight_decay": 0.0}]


def adamw_with_trainer_groups(model, decayed: set[str], *, weight_decay: float, **kw):
    """torch.optim.AdamW over ``model`` with Trainer's two groups: ``decayed`` and the rest."""
    import torch
    return torch.optim.AdamW(trainer_groups(model, decayed, weight_decay), **kw)


def sampler_for(corpus, cfg: ModelConfig, batch_size: int, seed: int = 0) -> BatchSampler:
    return BatchSampler(corpus.train, cfg.seq_len, batch_size, family(cfg.family).objective, seed=seed)


def relay(cfg: ModelConfig, hyper: OptimizerHyper, *, micro_batches: int, seed: int = 0,
          stash: str = "device", backend=None) -> RelayEngine:
    eps = EagerParamServer(backend or NumpyBackend(), hyper)
    return RelayEngine(build_stack(cfg, seed), eps, CPU, micro_batches=micro_batches, stash=stash, seed=seed)


def plain(cfg: ModelConfig, hyper: OptimizerHyper, *, seed: int = 0, checkpointing: bool = False) -> PlainEngine:
    return PlainEngine(build_stack(cfg, seed), hyper, CPU, checkpointing=checkpointing)


_ZYGOTE = Zygote()
FRESH_PROCESSES = os.environ.get("L2L_TEST_FRESH") == "1"


def run_python(*argv: str, env: dict | None = None, timeout: float = 300, cwd: Path | None = None,
               fresh: bool = False) -> subprocess.CompletedProcess:
    """``python ARGV`` (``-m MODULE ...`` or ``SCRIPT ...``) in a process of its own, its output
    captured as text. The process is forked from a pre-imported interpreter
    (tests/cli_zygote.py); ``fresh`` (or ``L2L_TEST_FRESH=1``) starts a new interpreter
    instead, for runs that measure their own resident memory or imports."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    if fresh or FRESH_PROCESSES:
        return subprocess.run([sys.executable, *argv], capture_output=True, text=True,
                              env=full_env, timeout=timeout, cwd=cwd)
    return _ZYGOTE.run(list(argv), env=full_env, cwd=cwd, timeout=timeout)


def run_cli(*args: str, env: dict | None = None, timeout: float = 300,
            fault: tuple[str, int] | None = None, cwd: Path | None = None,
            fresh: bool = False) -> subprocess.CompletedProcess:
    """``python -m l2l ARGS``, as a user would run it (see :func:`run_python`); with ``fault``,
    through ``tests/faulty_l2l.py FAULT N`` (a fault injected from outside the package)."""
    head = ["-m", "l2l"] if fault is None else [str(ROOT / "tests" / "faulty_l2l.py"), fault[0], str(fault[1])]
    return run_python(*head, *args, env=env, timeout=timeout, cwd=cwd, fresh=fresh)


def run_torchrun(*args: str, env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    """``torchrun ARGS`` as users launch it (this venv's, else ``python -m torch.distributed.run``),
    its output captured. The launcher and its ranks are a process group of their own: on a
    timeout the whole group is killed, so no rank outlives the test (an orphaned rank would hold
    its memory and wait on a collective for good)."""
    exe = Path(sys.executable).with_name("torchrun")
    launcher = [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]
    with subprocess.Popen([*launcher, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def pytest_sessionfinish(session):
    _ZYGOTE.close()


ROOT = Path(__file__).resolve().parents[1]
