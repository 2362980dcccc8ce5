"""The baseline: the same layer stack trained in memory with torch.optim.AdamW.

Every weight lives on the device for the whole step and the full batch runs
at once; ``checkpointing=True`` recomputes each block in backward
(``torch.utils.checkpoint``), the same recompute the relay pays. This is the
yardstick for the relay's correctness and speed.
"""
from __future__ import annotations


import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

from .data import Batch
from .eps import AdamWHyper
from .models import LayerStack
from .relay.engine import StepResult


class PlainEngine:
    name = "plain"

    def __init__(self, stack: LayerStack, hyper: AdamWHyper, device: torch.device, *,
                 checkpointing: bool = False) -> None:
        self.stack = stack
        self.device = device
        self.checkpointing = checkpointing
        self.modules = [layer.module.to(device) for layer in stack.layers]
        params = [p for m in self.modules for p in m.parameters()]
        self.optimizer = torch.optim.AdamW(
            params, lr=hyper.lr, betas=(hyper.beta1, hyper.beta2), eps=hyper.eps,
            weight_decay=hyper.weight_decay)
        self.eps_wait_seconds = 0.0

    def _loss_sum(self, batch: Batch) -> torch.Tensor:
        x = batch.inputs.to(self.device)
        pre, *blocks, post = self.modules
        x = pre(x)
        for block in blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointing else block(x)
        return post(x, batch.targets.to(self.device))

    def train_step(self, batch: Batch, step: int) -> StepResult:
        self.stack.train(True)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = self._loss_sum(batch)
        (loss_sum / batch.num_targets).backward()
        self.optimizer.step()
        weight_bytes = sum(p.numel() * p.element_size() * 2 for m in self.modules for p in m.parameters())
        peak = int(torch.cuda.max_memory_allocated(self.device)) if self.device.type == "cuda" else weight_bytes
        return StepResult(loss=loss_sum.item() / batch.num_targets, tokens=batch.inputs.numel(),
                          eps_wait_s=0.0, device_peak_bytes=peak, device_weight_peak_bytes=weight_bytes)

    @torch.no_grad()
    def evaluate(self, batches: list[Batch]) -> float:
        self.stack.train(False)
        try:
            total = sum(float(self._loss_sum(b)) for b in batches)
            return total / sum(b.num_targets for b in batches)
        finally:
            self.stack.train(True)

    # ------------------------------------------------------------ state
    # Checkpoints use the EPS's format -- per layer, flat fp32 p, m, v and a
    # step count -- so a run can move between the relay and the baseline.
    def _layer_params(self):
        for i, (layer, module) in enumerate(zip(self.stack.layers, self.modules)):
            params = dict(module.named_parameters())
            yield i, layer.layout, [params[s.name] for s in layer.layout.slots]

    def state_tensors(self) -> dict[str, np.ndarray]:
        out = {}
        for i, layout, params in self._layer_params():
            for key, field in (("p", None), ("m", "exp_avg"), ("v", "exp_avg_sq")):
                flat = np.zeros(layout.numel, np.float32)
                for slot, p in zip(layout.slots, params):
                    src = p if field is None else self.optimizer.state.get(p, {}).get(field)
                    if src is not None:
                        flat[slot.offset:slot.offset + slot.numel] = src.detach().reshape(-1).float().cpu().numpy()
                out[f"layer{i}.{key}"] = flat
        return out

    def state_meta(self) -> dict:
        steps = {}
        for i, _, params in self._layer_params():
            state = self.optimizer.state.get(params[0], {})
            steps[str(i)] = int(state["step"]) if "step" in state else 0
        return {"steps": steps}

    @torch.no_grad()
    def load_state(self, tensors: dict[str, np.ndarray], meta: dict) -> None:
        for i, layout, params in self._layer_params():
            p, m, v = (torch.from_numpy(np.asarray(tensors[f"layer{i}.{k}"], np.float32)) for k in "pmv")
            t = int(meta["steps"][str(i)])
            for slot, param in zip(layout.slots, params):
                cut = slice(slot.offset, slot.offset + slot.numel)
                param.copy_(p[cut].view(slot.shape))
                if t:
                    self.optimizer.state[param] = {
                        "step": torch.tensor(float(t)),
                        "exp_avg": m[cut].view(slot.shape).to(param.device, param.dtype).clone(),
                        "exp_avg_sq": v[cut].view(slot.shape).to(param.device, param.dtype).clone(),
                    }

    def master_weights(self) -> list[np.ndarray]:
        return [layer.layout.flatten(m) for layer, m in zip(self.stack.layers, self.modules)]

    def close(self) -> None:
        pass
