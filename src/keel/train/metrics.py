"""What a run reports: metrics.jsonl, TensorBoard, a progress bar, loss.png, a summary."""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

import psutil
import torch

METRICS_FILE = "metrics.jsonl"


def peak_rss_mb() -> float:
    """Peak resident memory of this process (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def memory_now() -> dict[str, float]:
    info = {"rss_mb": round(psutil.Process().memory_info().rss / 2**20, 1)}
    if torch.cuda.is_available():
        info["cuda_alloc_mb"] = round(torch.cuda.memory_allocated() / 2**20, 1)
        info["cuda_peak_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return info


class MetricsLog:
    """Appends one JSON object per logged step; on resume, drops entries past the resume step
    so the file reads as one uninterrupted run."""

    def __init__(self, output_dir: Path, *, resume_step: int, tensorboard: bool):
        self.path = output_dir / METRICS_FILE
        self._truncate_after(resume_step)
        self._handle = open(self.path, "a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(output_dir / "tensorboard"),
                                     purge_step=resume_step + 1)

    def _truncate_after(self, step: int) -> None:
        if not self.path.exists():
            return
        kept = [line for line in self.path.read_text(encoding="utf-8").splitlines()
                if line.strip() and json.loads(line).get("step", 0) <= step]
        self.path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")

    def write(self, record: dict) -> None:
        self._handle.write(json.dumps(record) + "\n")
        self._handle.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, int | float):
                    self._tb.add_scalar(f"train/{key}" if not key.startswith("eval")
                                        else f"eval/{key}", value, record["step"])

    def close(self) -> None:
        self._handle.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()
            if line.strip()]


def plot_losses(metrics_path: Path, out_png: Path) -> bool:
    """Draw train (and eval) loss against step; False when there is nothing to plot."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    records = read_metrics(metrics_path) if metrics_path.exists() else []
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    if not train:
        return False
    fig = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(fig)  # attaches a non-interactive canvas; no global pyplot state
    ax = fig.add_subplot()
    ax.plot(*zip(*train), label="train loss", linewidth=1.2)
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_png)
    return True


class Progress:
    """A tqdm bar on stderr with loss, lr and tokens/s; tqdm supplies the ETA."""

    def __init__(self, total: int, initial: int, enabled: bool = True):
        from tqdm.auto import tqdm

        self.enabled = enabled
        self._bar = tqdm(total=total, initial=initial, desc="train", unit="step",
                         file=sys.stderr, disable=not enabled, dynamic_ncols=True)

    def update(self, loss: float, lr: float, tokens_per_s: float) -> None:
        self._bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tokens_per_s:.0f}",
                              refresh=False)
        self._bar.update(1)

    def write(self, text: str) -> None:
        if self.enabled:
            self._bar.write(text, file=sys.stderr)

    def close(self) -> None:
        self._bar.close()
