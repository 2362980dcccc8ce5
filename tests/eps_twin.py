"""The harness shared by the bit-exact suites of every non-NumPy EPS backend.

A :class:`Twin` holds one layer in a fresh NumpyBackend (the golden model) and
in the backend under test, steps both from the same state and compares p, m, v,
the finite flag and the device copy bit for bit (NaN == NaN).
tests/test_eps_opencl.py and tests/test_eps_hls.py use it; an RTL backend will too.
"""
from __future__ import annotations

import itertools

import numpy as np

from l2l.eps import NumpyBackend, StepScalars
from l2l.eps.numerics import COPY_DTYPES

from test_eps_contract import (  # tests/ is on sys.path under pytest
    Oracle,
    _bits_of,
    _is_nan_bits,
    assert_bits,
    grad_array,
    wide_f32,
)

FMT_OF = {np.dtype(np.float32): "fp32", COPY_DTYPES["bf16"]: "bf16", np.dtype(np.float16): "fp16"}
DTYPES = ["fp32", "bf16", "fp16"]
_LAYER_IDS = itertools.count(10_000)


def new_layer() -> int:
    """A layer id no other test uses on a module-shared backend."""
    return next(_LAYER_IDS)


# --------------------------------------------------------------------------
# comparison helpers
# --------------------------------------------------------------------------


def _hex(a, i) -> str:
    a = np.ascontiguousarray(a)
    width = a.dtype.itemsize * 2
    return f"0x{int(_bits_of(a)[i]):0{width}x}"


def assert_same(got, want, what, inputs=None):
    """``got`` has ``want``'s dtype, shape and bits (NaN == NaN); on failure the inputs
    of the first differing elements are in the message."""
    got, want = np.ascontiguousarray(got), np.ascontiguousarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, got.shape, want.dtype, want.shape)
    fmt = FMT_OF[got.dtype]
    a, e = _bits_of(got), _bits_of(want)
    ok = (a == e) | (_is_nan_bits(a, fmt) & _is_nan_bits(e, fmt))
    if ok.all():
        return
    detail = ""
    if inputs:
        arrays = {k: x for k, x in inputs.items() if isinstance(x, np.ndarray)}
        scal = {k: x for k, x in inputs.items() if not isinstance(x, np.ndarray)}
        rows = []
        for i in np.flatnonzero(~ok)[:4]:
            rows.append(f"  input [{i}]: " + ", ".join(f"{k}={_hex(x, i)}" for k, x in arrays.items()))
        rows.append("  scalars: " + ", ".join(f"{k}={x!r}" for k, x in scal.items()))
        detail = "\n" + "\n".join(rows)
    assert_bits(got, e, fmt, f"{what} (backend vs NumPy){detail}")


def sentinel(n: int, cdtype: str) -> np.ndarray:
    """A device-copy array filled with a recognisable pattern (bits 0x5a5a...)."""
    out = np.empty(n, COPY_DTYPES[cdtype])
    out.view(np.uint8)[:] = 0x5A
    return out


def scalar_dict(s: StepScalars) -> dict:
    return {k: f"0x{int(np.asarray(v).view(np.uint32)):08x}" for k, v in zip(StepScalars.names(), s.as_tuple())}


class Twin:
    """One layer held by a fresh NumpyBackend and by the backend under test (``dut``), stepped in lockstep."""

    def __init__(self, backend, p, m=None, v=None, layer=None):
        self.ref, self.dut = NumpyBackend(), backend
        self.layer = new_layer() if layer is None else layer
        self.n = p.shape[0]
        for be in (self.ref, self.dut):
            be.allocate(self.layer, p)
            if m is not None:
                be.write_state(self.layer, p, m, v)
        self.check_state("after allocate/write_state")

    def check_state(self, what, inputs=None):
        ref, got = self.ref.read_state(self.layer), self.dut.read_state(self.layer)
        for name, r, g in zip("pmv", ref, got):
            assert_same(g, r, f"{what}: {name}", inputs)
        return ref

    def step(self, grads, s: StepScalars, cdtype: str, what: str, expect_finite=None, form="list",
             copies=None) -> bool:
        """One update on both; ``grads`` is a list of K arrays, passed as ``form`` (see
        as_form). ``copies``: (NumPy's, the backend's) device-copy arrays reused across steps;
        by default fresh arrays holding a sentinel."""
        p, m, v = self.ref.read_state(self.layer)
        inputs = {"p": p, "m": m, "v": v, **{f"g{k}": g for k, g in enumerate(grads)}, **scalar_dict(s)}
        inputs["copy"] = cdtype
        inputs["form"] = form
        c_ref, c_dut = copies if copies is not None else (sentinel(self.n, cdtype), sentinel(self.n, cdtype))
        before = c_dut.copy()
        arg = as_form(grads, form)
        f_ref = self.ref.step(self.layer, arg, s, c_ref)
        f_dut = self.dut.step(self.layer, arg, s, c_dut)
        assert f_dut is f_ref, f"{what}: finite flag {self.dut.name} {f_dut} vs NumPy {f_ref}"
        if expect_finite is not None:
            assert f_ref is expect_finite, f"{what}: test vectors meant to give finite={expect_finite}"
        self.check_state(what, inputs)
        assert_same(c_dut, c_ref, f"{what}: device copy {cdtype}", inputs)
        if not f_ref:  # nothing written: what was there before is still there
            assert_same(c_dut, before, f"{what}: device copy written on a non-finite step")
        return f_ref

    def write_copy(self, cdtype: str, what: str):
        c_ref, c_dut = sentinel(self.n, cdtype), sentinel(self.n, cdtype)
        self.ref.write_copy(self.layer, c_ref)
        self.dut.write_copy(self.layer, c_dut)
        p = self.ref.read_state(self.layer)[0]
        assert_same(c_dut, c_ref, f"{what}: write_copy {cdtype}", {"p": p})
        return c_ref


def grads_of(grad_bits, gdtype):
    return [grad_array(b, gdtype) for b in grad_bits]


FORMS = ["list", "block", "strided"]


def as_form(grads, form):
    """The K contributions as a backend receives them: a list of K arrays ("list"), one
    C-contiguous (K, n) array ("block", what the server passes), or a non-contiguous (K, n)
    view ("strided": every other column of a wider array); "given": ``grads`` itself."""
    if form == "given":
        return grads
    if form == "list":
        return list(grads)
    if form == "block":
        return np.stack(grads)
    assert form == "strided"
    wide = np.zeros((len(grads), 2 * grads[0].shape[0]), grads[0].dtype)
    wide[:, ::2] = np.stack(grads)
    return wide[:, ::2]


def wide_state(rng, n):
    return wide_f32(rng, n), wide_f32(rng, n), wide_f32(rng, n, nonneg=True)


def oracle_ties(p, m, v, grad_bits, gdtype, s, cdtype) -> Oracle:
    """The contract oracle's tie counters for these inputs: proves a construction really ties."""
    o = Oracle()
    g, finite = o.reduce(grad_bits, gdtype, s.inv_scale)
    assert finite
    p2, _, _ = o.adamw(p.astype(np.float64), m.astype(np.float64), v.astype(np.float64), g, s)
    o.copy_bits(p2, cdtype)
    return o


