"""Mixture-of-experts routers' load-balancing loss, computed across a relayed step.

With ``output_router_logits`` in its config, a Hugging Face MoE model adds
``router_aux_loss_coef * aux`` to its LM loss, where ``load_balancing_loss_func``
takes every routed layer's router logits over every token of the batch: with
``p = softmax(logits)`` per token, ``C_e`` the top-k choices of expert ``e`` and
``S_e`` the sum of ``p_e``, both summed over all ``R = layers x tokens`` rows,
``aux = E * sum_e (C_e / R) * (S_e / R)``. The counts come from a top-k and carry no
gradient, so given them ``aux`` is linear in each layer's ``S_l``:
``d aux / d S_{l,e} = E * C_e / R**2``. But ``C`` needs the forward of every layer
over the whole batch, which no single layer sees.

The relay has it: every forward (all layers, all micro-batches) runs before any
backward. So a forward hook on each router (the module transformers itself records
router logits from) adds the step's counts and probability sums to this per-step
holder while the engine counts (:meth:`RouterBalance.start` to
:meth:`RouterBalance.finish`, which the engine calls around the forward, so that
the backward's recompute never counts twice), and a forward hook on each routed
decoder layer passes its output through :class:`_Inject`: identity in forward,
whose backward also hands the layer's ``S_l`` its gradient, read from the holder
then (the counts are complete by then). The aux term's gradient thus flows in each
block's own backward, through the relay's recorded graph and recompute like any
other op, and the EPS updates the router with it eagerly. The reported loss is the
LM mean plus ``coef * aux``, as transformers reports it; the aux gradient is scaled
by the loss scale but not divided by the token count (it is not a token sum).

Without ``output_router_logits`` (the configs' default) there is no aux loss, in
transformers or here: the hooks compute nothing.
"""
from __future__ import annotations

import torch
from torch import nn


class NoRouterBalance:
    """A model without routers (or without the aux loss): nothing to count, nothing added."""

    active = False

    def start(self, grad_scale: float = 1.0) -> None:
        pass

    def finish(self) -> float:
        return 0.0


class RouterBalance(NoRouterBalance):
    """One model's load-balancing term: its routers' hooks feed it, the engine reads it."""

    def __init__(self, experts: int, top_k: int, coef: float) -> None:
        self.experts, self.top_k, self.coef = experts, top_k, coef
        self.active = True
        self.routers = 0
        self._counting = False
        self._finished = False
        self._grad_scale = 1.0
        self._counts: torch.Tensor | None = None
        self._prob_sums: torch.Tensor | None = None
        self._rows = 0
        self._pending: torch.Tensor | None = None  # the routed layer now running: its S_l

    @classmethod
    def attach(cls, model: nn.Module, layers: list[nn.Module]) -> "RouterBalance":
        """Hooks on ``model``'s routers and on those of ``layers`` (its decoder layers) that route."""
        balance = cls(model.num_experts, model.num_experts_per_tok, float(model.router_aux_loss_coef))
        router_class, index = _router_kind(model)
        for layer in layers:
            routers = [m for m in layer.modules() if isinstance(m, router_class)]
            if not routers:
                continue  # a dense layer (Qwen2-MoE's mlp_only_layers, decoder_sparse_step)
            if len(routers) > 1:
                raise ValueError(f"a decoder layer with {len(routers)} routers")
            routers[0].register_forward_hook(lambda _m, _a, out, i=index: balance._routed(
                out if isinstance(out, torch.Tensor) else out[i]))
            layer.register_forward_hook(lambda _m, _a, out: balance._inject(out))
            balance.routers += 1
        return balance

    # ---------------------------------------------------------------- the engine's calls
    def start(self, grad_scale: float = 1.0) -> None:
        """A step (or an evaluated batch) begins: count its routing from zero. ``grad_scale``
        multiplies the aux gradient (the loss scale the backward runs at)."""
        self._counting, self._finished = True, False
        self._grad_scale = grad_scale
        self._counts = self._prob_sums = None
        self._rows = 0

    def finish(self) -> float:
        """Every forward of the step has run: stop counting; ``coef * aux`` (what transformers
        adds to its loss). The backward that follows reads the counts."""
        self._counting, self._finished = False, True
        if not self._rows:
            return 0.0
        rows = float(self._rows)
        aux = self.experts * float(torch.sum((self._counts / rows) * (self._prob_sums / rows)))
        return self.coef * aux

    # ---------------------------------------------------------------- the hooks
    def _routed(self, logits: torch.Tensor) -> None:
        probs = torch.softmax(logits, dim=-1)  # as load_balancing_loss_func: then summed in fp32
        if self._counting:
            with torch.no_grad():  # counting saves nothing for backward: the recompute stays in step
                chosen = torch.topk(probs, self.top_k, dim=-1).indices.reshape(-1)
                counts = torch.bincount(chosen, minlength=self.experts).double()
                sums = probs.float().sum(dim=0).double()
                if self._counts is None:
                    self._counts, self._prob_sums = counts, sums
                else:
                    self._counts = self._counts + counts.to(self._counts.device)
                    self._prob_sums = self._prob_sums + sums.to(self._prob_sums.device)
                self._rows += probs.shape[0]
        self._pending = probs.float().sum(dim=0) if torch.is_grad_enabled() else None

    def _inject(self, out):
        pending, self._pending = self._pending, None
        if pending is None:
            return None  # no graph being recorded: the output as it is
        return _Inject.apply(out, pending, self)

    def prob_sum_grad(self, like: torch.Tensor) -> torch.Tensor:
        """``d (grad_scale * coef * aux) / d S_l``, the same for every routed layer."""
        if not self._finished:
            raise RuntimeError("a router's backward ran before the step's routing was counted "
                               "(RouterBalance.finish is called after the whole forward)")
        rows = float(self._rows)
        grad = self._counts * (self._grad_scale * self.coef * self.experts / (rows * rows))
        return grad.to(device=like.device, dtype=like.dtype)


class _Inject(torch.autograd.Function):
    """``hidden`` unchanged; in backward, the aux loss's gradient for the layer's ``S_l`` too."""

    @staticmethod
    def forward(ctx, hidden, prob_sum, balance):
        ctx.balance = balance
        ctx.meta = (prob_sum.shape, prob_sum.dtype, prob_sum.device)
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.meta
        return grad, ctx.balance.prob_sum_grad(torch.empty(shape, dtype=dtype, device=device)), None


def _router_kind(model: nn.Module) -> tuple[type, int]:
    """The router class whose output transformers records as ``router_logits`` and the
    logits' place in that output (``_can_record_outputs``, transformers 5)."""
    recorder = (getattr(type(model), "_can_record_outputs", None) or {}).get("router_logits")
    if recorder is None or getattr(recorder, "target_class", None) is None:
        raise ValueError(f"{type(model).__name__} records no router logits l2l can find")
    return recorder.target_class, recorder.index or 0
