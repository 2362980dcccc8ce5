"""Local Hugging Face checkpoints in: ``--model DIR`` for Llama (tied and untied), Mistral,
Qwen2, Qwen3, GPT-2 and BERT, and ``l2l export`` back out.

Each test writes its tiny checkpoint itself with ``save_pretrained`` (random init,
safetensors; one sharded), so nothing comes from a hub.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from l2l.build import build_engine
from l2l.config import TrainConfig
from l2l.data import Batch, _mask
from l2l.models import build_stack
from l2l.models.hf_version import dtype_kwarg

from conftest import CPU, adamw_with_trainer_groups, run_cli
from shared_runs import cli_once, named_master_weights


VOCAB, SEQ = 300, 16
MASK_ID = VOCAB - 1  # the tiny BERT's [MASK]
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=64, tie_word_embeddings=False)
ALL = ["llama-gqa", "llama-tied", "llama-rope-scaled", "mistral", "qwen2", "qwen3", "gpt2", "bert"]
TIED = {"llama-tied": ("model.embed_tokens.weight", "lm_head.weight"),
        "gpt2": ("transformer.wte.weight", "lm_head.weight"),
        "bert": ("bert.embeddings.word_embeddings.weight", "cls.predictions.decoder.weight")}


def _families():
    from transformers import (BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel, LlamaConfig,
                              LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                              Qwen3Config, Qwen3ForCausalLM)
    return {
        "llama-gqa": (LlamaForCausalLM, LlamaConfig(**SHAPE, num_key_value_heads=2)),
        "llama-tied": (LlamaForCausalLM, LlamaConfig(**{**SHAPE, "tie_word_embeddings": True}, num_key_value_heads=2)),
        "llama-rope-scaled": (LlamaForCausalLM, LlamaConfig(**SHAPE, num_key_value_heads=4,
                                                            rope_scaling={"rope_type": "linear", "factor": 2.0})),
        "mistral": (MistralForCausalLM, MistralConfig(**SHAPE, num_key_value_heads=2)),
        "qwen2": (Qwen2ForCausalLM, Qwen2Config(**SHAPE, num_key_value_heads=2)),
        "qwen3": (Qwen3ForCausalLM, Qwen3Config(**SHAPE, num_key_value_heads=2, head_dim=16)),
        # GPT-2 and BERT tie their embeddings by default; no dropout, so training is deterministic
        "gpt2": (GPT2LMHeadModel, GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                             bos_token_id=0, eos_token_id=0)),
        "bert": (BertForMaskedLM, BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, intermediate_size=96, max_position_embeddings=64,
                                             hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
    }


def _write(tmp: Path, name: str, **save) -> Path:
    return write_checkpoint(*_families()[name], tmp / name, **save)


def write_checkpoint(cls, config, out: Path, **save) -> Path:
    """A seeded model of ``cls`` and ``config``, saved to ``out`` with ``save_pretrained``."""
    torch.manual_seed(0)
    model = cls(config)
    with torch.no_grad():  # biases and norms away from their init, so a wrong mapping shows
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    model.save_pretrained(out, **save)
    return out


def _batch(seed: int = 0, batch: int = 4, name: str = "llama-gqa") -> Batch:
    """Causal: next-token targets; BERT: 15% of the tokens masked as the data pipeline masks them."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (batch, SEQ + 1), generator=g)
    if name == "bert":
        inputs, targets = _mask(x[:, :SEQ].numpy(), np.random.default_rng(seed), MASK_ID, VOCAB)
        return Batch(torch.from_numpy(inputs), torch.from_numpy(targets))
    return Batch(x[:, :-1].contiguous(), x[:, 1:].contiguous())


def _hf(name: str, directory: Path, **kw):
    auto = transformers.AutoModelForMaskedLM if name == "bert" else transformers.AutoModelForCausalLM
    return auto.from_pretrained(directory, **kw)


def _hf_loss_sum(model, batch: Batch) -> torch.Tensor:
    logits = model(batch.inputs).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch.targets.reshape(-1),
                                             reduction="sum")


def _cfg(directory: Path, **kw) -> TrainConfig:
    shape = {"seq_len": SEQ, "batch_size": 4, "micro_batches": 4, **kw}
    return TrainConfig(model=str(directory), progress=False, **shape).check()



def engine_loss_sums(directory, batch):
    """(engine, summed loss of ``batch``) for the relay and the plain engine on ``directory``."""
    for engine_name in ("l2l", "plain"):
        cfg = _cfg(directory, engine=engine_name)
        engine = build_engine(cfg, build_stack(cfg.model_config(), cfg.seed), CPU)
        try:
            yield engine_name, engine.evaluate([batch]) * batch.num_targets
        finally:
            engine.close()

@pytest.mark.parametrize("name", ALL)
def test_a_checkpoint_loads_and_its_loss_equals_hugging_faces(name, tmp_path):
    sharded = name == "llama-gqa"
    directory = _write(tmp_path, name, **({"max_shard_size": "40KB"} if sharded else {}))
    assert (directory / "model.safetensors.index.json").exists() == sharded
    hf = _hf(name, directory).eval()
    batch = _batch(name=name)
    with torch.no_grad():
        want = float(_hf_loss_sum(hf, batch))
    for engine_name, got in engine_loss_sums(directory, batch):
        assert got == pytest.approx(want, rel=1e-5), engine_name


def _zero_gradient(key: str, weight: np.ndarray) -> np.ndarray:
    """The elements of ``key`` whose gradient is zero in exact arithmetic: without rotary
    positions an attention key bias adds the same ``q . b`` to every logit of a query, which
    the softmax ignores. Adam turns their rounding-noise gradients into noise-sized updates,
    different in any two implementations, so they are checked apart (BERT's key bias, the
    middle third of GPT-2's q, k, v ``c_attn.bias``)."""
    noise = np.zeros(weight.shape, bool)
    if key.endswith("key.bias"):
        noise[:] = True
    elif key.endswith("c_attn.bias"):
        d = weight.shape[0] // 3
        noise[d:2 * d] = True
    return noise


@pytest.mark.parametrize("name", ["llama-gqa", "llama-tied", "mistral", "qwen2", "qwen3", "gpt2", "bert"])
def test_fine_tuning_equals_hugging_face_trained_in_memory(name, tmp_path, trainer_decay_names):
    """20 steps over 4 micro-batches: every step's loss and every final weight equal Hugging
    Face's model trained with torch.optim.AdamW with Trainer's parameter groups on the same
    batches, a tied embedding tied in both (one tensor in the HF model, one EPS entry in l2l)."""
    directory = _write(tmp_path, name)
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.99, adam_eps=1e-8, weight_decay=0.01)
    cfg = _cfg(directory, micro_batches=4, **hyper)
    stack = build_stack(cfg.model_config(), cfg.seed)
    assert len(stack.shared) == (1 if name in TIED else 0)
    engine = build_engine(cfg, stack, CPU)
    hf = _hf(name, directory).train()
    opt = adamw_with_trainer_groups(hf, trainer_decay_names(hf), weight_decay=0.01, lr=1e-3, betas=(0.9, 0.99),
                                    eps=1e-8)
    try:
        for step in range(20):
            batch = _batch(seed=step, name=name)
            ours = engine.train_step(batch, step).loss
            opt.zero_grad()
            loss = _hf_loss_sum(hf, batch) / batch.num_targets
            loss.backward()
            opt.step()
            assert ours == pytest.approx(float(loss.detach()), rel=1e-5), step
        ours = named_master_weights(directory, engine.master_weights())
    finally:
        engine.close()
    theirs = {k: p.detach().numpy() for k, p in hf.named_parameters()}  # a tied tensor once, by its first name
    grads = {k: p.grad.numpy() for k, p in hf.named_parameters()}
    largest_grad = max(float(np.abs(g).max()) for g in grads.values())
    assert ours.keys() == theirs.keys()
    diff = total = 0.0
    for key, want in theirs.items():
        noise = _zero_gradient(key, want)
        diff += float(np.sum((ours[key] - want)[~noise].astype(np.float64) ** 2))
        total += float(np.sum(want[~noise].astype(np.float64) ** 2))
        # each tensor on its own too, a little looser (the least-moved tensors differ the most,
        # relatively): a wrongly mapped or untied tensor is off by far more
        if not noise.all():
            err = np.linalg.norm((ours[key] - want)[~noise]) / np.linalg.norm(want[~noise])
            assert err <= 1e-4, (key, err)
        if noise.any():  # zero gradients in exact arithmetic: noise both sides, each Adam step <= lr
            assert np.abs(grads[key][noise]).max() <= 1e-5 * largest_grad, key
            assert np.abs(ours[key] - want)[noise].max() <= 2 * 20 * 1e-3, key
    assert (diff / total) ** 0.5 <= 1e-5
    if name in TIED:
        embed, head = TIED[name]
        assert hf.get_parameter(head) is hf.get_parameter(embed)


def test_train_from_the_command_line_pretrained_and_random(tmp_path):
    directory = _write(tmp_path, "llama-gqa")
    flags = ["--model", str(directory), "--seq-len", str(SEQ), "--batch-size", "4", "--micro-batches", "2",
             "--steps", "2", "--eval-batches", "1", "--no-plot"]
    for init in ("pretrained", "random"):
        r = run_cli("train", *flags, "--init", init, "--out", str(tmp_path / init))
        assert r.returncode == 0, r.stderr[-2000:]
        assert f"llama from {directory}, 2 blocks" in r.stdout
        summary = json.loads((tmp_path / init / "summary.json").read_text())
        assert np.isfinite(summary["final_val_loss"])
    first = [json.loads(line)["loss"] for line in (tmp_path / "pretrained" / "metrics.jsonl").read_text().splitlines()]
    fresh = [json.loads(line)["loss"] for line in (tmp_path / "random" / "metrics.jsonl").read_text().splitlines()]
    assert first != fresh  # the checkpoint's weights, not a fresh init


def _losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_tied_families_train_from_the_command_line(name, tmp_path):
    """Default options but the shape: both engines agree, two workers feed the tied entry
    four contributions and agree with one, a resumed run continues the same trajectory,
    and the OpenCL EPS gives NumPy's bits."""
    directory = _write(tmp_path, name)
    flags = ["--model", str(directory), "--seq-len", str(SEQ), "--batch-size", "4", "--micro-batches", "2",
             "--eval-batches", "1", "--no-plot"]
    runs = {"l2l": ["--steps", "4"], "plain": ["--steps", "4", "--engine", "plain"],
            "two": ["--steps", "4", "--devices", "2"], "half": ["--steps", "2"]}
    if name == "gpt2":  # the FPGA backends never see the pre stage's empty entry; bit for bit as NumPy
        runs["opencl"] = ["--steps", "4", "--eps", "opencl"]
    for run, extra in runs.items():
        r = run_cli("train", *flags, *extra, "--out", str(tmp_path / run))
        assert r.returncode == 0, r.stderr[-2000:]
    assert f"{name} from {directory}, 2 blocks" in r.stdout
    r = run_cli("train", *flags, "--steps", "4", "--resume", "--out", str(tmp_path / "half"))
    assert r.returncode == 0, r.stderr[-2000:]
    want = _losses(tmp_path / "l2l")
    for run in ("plain", "two"):
        assert _losses(tmp_path / run) == pytest.approx(want, rel=1e-5), run
    assert _losses(tmp_path / "half") == want
    if name == "gpt2":
        assert _losses(tmp_path / "opencl") == want


def test_a_checkpoint_named_by_its_base_model_loads(tmp_path):
    """GPT-2 as first published: tensors saved from the base model (``h.0...``, no ``transformer.``)."""
    from safetensors.torch import load_file, save_file
    directory = _write(tmp_path, "gpt2")
    tensors = load_file(directory / "model.safetensors")
    save_file({k.removeprefix("transformer."): v for k, v in tensors.items()}, directory / "model.safetensors")
    hf = _hf("gpt2", directory).eval()  # transformers reads it too
    batch = _batch()
    cfg = _cfg(directory)
    engine = build_engine(cfg, build_stack(cfg.model_config(), cfg.seed), CPU)
    try:
        got = engine.evaluate([batch]) * batch.num_targets
    finally:
        engine.close()
    with torch.no_grad():
        assert got == pytest.approx(float(_hf_loss_sum(hf, batch)), rel=1e-5)


def test_a_tied_model_is_audited_and_planned_once(tmp_path):
    """The device memory the relay books for a tied model equals what it holds, and the
    planner counts the tied embedding once in the total and in both layers that fetch it."""
    from l2l.planner import Rates, layer_shapes, predict
    from l2l.relay.audit import audited
    directory = _write(tmp_path, "llama-tied")
    cfg = _cfg(directory)
    stack = build_stack(cfg.model_config(), cfg.seed)
    engine = build_engine(cfg, stack, CPU)
    audit = audited(engine)
    try:
        engine.train_step(_batch(), 0)
    finally:
        engine.close()
    assert audit.records and not audit.mismatches()
    shapes = layer_shapes(cfg)
    embed = VOCAB * 64
    assert shapes[0].params == embed and shapes[-1].params == embed + 64  # the final norm, then the head
    assert predict(cfg, Rates(flops_per_s=1e11)).params == stack.num_params == sum(
        p.numel() for p in _hf("llama-tied", directory).parameters())


def _refused(tmp_path, directory, *needles):
    r = run_cli("train", "--model", str(directory), "--steps", "1", "--out", str(tmp_path / "out"))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("l2l: error:"), r.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert not (tmp_path / "out").exists()


def test_bad_checkpoints_are_one_line(tmp_path):
    llama = _write(tmp_path, "llama-gqa")
    # an unsupported family names the supported ones
    other = tmp_path / "neox"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({**json.loads((llama / "config.json").read_text()),
                                                   "model_type": "gpt_neox"}))
    _refused(tmp_path, other, "gpt_neox", "llama, mistral, qwen2, qwen3, gpt2, bert")
    # pickle weights are never loaded
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((llama / "config.json").read_text())
    (pickled / "pytorch_model.bin").write_bytes(b"not loaded")
    _refused(tmp_path, pickled, "pytorch_model.bin", "safetensors")
    # a missing tensor is named
    from safetensors.torch import load_file, save_file
    missing = tmp_path / "missing"
    missing.mkdir()
    (missing / "config.json").write_text((llama / "config.json").read_text())
    tensors = {}
    for shard in sorted(llama.glob("*.safetensors")):
        tensors.update(load_file(shard))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, missing / "model.safetensors")
    _refused(tmp_path, missing, "model.layers.1.mlp.up_proj.weight")
    # learned positions bound the sequence (the default --seq-len, 128, is beyond this GPT-2's 64)
    _refused(tmp_path, _write(tmp_path, "gpt2"), "--seq-len 128", "64 positions", "n_positions")


def test_the_planner_counts_a_model_directory(tmp_path):
    from l2l.planner import layer_shapes
    directory = _write(tmp_path, "qwen3")
    cfg = _cfg(directory)
    shapes = layer_shapes(cfg)
    stack = build_stack(cfg.model_config(), 0)
    assert [s.params for s in shapes] == [layer.layout.numel for layer in stack.layers]
    assert replace(cfg, init="random").check().init == "random"
    from l2l.planner import Rates, predict
    p = predict(cfg, Rates(flops_per_s=1e11))  # the directory's shape, not the shape options' defaults
    assert (p.config["layers"], p.config["d_model"], p.config["heads"]) == (2, 64, 4)
    assert p.params == stack.num_params


# ---------------------------------------------------------------- export

def _trained_run(tmp_path, directory, steps: int) -> Path:
    out = tmp_path / f"run{steps}"
    r = run_cli("train", "--model", str(directory), "--seq-len", str(SEQ), "--batch-size", "4",
                "--micro-batches", "2", "--steps", str(steps), "--eval-batches", "1", "--no-plot",
                "--no-progress", "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    return out


@pytest.mark.parametrize("name", ["llama-gqa", "gpt2", "bert"])
def test_export_after_no_steps_is_the_source_bit_for_bit(name, tmp_path):
    from safetensors.torch import load_file
    directory = _write(tmp_path, name, **({"max_shard_size": "40KB"} if name == "llama-gqa" else {}))
    run = _trained_run(tmp_path, directory, 0)
    r = run_cli("export", str(run), "--out", str(tmp_path / "exported"))
    assert r.returncode == 0, r.stderr
    source, exported = {}, {}
    for shard in directory.glob("*.safetensors"):
        source.update(load_file(shard))
    for shard in (tmp_path / "exported").glob("*.safetensors"):
        exported.update(load_file(shard))
    assert source.keys() == exported.keys()  # a tied tensor once, under the name save_pretrained gives it
    for key, t in source.items():
        assert t.dtype == exported[key].dtype and torch.equal(t, exported[key]), key
    model, info = _hf(name, tmp_path / "exported", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    if name in TIED:
        embed, head = TIED[name]
        assert model.get_parameter(head) is model.get_parameter(embed)


@pytest.mark.parametrize("name", ["qwen3", "bert"])
def test_export_after_training_gives_l2ls_loss_under_transformers(name, tmp_path):
    from l2l.checkpoint import load_latest
    directory = _write(tmp_path, name)
    run = _trained_run(tmp_path, directory, 3)
    for dtype in ("fp32", "bf16"):
        r = run_cli("export", str(run), "--out", str(tmp_path / dtype), "--dtype", dtype)
        assert r.returncode == 0, r.stderr
    ck = load_latest(run)
    cfg = _cfg(directory)
    engine = build_engine(cfg, build_stack(cfg.model_config(), cfg.seed), CPU)
    try:
        engine.load_state(ck.tensors, ck.meta["engine"])
        batch = _batch(seed=7, name=name)
        ours = engine.evaluate([batch])
    finally:
        engine.close()
    hf = _hf(name, tmp_path / "fp32").eval()
    with torch.no_grad():
        theirs = float(_hf_loss_sum(hf, batch)) / batch.num_targets
    assert theirs == pytest.approx(ours, rel=1e-6)
    assert ours != pytest.approx(float(_hf_loss_sum(_hf(name, directory).eval(), batch).detach()) / batch.num_targets,
                                 rel=1e-6)  # trained: not the source's loss
    half = _hf(name, tmp_path / "bf16", **dtype_kwarg("auto"))  # the default before transformers 5: fp32
    assert next(half.parameters()).dtype == torch.bfloat16


def test_export_refuses_what_it_cannot_write(tmp_path):
    plain_run = tmp_path / "gpt"
    r = run_cli("train", "--layers", "1", "--d-model", "16", "--heads", "2", "--seq-len", "16", "--batch-size", "2",
                "--micro-batches", "1", "--steps", "1", "--eval-batches", "1", "--no-plot", "--no-progress",
                "--out", str(plain_run))
    assert r.returncode == 0, r.stderr
    for args, needle in ((["export", str(plain_run), "--out", str(tmp_path / "x")], "model directory"),
                         (["export", str(tmp_path / "nothing"), "--out", str(tmp_path / "y")], "no checkpoint"),
                         (["export", str(plain_run), "--out", str(plain_run)], "not an empty directory")):
        r = run_cli(*args)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and needle in lines[0], r.stderr
    assert not (tmp_path / "x").exists()


# ---------------------------------------------------------------- tokenizers and data

def _corpus(tmp_path) -> Path:
    rng = np.random.default_rng(0)
    words = "the eager param server updates each layer while the relay moves on to the next".split()
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i in range(10):
        (folder / f"doc{i}.txt").write_text(" ".join(rng.choice(words, 300)))
    return folder


@pytest.fixture(scope="module")
def trained_tokenizer(tmp_path_factory) -> Path:
    """``l2l tokenizer train`` on ``_corpus``, run once for the session: the tests copy its files."""
    tok, r = cli_once(tmp_path_factory, "pretrained-tokenizer", lambda out: run_cli(
        "tokenizer", "train", "--data", str(_corpus(out.parent)), "--vocab-size", "290", "--out", str(out)), leaf="tok")
    assert r.returncode == 0, r.stderr
    return tok


def _with_tokenizer(tmp_path, trained: Path) -> tuple[Path, Path]:
    """The llama checkpoint with the trained tokenizer's files, the corpus, and the tokenizer at tmp_path/tok."""
    directory = _write(tmp_path, "llama-gqa")
    data = _corpus(tmp_path)
    shutil.copytree(trained, tmp_path / "tok")
    for f in trained.iterdir():
        (directory / f.name).write_bytes(f.read_bytes())
    return directory, data


def test_the_model_directorys_tokenizer_is_used_and_its_tokens_are_cached(tmp_path, trained_tokenizer):
    directory, data = _with_tokenizer(tmp_path, trained_tokenizer)
    env = {"L2L_CACHE": str(tmp_path / "cache")}
    flags = ["--model", str(directory), "--data", str(data), "--seq-len", str(SEQ), "--batch-size", "4",
             "--micro-batches", "2", "--steps", "2", "--eval-batches", "1", "--no-plot"]
    runs = []
    for name in ("first", "second"):
        r = run_cli("train", *flags, "--out", str(tmp_path / name), env=env)
        assert r.returncode == 0, r.stderr[-2000:]
        runs.append(r.stdout)
    assert "tokens of llama-gqa" in runs[0] and "cached" not in runs[0]
    assert "cached)" in runs[1]
    losses = [[json.loads(line)["loss"] for line in (tmp_path / n / "metrics.jsonl").read_text().splitlines()]
              for n in ("first", "second")]
    assert losses[0] == losses[1]
    r = run_cli("train", *flags, "--tokenizer", "bytes", "--out", str(tmp_path / "bytes"), env=env)
    assert r.returncode == 0 and "bytes (train" in r.stdout, r.stderr[-2000:]


def test_documents_are_joined_by_the_end_of_text_token(tmp_path, trained_tokenizer, monkeypatch):
    from l2l.data import load_corpus
    from l2l.tokenizer import load_tokenizer
    monkeypatch.setenv("L2L_CACHE", str(tmp_path / "cache"))
    directory, data = _with_tokenizer(tmp_path, trained_tokenizer)
    tok = load_tokenizer(None, str(directory))
    corpus = load_corpus(str(data), tokenizer=tok)
    eos = [int((side == tok.eos_id).sum()) for side in (corpus.train, corpus.val)]
    assert sum(eos) == corpus.num_files - 2 and corpus.train.dtype == np.int32
    first = (data / "doc0.txt").read_text()
    assert tok.decode(corpus.train[:len(tok.encode(first))]) == first or tok.decode(
        corpus.val[:len(tok.encode(first))]) == first


def test_jsonl_text_records_and_mixed_or_fieldless_records(tmp_path, trained_tokenizer):
    directory, _ = _with_tokenizer(tmp_path, trained_tokenizer)
    env = {"L2L_CACHE": str(tmp_path / "cache")}
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps({"text": f"record {i} " * 40}) + "\n" for i in range(30)))
    flags = ["--model", str(directory), "--seq-len", str(SEQ), "--batch-size", "4", "--micro-batches", "2",
             "--steps", "1", "--eval-batches", "1", "--no-plot", "--no-progress"]
    r = run_cli("train", *flags, "--data", str(good), "--out", str(tmp_path / "ok"), env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    text = {"text": "some words " * 20}
    cases = {"mixed.jsonl": ([text, {"prompt": "a", "completion": "b"}], "in a file of text records"),
             "other.jsonl": ([{"body": "x"}], "no 'text' field"),
             "one.jsonl": ([{"prompt": "a", "completion": "b"}], "need at least 2")}
    for name, (records, needle) in cases.items():
        (tmp_path / name).write_text("".join(json.dumps(rec) + "\n" for rec in records))
        r = run_cli("train", *flags, "--data", str(tmp_path / name), "--out", str(tmp_path / name[:-6]), env=env)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and needle in lines[0], r.stderr
        assert not (tmp_path / name[:-6]).exists()


def _word_tokenizer(directory: Path, corpus: Path, special: dict) -> None:
    """A word-level tokenizer of the corpus's words into ``directory``, with ``special`` tokens
    (role -> text) named in its tokenizer_config.json, as BERT-style tokenizers have them
    (other keys of ``special`` go to the config only)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    words = sorted({w for f in corpus.iterdir() for w in f.read_text().split()})
    vocab = {t: i for i, t in enumerate(["[UNK]", *(v for k, v in special.items() if k.endswith("_token")), *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=False)  # as BERT's tokenizer.json (transformers 4's
    tok.pre_tokenizer = pre_tokenizers.Whitespace()               # BertTokenizerFast needs one)
    if "cls_token" in special:  # [CLS] text [SEP], as BERT's post-processor
        cls, sep = special["cls_token"], special["sep_token"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} $B {sep}",
            special_tokens=[(cls, vocab[cls]), (sep, vocab[sep])])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"unk_token": "[UNK]", **special}))


def test_bert_masks_with_its_tokenizers_mask_token(tmp_path, monkeypatch):
    from l2l.data import BatchSampler, load_corpus
    from l2l.tokenizer import load_tokenizer
    monkeypatch.setenv("L2L_CACHE", str(tmp_path / "cache"))
    directory, data = _write(tmp_path, "bert"), _corpus(tmp_path)
    _word_tokenizer(directory, data, {"sep_token": "[SEP]", "mask_token": "[MASK]", "cls_token": "[CLS]"})
    tok = load_tokenizer(None, str(directory))
    assert (tok.eos_id, tok.mask_id) == (1, 2)  # documents joined by [SEP]; [MASK] masks
    corpus = load_corpus(str(data), tokenizer=tok)
    # each document is transformers' tokenizer(doc): it ends with [SEP], so no [SEP] is put between them
    hf = transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)
    docs = [hf(f.read_text())["input_ids"] for f in sorted(data.iterdir())]
    assert all(d[-1] == 1 for d in docs) and corpus.train.size + corpus.val.size == sum(map(len, docs))
    assert int((corpus.train == 1).sum() + (corpus.val == 1).sum()) == corpus.num_files
    batch = BatchSampler(corpus.train, SEQ, 64, "mlm", mask_id=tok.mask_id, vocab_size=tok.vocab_size).batch(0)
    hidden = batch.targets != -100
    assert (batch.inputs[hidden] == 2).float().mean() > 0.6 and (batch.inputs[~hidden] != 2).all()
    assert int(batch.inputs.max()) < tok.vocab_size
    flags = ["--model", str(directory), "--data", str(data), "--seq-len", str(SEQ), "--batch-size", "4",
             "--micro-batches", "2", "--steps", "2", "--eval-batches", "1", "--no-plot"]
    r = run_cli("train", *flags, "--out", str(tmp_path / "run"), env={"L2L_CACHE": str(tmp_path / "cache")})
    assert r.returncode == 0, r.stderr[-2000:]
    # a tokenizer with no mask token cannot serve a masked-LM objective: one line (the generic class:
    # transformers' BERT tokenizer class would give it its default [MASK])
    _word_tokenizer(directory, data, {"sep_token": "[SEP]", "tokenizer_class": "PreTrainedTokenizerFast"})
    r = run_cli("train", *flags, "--out", str(tmp_path / "refused"), env={"L2L_CACHE": str(tmp_path / "cache")})
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "no mask token" in lines[0], r.stderr
    assert not (tmp_path / "refused").exists()


def test_a_tokenizer_larger_than_the_model_is_refused(tmp_path, trained_tokenizer):
    _, data = _with_tokenizer(tmp_path, trained_tokenizer)  # 290 tokens: more than the GPT's 256 byte embeddings
    r = run_cli("train", "--model", "gpt", "--tokenizer", str(tmp_path / "tok"), "--data", str(data),
                "--seq-len", str(SEQ), "--steps", "1", "--out", str(tmp_path / "refused"),
                env={"L2L_CACHE": str(tmp_path / "cache")})
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "more than the model's 256" in lines[0], r.stderr
    assert not (tmp_path / "refused").exists()


# ---------------------------------------------------------------- supervised fine-tuning

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% if m.role == 'assistant' %}"
                 "{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_completion_loss_counts_the_completion_only(tmp_path, trained_tokenizer, monkeypatch):
    from l2l.sft import ExampleSampler, load_examples
    from l2l.tokenizer import load_tokenizer
    monkeypatch.setenv("L2L_CACHE", str(tmp_path / "cache"))
    directory, _ = _with_tokenizer(tmp_path, trained_tokenizer)
    data = tmp_path / "sft.jsonl"
    prompt, completion = "the relay moves on to the next", " layer while the server updates"
    data.write_text("".join(json.dumps({"prompt": prompt, "completion": completion}) + "\n" for _ in range(24)))
    tok = load_tokenizer(None, str(directory))
    examples = load_examples(str(data), tok)
    batch = ExampleSampler(examples.train, SEQ * 4, 2, pad_id=tok.eos_id).batch(0)
    # by hand: the full sequence through Hugging Face, cross-entropy on the completion's tokens only
    head, tail = tok.encode(prompt), tok.encode(completion) + [tok.eos_id]
    full = torch.tensor([head + tail])
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        logits = hf(full[:, :-1]).logits[0]
    picked = torch.arange(len(head) - 1, len(full[0]) - 1)  # positions whose next token is the completion's
    by_hand = float(torch.nn.functional.cross_entropy(logits[picked], full[0, picked + 1]))
    assert batch.num_targets == 2 * len(tail)
    cfg = _cfg(directory, seq_len=SEQ * 4, batch_size=2, micro_batches=2)
    engine = build_engine(cfg, build_stack(cfg.model_config(), cfg.seed), CPU)
    try:
        assert engine.evaluate([batch]) == pytest.approx(by_hand, rel=1e-5)
    finally:
        engine.close()
    r = run_cli("train", "--model", str(directory), "--data", str(data), "--seq-len", str(SEQ), "--batch-size", "4",
                "--micro-batches", "2", "--steps", "2", "--eval-batches", "1", "--no-plot", "--no-progress",
                "--out", str(tmp_path / "run"), env={"L2L_CACHE": str(tmp_path / "cache")})
    assert r.returncode == 0, r.stderr[-2000:]


def test_chat_records_learn_the_assistant_turns_through_the_template(tmp_path, trained_tokenizer, monkeypatch):
    from l2l.sft import load_examples
    from l2l.tokenizer import load_tokenizer
    monkeypatch.setenv("L2L_CACHE", str(tmp_path / "cache"))
    directory, _ = _with_tokenizer(tmp_path, trained_tokenizer)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    data = tmp_path / "chat.jsonl"
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the relay"},
            {"role": "assistant", "content": "moves on"}, {"role": "user", "content": "and the server"},
            {"role": "assistant", "content": "updates the layer"}]
    data.write_text("".join(json.dumps({"messages": chat}) + "\n" for _ in range(24)))
    tok = load_tokenizer(None, str(directory))
    examples = load_examples(str(data), tok)
    ids, mask = examples.train.example(0)
    learned = tok.decode(ids[mask == 1])
    assert learned == "moves on<|endoftext|>\nupdates the layer<|endoftext|>\n"
    assert tok.decode(ids) == "".join(f"<|{m['role']}|>{m['content']}" + ("<|endoftext|>" if m["role"] ==
                                      "assistant" else "") + "\n" for m in chat)
    env = {"L2L_CACHE": str(tmp_path / "cache")}
    r = run_cli("train", "--model", str(directory), "--data", str(data), "--seq-len", str(SEQ * 4),
                "--batch-size", "4", "--micro-batches", "2", "--steps", "2", "--eval-batches", "1", "--no-plot",
                "--no-progress", "--out", str(tmp_path / "run"), env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    # bytes have no chat template: one line
    r = run_cli("train", "--model", str(directory), "--tokenizer", "bytes", "--data", str(data), "--steps", "1",
                "--out", str(tmp_path / "bytes"), env=env)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "chat template" in lines[0], r.stderr


def test_examples_whose_answer_is_beyond_the_window_are_not_drawn():
    from l2l.errors import UserError
    from l2l.sft import ExampleSampler, TokenizedExamples
    # example 0: answer at token 5; example 1: answer at token 2
    ids = np.arange(14, dtype=np.int32)
    mask = np.array([0, 0, 0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 1, 1], np.uint8)
    examples = TokenizedExamples(ids, mask, np.array([0, 7, 14]))
    sampler = ExampleSampler(examples, seq_len=3, batch_size=8)
    assert sampler.usable.tolist() == [1]
    batch = sampler.batch(0)
    assert (batch.inputs[:, 0] == 7).all() and batch.targets[0].tolist() == [-100, 9, 10]
    with pytest.raises(UserError, match="raise --seq-len"):
        ExampleSampler(TokenizedExamples(ids[:7], mask[:7], np.array([0, 7])), seq_len=3, batch_size=2)
