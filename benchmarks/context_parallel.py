"""What context and tensor parallelism save: one long row per step, on one process or split
over two.

A random 4-layer Llama (hidden 256, 8 heads, the bundled SmolLM2 tokenizer's vocabulary)
pretrains on rows of `--tokens` tokens (one document cut into pieces of cutoff_len, packed:
each step is one whole row), without gradient checkpointing, so that the saved activations
are the memory that grows with the row. Systems, each a whole `keel train` run, alternating
within each round:
- one: 1 process holds the whole row;
- cp2: 2 processes (`--nproc 2`, distributed.context_parallel 2, DDP) each hold half of it;
- tp2: 2 processes (`--nproc 2`, distributed.tensor_parallel 2, FSDP2 over the one group)
  each hold the whole row but half of every layer's heads and MLP columns, and of their
  weights (with `--stage sft`: of the language model's layers; the vision tower stays whole).
With `--stage dpo` each step is one preference pair instead, LoRA (the reference is the
base with the adapters off): its chosen and rejected sequences, each about half of
`--tokens` (a long prompt and answers of about 100 words), laid end to end in one row.
With `--stage grpo` each step is one prompt of about `--tokens` tokens (a document to
answer about), LoRA, 2 completions of 16 tokens sampled and scored by their length: the
prompt runs through the model once for both (keel.data.shared_prompt), so the row is the
prompt and the completions.
With `--stage sft --images N` the model is a random Qwen2-VL (the same language model, a
2-block vision tower) and each step is one conversation of about `--tokens` tokens with N
images of 448x448 (256 image tokens each) spread through its text, LoRA: each process
encodes every image and embeds the whole row, and its language model takes its part
(keel.models.attention.embed_whole_row).
Reported per system (median over rounds): the memory the steps add to a process (its peak
RSS less its peak RSS when the model was ready, keel_run.json, largest process; and rank
0's, which prepared the data as the one process did), the largest process's peak RSS, `keel
plan`'s activation estimate per device, the median step time, and the first step's loss
(dpo: its chosen answer's log-prob; grpo: its grad norm), the same for both: the split computes
the same row.

    python benchmarks/context_parallel.py [--tokens 8192] [--steps 4] [--rounds 2]
        [--stage pt|dpo|grpo|sft] [--images 8]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml
from streaming_start import tiny_model

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Data:
    stage: str  # pt: one long document; dpo: long pairs; grpo: long prompts; sft: images
    path: Path
    cutoff_len: int
    images: int = 0  # sft: images per conversation (a vision-language model)


SYSTEMS = {
    "one": [],
    "cp2": ["--nproc", "2", "distributed.context_parallel=2", "distributed.strategy=ddp"],
    "tp2": ["--nproc", "2", "distributed.tensor_parallel=2", "distributed.strategy=fsdp"],
}
STRATEGY = {"one": "single", "cp2": "ddp", "tp2": "fsdp"}


def doc_words() -> list[str]:
    """The words of keel's docs, but markup a chat row would read as an image placeholder
    (<image>): random text, the same for every system."""
    text = " ".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    return [word for word in text.split() if "<" not in word and ">" not in word]


def write_corpus(path: Path, tokens: int, steps: int) -> None:
    """One long document of words from keel's docs: about `steps` rows of `tokens`."""
    words = doc_words()
    rng = random.Random(0)
    text = " ".join(rng.choices(words, k=tokens * (steps + 1)))
    path.write_text(json.dumps({"text": text}) + "\n")


def write_pairs(path: Path, model: Path, tokens: int, steps: int) -> int:
    """`steps` pairs whose prompt and answer fill about tokens / 2 each (the bundled
    tokenizer counts); returns the cutoff_len that keeps each sequence whole."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    words = doc_words()
    rng = random.Random(0)
    rows, longest = [], 0
    for _ in range(steps):
        prompt = " ".join(rng.choices(words, k=tokens // 2))
        ids = tokenizer(prompt)["input_ids"][: tokens // 2 - 256]
        prompt = tokenizer.decode(ids)
        chosen, rejected = (" ".join(rng.choices(words, k=100)) for _ in range(2))
        rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
        answers = max(len(tokenizer(a)["input_ids"]) for a in (chosen, rejected))
        longest = max(longest, len(ids) + answers)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return longest + 64  # the chat template's tokens


# grpo's reward: a function of the completion alone (TRL's signature)
LENGTH_REWARD = """
def length(completions, **kwargs):
    return [len(text) / 100 for text in completions]
"""


def write_prompts(path: Path, model: Path, tokens: int, steps: int) -> int:
    """`steps` prompts of about `tokens` tokens each (a document, then a question), and
    rewards.py beside them; returns the cutoff_len that keeps each prompt whole."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    words = doc_words()
    rng = random.Random(0)
    rows, longest = [], 0
    for _ in range(steps):
        ids = tokenizer(" ".join(rng.choices(words, k=tokens)))["input_ids"][: tokens - 64]
        prompt = tokenizer.decode(ids) + "\nWhat is this text about?"
        rows.append({"prompt": prompt})
        longest = max(longest, len(tokenizer(prompt)["input_ids"]))
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    (path.parent / "rewards.py").write_text(LENGTH_REWARD)
    return longest + 64  # the chat template's tokens


QWEN2_VL_SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
IMAGE_SIDE = 448  # pixels: (448 / 28)^2 = 256 image tokens


def write_conversations(path: Path, model: Path, data: Data, steps: int) -> int:
    """`steps` conversations of about `data.cutoff_len` tokens, each with `data.images`
    images (random pixels) between pieces of text, and a short answer; returns the
    cutoff_len that keeps each conversation whole."""
    from PIL import Image
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    words, rng = doc_words(), random.Random(0)
    image_tokens = (IMAGE_SIDE // 28) ** 2
    text_tokens = data.cutoff_len - data.images * (image_tokens + 2) - 64
    piece = text_tokens // (data.images + 1)
    rows, longest = [], 0
    for step in range(steps):
        content = ""
        for index in range(data.images + 1):
            ids = tokenizer(" ".join(rng.choices(words, k=piece)))["input_ids"][:piece]
            content += tokenizer.decode(ids)
            if index < data.images:
                image = path.parent / f"image{step}-{index}.png"
                pixels = rng.randbytes(IMAGE_SIDE * IMAGE_SIDE * 3)
                Image.frombytes("RGB", (IMAGE_SIDE, IMAGE_SIDE), pixels).save(image)
                content += " <image> "
        messages = [
            {"role": "user", "content": content + "\nWhat do these pictures show?"},
            {"role": "assistant", "content": "Noise, between pieces of keel's docs."},
        ]
        rows.append({"messages": messages, "images": [str(i) for i in _images(path, step, data)]})
        longest = max(longest, len(tokenizer(content)["input_ids"]))
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return longest + data.images * (image_tokens + 2) + 128  # the template and the answer


def _images(path: Path, step: int, data: Data) -> list[Path]:
    return [path.parent / f"image{step}-{index}.png" for index in range(data.images)]


def tiny_qwen2_vl(folder: Path, sizes: dict) -> Path:
    """A random Qwen2-VL whose language model has `sizes` (LlamaConfig's keys) and whose
    vision tower has 2 blocks, with the bundled tokenizer plus Qwen2-VL's vision specials."""
    import torch
    from transformers import (
        AutoTokenizer,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessorPil,
    )

    from keel.models import resolve_model_path

    bundled = resolve_model_path("bundled:smollm2-135m-instruct", "~/.cache/keel", log=print)
    tokenizer = AutoTokenizer.from_pretrained(bundled)
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN2_VL_SPECIALS})
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN2_VL_SPECIALS}
    head_dim = sizes["hidden_size"] // sizes["num_attention_heads"]
    sections = [head_dim // 8, 3 * head_dim // 16, 3 * head_dim // 16]  # sum: head_dim / 2
    rope = {"rope_type": "default", "mrope_section": sections, "rope_theta": 10000.0}
    special = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    text = dict(sizes, vocab_size=len(tokenizer), rope_parameters=rope, **special)
    vision = dict(
        depth=2, embed_dim=64, hidden_size=sizes["hidden_size"], num_heads=4, mlp_ratio=2,
        patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
    )  # fmt: skip
    config = Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    torch.manual_seed(0)
    Qwen2VLForConditionalGeneration(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    side = IMAGE_SIDE * IMAGE_SIDE
    Qwen2VLImageProcessorPil(min_pixels=side, max_pixels=side).save_pretrained(folder)
    return folder


LONG_ROWS = dict(
    hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=4, max_position_embeddings=65536,
)  # fmt: skip


def job(work: Path, data: Data, model: Path, steps: int) -> Path:
    rows = data.stage != "pt"  # a pair or a prompt per step, not packed pieces
    config = {
        "model": {"path": str(model), "cache_dir": str(work / "cache")},
        "method": {"type": "lora" if rows else "full"},
        "data": {"datasets": [str(data.path)], "cutoff_len": data.cutoff_len, "packing": not rows},
        "train": {
            "stage": data.stage, "max_steps": steps, "precision": "fp32", "lr": 1e-4,
            "micro_batch_size": 1, "global_batch_size": 1, "threads": 1,
            "gradient_checkpointing": False,
        },
        "output": {"dir": str(work / "out"), "save_every": 0},
    }  # fmt: skip
    if data.images:  # each image at 448x448, not the default 768x768 bound
        config["model"]["vision"] = {"image_max_pixels": IMAGE_SIDE * IMAGE_SIDE}
        config["method"]["lora"] = {"dropout": 0.0}  # the check: the first loss
    if data.stage == "grpo":
        # no LoRA dropout: each process draws its own part's masks, and the first grad norm
        # (the check: B starts at 0, so the forward does not see the masks) would differ
        config["method"]["lora"] = {"dropout": 0.0}
        rewards = data.path.parent / "rewards.py"
        config["grpo"] = {
            "rewards": [f"{rewards}:length"], "num_generations": 2, "max_completion_length": 16,
        }  # fmt: skip
    (work / "job.yaml").write_text(yaml.safe_dump(config))
    return work / "job.yaml"


def planned_activations_mb(config: Path, system: str) -> float:
    overrides = [a for a in SYSTEMS[system] if "=" in a]
    gpus = "1" if system == "one" else "2"
    command = [sys.executable, "-m", "keel", "plan", str(config), *overrides, "--json"]
    command += ["--gpus", gpus, "--gpu-memory", "80GiB"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True)
    plan = json.loads(done.stdout)
    strategy = STRATEGY[system]
    option = next(
        o for o in plan["options"] if o["strategy"] == strategy and not o["gradient_checkpointing"]
    )
    return option["per_device_bytes"]["activations"] / 2**20


def run_once(system: str, data: Data, model: Path, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        config = job(work, data, model, args.steps)
        command = [sys.executable, "-m", "keel", "train", str(config), *SYSTEMS[system]]
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"{system} failed:\n{done.stderr[-3000:]}")
        records = [json.loads(line) for line in (work / "out/metrics.jsonl").open()]
        steps = [r for r in records if "loss" in r]
        summary = json.loads((work / "out/keel_run.json").read_text())
        ranks = summary["per_rank"]
        added = max(r["peak_rss_mb"] - r["load_peak_rss_mb"] for r in ranks)
        return {
            "steps_add_mb": added,
            # rank 0 prepares the data as the one process does (images decoded and resized):
            # its load peak is the higher, and its steps reuse what that phase freed
            "rank0_steps_add_mb": ranks[0]["peak_rss_mb"] - ranks[0]["load_peak_rss_mb"],
            "peak_rss_mb": max(r["peak_rss_mb"] for r in ranks),
            "planned_activations_mb": planned_activations_mb(config, system),
            "step_s": statistics.median(r["step_seconds"] for r in steps[1:] or steps),
            # pt: the first loss; dpo: the first chosen log-prob (its loss starts at ln 2
            # whatever the row, as LoRA starts as the reference); grpo: the first grad norm
            # (its loss is about 0)
            "check": _check(data.stage, steps[0]),
        }


def _check(stage: str, step: dict) -> float:
    """What the two systems must agree on: the first step's loss, or what stands for it."""
    return {"dpo": step.get("logps/chosen"), "grpo": step.get("grad_norm")}.get(stage, step["loss"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--stage", choices=("pt", "dpo", "grpo", "sft"), default="pt")
    parser.add_argument("--images", type=int, default=8, help="sft: images per conversation")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = Data(args.stage, Path(tmp) / "long.jsonl", args.tokens)
        if args.stage == "sft":
            data.images = args.images
            model = tiny_qwen2_vl(Path(tmp) / "model", LONG_ROWS)
        else:
            model = tiny_model(Path(tmp) / "model", LONG_ROWS)
        if args.stage == "sft":
            data.cutoff_len = write_conversations(data.path, model, data, args.steps)
        elif args.stage == "dpo":
            data.cutoff_len = write_pairs(data.path, model, args.tokens, args.steps)
        elif args.stage == "grpo":
            data.cutoff_len = write_prompts(data.path, model, args.tokens, args.steps)
        else:
            write_corpus(data.path, args.tokens, args.steps)
        print(f"{args.stage}: rows of about {args.tokens} tokens, {args.steps} steps of one each")
        systems = list(SYSTEMS)
        results: dict[str, list[dict]] = {name: [] for name in systems}
        for round_ in range(args.rounds):
            order = systems if round_ % 2 == 0 else list(reversed(systems))
            for system in order:
                result = run_once(system, data, model, args)
                results[system].append(result)
                print(f"  {system}: {json.dumps({k: round(v, 4) for k, v in result.items()})}")
    print(
        "\n| system | steps add (MB/process) | rank 0's | peak RSS (MB) | plan: activations (MB) | step s | loss 1 (dpo: logps/chosen 1, grpo: grad norm 1) |"
    )
    print("|---|---|---|---|---|---|---|")
    for system, runs in results.items():
        cells = [
            statistics.median(r[key] for r in runs)
            for key in (
                "steps_add_mb",
                "rank0_steps_add_mb",
                "peak_rss_mb",
                "planned_activations_mb",
            )
        ]
        step = statistics.median(r["step_s"] for r in runs)
        numbers = " | ".join(f"{cell:.0f}" for cell in cells)
        print(f"| {system} | {numbers} | {step:.2f} | {runs[0]['check']:.4f} |")


if __name__ == "__main__":
    main()
