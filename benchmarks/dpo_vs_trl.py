"""keel vs TRL's DPOTrainer: the same LoRA DPO job, alternating, in one run.

Same model (bundled SmolLM2-135M-Instruct, fp32), same LoRA (r=16, alpha=32, all-linear,
no dropout), same pairs (examples/data/preference/train.jsonl: conversational prompt,
chosen, rejected), same order (no shuffling, so step 1 sees the same 4 pairs on both
sides), same batch (4 pairs per step, no accumulation), same optimizer settings, same
number of steps, sigmoid DPO loss with beta 0.1. Neither side keeps a reference model: the
reference is the policy with its LoRA adapters switched off, computed live every step (no
precomputation). Each run is its own process, so its peak RSS is its own.

Reported: pairs per second of step time (set-up excluded), over all steps and over the
median steady step (steps 2 to N-1: no first-step warm-up, no final save, and robust to
bursts of load on a shared machine); peak RSS; the ratios keel/TRL; and step 1's loss and
mean summed log-probs of the chosen and rejected completions on both sides. At step 1 the policy is the base model (LoRA's B starts at zero), so those log-probs
must agree up to one difference of definition: TRL's completion also includes the chat
template's newline after the end-of-turn token, keel's ends at the end-of-turn token. The
TRL worker therefore rescores step 1's batch with the base model after training and reports
its log-probs both ways.

    python benchmarks/dpo_vs_trl.py [--steps 6] [--rounds 2] [--data pairs.jsonl] [--threads N]

--threads sets torch's CPU threads on both sides (default: one per core, as keel does). On a
machine other jobs share, fewer threads than cores keeps idle threads from spinning at
OpenMP barriers while a sibling waits for a core, which can slow a step 20-fold.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from trl_cpu import (
    StepTimer,
    alternating_rounds,
    cpu_trainer_args,
    load_model,
    lora_config,
    measured_worker,
    read_result,
)

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "examples/data/preference/train.jsonl"
MODEL = "bundled:smollm2-135m-instruct"
PAIRS, MAX_LEN, LR, BETA, SEED = 4, 512, 5e-5, 0.1, 42
SYSTEMS = ("keel", "trl")
STEP1_KEYS = ("loss", "logps/chosen", "logps/rejected")


def load_pairs(path: Path) -> list[dict]:
    """Rows of a JSONL or JSON file of TRL preference pairs (prompt, chosen, rejected)."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        rows = json.loads(text)
    else:
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [{k: row[k] for k in ("prompt", "chosen", "rejected")} for row in rows]


def run_keel(data: Path, steps: int, work: Path, threads: int) -> dict:
    from keel.config import load_config
    from keel.train.run import run_training

    out = work / "keel-out"
    base = {
        "model": {"path": MODEL},
        "method": {"type": "lora", "lora": {"r": 16, "alpha": 32, "dropout": 0.0}},
        "data": {
            "datasets": [{"path": str(data)}],
            "cutoff_len": MAX_LEN,
            "shuffle": False,
        },
        "train": {
            "stage": "dpo",
            "micro_batch_size": PAIRS,
            "grad_accum": 1,
            "max_steps": steps,
            "lr": LR,
            "precision": "fp32",
            "seed": SEED,
            "scheduler": "cosine",
            "threads": threads,
        },
        "dpo": {"beta": BETA, "loss_type": "sigmoid", "reference": "auto"},
        "output": {"dir": str(out), "overwrite": True, "log_every": 1},
    }
    ends: list[float] = []  # when each step's bookkeeping ended; the last one also saved
    result = run_training(
        load_config(None, base=base),
        log=lambda _msg: None,
        on_step_end=lambda _step, _record: ends.append(time.perf_counter()),
    )
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in records if r.get("step") == 1)
    return {
        "pairs": sum(r["pairs"] for r in records if "pairs" in r),
        "seconds": result.summary["train_seconds"],
        "steady_step_seconds": [b - a for a, b in zip(ends[:-2], ends[1:-1])],
        "step1": {key: first[key] for key in STEP1_KEYS},
    }


def run_trl(data: Path, steps: int, work: Path, threads: int) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    from keel.models import resolve_model_path

    if threads:
        torch.set_num_threads(threads)
    model_dir = resolve_model_path(MODEL, "~/.cache/keel")
    timer = StepTimer("loss")
    args = DPOConfig(
        output_dir=str(work / "trl-out"),
        max_length=MAX_LEN,
        per_device_train_batch_size=PAIRS,
        learning_rate=LR,
        max_steps=steps,
        beta=BETA,
        loss_type=["sigmoid"],
        precompute_ref_log_probs=False,
        train_sampling_strategy="sequential",
        bf16=False,
        **cpu_trainer_args(SEED),
    )
    model = load_model(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    trainer = _counting_trainer(DPOTrainer)(
        model=model,
        ref_model=None,  # with PEFT: the policy with adapters disabled is the reference
        args=args,
        train_dataset=Dataset.from_list(load_pairs(data)),
        processing_class=tokenizer,
        peft_config=lora_config(),
        callbacks=[timer.callback],
    )
    trainer.train()
    return {
        "pairs": trainer.pairs,
        "seconds": sum(timer.steps),
        "steady_step_seconds": timer.steps[1:-1],
        "step1": {key: timer.logs[1][key] for key in STEP1_KEYS},
        "step1_rescored": _rescore_first_batch(trainer, tokenizer),
    }


def _counting_trainer(base):
    class CountingDPOTrainer(base):
        """Counts the pairs of every batch it trains on (a batch is chosen rows, then rejected)."""

        pairs = 0
        first_batch = None

        def training_step(self, model, inputs, *args, **kwargs):
            self.pairs += int(inputs["input_ids"].shape[0]) // 2
            if self.first_batch is None:
                self.first_batch = {k: v.clone() for k, v in inputs.items()}
            return super().training_step(model, inputs, *args, **kwargs)

    return CountingDPOTrainer


def _rescore_first_batch(trainer, tokenizer) -> dict:
    """Step 1's batch scored again by the base model (adapters off, as the policy was at
    step 1): mean summed completion log-probs, with TRL's completion (ending with the newline
    after the end-of-turn token) and with keel's (ending at the end-of-turn token)."""
    import torch

    batch = trainer.first_batch
    mask = batch["completion_mask"][:, 1:].bool()  # [2P, T-1], aligned with next-token logps
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    model = trainer.model
    model.eval()
    with torch.no_grad(), model.disable_adapter():
        out = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            labels=labels,
            fused_lm_head=True,
            use_cache=False,
        )
    logps = out.log_probs[:, -mask.shape[1] :] * mask  # [2P, T-1]
    last = mask.shape[1] - 1 - mask.flip(1).int().argmax(1)  # [2P] last completion position
    rows = torch.arange(mask.shape[0])
    targets = batch["input_ids"][:, 1:]
    newline_ids = tokenizer.encode("\n", add_special_tokens=False)
    ends_with_newline = bool(
        (targets[rows, last] == newline_ids[-1]).all()
        and (targets[rows, last - 1] == tokenizer.eos_token_id).all()
    )
    with_newline = logps.sum(1)  # [2P]
    without = with_newline - logps[rows, last]  # [2P]
    pairs = with_newline.shape[0] // 2

    def means(x):
        return {"logps/chosen": x[:pairs].mean().item(), "logps/rejected": x[pairs:].mean().item()}

    return {
        "ends_with_newline": ends_with_newline,
        "trl_definition": means(with_newline),
        "keel_definition": means(without),
    }


def worker(system: str, data: Path, steps: int, threads: int) -> None:
    run = run_keel if system == "keel" else run_trl
    measured_worker(lambda work: run(data, steps, work, threads))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--steps", type=int, default=6, help="at least 3: steps 2 to N-1 are the steady ones"
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--data", default=str(DATA), help="JSONL/JSON of TRL preference pairs")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads; 0: all cores")
    parser.add_argument("--worker")
    args = parser.parse_args()
    if args.steps < 3:
        parser.error("--steps must be at least 3 (the steady steps are 2 to N-1)")
    data = Path(args.data).resolve()
    if args.worker:
        return worker(args.worker, data, args.steps, args.threads)
    if not data.is_file():
        sys.exit(f"{data}: no such file; pass --data with a JSONL of prompt/chosen/rejected rows")
    runs = alternating_rounds(
        args.systems.split(","),
        args.rounds,
        lambda system: _run_worker(system, data, args.steps, args.threads),
        lambda result: f"{result['pairs_per_s']:.2f} pairs/s",
    )
    print(table(runs, args.steps))
    if {"keel", "trl"} <= runs.keys():
        print(step1_comparison(runs["keel"][0], runs["trl"][0]))


def _run_worker(system: str, data: Path, steps: int, threads: int) -> dict:
    command = [sys.executable, __file__, "--worker", system, "--data", str(data)]
    command += ["--steps", str(steps), "--threads", str(threads)]
    result = read_result(command, system, ROOT)
    result["pairs_per_s"] = result["pairs"] / result["seconds"]
    steady = result["steady_step_seconds"]
    result["steady_pairs_per_s"] = PAIRS / statistics.median(steady) if steady else None
    return result


def table(runs: dict[str, list[dict]], steps: int) -> str:
    def median(system: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[system] if r[key] is not None)

    keel_rss = max(r["peak_rss_mb"] for r in runs["keel"])
    lines = [
        f"{steps} steps x {PAIRS} pairs x <= {MAX_LEN} tokens per sequence, median of "
        f"{len(runs['keel'])} alternating rounds; steady: the median of steps 2 to {steps - 1}",
        "",
        "| system | pairs/s (all steps) | pairs/s (steady) | peak RSS (MB) | keel speed-up "
        "(all / steady) | keel memory ratio |",
        "|---|---|---|---|---|---|",
    ]
    for system, results in runs.items():
        pps, steady = median(system, "pairs_per_s"), median(system, "steady_pairs_per_s")
        rss = max(r["peak_rss_mb"] for r in results)
        speedup = (
            f"{median('keel', 'pairs_per_s') / pps:.2f}x / "
            f"{median('keel', 'steady_pairs_per_s') / steady:.2f}x"
        )
        lines.append(
            f"| {system} | {pps:.2f} | {steady:.2f} | {rss:.0f} | {speedup} | "
            f"{keel_rss / rss:.2f} |"
        )
    return "\n".join(lines)


def step1_comparison(keel: dict, trl: dict) -> str:
    """Step 1's loss and log-probs side by side, with relative differences."""
    rescored = trl["step1_rescored"]
    columns = (
        ("keel", keel["step1"]),
        ("TRL (logged)", trl["step1"]),
        ("TRL rescored, keel's completion", rescored["keel_definition"]),
    )
    lines = [
        "",
        "Step 1 (policy = base model). TRL's completion ends with the newline after the "
        f"end-of-turn token: {rescored['ends_with_newline']}.",
        "",
        "| metric | " + " | ".join(name for name, _ in columns) + " | rel. diff keel vs TRL "
        "(logged) | rel. diff keel vs TRL (keel's completion) |",
        "|---" * (len(columns) + 3) + "|",
    ]
    for key in STEP1_KEYS:
        values = [col.get(key) for _, col in columns]
        cells = ["-" if v is None else f"{v:.6f}" for v in values]
        diffs = [_relative(values[0], other) for other in values[1:]]
        lines.append(f"| {key} | " + " | ".join(cells + diffs) + " |")
    return "\n".join(lines)


def _relative(ours: float | None, theirs: float | None) -> str:
    if ours is None or theirs is None:
        return "-"
    return f"{abs(ours - theirs) / max(abs(theirs), 1e-12):.2e}"


if __name__ == "__main__":
    main()
