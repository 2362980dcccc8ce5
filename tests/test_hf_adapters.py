"""The HF adapters cut a model into a stack without changing what it computes."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from l2l.models.config import BYTE_VOCAB, MASK_TOKEN, ModelConfig  # noqa: E402
from l2l.models.hf import BERT, GPT2, Embed, Recipe, build_from_recipe, build_hf_bert, build_hf_gpt2  # noqa: E402
from l2l.models.stack import IGNORE_INDEX, LayerStack  # noqa: E402

B, T = 3, 16
TINY = dict(layers=2, d_model=32, heads=2, seq_len=T)


def _build(recipe: Recipe, family: str, seed: int = 0, dropout: float = 0.0):
    """The stack and, from the same seed, the whole HF model it was cut from."""
    cfg = ModelConfig(family=family, dropout=dropout, **TINY)
    torch.manual_seed(seed)
    stack = build_from_recipe(recipe, cfg)
    torch.manual_seed(seed)
    model = recipe.make(cfg)
    stack.train(False)
    model.eval()
    return stack, model


def _hidden(stack: LayerStack, tokens: torch.Tensor) -> torch.Tensor:
    hidden = stack.layers[0].module(tokens)
    for layer in stack.layers[1:-1]:
        hidden = layer.module(hidden)
    return hidden


def _loss_sum(stack: LayerStack, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return stack.layers[-1].module(_hidden(stack, tokens), targets)


def _causal_batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and their next-byte targets, already shifted as the relay's data gives them."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, BYTE_VOCAB, (B, T), generator=g)
    targets = torch.cat([tokens[:, 1:], torch.full((B, 1), IGNORE_INDEX)], dim=1)
    return tokens, targets


def _mlm_batch(seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    original = torch.randint(0, BYTE_VOCAB, (B, T), generator=g)
    masked = torch.rand(B, T, generator=g) < 0.3
    masked[:, 0] = True  # at least one target per row
    tokens = torch.where(masked, torch.full_like(original, MASK_TOKEN), original)
    targets = torch.where(masked, original, torch.full_like(original, IGNORE_INDEX))
    return tokens, targets


def test_gpt2_loss_and_logits_match_hf_model():
    stack, model = _build(GPT2, "hf-gpt2")
    tokens, targets = _causal_batch()
    with torch.no_grad():
        ours = _loss_sum(stack, tokens, targets) / (targets != IGNORE_INDEX).sum()
        hf = model(input_ids=tokens, labels=tokens)  # HF shifts labels itself
        logits = stack.layers[-1].module.logits(_hidden(stack, tokens))
    assert stack.vocab_size == BYTE_VOCAB
    torch.testing.assert_close(logits, hf.logits, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours, hf.loss, rtol=0, atol=1e-6)


def test_gpt2_block_alone_is_causal():
    stack, _ = _build(GPT2, "hf-gpt2")
    block = stack.layers[1].module
    x = torch.randn(B, T, TINY["d_model"])
    y = x.clone()
    y[:, 10:] += torch.randn(B, T - 10, TINY["d_model"])
    with torch.no_grad():
        hx, hy = block(x), block(y)
    torch.testing.assert_close(hx[:, :10], hy[:, :10], rtol=0, atol=0)
    assert not torch.allclose(hx[:, 10:], hy[:, 10:])
    # and through the whole stack: changing a later token leaves earlier positions alone
    tokens, _ = _causal_batch()
    changed = tokens.clone()
    changed[:, 12] = (changed[:, 12] + 1) % BYTE_VOCAB
    with torch.no_grad():
        torch.testing.assert_close(_hidden(stack, tokens)[:, :12], _hidden(stack, changed)[:, :12],
                                   rtol=0, atol=0)


def test_bert_block_sees_both_ways():
    stack, _ = _build(BERT, "hf-bert")
    block = stack.layers[1].module
    x = torch.randn(B, T, TINY["d_model"])
    y = x.clone()
    y[:, -1] += 1.0
    with torch.no_grad():
        assert not torch.allclose(block(x)[:, 0], block(y)[:, 0])


def test_bert_mlm_loss_matches_hf_model():
    stack, model = _build(BERT, "hf-bert")
    tokens, targets = _mlm_batch()
    with torch.no_grad():
        ours = _loss_sum(stack, tokens, targets) / (targets != IGNORE_INDEX).sum()
        hf = model(input_ids=tokens, labels=targets)
        logits = stack.layers[-1].module.logits(_hidden(stack, tokens))
    assert stack.vocab_size == MASK_TOKEN + 1
    torch.testing.assert_close(logits, hf.logits, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours, hf.loss, rtol=0, atol=1e-6)


@pytest.mark.parametrize("recipe,family,dropped", [(GPT2, "hf-gpt2", 0), (BERT, "hf-bert", MASK_TOKEN + 1)])
def test_stack_holds_every_used_parameter_once(recipe, family, dropped):
    """Nothing lost, nothing shared between layers; BERT drops only its unread prediction bias."""
    stack, model = _build(recipe, family)
    if family == "hf-bert" and model.cls.predictions.bias is model.cls.predictions.decoder.bias:
        dropped = 0  # before transformers 5 the prediction bias is the decoder's own: read, and kept
    params = [p for layer in stack.layers for p in layer.module.parameters()]
    assert len({id(p) for p in params}) == len(params)
    assert stack.num_params == sum(p.numel() for p in model.parameters()) - dropped


def _args(layer, tokens, targets):
    if layer.kind == "pre":
        return (tokens,)
    hidden = torch.randn(B, T, TINY["d_model"], generator=torch.Generator().manual_seed(3))
    return (hidden,) if layer.kind == "block" else (hidden, targets)


@pytest.mark.parametrize("build,batch", [(build_hf_gpt2, _causal_batch), (build_hf_bert, _mlm_batch)])
def test_functional_call_on_flat_weights(build, batch):
    torch.manual_seed(0)
    stack = build(ModelConfig(**TINY))
    stack.train(False)
    tokens, targets = batch()
    for layer in stack.layers:
        flat = torch.from_numpy(layer.layout.flatten(layer.module))
        params = layer.layout.views(flat)
        assert set(params) == {n for n, _ in layer.module.named_parameters()}
        args = _args(layer, tokens, targets)
        with torch.no_grad():
            direct = layer.module(*args)
            functional = torch.func.functional_call(layer.module, params, args)
            # the relay keeps parameters on the meta device and supplies them at call time
            on_meta = torch.func.functional_call(copy.deepcopy(layer.module).to("meta"), params, args)
            doubled = torch.func.functional_call(layer.module, layer.layout.views(flat * 2), args)
        torch.testing.assert_close(functional, direct, rtol=0, atol=0)
        torch.testing.assert_close(on_meta, direct, rtol=0, atol=0)
        assert not torch.equal(doubled, direct), f"{layer.name} ignored the supplied parameters"


@pytest.mark.parametrize("build", [build_hf_gpt2, build_hf_bert])
def test_same_seed_same_weights(build):
    def flat(seed):
        torch.manual_seed(seed)
        stack = build(ModelConfig(**TINY))
        return np.concatenate([layer.layout.flatten(layer.module) for layer in stack.layers])

    a, b, c = flat(7), flat(7), flat(8)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)


@pytest.mark.parametrize("build,batch", [(build_hf_gpt2, _causal_batch), (build_hf_bert, _mlm_batch)])
def test_dropout_is_honoured(build, batch):
    tokens, targets = batch()
    for dropout, differs in ((0.3, True), (0.0, False)):
        torch.manual_seed(0)
        stack = build(ModelConfig(dropout=dropout, **TINY))
        stack.train(False)
        with torch.no_grad():
            evaluated = _loss_sum(stack, tokens, targets)
            stack.train(True)
            trained = _loss_sum(stack, tokens, targets)
        assert (not torch.equal(evaluated, trained)) == differs
    # every dropout probability in the HF config follows cfg.dropout
    torch.manual_seed(0)
    stack = build(ModelConfig(dropout=0.25, **TINY))
    ps = {m.p for layer in stack.layers for m in layer.module.modules() if isinstance(m, nn.Dropout)}
    assert ps == {0.25}
    attn = [m for layer in stack.layers[1:-1] for m in layer.module.modules() if hasattr(m, "attn_dropout")]
    assert all(m.attn_dropout.p == 0.25 for m in attn)


def test_a_new_decoder_family_is_one_recipe():
    """A Llama-style decoder (rotary positions, RMSNorm) needs only a recipe, no new wrappers."""
    transformers = pytest.importorskip("transformers")

    def make(cfg):
        config = transformers.LlamaConfig(
            vocab_size=BYTE_VOCAB, hidden_size=cfg.d_model, intermediate_size=4 * cfg.d_model,
            num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.heads,
            max_position_embeddings=cfg.seq_len, attention_dropout=cfg.dropout,
            bos_token_id=None, eos_token_id=None, pad_token_id=None,
            tie_word_embeddings=False, attn_implementation="sdpa")
        return transformers.LlamaForCausalLM(config)

    def rotary(aux, hidden):
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        return {"position_embeddings": aux(hidden, positions)}

    llama = Recipe(make=make, pre=lambda m: Embed(m.model.embed_tokens), blocks="model.layers",
                   head=("model.norm", "lm_head"), block_aux="model.rotary_emb", block_kwargs=rotary)
    stack, model = _build(llama, "llama")
    tokens, targets = _causal_batch()
    with torch.no_grad():
        ours = _loss_sum(stack, tokens, targets) / (targets != IGNORE_INDEX).sum()
        hf = model(input_ids=tokens, labels=tokens)
    torch.testing.assert_close(ours, hf.loss, rtol=0, atol=1e-6)
    assert stack.num_params == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("build,batch", [(build_hf_gpt2, _causal_batch), (build_hf_bert, _mlm_batch)])
def test_every_parameter_gets_a_gradient(build, batch):
    """A layer's flat buffer is updated as a whole, so no parameter may sit outside the graph."""
    torch.manual_seed(0)
    stack = build(ModelConfig(**TINY))
    tokens, targets = batch()
    _loss_sum(stack, tokens, targets).backward()
    for layer in stack.layers:
        for name, p in layer.module.named_parameters():
            assert p.grad is not None, f"{layer.name}.{name}"
