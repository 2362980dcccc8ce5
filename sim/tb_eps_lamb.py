"""cocotb testbench of LAMB's first pass in the RTL EPS (fpga/rtl/l2l_eps_lamb_norms.v).

Compared bit for bit (NaN == NaN) with the golden model ``l2l.eps.numerics.lamb_norms``:
m' and v' of every element, tlast (the segment's last element) of every output transfer,
and per segment the 16 lane sums of p*p and of u2*u2, in segment order. Elements go in
one per transfer with s_axis_first / s_axis_last from the case's segments
(``numerics.lamb_segments`` of its tensor starts) and s_axis_decay from its n_decay.

tests/test_rtl_lamb.py runs this through sim/rtl_runner.py with the configuration as JSON in
$L2L_TB_CONFIG: cases (a list of {starts, n, n_decay, wd, t, zero: [lo, hi] elements set to
+0 in p, m, v, g, mzero: [lo, hi] elements with m = g = +0, scale}), seed, idle / backpressure (probabilities of an input bubble / a
not-ready cycle on each output), and for ``lamb_norms_throughput`` its case.
"""
from __future__ import annotations

import numpy as np
import cocotb
from cocotb.clock import Clock
from cocotb.triggers import RisingEdge

import eps_vectors as ev
from l2l.eps import OptimizerHyper
from l2l.eps.contract import LambScalars
from l2l.eps import numerics
from tb_eps_datapath import BeatSink, BeatSource, assert_words, cfg, f32_word, random_pause, unpack

SCALAR_PORTS = ["b1", "omb1", "b2", "omb2", "inv_bc2_sqrt", "eps", "inv_bc1", "wd"]
LANES = numerics.LANES


def make_case(spec: dict, rng):
    """p, m, v, g (binary32) over many binades, zeros of both signs among them; the
    scalars of a LAMB hyper-parameter set at step t."""
    n = int(spec["n"])
    scale = float(spec.get("scale", 3.0))

    def wide(lo=-scale, hi=scale):
        x = rng.standard_normal(n) * 10.0 ** rng.uniform(lo, hi, n)
        x[rng.random(n) < 0.03] = 0.0
        x[rng.random(n) < 0.03] = -0.0
        return x.astype(np.float32)

    p, m, g = wide(), wide(), wide()
    v = np.abs(wide())
    if "zero" in spec:
        lo, hi = spec["zero"]
        for a in (p, m, v, g):
            a[lo:hi] = 0.0
    if "mzero" in spec:               # m' = 0 there: u2 is wd*p or 0, a decay boundary shows
        lo, hi = spec["mzero"]
        m[lo:hi] = 0.0
        g[lo:hi] = 0.0
    hyper = OptimizerHyper(optimizer="lamb", lr=1e-3, weight_decay=float(spec.get("wd", 0.01)))
    s = LambScalars.compute(hyper, int(spec.get("t", 3)))
    return p, m, v, g, s


class LambNormsTB:
    def __init__(self, dut):
        self.dut = dut
        self.log = dut._log
        cocotb.start_soon(Clock(dut.clk, 10, unit="ns", impl="gpi").start(start_high=False))
        self.source = BeatSource(dut.clk, dut.s_axis_tvalid, dut.s_axis_tready,
                                 {"g": dut.s_axis_g, "p": dut.s_axis_p, "m": dut.s_axis_m, "v": dut.s_axis_v,
                                  "decay": dut.s_axis_decay, "first": dut.s_axis_first,
                                  "last": dut.s_axis_last})
        self.sink = BeatSink(dut.clk, dut.m_axis_tvalid, dut.m_axis_tready,
                             {"m": dut.m_axis_m, "v": dut.m_axis_v, "tlast": dut.m_axis_tlast})
        self.sums = BeatSink(dut.clk, dut.m_sums_valid, dut.m_sums_ready,
                             {"pp": dut.m_sums_pp, "uu": dut.m_sums_uu})
        dut.rst.value = 1
        for name in SCALAR_PORTS:
            getattr(dut, name).value = 0

    def pauses(self, seed: int) -> None:
        self.source.set_pause_generator(random_pause(seed, float(cfg("idle", 0.3))))
        self.sink.set_pause_generator(random_pause(seed + 1, float(cfg("backpressure", 0.3))))
        self.sums.set_pause_generator(random_pause(seed + 2, float(cfg("backpressure", 0.3))))

    async def reset(self):
        self.dut.rst.value = 1
        for _ in range(3):
            await RisingEdge(self.dut.clk)
        self.dut.rst.value = 0
        for _ in range(2):
            await RisingEdge(self.dut.clk)

    async def check(self, spec: dict, rng) -> None:
        p, m, v, g, s = make_case(spec, rng)
        n = p.size
        n_decay = int(spec.get("n_decay", n))
        seg = numerics.lamb_segments(spec["starts"], n)
        what = f"starts={spec['starts']} n={n} n_decay={n_decay} wd={s.wd}"
        for name in SCALAR_PORTS:
            getattr(self.dut, name).value = f32_word(getattr(s, name))
        first = np.zeros(n, bool)
        last = np.zeros(n, bool)
        first[seg.bounds[:-1]] = True
        last[seg.bounds[1:] - 1] = True
        words = {k: ev.words(a) for k, a in (("g", g), ("p", p), ("m", m), ("v", v))}
        self.source.send([{"g": int(words["g"][i]), "p": int(words["p"][i]), "m": int(words["m"][i]),
                           "v": int(words["v"][i]), "decay": int(i < n_decay), "first": int(first[i]),
                           "last": int(last[i])} for i in range(n)])
        await self.sink.wait_for(n, 10 * n + 400, what)
        await self.sums.wait_for(seg.count, 10 * n + 400, what + " (sums)")
        got, sums = self.sink.take(), self.sums.take()
        assert len(got) == n and len(sums) == seg.count, (what, len(got), len(sums))
        rm, rv = m.copy(), v.copy()
        want = numerics.lamb_norms(p.copy(), rm, rv, g, s, seg, n_decay=n_decay)
        inputs = {k: words[k] for k in "pmvg"}
        assert_words(np.array([b["m"] for b in got], np.uint32), ev.words(rm), "fp32", f"{what}: m'", inputs)
        assert_words(np.array([b["v"] for b in got], np.uint32), ev.words(rv), "fp32", f"{what}: v'", inputs)
        tl = np.array([b["tlast"] for b in got], bool)
        assert (tl == last).all(), f"{what}: tlast at {np.flatnonzero(tl != last)[:8]}"
        for k, b in enumerate(sums):
            for j, key in enumerate(("pp", "uu")):
                lanes = unpack(b[key], LANES, 32)
                w = ev.words(want[k, j])
                bad = ~((lanes == w) | (np.isnan(lanes.view(np.float32)) & np.isnan(want[k, j])))
                assert not bad.any(), (f"{what}: segment {k} [{seg.bounds[k]}, {seg.bounds[k + 1]}) sum of {key}: "
                                       f"lanes {np.flatnonzero(bad)} got {[hex(x) for x in lanes[bad]]} "
                                       f"want {[hex(x) for x in w[bad]]}")
        nz = int((want[:, 1] != 0).sum())
        self.log.info("lamb norms %s: %d elements, %d segments, %d nonzero u2 sums: ok", what, n, seg.count, nz)


@cocotb.test()
async def lamb_norms_vectors(dut):
    """Each configured case under random input bubbles and backpressure on both outputs."""
    tb = LambNormsTB(dut)
    seed = int(cfg("seed", 1))
    tb.pauses(seed)
    await tb.reset()
    rng = np.random.default_rng(seed)
    for spec in cfg("cases", [{"starts": [0, 1, 16, 32, 49], "n": 100}]):
        await tb.check(spec, rng)


@cocotb.test()
async def lamb_norms_throughput(dut):
    """No bubbles, no backpressure: one element per clock, one lost clock per segment."""
    tb = LambNormsTB(dut)
    await tb.reset()
    spec = cfg("throughput", {"starts": [0, 300], "n": 600})
    t0 = tb.source.cycle
    await tb.check(spec, np.random.default_rng(7))
    n = int(spec["n"])
    nseg = numerics.lamb_segments(spec["starts"], n).count
    took = tb.source.times[-1] - tb.source.times[-n] + 1
    assert took <= n + nseg, f"{n} elements took {took} clocks ({nseg} segments)"
    lat = int(dut.latency.value)
    tb.log.info("throughput: %d elements in %d clocks, %d segments; LATENCY %d (since %d)", n, took, nseg, lat, t0)


@cocotb.test()
async def lamb_norms_reset(dut):
    """A reset in the middle of a segment (sums part-accumulated, elements in flight), then a
    whole case: nothing of the first one leaks into the second's sums."""
    tb = LambNormsTB(dut)
    seed = int(cfg("seed", 1))
    tb.pauses(seed)
    await tb.reset()
    rng = np.random.default_rng(seed + 100)
    p, m, v, g, s = make_case({"n": 300, "scale": 2.0}, rng)
    for name in SCALAR_PORTS:
        getattr(dut, name).value = f32_word(getattr(s, name))
    w = {k: ev.words(a) for k, a in (("g", g), ("p", p), ("m", m), ("v", v))}
    tb.source.send([{"g": int(w["g"][i]), "p": int(w["p"][i]), "m": int(w["m"][i]), "v": int(w["v"][i]),
                     "decay": 1, "first": int(i % 100 == 0), "last": int(i % 100 == 99)} for i in range(300)])
    for _ in range(250):
        await RisingEdge(dut.clk)
    tb.source.abort()
    await tb.reset()
    tb.sink.take()
    tb.sums.take()
    await tb.check(cfg("after_reset", {"starts": [0, 5, 40], "n": 70, "n_decay": 50}), rng)
