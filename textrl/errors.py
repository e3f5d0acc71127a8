"""How the ``textrl`` command reports a user's error: one line naming the culprit and the fix.

textrl's own checks raise ``ValueError`` (a bad option, file, row, model, a refused resume, a
busy run folder), :class:`~textrl.run.CheckpointError` (a corrupt checkpoint) or ``OSError`` (a
file that cannot be read or written, a full disk) with a message that already says what to do.
The command prints that message after ``textrl COMMAND:``, no traceback. An error raised
outside textrl (a library, a user's reward or agent file) gets its type too, and a second line
saying how to see the traceback: ``--debug`` on any subcommand, or ``TEXTRL_DEBUG=1``, lets
every error propagate with its traceback.
"""

from __future__ import annotations

import os
from pathlib import Path

DEBUG_VARIABLE = "TEXTRL_DEBUG"
"""Environment variable: set to 1 for the traceback of every error (as ``--debug``)."""

TRACEBACK_HINT = f"(for the traceback, rerun with --debug or {DEBUG_VARIABLE}=1)"


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


def user_error_message(command: str, err: BaseException) -> str:
    """``textrl COMMAND: message``; an error from outside textrl adds its type and
    :data:`TRACEBACK_HINT` on a second line."""
    text = str(err).strip() or type(err).__name__
    if raised_by_textrl(err):
        return f"textrl {command}: {text}"
    return f"textrl {command}: {type(err).__name__}: {text}\n{TRACEBACK_HINT}"


__all__ = ["DEBUG_VARIABLE", "TRACEBACK_HINT", "debug_requested", "raised_by_textrl", "user_error_message",
           "user_errors"]
