"""Trace co-simulation: every EPS update of a real training run, replayed through the RTL kernel.

A tiny byte-level GPT trains for a few steps on the stdlib corpus with the
NumPy EPS wrapped by sim/eps_trace.py's recording backend (host/ untouched);
the trace holds, for every layer update, the state before, the K gradient
contributions, the step scalars, the flag and the state and device copy
after. sim/tb_eps_kernel.py::test_trace_replay then loads each layer's first
state into the kernel's device memory once and runs every recorded update in
order through the AXI ports (random pauses on every channel): before each
update the state in device memory must equal the recorded input state, and
after it the flag, p', m', v' and the copy must equal the recorded outputs bit
for bit. So the RTL reproduces the run, not just single updates.

Default (``test_trace_replay_bf16_two_workers_with_skip``): bf16 gradients
and bf16 device copy, two data-parallel contributors (K = 2), 3 steps of a
d_model = 2 model (9 updates, LANES = 8), with one update skipped: contributor 1's
gradient of the transformer block at step 2 carries an inf
(:class:`eps_trace.Poison`), so the NumPy EPS returned flag 0 there and the
block's next update ran at the same t. The test requires the trace to hold
that skipped update and the kernel to have replayed it (flag 0, p, m, v and
the copy unchanged in device memory), so it cannot silently stop covering
it. The block and the head are parameter groups there (``decay_split``):
the block decays its first 37 elements (inside a beat), the head its first
512 (a burst and block edge, its partial last beat not decayed); the recorded
boundary goes to the kernel's n_decay register. Slow: fp32 with one contributor, fp16 with two (loss scaling, no
poison: skipped updates only if the scale overflows).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "sim"))
import eps_trace  # noqa: E402
import rtl_runner  # noqa: E402
from test_rtl_kernel import run_kernel  # noqa: E402

from l2l.eps.numerics import COPY_DTYPES, adamw_update, reduce_gradients  # noqa: E402

needs_sim = pytest.mark.skipif(rtl_runner.missing_simulator() is not None,
                               reason=str(rtl_runner.missing_simulator()))


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    w = {2: np.uint16, 4: np.uint32}[a.dtype.itemsize]
    return bool(np.array_equal(a.view(w), b.view(w)))


def test_recorded_trace_is_what_the_numpy_eps_did(tmp_path):
    """The recorder's view is consistent: each update's outputs are the golden model applied to
    its inputs (with its decay boundary: the block's first 37 elements only), each layer's next
    input is its last output, and the file round-trips exactly."""
    path = tmp_path / "trace.npz"
    rec = eps_trace.record(path, precision="bf16", contributors=2, steps=2, d_model=2, seq_len=4,
                           decay_split={1: 37})
    back = eps_trace.load(path)
    assert len(back.updates) == len(rec.updates) == 6 and back.gdtype == "bf16"
    last = {}
    for u, r in zip(back.updates, rec.updates):
        assert u.grads.shape == (2, u.p.shape[0]) and u.grads.dtype == COPY_DTYPES["bf16"]
        assert _same(u.grads, r.grads) and u.scalars == r.scalars and u.finite == r.finite
        assert u.n_decay == r.n_decay and (u.layer != 1 or u.n_decay == 37)  # else the model's own groups
        if u.layer in last:
            for a, b in zip((u.p, u.m, u.v), last[u.layer]):
                assert _same(a, b)
        g = np.empty(u.p.shape[0], np.float32)
        assert reduce_gradients(u.grads, u.scalars.inv_scale, g) == u.finite
        p, m, v = u.p.copy(), u.m.copy(), u.v.copy()
        c = np.empty_like(u.copy_out)
        adamw_update(p, m, v, g, u.scalars, copy_out=c, n_decay=u.n_decay)
        for got, want in zip((p, m, v, c), (u.p_out, u.m_out, u.v_out, u.copy_out)):
            assert _same(got, want)
        if u.layer == 1 and u.finite:     # the boundary reached the NumPy EPS: decaying all differs
            p_all = u.p.copy()
            adamw_update(p_all, u.m.copy(), u.v.copy(), g, u.scalars)
            assert not _same(p_all, u.p_out)
        last[u.layer] = (u.p_out, u.m_out, u.v_out)
    assert len(last) == 3 and back.meta["steps"] == 2


def test_recorder_forwards_a_given_decay_boundary():
    """A boundary the caller passes (the server's parameter groups) reaches the inner backend
    and the record as it is; decay_split replaces it for its layers; none given: all (n)."""
    from l2l.eps import NumpyBackend
    from l2l.eps.contract import StepScalars

    rng = np.random.default_rng(4)
    n = 10
    p0 = rng.standard_normal(n).astype(np.float32)
    s = StepScalars(*(np.float32(x) for x in (0.5, 0.9, 0.1, 0.999, 0.001, 1.0, 1e-8, -1e-3, 1.0)))
    rec = eps_trace.RecordingBackend(NumpyBackend(), decay_split={0: 2})
    for layer, nd, want in ((0, 3, 2), (0, None, 2), (1, 3, 3)):
        rec.allocate(layer, p0.copy())
        g = rng.standard_normal((1, n)).astype(np.float32)
        copy = np.empty(n, np.float32)
        assert rec.step(layer, g, s, copy, n_decay=nd)
        u = rec.updates[-1]
        assert u.n_decay == want
        p, m, v = p0.copy(), np.zeros(n, np.float32), np.zeros(n, np.float32)
        adamw_update(p, m, v, g[0].copy(), s, n_decay=want)
        assert _same(u.p_out, p)
    rec.allocate(2, p0.copy())
    rec.step(2, rng.standard_normal((1, n)).astype(np.float32), s, np.empty(n, np.float32))
    assert rec.updates[-1].n_decay == n
    rec.close()


def _replay(tmp_path, *, precision: str, contributors: int, steps: int, d_model: int, seq_len: int,
            lanes: int, burst: int, block: int, poison: eps_trace.Poison | None = None,
            decay_split: dict[int, int] | None = None) -> tuple:
    """Record a run, replay it through the kernel; (the trace, the kernel's replay report)."""
    path, report = tmp_path / "trace.npz", tmp_path / "replay.json"
    trace = eps_trace.record(path, precision=precision, contributors=contributors, steps=steps,
                             d_model=d_model, seq_len=seq_len, poison=poison, decay_split=decay_split)
    assert len(trace.updates) == 3 * steps
    run_kernel("test_trace_replay", lanes=lanes, gdtype=precision, cdtype=precision, burst=burst,
               block=block, L2L_TRACE=path, L2L_KERNEL_SEED=5, L2L_KERNEL_PAUSE=0.1,
               L2L_KERNEL_REPORT=report)
    replayed = json.loads(report.read_text())
    assert [(r["layer"], r["finite"], r["n_decay"]) for r in replayed["updates"]] == \
        [(u.layer, u.finite, u.n_decay) for u in trace.updates], "the kernel did not replay the whole trace"
    return trace, replayed


# the transformer block (layer 1, 74 elements at d_model = 2) at its second step, worker 1
BLOCK_SKIP = eps_trace.Poison(step=1, layer=1, contributor=1, index=37)


@pytest.mark.heavy
@needs_sim
def test_trace_replay_bf16_two_workers_with_skip(tmp_path):
    """bf16 gradients and copy, K = 2, 3 steps of a d_model = 2 GPT (embedding 520, block 74,
    head 516 elements: at LANES = 8 the block and the head end mid-beat, and their
    contribution 1 starts mid-beat), one update skipped; every update bit for bit, the skip
    included."""
    trace, replayed = _replay(tmp_path, precision="bf16", contributors=2, steps=3, d_model=2,
                              seq_len=4, lanes=8, burst=16, block=16, poison=BLOCK_SKIP,
                              decay_split={1: 37, 2: 512})
    assert trace.gdtype == trace.cdtype == "bf16" and replayed["gdtype"] == replayed["cdtype"] == "bf16"
    assert {u.grads.shape[0] for u in trace.updates} == {2}
    skipped = [i for i, u in enumerate(trace.updates) if not u.finite]
    block = [i for i, u in enumerate(trace.updates) if u.layer == BLOCK_SKIP.layer]
    # exactly the poisoned update was skipped, and it was a real skip of the NumPy EPS ...
    assert skipped == [block[BLOCK_SKIP.step]], skipped
    u = trace.updates[skipped[0]]
    assert not np.isfinite(u.grads[BLOCK_SKIP.contributor, BLOCK_SKIP.index].astype(np.float32))
    assert np.isfinite(u.grads[1 - BLOCK_SKIP.contributor].astype(np.float32)).all()
    # ... whose step count stayed: the block's next update has the skipped one's scalars (same t)
    assert trace.updates[block[BLOCK_SKIP.step + 1]].scalars == u.scalars
    assert trace.updates[block[BLOCK_SKIP.step - 1]].scalars != u.scalars
    # and the kernel replayed it, flag 0, with the copy compared (a finite update came before)
    assert [r for r in replayed["updates"] if not r["finite"]] == \
        [{"layer": BLOCK_SKIP.layer, "n": 74, "K": 2, "n_decay": 37, "finite": False, "copy_checked": True}]
    assert {u.layer: u.n_decay for u in trace.updates} == {0: 520, 1: 37, 2: 512}


@needs_sim
@pytest.mark.slow
def test_trace_replay_fp32(tmp_path):
    """fp32, K = 1: 3 steps of a d_model = 4 GPT (embedding 1056, block 244, head 1032 elements)."""
    _replay(tmp_path, precision="fp32", contributors=1, steps=3, d_model=4, seq_len=8,
            lanes=4, burst=16, block=16)


@needs_sim
@pytest.mark.slow
def test_trace_replay_fp16_two_workers(tmp_path):
    """fp16 gradients and copies (dynamic loss scaling), two data-parallel workers (K = 2),
    3 steps of a d_model = 4 GPT."""
    _replay(tmp_path, precision="fp16", contributors=2, steps=3, d_model=4, seq_len=8,
            lanes=2, burst=16, block=16)
