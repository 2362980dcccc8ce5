"""RTL FP divide and square root (fpga/rtl/l2l_fp32_div.v, l2l_fp32_sqrt.v) under cocotb.

Each unit must give the bits NumPy binary32 gives (np.divide / np.sqrt on
float32: correctly rounded, round to nearest even, subnormals kept; two NaNs
are equal whatever their payloads) on:

- the edge values (div: all 3600 ordered pairs; sqrt: all 60): zeros, subnormal
  and normal limits, largest finite, inf, quiet and signalling NaNs, both signs;
- vector classes, 1000 operands each (2000 in the slow sweeps). div: subnormal operands with every
  leading-zero count, quotients around the largest finite value and beyond,
  quotients in and below the subnormal range and around the smallest normal,
  exact quotients (zero remainder), exact ties in the subnormal range (the only
  place a quotient can tie, including the tie that rounds the largest
  subnormal up to the smallest normal) and 1 ulp off them, and normal
  quotients a hair above or below a rounding midpoint. sqrt: subnormals with
  every leading-zero count, perfect squares and 1-2 ulps around them, roots a
  hair above or below a midpoint, finite operands of every binade;
- random operands (pairs) per unit over every binade and class: 10k in
  ``make test``; issue 5's acceptance sweep (100k, and 2000 per class, seed 1)
  is ``test_fp_divsqrt_100k`` under ``-m slow``;

all streamed with random clock-enable stalls and in_valid bubbles. Every result
must leave exactly the latency of fpga/rtl/l2l_fp_latency.vh later (counted in
clock-enabled cycles), no result may appear unasked, N operations at full rate
take N + latency + 1 cycles (one per cycle), and rst clears the valid chain,
with ce high or low. The testbench is sim/tb_fp_divsqrt.py.

The slow sweep (pytest -m slow) runs 500k more random operands per unit and
20k per class on another seed.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sim"))
import rtl_runner

UNITS = {
    "div": ("l2l_fp32_div", "l2l_fp32_div.v"),
    "sqrt": ("l2l_fp32_sqrt", "l2l_fp32_sqrt.v"),
}

pytestmark = pytest.mark.skipif(rtl_runner.missing_simulator() is not None,
                                reason=str(rtl_runner.missing_simulator()))


def _run(unit: str, testcase, **env: int) -> None:
    top, src = UNITS[unit]
    rtl_runner.run(top, rtl_runner.rtl(src), "tb_fp_divsqrt",
                   env={k: str(v) for k, v in env.items()}, testcase=testcase)


@pytest.mark.parametrize("unit", sorted(UNITS))
def test_fp_divsqrt(unit):
    """Edges, vector classes (1000 each), 10k random, full rate and reset, in one simulation.
    The simulation costs ~0.25 ms of CPU per operation: the random sample is sized for make test."""
    _run(unit, None, L2L_FP_SEED=1, L2L_FP_RANDOM=10_000, L2L_FP_CLASS=1000)


@pytest.mark.slow
@pytest.mark.parametrize("unit", sorted(UNITS))
def test_fp_divsqrt_100k(unit):
    """Issue 5's acceptance sweep as it ran in make test before: 100k random, 2000 per class, seed 1."""
    _run(unit, ["test_classes", "test_random"], L2L_FP_SEED=1, L2L_FP_RANDOM=100_000, L2L_FP_CLASS=2000)


@pytest.mark.slow
@pytest.mark.parametrize("unit", sorted(UNITS))
def test_fp_divsqrt_sweep(unit):
    """Longer sweep on another seed: 500k random operands and 20k per class."""
    _run(unit, ["test_classes", "test_random"], L2L_FP_SEED=2, L2L_FP_RANDOM=500_000,
         L2L_FP_CLASS=20_000)
