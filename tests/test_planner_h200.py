"""The planner's CUDA device figure against the device peaks an H200 measured.

The measurements are ``bench/gpu_check.py`` and ``bench/gpu_memory_peak.py`` runs kept in
``docs/gpu-runs/h200-2026-12-04`` (``torch.cuda.max_memory_allocated`` over a step, torch
2.11 + CUDA 13). The plan a user sizes a run by must never promise less device memory than
a step takes, and should not waste much: every measured peak lies between 90% of the
planner's figure and the figure itself.
"""
from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import replace

import pytest

from conftest import ROOT
from l2l.planner import predict

RESULTS = ROOT / "docs" / "gpu-runs" / "h200-2026-12-04"


def _script(name: str):
    """A bench/ script as a module (once; its dataclasses need it in sys.modules)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def _measured() -> list[tuple[str, object, int]]:
    """(label, config, measured device peak) of every relay row the H200 runs recorded."""
    check = _script("gpu_check")
    planned = {(r.section, r.name): r.cfg for r in check.plan(False, 1.0, check.Machine())}
    out = []
    for path in sorted(RESULTS.glob("*-eps.json")):
        for section, s in json.loads(path.read_text())["sections"].items():
            for row in s.get("rows", []):
                if row.get("status") != "ok" or row.get("engine") != "l2l" or not row.get("device_peak_bytes"):
                    continue
                if section == "largest":
                    cfg = replace(planned[("largest", next(n for (sec, n) in planned if sec == "largest"))],
                                  layers=int(row["row"].split("=")[1]))
                else:
                    cfg = planned[(section, row["row"])]
                out.append((f"{path.stem}: {section}: {row['row']}", cfg, row["device_peak_bytes"]))
    peak = _script("gpu_memory_peak")
    configs = peak.configs(False)
    for row in json.loads((RESULTS / "memory-peak.json").read_text()):
        out.append((f"memory-peak: {row['config']}", configs[row["config"]], row["max_allocated"]))
    return out


MEASURED = _measured()


def test_every_h200_run_is_here():
    assert len(MEASURED) >= 15  # 8 memory rows, 3 throughput, 1 batch, 2 overlap, 2 largest... and the peaks


@pytest.mark.parametrize("label,cfg,measured", MEASURED, ids=[m[0] for m in MEASURED])
def test_planned_device_bytes_cover_the_measured_peak(label, cfg, measured):
    machine = _script("gpu_check").Machine()
    planned = predict(replace(cfg, engine="l2l"), machine.rates(cfg)).device_total_bytes
    assert measured <= planned <= measured / 0.9, (
        f"{label}: planned {planned / 2**20:.0f} MiB, measured {measured / 2**20:.0f} MiB")
