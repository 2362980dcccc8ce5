"""cocotb testbench for the binary32 add/sub and multiply units and the four conversions.

One module serves six top levels, told apart by the top-level name:
``l2l_fp32_add`` (a + b, a - b), ``l2l_fp32_mul`` (a * b),
``l2l_cvt_bf16_to_fp32``, ``l2l_cvt_fp16_to_fp32`` (exact widening) and
``l2l_cvt_fp32_to_bf16``, ``l2l_cvt_fp32_to_fp16`` (round to nearest even).

Operands are streamed one per clock with ``ce`` (the datapath's clock enable,
0 = stall) randomly deasserted and random ``in_valid`` bubbles. A cycle model
of the pipeline (a shift register of ``L2L_*_LAT`` stages, from
fpga/rtl/l2l_fp_latency.vh, advanced only on clock-enabled edges) predicts
``out_valid`` on every cycle, so each result must appear exactly the header's
latency after its operands and hold through stalls; every observed ``y`` is
compared bit for bit with NumPy binary32 (``np.add``/``np.subtract``/
``np.multiply`` on float32, ``ml_dtypes.bfloat16`` and ``np.float16``
``astype`` for the conversions: round to nearest even, subnormals kept), two
NaNs being equal whatever their payloads. The references are checked to be
IEEE in this very process first (fp_vectors.check_numpy_ieee).

Environment knobs (set by tests/test_rtl_fp_units.py):
``L2L_FP_SEED`` (default 1) and ``L2L_FP_RANDOM`` (random operand pairs or
values per unit, default 20000; the widening units always run all 65536
inputs). Tie operands are a tenth of that (at least 2000).
"""
from __future__ import annotations

import os
import re
from collections import deque
from pathlib import Path

import cocotb
import numpy as np
from cocotb.clock import Clock
from cocotb.triggers import RisingEdge

import fp_vectors as fv

U32 = np.uint32
LATENCY_VH = Path(__file__).resolve().parents[1] / "fpga" / "rtl" / "l2l_fp_latency.vh"


def header_latency(name: str) -> int:
    """The value of `define ``name`` in l2l_fp_latency.vh."""
    m = re.search(rf"`define\s+{name}\s+(\d+)", LATENCY_VH.read_text())
    if not m:
        raise RuntimeError(f"{name} not defined in {LATENCY_VH}")
    return int(m.group(1))


def env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


# ---------------------------------------------------------------------------
# The units: ports, latency, reference and vector classes


class Unit:
    """What the testbench needs to know about one top level."""

    def __init__(self, name, inputs, lat_macro, out_width, out_fmt, reference):
        self.name = name
        self.inputs = inputs          # input data ports besides in_valid
        self.lat_macro = lat_macro
        self.out_width = out_width    # 32 or 16
        self.out_fmt = out_fmt        # None, 'bf16' or 'fp16' (for NaN tests on 16-bit results)
        self.reference = reference    # f(*operand arrays) -> expected bits


UNITS = {
    "l2l_fp32_add": Unit("l2l_fp32_add", ("a", "b", "sub"), "L2L_FP32_ADD_LAT", 32, None, fv.ref_addsub),
    "l2l_fp32_mul": Unit("l2l_fp32_mul", ("a", "b"), "L2L_FP32_MUL_LAT", 32, None, fv.ref_mul),
    "l2l_cvt_bf16_to_fp32": Unit("l2l_cvt_bf16_to_fp32", ("a",), "L2L_CVT_WIDEN_LAT", 32, None,
                                 fv.ref_bf16_to_fp32),
    "l2l_cvt_fp16_to_fp32": Unit("l2l_cvt_fp16_to_fp32", ("a",), "L2L_CVT_WIDEN_LAT", 32, None,
                                 fv.ref_fp16_to_fp32),
    "l2l_cvt_fp32_to_bf16": Unit("l2l_cvt_fp32_to_bf16", ("a",), "L2L_CVT_NARROW_LAT", 16, "bf16",
                                 fv.ref_fp32_to_bf16),
    "l2l_cvt_fp32_to_fp16": Unit("l2l_cvt_fp32_to_fp16", ("a",), "L2L_CVT_NARROW_LAT", 16, "fp16",
                                 fv.ref_fp32_to_fp16),
}


def vector_classes(unit: Unit, rng: np.random.Generator, n_random: int) -> dict[str, tuple]:
    """Named operand sets for ``unit``: {class name: tuple of operand arrays in ``unit.inputs`` order}."""
    n_tie = max(2000, n_random // 10)
    if unit.name == "l2l_fp32_add":
        ea, eb = fv.edge_pairs()
        z, o = np.zeros(ea.size, U32), np.ones(ea.size, U32)
        ta, tb = fv.tie_pairs_add(rng, n_tie)
        ra, rb = fv.operand_pairs(rng, n_random, "add")
        return {
            "edge x edge, a + b": (ea, eb, z),
            "edge x edge, a - b": (ea, eb, o),
            "ties": (ta, tb, rng.integers(0, 2, ta.size).astype(U32)),
            "random mix": (ra, rb, rng.integers(0, 2, ra.size).astype(U32)),
        }
    if unit.name == "l2l_fp32_mul":
        ea, eb = fv.edge_pairs()
        return {
            "edge x edge": (ea, eb),
            "ties": fv.tie_pairs_mul(rng, n_tie),
            "random mix": fv.operand_pairs(rng, n_random, "mul"),
        }
    if unit.name in ("l2l_cvt_bf16_to_fp32", "l2l_cvt_fp16_to_fp32"):
        return {"all 65536 inputs": (rng.permutation(fv.all_half_bits()),)}
    fmt = unit.out_fmt
    return {f"fp32 -> {fmt} mix (edges, ties, overflow, subnormal)": (fv.narrowing_values(rng, n_random, fmt),)}


def coverage(unit: Unit, classes: dict[str, tuple], expected: dict[str, np.ndarray]) -> dict[str, int]:
    """Counts proving the vectors reach the interesting results (asserted > 0 by the tests)."""
    exp = np.concatenate(list(expected.values()))
    if unit.name in ("l2l_cvt_bf16_to_fp32", "l2l_cvt_fp16_to_fp32"):
        return {"distinct inputs": int(np.unique(classes[next(iter(classes))][0]).size)}
    if unit.out_width == 32:
        x = fv.f32(exp)
        with np.errstate(all="ignore"):
            cov = {
                "nan": int(np.isnan(x).sum()),
                "+inf": int((x == np.inf).sum()),
                "-inf": int((x == -np.inf).sum()),
                "+0": int((exp == fv.POS_ZERO).sum()),
                "-0": int((exp == fv.NEG_ZERO).sum()),
                "subnormal": int((((exp & 0x7F800000) == 0) & ((exp & 0x7FFFFFFF) != 0)).sum()),
                "largest finite": int(((exp & 0x7FFFFFFF) == fv.MAX_FINITE).sum()),
            }
    else:
        hb = exp.astype(np.uint32)
        expmask, manmask = (0x7F80, 0x7F) if unit.out_fmt == "bf16" else (0x7C00, 0x3FF)
        cov = {
            "nan": int(fv.is_nan16(hb, unit.out_fmt).sum()),
            "inf": int(((hb & 0x7FFF) == expmask).sum()),
            "+0": int((hb == 0).sum()),
            "-0": int((hb == 0x8000).sum()),
            "subnormal": int((((hb & expmask) == 0) & ((hb & manmask) != 0)).sum()),
        }
    if unit.name in ("l2l_fp32_add", "l2l_fp32_mul"):
        a, b = classes["ties"][0], classes["ties"][1]
        if unit.name == "l2l_fp32_add":
            sub = classes["ties"][2].astype(bool)
            bb = np.where(sub, b ^ U32(0x80000000), b)
            cov["exact ties"] = int(fv.is_tie(fv.exact_sum(a, bb)).sum())
        else:
            cov["exact ties"] = int(fv.is_tie(fv.exact_product(a, b)).sum())
    if unit.name == "l2l_cvt_fp32_to_bf16":
        a = classes[next(iter(classes))][0]
        cov["exact ties"] = int((((a & 0xFFFF) == 0x8000) & ~fv.is_nan32(a)).sum())
    if unit.name == "l2l_cvt_fp32_to_fp16":
        a = classes[next(iter(classes))][0]
        x = np.abs(fv.f32(a).astype(np.float64))
        with np.errstate(all="ignore"):
            r = x.astype(np.float16).astype(np.float64)
            # halfway between two binary16 neighbours: the residual is exactly half their spacing
            up = np.nextafter(x.astype(np.float16), np.float16(np.inf)).astype(np.float64)
            dn = np.nextafter(x.astype(np.float16), np.float16(0)).astype(np.float64)
            tie = np.isfinite(r) & (r != x) & ((2 * x == r + up) | (2 * x == r + dn))
        cov["exact ties"] = int(tie.sum())
    return cov


# ---------------------------------------------------------------------------
# The testbench


class TB:
    """Clock, reset, stall/bubble generators and a cycle-exact stream driver for one FP unit."""

    def __init__(self, dut, seed: int = 1):
        self.dut = dut
        self.unit = UNITS[dut._name]
        self.latency = header_latency(self.unit.lat_macro)
        self.rng = np.random.default_rng(seed)
        self.log = dut._log
        self.backpressure = None      # iterator of bool: True = stall (ce = 0) this cycle
        self.idle = None              # iterator of bool: True = no operand (in_valid = 0) this cycle
        self.empty_model()
        # cocotb's C clock: its Python clock is about a quarter of a sweep's CPU. It starts low, so
        # the first edge comes after the writes below, as it did with the Python clock
        cocotb.start_soon(Clock(dut.clk, 4, unit="ns", impl="gpi").start(start_high=False))
        dut.rst.value = 0
        dut.ce.value = 1
        dut.in_valid.value = 0
        for port in self.unit.inputs:
            getattr(dut, port).value = 0

    def empty_model(self):
        """The pipeline model after a reset: every stage a bubble, nothing held at the output."""
        self.pipe = deque([-1] * self.latency, maxlen=self.latency)   # operation tag per stage, -1 = bubble
        self.next_tag = 0
        self.held = (-1, None)        # (tag, y) at the output register

    def set_backpressure_generator(self, generator=None):
        self.backpressure = generator

    def set_idle_generator(self, generator=None):
        self.idle = generator

    async def reset(self):
        self.dut.in_valid.value = 0
        self.dut.ce.value = 1
        self.dut.rst.value = 1
        for _ in range(2):
            await RisingEdge(self.dut.clk)
        self.dut.rst.value = 0
        await RisingEdge(self.dut.clk)
        self.empty_model()

    async def stream(self, operands: tuple) -> tuple[np.ndarray, int]:
        """Push every operand tuple through the unit; return (results in order, cycles used).

        Asserts, on every cycle, that ``out_valid`` is what a pipeline of
        ``self.latency`` clock-enabled stages predicts, and that a held output
        (a stall) keeps its value.
        """
        dut = self.dut
        n = operands[0].size
        ports = [getattr(dut, p) for p in self.unit.inputs]
        cols = [op.tolist() for op in operands]
        d_ce, d_iv, d_ov, d_y = dut.ce, dut.in_valid, dut.out_valid, dut.y
        clk = RisingEdge(dut.clk)
        pipe = self.pipe
        base = self.next_tag
        out = [0] * n
        got = 0
        i = 0
        held_tag, held_y = self.held
        cycles = 0
        ce_now, iv_now = 1, 0
        d_ce.value = 1
        d_iv.value = 0
        while got < n:
            # drive this cycle's inputs (sampled at the next edge)
            stall = next(self.backpressure) if self.backpressure else False
            ce_nxt = 0 if stall else 1
            if ce_nxt != ce_now:
                d_ce.value = ce_nxt
                ce_now = ce_nxt
            want = i < n and not (next(self.idle) if self.idle else False)
            if want:
                for port, col in zip(ports, cols):
                    port.value = col[i]
            if int(want) != iv_now:
                iv_now = int(want)
                d_iv.value = iv_now
            await clk
            cycles += 1
            # outputs now read are those registered before this edge: the model's pipe end
            tag = pipe[-1]
            ov = int(d_ov.value)
            if ov != (tag >= 0):
                raise AssertionError(f"cycle {cycles}: out_valid={ov}, the {self.latency}-stage "
                                     f"model expects {int(tag >= 0)} (operand index {tag})")
            if ov:
                yv = d_y.value.to_unsigned()
                if tag == held_tag:
                    if yv != held_y:
                        raise AssertionError(f"cycle {cycles}: y changed from {held_y:#x} to {yv:#x} "
                                             f"during a stall (operation {tag})")
                else:
                    if tag != base + got:
                        raise AssertionError(f"result of operation {tag} arrived, expected {base + got}")
                    out[got] = yv
                    got += 1
                    held_tag, held_y = tag, yv
            # the edge just taken: a clock-enabled edge shifts the pipeline
            if ce_now:
                pipe.appendleft(base + i if want else -1)
                if want:
                    i += 1
        d_iv.value = 0
        d_ce.value = 1
        self.next_tag = base + n
        self.held = (held_tag, held_y)
        return np.array(out, dtype=np.uint64), cycles

    async def check(self, label: str, operands: tuple) -> np.ndarray:
        """Stream ``operands``, compare with the reference bit for bit; return the expected bits."""
        expected = np.asarray(self.unit.reference(*operands)).astype(np.uint64)
        got, cycles = await self.stream(operands)
        names = dict(zip(self.unit.inputs, operands))
        report = fv.describe_mismatches(got, expected, names, self.unit.out_width, self.unit.out_fmt)
        assert not report, f"{self.unit.name} {label}: {report}"
        self.log.info("%s %s: %d results bit-exact in %d cycles", self.unit.name, label, got.size, cycles)
        return expected


def random_flags(rng: np.random.Generator, p: float, chunk: int = 4096):
    """An endless iterator of booleans, True with probability ``p`` (seeded)."""
    while True:
        yield from (rng.random(chunk) < p).tolist()


def never():
    while True:
        yield False


async def _setup(dut) -> TB:
    fv.check_numpy_ieee()
    tb = TB(dut, env_int("L2L_FP_SEED", 1))
    await tb.reset()
    return tb


@cocotb.test()
async def test_vectors(dut):
    """Every vector class for this unit, streamed with random stalls (ce = 0) and bubbles, bit-exact."""
    tb = await _setup(dut)
    tb.set_backpressure_generator(random_flags(tb.rng, 0.1))
    tb.set_idle_generator(random_flags(tb.rng, 0.1))
    classes = vector_classes(tb.unit, tb.rng, env_int("L2L_FP_RANDOM", 20000))
    expected = {}
    for label, ops in classes.items():
        expected[label] = await tb.check(label, ops)
    cov = coverage(tb.unit, classes, expected)
    tb.log.info("%s coverage of expected results: %s", tb.unit.name, cov)
    empty = [k for k, v in cov.items() if v == 0]
    assert not empty, f"{tb.unit.name}: the vectors never produce {empty}: {cov}"


@cocotb.test()
async def test_full_rate(dut):
    """No stalls, no bubbles: one result per cycle, the first exactly LAT cycles after the first operand."""
    tb = await _setup(dut)
    tb.set_backpressure_generator(never())
    tb.set_idle_generator(never())
    ops = next(iter(vector_classes(tb.unit, tb.rng, 2000).values()))
    ops = tuple(op[:2000] for op in ops)
    expected = np.asarray(tb.unit.reference(*ops)).astype(np.uint64)
    got, cycles = await tb.stream(ops)
    assert cycles == ops[0].size + tb.latency, (cycles, ops[0].size, tb.latency)
    assert fv.mismatches(got, expected, tb.unit.out_width, tb.unit.out_fmt).size == 0


@cocotb.test()
async def test_reset(dut):
    """rst clears the valid chain whatever ce is, and only the valid chain; the unit runs again after it."""
    tb = await _setup(dut)
    dut = tb.dut
    lat = tb.latency
    ops = next(iter(vector_classes(tb.unit, tb.rng, 2000).values()))
    ports = [getattr(dut, p) for p in tb.unit.inputs]
    # fill every stage with a valid operation
    dut.ce.value = 1
    dut.in_valid.value = 1
    for k in range(lat):
        for port, col in zip(ports, ops):
            port.value = int(col[k])
        await RisingEdge(dut.clk)
    dut.in_valid.value = 0
    dut.ce.value = 0                      # stall with every stage full
    await RisingEdge(dut.clk)
    assert int(dut.out_valid.value) == 1, "pipeline should be full of valid operations"
    y_before = dut.y.value.to_unsigned()
    first = int(np.asarray(tb.unit.reference(*(op[:1] for op in ops)))[0])
    assert fv.same_bits(y_before, first, tb.unit.out_width, tb.unit.out_fmt), (y_before, first)
    # reset during the stall: still clears
    dut.rst.value = 1
    await RisingEdge(dut.clk)
    dut.rst.value = 0
    await RisingEdge(dut.clk)
    assert int(dut.out_valid.value) == 0, "rst with ce = 0 must clear out_valid"
    assert dut.y.value.to_unsigned() == y_before, "rst must not touch the data registers"
    dut.ce.value = 1
    for _ in range(lat + 2):
        await RisingEdge(dut.clk)
        assert int(dut.out_valid.value) == 0, "a valid operation survived rst"
    tb.empty_model()
    # and it works again, with the right latency
    got, cycles = await tb.stream(tuple(op[:50] for op in ops))
    expected = np.asarray(tb.unit.reference(*(op[:50] for op in ops))).astype(np.uint64)
    assert fv.mismatches(got, expected, tb.unit.out_width, tb.unit.out_fmt).size == 0
