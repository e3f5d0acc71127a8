"""The actor and the learner (docs/design.md, "Actor and learner").

The actor makes rollouts (its engine chosen once, for the backend), the learner learns from them;
the weights go back through one call (``Actor.load_weights_from``) with a version counter, and
every rollout records the version that generated it and the log-probs the engine drew with, which
the update compares with its own (``rollout/staleness``, ``rollout/logprob_gap``).
"""

from __future__ import annotations

import ast
import copy
from pathlib import Path

import pytest
import torch

from tests.agents.conftest import make_agent, target_reward
from tests.envs.test_collector import Echo
from textrl.agents import build as agent_build
from textrl.core.versions import VersionCounter
from textrl.envs.prompts import encode_prompts
from textrl.envs.tasks import make_digits_task
from textrl.keys import KEYS
from textrl.parallel import SingleProcess
from textrl.run.rollout import collect

ROOT = Path(__file__).resolve().parents[2]
GAP = 1e-3
"""The largest mean gap between the engine's log-probs and the prefill's the same weights give on the
CPU (float32: the decode step and the prefill sum the same products in other orders)."""


def rollout(agent, tok, env=None, seed: int = 0):
    rows = make_digits_task(4, seed=seed) if env is None else env.rows()
    batch = encode_prompts(rows, tok)[0]
    torch.manual_seed(seed)
    return collect(agent, batch, target_reward if env is None else env)


# -- the counter -------------------------------------------------------------------------------------
def test_a_version_counter_moves_once_for_each_change_it_sees():
    w = torch.zeros(3)
    counter = VersionCounter(lambda: [w])
    assert counter.now() == counter.now() == 0
    w.add_(1.0)
    assert counter.now() == 1 == counter.now()
    w.add_(1.0)
    w.add_(1.0)  # two writes between two reads: one change seen
    assert counter.now() == 2


# -- the engine, chosen once ---------------------------------------------------------------------
def test_the_engine_is_chosen_once_when_the_backend_is_set(tok, monkeypatch):
    calls = []
    choose = agent_build.engine_for
    monkeypatch.setattr(agent_build, "engine_for", lambda *a, **k: calls.append((a, k)) or choose(*a, **k))
    agent = make_agent(tok, "gae_ppo")
    assert calls == []  # nothing chosen before the backend is known
    SingleProcess(device="cpu").prepare(agent)
    engine = agent.actor.engine  # as the trainer does right after prepare
    assert len(calls) == 1 and calls[0][1] == {"partitions_weights": False}
    agent.update(rollout(agent, tok))
    rollout(agent, tok, seed=1)
    assert len(calls) == 1 and agent.actor.engine is engine


def test_a_direct_agent_chooses_its_engine_on_first_use(tok, monkeypatch):
    calls = []
    choose = agent_build.engine_for
    monkeypatch.setattr(agent_build, "engine_for", lambda *a, **k: calls.append(a) or choose(*a, **k))
    agent = make_agent(tok, "grpo", n_samples_per_prompt=2)
    rollout(agent, tok)
    rollout(agent, tok, seed=1)
    assert len(calls) == 1


# -- provenance -------------------------------------------------------------------------------------
@pytest.mark.parametrize("engine", ["hf", "textrl"])
@pytest.mark.parametrize("multi_turn", [False, True])
def test_a_rollout_records_its_version_and_the_engines_log_probs(tok, engine, multi_turn):
    agent = make_agent(tok, "gae_ppo", generation_engine=engine, temperature=0.8, top_k=50)
    td = rollout(agent, tok, Echo(max_turns=2) if multi_turn else None)
    mask = td.get(KEYS.mask)
    assert td.get(KEYS.policy_version).tolist() == [agent.learner.version] * td.shape[0]
    drawn = td.get(KEYS.generation_log_prob)
    assert drawn.shape == mask.shape and bool(torch.isfinite(drawn).all())
    assert bool((drawn[~mask] == 0).all())  # the environment's tokens and the padding: nothing drawn
    if multi_turn:
        assert bool((td.get(KEYS.response_mask) & ~mask).any())  # observations sit between the turns
    # the engine drew from the top-50 renormalised; the learner's log-probs are the policy's at the
    # temperature (docs/training.md, "Sampling settings and the log-probs"): the engine's are higher by
    # minus the log of the nucleus's mass, never lower
    learner = td.get(KEYS.action_log_prob)
    assert float((drawn - learner)[mask].min()) > -GAP
    gap = (drawn - learner).abs()[mask]
    # the weight check's prefill of the same weights under the engine's own filter agrees to noise
    checked = td.get(KEYS.weight_gap_tokens)
    assert int(checked.sum()) > 0 and int(td.get(KEYS.weight_gap_outside).sum()) == 0
    weight_gap = float(td.get(KEYS.weight_gap_sum).sum()) / int(checked.sum())
    assert weight_gap < GAP
    metrics = agent.update(td)
    assert metrics["rollout/staleness"] == 0.0
    assert metrics["rollout/weight_gap"] == pytest.approx(weight_gap)
    assert metrics["rollout/logprob_gap"] == pytest.approx(float(gap.mean()))
    assert metrics["rollout/logprob_gap_max"] == pytest.approx(float(gap.max()))
    assert metrics["rollout/logprob_kl"] > 0


def test_the_lag_counts_the_learners_updates_since_the_rollout(tok):
    agent = make_agent(tok, "gae_ppo", ppo_epochs=2, num_minibatches=2, actor_lr=1e-2)
    stale = rollout(agent, tok)
    first = agent.update(stale)
    assert first["rollout/staleness"] == 0.0 == first["rollout/staleness_max"]
    again = agent.update(agent.process_rollout(stale))  # generated before that update, evaluated after it
    assert again["rollout/staleness"] == 1.0 == again["rollout/staleness_max"]
    assert again["rollout/logprob_gap"] > 100 * first["rollout/logprob_gap"]  # the engine drew from the old weights


def test_an_agent_without_a_rollout_context_still_collects(tok):
    class Plain:  # a duck-typed agent: act only
        def __init__(self, agent):
            self.agent = agent
            self.config, self.tokenizer, self.device = agent.config, agent.tokenizer, agent.device
            self.eos_token_id, self.pad_token_id = agent.eos_token_id, agent.pad_token_id

        def act(self, input_ids, attention_mask, *, greedy=False):
            return self.agent.act(input_ids, attention_mask, greedy=greedy)

    td = rollout(Plain(make_agent(tok, "gae_ppo")), tok)
    assert KEYS.policy_version not in td.keys() and KEYS.generation_log_prob not in td.keys(include_nested=True)


# -- the weights, through one call --------------------------------------------------------------------
def test_load_weights_from_is_a_no_op_on_shared_weights_and_a_copy_on_its_own(tok):
    agent = make_agent(tok, "gae_ppo", actor_lr=1e-2)
    actor, learner = agent.actor, agent.learner
    assert actor.policy is learner.policy
    agent.update(rollout(agent, tok))
    actor.load_weights_from(learner)
    assert actor.version == learner.version > 0

    own = copy.copy(actor)  # an actor sampling with weights of its own (another process's copy)
    own.policy = copy.deepcopy(actor.policy)
    own.__post_init__()
    before = {k: v.clone() for k, v in own.policy.state_dict().items()}
    agent.update(rollout(agent, tok, seed=1))
    assert all(torch.equal(before[k], v) for k, v in own.policy.state_dict().items())  # stale until loaded
    own.load_weights_from(learner)
    assert own.version == learner.version
    assert all(torch.equal(v, learner.policy.state_dict()[k]) for k, v in own.policy.state_dict().items())


# -- the seams -----------------------------------------------------------------------------------------
def _functions(path: Path) -> list[ast.FunctionDef]:
    tree = ast.parse(path.read_text())
    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]


@pytest.mark.parametrize("name", ["update.py", "state.py"])
def test_the_update_and_the_state_take_the_parts_not_the_agent(name):
    taking = [f.name for f in _functions(ROOT / "textrl" / "agents" / name)
              if any(a.arg == "agent" for a in f.args.args + f.args.kwonlyargs)]
    assert taking == [], f"textrl/agents/{name}: {taking} take the agent; pass the learner or the actor"


def test_no_agent_module_writes_another_objects_private_attributes():
    written = []
    for path in sorted([*(ROOT / "textrl" / "agents").rglob("*.py"), ROOT / "textrl" / "run" / "rollout.py",
                        *(ROOT / "textrl" / "training" / f"{name}.py" for name in ("trainer", "set_up", "run_checks", "ppo_run"))]):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
                if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for target in targets:
                for t in (target.elts if isinstance(target, ast.Tuple) else [target]):
                    if (isinstance(t, ast.Attribute) and t.attr.startswith("_") and not t.attr.startswith("__")
                            and not (isinstance(t.value, ast.Name) and t.value.id in ("self", "cls"))):
                        written.append(f"{path.relative_to(ROOT)}:{t.lineno} {ast.unparse(t)}")
    assert written == []
