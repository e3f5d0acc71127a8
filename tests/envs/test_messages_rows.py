"""Rows with ``messages`` (TRL's conversational format) that end with an assistant turn: the
prompt is the conversation up to its last user turn, and the assistant's text is the row's
``reference``, which the rewards receive, however the rows arrive (a prompt file, a list given to
an environment, a row given to an episode). A row whose own ``reference`` differs is refused."""

from __future__ import annotations

import json

import pytest

from textrl.envs.environment import Environment
from textrl.envs.episodes import EpisodeDynamics
from textrl.envs.prompts import check_reward_columns, load_prompts
from textrl.envs.prompts.rows import row_messages
from textrl.envs.prompts.table import PromptTable

ANSWERED = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                         {"role": "assistant", "content": "4"}], "id": 7}
PROMPT = ANSWERED["messages"][:2]


def test_a_list_given_to_an_environment_keeps_the_answer_as_reference_and_out_of_the_prompt(tok):
    table = PromptTable([ANSWERED, {"prompt": PROMPT + [ANSWERED["messages"][2]]}], tok, max_prompt_length=256)
    expected = tok.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    for index in (0, 1):
        assert tok.decode(table.ids(index)) == expected  # the answer is not in the prompt
        assert table.fields(index)["reference"] == "4" and table.text(index) == "2+2?"
    assert table.fields(0)["id"] == 7
    assert row_messages(ANSWERED, 0)[0] == PROMPT


def test_a_row_given_to_an_episode_keeps_the_answer_as_reference(tok):
    episodes = EpisodeDynamics(Environment(), tokenizer=tok, eos_token_ids=[tok.eos_token_id], max_new_tokens=4,
                        max_episode_tokens=8)
    state = episodes.start(dict(ANSWERED), -1, "a row")
    assert state.episode.messages == PROMPT and state.episode.prompt_messages == 2
    assert state.fields == {"id": 7, "reference": "4"}


def test_a_prompt_file_keeps_the_answer_and_refuses_a_different_reference(tmp_path):
    path = tmp_path / "data.jsonl"
    rows = [ANSWERED, {**ANSWERED, "reference": "4"}, {**ANSWERED, "reference": "five"}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(ValueError, match=r"data.jsonl:3: 'messages' ends with an assistant turn \('4'\), kept as the "
                                         r"row's 'reference', but the row has its own 'reference' \('five'\); drop one"):
        load_prompts(str(path))
    path.write_text("".join(json.dumps(row) + "\n" for row in rows[:2]))
    data = load_prompts(str(path))
    assert [data[i]["reference"] for i in (0, 1)] == ["4", "4"] and data[0]["messages"] == PROMPT
    with pytest.raises(ValueError, match=r"prompt 0: 'messages' ends with an assistant turn .* own 'reference'"):
        PromptTable([rows[2]], None, max_prompt_length=8)


def test_a_reward_that_reads_another_column_hears_where_the_answer_went(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(ANSWERED) + "\n")
    with pytest.raises(ValueError, match=r"data.jsonl:1: row has no 'answer', which reward 'accuracy' reads; add it or "
                                         r"choose another reward \(its 'reference', where a conversation's closing "
                                         r"assistant turn goes, holds '4': copy it to 'answer' if it is the answer\)"):
        check_reward_columns(str(path), "accuracy")
