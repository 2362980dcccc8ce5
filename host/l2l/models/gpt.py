"""The built-in GPT decoder, written as a layer stack.

Pre-LN blocks, causal attention through ``scaled_dot_product_attention``,
GELU MLP, learned positions, untied head (the relay keeps each layer's weights
on its own; see README, "Tied embeddings").
"""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from .config import BYTE_VOCAB, ModelConfig
from .stack import Layer, LayerStack, token_loss_sum


class Embeddings(nn.Module):
    def __init__(self, cfg: ModelConfig, vocab: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
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


def _init_weights(module: nn.Module, std: float, resid_std: float) -> None:
    for name, p in module.named_parameters():
        if name.endswith("bias"):
            nn.init.zeros_(p)
        elif p.dim() == 1:  # LayerNorm gain
            nn.init.ones_(p)
        else:
            nn.init.normal_(p, 0.0, resid_std if name.endswith(("proj.weight", "out.weight")) else std)


def build_gpt(cfg: ModelConfig) -> LayerStack:
    """Build the stack layer by layer (the caller seeds the RNG)."""
    if cfg.d_model % cfg.heads:
        raise ValueError("d_model must be a multiple of heads")
    std, resid_std = 0.02, 0.02 / math.sqrt(2 * cfg.layers)
    layers = [Layer("pre", "pre", Embeddings(cfg, BYTE_VOCAB))]
    for i in range(cfg.layers):
        layers.append(Layer(f"block.{i}", "block", Block(cfg)))
    layers.append(Layer("post", "post", Head(cfg, BYTE_VOCAB)))
    for layer in layers:
        _init_weights(layer.module, std, resid_std)
    return LayerStack(layers, cfg.to_dict(), BYTE_VOCAB)
