"""A multi-turn turn cut by ``max_new_tokens`` reaches the environment, flagged truncated.

Before, such a turn ended the episode by ``length`` unanswered, so an untrained policy (whose turns
rarely end by EOS) got reward 0 from every multi-turn environment. Now the environment answers it
with ``episode.truncated`` True during ``step()``: the agent's tokens stay exactly what it sampled
(no EOS added to them), the observation follows with the template's end of turn, and the masks keep
the agent's tokens apart. The Gymnasium token MDP steps by the same rules.
"""

from __future__ import annotations

import pytest
import torch

from tests.envs.test_collector import scripted
from textrl.envs.collector import EpisodeRunner
from textrl.envs.environment import Environment, Turn
from textrl.envs.prompts import encode_prompts
from textrl.keys import END_REASONS, KEYS
from textrl.models import build_tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


class Game(Environment):
    """A turn cut by the cap is an invalid move: -0.5 and "too long"; a whole one wins (1, done)."""

    id = "cut_game"
    max_turns = 3

    def __init__(self):
        self.seen: list[tuple[int, bool, str]] = []

    def rows(self):
        return [{"prompt": "Move."}]

    def step(self, episode, completion):
        self.seen.append((episode.turn, episode.truncated, completion))
        if episode.truncated:
            return Turn(reward=-0.5, observation="too long, move again")
        return Turn(reward=1.0, done=True)


def test_a_cut_turn_is_answered_with_truncated_and_its_tokens_kept(tok):
    env = Game()
    batch = encode_prompts(env.rows(), tok)[0]
    long = "cat " * 10
    gen = scripted(tok, [[long, "dog"]], eos=[[False, True]], width=6)
    td = EpisodeRunner(env, tokenizer=tok, max_new_tokens=6, max_episode_tokens=200).run(gen, batch)
    cut_ids = tok(long, add_special_tokens=False)["input_ids"][:6]
    assert [(t, cut) for t, cut, _ in env.seen] == [(1, True), (2, False)]
    assert env.seen[0][2] == tok.decode(cut_ids, skip_special_tokens=True)
    action, agent = td.get(KEYS.action)[0], td.get(KEYS.mask)[0]
    assert action[:6].tolist() == cut_ids and agent[:6].all()  # exactly the sampled tokens
    assert action[6].item() == tok.eos_token_id and not agent[6]  # the template's end of turn: not the agent's
    assert td.get(KEYS.end_reason)[0].item() == END_REASONS.index("done")
    assert td.get(KEYS.terminated)[0].any() and not td.get(KEYS.truncated)[0].any()
    reward = td.get(KEYS.reward)[0, :, 0]
    assert reward[5].item() == -0.5 and reward.sum().item() == pytest.approx(0.5)
    assert not torch.equal(td.get(KEYS.mask), td.get(KEYS.response_mask))  # the observation is seen, not trained


def test_the_opt_out_ends_a_cut_episode_by_length_unanswered(tok):
    env = Game()
    env.answers_truncated_turns = False
    batch = encode_prompts(env.rows(), tok)[0]
    gen = scripted(tok, [["cat " * 10]], eos=[[False]], width=6)
    td = EpisodeRunner(env, tokenizer=tok, max_new_tokens=6, max_episode_tokens=200).run(gen, batch)
    assert env.seen == []
    assert td.get(KEYS.end_reason)[0].item() == END_REASONS.index("length")


def test_the_gymnasium_token_mdp_answers_a_cut_turn_too(tok):
    from textrl.envs.token_mdp import TokenMDPEnv

    env = Game()
    mdp = TokenMDPEnv(env=env, tokenizer=tok, max_new_tokens=3, max_episode_tokens=100)
    mdp.reset(seed=0)
    token = tok("cat", add_special_tokens=False)["input_ids"][0]
    for _ in range(3):
        _, reward, terminated, truncated, _ = mdp.step(token)
    assert env.seen and env.seen[0][:2] == (1, True)
    assert reward == -0.5 and not terminated and not truncated
