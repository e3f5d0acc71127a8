"""Fault cases of environments and lengths (docs/reliability.md, "Environments and lengths").

An environment file whose pieces go wrong one at a time (its ``__init__`` raising, a turn reward
of ``10**400`` or ``1e39``, ``done="no"``, an ``int`` observation, a string ``max_turns``, a
prompt with a lone surrogate, a ``step()`` slower than ``--env-timeout``), the adapters run with
no length flags (``reasoning_gym:leg_counting``'s 167-token prompts, TextArena's TowerOfHanoi
budget), an explicit episode budget past the context, and ``textrl generate`` past the context.
"""

from __future__ import annotations

from pathlib import Path

from fault_catalogue import Trial, _write, case, judge, run_folder_sound

QUICK = ["--prompts-per-iteration", "4", "--n-samples-per-prompt", "2", "--eval-size", "8", "--eval-every", "0",
         "--progress", "false", "--ppo-epochs", "1", "--num-minibatches", "2", "--iterations", "1"]
"""A short run with no length flag (max_prompt_length, max_new_tokens, max_episode_tokens left to
their defaults)."""

ENVS = '''
import time
from textrl.envs import Environment, Turn


class Base(Environment):
    max_turns = 2

    def rows(self):
        return [{"prompt": f"Say {i}"} for i in range(40)]


class Boom(Base):
    id = "boom"

    def __init__(self):
        raise RuntimeError("no game server")


class BigReward(Base):
    id = "big_reward"

    def step(self, episode, completion):
        return Turn(reward=10**400, done=True)


class Float32Reward(Base):
    id = "float32_reward"

    def step(self, episode, completion):
        return Turn(reward=1e39, done=True)


class DoneNo(Base):
    id = "done_no"

    def step(self, episode, completion):
        return Turn(reward=1.0, done="no")


class IntObservation(Base):
    id = "int_observation"

    def step(self, episode, completion):
        return Turn(observation=7)


class StrTurns(Base):
    id = "str_turns"
    max_turns = "3"


class Surrogate(Base):
    id = "surrogate"

    def rows(self):
        return [{"prompt": "fine"}] * 20 + [{"prompt": "bad \\ud800 text"}]


class Slow(Base):
    id = "slow"

    def step(self, episode, completion):
        time.sleep(30)
        return Turn(done=True)
'''

BAD_ENVS = [
    ("env: __init__ raises", "Boom", [], "its constructor raised RuntimeError: no game server"),
    ("env: turn reward 10**400", "BigReward", [], "environment 'big_reward': step() on row"),
    ("env: turn reward 1e39", "Float32Reward", [], "too large for the rollout's float32 rewards"),
    ("env: done='no'", "DoneNo", [], "Turn.done='no' (str): done must be True or False"),
    ("env: int observation", "IntObservation", [], "Turn.observation=7 (int)"),
    ("env: string max_turns", "StrTurns", [], "environment 'str_turns': max_turns='3' (str) must be an int >= 1"),
    ("env: lone surrogate in a prompt", "Surrogate", ["--reward", "think_format"], "lone surrogate '\\ud800'"),
    ("env: step() past --env-timeout", "Slow", ["--env-timeout", "2"], "ran past env_timeout=2 s"),
]


@case("env: environment file faults")
def environment_file(trial: Trial, base: Path) -> None:
    path = _write(trial, "my_envs.py", ENVS)
    for name, cls, flags, expect in BAD_ENVS:
        out = trial.folder("env_faults")
        proc = trial.textrl("train", *QUICK, "--env", f"{path}:{cls}", "--warmup-sft-steps", "0", *flags,
                            "--output-dir", str(out))
        kept = not (out / "checkpoints").exists() and not (out / "summary.json").exists()
        judge(trial, name, proc, refused=True, kept=kept, expect=expect)


@case("env: adapters with no length flags")
def adapters_default_lengths(trial: Trial, base: Path) -> None:
    for name, spec, args, expect in [
        ("env: reasoning_gym:leg_counting, no length flags", "reasoning_gym:leg_counting",
         ["--env-args", "size=40,eval_size=8"], "held-out metric"),
        ("env: textarena:TowerOfHanoi-v0, no length flags", "textarena:TowerOfHanoi-v0",
         ["--env-args", "size=8,eval_size=8"], "max_episode_tokens: the default budget"),
    ]:
        out = trial.folder("env_adapters")
        proc = trial.textrl("train", *QUICK, "--env", spec, *args, "--output-dir", str(out), timeout=600)
        judge(trial, name, proc, refused=False, kept=run_folder_sound(out, 1), expect=expect)
    out = trial.folder("env_budget")
    proc = trial.textrl("train", *QUICK, "--env", "textarena:TowerOfHanoi-v0", "--env-args", "size=8,eval_size=8",
                        "--max-episode-tokens", "1536", "--output-dir", str(out))
    judge(trial, "env: TowerOfHanoi --max-episode-tokens 1536", proc, refused=True,
          kept=not (out / "config.yaml").exists() or not (out / "checkpoints").exists(),
          expect="lower --max-episode-tokens to")


@case("env: generate past the context")
def generate_past_context(trial: Trial, base: Path) -> None:
    proc = trial.textrl("generate", "--max-new-tokens", "500", "--prompt", "What is 2+3?")
    judge(trial, "env: textrl generate past the context", proc, refused=True, kept=True,
          expect="lower --max-new-tokens to 487")
