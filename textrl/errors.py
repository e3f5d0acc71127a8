"""How the ``textrl`` command reports a user's error: one line naming the culprit and the fix.

textrl's own checks raise ``ValueError`` (a bad option, file, row, model, a refused resume, a
busy run folder), :class:`~textrl.run.CheckpointError` (a corrupt checkpoint) or ``OSError`` (a
file that cannot be read or written, a full disk) with a message that already says what to do.
The command prints that message after ``textrl COMMAND:``, no traceback. Any other error
(a library's, a user's reward or agent file's, a bug's: every ``Exception``) gets its type too,
its message cut to its first line, and a second line saying how to see the traceback: ``--debug``
on any subcommand, or ``TEXTRL_DEBUG=1``, lets every error propagate with its traceback. A few
are named with their lever (:func:`remedy`): out of memory, a full disk, a model cache that is
corrupt. Under torchrun / ``accelerate launch`` a refusal of ``textrl train``'s checks, which every
process makes alike before any model loads, is said once a machine (:func:`alike_in_every_process`).
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

DEBUG_VARIABLE = "TEXTRL_DEBUG"
"""Environment variable: set to 1 for the traceback of every error (as ``--debug``)."""

TRACEBACK_HINT = f"(for the traceback, rerun with --debug or {DEBUG_VARIABLE}=1)"


def __getattr__(name: str):
    """``textrl.errors.EngineFailed``: :class:`textrl.generation.base.EngineFailed`, imported when
    named (the generation seam imports the registry, which reports errors through this module)."""
    if name == "EngineFailed":
        from textrl.generation.base import EngineFailed

        return EngineFailed
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def user_errors() -> tuple[type[BaseException], ...]:
    """The exceptions a command reports as one line: textrl's checks and the file system's."""
    from textrl.run import CheckpointError

    return (ValueError, OSError, CheckpointError)


def debug_requested(flag: bool = False) -> bool:
    """``--debug`` was given, or :data:`DEBUG_VARIABLE` is set to something other than 0 / empty."""
    return flag or os.environ.get(DEBUG_VARIABLE, "").strip().lower() not in ("", "0", "false", "no")


def _our_folders() -> tuple[str, ...]:
    """The folders of textrl's packages (``textrl``, and ``textrl.envs`` / ``agents`` / ``rewards``,
    which live in their own top-level folders of the repository)."""
    import importlib.util

    specs = (importlib.util.find_spec(name) for name in ("textrl", "textrl.agents", "textrl.envs", "textrl.rewards"))
    return tuple(str(Path(folder).resolve()) + os.sep
                 for spec in specs if spec is not None for folder in spec.submodule_search_locations or ())


def raised_by_textrl(err: BaseException) -> bool:
    """The innermost frame of ``err``'s traceback is in textrl's own code (its message is ours)."""
    tb = err.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    filename = str(Path(tb.tb_frame.f_code.co_filename).resolve())
    return filename.startswith(_our_folders())


MEMORY_LEVERS = {
    "train": "lower --generation-batch-size and --forward-batch-size, raise --num-minibatches or "
             "--gradient-accumulation-steps (smaller micro-batches), or shorten --max-new-tokens",
    "bench": "lower the batch sizes of its runs (--generation-batch-size, --forward-batch-size) or run "
             "fewer jobs at once",
}
"""Per command, what lowers its memory (the stages, the pipeline: ``--batch-size``)."""


def cache_roots() -> list[Path]:
    """Where models are cached: ``$TEXTRL_CACHE`` (textrl's tiny models) and Hugging Face's hub
    cache (``$HF_HUB_CACHE``, ``$HF_HOME/hub``, ``~/.cache/huggingface/hub``)."""
    home = Path("~").expanduser()
    roots = [Path(os.environ.get("TEXTRL_CACHE") or home / ".cache" / "textrl")]
    hf_home = Path(os.environ.get("HF_HOME") or home / ".cache" / "huggingface")
    roots.append(Path(os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE") or hf_home / "hub"))
    return roots


def _in_cache(err: BaseException) -> Path | None:
    """The cache root (:func:`cache_roots`) a path in ``err``'s message or ``filename`` lies under."""
    text = f"{err} {getattr(err, 'filename', '') or ''}"
    for root in cache_roots():
        for form in {str(root), str(root.resolve())}:
            if form and form in text:
                return root
    return None


def remedy(command: str, err: BaseException) -> str:
    """The lever for a few errors whatever raised them ('' for the rest): out of memory (the
    command's batch sizes), a full disk (free space, then ``--resume``), a model cache with a
    broken file (delete that model's folder to rebuild or download it again)."""
    name = type(err).__name__
    if isinstance(err, MemoryError) or name == "OutOfMemoryError":
        levers = MEMORY_LEVERS.get(command, "lower --batch-size (and --max-length)")
        return f"out of memory: {levers}"
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        where = f" holding {err.filename}" if err.filename else ""
        cache = _in_cache(err)
        moved = (f"; or point {'TEXTRL_CACHE' if cache == cache_roots()[0] else 'HF_HOME'} at a disk with room"
                 if cache is not None else "")
        return f"the disk{where} is full: free space there{moved}, then run again (a run: add --resume)"
    cache = _in_cache(err)
    if cache is None and (name in ("SafetensorError", "UnpicklingError") or "deserializing header" in str(err)):
        roots = " or ".join(str(root) for root in cache_roots())
        return ("a model's weights file is damaged or cut short (an interrupted download or build, a full disk): "
                f"if the model is in a cache ({roots}), delete its folder there and run again to rebuild or "
                "download it")
    if cache is not None:
        return (f"a file in the model cache {cache} is damaged or cut short (an interrupted download or "
                f"build, a full disk): delete that model's folder under {cache} and run again to rebuild "
                "or download it")
    return ""


ALIKE_ERROR_WAIT_S = 30.0
"""How long a process of a launch other than the first holds an error every process meets alike
(:func:`alike_in_every_process`) before it says it after all."""


def reports_alike_errors(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process says at once an error every process of its launch meets alike: yes in a
    single process (``WORLD_SIZE`` unset or 1), and in the first process of each machine of a
    torchrun / ``accelerate launch`` run (``LOCAL_RANK`` 0, or ``RANK`` 0 where ``LOCAL_RANK`` is
    unset). One a machine, not one in all: a file another machine lacks is still said there."""
    environ = os.environ if environ is None else environ
    size = environ.get("WORLD_SIZE", "").strip()
    rank = environ.get("LOCAL_RANK", environ.get("RANK", "0")).strip()
    return not (size.isdigit() and int(size) > 1) or rank in ("", "0")


@contextmanager
def alike_in_every_process(debug: bool = False, wait: Callable[[float], Any] = time.sleep) -> Iterator[None]:
    """Around the checks every process of a torchrun / ``accelerate launch`` run makes alike (the
    same command line, settings and files) before the processes join a group, so that their error
    is said once a machine, not by every process: the first process (:func:`reports_alike_errors`)
    raises it at once; another waits :data:`ALIKE_ERROR_WAIT_S` first, in which the launcher ends it
    (SIGTERM) as the first exits on the same error, then raises it too (the first got past the
    checks: the error is this process's alone). Exiting silently instead would race the first: a
    launcher ends the other processes as soon as one fails, the first before it printed, the
    error then said by none. ``--debug`` (:func:`debug_requested`): every process raises at once."""
    try:
        yield
    except Exception:
        if not (debug_requested(debug) or reports_alike_errors()):
            wait(ALIKE_ERROR_WAIT_S)
        raise


def _first_line(text: str, limit: int = 400) -> str:
    """The first non-empty line of ``text``, at most ``limit`` characters."""
    line = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return line if len(line) <= limit else line[:limit - 3] + "..."


def user_error_message(command: str, err: BaseException) -> str:
    """``textrl COMMAND: message`` for textrl's own checks (:func:`user_errors` raised in
    textrl's code: their message names the culprit and the fix); any other error:
    ``textrl COMMAND: TypeName: first line of its message`` (and :func:`remedy`'s lever), with
    :data:`TRACEBACK_HINT` on a second line."""
    whole = str(err).strip()
    if isinstance(err, user_errors()) and raised_by_textrl(err) and whole and not whole.startswith("[Errno") \
            and whole.count("\n") <= 1:
        return f"textrl {command}: {whole}"
    text = _first_line(whole) or type(err).__name__
    lever = remedy(command, err)
    return f"textrl {command}: {type(err).__name__}: {text}{'; ' + lever if lever else ''}\n{TRACEBACK_HINT}"


__all__ = ["ALIKE_ERROR_WAIT_S", "DEBUG_VARIABLE", "MEMORY_LEVERS", "TRACEBACK_HINT", "alike_in_every_process", "cache_roots",
           "debug_requested", "raised_by_textrl", "remedy", "reports_alike_errors", "user_error_message", "user_errors"]
