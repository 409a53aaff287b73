"""Context parallelism for the preference stages and rm: a group of 2 processes, each
holding part of every micro-batch's tokens, trains as one process on the whole rows.

A preference loss reads each sequence's log-prob, a sum over its tokens that the group's
processes add up from their parts (keel.distributed.context_parallel.group_sum); rm's
score is read at a sequence's last token, by the process holding it, and added up the same
way. Every process then computes the same loss and weighs it 1/2. Each case compares every step's
loss and metrics, the grad norms (a gradient summed over the wrong processes trains the
same under Adam, but not with the same norm), the eval loss and the final weights.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.multiprocessing as mp
from multiproc import free_port
from test_context_parallel import grad_norms
from test_parity import assert_same_weights
from test_preference_parity import (
    KTO,
    PAIR_METRICS,
    PreferenceWorkspace,
    assert_same_metrics,
)

from keel.distributed.context_parallel import shard_tokens
from keel.distributed.process_group import exit_now, shutdown
from keel.stages.rm import RM_METRICS

CP2 = ("distributed.context_parallel=2",)
KTO_METRICS = ("loss", "kl", "rewards/chosen", "rewards/rejected")
# case -> (overrides, strategy, metrics compared)
CASES = {
    # LoRA: the reference is the policy with its adapters off, on the same parts
    "dpo-lora-ddp-packed": (("data.packing=true",), "ddp", PAIR_METRICS),
    # full: a frozen copy of the base, sharded like the policy, scores the same parts
    "dpo-full-fsdp-copy": (("method.type=full",), "fsdp", PAIR_METRICS),
    # precompute: the pass before training runs split too, and one process of each group
    # writes the cache
    "dpo-full-precompute": (("method.type=full", "dpo.reference=precompute"), "fsdp", PAIR_METRICS),
    "orpo-lora-fsdp-ckpt": (
        ("train.stage=orpo", "train.gradient_checkpointing=true"),
        "fsdp",
        (*PAIR_METRICS, "nll_loss", "log_odds_ratio"),
    ),
    "simpo-lora-ddp-packed": (("train.stage=simpo", "data.packing=true"), "ddp", PAIR_METRICS),
    # a score at each sequence's last token: the process holding it scores it
    "rm-lora-ddp-packed": (
        ("train.stage=rm", "data.packing=true"),
        "ddp",
        ("loss", *RM_METRICS),
    ),
    # one sample per micro-batch: the first part is often all prompt (no target token),
    # and still runs the group's backward exchanges and uses every weight DDP waits for
    "kto-freeze-ddp-copy": (
        (*KTO, "method.type=freeze", "method.freeze.trainable_layers=1"),
        "ddp",
        KTO_METRICS,
    ),
}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, tiny_model_dir) -> PreferenceWorkspace:
    return PreferenceWorkspace(tmp_path_factory.mktemp("cp-preference"), tiny_model_dir)


def _one_sample_micro_batches(case: str) -> tuple[str, ...]:
    return ("train.micro_batch_size=1",) if case.startswith("kto") else ()


@pytest.fixture(scope="module")
def groups_of_two(workspace) -> dict:
    runs = [
        (case, (*CP2, *extra, *_one_sample_micro_batches(case), f"distributed.strategy={how}"))
        for case, (extra, how, _names) in CASES.items()
    ]
    return workspace.train_together(runs)


@pytest.mark.parametrize("case", CASES)
def test_a_group_of_two_splitting_tokens_matches_one_process(workspace, groups_of_two, case):
    extra, _strategy, names = CASES[case]
    want = workspace.train(f"{case}-one", *extra, *_one_sample_micro_batches(case))
    got = groups_of_two[case]
    output = workspace.outputs_together[case]
    assert "1 group(s) of 2 processes (context parallel)" in output
    assert_same_metrics(got, want, (*names, "logps/chosen", "logps/rejected"))
    _assert_close(grad_norms(got), grad_norms(want))
    _assert_close(_eval_losses(got), _eval_losses(want))
    # Full fine-tuning: Adam at lr 1e-2 turns round-off in small gradients into updates;
    # plain 2-process data parallelism ends 4e-4 from one process here too
    assert_same_weights(got, want, atol=1e-3 if "full" in case else 1e-5)
    if "precompute" in case:
        assert "reference log-probs: one pass" in output
        cache = json.loads(next(workspace.root.rglob("complete.json")).read_text())
        assert len(cache["files"]) == len(set(cache["files"])) == 2  # train, eval; once each


def _assert_close(got: dict[int, float], want: dict[int, float]) -> None:
    """Grad norms or eval losses, step by step, to 1e-4: full fine-tuning at lr 1e-2 carries
    each step's fp32 round-off (of log-probs summed in another order) into the next step's
    weights (5e-5 by step 6); a sum over the wrong processes is off by 2x."""
    assert got.keys() == want.keys() and want
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-4), step


def _eval_losses(out) -> dict[int, float]:
    records = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}


# ---- the sequence sums on one row, each process holding a part ----------------------

PROMPT, ANSWER = 11, 3  # one sample: its first part (7 of 14 tokens) is all prompt


def _sample_row() -> dict:
    torch.manual_seed(3)
    tokens = PROMPT + ANSWER
    ids = torch.randint(3, 50, (1, tokens))
    targets = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)
    targets[:, : PROMPT - 1] = -100  # the answer's tokens are the targets
    return {
        "input_ids": ids,
        "position_ids": torch.arange(tokens)[None],
        "targets": targets,
        "seq_lens": (tokens,),
        "sequence_index": torch.zeros((1, tokens), dtype=torch.long),
        "labels": torch.ones(1, dtype=torch.long),
    }


def _sums_worker(rank: int, world: int, port: int, out: str) -> None:
    from test_context_parallel import _model, one_group

    from keel.train.preference import score_sequences

    ctx = one_group(rank, world, port)
    seen = {}
    for fast_head in (True, False):
        model = _model(2)
        row = _sample_row()
        whole = score_sequences(model, row, fast_head=fast_head, chunk_size=4)
        whole.sums.sum().backward()
        want = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        part = shard_tokens(row, ctx.cp_rank, world, pad_id=0) | {"cp_group": ctx.cp_group}
        seen[f"targets-{fast_head}"] = int((part["targets"] != -100).sum())
        mine = score_sequences(model, part, fast_head=fast_head, chunk_size=4)
        (mine.sums.sum() / world).backward()  # each process weighs the same loss 1/C
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        for grad in grads.values():  # what DDP adds up over the group
            torch.distributed.all_reduce(grad, group=ctx.cp_group)
        seen[f"sums-{fast_head}"] = (mine.sums - whole.sums).abs().max().item()
        seen[f"counts-{fast_head}"] = mine.counts.tolist() == whole.counts.tolist()
        seen[f"grads-{fast_head}"] = max((grads[n] - want[n]).abs().max().item() for n in want)
        seen[f"head-used-{fast_head}"] = model.lm_head.weight.grad is not None
    with open(f"{out}.{rank}", "w") as f:
        json.dump(seen, f)
    shutdown(ctx)
    exit_now(0)


def test_a_sequence_split_over_two_processes_gives_its_log_prob_and_gradients(tmp_path):
    out = str(tmp_path / "seen")
    mp.spawn(_sums_worker, args=(2, free_port(), out), nprocs=2)
    seen = [json.loads(open(f"{out}.{rank}").read()) for rank in range(2)]
    for fast_head in (True, False):
        assert [s[f"targets-{fast_head}"] for s in seen] == [0, ANSWER]
        for rank in range(2):
            assert seen[rank][f"sums-{fast_head}"] < 1e-5
            assert seen[rank][f"counts-{fast_head}"]
            assert seen[rank][f"grads-{fast_head}"] < 1e-5
            # the part without targets still reaches the output layer (DDP waits for it)
            assert seen[rank][f"head-used-{fast_head}"]


def test_shard_tokens_cuts_kto_mismatched_sequences_and_their_index():
    row = _sample_row()
    batch = row | {f"kl_{k}": v for k, v in row.items() if k != "labels"}
    batch["kl_input_ids"] = batch["kl_input_ids"][:, :9]  # 9 tokens: padded to 10
    for key in ("targets", "position_ids", "sequence_index"):
        batch[f"kl_{key}"] = batch[f"kl_{key}"][:, :9]
    batch["kl_seq_lens"] = (9,)
    parts = [shard_tokens(batch, rank, 2, pad_id=0) for rank in range(2)]
    assert [p["kl_input_ids"].shape[1] for p in parts] == [5, 5]
    assert parts[0]["kl_seq_lens"] == (9, 1)
    assert parts[1]["sequence_index"][0, -1] == 0  # 14 tokens: no padding
    assert parts[1]["kl_sequence_index"][0, -1] == -1  # the pad belongs to no sequence
    assert parts[1]["kl_targets"][0, -1] == -100
    assert torch.equal(parts[0]["labels"], row["labels"])  # per sequence: whole
