"""The disk tier's call log (``IoLedger.calls``) and what :func:`timeline` makes of it: how
much of the time reads and writes were under way together, each direction's rate alone and
overlapped, the bytes a second while any call was under way (docs/disk-tier.md)."""
from __future__ import annotations

import threading
import uuid

import pytest

from l2l.eps.disk_tier import DiskTier, IoLedger, timeline

CALLS = [("read", 0.0, 2.0, 200), ("write", 1.0, 3.0, 100), ("read", 4.0, 5.0, 100)]


def test_timeline_of_known_calls():
    t = timeline(CALLS)
    assert t["span_s"] == 5.0 and t["busy_s"] == 4.0
    assert t["read_busy_s"] == 3.0 and t["write_busy_s"] == 2.0 and t["both_s"] == 1.0
    r, w = t["read"], t["write"]
    assert (r["bytes"], r["calls"], r["s"], r["bytes_per_s"]) == (300, 2, 3.0, 100.0)
    # the first read: its second half beside the write; the second read alone
    assert (r["alone_bytes"], r["alone_s"], r["alone_bytes_per_s"]) == (200, 2.0, 100.0)
    assert (r["overlapped_bytes"], r["overlapped_s"], r["overlapped_bytes_per_s"]) == (100, 1.0, 100.0)
    assert (w["alone_bytes_per_s"], w["overlapped_bytes_per_s"]) == (50.0, 50.0)
    assert (r["call_rate_min"], r["call_rate_median"], r["call_rate_max"]) == (100.0, 100.0, 100.0)
    assert t["busy_bytes_per_s"] == 400 / 4.0


def test_timeline_cuts_calls_at_the_window():
    t = timeline(CALLS, 1.5, 4.5)
    assert t["span_s"] == 3.0 and t["busy_s"] == 2.0 and t["both_s"] == 0.5
    assert t["read"]["bytes"] == pytest.approx(100)   # 50 of the first read, 50 of the second
    assert t["write"]["bytes"] == pytest.approx(75)   # 1.5 of its 2 seconds
    assert t["write"]["alone_s"] == pytest.approx(1.0) and t["write"]["overlapped_s"] == pytest.approx(0.5)
    empty = timeline([], 0.0, 1.0)
    assert empty["busy_s"] == 0 and empty["busy_bytes_per_s"] is None and empty["read"]["bytes_per_s"] is None


def test_the_tier_logs_every_call_of_its_two_threads(tmp_path):
    numels = {e: 50_000 for e in range(6)}
    tier = DiskTier(tmp_path / "eps", uuid.uuid4().hex, numels)
    tier.prepare()
    for e in numels:
        tier.store(tier.slab(e))
    before = len(tier.io.calls)

    def reads():
        for e in numels:
            tier.read(e)

    def writes():
        for e in numels:
            tier.store(tier.slab(e))
    threads = [threading.Thread(target=reads), threading.Thread(target=writes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    calls = tier.io.calls
    tier.close()
    size = tier.layout.file_bytes(50_000)
    assert before == len(numels) and len(calls) == 3 * len(numels)
    assert all(op in ("read", "write") and a < b and n == size for op, a, b, n in calls)
    ends = [c[2] for c in calls]
    assert ends == sorted(ends)  # booked as each call ends
    led = tier.io.as_dict()
    assert led["calls_logged"] == len(calls) and led["calls_dropped"] == 0
    t = timeline(calls)
    for op in ("read", "write"):
        assert t[op]["bytes"] == pytest.approx(led[f"{op}_bytes"])
        assert t[op]["s"] == pytest.approx(led[f"{op}_s"])
        assert t[op]["alone_s"] + t[op]["overlapped_s"] == pytest.approx(t[op]["s"])
    assert t["busy_s"] <= led["read_s"] + led["write_s"] + 1e-9


def test_the_log_is_bounded():
    led = IoLedger()
    led.MAX_CALLS = 3
    for k in range(5):
        led.add(k % 2 == 1, 0, 10, float(k), k + 0.5)
    assert len(led.calls) == 3 and led.calls_dropped == 2
    d = led.as_dict()
    assert (d["read_bytes"], d["write_bytes"], d["calls_logged"], d["calls_dropped"]) == (30, 20, 3, 2)
    assert d["read_s"] == pytest.approx(1.5)
