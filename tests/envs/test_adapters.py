"""The adapters (textrl/envs/adapters/) and the math_verify reward (textrl/rewards/math_verify.py).

Offline: reasoning-gym and TextArena generate their tasks locally. A suite that is not installed
skips its tests with the reason; the missing-package messages are tested by hiding the package.
Peers: each adapter is held equal to the suite used by hand (the same items, the same first
observation, the task's own scorer on the same entries); the episodes run at text level through
``start``/``step`` and through the real collector with scripted turns.
"""

from __future__ import annotations

import doctest
import importlib.util
import random
import re
import subprocess
import sys
import threading
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import textrl.envs.adapters as adapters
from textrl.envs.adapters import (
    EMPTY_OBSERVATION,
    REASONING_GYM_SLOW_SETUP,
    REASONING_GYM_TASKS,
    REASONING_GYM_VERIFIER_TASKS,
    TEXTARENA_DEFAULT_MAX_TURNS,
    TEXTARENA_GAMES,
    TEXTARENA_SLOW_SETUP,
    ReasoningGymEnv,
    TextArenaEnv,
    game_max_turns,
    observation_text,
    task_answer,
)
from textrl.envs.collector import EpisodeRunner
from textrl.envs.environment import Episode
from textrl.envs.prompts import encode_prompts
from textrl.envs.prompts.rows import batch_fields, raw_prompts
from textrl.envs.registry import make_env, split_rows
from textrl.keys import END_REASONS, KEYS
from textrl.rewards import call_reward
from textrl.rewards.math_verify import math_verify_reward

needs_rg = pytest.mark.skipif(importlib.util.find_spec("reasoning_gym") is None,
                              reason="reasoning-gym is not installed (pip install 'textrl[reasoning-gym]')")
needs_ta = pytest.mark.skipif(importlib.util.find_spec("textarena") is None,
                              reason="textarena is not installed (pip install 'textrl[textarena]')")
needs_mv = pytest.mark.skipif(importlib.util.find_spec("math_verify") is None,
                              reason="math-verify is not installed (pip install 'textrl[math]')")


def scripted(tok, turns_per_row):
    """generate() playing ``turns_per_row[b][k]`` (+ EOS) as row ``b``'s ``k``-th turn."""
    calls = [0] * len(turns_per_row)

    def generate(input_ids, attention_mask):
        running = [b for b, turns in enumerate(turns_per_row) if calls[b] < len(turns)][: input_ids.shape[0]]
        rows = []
        for b in running:
            rows.append(tok(turns_per_row[b][calls[b]], add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
            calls[b] += 1
        out = torch.full((len(rows), max(map(len, rows))), tok.pad_token_id, dtype=torch.long)
        for i, r in enumerate(rows):
            out[i, : len(r)] = torch.tensor(r)
        return out

    return generate


@pytest.mark.parametrize("module", [adapters.reasoning_gym, adapters.textarena, sys.modules["textrl.rewards.math_verify"]],
                         ids=lambda m: m.__name__)
def test_doctests_pass(module):
    if module.__name__ == "textrl.rewards.math_verify" and importlib.util.find_spec("math_verify") is None:
        pytest.skip("math-verify is not installed (pip install 'textrl[math]')")
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


# -- reasoning-gym ---------------------------------------------------------------------------------


def test_task_answer_reads_the_first_answer_block_else_the_whole_completion():
    assert task_answer("<think>\nx\n</think>\n<answer>\n 12 \n</answer><answer>13</answer>") == "12"
    assert task_answer("  12\n") == "12"
    assert task_answer("<answer>12") == "<answer>12"  # no complete block: the whole completion


@needs_rg
def test_reasoning_gym_rows_are_the_tasks_items_and_the_held_out_split_is_disjoint():
    import reasoning_gym

    env = make_env("reasoning_gym:basic_arithmetic", size=12, seed=3, eval_size=5)
    assert isinstance(env, ReasoningGymEnv) and env.id == "reasoning_gym:basic_arithmetic"
    assert env.max_turns == 1 and env.max_reward == 1.0
    ref = reasoning_gym.create_dataset("basic_arithmetic", size=12, seed=3)
    rows = env.rows()
    assert [r["prompt"] for r in rows] == [ref[i]["question"] for i in range(12)]
    assert [r["answer"] for r in rows] == [ref[i]["answer"] for i in range(12)]
    assert [r["metadata"] for r in rows] == [ref[i]["metadata"] for i in range(12)]
    held = env.eval_rows()
    assert len(held) == 5 and not {r["prompt"] for r in held} & {r["prompt"] for r in rows}
    again = ReasoningGymEnv("basic_arithmetic", size=12, seed=3, eval_size=5)
    assert again.rows() == rows and again.eval_rows() == held
    other = ReasoningGymEnv("basic_arithmetic", size=12, seed=4, eval_size=5)
    assert [r["prompt"] for r in other.rows()] != [r["prompt"] for r in rows]
    # the trainer's split takes the environment's own held-out rows
    train, evaluation = split_rows(env, 3, seed=0)
    assert len(train) == 12 and [r["prompt"] for r in evaluation] == [r["prompt"] for r in held[:3]]


@needs_rg
def test_held_out_questions_that_repeat_a_training_question_are_skipped():
    import reasoning_gym

    config = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1, operators=("+",))  # ~1000 questions
    env = ReasoningGymEnv("basic_arithmetic", size=40, seed=0, eval_size=10, **config)
    train = {r["prompt"] for r in env.rows()}
    raw = reasoning_gym.create_dataset("basic_arithmetic", size=40, seed=40, **config)
    assert {raw[i]["question"] for i in range(40)} & train  # without the filter the splits would share
    held = [r["prompt"] for r in env.eval_rows()]
    assert len(held) == len(set(held)) == 10 and not set(held) & train
    with pytest.raises(ValueError, match="lower eval_size"):
        ReasoningGymEnv("basic_arithmetic", size=40, seed=0, eval_size=1500, **config).eval_rows()


@needs_rg
def test_reasoning_gym_reward_is_the_tasks_scorer_through_the_batch_fields():
    env = ReasoningGymEnv("basic_arithmetic", size=6, seed=1, eval_size=0)
    assert env.eval_rows() is None
    rows = split_rows(env, 2, seed=0)[0]  # as the trainer loads them (validated copies)
    right = [f"<think>\nok\n</think>\n<answer>\n{r['answer']}\n</answer>" for r in rows]
    plain = [f"{r['answer']}\n" for r in rows]
    wrong = [f"<answer>{int(r['answer']) + 1}</answer>" for r in rows]
    for completions, expected in ((right, 1.0), (plain, 1.0)):
        score = call_reward(env.reward, raw_prompts(rows), completions, **batch_fields(rows))
        assert score.dtype == torch.float32 and score.tolist() == [expected] * len(rows)
    score = call_reward(env.reward, raw_prompts(rows), wrong, **batch_fields(rows))
    peer = [env.dataset.score_answer(answer=task_answer(c), entry={"question": r["prompt"], "answer": r["answer"],
                                                                    "metadata": r["metadata"]})
            for c, r in zip(wrong, rows)]
    assert score.tolist() == pytest.approx(peer) and max(peer) < 1.0
    with pytest.raises(ValueError, match="metadata"):
        env.reward(["q"], ["1"], answer=["1"])


@needs_rg
def test_a_scorer_that_raises_on_a_malformed_answer_scores_zero():
    env = ReasoningGymEnv("prime_factorization", size=3, seed=0, eval_size=0)
    rows = env.rows()
    with pytest.raises(ValueError):  # the task's own scorer raises on text
        env.dataset.score_answer(answer="not a number", entry=rows[0])
    completions = [f"<answer>{r['answer']}</answer>" for r in rows] + ["<answer>not a number</answer>"]
    fields = batch_fields(rows + rows[:1])
    assert env.reward(raw_prompts(rows + rows[:1]), completions, **fields).tolist() == [1.0, 1.0, 1.0, 0.0]


def _oracle_check(task, n):
    env = ReasoningGymEnv(task, size=n, seed=11, eval_size=0)
    rows = env.rows()
    fields = batch_fields(rows)
    garbage = env.reward(raw_prompts(rows), ["<answer>zzz not it</answer>"] * n, **fields)
    assert (garbage < 1.0).all(), task
    if task in REASONING_GYM_VERIFIER_TASKS:
        assert all(r["answer"] is None for r in rows)
        return
    right = env.reward(raw_prompts(rows), [f"<answer>\n{r['answer']}\n</answer>" for r in rows], **fields)
    assert right.tolist() == [1.0] * n, task


FAST_TASKS = ("basic_arithmetic", "chain_sum", "gcd", "letter_counting", "spell_backward", "word_sorting",
              "fraction_simplification", "count_bits", "rush_hour", "graph_color")


@needs_rg
@pytest.mark.parametrize("task", FAST_TASKS)
def test_listed_tasks_give_their_own_answer_the_max_reward(task):
    assert task in REASONING_GYM_TASKS + REASONING_GYM_VERIFIER_TASKS
    _oracle_check(task, 4)


@needs_rg
@pytest.mark.slow
def test_every_listed_task_works_offline_and_scores_its_own_answer_one():
    for task in REASONING_GYM_TASKS + REASONING_GYM_VERIFIER_TASKS:
        _oracle_check(task, 2)


@needs_rg
def test_a_task_with_few_distinct_questions_keeps_the_held_out_ones_it_has_by_default():
    env = make_env("reasoning_gym:coin_flip")  # textrl train --env reasoning_gym:coin_flip failed here
    held = env.eval_rows()
    assert 0 < len(held) < 50 and not {r["prompt"] for r in held} & {r["prompt"] for r in env.rows()}
    with pytest.raises(ValueError, match=r"only \d+ of 264 held-out items .* lower eval_size=50"):
        make_env("reasoning_gym:coin_flip", eval_size=50).eval_rows()


@needs_rg
def test_reasoning_gym_settings_errors_name_the_culprit():
    with pytest.raises(ValueError, match="did you mean 'basic_arithmetic'"):
        make_env("reasoning_gym:basic_arithmetik")
    with pytest.raises(ValueError, match=r"rejects the settings \{'max_termz': 3\}.*max_terms"):
        make_env("reasoning_gym:basic_arithmetic", max_termz=3)
    with pytest.raises(ValueError, match="size=0 must be an int >= 1"):
        make_env("reasoning_gym:basic_arithmetic", size=0)


@needs_rg
def test_a_system_prompt_makes_message_rows_whose_prompt_text_is_the_question():
    env = ReasoningGymEnv("basic_arithmetic", size=2, seed=0, eval_size=0, system_prompt="Answer in <answer> tags.")
    plain = ReasoningGymEnv("basic_arithmetic", size=2, seed=0, eval_size=0)
    rows = env.rows()
    assert rows[0]["messages"] == [{"role": "system", "content": "Answer in <answer> tags."},
                                   {"role": "user", "content": plain.rows()[0]["prompt"]}]
    assert raw_prompts(rows) == raw_prompts(plain.rows())


@needs_rg
def test_reasoning_gym_through_the_collector(tok):
    env = ReasoningGymEnv("basic_arithmetic", size=4, seed=2, eval_size=0, min_terms=2, max_terms=2, max_digits=2)
    rows = env.rows()
    batch = encode_prompts(rows, tok)[0]
    turns = [[f"<answer>{r['answer']}</answer>"] if b % 2 == 0 else ["<answer>no</answer>"] for b, r in enumerate(rows)]
    td = EpisodeRunner(env, tokenizer=tok, max_new_tokens=32).run(scripted(tok, turns), batch)
    assert td.get(KEYS.score).tolist() == [1.0, 0.0, 1.0, 0.0]
    assert td.get(KEYS.turns).tolist() == [1] * 4


# -- math_verify -----------------------------------------------------------------------------------


@needs_mv
def test_math_verify_accepts_equivalent_forms_and_rejects_others():
    completions = ["<answer>0.5</answer>", "<answer>\\frac{1}{2}</answer>", "<answer>1/2</answer>",
                   "So it is $\\frac{1}{2}$.", "<think>\n0.5?\n</think>\n<answer>\n0.4\n</answer>",
                   "<answer>1+x</answer>", "no answer here"]
    refs = ["1/2", "1/2", "0.5", "\\frac{1}{2}", "1/2", "x+1", "1/2"]
    score = call_reward(math_verify_reward, ["q"] * 7, completions, answer=refs)
    assert score.dtype == torch.float32 and score.shape == (7,)
    assert score.tolist() == [1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="needs the batch field 'answer'"):
        math_verify_reward(["q"], ["1"])
    with pytest.raises(ValueError, match="None in rows \\[1\\]"):
        math_verify_reward(["q", "q"], ["1", "2"], answer=["1", None])


@needs_mv
@settings(max_examples=30, deadline=None)
@given(st.integers(-50, 50), st.integers(1, 12), st.integers(-50, 50), st.integers(1, 12))
def test_math_verify_agrees_with_exact_fractions(p, q, r, s):
    """1.0 exactly when p/q == r/s (closed form: Fraction), whatever form the answer takes."""
    expected = float(Fraction(p, q) == Fraction(r, s))
    forms = [f"<answer>\\frac{{{r}}}{{{s}}}</answer>", f"<answer>{r}/{s}</answer>"]
    score = math_verify_reward(["q"] * 2, forms, answer=[f"{p}/{q}"] * 2)
    assert score.tolist() == [expected, expected]


@needs_mv
def test_math_verify_runs_outside_the_main_thread():
    out = {}
    worker = threading.Thread(target=lambda: out.update(s=math_verify_reward(["q"], ["<answer>0.5</answer>"], answer=["1/2"])))
    worker.start()
    worker.join()
    assert out["s"].tolist() == [1.0]


@needs_mv
@needs_rg
def test_math_verify_scores_the_arithmetic_tasks_rows():
    for task in ("basic_arithmetic", "fraction_simplification", "decimal_arithmetic"):
        rows = ReasoningGymEnv(task, size=4, seed=5, eval_size=0).rows()
        right = math_verify_reward(raw_prompts(rows), [f"<answer>{r['answer']}</answer>" for r in rows],
                                   **batch_fields(rows))
        assert right.tolist() == [1.0] * 4, task


@needs_mv
def test_math_verify_is_registered_by_name():
    from textrl.rewards import REWARDS, get_reward

    if "math_verify" not in REWARDS:
        pytest.skip("textrl/rewards/registry.py does not register math_verify yet (an import and one tuple entry)")
    assert get_reward("math_verify")(["q"], ["<answer>0.5</answer>"], answer=["1/2"]).tolist() == [1.0]


# -- TextArena -------------------------------------------------------------------------------------


def _first_observation(game, seed):
    """The peer: the game made and reset by hand, its first messages read under its wrappers."""
    import textarena as ta

    env = ta.make(game)
    env.reset(num_players=1, seed=seed)
    while isinstance(env, ta.Wrapper):
        env = env.env
    return "\n".join(m[1] for m in env.get_observation()[1] if m[2] != ta.ObservationType.PLAYER_ACTION)


def _episode(env, row):
    episode = Episode(row=row, messages=[{"role": "user", "content": row["prompt"]}], prompt_messages=1)
    env.start(episode)
    return episode


def _play(env, episode, completion):
    episode.turn += 1
    episode.messages.append({"role": "assistant", "content": completion})
    turn = env.step(episode, completion)
    if not turn.done:
        episode.messages += turn.messages()
    return turn


def _guess_the_number(env, row, lo=1, hi=20):
    """Binary search driven by the game's 'higher'/'lower' observations: the turns and rewards."""
    episode = _episode(env, row)
    played = []
    while True:
        guess = (lo + hi) // 2
        turn = _play(env, episode, f"My guess is [{guess}].")
        played.append((f"My guess is [{guess}].", turn))
        if turn.done:
            return played
        assert turn.reward == 0.0
        if "higher" in turn.observation:
            lo = guess + 1
        else:
            assert "lower" in turn.observation
            hi = guess - 1


@needs_ta
def test_textarena_rows_are_the_games_first_observations_with_disjoint_seeds():
    env = make_env("textarena:Minesweeper-v0-small", size=4, seed=10, eval_size=3)
    assert isinstance(env, TextArenaEnv) and env.id == "textarena:Minesweeper-v0-small"
    rows, held = env.rows(), env.eval_rows()
    assert [r["seed"] for r in rows] == [10, 11, 12, 13] and [r["seed"] for r in held] == [14, 15, 16]
    assert [r["prompt"] for r in rows + held] == [_first_observation("Minesweeper-v0-small", s) for s in range(10, 17)]
    assert {r["game"] for r in rows} == {"Minesweeper-v0-small"}
    train, evaluation = split_rows(env, 32, seed=0)
    assert len(train) == 4 and [r["seed"] for r in evaluation] == [14, 15, 16]


@needs_ta
def test_a_guess_the_number_episode_played_at_text_level_wins_with_binary_search():
    env = make_env("textarena:GuessTheNumber-v0", size=6, seed=0, eval_size=0)
    assert env.max_turns == 20 and env.max_reward == 1.0  # 10 guesses, one invalid move allowed per guess
    outer = random.getstate()
    for row in env.rows():
        played = _guess_the_number(env, row)
        assert random.getstate() == outer  # the games never touch the caller's global random
        last = played[-1][1]
        assert last.done and last.reward == 1.0 and "Congratulations" in last.info["reason"]
        assert len(played) <= 5  # log2(20) guesses
    with pytest.raises(ValueError, match="no int 'seed'"):
        env.start(Episode(row={"prompt": "x"}, messages=[]))
    with pytest.raises(ValueError, match="another observation"):
        env.start(Episode(row={**env.rows()[0], "prompt": "a different prompt"}, messages=[]))


@needs_ta
def test_a_losing_episode_pays_less_than_a_win():
    env = TextArenaEnv("GuessTheNumber-v0", size=1, seed=0, eval_size=0)
    episode = _episode(env, env.rows()[0])
    first = _play(env, episode, "hello")  # no [number]: an invalid move, allowed once
    assert not first.done and "invalid move" in first.observation
    second = _play(env, episode, "hello again")
    assert second.done and second.reward < 1.0 and "Invalid Move" in second.info["reason"]


@needs_ta
def test_each_game_keeps_its_own_random_state_when_episodes_interleave():
    """2048 draws a new tile from ``random`` after each move: an episode plays the same alone or
    interleaved with others."""
    env = TextArenaEnv("2048-v0", size=2, seed=3, eval_size=0)
    assert env.max_turns == TEXTARENA_DEFAULT_MAX_TURNS
    moves = ["[up]", "[left]", "[down]", "[right]", "[up]", "[left]"]

    def alone(row):
        episode = _episode(env, row)
        return [_play(env, episode, m).observation for m in moves]

    solo = [alone(row) for row in env.rows()]
    episodes = [_episode(env, row) for row in env.rows()]
    random.seed(123)  # the caller's own draws in between change nothing
    mixed = [[], []]
    for m in moves:
        for b in (1, 0):
            mixed[b].append(_play(env, episodes[b], m).observation)
            random.random()
    assert mixed == solo and solo[0] != solo[1]


@needs_rg
def test_a_task_slow_to_set_up_defaults_to_fewer_rows(monkeypatch):
    monkeypatch.setitem(REASONING_GYM_SLOW_SETUP, "leg_counting", (7, 3))
    env = ReasoningGymEnv("leg_counting")
    assert (env.size, env.eval_size) == (7, 3) and len(env.rows()) == 7 and len(env.eval_rows()) == 3
    given = ReasoningGymEnv("leg_counting", size=5, eval_size=0)
    assert (given.size, given.eval_size, ReasoningGymEnv("basic_arithmetic").size) == (5, 0, 500)
    assert set(REASONING_GYM_SLOW_SETUP) <= set(REASONING_GYM_TASKS)


def test_the_environments_doc_states_the_slow_tasks_sizes():
    doc = " ".join((Path(__file__).resolve().parents[2] / "docs" / "environments.md").read_text().split())
    for task, (size, eval_size) in REASONING_GYM_SLOW_SETUP.items():
        assert re.search(rf"{task}( and \w+)* {size} and {eval_size}\b", doc), task


@needs_ta
def test_a_game_slow_to_set_up_defaults_to_fewer_rows(monkeypatch):
    monkeypatch.setitem(TEXTARENA_SLOW_SETUP, "GuessTheNumber-v0", (3, 2))
    env = TextArenaEnv("GuessTheNumber-v0")
    assert (env.size, env.eval_size) == (3, 2) and len(env.rows()) == 3 and len(env.eval_rows()) == 2
    assert (TextArenaEnv("GuessTheNumber-v0", size=5, eval_size=0).size, TextArenaEnv("Blackjack-v0").size) == (5, 256)
    assert set(TEXTARENA_SLOW_SETUP) <= set(TEXTARENA_GAMES)


@needs_ta
@pytest.mark.parametrize("game", ["2048-v0", "RushHour-v0", "Blackjack-v0"])
def test_an_episode_plays_a_copy_of_the_rows_game_as_a_fresh_reset_would(game):
    """start() copies the game each row was built with (a RushHour reset takes up to a second):
    the episode plays as on a game reset with the row's seed, the kept game stays unplayed."""
    moves = ["[up]", "[A+1]", "[hit]", "[left]", "[stand]", "[down]"]

    def play(env, row):
        episode = _episode(env, row)
        seen = []
        for m in moves:
            turn = _play(env, episode, m)
            seen.append((turn.observation, turn.reward, turn.done))
            if turn.done:
                break
        return seen

    kept = TextArenaEnv(game, size=2, seed=7, eval_size=0)
    fresh = TextArenaEnv(game, size=2, seed=7, eval_size=0)  # never builds rows: each start resets the game
    rows = kept.rows()
    assert set(kept._games) == {7, 8}
    copied = [play(kept, row) for row in rows] + [play(kept, row) for row in rows]  # twice: the kept game is unplayed
    reset = [play(fresh, row) for row in rows]
    assert not fresh._games and copied == reset + reset


@needs_ta
def test_guess_the_number_through_the_collector_matches_the_text_level_episodes(tok):
    env = TextArenaEnv("GuessTheNumber-v0", size=3, seed=5, eval_size=0)
    rows = env.rows()
    scripts = [[c for c, _ in _guess_the_number(env, row)] for row in rows]
    scripts[2] = ["hello", "hello"]  # a row that loses by two invalid moves
    batch = encode_prompts(rows, tok)[0]
    td = EpisodeRunner(env, tokenizer=tok, max_new_tokens=16, max_episode_tokens=4000).run(scripted(tok, scripts), batch)
    assert td.get(KEYS.turns).tolist() == [len(s) for s in scripts]
    assert td.get(KEYS.end_reason).tolist() == [END_REASONS.index("done")] * 3
    assert td.get(KEYS.score).tolist() == [1.0, 1.0, 0.0]


@needs_ta
def test_max_turns_setting_and_the_games_own_limit():
    assert TextArenaEnv("GuessTheNumber-v0", size=1, eval_size=0, max_turns=4).max_turns == 4
    assert TextArenaEnv("TowerOfHanoi-v0", size=1, eval_size=0).max_turns == 28  # 14 moves, one error each

    class State:
        max_turns, error_allowance = 7, 2

    assert game_max_turns(State()) == 21 and game_max_turns(object()) == TEXTARENA_DEFAULT_MAX_TURNS


@needs_ta
def test_textarena_errors_name_the_culprit():
    with pytest.raises(ValueError, match="did you mean 'GuessTheNumber-v0'"):
        make_env("textarena:GuessTheNumbr-v0")
    with pytest.raises(ValueError, match="cannot be set up for one player.*has to be 2.*GuessTheNumber-v0"):
        make_env("textarena:TicTacToe-v0")  # its reset refuses one player
    with pytest.raises(ValueError, match="game for several players.*GuessTheNumber-v0"):
        make_env("textarena:QuantumTicTacToe-v0")  # its reset takes one player, its state is for two
    with pytest.raises(ValueError, match="max_turns=0"):
        make_env("textarena:GuessTheNumber-v0", max_turns=0)


def test_observation_text_drops_the_echo_of_the_players_action():
    class Kind:
        def __init__(self, name):
            self.name = name

    messages = [(0, "[5]", Kind("PLAYER_ACTION")), (-1, "The target number is higher.", Kind("GAME_MESSAGE")),
                (-1, "Board:\n1 2", Kind("GAME_BOARD"))]
    assert observation_text(messages) == "The target number is higher.\nBoard:\n1 2"
    assert observation_text(messages[:1]) == "" and EMPTY_OBSERVATION


def _play_a_little(game):
    env = TextArenaEnv(game, size=2, seed=0, eval_size=1)
    assert [r["prompt"] for r in env.rows()] == [_first_observation(game, s) for s in (0, 1)]
    episode = _episode(env, env.rows()[0])
    for turn_no in range(3):
        turn = _play(env, episode, "[1]" if turn_no == 0 else "I do not know")
        assert isinstance(turn.reward, float) and -1.0 <= turn.reward <= 1.0
        if turn.done:
            return
        assert isinstance(turn.observation, str) and turn.observation
    raise AssertionError(f"{game}: two invalid moves in a row did not end the game")


@needs_ta
@pytest.mark.parametrize("game", ["GuessTheNumber-v0", "Mastermind-v0", "TowerOfHanoi-v0", "LightsOut-v0",
                                  "FrozenLake-v0", "Blackjack-v0"])
def test_listed_games_play_offline(game):
    assert game in TEXTARENA_GAMES
    _play_a_little(game)


@needs_ta
@pytest.mark.slow
def test_every_listed_game_plays_offline():
    for game in TEXTARENA_GAMES:
        _play_a_little(game)


@needs_rg
@pytest.mark.slow
@pytest.mark.parametrize(("how", "kept"), [("import reasoning_gym", False), ("require('reasoning_gym', 'x')", True)])
def test_importing_a_suite_through_require_leaves_the_global_random_state_alone(how, kept):
    """A plain ``import reasoning_gym`` draws from ``random`` (in a fresh interpreter: the first
    import does); through ``require`` the caller's state is kept."""
    code = ("import random\nfrom textrl.envs.adapters import require\nrandom.seed(0); s = random.getstate()\n"
            f"{how}\nprint(random.getstate() == s)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == [str(kept)], out.stderr[-2000:]


# -- missing packages ------------------------------------------------------------------------------


@pytest.mark.parametrize(("spec", "extra"), [("reasoning_gym:basic_arithmetic", "reasoning-gym"),
                                             ("textarena:GuessTheNumber-v0", "textarena")])
def test_a_missing_suite_names_the_extra_to_install(monkeypatch, spec, extra):
    monkeypatch.setitem(sys.modules, spec.partition(":")[0], None)  # import raises ImportError
    with pytest.raises(ImportError) as error:
        make_env(spec)
    message = str(error.value)
    assert f"pip install 'textrl[{extra}]'" in message and spec in message and "\n" not in message


def test_a_missing_math_verify_names_the_extra_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)
    with pytest.raises(ImportError, match=r"pip install 'textrl\[math\]'") as error:
        math_verify_reward(["q"], ["1"], answer=["1"])
    assert "\n" not in str(error.value)
