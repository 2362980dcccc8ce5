"""The shape of a model: what every model family is built from."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from ..tokenizer import BYTE_VOCAB, MASK_TOKEN  # noqa: F401 -- the byte ids the built-in models are sized by


@dataclass(frozen=True)
class ModelConfig:
    family: str = "gpt"
    layers: int = 4
    d_model: int = 128
    heads: int = 4
    seq_len: int = 128
    dropout: float = 0.0
    init: str = "pretrained"  # a model directory: its weights, or "random" (built-in families: random)
    decay_groups: bool = True  # weight decay by Trainer's parameter groups (decayed parameters first)

    def to_dict(self) -> dict:
        """The shape, as checkpoints record it (``init`` is not shape: a resume reads the weights;
        the grouping is in the stack's signature, as the layouts' boundaries)."""
        d = asdict(self)
        del d["init"], d["decay_groups"]
        return d
