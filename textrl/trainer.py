"""The training loop: rollout -> rewards -> advantages -> updates -> log / evaluate / checkpoint.

:func:`train` reads like the algorithm (numbered phases below); everything it writes goes under
``config.output_dir``: ``config.yaml`` (the resolved config), ``metrics.jsonl`` (one flat JSON
object per iteration), TensorBoard events in ``tb/``, ``curves.png`` (reward and KL),
``samples.jsonl`` (held-out completions at each evaluation) and ``checkpoints/iter_NNNNNN/``
(the policy in Hugging Face format, plus the agent's optimisers, schedulers, KL controller,
the prompt sampler's position and every RNG), written to a temporary folder and renamed into
place only when complete. ``--resume`` continues from the newest complete checkpoint.

The same loop runs under ``accelerate`` (its device and main-process logic); only the main
process writes files.
"""

from __future__ import annotations

import copy
import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from textrl.config import TrainConfig, save_config
from textrl.keys import KEYS
from textrl.timing import timed

CHECKPOINT_MARKER = "COMPLETE"


# -- set-up --------------------------------------------------------------------------------------


def seed_everything(seed: int) -> None:
    """Python, NumPy and torch (CPU and CUDA) RNGs."""
    random.seed(seed)
    np.random.seed(seed)  # noqa: NPY002 - the global NumPy RNG that user reward code may use
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),  # noqa: NPY002 - saved for exact resume
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])  # noqa: NPY002 - restored for exact resume
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r}: CUDA is not available on this machine; use --device cpu")
    return device


def build_reward(config: TrainConfig):
    """The composite task reward of ``--reward`` (and ``--reward-model`` as 'reward_model')."""
    from rewards import parse_reward_spec

    spec = config.reward
    if config.reward_model:
        spec = f"{spec},reward_model:{config.reward_model}" if spec else f"reward_model:{config.reward_model}"
    return parse_reward_spec(spec)


def build_models(config: TrainConfig, device: torch.device, log) -> tuple[Any, Any]:
    """Tokenizer and policy; the tiny default gets a short supervised format warm-up."""
    from envs.tasks import warmup_examples
    from textrl.models import load_causal_lm, load_tokenizer
    from textrl.warmup import sft_warmup

    tokenizer = load_tokenizer(config.model)
    policy = load_causal_lm(config.model, device=device)
    policy.float()
    if config.warmup_sft_steps > 0 and config.dataset == "builtin:digits":
        from envs import load_prompts

        train_rows, _ = load_prompts(config.dataset).split(config.eval_size, seed=config.seed)
        pairs = warmup_examples(
            list(train_rows), seed=config.seed, answer_accuracy=config.warmup_answer_accuracy
        )
        stats = sft_warmup(
            policy, tokenizer, pairs, steps=config.warmup_sft_steps, lr=config.warmup_sft_lr,
            batch_size=config.warmup_sft_batch_size, seed=config.seed,
        )
        log(f"warm-up: {stats['steps']} SFT steps on the format, loss {stats['loss_first']:.2f} -> "
            f"{stats['loss_last']:.2f} in {stats['seconds']:.1f}s")
    return tokenizer, policy.eval()


def build_agent(config: TrainConfig, policy, tokenizer):
    from agents import make_agent
    from textrl.models.value import ValueModel

    if config.critic_init == "reward_model":
        from textrl.models import load_reward_model

        critic = ValueModel.from_reward_model(load_reward_model(config.reward_model)).to(policy.device)
    else:
        critic = ValueModel.from_causal_lm(policy)
    return make_agent(config.agent, policy, tokenizer, config, ref_policy=copy.deepcopy(policy), critic=critic)


# -- checkpoints ---------------------------------------------------------------------------------


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """Newest checkpoint folder holding the completion marker; partial ones are ignored."""
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return None
    complete = sorted(p for p in root.glob("iter_*") if (p / CHECKPOINT_MARKER).is_file())
    return complete[-1] if complete else None


def save_checkpoint(output_dir: str | Path, iteration: int, agent, sampler, keep: int) -> Path:
    """Write to a temporary folder, mark it complete, rename; then rotate old ones away."""
    root = Path(output_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"iter_{iteration:06d}"
    tmp = root / f".tmp_iter_{iteration:06d}_{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        agent.policy.save_pretrained(tmp / "policy")
        agent.tokenizer.save_pretrained(tmp / "policy")
        torch.save(
            {"agent": agent.state_dict(), "sampler": sampler.state_dict(), "rng": rng_state(),
             "iteration": iteration},
            tmp / "trainer_state.pt",
        )
        (tmp / CHECKPOINT_MARKER).write_text(json.dumps({"iteration": iteration}))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    complete = sorted(p for p in root.glob("iter_*") if (p / CHECKPOINT_MARKER).is_file())
    for old in complete[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(path: Path, agent, sampler) -> int:
    """Restore agent, sampler and RNGs; return the iteration the checkpoint was taken after."""
    state = torch.load(path / "trainer_state.pt", map_location=agent.device, weights_only=False)
    agent.load_state_dict(state["agent"])
    sampler.load_state_dict(state["sampler"])
    set_rng_state(state["rng"])
    return int(state["iteration"])


# -- logging -------------------------------------------------------------------------------------


class MetricsLog:
    """``metrics.jsonl`` (one flushed line per iteration), TensorBoard, and the curve plot."""

    def __init__(self, output_dir: Path, enabled: bool, resume_after: int | None) -> None:
        self.path = output_dir / "metrics.jsonl"
        self.enabled = enabled
        self.rows: list[dict[str, float]] = []
        self.writer = None
        if not enabled:
            return
        if resume_after is not None and self.path.exists():
            kept = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
            self.rows = [r for r in kept if r["iteration"] <= resume_after]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in self.rows))
        elif self.path.exists():
            self.path.unlink()
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(output_dir / "tb"))

    def write(self, row: dict[str, float]) -> None:
        self.rows.append(row)
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
        for key, value in row.items():
            if key != "iteration" and isinstance(value, (int, float)):
                self.writer.add_scalar(key, value, row["iteration"])

    def plot(self, path: Path) -> None:
        if not self.enabled or not self.rows:
            return
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        its = [r["iteration"] for r in self.rows]
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
        ax1.plot(its, [r.get("reward/mean", float("nan")) for r in self.rows], label="rollout reward")
        evals = [r for r in self.rows if "eval/sampled/reward/mean" in r]
        if evals:
            ax1.plot([r["iteration"] for r in evals], [r["eval/sampled/reward/mean"] for r in evals],
                     "o-", label="held-out (sampled)")
        ax1.set_xlabel("iteration")
        ax1.set_ylabel("reward")
        ax1.legend()
        ax2.plot(its, [r.get("kl/collection", float("nan")) for r in self.rows])
        ax2.set_xlabel("iteration")
        ax2.set_ylabel("KL(policy || ref) at collection")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


# -- the loop ------------------------------------------------------------------------------------


def evaluate(agent, eval_batches, reward_fn, seed: int) -> dict[str, float]:
    """Held-out reward, greedy and sampled, under ``eval/greedy/`` and ``eval/sampled/``.

    Sampling runs under a forked RNG seeded with ``seed``: evaluating (or not) never changes the
    training run's random stream, so a resumed run matches an uninterrupted one.
    """
    from textrl.rollout import evaluate_prompts

    out: dict[str, float] = {}
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        for mode, greedy in (("greedy", True), ("sampled", False)):
            for key, value in evaluate_prompts(agent, eval_batches, reward_fn, greedy=greedy).items():
                out[f"eval/{mode}/{key}"] = value
    return out


def sample_completions(agent, batch, n: int = 4) -> list[dict[str, str]]:
    """Greedy completions of the first ``n`` prompts of an eval batch, for ``samples.jsonl``."""
    ids, mask = batch.input_ids[:n].to(agent.device), batch.attention_mask[:n].to(agent.device)
    responses = agent.act(ids, mask, greedy=True)
    texts = agent.tokenizer.batch_decode(responses, skip_special_tokens=True)
    return [{"prompt": p, "completion": c} for p, c in zip(batch.prompt_texts[:n], texts)]


def write_samples(path: Path, iteration: int, samples: list[dict[str, str]]) -> None:
    with path.open("a") as f:
        for sample in samples:
            f.write(json.dumps({"iteration": iteration, **sample}) + "\n")


def iteration_metrics(iteration: int, td, update_metrics: dict[str, float]) -> dict[str, float]:
    """The flat metrics row of one iteration: rollout reward (total and per component), response
    length, generated tokens, then the agent's update metrics (losses, KL monitors, ...)."""
    mask = td.get(KEYS.mask)
    score = td.get(KEYS.score).float()
    row: dict[str, float] = {"iteration": iteration}
    row["reward/mean"] = score.mean().item()
    row["reward/std"] = score.std().item() if score.numel() > 1 else 0.0
    for name, value in td.get(KEYS.reward_components).items():
        row[f"reward_components/{name}/mean"] = value.float().mean().item()
        row[f"reward_components/{name}/std"] = value.float().std().item() if value.numel() > 1 else 0.0
    row["response_length/mean"] = mask.sum(1).float().mean().item()
    row["tokens"] = float(mask.sum().item())
    row.update(update_metrics)
    return row


def train(config: TrainConfig) -> dict[str, Any]:
    """Run ``config.iterations`` PPO iterations; return the before/after held-out summary."""
    from accelerate import Accelerator

    from envs import PromptSampler, load_prompts
    from textrl.rollout import collect

    config.validate()
    device = resolve_device(config.device)
    accelerator = Accelerator(cpu=device.type == "cpu")
    main = accelerator.is_main_process
    output_dir = Path(config.output_dir)
    log = print if main else (lambda *a, **k: None)
    if main:
        output_dir.mkdir(parents=True, exist_ok=True)
        save_config(config, output_dir / "config.yaml")
    seed_everything(config.seed)

    reward_fn = build_reward(config)
    tokenizer, policy = build_models(config, device, log)
    train_rows, eval_rows = load_prompts(config.dataset).split(config.eval_size, seed=config.seed)
    sampler = PromptSampler(
        train_rows, tokenizer, prompts_per_batch=config.prompts_per_iteration,
        n_samples_per_prompt=config.n_samples_per_prompt, seed=config.seed,
        max_prompt_length=config.max_prompt_length,
    )
    eval_batches = sampler.encode_eval(eval_rows, batch_size=config.generation_batch_size)
    agent = build_agent(config, policy, tokenizer)

    start = 0
    checkpoint = latest_checkpoint(output_dir) if config.resume else None
    if config.resume and checkpoint is None:
        log(f"--resume: no complete checkpoint in {output_dir / 'checkpoints'}; starting from scratch")
    if checkpoint is not None:
        start = load_checkpoint(checkpoint, agent, sampler)
        log(f"resumed from {checkpoint} (iteration {start})")
    metrics_log = MetricsLog(output_dir, main, resume_after=start if checkpoint is not None else None)
    before = evaluate(agent, eval_batches, reward_fn, config.seed) if start == 0 else None
    samples_path = output_dir / "samples.jsonl"
    if main and start == 0:
        samples_path.unlink(missing_ok=True)
        write_samples(samples_path, 0, sample_completions(agent, eval_batches[0]))
    elif main and samples_path.exists():  # resumed: drop samples written after the checkpoint
        kept = [s for s in samples_path.read_text().splitlines() if json.loads(s)["iteration"] <= start]
        samples_path.write_text("".join(s + "\n" for s in kept))

    progress = None
    if config.progress and main:
        from tqdm.auto import tqdm

        progress = tqdm(total=config.iterations, initial=start, desc="PPO", dynamic_ncols=True)
    for iteration in range(start + 1, config.iterations + 1):
        t0 = time.perf_counter()
        timings: dict[str, float] = {}
        # 1. rollout, 2. rewards, 3. log-probs / values / advantages (timed inside collect)
        td = collect(agent, sampler.next_batch(), reward_fn, reward_placement=config.reward_placement,
                     timings=timings)
        # 4. K epochs of minibatch updates
        with timed(timings, "update", agent.device):
            update_metrics = agent.update(td)
        # 5. log / evaluate / checkpoint
        with timed(timings, "bookkeeping", agent.device):
            row = iteration_metrics(iteration, td, update_metrics)
        if iteration == config.iterations or (config.eval_every and iteration % config.eval_every == 0):
            with timed(timings, "eval", agent.device):
                row.update(evaluate(agent, eval_batches, reward_fn, config.seed + iteration))
                if main:
                    write_samples(samples_path, iteration, sample_completions(agent, eval_batches[0]))
        row.update({f"time/{phase}_s": seconds for phase, seconds in timings.items()})
        row["time/iteration_s"] = time.perf_counter() - t0
        row["tokens_per_second"] = row["tokens"] / row["time/iteration_s"]
        metrics_log.write(row)
        if progress is not None:
            progress.set_postfix(reward=f"{row['reward/mean']:.3f}", kl=f"{row.get('kl/collection', 0.0):.3f}")
            progress.update(1)
        if main and (iteration == config.iterations
                     or (config.checkpoint_every and iteration % config.checkpoint_every == 0)):
            save_checkpoint(output_dir, iteration, agent, sampler, config.keep_checkpoints)
    if progress is not None:
        progress.close()
    metrics_log.plot(output_dir / "curves.png")
    metrics_log.close()
    after = {k: v for k, v in (metrics_log.rows[-1] if metrics_log.rows else {}).items() if k.startswith("eval/")}
    summary = {"before": before, "after": after}
    if main:
        log(format_summary(before, after))
        (output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def format_summary(before: dict[str, float] | None, after: dict[str, float]) -> str:
    """A small before/after table of the held-out metrics."""
    keys = [k for k in ("reward/mean", "format_rate", "accuracy", "response_length/mean")]
    lines = [f"{'held-out metric':<34}{'before':>10}{'after':>10}"]
    for mode in ("sampled", "greedy"):
        for key in keys:
            full = f"eval/{mode}/{key}"
            if full not in after:
                continue
            b = f"{before[full]:.3f}" if before and full in before else "-"
            lines.append(f"{mode + ' ' + key:<34}{b:>10}{after[full]:>10.3f}")
    return "\n".join(lines)


__all__ = ["format_summary", "latest_checkpoint", "load_checkpoint", "save_checkpoint", "train"]
