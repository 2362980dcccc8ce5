"""The run's record: ``metrics.jsonl`` (one object per step) and its plot.

On resume the log is cut back to the checkpoint's step (lines written after
it belong to steps that are about to run again), so a resumed run's log reads
exactly like an uninterrupted one's.
"""
from __future__ import annotations

import json
import os
from pathlib import Path


class MetricsLog:
    def __init__(self, path: Path, resume_from_step: int = 0) -> None:
        self.path = path
        kept = []
        if resume_from_step and path.exists():
            for line in path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    break  # a line torn by a kill: everything after it is stale too
                if rec.get("step", 0) <= resume_from_step:
                    kept.append(line)
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, path)
        self._file = path.open("a", buffering=1)

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record, sort_keys=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_metrics(metrics_path: Path, png_path: Path, title: str = "",
                 initial_val_loss: float | None = None) -> None:
    """Loss (train and validation, from step 0) and throughput against step, as one PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = read_metrics(metrics_path)
    steps = [r["step"] for r in recs]
    fig, (ax_loss, ax_tps) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    ax_loss.plot(steps, [r["loss"] for r in recs], lw=1, label="train")
    val = [(0, initial_val_loss)] if initial_val_loss is not None else []
    val += [(r["step"], r["val_loss"]) for r in recs if r.get("val_loss") is not None]
    if val:
        ax_loss.plot(*zip(*val), "o-", label="validation")
    ax_loss.set_ylabel("loss (nats/token)")
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    ax_tps.plot(steps, [r["tokens_per_s"] for r in recs], lw=1, color="tab:green")
    ax_tps.set_ylabel("tokens/s")
    ax_tps.set_xlabel("step")
    ax_tps.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    tmp = png_path.with_name(png_path.name + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, png_path)
