"""KL coefficient controllers: fixed, and adaptive (Ziegler et al. 2019, "Fine-Tuning Language
Models from Human Preferences", eq. 2).

The adaptive rule moves beta in proportion to the relative error of the measured KL against a
target, clipped to +-0.2, scaled by the number of samples seen over a horizon:
``e = clip(KL / target - 1, -0.2, 0.2)``; ``beta <- beta * (1 + e * n_steps / horizon)``.
"""

from __future__ import annotations

import math


class FixedKLController:
    """beta stays where it was set."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> float:
        return self.value

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController(FixedKLController):
    """beta follows the measured KL towards ``target`` (proportional error clipped to +-0.2)."""

    def __init__(self, kl_coef: float, target: float, horizon: int) -> None:
        if not target > 0:
            raise ValueError(f"kl_target={target!r}: the adaptive KL controller needs a target > 0")
        if not horizon > 0:
            raise ValueError(f"kl_horizon={horizon!r}: must be > 0")
        super().__init__(kl_coef)
        self.target = float(target)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> float:
        """Update beta from the mean KL of the last rollout of ``n_steps`` samples."""
        if not math.isfinite(current_kl):
            return self.value
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon
        return self.value

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}


def make_kl_controller(kl_coef: float, adaptive: bool, target: float, horizon: int):
    """The controller the config asks for."""
    if adaptive:
        return AdaptiveKLController(kl_coef, target, horizon)
    return FixedKLController(kl_coef)


__all__ = ["AdaptiveKLController", "FixedKLController", "make_kl_controller"]
