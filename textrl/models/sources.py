"""Where a model or tokenizer comes from: a local folder or a hub id, checked before loading.

:func:`check_model_folder` names what a local folder lacks (``config.json``, weights, tokenizer
files) instead of transformers' guesses ("install sentencepiece or tiktoken"). For a hub id,
:func:`resolve_hub_id` looks in the local Hugging Face cache first, then asks the hub once, with a
short hard deadline (:func:`hub_unreachable`): a name that is neither a folder nor cached fails at
once when the hub cannot be reached, instead of after huggingface_hub's retries (about 50 s).
With a network nothing changes: the hub id goes to ``from_pretrained`` as it was given.
"""

from __future__ import annotations

import functools
import os
import threading
from pathlib import Path
from typing import Literal

Files = Literal["model", "tokenizer"]
"""What a load needs from a folder: a model (config and weights) or a tokenizer."""

CONFIG_FILE = "config.json"
WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin",
                   "pytorch_model.bin.index.json")
"""Weights ``from_pretrained`` reads (single files and shards)."""
TOKENIZER_PATTERNS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                      "vocab.txt", "*.model", "*.tiktoken")
"""Files of a saved tokenizer (fast, sentencepiece, BPE, WordPiece, tiktoken)."""
ADAPTER_FILE = "adapter_config.json"
"""A peft adapter folder: transformers loads it on its base, so it needs no config or weights."""
PROBE_TIMEOUT_S = 5.0
"""How long :func:`hub_unreachable` waits for the hub's answer, DNS included."""


# -- local folders ---------------------------------------------------------------------------------


def _has(folder: Path, patterns: tuple[str, ...]) -> bool:
    return any(next(folder.glob(pattern), None) is not None for pattern in patterns)


def folder_lacks(folder: str | os.PathLike[str]) -> dict[str, str]:
    """What of a saved model ``folder`` is missing: ``"config"``, ``"weights"``, ``"tokenizer"``,
    each with how the message names it (empty: nothing missing)."""
    folder = Path(folder)
    lacks = {}
    if not (folder / CONFIG_FILE).is_file():
        lacks["config"] = "no config.json"
    if not _has(folder, WEIGHT_PATTERNS):
        lacks["weights"] = "no weights (*.safetensors, pytorch_model*.bin)"
    if not _has(folder, TOKENIZER_PATTERNS):
        lacks["tokenizer"] = "no tokenizer files (tokenizer.json, tokenizer.model, vocab.json, ...)"
    return lacks


def _listing(folder: Path, shown: int = 5) -> str:
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir())
    if not names:
        return "it is empty"
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return "it holds " + ", ".join(names[:shown]) + more


def check_model_folder(folder: str | os.PathLike[str], files: Files = "model") -> None:
    """Refuse a local ``folder`` that cannot give what is loaded from it (``files``): a model needs
    ``config.json`` and weights (a peft adapter folder its ``adapter_config.json``), a tokenizer
    its tokenizer files. The ``ValueError`` names the folder, what it lacks and what is expected."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"{str(folder)!r} is a file, not a model folder: pass the folder that holds "
                         "config.json, the weights and the tokenizer (written by save_pretrained)")
    lacks = folder_lacks(folder)
    if files == "model" and (folder / ADAPTER_FILE).is_file():
        lacks.pop("config", None), lacks.pop("weights", None)
    needed = ("config", "weights") if files == "model" else ("tokenizer",)
    if not any(part in lacks for part in needed):
        return
    what = "a model" if files == "model" else "a tokenizer"
    raise ValueError(
        f"{str(folder)!r} is not {what} folder: it has {', '.join(lacks.values())}; {_listing(folder)}. "
        "Pass a folder written by save_pretrained, a hub id, or 'tiny'"
        + (" (or the tokenizer's folder with --tokenizer)" if files == "tokenizer" else "")
    )


# -- hub ids ---------------------------------------------------------------------------------------


def hub_offline() -> bool:
    """Whether the hub is switched off: ``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE`` now in the
    environment, or when huggingface_hub was imported."""
    from huggingface_hub import constants

    flags = (os.environ.get("HF_HUB_OFFLINE"), os.environ.get("TRANSFORMERS_OFFLINE"))
    return bool(constants.HF_HUB_OFFLINE) or any(
        (flag or "").strip().upper() in ("1", "ON", "YES", "TRUE") for flag in flags
    )


def hub_cache() -> str:
    """The Hugging Face hub cache folder (``HF_HUB_CACHE``, by default ``$HF_HOME/hub``)."""
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def cached_snapshot(name: str, files: Files = "model") -> Path | None:
    """The cached snapshot folder of hub id ``name`` (revision ``main``) when it holds ``files``
    (model: config and weights; tokenizer: tokenizer files), else None. Reads the disk only."""
    from huggingface_hub import try_to_load_from_cache

    key_files = (CONFIG_FILE,) if files == "model" else ("tokenizer_config.json", "tokenizer.json", CONFIG_FILE)
    for key in key_files:
        try:
            found = try_to_load_from_cache(name, key, cache_dir=hub_cache())
        except Exception:  # an id huggingface_hub refuses (HFValidationError): not cached
            return None
        if isinstance(found, str):
            snapshot = Path(found).parent
            needed = ("config", "weights") if files == "model" else ("tokenizer",)
            return None if any(part in folder_lacks(snapshot) for part in needed) else snapshot
    return None


@functools.lru_cache(maxsize=8)
def hub_unreachable(endpoint: str | None = None, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """Why the hub at ``endpoint`` (default: huggingface_hub's, ``HF_ENDPOINT``) cannot be reached,
    or None when it answers. One HEAD request through huggingface_hub's own HTTP session (so its
    proxies and certificates apply), without retries, under a hard deadline of ``timeout_s``
    (DNS included: it runs in a daemon thread). Any HTTP answer counts as reachable. The result is
    kept for the process, so the tokenizer, the policy and the reward model ask once."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    endpoint = endpoint or constants.ENDPOINT
    outcome: list[str | None] = []

    def probe() -> None:
        try:
            get_session().head(endpoint, timeout=timeout_s)
            outcome.append(None)
        except Exception as err:  # a connection error, a timeout, a proxy refusal, ...
            outcome.append(f"{type(err).__name__}: {str(err).strip()[:120] or 'no answer'}")

    thread = threading.Thread(target=probe, name="textrl-hub-probe", daemon=True)
    thread.start()
    thread.join(timeout_s + 1.0)
    if not outcome:
        return f"{endpoint}: no answer within {timeout_s:g} s"
    return None if outcome[0] is None else f"{endpoint}: {outcome[0]}"


def resolve_hub_id(name: str, files: Files = "model") -> str:
    """What ``from_pretrained`` should load for hub id ``name``: the id itself when the hub
    answers; the cached snapshot folder when the hub is off or unreachable (no network wait);
    a ``ValueError`` saying what to do when it is neither cached nor reachable."""
    offline = hub_offline()
    reason = "HF_HUB_OFFLINE is set" if offline else hub_unreachable()
    if reason is None:
        return name
    snapshot = cached_snapshot(name, files)
    if snapshot is not None:
        return str(snapshot)
    what = "model" if files == "model" else "tokenizer"
    raise ValueError(
        f"{what} {name!r} is neither a local folder nor in the Hugging Face cache ({hub_cache()}), and the hub "
        f"cannot be reached ({reason}).\nDownload it where there is a network (`hf download {name} --local-dir DIR`) "
        "and pass that folder, or set HF_HOME to a cache that holds it"
        + (" (or unset HF_HUB_OFFLINE to download it)" if offline else " (HF_HUB_OFFLINE=1 then skips the network)")
    )


__all__ = [
    "PROBE_TIMEOUT_S",
    "cached_snapshot",
    "check_model_folder",
    "folder_lacks",
    "hub_cache",
    "hub_offline",
    "hub_unreachable",
    "resolve_hub_id",
]
