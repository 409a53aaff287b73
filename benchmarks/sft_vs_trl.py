"""keel vs TRL's SFTTrainer: the same LoRA SFT job, alternating, in one run.

Same model (bundled SmolLM2-135M-Instruct, fp32), same LoRA (r=16, alpha=32, all-linear,
no dropout), same data (mixed-length instruction/response pairs, loss on the response only),
same batch (4 sequences of at most 512 tokens), same number of optimizer steps. Each run is
its own process, so its peak RSS is its own. Reported: real (non-padding) input tokens per
second of step time, peak RSS, and the ratios keel/TRL.

    python benchmarks/sft_vs_trl.py [--steps 8] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BATCH, MAX_LEN, LR, SEED = 4, 512, 2e-4, 42
SYSTEMS = ("keel", "trl-padded")


def make_dataset(path: Path, rows: int = 96, seed: int = SEED) -> None:
    """Instruction/response pairs whose lengths spread from ~40 to ~450 tokens."""
    rng = random.Random(seed)
    sentences = (ROOT / "examples/data/pretrain_sample.txt").read_text().split("\n")
    sentences = [s for s in sentences if s.strip()]
    tasks = [
        "Summarize the passage.",
        "Explain the passage to a beginner.",
        "List the key facts in the passage.",
        "Rewrite the passage more simply.",
    ]
    data = []
    for _ in range(rows):
        k_in = min(14, max(1, int(rng.lognormvariate(1.2, 0.8))))
        k_out = min(6, max(1, int(rng.lognormvariate(0.6, 0.6))))
        data.append(
            {
                "instruction": rng.choice(tasks),
                "input": " ".join(rng.sample(sentences, k_in)),
                "output": " ".join(rng.sample(sentences, k_out)),
            }
        )
    path.write_text(json.dumps(data, indent=1))


def run_keel(data: Path, steps: int, work: Path) -> dict:
    from keel.config import load_config
    from keel.train.run import run_training

    base = {
        "model": {"path": "bundled:smollm2-135m-instruct"},
        "method": {"type": "lora", "lora": {"r": 16, "alpha": 32, "dropout": 0.0}},
        "data": {
            "datasets": [{"path": str(data), "format": "alpaca"}],
            "cutoff_len": MAX_LEN,
            "packing": True,
            "overlength": "truncate",
        },
        "train": {
            "micro_batch_size": BATCH,
            "max_steps": steps,
            "lr": LR,
            "precision": "fp32",
            "seed": SEED,
            "scheduler": "cosine",
        },
        "output": {"dir": str(work / "keel-out"), "overwrite": True},
    }
    result = run_training(load_config(None, base=base), log=lambda _msg: None)
    s = result.summary
    return {"real_tokens": s["real_tokens"], "seconds": s["train_seconds"]}


def run_trl(data: Path, steps: int, work: Path, packing: bool) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from keel.models import resolve_model_path

    model_dir = resolve_model_path("bundled:smollm2-135m-instruct", "~/.cache/keel")
    rows = json.loads(data.read_text())
    # Conversational prompt/completion: TRL applies the chat template and trains on the
    # completion only, like keel's assistant-only loss.
    ds = Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": f"{r['instruction']}\n{r['input']}"}],
                "completion": [{"role": "assistant", "content": r["output"]}],
            }
            for r in rows
        ]
    )
    timer = _StepTimer(TrainerCallback)
    args = SFTConfig(
        output_dir=str(work / "trl-out"),
        max_length=MAX_LEN,
        packing=packing,
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=1,
        learning_rate=LR,
        lr_scheduler_type="cosine",
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        bf16=False,
        fp16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        seed=SEED,
        completion_only_loss=True,
        dataloader_num_workers=0,
    )
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="sdpa"
    )
    trainer = _counting_trainer(SFTTrainer)(
        model=model,
        args=args,
        train_dataset=ds,
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        peft_config=LoraConfig(
            r=16,
            lora_alpha=32,
            lora_dropout=0.0,
            target_modules="all-linear",
            task_type="CAUSAL_LM",
        ),
        callbacks=[timer.callback],
    )
    trainer.train()
    return {"real_tokens": trainer.real_tokens, "seconds": timer.seconds}


class _StepTimer:
    """Sums the wall time of optimizer steps only (not set-up), like keel's train_seconds."""

    def __init__(self, base):
        self.seconds = 0.0
        timer = self

        class Callback(base):
            def on_step_begin(self, *args, **kwargs):
                timer._start = time.perf_counter()

            def on_step_end(self, *args, **kwargs):
                timer.seconds += time.perf_counter() - timer._start

        self.callback = Callback()


def _counting_trainer(base):
    class CountingSFTTrainer(base):
        """Counts real (attention-mask) tokens of every batch it trains on."""

        real_tokens = 0

        def training_step(self, model, inputs, *args, **kwargs):
            if "attention_mask" in inputs:
                self.real_tokens += int(inputs["attention_mask"].sum())
            else:  # padding-free packing: every position is a real token
                self.real_tokens += int(inputs["input_ids"].numel())
            return super().training_step(model, inputs, *args, **kwargs)

    return CountingSFTTrainer


def worker(system: str, data: Path, steps: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if system == "keel":
            result = run_keel(data, steps, work)
        else:
            result = run_trl(data, steps, work, packing=system == "trl-packed")
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps(result), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--worker")
    parser.add_argument("--data")
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, Path(args.data), args.steps)
    systems = args.systems.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "mixed.json"
        make_dataset(data)
        runs: dict[str, list[dict]] = {s: [] for s in systems}
        for round_index in range(args.rounds):
            for system in systems:  # alternate, so drift in machine load hits both
                out = subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "--worker",
                        system,
                        "--data",
                        str(data),
                        "--steps",
                        str(args.steps),
                    ],
                    capture_output=True,
                    text=True,
                    cwd=ROOT,
                )
                line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
                if out.returncode or not line:
                    sys.exit(f"{system} failed:\n{out.stderr[-3000:]}")
                result = json.loads(line[-1][len("RESULT ") :])
                result["tokens_per_s"] = result["real_tokens"] / result["seconds"]
                runs[system].append(result)
                print(
                    f"round {round_index + 1} {system}: {result['tokens_per_s']:.1f} "
                    f"real tokens/s, peak RSS {result['peak_rss_mb']:.0f} MB",
                    flush=True,
                )
    print(table(runs, args.steps))


def table(runs: dict[str, list[dict]], steps: int) -> str:
    keel_tps = statistics.median(r["tokens_per_s"] for r in runs["keel"])
    keel_rss = max(r["peak_rss_mb"] for r in runs["keel"])
    lines = [
        f"{steps} steps x batch {BATCH} x <= {MAX_LEN} tokens, median of "
        f"{len(runs['keel'])} alternating rounds",
        "",
        "| system | real tokens/s | peak RSS (MB) | keel speed-up | keel memory ratio |",
        "|---|---|---|---|---|",
    ]
    for system, results in runs.items():
        tps = statistics.median(r["tokens_per_s"] for r in results)
        rss = max(r["peak_rss_mb"] for r in results)
        lines.append(
            f"| {system} | {tps:.1f} | {rss:.0f} | {keel_tps / tps:.2f}x | {keel_rss / rss:.2f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
