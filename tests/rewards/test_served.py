"""Served rewards without vLLM: ``reward_model:URL`` and ``judge:URL`` against a local HTTP server that
answers as vLLM's routes do (``/v1/models``, ``/classify`` scored by the tiny reward model in this
process, one row at a time; completions whose verdict is the prompt's last word). The served scores
equal ``reward_model:PATH``'s with the same settings; a dead server is named; a timed-out batch is sent
again; an unparsable verdict is said once and counted. The real vLLM servers: tests/rewards/test_served_vllm.py."""

from __future__ import annotations

import json
import math
import threading
import time
import warnings
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from textrl.generation.base import EngineFailed
from textrl.generation.vllm import budgets
from textrl.models import tiny_model_path
from textrl.rewards import NeuralReward, get_reward, parse_reward_spec
from textrl.rewards.base import evaluate_reward
from textrl.rewards.judge import JudgeUnparsableWarning, verdict_score
from textrl.rewards.served import RewardServerDown, ServedReward
from textrl.run import latest_checkpoint

PROMPTS = ["What is 2+2?", "Hi", "Explain why the sky is blue.", "x", "List three primes.", "Name a colour.", "ok"]
COMPLETIONS = ["<answer>4</answer> so four", "hello", "Light scatters.", "y" * 30, "<answer>2, 3, 5</answer>",
               "blue", "fine"]


class Stub(BaseHTTPRequestHandler):
    """vLLM's routes as a reward server or a judge server answers them (``self.server.state``)."""

    def log_message(self, *args):  # quiet
        pass

    def _send(self, status, answer):
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        state = self.server.state
        if self.path == "/v1/models":
            return self._send(200, {"data": [{"id": state["model"], "root": state["model"], "max_model_len": 512}]})
        self._send(404, {"detail": "Not Found"})

    def do_POST(self):
        state = self.server.state
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        route = self.path.strip("/")
        state["requests"].append((route, body))
        if state.get("delay_first") and len([r for r in state["requests"] if r[0] == route]) == 2:
            time.sleep(state["delay_first"])  # the first batch after the construction's check
        if route == "classify" and len([r for r in state["requests"] if r[0] == route]) > state.get("down_after", 1e9):
            return self._send(503, {"detail": "Service Unavailable"})
        if route == "classify" and "rm" in state:
            with torch.no_grad():
                scores = [state["rm"](torch.tensor([row])).logits[0, 0].item() for row in body["input"]]
            data = [{"index": i, "label": "LABEL_0", "probs": [s], "num_classes": 1} for i, s in enumerate(scores)]
            return self._send(200, {"data": data})
        if route in ("v1/completions", "v1/chat/completions") and "rm" not in state:
            text = body["messages"][0]["content"] if "messages" in body else body["prompt"]
            verdict = text.split()[-1]
            choice = {"message": {"content": verdict}} if "messages" in body else {"text": verdict}
            return self._send(200, {"choices": [choice]})
        self._send(404, {"detail": "Not Found"})


def serve(**state):
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    httpd.daemon_threads = True
    httpd.state = {"requests": [], **state}
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, f"http://127.0.0.1:{httpd.server_address[1]}"


@pytest.fixture(scope="module")
def rm_path():
    return str(tiny_model_path("reward_model"))


@pytest.fixture
def rm_server(rm_path):
    local = NeuralReward.from_pretrained(rm_path)
    httpd, url = serve(model=rm_path, rm=local.model)
    yield httpd, url
    httpd.shutdown()


@pytest.fixture
def fast_retries(monkeypatch):
    monkeypatch.setattr(budgets, "BACKOFF_S", 0.01)


@pytest.mark.parametrize("settings", ["", "?clip=none&baseline=0.25", "?clip=-0.1;0.1&answer_blend=0.4;0.6&batch_size=3"])
def test_served_scores_equal_the_in_process_reward_models(rm_server, rm_path, settings):
    httpd, url = rm_server
    served = get_reward(f"reward_model:{url}{settings}")
    assert isinstance(served, ServedReward) and served.does_io is True and served.max_length == 512
    options = {"clip": None, "baseline": 0.25} if "baseline" in settings else \
        {"clip": (-0.1, 0.1), "answer_blend": (0.4, 0.6), "batch_size": 3} if "blend" in settings else {}
    local = get_reward(f"reward_model:{rm_path}", **options)
    expected = local(PROMPTS, COMPLETIONS)
    got = served(PROMPTS, COMPLETIONS)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    sent = [body for route, body in httpd.state["requests"] if route == "classify"][1:]  # after the check
    rows = len(PROMPTS) + (2 if "blend" in settings else 0)  # two completions hold an answer block
    batch = 3 if "batch_size" in settings else 32
    sizes = sorted((len(b["input"]) for b in sent), reverse=True)  # the requests arrive in any order
    assert sizes == [min(batch, rows - i) for i in range(0, rows, batch)]
    sent_rows = [row for b in sent for row in b["input"]]
    assert all(row in sent_rows for row in local.encode(PROMPTS, COMPLETIONS))  # the ids, tokenised here


def test_a_reward_spec_weights_a_served_reward_after_its_port(rm_server):
    _, url = rm_server
    reward = parse_reward_spec(f"tag_count:0.5,reward_model:{url}?clip=none:2")
    assert reward.weights == {"tag_count": 0.5, "reward_model": 2.0}
    assert parse_reward_spec(f"reward_model:{url}").weights == {"reward_model": 1.0}  # the port is no weight


def test_a_dead_reward_server_is_named_at_the_start_and_mid_run(rm_server, fast_retries):
    httpd, url = rm_server
    served = get_reward(f"reward_model:{url}")
    httpd.shutdown()
    httpd.server_close()
    with pytest.raises(RewardServerDown) as stop:  # through evaluate_reward: not a RewardError
        evaluate_reward(served, PROMPTS, COMPLETIONS)
    message = str(stop.value)
    assert isinstance(stop.value, EngineFailed) and "\n" not in message
    assert f"reward_model server {url}: POST /classify: connection refused (4 tries)" in message
    assert message.endswith("; start it with textrl vllm-serve --reward-model MODEL (the run saves its last finished "
                            "iteration)")
    with pytest.raises(ValueError, match=rf"^reward_model server {url} does not answer GET /v1/models "
                                         r"\(connection refused\): start it with textrl vllm-serve --reward-model MODEL"):
        get_reward(f"reward_model:{url}")


def test_a_policy_server_is_refused_as_a_reward_model(rm_path):
    httpd, url = serve(model=rm_path)  # answers /v1/models, has no /classify
    try:
        with pytest.raises(ValueError, match=rf"^vLLM server {url} does not score with a reward model \(POST /classify: "
                                             r"HTTP 404: Not Found\): start it with textrl vllm-serve --reward-model MODEL"):
            get_reward(f"reward_model:{url}")
    finally:
        httpd.shutdown()


def test_a_timed_out_batch_is_sent_again(rm_server, rm_path, fast_retries):
    httpd, url = rm_server
    served = get_reward(f"reward_model:{url}?timeout=0.3")
    httpd.state["delay_first"] = 1.0
    got = served(PROMPTS[:2], COMPLETIONS[:2])
    torch.testing.assert_close(got, get_reward(f"reward_model:{rm_path}")(PROMPTS[:2], COMPLETIONS[:2]), rtol=1e-5, atol=1e-6)
    assert [route for route, _ in httpd.state["requests"]] == ["classify"] * 3  # check, timed out, again


# -- the judge ----------------------------------------------------------------------------------------------
@pytest.fixture
def judge_server():
    httpd, url = serve(model="judge-model")
    yield httpd, url
    httpd.shutdown()


def test_judge_verdicts_are_parsed_and_an_unparsable_one_does_not_apply(judge_server, tmp_path):
    httpd, url = judge_server
    template = tmp_path / "judge.txt"
    template.write_text('{"q": "{prompt}"} expected {answer}; verdict: {completion}')
    judge = get_reward(f"judge:{url}?template={template}&choices=yes=1;no=-1;half=0.5")
    assert judge.does_io is True and judge.needs == ("answer",)
    completions = ["so yes", "No.", "maybe", "half", "yesterday"]
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        scores = judge(["p"] * 5, completions, answer=["a"] * 5)
        judge(["p"], ["maybe"], answer=["a"])
    assert scores == [1.0, -1.0, None, 0.5, None]
    assert (judge.verdicts, judge.unparsable) == (6, 3)
    unparsable = [w for w in said if issubclass(w.category, JudgeUnparsableWarning)]
    assert len(unparsable) == 1  # said once, with an example
    assert "2 of 5 verdicts are unparsable, e.g. row 2: 'maybe'" in str(unparsable[0].message)
    sent = [body for route, body in httpd.state["requests"]]  # concurrent: in any order
    assert [{"role": "user", "content": '{"q": "p"} expected a; verdict: so yes'}] in [b["messages"] for b in sent]
    assert all(b["temperature"] == 0.0 and b["max_tokens"] == 8 for b in sent)


@pytest.fixture
def last_word(tmp_path):
    """A template whose last word is the completion's (the stub's verdict)."""
    path = tmp_path / "last_word.txt"
    path.write_text("Question: {prompt}\nVerdict: {completion}")
    return path


def test_judge_composes_by_weight_and_an_unparsable_row_leaves_the_total(judge_server, last_word):
    _, url = judge_server
    reward = parse_reward_spec(f"tag_count:0.5,judge:{url}?template={last_word}&pattern=(\\d%2B)/10&chat=false:0.1")
    assert reward.weights == {"tag_count": 0.5, "judge": 0.1}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", JudgeUnparsableWarning)
        out = reward.evaluate(["p", "p"], ["<think> 7/10", "<think> seven"])
    assert out.components["judge"][0].item() == 7.0 and math.isnan(out.components["judge"][1].item())
    assert out.applies["judge"].tolist() == [True, False]
    torch.testing.assert_close(out.total, torch.tensor([0.5 * 0.25 + 0.1 * 7.0, 0.5 * 0.25]))


def test_an_unparsable_score_given_is_used(judge_server, last_word):
    _, url = judge_server
    judge = get_reward(f"judge:{url}?unparsable=0&template={last_word}")
    with pytest.warns(JudgeUnparsableWarning, match="such a row scores 0"):
        assert judge(["p", "p"], ["yes", "perhaps"]) == [1.0, 0.0]


def test_verdict_parsing():
    choices = {"yes": 1.0, "no": 0.0, "not sure": 0.5}
    assert [verdict_score(v, choices, None) for v in ["YES!", " no", "Not sure.", "nope", ""]] == [1.0, 0.0, 0.5, None, None]


def test_a_dead_judge_is_named(judge_server, fast_retries):
    httpd, url = judge_server
    judge = get_reward(f"judge:{url}")
    httpd.shutdown()
    httpd.server_close()
    with pytest.raises(RewardServerDown, match=rf"^judge server {url}: POST /v1/chat/completions: connection refused "
                                               r"\(4 tries\); .*textrl vllm-serve JUDGE_MODEL"):
        evaluate_reward(judge, ["p"], ["yes"])


def test_a_reward_model_server_runs_the_pooling_runner_without_weight_updates(tmp_path):
    from textrl.generation.vllm_server import serve_command

    argv, env = serve_command(str(tmp_path), ["--port", "8002", "--max-model-len", "1024"], cuda=False, reward=True)
    assert argv[argv.index("--runner") + 1] == "pooling" and env == {}
    assert "--weight-transfer-config" not in argv and "--worker-extension-cls" not in argv
    assert argv[-4:] == ["--port", "8002", "--max-model-len", "1024"]  # the user's options last
    assert "--no-enable-chunked-prefill" in argv and argv[argv.index("--max-num-batched-tokens") + 1] == "2048"


@pytest.mark.slow  # two short training runs: 15 s
def test_a_run_trains_on_a_served_reward_and_a_judge_and_stops_at_a_dead_one(rm_server, judge_server, last_word,
                                                                              tmp_path, fast_retries, monkeypatch):
    """``textrl train --reward`` with both served rewards: the judge's unparsable verdicts show in
    ``reward_components/judge/applies``; the reward server down mid-run (HTTP 503 after the resumed run's
    check), the run stops in one line with its last finished iteration saved."""
    from tests.runs import SMALL, metrics
    from textrl.cli import main

    monkeypatch.setenv("TEXTRL_CACHE", str(tmp_path / "cache"))
    (_, rm_url), (_, judge_url) = rm_server, judge_server
    spec = f"tag_count,reward_model:{rm_url}:0.5,judge:{judge_url}?template={last_word}&pattern=\\d:0.1"
    out = tmp_path / "run"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", JudgeUnparsableWarning)
        assert main(["train", "--iterations", "1", "--output-dir", str(out), *SMALL, "--reward", spec]) == 0
    row = metrics(out)[0]
    assert row["reward_components/reward_model/applies"] == 1.0 and math.isfinite(row["reward_components/reward_model/mean"])
    assert 0.0 <= row["reward_components/judge/applies"] < 1.0  # the tiny policy's last words are rarely digits
    state = rm_server[0].state
    state["down_after"] = len([r for r in state["requests"] if r[0] == "classify"]) + 1  # the check answers
    with pytest.raises(SystemExit) as stop:
        main(["train", "--iterations", "2", "--output-dir", str(out), *SMALL, "--reward", spec, "--resume"])
    message = str(stop.value)
    assert f"reward_model server {rm_url}: POST /classify: HTTP 503 (Service Unavailable) (4 tries)" in message, message
    assert latest_checkpoint(out).name.endswith("1") and len(metrics(out)) == 1


def test_a_constrained_judge_asks_for_its_choices_only(judge_server):
    httpd, url = judge_server
    judge = get_reward(f"judge:{url}?choices=good=1;bad=0&constrain=true")
    judge(["p"], ["good"])
    assert httpd.state["requests"][-1][1]["structured_outputs"] == {"choice": ["good", "bad"]}
    with pytest.raises(ValueError, match="constrain=true needs choices"):
        get_reward(f"judge:{url}?pattern=\\d&constrain=true")
