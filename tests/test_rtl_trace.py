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

Default: fp32, one contributor, 3 steps of a d_model = 4 model (9 updates,
6996 elements). Slow: fp16 and bf16 mixed precision with two data-parallel
contributors (K = 2) on a d_model = 4 model.
"""
from __future__ import annotations

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
    its inputs, each layer's next input is its last output, and the file round-trips exactly."""
    path = tmp_path / "trace.npz"
    rec = eps_trace.record(path, precision="bf16", contributors=2, steps=2, d_model=2, seq_len=4)
    back = eps_trace.load(path)
    assert len(back.updates) == len(rec.updates) == 6 and back.gdtype == "bf16"
    last = {}
    for u, r in zip(back.updates, rec.updates):
        assert u.grads.shape == (2, u.p.shape[0]) and u.grads.dtype == COPY_DTYPES["bf16"]
        assert _same(u.grads, r.grads) and u.scalars == r.scalars and u.finite == r.finite
        if u.layer in last:
            for a, b in zip((u.p, u.m, u.v), last[u.layer]):
                assert _same(a, b)
        g = np.empty(u.p.shape[0], np.float32)
        assert reduce_gradients(u.grads, u.scalars.inv_scale, g) == u.finite
        p, m, v = u.p.copy(), u.m.copy(), u.v.copy()
        c = np.empty_like(u.copy_out)
        adamw_update(p, m, v, g, u.scalars, copy_out=c)
        for got, want in zip((p, m, v, c), (u.p_out, u.m_out, u.v_out, u.copy_out)):
            assert _same(got, want)
        last[u.layer] = (u.p_out, u.m_out, u.v_out)
    assert len(last) == 3 and back.meta["steps"] == 2


def _replay(tmp_path, *, precision: str, contributors: int, steps: int, d_model: int, seq_len: int,
            lanes: int, burst: int, block: int) -> None:
    path = tmp_path / "trace.npz"
    trace = eps_trace.record(path, precision=precision, contributors=contributors, steps=steps,
                             d_model=d_model, seq_len=seq_len)
    assert len(trace.updates) == 3 * steps
    run_kernel("test_trace_replay", lanes=lanes, gdtype=precision, cdtype=precision, burst=burst,
               block=block, L2L_TRACE=path, L2L_KERNEL_SEED=5, L2L_KERNEL_PAUSE=0.1)


@needs_sim
def test_trace_replay_fp32(tmp_path):
    """fp32, K = 1: 3 steps of a d_model = 4 GPT (embedding 1056, block 244, head 1032 elements)."""
    _replay(tmp_path, precision="fp32", contributors=1, steps=3, d_model=4, seq_len=8,
            lanes=4, burst=16, block=16)


@needs_sim
@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_trace_replay_mixed_precision_two_workers(tmp_path, precision):
    """16-bit gradients and copies, two data-parallel workers (K = 2), 3 steps of a d_model = 4 GPT."""
    _replay(tmp_path, precision=precision, contributors=2, steps=3, d_model=4, seq_len=8,
            lanes=2, burst=16, block=16)
