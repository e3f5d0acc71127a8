"""The check that the engine samples with the weights the actor claims (textrl.agents.weight_check;
docs/training.md, "Does the engine have the learner's weights?").

The statistics against a closed form (hypothesis draws the log-probs); end to end, an engine that keeps
the weights of its first call (a broken sync) is stopped at the first rollout drawn after an update,
at K=0 and K=1, with top-p too, in one line naming the engine, the update, the gap and the bound; the
built-in engines pass it under every filter; ``--max-weight-gap 0`` turns it off.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from textrl import TrainConfig, train
from textrl.agents.weight_check import (
    WEIGHT_GAP_BOUNDS,
    WeightGapError,
    weight_gap,
    weight_gap_bound,
    weight_gap_error,
)
from textrl.testing.engines import stale_engine

# -- the statistics ---------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 4), cols=st.integers(1, 6), shift=st.floats(-3, 3), seed=st.integers(0, 2**16))
def test_the_gap_is_the_mean_absolute_difference_over_the_tokens_both_hold(rows, cols, shift, seed):
    g = torch.Generator().manual_seed(seed)
    prefill = -torch.rand(rows, cols, generator=g) * 5
    mask = torch.rand(rows, cols, generator=g) < 0.7
    outside = mask & (torch.rand(rows, cols, generator=g) < 0.2)  # tokens the prefill's filter drops
    prefill = prefill.masked_fill(outside, -math.inf)
    engine = (prefill + shift).masked_fill(outside, -1.0)
    gap_sum, tokens, out = weight_gap(engine, prefill, mask)
    both = mask & ~outside
    assert tokens.tolist() == both.sum(1).tolist()
    assert out.tolist() == outside.sum(1).tolist()
    torch.testing.assert_close(gap_sum, both.sum(1).double() * abs(shift), rtol=1e-5, atol=1e-5)


def test_equal_log_probs_have_no_gap_and_a_shape_mismatch_is_refused():
    logp = torch.log(torch.tensor([[0.5, 0.25], [0.1, 0.9]]))
    gap_sum, tokens, outside = weight_gap(logp, logp.clone(), torch.ones(2, 2, dtype=torch.bool))
    assert gap_sum.tolist() == [0.0, 0.0] and tokens.tolist() == [2, 2] and outside.tolist() == [0, 0]
    with pytest.raises(ValueError, match=r"must have one shape \[B, T\]"):
        weight_gap(logp, logp[:, :1], torch.ones(2, 2, dtype=torch.bool))


def test_the_bound_is_the_precisions_unless_the_run_sets_one():
    config = TrainConfig()
    assert weight_gap_bound(config, torch.float32) == WEIGHT_GAP_BOUNDS["float32"]
    assert weight_gap_bound(config, torch.bfloat16) == WEIGHT_GAP_BOUNDS["bfloat16"]
    assert weight_gap_bound(TrainConfig(max_weight_gap=0.5), torch.float32) == 0.5
    assert weight_gap_bound(TrainConfig(max_weight_gap=0), torch.float32) == math.inf
    with pytest.raises(ValueError, match="max_weight_gap=-1"):
        TrainConfig(max_weight_gap=-1).validate()


def test_the_stop_names_the_engine_the_update_the_gap_and_the_bound():
    assert weight_gap_error(engine="x", updates=1, gap=1e-4, tokens=10, outside=0, bound=1e-3,
                            dtype=torch.float32) is None
    err = weight_gap_error(engine="vllm", updates=7, gap=0.25, tokens=96, outside=3, bound=1e-3, dtype=torch.float32)
    assert isinstance(err, WeightGapError) and "\n" not in str(err)
    for part in ("'vllm' engine", "after update 7", "0.25", "96 tokens", "bound 0.001", "float32",
                 "3 of its tokens", "--max-weight-gap"):
        assert part in str(err), part


# -- end to end --------------------------------------------------------------------------------------


@pytest.fixture
def stale():
    """The ``textrl`` engine sampling with a copy of the model taken at its first call (a weight sync that
    never happens), registered for one test only."""
    with stale_engine("test-stale") as name:
        yield name


def tiny(tmp_path, **overrides) -> TrainConfig:
    base = dict(agent="grpo", iterations=4, warmup_sft_steps=5, prompts_per_iteration=2, n_samples_per_prompt=4,
                max_new_tokens=8, eval_size=4, eval_every=0, checkpoint_every=0, progress=False, actor_lr=1e-4,
                output_dir=str(tmp_path / "run"))
    return TrainConfig(**{**base, **overrides})


@pytest.mark.parametrize("staleness", [0, 1])
@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_an_engine_that_never_receives_the_updates_is_stopped_at_its_first_stale_rollout(tmp_path, stale, staleness,
                                                                                          top_p):
    with pytest.raises(WeightGapError) as stop:
        train(tiny(tmp_path, generation_engine=stale, max_staleness=staleness, top_p=top_p))
    message = str(stop.value)
    found = re.search(r"'test-stale' engine does not sample with the weights after update (\d+)", message)
    assert found and "bound 0.001 for float32" in message, message
    # the first update may change nothing (a group whose rewards are all equal has no advantage): the
    # stop comes with the first rollout drawn after weights that moved, update 1 or 2 here
    updates = int(found.group(1))
    assert updates in (1, 2), message
    rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    # K=0: rollout u+1 (iteration u+1) is drawn with the weights of update u; K=1: iteration u+2
    assert len(rows) == updates + staleness


def test_the_check_turned_off_lets_a_stale_engine_train(tmp_path, stale):
    summary = train(tiny(tmp_path, generation_engine=stale, max_weight_gap=0, iterations=3))
    assert summary is not None
    rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 3 and "rollout/weight_gap" not in rows[-1]


@pytest.mark.parametrize("engine", ["textrl", "hf", "static"])
def test_the_built_in_engines_pass_the_check_under_top_k_and_top_p(tmp_path, engine):
    import json

    train(tiny(tmp_path, generation_engine=engine, top_k=20, top_p=0.9, temperature=0.8, iterations=3))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["rollout/weight_gap"] < 1e-5 for r in rows), [r["rollout/weight_gap"] for r in rows]
    assert all(r["rollout/weight_gap_outside"] == 0 for r in rows)
