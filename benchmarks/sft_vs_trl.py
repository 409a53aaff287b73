"""keel vs TRL's SFTTrainer: the same LoRA SFT job as whole processes, alternating.

The job: the bundled SmolLM2-135M-Instruct as a plain Hugging Face folder, LoRA r=16 /
alpha=32 on all linear layers (no dropout), instruction/response pairs with the loss on the
response only, 4 sequences of at most 512 tokens per step (longer ones truncated on both
sides), lr 2e-4 cosine, one epoch. keel runs as `python -m keel train job.yaml` with its
defaults otherwise; TRL 1.16 runs `SFTTrainer` padded (`packing=False`) and packed
(`packing=True`), with `bf16=False` in fp32 and `bf16=True` under `auto`. Every run is its
own process; the systems alternate within each round, so drift in machine load hits all.

Reported per system (median over rounds):
- end to end: the whole process's wall time (start-up, model load, data, training, saving),
  measured by this script around the child, and its peak RSS (the child's own, from wait4);
- steady state: real (non-padding) input tokens per second over steps 2..N (the first step
  holds the warm-up), and step 1's seconds;
- the steady state as a fraction of this CPU's measured matmul limit (a 2048x2048 matmul,
  best of several, in fp32 and bf16), counting 4 x parameters FLOPs per token (forward 2N
  plus backward to the activations 2N; LoRA's own weight gradients are negligible).

Data shapes: `readme` (96 pairs, ~100-520 tokens, mean ~190: the README's job) and `long`
(48 pairs, ~150-512 tokens, mean ~330: longer, mixed lengths).

    python benchmarks/sft_vs_trl.py [--shapes readme,long] [--precisions fp32,auto]
        [--systems keel,keel-packed,trl-padded,trl-packed] [--rounds 2] [--set key=value]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from trl_cpu import cpu_trainer_args, load_model, lora_config, read_result, report_result

ROOT = Path(__file__).resolve().parents[1]
MODEL = "bundled:smollm2-135m-instruct"
BATCH, MAX_LEN, LR, SEED = 4, 512, 2e-4, 42
SYSTEMS = ("keel", "keel-packed", "trl-padded", "trl-packed")
SHAPES = {
    # rows, sentences in the input (lognormal mu, sigma, max), sentences in the output
    "readme": (96, (1.2, 0.8, 14), (0.6, 0.6, 6)),
    "long": (48, (2.0, 0.45, 14), (0.9, 0.4, 4)),
}


def make_dataset(path: Path, shape: str, seed: int = SEED) -> None:
    """Alpaca rows built from the sentences of examples/data/pretrain_sample.txt."""
    rows, (mu_in, sigma_in, max_in), (mu_out, sigma_out, max_out) = SHAPES[shape]
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
        k_in = min(max_in, max(1, int(rng.lognormvariate(mu_in, sigma_in))))
        k_out = min(max_out, max(1, int(rng.lognormvariate(mu_out, sigma_out))))
        data.append(
            {
                "instruction": rng.choice(tasks),
                "input": " ".join(rng.sample(sentences, k_in)),
                "output": " ".join(rng.sample(sentences, k_out)),
            }
        )
    path.write_text(json.dumps(data, indent=1))


def model_dir() -> Path:
    """The bundled model converted once to a plain Hugging Face folder (both sides load it)."""
    from keel.models import resolve_model_path

    return Path(resolve_model_path(MODEL, "~/.cache/keel", log=lambda _m: None))


def keel_job(data: Path, work: Path, precision: str, packed: bool, overrides: list[str]) -> list:
    """The command line of a whole `keel train` process for the job."""
    config = {
        "model": {"path": str(model_dir())},
        "method": {"type": "lora", "lora": {"r": 16, "alpha": 32, "dropout": 0.0}},
        "data": {
            "datasets": [{"path": str(data), "format": "alpaca"}],
            "cutoff_len": MAX_LEN,
            "overlength": "truncate",
            "packing": packed,
        },
        "train": {
            "micro_batch_size": BATCH,
            "epochs": 1,
            "lr": LR,
            "precision": precision,
            "seed": SEED,
            "scheduler": "cosine",
        },
        "output": {"dir": str(work / "out"), "overwrite": True},
    }
    path = work / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    return [sys.executable, "-m", "keel", "train", str(path), *overrides]


def keel_steps(work: Path) -> list[tuple[int, float]]:
    """(real tokens, seconds) of each step, from the run's metrics.jsonl."""
    records = [json.loads(line) for line in (work / "out/metrics.jsonl").read_text().splitlines()]
    return [(r["real_tokens"], r["step_seconds"]) for r in records if "step_seconds" in r]


def trl_worker(data: Path, work: Path, precision: str, packed: bool) -> None:
    """Train with TRL in this process; print the steps' (real tokens, seconds)."""
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    folder = model_dir()
    rows = json.loads(data.read_text())
    # Conversational prompt/completion: TRL applies the chat template and trains on the
    # completion only, like keel's assistant-only loss.
    dataset = Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": f"{r['instruction']}\n{r['input']}"}],
                "completion": [{"role": "assistant", "content": r["output"]}],
            }
            for r in rows
        ]
    )
    steps: list[list] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *args, **kwargs):
            steps.append([0, time.perf_counter()])

        def on_step_end(self, *args, **kwargs):
            steps[-1][1] = time.perf_counter() - steps[-1][1]

    class CountingSFTTrainer(SFTTrainer):
        def training_step(self, model, inputs, *args, **kwargs):
            mask = inputs.get("attention_mask")
            # padding-free packing has no mask: every position is a real token
            steps[-1][0] += int(mask.sum()) if mask is not None else inputs["input_ids"].numel()
            return super().training_step(model, inputs, *args, **kwargs)

    args = SFTConfig(
        output_dir=str(work / "out"),
        max_length=MAX_LEN,
        packing=packed,
        per_device_train_batch_size=BATCH,
        learning_rate=LR,
        num_train_epochs=1,
        bf16=precision != "fp32",
        completion_only_loss=True,
        **cpu_trainer_args(SEED),
    )
    model = load_model(folder)
    trainer = CountingSFTTrainer(
        model=model,
        args=args,
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(folder),
        peft_config=lora_config(),
        callbacks=[StepTimer()],
    )
    trainer.train()
    trainer.save_model(str(work / "out"))  # keel writes its adapter too: same end of job
    print("STEPS " + json.dumps(steps), flush=True)


def run_once(system: str, data: Path, precision: str, overrides: list[str]) -> dict:
    """One whole process of `system`: wall time, peak RSS and per-step numbers."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if system.startswith("keel"):
            command = keel_job(data, work, precision, system == "keel-packed", overrides)
        else:
            command = [sys.executable, __file__, "--trl-worker", system, "--data", str(data)]
            command += ["--work", str(work), "--precision", precision]
        started = time.perf_counter()
        child = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = child.communicate()
        wall = time.perf_counter() - started
        rss_mb = _child_peak_rss_mb(child)
        if child.returncode:
            sys.exit(f"{system} failed (exit {child.returncode}):\n{err.decode()[-3000:]}")
        if system.startswith("keel"):
            steps = keel_steps(work)
        else:
            line = [ln for ln in out.decode().splitlines() if ln.startswith("STEPS ")][-1]
            steps = [tuple(s) for s in json.loads(line[len("STEPS ") :])]
    steady = steps[1:] or steps
    return {
        "wall_s": wall,
        "peak_rss_mb": rss_mb,
        "steps": len(steps),
        "real_tokens": sum(t for t, _ in steps),
        "first_step_s": steps[0][1],
        "steady_tokens_per_s": sum(t for t, _ in steady) / sum(s for _, s in steady),
    }


def _child_peak_rss_mb(child: subprocess.Popen) -> float:
    """The finished child's peak RSS. RUSAGE_CHILDREN's ru_maxrss is the largest of any
    child this process reaped; run_once runs in its own process (`--single`), so that is
    this child's."""
    import resource

    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


def matmul_limit(kinds: set[str], rounds: int = 5, size: int = 2048) -> dict[str, float]:
    """Best GFLOP/s of a size x size matmul in each of `kinds` (fp32, bf16) on this CPU (all
    threads). Only the kinds the run needs: on a CPU without bf16 units, the bf16 one alone
    takes minutes."""
    import torch

    best = {}
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    for name, dtype in ((k, dtypes[k]) for k in sorted(kinds)):
        a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
        a @ b
        for _ in range(rounds):
            start = time.perf_counter()
            for _ in range(3):
                a @ b
            rate = 3 * 2 * size**3 / (time.perf_counter() - start) / 1e9
            best[name] = max(best.get(name, 0.0), rate)
    return best


def parameter_count() -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir()))
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="readme,long")
    parser.add_argument("--precisions", default="fp32,auto")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--set", action="append", default=[], help="keel override key=value")
    parser.add_argument("--trl-worker")
    parser.add_argument("--single")  # one run in its own process (for its own peak RSS)
    parser.add_argument("--data")
    parser.add_argument("--work")
    parser.add_argument("--precision", default="fp32")
    args = parser.parse_args()
    if args.trl_worker:
        trl_worker(
            Path(args.data), Path(args.work), args.precision, args.trl_worker == "trl-packed"
        )
        return
    if args.single:
        report_result(run_once(args.single, Path(args.data), args.precision, args.set))
        return
    model_dir()  # convert once, outside any timed run
    limit = matmul_limit({_matmul_kind(p) for p in args.precisions.split(",")})
    params = parameter_count()
    print(f"matmul limit: {_limits(limit)}")
    results: dict[tuple, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes.split(","):
            data = Path(tmp) / f"{shape}.json"
            make_dataset(data, shape)
            for precision in args.precisions.split(","):
                for round_index in range(args.rounds):
                    systems = args.systems.split(",")
                    if round_index % 2:  # which goes first alternates too
                        systems = systems[::-1]
                    for system in systems:
                        result = _isolated(system, data, precision, args.set)
                        results.setdefault((shape, precision, system), []).append(result)
                        print(
                            f"{shape} {precision} round {round_index + 1} {system}: "
                            f"{result['wall_s']:.1f} s end to end, steady "
                            f"{result['steady_tokens_per_s']:.1f} tokens/s, step 1 "
                            f"{result['first_step_s']:.1f} s, peak RSS "
                            f"{result['peak_rss_mb']:.0f} MB",
                            flush=True,
                        )
    print(table(results, limit, params))


def _matmul_kind(precision: str) -> str:
    """The matmul a precision setting trains in here: fp32, or bf16 under `auto`."""
    return "fp32" if precision == "fp32" else "bf16"


def _limits(limit: dict[str, float]) -> str:
    return ", ".join(f"{kind} {rate:.0f} GFLOP/s" for kind, rate in sorted(limit.items()))


def _isolated(system: str, data: Path, precision: str, overrides: list[str]) -> dict:
    """run_once in an intermediate process, so RUSAGE_CHILDREN holds this run only."""
    command = [sys.executable, __file__, "--single", system, "--data", str(data)]
    command += ["--precision", precision, *(f"--set={o}" for o in overrides)]
    return read_result(command, system, ROOT)


def table(results: dict[tuple, list[dict]], limit: dict[str, float], params: int) -> str:
    lines = [
        f"matmul limit: {_limits(limit)}; "
        f"FLOPs/token = 4 x {params / 1e6:.1f}M; medians over rounds",
        "",
        "| data | precision | system | end to end s | keel speed-up (e2e) | steady tokens/s "
        "| keel speed-up (steady) | step 1 s | % of matmul limit | peak RSS MB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (shape, precision, system), runs in results.items():
        keel = results.get((shape, precision, "keel"))

        def median(key, rows=runs):
            return statistics.median(r[key] for r in rows)

        wall, steady = median("wall_s"), median("steady_tokens_per_s")
        e2e_ratio = f"{wall / median('wall_s', keel):.2f}x" if keel else "-"
        steady_ratio = f"{median('steady_tokens_per_s', keel) / steady:.2f}x" if keel else "-"
        kind = _matmul_kind(precision)
        fraction = 4 * params * steady / (limit[kind] * 1e9)
        lines.append(
            f"| {shape} | {precision} | {system} | {wall:.1f} | {e2e_ratio} | {steady:.1f} | "
            f"{steady_ratio} | {median('first_step_s'):.1f} | {100 * fraction:.0f}% of {kind} | "
            f"{max(r['peak_rss_mb'] for r in runs):.0f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
