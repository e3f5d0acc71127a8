"""The generate fast path: DESIGN §3 rows, reward placement, masks, and its input checks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from textrl.core.checks import check_rollout
from textrl.envs.fast_path import default_tokenizer, rollout_from_responses
from textrl.envs.prompts.table import PromptTable
from textrl.keys import KEYS
from textrl.models import build_tiny_tokenizer
from textrl.rewards import RewardError, parse_reward_spec, think_format_reward

EOS = 3
VOCAB = 512
TAGS = [508, 509, 510, 511]


def pad_eq_eos_tokenizer():
    """The tiny tokenizer with ``pad_token = eos_token`` (as many chat models ship)."""
    tok = build_tiny_tokenizer()
    tok.pad_token = tok.eos_token
    return tok


def draw_responses(gen: torch.Generator, b: int, t: int, pad: int, eos: int = EOS) -> torch.Tensor:
    """int64 ``[b, t]`` responses covering EOS first, EOS mid-way, truncated and random rows.

    Tokens are drawn from the whole vocabulary (pad and tag ids included, as ordinary actions);
    everything after a row's EOS is ``pad``.
    """
    out = torch.randint(0, VOCAB, (b, t), generator=gen)
    out = torch.where(out == eos, torch.full_like(out, 4), out)  # EOS only where placed below
    tags = torch.randint(0, 2, (b, t), generator=gen).bool()
    out = torch.where(tags, torch.tensor(TAGS)[torch.randint(0, 4, (b, t), generator=gen)], out)
    for i in range(b):
        kind = i % 4 if i < 4 else int(torch.randint(0, 4, (1,), generator=gen))
        if kind == 0:
            end = 0  # EOS first
        elif kind == 1:
            end = None  # truncated: no EOS
        else:
            end = int(torch.randint(0, t, (1,), generator=gen))
        if end is not None:
            out[i, end] = eos
            out[i, end + 1 :] = pad
    return out


def prompt_batch(table: PromptTable, indices: list[int], pad: int):
    """Left-padded prompt ids / mask ``[B, P]``, prompt texts and reward fields of rows."""
    p = table.max_prompt_length
    ids = torch.full((len(indices), p), pad, dtype=torch.int64)
    mask = torch.zeros((len(indices), p), dtype=torch.bool)
    for row, k in enumerate(indices):
        x = torch.from_numpy(table.ids(k))
        ids[row, p - x.numel() :] = x
        mask[row, p - x.numel() :] = True
    fields = [table.fields(k) for k in indices]
    names = sorted({n for f in fields for n in f})
    return (
        ids,
        mask,
        [table.text(k) for k in indices],
        {n: [f.get(n) for f in fields] for n in names},
    )


def _fast(responses, tok, t, placement="last", reward="think_format,tag_count"):
    table = PromptTable(None, tok, max_prompt_length=64)
    indices = list(range(responses.shape[0]))
    ids, mask, texts, fields = prompt_batch(table, indices, tok.pad_token_id)
    return rollout_from_responses(
        ids,
        mask,
        responses,
        tokenizer=tok,
        reward_fn=reward,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        max_new_tokens=t,
        reward_placement=placement,
        fields=fields,
        prompt_texts=texts,
    )


@pytest.mark.parametrize("pad_is_eos", [False, True])
@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), t=st.integers(1, 8))
def test_rollout_rows_follow_design(pad_is_eos, seed, t):
    tok = pad_eq_eos_tokenizer() if pad_is_eos else default_tokenizer()
    gen = torch.Generator().manual_seed(seed)
    responses = draw_responses(gen, 6, t, tok.pad_token_id)
    td = _fast(responses, tok, t)
    check_rollout(td)
    mask = td[KEYS.mask]
    has_eos = (responses == EOS).any(1)
    want_len = torch.where(has_eos, (responses == EOS).int().argmax(1) + 1, t)
    assert mask.sum(1).tolist() == want_len.tolist()  # the first EOS is kept, also if pad == eos
    last = want_len - 1
    done = td[KEYS.done].squeeze(-1)
    assert done.sum(1).tolist() == [1] * 6
    assert (done.float().argmax(1) == last).all()
    assert td[KEYS.terminated].squeeze(-1).any(1).tolist() == has_eos.tolist()
    assert td[KEYS.truncated].squeeze(-1).any(1).tolist() == (~has_eos).tolist()
    action = td[KEYS.action]
    assert (action[~mask] == tok.pad_token_id).all()
    assert torch.equal(action[mask], responses[mask])

    reward = td[KEYS.reward].squeeze(-1)
    comps = td[KEYS.reward_components]
    total = comps["think_format"] + comps["tag_count"]
    assert torch.allclose(reward.sum(1), total)
    assert (reward[~mask] == 0).all()
    uniform = _fast(responses, tok, t, placement="uniform")[KEYS.reward].squeeze(-1)
    expect = torch.where(mask, (total / want_len).unsqueeze(1), torch.zeros(()))
    assert torch.allclose(uniform, expect)


def test_completions_decoded_without_specials_and_scored():
    tok = default_tokenizer()
    text = "<think>\nok\n</think>\n<answer>\n1\n</answer>"
    row = torch.tensor([tok(text, add_special_tokens=False)["input_ids"] + [EOS]])
    td = _fast(row, tok, row.shape[1], reward="think_format,tag_count,accuracy")
    comps = td[KEYS.reward_components]
    direct = think_format_reward(["q"], [text])  # EOS is dropped by skip_special_tokens
    assert comps["think_format"].tolist() == direct.tolist()
    assert comps["tag_count"].item() == 1.0
    assert comps["accuracy"].shape == (1,)


def test_short_row_without_eos_raises():
    tok = default_tokenizer()
    with pytest.raises(ValueError, match=r"no EOS and fewer than max_new_tokens=8"):
        _fast(torch.full((1, 4), 7), tok, 8)


def test_failing_reward_raises_reward_error_naming_it():
    def broken(prompts, completions, **kwargs):
        raise RuntimeError("boom")

    with pytest.raises(RewardError, match="broken"):
        _fast(torch.tensor([[7, EOS]]), default_tokenizer(), 2, reward=broken)


def test_plain_callable_reports_one_component():
    def length(prompts, completions, completion_ids, **kwargs):
        return [float(len(c)) for c in completion_ids]

    td = _fast(torch.tensor([[7, 8, EOS, 0]]), default_tokenizer(), 4, reward=length)
    assert td[KEYS.reward_component("length")].tolist() == [3.0]
    assert td[KEYS.reward].squeeze(-1).tolist() == [[0.0, 0.0, 3.0, 0.0]]


def test_composite_object_is_accepted():
    tok = default_tokenizer()
    td = _fast(torch.tensor([[508, EOS]]), tok, 2, reward=parse_reward_spec("tag_count:2"))
    assert td[KEYS.reward].sum().item() == pytest.approx(0.5)
