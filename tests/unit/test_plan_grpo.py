"""`keel plan` for the stages that generate (grpo) or score (rm): the generation KV cache,
logits row and FSDP2 replica, the reference copy, group-sized training rows, no LM-head
logits for a reward model; each term by hand on a tiny Llama (config.json only)."""

import json
from pathlib import Path

import yaml
from test_plan import SMALL

from keel.cli import main
from keel.config import load_config
from keel.plan import decide, detect_devices, plan_run
from keel.plan.devices import GIB

LAYERS, KV_HEADS, HEAD_DIM, VOCAB = 4, 4, 256 // 8, 8192  # test_plan's SMALL Llama, by hand
FP32 = 4  # train.precision fp32: weights, KV cache and logits all 4 bytes an element
GRPO = ("train.stage=grpo", "grpo.rewards=[keel.rewards:format]")


def write_config(root: Path, method: str = "full") -> Path:
    model_dir = root / "small"
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(SMALL))
    cfg = {
        "model": {"path": str(model_dir)},
        "method": {"type": method},
        "data": {"datasets": ["never-read.json"], "cutoff_len": 128},
        "train": {"precision": "fp32", "micro_batch_size": 1},
        "output": {"dir": str(root / "out")},
    }
    path = root / f"{method}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def plan_of(root: Path, *overrides: str, method: str = "full", gpus: int = 1, memory="24GiB"):
    cfg = load_config(write_config(root, method), list(overrides))
    return plan_run(cfg, devices=detect_devices(gpus=gpus, memory=memory))


def option(plan, strategy: str = "single", method: str = "full", checkpointing=False):
    return plan.option_for(strategy, method, checkpointing)


def kv_by_hand(tokens: int, sequences: int, itemsize: int = FP32) -> int:
    return 2 * LAYERS * KV_HEADS * HEAD_DIM * itemsize * tokens * sequences


def test_each_generation_term_by_hand(tmp_path):
    """KV cache: 2 x layers x kv heads x head_dim x bytes x (cutoff_len + completion) x
    prompts generated together x group; logits: [sequences x vocab] fp32; one device: no
    replica. Training rows: micro_batch_size x group sequences of prompt + completion, the
    same activations and logits as sft on that many rows of that length."""
    plan = plan_of(
        tmp_path,
        *GRPO,
        "grpo.num_generations=4",
        "grpo.max_completion_length=64",
        "grpo.generation_batch_prompts=3",
    )
    grpo = option(plan)
    g = grpo.generation
    assert g.kv_cache == kv_by_hand(128 + 64, 3 * 4) == 4096 * 192 * 12
    assert g.logits == FP32 * 12 * VOCAB
    assert g.replica == 0
    assert grpo.per_device.generation == g.kv_cache + g.logits
    # 1 prompt x 4 completions of 128 + 64 tokens train like sft's 4 rows of 192
    sft = option(plan_of(tmp_path, "data.cutoff_len=192", "train.micro_batch_size=4"))
    assert sft.generation is None and sft.per_device.generation == 0
    assert grpo.per_device.activations == sft.per_device.activations
    assert grpo.per_device.logits == sft.per_device.logits
    assert grpo.per_device.params == sft.per_device.params  # beta 0: no reference
    # Generation comes before training: the step's peak is the larger phase, not the sum
    assert grpo.per_device.total == sft.per_device.total
    big = option(
        plan_of(
            tmp_path,
            *GRPO,
            "grpo.num_generations=4",
            "grpo.max_completion_length=64",
            "grpo.generation_batch_prompts=256",
        )
    )
    fixed = big.per_device.params + big.per_device.optimizer + big.per_device.overhead
    assert big.per_device.total == fixed + big.per_device.generation
    assert big.per_device.generation == kv_by_hand(192, 1024) + FP32 * 1024 * VOCAB


def test_kv_cache_grows_linearly_with_group_and_completion_length(tmp_path):
    def kv(group: int, completion: int) -> int:
        plan = plan_of(
            tmp_path,
            *GRPO,
            f"grpo.num_generations={group}",
            f"grpo.max_completion_length={completion}",
        )
        return option(plan).generation.kv_cache

    assert kv(8, 64) == 2 * kv(4, 64)
    assert kv(4, 64) == kv_by_hand(128 + 64, 4)
    # the cache holds prompt + completion: 128 more completion tokens add 128 x a token's
    assert kv(4, 192) - kv(4, 64) == kv_by_hand(128, 4)


def test_beta_adds_a_reference_copy_for_full_and_none_for_lora(tmp_path):
    full = option(plan_of(tmp_path, *GRPO))
    full_kl = option(plan_of(tmp_path, *GRPO, "grpo.beta=0.04"))
    assert full_kl.per_device.params == 2 * full.per_device.params
    assert full_kl.per_device.grads == full.per_device.grads
    lora = option(plan_of(tmp_path, *GRPO, method="lora"), method="lora")
    lora_kl = option(plan_of(tmp_path, *GRPO, "grpo.beta=0.04", method="lora"), method="lora")
    assert lora_kl.per_device.params == lora.per_device.params  # the base, adapters off


def test_fsdp_holds_a_whole_replica_while_generating(tmp_path):
    plan = plan_of(tmp_path, *GRPO, gpus=2)
    ddp, fsdp = option(plan, "ddp"), option(plan, "fsdp")
    assert ddp.generation.replica == 0  # DDP's weights are whole already
    # every unit unsharded at the gathered dtype (fp32 here): the whole model, once
    assert fsdp.generation.replica == plan.params * FP32
    assert fsdp.per_device.generation == (
        fsdp.generation.kv_cache + fsdp.generation.logits + plan.params * FP32
    )
    assert fsdp.generation.kv_cache == ddp.generation.kv_cache
    lines = fsdp.generation.lines()
    assert lines[0].startswith("generation KV cache ")
    assert (
        "2 x 4 layers x 4 kv heads x 32 head_dim x 4 bytes x 384 tokens x 8 sequences" in lines[0]
    )
    assert lines[2].startswith("generation replica ")
    assert len(ddp.generation.lines()) == 2  # no replica line without FSDP2


def test_rm_counts_no_lm_head_logits(tmp_path):
    """A reward model's head has one output: no vocabulary logits, no output-layer gradient
    at the loss; its pair rows are dpo's (two sequences) and it uses no reference."""
    rm = option(plan_of(tmp_path, "train.stage=rm"))
    dpo = option(plan_of(tmp_path, "train.stage=dpo", "dpo.reference=precompute"))
    sft = option(plan_of(tmp_path))
    assert rm.per_device.logits == 0 and dpo.per_device.logits > 0
    assert rm.per_device.activations == dpo.per_device.activations
    assert rm.per_device.params == sft.per_device.params
    assert rm.generation is None and rm.per_device.generation == 0
    assert rm.per_device.total < dpo.per_device.total


def test_an_over_budget_grpo_run_is_refused_naming_the_kv_cache(tmp_path):
    overrides = (
        *GRPO,
        "grpo.num_generations=16",
        "grpo.max_completion_length=2048",
        "grpo.generation_batch_prompts=64",
        "train.gradient_checkpointing=true",
    )
    plan = plan_of(tmp_path, *overrides, memory="8GiB")
    kv = kv_by_hand(128 + 2048, 64 * 16)
    assert kv > 8 * GIB
    decision = decide(plan)
    assert not decision.fits
    assert (
        f"while generating: generation KV cache {kv / GIB:.1f} GiB (2 x 4 layers x 4 kv heads "
        "x 32 head_dim x 4 bytes x 2176 tokens x 1024 sequences)"
    ) in decision.message
    # the fix: fewer prompts generated at once (the same samples, a smaller cache)
    assert "grpo.generation_batch_prompts 64 -> " in decision.message


def test_keel_plan_prints_the_generation_lines_and_column(tmp_path, capsys):
    config = write_config(tmp_path)
    assert main(["plan", str(config), *GRPO, "--gpus", "2", "--gpu-memory", "24GiB"]) == 0
    out = capsys.readouterr().out
    assert "grpo: each step first generates, 1 prompt(s) x 8 completions at once" in out
    header = next(line for line in out.splitlines() if line.startswith("strategy"))
    assert header.split()[8:10] == ["buffers", "generation"]
    assert "while generating: generation KV cache " in out
    assert "while generating: generation logits " in out
    assert main(["plan", str(config), *GRPO, "--gpus", "2", "--gpu-memory", "24GiB", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    fsdp = next(o for o in doc["options"] if o["strategy"] == "fsdp")
    assert fsdp["per_device_bytes"]["generation"] > 0
    # a stage that trains on its rows as they are shows no generation column
    assert main(["plan", str(config), "--gpus", "2", "--gpu-memory", "24GiB"]) == 0
    assert "generation" not in capsys.readouterr().out


def test_the_longest_prepared_prompt_bounds_the_rows_not_cutoff_len(tmp_path):
    """Inside `keel train` the prompts are known: a row is the longest prompt + a completion,
    not data.cutoff_len + a completion (a 40-token prompt under the default cutoff of 1024
    would otherwise plan 25x the activations). A prompt over cutoff_len cannot occur (the
    data refuses it), so the bound never grows."""
    cfg = load_config(write_config(tmp_path), [*GRPO, "grpo.max_completion_length=64"])
    devices = detect_devices(gpus=1, memory="24GiB")
    bounded = option(plan_run(cfg, devices=devices))
    known = option(plan_run(cfg, devices=devices, longest_prompt=32))
    assert known.generation.kv_cache == kv_by_hand(32 + 64, 8)
    assert bounded.generation.kv_cache == kv_by_hand(128 + 64, 8)
    assert known.per_device.activations < bounded.per_device.activations
    assert option(plan_run(cfg, devices=devices, longest_prompt=4096)) == bounded
