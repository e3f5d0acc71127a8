"""Regression tests for the masking bugs most reported across RL-for-LLM toolkits, one each.

The classes, and where else they are covered:

1. gaps in the agent mask (observations between turns): here, and the math in
   tests/functional/test_gapped_masks.py, the agents in tests/test_multiturn_agents.py;
2. ``pad == eos`` (the first EOS must stay in the mask): here, single- and multi-turn;
3. a tool mask whose length no longer matches the completion after re-tokenisation: textrl never
   re-tokenises the agent's tokens, so the mask is built on the sampled ids (here);
4. tool tokens counted by a length penalty: here (the final reward sees the agent's tokens only);
5. earlier assistant turns of a conversational prompt trained on: here (prompt tokens are never in
   the rollout's agent mask);
6. a chat template that drops earlier ``<think>`` blocks: tests/envs/test_collector.py and
   tests/envs/test_token_env_multiturn.py (the trained tokens are the sampled ones).
"""

from __future__ import annotations

import copy

import pytest
import torch

from textrl.envs.collector import EpisodeRunner
from textrl.envs.environment import Environment, Turn
from textrl.envs.prompts import encode_prompts
from textrl.keys import KEYS
from textrl.rewards import length_penalty, named


def play(tok, turns: list[str], eos: int | None = None):
    """A generate function playing ``turns`` (each + EOS) for a one-row batch, one per call."""
    state = {"k": 0}
    eos = tok.eos_token_id if eos is None else eos

    def generate(ids, mask):
        text = turns[state["k"]]
        state["k"] += 1
        out = tok(text, add_special_tokens=False)["input_ids"] + [eos]
        return torch.tensor([out + [tok.pad_token_id] * 3])  # padding after EOS, as generate pads

    return generate


class Tool(Environment):
    """The first turn calls a tool (its result is long), the second answers."""

    id = "tool"
    max_turns = 2
    stop_strings = ("</tool>",)

    def __init__(self, reward=None):
        self.reward = reward

    def rows(self):
        return [{"prompt": "What is 123*456?"}]

    def step(self, episode, completion):
        if completion.endswith("</tool>"):
            return Turn(observation=[{"role": "tool", "content": "56088 " * 20}])
        return Turn(reward=1.0, done=True)


def test_gaps_sit_exactly_on_the_tool_result_and_the_mask_matches_the_sampled_ids(tok):
    env = Tool()
    batch = encode_prompts(env.rows(), tok)[0]
    call, answer = "<tool>123*456</tool>", "<answer>56088</answer>"
    td = EpisodeRunner(env, tokenizer=tok, max_new_tokens=40, max_episode_tokens=300).run(play(tok, [call + " extra", answer]), batch)
    action, agent = td.get(KEYS.action)[0], td.get(KEYS.mask)[0]
    ids = tok(call + " extra", add_special_tokens=False)["input_ids"]
    cut = next(i for i in range(1, len(ids) + 1) if "</tool>" in tok.decode(ids[:i]))
    first = ids[:cut]
    second = tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    n = int(td.get(KEYS.response_mask)[0].sum())
    # the agent's tokens are exactly the sampled ones, the gap exactly the environment's tokens
    assert action[agent].tolist() == first + second
    assert agent[: len(first)].all() and agent[n - len(second) : n].all()
    assert not agent[len(first) : n - len(second)].any()
    assert int(agent.sum()) == len(first) + len(second)  # no drift between the mask and the ids


def test_a_length_penalty_counts_the_agents_tokens_not_the_tool_result(tok):
    seen = {}

    @named("spy_length")
    def spy(prompts, completions, completion_ids=None, **kw):
        seen["ids"] = completion_ids
        return length_penalty(prompts, completions, completion_ids=completion_ids, target_tokens=0,
                              penalty_per_token=1.0)

    env = Tool(reward=spy)
    batch = encode_prompts(env.rows(), tok)[0]
    td = EpisodeRunner(env, tokenizer=tok, max_new_tokens=40, max_episode_tokens=300).run(
        play(tok, ["<tool>123*456</tool>", "<answer>56088</answer>"]), batch)
    agent_tokens = int(td.get(KEYS.mask).sum())
    all_tokens = int(td.get(KEYS.response_mask).sum())
    assert all_tokens > 2 * agent_tokens  # the tool result is long
    assert [len(r) for r in seen["ids"]] == [agent_tokens]
    assert td.get((KEYS.reward_components, "spy_length")).tolist() == [-float(agent_tokens)]


@pytest.mark.parametrize("multi_turn", [False, True])
def test_pad_equal_to_eos_keeps_the_first_eos_in_the_mask(tok, multi_turn):
    same = copy.deepcopy(tok)
    same.pad_token = same.eos_token
    assert same.pad_token_id == same.eos_token_id
    env = Tool() if multi_turn else Environment()
    rows = Tool().rows()
    batch = encode_prompts(rows, same)[0]
    turns = ["<tool>1+1</tool>", "<answer>2</answer>"] if multi_turn else ["<answer>2</answer>"]
    td = EpisodeRunner(env, tokenizer=same, max_new_tokens=40).run(play(same, turns), batch)
    action, agent = td.get(KEYS.action)[0], td.get(KEYS.mask)[0]
    last = int(agent.nonzero().max())
    assert action[last].item() == same.eos_token_id  # the final EOS is an action, trained on
    assert td.get(KEYS.done)[0, last].item()
    assert not agent[last + 1 :].any()  # the padding after it (also EOS ids) is not


def test_earlier_assistant_turns_of_a_conversational_prompt_are_not_trained_on(tok):
    rows = [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! Ask me."},
                          {"role": "user", "content": "What is 2+2?"}], "answer": "4"}]
    batch = encode_prompts(rows, tok)[0]
    td = EpisodeRunner("accuracy", tokenizer=tok, max_new_tokens=16).run(play(tok, ["<answer>4</answer>"]), batch)
    earlier = tok("Hello! Ask me.", add_special_tokens=False)["input_ids"]
    prompt = td.get(KEYS.prompt_tokens)[0][td.get(KEYS.prompt_mask)[0]].tolist()
    assert any(prompt[i : i + len(earlier)] == earlier for i in range(len(prompt)))  # it is context ...
    trained = td.get(KEYS.action)[0][td.get(KEYS.mask)[0]].tolist()
    assert trained == tok("<answer>4</answer>", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert td.get(KEYS.score).tolist() == [1.0]  # ... and the reward sees the whole conversation's answer
