"""``textrl sft``: prompt tokens are masked out of the loss, training lowers it, LoRA on 4-bit runs."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from textrl.models import load_tokenizer
from textrl.run.warmup import IGNORE_INDEX, build_sft_batch, encode_sft_example
from textrl.stages.sft import SFTConfig, load_sft_pairs, parse_sft_row, train_sft


def test_prompt_positions_have_label_minus_100():
    tok = load_tokenizer("tiny")
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                    {"role": "user", "content": "Describe the sky. Use capital letters."}]
    pairs = [("Describe the sky. Use small letters.", "the sky is blue."), (conversation, "THE SKY.")]
    batch = build_sft_batch(tok, pairs)
    for b, (prompt, response) in enumerate(pairs):
        ids, n_prompt = encode_sft_example(tok, prompt, response)
        labels = batch["labels"][b]
        assert (labels[:n_prompt] == IGNORE_INDEX).all()
        assert labels[n_prompt:len(ids)].tolist() == ids[n_prompt:]  # response and EOS
        assert (labels[len(ids):] == IGNORE_INDEX).all()  # padding
        assert ids[-1] == tok.eos_token_id
        assert tok.decode(ids[n_prompt:-1]) == response
        assert tok.decode(ids[:n_prompt]).endswith("<|im_start|>assistant\n")


@pytest.mark.slow
def test_sft_lowers_the_completion_loss_and_writes_its_outputs(tmp_path):
    config = SFTConfig(output_dir=str(tmp_path), steps=40, eval_size=16, eval_every=20, progress=False)
    summary = train_sft(config)
    assert summary["after"]["loss"] < summary["before"]["loss"] - 1.0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == list(range(1, 41))
    assert "eval/loss" in rows[19] and "eval/loss" in rows[39] and "eval/loss" not in rows[0]
    assert (tmp_path / "config.yaml").is_file() and (tmp_path / "summary.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.slow
def test_lora_on_a_4bit_base_runs_a_step_on_cpu(tmp_path):
    from peft import PeftConfig

    config = SFTConfig(output_dir=str(tmp_path), steps=1, batch_size=4, eval_size=4, lora=True,
                       load_in_4bit=True, device="cpu", progress=False)
    summary = train_sft(config)
    assert math.isfinite(summary["after"]["loss"])
    step = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert math.isfinite(step["loss"]) and step["grad_norm"] > 0
    meta = json.loads((tmp_path / "model" / "textrl_adapter.json").read_text())
    assert meta == {"format": "textrl-lora", "version": 1, "base_model": "tiny", "load_in_4bit": True,
                    "stage": "sft"}
    assert PeftConfig.from_pretrained(str(tmp_path / "model")).r == 8


def test_sft_rows_prompt_response_and_conversations(tmp_path):
    path = tmp_path / "sft.jsonl"
    rows = [
        {"prompt": "Hi", "response": "Hello."},
        {"prompt": "Hi", "completion": "Hey."},
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo."}]},
        {"conversations": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
                           {"role": "assistant", "content": "A"}]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    pairs = load_sft_pairs(path)
    assert pairs[:3] == [("Hi", "Hello."), ("Hi", "Hey."), ("Hi", "Yo.")]
    assert pairs[3] == ([{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}], "A")
    assert len(load_sft_pairs("builtin:case")) == 1024


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"response": "x"}, "missing field 'prompt'"),
        ({"prompt": "p"}, "missing field 'response'"),
        ({"prompt": "p", "response": ""}, "the response must be a non-empty string"),
        ({"messages": [{"role": "user", "content": "Hi"}]}, "field .messages. must end with an assistant turn"),
        ({"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]},
         r"field 'messages'\[0\] needs string 'role' and 'content'"),
    ],
)
def test_malformed_sft_rows_name_the_row(row, message):
    with pytest.raises(ValueError, match=f"row 5: {message}"):
        parse_sft_row(row, "row 5")
