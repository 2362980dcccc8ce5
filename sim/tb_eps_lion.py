"""cocotb testbench of the RTL Lion datapath (fpga/rtl/l2l_eps_lion.v).

Everything is compared bit for bit (NaN == NaN) with the golden model
``l2l.eps.numerics.lion_update`` on the contract's vector classes for Lion
(sim/lion_vectors.py): p', m' and the device copy of every element, tkeep and
tlast of every output beat. Streams are driven and taken with seeded random
bubbles on the input and random backpressure on the output (the stream
driver and monitor are sim/tb_eps_datapath.py's); the throughput test drives
with neither.

tests/test_rtl_lion.py runs these through sim/rtl_runner.py with the
configuration as JSON in $L2L_TB_CONFIG: lanes, cdtype, kinds, Ks, gdtypes,
ns, segs (beats per tlast), seed, idle, backpressure (probabilities of a
bubble / a not-ready cycle), steps, multistep_n, throughput_beats.

The per-lane decay bit (s_axis_decay) is driven from each case's decay
boundary (lane i of beat b is decayed iff b*LANES + i < n_decay), and the
golden model gets the same boundary.
"""
from __future__ import annotations

import zlib

import cocotb
import numpy as np
from cocotb.clock import Clock
from cocotb.triggers import RisingEdge

import eps_vectors as ev
import lion_vectors as lv
from l2l.eps import LionScalars, OptimizerHyper
from tb_eps_datapath import (JUNK32, BeatSink, BeatSource, assert_words, cfg, decay_of, f32_word, keep_of, pack,
                             padded, random_pause, unpack)

SCALAR_PORTS = ["decay", "b1", "omb1", "b2", "omb2", "neg_lr"]


class LionTB:
    def __init__(self, dut):
        self.dut = dut
        self.lanes = len(dut.s_axis_tkeep)
        self.cdtype = cfg("cdtype", "fp32")
        self.cw = ev.DTYPE_BITS[self.cdtype]
        assert len(dut.m_axis_c) == self.cw * self.lanes, "CDTYPE of the build and the config differ"
        assert self.lanes == int(cfg("lanes", self.lanes))
        self.log = dut._log
        cocotb.start_soon(Clock(dut.clk, 10, unit="ns", impl="gpi").start(start_high=False))
        self.source = BeatSource(dut.clk, dut.s_axis_tvalid, dut.s_axis_tready,
                                 {"g": dut.s_axis_g, "p": dut.s_axis_p, "m": dut.s_axis_m,
                                  "tkeep": dut.s_axis_tkeep, "decay": dut.s_axis_decay,
                                  "tlast": dut.s_axis_tlast})
        self.sink = BeatSink(dut.clk, dut.m_axis_tvalid, dut.m_axis_tready,
                             {"p": dut.m_axis_p, "m": dut.m_axis_m, "c": dut.m_axis_c,
                              "tkeep": dut.m_axis_tkeep, "tlast": dut.m_axis_tlast})
        dut.rst.value = 1
        for name in SCALAR_PORTS:
            getattr(dut, name).value = 0

    def pauses(self, seed: int) -> None:
        self.source.set_pause_generator(random_pause(seed, float(cfg("idle", 0.3))))
        self.sink.set_pause_generator(random_pause(seed + 1, float(cfg("backpressure", 0.3))))

    async def cycles(self, n):
        for _ in range(n):
            await RisingEdge(self.dut.clk)

    async def reset(self):
        self.dut.rst.value = 1
        await self.cycles(3)
        self.dut.rst.value = 0
        await self.cycles(2)

    def set_scalars(self, s: LionScalars) -> None:
        for name in SCALAR_PORTS:
            getattr(self.dut, name).value = f32_word(getattr(s, name))

    def beats(self, p, m, g, n_decay: int, last_every: int) -> list:
        L, n = self.lanes, p.size
        rows = {k: padded(ev.words(a), L, JUNK32) for k, a in (("g", g), ("p", p), ("m", m))}
        nb = rows["p"].shape[0]
        return [{"g": pack(rows["g"][b]), "p": pack(rows["p"][b]), "m": pack(rows["m"][b]),
                 "tkeep": keep_of(n, L, b), "tlast": int(b % last_every == last_every - 1 or b == nb - 1),
                 "decay": decay_of(n_decay, L, b)} for b in range(nb)]

    def outputs(self, got: list, n: int):
        L = self.lanes
        p, m = (np.concatenate([unpack(b[k], L, 32) for b in got])[:n] for k in "pm")
        c = np.concatenate([unpack(b["c"], L, self.cw) for b in got])[:n]
        return p, m, c

    async def check(self, case: lv.LionCase, last_every: int, g=None):
        """One update of ``case`` compared bit for bit with the golden model; returns the RTL's
        (p', m')."""
        if g is None:
            g = case.reduced()[0]
        n, L = case.n, self.lanes
        n_decay = n if case.n_decay is None else case.n_decay
        what = f"{case.name} n={n} K={case.K} {case.gdtype} -> {self.cdtype} n_decay={case.n_decay}"
        self.set_scalars(case.s)
        sent = self.beats(case.p, case.m, g, n_decay, last_every)
        self.source.send(sent)
        await self.sink.wait_for(len(sent), 60 * len(sent) + 400, what)
        got = self.sink.take()
        for i, (b, s) in enumerate(zip(got, sent)):
            assert b["tkeep"] == s["tkeep"], f"{what}: tkeep of output beat {i}"
            assert b["tlast"] == s["tlast"], f"{what}: tlast of output beat {i}"
        p2, m2, c = self.outputs(got, n)
        rp, rm, rc = case.updated(self.cdtype, g)
        inputs = {"p": ev.words(case.p), "m": ev.words(case.m), "g": ev.words(g)}
        assert_words(p2, ev.words(rp), "fp32", f"{what}: p'", inputs)
        assert_words(m2, ev.words(rm), "fp32", f"{what}: m'", inputs)
        assert_words(c, ev.words(rc), self.cdtype, f"{what}: copy", inputs)
        return p2.view(np.float32), m2.view(np.float32)


@cocotb.test()
async def lion_vectors(dut):
    """Every Lion vector class (sim/lion_vectors.py), each with a decay boundary of
    eps_vectors.decay_boundaries in turn, under random input bubbles and output backpressure:
    p', m' and the copy bit-exact, tkeep/tlast carried per beat."""
    tb = LionTB(dut)
    seed = int(cfg("seed", 1))
    tb.pauses(seed)
    await tb.reset()
    kinds = cfg("kinds", lv.LION_KINDS)
    ns, Ks = cfg("ns", [1, 37]), cfg("Ks", [1, 2])
    gds, segs = cfg("gdtypes", ["fp32", "bf16", "fp16"]), cfg("segs", [4])
    moved = still = 0
    for i, kind in enumerate(kinds):
        n, K, gd, seg = ns[i % len(ns)], Ks[i % len(Ks)], gds[i % len(gds)], segs[i % len(segs)]
        if not lv.applicable(kind, K, gd):
            K, gd = 1, "fp32"
        rng = np.random.default_rng(zlib.crc32(f"{seed}-{kind}-{n}-{K}-{gd}".encode()))
        case = lv.make_case(kind, rng, n, K, gd)
        bounds = ev.decay_boundaries(n, tb.lanes)
        case.n_decay = bounds[i % len(bounds)]     # the classes meet the boundaries in turn
        g = case.reduced()[0]
        await tb.check(case, seg, g)
        with np.errstate(all="ignore"):
            c = np.float32(case.s.b1) * case.m + np.float32(case.s.omb1) * g
        still += int((c == 0).sum())
        moved += int((c != 0).sum())
        tb.log.info("lion %s n=%d K=%d %s -> %s n_decay=%d: ok", kind, n, case.K, case.gdtype, tb.cdtype,
                    case.n_decay)
    tb.log.info("lion_vectors: %d elements stepped, %d with c a zero", moved, still)
    if "czero" in kinds:
        assert still > 0, "no element had c a zero"


@cocotb.test()
async def lion_decay_boundaries(dut):
    """The parameter groups' boundary at every place that matters (eps_vectors.decay_boundaries:
    0, 1, n - 1, n, inside a beat, on a beat edge, on the edges of 2-beat bursts and 3-beat
    blocks, above n) on one layer, the updates streamed back to back, with bubbles and
    backpressure: the elements below it decayed, the others not, bit-exact."""
    tb = LionTB(dut)
    seed = int(cfg("seed", 1)) + 21
    tb.pauses(seed)
    await tb.reset()
    L = tb.lanes
    n = 2 * L + L // 2 + 1                             # a partial last beat
    rng = np.random.default_rng(seed)
    case = lv.make_case("wide", rng, n, 1, "fp32")
    case.s = lv.lion_scalars(decay=0.75, neg_lr=-2.0 ** -20)   # p * decay != p for most p: a wrong bit shows
    tb.set_scalars(case.s)
    g = case.reduced()[0]
    bounds = ev.decay_boundaries(n, L, burst=2, block=3)
    assert {0, 1, n - 1, n} <= set(bounds)
    nb = -(-n // L)
    tb.source.send([b for nd in bounds for b in tb.beats(case.p, case.m, g, nd, nb)])
    await tb.sink.wait_for(nb * len(bounds), 60 * nb * len(bounds) + 600, "decay boundaries")
    got = tb.sink.take()
    inputs = {"p": ev.words(case.p), "m": ev.words(case.m), "g": ev.words(g)}
    for j, nd in enumerate(bounds):
        case.n_decay = nd
        want = case.updated(tb.cdtype, g)
        for k, w, fmt in zip(("p", "m", "c"), want, ("fp32", "fp32", tb.cdtype)):
            out = tb.outputs(got[j * nb:(j + 1) * nb], n)["pmc".index(k)]
            assert_words(out, ev.words(w), fmt, f"n={n} n_decay={nd}: {k}", inputs)


@cocotb.test()
async def lion_multistep(dut):
    """A run of several steps on one state: the RTL's own p', m' are fed back as the next
    step's state, each step equal to the golden model's from the same state, K = 2 bf16
    contributions reduced by the golden model, a decay boundary inside a beat."""
    tb = LionTB(dut)
    seed = int(cfg("seed", 1)) + 7
    tb.pauses(seed)
    await tb.reset()
    L = tb.lanes
    steps, n = int(cfg("steps", 3)), int(cfg("multistep_n", 8 * L + 3))
    rng = np.random.default_rng(seed)
    half = n // 2
    p = np.concatenate([rng.standard_normal(half) * 0.02, ev.wide_f32(rng, n - half)]).astype(np.float32)
    m = np.zeros(n, np.float32)
    hyper = OptimizerHyper(lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.1, optimizer="lion")
    p0, K = p.copy(), 2
    for t in range(1, steps + 1):
        real = rng.standard_normal((K, half)) * 10.0 ** rng.uniform(-10, 3, (K, half))
        bits = [ev.round_bits(r, "fp32")[0] >> np.uint64(16) for r in real]
        grad_bits = [np.concatenate([b, ev.wide_grad_bits(rng, n - half, "bf16")]) for b in bits]
        s = LionScalars.compute(hyper, t, divisor=float(K))
        case = lv.LionCase(f"step {t}", p, m, grad_bits, "bf16", s, n_decay=n // 2 + 1)
        g, finite = case.reduced()
        assert finite
        p, m = await tb.check(case, 5, g)
    assert not np.array_equal(p[:half], p0[:half]), "the realistic half did not move"


@cocotb.test()
async def lion_reset(dut):
    """rst with beats in flight and the output stalled: no stale beat comes out and the next
    update is exact."""
    tb = LionTB(dut)
    await tb.reset()
    L = tb.lanes
    rng = np.random.default_rng(12)
    case = lv.make_case("wide", rng, L * 40, 1, "fp32")
    tb.set_scalars(case.s)
    tb.sink.set_pause_generator(random_pause(3, 0.7))
    tb.source.send(tb.beats(case.p, case.m, case.reduced()[0], L * 20 + 1, 8))
    await tb.cycles(45)
    tb.source.abort()
    await tb.reset()
    tb.sink.take()
    tb.sink.set_pause_generator(None)
    await tb.check(lv.make_case("train", rng, L * 3 + 1, 2, "bf16"), 2)


@cocotb.test()
async def lion_throughput(dut):
    """Input always valid, output always ready: beats (LANES elements) per cycle >= 0.95 on
    both sides, the latency equals the DUT's LATENCY output, results still bit-exact."""
    tb = LionTB(dut)
    await tb.reset()
    L = tb.lanes
    beats = int(cfg("throughput_beats", 128))
    rng = np.random.default_rng(5)
    await tb.check(lv.make_case("wide", rng, beats * L, 1, "fp32"), 16)
    tin, tout = tb.source.times, tb.sink.times
    rate_in = (len(tin) - 1) / (tin[-1] - tin[0])
    rate_out = (len(tout) - 1) / (tout[-1] - tout[0])
    lat = tout[0] - tin[0]
    tb.log.info("THROUGHPUT lion LANES=%d copy=%s: input %.4f beats/cycle, output %.4f beats/cycle, "
                "latency %d cycles (DUT says %d)", L, tb.cdtype, rate_in, rate_out, lat, int(dut.latency.value))
    assert rate_in >= 0.95 and rate_out >= 0.95, (rate_in, rate_out)
    assert lat == int(dut.latency.value), (lat, int(dut.latency.value))
