"""DeepSpeed ZeRO (stages 1, 2 and 3) for the agents' training loop.

With ``--zero-stage N`` (or ``accelerate launch`` with a DeepSpeed config) the agent's models go
into one DeepSpeed engine (the backend :class:`textrl.parallel.zero.DeepSpeedZero`), the way TRL
wraps policy and value model together. The engine owns one AdamW with a parameter group per trained model
(the actor's and the critic's learning rates) and:

- stage 1 partitions the AdamW states over the processes, stage 2 the gradients as well, stage 3
  the weights too (of every model in the engine: policy, reference, critic, old-policy snapshot);
- ``engine.backward`` reduces gradients (inside the backward from stage 2 on) and
  ``engine.step`` clips the *joint* gradient norm of actor and critic (DeepSpeed's
  ``gradient_clipping``, set from ``max_grad_norm``) and skips the step when a gradient is
  NaN/inf (its overflow check);
- gradient accumulation is textrl's (DeepSpeed's ``managed_gradient_accumulation: false``:
  every micro-batch's backward accumulates, the one ``step`` per minibatch is the boundary).

Under stage 3 generation gathers the policy once per micro-batch (:func:`gathered`), every
process takes part in evaluation, and the reference / old-policy refreshes copy gathered weights.
Checkpoints hold full tensors (:func:`full_model_state`, :func:`full_optimizer_state`), so a run
resumes with any number of processes and any stage. Weights and AdamW states stay float32
(autocast handles bf16 on CUDA, as without DeepSpeed); optimizer or parameter offload is refused.

What textrl reads from a DeepSpeed JSON config (``--deepspeed-config`` or accelerate's
``deepspeed_config_file``): its ``zero_optimization`` section. Batch sizes, optimizer,
scheduler, precision and clipping come from textrl's own options and are ignored there.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from textrl.core.versions import mark_written
from textrl.parallel.fsdp_sharding import _env_flag

STAGES = (1, 2, 3)
OPTIMIZER_STATE_KEYS = ("exp_avg", "exp_avg_sq")
"""AdamW's per-parameter states (its step count is saved separately)."""
INSTALL_HINT = "pip install 'textrl[deepspeed]' (or pip install deepspeed)"


def require_deepspeed() -> Any:
    """The ``deepspeed`` module; ``ImportError`` saying how to install it."""
    try:
        import deepspeed
    except ImportError as err:
        raise ImportError(f"zero_stage > 0 trains under DeepSpeed, which is not installed: {INSTALL_HINT}") from err
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    return deepspeed


# -- configuration -------------------------------------------------------------------------------


def accelerate_wants_deepspeed() -> bool:
    """Whether ``accelerate launch`` was given a DeepSpeed config (it exports ``ACCELERATE_USE_DEEPSPEED``)."""
    return _env_flag("ACCELERATE_USE_DEEPSPEED")


def accelerate_deepspeed_options() -> dict[str, Any]:
    """``zero_stage`` (and ``deepspeed_config``) of an accelerate DeepSpeed config.

    accelerate exports the stage as ``ACCELERATE_DEEPSPEED_ZERO_STAGE`` (its default is 2) and a
    config file as ``ACCELERATE_DEEPSPEED_CONFIG_FILE``; offload devices other than ``none`` are
    refused by name (``ValueError``). Turns accelerate's ``zero3_init`` off (sets
    ``ACCELERATE_DEEPSPEED_ZERO3_INIT=false`` for this process) before accelerate's state exists.
    """
    env = os.environ
    # textrl loads whole models (warm-up, reference copies) and partitions them when the engine
    # starts; accelerate's zero3_init would partition them inside from_pretrained already
    env["ACCELERATE_DEEPSPEED_ZERO3_INIT"] = "false"
    for var, what in (("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "offload_optimizer_device"),
                      ("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "offload_param_device")):
        device = env.get(var, "none").lower()
        if device not in ("", "none"):
            raise ValueError(f"the accelerate DeepSpeed config sets {what}: {device}, which textrl train "
                             "does not support; set it to none")
    options: dict[str, Any] = {}
    file = env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "")
    if file and file.lower() != "none":
        options["deepspeed_config"] = file
    stage = env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")
    if stage is None and file:
        stage = read_zero_section(file).get("stage")
    options["zero_stage"] = _stage(stage if stage is not None else 2, "the accelerate DeepSpeed config")
    return options


def _stage(value: Any, where: str) -> int:
    try:
        stage = int(value)
    except (TypeError, ValueError):
        stage = None
    if stage not in STAGES:
        raise ValueError(f"{where}: ZeRO stage {value!r} is not one of {STAGES}")
    return stage


def read_zero_section(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``zero_optimization`` section of a DeepSpeed JSON config file.

    ``ValueError`` naming the file for a missing or unreadable file, and for offload (which
    textrl does not support).
    """
    path = Path(path)
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError as err:
        raise ValueError(f"deepspeed_config={str(path)!r}: no such file") from err
    except ValueError as err:
        raise ValueError(f"deepspeed_config={str(path)!r} is not valid JSON ({err})") from err
    if not isinstance(config, dict):
        raise ValueError(f"deepspeed_config={str(path)!r}: expected a JSON object")
    section = dict(config.get("zero_optimization") or {})
    for key in ("offload_optimizer", "offload_param"):
        device = str((section.get(key) or {}).get("device", "none")).lower()
        if device != "none":
            raise ValueError(f"{path}: zero_optimization.{key}.device={device!r}; textrl train does not "
                             "support offload: remove it or set it to none")
        section.pop(key, None)
    if "stage" in section:
        section["stage"] = _stage(section["stage"], str(path))
    return section


def auto_bucket_sizes(hidden_size: int) -> dict[str, int]:
    """The ZeRO bucket sizes accelerate and the HF Trainer give ``"auto"`` for a model of width
    ``hidden_size`` (DeepSpeed's own defaults, 5e8 / 5e7 / 1e5 elements, suit billion-weight models)."""
    return {"reduce_bucket_size": hidden_size * hidden_size,
            "stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
            "stage3_param_persistence_threshold": 10 * hidden_size}


def deepspeed_config(stage: int, max_grad_norm: float, zero_section: dict[str, Any] | None = None,
                     hidden_size: int | None = None) -> dict[str, Any]:
    """The DeepSpeed config of an agent's engine: ``stage``, clipping at ``max_grad_norm`` (0 = off),
    textrl's own accumulation, float32; ``zero_section`` adds ZeRO knobs (bucket sizes, ...), and
    bucket sizes it leaves out (or sets to ``"auto"``) follow ``hidden_size`` (:func:`auto_bucket_sizes`)."""
    zero = {k: v for k, v in (zero_section or {}).items() if v != "auto"}
    if hidden_size:
        zero = {**auto_bucket_sizes(hidden_size), **zero}
    zero["stage"] = _stage(stage, "zero_stage")
    return {
        "train_micro_batch_size_per_gpu": 1,  # only for DeepSpeed's throughput log; textrl batches itself
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,  # every step() is the boundary; backward only accumulates
        "gradient_clipping": float(max_grad_norm),
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,  # torch's AdamW, with one parameter group per model
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def initialize(model: nn.Module, optimizer: torch.optim.Optimizer, config: dict[str, Any]) -> Any:
    """A DeepSpeed engine over ``model`` (the process group must exist: torchrun / accelerate)."""
    deepspeed = require_deepspeed()
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        raise ValueError("zero_stage > 0 runs over a process group; launch with `accelerate launch "
                         "--num_processes N -m textrl.cli train ...` or torchrun")
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, dist_init_required=False)
    return engine


def backward(engine: Any, loss: Tensor) -> None:
    """``engine.backward(loss)`` for a forward that called the models directly, not ``engine(...)``.

    ``engine.forward`` first tells the ZeRO optimizer that a new micro-batch begins
    (``clear_backward_seen_flag``); without it stage 3 *overwrites* the gradients of the previous
    backward instead of accumulating them. textrl's forwards go to the agent's models, so the
    call is made here. No scaling by DeepSpeed's accumulation steps: the caller weighs ``loss``.
    """
    optimizer = engine.optimizer
    if hasattr(optimizer, "clear_backward_seen_flag"):
        optimizer.clear_backward_seen_flag()
    engine.backward(loss, scale_wrt_gas=False)


# -- stage 3: partitioned weights ----------------------------------------------------------------


def is_partitioned(param: Tensor) -> bool:
    """Whether ``param`` is a ZeRO-3 parameter (its data lives in per-process partitions)."""
    return hasattr(param, "ds_id")


def _gather(params: Iterable[Tensor], modifier_rank: int | None = None):
    params = [p for p in params if is_partitioned(p)]
    if not params:
        return nullcontext()
    return require_deepspeed().zero.GatheredParameters(params, modifier_rank=modifier_rank)


def gathered(model: nn.Module) -> AbstractContextManager[Any]:
    """``model``'s full weights on every process for the block (generation: one all-gather per
    weight instead of one per layer and token); partitioned again after. A no-op below stage 3."""
    return _gather(model.parameters())


def copy_weights(dst: nn.Module, src: nn.Module) -> None:
    """``dst.load_state_dict(src.state_dict())`` for (possibly partitioned) models of one architecture;
    each tensor of ``dst`` marked written (:func:`mark_held_written`)."""
    source = src.state_dict(keep_vars=True)
    for key, d in dst.state_dict(keep_vars=True).items():
        s = source[key]
        with _gather([d, s], modifier_rank=0), torch.no_grad():
            d.data.copy_(s.data)
        mark_held_written(d)


def mark_held_written(tensor: Tensor) -> None:
    """Mark ``tensor`` written through ``.data`` (:func:`textrl.core.versions.mark_written`): the tensor
    and, partitioned, this process's partition of it (what the learner's version reads)."""
    mark_written([tensor, tensor.ds_tensor] if is_partitioned(tensor) else [tensor])


def trained_weights(model: nn.Module, keep: bool) -> dict[str, Tensor]:
    """``model``'s trained weights whole, copied to the CPU where ``keep`` (``{}`` elsewhere); a
    collective under stage 3 (every process calls), gathered one tensor at a time."""
    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            with _gather([p]):
                if keep:
                    out[name] = p.detach().to("cpu", copy=True)
    return out


def full_model_state(model: nn.Module, keep: bool) -> dict[str, Tensor]:
    """Every full tensor of ``model`` on the CPU where ``keep`` (the main process), ``{}`` elsewhere.

    A collective under stage 3 (every process calls); gathered one tensor at a time.
    """
    state = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        with _gather([tensor]):
            if keep:
                state[key] = tensor.detach().to("cpu", copy=True)
    return state


def _set_full_fp32(param: nn.Parameter, value: Tensor, optim_state_key: str | None = None) -> None:
    """Write a full float32 ``value`` into this process's part of ``param``'s master weight (or of
    its AdamW state ``optim_state_key``).

    Stages 1, 2: DeepSpeed's ``safe_set_full_*``. Stage 3: its setter cannot write a parameter
    whose last partition is padding (fewer elements than processes x partition), so the value is
    padded here and this process's slice copied.
    """
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    value = value.to(param.device, torch.float32)
    if not is_partitioned(param):
        if optim_state_key is None:
            safe_set_full_fp32_param(param, value)
        else:
            safe_set_full_optimizer_state(param, value, optim_state_key)
        return
    z3 = param._z3_optimizer
    part, _ = z3._get_fp32_opt_state_partition(param, release_swap_buffers=False, optim_state_key=optim_state_key)
    world, rank = z3._get_param_partition_world_size(param), z3._get_param_partition_rank(param)
    padded = value.new_zeros(part.numel() * world)
    padded[: value.numel()] = value.flatten()
    part.data.copy_(padded.narrow(0, part.numel() * rank, part.numel()))


def load_full_model_state(model: nn.Module, state: dict[str, Tensor]) -> None:
    """Copy full tensors into ``model``'s weights (each marked written: :func:`mark_held_written`) and
    into DeepSpeed's float32 master copies of the trained ones (every process passes the same
    ``state``; a collective under stage 3)."""
    own = model.state_dict(keep_vars=True)
    missing, unexpected = own.keys() - state.keys(), state.keys() - own.keys()
    if missing or unexpected:
        raise KeyError(f"the saved state does not match {type(model).__name__}: missing {sorted(missing)[:5]}, "
                       f"unexpected {sorted(unexpected)[:5]}")
    with torch.no_grad():
        for key, tensor in own.items():
            value = state[key]
            with _gather([tensor], modifier_rank=0):
                tensor.data.copy_(value)
            mark_held_written(tensor)
            if isinstance(tensor, nn.Parameter) and tensor.requires_grad:
                _set_full_fp32(tensor, value)


def _adamw(engine: Any) -> torch.optim.Optimizer:
    """The torch AdamW inside ``engine``'s ZeRO optimizer (its state is keyed by flat partitions)."""
    return engine.optimizer.optimizer


def flat_partitions(engine: Any) -> list[Tensor]:
    """This process's float32 master partitions, one per parameter group: what AdamW steps and the
    keys of its state (stage 3 leaves AdamW's parameter groups empty between steps)."""
    zero = engine.optimizer
    flats = getattr(zero, "fp32_partitioned_groups_flat", None)  # stage 3
    return list(flats if flats is not None else zero.single_partition_of_fp32_groups)  # stages 1, 2


def _link_optimizer_states(engine: Any) -> None:
    """Stages 1, 2: point every weight's views of the AdamW state at the current state tensors.

    DeepSpeed links them once, right after the first group's first step, when the second group
    (the critic's) has no state yet; ``safe_get/set_full_optimizer_state`` then miss it. Linking
    again (after any step, and after a restore created the state) covers every group.
    """
    optimizer = engine.optimizer
    if hasattr(optimizer, "_lazy_init_hp_params_optimizer_state"):
        optimizer._hp_optimizer_states_linked = False
        optimizer._lazy_init_hp_params_optimizer_state()


def full_optimizer_state(named_params: list[tuple[str, nn.Parameter]], engine: Any, keep: bool) -> dict[str, Any]:
    """The engine's AdamW state as full CPU tensors keyed by parameter name, plus its step count
    (on the main process where ``keep``; a collective: every process calls)."""
    from deepspeed.utils import safe_get_full_optimizer_state

    steps = sorted({float(s["step"]) for s in _adamw(engine).state.values() if "step" in s})
    state: dict[str, dict[str, Tensor]] = {}
    if steps:  # before the first step AdamW has no state
        _link_optimizer_states(engine)
        for name, param in named_params:
            entry = {key: safe_get_full_optimizer_state(param, key) for key in OPTIMIZER_STATE_KEYS}
            if keep:
                state[name] = {key: value.detach().to("cpu", copy=True) for key, value in entry.items()}
    return {"format": "deepspeed_zero_full", "step": steps[0] if steps else 0.0, "state": state}


def load_full_optimizer_state(named_params: list[tuple[str, nn.Parameter]], engine: Any,
                              saved: dict[str, Any]) -> None:
    """Restore :func:`full_optimizer_state`'s output into the engine's (partitioned) AdamW."""
    if not isinstance(saved, dict) or saved.get("format") != "deepspeed_zero_full":
        raise ValueError("the checkpoint's optimizer state was not written under DeepSpeed (zero_stage > 0); "
                         "resume it with the same kind of run (DeepSpeed, FSDP or plain), or start over")
    if not saved["state"]:
        return
    names = {name for name, _ in named_params}
    if names != saved["state"].keys():
        raise KeyError(f"the checkpoint's optimizer state names other parameters (missing "
                       f"{sorted(names - saved['state'].keys())[:5]}); it belongs to another model")
    adamw = _adamw(engine)
    for flat in flat_partitions(engine):  # AdamW creates its state at its first step: create it here
        state = adamw.state.setdefault(flat, {})
        for key in OPTIMIZER_STATE_KEYS:
            state.setdefault(key, torch.zeros_like(flat))
        state["step"] = torch.tensor(float(saved["step"]))
    _link_optimizer_states(engine)
    for name, param in named_params:
        for key in OPTIMIZER_STATE_KEYS:
            _set_full_fp32(param, saved["state"][name][key], key)


__all__ = [
    "INSTALL_HINT",
    "STAGES",
    "accelerate_deepspeed_options",
    "accelerate_wants_deepspeed",
    "backward",
    "copy_weights",
    "deepspeed_config",
    "flat_partitions",
    "full_model_state",
    "full_optimizer_state",
    "gathered",
    "initialize",
    "is_partitioned",
    "load_full_model_state",
    "load_full_optimizer_state",
    "mark_held_written",
    "read_zero_section",
    "require_deepspeed",
]
