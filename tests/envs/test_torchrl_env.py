"""TextGenEnv: TorchRL specs, seeding, equality with the fast path, model-backed rollouts."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torchrl.envs.utils import check_env_specs

from tests.envs.test_fast_path import EOS, draw_responses, pad_eq_eos_tokenizer, prompt_batch
from textrl.envs import TextGenEnv, rollout_from_responses
from textrl.envs.fast_path import default_tokenizer
from textrl.keys import KEYS
from textrl.models import build_tiny_causal_lm


def test_check_env_specs():
    check_env_specs(TextGenEnv(3, max_new_tokens=4, seed=0))
    check_env_specs(TextGenEnv(2, max_new_tokens=2, seed=0), break_when_any_done="both")


def test_seeded_reset_is_deterministic():
    a, b = TextGenEnv(4, seed=0), TextGenEnv(4, seed=1)
    b.set_seed(0)
    ta, tb = a.reset(), b.reset()
    assert torch.equal(ta["prompt_ids"], tb["prompt_ids"])
    a.set_seed(5)
    assert not torch.equal(a.reset()["prompt_ids"], ta["prompt_ids"])


def _step_all(env: TextGenEnv, responses: torch.Tensor):
    """Reset rows on prompts 0..B-1 and feed ``responses[:, j]`` at step j until all are done."""
    b, t = responses.shape
    td = env.reset(TensorDict({"prompt_index": torch.arange(b)}, batch_size=[b]))
    rewards, done, term, trunc = (torch.zeros(b, t) for _ in range(4))
    components = {}
    for j in range(t):
        td["action"] = responses[:, j]
        td = env.step(td)
        nxt = td["next"]
        rewards[:, j] = nxt["reward"].squeeze(-1)
        done[:, j] = nxt["done"].squeeze(-1).float()
        term[:, j] = nxt["terminated"].squeeze(-1).float()
        trunc[:, j] = nxt["truncated"].squeeze(-1).float()
        for name, value in nxt["reward_components"].items():
            components[name] = components.get(name, 0) + value
        td = nxt
    return rewards, done.bool(), term.bool(), trunc.bool(), components


@pytest.mark.parametrize("pad_is_eos", [False, True])
def test_stepping_equals_fast_path(pad_is_eos):
    tok = pad_eq_eos_tokenizer() if pad_is_eos else default_tokenizer()
    b, t = 10, 6
    env = TextGenEnv(b, tokenizer=tok, max_new_tokens=t, seed=0)
    responses = draw_responses(torch.Generator().manual_seed(3), b, t, tok.pad_token_id)
    rewards, done, term, trunc, components = _step_all(env, responses)
    ids, mask, texts, fields = prompt_batch(env.prompts, list(range(b)), tok.pad_token_id)
    fast = rollout_from_responses(
        ids,
        mask,
        responses,
        tokenizer=tok,
        reward_fn=env.reward_fn,
        eos_token_id=EOS,
        pad_token_id=tok.pad_token_id,
        max_new_tokens=t,
        fields=fields,
        prompt_texts=texts,
    )
    valid = fast[KEYS.mask]
    # finished rows stay done (and pay 0) afterwards; compare on valid tokens
    assert torch.equal(done & valid, fast[KEYS.done].squeeze(-1))
    assert torch.equal(term & valid, fast[KEYS.terminated].squeeze(-1))
    assert torch.equal(trunc & valid, fast[KEYS.truncated].squeeze(-1))
    assert torch.equal(rewards, fast[KEYS.reward].squeeze(-1))
    for name, score in fast[KEYS.reward_components].items():
        assert torch.equal(components[name], score)
    assert torch.equal(
        env.reset(TensorDict({"prompt_index": torch.arange(b)}, [b]))["prompt_ids"], ids
    )


def test_finished_rows_ignore_actions():
    env = TextGenEnv(2, max_new_tokens=3, seed=0)
    td = env.reset()
    td["action"] = torch.tensor([EOS, 7])
    td = env.step(td)["next"]
    assert td["done"].squeeze(-1).tolist() == [True, False]
    before = td["response_ids"][0].clone()
    td["action"] = torch.tensor([9, 8])
    nxt = env.step(td)["next"]
    assert torch.equal(nxt["response_ids"][0], before)
    assert nxt["reward"][0].item() == 0.0 and nxt["done"][0].item()
    assert nxt["response_length"].squeeze(-1).tolist() == [1, 2]


def test_out_of_vocab_action_raises():
    env = TextGenEnv(2, seed=0)
    td = env.reset()
    td["action"] = torch.tensor([5, 512])
    with pytest.raises(ValueError, match=r"action \[512\] in rows \[1\].*vocab_size=512"):
        env.step(td)


class NextTokenPolicy(torch.nn.Module):
    """Greedy (or sampled) next token of a causal LM on ``prompt + response so far``.

    Recomputes the whole prefix every step (no KV cache): the simplest correct policy.
    """

    def __init__(self, model: torch.nn.Module, sample: bool = False) -> None:
        super().__init__()
        self.model, self.sample = model, sample

    def forward(self, prompt_ids, prompt_mask, response_ids, response_length):
        p, t = prompt_ids.shape[1], response_ids.shape[1]
        length = response_length.squeeze(-1)  # [B]
        input_ids = torch.cat([prompt_ids, response_ids], 1)  # [B, P + T]
        resp_mask = torch.arange(t).unsqueeze(0) < length.unsqueeze(1)  # [B, T]
        attn = torch.cat([prompt_mask, resp_mask], 1)
        position_ids = (attn.long().cumsum(1) - 1).clamp(min=0)
        with torch.no_grad():
            logits = self.model(
                input_ids=input_ids, attention_mask=attn.long(), position_ids=position_ids
            ).logits  # [B, P + T, V]
        last = (p + length - 1).view(-1, 1, 1).expand(-1, 1, logits.shape[-1])
        next_logits = logits.gather(1, last).squeeze(1)  # [B, V]
        if self.sample:
            return torch.distributions.Categorical(logits=next_logits).sample()
        return next_logits.argmax(-1)


@pytest.mark.parametrize("sample", [False, True])
def test_rollout_with_model_policy(sample):
    tok = default_tokenizer()
    model = build_tiny_causal_lm(tok, seed=0).eval()
    policy = TensorDictModule(
        NextTokenPolicy(model, sample=sample),
        in_keys=["prompt_ids", "prompt_mask", "response_ids", "response_length"],
        out_keys=["action"],
    )
    env = TextGenEnv(3, tokenizer=tok, max_new_tokens=4, seed=0)
    torch.manual_seed(0)
    td = env.rollout(4, policy, break_when_any_done=False, break_when_all_done=True)
    assert td.batch_size[0] == 3 and td.batch_size[1] <= 4
    done = td["next", "done"].squeeze(-1)
    assert done[:, -1].all()
    first = done.float().argmax(1)  # a row's episode ends at its first done
    lengths = td["next", "response_length"].squeeze(-1)[torch.arange(3), first]
    assert (lengths == first + 1).all()
    # rows re-reset by a continuing rollout start from an empty response
    td = env.rollout(6, policy, break_when_any_done=False)
    assert td["next", "response_length"].max() <= 4


def test_greedy_env_rollout_equals_generate_fast_path():
    """DESIGN §1: the MDP stepped by a greedy policy and batched ``generate`` agree."""
    tok = default_tokenizer()
    model = build_tiny_causal_lm(tok, seed=0).eval()
    b, t = 3, 5
    env = TextGenEnv(b, tokenizer=tok, max_new_tokens=t, seed=0)
    td = env.reset(TensorDict({"prompt_index": torch.arange(b)}, [b]))
    policy = NextTokenPolicy(model)
    for _ in range(t):
        td["action"] = policy(
            td["prompt_ids"], td["prompt_mask"], td["response_ids"], td["response_length"]
        )
        td = env.step(td)["next"]
    stepped = td["response_ids"]
    generated = greedy_generate(model, env, tok, b, t)
    assert torch.equal(stepped, generated)
    assert (stepped != tok.pad_token_id).sum() > b  # not a trivial all-EOS-first batch


def greedy_generate(model, env, tok, b: int, t: int) -> torch.Tensor:
    """``model.generate`` (greedy) on the env's first ``b`` prompts, right-padded to ``[b, t]``."""
    ids, mask, _, _ = prompt_batch(env.prompts, list(range(b)), tok.pad_token_id)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask.long(),
            max_new_tokens=t,
            do_sample=False,
            eos_token_id=EOS,
            pad_token_id=tok.pad_token_id,
        )
    generated = out[:, ids.shape[1] :]
    return torch.cat([generated, torch.full((b, t - generated.shape[1]), tok.pad_token_id)], 1)


@pytest.mark.parametrize("bad", [0, -1, 2.5])
def test_both_envs_reject_a_bad_max_new_tokens(bad):
    from textrl.envs import TokenMDPEnv

    for make in (TokenMDPEnv, TextGenEnv):
        with pytest.raises(ValueError, match="max_new_tokens"):
            make(max_new_tokens=bad)
