"""Padding-free layouts (textrl.models.packing) and the models run on them
(textrl.models.packed_forward): every attended token lands in a packed slot with its padded
position, each pick is the slot before its response token, ``scatter`` puts the picks back; the
logits, hidden states and values of packed rows (bins, one row, one row at a time) equal the padded
forward's under sdpa and eager, for a tiny Llama and GPT-2, with their gradients; a model that
ignores packed positions is caught by the probe and runs one row at a time, still exact.
"""

from __future__ import annotations

import doctest

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from tests.arithmetic import assert_gradients_close, model_rtol
from textrl.core.precision import set_attn_implementation
from textrl.models import ValueModel, build_tiny_causal_lm, build_tiny_gpt2, build_tiny_tokenizer
from textrl.models import packing as packing_module
from textrl.models.forward import response_logits
from textrl.models.packed_forward import (
    critic_layout,
    honours_packed_positions,
    packed_hidden,
    packed_logits,
    packed_values,
    packing_layout,
)
from textrl.models.packing import (
    LAYOUTS,
    first_fit_decreasing,
    pack_last_tokens,
    pack_rows,
    padding_fraction,
)
from textrl.testing import assert_close_normwise


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


@st.composite
def batches(draw, max_rows: int = 5):
    """Ragged prompts padded on the left, responses padded on the right (some rows without a
    response token, some batches without padding), random token ids."""
    rows = draw(st.integers(1, max_rows))
    prompt_lengths = draw(st.lists(st.integers(1, 6), min_size=rows, max_size=rows))
    width = draw(st.integers(0, 7))
    response_lengths = draw(st.lists(st.integers(0, width), min_size=rows, max_size=rows))
    p = max(prompt_lengths)
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    ids = torch.randint(4, 500, (rows, p + width), generator=g)
    mask = torch.zeros(rows, p + width, dtype=torch.bool)
    for b, (n_prompt, n_response) in enumerate(zip(prompt_lengths, response_lengths)):
        mask[b, p - n_prompt : p + n_response] = True
        ids[b, ~mask[b]] = 0
    return ids, mask, p


def test_the_doctests_run():
    assert doctest.testmod(packing_module).failed == 0


def test_first_fit_decreasing_fills_the_first_bin_with_room():
    assert first_fit_decreasing([4, 1, 3, 2, 0, 4], 4) == [[0], [5], [2, 1], [3]]
    assert first_fit_decreasing([], 4) == [] and first_fit_decreasing([0, 0], 3) == []


@settings(max_examples=60, deadline=None)
@given(batch=batches(), layout=st.sampled_from(LAYOUTS))
def test_every_attended_token_is_packed_with_its_position_and_each_pick_precedes_its_token(batch, layout):
    ids, mask, p = batch
    packed = pack_rows(ids, mask, p, layout)
    response = mask[:, p:]
    assert packed.picks == int(response.sum()) and packed.shape == tuple(response.shape)
    # each pick is the slot before its response token, at the padded batch's position of that column
    tokens = torch.cat([call.input_ids.reshape(-1)[call.picks + 1] for call in packed.calls]) if packed.calls else \
        torch.zeros(0, dtype=torch.long)
    positions = torch.cat([call.position_ids.reshape(-1)[call.picks] for call in packed.calls]) if packed.calls else \
        torch.zeros(0, dtype=torch.long)
    assert torch.equal(tokens, packed.gather(ids[:, p:]))
    padded_positions = (mask.long().cumsum(1) - 1)[:, p - 1 : -1]  # the column before each response token
    assert torch.equal(positions, packed.gather(padded_positions))
    # every row with a response token is packed whole (its tokens in order, positions 0, 1, ...), once
    runs = [ids[b, mask[b]].tolist() for b in range(ids.shape[0]) if response[b].any()]
    found = []
    for call in packed.calls:
        for row_ids, row_pos in zip(call.input_ids.tolist(), call.position_ids.tolist()):
            starts = [i for i, pos in enumerate(row_pos) if pos == 0] + [len(row_pos)]
            found += [row_ids[a:b] for a, b in zip(starts, starts[1:])]
    for run in runs:
        assert run in found
        found.remove(run)
    assert all(set(rest) == {0} for rest in found)  # what is left is the bins' room: token 0
    # the slots run: the real tokens and, in bins, the room of the longest row's width
    real = sum(map(len, runs))
    if layout != "bins":
        assert packed.slots == real
    else:
        assert real <= packed.slots <= len(runs) * max(map(len, runs), default=0)
    values = torch.randn(packed.picks, 3)
    scattered = packed.scatter(values, fill=-1.0)
    assert torch.equal(scattered[response], values) and bool((scattered[~response] == -1.0).all())


@settings(max_examples=60, deadline=None)
@given(batch=batches(), layout=st.sampled_from(LAYOUTS))
def test_a_scorers_pick_is_each_rows_last_attended_token_at_its_padded_position(batch, layout):
    ids, mask, _ = batch
    packed = pack_last_tokens(ids, mask, layout)
    last = torch.where(mask, torch.arange(mask.shape[1]), -1).argmax(1)  # [B]: each row's last attended column
    rows = torch.arange(ids.shape[0])
    assert packed.shape == (ids.shape[0], 1) and packed.picks == ids.shape[0]  # every row has a prompt token
    tokens = torch.cat([call.input_ids.reshape(-1)[call.picks] for call in packed.calls])
    positions = torch.cat([call.position_ids.reshape(-1)[call.picks] for call in packed.calls])
    assert torch.equal(tokens, packed.gather(ids[rows, last][:, None]))
    assert torch.equal(positions, packed.gather(mask.sum(1, keepdim=True) - 1))  # cumsum(mask) - 1 there
    assert packed.slots == int(mask.sum()) if layout != "bins" else packed.slots <= mask.shape[0] * int(mask.sum(1).max())
    values = torch.randn(packed.picks)
    assert torch.equal(packed.scatter(values)[packed.dest, 0], values)


def test_the_calls_of_each_layout():
    ids = torch.tensor([[0, 0, 5, 6, 7, 0], [8, 9, 10, 11, 12, 13], [0, 14, 15, 16, 0, 0]])
    mask = ids != 0
    bins = pack_rows(ids, mask, 3, "bins")
    assert len(bins.calls) == 1 and bins.calls[0].attention_mask is None
    assert bins.calls[0].input_ids.tolist() == [[8, 9, 10, 11, 12, 13], [5, 6, 7, 14, 15, 16]]
    assert bins.calls[0].position_ids.tolist() == [[0, 1, 2, 3, 4, 5], [0, 1, 2, 0, 1, 2]]
    one = pack_rows(ids, mask, 3, "one_row")
    assert one.calls[0].input_ids.tolist() == [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]]
    rows = pack_rows(ids, mask, 3, "per_row")
    assert [c.input_ids.tolist() for c in rows.calls] == [[[5, 6, 7]], [[8, 9, 10, 11, 12, 13]], [[14, 15, 16]]]
    assert all(c.attention_mask is not None and bool(c.attention_mask.all()) for c in rows.calls)
    assert padding_fraction(mask) == pytest.approx(1 - 12 / 18)


@pytest.mark.parametrize("mask, p, message", [
    ([[1, 1, 0, 1]], 2, "row 0 attends to columns that are not one run"),
    ([[0, 0, 1, 1]], 2, "row 0 has a response but no attended prompt token"),
    ([[1, 1, 1, 1]], 0, "prompt_len=0 must lie in"),
])
def test_a_batch_that_cannot_be_packed_is_refused(mask, p, message):
    mask = torch.tensor(mask, dtype=torch.bool)
    with pytest.raises(ValueError, match=message):
        pack_rows(torch.ones_like(mask, dtype=torch.long), mask, p, "bins")
    with pytest.raises(ValueError, match="layout='rows' must be one of one_row, bins, per_row"):
        pack_rows(torch.ones(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.bool), 1, "rows")


def tiny(tok, kind: str, attn: str):
    model = (build_tiny_gpt2 if kind == "gpt2" else build_tiny_causal_lm)(tok, seed=1)
    set_attn_implementation(model, attn)
    return model


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def ragged(seed: int = 0, rows: int = 5, p: int = 6, width: int = 9):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 500, (rows, p + width), generator=g)
    prompt = torch.randint(1, p + 1, (rows,), generator=g)
    response = torch.randint(1, width + 1, (rows,), generator=g)
    columns = torch.arange(p + width)
    mask = (columns >= p - prompt[:, None]) & (columns < p + response[:, None])
    return torch.where(mask, ids, 0), mask, p


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_packed_logits_hidden_and_gradients_equal_the_padded_forwards(tok, kind, attn, layout):
    model = tiny(tok, kind, attn).train()
    assert packing_layout(model, "cpu") == "bins"  # transformers' masks honour packed positions
    ids, mask, p = ragged()
    packed = pack_rows(ids, mask, p, layout)
    weights = torch.randn(packed.picks, model.config.vocab_size, generator=torch.Generator().manual_seed(2))
    want = packed.gather(response_logits(model, ids, mask, p))  # [n, V]
    (want * weights).sum().backward()
    want_grads = grads(model)
    model.zero_grad(set_to_none=True)
    got = packed_logits(model, packed)
    (got * weights).sum().backward()
    rtol = model_rtol(model.config, ids.numel())
    assert_close_normwise(got, want, rtol, name="logits")
    assert_gradients_close(grads(model), want_grads, rtol)
    hidden, head = packed_hidden(model, packed)
    assert_close_normwise(head(hidden), want, rtol, name="head(hidden)")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_packed_values_equal_the_padded_critics(tok, layout):
    critic = ValueModel.from_causal_lm(build_tiny_causal_lm(tok, seed=1))
    with torch.no_grad():
        critic.value_head.weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(3))
    assert critic_layout(critic, "cpu") == "bins"
    ids, mask, p = ragged(seed=4)
    packed = pack_rows(ids, mask, p, layout)
    want = packed.gather(critic(ids, mask)[:, p - 1 : -1])
    want.sum().backward()
    want_grads = grads(critic)
    critic.zero_grad(set_to_none=True)
    got = packed_values(critic, packed)
    got.sum().backward()
    rtol = model_rtol(critic.config, ids.numel())
    assert_close_normwise(got, want, rtol, name="values")
    assert_gradients_close(grads(critic), want_grads, rtol)


class Leaky(nn.Module):
    """A causal LM that attends across packed rows: without a mask it makes one of all ones (so
    positions restarting never reach transformers' packed masks)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.config = model.config

    def get_output_embeddings(self) -> nn.Module:
        return self.model.get_output_embeddings()

    def forward(self, input_ids, attention_mask=None, position_ids=None, **kwargs):
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        return self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)


def test_a_model_that_attends_across_packed_rows_runs_one_row_at_a_time(tok):
    leaky = Leaky(tiny(tok, "llama", "sdpa"))
    assert not honours_packed_positions(leaky, "cpu") and packing_layout(leaky, "cpu") == "per_row"
    ids, mask, p = ragged(seed=5)
    mask[0] = True  # one row as long as the batch: the bins hold several of the others
    ids[0] = 7
    assert len(pack_rows(ids, mask, p, "bins").calls[0].input_ids) < ids.shape[0]
    want = pack_rows(ids, mask, p, "bins").gather(response_logits(leaky, ids, mask, p))
    wrong = packed_logits(leaky, pack_rows(ids, mask, p, "bins"))  # packed anyway: rows see each other
    right = packed_logits(leaky, pack_rows(ids, mask, p, "per_row"))
    rtol = model_rtol(leaky.config, ids.numel())
    assert_close_normwise(right, want, rtol, name="per-row logits")
    assert float((wrong - want).norm()) > 1e3 * rtol * float(want.norm())


def test_a_model_without_an_output_per_position_is_probed_as_per_row(tok):
    from textrl.models import build_tiny_reward_model

    classifier = build_tiny_reward_model(tok)  # pooled logits [1, 1]: nothing to compare position by position
    assert not honours_packed_positions(classifier, "cpu") and packing_layout(classifier, "cpu") == "per_row"
    assert honours_packed_positions(classifier.model, "cpu")  # its body: hidden states per position


def test_the_probe_restores_each_modules_mode(tok):
    model = tiny(tok, "llama", "sdpa").train()
    model.model.layers[0].eval()
    before = [m.training for m in model.modules()]
    assert honours_packed_positions(model, "cpu")
    assert [m.training for m in model.modules()] == before


def test_the_layout_follows_the_attention_implementation(tok, monkeypatch):
    from textrl.models import packed_forward

    model = tiny(tok, "llama", "sdpa")
    assert packing_layout(model, "cpu") == "bins"
    monkeypatch.setattr(packed_forward, "honours_packed_positions", lambda model, device: True)  # no flash-attn here
    monkeypatch.setattr(model.config, "_attn_implementation", "flash_attention_2")
    assert packing_layout(model, "cpu") == "one_row"  # varlen kernels: one [1, N] row
    monkeypatch.setattr(packed_forward, "honours_packed_positions", lambda model, device: False)
    monkeypatch.setattr(model.config, "_attn_implementation", "eager")
    assert packing_layout(model, "cpu") == "per_row"  # probed again for the new kernels


def _arch(name: str):
    import transformers as tf

    small = dict(vocab_size=128, hidden_size=32, num_attention_heads=4)
    if name == "opt":
        return tf.OPTForCausalLM(tf.OPTConfig(**small, ffn_dim=64, num_hidden_layers=2, word_embed_proj_dim=32))
    if name == "bloom":
        return tf.BloomForCausalLM(tf.BloomConfig(vocab_size=128, hidden_size=32, n_layer=2, n_head=4,
                                                  attn_implementation="eager"))
    config, model = {"qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM), "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
                     "gpt_neox": (tf.GPTNeoXConfig, tf.GPTNeoXForCausalLM)}[name]
    heads = {} if name == "gpt_neox" else {"num_key_value_heads": 2}
    return model(config(**small, **heads, intermediate_size=64, num_hidden_layers=2))


@pytest.mark.parametrize("name, layout", [("qwen2", "bins"), ("mistral", "bins"), ("gpt_neox", "bins"),
                                          ("opt", "per_row"), ("bloom", "per_row")])
def test_each_architecture_takes_its_layout_and_equals_its_padded_forward(name, layout):
    """docs/training.md's list: the models whose masks follow packed position ids, and two whose
    masks do not (OPT, Bloom), which run one unpadded row at a time."""
    torch.manual_seed(0)
    model = _arch(name).eval()
    assert packing_layout(model, "cpu") == layout
    ids, mask, p = ragged(seed=6)
    ids = ids % 128
    packed = pack_rows(ids, mask, p, layout)
    want = packed.gather(response_logits(model, ids, mask, p))
    assert_close_normwise(packed_logits(model, packed), want, model_rtol(model.config, ids.numel()), name=name)
