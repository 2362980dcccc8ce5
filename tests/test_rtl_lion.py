"""The RTL EPS's Lion update (fpga/rtl/l2l_eps_lion.v, l2l_eps_lion_lane.v, and the kernel
l2l_eps_kernel.v built with OPTIMIZER = 1) bit for bit against the golden model
``l2l.eps.numerics.lion_update``, through cocotb.

- ``test_lion_vector_classes_do_what_they_say`` (no simulation): sim/lion_vectors.py's
  classes land where they claim -- every product or every sum on a tie (by the independent
  oracle's count), c a zero of both signs, a non-finite reduced g.
- ``test_lion_datapath``: l2l_eps_lion (sim/tb_eps_lion.py) at LANES 1, 2, 4 with each copy
  dtype: every Lion class, decay boundaries at 0, 1, n - 1, n, inside a beat, on beat /
  burst / block edges and above n, the RTL's own state fed back for several steps, a reset
  mid-stream, one beat per clock and the LATENCY output; random bubbles and backpressure.
- ``test_lion_kernel_*``: the whole kernel through AXI (sim/tb_eps_lion_kernel.py) with 20 %
  random pauses on every channel: each gradient dtype at K = 1 and K = 2 and each copy dtype,
  n around LANES and BURST x LANES, gradients starting mid-beat, decay boundaries, several
  steps on one state, non-finite gradients (flag 0, nothing written), n = 0 / k = 0 / k = 256,
  v's buffer and the words past inv_scale never touched or used; the LANES = 4 build also
  checks both passes' steady-state rate (>= 0.95/K element per clock per lane).
- ``test_lion_trace_replay_bf16_two_workers_with_skip``: a real Lion training run (tiny GPT,
  NumPy EPS with ``--optimizer lion``, bf16, two data-parallel workers, one poisoned update)
  recorded by sim/eps_trace.py and replayed through the Lion kernel, every update bit for bit.
- The Lion register map: fpga/ARGS.md's "Lion" subsection and fpga/rtl/kernel_lion.xml against
  the map the testbench drives; the kernel's lint at OPTIMIZER = 1 corners.

About 1 minute of CPU in all (Icarus; the kernel builds take most of it).
"""
from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "sim"))
import rtl_runner  # noqa: E402

from test_rtl_datapath import sources  # noqa: E402

needs_sim = pytest.mark.skipif(rtl_runner.missing_simulator() is not None,
                               reason=str(rtl_runner.missing_simulator()))

CODE = {"fp32": 0, "bf16": 1, "fp16": 2}
DATAPATH_TESTS = ["lion_vectors", "lion_decay_boundaries", "lion_multistep", "lion_reset", "lion_throughput"]


def run_lion_datapath(lanes: int, cdtype: str, config: dict, tests=DATAPATH_TESTS) -> float:
    config = {"lanes": lanes, "cdtype": cdtype, **config}
    t0 = time.monotonic()
    rtl_runner.run("l2l_eps_lion", sources("l2l_eps_lion"), "tb_eps_lion",
                   parameters={"LANES": lanes, "CDTYPE": CODE[cdtype]},
                   env={"L2L_TB_CONFIG": json.dumps(config)}, testcase=list(tests))
    return time.monotonic() - t0


def run_lion_kernel(testcase, *, lanes: int, gdtype: str, cdtype: str, burst: int, block: int,
                    rd_fifo: int | None = None, wr_fifo: int | None = None, **env) -> None:
    params = dict(LANES=lanes, GDTYPE=CODE[gdtype], CDTYPE=CODE[cdtype], OPTIMIZER=1, BURST=burst, BLOCK=block,
                  RD_FIFO=rd_fifo or max(32, 4 * burst), WR_FIFO=wr_fifo or max(16, 2 * burst))
    env = {"L2L_GDTYPE": gdtype, "L2L_CDTYPE": cdtype, "L2L_KERNEL_BLOCK": str(block),
           **{k: str(v) for k, v in env.items()}}
    rtl_runner.run("l2l_eps_kernel", sources("l2l_eps_kernel"), "tb_eps_lion_kernel",
                   parameters=params, env=env, testcase=testcase)


def cases(*specs: dict) -> str:
    return json.dumps(list(specs))


# ---------------------------------------------------------------- the vector classes


def test_lion_vector_classes_do_what_they_say():
    import lion_vectors as lv
    from eps_oracle import Oracle

    rng = np.random.default_rng(3)
    n = 600
    for kind, ops in (("ties-products", ("p1", "b1m", "omb1g", "b2m", "omb2g")), ("ties-sums", ("c", "m'"))):
        c = lv.make_case(kind, rng, n, 1, "fp32")
        o = Oracle()
        g, _ = o.reduce(c.grad_bits, c.gdtype, c.s.inv_scale)
        o.lion(c.p.astype(np.float64), c.m.astype(np.float64), g, c.s)
        for op in ops:
            assert o.ties[op] >= n // 2, (kind, op, o.ties)
        if kind == "ties-sums":       # every element steps by +-1 onto a tie
            assert o.ties["p'+"] == o.ties["p'-"] == n, o.ties
    for gd in ("fp32", "bf16", "fp16"):
        for K in (1, 2):
            c = lv.make_case("czero", rng, n, K, gd)
            g, finite = c.reduced()
            assert finite
            with np.errstate(all="ignore"):
                cc = np.float32(c.s.b1) * c.m + np.float32(c.s.omb1) * g
            zero = cc == 0
            assert zero.sum() >= n // 4 and (zero & np.signbit(cc)).sum() >= 5 and (zero & ~np.signbit(cc)).sum() >= 5, \
                (gd, K, zero.sum())
            assert (~zero).sum() >= n // 8, (gd, K)
        for kind in lv.BUILDERS:
            if kind.startswith("nonfinite") and lv.applicable(kind, 2, gd):
                assert lv.make_case(kind, rng, 9, 2, gd).reduced()[1] is False, (kind, gd)


# ---------------------------------------------------------------- the datapath

DATAPATH = [
    # lanes, cdtype, ns (cycled over the classes)
    (1, "fp16", [1, 37, 16, 100]),
    (2, "fp32", [2 * 9 + 1, 1, 64, 33]),
    (4, "bf16", [4 * 5 + 3, 1, 9, 300]),
]


@needs_sim
@pytest.mark.parametrize("lanes,cdtype,ns", DATAPATH, ids=[f"L{a}-{b}" for a, b, _ in DATAPATH])
def test_lion_datapath(lanes, cdtype, ns):
    import lion_vectors as lv
    run_lion_datapath(lanes, cdtype, {"ns": ns, "kinds": lv.LION_KINDS, "Ks": [1, 2], "segs": [3, 1, 64],
                                      "seed": lanes * 10 + CODE[cdtype], "steps": 4, "throughput_beats": 96})


@needs_sim
@pytest.mark.slow
@pytest.mark.parametrize("cdtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("lanes", [1, 4, 16])
def test_lion_datapath_full(lanes, cdtype):
    import lion_vectors as lv
    run_lion_datapath(lanes, cdtype, {"ns": [1, lanes * 40 + 3, 257, lanes, 1000], "kinds": lv.LION_KINDS * 3,
                                      "Ks": [1, 2, 4], "segs": [1, 8, 64], "seed": 3000 + lanes * 10 + CODE[cdtype],
                                      "steps": 12, "multistep_n": lanes * 20 + 5, "throughput_beats": 256})


# ---------------------------------------------------------------- the kernel


@needs_sim
@pytest.mark.heavy
def test_lion_kernel_lanes4_bf16():
    """LANES = 4, bf16 gradients and copy, 8-beat bursts and blocks: n = 1, 3, 31, 33 (BURST x
    LANES +- 1), 301 (ten blocks, ends mid-beat and mid-burst), K = 1 and 2, gradients
    mid-beat, 3 steps on one state, c a zero, a NaN gradient (untouched) then a finite step;
    decay boundaries at 0, inside a beat, on the burst / block edge, n - 1 (just before the
    partial last beat), above n; n = 0 / k = 0 / k = 256; the steady-state rate of both passes at K = 1 (at K = 2
    blocks of 8 beats are shorter than the reducer's adder: its read-after-write stall, by
    design; tests/test_rtl_kernel.py measures K = 2 with 64-beat blocks)."""
    run_lion_kernel(["lion_cases", "lion_edge_args", "lion_throughput"], lanes=4, gdtype="bf16", cdtype="bf16",
                    burst=8, block=8, L2L_KERNEL_SEED=41, L2L_KERNEL_RATE_K="1", L2L_KERNEL_RATE_N=1024,
                    L2L_KERNEL_CASES=cases(
                        {"kind": "wide", "n": 1, "K": 1, "n_decay": 0},
                        {"kind": "czero", "n": 3, "K": 2, "gr_off": 1, "n_decay": 2},
                        {"kind": "train", "n": 31, "K": 1, "steps": 3, "n_decay": 13},
                        {"kind": "czero", "n": 33, "K": 2, "gr_off": 3, "n_decay": 32},
                        {"kind": "nonfinite-nan", "n": 9, "K": 2, "steps": 2, "then": "train", "n_decay": 4},
                        {"kind": "specials-subnormal-lr", "n": 32, "K": 1, "n_decay": 0xFFFF_FFFF},
                        {"kind": "train", "n": 301, "K": 2, "gr_off": 2, "n_decay": 300}))


@needs_sim
def test_lion_kernel_lanes1_fp32_grads():
    """LANES = 1, fp32 gradients, fp16 copy, 4-beat bursts, 8-beat blocks: K = 1 and 2 (and 4
    with short segments), the reduction's ties, an inf - inf and an overflowing sum; decay
    boundaries on a burst edge, a block edge and at n + 1."""
    run_lion_kernel("lion_cases", lanes=1, gdtype="fp32", cdtype="fp16", burst=4, block=8,
                    L2L_KERNEL_SEED=42, L2L_KERNEL_CASES=cases(
                        {"kind": "ties-reduction", "n": 5, "K": 4},
                        {"kind": "czero", "n": 9, "K": 1, "steps": 2, "n_decay": 4},      # burst edge
                        {"kind": "specials-zero-lr", "n": 7, "K": 1, "n_decay": 3},
                        {"kind": "train", "n": 17, "K": 2, "n_decay": 8},                 # block edge
                        {"kind": "wide", "n": 16, "K": 2, "n_decay": 17},                 # n + 1
                        {"kind": "nonfinite-inf-inf", "n": 3, "K": 2, "n_decay": 1},
                        {"kind": "nonfinite-sum-overflow", "n": 4, "K": 2}))


@needs_sim
def test_lion_kernel_lanes2_fp16_grads():
    """LANES = 2, fp16 gradients (loss-scaled), fp32 copy, 4-beat bursts and blocks: K = 1 and
    2, n = 2, 7, 8, 9, c a zero, an overflowing scaled gradient and a +inf one (flag 0)."""
    run_lion_kernel("lion_cases", lanes=2, gdtype="fp16", cdtype="fp32", burst=4, block=4,
                    L2L_KERNEL_SEED=43, L2L_KERNEL_CASES=cases(
                        {"kind": "train", "n": 2, "K": 1, "n_decay": 1},
                        {"kind": "wide", "n": 7, "K": 2, "gr_off": 1, "n_decay": 7},
                        {"kind": "czero", "n": 8, "K": 2, "steps": 2, "n_decay": 5},
                        {"kind": "specials-big-lr", "n": 9, "K": 1, "n_decay": 8},
                        {"kind": "nonfinite-scale-overflow", "n": 6, "K": 2, "n_decay": 0},
                        {"kind": "nonfinite-+inf", "n": 5, "K": 1, "then": "train", "steps": 2}))


# ---------------------------------------------------------------- a recorded training run


def test_recorded_lion_trace_is_what_the_numpy_eps_did(tmp_path):
    """The recorder on a Lion run: state (p, m) and LionScalars recorded, each update's outputs
    the golden model's lion_update of its inputs, each layer's next input its last output, the
    file round-trips with its optimizer named."""
    import eps_trace
    from l2l.eps.contract import LionScalars
    from l2l.eps.numerics import lion_update, reduce_gradients

    path = tmp_path / "lion.npz"
    rec = eps_trace.record(path, precision="bf16", contributors=2, steps=2, d_model=2, seq_len=4,
                           decay_split={1: 37}, optimizer="lion")
    back = eps_trace.load(path)
    assert back.optimizer == rec.optimizer == "lion" and len(back.updates) == 6
    last = {}
    for u, r in zip(back.updates, rec.updates):
        assert isinstance(u.scalars, LionScalars) and u.scalars == r.scalars
        assert u.v is None and u.v_out is None and r.v is None
        assert np.array_equal(u.grads.view(np.uint16), r.grads.view(np.uint16)) and u.n_decay == r.n_decay
        if u.layer in last:
            assert np.array_equal(u.p.view(np.uint32), last[u.layer][0].view(np.uint32))
            assert np.array_equal(u.m.view(np.uint32), last[u.layer][1].view(np.uint32))
        g = np.empty(u.p.shape[0], np.float32)
        assert reduce_gradients(u.grads, u.scalars.inv_scale, g) == u.finite
        p, m, c = u.p.copy(), u.m.copy(), np.empty_like(u.copy_out)
        lion_update(p, m, g, u.scalars, copy_out=c, n_decay=u.n_decay)
        for got, want in ((p, u.p_out), (m, u.m_out), (c, u.copy_out)):
            w = {2: np.uint16, 4: np.uint32}[got.dtype.itemsize]
            assert np.array_equal(got.view(w), want.view(w))
        last[u.layer] = (u.p_out, u.m_out)
    assert {u.n_decay for u in back.updates if u.layer == 1} == {37}


@needs_sim
@pytest.mark.heavy
def test_lion_trace_replay_bf16_two_workers_with_skip(tmp_path):
    """A Lion run: bf16 gradients and copy, two data-parallel workers (K = 2), 3 steps of a
    d_model = 2 GPT (embedding 520, block 74, head 516 elements; at LANES = 4 the block ends
    mid-beat and its contribution 1 starts mid-beat), the block's second update poisoned
    (skipped, flag 0), the block decaying its first 37 elements and the head its first 512;
    every update through the Lion kernel bit for bit, the skip included."""
    import eps_trace

    poison = eps_trace.Poison(step=1, layer=1, contributor=1, index=37)
    path, report = tmp_path / "lion.npz", tmp_path / "replay.json"
    trace = eps_trace.record(path, precision="bf16", contributors=2, steps=3, d_model=2, seq_len=4,
                             poison=poison, decay_split={1: 37, 2: 512}, optimizer="lion")
    assert trace.optimizer == "lion" and len(trace.updates) == 9
    block = [i for i, u in enumerate(trace.updates) if u.layer == 1]
    assert [i for i, u in enumerate(trace.updates) if not u.finite] == [block[1]]
    run_lion_kernel("lion_trace_replay", lanes=4, gdtype="bf16", cdtype="bf16", burst=8, block=8,
                    L2L_TRACE=path, L2L_KERNEL_SEED=5, L2L_KERNEL_PAUSE=0.1, L2L_KERNEL_REPORT=report)
    replayed = json.loads(report.read_text())
    assert [(r["layer"], r["finite"], r["n_decay"]) for r in replayed["updates"]] == \
        [(u.layer, u.finite, u.n_decay) for u in trace.updates], "the kernel did not replay the whole trace"
    assert [r for r in replayed["updates"] if not r["finite"]] == \
        [{"layer": 1, "n": 74, "K": 2, "n_decay": 37, "finite": False, "copy_checked": True}]
    # the moments moved: Lion's m' is not zero after a finite step
    assert all(np.any(u.m_out != 0) for u in trace.updates if u.finite)


# ---------------------------------------------------------------- the register map, kernel_lion.xml, lint


def _lion_map() -> dict[str, int]:
    from tb_eps_lion_kernel import lion_register_map
    return lion_register_map()


def test_lion_register_map_is_adamws_shape():
    """Buffers, n, k and n_decay where AdamW has them (v's word 0x28 left out), Lion's scalars
    in LionScalars order from 0x4C, 4 bytes apart, all before the status register (0x70)."""
    from l2l.eps.contract import LionScalars
    from tb_eps_kernel import register_map

    regs, adamw = _lion_map(), register_map()
    assert list(regs) == ["gr", "p", "m", "copy", "finite", "n", "k", "n_decay", *LionScalars.names()]
    assert {k: v for k, v in regs.items() if k in adamw and k not in LionScalars.names()} == \
        {k: adamw[k] for k in ("gr", "p", "m", "copy", "finite", "n", "k", "n_decay")}
    assert [regs[s] for s in LionScalars.names()] == [0x4C + 4 * i for i in range(7)]
    assert max(regs.values()) < 0x70 and adamw["v"] == 0x28 and 0x28 not in regs.values()


def test_args_md_documents_the_lion_register_map():
    regs = _lion_map()
    text = (ROOT / "fpga" / "ARGS.md").read_text()
    section = text[text.index("## RTL kernel"):]
    section = section[section.index("### Lion"):]
    section = section[:section.index("\n### ", 1)]      # Lion's, before LAMB's
    rows = dict(re.findall(r"^\| (0x[0-9A-Fa-f]+) \| `(\w+)` \|", section, re.M))
    documented = {name: int(off, 16) for off, name in rows.items()}
    names = list(regs)
    first_scalar = names.index("decay")
    assert documented == {k: regs[k] for k in names[:first_scalar]}
    scalars = re.search(r"\| (0x[0-9A-Fa-f]+) \.\. (0x[0-9A-Fa-f]+) \| `([\w, ]+)` \|", section)
    listed = [s.strip() for s in scalars.group(3).split(",")]
    assert listed == names[first_scalar:]
    assert int(scalars.group(1), 16) == regs[listed[0]] and int(scalars.group(2), 16) == regs[listed[-1]]


def test_kernel_lion_xml_matches_the_rtl():
    """fpga/rtl/kernel_lion.xml: eps_lion_f32_f32 at the module's default LANES with
    OPTIMIZER = 1: Lion's arguments in order at the Lion map's offsets, each on a port the RTL
    has, no m_axi_v, the data widths of the default parameters."""
    import xml.etree.ElementTree as ET

    src = (ROOT / "fpga" / "rtl" / "l2l_eps_kernel.v").read_text()
    default = {k: int(v) for k, v in re.findall(r"parameter\s+(\w+)\s*=\s*(\d+)\s*[,)]", src)}
    lanes = default["LANES"]
    kernel = ET.parse(ROOT / "fpga" / "rtl" / "kernel_lion.xml").getroot().find("kernel")
    assert kernel.get("name") == "eps_lion_f32_f32"
    assert kernel.get("hwControlProtocol") == "ap_ctrl_hs" and kernel.get("interrupt") == "true"
    ports = {p.get("name"): p for p in kernel.find("ports")}
    for name in ports:
        assert re.search(rf"\b{name}_(awvalid|arvalid)\b", src), f"{name}: no such AXI port in the RTL"
    assert int(ports["s_axi_control"].get("range"), 16) == 2 ** default["C_S_AXI_CONTROL_ADDR_WIDTH"]
    assert {k: int(p.get("dataWidth")) for k, p in ports.items() if k != "s_axi_control"} == \
        {"m_axi_gr": 32 * lanes, "m_axi_p": 32 * lanes, "m_axi_m": 32 * lanes, "m_axi_copy": 32 * lanes}
    regs = _lion_map()
    args = list(kernel.find("args"))
    assert [a.get("name") for a in args] == list(regs)
    assert [int(a.get("id")) for a in args] == list(range(len(regs)))
    buffers = ["gr", "p", "m", "copy", "finite"]
    on_port = {"gr": "m_axi_gr", "p": "m_axi_p", "m": "m_axi_m", "copy": "m_axi_copy", "finite": "m_axi_p"}
    for a in args:
        name = a.get("name")
        assert int(a.get("offset"), 16) == regs[name], name
        assert int(a.get("size"), 16) == (8 if name in buffers else 4), name
        assert a.get("addressQualifier") == ("1" if name in buffers else "0"), name
        assert a.get("port") == on_port.get(name, "s_axi_control"), name


LION_CORNERS = [
    {"OPTIMIZER": 1},
    {"OPTIMIZER": 1, "LANES": 4, "GDTYPE": 1, "CDTYPE": 1, "BURST": 8, "BLOCK": 8, "RD_FIFO": 32, "WR_FIFO": 16},
    {"OPTIMIZER": 1, "LANES": 1, "GDTYPE": 0, "CDTYPE": 2, "BURST": 1, "BLOCK": 1, "RD_FIFO": 2, "WR_FIFO": 2,
     "C_S_AXI_CONTROL_ADDR_WIDTH": 7},
    {"OPTIMIZER": 1, "LANES": 2, "GDTYPE": 2, "CDTYPE": 0, "BURST": 4, "BLOCK": 4, "RD_FIFO": 32, "WR_FIFO": 16},
]


@pytest.mark.parametrize("params", LION_CORNERS, ids=lambda p: "-".join(f"{k}{v}" for k, v in p.items()))
@pytest.mark.heavy
def test_lion_kernel_lint(params):
    """verilator --lint-only -Wall on the Lion kernel (tests/test_rtl_lint.py's check: no
    warning, waivers in place only) at the default shape, the shapes simulated here and the
    smallest."""
    from test_rtl_lint import KERNEL, RTL, _check
    _check(KERNEL, RTL / f"{KERNEL}.v", params)
