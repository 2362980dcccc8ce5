"""A layer's module with placeholder parameters, bound to fetched weights while it runs.

The master weights live in the EPS, so the relay's modules keep only shapes
(meta tensors). To run a layer, the weights it fetched are bound into the
module's parameter slots for as long as the layer computes -- once per layer and
pass, not per micro-batch as ``torch.func.functional_call`` would do (its per-call
bookkeeping is a few percent of a CPU step at 8 micro-batches) -- and the
placeholders are put back afterwards. A weight shared by two submodules (tied)
is bound at every place it appears, under the name ``named_parameters`` gives it
first, which is the name the layer's flat layout uses.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn


class WeightBinding:
    def __init__(self, module: nn.Module, device: torch.device) -> None:
        """Strip ``module``'s parameters (to meta placeholders) and move its buffers to ``device``."""
        self.module = module
        first: dict[int, str] = {}
        self._sites: dict[str, list[tuple[nn.Module, str]]] = {}
        self._placeholders: dict[str, nn.Parameter] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            key = first.setdefault(id(p), name)
            owner, _, attr = name.rpartition(".")
            self._sites.setdefault(key, []).append((module.get_submodule(owner), attr))
            if key not in self._placeholders:
                self._placeholders[key] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                                       requires_grad=False)
        self._put(self._placeholders)
        for mod in module.modules():
            for name, b in list(mod._buffers.items()):
                if b is not None:
                    mod._buffers[name] = b.to(device)

    def _put(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, sites in self._sites.items():
            t = tensors[name]
            for owner, attr in sites:
                owner._parameters[attr] = t

    @contextmanager
    def bound(self, weights: dict[str, torch.Tensor]) -> Iterator[nn.Module]:
        """The module computing with ``weights`` (name -> tensor) until the block exits."""
        self._put(weights)
        try:
            yield self.module
        finally:
            self._put(self._placeholders)
