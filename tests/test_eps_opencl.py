"""What only the OpenCL EPS has: its program binary (``--cl-binary``).

The bit-exact comparison of fpga/opencl/eps.cl on PoCL with the NumPy golden
model (every vector class of shared/spec/eps-numerics.md, sizes around the
work-group of float8 work-items, the EagerParamServer) is the shared suite of
tests/test_eps_backends_bitexact.py, which runs the same bodies for every
backend. Here: a program loaded from ``program_binary()`` (what ``--cl-binary``
does with an FPGA build) gives the same bits, and a bad binary file is one line
of UserError, not a crash.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from l2l.eps import AdamWHyper, OpenCLBackend, StepScalars
from l2l.eps.numerics import COPY_DTYPES
from l2l.errors import UserError

from eps_oracle import (  # tests/ is on sys.path under pytest
    NAN_BITS,
    SPECIAL_SCALARS,
    f32_from_bits,
    specials,
    wide_grad_bits,
)

from eps_twin import DTYPES, Twin, grads_of, wide_state

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")


# --------------------------------------------------------------------------
# the program binary (--cl-binary)
# --------------------------------------------------------------------------


def test_program_binary_round_trip(tmp_path):
    """program_binary() written to a file and loaded with binary=: the same kernels, the same bits."""
    path = tmp_path / "eps.bin"
    built = OpenCLBackend()
    path.write_bytes(built.program_binary())
    built.close()
    loaded = OpenCLBackend(binary=str(path))
    try:
        assert sorted(loaded.program.kernel_names.split(";")) == sorted(built.program.kernel_names.split(";"))
        rng = np.random.default_rng(717)
        for (gdtype, cdtype), K, n in zip(itertools.product(DTYPES, DTYPES), itertools.cycle([1, 2, 4]),
                                          itertools.cycle([1, 7, 257, 3001])):
            tw = Twin(loaded, *wide_state(rng, n))
            tw.write_copy(cdtype, "binary: after write_state")
            for t in range(1, 5):
                grad_bits = [wide_grad_bits(rng, n, gdtype) for _ in range(K)]
                if t == 3:
                    grad_bits[0][n // 2] = NAN_BITS[gdtype]
                tw.step(grads_of(grad_bits, gdtype), StepScalars.compute(AdamWHyper(), t, divisor=float(K)),
                        cdtype, f"binary: {gdtype} K={K} ->{cdtype} n={n} t={t}", expect_finite=t != 3)
        # special values through the loaded program too
        P, M, V, G = np.meshgrid(specials(True), specials(True), specials(False), specials(True),
                                 indexing="ij")
        tw = Twin(loaded, *(f32_from_bits(x.reshape(-1)) for x in (P, M, V)))
        tw.step([f32_from_bits(G.reshape(-1))], SPECIAL_SCALARS["subnormal-eps"], "fp16", "binary: specials")
    finally:
        loaded.close()


def _assert_one_line_user_error(path, what):
    with pytest.raises(UserError) as info:
        OpenCLBackend(binary=str(path))
    msg = str(info.value)
    assert msg and "\n" not in msg.strip(), f"{what}: message is not one line: {msg!r}"
    assert str(path) in msg, f"{what}: message does not name the file: {msg!r}"


def test_bad_binary_missing_file(tmp_path):
    _assert_one_line_user_error(tmp_path / "no-such-program.bin", "missing file")
    _assert_one_line_user_error(tmp_path, "a directory")


@pytest.mark.parametrize("content", [b"this is not an OpenCL program binary\n" * 40, b"", b"\x7fELF" + bytes(200)],
                         ids=["text", "empty", "elf-header"])
def test_bad_binary_garbage_file(tmp_path, content):
    path = tmp_path / "garbage.bin"
    path.write_bytes(content)
    _assert_one_line_user_error(path, f"garbage file {content[:8]!r}")


# --------------------------------------------------------------------------
# the check kernel's spans
# --------------------------------------------------------------------------


@pytest.mark.parametrize("launch", ["ndrange", "task"])
def test_check_spans_find_every_position(launch):
    """eps_check walks CHECK_SPAN vectors per work-item and stores its verdict once: an inf or
    a NaN on either side of every span boundary, in the last full vector and in the n % 8
    tail still clears the flag, and the layer is left as it was."""
    from l2l.eps.opencl_backend import CHECK_SPAN, VECTOR
    span = CHECK_SPAN * VECTOR
    n = 3 * span + 5
    be = OpenCLBackend(launch=launch)
    try:
        rng = np.random.default_rng(77)
        p, m, v = wide_state(rng, n)
        s = StepScalars.compute(AdamWHyper(), 1)
        positions = [0, span - 1, span, 2 * span - 1, 2 * span, 3 * span - 1, 3 * span, n - 1]
        for i, bad in zip(positions, itertools.cycle([np.inf, np.nan, -np.inf])):
            tw = Twin(be, p, m, v)
            g = (rng.standard_normal(n) * 1e-3).astype(np.float32)
            g[i] = bad
            tw.step([g], s, "fp32", f"{bad} at {i} of {n}", expect_finite=False)
            tw.check_state(f"after {bad} at {i}")
        tw.step([np.ones(n, np.float32)], s, "fp32", "finite layer", expect_finite=True)
    finally:
        be.close()


# --------------------------------------------------------------------------
# streaming stores for the device copy (x86 CPU devices)
# --------------------------------------------------------------------------


def _copy_at(n: int, cdtype: str, misalign: int) -> np.ndarray:
    """A device-copy array whose data start ``misalign`` bytes past a 64-byte boundary."""
    dtype = np.dtype(COPY_DTYPES[cdtype])
    raw = np.zeros(n * dtype.itemsize + 128, np.uint8)
    start = (-raw.ctypes.data) % 64 + misalign
    return raw[start:start + n * dtype.itemsize].view(dtype)


@pytest.mark.parametrize("streaming", ["1", "0"])
def test_device_copy_bits_do_not_depend_on_its_alignment(streaming, monkeypatch):
    """The update writes the copy with streaming stores when built for them and the copy
    is aligned for them, with plain stores otherwise: the same bits either way, and on a
    non-finite step nothing is written by either route."""
    monkeypatch.setenv("L2L_CL_STREAMING", streaming)
    be = OpenCLBackend()
    try:
        options = be.program.get_build_info(be.device, be._cl.program_build_info.OPTIONS)
        assert ("-DL2L_NT_STORES" in options) is be.streaming_stores
        rng = np.random.default_rng(5)
        n = 8 * 300 + 3
        for cdtype, misalign in itertools.product(DTYPES, (0, 2, 4, 16)):
            tw = Twin(be, *wide_state(rng, n))
            copies = (_copy_at(n, cdtype, misalign), _copy_at(n, cdtype, misalign))
            for t in (1, 2, 3):
                g = grads_of([wide_grad_bits(rng, n, "fp32")], "fp32")
                if t == 2:
                    g[0][n // 3] = np.inf
                tw.step(g, StepScalars.compute(AdamWHyper(), t), cdtype,
                        f"copy {cdtype} at 64+{misalign} t={t}", expect_finite=t != 2, copies=copies)
    finally:
        be.close()
