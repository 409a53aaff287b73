"""N processes compute what one process computes: step by step, fp32, 1e-5 relative.

Each case runs `keel train --nproc 2` and compares training loss, eval loss and the final
weights with a single-process run of the same config. The data gives an uneven last
window (1 row for 2 processes), so the filler path runs in every case.
"""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import torch
from moe_support import write_mxfp4_gpt_oss
from multiproc import RUN_TIMEOUT_S, Workspace, eval_losses, single_process_runs, train_losses
from safetensors.torch import load_file

REL = 1e-5
PACK_AND_CHECKPOINT = ("data.packing=true", "train.gradient_checkpointing=true")
MERGED = ("output.merge_lora=true",)


def assert_same_losses(got: dict[int, float], want: dict[int, float]) -> None:
    assert got.keys() == want.keys()
    for step in want:
        assert abs(got[step] - want[step]) <= REL * abs(want[step]), (step, got[step], want[step])


def assert_same_weights(got_dir, want_dir, atol: float = 1e-5) -> None:
    name = (
        "adapter_model.safetensors"
        if (want_dir / "adapter_model.safetensors").is_file()
        else "model.safetensors"
    )
    got, want = load_file(got_dir / name), load_file(want_dir / name)
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-4, atol=atol, msg=key)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, tiny_model_dir) -> Workspace:
    space = Workspace(tmp_path_factory.mktemp("dist"), tiny_model_dir)
    _write_untied(tiny_model_dir, space.root / UNTIED)
    _write_start_adapter(tiny_model_dir, space.root / START_ADAPTER)
    _write_moe(tiny_model_dir, space.root / MOE)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    write_mxfp4_gpt_oss(space.root / GPT_OSS, tokenizer, seed=5)
    return space


UNTIED = "untied-model"  # under the workspace, which every run starts in
START_ADAPTER = "start-adapter"  # a LoRA adapter of the tiny model that runs keep training
MOE = "moe-model"  # a tiny Qwen3-MoE with the tiny model's tokenizer
GPT_OSS = "gpt-oss-mxfp4"  # a tiny gpt-oss, its experts in MXFP4 as the Hub's checkpoints


def _write_moe(model_dir: Path, out: Path) -> None:
    """A Qwen3-MoE of 4 experts (2 per token) saved as its checkpoints are, one tensor per
    expert: 2 processes under FSDP2 each read and stack 2 of a layer's experts."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = AutoConfig.for_model(
        "qwen3_moe", vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    tokenizer.save_pretrained(out)


def _write_start_adapter(model_dir: Path, out: Path) -> None:
    """A LoRA adapter (r 4, alpha 8, every linear layer, as the workspace's config) with
    random A and B: a run that starts from it starts away from the base."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    get_peft_model(model, config).save_pretrained(out)


def _write_untied(model_dir: Path, out: Path) -> None:
    """The tiny model with an output layer of its own (a copy of the embeddings, moved off
    them): under FSDP2 its embeddings are then a unit of their own."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    tied = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tied.config.tie_word_embeddings = False
    untied = LlamaForCausalLM(tied.config)
    untied.load_state_dict(tied.state_dict())
    with torch.no_grad():
        untied.lm_head.weight.add_(0.01 * torch.randn(untied.lm_head.weight.shape))
    untied.save_pretrained(out)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)


@pytest.fixture(scope="module")
def reference(workspace):
    """Single-process runs, one per distinct config, shared by the tests that need them."""
    return single_process_runs(workspace)


CASES = {
    "ddp-lora": ("ddp", "lora", ()),
    "fsdp-full": ("fsdp", "full", ()),
    "fsdp-lora": ("fsdp", "lora", ()),
    "ddp-full-packed-ckpt": ("ddp", "full", PACK_AND_CHECKPOINT),
    # DoRA: each process starts its magnitudes' rows from the weight rows it holds
    "fsdp-dora-packed-ckpt-merged": (
        "fsdp",
        "lora",
        ("method.lora.dora=true", *PACK_AND_CHECKPOINT, *MERGED),
    ),
    # OFT: each process holds its rows of every layer's rotation blocks (and computes
    # the blocks' index buffers, which no checkpoint holds)
    "fsdp-oft-packed-ckpt-merged": (
        "fsdp",
        "oft",
        ("method.oft.block_size=16", *PACK_AND_CHECKPOINT, *MERGED),
    ),
    # PiSSA: each process decomposes the whole weight it reads (the singular pairs' signs
    # fixed, so all agree) and keeps its rows of W_res, A and B; the saved adapter is the
    # converted rank-2r LoRA, merged on the original base
    "fsdp-lora-pissa-merged": ("fsdp", "lora", ("method.lora.init=pissa", *MERGED)),
    # NF4 base: each process quantises its rows to what one process quantises
    "ddp-qlora": ("ddp", "qlora", ()),
    "fsdp-qlora-packed-ckpt-merged": ("fsdp", "qlora", PACK_AND_CHECKPOINT + MERGED),
    # LoRA started from a saved adapter: each process reads its shards of the adapter's weights
    "fsdp-lora-from-adapter": ("fsdp", "lora", (f"model.adapter={START_ADAPTER}",)),
    # the embeddings and the output layer trained in full beside LoRA (each sharded in a
    # unit of its own with its frozen original), LoRA+'s groups and rsLoRA's scale
    "fsdp-lora-untied-full-modules-merged": (
        "fsdp",
        "lora",
        (
            f"model.path={UNTIED}",
            "method.lora.modules_to_save=[embed_tokens, lm_head]",
            "method.lora.plus_lr_ratio=4",
            "method.lora.rslora=true",
            *MERGED,
        ),
    ),
    # tokens added to the vocabulary: each process fills its rows of the grown embeddings
    # (tied to the output layer), which train in full beside LoRA
    "fsdp-lora-added-tokens-merged": (
        "fsdp",
        "lora",
        ("model.add_tokens=[<think>]", "model.add_special_tokens=[<tool>]", *MERGED),
    ),
    # a mixture of experts: each process loads and trains its half of every layer's experts
    "fsdp-moe-full": ("fsdp", "full", (f"model.path={MOE}",)),
    # QLoRA with the experts in NF4 too: each process quantises its rows of every expert
    # weight with the whole weight's absmax mean
    "fsdp-moe-qlora-experts": (
        "fsdp",
        "qlora",
        (f"model.path={MOE}", "method.qlora.quantize_experts=true"),
    ),
    # LoRA on the routed experts too (PEFT's target_parameters, rank r per expert): each
    # process holds its rows of the experts and of their LoRA weights, merged on rank 0
    "fsdp-moe-lora-experts-merged": (
        "fsdp",
        "lora",
        (
            f"model.path={MOE}",
            "method.lora.target_parameters=[experts.gate_up_proj, experts.down_proj]",
            *MERGED,
        ),
    ),
    # gpt-oss from an MXFP4 checkpoint: each process dequantizes the experts it holds
    "fsdp-gpt-oss-mxfp4-full": ("fsdp", "full", (f"model.path={GPT_OSS}",)),
    # QAT (int8 activations per token, int4 weights per group of 32): each process rounds
    # the gathered weights and its tokens as one process rounds them. One step, no eval:
    # rounding is discontinuous, so the 1e-7 the processes' sums differ by after a step
    # flips some int8 activation a level (1e-4 in the loss) in later forwards
    "fsdp-full-qat": (
        "fsdp",
        "full",
        ("method.qat.scheme=int8-int4", "train.max_steps=1", "data.val_size=0"),
    ),
    # each token's cross-entropy weighted by the model's top-k entropy (packed rows): the
    # weighted sums and the unweighted ce_loss beside them reduced over processes
    "fsdp-full-eaft-packed": (
        "fsdp",
        "full",
        ("train.token_weighting=eaft", "train.eaft_top_k=8", "data.packing=true"),
    ),
    # Muon: each process gathers every matrix's update, orthogonalises the whole and keeps
    # its rows. One step, no eval: Newton-Schulz runs in bf16 and multiplies the smallest
    # singular directions ~450-fold, so the last bits the processes' gradient sums differ by
    # reach the update (2.3e-4 on a few elements of a 2e-3 step; test_muon_fsdp checks the
    # gather bit for bit on equal inputs)
    "fsdp-full-muon": (
        "fsdp",
        "full",
        ("train.optimizer=muon", "train.max_steps=1", "data.val_size=0"),
    ),
    # streamed data (data.streaming): each process reads the whole stream and takes its share
    # of every step's 5 rows, which run across the 12-row epochs
    "ddp-lora-streaming": ("ddp", "lora", ("data.streaming=true", "data.val_size=0")),
    # freeze by parameter patterns: FSDP2 units that hold trained and frozen weights together
    "fsdp-freeze-patterns": (
        "fsdp",
        "freeze",
        (
            "method.freeze.trainable_layers=0",
            r"method.freeze.trainable_params=['model\.layers\.0\.mlp\.', "
            r"'.*\.1\.self_attn\.q_proj', 'model\.norm']",
        ),
    ),
}


def _overrides(case: str) -> tuple[str, ...]:
    strategy, method, extra = CASES[case]
    return (f"method.type={method}", *extra, f"distributed.strategy={strategy}")


# Stopped after 4 of 6 steps (FSDP2) on one number of processes, finished on the other:
# (method, what the first part runs on, what the rest runs on)
RESUMES = {"resume-2-to-1": ("full", 2, 1), "resume-1-to-2": ("lora", 1, 2)}
STOPPED_AT_4 = ("train.max_steps=4",)
# A run long enough to kill a worker in it (test_killed_worker_...), and its clean twin
KILLED_RUN = ("train.max_steps=45", "output.save_every=9", "distributed.strategy=ddp")


def _resume_overrides(name: str) -> tuple[str, ...]:
    return (f"method.type={RESUMES[name][0]}", "distributed.strategy=fsdp")


@pytest.fixture(scope="module")
def two_processes(workspace) -> dict[str, Path]:
    """Every 2-process run of the module but the killed one, made together in one launch:
    name -> output.dir. The resumes' 1-process first parts run before it, their 1-process
    ends in the test."""
    runs = [(case, _overrides(case)) for case in CASES]
    for name, (_method, first, _then) in RESUMES.items():
        if first == 1:
            workspace.train(name, *_resume_overrides(name), *STOPPED_AT_4)
        runs.append((name, _resume_overrides(name) + (STOPPED_AT_4 if first == 2 else ())))
    runs.append(("not-killed", KILLED_RUN))
    return workspace.train_together(runs)


@pytest.mark.parametrize("case", CASES)
def test_two_processes_match_one(workspace, reference, two_processes, case):
    strategy, method, extra = CASES[case]
    want = reference(*_overrides(case)[:-1])
    got = two_processes[case]
    summary = json.loads((got / "keel_run.json").read_text())
    assert summary["processes"] == 2 and summary["strategy"] == strategy
    assert len(summary["per_rank"]) == 2
    assert_same_losses(train_losses(got), train_losses(want))
    assert_same_losses(eval_losses(got), eval_losses(want))
    if "train.token_weighting=eaft" in extra:
        ce_got, ce_want = (_ce_losses(run) for run in (got, want))
        assert ce_want and ce_got.keys() == train_losses(got).keys()
        assert_same_losses(ce_got, ce_want)
        assert all(train_losses(want)[step] < ce_want[step] for step in ce_want)
    # An expert few tokens reach has gradients near 0, whose sign the order of the sums
    # decides and which Adam scales up to full steps: weights agree to 3e-5 after 6 steps
    # that move them by 0.06 (a rank that trained the wrong experts would be off by that).
    moe = f"model.path={MOE}" in extra
    # gpt-oss: one embedding element lands 1.2e-4 apart after moving 0.04 (Adam turns the
    # last bits of a near-zero coordinate into a step); a process that dequantized the wrong
    # experts would be off in the losses, checked to 1e-5 from the first step
    gpt_oss = f"model.path={GPT_OSS}" in extra
    muon = "train.optimizer=muon" in extra
    assert_same_weights(
        got, want, atol=1e-3 if gpt_oss else 5e-4 if muon else 1e-4 if moe else 1e-5
    )
    if MERGED[0] in extra:  # merged from gathered shards on rank 0
        assert_same_weights(got / "merged", want / "merged")
    if f"model.path={MOE}" in extra and method == "full":  # saved as its checkpoints are
        assert "model.layers.1.mlp.experts.3.up_proj.weight" in load_file(got / "model.safetensors")


def _ce_losses(out: Path) -> dict[int, float]:
    """step -> ce_loss (the unweighted cross-entropy of a token-weighted run)."""
    records = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["ce_loss"] for r in records if "ce_loss" in r}


@pytest.mark.parametrize("name", RESUMES)
def test_resume_with_another_number_of_processes(workspace, reference, two_processes, name):
    """Stop after 4 of 6 steps on some processes, finish on another number: the same as
    an uninterrupted run."""
    method, _first, then = RESUMES[name]
    if then == 1:
        resumed = workspace.train(name, *_resume_overrides(name))
        assert "resumed from" in workspace.last_output
    else:
        resumed = two_processes[name]
        assert "resumed from" in workspace.outputs_together[name]
    want = reference(f"method.type={method}")
    assert_same_losses(train_losses(resumed), train_losses(want))
    assert_same_weights(resumed, want)


def _workers(launcher: psutil.Process) -> list[psutil.Process]:
    found = []
    for child in launcher.children(recursive=True):
        try:
            cmd = " ".join(child.cmdline())
        except psutil.NoSuchProcess:
            continue
        if "keel" in cmd and "torch.distributed.run" not in cmd and "torchrun" not in cmd:
            found.append(child)
    return found


def test_hsdp_on_four_processes_matches_one(workspace, reference):
    """distributed.fsdp.shard_size 2 on 4 processes: 2 copies of the model, each sharded
    over 2 processes (FSDP2 over a replicate x shard mesh), trained as one process trains."""
    got = workspace.train(
        "hsdp-lora-merged", "method.type=lora", *MERGED, "distributed.strategy=fsdp",
        "distributed.fsdp.shard_size=2", nproc=4,
    )  # fmt: skip
    assert "HSDP: 2 copies, each sharded over 2 processes" in workspace.last_output
    want = reference("method.type=lora", *MERGED)
    assert json.loads((got / "keel_run.json").read_text())["processes"] == 4
    assert_same_losses(train_losses(got), train_losses(want))
    assert_same_losses(eval_losses(got), eval_losses(want))
    assert_same_weights(got, want)
    assert_same_weights(got / "merged", want / "merged")


def test_killed_worker_is_restarted_and_the_run_finishes_the_same(workspace, two_processes):
    """A worker SIGKILLed mid-run under --max-restarts 1: torchrun restarts the job, keel
    resumes from the newest complete checkpoint, and every loss matches a clean run.

    The clean run has 2 processes too: 45 steps are enough for float rounding to drift
    past 1e-5 between 1 and 2 processes, while resuming must reproduce the run exactly."""
    out = workspace.root / "killed"
    args = workspace.command(out, *KILLED_RUN, "--nproc", "2", "--max-restarts", "1")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    proc = subprocess.Popen(
        args,
        cwd=workspace.root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        checkpoint = out / "checkpoints/step-00000009/meta.json"
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not checkpoint.exists():
            assert proc.poll() is None, proc.stdout.read()[-4000:]
            assert time.monotonic() < deadline, "no checkpoint appeared"
            time.sleep(0.02)
        assert not (out / "keel_run.json").exists(), "finished before it could be killed"
        victim = _workers(psutil.Process(proc.pid))[-1]
        victim.send_signal(signal.SIGKILL)
        output, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output[-4000:]
    assert "resumed from" in output
    want = two_processes["not-killed"]
    assert_same_losses(train_losses(out), train_losses(want))
    final = [json.loads((d / "keel_run.json").read_text())["final_loss"] for d in (out, want)]
    assert final[0] == pytest.approx(final[1], rel=1e-6)
