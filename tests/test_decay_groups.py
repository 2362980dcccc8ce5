"""Weight decay by parameter groups, as Hugging Face's ``Trainer`` makes them.

The groups come from transformers' own ``Trainer.get_decay_parameter_names`` on the whole
Hugging Face model, and the runs are ``l2l train`` on the command line, relay and plain
engine, checked step by step against the HF model trained by ``torch.optim.AdamW`` with
those groups.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from l2l.checkpoint import load_latest
from l2l.data import BatchSampler, load_corpus
from l2l.lr_schedule import lr_at
from l2l.models import ModelConfig, build_stack
from l2l.models.pretrained import checkpoint_keys
from l2l.tokenizer import load_tokenizer

from conftest import adamw_with_trainer_groups, run_cli
from test_pretrained import ALL, SEQ, _families, _hf, _hf_loss_sum, _write

STEPS, BATCH, MICRO = 20, 4, 2
HYPER = dict(lr=2e-3, beta1=0.9, beta2=0.99, adam_eps=1e-8, weight_decay=0.1, warmup_steps=4, min_lr_ratio=0.1)


def _decayed_keys(directory: Path, decay_groups: bool = True) -> set[str]:
    """The checkpoint names of the tensors l2l's layouts put below their entry's decay boundary."""
    stack, keys = checkpoint_keys(str(directory), decay_groups=decay_groups)
    out = set()
    for e in range(stack.num_entries):
        layout = stack.entry_layout(e)[1]
        assert all(s.offset >= layout.decayed for s in layout.slots if s.offset + s.numel > layout.decayed)
        out |= {key for s, key in zip(layout.slots, keys[e]) if s.offset < layout.decayed}
    return out


@pytest.mark.parametrize("name", ALL)
def test_the_groups_are_trainers(name, tmp_path, trainer_decay_names):
    """Every family: l2l decays exactly the tensors Trainer decays (biases and norms not, embeddings
    and a tied embedding yes), and ``--weight-decay-all`` every tensor."""
    directory = _write(tmp_path, name)
    hf = _hf(name, directory)
    every = {k for k, _ in hf.named_parameters()}  # a tied tensor once, by its first name
    want = trainer_decay_names(hf) & every  # Trainer lists a tied tensor under each of its names
    assert want != every  # the family has something Trainer leaves undecayed
    assert _decayed_keys(directory) == want
    assert _decayed_keys(directory, decay_groups=False) == every


def test_the_built_in_gpts_groups_are_trainers(trainer_decay_names):
    stack = build_stack(ModelConfig(layers=2, d_model=32, heads=2, seq_len=16), 0, materialize=True)
    whole = torch.nn.ModuleDict({str(i): layer.module for i, layer in enumerate(stack.layers)})
    want = trainer_decay_names(whole)
    got = {f"{i}.{s.name}" for i, layer in enumerate(stack.layers) for s in layer.layout.slots
           if s.offset < layer.layout.decayed}
    assert got == want and 0 < len(want) < len(list(whole.parameters()))


def reference(directory: Path, data: Path, make_optimizer, hyper: dict) -> tuple[list[float], dict[str, np.ndarray]]:
    """Hugging Face's model trained by ``make_optimizer(model)`` on the batches and learning
    rates of ``l2l train`` with ``hyper``: per-step losses and the final weights."""
    hf = _hf("qwen2", directory).train()
    named = dict(hf.named_parameters())
    opt = make_optimizer(hf)
    corpus = load_corpus(str(data), tokenizer=load_tokenizer(None, str(directory)))
    sampler = BatchSampler(corpus.train, SEQ, BATCH, "causal", seed=0, name="train")
    losses = []
    for step in range(STEPS):
        lr = lr_at(step, lr=hyper["lr"], warmup_steps=hyper["warmup_steps"], total_steps=STEPS,
                   min_lr_ratio=hyper["min_lr_ratio"])
        for group in opt.param_groups:
            group["lr"] = lr
        batch = sampler.next()
        opt.zero_grad()
        loss = _hf_loss_sum(hf, batch) / batch.num_targets
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, {k: p.detach().numpy().copy() for k, p in named.items()}


def train_flags(directory: Path, data: Path, out: Path, hyper: dict, steps: int = STEPS) -> list[str]:
    """``l2l train`` of that model on that corpus with ``hyper``, as the references train it."""
    return ["train", "--model", str(directory), "--data", str(data), "--seq-len", str(SEQ), "--batch-size",
            str(BATCH), "--micro-batches", str(MICRO), "--steps", str(steps), "--eval-every", "0",
            "--eval-batches", "1", "--no-plot", "--out", str(out),
            *(f"--{k.replace('_', '-')}={v}" for k, v in hyper.items())]


def qwen2_and_corpus(tmp: Path) -> tuple[Path, Path]:
    """A tiny Qwen2 (biases on q, k, v: a bias group as well as the norms) and a corpus."""
    directory = _write(tmp, "qwen2")
    data = tmp / "corpus.txt"
    rng = np.random.default_rng(0)
    data.write_text("\n".join(" ".join(rng.choice(["alpha", "beta", "gamma", "delta", "eps"], 12))
                              for _ in range(400)))
    return directory, data


def train_losses(out: Path) -> list[float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def _flags(directory: Path, data: Path, out: Path) -> list[str]:
    return train_flags(directory, data, out, HYPER)


@pytest.fixture(scope="module")
def qwen2_run(tmp_path_factory, trainer_decay_names):
    """The model and corpus, and torch.optim.AdamW with Trainer's groups on them."""
    directory, data = qwen2_and_corpus(tmp_path_factory.mktemp("groups"))
    adamw = lambda hf: adamw_with_trainer_groups(  # noqa: E731
        hf, trainer_decay_names(hf), weight_decay=HYPER["weight_decay"], lr=HYPER["lr"],
        betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["adam_eps"])
    return directory, data, reference(directory, data, adamw, HYPER)


@pytest.mark.parametrize("engine", ["l2l", "plain"])
def test_twenty_steps_equal_torch_adamw_with_trainers_groups(engine, qwen2_run, tmp_path):
    directory, data, (want_losses, want_weights) = qwen2_run
    out = tmp_path / engine
    r = run_cli(*_flags(directory, data, out), "--engine", engine)
    assert r.returncode == 0, r.stderr[-3000:]
    losses = train_losses(out)
    assert len(losses) == STEPS
    for step, (got, want) in enumerate(zip(losses, want_losses)):
        assert got == pytest.approx(want, rel=1e-5), step
    # the final weights: all together within 1e-5, each tensor within 1e-4 (the least-moved drift
    # most, relatively); a decayed norm or bias would be off by about 2e-3 (20 steps of lr * 0.1)
    stack, keys = checkpoint_keys(str(out / "model"))
    saved = load_latest(out)
    diff = total = 0.0
    for e in range(stack.num_entries):
        flat = saved.tensors[f"layer{e}.p"]
        for slot, key in zip(stack.entry_layout(e)[1].slots, keys[e]):
            got = flat[slot.offset:slot.offset + slot.numel].reshape(slot.shape).astype(np.float64)
            want = want_weights[key].astype(np.float64)
            assert np.linalg.norm(got - want) <= 1e-4 * np.linalg.norm(want), key
            diff, total = diff + np.sum((got - want) ** 2), total + np.sum(want ** 2)
    assert (diff / total) ** 0.5 <= 1e-5


def test_resume_refuses_another_grouping(qwen2_run, tmp_path):
    directory, data, _ = qwen2_run
    out = tmp_path / "run"
    flags = _flags(directory, data, out)
    flags[flags.index("--steps") + 1] = "2"
    assert run_cli(*flags).returncode == 0
    flags[flags.index("--steps") + 1] = "3"
    r = run_cli(*flags, "--resume", "--weight-decay-all")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "weight_decay_all was False, now True" in r.stderr and "--weight-decay-all" in r.stderr
    r = run_cli(*flags, "--resume")
    assert r.returncode == 0, r.stderr[-2000:]
