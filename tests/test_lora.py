"""LoRA over a streamed frozen base (``--lora-rank``), against peft itself.

The tiny Llama is written by the test with ``save_pretrained`` in bf16, so l2l's bf16 store of
the base is lossless and peft's model, loaded in fp32, computes with the same base weights.
Both start from one PEFT adapter directory (peft's own ``save_pretrained``; ``--lora-init``),
its B set away from zero so that A's gradients are not zero from the first step.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

import ml_dtypes
import numpy as np
import peft
import pytest
import torch
import transformers

from conftest import CPU, run_cli
from l2l.build import build_engine
from l2l.checkpoint import load_latest
from l2l.config import TrainConfig
from l2l.data import Batch
from l2l.lora.build import build_lora_stack, initial_adapters
from l2l.models import FlatLayout

VOCAB, SEQ = 300, 16
TARGETS = ["down_proj", "q_proj", "v_proj"]
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.99, adam_eps=1e-8, weight_decay=0.01)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    """A tiny Llama (grouped-query attention, untied) saved in bf16."""
    out = tmp_path_factory.mktemp("lora") / "llama"
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # norms away from their init, so a wrong mapping shows
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    model.to(torch.bfloat16).save_pretrained(out)
    return out


def _peft_model(base_dir: Path, adapter: Path | None = None):
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter is not None:
        return peft.PeftModel.from_pretrained(base, adapter, is_trainable=True)
    return base


@pytest.fixture(scope="module")
def adapter_dir(base_dir, tmp_path_factory) -> Path:
    """peft's own adapter directory over ``base_dir``: rank 4, alpha 16, B drawn away from zero."""
    torch.manual_seed(1)
    model = peft.get_peft_model(_peft_model(base_dir), peft.LoraConfig(r=4, lora_alpha=16, target_modules=TARGETS))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.02)
    out = tmp_path_factory.mktemp("lora") / "adapter"
    model.save_pretrained(out)
    return out


def _batch(step: int, batch: int = 4) -> Batch:
    x = torch.randint(0, 256, (batch, SEQ + 1), generator=torch.Generator().manual_seed(step))
    return Batch(x[:, :-1].contiguous(), x[:, 1:].contiguous())


def _peft_loss(model, batch: Batch) -> torch.Tensor:
    logits = model(batch.inputs).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch.targets.reshape(-1))


def _cfg(base_dir: Path, **kw) -> TrainConfig:
    return TrainConfig(model=str(base_dir), seq_len=SEQ, batch_size=4, micro_batches=2, progress=False, eps="numpy",
                       **{**HYPER, **kw}).check()


def test_the_adapters_start_as_peft_starts_them():
    """A kaiming-uniform (a = sqrt(5)) and B zeros, drawn as peft's reset_lora_parameters draws them."""
    linear = torch.nn.Sequential()
    linear.add_module("q_proj", torch.nn.Linear(12, 10, bias=False))
    model = peft.inject_adapter_in_model(peft.LoraConfig(r=3, target_modules=["q_proj"]), linear)
    layout = FlatLayout.of(model)  # the adapters only: the base is frozen
    assert [s.name for s in layout.slots] == ["q_proj.lora_A.default.weight", "q_proj.lora_B.default.weight"]
    torch.manual_seed(7)
    model.q_proj.reset_lora_parameters("default", True)
    assert np.array_equal(initial_adapters(layout, 7), layout.flatten(model))


def test_training_equals_peft_with_adamw(base_dir, adapter_dir):
    """20 relay steps (2 micro-batches, fp32) equal peft's model trained with torch.optim.AdamW."""
    cfg = _cfg(base_dir, lora_init=str(adapter_dir))
    stack = build_lora_stack(cfg, cfg.seed)
    assert stack.layers[0].layout.numel == 0 and stack.layers[-1].layout.numel == 0  # pre, post: nothing to train
    assert stack.frozen.store and all(a.dtype == ml_dtypes.bfloat16 for a in stack.frozen.store.values())
    engine = build_engine(cfg, stack, CPU)
    reference = _peft_model(base_dir, adapter_dir)
    trained = [p for p in reference.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["adam_eps"],
                            weight_decay=HYPER["weight_decay"])
    try:
        for step in range(20):
            batch = _batch(step)
            ours = engine.train_step(batch, step).loss
            opt.zero_grad()
            theirs = _peft_loss(reference, batch)
            theirs.backward()
            opt.step()
            assert abs(ours - theirs.item()) < 1e-5, (step, ours, theirs.item())
        ours = engine.evaluate([_batch(99)])
        with torch.no_grad():
            assert abs(ours - _peft_loss(reference, _batch(99)).item()) < 1e-5
    finally:
        engine.close()


def _train(tmp_path: Path, name: str, base_dir: Path, *extra: str) -> Path:
    out = tmp_path / name
    r = run_cli("train", "--model", str(base_dir), "--seq-len", str(SEQ), "--batch-size", "4", "--micro-batches", "2",
                "--eval-batches", "1", "--no-plot", "--no-progress", "--out", str(out), *extra)
    assert r.returncode == 0, r.stderr[-2000:]
    return out


def _losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def _l2l_loss_of_checkpoint(run: Path, batch: Batch) -> float:
    """l2l's evaluation of ``batch`` with the run's latest adapters (its checkpoint, loaded)."""
    ck = load_latest(run)
    cfg = TrainConfig.from_record(ck.meta["config"])
    engine = build_engine(cfg, build_lora_stack(cfg, cfg.seed), CPU)
    try:
        engine.load_state(ck.tensors, ck.meta["engine"])
        return engine.evaluate([batch])
    finally:
        engine.close()


def test_train_resume_and_export_from_the_command_line(base_dir, tmp_path):
    """``l2l train --model DIR --lora-rank R`` (peft's defaults for the rest), resumed, exported: the
    adapter loads with PeftModel.from_pretrained and the merged model with transformers, and
    both give l2l's loss."""
    whole = _train(tmp_path, "whole", base_dir, "--lora-rank", "4", "--steps", "4", "--lr", "1e-2")
    half = _train(tmp_path, "half", base_dir, "--lora-rank", "4", "--steps", "2", "--lr", "1e-2",
                  "--schedule-steps", "4")
    half = _train(tmp_path, "half", base_dir, "--lora-rank", "4", "--steps", "4", "--lr", "1e-2", "--resume")
    assert _losses(half) == _losses(whole)
    ck = load_latest(whole)
    assert ck.meta["signature"]["config"]["lora"] == {"rank": 4, "alpha": 8.0, "targets": ["q_proj", "v_proj"],
                                                      "dropout": 0.0}  # peft's LoraConfig defaults for llama
    # the EPS holds the adapters only: one entry per block, A (4 x in) and B (out x 4) of q and v
    assert sorted(k for k in ck.tensors if k.endswith(".p")) == ["layer1.p", "layer2.p"]
    assert ck.tensors["layer1.p"].size == 4 * 64 + 64 * 4 + 4 * 64 + 32 * 4

    batch = _batch(123)
    ours = _l2l_loss_of_checkpoint(whole, batch)
    r = run_cli("export", str(whole), "--out", str(tmp_path / "adapter"))
    assert r.returncode == 0, r.stderr[-2000:]
    loaded = peft.PeftModel.from_pretrained(_peft_model(base_dir), tmp_path / "adapter")
    assert loaded.peft_config["default"].r == 4 and loaded.peft_config["default"].lora_alpha == 8
    with torch.no_grad():
        assert abs(_peft_loss(loaded, batch).item() - ours) < 1e-6
    trained = [t for k, t in loaded.state_dict().items() if "lora_B" in k]
    assert trained and all(t.abs().max() > 0 for t in trained)  # B moved from peft's zeros

    r = run_cli("export", str(whole), "--out", str(tmp_path / "merged"), "--merge")
    assert r.returncode == 0, r.stderr[-2000:]
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    with torch.no_grad():
        assert abs(_peft_loss(merged, batch).item() - ours) < 1e-5


def test_bad_lora_input_is_one_line(base_dir, adapter_dir, tmp_path):
    flags = ["--seq-len", str(SEQ), "--batch-size", "2", "--micro-batches", "1", "--steps", "1", "--no-progress"]
    cases = [
        (["--model", str(base_dir), "--lora-rank", "4", "--lora-targets", "q_proj,nope"], "--lora-targets nope"),
        (["--model", str(base_dir), "--lora-rank", "33", "--lora-targets", "k_proj"], "at most 32"),
        (["--model", "gpt", "--lora-rank", "4"], "model directory"),
        (["--model", str(base_dir), "--lora-rank", "4", "--engine", "plain"], "--engine l2l"),
        (["--model", str(base_dir), "--lora-alpha", "8"], "--lora-alpha needs --lora-rank"),
        (["--model", str(base_dir), "--lora-rank", "4", "--lora-base-dtype", "fp8"], "--lora-base-dtype"),
        (["--model", str(base_dir), "--lora-rank", "4", "--eps-offload", str(tmp_path / "off")], "--eps-offload"),
        (["--model", str(base_dir), "--lora-rank", "4", "--lora-targets", "embed_tokens"], "Embedding"),
        (["--model", str(base_dir), "--lora-init", str(adapter_dir), "--lora-rank", "8"], "differs"),
        (["--model", str(base_dir), "--lora-init", str(tmp_path)], "adapter_config.json"),
    ]
    for args, needle in cases:
        r = run_cli("train", *args, *flags, "--out", str(tmp_path / "out"))
        assert r.returncode == 2, (args, r.stderr[-1000:])
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0], (args, r.stderr)
        assert not (tmp_path / "out" / "metrics.jsonl").exists()


def _fit(*extra: str) -> dict:
    r = run_cli("plan", "--fit", "--device", "cuda", "--device-memory", "80", "--host-memory", "64",
                "--d-model", "4096", "--heads", "32", "--json", *extra)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)


def test_the_planner_fits_a_base_four_times_larger():
    """2 bytes a frozen base parameter and no state, against AdamW's 12 and the device copy's."""
    full, lora = _fit(), _fit("--lora-rank", "16")
    assert lora["params"] >= 4 * full["params"] and lora["binding"] == full["binding"] == "host"
    assert "--lora-rank 16" in lora["train"] and lora["train"].startswith("l2l train --model DIR ")


def test_a_tied_head_exports_as_an_adapter_not_merged(tmp_path):
    """An adapter on a tied output embedding trains and exports for peft; --merge, which would
    change the input embedding too, is refused in one line."""
    base = tmp_path / "tied"
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=True)).to(torch.bfloat16).save_pretrained(base)
    run = _train(tmp_path, "run", base, "--lora-rank", "2", "--lora-targets", "lm_head,q_proj", "--steps", "2",
                 "--lr", "1e-2")
    r = run_cli("export", str(run), "--out", str(tmp_path / "adapter"))
    assert r.returncode == 0, r.stderr[-2000:]
    loaded = peft.PeftModel.from_pretrained(_peft_model(base), tmp_path / "adapter")
    batch = _batch(5)
    with torch.no_grad():
        assert abs(_peft_loss(loaded, batch).item() - _l2l_loss_of_checkpoint(run, batch)) < 1e-6
    r = run_cli("export", str(run), "--out", str(tmp_path / "merged"), "--merge")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "tied" in r.stderr, r.stderr
    assert not (tmp_path / "merged").exists()


def test_a_frozen_parameter_without_a_frozen_store_is_refused():
    """Outside a LoRA run a parameter with requires_grad False has no weights to bind: one line."""
    from l2l.errors import UserError
    from l2l.eps import EagerParamServer, NumpyBackend, OptimizerHyper
    from l2l.models import ModelConfig, build_stack
    from l2l.relay.engine import RelayEngine
    stack = build_stack(ModelConfig(layers=1, d_model=16, heads=2, seq_len=8), 0)
    next(stack.layers[1].module.parameters()).requires_grad_(False)
    eps = EagerParamServer(NumpyBackend(), OptimizerHyper())
    try:
        with pytest.raises(UserError, match="requires_grad False"):
            RelayEngine(stack, eps, CPU, micro_batches=1)
    finally:
        eps.close()


def test_the_frozen_store_holds_the_base_once_in_its_dtype(base_dir):
    """Every base weight once, in --lora-base-dtype (2 bytes a parameter), nothing of it in the EPS."""
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir)
    for dtype, np_dtype in (("bf16", ml_dtypes.bfloat16), ("fp16", np.float16)):
        stack = build_lora_stack(_cfg(base_dir, lora_rank=2, lora_base_dtype=dtype), 0)
        assert {a.dtype for a in stack.frozen.store.values()} == {np.dtype(np_dtype)}
        assert stack.frozen.numel == sum(p.numel() for p in base.parameters())
        assert stack.frozen.nbytes == 2 * stack.frozen.numel
        assert stack.num_params == 2 * (2 * 64 * 2 + 2 * (64 + 32))  # q (64 -> 64) and v (64 -> 32), 2 blocks


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_frozen_base_streams_through_the_cuda_transport(base_dir, adapter_dir, precision):
    """On CUDA the base goes to the device as the EPS's weights go: from pinned memory on the
    copy-in stream, a layer ahead (``tests/fake_cuda.py`` runs the CUDA transport's code on the
    CPU, each copy as late as CUDA allows and its destination poisoned until then; pageable
    memory is an error there). The same bits as the CPU transport's zero-copy views, no copy of
    freed memory, no CPU wait on the relay's thread."""
    from fake_cuda import FakeCuda
    from transport_mutants import name_streams
    from l2l.build import hyper_of
    from l2l.eps import EagerParamServer, NumpyBackend
    from l2l.relay.engine import RelayEngine
    from l2l.relay.pinned import PinnedRegistry
    from l2l.relay.transport import CudaTransport

    cfg = _cfg(base_dir, lora_init=str(adapter_dir), precision=precision)

    def run(fake):
        transport, alloc = None, {}
        if fake is not None:
            transport = CudaTransport(CPU, cuda=fake, pinned=PinnedRegistry())
            name_streams(transport)
            alloc = {"host_alloc": transport.host_alloc}
        eps = EagerParamServer(NumpyBackend(), hyper_of(cfg), copy_dtype=precision, grad_dtype=precision, **alloc)
        engine = RelayEngine(build_lora_stack(cfg, cfg.seed), eps, CPU, micro_batches=2, precision=precision,
                             transport=transport)
        try:
            with fake if fake is not None else contextlib.nullcontext():
                losses = [engine.train_step(_batch(step), step).loss for step in range(3)]
            return losses, engine.master_weights()
        finally:
            engine.close()

    fake = FakeCuda()
    (want, want_w), (got, got_w) = run(None), run(fake)
    assert fake.errors == [] and fake.pending() == 0 and fake.copies > 0
    assert got == want
    assert all(np.array_equal(a, b) for a, b in zip(got_w, want_w))
