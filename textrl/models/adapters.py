"""LoRA adapters on one (optionally 4-bit NF4) base model: loading, reward adapters, merging.

The pieces the multi-adapter stages share (docs/design.md, "Agents", MA-RLHF):

- :func:`load_base_model` loads a causal LM, quantised to 4-bit NF4 with bitsandbytes on request;
- :func:`lora_config` is the one LoRA recipe every stage uses (causal-LM task, no bias);
- :func:`last_token_hidden` reads the final hidden state at each row's last attended token;
- :func:`save_reward_adapter` / :func:`load_reward_adapter` write and read the reward-adapter
  folder of ``textrl rm --lora`` (format below);
- :func:`merge_adapter` / :func:`save_merged_model` / :func:`merge_info` merge a LoRA into its base,
  save the result with a record of the merge, and detect such a record later.

Reward-adapter folder (``textrl-lora-reward`` version 1)::

    adapter_config.json         peft LoRA config of the reward adapter (at the top level)
    adapter_model.safetensors   its LoRA weights (at the top level)
    score_head.safetensors      tensors ``weight`` [1, H] and ``bias`` [1]
    textrl_reward.json          {"format": "textrl-lora-reward", "version": 1,
                                 "base_model": <str>, "hidden_size": H}

The score of a text is ``score_head(last_token_hidden(base + reward adapter, ids, mask))``.
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from textrl.config.io import check_bitsandbytes
from textrl.core.precision import Precision
from textrl.models.tiny import _resolve, load_causal_lm
from textrl.run import atomic

if TYPE_CHECKING:  # peft (and through it bitsandbytes) is imported only when an adapter is used
    from peft import LoraConfig, PeftModel

REWARD_FORMAT = "textrl-lora-reward"
REWARD_VERSION = 1
REWARD_META = "textrl_reward.json"
SCORE_HEAD = "score_head.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
MERGED_META = "textrl_merged.json"
"""Written next to a merged model by :func:`save_merged_model` (also kept in ``config.textrl_merged``)."""


# -- base model and LoRA recipe -------------------------------------------------------------------


def load_base_model(
    name: str | os.PathLike[str],
    *,
    load_in_4bit: bool = False,
    device: str | torch.device | None = None,
    precision: Precision | None = None,
) -> PreTrainedModel:
    """A causal LM from a local path, a hub id or ``"tiny"``, in eval mode, on ``device`` (CPU).

    ``precision`` (default: float32 weights, no autocast, on ``device``) sets the weights' dtype and
    the attention implementation. With ``load_in_4bit`` the linear layers are NF4 (bitsandbytes)
    computing in the precision's compute dtype (bfloat16 under bf16 autocast or bf16 weights,
    else float32); embeddings, norms and the LM head stay in that dtype.
    """
    device = torch.device(device if device is not None else "cpu")
    precision = precision or Precision(device)
    if isinstance(name, nn.Module) and load_in_4bit and not getattr(name, "is_loaded_in_4bit", False):
        raise ValueError("load_in_4bit=True quantises a model while loading it: pass a path or hub id as model, "
                         "or a model loaded in 4-bit (BitsAndBytesConfig(load_in_4bit=True))")
    if isinstance(name, nn.Module) and load_in_4bit:
        return name.eval()
    if not load_in_4bit:
        return load_causal_lm(name, device=device, **precision.model_kwargs()).eval()
    check_bitsandbytes("load_in_4bit")
    from transformers import BitsAndBytesConfig

    compute = precision.compute_dtype
    quant = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute
    )
    model = AutoModelForCausalLM.from_pretrained(
        _resolve(name, "causal_lm"), quantization_config=quant, **{**precision.model_kwargs(), "dtype": compute},
        device_map={"": str(device) if device.type != "cuda" else (device.index or 0)},
    )
    keep_4bit_differentiable(model)
    if device.type == "cpu":
        # The unquantised weights (embeddings, norms, head) are views into the memory-mapped float
        # checkpoint, which keeps every page read while quantising resident: own them instead.
        for param in model.parameters():
            if param.dtype != torch.uint8:
                param.data = param.data.clone()
    return model.eval()


def keep_4bit_differentiable(model: nn.Module) -> int:
    """Keep every NF4 layer on bitsandbytes' differentiable matmul; returns how many were changed.

    On CPUs with AVX512-BF16, bitsandbytes (0.50) repacks an NF4 weight for its inference kernel
    the first time an eval-mode layer sees an input without grad (generation, reference
    forwards), and from then on always calls that kernel, which has no autograd: gradients
    through the layer to the LoRA weights below it become silently wrong. This turns the repacking
    off and undoes it where it already happened (with a warning: the repacking rounded the block
    scales to bfloat16, so those layers now hold slightly different weights).
    """
    changed = repacked = 0
    for module in model.modules():
        if not getattr(module, "support_avx512bf16_for_cpu", False) and not _cpu_packed(module):
            continue
        module.support_avx512bf16_for_cpu = False
        if _cpu_packed(module):
            from bitsandbytes.nn.modules import _convert_weight_packed_for_cpu_inverse

            module.weight.data, module.weight.quant_state = _convert_weight_packed_for_cpu_inverse(
                module.weight.data, module.weight.quant_state
            )
            repacked += 1
        changed += 1
    if repacked:
        warnings.warn(
            f"{repacked} NF4 layers had been repacked by bitsandbytes for CPU inference (a no-grad "
            "forward ran before training); they are unpacked so gradients flow, but their block "
            "scales were rounded to bfloat16 on the way: load the base with load_base_model to avoid it",
            UserWarning,
            stacklevel=2,
        )
    return changed


def _cpu_packed(module: nn.Module) -> bool:
    state = getattr(getattr(module, "weight", None), "quant_state", None)
    return bool(getattr(state, "packing_format_for_cpu", False))


def is_adapter_dir(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a folder holding a peft adapter (``adapter_config.json``)."""
    return (Path(path) / "adapter_config.json").is_file()


def is_peft(model: Any) -> bool:
    """True for a peft ``PeftModel`` (duck-typed, so peft need not be imported)."""
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def is_quantized(model: nn.Module) -> bool:
    """True when ``model`` (or the base under a PeftModel) holds bitsandbytes 4/8-bit weights."""
    base = model.get_base_model() if is_peft(model) else model
    return bool(getattr(base, "is_loaded_in_4bit", False) or getattr(base, "is_loaded_in_8bit", False))


AUTO_TARGETS = "auto"
"""``lora_target_modules`` default: peft's choice for the architecture, else every linear layer."""
LEGACY_LLAMA_TARGETS = "q_proj,k_proj,v_proj,o_proj"
"""The default of textrl before ``auto``: a config that holds it still means exactly that list."""


def linear_module_names(model: nn.Module) -> list[str]:
    """The distinct last names of ``model``'s linear layers (``nn.Linear``, GPT-2's ``Conv1D``,
    bitsandbytes' 4-bit linears), output head included, in order of appearance."""
    names: dict[str, None] = {}
    for full, module in model.named_modules():
        kind = type(module).__name__
        if full and (isinstance(module, nn.Linear) or kind in ("Conv1D", "Linear4bit", "Linear8bitLt")):
            names.setdefault(full.rsplit(".", 1)[-1], None)
    return list(names)


def auto_target_modules(model: nn.Module) -> list[str] | str:
    """peft's LoRA targets for ``model``'s architecture (``TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING``,
    what ``target_modules=None`` picks: GPT-2 ``c_attn``, Llama / Qwen2 ``q_proj, v_proj``), else
    ``"all-linear"`` (every linear layer but the output head) for an architecture peft does not know."""
    from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as BY_ARCHITECTURE

    base = model.get_base_model() if is_peft(model) else model
    model_type = getattr(getattr(base, "config", None), "model_type", None)
    targets = BY_ARCHITECTURE.get(model_type)
    return list(targets) if targets else "all-linear"


def target_modules_for(spec: str | Sequence[str], model: nn.Module | None = None) -> list[str] | str | None:
    """The ``target_modules`` a LoRA on ``model`` gets from ``spec``: ``"auto"`` ->
    :func:`auto_target_modules` (None without a model: peft chooses when the adapter is added);
    ``"all-linear"`` as it is; a comma list or a sequence of names, checked against ``model``:
    one that matches no module is refused, naming the model's linear modules."""
    if isinstance(spec, str):
        text = spec.strip()
        if text in (AUTO_TARGETS, "all-linear"):
            return (auto_target_modules(model) if model is not None else None) if text == AUTO_TARGETS else text
        modules = [m.strip() for m in text.split(",") if m.strip()]
    else:
        modules = [str(m) for m in spec]
    if not modules:
        raise ValueError("lora target_modules is empty: name modules (e.g. 'q_proj,v_proj'), 'auto' or 'all-linear'")
    if model is not None:
        present = {full.rsplit(".", 1)[-1] for full, _ in model.named_modules() if full}
        if not present & set(modules):
            model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
            raise ValueError(
                f"lora_target_modules={','.join(modules)!r} matches no module of this {model_type} model; its "
                f"linear modules are {', '.join(linear_module_names(model))}: name some of them, or leave the "
                "default 'auto' (peft's choice for the architecture) or pass 'all-linear'")
    return modules


def lora_config(
    r: int = 8,
    alpha: int = 16,
    dropout: float = 0.0,
    target_modules: str | Sequence[str] = AUTO_TARGETS,
    model: nn.Module | None = None,
) -> LoraConfig:
    """The LoRA recipe of every stage: causal-LM task, no bias, B zero-initialised.

    ``target_modules`` is ``"auto"`` (peft's per-architecture choice, else ``"all-linear"``), a comma
    list (``"q_proj,v_proj"``), a sequence of names, or ``"all-linear"`` (every linear layer but
    the output head); with ``model`` it is resolved and checked against it
    (:func:`target_modules_for`).
    """
    from peft import LoraConfig

    return LoraConfig(
        r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules_for(target_modules, model),
        bias="none", task_type="CAUSAL_LM",
    )


# -- hidden states --------------------------------------------------------------------------------


def transformer_body(model: nn.Module) -> nn.Module:
    """The transformer body (``LlamaModel``, GPT-2's ``transformer``) under a PeftModel / head model.

    Calling the body instead of the whole model skips the ``[B, L, V]`` LM-head logits; LoRA layers
    live inside the body, so the active adapter still applies.
    """
    if is_peft(model):
        model = model.get_base_model()
    body = getattr(model, "base_model", None)
    return body if isinstance(body, nn.Module) and body is not model else model


def final_hidden(model: nn.Module, input_ids: Tensor, attention_mask: Tensor | None,
                 position_ids: Tensor | None = None) -> Tensor:
    """Final hidden states ``[B, L, H]`` (after the last norm), positions counted from the mask, no
    attention row fully masked (:func:`textrl.models.forward.hidden_states`; ``attention_mask=None``:
    packed rows with their ``position_ids``)."""
    from textrl.models.forward import hidden_states

    return hidden_states(transformer_body(model), input_ids, attention_mask, position_ids)


def last_token_hidden(model: nn.Module, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """Float32 ``[B, H]``: final hidden state at each row's last attended token.

    ``input_ids``, ``attention_mask`` ``[B, L]``; right or left padding (the last position whose
    mask is 1), position ids from the mask so a left-padded row reads as it would alone.
    """
    hidden = final_hidden(model, input_ids, attention_mask)  # [B, L, H]
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)  # [L]
    last = torch.where(attention_mask.bool(), positions, -1).argmax(-1)  # [B]
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), last].float()  # [B, H]


def hidden_size(model: nn.Module) -> int:
    """``config.hidden_size`` (or GPT-2's ``n_embd``) of a model or PeftModel."""
    config = getattr(model, "config", None)
    size = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
    if size is None:
        raise ValueError(f"{type(model).__name__} has no config.hidden_size; pass a transformers model")
    return int(size)


# -- reward adapter folder ------------------------------------------------------------------------


def write_atomically(path: Path, write: Callable[[Path], None]) -> Path:
    """Fill a temporary sibling folder with ``write(tmp)``, then rename it to ``path``: the folder
    is complete or absent (an older one is replaced only once the new one is whole;
    :func:`textrl.run.atomic.write_folder`)."""
    return atomic.write_folder(path, write)


def save_adapter(model: PeftModel, adapter_name: str, path: str | os.PathLike[str]) -> None:
    """Save one adapter of ``model`` in peft format with its files at the top level of ``path``.

    peft puts an adapter not named ``"default"`` in a subfolder; it is moved up here, so
    ``PeftModel.from_pretrained(base, path)`` loads it.
    """
    if adapter_name not in model.peft_config:
        raise ValueError(f"the model has no adapter {adapter_name!r}; it has {sorted(model.peft_config)}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path) as tmp:
        model.save_pretrained(tmp, selected_adapters=[adapter_name])
        src = Path(tmp) if adapter_name == "default" else Path(tmp) / adapter_name
        for file in src.iterdir():
            if file.is_file():
                os.replace(file, path / file.name)


def save_reward_adapter(
    model: PeftModel,
    score_head: nn.Linear,
    path: str | os.PathLike[str],
    *,
    adapter_name: str = "default",
    base_model: str,
) -> None:
    """Write the reward-adapter folder (module docstring) atomically: complete or absent.

    ``model`` carries the trained reward LoRA ``adapter_name``; ``score_head`` is
    ``Linear(H, 1)``; ``base_model`` names the model the adapter was trained on (path or hub id).
    """
    h = hidden_size(model)
    if tuple(score_head.weight.shape) != (1, h) or score_head.bias is None:
        raise ValueError(
            f"score_head must be nn.Linear({h}, 1) with a bias, got weight "
            f"{tuple(score_head.weight.shape)} bias={score_head.bias is not None}"
        )
    meta = {"format": REWARD_FORMAT, "version": REWARD_VERSION, "base_model": str(base_model), "hidden_size": h}

    def write(tmp: Path) -> None:
        save_adapter(model, adapter_name, tmp)
        head = {
            "weight": score_head.weight.detach().float().cpu().contiguous(),
            "bias": score_head.bias.detach().float().cpu().contiguous(),
        }
        save_file(head, str(tmp / SCORE_HEAD))
        (tmp / REWARD_META).write_text(json.dumps(meta, indent=2) + "\n")

    write_atomically(Path(path), write)


def read_reward_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """``textrl_reward.json`` of a reward-adapter folder, after checking every file is there."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(
            f"reward adapter {str(path)!r} is not a folder; pass the output folder of "
            "`textrl rm --lora` (or of textrl.models.adapters.save_reward_adapter)"
        )
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS, SCORE_HEAD, REWARD_META):
        if not (path / name).is_file():
            raise ValueError(
                f"reward adapter folder {str(path)!r} has no {name}; it is incomplete or not a "
                "textrl LoRA reward model: write it again with `textrl rm --lora` "
                "(textrl.models.adapters.save_reward_adapter)"
            )
    try:
        meta = json.loads((path / REWARD_META).read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path / REWARD_META}: not valid JSON ({err}); write the folder again") from err
    if meta.get("format") != REWARD_FORMAT or meta.get("version") != REWARD_VERSION:
        raise ValueError(
            f"{path / REWARD_META}: format {meta.get('format')!r} version {meta.get('version')!r}; "
            f"this textrl reads {REWARD_FORMAT!r} version {REWARD_VERSION}"
        )
    return meta


def load_reward_adapter(
    model: PeftModel | PreTrainedModel,
    path: str | os.PathLike[str],
    *,
    adapter_name: str = "reward",
) -> tuple[PeftModel, nn.Linear]:
    """Add the frozen reward adapter of folder ``path`` to ``model``; return it and the score head.

    A plain model is wrapped into a PeftModel (the reward adapter becomes its active adapter);
    a PeftModel gets one more adapter (its active adapter is left as it was). The adapter and the
    float32 score head ``Linear(H, 1)`` have ``requires_grad=False``. Raises ``ValueError`` naming
    the missing file or the mismatched field.
    """
    from peft import LoraConfig, PeftModel

    path = Path(path)
    meta = read_reward_meta(path)
    h = hidden_size(model)
    if meta.get("hidden_size") != h:
        raise ValueError(
            f"{path / REWARD_META}: hidden_size={meta.get('hidden_size')} but the model has "
            f"hidden_size={h}; the reward adapter was trained on another base "
            f"(base_model={meta.get('base_model')!r}): load that base, or train the reward "
            "adapter on this one"
        )
    head_state = load_file(str(path / SCORE_HEAD))
    shapes = {k: tuple(v.shape) for k, v in head_state.items()}
    if shapes != {"weight": (1, h), "bias": (1,)}:
        raise ValueError(
            f"{path / SCORE_HEAD}: tensors {shapes}, expected weight (1, {h}) and bias (1,); "
            "write the folder again with save_reward_adapter"
        )
    config = LoraConfig.from_pretrained(str(path))
    if config.modules_to_save:
        raise ValueError(
            f"{path / ADAPTER_CONFIG}: modules_to_save={config.modules_to_save}; a textrl reward "
            f"adapter keeps its head in {SCORE_HEAD}, not in the peft adapter"
        )
    config.task_type = "CAUSAL_LM"
    if is_peft(model):
        if adapter_name in model.peft_config:
            raise ValueError(f"the model already has an adapter named {adapter_name!r}; pick another adapter_name")
        active = model.active_adapter
        model.load_adapter(str(path), adapter_name=adapter_name, is_trainable=False)
        model.set_adapter(active)
    else:
        model = PeftModel.from_pretrained(
            model, str(path), adapter_name=adapter_name, is_trainable=False, config=config
        )
    for name, param in model.named_parameters():
        if f".{adapter_name}." in name:
            param.requires_grad_(False)
    device = next(model.parameters()).device
    head = nn.Linear(h, 1).to(device)
    head.load_state_dict({k: v.to(device) for k, v in head_state.items()})
    return model, head.requires_grad_(False).eval()


# -- merging --------------------------------------------------------------------------------------


def lora_delta(layer: nn.Module, adapter: str) -> Tensor:
    """The weight update of ``adapter`` on peft LoRA ``layer`` in float32, shaped as the base layer's
    weight: ``scaling * B @ A`` (transposed where the base is a GPT-2 ``Conv1D``: ``fan_in_fan_out``),
    from the adapter's weights whatever their dtype (peft's ``get_delta_weight`` rounds it to theirs).
    ``ValueError`` for a layer whose merge is more than ``W + B A`` (DoRA and other variants, a LoRA bias,
    embedding and convolution LoRAs)."""
    lora_a = getattr(layer, "lora_A", {})
    plain = (adapter in lora_a and lora_a[adapter].weight.dim() == 2 and adapter not in getattr(layer, "lora_variant", {})
             and not getattr(layer, "lora_bias", {}).get(adapter, False))
    if not plain:
        raise ValueError(f"{type(layer).__name__} of adapter {adapter!r} is not a plain linear LoRA (W + B A): "
                         "textrl merges only those (no DoRA, LoRA bias, embedding or convolution adapters)")
    delta = layer.lora_B[adapter].weight.float() @ lora_a[adapter].weight.float()  # [out, in]
    return (delta.T if layer.fan_in_fan_out else delta) * layer.scaling[adapter]


def merged_weight(weight: Tensor, delta: Tensor) -> Tensor:
    """``weight + delta`` computed in float32 and cast once to ``weight``'s dtype: a bfloat16 weight is
    rounded once, at the end, not at the delta and again at the sum. ``delta``: :func:`lora_delta`."""
    return (weight.float() + delta.float()).to(weight.dtype)


def merge_in_float32(layer: nn.Module, adapter: str) -> None:
    """Merge ``adapter`` into peft LoRA ``layer``'s base weights in place, the arithmetic in float32:
    the layer (base and adapters) is cast to float32, merged by peft (every kind of LoRA layer), and its
    base cast back to the dtypes it had, so each merged weight is rounded once."""
    base = layer.get_base_layer()
    dtypes = {name: param.dtype for name, param in base.named_parameters()}
    layer.float()
    layer.merge(adapter_names=[adapter])
    for name, param in base.named_parameters():
        param.data = param.data.to(dtypes[name])


def merge_adapter(peft_model: PeftModel, adapter_name: str = "default") -> PreTrainedModel:
    """Merge LoRA ``adapter_name`` into the base weights and return the plain base model.

    In place: the PeftModel is consumed (every adapter is unloaded, only ``adapter_name`` is
    merged). Each layer merges in float32 and is cast back to its dtype (:func:`merge_in_float32`),
    so a bfloat16 base is rounded once per weight, whatever the adapter's dtype. Needs a
    full-precision base: merging into NF4 weights would re-quantise them.
    """
    from peft.tuners.tuners_utils import BaseTunerLayer

    if adapter_name not in peft_model.peft_config:
        raise ValueError(f"the model has no adapter {adapter_name!r}; it has {sorted(peft_model.peft_config)}")
    if is_quantized(peft_model):
        raise ValueError(
            "merge_adapter: the base is quantised (4-bit); load it in full precision "
            "(load_base_model(..., load_in_4bit=False)) and load the adapter on it to merge"
        )
    for layer in [m for m in peft_model.modules() if isinstance(m, BaseTunerLayer) and hasattr(m, "base_layer")]:
        merge_in_float32(layer, adapter_name)
    return peft_model.unload()


def save_merged_model(
    model: PreTrainedModel,
    path: str | os.PathLike[str],
    *,
    base_model: str,
    adapter: str,
    tokenizer: Any = None,
) -> None:
    """``save_pretrained`` a merged model (and tokenizer), recording the merge.

    The record ``{"base_model", "adapter"}`` goes into ``textrl_merged.json`` and into
    ``config.textrl_merged`` (so it survives a later ``save_pretrained``); :func:`merge_info`
    reads it, and ``MultiAdapterPPO`` warns that its reference policy is then the merged model.
    """
    record = {"base_model": str(base_model), "adapter": str(adapter)}
    model.config.textrl_merged = record

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        (tmp / MERGED_META).write_text(json.dumps(record, indent=2) + "\n")

    write_atomically(Path(path), write)


def merge_info(model: nn.Module | str | os.PathLike[str]) -> dict[str, Any] | None:
    """What shows that a model is a LoRA merge (or carries an adapter), else None.

    Looks at ``config.textrl_merged`` and, in the model's folder (``config._name_or_path`` or the
    given path), at ``textrl_merged.json`` and at a leftover ``adapter_config.json`` (peft files
    next to full weights: something was trained on top of this model).
    """
    if is_peft(model):
        model = model.get_base_model()
    record = None
    folder = model if isinstance(model, (str, os.PathLike)) else None
    if isinstance(model, nn.Module):
        config = getattr(model, "config", None)
        record = getattr(config, "textrl_merged", None)
        folder = getattr(config, "_name_or_path", None) or None
    if record:
        return dict(record)
    if folder and Path(folder).is_dir():
        folder = Path(folder)
        if (folder / MERGED_META).is_file():
            return json.loads((folder / MERGED_META).read_text())
        if (folder / ADAPTER_CONFIG).is_file():
            return {"adapter": str(folder / ADAPTER_CONFIG), "base_model": str(folder)}
    return None


def warn_if_merged(model: nn.Module, merged: bool | None = None) -> dict[str, Any] | None:
    """Warn that "adapters disabled" is the merged model; ``merged`` overrides the detection."""
    info = merge_info(model) if merged is None else ({"adapter": "?", "base_model": "?"} if merged else None)
    if info:
        warnings.warn(
            f"the base model is already merged with a LoRA (adapter {info.get('adapter')!r} into "
            f"{info.get('base_model')!r}): with adapters disabled, the reference policy is this "
            "merged model, not the original base, and the reward adapter must have been trained on "
            "this same merged model. If you meant the reference to be the model before the merge, "
            "pass that one as the base (and its adapter as the policy start); pass merged=False to "
            "silence this warning",
            UserWarning,
            stacklevel=3,
        )
    return info


__all__ = [
    "is_adapter_dir",
    "AUTO_TARGETS",
    "LEGACY_LLAMA_TARGETS",
    "REWARD_FORMAT",
    "auto_target_modules",
    "linear_module_names",
    "target_modules_for",
    "final_hidden",
    "hidden_size",
    "is_peft",
    "is_quantized",
    "keep_4bit_differentiable",
    "last_token_hidden",
    "load_base_model",
    "load_reward_adapter",
    "lora_config",
    "lora_delta",
    "merge_adapter",
    "merge_in_float32",
    "merge_info",
    "merged_weight",
    "read_reward_meta",
    "save_adapter",
    "save_merged_model",
    "save_reward_adapter",
    "transformer_body",
    "warn_if_merged",
]
