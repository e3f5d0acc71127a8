"""`--resume` with other settings: fixed fields refused before anything is written, the others
applied from the resumed iteration on and recorded (docs/reliability.md, "Resuming with other
settings")."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from tests.runs import SMALL
from tests.runs import metrics as _metrics
from textrl.cli import main
from textrl.config import ResumeRules, TrainConfig, config_values
from textrl.run.resume import RESUMES_FILE, settings_changes
from textrl.stages.common import StageConfig


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("TEXTRL_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


def test_every_train_setting_has_a_resume_rule():
    TrainConfig.RESUME_RULES.check_covers(TrainConfig)  # a new field must be classified
    assert {"actor_lr", "critic_lr", "kl_coef", "iterations", "eval_every"} <= TrainConfig.RESUME_RULES.applied
    assert {"model", "agent", "seed", "dataset", "tokenizer"} <= TrainConfig.RESUME_RULES.fixed


def test_check_covers_names_an_unclassified_field():
    rules = ResumeRules(applied=frozenset({"iterations"}), fixed=frozenset({"seed"}))
    with pytest.raises(ValueError, match=r"not classified \[.*'actor_lr'"):
        rules.check_covers(TrainConfig)


def test_settings_changes_compares_by_value_and_skips_what_it_cannot_compare():
    saved = {"seed": 0, "actor_lr": 0.0003, "kl_coef": 0.02, "output_dir": "a", "model": "tiny"}
    given = {**saved, "actor_lr": 3e-4, "kl_coef": 0.5, "output_dir": "b", "seed": 1, "eval_every": 7}
    changes = settings_changes(saved, given, TrainConfig.RESUME_RULES)
    assert changes.applied == {"kl_coef": (0.02, 0.5)}  # 3e-4 == 0.0003; eval_every: not saved
    assert changes.refused == {"seed": (0, 1)}  # output_dir: this invocation's, never compared
    stage = settings_changes({"lr": 1e-3, "steps": 4}, {"lr": 2e-3, "steps": 8}, StageConfig.RESUME_RULES)
    assert stage.refused == {"lr": (1e-3, 2e-3)} and stage.applied == {"steps": (4, 8)}


# -- through `textrl train` -----------------------------------------------------------------------

RUN = [*SMALL, "--iterations", "2", "--checkpoint-every", "1"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished two-iteration run with a checkpoint after each iteration."""
    out = tmp_path_factory.mktemp("finished") / "run"
    cache = tmp_path_factory.getbasetemp() / "cache"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TEXTRL_CACHE", str(cache))
        assert main(["train", "--output-dir", str(out), *RUN]) == 0
    return out


def _copy(finished, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    return out


def _files(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(("flags", "named"), [
    (["--seed", "1"], "seed: 0 -> 1"),
    (["--agent", "grpo"], "agent: 'gae_ppo' -> 'grpo'"),
    (["--model", "/models/another"], "model: 'tiny' -> '/models/another'"),
    (["--dataset", "other.jsonl"], "dataset: None -> 'other.jsonl'"),
    (["--max-new-tokens", "12", "--lam", "0.9"], "max_new_tokens: 8 -> 12; lam: 0.95 -> 0.9"),
])
def test_a_resume_that_changes_what_defines_the_run_is_refused_and_writes_nothing(
    finished, tmp_path, capsys, flags, named
):
    out = _copy(finished, tmp_path)
    before = _files(out)
    with pytest.raises(SystemExit) as refused:
        main(["train", "--output-dir", str(out), *RUN, "--iterations", "3", "--resume", *flags])
    message = str(refused.value.code)
    assert message.startswith(f"textrl train: --resume cannot change what defines the run ({named}")
    assert f"--config {out / 'checkpoints' / 'iter_000002' / 'config.yaml'} --resume" in message
    assert "\n" not in message  # one line
    assert _files(out) == before  # not a byte changed, the lock file included


def test_a_resume_applies_learning_rates_kl_and_cadence_and_records_them(finished, tmp_path, capsys):
    out = _copy(finished, tmp_path)
    changed = ["--iterations", "3", "--actor-lr", "5e-3", "--critic-lr", "2e-3", "--kl-coef", "0.5",
               "--eval-every", "1"]
    assert main(["train", "--output-dir", str(out), *RUN, "--resume", *changed]) == 0
    logged = capsys.readouterr().out
    assert "--resume: actor_lr 0.0003 -> 0.005 (applied from the next iteration on)" in logged
    rows = _metrics(out)
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    assert rows[1]["lr/actor"] == pytest.approx(3e-4) and rows[2]["lr/actor"] == pytest.approx(5e-3)
    assert rows[2]["lr/critic"] == pytest.approx(2e-3)
    assert rows[1]["kl/coef"] == pytest.approx(0.02) and rows[2]["kl/coef"] == pytest.approx(0.5)
    assert "eval/greedy/reward/mean" in rows[2]  # eval_every=1 from iteration 3 on
    # the record: config.yaml and the new checkpoint say what runs now, resumes.jsonl when it changed
    assert yaml.safe_load((out / "config.yaml").read_text())["actor_lr"] == 5e-3
    assert yaml.safe_load((out / "checkpoints" / "iter_000003" / "config.yaml").read_text())["kl_coef"] == 0.5
    assert yaml.safe_load((out / "checkpoints" / "iter_000002" / "config.yaml").read_text())["kl_coef"] == 0.02
    (record,) = [json.loads(line) for line in (out / RESUMES_FILE).read_text().splitlines()]
    assert record["resumed_after"] == 2 and record["checkpoint"] == "iter_000002"
    assert record["changed"]["actor_lr"] == {"from": 3e-4, "to": 5e-3}
    assert set(record["changed"]) == {"iterations", "actor_lr", "critic_lr", "kl_coef", "eval_every"}


def test_a_resume_with_the_runs_own_config_changes_nothing_and_records_no_change(finished, tmp_path):
    out = _copy(finished, tmp_path)
    config = out / "config.yaml"
    assert main(["train", "--config", str(config), "--output-dir", str(out), "--resume", "--iterations", "3"]) == 0
    (record,) = [json.loads(line) for line in (out / RESUMES_FILE).read_text().splitlines()]
    assert record["changed"] == {"iterations": {"from": 2, "to": 3}}
    saved = yaml.safe_load(config.read_text())
    assert saved == {**config_values(TrainConfig(**{**saved, "iterations": 3})), "output_dir": str(out)}


def test_a_checkpoint_that_does_not_fit_the_models_is_named_in_one_line(finished, tmp_path, monkeypatch):
    """The same model name with other contents (here: a bigger critic head) reaches the state's load."""
    out = _copy(finished, tmp_path)
    from textrl.models.value import ValueModel

    build = ValueModel.from_causal_lm

    def wider(policy):
        critic = build(policy)
        critic.value_head = type(critic.value_head)(critic.value_head.in_features, 2)
        return critic

    monkeypatch.setattr(ValueModel, "from_causal_lm", staticmethod(wider))
    before = _files(out)
    with pytest.raises(SystemExit) as refused:
        main(["train", "--output-dir", str(out), *RUN, "--iterations", "3", "--resume"])
    message = str(refused.value.code)
    assert "iter_000002 does not fit the models this run built: " in message
    assert "weights of another shape (first: critic.value_head.weight, [1, " in message and "\n" not in message
    changed = {k for k, v in _files(out).items() if before.get(k) != v}
    assert changed <= {".textrl.lock"}  # the lock's record of its holder only
