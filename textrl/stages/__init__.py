"""The supervised and preference stages of the RLHF pipeline, each a ``textrl`` subcommand.

``sft`` (completion-only SFT), ``rm`` (pairwise reward model), ``dpo`` (sigmoid DPO), ``merge``
(LoRA into its base) and ``pipeline`` (SFT -> reward model -> PPO). They share the config
machinery of :mod:`textrl.config`, the run infrastructure of :mod:`textrl.run` (the loop,
metrics log, checkpoints) and atomic saving (:mod:`textrl.stages.common`). Modules are imported
on use, so that importing this package stays cheap.
"""

from __future__ import annotations

__all__ = ["common", "dpo", "merge", "pipeline", "preferences", "rm", "sft", "synthetic"]
