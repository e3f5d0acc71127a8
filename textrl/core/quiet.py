"""The ``textrl`` command's quiet: other libraries' chatter left out of its output unless ``--debug``.

Every command used to print lines that are not about the user's run: DeepSpeed's ``Setting
accelerator to CPU`` (when something imports it on a machine without a GPU), bitsandbytes'
``Failed to load CPU gemm_4bit_forward from kernels-community`` (an optional faster kernel), and
transformers' progress bars and load reports (``Loading weights``, ``Writing model shards``,
weights newly initialised for a value head textrl adds on purpose), and one library's deprecation
warnings about another's API (peft reads transformers' ``is_gradient_checkpointing`` on every LoRA
model), and vLLM's engine log in the training process (some 40 lines a colocated run: its
platform notes, a chat-template warm-up's traceback, the checkpoint progress bar, and ``RotaryEmbedding:
Failed to load weights`` at every weight hand-over, a layer with no weights of its own, restored as it
was). :func:`quiet_libraries` leaves their informational lines and warnings out, and keeps their
errors; textrl's own lines and warnings are never touched. ``--debug`` (or ``TEXTRL_DEBUG=1``) shows everything. The Python API changes
nothing: it is the command line's choice only.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

NOISY_LOGGERS = ("DeepSpeed", "bitsandbytes.backends.cpu.ops", "vllm.triton_utils.importing")
"""Loggers whose records below ERROR the command leaves out (filters stay on a logger whatever
level its library sets later)."""

DEPRECATIONS_FROM = ("transformers", "peft", "accelerate", "deepspeed", "bitsandbytes", "vllm")
"""Packages whose ``FutureWarning`` and ``DeprecationWarning`` raised in their own code (one library
calling another's deprecated API: nothing a user of textrl can change) the command leaves out.
Their other warnings stay, and so does a deprecation a library attributes to textrl's call."""

QUIET_ENVIRONMENT = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error",
                     "VLLM_LOGGING_LEVEL": "ERROR"}
"""Read by huggingface_hub, transformers and vLLM when they are imported: no progress bars (the
colocated vLLM engine reads the first too: :func:`progress_bars`), only errors from transformers' and
vLLM's loggers. A value the user set is kept. A process the command replaces itself with (``textrl
vllm-serve``'s server) gets the user's environment instead: :func:`environment_before_quiet`."""

_SET_BY_QUIET: set[str] = set()
"""Within :func:`quiet_libraries`: the variables it set (the user had not)."""


def _errors_only(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR


@contextmanager
def quiet_libraries(debug: bool = False) -> Iterator[None]:
    """Within the block, leave the other libraries' chatter out of this process's output (module
    docstring); with ``debug``, nothing changes. :func:`textrl.cli.main` runs a command in it; what
    it set (the loggers' filters, the warnings filters, the environment variables, transformers'
    verbosity and progress bars) is as before once the block ends, so a Python caller of ``main``
    keeps its own settings."""
    if debug:
        yield
        return
    with ExitStack() as stack:
        stack.enter_context(warnings.catch_warnings())  # the filters below are undone at the end
        for package in DEPRECATIONS_FROM:
            for category in (FutureWarning, DeprecationWarning):
                warnings.filterwarnings("ignore", category=category, module=rf"{package}(\.|$)")
        stack.enter_context(_quiet_logging())
        yield


@contextmanager
def _quiet_logging() -> Iterator[None]:
    """The loggers, environment variables and transformers settings of :func:`quiet_libraries`."""
    loggers = [logging.getLogger(name) for name in NOISY_LOGGERS]
    added = [logger for logger in loggers if _errors_only not in logger.filters]
    for logger in added:
        logger.addFilter(_errors_only)
    environment = {key: os.environ.get(key) for key in QUIET_ENVIRONMENT}
    for key, value in QUIET_ENVIRONMENT.items():
        os.environ.setdefault(key, value)
    _SET_BY_QUIET.update(key for key, value in environment.items() if value is None)
    transformers_logging = None
    if "transformers" in sys.modules:  # imported already: told directly (else it reads the environment)
        from transformers.utils import logging as transformers_logging

        verbosity, bars = transformers_logging.get_verbosity(), transformers_logging.is_progress_bar_enabled()
        transformers_logging.set_verbosity_error()
        transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        for logger in added:
            logger.removeFilter(_errors_only)
        for key, value in environment.items():
            _SET_BY_QUIET.discard(key)
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if transformers_logging is not None:
            transformers_logging.set_verbosity(verbosity)
            (transformers_logging.enable_progress_bar if bars else transformers_logging.disable_progress_bar)()


def environment_before_quiet() -> dict[str, str]:
    """This process's environment without what :func:`quiet_libraries` added (the user's own values
    kept): for a program the command hands over to, whose log is the user's to read."""
    return {key: value for key, value in os.environ.items() if key not in _SET_BY_QUIET}


def progress_bars() -> bool:
    """Whether a library's progress bars are wanted: not within :func:`quiet_libraries` (nor where the
    user set ``HF_HUB_DISABLE_PROGRESS_BARS``)."""
    return os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS", "").strip().lower() not in ("1", "true", "yes", "on")


__all__ = ["DEPRECATIONS_FROM", "NOISY_LOGGERS", "QUIET_ENVIRONMENT", "environment_before_quiet", "progress_bars",
           "quiet_libraries"]
