"""Learning-rate schedule: linear warm-up, then cosine decay to a floor.

The schedule is a pure function of the step, so its position in a checkpoint is the step itself:
a resumed run asks for `lr_at(step)` of its next step and continues the same curve.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class WarmupCosine:
    peak_lr: float
    min_lr: float
    warmup_steps: int
    total_steps: int

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step `step` (1-based)."""
        if self.warmup_steps > 0 and step <= self.warmup_steps:
            # Step 1 already trains, so warm-up reaches the peak at step `warmup_steps`, not after it.
            return self.peak_lr * step / self.warmup_steps
        decay_steps = self.total_steps - self.warmup_steps
        if decay_steps <= 0:
            return self.peak_lr
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr + (self.peak_lr - self.min_lr) * cosine

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)
