"""Acting and forwards of a PPO-family agent: generation, prefill log-probs and values, the rollout's
processing, and the behaviour forward kept for a one-step update.

Module functions of the agent (``act(agent, ...)``): :class:`~textrl.agents.base.PPOAgent`'s
``act``, ``evaluate`` and ``process_rollout`` call the functions of the same names; a loss calls
:func:`forward_policy` and :func:`forward_values`, a behaviour forward :func:`logprobs`. Every
forward runs under the run's precision (``agent.precision.autocast()``,
:class:`textrl.precision.Precision`: the one autocast context of the package).
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from tensordict import TensorDict, TensorDictBase
from torch import Tensor, nn

from textrl.functional import (
    entropy_from_logits,
    kl_penalty,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    next_valid,
    sampling_filter,
)
from textrl.generation import Sampling
from textrl.keys import KEYS
from textrl.models.forward import (
    UnfusableHead,
    positions_from_mask,
    response_logits,
    response_logprobs,
)
from textrl.parallel.fsdp_sharding import local
from textrl.timing import timed
from textrl.versions import tensor_versions

if TYPE_CHECKING:
    from textrl.agents.base import PPOAgent

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
    written into the rollout (identifies it); ``version`` the weights' versions at the forward.
    """

    logp: Tensor
    entropy: Tensor
    values: Tensor | None
    stored: Tensor
    version: tuple[tuple[int, int], ...]

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


# -- 1. acting ------------------------------------------------------------------------------------
@torch.no_grad()
def act(agent: PPOAgent, input_ids: Tensor, attention_mask: Tensor, *, greedy: bool = False) -> Tensor:
    """:meth:`PPOAgent.act <textrl.agents.base.PPOAgent.act>`: sample responses ``[B, T]``."""
    cfg = agent.config
    sampling = rollout_sampling(agent, greedy=greedy)
    engine = agent.generation_engine
    extra = {"synced_gpus": True} if agent.backend.partitions_weights else {}  # each forward is a collective
    outs = []
    for sl in micro_batches(input_ids.shape[0], cfg.generation_batch_size):
        ids = input_ids[sl].to(agent.device)
        mask = attention_mask[sl].to(agent.device)
        with agent.precision.autocast(), agent.backend.gathered(agent.policy), torch.no_grad():
            try:
                outs.append(engine.generate(agent.policy, ids, mask.long(), sampling, **extra))
            except RuntimeError as err:
                if "probability tensor contains" not in str(err):
                    raise
                raise overflowed(agent) from err
    width = max(o.shape[1] for o in outs)
    return torch.cat(
        [nn.functional.pad(o, (0, width - o.shape[1]), value=agent.pad_token_id) for o in outs], dim=0
    )


def rollout_sampling(agent: PPOAgent, *, greedy: bool = False) -> Sampling:
    """What :func:`act` draws (:class:`textrl.generation.Sampling`): greedy, or the config's
    temperature, top-k and top-p (the warping :func:`logprobs` applies), the length cap, the
    tokenizer's EOS / pad ids."""
    cfg = agent.config
    return Sampling(greedy=greedy, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                    max_new_tokens=cfg.max_new_tokens, eos_token_id=agent.eos_token_id,
                    pad_token_id=agent.pad_token_id)


def overflowed(agent: PPOAgent) -> ValueError:
    """Sampling met NaN/inf probabilities: the weights are finite (checked after every update)
    but so large that the forward overflows. A ``ValueError`` naming the largest weight and
    the learning rate, for a one-line stop (the checkpoints on disk are intact)."""
    largest = max((float(p.detach().abs().max()) for p in agent.policy.parameters() if p.numel()), default=0.0)
    return ValueError(
        f"generation drew from NaN/inf probabilities: the policy's forward overflows (its largest weight "
        f"is {largest:.3g}, actor_lr={agent.config.actor_lr:g}); lower --actor-lr (or set --max-grad-norm), "
        "then resume from a checkpoint taken before the weights grew (--resume takes the newest)")


# -- 2. forwards ----------------------------------------------------------------------------------
def precise_response_logits(agent: PPOAgent, model: nn.Module, input_ids: Tensor, attention_mask: Tensor,
                            prompt_len: int) -> Tensor:
    """Logits that predict each response token: ``[B, T, V]``, under the run's precision.

    :func:`textrl.models.forward.response_logits`: the LM head runs on the response columns
    only, and no attention row is fully masked (left-padded prompts are left-aligned first).
    """
    with agent.precision.autocast():
        return response_logits(model, input_ids, attention_mask, prompt_len)


def values(agent: PPOAgent, input_ids: Tensor, attention_mask: Tensor, prompt_len: int) -> Tensor:
    """V(s_t) for each response position: ``[B, T]`` (state = prompt + tokens before t)."""
    with agent.precision.autocast():
        out = agent.critic(input_ids=input_ids, attention_mask=attention_mask.long())
    return out[:, prompt_len - 1 : -1].float()


def sampling_logprobs(agent: PPOAgent, logits: Tensor, action: Tensor) -> Tensor:
    """Log-probs ``[B, T]`` of ``action`` under the sampling distribution (temperature, top-k, top-p)."""
    cfg = agent.config
    warped = warp_logits(logits, cfg.temperature, cfg.top_k, cfg.top_p)
    # warp_logits already divided by the temperature when it filtered; otherwise do it here.
    temperature = cfg.temperature if warped is logits else 1.0
    return logprobs_from_logits(warped, action, temperature=temperature)


def fused_chunk(agent: PPOAgent) -> int | None:
    """Response positions per chunk of the fused LM head + log-softmax: ``config.logprob_chunk_size``
    (0: off, the whole response's logits); unset, on CUDA None (chunks of
    :data:`textrl.functional.logprobs.DEFAULT_CHUNK_ELEMENTS` logits: 110 positions at 151,936
    tokens) and off (0) on the CPU."""
    size = agent.config.logprob_chunk_size
    if size is None:
        return None if agent.device.type == "cuda" else 0
    return size


def fused_logprobs(agent: PPOAgent, model: nn.Module, input_ids: Tensor, attention_mask: Tensor, prompt_len: int,
                   action: Tensor, entropy: str) -> tuple[Tensor, Tensor | None] | None:
    """``(logp [B, T], entropy [B, T] or None)`` of ``action`` from ``model``'s final hidden states and
    LM head in chunks of :func:`fused_chunk` positions (:func:`textrl.models.forward.response_logprobs`:
    no ``[B, T, V]`` logits), under the run's precision; None when the fused path is off or the model's
    head cannot run outside its forward (then once a warning if ``logprob_chunk_size`` was asked for)."""
    chunk = fused_chunk(agent)
    if chunk == 0:
        return None
    cfg = agent.config
    try:
        with agent.precision.autocast():
            return response_logprobs(model, input_ids, attention_mask, prompt_len, action, temperature=cfg.temperature,
                                     top_k=cfg.top_k, top_p=cfg.top_p, chunk_size=chunk, entropy=entropy)
    except UnfusableHead as err:
        if cfg.logprob_chunk_size is not None and not getattr(agent, "_unfused_warned", False):
            agent._unfused_warned = True
            reason = str(err).removesuffix("; use response_logits")
            warnings.warn(f"logprob_chunk_size={cfg.logprob_chunk_size}: {reason}; this run's log-probs use the whole "
                          "response's logits", stacklevel=2)
        return None


def logprobs(agent: PPOAgent, model: nn.Module, input_ids: Tensor, attention_mask: Tensor, prompt_len: int,
             action: Tensor) -> Tensor:
    """Log-probs of the response tokens under the sampling distribution of ``model``: ``[B, T]``
    (:func:`fused_logprobs` when it is on)."""
    fused = fused_logprobs(agent, model, input_ids, attention_mask, prompt_len, action, entropy="none")
    if fused is not None:
        return fused[0]
    logits = precise_response_logits(agent, model, input_ids, attention_mask, prompt_len)
    return sampling_logprobs(agent, logits, action)


def logprobs_and_entropy(agent: PPOAgent, input_ids: Tensor, attention_mask: Tensor, prompt_len: int,
                         action: Tensor) -> tuple[Tensor, Tensor]:
    """``(logp [B, T], entropy [B, T])`` of ``action`` under the policy (grad as the caller's mode).

    The entropy carries grad only when ``entropy_coef > 0`` (otherwise it is only logged).
    """
    cfg = agent.config
    fused = fused_logprobs(agent, agent.policy, input_ids, attention_mask, prompt_len, action,
                           entropy="grad" if cfg.entropy_coef > 0 else "detached")
    if fused is not None:
        return fused  # type: ignore[return-value]
    logits = precise_response_logits(agent, agent.policy, input_ids, attention_mask, prompt_len)  # [B, T, V]
    logp = sampling_logprobs(agent, logits, action)
    source = logits if cfg.entropy_coef > 0 else logits.detach()
    entropy = entropy_from_logits(source, temperature=cfg.temperature)
    return logp, entropy


def forward_policy(agent: PPOAgent, mb: TensorDictBase) -> tuple[Tensor, Tensor]:
    """Current ``(logp [B, T], entropy [B, T])`` of a minibatch's actions, with grad: the kept
    behaviour forward when ``mb`` carries one (:func:`with_forward`), else a forward."""
    kept = mb.get((FORWARD, "logp"), None)
    if kept is not None:
        return kept, mb.get((FORWARD, "entropy"))
    input_ids, attention_mask, p = sequence_inputs(mb)
    return logprobs_and_entropy(agent, input_ids, attention_mask, p, mb.get(KEYS.action))


def forward_values(agent: PPOAgent, mb: TensorDictBase) -> Tensor:
    """Current ``V(s_t)`` ``[B, T]`` of a minibatch, with grad (the kept forward's when ``mb`` carries one)."""
    kept = mb.get((FORWARD, "values"), None)
    if kept is not None:
        return kept
    input_ids, attention_mask, p = sequence_inputs(mb)
    return values(agent, input_ids, attention_mask, p)


def own_behaviour_logprobs(agent: PPOAgent) -> bool:
    """Whether the agent's behaviour log-probs are the policy's own (no old-policy snapshot):
    its ``behaviour_logprobs`` is :class:`~textrl.agents.base.PPOAgent`'s, not an override."""
    return not type(agent).overrides("behaviour_logprobs")


@torch.no_grad()
def evaluate(agent: PPOAgent, td: TensorDictBase, *, keep_graph: bool = False) -> TensorDict:
    """:meth:`PPOAgent.evaluate <textrl.agents.base.PPOAgent.evaluate>`: log-probs, reference
    log-probs and values of a rollout, one prefill forward per micro-batch."""
    cfg = agent.config
    input_ids, attention_mask, p = sequence_inputs(td)
    action = td.get(KEYS.action)
    out = defaultdict(list)
    for sl in micro_batches(input_ids.shape[0], cfg.forward_batch_size):
        args = (input_ids[sl], attention_mask[sl], p)
        if keep_graph:
            with torch.enable_grad():
                logp, entropy = logprobs_and_entropy(agent, *args, action[sl])
                out["graph_logp"].append(logp)
                out["graph_entropy"].append(entropy)
                out["logp"].append(logp.detach())
                if agent.critic is not None:
                    out["graph_value"].append(values(agent, *args))
                    out["value"].append(out["graph_value"][-1].detach())
        else:
            out["logp"].append(agent.behaviour_logprobs(*args, action[sl]))
            if agent.critic is not None:
                out["value"].append(values(agent, *args))
        if agent.ref_policy is not None:
            out["ref"].append(logprobs(agent, agent.ref_policy, *args, action[sl]))
    logp = torch.cat(out["logp"])
    result = TensorDict({KEYS.action_log_prob: logp}, batch_size=td.batch_size)
    if agent.ref_policy is not None:
        result.set(KEYS.ref_log_prob, torch.cat(out["ref"]))
    if agent.critic is not None:
        result.set(KEYS.state_value, torch.cat(out["value"]).unsqueeze(-1))
    if own_behaviour_logprobs(agent):  # the policy's own log-probs
        agent._policy_logp = (logp, logp._version, policy_version(agent))
    agent._rollout_forward = None
    if keep_graph:
        with torch.enable_grad():  # a concatenation under no_grad would cut the graph
            agent._rollout_forward = RolloutForward(
                logp=torch.cat(out["graph_logp"]),
                entropy=torch.cat(out["graph_entropy"]),
                values=torch.cat(out["graph_value"]) if agent.critic is not None else None,
                stored=logp,
                version=weights_version(agent),
            )
    return result


def reuses_rollout_forward(agent: PPOAgent) -> bool:
    """Whether ``agent.update`` is one optimiser step over the whole rollout from the behaviour
    policy itself (1 epoch, 1 minibatch, no accumulation, no old-policy snapshot).

    Then that step's forward is the behaviour forward: :func:`process_rollout` runs it with
    grad, the advantages are computed from its detached log-probs and values, and the step
    back-propagates through it instead of running the policy and critic again (one forward
    each fewer per iteration; the graph is held from the prefill to the step, as the step's
    own forward would hold it). ``reuse_rollout_forward = False`` on an agent turns it off.
    """
    cfg = agent.config
    return (
        agent.reuse_rollout_forward
        and cfg.ppo_epochs == 1
        and cfg.num_minibatches == 1
        and cfg.gradient_accumulation_steps == 1
        and own_behaviour_logprobs(agent)
    )


def take_rollout_forward(agent: PPOAgent, td: TensorDictBase) -> RolloutForward | None:
    """The kept forward of :func:`evaluate` if it belongs to ``td`` and no weight changed since."""
    kept, agent._rollout_forward = agent._rollout_forward, None
    if kept is None or not reuses_rollout_forward(agent):
        return None
    logp = td.get(KEYS.action_log_prob, None)
    if logp is not kept.stored or kept.version != weights_version(agent):
        return None
    return kept


def weights_version(agent: PPOAgent) -> tuple[tuple[int, int], ...]:
    """:func:`policy_version` of the policy and the critic together."""
    critic = () if agent.critic is None else tensor_versions(map(local, agent.critic.parameters()))
    return policy_version(agent) + critic


def policy_version(agent: PPOAgent) -> tuple[tuple[int, int], ...]:
    """Changes whenever a policy weight is replaced or modified in place (optimiser step, load)."""
    return tensor_versions(map(local, agent.policy.parameters()))


@torch.no_grad()
def policy_ref_kl(agent: PPOAgent, td: TensorDictBase) -> float:
    """Mean per-token KL(policy || ref) (``config.kl_kind``) of the rollout's actions, now.

    When the rollout's ``action_log_prob`` are the policy's own (computed by :func:`evaluate`,
    neither they nor a policy weight changed since), they are reused instead of recomputed:
    the forward would give the same numbers. This makes ``kl/before_update`` free.
    """
    input_ids, attention_mask, p = sequence_inputs(td)
    action, mask = td.get(KEYS.action), td.get(KEYS.mask)
    cached, cached_version, version = getattr(agent, "_policy_logp", None) or (None, None, None)
    logp = td.get(KEYS.action_log_prob, None)
    if not (logp is not None and logp is cached and logp._version == cached_version
            and version == policy_version(agent)):
        logp = torch.cat([
            logprobs(agent, agent.policy, input_ids[sl], attention_mask[sl], p, action[sl])
            for sl in micro_batches(td.shape[0], agent.config.forward_batch_size)
        ])
    kl = kl_penalty(logp, td.get(KEYS.ref_log_prob), kind=agent.config.kl_kind)
    return masked_mean(kl, mask).item()


# -- 3. the rollout's processing ------------------------------------------------------------------
@torch.no_grad()
def process_rollout(agent: PPOAgent, td: TensorDictBase, *, timings: dict[str, float] | None = None) -> TensorDictBase:
    """:meth:`PPOAgent.process_rollout <textrl.agents.base.PPOAgent.process_rollout>`."""
    agent.backend.stage_rollback(agent)  # the update's rollback copy, overlapping the forwards on CUDA
    if KEYS.task_reward not in td.keys(include_nested=True):
        td.set(KEYS.task_reward, td.get(KEYS.reward).clone())
    if SCORE not in td.keys():
        td.set(SCORE, td.get(KEYS.reward).squeeze(-1).sum(1).float())
    with timed(timings, "forward", agent.device):
        td.update(agent.evaluate(td, keep_graph=reuses_rollout_forward(agent)))
    with timed(timings, "advantages", agent.device):
        mask = td.get(KEYS.mask)
        if agent.critic is not None:
            state_values = torch.where(mask, td.get(KEYS.state_value).squeeze(-1), 0.0)  # [B, T]
            next_values = next_valid(state_values, mask)  # V(s_t+1): at the next agent token, 0 after the last
            td.set(KEYS.state_value, state_values.unsqueeze(-1))
            td.set(KEYS.next_state_value, next_values.unsqueeze(-1))
        agent.estimate(td)
        if agent.ref_policy is not None:  # without one the coefficient is a fixed 0
            kl = agent.reference_kl(td.get(KEYS.action_log_prob), td, kind="k1")
            seq_kl = agent.backend.dist.mean({"kl": masked_sum(kl, mask, dim=1).mean().item()})["kl"]
            agent.kl_ctl.update(seq_kl, td.shape[0] * agent.backend.dist.world_size)
    return td


__all__ = [
    "FORWARD", "SCORE", "RolloutForward", "act", "attended_response", "evaluate", "forward_policy", "forward_values",
    "logprobs", "micro_batches", "policy_ref_kl", "position_ids_for", "precise_response_logits", "process_rollout",
    "reuses_rollout_forward", "rollout_sampling", "sequence_inputs", "take_rollout_forward", "warp_logits", "with_forward",
]
