"""The built-in GPT decoder, written as a layer stack.

Pre-LN blocks, causal attention through ``scaled_dot_product_attention``,
GELU MLP, learned positions, untied head (the relay keeps each layer's weights
on its own; see README, "Tied embeddings").
"""
from __future__ import annotations

import math
from functools import partial

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from .config import BYTE_VOCAB, ModelConfig
from ..seeds import derive_seed
from .stack import FlatLayout, Layer, LayerStack, token_loss_sum


class Embeddings(nn.Module):
    def __init__(self, cfg: ModelConfig, vocab: int):
        super().__init__()
        # shapes only: the weights come from the stack's source (nn.Embedding's own init
        # draws normal_, which on the meta device imports torch's compiler, ~70 MB resident)
        self.tok = nn.Embedding.from_pretrained(torch.empty(vocab, cfg.d_model), freeze=False)
        self.pos = nn.Embedding.from_pretrained(torch.empty(cfg.seq_len, cfg.d_model), freeze=False)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.drop(self.tok(tokens) + self.pos(positions))


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.dropout = cfg.dropout
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.out = nn.Linear(4 * cfg.d_model, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class Head(nn.Module):
    def __init__(self, cfg: ModelConfig, vocab: int):
        super().__init__()
        self.ln = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, vocab, bias=False)

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return token_loss_sum(self.lm_head(self.ln(x)), targets)


def _initial_weights(layout: FlatLayout, seed: int, std: float, resid_std: float) -> np.ndarray:
    """One layer's initial weights as its flat vector, drawn from a generator of its own:
    biases 0, norm gains 1, matrices normal with std 0.02 (residual projections scaled
    by ``1/sqrt(2 * layers)``, as GPT-2 does)."""
    flat = np.empty(layout.numel, dtype=np.float32)
    generator = torch.Generator().manual_seed(seed)
    for name, view in layout.views(torch.from_numpy(flat)).items():
        if name.endswith("bias"):
            view.zero_()
        elif view.dim() == 1:  # LayerNorm gain
            view.fill_(1.0)
        else:
            view.normal_(0.0, resid_std if name.endswith(("proj.weight", "out.weight")) else std,
                         generator=generator)
    return flat


def build_gpt(cfg: ModelConfig, seed: int) -> LayerStack:
    """The stack as shapes (meta tensors); each layer's initial weights are made when the
    EPS reads them (``Layer.source``), from a seed of its own derived from ``seed``, so the
    model is never whole in memory and any layer can be made alone, in any order."""
    if cfg.d_model % cfg.heads:
        raise ValueError("d_model must be a multiple of heads")
    std, resid_std = 0.02, 0.02 / math.sqrt(2 * cfg.layers)
    with torch.device("meta"):
        modules = [("pre", "pre", Embeddings(cfg, BYTE_VOCAB))]
        modules += [(f"block.{i}", "block", Block(cfg)) for i in range(cfg.layers)]
        modules.append(("post", "post", Head(cfg, BYTE_VOCAB)))
    layers = []
    for i, (name, kind, module) in enumerate(modules):
        layer = Layer(name, kind, module)
        layers.append(layer)
    stack = LayerStack(layers, cfg.to_dict(), BYTE_VOCAB, decay_groups=cfg.decay_groups)
    for i, layer in enumerate(stack.layers):  # after the stack has laid the layers out
        layer.source = partial(_initial_weights, layer.layout, derive_seed(seed, "gpt-init", i), std, resid_std)
    return stack
