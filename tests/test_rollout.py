"""collect / evaluate_prompts: fast-path rows, the task score, process_rollout, eval metrics.

The agents here are minimal fakes around a tiny real model (or scripted responses), so these
tests do not depend on :mod:`textrl.agents`.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from textrl.core.checks import RolloutError, check_rollout
from textrl.envs.prompts import batch_fields, encode_prompts, raw_prompts
from textrl.envs.tasks import format_completion, make_digits_task
from textrl.keys import KEYS
from textrl.models import build_tiny_causal_lm, build_tiny_tokenizer
from textrl.rewards import parse_reward_spec
from textrl.run.rollout import SCORE_KEY, collect, evaluate_prompts

MAX_NEW = 12
SPEC = "think_format,tag_count:0.5,accuracy:2"


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    return build_tiny_causal_lm(tokenizer, seed=0)


@pytest.fixture(scope="module")
def rows():
    return make_digits_task(8, seed=3)


@pytest.fixture(scope="module")
def batch(rows, tokenizer):
    return encode_prompts(rows, tokenizer)[0]


class GenerateAgent:
    """The slice of the agent API collect uses, around ``model.generate`` (seeded sampling)."""

    def __init__(self, model: nn.Module, tokenizer, max_new_tokens: int = MAX_NEW, seed: int = 0):
        self.model = model
        self.tokenizer = tokenizer
        self.config = SimpleNamespace(max_new_tokens=max_new_tokens)
        self.eos_token_id = tokenizer.eos_token_id
        self.pad_token_id = tokenizer.pad_token_id
        self.device = torch.device("cpu")
        self.seed = seed

    @torch.no_grad()
    def act(self, input_ids, attention_mask, *, greedy=False):
        kwargs = dict(do_sample=False) if greedy else dict(do_sample=True, top_k=0, top_p=1.0)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask.long(),
                max_new_tokens=self.config.max_new_tokens,
                eos_token_id=self.eos_token_id,
                pad_token_id=self.pad_token_id,
                **kwargs,
            )
        return out[:, input_ids.shape[1] :]


class ScriptedAgent(GenerateAgent):
    """Returns fixed completion texts (each followed by EOS), right-padded to the longest."""

    def __init__(self, tokenizer, completions, max_new_tokens: int = 32, eos: bool = True):
        super().__init__(None, tokenizer, max_new_tokens)
        self.completions = completions
        self.eos = eos

    def act(self, input_ids, attention_mask, *, greedy=False):
        ids = [
            self.tokenizer(c, add_special_tokens=False)["input_ids"]
            + ([self.eos_token_id] if self.eos else [])
            for c in self.completions[: input_ids.shape[0]]
        ]
        width = max(map(len, ids))
        out = torch.full((len(ids), width), self.pad_token_id, dtype=torch.long)
        for i, row in enumerate(ids):
            out[i, : len(row)] = torch.tensor(row)
        return out


def test_collect_writes_checked_rows_and_the_task_score(model, tokenizer, batch):
    agent = GenerateAgent(model, tokenizer)
    reward = parse_reward_spec(SPEC)
    td = collect(agent, batch, reward)
    check_rollout(td)
    b = len(batch)
    assert td.batch_size == torch.Size([b])
    assert td.get(KEYS.action).shape[1] <= MAX_NEW
    assert torch.equal(td.get(KEYS.prompt_tokens), batch.input_ids)
    score = td.get(SCORE_KEY)
    assert score.shape == (b,) and score.dtype == torch.float32
    assert torch.equal(score, td.get(KEYS.reward).squeeze(-1).sum(1))
    comps = td.get(KEYS.reward_components)
    assert sorted(comps.keys()) == ["accuracy", "tag_count", "think_format"]
    weighted = comps["think_format"] + 0.5 * comps["tag_count"] + 2 * comps["accuracy"]
    torch.testing.assert_close(score, weighted)
    assert all(t.device.type == "cpu" for t in td.values(include_nested=True, leaves_only=True))


def test_collect_accepts_a_spec_string_and_uniform_placement(tokenizer, batch, rows):
    completions = [format_completion("x", r["answer"]) for r in rows]
    completions[1] = "no tags"
    agent = ScriptedAgent(tokenizer, completions)
    last = collect(agent, batch, SPEC)
    uniform = collect(agent, batch, SPEC, reward_placement="uniform")
    torch.testing.assert_close(uniform.get(SCORE_KEY), last.get(SCORE_KEY))
    assert last.get(SCORE_KEY)[0].item() == pytest.approx(0.5 + 0.5 + 2.0)
    assert last.get(SCORE_KEY)[1].item() == 0.0
    mask = uniform.get(KEYS.mask)
    spread = uniform.get(KEYS.reward).squeeze(-1)
    assert (spread[mask] > 0).sum() == mask[0].sum() + sum(mask[i].sum() for i in range(2, 8))


def test_collect_passes_raw_prompts_and_row_fields_to_the_reward(tokenizer, batch, rows):
    seen = {}

    def spy(prompts, completions, **kwargs):
        seen.update(prompts=prompts, completions=completions, **kwargs)
        return torch.zeros(len(prompts))

    agent = ScriptedAgent(tokenizer, [format_completion("x", "1")] * len(rows))
    collect(agent, batch, spy)
    assert seen["prompts"] == [r["prompt"] for r in rows]  # raw, not the chat template
    assert seen["answer"] == [r["answer"] for r in rows]
    assert seen["completions"][0] == format_completion("x", "1")


def test_collect_calls_process_rollout_and_keeps_the_task_score(model, tokenizer, batch):
    class ShapingAgent(GenerateAgent):
        calls = 0

        def process_rollout(self, td):
            ShapingAgent.calls += 1
            mask = td.get(KEYS.mask).unsqueeze(-1)
            td.set(KEYS.reward, td.get(KEYS.reward) - 0.1 * mask)  # a stand-in KL penalty
            return td

    agent = ShapingAgent(model, tokenizer)
    plain = collect(GenerateAgent(model, tokenizer), batch, SPEC)
    shaped = collect(agent, batch, SPEC)
    assert ShapingAgent.calls == 1
    assert torch.equal(shaped.get(SCORE_KEY), plain.get(SCORE_KEY))
    assert not torch.equal(shaped.get(KEYS.reward), plain.get(KEYS.reward))


def test_collect_checks_what_process_rollout_returns(model, tokenizer, batch):
    class BrokenAgent(GenerateAgent):
        def process_rollout(self, td):
            td.set(KEYS.advantage, torch.zeros(td.get(KEYS.action).shape))  # [B, T], not [B, T, 1]
            return td

    with pytest.raises(RolloutError, match="unsqueeze"):
        collect(BrokenAgent(model, tokenizer), batch, SPEC)


def test_rows_that_all_end_early_are_fine_but_a_short_row_without_eos_raises(tokenizer, batch):
    short = [format_completion("x", "1")] * len(batch)
    td = collect(ScriptedAgent(tokenizer, short, max_new_tokens=32), batch, SPEC)
    assert td.get(KEYS.action).shape[1] < 32
    assert td.get(KEYS.terminated).any(1).all()
    with pytest.raises(ValueError, match="no EOS and fewer than max_new_tokens"):
        collect(ScriptedAgent(tokenizer, short, max_new_tokens=32, eos=False), batch, SPEC)


def test_max_new_tokens_must_be_known(tokenizer, batch):
    agent = ScriptedAgent(tokenizer, ["a"] * len(batch))
    agent.config = SimpleNamespace()
    with pytest.raises(ValueError, match="max_new_tokens"):
        collect(agent, batch, SPEC)
    td = collect(agent, batch, SPEC, max_new_tokens=8)
    assert td.get(KEYS.terminated).any(1).all()


def test_evaluate_prompts_metrics(tokenizer, rows):
    batches = encode_prompts(rows, tokenizer, batch_size=3)  # 3 + 3 + 2 rows
    completions = [format_completion("x", r["answer"]) for r in rows]
    completions[0] = format_completion("x", "wrong")
    completions[1] = "<answer>\n" + rows[1]["answer"] + "\n</answer>"  # right, badly formatted

    class PerBatch(ScriptedAgent):
        calls: list[bool] = []

        def act(self, input_ids, attention_mask, *, greedy=False):
            PerBatch.calls.append(greedy)
            out = super().act(input_ids, attention_mask)
            self.completions = self.completions[input_ids.shape[0] :]
            return out

    agent = PerBatch(tokenizer, completions)
    metrics = evaluate_prompts(agent, batches, SPEC, greedy=True)
    assert PerBatch.calls == [True, True, True]
    assert metrics["n"] == 8
    assert metrics["format_rate"] == pytest.approx(7 / 8)
    assert metrics["accuracy"] == pytest.approx(7 / 8)
    assert metrics["reward_components/think_format"] == pytest.approx(0.5 * 7 / 8)
    total = 7 * 0.5 + 0.5 * (7 * 1.0 + 0.5) + 2 * 7
    assert metrics["reward/mean"] == pytest.approx(total / 8)
    assert metrics["truncated/rate"] == 0.0
    assert metrics["response_length/mean"] > 1
    assert all(isinstance(v, float) for v in metrics.values())


def test_evaluate_prompts_with_a_model_and_a_single_reward(model, tokenizer, batch):
    metrics = evaluate_prompts(GenerateAgent(model, tokenizer), [batch], "tag_count", greedy=True)
    assert "format_rate" not in metrics and "accuracy" not in metrics
    assert 0.0 <= metrics["reward/mean"] <= 1.0
    assert 1 <= metrics["response_length/mean"] <= MAX_NEW
    with pytest.raises(ValueError, match="no prompt batches"):
        evaluate_prompts(GenerateAgent(model, tokenizer), [], "tag_count", greedy=True)


def test_batch_fields_and_raw_prompts():
    rows = [
        {"prompt": "a", "answer": "1"},
        {"messages": [{"role": "user", "content": "b"}], "reference": "r"},
    ]
    assert batch_fields(rows) == {"answer": ["1", None], "reference": [None, "r"]}
    assert raw_prompts(rows) == ["a", "b"]
