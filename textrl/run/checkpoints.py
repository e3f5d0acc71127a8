"""Checkpoints: written atomically, marked complete by a manifest, verified, found, loaded.

A checkpoint is a folder ``checkpoints/iter_NNNNNN/`` holding the policy in Hugging Face format
(``policy/``) and ``trainer_state.pt`` (the agent's state, the sampler's position, every RNG and
the iteration). It is written to a temporary folder, fsync'ed, marked complete by a manifest of
sizes and sha256 sums (:data:`CHECKPOINT_MARKER`, written last) and renamed into place, so a
crash or a full disk never leaves a folder that looks complete. What is saved is duck-typed: an
``agent`` with ``policy``, ``tokenizer``, ``state_dict`` / ``load_state_dict`` and ``device``, a
``sampler`` with ``state_dict`` / ``load_state_dict`` (the PPO agent and prompt sampler, or a
stage's trainable state and batch order).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

from textrl.parallel.distributed import Distributed
from textrl.run import atomic
from textrl.run.rng import rng_state, set_rng_state

CHECKPOINT_MARKER = "manifest.json"
"""A checkpoint's completion marker, written last: every file with its size and sha256."""


class CheckpointError(RuntimeError):
    """A checkpoint that is incomplete, truncated or corrupt; the message names the file."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    """Flush a file's (or a directory's entries') data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_manifest(folder: Path, iteration: int) -> None:
    """fsync every file of ``folder``, then write the manifest (the completion marker) last."""
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        _fsync(path)
        files[path.relative_to(folder).as_posix()] = {"size": path.stat().st_size, "sha256": _sha256(path)}
    for sub in sorted(p for p in folder.rglob("*") if p.is_dir()):
        _fsync(sub)
    with (folder / CHECKPOINT_MARKER).open("w") as f:
        json.dump({"iteration": iteration, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync(folder)


def complete_checkpoints(root: Path) -> list[Path]:
    """``iter_*`` folders holding a manifest, oldest first (unverified)."""
    return sorted(p for p in root.glob("iter_*") if (p / CHECKPOINT_MARKER).is_file())


def verify_checkpoint(path: str | Path) -> dict[str, Any]:
    """The manifest of ``path`` after checking every file it lists (size, then sha256).

    Raises :class:`CheckpointError` naming the first missing, truncated or corrupt file.
    """
    path = Path(path)
    marker = path / CHECKPOINT_MARKER
    hint = f"delete {path} to resume from an earlier checkpoint"
    if not marker.is_file():
        raise CheckpointError(f"{path} is incomplete (no {CHECKPOINT_MARKER}: its save was interrupted); {hint}")
    try:
        manifest = json.loads(marker.read_text())
        files = manifest["files"]
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{marker} is corrupt ({err}); {hint}") from err
    for name, meta in files.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file} is missing from the checkpoint; {hint}")
        size = file.stat().st_size
        if size != meta["size"]:
            raise CheckpointError(f"{file} is truncated or corrupt: {size} bytes, the manifest says "
                                  f"{meta['size']}; {hint}")
        if _sha256(file) != meta["sha256"]:
            raise CheckpointError(f"{file} is corrupt: its sha256 differs from the manifest's; {hint}")
    return manifest


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """Newest checkpoint whose manifest verifies; partial ones (no manifest) are ignored and
    corrupt ones skipped with a warning naming the bad file."""
    for path in reversed(complete_checkpoints(Path(output_dir) / "checkpoints")):
        try:
            verify_checkpoint(path)
            return path
        except CheckpointError as err:
            warnings.warn(f"skipping a checkpoint: {err}", stacklevel=2)
    return None


def save_checkpoint(
    output_dir: str | Path, iteration: int, agent, sampler, keep: int,
    rng_per_process: list[dict[str, Any]] | None = None, agent_state: dict[str, Any] | None = None,
    files: dict[str, str] | None = None,
) -> Path:
    """Write ``checkpoints/iter_NNNNNN`` atomically; return its path.

    Everything goes to a temporary folder; every file is fsync'ed, the manifest (files, sizes,
    sha256: the completion marker) is written last, then one rename puts the folder in place.
    Only then are older checkpoints rotated away (``keep`` newest stay). On a failure (a full
    disk, a second Ctrl-C) the temporary folder is removed and earlier checkpoints are
    untouched; an ``OSError`` names the checkpoint and the one that is still intact.
    ``agent_state`` is ``agent.state_dict()`` when the caller gathered it already (FSDP: every
    process takes part in gathering, only the main process writes). ``files`` are text files
    saved beside them, ``{name: text}`` (the run's settings, ``config.yaml``), in the manifest too.
    """
    root = Path(output_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp_iter_*"):  # left by a killed run; only the main process saves
        shutil.rmtree(stale, ignore_errors=True)
    final = root / f"iter_{iteration:06d}"

    def write(tmp: Path) -> None:
        for name, text in (files or {}).items():
            (tmp / name).write_text(text)
        _write_checkpoint(tmp, iteration, agent, sampler, rng_per_process, agent_state)

    try:  # the temporary folder is removed on any error; a save of this iteration is replaced
        atomic.write_folder(final, write, tmp=root / f".tmp_iter_{iteration:06d}_{os.getpid()}")
    except (OSError, *LIBRARY_WRITE_ERRORS) as err:  # a full disk, whichever library was writing
        if not _is_write_error(err):
            raise
        raise _save_failed(err, final) from err
    for old in complete_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _write_checkpoint(folder: Path, iteration: int, agent, sampler, rng_per_process: list[dict[str, Any]] | None,
                      agent_state: dict[str, Any] | None) -> None:
    """The files of a checkpoint into ``folder``: ``policy/`` (model and tokenizer),
    ``trainer_state.pt`` (agent, sampler, this process's RNGs and every process's), the manifest."""
    if agent_state is None:
        agent_state = agent.state_dict()
    if getattr(getattr(agent, "backend", None), "gathers_state", False):  # full weights, gathered into agent_state
        policy_state = {k.removeprefix("policy."): v for k, v in agent_state.items() if k.startswith("policy.")}
        agent.policy.save_pretrained(folder / "policy", state_dict=policy_state)
    else:
        agent.policy.save_pretrained(folder / "policy")
    agent.tokenizer.save_pretrained(folder / "policy")
    torch.save(
        {"agent": agent_state, "sampler": sampler.state_dict(), "rng": rng_state(),
         "rng_per_process": rng_per_process, "iteration": iteration},
        folder / "trainer_state.pt",
    )
    _write_manifest(folder, iteration)


def _library_write_errors() -> tuple[type[BaseException], ...]:
    """What torch and safetensors raise when a write fails (a full disk among other causes):
    torch a ``RuntimeError`` ("[enforce fail at inline_container.cc] unexpected pos ..."),
    safetensors its ``SafetensorError``."""
    errors: list[type[BaseException]] = [RuntimeError]
    try:
        from safetensors import SafetensorError

        errors.append(SafetensorError)
    except ImportError:  # pragma: no cover - safetensors is a dependency
        pass
    return tuple(errors)


LIBRARY_WRITE_ERRORS = _library_write_errors()
_TORCH_WRITE_MARKERS = ("inline_container", "PytorchStreamWriter", "unexpected pos", "file write failed")


def _is_write_error(err: BaseException) -> bool:
    """An ``OSError``, safetensors' error, or torch's ``RuntimeError`` from its file writer (any
    other ``RuntimeError`` is a bug to report as it is)."""
    if isinstance(err, RuntimeError):
        return any(marker in str(err) for marker in _TORCH_WRITE_MARKERS)
    return True

_NOT_WRITABLE = {errno.EACCES, errno.EPERM, errno.EROFS}
_NO_SPACE = {errno.ENOSPC, errno.EDQUOT}


def _save_failed(err: BaseException, final: Path) -> OSError:
    """The ``OSError`` of a failed save: which checkpoint, why, which earlier one is intact, what
    to do (free space, or make the folder writable). A library's write error (torch, safetensors)
    gets the ``errno`` of a full disk when the filesystem has (almost) no space left."""
    previous = complete_checkpoints(final.parent)
    intact = f"{previous[-1]} is intact" if previous else "there is no earlier checkpoint"
    free = shutil.disk_usage(final.parent).free
    code = err.errno if isinstance(err, OSError) else None
    if code is None and free < 64 * 2**20:
        code = errno.ENOSPC
    reason = (err.strerror or str(err)) if isinstance(err, OSError) else f"{type(err).__name__}: {err}"
    if code in _NOT_WRITABLE:
        fix = f"make {final.parent} writable (or choose another --output-dir)"
    elif code in _NO_SPACE:
        fix = f"free disk space ({free / 2**20:.0f} MiB free there) or lower keep_checkpoints"
    else:
        fix = (f"check the disk ({free / 2**20:.0f} MiB free there; a full disk is the usual cause) and "
               "the folder's permissions")
    return OSError(code, f"could not write checkpoint {final} ({reason.strip()[:300]}); the partial copy "
                   f"was removed and {intact}. {fix[0].upper() + fix[1:]}, then resume with --resume")


def load_checkpoint(path: str | Path, agent, sampler, verify: bool = True, dist: Distributed | None = None) -> int:
    """Restore agent, sampler and RNGs; return the iteration the checkpoint was taken after.

    ``verify`` checks the manifest first (:func:`verify_checkpoint`); any unreadable file raises
    :class:`CheckpointError` naming it.
    """
    path = Path(path)
    if verify:
        verify_checkpoint(path)
    file = path / "trainer_state.pt"
    try:
        state = torch.load(file, map_location=agent.device, weights_only=False)
    except Exception as err:
        raise CheckpointError(f"{file} cannot be read ({type(err).__name__}: {err}); it is truncated "
                              f"or corrupt: delete {path} to resume from an earlier checkpoint") from err
    try:
        agent.load_state_dict(state["agent"])
    except RuntimeError as err:  # torch lists every key; name the mismatch in one line
        raise CheckpointError(f"{path} does not fit the models this run built: {_state_mismatch(err)}; "
                              "resume with the models the checkpoint was trained with") from None
    try:
        sampler.load_state_dict(state["sampler"])
    except ValueError as err:
        raise CheckpointError(f"{path} cannot continue on this data: {err}") from None
    _restore_rngs(state, dist or Distributed(), path)
    return int(state["iteration"])


def _state_mismatch(err: RuntimeError) -> str:
    """``load_state_dict``'s error summarised: how many keys are missing, unexpected or of another
    shape, with the first of each."""
    import re

    text = str(err)
    parts = []
    for label, pattern in (("missing", r'Missing key\(s\) in state_dict: (.*?)\.\s*(?:Unexpected|size mismatch|$)'),
                           ("unexpected", r'Unexpected key\(s\) in state_dict: (.*?)\.\s*(?:size mismatch|$)')):
        found = re.search(pattern, text, re.S)
        if found:
            keys = re.findall(r'"([^"]+)"', found.group(1))
            parts.append(f"{len(keys)} {label} weights (first: {keys[0]})" if keys else "")
    size = r"torch\.Size\(\[([^\]]*)\]\)"
    shapes = re.findall(rf"size mismatch for ([^:]+): copying a param with shape {size} from checkpoint, "
                        rf"the shape in current model is {size}", text)
    if shapes:
        name, saved, here = shapes[0]
        parts.append(f"{len(shapes)} weights of another shape (first: {name}, [{saved}] saved, [{here}] here)")
    parts = [part for part in parts if part]
    return "; ".join(parts) if parts else text.splitlines()[0]


def _restore_rngs(state: dict[str, Any], dist: Distributed, path: Path) -> None:
    """Each process's own RNGs where the checkpoint has them for this many processes, else the
    main process's (with a warning: the sampling stream differs from an uninterrupted run's)."""
    per_process = state.get("rng_per_process")
    if dist.enabled and per_process is not None and len(per_process) == dist.world_size:
        set_rng_state(per_process[dist.rank])
    elif dist.rank == 0:
        set_rng_state(state["rng"])
    if (len(per_process) if per_process else 1) != dist.world_size:
        warnings.warn(f"{path} was saved by {len(per_process) if per_process else 1} process(es) and is "
                      f"resumed by {dist.world_size}: the run continues, but the sampling stream is not "
                      "the one an uninterrupted run would have drawn", stacklevel=3)


__all__ = [
    "CHECKPOINT_MARKER",
    "CheckpointError",
    "complete_checkpoints",
    "latest_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
    "verify_checkpoint",
]
