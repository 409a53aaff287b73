"""Early stopping (train.early_stopping_patience): end a run once evaluation stops improving,
and keep the best evaluation's model, as Hugging Face's EarlyStoppingCallback does with
load_best_model_at_end.

After each periodic evaluation the eval loss is compared with the best so far: lower by more
than train.early_stopping_threshold counts as an improvement (a checkpoint is then saved at
that step, and kept by the pruning of old ones); `patience` evaluations in a row without one
end the run. The final model is the best evaluation's: its checkpoint is loaded before the
outputs are written. The tracker is a checkpointed part, so a resumed run counts on where
the interrupted one stopped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from keel.checkpoint.checkpointer import Checkpointer
from keel.config.schema import TrainConfig

EARLY_STOPPING = "early_stopping"  # its name among the checkpointed parts


@dataclass(frozen=True)
class Verdict:
    improved: bool  # the best so far: keep this step's model
    stop: bool  # `patience` evaluations in a row without improvement


class EarlyStopping:
    """The best eval loss so far, its step, and the evaluations since (every process keeps
    the same numbers: the eval loss is reduced over all of them)."""

    def __init__(self, patience: int, threshold: float):
        self.patience, self.threshold = patience, threshold
        self.best_loss = math.inf
        self.best_step: int | None = None
        self.evals_since_best = 0

    @classmethod
    def of(cls, train: TrainConfig) -> EarlyStopping | None:
        if not train.early_stopping_patience:
            return None
        return cls(train.early_stopping_patience, train.early_stopping_threshold)

    def update(self, step: int, eval_loss: float) -> Verdict:
        if eval_loss < self.best_loss - self.threshold:
            self.best_loss, self.best_step, self.evals_since_best = eval_loss, step, 0
            return Verdict(improved=True, stop=False)
        self.evals_since_best += 1
        return Verdict(improved=False, stop=self.evals_since_best >= self.patience)

    def why(self, step: int) -> str:
        return (
            f"early stopping: eval_loss did not improve by more than "
            f"{self.threshold:g} in {self.evals_since_best} evaluation"
            f"{'s' if self.evals_since_best > 1 else ''} (best "
            f"{self.best_loss:.4f} at step {self.best_step}); stopped after step {step}"
        )

    def state_dict(self) -> dict:
        loss = None if math.isinf(self.best_loss) else self.best_loss
        return {"best_loss": loss, "best_step": self.best_step, "evals": self.evals_since_best}

    def load_state_dict(self, state: dict) -> None:
        loss = state.get("best_loss")
        self.best_loss = math.inf if loss is None else float(loss)
        self.best_step = state.get("best_step")
        self.evals_since_best = int(state.get("evals", 0))


def track_early_stopping(checkpointer: Checkpointer, train: TrainConfig) -> None:
    """Checkpoint the run's tracker beside its other parts (no tracker: early stopping is
    off). A checkpoint of a run without it holds none: the tracker then starts anew."""
    tracker = EarlyStopping.of(train)
    if tracker is not None:
        checkpointer.register(EARLY_STOPPING, tracker, missing_ok=True)
