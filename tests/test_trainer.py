"""End-to-end runs of `textrl train` on the tiny model (few iterations, small sizes)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.runs import SMALL, checkpoint_tensors
from tests.runs import metrics as _metrics
from textrl.cli import main
from textrl.run import latest_checkpoint


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TEXTRL_CACHE", str(tmp_path / "cache"))


def _policy_state(out):
    return checkpoint_tensors(latest_checkpoint(out))


def test_train_writes_every_output(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--iterations", "2", "--output-dir", str(out), *SMALL]) == 0
    rows = _metrics(out)
    assert [r["iteration"] for r in rows] == [1, 2]
    for key in ("reward/mean", "kl/collection", "loss/policy", "loss/value", "entropy", "clip_fraction",
                "explained_variance", "response_length/mean", "time/iteration_s", "tokens_per_second",
                "reward_components/think_format/mean", "lr/actor", "perf/total_tokens", "perf/padding_fraction",
                "perf/tokens_per_s"):
        assert key in rows[0], key
    assert "eval/sampled/reward/mean" in rows[-1] and "eval/greedy/accuracy" in rows[-1]
    phases = ("generation", "reward", "forward", "advantages", "update", "bookkeeping")
    for row in rows:
        seconds = [row[f"time/{phase}_s"] for phase in phases] + [row.get("time/eval_s", 0.0)]
        assert all(s >= 0 for s in seconds) and sum(seconds) <= row["time/iteration_s"]
        assert row["tokens_per_second"] == pytest.approx(row["tokens"] / row["time/iteration_s"])
        step_s = row["time/iteration_s"] - row.get("time/eval_s", 0.0)
        assert row["perf/tokens_per_s"] == pytest.approx(row["perf/total_tokens"] / step_s)
        assert row["perf/total_tokens"] > row["tokens"] and 0 < row["perf/padding_fraction"] < 1
    assert "time/eval_s" in rows[-1] and "time/eval_s" not in rows[0]
    peaks = [r["memory/peak_mib"] for r in rows]  # a high-water mark: positive, never falling
    assert peaks[0] > 100 and peaks == sorted(peaks)
    for name in ("config.yaml", "curves.png", "summary.json", "eval_before.json"):
        assert (out / name).is_file()
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["peak_memory_mib"]) == 1 and summary["peak_memory_mib"][0] >= peaks[-1]
    assert summary["before"] == json.loads((out / "eval_before.json").read_text())
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert {s["iteration"] for s in samples} == {0, 2} and all("completion" in s for s in samples)
    assert any((out / "tb").iterdir())
    ckpt = latest_checkpoint(out)
    assert ckpt is not None and ckpt.name == "iter_000002"
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(ckpt / "policy")
    assert "held-out metric" in capsys.readouterr().out


@pytest.mark.parametrize(
    "options",
    [[], ["--agent", "one_step_ppo", "--gradient-accumulation-steps", "2", "--ppo-epochs", "2"]],
    ids=["gae_ppo", "one_step_ppo-accumulation"],
)
def test_resume_reproduces_an_uninterrupted_run(tmp_path, options):
    full, part = tmp_path / "full", tmp_path / "part"
    args = [*SMALL, *options]
    assert main(["train", "--iterations", "3", "--output-dir", str(full), *args]) == 0
    assert main(["train", "--iterations", "2", "--output-dir", str(part), *args]) == 0
    assert main(["train", "--iterations", "3", "--output-dir", str(part), "--resume", *args]) == 0
    a, b = _metrics(full), _metrics(part)
    assert [r["iteration"] for r in b] == [1, 2, 3]
    # iteration 2 of the short run evaluated (last iteration); compare the training metrics
    for key in ("reward/mean", "loss/policy", "loss/value", "kl/collection"):
        assert a[2][key] == pytest.approx(b[2][key], abs=1e-6), key
    sa, sb = _policy_state(full), _policy_state(part)
    assert sa.keys() == sb.keys() and any(k.startswith("policy.") for k in sa)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize(
    ("agent", "reward"), [("one_step_ppo", "tag_count"), ("gae_ppo", "think_format:2,tag_count:0.5")]
)
def test_agent_and_reward_swap_from_the_command_line(tmp_path, agent, reward):
    out = tmp_path / agent
    assert main(["train", *SMALL, "--iterations", "1", "--agent", agent, "--reward", reward,
                 "--output-dir", str(out)]) == 0
    row = _metrics(out)[0]
    names = {k.split("/")[1] for k in row if k.startswith("reward_components/")}
    assert names == {part.split(":")[0] for part in reward.split(",")}


def test_invalid_config_fails_before_any_model_loads(tmp_path):
    with pytest.raises(SystemExit, match="clip_eps"):
        main(["train", "--clip-eps", "0", "--output-dir", str(tmp_path / "x")])
    assert not (tmp_path / "x").exists()
