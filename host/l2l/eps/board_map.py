"""A board's EPS SoC as the host sees it over Etherbone: bus addresses, the kernel's build, the DRAM.

One home for the three parties that must agree on it: the SoC build (fpga/soc/l2l_soc.py),
the host driver (:mod:`l2l.eps.board_backend`) and the simulated SoC the driver is tested
against (:mod:`l2l.eps.board_sim`). tests/test_bitstream.py checks the elaborated SoC's
memory map (csr.json) against these numbers.
"""
from __future__ import annotations

ETHERBONE_PORT = 1234        # LiteEth's Etherbone UDP port; the board answers to this port too
EPS_BASE = 0xA000_0000       # the kernel's AXI-Lite registers (VexRiscv's uncached I/O region)
EPS_SIZE = 0x1000            # 12 address bits: C_S_AXI_CONTROL_ADDR_WIDTH
DRAM_BASE = 0x4000_0000      # main_ram: the kernel's byte addresses are these bus addresses
IDENT_ADDR = 0xF000_1800     # LiteX's identifier memory: one character a 32-bit word, NUL-ended
IDENT_WORDS = 64

# The kernel's build parameters in the SoC: AdamW, fp32 gradients and device copy; bursts, reducer
# blocks and buffers small (DRAM latency on these boards is tens of clocks, not HBM's hundreds).
KERNEL = dict(OPTIMIZER=0, GDTYPE=0, CDTYPE=0, BURST=8, BLOCK=8, RD_FIFO=16, WR_FIFO=16, DSP_SHAPE=0)

# DDR3 behind main_ram as LiteDRAM maps it (the module's geometry, x16)
DRAM_BYTES = {"ecpix5": 512 << 20, "butterstick": 256 << 20}


def ident(board: str, lanes: int) -> str:
    """The SoC's identifier string (LiteX ``ident``): what the driver reads to know the board."""
    return f"l2l EPS SoC on {board}, LANES={lanes}"


def parse_ident(text: str) -> tuple[str, int] | None:
    """(board, LANES) from an identifier string, or None if it is not an l2l EPS SoC's."""
    prefix = "l2l EPS SoC on "
    if not text.startswith(prefix) or ", LANES=" not in text:
        return None
    board, _, lanes = text[len(prefix):].partition(", LANES=")
    if board not in DRAM_BYTES or not lanes.isdigit():
        return None
    return board, int(lanes)
