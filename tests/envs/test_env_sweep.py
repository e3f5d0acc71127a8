"""benchmarks/env_sweep.py runs every environment docs/environments.md lists: its list is the
registry's built-in ids plus that page's reasoning-gym tasks and TextArena games, and those lists are
exactly the adapters' lists (``REASONING_GYM_TASKS``, ``TEXTARENA_GAMES``). Each listed environment
builds, and its prompts and episode budget, fitted as ``textrl train`` fits them
(:func:`textrl.envs.lengths.resolve_lengths`), fit the default tiny model's context with
``--max-new-tokens`` left at its default: the built-in ones and a subset of the adapters at once,
every one in the slow test (a few rows each)."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import pytest

from textrl.config import TrainConfig
from textrl.envs import env_ids, make_env
from textrl.envs.adapters import REASONING_GYM_TASKS, TEXTARENA_GAMES
from textrl.envs.lengths import resolve_lengths

ROOT = Path(__file__).resolve().parents[2]
CONTEXT = 512
"""The default tiny model's context (max_position_embeddings)."""


def _sweep():
    spec = importlib.util.spec_from_file_location("env_sweep", ROOT / "benchmarks" / "env_sweep.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("env_sweep", module)
    spec.loader.exec_module(module)
    return module


sweep = _sweep()
DOC = (ROOT / "docs" / "environments.md").read_text()


def test_the_sweep_runs_the_builtin_environments_and_every_adapter_environment_the_docs_list():
    envs = sweep.listed_environments()
    assert envs == (env_ids() + [f"reasoning_gym:{t}" for t in REASONING_GYM_TASKS]
                    + [f"textarena:{g}" for g in TEXTARENA_GAMES])
    assert len(envs) == len(set(envs))
    assert tuple(sweep.listed_reasoning_gym_tasks(DOC)) == REASONING_GYM_TASKS
    assert tuple(sweep.listed_textarena_games(DOC, list(TEXTARENA_GAMES))) == TEXTARENA_GAMES


def test_every_textarena_game_name_of_the_docs_has_its_ids_and_the_2048_count_is_true():
    entries = dict(sweep.listed_textarena_names(DOC))
    assert entries["2048"] == "14" and entries["Sokoban-v0"] == "all"
    bases = {sweep.textarena_base(g) for g in TEXTARENA_GAMES}
    assert {sweep.textarena_base(name) for name in entries} == bases


@pytest.mark.parametrize("old, new, message", [
    ("These 98 tasks", "These 97 tasks", r"docs/environments.md says 97 reasoning-gym tasks and lists 98"),
    ("2048 (14 variants)", "2048 (13 variants)", r"docs/environments.md says 2048 has 13 variants; TEXTARENA_GAMES has 14"),
    ("Bandit, Blackjack", "Bandit, Chess, Blackjack", r"lists the TextArena game 'Chess', which no id"),
    ("(`TEXTARENA_GAMES`)", "(TEXTARENA_GAMES)", r"docs/environments.md has no 'These work offline"),
])
def test_a_docs_list_that_is_not_true_stops_the_sweep_naming_it(old, new, message):
    assert old in " ".join(DOC.split())
    text = " ".join(DOC.split()).replace(old, new)
    with pytest.raises(ValueError, match=message):
        sweep.listed_environments(text)


def test_a_run_line_says_ok_or_the_error_and_the_seconds():
    assert sweep.Outcome("digits", True, 12.34).line().split() == ["ok", "digits", "12.3", "s"]
    failed = sweep.Outcome("textarena:Set-v0", False, 3.0, "exit 1: textrl train: ValueError: boom").line()
    assert failed.startswith("FAILED textarena:Set-v0") and failed.endswith("3.0 s  exit 1: textrl train: ValueError: boom")
    assert sweep.last_line("Loading 0%\rLoading 100%\ntextrl train: ValueError: boom\n\n") == "textrl train: ValueError: boom"


def few_rows(env_id: str) -> dict:
    """Settings that build an adapter environment with a few rows (its prompts as the defaults'
    rows are: the same generator, the first seeds)."""
    if env_id.startswith("reasoning_gym:"):
        return {"size": 4, "eval_size": 0}
    if env_id.startswith("textarena:"):
        return {"size": 2, "eval_size": 0}
    return {}


def check_fits(env_id: str, tok) -> None:
    """``env_id`` builds, and its lengths, fitted as ``textrl train`` fits them, fit the tiny
    model's context: every prompt kept whole or left-truncated to the bound, an episode of at least
    one turn of the default ``max_new_tokens``."""
    env = make_env(env_id, **few_rows(env_id))
    rows = [env.rows()] + ([env.eval_rows()] if env.eval_rows() else [])
    new = TrainConfig().max_new_tokens
    lengths = resolve_lengths(env, rows, tok, max_new_tokens=new, max_prompt_length=None,
                              max_episode_tokens=None, context=CONTEXT)
    assert lengths.max_prompt_length == min(lengths.longest_prompt, CONTEXT - new), env_id
    assert new <= lengths.max_episode_tokens and lengths.max_prompt_length + lengths.max_episode_tokens <= CONTEXT, env_id
    assert (lengths.truncated_rows > 0) == (lengths.longest_prompt > CONTEXT - new), env_id


@pytest.mark.parametrize("env_id", env_ids())
def test_each_builtin_environment_builds_and_fits_the_default_context(env_id, tok):
    check_fits(env_id, tok)


@pytest.mark.parametrize("env_id", [
    "reasoning_gym:leg_counting", "reasoning_gym:rectangle_count",  # 167 tokens; 6768, left-truncated
    "textarena:GuessTheNumber-v0", "textarena:TowerOfHanoi-v0",  # multi-turn, the budget bounded
    "textarena:Crosswords-v0",  # a multi-turn prompt over the context: one turn left
])
def test_a_subset_of_the_adapter_environments_builds_and_fits_the_default_context(env_id, tok):
    check_fits(env_id, tok)


@pytest.mark.slow
def test_every_listed_environment_builds_and_fits_the_default_context(tok):
    start = time.perf_counter()
    for env_id in sweep.listed_environments():
        check_fits(env_id, tok)
    assert time.perf_counter() - start < 600  # ~60 s on an idle 2-core CPU
