"""Dynamic loss scaling for fp16, in the eager param-server's terms.

The relay multiplies each micro-batch's summed loss by ``scale`` before
backward; the EPS divides it out through the contract's ``inv_scale`` and
reports, per layer, whether the reduced gradient was finite.

Eager semantics (``--overflow eager``, the default): layers update as soon as
their gradient is in, so an overflow can only be seen layer by layer. A layer
whose gradient overflowed skips its update -- its weights, moments and step
count stay as they were -- while the other layers of the same step update
normally. After a step with any skipped layer the scale is halved for the next
step; after ``growth_interval`` consecutive clean steps it is doubled. (torch's
GradScaler instead skips the whole step; that needs every gradient before any
update, which eager updates cannot wait for.)
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class LossScaler:
    scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    clean_steps: int = 0
    enabled: bool = True

    def update(self, overflowed: bool) -> None:
        """Account for one finished step."""
        if not self.enabled:
            return
        if overflowed:
            self.scale *= self.backoff_factor
            self.clean_steps = 0
        else:
            self.clean_steps += 1
            if self.clean_steps >= self.growth_interval:
                self.scale *= self.growth_factor
                self.clean_steps = 0

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)


def scaler_for(precision: str) -> LossScaler:
    """fp16 needs dynamic scaling; fp32 and bf16 have fp32's exponent range and use none."""
    return LossScaler() if precision == "fp16" else LossScaler(scale=1.0, enabled=False)
