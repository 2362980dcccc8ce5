"""Where a mixture-of-experts model's expert weights lie on disk, one tensor per expert.

transformers 5 keeps a layer's experts fused in memory -- ``experts.gate_up_proj``
``[E, 2I, H]`` (each expert's gate projection, then its up projection) and
``experts.down_proj`` ``[E, H, I]`` -- but ``save_pretrained`` writes them as before
fusion, one tensor per expert and projection (Mixtral's ``w1``/``w3``/``w2`` under
``block_sparse_moe``, the others' ``gate_proj``/``up_proj``/``down_proj``), and
``from_pretrained`` reads those names (and the fused ones) back. l2l reads a
checkpoint by the names the in-memory model gives its parameters, so a fused
parameter is a list of :class:`Piece`\\ s: each stored tensor and where it lies in
the parameter. A checkpoint holding the fused names is read as it is; an export
writes the per-expert names, as ``save_pretrained`` does, so a zero-step export
is the source tensor for tensor (and other tools that read per-expert checkpoints
read it). The table below restates what transformers' conversion mapping does for
these four families; ``tests/test_moe.py`` holds it to ``save_pretrained`` and
``from_pretrained``. (transformers 4, which kept the experts unfused in memory, is
refused for these families: ``hf_version.need_fused_experts``.)
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Piece:
    name: str     # the stored tensor's name
    index: tuple  # where it lies in the model's parameter: () the whole of it, else (expert, rows)


@dataclass(frozen=True)
class ExpertNames:
    block: str  # the MoE block's attribute in the stored names (``mlp`` in memory)
    gate: str   # the stored names of each expert's projections
    up: str
    down: str


# as save_pretrained writes them (transformers' conversion mapping, reversed)
STORED = {
    "mixtral": ExpertNames("block_sparse_moe", "w1", "w3", "w2"),
    "qwen2_moe": ExpertNames("mlp", "gate_proj", "up_proj", "down_proj"),
    "qwen3_moe": ExpertNames("mlp", "gate_proj", "up_proj", "down_proj"),
    "olmoe": ExpertNames("mlp", "gate_proj", "up_proj", "down_proj"),
}
_FUSED = re.compile(r"^(.*)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_MOE_BLOCK = re.compile(r"^(.*\.layers\.\d+)\.mlp\.")


def stored_pieces(model_type: str, name: str, shape: tuple[int, ...]) -> list[Piece]:
    """How ``save_pretrained`` stores the model's parameter ``name`` of ``shape``."""
    names = STORED.get(model_type)
    if names is None:
        return [Piece(name, ())]
    fused = _FUSED.match(name)
    if fused is None:  # the router and the rest: at most the block's attribute renamed
        if names.block != "mlp" and _is_moe_block_param(name):
            return [Piece(_MOE_BLOCK.sub(rf"\1.{names.block}.", name, count=1), ())]
        return [Piece(name, ())]
    prefix = f"{fused.group(1)}.{names.block}.experts"
    experts = shape[0]
    if fused.group(2) == "down_proj":
        return [Piece(f"{prefix}.{e}.{names.down}.weight", (e,)) for e in range(experts)]
    half = shape[1] // 2
    return [piece for e in range(experts) for piece in (
        Piece(f"{prefix}.{e}.{names.gate}.weight", (e, slice(0, half))),
        Piece(f"{prefix}.{e}.{names.up}.weight", (e, slice(half, 2 * half))))]


def _is_moe_block_param(name: str) -> bool:
    """Mixtral's ``mlp`` is always its MoE block (router and experts), renamed on disk."""
    return _MOE_BLOCK.match(name) is not None


def piece_shape(shape: tuple[int, ...], piece: Piece) -> tuple[int, ...]:
    return tuple(torch.empty(shape, device="meta")[piece.index].shape)
