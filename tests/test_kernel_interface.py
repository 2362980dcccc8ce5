"""The kernel sources take the argument order documented in fpga/ARGS.md."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from l2l.eps.contract import LambScalars, LionScalars, StepScalars
from l2l.eps.opencl_backend import kernel_source

SCALARS = list(StepScalars.names())
# eps_update_<g>_<c>'s arguments (fpga/ARGS.md): buffers, n, k, the decay boundary, the step scalars
UPDATE_ARGS = ["gr", "p", "m", "v", "copy", "finite", "n", "k", "n_decay", *SCALARS]
# eps_lion_<g>_<c>'s: Lion's state (no v), then the Lion scalars in their field order
LION_ARGS = ["gr", "p", "m", "copy", "finite", "n", "k", "n_decay", *LionScalars.names()]
# LAMB's two kernels: eps_lamb_norms_<g> and eps_lamb_step_<c>, each with the nine LambScalars
LAMB_NORMS_ARGS = ["gr", "p", "m", "v", "seg", "sums", "finite", "n", "k", "n_decay", "nseg", *LambScalars.names()]
LAMB_STEP_ARGS = ["p", "m", "v", "copy", "seg", "steps", "finite", "n", "n_decay", "nseg", *LambScalars.names()]
# the buffers each LAMB kernel only reads (const pointers in every source)
LAMB_CONST = {"eps_lamb_norms_": {"gr", "p", "seg", "finite"}, "eps_lamb_step_": {"m", "v", "seg", "steps", "finite"}}


def _params(source: str, kernel: str) -> list[str]:
    """Parameter names of ``kernel`` in an OpenCL source written with the EPS_* macros."""
    macro = {"eps_check": "EPS_CHECK", "eps_update": "EPS_UPDATE", "eps_lion": "EPS_LION",
             "eps_lamb_norms": "EPS_LAMB_NORMS", "eps_lamb_step": "EPS_LAMB_STEP", "eps_copy": "EPS_COPY"}[kernel]
    body = re.search(rf"#define {macro}\([\w, ]+\)(.*?)\{{", source, re.S).group(1)
    signature = body[body.index("(") + 1:body.rindex(")")]
    return [re.sub(r"[\s\\]+", " ", p).strip().split(" ")[-1].lstrip("*") for p in signature.split(",")]


def test_opencl_kernels_follow_the_shared_order():
    src = kernel_source()
    assert _params(src, "eps_check") == ["g", "finite", "n", "k", "inv_scale"]
    assert _params(src, "eps_update") == UPDATE_ARGS
    assert _params(src, "eps_lion") == LION_ARGS
    assert _params(src, "eps_lamb_norms") == LAMB_NORMS_ARGS
    assert _params(src, "eps_lamb_step") == LAMB_STEP_ARGS
    assert _params(src, "eps_copy") == ["p", "copy", "n"]
    assert SCALARS == ["decay", "b1", "omb1", "b2", "omb2", "inv_bc2_sqrt", "eps", "neg_step", "inv_scale"]
    assert list(LionScalars.names()) == ["decay", "b1", "omb1", "b2", "omb2", "neg_lr", "inv_scale"]
    assert list(LambScalars.names()) == ["b1", "omb1", "b2", "omb2", "inv_bc2_sqrt", "eps", "inv_bc1", "wd",
                                         "inv_scale"]


def test_opencl_source_keeps_the_contract_rules():
    src = kernel_source()
    assert "#pragma OPENCL FP_CONTRACT OFF" in src
    for banned in ("fma(", "mad(", "native_", "half_divide", "half_sqrt"):
        assert banned not in src


# ----------------------------------------------------------------- all three sources

ROOT = Path(__file__).resolve().parents[1]


def _hls_update_params() -> list[str]:
    src = (ROOT / "hls" / "eps_kernels.cpp").read_text()
    found = re.search(r'#define EPS_UPDATE\([\w, ]+\)\s*\\?\s*extern "C" void [\w#]+\((.*?)\)\s*\{', src, re.S)
    return [re.sub(r"[\s\\]+", " ", p).strip().split(" ")[-1].lstrip("*") for p in found.group(1).split(",")]


def _signatures(source: str, prefix: str) -> list[list[str]]:
    """The parameter names of every kernel ``prefix...`` a source defines (an OpenCL ``__kernel``,
    an HLS ``extern "C"`` top function), however it is written: in a macro
    (``eps_lion_##G##_##C(``) or out in full."""
    return [[name for name, _ in sig] for sig in _typed_signatures(source, prefix)]


def _typed_signatures(source: str, prefix: str) -> list[list[tuple[str, str]]]:
    """As :func:`_signatures`, each parameter as (name, its declaration with spaces normalised)."""
    found = re.findall(rf'(?:__kernel|extern "C")\s+void\s+{prefix}[\w#]*\s*\((.*?)\)\s*\{{', source, re.S)
    out = []
    for sig in found:
        decls = [re.sub(r"[\s\\]+", " ", p).strip() for p in sig.split(",")]
        out.append([(d.split(" ")[-1].lstrip("*"), d) for d in decls])
    return out


LION_SOURCES = {"fpga/opencl/eps.cl": kernel_source, "hls/eps_kernels.cpp":
                lambda: (ROOT / "hls" / "eps_kernels.cpp").read_text()}


def test_every_source_with_lion_kernels_takes_their_order():
    """eps_lion_<g>_<c> in every kernel source that has it (the OpenCL C one does; the HLS C++
    one once it has them): buffers gr, p, m, copy, finite, then n, k, n_decay, then the
    LionScalars fields in order -- in every definition, however written."""
    have = {}
    for name, read in LION_SOURCES.items():
        src = read()
        if re.search(r"eps_lion_[\w#]*\s*\(", src):  # a kernel defined or called, not a mention
            have[name] = _signatures(src, "eps_lion_")
    assert have.get("fpga/opencl/eps.cl"), "eps.cl defines no eps_lion_ kernel"
    for name, signatures in have.items():
        assert signatures, f"{name} names eps_lion_ kernels but defines none this test can read"
        for params in signatures:
            assert params == LION_ARGS, (name, params)


@pytest.mark.parametrize("prefix, args", [("eps_lamb_norms_", LAMB_NORMS_ARGS), ("eps_lamb_step_", LAMB_STEP_ARGS)])
def test_every_source_with_lamb_kernels_takes_their_order(prefix, args):
    """eps_lamb_norms_<g> and eps_lamb_step_<c> in every kernel source (eps.cl and the HLS
    C++ have both): the buffers, then n (k), n_decay, nseg, then the LambScalars fields in
    order, in every definition; and the same buffers read-only (const) in every source."""
    have = {}
    for name, read in LION_SOURCES.items():
        src = read()
        if re.search(rf"{prefix}[\w#]*\s*\(", src):
            have[name] = _typed_signatures(src, prefix)
    assert set(have) == set(LION_SOURCES), f"{prefix} kernels only in {sorted(have)}"
    for name, signatures in have.items():
        assert signatures, f"{name} names {prefix} kernels but defines none this test can read"
        for sig in signatures:
            assert [p for p, _ in sig] == args, (name, sig)
            const = {p for p, decl in sig if "*" in decl and re.search(r"\bconst\b", decl)}
            assert const == LAMB_CONST[prefix], (name, const)


def _rtl_register_map() -> list[tuple[int, str]]:
    """(address, argument) of the RTL kernel's AXI4-Lite arguments, from its ADDR_* localparams."""
    return sorted((addr, name) for name, addr in _rtl_localparams("ADDR").items())


def _rtl_localparams(prefix: str) -> dict[str, int]:
    """{name: address} of l2l_axil_ctrl.v's ``<prefix>_*`` localparams, names lower-case."""
    src = (ROOT / "fpga" / "rtl" / "l2l_axil_ctrl.v").read_text()
    regs = re.findall(rf"localparam\s*(?:\[[^\]]*\])?\s*{prefix}_(\w+)\s*=\s*\d*'h([0-9A-Fa-f]+)\s*;", src)
    return {name.lower(): int(addr, 16) for name, addr in regs}


def test_opencl_and_hls_take_one_argument_order():
    """The update kernel's arguments, read from the OpenCL C macro and the HLS C++ top
    function -- one order, not a list kept twice."""
    cl = _params(kernel_source(), "eps_update")
    hls = _hls_update_params()
    assert cl == hls == UPDATE_ARGS, (cl, hls)


def test_rtl_register_map_takes_the_same_order():
    """The RTL kernel's register map holds the update's arguments in the same order, in the
    ap_ctrl_hs encoding of fpga/ARGS.md: from 0x10, buffers as 64-bit addresses, n, k,
    n_decay (0x48) and the scalars as 32 bits, the read-only status right after them (0x70)."""
    regs = _rtl_register_map()
    rtl = [name for _, name in regs]
    assert rtl == UPDATE_ARGS, rtl
    addrs = [a for a, _ in regs]
    assert addrs[0] == 0x10
    buffers = ["gr", "p", "m", "v", "copy", "finite"]
    for (a, name), (b, _) in zip(regs, regs[1:]):
        assert b - a == (8 if name in buffers else 4), (name, hex(a), hex(b))
    assert dict((name, a) for a, name in regs)["n_decay"] == 0x48 and addrs[-1] == 0x6C
    assert _rtl_localparams("REG")["status"] == 0x70
