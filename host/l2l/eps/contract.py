"""The host side of the EPS numerical contract (docs/eps-numerics.md).

Hyper-parameters live here in float64; the step scalars (:class:`StepScalars` for AdamW,
:class:`LionScalars` for Lion, :class:`LambScalars` for LAMB) are the binary32 values every backend (NumPy, OpenCL, HLS, RTL)
receives, computed once per layer update in float64 and rounded once. Their field order is
the argument order shared by every kernel source (after the buffers and ``n``).
:data:`OPTIMIZERS` declares each optimizer's state beside the master weights: what the
backends allocate, checkpoints name and the planner counts.
"""
from __future__ import annotations

import math
from dataclasses import astuple, dataclass, fields

import numpy as np


@dataclass(frozen=True)
class OptimizerHyper:
    """One optimizer and its hyper-parameters (``eps``: AdamW's and LAMB's)."""
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01
    optimizer: str = "adamw"

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer {self.optimizer!r}; expected one of {', '.join(OPTIMIZERS)}")


class _Scalars:
    """What every optimizer's step scalars give: their names and values in kernel order."""

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def as_tuple(self) -> tuple[np.float32, ...]:
        return astuple(self)


@dataclass(frozen=True)
class StepScalars(_Scalars):
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
    def compute(cls, hyper: OptimizerHyper, t: int, loss_scale: float = 1.0,
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



@dataclass(frozen=True)
class LionScalars(_Scalars):
    """Binary32 scalars of one Lion update (Chen et al. 2023), in the kernels' order. Lion has
    no bias correction: ``t`` does not enter."""

    decay: np.float32
    b1: np.float32
    omb1: np.float32
    b2: np.float32
    omb2: np.float32
    neg_lr: np.float32
    inv_scale: np.float32

    @classmethod
    def compute(cls, hyper: OptimizerHyper, t: int, loss_scale: float = 1.0,
                divisor: float = 1.0) -> "LionScalars":
        if t < 1:
            raise ValueError("step count t starts at 1")
        f32 = np.float32
        return cls(
            decay=f32(1.0 - hyper.lr * hyper.weight_decay),
            b1=f32(hyper.beta1),
            omb1=f32(1.0 - hyper.beta1),
            b2=f32(hyper.beta2),
            omb2=f32(1.0 - hyper.beta2),
            neg_lr=f32(-hyper.lr),
            inv_scale=f32(1.0 / (loss_scale * divisor)),
        )



@dataclass(frozen=True)
class LambScalars(_Scalars):
    """Binary32 scalars of one LAMB update (You et al. 2019, timm's ``Lamb``: bias-corrected,
    the weight decay added to the update, each decayed tensor's step scaled by its trust
    ratio), in the kernels' order. The per-tensor step sizes come after the norm pass
    (:func:`~l2l.eps.numerics.lamb_steps`), not from here."""

    b1: np.float32
    omb1: np.float32
    b2: np.float32
    omb2: np.float32
    inv_bc2_sqrt: np.float32
    eps: np.float32
    inv_bc1: np.float32
    wd: np.float32
    inv_scale: np.float32
    lr: float = 0.0        # binary64, for the host's step sizes (not a kernel argument)
    adapt: bool = True     # weight_decay != 0: the decayed tensors take their trust ratio (timm's rule)

    _HOST_ONLY = ("lr", "adapt")  # the fold's, not the kernels'

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls) if f.name not in cls._HOST_ONLY)

    def as_tuple(self) -> tuple[np.float32, ...]:
        return tuple(getattr(self, name) for name in self.names())

    @classmethod
    def compute(cls, hyper: OptimizerHyper, t: int, loss_scale: float = 1.0,
                divisor: float = 1.0) -> "LambScalars":
        if t < 1:
            raise ValueError("step count t starts at 1")
        f32 = np.float32
        return cls(
            b1=f32(hyper.beta1),
            omb1=f32(1.0 - hyper.beta1),
            b2=f32(hyper.beta2),
            omb2=f32(1.0 - hyper.beta2),
            inv_bc2_sqrt=f32(1.0 / math.sqrt(1.0 - hyper.beta2 ** t)),
            eps=f32(hyper.eps),
            inv_bc1=f32(1.0 / (1.0 - hyper.beta1 ** t)),
            wd=f32(hyper.weight_decay),
            inv_scale=f32(1.0 / (loss_scale * divisor)),
            lr=float(hyper.lr),
            adapt=hyper.weight_decay != 0,
        )


@dataclass(frozen=True)
class LambStep:
    """What one LAMB update takes beside the gradients: its scalars, the entry's segments
    (:func:`~l2l.eps.numerics.lamb_segments`) and the host's fold of the norm pass's sums into
    each segment's step size, called between the two passes (a sharded EPS sums the
    machines' sums first)."""

    scalars: LambScalars
    segments: "object"   # l2l.eps.numerics.Segments of the elements the backend holds
    steps: "object"      # (sums: float32 (nseg, 2, LANES)) -> float32 (nseg,) step sizes

    @property
    def inv_scale(self) -> np.float32:
        return self.scalars.inv_scale


@dataclass(frozen=True)
class Optimizer:
    """What an optimizer keeps and takes: its state arrays beside the fp32 masters ``p``
    (binary32, zero at the start, in checkpoint order) and its step scalars."""
    name: str
    moments: tuple[str, ...]
    scalars: type

    @property
    def state(self) -> tuple[str, ...]:
        """Every state array of an entry: ``p`` then the moments (``layer{i}.<name>`` in a checkpoint)."""
        return ("p",) + self.moments

    @property
    def state_bytes(self) -> int:
        """Host bytes of state per parameter: 4 a binary32 array."""
        return 4 * len(self.state)


OPTIMIZERS = {
    "adamw": Optimizer("adamw", ("m", "v"), StepScalars),
    "lion": Optimizer("lion", ("m",), LionScalars),
    "lamb": Optimizer("lamb", ("m", "v"), LambScalars),
}


def optimizer_of(scalars) -> Optimizer:
    """The optimizer whose step scalars these are."""
    if isinstance(scalars, LambStep):
        scalars = scalars.scalars
    for opt in OPTIMIZERS.values():
        if isinstance(scalars, opt.scalars):
            return opt
    raise TypeError(f"not step scalars: {type(scalars).__name__}")


def step_scalars(hyper: OptimizerHyper, t: int, loss_scale: float = 1.0, divisor: float = 1.0):
    """The scalars of the layer's ``t``-th update under ``hyper``'s optimizer."""
    return OPTIMIZERS[hyper.optimizer].scalars.compute(hyper, t, loss_scale, divisor)


def inv_scale(loss_scale: float = 1.0, divisor: float = 1.0) -> np.float32:
    """The gradient's scale, the same scalar in every optimizer: ``1 / (loss_scale * divisor)``."""
    return np.float32(1.0 / (loss_scale * divisor))
