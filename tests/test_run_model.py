"""A run of ``--model DIR`` does not depend on where DIR is: it resumes and exports with the
source reached through a symlink, copied elsewhere, named from another working directory,
or deleted (``l2l/run_model.py``), and a directory that is another model is refused.

One training run serves every case: each resumes its own copy of the run directory.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
import transformers

from l2l.checkpoint import load_latest
from l2l.models.pretrained import checkpoint_keys
from l2l.tokenizer import train_bpe

from conftest import run_cli

SEQ = 16


def _model_dir(root: Path) -> tuple[Path, Path]:
    """A tiny Llama written by transformers with a BPE tokenizer beside it, and a text corpus."""
    data = root / "corpus.txt"
    rng = np.random.default_rng(0)
    words = "the relay fetches each layer once while the param server updates the last".split()
    data.write_text("\n".join(" ".join(rng.choice(words, 40)) for _ in range(60)))
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    source = root / "src" / "llama"
    transformers.LlamaForCausalLM(config).save_pretrained(source)
    train_bpe([str(data)], 290, root / "tok")
    for f in (root / "tok").iterdir():
        shutil.copy(f, source / f.name)
    return source, data


def _train(*args: str, cwd: Path, data: Path, steps: int, out: Path, resume: bool = False):
    return run_cli("train", *args, "--data", str(data), "--seq-len", str(SEQ), "--batch-size", "4",
                   "--micro-batches", "2", "--steps", str(steps), "--eval-batches", "1", "--no-plot",
                   "--no-progress", "--plan", "off", "--out", str(out), *(["--resume"] if resume else []), cwd=cwd)


def _losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def _check_export(run: Path, exported: Path, tokenizer: bytes) -> None:
    """transformers loads the export, and its weights are the run's latest master weights."""
    model, info = transformers.AutoModelForCausalLM.from_pretrained(exported, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ck = load_latest(run)
    stack, keys = checkpoint_keys(str(run / "model"))
    for e in range(stack.num_entries):
        flat = torch.from_numpy(ck.tensors[f"layer{e}.p"])
        for slot, key in zip(stack.entry_layout(e)[1].slots, keys[e]):
            assert torch.equal(model.get_parameter(key).detach(), flat[slot.offset:slot.offset + slot.numel]
                               .view(slot.shape)), key
    assert (exported / "tokenizer.json").read_bytes() == tokenizer


def test_resume_and_export_wherever_the_model_directory_is(tmp_path):
    source, data = _model_dir(tmp_path)
    tokenizer = (source / "tokenizer.json").read_bytes()
    runs = tmp_path / "runs"
    r = _train("--model", "llama", cwd=source.parent, data=data, steps=2, out=runs / "base")  # a relative --model
    assert r.returncode == 0, r.stderr[-2000:]
    copy = runs / "base" / "model"
    assert (copy / "config.json").read_bytes() == (source / "config.json").read_bytes()
    assert (copy / "tokenizer.json").read_bytes() == tokenizer
    assert not list(copy.glob("*.safetensors"))  # the weights stay where they are

    link = tmp_path / "link"
    link.symlink_to(source, target_is_directory=True)
    scratch = tmp_path / "scratch" / "llama"
    shutil.copytree(source, scratch)
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(source, elsewhere / "llama")  # the same relative name, another directory
    cases = {  # name: (--model, working directory, export's extra options)
        "symlink": (str(link), tmp_path, []),
        "copy": (str(scratch), tmp_path, ["--model", str(scratch)]),
        "cwd": ("llama", elsewhere, []),
        "deleted": ("llama", source.parent, []),
    }
    for name, (model, cwd, export_options) in cases.items():
        if name == "deleted":
            shutil.rmtree(source)
        run = runs / name
        shutil.copytree(runs / "base", run)
        r = _train("--model", model, cwd=cwd, data=data, steps=4, out=run, resume=True)
        assert r.returncode == 0, (name, r.stderr[-2000:])
        assert _losses(run)[:2] == _losses(runs / "base")
        exported = tmp_path / "exported" / name
        relative_run = Path("..") / "runs" / name if name == "cwd" else run  # the run named from elsewhere
        r = run_cli("export", str(relative_run), "--out", str(exported), *export_options, cwd=cwd)
        assert r.returncode == 0, (name, r.stderr[-2000:])
        _check_export(run, exported, tokenizer)
    # the same trajectory wherever the model was
    for name in cases:
        assert _losses(runs / name) == _losses(runs / "symlink"), name
    assert len(_losses(runs / "symlink")) == 4

    # a directory that is another model is refused, in one line, before anything is written
    other = tmp_path / "other"
    shutil.copytree(scratch, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    shutil.copytree(runs / "base", runs / "other")
    before = sorted(p.name for p in (runs / "other").iterdir())
    r = _train("--model", str(other), cwd=tmp_path, data=data, steps=4, out=runs / "other", resume=True)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "is not the model" in lines[0], r.stderr
    assert sorted(p.name for p in (runs / "other").iterdir()) == before
    assert _losses(runs / "other") == _losses(runs / "base")


def test_checkpoints_that_named_their_model_by_path_still_match():
    """A checkpoint of an older l2l recorded the model directory's path; the layout and config
    still decide, and a differing config or tensor index does not match."""
    from l2l.run_model import same_model
    config = {"model_type": "llama", "config": {"hidden_size": 32}}
    layers = {"layers": [["pre", 10], ["post", 20]]}
    ours = {"config": {**config, "tensors": "abc"}, **layers}
    assert same_model({"config": {"directory": "/gone/llama", **config}, **layers}, ours)
    assert same_model(json.loads(json.dumps(ours)), ours)
    assert not same_model({"config": {**config, "tensors": "abd"}, **layers}, ours)
    assert not same_model({"config": {**config, "config": {"hidden_size": 64}, "tensors": "abc"}, **layers}, ours)
    assert not same_model({"config": {**config, "tensors": "abc"}, "layers": [["pre", 10], ["post", 21]]}, ours)
