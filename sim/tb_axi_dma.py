"""cocotb testbench for the EPS kernel's AXI DMA engines (l2l_axi_rd, l2l_axi_wr).

Top level: sim/l2l_dma_loop.v -- the read engine's stream feeds the write
engine, both on one AXI4 master backed by a cocotbext-axi ``AxiRam``.

``test_copy_ranges`` queues ranges whose source starts at any element offset
(so most start in the middle of a beat) and whose lengths sit on and around
the lane count and the burst length; each is read and written back to a
beat-aligned destination. Checked: every streamed beat (data of the kept
lanes, tkeep, tlast) against the source bytes; the destination equal to the
source; the bytes after each destination range (the masked tail of its last
beat and beyond) untouched; no burst crossing 4 KiB (AxiRam asserts it).
Run with random pauses on all five AXI channels and random stalls of the
stream between the engines.

``test_stream_rate``: one long aligned range with a memory that never
pauses: the stream must move one beat per clock in steady state (>= 0.95).

Parameters come from the top level's port widths (LANES, element width);
``L2L_DMA_SEED`` seeds the randomness.
"""
from __future__ import annotations

import logging
import os
import random

import cocotb
from cocotb.clock import Clock
from cocotb.triggers import RisingEdge, ReadOnly
from cocotbext.axi import AxiBus, AxiRam

SRC = 0x1_2345_0000          # above 4 GiB: the high address bits travel too
DST = 0x2_0000_3000


def random_pause(rng: random.Random, p: float):
    """A pause generator: paused with probability p on each cycle."""
    while True:
        yield rng.random() < p


class TB:
    def __init__(self, dut, seed: int):
        self.dut = dut
        self.log = logging.getLogger("cocotb.tb")
        self.rng = random.Random(seed)
        self.lanes = len(dut.st_tkeep)
        self.ew = len(dut.st_tdata) // self.lanes
        self.eb = self.ew // 8
        self.bb = self.eb * self.lanes
        cocotb.start_soon(Clock(dut.clk, 4, unit="ns", impl="gpi").start(start_high=False))
        self.ram = AxiRam(AxiBus.from_prefix(dut, "m_axi"), dut.clk, dut.rst, size=2**62)
        for log in (self.ram.write_if.log, self.ram.read_if.log):
            log.setLevel(logging.WARNING)
        self.beats = []          # (data, keep, last) of every beat taken from the read engine
        self.cycles = 0
        self.take_cycles = []    # the cycle number of each taken beat
        dut.stall.value = 0
        for c in ("rd", "wr"):
            getattr(dut, f"{c}_cmd_valid").value = 0
            getattr(dut, f"{c}_cmd_addr").value = 0
            getattr(dut, f"{c}_cmd_len").value = 0

    def set_backpressure(self, p: float) -> None:
        r = self.ram
        for ch in (r.write_if.aw_channel, r.write_if.w_channel, r.write_if.b_channel,
                   r.read_if.ar_channel, r.read_if.r_channel):
            ch.set_pause_generator(random_pause(random.Random(self.rng.random()), p) if p else None)

    async def reset(self) -> None:
        self.dut.rst.value = 1
        for _ in range(4):
            await RisingEdge(self.dut.clk)
        self.dut.rst.value = 0
        await RisingEdge(self.dut.clk)

    async def monitor(self) -> None:
        dut = self.dut
        while True:
            await RisingEdge(dut.clk)
            await ReadOnly()
            self.cycles += 1
            if int(dut.st_take.value):
                self.beats.append((int(dut.st_tdata.value), int(dut.st_tkeep.value),
                                   int(dut.st_tlast.value)))
                self.take_cycles.append(self.cycles)

    async def stall_driver(self, p: float) -> None:
        while True:
            await RisingEdge(self.dut.clk)
            self.dut.stall.value = int(self.rng.random() < p)

    async def send_cmds(self, which: str, cmds) -> None:
        dut = self.dut
        valid, ready = getattr(dut, f"{which}_cmd_valid"), getattr(dut, f"{which}_cmd_ready")
        for addr, n in cmds:
            if self.rng.random() < 0.3:
                for _ in range(self.rng.randint(1, 5)):
                    await RisingEdge(dut.clk)
            valid.value = 1
            getattr(dut, f"{which}_cmd_addr").value = addr
            getattr(dut, f"{which}_cmd_len").value = n
            while True:
                await RisingEdge(dut.clk)
                if int(ready.value):
                    break
            valid.value = 0

    async def wait_idle(self, timeout: int) -> None:
        for _ in range(timeout):
            await RisingEdge(self.dut.clk)
            if int(self.dut.rd_idle.value) and int(self.dut.wr_idle.value) and \
                    int(self.dut.rd_cmd_ready.value) and int(self.dut.wr_cmd_ready.value):
                for _ in range(4):       # stays idle
                    await RisingEdge(self.dut.clk)
                    assert int(self.dut.rd_idle.value) and int(self.dut.wr_idle.value)
                return
        raise AssertionError("DMA engines did not go idle")


def lengths(lanes: int, burst: int, rng: random.Random) -> list[int]:
    edge = [1, 2, lanes - 1, lanes, lanes + 1, burst * lanes - 1, burst * lanes, burst * lanes + 1,
            2 * burst * lanes + 1, 3 * burst * lanes - 1]
    return [x for x in edge if x >= 1] + [rng.randint(1, 4 * burst * lanes) for _ in range(6)]


@cocotb.test()
async def test_copy_ranges(dut):
    seed = int(os.environ.get("L2L_DMA_SEED", "1"))
    tb = TB(dut, seed)
    burst = int(os.environ.get("L2L_DMA_BURST", "8"))
    rng = tb.rng
    await tb.reset()
    cocotb.start_soon(tb.monitor())
    tb.set_backpressure(0.3)
    cocotb.start_soon(tb.stall_driver(0.2))

    src_bytes = bytes(rng.getrandbits(8) for _ in range(64 * 1024))
    tb.ram.write(SRC, src_bytes)
    canary = bytes(rng.getrandbits(8) for _ in range(256 * 1024))
    tb.ram.write(DST, canary)

    plan = []   # (src element offset, n elements, dst byte address)
    dst = DST
    for n in lengths(tb.lanes, burst, rng):
        e0 = rng.randrange(0, len(src_bytes) // tb.eb - n)
        plan.append((e0, n, dst))
        beats = -(-n // tb.lanes)
        dst += (beats + rng.randint(1, 3)) * tb.bb      # a gap after each range
        assert dst + tb.bb < DST + len(canary)

    rd = cocotb.start_soon(tb.send_cmds("rd", [(SRC + e0 * tb.eb, n) for e0, n, _ in plan]))
    wr = cocotb.start_soon(tb.send_cmds("wr", [(d, n) for _, n, d in plan]))
    await rd
    await wr
    await tb.wait_idle(200000)

    # the stream: beat by beat
    it = iter(tb.beats)
    emask = (1 << tb.ew) - 1
    for e0, n, _ in plan:
        beats = -(-n // tb.lanes)
        for b in range(beats):
            data, keep, last = next(it)
            lanes_here = min(tb.lanes, n - b * tb.lanes)
            assert keep == (1 << lanes_here) - 1, (e0, n, b, keep)
            assert last == (b == beats - 1), (e0, n, b)
            for ln in range(lanes_here):
                e = e0 + b * tb.lanes + ln
                want = int.from_bytes(src_bytes[e * tb.eb:(e + 1) * tb.eb], "little")
                assert (data >> (ln * tb.ew)) & emask == want, (e0, n, b, ln)
    assert next(it, None) is None, "extra beats"

    # the memory: copies exact, everything else untouched
    written = bytearray(canary)
    for e0, n, d in plan:
        off = d - DST
        written[off:off + n * tb.eb] = src_bytes[e0 * tb.eb:(e0 + n) * tb.eb]
    assert tb.ram.read(DST, len(canary)) == bytes(written)
    assert tb.ram.read(SRC, len(src_bytes)) == src_bytes
    tb.log.info("%d ranges, %d beats, %d cycles", len(plan), len(tb.beats), tb.cycles)


@cocotb.test()
async def test_stream_rate(dut):
    tb = TB(dut, int(os.environ.get("L2L_DMA_SEED", "1")) + 100)
    burst = int(os.environ.get("L2L_DMA_BURST", "8"))
    await tb.reset()
    cocotb.start_soon(tb.monitor())
    beats = 32 * burst
    n = beats * tb.lanes
    data = bytes(tb.rng.getrandbits(8) for _ in range(n * tb.eb))
    tb.ram.write(SRC, data)
    rd = cocotb.start_soon(tb.send_cmds("rd", [(SRC, n)]))
    wr = cocotb.start_soon(tb.send_cmds("wr", [(DST, n)]))
    await rd
    await wr
    await tb.wait_idle(20 * beats + 1000)
    assert tb.ram.read(DST, len(data)) == data
    assert len(tb.take_cycles) == beats
    lo, hi = beats // 8, beats - 1          # steady state: after the first bursts
    rate = (hi - lo) / (tb.take_cycles[hi] - tb.take_cycles[lo])
    tb.log.info("stream rate %.4f beats/cycle (first beat at cycle %d)", rate, tb.take_cycles[0])
    assert rate >= 0.95, rate
