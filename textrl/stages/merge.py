"""``textrl merge``: fold a policy LoRA adapter into its base and save a full causal LM.

The base is loaded unquantised in the dtype of its checkpoint (an adapter trained on a 4-bit base
merges into the unquantised weights, the usual QLoRA practice); each weight is merged in float32,
``W + scaling B A``, and cast once back to that dtype (:func:`textrl.models.adapters.merge_adapter`),
so a bfloat16 base gives a bfloat16 merged model rounded once per weight. The output folder holds the merged model, the
tokenizer and ``textrl_merged.json`` ``{"base_model", "adapter"}`` (also kept in
``config.textrl_merged``), so that a later stage that treats "the base with adapters disabled"
as its reference can warn that this base is no longer the model before the merge
(:func:`textrl.models.adapters.warn_if_merged`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from textrl.stages.common import adapter_base, is_adapter_dir


@dataclass
class MergeConfig:
    """``textrl merge``: ``--adapter`` and ``--output-dir`` are needed."""

    adapter: str = ""
    """Folder of a policy LoRA adapter (from `textrl sft --lora` or `textrl dpo --lora`)."""
    output_dir: str = ""
    """Where the merged model, its tokenizer and textrl_merged.json go."""
    base_model: str | None = None
    """The base to merge into (default: the one recorded in the adapter folder)."""
    device: str = "cpu"
    """Device of the merge: 'cpu', 'cuda' or 'cuda:N'."""

    def validate(self) -> MergeConfig:
        if not self.adapter:
            raise ValueError("adapter='': pass --adapter FOLDER (a LoRA adapter from `textrl sft --lora`)")
        if not self.output_dir:
            raise ValueError("output_dir='': pass --output-dir FOLDER for the merged model")
        if not is_adapter_dir(self.adapter):
            raise ValueError(
                f"adapter={self.adapter!r} holds no adapter_config.json; pass the model/ folder "
                "written by `textrl sft --lora` or `textrl dpo --lora`"
            )
        if (Path(self.adapter) / "textrl_reward.json").is_file():
            raise ValueError(
                f"adapter={self.adapter!r} is a LoRA reward adapter (`textrl rm --lora`): its score "
                "head is not part of a causal LM; use it with --agent multi_adapter_ppo "
                "--reward-adapter, or train a full reward model with `textrl rm`"
            )
        if Path(self.output_dir).resolve() == Path(self.adapter).resolve():
            raise ValueError("output_dir is the adapter folder; choose another folder for the merged model")
        return self


def merge(config: MergeConfig) -> dict[str, Any]:
    """Merge and save; return ``{"base_model", "adapter", "output_dir"}``."""
    from peft import PeftModel

    from textrl.models import load_causal_lm, load_tokenizer
    from textrl.models.adapters import merge_adapter, save_merged_model
    from textrl.run import resolve_device

    config.validate()
    base_name = config.base_model or adapter_base(config.adapter)
    base = load_causal_lm(base_name, dtype="auto", device=resolve_device(config.device)).eval()  # the checkpoint's dtype
    peft_model = PeftModel.from_pretrained(base, config.adapter)
    merged = merge_adapter(peft_model, "default")
    has_tokenizer = (Path(config.adapter) / "tokenizer_config.json").is_file()
    tokenizer_source = config.adapter if has_tokenizer else base_name
    save_merged_model(merged, config.output_dir, base_model=base_name, adapter=str(config.adapter),
                      tokenizer=load_tokenizer(tokenizer_source))
    return {"base_model": base_name, "adapter": str(config.adapter), "output_dir": config.output_dir}


def format_merge_result(result: dict[str, Any]) -> str:
    return f"merged {result['adapter']} into {result['base_model']}: {result['output_dir']}"


__all__ = ["MergeConfig", "format_merge_result", "merge"]
