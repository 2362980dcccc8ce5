"""Sliding-window attention as transformers computes it: Mistral's ``sliding_window`` (every
layer) and Qwen2's / Qwen3's ``use_sliding_window`` with ``max_window_layers`` (some layers),
at a ``--seq-len`` four windows long. l2l's loss, through the relay and the plain engine,
equals the transformers model's own on the same batch and checkpoint."""
from __future__ import annotations

import pytest
import torch
import transformers

from l2l.build import build_engine
from l2l.models import build_stack

from conftest import CPU
from test_pretrained import SEQ, SHAPE, _batch, _cfg, _hf_loss_sum, engine_loss_sums, write_checkpoint

WINDOW = 4  # SEQ (16) is four windows
NAMES = ["mistral", "qwen2", "qwen3"]


def _model(name: str):
    kv = dict(num_key_value_heads=2)
    if name == "mistral":
        return transformers.MistralForCausalLM, transformers.MistralConfig(**SHAPE, **kv, sliding_window=WINDOW)
    # layer 0 full attention, layer 1 windowed (as the installed transformers reads max_window_layers)
    window = dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    if name == "qwen2":
        return transformers.Qwen2ForCausalLM, transformers.Qwen2Config(**SHAPE, **kv, **window)
    return transformers.Qwen3ForCausalLM, transformers.Qwen3Config(**SHAPE, **kv, **window, head_dim=16)


@pytest.fixture(scope="session")
def windowed(tmp_path_factory):
    """name -> a tiny checkpoint directory whose config slides a 4-token window."""
    root = tmp_path_factory.mktemp("windowed")
    return {name: write_checkpoint(*_model(name), root / name) for name in NAMES}


def _hf_loss(directory, batch, **config) -> float:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="sdpa", **config)
    with torch.no_grad():
        return float(_hf_loss_sum(model.eval(), batch))


@pytest.mark.parametrize("name", NAMES)
def test_loss_equals_transformers_beyond_the_window(name, windowed):
    directory, batch = windowed[name], _batch()
    want = _hf_loss(directory, batch)
    # the window matters at this length: a window as long as the sequence (full attention,
    # what l2l computed before) gives another loss
    full = _hf_loss(directory, batch, sliding_window=SEQ)
    assert abs(full - want) > 1e-4 * abs(want), (full, want)  # 10x the tolerance below
    for engine_name, got in engine_loss_sums(directory, batch):
        assert got == pytest.approx(want, rel=1e-5), engine_name


def test_relay_trains_like_transformers_beyond_the_window(windowed):
    """Three relay steps of the Qwen2 checkpoint (one full, one windowed layer): each loss
    equals the transformers model's trained with torch.optim.AdamW on the same batches, so
    the window holds in the backward's recompute too."""
    directory = windowed["qwen2"]
    cfg = _cfg(directory, lr=1e-3, beta1=0.9, beta2=0.99, adam_eps=1e-8, weight_decay=0.01)
    engine = build_engine(cfg, build_stack(cfg.model_config(), cfg.seed), CPU)
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="sdpa").train()
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
    try:
        for step in range(3):
            batch = _batch(seed=step)
            ours = engine.train_step(batch, step).loss
            opt.zero_grad()
            loss = _hf_loss_sum(hf, batch) / batch.num_targets
            loss.backward()
            opt.step()
            assert ours == pytest.approx(float(loss.detach()), rel=1e-5), step
    finally:
        engine.close()


def test_two_relay_workers_slide_the_window_too(windowed):
    """--devices 2: the second worker's stack is a skeleton of the first (``LayerStack.skeleton``);
    its blocks ask for their masks as the first's do, so the step's loss (each worker half the
    micro-batches) is transformers' own."""
    directory, batch = windowed["mistral"], _batch()
    want = _hf_loss(directory, batch) / batch.num_targets
    cfg = _cfg(directory, devices=2)
    engine = build_engine(cfg, build_stack(cfg.model_config(), cfg.seed), CPU)
    try:
        assert engine.train_step(batch, 0).loss == pytest.approx(want, rel=1e-5)
    finally:
        engine.close()
