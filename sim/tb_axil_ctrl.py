"""cocotb testbench for l2l_axil_ctrl, the EPS kernel's AXI4-Lite ap_ctrl_hs register file.

The core side (ap_ready, ap_done pulses, ap_idle) is driven by the testbench,
the host side by cocotbext-axi's ``AxiLiteMaster`` under random pauses on
every AXI-Lite channel. Checked:

- every argument register (offsets read from the ADDR_* localparams of the
  source, in the ARGS.md order) holds what was written, byte strobes honoured,
  and drives its arg_* port (64-bit buffers: low word, high word);
- the status register (0x70) reads the kernel's dma_error bit and ignores
  writes;
- unmapped offsets read 0 and writing them changes nothing;
- ap_start: set by the host, visible on the port, cleared by the core's
  ap_ready unless auto_restart is set (then it stays set); ap_idle follows the
  core; ap_done and ap_ready are sticky until the control register is read
  (clear on read), and a done that arrives in the very cycle of that read is
  not lost;
- GIE/IER/ISR: ISR bits set on ap_done / ap_ready only when enabled in IER,
  a 1 written to an ISR bit toggles it, the interrupt line is GIE & |ISR;
- built with LAMB = 1 (``test_lamb_words``): the LAMB kernel's five words past
  the status register.
"""
from __future__ import annotations

import logging
import os
import random

import cocotb
from cocotb.clock import Clock
from cocotb.triggers import RisingEdge
from cocotbext.axi import AxiLiteBus, AxiLiteMaster

from tb_eps_kernel import ARG_NAMES, BUFFERS, register_map

REG_CTRL, REG_GIE, REG_IER, REG_ISR, REG_STATUS = 0x00, 0x04, 0x08, 0x0C, 0x70


def random_pause(rng: random.Random, p: float):
    while True:
        yield rng.random() < p


class TB:
    def __init__(self, dut, seed: int):
        self.dut = dut
        self.rng = random.Random(seed)
        self.regs = register_map()
        cocotb.start_soon(Clock(dut.clk, 4, unit="ns", impl="gpi").start(start_high=False))
        self.axil = AxiLiteMaster(AxiLiteBus.from_prefix(dut, "s_axi_control"), dut.clk, dut.rst)
        self.axil.write_if.log.setLevel(logging.WARNING)
        self.axil.read_if.log.setLevel(logging.WARNING)
        for ch in (self.axil.write_if.aw_channel, self.axil.write_if.w_channel, self.axil.write_if.b_channel,
                   self.axil.read_if.ar_channel, self.axil.read_if.r_channel):
            ch.set_pause_generator(random_pause(random.Random(self.rng.random()), 0.3))
        dut.ap_ready.value = 0
        dut.ap_done.value = 0
        dut.ap_idle.value = 1
        dut.dma_error.value = 0

    async def reset(self):
        self.dut.rst.value = 1
        for _ in range(4):
            await RisingEdge(self.dut.clk)
        self.dut.rst.value = 0
        await RisingEdge(self.dut.clk)

    async def pulse(self, name: str):
        getattr(self.dut, name).value = 1
        await RisingEdge(self.dut.clk)
        getattr(self.dut, name).value = 0
        await RisingEdge(self.dut.clk)

    def port(self, name: str) -> int:
        return int(getattr(self.dut, f"arg_{name}").value)


@cocotb.test()
async def test_arguments(dut):
    tb = TB(dut, int(os.environ.get("L2L_CTRL_SEED", "1")))
    await tb.reset()
    assert list(tb.regs) == ARG_NAMES
    want = {}
    for name in ARG_NAMES:
        width = 64 if name in BUFFERS else 32
        want[name] = tb.rng.getrandbits(width)
        await tb.axil.write_dword(tb.regs[name], want[name] & 0xFFFF_FFFF)
        if width == 64:
            await tb.axil.write_dword(tb.regs[name] + 4, want[name] >> 32)
    for name in ARG_NAMES:
        assert tb.port(name) == want[name], name
        got = await tb.axil.read_dword(tb.regs[name])
        assert got == want[name] & 0xFFFF_FFFF, name
        if name in BUFFERS:
            assert await tb.axil.read_dword(tb.regs[name] + 4) == want[name] >> 32, name
    # byte strobes: one byte of n, two bytes of the high word of p
    await tb.axil.write(tb.regs["n"] + 2, b"\x5a")
    want["n"] = (want["n"] & ~0x00FF_0000) | 0x005A_0000
    await tb.axil.write(tb.regs["p"] + 4, b"\x34\x12")
    want["p"] = (want["p"] & ~(0xFFFF << 32)) | (0x1234 << 32)
    for name in ARG_NAMES:
        assert tb.port(name) == want[name], name
    # status (0x70, after the arguments): read-only, the kernel's dma_error bit
    status = max(tb.regs.values()) + 4
    assert status == REG_STATUS
    await tb.axil.write_dword(status, 0xFFFF_FFFF)
    assert await tb.axil.read_dword(status) == 0
    tb.dut.dma_error.value = 1
    assert await tb.axil.read_dword(status) == 1
    await tb.axil.write_dword(status, 0)
    assert await tb.axil.read_dword(status) == 1
    tb.dut.dma_error.value = 0
    assert await tb.axil.read_dword(status) == 0
    # unmapped offsets: read 0, writes ignored
    top = status + 4
    for addr in (top, top + 4, 0xFC, 0x100 + tb.regs["gr"], 0xFFC):   # no aliasing above 0xFF
        await tb.axil.write_dword(addr, 0xFFFF_FFFF)
        assert await tb.axil.read_dword(addr) == 0, hex(addr)
    for name in ARG_NAMES:
        assert tb.port(name) == want[name], name
    assert await tb.axil.read_dword(REG_CTRL) == 0x4          # idle, nothing else


@cocotb.test()
async def test_handshake_and_interrupts(dut):
    tb = TB(dut, int(os.environ.get("L2L_CTRL_SEED", "1")) + 1)
    await tb.reset()
    ax = tb.axil
    assert int(dut.ap_start.value) == 0 and int(dut.interrupt.value) == 0
    # start: visible until the core takes it
    await ax.write_dword(REG_CTRL, 1)
    assert int(dut.ap_start.value) == 1
    assert await ax.read_dword(REG_CTRL) == 0x5               # start | idle
    dut.ap_idle.value = 0
    await tb.pulse("ap_ready")
    assert int(dut.ap_start.value) == 0
    assert await ax.read_dword(REG_CTRL) == 0x8               # ready (sticky), not idle
    assert await ax.read_dword(REG_CTRL) == 0x0               # ready cleared by the read
    dut.ap_idle.value = 1
    await tb.pulse("ap_done")
    assert int(dut.interrupt.value) == 0                      # not enabled
    assert await ax.read_dword(REG_ISR) == 0
    assert await ax.read_dword(REG_CTRL) == 0x6               # done | idle
    assert await ax.read_dword(REG_CTRL) == 0x4               # done cleared by the read

    # interrupts: done enabled, ready not
    await ax.write_dword(REG_GIE, 1)
    await ax.write_dword(REG_IER, 1)
    assert await ax.read_dword(REG_GIE) == 1 and await ax.read_dword(REG_IER) == 1
    await ax.write_dword(REG_CTRL, 1)
    await tb.pulse("ap_ready")
    assert int(dut.interrupt.value) == 0 and await ax.read_dword(REG_ISR) == 0
    await tb.pulse("ap_done")
    assert int(dut.interrupt.value) == 1 and await ax.read_dword(REG_ISR) == 1
    await ax.write_dword(REG_ISR, 1)                          # toggle off
    assert int(dut.interrupt.value) == 0 and await ax.read_dword(REG_ISR) == 0
    await ax.write_dword(REG_ISR, 2)                          # toggle on by software
    assert int(dut.interrupt.value) == 1 and await ax.read_dword(REG_ISR) == 2
    await ax.write_dword(REG_GIE, 0)                          # global enable gates the line
    assert int(dut.interrupt.value) == 0
    await ax.write_dword(REG_ISR, 2)
    await ax.write_dword(REG_IER, 3)
    await ax.write_dword(REG_GIE, 1)
    await tb.pulse("ap_ready")
    assert await ax.read_dword(REG_ISR) == 2 and int(dut.interrupt.value) == 1
    await ax.write_dword(REG_ISR, 2)

    # auto_restart: ap_start survives ap_ready until auto_restart is cleared
    await ax.write_dword(REG_CTRL, 0x81)
    for _ in range(3):
        await tb.pulse("ap_ready")
        assert int(dut.ap_start.value) == 1
        await tb.pulse("ap_done")
    assert await ax.read_dword(REG_CTRL) & 0x83 == 0x83       # auto_restart, done, start
    await ax.write_dword(REG_CTRL, 0x00)                      # clear auto_restart (start stays pending)
    assert int(dut.ap_start.value) == 1
    await tb.pulse("ap_ready")
    assert int(dut.ap_start.value) == 0
    assert await ax.read_dword(REG_CTRL) & 0x81 == 0


async def manual_read(dut, addr: int, pulse: str | None = None) -> int:
    """One AXI-Lite read driven by hand; ``pulse``: a core input raised for exactly the
    cycle in which the slave takes the read address."""
    dut.s_axi_control_araddr.value = addr
    dut.s_axi_control_arvalid.value = 1
    dut.s_axi_control_rready.value = 0
    if pulse:
        getattr(dut, pulse).value = 1
    await RisingEdge(dut.clk)                 # arready = !rvalid = 1: taken on this edge
    dut.s_axi_control_arvalid.value = 0
    if pulse:
        getattr(dut, pulse).value = 0
    dut.s_axi_control_rready.value = 1
    await RisingEdge(dut.clk)
    assert int(dut.s_axi_control_rvalid.value) == 1
    data = int(dut.s_axi_control_rdata.value)
    await RisingEdge(dut.clk)
    dut.s_axi_control_rready.value = 0
    return data


@cocotb.test()
async def test_event_during_read(dut):
    """ap_done / ap_ready in the very cycle the control register is read: the read returns
    the value before, the event is kept for the next read (set wins over clear-on-read)."""
    cocotb.start_soon(Clock(dut.clk, 4, unit="ns", impl="gpi").start(start_high=False))
    for sig in ("s_axi_control_awvalid", "s_axi_control_wvalid", "s_axi_control_arvalid",
                "s_axi_control_bready", "s_axi_control_rready", "ap_ready", "ap_done"):
        getattr(dut, sig).value = 0
    dut.ap_idle.value = 1
    dut.rst.value = 1
    for _ in range(3):
        await RisingEdge(dut.clk)
    dut.rst.value = 0
    await RisingEdge(dut.clk)
    for event, bit in (("ap_done", 0x2), ("ap_ready", 0x8)):
        assert await manual_read(dut, REG_CTRL, pulse=event) & bit == 0
        assert await manual_read(dut, REG_CTRL) & bit == bit, f"{event} lost when it came with the read"
        assert await manual_read(dut, REG_CTRL) & bit == 0, f"{event} not cleared by the read"


@cocotb.test()
async def test_lamb_words(dut):
    """A register file built with LAMB = 1 (the LAMB kernel's): pass, seg, sums, steps, nseg past the
    status register (the LAMB_ADDR_* localparams) hold what was written, byte strobes honoured,
    drive their ports; the AdamW words and the read-only status are as before; 0x94 on is
    unmapped."""
    import re
    from tb_eps_kernel import RTL

    tb = TB(dut, int(os.environ.get("L2L_CTRL_SEED", "1")) + 2)
    await tb.reset()
    src = (RTL / "l2l_axil_ctrl.v").read_text()
    lamb = {name.lower(): int(off, 16)
            for name, off in re.findall(r"localparam\s*\[7:0\]\s*LAMB_ADDR_(\w+)\s*=\s*8'h([0-9A-Fa-f]+)", src)}
    assert list(lamb) == ["pass", "seg", "sums", "steps", "nseg"] and lamb["pass"] == REG_STATUS + 4
    wide = ("seg", "sums", "steps")
    want = {name: tb.rng.getrandbits(64 if name in wide else 32) for name in lamb}
    others = {name: tb.rng.getrandbits(64 if name in BUFFERS else 32) for name in ARG_NAMES}
    for regs, vals in ((lamb, want), (tb.regs, others)):
        for name, value in vals.items():
            await tb.axil.write_dword(regs[name], value & 0xFFFF_FFFF)
            if name in wide or name in BUFFERS:
                await tb.axil.write_dword(regs[name] + 4, value >> 32)
    await tb.axil.write(lamb["sums"] + 5, b"\xab")                      # one byte of a high word
    want["sums"] = (want["sums"] & ~(0xFF << 40)) | (0xAB << 40)
    for name, value in want.items():
        assert tb.port(name) == value, name
        assert await tb.axil.read_dword(lamb[name]) == value & 0xFFFF_FFFF, name
        if name in wide:
            assert await tb.axil.read_dword(lamb[name] + 4) == value >> 32, name
    for name, value in others.items():
        assert tb.port(name) == value, name
    await tb.axil.write_dword(REG_STATUS, 0xFFFF_FFFF)
    assert await tb.axil.read_dword(REG_STATUS) == 0
    for addr in (lamb["nseg"] + 4, 0xFC):
        await tb.axil.write_dword(addr, 0xFFFF_FFFF)
        assert await tb.axil.read_dword(addr) == 0, hex(addr)
    for name, value in want.items():
        assert tb.port(name) == value, name
