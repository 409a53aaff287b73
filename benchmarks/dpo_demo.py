"""DPO on the bundled model: train examples/dpo_bundled.yaml, then measure on held-out pairs.

The training pairs prefer a friendly answer ("Sure! ... Hope that helps!") to a curt one.
The 16 held-out pairs (examples/data/preference/heldout.jsonl) ask other questions in the
same style. Before (base model) and after (base + the trained LoRA adapter) it reports:

- implicit reward accuracy and margin: reward = beta x (policy - reference) summed log-prob
  of an answer, the base being the reference, scored by keel's own PreferenceObjective.
  Before training the policy is the reference, so every reward is 0 and every pair a tie:
  accuracy 0 and margin 0 by definition, not by measurement;
- how often the policy itself gives the chosen answer more probability than the rejected
  one, by summed log-prob and by mean log-prob per token (the chosen answers are longer, so
  the sum starts out favouring the curt ones);
- greedy replies to the 16 held-out prompts: the fraction that start with "Sure!" and the
  fraction that contain "Hope that helps", and the fraction that are degenerate (a phrase
  said twice, or text stuttering), with two examples; all replies go to
  <out>/heldout_replies.json.

Everything is scored in fp32 on the CPU, whatever precision the training chose.

    python benchmarks/dpo_demo.py [--out outputs/dpo-bundled] [--readme FILE] [--set KEY=VALUE]
"""

from __future__ import annotations

import argparse
import json
import re
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from demo_cli import add_demo_options, fresh_run_config

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples/dpo_bundled.yaml"
HELDOUT = ROOT / "examples/data/preference/heldout.jsonl"
MAX_NEW_TOKENS = 40
SHOWN_EXAMPLES = 2
OPENING, CLOSING = "Sure!", "Hope that helps"
# A piece of 2+ characters 4+ times in a row ("1.1.1.1."), or one symbol 6+ times (emoji);
# neither matches indentation, ellipses or numbers such as 1000000.
STUTTER = re.compile(r"(\S.+?)\1{3,}|([^\w\s.])\2{5,}", re.DOTALL)


@dataclass
class Measurement:
    """What one model does on the held-out pairs and prompts."""

    eval_loss: float
    reward_accuracy: float
    reward_margin: float
    sum_prefers_chosen: float  # fraction of pairs: summed log-prob chosen > rejected
    mean_prefers_chosen: float  # fraction of pairs: per-token log-prob chosen > rejected
    logp_chosen: float  # mean over pairs of the chosen answer's summed log-prob
    logp_rejected: float
    replies: list[str]

    @property
    def opens(self) -> float:
        return sum(r.strip().startswith(OPENING) for r in self.replies) / len(self.replies)

    @property
    def closes(self) -> float:
        return sum(CLOSING in r for r in self.replies) / len(self.replies)

    @property
    def degenerate(self) -> float:
        """Replies that say either phrase twice, or stutter (see STUTTER): an over-optimised
        policy that has learnt the phrases, or lost the language, instead of the style."""
        broken = (
            r.count(OPENING) > 1 or r.count(CLOSING) > 1 or STUTTER.search(r) is not None
            for r in self.replies
        )
        return sum(broken) / len(self.replies)


def heldout_rows(cfg, tokenizer) -> list[dict]:
    """The held-out pairs prepared exactly as the training pairs are (template, cutoff)."""
    from keel.data import prepare_data

    dataset = replace(cfg.data.datasets[0], path=str(HELDOUT))
    data_cfg = replace(cfg.data, datasets=[dataset], val_size=0.0, shuffle=False)
    data = prepare_data(
        data_cfg,
        tokenizer,
        stage="dpo",
        cache_dir=Path(cfg.model.cache_dir).expanduser(),
        base_dir=ROOT,
        seed=cfg.train.seed,
        log=lambda _msg: None,
    )
    return [data.train[i] for i in range(len(data.train))]


def heldout_prompts() -> list[list[dict]]:
    lines = HELDOUT.read_text(encoding="utf-8").splitlines()
    return [json.loads(line)["prompt"] for line in lines if line.strip()]


@torch.no_grad()
def score(objective, rows: list[dict], pad_id: int, batch_size: int) -> dict[str, float]:
    """DPO loss and statistics (keel's names) over `rows`, plus the policy's own preference."""
    from keel.data import collate
    from keel.train.preference import reduce_statistics, score_sequences

    loss, pairs, statistics = 0.0, 0.0, None
    by_sum, by_mean = [], []
    for start in range(0, len(rows), batch_size):
        batch = collate(rows[start : start + batch_size], pad_id)
        out = objective(batch)
        loss, pairs = loss + out.loss.item(), pairs + out.count.item()
        statistics = out.statistics if statistics is None else statistics + out.statistics
        scored = score_sequences(
            objective.model,
            batch,
            fast_head=objective.fast_head,
            chunk_size=objective.chunk_size,
        )
        by_sum.append(scored.sums[0::2] > scored.sums[1::2])  # [pairs]
        by_mean.append(scored.means[0::2] > scored.means[1::2])  # [pairs]
    named = reduce_statistics(objective.metric_names, statistics.double().tolist())
    return {
        "eval_loss": loss / pairs,
        **named,
        "sum_prefers_chosen": torch.cat(by_sum).float().mean().item(),
        "mean_prefers_chosen": torch.cat(by_mean).float().mean().item(),
    }


def measure(policy, reference, cfg, tokenizer, rows: list[dict]) -> Measurement:
    """Score the held-out pairs with a DPO objective and greedily answer the prompts."""
    from keel.infer.generate import generate_reply
    from keel.stages.registry import get_stage
    from keel.train.preference import PreferenceObjective

    objective = PreferenceObjective(
        policy,
        stage=get_stage("dpo"),
        settings=cfg.stage_settings,
        reference=reference,
        chunk_size=cfg.train.loss_chunk_size,
    )
    ok, why = objective.check_fast_head()  # as the trainer does: fast only if it agrees
    print(f"loss head: {'fast' if ok else 'full Hugging Face forward'} ({why})", flush=True)
    objective.fast_head = ok
    if reference is not None:
        reference.fast_head = ok
    objective.eval()
    found = score(objective, rows, tokenizer.pad_token_id, cfg.train.micro_batch_size)
    replies = [
        generate_reply(policy, tokenizer, prompt, max_new_tokens=MAX_NEW_TOKENS)
        for prompt in heldout_prompts()
    ]
    return Measurement(
        eval_loss=found["eval_loss"],
        reward_accuracy=found["rewards/accuracies"],
        reward_margin=found["rewards/margins"],
        sum_prefers_chosen=found["sum_prefers_chosen"],
        mean_prefers_chosen=found["mean_prefers_chosen"],
        logp_chosen=found["logps/chosen"],
        logp_rejected=found["logps/rejected"],
        replies=replies,
    )


def report(before: Measurement, after: Measurement, cfg, trained: dict, command: str) -> str:
    """The markdown section: settings, training, the before/after table and examples."""
    rows = [
        ("DPO loss (sigmoid)", "eval_loss", "{:.4f}"),
        ("implicit reward accuracy (chosen > rejected)", "reward_accuracy", "{:.0%}"),
        ("mean reward margin", "reward_margin", "{:.3f}"),
        ("policy prefers chosen, summed log-prob", "sum_prefers_chosen", "{:.0%}"),
        ("policy prefers chosen, mean log-prob per token", "mean_prefers_chosen", "{:.0%}"),
        ("mean summed log-prob, chosen", "logp_chosen", "{:.2f}"),
        ("mean summed log-prob, rejected", "logp_rejected", "{:.2f}"),
        (f'greedy replies starting with "{OPENING}"', "opens", "{:.0%}"),
        (f'greedy replies containing "{CLOSING}"', "closes", "{:.0%}"),
        ("degenerate greedy replies (a phrase twice, or stuttering)", "degenerate", "{:.0%}"),
    ]
    n = len(before.replies)
    lines = [
        "```",
        command,
        "```",
        "",
        f"Training: {trained['steps']} steps, {trained['pairs_seen']} pairs seen over "
        f"{cfg.train.epochs:g} epochs, LoRA r={cfg.method.lora.r}, lr {cfg.train.lr:g}, "
        f"beta {cfg.stage_settings.beta:g}, precision {trained['precision']}, "
        f"{trained['threads']} CPU thread(s): {trained['wall']:.0f} s wall "
        f"({trained['train_seconds']:.0f} s in optimizer steps), training loss "
        f"{trained['first_loss']:.3f} (step 1) -> {trained['last_loss']:.3f} (last step).",
        "",
        f"Held-out: {n} pairs/prompts not seen in training; the reference is the base model; "
        f"greedy replies of at most {MAX_NEW_TOKENS} new tokens.",
        "",
        "| held-out measure | before (base) | after (base + DPO LoRA) |",
        "|---|---|---|",
    ]
    for label, key, fmt in rows:
        lines.append(
            f"| {label} | {fmt.format(getattr(before, key))} | {fmt.format(getattr(after, key))} |"
        )
    lines += [
        "",
        "Before training the policy *is* the reference, so every implicit reward is 0 and every "
        "pair a tie: the reward accuracy is 0 and the margin 0 by definition.",
        "",
    ]
    for index, prompt in enumerate(heldout_prompts()[:SHOWN_EXAMPLES]):
        lines += [
            f"**{prompt[-1]['content']}**",
            f"- before: {_one_line(before.replies[index])}",
            f"- after: {_one_line(after.replies[index])}",
            "",
        ]
    return "\n".join(lines)


def _one_line(text: str) -> str:
    return " ".join(text.split()) or "(empty)"


def train(cfg) -> dict:
    from keel.train.run import run_training

    began = time.perf_counter()
    result = run_training(cfg, base_dir=ROOT)
    wall = time.perf_counter() - began
    return {
        "wall": wall,
        "steps": result.steps,
        "train_seconds": result.summary["train_seconds"],
        "pairs_seen": result.summary["target_tokens"],  # a preference stage's targets: pairs
        "precision": result.summary.get("precision", cfg.train.precision),
        "threads": torch.get_num_threads(),  # run_training set it from train.threads
        "first_loss": result.losses[0],
        "last_loss": result.losses[-1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="outputs/dpo-bundled", help="training output dir")
    add_demo_options(parser, set_example="train.threads=1 on a busy machine")
    args = parser.parse_args()

    from peft import PeftModel

    from keel.models import load_model, load_tokenizer, resolve_model_path
    from keel.train.preference import SequenceScorer

    out = Path(args.out).expanduser().resolve()
    cfg = fresh_run_config(CONFIG, args.overrides, out)
    trained = train(cfg)

    model_dir = resolve_model_path(cfg.model.path, cfg.model.cache_dir)
    tokenizer = load_tokenizer(model_dir)
    rows = heldout_rows(cfg, tokenizer)
    base = load_model(model_dir, dtype=torch.float32).eval()
    print("measuring the base model on the held-out pairs ...", flush=True)
    reference = SequenceScorer(base, chunk_size=cfg.train.loss_chunk_size, fast_head=False)
    before = measure(base, reference, cfg, tokenizer, rows)
    # PEFT wraps `base` in place; with its adapters switched off it is the reference again,
    # exactly as during training (no second copy).
    print("measuring base + the trained adapter ...", flush=True)
    policy = PeftModel.from_pretrained(base, str(out)).eval()
    after = measure(policy, None, cfg, tokenizer, rows)

    command = " ".join(
        [".venv/bin/python benchmarks/dpo_demo.py"]
        + ([f"--out {args.out}"] if args.out != "outputs/dpo-bundled" else [])
        + [f"--set {item}" for item in args.overrides]
    )
    text = report(before, after, cfg, trained, command)
    print(text)
    replies = [
        {"prompt": prompt[-1]["content"], "before": old, "after": new}
        for prompt, old, new in zip(heldout_prompts(), before.replies, after.replies)
    ]
    (out / "heldout_replies.json").write_text(json.dumps(replies, indent=1), encoding="utf-8")
    print(f"all {len(replies)} replies before/after: {out / 'heldout_replies.json'}")
    if args.readme:
        Path(args.readme).write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
