"""cocotb testbenches of the RTL EPS datapath: l2l_eps_reduce and l2l_eps_adamw.

Everything is compared bit for bit (NaN == NaN) with the golden model
``l2l.eps.numerics`` on the contract's vector classes (sim/eps_vectors.py).
Streams are driven and taken with seeded random bubbles on the input and
random backpressure on the output; the throughput tests drive with neither.

tests/test_rtl_datapath.py runs these through sim/rtl_runner.py and passes the
configuration as JSON in $L2L_TB_CONFIG:

    lanes, gdtype (reduce) / cdtype (adamw), block (reduce),
    kinds, Ks, ns, segs (reduce: beats per block; adamw: beats per tlast),
    seed, idle, backpressure (probabilities of a bubble / a not-ready cycle),
    steps (adamw_multistep), throughput_beats.

The AdamW datapath's per-lane decay bit (s_axis_decay) is driven from each
case's decay boundary (eps_vectors.Case.n_decay: lane i of beat b is decayed
iff b*LANES + i < n_decay), and the golden model gets the same boundary.
"""
from __future__ import annotations

import json
import os
import random
import zlib

import cocotb
import numpy as np
from cocotb.clock import Clock
from cocotb.triggers import Event, First, RisingEdge, Timer
from cocotb.utils import get_sim_time

import eps_vectors as ev
from l2l.eps import OptimizerHyper, StepScalars

CFG = json.loads(os.environ.get("L2L_TB_CONFIG", "{}"))

JUNK32 = [0x7F800000, 0xFFC00001, 0x7FFFFFFF, 0xFF800000, 0x7F7FFFFF]   # inf, NaN, max: must not leak
JUNK16 = [0x7C00, 0xFE01, 0x7FFF, 0xFC00, 0x7F80]


def cfg(key, default):
    return CFG.get(key, default)


def clock_cycle() -> int:
    """The number of the rising edge now (10 ns clock, first edge at 5 ns): source and
    sink count the same edges even while one of them sleeps."""
    return int(get_sim_time("ns")) // 10 + 1


def random_pause(seed: int, p: float):
    """A pause generator: True (pause) with probability p each cycle, seeded."""
    rnd = random.Random(seed)
    while True:
        yield p > 0 and rnd.random() < p


# --------------------------------------------------------------------------
# stream driver and monitor (valid/ready, several data signals per beat)
# --------------------------------------------------------------------------


class BeatSource:
    """Drives one stream slave port: a beat is a dict {signal name: int}; tvalid is
    held until the DUT takes the beat (AXI-Stream rules); a pause generator inserts
    bubbles between beats. Records the cycle of every transfer."""

    def __init__(self, clk, valid, ready, signals: dict):
        self.clk, self.valid, self.ready, self.signals = clk, valid, ready, signals
        self.queue: list = []
        self.head = 0
        self.pause = None
        self.cycle = 0
        self.times: list[int] = []
        self._driving = False
        self._more = Event()
        self.valid.value = 0
        cocotb.start_soon(self._run())

    def set_pause_generator(self, gen=None):
        self.pause = gen

    def send(self, beats):
        self.queue.extend(beats)
        self._more.set()

    def idle(self) -> bool:
        return self.head >= len(self.queue) and not self._driving

    def abort(self):
        """Drop every beat not yet transferred and deassert tvalid now (for a reset)."""
        self.queue, self.head, self._driving = [], 0, False
        self.valid.value = 0

    async def _run(self):
        edge = RisingEdge(self.clk)
        while True:
            if not self._driving and self.head >= len(self.queue):
                self._more.clear()      # nothing to drive: sleep until send(), not every clock
                await self._more.wait()
            await edge
            self.cycle = clock_cycle()
            if self._driving and self.ready.value:
                self.times.append(self.cycle)
                self._driving = False
            if not self._driving:
                paused = next(self.pause) if self.pause is not None else False
                if self.head < len(self.queue) and not paused:
                    beat = self.queue[self.head]
                    self.head += 1
                    for name, val in beat.items():
                        self.signals[name].value = val
                    self.valid.value = 1
                    self._driving = True
                else:
                    self.valid.value = 0


class BeatSink:
    """Takes one stream master port: records every transferred beat as a dict of ints
    and its cycle; a pause generator deasserts tready (backpressure)."""

    def __init__(self, clk, valid, ready, signals: dict):
        self.clk, self.valid, self.ready, self.signals = clk, valid, ready, signals
        self.beats: list = []
        self.times: list[int] = []
        self.pause = None
        self.cycle = 0
        self.want = None
        self.got = Event()
        self.ready.value = 0
        cocotb.start_soon(self._run())

    def set_pause_generator(self, gen=None):
        self.pause = gen

    def take(self):
        beats, self.beats = self.beats, []
        return beats

    async def wait_for(self, count: int, limit: int, what: str):
        """Wait until ``count`` beats are in, at most ``limit`` cycles: one event set by
        the monitor, not a second coroutine polling every clock (the clocks are the time)."""
        if len(self.beats) < count:
            self.want = count
            self.got.clear()
            await First(self.got.wait(), Timer(10 * limit, "ns"))
            self.want = None
        assert len(self.beats) >= count, f"{what}: {len(self.beats)} of {count} output beats after {limit} cycles"

    async def _run(self):
        edge, rise = RisingEdge(self.clk), RisingEdge(self.valid)
        ready = 0
        while True:
            if ready and self.valid.value == 0:
                await rise              # ready and nothing offered: sleep until tvalid rises
            await edge
            self.cycle = clock_cycle()
            if ready and self.valid.value:
                beat = {}
                for name, h in self.signals.items():
                    try:
                        beat[name] = int(h.value)
                    except ValueError:
                        raise AssertionError(f"X or Z on {name} = {h.value} in output beat {len(self.beats)}"
                                             f" (cycle {self.cycle})") from None
                self.beats.append(beat)
                self.times.append(self.cycle)
                if self.want is not None and len(self.beats) >= self.want:
                    self.got.set()
            paused = next(self.pause) if self.pause is not None else False
            ready = 0 if paused else 1
            self.ready.value = ready


# --------------------------------------------------------------------------
# packing
# --------------------------------------------------------------------------


def pack(words_row: np.ndarray) -> int:
    """LANES unsigned words -> one bus value, lane i in the i-th word (little end first)."""
    return int.from_bytes(np.ascontiguousarray(words_row).tobytes(), "little")


def unpack(value: int, lanes: int, bits: int) -> np.ndarray:
    dt = ev.UINT_OF[bits]
    return np.frombuffer(value.to_bytes(lanes * bits // 8, "little"), dtype=dt).copy()


def padded(words_arr: np.ndarray, lanes: int, junk: list) -> np.ndarray:
    """The n words in beats of ``lanes``; lanes beyond n on the last beat hold junk (inf, NaN)."""
    n = words_arr.size
    nb = -(-n // lanes)
    out = np.empty(nb * lanes, words_arr.dtype)
    out[:n] = words_arr
    for i in range(n, nb * lanes):
        out[i] = junk[i % len(junk)]
    return out.reshape(nb, lanes)


def keep_of(n: int, lanes: int, beat: int) -> int:
    valid = min(lanes, n - beat * lanes)
    return (1 << valid) - 1


def decay_of(n_decay: int, lanes: int, beat: int) -> int:
    """The decay bits of a beat: lane i set iff its element index beat*lanes + i < n_decay."""
    return (1 << max(0, min(lanes, n_decay - beat * lanes))) - 1


def is_nan(w: np.ndarray, bits: int) -> np.ndarray:
    w = w.astype(np.uint64)
    if bits == 32:
        return (w & 0x7FFFFFFF) > 0x7F800000
    return (w & 0x7FFF) > 0x7C00


def is_nan_fmt(w, fmt: str):
    w = np.asarray(w).astype(np.uint64)
    inf = {"fp32": 0x7F800000, "bf16": 0x7F80, "fp16": 0x7C00}[fmt]
    mag = {"fp32": 0x7FFFFFFF, "bf16": 0x7FFF, "fp16": 0x7FFF}[fmt]
    return (w & mag) > inf


def assert_words(got, want, fmt: str, what: str, inputs: dict | None = None):
    """Bit-for-bit equality, NaN == NaN; the message names the first differing elements
    with their inputs."""
    got = np.asarray(got).astype(np.uint64)
    want = np.asarray(want).astype(np.uint64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    ok = (got == want) | (is_nan_fmt(got, fmt) & is_nan_fmt(want, fmt))
    if ok.all():
        return
    bad = np.flatnonzero(~ok)
    w = 8 if fmt == "fp32" else 4
    rows = []
    for i in bad[:6]:
        extra = ""
        if inputs:
            extra = "  inputs: " + ", ".join(f"{k}=0x{int(np.asarray(v).astype(np.uint64)[i]):x}"
                                            for k, v in inputs.items())
        rows.append(f"  [{i}] got 0x{int(got[i]):0{w}x} want 0x{int(want[i]):0{w}x}{extra}")
    raise AssertionError(f"{what}: {bad.size} of {got.size} elements differ\n" + "\n".join(rows))


def f32_word(x) -> int:
    return int(np.asarray(x, np.float32).view(np.uint32))


# --------------------------------------------------------------------------
# l2l_eps_reduce
# --------------------------------------------------------------------------


class ReduceTB:
    def __init__(self, dut):
        self.dut = dut
        self.lanes = len(dut.s_axis_tkeep)
        self.gdtype = cfg("gdtype", "fp32")
        self.gw = ev.DTYPE_BITS[self.gdtype]
        self.block = int(cfg("block", 64))
        assert len(dut.s_axis_tdata) == self.gw * self.lanes, "GDTYPE of the build and the config differ"
        assert self.lanes == int(cfg("lanes", self.lanes))
        self.log = dut._log
        cocotb.start_soon(Clock(dut.clk, 10, unit="ns", impl="gpi").start(start_high=False))
        self.source = BeatSource(dut.clk, dut.s_axis_tvalid, dut.s_axis_tready,
                                 {"tdata": dut.s_axis_tdata, "tkeep": dut.s_axis_tkeep,
                                  "tlast": dut.s_axis_tlast})
        self.sink = BeatSink(dut.clk, dut.m_axis_tvalid, dut.m_axis_tready,
                             {"tdata": dut.m_axis_tdata, "tkeep": dut.m_axis_tkeep, "tlast": dut.m_axis_tlast})
        dut.rst.value = 1
        dut.flag_clear.value = 0
        dut.k.value = 1
        dut.inv_scale.value = 0x3F800000

    def set_idle_generator(self, gen=None):
        self.source.set_pause_generator(gen)

    def set_backpressure_generator(self, gen=None):
        self.sink.set_pause_generator(gen)

    async def cycles(self, n):
        for _ in range(n):
            await RisingEdge(self.dut.clk)

    async def reset(self):
        self.dut.rst.value = 1
        await self.cycles(3)
        self.dut.rst.value = 0
        await self.cycles(2)
        assert int(self.dut.finite.value) == 1, "finite after reset"

    async def clear_flag(self):
        self.dut.flag_clear.value = 1
        await RisingEdge(self.dut.clk)
        self.dut.flag_clear.value = 0
        await RisingEdge(self.dut.clk)
        assert int(self.dut.finite.value) == 1, "finite after flag_clear"

    def beats(self, case: ev.Case, seg: int):
        """The input stream: per block of ``seg`` beats, contribution 0's segment, then 1's, ..."""
        L = self.lanes
        junk = JUNK32 if self.gw == 32 else JUNK16
        rows = [padded(case.grad_words(k), L, junk) for k in range(case.K)]
        nb = rows[0].shape[0]
        out = []
        for b0 in range(0, nb, seg):
            b1 = min(b0 + seg, nb)
            for k in range(case.K):
                for b in range(b0, b1):
                    out.append({"tdata": pack(rows[k][b]), "tkeep": keep_of(case.n, L, b),
                                "tlast": int(b == b1 - 1)})
        return out

    async def run(self, case: ev.Case, seg: int, clear: bool = True, timeout: int | None = None):
        """Stream ``case`` through and check g, tkeep, tlast (not the flag: returned)."""
        assert 1 <= seg <= self.block
        L = self.lanes
        self.dut.k.value = case.K
        self.dut.inv_scale.value = f32_word(case.s.inv_scale)
        if clear:
            await self.clear_flag()
        beats = self.beats(case, seg)
        nb = -(-case.n // L)
        self.source.send(beats)
        limit = timeout or (60 * len(beats) + 400)
        await self.sink.wait_for(nb, limit, case.name)
        await self.cycles(2)
        got = self.sink.take()
        assert len(got) == nb
        g_ref, finite_ref = case.reduced()
        g = np.concatenate([unpack(b["tdata"], L, 32) for b in got])[:case.n]
        for i, b in enumerate(got):
            assert b["tkeep"] == keep_of(case.n, L, i), f"{case.name}: tkeep of output beat {i}"
            want_last = int((i % seg) == seg - 1 or i == nb - 1)
            assert b["tlast"] == want_last, f"{case.name}: tlast of output beat {i}"
        inputs = {f"g{k}": case.grad_bits[k] for k in range(case.K)}
        assert_words(g, ev.words(g_ref), "fp32", f"{case.name} n={case.n} K={case.K} seg={seg}: g", inputs)
        return int(self.dut.finite.value), finite_ref


def _plan(kinds, Ks, ns, segs, gdtype, applicable):
    """Every (kind, K) applicable, each with an n and a seg taken in turn from the lists."""
    out = []
    i = 0
    for kind in kinds:
        for K in Ks:
            if not applicable(kind, K, gdtype):
                continue
            out.append((kind, K, ns[i % len(ns)], segs[(i // len(ns) + i) % len(segs)]))
            i += 1
    return out


@cocotb.test()
async def reduce_vectors(dut):
    """Every vector class x K with random input bubbles and output backpressure:
    g bit-exact, tkeep/tlast per beat, finite flag equal to the golden model's."""
    tb = ReduceTB(dut)
    seed = int(cfg("seed", 1))
    tb.set_idle_generator(random_pause(seed, float(cfg("idle", 0.3))))
    tb.set_backpressure_generator(random_pause(seed + 1, float(cfg("backpressure", 0.3))))
    await tb.reset()
    plan = _plan(cfg("kinds", ev.REDUCE_KINDS), cfg("Ks", [1, 2, 4]), cfg("ns", [1, 37]),
                 cfg("segs", [tb.block]), tb.gdtype, ev.reduce_applicable)
    assert plan, "nothing to run"
    for kind, K, n, seg in plan:
        rng = np.random.default_rng(zlib.crc32(f"{seed}-{kind}-{K}-{n}-{tb.gdtype}".encode()))
        case = ev.make_case(kind, rng, n, K, tb.gdtype)
        finite, finite_ref = await tb.run(case, min(seg, tb.block))
        assert finite == int(finite_ref), f"{kind} K={K} n={n}: finite {finite}, golden {finite_ref}"
        if kind.startswith("nonfinite"):
            assert not finite_ref, f"{kind}: the class is meant to be non-finite"
        tb.log.info("reduce %s K=%d n=%d seg=%d: ok (finite=%d)", kind, K, n, seg, finite)


@cocotb.test()
async def reduce_short_segments(dut):
    """Segments shorter than the adder pipeline (the read-after-write hazard on the
    accumulator): every segment length from 1 to BLOCK, K = 2..4, with bubbles and
    backpressure, bit-exact."""
    tb = ReduceTB(dut)
    seed = int(cfg("seed", 1)) + 100
    tb.set_idle_generator(random_pause(seed, float(cfg("idle", 0.3))))
    tb.set_backpressure_generator(random_pause(seed + 1, float(cfg("backpressure", 0.3))))
    await tb.reset()
    L = tb.lanes
    seg_list = cfg("short_segs", list(range(1, min(tb.block, 12) + 1)))
    for i, seg in enumerate(seg_list):
        K = [2, 3, 4][i % 3]
        n = L * (2 * seg + 1) - (i % L)            # two full blocks and a one-beat tail
        rng = np.random.default_rng(seed * 1000 + seg)
        case = ev.make_case("wide", rng, n, K, tb.gdtype)
        finite, finite_ref = await tb.run(case, seg)
        assert finite == int(finite_ref)
    # and with the input always valid and the output always ready (back-to-back segments)
    tb.set_idle_generator(None)
    tb.set_backpressure_generator(None)
    for seg in (1, 2, 3, 5):
        rng = np.random.default_rng(seed + seg)
        case = ev.make_case("ties-reduction", rng, L * 3 * seg, 4, tb.gdtype)
        await tb.run(case, min(seg, tb.block))


@cocotb.test()
async def reduce_flag(dut):
    """The flag is sticky until flag_clear, ignores junk (inf, NaN) in lanes beyond n,
    and drops for a non-finite element in any lane of any beat."""
    tb = ReduceTB(dut)
    await tb.reset()
    L = tb.lanes
    rng = np.random.default_rng(7)
    n = 3 * L + 1                                         # the last beat has L - 1 junk lanes
    bad = ev.make_case("nonfinite-nan", rng, n, 2, tb.gdtype)
    good = ev.make_case("wide", rng, n, 2, tb.gdtype)
    finite, ref = await tb.run(good, tb.block)
    assert (finite, ref) == (1, True), "junk lanes beyond n raised the flag"
    finite, ref = await tb.run(bad, tb.block)
    assert (finite, ref) == (0, False)
    finite, ref = await tb.run(good, tb.block, clear=False)
    assert (finite, ref) == (0, True), "flag not sticky"
    finite, ref = await tb.run(good, tb.block, clear=True)
    assert finite == 1, "flag_clear did not set the flag"
    # a non-finite value in each lane position of a full beat
    for lane in range(L):
        case = ev.make_case("wide", rng, 2 * L, 1, tb.gdtype)
        case.grad_bits[0][L + lane] = 0x7F800000 if tb.gw == 32 else (0x7F80 if tb.gdtype == "bf16" else 0x7C00)
        finite, ref = await tb.run(case, tb.block)
        assert (finite, ref) == (0, False), f"inf in lane {lane} not flagged"


@cocotb.test()
async def reduce_reset(dut):
    """rst in the middle of a segment (beats in flight, a non-finite value already out,
    the output stalled) leaves nothing behind: the flag is 1 again and the next layer is exact."""
    tb = ReduceTB(dut)
    await tb.reset()
    L = tb.lanes
    rng = np.random.default_rng(11)
    for K, cut in ((3, 0.5), (1, 0.3), (2, 0.8)):
        case = ev.make_case("nonfinite-+inf", rng, L * tb.block * 2 + 3, K, tb.gdtype)
        case.grad_bits[K - 1][0] = case.grad_bits[K - 1][case.meta["at"]]   # the inf early too
        dut.k.value = K
        dut.inv_scale.value = f32_word(case.s.inv_scale)
        beats = tb.beats(case, tb.block)
        tb.set_backpressure_generator(random_pause(K, 0.5))
        tb.source.send(beats[:int(len(beats) * cut)])
        await tb.cycles(int(len(beats) * cut) + 6)
        tb.source.abort()
        await tb.reset()
        tb.sink.take()
        tb.set_backpressure_generator(None)
        good = ev.make_case("wide", rng, L * 5 + 1, 2, tb.gdtype)
        finite, ref = await tb.run(good, min(4, tb.block), clear=False)
        assert (finite, ref) == (1, True)


@cocotb.test()
async def reduce_throughput(dut):
    """Input always valid, output always ready, segments of BLOCK beats: input beats
    accepted per cycle (= elements per cycle per lane) >= 0.95 for K = 1, and for K = 2
    when BLOCK is at least the pipeline depth; output beats per cycle >= 0.95 for K = 1;
    the measured latency equals the `latency` output; results still bit-exact."""
    tb = ReduceTB(dut)
    await tb.reset()
    L = tb.lanes
    beats = int(cfg("throughput_beats", 256))
    for K in (1, 2):
        rng = np.random.default_rng(40 + K)
        case = ev.make_case("wide", rng, beats * L, K, tb.gdtype)
        t_in, t_out = len(tb.source.times), len(tb.sink.times)
        await tb.run(case, tb.block)
        tin = tb.source.times[t_in:]
        tout = tb.sink.times[t_out:]
        rate_in = (len(tin) - 1) / (tin[-1] - tin[0])
        rate_out = (len(tout) - 1) / (tout[-1] - tout[0])
        lat = tout[0] - tin[(K - 1) * min(tb.block, beats)]
        tb.log.info("THROUGHPUT reduce LANES=%d %s BLOCK=%d K=%d: input %.4f beats/cycle, output %.4f "
                    "beats/cycle, latency %d cycles (DUT says %d)", L, tb.gdtype, tb.block, K, rate_in,
                    rate_out, lat, int(dut.latency.value))
        # K >= 2 reads the accumulator back: full rate needs segments longer than the adder
        # pipeline (PRE + ADD_LAT < latency), else the read-after-write stall is by design
        if K == 1 or tb.block >= int(dut.latency.value):
            assert rate_in >= 0.95, f"K={K}: input {rate_in:.4f} beats per cycle"
        if K == 1:
            assert rate_out >= 0.95, f"output {rate_out:.4f} beats per cycle"
            assert lat == int(dut.latency.value), (lat, int(dut.latency.value))


# --------------------------------------------------------------------------
# l2l_eps_adamw
# --------------------------------------------------------------------------

SCALAR_PORTS = ["decay", "b1", "omb1", "b2", "omb2", "inv_bc2_sqrt", "eps", "neg_step"]


class AdamwTB:
    def __init__(self, dut):
        self.dut = dut
        self.lanes = len(dut.s_axis_tkeep)
        self.cdtype = cfg("cdtype", "fp32")
        self.cw = ev.DTYPE_BITS[self.cdtype]
        assert len(dut.m_axis_c) == self.cw * self.lanes, "CDTYPE of the build and the config differ"
        self.log = dut._log
        cocotb.start_soon(Clock(dut.clk, 10, unit="ns", impl="gpi").start(start_high=False))
        self.source = BeatSource(dut.clk, dut.s_axis_tvalid, dut.s_axis_tready,
                                 {"g": dut.s_axis_g, "p": dut.s_axis_p, "m": dut.s_axis_m, "v": dut.s_axis_v,
                                  "tkeep": dut.s_axis_tkeep, "decay": dut.s_axis_decay,
                                  "tlast": dut.s_axis_tlast})
        self.sink = BeatSink(dut.clk, dut.m_axis_tvalid, dut.m_axis_tready,
                             {"p": dut.m_axis_p, "m": dut.m_axis_m, "v": dut.m_axis_v, "c": dut.m_axis_c,
                              "tkeep": dut.m_axis_tkeep, "tlast": dut.m_axis_tlast})
        dut.rst.value = 1
        for name in SCALAR_PORTS:
            getattr(dut, name).value = 0

    def set_idle_generator(self, gen=None):
        self.source.set_pause_generator(gen)

    def set_backpressure_generator(self, gen=None):
        self.sink.set_pause_generator(gen)

    async def cycles(self, n):
        for _ in range(n):
            await RisingEdge(self.dut.clk)

    async def reset(self):
        self.dut.rst.value = 1
        await self.cycles(3)
        self.dut.rst.value = 0
        await self.cycles(2)

    async def update(self, p, m, v, g, s: StepScalars, last_every: int, what: str, n_decay: int | None = None):
        """Stream one update through (elements below ``n_decay`` decayed; None: all); returns
        (p', m', v', copy words) for the n elements after checking tkeep and tlast of every
        output beat."""
        L = self.lanes
        n = p.size
        n_decay = n if n_decay is None else n_decay
        for name in SCALAR_PORTS:
            getattr(self.dut, name).value = f32_word(getattr(s, name))
        rows = {k: padded(ev.words(a), L, JUNK32) for k, a in (("g", g), ("p", p), ("m", m), ("v", v))}
        nb = rows["p"].shape[0]
        lasts = [int(b % last_every == last_every - 1 or b == nb - 1) for b in range(nb)]
        self.source.send([{"g": pack(rows["g"][b]), "p": pack(rows["p"][b]), "m": pack(rows["m"][b]),
                           "v": pack(rows["v"][b]), "tkeep": keep_of(n, L, b), "tlast": lasts[b],
                           "decay": decay_of(n_decay, L, b)}
                          for b in range(nb)])
        limit = 60 * nb + 600
        await self.sink.wait_for(nb, limit, what)
        got = self.sink.take()
        for i, b in enumerate(got):
            assert b["tkeep"] == keep_of(n, L, i), f"{what}: tkeep of output beat {i}"
            assert b["tlast"] == lasts[i], f"{what}: tlast of output beat {i}"
        out = [np.concatenate([unpack(b[k], L, 32) for b in got])[:n] for k in "pmv"]
        c = np.concatenate([unpack(b["c"], L, self.cw) for b in got])[:n]
        return (*out, c)

    async def check(self, case: ev.Case, last_every: int, g=None):
        """One update of ``case`` compared bit for bit with the golden model; returns the RTL state."""
        if g is None:
            g = case.reduced()[0]
        what = f"{case.name} n={case.n} {self.cdtype}"
        what += f" n_decay={case.n_decay}"
        p2, m2, v2, c = await self.update(case.p, case.m, case.v, g, case.s, last_every, what, case.n_decay)
        rp, rm, rv, rc = case.updated(self.cdtype, g)
        inputs = {"p": ev.words(case.p), "m": ev.words(case.m), "v": ev.words(case.v), "g": ev.words(g)}
        assert_words(p2, ev.words(rp), "fp32", f"{what}: p'", inputs)
        assert_words(m2, ev.words(rm), "fp32", f"{what}: m'", inputs)
        assert_words(v2, ev.words(rv), "fp32", f"{what}: v'", inputs)
        assert_words(c, ev.words(rc), self.cdtype, f"{what}: copy", inputs)
        return p2, m2, v2


@cocotb.test()
async def adamw_vectors(dut):
    """Every vector class with random input bubbles and output backpressure: p', m', v'
    and the device copy bit-exact, tkeep/tlast carried per beat."""
    tb = AdamwTB(dut)
    seed = int(cfg("seed", 1))
    tb.set_idle_generator(random_pause(seed, float(cfg("idle", 0.3))))
    tb.set_backpressure_generator(random_pause(seed + 1, float(cfg("backpressure", 0.3))))
    await tb.reset()
    kinds = cfg("kinds", ev.ADAMW_KINDS)
    ns = cfg("ns", [1, 37])
    Ks = cfg("Ks", [1, 2])
    gds = cfg("gdtypes", ["fp32", "bf16", "fp16"])
    segs = cfg("segs", [4])
    for i, kind in enumerate(kinds):
        n, K, gd, seg = ns[i % len(ns)], Ks[i % len(Ks)], gds[i % len(gds)], segs[i % len(segs)]
        rng = np.random.default_rng(zlib.crc32(f"{seed}-{kind}-{n}-{K}-{gd}".encode()))
        case = ev.make_case(kind, rng, n, K, gd)
        bounds = ev.decay_boundaries(n, tb.lanes)
        case.n_decay = bounds[i % len(bounds)]     # the classes meet the boundaries in turn
        await tb.check(case, seg)
        tb.log.info("adamw %s n=%d K=%d %s -> %s n_decay=%d: ok", kind, case.n, case.K, case.gdtype, tb.cdtype,
                    case.n_decay)


@cocotb.test()
async def adamw_multistep(dut):
    """A run of several steps on one state: the RTL's own p', m', v' are fed back as the
    next step's state; each step must equal the golden model's step from the same state
    (so the two states stay identical all along), with bubbles and backpressure."""
    tb = AdamwTB(dut)
    seed = int(cfg("seed", 1)) + 7
    tb.set_idle_generator(random_pause(seed, float(cfg("idle", 0.3))))
    tb.set_backpressure_generator(random_pause(seed + 1, float(cfg("backpressure", 0.3))))
    await tb.reset()
    L = tb.lanes
    steps = int(cfg("steps", 3))
    n = int(cfg("multistep_n", 8 * L + 3))
    rng = np.random.default_rng(seed)
    half = n // 2
    p = np.concatenate([(rng.standard_normal(half) * 0.02), ev.wide_f32(rng, n - half)]).astype(np.float32)
    m = np.zeros(n, np.float32)
    v = np.zeros(n, np.float32)
    hyper = OptimizerHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    gdtype = cfg("multistep_gdtype", "bf16")
    K = 2
    p0 = p.copy()
    for t in range(1, steps + 1):
        real = rng.standard_normal((K, half)) * 10.0 ** rng.uniform(-10, 3, (K, half))
        bits = [ev.round_bits(r, "fp32")[0] for r in real]
        if gdtype == "bf16":
            bits = [b >> np.uint64(16) for b in bits]
        grad_bits = [np.concatenate([b, ev.wide_grad_bits(rng, n - half, gdtype)]) for b in bits]
        s = StepScalars.compute(hyper, t, divisor=float(K))
        # the decay boundary inside a beat (the parameter groups), the same at every step
        case = ev.Case(f"step {t}", p, m, v, grad_bits, gdtype, s, n_decay=n // 2 + 1)
        g, finite = case.reduced()
        assert finite
        p, m, v = await tb.check(case, 5, g)
        p, m, v = (a.view(np.float32) for a in (p, m, v))
    assert not np.array_equal(p[:half], p0[:half]), "the realistic half did not move"


@cocotb.test()
async def adamw_decay_boundaries(dut):
    """The parameter groups' boundary at every place that matters (eps_vectors.decay_boundaries:
    0, n, inside a beat, on a beat edge, above n) on one layer, the updates streamed back to back
    (one pipeline fill for all of them), with bubbles and backpressure: the elements below the
    boundary decayed, the others not, bit-exact."""
    tb = AdamwTB(dut)
    seed = int(cfg("seed", 1)) + 21
    tb.set_idle_generator(random_pause(seed, float(cfg("idle", 0.3))))
    tb.set_backpressure_generator(random_pause(seed + 1, float(cfg("backpressure", 0.3))))
    await tb.reset()
    L = tb.lanes
    n = 2 * L + L // 2 + 1                             # a partial last beat
    rng = np.random.default_rng(seed)
    case = ev.make_case("wide", rng, n, 1, "fp32")
    s = ev.custom_scalars(decay=0.75)                  # p * decay != p for most p: a wrong bit shows
    for name in SCALAR_PORTS:
        getattr(dut, name).value = f32_word(getattr(s, name))
    g = case.reduced()[0]
    rows = {k: padded(ev.words(a), L, JUNK32) for k, a in (("g", g), ("p", case.p), ("m", case.m), ("v", case.v))}
    nb = rows["p"].shape[0]
    bounds = ev.decay_boundaries(n, L, burst=2, block=3)
    tb.source.send([{"g": pack(rows["g"][b]), "p": pack(rows["p"][b]), "m": pack(rows["m"][b]),
                     "v": pack(rows["v"][b]), "tkeep": keep_of(n, L, b), "tlast": int(b == nb - 1),
                     "decay": decay_of(nd, L, b)} for nd in bounds for b in range(nb)])
    await tb.sink.wait_for(nb * len(bounds), 60 * nb * len(bounds) + 600, "decay boundaries")
    got = tb.sink.take()
    inputs = {"p": ev.words(case.p), "m": ev.words(case.m), "v": ev.words(case.v), "g": ev.words(g)}
    for j, nd in enumerate(bounds):
        beats = got[j * nb:(j + 1) * nb]
        want = ev.Case(case.name, case.p, case.m, case.v, case.grad_bits, "fp32", s, n_decay=nd).updated(tb.cdtype, g)
        for k, w, fmt, bits in (("p", want[0], "fp32", 32), ("m", want[1], "fp32", 32), ("v", want[2], "fp32", 32),
                                ("c", want[3], tb.cdtype, tb.cw)):
            out = np.concatenate([unpack(b[k], L, bits) for b in beats])[:n]
            assert_words(out, ev.words(w), fmt, f"n={n} n_decay={nd}: {k}", inputs)


@cocotb.test()
async def adamw_reset(dut):
    """rst with beats in flight and the output stalled: the next update is exact and no
    stale beat comes out."""
    tb = AdamwTB(dut)
    await tb.reset()
    L = tb.lanes
    rng = np.random.default_rng(12)
    case = ev.make_case("wide", rng, L * 40, 1, "fp32")
    g = case.reduced()[0]
    rows = {k: padded(ev.words(a), L, JUNK32) for k, a in (("g", g), ("p", case.p), ("m", case.m), ("v", case.v))}
    tb.set_backpressure_generator(random_pause(3, 0.7))
    tb.source.send([{"g": pack(rows["g"][b]), "p": pack(rows["p"][b]), "m": pack(rows["m"][b]),
                     "v": pack(rows["v"][b]), "tkeep": (1 << L) - 1, "tlast": 0, "decay": b % (1 << L)}
                    for b in range(40)])
    await tb.cycles(60)
    tb.source.abort()
    await tb.reset()
    tb.sink.take()
    tb.set_backpressure_generator(None)
    await tb.check(ev.make_case("train", rng, L * 3 + 1, 2, "bf16"), 2)


@cocotb.test()
async def adamw_throughput(dut):
    """Input always valid, output always ready: beats (LANES elements) per cycle >= 0.95
    on both sides, the latency equals the DUT's LATENCY, results still bit-exact."""
    tb = AdamwTB(dut)
    await tb.reset()
    L = tb.lanes
    beats = int(cfg("throughput_beats", 256))
    rng = np.random.default_rng(5)
    case = ev.make_case("wide", rng, beats * L, 1, "fp32")
    await tb.check(case, 16)
    tin, tout = tb.source.times, tb.sink.times
    rate_in = (len(tin) - 1) / (tin[-1] - tin[0])
    rate_out = (len(tout) - 1) / (tout[-1] - tout[0])
    lat = tout[0] - tin[0]
    tb.log.info("THROUGHPUT adamw LANES=%d copy=%s: input %.4f beats/cycle, output %.4f beats/cycle, "
                "latency %d cycles (DUT says %d)", L, tb.cdtype, rate_in, rate_out, lat, int(dut.latency.value))
    assert rate_in >= 0.95 and rate_out >= 0.95, (rate_in, rate_out)
    assert lat == int(dut.latency.value), (lat, int(dut.latency.value))
