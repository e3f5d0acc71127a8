"""textrl.models.forward: no forward with gradients hands a fully masked attention row to a kernel,
and left-aligning the rows changes no output beyond rounding.

The spy wraps ``torch.nn.functional.scaled_dot_product_attention`` (what transformers' sdpa
attention calls) and records, for every call that builds a graph, whether a query row of its mask
attends to nothing: that row is what gives NaN gradients in the fused CUDA kernels (cuDNN since
PyTorch 2.11). The spy is first shown to see such rows in a plain left-padded forward.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.agents.conftest import PROMPTS, collect, make_agent
from tests.arithmetic import model_rtol
from textrl.models import ValueModel, build_tiny_causal_lm, build_tiny_tokenizer
from textrl.models.forward import (
    hidden_states,
    leading_padding,
    positions_from_mask,
    response_logits,
    rotate_rows,
)
from textrl.testing import assert_close_normwise


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


class AttentionSpy:
    """Every SDPA call made while autograd records: ``masked`` (a mask was passed, with at least one
    padded key) and ``fully_masked`` (some query row of the mask attends to nothing)."""

    def __init__(self) -> None:
        self.calls: list[dict[str, bool]] = []

    def wrap(self, real):
        def spy(query, key, value, attn_mask=None, *args, **kwargs):
            if torch.is_grad_enabled() and query.requires_grad:
                entry = {"masked": False, "fully_masked": False}
                if attn_mask is not None:
                    allowed = attn_mask if attn_mask.dtype == torch.bool else attn_mask > torch.finfo(attn_mask.dtype).min / 2
                    entry["masked"] = bool((~allowed).any())
                    entry["fully_masked"] = bool((~allowed.any(dim=-1)).any())
                self.calls.append(entry)
            return real(query, key, value, attn_mask, *args, **kwargs)

        return spy

    @property
    def fully_masked(self) -> int:
        return sum(c["fully_masked"] for c in self.calls)

    @property
    def padded(self) -> int:
        return sum(c["masked"] for c in self.calls)


@pytest.fixture
def spy(monkeypatch):
    watcher = AttentionSpy()
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        watcher.wrap(torch.nn.functional.scaled_dot_product_attention))
    return watcher


def left_padded(tok, texts):
    enc = tok(list(texts), return_tensors="pt", padding=True)  # the tiny tokenizer pads on the left
    return enc["input_ids"], enc["attention_mask"].bool()


# -- the pure pieces --------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), min_size=1, max_size=5), st.integers(0, 3))
def test_rotating_rows_left_then_right_gives_them_back_and_moves_leading_padding_to_the_end(rows, extra):
    width = max(lead + n for lead, n in rows) + extra
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for b, (lead, n) in enumerate(rows):
        mask[b, lead : lead + n] = True
    x = torch.randn(len(rows), width, 3)
    shift = leading_padding(mask)
    expected = [lead if n else 0 for lead, n in rows]
    assert shift.tolist() == expected
    aligned = rotate_rows(mask, shift)
    for b, (_, n) in enumerate(rows):  # each row's tokens from column 0, padding after them
        assert aligned[b, :n].all() and not aligned[b, n:].any()
    assert torch.equal(rotate_rows(rotate_rows(x, shift), -shift), x)
    positions = positions_from_mask(aligned)
    for b, (_, n) in enumerate(rows):  # every token keeps the position it had
        assert positions[b, :n].tolist() == list(range(n))


def test_rotate_rows_refuses_a_shift_of_another_batch():
    with pytest.raises(ValueError, match=r"shift \[B\]"):
        rotate_rows(torch.zeros(2, 3), torch.zeros(3, dtype=torch.long))


def test_response_logits_refuses_a_prompt_length_outside_the_inputs(tok):
    model = build_tiny_causal_lm(tok)
    with pytest.raises(ValueError, match="prompt_len=0"):
        response_logits(model, torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 4), 0)


# -- left and right padding agree -------------------------------------------------------------------


def test_left_padded_logits_and_hidden_states_equal_each_row_alone(tok):
    model = build_tiny_causal_lm(tok).eval()
    ids, mask = left_padded(tok, PROMPTS)
    assert leading_padding(mask).any() and not leading_padding(mask).all()
    response = torch.randint(10, 200, (len(PROMPTS), 5))
    full_ids = torch.cat([ids, response], 1)
    full_mask = torch.cat([mask, torch.ones_like(response, dtype=torch.bool)], 1)
    p = ids.shape[1]
    rtol = model_rtol(model.config, full_ids.numel())  # other shapes, other orders: tests/arithmetic.py
    with torch.no_grad():
        logits = response_logits(model, full_ids, full_mask, p)  # [B, 5, V]
        hidden = hidden_states(model.model, full_ids, full_mask)  # [B, P+5, H]
        for b in range(len(PROMPTS)):
            row = full_ids[b][full_mask[b]][None]  # the row alone, no padding at all
            alone = model(input_ids=row).logits[0, -6:-1]
            assert_close_normwise(logits[b], alone, rtol=rtol, name=f"row {b}'s logits")
            alone_hidden = model.model(input_ids=row).last_hidden_state[0]
            assert_close_normwise(hidden[b][full_mask[b]], alone_hidden, rtol=rtol, name=f"row {b}'s hidden states")
    assert torch.isfinite(hidden).all()  # padding positions too: nothing NaN for a masked loss to multiply


def test_the_agent_log_probs_and_values_do_not_depend_on_the_prompt_padding(tok):
    agent = make_agent(tok, "gae_ppo")
    td = collect(agent, tok)
    longer = td.clone()  # the same rows with four more columns of left padding on the prompt
    pad = torch.full((td.shape[0], 4), tok.pad_token_id)
    longer.set(("tokens", "prompt"), torch.cat([pad, td.get(("tokens", "prompt"))], 1))
    longer.set(("masks", "prompt"), torch.cat([torch.zeros_like(pad, dtype=torch.bool), td.get(("masks", "prompt"))], 1))
    a, b = agent.evaluate(td), agent.evaluate(longer)
    # the padded forward sums the attention and the layers in other shapes: equal by norm (tests/arithmetic.py)
    rtol = model_rtol(agent.policy.config, longer.get(("tokens", "prompt")).numel() + td.get("action").numel())
    for key in ("action_log_prob", "ref_log_prob", "state_value"):
        assert_close_normwise(b.get(key), a.get(key), rtol=rtol, name=key)


# -- no fully masked row under a graph ----------------------------------------------------------------


def test_the_spy_sees_the_fully_masked_rows_of_a_plain_left_padded_forward(tok, spy):
    model = build_tiny_causal_lm(tok)
    ids, mask = left_padded(tok, PROMPTS)
    model(input_ids=ids, attention_mask=mask.long(), position_ids=positions_from_mask(mask)).logits.sum().backward()
    assert spy.fully_masked > 0  # the leading padding's query rows: what the forwards here avoid


@pytest.mark.parametrize("name", ["gae_ppo", "rloo", "one_step_ppo", "multi_adapter_ppo"])
def test_an_update_never_back_propagates_through_a_fully_masked_row(tok, spy, name):
    agent = make_agent(tok, name, ppo_epochs=2)  # two epochs: the update's own forwards too
    td = collect(agent, tok)
    assert leading_padding(td.get(("masks", "prompt"))).any()  # the prompts are left-padded
    spy.calls.clear()
    metrics = agent.update(td)
    assert metrics["ppo/epochs_run"] == 2.0
    assert spy.padded > 0, "no masked attention ran under a graph: the spy saw nothing"
    assert spy.fully_masked == 0


def test_a_value_model_never_back_propagates_through_a_fully_masked_row(tok, spy):
    critic = ValueModel.from_causal_lm(build_tiny_causal_lm(tok))
    ids, mask = left_padded(tok, PROMPTS)
    critic(ids, mask).sum().backward()
    assert spy.padded > 0 and spy.fully_masked == 0


@pytest.mark.slow
def test_training_runs_never_back_propagate_through_a_fully_masked_row(tmp_path, spy):
    """Every forward with gradients of ``textrl train`` (warm-up, a multi-turn environment with
    observation gaps, a critic), ``textrl sft``, ``rm`` (left-padded pairs) and ``dpo``."""
    from textrl.config import TrainConfig
    from textrl.stages.dpo import DPOConfig, train_dpo
    from textrl.stages.rm import RMConfig, train_rm
    from textrl.stages.sft import SFTConfig, train_sft
    from textrl.training.trainer import train

    small = dict(iterations=1, prompts_per_iteration=4, n_samples_per_prompt=1, num_minibatches=1, ppo_epochs=1,
                 eval_size=4, eval_every=0, progress=False, warmup_sft_steps=2, warmup_sft_batch_size=4)
    for i, (agent, env, tokens) in enumerate([("gae_ppo", None, 6), ("gae_ppo", "guess_number", 6)]):
        with contextlib.redirect_stdout(None):
            train(TrainConfig(output_dir=str(tmp_path / f"train{i}"), agent=agent, env=env,
                              max_new_tokens=tokens, **small))
    stage = dict(steps=1, batch_size=4, eval_size=4, progress=False)
    with contextlib.redirect_stdout(None):
        train_sft(SFTConfig(output_dir=str(tmp_path / "sft"), **stage))
        train_rm(RMConfig(output_dir=str(tmp_path / "rm"), **stage))
        train_dpo(DPOConfig(output_dir=str(tmp_path / "dpo"), **stage))
    assert spy.padded > 0
    assert spy.fully_masked == 0
