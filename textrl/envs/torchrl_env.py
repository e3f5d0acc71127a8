"""``TextGenEnv``: the token MDP as a batched TorchRL environment (``batch_size=[B]``).

Each of the ``B`` rows is one episode of :class:`textrl.envs.TokenMDPEnv`'s MDP, with the same
rules (:class:`textrl.envs.episodes.EpisodeDynamics`): the action is the next token id
(``Categorical(vocab_size)``). Without an environment a row terminates on EOS and is truncated
after ``max_new_tokens`` actions, and its task reward (scored by the same
:func:`textrl.envs.score_completions` as the fast path) is paid on its final step. With an
environment (``env=``, docs/design.md "Multi-turn episodes") a row's turn ends at EOS, a stop string
or the caps; the environment's answer pays the turn's reward on that step, and its observation
tokens are appended to the row within the same step call (they are not actions); the final reward
is added on the row's last step.

Observation keys (all with leading batch dim ``B``):

* ``"prompt_ids"`` int64 ``[B, P]`` left-padded with ``pad_token_id``, ``"prompt_mask"`` bool
  ``[B, P]`` (``P = max_prompt_length``);
* ``"response_ids"`` int64 ``[B, T]``, every token after the prompt (the agent's and the
  observations') right-padded with ``pad_token_id`` (``T = max_episode_tokens``, by default
  ``max_new_tokens`` for a single turn), ``"response_length"`` int64 ``[B, 1]``;
* ``"agent_mask"`` bool ``[B, T]``: True on the agent's tokens;
* ``("episode", "id")`` int64 ``[B]`` (a number unique to the episode, new at every reset),
  ``("episode", "turns")`` int64 ``[B]`` (agent turns ended so far), ``("episode", "end")`` int64
  ``[B]`` (why the episode ended, an index into :data:`textrl.keys.END_REASONS`; -1 while it runs);
* ``("reward_components", name)`` float ``[B]``: each reward's raw score on the step a row
  finishes, 0 otherwise (a multi-turn environment adds ``"turn_rewards"``, the sum of its turn
  rewards).

``reward`` is float ``[B, 1]`` and ``done`` / ``terminated`` / ``truncated`` bool ``[B, 1]``.

Finished rows: a row that is done ignores further actions (its state does not change), pays
reward 0 and stays done until it is reset. ``env.rollout(..., break_when_any_done=False)``
resets finished rows (partial reset through ``"_reset"``) with new prompts, and
``break_when_all_done=True`` runs until every row is done (TorchRL then repeats a finished
row's last transition in the stacked output). :func:`textrl.envs.torchrl_rollout.to_rollout` turns
such data, or a TorchRL collector's, into textrl's rollout TensorDict. The step rewards follow
``reward_placement="last"``; ``to_rollout`` can spread them (``"uniform"``).

The prompt of each reset row is drawn with a private ``torch.Generator`` seeded by
``env.set_seed(seed)``; pass ``"prompt_index"`` int64 ``[B]`` in the reset TensorDict to pick
prompts instead.

A policy reads the observation and writes ``"action"`` ``[B]``. A policy that recomputes the
model on ``prompt + response`` every step costs O(T^2) per episode; :class:`textrl.envs.KVCachePolicy`
(``textrl/envs/policies.py``) keeps the KV cache on the module and feeds one token per row per step,
re-encoding ``prompt + response`` only when the observation does not continue its cache (after a
partial reset, or an environment's observation). The env never re-tokenises the agent's tokens.

Importing this module imports TorchRL, whose first import sets the process's multiprocessing start
method to ``"spawn"`` when none is set; this module puts it back (unset), so Gymnasium's
``AsyncVectorEnv`` and other ``multiprocessing`` users keep the platform default. TorchRL's own
workers ask for their start method explicitly.
"""

from __future__ import annotations

import contextlib
import multiprocessing
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from textrl.envs.environment import Environment
from textrl.envs.episodes import DONE, EpisodeDynamics, EpisodeState, default_episode_tokens
from textrl.envs.fast_path import DEFAULT_REWARD, RewardLike
from textrl.envs.prompts.table import TokenMDPSetup
from textrl.envs.registry import environment_and_rows
from textrl.keys import END_REASONS


@contextlib.contextmanager
def _start_method_kept() -> Iterator[None]:
    """Leave ``multiprocessing``'s global start method as it was (TorchRL's first import sets
    ``"spawn"`` when it is unset, which breaks scripts without a ``__main__`` guard)."""
    before = multiprocessing.get_start_method(allow_none=True)
    try:
        yield
    finally:
        if before is None and multiprocessing.get_start_method(allow_none=True) is not None:
            multiprocessing.set_start_method(None, force=True)


with _start_method_kept():
    from torchrl.data import Bounded, Categorical, Composite, Unbounded
    from torchrl.envs import EnvBase

EPISODE_ID, EPISODE_TURNS, EPISODE_END = ("episode", "id"), ("episode", "turns"), ("episode", "end")


class TextGenEnv(TokenMDPSetup, EnvBase):
    """``B`` token-MDP episodes stepped together; see the module docstring.

    Args:
        batch_size: number of rows ``B`` (an int or ``[B]``).
        tokenizer, prompts, reward, max_new_tokens, max_prompt_length, truncate_prompt,
        apply_chat_template, eos_token_id, pad_token_id, env, max_episode_tokens: as for
        :class:`textrl.envs.TokenMDPEnv`.
        device: where the TensorDicts live.
        seed: seed of the prompt sampler (default: fresh entropy); ``set_seed`` reseeds it.
    """

    def __init__(
        self,
        batch_size: int | Sequence[int] = 1,
        *,
        tokenizer: Any = None,
        prompts: Any = None,
        reward: RewardLike | None = None,
        max_new_tokens: int = 32,
        max_prompt_length: int = 64,
        truncate_prompt: str = "error",
        apply_chat_template: bool | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int | None = None,
        device: torch.device | str = "cpu",
        seed: int | None = None,
        env: Environment | str | None = None,
        max_episode_tokens: int | None = None,
    ) -> None:
        dims = [batch_size] if isinstance(batch_size, int) else list(batch_size)
        if len(dims) != 1:
            raise ValueError(f"batch_size={batch_size!r}: TextGenEnv takes one batch dim [B]")
        b = int(dims[0])
        if b < 1:
            raise ValueError(f"batch_size={batch_size!r}: must be >= 1")
        super().__init__(device=device, batch_size=torch.Size([b]))
        task, rows = environment_and_rows(env, prompts, reward)
        self._setup_mdp(
            tokenizer=tokenizer,
            prompts=rows,
            reward=DEFAULT_REWARD if task.reward is None else task.reward,
            max_new_tokens=max_new_tokens,
            max_prompt_length=max_prompt_length,
            truncate_prompt=truncate_prompt,
            apply_chat_template=apply_chat_template,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
        )
        if task.reward is None:
            self.reward_fn = None
        self.task = task
        self.max_episode_tokens = (default_episode_tokens(task, max_new_tokens) if max_episode_tokens is None
                                   else max_episode_tokens)
        self.dynamics = EpisodeDynamics(task, tokenizer=self.tokenizer, eos_token_ids=self.eos_token_ids,
                                        max_new_tokens=max_new_tokens, max_episode_tokens=self.max_episode_tokens)
        self.component_names = self.dynamics.component_names(self.reward_fn)
        self._make_specs(b)
        self._rng = torch.Generator()
        self._rng.manual_seed(
            int(np.random.SeedSequence().entropy % 2**63) if seed is None else seed
        )
        self._init_state(b)

    def _make_specs(self, b: int) -> None:
        dev, v = self.device, self.vocab_size
        p, t = self.max_prompt_length, self.max_episode_tokens
        ids = {"low": 0, "high": v - 1, "dtype": torch.int64, "device": dev}
        count = {"dtype": torch.int64, "device": dev}
        self.observation_spec = Composite(
            prompt_ids=Bounded(shape=(b, p), **ids),
            prompt_mask=Categorical(2, shape=(b, p), dtype=torch.bool, device=dev),
            response_ids=Bounded(shape=(b, t), **ids),
            response_length=Bounded(0, t, shape=(b, 1), **count),
            agent_mask=Categorical(2, shape=(b, t), dtype=torch.bool, device=dev),
            episode=Composite(
                id=Unbounded(shape=(b,), **count),
                turns=Bounded(0, self.task.max_turns, shape=(b,), **count),
                end=Bounded(-1, len(END_REASONS) - 1, shape=(b,), **count),
                shape=(b,),
                device=dev,
            ),
            reward_components=Composite(
                {
                    name: Unbounded(shape=(b,), dtype=torch.float32, device=dev)
                    for name in self.component_names
                },
                shape=(b,),
                device=dev,
            ),
            shape=(b,),
            device=dev,
        )
        self.action_spec = Categorical(v, shape=(b,), dtype=torch.int64, device=dev)
        self.reward_spec = Unbounded(shape=(b, 1), dtype=torch.float32, device=dev)
        flag = Categorical(2, shape=(b, 1), dtype=torch.bool, device=dev)
        self.done_spec = Composite(
            done=flag.clone(),
            terminated=flag.clone(),
            truncated=flag.clone(),
            shape=(b,),
            device=dev,
        )

    def _init_state(self, b: int) -> None:
        dev, t = self.device, self.max_episode_tokens
        self._prompt_ids = torch.full(
            (b, self.max_prompt_length), self.pad_token_id, dtype=torch.int64, device=dev
        )
        self._prompt_mask = torch.zeros((b, self.max_prompt_length), dtype=torch.bool, device=dev)
        self._response = torch.full((b, t), self.pad_token_id, dtype=torch.int64, device=dev)
        self._agent = torch.zeros((b, t), dtype=torch.bool, device=dev)
        self._length = torch.zeros(b, dtype=torch.int64, device=dev)
        self._done = torch.ones(b, dtype=torch.bool, device=dev)  # no episode until reset
        self._terminated = torch.zeros(b, dtype=torch.bool, device=dev)
        self._truncated = torch.zeros(b, dtype=torch.bool, device=dev)
        self._episode_id = torch.zeros(b, dtype=torch.int64, device=dev)
        self._turns = torch.zeros(b, dtype=torch.int64, device=dev)
        self._end = torch.full((b,), -1, dtype=torch.int64, device=dev)
        self._next_episode = 0
        self._states: list[EpisodeState | None] = [None] * b
        self._prompt_index = [0] * b

    def _set_seed(self, seed: int | None) -> None:
        self._rng.manual_seed(
            int(np.random.SeedSequence().entropy % 2**63) if seed is None else seed
        )

    def _observation(self, components: dict[str, torch.Tensor] | None = None) -> TensorDict:
        b = self.batch_size[0]
        comps = components or {
            name: torch.zeros(b, dtype=torch.float32, device=self.device)
            for name in self.component_names
        }
        return TensorDict(
            {
                "prompt_ids": self._prompt_ids.clone(),
                "prompt_mask": self._prompt_mask.clone(),
                "response_ids": self._response.clone(),
                "response_length": self._length.unsqueeze(-1).clone(),
                "agent_mask": self._agent.clone(),
                EPISODE_ID: self._episode_id.clone(),
                EPISODE_TURNS: self._turns.clone(),
                EPISODE_END: self._end.clone(),
                "reward_components": TensorDict(comps, batch_size=[b], device=self.device),
                "done": self._done.unsqueeze(-1).clone(),
                "terminated": self._terminated.unsqueeze(-1).clone(),
                "truncated": self._truncated.unsqueeze(-1).clone(),
            },
            batch_size=self.batch_size,
            device=self.device,
        )

    def _reset(self, tensordict: TensorDictBase | None = None, **kwargs: Any) -> TensorDictBase:
        b = self.batch_size[0]
        rows = torch.ones(b, dtype=torch.bool)
        chosen = None
        if tensordict is not None:
            reset = tensordict.get("_reset", None)
            if reset is not None:
                rows = reset.reshape(b).to("cpu", torch.bool)
            chosen = tensordict.get("prompt_index", None)
        idx = torch.nonzero(rows).flatten().tolist()
        if chosen is not None:
            picks = chosen.reshape(b).cpu()[idx].tolist()
        else:
            picks = torch.randint(len(self.prompts), (len(idx),), generator=self._rng).tolist()
        starts = {}
        for row, k in zip(idx, picks):  # every start before any change: a raising env.start changes nothing
            ids = torch.from_numpy(self.prompts.ids(int(k)))
            starts[row] = (ids, self.dynamics.start(self.prompts.row(int(k)), int(k), int(k)))
        p = self.max_prompt_length
        for row, k in zip(idx, picks):
            ids, state = starts[row]
            self._prompt_ids[row] = self.pad_token_id
            self._prompt_ids[row, p - ids.numel() :] = ids.to(self.device)
            self._prompt_mask[row] = False
            self._prompt_mask[row, p - ids.numel() :] = True
            self._prompt_index[row] = int(k)
            self._states[row] = state
            self._episode_id[row] = self._next_episode
            self._next_episode += 1
        sel = rows.to(self.device)
        self._response[sel] = self.pad_token_id
        self._agent[sel] = False
        self._length[sel] = 0
        self._done[sel] = False
        self._terminated[sel] = False
        self._truncated[sel] = False
        self._turns[sel] = 0
        self._end[sel] = -1
        return self._observation()

    def _step(self, tensordict: TensorDictBase) -> TensorDictBase:
        b = self.batch_size[0]
        action = tensordict.get("action").reshape(b).to(self.device)
        active = ~self._done
        partial = tensordict.get("_step", None)
        if partial is not None:
            active = active & partial.reshape(b).to(self.device, torch.bool)
        if active.any():
            bad = active & ((action < 0) | (action >= self.vocab_size))
            if bad.any():
                rows = torch.nonzero(bad).flatten().tolist()
                raise ValueError(
                    f"action {action[bad].tolist()[:10]} in rows {rows[:10]} is outside the "
                    f"vocabulary: token ids are in [0, {self.vocab_size}) (vocab_size={self.vocab_size})"
                )
        paid = [0.0] * b
        rows, cols, tokens, agent = [], [], [], []  # every token appended at this step, all rows
        finished, ends = [], []
        actions = action.tolist()
        stepped = torch.nonzero(active).flatten().tolist()
        for row in stepped:
            s = self._states[row]
            assert s is not None  # an active row was reset
            before = len(s.tokens)
            turn_reward = self.dynamics.act(s, actions[row])
            if turn_reward is not None:
                paid[row] = turn_reward
            rows += [row] * (len(s.tokens) - before)
            cols += range(before, len(s.tokens))
            tokens += s.tokens[before:]
            agent += s.agent[before:]
            if s.end is not None:
                finished.append(row)
                ends.append(s.end)
        self._write(rows, cols, tokens, agent, finished, ends)
        self._turns[stepped] = torch.tensor([self._states[r].episode.turn for r in stepped],  # type: ignore[union-attr]
                                            dtype=torch.int64, device=self.device)
        reward = torch.tensor(paid, dtype=torch.float32, device=self.device).unsqueeze(1)
        components = None
        if finished:
            components = self._score(finished, reward)
        out = self._observation(components)
        out.set("reward", reward)
        return out

    def _write(self, rows: list[int], cols: list[int], tokens: list[int], agent: list[bool], finished: list[int],
               ends: list[int]) -> None:
        """Write a step's appended tokens (``tokens[i]`` at ``[rows[i], cols[i]]``) and the rows that
        finished (with their end reasons) into the state tensors."""
        dev = self.device
        if rows:
            index = (torch.tensor(rows, device=dev), torch.tensor(cols, device=dev))
            self._response[index] = torch.tensor(tokens, dtype=torch.int64, device=dev)
            self._agent[index] = torch.tensor(agent, dtype=torch.bool, device=dev)
            self._length.index_add_(0, index[0], torch.ones_like(index[0]))
        if finished:
            done, end = torch.tensor(finished, device=dev), torch.tensor(ends, device=dev)
            self._end[done] = end
            self._terminated[done] = end == DONE
            self._truncated[done] = end != DONE
            self._done[done] = True

    def _score(self, finished: list[int], reward: torch.Tensor) -> dict[str, torch.Tensor]:
        """Score the rows that finished at this step (adding the final reward to ``reward``
        ``[B, 1]`` in place) and return the components of every row (0 for the others)."""
        b = self.batch_size[0]
        states = [self._states[r] for r in finished]
        total, scores, _, _ = self.dynamics.final_scores(states, self.reward_fn)  # type: ignore[arg-type]
        index = torch.tensor(finished, device=self.device)
        reward[index, 0] = reward[index, 0] + total.to(self.device)
        components = {}
        for name in self.component_names:
            full = torch.zeros(b, dtype=torch.float32, device=self.device)
            if name in scores:
                full[index] = scores[name].to(self.device)
            components[name] = full
        return components


__all__ = ["EPISODE_END", "EPISODE_ID", "EPISODE_TURNS", "TextGenEnv"]
