"""Vision-language learning on a CPU: LLaVA's alignment stage on the bundled SmolLM2.

1. Assembles a LLaVA model (keel.models.vision.assemble): the bundled SmolLM2-135M-Instruct,
   a small randomly initialised CLIP vision tower (64x64 pictures in 16x16 patches: 16 image
   tokens) and a fresh projector. Nothing in it has ever seen a picture.
2. Draws pictures of one coloured shape (examples/data/vision/make_shapes.py): a training
   split and a held-out split drawn with another seed; each picture asks "What shape is
   this?" or "What colour is the shape?".
3. Trains examples/vision_llava_demo.yaml with keel: the projector fully and LoRA on the
   language model; the random tower stays frozen (the config says why).
4. Answers every held-out question greedily (keel's chat generation, images through the
   LLaVA plugin) before training, at each saved checkpoint and with the final adapter:
   accuracy = the reply is exactly the expected word (case and a final "." aside).
5. Writes <out>/results.json, a plot (training loss and held-out accuracy) and the
   markdown section of the README.

    python benchmarks/vision_demo.py [--out outputs/vision-demo] [--train 600] [--heldout 40]
        [--set KEY=VALUE] [--plot FILE] [--readme FILE]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from demo_cli import add_demo_options, fresh_run_config

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples/vision_llava_demo.yaml"
MAKE_SHAPES = ROOT / "examples/data/vision/make_shapes.py"
LANGUAGE_MODEL = "bundled:smollm2-135m-instruct"
MAX_NEW_TOKENS = 4


def make_shapes():
    """examples/data/vision/make_shapes.py as a module (it is a script, not a package)."""
    spec = importlib.util.spec_from_file_location("make_shapes", MAKE_SHAPES)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


@dataclass
class Accuracy:
    """Exact-match accuracy of greedy replies on the held-out questions."""

    shape: float
    colour: float
    overall: float
    replies: list[dict]


def prepare(out: Path, args, cfg_cache: str) -> tuple[Path, Path]:
    """The assembled model (once: kept in <out>/model) and freshly drawn data (<out>/data)."""
    from keel.models.bundled import resolve_model_path
    from keel.models.vision.assemble import TowerShape, assemble_llava

    model_dir = out / "model"
    if not (model_dir / "config.json").is_file():
        language = resolve_model_path(LANGUAGE_MODEL, cfg_cache)
        print(f"assembling {model_dir}: {LANGUAGE_MODEL} + random CLIP tower + projector")
        tower = TowerShape(image_size=args.size, patch_size=args.patch)
        assemble_llava(language, model_dir, tower)
    shapes = make_shapes()
    data_dir = out / "data"
    shapes.write_split(data_dir, "train", args.train, seed=0, size=args.size)
    shapes.write_split(data_dir, "heldout", args.heldout, seed=1, size=args.size)
    return model_dir, data_dir


@torch.no_grad()
def evaluate(model, tokenizer, data_dir: Path) -> Accuracy:
    """Greedy replies to the held-out questions and their exact-match accuracy."""
    from keel.infer.generate import ChatImages, generate_reply
    from keel.infer.vision import require_vision
    from keel.models.vision.images import load_image

    vision = require_vision(model, log=lambda _m: None)
    rows = json.loads((data_dir / "heldout.json").read_text(encoding="utf-8"))
    replies = []
    model.eval()
    for row in rows:
        *prompt, answer = row["messages"]
        images = ChatImages((load_image(row["images"][0], data_dir),), vision)
        reply = generate_reply(
            model, tokenizer, prompt, images=images, max_new_tokens=MAX_NEW_TOKENS
        )
        kind = "shape" if "shape is this" in prompt[-1]["content"] else "colour"
        right = reply.strip().rstrip(".").lower() == answer["content"]
        replies.append({"kind": kind, "answer": answer["content"], "reply": reply, "ok": right})
    return Accuracy(
        shape=_mean(r["ok"] for r in replies if r["kind"] == "shape"),
        colour=_mean(r["ok"] for r in replies if r["kind"] == "colour"),
        overall=_mean(r["ok"] for r in replies),
        replies=replies,
    )


def _mean(flags) -> float:
    flags = list(flags)
    return sum(flags) / len(flags) if flags else float("nan")


def checkpoint_curve(
    model_dir: Path, run_dir: Path, data_dir: Path, tokenizer, last_step: int
) -> list[dict]:
    """Held-out accuracy at each checkpoint the run saved (train.save_every) before
    `last_step`: the final adapter, which holds the same weights, is measured anyway."""
    from keel.checkpoint.source import load_checkpoint_weights, read_checkpoint
    from keel.models import load_model

    curve = []
    for step_dir in sorted((run_dir / "checkpoints").glob("step-*")):
        checkpoint = read_checkpoint(step_dir)
        if checkpoint.step >= last_step:
            continue
        base = load_model(model_dir, dtype=torch.float32)
        model = load_checkpoint_weights(base, checkpoint, model_dir, log=lambda _m: None)
        found = evaluate(model, tokenizer, data_dir)
        print(f"step {checkpoint.step}: held-out accuracy {found.overall:.0%}", flush=True)
        curve.append({"step": checkpoint.step, "shape": found.shape, "colour": found.colour})
    return curve


def train(cfg) -> dict:
    from keel.train.run import run_training

    began = time.perf_counter()
    result = run_training(cfg, base_dir=ROOT)
    return {
        "wall": time.perf_counter() - began,
        "steps": result.steps,
        "losses": result.losses,
        "threads": torch.get_num_threads(),  # run_training set it from train.threads
        "precision": result.summary.get("precision", cfg.train.precision),
    }


def plot(trained: dict, curve: list[dict], path: Path) -> None:
    """Training loss per step and held-out accuracy per checkpoint, side by side (PNG)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(9, 3.2))
    steps = range(1, len(trained["losses"]) + 1)
    left.plot(steps, trained["losses"], color="tab:blue")
    left.set(title="training loss", xlabel="step", yscale="log")
    for key, colour in (("shape", "tab:green"), ("colour", "tab:orange")):
        points = [(p["step"], 100 * p[key]) for p in curve]
        right.plot(*zip(*points), marker="o", color=colour, label=f"{key} question")
    right.axhline(100 / 3, color="tab:green", linestyle=":", linewidth=1, label="chance (shape)")
    right.axhline(100 / 6, color="tab:orange", linestyle=":", linewidth=1, label="chance (colour)")
    right.set(title="held-out accuracy (exact word), %", xlabel="step", ylim=(-3, 103))
    right.legend(loc="center right", fontsize="small")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)


def report(before: Accuracy, after: Accuracy, cfg, trained: dict, args) -> str:
    """The README section's body: the command, the run and the before/after table."""
    n = len(after.replies)
    lines = [
        "```",
        "make demo-vision    # = .venv/bin/python benchmarks/vision_demo.py",
        "```",
        "",
        f"Model: SmolLM2-135M-Instruct + a random CLIP tower ({args.size}x{args.size} pixels, "
        f"{args.patch}x{args.patch} patches: {(args.size // args.patch) ** 2} image tokens) + "
        f"a fresh projector. Training: {args.train} pictures, {trained['steps']} steps of "
        f"{cfg.train.micro_batch_size}, {_trained_parts(cfg)}, lr {cfg.train.lr:g}, "
        f"{trained['precision']}, "
        f"{trained['threads']} CPU thread(s): {trained['wall'] / 60:.1f} min of training, "
        f"{trained['demo_wall'] / 60:.1f} min for the whole demo; training loss "
        f"{trained['losses'][0]:.3f} (step 1) -> {trained['losses'][-1]:.3f} (last step).",
        "",
        f"Held-out: {n} questions on pictures never seen in training (another seed); greedy "
        f"replies of at most {MAX_NEW_TOKENS} tokens; right = exactly the expected word.",
        "",
        "| held-out accuracy | chance | before training | after training |",
        "|---|---|---|---|",
        f"| What shape is this? (3 shapes) | 33% | {before.shape:.0%} | {after.shape:.0%} |",
        f"| What colour is the shape? (6 colours) | 17% | {before.colour:.0%} | "
        f"{after.colour:.0%} |",
        f"| all questions | | {before.overall:.0%} | {after.overall:.0%} |",
        "",
        f'Before training the model answers in sentences ("{_first(before)}"); after, in '
        f'the word ("{_first(after)}").',
    ]
    return "\n".join(lines)


def _trained_parts(cfg) -> str:
    """Which parts the run trained, as the config says (e.g. "projector fully, tower frozen,
    LoRA r=8 on the language model")."""
    vision = cfg.model.vision
    parts = [
        "tower " + ("frozen" if vision.freeze_tower else "fully"),
        "projector " + ("frozen" if vision.freeze_projector else "fully"),
    ]
    if cfg.method.uses_lora:
        parts.append(f"LoRA r={cfg.method.lora.r} on the language model")
    else:
        parts.append(f"language model: method {cfg.method.type}")
    return ", ".join(parts)


def _first(found: Accuracy) -> str:
    return " ".join(found.replies[0]["reply"].split()) or "(empty)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="outputs/vision-demo", help="model, data and run")
    parser.add_argument("--train", type=int, default=600, help="training pictures")
    parser.add_argument("--heldout", type=int, default=40, help="held-out pictures")
    parser.add_argument("--size", type=int, default=64, help="picture side, pixels")
    parser.add_argument("--patch", type=int, default=16, help="vision tower patch side")
    parser.add_argument("--plot", help="write the plot here (PNG)")
    add_demo_options(parser, set_example="train.max_steps=20")
    args = parser.parse_args()
    began = time.perf_counter()

    from keel.config import load_config
    from keel.models import load_tokenizer
    from keel.models.adapters import load_for_inference

    out = Path(args.out).expanduser().resolve()
    # the config as given, but with the language model while the assembled one is not built
    cache = load_config(CONFIG, [*args.overrides, f"model.path={LANGUAGE_MODEL}"]).model.cache_dir
    model_dir, data_dir = prepare(out, args, cache)
    run_dir = out / "run"
    placed = [f"model.path={model_dir}", f"data.datasets.0.path={data_dir / 'train.json'}"]
    cfg = fresh_run_config(CONFIG, args.overrides, run_dir, *placed)
    tokenizer = load_tokenizer(model_dir)
    print("answering the held-out questions before training ...", flush=True)
    base = load_for_inference(str(model_dir), None, cache_dir=cfg.model.cache_dir)[0]
    before = evaluate(base, tokenizer, data_dir)
    del base
    trained = train(cfg)
    curve = [{"step": 0, "shape": before.shape, "colour": before.colour}]
    curve += checkpoint_curve(model_dir, run_dir, data_dir, tokenizer, trained["steps"])
    print("answering the held-out questions with the trained adapter ...", flush=True)
    model = load_for_inference(str(model_dir), str(run_dir), cache_dir=cfg.model.cache_dir)[0]
    after = evaluate(model, tokenizer, data_dir)
    curve.append({"step": trained["steps"], "shape": after.shape, "colour": after.colour})
    trained["demo_wall"] = time.perf_counter() - began  # data, model, training, answers
    text = report(before, after, cfg, trained, args)
    print(text)
    results = {"before": before.__dict__, "after": after.__dict__, "curve": curve, **trained}
    (out / "results.json").write_text(json.dumps(results, indent=1), encoding="utf-8")
    if args.plot:
        plot(trained, curve, Path(args.plot))
    if args.readme:
        Path(args.readme).write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
