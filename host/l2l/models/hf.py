"""Hugging Face ``transformers`` models, cut into a layer stack.

The relay sees a model only as pre / blocks / post (see :mod:`.stack`). Here an
HF model is built *from a config* (no download, no hub access), and its own
submodules are moved into thin wrappers that follow the stack's calling
conventions; the HF code still does all the maths. Where each part lives is
described by a :class:`Recipe`, so another family (a GPT-NeoX-style decoder,
say) is one more recipe, not new wrapper code; ``pretrained.py`` names the
recipe of each ``model_type``.

Departures from stock HF, and why:

* The built-in byte-level ``hf-gpt2`` and ``hf-bert`` are built untied
  (``tie_word_embeddings=False``), as they always were, so their runs stay
  comparable. A checkpoint's tied embedding (``--model DIR``) stays tied: the
  one parameter lands in the pre and the post stage, and the stack keeps it as
  one shared EPS entry (``stack.py``).
* Attention is ``sdpa`` with no mask: every position is a real token. From
  transformers 5 on, the causal mask is built once at the model level, and a
  block called alone never sees it; with no mask, sdpa falls back to the
  attention module's own ``is_causal``, so a GPT-2 block alone is still causal
  (eager attention without a mask would silently look ahead). The Llama-style
  decoders' blocks get the mask their model's forward would give them
  (:mod:`.layer_masks`): none, or a sliding window's.
* BERT's word embedding gets no ``padding_idx``: byte 0 is a real token whose
  embedding must learn (a padding row gets no gradient).
* BERT's ``cls.predictions.bias`` is left out: once untied, HF never reads it
  (the decoder's own bias is the one applied), and a parameter that never gets
  a gradient has no place in a layer.
* Pre stages pass positions (and BERT's all-zero token types) explicitly, so
  they do not read index buffers, which may not live where the tokens do.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from .config import BYTE_VOCAB, MASK_TOKEN, ModelConfig
from .layer_masks import LayerMasks
from .router_balance import RouterBalance
from .stack import Layer, LayerStack, token_loss_sum


def _no_kwargs(aux: nn.Module | None, hidden: torch.Tensor) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class Recipe:
    """Where the parts of one HF model family live, and how to call a block.

    ``pre`` turns the whole HF model into the ``tokens -> hidden`` module
    (:class:`Embed` covers token + learned-position decoders). ``blocks`` is the
    dotted path of the ``nn.ModuleList`` of layers; ``head`` the dotted paths
    applied in order to turn hidden states into logits (final norm, then
    projection). A block is called as ``layer(hidden, **block_kwargs(aux,
    hidden))``, where ``aux`` is a private copy of the parameter-free module at
    ``block_aux`` (e.g. a rotary embedding) for families whose layers need more
    than the hidden states. With ``layer_masks``, a block also gets the
    ``attention_mask`` the model's own forward would give that layer
    (:class:`~.layer_masks.LayerMasks`).
    """

    make: Callable[[ModelConfig], nn.Module] | None  # None: built from a checkpoint's own config
    pre: Callable[[nn.Module], nn.Module]
    blocks: str
    head: tuple[str, ...]
    block_kwargs: Callable[[nn.Module | None, torch.Tensor], dict[str, Any]] = _no_kwargs
    block_aux: str | None = None
    layer_masks: bool = False  # blocks take the attention mask the model's forward gives each (sliding windows)
    routers: bool = False  # mixture-of-experts blocks: their load-balancing loss (router_balance.py)


class Embed(nn.Module):
    """tokens -> token embedding (+ learned position embedding), then ``after`` in order."""

    def __init__(self, tokens: nn.Module, positions: nn.Module | None = None, *after: nn.Module):
        super().__init__()
        self.tokens = tokens
        self.positions = positions
        self.after = nn.ModuleList(after)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.tokens(tokens)
        if self.positions is not None:
            hidden = hidden + self.positions(torch.arange(tokens.shape[1], device=tokens.device))
        for module in self.after:
            hidden = module(hidden)
        return hidden


class Block(nn.Module):
    """One HF layer as ``hidden -> hidden``; layer ``index`` of ``masks`` where given."""

    def __init__(self, layer: nn.Module, kwargs: Callable[..., dict[str, Any]], aux: nn.Module | None,
                 masks: LayerMasks | None = None, index: int = 0):
        super().__init__()
        self.layer = layer
        self.aux = aux
        self.kwargs = kwargs
        self.masks = masks
        self.index = index

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        kwargs = self.kwargs(self.aux, hidden)
        if self.masks is not None:
            kwargs["attention_mask"] = self.masks.mask(self.index, hidden)
        out = self.layer(hidden, **kwargs)
        # Layers return a tensor in transformers 5 and a tuple (hidden, ...) before.
        return out if isinstance(out, torch.Tensor) else out[0]


class Head(nn.Module):
    """``hidden, targets -> summed token loss`` through the HF head modules in order."""

    def __init__(self, parts: dict[str, nn.Module]):
        super().__init__()
        self.parts = nn.ModuleDict(parts)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        for module in self.parts.values():
            hidden = module(hidden)
        return hidden

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return token_loss_sum(self.logits(hidden), targets)


def build_from_recipe(recipe: Recipe, cfg: ModelConfig) -> LayerStack:
    """Build the HF model (the caller seeds the RNG) and cut it into a stack."""
    if cfg.d_model % cfg.heads:
        raise ValueError("d_model must be a multiple of heads")
    return cut_model(recipe, recipe.make(cfg), cfg.to_dict(), decay_groups=cfg.decay_groups)


def cut_model(recipe: Recipe, model: nn.Module, stack_config: dict, *, decay_groups: bool = False) -> LayerStack:
    """``model``'s parts, as ``recipe`` finds them, moved into a layer stack."""
    if model.config._attn_implementation != "sdpa":  # a lone block is only causal under sdpa
        raise RuntimeError(f"expected sdpa attention, got {model.config._attn_implementation!r}")
    aux = model.get_submodule(recipe.block_aux) if recipe.block_aux else None
    base, _, blocks_attr = recipe.blocks.rpartition(".")
    masks = LayerMasks(model.get_submodule(base), blocks_attr) if recipe.layer_masks else None
    layers = [Layer("pre", "pre", recipe.pre(model))]
    for i, layer in enumerate(model.get_submodule(recipe.blocks)):
        block_aux = copy.deepcopy(aux) if aux is not None else None
        layers.append(Layer(f"block.{i}", "block", Block(layer, recipe.block_kwargs, block_aux, masks, i)))
    parts = {path.rsplit(".", 1)[-1]: model.get_submodule(path) for path in recipe.head}
    if len(parts) != len(recipe.head):
        raise ValueError(f"head paths must end in distinct names: {recipe.head}")
    layers.append(Layer("post", "post", Head(parts)))
    stack = LayerStack(layers, stack_config, model.config.vocab_size, decay_groups=decay_groups)
    if recipe.routers and getattr(model.config, "output_router_logits", False):
        stack.router_balance = RouterBalance.attach(model, list(model.get_submodule(recipe.blocks)))
    stack.train(True)  # like the built-in model; the relay sets the mode it needs
    return stack


# ---- GPT-2 -----------------------------------------------------------------

def _make_gpt2(cfg: ModelConfig) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=BYTE_VOCAB, n_positions=cfg.seq_len, n_embd=cfg.d_model, n_layer=cfg.layers,
        n_head=cfg.heads, n_inner=4 * cfg.d_model,
        resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout,
        bos_token_id=None, eos_token_id=None,  # defaults (50256) lie outside a byte vocabulary
        tie_word_embeddings=False, attn_implementation="sdpa")
    return GPT2LMHeadModel(config)


def _gpt2_pre(model: nn.Module) -> nn.Module:
    t = model.transformer
    return Embed(t.wte, t.wpe, t.drop)


GPT2 = Recipe(make=_make_gpt2, pre=_gpt2_pre, blocks="transformer.h", head=("transformer.ln_f", "lm_head"))


def build_hf_gpt2(cfg: ModelConfig) -> LayerStack:
    """HF GPT-2 over bytes, as a layer stack (causal objective)."""
    return build_from_recipe(GPT2, cfg)


# ---- BERT ------------------------------------------------------------------

class BertEmbed(nn.Module):
    """HF ``BertEmbeddings`` as ``tokens -> hidden``, with positions and token types given explicitly."""

    def __init__(self, embeddings: nn.Module):
        super().__init__()
        # the index buffers those replace are dropped: never read, and a model built on
        # the meta device would carry them as placeholders that cannot move to a device
        for name in ("position_ids", "token_type_ids"):
            embeddings._buffers.pop(name, None)
        self.embeddings = embeddings

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)
        return self.embeddings(input_ids=tokens, position_ids=positions,
                               token_type_ids=torch.zeros_like(tokens))


def _make_bert(cfg: ModelConfig) -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        vocab_size=MASK_TOKEN + 1, hidden_size=cfg.d_model, num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads, intermediate_size=4 * cfg.d_model,
        max_position_embeddings=cfg.seq_len, type_vocab_size=2,
        hidden_dropout_prob=cfg.dropout, attention_probs_dropout_prob=cfg.dropout,
        pad_token_id=None, tie_word_embeddings=False, attn_implementation="sdpa")
    return BertForMaskedLM(config)


def _bert_pre(model: nn.Module) -> nn.Module:
    return BertEmbed(model.bert.embeddings)


BERT = Recipe(make=_make_bert, pre=_bert_pre, blocks="bert.encoder.layer",
              head=("cls.predictions.transform", "cls.predictions.decoder"))


def build_hf_bert(cfg: ModelConfig) -> LayerStack:
    """HF BERT over bytes plus a mask token, as a layer stack (masked-LM objective)."""
    return build_from_recipe(BERT, cfg)


# ---- Llama-style decoders (Llama, Mistral, Qwen2, Qwen3) --------------------

def _decoder_pre(model: nn.Module) -> nn.Module:
    return Embed(model.model.embed_tokens)


def _rotary_kwargs(rotary: nn.Module | None, hidden: torch.Tensor) -> dict[str, Any]:
    """Positions 0..T-1 and their rotary embedding, which these layers take as arguments."""
    positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
    return {"position_embeddings": rotary(hidden, positions), "position_ids": positions}


DECODER = Recipe(make=None, pre=_decoder_pre, blocks="model.layers", head=("model.norm", "lm_head"),
                 block_kwargs=_rotary_kwargs, block_aux="model.rotary_emb", layer_masks=True)


# ---- Mixture-of-experts decoders (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) ----------
# The HF decoder layer is the block, as for Llama: its router, top-k, experts and
# shared expert (Qwen2-MoE's, with its sigmoid gate) are transformers' own modules,
# and one block -- all its experts -- is one EPS entry.

MOE_DECODER = Recipe(make=None, pre=_decoder_pre, blocks="model.layers", head=("model.norm", "lm_head"),
                     block_kwargs=_rotary_kwargs, block_aux="model.rotary_emb", layer_masks=True, routers=True)
