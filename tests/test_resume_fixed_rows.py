"""No run is lost to a data fault: a run stopped by a bad row of its prompt file
resumes once the row is fixed (the row named, the change recorded, every iteration logged once);
rows added, removed or reordered are still refused, and the run folder is left as it was."""

from __future__ import annotations

import json

import pytest

from tests.runs import metrics
from textrl.cli import main

REWARD = '''def strict(completions, answer, **kwargs):
    """1 per completion; a row whose answer is not a number is a fault of the data."""
    for a in answer:
        if not a.isdigit():
            raise ValueError(f"answer {a!r} is not a number")
    return [1.0 for _ in completions]
'''

RUN = ["--prompts-per-iteration", "2", "--n-samples-per-prompt", "2", "--max-new-tokens", "4",
       "--warmup-sft-steps", "0", "--eval-size", "2", "--eval-every", "0", "--progress", "false",
       "--checkpoint-every", "1", "--keep-checkpoints", "2", "--iterations", "8", "--seed", "1"]
"""With --seed 1 the 22 training rows of 24 are drawn two an iteration and line 5 in iteration 6."""


def _rows(answers: list[str]) -> str:
    return "".join(json.dumps({"prompt": f"What is {i} + {i}?", "answer": a}) + "\n" for i, a in enumerate(answers))


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("TEXTRL_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


def test_a_run_stopped_by_a_bad_row_resumes_once_the_row_is_fixed(tmp_path, capsys):
    answers = [str(2 * i) for i in range(24)]
    data, reward, out = tmp_path / "prompts.jsonl", tmp_path / "my_reward.py", tmp_path / "run"
    reward.write_text(REWARD)
    data.write_text(_rows([*answers[:4], "bad", *answers[5:]]))
    args = ["train", "--dataset", str(data), "--reward", f"{reward}:strict", *RUN, "--output-dir", str(out)]
    with pytest.raises(SystemExit) as stopped:
        main(args)
    assert str(stopped.value.code).startswith(
        "textrl train: reward 'strict' raised ValueError: answer 'bad' is not a number; rows that raise on their own: "
        "[2, 3]; ")
    assert str(stopped.value.code).endswith(f"; in iteration 6, batch rows 0-1 = {data}:12, 2-3 = {data}:5")
    assert [row["iteration"] for row in metrics(out)] == [1, 2, 3, 4, 5]

    # a row added, or two rows swapped, is another dataset: refused, the folder left as it was
    kept = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != ".textrl.lock"}
    fixed = _rows([*answers[:4], "8", *answers[5:]]).splitlines(keepends=True)
    for edited, refusal in [(_rows([*answers, "48"]), "rows were added"),
                            ("".join([fixed[1], fixed[0], *fixed[2:]]), "the rows were reordered")]:
        data.write_text(edited)
        with pytest.raises(SystemExit) as refused:
            main([*args, "--resume"])
        assert refusal in str(refused.value.code) and "start a new run in another --output-dir" in str(refused.value.code)
        assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != ".textrl.lock"} == kept

    data.write_text("".join(fixed))  # line 5 fixed
    capsys.readouterr()
    assert main([*args, "--resume"]) == 0
    said = capsys.readouterr().out
    assert (f"--resume: 1 row(s) changed since iter_000005: {data}:5; the number and order of the rows are the "
            "same, so the batches are drawn as before (recorded in resumes.jsonl)") in said
    assert [row["iteration"] for row in metrics(out)] == list(range(1, 9))
    (record,) = [json.loads(line) for line in (out / "resumes.jsonl").read_text().splitlines()]
    assert record["resumed_after"] == 5 and record["checkpoint"] == "iter_000005" and record["changed"] == {}
    assert [change["row"] for change in record["changed_rows"]] == [f"{data}:5"]
