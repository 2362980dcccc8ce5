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

A parameter that several layers use -- tied input and output embeddings --
is a :class:`SharedParam`: not in any layer's vector but an EPS entry of its
own (entry ``len(layers) + t`` for the stack's ``t``-th shared parameter),
fetched beside each layer that uses it, given a gradient contribution by each,
and updated once per step when all have arrived. The stack finds them itself:
a parameter object that appears in two layers' modules is shared.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from ..errors import UserError
from .decay_groups import no_decay_names
from .router_balance import NoRouterBalance

IGNORE_INDEX = -100


@dataclass(frozen=True)
class ParamSlot:
    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int


@dataclass(frozen=True)
class FlatLayout:
    """Where each named parameter of a layer lives inside its flat buffer. Weight decay applies
    to the first ``n_decay`` elements (None: all): with parameter groups the decayed
    parameters come first, so one boundary per entry tells the EPS which."""

    slots: tuple[ParamSlot, ...]
    numel: int
    n_decay: int | None = None

    @classmethod
    def of(cls, module: nn.Module, exclude: frozenset[str] = frozenset(),
           no_decay: frozenset[str] | None = None) -> "FlatLayout":
        """``module``'s parameters in order, each once, but for the names in ``exclude``; with
        ``no_decay`` (names weight decay leaves alone), the decayed ones first, each group in
        module order."""
        # shared: once; frozen (requires_grad False, a LoRA run's base): not the EPS's
        params = [(name, p) for name, p in module.named_parameters() if name not in exclude and p.requires_grad]
        if no_decay is not None:
            params = [(n, p) for n, p in params if n not in no_decay] + [(n, p) for n, p in params if n in no_decay]
        slots, offset, n_decay = [], 0, None
        for name, p in params:
            if no_decay is not None and n_decay is None and name in no_decay:
                n_decay = offset
            slots.append(ParamSlot(name, tuple(p.shape), offset, p.numel()))
            offset += p.numel()
        if no_decay is not None and n_decay is None:
            n_decay = offset
        return cls(tuple(slots), offset, n_decay)

    @property
    def decayed(self) -> int:
        """Elements weight decay applies to: the first ``decayed`` of the vector."""
        return self.numel if self.n_decay is None else self.n_decay

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
    # parameter name in ``module`` -> index of the stack's SharedParam it is (set by the stack)
    shared: dict[str, int] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in ("pre", "block", "post"):
            raise ValueError(f"unknown layer kind {self.kind!r}")
        self.layout = FlatLayout.of(self.module)

    @property
    def frozen_names(self) -> list[str]:
        """The module's frozen parameters (requires_grad False), each once: weights the relay
        binds from the stack's frozen store (``LayerStack.frozen``), not from the EPS."""
        return [name for name, p in self.module.named_parameters() if not p.requires_grad]


@dataclass
class SharedParam:
    """One parameter used by several layers; its own EPS entry, with one gradient
    contribution per user (in ``users`` order) and per data-parallel worker."""

    shape: tuple[int, ...]
    users: tuple[tuple[int, str], ...]  # (layer index, the parameter's name in that layer's module)
    source: Callable[[], np.ndarray] | None = None  # as Layer.source
    decay: bool | None = None  # weight-decayed (parameter groups); None: no groups, decayed

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape))

    def layout(self, name: str) -> FlatLayout:
        """The one-slot layout that binds this entry's vector under ``name``."""
        n_decay = None if self.decay is None else (self.numel if self.decay else 0)
        return FlatLayout((ParamSlot(name, self.shape, 0, self.numel),), self.numel, n_decay)


@dataclass
class LayerStack:
    """An ordered relay of layers plus the config that rebuilds it."""

    layers: list[Layer]
    config: dict[str, Any]
    vocab_size: int
    # weight decay by parameter groups, as Hugging Face's Trainer makes them (decay_groups.py);
    # False: every parameter decayed, layouts in module order (as before the groups)
    decay_groups: bool = False
    # where frozen parameters come from (l2l.lora.frozen.FrozenBase: ``arrays(i)``, the host
    # arrays the relay sends to the device beside the EPS's); None: every parameter is trained
    frozen: Any = None

    def __post_init__(self) -> None:
        kinds = [layer.kind for layer in self.layers]
        if len(kinds) < 3 or kinds[0] != "pre" or kinds[-1] != "post" or set(kinds[1:-1]) != {"block"}:
            raise ValueError(f"a layer stack is pre, blocks, post; got {kinds}")
        self.router_balance = NoRouterBalance()  # an MoE model's load-balancing loss (router_balance.py)
        self.shared: list[SharedParam] = []
        users: dict[int, list[tuple[int, str, nn.Parameter]]] = {}
        for i, layer in enumerate(self.layers):
            for name, p in layer.module.named_parameters():
                if p.requires_grad:  # a frozen tied weight is the frozen store's, once
                    users.setdefault(id(p), []).append((i, name, p))
        for found in users.values():
            if len(found) < 2:
                continue
            t = len(self.shared)
            self.shared.append(SharedParam(tuple(found[0][2].shape), tuple((i, name) for i, name, _ in found)))
            for i, name, _ in found:
                self.layers[i].shared[name] = t
        for layer in self.layers:
            no_decay = no_decay_names(layer.module) if self.decay_groups else None
            if layer.shared or no_decay is not None:
                layer.layout = FlatLayout.of(layer.module, exclude=frozenset(layer.shared), no_decay=no_decay)
        if self.decay_groups:
            for shared in self.shared:  # its first user's module decides, as Trainer decides for the model
                i, name = shared.users[0]
                shared.decay = name not in no_decay_names(self.layers[i].module)

    def __len__(self) -> int:
        return len(self.layers)

    def check_frozen(self) -> None:
        """Refuse frozen parameters (requires_grad False) without a frozen store to bind them
        from: the EPS holds only what trains, so they would have no weights."""
        if self.frozen is None:
            for layer in self.layers:
                if layer.frozen_names:
                    raise UserError(f"{layer.name}: parameter {layer.frozen_names[0]} has requires_grad False; l2l "
                                    "trains every parameter of a model (frozen weights: a LoRA run, docs/lora.md)")

    @property
    def num_params(self) -> int:
        return sum(self.entry_numel(e) for e in range(self.num_entries))

    # EPS entries: one per layer (its own parameters), then one per shared parameter
    @property
    def num_entries(self) -> int:
        return len(self.layers) + len(self.shared)

    def entry_numel(self, e: int) -> int:
        return self.layers[e].layout.numel if e < len(self.layers) else self.shared[e - len(self.layers)].numel

    def entry_users(self, e: int) -> int:
        """How many layers give entry ``e`` a gradient contribution each step."""
        return 1 if e < len(self.layers) else len(self.shared[e - len(self.layers)].users)

    def parts(self, i: int) -> list[tuple[int, int, FlatLayout]]:
        """What layer ``i`` fetches and gives gradients to: (entry, this layer's place among
        the entry's users, the layout binding the entry's vector into the layer's module)."""
        out = [(i, 0, self.layers[i].layout)]
        for name, t in self.layers[i].shared.items():
            shared = self.shared[t]
            out.append((len(self.layers) + t, [u for u, _ in shared.users].index(i), shared.layout(name)))
        return out

    def signature(self) -> dict[str, Any]:
        sig: dict[str, Any] = {"config": self.config, "layers": [[l.name, l.layout.numel] for l in self.layers]}
        if self.shared:
            sig["shared"] = [[[i for i, _ in s.users], s.numel] for s in self.shared]
        if self.decay_groups:  # the layouts' order and boundaries (absent: every element decayed)
            sig["n_decay"] = [self.entry_n_decay(e) for e in range(self.num_entries)]
        return sig

    def entry_n_decay(self, e: int) -> int:
        """Entry ``e``'s decay boundary: weight decay applies to its first ``entry_n_decay`` elements."""
        return self.entry_layout(e)[1].decayed

    def entry_layout(self, e: int) -> tuple[int, FlatLayout]:
        """Where entry ``e``'s vector lives in the model: a layer that holds it, and the layout
        of it in that layer's module (for a shared parameter: its first user's)."""
        if e < len(self.layers):
            return e, self.layers[e].layout
        shared = self.shared[e - len(self.layers)]
        i, name = shared.users[0]
        return i, shared.layout(name)

    def initial_weights(self, e: int) -> np.ndarray:
        """Entry ``e``'s initial weights as one fp32 vector (read one entry at a time)."""
        i, layout = self.entry_layout(e)
        source = self.layers[e].source if e < len(self.layers) else self.shared[e - len(self.layers)].source
        flat = source() if source is not None else layout.flatten(self.layers[i].module)
        if flat.shape != (layout.numel,) or flat.dtype != np.float32:
            raise ValueError(f"entry {e} ({self.layers[i].name}): initial weights of shape {flat.shape} and dtype "
                             f"{flat.dtype}, expected ({layout.numel},) float32")
        return flat

    def materialize(self, device: torch.device) -> None:
        """Give every layer whose parameters are meta placeholders real parameters on
        ``device``, filled with its initial weights (what an in-memory engine needs)."""
        self.check_frozen()
        shared = [None] * len(self.shared)  # one Parameter per shared entry, put in every user
        for i, layer in enumerate(self.layers):
            if not any(p.is_meta for p in layer.module.parameters()):
                continue
            fresh = {}
            for e, _, layout in self.parts(i):
                t = e - len(self.layers)
                if t >= 0 and shared[t] is not None:
                    fresh[layout.slots[0].name] = shared[t]
                    continue
                flat = torch.from_numpy(self.initial_weights(e))
                made = {s.name: nn.Parameter(flat[s.offset:s.offset + s.numel].view(s.shape).to(device).clone())
                        for s in layout.slots}
                fresh.update(made)
                if t >= 0:
                    shared[t] = next(iter(made.values()))
            first: dict[int, str] = {}
            for name, p in list(layer.module.named_parameters(remove_duplicate=False)):
                owner, _, attr = name.rpartition(".")
                layer.module.get_submodule(owner)._parameters[attr] = fresh[first.setdefault(id(p), name)]

    def skeleton(self) -> "LayerStack":
        """A copy whose parameters are meta placeholders (a tied one stays one): the same
        modules, buffers and entries without a byte of weights, for another relay worker,
        whose weights come from the EPS (``--devices K`` builds one model, not K)."""
        memo: dict[int, Any] = {}
        for layer in self.layers:
            for p in layer.module.parameters():
                if id(p) not in memo:
                    memo[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                               requires_grad=p.requires_grad)
        return copy.deepcopy(self, memo)

    def train(self, mode: bool = True) -> None:
        for layer in self.layers:
            layer.module.train(mode)


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy over non-ignored targets, computed in fp32."""
    return nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
        ignore_index=IGNORE_INDEX, reduction="sum")
