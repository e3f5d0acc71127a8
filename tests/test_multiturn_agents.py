"""The agents on multi-turn rollouts: an agent mask with gaps where observation tokens sit.

docs/design.md, "Multi-turn episodes": ``action`` holds every token after the prompt, the agent
mask ``("collector","mask")`` marks the agent's tokens, ``("masks","response")`` every token (the
attention mask). Observation tokens are attended to but never trained on: no advantage, reward,
value target, policy-loss, KL or entropy share; GAE steps from agent token to agent token. A
single-turn rollout (no gaps) gives exactly what it gave before. Also: the rollout checks of such
rollouts, and the "pad == eos" regression (the EOS that ends a turn stays an action).
"""

from __future__ import annotations

import math

import pytest
import torch
from tensordict import TensorDict

from tests.agents.conftest import PROMPTS, make_agent
from tests.arithmetic import assert_within, gae_tolerance, rollout_rtol
from textrl.agents.base import SCORE, sequence_inputs
from textrl.agents.forwards import forward_policy
from textrl.core.checks import RolloutError, check_rollout
from textrl.envs import rollout_from_responses
from textrl.functional import gae, kl_shaped_rewards, masked_whiten, next_valid
from textrl.keys import END_REASONS, KEYS
from textrl.models import build_tiny_tokenizer
from textrl.testing import assert_close_normwise

LAYOUTS = ("aaEooaE...", "Eoooaaa...", "aaaaE.....", "aEooEoaaaE")
"""One row each: ``a`` an agent token, ``E`` the agent's EOS, ``o`` an observation token, ``.``
padding. A turn is a run of agent tokens; its reward sits on its last one. Rows 0 and 3 have two
and three turns, row 1 opens with a lone EOS, row 2 is a single turn."""
GROUPED_PROMPTS = [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[1]]  # grpo: groups of 2 consecutive rows


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def eos_pad_tok():
    """The tiny tokenizer with ``pad_token = eos_token``, as many chat models ship."""
    tokenizer = build_tiny_tokenizer()
    tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _layout(layouts, char):
    return torch.tensor([[c in char for c in row] for row in layouts])


def turn_ends(mask: torch.Tensor) -> torch.Tensor:
    """bool ``[B, T]``: the last agent token of each run of agent tokens."""
    return mask & ~torch.cat([mask[:, 1:], torch.zeros_like(mask[:, :1])], dim=1)


def multiturn_rollout(tok, layouts=LAYOUTS, *, seed: int = 0, pad_id: int | None = None,
                      response_mask: bool = True) -> TensorDict:
    """A rollout as the multi-turn collector lays it out, built by hand from ``layouts``."""
    g = torch.Generator().manual_seed(seed)
    b, t = len(layouts), len(layouts[0])
    enc = tok(GROUPED_PROMPTS[:b], return_tensors="pt", padding=True)
    agent, eos, obs = _layout(layouts, "aE"), _layout(layouts, "E"), _layout(layouts, "o")
    action = torch.randint(4, 500, (b, t), generator=g)
    action = torch.where(eos, tok.eos_token_id, action)
    action = torch.where(agent | obs, action, tok.pad_token_id if pad_id is None else pad_id)
    ends = turn_ends(agent)
    turn = ends.long().cumsum(1)  # the turn number at each turn end
    rows = torch.arange(b).unsqueeze(1).float()
    rewards = torch.where(ends, 0.5 * turn - 0.3 * rows, 0.0)  # [B, T]: each turn's reward on its end
    last = torch.tensor([max(row.rfind("a"), row.rfind("E")) for row in layouts])  # the last agent token
    done = torch.zeros(b, t, dtype=torch.bool)
    done[torch.arange(b), last] = True
    cut = torch.tensor([row[i] == "a" for row, i in zip(layouts, last.tolist())])  # its turn hit max_new_tokens
    td = TensorDict(batch_size=[b])
    td.set(KEYS.prompt_tokens, enc["input_ids"])
    td.set(KEYS.prompt_mask, enc["attention_mask"].bool())
    td.set(KEYS.action, action)
    td.set(KEYS.mask, agent)
    if response_mask:
        td.set(KEYS.response_mask, agent | obs)
    td.set(KEYS.reward, rewards.unsqueeze(-1))
    td.set(KEYS.task_reward, rewards.unsqueeze(-1).clone())
    td.set(KEYS.done, done.unsqueeze(-1))
    td.set(KEYS.terminated, (done & ~cut[:, None]).unsqueeze(-1))
    td.set(KEYS.truncated, (done & cut[:, None]).unsqueeze(-1))
    td.set(KEYS.turns, ends.sum(1))
    td.set(KEYS.end_reason, torch.where(cut, END_REASONS.index("length"), END_REASONS.index("done")))
    return td


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view({torch.float64: torch.int64, torch.float32: torch.int32}[x.dtype])


def flat(td, key) -> torch.Tensor:
    x = td.get(key)
    return x.squeeze(-1) if x.dim() == 3 else x


def compacted_gae(rewards, values, mask, gamma, lam):
    """GAE on each row's agent tokens taken in order as a plain list, written back to their positions."""
    adv = torch.zeros(mask.shape, dtype=torch.float64)
    for i in range(mask.shape[0]):
        positions = torch.nonzero(mask[i]).flatten().tolist()
        r = [float(rewards[i, j]) for j in positions]
        v = [float(values[i, j]) for j in positions] + [0.0]
        running = 0.0
        for k in reversed(range(len(positions))):
            running = r[k] + gamma * v[k + 1] - v[k] + gamma * lam * running
            adv[i, positions[k]] = running
    return adv, torch.where(mask, adv + values.double(), 0.0)


AGENT_NAMES = ("gae_ppo", "grpo", "one_step_ppo")


def agent_with_values(tok, name: str, **options):
    """``make_agent``, its zero-initialised value head set to seeded random weights (values that differ)."""
    agent = make_agent(tok, name, **options)
    if agent.critic is not None:
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            head = agent.critic.value_head
            head.weight.copy_(torch.randn(head.weight.shape, generator=g))
            head.bias.fill_(0.1)
    return agent


# -- the rollout checks ----------------------------------------------------------------------
def test_a_multiturn_rollout_passes_the_checks(tok):
    td = multiturn_rollout(tok)
    assert check_rollout(td) is td
    assert td.get(KEYS.truncated).squeeze(-1).any(1).tolist() == [False, True, False, False]


def _broken(tok, key, fn):
    td = multiturn_rollout(tok)
    td.set(key, fn(td.get(key).clone()))
    return td


def _set(x, index, value):
    x[index] = value
    return x


@pytest.mark.parametrize(
    ("key", "fn", "message"),
    [
        (KEYS.mask, lambda m: _set(m, (0, 8), True),
         r"\('collector', 'mask'\) is True where \('masks', 'response'\) is False in rows \[0\]"),
        (KEYS.response_mask, lambda m: _set(m, (2, 7), True), r"\('masks', 'response'\) is not a prefix .*rows \[2\]"),
        (KEYS.response_mask, lambda m: m.long(), r"\('masks', 'response'\) has dtype torch.int64"),
        (KEYS.response_mask, lambda m: m.unsqueeze(-1), r"\('masks', 'response'\) has shape \(4, 10, 1\)"),
        (KEYS.mask, lambda m: _set(m, 1, False), r"\('collector', 'mask'\) has rows with no valid token: \[1\]"),
        (KEYS.done, lambda d: _set(_set(d, (0, 6, 0), False), (0, 4, 0), True),
         r"\('next', 'done'\) is not at the last valid token .*rows \[0\]"),
        (KEYS.task_reward, lambda r: r.squeeze(-1), r"\('next', 'task_reward'\) has shape \(4, 10\).*unsqueeze"),
        (KEYS.task_reward, lambda r: r.long(), r"\('next', 'task_reward'\) has dtype torch.int64"),
        (KEYS.task_reward, lambda r: _set(r, (3, 3, 0), 1.0), r"\('next', 'task_reward'\) is non-zero off the agent mask .*rows \[3\]"),
        (KEYS.turns, lambda n: n.int(), r"\('episode', 'turns'\) must be int64 \[B\]"),
        (KEYS.turns, lambda n: _set(n, 2, 0), r"\('episode', 'turns'\) must be >= 1; rows \[2\]"),
        (KEYS.end_reason, lambda e: e.unsqueeze(-1), r"\('episode', 'end'\) must be int64 \[B\] = \(4,\)"),
        (KEYS.end_reason, lambda e: _set(e, 1, len(END_REASONS)), rf"\('episode', 'end'\) must be in range\({len(END_REASONS)}\).*rows \[1\]"),
    ],
)
def test_broken_multiturn_rollouts_are_named(tok, key, fn, message):
    with pytest.raises(RolloutError, match=message):
        check_rollout(_broken(tok, key, fn))


def test_without_a_response_mask_the_agent_mask_must_be_a_prefix(tok):
    with pytest.raises(RolloutError, match=r"\('collector', 'mask'\) is not a prefix of Trues in rows \[0, 1, 3\]"):
        check_rollout(multiturn_rollout(tok, response_mask=False))


# -- the estimators --------------------------------------------------------------------------
@pytest.mark.parametrize("name", (*AGENT_NAMES, "multi_adapter_ppo"))
def test_observation_tokens_get_no_advantage_reward_or_value_target(tok, name):
    agent = agent_with_values(tok, name, kl_coef=0.1)
    td = check_rollout(agent.process_rollout(multiturn_rollout(tok)))
    off = ~td.get(KEYS.mask)
    keys = [KEYS.advantage, KEYS.value_target]
    keys += [KEYS.reward] if name != "one_step_ppo" else []
    keys += [KEYS.state_value, KEYS.next_state_value] if agent.critic is not None else []
    for key in keys:
        assert torch.equal(flat(td, key)[off], torch.zeros(int(off.sum()))), key
    assert (flat(td, KEYS.advantage)[~off] != 0).all()


def test_gae_ppo_is_gae_over_the_compacted_agent_tokens(tok):
    agent = agent_with_values(tok, "gae_ppo", kl_coef=0.1, gamma=0.9, lam=0.8, whiten_advantages=False)
    td = agent.process_rollout(multiturn_rollout(tok))
    mask = td.get(KEYS.mask)
    task = flat(td, KEYS.task_reward)
    kl = td.get(KEYS.action_log_prob) - td.get(KEYS.ref_log_prob)  # k1
    reward = flat(td, KEYS.reward)
    # every agent token pays -beta * KL; each turn's reward stays on that turn's last agent token
    torch.testing.assert_close(reward[mask], (task - 0.1 * kl)[mask])
    ends = turn_ends(mask)
    torch.testing.assert_close((reward + 0.1 * kl)[ends], task[ends])
    assert (task[ends] != 0).all() and (task[~ends] == 0).all() and ends.sum(1).tolist() == [2, 2, 1, 3]
    values = flat(td, KEYS.state_value)
    for i, j in torch.nonzero(mask).tolist():  # V(s_t+1) is V at the next agent token, 0 after the last
        later = torch.nonzero(mask[i, j + 1:]).flatten()
        want = values[i, j + 1 + int(later[0])] if later.numel() else torch.tensor(0.0)
        assert flat(td, KEYS.next_state_value)[i, j] == want
    adv, ret = compacted_gae(reward, values, mask, 0.9, 0.8)
    # float32 against a float64 loop: within the float32 sums' bound (tests/arithmetic.py)
    adv_tol, ret_tol = gae_tolerance(reward, values, mask, 0.9, 0.8)
    assert_within(flat(td, KEYS.advantage), adv.float(), adv_tol, "advantages")
    assert_within(flat(td, KEYS.value_target), ret.float(), ret_tol, "returns")


def test_grpo_gives_each_agent_token_its_group_advantage(tok):
    agent = make_agent(tok, "grpo", kl_coef=0.1)
    td = agent.process_rollout(multiturn_rollout(tok))
    mask = td.get(KEYS.mask)
    kl = torch.where(mask, td.get(KEYS.action_log_prob) - td.get(KEYS.ref_log_prob), 0.0)
    sequence_reward = flat(td, KEYS.task_reward).sum(1) - 0.1 * kl.sum(1)  # [B]
    s = sequence_reward.view(2, 2)
    want = ((s - s.mean(1, keepdim=True)) / (s.std(1, keepdim=True) + 1e-6)).view(-1)
    adv = flat(td, KEYS.advantage)
    for i in range(4):
        torch.testing.assert_close(adv[i][mask[i]], want[i].expand(int(mask[i].sum())), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(td.get(SCORE), flat(td, KEYS.task_reward).sum(1))


def test_one_step_ppo_reads_v_at_the_last_agent_token(tok):
    td = multiturn_rollout(tok)
    agent = agent_with_values(tok, "one_step_ppo")
    td = agent.process_rollout(td)
    mask = td.get(KEYS.mask)
    values = flat(td, KEYS.state_value)
    last = torch.tensor([6, 6, 4, 9])  # "aaEooaE...", "Eoooaaa...", "aaaaE.....", "aEooEoaaaE"
    want = td.get(SCORE) - values[torch.arange(4), last]
    adv = flat(td, KEYS.advantage)
    for i in range(4):
        assert torch.equal(adv[i][mask[i]], want[i].expand(int(mask[i].sum())))


def test_processing_twice_does_not_shape_twice(tok):
    agent = make_agent(tok, "gae_ppo", kl_coef=0.1)
    td = multiturn_rollout(tok)
    td.exclude(KEYS.task_reward, inplace=True)  # a collector that wrote only ("next","reward")
    placed = flat(td, KEYS.reward).clone()
    first = agent.process_rollout(td).clone()
    assert torch.equal(flat(first, KEYS.task_reward), placed)
    second = agent.process_rollout(td)
    for key in (KEYS.reward, KEYS.advantage, KEYS.value_target, KEYS.task_reward, SCORE):
        assert torch.equal(second.get(key), first.get(key)), key


# -- the losses ------------------------------------------------------------------------------
LOSS_OPTIONS = {
    "gae_ppo": dict(kl_coef=0.1, entropy_coef=0.01),
    "grpo": dict(kl_coef=0.1, kl_in="loss", kl_kind="k3", entropy_coef=0.01),
    "one_step_ppo": dict(kl_coef=0.1),
}


@pytest.mark.parametrize("name", AGENT_NAMES)
def test_observation_log_probs_and_values_change_no_estimate_and_no_update(tok, name):
    """Two identical agents on one rollout; in the second copy the observation positions of the
    behaviour / reference log-probs and values are garbage. Estimates, update metrics and the
    updated weights must be the same, bit for bit."""
    options = dict(LOSS_OPTIONS[name], ppo_epochs=2, num_minibatches=2, actor_lr=1e-2)
    agents = [agent_with_values(tok, name, **options) for _ in range(2)]
    clean = agents[0].process_rollout(multiturn_rollout(tok))
    dirty = agents[1].process_rollout(multiturn_rollout(tok))
    obs = ~clean.get(KEYS.mask)
    for key, garbage in ((KEYS.action_log_prob, float("nan")), (KEYS.ref_log_prob, 7.0),
                         (KEYS.state_value, float("inf"))):
        if key in dirty.keys(include_nested=True):
            x = dirty.get(key).clone()
            x[obs] = garbage
            dirty.set(key, x)
    agents[1].estimate(dirty)
    for key in (KEYS.advantage, KEYS.value_target, KEYS.reward):
        if key in clean.keys(include_nested=True):
            assert torch.equal(bits(clean.get(key)), bits(dirty.get(key))), key
    metrics = []
    for agent, td in zip(agents, (clean, dirty)):
        torch.manual_seed(0)
        metrics.append(agent.update(td))
    assert metrics[0].keys() == metrics[1].keys()
    for k, v in metrics[0].items():  # NaN (an undefined explained variance) equals NaN here
        assert v == metrics[1][k] or (math.isnan(v) and math.isnan(metrics[1][k])), k
    assert metrics[0]["nonfinite/skipped_updates"] == 0.0
    for p, q in zip(agents[0].parameters(), agents[1].parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("name", ("gae_ppo", "grpo"))
def test_entropy_and_kl_in_the_loss_count_only_agent_tokens(tok, name):
    agent = make_agent(tok, name, **LOSS_OPTIONS[name])
    td = agent.process_rollout(multiturn_rollout(tok))
    mask = td.get(KEYS.mask)
    _, stats = agent.loss(td)
    with torch.no_grad():
        logp, entropy = forward_policy(agent, td)
    torch.testing.assert_close(stats["entropy"], entropy[mask].mean())
    if name == "grpo":  # k3 in the loss, over the agent tokens only
        log_r = td.get(KEYS.ref_log_prob) - logp
        k3 = torch.expm1(log_r) - log_r
        torch.testing.assert_close(stats["loss/kl"], 0.1 * k3[mask].mean())


# -- the forwards ----------------------------------------------------------------------------
def test_forwards_attend_to_the_observation_tokens(tok):
    agent = agent_with_values(tok, "gae_ppo")
    td = multiturn_rollout(tok)
    _, attention, p = sequence_inputs(td)
    assert torch.equal(attention, torch.cat([td.get(KEYS.prompt_mask), td.get(KEYS.response_mask)], dim=1))
    before = agent.evaluate(td)
    changed = td.clone()
    action = changed.get(KEYS.action)
    action[0, 3] = (action[0, 3] + 1) % 500  # row 0: "aaEooaE...", an observation token
    after = agent.evaluate(changed)
    for key in (KEYS.action_log_prob, KEYS.ref_log_prob, KEYS.state_value):
        x, y = flat(before, key), flat(after, key)
        assert torch.equal(x[0, :3], y[0, :3]) and torch.equal(x[1:], y[1:]), key  # causal: nothing earlier moves
        assert (x[0, 5:7] != y[0, 5:7]).all(), key  # the agent's next turn sees the observation


def test_log_probs_equal_a_plain_forward_of_the_whole_episode(tok):
    """Row by row without padding: prompt, then every token of the episode (observations included)."""
    agent = make_agent(tok, "gae_ppo")
    td = multiturn_rollout(tok)
    logp = agent.evaluate(td).get(KEYS.action_log_prob)
    mask, response = td.get(KEYS.mask), td.get(KEYS.response_mask)
    for i in range(4):
        prompt = td.get(KEYS.prompt_tokens)[i][td.get(KEYS.prompt_mask)[i]]
        tokens = td.get(KEYS.action)[i][response[i]]
        ids = torch.cat([prompt, tokens]).unsqueeze(0)
        with torch.no_grad():
            logits = agent.policy(input_ids=ids).logits[0, prompt.numel() - 1 : -1]
        want = torch.log_softmax(logits.float(), -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        # a padded batch against one row: other shapes, other sums (tests/arithmetic.py)
        rtol = rollout_rtol(agent.policy.config, td)
        assert_close_normwise(logp[i][mask[i]], want[mask[i][response[i]]], rtol=rtol, name=f"row {i}")


# -- single turn: exactly as before ----------------------------------------------------------
def single_turn_rollout(agent, tok, placement):
    enc = tok(list(PROMPTS), return_tensors="pt", padding=True)
    eos, pad = tok.eos_token_id, tok.pad_token_id
    responses = torch.tensor([[40, 41, eos, pad, pad, pad], [50, 51, 52, 53, 54, 55],
                              [eos, pad, pad, pad, pad, pad], [60, 61, 62, 63, eos, pad]])

    def reward(prompts, completions, completion_ids=None, **kwargs):
        return torch.tensor([0.3, -0.2, 1.0, 0.5])

    td = rollout_from_responses(
        enc["input_ids"], enc["attention_mask"].bool(), responses, tokenizer=tok, reward_fn=reward,
        eos_token_id=eos, pad_token_id=pad, max_new_tokens=6, reward_placement=placement,
    )
    return agent.process_rollout(td)


@pytest.mark.parametrize("placement", ["last", "uniform"])
@pytest.mark.parametrize("name", ["gae_ppo", "grpo"])
def test_single_turn_estimates_are_bit_for_bit_the_old_formulas(tok, name, placement):
    agent = agent_with_values(tok, name, kl_coef=0.1, reward_placement=placement)
    td = single_turn_rollout(agent, tok, placement)
    mask = td.get(KEYS.mask)
    kl = agent.token_kl(td.get(KEYS.action_log_prob), td) if name == "gae_ppo" else \
        td.get(KEYS.action_log_prob) - td.get(KEYS.ref_log_prob)
    rewards = kl_shaped_rewards(td.get(SCORE), kl, mask, 0.1, placement)  # the pre-multi-turn shaping
    assert torch.equal(flat(td, KEYS.reward), rewards)
    if name == "grpo":
        sequence_reward = torch.where(mask, rewards, 0.0).sum(1)
        assert torch.equal(bits(flat(td, KEYS.value_target)), bits(torch.where(mask, sequence_reward[:, None], 0.0)))
        return
    values = flat(td, KEYS.state_value)
    next_mask = torch.cat([mask[:, 1:], torch.zeros_like(mask[:, :1])], dim=1)
    assert torch.equal(bits(flat(td, KEYS.next_state_value)), bits(torch.where(next_mask, values.roll(-1, 1), 0.0)))
    assert torch.equal(bits(next_valid(values, mask)), bits(flat(td, KEYS.next_state_value)))
    adv, ret = gae(rewards, values, mask, gamma=agent.config.gamma, lam=agent.config.lam)
    assert torch.equal(bits(flat(td, KEYS.value_target)), bits(ret))
    assert torch.equal(bits(flat(td, KEYS.advantage)), bits(masked_whiten(adv, mask)))


# -- pad == eos ------------------------------------------------------------------------------
def test_pad_equal_to_eos_keeps_the_eos_in_the_mask_single_turn(eos_pad_tok):
    agent = agent_with_values(eos_pad_tok, "gae_ppo")
    assert agent.pad_token_id == agent.eos_token_id
    td = single_turn_rollout(agent, eos_pad_tok, "last")
    mask = td.get(KEYS.mask)
    assert mask[0].tolist() == [True, True, True, False, False, False]  # the EOS at 2 stays, pads go
    assert mask[2].tolist() == [True] + [False] * 5
    _, attention, p = sequence_inputs(td)
    assert torch.equal(attention[:, p:], mask)
    adv = flat(td, KEYS.advantage)
    assert adv[0, 2] != 0 and adv[2, 0] != 0 and (adv[~mask] == 0).all()
    _, stats = agent.loss(td)
    td.set(KEYS.action_log_prob, torch.where(td.get(KEYS.action) == agent.eos_token_id, -50.0,
                                             td.get(KEYS.action_log_prob)))
    _, moved = agent.loss(td)
    assert moved["loss/policy"] != stats["loss/policy"]  # the EOS positions are trained on


def test_pad_equal_to_eos_keeps_each_turns_eos_multi_turn(eos_pad_tok):
    agent = agent_with_values(eos_pad_tok, "gae_ppo")
    td = multiturn_rollout(eos_pad_tok, pad_id=eos_pad_tok.eos_token_id)
    action, mask = td.get(KEYS.action), td.get(KEYS.mask)
    is_eos = action == agent.eos_token_id
    assert (is_eos & mask).sum(1).tolist() == [2, 1, 1, 3]  # each turn's EOS ...
    assert (is_eos & ~td.get(KEYS.response_mask)).any()  # ... while padding is EOS too
    td = check_rollout(agent.process_rollout(td))
    adv = flat(td, KEYS.advantage)
    assert (adv[is_eos & mask] != 0).all() and (adv[~mask] == 0).all()
    metrics = agent.update(td)
    assert metrics["nonfinite/skipped_updates"] == 0.0


# -- with the collector ----------------------------------------------------------------------
@pytest.mark.parametrize("name", AGENT_NAMES)
def test_a_collected_multiturn_rollout_is_processed_and_trained(tok, name):
    """textrl/envs/collector.py's rollout of a two-turn environment (scripted turns), through each agent."""
    from tests.envs.test_collector import Echo, batch_of, scripted
    from textrl.envs.collector import EpisodeRunner

    env = Echo(max_turns=2)
    rows = [env.rows()[0], env.rows()[0], env.rows()[1], env.rows()[1]]  # grpo: two groups of two
    gen = scripted(tok, [["cat", "cat"], ["no", "cat"], ["dog", "x"], ["dog", "dog"]])
    td = EpisodeRunner(env, tokenizer=tok, max_new_tokens=8, max_episode_tokens=200).run(gen, batch_of(tok, rows))
    mask, response = td.get(KEYS.mask), td.get(KEYS.response_mask)
    assert (response & ~mask).any(1).all()  # every row has observation tokens between its turns
    placed = flat(td, KEYS.reward).clone()
    agent = agent_with_values(tok, name, kl_coef=0.1)
    td = check_rollout(agent.process_rollout(td))
    assert torch.equal(flat(td, KEYS.task_reward), placed)
    assert (flat(td, KEYS.advantage)[~mask] == 0).all() and (flat(td, KEYS.advantage)[mask] != 0).all()
    assert agent.update(td)["nonfinite/skipped_updates"] == 0.0
