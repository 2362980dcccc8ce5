"""Lion (Chen et al. 2023, "Symbolic discovery of optimization algorithms") as a torch optimizer:
the plain engine's, in the EPS contract's operation order (docs/eps-numerics.md), so both
engines give the same bits where torch computes in binary32 without fusing.

    p1 = p * (1 - lr * wd)                       (wd only in the decayed group)
    c  = beta1 * m + (1 - beta1) * g
    p' = p1 - lr * sign(c)                       (p1 where c is zero)
    m' = beta2 * m + (1 - beta2) * g

timm's ``Lion`` computes the same with ``lerp`` for the two interpolations (equal up to
rounding); ``tests/test_lion.py`` holds both to it.
"""
from __future__ import annotations

import torch


class Lion(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0) -> None:
        if lr <= 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1) or weight_decay < 0:
            raise ValueError(f"Lion: lr {lr}, betas {betas}, weight_decay {weight_decay}")
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (b1, b2), wd = group["lr"], group["betas"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                m, g = state["exp_avg"], p.grad
                state["step"] += 1
                if wd:
                    p.mul_(1.0 - lr * wd)
                c = torch.add(m.mul(b1), g.mul(1.0 - b1))  # two roundings, then one: no fused multiply-add
                step = torch.sign(c).mul_(-lr)                # -lr, +lr or a zero, exactly
                p.copy_(torch.where(c != 0, p + step, p))
                m.mul_(b2).add_(g.mul(1.0 - b2))
        return loss
