"""The stages' data: a resume after a row's contents were edited names the row and records it;
rows added are refused; ``textrl sft`` warns about the rows ``--max-length`` truncates, and
refuses before training a prompt that fills it."""

from __future__ import annotations

import json

import pytest

from textrl.run import CheckpointError
from textrl.stages.common import BatchOrder
from textrl.stages.sft import SFTConfig, train_sft

TINY = {"steps": 4, "batch_size": 4, "eval_size": 4, "eval_every": 0, "checkpoint_every": 2, "progress": False}


def _pairs(n: int = 16, long_response: dict[int, int] | None = None) -> list[dict[str, str]]:
    """``n`` SFT rows; row k of ``long_response`` gets a response of that many words."""
    rows = [{"prompt": f"Say {i}.", "response": f"{i}"} for i in range(n)]
    for k, words in (long_response or {}).items():
        rows[k]["response"] = " ".join(["word"] * words)
    return rows


def _write(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_batch_order_accepts_an_edited_row_naming_it_and_refuses_an_added_one():
    rows = [("prompt", str(i)) for i in range(10)]
    names = [f"data.jsonl: row {i} (line {i + 1})" for i in range(10)]
    first = BatchOrder(rows, seed=3, names=names)
    first.next_batch(4)
    state = first.state_dict()
    expected = [first.next_batch(4) for _ in range(3)]
    edited = BatchOrder([*rows[:6], ("prompt", "fixed"), *rows[7:]], seed=99, names=names)
    edited.load_state_dict(state)
    assert [change["row"] for change in edited.edited] == ["data.jsonl: row 6 (line 7)"]
    assert [edited.next_batch(4) for _ in range(3)] == expected  # the same batches
    with pytest.raises(ValueError, match=r"^it was taken on other training rows: the checkpoint was taken on 10 "
                                         r"training rows and the training data now gives 11: rows were added"):
        BatchOrder([*rows, ("prompt", "new")], seed=3).load_state_dict(state)
    old = {k: v for k, v in state.items() if k != "row_digests"}  # a checkpoint from before row digests
    with pytest.raises(ValueError, match=r"other training rows \(10 rows, fingerprint"):
        BatchOrder([*rows[:6], ("prompt", "fixed"), *rows[7:]], seed=3).load_state_dict(old)


def test_sft_resumes_after_a_row_was_edited_naming_it(tmp_path, capsys):
    data = _write(tmp_path / "sft.jsonl", _pairs())
    out = tmp_path / "run"
    train_sft(SFTConfig(output_dir=str(out), data=str(data), **TINY))
    assert (out / "checkpoints" / "iter_000002").is_dir()
    rows = _pairs()
    rows[0]["response"] = "zero"  # an edit of line 1 (a training row with this seed)
    _write(data, rows)
    capsys.readouterr()
    train_sft(SFTConfig(output_dir=str(out), data=str(data), resume=True, **{**TINY, "steps": 6}))
    said = capsys.readouterr().out
    assert f"--resume: 1 row(s) changed since iter_000002: {data}: row 0 (line 1);" in said
    (record,) = [json.loads(line) for line in (out / "resumes.jsonl").read_text().splitlines()]
    assert [change["row"] for change in record["changed_rows"]] == [f"{data}: row 0 (line 1)"]
    assert [json.loads(line)["iteration"] for line in (out / "metrics.jsonl").read_text().splitlines()] == \
        [1, 2, 3, 4, 5, 6]
    _write(data, [*rows, {"prompt": "Say 16.", "response": "16"}])
    with pytest.raises(CheckpointError, match="cannot continue on this data: it was taken on other training rows: .*rows "
                                              "were added"):
        train_sft(SFTConfig(output_dir=str(out), data=str(data), resume=True, **{**TINY, "steps": 8}))


def test_sft_warns_once_counting_the_rows_max_length_truncates(tmp_path):
    data = _write(tmp_path / "sft.jsonl", _pairs(long_response={3: 40, 9: 60}))
    config = SFTConfig(output_dir=str(tmp_path / "run"), data=str(data), max_length=32, **{**TINY, "steps": 1})
    with pytest.warns(UserWarning) as caught:
        train_sft(config)
    said = [str(w.message) for w in caught if "max_length" in str(w.message)]
    assert len(said) == 1
    assert said[0].startswith("sft: 2 of 16 rows are longer than max_length=32 tokens (prompt + response + EOS) "
                              "and are truncated, losing the end of their response and its EOS; the longest: "
                              f"{data}: row 9 (line 10) (")
    assert "raise --max-length to" in said[0]


def test_sft_refuses_a_prompt_that_fills_max_length_before_training(tmp_path):
    rows = _pairs()
    rows[5]["prompt"] = "Say " + " ".join(["word"] * 80) + "."
    data = _write(tmp_path / "sft.jsonl", rows)
    with pytest.raises(ValueError, match=rf"^{data}: row 5 \(line 6\): the templated prompt is \d+ tokens, not "
                                         r"shorter than max_length=32, so no response token is left to learn; raise "
                                         r"--max-length above \d+ or shorten the prompt$"):
        train_sft(SFTConfig(output_dir=str(tmp_path / "run"), data=str(data), max_length=32, **TINY))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
