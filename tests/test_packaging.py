"""What the package installs: one top-level import name, ``textrl``, and nothing a user's own
``envs/`` (or ``agents/``, ``rewards/``) folder can shadow."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import json, sys
import textrl.envs, textrl.rewards, textrl.agents
import envs, agents, rewards   # the user's own packages, next to this script
from textrl.config import TrainConfig
from textrl.trainer import train

assert envs.MINE and agents.MINE and rewards.MINE, "the user's packages were shadowed"
assert textrl.envs.TokenMDPEnv and textrl.agents.GAEPPO and textrl.rewards.get_reward
summary = train(TrainConfig(
    output_dir=sys.argv[1], iterations=1, prompts_per_iteration=2, n_samples_per_prompt=2,
    max_new_tokens=4, warmup_sft_steps=0, eval_size=4, eval_every=0, progress=False,
    num_minibatches=1, ppo_epochs=1,
))
print(json.dumps(sorted(summary["after"])))
"""


@pytest.mark.slow
def test_a_script_beside_its_own_envs_package_imports_and_trains_with_textrl(tmp_path):
    for name in ("envs", "agents", "rewards"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("MINE = True\n")
    (tmp_path / "script.py").write_text(textwrap.dedent(SCRIPT))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ""}
    result = subprocess.run(
        [sys.executable, "script.py", str(tmp_path / "run")], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "eval/sampled/reward/mean" in result.stdout
    assert (tmp_path / "run" / "metrics.jsonl").is_file()


@pytest.mark.slow
def test_the_wheel_installs_textrl_alone_at_the_top_level(tmp_path):
    source = tmp_path / "source"  # a copy: setuptools writes build/ into the tree it builds
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    for name in tracked.stdout.splitlines():
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path), str(source)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (wheel,) = tmp_path.glob("textrl-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"textrl"}, f"the wheel installs {sorted(top)} at the top level"
    for module in ("textrl/envs/token_mdp.py", "textrl/agents/gae_ppo.py",
                   "textrl/rewards/rules.py", "textrl/envs/data/digits.jsonl"):
        assert module in names, f"{module} is missing from the wheel"
