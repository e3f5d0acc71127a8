"""What the package installs: one top-level import name, ``textrl``, with every subpackage of the
tree (``textrl/envs/``, ``textrl/rewards/``, ``textrl/agents/`` as ``textrl.envs``, ...), and nothing
a user's own ``envs/`` (or ``agents/``, ``rewards/``) folder can shadow."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest
from setuptools.config.pyprojecttoml import read_configuration

ROOT = Path(__file__).resolve().parents[1]


def _setuptools_config() -> dict:
    return read_configuration(ROOT / "pyproject.toml")["tool"]["setuptools"]


def _package_roots() -> dict[str, Path]:
    """Each installed top package and the source folder it comes from: ``textrl`` itself and any
    folder ``[tool.setuptools.package-dir]`` maps under it (none: a file's path is its import name)."""
    mapped = _setuptools_config().get("package-dir", {})
    return {"textrl": ROOT / "textrl", **{name: ROOT / folder for name, folder in mapped.items()}}


def _source_packages() -> dict[str, Path]:
    """Every package of the tree, by the name it installs as: each folder under a package root
    that holds an ``__init__.py``."""
    packages = {}
    for top, folder in _package_roots().items():
        for init in folder.rglob("__init__.py"):
            relative = init.parent.relative_to(folder)
            if "__pycache__" in relative.parts:
                continue
            packages[".".join((top, *relative.parts))] = init.parent
    return packages


def test_pyproject_lists_exactly_the_packages_of_the_tree():
    """``[tool.setuptools] packages`` is written by hand: a subpackage folder missing from it is
    left out of a built wheel, which only a non-editable install shows (``ModuleNotFoundError``)."""
    listed = set(_setuptools_config()["packages"])
    tree = set(_source_packages())
    assert not tree - listed, (
        f"add {sorted(tree - listed)} to [tool.setuptools] packages in pyproject.toml: "
        "a wheel ships only the packages listed there")
    assert not listed - tree, (
        f"[tool.setuptools] packages lists {sorted(listed - tree)}, which no folder with an "
        "__init__.py provides")


def test_every_folder_of_python_modules_is_a_package():
    """A folder of modules without an ``__init__.py`` would be neither listed nor shipped."""
    for top, folder in _package_roots().items():
        for module in folder.rglob("*.py"):
            if "__pycache__" in module.parts:
                continue
            assert (module.parent / "__init__.py").is_file(), (
                f"{module.relative_to(ROOT)} sits in a folder without an __init__.py: "
                f"it would not be installed with {top}")


SCRIPT = """
import json, sys
import textrl.envs, textrl.rewards, textrl.agents
import envs, agents, rewards   # the user's own packages, next to this script
from textrl.config import TrainConfig
from textrl.training.trainer import train

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


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel of the working tree, built once for this module's tests."""
    build = tmp_path_factory.mktemp("wheel")
    source = build / "source"  # a copy: setuptools writes build/ into the tree it builds
    # Tracked files and new ones not committed yet (git's ignored files stay out).
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, capture_output=True, text=True, check=True)
    for name in files.stdout.splitlines():
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(build), str(source)],
        capture_output=True, text=True, timeout=600, cwd=build,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (built,) = build.glob("textrl-*.whl")
    return built


@pytest.mark.slow
def test_the_wheel_installs_textrl_alone_at_the_top_level(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"textrl"}, f"the wheel installs {sorted(top)} at the top level"
    for module in ("textrl/envs/token_mdp.py", "textrl/agents/gae_ppo.py",
                   "textrl/rewards/rules.py", "textrl/envs/data/digits.jsonl",
                   "textrl/py.typed"):
        assert module in names, f"{module} is missing from the wheel"
    modules = {
        "/".join((*package.split("."), path.name))
        for package, folder in _source_packages().items() for path in folder.glob("*.py")
    }
    assert not modules - set(names), f"the wheel lacks {sorted(modules - set(names))}"


INSTALLED = """
import importlib, json, pkgutil, sys
from importlib.metadata import Distribution
from pathlib import Path

site = Path(sys.argv[1]).resolve()
import textrl

# `python -S` reads no .pth file, so the editable install's finder is not there to answer.
assert not [n for n in sys.modules if n.startswith("__editable__")], "the editable finder loaded"
assert Path(textrl.__file__).resolve().is_relative_to(site), textrl.__file__
imported, failures = ["textrl"], []

def unlisted(name):  # a package whose import failed: its modules could not be listed
    failures.append(f"{name}: its modules were not listed, the package did not import")

for info in pkgutil.walk_packages(textrl.__path__, "textrl.", onerror=unlisted):
    try:
        module = importlib.import_module(info.name)
    except ImportError as err:  # a module of an optional extra, without it: the error says what to install
        if "pip install 'textrl[" not in str(err):
            failures.append(f"{info.name}: {type(err).__name__}: {err}")
        continue
    except Exception as err:
        failures.append(f"{info.name}: {type(err).__name__}: {err}")
        continue
    if not Path(module.__file__).resolve().is_relative_to(site):
        failures.append(f"{info.name} was imported from {module.__file__}, not the install")
    imported.append(info.name)
if failures:
    sys.exit("modules of the installed textrl that fail to import:\\n" + "\\n".join(failures))
Path("imported.json").write_text(json.dumps(imported))

# The `textrl` command as the wheel declares it (its script's shebang names the venv's python,
# which would import the editable install: call the entry point here instead).
(info,) = site.glob("textrl-*.dist-info")
(entry,) = [e for e in Distribution.at(info).entry_points
            if e.group == "console_scripts" and e.name == "textrl"]
sys.argv = ["textrl", *sys.argv[2:]]
sys.exit(entry.load()())
"""


@pytest.mark.slow
def test_the_installed_wheel_imports_every_module_and_trains(wheel, tmp_path):
    """Installed from the wheel (not editable) and run outside the source tree, every module of
    ``textrl`` imports and ``textrl train`` runs an iteration (one process for both: the
    imports of torch and transformers are most of its time)."""
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile", "-q",
         "--target", str(site), str(wheel)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (site / "bin" / "textrl").is_file(), "the wheel declares no `textrl` command"
    work = tmp_path / "work"
    work.mkdir()
    # -S: no site module, hence no .pth file and no editable finder; the venv's own
    # site-packages comes back through PYTHONPATH, after the installed wheel, for the
    # dependencies.
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(site), sysconfig.get_paths()["purelib"]])}
    run = work / "run"
    result = subprocess.run(
        [sys.executable, "-S", "-c", INSTALLED, str(site), "train",
         "--output-dir", str(run), "--iterations", "1", "--warmup-sft-steps", "0",
         "--eval-size", "4", "--eval-every", "0", "--prompts-per-iteration", "2",
         "--n-samples-per-prompt", "2", "--max-new-tokens", "4", "--num-minibatches", "1",
         "--ppo-epochs", "1", "--progress", "false"],
        cwd=work, env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    imported = json.loads((work / "imported.json").read_text())
    for name in ("textrl.parallel", "textrl.envs", "textrl.agents", "textrl.rewards", "textrl.cli"):
        assert name in imported, f"{name} was not found in the installed package"
    rows = (run / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 1, rows
