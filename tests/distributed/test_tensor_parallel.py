"""Tensor parallelism (distributed.tensor_parallel 2): two processes that split every
decoder layer's heads and MLP columns compute what one process computes, step by step in
fp32 (1e-5 relative): the training and eval losses, and the final weights gathered from
the split shards. On 4 processes, 2 groups of 2 with FSDP2 over the groups, too.

The Qwen3 case is the one that fails without the per-head norms' gradient sum over the
group (its q_norm and k_norm see only their process's heads): its loss leaves the
single-process run's at step 5 and its q_norm weights by 0.07 after 6 steps.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_support import ROOT, keel_in_process
from conftest import write_grpo_inputs
from multiproc import (
    PREFERENCE_PAIRS,
    RUN_TIMEOUT_S,
    Workspace,
    _env,
    assert_same_last_eval_loss,
    eval_losses,
    single_process_runs,
    step_records,
    train_losses,
)
from test_parity import MERGED, assert_same_losses, assert_same_weights
from test_preference_parity import PAIR_METRICS, assert_same_metrics
from vlm_support import write_colour_dataset, write_tiny_qwen2_vl_dir

TP2 = ("distributed.tensor_parallel=2",)
QWEN3 = "qwen3-model"  # under the workspace: a tiny Qwen3 with the tiny model's tokenizer
PAIRS = "pairs.json"
QWEN2_VL = "qwen2-vl"  # a tiny Qwen2-VL, and colour questions about images (5 with one)
COLOURS = "colours.json"

# name -> overrides; the 2-process run adds TP2 (and distributed.strategy fsdp: tensor
# parallelism runs under FSDP2), the 1-process run is the same config without them
CASES = {
    "full": ("method.type=full",),
    # per-head norms, packed rows (keel's varlen attention on the process's heads) and
    # gradient checkpointing (each recomputed block splits again)
    "qwen3-full-packed-ckpt": (
        f"model.path={QWEN3}",
        "method.type=full",
        "data.packing=true",
        "train.gradient_checkpointing=true",
    ),
    # LoRA: lora_B split with its colwise layer, lora_A with its rowwise one, and the
    # adapter and the merged model written from the gathered shards
    "lora-merged": ("method.type=lora", *MERGED),
    # DPO with full fine-tuning: the frozen reference copy is split as the policy is, and
    # the pair metrics are summed once per group
    "dpo-full": ("train.stage=dpo", f"data.datasets.0.path={PAIRS}", "method.type=full"),
    # a vision-language model (Qwen2-VL): its language model splits, its vision tower and
    # projector (trained) stay whole on each process, their gradients averaged over dp
    "qwen2-vl-full-tower": (
        f"model.path={QWEN2_VL}",
        f"data.datasets.0.path={COLOURS}",
        "method.type=full",
        "model.vision.freeze_tower=false",
        "model.vision.freeze_projector=false",
        "train.lr=5e-3",
        "train.max_steps=3",
        "train.global_batch_size=4",
    ),  # fmt: skip
    # GRPO: the group generates its block together (the same completions on each process),
    # counts it once (the tallies, the window's reward std for batch scaling); dapo's
    # token count, a split reference copy for the KL and a rollout reused for 2 steps
    "grpo-dapo-full": (
        "train.stage=grpo",
        "data.datasets.0.path=prompts.jsonl",
        "data.cutoff_len=64",
        "train.global_batch_size=4",
        "train.max_steps=4",
        "data.val_size=0",
        "method.type=full",
        "train.lr=1e-3",
        "grpo.rewards=[rewards.py:share_of_letter]",
        "grpo.num_generations=4",
        "grpo.max_completion_length=6",
        "grpo.loss_type=dapo",
        "grpo.scale_rewards=batch",
        "grpo.beta=0.1",
        "grpo.num_iterations=2",
        "grpo.log_completions_every=1",
    ),  # fmt: skip
}
GRPO_EXACT = ("reward", "reward_std", "completions/mean_length", "completions/max_length")
# stopped after 4 of 6 steps on a tensor-parallel pair, finished on one process
RESUMED = "resume-tp-to-one"
STOPPED_AT_4 = ("train.max_steps=4",)


def _write_qwen3(model_dir: Path, out: Path) -> None:
    """A Qwen3 whose q_norm and k_norm weights are not all ones (so their gradients
    matter from the first step)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = AutoConfig.for_model(
        "qwen3", vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.add_(0.1 * torch.randn(norm.weight.shape))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, tiny_model_dir) -> Workspace:
    space = Workspace(tmp_path_factory.mktemp("tensor-parallel"), tiny_model_dir)
    _write_qwen3(tiny_model_dir, space.root / QWEN3)
    pairs = [{"prompt": q, "chosen": c, "rejected": r} for q, c, r in PREFERENCE_PAIRS]
    (space.root / PAIRS).write_text(json.dumps(pairs))
    write_grpo_inputs(space.root)  # prompts.jsonl, rewards.py
    write_tiny_qwen2_vl_dir(space.root / QWEN2_VL)
    write_colour_dataset(space.root)  # colours.json and its images
    return space


@pytest.fixture(scope="module")
def reference(workspace):
    return single_process_runs(workspace)


@pytest.fixture(scope="module")
def two_processes(workspace) -> dict[str, Path]:
    """Every tensor-parallel pair's run, in one launch: name -> output.dir."""
    runs = [
        (name, (*overrides, *TP2, "distributed.strategy=fsdp")) for name, overrides in CASES.items()
    ]
    runs.append((RESUMED, ("method.type=full", *TP2, *STOPPED_AT_4)))
    return workspace.train_together(runs)


@pytest.mark.parametrize("case", CASES)
def test_a_tensor_parallel_pair_matches_one_process(workspace, reference, two_processes, case):
    got, want = two_processes[case], reference(*CASES[case])
    summary = json.loads((got / "keel_run.json").read_text())
    assert (summary["processes"], summary["strategy"]) == (2, "fsdp")
    said = workspace.outputs_together[case]
    assert "tensor parallelism: 1 group(s) of 2 processes, each splitting every decoder" in said
    assert "over 1 group(s) of 2 processes (tensor parallel)" in said
    if "train.stage=grpo" in CASES[case]:
        _assert_grpo_like_one(got, want)
        return
    if "train.stage=dpo" in CASES[case]:
        # DPO's loss is a function of differences of sequence log-probs, whose round-off
        # (1e-5 of ~60) sets its scale; full fine-tuning at lr 1e-2 carries each step's
        # into the next, so the last eval loss agrees to 1e-4
        assert_same_metrics(got, want, (*PAIR_METRICS, "logps/chosen", "logps/rejected"))
        assert_same_last_eval_loss(got, want, 1e-4)
    else:
        assert_same_losses(train_losses(got), train_losses(want))
        assert_same_losses(eval_losses(got), eval_losses(want))
    # Adam turns the last bits of a near-zero gradient coordinate into a step: the
    # weights agree to 3e-5 after 6 steps that move them by ~0.05 (DPO's to 1.5e-4: its
    # gradients carry the log-probs' round-off, as under context parallelism)
    assert_same_weights(got, want, atol=1e-3 if "train.stage=dpo" in CASES[case] else 3e-5)
    if MERGED[0] in CASES[case]:
        assert_same_weights(got / "merged", want / "merged", atol=3e-5)


def _assert_grpo_like_one(got: Path, want: Path) -> None:
    """The same completions (so the same rewards and lengths, exactly), once each in the
    log, and the losses to fp32 round-off; the weights as full fine-tuning's."""
    mine, theirs = step_records(got), step_records(want)
    assert mine.keys() == theirs.keys() == {1, 2, 3, 4}
    for step, line in theirs.items():
        for name in GRPO_EXACT:
            assert mine[step][name] == line[name], (step, name)
        for name in ("loss", "grad_norm", "kl"):
            assert mine[step][name] == pytest.approx(line[name], rel=1e-5, abs=1e-7), (step, name)
    logged, alone = (
        [json.loads(x)["completion"] for x in (run / "completions.jsonl").read_text().splitlines()]
        for run in (got, want)
    )
    assert logged == alone and len(logged) == 4 * 4 * 4  # 4 steps of 4 prompts x 4
    assert_same_weights(got, want, atol=3e-5)


def test_a_run_stopped_on_a_tensor_parallel_pair_finishes_on_one_process(
    workspace, reference, two_processes
):
    """The distributed checkpoint of split and sharded weights and their optimizer state
    loads into one process's whole tensors."""
    resumed = workspace.train(RESUMED, "method.type=full")
    assert "resumed from" in workspace.last_output
    want = reference("method.type=full")
    assert_same_losses(train_losses(resumed), train_losses(want))
    assert_same_weights(resumed, want, atol=3e-5)


def test_two_tensor_parallel_groups_on_four_processes_match_one(workspace, reference):
    """A (dp 2, tp 2) mesh: each group reads its share of the rows, FSDP2 shards the split
    layers over the groups and averages their gradients over them only."""
    got = workspace.train("four", "method.type=full", *TP2, "distributed.strategy=fsdp", nproc=4)
    assert "tensor parallelism: 2 group(s) of 2 processes" in workspace.last_output
    want = reference("method.type=full")
    assert_same_losses(train_losses(got), train_losses(want))
    assert_same_losses(eval_losses(got), eval_losses(want))
    assert_same_weights(got, want, atol=3e-5)


def test_the_shipped_example_runs_on_a_tensor_parallel_pair(tiny_model_dir, tmp_path):
    """examples/sft_tensor_parallel.yaml, the tiny model (4 heads, 2 key-value heads) swapped
    in and split 2 ways: 2 steps, 1 group."""
    out = tmp_path / "out"
    command = [sys.executable, "-m", "keel", "train", "examples/sft_tensor_parallel.yaml"]
    command += [f"model.path={tiny_model_dir}", f"model.cache_dir={tmp_path / 'cache'}"]
    command += [f"output.dir={out}", "train.max_steps=2", "train.precision=fp32"]
    command += ["train.threads=1", "distributed.tensor_parallel=2", "--nproc", "2"]
    done = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=_env()
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "1 group(s) of 2 processes (tensor parallel)" in done.stdout + done.stderr
    assert list(train_losses(out)) == [1, 2]


def test_a_split_the_model_cannot_take_is_refused_before_the_data_is_read(tiny_model_dir, tmp_path):
    result = keel_in_process(
        "validate",
        "examples/sft_tensor_parallel.yaml",
        f"model.path={tiny_model_dir}",
        f"model.cache_dir={tmp_path / 'cache'}",
        cwd=ROOT,
    )
    assert result.returncode == 2
    said = result.stdout + result.stderr
    assert "distributed.tensor_parallel = 3: LlamaForCausalLM has num_attention_heads 4" in said
    assert not (tmp_path / "cache" / "data").exists()  # refused before tokenizing


def test_groups_that_do_not_divide_the_processes_are_refused_before_anything_starts(
    tiny_model_dir, tmp_path
):
    out = tmp_path / "out"
    result = keel_in_process(
        "train",
        "examples/sft_tensor_parallel.yaml",
        f"model.path={tiny_model_dir}",
        f"output.dir={out}",
        "distributed.tensor_parallel=2",
        cwd=ROOT,
    )
    assert result.returncode == 2
    assert "distributed.tensor_parallel = 2 does not divide the 1 processes" in result.stderr
    assert not out.exists()  # no output folder claimed, no data read
