"""What a run reports: metrics.jsonl, TensorBoard, a progress bar, loss.png, a summary."""

from __future__ import annotations

import json
import math
import resource
import secrets
import string
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from keel.distributed.watchdog import memory_state
from keel.errors import KeelError

if TYPE_CHECKING:
    from keel.config.schema import OutputConfig, WandbConfig
    from keel.train.loop import StepResult

METRICS_FILE = "metrics.jsonl"
WANDB_RUN_ID_FILE = "wandb_run_id"  # in output.dir: the W&B run a resumed run continues


def peak_rss_mb() -> float:
    """Peak resident memory of this process (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@dataclass(kw_only=True)
class RunStats:
    """What this process's training added up, for the run summary (keel_run.json)."""

    real_tokens: int = 0  # non-padding input tokens of every global batch
    target_tokens: int = 0  # of every global batch (pairs or samples for preference stages)
    train_seconds: float = 0.0  # in the steps, without set-up, evaluation or saving
    final_loss: float | None = None  # the last logged step's loss (None: none logged)
    rows: int = 0  # rows this process trained on
    filler_micro_batches: int = 0  # zero-weight micro-batches this process ran
    load_peak_rss_mb: float = 0.0  # the loading high-water mark, before any training
    steps: int = 0  # the run's last step: its length, or where early stopping ended it

    def add_step(self, result: StepResult, seconds: float) -> None:
        """Count one optimizer step that took `seconds`."""
        self.real_tokens += result.real_tokens
        self.target_tokens += result.target_tokens
        self.train_seconds += seconds
        self.rows += result.rows
        self.filler_micro_batches += result.filler_micro_batches


def memory_now() -> dict[str, float]:
    """For every logged step: RSS and its peak; on a GPU allocated/reserved and peaks."""
    return {**memory_state(), "peak_rss_mb": round(peak_rss_mb(), 1)}


class MetricsLog:
    """Appends one JSON object per logged step to metrics.jsonl, and sends it to TensorBoard
    and W&B when `output.loggers` asks for them. On resume, drops entries past the resume
    step so the file reads as one uninterrupted run."""

    def __init__(
        self,
        output_dir: Path,
        *,
        resume_step: int,
        output: OutputConfig,
        run_config: dict | None = None,
        log: Callable[[str], None] = print,
    ):
        """`run_config` (the resolved config as plain data) becomes the W&B run's config;
        `log` reports a W&B failure during the run. Raises KeelError when W&B cannot start."""
        self.path = output_dir / METRICS_FILE
        logged_through = self._truncate_after(resume_step)
        # W&B first: it is the one backend that can fail on a user's setup (login, network),
        # and failing here leaves no open file behind.
        self._wandb = None
        if "wandb" in output.loggers:
            self._wandb = _WandbRun(
                output_dir,
                output.wandb,
                run_config or {},
                resume_step=resume_step,
                logged_through=logged_through,
                log=log,
            )
        self._handle = open(self.path, "a", encoding="utf-8")
        self._tb = None
        if "tensorboard" in output.loggers:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(
                log_dir=str(output_dir / "tensorboard"), purge_step=resume_step + 1
            )

    def _truncate_after(self, step: int) -> int:
        """Drop entries past `step`; return the last step the file held before (0: none)."""
        if not self.path.exists():
            return 0
        lines = [
            line for line in self.path.read_text(encoding="utf-8").splitlines() if line.strip()
        ]
        steps = [json.loads(line).get("step", 0) for line in lines]
        kept = [line for line, at in zip(lines, steps) if at <= step]
        self.path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        return max(steps, default=0)

    def write(self, record: dict) -> None:
        """Log one step's record (train or eval), which holds its `step`. A NaN or an
        infinity is written as null: bare NaN/Infinity is not JSON, and strict readers
        (jq, JavaScript, pandas' strict mode) refuse the whole file."""
        self._handle.write(json.dumps(_json_safe(record), allow_nan=False) + "\n")
        self._handle.flush()
        scalars = {
            _scalar_name(key): value
            for key, value in record.items()
            if key != "step" and isinstance(value, int | float)
        }
        if self._tb is not None:
            for name, value in scalars.items():
                self._tb.add_scalar(name, value, record["step"])
        if self._wandb is not None:
            self._wandb.log(scalars, record["step"])

    def close(self) -> None:
        """Flush and close every backend; ends the W&B run (see `_WandbRun.finish`)."""
        self._handle.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _json_safe(record: dict) -> dict:
    return {
        key: None if isinstance(value, float) and not math.isfinite(value) else value
        for key, value in record.items()
    }


def _scalar_name(key: str) -> str:
    # The same names in TensorBoard and W&B: eval metrics in one group, the rest in another.
    return f"eval/{key}" if key.startswith("eval") else f"train/{key}"


def _new_run_id() -> str:
    # W&B's own form (8 of [a-z0-9]); wandb.util.generate_id is gone from wandb 0.31.
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


class _WandbRun:
    """Rank 0's W&B run. A resumed keel run continues the W&B run whose id is kept in
    output.dir/wandb_run_id; a run starting at step 0 is a new W&B run."""

    def __init__(
        self,
        output_dir: Path,
        settings: WandbConfig,
        run_config: dict,
        *,
        resume_step: int,
        logged_through: int,
        log: Callable[[str], None],
    ):
        import wandb  # imported only when asked for: an optional extra, and slow to import

        self._log_message = log
        id_file = output_dir / WANDB_RUN_ID_FILE
        # Starting at step 0 (a fresh, overwritten, or restarted-before-any-checkpoint run)
        # gets a new id, so one W&B run never holds two different histories.
        reuse = resume_step > 0 and id_file.is_file()
        run_id = id_file.read_text(encoding="utf-8").strip() if reuse else _new_run_id()
        # W&B drops steps that go backwards, and offline it cannot know what it already has.
        # Steps between the checkpoint and the interruption were logged by the first attempt
        # with the values a resumed run recomputes (resume parity is tested), so they are not
        # sent again; metrics.jsonl, before truncation, says which steps those were. (Resuming
        # an older checkpoint on purpose keeps W&B's first values for those steps: replacing
        # them needs W&B's server-side rewind, which offline runs cannot use.)
        self._skip_through = logged_through if reuse else 0
        try:
            self._run = wandb.init(
                project=settings.project,
                entity=settings.entity,
                name=settings.name or output_dir.name,
                tags=settings.tags,
                mode=settings.mode,
                dir=str(output_dir),
                config=run_config,
                id=run_id,
                resume="allow",
            )
        except Exception as exc:  # fail before training, not after hours of unlogged steps
            raise KeelError(
                f"W&B could not start a run ({type(exc).__name__}: {exc}). Log in with "
                f"`wandb login`, or set output.wandb.mode=offline (upload later with "
                f"`wandb sync {output_dir}/wandb/offline-run-*`), or remove wandb from "
                f"output.loggers"
            ) from exc
        id_file.write_text(run_id + "\n", encoding="utf-8")

    def log(self, scalars: dict, step: int) -> None:
        if self._run is None or step <= self._skip_through:
            return
        try:
            self._run.log(scalars, step=step)
        except Exception as exc:
            self._give_up("log", exc)

    def finish(self) -> None:
        """End the W&B run; called while an exception propagates (the run.py `finally`),
        it marks the W&B run as failed, so a crash does not read as a finished run."""
        if self._run is None:
            return
        try:
            self._run.finish(exit_code=1 if sys.exc_info()[0] is not None else 0)
        except Exception as exc:
            self._give_up("finish", exc)
        self._run = None

    def _give_up(self, what: str, exc: Exception) -> None:
        # A broken metrics sink must not end hours of training: metrics.jsonl still has
        # every record. Say so once, then stop calling W&B.
        self._run = None
        self._log_message(
            f"warning: W&B {what} failed ({type(exc).__name__}: {exc}); "
            f"no more W&B logging for this run, {METRICS_FILE} has every step"
        )


def read_metrics(path: Path) -> list[dict]:
    return [
        json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()
    ]


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
    """Training progress: on a terminal, a tqdm bar on stderr with loss, lr and tokens/s (tqdm
    supplies the ETA); elsewhere (a pipe, a log file) one plain line per logged step through
    `log`, since a bar's carriage-return updates would make one endless line there."""

    def __init__(
        self,
        total: int,
        initial: int,
        enabled: bool = True,
        log: Callable[[str], None] = print,
        interactive: bool | None = None,
    ):
        """`interactive` None: a bar when stderr is a terminal."""
        from tqdm.auto import tqdm

        self.enabled, self.total, self.done, self._log = enabled, total, initial, log
        self.interactive = sys.stderr.isatty() if interactive is None else interactive
        self._bar = tqdm(
            total=total,
            initial=initial,
            desc="train",
            unit="step",
            file=sys.stderr,
            disable=not (enabled and self.interactive),
            dynamic_ncols=True,
        )

    def update(self, loss: float | None, lr: float, tokens_per_s: float) -> None:
        """One step done; `loss` is None on steps that are not logged (reading it would be a
        host sync), and the bar keeps showing the last logged values."""
        self.done += 1
        if loss is not None:
            self._bar.set_postfix(
                loss=f"{loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tokens_per_s:.0f}", refresh=False
            )
            if self.enabled and not self.interactive:
                self._log(
                    f"step {self.done}/{self.total}: loss {loss:.4f}, lr {lr:.2e}, "
                    f"{tokens_per_s:,.0f} tokens/s"
                )
        self._bar.update(1)

    def write(self, text: str) -> None:
        if not self.enabled:
            return
        if self.interactive:
            self._bar.write(text, file=sys.stderr)
        else:
            self._log(text)

    def close(self) -> None:
        self._bar.close()
