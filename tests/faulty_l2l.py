"""``l2l`` with a fault injected, for the crash tests: ``python tests/faulty_l2l.py FAULT N l2l-args...``.

FAULT is ``kill-in-save`` (SIGKILL inside the checkpoint save of step N, after its files
are written and before they are committed: the worst moment for a checkpoint writer) or
``kill-at-step`` (SIGKILL as 0-based step N starts: a machine dying mid-run) or
``kill-in-update`` (SIGKILL as the N-th EPS update on an ``--eps-offload`` disk tier starts,
counting from 1: mid-step, with the updates before it written or being written to the state
files, which are then half-updated) or ``kill-in-exchange`` (SIGKILL as the N-th gradient
exchange of a sharded EPS starts, counting from 1: a machine dying mid-backward, its peers
waiting on it in a collective) or ``free-bytes`` (every filesystem reports N bytes free:
the disk tier's and the planner's space checks, tested without filling a disk). The faults
are patched in here, from outside the package, through the same seams a user could use:
``l2l.checkpoint.save_checkpoint``'s ``before_commit``, the engine's ``train_step``, the
disk tier's ``OffloadedBackend.step``, ``ShardCollectives.to_owners`` and ``shutil.disk_usage``.
"""
from __future__ import annotations

import os
import shutil
import signal
import sys


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _kill_in_save(step: int) -> None:
    from l2l import checkpoint
    save = checkpoint.save_checkpoint

    def save_then_die(out, at, tensors, meta, **kwargs):
        return save(out, at, tensors, meta, **{**kwargs, "before_commit": _kill if at == step else None})
    checkpoint.save_checkpoint = save_then_die


def _kill_at_step(step: int) -> None:
    from l2l import train
    build = train.build_engine

    def build_then_arm(*args, **kwargs):
        engine = build(*args, **kwargs)
        train_step = engine.train_step

        def step_or_die(batch, at, **kw):
            if at == step:
                _kill()
            return train_step(batch, at, **kw)
        engine.train_step = step_or_die
        return engine
    train.build_engine = build_then_arm


def _kill_at_call(cls, method: str, n: int) -> None:
    """SIGKILL as the ``n``-th call (from 1) of ``cls.method`` in this process starts."""
    original = getattr(cls, method)
    count = [0]

    def call_or_die(self, *args, **kwargs):
        count[0] += 1
        if count[0] == n:
            _kill()
        return original(self, *args, **kwargs)
    setattr(cls, method, call_or_die)


def _kill_in_update(n: int) -> None:
    from l2l.eps.offload_backend import OffloadedBackend
    _kill_at_call(OffloadedBackend, "step", n)


def _kill_in_exchange(n: int) -> None:
    from l2l.distributed import ShardCollectives
    _kill_at_call(ShardCollectives, "to_owners", n)


def disk_usage_reporting(free: int, usage=shutil.disk_usage):
    """``shutil.disk_usage`` as it is, but saying ``free`` bytes are free."""
    def smaller(path):
        real = usage(path)
        return type(real)(real.total, real.used, free)
    return smaller


def report_free_bytes(free: int) -> None:
    """Every ``shutil.disk_usage`` in this process says ``free`` bytes are free."""
    shutil.disk_usage = disk_usage_reporting(free)


if __name__ == "__main__":
    fault, n, *argv = sys.argv[1:]
    {"kill-in-save": _kill_in_save, "kill-at-step": _kill_at_step, "kill-in-update": _kill_in_update,
     "kill-in-exchange": _kill_in_exchange, "free-bytes": report_free_bytes}[fault](int(n))
    from l2l.cli import main
    sys.exit(main(argv))
