"""The attention mask transformers gives each decoder layer, asked of transformers itself.

A block of the stack runs alone, so the mask an HF model builds once in its
forward and hands to every layer never reaches it. Most layers need none (sdpa's
own ``is_causal`` is the causal mask), but a layer with a sliding window (Mistral's
``sliding_window``; Qwen2's and Qwen3's ``use_sliding_window`` with
``max_window_layers`` or ``layer_types``) must not see further back than the window.
Which layers slide, and the mask itself, changed between transformers releases, so
l2l does not decide either: :class:`LayerMasks` runs the base model's own forward on
a skeleton -- the same class and config on the meta device, its layers replaced by
recorders, its other parts by stubs -- and keeps the ``attention_mask`` each layer is
called with, once per sequence length, device and dtype. Training sequences have no
padding, which is what the probe's unpadded input is.
"""
from __future__ import annotations

import copy
import threading

import torch
from torch import nn


class _Recorded(Exception):
    """Raised by the last recorder: the probe has what it came for."""


class _Recorder(nn.Module):
    """Stands in for ``layer`` (a meta one): keeps the mask it is called with; any other
    attribute the model's forward reads of it (4.5x's ``attention_type``) is the layer's."""

    def __init__(self, layer: nn.Module, found: list, index: int, last: bool) -> None:
        super().__init__()
        self.layer = layer
        self.found, self.index, self.last = found, index, last

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            layer = self.__dict__.get("_modules", {}).get("layer")
            if layer is None:
                raise
            return getattr(layer, name)

    def forward(self, hidden_states, *args, **kwargs):
        if "attention_mask" not in kwargs:
            raise RuntimeError("this transformers release calls its decoder layers without an attention_mask "
                               "keyword; l2l cannot tell which mask each layer gets")
        self.found[self.index] = kwargs["attention_mask"]
        if self.last:
            raise _Recorded
        return hidden_states


class _Unused(nn.Module):
    """Stands in for the embedding, rotary embedding and final norm: the probe needs none."""

    def forward(self, *args, **kwargs):
        return None


class LayerMasks:
    """Per decoder layer, the attention mask ``base``'s forward would pass it (None: none,
    sdpa's ``is_causal`` applies), for the layers at ``layers_attr`` of ``base``."""

    def __init__(self, base: nn.Module, layers_attr: str) -> None:
        self._base_class = type(base)
        self._config = copy.deepcopy(base.config)
        self._layers_attr = layers_attr
        self._count = len(getattr(base, layers_attr))
        self._cache: dict[tuple, list] = {}
        self._lock = threading.Lock()  # data-parallel workers ask from their own threads

    def mask(self, index: int, hidden: torch.Tensor) -> torch.Tensor | None:
        """Layer ``index``'s mask for ``hidden`` (batch, length, width), on its device."""
        key = (hidden.shape[1], hidden.device, hidden.dtype)
        with self._lock:
            masks = self._cache.get(key)
            if masks is None:
                masks = self._cache[key] = self._probe(hidden)
        return masks[index]

    def _probe(self, hidden: torch.Tensor) -> list:
        with torch.random.fork_rng(devices=[]), torch.device("meta"):  # the run's random stream untouched
            skeleton = self._base_class(self._config)
        found: list = [None] * self._count
        layers = getattr(skeleton, self._layers_attr)
        for name, _ in list(skeleton.named_children()):
            setattr(skeleton, name, _Unused())
        setattr(skeleton, self._layers_attr, nn.ModuleList(
            _Recorder(layer, found, i, i == self._count - 1) for i, layer in enumerate(layers)))
        skeleton.eval()
        try:
            with torch.no_grad():
                skeleton(inputs_embeds=hidden[:1].detach(), use_cache=False)
        except _Recorded:
            return found
        raise RuntimeError("the base model's forward never reached its last decoder layer")

    def __deepcopy__(self, memo) -> "LayerMasks":
        """A copy (a data-parallel worker's stack) shares nothing mutable: its own cache and lock."""
        new = copy.copy(self)
        new._cache, new._lock = {}, threading.Lock()
        return new
