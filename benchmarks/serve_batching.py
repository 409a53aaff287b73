"""keel serve: N concurrent streaming requests vs the same N one after another.

Starts `keel serve` in its own process on the bundled SmolLM2-135M-Instruct (fp32, CPU
unless a GPU is visible), then sends the same N chat requests (different questions, same
max_tokens, temperature 0, streamed) first one at a time, then all at once, for R rounds;
the best round of each is reported (on a shared machine a burst of other work slows one
round, most of all the one-at-a-time run). Reports aggregate completion tokens/s,
p50/p95 latency and time to first token for both, their ratio, whether each concurrent
answer equals its serial one, and a bounded load test (L requests at once against
--max-concurrency L, --max-batch-size B) that must end with no errors.

    python benchmarks/serve_batching.py [--requests 16] [--max-tokens 64] [--load 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx

MODEL = "bundled:smollm2-135m-instruct"
QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for staying healthy.",
    "Write a haiku about the sea.",
    "Explain gravity to a child in two sentences.",
    "hi",
    "What is 12 times 12?",
    "Name three animals that live in the ocean and say one fact about each of them.",
    "Why is the sky blue?",
    "Translate 'good morning' into Spanish and French.",
    "List the planets of the solar system in order from the sun.",
    "What does a compiler do?",
    "Suggest a name for a small bakery.",
    "How do I boil an egg?",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "What is the difference between weather and climate?",
    "Write a short thank-you note to a teacher.",
]


@dataclass
class Result:
    text: str
    tokens: int
    latency: float  # request sent -> last byte
    first_token: float  # request sent -> first text
    error: str | None = None


def ask(url: str, question: str, max_tokens: int) -> Result:
    """One streamed chat request; counts tokens from the usage chunk."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first, pieces, tokens = None, [], 0
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
            if r.status_code != 200:
                r.read()
                return Result("", 0, time.perf_counter() - start, 0.0, f"HTTP {r.status_code}")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                if "error" in chunk:
                    return Result(
                        "", 0, time.perf_counter() - start, 0.0, chunk["error"]["message"]
                    )
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk["choices"]:
                    if choice["delta"].get("content"):
                        first = first or time.perf_counter() - start
                        pieces.append(choice["delta"]["content"])
    except httpx.HTTPError as e:
        return Result("", 0, time.perf_counter() - start, 0.0, f"{type(e).__name__}: {e}")
    return Result("".join(pieces), tokens, time.perf_counter() - start, first or 0.0)


def run_serial(url: str, questions: list[str], max_tokens: int) -> tuple[list[Result], float]:
    start = time.perf_counter()
    results = [ask(url, q, max_tokens) for q in questions]
    return results, time.perf_counter() - start


def run_together(url: str, questions: list[str], max_tokens: int) -> tuple[list[Result], float]:
    start = time.perf_counter()
    with ThreadPoolExecutor(len(questions)) as pool:
        results = list(pool.map(lambda q: ask(url, q, max_tokens), questions))
    return results, time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(name: str, results: list[Result], wall: float) -> dict:
    tokens = sum(r.tokens for r in results)
    latencies = [r.latency for r in results]
    firsts = [r.first_token for r in results if not r.error]
    return {
        "name": name,
        "requests": len(results),
        "errors": sum(r.error is not None for r in results),
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "p50_s": statistics.median(latencies),
        "p95_s": percentile(latencies, 0.95),
        "ttft_p50_s": statistics.median(firsts) if firsts else float("nan"),
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| run | requests | errors | tokens | wall s | tokens/s | p50 latency s | p95 latency s | p50 first token s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r['requests']} | {r['errors']} | {r['tokens']} | {r['wall_s']:.1f} "
            f"| {r['tokens_per_s']:.1f} | {r['p50_s']:.2f} | {r['p95_s']:.2f} | {r['ttft_p50_s']:.2f} |"
        )
    return "\n".join(lines)


def start_server(args) -> tuple[subprocess.Popen, str]:
    command = [
        *(sys.executable, "-m", "keel", "serve", "--model", MODEL, "--port", "0"),
        *("--max-batch-size", str(args.max_batch_size)),
        *("--max-concurrency", str(max(args.load, args.requests))),
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    for line in process.stdout:
        if found := re.search(r"on (http://[\d.]+:\d+)/", line):
            return process, found.group(1)
    raise SystemExit("keel serve did not start; run the command above to see why")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--load", type=int, default=64, help="requests in the load test")
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3, help="serial/concurrent rounds")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON too")
    args = parser.parse_args()
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.requests)]
    process, url = start_server(args)
    rounds = {"serial": [], "together": []}
    try:
        ask(url, "warm up", 4)
        for _ in range(args.rounds):
            rounds["serial"].append(run_serial(url, questions, args.max_tokens))
            rounds["together"].append(run_together(url, questions, args.max_tokens))
        load_questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.load)]
        load, load_wall = run_together(url, load_questions, args.max_tokens)
    finally:
        process.terminate()
        process.wait(timeout=60)
    serial, serial_wall = min(rounds["serial"], key=lambda run: run[1])
    together, together_wall = min(rounds["together"], key=lambda run: run[1])
    walls = {mode: [f"{wall:.1f}" for _, wall in runs] for mode, runs in rounds.items()}
    print(
        f"wall seconds per round: one after another {walls['serial']}, at once {walls['together']}"
    )
    rows = [
        summary(f"{args.requests} one after another (best round)", serial, serial_wall),
        summary(f"{args.requests} at once (best round)", together, together_wall),
        summary(f"load: {args.load} at once (batch {args.max_batch_size})", load, load_wall),
    ]
    same = sum(a.text == b.text for a, b in zip(serial, together))
    print(table(rows))
    print(
        f"\naggregate tokens/s, {args.requests} at once vs one after another: "
        f"{rows[1]['tokens_per_s'] / rows[0]['tokens_per_s']:.2f}x"
    )
    print(f"concurrent answers equal to their serial answers: {same}/{len(serial)}")
    print(f"load test errors: {rows[2]['errors']} of {args.load}")
    if args.json:
        print(json.dumps(rows, indent=1))
    every = [r for runs in rounds.values() for results, _ in runs for r in results]
    if rows[2]["errors"] or any(r.error is not None for r in every):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
