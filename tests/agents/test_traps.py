"""PPO-for-LM correctness traps and numerical faults, each with a test (docs/reliability.md, "PPO correctness traps").

Covered elsewhere and not repeated here: ratio exactly 1 and clip fraction 0 on the first
minibatch, and bit-identical parameters with learning rate 0 (``test_agents.py``); gradient
accumulation over uneven micro-batches equals the full minibatch (``test_options.py``); the
score on the last valid token for both placements (``test_options.py``); GRPO's constant group
(``tests/functional/test_advantages.py``); k3 at a log-ratio of +-100 in fp16/bf16/fp32
(``tests/functional/test_kl.py``); whitening over one or no valid token
(``tests/functional/test_masking.py``); a reward model scoring text with its own tokenizer
(``tests/rewards/test_neural.py``).
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.agents.conftest import PROMPTS, collect, make_agent
from tests.arithmetic import model_rtol
from tests.rewards.test_neural import char_tokenizer
from textrl.agents import forwards
from textrl.agents.forwards import sequence_inputs
from textrl.envs import rollout_from_responses
from textrl.functional import clipped_policy_loss, grpo_advantage, rloo_advantage
from textrl.keys import KEYS
from textrl.models import ValueModel, build_tiny_causal_lm, build_tiny_gpt2, build_tiny_reward_model
from textrl.rewards import NeuralReward
from textrl.testing import assert_close_normwise

NAMES = ["gae_ppo", "one_step_ppo"]


def weights(agent):
    return {k: v.detach().clone() for k, v in agent.state_dict().items() if torch.is_tensor(v)}


def unchanged(agent, before) -> bool:
    return all(torch.equal(v, agent.state_dict()[k]) for k, v in before.items())


# -- numerical faults: the update is skipped, counted, and the weights stay ------------------------


def _nan_logits(agent, td, monkeypatch):
    logits = forwards.Forwards.response_logits
    monkeypatch.setattr(forwards.Forwards, "response_logits", lambda *args: logits(*args) * math.nan)


def _nan_values(agent, td, monkeypatch):
    values = forwards.forward_values
    monkeypatch.setattr(forwards, "forward_values", lambda agent, mb: values(agent, mb) * math.nan)


def _inf_loss(agent, td, monkeypatch):
    loss = agent.loss
    agent.loss = lambda mb: (loss(mb)[0] * math.inf, loss(mb)[1])


def _inf_gradient(agent, td, monkeypatch):
    next(agent.policy.parameters()).register_hook(lambda grad: grad * math.inf)


def _poison(key):
    def inject(agent, td, monkeypatch):
        x = td.get(key).clone()
        x[0, 0] = math.nan
        td.set(key, x)

    return inject


MINIBATCH_FAULTS = {"logits": _nan_logits, "values": _nan_values, "loss": _inf_loss, "gradient": _inf_gradient}
ROLLOUT_FAULTS = {"log_probs": _poison(KEYS.action_log_prob), "advantages": _poison(KEYS.advantage)}


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("fault", [*MINIBATCH_FAULTS, *ROLLOUT_FAULTS])
def test_a_nonfinite_update_is_skipped_counted_and_leaves_the_weights(tok, name, fault, monkeypatch):
    agent = make_agent(tok, name, ppo_epochs=2, num_minibatches=2, max_nonfinite_updates=100)
    td = collect(agent, tok)
    before = weights(agent)
    {**MINIBATCH_FAULTS, **ROLLOUT_FAULTS}[fault](agent, td, monkeypatch)
    metrics = agent.update(td)
    assert unchanged(agent, before)
    assert all(not o.state for o in agent.optimizers)  # no Adam moments either
    assert all(s.last_epoch == 0 for s in agent.schedulers)
    skipped = 4 if fault in MINIBATCH_FAULTS else 1  # 2 epochs x 2 minibatches, or the whole rollout
    assert metrics["nonfinite/skipped_updates"] == skipped == agent.nonfinite_streak
    assert all(math.isfinite(v) for k, v in metrics.items() if k.startswith(("loss/", "grad_norm/")))


def test_the_streak_stops_the_update_at_the_maximum_and_a_good_step_resets_it(tok):
    agent = make_agent(tok, ppo_epochs=3, num_minibatches=2, max_nonfinite_updates=2)
    td = collect(agent, tok)
    loss, calls = agent.loss, []

    def first_two_fail(mb):
        calls.append(1)
        value, stats = loss(mb)
        return (value * math.nan if len(calls) <= 2 else value), stats

    agent.loss = first_two_fail
    metrics = agent.update(td)
    assert len(calls) == 2 and metrics["nonfinite/skipped_updates"] == 2 == agent.nonfinite_streak
    agent.nonfinite_streak = 1
    metrics = agent.update(td)  # every loss is finite now
    assert agent.nonfinite_streak == 0 and metrics["nonfinite/skipped_updates"] == 0


def test_rows_dropped_for_a_nan_reward_leave_uneven_minibatches_that_still_update(tok):
    agent = make_agent(tok, num_minibatches=2, gradient_accumulation_steps=2, actor_lr=1e-2)
    td = collect(agent, tok)[:3]  # 4 rows, one dropped by reward_nonfinite='drop'
    before = weights(agent)
    metrics = agent.update(td)
    assert not unchanged(agent, before) and math.isfinite(metrics["loss/total"])


# -- sampling distribution: evaluate() sees what generate() sampled from ---------------------------


@pytest.mark.parametrize(
    "sampling",
    [dict(temperature=0.7, top_k=20, top_p=0.9), dict(temperature=1.3, top_k=0, top_p=1.0)],
    ids=["t0.7-k20-p0.9", "t1.3"],
)
def test_the_check_reproduces_the_sampler_and_policy_equal_reference_has_zero_kl(tok, sampling):
    agent = make_agent(tok, max_new_tokens=8, generation_engine="hf", **sampling)  # generate's processed scores
    agent.ref_policy = build_tiny_causal_lm(tok, seed=0).eval()  # an independent copy of the policy
    scores, generate = [], agent.policy.generate

    def recording_generate(**kwargs):  # the processed (temperature / top-k / top-p) logits
        out = generate(**kwargs, output_scores=True, return_dict_in_generate=True)
        scores.append(torch.stack(out.scores, dim=1))  # [b, T, V]
        return out.sequences

    agent.policy.generate = recording_generate
    prompts = PROMPTS * 8
    enc = tok(prompts, return_tensors="pt", padding=True)
    torch.manual_seed(0)
    responses = agent.act(enc["input_ids"], enc["attention_mask"].bool())
    td = rollout_from_responses(
        enc["input_ids"], enc["attention_mask"].bool(), responses, tokenizer=tok,
        reward_fn=lambda p, c, **kw: torch.zeros(len(c)), eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, max_new_tokens=8,
    )
    t = responses.shape[1]
    sampler_logp = torch.cat([s[:, :t].log_softmax(-1) for s in scores]).gather(-1, responses.unsqueeze(-1))
    mask = td.get(KEYS.mask)
    out = agent.evaluate(td)
    # one prefill against a decode step by step on a KV cache: other kernels, other sums (tests/arithmetic.py)
    rtol = model_rtol(agent.policy.config, enc["input_ids"].numel() + responses.numel())
    # the engine's distribution, reproduced by the weight check's prefill (temperature, top-k, top-p)
    input_ids, attention_mask, p = sequence_inputs(td)
    filtered = agent.learner.forwards.filtered_logprobs(agent.policy, input_ids, attention_mask, p, responses)
    assert_close_normwise(filtered[mask], sampler_logp.squeeze(-1)[mask], rtol=rtol, name="logp")
    # the learner's (and the reference's) log-probs are the policy's at the temperature, no filter: the
    # sampler's exceed them by -log(the nucleus's mass) >= 0, equal without a filter
    learner = out.get(KEYS.action_log_prob)
    assert bool(torch.isfinite(learner[mask]).all()) and bool(torch.isfinite(out.get(KEYS.ref_log_prob)[mask]).all())
    lifted = (sampler_logp.squeeze(-1) - learner)[mask]
    assert float(lifted.min()) > -1e-4
    if sampling["top_k"] == 0 and sampling["top_p"] == 1.0:
        assert_close_normwise(learner[mask], sampler_logp.squeeze(-1)[mask], rtol=rtol, name="logp")
    # a ~ sampler, so E[log pi - log ref] = 0 for a reference equal to the policy: KL(pi || ref) = 0
    k1 = (learner - out.get(KEYS.ref_log_prob))[mask]
    assert k1.numel() > 100
    assert abs(k1.mean().item()) <= 3 * k1.std().item() / math.sqrt(k1.numel()) + 1e-6


# -- left padding on an absolute-position model ----------------------------------------------------


def test_a_row_scores_the_same_alone_and_inside_a_left_padded_batch_on_gpt2(tok):
    policy = build_tiny_gpt2(tok, seed=1)
    critic = ValueModel.from_causal_lm(policy)
    torch.nn.init.normal_(critic.value_head.weight, std=0.5)  # a zero head would hide a difference
    agent = make_agent(tok, max_new_tokens=4)
    agent.policy, agent.ref_policy, agent.critic = policy, build_tiny_gpt2(tok, seed=2), critic
    eos = tok.eos_token_id
    prompts = ["hi", "Count to three, then stop, and say done at the end"]
    responses = torch.tensor([[40, 41, 42, eos], [43, 44, eos, tok.pad_token_id]])

    def evaluated(rows):
        enc = tok([prompts[i] for i in rows], return_tensors="pt", padding=True)
        td = rollout_from_responses(
            enc["input_ids"], enc["attention_mask"].bool(), responses[rows], tokenizer=tok,
            reward_fn=lambda p, c, **kw: torch.zeros(len(c)), eos_token_id=eos,
            pad_token_id=tok.pad_token_id, max_new_tokens=4,
        )
        return enc, agent.evaluate(td)

    enc, batch = evaluated([0, 1])
    assert not enc["attention_mask"][0].all()  # row 0 really is left-padded
    _, alone = evaluated([0])
    rtol = model_rtol(policy.config, enc["input_ids"].numel() + responses.numel())  # tests/arithmetic.py
    for key in (KEYS.action_log_prob, KEYS.ref_log_prob, KEYS.state_value):
        assert_close_normwise(batch.get(key)[0], alone.get(key)[0], rtol=rtol, name=str(key))
    greedy = agent.act(enc["input_ids"], enc["attention_mask"].bool(), greedy=True)
    one = tok([prompts[0]], return_tensors="pt")
    assert torch.equal(agent.act(one["input_ids"], one["attention_mask"].bool(), greedy=True)[0], greedy[0, :4])


# -- reward index and truncation -------------------------------------------------------------------


def test_the_score_sits_at_mask_sum_minus_one_and_a_truncated_row_gets_no_fake_eos(tok):
    eos, pad = tok.eos_token_id, tok.pad_token_id
    enc = tok(PROMPTS[:2], return_tensors="pt", padding=True)
    responses = torch.tensor([[40, eos, pad, pad], [41, 42, 43, 44]])  # ends with EOS; truncated
    td = rollout_from_responses(
        enc["input_ids"], enc["attention_mask"].bool(), responses, tokenizer=tok,
        reward_fn=lambda p, c, **kw: torch.tensor([2.0, 3.0]), eos_token_id=eos, pad_token_id=pad,
        max_new_tokens=4,
    )
    mask, reward = td.get(KEYS.mask), td.get(KEYS.reward).squeeze(-1)
    last = mask.sum(1) - 1
    assert last.tolist() == [1, 3]
    expected = torch.zeros(2, 4)
    expected[0, 1], expected[1, 3] = 2.0, 3.0
    assert torch.equal(reward, expected)
    assert torch.equal(td.get(KEYS.action)[1], responses[1]) and eos not in td.get(KEYS.action)[1]
    assert td.get(KEYS.truncated).squeeze(-1)[1].tolist() == [False, False, False, True]
    assert not td.get(KEYS.terminated)[1].any()
    agent = make_agent(tok, max_new_tokens=3, top_k=1)  # greedy-like sampling, rarely EOS: truncated rows
    out = agent.act(enc["input_ids"], enc["attention_mask"].bool())
    no_eos = ~(out == eos).any(1)
    assert out.shape[1] <= 3 and (out[no_eos].shape[1] == 3 if no_eos.any() else True)


# -- a reward model with its own tokenizer ---------------------------------------------------------


def test_reward_model_needs_its_own_tokenizer_and_scores_the_policys_text(tok):
    rm = build_tiny_reward_model(tok, seed=3)
    with pytest.raises(ValueError, match="no reward tokenizer; pass the reward model's own tokenizer"):
        NeuralReward(rm, None)
    policy_tok = char_tokenizer()  # a policy tokenizer with another vocabulary
    with pytest.raises(ValueError, match="this tokenizer belongs to another model"):
        NeuralReward(rm, policy_tok)
    reward = NeuralReward(rm, tok)
    texts = ["<think>\nadd\n</think>\n<answer>\n4\n</answer>", "no idea"]
    ids = [policy_tok.encode(t, add_special_tokens=False) + [policy_tok.eos_token_id] for t in texts]
    width = max(map(len, ids))
    responses = torch.tensor([row + [policy_tok.pad_token_id] * (width - len(row)) for row in ids])
    prompt = policy_tok(["2+2?", "2+2?"], return_tensors="pt")
    td = rollout_from_responses(
        prompt["input_ids"], prompt["attention_mask"].bool(), responses, tokenizer=policy_tok,
        reward_fn=reward, eos_token_id=policy_tok.eos_token_id, pad_token_id=policy_tok.pad_token_id,
        max_new_tokens=width, prompt_texts=["2+2?", "2+2?"],
    )
    direct = reward(["2+2?", "2+2?"], texts)
    torch.testing.assert_close(td.get(KEYS.reward).squeeze(-1).sum(1), direct)


# -- group baselines -------------------------------------------------------------------------------


@pytest.mark.parametrize("estimator", [grpo_advantage, rloo_advantage])
def test_a_constant_reward_group_gives_zero_advantages_and_a_finite_loss(estimator):
    scores = torch.tensor([0.7, 0.7, 0.7, 0.7, 1.0, 0.0, 1.0, 0.0])  # group 0 is constant
    advantages = estimator(scores, group_size=4)
    assert torch.equal(advantages[:4], torch.zeros(4)) and advantages[4:].abs().min() > 0
    logp = torch.randn(8, 5, generator=torch.Generator().manual_seed(0)).requires_grad_()
    mask = torch.ones(8, 5, dtype=torch.bool)
    loss, stats = clipped_policy_loss(logp, logp.detach(), advantages.unsqueeze(1).expand(8, 5), mask)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert torch.equal(logp.grad[:4], torch.zeros(4, 5))  # the constant group teaches nothing
