"""Checkpoints written by several machines at once (format version 2): each machine its own
file of pieces, rank 0 the manifest last; loading assembles each array from the pieces.

The machines here are threads of one process that agree through a barrier: the protocol
``save_sharded_checkpoint`` asks of its team (rank 0's text to all, every rank's text to all)
without torch.distributed; tests/test_sharded_eps.py runs it under torchrun."""
from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from l2l import checkpoint as ckpt
from l2l.errors import UserError


class ThreadTeam:
    """``world`` threads saving together: each call is a barrier-separated exchange."""

    def __init__(self, world: int) -> None:
        self.world = world
        self._barrier = threading.Barrier(world)
        self._slots: list = [None] * world

    def member(self, rank: int):
        team = self

        class Member:
            def __init__(self) -> None:
                self.rank, self.world = rank, team.world

            def agree_text(self, text: str) -> str:
                return self.gather_text(text)[0]

            def gather_text(self, text: str) -> list[str]:
                team._slots[rank] = text
                team._barrier.wait(timeout=30)
                out = list(team._slots)
                team._barrier.wait(timeout=30)
                return out
        return Member()


def _save(run, step, arrays: dict[str, np.ndarray], cuts: list[int], world: int, keep: int = 2):
    """Every array split at ``cuts`` (element indices, rank r from cuts[r] to cuts[r+1]: the
    ends are clipped) and saved by ``world`` threads."""
    team, errors = ThreadTeam(world), []

    def machine(rank: int) -> None:
        try:
            pieces, starts = {}, {}
            for name, a in arrays.items():
                lo, hi = min(cuts[rank], a.size), min(cuts[rank + 1], a.size) if rank + 1 < world else a.size
                if hi > lo:
                    pieces[name] = a[lo:hi]
                starts[name] = lo
            ckpt.save_sharded_checkpoint(run, step, pieces, starts, {k: a.size for k, a in arrays.items()},
                                         {"who": "rank 0"} if rank == 0 else {"who": f"rank {rank}"},
                                         team.member(rank), keep=keep)
        except BaseException as exc:  # noqa: BLE001 -- reported by the test
            errors.append(exc)
    threads = [threading.Thread(target=machine, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return errors


ARRAYS = {"layer0.p": np.arange(10, dtype=np.float32), "layer1.p": np.arange(100, 107, dtype=np.float32),
          "layer2.p": np.zeros(0, np.float32)}


def test_three_machines_write_one_checkpoint_read_whole(tmp_path):
    assert _save(tmp_path, 5, ARRAYS, [0, 4, 8], 3) == []
    step_dir = tmp_path / "checkpoints" / "step-00000005"
    files = sorted(p.name for p in step_dir.iterdir())
    assert files == ["meta.json", "shard-00000-of-00003.safetensors", "shard-00001-of-00003.safetensors",
                     "shard-00002-of-00003.safetensors"]
    doc = json.loads((step_dir / "meta.json").read_text())
    assert doc["version"] == 2 and doc["meta"] == {"who": "rank 0"}   # rank 0's meta, once
    loaded = ckpt.load_latest(tmp_path)
    assert loaded.step == 5 and set(loaded.tensors) == set(ARRAYS)
    for name, a in ARRAYS.items():
        assert np.array_equal(loaded.tensors[name], a)


def test_a_damaged_piece_is_one_line(tmp_path):
    assert _save(tmp_path, 1, ARRAYS, [0, 4, 8], 3) == []
    shard = tmp_path / "checkpoints" / "step-00000001" / "shard-00001-of-00003.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with pytest.raises(UserError, match="shard-00001-of-00003.safetensors SHA-256 mismatch"):
        ckpt.load_latest(tmp_path)
    shard.unlink()
    with pytest.raises(UserError, match="incomplete: shard-00001-of-00003.safetensors is missing"):
        ckpt.load_latest(tmp_path)


def test_pieces_that_do_not_tile_an_array_are_refused(tmp_path):
    # rank 1 claims the same elements as rank 0: element 4.. are never written
    assert _save(tmp_path, 2, {"layer0.p": np.arange(10, dtype=np.float32)}, [0, 0, 8], 3) == []
    doc_path = tmp_path / "checkpoints" / "step-00000002" / "meta.json"
    doc = json.loads(doc_path.read_text())
    doc["tensors"]["numels"]["layer0.p"] = 11        # an array longer than its pieces
    doc_path.write_text(json.dumps(doc))
    with pytest.raises(UserError, match="pieces of 10 elements, the array has 11"):
        ckpt.load_latest(tmp_path)


def test_a_machine_that_cannot_read_its_state_fails_the_save_and_leaves_no_step(tmp_path):
    """Rank 1's state cannot be read (its --eps-offload files went away): every machine
    raises the same one line, naming it, and no step (nor temporary directory) is left."""
    team, errors = ThreadTeam(2), []

    def unreadable(key):
        raise OSError(5, "Input/output error")

    def machine(rank: int) -> None:
        a = np.arange(8, dtype=np.float32)
        pieces = {"layer0.p": a[:4]} if rank == 0 else \
            ckpt.LazyArrays({"layer0.p": ((4,), np.dtype(np.float32))}, unreadable)
        try:
            ckpt.save_sharded_checkpoint(tmp_path, 3, pieces, {"layer0.p": 4 * rank}, {"layer0.p": 8}, {},
                                         team.member(rank))
        except UserError as exc:
            errors.append(str(exc))
    threads = [threading.Thread(target=machine, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(errors) == 2 and errors[0] == errors[1] and "machine 1: " in errors[0], errors
    assert "Input/output error" in errors[0] and "\n" not in errors[0]
    assert not ckpt.list_checkpoints(tmp_path) and not list((tmp_path / "checkpoints").iterdir())
