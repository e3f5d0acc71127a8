"""What users meet on their second day (docs/reliability.md, "Runs kept around, moved and come back to"):
moved and copied run folders, a resume from another working folder, the kept warm-up, refusals of
values from a YAML file, and the small traps a user falls into on the way back to a run."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from fault_catalogue import SMALL, Trial, _write, case, judge, run_folder_sound, snapshot, unchanged

RUN = [*SMALL, "--checkpoint-every", "1"]


def _project(trial: Trial, name: str) -> tuple[Path, Path]:
    """A project folder with a relative reward file and a two-iteration run ``runs/a`` made from it."""
    proj = trial.folder(name)
    proj.mkdir()
    (proj / "badrew.py").write_text("def digits(completions, **kwargs):\n"
                                    "    return [float(sum(c.isdigit() for c in t)) for t in completions]\n")
    trial.textrl("train", *RUN, "--iterations", "2", "--reward", "badrew.py:digits", "--output-dir", "runs/a",
                 cwd=proj)
    return proj, proj / "runs" / "a"


@case("second day: a moved run folder, --resume")
def moved(trial: Trial, base: Path) -> None:
    proj, run = _project(trial, "moved")
    shutil.move(run, run.with_name("b"))
    proc = trial.textrl("train", "--config", "runs/b/config.yaml", "--resume", "--iterations", "3", cwd=proj)
    judge(trial, "second day: a moved run folder, --resume", proc, refused=False,
          kept=run_folder_sound(run.with_name("b"), 3) and not run.exists(), expect="resuming it there")


@case("second day: a copied run folder, --resume")
def copied(trial: Trial, base: Path) -> None:
    proj, run = _project(trial, "copied")
    shutil.copytree(run, run.with_name("c"))
    before = snapshot(run)
    proc = trial.textrl("train", "--config", "runs/c/config.yaml", "--resume", "--iterations", "3", cwd=proj)
    judge(trial, "second day: a copied run folder, --resume", proc, refused=False,
          kept=run_folder_sound(run.with_name("c"), 3) and unchanged(before, snapshot(run)),
          expect="resuming it there")


@case("second day: a fresh run from a moved run's config.yaml")
def fresh_from_moved(trial: Trial, base: Path) -> None:
    proj, run = _project(trial, "fresh_moved")
    shutil.move(run, run.with_name("b"))
    before = snapshot(run.with_name("b"))
    proc = trial.textrl("train", "--config", "runs/b/config.yaml", cwd=proj)
    judge(trial, "second day: a fresh run from a moved run's config.yaml", proc, refused=True,
          kept=unchanged(before, snapshot(run.with_name("b"))) and not run.exists(), expect="pass --resume")


@case("second day: --resume from another working folder, relative reward file")
def elsewhere(trial: Trial, base: Path) -> None:
    proj, run = _project(trial, "elsewhere")
    other = trial.folder("elsewhere_cwd")
    other.mkdir()
    proc = trial.textrl("train", "--config", str(run / "config.yaml"), "--resume", "--iterations", "3", cwd=other)
    judge(trial, "second day: --resume from another working folder, relative reward file", proc, refused=False,
          kept=run_folder_sound(run, 3) and not any(other.iterdir()), expect="resumed from")


@case("second day: --resume does not repeat the warm-up")
def warmup_kept(trial: Trial, base: Path) -> None:
    out = trial.folder("warm_kept")
    trial.textrl("train", *RUN, "--iterations", "1", "--output-dir", str(out))
    proc = trial.textrl("train", *RUN, "--iterations", "2", "--resume", "--output-dir", str(out))
    judge(trial, "second day: --resume does not repeat the warm-up", proc, refused=False,
          kept=run_folder_sound(out, 2) and "SFT steps on the format" not in proc.stdout, expect="warm-up: loaded from")


@case("second day: a corrupt kept warm-up")
def warmup_corrupt(trial: Trial, base: Path) -> None:
    out = trial.folder("warm_corrupt")
    trial.textrl("train", *RUN, "--iterations", "1", "--output-dir", str(out))
    kept = out / "warmup" / "policy.pt"
    kept.write_bytes(kept.read_bytes()[: kept.stat().st_size // 2])
    proc = trial.textrl("train", *RUN, "--iterations", "2", "--resume", "--output-dir", str(out))
    judge(trial, "second day: a corrupt kept warm-up", proc, refused=False, kept=run_folder_sound(out, 2),
          expect="running the warm-up again")


@case("second day: a refused value from --config")
def yaml_value(trial: Trial, base: Path) -> None:
    config = _write(trial, "exp.yaml", "agent: rloo\ncritic: lora\n")
    out = trial.folder("yaml_value")
    proc = trial.textrl("train", "--config", str(config), "--output-dir", str(out))
    judge(trial, "second day: a refused value from --config", proc, refused=True, kept=not out.exists(),
          expect=f"remove critic: from {config}")


@case("second day: summary.json says what ran")
def what_ran(trial: Trial, base: Path) -> None:
    summary = json.loads((base / "summary.json").read_text())
    proc = subprocess.CompletedProcess([], 0, stdout=json.dumps(summary.get("generation_engine")), stderr="")
    judge(trial, "second day: summary.json says what ran", proc, refused=False,
          kept=summary.get("device") == "cpu" and "precision" in summary, expect='"ran": "textrl"')


@case("second day: textrl envs | head -2")
def closed_pipe(trial: Trial, base: Path) -> None:
    shell = f"{sys.executable} -m textrl.cli envs | head -2"
    proc = subprocess.run(["bash", "-c", shell], env=trial.env, capture_output=True, text=True, timeout=120)
    judge(trial, "second day: textrl envs | head -2", proc, refused=False,
          kept="BrokenPipe" not in proc.stderr and len(proc.stdout.splitlines()) == 2)


@case("second day: --reward badrew.py:nan")
def reward_named_nan(trial: Trial, base: Path) -> None:
    reward = _write(trial, "badrew.py", "def nan(completions, **kwargs):\n    return [1.0 for _ in completions]\n")
    out = trial.folder("reward_nan")
    proc = trial.textrl("train", *SMALL, "--iterations", "1", "--reward", f"{reward}:nan", "--output-dir", str(out))
    rows = (out / "metrics.jsonl").read_text() if (out / "metrics.jsonl").is_file() else ""
    judge(trial, "second day: --reward badrew.py:nan", proc, refused=False,
          kept=run_folder_sound(out, 1) and "reward_components/nan" in rows)
    out = trial.folder("weight_nan")
    proc = trial.textrl("train", *SMALL, "--reward", "accuracy:nan", "--output-dir", str(out))
    judge(trial, "second day: --reward accuracy:nan", proc, refused=True, kept=not out.exists(), expect="not finite")


@case("second day: messages rows ending with an assistant turn")
def trailing_assistant(trial: Trial, base: Path) -> None:
    rows = [{"messages": [{"role": "user", "content": f"Say {i}"}, {"role": "assistant", "content": str(i)}],
             "reference": "other" if i == 3 else str(i)} for i in range(8)]
    data = _write(trial, "chat.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    out = trial.folder("messages")
    proc = trial.textrl("train", *SMALL, "--dataset", str(data), "--reward", "think_format", "--output-dir", str(out))
    judge(trial, "second day: messages rows ending with an assistant turn", proc, refused=True,
          kept=not (out / "checkpoints").exists(), expect="chat.jsonl:4")


@case("second day: textrl generate --model RUN/checkpoints/iter_N")
def generate_checkpoint(trial: Trial, base: Path) -> None:
    checkpoint = sorted((base / "checkpoints").iterdir())[-1]
    before = snapshot(base)
    proc = trial.textrl("generate", "--model", str(checkpoint), "--max-new-tokens", "4", "--greedy")
    judge(trial, "second day: textrl generate --model RUN/checkpoints/iter_N", proc, refused=False,
          kept=unchanged(before, snapshot(base)) and "### completion" in proc.stdout,
          expect="the policy of checkpoint")
