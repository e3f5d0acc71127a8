"""The Gymnasium ids of the token MDP: ``textrl/TokenMDP-v0`` and ``textrl/<Id>-v0`` for every
registered environment (:func:`register`, which ``import textrl.envs`` runs), each carrying
:class:`TimeLimitCap` so that ``gym.make(id, max_episode_steps=N)`` ends an episode as the env's
own caps do (:class:`textrl.envs.TokenMDPEnv`)."""

from __future__ import annotations

from typing import Any

import gymnasium as gym
from gymnasium.envs.registration import WrapperSpec

from textrl.envs.registry import env_ids, gym_id
from textrl.envs.token_mdp import ENV_ID, TokenMDPEnv


class TimeLimitCap(gym.Wrapper, gym.utils.RecordConstructorArgs):
    """Hands a ``TimeLimit`` below it (``gym.make(id, max_episode_steps=N)``) to the
    :class:`TokenMDPEnv` it wraps, so the N-th action ends the episode as the env's own caps do:
    truncated, end reason ``"length"``, scored, with the final ``info``. (Gymnasium passes
    ``max_episode_steps`` to ``TimeLimit``, never to the env, and a ``TimeLimit`` truncation alone
    would end the episode with reward 0 and an empty ``info``.) The ids :func:`register`
    registers carry it in their spec's ``additional_wrappers``, which ``gym.make`` applies
    above the ``TimeLimit``. Without a ``TimeLimit`` it changes nothing."""

    def __init__(self, env: gym.Env) -> None:
        gym.utils.RecordConstructorArgs.__init__(self)
        gym.Wrapper.__init__(self, env)
        steps = env.spec.max_episode_steps if env.spec is not None else None
        inner = env.unwrapped
        if steps is not None and isinstance(inner, TokenMDPEnv):
            own = inner.max_episode_steps
            inner.max_episode_steps = steps if own is None else min(own, steps)


TIME_LIMIT_CAP = WrapperSpec("TimeLimitCap", "textrl.envs.gym_ids:TimeLimitCap", {})
"""The wrapper spec of :class:`TimeLimitCap`, in the ``additional_wrappers`` of every textrl id."""


def register_gym_id(name: str, kwargs: dict[str, Any] | None = None) -> None:
    """Register the Gymnasium id ``name`` as a :class:`TokenMDPEnv` with ``kwargs`` (idempotent);
    an id registered before without :class:`TimeLimitCap` gets it."""
    spec = gym.registry.get(name)
    if spec is None:
        gym.register(id=name, entry_point="textrl.envs.token_mdp:TokenMDPEnv", kwargs=kwargs or {},
                     additional_wrappers=(TIME_LIMIT_CAP,))
    elif TIME_LIMIT_CAP not in spec.additional_wrappers:
        spec.additional_wrappers = (*spec.additional_wrappers, TIME_LIMIT_CAP)


def register() -> None:
    """Register ``textrl/TokenMDP-v0`` and ``textrl/<Id>-v0`` for every registered environment
    with Gymnasium (idempotent; ``import textrl.envs`` calls it). Gymnasium >= 1.0 has no plugin
    entry points, so a fresh interpreter names the module: ``gym.make("textrl.envs:textrl/TokenMDP-v0")``."""
    register_gym_id(ENV_ID)
    for env_id in env_ids():
        register_gym_id(gym_id(env_id), {"env": env_id})


__all__ = ["TIME_LIMIT_CAP", "TimeLimitCap", "register", "register_gym_id"]
