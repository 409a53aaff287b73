"""What the keel-vs-TRL benchmarks share. TRL's side alike in each: its trainer arguments for
one CPU process that saves and reports nothing mid-run, the fp32 sdpa model, the LoRA of
the jobs (r=16, alpha=32, all linear layers, no dropout: keel's side uses the same) and a
timer of its steps. Each side runs in a worker process of its own (so its peak RSS is its
own) that reports its result as one RESULT line on stdout, read back by the parent."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

RESULT = "RESULT "  # how a worker's result line starts


def report_result(result: dict) -> None:
    """A worker's result, as the RESULT line the parent reads (`read_result`)."""
    print(RESULT + json.dumps(result), flush=True)


def measured_worker(run: Callable[[Path], dict]) -> None:
    """A worker's whole job: `run(work)` in a fresh temporary folder, reported with this
    process's peak RSS and torch's thread count (after set-up: what the steps ran with)."""
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        result = run(Path(tmp))
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result["threads"] = torch.get_num_threads()
    report_result(result)


def read_result(command: list[str], name: str, cwd: Path) -> dict:
    """Run a worker process to its end and return its result; exit naming `name`, with its
    stderr's tail, when it fails or reports none."""
    out = subprocess.run(command, capture_output=True, text=True, cwd=cwd)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith(RESULT)]
    if out.returncode or not line:
        sys.exit(f"{name} failed:\n{out.stderr[-3000:]}")
    return json.loads(line[-1][len(RESULT) :])


def alternating_rounds(
    systems: list[str], rounds: int, measure: Callable[[str], dict], describe: Callable[[dict], str]
) -> dict[str, list[dict]]:
    """system -> its results: `measure(system)` for each system in turn, `rounds` times (so
    drift in machine load hits all), a line per result as it comes: `describe(result)`, its
    steady steps' seconds, peak RSS and threads (as `measured_worker` reports them)."""
    runs: dict[str, list[dict]] = {system: [] for system in systems}
    for round_index in range(rounds):
        for system in systems:
            result = measure(system)
            runs[system].append(result)
            steps = ", ".join(f"{s:.1f}" for s in result["steady_step_seconds"])
            print(
                f"round {round_index + 1} {system}: {describe(result)}, steady steps {steps} s, "
                f"peak RSS {result['peak_rss_mb']:.0f} MB, {result['threads']} threads",
                flush=True,
            )
    return runs


class StepTimer:
    """For a TRL trainer's callbacks: the wall time of each optimizer step (not set-up, as
    keel's train_seconds counts), and by step, each log that has `key`."""

    def __init__(self, key: str):
        from transformers import TrainerCallback

        self.steps: list[float] = []
        self.logs: dict[int, dict] = {}
        timer = self

        class Callback(TrainerCallback):
            def on_step_begin(self, *args, **kwargs):
                timer._start = time.perf_counter()

            def on_step_end(self, *args, **kwargs):
                timer.steps.append(time.perf_counter() - timer._start)

            def on_log(self, args, state, control, logs=None, **kwargs):
                if logs and key in logs:
                    timer.logs[state.global_step] = dict(logs)

        self.callback = Callback()


def cpu_trainer_args(seed: int) -> dict:
    """transformers TrainingArguments shared by SFTConfig and DPOConfig runs: no
    accumulation, cosine schedule, a log line every step, no checkpoints, no reporting, no
    gradient checkpointing, no fp16, data loaded in the training process."""
    return dict(
        gradient_accumulation_steps=1,
        lr_scheduler_type="cosine",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        fp16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        seed=seed,
        dataloader_num_workers=0,
    )


def load_model(folder: Path):
    """The benchmark's model in fp32 with transformers' sdpa attention."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="sdpa"
    )


def lora_config():
    from peft import LoraConfig

    return LoraConfig(
        r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
    )
