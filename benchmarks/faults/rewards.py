"""Fault cases of rewards and data (docs/reliability.md, "Rewards and data").

A prompt file whose row lacks the ``answer`` the accuracy reward reads, a one-row dataset, duplicate
rows that put training prompts in the held-out set, ``--reward ''``, a reward file whose function
calls ``sys.exit``, and preference data whose every pair has chosen == rejected (``textrl rm``).
"""

from __future__ import annotations

import json
from pathlib import Path

from fault_catalogue import SMALL, Trial, _write, case, judge, run_folder_sound

ONE = [*SMALL, "--iterations", "1"]


def _prompts(trial: Trial, name: str, rows: list[dict]) -> Path:
    return _write(trial, name, "".join(json.dumps(row) + "\n" for row in rows))


@case("rewards: a row without the answer the accuracy reward reads")
def row_without_answer(trial: Trial, base: Path) -> None:
    rows = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(20)]
    rows[13] = {"prompt": "What is 13 + 13?"}
    data = _prompts(trial, "no_answer.jsonl", rows)
    out = trial.folder("no_answer")
    proc = trial.textrl("train", *ONE, "--dataset", str(data), "--reward", "think_format,accuracy",
                        "--output-dir", str(out))
    judge(trial, "rewards: a row without the answer the accuracy reward reads", proc, refused=True,
          kept=not (out / "config.yaml").exists(),
          expect="no_answer.jsonl:14: row has no 'answer', which reward 'accuracy' reads; add it or choose another reward")


@case("rewards: a one-row dataset")
def one_row(trial: Trial, base: Path) -> None:
    data = _prompts(trial, "one_row.jsonl", [{"prompt": "What is 2 + 2?", "answer": "4"}])
    out = trial.folder("one_row")
    proc = trial.textrl("train", *ONE, "--dataset", str(data), "--output-dir", str(out))
    judge(trial, "rewards: a one-row dataset", proc, refused=True, kept=not (out / "metrics.jsonl").exists(),
          expect="the dataset has 1 row")


@case("rewards: duplicate rows across the held-out split")
def duplicate_rows(trial: Trial, base: Path) -> None:
    rows = [{"prompt": "What is 2 + 2?", "answer": "4"}] * 12 + [{"prompt": "What is 3 + 3?", "answer": "6"}] * 4
    data = _prompts(trial, "duplicates.jsonl", rows)
    out = trial.folder("duplicates")
    proc = trial.textrl("train", *ONE, "--dataset", str(data), "--output-dir", str(out))
    judge(trial, "rewards: duplicate rows across the held-out split", proc, refused=False,
          kept=run_folder_sound(out, 1), expect="held-out rows are duplicates of training rows")


@case("rewards: --reward ''")
def empty_reward(trial: Trial, base: Path) -> None:
    out = trial.folder("empty_reward")
    proc = trial.textrl("train", *ONE, "--reward", "", "--output-dir", str(out))
    judge(trial, "rewards: --reward ''", proc, refused=True, kept=not out.exists() or not any(out.iterdir()),
          expect="empty reward spec '' (--reward")


@case("rewards: a reward function that calls sys.exit")
def reward_exits(trial: Trial, base: Path) -> None:
    file = _write(trial, "exiting_reward.py", "import sys\n\n\ndef score(prompts, completions, **kwargs):\n"
                                              "    sys.exit(3)\n")
    out = trial.folder("reward_exits")
    proc = trial.textrl("train", *ONE, "--reward", f"{file}:score", "--output-dir", str(out))
    judge(trial, "rewards: a reward function that calls sys.exit", proc, refused=True,
          kept=not (out / "checkpoints").exists(), expect="reward 'score' raised SystemExit: sys.exit(3) was called")


@case("rewards: textrl rm on pairs with chosen == rejected")
def tied_preferences(trial: Trial, base: Path) -> None:
    rows = [{"prompt": f"q{i}", "chosen": "the same answer", "rejected": "the same answer"} for i in range(8)]
    data = _prompts(trial, "tied.jsonl", rows)
    out = trial.folder("tied_rm")
    proc = trial.textrl("rm", "--data", str(data), "--steps", "1", "--output-dir", str(out))
    judge(trial, "rewards: textrl rm on pairs with chosen == rejected", proc, refused=True,
          kept=not (out / "checkpoints").exists(), expect="every preference pair has chosen == rejected")


@case("rewards: a reward server where nothing listens")
def dead_reward_server(trial: Trial, base: Path) -> None:
    import socket

    with socket.socket() as s:  # a port where nothing listens once it is closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = trial.folder("dead_reward_server")
    proc = trial.textrl("train", *ONE, "--reward", f"think_format,reward_model:http://127.0.0.1:{port}:0.5",
                        "--output-dir", str(out))
    judge(trial, "rewards: a reward server where nothing listens", proc, refused=True,
          kept=not (out / "metrics.jsonl").exists(),
          expect=f"reward_model server http://127.0.0.1:{port} does not answer GET /v1/models (connection refused): "
                 "start it with textrl vllm-serve --reward-model MODEL, or fix the URL")
