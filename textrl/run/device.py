"""The device a run computes on."""

from __future__ import annotations

import torch


def resolve_device(name: str) -> torch.device:
    """The device of ``--device``: 'auto' is CUDA when available, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r}: CUDA is not available on this machine; use --device cpu")
    return device


__all__ = ["resolve_device"]
