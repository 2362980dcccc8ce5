"""The RTL kernel's AXI4-Lite register map, and what a host driver writes there for one launch.

One home for every driver of ``l2l_eps_kernel``: the Verilator model (``--eps rtl``) and a board
over Etherbone (``--eps board``). The offsets are the ``REG_*``, ``ADDR_*`` and ``LAMB_ADDR_*``
localparams of ``fpga/rtl/l2l_axil_ctrl.v`` (documented in fpga/ARGS.md, "RTL kernel");
tests/test_eps_board.py reads them out of the Verilog and compares.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

REG_CTRL, REG_GIE, REG_IER, REG_ISR, REG_STATUS = 0x00, 0x04, 0x08, 0x0C, 0x70
AP_START, AP_DONE, AP_IDLE = 0x1, 0x2, 0x4
BUFFER_REGS = {"gr": 0x10, "p": 0x18, "m": 0x20, "v": 0x28, "copy": 0x30, "finite": 0x38}  # 64-bit each
REG_N, REG_K, REG_N_DECAY, REG_SCALARS = 0x40, 0x44, 0x48, 0x4C  # then the nine scalar words
LAMB_REGS = {"pass": 0x74, "seg": 0x78, "sums": 0x80, "steps": 0x88, "nseg": 0x90}
SENTINEL = 0x5A5A5A5A  # the flag word before a launch: the kernel writes 1 or 0 over it
MAX_K = 255              # gradient contributions a launch takes (the k register's width)


def f32_bits(x) -> int:
    return int(np.asarray(x, np.float32).view(np.uint32))


def scalar_words(scalars) -> dict[int, int]:
    """The nine binary32 scalars (``as_tuple()`` order) as register words."""
    return {REG_SCALARS + 4 * i: f32_bits(x) for i, x in enumerate(scalars.as_tuple())}


def launch_words(addresses: dict[str, int], words: dict[int, int]) -> dict[int, int]:
    """Every argument word of a launch: ``addresses`` (buffer name -> the kernel's byte address)
    split into low and high words at their registers, beside the other ``words``."""
    out = dict(words)
    for name, addr in addresses.items():
        reg = BUFFER_REGS.get(name, LAMB_REGS.get(name))
        out[reg], out[reg + 4] = addr & 0xFFFF_FFFF, addr >> 32
    return out


def acknowledge(write: Callable[[int, int], None], read: Callable[[int], int], what: str) -> None:
    """After the kernel's ap_done: acknowledge the interrupt (ISR toggle), read the control word
    (which clears ap_done) and the status; a DMA error or a kernel that is not idle is an error."""
    write(REG_ISR, 1)
    ctrl = read(REG_CTRL)
    status = read(REG_STATUS)
    if status & 1 or not ctrl & AP_IDLE:
        raise RuntimeError(f"{what}: dma_error set (status {status:#x}, control {ctrl:#x})")


def finite_flag(word: int, what: str) -> bool:
    if word not in (0, 1):
        raise RuntimeError(f"{what}: the kernel did not write the flag word ({word:#x})")
    return bool(word)
