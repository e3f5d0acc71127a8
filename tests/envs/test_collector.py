"""The batched collector (textrl/envs/collector.py): one path for single- and multi-turn episodes.

A scripted ``generate`` plays given turns, so every token, mask, reward and end reason is known;
single-turn episodes are held equal to the fast path (``rollout_from_responses``) on the same
tokens, with a real tiny model's samples too.
"""

from __future__ import annotations

import pytest
import torch

from textrl.envs.collector import TURN_REWARDS, EpisodeRunner
from textrl.envs.environment import EnvError, Environment, Turn
from textrl.envs.observations import observation_ids
from textrl.envs.prompts import encode_prompts
from textrl.envs.tasks import make_digits_task
from textrl.keys import END_REASONS, KEYS
from textrl.models import build_tiny_causal_lm


def scripted(tok, turns_per_row: list[list[str]], eos: bool | list[list[bool]] = True, width: int | None = None):
    """A generate function that plays, for row ``b`` at its ``k``-th call, the text
    ``turns_per_row[b][k]`` (+ EOS), right-padded; it records the contexts it was given."""
    calls = {"n": [0] * len(turns_per_row), "contexts": []}

    def generate(input_ids, attention_mask):
        rows = []
        # the rows still running are the ones whose scripts have turns left, in order
        running = [b for b, script in enumerate(turns_per_row) if calls["n"][b] < len(script)]
        running = running[: input_ids.shape[0]]
        for i, b in enumerate(running):
            k = calls["n"][b]
            calls["n"][b] += 1
            ends = eos if isinstance(eos, bool) else eos[b][k]
            ids = tok(turns_per_row[b][k], add_special_tokens=False)["input_ids"] + ([tok.eos_token_id] if ends else [])
            rows.append(ids)
            calls["contexts"].append(input_ids[i][attention_mask[i]].tolist())
        t = width or max(len(r) for r in rows)
        out = torch.full((len(rows), t), tok.pad_token_id, dtype=torch.long)
        for i, r in enumerate(rows):
            out[i, : len(r)] = torch.tensor(r[:t])
        return out

    generate.calls = calls
    return generate


class Echo(Environment):
    """Say the row's word; the environment says "again" until max_turns; reward 1 per right turn."""

    id = "echo"
    max_turns = 3

    def __init__(self, max_turns=3, finish_after=None):
        self.max_turns = max_turns
        self.finish_after = finish_after

    def rows(self):
        return [{"prompt": f"Say {w}", "word": w} for w in ("cat", "dog", "sun")]

    def step(self, episode, completion):
        reward = float(completion.strip() == episode.row["word"])
        if self.finish_after is not None and episode.turn >= self.finish_after:
            return Turn(reward=reward, done=True)
        return Turn(reward=reward, observation="again")


def batch_of(tok, rows):
    return encode_prompts(rows, tok)[0]


def test_single_turn_equals_the_fast_path_on_a_real_models_samples(tok):
    model = build_tiny_causal_lm(tok, seed=0)
    rows = make_digits_task(8, seed=3)
    batch = batch_of(tok, rows)
    torch.manual_seed(0)
    responses = model.generate(input_ids=batch.input_ids, attention_mask=batch.attention_mask.long(),
                               max_new_tokens=10, do_sample=True, pad_token_id=tok.pad_token_id)[:, batch.input_ids.shape[1]:]
    for placement in ("last", "uniform"):
        runner = EpisodeRunner("think_format,tag_count,accuracy", tokenizer=tok, max_new_tokens=10,
                               reward_placement=placement)
        td = runner.run(lambda ids, mask: responses, batch)
        ref = batch.rollout(responses, tokenizer=tok, reward_fn="think_format,tag_count,accuracy",
                            eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, max_new_tokens=10,
                            reward_placement=placement)
        for key in (KEYS.prompt_tokens, KEYS.prompt_mask, KEYS.action, KEYS.mask, KEYS.reward, KEYS.done,
                    KEYS.terminated, KEYS.truncated, KEYS.score):
            assert torch.equal(td.get(key), ref.get(key)), key
        for name, value in ref.get(KEYS.reward_components).items():
            assert torch.equal(td.get((KEYS.reward_components, name)), value)
        assert torch.equal(td.get(KEYS.response_mask), td.get(KEYS.mask))
        assert td.get(KEYS.turns).tolist() == [1] * len(rows)
        ended = td.get(KEYS.terminated).squeeze(-1).any(1)
        assert td.get(KEYS.end_reason).tolist() == [0 if e else 1 for e in ended.tolist()]


def test_multi_turn_layout_masks_rewards_and_observation_tokens(tok):
    env = Echo(max_turns=3)
    batch = batch_of(tok, env.rows())
    gen = scripted(tok, [["cat", "cat", "cat"], ["dog", "no", "dog"], ["x", "sun", "sun"]])
    td = EpisodeRunner(env, tokenizer=tok, max_new_tokens=8, max_episode_tokens=200).run(gen, batch)
    obs = observation_ids(tok, [{"role": "user", "content": "again"}], [tok.eos_token_id])
    eos = tok.eos_token_id
    for b, words in enumerate([["cat"] * 3, ["dog", "no", "dog"], ["x", "sun", "sun"]]):
        turns = [tok(w, add_special_tokens=False)["input_ids"] + [eos] for w in words]
        expected = turns[0] + obs + turns[1] + obs + turns[2]
        agent = [True] * len(turns[0]) + [False] * len(obs) + [True] * len(turns[1]) + [False] * len(obs) + [True] * len(turns[2])
        n = len(expected)
        assert td.get(KEYS.action)[b, :n].tolist() == expected
        assert td.get(KEYS.mask)[b, :n].tolist() == agent and not td.get(KEYS.mask)[b, n:].any()
        assert td.get(KEYS.response_mask)[b].tolist() == [True] * n + [False] * (td.get(KEYS.action).shape[1] - n)
        # each turn's reward on its last agent token, nothing elsewhere
        ends = [len(turns[0]) - 1, len(turns[0]) + len(obs) + len(turns[1]) - 1, n - 1]
        reward = td.get(KEYS.reward)[b].squeeze(-1)
        paid = [float(w == Echo().rows()[b]["word"]) for w in words]
        assert reward[ends].tolist() == paid
        assert reward.sum().item() == sum(paid) == td.get(KEYS.score)[b].item()
        assert td.get(KEYS.done)[b].squeeze(-1).nonzero().flatten().tolist() == [n - 1]
        assert td.get(KEYS.truncated)[b, n - 1].item()  # max_turns: truncated, not terminated
    assert td.get(KEYS.end_reason).tolist() == [END_REASONS.index("max_turns")] * 3
    assert td.get(KEYS.turns).tolist() == [3, 3, 3]
    assert torch.equal(td.get((KEYS.reward_components, TURN_REWARDS)), td.get(KEYS.score))
    # the second turn's context is the prompt, the first turn as sampled and the observation
    first_turn = tok("cat", add_special_tokens=False)["input_ids"] + [eos]
    second = gen.calls["contexts"][3]
    assert second[-(len(first_turn) + len(obs)):] == first_turn + obs


def test_rows_end_at_different_turns_and_wait_for_nothing(tok):
    env = Echo(max_turns=4, finish_after=2)
    batch = batch_of(tok, env.rows())
    gen = scripted(tok, [["cat", "cat"], ["dog", "dog"], ["sun", "sun"]])
    td = EpisodeRunner(env, tokenizer=tok, max_new_tokens=8).run(gen, batch)
    assert td.get(KEYS.end_reason).tolist() == [0, 0, 0]
    assert td.get(KEYS.terminated).squeeze(-1).any(1).all()
    assert td.get(KEYS.turns).tolist() == [2, 2, 2]


def test_length_and_context_ends(tok):
    env = Echo(max_turns=3)
    env.answers_truncated_turns = False  # the opt-out: a cut turn ends the episode, unanswered
    batch = batch_of(tok, env.rows())
    # row 0's second turn has no EOS and runs to the cap: "length"
    long = "cat " * 10
    gen = scripted(tok, [["cat", long], ["dog", "dog", "dog"], ["sun", "sun", "sun"]],
                   eos=[[True, False], [True] * 3, [True] * 3], width=6)
    td = EpisodeRunner(env, tokenizer=tok, max_new_tokens=6, max_episode_tokens=200).run(gen, batch)
    assert td.get(KEYS.end_reason)[0].item() == END_REASONS.index("length")
    assert td.get(KEYS.truncated)[0].any()
    # a budget with room for one turn only: the observation is not appended
    gen = scripted(tok, [["cat"], ["dog"], ["sun"]])
    td = EpisodeRunner(env, tokenizer=tok, max_new_tokens=6, max_episode_tokens=8).run(gen, batch)
    assert td.get(KEYS.end_reason).tolist() == [END_REASONS.index("context")] * 3
    assert torch.equal(td.get(KEYS.mask), td.get(KEYS.response_mask))  # no observation in it


class Tool(Environment):
    """A turn ends at ``</tool>``; the tool answers; the next turn answers."""

    id = "tool"
    max_turns = 2
    stop_strings = ("</tool>",)

    def rows(self):
        return [{"prompt": "use the tool"}]

    def step(self, episode, completion):
        if completion.endswith("</tool>"):
            return Turn(observation=[{"role": "tool", "content": "42"}])
        return Turn(reward=float("42" in completion), done=True)


def test_a_stop_string_ends_the_turn_at_the_token_that_completes_it(tok):
    env = Tool()
    batch = batch_of(tok, env.rows())
    gen = scripted(tok, [["<tool>6*7</tool> and more words", "it is 42"]], eos=[[False, True]], width=30)
    td = EpisodeRunner(env, tokenizer=tok, max_new_tokens=30).run(gen, batch)
    first = tok("<tool>6*7</tool> and more words", add_special_tokens=False)["input_ids"]
    cut = next(i for i in range(1, len(first) + 1) if "</tool>" in tok.decode(first[:i]))
    assert td.get(KEYS.action)[0, :cut].tolist() == first[:cut]
    assert td.get(KEYS.mask)[0, :cut].all() and not td.get(KEYS.mask)[0, cut]
    assert td.get(KEYS.score).tolist() == [1.0]
    assert td.get(KEYS.end_reason).tolist() == [0]
    # the template closes the cut turn: the observation starts with EOS, an environment token
    assert td.get(KEYS.action)[0, cut].item() == tok.eos_token_id
    obs = observation_ids(tok, [{"role": "tool", "content": "42"}], [tok.eos_token_id])
    assert td.get(KEYS.action)[0, cut + 1 : cut + 1 + len(obs)].tolist() == obs


class Raises(Echo):
    def step(self, episode, completion):
        raise KeyError("boom")


def test_an_environment_that_raises_is_named_with_the_row(tok):
    env = Raises()
    batch = batch_of(tok, env.rows())
    with pytest.raises(EnvError, match=r"environment 'echo' raised in step\(\) on row 0 \(turn 1\): KeyError"):
        EpisodeRunner(env, tokenizer=tok, max_new_tokens=8).run(scripted(tok, [["a"], ["b"], ["c"]]), batch)



def test_a_template_that_drops_think_blocks_is_refused_before_any_episode(tok):
    import copy

    dropping = copy.deepcopy(tok)
    dropping.chat_template = (
        "{%- for message in messages -%}"
        "{%- set content = message['content'] -%}"
        "{%- if message['role'] == 'assistant' and '</think>' in content -%}"
        "{%- set content = content.split('</think>')[-1] -%}{%- endif -%}"
        "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' -}}"
        "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    )
    with pytest.raises(ValueError, match="environment 'echo' is multi-turn and the chat template is not append-only: "
                                         "it drops the <think> block"):
        EpisodeRunner(Echo(max_turns=2), tokenizer=dropping, max_new_tokens=16)
