"""Served rollouts (``textrl train --vllm-server``) against real vLLM servers on localhost started
with ``textrl vllm-serve``: two servers and a trainer in two gloo processes, the weights pushed after
every update (the logged gap stays at float noise), resume, a call's draws from the run's random
stream, a server serving another model, a server killed mid-run, and an asynchronous run stopped by
SIGTERM while its actor draws, then resumed. Marked ``vllm`` (and ``slow``: each server takes 30-90 s to start); the
errors for a server that does not answer run everywhere.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.runs import checkpoint_tensors, metrics
from textrl.cli import main
from textrl.generation.vllm_server import choice_rows, completion_request, server_urls
from textrl.run import latest_checkpoint
from textrl.testing.servers import wait_until_serving

SMALL = [
    "--prompts-per-iteration", "4", "--n-samples-per-prompt", "2", "--max-new-tokens", "8",
    "--warmup-sft-steps", "3", "--eval-size", "4", "--eval-every", "0", "--progress", "false",
    "--ppo-epochs", "1", "--num-minibatches", "2", "--device", "cpu",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- everywhere ---------------------------------------------------------------------------------------
def test_server_urls_take_a_comma_separated_list():
    assert server_urls("localhost:8000, http://h:9/") == ["http://localhost:8000", "http://h:9"]
    with pytest.raises(ValueError, match="comma-separated list"):
        server_urls("http://a:1,,http://b:2")


def test_a_completion_request_draws_what_the_agents_describe():
    from textrl.generation import Sampling

    sampling = Sampling(greedy=False, temperature=0.7, top_k=5, top_p=0.9, max_new_tokens=6, eos_token_id=3,
                        pad_token_id=0)
    body = completion_request("m", [1, 2], 4, sampling, seed=9, logprobs=True)
    assert body["n"] == 4 and body["prompt"] == [1, 2] and body["seed"] == 9 and body["logprobs"] == 0
    assert "seed" not in completion_request("m", [1, 2], 1, sampling, seed=None, logprobs=False)  # greedy: none
    assert (body["temperature"], body["top_k"], body["top_p"]) == (0.7, 5, 0.9)
    assert body["stop_token_ids"] == [3] and body["ignore_eos"] and body["return_token_ids"]
    answer = {"choices": [{"index": 1, "token_ids": [7], "logprobs": {"token_logprobs": [-0.5]}},
                          {"index": 0, "token_ids": [5, 3], "logprobs": {"token_logprobs": [-1.0, -2.0]}}]}
    assert choice_rows(answer, True) == [([5, 3], [-1.0, -2.0]), ([7], [-0.5])]


def test_a_server_that_does_not_answer_stops_the_run_naming_its_url(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TEXTRL_CACHE", str(tmp_path / "cache"))
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(SystemExit) as stop:
        main(["train", "--iterations", "1", "--output-dir", str(tmp_path / "run"), "--vllm-server", url, *SMALL,
              "--warmup-sft-steps", "0"])
    message = str(stop.value)
    assert f"vLLM server {url} does not answer GET /v1/models (connection refused)" in message
    assert "\n" not in message.strip() and "textrl vllm-serve MODEL" in message


def test_servers_with_another_engine_are_refused(tmp_path):
    with pytest.raises(SystemExit, match="--vllm-server samples from vLLM servers, but --generation-engine hf"):
        main(["train", "--output-dir", str(tmp_path / "run"), "--vllm-server", "http://a:1", "--generation-engine", "hf"])


@pytest.mark.parametrize("engine", [["--vllm-server", "http://a:1"], ["--generation-engine", "vllm-server"],
                                    ["--generation-engine", "vllm"]], ids=["served", "served-engine", "vllm"])
@pytest.mark.parametrize("agent", [["--lora-r", "8"], ["--agent", "multi_adapter_ppo"]], ids=["lora", "multi-adapter"])
def test_a_lora_policy_on_a_4bit_base_with_vllm_is_refused_in_one_line_before_any_work(tmp_path, engine, agent):
    with pytest.raises(SystemExit) as stop:
        main(["train", "--output-dir", str(tmp_path / "run"), *agent, "--load-in-4bit", "true", *engine])
    message = str(stop.value)
    assert "\n" not in message.strip() and "with a 4-bit base (--load-in-4bit)" in message
    assert message.count("--generation-engine vllm" if engine[-1] == "vllm" else "--vllm-server") >= 1
    assert "drop --load-in-4bit, or use --generation-engine textrl or hf" in message
    assert not (tmp_path / "run").exists()


def test_a_4bit_model_object_with_vllm_is_refused():
    from textrl.config import TrainConfig

    class Quantised:  # what transformers marks a bitsandbytes model with
        is_loaded_in_4bit = True

    with pytest.raises(ValueError, match=r"^--vllm-server with a 4-bit base"):
        TrainConfig(model=Quantised(), vllm_server="http://a:1").validate()


# -- against vLLM servers -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def folder(served_folder):
    """The tiny model the shared servers serve (tests/generation/conftest.py)."""
    return served_folder


def start_server(model: Path, log: Path, port: int | None = None, cores: str | None = None) -> tuple[subprocess.Popen, str]:
    """A ``textrl vllm-serve`` of ``model`` on ``port`` (a free one), its worker on ``cores`` (vLLM's
    own choice: the first core, for every server)."""
    port = port or free_port()
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "OMP_NUM_THREADS": "1"}
    if cores is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cores
    cmd = [sys.executable, "-m", "textrl.cli", "vllm-serve", str(model), "--port", str(port), "--dtype", "float32",
           "--max-model-len", "512", "--kv-cache-memory-bytes", str(128 << 20), "--enforce-eager"]
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("a"), stderr=subprocess.STDOUT, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


wait_ready = wait_until_serving


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def train(out: Path, folder: Path, servers: list[str], *args: str, processes: int = 1,
          check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "TEXTRL_CACHE": str(out.parent / "cache"), "OMP_NUM_THREADS": "1"}
    launch = ([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={processes}",
               f"--master_port={free_port()}", "-m", "textrl.cli"] if processes > 1 else [sys.executable, "-m", "textrl.cli"])
    cmd = [*launch, "train", "--output-dir", str(out), "--model", str(folder), "--vllm-server", ",".join(servers),
           *SMALL, *args]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if check:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.mark.vllm
@pytest.mark.slow
def test_two_servers_and_two_trainer_processes_train_with_the_new_weights_each_iteration(tmp_path, folder, servers):
    out = tmp_path / "run"
    train(out, folder, servers, "--iterations", "3", processes=2)
    rows = metrics(out)
    assert [r["iteration"] for r in rows] == [1, 2, 3] and all(r["samples"] == 8 for r in rows)
    for row in rows:  # stale weights on a server would show as a gap of the update's size (~1e-2)
        assert row["rollout/staleness"] == 0.0
        assert row["rollout/logprob_gap_max"] < 1e-4, row
    summary = json.loads((out / "summary.json").read_text())
    assert summary["processes"] == 2


@pytest.mark.vllm
@pytest.mark.slow
def test_a_served_run_resumes_with_its_checkpoints_weights_on_the_servers(tmp_path, folder, servers):
    """The servers hold another run's weights when the run resumes: its first rollout must come from
    the checkpoint's (sent at the first call), or the logged gap would be of a whole run's training.
    Not bitwise the run it continues: a server batches concurrent requests as they arrive, and a
    batch of another shape sums its float32 products in another order (docs/vllm.md)."""
    part, other = tmp_path / "part", tmp_path / "other"
    train(part, folder, servers, "--iterations", "2")
    train(other, folder, servers, "--iterations", "3", "--actor-lr", "3e-2", "--seed", "1")  # the servers move on
    train(part, folder, servers, "--iterations", "3", "--resume")
    rows = metrics(part)
    assert [r["iteration"] for r in rows] == [1, 2, 3] and rows[2]["samples"] == 8
    assert rows[2]["rollout/staleness"] == 0.0 and rows[2]["rollout/logprob_gap_max"] < 1e-4, rows[2]
    assert metrics(other)[0]["rollout/logprob_gap_max"] < 1e-4  # the other run's first rollout: its own weights too


@pytest.mark.vllm
@pytest.mark.slow
def test_served_asynchronous_rollouts_are_exactly_k_updates_behind(tmp_path, folder, servers):
    """--max-staleness 1 with two servers: the actor's engine (one per run) sends the servers the
    weights of iteration n - 1 before drawing rollout n, while the learner trains on rollout n - 1;
    the held-out evaluation samples from the servers with the learner's weights."""
    out = tmp_path / "run"
    train(out, folder, servers, "--iterations", "3", "--max-staleness", "1", "--eval-every", "3")
    rows = metrics(out)
    assert [r["rollout/staleness"] for r in rows] == [0.0, 1.0, 1.0]
    assert rows[0]["rollout/logprob_gap_max"] < 1e-4, rows[0]
    assert rows[2]["rollout/logprob_gap"] > 1e-4, rows[2]  # a step behind: the update's size
    assert "eval/greedy/reward/mean" in rows[2]


@pytest.mark.vllm
@pytest.mark.slow
def test_a_lora_policy_is_served_merged_with_its_adapter(tmp_path, folder, servers):
    """A server has no adapter: it gets the base with the adapter merged in after each update (the base
    alone would be off by the adapter's trained delta in the logged gap)."""
    out = tmp_path / "run"
    train(out, folder, servers, "--iterations", "3", "--lora-r", "4", "--actor-lr", "3e-2")
    for row in metrics(out):
        assert row["rollout/logprob_gap_max"] < 1e-4, row


@pytest.mark.vllm
@pytest.mark.slow
def test_a_server_serving_another_model_is_named_by_its_config_not_its_folder_name(tmp_path, folder, servers):
    """The same model under another folder name trains; a model of another config (3 layers where the
    server's has 2) is refused in one line naming the field, before it sends the server anything."""
    from textrl.models import build_tiny_causal_lm, build_tiny_tokenizer

    renamed = tmp_path / "renamed-model"
    renamed.symlink_to(folder, target_is_directory=True)
    train(tmp_path / "renamed", renamed, servers[:1], "--iterations", "1")
    other = tmp_path / "tiny32"  # the served folder's name, another model
    tok = build_tiny_tokenizer()
    build_tiny_causal_lm(tok, num_attention_heads=2, num_hidden_layers=3).save_pretrained(other)
    tok.save_pretrained(other)
    result = train(tmp_path / "run", other, servers[:1], "--iterations", "1", check=False)
    assert result.returncode == 1
    line = [ln for ln in result.stderr.splitlines() if ln.startswith("textrl train: ")][-1]
    assert line.startswith(f"textrl train: vLLM server {servers[0]} serves another model than the run's"), line
    assert "its num_hidden_layers is 2, the run's model's 3" in line


class Watched:
    """A ``textrl train`` process whose output lines are read as they come, each with its time."""

    def __init__(self, cmd: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: list[tuple[float, str]] = []
        self.errors: list[tuple[float, str]] = []
        self.readers = [threading.Thread(target=self._read, args=(stream, into), daemon=True)
                        for stream, into in ((self.proc.stdout, self.lines), (self.proc.stderr, self.errors))]
        for reader in self.readers:
            reader.start()

    @staticmethod
    def _read(stream, into: list) -> None:
        for line in stream:
            into.append((time.monotonic(), line.rstrip("\n")))

    def end(self, timeout: float) -> int:
        """Wait for the run to end, and for its output to be read."""
        self.proc.wait(timeout=timeout)
        for reader in self.readers:
            reader.join(10)
        return self.proc.returncode

    def wait_for(self, text: str, timeout: float) -> float:
        """When the first output line holding ``text`` came (fails if the run ended or ``timeout`` passed)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for at, line in list(self.lines) + list(self.errors):
                if text in line:
                    return at
            assert self.proc.poll() is None, self.tail()
            time.sleep(0.05)
        raise AssertionError(f"no line with {text!r} in {timeout:.0f} s:\n{self.tail()}")

    def tail(self) -> str:
        return "\n".join(line for _, line in (self.lines + self.errors)[-40:])


def wait_rows(out: Path, rows: int, run: Watched, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while not (out / "metrics.jsonl").exists() or len(metrics(out)) < rows:
        assert run.proc.poll() is None and time.monotonic() < deadline, run.tail()
        time.sleep(0.2)


@pytest.mark.vllm
@pytest.mark.slow
def test_a_killed_server_is_dropped_taken_back_when_restarted_and_the_last_one_killed_stops_the_run(tmp_path, folder):
    """Two servers of its own: one killed (kill -9) mid-run is dropped within seconds and the run goes
    on with the other; restarted on its port, it is taken back (the run's weights sent, the logged gap
    still at float noise); then both killed: EngineFailed naming both, in seconds."""
    logs = [tmp_path / "x.log", tmp_path / "y.log"]
    # each worker on a core of its own: vLLM binds every server's to the first, where the busy one's
    # threads starve a restarted one's start (seen: no progress in 15 minutes)
    started = [start_server(folder, log, cores=str(core)) for core, log in zip((1, 0), logs, strict=True)]
    try:
        for (proc, url), log in zip(started, logs, strict=True):
            wait_ready(proc, url, log)
        (x, x_url), (y, y_url) = started
        out = tmp_path / "run"
        env = {**os.environ, "TEXTRL_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
        run = Watched(["nice", "-n", "19",  # the restarted server's start (minutes on 2 cores) comes first
                       sys.executable, "-m", "textrl.cli", "train", "--output-dir", str(out), "--model", str(folder),
                       "--vllm-server", f"{x_url},{y_url}", *SMALL, "--iterations", "100000", "--checkpoint-every", "1"],
                      env)
        wait_rows(out, 2, run)
        killed = time.monotonic()
        stop(x, signal.SIGKILL)
        noticed = run.wait_for(f"vLLM server {x_url} dropped (", 60) - killed
        started[0] = start_server(folder, logs[0], port=int(x_url.rsplit(":", 1)[1]), cores="1")
        wait_ready(started[0][0], x_url, logs[0], timeout=900)
        back = run.wait_for(f"vLLM server {x_url} answers again: taken back", 120)
        rows_back = len(metrics(out))
        wait_rows(out, rows_back + 2, run)
        assert not [ln for at, ln in run.lines if at > back and "dropped" in ln], run.tail()
        both = time.monotonic()
        stop(started[0][0], signal.SIGKILL)
        stop(y, signal.SIGKILL)
        run.end(timeout=300)
        stopped = time.monotonic() - both
    finally:
        for proc, _ in started:
            stop(proc, signal.SIGKILL)
    assert run.proc.returncode == 1, run.tail()
    line = [ln for _, ln in run.errors if ln.startswith("textrl train: ")][-1]
    assert "no vLLM server left (" in line and x_url in line and y_url in line, line  # EngineFailed's message
    assert "checkpoint stands" not in line and "restart them (textrl vllm-serve MODEL)" in line
    rows = metrics(out)
    assert len(rows) >= rows_back + 2
    for row in rows:  # the taken-back server sampled with the run's weights: else its rows' gap would show it
        assert row["rollout/staleness"] == 0.0 and row["rollout/logprob_gap_max"] < 1e-4, row
    checkpoint = latest_checkpoint(out)
    assert int(checkpoint.name.removeprefix("iter_")) == rows[-1]["iteration"]  # metrics and checkpoint agree
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(checkpoint / "policy")  # intact
    assert noticed < 10.0
    print(f"a killed server noticed after {noticed:.2f} s; the last two killed: the run stopped after {stopped:.2f} s")


SLOW_RUN = """
import sys, time
from textrl.agents.async_actor import AsyncRollouts
from textrl.cli import entry
from textrl.generation.vllm_server import VLLMServerEngine

seconds, sys.argv = float(sys.argv[1]), ["textrl", *sys.argv[2:]]
generate, rest = VLLMServerEngine.generate_with_logprobs, AsyncRollouts._rest

def slow(self, *args, **kwargs):  # a slow server: each rollout call seconds longer, its answer the same
    time.sleep(seconds)
    return generate(self, *args, **kwargs)

def said(self, n):  # the actor's rollout n cancelled (drawn again from its start)
    print(f"rollout {n} cancelled", file=sys.stderr, flush=True)
    return rest(self, n)

VLLMServerEngine.generate_with_logprobs, AsyncRollouts._rest = slow, said
entry()
"""


@pytest.mark.vllm
@pytest.mark.slow
def test_sigterm_during_a_slow_served_rollout_stops_within_one_call_and_the_resume_is_exact(tmp_path, folder, servers):
    """--max-staleness 2, each rollout call (one request: 2 rows of one prompt) 4 s slower, so the actor
    is always drawing: SIGTERM in iteration 3 finishes it, cancels the actor's next rollout between two
    of its calls (not at its end, a whole rollout later), saves iteration 3 with that rollout to draw
    again and exits with 143, less than one iteration after iteration 3 ended. Resumed to iteration 4,
    its rows and tensors are the uninterrupted run's, bit for bit: one request a call and one server, so
    each batch vLLM computes has the same shape in both (concurrent requests batch as they arrive)."""
    settings = ["--iterations", "4", "--max-staleness", "2", "--generation-batch-size", "2"]
    full, out = tmp_path / "full", tmp_path / "run"
    train(full, folder, servers[:1], *settings)
    env = {**os.environ, "TEXTRL_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    run = Watched([sys.executable, "-c", SLOW_RUN, "4.0", "train", "--output-dir", str(out), "--model", str(folder),
                   "--vllm-server", servers[0], *SMALL, *settings], env)
    wait_rows(out, 2, run)
    time.sleep(1.0)  # past iteration 2's stop check: the signal lands in iteration 3, the actor drawing its rollout
    sent = time.monotonic()
    run.proc.send_signal(signal.SIGTERM)
    ended: dict[int, float] = {}  # when each iteration's row came
    while run.proc.poll() is None:
        ended.setdefault((out / "metrics.jsonl").read_text().count("\n"), time.monotonic())  # whole rows
        time.sleep(0.05)
    exited = time.monotonic()
    assert run.end(timeout=60) == 128 + signal.SIGTERM, run.tail()
    rows = metrics(out)
    stopped = rows[-1]["iteration"]
    checkpoint = latest_checkpoint(out)
    line = [ln for _, ln in run.errors if ln.startswith("textrl train: ")][-1]
    assert line.startswith(f"textrl train: stopped by SIGTERM after iteration {stopped} of 4; checkpoint saved in "
                           f"{checkpoint}"), line
    assert stopped == 3 and checkpoint.name == "iter_000003"
    cancelled = [at for at, ln in run.errors if ln == f"rollout {stopped} cancelled"]  # iteration 4's, 0-based
    assert cancelled and sent < cancelled[0] < exited, run.tail()
    pipeline = torch.load(checkpoint / "trainer_state.pt", weights_only=False)["sampler"]["async"]
    assert pipeline["in_flight"][0] == stopped and pipeline["queued"] == []  # drawn again from its start on resume
    iteration_s = min(row["time/iteration_s"] for row in rows[1:])  # one iteration of this run (the first starts it)
    after = exited - ended[stopped]
    print(f"SIGTERM to exit {exited - sent:.1f} s, of which {after:.1f} s after iteration {stopped} ended "
          f"(its rollout's call cancelled {cancelled[0] - ended[stopped]:.1f} s after); one iteration {iteration_s:.1f} s")
    assert after < iteration_s  # waiting for the cancelled rollout's end would be a whole iteration more

    train(out, folder, servers[:1], *settings, "--resume")
    trained = lambda row: {k: str(v) for k, v in row.items()  # noqa: E731
                           if not k.startswith(("time/", "memory/", "eval/")) and k not in ("tokens_per_second", "perf/tokens_per_s")}
    assert [trained(r) for r in metrics(out)] == [trained(r) for r in metrics(full)]
    a, b = (checkpoint_tensors(path / "checkpoints" / "iter_000004") for path in (full, out))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def trained_figures(row: dict) -> dict[str, str]:
    """A metrics row less what a run's timing and the held-out evaluation give (the figures of its training)."""
    return {k: str(v) for k, v in row.items()
            if not k.startswith(("time/", "memory/", "eval/")) and k not in ("tokens_per_second", "perf/tokens_per_s")}


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 2], ids=["k1", "k2"])
def test_a_resumed_asynchronous_run_on_two_servers_is_the_uninterrupted_one_bit_for_bit(tmp_path, folder, servers, k):
    """--max-staleness K over two servers, stopped after iteration 1 and resumed to 3: every figure and
    tensor the uninterrupted run's. Each call is one request (one prompt's 2 rows), so each batch a
    server computes has the same shape in both runs (concurrent requests on one server batch as they
    arrive: docs/vllm.md), and each request goes to the server the uninterrupted run sent it to (the
    dealing is a function of the call: test_served_faults.py). 3 calls an iteration, so dealing that
    went on from where the last call's ended sent every resumed call to the other server; on idle
    servers holding the same weights that drew the same tokens (measured: this passed with it too)."""
    settings = ["--iterations", "3", "--max-staleness", str(k), "--generation-batch-size", "2",
                "--prompts-per-iteration", "3", "--num-minibatches", "1"]
    full, out = tmp_path / "full", tmp_path / "run"
    train(full, folder, servers, *settings)
    train(out, folder, servers, *settings, "--iterations", "1")
    train(out, folder, servers, *settings, "--resume")
    rows = metrics(out)
    assert [r["iteration"] for r in rows] == [1, 2, 3] and rows[2]["rollout/staleness"] == float(k)
    assert [trained_figures(r) for r in rows] == [trained_figures(r) for r in metrics(full)]
    a, b = (checkpoint_tensors(path / "checkpoints" / "iter_000003") for path in (full, out))
    assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)


STREAM_PROBE = """
import json, random, sys
import numpy as np, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from textrl.generation import Sampling
from textrl.generation.vllm_server import VLLMServerEngine

folder, url = sys.argv[1], sys.argv[2]
model, tok = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
engine = VLLMServerEngine([url])
engine.trained = folder
enc = tok(["hi", "hi", "a b c", "Count to 3"], return_tensors="pt", padding=True)  # 3 distinct contexts

def streams():
    return repr((random.getstate(), np.random.get_state()[1].tolist(), torch.get_rng_state().tolist()))

def seeded():
    random.seed(11); np.random.seed(11); torch.manual_seed(11)

out = []
for greedy in (True, False, True):  # the first call connects and sends the weights
    sampling = Sampling(greedy=greedy, temperature=1.0, top_k=0, top_p=0.9, max_new_tokens=4,
                        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    seeded()
    if not greedy:
        torch.randint(0, 2**31 - 1, (3,))  # one seed per distinct context: all a call may take
    expected = streams()
    seeded()
    with torch.no_grad():
        tokens = engine.generate_with_logprobs(model, enc["input_ids"], enc["attention_mask"], sampling)[0]
    out.append(streams() == expected)
    if greedy:  # one request (vLLM refuses n > 1 when greedy), its answer both rows'
        out.append(torch.equal(tokens[0], tokens[1]) and tokens.shape[1] > 0)
print(json.dumps(out))
"""


@pytest.mark.vllm
@pytest.mark.slow
def test_a_served_call_takes_only_its_groups_seeds_from_the_runs_random_stream(tmp_path, folder, servers):
    """A greedy call (the held-out evaluation's, samples.jsonl's) takes nothing of the run's random
    stream, a sampled one one seed per distinct context; the first call's weight transfer nothing
    (in a process of its own: the transfer's group lives until the process ends). A greedy call with
    a context twice asks for it once."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", STREAM_PROBE, str(folder), servers[0]], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == [True] * 5


CORRUPT_PROBE = """
import json, sys, time
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from textrl.generation import Sampling
from textrl.generation import vllm_transfer
from textrl.generation.vllm_engine import WeightFingerprintError
from textrl.generation.vllm_server import VLLMServerEngine

folder, url = sys.argv[1], sys.argv[2]
model, tok = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
engine = VLLMServerEngine([url])
engine.trained = folder
enc = tok(["hi", "a b c"], return_tensors="pt", padding=True)
sampling = Sampling(greedy=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=4,
                    eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)

def bump():
    with torch.no_grad():
        next(model.parameters()).add_(1e-3)

engine.generate(model, enc["input_ids"], enc["attention_mask"], sampling)  # connects, sends, checks
seconds = []
for _ in range(3):  # a normal push each: checked and passed
    bump()
    start = time.perf_counter()
    engine.generate(model, enc["input_ids"], enc["attention_mask"], sampling)
    seconds.append(time.perf_counter() - start)
original, sent = vllm_transfer.broadcast, []

def corrupting(group, tensor, *rest):  # one weight arrives changed in its last bit (a packed bucket's first byte)
    if not sent:
        tensor = tensor.clone()
        tensor.view(torch.uint8).view(-1)[0] ^= 1
    sent.append(1)
    original(group, tensor, *rest)

vllm_transfer.broadcast = corrupting
bump()
try:
    engine.generate(model, enc["input_ids"], enc["attention_mask"], sampling)
    print(json.dumps({"stopped": None, "seconds": seconds}))
except WeightFingerprintError as err:
    print(json.dumps({"stopped": str(err), "seconds": seconds}))
"""


@pytest.mark.vllm
@pytest.mark.slow
def test_a_push_the_server_took_otherwise_stops_the_run_naming_the_server(tmp_path, folder, servers):
    """The server's workers fingerprint what their loads take; pushes that arrive as sent pass, one whose
    tensor changed by one ulp on the way stops the run in one line naming the server, the hand-over and
    both fingerprints (in a process of its own: the transfer's group lives until the process ends)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", CORRUPT_PROBE, str(folder), servers[1]], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    message = out["stopped"]
    assert message is not None and "\n" not in message
    assert message.startswith(f"vLLM server {servers[1]}: at weight hand-over 5 "), message
    sent, taken = (message.split(f"{key} ")[1][:12] for key in ("sent", "taken"))
    assert sent != taken and message.endswith("(docs/vllm.md)")  # an EngineFailed: the run saves, then says --resume
    print(f"served push with its check, tiny model: {max(out['seconds']):.3f} s at most")


@pytest.mark.vllm
@pytest.mark.slow
def test_a_second_run_on_a_server_is_stopped_at_its_start_and_the_first_finishes(tmp_path, folder, servers):
    """The first run claims the server; a second one finds the claim renewed seconds ago and stops in
    one line at its start, having paused, pushed or reset nothing there; the first goes on with its own
    weights (its logged gap at float noise throughout) and finishes."""
    env = {**os.environ, "TEXTRL_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "textrl.cli", "train", "--model", str(folder), "--vllm-server", servers[0], *SMALL]
    first = Watched([*cmd, "--iterations", "150", "--output-dir", str(tmp_path / "a")], env)
    wait_rows(tmp_path / "a", 1, first)
    second = subprocess.run([*cmd, "--iterations", "2", "--output-dir", str(tmp_path / "b"), "--seed", "1"], env=env,
                            capture_output=True, text=True, timeout=600)
    assert first.proc.poll() is None, first.tail()  # the first still running when the second ended
    assert second.returncode == 1
    line = [ln for ln in second.stderr.splitlines() if ln.startswith("textrl train: ")]
    assert len(line) == 1 and line[0].startswith(f"textrl train: vLLM server {servers[0]} is in use by another run ("), \
        second.stderr[-2000:]
    assert "give each run servers of its own" in line[0] and str(tmp_path / "a") in line[0]
    assert not (tmp_path / "b" / "metrics.jsonl").exists()
    assert first.end(timeout=900) == 0, first.tail()
    rows = metrics(tmp_path / "a")
    assert [r["iteration"] for r in rows] == list(range(1, 151))
    assert all(r["rollout/logprob_gap_max"] < 1e-4 for r in rows), rows


@pytest.mark.vllm
@pytest.mark.slow
def test_a_url_that_is_not_a_vllm_server_is_refused_before_the_warm_up(tmp_path, monkeypatch):
    """``python -m http.server`` at --vllm-server: one line naming it, whole, before the warm-up runs
    (nothing kept of a warm-up in the run folder)."""
    monkeypatch.setenv("TEXTRL_CACHE", str(tmp_path / "cache"))
    port = free_port()
    page = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"], cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        with pytest.raises(SystemExit) as stop_:
            main(["train", "--iterations", "1", "--output-dir", str(tmp_path / "run"), "--vllm-server", url, *SMALL])
    finally:
        page.kill()
        page.wait()
    assert str(stop_.value) == (f"textrl train: {url} is not a vLLM server (GET /v1/models answered HTTP 404 "
                                "text/html): point --vllm-server at a server started with textrl vllm-serve MODEL")
    from textrl.run.warmup import KEPT_WARMUP

    assert not (tmp_path / "run" / KEPT_WARMUP).exists()  # refused before the warm-up


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("learners, k, used", [(["--fsdp"], 1, 2), ([], 2, 2), (["--zero-stage", "2"], 1, 1)],
                         ids=["fsdp-k1", "data_parallel-k2", "zero2-k1"])
def test_served_asynchronous_rollouts_in_two_trainer_processes_are_dealt_by_one_actor(tmp_path, folder, servers,
                                                                                      learners, k, used):
    """--max-staleness K under torchrun with ``used`` servers, FSDP2, data-parallel or ZeRO-2 learners:
    the learners hand the main process's actor the weights whole after each update (FSDP2: a gather;
    ZeRO-2 holds them whole on every process), which draws every batch whole from the servers (one
    weight push per change) and deals each process its share; the rollouts are up to K updates behind,
    the servers' log-probs of the first one the learner's, and a resume continues with the
    checkpoint's rollouts queued and in flight."""
    out, servers = tmp_path / "run", servers[:used]
    options = ["--max-staleness", str(k), "--eval-every", "2", *learners]
    train(out, folder, servers, "--iterations", "2", *options, processes=2)
    train(out, folder, servers, "--iterations", "3", *options, "--resume", processes=2)
    rows = metrics(out)
    assert [r["iteration"] for r in rows] == [1, 2, 3] and all(r["samples"] == 8 for r in rows)
    assert [r["rollout/staleness"] for r in rows] == [0.0, 1.0, float(min(2, k))]
    assert rows[0]["rollout/logprob_gap_max"] < 1e-4, rows[0]
    assert rows[2]["rollout/logprob_gap"] > 1e-4, rows[2]  # a step behind: the update's size
    assert "eval/greedy/reward/mean" in rows[1]
