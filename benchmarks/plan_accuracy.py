"""How close `keel plan` is to what `keel train` really uses, on this CPU.

Each case runs `keel train` for two steps on the bundled SmolLM2-135M (continued
pretraining on generated documents longer than cutoff_len, truncated to it, so every row
is exactly cutoff_len tokens and every token is a target: the shape the plan assumes;
the second step is the first with AdamW state), reads the peak RSS from
keel_run.json (the largest process's) and compares it with the plan's per-device total
for the same config, once with glibc's malloc as it comes and once with its mmap threshold
fixed (see `measure`). The first case, a random model of ~20k parameters, is the fixed
cost of a keel training process (keel.plan.devices.CPU_PROCESS_BYTES).

    python benchmarks/plan_accuracy.py [--work-dir DIR] [--only "NAME" ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

# name: (model, method, checkpointing, cutoff_len, precision, processes, strategy); a
# strategy "fsdp+tpN" is fsdp with distributed.tensor_parallel N
CASES = {
    "process baseline (20k-param model)": ("tiny", "full", False, 128, "fp32", 1, "auto"),
    "full, fp32, cutoff 512": ("bundled", "full", False, 512, "fp32", 1, "auto"),
    "full, fp32, cutoff 512, checkpointing": ("bundled", "full", True, 512, "fp32", 1, "auto"),
    "full, fp32, cutoff 1024": ("bundled", "full", False, 1024, "fp32", 1, "auto"),
    "full, bf16 autocast, cutoff 512": ("bundled", "full", False, 512, "bf16", 1, "auto"),
    "lora, fp32, cutoff 512": ("bundled", "lora", False, 512, "fp32", 1, "auto"),
    "lora, fp32, cutoff 1024": ("bundled", "lora", False, 1024, "fp32", 1, "auto"),
    "lora, fp32, cutoff 1024, checkpointing": ("bundled", "lora", True, 1024, "fp32", 1, "auto"),
    "oft, fp32, cutoff 1024": ("bundled", "oft", False, 1024, "fp32", 1, "auto"),
    "oft, fp32, cutoff 1024, checkpointing": ("bundled", "oft", True, 1024, "fp32", 1, "auto"),
    "fsdp x2, full, fp32, cutoff 512": ("bundled", "full", False, 512, "fp32", 2, "fsdp"),
    "ddp x2, lora, fp32, cutoff 512": ("bundled", "lora", False, 512, "fp32", 2, "ddp"),
    # SmolLM2's 9 heads and 3 key-value heads split 3 ways: one group of 3 (fsdp over 1)
    "fsdp x3, full, fp32, cutoff 1024": ("bundled", "full", False, 1024, "fp32", 3, "fsdp"),
    "tp x3, full, fp32, cutoff 1024": ("bundled", "full", False, 1024, "fp32", 3, "fsdp+tp3"),
}
MICRO_BATCH = 2
STEPS = 2
WORDS = (
    "river stone light paper garden window market winter engine letter forest "
    "signal harbor candle number pattern silver morning travel question"
).split()


def make_corpus(path: Path, rows: int = 16) -> None:
    """Deterministic documents of ~1500 words, each longer than the longest cutoff_len."""
    lines = []
    for i in range(rows):
        words = [WORDS[(i * 7 + j * 3 + j // 5) % len(WORDS)] for j in range(1500)]
        lines.append({"text": f"Document {i}: " + " ".join(words) + "."})
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")


def make_tiny_model(path: Path) -> None:
    """A 2-layer random Llama with the bundled model's tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from keel.models import load_tokenizer, resolve_model_path

    tokenizer = load_tokenizer(
        resolve_model_path("bundled:smollm2-135m-instruct", "~/.cache/keel", log=print)
    )
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


def write_config(work: Path, name: str, case: tuple) -> Path:
    model, method, ckpt, cutoff, precision, _processes, strategy = case
    path = str(work / "tiny") if model == "tiny" else "bundled:smollm2-135m-instruct"
    cfg = {
        "model": {"path": path},
        "method": {"type": method, "lora": {"r": 16, "alpha": 32, "dropout": 0.05}},
        "data": {
            "datasets": [{"path": str(work / "corpus.jsonl"), "format": "text"}],
            "cutoff_len": cutoff,
            "overlength": "truncate",
        },
        "train": {
            "stage": "pt",
            "max_steps": STEPS,
            "micro_batch_size": MICRO_BATCH,
            "precision": precision,
            "gradient_checkpointing": ckpt,
            "resume": "never",
        },
        "output": {"dir": str(work / "out" / _slug(name)), "overwrite": True},
        "distributed": {"strategy": _strategy(strategy), "tensor_parallel": _tp(strategy)},
    }
    out = work / f"{_slug(name)}.yaml"
    out.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return out


def _strategy(strategy: str) -> str:
    return strategy.partition("+tp")[0]


def _tp(strategy: str) -> int:
    return int(strategy.partition("+tp")[2] or 1)


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name).strip("-")


def measure(config: Path, processes: int, *, fixed_mmap: bool) -> float:
    """Peak RSS in MiB of the largest `keel train` process for `config`.

    `fixed_mmap`: glibc's mmap threshold fixed at 128 KiB (MALLOC_MMAP_THRESHOLD_), so a
    freed tensor's memory goes back to the system. By default glibc raises the threshold
    to the size of the largest block freed so far (up to 32 MiB), after which tensors up
    to that size come from the heap, and freed heap memory mostly stays with the process.
    """
    args = [sys.executable, "-m", "keel", "train", str(config)]
    if processes > 1:
        args += ["--nproc", str(processes)]
    env = dict(os.environ)
    if fixed_mmap:
        env["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
    done = subprocess.run(args, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{done.stderr[-3000:]}")
    out = Path(yaml.safe_load(config.read_text())["output"]["dir"])
    return json.loads((out / "keel_run.json").read_text())["peak_rss_mb"]


def predict(config: Path, case: tuple):
    """The plan's option for this run, as `keel train` would see it."""
    from keel.config import load_config
    from keel.plan import devices_for_run, plan_run
    from keel.precision import Precision

    _model, method, ckpt, _cutoff, precision, processes, strategy = case
    cfg = load_config(config)
    devices = devices_for_run("cpu", world_size=processes, local_world_size=processes)
    plan = plan_run(cfg, devices=devices, precision=Precision(precision, "set by train.precision"))
    return plan.option_for("single" if processes == 1 else _strategy(strategy), method, ckpt)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/keel-plan-accuracy"))
    parser.add_argument(
        "--only",
        nargs="+",
        metavar="NAME",
        choices=list(CASES),
        help="run only these cases (default: all)",
    )
    args = parser.parse_args()
    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    if not (work / "corpus.jsonl").is_file():
        make_corpus(work / "corpus.jsonl")
    if not (work / "tiny" / "config.json").is_file():
        make_tiny_model(work / "tiny")
    names = args.only or list(CASES)
    mib = 2**20
    print(
        "| run | predicted MiB | peak RSS MiB, glibc default | error | peak RSS MiB, "
        "fixed mmap threshold | error | params / grads / optimizer / activations / logits / "
        "buffers / overhead MiB |"
    )
    print("|---|---:|---:|---:|---:|---:|---|")
    for name in names:
        config = write_config(work, name, CASES[name])
        option = predict(config, CASES[name])
        d = option.per_device
        predicted = d.total / mib
        cells, measured = [], []
        for fixed in (False, True):
            measured.append(measure(config, CASES[name][5], fixed_mmap=fixed))
            error = 100 * (predicted - measured[-1]) / measured[-1]
            cells += [f"{measured[-1]:.0f}", f"{error:+.1f}%"]
        parts = " / ".join(
            f"{getattr(d, k) / mib:.0f}"
            for k in (
                "params",
                "grads",
                "optimizer",
                "activations",
                "logits",
                "buffers",
                "overhead",
            )
        )
        print(f"| {name} | {predicted:.0f} | {' | '.join(cells)} | {parts} |", flush=True)
        if CASES[name][0] == "tiny":
            baseline = measured[0] - (d.total - d.overhead) / mib  # as keel train runs
            print(
                f"|   -> process baseline: measured minus the plan's tensors = {baseline:.0f} "
                f"MiB (CPU_PROCESS_BYTES: {d.overhead / mib:.0f} MiB) | | | | | | |",
                flush=True,
            )


if __name__ == "__main__":
    main()
