"""``textrl rm``: reward-model training with the pairwise loss ``-log sigmoid(r_chosen - r_rejected)``.

Each side of a pair is rendered as the reward model will read it in PPO (``NeuralReward``): the
conversation plus the response as the assistant turn through the tokenizer's chat template (no
template: prompt text + response), truncated from the left to ``max_length``, left-padded. The
score is a linear head on the final hidden state at the last token.

Outputs (``model/``):

- full (default): an ``AutoModelForSequenceClassification`` with ``num_labels=1`` initialised
  from ``--model`` (a causal LM; its score head is new), saved with the tokenizer: loadable by
  :func:`textrl.models.load_reward_model` and usable as ``textrl train --reward-model``;
- ``--lora``: a LoRA reward adapter on the (optionally 4-bit) base with its own score head,
  written by :func:`textrl.models.adapters.save_reward_adapter` (for
  ``--agent multi_adapter_ppo --reward-adapter``).

Held-out pairwise accuracy (``r_chosen > r_rejected``) and mean margin are reported before and
after training.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from textrl.run import holds_run_folder
from textrl.run.signals import until_stopped
from textrl.stages.common import (
    add_lora,
    fit,
    format_summary,
    model_record,
    pad_left,
    prepare_run,
    resolve_model_path,
    split_rows,
    stage_precision,
    write_atomically,
)
from textrl.stages.preferences import Preference, PreferenceStageConfig, load_preferences


@dataclass
class RMConfig(PreferenceStageConfig):
    """``textrl rm``. Defaults: the tiny model on ``builtin:case`` preferences."""

    output_dir: str = "runs/rm"
    """Where config.yaml, metrics.jsonl, tb/, summary.json, checkpoints/ and model/ go."""


def pairwise_loss(chosen: Tensor, rejected: Tensor) -> tuple[Tensor, dict[str, float]]:
    """``mean(-log sigmoid(r_c - r_r))`` of scores ``[B]``, with accuracy and mean margin."""
    margin = chosen - rejected  # [B]
    loss = -F.logsigmoid(margin).mean()
    return loss, {"accuracy": (margin > 0).float().mean().item(), "margin": margin.mean().item()}


def render_for_reward(tokenizer: Any, pref_messages: list[dict[str, str]], response: str) -> tuple[str, bool]:
    """(text, whether a chat template produced it): what ``NeuralReward.render`` gives."""
    if getattr(tokenizer, "chat_template", None):
        messages = [*pref_messages, {"role": "assistant", "content": response}]
        return tokenizer.apply_chat_template(messages, tokenize=False), True
    return "\n\n".join(m["content"] for m in pref_messages) + response, False


def encode_pairs(tokenizer: Any, prefs: list[Preference], max_length: int) -> tuple[Tensor, Tensor]:
    """Chosen rows then rejected rows: ``input_ids``, ``attention_mask`` int64 ``[2B, L]``,
    left-padded, each row truncated from the left to ``max_length``."""
    rows = []
    for key in ("chosen", "rejected"):
        for pref in prefs:
            text, templated = render_for_reward(tokenizer, pref.prompt, getattr(pref, key))
            ids = tokenizer(text, add_special_tokens=not templated)["input_ids"]
            rows.append(ids[-max_length:])
    return pad_left(rows, tokenizer.pad_token_id)


class RewardScorer(nn.Module):
    """Scalar scores ``[B]`` of a body + linear head at the last token (full model or LoRA)."""

    def __init__(self, model: nn.Module, head: nn.Linear) -> None:
        super().__init__()
        self.model, self.head = model, head

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        from textrl.models.adapters import last_token_hidden

        hidden = last_token_hidden(self.model, input_ids, attention_mask)  # [B, H] float32
        return self.head(hidden.to(self.head.weight.dtype)).squeeze(-1).float()  # [B]


def build_scorer(config: RMConfig, device: torch.device, pad_token_id: int) -> RewardScorer:
    """Full: a sequence-classification model from ``--model`` (its ``score`` head). LoRA: the
    (4-bit) base with a LoRA adapter and a new ``Linear(H, 1)`` head."""
    precision = stage_precision(config, device)
    if not config.lora:
        from textrl.models import load_reward_model

        model = load_reward_model(resolve_model_path(config.model), device=device, **precision.model_kwargs())
        model.config.pad_token_id = pad_token_id
        head = getattr(model, "score", None)
        if not isinstance(head, nn.Linear):
            raise ValueError(
                f"model={config.model!r}: its sequence-classification head is not a linear "
                "'score' layer (as in Llama, Qwen, Mistral, GPT-2); start from a decoder-only causal LM"
            )
        return RewardScorer(model, head)
    from textrl.models.adapters import hidden_size, load_base_model

    base = load_base_model(config.model, load_in_4bit=config.load_in_4bit, device=device, precision=precision)
    model = add_lora(base, config)
    head = nn.Linear(hidden_size(model), 1, device=device)  # float32: the scorer reads float32 hidden states
    nn.init.normal_(head.weight, std=0.02)
    nn.init.zeros_(head.bias)
    return RewardScorer(model, head)


def save_reward(scorer: RewardScorer, tokenizer: Any, config: RMConfig, path) -> None:
    """Full model + tokenizer, or the reward-adapter folder (``save_reward_adapter``)."""
    from textrl.models.adapters import is_peft, save_reward_adapter

    if is_peft(scorer.model):
        save_reward_adapter(scorer.model, scorer.head, path, base_model=model_record(config.model))
        return

    def write(tmp) -> None:
        scorer.model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    write_atomically(path, write)


@holds_run_folder
def train_rm(config: RMConfig) -> dict[str, Any]:
    """Run the stage; return ``{"before", "after", "model", ...}`` (held-out accuracy, margin)."""
    from textrl.models import load_tokenizer

    device, _, checkpoint = prepare_run(config)
    prefs = load_preferences(config.data, format=config.format)
    train_prefs, eval_prefs = split_rows(prefs, config.eval_size, config.seed, "preference data")
    tokenizer = load_tokenizer(config.model)
    scorer = build_scorer(config, device, tokenizer.pad_token_id)

    def scores(rows: list[Preference]) -> tuple[Tensor, Tensor]:
        ids, mask = encode_pairs(tokenizer, rows, config.max_length)
        r = scorer(ids.to(device), mask.to(device))  # [2B]
        return r[: len(rows)], r[len(rows):]

    def loss_fn(rows: list[Preference]) -> tuple[Tensor, dict[str, float]]:
        scorer.train()
        return pairwise_loss(*scores(rows))

    def evaluate() -> dict[str, float]:
        if not eval_prefs:
            return {}
        scorer.eval()
        chosen, rejected = [], []
        with torch.no_grad():
            batches = range(0, len(eval_prefs), config.batch_size)
            for start in until_stopped(batches, "the held-out evaluation", "batch"):  # a signal: cut between batches
                c, r = scores(eval_prefs[start:start + config.batch_size])
                chosen.append(c)
                rejected.append(r)
        _, stats = pairwise_loss(torch.cat(chosen), torch.cat(rejected))
        return stats

    summary = fit(config, list(scorer.parameters()), train_prefs, loss_fn, evaluate,
                  lambda path: save_reward(scorer, tokenizer, config, path), name="rm", resume_from=checkpoint)
    scorer.eval()
    return summary


def format_rm_summary(summary: dict[str, Any]) -> str:
    return format_summary(summary, ["accuracy", "margin"])


__all__ = ["RMConfig", "RewardScorer", "encode_pairs", "format_rm_summary", "pairwise_loss",
           "render_for_reward", "train_rm"]
