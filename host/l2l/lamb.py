"""LAMB (You et al. 2019, "Large batch optimization for deep learning: training BERT in 76
minutes") as a torch optimizer: the plain engine's, in the EPS contract's order
(docs/eps-numerics.md), timm's ``Lamb`` rule: bias correction, the weight decay added to the
update, and each tensor of a decayed group (weight decay not 0) stepped by its trust ratio.

    m' = beta1 * m + (1 - beta1) * g
    v' = beta2 * v + (1 - beta2) * g * g
    u  = (m' / (sqrt(v') / sqrt(1 - beta2^t) + eps)) / (1 - beta1^t)  + wd * p
    p' = p - lr * trust * u,   trust = |p| / |u| (1 where either is 0, or wd is 0)

The norms are binary64 sums of binary32 squares: the EPS sums its squares in a fixed lane
order (``numerics.lamb_norms``), this in torch's, so the two differ in the last bits of a
trust ratio at most.
"""
from __future__ import annotations

import math

import torch


class Lamb(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.01) -> None:
        if lr <= 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1) or eps <= 0 or weight_decay < 0:
            raise ValueError(f"Lamb: lr {lr}, betas {betas}, eps {eps}, weight_decay {weight_decay}")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                t = int(state["step"])
                m, v, g = state["exp_avg"], state["exp_avg_sq"], p.grad
                m.mul_(b1).add_(g.mul(1.0 - b1))
                v.mul_(b2).add_(g.mul(g).mul_(1.0 - b2))
                d = v.sqrt().mul_(1.0 / math.sqrt(1.0 - b2 ** t)).add_(eps)
                u = m.div(d).mul_(1.0 / (1.0 - b1 ** t))
                if wd:
                    u.add_(p.mul(wd))
                    w_norm = float(p.double().square().sum().sqrt())
                    u_norm = float(u.double().square().sum().sqrt())
                    trust = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
                else:
                    trust = 1.0
                p.add_(u.mul_(-lr * trust))
        return loss
