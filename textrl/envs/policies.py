"""Policies for :class:`textrl.envs.TextGenEnv`.

:class:`KVCachePolicy` keeps a Hugging Face causal LM's KV cache (a ``DynamicCache``) on the
module across the steps of one ``env.rollout(...)``, so each step is one single-token forward
instead of re-encoding ``prompt + response``.
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase

from textrl.models.kv_cache import cache_argument, new_cache

OBS_KEYS = ["prompt_ids", "prompt_mask", "response_ids", "response_length"]


class KVCachePolicy(TensorDictModuleBase):
    """Next-token policy for :class:`textrl.envs.TextGenEnv` that keeps the LM's KV cache between steps.

    Reads ``"prompt_ids"``, ``"prompt_mask"`` (left-padded), ``"response_ids"`` and
    ``"response_length"`` (every response token is attended, the agent's and the observations')
    and writes ``"action"`` ``[B]`` (and ``"action_log_prob"`` ``[B]``,
    the log-probability of the action under the sampling distribution, if
    ``return_log_prob``). Use it directly as ``env.rollout(n, policy)``.

    How a step is computed:

    * **prefill**: when every row has ``response_length == 0`` (a full reset, e.g. the start
      of a rollout) the left-padded prompts are encoded with ``attention_mask=prompt_mask`` and
      ``position_ids = cumsum(mask) - 1`` (clamped at 0), and the cache is kept.
    * **incremental step**: when the observation continues the cached state (same batch size,
      prompts and response prefix, and every row's ``response_length`` equals the policy's own
      count or that count + 1), only one token per row is fed (``input_ids`` ``[B, 1]``): the
      last action ``response_ids[b, response_length[b] - 1]`` for rows that advanced, with
      the attention mask grown by one; rows that did not advance (finished rows, which the env
      freezes) get a masked pad token and reuse their previous next-token logits. If no row
      advanced, no forward is run at all.
    * **fallback**: anything else (a partial reset mid-rollout, i.e. ``response_length == 0``
      for some rows but not all; rows that jumped by more than one token, as after a multi-turn
      environment's observation, appended in the step that ended the agent's turn; a changed
      prompt, response prefix or batch size) re-encodes ``prompt + response`` for every row in one
      forward (masking each row's unused response slots) and rebuilds the cache from it;
      later steps are incremental again. Correctness first: the fallback gives the same
      next-token logits as recomputing the whole prefix.

    Sampling: greedy when ``temperature`` is ``None`` or ``0``, else a draw from
    ``softmax(logits / temperature)`` with a private ``torch.Generator`` (``seed`` /
    :meth:`set_seed`); the global RNG is not touched.

    The cache lives on the module, outside the TensorDict; :meth:`reset_cache` drops it
    (a new rollout's full reset also starts over). Counters ``n_prefill``, ``n_incremental``
    and ``n_fallback`` record which path each call took. The forward runs under
    ``torch.no_grad()``: this is a rollout (acting) policy, not a training forward.

    Args:
        model: a Hugging Face causal LM (``model(input_ids, attention_mask, position_ids,
            cache, use_cache=True)`` returning ``.logits`` and filling the ``DynamicCache`` it is
            given; ``past_key_values`` on transformers releases before ``cache``), on the env's device.
        temperature: ``None``/``0`` for greedy, else the sampling temperature.
        seed: seed of the private generator (default: fresh entropy).
        pad_token_id: token fed to rows that did not advance (masked out; default: the
            model config's ``pad_token_id``, else 0).
        return_log_prob: also write ``"action_log_prob"``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        temperature: float | None = None,
        seed: int | None = None,
        pad_token_id: int | None = None,
        return_log_prob: bool = False,
    ) -> None:
        super().__init__()
        if temperature is not None and temperature < 0:
            raise ValueError(f"temperature={temperature!r}: must be >= 0 or None (greedy)")
        self.model = model
        self.temperature = temperature
        if pad_token_id is None:
            pad_token_id = getattr(getattr(model, "config", None), "pad_token_id", None)
        self.pad_token_id = 0 if pad_token_id is None else int(pad_token_id)
        self.return_log_prob = return_log_prob
        self.in_keys = list(OBS_KEYS)
        self.out_keys = ["action"] + (["action_log_prob"] if return_log_prob else [])
        self._seed = seed
        self._generator: torch.Generator | None = None
        self.n_prefill = self.n_incremental = self.n_fallback = 0
        self.reset_cache()

    # ------------------------------------------------------------------ state
    def reset_cache(self) -> None:
        """Drop the KV cache and the tracked state; the next call prefills from scratch."""
        self._cache: Any = None
        self._attn: torch.Tensor | None = None  # bool [B, cache_len]: valid cached positions
        self._prompt_ids: torch.Tensor | None = None
        self._prompt_mask: torch.Tensor | None = None
        self._response: torch.Tensor | None = None  # int64 [B, T]: tokens encoded so far
        self._length: torch.Tensor | None = None  # int64 [B]: response tokens encoded per row
        self._logits: torch.Tensor | None = None  # float [B, V]: next-token logits per row

    def set_seed(self, seed: int | None) -> None:
        """Reseed the private sampling generator (``None``: fresh entropy)."""
        self._seed = seed
        self._generator = None

    def _rng(self, device: torch.device) -> torch.Generator:
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device)
            if self._seed is None:
                self._generator.seed()
            else:
                self._generator.manual_seed(self._seed)
        return self._generator

    def _cache_argument(self) -> str:
        """The forward's name for the KV cache (:func:`textrl.models.kv_cache.cache_argument`)."""
        name = self.__dict__.get("_cache_name")
        if name is None:
            name = self.__dict__["_cache_name"] = cache_argument(self.model)
        return name

    def _new_cache(self) -> Any:
        """An empty ``DynamicCache`` for the model; the forwards fill it in place."""
        return new_cache(self.model)

    # ------------------------------------------------------------------ forward
    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        prompt_ids = tensordict.get("prompt_ids")
        prompt_mask = tensordict.get("prompt_mask").bool()
        response_ids = tensordict.get("response_ids")
        length = tensordict.get("response_length").reshape(prompt_ids.shape[0])
        with torch.no_grad():
            logits = self._next_logits(prompt_ids, prompt_mask, response_ids, length)
            action, log_prob = self._sample(logits)
        tensordict.set("action", action)
        if self.return_log_prob:
            tensordict.set("action_log_prob", log_prob)
        return tensordict

    def _next_logits(self, prompt_ids, prompt_mask, response_ids, length) -> torch.Tensor:
        if bool((length == 0).all()):
            self.n_prefill += 1
            return self._prefill(prompt_ids, prompt_mask, response_ids, length)
        step = self._continues(prompt_ids, prompt_mask, response_ids, length)
        if step is None:
            self.n_fallback += 1
            return self._prefill(prompt_ids, prompt_mask, response_ids, length)
        self.n_incremental += 1
        return self._incremental(response_ids, length, step)

    def _continues(self, prompt_ids, prompt_mask, response_ids, length) -> torch.Tensor | None:
        """Rows that advanced by one token (bool ``[B]``), or ``None`` if the cache can't go on."""
        if self._cache is None or self._length is None or self._response is None:
            return None
        if prompt_ids.shape != self._prompt_ids.shape or response_ids.shape != self._response.shape:
            return None
        step = length - self._length
        if bool(((step != 0) & (step != 1)).any()):
            return None
        if not (
            torch.equal(prompt_ids, self._prompt_ids)
            and torch.equal(prompt_mask, self._prompt_mask)
        ):
            return None
        seen = torch.arange(response_ids.shape[1], device=length.device) < self._length.unsqueeze(1)
        if bool(((response_ids != self._response) & seen).any()):
            return None
        return step.bool()

    def _prefill(self, prompt_ids, prompt_mask, response_ids, length) -> torch.Tensor:
        """Encode ``prompt + response[:, :max(length)]`` and rebuild the cache from it."""
        b, p = prompt_ids.shape
        t = int(length.max())
        resp_mask = torch.arange(t, device=length.device) < length.unsqueeze(1)  # [B, t]
        input_ids = torch.cat([prompt_ids, response_ids[:, :t]], 1)
        attn = torch.cat([prompt_mask, resp_mask], 1)
        position_ids = (attn.long().cumsum(1) - 1).clamp(min=0)
        cache = self._new_cache()
        out = self.model(
            input_ids=input_ids,
            attention_mask=attn.long(),
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=1 if t == 0 else 0,
            **{self._cache_argument(): cache},
        )
        logits = out.logits
        if t == 0:
            next_logits = logits[:, -1]
        else:  # row b's next token is predicted at its last valid position p + length[b] - 1
            last = (p + length - 1).view(-1, 1, 1).expand(-1, 1, logits.shape[-1])
            next_logits = logits.gather(1, last).squeeze(1)
        self._cache = cache  # the forward filled it in place
        self._attn = attn
        self._prompt_ids, self._prompt_mask = prompt_ids.clone(), prompt_mask.clone()
        self._response = response_ids.clone()
        self._length = length.clone()
        self._logits = next_logits.float()
        return self._logits

    def _incremental(self, response_ids, length, step) -> torch.Tensor:
        """Feed one token per row: the last action for rows that advanced, masked pad else."""
        if not bool(step.any()):
            return self._logits
        last = (length - 1).clamp(min=0).unsqueeze(1)
        token = response_ids.gather(1, last)  # [B, 1]
        token = torch.where(step.unsqueeze(1), token, torch.full_like(token, self.pad_token_id))
        attn = torch.cat([self._attn, step.unsqueeze(1)], 1)
        position_ids = (attn.long().sum(1, keepdim=True) - 1).clamp(min=0)
        out = self.model(
            input_ids=token,
            attention_mask=attn.long(),
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_argument(): self._cache},  # grown in place by the forward
        )
        new = out.logits[:, -1].float()
        self._attn = attn
        self._response = response_ids.clone()
        self._length = length.clone()
        self._logits = torch.where(step.unsqueeze(1), new, self._logits)
        return self._logits

    def _sample(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.temperature:
            action = logits.argmax(-1)
            logp = torch.log_softmax(logits, -1)
        else:
            logp = torch.log_softmax(logits / self.temperature, -1)
            action = torch.multinomial(logp.exp(), 1, generator=self._rng(logits.device)).squeeze(1)
        return action, logp.gather(1, action.unsqueeze(1)).squeeze(1)


__all__ = ["KVCachePolicy"]
