"""l2l: layer-to-layer training with an eager param-server.

The public API, for training a model of your own through the relay and the EPS
(``docs/custom-model.md`` has a runnable example):

* :class:`Layer`, :class:`LayerStack` -- your model cut into a pre stage
  (tokens -> hidden), blocks (hidden -> hidden) and a post stage (hidden,
  targets -> summed loss); :func:`token_loss_sum` is that loss for logits.
* :func:`relay` -- a :class:`RelayEngine` for a stack: the EPS (fp32 masters,
  AdamW, the chosen backend) and the layer-by-layer schedule over micro-batches.
* :class:`Batch` -- inputs and targets (``IGNORE_INDEX`` where no loss counts).
* :class:`Engine` / :class:`StepResult` -- what every engine does and reports
  (``train_step``, ``evaluate``, ``set_lr``, state in and out, ``close``);
  :class:`PlainEngine` is the in-memory baseline with the same interface.
* :class:`OptimizerHyper` -- the optimizer's hyper-parameters.

Names are imported on first use, so ``import l2l`` costs nothing and changes nothing.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "OptimizerHyper": "l2l.eps", "Batch": "l2l.data", "Engine": "l2l.engine", "StepResult": "l2l.engine",
    "IGNORE_INDEX": "l2l.models.stack", "Layer": "l2l.models.stack", "LayerStack": "l2l.models.stack",
    "token_loss_sum": "l2l.models.stack", "PlainEngine": "l2l.baseline", "RelayEngine": "l2l.relay.engine",
    "relay": "l2l.build",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'l2l' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
