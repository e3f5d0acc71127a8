"""``python -m textrl``: the ``textrl`` command (:func:`textrl.cli.entry`)."""

from textrl.cli import entry

if __name__ == "__main__":
    entry()
