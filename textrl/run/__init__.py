"""Run infrastructure shared by ``textrl train`` and every stage (``textrl sft``, ``rm``, ``dpo``).

- :mod:`~textrl.run.loop`: :class:`RunLoop`, the one loop driver (iterations, timing, evaluation
  and checkpoint cadence, the metrics row, progress, signals, the stop);
- :mod:`~textrl.run.checkpoints`: atomic, manifest-marked checkpoints (save, verify, latest, load);
- :mod:`~textrl.run.lock`: one writer per run folder;
- :mod:`~textrl.run.resume`: which checkpoint ``--resume`` continues from, and what it may change;
- :mod:`~textrl.run.metrics`: ``metrics.jsonl`` / TensorBoard / ``curves.png`` and ``samples.jsonl``;
- :mod:`~textrl.run.signals`: SIGINT / SIGTERM and :class:`TrainingStopped`;
- :mod:`~textrl.run.user_code`: the sha256 of the user's files a run imports (``user_code_digest``);
- :mod:`~textrl.run.records`: a fresh run sets an earlier run's records aside (``earlier_runs/``);
- :mod:`~textrl.run.rng`: seeding, and every RNG captured and restored for exact resume;
- :mod:`~textrl.run.progress`, :mod:`~textrl.run.device`: the progress bar, the device.

None of it knows an algorithm: what is saved, evaluated and stepped comes from the caller.
"""

from textrl.run.checkpoints import (
    CHECKPOINT_MARKER,
    CheckpointError,
    complete_checkpoints,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from textrl.run.device import resolve_device, torch_threads
from textrl.run.lock import (
    RunFolderBusy,
    RunFolderLock,
    holds_run_folder,
    refuse_busy_folder,
    take_run_folder,
)
from textrl.run.loop import LoopBody, RunLoop
from textrl.run.metrics import MetricsLog, SamplesLog
from textrl.run.progress import Progress
from textrl.run.records import set_aside_earlier_records
from textrl.run.resume import (
    SETTINGS_FILE,
    ResumeRefused,
    check_resume_settings,
    record_resume,
    refuse_earlier_run,
    resume_checkpoint,
)
from textrl.run.rng import rng_state, seed_everything, set_rng_state
from textrl.run.signals import StopSignals, TrainingStopped, resume_command, signal_message
from textrl.run.user_code import USER_CODE_FILE, user_code_digest

__all__ = [
    "CHECKPOINT_MARKER",
    "CheckpointError",
    "LoopBody",
    "MetricsLog",
    "Progress",
    "ResumeRefused",
    "SETTINGS_FILE",
    "USER_CODE_FILE",
    "RunFolderBusy",
    "RunFolderLock",
    "RunLoop",
    "SamplesLog",
    "StopSignals",
    "TrainingStopped",
    "check_resume_settings",
    "complete_checkpoints",
    "holds_run_folder",
    "latest_checkpoint",
    "load_checkpoint",
    "record_resume",
    "refuse_busy_folder",
    "refuse_earlier_run",
    "resolve_device",
    "torch_threads",
    "resume_checkpoint",
    "resume_command",
    "rng_state",
    "save_checkpoint",
    "seed_everything",
    "set_aside_earlier_records",
    "set_rng_state",
    "take_run_folder",
    "user_code_digest",
    "signal_message",
    "verify_checkpoint",
]
