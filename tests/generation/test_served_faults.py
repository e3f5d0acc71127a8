"""The served engine's faults against fake vLLM servers in this process (no vLLM needed): a small
threading HTTP server with the routes the engine uses (``/v1/models``, ``/health``,
``/v1/completions`` answering canned token ids that depend only on the request body, ``/weight_info``,
``/collective_rpc`` with textrl's worker-extension methods, the weight push's version routes). The
weight transfer itself is bypassed (:class:`Engine` sets the version a push would set); its pieces
that need no vLLM are tested as functions: the health-watched push step, the gloo broadcast that
stops waiting on a peer that went silent.

Retries and their backoff, the completion's budget, a dead or silent server noticed within seconds,
its groups dealt to the others with the same bodies (the result what it would have been), a server
taken back when it answers again, :class:`~textrl.generation.base.EngineFailed` when none is left, the checks
before any work (not a vLLM server, another model by its config, no dev routes), and the claims (a
second run refused at its start touching nothing, a stale claim taken over, a resumed run taking its
own back).
"""

from __future__ import annotations

import datetime
import functools
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from textrl.generation import Sampling
from textrl.generation import vllm_server as vs
from textrl.generation.base import EngineFailed
from textrl.generation.vllm import budgets, claims
from textrl.generation.weight_sync import fingerprint

ESSENTIALS = {"model_type": "llama", "vocab_size": 300, "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 128}


def canned(body: dict) -> dict:
    """The answer to a completion body: token ids and log-probs that depend only on the body."""
    base = sum(body["prompt"]) + (body.get("seed") or 0)
    choices = []
    for i in range(body["n"]):
        ids = [(base + 7 * i + 3 * k) % 50 + 5 for k in range(body["max_tokens"])]
        choices.append({"index": i, "token_ids": ids,
                        "logprobs": {"token_logprobs": [-0.01 * (t % 13 + 1) for t in ids]}})
    return {"choices": choices}


class Fake:
    """A fake vLLM server (module docstring). ``faults[path]``: HTTP statuses answered first, one per
    request; ``delay``: how long a completion takes; :meth:`kill` (connections refused, pending ones
    cut), :meth:`freeze` (connections accepted, never answered), :meth:`restart` (fresh: no weights,
    no claim; same port)."""

    def __init__(self, model_id: str = "/srv/models/tiny", config: dict | None = None, *,
                 rpc: bool = True, transfer: str | None = "textrl_gloo", routes: tuple[str, ...] = vs.WEIGHT_ROUTES) -> None:
        self.model_id, self.config, self.rpc, self.transfer, self.routes = model_id, config or dict(ESSENTIALS), rpc, transfer, routes
        self.faults: dict[str, list[int]] = {}
        self.delay = 0.0
        self.log: list[tuple[str, str, str]] = []
        """(method, path, worker method) of every request."""
        self.bodies: list[dict] = []
        self.port = 0
        self._fresh()
        self._start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _fresh(self) -> None:
        self.version: str | None = None
        self.book = vs.LeaseBook()
        self.dead = self.frozen = False

    def _start(self) -> None:
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                fake.serve(self, "GET", None)

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                fake.serve(self, "POST", json.loads(self.rfile.read(length) or b"{}"))

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def kill(self) -> None:
        self.dead = True
        self.httpd.shutdown()
        self.httpd.server_close()

    def freeze(self) -> None:
        self.frozen = True
        self.httpd.shutdown()  # the socket stays open: connections queue, nothing answers

    def restart(self) -> None:
        self._fresh()
        self._start()

    def close(self) -> None:
        self.dead = True
        if not self.frozen:
            self.httpd.shutdown()
        self.httpd.server_close()

    def posts(self) -> list[tuple[str, str]]:
        return [(path, method) for verb, path, method in self.log if verb == "POST"]

    def serve(self, handler, verb: str, body: dict | None) -> None:
        path = handler.path.lstrip("/")
        method = (body or {}).get("method", "") if path == "collective_rpc" else ""
        self.log.append((verb, path, method))
        if self.frozen:
            while self.frozen and not self.dead:
                time.sleep(0.05)
            return
        statuses = self.faults.get(path)
        if statuses:
            self.reply(handler, statuses.pop(0), {"error": {"message": "a fault the test asked for"}})
            return
        if verb == "GET":
            self.get(handler, path)
        else:
            self.post(handler, path, body)

    def reply(self, handler, status: int, answer, kind: str = "application/json") -> None:
        data = answer.encode() if isinstance(answer, str) else json.dumps(answer).encode()
        handler.send_response(status)
        handler.send_header("Content-Type", kind)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    def get(self, handler, path: str) -> None:
        if path == "v1/models":
            self.reply(handler, 200, {"object": "list", "data": [{"id": self.model_id}]})
        elif path == "health":
            self.reply(handler, 200, "", "text/plain")
        elif path == "weight_info":
            self.reply(handler, 200, {"weight_version": self.version})
        elif path in self.routes:
            self.reply(handler, 405, {"detail": "Method Not Allowed"})
        else:
            self.reply(handler, 404, {"detail": "Not Found"})

    def post(self, handler, path: str, body: dict) -> None:
        if path == "v1/completions":
            self.bodies.append(body)
            waited = 0.0
            while waited < self.delay:
                if self.dead:  # killed with the request pending: the connection is cut, no answer
                    handler.connection.shutdown(socket.SHUT_RDWR)
                    return
                time.sleep(0.02)
                waited += 0.02
            self.reply(handler, 200, canned(body))
        elif path == "collective_rpc" and self.rpc:
            self.reply(handler, 200, {"results": [self.worker(body["method"], body.get("kwargs") or {})]})
        elif path == "update_weight_version":
            self.version = body["new_version"]
            self.reply(handler, 200, {})
        else:
            self.reply(handler, 404, {"detail": "Not Found"})

    def worker(self, method: str, kwargs: dict):
        if method == "textrl_model_config":
            return {"config": self.config, "weight_transfer": self.transfer}
        if method == "textrl_claim":
            return self.book.claim(kwargs["run"], kwargs["lease_s"])
        if method == "textrl_release":
            return self.book.release(kwargs["run"])
        raise AssertionError(method)


class Engine(vs.VLLMServerEngine):
    """The served engine with its weight transfer bypassed: a push sets the server's version to the
    weights' fingerprint, as the real one does after sending them."""

    def __init__(self, fakes, output_dir, lines: list[str]) -> None:
        super().__init__()
        self.configure(SimpleNamespace(vllm_server=",".join(f.url for f in fakes), model="tiny",
                                       output_dir=str(output_dir), seed=0))
        self.log = lines.append
        self.pushes: list[str] = []

    def _push(self, server, model, rank, *, watched=True):
        version = fingerprint(model.state_dict().items())
        server.request("update_weight_version", {"new_version": version})
        self.pushes.append(server.url)
        return version


class Policy(torch.nn.Module):
    def __init__(self, config: dict | None = None) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(3))
        self.config = SimpleNamespace(**(config or ESSENTIALS))


SAMPLING = Sampling(greedy=False, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=4, eos_token_id=None,
                    pad_token_id=0)


def call(engine, model, groups: int = 6, samples: int = 2, sampling: Sampling = SAMPLING, seed: int = 0):
    """One sampled call: ``groups`` distinct prompts, ``samples`` rows each."""
    torch.manual_seed(seed)
    ids = torch.tensor([[g + 1, g + 2] for g in range(groups) for _ in range(samples)])
    return engine.generate_with_logprobs(model, ids, torch.ones_like(ids), sampling)


@pytest.fixture
def fakes(request):
    made: list[Fake] = []

    def make(*args, **kwargs) -> Fake:
        made.append(Fake(*args, **kwargs))
        return made[-1]

    yield make
    vs.CLAIMS.let_go()
    for fake in made:
        fake.close()


@pytest.fixture
def quick(monkeypatch):
    """Short budgets, so that a test of a fault takes a second, not a minute."""
    for name, value in {"BACKOFF_S": 0.02, "HEALTH_EVERY_S": 0.1, "HEALTH_TIMEOUT_S": 0.3, "PROBE_TIMEOUT_S": 0.3,
                        "RENEW_EVERY_S": 0.1, "LEASE_S": 2.0, "REQUEST_TIMEOUT_S": 2.0}.items():
        monkeypatch.setattr(budgets, name, value)


# -- the pieces --------------------------------------------------------------------------------------------
def test_a_lease_book_grants_its_holder_refuses_another_and_lets_a_stale_claim_be_taken_over():
    book = vs.LeaseBook()
    assert book.claim("a", 30, wall=100.0, clock=0.0) == {"granted": True, "taken_over": None}
    assert book.claim("a", 30, wall=110.0, clock=10.0)["granted"]  # renewed
    refused = book.claim("b", 30, wall=125.0, clock=25.0)
    assert refused == {"granted": False, "run": "a", "since": 100.0, "seen_ago": 15.0}
    taken = book.claim("b", 30, wall=150.0, clock=50.0)  # a's last renewal 40 s ago: stale
    assert taken == {"granted": True, "taken_over": {"run": "a", "seen_ago": 40.0}} and book.since == 150.0
    assert not book.release("a") and book.release("b") and book.claim("c", 30, clock=51.0)["granted"]


def test_the_budget_of_a_completion_scales_with_what_the_call_asks_its_server():
    body = vs.completion_request("m", [1, 2], 8, SAMPLING, seed=1, logprobs=True)
    assert vs.requested_tokens(body) == 8 * 4
    assert vs.completion_budget(0) == budgets.COMPLETION_FLOOR_S
    assert vs.completion_budget(32) == pytest.approx(budgets.COMPLETION_FLOOR_S + 32 * budgets.SECONDS_PER_TOKEN)
    assert vs.completion_budget(64 * 8 * 1024) > 10 * vs.completion_budget(8 * 1024)


def test_a_models_config_is_compared_field_by_field_and_the_first_difference_named():
    assert vs.first_difference(ESSENTIALS, dict(ESSENTIALS)) is None
    assert vs.first_difference({**ESSENTIALS, "hidden_size": 32, "vocab_size": 5}, ESSENTIALS) == ("vocab_size", 5, 300)
    assert vs.first_difference({"model_type": "llama"}, {"vocab_size": 3}) is None  # only fields both set


def test_the_trained_models_essentials_come_from_its_folder_or_the_model_object(tmp_path):
    from textrl.models import build_tiny_causal_lm, build_tiny_tokenizer

    model = build_tiny_causal_lm(build_tiny_tokenizer(), num_attention_heads=2)
    model.save_pretrained(tmp_path)  # its config read, no weight loaded
    essentials = vs.trained_essentials(str(tmp_path))
    assert essentials == vs.model_essentials(model.config) == vs.trained_essentials(model)
    assert essentials["num_attention_heads"] == 2 and essentials["model_type"] == "llama"


def test_an_error_answer_is_cut_to_its_first_line():
    assert vs.error_detail('{"error": {"message": "too long\\nsecond"}}') == "too long"
    assert vs.error_detail('{"detail": "Not Found"}') == "Not Found"
    assert vs.error_detail("<html>\n<b>x</b>") == "<html>"


# -- retries and budgets -------------------------------------------------------------------------------------
def test_a_transient_failure_is_retried_with_backoff_and_the_same_body(fakes, quick):
    fake = fakes()
    fake.faults["v1/completions"] = [503, 502]
    server = vs.Server(fake.url)
    server.model = fake.model_id
    body = vs.completion_request(None, [4, 5], 2, SAMPLING, seed=3, logprobs=True)
    start = time.monotonic()
    answer = server.complete(body, timeout=5)
    assert time.monotonic() - start >= budgets.BACKOFF_S * (1 + 2)
    assert answer == canned({**body, "model": fake.model_id})
    assert len(fake.bodies) == 1 and [p for p, _ in fake.posts()].count("v1/completions") == 3


def test_a_server_that_keeps_failing_is_given_up_after_its_retries(fakes, quick):
    fake = fakes()
    fake.faults["v1/completions"] = [503] * 10
    server = vs.Server(fake.url)
    with pytest.raises(vs.ServerDown, match=r"POST /v1/completions: HTTP 503 \(a fault the test asked for\) \(4 tries\)"):
        server.complete(vs.completion_request(None, [1], 1, SAMPLING, 1, False), timeout=5)
    assert len(fake.log) == budgets.RETRIES + 1


def test_a_request_error_that_is_not_transient_is_not_retried(fakes, quick):
    fake = fakes()
    fake.faults["v1/completions"] = [400]
    with pytest.raises(vs.ServerRefused, match="HTTP 400: a fault the test asked for"):
        vs.Server(fake.url).complete(vs.completion_request(None, [1], 1, SAMPLING, 1, False), timeout=5)
    assert len(fake.log) == 1


def test_a_weight_push_route_is_never_sent_twice(fakes, quick):
    fake = fakes()
    fake.faults["update_weights"] = [503]
    with pytest.raises(vs.ServerDown, match=r"POST /update_weights: HTTP 503"):
        vs.HTTPClient(vs.Server(fake.url)).update_weights({"names": []})
    assert fake.posts() == [("update_weights", "")]


def test_a_completion_gets_the_budget_of_what_the_call_asks(fakes, quick, monkeypatch, tmp_path):
    """A server 0.6 s slow: a call asking 2 x 4 tokens of it (budget 0.2 + 8 x 0.01 s) gives up on it,
    one asking 2 x 60 tokens (0.2 + 120 x 0.01 s) waits for it."""
    monkeypatch.setattr(budgets, "COMPLETION_FLOOR_S", 0.2)
    monkeypatch.setattr(budgets, "SECONDS_PER_TOKEN", 0.01)
    monkeypatch.setattr(budgets, "RETRIES", 0)
    slow, quick_one = fakes(), fakes()
    slow.delay = 0.6
    lines: list[str] = []
    engine, model = Engine([slow, quick_one], tmp_path / "run", lines), Policy()
    long = Sampling(**{**SAMPLING.__dict__, "max_new_tokens": 60})
    call(engine, model, groups=1, sampling=long)  # dealt to the slow one: answered within its budget
    assert slow.bodies and not lines
    call(engine, model, groups=2)  # the second group, 8 tokens, to the slow one: given up on
    assert len(lines) == 1 and lines[0].startswith(f"vLLM server {slow.url} dropped (POST /v1/completions: no answer in 0.2")


# -- a server that fails mid-run -------------------------------------------------------------------------------
def test_a_killed_server_is_noticed_in_a_second_and_its_groups_go_to_the_other_with_the_same_bodies(fakes, tmp_path):
    """With the real budgets: the requests pending on the killed server are cut, retried, refused;
    its groups are sent to the other server as they were, and the call's result is the one a call
    with no failure gives."""
    a, b, reference = fakes(), fakes(), fakes()
    lines: list[str] = []
    engine, model = Engine([a, b], tmp_path / "run", lines), Policy()
    alone = Engine([reference], tmp_path / "reference", [])
    call(engine, model)
    a.delay = 30.0
    del a.bodies[:], b.bodies[:]
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(out=call(engine, model, seed=1)))
    worker.start()
    while len(a.bodies) < 3:
        time.sleep(0.01)
    killed = time.monotonic()
    a.kill()
    worker.join(30)
    noticed = time.monotonic() - killed
    assert "out" in result and noticed < 3.0, (noticed, lines)
    assert len(lines) == 1 and lines[0].startswith(f"vLLM server {a.url} dropped (")
    assert "its 3 requests of this call sent to the others; the run goes on with 1 of 2 servers" in lines[0]
    moved = sorted(json.dumps(body, sort_keys=True) for body in a.bodies)
    assert sorted(json.dumps(body, sort_keys=True) for body in b.bodies[3:]) == moved  # the same bodies, seeds too
    expected = call(alone, model, seed=1)
    assert all(torch.equal(x, y) for x, y in zip(result["out"], expected, strict=True))
    print(f"killed server noticed after {noticed:.2f} s")


def test_where_a_request_goes_depends_on_its_call_alone_so_a_resumed_run_deals_as_the_one_it_continues(fakes, tmp_path):
    """Calls of 3 groups over 2 servers (an odd count: dealing that went on from the last call's end
    would send the fourth call elsewhere after a resume); a fresh engine, as a resumed run has, sends
    each body of that call to the server the first engine sent it to; one-request calls, sampled and
    greedy, go to both servers."""
    a, b = fakes(), fakes()
    model = Policy()

    def where(engine, seed: int, groups: int = 3, sampling: Sampling = SAMPLING) -> dict[str, str]:
        for fake in (a, b):
            del fake.bodies[:]
        call(engine, model, groups=groups, sampling=sampling, seed=seed)
        return {json.dumps(body, sort_keys=True): fake.url for fake in (a, b) for body in fake.bodies}

    first = Engine([a, b], tmp_path / "run", [])
    for seed in range(3):
        where(first, seed)
    dealt = where(first, 3)
    assert len(dealt) == 3 and set(dealt.values()) == {a.url, b.url}  # round-robin within the call
    vs.CLAIMS.let_go()
    assert where(Engine([a, b], tmp_path / "run", []), 3) == dealt  # the resumed run's engine starts afresh
    greedy = Sampling(greedy=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=4, eos_token_id=None,
                      pad_token_id=0)
    singles = [where(first, seed, groups=1, sampling=sampling) for seed in range(8) for sampling in (SAMPLING, greedy)]
    assert {url for one in singles for url in one.values()} == {a.url, b.url}
    assert [vs.first_server([vs.Job([0], {"seed": 7, "prompt": [1]})], n) for n in (1, 2, 3)] == [0, 1, 1]


def test_a_silent_server_is_found_by_its_health_check_within_seconds(fakes, quick, tmp_path):
    a, b = fakes(), fakes()
    lines: list[str] = []
    engine, model = Engine([a, b], tmp_path / "run", lines), Policy()
    call(engine, model)
    a.delay = 30.0
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(out=call(engine, model, seed=1)))
    worker.start()
    while len(a.bodies) < 4:
        time.sleep(0.01)
    frozen = time.monotonic()
    a.freeze()
    worker.join(30)
    noticed = time.monotonic() - frozen
    bound = budgets.HEALTH_MISSES * (budgets.HEALTH_EVERY_S + budgets.HEALTH_TIMEOUT_S) + 0.5
    assert "out" in result and noticed < bound, (noticed, lines)
    assert f"vLLM server {a.url} dropped (GET /health: no answer in 0.3 s (2 checks in a row))" in lines[0]


def test_a_dropped_server_is_taken_back_when_it_answers_again(fakes, quick, tmp_path):
    a, b = fakes(), fakes()
    lines: list[str] = []
    engine, model = Engine([a, b], tmp_path / "run", lines), Policy()
    call(engine, model)
    a.kill()
    call(engine, model, seed=1)
    assert len(lines) == 1 and "dropped" in lines[0]
    pushes = len(engine.pushes)
    call(engine, model, seed=2)  # still down: no line, no push, b alone
    assert len(lines) == 1 and len(engine.pushes) == pushes
    a.restart()  # a fresh server: no weights, no claim
    del a.bodies[:]
    call(engine, model, seed=3)
    assert lines[1] == (f"vLLM server {a.url} answers again: taken back (its model checked; this run's weights are "
                        "sent to it before it samples)")
    assert engine.pushes[pushes:] == [a.url] and a.version == b.version  # this run's weights, version checked
    assert a.book.run == engine.run and a.bodies  # claimed again, and sampling
    assert [p for p, m in a.posts() if p == "collective_rpc"]


def test_a_server_another_model_now_is_not_taken_back(fakes, quick, tmp_path):
    a, b = fakes(), fakes()
    lines: list[str] = []
    engine, model = Engine([a, b], tmp_path / "run", lines), Policy()
    call(engine, model)
    a.kill()
    call(engine, model, seed=1)
    a.config = {**ESSENTIALS, "num_hidden_layers": 4}
    a.restart()
    call(engine, model, seed=2)
    call(engine, model, seed=3)  # said once
    assert len(lines) == 2 and lines[1].startswith(f"vLLM server {a.url} answers again but is not taken back: ")
    assert "its num_hidden_layers is 4, the run's model's 2" in lines[1]


def test_the_run_stops_with_engine_failed_when_no_server_is_left(fakes, quick, tmp_path):
    a, b = fakes(), fakes()
    lines: list[str] = []
    engine, model = Engine([a, b], tmp_path / "run", lines), Policy()
    call(engine, model)
    a.kill()
    b.kill()
    with pytest.raises(EngineFailed) as failed:
        call(engine, model, seed=1)
    message = str(failed.value)
    assert "\n" not in message and message.startswith("no vLLM server left (")
    assert f"{a.url}: " in message and f"{b.url}: " in message and "restart them (textrl vllm-serve MODEL)" in message
    assert "checkpoint" not in message


def test_a_server_holding_another_runs_weights_is_dropped_and_its_groups_drawn_again(fakes, quick, tmp_path):
    a, b = fakes(), fakes()
    lines: list[str] = []
    engine, model = Engine([a, b], tmp_path / "run", lines), Policy()
    call(engine, model)
    a.version = "f" * 64  # another run's push landed there
    call(engine, model, seed=1)
    assert lines[0].startswith(f"vLLM server {a.url} dropped (it holds weights this run did not send, version ffffffffffff")


def test_the_push_of_a_server_that_stops_answering_is_left_in_seconds(fakes, quick):
    """The weight-push step runs on a thread while the server's health is polled; once it stops
    answering the step is told to stop (its client's ``stop``) and the engine goes on."""
    fake = fakes()
    server = vs.Server(fake.url)
    server.client = vs.HTTPClient(server)
    started = threading.Event()

    def push():  # a transfer waiting on its peer, which stops when told to
        started.set()
        server.client.stop.wait(60)
        raise ConnectionError("abandoned")

    threading.Timer(0.3, fake.kill).start()
    start = time.monotonic()
    with pytest.raises(vs.ServerDown, match="the weight push: it stopped answering \\(GET /health: connection refused\\)"):
        vs.VLLMServerEngine._watched(server, push, "the weight push")
    assert server.client.stop.is_set() and time.monotonic() - start < 2.0
    with pytest.raises(vs.ServerDown, match=r"the weight push broke \(Connection closed by peer\)"):
        vs.VLLMServerEngine._watched(server, lambda: (_ for _ in ()).throw(RuntimeError("Connection closed by peer")),
                                     "the weight push")


PEER = """
import os, signal, sys, datetime, torch
store = torch.distributed.TCPStore("127.0.0.1", int(sys.argv[1]), 2, is_master=False,
                                   timeout=datetime.timedelta(seconds=30))
group = torch.distributed.ProcessGroupGloo(store, 1, 2, datetime.timedelta(seconds=30))
print("joined", flush=True)
os.kill(os.getpid(), signal.SIGSTOP)  # alive, never receiving: a peer gone silent
"""

ROOT = """
import datetime, sys, time, torch
from textrl.generation import gloo

gloo.OP_FLOOR = datetime.timedelta(seconds=1)
group = gloo.gloo_group("127.0.0.1", int(sys.argv[1]), 0, 2)
asked_at = time.monotonic() + 0.5
failure = ConnectionError("the server's /update_weights failed")
try:
    gloo.broadcast(group, torch.ones(1 << 20), lambda: failure if time.monotonic() > asked_at else None)
except ConnectionError:
    print(f"left {time.monotonic() - asked_at:.2f} s after the failure", flush=True)
"""


def test_a_gloo_broadcast_to_a_silent_peer_is_left_at_the_other_sides_failure_and_holds_no_exit():
    """The trainer (a process of its own) broadcasts 4 MB to a peer that stopped: it leaves the
    broadcast within a slice of the failure it is told of, and the broadcast left pending fails by
    itself within its timeout (1 s here, the size's share nothing), so the process ends at once.
    Without them it waited for the group's timeout, and again at exit (abort and shutdown do not
    end the wait)."""
    from textrl.generation import gloo

    port = vs.free_port()
    peer = subprocess.Popen([sys.executable, "-c", PEER, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        start = time.monotonic()
        root = subprocess.run([sys.executable, "-c", ROOT, str(port)], capture_output=True, text=True, timeout=120)
        took = time.monotonic() - start
    finally:
        os.kill(peer.pid, signal.SIGKILL)
        peer.wait()
    assert root.returncode == 0, root.stderr[-2000:]
    left = float(root.stdout.split()[1])
    assert left < 2 * gloo.WAIT_SLICE.total_seconds() + 0.2, root.stdout
    assert took < 20, took  # the interpreter's start, the group, 0.5 s, the 1 s timeout: not the group's 2 minutes
    assert gloo.op_timeout(10**9) == gloo.OP_FLOOR + datetime.timedelta(seconds=100)


class RacedWork:
    """A broadcast whose first slice times out and which completes, with ``error`` or sent, before the
    trainer looks at it (its thread descheduled in between, on a busy machine)."""

    def __init__(self, error: BaseException | None) -> None:
        self.error, self.waits = error, 0

    def wait(self, timeout=None) -> None:
        self.waits += 1
        if timeout is not None and self.waits == 1:
            raise RuntimeError("Operation timed out!")  # the slice's timeout
        if self.error is not None:
            raise self.error

    def is_completed(self) -> bool:
        return self.waits >= 1


class OneWorkGroup:
    def __init__(self, work: RacedWork) -> None:
        self.work = work

    def set_timeout(self, timeout) -> None:
        pass

    def broadcast(self, tensors, options) -> RacedWork:
        return self.work


@pytest.mark.parametrize("error", [None, RuntimeError("Connection closed by peer")], ids=["sent", "failed"])
def test_a_broadcast_done_just_after_its_slice_timed_out_counts_as_it_ended(error):
    """Its own outcome, not the slice's timeout: before, a push that had arrived was said broken
    (``the weight push broke (Operation timed out!)``) and a run's only server dropped (seen 2 times in
    about 10 served runs on the shared 2-core machine; against real gloo with 10 ms between the slice's
    timeout and the look, 42 broadcasts of 100 that had arrived)."""
    from textrl.generation import gloo

    group = OneWorkGroup(RacedWork(error))
    if error is None:
        gloo.broadcast(group, torch.ones(2), lambda: None)
    else:
        with pytest.raises(RuntimeError, match="Connection closed by peer"):
            gloo.broadcast(group, torch.ones(2), lambda: None)
    assert group.work.waits == 2


# -- before any work -------------------------------------------------------------------------------------------
def config_for(urls, output_dir, model="tiny"):
    return SimpleNamespace(vllm_server=",".join(urls), model=model, output_dir=str(output_dir), seed=0)


@pytest.fixture
def trained_tiny(monkeypatch):
    """The run's model's essentials as the fakes' (no model folder read)."""
    monkeypatch.setattr(claims, "trained_essentials", lambda model: dict(ESSENTIALS))


def test_a_url_that_is_not_a_vllm_server_is_named_in_one_line(tmp_path, trained_tiny):
    (tmp_path / "index.txt").write_text("hello")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    handler.log_message = lambda *args: None
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        with pytest.raises(ValueError) as refused:
            vs.check_servers(config_for([url], tmp_path / "run"), log=lambda line: None)
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert str(refused.value) == (f"{url} is not a vLLM server (GET /v1/models answered HTTP 404 text/html): point "
                                  "--vllm-server at a server started with textrl vllm-serve MODEL")


def test_a_port_where_nothing_listens_is_named_before_any_work(tmp_path, trained_tiny):
    url = f"http://127.0.0.1:{vs.free_port()}"
    with pytest.raises(ValueError, match=rf"^vLLM server {url} does not answer GET /v1/models \(connection refused\)"):
        vs.check_servers(config_for([url], tmp_path / "run"))


def test_the_model_is_checked_by_its_config_not_its_folder_name(fakes, tmp_path, trained_tiny):
    same, other = fakes("/elsewhere/another-name"), fakes("/srv/models/tiny", {**ESSENTIALS, "hidden_size": 128})
    lines: list[str] = []
    vs.check_servers(config_for([same.url], tmp_path / "a"), log=lines.append)
    assert lines == [f"vLLM server {same.url}: serves /elsewhere/another-name (llama, 2 layers, hidden 64, vocab 300), "
                     "weight transfer textrl_gloo"]
    with pytest.raises(ValueError) as refused:
        vs.check_servers(config_for([other.url], tmp_path / "b"))
    assert str(refused.value) == (f"vLLM server {other.url} serves another model than the run's (/srv/models/tiny: its "
                                  "hidden_size is 128, the run's model's 64): start it on the run's model (textrl "
                                  "vllm-serve MODEL)")
    assert not other.posts() or all(p == "collective_rpc" and m == "textrl_model_config" for p, m in other.posts())


@pytest.mark.parametrize("fault, said", [
    ({"rpc": False}, "has no /collective_rpc route (vLLM's dev routes, which weight updates need, are off)"),
    ({"routes": ("init_weight_transfer_engine",)}, "has no /start_weight_update, /update_weights, /finish_weight_update route"),
    ({"transfer": None}, "was started without a weight-transfer backend (--weight-transfer-config)"),
], ids=["no-dev-routes", "no-weight-routes", "no-transfer-backend"])
def test_a_server_without_what_a_run_needs_is_named_in_one_line(fakes, tmp_path, trained_tiny, fault, said):
    fake = fakes(**fault)
    with pytest.raises(ValueError) as refused:
        vs.check_servers(config_for([fake.url], tmp_path / "run"))
    assert str(refused.value).startswith(f"vLLM server {fake.url} {said}") and "\n" not in str(refused.value)
    assert "textrl vllm-serve MODEL" in str(refused.value)


# -- one run per server ---------------------------------------------------------------------------------------
def test_a_second_run_is_stopped_at_its_start_and_the_first_goes_on_untouched(fakes, quick, tmp_path, trained_tiny):
    a, b = fakes(), fakes()
    lines: list[str] = []
    first, model = Engine([a, b], tmp_path / "first", lines), Policy()
    call(first, model)
    seen = len(b.log)
    with pytest.raises(vs.ServerBusy) as refused:
        vs.check_servers(config_for([b.url], tmp_path / "second"))
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"vLLM server {b.url} is in use by another run (")
    assert f"{vs.run_id(tmp_path / 'first')}, since " in message and "last seen 0 s ago); give each run servers of its own" in message
    second_asked = [(verb, path, method) for verb, path, method in b.log[seen:] if verb == "POST"]
    assert {(path, method) for _, path, method in second_asked} <= {("collective_rpc", "textrl_model_config"),
                                                                    ("collective_rpc", "textrl_claim")}
    call(first, model, seed=1)
    assert not lines and b.book.run == first.run  # the first run goes on, its claim untouched


def test_a_claim_is_renewed_while_the_run_lives_and_given_back_when_it_ends(fakes, quick, tmp_path, trained_tiny):
    fake = fakes()
    first, model = Engine([fake], tmp_path / "first", []), Policy()
    call(first, model)
    time.sleep(2.5 * budgets.LEASE_S)  # leases: renewed meanwhile
    with pytest.raises(vs.ServerBusy):
        vs.check_servers(config_for([fake.url], tmp_path / "second"))
    first.close()
    assert fake.book.run is None
    vs.check_servers(config_for([fake.url], tmp_path / "second"))  # at once
    assert fake.book.run == vs.run_id(tmp_path / "second")


def test_a_stale_claim_is_taken_over_in_one_line(fakes, quick, tmp_path, trained_tiny):
    fake = fakes()
    fake.book.claim("crashed-host:/runs/old", budgets.LEASE_S, clock=time.monotonic() - 2 * budgets.LEASE_S)
    lines: list[str] = []
    vs.check_servers(config_for([fake.url], tmp_path / "run"), log=lines.append)
    assert lines[0].startswith(f"vLLM server {fake.url}: the claim of run crashed-host:/runs/old was not renewed for 4 s")
    assert lines[0].endswith("this run takes the server over") and fake.book.run == vs.run_id(tmp_path / "run")


def test_a_resumed_run_takes_its_own_claim_back_at_once(fakes, quick, tmp_path, trained_tiny):
    fake = fakes()
    fake.book.claim(vs.run_id(tmp_path / "run"), budgets.LEASE_S)  # the run before it crashed a moment ago
    lines: list[str] = []
    vs.check_servers(config_for([fake.url], tmp_path / "run"), log=lines.append)
    assert len(lines) == 1 and "takes the server over" not in lines[0]


def test_a_server_whose_claim_another_run_took_is_dropped_at_the_next_call(fakes, quick, tmp_path):
    a, b = fakes(), fakes()
    lines: list[str] = []
    engine, model = Engine([a, b], tmp_path / "run", lines), Policy()
    call(engine, model)
    a.book = vs.LeaseBook()  # another run took it over (this run's renewals had stopped), and renews its claim
    deadline = time.monotonic() + 10  # the renewal thread may still sleep the period of a test before
    while vs.CLAIMS.lost(a.url, engine.run) is None and time.monotonic() < deadline:
        a.book.claim("other-host:/runs/other", budgets.LEASE_S)
        time.sleep(0.05)
    call(engine, model, seed=1)
    assert lines[0].startswith(f"vLLM server {a.url} dropped (another run took it over (other-host:/runs/other) when "
                               "this run's claim was not renewed for over 2 s)")


def test_only_the_first_process_claims_even_before_the_process_group_is_up(fakes, tmp_path, trained_tiny, monkeypatch):
    """Under torchrun the trainer checks its servers before its process group is set up: the
    launcher's RANK decides (every process checks, rank 0 alone claims: another machine's rank 1
    would hold another run id)."""
    fake = fakes()
    monkeypatch.setenv("RANK", "1")
    vs.check_servers(config_for([fake.url], tmp_path / "run"), log=lambda line: None)
    assert fake.book.run is None and ("collective_rpc", "textrl_model_config") in fake.posts()
    monkeypatch.setenv("RANK", "0")
    vs.check_servers(config_for([fake.url], tmp_path / "run"), log=lambda line: None)
    assert fake.book.run == vs.run_id(tmp_path / "run")


def test_a_second_run_on_the_first_runs_folder_leaves_the_first_runs_claim_alone(fakes, quick, tmp_path, trained_tiny,
                                                                                  monkeypatch):
    """The run's id in its claims is its folder: a second ``textrl train`` on a folder a live run
    holds is refused at the folder's lock, before it claims (or gives back) anything on the servers,
    also where the first run took the folder after the second one's early probe (left out here)."""
    from textrl.config import TrainConfig
    from textrl.run import RunFolderBusy
    from textrl.training import run_checks
    from textrl.training.trainer import train

    monkeypatch.setattr(run_checks, "refuse_busy_folder", lambda folder: None)  # the race: the probe found it free

    fake, folder = fakes(), tmp_path / "run"
    hold = ("import sys, time\nfrom textrl.run import RunFolderLock\nwith RunFolderLock(sys.argv[1]):\n"
            "    print('held', flush=True)\n    time.sleep(120)\n")
    holder = subprocess.Popen([sys.executable, "-c", hold, str(folder)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        fake.book.claim(vs.run_id(folder), budgets.LEASE_S)  # the live first run's claim, renewed from its process
        config = TrainConfig(output_dir=str(folder), vllm_server=fake.url, iterations=1, warmup_sft_steps=0,
                             progress=False)
        with pytest.raises(RunFolderBusy, match=f"process {holder.pid}"):
            train(config)
        assert fake.book.run == vs.run_id(folder)
        assert not [method for _, _, method in fake.log if method in ("textrl_claim", "textrl_release")]
    finally:
        holder.kill()
        holder.wait()
