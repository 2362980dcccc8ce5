"""The RTL EPS's LAMB first pass (fpga/rtl/l2l_eps_lamb_norms.v, l2l_eps_lamb_lane.v,
l2l_eps_lamb_acc.v) bit for bit against the golden model ``l2l.eps.numerics.lamb_norms``,
through cocotb (sim/tb_eps_lamb.py).

- ``test_lamb_norms``: segments of 1, 15, 16, 17, 1000 and 37 elements (ragged tails),
  one all-zero tensor, n_decay at 0, inside a segment, on a segment boundary, at n; a
  zero weight decay; random input bubbles and backpressure on both outputs. m', v',
  tlast and every segment's 2 x 16 lane sums.
- ``test_lamb_norms_throughput``: one element per clock (one lost clock a segment) with
  the outputs always ready.
- ``test_lamb_apply``: LAMB's second pass (fpga/rtl/l2l_eps_lamb_apply.v,
  sim/tb_eps_lamb_apply.py) against ``numerics.lamb_apply`` at LANES 1, 4, 3 with each copy
  dtype: p' and the copy of every element, segment boundaries inside beats, the host fold's
  step sizes and random ones (zeros of both signs, tiny, huge), decay boundaries.

About a minute of CPU in all (Icarus).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "sim"))
import rtl_runner  # noqa: E402

from test_rtl_datapath import sources  # noqa: E402

needs_sim = pytest.mark.skipif(rtl_runner.missing_simulator() is not None,
                               reason=str(rtl_runner.missing_simulator()))

# segments of 1, 15, 16, 17, 1000, 37 elements; elements [1, 16) all zero
STARTS = [0, 1, 16, 32, 49, 1049]
N = 1086
CASES = [
    {"starts": STARTS, "n": N, "n_decay": 49 + 517, "zero": [1, 16], "mzero": [560, 572], "wd": 0.01},
    {"starts": STARTS, "n": N, "n_decay": 32, "wd": 0.1, "t": 1, "scale": 1.0},
    {"starts": [0, 17, 40], "n": 57, "n_decay": 0, "wd": 0.01},
    {"starts": [0, 17, 40], "n": 57, "n_decay": 57, "wd": 0.0},
    {"starts": [0, 5], "n": 21, "n_decay": 20, "mzero": [0, 21], "wd": 0.5, "t": 100},
    {"starts": [0, 3], "n": 40, "n_decay": 30, "scale": 22.0},
    # one-element segments back to back (a sums transfer every element), then 16, 1, 33
    {"starts": [0, 1, 2, 3, 4, 5, 6, 7, 8, 24, 25], "n": 58, "n_decay": 7, "mzero": [5, 9], "wd": 0.2},   # squares and sums past binary32: inf
]


def run(config: dict, tests) -> None:
    rtl_runner.run("l2l_eps_lamb_norms", sources("l2l_eps_lamb_norms"), "tb_eps_lamb",
                   env={"L2L_TB_CONFIG": json.dumps(config)}, testcase=list(tests))


@needs_sim
def test_lamb_norms():
    run({"cases": CASES, "seed": 5, "idle": 0.3, "backpressure": 0.3}, ["lamb_norms_vectors", "lamb_norms_reset"])


@needs_sim
def test_lamb_norms_throughput():
    run({"throughput": {"starts": [0, 1, 17, 33, 200], "n": 400}}, ["lamb_norms_throughput"])


APPLY = [
    # lanes, cdtype
    (1, "fp32"),
    (4, "bf16"),
    (3, "fp16"),
]
APPLY_CASES = [
    {"starts": [0, 1, 16, 32, 49], "n": 300, "n_decay": 49 + 117, "zero": [1, 16], "mzero": [160, 172],
     "wd": 0.01, "scale": 1.0},
    {"starts": [0, 1, 16, 32, 49], "n": 300, "n_decay": 33, "wd": 0.1, "steps": "random"},
    {"starts": [0, 17, 40], "n": 57, "n_decay": 0, "wd": 0.0, "scale": 0.5},
    {"starts": [0, 5], "n": 21, "n_decay": 20, "mzero": [0, 21], "wd": 0.5, "t": 100},
]


@needs_sim
@pytest.mark.parametrize("lanes,cdtype", APPLY, ids=[f"L{a}-{b}" for a, b in APPLY])
def test_lamb_apply(lanes, cdtype):
    config = {"lanes": lanes, "cdtype": cdtype, "cases": APPLY_CASES, "seed": 11 + lanes, "idle": 0.3,
              "backpressure": 0.3, "last_every": 3}
    rtl_runner.run("l2l_eps_lamb_apply", sources("l2l_eps_lamb_apply"), "tb_eps_lamb_apply",
                   parameters={"LANES": lanes, "CDTYPE": {"fp32": 0, "bf16": 1, "fp16": 2}[cdtype]},
                   env={"L2L_TB_CONFIG": json.dumps(config)}, testcase=["lamb_apply_vectors"])


@pytest.mark.parametrize("params", [{"LANES": 4, "CDTYPE": 1}, {"LANES": 16, "CDTYPE": 2}, {"LANES": 3, "CDTYPE": 0}],
                         ids=lambda p: f"L{p['LANES']}-C{p['CDTYPE']}")
def test_lamb_apply_lint(params):
    """Verilator -Wall on l2l_eps_lamb_apply at LANES / CDTYPE corners (test_rtl_lint.py lints
    every module at its defaults only)."""
    from test_rtl_lint import RTL, _check
    _check("l2l_eps_lamb_apply", RTL / "l2l_eps_lamb_apply.v", params)
