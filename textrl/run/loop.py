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

An engine that cannot go on (:class:`textrl.errors.EngineFailed`) loses nothing: raised in the
step, before its update, the body rewinds to the end of the iteration before (:meth:`LoopBody.rewind`:
its random state and prompts as they were) and that iteration is checkpointed, unless it was
already; raised in the evaluation, after the update, the row is written without its ``eval/``
metrics and the iteration checkpointed. Then the run stops (:class:`TrainingStopped`, status 1) with
the engine's line, what was saved and how to resume (:meth:`LoopBody.engine_message`).

However it ends, :attr:`RunLoop.end` says how (:func:`completed`, :func:`stopped`, :func:`failed`:
``ended``, ``iteration``, and for a stop or a failure the ``reason``) and ``curves.png`` is drawn
from the rows written: a run stopped by a signal, by its own fault (repeated NaN/inf updates) or
by an exception out of its body (an engine's failure) leaves the same records as a finished one,
and the caller writes its summary from :attr:`RunLoop.end` (``textrl train``: ``summary.json``).
No row is written twice: the row of an iteration is written once, before its checkpoint.
"""

from __future__ import annotations

import signal
import sys
import time
import traceback
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from textrl.generation.base import EngineFailed, EngineFailedElsewhere
from textrl.parallel.distributed import Distributed
from textrl.run.metrics import MetricsLog
from textrl.run.pace import Pace, threads_chosen
from textrl.run.progress import Progress
from textrl.run.signals import StopRequested, StopSignals, TrainingStopped, stop_phase


def completed(iteration: int) -> dict[str, Any]:
    """:attr:`RunLoop.end` of a run that did all its iterations (``iteration``: the last)."""
    return {"ended": "completed", "iteration": iteration}


def stopped(iteration: int, reason: str, signum: int | None, saved: Path | None) -> dict[str, Any]:
    """:attr:`RunLoop.end` of a stop after ``iteration`` (its row written): ``stopped_by`` the
    signal's name or ``"fault"`` (the body's own, :meth:`LoopBody.faulted`), the stop message as
    ``reason``, the ``checkpoint`` it saved (None: none, e.g. NaN/inf weights)."""
    return {"ended": "stopped", "stopped_by": signal.Signals(signum).name if signum else "fault",
            "reason": reason, "iteration": iteration, "checkpoint": None if saved is None else str(saved)}


def engine_failed(err: BaseException, iteration: int, done: int, saved: Path | None) -> dict[str, Any]:
    """:attr:`RunLoop.end` of an engine that could not go on (:class:`~textrl.errors.EngineFailed`)
    in ``iteration``: :func:`failed`'s, with the ``checkpoint`` of iteration ``done`` saved
    (None: none could be, e.g. no iteration had finished)."""
    return failed(err, iteration, done) | {"checkpoint": None if saved is None else str(saved)}


def failed(err: BaseException, iteration: int, done: int) -> dict[str, Any]:
    """:attr:`RunLoop.end` of an exception raised out of ``iteration``: ``iteration`` is ``done``,
    the last iteration whose row was written (``iteration`` itself when it raised after its row,
    in its checkpoint; the one before when it raised in its step or evaluation), ``failed_in`` the
    one that raised, ``reason`` the exception's type and message, ``where`` its innermost frame."""
    frames = traceback.extract_tb(err.__traceback__)
    where = f"{frames[-1].filename}:{frames[-1].lineno} ({frames[-1].name})" if frames else None
    return {"ended": "failed", "reason": f"{type(err).__name__}: {err}", "iteration": done, "failed_in": iteration,
            "where": where}


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

    # Optional (a body whose steps use no engine leaves them out):

    def rewind(self, iteration: int) -> bool:
        """After an engine's failure in ``step(iteration)``: put back what the step changed (its
        random state, the prompts it drew), so the state is that at the end of ``iteration - 1``;
        False where it cannot (the step's update had begun)."""

    def engine_message(self, err: BaseException, done: int, saved: Path | None) -> str:
        """What the user reads when an engine failed after iteration ``done`` (``saved``: its
        checkpoint, or None): the engine's line, what was saved, how to resume."""


PER_DEVICE_RATES = {"perf/total_tokens": "perf/tokens_per_s"}
"""A row's count over every process -> its rate per process (per device) and second of the step,
its evaluation left out (verl's ``perf/throughput``): the prompt and response tokens of ``textrl
train``'s iteration (:data:`textrl.training.records.TOTAL_TOKENS`)."""


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
    engine_failure: BaseException | None = None
    """The engine's failure that cut the evaluation of the current iteration (None: none)."""
    saved: int = 0
    """The iteration of the newest checkpoint (the run's start until it saves one)."""
    saved_path: Path | None = None
    """That checkpoint's folder, where this loop saved it (None before it saves one)."""
    end: dict[str, Any] | None = None
    """How the last :meth:`run` ended (:func:`completed`, :func:`stopped` or :func:`failed`); None
    while it runs, and after an abort (a second signal: ``KeyboardInterrupt``)."""

    def run(self, body: LoopBody, start: int, signals: StopSignals | None = None) -> None:
        """Iterations ``start + 1 .. iterations`` of ``body``; :class:`TrainingStopped` on a stop.

        ``signals``: the run's handler when it was installed before set-up (so a signal while
        models load stops after the first iteration); else one is installed for the loop.
        """
        self.end = None
        progress = Progress(self.progress, self.iterations, start, self.name)
        # the torch threads fitted to the cores other processes leave, a line when iterations crawl
        pace = Pace(log=print if self.main else (lambda line: None), unit=self.timing,
                    adapt=self.fit_threads and not torch.cuda.is_initialized() and not threads_chosen())
        pace.start()
        iteration = start
        self.saved, self.saved_path = start, None
        try:
            with nullcontext(signals) if signals is not None else StopSignals() as signals:
                for iteration in range(start + 1, self.iterations + 1):
                    last = iteration == self.iterations
                    with stop_phase(f"the last {self.timing}" if last else f"the current {self.timing}",
                                    "ending the run" if last else "saving a checkpoint", stoppable=not last):
                        try:
                            row = self.iteration(body, iteration)
                        except EngineFailed as err:  # in the step, before its update: nothing of it stands
                            self.engine_stop(body, err, iteration, progress)
                        self.metrics.write(row)
                    progress.advance(body.postfix(row))
                    pace.after(iteration, row[f"time/{self.timing}_s"] - row.get("time/eval_s", 0.0))
                    self.stop_or_save(body, iteration, signals, progress)
        except TrainingStopped as stop:
            if self.end is None:  # raised by the body itself, not by stop_or_save (which set the end, closed the logs)
                self.end = stopped(self.last_row(start), str(stop), None, None)
                progress.close()
                self.metrics.close()
            self.draw(quietly=True)
            raise
        except Exception as err:  # the body's (an engine's failure, a full disk): the records say so, then it goes on up
            self.end = failed(err, iteration, self.last_row(start))
            progress.close()
            self.metrics.close()
            self.draw(quietly=True)
            raise
        finally:
            torch.set_num_threads(pace.most)  # as the process started
        progress.close()
        self.end = completed(max(start, self.iterations))
        self.draw()
        self.metrics.close()

    def last_row(self, start: int) -> int:
        """The iteration of the last row written (``start`` when none was)."""
        return int(self.metrics.rows[-1]["iteration"]) if self.metrics.rows else start

    def draw(self, quietly: bool = False) -> None:
        """``curves.png`` (:attr:`plot`) of the rows written. ``quietly`` (a stop or a failure, whose
        own message must reach the user): a plot that fails is a line on stderr, not an exception."""
        if self.plot is None:
            return
        if not quietly:
            self.metrics.plot(self.plot)
            return
        try:
            self.metrics.plot(self.plot)
        except Exception as err:  # noqa: BLE001 - the stop's message, not the plot's, is what the user needs
            if self.main:
                print(f"{self.plot} not drawn: {type(err).__name__}: {err}", file=sys.stderr, flush=True)

    def iteration(self, body: LoopBody, iteration: int) -> dict[str, Any]:
        """One step of ``body`` with its evaluation when due; the timed metrics row."""
        t0 = time.perf_counter()
        timings: dict[str, float] = {}
        row = body.step(iteration, timings)
        self.evaluation_cut = None
        self.engine_failure = None
        if self.evaluates and self.due(iteration, self.eval_every):
            try:
                with stop_phase("the current evaluation batch"):
                    row.update(body.evaluate(iteration, timings))
            except StopRequested as err:  # a signal: the evaluation ends between batches, unlogged
                self.evaluation_cut = err.where
            except EngineFailed as err:  # after the update: the row stands, unevaluated, and is saved
                self.engine_failure = err
        row.update({f"time/{phase}_s": seconds for phase, seconds in timings.items()})
        row[f"time/{self.timing}_s"] = time.perf_counter() - t0
        if self.throughput is not None:
            row[f"{self.throughput}_per_second"] = row[self.throughput] / row[f"time/{self.timing}_s"]
        step_s = row[f"time/{self.timing}_s"] - row.get("time/eval_s", 0.0)
        for count, rate in PER_DEVICE_RATES.items():
            if count in row and step_s > 0:
                row[rate] = row[count] / self.dist.world_size / step_s
        return row

    def due(self, iteration: int, every: int) -> bool:
        """Every ``every`` iterations (0 = never), and the last."""
        return iteration == self.iterations or bool(every and iteration % every == 0)

    def stop_or_save(self, body: LoopBody, iteration: int, signals: StopSignals, progress: Progress) -> None:
        """A checkpoint when due; on a signal (to any process, before the last iteration) or a
        fault of ``body``: a checkpoint, then :class:`TrainingStopped`."""
        interrupted = self.dist.any(signals.received is not None) and iteration < self.iterations
        if self.dist.any(self.engine_failure is not None) and self.engine_failure is None:  # all stop together
            self.engine_failure = EngineFailedElsewhere("the engine of another process failed in the evaluation "
                                                        "(its line is in that process's output)")
        faulted = body.faulted()
        stop = interrupted or faulted or self.engine_failure is not None
        due = self.due(iteration, self.checkpoint_every) and (self.checkpoint_last or iteration < self.iterations)
        saved = body.checkpoint(iteration, stop) if stop or due else None
        if saved is not None:
            self.saved, self.saved_path = iteration, saved
        if self.engine_failure is not None:
            self.dist.barrier()
            self.finish_engine_stop(body, self.engine_failure, iteration, iteration, saved, progress)
        if not stop:
            return
        self.dist.barrier()  # the others wait for the main process's checkpoint before exiting
        progress.close()
        self.metrics.close()
        message = body.stop_message(iteration, signals.received, saved)
        if self.evaluation_cut is not None:
            message += f" ({self.evaluation_cut} was cut short: the row of {self.timing} {iteration} has no eval/ metrics)"
        self.end = stopped(iteration, message, None if faulted else signals.received or signal.SIGTERM, saved)
        if self.main:
            print(message, file=sys.stderr, flush=True)
        raise TrainingStopped(message, 1 if faulted else 128 + (signals.received or signal.SIGTERM))


    def engine_stop(self, body: LoopBody, err: EngineFailed, iteration: int, progress: Progress) -> None:
        """An engine failed in ``body.step(iteration)``: iteration ``iteration - 1`` checkpointed
        (unless it was, or none had finished since ``start``, or the body cannot rewind), then the stop."""
        done = iteration - 1
        saved = self.saved_path if done == self.saved else None
        rewind = getattr(body, "rewind", None)
        if done > self.saved and rewind is not None and rewind(iteration):
            saved = body.checkpoint(done, True)
        self.finish_engine_stop(body, err, iteration, done, saved, progress)

    def finish_engine_stop(self, body: LoopBody, err: EngineFailed, iteration: int, done: int, saved: Path | None,
                           progress: Progress) -> None:
        """Close the logs, say what happened and what was saved, raise :class:`TrainingStopped` (status 1)."""
        progress.close()
        self.metrics.close()
        describe = getattr(body, "engine_message", None)
        message = describe(err, done, saved) if describe is not None else str(err)
        self.end = engine_failed(err, iteration, done, saved)
        if self.main:
            print(message, file=sys.stderr, flush=True)
        elif not isinstance(err, EngineFailedElsewhere):  # its own engine's line; the main process says what was saved
            print(f"rank {self.dist.rank}: {err}", file=sys.stderr, flush=True)
        raise TrainingStopped(message, 1) from err


__all__ = ["PER_DEVICE_RATES", "LoopBody", "RunLoop", "completed", "engine_failed", "failed", "stopped"]
