"""What a run writes as it goes: ``metrics.jsonl``, TensorBoard events, ``curves.png`` and
``samples.jsonl``; on resume each keeps only what was written up to the resumed iteration.

The JSON-lines logs are appended a line at a time, so a crash or a full disk can leave a torn last
line; on resume it is dropped with a warning (:func:`rows_up_to`) and the kept lines are rewritten
atomically. TensorBoard purges the events after the resumed iteration, so each shows once.

Every line is strict JSON (RFC 8259, which has no NaN or Infinity): a value that is not a finite
number (``explained_variance`` when the returns are constant, a diverged loss) is written as
``null``, as JavaScript's ``JSON.stringify`` does, so ``jq`` and any JSON reader take the file
(:func:`json_text`); :func:`loads_row` reads a row's ``null`` back as NaN (an infinity too: its
sign is not kept). Lines written by an older textrl with a bare ``NaN`` still read.

``curves.png`` draws the held-out evaluation before training at iteration 0, read from the run
folder's ``eval_before.json`` (:data:`EVAL_BEFORE_FILE`) when there is one.
"""

from __future__ import annotations

import errno
import json
import math
import time
import warnings
from pathlib import Path
from typing import Any

from textrl.run import atomic

EVAL_BEFORE_FILE = "eval_before.json"
"""The held-out evaluation before the first iteration, in the run folder (iteration 0 of ``curves.png``)."""


def finite_or_null(value: Any) -> Any:
    """``value`` with every float that is not finite (NaN, +-inf) replaced by None, in nested
    dicts, lists and tuples too (a tuple becomes a list, as JSON has it).

    >>> finite_or_null({"a": float("nan"), "b": [1.5, float("-inf")], "c": "x"})
    {'a': None, 'b': [1.5, None], 'c': 'x'}
    """
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite_or_null(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(item) for item in value]
    return value


def json_text(value: Any, indent: int | None = None) -> str:
    """``value`` as strict JSON text: non-finite floats as ``null`` (:func:`finite_or_null`), never
    the ``NaN`` / ``Infinity`` that ``json.dumps`` writes by default and JSON readers refuse.

    >>> json_text({"iteration": 3, "explained_variance": float("nan")})
    '{"iteration": 3, "explained_variance": null}'
    """
    return json.dumps(finite_or_null(value), indent=indent, allow_nan=False)


def loads_row(line: str) -> dict[str, Any]:
    """One JSON row of a run's log; a top-level ``null`` (a non-finite number, :func:`json_text`)
    reads back as NaN. ``ValueError`` when the line is not JSON, ``TypeError`` when it is not an object.

    >>> loads_row('{"iteration": 3, "explained_variance": null}')
    {'iteration': 3, 'explained_variance': nan}
    """
    row = json.loads(line)
    if not isinstance(row, dict):
        raise TypeError(f"not a JSON object: {line[:60]!r}")
    return {key: math.nan if value is None else value for key, value in row.items()}


def read_rows(path: Path) -> list[dict[str, Any]]:
    """Every row of a finished run's ``metrics.jsonl`` (:func:`loads_row`: ``null`` as NaN), in order."""
    return [loads_row(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def read_eval_before(output_dir: Path) -> dict[str, Any] | None:
    """The run folder's held-out evaluation before training (``eval_before.json``, ``null`` read as
    NaN), or None when there is none or it does not parse (a plot is no reason to stop a run)."""
    path = Path(output_dir) / EVAL_BEFORE_FILE
    try:
        return loads_row(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError):
        return None


def rows_up_to(path: Path, iteration: int) -> list[dict[str, Any]]:
    """The JSON rows of ``path`` whose ``iteration`` is at most ``iteration``.

    A last line that does not parse (torn by a crash or a full disk while appending) is dropped
    with a warning; a bad line before the last is a ``ValueError`` naming the file and the line.
    A ``null`` value reads back as NaN (:func:`loads_row`).
    """
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = loads_row(line)
            row["iteration"]
        except (ValueError, TypeError, KeyError):
            if number == len(lines):
                warnings.warn(f"{path}: dropped its last line {number}, torn by an interrupted write "
                              f"({line[:60]!r})", stacklevel=2)
                break
            raise ValueError(f"{path}: line {number} is not a JSON row with an 'iteration' ({line[:60]!r}); "
                             "repair or delete that line, then resume again") from None
        rows.append(row)
    return [row for row in rows if row["iteration"] <= iteration]


def append_line(path: Path, text: str, what: str) -> None:
    """Append ``text`` to ``path`` and flush; a full disk (or any write error) is an ``OSError``
    naming the file, ``what`` was written and the fix. A torn line it leaves is dropped on resume
    (:func:`rows_up_to`), and the resumed run writes the rows after its checkpoint again."""
    try:
        with path.open("a") as f:
            f.write(text)
            f.flush()
    except OSError as err:
        reason = "the disk is full" if err.errno in (errno.ENOSPC, errno.EDQUOT) else (err.strerror or str(err))
        failure = OSError(f"cannot append {what} to {path}: {reason}; free space (or fix the folder), then "
                          "resume with --resume: the rows after the last checkpoint are written again")
        failure.errno = err.errno  # the message alone: str() without the "[Errno N]" prefix
        raise failure from err


def rewrite_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    """Replace ``path`` by ``rows`` (one JSON object a line) atomically: a crash leaves the old
    file or the new one, never a half-written one."""
    atomic.write_text(path, "".join(json_text(row) + "\n" for row in rows))


def wait_past_event_files(tb_dir: Path) -> None:
    """Wait, if need be, until the clock's second is past that of every event file in ``tb_dir``.

    TensorBoard reads a folder's event files in name order, and a name is
    ``events.out.tfevents.<second>.<host>.<pid>.<counter>``: two files opened in the same second
    compare by process id and counter as text (``...9`` after ``...10``), so a resumed run's file,
    whose first event tells TensorBoard to purge the iterations after the resume, could be read
    before the file it purges. At most a second's wait, only when a run resumes within the second
    its previous event file was opened.
    """
    newest = -1
    for path in tb_dir.glob("events.out.tfevents.*"):
        second = path.name.split(".")[3]
        if second.isdigit():
            newest = max(newest, int(second))
    while int(time.time()) <= newest:
        time.sleep(newest + 1 - time.time() + 0.01)


class MetricsLog:
    """``metrics.jsonl`` (one flushed line per iteration), TensorBoard, and the curve plot.

    A fresh run (``resume_after`` None) starts ``metrics.jsonl`` anew; a resumed one keeps the
    rows up to ``resume_after`` (in ``rows`` too). Only an ``enabled`` log writes files.
    """

    def __init__(self, output_dir: Path, enabled: bool, resume_after: int | None, kl_kind: str | None = None) -> None:
        self.path = output_dir / "metrics.jsonl"
        self.enabled = enabled
        self.kl_kind = kl_kind  # the estimator behind kl/collection, for curves.png's label
        self.rows: list[dict[str, float]] = []
        self.writer = None
        if not enabled:
            return
        if resume_after is not None and self.path.exists():
            self.rows = rows_up_to(self.path, resume_after)
            rewrite_rows(self.path, self.rows)
        elif self.path.exists():
            self.path.unlink()
        from torch.utils.tensorboard import SummaryWriter

        # resumed: TensorBoard hides the events of iterations after resume_after (written before
        # the stop), so each iteration shows once
        purge = resume_after + 1 if resume_after is not None else None
        wait_past_event_files(output_dir / "tb")
        self.writer = SummaryWriter(str(output_dir / "tb"), purge_step=purge)

    def write(self, row: dict[str, float]) -> None:
        """Append one iteration's row (kept in ``rows`` on every process, written on the main one)."""
        self.rows.append(row)
        if not self.enabled:
            return
        append_line(self.path, json_text(row) + "\n", f"iteration {row['iteration']}'s row")
        for key, value in row.items():
            if key != "iteration" and isinstance(value, (int, float)):
                self.writer.add_scalar(key, value, row["iteration"])

    def plot(self, path: Path) -> None:
        """``curves.png`` (:func:`curves_figure`) of the rows so far, with the held-out evaluation
        before training at iteration 0 when the run folder has ``eval_before.json``."""
        if not self.enabled or not self.rows:
            return
        import matplotlib.pyplot as plt

        fig = curves_figure(self.rows, self.kl_kind, before=read_eval_before(self.path.parent))
        fig.savefig(path, dpi=100)
        plt.close(fig)

    def close(self) -> None:
        """Flush and close the TensorBoard writer."""
        if self.writer is not None:
            self.writer.close()


KL_ESTIMATES = {
    "k1": ("k1 estimate of KL(policy || ref)", "mean log-ratio; can be negative"),
    "k2": ("k2 estimate of KL(policy || ref)", "half the squared log-ratio; >= 0, biased"),
    "k3": ("k3 estimate of KL(policy || ref)", "r - 1 - log r, r = ref / policy; >= 0"),
    "abs": ("abs estimate of KL(policy || ref)", "|log-ratio|; >= 0, biased"),
}
"""``--kl-kind`` -> (what ``kl/collection`` is, how it is computed per token; Schulman's estimators)."""


def kl_axis_label(kind: str | None) -> str:
    """The KL axis label of ``curves.png`` for the run's ``--kl-kind`` (None: not known), two lines."""
    name, how = KL_ESTIMATES.get(kind, ("estimate of KL(policy || ref)", "the run's --kl-kind; k1 can be negative"))
    return f"{name} at collection\n({how})"


def curves_figure(rows: list[dict[str, Any]], kl_kind: str | None = None,
                  before: dict[str, Any] | None = None) -> Any:
    """The figure of ``curves.png``: rollout and held-out reward, and ``kl/collection`` per
    iteration, labelled with its estimator (:func:`kl_axis_label`; a dotted line marks 0, below
    which a k1 curve can dip). ``before``: the held-out evaluation before training (the keys of
    ``eval_before.json``), drawn as the held-out line's point at iteration 0."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    its = [r["iteration"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
    ax1.plot(its, [r.get("reward/mean", float("nan")) for r in rows], label="rollout reward")
    evals = [r for r in rows if "eval/sampled/reward/mean" in r]
    if before is not None and "eval/sampled/reward/mean" in before:
        evals = [{**before, "iteration": 0}, *(r for r in evals if r["iteration"] != 0)]
    if evals:
        ax1.plot([r["iteration"] for r in evals], [r["eval/sampled/reward/mean"] for r in evals],
                 "o-", label="held-out (sampled)")
    ax1.set_xlabel("iteration")
    ax1.set_ylabel("reward")
    ax1.legend()
    ax2.plot(its, [r.get("kl/collection", float("nan")) for r in rows])
    ax2.axhline(0.0, color="grey", linestyle=":", linewidth=1)
    ax2.set_xlabel("iteration")
    ax2.set_ylabel(kl_axis_label(kl_kind), fontsize=8)
    fig.tight_layout()
    return fig


class SamplesLog:
    """``samples.jsonl``: greedy held-out completions at each evaluation, one JSON object per line,
    ``{"iteration", "prompt", "completion", "turns"}``: ``completion`` is every token after the
    prompt decoded (a multi-turn episode's observations included), ``turns`` the same text apart as
    a list of ``{"role": "agent" | "environment", "text"}``, one per stretch of the agent's or the
    environment's tokens, as the loss mask sees them (a single-turn completion: one agent entry;
    :func:`textrl.envs.collector.episode_turns`).

    A fresh run (``resume_after`` None) starts the file anew; a resumed one keeps the lines up to
    ``resume_after``. Nothing is written when ``enabled`` is false (processes other than the main).
    """

    def __init__(self, output_dir: Path, enabled: bool, resume_after: int | None) -> None:
        self.path = output_dir / "samples.jsonl"
        self.enabled = enabled
        if not enabled:
            return
        if resume_after is None:
            self.path.unlink(missing_ok=True)
        elif self.path.exists():
            rewrite_rows(self.path, rows_up_to(self.path, resume_after))

    def write(self, iteration: int, samples: list[dict[str, str]]) -> None:
        if not self.enabled:
            return
        lines = "".join(json_text({"iteration": iteration, **sample}) + "\n" for sample in samples)
        append_line(self.path, lines, f"iteration {iteration}'s samples")


__all__ = ["EVAL_BEFORE_FILE", "KL_ESTIMATES", "MetricsLog", "curves_figure", "SamplesLog", "finite_or_null", "json_text",
           "kl_axis_label", "loads_row", "read_eval_before", "read_rows", "rewrite_rows", "rows_up_to"]
