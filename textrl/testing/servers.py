"""A vLLM server started for a test or a benchmark (``textrl vllm-serve`` in a process of its own):
:func:`wait_until_serving`, the one wait for it to answer."""

from __future__ import annotations

import subprocess
import time
import urllib.request
from pathlib import Path


def wait_until_serving(proc: subprocess.Popen, url: str, log: Path, timeout: float = 300.0) -> None:
    """Return once the server at ``url`` answers ``GET /v1/models``; ``RuntimeError`` with the tail of
    its ``log`` when ``proc`` exits first or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the vLLM server exited ({proc.returncode}):\n{Path(log).read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=5):
                return
        except OSError:
            time.sleep(1.0)
    raise RuntimeError(f"the vLLM server at {url} did not start in {timeout:.0f} s:\n{Path(log).read_text()[-3000:]}")


__all__ = ["wait_until_serving"]
