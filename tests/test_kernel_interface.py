"""The kernel sources take the argument order documented in fpga/ARGS.md."""
from __future__ import annotations

import re
from pathlib import Path

from l2l.eps.contract import StepScalars
from l2l.eps.opencl_backend import kernel_source

SCALARS = list(StepScalars.names())


def _params(source: str, kernel: str) -> list[str]:
    """Parameter names of ``kernel`` in an OpenCL source written with the EPS_* macros."""
    macro = {"eps_check": "EPS_CHECK", "eps_update": "EPS_UPDATE", "eps_copy": "EPS_COPY"}[kernel]
    body = re.search(rf"#define {macro}\([\w, ]+\)(.*?)\{{", source, re.S).group(1)
    signature = body[body.index("(") + 1:body.rindex(")")]
    return [re.sub(r"[\s\\]+", " ", p).strip().split(" ")[-1].lstrip("*") for p in signature.split(",")]


def test_opencl_kernels_follow_the_shared_order():
    src = kernel_source()
    assert _params(src, "eps_check") == ["g", "finite", "n", "k", "inv_scale"]
    assert _params(src, "eps_update") == ["gr", "p", "m", "v", "copy", "finite", "n", "k", *SCALARS]
    assert _params(src, "eps_copy") == ["p", "copy", "n"]
    assert SCALARS == ["decay", "b1", "omb1", "b2", "omb2", "inv_bc2_sqrt", "eps", "neg_step", "inv_scale"]


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


def _rtl_register_map() -> list[tuple[int, str]]:
    """(address, argument) of the RTL kernel's AXI4-Lite arguments, from its ADDR_* localparams."""
    src = (ROOT / "fpga" / "rtl" / "l2l_axil_ctrl.v").read_text()
    regs = re.findall(r"localparam\s*(?:\[[^\]]*\])?\s*ADDR_(\w+)\s*=\s*\d*'h([0-9A-Fa-f]+)\s*;", src)
    return sorted((int(addr, 16), name.lower()) for name, addr in regs)


def test_opencl_hls_and_rtl_take_one_argument_order():
    """The update kernel's arguments, read from each source: the OpenCL C macro, the HLS
    C++ top function and the RTL kernel's register map -- one order, not a list kept twice."""
    cl = _params(kernel_source(), "eps_update")
    hls = _hls_update_params()
    regs = _rtl_register_map()
    rtl = [name for _, name in regs]
    assert cl == hls == rtl, (cl, hls, rtl)
    assert cl == ["gr", "p", "m", "v", "copy", "finite", "n", "k", *SCALARS]
    # the ap_ctrl_hs encoding: arguments from 0x10, buffers as 64-bit addresses, scalars as 32 bits
    addrs = [a for a, _ in regs]
    assert addrs[0] == 0x10
    buffers = ["gr", "p", "m", "v", "copy", "finite"]
    for (a, name), (b, _) in zip(regs, regs[1:]):
        assert b - a == (8 if name in buffers else 4), (name, hex(a), hex(b))
