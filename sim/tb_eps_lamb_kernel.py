"""cocotb testbench of the RTL EPS kernel built for LAMB (fpga/rtl/l2l_eps_kernel.v, OPTIMIZER = 2).

The kernel is driven as a host driver would drive eps_lamb_<g>_<c>: the
arguments written through the AXI4-Lite control port at the offsets of the
LAMB register map (:func:`lamb_register_map`; fpga/ARGS.md, "RTL kernel",
"LAMB"), ap_start set, the end awaited on the interrupt line, as
sim/tb_eps_kernel.py does for AdamW (its ``TB`` is reused: AXI RAMs with random
pauses on every channel, guard bytes around every buffer). One update is two
runs with the host between them:

1. pass 1 (pass register 1): the check, the flag word, and when finite m', v'
   in place and the segments' lane sums written to ``sums`` (in p's RAM);
2. the host reads the flag and the sums back from device memory and folds them
   (``numerics.lamb_steps``, binary64) into one step size per segment, written
   to ``steps`` (in gr's RAM);
3. pass 2 (pass register 2): p' in place and the device copy.

References are the golden model only (``l2l.eps.numerics``: reduce_gradients,
lamb_norms, lamb_steps, lamb_apply): the flag, m', v', every lane sum, p' and
the copy bit for bit. A layer whose reduced gradient is not finite gets flag 0
and nothing else (p, m, v, the copy and the sums unchanged). The segment
bounds (``seg``, in copy's RAM) are ``numerics.lamb_segments`` of the case's
tensor starts.

cocotb tests (selected by tests/test_rtl_lamb.py):

- ``lamb_cases``: ``$L2L_KERNEL_CASES`` (JSON list of {kind, n, K, starts, steps,
  gr_off, then, n_decay, wd, zero}; kinds of sim/eps_vectors.py, their p, m, v and
  contributions with LAMB's scalars at step t; ``zero``: [lo, hi) elements whose
  p, m, v and gradients are +0, an all-zero tensor when it is one), several steps
  each on the state in device memory.
- ``lamb_edge_args``: n = 0 (pass 1: flag 1, nothing else; pass 2: nothing),
  k = 0, k = 256 and a pass register of 0 or 3 (flag 0, nothing else).
- ``lamb_throughput``: memory that never pauses; elements per clock of each pass
  (pass 1 one element a clock: a lane's rate of 1/LANES; pass 2 one beat a
  clock between boundaries), printed to ``$L2L_KERNEL_REPORT``.
- ``lamb_trace_replay``: every update of a recorded LAMB training run
  (``$L2L_TRACE``, sim/eps_trace.py with optimizer="lamb") replayed through both
  passes, each layer's state kept in device memory across steps.

Environment: as sim/tb_eps_kernel.py (``L2L_GDTYPE``, ``L2L_CDTYPE``,
``L2L_KERNEL_SEED``, ``L2L_KERNEL_PAUSE``, ``L2L_KERNEL_REPORT``).
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

import cocotb
import numpy as np

import eps_vectors as ev
from l2l.eps import OptimizerHyper, numerics
from l2l.eps.contract import LambScalars
from tb_eps_kernel import GUARD, RTL, SENTINEL, TB, Layout, assert_same, f32_bits, register_map

LAMB_ARG_NAMES = ["gr", "p", "m", "v", "copy", "finite", "n", "k", "n_decay", *LambScalars.names()]
LAMB_BUFFERS = ["gr", "p", "m", "v", "copy", "finite", "seg", "sums", "steps"]
LAMB_WORDS = ["pass", "seg", "sums", "steps", "nseg"]


def lamb_register_map(path: Path = RTL / "l2l_axil_ctrl.v") -> dict[str, int]:
    """``{argument name: byte offset}`` of eps_lamb_<g>_<c>: the buffers, n, k and n_decay where the
    AdamW map has them, LAMB's nine scalars in LambScalars order from AdamW's first scalar word
    (0x4C), then the LAMB_ADDR_* words of l2l_axil_ctrl.v past the status register."""
    adamw = register_map(path)
    regs = {name: adamw[name] for name in LAMB_ARG_NAMES[:9]}
    for i, name in enumerate(LambScalars.names()):
        regs[name] = adamw["decay"] + 4 * i
    found = re.findall(r"localparam\s*\[7:0\]\s*LAMB_ADDR_(\w+)\s*=\s*8'h([0-9A-Fa-f]+)\s*;", path.read_text())
    regs.update({name.lower(): int(val, 16) for name, val in found})
    assert [k for k in regs if k in LAMB_WORDS] == LAMB_WORDS, regs
    return regs


@dataclass
class LambLayout(Layout):
    seg: int = 0       # copy's RAM: nseg + 1 uint32
    sums: int = 0      # p's RAM: nseg * 32 float32
    steps: int = 0     # gr's RAM: nseg float32


@dataclass
class LambUpdate:
    """One LAMB update's inputs: K contributions (words of the gradient dtype), the scalars, the
    segments, the decay boundary register's value."""
    grads: list
    s: LambScalars
    seg: numerics.Segments
    n_decay: int

    @property
    def n(self) -> int:
        return int(self.seg.bounds[-1])

    @property
    def K(self) -> int:
        return len(self.grads)


class LambTB(TB):
    """tb_eps_kernel.TB with LAMB's register map, buffers and two passes."""

    def __init__(self, dut, seed: int = 1):
        super().__init__(dut, seed)
        self.lamb_regs = lamb_register_map()
        self.cb = self.cw // 8

    def lamb_layout(self, n: int, k: int, nseg: int, gr_off: int = 0) -> LambLayout:
        base = self.layout(n, k, gr_off)
        lay = LambLayout(**vars(base), seg=self._alloc("copy", 4 * (nseg + 1), 4096),
                         sums=self._alloc("p", 128 * nseg, 4096), steps=self._alloc("gr", 4 * nseg, 4096))
        for port, addr, size in self._extra(lay, nseg):
            self.ram[port].write(addr - GUARD, self.rng.randbytes(size + 2 * GUARD))
        return lay

    @staticmethod
    def _extra(lay: LambLayout, nseg: int):
        return (("copy", lay.seg, 4 * (nseg + 1)), ("p", lay.sums, 128 * nseg), ("gr", lay.steps, 4 * nseg))

    def lamb_guards(self, lay: LambLayout, n: int, k: int, nseg: int) -> dict:
        out = self.guards(lay, n, k)
        for port, addr, size in self._extra(lay, nseg):
            out[(port, addr)] = (self.ram[port].read(addr - GUARD, GUARD), self.ram[port].read(addr + size, GUARD))
        return out

    def read_sums(self, lay: LambLayout, nseg: int) -> np.ndarray:
        return np.frombuffer(self.ram["p"].read(lay.sums, 128 * nseg), np.float32).reshape(nseg, 2, numerics.LANES)

    async def write_args(self, lay: LambLayout, n: int, k: int, s: LambScalars, n_decay: int | None = None, *,
                         pass_: int = 1, nseg: int = 0) -> None:
        """Every word from 0x10 to 0x93 in two writes (the status word between them is read-only)."""
        vals = {name: getattr(lay, name) for name in LAMB_BUFFERS}
        vals.update(n=n, k=k, n_decay=n if n_decay is None else n_decay, nseg=nseg, **{"pass": pass_},
                    **{name: f32_bits(x) for name, x in zip(LambScalars.names(), s.as_tuple())})
        words = {}
        for name, off in self.lamb_regs.items():
            words[off] = vals[name] & 0xFFFF_FFFF
            if name in LAMB_BUFFERS:
                words[off + 4] = vals[name] >> 32
        for lo, hi in ((self.regs["gr"], self.regs["inv_scale"] + 4),
                       (self.lamb_regs["pass"], self.lamb_regs["nseg"] + 4)):
            await self.axil.write(lo, b"".join(words[o].to_bytes(4, "little") for o in range(lo, hi, 4)))

    def write_lamb_state(self, lay: LambLayout, p, m, v) -> None:
        self.write_state(lay, p, m, v)

    def write_seg(self, lay: LambLayout, seg: numerics.Segments) -> None:
        self.ram["copy"].write(lay.seg, np.asarray(seg.bounds, np.uint32).tobytes())

    async def update(self, lay: LambLayout, u: LambUpdate, what: str, *, check: bool = True) -> tuple[bool, int, int]:
        """Both passes, the host's fold between them, every output checked against the golden model
        from the state in device memory before the update. Returns (finite, pass 1 cycles, pass 2
        cycles)."""
        n, k, nseg = u.n, u.K, u.seg.count
        before = self.lamb_guards(lay, n, k, nseg)
        p0, m0, v0, c0 = (a.copy() for a in self.read_state(lay, n))
        sums0 = self.ram["p"].read(lay.sums, 128 * nseg)
        g = np.empty(n, np.float32)
        finite = numerics.reduce_gradients([ev.grad_array(w, self.gdtype) for w in u.grads], u.s.inv_scale, g)
        self.write_grads(lay, np.concatenate(u.grads))
        self.write_seg(lay, u.seg)
        self.ram["p"].write_dword(lay.finite, SENTINEL)
        await self.write_args(lay, n, k, u.s, u.n_decay, pass_=1, nseg=nseg)
        c1 = await self.start_and_wait()
        flag = self.read_flag(lay)
        assert flag == int(finite), f"{what}: flag {flag:#x}, the golden model says finite={finite}"
        decayed = min(u.n_decay, n)
        if not finite:
            for name, a, e in zip(("p", "m", "v", "copy"), self.read_state(lay, n), (p0, m0, v0, c0)):
                assert_same(f"{what}: {name} (not finite: untouched)", a, e)
            assert self.ram["p"].read(lay.sums, 128 * nseg) == sums0, f"{what}: sums written on a skip"
            assert self.lamb_guards(lay, n, k, nseg) == before, f"{what}: bytes outside the buffers changed"
            return False, c1, 0
        want_m, want_v = m0.copy(), v0.copy()
        want_sums = numerics.lamb_norms(p0.copy(), want_m, want_v, g, u.s, u.seg, n_decay=decayed)
        p1, m1, v1, cc1 = self.read_state(lay, n)
        assert_same(f"{what}: pass 1 p (read only)", p1, p0)
        assert_same(f"{what}: pass 1 copy (not written)", cc1, c0)
        if check:
            assert_same(f"{what}: m'", m1, want_m)
            assert_same(f"{what}: v'", v1, want_v)
        sums = self.read_sums(lay, nseg)
        assert_same(f"{what}: lane sums", sums.reshape(-1), want_sums.reshape(-1))
        steps = numerics.lamb_steps(sums, u.seg, u.s, decayed)        # the host's fold, from device memory
        self.ram["gr"].write(lay.steps, np.ascontiguousarray(steps, np.float32).tobytes())
        await self.write_args(lay, n, k, u.s, u.n_decay, pass_=2, nseg=nseg)
        c2 = await self.start_and_wait()
        want_p, want_c = p0.copy(), np.empty_like(c0)
        numerics.lamb_apply(want_p, want_m, want_v, u.s, u.seg, steps, copy_out=want_c, n_decay=decayed)
        p2, m2, v2, cc2 = self.read_state(lay, n)
        assert_same(f"{what}: p'", p2, want_p)
        assert_same(f"{what}: copy", cc2, want_c)
        assert_same(f"{what}: pass 2 m (read only)", m2, m1)
        assert_same(f"{what}: pass 2 v (read only)", v2, v1)
        assert self.read_flag(lay) == 1, f"{what}: pass 2 wrote the flag word"
        assert self.lamb_guards(lay, n, k, nseg) == before, f"{what}: bytes outside the buffers changed"
        return True, c1, c2


def lamb_scalars(case: ev.Case, t: int, wd: float) -> LambScalars:
    """LAMB's scalars at step t with the case's inv_scale (its loss scale and divisor)."""
    hyper = OptimizerHyper(optimizer="lamb", lr=1e-3, weight_decay=wd)
    return replace(LambScalars.compute(hyper, t), inv_scale=case.s.inv_scale)


def _seed() -> int:
    return int(os.environ.get("L2L_KERNEL_SEED", "1"))


@cocotb.test()
async def lamb_cases(dut):
    """Layers from the vector classes with LAMB's scalars and segments, several steps each, under
    random AXI pauses."""
    tb = LambTB(dut, _seed())
    await tb.reset()
    tb.set_backpressure(float(os.environ.get("L2L_KERNEL_PAUSE", "0.2")))
    cases = json.loads(os.environ.get("L2L_KERNEL_CASES", '[{"kind": "train", "n": 37, "K": 2}]'))
    for spec in cases:
        kind, n, K = spec["kind"], int(spec["n"]), int(spec["K"])
        steps, gr_off = int(spec.get("steps", 1)), int(spec.get("gr_off", 0))
        seg = numerics.lamb_segments(spec.get("starts", [0]), n)
        lay = tb.lamb_layout(n, K, seg.count, gr_off)
        first = ev.make_case(kind, tb.nprng, n, K, tb.gdtype)
        zlo, zhi = spec.get("zero", (0, 0))
        for a in (first.p, first.m, first.v):
            a[zlo:zhi] = 0.0
        tb.write_state(lay, first.p, first.m, np.abs(first.v))
        for step in range(steps):
            case = first if step == 0 else ev.make_case(spec.get("then", kind), tb.nprng, n, K, tb.gdtype)
            n_decay = int(spec.get("n_decay", n))
            grads = [case.grad_words(i) for i in range(K)]
            for w in grads:
                w[zlo:zhi] = 0
            u = LambUpdate(grads,
                           lamb_scalars(case, 3 + step, float(spec.get("wd", 0.01))), seg, n_decay)
            what = f"lamb {kind} n={n} K={K} starts={spec.get('starts', [0])} n_decay={n_decay} step {step + 1}"
            finite, c1, c2 = await tb.update(lay, u, what)
            tb.log.info("%s: finite=%s, %d + %d cycles", what, finite, c1, c2)


@cocotb.test()
async def lamb_edge_args(dut):
    """n = 0: pass 1 writes flag 1 and nothing else, pass 2 nothing; k = 0, k = 256 and a pass
    register of 0 or 3 write flag 0 and nothing else."""
    tb = LambTB(dut, _seed() + 7)
    await tb.reset()
    n = 3 * tb.lanes + 1
    case = ev.make_case("train", tb.nprng, n, 2, tb.gdtype)
    seg = numerics.lamb_segments([0, 2], n)
    lay = tb.lamb_layout(n, 2, seg.count)
    tb.write_state(lay, case.p, case.m, np.abs(case.v))
    tb.write_grads(lay, np.concatenate([case.grad_words(i) for i in range(2)]))
    tb.write_seg(lay, seg)
    s = lamb_scalars(case, 1, 0.01)
    for n_arg, k_arg, pass_, want in ((0, 2, 1, 1), (0, 2, 2, None), (n, 0, 1, 0), (n, 256, 1, 0),
                                      (n, 2, 0, 0), (n, 2, 3, 0)):
        before, prior = tb.lamb_guards(lay, n, 2, seg.count), tb.read_state(lay, n)
        sums0 = tb.ram["p"].read(lay.sums, 128 * seg.count)
        tb.ram["p"].write_dword(lay.finite, SENTINEL)
        await tb.write_args(lay, n_arg, k_arg, s, pass_=pass_, nseg=0 if n_arg == 0 else seg.count)
        await tb.start_and_wait()
        got = tb.read_flag(lay)
        assert got == (SENTINEL if want is None else want), (n_arg, k_arg, pass_, hex(got))
        for name, a, e in zip(("p", "m", "v", "copy"), tb.read_state(lay, n), prior):
            assert_same(f"n={n_arg} k={k_arg} pass={pass_}: {name}", a, e)
        assert tb.ram["p"].read(lay.sums, 128 * seg.count) == sums0
        assert tb.lamb_guards(lay, n, 2, seg.count) == before


@cocotb.test()
async def lamb_throughput(dut):
    """Memory that never pauses: cycles of each pass on a layer of ``$L2L_KERNEL_RATE_N`` elements in
    segments of ``$L2L_KERNEL_RATE_SEG`` elements, K = 1; outputs still checked bit for bit.
    Figures to ``$L2L_KERNEL_REPORT``."""
    tb = LambTB(dut, 3)
    await tb.reset()
    n = int(os.environ.get("L2L_KERNEL_RATE_N", str(256 * tb.lanes)))
    step = int(os.environ.get("L2L_KERNEL_RATE_SEG", "1000"))
    seg = numerics.lamb_segments(list(range(0, n, step)), n)
    case = ev.make_case("train", tb.nprng, n, 1, tb.gdtype)
    lay = tb.lamb_layout(n, 1, seg.count)
    tb.write_state(lay, case.p, case.m, np.abs(case.v))
    u = LambUpdate([case.grad_words(0)], lamb_scalars(case, 2, 0.01), seg, n)
    finite, c1, c2 = await tb.update(lay, u, f"throughput n={n}")
    assert finite
    report = {"lanes": tb.lanes, "n": n, "segments": seg.count, "pass1_cycles": c1, "pass2_cycles": c2,
              "pass1_elements_per_clock": n / c1, "pass2_elements_per_clock": n / c2}
    tb.log.info("LAMB kernel rate: %s", report)
    if os.environ.get("L2L_KERNEL_REPORT"):
        Path(os.environ["L2L_KERNEL_REPORT"]).write_text(json.dumps(report))


@cocotb.test()
async def lamb_trace_replay(dut):
    """Every update of a recorded LAMB run through both passes, bit for bit against the NumPy
    EPS's recorded outputs (and the golden model's, which update() checks on the way)."""
    import eps_trace

    tb = LambTB(dut, _seed())
    await tb.reset()
    tb.set_backpressure(float(os.environ.get("L2L_KERNEL_PAUSE", "0.1")))
    trace = eps_trace.load(Path(os.environ["L2L_TRACE"]))
    assert trace.optimizer == "lamb", trace.optimizer
    lays, done = {}, []
    for i, up in enumerate(trace.updates):
        n, K = up.p.shape[0], up.grads.shape[0]
        seg = numerics.lamb_segments(up.tensor_starts, n)
        if up.layer not in lays:
            lays[up.layer] = tb.lamb_layout(n, K, seg.count)
            tb.write_state(lays[up.layer], up.p, up.m, up.v)
        lay = lays[up.layer]
        for name, a, e in zip(("p", "m", "v"), tb.read_state(lay, n)[:3], (up.p, up.m, up.v)):
            assert_same(f"update {i}: the kernel's {name} is the recorded input", a, e)
        grads = [ev.words(np.ascontiguousarray(up.grads[j])) for j in range(K)]
        u = LambUpdate(grads, up.scalars, seg, up.n_decay)
        finite, _, _ = await tb.update(lay, u, f"update {i} (layer {up.layer})")
        assert finite == up.finite, (i, finite, up.finite)
        p, m, v, c = tb.read_state(lay, n)
        for name, a, e in zip(("p", "m", "v", "copy"), (p, m, v, c), (up.p_out, up.m_out, up.v_out, up.copy_out)):
            assert_same(f"update {i}: {name} against the NumPy EPS", a, e)
        done.append({"layer": up.layer, "n": n, "K": K, "segments": seg.count, "n_decay": up.n_decay,
                     "finite": finite})
    if os.environ.get("L2L_KERNEL_REPORT"):
        Path(os.environ["L2L_KERNEL_REPORT"]).write_text(json.dumps({"updates": done}))
