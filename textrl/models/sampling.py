"""On-policy sampling: ``generate`` with exactly the logits processors textrl accounts for.

transformers merges a model's ``generation_config`` (a folder's ``generation_config.json``:
Qwen2.5-Instruct's ``repetition_penalty=1.05``, others' ``no_repeat_ngram_size``, ``min_length``,
``suppress_tokens``, ...) into every ``generate`` call: each field a call leaves unset is taken from
it, so passing a fresh ``GenerationConfig`` is not enough. A rollout drawn that way comes from a
distribution textrl never accounts for (the engine's log-probs and the weight check apply temperature,
top-k and top-p: :func:`textrl.agents.base.warp_logits`; the learner's the temperature), and the PPO
ratio is off from the first token.

:func:`sample` therefore builds the whole configuration itself (:func:`sampling_config`: sampling
or greedy, temperature, top-k, top-p, the length cap, EOS / pad ids, one beam) and, for the
call, puts a fresh ``GenerationConfig`` in place of every ``generation_config`` the model carries
(:func:`folder_settings_off`), so nothing of the folder's reaches the sampler.
:func:`off_policy_settings` lists what the folder would have added; :func:`neutralised_notice`
says it in one line.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import Tensor, nn

LOGPROB_SETTINGS = ("do_sample", "temperature", "top_k", "top_p")
"""The generation settings textrl accounts for (``warp_logits``: temperature, then
top-k, then top-p, HF's order); always set by textrl, never taken from a model's config."""

NEUTRAL: dict[str, tuple[Any, ...]] = {
    "num_beams": (1,), "num_beam_groups": (1,), "penalty_alpha": (0, 0.0),
    "repetition_penalty": (1.0,), "encoder_repetition_penalty": (1.0,),
    "no_repeat_ngram_size": (0,), "encoder_no_repeat_ngram_size": (0,), "bad_words_ids": ([],),
    "min_length": (0,), "min_new_tokens": (0,), "forced_bos_token_id": (), "forced_eos_token_id": (),
    "remove_invalid_values": (False,), "exponential_decay_length_penalty": (),
    "suppress_tokens": ([],), "begin_suppress_tokens": ([],), "sequence_bias": ({},),
    "guidance_scale": (1, 1.0), "typical_p": (1.0,), "epsilon_cutoff": (0.0,), "eta_cutoff": (0.0,),
    "min_p": (0.0,), "top_h": (), "watermarking_config": (), "renormalize_logits": (False,),
    "stop_strings": ([], ""), "max_time": (), "dola_layers": (), "prompt_lookup_num_tokens": (),
    "token_healing": (False,), "low_memory": (False,),
}
"""Every other setting that changes the sampled distribution, which tokens can come, or where a
response ends, with its neutral values besides None (the first is the one textrl sets)."""


SAMPLING_NEUTRAL = {
    "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0, "min_length": 0, "typical_p": 1.0, "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0, "remove_invalid_values": False, "renormalize_logits": False,
}
"""The settings of :data:`NEUTRAL` a sampling config sets to their neutral value explicitly."""


def _known(name: str) -> bool:
    """Whether this transformers' ``GenerationConfig`` has the setting ``name``."""
    from transformers import GenerationConfig

    return hasattr(GenerationConfig(), name)


def _is_neutral(name: str, value: Any) -> bool:
    return value is None or any(value == neutral for neutral in NEUTRAL[name])


def off_policy_settings(generation_config: Any) -> dict[str, Any]:
    """The settings of a model's ``generation_config`` that change sampling beyond
    :data:`LOGPROB_SETTINGS` (``{name: value}``, in :data:`NEUTRAL`'s order); empty when none."""
    if generation_config is None:
        return {}
    return {name: getattr(generation_config, name) for name in NEUTRAL
            if not _is_neutral(name, getattr(generation_config, name, None))}


def sampling_config(*, greedy: bool, temperature: float, top_k: int, top_p: float, max_new_tokens: int,
                    eos_token_id: int | None, pad_token_id: int | None) -> Any:
    """The whole ``GenerationConfig`` of a rollout: greedy, or sampling at ``temperature`` with
    ``top_k`` (0: off) and ``top_p`` (1.0: off); one beam, the KV cache, every setting of
    :data:`SAMPLING_NEUTRAL` at its neutral value (the rest are unset: :func:`sample` keeps the
    model's values out)."""
    from transformers import GenerationConfig

    settings: dict[str, Any] = dict(max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                                    pad_token_id=pad_token_id, use_cache=True, do_sample=not greedy, num_beams=1)
    if not greedy:  # the numeric ones explicitly too, should a model's config escape folder_settings_off
        settings.update(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p))
        settings.update({name: value for name, value in SAMPLING_NEUTRAL.items() if _known(name)})
    return GenerationConfig(**settings)


def _owners(model: Any) -> list[Any]:
    """Every object under ``model`` that carries a ``generation_config`` of its own: the modules
    of ``model``, and of the modules it generates with (``model.generation_modules()``, such as
    an adapter view's shared base)."""
    roots = [model, *(model.generation_modules() if callable(getattr(model, "generation_modules", None)) else [])]
    seen: dict[int, Any] = {}
    for root in roots:
        for obj in (root.modules() if isinstance(root, nn.Module) else [root]):
            if getattr(obj, "__dict__", {}).get("generation_config") is not None:
                seen.setdefault(id(obj), obj)
    return list(seen.values())


def model_generation_config(model: Any) -> Any:
    """The ``generation_config`` ``model`` (or the first of its modules) carries, else None."""
    owners = _owners(model)
    return owners[0].__dict__["generation_config"] if owners else None


@contextmanager
def folder_settings_off(model: Any) -> Iterator[None]:
    """For the ``with`` block, every ``generation_config`` under ``model`` is a fresh
    ``GenerationConfig`` (all unset), so ``generate`` takes nothing from the model's own; the
    originals are put back afterwards, whatever happens."""
    from transformers import GenerationConfig

    saved = [(owner, owner.__dict__["generation_config"]) for owner in _owners(model)]
    try:
        for owner, _ in saved:
            owner.__dict__["generation_config"] = GenerationConfig()
        yield
    finally:
        for owner, original in saved:
            owner.__dict__["generation_config"] = original


def sample(model: Any, input_ids: Tensor, attention_mask: Tensor, generation_config: Any, **kwargs: Any) -> Tensor:
    """``model.generate`` under ``generation_config`` alone (:func:`sampling_config`), none of the
    model's own settings (:func:`folder_settings_off`); ``kwargs`` are generate's own arguments
    (``synced_gpus``). Returns prompt + response ``[B, P + T]``."""
    with folder_settings_off(model):
        return model.generate(input_ids=input_ids, attention_mask=attention_mask,
                              generation_config=generation_config, **kwargs)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def neutralised_notice(model: Any, *, temperature: float, top_k: int, top_p: float) -> str | None:
    """One line saying which settings of the model's ``generation_config`` textrl samples without
    (:func:`off_policy_settings`) and which of :data:`LOGPROB_SETTINGS` it replaces with its own;
    None when the model's config adds nothing."""
    config = model_generation_config(model)
    dropped = off_policy_settings(config)
    ours = {"temperature": float(temperature), "top_k": int(top_k), "top_p": float(top_p)}
    replaced = {name: getattr(config, name) for name, value in ours.items()
                if config is not None and getattr(config, name, None) is not None and getattr(config, name) != value}
    if not dropped and not replaced:
        return None
    parts = []
    if dropped:
        listed = ", ".join(f"{name}={value!r}" for name, value in dropped.items())
        parts.append(f"the model's generation_config.json sets {listed}; textrl samples without "
                     f"{'it' if len(dropped) == 1 else 'them'} so that rollouts stay on-policy "
                     "(its log-probs apply only temperature, top-k and top-p)")
    if replaced:
        listed = ", ".join(f"{name}={value!r}" for name, value in replaced.items())
        own = " ".join(f"{_flag(name)} {ours[name]:g}" for name in replaced)
        parts.append(f"{'its' if dropped else 'the model' + chr(39) + 's generation_config.json'} {listed} "
                     f"{'is' if len(replaced) == 1 else 'are'} replaced by textrl's {own}")
    return "; ".join(parts)


def inference_notice(model: Any) -> str | None:
    """For inference (``textrl generate``, which keeps the model's own configuration): one line
    naming the settings of the model's ``generation_config`` that shape its samples, None if none."""
    dropped = off_policy_settings(model_generation_config(model))
    if not dropped:
        return None
    listed = ", ".join(f"{name}={value!r}" for name, value in dropped.items())
    return f"sampling with the model's generation_config.json: {listed} (training rollouts sample without them)"


__all__ = ["LOGPROB_SETTINGS", "NEUTRAL", "folder_settings_off", "inference_notice", "model_generation_config",
           "neutralised_notice", "off_policy_settings", "sample", "sampling_config"]
