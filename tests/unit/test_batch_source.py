"""The batch source seam: the loop asks a source for each step's rows and checkpoints its
state. The dataset source gives exactly StepPlan's rows and sums; a generated source drives
the loop with no dataset at all (online RL's shape); old checkpoints without the source's
state keep resuming; a checkpoint of another data order is refused."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from config_support import qa_rows, tiny_lora_config
from conftest import build_tiny_model
from datasets import Dataset
from torch import nn

from keel.checkpoint.checkpointer import Checkpointer, StatefulParts
from keel.checkpoint.layout import TRAINER, complete_checkpoints
from keel.config import load_config
from keel.distributed.process_group import DistContext
from keel.errors import CheckpointError
from keel.precision import Precision
from keel.train.batch_source import BATCH_SOURCE, DatasetBatchSource, StepBatch, StepPlan
from keel.train.loop import Trainer
from keel.train.objective import CausalLMObjective
from keel.train.reference import ReferenceLogps
from keel.train.run import run_training
from keel.train.run_loop import RunEnv, TrainingLoop
from keel.train.stops import Preemption
from keel.train.watch import watching


def rows_dataset(count: int) -> Dataset:
    """`count` rows of different lengths and target counts (row i: i + 3 tokens)."""
    ids = [list(range(1, i + 4)) for i in range(count)]
    targets = [[-100] * (i % 3) + row[1 + i % 3 :] + [-100] for i, row in enumerate(ids)]
    return Dataset.from_dict(
        {
            "input_ids": ids,
            "targets": targets,
            "position_ids": [list(range(len(row))) for row in ids],
            "num_targets": [sum(t != -100 for t in row) for row in targets],
        }
    )


@pytest.mark.parametrize("dp_size", [1, 2, 3])
def test_the_dataset_source_gives_the_step_plans_rows_and_sums(dp_size):
    rows = rows_dataset(11)
    plan = StepPlan(num_rows=11, global_batch=4, micro_batch_size=1, seed=5, shuffle=True)
    reference = ReferenceLogps(main={i: [-float(i)] for i in range(11)}, kl={})
    steps = range(2 * plan.steps_per_epoch + 1)  # epochs 0-2; each ends in a 3-row window
    for rank in range(dp_size):
        source = DatasetBatchSource(plan, rows, dp_rank=rank, dp_size=dp_size, reference=reference)
        for step in steps:
            window = plan.window(step)
            batch = source.batch(step)
            expected = [
                [{**rows[i], "reference_logps": [-float(i)]} for i in micro]
                for micro in plan.micro_batches(step, rank, dp_size)
            ]
            assert batch.micro_batches == expected
            assert batch.window_targets == sum(rows[i]["num_targets"] for i in window)
            assert batch.window_tokens == sum(len(rows[i]["input_ids"]) for i in window)
            assert batch.filler == {**rows[window[0]], "reference_logps": [-float(window[0])]}
            assert batch.rows == len(window)
            assert source.epoch_of(step) == plan.epoch_of(step)
    assert len(plan.window(plan.steps_per_epoch - 1)) == 3  # the uneven last window was met


def _checkpointer(folder, source, seed: int = 0) -> Checkpointer:
    torch.manual_seed(seed)
    module = nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    parts = StatefulParts(module=module, optimizer=optimizer, scheduler=scheduler)
    checkpointer = Checkpointer(parts, output_dir=folder, keep_last=2, dist=DistContext())
    if source is not None:
        checkpointer.register(BATCH_SOURCE, source, missing_ok=True)
    return checkpointer


def _dataset_source(seed: int = 5, global_batch: int = 4) -> DatasetBatchSource:
    plan = StepPlan(
        num_rows=11, global_batch=global_batch, micro_batch_size=2, seed=seed, shuffle=True
    )
    return DatasetBatchSource(plan, rows_dataset(11), dp_rank=0, dp_size=1)


def test_the_dataset_sources_state_goes_through_a_checkpoint(tmp_path):
    path = _checkpointer(tmp_path, _dataset_source()).save(3, meta={})
    saved = json.loads((path / TRAINER).read_text())["parts"][BATCH_SOURCE]
    assert saved == {
        "kind": "dataset",
        "num_rows": 11,
        "global_batch": 4,
        "seed": 5,
        "shuffle": True,
    }
    assert _checkpointer(tmp_path, _dataset_source(), seed=1).load(path).step == 3


@pytest.mark.parametrize(
    "other,named",
    [
        ({"seed": 6}, "seed was 5 in the checkpoint, this run has 6"),
        ({"global_batch": 5}, "global_batch was 4"),
    ],
    ids=["seed", "global-batch"],
)
def test_a_checkpoint_of_another_data_order_is_refused_before_the_weights_load(
    tmp_path, other, named
):
    path = _checkpointer(tmp_path, _dataset_source()).save(3, meta={})
    resumed = _checkpointer(tmp_path, _dataset_source(**other), seed=1)
    before = [p.detach().clone() for p in resumed.parts.module.parameters()]
    with pytest.raises(CheckpointError, match="data order") as info:
        resumed.load(path)
    assert named in str(info.value) and "train.resume=never" in str(info.value)
    after = list(resumed.parts.module.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_a_checkpoint_without_the_sources_state_loads(tmp_path):
    """As keel wrote checkpoints before the source was a part: trainer.json has no parts."""
    path = _checkpointer(tmp_path, source=None).save(2, meta={})
    assert "parts" not in json.loads((path / TRAINER).read_text())
    assert _checkpointer(tmp_path, _dataset_source(), seed=1).load(path).step == 2


class GeneratedRows:
    """A source that makes each step's rows (as online RL's rollouts will), no dataset:
    random token ids from a generator that only its state carries across a resume."""

    def __init__(self, vocab_size: int, seed: int = 0):
        self.vocab_size, self.seed, self.made = vocab_size, seed, 0

    def _row(self, length: int) -> dict:
        generator = torch.Generator().manual_seed(self.seed * 1000 + self.made)
        self.made += 1
        ids = torch.randint(3, self.vocab_size, (length,), generator=generator).tolist()
        targets = [-100, -100, *ids[3:], -100]  # a 2-token "prompt", then the completion
        return {"input_ids": ids, "targets": targets, "position_ids": list(range(length))}

    def batch(self, step: int) -> StepBatch:
        micro_batches = [[self._row(6), self._row(9)], [self._row(7)]]
        rows = [row for micro in micro_batches for row in micro]
        return StepBatch(
            micro_batches=micro_batches,
            window_targets=sum(sum(t != -100 for t in row["targets"]) for row in rows),
            window_tokens=sum(len(row["input_ids"]) for row in rows),
            filler=rows[0],
            rows=len(rows),
        )

    def epoch_of(self, step: int) -> float:
        return 0.0  # generated rows have no epochs

    def state_dict(self) -> dict:
        return {"seed": self.seed, "made": self.made}

    def load_state_dict(self, state_dict: dict) -> None:
        self.seed, self.made = state_dict["seed"], state_dict["made"]


def test_a_generated_source_drives_the_loop_without_a_dataset(tiny_model_dir, tmp_path):
    missing = tmp_path / "no-such-data.json"  # never read: the loop asks only the source
    cfg = load_config(None, [], base=tiny_lora_config(tiny_model_dir, missing, tmp_path / "out"))
    (tmp_path / "out").mkdir()
    dist = DistContext()
    torch.manual_seed(0)
    objective = CausalLMObjective(build_tiny_model(vocab_size=64))
    optimizer = torch.optim.SGD(objective.parameters(), lr=0.1)
    trainer = Trainer(
        objective=objective,
        optimizer=optimizer,
        scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _s: 1.0),
        precision=Precision("fp32", "test"),
        device=torch.device("cpu"),
        pad_id=0,
        max_grad_norm=1.0,
    )
    source = GeneratedRows(vocab_size=64, seed=3)
    parts = StatefulParts(module=objective, optimizer=optimizer, scheduler=trainer.scheduler)
    checkpointer = Checkpointer(parts, output_dir=tmp_path / "out", keep_last=1, dist=dist)
    checkpointer.register(BATCH_SOURCE, source)
    with watching(cfg, dist, None) as watchdog, Preemption() as preemption:
        env = RunEnv(
            dist=dist,
            log=lambda _m: None,
            detail=lambda _m: None,
            on_step_end=None,
            watchdog=watchdog,
            fault=None,
            preemption=preemption,
        )
        loop = TrainingLoop(
            cfg, trainer, env, source=source, checkpointer=checkpointer, eval_rows=[]
        )
        losses, stats = loop.run(0, 2, meta={})
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    assert source.made == 6 and stats.rows == 6 and stats.final_loss == losses[-1]
    assert stats.target_tokens == 2 * (3 + 6 + 4)  # the source's counts, not a dataset's
    (newest,) = complete_checkpoints(tmp_path / "out")
    parts_saved = json.loads((newest / TRAINER).read_text())["parts"]
    assert parts_saved == {BATCH_SOURCE: {"seed": 3, "made": 6}}
    assert checkpointer.load(newest).step == 2 and source.made == 6


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir):
    """A 4-step run, and a 2-step run whose checkpoint is as keel wrote them before the batch
    source was a checkpoint part (no "parts" in trainer.json)."""
    root = tmp_path_factory.mktemp("batch-source")
    data = root / "qa.json"
    data.write_text(json.dumps(qa_rows(8)))

    def config(name: str, steps: int):
        train = {"max_steps": steps, "scheduler": "constant"}  # the same lr when extended
        base = tiny_lora_config(tiny_model_dir, data, root / name, train=train)
        return base, load_config(None, [], base=base)

    full = run_training(config("full", 4)[1], log=lambda _m: None)
    old_base, old_cfg = config("old", 2)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Checkpointer, "register", lambda *_a, **_k: None)
        run_training(old_cfg, log=lambda _m: None)
    return root, full, old_base


def test_the_run_checkpoints_the_dataset_source(runs):
    root, _, _ = runs
    step2 = root / "full" / "checkpoints" / "step-00000002"
    saved = json.loads((step2 / TRAINER).read_text())["parts"]
    assert saved[BATCH_SOURCE] == {
        "kind": "dataset",
        "num_rows": 8,
        "global_batch": 2,
        "seed": 42,
        "shuffle": True,
    }


def test_a_checkpoint_from_before_batch_sources_resumes_the_same_run(runs, tmp_path):
    root, full, old_base = runs
    old_trainer = root / "old" / "checkpoints" / "step-00000002" / TRAINER
    assert "parts" not in json.loads(old_trainer.read_text())
    out = tmp_path / "old"
    shutil.copytree(root / "old", out)
    base = {**old_base, "output": {**old_base["output"], "dir": str(out)}}
    resumed = run_training(load_config(None, ["train.max_steps=4"], base=base), log=lambda _m: None)
    assert resumed.losses == full.losses[2:]  # steps 3 and 4, bit for bit
