"""The planner's view of a model: per layer, its parameters and the FLOPs of each relay pass.

The built-in GPT is counted by formula (:func:`gpt_layer_shapes`, checked against the real
stack by the tests); any other family is built on the meta device and counted
(:func:`meta_layer_shapes`).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..config import TrainConfig
from ..errors import UserError

# bytes per element of what the device computes in (weights, their device copy,
# gradients and activations); the EPS keeps fp32 master weights and moments.
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
EPS_STATE_BYTES = 12  # fp32 p, m, v per parameter on the host: AdamW's (eps_state_bytes for the others)


def eps_state_bytes(cfg) -> int:
    """The EPS state's host bytes a parameter under ``cfg``'s optimizer: 4 for ``p`` and 4 a moment."""
    from ..eps.contract import OPTIMIZERS
    return OPTIMIZERS[getattr(cfg, "optimizer", "adamw")].state_bytes
INBOXES_IN_FLIGHT = 2  # gradient inboxes held at once: the layer in backward, the one updating


# ---------------------------------------------------------------- model shape

@dataclass(frozen=True)
class LayerShape:
    """What the planner needs of one layer of the stack."""

    name: str
    kind: str           # "pre" | "block" | "post"
    params: int         # elements the layer fetches: its flat buffer and any shared (tied) entry
    matmul_params: int  # weights used in matrix products: 2 * this FLOPs per token
    attention: bool     # a block: causal self-attention over the sequence
    tail_matmul_params: int = 0  # of those, used after the last tensor backward needs:
    #                              the early-stopping recompute skips them
    counted_before: int = 0  # of ``params``, those an earlier layer also fetches (a tied
    #                          embedding's second user): the EPS stores them once

    def forward_flops(self, batch: int, seq_len: int, d_model: int) -> float:
        """FLOPs of one forward over ``batch`` sequences of ``seq_len`` tokens."""
        tokens = batch * seq_len
        flops = 2.0 * self.matmul_params * tokens
        if self.attention:
            flops += 4.0 * batch * seq_len * seq_len * d_model  # QK^T and AV, 2*b*T^2*d each
        return flops

    def backward_flops(self, batch: int, seq_len: int, d_model: int) -> float:
        """FLOPs of one recompute (stopping early) + backward over ``batch`` sequences."""
        return (3.0 * self.forward_flops(batch, seq_len, d_model)
                - 2.0 * self.tail_matmul_params * batch * seq_len)

    def pass_flops(self, kind: str, batch: int, seq_len: int, d_model: int) -> float:
        """FLOPs of one call of the relay's pass ``kind`` ("fwd", "post", "bwd")."""
        if kind == "fwd":
            return self.forward_flops(batch, seq_len, d_model)
        return self.backward_flops(batch, seq_len, d_model)  # the post stage has no tail: 3x forward


def gpt_layer_shapes(layers: int, d_model: int, seq_len: int, vocab: int = 256) -> list[LayerShape]:
    """The built-in GPT (``models/gpt.py``), counted by hand.

    pre: token + position embeddings, ``vocab*d + T*d``; a block: qkv ``3d^2+3d``,
    proj ``d^2+d``, fc ``4d^2+4d``, out ``4d^2+d``, two layer norms ``4d``:
    ``12d^2 + 13d``, of which ``12d^2`` multiply (the last, out's ``4d^2``, after
    every tensor backward needs); post: norm ``2d`` and the untied head ``d*vocab``.
    """
    d = d_model
    shapes = [LayerShape("pre", "pre", vocab * d + seq_len * d, 0, False)]
    shapes += [LayerShape(f"block.{i}", "block", 12 * d * d + 13 * d, 12 * d * d, True, 4 * d * d) for i in range(layers)]
    shapes.append(LayerShape("post", "post", d * vocab + 2 * d, d * vocab, False))
    return shapes


def with_model_shape(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with the shape a model directory's config gives (its depth, width and heads
    rule over the shape options, which only describe the built-in models)."""
    from ..models.pretrained import is_model_dir, model_shape
    if not is_model_dir(cfg.model):
        return cfg
    layers, d_model, heads = model_shape(cfg.model)
    return replace(cfg, layers=layers, d_model=d_model, heads=heads)


def layer_shapes(cfg: TrainConfig) -> list[LayerShape]:
    """Per-layer sizes of ``cfg``'s stack: by formula for ``gpt``, otherwise counted
    on the stack built on the meta device (:func:`meta_layer_shapes`)."""
    if cfg.model == "gpt":
        from ..models.config import BYTE_VOCAB
        return gpt_layer_shapes(cfg.layers, cfg.d_model, cfg.seq_len, BYTE_VOCAB)
    return meta_layer_shapes(cfg)


def meta_layer_shapes(cfg: TrainConfig) -> list[LayerShape]:
    """Build the stack on the meta device (shapes only: no memory, no init) and count:
    every parameter of a layer, and as matmul weights its 2-D parameters outside
    embeddings (``nn.Linear``, HF's ``Conv1D``)."""
    from ..models import build_stack
    with torch.device("meta"):
        stack = build_stack(cfg.model_config(), 0)
    shapes = []
    for i, layer in enumerate(stack.layers):
        matmul = 0
        for module in layer.module.modules():
            if isinstance(module, torch.nn.Embedding):
                continue  # a gather, not a product
            matmul += sum(p.numel() for p in module.parameters(recurse=False) if p.dim() >= 2)
        shared = [stack.shared[t] for t in layer.shared.values()]
        fetched = layer.layout.numel + sum(sh.numel for sh in shared)
        before = sum(sh.numel for sh in shared if sh.users[0][0] != i)
        shapes.append(LayerShape(layer.name, layer.kind, fetched, matmul, layer.kind == "block",
                                 counted_before=before))
    return shapes


def dtype_bytes_of(cfg: TrainConfig, dtype_bytes: int | None = None) -> int:
    """``dtype_bytes`` when given, else what ``cfg.precision`` computes in (fp32 when absent)."""
    if dtype_bytes is not None:
        if dtype_bytes not in (1, 2, 4, 8):
            raise UserError(f"dtype bytes must be 1, 2, 4 or 8 (got {dtype_bytes})")
        return dtype_bytes
    precision = getattr(cfg, "precision", "fp32")
    return DTYPE_BYTES.get(precision, 4)
