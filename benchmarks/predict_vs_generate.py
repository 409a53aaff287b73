"""keel predict's generation vs transformers' generate, the way LLaMA-Factory's predict runs
it (their nlg_eval example: per_device_eval_batch_size 1; and 16 rows padded on the left).

One process, the bundled SmolLM2-135M-Instruct (fp32, CPU unless a GPU is visible), the
same N chat prompts (rendered with the chat template and its generation prompt), greedy,
at most M new tokens each. Per round, alternating: keel's engine (the one `keel predict`
and `keel serve` run, --max-batch-size B), transformers' generate one prompt at a time,
and generate over batches of B left-padded prompts. Reports the best round of each (on a
shared machine a burst of other work slows one round), new tokens per second (up to and
including each answer's end token), the ratios, and how many answers equal the one-at-a-time
ones token for token.

    python benchmarks/predict_vs_generate.py [--rows 32] [--max-new-tokens 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from serve_batching import QUESTIONS  # the questions of the serving benchmark


def _answer(ids: list[int], stops: set[int]) -> list[int]:
    """`ids` up to and including the first stop token."""
    for i, token in enumerate(ids):
        if token in stops:
            return ids[: i + 1]
    return ids


def keel_engine(model, tokenizer, prompts, args) -> list[list[int]]:
    from keel.infer.batch_generate import GroupRequest, Sampling, generate_groups

    requests = [GroupRequest(prompt_ids=p, n=1, seed=i) for i, p in enumerate(prompts)]
    sampling = Sampling(max_tokens=args.max_new_tokens, temperature=0.0)
    done = generate_groups(model, tokenizer, requests, sampling, max_batch_size=args.batch)
    return [group[0].token_ids for group in done]


def hf_generate(model, tokenizer, prompts, args, batch: int) -> list[list[int]]:
    from keel.infer.generate import stop_token_ids

    stops = stop_token_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    answers = []
    for start in range(0, len(prompts), batch):
        part = prompts[start : start + batch]
        width = max(len(p) for p in part)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in part])  # [b, width]
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in part])
        with torch.no_grad():
            out = model.generate(
                input_ids=ids.to(model.device),
                attention_mask=mask.to(model.device),
                max_new_tokens=args.max_new_tokens,
                do_sample=False,
                eos_token_id=stops,
                pad_token_id=pad,
            )  # [b, width + new]
        answers += [_answer(row[width:].tolist(), set(stops)) for row in out]
    return answers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("outputs/bench-predict"))
    parser.add_argument("--cache-dir", default="~/.cache/keel")
    args = parser.parse_args()

    from keel.models import load_for_inference

    model, tokenizer = load_for_inference(
        "bundled:smollm2-135m-instruct", None, cache_dir=args.cache_dir, log=lambda m: None
    )
    if torch.cuda.is_available():
        model = model.to("cuda")
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.rows)]
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        for q in questions
    ]
    prompts = [list(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    runs = {
        "keel engine": lambda: keel_engine(model, tokenizer, prompts, args),
        "generate, one at a time": lambda: hf_generate(model, tokenizer, prompts, args, 1),
        f"generate, batches of {args.batch}": lambda: hf_generate(
            model, tokenizer, prompts, args, args.batch
        ),
    }
    best: dict[str, float] = {}
    answers: dict[str, list[list[int]]] = {}
    for round_ in range(args.rounds):
        for name, run in runs.items():
            started = time.perf_counter()
            answers[name] = run()
            seconds = time.perf_counter() - started
            best[name] = min(best.get(name, seconds), seconds)
            print(f"round {round_ + 1}: {name}: {seconds:.1f} s", flush=True)
    reference = answers["generate, one at a time"]
    rows = []
    for name, seconds in best.items():
        tokens = sum(len(a) for a in answers[name])
        same = sum(a == b for a, b in zip(answers[name], reference))
        rows.append(
            {
                "run": name,
                "seconds": round(seconds, 2),
                "new_tokens": tokens,
                "tokens_per_s": round(tokens / seconds, 1),
                "same_as_one_at_a_time": f"{same}/{len(reference)}",
            }
        )
    base = best["generate, one at a time"]
    for row in rows:
        row["speed_vs_one_at_a_time"] = round(base / best[row["run"]], 2)
    args.out.mkdir(parents=True, exist_ok=True)
    settings = {"rows": args.rows, "max_new_tokens": args.max_new_tokens, "batch": args.batch}
    (args.out / "results.json").write_text(
        json.dumps({"settings": settings, "runs": rows}, indent=2) + "\n"
    )
    print("| run | s | new tokens | tokens/s | x one at a time | same answers |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['run']} | {r['seconds']} | {r['new_tokens']} | {r['tokens_per_s']} | "
            f"{r['speed_vs_one_at_a_time']} | {r['same_as_one_at_a_time']} |"
        )


if __name__ == "__main__":
    main()
