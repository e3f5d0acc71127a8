"""The forwards of a PPO-family agent's models: prefill log-probs, entropy and values under the
run's precision (:class:`Forwards`, shared by the actor and the learner), the inputs of a rollout's
sequences, and the behaviour forward kept for a one-step update (:class:`RolloutForward`).

A loss calls :func:`forward_policy` and :func:`forward_values` (the learner's policy and critic, or
the kept forward); the actor (:mod:`textrl.agents.actor`) runs the rollout-time forwards.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDictBase
from torch import Tensor, nn

from textrl.functional import (
    entropy_from_logits,
    logprobs_from_hidden,
    logprobs_from_logits,
    sampling_filter,
)
from textrl.keys import KEYS
from textrl.models.forward import (
    UnfusableHead,
    positions_from_mask,
    response_logits,
    response_logprobs,
)
from textrl.models.packed_forward import (
    critic_layout,
    packed_hidden,
    packed_logits,
    packed_values,
    packing_layout,
)
from textrl.models.packing import Packing, pack_rows

SCORE = KEYS.score
"""Key of the task score per row ``[B]`` (float), before any KL shaping."""

position_ids_for = positions_from_mask
"""Positions that skip left padding: ``cumsum(mask) - 1`` clamped at 0, ``[B, L] -> [B, L]``
(:func:`textrl.models.forward.positions_from_mask`)."""

FORWARD = "rollout_forward"
"""Sub-key of a micro-batch holding the kept behaviour forward (:func:`with_forward`)."""


def attended_response(td: TensorDictBase) -> Tensor:
    """The response tokens a forward attends to, bool ``[B, T]``: ``KEYS.response_mask`` (every
    token of the episode, the environment's observations included), else ``KEYS.mask`` (a
    single-turn rollout, where the two are equal)."""
    response = td.get(KEYS.response_mask, None)
    return td.get(KEYS.mask) if response is None else response


def sequence_inputs(td: TensorDictBase) -> tuple[Tensor, Tensor, int]:
    """``(input_ids [B, P+T], attention_mask [B, P+T], P)`` of prompt + response.

    The attention mask covers the prompt and :func:`attended_response`: in a multi-turn episode the
    agent's later tokens attend to the observations before them (docs/design.md, "Multi-turn
    episodes"); losses and counts still use the agent mask ``KEYS.mask``.
    """
    prompt = td.get(KEYS.prompt_tokens)
    input_ids = torch.cat([prompt, td.get(KEYS.action)], dim=1)
    attention_mask = torch.cat([td.get(KEYS.prompt_mask), attended_response(td)], dim=1)
    return input_ids, attention_mask, prompt.shape[1]


def warp_logits(logits: Tensor, temperature: float, top_k: int, top_p: float) -> Tensor:
    """The sampling distribution's logits: temperature, then top-k, then top-p (as HF generate).

    ``[..., V] -> [..., V]``. Filtered entries become ``-inf``; with top_k=0 and top_p=1 only the
    temperature is applied (and that is left to :func:`logprobs_from_logits` to avoid a copy).
    """
    if top_k <= 0 and top_p >= 1.0:
        return logits
    return sampling_filter(logits.float() / temperature, top_k, top_p)


def micro_batches(n: int, size: int) -> Iterator[slice]:
    """Slices of ``size`` rows over ``n`` rows."""
    for start in range(0, n, size):
        yield slice(start, min(n, start + size))


@dataclass
class RolloutForward:
    """The policy (and critic) forward of :func:`evaluate`, kept with its graph.

    ``logp``, ``entropy``, ``values`` ``[B, T]`` with grad; ``stored`` the detached log-probs
    written into the rollout (identifies it); ``version`` the version of the weights it read
    (:class:`textrl.core.versions.VersionCounter`).
    """

    logp: Tensor
    entropy: Tensor
    values: Tensor | None
    stored: Tensor
    version: int

    def rows(self, idx: Tensor) -> RolloutForward:
        """The same forward for rows ``idx`` (a minibatch), graph kept."""
        values = self.values[idx] if self.values is not None else None
        return RolloutForward(self.logp[idx], self.entropy[idx], values, self.stored[idx], self.version)


def with_forward(mb: TensorDictBase, forward: RolloutForward) -> TensorDictBase:
    """``mb`` carrying the kept behaviour forward of its rows (``(FORWARD, "logp")``, ...), which
    :func:`forward_policy` and :func:`forward_values` return instead of running the models."""
    mb.set((FORWARD, "logp"), forward.logp)
    mb.set((FORWARD, "entropy"), forward.entropy)
    if forward.values is not None:
        mb.set((FORWARD, "values"), forward.values)
    return mb


# -- the run's forwards ------------------------------------------------------------------------------
class Forwards:
    """The forwards of a run's models under its precision: the policy's log-probs (at the temperature, no filter) of
    given tokens (fused with the LM head in chunks where it can), the entropy, the values. The actor
    runs them at rollout time, a loss at update time (:func:`forward_policy`, :func:`forward_values`);
    every one runs under ``precision.autocast()`` (:class:`textrl.core.precision.Precision`: the one
    autocast context of the package)."""

    def __init__(self, config: Any, precision: Any) -> None:
        self.config = config
        self.precision = precision
        self.unfused_warned = False
        """Whether the fused path's fallback was said (once a run)."""

    def packing(self, model: nn.Module, input_ids: Tensor, attention_mask: Tensor, prompt_len: int, *,
                critic: bool = False) -> Packing | None:
        """With ``config.padding_free``, the batch's attended tokens packed for ``model``
        (:func:`textrl.models.packing.pack_rows` in the layout :func:`~textrl.models.packed_forward.packing_layout`
        or, for a critic, :func:`~textrl.models.packed_forward.critic_layout` finds); None when off
        or when no response token is attended (the padded forward runs)."""
        if not getattr(self.config, "padding_free", False):
            return None
        device = input_ids.device
        with self.precision.autocast():
            layout = critic_layout(model, device) if critic else packing_layout(model, device)
        packed = pack_rows(input_ids, attention_mask, prompt_len, layout)
        return packed if packed.picks else None

    def response_logits(self, model: nn.Module, input_ids: Tensor, attention_mask: Tensor, prompt_len: int) -> Tensor:
        """Logits that predict each response token: ``[B, T, V]``, under the run's precision.

        :func:`textrl.models.forward.response_logits`: the LM head runs on the response columns
        only, and no attention row is fully masked (left-padded prompts are left-aligned first).
        """
        with self.precision.autocast():
            return response_logits(model, input_ids, attention_mask, prompt_len)

    def values(self, critic: nn.Module, input_ids: Tensor, attention_mask: Tensor, prompt_len: int) -> Tensor:
        """V(s_t) for each response position: ``[B, T]`` (state = prompt + tokens before t); with
        ``padding_free`` on the attended tokens only (0 at padding)."""
        packed = self.packing(critic, input_ids, attention_mask, prompt_len, critic=True)
        with self.precision.autocast():
            if packed is not None:
                return packed.scatter(packed_values(critic, packed).float())
            out = critic(input_ids=input_ids, attention_mask=attention_mask.long())
        return out[:, prompt_len - 1 : -1].float()

    def sampling_logprobs(self, logits: Tensor, action: Tensor) -> Tensor:
        """Log-probs ``[B, T]`` of ``action`` under the policy at the run's temperature, with no top-k
        or top-p filter: the learner's, the reference's and the old policy's log-probs (docs/training.md,
        "Sampling settings and the log-probs": the truncation belongs to the behaviour policy)."""
        return logprobs_from_logits(logits, action, temperature=self.config.temperature)

    def filtered_logprobs(self, model: nn.Module, input_ids: Tensor, attention_mask: Tensor, prompt_len: int,
                          action: Tensor) -> Tensor:
        """Log-probs ``[B, T]`` of ``action`` under the distribution the engine draws from: temperature,
        then top-k, then top-p (:func:`warp_logits`; ``-inf`` on a token the filter drops). Only the
        weight check reads them (:func:`textrl.agents.weight_check.weight_gap`), never a loss."""
        cfg = self.config
        logits = self.response_logits(model, input_ids, attention_mask, prompt_len)  # [B, T, V]
        warped = warp_logits(logits, cfg.temperature, cfg.top_k, cfg.top_p)
        return logprobs_from_logits(warped, action, temperature=cfg.temperature if warped is logits else 1.0)

    def fused_chunk(self) -> int | None:
        """Response positions per chunk of the fused LM head + log-softmax: ``config.logprob_chunk_size``
        (0: off, the whole response's logits); unset, on CUDA None (chunks of
        :data:`textrl.functional.logprobs.DEFAULT_CHUNK_ELEMENTS` logits: 110 positions at 151,936
        tokens) and off (0) on the CPU."""
        size = self.config.logprob_chunk_size
        if size is None:
            return None if self.precision.device.type == "cuda" else 0
        return size

    def fused_logprobs(self, model: nn.Module, input_ids: Tensor, attention_mask: Tensor, prompt_len: int,
                       action: Tensor, entropy: str) -> tuple[Tensor, Tensor | None] | None:
        """``(logp [B, T], entropy [B, T] or None)`` of ``action`` from ``model``'s final hidden states and
        LM head in chunks of :meth:`fused_chunk` positions (:func:`textrl.models.forward.response_logprobs`:
        no ``[B, T, V]`` logits); None when the fused path is off or the model's head cannot run
        outside its forward (then once a warning if ``logprob_chunk_size`` was asked for)."""
        chunk = self.fused_chunk()
        if chunk == 0:
            return None
        cfg = self.config
        try:
            with self.precision.autocast():
                return response_logprobs(model, input_ids, attention_mask, prompt_len, action,
                                         temperature=cfg.temperature, chunk_size=chunk, entropy=entropy)
        except UnfusableHead as err:
            self.warn_unfused(err)
            return None

    def warn_unfused(self, err: UnfusableHead) -> None:
        """Say once a run that the fused path asked for (``logprob_chunk_size``) cannot run, and why."""
        cfg = self.config
        if cfg.logprob_chunk_size is not None and not self.unfused_warned:
            self.unfused_warned = True
            reason = str(err).removesuffix("; use response_logits")
            warnings.warn(f"logprob_chunk_size={cfg.logprob_chunk_size}: {reason}; this run's log-probs use "
                          "the whole response's logits", stacklevel=3)

    def packed_logprobs(self, model: nn.Module, packed: Packing, action: Tensor,
                        entropy: str) -> tuple[Tensor, Tensor | None]:
        """``(logp [B, T], entropy [B, T] or None)`` of ``action`` on the packed attended tokens
        (:mod:`textrl.models.packed_forward`), 0 at padding: the fused head in chunks where
        :meth:`fused_chunk` asks for it and the head allows, else the picks' logits ``[n, V]``.
        ``entropy``: ``none``, ``detached`` or ``grad`` (:func:`textrl.functional.logprobs_from_hidden`)."""
        cfg = self.config
        tokens = packed.gather(action)[None]  # [1, n]
        chunk = self.fused_chunk()
        logp = ent = None
        with self.precision.autocast():
            if chunk != 0:
                try:
                    hidden, head = packed_hidden(model, packed)  # [n, H]
                    logp, ent = logprobs_from_hidden(hidden[None], head.weight, tokens, bias=head.bias,
                                                     temperature=cfg.temperature, chunk_size=chunk, entropy=entropy)
                except UnfusableHead as err:
                    self.warn_unfused(err)
            if logp is None:
                logits = packed_logits(model, packed)[None]  # [1, n, V]
                logp = self.sampling_logprobs(logits, tokens)
                if entropy != "none":
                    source = logits if entropy == "grad" else logits.detach()
                    ent = entropy_from_logits(source, temperature=cfg.temperature)
        return packed.scatter(logp[0]), None if ent is None else packed.scatter(ent[0])

    def logprobs(self, model: nn.Module, input_ids: Tensor, attention_mask: Tensor, prompt_len: int,
                 action: Tensor) -> Tensor:
        """Log-probs of the response tokens under ``model`` at the run's temperature (no top-k / top-p:
        :meth:`sampling_logprobs`): ``[B, T]`` (:meth:`fused_logprobs` when it is on)."""
        packed = self.packing(model, input_ids, attention_mask, prompt_len)
        if packed is not None:
            return self.packed_logprobs(model, packed, action, entropy="none")[0]
        fused = self.fused_logprobs(model, input_ids, attention_mask, prompt_len, action, entropy="none")
        if fused is not None:
            return fused[0]
        logits = self.response_logits(model, input_ids, attention_mask, prompt_len)
        return self.sampling_logprobs(logits, action)

    def logprobs_and_entropy(self, model: nn.Module, input_ids: Tensor, attention_mask: Tensor, prompt_len: int,
                             action: Tensor) -> tuple[Tensor, Tensor]:
        """``(logp [B, T], entropy [B, T])`` of ``action`` under ``model`` (grad as the caller's mode).

        The entropy carries grad only when ``entropy_coef > 0`` (otherwise it is only logged).
        """
        cfg = self.config
        entropy = "grad" if cfg.entropy_coef > 0 else "detached"
        packed = self.packing(model, input_ids, attention_mask, prompt_len)
        if packed is not None:
            return self.packed_logprobs(model, packed, action, entropy=entropy)  # type: ignore[return-value]
        fused = self.fused_logprobs(model, input_ids, attention_mask, prompt_len, action, entropy=entropy)
        if fused is not None:
            return fused  # type: ignore[return-value]
        logits = self.response_logits(model, input_ids, attention_mask, prompt_len)  # [B, T, V]
        logp = self.sampling_logprobs(logits, action)
        source = logits if cfg.entropy_coef > 0 else logits.detach()
        return logp, entropy_from_logits(source, temperature=cfg.temperature)


# -- a loss's forwards ----------------------------------------------------------------------------
def forward_policy(agent: Any, mb: TensorDictBase) -> tuple[Tensor, Tensor]:
    """Current ``(logp [B, T], entropy [B, T])`` of a minibatch's actions under the learner's policy,
    with grad: the kept behaviour forward when ``mb`` carries one (:func:`with_forward`), else a forward
    (:meth:`Forwards.logprobs_and_entropy`). ``agent``: what a loss has, the agent (``self``), or its
    learner (:class:`textrl.agents.learner.Learner`); only its learner is read."""
    kept = mb.get((FORWARD, "logp"), None)
    if kept is not None:
        return kept, mb.get((FORWARD, "entropy"))
    learner = getattr(agent, "learner", agent)
    input_ids, attention_mask, p = sequence_inputs(mb)
    return learner.forwards.logprobs_and_entropy(learner.policy, input_ids, attention_mask, p, mb.get(KEYS.action))


def forward_values(agent: Any, mb: TensorDictBase) -> Tensor:
    """Current ``V(s_t)`` ``[B, T]`` of a minibatch under the learner's critic, with grad (the kept
    forward's when ``mb`` carries one). ``agent``: the agent or its learner, as :func:`forward_policy`."""
    kept = mb.get((FORWARD, "values"), None)
    if kept is not None:
        return kept
    learner = getattr(agent, "learner", agent)
    input_ids, attention_mask, p = sequence_inputs(mb)
    return learner.forwards.values(learner.critic, input_ids, attention_mask, p)


def overrides(agent_type: type, name: str) -> bool:
    """Whether ``agent_type`` (or a class between it and the class that first defines ``name``,
    :class:`~textrl.agents.base.PPOAgent` for its hooks) replaces that definition: a hook the
    construction and the forwards treat differently when a user's agent brings its own
    (``load_policy`` loads without the warm-up; ``behaviour_logprobs`` is an old-policy snapshot)."""
    owners = [klass for klass in agent_type.__mro__ if name in vars(klass)]
    return len(owners) > 1


def own_behaviour_logprobs(agent_type: type) -> bool:
    """Whether an agent class's behaviour log-probs are the policy's own (no old-policy snapshot):
    its ``behaviour_logprobs`` is :class:`~textrl.agents.base.PPOAgent`'s, not an override."""
    return not overrides(agent_type, "behaviour_logprobs")


def reuses_rollout_forward(config: Any, reuse: bool, own_behaviour: bool) -> bool:
    """Whether an agent's update is one optimiser step over the whole rollout from the behaviour
    policy itself (1 epoch, 1 minibatch, no accumulation by rows or tokens in ``config``, no
    old-policy snapshot: ``own_behaviour``, :func:`own_behaviour_logprobs`).

    Then that step's forward is the behaviour forward: the actor's :meth:`~textrl.agents.actor.Actor.evaluate`
    runs it with grad, the advantages are computed from its detached log-probs and values, and the step
    back-propagates through it instead of running the policy and critic again (one forward
    each fewer per iteration; the graph is held from the prefill to the step, as the step's
    own forward would hold it). ``reuse``: the agent's ``reuse_rollout_forward`` (False turns it off).
    """
    return (
        reuse
        and config.ppo_epochs == 1
        and config.num_minibatches == 1
        and config.gradient_accumulation_steps == 1
        and getattr(config, "microbatch_tokens", None) is None
        and own_behaviour
    )


__all__ = [
    "FORWARD", "SCORE", "Forwards", "RolloutForward", "attended_response", "forward_policy", "forward_values",
    "micro_batches", "overrides", "own_behaviour_logprobs", "position_ids_for", "reuses_rollout_forward", "sequence_inputs",
    "warp_logits", "with_forward",
]
