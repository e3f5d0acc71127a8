"""The loop every run drives: ``textrl train`` (PPO iterations) and the stages (``sft``, ``rm``,
``dpo``: AdamW steps) alike.

:class:`RunLoop` owns what is the same for all of them: iterating ``start + 1 .. iterations``,
timing each iteration, evaluation and checkpoint cadence, writing the metrics row, the progress
bar, the signal check and the stop (a checkpoint, then :class:`TrainingStopped`), and the final
plot. What differs is a :class:`LoopBody`: its step, its evaluation, its checkpoint.

One iteration, in order::

    row = body.step(i, timings)                     # the algorithm; returns the metrics row
    row |= body.evaluate(i, timings)                # when due (every eval_every, and the last)
    row |= time/<phase>_s, time/<timing>_s          # (+ <throughput>_per_second)
    metrics.jsonl <- row; progress bar
    pace: torch threads fitted to the free cores; a line if iterations crawl (textrl.run.pace)
    stop = a signal (any process; not after the last) or body.faulted()
    body.checkpoint(i, stop)                        # when due, or stopping
    stop: raise TrainingStopped(body.stop_message(...))
"""

from __future__ import annotations

import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from textrl.distributed import Distributed
from textrl.run.metrics import MetricsLog
from textrl.run.pace import Pace, threads_chosen
from textrl.run.progress import Progress
from textrl.run.signals import StopRequested, StopSignals, TrainingStopped, stop_phase


class LoopBody(Protocol):
    """What a run supplies to :class:`RunLoop`."""

    def step(self, iteration: int, timings: dict[str, float]) -> dict[str, Any]:
        """Do one iteration; return its metrics row (``"iteration"`` first). Phases timed into
        ``timings`` are logged as ``time/<phase>_s``."""

    def evaluate(self, iteration: int, timings: dict[str, float]) -> dict[str, Any]:
        """Held-out metrics to add to the row (keys under ``eval/``)."""

    def checkpoint(self, iteration: int, stopping: bool) -> Path | None:
        """Save a resumable checkpoint after ``iteration``; its path (None where this process
        wrote none, or the state was not worth saving)."""

    def faulted(self) -> bool:
        """Whether the run must stop now for a fault of its own (e.g. repeated NaN/inf updates)."""

    def stop_message(self, iteration: int, signum: int | None, saved: Path | None) -> str:
        """Why the run stopped after ``iteration``, where its checkpoint is, how to resume."""

    def postfix(self, row: dict[str, Any]) -> dict[str, str]:
        """What the progress bar shows after an iteration (``{"loss": "0.512"}``)."""


@dataclass
class RunLoop:
    """Drives a :class:`LoopBody` from ``start + 1`` to ``iterations``.

    ``eval_every`` / ``checkpoint_every``: every N iterations (0 = off); the last iteration is
    always evaluated, and checkpointed when ``checkpoint_last`` (the stages save their final
    model elsewhere). ``evaluates``: whether this process evaluates at all. ``timing``: the
    iteration's wall-clock seconds are logged as ``time/<timing>_s``; ``throughput``: a row key
    also logged per second of that (``tokens`` -> ``tokens_per_second``). ``plot``: where the
    metrics log draws its curves at the end (None: no plot). ``main``: this process writes the
    stop message; ``dist``: a signal to any process stops them all. ``fit_threads``: see the field.
    """

    name: str
    iterations: int
    metrics: MetricsLog
    eval_every: int = 0
    checkpoint_every: int = 0
    checkpoint_last: bool = True
    evaluates: bool = True
    timing: str = "iteration"
    throughput: str | None = None
    progress: bool = False
    plot: Path | None = None
    main: bool = True
    dist: Distributed = field(default_factory=Distributed)
    fit_threads: bool = True
    """Whether the torch threads follow the cores other processes leave (:mod:`textrl.run.pace`)."""
    evaluation_cut: str | None = None
    """How far the evaluation of the current iteration got when a signal cut it (None: it ran whole)."""

    def run(self, body: LoopBody, start: int, signals: StopSignals | None = None) -> None:
        """Iterations ``start + 1 .. iterations`` of ``body``; :class:`TrainingStopped` on a stop.

        ``signals``: the run's handler when it was installed before set-up (so a signal while
        models load stops after the first iteration); else one is installed for the loop.
        """
        progress = Progress(self.progress, self.iterations, start, self.name)
        # the torch threads fitted to the cores other processes leave, a line when iterations crawl
        pace = Pace(log=print if self.main else (lambda line: None), unit=self.timing,
                    adapt=self.fit_threads and not torch.cuda.is_initialized() and not threads_chosen())
        pace.start()
        try:
            with nullcontext(signals) if signals is not None else StopSignals() as signals:
                for iteration in range(start + 1, self.iterations + 1):
                    last = iteration == self.iterations
                    with stop_phase(f"the last {self.timing}" if last else f"the current {self.timing}",
                                    "ending the run" if last else "saving a checkpoint", stoppable=not last):
                        row = self.iteration(body, iteration)
                        self.metrics.write(row)
                    progress.advance(body.postfix(row))
                    pace.after(iteration, row[f"time/{self.timing}_s"] - row.get("time/eval_s", 0.0))
                    self.stop_or_save(body, iteration, signals, progress)
        finally:
            torch.set_num_threads(pace.most)  # as the process started
        progress.close()
        if self.plot is not None:
            self.metrics.plot(self.plot)
        self.metrics.close()

    def iteration(self, body: LoopBody, iteration: int) -> dict[str, Any]:
        """One step of ``body`` with its evaluation when due; the timed metrics row."""
        t0 = time.perf_counter()
        timings: dict[str, float] = {}
        row = body.step(iteration, timings)
        self.evaluation_cut = None
        if self.evaluates and self.due(iteration, self.eval_every):
            try:
                with stop_phase("the current evaluation batch"):
                    row.update(body.evaluate(iteration, timings))
            except StopRequested as err:  # a signal: the evaluation ends between batches, unlogged
                self.evaluation_cut = err.where
        row.update({f"time/{phase}_s": seconds for phase, seconds in timings.items()})
        row[f"time/{self.timing}_s"] = time.perf_counter() - t0
        if self.throughput is not None:
            row[f"{self.throughput}_per_second"] = row[self.throughput] / row[f"time/{self.timing}_s"]
        return row

    def due(self, iteration: int, every: int) -> bool:
        """Every ``every`` iterations (0 = never), and the last."""
        return iteration == self.iterations or bool(every and iteration % every == 0)

    def stop_or_save(self, body: LoopBody, iteration: int, signals: StopSignals, progress: Progress) -> None:
        """A checkpoint when due; on a signal (to any process, before the last iteration) or a
        fault of ``body``: a checkpoint, then :class:`TrainingStopped`."""
        interrupted = self.dist.any(signals.received is not None) and iteration < self.iterations
        faulted = body.faulted()
        stop = interrupted or faulted
        due = self.due(iteration, self.checkpoint_every) and (self.checkpoint_last or iteration < self.iterations)
        saved = body.checkpoint(iteration, stop) if stop or due else None
        if not stop:
            return
        self.dist.barrier()  # the others wait for the main process's checkpoint before exiting
        progress.close()
        self.metrics.close()
        message = body.stop_message(iteration, signals.received, saved)
        if self.evaluation_cut is not None:
            message += f" ({self.evaluation_cut} was cut short: the row of {self.timing} {iteration} has no eval/ metrics)"
        if self.main:
            print(message, file=sys.stderr, flush=True)
        raise TrainingStopped(message, 1 if faulted else 128 + (signals.received or signal.SIGTERM))


__all__ = ["LoopBody", "RunLoop"]
