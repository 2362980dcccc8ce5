"""The EPS sharded across machines (``--eps-layout sharded``, the default under torchrun).

R ranks of K workers must give the bits of ONE process of R x K workers: the same
per-step losses, exactly, and the same final fp32 masters (a digest that does not
depend on R). Every run is launched as users launch it: ``torchrun`` on loopback
for the ranks, ``python -m l2l`` for the one process. The one process runs with
``OMP_NUM_THREADS=1``, as torchrun sets it for each of several ranks: torch's CPU
matrix products round differently with another number of threads, which would
change the gradients before the EPS sees them.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from l2l import checkpoint as ckpt
from l2l.distributed import weights_digest
from l2l.eps.shards import BLOCK, ShardLayout
from l2l.metrics import read_metrics

from conftest import ROOT, run_cli, run_torchrun

# d_model 96: a block's entry has about 110k parameters (two shard blocks), the embedding
# 24.6k (one block, so it goes whole to one rank); at R = 3 one rank holds none of a block.
BASE = ["--layers", "2", "--d-model", "96", "--heads", "2", "--seq-len", "16", "--batch-size", "12",
        "--micro-batches", "12", "--eval-every", "0", "--eval-batches", "1", "--no-plot", "--no-progress",
        "--device", "cpu"]


# ------------------------------------------------------------------ the layout

def test_layout_whole_blocks_cover_every_entry_once():
    numels = {0: 0, 1: 5, 2: BLOCK, 3: 3 * BLOCK + 7, 4: 10 * BLOCK, 5: BLOCK + 1}
    for world in (1, 2, 3, 4, 7):
        layout = ShardLayout(numels, world)
        held = [0] * world
        for e, n in numels.items():
            slices = layout.slices(e)
            assert len(slices) == world and slices[0].lo == 0 and slices[-1].hi == n
            for a, b in zip(slices, slices[1:]):
                assert a.hi == b.lo                               # contiguous, in rank order
            for r, s in enumerate(slices):
                assert s.lo % BLOCK == 0 or s.numel == 0           # a block never straddles two ranks
                held[r] += s.numel
            blocks = [-(-s.numel // BLOCK) for s in slices]
            assert max(blocks) - min(blocks) <= 1                   # as even as whole blocks allow
            assert len(layout.owners(e)) == min(world, -(-n // BLOCK))
        assert held == layout.held
    assert ShardLayout(numels, 3).slices(0) == ShardLayout(numels, 3).slices(0)


def test_layout_gives_small_entries_to_the_least_loaded_rank():
    layout = ShardLayout({e: 100 for e in range(6)}, 3)
    assert [layout.owners(e) for e in range(6)] == [[0], [1], [2], [0], [1], [2]]
    assert layout.held == [200, 200, 200]
    big_first = ShardLayout({0: 4 * BLOCK, 1: 10, 2: 10}, 3)   # rank 0 takes the extra block
    assert [s.numel for s in big_first.slices(0)] == [2 * BLOCK, BLOCK, BLOCK]
    assert big_first.owners(1) == [1] and big_first.owners(2) == [2]


def test_layout_refuses_nonsense():
    with pytest.raises(ValueError):
        ShardLayout({0: 1}, 0)


# ------------------------------------------------------------------ runs

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    return {**os.environ, "L2L_DIST_TIMEOUT": "60", "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT / "host")]))}


def _torchrun(ranks: int, *args: str) -> subprocess.CompletedProcess:
    return run_torchrun("--nproc-per-node", str(ranks), "--master-addr", "127.0.0.1",
                        "--master-port", str(_free_port()), "-m", "l2l", "train", *args, env=_env())


def _train(ranks: int, workers: int, out: Path, *args: str) -> dict:
    """``ranks`` machines of ``workers`` workers each (one process when ``ranks`` is 1)."""
    argv = [*BASE, "--devices", str(workers), *(a.format(out=out) for a in args), "--out", str(out)]
    r = run_cli("train", *argv, env={**os.environ, "OMP_NUM_THREADS": "1"}) if ranks == 1 else _torchrun(ranks, *argv)
    assert r.returncode == 0, r.stderr[-3000:]
    return _record(out)


def _record(out: Path) -> dict:
    summary = json.loads((out / "summary.json").read_text())
    saved = ckpt.load_latest(out)
    return {"losses": [m["loss"] for m in read_metrics(out / "metrics.jsonl")],
            "digest": summary["weights_sha256"], "machines": summary["machines_weights_sha256"],
            "collective_bytes": summary.get("collective_bytes_per_step"),
            "saved_digest": weights_digest(saved.tensors), "tensors": dict(saved.tensors)}


def _same(a: dict, b: dict) -> None:
    assert a["losses"] == b["losses"]
    assert a["saved_digest"] == b["saved_digest"]
    for run in (a, b):  # the digest the machines computed is the checkpoint's (one process: none)
        assert run["digest"] in (None, run["saved_digest"])
    for k in a["tensors"]:                      # the moments too, not only the masters the digest covers
        assert np.array_equal(a["tensors"][k].view(np.uint32), b["tensors"][k].view(np.uint32)), k


CASES = {
    # name: (ranks, workers per rank, options)
    "fp32-eager-uneven": (3, 1, ["--steps", "3"]),
    "bf16-tied-strict-clip": (2, 2, ["--steps", "3", "--model", "hf-gpt2", "--precision", "bf16",
                                     "--overflow", "strict", "--clip-grad-norm", "0.5"]),
    # the OpenCL EPS, its state in files: each rank its slices' files
    "opencl-offload": (2, 1, ["--steps", "2", "--eps", "opencl", "--eps-offload", "{out}-eps"]),
    # Lion: one moment per slice, in memory on one rank and in files on the other layout
    "lion-offload": (2, 1, ["--steps", "2", "--optimizer", "lion", "--lr", "1e-3", "--eps-offload", "{out}-eps"]),
    # LAMB on the OpenCL EPS, held steps: a block's entry has a tensor across its two ranks' slices
    # (its norms sum over both), the embedding lies whole on rank 0 and the head on rank 1 (the
    # other joins the sum)
    "lamb-opencl-strict-clip": (2, 1, ["--steps", "2", "--optimizer", "lamb", "--lr", "1e-2", "--eps", "opencl",
                                       "--overflow", "strict", "--clip-grad-norm", "0.5"]),
    # LayerDrop: block 0 left out of steps 1 and 2, both blocks of step 3 (seed 0's draws): the
    # machines skip the same entries' updates and collectives
    "layer-drop": (2, 1, ["--steps", "3", "--layer-drop", "0.5"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_ranks_give_the_bits_of_one_machine(tmp_path, case):
    ranks, workers, args = CASES[case]
    sharded = _train(ranks, workers, tmp_path / "sharded", *args)
    one = _train(1, ranks * workers, tmp_path / "one", *args)
    _same(sharded, one)
    # one digest of the global masters, not one per rank
    assert sharded["machines"] == [sharded["digest"]] == [sharded["saved_digest"]]
    assert sharded["losses"][-1] < sharded["losses"][0]
    if case == "bf16-tied-strict-clip":   # the bytes the machines sent each other: the planner's formula
        shape = BASE[:BASE.index("--eval-every")] + ["--model", "hf-gpt2", "--precision", "bf16", "--device", "cpu"]
        plan = run_cli("plan", *shape, "--devices", str(workers), "--machines", str(ranks), "--flops", "1e9",
                       "--eps-rate", "1e8", "--link-gbps", "0", "--json")
        assert plan.returncode == 0, plan.stderr[-2000:]
        predicted = json.loads(plan.stdout)["prediction"]["collective_bytes"]
        assert predicted > 0 and abs(sharded["collective_bytes"] - predicted) <= 0.01 * predicted
    if "--eps-offload" in args:   # each rank kept its own slices in its own directory
        numels = [sum(json.loads((tmp_path / f"sharded-eps/rank-{r}-of-{ranks}/manifest.json").read_text())
                      ["entries"].values()) for r in range(ranks)]
        assert all(numels) and sum(numels) == sum(t.size for k, t in one["tensors"].items() if k.endswith(".p"))


def test_a_run_saved_at_three_ranks_resumes_at_one_two_and_four(tmp_path):
    """Saved at R = 3 (uneven slices; one rank owns none of some entries), resumed with
    R x K = 12 workers kept: every resume gives the uninterrupted run's bits. And a
    one-process checkpoint resumes at R = 2."""
    steps = ["--save-every", "2"]
    whole = _train(1, 12, tmp_path / "whole", *steps, "--steps", "4")
    _train(3, 4, tmp_path / "saved", *steps, "--steps", "2")
    doc = json.loads((ckpt.load_latest(tmp_path / "saved").path / "meta.json").read_text())
    assert doc["version"] == 2 and [f["file"] for f in doc["tensors"]["shards"]] == \
        [f"shard-0000{r}-of-00003.safetensors" for r in range(3)]   # each machine wrote its slices
    for ranks in (1, 2, 4):
        out = tmp_path / f"resumed-{ranks}"
        subprocess.run(["cp", "-r", str(tmp_path / "saved"), str(out)], check=True)
        _same(_train(ranks, 12 // ranks, out, *steps, "--steps", "4", "--resume"), whole)
    _train(1, 12, tmp_path / "from-one", *steps, "--steps", "2")
    _same(_train(2, 6, tmp_path / "from-one", *steps, "--steps", "4", "--resume"), whole)


def test_lamb_sharded_resumes_with_the_one_machine_bits(tmp_path):
    """LAMB's eager updates at R = 2 (the norms of a tensor split between ranks summed over
    both; a rank with no slice of an entry joining the sum), saved after step 1 and resumed
    at R = 2: the bits of one process of 2 workers run through."""
    lamb = ["--optimizer", "lamb", "--lr", "1e-2", "--save-every", "1"]
    _train(2, 1, tmp_path / "sharded", *lamb, "--steps", "1")
    resumed = _train(2, 1, tmp_path / "sharded", *lamb, "--steps", "2", "--resume")
    one = _train(1, 2, tmp_path / "one", *lamb, "--steps", "2")
    _same(resumed, one)
    assert len(one["losses"]) == 2 and resumed["machines"] == [resumed["saved_digest"]]


def _rank(rank: int, world: int, port: int, argv: list[str], fault: list[str] | None = None) -> subprocess.Popen:
    """One machine as torchrun starts it (its environment), without torchrun's own
    teardown of the others when one dies: what the survivors do is what is tested."""
    env = {**_env(), "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
           "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "L2L_DIST_TIMEOUT": "20"}
    head = ["-m", "l2l"] if fault is None else [str(ROOT / "tests" / "faulty_l2l.py"), *fault]
    return subprocess.Popen([sys.executable, *head, "train", *argv], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_rank_killed_mid_step_stops_the_others_and_the_run_resumes_at_two(tmp_path):
    """SIGKILL one of 3 ranks in a gradient exchange of step 3 (mid-backward): the two
    others exit 1 with one line within the timeout; resumed at R = 2 from the step-2
    checkpoint (R x K = 6 kept), the run gives the uninterrupted run's bits."""
    out = tmp_path / "run"
    argv = [*BASE, "--devices", "2", "--steps", "4", "--save-every", "2", "--out", str(out)]
    entries = 4                                      # exchanges a step: one per entry
    port = _free_port()
    victim_at = 2 * entries + 2                      # the second entry of step 3
    ranks = [_rank(r, 3, port, argv, ["kill-in-exchange", str(victim_at)] if r == 1 else None) for r in range(3)]
    assert ranks[1].wait(timeout=120) == -9
    for r in (0, 2):
        _, err = ranks[r].communicate(timeout=60)   # the timeout is 20 s
        lines = [line for line in err.strip().splitlines() if line]
        assert ranks[r].returncode == 1 and len(lines) == 1, err
        assert f"rank {r} of 3" in lines[0] and "--resume" in lines[0], err
    ranks[1].communicate()
    assert ckpt.load_latest(out).step == 2
    resumed = _train(2, 3, out, *argv[len(BASE) + 2:-2], "--resume")
    _same(resumed, _train(1, 6, tmp_path / "whole", "--steps", "4", "--save-every", "2"))


def test_a_sharded_run_of_a_model_directory_exports_the_one_machine_weights(tmp_path):
    """A Llama directory trained at R = 2: the checkpoint is one file per machine, and
    `l2l export` of the run writes the same weights as the one-process run's export."""
    import torch
    from safetensors.numpy import load_file
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                 tie_word_embeddings=False)).save_pretrained(tmp_path / "llama")
    args = ["--model", str(tmp_path / "llama"), "--steps", "2"]
    sharded = _train(2, 1, tmp_path / "sharded", *args)
    _same(sharded, _train(1, 2, tmp_path / "one", *args))
    step_dir = ckpt.load_latest(tmp_path / "sharded").path
    assert sorted(p.name for p in step_dir.glob("*.safetensors")) == \
        ["shard-00000-of-00002.safetensors", "shard-00001-of-00002.safetensors"]
    exported = {}
    for run in ("sharded", "one"):
        r = run_cli("export", str(tmp_path / run), "--out", str(tmp_path / f"{run}-hf"))
        assert r.returncode == 0, r.stderr[-2000:]
        exported[run] = load_file(str(tmp_path / f"{run}-hf" / "model.safetensors"))
    assert exported["sharded"].keys() == exported["one"].keys()
    for k, a in exported["sharded"].items():
        assert np.array_equal(a, exported["one"][k]), k
