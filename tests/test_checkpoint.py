"""Checkpoints must round-trip exactly, detect damage, and survive a kill at any point."""

from __future__ import annotations

import ast
import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import l2l.checkpoint as ck
from l2l.checkpoint import (
    atomic_write_bytes,
    fsync_write_text,
    list_checkpoints,
    load_checkpoint,
    load_latest,
    save_checkpoint,
)
from l2l.errors import UserError


def _tensors(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "layer0.w": rng.standard_normal((4, 3)).astype(np.float32),
        "layer0.adam_m": rng.standard_normal(7).astype(np.float32),
        "tokens_seen": np.array(seed * 1000 + 7, dtype=np.int64),  # 0-d
        "empty": np.zeros((0, 5), dtype=np.float32),
        "ids": np.arange(12, dtype=np.int64).reshape(3, 2, 2),
        "mask": np.array([True, False, True]),
    }


def _meta(step: int) -> dict:
    return {
        "step": step,
        "config": {"d_model": 64, "layers": [1, 2, {"x": None}], "lr": 3e-4, "name": "tiny"},
        "rng": {"state": [2**63 + 5, 17], "pos": 3},
        "data": {"epoch": 1, "offset": 12345},
    }


def _assert_same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert a[k].shape == b[k].shape, k
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def _ckdir(run: Path) -> Path:
    return run / "checkpoints"


def _one_line_user_error(excinfo, *needles: str) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg
    for n in needles:
        assert n in msg, (n, msg)
    return msg


# --------------------------------------------------------------------------
# Round trip, LATEST, pruning


def test_round_trip(tmp_path):
    run = tmp_path / "run"
    t = _tensors(1)
    path = save_checkpoint(run, 123, t, _meta(123))
    assert path == _ckdir(run) / "step-00000123"
    assert sorted(p.name for p in path.iterdir()) == ["meta.json", "tensors.safetensors"]
    assert (_ckdir(run) / "LATEST").read_text() == "step-00000123\n"

    doc = json.loads((path / "meta.json").read_text())
    assert doc["version"] == ck.FORMAT_VERSION and doc["step"] == 123
    assert doc["tensors"]["bytes"] == (path / "tensors.safetensors").stat().st_size
    assert len(doc["tensors"]["sha256"]) == 64

    got = load_latest(run)
    assert got.step == 123 and got.path == path and got.meta == _meta(123)
    _assert_same(got.tensors, t)
    assert got.tensors["tokens_seen"].shape == ()
    got.tensors["layer0.w"][0, 0] = 1.0  # resumed weights must be updatable in place

    again = load_checkpoint(path)
    _assert_same(again.tensors, t)


def test_non_contiguous_and_scalar_inputs(tmp_path):
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    t = {"strided": base[:, ::2], "transposed": base.T, "scalar": np.float32(2.5)}
    save_checkpoint(tmp_path, 0, t, {})
    got = load_latest(tmp_path).tensors
    np.testing.assert_array_equal(got["strided"], base[:, ::2])
    np.testing.assert_array_equal(got["transposed"], base.T)
    assert got["scalar"].shape == () and got["scalar"] == np.float32(2.5)


def test_bad_inputs_leave_nothing(tmp_path):
    with pytest.raises(TypeError):
        save_checkpoint(tmp_path, 1, {"x": np.zeros(2)}, {"bad": object()})
    with pytest.raises(TypeError):
        save_checkpoint(tmp_path, 1, {"x": np.array(["a"], dtype=object)}, {})
    with pytest.raises(TypeError):
        save_checkpoint(tmp_path, 1, {"x": [1, 2]}, {})
    with pytest.raises(ValueError):
        save_checkpoint(tmp_path, -1, {}, {})
    with pytest.raises(ValueError):
        save_checkpoint(tmp_path, 1, {}, {}, keep=0)
    assert load_latest(tmp_path) is None
    assert not _ckdir(tmp_path).exists() or not any(_ckdir(tmp_path).iterdir())


def test_latest_follows_newest_and_keep_prunes(tmp_path):
    assert load_latest(tmp_path) is None
    assert load_latest(tmp_path / "nonexistent") is None
    for step in (10, 20, 30, 40):
        save_checkpoint(tmp_path, step, _tensors(step), _meta(step), keep=2)
        got = load_latest(tmp_path)
        assert got.step == step
        _assert_same(got.tensors, _tensors(step))
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000030", "step-00000040"]
    save_checkpoint(tmp_path, 50, _tensors(50), _meta(50), keep=1)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000050"]
    assert [p.name for p in _ckdir(tmp_path).iterdir() if p.name.startswith(".")] == []


def test_higher_steps_from_abandoned_timeline_are_kept(tmp_path):
    for step in (10, 20, 30):
        save_checkpoint(tmp_path, step, _tensors(step), _meta(step), keep=3)
    save_checkpoint(tmp_path, 15, _tensors(15), _meta(15), keep=2)  # resumed from 10
    assert load_latest(tmp_path).step == 15
    assert [p.name for p in list_checkpoints(tmp_path)] == [
        "step-00000010", "step-00000015", "step-00000020", "step-00000030"
    ]


def test_resave_same_step_replaces(tmp_path):
    save_checkpoint(tmp_path, 5, _tensors(1), _meta(1))
    save_checkpoint(tmp_path, 5, _tensors(2), _meta(2))
    got = load_latest(tmp_path)
    assert got.step == 5 and got.meta == _meta(2)
    _assert_same(got.tensors, _tensors(2))
    assert sorted(p.name for p in _ckdir(tmp_path).iterdir()) == ["LATEST", "step-00000005"]


# --------------------------------------------------------------------------
# Damage detection


def _saved(tmp_path) -> Path:
    save_checkpoint(tmp_path, 10, _tensors(), _meta(10))
    return _ckdir(tmp_path) / "step-00000010"


def test_flipped_byte_in_data_is_detected(tmp_path):
    path = _saved(tmp_path)
    f = path / "tensors.safetensors"
    data = bytearray(f.read_bytes())
    (header_len,) = struct.unpack("<Q", data[:8])
    pos = 8 + header_len + 5  # inside the tensor data, not the header
    assert pos < len(data)
    data[pos] ^= 0x01
    f.write_bytes(bytes(data))
    with pytest.raises(UserError) as e:
        load_latest(tmp_path)
    _one_line_user_error(e, str(path), "corrupt", "SHA-256 mismatch")


def test_truncated_tensor_file_is_detected(tmp_path):
    path = _saved(tmp_path)
    f = path / "tensors.safetensors"
    os.truncate(f, f.stat().st_size - 10)
    with pytest.raises(UserError) as e:
        load_latest(tmp_path)
    _one_line_user_error(e, str(path), "truncated")


@pytest.mark.parametrize(
    "content, needle",
    [
        (b'{"format": "l2l-checkpoint", "vers', "not valid JSON"),
        (b"\xff\xfe garbage", "not valid JSON"),
        (b"[1, 2]", "not an l2l-checkpoint"),
        (b'{"format": "l2l-checkpoint", "version": 99, "step": 10}', "version 99"),
    ],
)
def test_corrupt_meta_json_is_detected(tmp_path, content, needle):
    path = _saved(tmp_path)
    (path / "meta.json").write_bytes(content)
    with pytest.raises(UserError) as e:
        load_latest(tmp_path)
    _one_line_user_error(e, str(path), needle)


def test_meta_json_wrong_hash_or_step_is_detected(tmp_path):
    path = _saved(tmp_path)
    doc = json.loads((path / "meta.json").read_text())
    doc["tensors"]["sha256"] = "0" * 64
    (path / "meta.json").write_text(json.dumps(doc))
    with pytest.raises(UserError, match="SHA-256 mismatch"):
        load_checkpoint(path)
    doc = json.loads((path / "meta.json").read_text())
    doc["step"] = 11
    (path / "meta.json").write_text(json.dumps(doc))
    with pytest.raises(UserError, match="says step 11"):
        load_checkpoint(path)


def test_missing_files_are_detected(tmp_path):
    path = _saved(tmp_path)
    (path / "tensors.safetensors").unlink()
    with pytest.raises(UserError) as e:
        load_latest(tmp_path)
    _one_line_user_error(e, str(path), "tensors.safetensors is missing")
    (path / "meta.json").unlink()
    with pytest.raises(UserError) as e:
        load_latest(tmp_path)
    _one_line_user_error(e, str(path), "meta.json is missing")
    with pytest.raises(UserError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")


def test_latest_pointing_nowhere_or_garbage(tmp_path):
    _saved(tmp_path)
    latest = _ckdir(tmp_path) / "LATEST"
    latest.write_text("step-00000099\n")
    with pytest.raises(UserError) as e:
        load_latest(tmp_path)
    _one_line_user_error(e, str(latest), "step-00000099", "does not exist")
    latest.write_text("../../etc\n")
    with pytest.raises(UserError) as e:
        load_latest(tmp_path)
    _one_line_user_error(e, str(latest), "corrupt")


def test_corrupt_latest_target_does_not_fall_back_silently(tmp_path):
    save_checkpoint(tmp_path, 1, _tensors(1), _meta(1))
    path = save_checkpoint(tmp_path, 2, _tensors(2), _meta(2))
    os.truncate(path / "tensors.safetensors", 100)
    with pytest.raises(UserError, match="truncated"):
        load_latest(tmp_path)


def test_missing_latest_falls_back_to_newest_that_verifies(tmp_path):
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, _tensors(step), _meta(step), keep=3)
    (_ckdir(tmp_path) / "LATEST").unlink()
    with pytest.warns(RuntimeWarning, match="LATEST is missing"):
        assert load_latest(tmp_path).step == 3
    os.truncate(_ckdir(tmp_path) / "step-00000003" / "tensors.safetensors", 50)
    with pytest.warns(RuntimeWarning, match="step-00000003 is truncated"):
        got = load_latest(tmp_path)
    assert got.step == 2
    _assert_same(got.tensors, _tensors(2))
    for step in (1, 2):
        (_ckdir(tmp_path) / f"step-{step:08d}" / "meta.json").write_text("{")
    with pytest.raises(UserError, match="no checkpoint .* verifies"):
        load_latest(tmp_path)


# --------------------------------------------------------------------------
# Simulated crashes


def _good_then(tmp_path) -> dict[str, np.ndarray]:
    save_checkpoint(tmp_path, 1, _tensors(1), _meta(1))
    return _tensors(1)


def _assert_still_step1(tmp_path, good):
    got = load_latest(tmp_path)
    assert got.step == 1 and got.meta == _meta(1)
    _assert_same(got.tensors, good)


def test_failure_during_tensor_write_keeps_previous(tmp_path):
    """The tensor file is half written when producing an array fails (arrays are written one at
    a time): the previous checkpoint stays the latest, and nothing of the new one remains."""
    good = _good_then(tmp_path)
    tensors = _tensors(2)
    names = list(tensors)

    def read(name):
        if name == names[-1]:
            raise OSError("disk full")
        return tensors[name]

    lazy = ck.LazyArrays({k: (v.shape, v.dtype) for k, v in tensors.items()}, read)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, 2, lazy, _meta(2))
    _assert_still_step1(tmp_path, good)
    assert sorted(p.name for p in _ckdir(tmp_path).iterdir()) == ["LATEST", "step-00000001"]


def test_lazy_arrays_are_written_one_at_a_time(tmp_path):
    """A save of lazily made arrays holds about one of them at a time (numpy's allocations
    traced by tracemalloc), and reads back equal to the same arrays saved from a dict."""
    import tracemalloc
    n, size = 24, 1 << 18  # 24 arrays of 1 MiB
    def make(name):
        return np.random.default_rng(int(name[1:])).standard_normal(size, dtype=np.float32)
    specs = {f"a{i}": ((size,), np.dtype(np.float32)) for i in range(n)}
    tracemalloc.start()
    try:
        save_checkpoint(tmp_path / "lazy", 1, ck.LazyArrays(specs, make), _meta(1))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # one array, the file hash's 4 MiB read chunk and the generator: far below a whole copy (24 MiB)
    assert peak < 8 * 2**20, peak
    whole = {k: make(k) for k in specs}
    save_checkpoint(tmp_path / "dict", 1, whole, _meta(1))
    loaded = load_latest(tmp_path / "lazy").tensors
    assert loaded.keys() == whole.keys() and all(np.array_equal(loaded[k], whole[k]) for k in whole)
    same = [(tmp_path / r / "checkpoints" / "step-00000001" / "tensors.safetensors").read_bytes() for r in ("lazy", "dict")]
    assert same[0] == same[1]


def test_failure_at_rename_keeps_previous(tmp_path, monkeypatch):
    good = _good_then(tmp_path)

    def boom(src, dst):
        raise KeyboardInterrupt  # like Ctrl-C at the worst moment

    monkeypatch.setattr(os, "rename", boom)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 2, _tensors(2), _meta(2))
    monkeypatch.undo()
    _assert_still_step1(tmp_path, good)


def test_crash_between_rename_and_latest(tmp_path, monkeypatch):
    good = _good_then(tmp_path)
    real = ck.fsync_write_text

    def fail_latest(path, text):
        if Path(path).name == "LATEST":
            raise OSError("killed")
        real(path, text)

    monkeypatch.setattr(ck, "fsync_write_text", fail_latest)
    with pytest.raises(OSError):
        save_checkpoint(tmp_path, 2, _tensors(2), _meta(2))
    monkeypatch.undo()
    assert (_ckdir(tmp_path) / "step-00000002").is_dir()
    _assert_still_step1(tmp_path, good)  # LATEST is authoritative
    # the next save proceeds normally
    save_checkpoint(tmp_path, 3, _tensors(3), _meta(3), keep=2)
    assert load_latest(tmp_path).step == 3


def test_kill_while_replacing_same_step_recovers_old_copy(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, 5, _tensors(1), _meta(1))
    ckdir = _ckdir(tmp_path)
    # state a SIGKILL between "move old aside" and "move new into place" leaves
    os.rename(ckdir / "step-00000005", ckdir / ".tmp-replaced-step-00000005")
    (ckdir / ".tmp-step-00000005-1-abcd").mkdir()
    got = load_latest(tmp_path)
    assert got.step == 5
    _assert_same(got.tensors, _tensors(1))
    # and without LATEST the orphaned copy is still found
    (ckdir / "LATEST").unlink()
    with pytest.warns(RuntimeWarning):
        assert load_latest(tmp_path).step == 5
    # a new save of that step cleans everything up
    save_checkpoint(tmp_path, 5, _tensors(2), _meta(2))
    _assert_same(load_latest(tmp_path).tensors, _tensors(2))
    assert sorted(p.name for p in ckdir.iterdir()) == ["LATEST", "step-00000005"]


def test_failed_swap_restores_old_dir(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, 5, _tensors(1), _meta(1))
    real = os.rename
    calls = []

    def second_fails(src, dst):
        calls.append(Path(dst).name)
        if len(calls) == 2:
            raise OSError("boom")
        real(src, dst)

    monkeypatch.setattr(os, "rename", second_fails)
    with pytest.raises(OSError):
        save_checkpoint(tmp_path, 5, _tensors(2), _meta(2))
    monkeypatch.undo()
    got = load_latest(tmp_path)
    assert got.path.name == "step-00000005"
    _assert_same(got.tensors, _tensors(1))


def test_stale_tmp_dirs_are_ignored_then_cleaned(tmp_path):
    good = _good_then(tmp_path)
    stale = _ckdir(tmp_path) / ".tmp-step-00000002-999-dead"
    stale.mkdir()
    (stale / "tensors.safetensors").write_bytes(b"partial")
    (_ckdir(tmp_path) / ".tmp-LATEST-999-dead").write_text("step-00000002")
    _assert_still_step1(tmp_path, good)
    save_checkpoint(tmp_path, 2, _tensors(2), _meta(2))
    assert not stale.exists()
    assert sorted(p.name for p in _ckdir(tmp_path).iterdir()) == [
        "LATEST", "step-00000001", "step-00000002"
    ]


# --------------------------------------------------------------------------
# Real SIGKILL mid-save

_CHILD = r"""
import sys, time
import numpy as np
from l2l.checkpoint import save_checkpoint
run_dir, mib = sys.argv[1], int(sys.argv[2])
n = mib * (1 << 20) // 4 // 4
big = {f"layer{i}.w": np.full(n, i + 0.5, np.float32) for i in range(4)}
print("ready", flush=True)
t = time.perf_counter()
save_checkpoint(run_dir, 2, big, {"step": 2}, keep=2)
print(time.perf_counter() - t, flush=True)
"""


def _spawn(run: Path, mib: int) -> subprocess.Popen:
    p = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(run), str(mib)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout.readline().strip() == "ready"
    return p


def test_sigkill_mid_save_keeps_previous(tmp_path):
    mib = 64
    # calibrate: how long does an uninterrupted save take here?
    cal = tmp_path / "calibrate"
    p = _spawn(cal, mib)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 0
    duration = float(out.strip())
    assert load_latest(cal).tensors["layer3.w"][-1] == np.float32(3.5)

    fractions = [0.5, 0.25, 0.75, 0.1, 0.4, 0.6, 0.9, 0.05]
    killed_mid_write = 0
    for attempt, frac in enumerate(fractions * 2):
        run = tmp_path / f"run{attempt}"
        good = _good_then(run)
        p = _spawn(run, mib)
        time.sleep(duration * frac)
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=60)
        p.stdout.close()

        leftovers = [q.name for q in _ckdir(run).iterdir() if q.name.startswith(".tmp-")]
        got = load_latest(run)
        if got.step == 1:
            _assert_same(got.tensors, good)
            assert got.meta == _meta(1)
        else:  # the kill landed after LATEST was replaced: the new one must be whole
            assert got.step == 2
            for i in range(4):
                assert np.all(got.tensors[f"layer{i}.w"] == np.float32(i + 0.5))
        if p.returncode == -signal.SIGKILL and leftovers and got.step == 1:
            killed_mid_write += 1
            # the run carries on: the next save succeeds and removes the debris
            save_checkpoint(run, 3, _tensors(3), _meta(3))
            assert load_latest(run).step == 3
            assert not [q for q in _ckdir(run).iterdir() if q.name.startswith(".tmp-")]
        if killed_mid_write >= 2:
            break
    assert killed_mid_write >= 1, "never managed to kill the child during a save"


def test_no_pickle():
    src = Path(ck.__file__).read_text()
    assert "pickle" not in src  # no import, no np.load(allow_pickle=...), nothing
    tree = ast.parse(src)
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not any(m and m.split(".")[0] in {"pickle", "dill", "cloudpickle", "torch"} for m in imported)


def test_atomic_small_file_helpers(tmp_path):
    f = tmp_path / "metrics.json"
    fsync_write_text(f, '{"a": 1}')
    assert f.read_text() == '{"a": 1}'
    atomic_write_bytes(f, b"\x00\x01")
    assert f.read_bytes() == b"\x00\x01"
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.json"]
