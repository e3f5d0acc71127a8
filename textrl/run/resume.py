"""``--resume``: which checkpoint a run continues from, and refusing to mix two runs in one folder.

The logs are cut back to the resumed iteration by their own writers
(:class:`~textrl.run.metrics.MetricsLog`, :class:`~textrl.run.metrics.SamplesLog`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from textrl.run.checkpoints import CheckpointError, complete_checkpoints, latest_checkpoint


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


__all__ = ["refuse_earlier_run", "resume_checkpoint"]
