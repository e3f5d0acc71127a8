"""``TextGenEnv``: the token MDP as a batched TorchRL environment (``batch_size=[B]``).

Each of the ``B`` rows is one episode of :class:`textrl.envs.TokenMDPEnv`'s MDP: the action is the
next token id (``Categorical(vocab_size)``), a row terminates on EOS and is truncated after
``max_new_tokens`` actions, and its task reward (scored by the same
:func:`textrl.envs.score_completions` as the fast path) is paid on its final step; every other step
pays 0.

Observation keys (all with leading batch dim ``B``):

* ``"prompt_ids"`` int64 ``[B, P]`` left-padded with ``pad_token_id``, ``"prompt_mask"`` bool
  ``[B, P]`` (``P = max_prompt_length``);
* ``"response_ids"`` int64 ``[B, T]``, the actions so far right-padded with ``pad_token_id``
  (``T = max_new_tokens``), ``"response_length"`` int64 ``[B, 1]``;
* ``("reward_components", name)`` float ``[B]``: each reward's raw score on the step a row
  finishes, 0 otherwise.

``reward`` is float ``[B, 1]`` and ``done`` / ``terminated`` / ``truncated`` bool ``[B, 1]``.

Finished rows: a row that is done ignores further actions (its state does not change), pays
reward 0 and stays done until it is reset. ``env.rollout(..., break_when_any_done=False)``
resets finished rows (partial reset through ``"_reset"``) with new prompts, and
``break_when_all_done=True`` runs until every row is done (TorchRL then repeats a finished
row's last transition in the stacked output, so read each row up to its first ``done``).
Only ``reward_placement="last"`` exists here: spreading a score needs the whole response, see
:func:`textrl.envs.rollout_from_responses`.

The prompt of each reset row is drawn with a private ``torch.Generator`` seeded by
``env.set_seed(seed)``; pass ``"prompt_index"`` int64 ``[B]`` in the reset TensorDict to pick
prompts instead.

A policy reads the observation and writes ``"action"`` ``[B]``. A policy that recomputes the
model on ``prompt + response`` every step costs O(T^2) per episode; :class:`textrl.envs.KVCachePolicy`
(``envs/policies.py``) keeps the KV cache on the module and feeds one token per row per step,
re-encoding ``prompt + response`` only when the observation does not continue its cache (e.g.
after a partial reset). The env never re-tokenises text: it only appends ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase
from textrl.envs.fast_path import (
    DEFAULT_REWARD,
    RewardLike,
    reward_component_names,
    score_completions,
)
from textrl.envs.prompt_table import TokenMDPSetup
from torchrl.data import Bounded, Categorical, Composite, Unbounded
from torchrl.envs import EnvBase


class TextGenEnv(TokenMDPSetup, EnvBase):
    """``B`` token-MDP episodes stepped together; see the module docstring.

    Args:
        batch_size: number of rows ``B`` (an int or ``[B]``).
        tokenizer, prompts, reward, max_new_tokens, max_prompt_length, truncate_prompt,
        apply_chat_template, eos_token_id, pad_token_id: as for :class:`textrl.envs.TokenMDPEnv`.
        device: where the TensorDicts live.
        seed: seed of the prompt sampler (default: fresh entropy); ``set_seed`` reseeds it.
    """

    def __init__(
        self,
        batch_size: int | Sequence[int] = 1,
        *,
        tokenizer: Any = None,
        prompts: Any = None,
        reward: RewardLike = DEFAULT_REWARD,
        max_new_tokens: int = 32,
        max_prompt_length: int = 64,
        truncate_prompt: str = "error",
        apply_chat_template: bool | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int | None = None,
        device: torch.device | str = "cpu",
        seed: int | None = None,
    ) -> None:
        dims = [batch_size] if isinstance(batch_size, int) else list(batch_size)
        if len(dims) != 1:
            raise ValueError(f"batch_size={batch_size!r}: TextGenEnv takes one batch dim [B]")
        b = int(dims[0])
        if b < 1:
            raise ValueError(f"batch_size={batch_size!r}: must be >= 1")
        super().__init__(device=device, batch_size=torch.Size([b]))
        self._setup_mdp(
            tokenizer=tokenizer,
            prompts=prompts,
            reward=reward,
            max_new_tokens=max_new_tokens,
            max_prompt_length=max_prompt_length,
            truncate_prompt=truncate_prompt,
            apply_chat_template=apply_chat_template,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
        )
        self.component_names = reward_component_names(self.reward_fn)
        self._make_specs(b)
        self._rng = torch.Generator()
        self._rng.manual_seed(
            int(np.random.SeedSequence().entropy % 2**63) if seed is None else seed
        )
        self._init_state(b)

    def _make_specs(self, b: int) -> None:
        dev, v = self.device, self.vocab_size
        p, t = self.max_prompt_length, self.max_new_tokens
        ids = {"low": 0, "high": v - 1, "dtype": torch.int64, "device": dev}
        self.observation_spec = Composite(
            prompt_ids=Bounded(shape=(b, p), **ids),
            prompt_mask=Categorical(2, shape=(b, p), dtype=torch.bool, device=dev),
            response_ids=Bounded(shape=(b, t), **ids),
            response_length=Bounded(0, t, shape=(b, 1), dtype=torch.int64, device=dev),
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
        dev = self.device
        self._prompt_ids = torch.full(
            (b, self.max_prompt_length), self.pad_token_id, dtype=torch.int64, device=dev
        )
        self._prompt_mask = torch.zeros((b, self.max_prompt_length), dtype=torch.bool, device=dev)
        self._response = torch.full(
            (b, self.max_new_tokens), self.pad_token_id, dtype=torch.int64, device=dev
        )
        self._length = torch.zeros(b, dtype=torch.int64, device=dev)
        self._done = torch.ones(b, dtype=torch.bool, device=dev)  # no episode until reset
        self._terminated = torch.zeros(b, dtype=torch.bool, device=dev)
        self._truncated = torch.zeros(b, dtype=torch.bool, device=dev)
        self._prompt_index = [0] * b
        self._eos = torch.tensor(self.eos_token_ids, dtype=torch.int64, device=dev)

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
        p = self.max_prompt_length
        for row, k in zip(idx, picks):
            ids = torch.from_numpy(self.prompts.ids(int(k)))
            self._prompt_ids[row] = self.pad_token_id
            self._prompt_ids[row, p - ids.numel() :] = ids.to(self.device)
            self._prompt_mask[row] = False
            self._prompt_mask[row, p - ids.numel() :] = True
            self._prompt_index[row] = int(k)
        sel = rows.to(self.device)
        self._response[sel] = self.pad_token_id
        self._length[sel] = 0
        self._done[sel] = False
        self._terminated[sel] = False
        self._truncated[sel] = False
        return self._observation()

    def _step(self, tensordict: TensorDictBase) -> TensorDictBase:
        b, t = self.batch_size[0], self.max_new_tokens
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
        pos = self._length.clamp(max=t - 1).unsqueeze(1)  # [B, 1]
        current = self._response.gather(1, pos).squeeze(1)
        self._response.scatter_(1, pos, torch.where(active, action, current).unsqueeze(1))
        self._length = self._length + active.long()
        terminated = active & torch.isin(action, self._eos)
        truncated = active & ~terminated & (self._length == t)
        finished = terminated | truncated
        self._terminated |= terminated
        self._truncated |= truncated
        self._done |= finished

        reward = torch.zeros(b, 1, dtype=torch.float32, device=self.device)
        components = None
        if finished.any():
            reward, components = self._score(finished)
        out = self._observation(components)
        out.set("reward", reward)
        return out

    def _score(self, finished: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Score the rows that finished at this step, with the fast path's scoring function."""
        b = self.batch_size[0]
        rows = torch.nonzero(finished).flatten().tolist()
        fields_per_row = [self.prompts.fields(self._prompt_index[r]) for r in rows]
        names = sorted({k for f in fields_per_row for k in f})
        lengths = self._length[rows]
        mask = torch.arange(self.max_new_tokens, device=self.device).unsqueeze(
            0
        ) < lengths.unsqueeze(1)
        scores = score_completions(
            self.reward_fn,
            [self.prompts.text(self._prompt_index[r]) for r in rows],
            self._response[rows],
            mask,
            tokenizer=self.tokenizer,
            truncated=self._truncated[rows],
            fields={k: [f.get(k) for f in fields_per_row] for k in names},
        )
        index = torch.tensor(rows, device=self.device)
        reward = torch.zeros(b, 1, dtype=torch.float32, device=self.device)
        reward[index, 0] = scores.total.to(self.device)
        components = {}
        for name in self.component_names:
            full = torch.zeros(b, dtype=torch.float32, device=self.device)
            if name in scores.components:
                full[index] = scores.components[name].to(self.device)
            components[name] = full
        return reward, components


__all__ = ["TextGenEnv"]
