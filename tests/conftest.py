"""Shared fixtures: tiny models and the stdlib corpus, small enough for 2 CPU cores."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from l2l.data import BatchSampler, load_corpus
from l2l.eps import AdamWHyper, EagerParamServer, NumpyBackend
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


def adamw_with_trainer_groups(model, decayed: set[str], *, weight_decay: float, **kw):
    """torch.optim.AdamW over ``model`` with Trainer's two groups: ``decayed`` and the rest."""
    import torch
    named = dict(model.named_parameters())
    return torch.optim.AdamW(
        [{"params": [p for k, p in named.items() if k in decayed], "weight_decay": weight_decay},
         {"params": [p for k, p in named.items() if k not in decayed], "weight_decay": 0.0}], **kw)


def sampler_for(corpus, cfg: ModelConfig, batch_size: int, seed: int = 0) -> BatchSampler:
    return BatchSampler(corpus.train, cfg.seq_len, batch_size, family(cfg.family).objective, seed=seed)


def relay(cfg: ModelConfig, hyper: AdamWHyper, *, micro_batches: int, seed: int = 0,
          stash: str = "device", backend=None) -> RelayEngine:
    eps = EagerParamServer(backend or NumpyBackend(), hyper)
    return RelayEngine(build_stack(cfg, seed), eps, CPU, micro_batches=micro_batches, stash=stash, seed=seed)


def plain(cfg: ModelConfig, hyper: AdamWHyper, *, seed: int = 0, checkpointing: bool = False) -> PlainEngine:
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


def pytest_sessionfinish(session):
    _ZYGOTE.close()


ROOT = Path(__file__).resolve().parents[1]
