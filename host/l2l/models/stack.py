"""A model as a relay of layers: pre stage, N blocks, post stage.

The relay never sees a model as a whole. It sees an ordered list of
:class:`Layer` objects, each an ``nn.Module`` with one calling convention:

* ``pre``:   ``module(tokens: LongTensor[B, T]) -> hidden``
* ``block``: ``module(hidden) -> hidden``
* ``post``:  ``module(hidden, targets: LongTensor[B, T]) -> loss_sum``
  where ``loss_sum`` is the *summed* token loss over positions whose target
  is not :data:`IGNORE_INDEX`. Summing (not averaging) lets micro-batches with
  different numbers of targets add up to exactly the global mean once divided
  by the global target count.

Each layer's parameters are addressed through a :class:`FlatLayout`: one
contiguous fp32 vector per layer, the unit the EPS stores and updates.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

IGNORE_INDEX = -100


@dataclass(frozen=True)
class ParamSlot:
    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int


@dataclass(frozen=True)
class FlatLayout:
    """Where each named parameter of a layer lives inside its flat buffer."""

    slots: tuple[ParamSlot, ...]
    numel: int

    @classmethod
    def of(cls, module: nn.Module) -> "FlatLayout":
        slots, offset = [], 0
        for name, p in module.named_parameters():  # shared parameters appear once
            n = p.numel()
            slots.append(ParamSlot(name, tuple(p.shape), offset, n))
            offset += n
        return cls(tuple(slots), offset)

    def flatten(self, module: nn.Module) -> np.ndarray:
        """The module's current parameters as one fresh fp32 vector."""
        params = dict(module.named_parameters())
        out = np.empty(self.numel, dtype=np.float32)
        for s in self.slots:
            out[s.offset:s.offset + s.numel] = params[s.name].detach().reshape(-1).float().cpu().numpy()
        return out

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Named tensors viewing ``flat``; no copy."""
        return {s.name: flat[s.offset:s.offset + s.numel].view(s.shape) for s in self.slots}

    def signature(self) -> list[list[Any]]:
        """JSON-able description, used to refuse a checkpoint of another shape."""
        return [[s.name, list(s.shape)] for s in self.slots]


@dataclass
class Layer:
    name: str
    kind: str  # "pre" | "block" | "post"
    module: nn.Module
    # where the initial weights come from when the module has none of its own (a model
    # built on the meta device, its weights read from a checkpoint); None: the module's
    source: Callable[[], np.ndarray] | None = None
    layout: FlatLayout = field(init=False)

    def __post_init__(self) -> None:
        if self.kind not in ("pre", "block", "post"):
            raise ValueError(f"unknown layer kind {self.kind!r}")
        self.layout = FlatLayout.of(self.module)


@dataclass
class LayerStack:
    """An ordered relay of layers plus the config that rebuilds it."""

    layers: list[Layer]
    config: dict[str, Any]
    vocab_size: int

    def __post_init__(self) -> None:
        kinds = [layer.kind for layer in self.layers]
        if len(kinds) < 3 or kinds[0] != "pre" or kinds[-1] != "post" or set(kinds[1:-1]) != {"block"}:
            raise ValueError(f"a layer stack is pre, blocks, post; got {kinds}")

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def num_params(self) -> int:
        return sum(layer.layout.numel for layer in self.layers)

    def signature(self) -> dict[str, Any]:
        return {"config": self.config, "layers": [[l.name, l.layout.numel] for l in self.layers]}

    def initial_weights(self, i: int) -> np.ndarray:
        """Layer ``i``'s initial weights as one fp32 vector in its layout (read one layer at a time)."""
        layer = self.layers[i]
        flat = layer.source() if layer.source is not None else layer.layout.flatten(layer.module)
        if flat.shape != (layer.layout.numel,) or flat.dtype != np.float32:
            raise ValueError(f"{layer.name}: initial weights of shape {flat.shape} and dtype {flat.dtype}, "
                             f"expected ({layer.layout.numel},) float32")
        return flat

    def materialize(self, device: torch.device) -> None:
        """Give every layer whose parameters are meta placeholders real parameters on
        ``device``, filled with its initial weights (what an in-memory engine needs)."""
        for i, layer in enumerate(self.layers):
            if not any(p.is_meta for p in layer.module.parameters()):
                continue
            flat = torch.from_numpy(self.initial_weights(i))
            fresh = {s.name: nn.Parameter(flat[s.offset:s.offset + s.numel].view(s.shape).to(device).clone())
                     for s in layer.layout.slots}
            first: dict[int, str] = {}
            for name, p in list(layer.module.named_parameters(remove_duplicate=False)):
                owner, _, attr = name.rpartition(".")
                layer.module.get_submodule(owner)._parameters[attr] = fresh[first.setdefault(id(p), name)]

    def train(self, mode: bool = True) -> None:
        for layer in self.layers:
            layer.module.train(mode)


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy over non-ignored targets, computed in fp32."""
    return nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
        ignore_index=IGNORE_INDEX, reduction="sum")
