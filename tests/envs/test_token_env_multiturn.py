"""TokenMDPEnv as the token-by-token specification of multi-turn episodes (docs/design.md,
"Multi-turn episodes"): scripted tokens through small environments defined here, the state,
agent mask, rewards and end reasons after every step, observation tokens equal to
``observation_ids``, agent tokens never re-tokenised, environment errors named, and every scripted
episode equal to the batched collector's (:class:`textrl.envs.collector.EpisodeRunner`)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from textrl.core import checks
from textrl.envs import EnvError, Environment, TokenMDPEnv, Turn, observation_ids
from textrl.envs import collector as collector_module
from textrl.envs.collector import EpisodeRunner
from textrl.envs.fast_path import default_tokenizer
from textrl.keys import END_REASONS, KEYS
from textrl.models import build_tiny_tokenizer

TOK = default_tokenizer()
EOS = TOK.eos_token_id
A, B, Z = 68, 69, 93  # "a", "b", "z": one token each in the tiny tokenizer
STOP = [54, 55, 50, 51]  # "S", "T", "O", "P"
AGAIN = [{"role": "user", "content": "again"}]


class Echo(Environment):
    """Say the row's word, then say it again: each turn pays 1 when the turn (after any
    ``</think>``) is the word; the ``done_after``-th answer ends the episode, the others answer
    with ``observation``."""

    id = "echo"
    max_observation_tokens = 16

    def __init__(self, max_turns: int = 3, done_after: int = 2, reward=None, observation="again",
                 stop_strings: tuple[str, ...] = ()) -> None:
        self.max_turns = max_turns
        self.done_after = done_after
        self.reward = reward
        self.observation = observation
        self.stop_strings = stop_strings
        self.calls: list[tuple[int, int, str]] = []

    def rows(self):
        return [{"prompt": "Say a, then again.", "word": "a"}, {"prompt": "Say b, then again.", "word": "b"}]

    def step(self, episode, completion):
        self.calls.append((episode.index, episode.turn, completion))
        said = completion.split("</think>")[-1].strip() == episode.row["word"]
        if episode.turn >= self.done_after:
            return Turn(reward=float(said), done=True)
        return Turn(reward=float(said), observation=self.observation)


def said(completion) -> str:
    """The agent's text of a completion: a string, or (TRL's conversational form, which a multi-turn
    episode gets) the assistant messages of a message list."""
    return completion if isinstance(completion, str) else "".join(
        m["content"] for m in completion if m["role"] == "assistant")


def count_a(prompts, completions, **kwargs):
    """Final reward: how many ``a`` the agent said over the episode."""
    return torch.tensor([float(said(c).count("a")) for c in completions])


def truncated_flag(prompts, completions, truncated, **kwargs):
    return truncated.float()


def feed(env: TokenMDPEnv, tokens, index: int = 0):
    """Reset on prompt ``index`` and step ``tokens``; every step's (obs, reward, terminated,
    truncated, info)."""
    env.reset(options={"prompt_index": index})
    return [env.step(t) for t in tokens]


def test_two_turn_episode_state_rewards_and_observation_tokens():
    env = TokenMDPEnv(env=Echo(reward=count_a), max_new_tokens=4)
    obs_ids = observation_ids(TOK, AGAIN, [EOS])
    assert env.max_episode_tokens == 3 * 4 + 2 * 16 and env.observation_space["response_ids"].shape == (44,)
    steps = feed(env, [A, EOS, B, EOS])
    # turn 1 ends at its EOS: reward 1 paid there, the observation appended in the same step
    obs, reward, term, trunc, info = steps[1]
    n = 2 + len(obs_ids)
    assert (reward, term, trunc, info) == (1.0, False, False, {"turn": 1, "turn_reward": 1.0})
    assert obs["response_ids"][:n].tolist() == [A, EOS, *obs_ids]
    assert obs["agent_mask"][:n].tolist() == [1, 1] + [0] * len(obs_ids)
    assert obs["response_length"] == n and (obs["response_ids"][n:] == TOK.pad_token_id).all()
    assert steps[0][1:] == (0.0, False, False, {})
    # turn 2 is wrong (0) and ends the episode: the final reward (one "a" said) on its last token
    obs, reward, term, trunc, info = steps[3]
    assert (reward, term, trunc) == (1.0, True, False)
    assert obs["agent_mask"][: n + 2].tolist() == [1, 1] + [0] * len(obs_ids) + [1, 1]
    assert info["end_reason"] == "done" and info["turns"] == 2
    expected = np.zeros(env.max_episode_tokens, dtype=np.float32)
    expected[1], expected[n + 1] = 1.0, 0.0 + 1.0
    assert np.array_equal(info["per_token_rewards"], expected)
    assert info["score"] == 2.0 and info["reward_components"] == {"turn_rewards": 1.0, "count_a": 1.0}
    assert info["response"] == "ab" and info["response_length"] == n + 2
    assert [m["role"] for m in info["messages"]] == ["user", "assistant", "user", "assistant"]
    assert [m["content"] for m in info["messages"][1:]] == ["a", "again", "b"]
    assert sum(s[1] for s in steps) == info["score"]


def test_max_turns_ends_without_an_observation():
    echo = Echo(max_turns=2, done_after=99)
    env = TokenMDPEnv(env=echo, max_new_tokens=4)
    steps = feed(env, [A, EOS, A, EOS], index=0)
    obs, reward, term, trunc, info = steps[-1]
    assert (reward, term, trunc, info["end_reason"], info["turns"]) == (1.0, False, True, "max_turns", 2)
    assert obs["response_length"] == 4 + len(observation_ids(TOK, AGAIN, [EOS]))  # nothing after turn 2
    assert echo.calls == [(0, 1, "a"), (0, 2, "a")]
    assert info["reward_components"] == {"turn_rewards": 2.0}  # no final reward: turns alone


def test_length_cap_ends_the_episode_unanswered_and_scored_truncated_with_the_opt_out():
    echo = Echo(reward=truncated_flag)
    echo.answers_truncated_turns = False  # else the cut turn is answered (tests/envs/test_truncated_turns.py)
    env = TokenMDPEnv(env=echo, max_new_tokens=3)
    steps = feed(env, [A, EOS, Z, Z, Z])
    obs, reward, term, trunc, info = steps[-1]
    assert (term, trunc, info["end_reason"], info["turns"]) == (False, True, "length", 2)
    assert echo.calls == [(0, 1, "a")]  # the cut turn is not passed to step
    answered = Echo(reward=truncated_flag)  # by default it is: the echo's second answer ends the episode
    steps = feed(TokenMDPEnv(env=answered, max_new_tokens=3), [A, EOS, Z, Z, Z])
    assert steps[-1][2:4] == (True, False) and answered.calls == [(0, 1, "a"), (0, 2, "zzz")]
    assert reward == 1.0 and info["reward_components"]["truncated_flag"] == 1.0
    assert info["per_token_rewards"][obs["response_length"] - 1] == 1.0  # final reward on the last token


def test_context_budget_refuses_an_observation_and_cuts_a_turn():
    obs_len = len(observation_ids(TOK, AGAIN, [EOS]))
    # no room for one more agent token after the observation: not appended, "context"
    env = TokenMDPEnv(env=Echo(), max_new_tokens=4, max_episode_tokens=2 + obs_len)
    obs, reward, term, trunc, info = feed(env, [A, EOS])[-1]
    assert (reward, trunc, info["end_reason"], obs["response_length"]) == (1.0, True, "context", 2)
    # room for two: the next turn is cut after two tokens by the budget
    env = TokenMDPEnv(env=Echo(), max_new_tokens=4, max_episode_tokens=2 + obs_len + 2)
    steps = feed(env, [A, EOS, Z, Z])
    obs, reward, term, trunc, info = steps[-1]
    assert (trunc, info["end_reason"], info["turns"], obs["response_length"]) == (True, "context", 2, 4 + obs_len)
    assert obs["agent_mask"].sum() == 4


def test_stop_string_ends_the_turn_at_the_token_completing_it():
    echo = Echo(stop_strings=("STOP",))
    env = TokenMDPEnv(env=echo, max_new_tokens=8)
    turn = [A, *STOP]
    steps = feed(env, [*turn, B, EOS])
    # a reference loop: the first prefix of the turn whose decoded text holds the stop string
    end = next(i for i in range(1, len(turn) + 1) if "STOP" in TOK.decode(turn[:i], skip_special_tokens=True))
    assert end == len(turn)
    assert all(s[4] == {} for s in steps[: end - 1]) and steps[end - 1][4]["turn"] == 1
    assert echo.calls[0] == (0, 1, "aSTOP")
    obs = steps[end - 1][0]
    assert obs["response_ids"][:end].tolist() == turn  # the stop string's tokens are the agent's
    # the template's EOS closes the cut turn (an environment token), then the observation
    assert obs["response_ids"][end : obs["response_length"]].tolist() == [EOS, *observation_ids(TOK, AGAIN, [EOS])]
    assert obs["agent_mask"][end : obs["response_length"]].tolist() == [0] * (obs["response_length"] - end)
    assert steps[-1][4]["end_reason"] == "done"


def test_agent_tokens_are_kept_and_are_what_the_template_renders():
    # the tiny template is append-only: the state after a turn with a <think> block is, token for
    # token, the template's rendering of the conversation (the sampled tokens, never re-tokenised)
    env = TokenMDPEnv(tokenizer=TOK, env=Echo(done_after=2), max_new_tokens=8)
    think = TOK.convert_tokens_to_ids(["<think>", "</think>"])
    turn = [think[0], Z, think[1], A, EOS]
    obs, *_ = feed(env, turn)[-1]
    n = obs["response_length"]
    assert obs["response_ids"][: len(turn)].tolist() == turn  # the sampled tokens, <think> kept
    assert obs["response_ids"][len(turn) : n].tolist() == observation_ids(TOK, AGAIN, [EOS])
    state = obs["prompt_ids"][obs["prompt_mask"] == 1].tolist() + obs["response_ids"][:n].tolist()
    rendered = TOK.apply_chat_template(env._state.episode.messages, tokenize=False, add_generation_prompt=True)
    assert "<think>" in rendered and TOK(rendered, add_special_tokens=False)["input_ids"] == state


def test_a_template_that_drops_think_blocks_is_refused():
    tok = build_tiny_tokenizer()
    # a Qwen3-style template: earlier assistant turns lose their <think> block when re-rendered
    tok.chat_template = (
        "{%- for m in messages -%}{%- set c = m['content'] -%}"
        "{%- if m['role'] == 'assistant' and not loop.last -%}{%- set c = c.split('</think>')[-1] -%}{%- endif -%}"
        "{{- '<|im_start|>' + m['role'] + '\n' + c + '<|im_end|>\n' -}}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
    )
    with pytest.raises(ValueError, match="environment 'echo' is multi-turn and the chat template is not append-only"):
        TokenMDPEnv(tokenizer=tok, env=Echo(done_after=2), max_new_tokens=8)
    TokenMDPEnv(tokenizer=tok, env=Echo(max_turns=1), max_new_tokens=8)  # one turn: no history to re-render


class Broken(Echo):
    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where

    def start(self, episode):
        if self.where == "start":
            raise KeyError("no secret")

    def step(self, episode, completion):
        if self.where == "step":
            raise RuntimeError("game over")
        return Turn(reward="high") if self.where == "reward" else super().step(episode, completion)


def test_an_environment_that_raises_is_named_with_its_row():
    env = TokenMDPEnv(env=Broken("step"))
    env.reset(options={"prompt_index": 1})
    with pytest.raises(EnvError, match=r"environment 'echo' raised in step\(\) on row 1 \(turn 1\): RuntimeError: game over"):
        env.step(EOS)
    with pytest.raises(EnvError, match=r"environment 'echo' raised in start\(\) on row 0: KeyError"):
        TokenMDPEnv(env=Broken("start")).reset(options={"prompt_index": 0})
    env = TokenMDPEnv(env=Broken("reward"))
    env.reset(options={"prompt_index": 0})
    with pytest.raises(EnvError, match=r"step\(\) on row 0 \(turn 1\) gave Turn.reward='high' \(str\): a turn reward must be a float"):
        env.step(EOS)


def test_a_reward_replaces_the_final_reward_of_a_copy():
    echo = Echo(reward=count_a)
    env = TokenMDPEnv(env=echo, reward=truncated_flag, max_new_tokens=4)
    assert echo.reward is count_a and env.task.reward is truncated_flag and env.task is not echo
    assert feed(env, [A, EOS, A, EOS])[-1][4]["reward_components"] == {"turn_rewards": 2.0, "truncated_flag": 0.0}


def test_bad_arguments_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="unknown environment 'no_such_env'"):
        TokenMDPEnv(env="no_such_env")
    with pytest.raises(ValueError, match="max_turns=0 must be an int >= 1"):
        TokenMDPEnv(env=Echo(max_turns=0))
    with pytest.raises(ValueError, match="max_episode_steps=0"):
        TokenMDPEnv(max_episode_steps=0)


def test_an_environment_id_is_made_by_the_registry():
    from textrl.envs.registry import ENVS, register_env

    register_env("echo-token-env-test", overwrite=True)(Echo)
    try:
        env = TokenMDPEnv(env="echo-token-env-test", max_new_tokens=4)
        assert isinstance(env.task, Echo) and env.spec.kwargs["env"] == "echo-token-env-test"
        assert feed(env, [A, EOS])[-1][1] == 1.0
    finally:
        del ENVS["echo-token-env-test"]


def test_single_turn_prompt_task_equals_no_environment():
    from textrl.envs import PromptTask

    rows = [{"prompt": "hi", "answer": "1"}, {"prompt": "2+2?", "answer": "4"}]
    plain = TokenMDPEnv(prompts=rows, reward="think_format", max_new_tokens=4)
    task = TokenMDPEnv(env=PromptTask(rows, "think_format"), max_new_tokens=4)
    for tokens in ([508, 509, EOS], [5, 6, 7, 8], [EOS]):
        a, b = feed(plain, tokens, 1), feed(task, tokens, 1)
        for (oa, *ra, ia), (ob, *rb, ib) in zip(a, b):
            assert all(np.array_equal(oa[k], ob[k]) for k in oa) and ra == rb
            assert ia.keys() == ib.keys() and all(np.array_equal(ia[k], ib[k]) for k in ia)
        assert a[-1][4]["end_reason"] == ("done" if tokens[-1] == EOS else "length")


# -- the batched collector runs the same episodes ------------------------------------------------


@pytest.fixture
def gapped_rollouts(monkeypatch):
    """The collector checks its rollout with textrl.core.checks.check_rollout; until that accepts agent
    masks with gaps (``check_agent_mask``), the check is left out here."""
    if not hasattr(checks, "check_agent_mask"):
        monkeypatch.setattr(collector_module, "check_rollout", lambda td, *args, **kwargs: td)


def effective_turns(script: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """What ``generate`` returns for each turn: the scripted tokens, then ``z`` to the cap."""
    return [(t + [Z] * max_new_tokens)[:max_new_tokens] for t in script]


def run_token_env(env: TokenMDPEnv, index: int, turns: list[list[int]]):
    """Step ``env`` through ``turns`` (each turn from its start until the env ends it): the final
    observation, info and every step's reward."""
    env.reset(options={"prompt_index": index})
    k = j = 0
    rewards = []
    while True:
        obs, reward, terminated, truncated, info = env.step(turns[k][j])
        rewards.append(reward)
        if terminated or truncated:
            return obs, info, rewards
        k, j = (k + 1, 0) if "turn" in info else (k, j + 1)


def run_collector(env: TokenMDPEnv, index: int, turns: list[list[int]]):
    runner = EpisodeRunner(env.task, tokenizer=TOK, max_new_tokens=env.max_new_tokens,
                           max_episode_tokens=env.max_episode_tokens, reward_placement=env.reward_placement)
    calls = iter(turns)
    ids = torch.from_numpy(env.prompts.ids(index)).unsqueeze(0)
    batch = SimpleNamespace(input_ids=ids, attention_mask=torch.ones_like(ids, dtype=torch.bool),
                            rows=[env.prompts.row(index)], prompt_index=torch.tensor([index]))
    return runner.run(lambda input_ids, mask: torch.tensor([next(calls)]), batch)[0]


ENDINGS = {"eos": [EOS], "stop": STOP, "stop+eos": [*STOP, EOS], "none": []}
TURNS = st.builds(lambda body, end: body + ENDINGS[end], st.lists(st.sampled_from([A, B, Z, EOS, *STOP]), max_size=3),
                  st.sampled_from(["eos", "eos", "eos", "stop", "stop+eos", "none"]))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(
    max_turns=st.integers(1, 3), done_after=st.integers(1, 4), stop=st.booleans(), final=st.booleans(),
    max_new_tokens=st.integers(3, 7), budget=st.one_of(st.none(), st.integers(2, 60)),
    placement=st.sampled_from(["last", "uniform"]), index=st.integers(0, 1),
    script=st.lists(TURNS, min_size=3, max_size=3),
)
def test_stepping_equals_the_batched_collector(gapped_rollouts, max_turns, done_after, stop, final, max_new_tokens,
                                               budget, placement, index, script):
    echo = Echo(max_turns=max_turns, done_after=done_after, reward=count_a if final else None,
                stop_strings=("STOP",) if stop else ())
    env = TokenMDPEnv(env=echo, max_new_tokens=max_new_tokens, max_episode_tokens=budget, reward_placement=placement)
    turns = effective_turns(script, max_new_tokens)
    obs, info, rewards = run_token_env(env, index, turns)
    event(f"{info['end_reason']}, {info['turns']} turn(s)")
    row = run_collector(env, index, turns)
    n = int(obs["response_length"])
    assert row[KEYS.action].tolist() == obs["response_ids"][:n].tolist()
    assert row[KEYS.mask].tolist() == obs["agent_mask"][:n].astype(bool).tolist()
    assert row[KEYS.response_mask].all() and row[KEYS.action].shape == (n,)
    assert row[KEYS.reward].squeeze(-1).tolist() == info["per_token_rewards"][:n].tolist()
    assert not info["per_token_rewards"][n:].any()
    assert END_REASONS[int(row[KEYS.end_reason])] == info["end_reason"]
    assert int(row[KEYS.turns]) == info["turns"]
    assert float(row[KEYS.score]) == pytest.approx(info["score"], abs=1e-6)
    assert {k: float(v) for k, v in row[KEYS.reward_components].items()} == info["reward_components"]
    last = int(np.nonzero(obs["agent_mask"])[0].max())
    assert bool(row[KEYS.done][last]) and bool(row[KEYS.terminated][last]) == (info["end_reason"] == "done")
    assert sum(rewards) == pytest.approx(info["score"], abs=1e-5)  # the step rewards pay the score


def encode(text: str) -> list[int]:
    return TOK(text, add_special_tokens=False)["input_ids"]


BUILTIN_SCRIPTS = {
    "calculator": [
        ["<tool>{expression}</tool> and more", "<answer>{answer}</answer>", ""],  # tool, then the answer
        ["<answer>{answer}</answer>", "", ""],  # answers at once
        ["let me think", "<tool>2 +</tool>", "<answer>1</answer>"],  # no tool call, a bad one, wrong
        ["<tool>{expression}", "</tool>", "x" * 30],  # a turn cut by the length cap
    ],
    "guess_number": [["4", "2", "1", "3"], ["{secret}", "", "", ""], ["9", "x", "5", "5"]],
}


@pytest.mark.parametrize("env_id", sorted(BUILTIN_SCRIPTS))
def test_builtin_environments_equal_the_batched_collector(env_id):
    env = TokenMDPEnv(env=env_id, max_new_tokens=24, max_prompt_length=128)
    for index, script in enumerate(BUILTIN_SCRIPTS[env_id]):
        row = env.prompts.row(index)
        texts = [t.format(**row) for t in script]
        turns = effective_turns([encode(t) + ([EOS] if "</tool>" not in t else []) for t in texts], 24)
        obs, info, _ = run_token_env(env, index, turns)
        ref = run_collector(env, index, turns)
        n = int(obs["response_length"])
        assert ref[KEYS.action].tolist() == obs["response_ids"][:n].tolist(), (env_id, index)
        assert ref[KEYS.mask].tolist() == obs["agent_mask"][:n].astype(bool).tolist()
        assert ref[KEYS.reward].squeeze(-1).tolist() == info["per_token_rewards"][:n].tolist()
        assert (END_REASONS[int(ref[KEYS.end_reason])], int(ref[KEYS.turns])) == (info["end_reason"], info["turns"])
    assert info["turns"] >= 2  # the scripts reach the environment's observations
