"""An earlier run's records in a folder where a fresh run starts: set aside, never mixed.

A fresh run is refused over an earlier run's checkpoints (:func:`textrl.run.refuse_earlier_run`),
and the refusal says to delete ``checkpoints/`` to start over. What else that earlier run wrote
(``metrics.jsonl``, TensorBoard events, ``resumes.jsonl``, its summary, a stage's model) would
otherwise stay beside the new run's records, and TensorBoard would draw both runs as one. So a
fresh run moves each of them, before it writes anything, into ``earlier_runs/<time>/`` in the
folder (:func:`set_aside_earlier_records`) and says so: nothing is deleted, nothing is mixed.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

RUN_RECORDS = ("config.yaml", "user_code.json", "metrics.jsonl", "samples.jsonl", "resumes.jsonl",
               "eval_before.json", "summary.json", "curves.png", "tb", "model")
"""What a run writes in its folder besides ``checkpoints/`` and the lock file (``model`` is a stage's
final model): a fresh run sets aside each of these that an earlier run left."""

EARLIER_RUNS = "earlier_runs"
"""The folder (inside the run folder) that keeps the records of earlier runs, one subfolder each."""


def earlier_records(output_dir: str | Path) -> list[Path]:
    """The :data:`RUN_RECORDS` present in ``output_dir``."""
    folder = Path(output_dir)
    return [folder / name for name in RUN_RECORDS if (folder / name).exists()]


def set_aside_earlier_records(output_dir: str | Path, log=print) -> Path | None:
    """Move the records an earlier run left in ``output_dir`` (:func:`earlier_records`) into
    ``earlier_runs/<YYYYmmdd-HHMMSS>/``, log one line naming them, and return that folder (None when
    there were none). Called by a fresh run, under the folder's lock, before its first write."""
    found = earlier_records(output_dir)
    if not found:
        return None
    root = Path(output_dir) / EARLIER_RUNS
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target, n = root / stamp, 1
    while target.exists():
        n += 1
        target = root / f"{stamp}-{n}"
    target.mkdir(parents=True)
    for path in found:
        os.replace(path, target / path.name)
    log(f"a fresh run in {output_dir}: the earlier run's records ({', '.join(p.name for p in found)}) "
        f"moved to {target}")
    return target


__all__ = ["EARLIER_RUNS", "RUN_RECORDS", "earlier_records", "set_aside_earlier_records"]
