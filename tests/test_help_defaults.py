"""Help that is true: every default a subcommand's ``--help`` shows is the value it uses.

For each subcommand of ``textrl`` (found in the parser, so a new one is checked too), each
option's help as ``--help`` prints it is searched for the defaults it claims: ``(default: X)``,
``(default X)``, ``default: X`` at its start and ``X (default)``. A claim that is a literal
(``'rloo'``, ``0.02``, ``None``, ``runs/bench``, ``gae_ppo,rloo``) must equal what the command
uses when the option is not given:

- a config field of ``train`` and the stages: the field of the config the command builds from no
  flags (:func:`textrl.config.build_config`);
- ``bench``: what the comparison really plans with no flags (its jobs' configs, agents, seeds,
  environments, token budget and folder, captured just before any job would run);
- any other option: argparse's default.

A claim in words (``CPU cores // --threads``) must be one this file checks by hand
(:data:`IN_WORDS`). Per-agent defaults (``None = the agent's default: 0.2, one_step_ppo 0.1``)
are checked against each registered agent's ``default_<field>``.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import os
import re
from pathlib import Path
from typing import Any

import pytest

from textrl.cli import _add_debug_flag, build_parser

CLAIMS = (
    re.compile(r"\(default:? ((?:[^()]|\([^()]*\))*)\)"),  # (default: X) / (default X)
    re.compile(r"^default:? (.*)$"),  # a help that is only "default: X"
    re.compile(r"((?:'[^']*'|\S+)) \(default\)"),  # X (default)
)
LITERAL = re.compile(r"""^('(?:[^'\\]|\\.)*'|"[^"]*"|-?\d[\d_]*(?:\.\d*)?(?:e-?\d+)?|True|False|None)(?=$|[\s;)])""")
BARE = re.compile(r"^([\w./-]+(?:,[\w./-]+)*)(?=$|[\s;)])")


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TEXTRL_CACHE", str(tmp_path / "cache"))


def subcommands() -> dict[str, argparse.ArgumentParser]:
    """Every subcommand's parser, as ``textrl`` builds it (``--debug`` included)."""
    parser = build_parser()
    _add_debug_flag(parser)
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def shown_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The option's help as ``--help`` prints it (the formatter's own additions, %-expansion),
    on one line."""
    return " ".join(parser._get_formatter()._expand_help(action).split())


def claims(text: str) -> list[str]:
    """The defaults ``text`` claims, as written."""
    found = []
    for pattern in CLAIMS:
        found += [m.group(1).strip() for m in pattern.finditer(text)]
    return found


def claimed_value(claim: str) -> tuple[str, Any]:
    """``("literal", value)`` (a Python literal) or ``("bare", text)`` (its first unquoted word or
    comma list: ``runs/bench``, ``0,1,2``)."""
    literal = LITERAL.match(claim)
    if literal:
        return "literal", ast.literal_eval(literal.group(1))
    bare = BARE.match(claim)
    return "bare", bare.group(1) if bare else claim


def same(claimed: tuple[str, Any], actual: Any) -> bool:
    kind, value = claimed
    if kind == "literal":
        return value == actual and type(value) is type(actual) or (
            isinstance(value, (int, float)) and isinstance(actual, (int, float)) and not isinstance(actual, bool)
            and value == actual)
    if isinstance(actual, (list, tuple)):
        return value == ",".join(str(a) for a in actual)
    return value == str(actual)


# -- what each command really uses ----------------------------------------------------------------


def config_class(command: str):
    """The config dataclass of a subcommand, or None."""
    from textrl.config import TrainConfig

    if command in ("train", "bench"):
        return TrainConfig
    from textrl.stages import dpo, merge, pipeline, rm, sft

    return {"sft": sft.SFTConfig, "rm": rm.RMConfig, "dpo": dpo.DPOConfig, "merge": merge.MergeConfig,
            "pipeline": pipeline.PipelineConfig}.get(command)


class _Planned(Exception):
    """Raised by the patched bench to stop once its jobs are planned."""


def bench_plan(parser: argparse.ArgumentParser, tmp_path: Path, monkeypatch) -> dict[str, Any]:
    """What ``textrl bench`` with no flags plans: ``{"plan", "jobs", "threads", "output_dir",
    "reps"}``, captured in ``_execute`` (before any job runs), from a scratch folder."""
    from textrl.bench import compare as bench

    seen: dict[str, Any] = {}

    def execute(jobs_plan, fresh, jobs, isolate, threads, log):
        seen.update(plan=jobs_plan, jobs=jobs, threads=threads)
        raise _Planned

    real = bench.compare_agents

    def compare(*args, **kwargs):
        seen.update(output_dir=args[2], reps=kwargs["reps"])
        return real(*args, **{**kwargs, "log": lambda *a: None})

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(bench, "_execute", execute)
    monkeypatch.setattr(bench, "compare_agents", compare)
    with pytest.raises(_Planned):
        bench.run(parser.parse_args([]))
    return seen


BENCH_OWN = ("agents", "envs", "seeds", "token_budget", "threads", "reps", "output_dir")
"""``textrl bench``'s own options whose default :func:`bench_value` reads from the plan."""


def bench_value(dest: str, seen: dict[str, Any]) -> Any:
    """The value ``textrl bench`` uses for option ``dest`` when it is not given."""
    from textrl import bench

    plan = seen["plan"]
    run, warm = plan["runs"][0]["config"], plan["warmups"][0]["config"]
    own = {"agents": list(dict.fromkeys(r["agent"] for r in plan["runs"])),
           "envs": list(dict.fromkeys(r["env"] for r in plan["runs"])),
           "seeds": list(dict.fromkeys(r["seed"] for r in plan["runs"])),
           "token_budget": plan["token_budget"], "threads": seen["threads"], "reps": seen["reps"],
           "output_dir": str(seen["output_dir"])}
    if dest in own:
        return own[dest]
    if dest == "progress":
        return run.progress
    return getattr(warm if dest in bench.WARMUP_FIELDS else run, dest)


IN_WORDS = {
    ("bench", "jobs"): "CPU cores // --threads",
    ("bench", "iterations"): "set per environment by --token-budget",
    ("tiny", "cache_dir"): "$TEXTRL_CACHE or ~/.cache/textrl",
    ("merge", "base_model"): "the one recorded in the adapter folder",
    ("generate", "tokenizer"): "the model's own",
}
"""Defaults shown in words, each checked by :func:`check_in_words`."""


def check_in_words(command: str, dest: str, claim: str, seen: dict[str, Any] | None) -> None:
    """The defaults in :data:`IN_WORDS` hold."""
    assert claim.startswith(IN_WORDS[(command, dest)]), (command, dest, claim)
    if (command, dest) == ("bench", "jobs"):
        from textrl import bench

        assert seen["jobs"] is None and bench.default_jobs(seen["threads"]) == max(1, (os.cpu_count() or 1) // seen["threads"])
    elif (command, dest) == ("bench", "iterations"):
        from textrl.bench import iterations_for

        env = seen["plan"]["runs"][0]
        assert env["config"].iterations == iterations_for(seen["plan"]["token_budget"], env["config"], 1)
    elif (command, dest) == ("tiny", "cache_dir"):
        from textrl.models.tiny import _cache_root

        assert _cache_root(None) == Path(os.environ["TEXTRL_CACHE"])
        os.environ.pop("TEXTRL_CACHE")
        assert _cache_root(None) == Path.home() / ".cache" / "textrl"
    elif (command, dest) == ("merge", "base_model"):
        from textrl.stages.merge import MergeConfig

        assert MergeConfig.base_model is None  # None: read from the adapter folder
    elif (command, dest) == ("generate", "tokenizer"):
        from textrl.cli import build_parser

        assert build_parser("generate").parse_args(["generate"]).tokenizer is None  # None: --model's own


def test_every_shown_default_is_the_value_used(tmp_path, monkeypatch):
    from textrl.config import build_config

    checked, mismatches = 0, []
    for command, parser in subcommands().items():
        cls = config_class(command)
        config = build_config(parser.parse_args([]), cls) if cls is not None and command != "bench" else None
        seen = bench_plan(parser, tmp_path, monkeypatch) if command == "bench" else None
        field_names = {f.name for f in dataclasses.fields(cls)} if cls is not None else set()
        for action in parser._actions:
            if action.help in (None, argparse.SUPPRESS):
                continue
            for claim in claims(shown_help(parser, action)):
                if claim.startswith(IN_WORDS.get((command, action.dest), "\0")):
                    check_in_words(command, action.dest, claim, seen)
                    checked += 1
                    continue
                value = claimed_value(claim)
                if command == "bench" and (action.dest in field_names or action.dest in BENCH_OWN):
                    actual = bench_value(action.dest, seen)
                elif action.dest in field_names:
                    actual = getattr(config, action.dest)
                else:
                    actual = parser.parse_args([]).__dict__.get(action.dest, action.default)
                checked += 1
                if not same(value, actual):
                    mismatches.append(f"textrl {command} {action.option_strings[0]}: help says {claim!r}, "
                                      f"uses {actual!r}")
    assert not mismatches, "\n".join(mismatches)
    assert checked > 200  # the options of train, the stages and bench, not a vacuous pass


def test_the_known_defaults_are_said():
    """The defaults users asked about, said as they are."""
    from textrl.config import TrainConfig

    parsers = subcommands()
    train = {a.dest: shown_help(parsers["train"], a) for a in parsers["train"]._actions if a.help}
    bench = {a.dest: shown_help(parsers["bench"], a) for a in parsers["bench"]._actions if a.help}
    assert f"(default: {TrainConfig.agent!r})" in train["agent"] and TrainConfig.agent == "rloo"
    assert "(default: 'runs/bench')" in bench["output_dir"]
    assert "(default: 0 in the comparison's runs)" in bench["eval_every"]
    import textrl.cli

    assert "GAEPPO" not in textrl.cli.__doc__ and "RLOO on the built-in digits task" in textrl.cli.__doc__


# -- per-agent defaults ---------------------------------------------------------------------------

WORDS = {"symmetric": None, "off": None, "lam": None, "none": None, "0": 0}
"""Words of "the agent's default: ..." and the class default they stand for."""
NOT_A_CLASS_DEFAULT = {"overlong_buffer": "a quarter of the episode's budget, computed per run"}


def agent_default_claims(text: str) -> tuple[str, dict[str, str]] | None:
    """``(base, {agent: value})`` of "the agent's default: BASE, a1/a2 V, a3 V" or of
    "the agent's default, N for AGENT"; None when ``text`` has neither."""
    m = re.search(r"the agent's default: ([^);]*)", text)
    if m:
        base, *rest = [p.strip() for p in m.group(1).split(",")]
        named = {}
        for part in rest:
            names, _, value = part.partition(" ")
            for name in names.split("/"):
                named[name] = value.split(":")[0].strip()
        if base.startswith("on for "):
            return "none", {name: "on" for name in base.removeprefix("on for ").split("/")}
        return base, named
    m = re.search(r"the agent's default, (\d+) for (\w+)", text)
    return ("none", {m.group(2): m.group(1)}) if m else None


def _as_value(word: str) -> Any:
    if word == "on":
        return True
    if word in WORDS:
        return WORDS[word]
    return ast.literal_eval(word)


def test_per_agent_defaults_in_help_are_the_agents_own():
    from textrl.agents import agent_names
    from textrl.core.agent_registry import agent_class

    parser = subcommands()["train"]
    seen_fields = []
    for action in parser._actions:
        if not action.help or action.help == argparse.SUPPRESS:
            continue
        parsed = agent_default_claims(shown_help(parser, action))
        if parsed is None:
            continue
        seen_fields.append(action.dest)
        if action.dest in NOT_A_CLASS_DEFAULT:
            continue
        base, named = parsed
        for name in agent_names():
            cls = agent_class(name)
            if not hasattr(cls, f"default_{action.dest}"):  # an option the agent does not have (no critic)
                assert name not in named, f"--{action.dest}: help names {name}, which has no such option"
                continue
            actual = getattr(cls, f"default_{action.dest}")
            claimed = _as_value(named.get(name, base))
            assert actual == claimed, f"--{action.dest}: help says {name} {claimed!r}, the agent has {actual!r}"
    assert {"clip_eps", "clip_eps_high", "lam_critic", "critic_warmup_iterations", "lora_r"} <= set(seen_fields)
