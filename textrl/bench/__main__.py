"""``python -m textrl.bench``: ``textrl bench`` (its workers run as ``python -m textrl.bench --worker JOB.json``)."""

from __future__ import annotations

import os

from textrl.bench.compare import main

if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
