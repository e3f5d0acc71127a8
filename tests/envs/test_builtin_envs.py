"""The built-in environments (textrl.envs.builtin), played at text level with scripted policies."""

from __future__ import annotations

import re
from collections import Counter

import pytest

import textrl.envs.builtin as builtin
from textrl.envs.builtin import (
    FORMAT_MAX_REWARD,
    FORMAT_REWARD,
    HIGHER,
    INVALID,
    LOWER,
    parse_guess,
    parse_integer,
    parse_tool_call,
)
from textrl.envs.environment import Environment, Episode, Turn
from textrl.envs.observations import observation_ids
from textrl.envs.registry import ENVS, env_ids, make_env
from textrl.envs.tasks import WARMUP_THINK, format_completion
from textrl.envs.tasks import warmup_examples as digits_warmup
from textrl.models import build_tiny_tokenizer
from textrl.rewards import check_reward_spec, parse_reward_spec
from textrl.run.warmup import encode_sft_example

BUILTIN_IDS = sorted(i for i, ctor in ENVS.items() if getattr(ctor, "__module__", "").startswith(builtin.__name__ + "."))
SEEDED = [i for i in BUILTIN_IDS if i != "reward_model"]
SPLIT = ["arithmetic", "calculator", "guess_number"]
"""The environments with a held-out split of their own."""


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


# -- a text-level episode runner ---------------------------------------------------------------


def play(env: Environment, row: dict, policy) -> tuple[float, list[Turn], Episode]:
    """Run one episode as the collector would at text level: ``policy(episode) -> completion``
    per agent turn, ``env.step`` answers, observations are appended, and the final ``reward``
    spec (if any) scores the last turn. Returns (episode reward, turns, episode)."""
    episode = Episode(row=row, messages=[{"role": "user", "content": row["prompt"]}], prompt_messages=1)
    env.start(episode)
    turns = []
    for turn in range(1, env.max_turns + 1):
        episode.turn = turn
        completion = policy(episode)
        answer = env.step(episode, completion)
        turns.append(answer)
        episode.messages.append({"role": "assistant", "content": completion})
        if answer.done:
            break
        episode.messages += answer.messages()
    total = sum(t.reward for t in turns)
    if env.reward is not None:
        final = parse_reward_spec(env.reward)
        total += float(final([row["prompt"]], [episode.messages[-1]["content"]], answer=[row.get("answer")])[0])
    return total, turns, episode


def perfect(env: Environment):
    """A policy that plays each built-in task perfectly."""
    if env.id in ("digits", "arithmetic"):
        return lambda ep: format_completion(WARMUP_THINK, ep.row["answer"])
    if env.id == "calculator":
        def calculate(ep):
            if ep.turn == 1:
                return f"<tool>{ep.row['expression']}</tool>"
            return f"<answer>{ep.messages[-1]['content']}</answer>"
        return calculate
    if env.id == "guess_number":
        return binary_search(env.max_n)
    raise AssertionError(env.id)


def bad(env: Environment):
    """A policy that plays badly: wrong answers, no tool, always the same guess."""
    if env.id in ("digits", "arithmetic"):
        return lambda ep: format_completion(WARMUP_THINK, str(int(ep.row["answer"]) + 1))
    if env.id == "calculator":
        return lambda ep: "<answer>0</answer>"
    if env.id == "guess_number":
        return lambda ep: "<answer>1</answer>"
    raise AssertionError(env.id)


def binary_search(max_n: int):
    def guess(ep):
        low, high = 1, max_n
        said = [m["content"] for m in ep.completions if m["role"] == "user"]
        guesses = [parse_guess(m["content"]) for m in ep.completions if m["role"] == "assistant"]
        for g, s in zip(guesses, said):
            low, high = (max(low, g + 1), high) if s == HIGHER else (low, min(high, g - 1))
        return f"<answer>{(low + high) // 2}</answer>"
    return guess


# -- registry, construction, rows --------------------------------------------------------------


def test_the_builtins_are_registered():
    assert BUILTIN_IDS == ["arithmetic", "calculator", "digits", "guess_number", "reward_model"]
    assert set(BUILTIN_IDS) <= set(env_ids())


@pytest.mark.parametrize("env_id", BUILTIN_IDS)
def test_builds_with_no_arguments(env_id):
    env = make_env(env_id)
    assert isinstance(env, Environment) and env.id == env_id
    assert env.description and "\n" not in env.description
    assert env.max_turns >= 1
    assert env.max_reward is None or env.max_reward > 0
    assert env.describe().startswith(env.description)
    rows = env.rows()
    assert rows and all(isinstance(r["prompt"], str) and r["prompt"].strip() for r in rows)
    assert type(env).__doc__ and "Row" in type(env).__doc__ and "Reward" in type(env).__doc__


@pytest.mark.parametrize("env_id", BUILTIN_IDS)
def test_rows_are_deterministic(env_id):
    first, second = make_env(env_id), make_env(env_id)
    assert first.rows() == second.rows()
    assert first.eval_rows() == second.eval_rows()
    rows = first.rows()
    rows[0]["prompt"] = "changed"
    assert first.rows() == second.rows(), "rows() must hand out copies"


@pytest.mark.parametrize("env_id", SEEDED)
def test_the_seed_changes_the_rows(env_id):
    assert make_env(env_id, seed=1).rows() != make_env(env_id).rows()


@pytest.mark.parametrize("env_id", SPLIT)
def test_train_and_eval_rows_are_disjoint(env_id):
    env = make_env(env_id)
    train, held_out = env.rows(), env.eval_rows()
    assert held_out
    key = (lambda r: r["instance"]) if env_id == "guess_number" else (lambda r: r["prompt"])
    assert not {key(r) for r in train} & {key(r) for r in held_out}
    assert len({key(r) for r in train}) == len(train), "rows are distinct instances"


@pytest.mark.parametrize("env_id", ["digits", "reward_model"])
def test_without_a_split_of_their_own(env_id):
    assert make_env(env_id).eval_rows() is None


def test_settings_reach_the_constructor():
    env = make_env("guess_number", max_n=16, max_turns=5, n_rows=32, n_eval=16)
    assert env.max_n == 16 and env.max_turns == 5
    assert all(r["prompt"] == "Guess my number from 1 to 16." for r in env.rows())
    assert Counter(r["secret"] for r in env.rows()) == Counter({s: 2 for s in range(1, 17)})
    assert Counter(r["secret"] for r in env.eval_rows()) == Counter({s: 1 for s in range(1, 17)})
    assert len(make_env("arithmetic", n_rows=10, n_eval=5).rows()) == 10
    assert len(make_env("calculator", digits=2, n_rows=20, n_eval=0).rows()) == 20
    assert make_env("calculator", n_eval=0).eval_rows() is None


@pytest.mark.parametrize(
    ("env_id", "settings", "message"),
    [
        ("guess_number", {"max_n": 1}, "max_n=1"),
        ("guess_number", {"turn_cost": 0.5}, "turn_cost=0.5"),
        ("guess_number", {"answer_accuracy": 1.5}, "answer_accuracy=1.5"),
        ("arithmetic", {"ops": "+/"}, "ops='+/'"),
        ("arithmetic", {"n_rows": 500}, "n_rows=500 and n_eval=40 do not fit its 200 distinct"),
        ("arithmetic", {"n_eval": 300}, "n_rows=-100 and n_eval=300 do not fit"),
        ("calculator", {"max_turns": 0}, "max_turns=0"),
        ("calculator", {"digits": 0}, "digits=0"),
        ("calculator", {"observation_role": ""}, "observation_role"),
        ("digits", {"n_rows": 0}, "n_rows=0"),
        ("reward_model", {"path": "a,b"}, "path='a,b'"),
    ],
)
def test_bad_settings_name_the_setting(env_id, settings, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make_env(env_id, **settings)


def test_unknown_setting_is_refused():
    with pytest.raises(ValueError, match="does not take the settings .*max_m.*its settings: max_n"):
        make_env("guess_number", max_m=16)


# -- rewards: perfect play reaches max_reward, bad play does not -------------------------------


@pytest.mark.parametrize("env_id", SEEDED)
def test_perfect_play_reaches_max_reward_and_bad_play_does_not(env_id):
    env = make_env(env_id)
    rows = (env.eval_rows() or env.rows())[:64]
    good = [play(env, row, perfect(env))[0] for row in rows]
    poor = [play(env, row, bad(env))[0] for row in rows]
    assert good == pytest.approx([env.max_reward] * len(rows))
    assert max(poor) <= env.max_reward and sum(poor) / len(poor) < env.max_reward - 0.5


def test_format_max_reward_is_the_sum_of_the_rules_maxima():
    reward = parse_reward_spec(FORMAT_REWARD)
    total, raw = reward.components(["q"], [format_completion("x", "7")], answer=["7"])
    assert {k: v.item() for k, v in raw.items()} == {"think_format": 0.5, "tag_count": 1.0, "accuracy": 1.0}
    assert total.item() == FORMAT_MAX_REWARD


# -- warm-up -----------------------------------------------------------------------------------


@pytest.mark.parametrize("env_id", BUILTIN_IDS)
def test_warmup_pairs_are_well_formed(env_id, tokenizer):
    env = make_env(env_id)
    pairs = env.warmup_examples(env.rows(), 0)
    assert pairs and pairs == env.warmup_examples(env.rows(), 0)
    assert pairs != env.warmup_examples(env.rows(), 1)
    for prompt, completion in pairs:
        assert isinstance(completion, str) and completion.strip()
        if isinstance(prompt, list):
            assert all(set(m) == {"role", "content"} and isinstance(m["content"], str) for m in prompt)
            assert prompt[0]["role"] == "user" and prompt[-1]["role"] != "assistant"
        else:
            assert isinstance(prompt, str) and prompt.strip()
        ids, n_prompt = encode_sft_example(tokenizer, prompt, completion)
        assert 0 < n_prompt < len(ids) <= 160


def test_digits_is_the_embedded_default_task():
    from textrl.envs.prompts import load_prompts

    env = make_env("digits")
    assert env.rows() == [dict(r) for r in load_prompts("builtin:digits")]
    assert env.reward == "think_format,tag_count,accuracy" and env.max_reward == 2.5
    assert env.warmup_examples(env.rows(), 3) == digits_warmup(env.rows(), 3, answer_accuracy=0.3)
    assert env.warmup_examples(env.rows(), 3, answer_accuracy=1.0) == digits_warmup(env.rows(), 3, answer_accuracy=1.0)


@pytest.mark.parametrize("env_id", ["digits", "arithmetic"])
def test_format_warmup_scores_max_reward_when_right(env_id):
    env = make_env(env_id)
    rows = env.rows()
    reward = parse_reward_spec(env.reward)
    for accuracy in (0.0, 0.3, 1.0):
        pairs = env.warmup_examples(rows, 0, answer_accuracy=accuracy)
        scores = reward([p for p, _ in pairs], [c for _, c in pairs], answer=[r["answer"] for r in rows]).tolist()
        right = [s == env.max_reward for s in scores]
        assert all(s in (env.max_reward, env.max_reward - 1.0) for s in scores), "the format is always perfect"
        if accuracy == 1.0:
            assert all(right)
        else:  # mostly random: right about accuracy + (1 - accuracy) / number of answers of the time
            choices = 10 if env_id == "digits" else len(env.answers())
            expected = accuracy + (1 - accuracy) / choices
            assert abs(sum(right) / len(right) - expected) < 0.1


def test_arithmetic_rows_hold_their_answer():
    env = make_env("arithmetic", ops="+-*", max_operand=12, n_rows=300, n_eval=50)
    for row in env.rows() + env.eval_rows():
        a, op, b = row["a"], row["op"], row["b"]
        assert row["prompt"] == f"What is {a} {op} {b}?"
        assert int(row["answer"]) == {"+": a + b, "-": a - b, "*": a * b}[op]
        assert row["answer"] in env.answers()


def test_guess_warmup_replays_the_game():
    """Every warm-up conversation is a game the environment would play: the feedback after each
    guess is the environment's, a game stops at the right guess or after max_turns, and the
    share of guesses consistent with the feedback follows answer_accuracy."""
    env = make_env("guess_number")
    rows = env.rows()
    for accuracy in (0.0, 1.0):
        pairs = env.warmup_examples(rows, 0, answer_accuracy=accuracy)
        games = []
        for prompt, completion in pairs:
            if isinstance(prompt, str):
                games.append([])
            games[-1].append((prompt, completion))
        assert len(games) == len(rows)
        consistent = total = 0
        for row, game in zip(rows, games):
            assert 1 <= len(game) <= env.max_turns
            _, turns, episode = play(env, row, _replay([c for _, c in game]))
            assert len(turns) == len(game)
            for k, (prompt, _) in enumerate(game):
                expected = episode.messages[: 1 + 2 * k]
                assert (prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]) == expected
            low, high = 1, env.max_n
            for turn in turns:
                guess = turn.info["guess"]
                total += 1
                consistent += low <= guess <= high
                if turn.info["feedback"] == HIGHER:
                    low = max(low, guess + 1)
                elif turn.info["feedback"] == LOWER:
                    high = min(high, guess - 1)
            assert turns[-1].done
        if accuracy == 1.0:
            assert consistent == total
        else:
            assert consistent < total


def _replay(completions):
    return lambda ep: completions[ep.turn - 1]


def test_guess_warmup_is_random_play_not_the_strategy():
    env = make_env("guess_number")
    pairs = env.warmup_examples(env.rows(), 0, answer_accuracy=0.0)
    first = Counter(parse_guess(c) for p, c in pairs if isinstance(p, str))
    assert set(first) == set(range(1, env.max_n + 1))
    assert max(first.values()) < 2 * len(env.rows()) / env.max_n, "first guesses are uniform, not a fixed opening"


def test_calculator_warmup_replays_the_tool(tokenizer):
    env = make_env("calculator")
    rows = env.rows()[:50]
    pairs = env.warmup_examples(rows, 0, answer_accuracy=1.0)
    assert len(pairs) == 2 * len(rows)
    for row, (call, answer) in zip(rows, zip(pairs[::2], pairs[1::2])):
        assert call[0] == row["prompt"] and call[1] == f"<tool>{builtin.compact(row['expression'])}</tool>"
        reward, turns, episode = play(env, row, _replay([call[1], answer[1]]))
        assert answer[0] == episode.messages[:3]
        assert reward == 1.0 and turns[-1].done
    mostly_wrong = env.warmup_examples(rows, 0, answer_accuracy=0.0)
    assert sum(play(env, r, _replay([c[1], a[1]]))[0] for r, c, a in zip(rows, mostly_wrong[::2], mostly_wrong[1::2])) <= 2


# -- guess_number dynamics ---------------------------------------------------------------------


def _episode(env, secret=5):
    episode = Episode(row={"prompt": env.prompt, "secret": secret}, messages=[{"role": "user", "content": env.prompt}],
                      prompt_messages=1)
    env.start(episode)
    return episode


def _step(env, episode, completion):
    episode.turn += 1
    return env.step(episode, completion)


def test_guess_feedback_and_success():
    env = make_env("guess_number")
    episode = _episode(env, secret=5)
    assert episode.state == {"secret": 5}
    low = _step(env, episode, "<answer>2</answer>")
    assert (low.observation, low.done, low.reward, low.info["solved"]) == (HIGHER, False, 0.0, False)
    assert low.messages() == [{"role": "user", "content": "higher"}]
    high = _step(env, episode, "<answer>7</answer>")
    assert (high.observation, high.done, high.reward) == (LOWER, False, 0.0)
    win = _step(env, episode, "<answer>5</answer>")
    assert (win.done, win.reward, win.info["solved"], win.observation) == (True, 1.0, True, None)


def test_guess_formats():
    env = make_env("guess_number")
    assert _step(env, _episode(env, 3), " 3 ").done, "a bare integer is a guess"
    assert _step(env, _episode(env, 3), "<answer>\n3\n</answer>").done
    assert _step(env, _episode(env, 3), "<think>\nmaybe\n</think>\n<answer>3</answer>").done
    out_of_range = _step(env, _episode(env, 3), "<answer>12</answer>")
    assert out_of_range.observation == LOWER, "a guess outside the range gets true feedback"
    for unreadable in ("<answer>three</answer>", "", "I guess 3", "<answer>3.5</answer>", "<answer></answer>"):
        turn = _step(env, _episode(env, 3), unreadable)
        assert (turn.observation, turn.done, turn.reward, turn.info["guess"]) == (INVALID, False, 0.0, None)


def test_guess_episode_ends_after_max_turns():
    env = make_env("guess_number", max_turns=3)
    episode = _episode(env, secret=8)
    assert not _step(env, episode, "<answer>1</answer>").done
    assert not _step(env, episode, "nonsense").done, "an unreadable guess uses up a turn"
    last = _step(env, episode, "<answer>2</answer>")
    assert (last.done, last.reward, last.info["solved"], last.observation) == (True, 0.0, False, None)


def test_guess_turn_cost():
    env = make_env("guess_number", turn_cost=0.1)
    episode = _episode(env, secret=4)
    _step(env, episode, "<answer>1</answer>")
    _step(env, episode, "<answer>2</answer>")
    assert _step(env, episode, "<answer>4</answer>").reward == pytest.approx(0.8)
    assert [env.win_reward(t) for t in (1, 4)] == pytest.approx([1.0, 0.7])


def test_guess_start_needs_a_secret_in_range():
    env = make_env("guess_number")
    for row in ({"prompt": "x"}, {"prompt": "x", "secret": 9}, {"prompt": "x", "secret": "3"}):
        with pytest.raises(ValueError, match="secret"):
            env.start(Episode(row=row, messages=[]))


def test_guess_success_rates_of_reference_strategies():
    """The room PPO has: binary search wins every game, a constant guess 1/max_n of them."""
    env = make_env("guess_number")
    rows = env.eval_rows()
    assert sum(play(env, r, binary_search(env.max_n))[0] for r in rows) == len(rows)
    assert sum(play(env, r, lambda ep: "<answer>4</answer>")[0] for r in rows) == len(rows) / env.max_n


def test_guess_tokens_are_few(tokenizer):
    """Short observations and prompts keep episodes cheap for the tiny model."""
    eos = [tokenizer.eos_token_id]
    sizes = {said: len(observation_ids(tokenizer, [{"role": "user", "content": said}], eos))
             for said in (HIGHER, LOWER, INVALID)}
    assert sizes[HIGHER] <= 14 and sizes[LOWER] <= 14 and sizes[INVALID] <= 20, sizes
    assert len(tokenizer(builtin.guess_completion(5), add_special_tokens=False)["input_ids"]) == 3


# -- calculator dynamics -----------------------------------------------------------------------

ROW = {"prompt": "What is 123 * 456?", "answer": "56088", "expression": "123 * 456"}


def _calc(env=None):
    env = env or make_env("calculator")
    episode = Episode(row=dict(ROW), messages=[{"role": "user", "content": ROW["prompt"]}], prompt_messages=1)
    env.start(episode)
    return env, episode


def test_calculator_tool_loop():
    env, episode = _calc()
    call = _step(env, episode, "<tool>123*456</tool>")
    assert (call.done, call.reward) == (False, 0.0)
    assert call.messages() == [{"role": "tool", "content": "56088"}]
    assert call.info == {"tool": "123*456", "result": "56088"}
    answer = _step(env, episode, "<answer>56088</answer>")
    assert (answer.done, answer.reward, answer.info["correct"]) == (True, 1.0, True)


@pytest.mark.parametrize(
    ("completion", "reward"),
    [("<answer>56088</answer>", 1.0), ("<answer>56,088</answer>", 0.0), ("<answer> 56088 </answer>", 1.0),
     ("<answer>56089</answer>", 0.0), ("<answer>123*456</answer>", 0.0), ("<answer></answer>", 0.0)],
)
def test_calculator_answers(completion, reward):
    env, episode = _calc()
    turn = _step(env, episode, completion)
    assert turn.done and turn.reward == reward


@pytest.mark.parametrize(
    ("completion", "error"),
    [
        ("<tool>123*456", "unclosed <tool>"),
        ("<tool></tool>", "empty <tool></tool>"),
        ("<tool>   </tool>", "empty <tool></tool>"),
        ("123*456</tool>", "</tool> without <tool>"),
        ("<tool>abc</tool>", "unexpected character 'a'"),
        ("<tool>1/0</tool>", "division by zero"),
        ("<tool>9**9**9</tool>", "exponent too large"),
        ("<tool>(((1)</tool>", "missing ')'"),
        ("<tool><tool>1</tool>", "unexpected character '<'"),
        ("<tool>" + "1" * 5000 + "</tool>", "too long"),
    ],
)
def test_calculator_malformed_calls_get_an_error_observation(completion, error):
    env, episode = _calc()
    turn = _step(env, episode, completion)
    assert not turn.done and turn.reward == 0.0
    [message] = turn.messages()
    assert message["role"] == "tool" and message["content"].startswith("error: ") and error in message["content"]


def test_calculator_turn_without_call_or_answer():
    env, episode = _calc()
    turn = _step(env, episode, "I think it is large.")
    assert not turn.done and turn.reward == 0.0
    assert turn.messages()[0]["role"] == "user" and "<tool>EXPR</tool>" in turn.observation


def test_calculator_last_turn_without_answer_ends_unanswered():
    env, episode = _calc()
    for _ in range(env.max_turns - 1):
        assert not _step(env, episode, "<tool>1+1</tool>").done
    last = _step(env, episode, "<tool>1+1</tool>")
    assert (last.done, last.reward, last.info["correct"]) == (True, 0.0, False)


def test_calculator_observation_role_setting():
    env, episode = _calc(make_env("calculator", observation_role="user"))
    assert _step(env, episode, "<tool>2*3</tool>").messages() == [{"role": "user", "content": "6"}]


def test_calculator_tool_shows_fractions_as_decimals():
    env, episode = _calc()
    assert _step(env, episode, "<tool>1/3</tool>").messages()[0]["content"] == "0.333333"


def test_tiny_template_renders_the_tool_role(tokenizer):
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<tool>2*3</tool>"},
                {"role": "tool", "content": "6"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>tool\n6<|im_end|>\n<|im_start|>assistant\n")
    ids = observation_ids(tokenizer, messages[2:], [tokenizer.eos_token_id])
    assert tokenizer.decode(ids) == "\n<|im_start|>tool\n6<|im_end|>\n<|im_start|>assistant\n"


def test_calculator_rows_are_products():
    env = make_env("calculator")
    assert env.stop_strings == ("</tool>",) and env.max_turns == 3 and env.max_reward == 1.0
    for row in env.rows() + env.eval_rows():
        a, b = (int(x) for x in row["expression"].split(" * "))
        assert 100 <= a <= 999 and 100 <= b <= 999 and int(row["answer"]) == a * b
        assert row["prompt"].startswith(f"What is {a} * {b}?")


def test_parsers():
    assert parse_tool_call("think first <tool> 2 + 2 </tool>") == ("2 + 2", None)
    assert parse_tool_call("no call") == (None, None)
    assert parse_integer("+12") == 12 and parse_integer("1 2") is None and parse_integer(None) is None
    assert parse_guess("<answer>-3</answer>") == -3
    assert builtin.run_tool("2**-2") == "0.25"


# -- reward_model ------------------------------------------------------------------------------


def test_reward_model_env_is_the_pipelines_task():
    from textrl.envs.synthetic import BUILTIN_PROMPTS, case_sft_pairs

    env = make_env("reward_model")
    assert env.rows() == BUILTIN_PROMPTS["case"]()
    assert env.reward.split(",")[0] == "reward_model:tiny"
    assert env.reward.endswith("synthetic.py:case_follow_reward:0")
    check_reward_spec(env.reward)
    assert env.max_reward is None and env.max_turns == 1
    pairs = env.warmup_examples(env.rows(), 2)
    assert pairs == [(r["prompt"], r["response"]) for r in case_sft_pairs(1024, follow_rate=0.5, seed=2)]


def test_reward_model_env_settings(tmp_path):
    env = make_env("reward_model", path=str(tmp_path), monitor=False)
    assert env.reward == f"reward_model:{tmp_path}"
    other = make_env("reward_model", prompts=["Say hi.", {"prompt": "Say bye."}])
    assert other.reward == "reward_model:tiny"
    assert [r["prompt"] for r in other.rows()] == ["Say hi.", "Say bye."]
    assert other.warmup_examples(other.rows(), 0) is None


@pytest.mark.slow
def test_reward_model_env_scores_with_the_tiny_reward_model():
    env = make_env("reward_model")
    rows = env.rows()[:4]
    total, raw = parse_reward_spec(env.reward).components(
        [r["prompt"] for r in rows], ["THE SEA IS CALM."] * 4
    )
    assert total.shape == (4,) and set(raw) == {"reward_model", "case_follow_reward"}
    assert raw["case_follow_reward"].tolist() == [float(r["style"] == "capital") for r in rows]


# -- warm-up conversations are the token sequences a rollout shows ------------------------------


@pytest.mark.parametrize("env_id", ["guess_number", "calculator"])
def test_warmup_conversations_tokenise_as_a_rollout(env_id, tokenizer):
    """A later-turn warm-up prompt, rendered whole, is token for token what the collector builds:
    the first prompt, then each agent turn's tokens + EOS and the observation tokenised after it
    (``observation_ids``); so the warm-up teaches exactly the states the agent will see."""
    env = make_env(env_id)
    eos = tokenizer.eos_token_id
    later = [(p, c) for p, c in env.warmup_examples(env.rows()[:40], 0) if isinstance(p, list)]
    assert later
    for prompt, completion in later:
        ids, n_prompt = encode_sft_example(tokenizer, prompt, completion)
        first, n_first = encode_sft_example(tokenizer, prompt[0]["content"], completion)
        rollout = first[:n_first]
        for agent, observation in zip(prompt[1::2], prompt[2::2]):
            rollout += tokenizer(agent["content"], add_special_tokens=False)["input_ids"] + [eos]
            rollout += observation_ids(tokenizer, [observation], [eos])
        assert ids[:n_prompt] == rollout


def test_doctests_pass():
    import doctest
    import importlib
    import pkgutil

    results = [doctest.testmod(importlib.import_module(f"{builtin.__name__}.{m.name}"))
               for m in pkgutil.iter_modules(builtin.__path__)]
    assert sum(r.attempted for r in results) > 0 and all(r.failed == 0 for r in results)
