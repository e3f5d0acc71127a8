"""Import paths of modules that moved, kept working: ``textrl.trainer`` is ``textrl.training.trainer``.

:data:`MOVED` maps each former path to the module's present one. :func:`install` (run by ``import
textrl``) puts a finder on ``sys.meta_path`` that answers a former path with the present module
itself (the same object, so a monkeypatch or an ``isinstance`` through either path is the same),
after a :class:`DeprecationWarning` that names the present path. Unpickling an object saved under
a former path finds it the same way. textrl's own code imports the present paths only
(``tests/test_moved_modules.py``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

MOVED: dict[str, str] = {
    "textrl.agent_registry": "textrl.core.agent_registry",
    "textrl.checks": "textrl.core.checks",
    "textrl.env_facts": "textrl.core.env_facts",
    "textrl.kl_control": "textrl.core.kl_control",
    "textrl.optim": "textrl.core.optim",
    "textrl.precision": "textrl.core.precision",
    "textrl.quiet": "textrl.core.quiet",
    "textrl.timing": "textrl.core.timing",
    "textrl.user_files": "textrl.core.user_files",
    "textrl.versions": "textrl.core.versions",
    "textrl.config_io": "textrl.config.io",
    "textrl.help_topics": "textrl.config.help_topics",
    "textrl.reward_option": "textrl.config.reward_option",
    "textrl.trl_names": "textrl.config.trl_names",
    "textrl.distributed": "textrl.parallel.distributed",
    "textrl.rollout": "textrl.run.rollout",
    "textrl.warmup": "textrl.run.warmup",
    "textrl.async_training": "textrl.training.async_training",
    "textrl.rollout_sources": "textrl.training.rollout_sources",
    "textrl.train_records": "textrl.training.records",
    "textrl.trainer": "textrl.training.trainer",
    "textrl.envs.prompt_batch": "textrl.envs.prompts.batch",
    "textrl.envs.prompt_dataset": "textrl.envs.prompts.dataset",
    "textrl.envs.prompt_encoding": "textrl.envs.prompts.encoding",
    "textrl.envs.prompt_sampler": "textrl.envs.prompts.sampler",
    "textrl.envs.prompt_table": "textrl.envs.prompts.table",
    "textrl.envs.row_stores": "textrl.envs.prompts.stores",
    "textrl.envs.row_edits": "textrl.envs.prompts.edits",
    "textrl.envs.rows": "textrl.envs.prompts.rows",
}
"""Former import path -> present one."""


class _Present(importlib.abc.Loader):
    """Loads a former path as the present module (imported first, then handed over as it is)."""

    def __init__(self, present: str) -> None:
        self.present = present
        self.spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(f"{spec.name} moved to {self.present}; import it from there "
                      f"({spec.name} keeps working for now)", DeprecationWarning, stacklevel=2)
        module = importlib.import_module(self.present)
        self.spec = module.__spec__  # the import machinery sets the former path's spec on it next
        return module

    def exec_module(self, module: ModuleType) -> None:
        """The present module ran when it was imported: only its own spec is put back."""
        module.__spec__ = self.spec


class _MovedFinder(importlib.abc.MetaPathFinder):
    """Finds the former paths of :data:`MOVED`, and nothing else."""

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        present = MOVED.get(fullname)
        if present is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Present(present))


def install() -> None:
    """Put the finder of former paths on ``sys.meta_path`` once."""
    if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
