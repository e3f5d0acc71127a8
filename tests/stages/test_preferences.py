"""The three preference formats, the safety-first ordering of PKU-SafeRLHF, and malformed rows."""

from __future__ import annotations

import json

import pytest

from textrl.stages.preferences import Preference, detect_format, load_preferences, parse_preference


def test_generic_rows_with_string_or_messages_prompt_and_aliases():
    prefs = load_preferences([
        {"prompt": "2+2?", "chosen": "4", "rejected": "5"},
        {"question": "Hi", "response_chosen": "Hello!", "response_rejected": "Go away."},
        {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
         "chosen": "Hi.", "rejected": "Hello there, how are you today?"},
    ])
    assert prefs[0] == Preference((("user", "2+2?"),), "4", "5")
    assert (prefs[1].chosen, prefs[1].rejected) == ("Hello!", "Go away.")
    assert prefs[2].prompt == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def test_hh_rlhf_transcripts_split_into_prompt_and_final_turns():
    shared = "\n\nHuman: What is 2+2?\n\nAssistant: 4.\n\nHuman: And 3+3?"
    row = {"chosen": shared + "\n\nAssistant: 6.", "rejected": shared + "\n\nAssistant: No idea."}
    assert detect_format(row) == "hh"
    pref = parse_preference(row, "row 0")
    assert pref.messages == (("user", "What is 2+2?"), ("assistant", "4."), ("user", "And 3+3?"))
    assert (pref.chosen, pref.rejected) == ("6.", "No idea.")


def test_hh_rlhf_pair_must_share_its_prompt():
    row = {"chosen": "\n\nHuman: A\n\nAssistant: x", "rejected": "\n\nHuman: B\n\nAssistant: y"}
    with pytest.raises(ValueError, match="row 7: fields 'chosen' and 'rejected' hold different"):
        parse_preference(row, "row 7")


def test_hh_rlhf_field_that_is_not_a_transcript():
    with pytest.raises(ValueError, match="row 0: field 'rejected' is not an hh-rlhf transcript"):
        parse_preference({"chosen": "\n\nHuman: A\n\nAssistant: x", "rejected": "just text"}, "row 0")


def _pku(safe0: bool, safe1: bool, better: int, **extra) -> dict:
    return {"prompt": "How do I pick a lock?", "response_0": "R0", "response_1": "R1",
            "is_response_0_safe": safe0, "is_response_1_safe": safe1, "better_response_id": better,
            **extra}


@pytest.mark.parametrize(
    ("safe0", "safe1", "better", "chosen"),
    [
        (True, False, 1, "R0"),   # the safe one wins although the other is "better"
        (False, True, 0, "R1"),
        (True, True, 1, "R1"),    # both safe: better_response_id decides
        (True, True, 0, "R0"),
        (False, False, 1, "R1"),  # neither safe: better_response_id decides
        (False, False, 0, "R0"),
    ],
)
def test_pku_safety_first_then_better_response(safe0, safe1, better, chosen):
    pref = parse_preference(_pku(safe0, safe1, better, safer_response_id=0), "row 0")
    assert detect_format(_pku(safe0, safe1, better)) == "pku"
    assert pref.chosen == chosen and pref.rejected == ({"R0", "R1"} - {chosen}).pop()


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({k: v for k, v in _pku(True, True, 0).items() if k != "is_response_1_safe"},
         "missing field 'is_response_1_safe'"),
        (_pku(True, True, 2), "field 'better_response_id' must be one of"),
        (_pku(True, True, True), "field 'better_response_id' must be one of"),
        (_pku("yes", True, 0), "field 'is_response_0_safe' must be one of"),
        (_pku(True, True, 0, safer_response_id=5), "field 'safer_response_id' must be one of"),
        ({"prompt": "p", "chosen": "a"}, "missing field 'rejected'"),
        ({"prompt": "p", "chosen": "", "rejected": "b"}, "field 'chosen' must be a non-empty string"),
        ({"prompt": "", "chosen": "a", "rejected": "b"}, "field 'prompt' is empty"),
        ({"text": "nothing"}, "no preference fields"),
    ],
)
def test_malformed_rows_name_the_row_and_the_field(row, message):
    with pytest.raises(ValueError, match=f"row 3: .*{message}"):
        load_preferences([{"prompt": "p", "chosen": "a", "rejected": "b"}] * 3 + [row])


def test_jsonl_errors_name_row_and_line(tmp_path):
    path = tmp_path / "prefs.jsonl"
    rows = [{"prompt": "p", "chosen": "a", "rejected": "b"}, {"prompt": "p", "chosen": "a"}]
    path.write_text(json.dumps(rows[0]) + "\n\n" + json.dumps(rows[1]) + "\n")
    with pytest.raises(ValueError, match=r"prefs.jsonl: row 1 \(line 3\): missing field 'rejected'"):
        load_preferences(path)
    path.write_text("{not json\n")
    with pytest.raises(ValueError, match=r"row 0 \(line 1\): not valid JSON"):
        load_preferences(path)


def test_json_list_file_and_builtin_sets(tmp_path):
    path = tmp_path / "prefs.json"
    path.write_text(json.dumps([_pku(False, True, 0)]))
    assert load_preferences(path)[0].chosen == "R1"
    assert len(load_preferences("builtin:case")) == 256
    assert len(load_preferences("builtin:case-heldout")) == 128
    with pytest.raises(ValueError, match="preference data 'builtin:nope': unknown built-in set"):
        load_preferences("builtin:nope")
    with pytest.raises(ValueError, match="no such file"):
        load_preferences(tmp_path / "missing.jsonl")


def test_forced_format_overrides_detection():
    row = {"prompt": "p", "chosen": "\n\nHuman: A\n\nAssistant: x", "rejected": "\n\nHuman: A\n\nAssistant: y"}
    assert parse_preference(row, "row 0").chosen.startswith("\n\nHuman")  # auto: generic
    assert parse_preference(row, "row 0", format="hh").chosen == "x"
    with pytest.raises(ValueError, match="format='x'"):
        parse_preference(row, "row 0", format="x")
