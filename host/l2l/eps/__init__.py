"""The eager param-server (EPS) and its backends, chosen by name."""
from __future__ import annotations

from ..errors import UserError
from .backend import EpsBackend
from .board_backend import BoardBackend
from .contract import OPTIMIZERS, LambScalars, LambStep, LionScalars, OptimizerHyper, StepScalars
from .hls_csim_backend import HlsCsimBackend
from .numpy_backend import NumpyBackend
from .opencl_backend import OpenCLBackend
from .rtl_backend import RtlBackend
from .server import EagerParamServer

BACKENDS: dict[str, type[EpsBackend]] = {
    NumpyBackend.name: NumpyBackend,
    OpenCLBackend.name: OpenCLBackend,
    HlsCsimBackend.name: HlsCsimBackend,
    RtlBackend.name: RtlBackend,
    BoardBackend.name: BoardBackend,
}


def make_backend(name: str, **options) -> EpsBackend:
    try:
        cls = BACKENDS[name]
    except KeyError:
        raise UserError(f"unknown EPS backend {name!r}; choose one of {', '.join(BACKENDS)}") from None
    ok, why = cls.availability()
    if not ok:
        raise UserError(f"EPS backend {name!r} is not usable here: {why}")
    return cls(**options)


def shares_masters(name: str, **options) -> bool:
    """Whether EPS backend ``name`` built with ``options`` gives its fp32 masters as the CPU
    device's copies (:meth:`EpsBackend.shares_masters`), without building it."""
    cls = BACKENDS.get(name)
    return cls is not None and cls.shares_masters(**options)


__all__ = ["BACKENDS", "BoardBackend", "EagerParamServer", "EpsBackend", "HlsCsimBackend", "LambScalars", "LambStep", "LionScalars",
           "NumpyBackend", "OPTIMIZERS", "OpenCLBackend", "OptimizerHyper", "RtlBackend", "StepScalars", "make_backend",
           "shares_masters"]
