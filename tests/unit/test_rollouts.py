"""The rollout batch source (keel.train.rollouts) on a tiny random model and a fake reward.

Data-parallel ranks are faked (a DistContext whose dims say rank r of 2, no process group:
its all-reduce is the identity), which is enough to check what each rank generates: the
sampling seeds depend on the prompt's row, never on the rank, so rank 1 of 2 samples
exactly the completions a 1-process run samples for the same prompts.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset

from keel import faults
from keel.distributed.parallel_dims import ParallelDims
from keel.distributed.process_group import DistContext
from keel.errors import CheckpointError, ConfigError
from keel.losses.grpo import group_advantages
from keel.precision import Precision
from keel.rewards import RewardFunction
from keel.stages.grpo import GrpoSettings
from keel.train import rollouts
from keel.train.batch_source import StepPlan
from keel.train.completions_log import CompletionsLog
from keel.train.grpo_objective import PolicyGradientObjective
from keel.train.loop import Trainer
from keel.train.rollout_rows import refuse_uneven_prompts, sample_seed
from keel.train.rollouts import RolloutBatchSource, RolloutContext
from tests.conftest import build_tiny_model

GROUP = 4
PROMPTS = ["Who are you?", "Name a color.", "Add 2 and 3.", "Say hello.", "Give a tip.", "Hi"]


def share_of_a(completions, **kwargs) -> list[float]:
    """The fake reward: the share of the completion's characters that are "a"."""
    return [text.count("a") / max(len(text), 1) for text in completions]


def prompt_rows(tokenizer) -> Dataset:
    """PROMPT rows as keel.data lays them (ids, prompt JSON, other columns JSON)."""
    return Dataset.from_list(
        [
            {
                "input_ids": tokenizer(text)["input_ids"],
                "num_targets": 0,
                "prompt": json.dumps(text),
                "columns": json.dumps({"answer": str(index)}),
            }
            for index, text in enumerate(PROMPTS)
        ]
    )


def make_source(
    tokenizer,
    *,
    rank=0,
    world=1,
    global_batch=4,
    micro=1,
    completions=None,
    reward=share_of_a,
    **settings,
) -> RolloutBatchSource:
    grpo = GrpoSettings(
        rewards=["share_of_a"],
        num_generations=GROUP,
        max_completion_length=5,
        **settings,
    )
    model = build_tiny_model(len(tokenizer), seed=1)
    objective = PolicyGradientObjective(model, settings=grpo)
    optimizer = torch.optim.SGD(objective.parameters(), lr=0.0)
    dims = ParallelDims(dp_replicate=world, dp_shard=1, world_size=world)
    trainer = Trainer(
        objective=objective,
        optimizer=optimizer,
        scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0),
        precision=Precision("fp32", "test"),
        device=torch.device("cpu"),
        pad_id=tokenizer.pad_token_id,
        max_grad_norm=0.0,
        dist=DistContext(rank=rank, world_size=world, dims=dims),
    )
    plan = StepPlan(
        num_rows=len(PROMPTS), global_batch=global_batch, micro_batch_size=micro, seed=7,
        shuffle=False,
    )  # fmt: skip
    context = RolloutContext(
        trainer=trainer,
        tokenizer=tokenizer,
        rewards=[RewardFunction(name="share_of_a", call=reward)],
        hang_limit=30.0,
        completions=completions,
    )
    return RolloutBatchSource(plan, prompt_rows(tokenizer), grpo, context)


def flat(batch) -> list[dict]:
    return [row for mb in batch.micro_batches for row in mb]


def test_rows_hold_prompt_then_completion_with_targets_on_the_completion(tiny_tokenizer):
    source = make_source(tiny_tokenizer)
    batch = source.batch(0)
    rows = flat(batch)
    assert len(rows) == 4 * GROUP and batch.rows == 4 * GROUP
    prompts = source.prompts
    for index, row in enumerate(rows):
        prompt = prompts[index // GROUP]["input_ids"]
        ids, targets = row["input_ids"], row["targets"]
        assert ids[: len(prompt)] == prompt and len(ids) > len(prompt)
        assert row["position_ids"] == list(range(len(ids)))
        completion = ids[len(prompt) :]
        assert targets == [-100] * (len(prompt) - 1) + completion + [-100]
        assert row["num_targets"] == len(completion) <= 5
        assert len(row["advantages"]) == 1 and "old_logps" not in row
    # grpo counts completions: the whole window's prompts x G
    assert batch.window_targets == 4 * GROUP
    assert batch.window_tokens == sum(len(row["input_ids"]) for row in rows)


def test_advantages_are_each_groups_rewards_normalised(tiny_tokenizer):
    source = make_source(tiny_tokenizer)
    rows = flat(source.batch(0))
    texts = [
        tiny_tokenizer.decode(row["input_ids"][len(source.prompts[i // GROUP]["input_ids"]) :],
                              skip_special_tokens=True)
        for i, row in enumerate(rows)
    ]  # fmt: skip
    rewards = torch.tensor(share_of_a(texts)).view(-1, GROUP)  # [P, G]
    expected = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)
    got = torch.tensor([row["advantages"][0] for row in rows]).view(-1, GROUP)
    torch.testing.assert_close(got, expected)


def test_metrics_of_the_step(tiny_tokenizer):
    batch = make_source(tiny_tokenizer).batch(0)
    metrics = batch.metrics
    for key in (
        "reward", "reward_std", "rewards/share_of_a/mean", "rewards/share_of_a/std",
        "frac_reward_zero_std", "completions/mean_length", "completions/max_length",
        "completions/clipped_ratio", "generation_tokens_per_s", "generation_seconds",
    ):  # fmt: skip
        assert key in metrics, key
    lengths = [row["num_targets"] for row in flat(batch)]
    assert metrics["completions/mean_length"] == pytest.approx(sum(lengths) / len(lengths))
    assert metrics["completions/max_length"] == max(lengths)
    assert metrics["reward"] == pytest.approx(metrics["rewards/share_of_a/mean"])


def test_rank_1_of_2_samples_what_one_process_samples(tiny_tokenizer):
    """Contiguous blocks, seeds by prompt row: the two ranks' rows are the 1-process rows."""
    one = flat(make_source(tiny_tokenizer, global_batch=4).batch(0))
    ranks = [make_source(tiny_tokenizer, rank=r, world=2, global_batch=4).batch(0) for r in (0, 1)]
    assert [len(b.micro_batches) for b in ranks] == [2, 2]  # 2 prompts each, micro-batch 1
    both = flat(ranks[0]) + flat(ranks[1])
    assert [row["input_ids"] for row in both] == [row["input_ids"] for row in one]
    assert [row["advantages"] for row in both] == [row["advantages"] for row in one]
    assert {b.window_targets for b in ranks} == {4 * GROUP}


def test_every_rank_gets_the_same_number_of_micro_batches(tiny_tokenizer):
    """A short last window (6 prompts, batch 4: 2 left, over 4 ranks) leaves rank 3 without
    prompts: it runs a filler micro-batch, as many as rank 0 runs real ones."""
    batches = [make_source(tiny_tokenizer, rank=r, world=4).batch(1) for r in (0, 3)]
    assert [len(b.micro_batches) for b in batches] == [1, 1]
    assert len(batches[0].micro_batches[0]) == GROUP and batches[1].micro_batches == [[]]
    filler = batches[1].filler
    assert filler["advantages"] == [0.0] and filler["num_targets"] == 1


def test_dapo_counts_the_completion_tokens_of_the_window(tiny_tokenizer):
    batch = make_source(tiny_tokenizer, loss_type="dapo").batch(0)
    assert batch.window_targets == sum(row["num_targets"] for row in flat(batch))


def test_masked_truncated_completions_are_weighed_zero(tiny_tokenizer):
    batch = make_source(tiny_tokenizer, mask_truncated_completions=True).batch(0)
    for row in flat(batch):  # targets kept (the loss still reaches the graph), weight 0
        assert row["kept"] == [0.0 if row["num_targets"] == 0 else 1.0]
        assert set(row["targets"]) != {-100}
    truncated = sum(row["num_targets"] == 0 for row in flat(batch))
    assert truncated > 0  # the case exists in this rollout
    assert batch.metrics["completions/clipped_ratio"] == pytest.approx(truncated / (4 * GROUP))


def test_num_iterations_reuses_the_rollout_with_old_logps(tiny_tokenizer, monkeypatch):
    calls = []
    real = rollouts.generate_groups
    monkeypatch.setattr(
        rollouts, "generate_groups", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    source = make_source(tiny_tokenizer, num_iterations=2, generation_batch_prompts=4)
    first, second = source.batch(0), source.batch(1)
    assert len(calls) == 1 and second.micro_batches is first.micro_batches
    assert second.metrics["generation_seconds"] == 0.0
    for row in flat(first):
        assert len(row["old_logps"]) == len(row["input_ids"])
        assert all(v == 0.0 for v, t in zip(row["old_logps"], row["targets"]) if t == -100)
        assert all(v < 0.0 for v, t in zip(row["old_logps"], row["targets"]) if t != -100)
    # the weights did not move (lr 0): the ratio is 1, nothing is clipped, loss = -mean(A)
    result = source.ctx.trainer.train_step(
        first.micro_batches,
        window_targets=first.window_targets,
        window_tokens=first.window_tokens,
        filler=first.filler,
    )
    assert [result.statistics[i].item() for i in (0, 2, 4)] == [0.0, 0.0, 0.0]
    source.batch(2)
    assert len(calls) == 2  # the next span generates again


def test_padding_free_old_logps_equal_the_padded_ones(tiny_tokenizer):
    """num_iterations 2 with padding-free micro-batches (each prompt computed once): the same
    completions, and each row's old log-probs back in its own layout, as padded rows give."""
    from keel.models.attention import VARLEN_ATTENTION, register_varlen_attention
    from keel.train.objective import use_attention

    settings = dict(num_iterations=2, generation_batch_prompts=4)
    padded = flat(make_source(tiny_tokenizer, micro=2, **settings).batch(0))
    source = make_source(tiny_tokenizer, micro=2, **settings)
    register_varlen_attention()
    use_attention(source.ctx.trainer.objective.model, VARLEN_ATTENTION)
    source.ctx.trainer.padding_free = True
    shared = flat(source.batch(0))
    assert [r["input_ids"] for r in shared] == [r["input_ids"] for r in padded]
    for got, want in zip(shared, padded):
        assert got["old_logps"] == pytest.approx(want["old_logps"], rel=1e-5, abs=1e-6)


def test_seeds_are_stable_and_rank_free():
    assert sample_seed(7, 0, 3) == sample_seed(7, 0, 3)
    assert len({sample_seed(7, 0, 3), sample_seed(7, 1, 3), sample_seed(7, 0, 4)}) == 3
    assert 0 <= sample_seed(2**40, 10**6, 10**9) < 2**62


def test_an_uneven_prompt_batch_is_refused_with_the_numbers():
    refuse_uneven_prompts("grpo", 8, 4)
    refuse_uneven_prompts("sft", 6, 4)  # rows, not prompts: a filler micro-batch evens them
    with pytest.raises(ConfigError, match="global_batch_size = 6 .* 4 data-parallel.* use 4 or 8"):
        refuse_uneven_prompts("grpo", 6, 4)


def test_state_names_the_rollout_and_refuses_another(tiny_tokenizer):
    source = make_source(tiny_tokenizer)
    state = source.state_dict()
    assert state["kind"] == "rollout" and state["rewards"] == ["share_of_a"]
    source.load_state_dict(state)
    with pytest.raises(CheckpointError, match="num_generations was 8"):
        source.load_state_dict({**state, "num_generations": 8})


def test_completions_log_writes_rank_0_samples_and_drops_later_steps(tiny_tokenizer, tmp_path):
    log = CompletionsLog(tmp_path, resume_step=0, every=2)
    source = make_source(tiny_tokenizer, global_batch=2, completions=log)
    for step in range(4):
        source.batch(step)
    records = [json.loads(line) for line in log.path.read_text().splitlines()]
    assert {r["step"] for r in records} == {2, 4} and len(records) == 2 * 2 * GROUP
    first = records[0]
    assert set(first) == {"step", "prompt", "completion", "rewards", "reward", "advantage"}
    assert first["prompt"] == PROMPTS[2] and "share_of_a" in first["rewards"]
    CompletionsLog(tmp_path, resume_step=3, every=2)  # a resume at step 3
    kept = [json.loads(line)["step"] for line in log.path.read_text().splitlines()]
    assert set(kept) == {2}


def test_rewards_run_in_a_watched_phase_and_generation_marks_progress(tiny_tokenizer):
    """A reward function that never returns is a hang the watchdog reports: each call runs
    in the phase "reward <name>" with the hang limit; each engine round is a progress mark."""
    seen = []

    def watched(completions, **kwargs):
        progress = source.ctx.trainer.progress
        seen.append(([name for name, _, _ in progress.phases], progress.phases[-1][1]))
        seen.append(progress.point)
        return share_of_a(completions)

    source = make_source(tiny_tokenizer, reward=watched)
    before = source.ctx.trainer.progress.point
    source.batch(0)
    (phases, limit), point = seen
    assert phases[-1] == "reward share_of_a" and limit == 30.0
    assert point - before > 5  # a mark per decode round (5 tokens each), and the phases'


def test_generation_faults_fire_after_the_rounds_of_their_step(tiny_tokenizer, monkeypatch):
    """KEEL_FAULT's generation kinds fire inside the rollout generation, after each engine
    round's progress mark (a rank stuck there is reported at a generation round), on their
    step and rank only: slow_generation after every round, hang_generation once."""
    source = make_source(tiny_tokenizer)
    progress = source.ctx.trainer.progress
    slept, hung = [], []
    sleep = lambda seconds: slept.append((seconds, progress.where, progress.step))  # noqa: E731
    monkeypatch.setattr(faults, "time", SimpleNamespace(sleep=sleep))
    monkeypatch.setattr(faults, "_sleep_forever", lambda: hung.append(progress.where))
    rounds = []
    mark = progress.mark
    monkeypatch.setattr(progress, "mark", lambda where: (rounds.append(where), mark(where)))
    source.ctx.fault = faults.fault_from_env({"KEEL_FAULT": "slow_generation:2:0:0.25"})
    for step in range(3):
        progress.step_begin(step + 1)
        source.batch(step)
    in_step_2 = rounds.index("step begin", rounds.index("step begin") + 1)
    count = rounds[in_step_2 : rounds.index("step begin", in_step_2 + 1)].count("generation round")
    assert count > 5 and slept == [(0.25, "generation round", 2)] * count
    source.ctx.fault = faults.fault_from_env({"KEEL_FAULT": "hang_generation:4:0"})
    progress.step_begin(4)
    source.batch(3)
    assert hung == ["generation round"]
    source.ctx.fault = faults.fault_from_env({"KEEL_FAULT": "hang_generation:5:1"})
    progress.step_begin(5)
    source.batch(4)
    assert hung == ["generation round"]  # another rank's


def test_batch_scaled_advantages_use_every_ranks_rewards(tiny_tokenizer):
    """scale_rewards batch: the std is over the whole window (all ranks), so rank 1 of 2 gets
    the advantages one process computes for its completions, bit for bit."""
    window = 4  # prompts
    rewards = torch.tensor([0.1, 0.9, 0.3, float("nan"), 0.5, 0.2, 0.8, 0.4] * 2)  # [4 x G=4]
    assert rewards.numel() == window * GROUP
    one = make_source(tiny_tokenizer, scale_rewards="batch")
    want = one._batch_scaled(rewards, window)
    half = rewards.numel() // 2
    sources = [make_source(tiny_tokenizer, rank=r, world=2, scale_rewards="batch") for r in (0, 1)]
    sent = {}
    for rank, source in enumerate(sources):  # record what each rank contributes
        source.dist.all_reduce_sum = lambda values, rank=rank: sent.setdefault(rank, values)
        source._batch_scaled(rewards[rank * half : (rank + 1) * half], window)
    for rank, source in enumerate(sources):  # then the all-reduce, as the ranks would see it
        source.dist.all_reduce_sum = lambda values: [a + b for a, b in zip(sent[0], sent[1])]
        got = source._batch_scaled(rewards[rank * half : (rank + 1) * half], window)
        assert torch.equal(got, want[rank * half : (rank + 1) * half])
    assert not torch.equal(want, group_advantages(rewards[:half], GROUP, scale="batch").repeat(2))
