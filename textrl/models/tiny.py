"""Tiny offline tokenizer and models for tests and the embedded demo, plus the user-facing loaders.

Nothing here touches the network. ``build_tiny_tokenizer`` trains a byte-level BPE on a fixed
built-in corpus (the ``tokenizers`` trainer breaks ties by pair order, so the result is the same
on every run); ``build_tiny_*`` build seeded models around it without disturbing torch's global
RNG. ``tiny_model_path`` saves them once under ``$TEXTRL_CACHE`` (default ``~/.cache/textrl``) so
that every consumer can go through the ordinary ``from_pretrained`` path, and the ``load_*``
functions are that path, where the name ``"tiny"`` stands for the cached tiny model.

Token ids of the tiny tokenizer (vocab 512): ``<|pad|>`` 0, ``<|bos|>`` 1, ``<|im_start|>`` 2,
``<|im_end|>`` 3 (eos), bytes and merges 4..507, ``<think>`` 508, ``</think>`` 509,
``<answer>`` 510, ``</answer>`` 511. The tags are added tokens that are *not* special, so they
are single tokens yet survive ``decode(..., skip_special_tokens=True)``. BOS exists for models
that want it but is not prepended automatically (ChatML starts with ``<|im_start|>``).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import time
import warnings
from pathlib import Path
from typing import Any, Literal

import tokenizers
import torch
import transformers
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from textrl.core.precision import set_attn_implementation
from textrl.models.sources import Files, check_model_folder, resolve_hub_id
from textrl.run import atomic

TinyKind = Literal["causal_lm", "reward_model", "gpt2"]

PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|bos|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, IM_START, IM_END)
TAG_TOKENS = ("<think>", "</think>", "<answer>", "</answer>")
TINY_VOCAB_SIZE = 512
TINY_MAX_LENGTH = 512
TINY_KINDS: tuple[str, ...] = ("causal_lm", "reward_model", "gpt2")
TINY_NAMES = {"tiny": "causal_lm", "tiny-gpt2": "gpt2"}
"""Names the ``load_*`` functions resolve to a cached tiny model instead of a path or hub id."""

CACHE_ENV = "TEXTRL_CACHE"
COMPLETE_MARKER = "TEXTRL_TINY_COMPLETE.json"
# Bump when what gets built changes in a way the fingerprint below does not see.
_CACHE_VERSION = "tiny-v1"

CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' -%}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
"""ChatML as in Qwen / MiniMind; a default system turn is added when the messages have none."""

_PROSE = """\
You are a helpful assistant. Answer the question and show your reasoning.
Think step by step, then give the final answer inside the answer tags.
Write a short poem about the sea. Summarize the following text in one sentence.
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a step.
Explain why the sky is blue. Light from the sun is scattered by the air, and blue light the most.
Translate the sentence into French. Give three reasons why reading is good for you.
What is the capital of France? The capital of France is Paris.
List the first five prime numbers: 2, 3, 5, 7, 11.
Please write a story about a robot who learns to paint. Once upon a time there was a robot.
How many days are there in a week? There are seven days in a week.
Describe the weather today. It is sunny and warm with a light wind from the west.
Sort these numbers from small to large: 9, 4, 7, 1. The sorted list is 1, 4, 7, 9.
If Tom has 3 apples and buys 5 more, how many apples does he have? He has 8 apples.
Solve the equation for x. First subtract, then divide both sides by the same number.
The model should be helpful, honest and harmless. Do not make up facts you do not know.
Reinforcement learning from human feedback trains a policy with a reward model and PPO.
"""


def _corpus() -> list[str]:
    """The fixed training text: prose, ChatML turns and exact arithmetic, in a fixed order."""
    lines = _PROSE.splitlines()
    lines += [f"{a}+{b}={a + b}" for a in range(0, 40, 3) for b in range(0, 40, 7)]
    lines += [f"{a}*{b}={a * b}" for a in range(2, 13) for b in range(2, 13, 3)]
    lines += [f"{a}-{b}={a - b}" for a in range(20, 60, 9) for b in range(1, 20, 4)]
    for i, line in enumerate(_PROSE.splitlines()):
        a, b = 3 * i + 1, 7 * i + 2
        lines.append(
            f"{IM_START}system\nYou are a helpful assistant.{IM_END}\n"
            f"{IM_START}user\n{line}\nWhat is {a}+{b}?{IM_END}\n"
            f"{IM_START}assistant\n<think>\nI add {a} and {b}.\n</think>\n"
            f"<answer>{a + b}</answer>{IM_END}\n"
        )
    # Tags and special tokens are matched whole before BPE, so spend no merges on them.
    strip = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS + TAG_TOKENS))
    return [strip.sub("\n", line) for line in lines]


@functools.lru_cache(maxsize=1)
def _tiny_tokenizer_json() -> str:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE - len(TAG_TOKENS),
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAG_TOKENS])
    if tok.get_vocab_size() != TINY_VOCAB_SIZE:  # the corpus must be rich enough to fill it
        raise RuntimeError(f"tiny tokenizer has {tok.get_vocab_size()} tokens, expected 512")
    return tok.to_str()


FILLER_ALPHABET = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
"""The characters of the filler tokens of a large tiny vocabulary (:func:`build_tiny_tokenizer`)."""


@functools.lru_cache(maxsize=2)
def _tiny_tokenizer_json_of(vocab_size: int) -> str:
    """The tiny tokenizer's JSON with its BPE vocabulary padded to ``vocab_size`` tokens by filler
    tokens: every alphanumeric string of 2, then 3 characters not in the vocabulary already, in
    order. No merge produces them, so the BPE never emits one (every text encodes exactly as the
    512-token tokenizer encodes it), yet each decodes, to its 2 or 3 characters."""
    if vocab_size == TINY_VOCAB_SIZE:
        return _tiny_tokenizer_json()
    if vocab_size < TINY_VOCAB_SIZE:
        raise ValueError(f"vocab_size={vocab_size}: the tiny tokenizer needs at least {TINY_VOCAB_SIZE} tokens")
    spec = json.loads(_tiny_tokenizer_json())
    vocab: dict[str, int] = spec["model"]["vocab"]
    for added in spec["added_tokens"]:  # the tags keep their ids 508..511 (not re-numbered after the fillers)
        vocab.setdefault(added["content"], added["id"])
    taken = set(vocab)
    next_id = TINY_VOCAB_SIZE
    fillers = (a + b + c for c in ("", *FILLER_ALPHABET) for a in FILLER_ALPHABET for b in FILLER_ALPHABET)
    for text in fillers:
        if next_id == vocab_size:
            break
        if text not in taken:
            vocab[text] = next_id
            next_id += 1
    if next_id != vocab_size:
        raise ValueError(f"vocab_size={vocab_size}: at most {next_id} tokens can be filled")
    return json.dumps(spec, ensure_ascii=False)


def build_tiny_tokenizer(vocab_size: int = TINY_VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """A deterministic 512-token byte-level BPE with ChatML specials; no download.

    Round-trips any text (byte fallback); padding is on the left, for generation. A larger
    ``vocab_size`` (e.g. Qwen2's 151936, for memory benchmarks of a real-sized LM head) adds filler
    tokens ``512 .. vocab_size - 1`` that no text encodes to, so every text encodes to the same ids
    as with 512 tokens, while every id decodes (a random model samples them): each filler is 2 or 3
    alphanumeric characters, which re-encode to at most 3 tokens.
    """
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tiny_tokenizer_json_of(vocab_size)),
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=IM_END,
        additional_special_tokens=[IM_START],
        chat_template=CHAT_TEMPLATE,
        padding_side="left",
        model_max_length=TINY_MAX_LENGTH,
        clean_up_tokenization_spaces=False,
    )


def _special_ids(tokenizer: PreTrainedTokenizerBase) -> dict[str, int | None]:
    return {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def _seeded(seed: int, build: Any) -> PreTrainedModel:
    """Build under a forked RNG: same seed -> bit-identical weights, global RNG untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build()
    if getattr(model, "generation_config", None) is not None:
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            setattr(model.generation_config, key, getattr(model.config, key))
    return model.float().eval()


def _llama_config(
    tokenizer: PreTrainedTokenizerBase,
    hidden_size: int,
    intermediate_size: int,
    num_hidden_layers: int,
    num_attention_heads: int,
    num_key_value_heads: int | None,
    max_position_embeddings: int,
    **extra: Any,
) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads or num_attention_heads,
        max_position_embeddings=max_position_embeddings,
        attention_dropout=0.0,
        tie_word_embeddings=False,
        dtype="float32",
        **_special_ids(tokenizer),
        **extra,
    )


def build_tiny_causal_lm(
    tokenizer: PreTrainedTokenizerBase,
    *,
    seed: int = 0,
    hidden_size: int = 64,
    intermediate_size: int = 256,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int | None = None,
    max_position_embeddings: int = 512,
) -> LlamaForCausalLM:
    """A randomly initialised (seeded) float32 Llama with ``tokenizer``'s vocab and special ids."""
    config = _llama_config(
        tokenizer,
        hidden_size,
        intermediate_size,
        num_hidden_layers,
        num_attention_heads,
        num_key_value_heads,
        max_position_embeddings,
    )
    return _seeded(seed, lambda: LlamaForCausalLM(config))


def build_tiny_reward_model(
    tokenizer: PreTrainedTokenizerBase,
    *,
    seed: int = 0,
    hidden_size: int = 64,
    intermediate_size: int = 256,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int | None = None,
    max_position_embeddings: int = 512,
) -> LlamaForSequenceClassification:
    """A seeded Llama with a scalar score head, read at the last non-pad token."""
    config = _llama_config(
        tokenizer,
        hidden_size,
        intermediate_size,
        num_hidden_layers,
        num_attention_heads,
        num_key_value_heads,
        max_position_embeddings,
        num_labels=1,
    )
    return _seeded(seed, lambda: LlamaForSequenceClassification(config))


def build_tiny_gpt2(
    tokenizer: PreTrainedTokenizerBase,
    *,
    seed: int = 0,
    hidden_size: int = 64,
    intermediate_size: int = 256,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    max_position_embeddings: int = 512,
) -> GPT2LMHeadModel:
    """A seeded GPT-2 (absolute positions: left padding needs explicit ``position_ids``)."""
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=max_position_embeddings,
        n_embd=hidden_size,
        n_inner=intermediate_size,
        n_layer=num_hidden_layers,
        n_head=num_attention_heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        dtype="float32",
        **_special_ids(tokenizer),
    )
    return _seeded(seed, lambda: GPT2LMHeadModel(config))


_BUILDERS = {
    "causal_lm": build_tiny_causal_lm,
    "reward_model": build_tiny_reward_model,
    "gpt2": build_tiny_gpt2,
}


def _cache_root(cache_dir: str | os.PathLike[str] | None) -> Path:
    root = cache_dir or os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "textrl"
    return Path(root).expanduser()


def tiny_model_path(
    kind: TinyKind = "causal_lm",
    *,
    seed: int = 0,
    cache_dir: str | os.PathLike[str] | None = None,
    **sizes: int | None,
) -> Path:
    """Directory holding the tiny ``kind`` model and its tokenizer, built and saved on first use.

    Layout: ``<cache_dir>/tiny-<kind>-<hash>/`` with the ``save_pretrained`` files of model and
    tokenizer plus ``TEXTRL_TINY_COMPLETE.json``. The hash covers a version tag, the tokenizer
    itself, ``kind``, ``seed`` and ``sizes`` (keyword arguments of ``build_tiny_<kind>``). The
    directory is built next to its final place and renamed into it, so it is complete or absent;
    a directory without the marker (left by a crash) is replaced; a concurrent winner is reused.
    """
    if kind not in _BUILDERS:
        raise ValueError(f"kind must be one of {TINY_KINDS}, got {kind!r}")
    key = {
        "version": _CACHE_VERSION,
        "transformers": transformers.__version__.split(".")[0],  # save format of the major
        "tokenizer": hashlib.sha256(_tiny_tokenizer_json().encode()).hexdigest(),
        "kind": kind,
        "seed": seed,
        "sizes": dict(sorted(sizes.items())),
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    root = _cache_root(cache_dir)
    final = root / f"tiny-{kind}-{digest}"
    if _is_complete(final):
        return final
    if _distributed_rank() > 0:  # transformers' save_pretrained writes only on rank 0: it builds
        return _wait_for_marker(final)

    def write(tmp: Path) -> None:
        tokenizer = build_tiny_tokenizer()
        model = _BUILDERS[kind](tokenizer, seed=seed, **sizes)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if not (tmp / "config.json").is_file():
            raise RuntimeError(f"save_pretrained wrote no config.json into {tmp}; cannot cache the tiny model")
        marker = key | {"transformers": transformers.__version__, "tokenizers": tokenizers.__version__}
        (tmp / COMPLETE_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        if final.exists() and not _is_complete(final):
            _discard(final)  # half-written, or written by an older version without the model files

    try:
        atomic.write_folder(final, write, replace=False)  # a complete folder of another process stays
    except OSError:
        if not _is_complete(final):  # not a lost race: a real failure
            raise
    return final


def _is_complete(folder: Path) -> bool:
    """The marker is written last, after the model's ``config.json``."""
    return (folder / COMPLETE_MARKER).is_file() and (folder / "config.json").is_file()


def _distributed_rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _wait_for_marker(final: Path, timeout_s: float = 600.0) -> Path:
    """Wait until process 0 of the group has built ``final`` (under ``accelerate launch``)."""
    deadline = time.monotonic() + timeout_s
    while not _is_complete(final):
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"waited {timeout_s:.0f}s for process 0 to build the tiny model in {final}; "
                "check process 0's error, or build it first with `textrl tiny`"
            )
        time.sleep(0.2)
    return final


def _discard(path: Path) -> None:
    """Move ``path`` aside, then delete it; another process may be discarding it too."""
    aside = path.with_name(f".{path.name}.stale-{os.getpid()}")
    try:
        os.replace(path, aside)
    except FileNotFoundError:
        return
    shutil.rmtree(aside, ignore_errors=True)


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def _resolve(name_or_path: str | os.PathLike[str], kind: TinyKind, files: Files = "model") -> str:
    """What ``from_pretrained`` loads for ``name_or_path``; ``files`` says what it must hold.

    ``"tiny"`` -> the cached tiny model dir; an existing folder -> itself, once it holds a model
    (config and weights) or a tokenizer (:func:`~textrl.models.sources.check_model_folder`); a hub
    id -> itself, or its cached snapshot when the hub cannot be reached
    (:func:`~textrl.models.sources.resolve_hub_id`). Anything else, or a folder or hub id that
    cannot give ``files``, is a ``ValueError`` naming it and what to pass instead.
    """
    name = os.fspath(name_or_path)
    if name in TINY_NAMES:
        tiny_kind = "reward_model" if kind == "reward_model" else TINY_NAMES[name]
        return str(tiny_model_path(tiny_kind))
    if Path(name).expanduser().exists():
        check_model_folder(Path(name).expanduser(), files)
        return str(Path(name).expanduser())
    if _HUB_ID.match(name) and ".." not in name:
        return resolve_hub_id(name, files)
    raise ValueError(
        f"{name!r} is neither an existing local path nor a Hugging Face hub id ('org/name'): "
        f"pass the directory of a saved model, a hub id, or 'tiny' for the offline test model"
    )


def load_tokenizer(name_or_path: str | os.PathLike[str] | PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """``AutoTokenizer`` with a pad token (falls back to EOS, with a warning) and left padding.

    A tokenizer object (the Python API) is used as it is, given the same pad token and padding side.
    """
    if isinstance(name_or_path, PreTrainedTokenizerBase):
        tokenizer = name_or_path
        name_or_path = tokenizer.name_or_path
    else:
        tokenizer = AutoTokenizer.from_pretrained(_resolve(name_or_path, "causal_lm", "tokenizer"))
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"tokenizer of {name_or_path!r} has neither a pad nor an eos token")
        warnings.warn(
            f"tokenizer of {name_or_path!r} has no pad token; using its eos token "
            f"{tokenizer.eos_token!r} as pad (masks keep the first EOS)",
            stacklevel=2,
        )
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def load_causal_lm(
    name_or_path: str | os.PathLike[str],
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    attn_implementation: str | None = None,
) -> PreTrainedModel:
    """``AutoModelForCausalLM.from_pretrained``; ``"tiny"`` is the cached tiny Llama. A model
    object (the Python API) is used as it is (cast to ``dtype``, moved to ``device`` and switched
    to ``attn_implementation`` if given)."""
    if isinstance(name_or_path, torch.nn.Module):
        model = name_or_path.to(dtype) if dtype is not None and dtype != "auto" else name_or_path
        if attn_implementation is not None:
            set_attn_implementation(model, attn_implementation)
    else:
        model = AutoModelForCausalLM.from_pretrained(_resolve(name_or_path, "causal_lm"), dtype=dtype or "auto",
                                                     **_attention(attn_implementation))
    return model.to(device) if device is not None else model


def _attention(attn_implementation: str | None) -> dict[str, str]:
    """``from_pretrained``'s ``attn_implementation`` argument, when one is chosen."""
    return {} if attn_implementation is None else {"attn_implementation": attn_implementation}


def load_reward_model(
    name_or_path: str | os.PathLike[str],
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    attn_implementation: str | None = None,
) -> PreTrainedModel:
    """A scalar ``AutoModelForSequenceClassification`` with ``pad_token_id`` set.

    HF reads the score at the last token that is not ``pad_token_id``, so it must be set for
    batches; when the checkpoint lacks it, it is taken from the checkpoint's tokenizer.
    """
    path = _resolve(name_or_path, "reward_model")
    model = AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=1, dtype=dtype or "auto", **_attention(attn_implementation)
    )
    if model.config.pad_token_id is None:
        model.config.pad_token_id = load_tokenizer(path).pad_token_id
    return model.to(device) if device is not None else model
