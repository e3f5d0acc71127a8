"""The progress bar of a run (tqdm), or nothing where it is off or on a non-main process."""

from __future__ import annotations

from typing import Any


class Progress:
    """A tqdm bar from ``initial`` to ``total`` labelled ``desc``; every method is a no-op when
    ``enabled`` is false."""

    def __init__(self, enabled: bool, total: int, initial: int, desc: str) -> None:
        self.bar: Any = None
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True)

    def advance(self, postfix: dict[str, str]) -> None:
        """One more iteration done; ``postfix`` is shown after the bar (``reward=0.512``)."""
        if self.bar is not None:
            self.bar.set_postfix(**postfix)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


__all__ = ["Progress"]
