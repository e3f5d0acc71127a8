from __future__ import annotations

import math
import string

import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import GPT2Config, GPT2ForSequenceClassification, PreTrainedTokenizerFast

from tests.arithmetic import assert_within, head_tolerance, model_rtol
from textrl.core.precision import set_attn_implementation
from textrl.models import build_tiny_reward_model, build_tiny_tokenizer, tiny_model_path
from textrl.models.adapters import last_token_hidden
from textrl.models.packed_forward import honours_packed_positions, packed_scores, scorer_layout
from textrl.models.packing import LAYOUTS, pack_last_tokens
from textrl.rewards import NeuralReward, call_reward, get_reward, parse_reward_spec, reward_name
from textrl.testing import unit_roundoff

PROMPTS = [
    "What is 2+2?",
    "Hi",
    "Write a short poem about the sea. " * 4,
    "Explain why the sky is blue.",
    "List the first five prime numbers.",
    "x",
    "How many days are there in a week?",
]
COMPLETIONS = [
    "<think>\nI add.\n</think>\n<answer>\n4\n</answer>",
    "hello",
    "The sea is wide and blue, the waves come home.",
    "",
    "<answer>2, 3, 5, 7, 11</answer> done",
    "y" * 40,
    "There are seven days in a week.",
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    return build_tiny_reward_model(tokenizer, seed=3)


@pytest.fixture(scope="module")
def gpt2(tokenizer):
    return tiny_gpt2_reward_model(tokenizer)


def tiny_gpt2_reward_model(tokenizer) -> GPT2ForSequenceClassification:
    """A seeded GPT-2 (absolute positions) with a scalar score head."""
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=256,
        n_embd=32,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return GPT2ForSequenceClassification(config).eval()


def char_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level policy tokenizer with a vocab unrelated to the tiny BPE."""
    chars = sorted(set(string.printable))
    vocab = {"<pad>": 0, "<unk>": 1, "</s>": 2} | {c: i + 3 for i, c in enumerate(chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="</s>"
    )


def one_by_one(reward: NeuralReward, prompts, completions) -> torch.Tensor:
    return torch.cat(
        [reward(prompts[i : i + 1], completions[i : i + 1]) for i in range(len(prompts))]
    )


def score_tolerance(reward: NeuralReward, prompts, completions) -> torch.Tensor:
    """``[B]``: how far apart two computations of each row's raw score (a padded batch, the row
    alone) may be, from the arithmetic (tests/arithmetic.py): the body's normwise error in the last
    hidden state, then the score head's dot product, which cancels (terms of ~0.8 for scores of
    ~0.1), times its terms' magnitudes. Clipping and the baseline move no two scores further apart."""
    rows = reward.encode(prompts, completions)
    with torch.no_grad():
        hidden = torch.cat([last_token_hidden(reward.model, torch.tensor([r]), torch.ones(1, len(r), dtype=torch.long))
                            for r in rows])
    rtol = model_rtol(reward.model.config, len(rows) * max(map(len, rows)))
    return head_tolerance(hidden, reward.model.score.weight, rtol).squeeze(-1)


def test_batch_equals_rows_one_by_one_across_micro_batches(model, tokenizer):
    reward = NeuralReward(model, tokenizer, batch_size=3, clip=None)
    batch = reward(PROMPTS, COMPLETIONS)
    assert batch.dtype == torch.float32 and batch.shape == (len(PROMPTS),)
    assert batch.device == torch.device("cpu")
    assert_within(batch, one_by_one(reward, PROMPTS, COMPLETIONS), score_tolerance(reward, PROMPTS, COMPLETIONS), "scores")
    assert len(set(batch.tolist())) == len(PROMPTS)  # rows really differ


def test_forward_passes_are_batched(model, tokenizer):
    sizes = []
    hook = model.register_forward_pre_hook(
        lambda _m, _a, kw: sizes.append(kw["input_ids"].shape[0]), with_kwargs=True
    )
    try:
        NeuralReward(model, tokenizer, batch_size=3)(PROMPTS, COMPLETIONS)
    finally:
        hook.remove()
    assert sizes == [3, 3, 1]


def test_absolute_positions_left_padded_row_scores_as_alone(gpt2, tokenizer):
    reward = NeuralReward(gpt2, tokenizer, batch_size=8, clip=None)
    batch = reward(PROMPTS, COMPLETIONS)
    assert_within(batch, one_by_one(reward, PROMPTS, COMPLETIONS), score_tolerance(reward, PROMPTS, COMPLETIONS), "scores")

    # Without explicit position_ids, GPT-2 gives a left-padded row other positions: the test bites.
    ids = reward.encode(PROMPTS[:2], COMPLETIONS[:2])
    short = min(ids, key=len)
    width = max(map(len, ids))
    padded = torch.tensor([[tokenizer.pad_token_id] * (width - len(short)) + short])
    mask = (torch.arange(width) >= width - len(short)).long()[None]
    with torch.no_grad():
        naive = gpt2(input_ids=padded, attention_mask=mask).logits[0, 0]
        alone = gpt2(input_ids=torch.tensor([short])).logits[0, 0]
    assert not math.isclose(naive.item(), alone.item(), abs_tol=1e-4)


@pytest.fixture(scope="module")
def loud_model(tokenizer):
    """The tiny reward model with its score head scaled so raw scores leave [-3, 3]."""
    loud = build_tiny_reward_model(tokenizer, seed=3)
    with torch.no_grad():
        loud.score.weight.mul_(200.0)
    return loud


@pytest.mark.parametrize("clip", [(-3.0, 3.0), (-1.0, 0.5), None])
@pytest.mark.parametrize("baseline", [0.0, 1.5])
def test_clip_and_baseline_closed_form(loud_model, tokenizer, clip, baseline):
    raw = NeuralReward(loud_model, tokenizer, clip=None).score_raw(PROMPTS, COMPLETIONS)
    assert raw.abs().max() > 3.0  # some rows are clipped
    got = NeuralReward(loud_model, tokenizer, clip=clip, baseline=baseline)(PROMPTS, COMPLETIONS)
    expected = raw - baseline
    if clip is not None:
        expected = expected.clamp(*clip)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


def test_answer_blend_is_weighted_whole_and_answer_scores(model, tokenizer):
    plain = NeuralReward(model, tokenizer, batch_size=4)
    blended = NeuralReward(model, tokenizer, batch_size=4, answer_blend=(0.4, 0.6))
    whole = plain(PROMPTS, COMPLETIONS)
    got = blended(PROMPTS, COMPLETIONS)
    answers = {0: "4", 4: "2, 3, 5, 7, 11"}  # stripped content of the first <answer> block
    # each score within its computations' tolerance (score_tolerance), the blend's weights on them
    tol = score_tolerance(plain, PROMPTS, COMPLETIONS)
    for i in range(len(PROMPTS)):
        if i in answers:
            answer = plain([PROMPTS[i]], [answers[i]])[0]
            expected = 0.4 * whole[i] + 0.6 * answer
            tol_i = 0.4 * tol[i] + 0.6 * score_tolerance(plain, [PROMPTS[i]], [answers[i]])[0]
        else:
            expected, tol_i = whole[i], tol[i]
        assert_within(got[i], expected, tol_i + 4 * unit_roundoff() * abs(expected.item()), f"row {i}")
    assert not torch.allclose(got[[0, 4]], whole[[0, 4]])


def test_policy_tokenizer_differs_text_is_authoritative(model, tokenizer):
    policy = char_tokenizer()
    assert len(policy) != len(tokenizer)
    reward = NeuralReward(model, tokenizer, policy_tokenizer=policy, batch_size=4)
    ids = [policy.encode(c, add_special_tokens=False) for c in COMPLETIONS]
    decoded = reward.decode_completions(ids)
    assert decoded == COMPLETIONS
    direct = reward(PROMPTS, COMPLETIONS)
    via_ids = reward(PROMPTS, decoded, completion_ids=ids)  # ids are ignored
    torch.testing.assert_close(via_ids, direct, atol=1e-6, rtol=0)

    width = max(map(len, ids))
    padded = torch.tensor([row + [policy.pad_token_id] * (width - len(row)) for row in ids])
    mask = torch.tensor([[j < len(row) for j in range(width)] for row in ids])
    assert reward.decode_completions(padded, mask) == COMPLETIONS


def test_decode_completions_without_policy_tokenizer_says_what_to_pass(model, tokenizer):
    with pytest.raises(ValueError, match="policy_tokenizer="):
        NeuralReward(model, tokenizer).decode_completions([[1, 2]])


def test_mismatched_vocab_raises_with_both_sizes(model):
    policy = char_tokenizer()
    with pytest.raises(ValueError, match=rf"vocab size is 512 .* has {len(policy)} tokens") as err:
        NeuralReward(model, policy)
    assert "reward model's own tokenizer" in str(err.value)


def test_tokenizer_without_pad_token_raises(model):
    tokenizer = build_tiny_tokenizer()
    tokenizer.pad_token = None
    with pytest.raises(ValueError, match="no pad token.*set one"):
        NeuralReward(model, tokenizer)


def test_non_scalar_head_raises(tokenizer):
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=16, n_layer=1, n_head=2, num_labels=2)
    with pytest.raises(ValueError, match="num_labels=2"):
        NeuralReward(GPT2ForSequenceClassification(config), tokenizer)


def test_get_reward_and_spec_load_a_saved_reward_model(tmp_path, monkeypatch):
    monkeypatch.setenv("TEXTRL_CACHE", str(tmp_path))
    path = tiny_model_path("reward_model", cache_dir=tmp_path)
    reward = get_reward("reward_model:" + str(path), batch_size=2)
    assert isinstance(reward, NeuralReward) and reward_name(reward) == "reward_model"
    scores = call_reward(reward, PROMPTS, COMPLETIONS)
    assert scores.shape == (len(PROMPTS),)

    composite = parse_reward_spec(f"think_format,reward_model:{path}:0.5")
    assert composite.weights == {"think_format": 1.0, "reward_model": 0.5}
    total, raw = composite.components(PROMPTS, COMPLETIONS)
    torch.testing.assert_close(raw["reward_model"], scores, atol=1e-6, rtol=0)
    torch.testing.assert_close(total, raw["think_format"] + 0.5 * scores, atol=1e-6, rtol=0)

    tiny = get_reward("reward_model:tiny")
    torch.testing.assert_close(tiny(PROMPTS, COMPLETIONS), scores, atol=1e-6, rtol=0)


def test_missing_reward_model_path_names_it():
    with pytest.raises(ValueError, match="'/no/such/rm' is neither an existing local path"):
        get_reward("reward_model:/no/such/rm")


def test_empty_reward_model_spec_says_what_to_write():
    with pytest.raises(ValueError, match="reward_model:/path/to/model"):
        get_reward("reward_model:")


def test_truncation_keeps_the_end_of_the_completion(model, tokenizer):
    prompt = ("The quick brown fox jumps over the lazy dog. " * 200).rstrip()
    completion = " There are seven days in a week."
    short = NeuralReward(model, tokenizer, max_length=24, use_chat_template=False, clip=None)
    full = NeuralReward(model, tokenizer, max_length=10_000, use_chat_template=False, clip=None)
    kept = short.encode([prompt], [completion])[0]
    whole = full.encode([prompt], [completion])[0]
    assert len(kept) == 24 and kept == whole[-24:]
    tail = tokenizer.encode(completion, add_special_tokens=False)
    assert kept[-len(tail) :] == tail

    cut_prompt = tokenizer.decode(kept)[: -len(completion)]  # the prompt with its beginning cut
    assert full.encode([cut_prompt], [completion])[0] == kept
    score = short([prompt], [completion])
    assert torch.isfinite(score).all()
    torch.testing.assert_close(score, full([cut_prompt], [completion]), atol=1e-5, rtol=0)


def test_default_max_length_is_the_model_context(model, tokenizer):
    reward = NeuralReward(model, tokenizer)
    assert reward.max_length == 512
    long_prompt = "Explain why the sky is blue. " * 400
    assert len(reward.encode([long_prompt], ["ok"])[0]) == 512
    assert torch.isfinite(reward([long_prompt], ["ok"])).all()


def test_train_mode_is_restored_and_does_not_change_scores(tokenizer):
    model = build_tiny_reward_model(tokenizer, seed=3)
    reward = NeuralReward(model, tokenizer)
    before = reward(PROMPTS, COMPLETIONS)
    model.train()
    after = reward(PROMPTS, COMPLETIONS)
    assert model.training
    torch.testing.assert_close(after, before)


def test_empty_batch(model, tokenizer):
    assert NeuralReward(model, tokenizer)([], []).shape == (0,)


@pytest.mark.parametrize("padding_free", [False, True])
def test_score_is_read_at_the_last_token_even_when_it_is_the_pad_id(model, tokenizer, padding_free):
    reward = NeuralReward(model, tokenizer, use_chat_template=False, clip=None, padding_free=padding_free)
    prompts, completions = ["What is 2+2?", "Hi"], ["4<|pad|>", "hello there"]
    ids = reward.encode(prompts, completions)
    assert ids[0][-1] == tokenizer.pad_token_id
    with torch.no_grad():
        hidden = model.model(input_ids=torch.tensor([ids[0]])).last_hidden_state  # [1, T, C]
        expected = model.score(hidden)[0, -1, 0]
    got = reward(prompts, completions)
    tol = score_tolerance(reward, prompts, completions)  # a padded batch against a row alone
    assert_within(got[0], expected, tol[0], "row 0 against its head")
    assert_within(got, one_by_one(reward, prompts, completions), tol, "scores")


# -- padding_free: rows end to end ------------------------------------------------------------------
def packed_calls(model) -> tuple[list[dict], object]:
    """A list the model's forwards' keyword arguments land in, and the hook's handle."""
    calls: list[dict] = []
    return calls, model.register_forward_pre_hook(lambda _m, _a, kw: calls.append(kw), with_kwargs=True)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_padding_free_scores_equal_the_padded_batchs_on_ragged_rows(tokenizer, kind, attn):
    model = build_tiny_reward_model(tokenizer, seed=3) if kind == "llama" else tiny_gpt2_reward_model(tokenizer)
    set_attn_implementation(model, attn)
    padded = NeuralReward(model, tokenizer, batch_size=8, clip=None)
    packed = NeuralReward(model, tokenizer, batch_size=8, clip=None, padding_free=True)
    rows = padded.encode(PROMPTS, COMPLETIONS)
    assert len(set(map(len, rows))) == len(rows)  # ragged: every row another length
    want = padded(PROMPTS, COMPLETIONS)
    calls, hook = packed_calls(model)
    try:
        got = packed(PROMPTS, COMPLETIONS)
    finally:
        hook.remove()
    assert scorer_layout(model, "cpu") == "bins"
    # one packed forward: fewer slots than the padded batch, no mask, positions restarting per row
    assert len(calls) == 1 and calls[0]["attention_mask"] is None
    assert calls[0]["input_ids"].numel() < len(rows) * max(map(len, rows))
    assert int((calls[0]["position_ids"] == 0).sum()) > calls[0]["input_ids"].shape[0]
    assert_within(got, want, score_tolerance(padded, PROMPTS, COMPLETIONS), "packed scores")
    assert len(set(got.tolist())) == len(PROMPTS)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_packed_scores_in_every_layout_are_each_rows_last_token_score(model, tokenizer, layout):
    reward = NeuralReward(model, tokenizer, clip=None)
    rows = reward.encode(PROMPTS, COMPLETIONS)
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    with torch.no_grad():
        packing = pack_last_tokens(ids, mask, layout)
        got = packing.scatter(packed_scores(model, packing)[:, 0])[:, 0]
    assert_within(got, reward.score_raw(PROMPTS, COMPLETIONS), score_tolerance(reward, PROMPTS, COMPLETIONS),
                  f"{layout} scores")


class LeakyBody(torch.nn.Module):
    """A transformer body that attends across packed rows: without a mask it makes one of all ones."""

    def __init__(self, body: torch.nn.Module) -> None:
        super().__init__()
        self.body = body

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.body.get_input_embeddings()

    def forward(self, input_ids, attention_mask=None, **kwargs):
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        return self.body(input_ids, attention_mask=mask, **kwargs)


def test_a_reward_model_whose_body_attends_across_packed_rows_scores_one_row_at_a_time(tokenizer):
    model = build_tiny_reward_model(tokenizer, seed=3)
    model.model = LeakyBody(model.model)
    assert not honours_packed_positions(model.model, "cpu") and scorer_layout(model, "cpu") == "per_row"
    padded = NeuralReward(model, tokenizer, batch_size=8, clip=None)
    packed = NeuralReward(model, tokenizer, batch_size=8, clip=None, padding_free=True)
    want, tol = padded(PROMPTS, COMPLETIONS), score_tolerance(padded, PROMPTS, COMPLETIONS)
    assert_within(packed(PROMPTS, COMPLETIONS), want, tol, "per-row scores")
    rows = padded.encode(PROMPTS, COMPLETIONS)
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    with torch.no_grad():  # packed anyway: rows see each other, and the test would see it
        packing = pack_last_tokens(ids, mask, "bins")
        wrong = packing.scatter(packed_scores(model, packing)[:, 0])[:, 0]
    assert bool(((wrong - padded.score_raw(PROMPTS, COMPLETIONS)).abs() > tol).any())


def test_a_lora_reward_model_scores_packed_rows_as_padded_ones(tokenizer):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(build_tiny_reward_model(tokenizer, seed=3),
                           LoraConfig(task_type="SEQ_CLS", r=4, target_modules=["q_proj", "v_proj"]))
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:  # an adapter that changes the scores
                param.copy_(0.05 * torch.randn(param.shape, generator=gen))
    assert scorer_layout(model, "cpu") == "bins"  # its body under peft probed, not the pooled classifier
    padded = NeuralReward(model, tokenizer, batch_size=8, clip=None)
    packed = NeuralReward(model, tokenizer, batch_size=8, clip=None, padding_free=True)
    calls, hook = packed_calls(model.get_base_model())
    try:
        got = packed(PROMPTS, COMPLETIONS)
    finally:
        hook.remove()
    assert len(calls) == 1 and calls[0]["attention_mask"] is None
    rows = padded.encode(PROMPTS, COMPLETIONS)
    with torch.no_grad():
        hidden = torch.cat([last_token_hidden(model, torch.tensor([r]), torch.ones(1, len(r), dtype=torch.long))
                            for r in rows])
    head = model.get_base_model().score.modules_to_save["default"]
    tol = head_tolerance(hidden, head.weight, model_rtol(model.config, len(rows) * max(map(len, rows)))).squeeze(-1)
    assert_within(got, padded(PROMPTS, COMPLETIONS), tol, "LoRA reward model scores")
    base = NeuralReward(build_tiny_reward_model(tokenizer, seed=3), tokenizer, clip=None)(PROMPTS, COMPLETIONS)
    assert bool(((got - base).abs() > tol).any())  # the adapter is on


class NoPositions(torch.nn.Module):
    """A scorer whose ``forward`` takes no ``position_ids`` (nor ``**kwargs``): positions from its mask."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model, self.config = model, model.config

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.get_input_embeddings()

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask,
                          position_ids=(attention_mask.long().cumsum(1) - 1).clamp(min=0))


def test_a_reward_model_whose_forward_takes_no_positions_scores_one_row_at_a_time(gpt2, tokenizer):
    wrapped = NoPositions(gpt2)
    assert scorer_layout(wrapped, "cpu") == "per_row"
    padded = NeuralReward(wrapped, tokenizer, batch_size=8, clip=None)
    packed = NeuralReward(wrapped, tokenizer, batch_size=8, clip=None, padding_free=True)
    calls, hook = packed_calls(gpt2)
    try:
        got = packed(PROMPTS, COMPLETIONS)
    finally:
        hook.remove()
    assert [kw["input_ids"].shape[0] for kw in calls] == [1] * len(PROMPTS)  # one unpadded row a forward
    assert all(bool(kw["attention_mask"].all()) for kw in calls)
    tol = score_tolerance(NeuralReward(gpt2, tokenizer, clip=None), PROMPTS, COMPLETIONS)
    assert_within(got, padded(PROMPTS, COMPLETIONS), tol, "scores")


def test_place_takes_the_runs_padding_free_and_leaves_it_otherwise(model, tokenizer):
    from textrl.core.precision import Precision

    reward = NeuralReward(model, tokenizer)
    assert reward.place(Precision(torch.device("cpu"))).padding_free is False
    assert reward.place(Precision(torch.device("cpu")), padding_free=True).padding_free is True
    assert reward.place(Precision(torch.device("cpu"))).padding_free is True
    assert "padding_free=True" in repr(reward)


@pytest.mark.parametrize("padding_free", [False, True])
def test_a_reward_model_of_the_runs_reward_spec_scores_as_the_run_says(padding_free):
    """``textrl train --padding-free --reward reward_model:PATH``: the trainer's task_reward loads and
    places the spec's reward model with the run's padding_free, and it scores packed rows."""
    from textrl.agents import AGENTS
    from textrl.agents.build import task_reward
    from textrl.config import TrainConfig

    config = TrainConfig(agent="rloo", prompts_per_iteration=2, n_samples_per_prompt=2, max_new_tokens=4,
                         warmup_sft_steps=0, padding_free=padding_free)
    agent = AGENTS["rloo"].from_config(config, "cpu", log=lambda *a, **k: None)
    neural = task_reward(agent, "think_format,reward_model:tiny").functions["reward_model"]
    assert neural.padding_free is padding_free
    calls, hook = packed_calls(neural.model)
    try:
        neural(PROMPTS[:3], COMPLETIONS[:3])
    finally:
        hook.remove()
    assert [kw["attention_mask"] is None for kw in calls] == [padding_free]
