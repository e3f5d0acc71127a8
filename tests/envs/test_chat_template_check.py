"""A multi-turn episode's context is what the chat template renders, or the template is refused.

An episode keeps the tokens the policy sampled and appends each observation after them
(docs/design.md, "Multi-turn episodes"), so it is the template's rendering only when the template
is append-only. :func:`textrl.envs.observations.check_append_only` renders a probe conversation
whole and as an episode builds it; a template that is not (Qwen3's drops earlier ``<think>``
blocks) is refused in one line when a multi-turn runner is built and, in a run, before any model
loads. With an append-only template, the contexts the policy is given in ``guess_number`` and
``calculator`` are, token for token, the template's rendering of the conversation so far.
"""

from __future__ import annotations

import pytest

from tests.envs.chat_templates import (
    LLAMA3_STYLE,
    QWEN3_STYLE,
    QWEN25_STYLE,
    STRIP_THINK,
    SYSTEM,
    with_template,
)
from tests.envs.test_collector import batch_of, scripted
from textrl.envs import TokenMDPEnv
from textrl.envs.collector import EpisodeRunner
from textrl.envs.observations import PROBE, check_append_only, episode_contexts
from textrl.envs.registry import make_env

MULTI_TURN = ["guess_number", "calculator"]


def _chatml(messages: str, system: str = SYSTEM) -> str:
    return (system + "{%- for m in " + messages + " -%}"
            "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}{%- endfor -%}"
            "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")


# not append-only without a <think> block: the system turn counts the messages; only the last three
# messages are kept
COUNTING = _chatml("messages", "{{- '<|im_start|>system\\n' + (messages|length|string) + ' messages<|im_end|>\\n' -}}")
WINDOW = _chatml("messages[-3:]")


@pytest.fixture(scope="module")
def templates(tok):
    return {name: with_template(tok, t) for name, t in
            {"qwen2.5": QWEN25_STYLE, "llama3": LLAMA3_STYLE, "qwen3": QWEN3_STYLE, "strip": STRIP_THINK, "counting": COUNTING,
             "window": WINDOW}.items()}


def test_append_only_templates_pass_and_build_what_they_render(tok, templates):
    no_template = with_template(tok, None)
    for tokenizer in (tok, templates["qwen2.5"], templates["llama3"], no_template):
        check_append_only(tokenizer, [tok.eos_token_id])
    for built, rendered in episode_contexts(templates["qwen2.5"], [tok.eos_token_id]):
        assert built == rendered and "<think>" in built
    # the Qwen3-style template renders the probe's last context without the first turn's <think>
    (built, rendered), *_ = episode_contexts(templates["strip"], [tok.eos_token_id])
    assert PROBE[1]["content"] in built and PROBE[1]["content"] not in rendered


@pytest.mark.parametrize("name", ["qwen3", "strip"])
def test_a_think_stripping_template_is_refused_in_one_line(templates, name):
    with pytest.raises(ValueError) as err:
        check_append_only(templates[name], [templates[name].eos_token_id])
    message = str(err.value)
    assert "not append-only: it drops the <think> block of an earlier assistant turn" in message
    assert "--tokenizer" in message and "\n" not in message


def test_other_rewrites_are_refused_naming_where_the_renderings_part(templates):
    with pytest.raises(ValueError, match=r"renders a conversation differently once new messages follow it \(alone "
                                         r"'>system\\n2 messages.*followed by messages '>system\\n3 messages") as err:
        check_append_only(templates["counting"], [templates["counting"].eos_token_id])
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"renders earlier turns differently once later turns follow \(the episode "
                                         r"holds .*Guess my number.*the template renders .*higher") as err:
        check_append_only(templates["window"], [templates["window"].eos_token_id])
    assert "\n" not in str(err.value)


def test_a_template_without_the_eos_is_named(tok):
    other_end = with_template(tok, QWEN25_STYLE.replace("<|im_end|>", "<|pad|>"))
    with pytest.raises(ValueError, match="without the tokenizer's EOS"):
        check_append_only(other_end, [tok.eos_token_id])


@pytest.mark.parametrize("env_id", MULTI_TURN)
def test_guess_number_and_calculator_refuse_a_think_stripping_template(templates, env_id):
    qwen3 = templates["qwen3"]
    expected = rf"environment '{env_id}' is multi-turn and the chat template is not append-only: it drops the <think>"
    with pytest.raises(ValueError, match=expected):
        EpisodeRunner(make_env(env_id), tokenizer=qwen3, max_new_tokens=8)
    with pytest.raises(ValueError, match=expected):
        TokenMDPEnv(tokenizer=qwen3, env=make_env(env_id), max_new_tokens=8)
    EpisodeRunner(make_env(env_id), tokenizer=templates["qwen2.5"], max_new_tokens=8)  # append-only: built


def test_a_single_turn_environment_takes_any_template(templates):
    EpisodeRunner(make_env("digits"), tokenizer=templates["qwen3"], max_new_tokens=8)
    EpisodeRunner(make_env("guess_number", max_turns=1), tokenizer=templates["qwen3"], max_new_tokens=8)


def _is_rendering(tokenizer, context, messages, template):
    """Whether ``context`` (token ids) is the template's rendering of ``messages``: token for token
    under ChatML; as text under the Llama 3 layout, whose generation prompt ends in ``"\n\n"``, one
    token when it ends the text and two before a word (a tokenisation of the same text)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if template == "llama3":
        return tokenizer.decode(context, skip_special_tokens=False) == text
    return context == tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("template", ["tiny", "qwen2.5", "llama3"])
def test_guess_number_contexts_are_the_templates_rendering(tok, templates, template):
    tokenizer = tok if template == "tiny" else templates[template]
    env = make_env("guess_number")
    row = next(r for r in env.rows() if r["secret"] == 5)
    turns = ["<think>\nStart in the middle.\n</think>\n<answer>4</answer>", "<answer>6</answer>", "<answer>5</answer>"]
    gen = scripted(tokenizer, [turns])
    td = EpisodeRunner(env, tokenizer=tokenizer, max_new_tokens=24).run(gen, batch_of(tokenizer, [row]))
    assert td.get("score").tolist() == [1.0]
    messages = [{"role": "user", "content": row["prompt"]}]
    for k, said in enumerate(["higher", "lower"]):
        messages += [{"role": "assistant", "content": turns[k]}, {"role": "user", "content": said}]
        assert _is_rendering(tokenizer, gen.calls["contexts"][k + 1], messages, template)


@pytest.mark.parametrize("template", ["tiny", "qwen2.5", "llama3"])
def test_calculator_contexts_are_the_templates_rendering(tok, templates, template):
    tokenizer = tok if template == "tiny" else templates[template]
    env = make_env("calculator", n_rows=4, n_eval=0)
    row = env.rows()[0]
    a, b = row["expression"].split(" * ")
    call = f"<think>\nUse the tool.\n</think>\n<tool>{a}*{b}</tool>"
    turns = [call, "no tool", f"<answer>{row['answer']}</answer>"]
    gen = scripted(tokenizer, [turns], eos=[[False, True, True]])  # the first turn ends at the stop string
    td = EpisodeRunner(env, tokenizer=tokenizer, max_new_tokens=40, max_episode_tokens=400).run(
        gen, batch_of(tokenizer, [row]))
    assert td.get("score").tolist() == [1.0]
    messages = [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": call},
                {"role": "tool", "content": row["answer"]}]
    assert _is_rendering(tokenizer, gen.calls["contexts"][1], messages, template)
    messages += [{"role": "assistant", "content": "no tool"},
                 {"role": "user", "content": f"No tool call or answer. {env.INSTRUCTION}"}]
    assert _is_rendering(tokenizer, gen.calls["contexts"][2], messages, template)


def _no_model(*args, **kwargs):
    raise AssertionError("the run reached its models")


@pytest.mark.parametrize("env_id", MULTI_TURN)
def test_a_run_refuses_the_template_in_one_line_before_any_model_loads(tok, tmp_path, monkeypatch, env_id):
    from textrl.cli import main

    monkeypatch.setattr("textrl.training.set_up.build_agent", _no_model)
    monkeypatch.setattr("textrl.models.load_causal_lm", _no_model)
    with_template(tok, QWEN3_STYLE).save_pretrained(tmp_path / "qwen3")
    with pytest.raises(SystemExit) as err:
        main(["train", "--env", env_id, "--tokenizer", str(tmp_path / "qwen3"), "--output-dir", str(tmp_path / "run")])
    message = str(err.value.code)
    assert message.startswith(f"textrl train: environment '{env_id}' is multi-turn and the chat template is not "
                              "append-only: it drops the <think> block")
    assert "\n" not in message
    # the append-only template gets past the check, to the models
    with_template(tok, QWEN25_STYLE).save_pretrained(tmp_path / "qwen2.5")
    with pytest.raises(SystemExit, match="the run reached its models"):
        main(["train", "--env", env_id, "--tokenizer", str(tmp_path / "qwen2.5"), "--output-dir", str(tmp_path / "b")])
