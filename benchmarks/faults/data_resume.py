"""Fault cases of data and resume (docs/reliability.md, "Rewards and data").

A prompt row that makes the user's reward raise mid-run (named by FILE:LINE), the same run resumed
once the row is fixed (the row named and recorded in resumes.jsonl, every iteration logged once),
a row added or two rows swapped before ``--resume`` (refused, the folder untouched), and ``textrl
sft`` on responses longer than ``--max-length`` (one warning) or a prompt that fills it (refused).
"""

from __future__ import annotations

import json
from pathlib import Path

from fault_catalogue import Trial, _write, case, judge, run_folder_sound, snapshot

REWARD = '''def strict(completions, answer, **kwargs):
    for a in answer:
        if not a.isdigit():
            raise ValueError(f"answer {a!r} is not a number")
    return [1.0 for _ in completions]
'''

RUN = ["--prompts-per-iteration", "2", "--n-samples-per-prompt", "2", "--max-new-tokens", "4",
       "--warmup-sft-steps", "0", "--eval-size", "2", "--eval-every", "0", "--progress", "false",
       "--checkpoint-every", "1", "--iterations", "8", "--seed", "1"]
"""With --seed 1, line 5 of the 24 rows is drawn in iteration 6."""

ANSWERS = [str(2 * i) for i in range(24)]


def _rows(answers: list[str]) -> str:
    return "".join(json.dumps({"prompt": f"What is {i} + {i}?", "answer": a}) + "\n" for i, a in enumerate(answers))


def _without_lock(folder: Path) -> dict[str, bytes]:
    return {k: v for k, v in snapshot(folder).items() if k != ".textrl.lock"}


@case("data resume: a bad row stops the run, the fixed row resumes")
def bad_row_then_fixed(trial: Trial, base: Path) -> None:
    data = _write(trial, "bad_row.jsonl", _rows([*ANSWERS[:4], "bad", *ANSWERS[5:]]))
    reward = _write(trial, "strict_reward.py", REWARD)
    out = trial.folder("bad_row")
    args = ["train", "--dataset", str(data), "--reward", f"{reward}:strict", *RUN, "--output-dir", str(out)]
    proc = trial.textrl(*args)
    judge(trial, "data resume: a reward raises on a bad row (iteration 6)", proc, refused=True,
          kept=run_folder_sound(out, 5), expect="reward 'strict' raised ValueError: answer 'bad' is not a number")
    if f"in iteration 6, batch rows 0-1 = {data}:12, 2-3 = {data}:5" not in proc.stderr:
        trial.outcomes[-1].clear = False
        trial.outcomes[-1].note = "row unnamed"
    fixed = _rows([*ANSWERS[:4], "8", *ANSWERS[5:]]).splitlines(keepends=True)
    for name, text, expect in [("a row added before --resume", _rows([*ANSWERS, "48"]), "rows were added"),
                               ("two rows swapped before --resume", "".join([fixed[1], fixed[0], *fixed[2:]]),
                                "the rows were reordered")]:
        data.write_text(text)
        before = _without_lock(out)
        proc = trial.textrl(*args, "--resume")
        judge(trial, f"data resume: {name}", proc, refused=True, kept=_without_lock(out) == before, expect=expect)
    data.write_text("".join(fixed))
    proc = trial.textrl(*args, "--resume")
    resumes = (out / "resumes.jsonl").read_text() if (out / "resumes.jsonl").is_file() else ""
    named = [c["row"] for line in resumes.splitlines() for c in json.loads(line).get("changed_rows", [])]
    judge(trial, "data resume: the row fixed, --resume", proc, refused=False,
          kept=run_folder_sound(out, 8) and named == [f"{data}:5"], expect=f"1 row(s) changed since iter_000005: {data}:5")


def _sft_rows(long_response: dict[int, int] | None = None, long_prompt: int | None = None) -> str:
    rows = [{"prompt": f"Say {i}.", "response": f"{i}"} for i in range(16)]
    for k, words in (long_response or {}).items():
        rows[k]["response"] = " ".join(["word"] * words)
    if long_prompt is not None:
        rows[long_prompt]["prompt"] = "Say " + " ".join(["word"] * 80) + "."
    return "".join(json.dumps(row) + "\n" for row in rows)


SFT = ["sft", "--steps", "1", "--batch-size", "4", "--eval-size", "4", "--eval-every", "0", "--progress", "false",
       "--max-length", "32"]


@case("data resume: sft responses longer than --max-length")
def sft_truncates(trial: Trial, base: Path) -> None:
    data = _write(trial, "sft_long.jsonl", _sft_rows(long_response={3: 40, 9: 60}))
    out = trial.folder("sft_long")
    proc = trial.textrl(*SFT, "--data", str(data), "--output-dir", str(out))
    judge(trial, "data resume: sft responses longer than --max-length", proc, refused=False,
          kept=(out / "model").is_dir(),
          expect="sft: 2 of 16 rows are longer than max_length=32 tokens (prompt + response + EOS) and are truncated")
    if f"the longest: {data}: row 9 (line 10)" not in proc.stderr:
        trial.outcomes[-1].clear = False
        trial.outcomes[-1].note = "row unnamed"


@case("data resume: sft prompt that fills --max-length")
def sft_prompt_fills(trial: Trial, base: Path) -> None:
    data = _write(trial, "sft_prompt.jsonl", _sft_rows(long_prompt=5))
    out = trial.folder("sft_prompt")
    proc = trial.textrl(*SFT, "--data", str(data), "--output-dir", str(out))
    judge(trial, "data resume: sft prompt that fills --max-length", proc, refused=True,
          kept=not (out / "metrics.jsonl").exists(),
          expect=f"{data}: row 5 (line 6): the templated prompt is")
