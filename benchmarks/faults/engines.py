"""Engine and server faults that need no vLLM (docs/reliability.md, "Served generation" and "Tried
as a user"): ``--vllm-server`` at a plain web server and at a port where nothing listens, TRL's
``--use-vllm`` / ``--vllm-mode``, ``--max-staleness`` with ``--fsdp`` under two processes, an engine
that dies mid-run (then ``--resume``), and SIGTERM while an asynchronous actor's rollout is in flight
(then ``--resume``).

The dying engine is registered by a user's script (``textrl.testing.engines.failing_engine``) that
then calls the ``textrl`` command's own entry point, as a user with an engine of their own would."""

from __future__ import annotations

import functools
import http.server
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from fault_catalogue import SMALL, Trial, _write, case, judge, run_folder_sound, snapshot, unchanged

FAILING = '''"""textrl's command with the engine 'failing' registered (textrl.testing.engines.failing_engine).
argv[1]: the iteration whose rollout finds the engine dead (0: it never dies); the rest: textrl's arguments."""
import sys

from textrl.training import ppo_run
from textrl.cli import entry
from textrl.testing.engines import failing_engine

dies_in = int(sys.argv[1])
with failing_engine(None) as counter:
    step = ppo_run.PPORun.step

    def step_or_die(self, i, timings):
        if i == dies_in:
            counter.fail_after = counter.calls
        return step(self, i, timings)

    ppo_run.PPORun.step = step_or_die
    sys.argv = ["textrl", *sys.argv[2:]]
    entry()
'''


class _Quiet(http.server.SimpleHTTPRequestHandler):
    """``python -m http.server``'s handler, its request log left out of the catalogue's output."""

    def log_message(self, *args: object) -> None:
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@case("engines: --vllm-server at a plain web server")
def plain_web_server(trial: Trial, base: Path) -> None:
    site = trial.folder("site")
    site.mkdir()
    (site / "index.html").write_text("<html><body>\nnot vLLM\n</body></html>\n")
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(site)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    out = trial.folder("web_server")
    try:
        proc = trial.textrl("train", *SMALL, "--iterations", "1", "--vllm-server", url, "--output-dir", str(out))
    finally:
        httpd.shutdown()
        httpd.server_close()
    # the run takes its folder (its lock) before it checks the servers: nothing else is written there
    judge(trial, "engines: --vllm-server at a plain web server", proc, refused=True,
          kept=unchanged({}, snapshot(out)) and "warm-up" not in proc.stdout,
          expect=f"textrl train: {url} is not a vLLM server (GET /v1/models answered HTTP 404 text/html): point "
                 "--vllm-server at a server started with textrl vllm-serve MODEL")


@case("engines: --vllm-server at a port where nothing listens")
def nothing_listens(trial: Trial, base: Path) -> None:
    url = f"http://127.0.0.1:{_free_port()}"
    out = trial.folder("no_server")
    proc = trial.textrl("train", *SMALL, "--iterations", "1", "--vllm-server", url, "--output-dir", str(out))
    judge(trial, "engines: --vllm-server at a port where nothing listens", proc, refused=True,
          kept=unchanged({}, snapshot(out)) and "warm-up" not in proc.stdout,
          expect=f"vLLM server {url} does not answer GET /v1/models (connection refused)")


@case("engines: TRL's --use-vllm / --vllm-mode server")
def trl_vllm_names(trial: Trial, base: Path) -> None:
    config = _write(trial, "trl_vllm.yaml", "use_vllm: true\nvllm_mode: server\n")
    for label, flags, expect in [
        ("--use-vllm", ["--use-vllm"], "--use-vllm: use_vllm is TRL's name: textrl calls it vllm_server"),
        ("--vllm-mode server", ["--vllm-mode", "server"],
         "--vllm-mode: vllm_mode is TRL's name: textrl calls it generation_engine (colocate -> --generation-engine "
         "vllm; server (TRL's default) -> --vllm-server URL[,URL...])"),
        ("use_vllm, vllm_mode in --config", ["--config", str(config)],
         "unknown option(s) use_vllm, vllm_mode; use_vllm is TRL's name: textrl calls it vllm_server"),
    ]:
        out = trial.folder("trl_vllm")
        proc = trial.textrl("train", *flags, "--output-dir", str(out))
        judge(trial, f"engines: TRL's {label}", proc, refused=True, kept=not out.exists(), expect=expect)


@case("engines: --max-staleness 1 --fsdp in two processes")
def staleness_with_fsdp(trial: Trial, base: Path) -> None:
    out = trial.folder("async_fsdp")
    shared = trial.env  # as torchrun sets them for the first of two processes; no peer is needed to be refused
    trial.env = {**shared, "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    try:
        proc = trial.textrl("train", *SMALL, "--iterations", "1", "--max-staleness", "1", "--fsdp",
                            "--output-dir", str(out))
    finally:
        trial.env = shared
    judge(trial, "engines: --max-staleness 1 --fsdp in two processes", proc, refused=True, kept=not out.exists(),
          expect="--max-staleness 1 runs an actor beside the learner in each of the 2 training processes, and under "
                 "--fsdp none holds the policy's weights whole")


def _metrics(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    return [json.loads(line)["iteration"] for line in path.read_text().splitlines()] if path.is_file() else []


@case("engines: an engine that dies mid-run, then --resume")
def engine_dies(trial: Trial, base: Path) -> None:
    script = _write(trial, "failing_engine_run.py", FAILING)
    out = trial.folder("engine_dies")
    args = ["train", *SMALL, "--generation-engine", "failing", "--iterations", "4", "--output-dir", str(out)]

    def run(dies_in: int, *extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(script), str(dies_in), *args, *extra], env=trial.env,
                              capture_output=True, text=True, timeout=300)

    died = run(3)
    saved = out / "checkpoints" / "iter_000002"
    rows_then = _metrics(out)
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").is_file() else {}
    from textrl.run import verify_checkpoint

    try:
        verify_checkpoint(saved)
        verified = True
    except Exception:
        verified = False
    resumed = run(0, "--resume")
    kept = (verified and rows_then == [1, 2] and summary.get("ended") == "failed" and summary.get("failed_in") == 3
            and resumed.returncode == 0 and run_folder_sound(out, 4))
    judge(trial, "engines: an engine that dies mid-run, then --resume", died, refused=True, kept=kept,
          expect=f"iteration 2 is saved in {saved}. Fix the cause, then resume with: textrl train --config")
    outcome = trial.outcomes[-1]
    outcome.clear = outcome.clear and died.returncode == 1 and \
        " ".join(outcome.message).startswith("textrl train: stopped after iteration 2: engine double: no engine answers")
    outcome.note = f"resume rc={resumed.returncode}"


@case("engines: SIGTERM while the asynchronous actor's rollout is in flight, then --resume")
def sigterm_in_flight(trial: Trial, base: Path) -> None:
    """--max-staleness 2 with the actor slower than the learner (eight generation calls of 32 tokens a
    rollout): from the first row on, the actor is always drawing. The only checkpoint is the stop's;
    it must hold the cancelled rollout's start (``in_flight``), to be drawn again on --resume."""
    import torch

    name = "engines: SIGTERM while the asynchronous actor's rollout is in flight, then --resume"
    out = trial.folder("async_in_flight")
    flags = [*SMALL, "--max-new-tokens", "32", "--generation-batch-size", "1", "--max-staleness", "2",
             "--iterations", "4", "--checkpoint-every", "0", "--output-dir", str(out)]
    args = [sys.executable, "-m", "textrl.cli", "train", *flags]
    proc = subprocess.Popen(args, env=trial.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not _metrics(out) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    stopped = subprocess.CompletedProcess(args, proc.returncode, "", err)
    done = _metrics(out)
    checkpoints = sorted((out / "checkpoints").glob("iter_*")) if (out / "checkpoints").is_dir() else []
    in_flight = None
    if checkpoints:
        state = torch.load(checkpoints[-1] / "trainer_state.pt", weights_only=False)
        in_flight = state["sampler"]["async"]["in_flight"]
    finished = len(done)
    resumed = trial.textrl("train", *flags, "--resume")
    kept = (proc.returncode == 143 and [c.name for c in checkpoints] == [f"iter_{finished:06d}"]
            and finished < 4 and in_flight is not None and resumed.returncode == 0 and run_folder_sound(out, 4))
    judge(trial, name, stopped, refused=True, kept=kept,
          expect=f"textrl train: stopped by SIGTERM after iteration {finished} of 4; checkpoint saved in")
    trial.outcomes[-1].note = (f"rc={proc.returncode}, in flight: rollout {in_flight[0] if in_flight else None}, "
                               f"resume rc={resumed.returncode}")
