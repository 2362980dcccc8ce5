"""The EPS with its state on disk (l2l.eps.disk_tier, l2l.eps.offload_backend), through its API.

The same pushes into an EagerParamServer give the same bits (p, m, v, device copies, step
counts) with the state in files as in memory, for the numpy and OpenCL backends, fp32 and
bf16, through skipped (non-finite) updates and held (strict) steps; the wrapper holds at
most window + window + 1 entries; every read checks the file's header and size; the files
are O_DIRECT where the filesystem allows, and buffered with their pages dropped where not.
"""
from __future__ import annotations

import errno
import os
import shutil
import uuid

import numpy as np
import pytest

from l2l.eps import OptimizerHyper, EagerParamServer, HlsCsimBackend, NumpyBackend, OpenCLBackend
from l2l.eps.disk_tier import BLOCK, DiskTier, entry_file, file_bytes
from l2l.eps.offload_backend import OffloadedBackend
from l2l.errors import UserError

from faulty_l2l import disk_usage_reporting

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

# entries 0..4 as a stack's layers (sizes around a 4096-byte block, 1 element, 9000),
# entry 5 shared by two users (a tied embedding): its update waits for both contributions
LAYERS = {0: 1, 1: 1024, 2: 1025, 3: 9000, 4: 333}
SHARED = 5
NUMELS = {**LAYERS, SHARED: 700}
STEPS = 5
HELD = {2}        # steps run held and committed (--overflow strict), with clipping
NONFINITE = {(1, 3), (2, 2), (3, SHARED)}  # (step, entry) pushed a NaN: skipped (eager) or whole step (held)


def run_id() -> str:
    return uuid.uuid4().hex


def drive(backend, precision: str) -> dict:
    """Train the entries for STEPS steps in backward order; every copy, the state and step counts."""
    rng = np.random.default_rng(2024)
    eps = EagerParamServer(backend, OptimizerHyper(lr=1e-2, weight_decay=0.1), copy_dtype=precision,
                           grad_dtype=precision)
    for e, n in NUMELS.items():
        eps.add_layer(e, rng.standard_normal(n).astype(np.float32), users=2 if e == SHARED else 1)
    seen = {"copies": [], "state": [], "steps": []}

    def push(e, contributor=0):
        g = eps.gradient_inbox(e, contributor)
        vals = rng.standard_normal(g.shape[0]).astype(np.float32)
        if (t, e) in NONFINITE and contributor == 0:
            vals[g.shape[0] // 2] = np.nan
        g[...] = vals.astype(g.dtype)
        eps.push_gradient(e, contributor, divisor=2.0)

    for t in range(STEPS):
        if t in HELD:
            eps.hold()
        push(SHARED, 0)  # the post stage's contribution comes first ...
        for e in sorted(LAYERS, reverse=True):
            push(e)
        push(SHARED, 1)  # ... the pre stage's last
        if t in HELD:
            eps.commit(max_norm=0.5)
        seen["copies"].append({e: eps.fetch(e).copy() for e in NUMELS})
        seen["steps"].append({e: eps.step_count(e) for e in NUMELS})
        if t in (1, STEPS - 1):
            seen["state"].append(eps.state_tensors())
    eps.close()
    return seen


def assert_same_run(got: dict, want: dict) -> None:
    assert got["steps"] == want["steps"]
    for t, (g, w) in enumerate(zip(got["copies"], want["copies"])):
        for e in NUMELS:
            assert g[e].tobytes() == w[e].tobytes(), f"step {t} copy of entry {e}"
    for g, w in zip(got["state"], want["state"]):
        assert g.keys() == w.keys()
        for k in w:
            assert g[k].tobytes() == w[k].tobytes(), k


def make_inner(name: str):
    if name == "hls-csim":
        ok, why = HlsCsimBackend.availability()
        if not ok:  # g++ is a requirement of the suite, as for the HLS C-simulation tests
            pytest.fail(f"the HLS C-simulation backend is not usable here: {why}", pytrace=False)
        return HlsCsimBackend()
    return NumpyBackend() if name == "numpy" else OpenCLBackend()


@pytest.fixture(scope="module")
def in_memory():
    """The in-RAM runs the disk runs must match, per (backend, precision)."""
    return {}


@pytest.mark.parametrize("backend", ["numpy", "opencl", "hls-csim"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_disk_tier_gives_the_same_bits(tmp_path, backend, precision, in_memory):
    key = (backend, precision)
    if key not in in_memory:
        in_memory[key] = drive(make_inner(backend), precision)
    want = in_memory[key]
    assert any(not all(v == STEPS for v in s.values()) for s in want["steps"]), "no update was skipped"
    tier = DiskTier(tmp_path / "eps", run_id(), NUMELS)
    wrapped = OffloadedBackend(make_inner(backend), tier, window=2)
    got = drive(wrapped, precision)
    assert_same_run(got, want)
    assert wrapped.reads_ahead > wrapped.reads_on_demand > 0  # the window foresaw most updates


def test_window_bounds_the_memory_held(tmp_path):
    """At most window read ahead + window waiting to be written + the one updating, whatever
    the number of entries: counted as the tier's slab memory alive at its peak."""
    n, entries, window = 5000, 12, 2
    tier = DiskTier(tmp_path / "eps", run_id(), {e: n for e in range(entries)})
    wrapped = OffloadedBackend(NumpyBackend(), tier, window=window)
    eps = EagerParamServer(wrapped, OptimizerHyper())
    rng = np.random.default_rng(1)
    for e in range(entries):
        eps.add_layer(e, rng.standard_normal(n).astype(np.float32))
    for step in range(4):
        for e in reversed(range(entries)):
            eps.gradient_inbox(e)[...] = rng.standard_normal(n).astype(np.float32)
            eps.push_gradient(e, divisor=1.0)
        eps.synchronize()
        assert tier.live_bytes <= 2 * window * file_bytes(n)
    state = eps.state_tensors()  # a checkpoint reads one entry at a time from disk
    assert len(state) == 3 * entries
    eps.close()
    assert tier.peak_live_bytes <= (2 * window + 1) * file_bytes(n), tier.peak_live_bytes / file_bytes(n)
    assert wrapped.reads_on_demand == 1 and wrapped.reads_ahead == 4 * entries - 1  # only the very first


def test_expect_reads_ahead_in_the_order_given(tmp_path):
    tier = DiskTier(tmp_path / "eps", run_id(), {e: 100 for e in range(6)})
    wrapped = OffloadedBackend(NumpyBackend(), tier, window=2)
    eps = EagerParamServer(wrapped, OptimizerHyper())
    for e in range(6):
        eps.add_layer(e, np.ones(100, np.float32))
    for _ in range(2):
        eps.hold()
        for e in reversed(range(6)):
            eps.gradient_inbox(e)[...] = 1.0
            eps.push_gradient(e, divisor=1.0)
        eps.commit()  # ascending: 0, 1, ... 5, announced through expect()
        eps.synchronize()
    eps.close()
    assert wrapped.reads_on_demand == 0 and wrapped.reads_ahead == 12


def _write_tier(directory, rid, numels=None):
    numels = numels or {0: 10, 1: 2000}
    tier = DiskTier(directory, rid, numels)
    wrapped = OffloadedBackend(NumpyBackend(), tier)
    for e, n in numels.items():
        wrapped.allocate(e, np.arange(n, dtype=np.float32))
    wrapped.close()
    return numels


def _one_line(exc_info, *needles):
    msg = str(exc_info.value)
    assert "\n" not in msg, msg
    for n in needles:
        assert n in msg, msg


def test_files_have_the_documented_layout(tmp_path):
    rid = run_id()
    _write_tier(tmp_path, rid)
    raw = (tmp_path / entry_file(1)).read_bytes()
    assert len(raw) == file_bytes(2000) == BLOCK + 3 * 8192
    assert raw[:8] == b"L2LTIER1" and rid.encode() in raw[:BLOCK]
    p = np.frombuffer(raw[BLOCK:BLOCK + 8000], "<f4")
    assert np.array_equal(p, np.arange(2000, dtype=np.float32))
    assert raw[BLOCK + 8000:] == bytes(len(raw) - BLOCK - 8000)  # padding and zero moments
    assert b"pickle" not in raw and (tmp_path / "manifest.json").read_text().count(rid) == 1


def test_bad_state_files_are_one_line_and_untouched(tmp_path, monkeypatch):
    rid = run_id()
    numels = _write_tier(tmp_path, rid)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    other = run_id()
    with pytest.raises(UserError) as info:  # the manifest of another run
        DiskTier(tmp_path, other, numels)
    _one_line(info, "holds the EPS state of another run", rid)
    path = tmp_path / entry_file(1)
    with open(path, "r+b") as f:  # truncated
        f.truncate(5000)
    with pytest.raises(UserError) as info:
        DiskTier(tmp_path, rid, numels)
    _one_line(info, str(path), f"truncated: 5000 of {file_bytes(2000)} bytes")
    path.write_bytes(before[path.name])
    (tmp_path / "manifest.json").unlink()  # no manifest: the files' headers still tell
    with pytest.raises(UserError) as info:
        DiskTier(tmp_path, other, numels)
    _one_line(info, f"belongs to run {rid}, this run is {other}")
    (tmp_path / "manifest.json").write_bytes(before["manifest.json"])
    damaged = bytearray(before[path.name])
    damaged[20] ^= 1
    path.write_bytes(bytes(damaged))
    with pytest.raises(UserError) as info:
        DiskTier(tmp_path, rid, numels)
    _one_line(info, "CRC")
    path.write_bytes(before[path.name])
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    # not enough free space: the filesystem reports 1 GiB (as tests/faulty_l2l.py free-bytes does)
    monkeypatch.setattr(shutil, "disk_usage", disk_usage_reporting(2**30))
    with pytest.raises(UserError) as info:
        DiskTier(tmp_path / "new", rid, {0: 2**29})
    _one_line(info, "needs 6.00 GiB more", "1.00 GiB free")
    DiskTier(tmp_path, rid, numels)  # this run's own files take no more space
    # a read checks too: a file cut short under a running tier
    tier = DiskTier(tmp_path, rid, numels)
    with open(path, "r+b") as f:
        f.truncate(BLOCK + 100)
    with pytest.raises(UserError) as info:
        tier.read(1)
    _one_line(info, f"truncated: {BLOCK + 100} of")
    tier.close()


def test_o_direct_is_used_where_the_filesystem_takes_it(tmp_path):
    tier = DiskTier(tmp_path, run_id(), {0: 3000})
    tier.prepare()
    slab = tier.slab(0)
    slab.arrays[0][...] = 7.0
    tier.store(slab)
    assert tier.uses_direct(0)
    fdinfo = open(f"/proc/self/fdinfo/{tier.fd(0)}").read()
    flags = int(next(line for line in fdinfo.splitlines() if line.startswith("flags:")).split()[1], 8)
    assert flags & os.O_DIRECT
    assert np.all(tier.read(0).arrays[0] == 7.0)
    tier.close()


def test_buffered_fallback_drops_its_pages(tmp_path, monkeypatch):
    """A filesystem refusing O_DIRECT (EINVAL, as tmpfs does): buffered I/O, and every read
    and write ends with POSIX_FADV_DONTNEED (writes after fdatasync)."""
    real_open, calls = os.open, []

    def no_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, *args)

    def fadvise(fd, offset, length, advice):
        calls.append(advice)
    monkeypatch.setattr(os, "open", no_direct)
    monkeypatch.setattr(os, "posix_fadvise", fadvise)
    tier = DiskTier(tmp_path, run_id(), {0: 3000})
    wrapped = OffloadedBackend(NumpyBackend(), tier)
    wrapped.allocate(0, np.full(3000, 2.0, np.float32))
    assert not tier.uses_direct(0) and calls == [os.POSIX_FADV_DONTNEED]
    assert np.all(tier.read(0).arrays[0] == 2.0)
    assert calls == [os.POSIX_FADV_DONTNEED] * 2
    wrapped.close()


def test_a_failed_write_surfaces_at_close(tmp_path, monkeypatch):
    tier = DiskTier(tmp_path, run_id(), {0: 100})
    wrapped = OffloadedBackend(NumpyBackend(), tier)
    eps = EagerParamServer(wrapped, OptimizerHyper())
    eps.add_layer(0, np.ones(100, np.float32))

    def broken(slab):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(tier, "store", broken)
    eps.gradient_inbox(0)[...] = 1.0
    eps.push_gradient(0, divisor=1.0)
    eps.synchronize()
    with pytest.raises(OSError, match="No space"):
        eps.close()


def test_a_write_failing_mid_run_is_raised_once_as_itself(tmp_path, monkeypatch):
    """A disk error in a write behind an update ends the run once, as the OSError it is (the
    CLI's one line for the environment), at the next call into the EPS; the reads queued
    behind it and close() do not raise it again."""
    tier = DiskTier(tmp_path, run_id(), {e: 100 for e in range(4)})
    eps = EagerParamServer(OffloadedBackend(NumpyBackend(), tier, window=1), OptimizerHyper())
    for e in range(4):
        eps.add_layer(e, np.ones(100, np.float32))

    def broken(slab):
        raise OSError(errno.EIO, "Input/output error")
    monkeypatch.setattr(tier, "store", broken)
    raised = []
    for e in (3, 2, 1, 0):
        try:
            eps.gradient_inbox(e)[...] = 1.0
            eps.push_gradient(e, divisor=1.0)
            eps.synchronize()
        except OSError as exc:
            raised.append(exc)
            break
    assert len(raised) == 1 and raised[0].errno == errno.EIO
    eps.close()  # quiet: the error was raised


def test_a_file_damaged_mid_run_is_one_line(tmp_path):
    """A state file changed under a running tier: the update that reads it fails, and the
    relay's next fetch raises the tier's one-line UserError (not a worker traceback)."""
    tier = DiskTier(tmp_path, run_id(), {0: 100, 1: 100})
    eps = EagerParamServer(OffloadedBackend(NumpyBackend(), tier), OptimizerHyper())
    for e in (0, 1):
        eps.add_layer(e, np.ones(100, np.float32))
    with open(tier.path(0), "r+b") as f:
        f.seek(12)
        f.write(b"f" * 32)
    for e in (1, 0):
        eps.gradient_inbox(e)[...] = 1.0
        eps.push_gradient(e, divisor=1.0)
    with pytest.raises(UserError) as info:
        eps.fetch(0)
    _one_line(info, str(tier.path(0)), "damaged header")
    eps.close()
