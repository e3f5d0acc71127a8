"""Fault cases of sampling, models and LoRA (docs/reliability.md, "Sampling, models and LoRA").

``--lora-r 8`` on a GPT-2 folder (the LoRA targets default to peft's choice for the architecture,
``c_attn``), a model folder whose ``generation_config.json`` carries ``repetition_penalty`` and
``no_repeat_ngram_size`` (the run names them and samples without them), and ``--kl-coef 0`` (no
reference model, no KL monitors).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from fault_catalogue import SMALL, Trial, case, judge, run_folder_sound

ONE = [*SMALL, "--iterations", "1"]


def _tiny(trial: Trial, kind: str) -> Path:
    from textrl.models import tiny_model_path

    return tiny_model_path(kind, cache_dir=trial.env["TEXTRL_CACHE"])


def _rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


@case("sampling: --lora-r 8 on a GPT-2 folder")
def lora_on_gpt2(trial: Trial, base: Path) -> None:
    out = trial.folder("lora_gpt2")
    proc = trial.textrl("train", *ONE, "--model", str(_tiny(trial, "gpt2")), "--lora-r", "8", "--output-dir", str(out))
    judge(trial, "sampling: --lora-r 8 on a GPT-2 folder", proc, refused=False, kept=run_folder_sound(out, 1))


@case("sampling: a lora target list that matches nothing")
def lora_targets_match_nothing(trial: Trial, base: Path) -> None:
    out = trial.folder("lora_targets")
    proc = trial.textrl("train", *ONE, "--model", str(_tiny(trial, "gpt2")), "--lora-r", "8",
                        "--lora-target-modules", "q_proj,v_proj", "--output-dir", str(out))
    judge(trial, "sampling: a lora target list that matches nothing", proc, refused=True,
          kept=not (out / "metrics.jsonl").exists(), expect="its linear modules are c_attn, c_proj, c_fc, lm_head")


@case("sampling: a model folder with repetition_penalty")
def folder_with_repetition_penalty(trial: Trial, base: Path) -> None:
    model = trial.root / "penalised_model"
    shutil.rmtree(model, ignore_errors=True)
    shutil.copytree(_tiny(trial, "causal_lm"), model)
    settings = json.loads((model / "generation_config.json").read_text())
    settings.update(repetition_penalty=1.05, no_repeat_ngram_size=3)
    (model / "generation_config.json").write_text(json.dumps(settings))
    out = trial.folder("penalised")
    proc = trial.textrl("train", *ONE, "--model", str(model), "--output-dir", str(out))
    judge(trial, "sampling: a model folder with repetition_penalty", proc, refused=False, kept=run_folder_sound(out, 1),
          expect="sets repetition_penalty=1.05, no_repeat_ngram_size=3; textrl samples without them")


@case("sampling: kl_coef 0 runs without a reference")
def kl_coef_zero(trial: Trial, base: Path) -> None:
    out = trial.folder("kl0")
    proc = trial.textrl("train", *ONE, "--agent", "gae_ppo", "--kl-coef", "0", "--output-dir", str(out))
    rows = _rows(out)
    kept = run_folder_sound(out, 1) and bool(rows) and "kl/collection" not in rows[-1] and rows[-1]["kl/coef"] == 0.0
    judge(trial, "sampling: kl_coef 0 runs without a reference", proc, refused=False, kept=kept,
          note="no kl/ monitors in metrics.jsonl")
