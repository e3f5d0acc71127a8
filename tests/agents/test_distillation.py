"""On-policy distillation (--teacher): the teacher's per-token reward on the policy's own samples, alone or
mixed with the task's, the tokenizer rule and a dead served teacher (docs/rewards.md, "On-policy distillation")."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from tests.agents.conftest import PROMPTS, collect, make_agent
from textrl.agents import GRPO
from textrl.agents import teacher as teachers
from textrl.agents.teacher import LoadedTeacher, ServedTeacher, check_teacher_tokenizer
from textrl.config import TrainConfig
from textrl.core.precision import frozen_copy
from textrl.generation import vllm_server
from textrl.generation.base import EngineFailed
from textrl.generation.vllm import budgets
from textrl.keys import KEYS
from textrl.models import build_tiny_causal_lm, build_tiny_tokenizer


def zero_reward(prompts, completions, completion_ids=None, **kwargs):
    return torch.zeros(len(completions))


def with_teacher(agent, model, name="teacher"):
    agent.teacher = LoadedTeacher(frozen_copy(model, torch.float32), agent.learner.forwards, name)
    return agent


@pytest.mark.parametrize("name", ["grpo", "rloo"])
def test_teacher_equal_to_the_student_gives_zero_reward_and_leaves_the_policy(tok, name):
    """Zero reward on every token, so zero advantage (a group baseline, no critic), zero gradient, and
    AdamW without weight decay leaves every weight as it was."""
    agent = make_agent(tok, name, kl_coef=0.0, teacher="the policy", actor_lr=1e-2)
    with_teacher(agent, agent.policy)
    before = {n: p.detach().clone() for n, p in agent.policy.named_parameters()}
    td = collect(agent, tok)  # a task reward that varies, logged but not optimised: no --reward
    assert td.get(KEYS.score).std() > 0
    mask = td.get(KEYS.mask)
    assert torch.equal(td.get(KEYS.teacher_log_prob)[mask], td.get(KEYS.action_log_prob)[mask])
    assert torch.equal(td.get(KEYS.reward).squeeze(-1), torch.zeros_like(mask, dtype=torch.float32))
    assert not td.get(KEYS.advantage).any()
    metrics = agent.update(td)
    assert metrics["teacher/reverse_kl"] == 0.0
    assert all(torch.equal(before[n], p) for n, p in agent.policy.named_parameters())


def test_gae_ppo_gets_the_teachers_reward_per_token(tok):
    agent = with_teacher(make_agent(tok, "gae_ppo", kl_coef=0.0, teacher="the policy"), build_tiny_causal_lm(tok, seed=0))
    td = collect(agent, tok)
    assert td.get(KEYS.score).std() > 0 and td.get(KEYS.mask).sum() > len(PROMPTS)
    assert not td.get(KEYS.reward).any()  # the same weights: 0 on every token, the task reward left out


def hand_logprobs(model, prompt_ids, response_ids):
    """log p(y_t | prompt, y_<t) of one unpadded row, by a plain forward and log_softmax."""
    ids = torch.tensor([prompt_ids + response_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    return [logp[len(prompt_ids) + j - 1, y].item() for j, y in enumerate(response_ids)]


def test_reward_per_token_equals_a_reference_loop(tok):
    agent = make_agent(tok, "grpo", kl_coef=0.0, teacher="tiny seed 1", teacher_coef=0.7)
    teacher_model = build_tiny_causal_lm(tok, seed=1).eval()
    with_teacher(agent, teacher_model)
    td = collect(agent, tok, reward_fn=zero_reward)
    reward, mask = td.get(KEYS.reward).squeeze(-1), td.get(KEYS.mask)
    prompts, action = td.get(KEYS.prompt_tokens), td.get(KEYS.action)
    for b in range(len(PROMPTS)):
        prompt = prompts[b][td.get(KEYS.prompt_mask)[b]].tolist()
        response = action[b][mask[b]].tolist()
        student = hand_logprobs(agent.policy, prompt, response)
        teacher = hand_logprobs(teacher_model, prompt, response)
        want = [0.7 * (t - s) for t, s in zip(teacher, student, strict=True)]
        assert reward[b][mask[b]].tolist() == pytest.approx(want, abs=1e-5)
        assert not reward[b][~mask[b]].any()
    assert td.get(KEYS.reward)[mask.unsqueeze(-1)].abs().min() > 0


def test_task_reward_mixes_in_where_the_run_names_one(tok):
    def one(prompts, completions, completion_ids=None, **kwargs):
        return torch.ones(len(completions))

    rewards = {}
    for spec in (None, "accuracy"):
        agent = make_agent(tok, "grpo", kl_coef=0.0, teacher="tiny seed 1", reward=spec)
        with_teacher(agent, build_tiny_causal_lm(tok, seed=1))
        td = collect(agent, tok, reward_fn=one)
        rewards[spec] = (td.get(KEYS.reward).squeeze(-1), td.get(KEYS.mask))
    (alone, mask), (mixed, _) = rewards[None], rewards["accuracy"]
    assert torch.allclose(mixed.sum(1), alone.sum(1) + 1.0)  # the task score on the last agent token
    assert torch.equal(mixed[:, 0][mask.sum(1) > 1], alone[:, 0][mask.sum(1) > 1])


def test_agents_without_the_option_and_other_temperatures_refuse_a_teacher():
    with pytest.raises(ValueError, match="reinforce_pp does not read teacher="):
        TrainConfig(agent="reinforce_pp", teacher="tiny").validate()
    with pytest.raises(ValueError, match="temperature=0.7: on-policy distillation"):
        _ = make_agent(build_tiny_tokenizer(), "grpo", teacher="tiny", temperature=0.7).actor


def test_a_teacher_with_another_tokenizer_is_refused_in_one_line(tok, tmp_path):
    other = type(tok).from_pretrained(_saved(tok, tmp_path / "same"))
    other.add_tokens(["<only_the_teacher_knows>"])
    other.save_pretrained(tmp_path / "other")
    config = TrainConfig(agent="grpo", teacher=str(tmp_path / "other"))
    with pytest.raises(ValueError) as err:
        check_teacher_tokenizer(config, tok, "tiny")
    message = str(err.value)
    assert "\n" not in message and str(tmp_path / "other") in message and "'tiny'" in message
    assert "513 tokens" in message or "tokens against" in message
    check_teacher_tokenizer(TrainConfig(agent="grpo", teacher=str(tmp_path / "same")), tok, "tiny")  # the same: passes
    agent = GRPO.from_config(TrainConfig(agent="grpo", teacher=str(tmp_path / "other"), warmup_sft_steps=0))
    with pytest.raises(ValueError, match="another tokenizer"):  # the actor, built before the first iteration
        _ = agent.actor
    assert getattr(agent, "teacher", None) is None


def test_the_teacher_s_rules_are_checked_before_any_model_loads(tok, tmp_path, monkeypatch):
    """``textrl.training.run_checks.check_run`` (before the warm-up and any model) refuses another tokenizer, a
    missing teacher and a temperature other than 1; the same tokenizer passes."""
    from textrl.training.run_checks import check_run

    other = type(tok).from_pretrained(_saved(tok, tmp_path / "same"))
    other.add_tokens(["<only_the_teacher_knows>"])
    other.save_pretrained(tmp_path / "other")
    loads = []
    monkeypatch.setattr("textrl.models.load_causal_lm", lambda *a, **k: loads.append(a))
    base = {"agent": "grpo", "output_dir": str(tmp_path / "run"), "iterations": 1}
    with pytest.raises(ValueError, match="another tokenizer"):
        check_run(TrainConfig(**base, teacher=str(tmp_path / "other")))
    with pytest.raises(ValueError, match=r"its tokenizer cannot be loaded .*; fix --teacher"):
        check_run(TrainConfig(**base, teacher=str(tmp_path / "missing")))
    with pytest.raises(ValueError, match="temperature=0.7: on-policy distillation"):
        check_run(TrainConfig(**base, teacher="tiny", temperature=0.7))
    check_run(TrainConfig(**base, teacher=str(tmp_path / "same")))
    assert loads == []


def _saved(tok, path):
    tok.save_pretrained(path)
    return str(path)


def test_a_dead_served_teacher_is_named_as_the_engines_servers_are(monkeypatch):
    monkeypatch.setattr(budgets, "BACKOFF_S", 0.0)
    url = f"http://127.0.0.1:{vllm_server.free_port()}"
    with pytest.raises(ValueError) as err:
        ServedTeacher(url).identify()
    assert str(err.value).startswith(f"teacher {url} does not answer (GET /v1/models: connection refused")
    assert "vllm-serve" in str(err.value)
    served = ServedTeacher(url)
    served.server.model = "the teacher"
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(EngineFailed, match=f"teacher vLLM server {url}: POST /v1/completions: connection refused"):
        served.logprobs(ids, torch.ones_like(ids), 2, ids[:, 2:])


def test_served_answer_is_read_by_token_id():
    rows = teachers.row_tokens(torch.tensor([[0, 5, 6, 7, 8, 0]]), torch.tensor([[0, 1, 1, 1, 1, 0]]), 3)
    assert rows == [([5, 6, 7, 8], 2)]
    answer = {"choices": [{"index": 0, "prompt_logprobs": [
        None, {"6": {"logprob": -1.0}}, {"7": {"logprob": -2.5}, "9": {"logprob": -0.1}}, {"8": {"logprob": -0.5}}]}]}
    assert teachers.served_logprobs(answer, rows, 3).tolist() == [[-2.5, -0.5, 0.0]]


class TeacherStub(BaseHTTPRequestHandler):
    """A served teacher's two routes a check reads: its model, and token ids one off from the policy's."""

    def log_message(self, *args):
        pass

    def _answer(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._answer({"data": [{"id": "stub-teacher"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        ids = build_tiny_tokenizer().encode(body["prompt"], add_special_tokens=False)
        self._answer({"tokens": [i + self.server.shift for i in ids], "count": len(ids)})


@pytest.mark.parametrize("shift", [0, 1])
def test_a_served_teacher_is_checked_by_the_ids_of_the_probe(tok, shift):
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), TeacherStub)
    httpd.shift = shift
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        if shift == 0:
            ServedTeacher(url).check(tok, "tiny")
            return
        with pytest.raises(ValueError) as err:
            check_teacher_tokenizer(TrainConfig(agent="grpo", teacher=url), tok, "tiny")
        message = str(err.value)
        assert message.startswith(f"teacher '{url} (stub-teacher)' has another tokenizer than policy 'tiny'")
        assert "\n" not in message and "drop --teacher" in message
    finally:
        httpd.shutdown()
