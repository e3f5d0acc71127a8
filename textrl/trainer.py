"""The training loop: rollout -> rewards -> advantages -> updates -> log / evaluate / checkpoint.

:func:`train` reads like the algorithm (numbered phases below); everything it writes goes under
``config.output_dir``: ``config.yaml`` (the resolved config), ``metrics.jsonl`` (one flat JSON
object per iteration), TensorBoard events in ``tb/``, ``curves.png`` (reward and KL),
``samples.jsonl`` (held-out completions at each evaluation) and ``checkpoints/iter_NNNNNN/``
(the policy in Hugging Face format, plus the agent's optimisers, schedulers, KL controller,
the prompt sampler's position and every RNG), written to a temporary folder, fsync'ed, marked
complete by a manifest of sizes and sha256 sums and renamed into place. ``--resume`` continues
from the newest checkpoint whose manifest verifies. SIGINT / SIGTERM stop after the current
iteration with a checkpoint; NaN/inf updates are skipped (docs/reliability.md).

The same loop runs under ``accelerate`` (its device and main-process logic); only the main
process writes files.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from textrl.config import TrainConfig, save_config
from textrl.distributed import Distributed
from textrl.keys import KEYS
from textrl.timing import timed

BEFORE_FILE = "eval_before.json"
"""The held-out evaluation before the first iteration (kept so a resumed run's summary has it)."""
CHECKPOINT_MARKER = "manifest.json"
"""A checkpoint's completion marker, written last: every file with its size and sha256."""


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


def reward_spec(config: TrainConfig) -> str:
    """The reward spec of ``--reward`` plus ``--reward-model`` (as 'reward_model:PATH')."""
    spec = config.reward
    if config.reward_model:
        spec = f"{spec},reward_model:{config.reward_model}" if spec else f"reward_model:{config.reward_model}"
    return spec


def _agent_scores_alone(config: TrainConfig) -> bool:
    """An empty reward spec with an agent that brings its own reward model (``brings_reward``)."""
    from textrl.agents import agent_class

    return not reward_spec(config).strip() and agent_class(config.agent).brings_reward(config)


def build_agent(config: TrainConfig, device: torch.device, log):
    """The agent of ``config.agent``, built by its class: models, critic (if any), optimisers."""
    from textrl.agents import agent_class

    return agent_class(config.agent).from_config(config, device, log)


# -- checkpoints ---------------------------------------------------------------------------------


class CheckpointError(RuntimeError):
    """A checkpoint that is incomplete, truncated or corrupt; the message names the file."""


class TrainingStopped(SystemExit):
    """The run stopped early (a signal, repeated NaN/inf updates) after saving what it could.

    ``str(err)`` says why and how to resume. A ``SystemExit``: the ``textrl`` command exits with
    status ``err.code`` (128 + the signal number after a signal, 1 otherwise), no traceback.
    """

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(exit_code)
        self.message = message

    def __str__(self) -> str:
        return self.message


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    """Flush a file's (or a directory's entries') data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_manifest(folder: Path, iteration: int) -> None:
    """fsync every file of ``folder``, then write the manifest (the completion marker) last."""
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        _fsync(path)
        files[path.relative_to(folder).as_posix()] = {"size": path.stat().st_size, "sha256": _sha256(path)}
    for sub in sorted(p for p in folder.rglob("*") if p.is_dir()):
        _fsync(sub)
    with (folder / CHECKPOINT_MARKER).open("w") as f:
        json.dump({"iteration": iteration, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync(folder)


def _complete_checkpoints(root: Path) -> list[Path]:
    """``iter_*`` folders holding a manifest, oldest first (unverified)."""
    return sorted(p for p in root.glob("iter_*") if (p / CHECKPOINT_MARKER).is_file())


def verify_checkpoint(path: str | Path) -> dict[str, Any]:
    """The manifest of ``path`` after checking every file it lists (size, then sha256).

    Raises :class:`CheckpointError` naming the first missing, truncated or corrupt file.
    """
    path = Path(path)
    marker = path / CHECKPOINT_MARKER
    hint = f"delete {path} to resume from an earlier checkpoint"
    if not marker.is_file():
        raise CheckpointError(f"{path} is incomplete (no {CHECKPOINT_MARKER}: its save was interrupted); {hint}")
    try:
        manifest = json.loads(marker.read_text())
        files = manifest["files"]
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{marker} is corrupt ({err}); {hint}") from err
    for name, meta in files.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file} is missing from the checkpoint; {hint}")
        size = file.stat().st_size
        if size != meta["size"]:
            raise CheckpointError(f"{file} is truncated or corrupt: {size} bytes, the manifest says "
                                  f"{meta['size']}; {hint}")
        if _sha256(file) != meta["sha256"]:
            raise CheckpointError(f"{file} is corrupt: its sha256 differs from the manifest's; {hint}")
    return manifest


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """Newest checkpoint whose manifest verifies; partial ones (no manifest) are ignored and
    corrupt ones skipped with a warning naming the bad file."""
    for path in reversed(_complete_checkpoints(Path(output_dir) / "checkpoints")):
        try:
            verify_checkpoint(path)
            return path
        except CheckpointError as err:
            warnings.warn(f"skipping a checkpoint: {err}", stacklevel=2)
    return None


def save_checkpoint(
    output_dir: str | Path, iteration: int, agent, sampler, keep: int,
    rng_per_process: list[dict[str, Any]] | None = None, agent_state: dict[str, Any] | None = None,
) -> Path:
    """Write ``checkpoints/iter_NNNNNN`` atomically; return its path.

    Everything goes to a temporary folder; every file is fsync'ed, the manifest (files, sizes,
    sha256: the completion marker) is written last, then one rename puts the folder in place.
    Only then are older checkpoints rotated away (``keep`` newest stay). On a failure (a full
    disk, a second Ctrl-C) the temporary folder is removed and earlier checkpoints are
    untouched; an ``OSError`` names the checkpoint and the one that is still intact.
    ``agent_state`` is ``agent.state_dict()`` when the caller gathered it already (FSDP: every
    process takes part in gathering, only the main process writes).
    """
    root = Path(output_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp_iter_*"):  # left by a killed run; only the main process saves
        shutil.rmtree(stale, ignore_errors=True)
    final = root / f"iter_{iteration:06d}"
    tmp = root / f".tmp_iter_{iteration:06d}_{os.getpid()}"
    try:
        tmp.mkdir()
        if agent_state is None:
            agent_state = agent.state_dict()
        if getattr(agent, "gathers_state", False):  # full weights, gathered into agent_state
            policy_state = {k.removeprefix("policy."): v for k, v in agent_state.items() if k.startswith("policy.")}
            agent.policy.save_pretrained(tmp / "policy", state_dict=policy_state)
        else:
            agent.policy.save_pretrained(tmp / "policy")
        agent.tokenizer.save_pretrained(tmp / "policy")
        torch.save(
            {"agent": agent_state, "sampler": sampler.state_dict(), "rng": rng_state(),
             "rng_per_process": rng_per_process, "iteration": iteration},
            tmp / "trainer_state.pt",
        )
        _write_manifest(tmp, iteration)
        if final.exists():  # this iteration saved before (e.g. by an earlier run into this folder)
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync(root)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        previous = _complete_checkpoints(root)
        intact = f"{previous[-1]} is intact" if previous else "there is no earlier checkpoint"
        raise OSError(err.errno, f"could not write checkpoint {final} ({err.strerror or err}); the "
                      f"partial copy was removed and {intact}. Free disk space (or lower "
                      "keep_checkpoints), then resume with --resume") from err
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in _complete_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(path: str | Path, agent, sampler, verify: bool = True, dist: Distributed | None = None) -> int:
    """Restore agent, sampler and RNGs; return the iteration the checkpoint was taken after.

    ``verify`` checks the manifest first (:func:`verify_checkpoint`); any unreadable file raises
    :class:`CheckpointError` naming it.
    """
    path = Path(path)
    if verify:
        verify_checkpoint(path)
    file = path / "trainer_state.pt"
    try:
        state = torch.load(file, map_location=agent.device, weights_only=False)
    except Exception as err:
        raise CheckpointError(f"{file} cannot be read ({type(err).__name__}: {err}); it is truncated "
                              f"or corrupt: delete {path} to resume from an earlier checkpoint") from err
    agent.load_state_dict(state["agent"])
    sampler.load_state_dict(state["sampler"])
    dist = dist or Distributed()
    per_process = state.get("rng_per_process")
    if dist.enabled and per_process is not None and len(per_process) == dist.world_size:
        set_rng_state(per_process[dist.rank])
    elif dist.rank == 0:
        set_rng_state(state["rng"])
    if (len(per_process) if per_process else 1) != dist.world_size:
        warnings.warn(f"{path} was saved by {len(per_process) if per_process else 1} process(es) and is "
                      f"resumed by {dist.world_size}: the run continues, but the sampling stream is not "
                      "the one an uninterrupted run would have drawn", stacklevel=2)
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


def evaluate(agent, eval_batches, reward_fn, seed: int, reward_nonfinite: str = "raise") -> dict[str, float]:
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
            metrics = evaluate_prompts(agent, eval_batches, reward_fn, greedy=greedy,
                                       reward_nonfinite=reward_nonfinite)
            for key, value in metrics.items():
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


def iteration_metrics(
    iteration: int, td, update_metrics: dict[str, float], dist: Distributed | None = None
) -> dict[str, float]:
    """The flat metrics row of one iteration: rollout reward (total and per component), response
    length, rows (``samples``) and generated tokens over every process's share of the rollout,
    then the agent's update metrics (losses, KL monitors, ...) averaged over processes."""
    dist = dist or Distributed()
    lengths = dist.gather(td.get(KEYS.mask).sum(1))  # [B_global]
    score = dist.gather(td.get(KEYS.score).float())  # [B_global]
    row: dict[str, float] = {"iteration": iteration}
    row["reward/mean"] = score.mean().item()
    row["reward/std"] = score.std().item() if score.numel() > 1 else 0.0
    for name, value in td.get(KEYS.reward_components).items():
        value = dist.gather(value.float())
        row[f"reward_components/{name}/mean"] = value.mean().item()
        row[f"reward_components/{name}/std"] = value.std().item() if value.numel() > 1 else 0.0
    row["response_length/mean"] = lengths.float().mean().item()
    row["samples"] = float(lengths.numel())
    row["tokens"] = float(lengths.sum().item())
    row.update(dist.mean(update_metrics))
    return row


def peak_memory_mib(device: torch.device) -> float:
    """This process's peak memory so far, in MiB: ``torch.cuda.max_memory_allocated`` on CUDA,
    else the resident-set high-water mark (``ru_maxrss``; everything the process touched)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def parameter_checksum(module: torch.nn.Module) -> str:
    """sha256 of every parameter's bytes, in order: equal across processes iff the weights are."""
    digest = hashlib.sha256()
    for name, param in module.named_parameters():
        digest.update(name.encode())
        digest.update(param.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


# -- interruption and faults ---------------------------------------------------------------------


class StopSignals:
    """SIGINT / SIGTERM during :func:`train`: the first asks the loop to stop after the current
    iteration (with a checkpoint); a second one aborts at once (``KeyboardInterrupt``).

    Installed only in the main thread; the previous handlers come back on exit.
    """

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:
            print(f"\n{name} again: aborting now, without a checkpoint", file=sys.stderr, flush=True)
            raise KeyboardInterrupt(name)
        self.received = signum
        print(f"\n{name}: finishing the current iteration, then saving a checkpoint "
              "(Ctrl-C again aborts at once)", file=sys.stderr, flush=True)


def nonfinite_rows(td, n_rows: int) -> float:
    """Rows of a rollout of ``n_rows`` whose task reward was NaN/inf: dropped plus zeroed."""
    flagged = td.get(KEYS.reward_nonfinite).sum().item() if KEYS.reward_nonfinite in td.keys() else 0
    return float(n_rows - td.shape[0] + flagged)


def _weights_finite(agent, dist: Distributed) -> bool:
    """Every weight is finite (this process's shards under FSDP; the answer is shared)."""
    from textrl.sharding import local

    return not dist.any(not all(bool(torch.isfinite(local(p)).all()) for p in agent.parameters()))


def stop_message(config: TrainConfig, iteration: int, signum: int | None, streak: int,
                 saved: Path | None) -> str:
    """What the user reads when the run stops early: why, where the checkpoint is, how to resume."""
    resume = f"textrl train --config {Path(config.output_dir) / 'config.yaml'} --resume"
    if streak >= config.max_nonfinite_updates:
        kept = (f"the weights of the last good update are saved in {saved}" if saved else
                "the weights themselves are NaN/inf, so no checkpoint was written; the newest "
                f"good one is {latest_checkpoint(config.output_dir)}")
        return (f"textrl train: stopped after iteration {iteration}: {streak} consecutive updates "
                "were skipped for NaN/inf (loss, gradients, log-probs, values or advantages; see "
                f"nonfinite/skipped_updates in metrics.jsonl); {kept}. Usual causes: a learning rate "
                f"too high, max_grad_norm=0, a reward model that overflows. Resume with: {resume}")
    name = signal.Signals(signum).name if signum is not None else "a signal"
    return (f"textrl train: stopped by {name} after iteration {iteration} of {config.iterations}; "
            f"checkpoint saved in {saved}. Resume with: {resume}")


def check_run(config: TrainConfig) -> None:
    """Everything checkable before a model loads: every config field, the reward names, and that a
    fresh run would not overwrite an earlier run's checkpoints. ``ValueError`` says what to fix."""
    from textrl.rewards import check_reward_spec

    config.validate()
    if not _agent_scores_alone(config):
        check_reward_spec(reward_spec(config))
    existing = _complete_checkpoints(Path(config.output_dir) / "checkpoints")
    if existing and not config.resume:
        raise ValueError(
            f"output_dir={config.output_dir!r} holds checkpoints of an earlier run (newest: "
            f"{existing[-1].name}); pass --resume to continue it, or choose another --output-dir "
            f"(or delete {existing[-1].parent}) to start over"
        )


def resume_checkpoint(config: TrainConfig, log=print) -> Path | None:
    """The verified checkpoint ``--resume`` continues from (None: no resume, or a fresh folder).

    Raises :class:`CheckpointError` when checkpoints exist but none verifies, rather than
    silently starting over on top of them.
    """
    if not config.resume:
        return None
    root = Path(config.output_dir) / "checkpoints"
    checkpoint = latest_checkpoint(config.output_dir)
    if checkpoint is None and _complete_checkpoints(root):
        raise CheckpointError(f"--resume: no checkpoint in {root} verifies (see the warnings above); "
                              "delete the corrupt ones, or the folder to start over")
    if checkpoint is None:
        log(f"--resume: no complete checkpoint in {root}; starting from scratch")
    return checkpoint


def check_sharding(config: TrainConfig) -> dict[str, Any] | None:
    """Fold an accelerate FSDP / DeepSpeed config into ``config`` (``fsdp``, ``zero_stage``) and
    resolve ``deepspeed_config``; return the ZeRO section to use (None without DeepSpeed).

    ``ValueError`` for what cannot run: offload, an unreadable DeepSpeed config, DeepSpeed not
    installed, FSDP and DeepSpeed together.
    """
    from textrl import zero
    from textrl.sharding import accelerate_fsdp_options, accelerate_wants_fsdp

    if zero.accelerate_wants_deepspeed():
        for name, value in zero.accelerate_deepspeed_options().items():
            setattr(config, name, value)
    if accelerate_wants_fsdp():
        for name, value in {"fsdp": True, **accelerate_fsdp_options()}.items():
            setattr(config, name, value)
    section = zero.read_zero_section(config.deepspeed_config) if config.deepspeed_config else {}
    if not config.zero_stage and "stage" in section:  # --deepspeed-config alone: its stage
        config.zero_stage = section["stage"]
    if config.deepspeed_config and not config.zero_stage:
        raise ValueError(f"deepspeed_config={config.deepspeed_config!r} names no zero_optimization.stage; "
                         "add one or pass --zero-stage 1, 2 or 3")
    config.validate()
    if not config.zero_stage:
        return None
    zero.require_deepspeed()
    return section


def check_process_split(config: TrainConfig, dist: Distributed) -> None:
    """Each process takes whole prompt groups and splits its rows into the minibatches."""
    if config.prompts_per_iteration % dist.world_size:
        raise ValueError(
            f"prompts_per_iteration={config.prompts_per_iteration} does not split over "
            f"{dist.world_size} processes; choose a multiple of {dist.world_size}"
        )
    local = config.rollout_batch_size // dist.world_size
    parts = config.num_minibatches * config.gradient_accumulation_steps
    if local % parts:
        raise ValueError(
            f"each of the {dist.world_size} processes gets {local} rows, which do not divide into "
            f"num_minibatches={config.num_minibatches} x gradient_accumulation_steps="
            f"{config.gradient_accumulation_steps}; lower either or raise prompts_per_iteration"
        )


def train(config: TrainConfig) -> dict[str, Any]:
    """Run ``config.iterations`` PPO iterations; return the before/after held-out summary.

    SIGINT / SIGTERM finish the current iteration, save a checkpoint and raise
    :class:`TrainingStopped` (its message says how to resume); so does a run of
    ``config.max_nonfinite_updates`` consecutive NaN/inf updates.
    """
    with StopSignals() as signals:
        return _train(config, signals)


def _train(config: TrainConfig, signals: StopSignals) -> dict[str, Any]:
    from accelerate import Accelerator

    from textrl.envs import PromptSampler, load_prompts
    from textrl.rollout import collect

    check_run(config)
    device = resolve_device(config.device)
    zero_section = check_sharding(config)
    fsdp, zero_stage = config.fsdp, config.zero_stage
    accelerator = Accelerator(cpu=device.type == "cpu")
    dist = Distributed.from_accelerator(accelerator)
    if (fsdp or zero_stage) and not dist.enabled:
        flag = "--fsdp" if fsdp else "--zero-stage"
        raise ValueError(f"{'fsdp=True' if fsdp else f'zero_stage={zero_stage}'} shards over several processes; "
                         "launch with `accelerate launch --num_processes N -m textrl.cli train ...` or "
                         f"torchrun, or drop {flag}")
    if dist.enabled:  # each process: its own GPU (or the CPU), its share of every rollout
        device = accelerator.device
        check_process_split(config, dist)
    main = accelerator.is_main_process
    output_dir = Path(config.output_dir)
    log = print if main else (lambda *a, **k: None)
    if main:
        output_dir.mkdir(parents=True, exist_ok=True)
        save_config(config, output_dir / "config.yaml")
    seed_everything(config.seed)
    checkpoint = resume_checkpoint(config, log)  # verified before any model loads

    agent = build_agent(config, device, log)
    tokenizer = agent.tokenizer
    reward_fn = agent.task_reward(reward_spec(config))
    train_rows, eval_rows = load_prompts(config.dataset).split(config.eval_size, seed=config.seed)
    sampler = PromptSampler(
        train_rows, tokenizer, prompts_per_batch=config.prompts_per_iteration,
        n_samples_per_prompt=config.n_samples_per_prompt, seed=config.seed,
        max_prompt_length=config.max_prompt_length,
    )
    eval_batches = sampler.encode_eval(eval_rows, batch_size=config.generation_batch_size)
    if dist.enabled:  # identical weights everywhere, different samples in every process
        dist.broadcast_module(agent)
        agent.dist = dist
        torch.manual_seed(config.seed + 1_000_003 * dist.rank)
    if fsdp:  # each process keeps 1/N of every weight, gradient and optimiser state
        from textrl.sharding import device_mesh

        agent.shard(device_mesh(device, dist.world_size), config.fsdp_reshard_after_forward)
    if zero_stage:  # DeepSpeed ZeRO: AdamW states (1), + gradients (2), + weights (3) partitioned
        agent.use_deepspeed(zero_stage, zero_section)
    # held-out evaluation: the main process alone, unless the forwards are collectives (FSDP, ZeRO-3)
    evaluates = main or agent.partitions_weights

    start = 0
    if checkpoint is not None:
        start = load_checkpoint(checkpoint, agent, sampler, verify=False, dist=dist)  # verified already
        log(f"resumed from {checkpoint} (iteration {start})")
    metrics_log = MetricsLog(output_dir, main, resume_after=start if checkpoint is not None else None)
    before_path = output_dir / BEFORE_FILE
    before = (evaluate(agent, eval_batches, reward_fn, config.seed, reward_nonfinite=config.reward_nonfinite)
              if start == 0 and evaluates else None)
    if main and before is not None:
        before_path.write_text(json.dumps(before, indent=2) + "\n")
    elif start > 0 and before_path.is_file():  # resumed: the evaluation before the first iteration
        before = json.loads(before_path.read_text())
    samples_path = output_dir / "samples.jsonl"
    if evaluates and start == 0:
        samples = sample_completions(agent, eval_batches[0])
        if main:
            samples_path.unlink(missing_ok=True)
            write_samples(samples_path, 0, samples)
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
        batch = sampler.next_batch()  # the same global batch in every process ...
        batch = batch.select(dist.shard(len(batch)))  # ... of which each takes whole prompt groups
        td = collect(agent, batch, reward_fn, reward_placement=config.reward_placement, timings=timings,
                     reward_nonfinite=config.reward_nonfinite, check_finite=False)  # update() skips NaN
        # 4. K epochs of minibatch updates
        with timed(timings, "update", agent.device):
            update_metrics = agent.update(td)
        # 5. log / evaluate / checkpoint
        with timed(timings, "bookkeeping", agent.device):
            row = iteration_metrics(iteration, td, update_metrics, dist)
            row["reward/nonfinite_rows"] = dist.mean({"n": nonfinite_rows(td, len(batch))})["n"] * dist.world_size
            # the largest process's peak so far; checkpoints of earlier iterations included, this one's not
            row["memory/peak_mib"] = max(dist.gather_object(peak_memory_mib(agent.device)))
        if evaluates and (iteration == config.iterations or (config.eval_every and iteration % config.eval_every == 0)):
            with timed(timings, "eval", agent.device):
                row.update(evaluate(agent, eval_batches, reward_fn, config.seed + iteration,
                                    reward_nonfinite=config.reward_nonfinite))
                samples = sample_completions(agent, eval_batches[0])
                if main:
                    write_samples(samples_path, iteration, samples)
        row.update({f"time/{phase}_s": seconds for phase, seconds in timings.items()})
        row["time/iteration_s"] = time.perf_counter() - t0
        row["tokens_per_second"] = row["tokens"] / row["time/iteration_s"]
        metrics_log.write(row)
        if progress is not None:
            progress.set_postfix(reward=f"{row['reward/mean']:.3f}", kl=f"{row.get('kl/collection', 0.0):.3f}")
            progress.update(1)
        streak = getattr(agent, "nonfinite_streak", 0)
        # a signal to any process stops them all (the last iteration just finishes the run)
        interrupted = dist.any(signals.received is not None) and iteration < config.iterations
        stop = interrupted or streak >= config.max_nonfinite_updates
        save = stop or iteration == config.iterations or (
            config.checkpoint_every and iteration % config.checkpoint_every == 0)
        rng_per_process = dist.gather_object(rng_state()) if save and dist.enabled else None
        saved = None
        if save and (not stop or _weights_finite(agent, dist)):
            state = agent.state_dict() if agent.gathers_state else None  # a gather all processes join
            if main:
                saved = save_checkpoint(output_dir, iteration, agent, sampler, config.keep_checkpoints,
                                        rng_per_process=rng_per_process, agent_state=state)
        if stop:
            dist.barrier()  # the others wait for the main process's checkpoint before exiting
            if progress is not None:
                progress.close()
            metrics_log.close()
            message = stop_message(config, iteration, signals.received, streak, saved)
            if main:
                print(message, file=sys.stderr, flush=True)
            faulted = streak >= config.max_nonfinite_updates
            raise TrainingStopped(message, 1 if faulted else 128 + (signals.received or signal.SIGTERM))
    if progress is not None:
        progress.close()
    metrics_log.plot(output_dir / "curves.png")
    metrics_log.close()
    after = {k: v for k, v in (metrics_log.rows[-1] if metrics_log.rows else {}).items() if k.startswith("eval/")}
    summary: dict[str, Any] = {"before": before, "after": after, "processes": dist.world_size, "fsdp": fsdp,
                               "zero_stage": zero_stage}
    summary["peak_memory_mib"] = dist.gather_object(peak_memory_mib(agent.device))  # one per process
    if agent.partitions_weights:  # the share of the agent's weights this process holds (1 / processes, up to rounding)
        from textrl.sharding import full_numel, held_numel

        params = list(agent.parameters())
        summary["weights_held_per_process"] = sum(map(held_numel, params)) / sum(map(full_numel, params))
    if dist.enabled and not agent.partitions_weights:  # data parallelism must leave every process with the same weights
        checksums = dist.gather_object(parameter_checksum(agent))
        if len(set(checksums)) > 1:
            raise RuntimeError(f"the {dist.world_size} processes ended with different weights "
                               f"({checksums}); this is a bug in gradient synchronisation, please report it")
        summary["parameter_checksum"] = checksums[0]
    if main:
        log(format_summary(before, after))
        (output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    dist.barrier()  # every process ends together, after the main one wrote its files
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


__all__ = [
    "CheckpointError",
    "TrainingStopped",
    "check_run",
    "format_summary",
    "latest_checkpoint",
    "load_checkpoint",
    "resume_checkpoint",
    "save_checkpoint",
    "train",
    "verify_checkpoint",
]
