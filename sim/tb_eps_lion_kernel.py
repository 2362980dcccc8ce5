"""cocotb testbench of the RTL EPS kernel built for Lion (fpga/rtl/l2l_eps_kernel.v, OPTIMIZER = 1).

The kernel is driven as XRT would drive eps_lion_<g>_<c>: its arguments
written through the AXI4-Lite control port at the offsets of the Lion
register map (:func:`lion_register_map`: AdamW's map with v's address word
kept and ignored, Lion's seven scalars from 0x4C in LionScalars order;
fpga/ARGS.md, "RTL kernel", "Lion"), ap_start set, the end awaited on the
interrupt line, as sim/tb_eps_kernel.py does for AdamW (its ``TB`` is reused:
AXI RAMs with random pauses on every channel, guard bytes around every
buffer, the flag word in p's RAM).

References are the golden model only (``l2l.eps.numerics`` through
``lion_vectors.LionCase``): the flag, p', m' and the copy bit for bit; a
layer whose reduced gradient is not finite gets flag 0 and nothing else. What
only a Lion kernel must also keep: v's address register points at a buffer
of noise that must never change, the two words past inv_scale (0x68, 0x6C)
hold noise that must not matter, and m_axi_v never asks for anything.

cocotb tests (selected by tests/test_rtl_lion.py):

- ``lion_cases``: the cases of ``$L2L_KERNEL_CASES`` (JSON list of {kind, n,
  K, steps, gr_off, then, n_decay}, kinds of sim/lion_vectors.py), several
  steps each on the state in device memory.
- ``lion_edge_args``: n = 0 (flag 1, nothing else written), k = 0 and k = 256
  (flag 0).
- ``lion_throughput``: memory that never pauses; the check and update passes'
  steady-state rates (as tb_eps_kernel.test_throughput measures them) must be
  >= 0.95/K element per clock per lane.
- ``lion_trace_replay``: every update of a recorded Lion training run
  (``$L2L_TRACE``, sim/eps_trace.py with optimizer="lion") replayed through
  the kernel, each layer's state kept in device memory across steps, bit for
  bit against the recorded NumPy-backend outputs, skipped updates included.

Environment: as sim/tb_eps_kernel.py (``L2L_GDTYPE``, ``L2L_CDTYPE``,
``L2L_KERNEL_BLOCK``, ``L2L_KERNEL_SEED``, ``L2L_KERNEL_PAUSE``,
``L2L_KERNEL_REPORT``).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import cocotb
import numpy as np

import lion_vectors as lv
from l2l.eps.contract import LionScalars
from tb_eps_kernel import SENTINEL, TB, Layout, RateProbe, assert_same, f32_bits, register_map

LION_ARG_NAMES = ["gr", "p", "m", "copy", "finite", "n", "k", "n_decay", *LionScalars.names()]
LION_BUFFERS = ["gr", "p", "m", "copy", "finite"]


def lion_register_map() -> dict[str, int]:
    """``{argument name: byte offset}`` of eps_lion_<g>_<c> on the RTL kernel: the buffers, n, k
    and n_decay where the AdamW map (l2l_axil_ctrl.v's ADDR_* localparams) has them -- v's word
    at 0x28 stays, ignored -- and Lion's scalars in LionScalars order from AdamW's first scalar
    word (0x4C) on, 4 bytes each."""
    adamw = register_map()
    regs = {name: adamw[name] for name in LION_ARG_NAMES[:8]}
    for i, name in enumerate(LionScalars.names()):
        regs[name] = adamw["decay"] + 4 * i
    return regs


class LionTB(TB):
    """tb_eps_kernel.TB with Lion's state (p, m), argument map and checks."""

    def __init__(self, dut, seed: int = 1):
        super().__init__(dut, seed)
        self.lion_regs = lion_register_map()

    async def reset(self) -> None:
        await super().reset()
        for name in ("arvalid", "awvalid", "wvalid"):      # the tied-off v master never asks
            assert str(getattr(self.dut, f"m_axi_v_{name}").value) == "0", name

    def write_state(self, lay: Layout, p, m, v=None) -> None:
        """p and m; v's buffer keeps the noise layout() put there (the kernel must not touch it)."""
        self.ram["p"].write(lay.p, np.ascontiguousarray(p, np.float32).tobytes())
        self.ram["m"].write(lay.m, np.ascontiguousarray(m, np.float32).tobytes())

    def lion_state(self, lay: Layout, n: int):
        """(p, m, copy) as device memory holds them."""
        p, m, _, c = self.read_state(lay, n)
        return p, m, c

    async def write_args(self, lay: Layout, n: int, k: int, s: LionScalars, n_decay: int | None = None) -> None:
        """Every word from 0x10 to 0x6C in one write: the Lion arguments at their offsets, v's
        address word holding v's (noise) buffer and the two words past inv_scale noise."""
        assert isinstance(s, LionScalars)
        vals = {name: getattr(lay, name) for name in LION_BUFFERS}
        vals.update(n=n, k=k, n_decay=n if n_decay is None else n_decay,
                    **{name: f32_bits(x) for name, x in zip(LionScalars.names(), s.as_tuple())})
        base, end = self.regs["gr"], self.regs["inv_scale"] + 4          # AdamW's whole range
        words = {off: self.rng.getrandbits(32) for off in range(base, end, 4)}
        for name in LION_ARG_NAMES:
            off, val = self.lion_regs[name], vals[name]
            words[off] = val & 0xFFFF_FFFF
            if name in LION_BUFFERS:
                words[off + 4] = val >> 32
        words[self.regs["v"]], words[self.regs["v"] + 4] = lay.v & 0xFFFF_FFFF, lay.v >> 32
        await self.axil.write(base, b"".join(words[o].to_bytes(4, "little") for o in range(base, end, 4)))

    async def lion_update(self, lay: Layout, n: int, k: int, grad_words, s: LionScalars, want_flag: bool,
                          want, what: str, n_decay: int | None = None) -> int:
        """One run; the flag, p', m', the copy (``want``: the expected triple, or None when the
        flag must be 0: nothing written), v's buffer and every guard checked."""
        before = self.guards(lay, n, k)
        v_before = self.ram["v"].read(lay.v, 4 * n)
        prior = self.lion_state(lay, n)
        self.write_grads(lay, grad_words)
        self.ram["p"].write_dword(lay.finite, SENTINEL)
        await self.write_args(lay, n, k, s, n_decay)
        cycles = await self.start_and_wait()
        assert self.read_flag(lay) == int(want_flag), f"{what}: flag {self.read_flag(lay):#x}"
        got = self.lion_state(lay, n)
        for name, a, e in zip(("p", "m", "copy"), got, want if want_flag else prior):
            assert_same(f"{what}: {name}", a, e)
        assert self.ram["v"].read(lay.v, 4 * n) == v_before, f"{what}: v's buffer was written"
        assert self.guards(lay, n, k) == before, f"{what}: bytes outside the buffers changed"
        return cycles


def grads_of(case: lv.LionCase) -> np.ndarray:
    return np.concatenate([case.grad_words(i) for i in range(case.K)])


def _seed() -> int:
    return int(os.environ.get("L2L_KERNEL_SEED", "1"))


@cocotb.test()
async def lion_cases(dut):
    """Layers from the Lion vector classes, several steps each, under random AXI pauses."""
    tb = LionTB(dut, _seed())
    await tb.reset()
    tb.set_backpressure(float(os.environ.get("L2L_KERNEL_PAUSE", "0.2")))
    cases = json.loads(os.environ.get("L2L_KERNEL_CASES", '[{"kind": "train", "n": 37, "K": 2}]'))
    for spec in cases:
        kind, n, K = spec["kind"], int(spec["n"]), int(spec["K"])
        steps, gr_off = int(spec.get("steps", 1)), int(spec.get("gr_off", 0))
        lay = tb.layout(n, K, gr_off)
        first = lv.make_case(kind, tb.nprng, n, K, tb.gdtype)
        p, m = first.p, first.m
        tb.write_state(lay, p, m)
        for step in range(steps):
            case = first if step == 0 else lv.make_case(spec.get("then", kind), tb.nprng, n, K, tb.gdtype)
            case.p, case.m = p, m
            case.n_decay = spec.get("n_decay")
            g, finite = case.reduced()
            want = case.updated(tb.cdtype, g) if finite else None
            what = f"lion {case.name} n={n} K={K} n_decay={case.n_decay} step {step + 1}"
            cycles = await tb.lion_update(lay, n, K, grads_of(case), case.s, finite, want, what, case.n_decay_arg)
            if finite:
                p, m = want[0], want[1]
            tb.log.info("%s: finite=%s, %d cycles", what, finite, cycles)


@cocotb.test()
async def lion_edge_args(dut):
    """n = 0 writes flag 1 and nothing else; k = 0 and k = 256 write flag 0 and nothing else."""
    tb = LionTB(dut, _seed() + 7)
    await tb.reset()
    n = 3 * tb.lanes + 1
    case = lv.make_case("train", tb.nprng, n, 2, tb.gdtype)
    lay = tb.layout(n, 2)
    tb.write_state(lay, case.p, case.m)
    tb.write_grads(lay, grads_of(case))
    for n_arg, k_arg, want in ((0, 2, 1), (n, 0, 0), (n, 256, 0)):
        before, prior = tb.guards(lay, n, 2), tb.lion_state(lay, n)
        v_before = tb.ram["v"].read(lay.v, 4 * n)
        tb.ram["p"].write_dword(lay.finite, SENTINEL)
        await tb.write_args(lay, n_arg, k_arg, case.s)
        await tb.start_and_wait()
        assert tb.read_flag(lay) == want, (n_arg, k_arg, tb.read_flag(lay))
        for name, a, e in zip(("p", "m", "copy"), tb.lion_state(lay, n), prior):
            assert_same(f"n={n_arg} k={k_arg}: {name}", a, e)
        assert tb.ram["v"].read(lay.v, 4 * n) == v_before and tb.guards(lay, n, 2) == before


@cocotb.test()
async def lion_throughput(dut):
    """Memory that never pauses: the check and the update pass each at >= 0.95/K element per
    clock per lane in steady state (whole reducer blocks between the 10 % and the 90 % beat),
    K from ``$L2L_KERNEL_RATE_K``, ``$L2L_KERNEL_RATE_N`` elements a layer; outputs still
    checked bit for bit. Figures (the whole passes' too, not asserted) go to
    ``$L2L_KERNEL_REPORT``."""
    tb = LionTB(dut, 3)
    await tb.reset()
    Ks = [int(x) for x in os.environ.get("L2L_KERNEL_RATE_K", "1").split(",")]
    n = int(os.environ.get("L2L_KERNEL_RATE_N", str(512 * tb.lanes)))
    block = int(os.environ["L2L_KERNEL_BLOCK"])
    report = {"lanes": tb.lanes, "gdtype": tb.gdtype, "cdtype": tb.cdtype, "runs": []}
    for K in Ks:
        case = lv.make_case("train", tb.nprng, n, K, tb.gdtype)
        lay = tb.layout(n, K)
        tb.write_state(lay, case.p, case.m)
        g, finite = case.reduced()
        assert finite
        probe = RateProbe(tb)
        cycles = await tb.lion_update(lay, n, K, grads_of(case), case.s, True, case.updated(tb.cdtype, g),
                                      f"rate K={K}")
        probe.stop()
        check = probe.first(RateProbe.S_SAMPLE) - probe.first(RateProbe.S_CHECK)
        upd = probe.first(RateProbe.S_DONE) - probe.first(RateProbe.S_UPDATE)
        run = {"K": K, "n": n, "total_cycles": cycles, "check_cycles": check, "update_cycles": upd,
               "check_elems_per_cycle_per_lane": n / tb.lanes / check,
               "update_elems_per_cycle_per_lane": n / tb.lanes / upd,
               "check_steady_elems_per_cycle_per_lane": RateProbe.steady(probe.gr, K * block) / K,
               "update_steady_elems_per_cycle_per_lane": RateProbe.steady(probe.pw, block)}
        report["runs"].append(run)
        tb.log.info("throughput lion %s", run)
    if os.environ.get("L2L_KERNEL_REPORT"):
        Path(os.environ["L2L_KERNEL_REPORT"]).write_text(json.dumps(report, indent=1))
    for run in report["runs"]:
        for what in ("check", "update"):
            assert run[f"{what}_steady_elems_per_cycle_per_lane"] >= 0.95 / run["K"], run


@cocotb.test()
async def lion_trace_replay(dut):
    """Every EPS update of a recorded Lion training run, replayed through the kernel bit for bit.

    Before each update the state in device memory must equal the recorded input state; a
    recorded skip (flag 0) must leave p, m and the copy as they were (the recorder's outputs
    equal its inputs there; the copy is compared once a finite update of the layer wrote it).
    ``$L2L_KERNEL_REPORT``, when set, gets what was replayed."""
    import eps_trace

    tb = LionTB(dut, _seed())
    await tb.reset()
    tb.set_backpressure(float(os.environ.get("L2L_KERNEL_PAUSE", "0.1")))
    trace = eps_trace.load(os.environ["L2L_TRACE"])
    assert trace.optimizer == "lion", trace.optimizer
    assert trace.gdtype == tb.gdtype and trace.cdtype == tb.cdtype
    layouts: dict[int, Layout] = {}
    copy_written: set[int] = set()
    replayed = []
    for i, u in enumerate(trace.updates):
        n, K = u.p.shape[0], u.grads.shape[0]
        what = f"update {i} (layer {u.layer}, n={n}, K={K})"
        assert u.v is None and isinstance(u.scalars, LionScalars), what
        if u.layer not in layouts:
            layouts[u.layer] = tb.layout(n, K)
            tb.write_state(layouts[u.layer], u.p, u.m)
        lay = layouts[u.layer]
        for name, a, e in zip("pm", tb.lion_state(lay, n)[:2], (u.p, u.m)):
            assert_same(f"{what} input {name}", a, e)
        if not u.finite:
            for name, a, e in zip("pm", (u.p_out, u.m_out), (u.p, u.m)):
                assert_same(f"{what}: recorded skip changed {name}", a, e)
        copy_checked = bool(u.finite or u.layer in copy_written)
        prior_copy = tb.lion_state(lay, n)[2]
        want = (u.p_out, u.m_out, u.copy_out if copy_checked else prior_copy)
        await tb.lion_update(lay, n, K, eps_trace.grad_words(u.grads), u.scalars, u.finite,
                             want if u.finite else None, what, u.n_decay)
        got = tb.lion_state(lay, n)
        for name, a, e in zip(("p", "m", "copy"), got, want):
            assert_same(f"{what} output {name}", a, e)
        if u.finite:
            copy_written.add(u.layer)
        replayed.append({"layer": u.layer, "n": n, "K": K, "n_decay": u.n_decay, "finite": u.finite,
                         "copy_checked": copy_checked})
    tb.log.info("replayed %d Lion updates of %d layers (%d not finite) bit for bit",
                len(replayed), len(layouts), sum(not r["finite"] for r in replayed))
    if os.environ.get("L2L_KERNEL_REPORT"):
        Path(os.environ["L2L_KERNEL_REPORT"]).write_text(json.dumps(
            {"gdtype": tb.gdtype, "cdtype": tb.cdtype, "lanes": tb.lanes, "updates": replayed}, indent=1))

