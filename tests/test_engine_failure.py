"""An engine that cannot go on (a dead vLLM server, a broken weight transfer: ``EngineFailed``) loses
nothing: the run checkpoints its last finished iteration, stops in one line naming the engine, what
was saved and how to resume, and the resume repeats the uninterrupted run exactly (synchronous and
asynchronous). An engine that fails in the held-out evaluation, after the update, leaves its row
(without ``eval/``) and its checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

from tests.runs import SMALL, checkpoint_tensors, metrics
from textrl.cli import main
from textrl.run import TrainingStopped
from textrl.testing.engines import failing_engine
from textrl.training import ppo_run


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("TEXTRL_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


def trained(row: dict) -> dict:
    """A row's training figures (not its seconds, memory or held-out evaluation); a NaN equal to itself."""
    return {k: str(v) for k, v in row.items()
            if not k.startswith(("time/", "memory/", "eval/")) and k not in ("tokens_per_second", "perf/tokens_per_s")}


def fail_in(monkeypatch, counter, iteration: int, phase: str = "step") -> None:
    """The engine fails from the start of ``iteration``'s rollout (``phase="step"``; with
    ``--max-staleness`` drawn by the actor ahead of the learner), or of its evaluation."""
    from textrl.training.async_training import AsyncTraining

    produce = AsyncTraining._produce

    def failing_rollout(self, n, weights):
        if n + 1 == iteration:
            counter.fail_after = counter.calls
        return produce(self, n, weights)

    monkeypatch.setattr(AsyncTraining, "_produce", failing_rollout)
    target = ppo_run.PPORun.step if phase == "step" else ppo_run.PPORun.evaluate

    def failing(self, i, timings):
        if i == iteration:
            counter.fail_after = counter.calls
        return target(self, i, timings)

    monkeypatch.setattr(ppo_run.PPORun, phase, failing)


def run_args(out, *extra, iterations=4):
    return ["train", *SMALL, "--generation-engine", "failing", "--iterations", str(iterations),
            "--output-dir", str(out), *extra]


@pytest.mark.parametrize("options", [[], ["--max-staleness", "1"]], ids=["sync", "k1"])
def test_an_engine_failure_saves_the_last_finished_iteration_and_the_resume_is_exact(
        tmp_path, monkeypatch, capsys, options):
    full, part = tmp_path / "full", tmp_path / "part"
    with failing_engine(None):
        assert main(run_args(full, *options)) == 0
    with failing_engine(None) as counter, monkeypatch.context() as patch:
        fail_in(patch, counter, 3)
        with pytest.raises(TrainingStopped) as stop:
            main(run_args(part, *options))
    assert stop.value.code == 1
    message = str(stop.value)
    assert message.startswith("textrl train: stopped after iteration 2: engine double: no engine answers")
    saved = part / "checkpoints" / "iter_000002"
    assert f"iteration 2 is saved in {saved}" in message and "--resume" in message and "\n" not in message
    assert message in capsys.readouterr().err
    summary = json.loads((part / "summary.json").read_text())
    assert {k: summary[k] for k in ("ended", "iteration", "failed_in", "checkpoint")} == {
        "ended": "failed", "iteration": 2, "failed_in": 3, "checkpoint": str(saved)}
    assert [r["iteration"] for r in metrics(part)] == [1, 2]
    with failing_engine(None):
        assert main([*run_args(part, *options), "--resume"]) == 0
    a, b = metrics(full), metrics(part)
    assert [r["iteration"] for r in b] == [1, 2, 3, 4]
    assert [trained(r) for r in a] == [trained(r) for r in b]
    sa = checkpoint_tensors(full / "checkpoints" / "iter_000004")
    sb = checkpoint_tensors(part / "checkpoints" / "iter_000004")
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_a_failure_right_after_a_checkpoint_names_it_and_saves_nothing_more(tmp_path, monkeypatch):
    out = tmp_path / "run"
    with failing_engine(None) as counter, monkeypatch.context() as patch:
        fail_in(patch, counter, 3)
        with pytest.raises(TrainingStopped) as stop:
            main(run_args(out, "--checkpoint-every", "2"))
    assert f"iteration 2 is saved in {out / 'checkpoints' / 'iter_000002'}" in str(stop.value)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["iter_000002"]


def test_a_failure_in_the_first_rollout_says_nothing_was_saved(tmp_path, monkeypatch):
    out = tmp_path / "run"
    with failing_engine(None) as counter, monkeypatch.context() as patch:
        fail_in(patch, counter, 1)
        with pytest.raises(TrainingStopped) as stop:
            main(run_args(out))
    assert "stopped after iteration 0" in str(stop.value) and "no iteration had finished, so nothing was saved" in str(stop.value)
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())
    assert json.loads((out / "summary.json").read_text())["checkpoint"] is None


def test_a_failure_in_the_evaluation_keeps_the_updated_iteration(tmp_path, monkeypatch):
    """After the update: iteration 2's row is written without eval/ metrics and checkpointed."""
    out = tmp_path / "run"
    with failing_engine(None) as counter, monkeypatch.context() as patch:
        fail_in(patch, counter, 2, phase="evaluate")
        with pytest.raises(TrainingStopped) as stop:
            main(run_args(out, "--eval-every", "2"))
    assert f"iteration 2 is saved in {out / 'checkpoints' / 'iter_000002'}" in str(stop.value)
    rows = metrics(out)
    assert [r["iteration"] for r in rows] == [1, 2] and not any(k.startswith("eval/") for k in rows[1])


def test_a_url_that_is_no_vllm_server_is_refused_before_any_model_loads(tmp_path, capsys):
    """``--vllm-server`` at a plain web server: one line naming the URL, before the warm-up."""
    import threading
    from http.server import HTTPServer, SimpleHTTPRequestHandler

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    try:
        with pytest.raises(SystemExit) as stop:
            main(["train", *SMALL, "--vllm-server", url, "--output-dir", str(tmp_path / "run")])
    finally:
        server.shutdown()
    line = str(stop.value.code)
    assert line.startswith(f"textrl train: {url} is not a vLLM server") and "\n" not in line
    assert "warm-up" not in capsys.readouterr().out


def test_an_asynchronous_actor_stopped_by_an_error_of_its_own_saves_like_an_engine(tmp_path, monkeypatch):
    """--max-staleness 1: the actor's reward raises while it draws rollout 3: the learner's state is
    saved at iteration 2, the line names the error, and the resume (reward mended) is exact."""
    from textrl.training.async_training import AsyncTraining

    full, part = tmp_path / "full", tmp_path / "part"
    with failing_engine(None):
        assert main(run_args(full, "--max-staleness", "1")) == 0
    produce = AsyncTraining._produce

    def broken(self, n, weights):
        if n + 1 == 3:
            raise ValueError("reward 'mine' failed on row 0\nTraceback ...")
        return produce(self, n, weights)

    with failing_engine(None), monkeypatch.context() as patch:
        patch.setattr(AsyncTraining, "_produce", broken)
        with pytest.raises(TrainingStopped) as stop:
            main(run_args(part, "--max-staleness", "1"))
    message = str(stop.value)
    assert message.startswith("textrl train: stopped after iteration 2: the asynchronous actor stopped drawing "
                              "rollouts (ValueError: reward 'mine' failed on row 0); iteration 2 is saved in "), message
    assert "--resume" in message and "\n" not in message
    with failing_engine(None):
        assert main([*run_args(part, "--max-staleness", "1"), "--resume"]) == 0
    assert [trained(r) for r in metrics(full)] == [trained(r) for r in metrics(part)]
    sa = checkpoint_tensors(full / "checkpoints" / "iter_000004")
    sb = checkpoint_tensors(part / "checkpoints" / "iter_000004")
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
