"""What only the HLS C-simulation EPS has: its kernel interface, its build and cache.

The bit-exact comparison of hls/eps_kernels.cpp (compiled with g++, called
through ctypes) with the NumPy golden model (every vector class of
docs/eps-numerics.md, sizes around the kernels' tile, the EagerParamServer)
is the shared suite of tests/test_eps_backends_bitexact.py, which runs the same
bodies for every backend. Here: what the OpenCL backend does not do today
(empty layers, concurrent threads, refusing malformed arguments), the kernels
called directly, the compiled library and its cache, and the HLS source keeping
the kernel names, parameter names and order of fpga/opencl/eps.cl
(fpga/ARGS.md), with one AXI bundle per buffer.

One HlsCsimBackend serves the whole module (the library is built once into the
user cache); every test takes fresh layer ids from ``new_layer()``.
"""
from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from l2l.eps import OptimizerHyper, StepScalars
from l2l.eps import hls_csim_backend as hcb
from l2l.eps.hls_csim_backend import HlsCsimBackend
from l2l.eps.opencl_backend import KERNEL_SOURCE as CL_SOURCE
from l2l.errors import UserError

from eps_oracle import grad_array, wide_f32, wide_grad_bits  # tests/ is on sys.path under pytest

from eps_twin import DTYPES, HLS_BLOCK, HLS_TILE as TILE, Twin, assert_same, sentinel, wide_state

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")


@pytest.fixture(scope="module")
def hls():
    backend = HlsCsimBackend()
    yield backend
    backend.close()


# --------------------------------------------------------------------------
# bit-exact cases the OpenCL backend does not meet today
# --------------------------------------------------------------------------


def test_threads_share_one_backend(hls):
    """Two threads stepping different layers at once (the kernels run without the GIL) agree
    with NumPy: per-thread scratch, no shared staging buffer. (OpenCL: one finite-flag buffer
    and one set of scratch buffers per backend, stepped from the EPS thread alone.)"""
    rng = np.random.default_rng(817)
    twins = [Twin(hls, *wide_state(rng, 20_000)) for _ in range(2)]

    def run(j):
        r = np.random.default_rng(900 + j)
        for t in range(1, 6):
            grads = [grad_array(wide_grad_bits(r, 20_000, "bf16"), "bf16") for _ in range(3)]
            twins[j].step(grads, StepScalars.compute(OptimizerHyper(), t, divisor=3.0), "fp16",
                          f"thread {j} step {t}", expect_finite=True)

    with ThreadPoolExecutor(2) as pool:
        for future in [pool.submit(run, j) for j in range(2)]:
            future.result()  # re-raises a thread's failure here


# --------------------------------------------------------------------------
# the kernels called directly
# --------------------------------------------------------------------------


def test_update_kernel_writes_nothing_when_flag_clear(hls):
    """eps_update_<g>_<c> called directly with *finite == 0 on finite data: no store at all."""
    rng = np.random.default_rng(815)
    n = TILE + 5
    for g, c in itertools.product(DTYPES, DTYPES):
        gr = grad_array(wide_grad_bits(rng, 2 * n, g), g)
        state = [wide_f32(rng, n) for _ in range(3)]
        before = [a.copy() for a in state]
        copy = sentinel(n, c)
        flag = np.zeros(1, np.int32)
        fn = getattr(hls.lib, f"eps_update_{hcb.GRAD_SUFFIX[gr.dtype]}_{hcb.SUFFIX[copy.dtype]}")
        fn(gr.ctypes.data, *(a.ctypes.data for a in state), copy.ctypes.data, flag.ctypes.data, n, 2, n,
           *StepScalars.compute(OptimizerHyper(), 1).as_tuple())
        for a, b in zip(state, before):
            assert_same(a, b, f"{g}->{c}: state written with the flag clear")
        assert_same(copy, sentinel(n, c), f"{g}->{c}: copy written with the flag clear")


def test_update_kernel_decay_boundary_past_n_acts_as_n(hls):
    """eps_update_<g>_<c> called directly with n_decay above n (the host refuses one; the RTL
    register map says such a value acts as n): the bits of n_decay = n, every element decayed."""
    rng = np.random.default_rng(816)
    n = HLS_BLOCK + 5  # past n within the last block, and past a whole block
    gr = grad_array(wide_grad_bits(rng, n, "fp32"), "fp32")
    start = [wide_f32(rng, n) for _ in range(3)]
    s = StepScalars.compute(OptimizerHyper(lr=1e-2, weight_decay=0.1), 1).as_tuple()
    out = []
    for n_decay in (n, n + 1, HLS_BLOCK * 2, (1 << 32) - 1):
        state, copy, flag = [a.copy() for a in start], sentinel(n, "bf16"), np.ones(1, np.int32)
        hls.lib.eps_update_f32_bf16(gr.ctypes.data, *(a.ctypes.data for a in state), copy.ctypes.data,
                                    flag.ctypes.data, n, 1, n_decay, *s)
        out.append((n_decay, state, copy))
    for n_decay, state, copy in out[1:]:
        for a, b, name in zip(state, out[0][1], "pmv"):
            assert_same(a, b, f"n_decay={n_decay}: {name}")
        assert_same(copy, out[0][2], f"n_decay={n_decay}: copy")


# --------------------------------------------------------------------------
# the compiled library, its build and cache
# --------------------------------------------------------------------------


def test_library_exports_every_kernel(hls):
    for name in hcb.KERNEL_NAMES:
        assert callable(getattr(hls.lib, name)), name
    assert len(hcb.KERNEL_NAMES) == 30  # check 3, update (AdamW) 9, lion 9, lamb norms 3 and step 3, copy 3
    nm = shutil.which("nm")
    if nm:  # exactly these eps_* symbols, unmangled (extern "C")
        out = subprocess.run([nm, "-D", "--defined-only", hls.lib._name], capture_output=True, text=True,
                             check=True).stdout
        exported = {line.split()[-1] for line in out.splitlines() if line.split() and line.split()[-1].startswith("eps_")}
        assert exported == set(hcb.KERNEL_NAMES)


def test_build_flags_keep_the_contract_rules():
    assert "-ffp-contract=off" in hcb.CXX_FLAGS and "-fno-fast-math" in hcb.CXX_FLAGS
    for flag in hcb.CXX_FLAGS:
        assert not flag.startswith(("-Ofast", "-ffast-math", "-march", "-mfma", "-funsafe", "-ffinite",
                                    "-fassociative", "-freciprocal")), flag
    src = hcb.kernel_source()
    for banned in ("fma(", "fmaf(", "std::fma", "__builtin_fma", "-ffast-math\"", "ap_int.h", "hls_math"):
        assert banned not in src, banned


@pytest.mark.heavy
def test_build_cache_reuse_and_concurrent_builders(tmp_path, monkeypatch):
    """Two concurrent builders into a fresh cache both succeed with one library and no temporary
    left behind; a second build reuses it; XDG_CACHE_HOME chooses the default place."""
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(hcb.build_library, cache_dir=tmp_path / "cache") for _ in range(2)]
        paths = [f.result() for f in futures]
    assert len(set(paths)) == 1
    files = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert files == [paths[0].name], files
    mtime = os.stat(paths[0]).st_mtime_ns
    assert hcb.build_library(cache_dir=tmp_path / "cache") == paths[0]
    assert os.stat(paths[0]).st_mtime_ns == mtime
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hcb.default_cache_dir() == tmp_path / "xdg" / "l2l" / "hls-csim"
    assert hcb.library_path().parent == tmp_path / "xdg" / "l2l" / "hls-csim"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert hcb.default_cache_dir() == hcb.Path(os.path.expanduser("~")) / ".cache" / "l2l" / "hls-csim"


@pytest.mark.heavy
def test_a_backend_from_its_own_cache_agrees(tmp_path):
    """cache_dir= gives a backend whose library was built there; same bits as the shared one."""
    be = HlsCsimBackend(cache_dir=tmp_path)
    assert list(tmp_path.glob("*.so")) and be.lib._name.startswith(str(tmp_path))
    rng = np.random.default_rng(830)
    tw = Twin(be, *wide_state(rng, 999))
    tw.step([grad_array(wide_grad_bits(rng, 999, "fp16"), "fp16") for _ in range(2)],
            StepScalars.compute(OptimizerHyper(), 2, divisor=2.0), "bf16", "own cache", expect_finite=True)


def test_no_compiler_is_one_line_user_error(monkeypatch, tmp_path):
    with pytest.raises(UserError) as info:
        HlsCsimBackend(cxx="no-such-c++-compiler-l2l")
    msg = str(info.value)
    assert "\n" not in msg.strip() and "apt-get install g++" in msg, msg
    monkeypatch.setenv("PATH", str(tmp_path))  # no g++ on PATH
    ok, why = HlsCsimBackend.availability()
    assert not ok and "apt-get install g++" in why and "\n" not in why
    with pytest.raises(UserError, match="apt-get install g++"):
        HlsCsimBackend(cache_dir=tmp_path / "cache")


def test_unwritable_cache_is_one_line_user_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(UserError) as info:
        HlsCsimBackend(cache_dir=blocker / "cache")
    assert "\n" not in str(info.value) and "cache_dir" in str(info.value), info.value


def test_availability_and_name():
    ok, why = HlsCsimBackend.availability()
    assert ok, why
    assert HlsCsimBackend.name == "hls-csim" and "\n" not in why


# --------------------------------------------------------------------------
# one interface for every kernel source (fpga/ARGS.md)
# --------------------------------------------------------------------------

_KIND = {"uint": "uint", "unsigned": "uint", "float": "float"}


def _param(text: str) -> tuple[str, str, bool]:
    """(name, kind: ptr/uint/float, const pointer) of one C parameter declaration."""
    text = re.sub(r"[\s\\]+", " ", text).strip()
    tokens = text.replace("*", " * ").split()
    name = tokens[-1]
    if "*" in tokens:
        return name, "ptr", "const" in tokens[:tokens.index("*")]
    return name, _KIND[tokens[-2]], False


def _cl_signature(source: str, macro: str) -> list[tuple[str, str, bool]]:
    body = re.search(rf"#define {macro}\([\w, ]+\)(.*?)\{{", source, re.DOTALL).group(1)
    return [_param(p) for p in body[body.index("(") + 1:body.rindex(")")].split(",")]


def _hls_macro(source: str, macro: str) -> tuple[str, list[tuple[str, str, bool]], str]:
    """(top function name pattern, parameters, macro body) of an EPS_* macro of the HLS source."""
    found = re.search(rf'#define {macro}\([\w, ]+\)\s*\\?\s*extern "C" void ([\w#]+)\((.*?)\)\s*\{{(.*?)\n\n',
                      source, re.DOTALL)
    assert found, macro
    return found.group(1), [_param(p) for p in found.group(2).split(",")], found.group(3)


def _cl_kernel_names(source: str) -> set[str]:
    copies = re.findall(r"(?<!#define )EPS_UPDATE\(G, GT, (\w+),", source)
    names = {f"eps_check_{g}" for g in re.findall(r"^EPS_CHECK\((\w+),", source, re.MULTILINE)}
    names |= {f"eps_copy_{c}" for c in re.findall(r"^EPS_COPY\((\w+),", source, re.MULTILINE)}
    names |= {f"eps_update_{g}_{c}" for g in re.findall(r"^EPS_UPDATE_ALL_COPIES\((\w+),", source, re.MULTILINE)
              for c in copies}
    return names


@pytest.mark.parametrize("macro", ["EPS_CHECK", "EPS_UPDATE", "EPS_COPY"])
def test_hls_parameters_match_the_opencl_kernels(macro):
    """Same parameter names, kinds, order and const-ness as fpga/opencl/eps.cl; the documented order."""
    cl = _cl_signature(CL_SOURCE.read_text(), macro)
    top, params, body = _hls_macro(hcb.kernel_source(), macro)
    assert top.startswith(macro.lower() + "_"), top
    assert params == cl, (macro, params, cl)
    names = [p[0] for p in params]
    expected = {"EPS_CHECK": ["g", "finite", "n", "k", "inv_scale"],
                "EPS_UPDATE": ["gr", "p", "m", "v", "copy", "finite", "n", "k", "n_decay", *StepScalars.names()],
                "EPS_COPY": ["p", "copy", "n"]}[macro]
    assert names == expected
    # one AXI master bundle per buffer, every scalar and the control on the AXI-lite slave
    maxi = re.findall(r"EPS_MAXI\((\w+), (\w+)\)", body)
    assert [port for port, _ in maxi] == [n for n, kind, _ in params if kind == "ptr"]
    assert len({bundle for _, bundle in maxi}) == len(maxi)
    lite = re.findall(r"EPS_LITE\((\w+)\)", body)
    assert lite == [n for n, kind, _ in params if kind != "ptr"] + ["return"]


def test_hls_kernel_names_match_the_opencl_kernels():
    """The HLS source defines exactly KERNEL_NAMES; the OpenCL source the same check, AdamW
    update and copy kernels (tests/test_lion_hls.py and tests/test_lamb_hls.py compare the Lion
    and LAMB kernels with eps.cl's)."""
    src = hcb.kernel_source()
    adamw_era = {name for name in hcb.KERNEL_NAMES if not name.startswith(("eps_lion_", "eps_lamb_"))}
    assert _cl_kernel_names(CL_SOURCE.read_text()) == adamw_era
    hls_names = {f"eps_check_{g}" for g in re.findall(r"^EPS_CHECK\((\w+),", src, re.MULTILINE)}
    hls_names |= {f"eps_copy_{c}" for c in re.findall(r"^EPS_COPY\((\w+),", src, re.MULTILINE)}
    copies = re.findall(r"(?<!#define )EPS_UPDATE\(GN, G, (\w+),", src)
    hls_names |= {f"eps_update_{g}_{c}" for g in re.findall(r"^EPS_UPDATE_ALL_COPIES\((\w+),", src, re.MULTILINE)
                  for c in copies}
    copies = re.findall(r"(?<!#define )EPS_LION\(GN, G, (\w+),", src)
    hls_names |= {f"eps_lion_{g}_{c}" for g in re.findall(r"^EPS_LION_ALL_COPIES\((\w+),", src, re.MULTILINE)
                  for c in copies}
    hls_names |= {f"eps_lamb_norms_{g}" for g in re.findall(r"^EPS_LAMB_NORMS\((\w+),", src, re.MULTILINE)}
    hls_names |= {f"eps_lamb_step_{c}" for c in re.findall(r"^EPS_LAMB_STEP\((\w+),", src, re.MULTILINE)}
    assert hls_names == set(hcb.KERNEL_NAMES)
    # the interface pragmas themselves, and II=1 element loops
    maxi = re.search(r"#define EPS_MAXI.*?\n(.*?)\n", src, re.DOTALL).group(0)
    for word in ("HLS INTERFACE m_axi", "offset=slave", "bundle=bundle", "max_widen_bitwidth=512"):
        assert word in maxi, word
    assert "HLS INTERFACE s_axilite" in re.search(r"#define EPS_LITE.*?\n", src).group(0)
    assert src.count("#pragma HLS PIPELINE II=1") >= 5


# --------------------------------------------------------------------------
# layers over several dataflow blocks (eps::BLOCK elements each)
# --------------------------------------------------------------------------


def test_layer_over_several_blocks(hls):
    """Each kernel runs one dataflow region per block: a layer of two whole blocks and a partial
    one agrees with NumPy bit for bit, with the decay boundary inside the second block, at the
    third's start and at n; a non-finite element in a later block only (its last element, or
    the first of the second block) clears the flag and leaves everything as it was."""
    block = HLS_BLOCK
    n = 2 * block + TILE + 3
    rng = np.random.default_rng(841)
    p, m, v = wide_state(rng, n)
    tw = Twin(hls, p, m, v)
    for t, (g, c, k, nd) in enumerate([("bf16", "fp16", 3, block + 5), ("fp32", "bf16", 1, 2 * block),
                                       ("fp16", "fp32", 2, None)], start=1):
        grads = [grad_array(wide_grad_bits(rng, n, g), g) for _ in range(k)]
        tw.step(grads, StepScalars.compute(OptimizerHyper(), t, divisor=float(k)), c, f"{n} elements, step {t}",
                expect_finite=True, n_decay=nd)
    tw.write_copy("bf16", f"{n} elements")
    state = tw.dut.read_state(tw.layer)
    for at in (block, n - 1):
        grads = [grad_array(wide_grad_bits(rng, n, "fp32"), "fp32") for _ in range(2)]
        grads[1][at] = np.float32(np.inf)
        copy = sentinel(n, "fp16")
        assert tw.dut.step(tw.layer, grads, StepScalars.compute(OptimizerHyper(), 4, divisor=2.0), copy) is False
        for got, want, name in zip(tw.dut.read_state(tw.layer), state, "pmv"):
            assert_same(got, want, f"inf at {at}: {name} changed")
        assert_same(copy, sentinel(n, "fp16"), f"inf at {at}: device copy written")
