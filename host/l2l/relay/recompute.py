"""Recompute that stops early: the forward's autograd graph, without its saved tensors.

The relay's forward runs each layer with autograd recording, but a saved-tensors
hook drops every tensor the graph would keep for backward; only the graph itself
(nodes and edges, host memory) waits for the backward. There the layer is
recomputed from its stashed input, with the weights fetched again, and the
recompute stops as soon as it has rebuilt the last tensor the graph saved: the
ops after it -- a GPT block's output projection and residual add -- are never
run again. That is the early stop of ``torch.utils.checkpoint`` (about 8% of a
block's step on a CPU), which the plain "recompute, then backward" forgoes.

The graph must not keep the forward's device tensors alive (a layer's weights
are freed once its micro-batches are done, and stashed boundaries may move to
host memory), so it has no leaves that hold data: the layer input and each
weight enter through a *tap*, an identity whose backward hands its gradient to
a sink -- the input gradient for the layer below, or an in-place add into the
weight's slice of the layer's gradient buffer (what ``AccumulateGrad`` does to
a preset ``.grad``, so the bits are the same) -- instead of to a leaf.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.autograd.graph import saved_tensors_hooks


class _Stop(Exception):
    """Raised inside the recompute once every tensor the graph saved is rebuilt."""


class _Tap(torch.autograd.Function):
    """Identity in forward; in backward, gives the gradient to ``sink`` and nothing upstream."""

    @staticmethod
    def forward(ctx, anchor, t, sink):
        ctx.sink = sink
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        ctx.sink(grad)
        return None, None, None


class _Root(torch.autograd.Function):
    """A scalar whose backward feeds ``source()`` (the upstream gradient) into ``y``'s graph."""

    @staticmethod
    def forward(ctx, y, source):
        ctx.source = source
        return y.new_zeros(())

    @staticmethod
    def backward(ctx, _):
        return ctx.source(), None


class WeightSinks:
    """One layer's weight gradients: bound to the gradient buffer's views in backward."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] | None = None

    def sink(self, name: str) -> Callable[[torch.Tensor], None]:
        def add(grad: torch.Tensor) -> None:
            self.grads[name].add_(grad)
        return add


class Recording:
    """One layer call's forward graph; ``backward`` recomputes what it needs and runs it."""

    def __init__(self) -> None:
        self._meta: list[tuple[torch.Size, torch.dtype]] = []
        self._recomputed: list[torch.Tensor] = []
        self._token: torch.Tensor | None = None
        self._upstream: torch.Tensor | None = None
        self.input_grad: torch.Tensor | None = None

    def _pack(self, t: torch.Tensor) -> int:
        self._meta.append((t.shape, t.dtype))
        return len(self._meta) - 1

    def _unpack(self, key: int) -> torch.Tensor:
        return self._recomputed[key]

    def _take_input_grad(self, grad: torch.Tensor) -> None:
        self.input_grad = grad

    def _refill(self, run: Callable[[], object]) -> None:
        want = len(self._meta)
        got = self._recomputed

        def pack(t: torch.Tensor) -> None:
            if (t.shape, t.dtype) != self._meta[len(got)]:
                raise RuntimeError("a layer's recompute diverged from its forward (saved tensor "
                                   f"{len(got)}: {tuple(t.shape)} {t.dtype}, forward saved "
                                   f"{tuple(self._meta[len(got)][0])} {self._meta[len(got)][1]})")
            got.append(t.detach())
            if len(got) == want:
                raise _Stop

        if want == 0:
            return
        with torch.enable_grad(), saved_tensors_hooks(pack, _never):
            try:
                run()
            except _Stop:
                return
        raise RuntimeError(f"a layer's recompute diverged from its forward (it saved {len(got)} tensors "
                           f"for backward, the forward {want}): its ops must depend only on its input, "
                           "its weights and the replayed random state")

    def backward(self, run: Callable[[], object], upstream: torch.Tensor) -> torch.Tensor | None:
        """Recompute through ``run`` (the layer on its stashed input, as in forward),
        back-propagate ``upstream``; returns the input's gradient (None for token inputs)."""
        self._refill(run)
        self._upstream = upstream
        token, self._token = self._token, None
        try:
            token.backward()
        finally:
            self._recomputed, self._upstream = [], None
        grad, self.input_grad = self.input_grad, None
        return grad


def _never(_):
    raise RuntimeError("a recompute's own graph was back-propagated")


class Recorder:
    """Taps for one device; records layer calls and replays them for backward."""

    def __init__(self, device: torch.device) -> None:
        # the taps' one input that requires grad, so their nodes enter the graph; holds no data
        self._anchor = torch.empty(0, device=device, requires_grad=True)

    def tap_weights(self, weights: dict[str, torch.Tensor], sinks: WeightSinks) -> dict[str, torch.Tensor]:
        """The weights as graph inputs (once per layer; every micro-batch's graph shares them)."""
        with torch.enable_grad():
            return {name: _Tap.apply(self._anchor, w, sinks.sink(name)) for name, w in weights.items()}

    def forward(self, call: Callable[[object], torch.Tensor], x: torch.Tensor) -> tuple[torch.Tensor, Recording]:
        """``call(x)`` with autograd recording and no tensor saved; returns the output
        (detached) and the recording that backward replays."""
        rec = Recording()
        with torch.enable_grad(), saved_tensors_hooks(rec._pack, rec._unpack):
            if x.is_floating_point():
                x = _Tap.apply(self._anchor, x, rec._take_input_grad)
            y = call(x)
            rec._token = _Root.apply(y, lambda: rec._upstream)
        return y.detach(), rec

    # A recompute calls the layer on leaves that require grad, so its ops save what
    # the forward's saved (their outputs are discarded: only the saved tensors count).
    @staticmethod
    def leaves(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name: Recorder.leaf(w) for name, w in weights.items()}

    @staticmethod
    def leaf(x: torch.Tensor) -> torch.Tensor:
        return x.detach().requires_grad_() if x.is_floating_point() else x
