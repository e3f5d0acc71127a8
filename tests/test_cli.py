from __future__ import annotations

import pytest

from textrl.cli import main


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TEXTRL_CACHE", str(tmp_path / "cache"))


def test_tiny_builds_and_prints_paths(capsys, tmp_path):
    assert main(["tiny"]) == 0
    out = capsys.readouterr().out
    for kind in ("causal_lm", "reward_model", "gpt2"):
        assert f"{kind}: {tmp_path / 'cache'}" in out


def test_generate_prints_a_completion_per_prompt(capsys):
    assert main(["generate", "--prompt", "hi", "--prompt", "What is 1+1?", "--max-new-tokens", "4", "--greedy"]) == 0
    out = capsys.readouterr().out
    assert out.count("### completion") == 2 and "What is 1+1?" in out


@pytest.mark.parametrize(("flag", "value"), [("--max-new-tokens", "0"), ("--temperature", "0")])
def test_generate_rejects_bad_settings(flag, value):
    with pytest.raises(SystemExit, match=flag):
        main(["generate", flag, value])


def test_unknown_subcommand_is_an_argparse_error():
    with pytest.raises(SystemExit):
        main(["frobnicate"])
