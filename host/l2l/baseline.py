"""The baseline engine (``--engine plain``): the same layer stack trained in memory with torch.optim.AdamW
(or, with ``--optimizer lion`` or ``lamb``, :class:`l2l.lion.Lion` or :class:`l2l.lamb.Lamb`).

Every weight lives on the device for the whole step and the full batch runs
at once (or, with ``micro_batches`` M > 1, as M micro-batches whose gradients
accumulate: the same micro-batch size as the relay's, for a like-for-like
speed comparison); ``checkpointing=True`` recomputes each block in backward
(``torch.utils.checkpoint``), the same recompute the relay pays. This is the
yardstick for the relay's correctness and speed.

Mixed precision the way the relay does it: fp32 master parameters (the
optimizer's), the forward computed with bf16/fp16 copies of them
(``functional_call`` on cast weights, so gradients flow back into fp32), and
for fp16 ``torch.amp.GradScaler`` -- the reference the relay's
``--overflow strict`` mode is tested against.
"""
from __future__ import annotations

from typing import Collection

import numpy as np
import torch
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

from .data import Batch
from .depth import checked_skip
from .engine import StepResult
from .eps import OPTIMIZERS, OptimizerHyper
from .lamb import Lamb
from .lion import Lion
from .models import LayerStack
from .relay.scaler import LossScaler

_TORCH_STATE = {"p": None, "m": "exp_avg", "v": "exp_avg_sq"}  # checkpoint name -> torch optimizer state key
COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class PlainEngine:
    name = "plain"

    def __init__(self, stack: LayerStack, hyper: OptimizerHyper, device: torch.device, *,
                 checkpointing: bool = False, precision: str = "fp32",
                 clip_grad_norm: float | None = None, loss_scale: float | None = None,
                 micro_batches: int = 1) -> None:
        self.stack = stack
        self.micro_batches = micro_batches
        self.device = device
        self.checkpointing = checkpointing
        self.compute_dtype = COMPUTE_DTYPES[precision]
        self.clip_grad_norm = clip_grad_norm
        stack.materialize(device)  # a model read from a checkpoint arrives without weights of its own
        self.modules = [layer.module.to(device) for layer in stack.layers]
        # a parameter shared by two layers (tied embeddings) is one parameter here, as in the HF model
        self.params = list({id(p): p for m in self.modules for p in m.parameters()}.values())
        decayed = {id(p) for _, layout, params in self._layer_params() for slot, p in zip(layout.slots, params)
                   if slot.offset < layout.decayed}  # the layouts' parameter groups, as the EPS decays them
        groups = [{"params": [p for p in self.params if id(p) in decayed], "weight_decay": hyper.weight_decay},
                  {"params": [p for p in self.params if id(p) not in decayed], "weight_decay": 0.0}]
        groups = [g for g in groups if g["params"]]
        self.state_names = OPTIMIZERS[hyper.optimizer].state
        self.optimizer_name = hyper.optimizer
        if hyper.optimizer == "lion":
            self.optimizer = Lion(groups, lr=hyper.lr, betas=(hyper.beta1, hyper.beta2))
        elif hyper.optimizer == "lamb":
            self.optimizer = Lamb(groups, lr=hyper.lr, betas=(hyper.beta1, hyper.beta2), eps=hyper.eps)
        else:
            self.optimizer = torch.optim.AdamW(groups, lr=hyper.lr, betas=(hyper.beta1, hyper.beta2), eps=hyper.eps)
        self.scaler = None
        if precision == "fp16":  # the relay's LossScaler defaults are GradScaler's
            d = LossScaler()
            self.scaler = torch.amp.GradScaler(
                device.type, init_scale=loss_scale or d.scale, growth_factor=d.growth_factor,
                backoff_factor=d.backoff_factor, growth_interval=d.growth_interval)
        self.eps_wait_seconds = 0.0

    def _call(self, module: torch.nn.Module, *args):
        """Run ``module`` in the compute dtype: fp32 masters cast on the way in."""
        if self.compute_dtype == torch.float32:
            return module(*args)
        weights = {name: p.to(self.compute_dtype) for name, p in module.named_parameters()}
        return functional_call(module, weights, args)

    def _loss_sum(self, batch: Batch, grad_scale: float = 1.0, skip_blocks: Collection[int] = ()) -> torch.Tensor:
        """The summed token loss; an MoE model's routers count this batch's routing
        (``stack.router_balance.finish()`` reads it, before any backward)."""
        self.stack.router_balance.start(grad_scale)
        x = batch.inputs.to(self.device)
        pre, *blocks, post = self.modules
        x = self._call(pre, x)
        for b, block in enumerate(blocks):
            if b in skip_blocks:  # left out of this step: no gradient, so AdamW leaves its state alone
                continue
            x = (checkpoint(self._call, block, x, use_reentrant=False) if self.checkpointing
                 else self._call(block, x))
        return self._call(post, x, batch.targets.to(self.device))

    def train_step(self, batch: Batch, step: int, *, global_targets: int | None = None,
                   skip_blocks: Collection[int] = ()) -> StepResult:
        """One step; the blocks in ``skip_blocks`` (0-based) are left out of it (dynamic depth):
        their parameters get no gradient, which torch's optimizers skip (no step, no decay)."""
        skip_blocks = checked_skip(skip_blocks, len(self.modules) - 2)
        self.stack.train(True)
        divisor = global_targets or batch.num_targets
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.optimizer.zero_grad(set_to_none=True)
        scale = self.scaler.get_scale() if self.scaler else 1.0
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for mb in batch.split(self.micro_batches):  # gradients accumulate over micro-batches
            part = self._loss_sum(mb, scale, skip_blocks)
            aux_loss = self.stack.router_balance.finish()  # one micro-batch (build.py): its routing all counted
            loss = part / divisor
            (self.scaler.scale(loss) if self.scaler else loss).backward()
            loss_sum += part.detach()
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        grad_norm = None
        if self.clip_grad_norm is not None:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.clip_grad_norm))
        skipped = 0
        if self.scaler:
            self.scaler.step(self.optimizer)  # skipped when any gradient is inf/NaN
            self.scaler.update()
            # counted as the relay counts: EPS entries, a tied parameter one of its own
            skipped = self.stack.num_entries if self.scaler.get_scale() < scale else 0
        else:
            self.optimizer.step()
        weight_bytes = sum(p.numel() * p.element_size() * 2 for p in self.params)
        peak = int(torch.cuda.max_memory_allocated(self.device)) if self.device.type == "cuda" else weight_bytes
        return StepResult(loss=loss_sum.item() / divisor + aux_loss, tokens=batch.inputs.numel(),
                          eps_wait_s=0.0, device_peak_bytes=peak, device_weight_peak_bytes=weight_bytes,
                          loss_scale=scale, skipped_layers=skipped, grad_norm=grad_norm)

    @torch.no_grad()
    def evaluate(self, batches: list[Batch]) -> float:
        self.stack.train(False)
        try:
            total = sum(float(self._loss_sum(b)) + self.stack.router_balance.finish() * b.num_targets
                        for b in batches)  # an MoE model's load-balancing term as transformers reports it
            return total / sum(b.num_targets for b in batches)
        finally:
            self.stack.train(True)

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    # ------------------------------------------------------------ state
    # Checkpoints use the EPS's format -- per entry (each layer's own parameters,
    # then each shared one), flat fp32 p and the moments and a step count -- so a run can
    # move between the relay and the baseline.
    def _layer_params(self):
        named = [dict(module.named_parameters()) for module in self.modules]
        for e in range(self.stack.num_entries):
            i, layout = self.stack.entry_layout(e)
            yield e, layout, [named[i][s.name] for s in layout.slots]

    def state_tensors(self) -> dict[str, np.ndarray]:
        out = {}
        for i, layout, params in self._layer_params():
            for key in self.state_names:
                field = _TORCH_STATE[key]
                flat = np.zeros(layout.numel, np.float32)
                for slot, p in zip(layout.slots, params):
                    src = p if field is None else self.optimizer.state.get(p, {}).get(field)
                    if src is not None:
                        flat[slot.offset:slot.offset + slot.numel] = src.detach().reshape(-1).float().cpu().numpy()
                out[f"layer{i}.{key}"] = flat
        return out

    def state_arrays(self) -> dict[str, np.ndarray]:
        return self.state_tensors()  # the optimizer's state lives in torch: copied either way

    def state_meta(self) -> dict:
        steps = {}
        for i, _, params in self._layer_params():
            state = self.optimizer.state.get(params[0], {}) if params else {}
            steps[str(i)] = int(state["step"]) if "step" in state else 0
        meta = {"steps": steps, "n_decay": {str(e): self.stack.entry_n_decay(e) for e in range(self.stack.num_entries)},
                "optimizer": self.optimizer_name}
        if self.scaler:  # in the relay's LossScaler format, so runs move between engines
            st = self.scaler.state_dict()
            meta["loss_scaler"] = {**LossScaler().state_dict(), "scale": st["scale"],
                                   "clean_steps": st["_growth_tracker"]}
        return meta

    @torch.no_grad()
    def load_state(self, tensors: dict[str, np.ndarray], meta: dict) -> None:
        if self.scaler and "loss_scaler" in meta:
            st = meta["loss_scaler"]
            self.scaler.load_state_dict({**self.scaler.state_dict(), "scale": st["scale"],
                                         "_growth_tracker": st["clean_steps"]})
        saved_opt = meta.get("optimizer", "adamw")
        if saved_opt != self.optimizer_name:
            raise ValueError(f"the checkpoint holds {saved_opt} state, this run's optimizer is {self.optimizer_name}")
        for e in range(self.stack.num_entries):  # the grouping is checked before anything is loaded
            saved, mine = int(meta.get("n_decay", {}).get(str(e), self.stack.entry_numel(e))), self.stack.entry_n_decay(e)
            if saved != mine:
                raise ValueError(f"layer{e}: the checkpoint weight-decays {saved} of its elements, this run {mine}: "
                                 "another parameter grouping (--weight-decay-all decays every element)")
        for i, layout, params in self._layer_params():
            flat = {k: torch.from_numpy(np.asarray(tensors[f"layer{i}.{k}"], np.float32)) for k in self.state_names}
            t = int(meta["steps"][str(i)])
            for slot, param in zip(layout.slots, params):
                cut = slice(slot.offset, slot.offset + slot.numel)
                param.copy_(flat["p"][cut].view(slot.shape))
                if t:
                    self.optimizer.state[param] = {"step": torch.tensor(float(t)), **{
                        _TORCH_STATE[k]: flat[k][cut].view(slot.shape).to(param.device, param.dtype).clone()
                        for k in self.state_names[1:]}}

    def master_weights(self) -> list[np.ndarray]:
        """fp32 weights per entry, in the relay's order (each layer's own, then each shared one)."""
        entries = (self.stack.entry_layout(e) for e in range(self.stack.num_entries))
        return [layout.flatten(self.modules[i]) for i, layout in entries]

    def close(self) -> None:
        pass
