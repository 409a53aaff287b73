"""Generate the GRPO demo's data: "What is a + b?" for one-digit a and b, with the answer.

Rows are TRL's prompt-only format: `prompt` is a conversation (one user message) and every
other column reaches the reward functions as a keyword argument (here `answer`, the sum as
text). The 100 ordered pairs (a, b) with a, b in 0..9 are shuffled once with --seed and split:
the first --heldout pairs are held out (never trained on: the demo measures them before and
after training), the rest are the training prompts. The same seed always gives the same split.

    python examples/data/grpo/make_sums.py --out DIR [--heldout 20] [--seed 0]

writes DIR/train.jsonl and DIR/heldout.jsonl.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def question(a: int, b: int) -> dict:
    """One prompt-only row: the question as a user message and its answer."""
    return {"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b)}


def split(heldout: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(training rows, held-out rows): disjoint, together every pair once."""
    pairs = [(a, b) for a in range(10) for b in range(10)]
    random.Random(seed).shuffle(pairs)
    rows = [question(a, b) for a, b in pairs]
    return rows[heldout:], rows[:heldout]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for train.jsonl and heldout.jsonl")
    parser.add_argument("--heldout", type=int, default=20, help="pairs kept out of training")
    parser.add_argument("--seed", type=int, default=0, help="seed of the split")
    args = parser.parse_args()
    train, heldout = split(args.heldout, args.seed)
    write_jsonl(Path(args.out) / "train.jsonl", train)
    write_jsonl(Path(args.out) / "heldout.jsonl", heldout)
    print(f"{args.out}: {len(train)} training prompts, {len(heldout)} held-out prompts")


if __name__ == "__main__":
    main()
