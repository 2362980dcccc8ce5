"""cocotb testbench for the RTL EPS kernel (fpga/rtl/l2l_eps_kernel.v) through its AXI ports.

The kernel is driven as XRT would drive it: arguments written through the
AXI4-Lite control port (``AxiLiteMaster``) at the offsets of the register map
in fpga/rtl/l2l_axil_ctrl.v, ap_start set, the end awaited on the interrupt
line (GIE/IER enabled), the interrupt acknowledged by toggling ISR, ap_done
read (clear-on-read) from the control register. Memory is one cocotbext-axi
``AxiRam`` per AXI master (m_axi_gr, m_axi_p, m_axi_m, m_axi_v, m_axi_copy);
the flag word lives in p's RAM (the kernel writes it on m_axi_p).

References are the golden model only: ``l2l.eps.numerics`` through
``eps_vectors.Case`` (reduce_gradients, adamw_update with its device copy);
p', m', v', the copy and the flag are compared bit for bit (two NaNs being
equal whatever their payloads, as the contract allows). A layer whose
reduced gradient is not finite must get flag 0 and nothing else: p, m, v and
the copy are checked unchanged. Guard bytes around every buffer are checked
unchanged after every run (the tail of a partial last beat included).

cocotb tests (selected by tests/test_rtl_kernel.py and tests/test_rtl_trace.py):

- ``test_cases``: the cases of ``$L2L_KERNEL_CASES`` (JSON list of
  {kind, n, K, steps, gr_off, then, n_decay}), each a layer of n elements updated
  ``steps`` times on the same state in device memory (steps after the first
  draw their gradients from class ``then``, default ``kind``), elements below
  ``n_decay`` weight-decayed (default n; a value above n acts as n), with random pauses on
  every AXI channel of every RAM (``$L2L_KERNEL_PAUSE``, default 0.2).
- ``test_edge_args``: n = 0 (flag 1, nothing else written), k = 0 (flag 0),
  and ap_ctrl_hs behaviour at the top level (ap_idle, ap_start self-clearing,
  ap_done and ap_ready clear-on-read, ISR toggle, interrupt line).
- ``test_throughput``: memory that never pauses, K in ``$L2L_KERNEL_RATE_K``
  (default "1,2"), ``$L2L_KERNEL_RATE_N`` / K elements at each K: cycles of the
  check and update passes and their steady-state elements/cycle/lane (the rate
  of gradient read beats, and of p write beats, between the 10 % and the 90 %
  one); asserts >= 0.95/K for both passes at every K (the gradient port's
  bound: K words per element). Results go as JSON to ``$L2L_KERNEL_REPORT``.
- ``test_trace_replay``: every update of a recorded training run
  (``$L2L_TRACE``, written by sim/eps_trace.py) replayed through the kernel,
  each layer's state kept in device memory across steps, every output
  checked against the recorded NumPy-backend outputs, skipped (flag 0)
  updates included; what was replayed goes to ``$L2L_KERNEL_REPORT``.

Environment: ``L2L_GDTYPE`` / ``L2L_CDTYPE`` (fp32, bf16, fp16: must match the
GDTYPE / CDTYPE the top level was built with), ``L2L_KERNEL_BLOCK`` (its BLOCK,
for test_throughput's window), ``L2L_KERNEL_SEED``.
"""
from __future__ import annotations

import json
import logging
import os
import random
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import cocotb
import numpy as np
from cocotb.clock import Clock
from cocotb.triggers import ReadOnly, RisingEdge
from cocotbext.axi import AxiBus, AxiLiteBus, AxiLiteMaster, AxiRam

import eps_vectors as ev
from l2l.eps.contract import StepScalars
from l2l.eps.numerics import COPY_DTYPES

RTL = Path(__file__).resolve().parents[1] / "fpga" / "rtl"
PORTS = ("gr", "p", "m", "v", "copy")
DTYPE_BITS = {"fp32": 32, "bf16": 16, "fp16": 16}
ARG_NAMES = ["gr", "p", "m", "v", "copy", "finite", "n", "k", "n_decay", *StepScalars.names()]
BUFFERS = ARG_NAMES[:6]

REG_CTRL, REG_GIE, REG_IER, REG_ISR, REG_STATUS = 0x00, 0x04, 0x08, 0x0C, 0x70
AP_START, AP_DONE, AP_IDLE, AP_READY = 1, 2, 4, 8
SENTINEL = 0xA5A5_5A5A
GUARD = 256                  # bytes checked around every buffer


def register_map(path: Path = RTL / "l2l_axil_ctrl.v") -> dict[str, int]:
    """``{argument name: byte offset}`` from the ADDR_* localparams of the control slave."""
    found = re.findall(r"localparam\s*(?:\[[^\]]*\])?\s*ADDR_(\w+)\s*=\s*\d*'h([0-9A-Fa-f]+)\s*;",
                       path.read_text())
    return {name.lower(): int(val, 16) for name, val in found}


def random_pause(rng: random.Random, p: float):
    while True:
        yield rng.random() < p


def f32_bits(x) -> int:
    return int(np.asarray(x, np.float32).view(np.uint32))


def same(actual: np.ndarray, expected: np.ndarray) -> np.ndarray:
    """Elementwise: identical bits, or both NaN (any payload)."""
    a, e = np.asarray(actual), np.asarray(expected)
    w = a.dtype.itemsize * 8
    ab, eb = a.view(ev.UINT_OF[w]), e.view(ev.UINT_OF[w])
    with np.errstate(all="ignore"):
        an, en = np.isnan(a.astype(np.float32)), np.isnan(e.astype(np.float32))
    return (ab == eb) | (an & en)


def assert_same(what: str, actual: np.ndarray, expected: np.ndarray) -> None:
    ok = same(actual, expected)
    if not ok.all():
        bad = np.flatnonzero(~ok)
        w = actual.dtype.itemsize * 8
        a, e = actual.view(ev.UINT_OF[w]), expected.view(ev.UINT_OF[w])
        first = ", ".join(f"[{i}] got {int(a[i]):#x} want {int(e[i]):#x}" for i in bad[:5])
        raise AssertionError(f"{what}: {bad.size} of {ok.size} elements differ: {first}")


@dataclass
class Layout:
    """Byte addresses of one layer's buffers (each in its own port's RAM; finite in p's)."""
    gr: int
    p: int
    m: int
    v: int
    copy: int
    finite: int


class TB:
    def __init__(self, dut, seed: int = 1):
        self.dut = dut
        self.log = logging.getLogger("cocotb.tb")
        self.rng = random.Random(seed)
        self.nprng = np.random.default_rng(seed)
        self.gdtype = os.environ.get("L2L_GDTYPE", "fp32")
        self.cdtype = os.environ.get("L2L_CDTYPE", "fp32")
        self.lanes = len(dut.m_axi_p_wdata) // 32
        self.gw = len(dut.m_axi_gr_rdata) // self.lanes
        self.cw = len(dut.m_axi_copy_wdata) // self.lanes
        assert self.gw == DTYPE_BITS[self.gdtype] and self.cw == DTYPE_BITS[self.cdtype], \
            "L2L_GDTYPE/L2L_CDTYPE do not match the port widths"
        self.beat = 4 * self.lanes
        self.regs = register_map()
        assert list(self.regs) == ARG_NAMES, self.regs
        cocotb.start_soon(Clock(dut.ap_clk, 4, unit="ns", impl="gpi").start(start_high=False))
        self.axil = AxiLiteMaster(AxiLiteBus.from_prefix(dut, "s_axi_control"), dut.ap_clk, dut.ap_rst_n,
                                  reset_active_level=False)
        self.ram = {name: AxiRam(AxiBus.from_prefix(dut, f"m_axi_{name}"), dut.ap_clk, dut.ap_rst_n,
                                 reset_active_level=False, size=2 ** 62) for name in PORTS}
        for ram in self.ram.values():
            ram.write_if.log.setLevel(logging.WARNING)
            ram.read_if.log.setLevel(logging.WARNING)
        self.axil.write_if.log.setLevel(logging.WARNING)
        self.axil.read_if.log.setLevel(logging.WARNING)
        self.cycle = 0
        cocotb.start_soon(self._count())
        self._next = {name: 0x1_0000_0000 * (i + 1) for i, name in enumerate(PORTS)}

    async def _count(self) -> None:
        while True:
            await RisingEdge(self.dut.ap_clk)
            self.cycle += 1

    def set_backpressure(self, p: float) -> None:
        """Random pauses with probability p on every channel of every RAM (0: none)."""
        for ram in self.ram.values():
            for ch in (ram.write_if.aw_channel, ram.write_if.w_channel, ram.write_if.b_channel,
                       ram.read_if.ar_channel, ram.read_if.r_channel):
                ch.set_pause_generator(random_pause(random.Random(self.rng.random()), p) if p else None)

    async def reset(self) -> None:
        self.dut.ap_rst_n.value = 0
        for _ in range(8):
            await RisingEdge(self.dut.ap_clk)
        self.dut.ap_rst_n.value = 1
        for _ in range(4):
            await RisingEdge(self.dut.ap_clk)

    # ---------------------------------------------------------------- memory
    def _alloc(self, port: str, nbytes: int, align: int, skew: int = 0) -> int:
        base = -(-(self._next[port] + GUARD) // align) * align + skew
        self._next[port] = base + nbytes + GUARD + 4096
        return base

    def layout(self, n: int, k: int, gr_off: int = 0) -> Layout:
        """Fresh buffers for a layer of n elements and k contributions, guards filled with noise.

        gr starts ``gr_off`` elements past a beat boundary; p, m, v and copy are beat-aligned
        (4 KiB, as Vitis buffers are); the flag word sits at a random word of a beat of p's RAM.
        """
        gb, cb = self.gw // 8, self.cw // 8
        lay = Layout(
            gr=self._alloc("gr", k * n * gb, 4096, gr_off * gb),
            p=self._alloc("p", 4 * n, 4096), m=self._alloc("m", 4 * n, 4096),
            v=self._alloc("v", 4 * n, 4096), copy=self._alloc("copy", cb * n, 4096),
            finite=self._alloc("p", 4, self.beat, 4 * self.rng.randrange(self.lanes)))
        for port, addr, size in (("gr", lay.gr, k * n * gb), ("p", lay.p, 4 * n), ("m", lay.m, 4 * n),
                                 ("v", lay.v, 4 * n), ("copy", lay.copy, cb * n), ("p", lay.finite, 4)):
            self.ram[port].write(addr - GUARD, self.rng.randbytes(size + 2 * GUARD))
        self.ram["p"].write_dword(lay.finite, SENTINEL)
        return lay

    def guards(self, lay: Layout, n: int, k: int) -> dict:
        gb, cb = self.gw // 8, self.cw // 8
        out = {}
        for port, addr, size in (("gr", lay.gr, k * n * gb), ("p", lay.p, 4 * n), ("m", lay.m, 4 * n),
                                 ("v", lay.v, 4 * n), ("copy", lay.copy, cb * n), ("p", lay.finite, 4)):
            ram = self.ram[port]
            out[(port, addr)] = (ram.read(addr - GUARD, GUARD), ram.read(addr + size, GUARD))
        return out

    def write_state(self, lay: Layout, p, m, v) -> None:
        self.ram["p"].write(lay.p, np.ascontiguousarray(p, np.float32).tobytes())
        self.ram["m"].write(lay.m, np.ascontiguousarray(m, np.float32).tobytes())
        self.ram["v"].write(lay.v, np.ascontiguousarray(v, np.float32).tobytes())

    def write_grads(self, lay: Layout, grad_words: np.ndarray) -> None:
        self.ram["gr"].write(lay.gr, np.ascontiguousarray(grad_words).tobytes())

    def read_state(self, lay: Layout, n: int):
        get = lambda port, addr, dt: np.frombuffer(self.ram[port].read(addr, n * np.dtype(dt).itemsize), dt)  # noqa: E731
        return (get("p", lay.p, np.float32), get("m", lay.m, np.float32), get("v", lay.v, np.float32),
                get("copy", lay.copy, COPY_DTYPES[self.cdtype]))

    def read_flag(self, lay: Layout) -> int:
        return self.ram["p"].read_dword(lay.finite)

    @contextmanager
    def failing(self, port: str, kind: str, lo: int, hi: int):
        """Within the block, reads ("read") or writes ("write") of port's RAM at byte addresses
        [lo, hi) fail: cocotbext-axi answers them SLVERR (a write is then not performed)."""
        iface = self.ram[port].read_if if kind == "read" else self.ram[port].write_if
        name = "_read" if kind == "read" else "_write"
        real = getattr(iface, name)

        async def fail_in_range(address, arg):
            if lo <= address < hi:
                raise OSError(f"injected {kind} error at {address:#x}")
            return await real(address, arg)

        setattr(iface, name, fail_in_range)
        try:
            yield
        finally:
            delattr(iface, name)   # the class's own method again

    # ---------------------------------------------------------------- control
    async def write_args(self, lay: Layout, n: int, k: int, s: StepScalars, n_decay: int | None = None) -> None:
        vals = {name: getattr(lay, name) for name in BUFFERS}
        vals.update(n=n, k=k, n_decay=n if n_decay is None else n_decay, **{name: f32_bits(x) for name, x in zip(StepScalars.names(), s.as_tuple())})
        # the arguments fill one contiguous range of registers (8 bytes a buffer, 4 a scalar):
        # one write of the range issues every word in order, back to back, where a write_dword
        # each would wait for every response (~4 clocks a word of a kernel Icarus runs slowly)
        base = self.regs[ARG_NAMES[0]]
        data = b"".join(vals[name].to_bytes(8 if name in BUFFERS else 4, "little") for name in ARG_NAMES)
        assert [self.regs[a] - base for a in ARG_NAMES] == [
            sum(8 if b in BUFFERS else 4 for b in ARG_NAMES[:i]) for i in range(len(ARG_NAMES))], self.regs
        await self.axil.write(base, data)

    def status(self) -> str:
        """The kernel's sequencer and stream handshakes, for a hang's failure message."""
        names = ["state", "gen_active", "chk_left", "gr_tvalid", "gr_tready", "g_tvalid", "p_tvalid",
                 "m_tvalid", "v_tvalid", "ad_ready", "ad_valid", "wr_idle_p", "wr_idle_m", "wr_idle_v",
                 "wr_idle_c", "m_axi_gr_arvalid", "m_axi_gr_rvalid"]
        return " ".join(f"{k}={getattr(self.dut, k).value}" for k in names)

    async def start_and_wait(self, timeout: int | None = None) -> int:
        """ap_start, then the interrupt; returns clock cycles from the ap_start write to ap_done."""
        dut = self.dut
        timeout = timeout or int(os.environ.get("L2L_KERNEL_TIMEOUT", "2000000"))
        await self.axil.write_dword(REG_GIE, 1)
        await self.axil.write_dword(REG_IER, 1)             # ap_done interrupt
        ctrl = await self.axil.read_dword(REG_CTRL)
        assert ctrl & AP_IDLE and not ctrl & AP_START, hex(ctrl)
        t0 = self.cycle
        await self.axil.write_dword(REG_CTRL, AP_START)
        done_at = None
        for _ in range(timeout):
            await RisingEdge(dut.ap_clk)
            if done_at is None and int(dut.ap_done.value):
                done_at = self.cycle
            if int(dut.interrupt.value):
                break
        else:
            raise AssertionError(f"no interrupt within {timeout} cycles: {self.status()}")
        assert await self.axil.read_dword(REG_ISR) == 1
        await self.axil.write_dword(REG_ISR, 1)             # toggle: acknowledge
        assert await self.axil.read_dword(REG_ISR) == 0
        await RisingEdge(dut.ap_clk)
        assert not int(dut.interrupt.value)
        ctrl = await self.axil.read_dword(REG_CTRL)
        assert ctrl & AP_DONE and ctrl & AP_IDLE and not ctrl & AP_START, hex(ctrl)
        ctrl = await self.axil.read_dword(REG_CTRL)
        assert not ctrl & AP_DONE and not ctrl & AP_READY, hex(ctrl)   # cleared by the read before
        return done_at - t0

    async def update(self, lay: Layout, grad_words: np.ndarray, n: int, k: int, s: StepScalars,
                     n_decay: int | None = None) -> int:
        self.write_grads(lay, grad_words)
        self.ram["p"].write_dword(lay.finite, SENTINEL)
        await self.write_args(lay, n, k, s, n_decay)
        return await self.start_and_wait()

    async def checked_update(self, lay: Layout, n: int, k: int, grad_words, s: StepScalars,
                             want_flag: bool, want, what: str, n_decay: int | None = None) -> int:
        """One run; the flag, p, m, v, copy (``want``: the expected 4-tuple) and every guard checked."""
        before = self.guards(lay, n, k)
        prior = self.read_state(lay, n)
        cycles = await self.update(lay, grad_words, n, k, s, n_decay)
        assert self.read_flag(lay) == int(want_flag), f"{what}: flag {self.read_flag(lay):#x}"
        got = self.read_state(lay, n)
        if not want_flag:
            want = prior
        for name, a, e in zip(("p", "m", "v", "copy"), got, want):
            assert_same(f"{what}: {name}", a, e)
        assert self.guards(lay, n, k) == before, f"{what}: bytes outside the buffers changed"
        return cycles


def grads_of(case: ev.Case) -> np.ndarray:
    return np.concatenate([case.grad_words(i) for i in range(case.K)])


# ---------------------------------------------------------------------- tests


@cocotb.test()
async def test_cases(dut):
    """Layers from the contract's vector classes, several steps each, under random AXI pauses."""
    tb = TB(dut, int(os.environ.get("L2L_KERNEL_SEED", "1")))
    await tb.reset()
    tb.set_backpressure(float(os.environ.get("L2L_KERNEL_PAUSE", "0.2")))
    cases = json.loads(os.environ.get("L2L_KERNEL_CASES", '[{"kind": "train", "n": 37, "K": 2}]'))
    for spec in cases:
        kind, n, K = spec["kind"], int(spec["n"]), int(spec["K"])
        steps, gr_off = int(spec.get("steps", 1)), int(spec.get("gr_off", 0))
        lay = tb.layout(n, K, gr_off)
        first = ev.make_case(kind, tb.nprng, n, K, tb.gdtype)
        p, m, v = first.p, first.m, first.v
        tb.write_state(lay, p, m, v)
        for step in range(steps):
            # later steps: fresh gradients and scalars of class "then" (default: the same) on the
            # state in memory
            case = first if step == 0 else ev.make_case(spec.get("then", kind), tb.nprng, n, K, tb.gdtype)
            case.p, case.m, case.v = p, m, v
            case.n_decay = spec.get("n_decay")    # the parameter groups' boundary, every step
            g, finite = case.reduced()
            want = case.updated(tb.cdtype, g) if finite else None
            what = f"{case.name} n={n} K={K} n_decay={case.n_decay} step {step + 1}"
            cycles = await tb.checked_update(lay, n, K, grads_of(case), case.s, finite, want, what,
                                             case.n_decay_arg)
            if finite:
                p, m, v = want[0], want[1], want[2]
            tb.log.info("%s: finite=%s, %d cycles", what, finite, cycles)


@cocotb.test()
async def test_memory_errors(dut):
    """An SLVERR response on any master sets the status register's dma_error bit for that run.
    A failed gradient read in the check pass writes flag 0 and leaves the layer as it was; the
    next run clears the bit and updates bit for bit; a failed write during the update pass
    still ends the run (ap_done), with the bit set."""
    tb = TB(dut, int(os.environ.get("L2L_KERNEL_SEED", "1")) + 11)
    await tb.reset()
    tb.set_backpressure(float(os.environ.get("L2L_KERNEL_PAUSE", "0.2")))
    n, K = 8 * tb.lanes + 3, 2
    lay = tb.layout(n, K)
    case = ev.make_case("train", tb.nprng, n, K, tb.gdtype)
    tb.write_state(lay, case.p, case.m, case.v)
    assert await tb.axil.read_dword(REG_STATUS) == 0
    # a gradient read fails in the check pass: flag 0, the layer untouched
    gb = tb.gw // 8
    bad = lay.gr + (K * n * gb) // 2
    with tb.failing("gr", "read", bad - bad % (gb * tb.lanes), bad + 1):
        await tb.checked_update(lay, n, K, grads_of(case), case.s, False, None, "gradient read SLVERR")
    assert await tb.axil.read_dword(REG_STATUS) == 1
    # the next run, clean: the bit is cleared and the update is the golden model's
    g, finite = case.reduced()
    assert finite
    want = case.updated(tb.cdtype, g)
    await tb.checked_update(lay, n, K, grads_of(case), case.s, True, want, "clean run after the error")
    assert await tb.axil.read_dword(REG_STATUS) == 0
    # a write of m fails in the update pass: the run still ends, with the bit set
    with tb.failing("m", "write", lay.m, lay.m + 4 * n):
        await tb.update(lay, grads_of(case), n, K, case.s)
    assert tb.read_flag(lay) == 1
    assert await tb.axil.read_dword(REG_STATUS) == 1
    # and a failed flag write skips the update
    tb.write_state(lay, case.p, case.m, case.v)
    with tb.failing("p", "write", lay.finite - lay.finite % tb.beat, lay.finite + 1):
        await tb.update(lay, grads_of(case), n, K, case.s)
    assert await tb.axil.read_dword(REG_STATUS) == 1
    for name, got, before in zip("pmv", tb.read_state(lay, n), (case.p, case.m, case.v)):
        assert_same(f"after a failed flag write: {name}", got, before)


@cocotb.test()
async def test_edge_args(dut):
    """n = 0 and k = 0 write the flag only; ap_ctrl_hs bits at the top level."""
    tb = TB(dut, int(os.environ.get("L2L_KERNEL_SEED", "1")) + 7)
    await tb.reset()
    ctrl = await tb.axil.read_dword(REG_CTRL)
    assert ctrl == AP_IDLE, hex(ctrl)
    s = StepScalars.compute(ev.OptimizerHyper(), 1)
    n = 3 * tb.lanes + 1
    case = ev.make_case("train", tb.nprng, n, 2, tb.gdtype)
    lay = tb.layout(n, 2)
    tb.write_state(lay, case.p, case.m, case.v)
    prior = tb.read_state(lay, n)
    for n_arg, k_arg, want in ((0, 2, 1), (n, 0, 0), (n, 256, 0)):
        before = tb.guards(lay, n, 2)
        cycles = await tb.update(lay, grads_of(case), n_arg, k_arg, s)
        assert tb.read_flag(lay) == want, (n_arg, k_arg, tb.read_flag(lay))
        for name, a, e in zip(("p", "m", "v", "copy"), tb.read_state(lay, n), prior):
            assert_same(f"n={n_arg} k={k_arg}: {name}", a, e)
        assert tb.guards(lay, n, 2) == before
        tb.log.info("n=%d k=%d: flag %d after %d cycles", n_arg, k_arg, want, cycles)
    # every argument register reads back what was written
    for name in ARG_NAMES:
        got = await tb.axil.read_dword(tb.regs[name])
        want = (getattr(lay, name) & 0xFFFF_FFFF) if name in BUFFERS else \
            {"n": n, "k": 256, "n_decay": n}.get(name, f32_bits(getattr(s, name, 0)))
        assert got == want, (name, hex(got), hex(want))
    # ap_start is taken at once (ap_ready), ap_ready is cleared by reading control
    await tb.axil.write_dword(REG_IER, 3)
    await tb.axil.write_dword(REG_CTRL, AP_START)
    for _ in range(200):
        await RisingEdge(dut.ap_clk)
        if int(dut.interrupt.value):
            break
    assert await tb.axil.read_dword(REG_ISR) & 2                  # ap_ready seen
    for _ in range(2000):
        await RisingEdge(dut.ap_clk)
        if int(dut.ap_idle.value):
            break
    ctrl = await tb.axil.read_dword(REG_CTRL)
    assert ctrl == AP_DONE | AP_IDLE | AP_READY, hex(ctrl)
    assert await tb.axil.read_dword(REG_CTRL) == AP_IDLE
    assert await tb.axil.read_dword(REG_ISR) == 3
    await tb.axil.write_dword(REG_ISR, 3)
    await tb.axil.write_dword(REG_GIE, 0)
    assert await tb.axil.read_dword(REG_ISR) == 0


class RateProbe:
    """Watches one launch and timestamps what the rate is judged on.

    ``state``: (cycle, state) at every change of the sequencer's state
    (S_CHECK = 1, S_SAMPLE = 2, S_FLAG = 3, S_UPDATE = 4, S_DONE = 5);
    ``gr``: the cycle of every gradient read beat (R handshake on m_axi_gr)
    during the check pass; ``pw``: the cycle of every p write beat (W handshake
    on m_axi_p) during the update pass. Sampled in ReadOnly after each rising
    edge, so a handshake is counted in the cycle it completes.
    """

    S_CHECK, S_SAMPLE, S_UPDATE, S_DONE = 1, 2, 4, 5

    def __init__(self, tb: TB):
        self.tb = tb
        self.state: list[tuple[int, int]] = []
        self.gr: list[int] = []
        self.pw: list[int] = []
        self._task = cocotb.start_soon(self._watch())

    async def _watch(self) -> None:
        dut, last = self.tb.dut, None
        while True:
            await RisingEdge(dut.ap_clk)
            await ReadOnly()
            st = int(dut.state.value)
            if st != last:
                self.state.append((self.tb.cycle, st))
                last = st
            if st == self.S_CHECK and int(dut.m_axi_gr_rvalid.value) and int(dut.m_axi_gr_rready.value):
                self.gr.append(self.tb.cycle)
            if st == self.S_UPDATE and int(dut.m_axi_p_wvalid.value) and int(dut.m_axi_p_wready.value):
                self.pw.append(self.tb.cycle)

    def stop(self) -> None:
        self._task.cancel()

    def first(self, state: int) -> int:
        return next(c for c, st in self.state if st == state)

    @staticmethod
    def steady(beats: list[int], period: int) -> float:
        """Beats per cycle from the 10 % beat over the most whole periods that end by the 90 %
        beat: the pass without its fill and drain.

        The beats come in a pattern that repeats every ``period`` beats (the reducer takes
        BLOCK beats of each contribution in turn: at K = 2 the p writes come as BLOCK beats
        in about 2 x BLOCK clocks), so a window cut mid-pattern would be off by up to a
        block's worth of clocks; whole periods measure the average rate exactly."""
        lo, end = len(beats) // 10, len(beats) - len(beats) // 10 - 1
        periods = (end - lo) // period
        assert periods >= 4, f"{len(beats)} beats: too few for a steady-state window of {period}-beat periods"
        hi = lo + periods * period
        return (hi - lo) / (beats[hi] - beats[lo])


@cocotb.test()
async def test_throughput(dut):
    """Rates of both passes with a memory that never pauses, asserted for every K run.

    The design's promise (fpga/rtl/README.md): the gradient port moves one beat
    (LANES words) per clock, so the check pass reads K beats per LANES elements
    and the update pass, which reads the gradients again beside p, m and v, is
    bound by the same port: 1/K element per clock per lane. Both passes are
    asserted at >= 0.95/K in steady state (whole reducer blocks between the
    10 % and the 90 % beat, of the gradient read beats of the check pass and
    of the p write beats of the update pass); whole-pass figures and total
    cycles are reported, not asserted (they include the launch and the
    pipeline's fill, about 110 clocks with the current latency header).
    Each run's outputs are still checked bit for bit, so a fast wrong kernel
    fails too. K in ``$L2L_KERNEL_RATE_K``; a layer of ``$L2L_KERNEL_RATE_N``
    / K elements at each K (a multiple of LANES), so every run streams the
    same number of gradient beats, or, when ``$L2L_KERNEL_RATE_N`` lists one
    size per K, a layer of that size at each K.
    """
    tb = TB(dut, 3)
    await tb.reset()
    Ks = [int(x) for x in os.environ.get("L2L_KERNEL_RATE_K", "1,2").split(",")]
    Ns = [int(x) for x in os.environ.get("L2L_KERNEL_RATE_N", str(4096 * tb.lanes)).split(",")]
    # one N: N / K elements at each K; one N per K: the layer size at that K
    sizes = [Ns[0] // K for K in Ks] if len(Ns) == 1 else Ns
    assert len(sizes) == len(Ks), (Ns, Ks)
    block = int(os.environ["L2L_KERNEL_BLOCK"])      # the BLOCK parameter the top level was built with
    report = {"lanes": tb.lanes, "gdtype": tb.gdtype, "cdtype": tb.cdtype, "runs": []}
    failures = []
    for K, n in zip(Ks, sizes):
        assert n % tb.lanes == 0, (n, tb.lanes)
        beats = n // tb.lanes
        case = ev.make_case("train", tb.nprng, n, K, tb.gdtype)
        lay = tb.layout(n, K)
        tb.write_state(lay, case.p, case.m, case.v)
        g, finite = case.reduced()
        assert finite
        probe = RateProbe(tb)
        cycles = await tb.checked_update(lay, n, K, grads_of(case), case.s, finite,
                                         case.updated(tb.cdtype, g), f"rate K={K}")
        probe.stop()
        check = probe.first(RateProbe.S_SAMPLE) - probe.first(RateProbe.S_CHECK)
        upd = probe.first(RateProbe.S_DONE) - probe.first(RateProbe.S_UPDATE)
        # gradient beats: K contributions of n elements each, with gr beat-aligned here
        assert len(probe.gr) == K * beats, (len(probe.gr), K * beats)
        assert len(probe.pw) == beats, (len(probe.pw), beats)
        run = {"K": K, "n": n, "total_cycles": cycles, "check_cycles": check, "update_cycles": upd,
               "check_elems_per_cycle_per_lane": n / tb.lanes / check,
               "update_elems_per_cycle_per_lane": n / tb.lanes / upd,
               # gradient beats per cycle / K = elements per cycle per lane
               "check_steady_elems_per_cycle_per_lane": RateProbe.steady(probe.gr, K * block) / K,
               "update_steady_elems_per_cycle_per_lane": RateProbe.steady(probe.pw, block),
               "promised_elems_per_cycle_per_lane": 1 / K}
        report["runs"].append(run)
        tb.log.info("throughput %s", run)
        for what in ("check_steady", "update_steady"):
            if run[f"{what}_elems_per_cycle_per_lane"] < 0.95 / K:
                failures.append(f"K={K} {what}: {run[f'{what}_elems_per_cycle_per_lane']:.4f} < 0.95/K")
    if os.environ.get("L2L_KERNEL_REPORT"):
        Path(os.environ["L2L_KERNEL_REPORT"]).write_text(json.dumps(report, indent=1))
    assert not failures, "; ".join(failures)


@cocotb.test()
async def test_trace_replay(dut):
    """Every EPS update of a recorded training run, replayed through the kernel bit for bit.

    A recorded skipped update (flag 0) must leave p, m, v and the copy in device
    memory as they were: the recorder says the NumPy EPS left the state alone
    (its outputs equal its inputs), the kernel's state is compared with those
    recorded outputs, and its copy with the copy the last finite update of that
    layer wrote. ``$L2L_KERNEL_REPORT``, when set, gets what was replayed (so
    the caller can require that skipped updates were among them)."""
    import eps_trace

    tb = TB(dut, int(os.environ.get("L2L_KERNEL_SEED", "1")))
    await tb.reset()
    tb.set_backpressure(float(os.environ.get("L2L_KERNEL_PAUSE", "0.1")))
    trace = eps_trace.load(os.environ["L2L_TRACE"])
    assert trace.gdtype == tb.gdtype and trace.cdtype == tb.cdtype
    layouts: dict[int, Layout] = {}
    copy_written: set[int] = set()        # layers whose copy in device memory the kernel wrote
    replayed = []
    for i, u in enumerate(trace.updates):
        n, K = u.p.shape[0], u.grads.shape[0]
        what = f"update {i} (layer {u.layer}, n={n}, K={K})"
        if u.layer not in layouts:            # first update of the layer: its state goes to the card
            layouts[u.layer] = tb.layout(n, K)
            tb.write_state(layouts[u.layer], u.p, u.m, u.v)
        lay = layouts[u.layer]
        # the state the kernel holds must be the state the NumPy backend had before this update
        for name, a, e in zip("pmv", tb.read_state(lay, n)[:3], (u.p, u.m, u.v)):
            assert_same(f"{what} input {name}", a, e)
        if not u.finite:                      # the recording itself: NumPy left the layer alone
            for name, a, e in zip("pmv", (u.p_out, u.m_out, u.v_out), (u.p, u.m, u.v)):
                assert_same(f"{what}: recorded skip changed {name}", a, e)
        want = (u.p_out, u.m_out, u.v_out, u.copy_out)
        await tb.checked_update(lay, n, K, eps_trace.grad_words(u.grads), u.scalars, u.finite, want, what,
                                u.n_decay)
        got = tb.read_state(lay, n)
        for name, a, e in zip("pmv", got[:3], want[:3]):
            assert_same(f"{what} output {name}", a, e)
        if u.finite or u.layer in copy_written:
            assert_same(f"{what} copy", got[3], u.copy_out)
        if u.finite:
            copy_written.add(u.layer)
        replayed.append({"layer": u.layer, "n": n, "K": K, "n_decay": u.n_decay, "finite": u.finite,
                         "copy_checked": bool(u.finite or u.layer in copy_written)})
    skipped = sum(not r["finite"] for r in replayed)
    tb.log.info("replayed %d updates of %d layers (%d not finite) bit for bit",
                len(replayed), len(layouts), skipped)
    if os.environ.get("L2L_KERNEL_REPORT"):
        Path(os.environ["L2L_KERNEL_REPORT"]).write_text(json.dumps(
            {"gdtype": tb.gdtype, "cdtype": tb.cdtype, "lanes": tb.lanes, "updates": replayed}, indent=1))
