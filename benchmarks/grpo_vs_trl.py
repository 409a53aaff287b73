"""keel vs TRL's GRPOTrainer: the same LoRA GRPO job, alternating, in one run.

Same model (bundled SmolLM2-135M-Instruct, fp32), same LoRA (r=16, alpha=32, all-linear,
no dropout), same prompts (the GRPO demo's one-digit sums, examples/data/grpo/train.jsonl:
conversational prompt-only rows with an `answer` column), same order (no shuffling), same
reward file (examples/rewards/sums.py:correct, TRL's signature, loaded as is by both), same
group (num_generations completions per prompt, sampled at temperature 1, no top-k/top-p),
same max_completion_length, loss_type grpo, beta 0 (no reference), one policy update per
generation, same optimizer settings, same number of steps. A step is PROMPTS prompts x
num_generations completions: generated, scored and trained on, on one CPU process. TRL uses
transformers' `generate` (no vLLM), keel its own continuous-batching engine (the one behind
`keel serve`). Each run is its own process, so its peak RSS is its own.

Sampling differs between the two (different generators), so the completions differ and so do
their lengths; a step's time grows with them. The table therefore also gives each side's mean
completion length, and completion tokens per second next to steps per second.

Reported: seconds per step over the steady steps (steps 2..N: the first step holds the
warm-up), their median, peak RSS, mean reward and completion length, the ratios keel/TRL.

    python benchmarks/grpo_vs_trl.py [--steps 6] [--rounds 2] [--systems keel,trl] [--threads N]

--threads sets torch's CPU threads on both sides (default: one per core, as keel does).
"""

from __future__ import annotations

import argparse
import importlib.util
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
DATA = ROOT / "examples/data/grpo/train.jsonl"
REWARD_FILE = ROOT / "examples/rewards/sums.py"
REWARD = "correct"
MODEL = "bundled:smollm2-135m-instruct"
PROMPTS, GENERATIONS, COMPLETION_LEN, LR, SEED = 2, 8, 32, 5e-4, 42
SYSTEMS = ("keel", "trl")


def load_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def run_keel(steps: int, work: Path, threads: int) -> dict:
    from keel.config import load_config
    from keel.train.run import run_training

    out = work / "keel-out"
    base = {
        "model": {"path": MODEL},
        "method": {"type": "lora", "lora": {"r": 16, "alpha": 32, "dropout": 0.0}},
        "data": {"datasets": [{"path": str(DATA)}], "shuffle": False},
        "train": {
            "stage": "grpo",
            "global_batch_size": PROMPTS,
            "micro_batch_size": PROMPTS,
            "max_steps": steps,
            "lr": LR,
            "precision": "fp32",
            "seed": SEED,
            "scheduler": "cosine",
            "threads": threads,
        },
        "grpo": {
            "rewards": [f"{REWARD_FILE}:{REWARD}"],
            "num_generations": GENERATIONS,
            "max_completion_length": COMPLETION_LEN,
            "temperature": 1.0,
            "loss_type": "grpo",
            "beta": 0.0,
            "generation_batch_prompts": PROMPTS,  # one generation call per step, as TRL
            "log_completions_every": 0,
        },
        "output": {"dir": str(out), "overwrite": True, "log_every": 1},
    }
    ends: list[float] = []  # when each step's bookkeeping ended; the last one also saved
    run_training(
        load_config(None, base=base),
        base_dir=ROOT,
        log=lambda _msg: None,
        on_step_end=lambda _step, _record: ends.append(time.perf_counter()),
    )
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps_logged = [r for r in records if "reward" in r]
    return {
        "steady_step_seconds": [b - a for a, b in zip(ends[:-2], ends[1:-1])],
        "reward": statistics.mean(r["reward"] for r in steps_logged),
        "mean_length": statistics.mean(r["completions/mean_length"] for r in steps_logged),
    }


def reward_function():
    """examples/rewards/sums.py:correct, loaded from its file as keel loads it."""
    spec = importlib.util.spec_from_file_location("sums_rewards", REWARD_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, REWARD)


def run_trl(steps: int, work: Path, threads: int) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from keel.models import resolve_model_path

    if threads:
        torch.set_num_threads(threads)
    model_dir = resolve_model_path(MODEL, "~/.cache/keel")
    timer = StepTimer("reward")  # generation, rewards and the update of each step
    args = GRPOConfig(
        output_dir=str(work / "trl-out"),
        per_device_train_batch_size=PROMPTS * GENERATIONS,  # TRL counts completions
        num_generations=GENERATIONS,
        max_completion_length=COMPLETION_LEN,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=LR,
        max_steps=steps,
        loss_type="grpo",
        beta=0.0,
        num_iterations=1,
        shuffle_dataset=False,
        use_vllm=False,
        bf16=False,
        log_completions=False,
        **cpu_trainer_args(SEED),
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    trainer = GRPOTrainer(
        model=load_model(model_dir),
        reward_funcs=[reward_function()],
        args=args,
        train_dataset=Dataset.from_list(load_rows(DATA)),
        processing_class=tokenizer,
        peft_config=lora_config(),
        callbacks=[timer.callback],
    )
    trainer.train()
    logs = timer.logs.values()
    return {
        "steady_step_seconds": timer.steps[1:],
        "reward": statistics.mean(log["reward"] for log in logs),
        "mean_length": statistics.mean(log["completions/mean_length"] for log in logs),
    }


def worker(system: str, steps: int, threads: int) -> None:
    run = run_keel if system == "keel" else run_trl
    measured_worker(lambda work: run(steps, work, threads))


def _run_worker(system: str, steps: int, threads: int) -> dict:
    command = [sys.executable, __file__, "--worker", system]
    command += ["--steps", str(steps), "--threads", str(threads)]
    result = read_result(command, system, ROOT)
    result["median_step_seconds"] = statistics.median(result["steady_step_seconds"])
    return result


def table(runs: dict[str, list[dict]], steps: int) -> str:
    """The markdown table: per system, medians over rounds; ratios against TRL."""

    def median(system: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[system])

    lines = [
        f"{steps} steps x {PROMPTS} prompts x {GENERATIONS} completions of <= {COMPLETION_LEN} "
        f"tokens, LoRA, fp32, median of {len(next(iter(runs.values())))} alternating rounds; "
        f"steady: steps 2 to {steps} (keel: to {steps - 1}, its last step also saves)",
        "",
        "| system | s/step (steady) | steps/s | completion tokens/s | mean completion length "
        "| mean reward | peak RSS (MB) |",
        "|---|---|---|---|---|---|---|",
    ]
    for system in runs:
        seconds, length = median(system, "median_step_seconds"), median(system, "mean_length")
        rss = max(r["peak_rss_mb"] for r in runs[system])
        tokens_per_s = PROMPTS * GENERATIONS * length / seconds
        lines.append(
            f"| {system} | {seconds:.2f} | {1 / seconds:.3f} | {tokens_per_s:.1f} | "
            f"{length:.1f} | {median(system, 'reward'):.2f} | {rss:.0f} |"
        )
    if {"keel", "trl"} <= runs.keys():
        speedup = median("trl", "median_step_seconds") / median("keel", "median_step_seconds")
        memory = max(r["peak_rss_mb"] for r in runs["keel"]) / max(
            r["peak_rss_mb"] for r in runs["trl"]
        )
        lines += ["", f"keel speed-up (steps/s): {speedup:.2f}x; keel memory ratio: {memory:.2f}"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--steps", type=int, default=6, help="at least 3: steps 2 to N-1 are the steady ones"
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads; 0: all cores")
    parser.add_argument("--worker")
    args = parser.parse_args()
    if args.steps < 3:
        parser.error("--steps must be at least 3 (the steady steps are 2 to N-1)")
    if args.worker:
        return worker(args.worker, args.steps, args.threads)
    runs = alternating_rounds(
        args.systems.split(","),
        args.rounds,
        lambda system: _run_worker(system, args.steps, args.threads),
        lambda r: f"mean completion length {r['mean_length']:.1f}, reward {r['reward']:.2f}",
    )
    print(table(runs, args.steps))


if __name__ == "__main__":
    main()
