"""``--resume``: which checkpoint a run continues from, what it may change, and refusing to mix
two runs in one folder.

Each checkpoint holds the settings that produced it (``SETTINGS_FILE``). A resumed run compares
them with its own, field by field, by the rules of its config class (:class:`textrl.config.ResumeRules`,
the class attribute ``RESUME_RULES``): a field that defines the run (model, agent, seed, data, ...)
may not change, and the refusal names every such field with both values; a field that can take
effect from the next iteration on (learning rates, KL coefficient, iterations, cadences, ...) is
applied, logged, and recorded in ``resumes.jsonl``; a few fields describe only this invocation
(``output_dir``, ``resume``, ``progress``). The comparison runs before any model loads, and a
refused resume writes nothing.

The logs are cut back to the resumed iteration by their own writers
(:class:`~textrl.run.metrics.MetricsLog`, :class:`~textrl.run.metrics.SamplesLog`).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from textrl.config.io import RUN_RECORD
from textrl.core.user_files import absolute_paths
from textrl.run.checkpoints import (
    CHECKPOINT_MARKER,
    CheckpointError,
    complete_checkpoints,
    latest_checkpoint,
)
from textrl.run.user_code import (
    describe_code_changes,
    saved_user_code,
    user_code_changes,
    user_code_digest,
)

SETTINGS_FILE = RUN_RECORD
"""The settings a checkpoint was trained with (inside the checkpoint folder), and the run's own."""

RESUMES_FILE = "resumes.jsonl"
"""One line per resume that changed a setting or a data row: the iteration, the checkpoint, each
field's old and new value, each edited row's place and digests."""


class ResumeRefused(ValueError):
    """``--resume`` with settings that cannot change; the message names each field, both values."""


@dataclass
class SettingsChanges:
    """The fields whose value differs from the checkpoint's: ``{name: (old, new)}`` per rule."""

    refused: dict[str, tuple[Any, Any]]
    applied: dict[str, tuple[Any, Any]]


def saved_settings(checkpoint: Path, output_dir: str | Path) -> tuple[dict[str, Any], Path] | None:
    """The settings ``checkpoint`` was trained with and the file they come from: its own
    ``config.yaml``, else (a checkpoint written before checkpoints held one) the run folder's;
    None when neither exists."""
    for path in (checkpoint / SETTINGS_FILE, Path(output_dir) / SETTINGS_FILE):
        if path.is_file():
            try:
                data = yaml.safe_load(path.read_text())
            except yaml.YAMLError as err:
                raise CheckpointError(f"{path} cannot be read ({err}); restore it, or delete "
                                      f"{checkpoint} to resume from an earlier checkpoint") from None
            if isinstance(data, dict):
                return data, path
    return None


def settings_changes(saved: dict[str, Any], given: dict[str, Any], rules: Any) -> SettingsChanges:
    """Compare the ``given`` settings with the ``saved`` ones (both as ``config.yaml`` holds them:
    :func:`textrl.config.config_values`) field by field, by ``rules`` (a
    :class:`textrl.config.ResumeRules`). A field the saved file lacks (written by an older textrl)
    is not compared."""
    changes = SettingsChanges(refused={}, applied={})
    for name, new in given.items():
        if name in rules.invocation or name not in saved or _same(saved[name], new):
            continue
        (changes.applied if name in rules.applied else changes.refused)[name] = (saved[name], new)
    return changes


def _same(old: Any, new: Any) -> bool:
    """Equal as settings: numbers by value (YAML may read ``1e-3`` back as a float of an int)."""
    numbers = (int, float)
    if isinstance(old, numbers) and isinstance(new, numbers) and not isinstance(old, bool) \
            and not isinstance(new, bool):
        return math.isclose(float(old), float(new), rel_tol=1e-12, abs_tol=0.0)
    return old == new


def check_resume_settings(config: Any, given: dict[str, Any], checkpoint: Path, command: str,
                          log=print) -> dict[str, tuple[Any, Any]]:
    """Refuse (:class:`ResumeRefused`) a resume whose settings ``given`` (``config``'s, as
    ``config.yaml`` holds them) change a fixed field of the settings ``checkpoint`` was trained
    with; log and return the applied changes ``{name: (old, new)}``. ``config``'s class carries
    the rules (``RESUME_RULES``)."""
    found = saved_settings(checkpoint, config.output_dir)
    if found is None:
        log(f"--resume: {checkpoint} records no settings (no {SETTINGS_FILE}); they cannot be compared")
        return {}
    saved, source = found
    saved = absolute_paths(saved)  # a relative path an older textrl recorded, seen from here
    changes = settings_changes(saved, given, type(config).RESUME_RULES)
    if changes.refused:
        listed = "; ".join(f"{name}: {old!r} -> {new!r}" for name, (old, new) in changes.refused.items())
        raise ResumeRefused(
            f"--resume cannot change what defines the run ({listed}): {checkpoint} was trained with "
            f"the settings in {source}; resume with `textrl {command} --config {source} --resume`, "
            "or start a new run in another --output-dir")
    check_user_code(config, checkpoint, command)
    for name, (old, new) in changes.applied.items():
        log(f"--resume: {name} {old!r} -> {new!r} (applied from the next iteration on)")
    return changes.applied


def check_user_code(config: Any, checkpoint: Path, command: str) -> None:
    """:class:`ResumeRefused` when a user file the run imported (``--reward file.py:fn``, ``--env
    file.py:Class``, ``--agent file.py:Name``: :mod:`textrl.run.user_code`) was edited or removed
    since ``checkpoint`` was written: the code defines the run, as the ``reward`` / ``env`` /
    ``agent`` settings do. A checkpoint that recorded no digests is not compared."""
    saved = saved_user_code(checkpoint)
    if saved is None:
        return
    changed = user_code_changes(saved, user_code_digest(config))
    if changed:
        raise ResumeRefused(
            f"--resume cannot run other code than the run's ({describe_code_changes(changed)}): {checkpoint} "
            "was trained with the file as it was then; restore it (e.g. from version control) and resume "
            f"with `textrl {command} --config {Path(config.output_dir) / SETTINGS_FILE} --resume`, or start "
            "a new run in another --output-dir")


def checkpoint_iteration(checkpoint: Path) -> int:
    """The iteration (a stage's step) ``checkpoint`` was saved after, from its marker."""
    return int(json.loads((Path(checkpoint) / CHECKPOINT_MARKER).read_text())["iteration"])


def refuse_shorter_run(checkpoint: Path, length: int, name: str = "iterations", unit: str = "iteration") -> None:
    """:class:`ResumeRefused` when ``--resume`` asks for ``length`` (``--iterations``) below the
    iteration ``checkpoint`` already reached: the run cannot be cut back, and ``config.yaml`` would
    say a length that did not run."""
    done = checkpoint_iteration(checkpoint)
    if length < done:
        flag = "--" + name.replace("_", "-")
        raise ResumeRefused(
            f"--resume: {checkpoint} is at {unit} {done}, past {name}={length}; the run already trained "
            f"{done} {unit}s: pass {flag} {done} (nothing more to train) or more to continue it, or start "
            "a new run in another --output-dir for a shorter one")


def record_resume(output_dir: str | Path, iteration: int, checkpoint: Path,
                  applied: dict[str, tuple[Any, Any]], rows: list[dict[str, Any]] | None = None) -> None:
    """Append the resume's changed settings to ``resumes.jsonl`` (one line, written whole), and
    (``changed_rows``) the data rows whose contents changed since the checkpoint, each ``{"row":
    FILE:LINE, "sha256": {"from", "to"}}`` (:func:`textrl.envs.prompts.edited_rows`)."""
    if not applied and not rows:
        return
    record = {"resumed_after": iteration, "checkpoint": checkpoint.name, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "changed": {name: {"from": old, "to": new} for name, (old, new) in applied.items()}}
    if rows:
        record["changed_rows"] = rows
    line = json.dumps(record)
    with (Path(output_dir) / RESUMES_FILE).open("a") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


def refuse_earlier_run(config: Any) -> None:
    """``ValueError`` when a fresh run (``config.resume`` false) would write into a folder holding
    an earlier run's checkpoints. ``config`` needs ``output_dir`` and ``resume``."""
    existing = complete_checkpoints(Path(config.output_dir) / "checkpoints")
    if existing and not config.resume:
        raise ValueError(
            f"output_dir={config.output_dir!r} holds checkpoints of an earlier run (newest: "
            f"{existing[-1].name}); pass --resume to continue it, or choose another --output-dir "
            f"(or delete {existing[-1].parent}) to start over"
        )


def resume_checkpoint(config: Any, log=print) -> Path | None:
    """The verified checkpoint ``--resume`` continues from (None: no resume, or a fresh folder).

    ``config`` needs ``output_dir`` and ``resume``. Raises :class:`CheckpointError` when
    checkpoints exist but none verifies, rather than silently starting over on top of them.
    """
    if not config.resume:
        return None
    root = Path(config.output_dir) / "checkpoints"
    checkpoint = latest_checkpoint(config.output_dir)
    if checkpoint is None and complete_checkpoints(root):
        raise CheckpointError(f"--resume: no checkpoint in {root} verifies (see the warnings above); "
                              "delete the corrupt ones, or the folder to start over")
    if checkpoint is None:
        log(f"--resume: no complete checkpoint in {root}; starting from scratch")
    return checkpoint


__all__ = [
    "RESUMES_FILE",
    "SETTINGS_FILE",
    "ResumeRefused",
    "SettingsChanges",
    "check_resume_settings",
    "check_user_code",
    "checkpoint_iteration",
    "record_resume",
    "refuse_earlier_run",
    "refuse_shorter_run",
    "resume_checkpoint",
    "saved_settings",
    "settings_changes",
]
