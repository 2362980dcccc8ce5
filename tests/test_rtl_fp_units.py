"""RTL FP add/sub, multiply and conversions (fpga/rtl/l2l_fp32_{add,mul}.v, l2l_cvt_*.v) under cocotb.

Each unit is bit-exact against NumPy binary32 (float32 add/subtract/multiply;
ml_dtypes.bfloat16 and np.float16 ``astype`` for the conversions: round to
nearest even, subnormals kept; two NaNs are equal) on the edge-value cross
product (add: both a + b and a - b), exact ties (add, mul, and both narrowing
conversions, including binary16-subnormal ties), overflow, underflow into and
below the subnormal range, cancellation, and random operands over every
binade; the widening conversions on all 65536 inputs. Everything is streamed
with random clock-enable stalls and in_valid bubbles; each result must leave
exactly the latency in l2l_fp_latency.vh later and hold through stalls; at
full rate the unit takes one operation per cycle; rst clears the valid chain
(even with ce = 0) and nothing else. The testbench is sim/tb_fp_units.py.

The multiplier runs twice, once per ``DSP_SHAPE`` (0, the default: 18x18
partial products for the ECP5; 1: 27x18 ones for the Xilinx DSP48E2), each
held to the same NumPy bits and the same latency.

``make test`` runs every class at a smaller size: 10k random operand pairs
(values, for the narrowing units) per unit, 2k ties, all 3.6k-7.2k edge pairs
and all 65536 widening inputs, about 30 s of CPU for the file (the simulation
costs ~0.2 ms of CPU per operation, so 100k random operands cost ~20 s a unit).
``-m slow`` runs issue 5's acceptance sweep as it was (seed 1, 100k random
operands and 10k ties per unit) and 1M random operands per unit on two further
seeds.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sim"))
import rtl_runner  # noqa: E402

UNITS = ["l2l_fp32_add", "l2l_fp32_mul", "l2l_cvt_bf16_to_fp32", "l2l_cvt_fp16_to_fp32",
         "l2l_cvt_fp32_to_bf16", "l2l_cvt_fp32_to_fp16"]
WIDENING = {"l2l_cvt_bf16_to_fp32", "l2l_cvt_fp16_to_fp32"}
# (top, parameters): every unit at its defaults, and the multiplier's Xilinx-DSP shape
CASES = [(top, {}) for top in UNITS] + [("l2l_fp32_mul", {"DSP_SHAPE": 1})]
SWEPT_CASES = [(top, params) for top, params in CASES if top not in WIDENING]   # the slow sweeps


def _id(case) -> str:
    top, params = case
    return "-".join([top, *(f"{k}{v}" for k, v in params.items())])

pytestmark = pytest.mark.skipif(rtl_runner.missing_simulator() is not None,
                                reason=str(rtl_runner.missing_simulator()))


def _run(case, testcase=None, **env: int) -> None:
    top, params = case
    rtl_runner.run(top, rtl_runner.rtl(f"{top}.v"), "tb_fp_units", parameters=params,
                   env={k: str(v) for k, v in env.items()}, testcase=testcase)


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_fp_unit(case):
    """Edges, 2k ties, classes and 10k random operands with stalls; full rate; reset."""
    _run(case, None, L2L_FP_SEED=1, L2L_FP_RANDOM=10_000)


@pytest.mark.slow
@pytest.mark.parametrize("case", SWEPT_CASES, ids=_id)
def test_fp_unit_100k(case):
    """Issue 5's acceptance sweep: 100k random operands and 10k ties per unit, seed 1."""
    _run(case, "test_vectors", L2L_FP_SEED=1, L2L_FP_RANDOM=100_000)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [2, 3])
@pytest.mark.parametrize("case", SWEPT_CASES, ids=_id)
def test_fp_unit_1m(case, seed):
    """Longer sweep: 1M random operands per unit (and 100k ties) on further seeds."""
    _run(case, "test_vectors", L2L_FP_SEED=seed, L2L_FP_RANDOM=1000000)
