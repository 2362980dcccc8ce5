"""Mixture-of-experts checkpoints (``--model DIR``): Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE.

Each test writes its tiny checkpoint itself with ``save_pretrained`` (4 experts, top-2,
2 layers, hidden 32), router logits on (the load-balancing loss included) unless the
case says otherwise, and compares with transformers' own model: its forward ``loss``
and its training under ``torch.optim.AdamW``.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from l2l.build import build_engine
from l2l.config import TrainConfig
from l2l.data import Batch
from l2l.models import build_stack

from conftest import CPU, adamw_with_trainer_groups, run_cli
from shared_runs import named_master_weights

VOCAB, SEQ = 300, 16
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, num_experts_per_tok=2,
             output_router_logits=True, router_aux_loss_coef=0.1)  # a coefficient that shows in the loss
QWEN2_MOE = dict(num_experts=4, moe_intermediate_size=24, shared_expert_intermediate_size=40)
ALL = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "qwen2_moe-dense-layer", "qwen2_moe-sparse-step",
       "qwen2_moe-sliding", "mixtral-no-aux"]


def _families():
    from transformers import (MixtralConfig, MixtralForCausalLM, OlmoeConfig, OlmoeForCausalLM, Qwen2MoeConfig,
                              Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)
    return {
        "mixtral": (MixtralForCausalLM, MixtralConfig(**SHAPE, num_local_experts=4)),
        "mixtral-no-aux": (MixtralForCausalLM, MixtralConfig(**{**SHAPE, "output_router_logits": False},
                                                             num_local_experts=4)),
        "qwen2_moe": (Qwen2MoeForCausalLM, Qwen2MoeConfig(**SHAPE, **QWEN2_MOE)),  # shared expert, its gate
        # layer 1 dense (mlp_only_layers): the aux loss is over the routed layer alone
        "qwen2_moe-dense-layer": (Qwen2MoeForCausalLM, Qwen2MoeConfig(**SHAPE, **QWEN2_MOE, mlp_only_layers=[1])),
        # every second layer routed (decoder_sparse_step): layer 0 dense
        "qwen2_moe-sparse-step": (Qwen2MoeForCausalLM, Qwen2MoeConfig(**SHAPE, **QWEN2_MOE, decoder_sparse_step=2)),
        # a window shorter than the sequence, on the layers transformers' layer_types give it
        "qwen2_moe-sliding": (Qwen2MoeForCausalLM, Qwen2MoeConfig(**SHAPE, **QWEN2_MOE, use_sliding_window=True,
                                                                  sliding_window=5, max_window_layers=1)),
        "qwen3_moe": (Qwen3MoeForCausalLM, Qwen3MoeConfig(**SHAPE, num_experts=4, moe_intermediate_size=24,
                                                          norm_topk_prob=True, head_dim=16)),
        "olmoe": (OlmoeForCausalLM, OlmoeConfig(**SHAPE, num_experts=4, eos_token_id=None, pad_token_id=None)),
    }


def _write(tmp: Path, name: str) -> Path:
    cls, config = _families()[name]
    torch.manual_seed(0)
    model = cls(config)
    with torch.no_grad():  # norms away from their init, so a wrong mapping shows
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    model.save_pretrained(tmp / name)
    return tmp / name


def _batch(seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (4, SEQ + 1), generator=g)
    return Batch(x[:, :-1].contiguous(), x[:, 1:].contiguous())


def _hf_loss(model, batch: Batch) -> torch.Tensor:
    """transformers' own ``loss``: the mean token loss (targets given as already shifted),
    plus ``router_aux_loss_coef`` times the load-balancing loss when router logits are on."""
    return model(batch.inputs, labels=batch.targets, shift_labels=batch.targets).loss


def _cfg(directory: Path, **kw) -> TrainConfig:
    return TrainConfig(model=str(directory), progress=False, **{"seq_len": SEQ, "batch_size": 4,
                                                                "micro_batches": 4, **kw}).check()


def _engine(directory: Path, **kw):
    cfg = _cfg(directory, **kw)
    return build_engine(cfg, build_stack(cfg.model_config(), cfg.seed), CPU)


@pytest.mark.parametrize("name", ALL)
def test_the_loss_equals_transformers_loss_with_its_load_balancing_term(name, tmp_path):
    directory = _write(tmp_path, name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    batch = _batch()
    with torch.no_grad():
        out = hf(batch.inputs, labels=batch.targets, shift_labels=batch.targets)
    if name.endswith("no-aux"):
        assert out.aux_loss is None
    else:
        assert float(hf.router_aux_loss_coef * out.aux_loss) > 0.05  # large enough to show when missing
    for engine, micro_batches in (("l2l", 4), ("plain", 1)):
        e = _engine(directory, engine=engine, micro_batches=micro_batches)
        try:
            assert e.evaluate([batch]) == pytest.approx(float(out.loss), abs=1e-5), engine
        finally:
            e.close()


@pytest.mark.parametrize("name,steps,engine", [
    ("mixtral", 20, "l2l"), ("qwen2_moe", 20, "l2l"), ("qwen3_moe", 20, "l2l"), ("olmoe", 20, "l2l"),
    ("qwen2_moe-dense-layer", 3, "l2l"), ("mixtral-no-aux", 2, "l2l"), ("qwen2_moe", 2, "plain")])
def test_fine_tuning_equals_transformers_trained_with_adamw(name, steps, engine, tmp_path, trainer_decay_names):
    """The relay over 4 micro-batches (or the plain engine on the whole batch), step by step
    against transformers' model on the whole batch under torch.optim.AdamW with Trainer's
    parameter groups: every step's loss (aux included) and the final weights. The aux
    gradient is counted over the whole step while the relay back-propagates micro-batch by
    micro-batch, so a wrong split shows here."""
    directory = _write(tmp_path, name)
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.99, adam_eps=1e-8, weight_decay=0.01)
    engine = _engine(directory, engine=engine, checkpointing=engine == "plain", **hyper)
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory).train()
    opt = adamw_with_trainer_groups(hf, trainer_decay_names(hf), weight_decay=0.01, lr=1e-3, betas=(0.9, 0.99),
                                    eps=1e-8)
    try:
        for step in range(steps):
            batch = _batch(seed=step)
            ours = engine.train_step(batch, step).loss
            opt.zero_grad()
            loss = _hf_loss(hf, batch)
            loss.backward()
            opt.step()
            assert ours == pytest.approx(float(loss.detach()), abs=1e-5), step
        ours = named_master_weights(directory, engine.master_weights())
    finally:
        engine.close()
    theirs = {k: p.detach().numpy() for k, p in hf.named_parameters()}
    assert ours.keys() == theirs.keys()
    for key, want in theirs.items():
        assert np.abs(ours[key] - want).max() <= 1e-5, key
    router = next(k for k in theirs if k.endswith("mlp.gate.weight"))
    moved = np.abs(theirs[router] - transformers.AutoModelForCausalLM.from_pretrained(directory)
                   .get_parameter(router).detach().numpy()).max()
    assert moved > 1e-4  # the router trains (through the aux loss too, when on)


# ---------------------------------------------------------------- command line and export

def _cli_run(tmp_path, directory, steps: int, *extra) -> Path:
    out = tmp_path / f"run{steps}"
    r = run_cli("train", "--model", str(directory), "--seq-len", str(SEQ), "--batch-size", "4",
                "--micro-batches", "2", "--steps", str(steps), "--eval-batches", "1", "--no-plot",
                "--no-progress", "--out", str(out), *extra)
    assert r.returncode == 0, r.stderr[-2000:]
    return out


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    found = {}
    for shard in directory.glob("*.safetensors"):
        found.update(load_file(shard))
    return found


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_export_after_no_steps_is_the_source_bit_for_bit(name, tmp_path):
    """save_pretrained writes one tensor per expert (Mixtral's under block_sparse_moe); the
    export writes the same names and bits, and transformers loads it whole."""
    directory = _write(tmp_path, name)
    run = _cli_run(tmp_path, directory, 0)
    r = run_cli("export", str(run), "--out", str(tmp_path / "exported"))
    assert r.returncode == 0, r.stderr
    source, exported = _tensors(directory), _tensors(tmp_path / "exported")
    assert any(".experts.3." in k for k in source)  # per expert on disk
    assert source.keys() == exported.keys()
    for key, t in source.items():
        assert t.dtype == exported[key].dtype and torch.equal(t, exported[key]), key
    model, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    original = transformers.AutoModelForCausalLM.from_pretrained(directory)
    for key, p in original.named_parameters():
        assert torch.equal(p, model.get_parameter(key)), key


def test_train_from_the_command_line_then_export_gives_l2ls_loss_under_transformers(tmp_path):
    from l2l.checkpoint import load_latest
    directory = _write(tmp_path, "qwen3_moe")
    run = _cli_run(tmp_path, directory, 2)
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 2 and all(np.isfinite(losses))
    r = run_cli("export", str(run), "--out", str(tmp_path / "exported"))
    assert r.returncode == 0, r.stderr
    ck = load_latest(run)
    engine = _engine(directory)
    try:
        engine.load_state(ck.tensors, ck.meta["engine"])
        batch = _batch(seed=7)
        ours = engine.evaluate([batch])
    finally:
        engine.close()
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported").eval()
    with torch.no_grad():
        assert float(_hf_loss(hf, batch)) == pytest.approx(ours, abs=1e-5)
        source = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
        assert float(_hf_loss(source, batch)) != pytest.approx(ours, abs=1e-5)  # trained


def test_a_checkpoint_with_fused_experts_loads(tmp_path):
    """Experts stored fused, under the in-memory names (as transformers 5 also reads them)."""
    from safetensors.torch import save_file
    directory = _write(tmp_path, "olmoe")
    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    fused = tmp_path / "fused"
    fused.mkdir()
    (fused / "config.json").write_text((directory / "config.json").read_text())
    save_file({k: p.detach().contiguous() for k, p in model.named_parameters()}, fused / "model.safetensors")
    batch = _batch()
    with torch.no_grad():
        want = float(_hf_loss(model.eval(), batch))
    engine = _engine(fused)
    try:
        assert engine.evaluate([batch]) == pytest.approx(want, abs=1e-5)
    finally:
        engine.close()


# ---------------------------------------------------------------- refused in one line

def _refused(tmp_path, directory, *args_and_needles):
    *args, needles = args_and_needles
    r = run_cli("train", "--model", str(directory), "--seq-len", str(SEQ), "--batch-size", "4", "--steps", "1",
                "--no-progress", "--out", str(tmp_path / "out"), *args)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("l2l: error:"), r.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_what_is_not_supported_is_one_line(tmp_path):
    mixtral = _write(tmp_path, "mixtral")
    config = json.loads((mixtral / "config.json").read_text())
    for model_type in ("deepseek_v3", "jamba"):  # MoE families l2l does not list
        other = tmp_path / model_type
        other.mkdir()
        (other / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
        _refused(tmp_path, other, [model_type, "mixtral, qwen2_moe, qwen3_moe, olmoe"])
    more = tmp_path / "top5"  # more experts per token than there are experts
    more.mkdir()
    (more / "config.json").write_text(json.dumps({**config, "num_experts_per_tok": 5}))
    _refused(tmp_path, more, ["num_experts_per_tok 5", "4 experts"])
    # the aux loss counts the whole batch's routing on one worker
    _refused(tmp_path, mixtral, "--devices", "2", ["output_router_logits", "--devices"])
    _refused(tmp_path, mixtral, "--engine", "plain", "--accumulate", "--micro-batches", "2",
             ["--accumulate", "output_router_logits"])
    assert not (tmp_path / "out").exists()


def test_transformers_4_is_refused_for_moe_families(tmp_path, monkeypatch):
    """Routers and experts are found as transformers 5 lays them out: below 5, one line."""
    from l2l.errors import UserError
    from l2l.models.pretrained import read_config
    directory = _write(tmp_path, "qwen3_moe")
    monkeypatch.setattr("transformers.__version__", "4.51.1")
    with pytest.raises(UserError, match=r"qwen3_moe \(mixture of experts\) needs transformers>=5.0, this "
                                        r"environment has 4.51.1"):
        read_config(directory)


def test_a_block_left_out_is_left_out_of_the_load_balancing_term(tmp_path):
    """LayerDrop on an MoE model: a step that leaves a block out is transformers' model without
    that layer -- its router logits are not in the load-balancing loss either -- on the relay and
    on the plain engine alike."""
    directory = _write(tmp_path, "mixtral")
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    del hf.model.layers[0]  # the step leaves block 0 out
    batch = _batch()
    with torch.no_grad():
        want = float(_hf_loss(hf, batch))
    for engine_name in ("l2l", "plain"):
        engine = _engine(directory, engine=engine_name)
        try:
            assert engine.train_step(batch, 0, skip_blocks={0}).loss == pytest.approx(want, abs=1e-5), engine_name
        finally:
            engine.close()
