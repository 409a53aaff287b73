"""Context parallelism for grpo: a group of 2 processes samples each step's completions
once between them and trains on them as one process does.

The group shares a block of prompts. Each process samples and scores every other unit of
it (`grpo.generation_batch_prompts` prompts) and one gather gives both every completion,
in block order: the rewards and lengths must EQUAL one process's, and the completions log
hold the same texts. Each process then computes its part of every row's tokens: grpo's
per-completion mean needs each completion's token count over both parts, the old
log-probs of num_iterations 2 are gathered back into whole rows, the batch-scaled
rewards and the step's tallies count the group's block once. Each case compares every
step's metrics, the grad norms (a gradient summed over the wrong processes trains the same
under Adam, but not with the same norm) and the final weights with one process's. A
group's checkpoint inside a reused rollout resumes on one process as the unbroken run, and
without train.global_batch_size the default global batch counts groups, not processes.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from multiproc import single_process_runs, step_records
from test_grpo_parity import GrpoWorkspace
from test_parity import assert_same_weights

from keel.distributed.parallel_dims import ParallelDims
from keel.train.rollout_rows import ScoredPrompts, join_parts, units_of_part
from keel.train.rollouts import RolloutBatchSource

EXACT = ("reward", "reward_std", "completions/mean_length", "completions/max_length")
CLOSE = ("loss", "grad_norm", "clip_ratio/region_mean")
# The workspace's reward (rewards.py:share_of_letter) that also appends each call's
# process and completion count to CALLS_FILE
COUNTED_REWARD = """
import json, os

def share_of_letter(completions, letter, **kwargs):
    with open({calls!r}, "a") as calls:
        calls.write(json.dumps([os.environ.get("RANK", "0"), len(completions)]) + "\\n")
    return [text.count(x) / max(len(text), 1) for text, x in zip(completions, letter)]
"""
CP2 = ("distributed.context_parallel=2",)
# case -> (strategy, overrides)
CASES = {
    # grpo's mean over each completion's tokens: with one prompt per micro-batch (its
    # completions laid out after the prompt, which is computed once) the cut falls inside a
    # completion, whose tokens the two parts share
    "lora-ddp-grpo-one-prompt": ("ddp", ("train.micro_batch_size=1",)),
    # the old log-probs of a reused rollout (gathered into whole rows), the batch-wide
    # reward std (one all-reduce the group's block enters once) and a frozen reference copy
    # sharded like the policy, scored on the same parts
    "full-fsdp-dapo-reused-batch-scaled-kl": (
        "fsdp",
        (
            "method.type=full",
            "grpo.loss_type=dapo",
            "grpo.num_iterations=2",
            "grpo.scale_rewards=batch",
            "grpo.beta=0.1",
        ),
    ),
    # units of 3 prompts over a block of 4: one process samples 3, the other 1; the
    # reference is the policy with its adapters off; gradient checkpointing
    "lora-fsdp-dr_grpo-units-of-3-kl-ckpt": (
        "fsdp",
        (
            "grpo.loss_type=dr_grpo",
            "grpo.generation_batch_prompts=3",
            "grpo.beta=0.1",
            "train.gradient_checkpointing=true",
        ),
    ),
}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, tiny_model_dir) -> GrpoWorkspace:
    return GrpoWorkspace(tmp_path_factory.mktemp("cp-grpo"), tiny_model_dir)


# A run of the reused case stopped after step 3, inside its second rollout's 2 steps, on
# one group of 2; resumed to step 4 on one process
REUSED = "full-fsdp-dapo-reused-batch-scaled-kl"
RESUMED = "resumed-on-1"
# Without train.global_batch_size: micro_batch_size x grad_accum x groups, not x processes
DEFAULT_BATCH = "default-batch"


def _counted_reward(workspace: GrpoWorkspace, name: str) -> tuple[str, Path]:
    """The override naming a copy of the workspace's reward that records its calls in a
    file of `name`'s, and that file."""
    calls = workspace.root / f"calls-{name}.jsonl"
    module = workspace.root / f"counted_{name.replace('-', '_')}.py"
    module.write_text(COUNTED_REWARD.format(calls=str(calls)))
    return f"grpo.rewards=[{module.name}:share_of_letter,rewards.py:logs_letters]", calls


@pytest.fixture(scope="module")
def groups_of_two(workspace) -> tuple[dict[str, Path], dict[str, list]]:
    """Each case's run on one group of 2 processes (one launch for all, with the stopped
    part of the resumed run), and each case's reward calls."""
    runs, calls = [], {}
    for case, (strategy, extra) in CASES.items():
        reward, calls[case] = _counted_reward(workspace, case)
        runs.append((case, (*CP2, *extra, reward, f"distributed.strategy={strategy}")))
    strategy, extra = CASES[REUSED]
    reward, _ = _counted_reward(workspace, RESUMED)
    stopped = (*CP2, *extra, reward, f"distributed.strategy={strategy}", "train.max_steps=3")
    default_batch = (*CP2, "train.global_batch_size=null", "train.micro_batch_size=1")
    default_batch += ("train.max_steps=1", "distributed.strategy=ddp")
    outputs = workspace.train_together([*runs, (RESUMED, stopped), (DEFAULT_BATCH, default_batch)])
    made = {
        case: [json.loads(line) for line in path.read_text().splitlines()]
        for case, path in calls.items()
    }
    return outputs, made


@pytest.fixture(scope="module")
def one_process(workspace):
    """case -> its 1-process run, made once for the module's tests."""
    run = single_process_runs(workspace)
    return lambda case: run(*CASES[case][1])


@pytest.mark.parametrize("case", CASES)
def test_a_group_of_two_samples_once_and_trains_like_one_process(
    workspace, groups_of_two, one_process, case
):
    outputs, calls = groups_of_two
    want, got = one_process(case), outputs[case]
    assert "1 group(s) of 2 processes (context parallel)" in workspace.outputs_together[case]
    _assert_steps_match(got, want, kl="kl" in case)
    # rank 0 logs the group's whole block: every prompt of the step, as one process does
    assert _completions(got) == _completions(want)
    # the group scored each completion once, both processes taking a share
    by_rank: dict[str, int] = {}
    for rank, count in calls[case]:
        by_rank[rank] = by_rank.get(rank, 0) + count
    rollouts = 2 if "reused" in case else 4
    assert sum(by_rank.values()) == rollouts * 4 * 4  # prompts x num_generations each
    assert set(by_rank) == {"0", "1"}
    assert_same_weights(got, want, atol=1e-3 if "full" in case else 1e-5)


def test_a_group_checkpoint_inside_a_rollout_resumes_on_one_process(
    workspace, groups_of_two, one_process
):
    """Step 4 trains on step 3's rollout: both processes of the group saved it (each whole,
    with its old log-probs); one process resumes on it as the uninterrupted run goes on."""
    reward, _ = _counted_reward(workspace, RESUMED)
    resumed = workspace.train(RESUMED, *CASES[REUSED][1], reward, "distributed.strategy=ddp")
    assert "resumed from" in workspace.last_output
    _assert_steps_match(resumed, one_process(REUSED), kl=True)


def test_the_default_global_batch_counts_groups_not_processes(workspace, groups_of_two):
    """A group reads one block of prompts: micro_batch_size 1 on one group of 2 is a global
    batch of 1 prompt (it was refused as not splitting over 2 processes)."""
    output = workspace.outputs_together[DEFAULT_BATCH]
    assert "global batch 1 rows over 1 group(s) of 2 processes" in output
    assert step_records(groups_of_two[0][DEFAULT_BATCH]).keys() == {1}


def _assert_steps_match(got: Path, want: Path, *, kl: bool) -> None:
    mine, theirs = step_records(got), step_records(want)
    assert mine.keys() == theirs.keys() == {1, 2, 3, 4}
    for step, line in theirs.items():
        for name in EXACT:
            assert mine[step][name] == line[name], (step, name)
        for name in CLOSE + (("kl",) if kl else ()):
            assert mine[step][name] == pytest.approx(line[name], rel=1e-4, abs=1e-6), (step, name)


def _completions(out: Path) -> list[tuple[int, str, float, dict]]:
    """Each logged sample: with what the reward functions logged for it (each process of a
    group logs for its part: joined with the completions, in block order)."""
    records = map(json.loads, (out / "completions.jsonl").read_text().splitlines())
    return [(r["step"], r["completion"], r["reward"], r["extra"]) for r in records]


# ---- a block sampled in parts, joined back --------------------------------------------


@pytest.mark.parametrize("unit", [1, 2, 3, 5])
@pytest.mark.parametrize("size", [2, 3])
def test_parts_sampled_by_unit_join_back_in_block_order(unit, size):
    block, group = [10, 11, 12, 13, 14], 2
    units = [block[i : i + unit] for i in range(0, len(block), unit)]
    parts = [_scored(units_of_part(units, rank, size), group) for rank in range(size)]
    assert sorted(row for part in parts for row in part.prompts) == block
    joined = join_parts(units, parts, group)
    want = _scored(block, group)
    assert joined.prompts == want.prompts
    assert joined.texts == want.texts
    assert torch.equal(joined.rewards, want.rewards)
    assert torch.equal(joined.scores, want.scores)


def _scored(prompts: list[int], group: int) -> ScoredPrompts:
    """Completion j of prompt p: text 'p/j', reward p + j / 10."""
    rewards = torch.tensor([p + j / 10 for p in prompts for j in range(group)])
    return ScoredPrompts(
        prompts=prompts,
        completions=[f"{p}/{j}" for p in prompts for j in range(group)],
        scores=rewards[:, None],
        rewards=rewards,
        advantages=rewards - 1,
        texts=[f"{p}/{j}" for p in prompts for j in range(group)],
        seconds=1.0,
    )


@pytest.mark.parametrize("rank", [1, 3])
def test_a_group_joins_its_own_processes_parts_among_every_process(rank):
    """4 processes as 2 groups of 2 (the gather is over every process): process 1 joins the
    parts of processes 0 and 1, process 3 those of 2 and 3, in their group order."""
    dims = ParallelDims(dp_replicate=2, dp_shard=1, world_size=4, cp=2)
    blocks = {0: [[10], [11], [12]], 1: [[20], [21], [22]]}  # units of 1 prompt
    parts = [
        _scored(units_of_part(blocks[dims.dp_rank(r)], dims.cp_rank(r), 2), 2) for r in range(4)
    ]
    gather = SimpleNamespace(dims=dims, dp_rank=dims.dp_rank(rank), gather_objects=lambda _: parts)
    units = blocks[dims.dp_rank(rank)]
    joined = RolloutBatchSource._joined(SimpleNamespace(group=2, dist=gather), units, parts[rank])
    want = _scored([row for unit in units for row in unit], 2)
    assert joined.prompts == want.prompts and joined.texts == want.texts
