"""Preference pairs whose chosen and rejected answers are the same text teach nothing: they are
left out with one warning naming FILE:LINE, and data holding nothing else is refused."""

from __future__ import annotations

import json

import pytest

from textrl.stages.preferences import load_preferences


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_tied_pairs_are_named_and_left_out(tmp_path):
    rows = [{"prompt": f"q{i}", "chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(6)]
    rows[2]["rejected"] = " good  2 "
    data = _write(tmp_path / "prefs.jsonl", rows)
    with pytest.warns(UserWarning, match=r"1 of 6 preference pairs have chosen == rejected \(.*prefs.jsonl: row 2 \(line 3\)\)"):
        prefs = load_preferences(str(data))
    assert len(prefs) == 5 and all(p.chosen != p.rejected for p in prefs)


def test_data_of_only_tied_pairs_is_refused(tmp_path):
    data = _write(tmp_path / "prefs.jsonl", [{"prompt": "q", "chosen": "same", "rejected": "same"}] * 2)
    with pytest.raises(ValueError, match=r"every preference pair has chosen == rejected \(.*prefs.jsonl: row 0 \(line 1\), .*row 1 \(line 2\)\)"):
        load_preferences(str(data))
