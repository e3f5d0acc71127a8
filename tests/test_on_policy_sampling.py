"""Rollouts are drawn from exactly the distribution whose log-probs the agents compute.

A model folder's ``generation_config.json`` (repetition_penalty, no_repeat_ngram_size, min_length,
...) must not reach the sampler: the samples of a folder that carries them equal those of the same
weights without them, under a fixed seed, and the log-probs the agent recomputes are the
log-softmax of the temperature / top-k / top-p warped logits at the sampled tokens.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from textrl.agents import GAEPPO, MultiAdapterPPO
from textrl.config import TrainConfig
from textrl.models import ValueModel, build_tiny_causal_lm, build_tiny_tokenizer
from textrl.models.sampling import off_policy_settings

OFF_POLICY = dict(repetition_penalty=1000.0, no_repeat_ngram_size=1, min_length=40)
"""Each one changes the distribution beyond recognition: a token never repeats and is crushed
once seen, and EOS is banned for the first 40 positions."""


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def _folder(tmp_path, tok, generation: dict | None):
    """A tiny model saved to a folder, with ``generation`` in its generation_config.json."""
    model = build_tiny_causal_lm(tok, seed=3)
    if generation:
        for key, value in generation.items():
            setattr(model.generation_config, key, value)
    path = tmp_path / ("with" if generation else "without")
    model.save_pretrained(path)
    return AutoModelForCausalLM.from_pretrained(path).eval()


def _agent(tok, policy, cls=GAEPPO, **overrides):
    config = TrainConfig(agent=cls.name, prompts_per_iteration=8, n_samples_per_prompt=1, max_new_tokens=10,
                         forward_batch_size=8, generation_batch_size=8, temperature=0.7, top_k=40, top_p=0.9,
                         **overrides)
    if cls is MultiAdapterPPO:
        return cls(policy, tok, config)
    return cls(policy, tok, config, critic=ValueModel.from_causal_lm(policy))


def _prompts(tok):
    enc = tok(["What is 1+2?", "hi", "Count to 3", "<think>"] * 2, return_tensors="pt", padding=True)
    return enc["input_ids"], enc["attention_mask"].bool()


def _act(agent, ids, mask, seed=0):
    torch.manual_seed(seed)
    return agent.act(ids, mask)


def test_the_folder_really_changes_what_generate_samples(tmp_path, tok):
    # The premise: a plain generate() call takes the folder's settings (so the test below can fail).
    model = _folder(tmp_path, tok, OFF_POLICY)
    assert off_policy_settings(model.generation_config) == OFF_POLICY
    ids, mask = _prompts(tok)
    torch.manual_seed(0)
    out = model.generate(input_ids=ids, attention_mask=mask.long(), max_new_tokens=10, do_sample=True,
                         temperature=0.7, top_k=40, top_p=0.9, pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id)[:, ids.shape[1]:]
    assert all(len(set(row.tolist())) == len(row) for row in out)  # no_repeat_ngram_size=1: never a repeat


def test_samples_ignore_the_folders_generation_config(tmp_path, tok):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        agent = _agent(tok, _folder(tmp_path, tok, OFF_POLICY))
    plain = _agent(tok, _folder(tmp_path, tok, None))
    notice = [str(w.message) for w in caught if "generation_config.json" in str(w.message)]
    assert len(notice) == 1 and agent.sampling_notice == notice[0]
    assert "repetition_penalty=1000.0, no_repeat_ngram_size=1, min_length=40" in notice[0]
    assert "samples without them so that rollouts stay on-policy" in notice[0]
    assert plain.sampling_notice is None
    ids, mask = _prompts(tok)
    for seed in range(3):
        torch.testing.assert_close(_act(agent, ids, mask, seed), _act(plain, ids, mask, seed), rtol=0, atol=0)
    # the folder's settings are back on the model afterwards (textrl generate keeps them)
    assert agent.policy.generation_config.repetition_penalty == 1000.0
    # sampling really draws repeats, which no_repeat_ngram_size=1 would have made impossible
    many = torch.cat([_act(agent, ids, mask, seed) for seed in range(4)])
    assert any(len(set(row.tolist())) < len(row) for row in many)


def test_the_engines_distribution_is_the_warped_logits_and_the_learners_the_tempered_ones(tmp_path, tok):
    agent = _agent(tok, _folder(tmp_path, tok, OFF_POLICY))
    ids, mask = _prompts(tok)
    response = _act(agent, ids, mask)
    full = torch.cat([ids, response], 1)
    attn = torch.cat([mask, torch.ones_like(response, dtype=torch.bool)], 1)
    # the engine's distribution (the weight check's prefill); the learner's log-probs are the policy's at
    # the temperature alone (docs/training.md, "Sampling settings and the log-probs")
    logp = agent.learner.forwards.filtered_logprobs(agent.policy, full, attn, ids.shape[1], response)  # [B, T]
    learner = agent.learner.forwards.logprobs(agent.policy, full, attn, ids.shape[1], response)  # [B, T]
    with torch.no_grad():  # the reference computation, by hand: HF's warpers in HF's order
        positions = (attn.long().cumsum(1) - 1).clamp(min=0)
        logits = agent.policy(input_ids=full, attention_mask=attn.long(), position_ids=positions).logits
        logits = logits[:, ids.shape[1] - 1: -1].float() / 0.7
        tempered = logits.log_softmax(-1).gather(-1, response.unsqueeze(-1)).squeeze(-1)
        kth = logits.topk(40, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
        sorted_logits, order = logits.sort(-1)
        remove = sorted_logits.softmax(-1).cumsum(-1) <= 1 - 0.9
        remove[..., -1] = False
        logits = logits.masked_fill(remove.scatter(-1, order, remove), float("-inf"))
        expected = logits.log_softmax(-1).gather(-1, response.unsqueeze(-1)).squeeze(-1)
    valid = torch.ones_like(response, dtype=torch.bool)
    for row, tokens in enumerate(response):  # up to and including the first EOS
        eos = (tokens == tok.eos_token_id).nonzero()
        if len(eos):
            valid[row, int(eos[0]) + 1:] = False
    torch.testing.assert_close(logp[valid], expected[valid], rtol=1e-4, atol=1e-4)
    assert bool(torch.isfinite(logp[valid]).all())  # every sampled token is inside the top-k / top-p set
    torch.testing.assert_close(learner[valid], tempered[valid], rtol=1e-4, atol=1e-4)


def test_lora_agents_sample_without_the_folders_settings_too(tmp_path, tok):
    ids, mask = _prompts(tok)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        agent = _agent(tok, _folder(tmp_path, tok, OFF_POLICY), MultiAdapterPPO, lora_r=4)
    plain = _agent(tok, _folder(tmp_path, tok, None), MultiAdapterPPO, lora_r=4)
    assert agent.sampling_notice and "repetition_penalty=1000.0" in agent.sampling_notice
    torch.testing.assert_close(_act(agent, ids, mask), _act(plain, ids, mask), rtol=0, atol=0)


def test_greedy_evaluation_ignores_them_as_well(tmp_path, tok):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        agent = _agent(tok, _folder(tmp_path, tok, dict(OFF_POLICY, num_beams=3, do_sample=False)))
    plain = _agent(tok, _folder(tmp_path, tok, None))
    assert "num_beams=3" in agent.sampling_notice
    ids, mask = _prompts(tok)
    torch.testing.assert_close(agent.act(ids, mask, greedy=True), plain.act(ids, mask, greedy=True), rtol=0, atol=0)


def test_the_notice_names_the_folders_sampling_settings_textrl_replaces(tmp_path, tok):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        agent = _agent(tok, _folder(tmp_path, tok, dict(do_sample=True, top_k=20, top_p=0.8)))
    assert agent.sampling_notice == ("the model's generation_config.json top_k=20, top_p=0.8 are replaced by "
                                     "textrl's --top-k 40 --top-p 0.9")
    assert off_policy_settings(GenerationConfig()) == {}


def test_textrl_generate_says_it_samples_with_the_folders_settings(tmp_path, tok, capsys):
    """Inference keeps the folder's processors (that is what the model's authors chose), and says so."""
    from textrl.cli import main

    _folder(tmp_path, tok, {"repetition_penalty": 1.05})
    tok.save_pretrained(tmp_path / "with")
    assert main(["generate", "--model", str(tmp_path / "with"), "--max-new-tokens", "2", "--greedy"]) == 0
    err = capsys.readouterr().err
    assert "textrl generate: sampling with the model's generation_config.json: repetition_penalty=1.05" in err
