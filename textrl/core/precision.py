"""The run's numerical precision, decided once: the weights' dtype, the autocast of every forward,
the attention implementation and the attention kernels a forward with gradients may use.

:meth:`Precision.of` reads three fields that :class:`textrl.config.TrainConfig` and the stages'
``StageConfig`` share, ``dtype``, ``mixed_precision`` and ``attn_implementation``, for the
run's device; the agent, the stages, the warm-up and the neural rewards enter
:meth:`Precision.autocast` around their forwards and load their models with
:meth:`Precision.model_kwargs` / :meth:`Precision.prepare`. Nothing else in textrl names a
dtype for a model or opens an autocast.

Attention kernels (docs/design.md, "Precision and padding"): a forward with gradients on CUDA runs
scaled dot-product attention on the flash, memory-efficient and math kernels, never cuDNN's:
since PyTorch 2.11 cuDNN's attention backward returns NaN query gradients when a mask is passed,
the sequence length is 64 modulo 128 and a query row's log-sum-exp is very negative (a fully masked
row, or a head whose every logit is large and negative). textrl's forwards also never hand a
fully masked row to a kernel (:mod:`textrl.models.forward`).
"""

from __future__ import annotations

import contextlib
import copy
import functools
from dataclasses import dataclass
from typing import Any

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""``--dtype`` values and the weights' dtype each stands for."""
MIXED_PRECISION = ("auto", "bf16", "no")
"""``--mixed-precision`` values: autocast to bfloat16, none, or bf16 on a CUDA device that has it."""
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2")
"""``--attn-implementation`` values (transformers' names); None leaves the model's default."""


def training_sdpa_backends() -> list[Any]:
    """The scaled dot-product attention kernels a CUDA forward with gradients may use: flash,
    memory-efficient and math (cuDNN's backward is off; see the module docstring)."""
    from torch.nn.attention import SDPBackend

    return [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def check_precision(config: Any) -> None:
    """``ValueError`` naming the field when ``config``'s ``dtype``, ``mixed_precision`` or
    ``attn_implementation`` is not one textrl runs (before any model loads)."""
    if config.dtype not in DTYPES:
        hint = (" (float16 weights need loss scaling, which textrl does not do: use bfloat16)"
                if str(config.dtype) in ("float16", "fp16", "half") else "")
        raise ValueError(f"dtype={config.dtype!r}: must be one of {', '.join(DTYPES)}{hint}")
    if config.mixed_precision not in MIXED_PRECISION:
        hint = " (fp16 autocast needs loss scaling: use bf16)" if config.mixed_precision == "fp16" else ""
        raise ValueError(f"mixed_precision={config.mixed_precision!r}: must be one of "
                         f"{', '.join(MIXED_PRECISION)}{hint}")
    impl = config.attn_implementation
    if impl is None:
        return
    if impl not in ATTN_IMPLEMENTATIONS:
        raise ValueError(f"attn_implementation={impl!r}: must be one of {', '.join(ATTN_IMPLEMENTATIONS)} "
                         "(or unset: the model's default)")
    if impl == "flash_attention_2":
        from transformers.utils import is_flash_attn_2_available

        if not is_flash_attn_2_available():
            raise ValueError("attn_implementation='flash_attention_2' needs the flash-attn package and a CUDA "
                             "device: `pip install flash-attn --no-build-isolation`, or use --attn-implementation sdpa")


@dataclass(frozen=True)
class Precision:
    """How one run computes: ``dtype`` of the weights, ``autocast_dtype`` of the forwards (None:
    no autocast), ``attn_implementation`` (None: the model's default) on ``device``."""

    device: torch.device
    dtype: torch.dtype = torch.float32
    autocast_dtype: torch.dtype | None = None
    attn_implementation: str | None = None
    frozen_dtype: torch.dtype | None = None
    """The frozen models' weights (reference, reward models; :meth:`prepare_frozen`); None: :attr:`dtype`."""

    @classmethod
    def of(cls, config: Any, device: torch.device | str) -> Precision:
        """The precision of ``config`` (its ``dtype``, ``mixed_precision``, ``attn_implementation``,
        ``frozen_dtype``; a config without them gets the defaults) on ``device``.
        ``mixed_precision='auto'`` is bf16 on a CUDA device that supports it, else none;
        ``flash_attention_2`` needs CUDA.

        The same object for the same fields on the same device (and the same answer of
        ``torch.cuda.is_bf16_supported`` there): a :class:`Precision` is frozen, so the callers
        that decide it share one (a refused precision is not kept; fields that cannot be hashed
        are decided afresh each call)."""
        device = torch.device(device)
        fields = (getattr(config, "dtype", "float32"), getattr(config, "mixed_precision", "auto"),
                  getattr(config, "attn_implementation", None), getattr(config, "frozen_dtype", "auto"))
        key = (cls, *fields, device, device.type == "cuda" and torch.cuda.is_bf16_supported())
        return _decided(*key) if _hashable(key) else cls._decide(*fields, device)

    @classmethod
    def _decide(cls, dtype_name: Any, mixed: Any, impl: Any, frozen: Any, device: torch.device) -> Precision:
        """:meth:`of`'s decision from the config's four fields, uncached."""
        if mixed == "auto":
            mixed = "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "no"
        wants_bf16 = mixed == "bf16" or dtype_name == "bfloat16"
        if wants_bf16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ValueError(f"{torch.cuda.get_device_name(device)} has no bfloat16: use --mixed-precision no and "
                             "--dtype float32 on it")
        if impl == "flash_attention_2" and device.type != "cuda":
            raise ValueError(f"attn_implementation='flash_attention_2' runs on CUDA only, and this run's device "
                             f"is {device}; use --attn-implementation sdpa (or eager)")
        autocast = torch.bfloat16 if mixed == "bf16" else None
        if frozen == "auto":
            frozen = "bfloat16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else dtype_name
        elif frozen == "bfloat16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ValueError(f"frozen_dtype='bfloat16': {torch.cuda.get_device_name(device)} has no bfloat16; "
                             "use --frozen-dtype float32 (or auto) on it")
        return cls(device=device, dtype=DTYPES[dtype_name], autocast_dtype=autocast, attn_implementation=impl,
                   frozen_dtype=DTYPES[frozen])

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the matrix products run in: the autocast's, else the weights'."""
        return self.autocast_dtype or self.dtype

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The context of every forward: autocast to :attr:`autocast_dtype` (explicitly off without
        one, so an outer autocast does not leak in) and, for a forward with gradients on CUDA,
        :func:`training_sdpa_backends` (the backward runs on the kernel the forward chose)."""
        stack = contextlib.ExitStack()
        kind = self.device.type if self.device.type in ("cuda", "cpu") else "cpu"
        if self.autocast_dtype is not None:
            stack.enter_context(torch.autocast(kind, dtype=self.autocast_dtype))
        else:
            stack.enter_context(torch.autocast(kind, enabled=False))
        if self.device.type == "cuda" and torch.is_grad_enabled():
            from torch.nn.attention import sdpa_kernel

            stack.enter_context(sdpa_kernel(training_sdpa_backends()))
        return stack

    def model_kwargs(self) -> dict[str, Any]:
        """``from_pretrained`` keyword arguments: the weights' dtype and the attention implementation."""
        kwargs: dict[str, Any] = {"dtype": self.dtype}
        if self.attn_implementation is not None:
            kwargs["attn_implementation"] = self.attn_implementation
        return kwargs

    def prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` (loaded or given as an object) on :attr:`device`, its floating-point weights
        in :attr:`dtype`, with :attr:`attn_implementation` when one is set."""
        return self._placed(model, self.dtype)

    @property
    def frozen(self) -> torch.dtype:
        """The frozen models' weights' dtype: :attr:`frozen_dtype`, else :attr:`dtype`."""
        return self.frozen_dtype or self.dtype

    def prepare_frozen(self, model: torch.nn.Module) -> torch.nn.Module:
        """A frozen model (a reference, a reward model) on :attr:`device`, its floating-point weights
        in :attr:`frozen` (bfloat16 on CUDA by default: half the memory of float32, the forwards
        already run in bf16 there), with :attr:`attn_implementation` when one is set."""
        return self._placed(model, self.frozen)

    def _placed(self, model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
        model = model.to(device=self.device, dtype=dtype)
        if self.attn_implementation is not None:
            set_attn_implementation(model, self.attn_implementation)
        return model

    def frozen_copy(self, model: torch.nn.Module) -> torch.nn.Module:
        """A frozen copy of ``model`` (the reference of a policy) in :attr:`frozen`
        (:func:`frozen_copy`)."""
        return frozen_copy(model, self.frozen)

    def __str__(self) -> str:
        autocast = str(self.autocast_dtype).removeprefix("torch.") if self.autocast_dtype else "no"
        attention = self.attn_implementation or "the model's default"
        frozen = "" if self.frozen == self.dtype else f", frozen models {str(self.frozen).removeprefix('torch.')}"
        return (f"weights {str(self.dtype).removeprefix('torch.')}{frozen}, autocast {autocast}, "
                f"attention {attention} on {self.device}")

    def record(self) -> dict[str, str]:
        """What ran, for ``summary.json``: the dtype names, the attention implementation."""
        return {"dtype": str(self.dtype).removeprefix("torch."),
                "autocast": str(self.autocast_dtype).removeprefix("torch.") if self.autocast_dtype else "no",
                "attn_implementation": self.attn_implementation or "default", "device": str(self.device),
                "frozen_dtype": str(self.frozen).removeprefix("torch.")}


@functools.lru_cache(maxsize=64)
def _decided(cls: type[Precision], dtype_name: Any, mixed: Any, impl: Any, frozen: Any, device: torch.device,
             has_bf16: bool) -> Precision:
    """:meth:`Precision.of`'s cache: one :class:`Precision` per key (``has_bf16`` is part of the
    key only, so a device whose bfloat16 support reads differently is decided again)."""
    return cls._decide(dtype_name, mixed, impl, frozen, device)


def _hashable(value: Any) -> bool:
    """Whether ``value`` can key a cache (a config field may hold anything before its check)."""
    try:
        hash(value)
    except TypeError:
        return False
    return True


def frozen_copy(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A frozen copy of ``model``: its floating-point weights in ``dtype``, copied straight into it
    (no full-precision copy on the way), tied weights tied, buffers as they are, eval mode, no
    gradients."""
    memo: dict[int, Any] = {}
    for param in model.parameters():
        if id(param) not in memo:
            data = param.detach()
            data = data.to(dtype, copy=True) if data.is_floating_point() else data.clone()
            memo[id(param)] = torch.nn.Parameter(data, requires_grad=False)
    return copy.deepcopy(model, memo).eval().requires_grad_(False)


FROZEN_DTYPES = ("auto", "float32", "bfloat16")
"""``--frozen-dtype`` values."""


def check_memory_options(config: Any) -> None:
    """``ValueError`` naming the fields when ``frozen_dtype``, ``optim``, ``logprob_chunk_size`` is
    not one textrl runs, or ``dtype`` and ``optim`` cannot train together (before any model loads)."""
    from textrl.core.optim import check_optim

    if config.frozen_dtype not in FROZEN_DTYPES:
        raise ValueError(f"frozen_dtype={config.frozen_dtype!r}: must be one of {', '.join(FROZEN_DTYPES)}")
    chunk = config.logprob_chunk_size
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0):
        raise ValueError(f"logprob_chunk_size={chunk!r}: must be a whole number of positions >= 0 "
                         "(0: off) or unset (auto)")
    check_optim(config.optim, config.dtype, trains_full_weights=False)  # the agent checks the pair (LoRA or not)


def set_attn_implementation(model: torch.nn.Module, impl: str) -> None:
    """Switch a loaded transformers model to attention implementation ``impl``: its
    ``set_attn_implementation`` (transformers >= 4.56), else its config's ``_attn_implementation``."""
    setter = getattr(model, "set_attn_implementation", None)
    if callable(setter):
        setter(impl)
        return
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"attn_implementation={impl!r}: {type(model).__name__} is not a transformers model, "
                         "so its attention cannot be switched; leave --attn-implementation unset")
    config._attn_implementation = impl


__all__ = ["ATTN_IMPLEMENTATIONS", "DTYPES", "FROZEN_DTYPES", "MIXED_PRECISION", "Precision", "check_memory_options",
           "check_precision",
           "frozen_copy", "set_attn_implementation", "training_sdpa_backends"]
