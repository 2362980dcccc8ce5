"""cocotb testbench of LAMB's second pass in the RTL EPS (fpga/rtl/l2l_eps_lamb_apply.v).

p' and the device copy of every element compared bit for bit (NaN == NaN) with the golden
model ``l2l.eps.numerics.lamb_apply``, tkeep / tlast of every output beat with the input's.
The state is pass 1's: p, m', v' from ``numerics.lamb_norms`` on tb_eps_lamb.make_case's
values; the step sizes either the host's fold (``numerics.lamb_steps`` of the golden sums)
or, with ``steps: "random"``, random per segment (zeros of both signs, tiny, huge). Each
lane's step is its element's segment's (segment boundaries fall inside beats); its decay
bit is ``index < n_decay``.

tests/test_rtl_lamb.py runs this with $L2L_TB_CONFIG: lanes, cdtype, cases (as
tb_eps_lamb's plus steps), seed, idle, backpressure, last_every (beats per tlast).
"""
from __future__ import annotations

import numpy as np
import cocotb
from cocotb.clock import Clock
from cocotb.triggers import RisingEdge

import eps_vectors as ev
from l2l.eps import numerics
from l2l.eps.numerics import COPY_DTYPES
from tb_eps_datapath import (JUNK32, BeatSink, BeatSource, assert_words, cfg, decay_of, f32_word, keep_of, pack,
                             padded, random_pause, unpack)
from tb_eps_lamb import make_case

SCALAR_PORTS = ["inv_bc2_sqrt", "eps", "inv_bc1", "wd"]


@cocotb.test()
async def lamb_apply_vectors(dut):
    """Each configured case under random input bubbles and output backpressure."""
    lanes = len(dut.s_axis_tkeep)
    cdtype = cfg("cdtype", "fp32")
    cw = ev.DTYPE_BITS[cdtype]
    assert len(dut.m_axis_c) == cw * lanes, "CDTYPE of the build and the config differ"
    seed = int(cfg("seed", 1))
    cocotb.start_soon(Clock(dut.clk, 10, unit="ns", impl="gpi").start(start_high=False))
    source = BeatSource(dut.clk, dut.s_axis_tvalid, dut.s_axis_tready,
                        {"p": dut.s_axis_p, "m": dut.s_axis_m, "v": dut.s_axis_v, "step": dut.s_axis_step,
                         "tkeep": dut.s_axis_tkeep, "decay": dut.s_axis_decay, "tlast": dut.s_axis_tlast})
    sink = BeatSink(dut.clk, dut.m_axis_tvalid, dut.m_axis_tready,
                    {"p": dut.m_axis_p, "c": dut.m_axis_c, "tkeep": dut.m_axis_tkeep, "tlast": dut.m_axis_tlast})
    source.set_pause_generator(random_pause(seed, float(cfg("idle", 0.3))))
    sink.set_pause_generator(random_pause(seed + 1, float(cfg("backpressure", 0.3))))
    for name in SCALAR_PORTS:
        getattr(dut, name).value = 0
    dut.rst.value = 1
    for _ in range(3):
        await RisingEdge(dut.clk)
    dut.rst.value = 0
    rng = np.random.default_rng(seed)
    last_every = int(cfg("last_every", 4))
    for spec in cfg("cases", [{"starts": [0, 5], "n": 40}]):
        p, m, v, g, s = make_case(spec, rng)
        n = p.size
        n_decay = int(spec.get("n_decay", n))
        seg = numerics.lamb_segments(spec["starts"], n)
        sums = numerics.lamb_norms(p, m, v, g, s, seg, n_decay=n_decay)      # m, v become m', v'
        if spec.get("steps") == "random":
            steps = (rng.standard_normal(seg.count) * 10.0 ** rng.uniform(-30, 30, seg.count)).astype(np.float32)
            steps[::4] = np.float32(-0.0)
            steps[1::5] = np.float32(0.0)
        else:
            steps = numerics.lamb_steps(sums, seg, s, n_decay)
        what = f"starts={spec['starts']} n={n} n_decay={n_decay} L={lanes} -> {cdtype} steps={steps[:4]}"
        for name in SCALAR_PORTS:
            getattr(dut, name).value = f32_word(getattr(s, name))
        step_of = ev.words(steps[np.searchsorted(seg.bounds, np.arange(n), side="right") - 1])
        rows = {k: padded(w, lanes, JUNK32) for k, w in
                (("p", ev.words(p)), ("m", ev.words(m)), ("v", ev.words(v)), ("step", step_of))}
        nb = rows["p"].shape[0]
        sent = [{**{k: pack(rows[k][b]) for k in rows}, "tkeep": keep_of(n, lanes, b),
                 "decay": decay_of(n_decay, lanes, b),
                 "tlast": int(b % last_every == last_every - 1 or b == nb - 1)} for b in range(nb)]
        source.send(sent)
        await sink.wait_for(nb, 20 * nb + 400, what)
        got = sink.take()
        for i, (b, x) in enumerate(zip(got, sent)):
            assert b["tkeep"] == x["tkeep"] and b["tlast"] == x["tlast"], f"{what}: tkeep/tlast of beat {i}"
        rp, rc = p.copy(), np.empty(n, COPY_DTYPES[cdtype])
        numerics.lamb_apply(rp, m.copy(), v.copy(), s, seg, steps, copy_out=rc, n_decay=n_decay)
        gp = np.concatenate([unpack(b["p"], lanes, 32) for b in got])[:n]
        gc = np.concatenate([unpack(b["c"], lanes, cw) for b in got])[:n]
        inputs = {"p": ev.words(p), "m": ev.words(m), "v": ev.words(v), "step": step_of}
        assert_words(gp, ev.words(rp), "fp32", f"{what}: p'", inputs)
        assert_words(gc, ev.words(rc), cdtype, f"{what}: copy", inputs)
        moved = int((gp != ev.words(p)).sum())
        dut._log.info("lamb apply %s: %d elements, %d moved: ok", what, n, moved)
