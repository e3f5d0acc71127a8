"""Rewards scored in the background (textrl/rewards/background.py, ``EpisodeRunner.run``).

The same episodes are run three ways: the reward a plain function scored in the loop (today's
path), the same function ``async def``, and the same function declared ``does_io``. A tiny model
generates greedily in micro-batches of ``G`` rows, as the agent does, so the three runs sample the
same tokens; the rollouts must be equal key for key, row for row, component for component. The
concurrency limit is checked by counting the calls in flight (never by the clock): a barrier of
``limit`` parties shows the limit is reached, a counter that it is never passed.
"""

from __future__ import annotations

import asyncio
import math
import threading

import pytest
import torch
import torch.nn.functional as F

from textrl.config import TrainConfig
from textrl.envs.collector import EpisodeRunner
from textrl.envs.environment import Environment, Turn
from textrl.envs.prompts import PromptBatch, encode_prompts
from textrl.envs.tasks import make_digits_task
from textrl.keys import KEYS
from textrl.models import build_tiny_causal_lm
from textrl.rewards import (
    CompositeReward,
    RewardError,
    RewardPool,
    does_io,
    evaluate_reward,
    is_async_reward,
    overlapped,
)

G = 4  # the agent's generation micro-batch
LIMIT = 2  # reward calls in flight at most


def scores_of(completions, completion_ids):
    """Row-wise scores, None ("does not apply") on every row whose length is a multiple of 3."""
    return [None if len(ids) % 3 == 0 else len(ids) + 0.25 * len(text) for text, ids in zip(completions, completion_ids)]


def plain(prompts, completions, completion_ids, **kwargs):
    return scores_of(completions, completion_ids)


class Gauge:
    """Counts the calls in flight; the first ``limit`` calls wait for each other (a barrier), so
    a run that never has ``limit`` calls in flight fails instead of passing by luck."""

    def __init__(self, limit: int) -> None:
        self.lock = threading.Lock()
        self.now = self.most = self.calls = 0
        self.rows: list[int] = []
        self.barrier = threading.Barrier(limit, timeout=20)
        self.limit = limit

    def enter(self, rows: int) -> None:
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
            self.calls += 1
            first = self.calls <= self.limit
            self.rows.append(rows)
        if first:
            self.barrier.wait()

    def leave(self) -> None:
        with self.lock:
            self.now -= 1


def async_reward(gauge: Gauge, fail_on: str | None = None):
    async def judge(prompts, completions, completion_ids, **kwargs):
        gauge.enter(len(completions))
        try:
            await asyncio.sleep(0)
            if fail_on is not None and fail_on in prompts:
                raise ConnectionError("the judge hung up")
            return scores_of(completions, completion_ids)
        finally:
            gauge.leave()

    return judge


def io_reward(gauge: Gauge):
    @does_io
    def judge(prompts, completions, completion_ids, **kwargs):
        gauge.enter(len(completions))
        try:
            return scores_of(completions, completion_ids)
        finally:
            gauge.leave()

    return judge


THREADS: list[str] = []
"""The threads the composite's plain component ran in."""


def length(prompts, completions, **kwargs):
    THREADS.append(threading.current_thread().name)
    return [float(len(t)) for t in completions]


def composite(judge):
    return CompositeReward({"judge": (judge, 0.5), "length": length})


def agent_like(model, tok, max_new_tokens=6):
    """Greedy generation in micro-batches of ``G`` rows (as the agent's actor generates); the row
    counts of its calls are kept."""
    calls: list[int] = []

    def generate(ids, mask):
        calls.append(ids.shape[0])
        outs = [model.generate(input_ids=ids[s:s + G], attention_mask=mask[s:s + G].long(), do_sample=False,
                               max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id)[:, ids.shape[1]:]
                for s in range(0, ids.shape[0], G)]
        width = max(o.shape[1] for o in outs)
        return torch.cat([F.pad(o, (0, width - o.shape[1]), value=tok.pad_token_id) for o in outs])

    generate.calls = calls
    return generate


class Rounds(Environment):
    """Each row plays ``turns`` turns (1 to 3), so episodes end at different turns."""

    id = "rounds"
    max_turns = 3

    def rows(self):
        return [{"prompt": f"Count {i}", "turns": 1 + i % 3} for i in range(6)]

    def step(self, episode, completion):
        done = episode.turn >= episode.row["turns"]
        return Turn(reward=float(len(completion) % 2), done=done, observation=None if done else "again")


@pytest.fixture(scope="module")
def model(tok):
    return build_tiny_causal_lm(tok, seed=0)


def grouped(tok, rows, samples=2):
    """The prompt batch of ``rows``, each prompt's ``samples`` rows side by side (a GRPO group)."""
    one = encode_prompts(rows, tok)[0]
    again = lambda xs: [x for x in xs for _ in range(samples)]  # noqa: E731
    return PromptBatch(one.input_ids.repeat_interleave(samples, 0), one.attention_mask.repeat_interleave(samples, 0),
                       again(one.prompt_texts), again(one.rows), again(one.prompt_index))


def same_rollouts(a, b):
    assert a.batch_size == b.batch_size
    for key in (KEYS.prompt_tokens, KEYS.action, KEYS.mask, KEYS.response_mask, KEYS.reward, KEYS.done,
                KEYS.terminated, KEYS.truncated, KEYS.score, KEYS.turns, KEYS.end_reason):
        assert torch.equal(a.get(key), b.get(key)), key
    ca, cb = a.get(KEYS.reward_components), b.get(KEYS.reward_components)
    assert list(ca.keys()) == list(cb.keys())
    for name in ca.keys():
        torch.testing.assert_close(ca.get(name), cb.get(name), rtol=0, atol=0, equal_nan=True)


def runs(env_of, batch, tok, model, **settings):
    """The rollouts of a plain, an async and a does_io reward (``env_of(reward)`` the environment or
    reward the runner gets), and the gauges of the two in the background."""
    out, gauges, calls = [], [], []
    for kind in ("plain", "async", "io"):
        gauge = Gauge(LIMIT)
        judge = {"plain": plain, "async": async_reward(gauge), "io": io_reward(gauge)}[kind]
        runner = EpisodeRunner(env_of(composite(judge)), tokenizer=tok, max_new_tokens=6, generation_batch_size=G,
                               reward_concurrency=LIMIT, **settings)
        assert (runner.pool is not None) == (kind != "plain")
        generate, timings = agent_like(model, tok), {}
        THREADS.clear()
        out.append(runner.run(generate, batch, timings=timings))
        assert set(THREADS) == {threading.main_thread().name}  # a plain component stays in the loop's thread
        calls.append(generate.calls)
        gauges.append(gauge)
        assert ("reward_calls" in timings) == (kind != "plain")
    return out, gauges[1:], calls


def test_single_turn_rewards_in_the_background_give_the_rollout_of_the_loop(tok, model):
    batch = grouped(tok, make_digits_task(4, seed=3))  # 4 prompts x 2 samples
    (sync, in_async, in_io), gauges, calls = runs(lambda r: r, batch, tok, model)
    assert sync.get((KEYS.reward_components, "judge")).isnan().any()  # some rows it does not apply to
    same_rollouts(sync, in_async)
    same_rollouts(sync, in_io)
    assert calls == [[8], [G, G], [G, G]]  # one call in the loop; in the background, one per micro-batch
    for gauge in gauges:
        assert gauge.most == LIMIT and gauge.now == 0  # the limit reached and held; nothing left running
        # each micro-batch's rewards as it finished: LIMIT calls of whole groups
        assert gauge.calls == 4 and gauge.rows == [2] * 4


def test_multi_turn_episodes_ending_apart_are_scored_as_in_the_loop(tok, model):
    env = Rounds()

    def env_of(reward):
        e = Rounds()
        e.reward = reward
        return e

    batch = encode_prompts(env.rows(), tok)[0]
    (sync, in_async, in_io), gauges, _ = runs(env_of, batch, tok, model, max_episode_tokens=400)
    assert sync.get(KEYS.turns).tolist() == [1, 2, 3, 1, 2, 3]
    same_rollouts(sync, in_async)
    same_rollouts(sync, in_io)
    for gauge in gauges:
        assert gauge.most <= LIMIT and gauge.now == 0
        assert sum(gauge.rows) == 6  # every episode scored once, as it ended


def test_a_background_reward_that_raises_is_named_where_the_scores_are_needed(tok, model):
    batch = grouped(tok, make_digits_task(4, seed=3))  # the last prompt's rows raise
    gauge = Gauge(1)
    runner = EpisodeRunner(composite(async_reward(gauge, fail_on=batch.rows[-1]["prompt"])), tokenizer=tok, max_new_tokens=6,
                           generation_batch_size=G, reward_concurrency=LIMIT)
    with pytest.raises(RewardError, match=r"reward 'judge' raised ConnectionError: the judge hung up") as err:
        runner.run(agent_like(model, tok), batch)
    assert "the call scored the batch's rows [6, 7]" in str(err.value)  # its group's rows
    assert gauge.now == 0  # no call left running behind the error


def test_async_rewards_follow_the_rules_of_plain_ones():
    async def judge(prompts, completions, **kwargs):
        return [1.0, None]

    class Served:
        async def __call__(self, prompts, completions, **kwargs):
            return [math.nan, 2.0]

    scores, applies = evaluate_reward(judge, ["p", "p"], ["a", "b"])
    assert scores[0].item() == 1.0 and scores[1].isnan() and applies.tolist() == [True, False]
    with pytest.raises(RewardError, match="reward 'Served' returned non-finite scores"):
        evaluate_reward(Served(), ["p", "p"], ["a", "b"])
    assert is_async_reward(judge) and is_async_reward(Served()) and not is_async_reward(plain)
    assert overlapped(does_io(lambda p, c, **kw: [1.0])) and not overlapped(plain)
    assert overlapped(composite(judge)) and not overlapped(composite(plain))

    class Declared:  # a reward object that says so, as served rewards and judges do
        does_io = True

        def __call__(self, prompts, completions, **kwargs):
            return [1.0] * len(completions)

    assert overlapped(Declared()) and evaluate_reward(Declared(), ["p"], ["a"])[0].tolist() == [1.0]


def test_reward_concurrency_is_checked():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=r"reward_concurrency=.*must be an int >= 1"):
            RewardPool(bad)
    for bad in (0, -1):
        with pytest.raises(ValueError, match=rf"reward_concurrency={bad}: must be a number >= 1"):
            TrainConfig(reward_concurrency=bad).validate()
    with pytest.raises(ValueError, match="reward_concurrency"):
        TrainConfig(reward_concurrency=1.5).validate()
    assert TrainConfig().reward_concurrency == 8


REWARD_FILE = '''
from textrl.rewards import does_io, named


@named("judge")
def plain(prompts, completions, **kwargs):
    return [float(len(c) % 3) for c in completions]


@named("judge")
@does_io
def io(prompts, completions, **kwargs):
    return plain(prompts, completions)
'''


@pytest.mark.slow
def test_an_asynchronous_run_with_a_background_reward_is_the_run_with_it_in_the_loop(tmp_path):
    """--max-staleness 2 with partial rollouts on a multi-turn task: the background reward has the
    runner draw each turn in micro-batches of 2 rows, and every turn still gets its weights (one per
    turn, not per part): every metric but the timings is the loop's."""
    from tests.runs import SMALL, metrics
    from textrl.cli import main

    (tmp_path / "rewards.py").write_text(REWARD_FILE)
    rows = {}
    for name in ("plain", "io"):
        out = tmp_path / name
        assert main(["train", *SMALL, "--iterations", "3", "--output-dir", str(out), "--max-staleness", "2",
                     "--env", "guess_number", "--partial-rollouts", "continue", "--generation-batch-size", "2",
                     "--reward", f"{tmp_path / 'rewards.py'}:{name}"]) == 0
        rows[name] = metrics(out)
    assert "time/reward_calls_s" in rows["io"][0] and "time/reward_calls_s" not in rows["plain"][0]
    assert 0.0 < rows["io"][2]["rollout/staleness"] < 2.0  # turns drawn with newer weights, as in the loop's run
    for a, b in zip(rows["plain"], rows["io"]):
        same = {k for k in a if not k.startswith(("time/", "perf/")) and "per_second" not in k and "memory" not in k}
        assert {k: a[k] for k in same} == {k: b[k] for k in same}


class OwnComponents:
    """A does_io reward that reports components of its own (``components`` and ``weights``): it
    cannot be split, so it is scored whole in the background."""

    does_io = True
    weights = {"a": 1.0, "b": 2.0}

    def components(self, prompts, completions, **kwargs):
        a = torch.tensor([float(len(c) % 5) for c in completions])
        b = torch.tensor([float(len(c) % 2) for c in completions])
        THREADS.append(threading.current_thread().name)
        return a + 2 * b, {"a": a, "b": b}

    def __call__(self, prompts, completions, **kwargs):
        return self.components(prompts, completions, **kwargs)[0]


def test_a_reward_with_components_of_its_own_is_scored_whole_in_the_background(tok, model):
    batch = grouped(tok, make_digits_task(4, seed=3))
    sync = EpisodeRunner(composite(plain), tokenizer=tok, max_new_tokens=6).run(agent_like(model, tok), batch)
    THREADS.clear()
    td = {}
    for name, kwargs in (("loop", {}), ("background", {"generation_batch_size": G, "reward_concurrency": LIMIT})):
        runner = EpisodeRunner(OwnComponents(), tokenizer=tok, max_new_tokens=6, **kwargs)
        td[name] = runner.run(agent_like(model, tok), batch)
    assert runner.background is None and runner.pool is not None
    same_rollouts(td["loop"], td["background"])
    assert torch.equal(td["loop"].get(KEYS.action), sync.get(KEYS.action))
    assert any(t != threading.main_thread().name for t in THREADS)  # the background run's calls
