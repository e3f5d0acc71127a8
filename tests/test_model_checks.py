"""Models, tokenizers and prompts are checked before training (docs/reliability.md, "Models,
tokenizers and prompts"): a prompt past the model's context, a tokenizer past the embedding, a
critic from a reward model of another tokenizer, a folder that is not a model and an offline hub
id are each refused before any iteration, with a message naming the culprit, the limit and the fix.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedTokenizerFast

from tests.runs import SMALL
from tests.runs import metrics as read_metrics
from textrl.cli import main
from textrl.envs import check_prompts_fit
from textrl.models import (
    build_tiny_reward_model,
    build_tiny_tokenizer,
    load_causal_lm,
    load_reward_model,
    load_tokenizer,
    sources,
    tiny_model_path,
)
from textrl.models.checks import (
    check_tokenizer_fits,
    context_length,
    largest_token_id,
    vocabulary_difference,
)

HUB_ID = "nobody-xyz/not-a-model"
RUN = [*SMALL, "--warmup-sft-steps", "0"]
"""A few-second `textrl train` run without the format warm-up."""


@pytest.fixture(scope="module", autouse=True)
def _tiny_cache(tmp_path_factory):
    """The tiny models, built once for the module in a private cache; one torch thread."""
    old, threads = os.environ.get("TEXTRL_CACHE"), torch.get_num_threads()
    os.environ["TEXTRL_CACHE"] = str(tmp_path_factory.mktemp("textrl-cache"))
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    if old is None:
        os.environ.pop("TEXTRL_CACHE", None)
    else:
        os.environ["TEXTRL_CACHE"] = old


def refusal(args: list[str]) -> str:
    """The message a command stops with: ``SystemExit`` (the command line's) or the ``ValueError``
    it raised. Fails the test when the command runs through."""
    with pytest.raises((SystemExit, ValueError)) as info:
        main(args)
    return str(info.value)


def other_tokenizer(specials: tuple[str, str] = ("<pad>", "</s>")) -> PreTrainedTokenizerFast:
    """A byte-level BPE of about 300 tokens: another vocabulary than the tiny 512-token one."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    corpus = ["What is 2+3? The answer is 5.", "Write a short poem about the sea.", "<think> I add </think>"] * 4
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=320, special_tokens=list(specials), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", padding_side="left")


@pytest.fixture(scope="module")
def other_reward_model(tmp_path_factory) -> Path:
    """A tiny reward model on :func:`other_tokenizer`, saved with it."""
    folder = tmp_path_factory.mktemp("other-rm")
    tokenizer = other_tokenizer()
    build_tiny_reward_model(tokenizer, seed=3).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def prompt_file(folder: Path, long_at: int, words: int = 14) -> Path:
    """20 short prompts, and a long one (62 tokens with the tiny chat template at 14 words) on
    line ``long_at``; line 3 is blank, so rows and lines differ."""
    lines = [json.dumps({"prompt": "word " * (words if n == long_at else 3), "answer": "1"})
             for n in range(1, 23)]
    lines[2] = ""
    path = folder / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


# -- 1. prompts past the model's context ---------------------------------------------------------


@pytest.mark.parametrize(("kind", "field"), [("gpt2", "n_positions"), ("causal_lm", "max_position_embeddings")])
def test_a_prompt_past_the_context_is_refused_naming_the_levers(tmp_path, kind, field):
    model = tiny_model_path(kind, max_position_embeddings=64)
    prompts = prompt_file(tmp_path, long_at=7)
    out = tmp_path / "run"
    # an explicit --max-prompt-length that, with max_new_tokens, passes the context is refused naming
    # both levers (left unset, it is fitted to the context and the long prompt keeps its last tokens:
    # tests/envs/test_lengths.py)
    message = refusal(["train", "--model", str(model), "--dataset", str(prompts), "--iterations", "1",
                       "--max-prompt-length", "64", "--output-dir", str(out), *RUN])
    assert "max_prompt_length=64: prompts of 62 tokens leave 2 of the 64 positions of model" in message
    assert str(model) in message
    assert "lower --max-prompt-length to 56 or --max-new-tokens to 2" in message and "longer context" in message
    assert not (out / "metrics.jsonl").exists()  # no iteration ran


def test_prompts_that_fit_the_context_train(tmp_path):
    model = tiny_model_path("gpt2", max_position_embeddings=64)
    prompts = prompt_file(tmp_path, long_at=7, words=12)  # 56 + 8 = 64 positions: just fits
    out = tmp_path / "run"
    assert main(["train", "--model", str(model), "--dataset", str(prompts), "--iterations", "1",
                 "--output-dir", str(out), *RUN]) == 0
    assert [row["iteration"] for row in read_metrics(out)] == [1]


def test_max_new_tokens_alone_past_the_context_names_the_setting():
    tokenizer = build_tiny_tokenizer()
    with pytest.raises(ValueError, match=r"max_new_tokens=64 leaves no room for a prompt in the 64 positions "
                                         r"of model 'm' \(n_positions in its config\); lower --max-new-tokens below 64"):
        check_prompts_fit(["hi"], tokenizer, context=64, context_field="n_positions", model="m", max_new_tokens=64)


def test_the_context_check_counts_truncated_prompts_and_names_list_rows():
    tokenizer = build_tiny_tokenizer()
    rows = ["a", "b", "word " * 14]  # 62 tokens
    with pytest.raises(ValueError, match=r"^list\[2\]: the prompt is 62 tokens long"):
        check_prompts_fit(rows, tokenizer, context=64, max_new_tokens=8, model="m")
    check_prompts_fit(rows, tokenizer, context=64, max_new_tokens=8, model="m",
                      max_prompt_length=56, truncate="left")  # cut to its last 56 tokens: fits
    with pytest.raises(ValueError, match=r"list\[2\]: the prompt is 62 tokens long .*more than max_prompt_length=56"):
        check_prompts_fit(rows, tokenizer, context=64, max_new_tokens=8, model="m", max_prompt_length=56)
    check_prompts_fit(rows, tokenizer, context=None, max_new_tokens=8)  # no known context: no check
    with pytest.raises(ValueError, match=r"list\[2\]: .*\nShorten or remove the prompt, or choose a model with a longer"):
        check_prompts_fit(rows, tokenizer, context=62, max_new_tokens=8, model="m")  # no max_new_tokens would do


def test_context_length_reads_the_models_own_field():
    gpt2 = load_causal_lm(tiny_model_path("gpt2", max_position_embeddings=48))
    assert context_length(gpt2) == (48, "n_positions")
    assert context_length(load_causal_lm("tiny")) == (512, "max_position_embeddings")
    assert context_length(PretrainedConfig()) is None  # none known: nothing is checked


# -- 2. a tokenizer past the model's embedding ---------------------------------------------------


@pytest.fixture(scope="module")
def bigger_tokenizer(tmp_path_factory) -> Path:
    """The tiny tokenizer with an added pad token: id 512, one past the tiny model's embedding."""
    folder = tmp_path_factory.mktemp("bigger-tokenizer")
    tokenizer = build_tiny_tokenizer()
    tokenizer.add_special_tokens({"pad_token": "<|extra_pad|>"})
    tokenizer.save_pretrained(folder)
    return folder


def test_a_tokenizer_with_ids_past_the_embedding_is_refused(tmp_path, bigger_tokenizer):
    out = tmp_path / "run"
    message = refusal(["train", "--model", "tiny", "--tokenizer", str(bigger_tokenizer), "--output-dir", str(out),
                       "--iterations", "1", *RUN])
    assert f"tokenizer {str(bigger_tokenizer)!r} produces token ids up to 512 (513 tokens" in message
    assert "model 'tiny' has 512 rows in its input embedding" in message
    assert "--tokenizer" in message and "model.resize_token_embeddings(513)" in message
    assert not (out / "metrics.jsonl").exists()


def test_the_largest_id_counts_special_and_added_tokens(bigger_tokenizer):
    tokenizer = load_tokenizer(bigger_tokenizer)
    assert largest_token_id(build_tiny_tokenizer()) == 511
    assert largest_token_id(tokenizer) == tokenizer.pad_token_id == 512
    model = load_causal_lm("tiny")
    check_tokenizer_fits(build_tiny_tokenizer(), model)  # 512 tokens, 512 rows: fits
    model.resize_token_embeddings(513)
    check_tokenizer_fits(tokenizer, model)  # the documented fix


# -- 3. a critic from a reward model of another tokenizer ----------------------------------------


def test_critic_init_reward_model_with_another_tokenizer_is_refused_before_the_policy_loads(
        tmp_path, other_reward_model, monkeypatch):
    from textrl.agents.base import PPOAgent

    def no_policy(*args, **kwargs):
        raise AssertionError("the policy loaded before the tokenizers were compared")

    monkeypatch.setattr(PPOAgent, "load_policy", classmethod(no_policy))
    message = refusal(["train", "--critic-init", "reward_model", "--reward-model", str(other_reward_model),
                       "--output-dir", str(tmp_path / "run"), "--iterations", "1", *RUN])
    assert "critic_init='reward_model': the critic would read the token ids of policy 'tiny' (512 tokens)" in message
    n_tokens = len(load_tokenizer(other_reward_model))
    assert f"reward model {str(other_reward_model)!r}, whose tokenizer ({n_tokens} tokens) differs" in message
    assert "'<|pad|>' (id 0) is not in it" in message
    assert "Use --critic-init policy, or a reward model trained on the policy's tokenizer" in message


def test_critic_init_reward_model_with_the_policys_tokenizer_trains(tmp_path):
    out = tmp_path / "run"
    assert main(["train", "--critic-init", "reward_model", "--reward-model", "tiny", "--output-dir", str(out),
                 "--iterations", "1", *RUN]) == 0
    assert "loss/value" in read_metrics(out)[0]


def test_a_plain_reward_model_with_another_tokenizer_scores_the_decoded_text(tmp_path, other_reward_model):
    out = tmp_path / "run"
    assert main(["train", "--reward-model", str(other_reward_model), "--reward", "", "--output-dir", str(out),
                 "--iterations", "1", *RUN]) == 0
    row = read_metrics(out)[0]
    assert set(k.split("/")[1] for k in row if k.startswith("reward_components/")) == {"reward_model"}
    assert torch.isfinite(torch.tensor(row["reward/mean"]))


def test_the_vocabulary_rule_allows_a_superset_and_names_the_first_difference():
    tiny, other = build_tiny_tokenizer(), other_tokenizer()
    more = build_tiny_tokenizer()
    more.add_tokens(["<extra>"])
    assert vocabulary_difference(tiny, more) is None  # every policy token keeps its id
    assert vocabulary_difference(more, tiny) == "'<extra>' (id 512) is not in it"
    assert vocabulary_difference(tiny, other) == "'<|pad|>' (id 0) is not in it"
    swapped = other_tokenizer(specials=("</s>", "<pad>"))
    assert vocabulary_difference(other, swapped) == "'<pad>' is id 0 for the policy but 1 for the reward model"


# -- 4. a folder that is not a model -------------------------------------------------------------


@pytest.fixture(params=["empty", "text-files"])
def not_a_model(request, tmp_path) -> Path:
    folder = tmp_path / request.param
    folder.mkdir()
    if request.param == "text-files":
        (folder / "notes.txt").write_text("not a model\n")
        (folder / "README.md").write_text("# hello\n")
    return folder


def test_a_folder_that_is_not_a_model_is_named_with_what_it_lacks(not_a_model):
    holds = "it is empty" if not_a_model.name == "empty" else "it holds README.md, notes.txt"
    for load, what in ((load_causal_lm, "model"), (load_reward_model, "model"), (load_tokenizer, "tokenizer")):
        with pytest.raises(ValueError) as info:
            load(not_a_model)
        message = str(info.value)
        assert message.startswith(f"{str(not_a_model)!r} is not a {what} folder: it has no config.json, no weights")
        assert "no tokenizer files" in message and holds in message
        assert "Pass a folder written by save_pretrained, a hub id, or 'tiny'" in message


@pytest.mark.parametrize("command", ["train", "sft", "rm", "dpo"])
def test_every_command_names_a_folder_that_is_not_a_model(tmp_path, not_a_model, command):
    extra = RUN if command == "train" else []
    message = refusal([command, "--model", str(not_a_model), "--output-dir", str(tmp_path / "out"), *extra])
    assert f"{str(not_a_model)!r} is not a" in message and "no config.json" in message
    assert "sentencepiece" not in message


def test_a_model_folder_without_a_tokenizer_loads_as_a_model_and_asks_for_one(tmp_path):
    folder = tmp_path / "weights-only"
    load_causal_lm("tiny").save_pretrained(folder)
    assert load_causal_lm(folder).config.vocab_size == 512
    with pytest.raises(ValueError, match=r"is not a tokenizer folder: it has no tokenizer files .*--tokenizer"):
        load_tokenizer(folder)


# -- 5. an offline hub id ------------------------------------------------------------------------


@pytest.fixture
def empty_hub_cache(tmp_path, monkeypatch) -> Path:
    """An empty Hugging Face cache, and a from_pretrained that must not be reached."""
    from huggingface_hub import constants

    cache = tmp_path / "hf-hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))

    def no_download(name, *args, **kwargs):
        if not Path(name).is_dir():
            raise AssertionError(f"from_pretrained({name!r}) would wait for the network")
        return real(name, *args, **kwargs)

    real = AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_download)
    return cache


def test_an_uncached_hub_id_fails_at_once_with_hf_hub_offline(empty_hub_cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(sources, "hub_unreachable", lambda: pytest.fail("probed the hub while HF_HUB_OFFLINE is set"))
    start = time.monotonic()
    with pytest.raises(ValueError) as info:
        load_causal_lm(HUB_ID)
    assert time.monotonic() - start < 5
    message = str(info.value)
    assert f"model {HUB_ID!r} is neither a local folder nor in the Hugging Face cache ({empty_hub_cache})" in message
    assert "the hub cannot be reached (HF_HUB_OFFLINE is set)" in message
    assert f"`hf download {HUB_ID} --local-dir DIR`" in message and "HF_HOME" in message
    assert len(message.splitlines()) <= 2


def test_an_uncached_hub_id_fails_at_once_when_the_hub_does_not_answer(empty_hub_cache, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(sources, "hub_unreachable", lambda: "https://huggingface.co: ConnectError: no route")
    with pytest.raises(ValueError, match=r"tokenizer 'nobody-xyz/not-a-model' is neither a local folder nor in the "
                                         r"Hugging Face cache .*\(https://huggingface.co: ConnectError: no route\)"):
        load_tokenizer(HUB_ID)
    with pytest.raises(ValueError, match="model 'nobody-xyz/not-a-model' is neither"):
        load_causal_lm(HUB_ID)


def test_with_a_network_a_hub_id_goes_to_from_pretrained_as_given(monkeypatch):
    from textrl.models.tiny import _resolve

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.setattr(sources, "hub_unreachable", lambda: None)
    assert _resolve("someone/some-model", "causal_lm") == "someone/some-model"


def test_a_cached_hub_id_loads_from_the_cache_without_the_hub(empty_hub_cache, monkeypatch):
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = empty_hub_cache / "models--someone--tiny-copy"
    shutil.copytree(tiny_model_path("causal_lm"), repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(sources, "hub_unreachable", lambda: "https://huggingface.co: ConnectError: no route")
    model, tokenizer = load_causal_lm("someone/tiny-copy"), load_tokenizer("someone/tiny-copy")
    assert model.config.vocab_size == len(tokenizer) == 512


def test_the_real_probe_answers_within_seconds():
    sources.hub_unreachable.cache_clear()
    start = time.monotonic()
    reason = sources.hub_unreachable()
    assert time.monotonic() - start < sources.PROBE_TIMEOUT_S + 2
    if reason is None:
        pytest.skip("the hub answers here: a made-up id fails as transformers reports it")
    with pytest.raises(ValueError, match=f"{HUB_ID!r} is neither a local folder"):
        load_tokenizer(HUB_ID)


@pytest.mark.parametrize("command", ["train", "sft", "rm", "dpo"])
def test_every_command_refuses_an_offline_hub_id_at_once(tmp_path, monkeypatch, command):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    extra = RUN if command == "train" else []
    start = time.monotonic()
    message = refusal([command, "--model", HUB_ID, "--output-dir", str(tmp_path / "out"), *extra])
    assert time.monotonic() - start < 30
    assert f"{HUB_ID!r} is neither a local folder nor in the Hugging Face cache" in message
    assert "HF_HUB_OFFLINE is set" in message
