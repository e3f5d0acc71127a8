"""What the supervised stages (``textrl sft``, ``rm``, ``dpo``) share: the loop they train with.

- :func:`fit`: what every stage trains with: AdamW steps over shuffled batches
  (:class:`StageSteps`), driven by :class:`textrl.run.RunLoop` as ``textrl train``'s PPO
  iterations are: evaluation before, every ``eval_every`` steps and at the end,
  ``metrics.jsonl`` / TensorBoard (:class:`textrl.run.MetricsLog`), optional checkpoints, the
  final model. The stage's loss and evaluation run under the run's precision context
  (:meth:`textrl.core.precision.Precision.autocast`), as the agents' forwards do.
- Resume (``--resume``) with the run package's checkpoints: ``checkpoints/iter_NNNNNN/`` written
  atomically by :func:`textrl.run.save_checkpoint` (a manifest of sha256 sums marks it complete)
  holding the model as ``model/`` will be (``policy/``) and ``trainer_state.pt``: the trainable
  tensors, the AdamW state, the :class:`BatchOrder` and every RNG. SIGINT / SIGTERM finish the
  current step, save a checkpoint and raise :class:`textrl.run.TrainingStopped`.

The rest lives beside it, and is importable from here too: :class:`StageConfig` and its command
line (:mod:`textrl.stages.stage_config`), the model a stage trains and saves
(:mod:`textrl.stages.policy`: :func:`load_policy` / :func:`save_policy`), its rows
(:mod:`textrl.stages.data`).

Every stage writes to ``output_dir``: ``config.yaml`` (resolved config), ``metrics.jsonl``,
``tb/``, ``summary.json`` (held-out metrics before and after) and ``model/`` (the result).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor

from textrl.config.io import config_values, config_yaml, save_config
from textrl.models.adapters import write_atomically
from textrl.run import (
    CHECKPOINT_MARKER,
    SETTINGS_FILE,
    CheckpointError,
    MetricsLog,
    RunLoop,
    check_resume_settings,
    complete_checkpoints,
    load_checkpoint,
    record_resume,
    refuse_busy_folder,
    refuse_earlier_run,
    resolve_device,
    resume_checkpoint,
    save_checkpoint,
    seed_everything,
    signal_message,
    take_run_folder,
)
from textrl.run.metrics import json_text
from textrl.run.records import set_aside_earlier_records
from textrl.run.signals import StopRequested, StopSignals, stop_before_loop, stop_phase
from textrl.run.user_code import USER_CODE_FILE, user_code_digest, user_code_json
from textrl.stages.data import pad_left, read_jsonl, source_rows, split_rows
from textrl.stages.policy import (
    ADAPTER_META,
    adapter_base,
    add_lora,
    is_adapter_dir,
    load_adapter_model,
    load_policy,
    model_record,
    resolve_model_path,
    save_policy,
    stage_precision,
)
from textrl.stages.stage_config import StageConfig, add_stage_arguments, all_field_docs

MODEL_DIR = "model"
"""Subfolder of ``output_dir`` holding a stage's result."""


# -- the loop ---------------------------------------------------------------------------------------


def prepare_run(config: Any) -> tuple[torch.device, Path, Path | None]:
    """Validate, check the output folder (:func:`resume_point`) and the settings a resume
    changes, seed, resolve the device, create and lock ``output_dir`` (:func:`take_run_folder`);
    return the device, the folder and the checkpoint ``--resume`` continues from (None for a
    fresh run). Nothing loads a model before this, and a refused run writes nothing;
    ``config.yaml`` is written by :func:`record_run` once everything has loaded."""
    config.validate()
    checkpoint = resume_point(config)
    if checkpoint is not None:  # a refused change writes nothing
        check_resume_settings(config, config_values(config), checkpoint, _command(config))
    device = resolve_device(config.device)
    output_dir = Path(config.output_dir)
    take_run_folder(output_dir)  # a second run on the folder is refused here, before any write
    seed_everything(config.seed)
    return device, output_dir, checkpoint


def record_run(config: StageConfig, resume_from: Path | None, start: int,
               edited: list[dict[str, Any]] | None = None) -> None:
    """``config.yaml`` (the settings that run from here on) and, after a resume that changed
    some settings or found ``edited`` rows (:attr:`BatchOrder.edited`), a line of
    ``resumes.jsonl``: written once the data, the model and the checkpoint have loaded, so a run
    refused on the way leaves no record of settings that never ran."""
    output_dir = Path(config.output_dir)
    if resume_from is not None:
        changes = check_resume_settings(config, config_values(config), resume_from, _command(config),
                                        log=lambda *a, **k: None)  # printed by prepare_run already
        record_resume(output_dir, start, resume_from, changes, rows=edited)
    else:  # a fresh run: an earlier run's records (metrics, tb/, model/, ...) are set aside, not mixed in
        set_aside_earlier_records(output_dir)
    save_config(config, output_dir / SETTINGS_FILE)
    (output_dir / USER_CODE_FILE).write_text(user_code_json(user_code_digest(config)))


def _command(config: StageConfig) -> str:
    """The subcommand of a stage's config: ``SFTConfig`` -> 'sft'."""
    return type(config).__name__.removesuffix("Config").lower()


def resume_point(config: StageConfig) -> Path | None:
    """The verified checkpoint ``--resume`` continues from; None for a fresh run.

    ``ValueError`` when a fresh run would mix with an earlier run's checkpoints (as ``textrl
    train``'s ``check_run``), when ``--resume`` finds no checkpoint or none that verifies, or when
    the newest one is already at ``--steps``.
    """
    refuse_busy_folder(config.output_dir)  # another run writes there now: say that first
    refuse_earlier_run(config)
    if not config.resume:
        return None
    root = Path(config.output_dir) / "checkpoints"
    if not complete_checkpoints(root):
        raise ValueError(f"--resume: no checkpoint in {root} (none saved, or every save was cut "
                         "short); run without --resume to start, or pass the --output-dir of the run "
                         "to continue")
    try:
        checkpoint = resume_checkpoint(config)
    except CheckpointError as err:  # the command reports ValueErrors as one line
        raise ValueError(str(err)) from err
    step = json.loads((checkpoint / CHECKPOINT_MARKER).read_text())["iteration"]
    if step >= config.steps:
        raise ValueError(f"--resume: {checkpoint} is at step {step} and steps={config.steps}; pass "
                         f"--steps above {step} to train further")
    return checkpoint


class BatchOrder:
    """Batches of row indices drawn step by step: shuffled epochs from a private generator seeded
    with ``seed``, run on across epoch boundaries (the order of :func:`textrl.run.warmup._batch_order`).

    ``state_dict`` (the generator, the rest of the current epoch and each row's digest) lets a
    resumed run draw the batches an uninterrupted one would. ``load_state_dict`` accepts rows
    whose contents were edited since (a bad row fixed: as many rows in the same order draw the
    same batches), naming them in :attr:`edited` by ``names`` (each row's place, ``FILE: row N
    (line L)``; else its position among the training rows), and refuses rows added, removed,
    reordered or mostly changed (:func:`textrl.envs.prompts.edited_rows`); a state without
    digests (an older checkpoint) needs the very same rows.
    """

    source = "the training data"

    def __init__(self, rows: Sequence[Any], seed: int, names: Sequence[str] | None = None) -> None:
        from textrl.envs.prompts import DIGEST_HEX

        self.num_rows = len(rows)
        digest = hashlib.sha256()
        for row in rows:
            digest.update(repr(row).encode())
        self.fingerprint = digest.hexdigest()[:16]
        self.digests = "".join(hashlib.sha256(repr(row).encode()).hexdigest()[:DIGEST_HEX] for row in rows)
        self.names = list(names) if names is not None else None
        self.edited: list[dict[str, Any]] = []
        self.generator = torch.Generator().manual_seed(seed)
        self.pending: list[int] = []

    def __len__(self) -> int:
        return self.num_rows

    def where(self, i: int) -> str:
        """How messages name training row ``i``."""
        return self.names[i] if self.names is not None else f"training row {i}"

    def row_digests(self) -> str:
        """Each row's digest (16 hex digits of the sha256 of its ``repr``), joined."""
        return self.digests

    def next_batch(self, batch_size: int) -> list[int]:
        while len(self.pending) < batch_size:
            self.pending.extend(torch.randperm(self.num_rows, generator=self.generator).tolist())
        batch = self.pending[:batch_size]
        del self.pending[:batch_size]
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"num_rows": self.num_rows, "fingerprint": self.fingerprint, "row_digests": self.digests,
                "generator": self.generator.get_state(), "pending": list(self.pending)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from textrl.envs.prompts import edited_rows

        if "row_digests" in state:
            try:
                self.edited = edited_rows((state["num_rows"], state["row_digests"], self, "training rows"))
            except ValueError as err:
                raise ValueError(f"it was taken on other training rows: {err}") from None
        elif (state["num_rows"], state["fingerprint"]) != (self.num_rows, self.fingerprint):
            raise ValueError(
                f"it was taken on other training rows ({state['num_rows']} rows, fingerprint "
                f"{state['fingerprint']}) than this run's ({self.num_rows} rows, fingerprint "
                f"{self.fingerprint}); resume with the --data, --eval-size and --seed of that run"
            )
        self.generator.set_state(state["generator"])
        self.pending = list(state["pending"])


class StageState:
    """A stage's trainable state in the shape :func:`textrl.run.save_checkpoint` /
    :func:`~textrl.run.load_checkpoint` expect of an agent: ``policy.save_pretrained(path)``
    writes the model as ``save`` writes ``model/`` (the tokenizer with it); ``state_dict()``
    holds the trainable tensors, the AdamW state and the held-out metrics before training
    (``before``)."""

    device = torch.device("cpu")  # load_checkpoint's map_location: RNG states must be CPU tensors;
    # the copies below and AdamW's load_state_dict move the rest to the parameters' device

    def __init__(self, params: Sequence[torch.nn.Parameter], optimizer: torch.optim.Optimizer,
                 save: Callable[[Path], Any]) -> None:
        self.params, self.optimizer = list(params), optimizer
        self.policy = SimpleNamespace(save_pretrained=save)
        self.tokenizer = SimpleNamespace(save_pretrained=lambda path: None)  # save wrote it
        self.before: dict[str, float] = {}

    def state_dict(self) -> dict[str, Any]:
        return {"params": [p.detach() for p in self.params], "optimizer": self.optimizer.state_dict(),
                "before": self.before}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = [tuple(t.shape) for t in state["params"]]
        mine = [tuple(p.shape) for p in self.params]
        if saved != mine:
            raise ValueError(
                f"it holds {len(saved)} trainable tensors ({sum(map(math.prod, saved))} numbers), "
                f"this model {len(mine)} ({sum(map(math.prod, mine))}); resume with the --model, "
                "--lora and lora_* options of that run"
            )
        with torch.no_grad():
            for param, value in zip(self.params, state["params"]):
                param.copy_(value)
        self.optimizer.load_state_dict(state["optimizer"])
        self.before = state["before"]


def fit(
    config: StageConfig,
    params: Sequence[torch.nn.Parameter],
    train_rows: Sequence[Any],
    loss_fn: Callable[[list[Any]], tuple[Tensor, dict[str, float]]],
    evaluate: Callable[[], dict[str, float]],
    save: Callable[[Path], Any],
    *,
    name: str,
    resume_from: Path | None = None,
    row_names: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Train ``params`` for ``config.steps`` AdamW steps; return ``{"before", "after", ...}``.

    ``loss_fn(rows)`` puts the model in train mode and returns the loss of a batch of rows and
    its detached stats; ``evaluate()`` returns held-out metrics (keys without prefix; they are
    logged under ``eval/``); both run under the stage's autocast (:func:`stage_precision` of
    ``config`` on the parameters' device). ``save(path)`` writes the model to ``path``. Batches come from a
    :class:`BatchOrder` seeded with ``config.seed``. ``resume_from`` (a verified checkpoint, see
    :func:`prepare_run`) restores the state after its step, and ``metrics.jsonl`` keeps only the
    rows up to it. SIGINT / SIGTERM finish the current step, save a checkpoint and raise
    :class:`~textrl.run.TrainingStopped`, whose message says how to resume. ``row_names``: each
    training row's place in the data, naming the rows a resume finds edited (:class:`BatchOrder`).
    """
    output_dir = Path(config.output_dir)
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError(f"{name}: no trainable parameters")
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)
    precision = stage_precision(config, params[0].device)
    loss_fn, evaluate = under(precision.autocast, loss_fn), under(precision.autocast, evaluate)
    state, order = StageState(params, optimizer, save), BatchOrder(train_rows, config.seed, row_names)
    start = 0 if resume_from is None else restore(resume_from, state, order)
    record_run(config, resume_from, start, order.edited)
    log = MetricsLog(output_dir, enabled=True, resume_after=None if resume_from is None else start)
    began = time.perf_counter()
    with StopSignals("the current step", "saving a checkpoint") as signals:  # the evaluation before too
        if resume_from is None:
            state.before = evaluate_before(name, evaluate, log)
        steps = StageSteps(config, name, train_rows, loss_fn, evaluate, state, order)
        RunLoop(name, config.steps, log, eval_every=config.eval_every, checkpoint_every=config.checkpoint_every,
                checkpoint_last=False, timing="step", progress=config.progress).run(steps, start, signals)
    save(output_dir / MODEL_DIR)
    summary = {"stage": name, "before": state.before, "after": steps.after, "model": str(output_dir / MODEL_DIR),
               "steps": config.steps, "seconds": time.perf_counter() - began, "precision": precision.record()}
    (output_dir / "summary.json").write_text(json_text(summary, indent=2) + "\n")  # strict JSON: a NaN as null
    return summary


def evaluate_before(name: str, evaluate: Callable[[], dict[str, float]], log: MetricsLog) -> dict[str, float]:
    """The held-out evaluation before step 1 of a fresh run; a stop signal ends it between two
    batches (:class:`~textrl.run.signals.StopRequested`) and the stage with nothing saved."""
    try:
        with stop_phase("the current batch of the held-out evaluation before step 1",
                        "stopping (nothing is saved before step 1)"):
            return evaluate()
    except StopRequested as err:
        log.close()
        raise stop_before_loop(name, err, 0, None) from None


def under(context: Callable[[], Any], fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run inside ``context()`` (a stage's loss and evaluation under its autocast)."""
    def run(*args: Any, **kwargs: Any) -> Any:
        with context():
            return fn(*args, **kwargs)
    return run


class StageSteps:
    """A stage's side of :class:`~textrl.run.RunLoop`: one AdamW step on the next batch per
    iteration, the held-out evaluation, checkpoints (every ``checkpoint_every`` steps but the
    last, whose model ``model/`` holds, and on a signal). ``after``: the latest evaluation."""

    def __init__(self, config: StageConfig, name: str, train_rows: Sequence[Any],
                 loss_fn: Callable[[list[Any]], tuple[Tensor, dict[str, float]]],
                 evaluate: Callable[[], dict[str, float]], state: StageState, order: BatchOrder) -> None:
        self.config, self.name, self.train_rows = config, name, train_rows
        self.loss_fn, self._evaluate, self.state, self.order = loss_fn, evaluate, state, order
        self.after = state.before
        self.user_code = user_code_digest(config)  # as the run started: each checkpoint records these

    def step(self, step: int, timings: dict[str, float]) -> dict[str, Any]:
        """One AdamW step on the next batch of rows; the metrics row."""
        rows = [self.train_rows[i] for i in self.order.next_batch(self.config.batch_size)]
        metrics = train_step(rows, self.loss_fn, self.state.params, self.state.optimizer, self.config.max_grad_norm)
        return {"iteration": step, **metrics}

    def evaluate(self, step: int, timings: dict[str, float]) -> dict[str, float]:
        """The stage's held-out metrics under ``eval/``."""
        self.after = self._evaluate()
        return {f"eval/{k}": v for k, v in self.after.items()}

    def checkpoint(self, step: int, stopping: bool) -> Path:
        """``checkpoints/iter_NNNNNN`` after ``step``."""
        return save_stage_checkpoint(Path(self.config.output_dir), step, self.state, self.order,
                                     self.config.keep_checkpoints,
                                     files={SETTINGS_FILE: config_yaml(self.config),
                                            USER_CODE_FILE: user_code_json(self.user_code)})

    def faulted(self) -> bool:
        """A stage stops on a signal only."""
        return False

    def stop_message(self, step: int, signum: int | None, saved: Path | None) -> str:
        """``textrl NAME: stopped by SIGTERM after step 3 of 6; ...``: the command that resumes."""
        return signal_message(self.name, "step", step, self.config.steps, signum, saved,
                              Path(self.config.output_dir) / SETTINGS_FILE)

    def postfix(self, row: dict[str, Any]) -> dict[str, str]:
        """The progress bar's loss."""
        return {"loss": f"{row['loss']:.3f}"}


def train_step(
    rows: list[Any],
    loss_fn: Callable[[list[Any]], tuple[Tensor, dict[str, float]]],
    params: Sequence[torch.nn.Parameter],
    optimizer: torch.optim.Optimizer,
    max_grad_norm: float,
) -> dict[str, float]:
    """One AdamW step on a batch of rows; its metrics (loss, stats, grad_norm, lr)."""
    loss, stats = loss_fn(rows)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm > 0 else float("inf"))
    optimizer.step()
    return {"loss": loss.item(), **stats, "grad_norm": float(grad_norm),
            "lr": optimizer.param_groups[0]["lr"]}


def restore(checkpoint: Path, state: StageState, order: BatchOrder) -> int:
    """Load ``checkpoint`` (verified already) into ``state``, ``order`` and the RNGs; its step.
    A checkpoint of another model or other data raises ``ValueError`` naming it."""
    try:
        step = load_checkpoint(checkpoint, state, order, verify=False)
    except ValueError as err:
        raise ValueError(f"--resume: cannot continue from {checkpoint}: {err}") from None
    if order.edited:  # rows fixed since the checkpoint (as many, in the same order)
        from textrl.envs.prompts import describe_edited

        print(describe_edited(order.edited, checkpoint), flush=True)
    print(f"resumed from {checkpoint} (step {step})", flush=True)
    return step


def save_stage_checkpoint(output_dir: Path, step: int, state: StageState, order: BatchOrder,
                          keep: int, files: dict[str, str] | None = None) -> Path:
    """``checkpoints/iter_NNNNNN`` through the atomic, manifest-marked
    :func:`textrl.run.save_checkpoint` (the ``keep`` newest stay); its path."""
    return save_checkpoint(output_dir, step, state, order, keep, files=files)


def format_summary(summary: dict[str, Any], keys: Sequence[str]) -> str:
    """A before/after table of the held-out metrics ``keys``."""
    lines = [f"{'held-out metric':<28}{'before':>10}{'after':>10}"]
    for key in keys:
        if key in summary["after"]:
            lines.append(f"{key:<28}{summary['before'][key]:>10.3f}{summary['after'][key]:>10.3f}")
    lines.append(f"model: {summary['model']} ({summary['steps']} steps, {summary['seconds']:.1f}s)")
    return "\n".join(lines)


__all__ = [
    "ADAPTER_META",
    "MODEL_DIR",
    "BatchOrder",
    "StageConfig",
    "StageState",
    "StageSteps",
    "adapter_base",
    "add_lora",
    "add_stage_arguments",
    "all_field_docs",
    "fit",
    "format_summary",
    "is_adapter_dir",
    "load_adapter_model",
    "load_policy",
    "model_record",
    "pad_left",
    "prepare_run",
    "read_jsonl",
    "resolve_model_path",
    "restore",
    "resume_point",
    "save_policy",
    "save_stage_checkpoint",
    "source_rows",
    "split_rows",
    "stage_precision",
    "train_step",
    "write_atomically",
]
