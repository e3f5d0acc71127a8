"""`textrl train` in two CPU processes (gloo) under torchrun, as `accelerate launch` runs it.

Each process generates and scores half of every rollout; gradients are averaged before every
step, so both end with identical weights (the trainer compares parameter checksums across
processes and raises otherwise); the metrics count both processes' rows; only the main process
writes; resume continues exactly.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch

from tests.arithmetic import model_rtol
from tests.runs import checkpoint_tensors, metrics
from textrl.run import latest_checkpoint
from textrl.testing import assert_close_normwise

pytestmark = pytest.mark.slow

SMALL = [
    "--agent", "gae_ppo",  # the critic agent (the default is rloo); a later --agent wins
    "--prompts-per-iteration", "4", "--n-samples-per-prompt", "2", "--max-new-tokens", "6",
    "--warmup-sft-steps", "3", "--eval-size", "4", "--eval-every", "0", "--progress", "false",
    "--ppo-epochs", "1", "--num-minibatches", "2", "--device", "cpu",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def assert_trained_alike(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], steps: int, checkpoint) -> None:
    """Two runs' checkpoint tensors after ``steps`` AdamW steps whose gradients summed in other
    orders (another reduction, ZeRO-3's partitioned linear layers): equal by each tensor's norm.

    Each step's gradient agrees by norm to ``model_rtol`` (tests/arithmetic.py), and Adam passes that
    on to the step, which moves each weight by at most ~lr: over ``steps`` steps the weights agree to
    ``steps x model_rtol`` of their norm (3.7e-4 for 6 steps; observed 5e-7). Not elementwise: where
    a gradient cancels to ~0, Adam turns its float noise into a step of up to ~lr on that one weight
    (lr 3e-4 here, far above an elementwise 1e-6 + 1e-5 |w|). A missing iteration is off by 6e-3 of
    a tensor's norm, half a tensor left untrained by 3e-2, every step of a tensor at 0.9 lr by 4e-3."""
    from transformers import AutoConfig

    rtol = steps * model_rtol(AutoConfig.from_pretrained(checkpoint / "policy"))
    assert a.keys() == b.keys()
    for key in a:
        assert_close_normwise(b[key], a[key], rtol=rtol, name=key)


def _train(out, *args, processes: int = 2, cache, script=None) -> subprocess.CompletedProcess:
    """``textrl train`` under torchrun (``script``: a file that runs it, as :data:`ONE_ACTOR`)."""
    env = {**os.environ, "TEXTRL_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    target = [str(script)] if script is not None else ["-m", "textrl.cli"]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={processes}",
           f"--master_port={_free_port()}", *target, "train", "--output-dir", str(out),
           *SMALL, *args]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def test_two_processes_share_the_work_and_end_identical_then_resume_exactly(tmp_path):
    cache = tmp_path / "cache"
    full, part = tmp_path / "full", tmp_path / "part"
    _train(full, "--iterations", "3", cache=cache)
    summary = json.loads((full / "summary.json").read_text())
    assert summary["processes"] == 2 and len(summary["parameter_checksum"]) == 64
    rows = metrics(full)
    assert [r["iteration"] for r in rows] == [1, 2, 3]  # one line per iteration: main process only
    assert all(r["samples"] == 8 for r in rows)  # 4 prompts x 2 samples, 4 rows per process
    assert "eval/sampled/reward/mean" in rows[-1]

    _train(part, "--iterations", "2", cache=cache)
    _train(part, "--iterations", "3", "--resume", cache=cache)
    resumed = metrics(part)
    for key in ("reward/mean", "loss/policy", "loss/value", "kl/collection", "tokens"):
        assert resumed[2][key] == pytest.approx(rows[2][key], abs=1e-6), key
    a, b = checkpoint_tensors(latest_checkpoint(full)), checkpoint_tensors(latest_checkpoint(part))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# gae_ppo with one minibatch: the update reuses the behaviour forward (its graph crosses FSDP's
# reshard); one_step_ppo: two minibatches, an old-policy snapshot refreshed between shards, and
# gathered weights kept from forward to backward (--fsdp-reshard-after-forward false)
@pytest.mark.parametrize("agent, options", [
    ("gae_ppo", ["--num-minibatches", "1"]), ("one_step_ppo", ["--fsdp-reshard-after-forward", "false"]),
])
def test_fsdp_shards_the_weights_and_trains_as_replicated_data_parallel(tmp_path, agent, options):
    """FSDP2 (--fsdp): each process holds half of every weight; the run equals the replicated one."""
    cache = tmp_path / "cache"
    replicated, sharded = tmp_path / "replicated", tmp_path / "sharded"
    _train(replicated, "--iterations", "2", "--agent", agent, *options, cache=cache)
    _train(sharded, "--iterations", "2", "--agent", agent, "--fsdp", *options, cache=cache)
    summary = json.loads((sharded / "summary.json").read_text())
    assert summary["fsdp"] is True and summary["weights_held_per_process"] == pytest.approx(0.5, abs=0.01)
    a, b = checkpoint_tensors(replicated / "checkpoints" / "iter_000002"), checkpoint_tensors(sharded / "checkpoints" / "iter_000002")
    assert a.keys() == b.keys() and len(a) > 40
    # reduce-scatter and all-reduce sum in different orders: float noise only, over 2 iterations of
    # 1 (gae_ppo) or 2 (one_step_ppo) minibatches
    assert_trained_alike(a, b, steps=2 * (1 if agent == "gae_ppo" else 2), checkpoint=sharded / "checkpoints" / "iter_000002")
    rows_a, rows_b = metrics(replicated), metrics(sharded)
    for key in ("reward/mean", "loss/policy", "samples", "tokens"):
        assert rows_b[-1][key] == pytest.approx(rows_a[-1][key], rel=1e-4, abs=1e-6), key
    # the checkpoint is a full Hugging Face model, loadable without any process group
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(sharded / "checkpoints" / "iter_000002" / "policy")
    torch.testing.assert_close(policy.state_dict()["model.norm.weight"], b["policy.model.norm.weight"])


def test_fsdp_resumes_exactly(tmp_path):
    cache = tmp_path / "cache"
    full, part = tmp_path / "full", tmp_path / "part"
    _train(full, "--iterations", "3", "--fsdp", cache=cache)
    _train(part, "--iterations", "2", "--fsdp", cache=cache)
    _train(part, "--iterations", "3", "--fsdp", "--resume", cache=cache)
    a, b = checkpoint_tensors(latest_checkpoint(full)), checkpoint_tensors(latest_checkpoint(part))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    optim_a = torch.load(latest_checkpoint(full) / "trainer_state.pt", weights_only=False)["agent"]["agent_state"]
    optim_b = torch.load(latest_checkpoint(part) / "trainer_state.pt", weights_only=False)["agent"]["agent_state"]
    for sa, sb in zip(optim_a["optimizers"], optim_b["optimizers"]):
        for name, state in sa["state"].items():
            assert torch.equal(state["exp_avg_sq"], sb["state"][name]["exp_avg_sq"]), name


def test_a_batch_that_does_not_split_over_the_processes_is_named(tmp_path):
    env = {**os.environ, "TEXTRL_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           f"--master_port={_free_port()}", "-m", "textrl.cli", "train", "--output-dir",
           str(tmp_path / "x"), *SMALL, "--prompts-per-iteration", "3", "--num-minibatches", "1"]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "prompts_per_iteration=3 does not split over 2 processes" in result.stdout + result.stderr


# DeepSpeed ZeRO (tests/agents/test_zero.py holds the in-process checks). Clipping is off in both
# runs: DeepSpeed clips the joint actor + critic norm where the plain loop clips each model.
NO_CLIP = ["--max-grad-norm", "0"]


def test_zero2_trains_as_replicated_data_parallel(tmp_path):
    """gae_ppo, one minibatch: the update reuses the behaviour forward; ZeRO-2 partitions AdamW
    states and gradients, the weights stay replicated (the trainer compares their checksums)."""
    pytest.importorskip("deepspeed")
    cache = tmp_path / "cache"
    replicated, zero = tmp_path / "replicated", tmp_path / "zero"
    for out, extra in ((replicated, []), (zero, ["--zero-stage", "2"])):
        _train(out, "--iterations", "2", "--num-minibatches", "1", *NO_CLIP, *extra, cache=cache)
    summary = json.loads((zero / "summary.json").read_text())
    assert summary["zero_stage"] == 2 and len(summary["parameter_checksum"]) == 64
    a, b = checkpoint_tensors(latest_checkpoint(replicated)), checkpoint_tensors(latest_checkpoint(zero))
    assert a.keys() == b.keys() and len(a) > 40
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-6, msg=key)
    rows = metrics(zero)
    assert all("grad_norm/total" in r and r["samples"] == 8 for r in rows)


def test_zero3_partitions_the_weights_trains_as_replicated_and_resumes(tmp_path):
    """one_step_ppo: two minibatches and an old-policy snapshot refreshed between partitions.
    A DeepSpeed config file makes ZeRO-3 partition even the tiny model's small weights."""
    pytest.importorskip("deepspeed")
    ds_config = tmp_path / "ds.json"
    ds_config.write_text(json.dumps({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}))
    cache = tmp_path / "cache"
    replicated, full, part = tmp_path / "replicated", tmp_path / "full", tmp_path / "part"
    run = ["--agent", "one_step_ppo", *NO_CLIP]
    _train(replicated, "--iterations", "3", *run, cache=cache)
    _train(full, "--iterations", "3", *run, "--deepspeed-config", str(ds_config), cache=cache)
    summary = json.loads((full / "summary.json").read_text())
    assert summary["zero_stage"] == 3 and summary["weights_held_per_process"] == pytest.approx(0.5, abs=0.01)
    a, b = checkpoint_tensors(latest_checkpoint(replicated)), checkpoint_tensors(latest_checkpoint(full))
    # partitioned reductions and linear layers sum in another order: float noise only, over 3
    # iterations of 2 minibatches
    assert_trained_alike(a, b, steps=6, checkpoint=latest_checkpoint(full))
    # the checkpoint's policy is a full Hugging Face model
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(latest_checkpoint(full) / "policy")
    torch.testing.assert_close(policy.state_dict()["model.norm.weight"], b["policy.model.norm.weight"])

    # 2 iterations, then --resume to 3: the uninterrupted run's weights and AdamW moments exactly
    _train(part, "--iterations", "2", *run, "--deepspeed-config", str(ds_config), cache=cache)
    other_stage = tmp_path / "other_stage"
    shutil.copytree(part, other_stage)
    _train(part, "--iterations", "3", *run, "--deepspeed-config", str(ds_config), "--resume", cache=cache)
    c = checkpoint_tensors(latest_checkpoint(part))
    assert c.keys() == b.keys() and all(torch.equal(c[k], b[k]) for k in b)
    saved = [torch.load(latest_checkpoint(out) / "trainer_state.pt", weights_only=False)["agent"]["agent_state"]
             ["optimizers"][0] for out in (full, part)]
    assert saved[0]["step"] == saved[1]["step"] == 6.0  # 3 iterations x 2 minibatches
    for name, state in saved[0]["state"].items():
        assert torch.equal(state["exp_avg_sq"], saved[1]["state"][name]["exp_avg_sq"]), name
    # the checkpoint holds full tensors: it resumes under another stage too
    _train(other_stage, "--iterations", "3", *run, "--zero-stage", "2", "--resume", cache=cache)
    d = checkpoint_tensors(latest_checkpoint(other_stage))
    assert_trained_alike(b, d, steps=2, checkpoint=latest_checkpoint(other_stage))  # the last iteration's 2 steps


FAILING_RANK0 = """
import os, sys
from textrl.training import ppo_run
from textrl.cli import main
from textrl.testing.engines import failing_engine

fail_at = int(os.environ.get("TEXTRL_TEST_FAIL_AT", "0"))
with failing_engine(None) as counter:
    if fail_at and int(os.environ["RANK"]) == 1:  # this process's engine alone dies, in that iteration's rollout
        step = ppo_run.PPORun.step

        def failing(self, i, timings):
            if i == fail_at:
                counter.fail_after = counter.calls
            return step(self, i, timings)

        ppo_run.PPORun.step = failing
    sys.exit(main(sys.argv[1:]))
"""


def test_one_processs_engine_failing_saves_the_last_iteration_on_every_process_and_resumes_exactly(tmp_path):
    """Rank 1's engine dies in iteration 3's rollout while rank 0's answers: the failure is shared at
    the end of the rollout's episodes (no process waits in the update's collectives for another), both
    save iteration 2 together and stop; the resume equals the uninterrupted run."""
    cache = tmp_path / "cache"
    env = {**os.environ, "TEXTRL_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    script = tmp_path / "failing_rank0.py"
    script.write_text(FAILING_RANK0)

    def run(out, *extra, fail_at=0):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}",
               str(script), "train", "--output-dir", str(out), *SMALL, "--generation-engine", "failing",
               "--iterations", "4", *extra]
        return subprocess.run(cmd, env={**env, "TEXTRL_TEST_FAIL_AT": str(fail_at)}, capture_output=True,
                              text=True, timeout=600)

    full, part = tmp_path / "full", tmp_path / "part"
    assert run(full).returncode == 0
    stopped = run(part, fail_at=3)
    output = stopped.stdout + stopped.stderr
    saved = part / "checkpoints" / "iter_000002"
    assert stopped.returncode == 1, output[-3000:]
    assert "rank 1: engine double: no engine answers after" in output, output[-3000:]
    assert ("textrl train: stopped after iteration 2: the engine of another process failed in this iteration's "
            "rollout (its line is in that process's output); iteration 2 is saved in") in output, output[-3000:]
    assert f"iteration 2 is saved in {saved}" in output and latest_checkpoint(part) == saved
    assert [r["iteration"] for r in metrics(part)] == [1, 2]
    resumed = run(part, "--resume")
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    a, b = metrics(full), metrics(part)
    for key in ("reward/mean", "loss/policy", "loss/value", "kl/collection", "tokens"):
        assert [r[key] for r in b] == pytest.approx([r[key] for r in a], abs=1e-6), key
    sa, sb = checkpoint_tensors(latest_checkpoint(full)), checkpoint_tensors(latest_checkpoint(part))
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_asynchronous_rollouts_in_two_processes_resume_as_the_uninterrupted_run(tmp_path):
    """--max-staleness 2 under torchrun (data parallel; ZeRO-1/2 take the same path): an actor beside
    the learner in each process draws that process's share of every rollout (no collective in its
    thread); the checkpoint holds every process's rollouts in flight and queued, so 2 iterations then
    --resume to 4 equal 4 at once; a resume in one process is refused in one line."""
    cache, staleness = tmp_path / "cache", 2
    full, part = tmp_path / "full", tmp_path / "part"
    options = ["--max-staleness", str(staleness), "--eval-every", "2"]
    _train(full, *options, "--iterations", "4", cache=cache)
    _train(part, *options, "--iterations", "2", cache=cache)
    state = torch.load(latest_checkpoint(part) / "trainer_state.pt", weights_only=False)["sampler"]
    assert len(state["processes"]) == 1 and "snapshots" not in state["processes"][0]["async"]
    _train(part, *options, "--iterations", "4", "--resume", cache=cache)
    a, b = metrics(full), metrics(part)
    assert [r["iteration"] for r in b] == [1, 2, 3, 4]
    assert [r["rollout/staleness"] for r in a] == [0.0] + [float(min(i, staleness)) for i in range(1, 4)]
    for key in ("reward/mean", "loss/policy", "loss/value", "kl/collection", "tokens", "rollout/staleness"):
        assert [r[key] for r in b] == [r[key] for r in a], key
    sa, sb = checkpoint_tensors(latest_checkpoint(full)), checkpoint_tensors(latest_checkpoint(part))
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    env = {**os.environ, "TEXTRL_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "textrl.cli", "train", "--output-dir", str(part), *SMALL, *options,
                             "--iterations", "5", "--resume"], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode != 0
    assert ("this checkpoint was saved by an asynchronous run of 2 training process(es) (each with its actor's "
            "rollouts in flight), and this run has 1; resume it with as many") in result.stderr, result.stderr[-2000:]


ONE_ACTOR = """
import sys
from textrl.training import rollout_sources
from textrl.cli import main
from textrl.testing.engines import register_receiving_engine

register_receiving_engine("receiving")  # holds its own weights, pushed whole: a vLLM server in the process
rollout_sources.one_actor = lambda config: True  # as with --vllm-server: the main process's actor deals the shares
sys.exit(main(sys.argv[1:]))
"""


def test_one_actor_dealing_every_process_its_share_resumes_as_the_uninterrupted_run(tmp_path):
    """The served recipe's asynchronous mode (one actor on the main process draws every batch whole,
    each process takes its share when the learners take the rollout), with the textrl engine in its
    place: 2 iterations then --resume to 4 equal 4 at once, and the checkpoint holds one actor."""
    cache, script = tmp_path / "cache", tmp_path / "one_actor.py"
    script.write_text(ONE_ACTOR)

    def run(out, *extra):
        _train(out, "--max-staleness", "1", "--eval-every", "2", *extra, cache=cache, script=script)

    full, part = tmp_path / "full", tmp_path / "part"
    run(full, "--iterations", "4")
    run(part, "--iterations", "2")
    assert "processes" not in torch.load(latest_checkpoint(part) / "trainer_state.pt", weights_only=False)["sampler"]
    run(part, "--iterations", "4", "--resume")
    a, b = metrics(full), metrics(part)
    assert [r["rollout/staleness"] for r in a] == [0.0, 1.0, 1.0, 1.0] and all(r["samples"] == 8 for r in a)
    for key in ("reward/mean", "loss/policy", "loss/value", "kl/collection", "tokens", "rollout/weight_gap"):
        assert [r[key] for r in b] == [r[key] for r in a], key
    sa, sb = checkpoint_tensors(latest_checkpoint(full)), checkpoint_tensors(latest_checkpoint(part))
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("backend", [["--fsdp"], ["--zero-stage", "3"]], ids=["fsdp", "zero3"])
def test_sharded_learners_hand_one_actor_the_weights_whole_and_resume_as_the_uninterrupted_run(tmp_path, backend):
    """The served recipe's asynchronous mode under a backend that partitions the weights: the learners
    gather them after each update for the main process's actor, whose engine holds its own weights
    (pushed whole, as a vLLM server's); 2 iterations then --resume to 3 equal 3 at once, bit for bit;
    only the main process evaluates (its actor samples)."""
    cache, script = tmp_path / "cache", tmp_path / "one_actor.py"
    script.write_text(ONE_ACTOR)

    def run(out, *extra):
        _train(out, *backend, "--generation-engine", "receiving", "--max-staleness", "1", "--eval-every", "2", *extra,
               cache=cache, script=script)

    full, part = tmp_path / "full", tmp_path / "part"
    run(full, "--iterations", "3")
    run(part, "--iterations", "2")
    run(part, "--iterations", "3", "--resume")
    a, b = metrics(full), metrics(part)
    assert [r["rollout/staleness"] for r in a] == [0.0, 1.0, 1.0] and all(r["samples"] == 8 for r in a)
    assert "eval/greedy/reward/mean" in a[1] and "eval/greedy/reward/mean" in a[2]
    for key in ("reward/mean", "loss/policy", "loss/value", "kl/collection", "tokens", "eval/greedy/reward/mean"):
        assert [r.get(key) for r in b] == [r.get(key) for r in a], key
    assert all(r["time/weight_sync_s"] > 0 for r in a)
    sa, sb = checkpoint_tensors(latest_checkpoint(full)), checkpoint_tensors(latest_checkpoint(part))
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
