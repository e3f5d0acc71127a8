from __future__ import annotations

import math

import pytest

from textrl.core.kl_control import AdaptiveKLController, FixedKLController, make_kl_controller


def test_fixed_controller_never_moves():
    ctl = FixedKLController(0.1)
    assert ctl.update(5.0, 1000) == 0.1


@pytest.mark.parametrize(
    ("kl", "expected_error"),
    [(0.1, 0.0), (0.11, 0.1), (10.0, 0.2), (0.0, -0.2), (0.05, -0.2)],
)
def test_adaptive_controller_closed_form(kl, expected_error):
    # Ziegler et al. 2019: e = clip(KL/target - 1, -0.2, 0.2); beta *= 1 + e * n / horizon
    ctl = AdaptiveKLController(0.5, target=0.1, horizon=1000)
    new = ctl.update(kl, 100)
    assert math.isclose(new, 0.5 * (1 + expected_error * 100 / 1000), rel_tol=1e-12)


def test_adaptive_controller_ignores_nonfinite_kl_and_round_trips():
    ctl = AdaptiveKLController(0.5, target=0.1, horizon=1000)
    assert ctl.update(float("nan"), 100) == 0.5
    ctl.update(1.0, 100)
    other = make_kl_controller(0.5, True, 0.1, 1000)
    other.load_state_dict(ctl.state_dict())
    assert other.value == ctl.value


@pytest.mark.parametrize(("target", "horizon", "field"), [(0.0, 10, "kl_target"), (0.1, 0, "kl_horizon")])
def test_adaptive_controller_rejects_bad_settings(target, horizon, field):
    with pytest.raises(ValueError, match=field):
        AdaptiveKLController(0.1, target, horizon)
