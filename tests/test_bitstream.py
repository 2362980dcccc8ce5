"""The LiteX SoC around the EPS kernel (fpga/soc/l2l_soc.py, issue 31 part 2).

In ``make test`` (seconds): the SoC elaborates for each board (gateware sources and csr.json, no
synthesis); the kernel instance has the build parameters, every port of ``l2l_eps_kernel``
connected, and its control registers where the host will look for them: the bus region ``eps`` at
``EPS_BASE``, large enough for the ``ADDR_*`` map of fpga/rtl/l2l_axil_ctrl.v (what
``sim/tb_eps_kernel.py::register_map`` reads, and fpga/ARGS.md documents); the five masters as
wide as LANES says, each on its own DRAM port. Also the bitstream checks themselves (IDCODE, timing
parse) on made-up inputs.

Slow (``-m slow``, about 25 minutes on two cores): ``make bitstream BOARD=ecpix5``'s build, then a
bitstream whose IDCODE is the LFE5UM5G-85F's and timing met on every clock.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "sim"))
sys.path.insert(0, str(ROOT / "fpga" / "soc"))

pytest.importorskip("litex", reason="the fpga extra (pip install -e '.[fpga]') is not installed")
import l2l_soc  # noqa: E402
from tb_eps_kernel import register_map  # noqa: E402

KERNEL_V = (ROOT / "fpga" / "rtl" / "l2l_eps_kernel.v").read_text()


def _module_ports() -> set[str]:
    header = KERNEL_V[KERNEL_V.index("module l2l_eps_kernel"):KERNEL_V.index(");\n")]
    return set(re.findall(r"^\s*(?:input|output)\s+wire\s+(?:\[[^\]]+\]\s*)?(\w+)", header, re.M))


@pytest.fixture(scope="module", params=sorted(l2l_soc.BOARDS))
def elaborated(request, tmp_path_factory):
    """The SoC elaborated into a temporary folder: its object, csr.json and top-level Verilog."""
    from litex.soc.integration.builder import Builder
    board = request.param
    out = tmp_path_factory.mktemp(board)
    soc = l2l_soc.L2LSoC(board=board, lanes=1)
    Builder(soc, output_dir=str(out), compile_software=False, compile_gateware=False,
            csr_json=str(out / "csr.json")).build(build_name=f"l2l_{board}", run=False)
    return board, soc, json.loads((out / "csr.json").read_text()), (out / "gateware" / f"l2l_{board}.v").read_text()


def test_kernel_instance_has_the_build_parameters_and_every_port_connected(elaborated):
    board, soc, _, top = elaborated
    inst = top[top.index("l2l_eps_kernel #("):]
    inst = inst[:inst.index(");\n\n") if ");\n\n" in inst else len(inst)]
    params = dict(re.findall(r"\.(\w+)\s*\(\s*\d*'?[dh]?(\w+)\s*\)", inst[:inst.index(") eps (")]))
    want = dict(l2l_soc.KERNEL, LANES=1, C_S_AXI_CONTROL_ADDR_WIDTH=12)
    assert {k: int(params[k]) for k in want} == want
    assert want["OPTIMIZER"] == 0 and want["GDTYPE"] == want["CDTYPE"] == 0   # AdamW, fp32 in and out
    connected = {k.split("_", 1)[1] for k in soc.kernel_ports}
    assert connected == _module_ports()
    # and the generated instance names each of them
    assert set(re.findall(r"^\s*\.(\w+)\s*\(", inst[inst.index(") eps ("):], re.M)) == _module_ports()
    # every source file of fpga/rtl travels to synthesis, as it is there
    srcs = {Path(f).name for f, *_ in soc.platform.sources}
    assert {p.name for p in (ROOT / "fpga" / "rtl").glob("l2l_*.v")} <= srcs


def test_control_registers_are_at_the_eps_region_plus_the_rtl_offsets(elaborated):
    _, soc, csr, _ = elaborated
    eps = csr["memories"]["eps"]
    assert (eps["base"], eps["size"], eps["type"]) == (l2l_soc.EPS_BASE, l2l_soc.EPS_SIZE, "io")
    offsets = register_map()
    # the map ARGS.md documents (control word first, the 64-bit addresses, n, k, ..., status last)
    assert offsets["gr"] == 0x10 and offsets["n"] == 0x40 and offsets["inv_scale"] == 0x6C
    assert max(offsets.values()) + 4 <= eps["size"] <= 2 ** soc.kernel_params["C_S_AXI_CONTROL_ADDR_WIDTH"]
    # the region lies in the CPU's uncached I/O space and overlaps nothing else on the bus
    assert eps["base"] >= 0x8000_0000
    for name, m in csr["memories"].items():
        if name != "eps":
            assert m["base"] + m["size"] <= eps["base"] or m["base"] >= eps["base"] + eps["size"], name


def test_each_master_is_lanes_wide_on_its_own_dram_port(elaborated):
    _, soc, csr, _ = elaborated
    for name in l2l_soc.PORTS:
        assert len(soc.kernel_ports[f"o_m_axi_{name}_wdata"]) == 32 * soc.lanes
        assert len(soc.kernel_ports[f"i_m_axi_{name}_rdata"]) == 32 * soc.lanes
    # the kernel's byte addresses are the CPU's: DRAM at main_ram
    assert csr["memories"]["main_ram"]["base"] == 0x4000_0000
    # the CPU/Etherbone port plus one per master
    assert len(soc.sdram.crossbar.masters) >= len(l2l_soc.PORTS) + 1


def test_the_host_driver_finds_the_soc_where_its_board_map_says(elaborated):
    """--eps board reads the identifier to know the board, then uses its DRAM and the kernel's
    registers at the addresses of l2l.eps.board_map: the SoC must put them there."""
    from l2l.eps import board_map
    board, soc, csr, _ = elaborated
    assert csr["csr_bases"]["identifier_mem"] == board_map.IDENT_ADDR
    assert csr["constants"]["config_identifier"] == board_map.ident(board, soc.lanes).lower()  # csr.json lowers it
    assert board_map.parse_ident(board_map.ident(board, soc.lanes)) == (board, soc.lanes)
    assert len(board_map.ident(board, soc.lanes)) < board_map.IDENT_WORDS
    ram = csr["memories"]["main_ram"]
    assert (ram["base"], ram["size"]) == (board_map.DRAM_BASE, board_map.DRAM_BYTES[board])
    assert (csr["memories"]["eps"]["base"], csr["memories"]["eps"]["size"]) == (board_map.EPS_BASE,
                                                                                board_map.EPS_SIZE)


def test_idcode_of_the_boards_part_comes_from_the_trellis_database():
    for board, b in l2l_soc.BOARDS.items():
        assert l2l_soc.part_idcode(b["part"]) == 0x81113043, board   # LFE5UM5G-85F
    assert l2l_soc.part_idcode("LFE5U-85F-6BG381C") == 0x41113043


def test_bitstream_idcode_is_read_after_the_preamble():
    fake = (b"\xff\x00LiteX\xe2\x00\x00\x00\x01\x11\x30\x43\x00\xff" + b"\xff\xff\xbd\xb3"
            + b"\xff" * 4 + b"\xe2\x00\x00\x00\x81\x11\x30\x43")
    assert l2l_soc.bitstream_idcode(fake) == 0x81113043


def test_timing_parse_takes_the_last_summary_per_clock():
    log = ("Info: Max frequency for clock 'sys': 55.00 MHz (FAIL at 60.00 MHz)\n"
           "Info: Max frequency for clock 'sys': 70.20 MHz (PASS at 60.00 MHz)\n"
           "Info: Max frequency for clock 'eth_rx_clk': 140.0 MHz (PASS at 125.00 MHz)\n")
    t = l2l_soc.nextpnr_timing(log)
    assert t["sys"] == dict(fmax_mhz=70.2, target_mhz=60.0, met=True) and t["eth_rx_clk"]["met"]


@pytest.mark.slow
def test_make_bitstream_ecpix5_meets_timing_and_targets_the_85f():
    # under the worktree, not pytest's tmp_path: YoWASP's tools cannot see /tmp
    out = ROOT / "build-bitstream" / "test-ecpix5"
    subprocess.run([sys.executable, str(ROOT / "fpga" / "soc" / "l2l_soc.py"), "--board", "ecpix5",
                    "--build", "--output-dir", str(out)], check=False, cwd=ROOT, timeout=3600)
    r = json.loads((out / "summary.json").read_text())
    assert r["idcode"] == "0x81113043" == r["idcode_part"]
    assert r["timing"] and all(c["met"] for c in r["timing"].values()), r["timing"]
    assert r["ok"]
