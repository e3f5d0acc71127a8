"""What a ``textrl train`` run records and tells: ``summary.json``'s record of what ran (the
lengths in use, the warm-up as the agent's construction kept it, the generation engine and the
device), the metrics row of an iteration, the peak memory, the message of an early stop, how
the run ended and the updates it skipped (:func:`run_end`, whatever the end: completed, stopped,
failed), and the before / after table of the held-out metrics with the share of the gap to the
maximum closed and a line for the skipped updates. :class:`textrl.training.ppo_run.PPORun` runs the iteration and calls these.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from textrl.config import TrainConfig
from textrl.keys import KEYS
from textrl.parallel.distributed import Distributed
from textrl.run import SETTINGS_FILE, latest_checkpoint, resume_command, signal_message
from textrl.run.rollout import episode_metrics


def run_records(run: Any) -> dict[str, Any]:
    """``summary.json``'s record of what ran in ``run`` (a :class:`textrl.training.ppo_run.PPORun`) where
    config.yaml keeps what was asked: ``lengths`` (the prompts' cap and the episode budget in use,
    each ``set`` or ``auto``) and ``warmup`` (:func:`warmup_record`)."""
    config = run.config
    lengths = {"max_prompt_length": run.sampler.max_prompt_length, "prompt_truncate": run.sampler.truncate,
               "max_episode_tokens": run.episodes.max_episode_tokens,
               "source": {name: "auto" if getattr(config, name) is None else "set"
                          for name in ("max_prompt_length", "max_episode_tokens")}}
    records = {"lengths": lengths, "warmup": warmup_record(config, run.agent, run.episodes.env)}
    return {**records, **engine_record(config, run.agent)}


def engine_record(config: TrainConfig, agent) -> dict[str, Any]:
    """What generated and where: ``generation_engine`` (``asked``: the option, ``ran``: the engine
    ``auto`` resolved to) and the ``device`` (``summary.json``; the start of the run says the same)."""
    actor = getattr(agent, "actor", None)
    ran = getattr(getattr(actor, "engine", None), "name", None)
    return {"generation_engine": {"asked": config.generation_engine, "ran": ran}, "device": str(agent.device)}


def describe_run_start(config: TrainConfig, agent) -> str:
    """The line a run starts with: the device, the precision and the generation engine that run."""
    record = engine_record(config, agent)
    engine = record["generation_engine"]
    asked = "" if engine["asked"] == engine["ran"] else f" (--generation-engine {engine['asked']})"
    precision = getattr(agent, "precision", None)
    return (f"running on {record['device']}: generation engine {engine['ran']}{asked}"
            + (f"; precision: {precision}" if precision is not None else ""))


def gap_closed(before: dict[str, float] | None, after: dict[str, float], max_reward: float | None,
               key: str = "eval/sampled/reward/mean") -> dict[str, float] | None:
    """The share of the gap between the held-out reward before training and the environment's
    maximum that the run closed, ``(after - before) / (max_reward - before)`` (1: reached the
    maximum, 0: no progress, negative: worse), with the three values; None when the maximum is
    unknown (a reward other than the environment's own) or the start is already at it."""
    if max_reward is None or not before or key not in before or key not in after:
        return None
    start, end = float(before[key]), float(after[key])
    if not math.isfinite(start) or not math.isfinite(end) or max_reward - start <= 0:
        return None
    return {"share": (end - start) / (max_reward - start), "before": start, "after": end, "max_reward": float(max_reward),
            "metric": key}


def warmup_record(config: TrainConfig, agent, env) -> dict[str, Any]:
    """What the supervised format warm-up did, for ``summary.json``, as the agent's construction
    kept it (``agent.warmup_record``, :func:`textrl.agents.build.load_policy`): ``asked_steps``
    (``warmup_sft_steps``, as config.yaml records it), ``ran_steps`` (the steps it ran) and, when
    none ran, the ``reason`` (no steps asked, an environment without warm-up examples, an agent
    that loads its policy without the warm-up, such as multi_adapter_ppo). An agent whose
    construction kept no record is taken to have loaded its policy without the warm-up."""
    from textrl.agents.build import warmup_none
    from textrl.envs.registry import env_facts

    record = getattr(agent, "warmup_record", None)
    if record is None:
        facts = env_facts(config, env) if config.warmup_sft_steps > 0 else None
        record = warmup_none(config, facts, agent_warms=False)
    return dict(record)


def iteration_metrics(
    iteration: int, td, update_metrics: dict[str, float], dist: Distributed | None = None
) -> dict[str, float]:
    """The flat metrics row of one iteration: rollout reward (total and per component: its mean and std
    over the rows it applies to, and the share of rows it applies to, ``reward_components/NAME/applies``), the
    episodes' turns and end reasons (``episode/*``), response length (the agent's tokens), rows
    (``samples``) and generated tokens over every process's share of the rollout,
    then the agent's update metrics (losses, KL monitors, ...) averaged over processes."""
    dist = dist or Distributed()
    lengths = dist.gather(td.get(KEYS.mask).sum(1))  # [B_global]
    score = dist.gather(td.get(KEYS.score).float())  # [B_global]
    row: dict[str, float] = {"iteration": iteration}
    row["reward/mean"] = score.mean().item()
    row["reward/std"] = score.std().item() if score.numel() > 1 else 0.0
    for name, value in td.get(KEYS.reward_components).items():
        value = dist.gather(value.float())
        # NaN where the function does not apply to a row (it returned None): over the rows it applies to
        applies = value[~value.isnan()]
        row[f"reward_components/{name}/mean"] = applies.mean().item() if applies.numel() else float("nan")
        row[f"reward_components/{name}/std"] = applies.std().item() if applies.numel() > 1 else 0.0
        row[f"reward_components/{name}/applies"] = applies.numel() / max(value.numel(), 1)  # None rows: unparsable verdicts, ...
    if KEYS.turns in td.keys(include_nested=True):  # turns and why the episodes ended (length, context, ...)
        row.update(episode_metrics(dist.gather(td.get(KEYS.turns)), dist.gather(td.get(KEYS.end_reason))))
    row["response_length/mean"] = lengths.float().mean().item()
    row["samples"] = float(lengths.numel())
    row["tokens"] = float(lengths.sum().item())
    row.update(sequence_tokens(td, dist))
    row.update(dist.mean(update_metrics))
    return row


TOTAL_TOKENS = "perf/total_tokens"
"""Metric: the prompt and response tokens of the iteration's rollout over every process (verl's
``perf/total_num_tokens``; environment observations count, padding does not). The run loop turns
it into ``perf/tokens_per_s`` per process (:data:`textrl.run.loop.PER_DEVICE_RATES`)."""
PADDING_FRACTION = "perf/padding_fraction"
"""Metric: the share of the rollout's padded ``[B, P + T]`` batch that is padding, over every
process: what the forwards spend on nothing unless ``padding_free`` packs the rows."""


def sequence_tokens(td, dist: Distributed) -> dict[str, float]:
    """:data:`TOTAL_TOKENS` and :data:`PADDING_FRACTION` of a rollout: its attended prompt and
    response tokens (``KEYS.response_mask``, else the agent mask) against its ``[B, P + T]`` positions."""
    response = td.get(KEYS.response_mask, None)
    response = td.get(KEYS.mask) if response is None else response
    prompt = td.get(KEYS.prompt_mask)
    real = float(prompt.sum() + response.sum())
    positions = float(prompt.numel() + response.numel())
    shared = dist.mean({"real": real, "positions": positions})
    total, padded = shared["real"] * dist.world_size, shared["positions"] * dist.world_size
    return {TOTAL_TOKENS: total, PADDING_FRACTION: 1.0 - total / padded if padded else 0.0}


def peak_memory_mib(device: torch.device) -> float:
    """This process's peak memory so far, in MiB: ``torch.cuda.max_memory_allocated`` on CUDA,
    else the resident-set high-water mark (``ru_maxrss``; everything the process touched)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def nonfinite_rows(td, n_rows: int) -> float:
    """Rows of a rollout of ``n_rows`` whose task reward was NaN/inf: dropped plus zeroed."""
    flagged = td.get(KEYS.reward_nonfinite).sum().item() if KEYS.reward_nonfinite in td.keys() else 0
    return float(n_rows - td.shape[0] + flagged)


NONFINITE_HINTS = (
    ("log-probs", "a token its model gives probability 0 (a -inf logit: a logits bias or processor in the model, "
                  "a reference with another vocabulary) or logits that overflow in the run's precision"),
    ("values", "a critic that diverges: lower --critic-lr, set --max-grad-norm or --value-clip-eps"),
    ("value targets", "a critic that diverges: lower --critic-lr, set --max-grad-norm or --value-clip-eps"),
    ("rewards", "a reward function or reward model that returns NaN/inf (--reward-nonfinite zero drops such rows)"),
    ("advantages", "rewards or values that overflow"),
    ("correction", "an engine log-prob of -inf (a token it could not have drawn)"),
)
"""What usually makes each quantity of the rollout NaN/inf (the first match in the skipped update's
cause); a loss, gradients or weights: a learning rate too high or no gradient clipping."""


def nonfinite_hint(cause: str | None) -> str:
    """The usual causes of what a skipped update saw (:data:`NONFINITE_HINTS`)."""
    for word, hint in NONFINITE_HINTS:
        if cause and word in cause.split(":")[0]:
            return hint
    return "a learning rate too high, max_grad_norm=0, a reward model that overflows"


def stop_message(config: TrainConfig, iteration: int, signum: int | None, streak: int,
                 saved: Path | None, weights_poisoned: bool = False, cause: str | None = None) -> str:
    """What the user reads when the run stops early: why, where the checkpoint is, how to resume."""
    config_path = Path(config.output_dir) / SETTINGS_FILE
    if weights_poisoned:
        rollback = ("With nonfinite_weights='rollback' (the default) the update is undone and the run "
                    "goes on. " if config.nonfinite_weights == "stop" else "")
        return (f"textrl train: stopped after iteration {iteration}: its update left NaN/inf weights, so "
                f"no checkpoint was written; {_newest_good(config.output_dir)}. "
                f"{rollback}Usual causes: a learning rate too high, max_grad_norm=0, a reward model that "
                f"overflows. Lower them, then resume with: {resume_command('train', config_path)}")
    if streak >= config.max_nonfinite_updates:
        kept = (f"the weights of the last good update are saved in {saved}" if saved else
                "the weights themselves are NaN/inf, so no checkpoint was written; "
                f"{_newest_good(config.output_dir)}")
        saw = f"; the last one saw {cause}" if cause else ""
        return (f"textrl train: stopped after iteration {iteration}: {streak} consecutive updates "
                f"were skipped for NaN/inf{saw} (see nonfinite/skipped_updates and nonfinite/rolled_back in "
                f"metrics.jsonl); {kept}. Usual causes: {nonfinite_hint(cause)}. Resume with: "
                f"{resume_command('train', config_path)}")
    return signal_message("train", "iteration", iteration, config.iterations, signum, saved, config_path)


def engine_stop_message(config: TrainConfig, err: BaseException, done: int, saved: Path | None) -> str:
    """What the user reads when an engine could not go on after iteration ``done`` was finished:
    the engine's own line (which names it), the checkpoint that holds iteration ``done`` (saved
    now, or earlier), or the newest there is when none could be saved, and how to resume."""
    config_path = Path(config.output_dir) / SETTINGS_FILE
    if saved is not None:
        kept = f"iteration {done} is saved in {saved}"
    elif done == 0:
        kept = "no iteration had finished, so nothing was saved"
    else:
        kept = f"iteration {done} was not saved now; {_newest_good(config.output_dir)}"
    return (f"textrl train: stopped after iteration {done}: {str(err).rstrip('.')}; {kept}. Fix the cause, "
            f"then resume with: {resume_command('train', config_path)}")


def skipped_updates(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The updates a run skipped for NaN/inf, from its metrics rows (``summary.json``'s
    ``skipped_updates``): ``count``, the sum of ``nonfinite/skipped_updates`` (one per minibatch
    step skipped, per rollout skipped whole, per update rolled back); ``iterations``, those whose
    update skipped anything; ``rolled_back``, those whose update was undone
    (``nonfinite/rolled_back``); ``of_iterations``, the rows (a resumed run's earlier ones too)."""

    def value(row: dict[str, Any], key: str) -> float:
        found = row.get(key, 0.0)
        return float(found) if isinstance(found, (int, float)) and math.isfinite(found) else 0.0

    return {"count": sum(value(row, "nonfinite/skipped_updates") for row in rows),
            "iterations": [int(row["iteration"]) for row in rows if value(row, "nonfinite/skipped_updates") > 0],
            "rolled_back": [int(row["iteration"]) for row in rows if value(row, "nonfinite/rolled_back") > 0],
            "of_iterations": len(rows)}


def run_end(rows: list[dict[str, Any]], end: dict[str, Any] | None) -> dict[str, Any]:
    """``summary.json``'s record of how the run ended: ``ended`` (``completed``, ``stopped`` or
    ``failed``), ``iteration`` (the last whose row metrics.jsonl holds) and, for a stop or a
    failure, ``reason`` and the rest of ``end`` (:attr:`textrl.run.RunLoop.end`: ``stopped_by``,
    ``checkpoint``; ``failed_in``, ``where``); then ``skipped_updates`` (:func:`skipped_updates`).
    ``end`` None: a run that completed (``iteration``: its last row)."""
    record = dict(end) if end is not None else {"ended": "completed",
                                                "iteration": int(rows[-1]["iteration"]) if rows else 0}
    return {**record, "skipped_updates": skipped_updates(rows)}


def skipped_line(skipped: dict[str, Any], most: int = 12) -> str | None:
    """The closing line that says which iterations skipped updates (:func:`skipped_updates`);
    None when none did. At most ``most`` iterations are listed."""
    its = skipped["iterations"]
    if not its:
        return None
    listed = ", ".join(map(str, its[:most])) + (f", ... ({len(its) - most} more)" if len(its) > most else "")
    rolled = f"; {len(skipped['rolled_back'])} updates rolled back" if skipped["rolled_back"] else ""
    return (f"skipped updates: {len(its)} of the {skipped['of_iterations']} iterations skipped NaN/inf updates "
            f"(iterations {listed}: {skipped['count']:g} minibatch steps or whole updates skipped{rolled}), so "
            "their rollouts trained the policy in part or not at all; see nonfinite/* in metrics.jsonl")


def _newest_good(output_dir: str) -> str:
    """For a stop that wrote no checkpoint: the newest good one (not "None" when there is none)."""
    newest = latest_checkpoint(output_dir)
    return f"the newest good one is {newest}" if newest else "none was written before either"


def format_summary(before: dict[str, float] | None, after: dict[str, float], gap: dict[str, float] | None = None,
                   skipped: dict[str, Any] | None = None) -> str:
    """A small before/after table of the held-out metrics, the share of the gap to the
    environment's maximum the run closed (``gap``: :func:`gap_closed`) when known, and the
    iterations that skipped updates for NaN/inf (``skipped``: :func:`skipped_updates`) when any did."""
    keys = [k for k in ("reward/mean", "format_rate", "accuracy", "response_length/mean")]
    lines = [f"{'held-out metric':<34}{'before':>10}{'after':>10}"]
    for mode in ("sampled", "greedy"):
        for key in keys:
            full = f"eval/{mode}/{key}"
            if full not in after:
                continue
            b = f"{before[full]:.3f}" if before and full in before else "-"
            lines.append(f"{mode + ' ' + key:<34}{b:>10}{after[full]:>10.3f}")
    if gap is not None:
        lines.append(f"closed {round(gap['share'] * 100)}% of the gap between the held-out sampled reward before training "
                     f"({gap['before']:.3f}) and the environment's maximum ({gap['max_reward']:g})")
    line = skipped_line(skipped) if skipped is not None else None
    if line is not None:
        lines.append(line)
    return "\n".join(lines)


__all__ = [
    "PADDING_FRACTION", "TOTAL_TOKENS", "engine_stop_message", "sequence_tokens",
    "describe_run_start", "engine_record", "format_summary", "gap_closed", "iteration_metrics", "nonfinite_rows", "peak_memory_mib", "run_end",
    "run_records", "skipped_line", "skipped_updates", "stop_message", "warmup_record",
]
