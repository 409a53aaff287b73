"""Context parallelism (distributed.context_parallel): a micro-batch's tokens split over a
group of processes computes what one process computes on the whole row.

Two levels: the model's forward and backward on one row of samples, each process holding
its part of the tokens (with a negative control that attends within the part only); and
whole `keel train` runs, 2 and 4 processes against one, through the parity workspace.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from multiproc import (
    RUN_TIMEOUT_S,
    Workspace,
    _env,
    eval_losses,
    free_port,
    single_process_runs,
    train_losses,
)
from test_parity import assert_same_losses, assert_same_weights

from keel.distributed.context_parallel import CP_GROUP, head_problem, shard_tokens
from keel.distributed.process_group import exit_now, init_distributed, shutdown
from keel.models.attention import SEQ_LENS, VARLEN_ATTENTION, register_varlen_attention

# one row of two samples: 13 tokens, padded to 14 for 2 processes; the first sample runs
# into the second part
SAMPLES = (9, 4)
ROOT = Path(__file__).resolve().parents[2]


def _model(kv_heads: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).float()
    register_varlen_attention()
    model.set_attn_implementation(VARLEN_ATTENTION)
    return model


def _row() -> dict:
    torch.manual_seed(1)
    tokens = sum(SAMPLES)
    ids = torch.randint(3, 50, (1, tokens))
    positions = torch.cat([torch.arange(n) for n in SAMPLES])[None]
    targets = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)
    return {"input_ids": ids, "position_ids": positions, "targets": targets, "seq_lens": SAMPLES}


def _forward(model, batch: dict, group) -> torch.Tensor:
    """Logits [1, T, V] of `batch`; with `group`, of this process's part (context parallel)."""
    kwargs = {SEQ_LENS: batch["seq_lens"]}
    if group is not None:
        kwargs[CP_GROUP] = group
    out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], **kwargs)
    return out.logits


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(
        logits[0], targets[0], ignore_index=-100, reduction="sum"
    )


def one_group(rank: int, world: int, port: int):
    """This spawned process's gloo context, all `world` processes one context-parallel group."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    ctx = init_distributed(
        rank=rank, world_size=world, local_rank=rank, local_world_size=world,
        timeout_s=60, preprocess_timeout_s=60, log=lambda _m: None,
    )  # fmt: skip
    ctx.dims = ctx.dims.with_context(world, "cpu")
    return ctx


def _worker(rank: int, world: int, port: int, out: str) -> None:
    ctx = one_group(rank, world, port)
    group = ctx.cp_group
    seen = {"ranks": [ctx.dp_rank, ctx.dp_size, ctx.cp_rank, ctx.grad_size]}
    for kv_heads in (2, 1):  # 1: fewer key/value heads than processes (repeated)
        model = _model(kv_heads)
        row = _row()
        whole = _forward(model, row, None)  # every process computes the whole row too
        _loss(whole, row["targets"]).backward()
        want_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        part = shard_tokens(row, ctx.cp_rank, world, pad_id=0)
        mine = _forward(model, part, group)
        _loss(mine, part["targets"]).backward()
        size = mine.shape[1]
        start = ctx.cp_rank * size
        real = min(size, sum(SAMPLES) - start)  # the pad token has no counterpart
        seen[f"logits-{kv_heads}"] = (
            (mine[0, :real] - whole[0, start : start + real]).abs().max().item()
        )
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        for grad in grads.values():  # the group's parts sum to the row's gradient
            torch.distributed.all_reduce(grad, group=group)
        seen[f"grads-{kv_heads}"] = max(
            (grads[n] - want_grads[n]).abs().max().item() for n in want_grads
        )
        with torch.no_grad():  # negative control: each part attends within itself only
            alone = _forward(model, part | {"seq_lens": _cut(part["seq_lens"], start, size)}, None)
        seen[f"alone-{kv_heads}"] = (
            (alone[0, :real] - whole[0, start : start + real]).abs().max().item()
        )
    seen["probe"] = _probe_verdicts(group, ctx.cp_rank, world)
    with open(f"{out}.{rank}", "w") as f:
        json.dump(seen, f)
    shutdown(ctx)
    exit_now(0)


class _RunningSum(torch.nn.Module):
    """An MLP that also adds each token's running sum over the row: it mixes tokens
    outside attention, as a state-space layer does."""

    def __init__(self, mlp):
        super().__init__()
        self.mlp = mlp

    def forward(self, x):
        return self.mlp(x) + 0.1 * x.cumsum(dim=1)


def _probe_verdicts(group, rank: int, size: int) -> list:
    """The set-up check's (ok, why) for the model, then for one that mixes tokens."""
    from keel.train.objective import CausalLMObjective

    model = _model(2)
    objective = CausalLMObjective(model)
    verdicts = [objective.check_context_parallel(group, rank, size)]
    model.model.layers[0].mlp = _RunningSum(model.model.layers[0].mlp)
    verdicts.append(objective.check_context_parallel(group, rank, size))
    return verdicts


def grad_norms(out) -> dict[int, float]:
    """step -> grad_norm: the gradients' scale, which Adam's update would hide (a group
    whose gradients were averaged over the wrong number of processes trains the same)."""
    records = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["grad_norm"] for r in records if "grad_norm" in r}


def _cut(seq_lens: tuple[int, ...], start: int, size: int) -> tuple[int, ...]:
    """The lengths of the samples' pieces in tokens [start, start + size) of the row."""
    ends = torch.tensor(seq_lens).cumsum(0).tolist()
    bounds = sorted({start, start + size, *(e for e in ends if start < e < start + size)})
    return tuple(b - a for a, b in zip(bounds, bounds[1:]))


def test_a_row_split_over_two_processes_gives_its_logits_and_gradients(tmp_path):
    out = str(tmp_path / "seen")
    mp.spawn(_worker, args=(2, free_port(), out), nprocs=2)
    seen = [json.loads(open(f"{out}.{rank}").read()) for rank in range(2)]
    for rank in range(2):
        assert seen[rank]["ranks"] == [0, 1, rank, 2]
    for kv_heads in (2, 1):
        for rank in range(2):
            assert seen[rank][f"logits-{kv_heads}"] < 1e-5
            assert seen[rank][f"grads-{kv_heads}"] < 1e-5
        # alone, the second part's first tokens (the first sample's last two) do not see
        # that sample's start, in the first part
        assert seen[1][f"alone-{kv_heads}"] > 1e-2
    (ok, why), (mixed_ok, mixed_why) = seen[1]["probe"]
    assert ok and "tolerance rel 1e-05" in why
    # the second part's running sums miss the first part's tokens
    assert not mixed_ok and "a layer mixes tokens outside attention" in mixed_why


def test_shard_tokens_pads_with_a_sample_of_no_targets():
    row = _row()
    parts = [shard_tokens(row, rank, 2, pad_id=0) for rank in range(2)]
    assert [p["input_ids"].shape[1] for p in parts] == [7, 7]
    assert parts[0]["seq_lens"] == (9, 4, 1)
    assert _cut(parts[1]["seq_lens"], 7, 7) == (2, 4, 1)
    joined = {k: torch.cat([p[k] for p in parts], dim=1) for k in ("input_ids", "targets")}
    assert torch.equal(joined["input_ids"][:, :13], row["input_ids"])
    assert joined["input_ids"][0, 13] == 0 and joined["targets"][0, 13] == -100
    assert torch.equal(joined["targets"][:, :13], row["targets"])
    assert shard_tokens(row, 0, 1, pad_id=0)["input_ids"].shape[1] == 13  # one process: whole


def test_query_heads_must_split_over_the_group():
    assert head_problem(4, 2) is None and head_problem(8, 4) is None
    assert "4 attention heads do not split over" in head_problem(4, 3)


# ---- whole runs: N processes with context parallelism against one process ----------

CP2 = ("distributed.context_parallel=2",)
CASES = {
    # one group of 2: the whole global batch in one data-parallel rank, its rows split
    "cp2-ddp-full": ("method.type=full", "distributed.strategy=ddp"),
    "cp2-fsdp-lora-packed-ckpt": (
        "method.type=lora",
        "data.packing=true",
        "train.gradient_checkpointing=true",
        "distributed.strategy=fsdp",
    ),
}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, tiny_model_dir) -> Workspace:
    return Workspace(tmp_path_factory.mktemp("cp"), tiny_model_dir)


@pytest.fixture(scope="module")
def reference(workspace):
    return single_process_runs(workspace)


@pytest.fixture(scope="module")
def two_processes(workspace) -> dict:
    runs = [(name, (*CP2, *extra)) for name, extra in CASES.items()]
    runs.append(
        (RESUMED, (*CP2, "method.type=lora", "distributed.strategy=fsdp", "train.max_steps=4"))
    )
    return workspace.train_together(runs)


# Stopped after 4 of 6 steps as a group of 2 (FSDP2), finished on one process
RESUMED = "cp2-stopped-at-4"


@pytest.mark.parametrize("case", CASES)
def test_two_processes_splitting_tokens_match_one(workspace, reference, two_processes, case):
    got = two_processes[case]
    want = reference(*CASES[case][:-1])  # one process, no strategy
    assert "1 group(s) of 2 processes (context parallel)" in workspace.outputs_together[case]
    assert_same_run(got, want)


def assert_same_run(got: Path, want: Path) -> None:
    """Two runs' output folders: the same losses, eval losses, gradient norms (step by
    step) and final weights."""
    assert_same_losses(train_losses(got), train_losses(want))
    assert_same_losses(eval_losses(got), eval_losses(want))
    assert_same_losses(grad_norms(got), grad_norms(want))
    assert_same_weights(got, want)


def test_a_group_checkpoint_resumes_on_one_process(workspace, reference, two_processes):
    """A checkpoint written by a group of 2 (each process's shards of the weights and
    optimizer state, the data position) finishes on one process as an unbroken run."""
    assert max(train_losses(two_processes[RESUMED])) == 4
    resumed = workspace.train(RESUMED, "method.type=lora")
    assert "resumed from" in workspace.last_output
    want = reference("method.type=lora")
    assert_same_losses(train_losses(resumed), train_losses(want))
    assert_same_weights(resumed, want)


def test_four_processes_in_two_groups_match_one(workspace, reference):
    """2 data-parallel groups of 2: each group reads half of every step's rows (the last
    step's filler too) and FSDP2 shards over all 4 processes."""
    extra = ("method.type=full", "data.packing=true")
    got = workspace.train("cp2-dp2-fsdp", *CP2, *extra, "distributed.strategy=fsdp", nproc=4)
    assert "2 group(s) of 2 processes (context parallel)" in workspace.last_output
    assert_same_run(got, reference(*extra))


def test_models_context_parallelism_cannot_split_are_refused_before_weights_load():
    from conftest import build_tiny_model
    from vlm_support import build_tiny_qwen2_vl
    from vlm_support_more import build_tiny_gemma3

    from keel.models.attention import context_parallel_problem

    assert context_parallel_problem(build_tiny_model(64), 2) is None  # 4 heads over 2
    three = context_parallel_problem(build_tiny_model(64), 3)
    assert "4 attention heads do not split over distributed.context_parallel = 3" in three
    assert context_parallel_problem(build_tiny_qwen2_vl(), 2) is None
    # Gemma 3's image tokens attend both ways; keel's varlen attention is causal
    assert "attend to each other both ways" in context_parallel_problem(build_tiny_gemma3(), 2)
    assert context_parallel_problem(build_tiny_gemma3(), 1) is None  # off


def test_the_shipped_example_runs_on_two_processes(tiny_model_dir, tmp_path):
    """examples/pretrain_long_context.yaml, the tiny model swapped in: 2 steps, 1 group."""
    out = tmp_path / "out"
    command = [sys.executable, "-m", "keel", "train", "examples/pretrain_long_context.yaml"]
    command += [f"model.path={tiny_model_dir}", f"model.cache_dir={tmp_path / 'cache'}"]
    command += [f"output.dir={out}", "train.max_steps=2", "train.precision=fp32"]
    command += ["train.threads=1", "--nproc", "2"]
    done = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=_env()
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "1 group(s) of 2 processes (context parallel)" in done.stdout + done.stderr
    assert [step for step in train_losses(out)] == [1, 2]


def test_a_split_the_model_cannot_take_is_refused_before_the_data_is_read(tiny_model_dir, tmp_path):
    from cli_support import keel_in_process

    result = keel_in_process(
        "validate",
        "examples/pretrain_long_context.yaml",
        f"model.path={tiny_model_dir}",
        f"model.cache_dir={tmp_path / 'cache'}",
        "distributed.context_parallel=3",
        cwd=ROOT,
    )
    assert result.returncode == 2
    assert "4 attention heads do not split over distributed.context_parallel = 3" in (
        result.stdout + result.stderr
    )
    assert not (tmp_path / "cache" / "data").exists()  # refused before tokenizing
