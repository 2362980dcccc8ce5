"""The host side of the EPS numerical contract (docs/eps-numerics.md).

Hyper-parameters live here in float64; :class:`StepScalars` are the binary32
values every backend (NumPy, OpenCL, HLS, RTL) receives, computed once per
layer update in float64 and rounded once. Their field order is the argument
order shared by every kernel source (after the buffers and ``n``).
"""
from __future__ import annotations

import math
from dataclasses import astuple, dataclass, fields

import numpy as np


@dataclass(frozen=True)
class AdamWHyper:
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01


@dataclass(frozen=True)
class StepScalars:
    """Binary32 scalars of one layer update, in the contract's (and kernels') order."""

    decay: np.float32
    b1: np.float32
    omb1: np.float32
    b2: np.float32
    omb2: np.float32
    inv_bc2_sqrt: np.float32
    eps: np.float32
    neg_step: np.float32
    inv_scale: np.float32

    @classmethod
    def compute(cls, hyper: AdamWHyper, t: int, loss_scale: float = 1.0,
                divisor: float = 1.0) -> "StepScalars":
        """Scalars for the layer's ``t``-th update (t starts at 1)."""
        if t < 1:
            raise ValueError("step count t starts at 1")
        f32 = np.float32
        return cls(
            decay=f32(1.0 - hyper.lr * hyper.weight_decay),
            b1=f32(hyper.beta1),
            omb1=f32(1.0 - hyper.beta1),
            b2=f32(hyper.beta2),
            omb2=f32(1.0 - hyper.beta2),
            inv_bc2_sqrt=f32(1.0 / math.sqrt(1.0 - hyper.beta2 ** t)),
            eps=f32(hyper.eps),
            neg_step=f32(-hyper.lr / (1.0 - hyper.beta1 ** t)),
            inv_scale=f32(1.0 / (loss_scale * divisor)),
        )

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def as_tuple(self) -> tuple[np.float32, ...]:
        return astuple(self)
