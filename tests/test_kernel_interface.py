"""The kernel sources take the argument order documented in fpga/ARGS.md."""
from __future__ import annotations

import re

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
