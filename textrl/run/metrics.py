"""What a run writes as it goes: ``metrics.jsonl``, TensorBoard events, ``curves.png`` and
``samples.jsonl``; on resume each keeps only what was written up to the resumed iteration."""

from __future__ import annotations

import json
from pathlib import Path


class MetricsLog:
    """``metrics.jsonl`` (one flushed line per iteration), TensorBoard, and the curve plot.

    A fresh run (``resume_after`` None) starts ``metrics.jsonl`` anew; a resumed one keeps the
    rows up to ``resume_after`` (in ``rows`` too). Only an ``enabled`` log writes files.
    """

    def __init__(self, output_dir: Path, enabled: bool, resume_after: int | None) -> None:
        self.path = output_dir / "metrics.jsonl"
        self.enabled = enabled
        self.rows: list[dict[str, float]] = []
        self.writer = None
        if not enabled:
            return
        if resume_after is not None and self.path.exists():
            kept = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
            self.rows = [r for r in kept if r["iteration"] <= resume_after]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in self.rows))
        elif self.path.exists():
            self.path.unlink()
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(output_dir / "tb"))

    def write(self, row: dict[str, float]) -> None:
        """Append one iteration's row (kept in ``rows`` on every process, written on the main one)."""
        self.rows.append(row)
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
        for key, value in row.items():
            if key != "iteration" and isinstance(value, (int, float)):
                self.writer.add_scalar(key, value, row["iteration"])

    def plot(self, path: Path) -> None:
        """``curves.png``: rollout and held-out reward, and KL at collection, per iteration."""
        if not self.enabled or not self.rows:
            return
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        its = [r["iteration"] for r in self.rows]
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
        ax1.plot(its, [r.get("reward/mean", float("nan")) for r in self.rows], label="rollout reward")
        evals = [r for r in self.rows if "eval/sampled/reward/mean" in r]
        if evals:
            ax1.plot([r["iteration"] for r in evals], [r["eval/sampled/reward/mean"] for r in evals],
                     "o-", label="held-out (sampled)")
        ax1.set_xlabel("iteration")
        ax1.set_ylabel("reward")
        ax1.legend()
        ax2.plot(its, [r.get("kl/collection", float("nan")) for r in self.rows])
        ax2.set_xlabel("iteration")
        ax2.set_ylabel("KL(policy || ref) at collection")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)

    def close(self) -> None:
        """Flush and close the TensorBoard writer."""
        if self.writer is not None:
            self.writer.close()


class SamplesLog:
    """``samples.jsonl``: held-out completions at each evaluation, one JSON object per line
    (``{"iteration", "prompt", "completion"}``).

    A fresh run (``resume_after`` None) starts the file anew; a resumed one keeps the lines up to
    ``resume_after``. Nothing is written when ``enabled`` is false (processes other than the main).
    """

    def __init__(self, output_dir: Path, enabled: bool, resume_after: int | None) -> None:
        self.path = output_dir / "samples.jsonl"
        self.enabled = enabled
        if not enabled:
            return
        if resume_after is None:
            self.path.unlink(missing_ok=True)
        elif self.path.exists():
            kept = [s for s in self.path.read_text().splitlines() if json.loads(s)["iteration"] <= resume_after]
            self.path.write_text("".join(s + "\n" for s in kept))

    def write(self, iteration: int, samples: list[dict[str, str]]) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            for sample in samples:
                f.write(json.dumps({"iteration": iteration, **sample}) + "\n")


__all__ = ["MetricsLog", "SamplesLog"]
