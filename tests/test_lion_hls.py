"""Lion in the HLS C++ EPS (hls/eps_kernels.cpp, ``eps_lion_<g>_<c>``, C-simulated by
``--eps hls-csim``) against the NumPy golden model, bit for bit (NaN == NaN): p, m, the
finite flag and the device copy, on the vector classes of docs/eps-numerics.md
("What the tests must cover") that Lion's datapath can tell apart, directly, through the
EagerParamServer and from the command line. Also what only the Lion kernels add: their
interface (the documented argument order, eps.cl's once it has them), their links in
hls/u280.cfg and hls/u50.cfg and the Makefile's kernel lists.

The AdamW kernels' suite is tests/test_eps_backends_bitexact.py (eps_twin.Twin is
AdamW-shaped: three state arrays); the directives of every kernel, these included, are
checked by tests/test_hls_pragmas.py.
"""
from __future__ import annotations

import itertools
import re
import shutil
import subprocess
import zlib

import numpy as np
import pytest

from l2l.checkpoint import load_latest
from l2l.eps import EagerParamServer, HlsCsimBackend, LionScalars, NumpyBackend, OptimizerHyper, StepScalars
from l2l.eps import hls_csim_backend as hcb
from l2l.eps.contract import step_scalars
from l2l.eps.numerics import GRAD_DTYPES
from l2l.metrics import read_metrics

from conftest import ROOT, run_cli
from eps_oracle import bits_of, grad_array, nonfinite_cases, nonfinite_grads, wide_f32, wide_grad_bits
from eps_twin import DTYPES, HLS_BLOCK, HLS_TILE, assert_same, new_layer, sentinel

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

# beta1 = 0.75 makes b1 = 0.75f and omb1 = 0.25f exactly, so b1*m + omb1*g cancels to +0 exactly
# for m = k, g = -3k (k of a few bits: both products exact); weight decay 0.1 so p1 != p
CANCEL_HYPER = OptimizerHyper(lr=1e-2, beta1=0.75, beta2=0.99, weight_decay=0.1, optimizer="lion")
HYPERS = [CANCEL_HYPER, OptimizerHyper(optimizer="lion"),
          OptimizerHyper(lr=3e-4, beta1=0.95, beta2=0.98, weight_decay=1.0, optimizer="lion")]


@pytest.fixture(scope="module")
def hls():
    return HlsCsimBackend()


def lion_scalars(hyper=CANCEL_HYPER, **kw) -> LionScalars:
    return step_scalars(hyper, 1, **kw)


def with_inv_scale(s: LionScalars, inv_scale) -> LionScalars:
    return LionScalars(**{**dict(zip(s.names(), s.as_tuple())), "inv_scale": np.float32(inv_scale)})


class LionTwin:
    """One Lion layer, ``(p, m)``, in a one-thread NumpyBackend and in the HLS backend, stepped
    in lockstep; every step compares p, m, the flag and the copy bit for bit."""

    def __init__(self, dut, p, m=None):
        self.ref, self.dut, self.layer, self.n = NumpyBackend(threads=1), dut, new_layer(), p.shape[0]
        for be in (self.ref, self.dut):
            be.allocate(self.layer, p, moments=1)
            if m is not None:
                be.write_state(self.layer, p, m)
        self.check_state("after allocate/write_state")

    def check_state(self, what, inputs=None):
        ref, got = self.ref.read_state(self.layer), self.dut.read_state(self.layer)
        assert len(ref) == len(got) == 2
        for name, r, g in zip("pm", ref, got):
            assert_same(g, r, f"{what}: {name}", inputs)
        return ref

    def step(self, grads, s: LionScalars, cdtype: str, what: str, expect_finite=None, n_decay=None) -> bool:
        p, m = self.ref.read_state(self.layer)
        inputs = lambda: {"p": p, "m": m, **{f"g{k}": g for k, g in enumerate(grads)},  # noqa: E731
                          **{k: float(v) for k, v in zip(s.names(), s.as_tuple())}, "n_decay": n_decay}
        kw = {} if n_decay is None else {"n_decay": n_decay}
        c_ref, c_dut = sentinel(self.n, cdtype), sentinel(self.n, cdtype)
        f_ref = self.ref.step(self.layer, list(grads), s, c_ref, **kw)
        f_dut = self.dut.step(self.layer, list(grads), s, c_dut, **kw)
        assert f_dut is f_ref, f"{what}: finite flag hls {f_dut} vs NumPy {f_ref}"
        if expect_finite is not None:
            assert f_ref is expect_finite, f"{what}: vectors meant to give finite={expect_finite}"
        self.check_state(what, inputs)
        assert_same(c_dut, c_ref, f"{what}: device copy {cdtype}", inputs)
        if not f_ref:
            assert_same(c_dut, sentinel(self.n, cdtype), f"{what}: copy written on a non-finite step")
            assert_same(self.dut.read_state(self.layer)[0], p, f"{what}: p written on a non-finite step")
            assert_same(self.dut.read_state(self.layer)[1], m, f"{what}: m written on a non-finite step")
        return f_ref


def _zero(rng, n):
    return np.where(rng.random(n) < 0.5, np.float32(-0.0), np.float32(0.0)).astype(np.float32)


def _cancelling(rng, q, gdtype):
    """(m, g) with b1*m + omb1*g == +0 exactly under CANCEL_HYPER: m = k, g = -3k, k = (1..31) *
    2**e with 3k exact in ``gdtype`` (subnormal binary16 and small bfloat16 values included)."""
    lo, hi = {"fp32": (-140, 100), "bf16": (-125, 100), "fp16": (-24, 6)}[gdtype]
    k = rng.integers(1, 32, q) * np.exp2(rng.integers(lo, hi, q).astype(np.float64))
    k *= np.where(rng.random(q) < 0.5, -1.0, 1.0)
    g = (-3.0 * k).astype(GRAD_DTYPES[gdtype])
    assert np.array_equal(g.astype(np.float64), -3.0 * k)  # exact in the gradient's dtype
    return k.astype(np.float32), g


def _vectors(rng, n, K, gdtype):
    """Wide p and m over every binade (subnormals, zeros of both signs); K wide gradient
    contributions; a quarter of the elements with m = +-0 and every contribution +-0 (c is a
    zero of either sign), a quarter with b1*m and omb1*g cancelling exactly (c = +0)."""
    p, m = wide_f32(rng, n), wide_f32(rng, n)
    grads = [grad_array(wide_grad_bits(rng, n, gdtype, max_abs=1e37), gdtype) for _ in range(K)]
    q = n // 4
    zeros = rng.permutation(n)[:2 * q]
    z, cancel = zeros[:q], zeros[q:]
    m[z] = _zero(rng, q)
    for g in grads:
        g[z] = _zero(rng, q).astype(g.dtype)
    m[cancel], g0 = _cancelling(rng, q, gdtype)
    grads[0][cancel] = g0
    for g in grads[1:]:
        g[cancel] = _zero(rng, q).astype(g.dtype)  # x + (+-0) is x: the sum stays -3k
    return p, m, grads


# --------------------------------------------------------------------------
# the kernels against the golden model
# --------------------------------------------------------------------------


@pytest.mark.parametrize("K", [1, 2, 3])
@pytest.mark.parametrize("gdtype, cdtype", list(itertools.product(DTYPES, DTYPES)))
def test_wide_values_every_dtype_pair(hls, gdtype, cdtype, K):
    """Three steps on one layer (state carried over): inv_scale 1 (the exact zeros of c),
    then 1/K and a loss scale, and other hyper-parameters."""
    rng = np.random.default_rng([811, DTYPES.index(gdtype), DTYPES.index(cdtype), K])
    n = 2 * HLS_TILE + 77
    p, m, grads = _vectors(rng, n, K, gdtype)
    tw = LionTwin(hls, p, m)
    s = lion_scalars()
    assert (s.b1, s.omb1, s.inv_scale) == (np.float32(0.75), np.float32(0.25), np.float32(1))
    # the construction does give c = +-0 where meant, and as many as meant
    c = np.float32(s.b1) * m + np.float32(s.omb1) * sum(g.astype(np.float32) for g in grads)
    assert np.count_nonzero(c == 0) >= n // 2
    tw.step(grads, s, cdtype, f"{gdtype}->{cdtype} K={K} step 1", expect_finite=True, n_decay=n - 3)
    for t, hyper in ((2, HYPERS[1]), (3, HYPERS[2])):
        grads = [grad_array(wide_grad_bits(rng, n, gdtype, max_abs=1e37), gdtype) for _ in range(K)]
        s = step_scalars(hyper, t, loss_scale=1024.0 if gdtype == "fp16" else 1.0, divisor=float(K))
        tw.step(grads, s, cdtype, f"{gdtype}->{cdtype} K={K} step {t}", expect_finite=True)


@pytest.mark.parametrize("n", [1, 7, 8, 9, HLS_TILE - 1, HLS_TILE, HLS_TILE + 1, 2 * HLS_TILE + 1, 3001,
                               HLS_BLOCK - 1, HLS_BLOCK, HLS_BLOCK + 1])
def test_layer_sizes_around_tiles_and_blocks(hls, n):
    rng = np.random.default_rng([812, n])
    p, m, grads = _vectors(rng, n, 2, "bf16")
    tw = LionTwin(hls, p, m)
    tw.step(grads, lion_scalars(divisor=2.0), "bf16", f"n={n}", expect_finite=True)


def _decay_boundaries(n):
    edges = {0, 1, n - 1, n}
    for e in (HLS_TILE, 2 * HLS_TILE, HLS_BLOCK, HLS_BLOCK + HLS_TILE):
        edges |= {e - 1, e, e + 1}
    return sorted(b for b in edges if 0 <= b <= n)


@pytest.mark.parametrize("n_decay", _decay_boundaries(HLS_BLOCK + 3005))
def test_decay_boundary(hls, n_decay):
    """n_decay at 0, 1, n - 1, n and around the tile and block edges of a layer of one block
    and part of the next (the boundary is cut per block, as for AdamW). Decayed elements
    differ from the others wherever p1 = p * decay is not p: the test would see it moved."""
    n = HLS_BLOCK + 3005
    rng = np.random.default_rng([813, n_decay])
    p, m, grads = _vectors(rng, n, 2, "fp32")
    tw = LionTwin(hls, p, m)
    tw.step(grads, lion_scalars(hyper=HYPERS[2]), "fp16", f"n_decay={n_decay}", expect_finite=True,
            n_decay=n_decay)


def test_signed_zero_c_keeps_p1_and_its_sign(hls):
    """Every sign of m = 0 and g = 0 (c = +-0), on p of both signs of zero, subnormal and
    normal, decayed or not: p' is p1 exactly, sign of zero included -- checked against the
    contract's statement as well as against NumPy."""
    p_vals = np.array([0.0, -0.0, 1e-45, -1e-45, 1.5, -1.5, 3e38, -3e38], np.float32)
    rows = list(itertools.product(p_vals, [0.0, -0.0], [0.0, -0.0]))
    p = np.array([r[0] for r in rows], np.float32)
    m = np.array([r[1] for r in rows], np.float32)
    n = p.shape[0]
    s = lion_scalars()
    for gdtype, n_decay in (("fp32", n), ("bf16", 0), ("fp16", n // 2)):
        g = np.array([r[2] for r in rows], np.float32).astype(GRAD_DTYPES[gdtype])
        tw = LionTwin(hls, p, m)
        tw.step([g], s, "fp32", f"c = +-0, {gdtype}, n_decay={n_decay}", expect_finite=True, n_decay=n_decay)
        got = tw.dut.read_state(tw.layer)[0]
        p1 = np.where(np.arange(n) < n_decay, p * np.float32(s.decay), p).astype(np.float32)
        assert np.array_equal(bits_of(got), bits_of(p1)), "a zero c must leave p1, its sign of zero included"


def test_nonfinite_state_follows_the_golden_model(hls):
    """State the host loaded holding inf and NaN (a checkpoint's bits): an inf m gives an
    infinite c, a NaN m a NaN c, whose p' is NaN in the golden model (p1 + sign(NaN) * neg_lr);
    beta1 = 0 makes 0 * inf a NaN too."""
    rng = np.random.default_rng(814)
    n = HLS_TILE + 9
    p, m, grads = _vectors(rng, n, 1, "fp32")
    special = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0], np.float32)
    p[::3] = rng.choice(special, p[::3].shape[0])
    m[1::3] = rng.choice(special, m[1::3].shape[0])
    for hyper in (CANCEL_HYPER, OptimizerHyper(beta1=0.0, optimizer="lion")):
        tw = LionTwin(hls, p, m)
        tw.step(grads, step_scalars(hyper, 1), "bf16", f"inf/NaN state, beta1={hyper.beta1}", expect_finite=True)


@pytest.mark.parametrize("case, K, gdtype", list(nonfinite_cases()))
def test_nonfinite_gradient_changes_nothing(hls, case, K, gdtype):
    """Flag false, p, m and the copy untouched, wherever the bad element is: the first element,
    inside the second tile, the last element of a partial tile."""
    rng = np.random.default_rng([815, K, DTYPES.index(gdtype), zlib.crc32(case.encode())])
    n = 2 * HLS_TILE + 43
    p, m = wide_f32(rng, n), wide_f32(rng, n)
    tw = LionTwin(hls, p, m)
    for i in (0, HLS_TILE + 3, n - 1):
        grad_bits, adamw = nonfinite_grads(rng, n, case, K, gdtype, i)
        s = with_inv_scale(lion_scalars(), adamw.inv_scale)
        tw.step([grad_array(b, gdtype) for b in grad_bits], s, "bf16", f"{case} K={K} {gdtype} at {i}",
                expect_finite=False)


def test_long_run_stays_bit_identical(hls):
    """Many steps on one state: a one-ulp difference in p or m would grow and show."""
    rng = np.random.default_rng(816)
    n = HLS_TILE + 300
    tw = LionTwin(hls, (rng.standard_normal(n) * 0.05).astype(np.float32))
    hyper = OptimizerHyper(lr=3e-3, beta1=0.9, beta2=0.99, weight_decay=0.1, optimizer="lion")
    for t in range(1, 41):
        grads = [(rng.standard_normal(n) * 10.0 ** rng.uniform(-4, 0)).astype(np.float32) for _ in range(2)]
        tw.step(grads, step_scalars(hyper, t, divisor=2.0), "bf16", f"step {t}", expect_finite=True,
                n_decay=n - 100)


def test_optimizers_and_state_shape(hls):
    """hls-csim says it runs AdamW and Lion (and LAMB: tests/test_lamb_hls.py); a step of one on
    the other's state is refused before any kernel runs."""
    assert {"adamw", "lion"} <= HlsCsimBackend.optimizers
    n = 100
    p = np.ones(n, np.float32)
    adamw_layer, lion_layer = new_layer(), new_layer()
    hls.allocate(adamw_layer, p)
    hls.allocate(lion_layer, p, moments=1)
    g = [np.ones(n, np.float32)]
    with pytest.raises(ValueError, match="lion step on a layer with 2 moments"):
        hls.step(adamw_layer, g, lion_scalars(), np.empty(n, np.float32))
    with pytest.raises(ValueError, match="adamw step on a layer with 1 moments"):
        hls.step(lion_layer, g, StepScalars.compute(OptimizerHyper(), 1), np.empty(n, np.float32))
    for layer, moments in ((adamw_layer, 2), (lion_layer, 1)):
        state = hls.read_state(layer)
        assert len(state) == 1 + moments and all(np.array_equal(a, p if i == 0 else 0 * p)
                                                 for i, a in enumerate(state))


# --------------------------------------------------------------------------
# the kernels called directly
# --------------------------------------------------------------------------


def _call_lion(hls, g, c, gr, state, copy, flag, n, k, n_decay, s):
    getattr(hls.lib, f"eps_lion_{g}_{c}")(gr.ctypes.data, *(a.ctypes.data for a in state), copy.ctypes.data,
                                          flag.ctypes.data, n, k, n_decay, *s.as_tuple())


def test_lion_kernel_writes_nothing_when_flag_clear(hls):
    rng = np.random.default_rng(817)
    n = HLS_TILE + 5
    for g, c in itertools.product(DTYPES, DTYPES):
        gr = grad_array(wide_grad_bits(rng, 2 * n, g), g)
        state = [wide_f32(rng, n) for _ in range(2)]
        before = [a.copy() for a in state]
        copy = sentinel(n, c)
        _call_lion(hls, hcb.GRAD_SUFFIX[gr.dtype], hcb.SUFFIX[copy.dtype], gr, state, copy, np.zeros(1, np.int32),
                   n, 2, n, lion_scalars())
        for a, b in zip(state, before):
            assert_same(a, b, f"{g}->{c}: state written with the flag clear")
        assert_same(copy, sentinel(n, c), f"{g}->{c}: copy written with the flag clear")


def test_lion_kernel_decay_boundary_past_n_acts_as_n(hls):
    rng = np.random.default_rng(818)
    n = HLS_BLOCK + 5
    gr = grad_array(wide_grad_bits(rng, n, "fp32"), "fp32")
    start = [wide_f32(rng, n) for _ in range(2)]
    out = []
    for n_decay in (n, n + 1, HLS_BLOCK * 2, (1 << 32) - 1):
        state, copy = [a.copy() for a in start], sentinel(n, "bf16")
        _call_lion(hls, "f32", "bf16", gr, state, copy, np.ones(1, np.int32), n, 1, n_decay, lion_scalars())
        out.append((n_decay, state, copy))
    for n_decay, state, copy in out[1:]:
        for a, b, name in zip(state, out[0][1], "pm"):
            assert_same(a, b, f"n_decay={n_decay}: {name}")
        assert_same(copy, out[0][2], f"n_decay={n_decay}: copy")


# --------------------------------------------------------------------------
# through the eager param-server
# --------------------------------------------------------------------------


@pytest.mark.parametrize("grad_dtype, contributors", [("fp32", 1), ("bf16", 2)])
def test_server_matches_numpy(grad_dtype, contributors):
    """EagerParamServer(..., OptimizerHyper(optimizer="lion")) with bf16 copies: several layers
    with decay boundaries, one non-finite step on one layer, a checkpoint loaded into both,
    more steps: copies, step counts, history and state agree."""
    rng = np.random.default_rng([819, contributors])
    hyper = OptimizerHyper(lr=1e-2, beta1=0.9, beta2=0.99, weight_decay=0.05, optimizer="lion")
    sizes, decays = [1, 257, HLS_TILE + 3, 40], [1, 200, HLS_TILE - 1, 0]
    layers = [new_layer() for _ in sizes]
    kw = {"copy_dtype": "bf16", "grad_dtype": grad_dtype, "contributors": contributors}
    ref = EagerParamServer(NumpyBackend(threads=1), hyper, **kw)
    got = EagerParamServer(HlsCsimBackend(), hyper, **kw)

    def agree(what):
        ref.synchronize()
        got.synchronize()
        for layer in layers:
            assert got.step_count(layer) == ref.step_count(layer), (what, layer)
            assert_same(got.fetch(layer), ref.fetch(layer), f"{what}: layer {layer} device copy")
        tr, tg = ref.state_tensors(), got.state_tensors()
        assert tr.keys() == tg.keys() and not any(k.endswith(".v") for k in tr), sorted(tr)
        for k in tr:
            assert_same(tg[k], tr[k], f"{what}: {k}")
        assert got.state_meta() == ref.state_meta()

    def one_step(step, bad_layer=None):
        for layer, n in zip(layers, sizes):
            for k in range(contributors):
                g = (rng.standard_normal(n) * 10.0 ** rng.uniform(-5, 0)).astype(GRAD_DTYPES[grad_dtype])
                if layer == bad_layer and k == contributors - 1:
                    g[n // 2] = np.nan
                for srv in (ref, got):
                    srv.gradient_inbox(layer, k)[:] = g
            for srv in (ref, got):
                for k in range(contributors):
                    srv.push_gradient(layer, k, divisor=float(contributors), loss_scale=1.0)
        agree(f"step {step}")

    try:
        for layer, n, d in zip(layers, sizes, decays):
            p = wide_f32(rng, n) if n < 100 else (rng.standard_normal(n) * 0.05).astype(np.float32)
            ref.add_layer(layer, p, n_decay=d)
            got.add_layer(layer, p, n_decay=d)
        agree("after add_layer")
        for step in range(1, 7):
            one_step(step, bad_layer=layers[2] if step == 3 else None)
        assert got.step_count(layers[2]) == 5 and got.step_count(layers[0]) == 6
        assert got.history == ref.history
        tensors = {}
        meta = {"optimizer": "lion", "steps": {}, "n_decay": {str(lay): d for lay, d in zip(layers, decays)}}
        for layer, n in zip(layers, sizes):
            tensors[f"layer{layer}.p"], tensors[f"layer{layer}.m"] = wide_f32(rng, n), wide_f32(rng, n)
            meta["steps"][str(layer)] = int(rng.integers(1, 100))
        for srv in (ref, got):
            srv.load_state(tensors, meta)
        agree("after load_state")
        for step in range(7, 10):
            one_step(step)
        assert got.history == ref.history
    finally:
        ref.close()
        got.close()


# --------------------------------------------------------------------------
# from the command line
# --------------------------------------------------------------------------

TINY = ["--layers", "2", "--d-model", "32", "--heads", "2", "--seq-len", "32", "--batch-size", "8",
        "--micro-batches", "2", "--eval-batches", "1", "--no-progress", "--eval-every", "0", "--steps", "4",
        "--optimizer", "lion", "--lr", "3e-3"]


@pytest.mark.heavy
def test_cli_hls_csim_lion_run_is_the_numpy_run(tmp_path):
    """``l2l train --eps hls-csim --optimizer lion`` is ``--eps numpy --optimizer lion`` bit for
    bit: every loss and the final checkpoint's tensors (p and m; no v)."""
    runs = {}
    for eps in ("numpy", "hls-csim"):
        out = tmp_path / eps
        r = run_cli("train", *TINY, "--eps", eps, "--out", str(out))
        assert r.returncode == 0, r.stderr
        runs[eps] = out
    losses = {eps: [x["loss"] for x in read_metrics(out / "metrics.jsonl")] for eps, out in runs.items()}
    assert len(losses["numpy"]) == 4 and losses["hls-csim"] == losses["numpy"], losses
    want, got = load_latest(runs["numpy"]).tensors, load_latest(runs["hls-csim"]).tensors
    assert want.keys() == got.keys()
    assert any(k.endswith(".m") for k in want) and not any(k.endswith(".v") for k in want), sorted(want)
    for k in want:
        assert want[k].dtype == got[k].dtype and np.array_equal(want[k].view(np.uint8), got[k].view(np.uint8)), k


# --------------------------------------------------------------------------
# the interface: argument order, the OpenCL twin, the links and the Makefile
# --------------------------------------------------------------------------

LION_ARGS = ["gr", "p", "m", "copy", "finite", "n", "k", "n_decay", *LionScalars.names()]
CL_SOURCE = ROOT / "fpga" / "opencl" / "eps.cl"


def _params(signature: str) -> list[str]:
    return [re.sub(r"[\s\\]+", " ", p).strip().split(" ")[-1].lstrip("*") for p in signature.split(",")]


def _hls_params(macro: str) -> tuple[list[str], list[str], str]:
    """(parameter names, pointer parameter names, body) of an EPS_* macro's top function."""
    src = hcb.kernel_source()
    found = re.search(rf'#define {macro}\([\w, ]+\)\s*\\?\s*extern "C" void [\w#]+\((.*?)\)\s*\{{(.*?)\n\n',
                      src, re.S)
    assert found, macro
    params = found.group(1).split(",")
    return _params(found.group(1)), [_params(p)[0] for p in params if "*" in p], found.group(2)


def test_lion_kernels_take_the_documented_order():
    """Buffers gr, p, m, copy, finite; n, k, n_decay; the Lion scalars in LionScalars order;
    one m_axi bundle per buffer, numbered by position as in the other top functions; every
    scalar on the s_axilite slave; a top function per (g, c) pair."""
    names, pointers, body = _hls_params("EPS_LION")
    assert names == LION_ARGS
    assert LionScalars.names() == ("decay", "b1", "omb1", "b2", "omb2", "neg_lr", "inv_scale")
    maxi = re.findall(r"EPS_MAXI\((\w+), (\w+)\)", body)
    assert maxi == [(port, f"gmem{i}") for i, port in enumerate(pointers)]
    assert re.findall(r"EPS_LITE\((\w+)\)", body) == [n for n in names if n not in pointers] + ["return"]
    assert {f"eps_lion_{g}_{c}" for g in hcb.KINDS for c in hcb.KINDS} <= set(hcb.KERNEL_NAMES)


def test_lion_parameters_match_the_opencl_kernels():
    """The same parameter names and order as eps.cl's EPS_LION."""
    src = CL_SOURCE.read_text()
    found = re.search(r"#define EPS_LION\([\w, ]+\)(.*?)\{", src, re.S)
    assert found is not None, "fpga/opencl/eps.cl defines no EPS_LION"
    body = found.group(1)
    assert _params(body[body.index("(") + 1:body.rindex(")")]) == _hls_params("EPS_LION")[0]


# each argument role's bank in u280.cfg and u50.cfg (their header's table): g and gr are the gradients;
# LAMB's segment bounds, sums and step sizes share the flag's
BANKS = {"g": 0, "gr": 0, "p": 1, "m": 2, "v": 3, "copy": 4, "finite": 5, "seg": 5, "sums": 5, "steps": 5}
FAMILIES = {"eps_check": "EPS_CHECK", "eps_update": "EPS_UPDATE", "eps_lion": "EPS_LION",
            "eps_lamb_norms": "EPS_LAMB_NORMS", "eps_lamb_step": "EPS_LAMB_STEP", "eps_copy": "EPS_COPY"}


@pytest.mark.parametrize("card", ["u280", "u50"])
def test_link_config_connects_every_kernel(card):
    """One compute unit per kernel and an sp= line for exactly its pointer arguments, each in
    its role's bank: the Lion kernels' as AdamW's, so the host's shared buffers line up."""
    text = (ROOT / "hls" / f"{card}.cfg").read_text()
    nk = re.findall(r"(?m)^nk=(\w+):1:(\w+)$", text)
    assert sorted(nk) == sorted((k, f"{k}_1") for k in hcb.KERNEL_NAMES)
    sp = re.findall(r"(?m)^sp=(\w+)_1\.(\w+):HBM\[(\d+)\]$", text)
    want = set()
    for kernel in hcb.KERNEL_NAMES:
        family = hcb.kernel_family(kernel)
        want |= {(kernel, port, str(BANKS[port])) for port in _hls_params(FAMILIES[family])[1]}
    assert len(sp) == len(set(sp)) and set(sp) == want


@pytest.mark.skipif(shutil.which("make") is None or shutil.which("awk") is None, reason="needs make and awk")
@pytest.mark.parametrize("kernels, expect", [
    ("lion", ["eps_check_f32", "eps_lion_f32_f32", "eps_lion_f32_bf16", "eps_copy_f32", "eps_copy_bf16"]),
    ("all", hcb.KERNEL_NAMES),
    ("", ["eps_check_f32", "eps_update_f32_f32", "eps_update_f32_bf16", "eps_copy_f32", "eps_copy_bf16"]),
])
def test_makefile_link_config(tmp_path, kernels, expect):
    """The Makefile's KERNELS (the default, KERNELS=lion, KERNELS=all) and the link config it
    writes for them from u280.cfg, with a stand-in for v++ (only the config is made)."""
    hls_dir = tmp_path / "hls"
    shutil.copytree(ROOT / "hls", hls_dir, ignore=shutil.ignore_patterns("build"))
    target = "build/xilinx_u280_gen3x16_xdma_1_202211_1/hw/link.cfg"
    args = ["make", "-s", "-C", str(hls_dir), "VPP=true", target] + ([f"KERNELS={kernels}"] if kernels else [])
    r = subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    text = (hls_dir / target).read_text()
    assert [k for k, _ in re.findall(r"(?m)^nk=(\w+):1:(\w+)$", text)] == \
           [k for k in hcb.KERNEL_NAMES if k in expect]
    assert {k for k, _ in re.findall(r"(?m)^sp=(\w+)_1\.(\w+):", text)} == set(expect)
