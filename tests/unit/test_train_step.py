"""The training step: token-level normalisation, packed == unpacked, fast head == HF forward."""

import copy
import json

import pytest
import torch

from keel.config import DataConfig, DatasetConfig
from keel.data import collate, prepare_data
from keel.precision import Precision
from keel.train.batch_source import StepPlan
from keel.train.loop import Trainer
from keel.train.objective import CausalLMObjective

ROWS = [
    {"instruction": "Who are you?", "input": "", "output": "I am Keel."},
    {
        "instruction": "Give three tips for staying healthy.",
        "input": "",
        "output": "Eat well, sleep enough, and move every day. Drink water.",
    },
    {"instruction": "Translate to French", "input": "hello world", "output": "Bonjour le monde."},
    {"instruction": "What is your name?", "input": "", "output": "My name is Keel."},
    {"instruction": "Add", "input": "2 + 3", "output": "5"},
]


def rows_of(dataset):
    return [dataset[i] for i in range(len(dataset))]


def prepared(tokenizer, tmp_path, *, packing: bool, cutoff_len: int = 256):
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "d.json"
    path.write_text(json.dumps(ROWS))
    cfg = DataConfig(
        datasets=[DatasetConfig(path=str(path), format="alpaca")],
        cutoff_len=cutoff_len,
        packing=packing,
    )
    return prepare_data(
        cfg,
        tokenizer,
        stage="sft",
        cache_dir=tmp_path / "cache",
        base_dir=tmp_path,
        seed=0,
        log=lambda _m: None,
    )


def checked(objective: CausalLMObjective) -> CausalLMObjective:
    """The objective with its fast head on, as training sets it up (after the probe)."""
    ok, why = objective.check_fast_head()
    assert ok, why
    objective.fast_head = True
    return objective


def make_trainer(model, lr=1.0):
    objective = checked(CausalLMObjective(model, chunk_size=7))
    optimizer = torch.optim.SGD([p for p in objective.parameters() if p.requires_grad], lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _s: 1.0)
    return Trainer(
        objective=objective,
        optimizer=optimizer,
        scheduler=scheduler,
        precision=Precision("fp32", "test"),
        device=torch.device("cpu"),
        pad_id=0,
        max_grad_norm=0.0,
    )


@pytest.mark.parametrize("fast_head", [True, False], ids=["fast-head", "full-forward"])
def test_packed_loss_equals_unpacked(tiny_tokenizer, tiny_model_dir, tmp_path, fast_head):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    objective = CausalLMObjective(model)
    if fast_head:
        objective = checked(objective)
    packed = rows_of(prepared(tiny_tokenizer, tmp_path / "p", packing=True).train)
    unpacked = rows_of(prepared(tiny_tokenizer, tmp_path / "u", packing=False).train)
    assert len(packed) < len(unpacked) == len(ROWS)
    with torch.no_grad():
        out_p = objective(collate(packed, tiny_tokenizer.pad_token_id))
        out_u = objective(collate(unpacked, tiny_tokenizer.pad_token_id))
        loss_p, n_p, loss_u, n_u = out_p.loss, out_p.count, out_u.loss, out_u.count
    assert int(n_p) == int(n_u) > 0
    torch.testing.assert_close(loss_p, loss_u, rtol=1e-5, atol=1e-5)


def test_unpacked_batches_need_no_position_ids(tiny_tokenizer, tiny_model_dir, tmp_path):
    """The trainer drops position ids when no row holds two samples (so transformers need
    not check for packing, a host sync per forward); the loss is the same, and a packed
    batch keeps them."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    trainer = make_trainer(model)
    unpacked = rows_of(prepared(tiny_tokenizer, tmp_path / "u", packing=False).train)
    packed = rows_of(prepared(tiny_tokenizer, tmp_path / "p", packing=True).train)
    assert trainer._batch(unpacked)["position_ids"] is None
    assert trainer._batch(packed)["position_ids"] is not None
    with torch.no_grad():
        without = trainer.objective(trainer._batch(unpacked)).loss
        with_ids = trainer.objective(collate(unpacked, 0)).loss
    torch.testing.assert_close(without, with_ids, rtol=1e-6, atol=1e-6)


def test_fast_head_matches_hugging_face_forward(tiny_tokenizer, tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    batch = collate(
        rows_of(prepared(tiny_tokenizer, tmp_path, packing=False).train),
        tiny_tokenizer.pad_token_id,
    )
    slow = CausalLMObjective(model)
    assert not slow.fast_head  # off until the probe has passed: the full HF forward
    fast = CausalLMObjective(model, chunk_size=7)  # several chunks
    ok, why = fast.check_fast_head()
    assert ok, why
    fast.fast_head = True
    with torch.no_grad():
        torch.testing.assert_close(fast(batch).loss, slow(batch).loss, rtol=1e-5, atol=1e-5)


def test_accumulation_normalises_by_window_tokens(tiny_tokenizer, tiny_model_dir, tmp_path):
    """Two uneven micro-batches must give the update of one batch holding all rows."""
    from transformers import AutoModelForCausalLM

    rows = rows_of(prepared(tiny_tokenizer, tmp_path, packing=False).train)
    counts = [r["num_targets"] for r in rows]
    assert len(set(counts)) > 1  # uneven, or the test could not tell the two rules apart
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    one, accum = copy.deepcopy(base), copy.deepcopy(base)
    whole = dict(
        window_targets=sum(r["num_targets"] for r in rows),
        window_tokens=sum(len(r["input_ids"]) for r in rows),
        filler=rows[0],
    )
    r_one = make_trainer(one).train_step([rows], **whole)
    r_acc = make_trainer(accum).train_step([rows[:1], rows[1:]], **whole)
    assert float(r_one.loss_sum) == pytest.approx(float(r_acc.loss_sum), rel=1e-6)
    for p1, p2 in zip(one.parameters(), accum.parameters()):
        torch.testing.assert_close(p1, p2, rtol=1e-5, atol=1e-7)
    # A mean of per-micro-batch means would be a different (wrong) update:
    naive = copy.deepcopy(base)
    objective = CausalLMObjective(naive)
    for mb in (rows[:1], rows[1:]):
        out = objective(collate(mb, 0))
        loss, n = out.loss, out.count
        (loss / n / 2).backward()
    grads_naive = [p.grad for p in naive.parameters()]
    moved = [p0 - p1 for p0, p1 in zip(base.parameters(), one.parameters())]
    assert any(not torch.allclose(g, m, atol=1e-6) for g, m in zip(grads_naive, moved))


def test_a_process_without_rows_runs_a_zero_weight_filler(tiny_tokenizer, tiny_model_dir, tmp_path):
    """The filler micro-batch of a process whose share of a window is empty (even on its
    very first step) runs forward and backward but changes nothing."""
    from transformers import AutoModelForCausalLM

    rows = rows_of(prepared(tiny_tokenizer, tmp_path, packing=False).train)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    before = copy.deepcopy(model.state_dict())
    result = make_trainer(model).train_step(
        [[]], window_targets=12, window_tokens=40, filler=rows[0]
    )
    assert float(result.loss_sum) == 0.0 and result.target_tokens == 12
    assert result.rows == 0 and result.filler_micro_batches == 1
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0, msg=name)


def test_step_plan_windows_cover_each_row_once_per_epoch():
    plan = StepPlan(num_rows=11, global_batch=4, micro_batch_size=2, seed=3, shuffle=True)
    assert plan.steps_per_epoch == 3
    for epoch in range(2):
        seen = [i for s in range(epoch * 3, epoch * 3 + 3) for i in plan.window(s)]
        assert sorted(seen) == list(range(11))
    assert plan.window(0) != plan.window(3)  # reshuffled per epoch
    assert plan.total_steps(epochs=1.5, max_steps=None) == 5
    assert plan.total_steps(epochs=1, max_steps=7) == 7


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_rank_runs_the_same_number_of_micro_batches(world_size):
    """An uneven remainder is padded with empty (filler) micro-batches, never left to chance."""
    plan = StepPlan(num_rows=11, global_batch=5, micro_batch_size=2, seed=0, shuffle=True)
    for step in range(plan.steps_per_epoch):  # windows of 5, 5 and 1 rows
        per_rank = [plan.micro_batches(step, r, world_size) for r in range(world_size)]
        assert len({len(mbs) for mbs in per_rank}) == 1
        rows = [i for mbs in per_rank for mb in mbs for i in mb]
        assert sorted(rows) == sorted(plan.window(step))  # each row once, on one rank
        assert all(len(mb) <= 2 for mbs in per_rank for mb in mbs)
    # The last window holds one row: every other rank runs one filler micro-batch.
    assert [plan.micro_batches(2, r, 4) for r in range(4)][1:] == [[[]], [[]], [[]]]
