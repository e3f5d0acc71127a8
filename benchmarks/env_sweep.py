"""Every listed environment runs with nothing else: one ``textrl train`` iteration of each.

    python benchmarks/env_sweep.py [--jobs 2] [--only WORD[,WORD...]] [--timeout 900] [--list]

The environments are every built-in one (textrl's registry, ``textrl envs``), every reasoning-gym
task and every TextArena game docs/environments.md lists (:func:`listed_environments` reads them
from that page, so the sweep follows the docs; tests/envs/test_env_sweep.py checks that list against
``textrl.envs.adapters``). Each runs as ``textrl train --env ID --iterations 1 --output-dir TMP``
and nothing else: the default tiny model, the defaults' warm-up, the lengths fitted by
``textrl.envs.lengths``. Subprocesses run under ``nice -n 10`` with ``OMP_NUM_THREADS=1``, at most
``--jobs`` at a time. One line per environment (``ok`` or ``FAILED`` with the error's last line,
and seconds), then the counts; the exit status is 1 when any failed. A script, never imported by
textrl.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENVIRONMENTS_DOC = ROOT / "docs" / "environments.md"
"""The page that lists the adapters' environments (docs/environments.md, "Environments")."""

_RG_LIST = re.compile(r"These (\d+) tasks work without downloads\s*\(`textrl\.envs\.adapters\.REASONING_GYM_TASKS`\):"
                      r"(?P<names>[^.]*)\.")
"""The reasoning-gym list of docs/environments.md: a count, then the task names, comma-separated, up to a period."""
_TA_LIST = re.compile(r"These work offline \(`TEXTARENA_GAMES`\):(?P<names>[^;]*);")
"""The TextArena list of docs/environments.md: game names (with their variants) up to a semicolon."""
_TA_NAME = re.compile(r"^(?P<name>[A-Za-z0-9][\w-]*)(?:\s*\((?:(?P<count>\d+) variants|and their variants)\))?$")


@dataclass
class Outcome:
    """One environment's run: ``ok``, seconds, and the error's last line when it failed."""

    env: str
    ok: bool
    seconds: float
    error: str = ""

    def line(self) -> str:
        """The line printed for it."""
        head = f"{'ok' if self.ok else 'FAILED':6} {self.env:44} {self.seconds:7.1f} s"
        return head if self.ok else f"{head}  {self.error}"


def _names(block: str) -> list[str]:
    """Comma-separated names of a list of docs/environments.md, the line breaks and the final 'and' ignored."""
    return [n.strip() for n in " ".join(block.split()).split(",") if n.strip()]


def listed_reasoning_gym_tasks(text: str) -> list[str]:
    """The reasoning-gym tasks docs/environments.md lists; ``ValueError`` when the list is missing or its
    stated count is not the number of names."""
    found = _RG_LIST.search(" ".join(text.split()))
    if found is None:
        raise ValueError("docs/environments.md has no 'These N tasks work without downloads "
                         "(`textrl.envs.adapters.REASONING_GYM_TASKS`): ...' list")
    names = _names(found["names"])
    if len(names) != int(found.group(1)):
        raise ValueError(f"docs/environments.md says {found.group(1)} reasoning-gym tasks and lists {len(names)}")
    return names


def listed_textarena_names(text: str) -> list[tuple[str, str]]:
    """The TextArena entries of docs/environments.md as ``(name, variants)``: variants ``""`` (that id alone, or
    that game without variants), a count (``"14"``) or ``"all"`` (``and their variants``, said of
    every entry of the list when it ends the list)."""
    found = _TA_LIST.search(" ".join(text.split()))
    if found is None:
        raise ValueError("docs/environments.md has no 'These work offline (`TEXTARENA_GAMES`): ...;' list")
    entries: list[tuple[str, str]] = []
    for raw in _names(found["names"]):
        match = _TA_NAME.match(raw)
        if match is None:
            raise ValueError(f"docs/environments.md's TextArena list has an entry that is not a game name: {raw!r}")
        variants = match["count"] or ("all" if "their variants" in raw else "")
        entries.append((match["name"], variants))
    if entries and entries[-1][1] == "all":  # "..., TowerOfHanoi (and their variants)": every entry's
        entries = [(name, variants or "all") for name, variants in entries]
    return entries


def textarena_base(game: str) -> str:
    """A TextArena id's game name: ``2048-v0-3x3`` -> ``2048``, ``Sokoban-v0`` -> ``Sokoban``."""
    return game.split("-v", 1)[0]


def listed_textarena_games(text: str, known: list[str]) -> list[str]:
    """The TextArena ids docs/environments.md lists, in ``known``'s order: a name with a ``-v`` is that id
    alone, another name every id of ``known`` of that game. ``ValueError`` when a name matches no
    id or a stated variant count is wrong."""
    games: list[str] = []
    for name, variants in listed_textarena_names(text):
        if "-v" in name:
            ids = [g for g in known if g == name]
        else:
            ids = [g for g in known if textarena_base(g) == name]
        if not ids:
            raise ValueError(f"docs/environments.md lists the TextArena game {name!r}, which no id of TEXTARENA_GAMES has")
        if variants.isdigit() and int(variants) != len(ids):
            raise ValueError(f"docs/environments.md says {name} has {variants} variants; TEXTARENA_GAMES has {len(ids)}")
        games.extend(g for g in ids if g not in games)
    return [g for g in known if g in games]


def builtin_environments() -> list[str]:
    """textrl's registered environment ids (``textrl envs``)."""
    from textrl.envs import env_ids

    return env_ids()


def listed_environments(text: str | None = None) -> list[str]:
    """Every environment the sweep runs: the built-in ids, ``reasoning_gym:TASK`` for each task
    and ``textarena:ID`` for each game docs/environments.md lists."""
    from textrl.envs.adapters import TEXTARENA_GAMES

    text = ENVIRONMENTS_DOC.read_text() if text is None else text
    return (builtin_environments()
            + [f"reasoning_gym:{t}" for t in listed_reasoning_gym_tasks(text)]
            + [f"textarena:{g}" for g in listed_textarena_games(text, list(TEXTARENA_GAMES))])


def last_line(text: str) -> str:
    """The last non-empty line of a run's output (its error), progress bars' carriage returns cut."""
    lines = [line.split("\r")[-1].strip() for line in text.splitlines()]
    lines = [line for line in lines if line]
    return lines[-1][:300] if lines else "(no output)"


def run_folder(env: str) -> str:
    """The name of an environment's run folder: ``reasoning_gym:ab`` -> ``reasoning_gym_ab``."""
    return re.sub(r"[^\w.-]", "_", env)


def run_one(env: str, workdir: Path, timeout: float) -> Outcome:
    """``textrl train --env ENV --iterations 1`` in a subprocess, under nice, one thread."""
    out = workdir / run_folder(env)
    shutil.rmtree(out, ignore_errors=True)  # an earlier, unfinished run of the same environment
    command = ["nice", "-n", "10", sys.executable, "-m", "textrl.cli", "train", "--env", env,
               "--iterations", "1", "--output-dir", str(out)]
    environ = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    start = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=environ, cwd=workdir)
    except subprocess.TimeoutExpired:
        return Outcome(env, False, time.perf_counter() - start, f"no end after {timeout:.0f} s (--timeout)")
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        return Outcome(env, False, seconds, f"exit {done.returncode}: {last_line(done.stderr + done.stdout)}")
    if not (out / "summary.json").is_file():
        return Outcome(env, False, seconds, "exit 0 but no summary.json")
    return Outcome(env, True, seconds)


def sweep(envs: list[str], *, jobs: int, timeout: float, workdir: Path) -> list[Outcome]:
    """Run each environment, ``jobs`` at a time, printing each line as it ends."""
    outcomes: list[Outcome] = []
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(run_one, env, workdir, timeout): env for env in envs}
        for future in as_completed(futures):
            outcome = future.result()
            outcomes.append(outcome)
            print(outcome.line(), flush=True)
    return sorted(outcomes, key=lambda o: envs.index(o.env))


def main(argv: list[str] | None = None) -> int:
    """Command line: run the sweep and print the counts."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (default 2)")
    parser.add_argument("--only", default=None, help="run the environments whose id contains this word (or one of these, comma-separated)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds a run may take (default 900)")
    parser.add_argument("--list", action="store_true", help="print the environments and stop")
    parser.add_argument("--keep", default=None, help="folder for the runs' outputs (default: a temporary one)")
    parser.add_argument("--skip-done", action="store_true",
                        help="with --keep: leave out the environments whose folder there has a summary.json")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs {args.jobs} must be >= 1")
    envs = listed_environments()
    if args.only:
        words = [w.strip().lower() for w in args.only.split(",") if w.strip()]
        envs = [e for e in envs if any(w in e.lower() for w in words)]
        if not envs:
            parser.error(f"--only {args.only!r} matches no environment; --list names them")
    if args.skip_done:
        if not args.keep:
            parser.error("--skip-done needs --keep (the folder of the earlier runs)")
        done = [e for e in envs if (Path(args.keep) / run_folder(e) / "summary.json").is_file()]
        print(f"left out, done in {args.keep} before: {', '.join(done) or 'none'}")
        envs = [e for e in envs if e not in done]
    if args.list:
        print("\n".join(envs))
        return 0
    start = time.perf_counter()
    if args.keep:
        Path(args.keep).mkdir(parents=True, exist_ok=True)
        outcomes = sweep(envs, jobs=args.jobs, timeout=args.timeout, workdir=Path(args.keep))
    else:
        with tempfile.TemporaryDirectory(prefix="textrl-env-sweep-") as tmp:
            outcomes = sweep(envs, jobs=args.jobs, timeout=args.timeout, workdir=Path(tmp))
    failed = [o for o in outcomes if not o.ok]
    print(f"\n{len(outcomes) - len(failed)} ok, {len(failed)} failed of {len(outcomes)} environments "
          f"in {time.perf_counter() - start:.0f} s")
    for outcome in failed:
        print(outcome.line())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
