"""The actor: what makes a rollout.

An :class:`Actor` owns the weights it samples with and their version, the reference model, the
generation engine, the run's precision and the rollout-time forwards with their caches. It has
:meth:`~Actor.act` (sample responses), :meth:`~Actor.logprobs` (log-probs of given tokens under a
model) and :meth:`~Actor.evaluate` (the rollout's behaviour and reference log-probs and values).
The learner (:class:`textrl.agents.learner.Learner`) owns what an update changes; what crosses
from one to the other is the rollout TensorDict one way and the weights the other
(:meth:`Actor.load_weights_from`), each rollout stamped with the version of the weights that
generated it and the log-probs the engine drew with (docs/design.md, "Actor and learner").

The trainer builds the actor once, after the backend is set up
(:meth:`textrl.agents.base.PPOAgent.actor`): that is where the generation engine is chosen
(:func:`textrl.generation.engine_for`, ``auto`` resolved for the device and the backend) and
where the run's precision is taken from.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from torch import Tensor, nn

from textrl.agents.forwards import (
    Forwards,
    RolloutForward,
    micro_batches,
    sequence_inputs,
)
from textrl.agents.splits import prefill_batches, real_tokens
from textrl.agents.weight_check import (
    WEIGHT_CHECK_ROWS,
    mean_gap,
    weight_gap,
    weight_gap_bound,
    weight_gap_error,
)
from textrl.core.versions import VersionCounter
from textrl.functional import kl_penalty, masked_mean
from textrl.generation import GenerationEngine, Sampling
from textrl.keys import KEYS
from textrl.parallel.fsdp_sharding import local

Behaviour = Callable[[Tensor, Tensor, int, Tensor], Tensor]
"""``behaviour(input_ids [B, L], attention_mask [B, L], prompt_len, action [B, T]) -> [B, T]``: the
log-probs the ratio's denominator uses (an agent's old-policy snapshot)."""


@dataclass
class Sampled:
    """One rollout's sampling: ``generate(input_ids, attention_mask) -> (tokens [n, T], logp [n, T]
    or None)`` for each turn (the engine's log-probs of the tokens it drew, where it computes them),
    the ``version`` of the weights that generated them (:attr:`Actor.version`) and their
    ``iteration``, the learner's updates done when they were handed over (:attr:`Actor.updates`: the
    unit of ``rollout/staleness``); :func:`textrl.run.rollout.run_episodes` calls ``check_weights(td)``
    (:meth:`Actor.check_weights`) and ``take_weight_sync_seconds()`` (the engine's seconds taking the
    weights; None: an engine that samples the policy's weights in place)."""

    generate: Callable[[Tensor, Tensor], tuple[Tensor, Tensor | None]]
    version: int
    iteration: int = 0
    check_weights: Callable[[TensorDictBase], None] | None = None
    take_weight_sync_seconds: Callable[[], float | None] | None = None


@dataclass
class Actor:
    """What makes a rollout (see the module docstring).

    ``policy`` the model it samples with (the learner's own module when they share the weights),
    ``reference`` the frozen model of the KL penalty (None: nothing reads one), ``critic`` the value
    model its rollout-time forwards read (None without one), ``forwards`` the run's forwards under
    its precision, ``engine`` how :meth:`act` generates, ``backend`` the run's processes (a
    partitioned model's forwards are collectives), ``behaviour`` an agent's own behaviour log-probs
    (None: the policy's own).
    """

    config: Any
    policy: nn.Module
    reference: nn.Module | None
    critic: nn.Module | None
    forwards: Forwards
    engine: GenerationEngine
    backend: Any
    eos_token_id: int | None
    pad_token_id: int
    device: torch.device
    """Where it generates: the policy's device when it was built (the agent builds another for another)."""
    behaviour: Behaviour | None = None
    teacher: Any = None
    """On-policy distillation's teacher (:mod:`textrl.agents.teacher`: loaded or served), whose log-probs
    :meth:`evaluate` adds; None without ``--teacher``."""
    version: int = 0
    """The version of the weights it samples with: the learner's when they were last loaded
    (:meth:`load_weights_from`)."""
    updates: int = 0
    """The learner's updates done when the weights it samples with were loaded (named by the weight check)."""
    kept: RolloutForward | None = field(default=None, repr=False)
    """The last :meth:`evaluate`'s forward with its graph (``keep_graph``), for a one-step update."""
    own_logp: tuple[Tensor, int, int] | None = field(default=None, repr=False)
    """The last :meth:`evaluate`'s policy log-probs, their tensor version and the policy's version then."""

    def __post_init__(self) -> None:
        self._policy_version = VersionCounter(lambda: map(local, self.policy.parameters()))
        self._weights_version = VersionCounter(lambda: map(local, self._models_read()))

    def _models_read(self) -> list[Tensor]:
        """The weights a kept forward read: the policy's and the critic's."""
        critic = [] if self.critic is None else list(self.critic.parameters())
        return [*self.policy.parameters(), *critic]

    @property
    def precision(self) -> Any:
        """The run's precision (:class:`textrl.core.precision.Precision`) every forward of the actor runs under."""
        return self.forwards.precision

    # -- the weights ------------------------------------------------------------------------------
    def load_weights_from(self, learner: Any) -> None:
        """Sample with ``learner``'s weights from now on, and take their version: nothing to copy when
        the actor samples with the learner's own modules (one process, the same weights), a copy
        (``backend.copy_weights``) when it holds its own."""
        if self.policy is not learner.policy:
            self.backend.copy_weights(self.policy, learner.policy)
        self.version, self.updates = learner.version, learner.iteration

    # -- sampling -----------------------------------------------------------------------------------
    def sampling(self, *, greedy: bool = False) -> Sampling:
        """What :meth:`act` draws (:class:`textrl.generation.Sampling`): greedy, or the config's
        temperature, top-k and top-p (the warping :meth:`logprobs` applies), the length cap, the
        tokenizer's EOS / pad ids."""
        cfg = self.config
        return Sampling(greedy=greedy, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                        max_new_tokens=cfg.max_new_tokens, eos_token_id=self.eos_token_id,
                        pad_token_id=self.pad_token_id)

    @torch.no_grad()
    def act(self, input_ids: Tensor, attention_mask: Tensor, *, greedy: bool = False) -> Tensor:
        """Sample responses ``[B, T]`` (T <= max_new_tokens) for left-padded prompts ``[B, P]``, in
        micro-batches of ``generation_batch_size``; ``pad_token_id`` after a row's EOS."""
        return self._generate(input_ids, attention_mask, greedy, logprobs=False)[0]

    def start_engine(self) -> None:
        """The engine's start on every process together (:meth:`GenerationEngine.start`: ``vllm`` under
        several processes), under the precision and the weights its calls will see."""
        with self.precision.autocast(), self.backend.gathered(self.policy), torch.no_grad():
            self.engine.start(self.policy, torch.device(self.device))

    @torch.no_grad()
    def sample(self, input_ids: Tensor, attention_mask: Tensor, *, greedy: bool = False) -> tuple[Tensor, Tensor | None]:
        """:meth:`act`'s tokens ``[B, T]`` and the engine's log-probs of them ``[B, T]`` (float32, 0
        after a row's EOS; None when the engine computes none: ``generate_with_logprobs``)."""
        return self._generate(input_ids, attention_mask, greedy, logprobs=True)

    def _generate(self, input_ids: Tensor, attention_mask: Tensor, greedy: bool,
                  logprobs: bool) -> tuple[Tensor, Tensor | None]:
        """The engine's tokens in micro-batches, with its log-probs (``generate_with_logprobs``) when
        ``logprobs``, else none asked for (``generate``)."""
        sampling = self.sampling(greedy=greedy)
        extra = {"synced_gpus": True} if self.backend.partitions_weights else {}  # each forward is a collective
        tokens, logps = [], []
        for sl in micro_batches(input_ids.shape[0], self.config.generation_batch_size):
            ids = input_ids[sl].to(self.device)
            mask = attention_mask[sl].to(self.device)
            with self.precision.autocast(), self.backend.gathered(self.policy), torch.no_grad():
                try:
                    if logprobs:
                        out, logp = self.engine.generate_with_logprobs(self.policy, ids, mask.long(), sampling, **extra)
                    else:
                        out, logp = self.engine.generate(self.policy, ids, mask.long(), sampling, **extra), None
                except RuntimeError as err:
                    if "probability tensor contains" not in str(err):
                        raise
                    raise self.overflowed() from err
            tokens.append(out)
            logps.append(logp)
        width = max(o.shape[1] for o in tokens)
        out = torch.cat([nn.functional.pad(o, (0, width - o.shape[1]), value=self.pad_token_id) for o in tokens])
        if any(logp is None for logp in logps):
            return out, None
        return out, torch.cat([nn.functional.pad(lp.float(), (0, width - lp.shape[1])) for lp in logps])

    @contextmanager
    def rollout(self, *, greedy: bool = False) -> Iterator[Sampled]:
        """One rollout's turns (the engine's :meth:`~textrl.generation.GenerationEngine.rollout`: the
        ``textrl`` engine carries each turn's KV cache to the next), sampled by :meth:`sample`, with the
        version of the weights that generated them."""

        def generate(input_ids: Tensor, attention_mask: Tensor) -> tuple[Tensor, Tensor | None]:
            return self.sample(input_ids.to(self.device), attention_mask.to(self.device), greedy=greedy)

        with self.engine.rollout():
            took = self.engine.take_weight_sync_seconds if self.engine.receives_weights else None
            yield Sampled(generate, self.version, self.updates, self.check_weights, took)

    @torch.no_grad()
    def check_weights(self, td: TensorDictBase, tokens: Tensor | None = None) -> None:
        """The check that the engine sampled ``td`` with the weights this actor holds
        (:mod:`textrl.agents.weight_check`): :meth:`measure_weight_gap`, then :meth:`judge_weight_gap`
        (a collective under several processes). Nothing without the engine's log-probs or with
        ``max_weight_gap=0``."""
        self.measure_weight_gap(td, tokens)
        self.judge_weight_gap(td, self.updates)

    @torch.no_grad()
    def measure_weight_gap(self, td: TensorDictBase, tokens: Tensor | None = None) -> bool:
        """This process's part of the weight check, no collective (an asynchronous actor's thread
        runs it): the first :data:`~textrl.agents.weight_check.WEIGHT_CHECK_ROWS` rows prefilled with
        :attr:`policy` under the engine's own distribution (temperature, top-k, top-p), compared with
        ``KEYS.generation_log_prob`` over ``tokens`` (bool ``[B, T]``; default the agent's tokens); the
        per-row statistics written into ``td`` (``KEYS.weight_gap_*``). False where nothing was
        measured (no engine log-probs, ``max_weight_gap=0``, no row)."""
        engine_logp = td.get(KEYS.generation_log_prob, None)
        bound = weight_gap_bound(self.config, self.precision.compute_dtype)
        if engine_logp is None or math.isinf(bound) or td.shape[0] == 0:
            return False
        mask = td.get(KEYS.mask) if tokens is None else tokens
        rows = slice(0, min(td.shape[0], WEIGHT_CHECK_ROWS))
        input_ids, attention_mask, p = sequence_inputs(td[rows])
        prefill = self.forwards.filtered_logprobs(self.policy, input_ids, attention_mask, p, td.get(KEYS.action)[rows])
        gap_sum, n_tokens, outside = (torch.zeros(td.shape[0], dtype=dt, device=engine_logp.device)
                                      for dt in (torch.float64, torch.long, torch.long))
        gap_sum[rows], n_tokens[rows], outside[rows] = weight_gap(engine_logp[rows].float(), prefill.float(), mask[rows])
        td.set(KEYS.weight_gap_sum, gap_sum)
        td.set(KEYS.weight_gap_tokens, n_tokens)
        td.set(KEYS.weight_gap_outside, outside)
        return True

    def judge_weight_gap(self, td: TensorDictBase, updates: int) -> None:
        """The weight check's decision over every process (the mean gap of the statistics
        :meth:`measure_weight_gap` wrote into ``td``; a collective under several processes, the same
        on each): :class:`~textrl.agents.weight_check.WeightGapError` past the run's bound, naming
        ``updates``, the learner's updates behind the weights the engine should have held. Nothing
        without the engine's log-probs or with ``max_weight_gap=0`` (the same on every process); a
        process that measured no row (none in its share) joins with zeros."""
        bound = weight_gap_bound(self.config, self.precision.compute_dtype)
        if td.get(KEYS.generation_log_prob, None) is None or math.isinf(bound):
            return
        measured = [td.get(key, None) for key in (KEYS.weight_gap_sum, KEYS.weight_gap_tokens, KEYS.weight_gap_outside)]
        gap_sum, n_tokens, outside = (0.0, 0.0, 0.0) if measured[0] is None else (float(t.sum()) for t in measured)
        shared = self.backend.dist.mean({"sum": gap_sum, "tokens": n_tokens,
                                         "outside": outside})  # the same decision on every process
        error = weight_gap_error(engine=self.engine.name, updates=updates,
                                 gap=mean_gap(shared["sum"], shared["tokens"]),
                                 tokens=round(shared["tokens"] * self.backend.dist.world_size),
                                 outside=round(shared["outside"] * self.backend.dist.world_size), bound=bound,
                                 dtype=self.precision.compute_dtype)
        if error is not None:
            raise error

    def overflowed(self) -> ValueError:
        """Sampling met NaN/inf probabilities: the weights are finite (checked after every update)
        but so large that the forward overflows. A ``ValueError`` naming the largest weight and
        the learning rate, for a one-line stop (the checkpoints on disk are intact)."""
        largest = max((float(p.detach().abs().max()) for p in self.policy.parameters() if p.numel()), default=0.0)
        return ValueError(
            f"generation drew from NaN/inf probabilities: the policy's forward overflows (its largest weight "
            f"is {largest:.3g}, actor_lr={self.config.actor_lr:g}); lower --actor-lr (or set --max-grad-norm), "
            "then resume from a checkpoint taken before the weights grew (--resume takes the newest)")

    # -- forwards -----------------------------------------------------------------------------------
    def logprobs(self, model: nn.Module, input_ids: Tensor, attention_mask: Tensor, prompt_len: int,
                 action: Tensor) -> Tensor:
        """Log-probs ``[B, T]`` of ``action`` under ``model`` at the run's temperature (no filter)
        (:meth:`textrl.agents.forwards.Forwards.logprobs`)."""
        return self.forwards.logprobs(model, input_ids, attention_mask, prompt_len, action)

    @torch.no_grad()
    def evaluate(self, td: TensorDictBase, *, keep_graph: bool = False) -> TensorDict:
        """``action_log_prob``, ``ref_log_prob`` (with a reference), ``teacher_log_prob`` (with a teacher)
        and ``state_value`` (with a critic) of a rollout: one prefill forward per micro-batch (:meth:`prefill_batches`: ``forward_batch_size``
        rows, or runs of rows up to ``microbatch_tokens`` real tokens). With
        ``keep_graph`` the policy and critic forwards run with grad and are kept (:attr:`kept`) for
        the update's one optimiser step to reuse."""
        input_ids, attention_mask, p = sequence_inputs(td)
        action = td.get(KEYS.action)
        out = defaultdict(list)
        for sl in self.prefill_batches(td):
            args = (input_ids[sl], attention_mask[sl], p)
            if keep_graph:
                self._graph_forward(out, args, action[sl])
            else:
                out["logp"].append(self.behaviour_logprobs(*args, action[sl]))
                if self.critic is not None:
                    out["value"].append(self.forwards.values(self.critic, *args))
            if self.reference is not None:
                out["ref"].append(self.logprobs(self.reference, *args, action[sl]))
            if self.teacher is not None:
                out["teacher"].append(self.teacher.logprobs(*args, action[sl]))
        logp = torch.cat(out["logp"])
        result = TensorDict({KEYS.action_log_prob: logp}, batch_size=td.batch_size)
        if self.reference is not None:
            result.set(KEYS.ref_log_prob, torch.cat(out["ref"]))
        if self.teacher is not None:
            result.set(KEYS.teacher_log_prob, torch.cat(out["teacher"]).to(logp.dtype))
        if self.critic is not None:
            result.set(KEYS.state_value, torch.cat(out["value"]).unsqueeze(-1))
        if self.behaviour is None:  # the policy's own log-probs
            self.own_logp = (logp, logp._version, self._policy_version.now())
        self.kept = None
        if keep_graph:
            with torch.enable_grad():  # a concatenation under no_grad would cut the graph
                self.kept = RolloutForward(
                    logp=torch.cat(out["graph_logp"]), entropy=torch.cat(out["graph_entropy"]),
                    values=torch.cat(out["graph_value"]) if self.critic is not None else None,
                    stored=logp, version=self._weights_version.now(),
                )
        return result

    def prefill_batches(self, td: TensorDictBase) -> list[slice]:
        """The rows of each prefill forward of rollout ``td``, in order, each once
        (:func:`textrl.agents.splits.prefill_batches`: ``forward_batch_size`` rows, or runs up to
        ``microbatch_tokens`` real tokens, as many on every process)."""
        return prefill_batches(real_tokens(td), self.config, getattr(self.backend, "dist", None))

    def _graph_forward(self, out: dict[str, list[Tensor]], args: tuple[Tensor, Tensor, int], action: Tensor) -> None:
        """One micro-batch's policy (and critic) forward with grad, kept and detached into ``out``."""
        with torch.enable_grad():
            logp, entropy = self.forwards.logprobs_and_entropy(self.policy, *args, action)
            out["graph_logp"].append(logp)
            out["graph_entropy"].append(entropy)
            out["logp"].append(logp.detach())
            if self.critic is not None:
                out["graph_value"].append(self.forwards.values(self.critic, *args))
                out["value"].append(out["graph_value"][-1].detach())

    def behaviour_logprobs(self, input_ids: Tensor, attention_mask: Tensor, prompt_len: int, action: Tensor) -> Tensor:
        """The log-probs the ratio's denominator uses: :attr:`behaviour`'s, else the policy's own."""
        if self.behaviour is not None:
            return self.behaviour(input_ids, attention_mask, prompt_len, action)
        return self.logprobs(self.policy, input_ids, attention_mask, prompt_len, action)

    def take_kept_forward(self, td: TensorDictBase) -> RolloutForward | None:
        """The kept forward of :meth:`evaluate` if it belongs to ``td`` and no weight changed since
        (it is handed over once: a second call returns None)."""
        kept, self.kept = self.kept, None
        if kept is None or td.get(KEYS.action_log_prob, None) is not kept.stored:
            return None
        return kept if kept.version == self._weights_version.now() else None

    @torch.no_grad()
    def policy_ref_kl(self, td: TensorDictBase) -> float:
        """Mean per-token KL(policy || ref) (``config.kl_kind``) of the rollout's actions, now.

        When the rollout's ``action_log_prob`` are the policy's own (computed by :meth:`evaluate`,
        neither they nor a policy weight changed since), they are reused instead of recomputed:
        the forward would give the same numbers. This makes ``kl/before_update`` free.
        """
        input_ids, attention_mask, p = sequence_inputs(td)
        action, mask = td.get(KEYS.action), td.get(KEYS.mask)
        cached, cached_version, version = self.own_logp or (None, None, None)
        logp = td.get(KEYS.action_log_prob, None)
        if not (logp is not None and logp is cached and logp._version == cached_version
                and version == self._policy_version.now()):
            logp = torch.cat([
                self.logprobs(self.policy, input_ids[sl], attention_mask[sl], p, action[sl])
                for sl in self.prefill_batches(td)
            ])
        kl = kl_penalty(logp, td.get(KEYS.ref_log_prob), kind=self.config.kl_kind)
        return masked_mean(kl, mask).item()


__all__ = ["Actor", "Behaviour", "Sampled"]
