"""``textrl rm``: the pairwise loss, learning separable pairs, and the two output formats."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from textrl.stages.preferences import load_preferences
from textrl.stages.rm import RMConfig, encode_pairs, pairwise_loss, render_for_reward, train_rm


def test_pairwise_loss_closed_form():
    chosen, rejected = torch.tensor([2.0, 0.0, -1.0]), torch.tensor([0.0, 1.0, -1.0])
    loss, stats = pairwise_loss(chosen, rejected)
    expected = torch.log1p(torch.exp(-(chosen - rejected))).mean()
    torch.testing.assert_close(loss, expected)
    assert stats == pytest.approx({"accuracy": 1 / 3, "margin": 1 / 3})


def test_rendering_matches_what_neural_reward_reads():
    from textrl.models import load_tokenizer
    from textrl.rewards import NeuralReward

    tok = load_tokenizer("tiny")
    pref = load_preferences("builtin:case")[0]
    text, templated = render_for_reward(tok, pref.prompt, pref.chosen)
    assert templated
    neural = NeuralReward.__new__(NeuralReward)  # only its rendering, no model needed
    neural.tokenizer, neural.use_chat_template = tok, True
    assert neural.render(pref.messages[0][1], pref.chosen) == text
    ids, mask = encode_pairs(tok, [pref], max_length=8)
    assert ids.shape == (2, 8) and mask.all()  # truncated from the left to max_length


@pytest.mark.slow
def test_full_reward_model_ranks_held_out_pairs_and_loads_as_reward_model(sft_model, tmp_path):
    from textrl.models import load_reward_model
    from textrl.rewards import get_reward

    config = RMConfig(output_dir=str(tmp_path), model=sft_model, steps=40, eval_every=0, progress=False)
    summary = train_rm(config)
    assert summary["before"]["accuracy"] < 0.8
    assert summary["after"]["accuracy"] >= 0.95
    model = load_reward_model(tmp_path / "model")
    assert model.config.num_labels == 1
    # Through the reward registry, as `textrl train --reward-model` scores: unseen prompts.
    reward = get_reward(f"reward_model:{tmp_path / 'model'}", clip=None)
    held = load_preferences("builtin:case-heldout")
    prompts = [p.messages[0][1] for p in held]
    chosen = reward(prompts, [p.chosen for p in held])
    rejected = reward(prompts, [p.rejected for p in held])
    assert (chosen > rejected).float().mean() >= 0.95


@pytest.mark.slow
def test_lora_reward_adapter_round_trips_with_its_score_head(sft_model, tmp_path):
    from textrl.models import load_tokenizer
    from textrl.models.adapters import (
        last_token_hidden,
        load_base_model,
        load_reward_adapter,
        read_reward_meta,
    )

    config = RMConfig(output_dir=str(tmp_path), model=sft_model, steps=40, lr=1e-2, lora=True,
                      eval_every=0, progress=False)
    summary = train_rm(config)
    assert summary["after"]["accuracy"] >= 0.9
    meta = read_reward_meta(tmp_path / "model")
    assert meta["base_model"] == str(Path(sft_model).resolve()) and meta["hidden_size"] == 64
    model, head = load_reward_adapter(load_base_model(sft_model), tmp_path / "model")
    tok = load_tokenizer(sft_model)
    held = load_preferences("builtin:case-heldout")[:32]
    ids, mask = encode_pairs(tok, held, max_length=256)
    with torch.no_grad():
        scores = head(last_token_hidden(model, ids, mask)).squeeze(-1)
    assert (scores[:32] > scores[32:]).float().mean() >= 0.9
