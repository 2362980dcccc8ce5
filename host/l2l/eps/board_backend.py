"""The board EPS: the RTL kernel on an FPGA board, its state in the board's DRAM, over Etherbone.

``--eps board --board-url udp://IP[:PORT]`` drives the SoC of ``make bitstream`` (fpga/soc/
l2l_soc.py) as the host driver of fpga/ARGS.md, "RTL kernel": bus writes and reads over the
board's Ethernet (:mod:`l2l.eps.etherbone`), at the addresses of :mod:`l2l.eps.board_map`.

* **Where things live.** Each layer's ``p, m, v`` (fp32) stay in the board's DRAM for the whole
  run, allocated once, 4 KiB aligned. A scratch block there takes the K gradient contributions
  back to back, another the device copy, a word the finite flag. The host sends the gradients
  and reads the copy back: at K = 1 about 12 bytes a parameter go out (the gradient, and the
  read requests of the write's verification and of the copy) and 8 come back, so gigabit
  Ethernet bounds a step at about 10M parameters a second (docs/fpga.md).
* **The board first says what it is**: its LiteX identifier names the board (its DRAM size) and
  LANES; anything else answering Etherbone there is refused in one line.
* **A launch**: the gradients written and verified, the flag preset to a sentinel, the argument
  registers written and read back, ap_start; then ISR, which stays set until the host clears it,
  is polled (ap_done clears on the first read of the control word, whose answer a lost datagram
  could take with it); the interrupt acknowledged and checked cleared; the control word and the
  status read; the flag read; the copy read back when the update was applied. An ap_start that
  was lost (ISR clear, the kernel idle and not started) is sent again.
* **The bitstream's kernel is AdamW with fp32 gradients and copies** (board_map.KERNEL): other
  optimizers and precisions are refused before a run starts (``l2l.config``).
* **Checkpoints** read ``p, m, v`` back from the board and write them there on resume, verified.
"""
from __future__ import annotations

import functools
import threading
import time
from typing import Sequence

import numpy as np

from ..errors import UserError
from . import board_map as bm
from . import numerics
from .backend import EpsBackend, check_copy, check_optimizer, check_state, check_step
from .contract import StepScalars
from .etherbone import BoardTimeout, EtherboneLink, parse_url
from .kernel_regs import (AP_DONE, AP_IDLE, AP_START, MAX_K, REG_CTRL, REG_IER, REG_ISR, REG_K, REG_N,
                          REG_N_DECAY, REG_STATUS, SENTINEL, finite_flag, launch_words, scalar_words)

ALIGN = 4096


def _locked(method):
    """One conversation with the board at a time: the EPS worker's updates and a checkpoint's
    reads share one socket and one tag counter."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return run


def _words(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


class Dram:
    """The board's DRAM, handed out front to back in 4 KiB-aligned blocks (nothing is freed:
    a run allocates its layers once)."""

    def __init__(self, base: int, size: int, board: str) -> None:
        self.base, self.size, self.board, self.used = base, size, board, 0

    def take(self, nbytes: int, what: str) -> int:
        start = -(-self.used // ALIGN) * ALIGN
        if start + nbytes > self.size:
            raise UserError(f"--eps board: {what} does not fit the {self.board}'s {self.size >> 20} MiB of DRAM "
                            f"({(start + nbytes) / 2**20:.1f} MiB needed so far: p, m, v are 12 bytes a parameter, "
                            "the gradients and copy of the largest layer besides)")
        self.used = start + nbytes
        return self.base + start


class BoardBackend(EpsBackend):
    name = "board"
    optimizers = frozenset({"adamw"})
    probe_numel = 1 << 16  # the planner's rate probe: 256 KiB a buffer over the link, not 16 MiB

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        try:
            import litex.tools.remote.etherbone  # noqa: F401
        except ImportError:
            return False, "needs LiteX's Etherbone client: pip install 'l2l[board]'"
        return True, "an l2l EPS SoC (make bitstream) reached with --board-url udp://IP[:PORT]"

    def __init__(self, url: str | None = None, timeout_s: float | None = None) -> None:
        if not url:
            raise UserError("--eps board needs --board-url udp://IP[:PORT] (the board's address)")
        host, port = parse_url(url, bm.ETHERBONE_PORT)
        self.url = f"udp://{host}:{port}"
        self._lock = threading.RLock()  # write_copy reads the masters under it
        self.link = EtherboneLink(host, port, **({"timeout_s": timeout_s} if timeout_s else {}))
        try:
            self.link.probe()
            text = bytes(int(w) & 0xFF for w in self.link.read(bm.IDENT_ADDR, bm.IDENT_WORDS)).split(b"\0")[0]
        except BoardTimeout:
            self.link.close()
            raise UserError(f"--board-url {self.url}: no board answers there (is it powered, its bitstream "
                            "loaded, the host on its subnet? docs/fpga.md)") from None
        found = bm.parse_ident(text.decode("ascii", "replace"))
        if found is None:
            self.link.close()
            raise UserError(f"--board-url {self.url}: answers Etherbone but is not an l2l EPS SoC "
                            f"(identifier {text.decode('ascii', 'replace')!r})")
        self.board, self.lanes = found
        self.dram = Dram(bm.DRAM_BASE, bm.DRAM_BYTES[self.board], self.board)
        self._layers: dict[int, tuple[int, int, int, int]] = {}  # layer -> (n, p, m, v addresses)
        self._scratch_blocks: dict[str, tuple[int, int]] = {}  # name -> (address, capacity in words)
        self._flag = self.dram.take(4, "the flag word")
        self.launches = 0
        self.seconds = 0.0
        self.link.write_verified(bm.EPS_BASE + REG_IER, [1])  # ap_done sets ISR bit 0: what the host polls

    def describe(self) -> str:
        return f"the {self.board} board at {self.url} (RTL kernel, LANES {self.lanes})"

    def close(self) -> None:
        self.link.close()

    # ------------------------------------------------------------ registers
    def _reg(self, reg: int, value: int) -> None:
        self.link.write(bm.EPS_BASE + reg, [value & 0xFFFF_FFFF])

    def _get(self, reg: int) -> int:
        return self.link.read_word(bm.EPS_BASE + reg)

    def _scratch(self, which: str, words: int) -> int:
        """A DRAM block of at least ``words`` for ``which`` ("gr", "copy"), taken anew when it grows."""
        addr, cap = self._scratch_blocks.get(which, (0, 0))
        if cap < words:
            addr = self.dram.take(4 * words, f"the {which} scratch block")
            self._scratch_blocks[which] = (addr, words)
        return addr

    # ------------------------------------------------------------ state
    @_locked
    def allocate(self, layer: int, p: np.ndarray, moments: int = 2) -> None:
        p = np.asarray(p, dtype=np.float32)
        if p.ndim != 1:
            raise ValueError(f"layer {layer}: master weights of shape {p.shape}, expected one dimension")
        if moments != 2:
            raise UserError("--eps board runs AdamW (p, m, v): the bitstream's kernel is built for it")
        n = p.shape[0]
        addrs = tuple(self.dram.take(4 * n, f"layer {layer}") for _ in range(3))
        self._layers[layer] = (n, *addrs)
        self.link.write_verified(addrs[0], _words(p))
        zeros = np.zeros(n, np.uint32)
        self.link.write_verified(addrs[1], zeros)
        self.link.write_verified(addrs[2], zeros)

    @_locked
    def read_state(self, layer: int) -> tuple[np.ndarray, ...]:
        n, *addrs = self._layers[layer]
        return tuple(self.link.read(a, n).view(np.float32) for a in addrs)

    @_locked
    def read_master(self, layer: int) -> np.ndarray:
        n, p, _, _ = self._layers[layer]
        return self.link.read(p, n).view(np.float32)

    @_locked
    def write_state(self, layer: int, p: np.ndarray, *moments: np.ndarray) -> None:
        n, *addrs = self._layers[layer]
        check_state(layer, (p, *moments), n, 2)
        for addr, a in zip(addrs, (p, *moments)):
            self.link.write_verified(addr, _words(a))

    @_locked
    def write_copy(self, layer: int, copy_out: np.ndarray) -> None:
        p = self.read_master(layer)
        check_copy(copy_out, p.shape[0])
        numerics.device_copy(p, copy_out)

    # ------------------------------------------------------------ updates
    @_locked
    def step(self, layer: int, grads: Sequence[np.ndarray], scalars: StepScalars,
             copy_out: np.ndarray, n_decay: int | None = None) -> bool:
        n, p, m, v = self._layers[layer]
        check_step(grads, copy_out, n, n_decay)
        check_optimizer(self, scalars, 2)
        k = len(grads)
        if k > MAX_K:
            raise ValueError(f"{k} gradient contributions; the RTL kernel takes at most {MAX_K}")
        if any(np.dtype(g.dtype) != np.float32 for g in grads) or np.dtype(copy_out.dtype) != np.float32:
            raise UserError("--eps board: the bitstream's kernel takes fp32 gradients and copies: --precision fp32")
        started = time.perf_counter()
        gr = self._scratch("gr", k * n)
        copy = self._scratch("copy", n)
        block = np.concatenate([_words(g) for g in grads]) if k > 1 else _words(grads[0])
        self.link.write_verified(gr, block)
        self.link.write_verified(self._flag, [SENTINEL])
        words = launch_words({"gr": gr, "p": p, "m": m, "v": v, "copy": copy, "finite": self._flag},
                             {REG_N: n, REG_K: k, REG_N_DECAY: n if n_decay is None else n_decay,
                              **scalar_words(scalars)})
        first, last = min(words), max(words)
        block = np.array([words[a] for a in range(first, last + 4, 4)], np.uint32)
        self.link.write_verified(bm.EPS_BASE + first, block)  # the registers read back as written
        self._run(deadline_s=60.0 + 50e-6 * (k + 2) * n)
        finite = finite_flag(self.link.read_word(self._flag), f"the {self.board} board")
        if finite:
            copy_out[...] = self.link.read(copy, n).view(np.float32)
        self.launches += 1
        self.seconds += time.perf_counter() - started
        return finite

    def _run(self, deadline_s: float) -> None:
        """ap_start, then ISR polled until set; acknowledged; control and status checked."""
        self._reg(REG_CTRL, AP_START)
        end = time.monotonic() + deadline_s
        while True:
            try:
                if self._get(REG_ISR) & 1:
                    break
                ctrl = self._get(REG_CTRL)
                if ctrl & AP_IDLE and not ctrl & (AP_START | AP_DONE) and not self._get(REG_ISR) & 1:
                    self._reg(REG_CTRL, AP_START)  # the start was lost: the kernel never left idle
            except BoardTimeout:
                pass  # the board may be busy past a read's retries; the deadline decides
            if time.monotonic() > end:
                raise BoardTimeout(f"the kernel on the {self.board} board at {self.url} did not finish "
                                   f"within {deadline_s:.0f} s")
        for _ in range(10):  # acknowledge ap_done (ISR toggles on a write of 1); a lost write is sent again
            self._reg(REG_ISR, 1)
            if not self._get(REG_ISR) & 1:
                break
        else:
            raise BoardTimeout(f"the {self.board} board's kernel interrupt could not be acknowledged")
        ctrl, status = self._get(REG_CTRL), self._get(REG_STATUS)
        if status & 1 or not ctrl & AP_IDLE:
            raise RuntimeError(f"the {self.board} board's kernel: dma_error set (status {status:#x}, "
                               f"control {ctrl:#x})")
