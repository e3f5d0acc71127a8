"""Rewards given as tensors on a device: a final reward (a user reward function or an environment's
``reward``) or a turn reward on the 'meta' device, which holds no values, is one line naming the
reward or the environment and the device; a turn reward given as a one-number tensor is taken; scores
on another real device than the run's (cuda for a cpu run) are moved (cuda-marked: needs a GPU)."""

from __future__ import annotations

import pytest
import torch

from tests.envs.test_env_faults import Answers, play
from textrl.envs.environment import EnvError, Turn
from textrl.models import build_tiny_tokenizer
from textrl.rewards import RewardError, evaluate_reward


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def meta_scores(prompts, completions, **kwargs):
    """A reward function whose scores were made on the 'meta' device."""
    return torch.zeros(len(completions), device="meta")


class Scored(Answers):
    """Answers' single turn, then scored by ``reward`` (a callable)."""

    def __init__(self, reward):
        super().__init__(Turn(done=True))
        self.reward = reward


def test_a_reward_function_returning_a_meta_tensor_is_one_line_naming_it_and_the_device():
    with pytest.raises(RewardError, match=r"reward 'meta_scores' returned a tensor on device 'meta', which holds "
                                          r"no values; return real scores") as info:
        evaluate_reward(meta_scores, ["p", "q"], ["a", "b"])
    assert "\n" not in str(info.value)


def test_an_environment_reward_on_the_meta_device_is_named_when_episodes_are_scored(tok):
    with pytest.raises(RewardError, match=r"reward 'meta_scores' returned a tensor on device 'meta'") as info:
        play(tok, Scored(meta_scores))
    assert "\n" not in str(info.value)


def test_a_turn_reward_on_the_meta_device_is_one_line_naming_the_environment_and_row(tok):
    bad = Turn(reward=torch.tensor(1.0, device="meta"), done=True)
    with pytest.raises(EnvError, match=r"environment 'answers': step\(\) on row -?\d+ \(turn 1\) gave Turn.reward "
                                       r"as a tensor on device 'meta', which holds no value") as info:
        play(tok, Answers(bad))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("reward, message", [
    (torch.tensor([1.0, 2.0]), r"gave Turn.reward as a torch.float32 tensor of shape \(2,\) on cpu: a turn reward "
                               r"must be one real number"),
    (torch.tensor(True), r"gave Turn.reward as a torch.bool tensor of shape \(\) on cpu"),
])
def test_a_turn_reward_tensor_that_is_not_one_real_number_is_refused(tok, reward, message):
    with pytest.raises(EnvError, match=message):
        play(tok, Answers(Turn(reward=reward, done=True)))


@pytest.mark.parametrize("reward", [torch.tensor(2.0), torch.tensor([2.0], dtype=torch.float64), torch.tensor(2)])
def test_a_turn_reward_given_as_a_one_number_tensor_is_taken(tok, reward):
    td = play(tok, Answers(Turn(reward=reward, done=True)))
    assert td.get("score").tolist() == [2.0, 2.0]


def cuda_scores(prompts, completions, **kwargs):
    """A reward function whose scores were made on the GPU."""
    return torch.arange(len(completions), dtype=torch.float32, device="cuda")


@pytest.mark.cuda
def test_scores_and_turn_rewards_on_cuda_are_moved_for_a_cpu_rollout(tok):
    td = play(tok, Scored(cuda_scores))
    assert td.device is None or td.device.type == "cpu"
    assert td.get("score").tolist() == [0.0, 1.0]
    td = play(tok, Answers(Turn(reward=torch.tensor(2.0, device="cuda"), done=True)))
    assert td.get("score").tolist() == [2.0, 2.0]
