"""``textrl dpo``: direct preference optimisation with the sigmoid loss (Rafailov et al. 2023).

``loss = -log sigmoid(beta * ((log pi(y_c|x) - log ref(y_c|x)) - (log pi(y_r|x) - log ref(y_r|x))))``

with ``log pi(y|x)`` the summed log-probability of the response tokens and EOS (prompt tokens
masked out exactly as in SFT). The reference is the starting model: with ``--lora`` the same
base with the adapter disabled (one copy of the weights), otherwise a frozen copy.

Reported before and after on held-out pairs: ``margin`` (the mean of the implicit reward margin
``beta * (chosen log-ratio - rejected log-ratio)``, 0 before training), ``accuracy`` (share of
pairs with a positive margin) and ``logp_margin`` (``log pi(y_c|x) - log pi(y_r|x)``, the
policy's own chosen-over-rejected preference).
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from textrl.functional import logprobs_from_logits
from textrl.run import holds_run_folder
from textrl.run.signals import until_stopped
from textrl.run.warmup import IGNORE_INDEX, Prompt, build_sft_batch
from textrl.stages.common import (
    fit,
    format_summary,
    load_policy,
    prepare_run,
    save_policy,
    split_rows,
)
from textrl.stages.preferences import Preference, PreferenceStageConfig, load_preferences


@dataclass
class DPOConfig(PreferenceStageConfig):
    """``textrl dpo``. Defaults: the tiny model on ``builtin:case`` preferences."""

    output_dir: str = "runs/dpo"
    """Where config.yaml, metrics.jsonl, tb/, summary.json, checkpoints/ and model/ go."""
    beta: float = 0.1
    """DPO temperature: the strength of the implicit KL constraint to the reference."""

    def validate(self) -> DPOConfig:
        super().validate()
        if not self.beta > 0:
            raise ValueError(f"beta={self.beta!r}: must be > 0 (0.1 is usual)")
        return self


def dpo_loss(
    policy_chosen: Tensor, policy_rejected: Tensor, ref_chosen: Tensor, ref_rejected: Tensor,
    beta: float,
) -> tuple[Tensor, dict[str, float]]:
    """Sigmoid DPO loss of summed response log-probs ``[B]`` each; stats are detached means.

    >>> z = torch.zeros(3)
    >>> round(dpo_loss(z, z, z, z, beta=0.1)[0].item(), 4)  # log 2 when policy == reference
    0.6931
    """
    margin = beta * ((policy_chosen - ref_chosen) - (policy_rejected - ref_rejected))  # [B]
    loss = -F.logsigmoid(margin).mean()
    return loss, {
        "margin": margin.mean().item(),
        "accuracy": (margin > 0).float().mean().item(),
        "logp_margin": (policy_chosen - policy_rejected).mean().item(),
    }


def _prompt(pref: Preference) -> Prompt:
    return pref.messages[0][1] if len(pref.messages) == 1 else pref.prompt


def response_logps(model: Any, batch: dict[str, Tensor]) -> Tensor:
    """Summed log-prob of the labelled (response + EOS) tokens per row: ``[B]``.

    ``batch`` is a right-padded ``build_sft_batch`` batch; position ``t``'s label is predicted by
    the logits at ``t - 1``.
    """
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   use_cache=False).logits  # [B, L, V]
    labels = batch["labels"][:, 1:]  # [B, L-1]
    mask = labels != IGNORE_INDEX
    logp = logprobs_from_logits(logits[:, :-1], torch.where(mask, labels, 0))  # [B, L-1]
    return torch.where(mask, logp, 0.0).sum(1)


@holds_run_folder
def train_dpo(config: DPOConfig) -> dict[str, Any]:
    """Run the stage; return ``{"before", "after", "model", ...}`` (held-out margin, accuracy)."""
    from textrl.models import load_tokenizer

    device, _, checkpoint = prepare_run(config)
    prefs = load_preferences(config.data, format=config.format)
    train_prefs, eval_prefs = split_rows(prefs, config.eval_size, config.seed, "preference data")
    tokenizer = load_tokenizer(config.model)
    policy = load_policy(config, device)
    if config.lora:
        from textrl.models.adapters import warn_if_merged

        warn_if_merged(policy)
        reference = None  # the same base with the adapter disabled
    else:
        reference = copy.deepcopy(policy).eval().requires_grad_(False)

    def logps(rows: list[Preference]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        pairs = [(_prompt(p), p.chosen) for p in rows] + [(_prompt(p), p.rejected) for p in rows]
        batch = {k: v.to(device) for k, v in build_sft_batch(tokenizer, pairs, config.max_length).items()}
        pol = response_logps(policy, batch)  # [2B]
        with torch.no_grad():
            ctx = policy.disable_adapter() if reference is None else contextlib.nullcontext()
            with ctx:
                ref = response_logps(reference if reference is not None else policy, batch)
        n = len(rows)
        return pol[:n], pol[n:], ref[:n], ref[n:]

    def loss_fn(rows: list[Preference]) -> tuple[Tensor, dict[str, float]]:
        policy.train()
        return dpo_loss(*logps(rows), beta=config.beta)

    def evaluate() -> dict[str, float]:
        if not eval_prefs:
            return {}
        policy.eval()
        parts: list[tuple[Tensor, ...]] = []
        with torch.no_grad():
            batches = range(0, len(eval_prefs), config.batch_size)
            for start in until_stopped(batches, "the held-out evaluation", "batch"):  # a signal: cut between batches
                parts.append(logps(eval_prefs[start:start + config.batch_size]))
        _, stats = dpo_loss(*(torch.cat(p) for p in zip(*parts)), beta=config.beta)
        return stats

    summary = fit(config, list(policy.parameters()), train_prefs, loss_fn, evaluate,
                  lambda path: save_policy(policy, tokenizer, path, config=config, stage="dpo"),
                  name="dpo", resume_from=checkpoint)
    policy.eval()
    return summary


def format_dpo_summary(summary: dict[str, Any]) -> str:
    return format_summary(summary, ["margin", "accuracy", "logp_margin"])


__all__ = ["DPOConfig", "dpo_loss", "format_dpo_summary", "response_logps", "train_dpo"]
