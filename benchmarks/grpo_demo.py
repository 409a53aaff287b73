"""GRPO on a CPU: the bundled SmolLM2 learns to answer one-digit sums (held-out before/after).

1. The prompts (examples/data/grpo/, written by make_sums.py): "What is a + b?" for one-digit
   a and b, TRL's prompt-only format with an `answer` column; 80 training prompts and 20
   held-out ones (pairs never trained on).
2. Trains examples/grpo_sums.yaml with keel (`train.stage: grpo`, LoRA): each step samples a
   group of completions per prompt with keel's own generation engine, scores them with
   examples/rewards/sums.py:correct (1 when the reply's last number is the sum) and moves
   the policy towards the better completions of each group.
3. Answers every held-out question greedily before training and with the trained adapter:
   accuracy = the reward, the last number of the reply is the sum (the reply is at most
   max_completion_length tokens, as in training).
4. Writes <out>/results.json, a plot (the training reward per step and the held-out accuracy
   before/after) and the markdown section of the README.

    python benchmarks/grpo_demo.py [--out outputs/grpo-sums] [--set KEY=VALUE]
        [--plot FILE] [--readme FILE]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from demo_cli import add_demo_options, fresh_run_config

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples/grpo_sums.yaml"
HELDOUT = ROOT / "examples/data/grpo/heldout.jsonl"
REWARDS = ROOT / "examples/rewards/sums.py"


def correct_reward():
    """examples/rewards/sums.py:correct, the training reward, as the held-out measure."""
    spec = importlib.util.spec_from_file_location("sums_rewards", REWARDS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.correct


@dataclass
class Accuracy:
    """Greedy replies to the held-out questions and the share the reward calls right."""

    accuracy: float
    mean_words: float
    replies: list[dict]


@torch.no_grad()
def evaluate(model, tokenizer, max_new_tokens: int) -> Accuracy:
    """Greedy replies to the held-out prompts, scored by the training reward."""
    from keel.infer.generate import generate_reply

    rows = [json.loads(line) for line in HELDOUT.read_text(encoding="utf-8").splitlines()]
    model.eval()
    texts = [
        generate_reply(model, tokenizer, row["prompt"], max_new_tokens=max_new_tokens)
        for row in rows
    ]
    answers = [row["answer"] for row in rows]
    scores = correct_reward()(completions=texts, answer=answers)
    replies = [
        {"question": row["prompt"][-1]["content"], "answer": answer, "reply": text, "ok": ok}
        for row, answer, text, ok in zip(rows, answers, texts, scores, strict=True)
    ]
    return Accuracy(
        accuracy=sum(scores) / len(scores),
        mean_words=sum(len(t.split()) for t in texts) / len(texts),
        replies=replies,
    )


def train(cfg) -> dict:
    """keel's run of the config; the per-step reward and completion length from metrics.jsonl."""
    from keel.train.run import run_training

    began = time.perf_counter()
    result = run_training(cfg, base_dir=ROOT)
    metrics = Path(cfg.output.dir) / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text(encoding="utf-8").splitlines()]
    steps = [r for r in records if "reward" in r]
    return {
        "wall": time.perf_counter() - began,
        "steps": result.steps,
        "reward": [r["reward"] for r in steps],
        "mean_length": [r["completions/mean_length"] for r in steps],
        "threads": torch.get_num_threads(),  # run_training set it from train.threads
    }


def plot(trained: dict, before: Accuracy, after: Accuracy, path: Path) -> None:
    """Training reward per step and held-out accuracy before/after, side by side (PNG)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(9, 3.2))
    steps = range(1, len(trained["reward"]) + 1)
    left.plot(steps, trained["reward"], color="tab:blue", alpha=0.4, label="per step")
    window = 5
    smooth = [
        sum(trained["reward"][max(0, i - window + 1) : i + 1]) / min(i + 1, window)
        for i in range(len(trained["reward"]))
    ]
    left.plot(steps, smooth, color="tab:blue", label=f"mean of last {window}")
    left.set(title="training reward (share correct)", xlabel="step", ylim=(-0.03, 1.03))
    left.legend(loc="lower right", fontsize="small")
    right.bar(["before", "after"], [100 * before.accuracy, 100 * after.accuracy], color="tab:green")
    right.set(title="held-out accuracy (greedy), %", ylim=(0, 100))
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)


def report(before: Accuracy, after: Accuracy, cfg, trained: dict) -> str:
    """The README section's body: the command, the run and the before/after table."""
    grpo = cfg.stage_settings
    rewards = trained["reward"]
    lines = [
        "```",
        "make demo-grpo    # = .venv/bin/python benchmarks/grpo_demo.py",
        "```",
        "",
        f"Model: SmolLM2-135M-Instruct, LoRA r={cfg.method.lora.r}. GRPO ({grpo.loss_type}): "
        f"{trained['steps']} steps of {cfg.train.global_batch_size} prompts x "
        f"{grpo.num_generations} completions of at most {grpo.max_completion_length} tokens at "
        f"temperature {grpo.temperature:g}, lr {cfg.train.lr:g}, fp32, {trained['threads']} CPU "
        f"thread(s): {trained['wall'] / 60:.1f} min. Training reward {_mean(rewards[:5]):.2f} "
        f"(first 5 steps) -> {_mean(rewards[-5:]):.2f} (last 5).",
        "",
        f"Held-out: {len(after.replies)} sums never trained on; greedy replies; right = the "
        "reply's last number is the sum (the training reward).",
        "",
        "| held-out | before training | after training |",
        "|---|---|---|",
        f"| accuracy | {before.accuracy:.0%} | {after.accuracy:.0%} |",
        f"| mean reply length (words) | {before.mean_words:.1f} | {after.mean_words:.1f} |",
        "",
        f'"{before.replies[0]["question"]}" before: "{_flat(before)}"; after: "{_flat(after)}".',
    ]
    return "\n".join(lines)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _flat(found: Accuracy) -> str:
    return " ".join(found.replies[0]["reply"].split()) or "(empty)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="outputs/grpo-sums", help="the run and results")
    parser.add_argument("--plot", help="write the plot here (PNG)")
    add_demo_options(parser, set_example="train.max_steps=20")
    args = parser.parse_args()

    from keel.models.adapters import load_for_inference

    out = Path(args.out).expanduser().resolve()
    run_dir = out / "run"
    cfg = fresh_run_config(CONFIG, args.overrides, run_dir)
    length = cfg.stage_settings.max_completion_length
    print("answering the held-out questions before training ...", flush=True)
    base, tokenizer = load_for_inference(cfg.model.path, None, cache_dir=cfg.model.cache_dir)
    before = evaluate(base, tokenizer, length)
    del base
    trained = train(cfg)
    print("answering the held-out questions with the trained adapter ...", flush=True)
    model, tokenizer = load_for_inference(
        cfg.model.path, str(run_dir), cache_dir=cfg.model.cache_dir
    )
    after = evaluate(model, tokenizer, length)
    text = report(before, after, cfg, trained)
    print(text)
    results = {"before": before.__dict__, "after": after.__dict__, **trained}
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1), encoding="utf-8")
    plot(trained, before, after, Path(args.plot) if args.plot else out / "grpo_demo.png")
    if args.readme:
        Path(args.readme).write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
