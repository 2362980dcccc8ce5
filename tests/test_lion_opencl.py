"""Lion on the OpenCL EPS (``eps_lion_<g>_<c>`` in fpga/opencl/eps.cl) against the golden model,
``NumpyBackend(threads=1)``, bit for bit: p, m, the device copy and the finite flag (NaN == NaN).

Vector classes: values over every binade (subnormals, signed zeros), ``c = b1*m + omb1*g`` a
zero of either sign (zeros, and products that cancel exactly), every gradient dtype with every
copy dtype, K = 1, 2 and 3 contributions, non-finite gradients (nothing written), the decay
boundary at 0, 1, n-1, n and around vectors and chunks, n not a multiple of the vector width,
both vector widths (float8, float16) and every launch shape; then the zero-copy master serving
as the copy, programs loaded from a binary (one built before Lion still runs AdamW), the
EagerParamServer, and ``l2l train --optimizer lion`` against the NumPy EPS.
"""
from __future__ import annotations

import dataclasses
import itertools
import re

import numpy as np
import pytest

from l2l.checkpoint import load_latest
from l2l.eps import EagerParamServer, LionScalars, NumpyBackend, OpenCLBackend, OptimizerHyper, StepScalars
from l2l.eps.contract import step_scalars
from l2l.eps.numerics import COPY_DTYPES, GRAD_DTYPES
from l2l.eps.opencl_backend import BUILD_OPTIONS, BINARY_VECTOR, kernel_source
from l2l.errors import UserError
from l2l.metrics import read_metrics

from conftest import run_cli
from eps_oracle import NAN_BITS, f32_from_bits, nonfinite_cases, nonfinite_grads, wide_f32, wide_grad_bits
from eps_twin import DTYPES, FORMS, OPENCL_CHUNK, as_form, assert_same, grads_of, new_layer, sentinel

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

LION = OptimizerHyper(lr=1e-2, beta1=0.9, beta2=0.99, weight_decay=0.1, optimizer="lion")
HYPERS = [LION, OptimizerHyper(lr=3e-4, beta1=0.95, beta2=0.98, weight_decay=0.0, optimizer="lion"),
          OptimizerHyper(lr=0.5, beta1=0.0, beta2=0.0, weight_decay=1.5, optimizer="lion")]
# scalars no hyper-parameters give: subnormal step and scale, b1 = 1, a -0.0 step (lr = 0)
ODD_SCALARS = [
    LionScalars(*(np.float32(x) for x in (0.5, 1.0, 2.0 ** -100, 0.0, 1.0, -(2.0 ** -149), 2.0 ** -140))),
    LionScalars(*(np.float32(x) for x in (1.0, 0.25, 0.75, 0.5, 0.5, -0.0, 1.0))),
    LionScalars(*(np.float32(x) for x in (2.0 ** -130, 0.9, 0.1, 0.99, 0.01, -3e38, 1e-30))),
]
SIZES = (1, 7, 8, 9, 15, 16, 17, 383, 384, 385, 1535, 1536, 1537, 3001)  # around vectors and chunks


def lion(t: int = 1, hyper: OptimizerHyper = LION, k: int = 1) -> LionScalars:
    return step_scalars(hyper, t, divisor=float(k))


class LionTwin:
    """One Lion layer, ``(p, m)``, in a fresh NumpyBackend(threads=1) and in the backend under
    test, stepped in lockstep and compared bit for bit."""

    def __init__(self, backend, p, m=None):
        self.ref, self.dut = NumpyBackend(threads=1), backend
        self.layer = new_layer()
        self.n = p.shape[0]
        for be in (self.ref, self.dut):
            be.allocate(self.layer, p, 1)
            if m is not None:
                be.write_state(self.layer, p, m)
        self.check_state("after allocate/write_state")

    def check_state(self, what, inputs=None):
        ref, got = self.ref.read_state(self.layer), self.dut.read_state(self.layer)
        assert len(ref) == len(got) == 2, (len(ref), len(got))
        for name, r, g in zip("pm", ref, got):
            assert_same(g, r, f"{what}: {name}", inputs)
        return got

    def step(self, grads, s: LionScalars, cdtype: str, what: str, expect_finite=None, form="list",
             copies=None, n_decay=None) -> bool:
        p, m = self.ref.read_state(self.layer)
        inputs = {"p": p, "m": m, **{f"g{k}": g for k, g in enumerate(grads)},
                  **{k: f"0x{int(np.asarray(v).view(np.uint32)):08x}" for k, v in zip(s.names(), s.as_tuple())},
                  "copy": cdtype, "form": form, "n_decay": n_decay}
        kw = {} if n_decay is None else {"n_decay": n_decay}
        c_ref, c_dut = copies if copies is not None else (sentinel(self.n, cdtype), sentinel(self.n, cdtype))
        before, state_before = c_dut.copy(), self.dut.read_state(self.layer)
        arg = as_form(grads, form)
        f_ref = self.ref.step(self.layer, arg, s, c_ref, **kw)
        f_dut = self.dut.step(self.layer, arg, s, c_dut, **kw)
        assert f_dut is f_ref, f"{what}: finite flag opencl {f_dut} vs NumPy {f_ref}"
        if expect_finite is not None:
            assert f_ref is expect_finite, f"{what}: test vectors meant to give finite={expect_finite}"
        after = self.check_state(what, inputs)
        assert_same(c_dut, c_ref, f"{what}: device copy {cdtype}", inputs)
        if not f_ref:  # nothing written
            assert_same(c_dut, before, f"{what}: device copy written on a non-finite step")
            for name, x, y in zip("pm", after, state_before):
                assert_same(x, y, f"{what}: {name} changed on a non-finite step")
        return f_ref


@pytest.fixture(scope="module", params=[8, 16], ids=["VW8", "VW16"])
def backend(request):
    """The default launch on a CPU device (chunks), small chunks: many work-items on small layers."""
    be = OpenCLBackend(min_chunk=OPENCL_CHUNK, vector_width=request.param)
    yield be
    be.close()


def _cancelling(rng, g: np.ndarray, s: LionScalars) -> tuple[np.ndarray, np.ndarray]:
    """Moments m with b1*m == -(omb1*g) exactly in binary32 (c is then +0), where one is found
    near -(omb1*g)/b1; and where."""
    x = (s.omb1 * g).astype(np.float32)
    m = (-x / s.b1).astype(np.float32)
    found = np.zeros(g.shape, bool)
    out = m.copy()
    for d in (0, 1, -1, 2, -2):
        cand = m.view(np.int32) + np.int32(d)
        cand = cand.view(np.float32)
        hit = ~found & ((s.b1 * cand).astype(np.float32) == -x) & np.isfinite(cand)
        out[hit], found = cand[hit], found | hit
    return out, found


def _c_zero_state(rng, n, s: LionScalars, grad_bits_dtype="fp32"):
    """p over every binade with many signed zeros; m and g where c is a zero of either sign:
    both zeros (any signs), and products that cancel exactly; the rest wide values."""
    p = wide_f32(rng, n)
    p[rng.random(n) < 0.25] = np.float32(-0.0)
    m = wide_f32(rng, n, max_abs=1e30)
    g = (rng.standard_normal(n) * 10.0 ** rng.integers(-30, 30, n)).astype(np.float32)
    zeros = rng.random(n) < 0.3
    m[zeros] = np.where(rng.random(zeros.sum()) < 0.5, -0.0, 0.0)
    g[zeros] = np.where(rng.random(zeros.sum()) < 0.5, -0.0, 0.0)
    cancel = ~zeros & (rng.random(n) < 0.4)
    mc, found = _cancelling(rng, g, s)
    m[cancel & found] = mc[cancel & found]
    c = ((s.b1 * m).astype(np.float32) + (s.omb1 * g).astype(np.float32)).astype(np.float32)
    return p, m, g, c


# --------------------------------------------------------------------------
# the program
# --------------------------------------------------------------------------


def test_program_has_every_lion_kernel(backend):
    """eps_lion_<g>_<c> for every gradient and copy dtype, 15 arguments each (fpga/ARGS.md)."""
    cl = backend._cl
    for g, c in itertools.product(("f32", "bf16", "f16"), repeat=2):
        kernel = backend._kernels[f"eps_lion_{g}_{c}"]
        assert kernel.get_info(cl.kernel_info.NUM_ARGS) == 15
    assert backend.optimizers >= {"adamw", "lion"}


# --------------------------------------------------------------------------
# values
# --------------------------------------------------------------------------


@pytest.mark.parametrize("gdtype, cdtype", list(itertools.product(DTYPES, DTYPES)))
def test_wide_values_every_dtype_pair(backend, gdtype, cdtype):
    """p and m over every binade, subnormals and signed zeros included, gradients over every
    binade of their dtype; K = 1, 2, 3; every size around a vector of either width and a few
    chunks; the contributions as a list, a block and a strided view; the decay boundary off,
    at 0, mid-layer and at n."""
    rng = np.random.default_rng([backend.vector_width, DTYPES.index(gdtype), DTYPES.index(cdtype)])
    forms = itertools.cycle(FORMS)
    for K, n in itertools.product((1, 2, 3), SIZES):
        tw = LionTwin(backend, wide_f32(rng, n), wide_f32(rng, n))
        for t, hyper, n_decay in zip((1, 2, 3), HYPERS, (None, n // 2, rng.integers(0, n + 1))):
            grads = grads_of([wide_grad_bits(rng, n, gdtype) for _ in range(K)], gdtype)
            tw.step(grads, lion(t, hyper, K), cdtype, f"{gdtype}->{cdtype} K={K} n={n} t={t}",
                    expect_finite=True, form=next(forms), n_decay=n_decay)


@pytest.mark.parametrize("s", ODD_SCALARS, ids=["subnormal-step", "zero-step", "tiny-decay"])
def test_odd_scalars(backend, s):
    """Scalars outside what hyper-parameters give: subnormal neg_lr and inv_scale; neg_lr = -0.0
    (where c < 0, p1 - (-0.0) turns a -0 p1 into +0, as the golden model's p1 + (-1 * -0.0)
    does); a subnormal decay; b1 = 1, b2 = 0; a step that overflows p."""
    rng = np.random.default_rng(5)
    for cdtype, n in zip(DTYPES, (3001, 385, 17)):
        p = wide_f32(rng, n)
        p[::3] = np.float32(-0.0)
        tw = LionTwin(backend, p, wide_f32(rng, n))
        for t in range(3):
            grads = grads_of([wide_grad_bits(rng, n, "fp32", max_abs=1e30) for _ in range(2)], "fp32")
            tw.step(grads, s, cdtype, f"odd scalars {s} ->{cdtype} n={n} t={t}", n_decay=n // 3)


@pytest.mark.parametrize("launch", ["chunks", "vectors", "task"])
def test_a_zero_c_leaves_p1_with_its_sign(launch):
    """Where c is a zero of either sign (m and g zeros of any signs; b1*m and omb1*g that
    cancel exactly) p' is p1 itself, a -0 p1 staying -0, in every launch shape and vector
    width, decayed or not; elsewhere p1 -/+ neg_lr."""
    for vw in (8, 16):
        be = OpenCLBackend(launch=launch, min_chunk=3, vector_width=vw)
        try:
            rng = np.random.default_rng([vw, len(launch)])
            n = 40 * vw + 5
            for t, hyper in enumerate(HYPERS[:2], start=1):
                s = lion(t, hyper)
                p, m, g, c = _c_zero_state(rng, n, s)
                assert (c == 0).sum() > n // 3 and (np.signbit(c) & (c == 0)).any() and (c > 0).any() and (c < 0).any()
                tw = LionTwin(be, p, m)
                nd = n // 2 + 3
                tw.step([g], s, DTYPES[t], f"{launch} VW={vw} c zero t={t}", expect_finite=True, n_decay=nd)
                got = be.read_state(tw.layer)[0]
                p1 = np.where(np.arange(n) < nd, (p * s.decay).astype(np.float32), p)
                still = c == 0
                assert np.array_equal(got[still].view(np.uint32), p1[still].view(np.uint32))
                moved = ~still
                assert not np.array_equal(got[moved & (c > 0)], p1[moved & (c > 0)])
        finally:
            be.close()


def test_nan_state_gives_nan_as_the_golden_model(backend):
    """Outside the contract (finite state stays finite), but the golden model defines it: a NaN
    or an infinite m makes c NaN or infinite; p' then follows p1 + sign(c) * neg_lr (NaN for a
    NaN c), and an infinite p stays infinite."""
    rng = np.random.default_rng(9)
    n = 8 * 16 + 5
    p, m = wide_f32(rng, n), wide_f32(rng, n)
    nan = f32_from_bits(NAN_BITS["fp32"])
    m[::5], m[1::7], p[2::9] = nan, np.float32(np.inf), np.float32(-np.inf)
    tw = LionTwin(backend, p, m)
    for t, hyper in enumerate((LION, HYPERS[2]), start=1):  # beta1 = 0: 0 * inf is a NaN c
        grads = [(rng.standard_normal(n) * 1e-2).astype(np.float32)]
        tw.step(grads, lion(t, hyper), "bf16", f"NaN state t={t}", expect_finite=True)


def test_non_finite_gradients_change_nothing(backend):
    """inf, -inf, NaN, inf + (-inf), a sum or a scale that overflows, in the first element, a
    middle one and the last (the tail), K = 1, 2, 3, every gradient dtype: the flag is false,
    p, m and the device copy are left as they were; the next finite step is the golden model's."""
    rng = np.random.default_rng(13)
    n = 97 * 16 + 3
    for gdtype in DTYPES:
        tw = LionTwin(backend, wide_f32(rng, n), wide_f32(rng, n))
        copies = (sentinel(n, "bf16"), sentinel(n, "bf16"))
        for case, K, gd in nonfinite_cases():
            if gd != gdtype or K == 4:
                continue
            for i in (0, 65 * 16 + 3, n - 1):
                grad_bits, s = nonfinite_grads(rng, n, case, K, gdtype, i)
                scalars = dataclasses.replace(lion(2, LION, K), inv_scale=s.inv_scale)
                tw.step(grads_of(grad_bits, gdtype), scalars, "bf16", f"{case} K={K} {gdtype} at {i}",
                        expect_finite=False, copies=copies)
        for K in (3, 1):
            grads = grads_of([wide_grad_bits(rng, n, gdtype) for _ in range(K)], gdtype)
            tw.step(grads, lion(3, LION, K), "bf16", f"finite after the others K={K}", expect_finite=True,
                    copies=copies)


# --------------------------------------------------------------------------
# the decay boundary, every launch shape
# --------------------------------------------------------------------------


@pytest.mark.parametrize("launch", ["chunks", "vectors", "task"])
def test_decay_boundary_in_every_shape(launch):
    """eps_lion decays whole vectors below n_decay, selects lanes in the one vector that
    straddles it, leaves the vectors past it undecayed, and decides the tail element by
    element: every boundary in and around the first two vectors, 0, 1, n-1 and n, both sides
    of a chunk edge and half a vector past it; a work-item per chunk of 3 vectors, per vector
    or one for all; both vector widths; K = 1, 2 and 3."""
    for vw in (8, 16):
        chunk = 3
        n = 10 * chunk * vw + 5  # ten chunks of three vectors, a tail of 5
        be = OpenCLBackend(launch=launch, min_chunk=chunk, vector_width=vw)
        try:
            edges = (chunk * vw, 5 * chunk * vw, 10 * chunk * vw)
            boundaries = sorted(b for b in {*range(2 * vw + 2), *(e + d for e in edges for d in (-1, 0, 1, vw // 2)),
                                            *range(n - 6, n + 1)} if b <= n)
            assert {0, 1, n - 1, n} <= set(boundaries)
            rng = np.random.default_rng(vw)
            tw = LionTwin(be, wide_f32(rng, n, max_abs=1e30), (rng.standard_normal(n) * 1e-2).astype(np.float32))
            for t, nd in enumerate(boundaries, start=1):
                K, cdtype = 1 + t % 3, DTYPES[t % 3]
                grads = [(rng.standard_normal(n) * 1e-2).astype(np.float32) for _ in range(K)]
                tw.step(grads, lion(t, LION, K), cdtype, f"{launch} VW={vw} n_decay={nd} of {n} K={K} ->{cdtype}",
                        expect_finite=True, n_decay=nd)
        finally:
            be.close()


# --------------------------------------------------------------------------
# the master as the copy, refused steps
# --------------------------------------------------------------------------


def test_the_master_serves_as_the_fp32_copy_bit_for_bit():
    """On a CPU device p is a host array, handed out by master_as_copy: Lion steps writing the
    copy into it (one non-finite among them) and into separate copies between them match the
    golden model with its own master as copy; the kernel gets p's own buffer as its copy."""
    rng = np.random.default_rng(11)
    n = 16 * 300 + 5
    be, ref = OpenCLBackend(min_chunk=12), NumpyBackend(threads=1)
    try:
        assert be._zero_copy
        p0 = rng.standard_normal(n).astype(np.float32)
        be.allocate(0, p0, 1)
        ref.allocate(0, p0, 1)
        mine, golden = be.master_as_copy(0), ref.master_as_copy(0)
        assert len(be.state_view(0)) == 2
        separate = itertools.cycle([None, "bf16", "fp16", "fp32"])
        for t in range(1, 10):
            grads = (rng.standard_normal((2, n)) * 1e-2).astype(np.float32)
            grads[:, :100] = 0.0  # c = 0 there at the first step
            if t == 4:
                grads[1, n // 2] = np.nan
            s = lion(t, LION, 2)
            cdtype = next(separate)
            a, b = (mine, golden) if cdtype is None else (np.zeros(n, COPY_DTYPES[cdtype]) for _ in range(2))
            assert be.step(0, grads, s, a, n_decay=n - 700) is ref.step(0, grads, s, b, n_decay=n - 700) is (t != 4)
            assert_same(a, b, f"step {t}: copy {cdtype or 'the master'}")
            for name, x, y in zip("pm", be.state_view(0), ref.state_view(0)):
                assert_same(x, y, f"step {t}: {name}")
        args = be._last_args["eps_lion_f32_f32"]
        assert args[1] is args[3] is be._state[0][0]
    finally:
        be.close()


def test_a_step_of_the_other_optimizer_is_refused(backend):
    """A Lion step on an AdamW layer (and the other way round) is a ValueError, nothing written."""
    rng = np.random.default_rng(2)
    n = 300
    tw = LionTwin(backend, wide_f32(rng, n), wide_f32(rng, n))
    adamw = new_layer()
    backend.allocate(adamw, wide_f32(rng, n))
    copy = sentinel(n, "fp32")
    g = [np.ones(n, np.float32)]
    with pytest.raises(ValueError, match="lion step on a layer with 2 moments"):
        backend.step(adamw, g, lion(), copy)
    with pytest.raises(ValueError, match="adamw step on a layer with 1 moments"):
        backend.step(tw.layer, g, StepScalars.compute(OptimizerHyper(), 1), copy)
    assert_same(copy, sentinel(n, "fp32"), "copy written by a refused step")
    tw.check_state("after refused steps")


# --------------------------------------------------------------------------
# programs from a binary
# --------------------------------------------------------------------------


def test_program_binary_round_trip(tmp_path):
    """program_binary() loaded with binary=: Lion's bits too, every dtype pair."""
    path = tmp_path / "eps.bin"
    built = OpenCLBackend()
    path.write_bytes(built.program_binary())
    built.close()
    loaded = OpenCLBackend(binary=str(path))
    try:
        rng = np.random.default_rng(717)
        for (gdtype, cdtype), K, n in zip(itertools.product(DTYPES, DTYPES), itertools.cycle([1, 2, 3]),
                                          itertools.cycle([1, 7, 257, 3001])):
            tw = LionTwin(loaded, wide_f32(rng, n), wide_f32(rng, n))
            for t in range(1, 4):
                grad_bits = [wide_grad_bits(rng, n, gdtype) for _ in range(K)]
                if t == 2:
                    grad_bits[0][n // 2] = NAN_BITS[gdtype]
                tw.step(grads_of(grad_bits, gdtype), lion(t, LION, K), cdtype,
                        f"binary: {gdtype} K={K} ->{cdtype} n={n} t={t}", expect_finite=t != 2, n_decay=n // 2)
    finally:
        loaded.close()


def test_a_binary_built_before_lion_still_runs_adamw(tmp_path):
    """A program without eps_lion kernels (a binary built before Lion) loads and runs AdamW; a
    Lion step on it is one UserError naming the kernel, refused before anything is written."""
    import pyopencl as cl
    src = kernel_source()
    old = re.sub(r"^EPS_LION_ALL_COPIES\(.*\)$", "", src, flags=re.M)
    assert old != src and "eps_lion_" not in old.split("EPS_LION_ALL_COPIES(G, GT)")[-1].split("copy only")[-1]
    built = OpenCLBackend(vector_width=BINARY_VECTOR)
    program = cl.Program(built.context, old).build(options=BUILD_OPTIONS + [f"-DVW={BINARY_VECTOR}"])
    path = tmp_path / "old.bin"
    path.write_bytes(program.get_info(cl.program_info.BINARIES)[0])
    built.close()
    be = OpenCLBackend(binary=str(path))
    try:
        assert not any(name.startswith("eps_lion_") for name in be._kernels)
        rng = np.random.default_rng(3)
        n = 3001
        p = rng.standard_normal(n).astype(np.float32)
        ref = NumpyBackend(threads=1)
        for b in (be, ref):
            b.allocate(0, p)
        g = [(rng.standard_normal(n) * 1e-2).astype(np.float32)]
        a, b = np.empty(n, np.float32), np.empty(n, np.float32)
        s = StepScalars.compute(OptimizerHyper(), 1)
        assert be.step(0, g, s, a) and ref.step(0, g, s, b)
        assert_same(a, b, "AdamW on a program without Lion")
        be.allocate(1, p, 1)
        copy = sentinel(n, "bf16")
        with pytest.raises(UserError, match="no kernel eps_lion_f32_bf16"):
            be.step(1, g, lion(), copy)
        assert_same(copy, sentinel(n, "bf16"), "copy written by the refused Lion step")
        assert_same(be.read_state(1)[0], p, "p written by the refused Lion step")
    finally:
        be.close()


# --------------------------------------------------------------------------
# the server, the command line
# --------------------------------------------------------------------------


def _servers_agree(ref, got, layers, what):
    ref.synchronize()
    got.synchronize()
    for layer in layers:
        assert got.step_count(layer) == ref.step_count(layer), (what, layer)
        assert_same(got.fetch(layer), ref.fetch(layer), f"{what}: layer {layer} device copy")
    tr, tg = ref.state_tensors(), got.state_tensors()
    assert tr.keys() == tg.keys() and not any(k.endswith(".v") for k in tg), tg.keys()
    for k in tr:
        assert_same(tg[k], tr[k], f"{what}: {k}")


@pytest.mark.parametrize("grad_dtype, copy_dtype, contributors, share",
                         [("bf16", "fp16", 2, False), ("fp32", "bf16", 1, False), ("fp16", "fp32", 3, False),
                          ("fp32", "fp32", 1, True)])
def test_server_matches_numpy(grad_dtype, copy_dtype, contributors, share):
    """EagerParamServer(..., OptimizerHyper(optimizer="lion")): several layers with decay
    boundaries, 6 steps, one non-finite on one layer, a checkpoint of p and m loaded into both,
    3 more steps; with share_masters the OpenCL EPS's masters are the fp32 copies."""
    rng = np.random.default_rng([DTYPES.index(grad_dtype), contributors])
    sizes, decays = [1, 257, 3001, 40], [1, 200, 1500, 0]
    layers = [new_layer() for _ in sizes]
    loss_scale = 1024.0 if grad_dtype == "fp16" else 1.0
    kw = {"copy_dtype": copy_dtype, "grad_dtype": grad_dtype, "contributors": contributors, "share_masters": share}
    ref = EagerParamServer(NumpyBackend(threads=1), LION, **kw)
    got = EagerParamServer(OpenCLBackend(min_chunk=OPENCL_CHUNK), LION, **kw)
    try:
        for layer, n, nd in zip(layers, sizes, decays):
            p = wide_f32(rng, n) if n < 100 else (rng.standard_normal(n) * 0.05).astype(np.float32)
            ref.add_layer(layer, p, n_decay=nd)
            got.add_layer(layer, p, n_decay=nd)
        if share:
            assert got.copy_bytes == 0 and all(got.fetch(x) is got.backend.master_as_copy(x) for x in layers)
        _servers_agree(ref, got, layers, "after add_layer")

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
                        srv.push_gradient(layer, k, divisor=float(contributors), loss_scale=loss_scale)
            _servers_agree(ref, got, layers, f"step {step}")

        for step in range(1, 7):
            one_step(step, bad_layer=layers[2] if step == 4 else None)
        assert got.step_count(layers[2]) == 5 and got.step_count(layers[0]) == 6
        assert got.history == ref.history
        tensors = {f"layer{layer}.{k}": wide_f32(rng, n, max_abs=1e30) for layer, n in zip(layers, sizes)
                   for k in "pm"}
        meta = {**got.state_meta(), "steps": {str(layer): int(rng.integers(1, 100)) for layer in layers}}
        for srv in (ref, got):
            srv.load_state(tensors, meta)
        _servers_agree(ref, got, layers, "after load_state")
        for step in range(7, 10):
            one_step(step)
        assert got.history == ref.history
    finally:
        ref.close()
        got.close()


TINY = ["--layers", "2", "--d-model", "32", "--heads", "2", "--seq-len", "32", "--batch-size", "8",
        "--micro-batches", "2", "--eval-batches", "1", "--no-progress", "--eval-every", "0", "--no-plot",
        "--plan", "off", "--steps", "5", "--optimizer", "lion", "--lr", "3e-3", "--weight-decay", "0.1"]


def test_train_with_lion_on_opencl_is_the_numpy_run(tmp_path):
    """``l2l train --eps opencl --optimizer lion`` gives the NumPy EPS's losses and final
    checkpoint, bit for bit (p and m, no v)."""
    runs = {}
    for eps in ("numpy", "opencl"):
        out = tmp_path / eps
        r = run_cli("train", *TINY, "--eps", eps, "--out", str(out))
        assert r.returncode == 0, r.stderr[-3000:]
        runs[eps] = out
    losses = {eps: [x["loss"] for x in read_metrics(out / "metrics.jsonl")] for eps, out in runs.items()}
    assert len(losses["numpy"]) == 5 and losses["opencl"] == losses["numpy"], losses
    want, got = load_latest(runs["numpy"]).tensors, load_latest(runs["opencl"]).tensors
    assert want.keys() == got.keys() and any(k.endswith(".m") for k in got)
    assert not any(k.endswith(".v") for k in got)
    for k in want:
        assert np.array_equal(np.asarray(want[k]).view(np.uint8), np.asarray(got[k]).view(np.uint8)), k
