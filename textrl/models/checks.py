"""Checks of a loaded model against its tokenizer, run before any training step.

- :func:`context_length`: how many positions a model reads (``max_position_embeddings``,
  ``n_positions``, ... from its config); prompts plus responses must fit it
  (:func:`textrl.envs.check_prompts_fit`).
- :func:`check_tokenizer_fits`: every id the tokenizer can produce indexes the model's input
  embedding; otherwise the first forward that meets such an id dies with ``IndexError``.
- :func:`check_critic_tokenizer`: a critic initialised from a reward model reads the *policy's*
  token ids, so the reward model's tokenizer must give every policy token the same id.

Each check raises ``ValueError`` naming both sides, the sizes and what to do.
"""

from __future__ import annotations

from typing import Any

from torch import nn

CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length",
                "max_seq_len", "n_ctx")
"""Config fields that give a model's context, in the order they are read (the first set wins)."""


def name_of(model: Any) -> str:
    """How a message names a model or tokenizer: its path or hub id, else its class."""
    config = getattr(model, "config", None)
    name = getattr(model, "name_or_path", None) or getattr(config, "_name_or_path", None)
    return str(name) if name else type(model).__name__


def model_config(model: Any) -> Any | None:
    """The transformers config of ``model``, or of the first submodule that has one (a value head
    on a backbone, a LoRA view of a peft model); a config given as itself; None if there is none."""
    from transformers import PretrainedConfig

    if isinstance(model, PretrainedConfig):
        return model
    modules = model.modules() if isinstance(model, nn.Module) else [model]
    for module in modules:
        config = getattr(module, "config", None)
        if isinstance(config, PretrainedConfig):
            return config
    return None


def context_length(model: Any) -> tuple[int, str] | None:
    """``(positions, field)``: the context of ``model`` (a model or its config) and the config
    field it was read from (:data:`CONTEXT_KEYS`, on the text config of a multimodal model);
    None when the config names none (then nothing is checked)."""
    config = model_config(model)
    if config is None:
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    aliases = getattr(type(text), "attribute_map", {}) or {}  # GPT-2: max_position_embeddings -> n_positions
    for key in CONTEXT_KEYS:
        value = getattr(text, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value, aliases.get(key, key)
    return None


def input_embedding_rows(model: Any) -> int | None:
    """Rows of the input embedding of ``model`` (or of the first submodule that has
    ``get_input_embeddings``, e.g. a critic's backbone); None when it has none."""
    modules = model.modules() if isinstance(model, nn.Module) else [model]
    for module in modules:
        get = getattr(module, "get_input_embeddings", None)
        if not callable(get):
            continue
        try:
            embedding = get()
        except (NotImplementedError, AttributeError):
            continue
        rows = getattr(embedding, "num_embeddings", None)
        if isinstance(rows, int):
            return rows
    return None


def largest_token_id(tokenizer: Any) -> int:
    """The largest id ``tokenizer`` can produce: its vocabulary with the added tokens
    (``len(tokenizer) - 1`` and the largest id of ``get_vocab()``), and its special ids."""
    ids = [len(tokenizer) - 1]
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    if vocab:
        ids.append(max(vocab.values()))
    ids += [i for i in getattr(tokenizer, "added_tokens_decoder", {}) if isinstance(i, int)]
    for attr in ("pad_token_id", "eos_token_id", "bos_token_id", "unk_token_id"):
        value = getattr(tokenizer, attr, None)
        if isinstance(value, int):
            ids.append(value)
    ids += [i for i in getattr(tokenizer, "all_special_ids", []) if isinstance(i, int)]
    return max(ids)


def check_tokenizer_fits(tokenizer: Any, model: Any, *, tokenizer_name: str | None = None,
                         model_name: str | None = None) -> None:
    """Refuse a tokenizer whose ids do not all index ``model``'s input embedding: the largest id
    (:func:`largest_token_id`) must be below its rows. A model without an embedding is not checked."""
    rows = input_embedding_rows(model)
    if rows is None:
        return
    largest = largest_token_id(tokenizer)
    if largest < rows:
        return
    tok, mod = tokenizer_name or name_of(tokenizer), model_name or name_of(model)
    raise ValueError(
        f"tokenizer {tok!r} produces token ids up to {largest} ({len(tokenizer)} tokens, special and added "
        f"ones included), but model {mod!r} has {rows} rows in its input embedding (ids >= {rows} would fail "
        f"with IndexError).\nUse the model's own tokenizer (--tokenizer), or resize the model "
        f"(model.resize_token_embeddings({largest + 1}), then save_pretrained) and train with that"
    )


def vocabulary_difference(tokenizer: Any, other: Any) -> str | None:
    """The first way ``other`` gives a token of ``tokenizer`` another meaning: a token it lacks or
    maps to another id (added tokens included); None when every token of ``tokenizer`` has the
    same id in ``other`` (``other`` may have more)."""
    mine, theirs = tokenizer.get_vocab(), other.get_vocab()
    for token, index in sorted(mine.items(), key=lambda item: item[1]):
        if token not in theirs:
            return f"{token!r} (id {index}) is not in it"
        if theirs[token] != index:
            return f"{token!r} is id {index} for the policy but {theirs[token]} for the reward model"
    return None


def check_critic_tokenizer(policy_tokenizer: Any, reward_tokenizer: Any, *, policy: str,
                           reward_model: str) -> None:
    """``critic_init='reward_model'``: the critic is the reward model's body reading the policy's
    token ids, so every token of the policy's tokenizer must have the same id in the reward
    model's (:func:`vocabulary_difference`; the reward model may know more tokens). A plain
    ``--reward-model`` needs no such check: it reads the decoded text with its own tokenizer."""
    difference = vocabulary_difference(policy_tokenizer, reward_tokenizer)
    if difference is None:
        return
    raise ValueError(
        f"critic_init='reward_model': the critic would read the token ids of policy {policy!r} "
        f"({len(policy_tokenizer)} tokens) with the body of reward model {reward_model!r}, whose tokenizer "
        f"({len(reward_tokenizer)} tokens) differs: {difference}.\nUse --critic-init policy, or a reward "
        "model trained on the policy's tokenizer (textrl rm --model <the policy>); as a plain --reward-model "
        "it can score the text as it is"
    )


__all__ = [
    "CONTEXT_KEYS",
    "check_critic_tokenizer",
    "check_tokenizer_fits",
    "context_length",
    "input_embedding_rows",
    "largest_token_id",
    "model_config",
    "name_of",
    "vocabulary_difference",
]
