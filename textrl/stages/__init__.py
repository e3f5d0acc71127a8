"""The supervised and preference stages of the RLHF pipeline, each a ``textrl`` subcommand.

``sft`` (completion-only SFT), ``rm`` (pairwise reward model), ``dpo`` (sigmoid DPO), ``merge``
(LoRA into its base) and ``pipeline`` (SFT -> reward model -> PPO). They share the config
machinery of :mod:`textrl.config.io` (and the fields of :class:`textrl.config.SharedFields`), the
run infrastructure of :mod:`textrl.run` (the loop, metrics log, checkpoints) and, for sft / rm /
dpo, :mod:`textrl.stages.common` (the training loop; :class:`StageConfig` in ``stage_config``, the
model in ``policy``, the rows in ``data``, all importable from ``common``). Modules are imported
on use, so that importing this package stays cheap.
"""

from __future__ import annotations

__all__ = ["common", "data", "dpo", "merge", "pipeline", "policy", "preferences", "rm", "sft", "stage_config"]
