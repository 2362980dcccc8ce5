"""The RTL EPS datapath (issue 5): l2l_eps_reduce and l2l_eps_adamw, bit for bit
against the golden model l2l.eps.numerics, through cocotb (sim/tb_eps_datapath.py).

Each simulation builds one parameter set (LANES, gradient / copy dtype, BLOCK)
and runs the cocotb tests of that top level:

* reduce_vectors: every vector class of sim/eps_vectors.py x K in {1, 2, 4},
  n = 1 and sizes that are not multiples of LANES or of the block, random input
  bubbles and output backpressure; g, tkeep, tlast and the finite flag exact.
* reduce_short_segments: segments of 1 .. BLOCK beats (the accumulator's
  read-after-write hazard), exact.
* reduce_flag: sticky until flag_clear, deaf to junk in lanes beyond n, hears
  inf in every lane position.
* reduce_reset / adamw_reset: rst mid-stream (beats in flight, output stalled)
  leaves no state behind; the next layer is exact.
* reduce_throughput / adamw_throughput: beats per cycle >= 0.95 with the input
  always valid and the output always ready; the measured latency equals the
  module's `latency` output.
* adamw_vectors: every AdamW vector class (wide binades, the special grid under
  each special scalar set, exact ties in products / sums / the copy, training
  values, non-finite g), p', m', v' and the copy exact.
* adamw_multistep: the RTL's own state fed back for several steps.
* adamw_decay_boundaries: the parameter groups' decay boundary (n_decay) at 0,
  n, inside a beat, on beat edges and above n; adamw_vectors and
  adamw_multistep also run with boundaries (the per-lane decay bit).

The default suite runs a covering subset (every dtype once for each module,
LANES 1 and 4, one LANES = 16 reducer); `-m slow` runs the full cross product
with larger vectors. Both also run the AdamW datapath (and the slow suite the
reducer) built with the Xilinx-DSP multipliers (DSP_SHAPE = 1, 27x18 partial
products, fpga/rtl/l2l_fp32_mul.v) at one shape, held to the same bits.
"""
from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "sim"))

import rtl_runner  # noqa: E402

RTL_DIR = rtl_runner.RTL_DIR
_INST = re.compile(r"^\s*(l2l_[a-z0-9_]+)\s*(?:#\s*\(|[a-zA-Z_][a-zA-Z0-9_]*\s*\()", re.M)
_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)


def sources(top: str, dirs=(RTL_DIR,)) -> list[Path]:
    """``top``'s file and, transitively, the files of every l2l_* module it instantiates
    (one module per file, named after it), looked up in ``dirs`` in order."""
    found: dict[str, Path] = {}
    todo = [top]
    while todo:
        name = todo.pop()
        if name in found:
            continue
        path = next((Path(d) / f"{name}.v" for d in dirs if (Path(d) / f"{name}.v").is_file()), None)
        if path is None:
            raise FileNotFoundError(f"{name}.v (instantiated by the {top} hierarchy) not in {', '.join(map(str, dirs))}")
        found[name] = path
        text = _COMMENT.sub("", path.read_text())
        todo.extend(m for m in _INST.findall(text) if m != name)
    return list(found.values())


def _missing() -> str | None:
    reason = rtl_runner.missing_simulator()
    if reason:
        return reason
    try:
        import cocotb  # noqa: F401
    except ImportError:
        return "cocotb not installed (pip install -e '.[test]')"
    return None


pytestmark = pytest.mark.skipif(_missing() is not None, reason=str(_missing()))

REDUCE_TESTS = ["reduce_vectors", "reduce_short_segments", "reduce_flag", "reduce_reset", "reduce_throughput"]
ADAMW_TESTS = ["adamw_vectors", "adamw_decay_boundaries", "adamw_multistep", "adamw_reset", "adamw_throughput"]
DT = {"fp32": 0, "bf16": 1, "fp16": 2}


def _dsp(dsp_shape: int) -> dict:
    """The DSP_SHAPE parameter, given only when not the default (so default builds are unchanged)."""
    return {"DSP_SHAPE": dsp_shape} if dsp_shape else {}


def run_reduce(lanes: int, gdtype: str, block: int, config: dict, tests=REDUCE_TESTS, dirs=(RTL_DIR,),
               dsp_shape: int = 0):
    config = {"lanes": lanes, "gdtype": gdtype, "block": block, **config}
    t0 = time.monotonic()
    rtl_runner.run("l2l_eps_reduce", sources("l2l_eps_reduce", dirs), "tb_eps_datapath",
                   parameters={"LANES": lanes, "GDTYPE": DT[gdtype], "BLOCK": block, **_dsp(dsp_shape)},
                   env={"L2L_TB_CONFIG": json.dumps(config)}, testcase=list(tests))
    return time.monotonic() - t0


def run_adamw(lanes: int, cdtype: str, config: dict, tests=ADAMW_TESTS, dirs=(RTL_DIR,), dsp_shape: int = 0):
    config = {"lanes": lanes, "cdtype": cdtype, **config}
    t0 = time.monotonic()
    rtl_runner.run("l2l_eps_adamw", sources("l2l_eps_adamw", dirs), "tb_eps_datapath",
                   parameters={"LANES": lanes, "CDTYPE": DT[cdtype], **_dsp(dsp_shape)},
                   env={"L2L_TB_CONFIG": json.dumps(config)}, testcase=list(tests))
    return time.monotonic() - t0


# --------------------------------------------------------------------------
# the vector classes themselves (no simulation): they test what they claim
# --------------------------------------------------------------------------


def test_vector_classes_do_what_they_say():
    import eps_vectors as ev
    from eps_oracle import Oracle

    rng = np.random.default_rng(3)
    n = 600
    for kind, ops in (("ties-products", ("p1", "b1m", "omb1g", "b2v", "ns")), ("ties-sums", ("m'", "v'", "p'", "d"))):
        c = ev.make_case(kind, rng, n, 1, "fp32")
        o = Oracle()
        g, _ = o.reduce(c.grad_bits, c.gdtype, c.s.inv_scale)
        o.adamw(c.p.astype(np.float64), c.m.astype(np.float64), c.v.astype(np.float64), g, c.s)
        for op in ops:
            assert o.ties[op] >= n // 8, (kind, op, o.ties)
    for gd in ("fp32", "bf16", "fp16"):
        c = ev.make_case("ties-reduction", rng, n, 3, gd)
        o = Oracle()
        assert o.reduce(c.grad_bits, gd, c.s.inv_scale)[1]
        assert o.ties["acc"] >= n // 3, (gd, o.ties)
        for how in ev.NONFINITE:
            for K in (1, 2):
                if ev.reduce_applicable(f"nonfinite-{how}", K, gd):
                    c = ev.make_case(f"nonfinite-{how}", rng, 9, K, gd)
                    assert c.reduced()[1] is False, (how, K, gd)
    c = ev.make_case("ties-copy", rng, n, 1, "fp32")
    o = Oracle()
    o.copy_bits(c.p.astype(np.float64), "bf16")
    o.copy_bits(c.p.astype(np.float64), "fp16")
    assert o.ties["copy-bf16"] >= n // 4 and o.ties["copy-fp16"] >= n // 4, o.ties


def test_sources_follow_the_hierarchy():
    names = {p.name for p in sources("l2l_eps_lane")}
    assert {"l2l_eps_lane.v", "l2l_delay.v"} <= names


# --------------------------------------------------------------------------
# default suite: a covering subset
# --------------------------------------------------------------------------

REDUCE_DEFAULT = [
    # lanes, gdtype, block, ns (sizes cycle over the (kind, K) plan), segs (beats per block)
    (1, "fp32", 16, [1, 37, 16 * 3 + 5], [16, 5]),
    (4, "bf16", 8, [1, 4 * 8 * 2 + 5, 13], [8, 3]),
    (4, "fp16", 64, [3, 4 * 64 + 7, 50], [64, 20]),
    (16, "fp32", 16, [16 * 33 + 1, 5], [16, 7]),
]
ADAMW_DEFAULT = [
    # lanes, cdtype, ns (cycled over the vector classes)
    (1, "fp16", [1, 37, 16, 100]),
    (4, "bf16", [4 * 5 + 3, 1, 9, 64]),
    (4, "fp32", [4 * 4 + 1, 30]),
    (16, "bf16", [16 * 2 + 5]),
]


@pytest.mark.parametrize("lanes,gdtype,block,ns,segs", REDUCE_DEFAULT,
                         ids=[f"L{a}-{b}-B{c}" for a, b, c, *_ in REDUCE_DEFAULT])
@pytest.mark.heavy
def test_reduce(lanes, gdtype, block, ns, segs):
    config = {"ns": ns, "segs": segs, "seed": lanes * 10 + DT[gdtype], "throughput_beats": 192,
              "short_segs": list(range(1, block + 1))[:8]}
    tests = REDUCE_TESTS
    if lanes > 4:   # wide and slow to simulate: a few classes, the flag and the rate
        config.update(kinds=["wide", "nonfinite-nan", "specials-default-t1"], Ks=[1, 4])
        tests = ["reduce_vectors", "reduce_flag", "reduce_throughput"]
    run_reduce(lanes, gdtype, block, config, tests)


@pytest.mark.heavy
@pytest.mark.parametrize("lanes,cdtype,ns", ADAMW_DEFAULT, ids=[f"L{a}-{b}" for a, b, _ in ADAMW_DEFAULT])
def test_adamw(lanes, cdtype, ns):
    import eps_vectors as ev
    config = {"ns": ns, "kinds": ev.ADAMW_KINDS, "Ks": [1, 2, 4], "segs": [3, 1, 64],
              "seed": lanes * 10 + DT[cdtype], "steps": 3, "throughput_beats": 160}
    tests = ADAMW_TESTS
    if lanes > 4:   # 16 lanes simulate slowly: two classes and the rate
        config.update(kinds=["wide", "ties-copy"], throughput_beats=96)
        tests = ["adamw_vectors", "adamw_throughput"]
    run_adamw(lanes, cdtype, config, tests)


@pytest.mark.heavy
def test_adamw_xilinx_dsp():
    """The AdamW datapath with the 27x18 (DSP48E2) multipliers, LANES = 2: every vector class
    and several steps bit for bit, the same latency and full rate (the multiplier alone:
    tests/test_rtl_fp_units.py)."""
    import eps_vectors as ev
    config = {"ns": [2 * 5 + 1, 24, 40], "kinds": ev.ADAMW_KINDS, "Ks": [1, 2], "segs": [3, 64],
              "seed": 31, "steps": 3, "throughput_beats": 64}
    run_adamw(2, "fp32", config, ["adamw_vectors", "adamw_multistep", "adamw_throughput"], dsp_shape=1)


# --------------------------------------------------------------------------
# slow: the full cross product, larger vectors
# --------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("gdtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("lanes", [1, 4, 16])
def test_reduce_full(lanes, gdtype):
    block = {1: 64, 4: 16, 16: 8}[lanes]
    config = {"ns": [1, lanes * block * 3 + 1, lanes * 7 + lanes // 2 + 1, 700], "segs": [block, 7, 1],
              "seed": 1000 + lanes * 10 + DT[gdtype], "throughput_beats": 512,
              "short_segs": list(range(1, block + 1))}
    run_reduce(lanes, gdtype, block, config)


@pytest.mark.slow
@pytest.mark.parametrize("cdtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("lanes", [1, 4, 16])
def test_adamw_full(lanes, cdtype):
    import eps_vectors as ev
    config = {"ns": [1, lanes * 40 + 3, 257, lanes], "kinds": ev.ADAMW_KINDS, "Ks": [1, 2, 4],
              "segs": [1, 8, 64], "seed": 2000 + lanes * 10 + DT[cdtype], "steps": 12,
              "multistep_n": lanes * 20 + 5, "throughput_beats": 512}
    run_adamw(lanes, cdtype, config)


@pytest.mark.slow
@pytest.mark.parametrize("top", ["reduce", "adamw"])
def test_full_xilinx_dsp(top):
    """test_reduce_full and test_adamw_full at LANES = 4 (bf16) with the 27x18 multipliers."""
    import eps_vectors as ev
    if top == "reduce":
        config = {"ns": [1, 4 * 16 * 3 + 1, 4 * 7 + 3, 700], "segs": [16, 7, 1], "seed": 3041,
                  "throughput_beats": 512, "short_segs": list(range(1, 17))}
        run_reduce(4, "bf16", 16, config, dsp_shape=1)
    else:
        config = {"ns": [1, 4 * 40 + 3, 257, 4], "kinds": ev.ADAMW_KINDS, "Ks": [1, 2, 4],
                  "segs": [1, 8, 64], "seed": 4041, "steps": 12, "multistep_n": 4 * 20 + 5,
                  "throughput_beats": 512}
        run_adamw(4, "bf16", config, dsp_shape=1)
