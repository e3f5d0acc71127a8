"""Collecting rollouts with an agent: generate, score, hand to the agent, check.

:func:`collect` is phases 1-3 of the training loop (rollout, rewards, advantages) for one batch
of prompts: an environment's episodes, the agent sampling each turn with batched
``model.generate`` (its fast path), become the rows (docs/design.md, "The rollout TensorDict",
"Multi-turn episodes") the token MDP would pay, and the agent fills in log-probs, values and
advantages. :func:`evaluate_prompts` scores held-out prompts without
touching the agent's state.

Both sides are duck-typed, so this module imports no environment or agent (docs/design.md, "Layers"):

- the agent: ``act(input_ids, attention_mask, greedy=...) -> int64 [B, T]``, optionally
  ``rollout(greedy=...)`` (a context whose value has ``generate(input_ids, attention_mask) ->
  (tokens, log-probs or None)`` and ``version``, optionally ``iteration``, ``check_weights(td)`` and
  ``take_weight_sync_seconds()``: :class:`textrl.agents.actor.Sampled`) and
  ``process_rollout(td, timings=...) -> td``, and the attributes ``config`` (``max_new_tokens``),
  ``tokenizer``, ``eos_token_id``, ``pad_token_id`` and ``device``;
- the batch (an :class:`textrl.envs.prompts.PromptBatch`): ``input_ids`` / ``attention_mask``
  ``[B, P]``, ``rows``, ``to(device)`` and ``episode_runner(env, **settings)``, the
  :class:`textrl.envs.collector.EpisodeRunner` that runs the episodes (``run(generate, batch,
  timings=) -> TensorDict`` with ``KEYS.score``); a runner may also be passed as ``env``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from tensordict import TensorDictBase

from textrl.core.checks import check_rollout
from textrl.generation.base import EngineFailed, EngineFailedElsewhere
from textrl.keys import END_REASONS, KEYS

SCORE_KEY = KEYS.score
"""float ``[B]``: each row's task score (the weighted reward before any KL shaping)."""

PHASES = ("generation", "reward", "forward", "advantages")
"""Phases :func:`collect` times (seconds, in ``timings``): ``generation`` (``agent.act``),
``reward`` (scoring the responses), ``forward`` (the agent's log-prob / value prefill forwards)
and ``advantages`` (KL shaping and the estimator)."""


def _max_new_tokens(config: Any, max_new_tokens: int | None) -> int:
    if max_new_tokens is not None:
        return int(max_new_tokens)
    value = getattr(config, "max_new_tokens", None)
    if value is None:
        raise ValueError(
            "max_new_tokens is None and the agent has no config.max_new_tokens; pass "
            "max_new_tokens= (the generation limit the agent's act() uses)"
        )
    return int(value)


def episode_runner(
    batch: Any,
    env: Any,
    *,
    tokenizer: Any,
    eos_token_id: int,
    pad_token_id: int,
    config: Any = None,
    reward_placement: str = "last",
    max_new_tokens: int | None = None,
    reward_nonfinite: str = "raise",
    max_episode_tokens: int | None = None,
) -> Any:
    """``env`` itself when it is already a runner (has ``run(generate, batch, timings=)``, such as
    :class:`textrl.envs.collector.EpisodeRunner`), else the batch's runner of ``env`` (an
    environment, or a reward spec / callable: the single-turn task it scores) with the agent's
    ``tokenizer``, EOS and pad ids and generation limit (``max_new_tokens``, else ``config``'s) and,
    from its ``config``, its ``generation_batch_size`` and ``reward_concurrency``: how an async or
    ``does_io`` reward is scored in the background (docs/rewards.md, "Asynchronous rewards")."""
    if callable(getattr(env, "run", None)):
        return env
    if not callable(getattr(batch, "episode_runner", None)):
        raise TypeError(
            f"collect() got a {type(batch).__name__} as the prompt batch; pass an "
            "textrl.envs.prompts.PromptBatch (from PromptSampler.next_batch or encode_prompts)"
        )
    background = {name: value for name in ("generation_batch_size", "reward_concurrency")
                  if isinstance(value := getattr(config, name, None), int)}  # an async / does_io reward's parts
    return batch.episode_runner(
        env, tokenizer=tokenizer, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
        max_new_tokens=_max_new_tokens(config, max_new_tokens), reward_placement=reward_placement,
        reward_nonfinite=reward_nonfinite, max_episode_tokens=max_episode_tokens, **background,
    )


def run_episodes(agent: Any, batch: Any, runner: Any, greedy: bool, timings: dict[str, float] | None,
                 check_weights: bool = False) -> TensorDictBase:
    """The runner's episodes of ``batch``, the agent generating every turn: inside ``agent.rollout()``
    when the agent has one (it hands each turn's tokens with the log-probs its engine drew them with,
    and the version of the weights, which the rollout records: ``KEYS.generation_log_prob``,
    ``KEYS.policy_version``), else by ``agent.act``. With ``check_weights`` (a training rollout: every
    process draws one, so the check's forward and its shared decision run in step) a sampled rollout
    is then checked against the weights the agent handed over (the rollout's ``check_weights``, where
    it has one: :meth:`textrl.agents.actor.Actor.check_weights`); its ``take_weight_sync_seconds``, where
    it has one, adds the engine's seconds taking them to ``timings["weight_sync"]``."""
    device = torch.device(agent.device)
    opened = getattr(agent, "rollout", None)
    if not callable(opened):
        def generate(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            return agent.act(input_ids.to(device), attention_mask.to(device), greedy=greedy)  # [n, T]

        return runner.run(generate, batch.to(device), timings=timings)
    with opened(greedy=greedy) as sampled:
        episodes = lambda: runner.run(sampled.generate, batch.to(device), timings=timings)  # noqa: E731
        td = ended_together(getattr(getattr(agent, "backend", None), "dist", None), episodes) if check_weights \
            else episodes()
    td.set(KEYS.policy_version, torch.full(td.batch_size, int(sampled.version), dtype=torch.long, device=td.device))
    td.set(KEYS.policy_iteration, torch.full(td.batch_size, int(getattr(sampled, "iteration", 0)), dtype=torch.long,
                                             device=td.device))
    took = getattr(sampled, "take_weight_sync_seconds", None)
    if timings is not None and callable(took) and (seconds := took()) is not None:
        timings["weight_sync"] = timings.get("weight_sync", 0.0) + seconds  # within the generation seconds
    check = getattr(sampled, "check_weights", None)
    if check_weights and not greedy and callable(check):  # the engine sampled with the weights handed over
        check(td)
    return td


class RolloutFailedElsewhere(RuntimeError):
    """Another process's rollout failed with an error that is not an engine's (its line is in that
    process's output): this one stops too, rather than wait for it in the update's collectives."""


def ended_together(dist: Any, episodes: Callable[[], Any]) -> Any:
    """``episodes()`` (a training rollout's episodes, which every process draws); under several
    processes (``dist``: :class:`textrl.parallel.distributed.Distributed`; None: one) each then learns whether
    any process's failed before any goes on to the collectives that follow (the weight check, the
    forwards, the update): where one process's engine failed every process raises
    :class:`~textrl.generation.base.EngineFailed` (the others
    :class:`~textrl.generation.base.EngineFailedElsewhere`), so all save the last finished iteration
    together (:mod:`textrl.run.loop`); where another error stopped one, the others raise
    :class:`RolloutFailedElsewhere`. One collective of two flags."""
    if dist is None or not dist.enabled:
        return episodes()
    try:
        td = episodes()
    except EngineFailed:
        dist.mean({"engine": 1.0, "other": 0.0})
        raise
    except Exception:
        dist.mean({"engine": 0.0, "other": 1.0})
        raise
    failed = dist.mean({"engine": 0.0, "other": 0.0})
    if failed["engine"] > 0:
        raise EngineFailedElsewhere("the engine of another process failed in this iteration's rollout (its line is "
                                    "in that process's output)")
    if failed["other"] > 0:
        raise RolloutFailedElsewhere("another process's rollout failed in this iteration (its error is in that "
                                     "process's output)")
    return td


def collect(
    agent: Any,
    batch: Any,
    env: Any,
    *,
    reward_placement: str = "last",
    max_new_tokens: int | None = None,
    timings: dict[str, float] | None = None,
    reward_nonfinite: str = "raise",
    check_finite: bool = True,
) -> TensorDictBase:
    """One rollout TensorDict (docs/design.md, "The rollout TensorDict", ``batch_size=[B]``) for a batch of prompts.

    1. one episode per row of ``env`` (an environment, a runner of one, or a reward spec /
       callable such as ``"think_format,tag_count"``: the single-turn task it scores), run by
       :class:`textrl.envs.collector.EpisodeRunner`: ``agent.act`` samples every turn
       (micro-batched generation inside the agent), the environment answers;
    2. the runner writes the tokens, the agent and response masks, done flags,
       ``("next","reward")`` (placed by ``reward_placement``), ``("reward_components", name)``,
       the episode's turns and end reason, and ``KEYS.score`` float ``[B]`` (each row's task
       score, kept so it survives the KL shaping of the next step);
    3. ``agent.process_rollout(td)`` (when the agent has it) adds log-probs, values, KL shaping,
       ``advantage`` and ``value_target``;
    4. :func:`textrl.core.checks.check_rollout` validates the result.

    Every tensor is on ``agent.device``. ``max_new_tokens`` defaults to
    ``agent.config.max_new_tokens``; it must be the limit ``act`` generated with, since a row
    without EOS is only valid at full length. With a ``timings`` dict, the seconds of each of
    :data:`PHASES` are added to it (the agent times ``forward`` and ``advantages``).
    ``reward_nonfinite`` ('raise' | 'zero' | 'drop') is what a NaN/inf task reward does
    (:func:`textrl.envs.fast_path.rollout_from_responses`; 'drop' returns fewer rows).
    ``check_finite=False`` lets NaN/inf log-probs, values or advantages through the final check,
    for a caller (the trainer) whose ``agent.update`` skips such an update instead.
    """
    # 1.-2. rollout and rewards: every turn generated (timed as generation), the environment's
    # answers and the final reward (timed as reward)
    runner = episode_runner(batch, env, tokenizer=agent.tokenizer, eos_token_id=agent.eos_token_id,
                            pad_token_id=agent.pad_token_id, config=getattr(agent, "config", None),
                            reward_placement=reward_placement, max_new_tokens=max_new_tokens,
                            reward_nonfinite=reward_nonfinite)
    td = run_episodes(agent, batch, runner, greedy=False, timings=timings, check_weights=True)
    # 3. log-probs, values, advantages
    process = getattr(agent, "process_rollout", None)
    if callable(process):
        td = process(td) if timings is None else process(td, timings=timings)
    # 4. checks
    return check_rollout(td, finite=check_finite)


def evaluate_prompts(
    agent: Any,
    prompt_batches: Iterable[Any],
    env: Any,
    greedy: bool = True,
    *,
    max_new_tokens: int | None = None,
    reward_nonfinite: str = "raise",
) -> dict[str, float]:
    """Held-out evaluation: one episode of ``env`` per prompt, averaging the task rewards.

    Returns flat float metrics over all rows: ``reward/mean`` (the weighted task score, no KL),
    ``reward_components/NAME`` (each reward function's raw mean), ``response_length/mean``
    (the agent's tokens, EOS included), ``truncated/rate`` (episodes that did not end by the
    environment: a length cap, ``max_turns`` or the context), :func:`episode_metrics`,
    ``format_rate`` (fraction with ``think_format > 0``, only when that component exists) and
    ``accuracy`` (mean of the ``accuracy`` component, only when it exists). ``n`` is the row
    count. The agent's state is untouched (no ``process_rollout``). ``reward_nonfinite``: as in
    :func:`collect` (dropped rows are left out of every mean and of ``n``).
    """
    scores, lengths, truncated, turns, ends = [], [], [], [], []
    components: dict[str, list[torch.Tensor]] = {}
    runner = None
    for batch in prompt_batches:
        runner = runner or episode_runner(batch, env, tokenizer=agent.tokenizer, eos_token_id=agent.eos_token_id,
                                          pad_token_id=agent.pad_token_id, config=getattr(agent, "config", None),
                                          max_new_tokens=max_new_tokens, reward_nonfinite=reward_nonfinite)
        td = run_episodes(agent, batch, runner, greedy=greedy, timings=None)
        turns.append(td.get(KEYS.turns).float().cpu())
        ends.append(td.get(KEYS.end_reason).cpu())
        scores.append(td.get(SCORE_KEY).float().cpu())
        lengths.append(td.get(KEYS.mask).sum(1).float().cpu())
        truncated.append(td.get(KEYS.truncated).squeeze(-1).any(1).float().cpu())
        for name, value in td.get(KEYS.reward_components).items():
            components.setdefault(name, []).append(value.float().cpu())
    if not scores:
        raise ValueError("evaluate_prompts: no prompt batches given; pass at least one batch")
    comp = {name: torch.cat(values) for name, values in components.items()}
    metrics = {
        "reward/mean": torch.cat(scores).mean().item(),
        "response_length/mean": torch.cat(lengths).mean().item(),
        "truncated/rate": torch.cat(truncated).mean().item(),
        "n": float(sum(s.numel() for s in scores)),
    }
    # a component is NaN where its function does not apply to the row (it returned None)
    metrics.update({f"reward_components/{name}": v.nanmean().item() for name, v in comp.items()})
    metrics.update(episode_metrics(torch.cat(turns), torch.cat(ends)))
    if "think_format" in comp:
        metrics["format_rate"] = (comp["think_format"] > 0).float().mean().item()
    if "accuracy" in comp:
        metrics["accuracy"] = comp["accuracy"].nanmean().item()
    return metrics


def episode_metrics(turns: torch.Tensor, ends: torch.Tensor) -> dict[str, float]:
    """``episode/turns/mean`` and the share of episodes that ended for each reason of
    :data:`textrl.keys.END_REASONS` (``episode/end/done``, ``.../length``, ``.../max_turns``,
    ``.../context``), from ``turns`` and ``ends`` ``[N]``."""
    out = {"episode/turns/mean": turns.float().mean().item()}
    for i, reason in enumerate(END_REASONS):
        out[f"episode/end/{reason}"] = (ends == i).float().mean().item()
    return out


__all__ = ["PHASES", "SCORE_KEY", "RolloutFailedElsewhere", "collect", "ended_together", "episode_metrics", "episode_runner",
           "evaluate_prompts", "run_episodes"]
