"""``textrl dpo``: the sigmoid loss, a rising chosen-over-rejected margin, the LoRA reference."""

from __future__ import annotations

import pytest
import torch

from tests.arithmetic import model_rtol
from textrl.stages.dpo import DPOConfig, dpo_loss, response_logps, train_dpo
from textrl.testing import assert_close_normwise


def test_dpo_loss_closed_form_and_gradient_direction():
    pc = torch.tensor([-3.0, -5.0], requires_grad=True)
    pr = torch.tensor([-4.0, -2.0], requires_grad=True)
    rc, rr = torch.tensor([-3.5, -5.0]), torch.tensor([-3.5, -2.5])
    loss, stats = dpo_loss(pc, pr, rc, rr, beta=0.1)
    margin = 0.1 * ((pc - rc) - (pr - rr))
    torch.testing.assert_close(loss, -torch.nn.functional.logsigmoid(margin).mean())
    assert stats["accuracy"] == 0.5 and stats["margin"] == pytest.approx(margin.mean().item())
    loss.backward()
    assert (pc.grad < 0).all() and (pr.grad > 0).all()  # descent raises chosen, lowers rejected


def test_response_logps_sum_only_response_tokens():
    from textrl.models import load_causal_lm, load_tokenizer
    from textrl.run.warmup import build_sft_batch

    tok, model = load_tokenizer("tiny"), load_causal_lm("tiny")
    batch = build_sft_batch(tok, [("Hi", "a"), ("A much longer prompt here", "a")])
    with torch.no_grad():
        logps = response_logps(model, batch)
        alone = [response_logps(model, build_sft_batch(tok, [pair]))
                 for pair in [("Hi", "a"), ("A much longer prompt here", "a")]]
    # sums of log-probs (all < 0: no cancellation) of padded and unpadded forwards: equal by norm
    # (tests/arithmetic.py)
    rtol = model_rtol(model.config, batch["input_ids"].numel())
    assert_close_normwise(logps, torch.cat(alone), rtol=rtol, name="response log-probs")


@pytest.mark.slow
def test_dpo_raises_the_chosen_over_rejected_margin(sft_model, tmp_path):
    config = DPOConfig(output_dir=str(tmp_path), model=sft_model, steps=20, eval_every=0, progress=False)
    summary = train_dpo(config)
    before, after = summary["before"], summary["after"]
    assert before["margin"] == pytest.approx(0.0, abs=1e-5)  # the reference is the start
    assert after["margin"] > 0.4 and after["accuracy"] > 0.65  # measured 0.86 and 0.80
    assert after["logp_margin"] > before["logp_margin"] + 4


@pytest.mark.slow
def test_lora_dpo_reference_is_the_base_with_the_adapter_disabled(sft_model, tmp_path):
    from safetensors.torch import load_file

    config = DPOConfig(output_dir=str(tmp_path), model=sft_model, steps=20, lr=1e-2, lora=True,
                       eval_every=0, progress=False)
    summary = train_dpo(config)
    assert summary["before"]["margin"] == pytest.approx(0.0, abs=1e-5)
    assert summary["after"]["margin"] > 0.15  # measured 0.36 after 20 steps
    adapter = load_file(str(tmp_path / "model" / "adapter_model.safetensors"))
    assert adapter and all("lora_" in name for name in adapter)  # only the adapter is saved
