"""Fault cases of rewards on a device (docs/reliability.md, "Environments and lengths").

A reward function (``--reward FILE:fn``) whose scores are a tensor on the 'meta' device, an
environment whose turn reward is such a tensor (both refused in one line naming the reward or the
environment and the device, nothing written but the run's start), and an environment whose turn
reward is a one-number tensor (taken: the run completes). The sweep of every listed environment
run with nothing else is benchmarks/env_sweep.py.
"""

from __future__ import annotations

from pathlib import Path

from fault_catalogue import SMALL, Trial, _write, case, judge, run_folder_sound

CODE = '''
import torch
from textrl.envs import Environment, Turn


def meta_scores(prompts, completions, **kwargs):
    return torch.zeros(len(completions), device="meta")


class Base(Environment):
    max_turns = 2

    def rows(self):
        return [{"prompt": f"Say {i}"} for i in range(40)]


class MetaTurn(Base):
    id = "meta_turn"

    def step(self, episode, completion):
        return Turn(reward=torch.tensor(1.0, device="meta"), done=True)


class TensorTurn(Base):
    id = "tensor_turn"

    def step(self, episode, completion):
        return Turn(reward=torch.tensor(float(len(completion) > 3)), done=True)
'''


@case("env sweep: rewards on a device")
def rewards_on_a_device(trial: Trial, base: Path) -> None:
    path = _write(trial, "device_rewards.py", CODE)
    for name, flags, expect in [
        ("env sweep: --reward scores on 'meta'", ["--env", "digits", "--reward", f"{path}:meta_scores"],
         "reward 'meta_scores' returned a tensor on device 'meta'"),
        ("env sweep: a turn reward on 'meta'", ["--env", f"{path}:MetaTurn"],
         "environment 'meta_turn': step() on row"),
    ]:
        out = trial.folder("device_rewards")
        proc = trial.textrl("train", *SMALL, "--iterations", "1", "--warmup-sft-steps", "0", *flags,
                            "--output-dir", str(out))
        kept = not (out / "checkpoints").exists() and not (out / "summary.json").exists()
        judge(trial, name, proc, refused=True, kept=kept, expect=expect)
    out = trial.folder("device_rewards")
    proc = trial.textrl("train", *SMALL, "--iterations", "1", "--warmup-sft-steps", "0",
                        "--env", f"{path}:TensorTurn", "--output-dir", str(out))
    judge(trial, "env sweep: a turn reward as a one-number tensor", proc, refused=False,
          kept=run_folder_sound(out, 1), expect="held-out metric")
