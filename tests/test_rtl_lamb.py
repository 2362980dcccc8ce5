"""The RTL EPS's LAMB: its two passes' datapaths (fpga/rtl/l2l_eps_lamb_norms.v,
l2l_eps_lamb_lane.v, l2l_eps_lamb_acc.v, l2l_eps_lamb_apply.v) and the kernel built for it
(l2l_eps_kernel.v, OPTIMIZER = 2), bit for bit against the golden model
(``l2l.eps.numerics``), through cocotb.

- ``test_lamb_norms``: segments of 1, 15, 16, 17, 1000 and 37 elements (ragged tails),
  one all-zero tensor, n_decay at 0, inside a segment, on a segment boundary, at n; a
  zero weight decay; random input bubbles and backpressure on both outputs. m', v',
  tlast and every segment's 2 x 16 lane sums.
- ``test_lamb_norms_throughput``: one element per clock (one lost clock a segment) with
  the outputs always ready.
- ``test_lamb_apply``: LAMB's second pass (fpga/rtl/l2l_eps_lamb_apply.v,
  sim/tb_eps_lamb_apply.py) against ``numerics.lamb_apply`` at LANES 1, 4, 3 with each copy
  dtype: p' and the copy of every element, segment boundaries inside beats, the host fold's
  step sizes and random ones (zeros of both signs, tiny, huge), decay boundaries.
- ``test_lamb_kernel_*`` and the trace replay: the LAMB kernel (``l2l_eps_kernel`` with OPTIMIZER = 2,
  sim/tb_eps_lamb_kernel.py): both passes through AXI with the host's fold between them;
  its register map, ``fpga/ARGS.md`` and ``kernel_lamb.xml``; lint at its corners.

About three minutes of CPU in all (Icarus).
"""
from __future__ import annotations

import json
import re
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "sim"))
import rtl_runner  # noqa: E402

from test_rtl_datapath import sources  # noqa: E402

needs_sim = pytest.mark.skipif(rtl_runner.missing_simulator() is not None,
                               reason=str(rtl_runner.missing_simulator()))

# segments of 1, 15, 16, 17, 1000, 37 elements; elements [1, 16) all zero
STARTS = [0, 1, 16, 32, 49, 1049]
N = 1086
CASES = [
    {"starts": STARTS, "n": N, "n_decay": 49 + 517, "zero": [1, 16], "mzero": [560, 572], "wd": 0.01},
    {"starts": STARTS, "n": N, "n_decay": 32, "wd": 0.1, "t": 1, "scale": 1.0},
    {"starts": [0, 17, 40], "n": 57, "n_decay": 0, "wd": 0.01},
    {"starts": [0, 17, 40], "n": 57, "n_decay": 57, "wd": 0.0},
    {"starts": [0, 5], "n": 21, "n_decay": 20, "mzero": [0, 21], "wd": 0.5, "t": 100},
    {"starts": [0, 3], "n": 40, "n_decay": 30, "scale": 22.0},
    # one-element segments back to back (a sums transfer every element), then 16, 1, 33
    {"starts": [0, 1, 2, 3, 4, 5, 6, 7, 8, 24, 25], "n": 58, "n_decay": 7, "mzero": [5, 9], "wd": 0.2},   # squares and sums past binary32: inf
]


def run(config: dict, tests) -> None:
    rtl_runner.run("l2l_eps_lamb_norms", sources("l2l_eps_lamb_norms"), "tb_eps_lamb",
                   env={"L2L_TB_CONFIG": json.dumps(config)}, testcase=list(tests))


@needs_sim
def test_lamb_norms():
    run({"cases": CASES, "seed": 5, "idle": 0.3, "backpressure": 0.3}, ["lamb_norms_vectors", "lamb_norms_reset"])


@needs_sim
def test_lamb_norms_throughput():
    run({"throughput": {"starts": [0, 1, 17, 33, 200], "n": 400}}, ["lamb_norms_throughput"])


APPLY = [
    # lanes, cdtype
    (1, "fp32"),
    (4, "bf16"),
    (3, "fp16"),
]
APPLY_CASES = [
    {"starts": [0, 1, 16, 32, 49], "n": 300, "n_decay": 49 + 117, "zero": [1, 16], "mzero": [160, 172],
     "wd": 0.01, "scale": 1.0},
    {"starts": [0, 1, 16, 32, 49], "n": 300, "n_decay": 33, "wd": 0.1, "steps": "random"},
    {"starts": [0, 17, 40], "n": 57, "n_decay": 0, "wd": 0.0, "scale": 0.5},
    {"starts": [0, 5], "n": 21, "n_decay": 20, "mzero": [0, 21], "wd": 0.5, "t": 100},
]


@needs_sim
@pytest.mark.parametrize("lanes,cdtype", APPLY, ids=[f"L{a}-{b}" for a, b in APPLY])
def test_lamb_apply(lanes, cdtype):
    config = {"lanes": lanes, "cdtype": cdtype, "cases": APPLY_CASES, "seed": 11 + lanes, "idle": 0.3,
              "backpressure": 0.3, "last_every": 3}
    rtl_runner.run("l2l_eps_lamb_apply", sources("l2l_eps_lamb_apply"), "tb_eps_lamb_apply",
                   parameters={"LANES": lanes, "CDTYPE": {"fp32": 0, "bf16": 1, "fp16": 2}[cdtype]},
                   env={"L2L_TB_CONFIG": json.dumps(config)}, testcase=["lamb_apply_vectors"])


@pytest.mark.parametrize("params", [{"LANES": 4, "CDTYPE": 1}, {"LANES": 16, "CDTYPE": 2}, {"LANES": 3, "CDTYPE": 0}],
                         ids=lambda p: f"L{p['LANES']}-C{p['CDTYPE']}")
def test_lamb_apply_lint(params):
    """Verilator -Wall on l2l_eps_lamb_apply at LANES / CDTYPE corners (test_rtl_lint.py lints
    every module at its defaults only)."""
    from test_rtl_lint import RTL, _check
    _check("l2l_eps_lamb_apply", RTL / "l2l_eps_lamb_apply.v", params)


# ---------------------------------------------------------------- the kernel (OPTIMIZER = 2)

CODE = {"fp32": 0, "bf16": 1, "fp16": 2}


def run_lamb_kernel(testcase, *, lanes: int, gdtype: str, cdtype: str, burst: int, block: int, **env) -> None:
    params = dict(LANES=lanes, GDTYPE=CODE[gdtype], CDTYPE=CODE[cdtype], OPTIMIZER=2, BURST=burst, BLOCK=block,
                  RD_FIFO=max(32, 4 * burst), WR_FIFO=max(16, 2 * burst))
    env = {"L2L_GDTYPE": gdtype, "L2L_CDTYPE": cdtype, "L2L_KERNEL_BLOCK": str(block),
           **{k: str(v) for k, v in env.items()}}
    rtl_runner.run("l2l_eps_kernel", sources("l2l_eps_kernel"), "tb_eps_lamb_kernel",
                   parameters=params, env=env, testcase=testcase)


def kernel_cases(*specs: dict) -> str:
    return json.dumps(list(specs))


@needs_sim
@pytest.mark.heavy
def test_lamb_kernel_lanes4_bf16():
    """LANES = 4, bf16 gradients and copy, 8-beat bursts and blocks, random AXI pauses: segments
    of 1, 2, 3 elements (several ends in one beat), boundaries inside beats and on beat, burst
    and block edges, a 301-element layer ending mid-beat, K = 1 and 2 (gradients mid-beat),
    three steps on one state, a NaN gradient (flag 0, nothing written, not even the sums) then a
    finite step, an all-zero tensor (its norms 0: trust ratio 1, its m, v, p stay 0), zero weight
    decay (no trust ratio), decay boundaries at 0, inside a segment and above n; n = 0, k = 0 / 256 and a bad pass register; the rate of both passes."""
    report = ROOT / "sim" / "build" / f"lamb-rate-{os.getpid()}.json"
    run_lamb_kernel(["lamb_cases", "lamb_edge_args", "lamb_throughput"], lanes=4, gdtype="bf16", cdtype="bf16",
                    burst=8, block=8, L2L_KERNEL_SEED=51, L2L_KERNEL_RATE_N=1024, L2L_KERNEL_RATE_SEG=256,
                    L2L_KERNEL_REPORT=report, L2L_KERNEL_CASES=kernel_cases(
                        {"kind": "train", "n": 1, "K": 1},
                        {"kind": "train", "n": 13, "K": 2, "gr_off": 1, "starts": [0, 1, 3, 6, 7, 8], "n_decay": 7},
                        {"kind": "wide", "n": 37, "K": 1, "starts": [0, 5, 21, 32], "steps": 3, "n_decay": 21,
                         "zero": [5, 21]},                                   # an all-zero tensor
                        {"kind": "nonfinite-nan", "n": 9, "K": 2, "starts": [0, 4], "steps": 2, "then": "train"},
                        {"kind": "train", "n": 301, "K": 2, "gr_off": 2, "starts": [0, 31, 32, 64, 100, 297],
                         "n_decay": 300, "wd": 0.0},
                        {"kind": "train", "n": 40, "K": 1, "starts": [0, 17], "n_decay": 0xFFFF_FFFF}))
    rate = json.loads(report.read_text())
    report.unlink()
    # pass 1: the check pass (a beat a clock), then one element a clock (the contract's sums), each
    # segment's sums 32 / LANES clocks; pass 2: a beat a clock; each plus its pipeline's fill
    n, lanes, nseg = rate["n"], rate["lanes"], rate["segments"]
    assert rate["pass1_cycles"] <= n / lanes + n + nseg * 32 / lanes + 250, rate
    assert rate["pass2_cycles"] <= n / lanes + 160, rate


@needs_sim
def test_lamb_kernel_lanes1_fp32_grads():
    """LANES = 1, fp32 gradients, fp16 copy, 4-beat bursts, 8-beat blocks: K = 1, 2 and 4 (the
    reduction's ties), an overflowing sum (flag 0), one-element segments back to back."""
    run_lamb_kernel("lamb_cases", lanes=1, gdtype="fp32", cdtype="fp16", burst=4, block=8,
                    L2L_KERNEL_SEED=52, L2L_KERNEL_CASES=kernel_cases(
                        {"kind": "ties-reduction", "n": 5, "K": 4, "starts": [0, 1, 2, 3, 4]},
                        {"kind": "train", "n": 17, "K": 2, "starts": [0, 8, 9], "steps": 2, "n_decay": 8},
                        {"kind": "nonfinite-sum-overflow", "n": 4, "K": 2},
                        {"kind": "wide", "n": 9, "K": 1, "starts": [0, 4], "n_decay": 5}))


@needs_sim
def test_lamb_kernel_lanes2_fp16_grads():
    """LANES = 2, fp16 gradients (loss-scaled), fp32 copy, 4-beat bursts and blocks: K = 1 and 2,
    an overflowing scaled gradient (flag 0), segment ends on odd and even lanes."""
    run_lamb_kernel("lamb_cases", lanes=2, gdtype="fp16", cdtype="fp32", burst=4, block=4,
                    L2L_KERNEL_SEED=53, L2L_KERNEL_CASES=kernel_cases(
                        {"kind": "train", "n": 2, "K": 1},
                        {"kind": "wide", "n": 7, "K": 2, "gr_off": 1, "starts": [0, 3], "n_decay": 3},
                        {"kind": "train", "n": 23, "K": 2, "starts": [0, 2, 5, 16], "steps": 2, "n_decay": 16},
                        {"kind": "nonfinite-scale-overflow", "n": 6, "K": 2, "n_decay": 0}))


# ---------------------------------------------------------------- a recorded training run


def test_recorded_lamb_trace_is_what_the_numpy_eps_did(tmp_path):
    """The recorder on a LAMB run: state (p, m, v), LambScalars with the fold's lr and adapt, the
    entry's tensor starts; each update's outputs the golden model's two passes and the host's
    fold of its inputs, each layer's next input its last output; the file round-trips."""
    import eps_trace
    import numpy as np
    from l2l.eps import numerics
    from l2l.eps.contract import LambScalars

    path = tmp_path / "lamb.npz"
    rec = eps_trace.record(path, precision="bf16", contributors=2, steps=2, d_model=2, seq_len=4,
                           decay_split={1: 37}, optimizer="lamb")
    back = eps_trace.load(path)
    assert back.optimizer == rec.optimizer == "lamb" and len(back.updates) == 6
    last = {}
    for u, r in zip(back.updates, rec.updates):
        assert isinstance(u.scalars, LambScalars) and u.scalars == r.scalars and u.scalars.lr > 0
        assert np.array_equal(u.tensor_starts, r.tensor_starts) and u.n_decay == r.n_decay
        if u.layer in last:
            for a, b in zip((u.p, u.m, u.v), last[u.layer]):
                assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
        n = u.p.shape[0]
        g = np.empty(n, np.float32)
        assert numerics.reduce_gradients(u.grads, u.scalars.inv_scale, g) == u.finite
        seg = numerics.lamb_segments(u.tensor_starts, n)
        p, m, v, c = u.p.copy(), u.m.copy(), u.v.copy(), np.empty_like(u.copy_out)
        sums = numerics.lamb_norms(p, m, v, g, u.scalars, seg, n_decay=u.n_decay)
        steps = numerics.lamb_steps(sums, seg, u.scalars, u.n_decay)
        numerics.lamb_apply(p, m, v, u.scalars, seg, steps, copy_out=c, n_decay=u.n_decay)
        for got, want in ((p, u.p_out), (m, u.m_out), (v, u.v_out), (c, u.copy_out)):
            w = {2: np.uint16, 4: np.uint32}[got.dtype.itemsize]
            assert np.array_equal(got.view(w), want.view(w))
        last[u.layer] = (u.p_out, u.m_out, u.v_out)
    assert {u.n_decay for u in back.updates if u.layer == 1} == {37}
    assert max(len(u.tensor_starts) for u in back.updates) > 2, "the block is one tensor: no segments to test"


@needs_sim
@pytest.mark.heavy
def test_lamb_trace_replay_bf16_two_workers_with_skip(tmp_path):
    """A LAMB run: bf16 gradients and copy, two data-parallel workers (K = 2), 3 steps of a
    d_model = 2 GPT (the block's tensors are segments of 2 to 16 elements, several ending in one
    beat at LANES = 4), the block's second update poisoned (skipped, flag 0), the block decaying
    its first 37 elements and the head its first 512; every update through both passes of the
    LAMB kernel, the host's fold between them, bit for bit against the NumPy EPS."""
    import eps_trace

    poison = eps_trace.Poison(step=1, layer=1, contributor=1, index=37)
    path, report = tmp_path / "lamb.npz", tmp_path / "replay.json"
    trace = eps_trace.record(path, precision="bf16", contributors=2, steps=3, d_model=2, seq_len=4,
                             poison=poison, decay_split={1: 37, 2: 512}, optimizer="lamb")
    assert trace.optimizer == "lamb" and len(trace.updates) == 9
    block = [i for i, u in enumerate(trace.updates) if u.layer == 1]
    assert [i for i, u in enumerate(trace.updates) if not u.finite] == [block[1]]
    run_lamb_kernel("lamb_trace_replay", lanes=4, gdtype="bf16", cdtype="bf16", burst=8, block=8,
                    L2L_TRACE=path, L2L_KERNEL_SEED=5, L2L_KERNEL_PAUSE=0.1, L2L_KERNEL_REPORT=report)
    replayed = json.loads(report.read_text())
    assert [(r["layer"], r["finite"], r["n_decay"]) for r in replayed["updates"]] == \
        [(u.layer, u.finite, u.n_decay) for u in trace.updates], "the kernel did not replay the whole trace"
    assert [r["segments"] for r in replayed["updates"] if r["layer"] == 1][0] > 4


# ---------------------------------------------------------------- the register map, kernel_lamb.xml, lint


def _lamb_map() -> dict[str, int]:
    from tb_eps_lamb_kernel import lamb_register_map
    return lamb_register_map()


def test_lamb_register_map_is_adamws_shape_plus_five_words():
    """Buffers, n, k and n_decay where AdamW has them, LAMB's nine scalars in LambScalars order
    in AdamW's nine scalar words, then pass, seg, sums, steps, nseg past the status register
    (0x70), packed (8 bytes a buffer, 4 a word)."""
    from l2l.eps.contract import LambScalars
    from tb_eps_kernel import register_map

    regs, adamw = _lamb_map(), register_map()
    names = ["gr", "p", "m", "v", "copy", "finite", "n", "k", "n_decay"]
    assert list(regs) == [*names, *LambScalars.names(), "pass", "seg", "sums", "steps", "nseg"]
    assert {k: regs[k] for k in names} == {k: adamw[k] for k in names}
    assert [regs[s] for s in LambScalars.names()] == [adamw["decay"] + 4 * i for i in range(9)]
    assert regs["inv_scale"] == adamw["inv_scale"]            # the reducer reads one word in every build
    assert [regs[k] for k in ("pass", "seg", "sums", "steps", "nseg")] == [0x74, 0x78, 0x80, 0x88, 0x90]


def test_args_md_documents_the_lamb_register_map():
    regs = _lamb_map()
    text = (ROOT / "fpga" / "ARGS.md").read_text()
    section = text[text.index("## RTL kernel"):]
    section = section[section.index("### LAMB"):]
    rows = dict(re.findall(r"^\| (0x[0-9A-Fa-f]+) \| `(\w+)` \|", section, re.M))
    documented = {name: int(off, 16) for off, name in rows.items()}
    names = list(regs)
    first, last = names.index("b1"), names.index("inv_scale")
    assert documented == {k: regs[k] for k in names[:first] + names[last + 1:]}
    scalars = re.search(r"\| (0x[0-9A-Fa-f]+) \.\. (0x[0-9A-Fa-f]+) \| `([\w, ]+)` \|", section)
    listed = [s.strip() for s in scalars.group(3).split(",")]
    assert listed == names[first:last + 1]
    assert int(scalars.group(1), 16) == regs[listed[0]] and int(scalars.group(2), 16) == regs[listed[-1]]


def test_kernel_lamb_xml_matches_the_rtl():
    """fpga/rtl/kernel_lamb.xml: eps_lamb_f32_f32 at the module's default LANES with
    OPTIMIZER = 2: every argument in the map's order at its offset, each buffer on the port the
    RTL reads or writes it on (seg on m_axi_copy, sums on m_axi_p, steps on m_axi_gr), the five
    masters at the default data widths, a control range covering the map's end (0x94)."""
    import xml.etree.ElementTree as ET

    src = (ROOT / "fpga" / "rtl" / "l2l_eps_kernel.v").read_text()
    default = {k: int(v) for k, v in re.findall(r"parameter\s+(\w+)\s*=\s*(\d+)\s*[,)]", src)}
    lanes = default["LANES"]
    kernel = ET.parse(ROOT / "fpga" / "rtl" / "kernel_lamb.xml").getroot().find("kernel")
    assert kernel.get("name") == "eps_lamb_f32_f32"
    assert kernel.get("hwControlProtocol") == "ap_ctrl_hs" and kernel.get("interrupt") == "true"
    ports = {p.get("name"): p for p in kernel.find("ports")}
    for name in ports:
        assert re.search(rf"\b{name}_(awvalid|arvalid)\b", src), f"{name}: no such AXI port in the RTL"
    assert int(ports["s_axi_control"].get("range"), 16) == 2 ** default["C_S_AXI_CONTROL_ADDR_WIDTH"] > 0x94
    assert {k: int(p.get("dataWidth")) for k, p in ports.items() if k != "s_axi_control"} == \
        {f"m_axi_{a}": 32 * lanes for a in ("gr", "p", "m", "v", "copy")}
    regs = _lamb_map()
    args = list(kernel.find("args"))
    assert [a.get("name") for a in args] == list(regs)
    assert [int(a.get("id")) for a in args] == list(range(len(regs)))
    on_port = {"gr": "m_axi_gr", "p": "m_axi_p", "m": "m_axi_m", "v": "m_axi_v", "copy": "m_axi_copy",
               "finite": "m_axi_p", "seg": "m_axi_copy", "sums": "m_axi_p", "steps": "m_axi_gr"}
    for a in args:
        name = a.get("name")
        assert int(a.get("offset"), 16) == regs[name], name
        assert int(a.get("size"), 16) == (8 if name in on_port else 4), name
        assert a.get("addressQualifier") == ("1" if name in on_port else "0"), name
        assert a.get("port") == on_port.get(name, "s_axi_control"), name


LAMB_CORNERS = [
    {"OPTIMIZER": 2},
    {"OPTIMIZER": 2, "LANES": 4, "GDTYPE": 1, "CDTYPE": 1, "BURST": 8, "BLOCK": 8, "RD_FIFO": 32, "WR_FIFO": 16},
    {"OPTIMIZER": 2, "LANES": 1, "GDTYPE": 0, "CDTYPE": 2, "BURST": 1, "BLOCK": 1, "RD_FIFO": 2, "WR_FIFO": 2,
     "C_S_AXI_CONTROL_ADDR_WIDTH": 8},
    {"OPTIMIZER": 2, "LANES": 2, "GDTYPE": 2, "CDTYPE": 0, "BURST": 4, "BLOCK": 4, "RD_FIFO": 32, "WR_FIFO": 16},
]


@pytest.mark.parametrize("params", LAMB_CORNERS, ids=lambda p: "-".join(f"{k}{v}" for k, v in p.items()))
@pytest.mark.heavy
def test_lamb_kernel_lint(params):
    """verilator --lint-only -Wall on the LAMB kernel (tests/test_rtl_lint.py's check: no warning,
    waivers in place only) at the default shape, the shapes simulated here and the smallest."""
    from test_rtl_lint import KERNEL, RTL, _check
    _check(KERNEL, RTL / f"{KERNEL}.v", params)


@pytest.mark.parametrize("params", [{"LANES": 1, "EW": 16}, {"LANES": 4, "EW": 16}, {"LANES": 16, "EW": 32}],
                         ids=lambda p: f"L{p['LANES']}-EW{p['EW']}")
def test_words_in_lint(params):
    from test_rtl_lint import RTL, _check
    _check("l2l_words_in", RTL / "l2l_words_in.v", params)
