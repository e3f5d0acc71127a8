"""The rollout TensorDict's key names, in one place (docs/design.md, "The rollout TensorDict").

Every module that reads or writes a rollout goes through :data:`KEYS`; the math in
:mod:`textrl.functional` never sees a key. Nested keys are tuples, as in TensorDict.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

NestedKey = str | tuple[str, ...]


@dataclass(frozen=True)
class RolloutKeys:
    """Key names of the rollout TensorDict (``batch_size=[B]``, time at dim 1)."""

    prompt_tokens: NestedKey = ("tokens", "prompt")
    """int64 ``[B, P]``: left-padded prompt token ids."""
    prompt_mask: NestedKey = ("masks", "prompt")
    """bool ``[B, P]``: True on real prompt tokens."""
    action: NestedKey = "action"
    """int64 ``[B, T]``: response tokens, right-padded after the last one."""
    mask: NestedKey = ("collector", "mask")
    """bool ``[B, T]``: the agent's tokens (the actions), EOS included: what is trained on. A prefix
    of Trues for a single turn; in a multi-turn episode it has gaps where the environment's
    observation tokens sit."""
    response_mask: NestedKey = ("masks", "response")
    """bool ``[B, T]``: every token of the episode after the prompt, agent's and environment's (the
    attention mask of the response side); a prefix of Trues, ``mask`` lies inside it. Equal to
    ``mask`` for a single turn. A rollout without it reads ``mask`` instead."""
    action_log_prob: NestedKey = "action_log_prob"
    """float ``[B, T]``: behaviour-policy log-prob of each action."""
    ref_log_prob: NestedKey = "ref_log_prob"
    """float ``[B, T]``: reference-policy log-prob of each action."""
    teacher_log_prob: NestedKey = "teacher_log_prob"
    """float ``[B, T]``: with ``--teacher``, the teacher's log-prob of each agent token in its context
    (its own distribution, temperature 1; 0 off the agent's tokens): on-policy distillation's reward."""
    generation_log_prob: NestedKey = ("generation", "log_prob")
    """float ``[B, T]``: the log-prob the generation engine drew each agent token with (0 on the
    environment's tokens and after the episode); absent when the engine computes none."""
    weight_gap_sum: NestedKey = ("weight_check", "gap_sum")
    """float64 ``[B]``: the sum over a row's checked tokens of ``|generation_log_prob - prefill|``, the
    prefill of the weights the engine should hold under its own top-k / top-p
    (:mod:`textrl.agents.weight_check`); 0 on rows not checked; absent without the engine's log-probs."""
    weight_gap_tokens: NestedKey = ("weight_check", "tokens")
    """int64 ``[B]``: the tokens :attr:`weight_gap_sum` adds up (0 on rows not checked)."""
    weight_gap_outside: NestedKey = ("weight_check", "outside")
    """int64 ``[B]``: the row's checked tokens the prefill's top-k / top-p drops (a draw the weights
    it should hold could not have made)."""
    proximal_log_prob: NestedKey = "proximal_log_prob"
    """float ``[B, T]``: with ``old_logprobs='engine'``, the learner's own prefill log-probs before the
    update (``action_log_prob`` holds the engine's then); absent otherwise."""
    correction_weight: NestedKey = "correction_weight"
    """float ``[B, T]``: the rollout / training mismatch correction's weight of each agent token
    (``rollout_correction``; 0 where the token or its row is rejected, and off the agent mask),
    which multiplies the per-token policy loss; absent with ``rollout_correction='none'``."""
    policy_version: NestedKey = "policy_version"
    """int64 ``[B]``: the version of the weights that generated each row (the learner's, as the actor
    last loaded them); the update logs its lag behind the learner."""
    policy_iteration: NestedKey = ("provenance", "iteration")
    """int64 ``[B]``: with ``max_staleness`` > 0, the learner iteration (updates done) whose weights drew
    the row's first turn; the update logs its staleness behind the learner (``rollout/staleness``)."""
    token_iteration: NestedKey = ("provenance", "token_iteration")
    """int64 ``[B, T]``: with ``partial_rollouts='continue'``, the iteration whose weights sampled each
    agent token (-1 off the agent's tokens)."""
    state_value: NestedKey = "state_value"
    """float ``[B, T, 1]``: V(s_t)."""
    next_state_value: NestedKey = ("next", "state_value")
    """float ``[B, T, 1]``: V(s_{t+1}); 0 after the last valid token."""
    reward: NestedKey = ("next", "reward")
    """float ``[B, T, 1]``: per-token reward the agent optimises (task reward + shaping)."""
    done: NestedKey = ("next", "done")
    """bool ``[B, T, 1]``: True exactly once per row, at its last valid token."""
    terminated: NestedKey = ("next", "terminated")
    """bool ``[B, T, 1]``: the row ended with EOS at this token."""
    truncated: NestedKey = ("next", "truncated")
    """bool ``[B, T, 1]``: the row hit ``max_new_tokens`` at this token without EOS."""
    task_reward: NestedKey = ("next", "task_reward")
    """float ``[B, T, 1]``: the environment's reward before any shaping: each turn's reward on that
    turn's last agent token (``reward_placement='last'``), 0 elsewhere; its sum over time is
    ``score``."""
    turns: NestedKey = ("episode", "turns")
    """int64 ``[B]``: agent turns the episode took."""
    end_reason: NestedKey = ("episode", "end")
    """int64 ``[B]``: why the episode ended, an index into :data:`END_REASONS`."""
    advantage: NestedKey = "advantage"
    """float ``[B, T, 1]``: written by the advantage estimator."""
    value_target: NestedKey = "value_target"
    """float ``[B, T, 1]``: return target of the value loss."""
    loss_mask: NestedKey = "loss_mask"
    """bool ``[B, T]``: the tokens the policy loss counts, where an estimator leaves rows out of
    it (DAPO's dynamic sampling: groups whose rewards are all equal); absent: ``mask``."""
    reward_components: NestedKey = "reward_components"
    """sub-TensorDict: ``(reward_components, name)`` float ``[B]``, each reward's raw score."""
    score: NestedKey = "score"
    """float ``[B]``: each row's task score (the weighted reward total), kept before KL shaping."""
    reward_nonfinite: NestedKey = "reward_nonfinite"
    """bool ``[B]``: the row's task reward was NaN/inf and was set to 0 (written only under
    ``reward_nonfinite='zero'`` or ``'drop'``; dropped rows are gone from the rollout)."""

    def reward_component(self, name: str) -> tuple[str, str]:
        """Key of one reward function's raw score ``[B]``."""
        return (str(self.reward_components), name)

    def all(self) -> dict[str, NestedKey]:
        """Field name -> key, for iteration and documentation."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


END_REASONS = ("done", "length", "max_turns", "context")
"""Why an episode ended (``KEYS.end_reason``): the environment (or, single-turn, EOS) ended it;
a turn hit ``max_new_tokens`` without ending; ``max_turns`` agent turns were taken; the next
observation would not fit the context (the episode is truncated before it)."""

KEYS = RolloutKeys()
"""The default key set; pass another :class:`RolloutKeys` to rename keys."""

__all__ = ["END_REASONS", "KEYS", "NestedKey", "RolloutKeys"]
