"""What streaming saves before training starts: prepared vs streamed pretraining data.

A synthetic corpus (`--docs` documents of 100-1,500 words drawn from keel's docs, one JSONL
file) trains a tiny random Llama with the bundled SmolLM2 tokenizer for `--steps` steps
(pt, cutoff_len 1024, packed), each run a whole `keel train` process with a cold data cache:
- prepared: data.streaming false, the whole corpus read, tokenized, packed and cached first;
- streamed: data.streaming true, blocks of 1,024 rows read as the steps need them.
Systems alternate within each round. Reported per system (median over rounds; RSS: the
largest): the process's wall time, its peak RSS (keel_run.json) and its seconds outside the
training steps (wall time less metrics.jsonl's step_seconds: set-up, data, outputs).

    python benchmarks/streaming_start.py [--docs 20000] [--steps 3] [--rounds 2]
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

ROOT = Path(__file__).resolve().parents[1]
SYSTEMS = {"prepared": ["data.streaming=false"], "streamed": ["data.streaming=true"]}


def write_corpus(path: Path, docs: int) -> int:
    """`docs` documents of random words from keel's docs; returns the corpus's bytes."""
    words = " ".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))).split()
    rng = random.Random(0)
    with path.open("w") as f:
        for _ in range(docs):
            f.write(json.dumps({"text": " ".join(rng.choices(words, k=rng.randint(100, 1500)))}))
            f.write("\n")
    return path.stat().st_size


SMALL = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=2048,
)  # fmt: skip


def tiny_model(folder: Path, sizes: dict = SMALL) -> Path:
    """A random Llama of `sizes` (LlamaConfig's keys; by default 2 layers, so the steps
    stay cheap) with the bundled model's tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from keel.models import resolve_model_path

    bundled = resolve_model_path("bundled:smollm2-135m-instruct", "~/.cache/keel", log=print)
    tokenizer = AutoTokenizer.from_pretrained(bundled)
    config = LlamaConfig(vocab_size=len(tokenizer), **sizes)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def run_once(system: str, corpus: Path, model: Path, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        config = {
            "model": {"path": str(model), "cache_dir": str(work / "cache")},  # a cold cache
            "method": {"type": "full"},
            "data": {"datasets": [str(corpus)], "cutoff_len": 1024, "packing": True},
            "train": {"stage": "pt", "max_steps": steps, "precision": "fp32", "lr": 1e-4},
            "output": {"dir": str(work / "out")},
        }
        (work / "job.yaml").write_text(yaml.safe_dump(config))
        command = [sys.executable, "-m", "keel", "train", str(work / "job.yaml"), *SYSTEMS[system]]
        started = time.perf_counter()
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        wall = time.perf_counter() - started
        if done.returncode:
            sys.exit(f"{system} failed:\n{done.stderr[-3000:]}")
        records = [json.loads(line) for line in (work / "out/metrics.jsonl").open()]
        steps = [r for r in records if "loss" in r]
        summary = json.loads((work / "out/keel_run.json").read_text())
        return {
            "wall_s": wall,
            "peak_rss_mb": summary["peak_rss_mb"],  # the process's high-water mark
            "before_steps_s": wall - sum(r["step_seconds"] for r in steps),
            "first_loss": steps[0]["loss"],
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--docs", type=int, default=20000)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.jsonl"
        size = write_corpus(corpus, args.docs)
        model = tiny_model(Path(tmp) / "model")
        print(f"corpus: {args.docs} documents, {size / 2**20:.0f} MiB; {args.steps} steps each")
        results: dict[str, list[dict]] = {name: [] for name in SYSTEMS}
        for round_ in range(args.rounds):
            order = list(SYSTEMS) if round_ % 2 == 0 else list(reversed(SYSTEMS))
            for system in order:
                result = run_once(system, corpus, model, args.steps)
                results[system].append(result)
                print(f"  {system}: {json.dumps({k: round(v, 2) for k, v in result.items()})}")
    print("\n| data | wall s | outside the steps s | peak RSS MB |\n|---|---|---|---|")
    for system, runs in results.items():
        wall = statistics.median(r["wall_s"] for r in runs)
        before = statistics.median(r["before_steps_s"] for r in runs)
        rss = max(r["peak_rss_mb"] for r in runs)
        print(f"| {system} | {wall:.1f} | {before:.1f} | {rss:.0f} |")


if __name__ == "__main__":
    main()
