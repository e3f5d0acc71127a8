"""Every ``textrl train`` option tried once (issue 49): ``--top-p`` went untried since it was added.

The rule. Each option of ``textrl train --help`` has an entry in ``tests/option_sweep_values.py``
(a new option without one fails :func:`test_every_train_option_has_an_entry`): one value (a few for
an option that names one of a few choices) other than the baseline's (its default, unless the
baseline departs from it for size: then the default is a value to try), or the reason
it cannot run here (a GPU, vLLM, several processes). Each value runs alone, through the command line
in this process (``textrl.cli.main``: the flag parsed as a user's is), for two tiny iterations on top
of the baseline (``BASE``: a warmed-up tiny policy, 4 prompts x 2 samples, 8 new tokens), and the
cell fails when

1. the run stops (the one line ``textrl train`` prints: a traceback's last line or textrl's own
   error), or prints a traceback while it goes on;
2. an update was skipped for NaN/inf (``nonfinite/skipped_updates`` > 0 in metrics.jsonl);
3. the run's config.yaml does not hold the value (the option was dropped or overridden);
4. the option changes nothing it should: its entry names what must differ from the baseline run
   (the same settings without the option) -- the metrics, a metric, the sampled tokens, a summary
   value, a file, a printed line --, or says ``same`` for an option that must not change the
   computation (micro-batching, chunking, recomputation: the metrics within a float32 tolerance,
   the same samples), or ``recorded`` with the reason nothing can differ at this size and where its
   effect is tested. A difference is exact: the baseline repeats itself bit for bit
   (:func:`test_the_baseline_repeats_itself`), so any change comes from the option.

Slow: 121 cells, 18 baselines they share and a warm-up, about 140 runs of ~1 s: 2 to 3.5 minutes in one
process on a shared 2-core machine (measured with the command below):
``python -m pytest -p no:xdist -m slow tests/test_option_sweep.py``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import option_sweep_values as sweep
from textrl.cli import _add_debug_flag, build_parser, main
from textrl.config import TrainConfig

HERE = Path(__file__).resolve().parent
FIELDS = {f.name: f.default for f in fields(TrainConfig)}
VOLATILE = ("time/", "memory/", "tokens_per_second", "perf/tokens_per_s")
"""Metrics that measure the machine, not the run: left out of every comparison."""
SAME_RTOL, SAME_ATOL = 1e-4, 1e-6
"""``same``: two float32 computations of one function that add in another order (micro-batches, chunks,
another attention kernel) round apart by ~1e-7 relative; two iterations of training carry that to
~1e-5 at most. A real change (one token sampled otherwise, a step of another size) is far larger."""


def train_options() -> set[str]:
    """The options ``textrl train --help`` lists (hidden TRL aliases left out), as ``main`` builds them."""
    parser = build_parser("train")
    _add_debug_flag(parser)
    train = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["train"]
    return {a.dest for a in train._actions if a.help != argparse.SUPPRESS} - {"help"}


def tries(option: str) -> tuple[sweep.Try, ...]:
    entry = sweep.VALUES[option]
    return () if isinstance(entry, sweep.Exempt) else entry if isinstance(entry, tuple) else (entry,)


CELLS = [pytest.param(option, one, id=f"{option}={one.value}") for option in sweep.VALUES for one in tries(option)]


# -- the entries, checked without running anything ---------------------------------------------------


def test_every_train_option_has_an_entry():
    options = train_options() | set(FIELDS)  # a field the parser hid would still need an entry
    missing = sorted(options - set(sweep.VALUES))
    assert not missing, (f"give these options an entry in tests/option_sweep_values.py (a Try with a value and what it "
                         f"changes, or an Exempt with the reason): {missing}")
    assert not set(sweep.VALUES) - options, f"entries of no option: {sorted(set(sweep.VALUES) - options)}"


@pytest.mark.parametrize("option", sorted(sweep.VALUES))
def test_an_entry_tries_another_value_or_says_why_not(option):
    entry = sweep.VALUES[option]
    if isinstance(entry, sweep.Exempt):
        assert len(entry.reason.split()) >= 4, f"{option}: say why the sweep cannot try it"
        return
    for one in tries(option):
        assert one.why.strip(), f"{option}={one.value!r}: say what the value does"
        if option in FIELDS:
            baseline_value = {**FIELDS, **sweep.BASE, **one.base}[option]  # the default unless BASE departs from it
            assert one.value != baseline_value, f"{option}={one.value!r} is the baseline's value"
            assert option not in one.base, f"{option}: its own value belongs in value, not in base"
        if one.observe == "recorded":
            assert "test" in one.why, f"{option}: a value nothing observable follows names where its effect is tested"


# -- running ---------------------------------------------------------------------------------------


@dataclass
class Run:
    """What a finished run left: its folder, records and printed text."""

    folder: Path
    config: dict[str, Any]
    metrics: list[dict[str, Any]]
    samples: list[tuple[Any, ...]]
    summary: dict[str, Any]
    output: str
    seconds: float


def _placed(value: Any, places: dict[str, str]) -> Any:
    """``value`` with ``{warm}``, ``{tmp}``, ... replaced by their paths (in strings, lists and dicts)."""
    if isinstance(value, str):
        for name, path in places.items():
            value = value.replace("{" + name + "}", path)
        return value
    if isinstance(value, list):
        return [_placed(v, places) for v in value]
    if isinstance(value, dict):
        return {k: _placed(v, places) for k, v in value.items()}
    return value


def flags(settings: dict[str, Any]) -> list[str]:
    """``textrl train``'s arguments for ``settings`` (field -> value; ``debug`` a bare flag)."""
    argv = []
    for name, value in settings.items():
        flag = "--" + name.replace("_", "-")
        if name == "debug":
            argv += [flag] if value else []
        elif isinstance(value, bool):
            argv += [flag, str(value).lower()]
        elif isinstance(value, list):
            argv += [flag, ",".join(str(v) for v in value)]
        else:
            argv += [flag, str(value)]
    return argv


def run_train(settings: dict[str, Any], capfd) -> Run:
    """``textrl train`` with ``settings`` in this process; a stop fails the test with its line."""
    capfd.readouterr()
    start = time.perf_counter()
    try:
        code = main(["train", *flags(settings)])
    except SystemExit as stop:
        captured = capfd.readouterr()
        pytest.fail(f"the run stopped: {stop}\n{(captured.out + captured.err)[-3000:]}", pytrace=False)
    seconds = time.perf_counter() - start
    captured = capfd.readouterr()
    output = captured.out + captured.err
    assert code == 0, output[-3000:]
    folder = Path(settings["output_dir"])
    samples = [json.loads(line) for line in (folder / "samples.jsonl").read_text().splitlines()]
    return Run(folder=folder, config=yaml.safe_load((folder / "config.yaml").read_text()),
               metrics=[json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()],
               samples=[(s["iteration"], json.dumps(s.get("prompt")), s["completion"]) for s in samples],
               summary=json.loads((folder / "summary.json").read_text()), output=output, seconds=seconds)


def steady(row: dict[str, Any]) -> dict[str, Any]:
    """A metrics row without what measures the machine."""
    return {k: v for k, v in row.items() if not k.startswith(VOLATILE)}


def _close(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, (int, float)) or isinstance(b, float) and isinstance(a, (int, float)):
        return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=SAME_RTOL, abs_tol=SAME_ATOL)
    return a == b


def differences_beyond_tolerance(run: Run, base: Run) -> list[str]:
    """Where ``run`` and ``base`` differ beyond :data:`SAME_RTOL` (metrics) or at all (samples, rows)."""
    if len(run.metrics) != len(base.metrics):
        return [f"{len(run.metrics)} metric rows against {len(base.metrics)}"]
    found = []
    for mine, theirs in zip(map(steady, run.metrics), map(steady, base.metrics)):
        if mine.keys() != theirs.keys():
            found.append(f"iteration {mine['iteration']}: keys {sorted(mine.keys() ^ theirs.keys())} in one run only")
        found += [f"iteration {mine['iteration']}: {k} = {mine[k]!r} against {theirs[k]!r}"
                  for k in mine.keys() & theirs.keys() if not _close(mine[k], theirs[k])]
    if run.samples != base.samples:
        found.append("samples.jsonl differs")
    return found


def after(run: Run, before: dict[str, Any] | None) -> Run:
    """``run`` without what the run ``before`` it ended with (its held-out evaluation in the last metrics
    row, its closing samples): a resumed run's records against an uninterrupted one's."""
    if before is None:
        return run
    stop = before["iterations"]
    rows = [{k: v for k, v in row.items() if not (row["iteration"] == stop and k.startswith("eval/"))}
            for row in run.metrics]
    return replace(run, metrics=rows, samples=[s for s in run.samples if s[0] != stop])


def _at(tree: dict[str, Any], path: str) -> Any:
    for key in path.split("/") if path else ():
        tree = tree.get(key) if isinstance(tree, dict) else None
    return tree


def _summary(summary: dict[str, Any], path: str) -> Any:
    """A summary.json value by ``a/b`` path; the before/after sections' keys hold slashes themselves."""
    section, _, rest = path.partition("/")
    if section in ("before", "after"):
        return summary.get(section, {}).get(rest)
    return _at(summary, path)


def observed(what: str, run: Run, base: Run) -> tuple[Any, Any]:
    """(the run's, the baseline's) observable ``what`` (module docstring, rule 4)."""
    if what == "metrics":
        return list(map(steady, run.metrics)), list(map(steady, base.metrics))
    if what == "samples.jsonl":
        return run.samples, base.samples
    if what == "rows":
        return len(run.metrics), len(base.metrics)
    if what.startswith("summary:"):
        path = what.removeprefix("summary:")
        return _summary(run.summary, path), _summary(base.summary, path)
    if what.startswith("file:"):
        path = what.removeprefix("file:")
        return (run.folder / path).exists(), (base.folder / path).exists()
    if what.startswith("output:"):
        text = what.removeprefix("output:")
        return text in run.output, text in base.output
    return [row.get(what) for row in run.metrics], [row.get(what) for row in base.metrics]


@pytest.fixture(scope="module")
def places(tmp_path_factory) -> dict[str, str]:
    """The paths the entries' ``{name}`` placeholders stand for; ``{warm}``: the tiny policy after a 30-step
    supervised warm-up (as a checkpoint's policy folder), so that the baseline's rewards vary."""
    from textrl import TrainConfig as Config
    from textrl import train
    from textrl.models import tiny_model_path

    folder = tmp_path_factory.mktemp("warm")
    train(Config(agent="gae_ppo", device="cpu", iterations=1, warmup_sft_steps=30, prompts_per_iteration=2,
                 n_samples_per_prompt=2, num_minibatches=1, max_new_tokens=8, eval_size=2, eval_every=0,
                 progress=False, output_dir=str(folder / "run")))
    return {"warm": str(folder / "run" / "checkpoints" / "iter_000001" / "policy"),
            "tiny": str(tiny_model_path("causal_lm")), "tiny_rm": str(tiny_model_path("reward_model")),
            "here": str(HERE)}


@pytest.fixture(scope="module")
def baselines() -> dict[str, Run]:
    """Baseline runs by their settings, shared by the cells that need the same one."""
    return {}


def settings_of(one: sweep.Try, places: dict[str, str], folder: Path, option: str | None = None) -> dict[str, Any]:
    """The run's settings: ``BASE``, then the entry's ``base``, then the option's value (when given)."""
    settings = {**sweep.BASE, **one.base, "output_dir": str(folder)}
    if option is not None:
        settings[option] = one.value
    return _placed(settings, {**places, "tmp": str(folder.parent)})


def baseline(one: sweep.Try, places, baselines, tmp_path_factory, capfd) -> Run:
    key = json.dumps(_placed({**sweep.BASE, **one.base}, places), sort_keys=True)
    if key not in baselines:
        folder = tmp_path_factory.mktemp("baseline") / "run"
        baselines[key] = checked(run_train(settings_of(one, places, folder), capfd))
    return baselines[key]


def checked(run: Run) -> Run:
    """Rules 1 and 2: no traceback printed, no update skipped."""
    assert "Traceback (most recent call last)" not in run.output, run.output[-3000:]
    skipped = [(row["iteration"], row["nonfinite/skipped_updates"]) for row in run.metrics
               if row.get("nonfinite/skipped_updates", 0) > 0]
    assert not skipped, f"updates skipped for NaN/inf (iteration, count): {skipped}"
    return run


@pytest.mark.slow
def test_the_baseline_repeats_itself(places, baselines, tmp_path_factory, capfd):
    first = baseline(sweep.Try(None, "the baseline"), places, baselines, tmp_path_factory, capfd)
    folder = tmp_path_factory.mktemp("again") / "run"
    again = run_train(settings_of(sweep.Try(None, "again"), places, folder), capfd)
    assert list(map(steady, again.metrics)) == list(map(steady, first.metrics))  # exactly
    assert again.samples == first.samples and again.summary["after"] == first.summary["after"]
    assert all(row["reward/std"] > 0 for row in first.metrics), "the baseline's rewards must vary (advantages != 0)"


@pytest.mark.slow
@pytest.mark.parametrize(("option", "one"), CELLS)
def test_each_option_runs_and_acts(option, one, places, baselines, tmp_path_factory, tmp_path, capfd):
    for name, text in one.files.items():
        (tmp_path / name).write_text(text)
    if one.prepare is not None:
        one.prepare(tmp_path)
    folder = tmp_path / "run"
    settings = settings_of(one, {**places, "tmp": str(tmp_path)}, folder, option)
    if one.before is not None:
        checked(run_train({**settings_of(one, places, folder), **one.before}, capfd))
    run = checked(run_train(settings, capfd))
    value = settings[option]
    if option in FIELDS:
        assert run.config[option] == value, f"config.yaml holds {option}={run.config[option]!r}, not {value!r}"
    if callable(one.observe):
        assert one.observe(run), f"{option}={value!r}: {one.why}, which the run does not show"
        return
    if one.observe == "recorded":
        return
    base = baseline(one, places, baselines, tmp_path_factory, capfd)
    if one.observe == "same":
        found = differences_beyond_tolerance(after(run, one.before), after(base, one.before))
        assert not found, f"{option}={value!r} must change nothing ({one.why}); it changed: {found[:5]}"
        return
    mine, theirs = observed(one.observe, run, base)
    assert mine != theirs, (f"{option}={value!r} changed nothing it should: {one.why}, yet {one.observe} is "
                            f"{mine!r} in both runs")
