"""Tests for the data room: corpus loading, splitting and batch sampling."""
import json
import os

import numpy as np
import pytest
import torch

from l2l.data import Batch, BatchSampler, load_corpus
from l2l.errors import UserError
from l2l.models.config import MASK_TOKEN
from l2l.models.stack import IGNORE_INDEX


def _tokens(n=5000, seed=0):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def _same(a: Batch, b: Batch) -> bool:
    return torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)


def _one_line_user_error(fn):
    with pytest.raises(UserError) as info:
        fn()
    msg = str(info.value)
    assert msg and "\n" not in msg
    return msg


# -- sampler --------------------------------------------------------------


@pytest.mark.parametrize("objective", ["causal", "mlm"])
def test_two_samplers_agree(objective):
    a = BatchSampler(_tokens(), 16, 4, objective, seed=3)
    b = BatchSampler(_tokens(), 16, 4, objective, seed=3)
    for _ in range(5):
        assert _same(a.next(), b.next())
    c = BatchSampler(_tokens(), 16, 4, objective, seed=4)
    assert not _same(a.batch(0), c.batch(0))


def test_batch_is_pure_in_step():
    s = BatchSampler(_tokens(), 16, 4, "mlm", seed=1)
    forward = [s.batch(i) for i in range(6)]
    backward = [s.batch(i) for i in reversed(range(6))][::-1]
    assert all(_same(x, y) for x, y in zip(forward, backward))
    assert not _same(forward[0], forward[1])
    assert s.next_step == 0  # batch() does not move the stream


def test_state_dict_resumes_the_same_sequence():
    s = BatchSampler(_tokens(), 16, 4, "causal", seed=7)
    for _ in range(3):
        s.next()
    state = json.loads(json.dumps(s.state_dict()))
    expected = [s.next() for _ in range(4)]

    resumed = BatchSampler(_tokens(), 16, 4, "causal", seed=0)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == {"seed": 7, "next_step": 3}
    assert all(_same(x, resumed.next()) for x in expected)


def test_causal_targets_are_inputs_shifted():
    s = BatchSampler(_tokens(), 32, 8, "causal", seed=0)
    b = s.batch(0)
    assert b.inputs.shape == b.targets.shape == (8, 32)
    assert b.inputs.dtype == b.targets.dtype == torch.long
    assert torch.equal(b.inputs[:, 1:], b.targets[:, :-1])
    assert b.num_targets == 8 * 32


def test_mlm_masking():
    tokens = _tokens(50_000)
    s = BatchSampler(tokens, 100, 64, "mlm", seed=0)
    ins, tgts = [], []
    for step in range(10):
        b = s.batch(step)
        assert b.inputs.shape == b.targets.shape == (64, 100)
        ins.append(b.inputs)
        tgts.append(b.targets)
    inputs, targets = torch.cat(ins), torch.cat(tgts)
    picked = targets != IGNORE_INDEX
    assert picked.sum(dim=1).min() >= 1
    assert abs(picked.float().mean().item() - 0.15) < 0.02
    assert (targets[picked] >= 0).all() and (targets[picked] < 256).all()
    # Unpicked positions are untouched and MASK only appears where picked.
    assert (inputs[~picked] < 256).all()
    masked = inputs == MASK_TOKEN
    assert not (masked & ~picked).any()
    n = picked.sum().item()
    assert abs(masked.sum().item() / n - 0.8) < 0.03
    kept = picked & (inputs == targets)
    # 10% kept plus ~1/256 of the 10% random bytes that hit the original.
    assert abs(kept.sum().item() / n - 0.1) < 0.03


def test_mlm_short_sequence_still_has_a_target():
    b = BatchSampler(_tokens(), 3, 16, "mlm", seed=0).batch(0)
    assert ((b.targets != IGNORE_INDEX).sum(dim=1) >= 1).all()


def test_fixed_batches_repeat_and_ignore_training_position():
    s = BatchSampler(_tokens(), 16, 4, "mlm", seed=2)
    first = s.fixed_batches(3)
    for _ in range(5):
        s.next()
    again = s.fixed_batches(3)
    assert len(first) == 3
    assert all(_same(x, y) for x, y in zip(first, again))
    assert not _same(first[0], s.batch(0))


def test_split_micro_batches_concatenate_back():
    b = BatchSampler(_tokens(), 16, 8, "mlm", seed=0).batch(0)
    parts = b.split(4)
    assert len(parts) == 4 and all(p.inputs.shape == (2, 16) for p in parts)
    assert torch.equal(torch.cat([p.inputs for p in parts]), b.inputs)
    assert torch.equal(torch.cat([p.targets for p in parts]), b.targets)
    assert sum(p.num_targets for p in parts) == b.num_targets
    with pytest.raises(ValueError):
        b.split(3)


def test_sampler_rejects_too_small_input():
    _one_line_user_error(lambda: BatchSampler(_tokens(16), 16, 2, "causal"))
    BatchSampler(_tokens(16), 16, 2, "mlm")  # mlm needs no extra byte
    _one_line_user_error(lambda: BatchSampler(_tokens(), 16, 2, "bogus"))


# -- corpus ---------------------------------------------------------------


def test_stdlib_default_corpus():
    c = load_corpus(None, max_bytes=1 << 20)
    assert c.train.dtype == c.val.dtype == np.uint8
    assert c.train.size > 0 and c.val.size > 0
    # The cap counts the newline separators too.
    assert c.train.size + c.val.size + 1 <= 1 << 20
    assert "stdlib" in c.description and "\n" not in c.description
    again = load_corpus(None, max_bytes=1 << 20)
    assert np.array_equal(c.train, again.train) and np.array_equal(c.val, again.val)


def test_single_file_split_is_tail(tmp_path):
    data = bytes(range(256)) * 40
    f = tmp_path / "text.txt"
    f.write_bytes(data)
    c = load_corpus(str(f))
    assert c.num_files == 1
    assert c.train.tobytes() + c.val.tobytes() == data
    assert c.val.size == int(len(data) * 0.05)
    capped = load_corpus(str(f), max_bytes=1000)
    assert capped.train.size + capped.val.size == 1000


def test_folder_skips_binary_and_hidden(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"alpha " * 100)
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01\x02" * 100)
    (tmp_path / ".hidden").write_bytes(b"HIDDEN")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "x").write_bytes(b"HIDDEN")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_bytes(b"beta " * 100)
    c = load_corpus(str(tmp_path))
    assert c.num_files == 2
    everything = c.train.tobytes() + c.val.tobytes()
    assert b"\x00" not in everything and b"HIDDEN" not in everything
    assert b"alpha" in everything and b"beta" in everything


def test_folder_split_by_document_is_disjoint_and_stable(tmp_path):
    for i in range(60):
        (tmp_path / f"doc{i:03d}.txt").write_bytes(f"<{i:03d}>".encode() * 20)
    c = load_corpus(str(tmp_path))
    train, val = c.train.tobytes(), c.val.tobytes()
    assert train and val
    in_train = {i for i in range(60) if f"<{i:03d}>".encode() in train}
    in_val = {i for i in range(60) if f"<{i:03d}>".encode() in val}
    assert in_train.isdisjoint(in_val) and in_train | in_val == set(range(60))

    # Adding files elsewhere does not move existing documents between splits.
    for i in range(60, 90):
        (tmp_path / f"doc{i:03d}.txt").write_bytes(f"<{i:03d}>".encode() * 20)
    grown = load_corpus(str(tmp_path))
    assert all(f"<{i:03d}>".encode() in grown.val.tobytes() for i in in_val)
    assert all(f"<{i:03d}>".encode() in grown.train.tobytes() for i in in_train)


def test_tiny_folder_still_has_both_splits(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"a" * 50)
    (tmp_path / "b.txt").write_bytes(b"b" * 50)
    c = load_corpus(str(tmp_path))
    assert c.train.size == 50 and c.val.size == 50


def test_missing_path(tmp_path):
    _one_line_user_error(lambda: load_corpus(str(tmp_path / "nope")))


def test_empty_file(tmp_path):
    f = tmp_path / "empty.txt"
    f.write_bytes(b"")
    _one_line_user_error(lambda: load_corpus(str(f)))


def test_empty_folder(tmp_path):
    _one_line_user_error(lambda: load_corpus(str(tmp_path)))
    (tmp_path / "only.bin").write_bytes(b"\x00" * 10)
    _one_line_user_error(lambda: load_corpus(str(tmp_path)))


def test_too_small_input(tmp_path):
    f = tmp_path / "x.txt"
    f.write_bytes(b"x")
    _one_line_user_error(lambda: load_corpus(str(f)))
    f.write_bytes(b"hello world, not much here")
    c = load_corpus(str(f))
    _one_line_user_error(lambda: BatchSampler(c.train, 128, 2, "causal", name="train"))
    _one_line_user_error(lambda: BatchSampler(c.val, 8, 2, "causal", name="val"))


def test_unreadable_file(tmp_path, monkeypatch):
    f = tmp_path / "locked.txt"
    f.write_bytes(b"secret " * 100)

    def deny(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("builtins.open", deny)
    msg = _one_line_user_error(lambda: load_corpus(str(f)))
    assert "Permission denied" in msg


# -- the cache and its memory maps -------------------------------------------

MAPPED_PROBE = r"""
import sys
import numpy as np
from l2l import hostmem
from l2l.data import BatchSampler, load_corpus
before = hostmem.memory_status()["RssAnon"]
corpus = load_corpus(sys.argv[1], max_bytes=64 << 20)
sampler = BatchSampler(corpus.train, 64, 8, seed=0)
for step in range(20):
    sampler.batch(step)
print(corpus.train.size, hostmem.memory_status()["RssAnon"] - before)
"""


def test_the_corpus_is_mapped_from_the_cache_not_held(tmp_path):
    """A run holds the pages it samples, not the data set: 24 MiB of data, and the anonymous
    resident set of a process that loaded it and drew batches grows by far less."""
    import subprocess
    import sys
    data = tmp_path / "big.txt"
    data.write_bytes(np.random.default_rng(0).integers(32, 127, 24 << 20, dtype=np.uint8).tobytes())
    env = {**__import__("os").environ, "L2L_CACHE": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-c", MAPPED_PROBE, str(data)], capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    size, grown = (int(x) for x in r.stdout.split())
    assert size > 20 << 20
    assert grown < 4 << 20, f"the anonymous resident set grew by {grown / 2**20:.1f} MiB"


def test_a_cache_that_cannot_be_written_still_loads(tmp_path, monkeypatch):
    f = tmp_path / "text.txt"
    f.write_bytes(bytes(range(256)) * 40)
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("L2L_CACHE", str(tmp_path / "file" / "cache"))  # under a file: mkdir fails
    c = load_corpus(str(f))
    assert c.train.tobytes() + c.val.tobytes() == f.read_bytes()
    # the directory is there, but the file cannot be written (its temporary name is taken)
    monkeypatch.setenv("L2L_CACHE", str(tmp_path / "cache"))
    load_corpus(str(f))
    (entry,) = (tmp_path / "cache" / "tokens").glob("*.safetensors")
    entry.unlink()
    (entry.parent / f".{entry.name}.{os.getpid()}.tmp").mkdir()
    c = load_corpus(str(f))
    assert c.train.tobytes() + c.val.tobytes() == f.read_bytes()
    assert not entry.exists()


def test_a_damaged_cache_entry_is_made_again(tmp_path, monkeypatch):
    monkeypatch.setenv("L2L_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "text.txt"
    f.write_bytes(bytes(range(256)) * 40)
    first = load_corpus(str(f))
    train, val = np.array(first.train), np.array(first.val)  # copies: the maps share the file
    del first
    (entry,) = (tmp_path / "cache" / "tokens").glob("*.safetensors")
    whole = entry.read_bytes()
    entry.write_bytes(whole[:-7])  # truncated: the header's byte ranges no longer fit
    again = load_corpus(str(f))
    assert np.array_equal(train, again.train) and np.array_equal(val, again.val)
    assert entry.read_bytes() == whole
    with pytest.raises(ValueError):  # the arrays are the cache file's pages, read-only
        again.train[0] = 1
