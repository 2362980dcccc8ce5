"""A simulated l2l EPS SoC that serves Etherbone over UDP, for ``--eps board`` without a board.

    python -m l2l.eps.board_sim --listen 127.0.0.2:1234 [--board ecpix5] [--drop 0.05]
    l2l train --eps board --board-url udp://127.0.0.2:1234
    python -m l2l.eps.board_sim --bench        # the kernel's clocks an element, through the driver

What answers is what fpga/soc/l2l_soc.py builds, at the addresses of :mod:`l2l.eps.board_map`:

* **the kernel**: fpga/rtl/l2l_eps_kernel.v with the SoC's build parameters (LANES 1, AdamW,
  fp32), compiled by Verilator (:mod:`l2l.eps.rtl_backend`'s model and build cache), its
  AXI-Lite registers at ``EPS_BASE``, its five AXI masters on the DRAM at the SoC's bus
  addresses (the harness maps bus address ``DRAM_BASE`` to this process's DRAM array);
* **the DRAM**: ``DRAM_BYTES`` of the board, zero at start (a real board's is not: the driver
  writes everything it reads);
* **the identifier**: LiteX's identifier memory, one character a word, NUL-ended;
* **Etherbone** as LiteEth's core answers it: probes, then each record's writes and reads in
  order, the read values sent back as a write record to the request's ``base_ret_addr``, to
  the sender's address at the board's own port.

The kernel runs between datagrams: a write of ap_start runs it to its interrupt before the next
datagram is read (a board's kernel runs beside the link; the host sees the same registers).
``--drop P`` drops each datagram, either way, with probability P: the driver's retries and
verified writes are tested against it.
"""
from __future__ import annotations

import argparse
import random
import socket
import sys

import numpy as np

from ..errors import UserError
from . import board_map as bm
from .kernel_regs import AP_START, REG_CTRL
from .rtl_backend import Model, aligned, build_library, describe_params, find_tools, library_path

MAX_CLOCKS = 1 << 40  # a hang guard only: the driver has its own deadline


def kernel_params(lanes: int = 1) -> dict[str, int]:
    """The Verilator model's parameters: the SoC's kernel build (board_map.KERNEL) at ``lanes``."""
    return {**bm.KERNEL, "LANES": lanes}


def prebuild() -> None:
    """Build (or find cached) the simulated SoC's kernel model (``make rtl-models``), one line."""
    params = kernel_params()
    try:
        tools = find_tools()
    except UserError as exc:
        print(f"the board SoC's RTL EPS model not built: {exc}")
        return
    cached = library_path(params, tools).is_file()
    path = build_library(params, quiet=True)
    print(f"RTL EPS model ({describe_params(params)}, the board SoC's): {'cached' if cached else 'built'}, "
          f"{path.parent}")


class SimulatedSoc:
    """The bus of the SoC: DRAM, the kernel's registers, the identifier."""

    def __init__(self, board: str = "ecpix5", lanes: int = 1, cache_dir=None) -> None:
        self.board, self.lanes = board, lanes
        self.dram = aligned(bm.DRAM_BYTES[board] // 4, np.uint32)  # zero pages: touched ones only
        self.model = Model(kernel_params(lanes), cache_dir)
        self.model.regions([(self.dram.ctypes.data, self.dram.nbytes)], offset=self.dram.ctypes.data - bm.DRAM_BASE)
        text = bm.ident(board, lanes).encode() + b"\0"
        self.ident = np.zeros(bm.IDENT_WORDS, np.uint32)
        self.ident[:len(text)] = list(text)
        self.unmapped = 0  # accesses that hit nothing (a driver bug)

    def _dram_index(self, addr: int, words: int) -> int | None:
        off = addr - bm.DRAM_BASE
        return off // 4 if 0 <= off and off + 4 * words <= self.dram.nbytes and off % 4 == 0 else None

    def write(self, addr: int, values: list[int]) -> None:
        i = self._dram_index(addr, len(values))
        if i is not None:
            self.dram[i:i + len(values)] = values
            return
        for k, value in enumerate(values):
            a = addr + 4 * k
            if bm.EPS_BASE <= a < bm.EPS_BASE + bm.EPS_SIZE:
                reg = a - bm.EPS_BASE
                if reg == REG_CTRL and value & AP_START:
                    self.model.run(MAX_CLOCKS)  # ap_start, clocks to the interrupt
                else:
                    self.model.write(reg, value)
            else:
                self.unmapped += 1

    def read(self, addrs: list[int]) -> list[int]:
        if addrs:
            i = self._dram_index(addrs[0], len(addrs))
            if i is not None and addrs[-1] - addrs[0] == 4 * (len(addrs) - 1):
                return self.dram[i:i + len(addrs)].tolist()
        out = []
        for a in addrs:
            if bm.EPS_BASE <= a < bm.EPS_BASE + bm.EPS_SIZE:
                out.append(self.model.read(a - bm.EPS_BASE))
            elif bm.IDENT_ADDR <= a < bm.IDENT_ADDR + 4 * bm.IDENT_WORDS:
                out.append(int(self.ident[(a - bm.IDENT_ADDR) // 4]))
            elif (i := self._dram_index(a, 1)) is not None:
                out.append(int(self.dram[i]))
            else:
                self.unmapped += 1
                out.append(0)
        return out


def answer(soc: SimulatedSoc, data: bytes, eb) -> bytes | None:
    """Etherbone as LiteEth serves it: the answer datagram to one request (None: no answer)."""
    packet = eb.EtherbonePacket(32, data)
    packet.decode()
    if packet.pf:
        reply = eb.EtherbonePacket(32)
        reply.pr = 1
        reply.encode()
        return bytes(reply.bytes) + bytes(4)
    records = []
    for record in packet.records:
        if record.writes is not None:
            soc.write(record.writes.base_addr, record.writes.get_datas())
        if record.reads is not None:
            values = soc.read(record.reads.get_addrs())
            back = eb.EtherboneRecord(addr_size=4)
            # the return address is the reads' first word (LiteX 2024.12's EtherboneReads.decode
            # parses it but does not keep it)
            ret = int.from_bytes(bytes(record.reads.bytes[:4]), "big")
            back.writes = eb.EtherboneWrites(addr_size=4, base_addr=ret, datas=iter(values))
            back.wcount = len(values)
            records.append(back)
    if not records:
        return None
    reply = eb.EtherbonePacket(32)
    reply.records = records
    reply.encode()
    return bytes(reply.bytes)


def serve(sock: socket.socket, soc: SimulatedSoc, drop: float = 0.0, seed: int = 0) -> None:
    from litex.tools.remote import etherbone as eb
    rng = random.Random(seed)
    port = sock.getsockname()[1]
    while True:
        data, (host, _) = sock.recvfrom(65536)
        if drop and rng.random() < drop:
            continue
        out = answer(soc, data, eb)
        if out is not None and not (drop and rng.random() < drop):
            sock.sendto(out, (host, port))  # LiteEth answers at its own port, to the sender's address


def bench(n: int = 1 << 16) -> list[dict]:
    """One AdamW update of an ``n``-element layer at K = 1 and 2 through the driver and the link
    (in this process, on 127.0.0.2): the kernel's clocks an element and the wall rates."""
    import threading
    import time

    from .board_backend import BoardBackend
    from .contract import OptimizerHyper, step_scalars
    from .numerics import as_step
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.2", 0))
    soc = SimulatedSoc()
    threading.Thread(target=serve, args=(sock, soc), daemon=True).start()
    board = BoardBackend(f"udp://127.0.0.2:{sock.getsockname()[1]}")
    rows = []
    try:
        board.allocate(0, np.zeros(n, np.float32))
        for k in (1, 2):
            clocks, kernel_s = soc.model.clocks, soc.model.seconds
            started = time.perf_counter()
            board.step(0, np.ones((k, n), np.float32), as_step(step_scalars(OptimizerHyper(), k, divisor=1.0), n),
                       np.empty(n, np.float32))
            wall = time.perf_counter() - started
            rows.append({"k": k, "n": n, "clocks_per_element": (soc.model.clocks - clocks) / n,
                         "kernel_sim_s": soc.model.seconds - kernel_s, "step_s": wall, "elements_per_s": n / wall})
    finally:
        board.close()
        sock.close()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m l2l.eps.board_sim", description=__doc__.split("\n\n")[0])
    ap.add_argument("--listen", default=f"127.0.0.2:{bm.ETHERBONE_PORT}",
                    help="ADDRESS:PORT to serve on (port 0: any free one; default %(default)s)")
    ap.add_argument("--board", default="ecpix5", choices=sorted(bm.DRAM_BYTES))
    ap.add_argument("--lanes", type=int, default=1)
    ap.add_argument("--drop", type=float, default=0.0, help="drop each datagram with this probability")
    ap.add_argument("--bench", action="store_true", help="time one update through the driver, print, exit")
    ap.add_argument("--numel", type=int, default=1 << 16, help="--bench: the layer's elements (default %(default)s)")
    args = ap.parse_args(argv)
    if args.bench:
        for r in bench(args.numel):
            print(f"K={r['k']}, n={r['n']}: {r['clocks_per_element']:.3f} kernel clocks an element (LANES 1, "
                  f"memory that never pauses); step {r['step_s']:.2f} s through the simulated link "
                  f"({r['elements_per_s']:,.0f} elements/s; the kernel's simulation {r['kernel_sim_s']:.2f} s of it)")
        return 0
    host, _, port = args.listen.rpartition(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((host, int(port)))
    soc = SimulatedSoc(args.board, args.lanes)
    print(f"l2l board sim: {bm.ident(args.board, args.lanes)}, serving Etherbone at "
          f"udp://{host}:{sock.getsockname()[1]}", flush=True)
    try:
        serve(sock, soc, args.drop)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
