"""The 2025 agent zoo (dr_grpo, dapo, gspo, cispo, reinforce_pp(_baseline), vapo) on a tiny model:
each estimator against the functional closed form, every registered agent's gradient independent
of the micro-batch split, every agent on every registered environment, option validation."""

from __future__ import annotations

import math
import unittest.mock

import pytest
import torch

from tests.agents.conftest import make_agent, target_reward
from tests.arithmetic import assert_gradients_close, assert_within, rollout_rtol
from textrl.agents import AGENTS, agent_names
from textrl.agents.base import SCORE, UpdateTally
from textrl.agents.update import Objective, run_epochs
from textrl.config import TrainConfig
from textrl.envs import env_ids, rollout_from_responses
from textrl.envs.collector import EpisodeRunner
from textrl.envs.episodes import default_episode_tokens
from textrl.envs.prompts import PromptSampler
from textrl.envs.registry import split_rows, task_environment
from textrl.functional import (
    dr_grpo_advantage,
    dynamic_sampling_keep,
    gae,
    gae_row_lambda,
    grpo_advantage,
    kl_k1,
    length_adaptive_lambda,
    masked_whiten,
    overlong_penalty,
    reinforce_pp_advantages,
)
from textrl.keys import KEYS
from textrl.run.rollout import run_episodes
from textrl.testing import sum_tolerance

ZOO = ["cispo", "dapo", "dr_grpo", "gspo", "reinforce_pp", "reinforce_pp_baseline", "vapo"]
PROMPTS6 = ["What is 1+2?", "hi", "Count to 3", "<think>", "a b c d", "x"]
LOW, HIGH = 40, 300  # token ids under / over target_reward's threshold


def hand_rollout(tok, responses: list[list[int]], max_new_tokens: int = 6):
    """A rollout of the six prompts with fixed right-padded ``responses`` (ids, EOS = 3 included)."""
    enc = tok(PROMPTS6[: len(responses)], return_tensors="pt", padding=True)
    width = max(map(len, responses))
    padded = torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r in responses])
    return rollout_from_responses(
        enc["input_ids"], enc["attention_mask"].bool(), padded, tokenizer=tok, reward_fn=target_reward,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, max_new_tokens=max_new_tokens,
    )


def uneven_responses(eos: int) -> list[list[int]]:
    """Six responses of lengths 2, 6, 4, 1, 5, 3 (EOS = 3 counts as a low id; the 6-token one
    has no EOS): group (0, 1) has equal scores (0.5 each), groups (2, 3) and (4, 5) unequal ones."""
    return [
        [HIGH, eos], [LOW, LOW, HIGH, HIGH, HIGH, LOW],
        [HIGH, HIGH, LOW, eos], [eos],
        [HIGH, HIGH, HIGH, HIGH, eos], [LOW, HIGH, eos],
    ]


def zoo_agent(tok, name: str, **overrides):
    """A tiny ``name`` agent for six rows: 3 prompts x 2 samples (1 x 6 for the per-row agents)."""
    n = 2 if AGENTS[name].min_samples_per_prompt > 1 or name in ZOO else 1
    base = dict(prompts_per_iteration=6 // n, n_samples_per_prompt=n, forward_batch_size=6, generation_batch_size=6)
    return make_agent(tok, name, **{**base, **overrides})


def rows_of(td, key):
    return td.get(key).squeeze(-1)


# 1. each estimator is its functional closed form -------------------------------------------------
def test_dr_grpo_advantage_and_loss_are_the_closed_forms(tok):
    agent = zoo_agent(tok, "dr_grpo")
    td = agent.process_rollout(hand_rollout(tok, uneven_responses(tok.eos_token_id)))
    mask, score = td.get(KEYS.mask), td.get(SCORE)
    expected = dr_grpo_advantage(score, 2)  # KL is 0 before any update: policy == reference
    torch.testing.assert_close(rows_of(td, KEYS.advantage), torch.where(mask, expected[:, None], 0.0))
    assert agent.episode_budget() == 6
    loss, stats = agent.loss(td)  # ratio 1 at step 0: -sum_t A_t / (B * budget)
    torch.testing.assert_close(stats["loss/policy"], -(expected[:, None] * mask).sum() / (6 * 6))


def test_dapo_overlong_penalty_dynamic_sampling_and_clip_higher(tok):
    agent = zoo_agent(tok, "dapo", overlong_buffer=3)
    assert (agent.clip_eps, agent.clip_eps_high) == (0.2, 0.28)
    td = agent.process_rollout(hand_rollout(tok, uneven_responses(tok.eos_token_id)))
    mask, score = td.get(KEYS.mask), td.get(SCORE)
    penalty = overlong_penalty(mask.sum(1), 6, 3)  # lengths 2 6 4 1 5 3 against budget 6, buffer 3
    torch.testing.assert_close(penalty, torch.tensor([0.0, -1.0, -1 / 3, 0.0, -2 / 3, 0.0]))
    shaped = score + penalty
    torch.testing.assert_close(rows_of(td, KEYS.advantage), torch.where(mask, grpo_advantage(shaped, 2)[:, None], 0.0))
    keep = dynamic_sampling_keep(shaped.view(-1, 2))
    assert torch.equal(td.get(KEYS.loss_mask), mask & keep.repeat_interleave(2)[:, None])
    metrics = agent.update(td)
    assert metrics["dapo/kept_groups"] == pytest.approx(float(keep.float().mean()))


def test_dapo_drops_a_constant_group_from_the_token_mean(tok):
    eos = tok.eos_token_id
    responses = [[HIGH, eos], [HIGH, HIGH, LOW, eos], [LOW, eos], [HIGH, eos], [LOW, HIGH, eos], [HIGH, LOW, eos]]
    agent = zoo_agent(tok, "dapo", overlong_buffer=0)
    td = agent.process_rollout(hand_rollout(tok, responses))
    scores = td.get(SCORE).view(-1, 2)
    assert scores[0, 0] == scores[0, 1] and scores[1, 0] != scores[1, 1] and scores[2, 0] == scores[2, 1]
    loss_mask, mask = td.get(KEYS.loss_mask), td.get(KEYS.mask)
    assert not loss_mask[[0, 1, 4, 5]].any() and torch.equal(loss_mask[[2, 3]], mask[[2, 3]])
    _, stats = agent.loss(td)  # ratio 1: -mean of A over the kept tokens only
    adv = rows_of(td, KEYS.advantage)
    torch.testing.assert_close(stats["loss/policy"], -adv[loss_mask].mean())
    assert agent.update(td)["dapo/kept_groups"] == pytest.approx(1 / 3)


def test_dapo_with_every_group_constant_does_not_step(tok):
    eos = tok.eos_token_id
    agent = zoo_agent(tok, "dapo", overlong_buffer=0, actor_lr=1e-2)
    td = agent.process_rollout(hand_rollout(tok, [[HIGH, eos]] * 2 + [[LOW, eos]] * 2 + [[HIGH, HIGH, eos]] * 2))
    before = {k: v.clone() for k, v in agent.policy.state_dict().items()}
    metrics = agent.update(td)
    assert metrics["dapo/kept_groups"] == 0.0
    assert all(torch.equal(v, agent.policy.state_dict()[k]) for k, v in before.items())


@pytest.mark.parametrize("name", ["gspo", "cispo"])
def test_gspo_and_cispo_use_the_grpo_advantage_and_their_clip_defaults(tok, name):
    agent = zoo_agent(tok, name)
    td = agent.process_rollout(hand_rollout(tok, uneven_responses(tok.eos_token_id)))
    mask = td.get(KEYS.mask)
    expected = grpo_advantage(td.get(SCORE), 2)
    torch.testing.assert_close(rows_of(td, KEYS.advantage), torch.where(mask, expected[:, None], 0.0))
    assert (agent.clip_eps, agent.clip_eps_high) == ((3e-4, 4e-4) if name == "gspo" else (None, 0.28))
    _, stats = agent.loss(td)  # ratio 1 at step 0
    if name == "gspo":  # sum over rows of -A_i / rows
        torch.testing.assert_close(stats["loss/policy"], -expected.mean())
    else:  # token mean of -w_t A_t logp_t with the weight w_t = 1
        logp = td.get(KEYS.action_log_prob)
        # a mean of terms ~6 that cancels (A = +-0.7), in another order: within its terms' magnitude
        terms = (expected[:, None] * logp)[mask]
        tol = sum_tolerance(terms.numel() + 1, float(terms.abs().mean()))
        assert_within(stats["loss/policy"], -terms.mean(), tol, "loss/policy")


def _perturb(model, seed: int = 3, scale: float = 0.05) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))


@pytest.mark.parametrize("name, group", [("reinforce_pp", None), ("reinforce_pp_baseline", 2)])
def test_reinforce_pp_advantages_are_the_closed_form_with_kl_in_the_reward(tok, name, group):
    agent = zoo_agent(tok, name, kl_coef=0.1)
    _perturb(agent.ref_policy)  # a reference apart from the policy: KL_t != 0
    td = agent.process_rollout(hand_rollout(tok, uneven_responses(tok.eos_token_id)))
    mask = td.get(KEYS.mask)
    kl = kl_k1(td.get(KEYS.action_log_prob), td.get(KEYS.ref_log_prob))
    assert kl[mask].abs().max() > 1e-3
    adv, ret = reinforce_pp_advantages(td.get(SCORE), mask, kl, kl_coef=0.1, group_size=group)
    torch.testing.assert_close(rows_of(td, KEYS.advantage), adv)
    torch.testing.assert_close(rows_of(td, KEYS.value_target), ret)
    reward_sum = torch.where(mask, rows_of(td, KEYS.reward), 0.0).sum(1)
    torch.testing.assert_close(reward_sum, td.get(SCORE) - 0.1 * torch.where(mask, kl, 0.0).sum(1))


def test_vapo_decoupled_length_adaptive_gae(tok):
    agent = zoo_agent(tok, "vapo", kl_coef=0.0, max_new_tokens=60)  # responses of 40+ tokens: lambda > 0
    eos = tok.eos_token_id
    responses = [[LOW] * 39 + [eos], [HIGH] * 59 + [eos], [LOW, HIGH] * 15 + [eos], [eos], [HIGH] * 9 + [eos],
                 [LOW] * 50 + [eos]]
    td = agent.process_rollout(hand_rollout(tok, responses, max_new_tokens=60))
    mask = td.get(KEYS.mask)
    rewards, values = rows_of(td, KEYS.reward), rows_of(td, KEYS.state_value)
    lam = length_adaptive_lambda(mask.sum(1), 0.05)
    assert lam.tolist() == pytest.approx([0.5, 2 / 3, 1 - 1 / 1.55, 0.0, 0.0, 1 - 1 / 2.55])
    adv, _ = gae_row_lambda(rewards, values, mask, gamma=1.0, lam=lam)
    torch.testing.assert_close(rows_of(td, KEYS.advantage), masked_whiten(adv, mask))
    _, returns = gae(rewards, values, mask, gamma=1.0, lam=1.0)  # the critic's lambda: 1.0
    torch.testing.assert_close(rows_of(td, KEYS.value_target), returns)


def test_vapo_warms_the_critic_up_before_the_policy_moves(tok):
    agent = zoo_agent(tok, "vapo", critic_warmup_iterations=1, actor_lr=1e-2)
    td = agent.process_rollout(hand_rollout(tok, uneven_responses(tok.eos_token_id)))
    policy, critic = agent.policy.state_dict(), agent.critic.state_dict()
    policy, critic = {k: v.clone() for k, v in policy.items()}, {k: v.clone() for k, v in critic.items()}
    assert agent.update(td)["critic_warmup"] == 1.0
    assert all(torch.equal(v, agent.policy.state_dict()[k]) for k, v in policy.items())
    assert any(not torch.equal(v, agent.critic.state_dict()[k]) for k, v in critic.items())
    td = agent.process_rollout(hand_rollout(tok, uneven_responses(tok.eos_token_id)))
    assert "critic_warmup" not in agent.update(td)  # iteration 1: the policy trains
    assert any(not torch.equal(v, agent.policy.state_dict()[k]) for k, v in policy.items())


def test_gae_ppo_reads_the_vapo_options_and_defaults_to_plain_gae(tok):
    plain = zoo_agent(tok, "gae_ppo", n_samples_per_prompt=1, prompts_per_iteration=6)
    assert plain.lambdas(torch.ones(6, 3, dtype=torch.bool)) == (0.95, 0.95) and not plain.critic_warming_up()
    agent = zoo_agent(tok, "gae_ppo", lam_critic=1.0, lam=0.9, whiten_advantages=False)
    td = agent.process_rollout(hand_rollout(tok, uneven_responses(tok.eos_token_id)))
    mask, rewards, values = td.get(KEYS.mask), rows_of(td, KEYS.reward), rows_of(td, KEYS.state_value)
    torch.testing.assert_close(rows_of(td, KEYS.advantage), gae(rewards, values, mask, 1.0, 0.9)[0])
    torch.testing.assert_close(rows_of(td, KEYS.value_target), gae(rewards, values, mask, 1.0, 1.0)[1])


# 2. the gradient of a minibatch does not depend on its micro-batch split ---------------------------
GRADIENT_CASES = [(name, {}) for name in agent_names()] + [
    ("vapo", {"critic_warmup_iterations": 0}),
    ("dapo", {"kl_in": "loss", "entropy_coef": 0.01}),
    ("dr_grpo", {"kl_in": "loss", "entropy_coef": 0.01}),
    ("gspo", {"kl_in": "loss", "entropy_coef": 0.01}),
    ("grpo", {"loss_aggregation": "seq_mean", "kl_in": "loss"}),
]


def minibatch_gradient(tok, name: str, steps: int, overrides: dict) -> tuple[dict[str, torch.Tensor], float]:
    """The accumulated gradient of one minibatch (the whole six-row rollout), split into ``steps``,
    and the normwise tolerance of two such gradients summed in two orders (tests/arithmetic.py)."""
    torch.manual_seed(0)  # multi_adapter_ppo's LoRA initialisation draws from the global generator
    agent = zoo_agent(tok, name, gradient_accumulation_steps=steps, **overrides)
    _perturb(agent.ref_policy)  # KL_t != 0 in the reward or the loss
    td = agent.process_rollout(hand_rollout(tok, uneven_responses(tok.eos_token_id)))
    _perturb(agent.policy, seed=4, scale=0.02)  # ratios != 1 once the behaviour log-probs are stored
    agent.backend.step = lambda agent: {}  # record, do not step
    with unittest.mock.patch("torch.randperm", lambda n, device=None: torch.arange(n, device=device)):
        run_epochs(agent.learner, td, None, UpdateTally(), Objective(agent.loss, agent.micro_weight))  # one epoch, one minibatch: rows 0..5 in order
    rtol = rollout_rtol(agent.policy.config, td)
    return {n: p.grad.clone() for n, p in agent.named_parameters() if p.grad is not None}, rtol


@pytest.mark.parametrize("name, overrides", GRADIENT_CASES, ids=[f"{n}{'-' + '-'.join(o) if o else ''}" for n, o in GRADIENT_CASES])
def test_minibatch_gradient_does_not_depend_on_the_micro_batch_split(tok, name, overrides):
    runs = {steps: minibatch_gradient(tok, name, steps, overrides) for steps in (1, 2, 3)}
    grads, rtol = {steps: g for steps, (g, _) in runs.items()}, runs[1][1]
    assert grads[1] and grads[1].keys() == grads[2].keys() == grads[3].keys()
    assert any(g.abs().max() > 0 for g in grads[1].values())
    # micro-batches sum each gradient in another order: equal by norm (an element that cancels to
    # ~0 differs by float noise far above itself); a micro-batch weighted wrong or left out is off
    # by far more than rtol
    for steps in (2, 3):
        assert_gradients_close(grads[steps], grads[1], rtol, what=f"{steps} micro-batches: ")


TOKEN_BUDGETS = (1, 14, 30)
"""``microbatch_tokens`` over the six-row rollout (8, 8, 10, 2, 10 and 4 real tokens): every row alone,
micro-batches of 1, 1, 2 and 2 rows, of 3 and 3 rows (tests/agents/test_update_splits.py)."""


@pytest.mark.parametrize("name, overrides", GRADIENT_CASES, ids=[f"{n}{'-' + '-'.join(o) if o else ''}" for n, o in GRADIENT_CASES])
def test_minibatch_gradient_does_not_depend_on_a_token_budget_split(tok, name, overrides):
    whole, rtol = minibatch_gradient(tok, name, 1, overrides)
    for budget in TOKEN_BUDGETS:
        grads, _ = minibatch_gradient(tok, name, 1, {**overrides, "microbatch_tokens": budget})
        assert_gradients_close(grads, whole, rtol, what=f"microbatch_tokens={budget}: ")


# 3. every agent on every registered environment ----------------------------------------------------
class ScriptedGuesser:
    """A stand-in generator: each turn answers a random number 1..8 and EOS (multi-turn games
    then go on after 'higher' / 'lower'); everything else is a tiny agent's."""

    def __init__(self, agent, tok, seed: int = 0) -> None:
        self.agent, self.tok = agent, tok
        self.gen = torch.Generator().manual_seed(seed)
        self.device, self.config = agent.device, agent.config

    def act(self, input_ids, attention_mask, greedy=False):
        rows = [self.tok.encode(str(int(torch.randint(1, 9, (1,), generator=self.gen))), add_special_tokens=False)
                + [self.tok.eos_token_id] for _ in range(input_ids.shape[0])]
        width = max(map(len, rows))
        return torch.tensor([r + [self.tok.pad_token_id] * (width - len(r)) for r in rows])


ENV_SETTINGS = dict(prompts_per_iteration=2, n_samples_per_prompt=2, max_new_tokens=6, forward_batch_size=4,
                    generation_batch_size=4)


@pytest.fixture(scope="module")
def env_rollouts(tok):
    """One raw rollout (4 rows: 2 prompts x 2) per registered environment, collected once; the
    guess_number one by a scripted guesser, so its episodes take several turns."""
    generator = make_agent(tok, "grpo", **ENV_SETTINGS)
    out = {}
    for env_id in env_ids():
        env = task_environment(env_id, None, None, None)
        rows, _ = split_rows(env, 4, 0)
        sampler = PromptSampler(rows, tok, prompts_per_batch=2, n_samples_per_prompt=2, seed=0, max_prompt_length=64)
        runner = EpisodeRunner(env, tokenizer=tok, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                               max_new_tokens=6, max_episode_tokens=default_episode_tokens(env, 6))
        acting = ScriptedGuesser(generator, tok) if env_id == "guess_number" else generator
        torch.manual_seed(0)
        out[env_id] = run_episodes(acting, sampler.next_batch(), runner, greedy=False, timings=None)
    return out


def test_the_multi_turn_rollout_has_several_turns(env_rollouts):
    td = env_rollouts["guess_number"]
    assert int(td.get(KEYS.turns).max()) > 1
    assert not torch.equal(td.get(KEYS.mask), td.get(KEYS.response_mask))  # observation gaps


@pytest.mark.parametrize("name", agent_names())
def test_every_agent_updates_on_every_environment(tok, env_rollouts, name):
    for env_id, raw in env_rollouts.items():
        agent = make_agent(tok, name, env=env_id, **ENV_SETTINGS)
        td = agent.process_rollout(raw.clone())
        metrics = agent.update(td)
        assert metrics["ppo/epochs_run"] == 1.0, env_id
        assert metrics["nonfinite/skipped_updates"] == 0.0, env_id
        bad = {k: v for k, v in metrics.items() if not math.isfinite(v) and k != "explained_variance"}
        assert not bad, f"{name} on {env_id}: {bad}"


# 4. option validation -----------------------------------------------------------------------------
@pytest.mark.parametrize("option, value, readers", [
    ("dynamic_sampling", True, "dapo"), ("overlong_buffer", 4, "dapo"),
    ("lam_critic", 1.0, "gae_ppo/multi_adapter_ppo/vapo"), ("critic_warmup_iterations", 2, "gae_ppo/multi_adapter_ppo/vapo"),
])
def test_a_new_option_is_refused_where_it_is_not_read(option, value, readers):
    with pytest.raises(ValueError, match=rf"^grpo does not read {option}={value!r} .*{option} is read .*{readers}"):
        TrainConfig(agent="grpo", **{option: value}).validate()


def test_clip_eps_high_is_refused_by_one_step_ppo_and_read_by_the_token_level_agents():
    with pytest.raises(ValueError, match=r"^one_step_ppo does not read clip_eps_high=0.3"):
        TrainConfig(agent="one_step_ppo", clip_eps_high=0.3).validate()
    for name in ("gae_ppo", "grpo", "rloo", "dapo", "gspo", "cispo", "dr_grpo", "reinforce_pp", "vapo"):
        TrainConfig(agent=name, clip_eps_high=0.3).validate()


@pytest.mark.parametrize("name", ["dapo", "dr_grpo", "gspo", "cispo"])
def test_the_zoo_agents_with_a_fixed_aggregation_refuse_loss_aggregation(name):
    with pytest.raises(ValueError, match=rf"^{name} does not read loss_aggregation='seq_mean' \(the algorithm fixes"):
        TrainConfig(agent=name, loss_aggregation="seq_mean").validate()


@pytest.mark.parametrize("option, value, message", [
    ("clip_eps_high", 0.0, r"clip_eps_high=0.0: must be > 0"),
    ("lam_critic", 1.5, r"lam_critic=1.5: must lie in \[0.0, 1.0\]"),
    ("lam_length_alpha", -0.1, r"lam_length_alpha=-0.1: must be a number >= 0"),
    ("critic_warmup_iterations", -1, r"critic_warmup_iterations=-1: must be a number >= 0"),
    ("overlong_buffer", -2, r"overlong_buffer=-2: must be a number >= 0"),
    ("dynamic_sampling", "yes", r"dynamic_sampling='yes': must be true or false"),
])
def test_bad_values_of_the_new_options_are_refused(option, value, message):
    agent = "dapo" if option in ("dynamic_sampling", "overlong_buffer") else "vapo"
    with pytest.raises(ValueError, match=message):
        TrainConfig(agent=agent, **{option: value}).validate()


def test_an_overlong_buffer_over_the_budget_is_refused(tok):
    with pytest.raises(ValueError, match=r"overlong_buffer=9: must be <= max_episode_tokens=8"):
        TrainConfig(agent="dapo", max_new_tokens=6, max_episode_tokens=8, overlong_buffer=9).validate()
    agent = zoo_agent(tok, "dapo", overlong_buffer=7)  # single turn: the budget is max_new_tokens=6
    with pytest.raises(ValueError, match=r"overlong_buffer=7: must be <= the episode's token budget 6"):
        agent.process_rollout(hand_rollout(tok, uneven_responses(tok.eos_token_id)))


def test_the_new_options_have_help_text():
    from textrl.config import field_docs

    docs = field_docs(TrainConfig)
    for option in ("clip_eps_high", "dynamic_sampling", "overlong_buffer", "lam_critic", "lam_length_alpha",
                   "critic_warmup_iterations"):
        assert len(docs[option]) > 40, option


def test_every_zoo_agent_is_registered_with_its_paper():
    for name in ZOO:
        assert name in agent_names()
        assert "arXiv:" in (AGENTS[name].__doc__ or ""), name
