"""What the watchdog costs a training step: the same run with it on and off, alternating.

On: the watchdog thread (heartbeats to the rendezvous store every second, peer and stall
checks), a progress mark at every decoder layer's forward and in the step, and, with
several processes, the cross-check of each of keel's own collectives through the store.
Off (`watchdog.enabled=false`): none of that.

A random Llama-architecture model (~30M parameters, SmolLM2's tokenizer) is built once in
--work-dir; each run is a whole `keel train` process of --steps steps; steady-state
tokens/s is the mean of metrics.jsonl's 10-step windows after the first (which holds the
warm-up step). Runs alternate on/off (which goes first alternates too) for --rounds rounds,
for one process and for --nproc 2 (DDP, gloo).

    python benchmarks/watchdog_overhead.py [--rounds 5] [--steps 40] [--nproc 1,2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

ARCH = dict(
    hidden_size=512,
    intermediate_size=1376,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=49152,
    tie_word_embeddings=True,
    max_position_embeddings=1024,
)


def build_model(model_dir: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from keel.models import load_tokenizer, resolve_model_path

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**ARCH)).save_pretrained(str(model_dir))
    tokenizer_dir = resolve_model_path("bundled:smollm2-135m-instruct", "~/.cache/keel", log=print)
    load_tokenizer(tokenizer_dir).save_pretrained(str(model_dir))


def prepare(work: Path) -> None:
    if not (work / "model/config.json").is_file():
        work.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, __file__, "--build", str(work / "model")], check=True)
    rows = [
        {
            "instruction": f"Describe item {i} in a few words, please, with some detail.",
            "output": " ".join(f"word{(i * 7 + j) % 97}" for j in range(60)),
        }
        for i in range(64)
    ]
    (work / "data.json").write_text(json.dumps(rows))


def run(work: Path, *, watchdog: bool, nproc: int, steps: int, name: str) -> float:
    out = work / f"out-{name}"
    config = {
        "model": {"path": str(work / "model"), "cache_dir": str(work / "cache")},
        "method": {"type": "full"},
        "data": {"datasets": [str(work / "data.json")], "cutoff_len": 256},
        "train": {
            "max_steps": steps,
            "micro_batch_size": 2,
            "precision": "fp32",
            "resume": "never",
            "scheduler": "constant",
            "lr": 1e-4,
        },
        "output": {"dir": str(out), "overwrite": True, "log_every": 10},
        "watchdog": {"enabled": watchdog},
    }
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    args = [sys.executable, "-m", "keel", "train", str(path)]
    if nproc > 1:
        args += ["--nproc", str(nproc), "distributed.strategy=ddp"]
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stderr[-3000:]}")
    # Steady state: the logging windows after the first (which holds the warm-up step).
    windows = [
        r["tokens_per_s"]
        for r in map(json.loads, (out / "metrics.jsonl").open())
        if "tokens_per_s" in r and r["step"] > 10
    ]
    return statistics.mean(windows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/keel-bench-watchdog"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--nproc", default="1,2", help="process counts to measure")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--build", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.build:
        build_model(args.build)
        return
    prepare(args.work_dir)
    print("| processes | watchdog off tokens/s | on tokens/s | overhead |")
    print("|---|---|---|---|")
    for nproc in (int(n) for n in args.nproc.split(",")):
        results: dict[bool, list[float]] = {False: [], True: []}
        for round_ in range(args.rounds):
            for on in (round_ % 2 == 0, round_ % 2 == 1):  # alternate which goes first
                name = f"{nproc}p-{'on' if on else 'off'}-{round_}"
                results[on].append(
                    run(args.work_dir, watchdog=on, nproc=nproc, steps=args.steps, name=name)
                )
        off, on = statistics.median(results[False]), statistics.median(results[True])
        print(
            f"| {nproc} | {off:.0f} ({', '.join(f'{x:.0f}' for x in results[False])}) | "
            f"{on:.0f} ({', '.join(f'{x:.0f}' for x in results[True])}) | "
            f"{100 * (off - on) / off:+.2f}% |",
            flush=True,
        )


if __name__ == "__main__":
    main()
