"""The shape of a model: what every model family is built from."""
from __future__ import annotations

from dataclasses import asdict, dataclass

BYTE_VOCAB = 256  # byte-level tokens
MASK_TOKEN = 256  # extra token for masked-LM objectives


@dataclass(frozen=True)
class ModelConfig:
    family: str = "gpt"
    layers: int = 4
    d_model: int = 128
    heads: int = 4
    seq_len: int = 128
    dropout: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)
