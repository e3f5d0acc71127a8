"""The run's lengths (textrl/envs/lengths.py): max_prompt_length left unset is the longest prompt of the
environment, bounded by the context minus max_new_tokens; the episode budget is bounded to the
context; explicit values work as before, an explicit budget past the context names
--max-episode-tokens; and `textrl train` records what ran (lengths, warm-up) and writes the turns
of multi-turn samples apart."""

from __future__ import annotations

import json

import pytest

from tests.runs import SMALL
from textrl.cli import main
from textrl.envs.environment import Environment, PromptTask, Turn
from textrl.envs.lengths import longest_prompt, resolve_lengths
from textrl.envs.prompts import load_prompts
from textrl.envs.prompts.encoding import _encode_rows


class Words(Environment):
    id = "words"
    max_turns = 3

    def __init__(self, sizes=(2, 30, 5)):
        self.sizes = sizes

    def rows(self):
        return [{"prompt": " ".join(["word"] * n)} for n in self.sizes]

    def step(self, episode, completion):
        return Turn(observation="again") if episode.turn < self.max_turns else Turn(done=True)


def lengths_of(tok, rows):
    return [len(ids) for ids in _encode_rows(load_prompts(rows), tok, range(len(rows)))[1]]


def test_auto_is_the_longest_prompt_with_the_default_budget(tok):
    env = Words()
    got = resolve_lengths(env, [env.rows()], tok, max_new_tokens=8, max_prompt_length=None,
                          max_episode_tokens=None, context=512)
    assert got.max_prompt_length == max(lengths_of(tok, env.rows())) and got.truncate == "left"
    assert got.max_episode_tokens == 3 * 8 + 2 * 32 and got.notes == []


def test_auto_is_bounded_by_the_context_and_says_so(tok):
    env = Words()
    longest = max(lengths_of(tok, env.rows()))
    got = resolve_lengths(env, [env.rows()], tok, max_new_tokens=8, max_prompt_length=None,
                          max_episode_tokens=None, context=longest + 4, model="m")
    assert got.max_prompt_length == longest - 4 and got.truncated_rows == 1
    assert got.max_episode_tokens == 8  # what is left after the bounded prompts: one turn
    assert got.notes[0].startswith(f"max_prompt_length: the longest prompt of 'words' is list[1], {longest} tokens")
    assert "bounded to" in got.notes[0] and "left-truncated" in got.notes[0]
    assert got.notes[1].startswith("max_episode_tokens: the default budget of 'words' (3 turn(s)")


def test_an_explicit_max_prompt_length_is_kept_and_refuses(tok):
    env = Words()
    got = resolve_lengths(env, [env.rows()], tok, max_new_tokens=8, max_prompt_length=100,
                          max_episode_tokens=40, context=512)
    assert (got.max_prompt_length, got.max_episode_tokens, got.truncate) == (100, 40, "error")


def test_an_explicit_budget_past_the_context_names_its_own_option(tok):
    env = Words()
    longest = max(lengths_of(tok, env.rows()))
    with pytest.raises(ValueError, match=rf"^max_episode_tokens=1536: prompts of {longest} tokens plus the episode "
                                         rf"budget reach {longest + 1536} positions, .*lower --max-episode-tokens to "
                                         rf"{512 - longest}"):
        resolve_lengths(env, [env.rows()], tok, max_new_tokens=24, max_prompt_length=None,
                        max_episode_tokens=1536, context=512)
    with pytest.raises(ValueError, match=r"max_new_tokens=600 leaves no room .*lower --max-new-tokens below 512"):
        resolve_lengths(env, [env.rows()], tok, max_new_tokens=600, max_prompt_length=None,
                        max_episode_tokens=None, context=512)


def test_prompts_that_alone_fill_the_context_name_the_prompt_length_not_max_new_tokens(tok):
    """An explicit max_prompt_length whose prompts alone pass the context: lowering max_new_tokens
    cannot help, so the message names the prompt length (it once said 'leave -983 of the 512
    positions ... or --max-new-tokens to 1')."""
    rows = [{"prompt": "word " * 300}]
    env = PromptTask(rows, "think_format")
    longest = max(lengths_of(tok, rows))
    assert longest > 64
    with pytest.raises(ValueError, match=rf"^max_prompt_length=2000: prompts of {longest} tokens alone pass the 64 "
                                         rf"positions of model .*lower --max-prompt-length to at most 56 \(or leave "
                                         rf"it unset"):
        resolve_lengths(env, [rows], tok, max_new_tokens=8, max_prompt_length=2000, max_episode_tokens=None,
                        context=64)


def test_a_large_source_is_sampled_with_a_margin(tok):
    rows = [{"prompt": "word " * (1 + i % 7)} for i in range(300)]
    found, measured = longest_prompt([rows], tok, exact_rows=100, sample_rows=50)
    assert found.sampled and found.measured == 50 == len(measured)
    env = Words()
    got = resolve_lengths(env, [rows], tok, max_new_tokens=4, max_prompt_length=None, max_episode_tokens=None,
                          context=None)
    assert got.max_prompt_length == max(lengths_of(tok, rows))  # 300 rows: measured exactly


ENV_FILE = '''
from textrl.envs import Environment, Turn


class Chat(Environment):
    """Three turns, no warm-up examples; a long prompt (over the old default of 64 tokens)."""
    id = "chat"
    max_turns = 3
    reward = None

    def rows(self):
        return [{"prompt": "Please reply. " + " ".join(["word"] * (60 + i))} for i in range(20)]

    def step(self, episode, completion):
        if episode.turn < self.max_turns:
            return Turn(reward=0.1, observation="Say more.")
        return Turn(reward=1.0, done=True)
'''


def test_train_records_the_lengths_and_warmup_that_ran_and_writes_turns_apart(tmp_path, capsys):
    path = tmp_path / "chat_env.py"
    path.write_text(ENV_FILE)
    out = tmp_path / "run"
    args = [a for a in SMALL]
    assert main(["train", *args, "--iterations", "1", "--env", f"{path}:Chat", "--warmup-sft-steps", "7",
                 "--output-dir", str(out)]) == 0
    printed = capsys.readouterr().out
    assert ("warm-up: none (environment 'chat' has no warm-up examples (its warmup_examples() gives none); "
            "warmup_sft_steps=7 asked, 0 steps ran)") in printed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["warmup"] == {"asked_steps": 7, "ran_steps": 0, "reason":
                                 "environment 'chat' has no warm-up examples (its warmup_examples() gives none)"}
    assert "warmup_sft_steps: 7" in (out / "config.yaml").read_text()  # the asked value, as given
    lengths = summary["lengths"]
    assert lengths["max_prompt_length"] > 64 and lengths["source"]["max_prompt_length"] == "auto"
    assert lengths["max_episode_tokens"] == 3 * 8 + 2 * 32
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    for sample in samples:
        roles = [t["role"] for t in sample["turns"]]
        assert roles[0] == "agent" and set(roles) <= {"agent", "environment"}
        assert all(a != b for a, b in zip(roles, roles[1:]))  # stretches alternate
        assert "".join(t["text"] for t in sample["turns"]) == sample["completion"]
    assert any("Say more." in t["text"] for s in samples for t in s["turns"] if t["role"] == "environment")
