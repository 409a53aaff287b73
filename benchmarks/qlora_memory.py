"""Memory and speed of the memory-saving recipes on the bundled model: full vs LoRA vs QLoRA,
with AdamW, 8-bit AdamW and gradient checkpointing, each a whole `keel train` process.

The job is sft_vs_trl.py's `readme` one (SmolLM2-135M-Instruct, alpaca pairs, 4 rows of at
most 512 tokens per step, LoRA r=16 / alpha=32 on all linear layers) for `--steps` steps.
Systems alternate within each round (order flipped every round). Reported per system
(median over rounds; RSS: the largest):
- peak RSS of the whole process (wait4 of the child), and at the end of loading (before the
  first step; keel_run.json's load_peak_rss_mb);
- what keel's memory plan predicted for the step (`plan:` line of the log);
- steady state: real tokens per second over steps 2..N, and step 1's seconds (step 1 holds
  the one-off costs: first-touch memory, and the 8-bit optimizer's compilation).

    python benchmarks/qlora_memory.py [--systems full,lora,qlora,...] [--rounds 2]
        [--steps 12] [--precision fp32]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sft_vs_trl import keel_job, keel_steps, make_dataset, model_dir
from trl_cpu import read_result, report_result

ROOT = Path(__file__).resolve().parents[1]
SYSTEMS = {
    "full": ["method.type=full", "train.lr=2e-5"],
    "full-8bit": ["method.type=full", "train.lr=2e-5", "train.optimizer=adamw_8bit"],
    # Muon on the decoder's matrices (one momentum buffer each), AdamW on the rest
    "full-muon": ["method.type=full", "train.lr=2e-5", "train.optimizer=muon"],
    "lora": [],
    "qlora": ["method.type=qlora"],
    # OFT: rotation blocks of 32 inputs on every linear layer (LLaMA-Factory's default)
    "oft": ["method.type=oft"],
    # PiSSA: LoRA started from each weight's top-16 singular part (16-iteration randomised SVD)
    "pissa": ["method.lora.init=pissa"],
    # OLoRA: LoRA started from each weight's QR decomposition (Q's first 16 columns)
    "olora": ["method.lora.init=olora"],
    "qlora-bnb": ["method.type=qlora", "method.qlora.quant_backend=bnb"],
    # field note 4's recipe: QLoRA, 8-bit AdamW, offloaded checkpointing (on a CPU the
    # offload is plain checkpointing: there is no separate device memory to spare)
    "qlora-8bit-ckpt": [
        "method.type=qlora",
        "train.optimizer=adamw_8bit",
        "train.gradient_checkpointing=offload",
    ],
}


def run_once(system: str, data: Path, precision: str, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        overrides = [*SYSTEMS[system], f"train.max_steps={steps}"]
        command = keel_job(data, work, precision, False, overrides)
        started = time.perf_counter()
        child = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = child.communicate()
        wall = time.perf_counter() - started
        import resource

        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        log = out.decode() + err.decode()
        if child.returncode:
            sys.exit(f"{system} failed (exit {child.returncode}):\n{log[-3000:]}")
        measured = keel_steps(work)
        summary = json.loads((work / "out/keel_run.json").read_text())
    planned = re.search(r"plan: .*? needs ([0-9.]+) GiB", log)
    steady = measured[1:] or measured
    return {
        "wall_s": wall,
        "peak_rss_mb": peak,
        "load_peak_rss_mb": summary["per_rank"][0]["load_peak_rss_mb"],
        "planned_gib": float(planned.group(1)) if planned else None,
        "first_step_s": measured[0][1],
        "steady_tokens_per_s": sum(t for t, _ in steady) / sum(s for _, s in steady),
        "final_loss": summary["final_loss"],
    }


def _isolated(system: str, data: Path, precision: str, steps: int) -> dict:
    """run_once in its own process, so RUSAGE_CHILDREN holds this run only."""
    command = [sys.executable, __file__, "--single", system, "--data", str(data)]
    command += ["--precision", precision, "--steps", str(steps)]
    return read_result(command, system, ROOT)


def table(results: dict[str, list[dict]], precision: str) -> str:
    lines = [
        f"precision {precision}; medians over rounds (RSS: the largest)",
        "",
        "| system | peak RSS MB | RSS after loading MB | plan (step peak) GiB | steady tokens/s "
        "| vs lora | step 1 s | final loss |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lora = results.get("lora")
    for system, runs in results.items():

        def median(key, rows=runs):
            return statistics.median(r[key] for r in rows)

        speed = median("steady_tokens_per_s")
        ratio = f"{speed / median('steady_tokens_per_s', lora):.2f}x" if lora else "-"
        planned = runs[0]["planned_gib"]
        lines.append(
            f"| {system} | {max(r['peak_rss_mb'] for r in runs):.0f} | "
            f"{max(r['load_peak_rss_mb'] for r in runs):.0f} | "
            f"{planned if planned is not None else '-'} | {speed:.1f} | {ratio} | "
            f"{median('first_step_s'):.1f} | {median('final_loss'):.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--single")
    parser.add_argument("--data")
    args = parser.parse_args()
    if args.single:
        report_result(run_once(args.single, Path(args.data), args.precision, args.steps))
        return
    model_dir()  # convert once, outside any measured run
    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "readme.json"
        make_dataset(data, "readme")
        for round_index in range(args.rounds):
            systems = args.systems.split(",")
            if round_index % 2:
                systems = systems[::-1]
            for system in systems:
                result = _isolated(system, data, args.precision, args.steps)
                results.setdefault(system, []).append(result)
                print(
                    f"round {round_index + 1} {system}: peak RSS {result['peak_rss_mb']:.0f} MB, "
                    f"after loading {result['load_peak_rss_mb']:.0f} MB, steady "
                    f"{result['steady_tokens_per_s']:.1f} tokens/s, step 1 "
                    f"{result['first_step_s']:.1f} s",
                    flush=True,
                )
    print(table({s: results[s] for s in args.systems.split(",")}, args.precision))


if __name__ == "__main__":
    main()
