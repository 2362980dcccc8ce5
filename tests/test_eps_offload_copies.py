"""The device copies on disk too (``--eps-offload-copies``; l2l.eps.copy_window).

Driven as the relay drives the EPS (forward fetches ascending, backward fetches descending
each followed by its gradient, a held step, non-finite updates), every fetched copy has the
same bits as with the copies in memory, and no copy the caller still holds is ever
overwritten; the copy buffers alive stay a few entries whatever the depth; and
``l2l train --eps-offload DIR --eps-offload-copies`` is the same run as in memory.
"""
from __future__ import annotations

import uuid

import numpy as np
import pytest

from l2l.eps import OptimizerHyper, EagerParamServer, NumpyBackend, OpenCLBackend
from l2l.eps.copy_window import DiskCopies
from l2l.eps.disk_tier import DiskTier, copy_layout
from l2l.eps.numerics import COPY_DTYPES
from l2l.eps.offload_backend import OffloadedBackend

from test_eps_offload_cli import _assert_same_run, _one_line_error, _train

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

LAYERS = {0: 1024, 1: 1025, 2: 3000, 3: 3000, 4: 3000, 5: 333}
SHARED = 6  # a tied embedding: fetched with the first and the last layer, out of order
NUMELS = {**LAYERS, SHARED: 700}
STEPS = 4
HELD = {2}
NONFINITE = {(1, 3), (3, SHARED)}


def _server(backend: str, precision: str, directory=None, window: int = 2):
    inner = NumpyBackend() if backend == "numpy" else OpenCLBackend()
    copies = None
    if directory is not None:
        rid = uuid.uuid4().hex
        state = DiskTier(directory, rid, NUMELS)
        inner = OffloadedBackend(inner, state, window=window)
        copies = DiskCopies(DiskTier(directory, rid, NUMELS, layout=copy_layout(COPY_DTYPES[precision])), window)
    return EagerParamServer(inner, OptimizerHyper(lr=1e-2, weight_decay=0.1), copy_dtype=precision,
                            grad_dtype=precision, share_masters=True, copies=copies)


def relay_like(eps, held_back: int = 2, check_held: bool = False) -> list[bytes]:
    """Every copy fetched, in the relay's order. The last ``held_back`` fetched arrays stay
    referenced (an asynchronous transport's prefetch), and with ``check_held`` each must still
    hold what it held when fetched once it is let go (in memory, with the masters serving as
    copies, an update changes a held copy in place: the relay lets go before that)."""
    rng = np.random.default_rng(7)
    for e, n in NUMELS.items():
        eps.add_layer(e, rng.standard_normal(n).astype(np.float32), users=2 if e == SHARED else 1)
    seen, holding = [], []

    def fetch(e):
        a = eps.fetch(e)
        seen.append(a.tobytes())
        holding.append((a, seen[-1], e))
        while len(holding) > held_back:
            old, was, entry = holding.pop(0)
            assert not check_held or old.tobytes() == was, f"entry {entry}'s copy changed while still held"

    def push(e, contributor=0):
        g = eps.gradient_inbox(e, contributor)
        vals = rng.standard_normal(g.shape[0]).astype(np.float32)
        if (t, e) in NONFINITE and contributor == 0:
            vals[0] = np.inf
        g[...] = vals.astype(g.dtype)
        eps.push_gradient(e, contributor, divisor=2.0)

    last = max(LAYERS)
    for t in range(STEPS):
        fetch(SHARED)
        for e in range(last):  # forward
            fetch(e)
        if t in HELD:
            eps.hold()
        fetch(last)
        fetch(SHARED)  # the post stage
        push(last)
        push(SHARED, 0)
        for e in range(last - 1, -1, -1):  # backward
            fetch(e)
            push(e)
        push(SHARED, 1)
        if t in HELD:
            eps.commit(max_norm=0.5)
        if t == 1:  # an evaluation: ascending
            for e in sorted(NUMELS):
                fetch(e)
    eps.synchronize()
    seen.append(b"".join(a.tobytes() for a in eps.state_tensors().values()))
    return seen


@pytest.mark.parametrize("backend, precision", [("numpy", "fp32"), ("numpy", "bf16"), ("opencl", "fp32")])
def test_copies_on_disk_give_the_same_bits(tmp_path, backend, precision):
    want_eps = _server(backend, precision)
    want = relay_like(want_eps)
    want_eps.close()
    eps = _server(backend, precision, tmp_path / "eps")
    got = relay_like(eps, check_held=True)
    copies = eps.copies
    eps.close()
    assert len(got) == len(want)
    for k, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"fetch {k} differs"
    assert copies.reads_ahead > 3 * copies.reads_on_demand, (copies.reads_ahead, copies.reads_on_demand)
    assert sorted(p.name for p in (tmp_path / "eps").glob("*.copy")) == [f"entry{e:05d}.copy" for e in NUMELS]


def test_copies_in_memory_stay_a_few_entries(tmp_path):
    """Deep and uniform: the copy buffers alive never exceed 2 * window + 5 entries (the
    module's count), and the window foresees all but the very first fetch."""
    n, entries, window = 4000, 24, 2
    rid = uuid.uuid4().hex
    numels = {e: n for e in range(entries)}
    tier = DiskTier(tmp_path, rid, numels, layout=copy_layout(np.float32))
    eps = EagerParamServer(OffloadedBackend(NumpyBackend(), DiskTier(tmp_path, rid, numels), window=window),
                           OptimizerHyper(), copies=DiskCopies(tier, window))
    rng = np.random.default_rng(3)
    for e in range(entries):
        eps.add_layer(e, rng.standard_normal(n).astype(np.float32))
    peak = 0
    for _ in range(3):
        for e in range(entries):
            a = eps.fetch(e)
            peak = max(peak, eps.copies.buffers_alive())
            del a
        for e in reversed(range(entries)):
            a = eps.fetch(e)
            eps.gradient_inbox(e)[...] = rng.standard_normal(n).astype(np.float32)
            eps.push_gradient(e, divisor=1.0)
            peak = max(peak, eps.copies.buffers_alive())
            del a
    eps.close()
    one = copy_layout(np.float32).file_bytes(n)
    assert peak <= 2 * window + 5, peak
    assert tier.peak_live_bytes <= (2 * window + 5) * one, tier.peak_live_bytes / one
    assert eps.copies.reads_on_demand <= 3, eps.copies.reads_on_demand


@pytest.mark.parametrize("eps, precision, devices", [("numpy", "fp32", 1), ("numpy", "bf16", 1), ("opencl", "fp32", 1),
                                                     ("numpy", "fp32", 2)])
def test_train_with_copies_on_disk_is_the_same_run(tmp_path, eps, precision, devices):
    """Two relay workers fetch the copies from threads of their own: the same run too."""
    extra = ["--eps", eps, "--precision", precision, "--devices", str(devices)]
    ram, disk = tmp_path / "ram", tmp_path / "disk"
    assert _train(ram, *extra).returncode == 0
    r = _train(disk, *extra, "--eps-offload", str(tmp_path / "eps"), "--eps-offload-copies")
    assert r.returncode == 0, r.stderr
    _assert_same_run(disk, ram)
    assert len(list((tmp_path / "eps").glob("*.copy"))) >= 3


def test_copies_option_needs_the_tier(tmp_path):
    _one_line_error(_train(tmp_path / "out", "--eps-offload-copies"), "--eps-offload-copies needs --eps-offload")


@pytest.mark.parametrize("copies", [False, True])
def test_train_forecast_knows_the_tier(tmp_path, copies):
    """The forecast `l2l train` records plans the state (and copies) on disk: its host peak is
    within 15% of the measured one. Forecast in memory instead, this 7M-parameter model's
    p, m, v and copy (16 bytes a parameter, about 110 MiB) would put it some 30% over."""
    import json

    from conftest import run_cli
    extra = ["--eps-offload-copies"] if copies else []
    out = tmp_path / "out"
    r = run_cli("train", "--layers", "4", "--d-model", "384", "--heads", "4", "--seq-len", "32", "--batch-size", "4",
                "--micro-batches", "2", "--steps", "2", "--eval-batches", "1", "--no-plot", "--no-progress",
                "--plan", "quick", "--out", str(out), "--eps-offload", str(tmp_path / "eps"), *extra)
    assert r.returncode == 0, r.stderr
    summary = json.loads((out / "summary.json").read_text())
    plan = summary["plan"]
    assert abs(summary["host_peak_bytes"] / plan["predicted_host_bytes"] - 1) <= 0.15, (summary["host_peak_bytes"],
                                                                                      plan)
    assert (plan["predicted_host_state_bytes"] == 0) == copies
